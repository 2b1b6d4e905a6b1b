from atmost_client._pb import gate_pb2 as _gate_pb2
from atmost_client._pb import types_pb2 as _types_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreatePermitRequest(_message.Message):
    __slots__ = ("permit",)
    PERMIT_FIELD_NUMBER: _ClassVar[int]
    permit: _types_pb2.Permit
    def __init__(self, permit: _Optional[_Union[_types_pb2.Permit, _Mapping]] = ...) -> None: ...

class GetPermitRequest(_message.Message):
    __slots__ = ("permit_id",)
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    def __init__(self, permit_id: _Optional[str] = ...) -> None: ...

class GetPermitResponse(_message.Message):
    __slots__ = ("permit", "usage", "budget_committed", "budget_reserved", "budget_remaining")
    PERMIT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REMAINING_FIELD_NUMBER: _ClassVar[int]
    permit: _types_pb2.Permit
    usage: _containers.RepeatedCompositeFieldContainer[_types_pb2.Usage]
    budget_committed: int
    budget_reserved: int
    budget_remaining: int
    def __init__(self, permit: _Optional[_Union[_types_pb2.Permit, _Mapping]] = ..., usage: _Optional[_Iterable[_Union[_types_pb2.Usage, _Mapping]]] = ..., budget_committed: _Optional[int] = ..., budget_reserved: _Optional[int] = ..., budget_remaining: _Optional[int] = ...) -> None: ...

class GetAttemptRequest(_message.Message):
    __slots__ = ("permit_id", "idempotency_key")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    idempotency_key: str
    def __init__(self, permit_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class GetAttemptResponse(_message.Message):
    __slots__ = ("attempt",)
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ...) -> None: ...

class RevokePermitRequest(_message.Message):
    __slots__ = ("permit_id",)
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    def __init__(self, permit_id: _Optional[str] = ...) -> None: ...

class ListUncertainRequest(_message.Message):
    __slots__ = ("permit_id", "page_size", "page_token")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    page_size: int
    page_token: str
    def __init__(self, permit_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListUncertainResponse(_message.Message):
    __slots__ = ("attempts", "next_page_token")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    attempts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Attempt]
    next_page_token: str
    def __init__(self, attempts: _Optional[_Iterable[_Union[_types_pb2.Attempt, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("permit_id", "idempotency_key", "succeeded", "failed", "not_sent", "attempt_id")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    idempotency_key: str
    succeeded: _gate_pb2.Succeeded
    failed: _gate_pb2.Failed
    not_sent: _gate_pb2.NotSent
    attempt_id: str
    def __init__(self, permit_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., succeeded: _Optional[_Union[_gate_pb2.Succeeded, _Mapping]] = ..., failed: _Optional[_Union[_gate_pb2.Failed, _Mapping]] = ..., not_sent: _Optional[_Union[_gate_pb2.NotSent, _Mapping]] = ..., attempt_id: _Optional[str] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("attempt", "usage")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    usage: _types_pb2.Usage
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ...) -> None: ...
