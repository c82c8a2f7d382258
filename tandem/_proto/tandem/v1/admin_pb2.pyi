from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdminWorker(_message.Message):
    __slots__ = ("name", "address", "role", "up", "draining", "mark", "mark_reason", "metrics_port", "inflight", "routable", "last_error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    MARK_REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    role: str
    up: bool
    draining: bool
    mark: str
    mark_reason: str
    metrics_port: int
    inflight: int
    routable: bool
    last_error: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., up: _Optional[bool] = ..., draining: _Optional[bool] = ..., mark: _Optional[str] = ..., mark_reason: _Optional[str] = ..., metrics_port: _Optional[int] = ..., inflight: _Optional[int] = ..., routable: _Optional[bool] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[AdminWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[AdminWorker, _Mapping]]] = ...) -> None: ...

class WorkerMarkRequest(_message.Message):
    __slots__ = ("worker", "reason")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker: str
    reason: str
    def __init__(self, worker: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerMarkResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: AdminWorker
    def __init__(self, worker: _Optional[_Union[AdminWorker, _Mapping]] = ...) -> None: ...
