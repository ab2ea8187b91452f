from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvHeader(_message.Message):
    __slots__ = ("transfer_id", "dtype", "shape", "total_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvReceived(_message.Message):
    __slots__ = ("bytes_received", "ok")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    ok: bool
    def __init__(self, bytes_received: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...
