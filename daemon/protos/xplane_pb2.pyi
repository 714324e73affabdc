from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class XSpace(_message.Message):
    __slots__ = ("planes", "hostnames")
    PLANES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAMES_FIELD_NUMBER: _ClassVar[int]
    planes: _containers.RepeatedCompositeFieldContainer[XPlane]
    hostnames: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, planes: _Optional[_Iterable[_Union[XPlane, _Mapping]]] = ..., hostnames: _Optional[_Iterable[str]] = ...) -> None: ...

class XPlane(_message.Message):
    __slots__ = ("name", "lines")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    name: str
    lines: _containers.RepeatedCompositeFieldContainer[XLine]
    def __init__(self, name: _Optional[str] = ..., lines: _Optional[_Iterable[_Union[XLine, _Mapping]]] = ...) -> None: ...

class XLine(_message.Message):
    __slots__ = ("name", "events")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    events: _containers.RepeatedCompositeFieldContainer[XEvent]
    def __init__(self, name: _Optional[str] = ..., events: _Optional[_Iterable[_Union[XEvent, _Mapping]]] = ...) -> None: ...

class XEvent(_message.Message):
    __slots__ = ("metadata_id",)
    METADATA_ID_FIELD_NUMBER: _ClassVar[int]
    metadata_id: int
    def __init__(self, metadata_id: _Optional[int] = ...) -> None: ...
