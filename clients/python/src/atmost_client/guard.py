"""The guarded call: one side-effecting tool call wrapped with atmost.

Three forms share one engine, :class:`GuardedCall`:

- the context manager, ``with client.guard(...) as call:``, where the block
  sends the call itself (and keeps to ``call.time_left()``);
- the function, ``client.call_guarded(..., dispatch=fn)``;
- the decorator, ``@client.guarded(permit_id=..., tool=..., key=...)``.

The engine follows the contract the Rust, Python and TypeScript helpers
share: one holder token per guarded call, Authorize retried only when that
is safe, never a dispatch on REPLAY, the dispatch bounded by a deadline the
server's lease gives, and every ending recorded: Commit Succeeded / Failed /
NotSent, or MarkUncertain for anything else, after which nothing is sent
again.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Literal, Optional, Tuple, Union

import grpc

from . import pb
from .errors import (
    ApprovalDenied,
    AtmostError,
    AwaitingApproval,
    CommitNotRecorded,
    HeldByEarlierRun,
    NotSent,
    OutcomeUncertain,
    ToolFailed,
    Unavailable,
    text_of,
)
from .fingerprint import fingerprint as fingerprint_of

if TYPE_CHECKING:
    from .client import Client, Retry

#: A result larger than this is recorded as ``sha256:<hex>`` of its bytes
#: (atmost stores at most 64 KiB); the caller still gets all of it.
MAX_RESULT_BYTES = 64 * 1024

#: Taken off the lease to make the default dispatch deadline: the lease is
#: decided on the server's clock, the deadline counted on ours, and the
#: margin covers the answer's trip and the two clocks' rates.
LEASE_MARGIN = 1.0

#: The largest ``actual_cost`` atmost takes (an int64).
MAX_COST = 2**63 - 1

#: The longest atmost is asked to hold one Authorize open for an approval's
#: decision (it takes at most 60 s): a longer ``approval_wait`` is several
#: calls, one after the other, never a poll loop.
MAX_APPROVAL_HOLD = 55.0

#: atmost keeps an approval summary of at most this many UTF-8 bytes.
MAX_SUMMARY_BYTES = 1024

#: A held Authorize that atmost's own request timeout cut off (CANCELLED
#: without ErrorInfo) after at least this long is taken as "still waiting",
#: and the following asks hold for what it lasted, less the margin.
_MIN_CUT = 2.0
_CUT_MARGIN = 1.0

_UNSET: Any = object()
_log = logging.getLogger("atmost_client")


@dataclass(frozen=True)
class Outcome:
    """A guarded call that succeeded.

    ``result`` is what the dispatch returned, or, when ``replayed``, the
    bytes atmost stored for the key's earlier call (a JSON text for results
    that were not bytes: :meth:`json` decodes it; ``sha256:<hex>`` for one
    over 64 KiB). ``attempt`` is the attempt as recorded, SUCCEEDED with its
    receipt. ``redelivered``: the DISPATCH was the one an earlier Authorize
    try of this call got, whose answer was lost (to the call's own random
    holder token: a redelivery to one the caller gave is never dispatched).
    """

    result: Any
    replayed: bool
    attempt: pb.Attempt
    redelivered: bool = False

    @property
    def attempt_id(self) -> str:
        return self.attempt.attempt_id

    @property
    def receipt(self) -> pb.Receipt:
        return self.attempt.receipt

    def json(self) -> Any:
        """``result`` decoded from JSON when it is bytes (a replay), else as is."""
        if isinstance(self.result, (bytes, bytearray)):
            return json.loads(bytes(self.result).decode("utf-8"))
        return self.result


def encode_result(result: Any) -> bytes:
    """The bytes a result is recorded as: bytes as they are, anything else as
    its compact UTF-8 JSON, NaN and the infinities written ``null`` (as
    JavaScript's JSON.stringify and serde_json write them; a lone surrogate
    escaped, as JSON.stringify writes it, the rest then escaped too); past 64 KiB,
    ``sha256:<hex>`` of those bytes. A result json cannot encode at all (a
    set, an object, a cycle, one whose own code raises while it is written)
    is recorded empty (``b""``): the call went out and succeeded, and the
    caller still gets the result as it is."""
    if isinstance(result, (bytes, bytearray, memoryview)):
        data = bytes(result)
    else:
        try:
            try:
                text = _json(result)
            except ValueError:  # NaN or an infinity (or a cycle, refused again below)
                text = _json(_finite(result, set()))
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: escaped, as JSON.stringify writes it
                data = _json(_finite(result, set()), ascii=True).encode("ascii")
        except Exception as e:  # noqa: BLE001 (whatever the encoder raises, the success is recorded)
            # TypeError, ValueError, RecursionError, and anything a result's own
            # code raises (a dict changed while it is written, a broken Mapping).
            _log.warning("a result json cannot encode is recorded empty (%s: %s)", type(e).__name__, e)
            return b""
    if len(data) > MAX_RESULT_BYTES:
        data = b"sha256:" + hashlib.sha256(data).hexdigest().encode("ascii")
    return data


def _json(value: Any, ascii: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ascii, separators=(",", ":"), allow_nan=False)


def _finite(value: Any, above: set) -> Any:
    """``value`` with every NaN and infinity made None (a copy of the
    containers on their way); a cycle raises ValueError."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dict, list, tuple)):
        if id(value) in above:
            raise ValueError("the result contains itself (a cycle)")
        above.add(id(value))
        if isinstance(value, dict):
            copy: Any = {k: _finite(v, above) for k, v in value.items()}
        else:
            copy = [_finite(v, above) for v in value]
        above.discard(id(value))
        return copy
    return value


#: atmost keeps a reason of at most this many UTF-8 bytes (docs/api.md, "Limits").
MAX_REASON_BYTES = 1024


def clip_reason(text: str) -> str:
    """``text`` cut to :data:`MAX_REASON_BYTES` of UTF-8, on a character
    boundary: a longer reason would be refused, leaving the outcome
    unrecorded."""
    return text.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore")


class GuardedCall:
    """One guarded call; also the context manager ``client.guard()`` returns.

    ``with client.guard(permit_id, tool, key, request=..., cost=...) as call:``
    authorizes on entry (retrying safely). Then either

    - ``call.replayed`` is true: the key already succeeded; ``call.result``
      is the stored result and ``call.outcome`` the :class:`Outcome`. Send
      nothing. (A key that FAILED or is UNCERTAIN raises ToolFailed or
      OutcomeUncertain on entry instead, and the block does not run.)
    - or the block holds a DISPATCH: send the call with ``call.attempt_id``
      as the tool's own idempotency key, within ``call.time_left()``
      seconds, then ``call.succeeded(result)``; ``raise ToolFailed(reason)``
      when the tool refused, ``raise NotSent(...)`` when the call surely
      never left. Any other exception leaving the block marks the attempt
      UNCERTAIN and raises OutcomeUncertain from it, and so does a
      ToolFailed or NotSent a guarded call made inside the block raised
      (it names that call's attempt: this one may have sent); so does
      leaving the block without settling, a programming error. Keeping to
      the deadline is the block's job here: the function forms enforce it.

    A DISPATCH redelivered to a ``holder_token`` you gave raises
    HeldByEarlierRun on entry (an earlier run may have sent it), and the
    block does not run. So do a call that still awaits a person's approval
    (AwaitingApproval) and one that was denied (ApprovalDenied).

    Options: ``request`` (a JSON value, fingerprinted) or ``fingerprint``
    (bytes), ``cost`` (default 0), ``holder_token`` (bytes; default 16
    random ones, for this call only; give your own, kept with the call,
    only to recover and settle the attempt after a restart), ``timeout``
    (the dispatch deadline in seconds from when DISPATCH arrived; never past
    the default: what atmost said is left of the lease, less 1 s, counted
    from when the Authorize try it answered was sent), ``retry`` (a
    :class:`Retry`; default the client's), and for a call the permit's
    approval rule holds: ``approval_summary`` (a short description shown to
    the approvers, at most 1024 bytes of UTF-8; the request's fingerprint
    is what the approval binds to) and ``approval_wait`` (seconds or a
    timedelta, default 0: how long to wait for the decision, in Authorize
    calls atmost holds open for up to 55 s each, with the same request and
    holder token).
    """

    def __init__(
        self,
        client: "Client",
        permit_id: str,
        tool: str,
        idempotency_key: str,
        *,
        request: Any = _UNSET,
        fingerprint: Optional[bytes] = None,
        cost: int = 0,
        holder_token: Optional[bytes] = None,
        timeout: Optional[float] = None,
        retry: Optional["Retry"] = None,
        approval_summary: str = "",
        approval_wait: Union[float, datetime.timedelta] = 0,
    ) -> None:
        for name, value in (("permit_id", permit_id), ("tool", tool), ("idempotency_key", idempotency_key)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, not {value!r}")
        if (request is _UNSET) == (fingerprint is None):
            raise ValueError("give the request (a JSON value) or its fingerprint (bytes), exactly one")
        if fingerprint is not None and not isinstance(fingerprint, bytes):
            raise TypeError(f"fingerprint must be bytes, not {type(fingerprint).__name__}")
        if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
            raise ValueError(f"cost must be an int >= 0, not {cost!r}")
        if holder_token is not None and (
            not isinstance(holder_token, bytes) or not 1 <= len(holder_token) <= 64
        ):
            raise ValueError("holder_token must be 1 to 64 bytes")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if not isinstance(approval_summary, str):
            raise TypeError(f"approval_summary must be a str, not {type(approval_summary).__name__}")
        if len(approval_summary.encode("utf-8", "surrogatepass")) > MAX_SUMMARY_BYTES:
            raise ValueError(f"approval_summary is longer than {MAX_SUMMARY_BYTES} bytes of UTF-8")
        if isinstance(approval_wait, datetime.timedelta):
            approval_wait = approval_wait.total_seconds()
        if (
            isinstance(approval_wait, bool)
            or not isinstance(approval_wait, (int, float))
            or not 0 <= approval_wait < math.inf
        ):
            raise ValueError(f"approval_wait must be a number of seconds >= 0, not {approval_wait!r}")
        self._client = client
        self.permit_id = permit_id
        self.tool = tool
        self.idempotency_key = idempotency_key
        self.fingerprint = fingerprint if fingerprint is not None else fingerprint_of(request)
        self.cost = cost
        self.holder_token = holder_token if holder_token is not None else secrets.token_bytes(16)
        # A token made here is this call's alone: a DISPATCH redelivered to
        # it repeats a reservation one of its own tries made, whose answer
        # was lost, so nothing was sent. One the caller gave may repeat an
        # earlier run's, which may have sent.
        self._token_is_ours = holder_token is None
        self._timeout = timeout
        self.retry = retry if retry is not None else client.retry
        self.approval_summary = approval_summary
        #: Seconds this call may wait for a person's decision.
        self.approval_wait = float(approval_wait)
        #: Set by :meth:`authorize`.
        self.attempt: Optional[pb.Attempt] = None
        self.replayed = False
        self.redelivered = False
        #: Seconds atmost said were left of the DISPATCH's lease (None
        #: before it, or from a server that does not say).
        self.lease_remaining: Optional[float] = None
        self.result: Any = None
        self.outcome: Optional[Outcome] = None
        #: The seconds the binding rule gave the dispatch (what was left of
        #: the lease less the margin, counted from the Authorize try that
        #: was answered; or the caller's timeout, counted from when DISPATCH
        #: arrived), and the deadline's instant on time.monotonic():
        #: :meth:`time_left` is what remains of it.
        self.timeout: Optional[float] = None
        self.deadline: Optional[float] = None
        # "new" -> "dispatch" -> "settling" -> "settled"; "replay" for a
        # REPLAY, "held" for a DISPATCH an earlier run holds.
        self._state = "new"

    # --- reading it ---

    @property
    def attempt_id(self) -> str:
        """The attempt id: what the tool gets as its own idempotency key."""
        return self.attempt.attempt_id if self.attempt is not None else ""

    @property
    def receipt(self) -> Optional[pb.Receipt]:
        return self.attempt.receipt if self.attempt is not None and self.attempt.HasField("receipt") else None

    def time_left(self) -> float:
        """Seconds left before the dispatch deadline (0 when past it)."""
        if self.deadline is None:
            raise RuntimeError("the call holds no DISPATCH")
        return max(self.deadline - time.monotonic(), 0.0)

    # --- the steps ---

    def authorize(self) -> "GuardedCall":
        """Authorize, retried per ``retry`` with the same key, fingerprint,
        cost and holder token. A REPLAY of SUCCEEDED sets ``replayed``,
        ``result`` and ``outcome``; of FAILED raises ToolFailed; of
        UNCERTAIN raises OutcomeUncertain; of DENIED raises ApprovalDenied.
        A call awaiting approval is waited for within ``approval_wait``
        (the same request asked again, atmost holding each ask open for up
        to 55 s), then raises AwaitingApproval if still undecided. A
        DISPATCH redelivered to a token the caller gave raises
        HeldByEarlierRun. A DISPATCH sets the deadline; one that leaves no
        time to send is given back (Commit NotSent) and raises NotSent."""
        if self._state != "new":
            raise RuntimeError("a guarded call authorizes once")
        self._state = "authorizing"
        client = self._client
        tries: List[float] = []  # when each try was sent, on time.monotonic()

        def send(timeout: float, wait: float = 0.0) -> pb.AuthorizeResponse:
            tries.append(time.monotonic())
            return client.authorize(
                self.permit_id,
                self.tool,
                self.idempotency_key,
                self.fingerprint,
                cost=self.cost,
                holder_token=self.holder_token,
                approval_summary=self.approval_summary,
                wait=wait if wait > 0 else None,
                timeout=timeout,
            )

        answer = client._retrying("Authorize", send, self.retry, in_progress=True)
        redelivered = answer.redelivered
        waited = answer.decision == pb.DECISION_AWAIT_APPROVAL
        if waited:
            answer, redelivered = self._await_decision(answer, send)
        arrived = time.monotonic()
        attempt = answer.attempt
        if not answer.HasField("attempt") or not attempt.attempt_id:
            # A broken server (or a proxy): no attempt id to send under, nor to settle.
            decision = (
                pb.Decision.Name(answer.decision)
                if answer.decision in pb.Decision.values()
                else f"decision {answer.decision}"
            )
            raise AtmostError(f"atmost answered Authorize {decision} without an attempt; nothing was sent")
        self.attempt = attempt
        if answer.decision == pb.DECISION_AWAIT_APPROVAL:
            self._state = "awaiting"
            raise AwaitingApproval(attempt)
        if answer.decision == pb.DECISION_REPLAY and attempt.state == pb.ATTEMPT_STATE_DENIED:
            self._state = "replay"
            # A denial this call waited for is news, not a replay.
            self.replayed = not waited
            raise ApprovalDenied(attempt, replayed=not waited)
        if answer.decision == pb.DECISION_REPLAY:
            self._state = "replay"
            self.replayed = True
            if attempt.state == pb.ATTEMPT_STATE_SUCCEEDED:
                self.result = attempt.receipt.result
                self.outcome = Outcome(self.result, True, attempt)
                return self
            if attempt.state == pb.ATTEMPT_STATE_FAILED:
                failed = ToolFailed(attempt.failure_reason)
                failed.replayed, failed.attempt_id, failed.attempt = True, attempt.attempt_id, attempt
                raise failed
            if attempt.state == pb.ATTEMPT_STATE_UNCERTAIN:
                raise OutcomeUncertain(
                    f"the key's earlier call has an unknown outcome ({attempt.uncertain_reason});"
                    " an operator resolves it",
                    attempt_id=attempt.attempt_id,
                    replayed=True,
                    attempt=attempt,
                )
            raise AtmostError(
                f"atmost replayed an attempt in state {attempt.state}, which this client does not know"
            )
        if answer.decision != pb.DECISION_DISPATCH:
            raise AtmostError(f"atmost answered decision {answer.decision}, which this client does not know")
        self.redelivered = redelivered
        if answer.HasField("lease_remaining"):
            self.lease_remaining = max(answer.lease_remaining.ToNanoseconds() / 1e9, 0.0)
        if self.redelivered and not self._token_is_ours:
            self._state = "held"
            raise HeldByEarlierRun(attempt, self.lease_remaining)
        self._state = "dispatch"
        expires, created = attempt.lease_expires_at, attempt.created_at
        # In whole seconds and nanoseconds: exact, where two epoch floats would round.
        lease = (expires.seconds - created.seconds) + (expires.nanos - created.nanos) / 1e9
        self.deadline, self.timeout = dispatch_deadline(
            self.lease_remaining,
            lease,
            first_try=tries[0],
            answered_try=tries[-1],
            arrived=arrived,
            timeout=self._timeout,
        )
        if self.deadline - arrived <= 0:
            self.not_sent(
                NotSent(
                    f"the lease leaves no time to send ({self.deadline - arrived:.3g} s left at the"
                    f" DISPATCH after the {LEASE_MARGIN} s margin)"
                )
            )
        return self

    def _await_decision(
        self, answer: pb.AuthorizeResponse, send: Callable[..., pb.AuthorizeResponse]
    ) -> Tuple[pb.AuthorizeResponse, bool]:
        """While the call awaits approval, asks again with the same request
        and holder token and a ``wait`` (at most 55 s each; atmost holds the
        call open until the decision), within ``approval_wait``: the first
        answer that is not AWAIT_APPROVAL, or the last one; and whether its
        DISPATCH, if it is one, was a redelivery. Each ask's deadline and
        retry budget are longer by its wait."""
        client = self._client
        until = time.monotonic() + self.approval_wait
        hold = MAX_APPROVAL_HOLD
        held = False
        while answer.decision == pb.DECISION_AWAIT_APPROVAL:
            left = until - time.monotonic()
            if left <= 0:
                break
            wait = min(left, hold)
            last = answer

            def ask(
                timeout: float, wait: float = wait, last: pb.AuthorizeResponse = last
            ) -> pb.AuthorizeResponse:
                nonlocal hold
                asked = time.monotonic()
                try:
                    return send(timeout, wait)
                except Unavailable as error:
                    cut = time.monotonic() - asked
                    # atmost's --request-timeout (10 s by default) ends a
                    # held call before its wait, CANCELLED "Timeout
                    # expired": nothing changed (the call still waits, as
                    # last answered), and the next asks hold less than that.
                    if error.code == grpc.StatusCode.CANCELLED and error.reason is None and cut >= _MIN_CUT:
                        hold = max(min(hold, cut - _CUT_MARGIN), _MIN_CUT - _CUT_MARGIN)
                        return last
                    raise

            answer = client._retrying("Authorize", ask, self.retry, in_progress=True, held=wait)
            held = True
        if answer.decision != pb.DECISION_DISPATCH or not held:
            return answer, answer.redelivered
        # atmost claimed the approved call while it held the ask open: the
        # lease_remaining it sent was measured then, up to the whole wait
        # after the ask was sent, and the ask's start is all this process
        # can count it from (a claim late in a long wait would leave no
        # time to send). Asked once more without a wait (the same holder
        # token), atmost redelivers the same DISPATCH to this call, which
        # has sent nothing, with what is left of the lease now, counted
        # from a try just sent. Should that ask fail, the first answer
        # stands, its deadline counted from the held ask: shorter, never
        # longer than the lease.
        try:
            again = client._retrying("Authorize", send, self.retry, in_progress=True)
        except AtmostError:
            return answer, answer.redelivered
        if (
            again.decision == pb.DECISION_DISPATCH
            and again.redelivered
            and again.attempt.attempt_id == answer.attempt.attempt_id
        ):
            return again, answer.redelivered
        return answer, answer.redelivered

    def succeeded(self, result: Any, *, actual_cost: Optional[int] = None) -> Outcome:
        """The tool answered: Commit Succeeded with ``result`` (recorded as
        :func:`encode_result` says) and return the :class:`Outcome`.
        ``actual_cost`` (an int in 0..2^63-1) replaces the cost reserved.
        When nothing could be recorded (an ``actual_cost`` out of range, a
        Commit that failed, or answered without the SUCCEEDED attempt and
        its receipt), CommitNotRecorded carries ``result``."""
        self._require_dispatch()
        self._state = "settling"
        if actual_cost is not None and (
            isinstance(actual_cost, bool)
            or not isinstance(actual_cost, int)
            or not 0 <= actual_cost <= MAX_COST
        ):
            why = (
                ValueError(f"actual_cost {actual_cost} is outside 0..2^63-1")
                if isinstance(actual_cost, int) and not isinstance(actual_cost, bool)
                else TypeError(
                    f"actual_cost must be an int, not {type(actual_cost).__name__} {actual_cost!r}"
                )
            )
            raise self._not_recorded("SUCCEEDED", why, result=result) from why
        data = encode_result(result)
        attempt = self._commit("SUCCEEDED", result=data, actual_cost=actual_cost, value=result).attempt
        if attempt.state != pb.ATTEMPT_STATE_SUCCEEDED or not attempt.HasField("receipt"):
            # A broken server (or a proxy): what it recorded is unknown, the result must not be lost.
            state = attempt.state
            name = pb.AttemptState.Name(state) if state in pb.AttemptState.values() else f"state {state}"
            why = AtmostError(f"atmost answered the Commit with the attempt {name} and no receipt")
            if state == pb.ATTEMPT_STATE_SUCCEEDED:
                why = AtmostError("atmost answered the Commit with the attempt SUCCEEDED but no receipt")
            raise self._not_recorded("SUCCEEDED", why, result=result) from why
        self.attempt = attempt
        self.result = result
        self.outcome = Outcome(result, False, attempt, self.redelivered)
        self._state = "settled"
        return self.outcome

    def failed(self, error: ToolFailed) -> None:
        """The tool refused: Commit Failed (its reason cut to 1024 bytes),
        then raise ``error``."""
        self._require_dispatch()
        self._state = "settling"
        reason = clip_reason(text_of(getattr(error, "failure_reason", "")))
        self.attempt = self._commit("FAILED", failed=reason, failure_reason=reason).attempt
        self._state = "settled"
        error.attempt_id, error.attempt = self.attempt_id, self.attempt
        raise error

    def not_sent(self, error: NotSent) -> None:
        """The call never left: Commit NotSent (slot, cost and key come
        back), then raise ``error``."""
        self._require_dispatch()
        self._state = "settling"
        self.attempt = self._commit("NOT_SENT", not_sent=True).attempt
        self._state = "settled"
        error.attempt_id = self.attempt_id
        raise error

    def uncertain(self, reason: str) -> OutcomeUncertain:
        """The call may have gone out and nobody knows its outcome:
        MarkUncertain(reason) and return the OutcomeUncertain to raise."""
        self._require_dispatch()
        self._state = "settling"
        client = self._client
        reason = clip_reason(text_of(reason))
        try:
            answer = client._retrying(
                "MarkUncertain",
                lambda timeout: client.mark_uncertain(
                    self.permit_id, self.idempotency_key, self.attempt_id, reason, timeout=timeout
                ),
                self.retry,
            )
        except Exception as error:  # noqa: BLE001 (an RPC error, or a closed channel's ValueError)
            raise self._not_recorded("UNCERTAIN", error, failure_reason=reason) from error
        self.attempt = answer.attempt
        self._state = "settled"
        return OutcomeUncertain(
            f"the call's outcome is unknown ({reason}); marked UNCERTAIN, nothing will be sent again",
            attempt_id=self.attempt_id,
            attempt=self.attempt,
        )

    # --- the context manager ---

    def __enter__(self) -> "GuardedCall":
        return self.authorize()

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> Literal[False]:
        if self._state != "dispatch":
            return False  # a replay, or settled (or settling failed): nothing to record
        if error is not None and not isinstance(error, Exception):
            # KeyboardInterrupt, SystemExit, GeneratorExit: recorded if it can
            # be, and let through as they are, never swallowed.
            _uncertain_if_possible(self, _describe(error))
            return False
        if error is None:
            raise self.uncertain("the guarded block ended without settling the call") from RuntimeError(
                "leave the block by call.succeeded(result), raise ToolFailed(reason) or raise NotSent()"
            )
        if isinstance(error, ToolFailed) and _ours(error, self.attempt_id):
            self.failed(error)
        if isinstance(error, NotSent) and _ours(error, self.attempt_id):
            self.not_sent(error)
        raise self.uncertain(_describe(error)) from error

    # --- inside ---

    def _require_dispatch(self) -> None:
        if self._state != "dispatch":
            raise RuntimeError(
                "this guarded call holds no DISPATCH to settle"
                + (
                    " (it is a REPLAY: send nothing)"
                    if self._state == "replay"
                    else " (an earlier run holds it: client.settle_not_sent or settle_uncertain settles it)"
                    if self._state == "held"
                    else f" (state {self._state})"
                )
            )

    def _commit(
        self, outcome: str, *, value: Any = None, failure_reason: Optional[str] = None, **kw: Any
    ) -> Any:
        client = self._client
        try:
            return client._retrying(
                "Commit",
                lambda timeout: client.commit(
                    self.permit_id, self.idempotency_key, self.attempt_id, timeout=timeout, **kw
                ),
                self.retry,
            )
        except Exception as error:  # noqa: BLE001 (an RPC error, a closed channel's ValueError, protobuf's TypeError)
            raise self._not_recorded(outcome, error, result=value, failure_reason=failure_reason) from error

    def _not_recorded(
        self, outcome: str, error: BaseException, *, result: Any = None, failure_reason: Optional[str] = None
    ) -> CommitNotRecorded:
        """The CommitNotRecorded to raise from ``error``: nothing more will
        be recorded by this call."""
        self._state = "settled"
        return CommitNotRecorded(
            f"could not record attempt {self.attempt_id} as {outcome} ({_describe(error)});"
            " it becomes UNCERTAIN at its lease",
            attempt_id=self.attempt_id,
            outcome=outcome,
            result=result,
            failure_reason=failure_reason,
        )


def dispatch_deadline(
    lease_remaining: Optional[float],
    lease: float,
    *,
    first_try: float,
    answered_try: float,
    arrived: float,
    timeout: Optional[float],
) -> Tuple[float, float]:
    """The dispatch deadline, an instant on time.monotonic(), and the
    seconds that rule granted: ``(deadline, granted)``.

    ``lease_remaining`` is what atmost said was left of the lease when it
    decided, on the store's clock, counted here from ``answered_try``, the
    instant the Authorize try it answered was sent (always before the
    reservation it got, and before the decision): an answer held up on
    its way back (a slow network, a proxy) spends the lease, never extends
    it. Less :data:`LEASE_MARGIN`, for the two clocks' rates. From a server
    that does not say (``None``), the attempt's whole ``lease`` counted
    from ``first_try``, the call's first Authorize try: every reservation a
    try of this call can hold was made after it was sent. The caller's
    ``timeout``, counted from ``arrived`` (when the DISPATCH arrived), can
    only shorten it: past the lease the attempt reads UNCERTAIN, an
    operator may resolve it NotSent and the key be used again, and a call
    still sent then would exceed the cap. ``granted`` is the binding rule's
    own number (the lease less the margin, or the timeout)."""
    if lease_remaining is not None:
        granted, start = lease_remaining - LEASE_MARGIN, answered_try
    else:
        granted, start = lease - LEASE_MARGIN, first_try
    deadline = start + granted
    if timeout is not None and arrived + timeout < deadline:
        granted, deadline = float(timeout), arrived + timeout
    return deadline, granted


def _ours(error: Union[ToolFailed, NotSent], attempt_id: str) -> bool:
    """Whether a ToolFailed or NotSent is the dispatch's own report on this
    attempt: one it made, naming no attempt (or this one). One that names
    another attempt, or is a replay, was raised by a guarded call made
    inside the dispatch and passed through it: it tells what became of that
    inner call, not of this one, which may well have sent (the inner call
    did, or tried). Honoured, a NotSent would give this call's slot back;
    so it is treated like any other error: MarkUncertain."""
    if getattr(error, "replayed", False):
        return False
    return error.attempt_id is None or error.attempt_id == attempt_id


def _describe(error: BaseException) -> str:
    text = text_of(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _uncertain_if_possible(call: GuardedCall, reason: str) -> None:
    """MarkUncertain for a KeyboardInterrupt or SystemExit on its way out:
    best effort, so that it goes on as it is whatever happens here."""
    try:
        call.uncertain(reason)
    except Exception:  # noqa: BLE001 (CommitNotRecorded: the attempt turns UNCERTAIN at its lease)
        _log.warning("could not mark attempt %s UNCERTAIN on the way out", call.attempt_id, exc_info=True)


# === the function forms ===


def call_guarded(
    client: "Client",
    permit_id: str,
    tool: str,
    idempotency_key: str,
    dispatch: Callable[[str], Any],
    *,
    dispatch_timeout: Optional[float] = None,
    **options: Any,
) -> Outcome:
    """Runs ``dispatch(attempt_id)`` under atmost, once at most.

    Returns the :class:`Outcome` (the dispatch's result, or the stored one
    on a REPLAY, which never calls ``dispatch``). ``dispatch`` runs in a
    worker thread and is waited for until the deadline (``dispatch_timeout``
    seconds, but never past the lease less 1 s, the default): past it the
    attempt is marked UNCERTAIN and OutcomeUncertain raised; the thread
    cannot be stopped and whatever it returns later is dropped. A worker
    thread that had not yet started ``dispatch`` by the deadline never
    starts it: that is Commit NotSent, and NotSent raised.
    A DISPATCH redelivered to a ``holder_token`` you gave raises
    HeldByEarlierRun without calling ``dispatch``.
    ``dispatch`` raising a ToolFailed or NotSent of its own is recorded as
    such and raised; anything else it raises, a ToolFailed or NotSent of a
    guarded call made inside it included, is recorded UNCERTAIN and raised
    as OutcomeUncertain from it; a KeyboardInterrupt or SystemExit (raised
    by ``dispatch``, or arriving while this waits for it) is recorded
    UNCERTAIN when it can be and raised again as it is. The other options
    are :class:`GuardedCall`'s.
    """
    if not callable(dispatch):
        raise TypeError("dispatch must be callable: dispatch(attempt_id) -> result")
    call = GuardedCall(client, permit_id, tool, idempotency_key, timeout=dispatch_timeout, **options)
    call.authorize()
    if call.replayed:
        assert call.outcome is not None
        return call.outcome
    done = threading.Event()
    box: dict = {}
    # The handshake between the worker and this thread, under ``lock``: the
    # worker calls dispatch only when this thread has not given up and the
    # deadline has not passed, and says so ("started"); this thread, once it
    # stops waiting, gives up ("gave_up"), after which dispatch is never
    # called. A worker scheduled late (a loaded machine) so never begins a
    # send past the deadline, or after the attempt was settled, and a
    # dispatch that never started is known for sure to have sent nothing.
    lock = threading.Lock()
    phase = {"started": False, "gave_up": False}

    def work() -> None:
        try:
            with lock:
                if phase["gave_up"] or call.time_left() <= 0:
                    phase["gave_up"] = True
                    return
                phase["started"] = True
            box["result"] = dispatch(call.attempt_id)
        except BaseException as e:  # noqa: BLE001 (every ending is recorded, none re-raised in the thread)
            box["error"] = e
        finally:
            done.set()

    def give_up() -> bool:
        """Stops dispatch from starting from now on; whether it started."""
        with lock:
            phase["gave_up"] = True
            return phase["started"]

    worker = threading.Thread(target=work, name=f"atmost dispatch {idempotency_key}", daemon=True)
    try:
        worker.start()
        finished = done.wait(call.time_left())
    except BaseException as interrupted:  # KeyboardInterrupt (Ctrl-C), SystemExit from a signal handler
        # The dispatch may be sending: recorded as unknown if it can be, and
        # the interruption goes on as it is, never swallowed.
        give_up()
        _uncertain_if_possible(call, f"interrupted while waiting for dispatch: {_describe(interrupted)}")
        raise
    if not give_up():
        # The worker never called dispatch, and now never will: nothing was sent.
        call.not_sent(
            NotSent(
                f"no time to dispatch: the worker thread did not start dispatch within its deadline of"
                f" {call.timeout:.3g} s; nothing was sent"
            )
        )
    if not finished:
        raise call.uncertain(
            f"dispatch did not return within its deadline of {call.timeout:.3g} s"
        ) from TimeoutError(f"dispatch still running after {call.timeout:.3g} s")
    error = box.get("error")
    if error is None:
        return call.succeeded(box["result"])
    if isinstance(error, ToolFailed) and _ours(error, call.attempt_id):
        call.failed(error)
    if isinstance(error, NotSent) and _ours(error, call.attempt_id):
        call.not_sent(error)
    if not isinstance(error, Exception):
        # dispatch raised KeyboardInterrupt, SystemExit or GeneratorExit:
        # recorded as unknown if it can be, then raised again as it is.
        _uncertain_if_possible(call, _describe(error))
        raise error
    raise call.uncertain(_describe(error)) from error


def guarded(
    client: "Client",
    *,
    permit_id: Any,
    tool: Any,
    key: Any,
    cost: Any = 0,
    request: Optional[Callable[..., Any]] = None,
    dispatch_timeout: Optional[float] = None,
    retry: Optional["Retry"] = None,
    approval_summary: Any = "",
    approval_wait: Union[float, datetime.timedelta] = 0,
) -> Callable[[Callable[..., Any]], Callable[..., Outcome]]:
    """A decorator: each call of the function is one guarded call.

    The function gets the attempt id as the keyword argument ``attempt_id``
    (for the tool's own idempotency key); calling the decorated function
    returns an :class:`Outcome`. ``permit_id``, ``tool``, ``key`` and
    ``cost`` are values or functions of the call's arguments (``key``
    usually is one: the same logical call must give the same key on every
    retry). ``request(*args, **kwargs)`` gives the JSON value fingerprinted;
    by default ``{"args": [...], "kwargs": {...}}`` of the call.
    ``approval_summary`` (a value or a function of the call's arguments)
    and ``approval_wait`` are :class:`GuardedCall`'s.
    """

    def pick(value: Any, args: Any, kwargs: Any) -> Any:
        return value(*args, **kwargs) if callable(value) else value

    def decorate(fn: Callable[..., Any]) -> Callable[..., Outcome]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Outcome:
            body = request(*args, **kwargs) if request is not None else {"args": list(args), "kwargs": kwargs}
            return call_guarded(
                client,
                pick(permit_id, args, kwargs),
                pick(tool, args, kwargs),
                pick(key, args, kwargs),
                lambda attempt_id: fn(*args, attempt_id=attempt_id, **kwargs),
                request=body,
                cost=pick(cost, args, kwargs),
                dispatch_timeout=dispatch_timeout,
                retry=retry,
                approval_summary=pick(approval_summary, args, kwargs),
                approval_wait=approval_wait,
            )

        return wrapper

    return decorate
