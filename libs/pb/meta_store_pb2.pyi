from libs.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DocumentKey(_message.Message):
    __slots__ = ("kind", "key")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    key: str
    def __init__(self, kind: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class PutDocumentRequest(_message.Message):
    __slots__ = ("key", "data", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    data: bytes
    ttl_s: float
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., data: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutDocumentReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDocumentReply(_message.Message):
    __slots__ = ("found", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    data: bytes
    def __init__(self, found: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteDocumentReply(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.InstanceInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.InstanceInfo, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("info_only",)
    INFO_ONLY_FIELD_NUMBER: _ClassVar[int]
    info_only: bool
    def __init__(self, info_only: _Optional[bool] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[_common_pb2.InstanceRecord]
    def __init__(self, instances: _Optional[_Iterable[_Union[_common_pb2.InstanceRecord, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("min_update_interval_s",)
    MIN_UPDATE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    min_update_interval_s: float
    def __init__(self, min_update_interval_s: _Optional[float] = ...) -> None: ...

class WatchEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[WatchEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[WatchEvent, _Mapping]]] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("type", "record")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ADDED: _ClassVar[WatchEvent.Type]
        UPDATED: _ClassVar[WatchEvent.Type]
        REMOVED: _ClassVar[WatchEvent.Type]
        SYNCED: _ClassVar[WatchEvent.Type]
    ADDED: WatchEvent.Type
    UPDATED: WatchEvent.Type
    REMOVED: WatchEvent.Type
    SYNCED: WatchEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    type: WatchEvent.Type
    record: _common_pb2.InstanceRecord
    def __init__(self, type: _Optional[_Union[WatchEvent.Type, str]] = ..., record: _Optional[_Union[_common_pb2.InstanceRecord, _Mapping]] = ...) -> None: ...
