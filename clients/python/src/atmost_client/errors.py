"""The typed errors of atmost_client.

Every failure is an :class:`AtmostError`. One that atmost answered carries
the gRPC code, the ``google.rpc.ErrorInfo`` reason (a name of docs/api.md's
error table, kept as a string so a newer server's reasons survive), its
metadata and the RetryInfo delay. The subclasses let a caller catch by kind
instead of switching on reasons; the guarded call adds the kinds that come
from the caller's own dispatch (:class:`ToolFailed`, :class:`NotSent`),
from an unknown outcome (:class:`OutcomeUncertain`,
:class:`CommitNotRecorded`) and from a call that waits for a person's
approval (:class:`AwaitingApproval`, :class:`ApprovalDenied`).
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional, Tuple

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

#: The ``ErrorInfo.domain`` of every atmost error.
DOMAIN = "atmost"

#: Reasons that refuse the request for what it asks (the permit, the tool,
#: the key, a quota, the caller's role, an attempt another key reserved, or
#: an approval by the key that requested the call): retrying it as it is
#: fails again.
DENIED_REASONS = frozenset(
    {
        "PERMIT_NOT_FOUND",
        "PERMIT_REVOKED",
        "PERMIT_EXPIRED",
        "TOOL_NOT_IN_SCOPE",
        "TOOL_HELD_UNCERTAIN",
        "PERMIT_MAX_CALLS_EXCEEDED",
        "PERMIT_BUDGET_EXCEEDED",
        "IDEMPOTENCY_KEY_REUSED",
        "DUPLICATE_REQUEST_SUSPECTED",
        "ROLE_NOT_ALLOWED",
        "QUOTA_PERMIT_LIFETIME",
        "QUOTA_OPEN_ATTEMPTS",
        "QUOTA_ATTEMPTS",
        "QUOTA_TENANT_PERMITS",
        "QUOTA_STORE_FULL",
        "ATTEMPT_HOLDER_MISMATCH",
        "APPROVER_IS_REQUESTER",
    }
)

#: The reasons this client knows that are not refusals of the call: each is
#: read by its own kind (or is the plain :class:`AtmostError` of a settle
#: that does not apply). A reason outside these and :data:`DENIED_REASONS`
#: is newer than this client, and is read as a refusal: :class:`Denied`.
OTHER_REASONS = frozenset(
    {
        "IDEMPOTENCY_IN_PROGRESS",  # InProgress
        "STORE_UNAVAILABLE",  # Unavailable: retried
        "OVERLOADED",  # Unavailable: retried
        "DEADLINE_EXCEEDED",  # DeadlineExceeded: retried
        "UNAUTHENTICATED",  # Unauthenticated, a Denied
        "INVALID_REQUEST",  # InvalidRequest
        "ATTEMPT_NOT_FOUND",  # AtmostError: a settle of a key the permit never saw
        "ATTEMPT_MISMATCH",  # AtmostError: a stale attempt id
        "ATTEMPT_STATE_CONFLICT",  # AtmostError: the attempt is settled otherwise
        "MESSAGE_TOO_LARGE",  # AtmostError with .limit: the request was larger than the server reads
    }
)


class AtmostError(Exception):
    """Base of every atmost_client error.

    ``code`` is the gRPC status code (``None`` for an error the helper made
    itself, such as :class:`ToolFailed` raised by a dispatch), ``reason``
    the ErrorInfo reason atmost sent (``None`` when the failure did not come
    from atmost: a broken connection, a client-side deadline), ``metadata``
    the ErrorInfo metadata, ``message`` the status message.
    """

    def __init__(
        self,
        message: str = "",
        *,
        code: Optional[grpc.StatusCode] = None,
        reason: Optional[str] = None,
        metadata: Optional[Dict[str, str]] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.metadata: Dict[str, str] = dict(metadata or {})
        #: Seconds the server asked to wait before retrying (google.rpc.RetryInfo).
        self.retry_after = retry_after

    def __str__(self) -> str:
        label = self.reason or (self.code.name if self.code is not None else None)
        return f"{label}: {self.message}" if label else self.message

    def _number(self, name: str) -> Optional[int]:
        value = self.metadata.get(name)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            return None

    @property
    def tool(self) -> Optional[str]:
        """The ``tool`` of the ErrorInfo metadata, when it names one."""
        return self.metadata.get("tool")

    @property
    def limit(self) -> Optional[int]:
        """The ``limit`` of the ErrorInfo metadata (a cap, a quota), as a number."""
        return self._number("limit")

    @property
    def calls_made(self) -> Optional[int]:
        """The ``calls_made`` of the ErrorInfo metadata, as a number."""
        return self._number("calls_made")


class Denied(AtmostError):
    """atmost refused the request (a reason of :data:`DENIED_REASONS`, or
    one newer than this client): past a cap or the budget, out of scope,
    revoked, expired, unknown permit, a key reused for another request, a
    quota, a role; or authentication (:class:`Unauthenticated`), or a
    PERMISSION_DENIED from a proxy in front of atmost (no ErrorInfo).
    Nothing was dispatched; retrying the same request gets the same
    answer."""


class InProgress(AtmostError):
    """IDEMPOTENCY_IN_PROGRESS: the key's attempt is RESERVED by another
    holder (or one that lost its holder token). ``retry_after`` is the time
    to the lease's end; ``metadata["lease_expires_at"]`` the instant."""


class Unavailable(AtmostError):
    """UNAVAILABLE: atmost's store did not answer, atmost shed the request
    (OVERLOADED), or the transport failed (connection refused or reset);
    also CANCELLED without atmost's ErrorInfo (the server's
    ``--request-timeout`` answers CANCELLED "Timeout expired"), which says
    nothing about whether the request applied. Retry with the same
    idempotency key: a reservation made meanwhile comes back, never a
    second one."""


class DeadlineExceeded(Unavailable):
    """DEADLINE_EXCEEDED: from atmost (its reason: the request was not
    started) or from the transport (nothing known). Retry with the same key."""


class Unauthenticated(Denied):
    """UNAUTHENTICATED (from atmost, or a proxy in front of it): no API key,
    an unknown one, or a malformed ``authorization``. A :class:`Denied`
    (kept as its own class for compatibility). Never retried: the same key
    fails the same way."""


class InvalidRequest(AtmostError):
    """INVALID_ARGUMENT / INVALID_REQUEST: malformed input; nothing changed.
    ``violations`` lists the ``(field, description)`` pairs atmost named."""

    def __init__(self, *args: Any, violations: Optional[List[Tuple[str, str]]] = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.violations: List[Tuple[str, str]] = list(violations or [])


class ToolFailed(AtmostError):
    """The tool answered and refused (``raise ToolFailed("card declined")``
    in a dispatch). The guarded call records it (Commit Failed: the cost
    comes back, the slot stays used) and raises it to its caller;
    ``replayed`` is true when it is the stored outcome of an earlier call of
    the same key."""

    def __init__(self, failure_reason: Any = "", **kw: Any) -> None:
        failure_reason = text_of(failure_reason)  # a reason that is not a string is recorded as its str()
        super().__init__(failure_reason, **kw)
        #: What the tool said: the attempt's ``failure_reason``.
        self.failure_reason = failure_reason
        self.replayed = False
        self.attempt_id: Optional[str] = None
        self.attempt: Any = None


class NotSent(AtmostError):
    """The call never left (``raise NotSent("no connection to the tool")``
    in a dispatch, only when that is known for sure). The guarded call
    records it (Commit NotSent: the slot and the cost come back and the key
    is free again) and raises it to its caller."""

    def __init__(self, message: str = "the call was not sent", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.attempt_id: Optional[str] = None


class OutcomeUncertain(AtmostError):
    """Nobody knows whether the call took effect: the dispatch raised, hung
    past its deadline or lost its answer (this call marked it UNCERTAIN), or
    the key's stored outcome already was UNCERTAIN (``replayed``). The slot
    and the cost stay held and nothing is sent again; an operator resolves
    it (Permits/ListUncertain, Resolve). The original error, if any, is the
    ``__cause__``."""

    def __init__(self, message: str, *, attempt_id: str, replayed: bool = False, attempt: Any = None) -> None:
        super().__init__(message)
        self.attempt_id = attempt_id
        self.replayed = replayed
        self.attempt = attempt


class HeldByEarlierRun(AtmostError):
    """The key's attempt is RESERVED by an earlier run of this call: atmost
    redelivered its DISPATCH to the ``holder_token`` you gave, and this call
    cannot know whether that run sent it. Nothing was dispatched and nothing
    recorded. Settle it: :meth:`Client.settle_not_sent` only if you know the
    call never left (your own durable journal says so), else
    :meth:`Client.settle_uncertain`; left alone, it turns UNCERTAIN at its
    lease and an operator resolves it. ``attempt`` is the RESERVED attempt
    (what the settle methods take), ``lease_remaining`` the seconds atmost
    said were left of its lease (``None`` from a server that does not
    say)."""

    def __init__(self, attempt: Any, lease_remaining: Optional[float]) -> None:
        super().__init__(
            f"an earlier run of this call holds attempt {attempt.attempt_id}, and atmost cannot know"
            " whether it sent: settle it NotSent only if you know it did not, else mark it uncertain"
        )
        self.attempt_id: str = attempt.attempt_id
        self.attempt = attempt
        self.lease_remaining = lease_remaining


class AwaitingApproval(AtmostError):
    """The call waits for a person's approval (the permit's
    ``approval_per_tool`` rule holds it) and no decision came within the
    guarded call's ``approval_wait`` (0 by default: not waited for at all).
    Nothing was sent; the slot and the cost stay reserved until the request
    lapses at ``expires_at`` (an aware UTC datetime; ``None`` when atmost
    did not say). Make the same call again (the same key and request) to
    wait on, or to dispatch once approved. ``attempt`` is the attempt as
    atmost answered it (AWAITING_APPROVAL, with its ``approval``)."""

    def __init__(self, attempt: Any) -> None:
        approval = attempt.approval
        self.attempt_id: str = attempt.attempt_id
        self.attempt = attempt
        self.expires_at: Optional[datetime.datetime] = (
            approval.expires_at.ToDatetime(tzinfo=datetime.timezone.utc)
            if attempt.HasField("approval") and approval.HasField("expires_at")
            else None
        )
        until = f" (until {self.expires_at.isoformat()})" if self.expires_at is not None else ""
        super().__init__(f"attempt {self.attempt_id} awaits approval{until}: nothing was sent")


class ApprovalDenied(AtmostError):
    """A person denied the call, or nobody decided in time
    (``denial_reason`` ``approval_expired``; ``approval_unclaimed`` for an
    approval the requester did not come back for in time; ``permit_revoked``).
    It was never sent, and the key replays this denial for good: a new call
    needs a new key. ``denial_reason`` is the approver's reason (what the
    attempt's ``approval.denial_reason`` holds; ``reason`` stays the
    ErrorInfo reason of :class:`AtmostError`, ``None`` here),
    ``decided_by`` the approver's key id (``""`` for a lapse, and in dev
    mode), ``replayed`` false when this call waited for the decision and
    true when the key was already denied before it asked."""

    def __init__(self, attempt: Any, *, replayed: bool) -> None:
        approval = attempt.approval
        self.attempt_id: str = attempt.attempt_id
        self.attempt = attempt
        self.denial_reason: str = approval.denial_reason
        self.decided_by: str = approval.decided_by
        self.replayed = replayed
        by = f" by {self.decided_by}" if self.decided_by else ""
        super().__init__(
            f"the call was denied approval{by}{' (replayed)' if replayed else ''}: {self.denial_reason};"
            " nothing was sent"
        )


class CommitNotRecorded(AtmostError):
    """The call's outcome could not be recorded (Commit or MarkUncertain
    still failed after the retries, raised something that is not an RPC
    error, such as the ValueError of a closed channel, or could not be
    sent: an ``actual_cost`` that is not an int in 0..2^63-1), or atmost
    answered the Commit without a SUCCEEDED attempt and its receipt (a
    broken server). The attempt turns UNCERTAIN at its lease and an
    operator resolves it. ``outcome`` names what was being recorded
    (``"SUCCEEDED"``, ``"FAILED"``, ``"NOT_SENT"``, ``"UNCERTAIN"``);
    ``result`` is the dispatch's whole result for a success,
    ``failure_reason`` the reason for FAILED or UNCERTAIN; the cause (the
    last RPC error, or what was raised) is the ``__cause__``."""

    def __init__(
        self,
        message: str,
        *,
        attempt_id: str,
        outcome: str,
        result: Any = None,
        failure_reason: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.attempt_id = attempt_id
        self.outcome = outcome
        self.result = result
        self.failure_reason = failure_reason


def text_of(value: Any) -> str:
    """``value`` as text: itself when a str, else its ``str()`` (its type's
    name when even that raises)."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:  # noqa: BLE001 (a broken __str__ must not stop an outcome from being recorded)
        return f"<{type(value).__name__}>"


# === from a failed call ===


def from_rpc_error(error: grpc.RpcError) -> AtmostError:
    """The typed error of a failed grpcio call (its status, ErrorInfo,
    RetryInfo and BadRequest read with grpcio-status)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = (error.details() if hasattr(error, "details") else None) or ""
    reason: Optional[str] = None
    metadata: Dict[str, str] = {}
    retry_after: Optional[float] = None
    violations: List[Tuple[str, str]] = []
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        status = None  # trailers that do not match the status: read nothing from them
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = [(v.field, v.description) for v in bad.field_violations]
    kw: Dict[str, Any] = dict(code=code, reason=reason, metadata=metadata, retry_after=retry_after)
    if reason == "IDEMPOTENCY_IN_PROGRESS":
        return InProgress(message, **kw)
    if reason in DENIED_REASONS:
        return Denied(message, **kw)
    if code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.CANCELLED and reason is None):
        return Unavailable(message, **kw)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message, **kw)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message, **kw)
    if code == grpc.StatusCode.INVALID_ARGUMENT or reason == "INVALID_REQUEST":
        return InvalidRequest(message, violations=violations, **kw)
    if code == grpc.StatusCode.PERMISSION_DENIED and reason is None:
        return Denied(message, **kw)  # a proxy or TLS front end in front of atmost refused the call
    if reason is not None and reason not in OTHER_REASONS:
        return Denied(message, **kw)  # a refusal newer than this client
    return AtmostError(message, **kw)
