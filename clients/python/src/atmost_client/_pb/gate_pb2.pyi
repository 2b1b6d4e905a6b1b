import datetime

from atmost_client._pb import types_pb2 as _types_pb2
from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Decision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECISION_UNSPECIFIED: _ClassVar[Decision]
    DECISION_DISPATCH: _ClassVar[Decision]
    DECISION_REPLAY: _ClassVar[Decision]
    DECISION_AWAIT_APPROVAL: _ClassVar[Decision]
DECISION_UNSPECIFIED: Decision
DECISION_DISPATCH: Decision
DECISION_REPLAY: Decision
DECISION_AWAIT_APPROVAL: Decision

class AuthorizeRequest(_message.Message):
    __slots__ = ("permit_id", "tool", "idempotency_key", "request_fingerprint", "cost", "holder_token", "approval_summary", "wait")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    HOLDER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    tool: str
    idempotency_key: str
    request_fingerprint: bytes
    cost: int
    holder_token: bytes
    approval_summary: str
    wait: _duration_pb2.Duration
    def __init__(self, permit_id: _Optional[str] = ..., tool: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., request_fingerprint: _Optional[bytes] = ..., cost: _Optional[int] = ..., holder_token: _Optional[bytes] = ..., approval_summary: _Optional[str] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AuthorizeResponse(_message.Message):
    __slots__ = ("decision", "attempt", "usage", "duplicate_of", "redelivered", "lease_remaining", "approval_remaining")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_OF_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_REMAINING_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    attempt: _types_pb2.Attempt
    usage: _types_pb2.Usage
    duplicate_of: str
    redelivered: bool
    lease_remaining: _duration_pb2.Duration
    approval_remaining: _duration_pb2.Duration
    def __init__(self, decision: _Optional[_Union[Decision, str]] = ..., attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., duplicate_of: _Optional[str] = ..., redelivered: bool = ..., lease_remaining: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., approval_remaining: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("permit_id", "idempotency_key", "attempt_id", "succeeded", "failed", "not_sent")
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    idempotency_key: str
    attempt_id: str
    succeeded: Succeeded
    failed: Failed
    not_sent: NotSent
    def __init__(self, permit_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., attempt_id: _Optional[str] = ..., succeeded: _Optional[_Union[Succeeded, _Mapping]] = ..., failed: _Optional[_Union[Failed, _Mapping]] = ..., not_sent: _Optional[_Union[NotSent, _Mapping]] = ...) -> None: ...

class Succeeded(_message.Message):
    __slots__ = ("result", "actual_cost")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_COST_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    actual_cost: int
    def __init__(self, result: _Optional[bytes] = ..., actual_cost: _Optional[int] = ...) -> None: ...

class Failed(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class NotSent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("attempt", "usage")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    usage: _types_pb2.Usage
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ...) -> None: ...

class MarkUncertainRequest(_message.Message):
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

class MarkUncertainResponse(_message.Message):
    __slots__ = ("attempt",)
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    attempt: _types_pb2.Attempt
    def __init__(self, attempt: _Optional[_Union[_types_pb2.Attempt, _Mapping]] = ...) -> None: ...
