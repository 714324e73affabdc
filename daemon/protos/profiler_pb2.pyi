from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileOptions(_message.Message):
    __slots__ = ("version", "include_dataset_ops", "host_tracer_level", "device_tracer_level", "python_tracer_level", "start_timestamp_ns", "duration_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DATASET_OPS_FIELD_NUMBER: _ClassVar[int]
    HOST_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PYTHON_TRACER_LEVEL_FIELD_NUMBER: _ClassVar[int]
    START_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    version: int
    include_dataset_ops: bool
    host_tracer_level: int
    device_tracer_level: int
    python_tracer_level: int
    start_timestamp_ns: int
    duration_ms: int
    def __init__(self, version: _Optional[int] = ..., include_dataset_ops: bool = ..., host_tracer_level: _Optional[int] = ..., device_tracer_level: _Optional[int] = ..., python_tracer_level: _Optional[int] = ..., start_timestamp_ns: _Optional[int] = ..., duration_ms: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("duration_ms", "opts", "repository_root", "session_id", "host_name", "emit_xspace")
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    OPTS_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_ROOT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_NAME_FIELD_NUMBER: _ClassVar[int]
    EMIT_XSPACE_FIELD_NUMBER: _ClassVar[int]
    duration_ms: int
    opts: ProfileOptions
    repository_root: str
    session_id: str
    host_name: str
    emit_xspace: bool
    def __init__(self, duration_ms: _Optional[int] = ..., opts: _Optional[_Union[ProfileOptions, _Mapping]] = ..., repository_root: _Optional[str] = ..., session_id: _Optional[str] = ..., host_name: _Optional[str] = ..., emit_xspace: bool = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("empty_trace", "xspace")
    EMPTY_TRACE_FIELD_NUMBER: _ClassVar[int]
    XSPACE_FIELD_NUMBER: _ClassVar[int]
    empty_trace: bool
    xspace: bytes
    def __init__(self, empty_trace: bool = ..., xspace: _Optional[bytes] = ...) -> None: ...
