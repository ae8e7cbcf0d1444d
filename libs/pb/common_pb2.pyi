from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_HIGH: _ClassVar[Priority]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_MIXED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
PRIORITY_NORMAL: Priority
PRIORITY_HIGH: Priority
ROLE_MIXED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "has_seed", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "min_tokens", "has_logprobs", "logprobs", "has_prompt_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "has_repetition_penalty", "repetition_penalty", "min_p", "logit_bias", "allowed_token_ids", "bad_words", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    has_seed: bool
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    has_logprobs: bool
    logprobs: int
    has_prompt_logprobs: bool
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    has_repetition_penalty: bool
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    grammar: Grammar
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., has_logprobs: _Optional[bool] = ..., logprobs: _Optional[int] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_repetition_penalty: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec", "strict", "compact")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    strict: bool
    compact: bool
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., strict: _Optional[bool] = ..., compact: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "none")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    none: bool
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., none: _Optional[bool] = ...) -> None: ...

class RequestLoad(_message.Message):
    __slots__ = ("request_id", "priority", "state", "physical_blocks", "num_tokens", "virtual_usage")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WAITING: _ClassVar[RequestLoad.State]
        RUNNING: _ClassVar[RequestLoad.State]
        MIGRATING: _ClassVar[RequestLoad.State]
    WAITING: RequestLoad.State
    RUNNING: RequestLoad.State
    MIGRATING: RequestLoad.State
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    priority: Priority
    state: RequestLoad.State
    physical_blocks: int
    num_tokens: int
    virtual_usage: float
    def __init__(self, request_id: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., state: _Optional[_Union[RequestLoad.State, str]] = ..., physical_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., virtual_usage: _Optional[float] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "seq", "timestamp", "total_blocks", "free_blocks", "block_size", "num_running", "num_waiting", "head_of_line_demand_blocks", "virtual_usage", "freeness", "normal_freeness", "terminating", "num_preemptions", "migrating_in", "migrating_out", "requests", "used_blocks", "waiting_demand_blocks", "engine_steps", "role", "unschedulable", "prefix_cache", "shared_blocks", "running_prefill_tokens", "preempted_waiting", "kept_blocks")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    HEAD_OF_LINE_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    FREENESS_FIELD_NUMBER: _ClassVar[int]
    NORMAL_FREENESS_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATING_IN_FIELD_NUMBER: _ClassVar[int]
    MIGRATING_OUT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    UNSCHEDULABLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_WAITING_FIELD_NUMBER: _ClassVar[int]
    KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    timestamp: float
    total_blocks: int
    free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    head_of_line_demand_blocks: int
    virtual_usage: float
    freeness: float
    normal_freeness: float
    terminating: bool
    num_preemptions: int
    migrating_in: int
    migrating_out: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestLoad]
    used_blocks: int
    waiting_demand_blocks: int
    engine_steps: int
    role: Role
    unschedulable: bool
    prefix_cache: PrefixCacheStats
    shared_blocks: int
    running_prefill_tokens: int
    preempted_waiting: int
    kept_blocks: int
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., head_of_line_demand_blocks: _Optional[int] = ..., virtual_usage: _Optional[float] = ..., freeness: _Optional[float] = ..., normal_freeness: _Optional[float] = ..., terminating: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., migrating_in: _Optional[int] = ..., migrating_out: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestLoad, _Mapping]]] = ..., used_blocks: _Optional[int] = ..., waiting_demand_blocks: _Optional[int] = ..., engine_steps: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., unschedulable: _Optional[bool] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., shared_blocks: _Optional[int] = ..., running_prefill_tokens: _Optional[int] = ..., preempted_waiting: _Optional[int] = ..., kept_blocks: _Optional[int] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("enabled", "requests", "queries", "hits", "evictions", "cached_blocks", "evictable_blocks", "preempted_queries", "preempted_hits")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_HITS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    requests: int
    queries: int
    hits: int
    evictions: int
    cached_blocks: int
    evictable_blocks: int
    preempted_queries: int
    preempted_hits: int
    def __init__(self, enabled: _Optional[bool] = ..., requests: _Optional[int] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., evictable_blocks: _Optional[int] = ..., preempted_queries: _Optional[int] = ..., preempted_hits: _Optional[int] = ...) -> None: ...

class KvBlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent: _Optional[int] = ...) -> None: ...

class KvBlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvAllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KvBlockStored
    removed: KvBlockRemoved
    cleared: KvAllCleared
    def __init__(self, stored: _Optional[_Union[KvBlockStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvAllCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("instance_id", "seq", "events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("hash", "parent")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    hash: int
    parent: int
    def __init__(self, hash: _Optional[int] = ..., parent: _Optional[int] = ...) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("instance_id", "seq", "blocks")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    seq: int
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "address", "engine", "model", "block_size", "total_blocks", "max_model_len", "started_at_ms", "vocab_size", "no_migration")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NO_MIGRATION_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    engine: str
    model: str
    block_size: int
    total_blocks: int
    max_model_len: int
    started_at_ms: int
    vocab_size: int
    no_migration: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., started_at_ms: _Optional[int] = ..., vocab_size: _Optional[int] = ..., no_migration: _Optional[str] = ...) -> None: ...

class InstanceRecord(_message.Message):
    __slots__ = ("info", "status", "last_seen")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    info: InstanceInfo
    status: InstanceStatus
    last_seen: float
    def __init__(self, info: _Optional[_Union[InstanceInfo, _Mapping]] = ..., status: _Optional[_Union[InstanceStatus, _Mapping]] = ..., last_seen: _Optional[float] = ...) -> None: ...
