from libs.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DispatchRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "priority", "exclude_instance_ids", "block_hashes", "block_size", "affinity_instance_id", "traceparent", "program_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    priority: _common_pb2.Priority
    exclude_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    affinity_instance_id: str
    traceparent: str
    program_id: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., exclude_instance_ids: _Optional[_Iterable[str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., affinity_instance_id: _Optional[str] = ..., traceparent: _Optional[str] = ..., program_id: _Optional[str] = ...) -> None: ...

class DispatchReply(_message.Message):
    __slots__ = ("instance_id", "address", "policy", "run_priority", "decode_instance_id", "decode_address", "request_id", "error_code", "error_message")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RUN_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    address: str
    policy: str
    run_priority: _common_pb2.Priority
    decode_instance_id: str
    decode_address: str
    request_id: str
    error_code: str
    error_message: str
    def __init__(self, instance_id: _Optional[str] = ..., address: _Optional[str] = ..., policy: _Optional[str] = ..., run_priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., decode_instance_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., request_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class ClusterViewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterViewReply(_message.Message):
    __slots__ = ("instances", "dispatch_policy", "migrations_ordered")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_POLICY_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_ORDERED_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[_common_pb2.InstanceRecord]
    dispatch_policy: str
    migrations_ordered: int
    def __init__(self, instances: _Optional[_Iterable[_Union[_common_pb2.InstanceRecord, _Mapping]]] = ..., dispatch_policy: _Optional[str] = ..., migrations_ordered: _Optional[int] = ...) -> None: ...

class SetTerminatingRequest(_message.Message):
    __slots__ = ("instance_id", "terminating")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    terminating: bool
    def __init__(self, instance_id: _Optional[str] = ..., terminating: _Optional[bool] = ...) -> None: ...

class SetTerminatingReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class SetInstanceRoleRequest(_message.Message):
    __slots__ = ("instance_id", "role")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ...) -> None: ...

class SetInstanceRoleReply(_message.Message):
    __slots__ = ("previous", "draining")
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    previous: _common_pb2.Role
    draining: int
    def __init__(self, previous: _Optional[_Union[_common_pb2.Role, str]] = ..., draining: _Optional[int] = ...) -> None: ...

class PrefixIndexRequest(_message.Message):
    __slots__ = ("with_hashes",)
    WITH_HASHES_FIELD_NUMBER: _ClassVar[int]
    with_hashes: bool
    def __init__(self, with_hashes: _Optional[bool] = ...) -> None: ...

class PrefixIndexReply(_message.Message):
    __slots__ = ("instances", "num_entries")
    class Instance(_message.Message):
        __slots__ = ("instance_id", "seq", "synced", "num_blocks", "block_hashes")
        INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
        SEQ_FIELD_NUMBER: _ClassVar[int]
        SYNCED_FIELD_NUMBER: _ClassVar[int]
        NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
        instance_id: str
        seq: int
        synced: bool
        num_blocks: int
        block_hashes: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., synced: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[PrefixIndexReply.Instance]
    num_entries: int
    def __init__(self, instances: _Optional[_Iterable[_Union[PrefixIndexReply.Instance, _Mapping]]] = ..., num_entries: _Optional[int] = ...) -> None: ...
