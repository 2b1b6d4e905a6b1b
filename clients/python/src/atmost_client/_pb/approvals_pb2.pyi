from atmost_client._pb import types_pb2 as _types_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListApprovalsRequest(_message.Message):
    __slots__ = ("permit_id", "page_size", "page_token")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    page_size: int
    page_token: str
    def __init__(self, permit_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListApprovalsResponse(_message.Message):
    __slots__ = ("attempts", "next_page_token")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    attempts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Attempt]
    next_page_token: str
    def __init__(self, attempts: _Optional[_Iterable[_Union[_types_pb2.Attempt, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ApproveRequest(_message.Message):
    __slots__ = ("permit_id", "idempotency_key", "attempt_id")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    idempotency_key: str
    attempt_id: str
    def __init__(self, permit_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class ApproveResponse(_message.Message):
    __slots__ = ("attempt",)
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ...) -> None: ...

class DenyRequest(_message.Message):
    __slots__ = ("permit_id", "idempotency_key", "attempt_id", "reason")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    idempotency_key: str
    attempt_id: str
    reason: str
    def __init__(self, permit_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., attempt_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DenyResponse(_message.Message):
    __slots__ = ("attempt", "usage")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    usage: _types_pb2.Usage
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ...) -> None: ...
