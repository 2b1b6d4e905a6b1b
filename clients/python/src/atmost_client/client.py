"""``Client``: the connection to atmost, one thin method per RPC, and the
retry loop the guarded call uses.

Each RPC method builds its request from keyword arguments, sends it with the
API key and the default deadline, and returns the response message; a
failure raises the typed error of :mod:`atmost_client.errors`. Nothing is
retried there: retrying belongs to the guarded call (:mod:`.guard`), which
knows which requests are safe to send again.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import pb
from ._pb import approvals_pb2_grpc, gate_pb2_grpc, permits_pb2_grpc, receipts_pb2_grpc
from .errors import AtmostError, InProgress, Unavailable, from_rpc_error
from .guard import GuardedCall, Outcome, call_guarded, clip_reason, guarded

PemSource = Union[bytes, str, "os.PathLike[str]"]

_log = logging.getLogger("atmost_client")

#: Channel options applied under the caller's: grpc's reconnect backoff
#: starts at 1 s and grows to 120 s by default, and while it waits every
#: RPC fails at once with UNAVAILABLE, so the guarded call's retries
#: (50 ms doubling to 2 s) would all land inside one backoff. Reconnecting
#: on the same scale makes a server that comes back reachable to them.
#: ``grpc.min_reconnect_backoff_ms`` is left alone: grpc core takes it as the
#: least time a connection attempt gets (20 s by default), and 100 ms fails
#: every attempt to a server slower than that to say hello (a far TLS
#: handshake, a loaded machine); each call's own deadline bounds the wait.
DEFAULT_CHANNEL_OPTIONS: Tuple[Tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


@dataclass(frozen=True)
class Retry:
    """How the guarded call retries Authorize, Commit and MarkUncertain.

    A retryable failure (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED without
    atmost's ErrorInfo, and for Authorize IDEMPOTENCY_IN_PROGRESS) is sent
    again, the same request, after the server's RetryInfo delay or else an
    exponential backoff with jitter (50 ms doubling, at most 2 s), until
    ``max_tries`` tries or ``max_time`` seconds: then the last error is
    raised. A wait that would end past ``max_time`` is not begun: the last
    error is raised at once (an IDEMPOTENCY_IN_PROGRESS whose RetryInfo
    delay, the other holder's lease, outlasts the budget raises InProgress
    without waiting). ``on_retry(rpc, error, delay)`` is called before each
    wait (for logs and metrics); an exception it raises is logged (logger
    ``atmost_client``) and ignored, so the retries and the recording of the
    outcome go on.
    """

    max_tries: int = 5
    max_time: float = 10.0
    on_retry: Optional[Callable[[str, AtmostError, float], None]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tries, int) or isinstance(self.max_tries, bool) or self.max_tries < 1:
            raise ValueError(f"Retry.max_tries must be an int >= 1, not {self.max_tries!r}")
        if not isinstance(self.max_time, (int, float)) or not self.max_time > 0:
            raise ValueError(f"Retry.max_time must be a number of seconds > 0, not {self.max_time!r}")


def backoff(tries: int) -> float:
    """The wait after the ``tries``-th failed try: 50 ms doubling, capped at
    2 s, drawn uniformly from its upper half (jitter, so callers that failed
    together do not retry together)."""
    ceiling = min(0.05 * 2 ** (tries - 1), 2.0)
    return random.uniform(ceiling / 2, ceiling)


def _pem(value: Optional[PemSource], what: str) -> Optional[bytes]:
    if value is None:
        return None
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (str, os.PathLike)):
        try:
            with open(value, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {value!s}: {e.strerror}") from e
    else:
        raise TypeError(f"{what} must be PEM bytes or a file path, not {type(value).__name__}")
    # grpc takes anything and fails each connection later with a log line:
    # a file that is not PEM at all is refused here, with its name.
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} is not PEM (no -----BEGIN line)")
    return data


def _seconds(value: Union[float, int, datetime.timedelta], what: str) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return float(value)


class Client:
    """A connection to one atmost (or a load balancer in front of several).

    ``address`` is ``host:port``. ``api_key`` is sent as ``authorization:
    Bearer <key>`` with every call (an atmost started with ``--auth-keys``).
    TLS is on when ``tls`` is true or any certificate is given:
    ``root_certificates`` is the CA (PEM) that signed the server's
    certificate (the system's roots when omitted), ``certificate_chain`` and
    ``private_key`` the client's certificate and key for mTLS; each is PEM
    bytes or a file path. ``timeout`` is each RPC's deadline in seconds
    unless a call names its own; ``retry`` the guarded call's default
    :class:`Retry`; ``options`` more grpc channel options.

    Thread-safe; a context manager that closes the channel.
    """

    def __init__(
        self,
        address: str,
        *,
        api_key: Optional[str] = None,
        tls: bool = False,
        root_certificates: Optional[PemSource] = None,
        certificate_chain: Optional[PemSource] = None,
        private_key: Optional[PemSource] = None,
        timeout: float = 5.0,
        retry: Optional[Retry] = None,
        options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        if not isinstance(address, str) or not address:
            raise ValueError(f"address must be a non-empty 'host:port' string, not {address!r}")
        self.address = address
        self.timeout = _seconds(timeout, "timeout")
        self.retry = retry if retry is not None else Retry()
        self._metadata: Tuple[Tuple[str, str], ...] = ()
        if api_key is not None:
            if not isinstance(api_key, str) or not api_key or not all(" " < c <= "~" for c in api_key):
                raise ValueError("api_key must be a non-empty string of visible ASCII characters")
            self._metadata = (("authorization", f"Bearer {api_key}"),)
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together (mTLS needs both)")
        channel_options = list(DEFAULT_CHANNEL_OPTIONS) + list(options)
        if tls or root_certificates is not None or certificate_chain is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(root_certificates, "root_certificates"),
                private_key=_pem(private_key, "private_key"),
                certificate_chain=_pem(certificate_chain, "certificate_chain"),
            )
            self._channel = grpc.secure_channel(address, credentials, options=channel_options)
        else:
            self._channel = grpc.insecure_channel(address, options=channel_options)
        self._gate = gate_pb2_grpc.GateStub(self._channel)
        self._permits = permits_pb2_grpc.PermitsStub(self._channel)
        self._receipts = receipts_pb2_grpc.ReceiptsStub(self._channel)
        self._approvals = approvals_pb2_grpc.ApprovalsStub(self._channel)

    @property
    def channel(self) -> grpc.Channel:
        """The grpc channel, for the other services atmost serves on it
        (``grpc.health.v1.Health``, reflection)."""
        return self._channel

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        try:
            return method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    # === atmost.v1.Gate ===

    def authorize(
        self,
        permit_id: str,
        tool: str,
        idempotency_key: str,
        request_fingerprint: bytes,
        *,
        cost: int = 0,
        holder_token: bytes = b"",
        approval_summary: str = "",
        wait: Union[None, float, datetime.timedelta] = None,
        timeout: Optional[float] = None,
    ) -> pb.AuthorizeResponse:
        """Asks for a DISPATCH before a side-effecting call (no retries:
        see :meth:`guard` for the call that retries safely).
        ``approval_summary`` describes the call to the approvers when the
        permit's approval rule holds it; ``wait`` (seconds or a timedelta,
        at most 60) has atmost hold the call open while it awaits approval,
        until the decision or the wait's end: the default deadline is then
        ``timeout`` plus the wait."""
        request = pb.AuthorizeRequest(
            permit_id=permit_id,
            tool=tool,
            idempotency_key=idempotency_key,
            request_fingerprint=request_fingerprint,
            cost=cost,
            holder_token=holder_token,
            approval_summary=approval_summary,
        )
        if wait is not None:
            held = _seconds_or_zero(wait, "wait")
            if held > 0:
                request.wait.FromNanoseconds(round(held * 1e9))
                if timeout is None:
                    timeout = self.timeout + held
        return self._call(self._gate.Authorize, request, timeout)

    def commit(
        self,
        permit_id: str,
        idempotency_key: str,
        attempt_id: str,
        *,
        result: Optional[bytes] = None,
        actual_cost: Optional[int] = None,
        failed: Optional[str] = None,
        not_sent: bool = False,
        timeout: Optional[float] = None,
    ) -> pb.CommitResponse:
        """Reports the outcome: exactly one of ``result`` (Succeeded, with an
        optional ``actual_cost``), ``failed`` (the tool's reason) or
        ``not_sent=True``."""
        request = pb.CommitRequest(
            permit_id=permit_id, idempotency_key=idempotency_key, attempt_id=attempt_id
        )
        _outcome(request, result, actual_cost, failed, not_sent)
        return self._call(self._gate.Commit, request, timeout)

    def mark_uncertain(
        self,
        permit_id: str,
        idempotency_key: str,
        attempt_id: str,
        reason: str = "",
        *,
        timeout: Optional[float] = None,
    ) -> pb.MarkUncertainResponse:
        """The call was sent and its answer lost: the slot and the money
        stay held and nothing is sent again. Idempotent."""
        request = pb.MarkUncertainRequest(
            permit_id=permit_id, idempotency_key=idempotency_key, attempt_id=attempt_id, reason=reason
        )
        return self._call(self._gate.MarkUncertain, request, timeout)

    # === atmost.v1.Permits ===

    def create_permit(
        self,
        tools: Union[Iterable[str], pb.Permit],
        *,
        expires_at: Optional[datetime.datetime] = None,
        max_calls_per_tool: Optional[Mapping[str, int]] = None,
        budget: Optional[int] = None,
        lease: Union[None, float, datetime.timedelta] = None,
        subject: str = "",
        currency: str = "",
        uncertain_policy: Optional[int] = None,
        duplicate_guard: Optional[pb.DuplicateGuard] = None,
        agents: Iterable[str] = (),
        approval_per_tool: Optional[Mapping[str, pb.ApprovalRule]] = None,
        timeout: Optional[float] = None,
    ) -> pb.Permit:
        """Creates a permit for ``tools`` (or sends the ``pb.Permit`` given
        as it is). ``expires_at`` defaults to an hour from now (an aware
        datetime; naive ones are read as UTC), ``lease`` is in seconds (or a
        timedelta), ``uncertain_policy`` a ``pb.UNCERTAIN_POLICY_*``.
        ``approval_per_tool`` maps a tool to the :func:`approval_rule` its
        calls wait for a person under."""
        if isinstance(tools, pb.Permit):
            permit = tools
        else:
            if isinstance(tools, str):
                raise TypeError("tools is a list of tool names, not one string")
            permit = pb.Permit(
                tools=list(tools),
                max_calls_per_tool=dict(max_calls_per_tool or {}),
                subject=subject,
                currency=currency,
                agents=list(agents),
            )
            if budget is not None:
                permit.budget = budget
            if expires_at is None:
                expires_at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
            if expires_at.tzinfo is None:
                expires_at = expires_at.replace(tzinfo=datetime.timezone.utc)
            permit.expires_at.FromDatetime(expires_at)
            if lease is not None:
                permit.lease.FromNanoseconds(round(_seconds(lease, "lease") * 1e9))
            if uncertain_policy is not None:
                permit.uncertain_policy = uncertain_policy  # type: ignore[assignment]
            if duplicate_guard is not None:
                permit.duplicate_guard.CopyFrom(duplicate_guard)
            for tool, rule in (approval_per_tool or {}).items():
                if not isinstance(rule, pb.ApprovalRule):
                    raise TypeError(
                        f"approval_per_tool[{tool!r}] must be a pb.ApprovalRule (see approval_rule()),"
                        f" not {type(rule).__name__}"
                    )
                permit.approval_per_tool[tool].CopyFrom(rule)
        return self._call(self._permits.CreatePermit, pb.CreatePermitRequest(permit=permit), timeout)

    def get_permit(self, permit_id: str, *, timeout: Optional[float] = None) -> pb.GetPermitResponse:
        return self._call(self._permits.GetPermit, pb.GetPermitRequest(permit_id=permit_id), timeout)

    def get_attempt(
        self, permit_id: str, idempotency_key: str, *, timeout: Optional[float] = None
    ) -> pb.GetAttemptResponse:
        """The key's attempt as every reader sees it now (a RESERVED one past
        its lease reads UNCERTAIN, ``lease_expired``). Reads only. A key the
        permit never saw raises AtmostError ATTEMPT_NOT_FOUND; an unknown
        permit Denied PERMIT_NOT_FOUND."""
        request = pb.GetAttemptRequest(permit_id=permit_id, idempotency_key=idempotency_key)
        return self._call(self._permits.GetAttempt, request, timeout)

    def revoke_permit(self, permit_id: str, *, timeout: Optional[float] = None) -> pb.Permit:
        return self._call(self._permits.RevokePermit, pb.RevokePermitRequest(permit_id=permit_id), timeout)

    def list_uncertain(
        self,
        permit_id: str = "",
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: Optional[float] = None,
    ) -> pb.ListUncertainResponse:
        """One page of UNCERTAIN attempts (``permit_id`` empty: across the
        caller's permits)."""
        request = pb.ListUncertainRequest(permit_id=permit_id, page_size=page_size, page_token=page_token)
        return self._call(self._permits.ListUncertain, request, timeout)

    def iter_uncertain(self, permit_id: str = "", *, page_size: int = 0) -> Iterator[pb.Attempt]:
        """Every UNCERTAIN attempt, following page tokens to the end. A token
        answered twice is a broken server: AtmostError rather than a loop."""
        token, seen = "", set()
        while True:
            page = self.list_uncertain(permit_id, page_size=page_size, page_token=token)
            yield from page.attempts
            if not page.next_page_token:
                return
            if page.next_page_token in seen:
                raise AtmostError("ListUncertain answered a page token it had answered before")
            seen.add(page.next_page_token)
            token = page.next_page_token

    def resolve(
        self,
        permit_id: str,
        idempotency_key: str,
        *,
        result: Optional[bytes] = None,
        actual_cost: Optional[int] = None,
        failed: Optional[str] = None,
        not_sent: bool = False,
        attempt_id: str = "",
        timeout: Optional[float] = None,
    ) -> pb.ResolveResponse:
        """Settles an UNCERTAIN attempt after asking the tool what happened:
        exactly one of ``result``, ``failed`` or ``not_sent=True`` (which
        needs ``attempt_id``)."""
        request = pb.ResolveRequest(
            permit_id=permit_id, idempotency_key=idempotency_key, attempt_id=attempt_id
        )
        _outcome(request, result, actual_cost, failed, not_sent)
        return self._call(self._permits.Resolve, request, timeout)

    # === atmost.v1.Approvals ===

    def list_approvals(
        self,
        permit_id: str = "",
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: Optional[float] = None,
    ) -> pb.ListApprovalsResponse:
        """One page of calls AWAITING_APPROVAL (``permit_id`` empty: across
        the caller's tenant), oldest request first, each with its
        ``approval`` (summary, expiry, approvals so far) and the
        ``attempt_id`` :meth:`approve` and :meth:`deny` need. An approver's
        or admin's key."""
        request = pb.ListApprovalsRequest(permit_id=permit_id, page_size=page_size, page_token=page_token)
        return self._call(self._approvals.ListApprovals, request, timeout)

    def iter_approvals(self, permit_id: str = "", *, page_size: int = 0) -> Iterator[pb.Attempt]:
        """Every call awaiting approval, following page tokens to the end. A
        token answered twice is a broken server: AtmostError rather than a
        loop."""
        token, seen = "", set()
        while True:
            page = self.list_approvals(permit_id, page_size=page_size, page_token=token)
            yield from page.attempts
            if not page.next_page_token:
                return
            if page.next_page_token in seen:
                raise AtmostError("ListApprovals answered a page token it had answered before")
            seen.add(page.next_page_token)
            token = page.next_page_token

    def approve(
        self, permit_id: str, idempotency_key: str, attempt_id: str, *, timeout: Optional[float] = None
    ) -> pb.ApproveResponse:
        """Approves one call awaiting approval, named by its attempt (an
        approver's or admin's key; never the key that requested it:
        Denied APPROVER_IS_REQUESTER). With a four-eyes rule the call stays
        AWAITING_APPROVAL until a second, distinct key approves. Repeating
        an approval already recorded answers the attempt as it is."""
        request = pb.ApproveRequest(
            permit_id=permit_id, idempotency_key=idempotency_key, attempt_id=attempt_id
        )
        return self._call(self._approvals.Approve, request, timeout)

    def deny(
        self,
        permit_id: str,
        idempotency_key: str,
        attempt_id: str,
        reason: str = "",
        *,
        timeout: Optional[float] = None,
    ) -> pb.DenyResponse:
        """Denies one call awaiting approval (or approved and not yet
        claimed): DENIED, the slot and the cost come back, nothing was sent,
        and its key replays the denial with ``reason`` (at most 1024 bytes;
        empty means "denied")."""
        request = pb.DenyRequest(
            permit_id=permit_id, idempotency_key=idempotency_key, attempt_id=attempt_id, reason=reason
        )
        return self._call(self._approvals.Deny, request, timeout)

    # === atmost.v1.Receipts ===

    def get_signing_keys(self, *, timeout: Optional[float] = None) -> pb.GetSigningKeysResponse:
        """The Ed25519 public keys that verify atmost's signed receipts."""
        return self._call(self._receipts.GetSigningKeys, pb.GetSigningKeysRequest(), timeout)

    # === the guarded call (atmost_client.guard) ===

    def guard(self, permit_id: str, tool: str, idempotency_key: str, **options: Any) -> GuardedCall:
        """The guarded call as a context manager: see :class:`GuardedCall`."""
        return GuardedCall(self, permit_id, tool, idempotency_key, **options)

    def call_guarded(
        self, permit_id: str, tool: str, idempotency_key: str, dispatch: Callable[[str], Any], **options: Any
    ) -> Outcome:
        """The guarded call as a function: see :func:`atmost_client.guard.call_guarded`."""
        return call_guarded(self, permit_id, tool, idempotency_key, dispatch, **options)

    def guarded(self, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Outcome]]:
        """The guarded call as a decorator: see :func:`atmost_client.guard.guarded`."""
        return guarded(self, **options)

    def settle_not_sent(self, attempt: pb.Attempt) -> pb.Attempt:
        """Commit NotSent for an attempt you hold and know was never sent:
        the slot, the cost and the key come back. For the ``attempt`` of
        :class:`HeldByEarlierRun` when your own durable record says the
        earlier run never sent it; anything less than that knowledge is
        :meth:`settle_uncertain`. Retried like the guarded call's Commit
        (``self.retry``); returns the attempt as recorded, RELEASED."""
        return self._retrying(
            "Commit",
            lambda timeout: self.commit(
                attempt.permit_id, attempt.idempotency_key, attempt.attempt_id, not_sent=True, timeout=timeout
            ),
            self.retry,
        ).attempt

    def settle_uncertain(self, attempt: pb.Attempt, reason: str) -> pb.Attempt:
        """MarkUncertain for an attempt you hold whose call may have gone
        out (the ``attempt`` of :class:`HeldByEarlierRun`, say): the slot
        and the cost stay held, nothing is sent again, and an operator
        resolves it. ``reason`` is cut to the 1024 bytes atmost keeps.
        Retried like the guarded call's MarkUncertain; returns the attempt
        as recorded, UNCERTAIN."""
        return self._retrying(
            "MarkUncertain",
            lambda timeout: self.mark_uncertain(
                attempt.permit_id,
                attempt.idempotency_key,
                attempt.attempt_id,
                clip_reason(reason),
                timeout=timeout,
            ),
            self.retry,
        ).attempt

    # === retrying (used by the guarded call) ===

    def _retrying(
        self,
        rpc: str,
        send: Callable[[float], Any],
        retry: Retry,
        *,
        in_progress: bool = False,
        held: float = 0.0,
    ) -> Any:
        """``send(timeout)`` until it answers, per :class:`Retry`. Only
        failures that leave the request safe to send again as it is are
        retried: :class:`Unavailable` (UNAVAILABLE: nothing decided, or
        shed; DEADLINE_EXCEEDED; CANCELLED without atmost's ErrorInfo: a
        timeout, applied or not, and the same request answers the same),
        and with ``in_progress`` IDEMPOTENCY_IN_PROGRESS. ``held`` is how
        long atmost may hold each try open (an Authorize with a ``wait``):
        each try's deadline and the whole budget are longer by it."""
        start = time.monotonic()
        tries = 0
        while True:
            tries += 1
            left = retry.max_time + held - (time.monotonic() - start)
            try:
                return send(max(min(self.timeout + held, left), 0.001))
            except AtmostError as error:
                if not (isinstance(error, Unavailable) or (in_progress and isinstance(error, InProgress))):
                    raise
                if tries >= retry.max_tries:
                    raise
                delay = error.retry_after if error.retry_after is not None else backoff(tries)
                if time.monotonic() - start + delay > retry.max_time + held:
                    raise
                if retry.on_retry is not None:
                    try:
                        retry.on_retry(rpc, error, delay)
                    except Exception:  # noqa: BLE001 (a hook for logs and metrics)
                        # A broken hook must not stop an outcome from being
                        # recorded: raised through a Commit, it would leave
                        # the attempt RESERVED and the caller with neither
                        # the result nor CommitNotRecorded.
                        _log.warning("Retry.on_retry raised; ignored", exc_info=True)
                time.sleep(delay)


def approval_rule(
    *,
    cost_at_least: Optional[int] = None,
    wait: Union[None, float, datetime.timedelta] = None,
    approvers: int = 1,
) -> pb.ApprovalRule:
    """The rule a permit's ``approval_per_tool`` holds a tool's calls under
    (:meth:`Client.create_permit`): every call of the tool waits for a
    person, or only those whose cost is at least ``cost_at_least`` (minor
    units); each may wait ``wait`` (seconds or a timedelta; ``None``: the
    server's ``--approval-wait-default``) before it lapses as if denied;
    and it needs ``approvers`` distinct approvals (1, or 2 for a four-eyes
    rule, which needs keys)."""
    rule = pb.ApprovalRule(approvers=approvers)
    if cost_at_least is not None:
        rule.cost_at_least = cost_at_least
    if wait is not None:
        rule.wait.FromNanoseconds(round(_seconds(wait, "wait") * 1e9))
    return rule


def _seconds_or_zero(value: Union[float, int, datetime.timedelta], what: str) -> float:
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{what} must be a number of seconds >= 0, not {value!r}")
    return float(value)


def _outcome(
    request: Any, result: Optional[bytes], actual_cost: Optional[int], failed: Optional[str], not_sent: bool
) -> None:
    chosen = (result is not None) + (failed is not None) + bool(not_sent)
    if chosen != 1:
        raise ValueError("give exactly one outcome: result=..., failed=... or not_sent=True")
    if actual_cost is not None and result is None:
        raise ValueError("actual_cost goes with result=... (a Succeeded outcome)")
    if result is not None:
        request.succeeded.result = result
        if actual_cost is not None:
            request.succeeded.actual_cost = actual_cost
    elif failed is not None:
        request.failed.reason = failed
    else:
        request.not_sent.SetInParent()
