"""What a DISPATCH's ending records (SPEC E), against a live atmost: the
endings that are not a plain result, ToolFailed or an exception. A result
JSON cannot write, a reason that is not a string, an actual cost out of
range, a Commit or MarkUncertain that raises something other than an RPC
error (the client closed under it), a Commit a broken server answers
without the receipt, and KeyboardInterrupt / SystemExit, which are recorded
and go on as they are. In every case the caller gets the result or the
error, never a bare ValueError, and the result is never dropped."""

from __future__ import annotations

import math
import signal
import threading
from typing import Any, List

import pytest

from atmost_client import (
    AtmostError,
    Client,
    CommitNotRecorded,
    OutcomeUncertain,
    ToolFailed,
    pb,
)

TOOL = "wallet.charge"
REQUEST = {"amount": 500, "currency": "EUR", "to": "acct_42"}


def new_permit(client: Client, **kw: Any) -> str:
    return client.create_permit([TOOL], **kw).permit_id


def state_of(client: Client, permit: str, key: str) -> int:
    return client.get_attempt(permit, key).attempt.state


def never(attempt_id: str) -> Any:
    raise AssertionError(f"dispatch called ({attempt_id}) where nothing may be sent")


# === what is stored ===


def test_nan_and_the_infinities_in_a_result_are_stored_as_null(client):
    permit = new_permit(client)
    result = {"rate": math.nan, "bounds": [1.5, math.inf, -math.inf]}
    outcome = client.call_guarded(permit, TOOL, "nan", lambda _: result, request=1)
    assert outcome.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED
    assert outcome.receipt.result == b'{"rate":null,"bounds":[1.5,null,null]}'
    assert outcome.result is result and math.isnan(outcome.result["rate"])  # the result as the tool gave it
    with client.guard(permit, TOOL, "nan-2", request=2) as call:
        assert call.succeeded([math.nan]).receipt.result == b"[null]"
    # A lone surrogate, no UTF-8, is written escaped (as JSON.stringify writes it).
    lone = client.call_guarded(permit, TOOL, "surrogate", lambda _: ["\ud800", "é"], request=3)
    assert lone.receipt.result == b'["\\ud800","\\u00e9"]'


class Handle:
    pass


def cycle() -> Any:
    looped: List[Any] = [1]
    looped.append({"again": looped})
    return looped


class ChangedWhileWritten(dict):
    """A mapping whose own code raises while json writes it (not a TypeError or ValueError)."""

    def items(self) -> Any:
        raise RuntimeError("dictionary changed size during iteration")


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"tags": {"a"}},
        Handle,
        cycle,
        lambda: {"tx": ChangedWhileWritten(a=1)},
        lambda: [math.nan, ChangedWhileWritten(a=1)],  # raises again where NaN is made null
    ],
)
def test_a_result_json_cannot_write_is_recorded_succeeded_and_empty(client, make):
    permit = new_permit(client)
    result = make()
    outcome = client.call_guarded(permit, TOOL, "k", lambda _: result, request=1)
    # The call went out and the tool answered: Succeeded, whatever its result is.
    assert outcome.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED
    assert outcome.receipt.result == b""
    assert outcome.result is result
    replay = client.call_guarded(permit, TOOL, "k", never, request=1)
    assert replay.replayed and replay.result == b""  # a replay has nothing more to give


class Declined(ToolFailed):
    """A tool's own ToolFailed that keeps its structured reason."""

    def __init__(self, code: int) -> None:
        super().__init__("declined")
        self.failure_reason = code  # type: ignore[assignment]


@pytest.mark.parametrize("reason, stored", [(42, "42"), ({"code": 7}, "{'code': 7}"), (None, "None")])
def test_a_reason_that_is_not_a_string_is_recorded_as_its_text(client, reason, stored):
    permit = new_permit(client)

    def declined(attempt_id: str) -> Any:
        raise ToolFailed(reason)

    with pytest.raises(ToolFailed) as caught:
        client.call_guarded(permit, TOOL, "k", declined, request=1)
    assert caught.value.attempt.state == pb.ATTEMPT_STATE_FAILED
    assert caught.value.attempt.failure_reason == stored == caught.value.failure_reason
    # One set after it was made, by a subclass of the tool's.
    with pytest.raises(Declined) as subclass:
        with client.guard(permit, TOOL, "k2", request=2):
            raise Declined(51)
    assert subclass.value.attempt.failure_reason == "51"


# === nothing could be recorded: CommitNotRecorded, with the result ===


@pytest.mark.parametrize(
    "cost, kind", [(1.5, TypeError), (2**63, ValueError), ("3", TypeError), (-1, ValueError)]
)
def test_an_actual_cost_out_of_range_records_nothing_and_keeps_the_result(client, cost, kind):
    permit = new_permit(client)
    with pytest.raises(CommitNotRecorded) as caught:
        with client.guard(permit, TOOL, "k", request=1, cost=5) as call:
            call.succeeded({"tx": 1}, actual_cost=cost)
    e = caught.value
    assert (e.outcome, e.result, e.attempt_id) == ("SUCCEEDED", {"tx": 1}, call.attempt_id)
    assert isinstance(e.__cause__, kind)
    # Nothing recorded: the attempt turns UNCERTAIN at its lease.
    assert state_of(client, permit, "k") == pb.ATTEMPT_STATE_RESERVED


def test_an_actual_cost_in_range_is_recorded(client):
    permit = new_permit(client)
    with client.guard(permit, TOOL, "k", request=1, cost=5) as call:
        outcome = call.succeeded({"tx": 1}, actual_cost=3)
    assert outcome.receipt.cost == 3


def test_a_closed_client_under_the_commit_is_commit_not_recorded(server):
    with Client(server.address) as direct:
        permit = new_permit(direct)
        c = Client(server.address)

        def sent_then_closed(attempt_id: str) -> Any:
            c.close()  # the Commit meets grpc's ValueError: "Cannot invoke RPC on closed channel!"
            return {"tx": 1}

        with pytest.raises(CommitNotRecorded) as caught:
            c.call_guarded(permit, TOOL, "succeeded", sent_then_closed, request=1)
        e = caught.value
        assert (e.outcome, e.result) == ("SUCCEEDED", {"tx": 1}) and e.attempt_id
        assert isinstance(e.__cause__, ValueError) and not isinstance(e.__cause__, AtmostError)
        assert state_of(direct, permit, "succeeded") == pb.ATTEMPT_STATE_RESERVED

        # The same for Commit Failed and for MarkUncertain.
        for key, ending, outcome in (
            ("failed", ToolFailed("card declined"), "FAILED"),
            ("reset", ConnectionResetError("reset after sending"), "UNCERTAIN"),
        ):
            c = Client(server.address)

            def closed_then(attempt_id: str, ending: BaseException = ending, c: Client = c) -> Any:
                c.close()
                raise ending

            with pytest.raises(CommitNotRecorded) as caught:
                c.call_guarded(permit, TOOL, key, closed_then, request=1)
            assert caught.value.outcome == outcome and isinstance(caught.value.__cause__, ValueError)
            assert caught.value.failure_reason in (
                "card declined",
                "ConnectionResetError: reset after sending",
            )
            assert state_of(direct, permit, key) == pb.ATTEMPT_STATE_RESERVED


def without_receipt(request: bytes, context: Any, forward: Any) -> bytes:
    """A broken server's Commit: applied, answered without the receipt."""
    answer = pb.CommitResponse.FromString(forward(request))
    answer.attempt.ClearField("receipt")
    return answer.SerializeToString()


def still_reserved(request: bytes, context: Any, forward: Any) -> bytes:
    """A broken server's Commit: not applied, answered with the attempt as it was."""
    commit = pb.CommitRequest.FromString(request)
    return pb.CommitResponse(
        attempt=pb.Attempt(attempt_id=commit.attempt_id, state=pb.ATTEMPT_STATE_RESERVED)
    ).SerializeToString()


@pytest.mark.parametrize("hook", [without_receipt, still_reserved])
def test_a_commit_answered_without_a_receipt_keeps_the_result(server, front_end, hook):
    front = front_end(server.address, Commit=hook)
    with Client(front.address) as c:
        permit = new_permit(c)
        with pytest.raises(CommitNotRecorded) as caught:
            c.call_guarded(permit, TOOL, "k", lambda _: {"tx": 1}, request=1)
    e = caught.value
    assert (e.outcome, e.result) == ("SUCCEEDED", {"tx": 1}) and e.attempt_id
    assert isinstance(e.__cause__, AtmostError)
    assert front.calls.count("Commit") == 1


# === KeyboardInterrupt, SystemExit: recorded, then raised as they are ===


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_dispatch_is_marked_uncertain_and_raised_again(client, kind):
    permit = new_permit(client)

    def interrupted(attempt_id: str) -> Any:
        raise kind("stop")

    with pytest.raises(kind):
        client.call_guarded(permit, TOOL, "function", interrupted, request=1)
    attempt = client.get_attempt(permit, "function").attempt
    assert attempt.state == pb.ATTEMPT_STATE_UNCERTAIN
    assert attempt.uncertain_reason == f"{kind.__name__}: stop"

    @client.guarded(permit_id=permit, tool=TOOL, key="decorated")
    def decorated(*, attempt_id: str) -> Any:
        raise kind("stop")

    with pytest.raises(kind):
        decorated()
    assert state_of(client, permit, "decorated") == pb.ATTEMPT_STATE_UNCERTAIN


def test_ctrl_c_while_waiting_for_dispatch_is_marked_uncertain_and_raised_again(client):
    # SIGINT to the main thread while it waits for the worker thread that
    # runs dispatch, as Ctrl-C does: the dispatch may be sending.
    permit = new_permit(client)
    release = threading.Event()
    main = threading.main_thread().ident
    assert threading.get_ident() == main
    # Python's own Ctrl-C handler, whatever this process inherited: a shell
    # starts a background job (a CI runner's, `cmd &`) with SIGINT ignored,
    # and Python then installs none.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)

    def sending(attempt_id: str) -> Any:
        signal.pthread_kill(main, signal.SIGINT)
        release.wait(30)
        return {"tx": "late"}

    try:
        with pytest.raises(KeyboardInterrupt):
            client.call_guarded(permit, TOOL, "k", sending, request=1)
    finally:
        release.set()
        signal.signal(signal.SIGINT, inherited)
    attempt = client.get_attempt(permit, "k").attempt
    assert attempt.state == pb.ATTEMPT_STATE_UNCERTAIN
    assert "interrupted while waiting for dispatch: KeyboardInterrupt" in attempt.uncertain_reason


def test_an_interrupt_goes_on_even_when_it_cannot_be_recorded(server):
    with Client(server.address) as direct:
        permit = new_permit(direct)
        c = Client(server.address)
        with pytest.raises(KeyboardInterrupt):
            with c.guard(permit, TOOL, "k", request=1):
                c.close()  # MarkUncertain cannot be sent now
                raise KeyboardInterrupt
        c = Client(server.address)

        def closed_then_interrupted(attempt_id: str) -> Any:
            c.close()
            raise SystemExit(3)

        with pytest.raises(SystemExit) as caught:
            c.call_guarded(permit, TOOL, "k2", closed_then_interrupted, request=1)
        assert caught.value.code == 3
        assert state_of(direct, permit, "k") == state_of(direct, permit, "k2") == pb.ATTEMPT_STATE_RESERVED


def test_a_guarded_block_that_raises_still_ends_uncertain(client):
    # Unchanged by the above: an ordinary exception is OutcomeUncertain.
    permit = new_permit(client)
    with pytest.raises(OutcomeUncertain):
        with client.guard(permit, TOOL, "k", request=1):
            raise TimeoutError("read timed out")
