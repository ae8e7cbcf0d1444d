from libs.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class DropLayersRequest(_message.Message):
    __slots__ = ("layers", "hold", "prepare")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    layers: LayerRange
    hold: bool
    prepare: bool
    def __init__(self, layers: _Optional[_Union[LayerRange, _Mapping]] = ..., hold: _Optional[bool] = ..., prepare: _Optional[bool] = ...) -> None: ...

class DropLayersReply(_message.Message):
    __slots__ = ("blocks_added", "total_blocks")
    BLOCKS_ADDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks_added: int
    total_blocks: int
    def __init__(self, blocks_added: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class PipelinePeer(_message.Message):
    __slots__ = ("layers", "address")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    layers: LayerRange
    address: str
    def __init__(self, layers: _Optional[_Union[LayerRange, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class SetPipelineRequest(_message.Message):
    __slots__ = ("own", "peers", "pause_exchange", "hold")
    OWN_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    own: LayerRange
    peers: _containers.RepeatedCompositeFieldContainer[PipelinePeer]
    pause_exchange: bool
    hold: bool
    def __init__(self, own: _Optional[_Union[LayerRange, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PipelinePeer, _Mapping]]] = ..., pause_exchange: _Optional[bool] = ..., hold: _Optional[bool] = ...) -> None: ...

class SetPipelineReply(_message.Message):
    __slots__ = ("requests_moved",)
    REQUESTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    requests_moved: int
    def __init__(self, requests_moved: _Optional[int] = ...) -> None: ...

class RestoreLayersRequest(_message.Message):
    __slots__ = ("layers", "from_address")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    FROM_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    layers: LayerRange
    from_address: str
    def __init__(self, layers: _Optional[_Union[LayerRange, _Mapping]] = ..., from_address: _Optional[str] = ...) -> None: ...

class RestoreLayersReply(_message.Message):
    __slots__ = ("blocks_returned", "total_blocks")
    BLOCKS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks_returned: int
    total_blocks: int
    def __init__(self, blocks_returned: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class LayerTensor(_message.Message):
    __slots__ = ("layer", "name", "dtype", "shape", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GuestChunk(_message.Message):
    __slots__ = ("request_id", "start", "num_new", "kv_at_owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_FIELD_NUMBER: _ClassVar[int]
    KV_AT_OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: int
    num_new: int
    kv_at_owner: bool
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[int] = ..., num_new: _Optional[int] = ..., kv_at_owner: _Optional[bool] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("layer", "rows", "dtype", "q", "k", "v", "head_dim")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    rows: int
    dtype: str
    q: bytes
    k: bytes
    v: bytes
    head_dim: int
    def __init__(self, layer: _Optional[int] = ..., rows: _Optional[int] = ..., dtype: _Optional[str] = ..., q: _Optional[bytes] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., head_dim: _Optional[int] = ...) -> None: ...

class LayerStep(_message.Message):
    __slots__ = ("layers", "chunks", "hidden", "dtype", "hidden_size", "release", "push_kv", "fetch_kv", "kv_tokens", "kv", "attended", "attend_error")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PUSH_KV_FIELD_NUMBER: _ClassVar[int]
    FETCH_KV_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    ATTENDED_FIELD_NUMBER: _ClassVar[int]
    ATTEND_ERROR_FIELD_NUMBER: _ClassVar[int]
    layers: LayerRange
    chunks: _containers.RepeatedCompositeFieldContainer[GuestChunk]
    hidden: bytes
    dtype: str
    hidden_size: int
    release: _containers.RepeatedScalarFieldContainer[str]
    push_kv: str
    fetch_kv: str
    kv_tokens: int
    kv: bytes
    attended: bytes
    attend_error: str
    def __init__(self, layers: _Optional[_Union[LayerRange, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[GuestChunk, _Mapping]]] = ..., hidden: _Optional[bytes] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., release: _Optional[_Iterable[str]] = ..., push_kv: _Optional[str] = ..., fetch_kv: _Optional[str] = ..., kv_tokens: _Optional[int] = ..., kv: _Optional[bytes] = ..., attended: _Optional[bytes] = ..., attend_error: _Optional[str] = ...) -> None: ...

class LayerStepReply(_message.Message):
    __slots__ = ("hidden", "error", "kv", "short", "attend")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    SHORT_FIELD_NUMBER: _ClassVar[int]
    ATTEND_FIELD_NUMBER: _ClassVar[int]
    hidden: bytes
    error: str
    kv: bytes
    short: bool
    attend: AttendRequest
    def __init__(self, hidden: _Optional[bytes] = ..., error: _Optional[str] = ..., kv: _Optional[bytes] = ..., short: _Optional[bool] = ..., attend: _Optional[_Union[AttendRequest, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "resume_token_ids", "frontend_address", "flush_interval_ms", "handoff", "program_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: _common_pb2.Priority
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    frontend_address: str
    flush_interval_ms: int
    handoff: Handoff
    program_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., frontend_address: _Optional[str] = ..., flush_interval_ms: _Optional[int] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., program_id: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("instance_id", "address")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class MovedTo(_message.Message):
    __slots__ = ("instance_id", "address", "next_index")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_INDEX_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    next_index: int
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., next_index: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("index", "token_ids", "finish_reason", "moved", "num_prompt_tokens", "num_preemptions", "preemption_loss_ms", "num_migrations", "error_code", "error_message", "logprobs", "prompt_logprobs", "num_cached_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_LOSS_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    moved: MovedTo
    num_prompt_tokens: int
    num_preemptions: int
    preemption_loss_ms: float
    num_migrations: int
    error_code: str
    error_message: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_cached_tokens: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., moved: _Optional[_Union[MovedTo, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., preemption_loss_ms: _Optional[float] = ..., num_migrations: _Optional[int] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("request_id", "from_index", "flush_interval_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    FLUSH_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_index: int
    flush_interval_ms: int
    def __init__(self, request_id: _Optional[str] = ..., from_index: _Optional[int] = ..., flush_interval_ms: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetInstanceTerminatingRequest(_message.Message):
    __slots__ = ("terminating",)
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    terminating: bool
    def __init__(self, terminating: _Optional[bool] = ...) -> None: ...

class SetInstanceTerminatingReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_to")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TO_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    drain_to: _containers.RepeatedCompositeFieldContainer[Handoff]
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., drain_to: _Optional[_Iterable[_Union[Handoff, _Mapping]]] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("previous", "draining")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    previous: _common_pb2.Role
    draining: int
    def __init__(self, previous: _Optional[_Union[_common_pb2.Role, str]] = ..., draining: _Optional[int] = ...) -> None: ...

class CheckIntegrityRequest(_message.Message):
    __slots__ = ("with_cached_hashes",)
    WITH_CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    with_cached_hashes: bool
    def __init__(self, with_cached_hashes: _Optional[bool] = ...) -> None: ...

class CheckIntegrityReply(_message.Message):
    __slots__ = ("ok", "error", "free_blocks", "total_blocks", "num_requests", "num_reservations", "cached_block_hashes")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    free_blocks: int
    total_blocks: int
    num_requests: int
    num_reservations: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_reservations: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventsMessage(_message.Message):
    __slots__ = ("snapshot", "batch")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    snapshot: _common_pb2.KvSnapshot
    batch: _common_pb2.KvEventBatch
    def __init__(self, snapshot: _Optional[_Union[_common_pb2.KvSnapshot, _Mapping]] = ..., batch: _Optional[_Union[_common_pb2.KvEventBatch, _Mapping]] = ...) -> None: ...

class MigrateOutRequest(_message.Message):
    __slots__ = ("dest_instance_id", "dest_address", "stop_when_freeness_above", "max_requests", "request_id", "use_priorities", "blocking", "linkable_blocks", "pick", "cache_blocks")
    class LinkableBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DEST_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DEST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STOP_WHEN_FREENESS_ABOVE_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USE_PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    BLOCKING_FIELD_NUMBER: _ClassVar[int]
    LINKABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    dest_instance_id: str
    dest_address: str
    stop_when_freeness_above: float
    max_requests: int
    request_id: str
    use_priorities: bool
    blocking: bool
    linkable_blocks: _containers.ScalarMap[str, int]
    pick: str
    cache_blocks: int
    def __init__(self, dest_instance_id: _Optional[str] = ..., dest_address: _Optional[str] = ..., stop_when_freeness_above: _Optional[float] = ..., max_requests: _Optional[int] = ..., request_id: _Optional[str] = ..., use_priorities: _Optional[bool] = ..., blocking: _Optional[bool] = ..., linkable_blocks: _Optional[_Mapping[str, int]] = ..., pick: _Optional[str] = ..., cache_blocks: _Optional[int] = ...) -> None: ...

class MigrateOutReply(_message.Message):
    __slots__ = ("started", "committed", "aborted", "results")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    started: int
    committed: int
    aborted: int
    results: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    def __init__(self, started: _Optional[int] = ..., committed: _Optional[int] = ..., aborted: _Optional[int] = ..., results: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ...) -> None: ...

class MigrationResult(_message.Message):
    __slots__ = ("migration_id", "request_id", "outcome", "reason", "stages", "blocks", "bytes", "duration_ms", "downtime_ms", "commit_ack_ms", "suspended_at", "kv_shared", "linked_blocks")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ACK_MS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_SHARED_FIELD_NUMBER: _ClassVar[int]
    LINKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    outcome: str
    reason: str
    stages: int
    blocks: int
    bytes: int
    duration_ms: float
    downtime_ms: float
    commit_ack_ms: float
    suspended_at: float
    kv_shared: bool
    linked_blocks: int
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., stages: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., duration_ms: _Optional[float] = ..., downtime_ms: _Optional[float] = ..., commit_ack_ms: _Optional[float] = ..., suspended_at: _Optional[float] = ..., kv_shared: _Optional[bool] = ..., linked_blocks: _Optional[int] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "k_transposed")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    K_TRANSPOSED_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_transposed: bool
    def __init__(self, dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., k_transposed: _Optional[bool] = ...) -> None: ...

class PreAllocateRequest(_message.Message):
    __slots__ = ("migration_id", "request_id", "num_blocks", "stage", "header", "deadline_ms", "source_instance_id", "spare_blocks", "handoff", "last", "kv_share", "block_hashes", "link_cached", "program_id")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SPARE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    KV_SHARE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LINK_CACHED_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    num_blocks: int
    stage: int
    header: KvHeader
    deadline_ms: int
    source_instance_id: str
    spare_blocks: int
    handoff: bool
    last: bool
    kv_share: KvShare
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    link_cached: bool
    program_id: str
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., stage: _Optional[int] = ..., header: _Optional[_Union[KvHeader, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., source_instance_id: _Optional[str] = ..., spare_blocks: _Optional[int] = ..., handoff: _Optional[bool] = ..., last: _Optional[bool] = ..., kv_share: _Optional[_Union[KvShare, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., link_cached: _Optional[bool] = ..., program_id: _Optional[str] = ...) -> None: ...

class KvShare(_message.Message):
    __slots__ = ("pid", "fd", "name", "size")
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    fd: int
    name: str
    size: int
    def __init__(self, pid: _Optional[int] = ..., fd: _Optional[int] = ..., name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class PreAllocateReply(_message.Message):
    __slots__ = ("accepted", "reason", "kv_shared", "held_block_hashes", "linked_blocks")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_SHARED_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LINKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    kv_shared: bool
    held_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    linked_blocks: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., kv_shared: _Optional[bool] = ..., held_block_hashes: _Optional[_Iterable[int]] = ..., linked_blocks: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("migration_id", "stage", "header", "num_blocks", "offset", "data", "total_bytes", "layer", "src_blocks")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    stage: int
    header: KvHeader
    num_blocks: int
    offset: int
    data: bytes
    total_bytes: int
    layer: int
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, migration_id: _Optional[str] = ..., stage: _Optional[int] = ..., header: _Optional[_Union[KvHeader, _Mapping]] = ..., num_blocks: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., layer: _Optional[int] = ..., src_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferKvReply(_message.Message):
    __slots__ = ("blocks_written", "bytes")
    BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks_written: int
    bytes: int
    def __init__(self, blocks_written: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "rng_state", "arrival_time", "first_token_time", "num_preemptions", "priority", "frontend_address", "preemption_loss_ms", "num_migrations", "num_computed_tokens", "next_event_index", "program_id", "cached_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_LOSS_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_EVENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    rng_state: bytes
    arrival_time: float
    first_token_time: float
    num_preemptions: int
    priority: _common_pb2.Priority
    frontend_address: str
    preemption_loss_ms: float
    num_migrations: int
    num_computed_tokens: int
    next_event_index: int
    program_id: str
    cached_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., rng_state: _Optional[bytes] = ..., arrival_time: _Optional[float] = ..., first_token_time: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., frontend_address: _Optional[str] = ..., preemption_loss_ms: _Optional[float] = ..., num_migrations: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., next_event_index: _Optional[int] = ..., program_id: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("migration_id", "state", "has_last_stage", "last_stage", "last_src_blocks", "program_cache")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_LAST_STAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_STAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_CACHE_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    state: RequestState
    has_last_stage: bool
    last_stage: int
    last_src_blocks: _containers.RepeatedScalarFieldContainer[int]
    program_cache: ProgramCache
    def __init__(self, migration_id: _Optional[str] = ..., state: _Optional[_Union[RequestState, _Mapping]] = ..., has_last_stage: _Optional[bool] = ..., last_stage: _Optional[int] = ..., last_src_blocks: _Optional[_Iterable[int]] = ..., program_cache: _Optional[_Union[ProgramCache, _Mapping]] = ...) -> None: ...

class ProgramCache(_message.Message):
    __slots__ = ("program_id", "block_hashes", "age_s", "gap_s")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    GAP_S_FIELD_NUMBER: _ClassVar[int]
    program_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    age_s: float
    gap_s: float
    def __init__(self, program_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., age_s: _Optional[float] = ..., gap_s: _Optional[float] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("ok", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ExpectCommitRequest(_message.Message):
    __slots__ = ("migration_id", "in_ms")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    IN_MS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    in_ms: float
    def __init__(self, migration_id: _Optional[str] = ..., in_ms: _Optional[float] = ...) -> None: ...

class ExpectCommitReply(_message.Message):
    __slots__ = ("expected",)
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    expected: bool
    def __init__(self, expected: _Optional[bool] = ...) -> None: ...

class AbortMigrationRequest(_message.Message):
    __slots__ = ("migration_id", "reason")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    reason: str
    def __init__(self, migration_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortMigrationReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class MigrationSettledRequest(_message.Message):
    __slots__ = ("migration_id", "wait_ms")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    wait_ms: int
    def __init__(self, migration_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class MigrationSettledReply(_message.Message):
    __slots__ = ("stepped", "after_commit_ms")
    STEPPED_FIELD_NUMBER: _ClassVar[int]
    AFTER_COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    stepped: bool
    after_commit_ms: float
    def __init__(self, stepped: _Optional[bool] = ..., after_commit_ms: _Optional[float] = ...) -> None: ...
