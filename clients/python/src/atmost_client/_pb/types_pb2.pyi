import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UncertainPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNCERTAIN_POLICY_UNSPECIFIED: _ClassVar[UncertainPolicy]
    UNCERTAIN_POLICY_COUNT: _ClassVar[UncertainPolicy]
    UNCERTAIN_POLICY_HOLD_TOOL: _ClassVar[UncertainPolicy]

class PermitStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PERMIT_STATUS_UNSPECIFIED: _ClassVar[PermitStatus]
    PERMIT_STATUS_ACTIVE: _ClassVar[PermitStatus]
    PERMIT_STATUS_REVOKED: _ClassVar[PermitStatus]

class DuplicateGuardMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DUPLICATE_GUARD_MODE_UNSPECIFIED: _ClassVar[DuplicateGuardMode]
    DUPLICATE_GUARD_MODE_OFF: _ClassVar[DuplicateGuardMode]
    DUPLICATE_GUARD_MODE_LOG: _ClassVar[DuplicateGuardMode]
    DUPLICATE_GUARD_MODE_ENFORCE: _ClassVar[DuplicateGuardMode]

class AttemptState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTEMPT_STATE_UNSPECIFIED: _ClassVar[AttemptState]
    ATTEMPT_STATE_RESERVED: _ClassVar[AttemptState]
    ATTEMPT_STATE_SUCCEEDED: _ClassVar[AttemptState]
    ATTEMPT_STATE_FAILED: _ClassVar[AttemptState]
    ATTEMPT_STATE_UNCERTAIN: _ClassVar[AttemptState]
    ATTEMPT_STATE_RELEASED: _ClassVar[AttemptState]
    ATTEMPT_STATE_AWAITING_APPROVAL: _ClassVar[AttemptState]
    ATTEMPT_STATE_DENIED: _ClassVar[AttemptState]
    ATTEMPT_STATE_APPROVED: _ClassVar[AttemptState]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    PERMIT_NOT_FOUND: _ClassVar[ErrorReason]
    PERMIT_REVOKED: _ClassVar[ErrorReason]
    PERMIT_EXPIRED: _ClassVar[ErrorReason]
    TOOL_NOT_IN_SCOPE: _ClassVar[ErrorReason]
    PERMIT_MAX_CALLS_EXCEEDED: _ClassVar[ErrorReason]
    PERMIT_BUDGET_EXCEEDED: _ClassVar[ErrorReason]
    IDEMPOTENCY_KEY_REUSED: _ClassVar[ErrorReason]
    IDEMPOTENCY_IN_PROGRESS: _ClassVar[ErrorReason]
    DUPLICATE_REQUEST_SUSPECTED: _ClassVar[ErrorReason]
    ATTEMPT_NOT_FOUND: _ClassVar[ErrorReason]
    ATTEMPT_MISMATCH: _ClassVar[ErrorReason]
    ATTEMPT_STATE_CONFLICT: _ClassVar[ErrorReason]
    INVALID_REQUEST: _ClassVar[ErrorReason]
    STORE_UNAVAILABLE: _ClassVar[ErrorReason]
    OVERLOADED: _ClassVar[ErrorReason]
    DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    TOOL_HELD_UNCERTAIN: _ClassVar[ErrorReason]
    UNAUTHENTICATED: _ClassVar[ErrorReason]
    ROLE_NOT_ALLOWED: _ClassVar[ErrorReason]
    QUOTA_PERMIT_LIFETIME: _ClassVar[ErrorReason]
    QUOTA_OPEN_ATTEMPTS: _ClassVar[ErrorReason]
    QUOTA_ATTEMPTS: _ClassVar[ErrorReason]
    QUOTA_TENANT_PERMITS: _ClassVar[ErrorReason]
    QUOTA_STORE_FULL: _ClassVar[ErrorReason]
    MESSAGE_TOO_LARGE: _ClassVar[ErrorReason]
    ATTEMPT_HOLDER_MISMATCH: _ClassVar[ErrorReason]
    APPROVER_IS_REQUESTER: _ClassVar[ErrorReason]
UNCERTAIN_POLICY_UNSPECIFIED: UncertainPolicy
UNCERTAIN_POLICY_COUNT: UncertainPolicy
UNCERTAIN_POLICY_HOLD_TOOL: UncertainPolicy
PERMIT_STATUS_UNSPECIFIED: PermitStatus
PERMIT_STATUS_ACTIVE: PermitStatus
PERMIT_STATUS_REVOKED: PermitStatus
DUPLICATE_GUARD_MODE_UNSPECIFIED: DuplicateGuardMode
DUPLICATE_GUARD_MODE_OFF: DuplicateGuardMode
DUPLICATE_GUARD_MODE_LOG: DuplicateGuardMode
DUPLICATE_GUARD_MODE_ENFORCE: DuplicateGuardMode
ATTEMPT_STATE_UNSPECIFIED: AttemptState
ATTEMPT_STATE_RESERVED: AttemptState
ATTEMPT_STATE_SUCCEEDED: AttemptState
ATTEMPT_STATE_FAILED: AttemptState
ATTEMPT_STATE_UNCERTAIN: AttemptState
ATTEMPT_STATE_RELEASED: AttemptState
ATTEMPT_STATE_AWAITING_APPROVAL: AttemptState
ATTEMPT_STATE_DENIED: AttemptState
ATTEMPT_STATE_APPROVED: AttemptState
ERROR_REASON_UNSPECIFIED: ErrorReason
PERMIT_NOT_FOUND: ErrorReason
PERMIT_REVOKED: ErrorReason
PERMIT_EXPIRED: ErrorReason
TOOL_NOT_IN_SCOPE: ErrorReason
PERMIT_MAX_CALLS_EXCEEDED: ErrorReason
PERMIT_BUDGET_EXCEEDED: ErrorReason
IDEMPOTENCY_KEY_REUSED: ErrorReason
IDEMPOTENCY_IN_PROGRESS: ErrorReason
DUPLICATE_REQUEST_SUSPECTED: ErrorReason
ATTEMPT_NOT_FOUND: ErrorReason
ATTEMPT_MISMATCH: ErrorReason
ATTEMPT_STATE_CONFLICT: ErrorReason
INVALID_REQUEST: ErrorReason
STORE_UNAVAILABLE: ErrorReason
OVERLOADED: ErrorReason
DEADLINE_EXCEEDED: ErrorReason
TOOL_HELD_UNCERTAIN: ErrorReason
UNAUTHENTICATED: ErrorReason
ROLE_NOT_ALLOWED: ErrorReason
QUOTA_PERMIT_LIFETIME: ErrorReason
QUOTA_OPEN_ATTEMPTS: ErrorReason
QUOTA_ATTEMPTS: ErrorReason
QUOTA_TENANT_PERMITS: ErrorReason
QUOTA_STORE_FULL: ErrorReason
MESSAGE_TOO_LARGE: ErrorReason
ATTEMPT_HOLDER_MISMATCH: ErrorReason
APPROVER_IS_REQUESTER: ErrorReason

class Permit(_message.Message):
    __slots__ = ("permit_id", "subject", "tools", "max_calls_per_tool", "budget", "currency", "expires_at", "lease", "duplicate_guard", "status", "created_at", "uncertain_policy", "tenant", "agents", "approval_per_tool")
    class MaxCallsPerToolEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ApprovalPerToolEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ApprovalRule
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ApprovalRule, _Mapping]] = ...) -> None: ...
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_CALLS_PER_TOOL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_GUARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UNCERTAIN_POLICY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_PER_TOOL_FIELD_NUMBER: _ClassVar[int]
    permit_id: str
    subject: str
    tools: _containers.RepeatedScalarFieldContainer[str]
    max_calls_per_tool: _containers.ScalarMap[str, int]
    budget: int
    currency: str
    expires_at: _timestamp_pb2.Timestamp
    lease: _duration_pb2.Duration
    duplicate_guard: DuplicateGuard
    status: PermitStatus
    created_at: _timestamp_pb2.Timestamp
    uncertain_policy: UncertainPolicy
    tenant: str
    agents: _containers.RepeatedScalarFieldContainer[str]
    approval_per_tool: _containers.MessageMap[str, ApprovalRule]
    def __init__(self, permit_id: _Optional[str] = ..., subject: _Optional[str] = ..., tools: _Optional[_Iterable[str]] = ..., max_calls_per_tool: _Optional[_Mapping[str, int]] = ..., budget: _Optional[int] = ..., currency: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., duplicate_guard: _Optional[_Union[DuplicateGuard, _Mapping]] = ..., status: _Optional[_Union[PermitStatus, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., uncertain_policy: _Optional[_Union[UncertainPolicy, str]] = ..., tenant: _Optional[str] = ..., agents: _Optional[_Iterable[str]] = ..., approval_per_tool: _Optional[_Mapping[str, ApprovalRule]] = ...) -> None: ...

class ApprovalRule(_message.Message):
    __slots__ = ("cost_at_least", "wait", "approvers")
    COST_AT_LEAST_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    APPROVERS_FIELD_NUMBER: _ClassVar[int]
    cost_at_least: int
    wait: _duration_pb2.Duration
    approvers: int
    def __init__(self, cost_at_least: _Optional[int] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., approvers: _Optional[int] = ...) -> None: ...

class DuplicateGuard(_message.Message):
    __slots__ = ("mode", "window")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    mode: DuplicateGuardMode
    window: _duration_pb2.Duration
    def __init__(self, mode: _Optional[_Union[DuplicateGuardMode, str]] = ..., window: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt_id", "permit_id", "tool", "idempotency_key", "request_fingerprint", "state", "cost", "created_at", "lease_expires_at", "receipt", "failure_reason", "uncertain_reason", "uncertain_since", "reserved_by", "approval")
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PERMIT_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    UNCERTAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    UNCERTAIN_SINCE_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BY_FIELD_NUMBER: _ClassVar[int]
    APPROVAL_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    permit_id: str
    tool: str
    idempotency_key: str
    request_fingerprint: bytes
    state: AttemptState
    cost: int
    created_at: _timestamp_pb2.Timestamp
    lease_expires_at: _timestamp_pb2.Timestamp
    receipt: Receipt
    failure_reason: str
    uncertain_reason: str
    uncertain_since: _timestamp_pb2.Timestamp
    reserved_by: str
    approval: Approval
    def __init__(self, attempt_id: _Optional[str] = ..., permit_id: _Optional[str] = ..., tool: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., request_fingerprint: _Optional[bytes] = ..., state: _Optional[_Union[AttemptState, str]] = ..., cost: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., failure_reason: _Optional[str] = ..., uncertain_reason: _Optional[str] = ..., uncertain_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reserved_by: _Optional[str] = ..., approval: _Optional[_Union[Approval, _Mapping]] = ...) -> None: ...

class Approval(_message.Message):
    __slots__ = ("summary", "expires_at", "approvers_needed", "approved_by", "decided_by", "decided_at", "denial_reason")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    APPROVERS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    APPROVED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    DENIAL_REASON_FIELD_NUMBER: _ClassVar[int]
    summary: str
    expires_at: _timestamp_pb2.Timestamp
    approvers_needed: int
    approved_by: _containers.RepeatedScalarFieldContainer[str]
    decided_by: str
    decided_at: _timestamp_pb2.Timestamp
    denial_reason: str
    def __init__(self, summary: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., approvers_needed: _Optional[int] = ..., approved_by: _Optional[_Iterable[str]] = ..., decided_by: _Optional[str] = ..., decided_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., denial_reason: _Optional[str] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("receipt_id", "result", "cost", "issued_at", "signature", "key_id", "tenant", "signature_version")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_VERSION_FIELD_NUMBER: _ClassVar[int]
    receipt_id: str
    result: bytes
    cost: int
    issued_at: _timestamp_pb2.Timestamp
    signature: bytes
    key_id: str
    tenant: str
    signature_version: int
    def __init__(self, receipt_id: _Optional[str] = ..., result: _Optional[bytes] = ..., cost: _Optional[int] = ..., issued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., signature: _Optional[bytes] = ..., key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., signature_version: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("tool", "calls_made", "calls_limit", "budget_remaining")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    CALLS_MADE_FIELD_NUMBER: _ClassVar[int]
    CALLS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    BUDGET_REMAINING_FIELD_NUMBER: _ClassVar[int]
    tool: str
    calls_made: int
    calls_limit: int
    budget_remaining: int
    def __init__(self, tool: _Optional[str] = ..., calls_made: _Optional[int] = ..., calls_limit: _Optional[int] = ..., budget_remaining: _Optional[int] = ...) -> None: ...
