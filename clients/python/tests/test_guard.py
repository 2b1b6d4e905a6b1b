"""The guarded call against a live atmost: each form, each ending, and the
paths the helper exists for (a lost response, a lost DISPATCH, a server not
up yet). The fake tool counts its side effects: "sent once" is a count."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, List, Optional

import grpc
import pytest
from conftest import free_port

from atmost_client import (
    AtmostError,
    Client,
    CommitNotRecorded,
    Denied,
    FingerprintError,
    HeldByEarlierRun,
    InProgress,
    InvalidRequest,
    NotSent,
    OutcomeUncertain,
    Retry,
    ToolFailed,
    Unavailable,
    fingerprint,
    pb,
)
from atmost_client.guard import LEASE_MARGIN, dispatch_deadline

TOOL = "wallet.charge"
REQUEST = {"amount": 500, "currency": "EUR", "to": "acct_42"}


class Tool:
    """A fake side-effecting tool: counts what it was sent."""

    def __init__(self, answer: Any = None) -> None:
        self.sent: List[str] = []
        self.answer = answer if answer is not None else {"tx": 981}

    def __call__(self, attempt_id: str) -> Any:
        self.sent.append(attempt_id)
        return self.answer


def never(attempt_id: str) -> Any:
    raise AssertionError(f"dispatch called ({attempt_id}) where nothing may be sent")


def new_permit(client: Client, cap: int = 0, **kw: Any) -> str:
    caps = {TOOL: cap} if cap else {}
    return client.create_permit([TOOL], max_calls_per_tool=caps, **kw).permit_id


def uncertain_ids(client: Client, permit_id: str) -> List[str]:
    return [a.attempt_id for a in client.iter_uncertain(permit_id)]


# === the function form ===


def test_dispatch_commits_succeeded_and_the_same_key_replays(client):
    permit = new_permit(client)
    tool = Tool()
    first = client.call_guarded(permit, TOOL, "charge-1", tool, request=REQUEST, cost=500)
    assert not first.replayed and not first.redelivered
    assert first.result == {"tx": 981}
    assert tool.sent == [first.attempt_id]
    assert first.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED
    assert first.receipt.result == b'{"tx":981}'
    assert first.receipt.cost == 500

    again = client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST, cost=500)
    assert again.replayed
    assert again.result == b'{"tx":981}' and again.json() == {"tx": 981}
    assert again.attempt_id == first.attempt_id
    assert again.receipt.receipt_id == first.receipt.receipt_id
    assert len(tool.sent) == 1


def test_bytes_are_stored_as_they_are_and_a_large_result_as_its_digest(client):
    permit = new_permit(client)
    small = client.call_guarded(permit, TOOL, "bytes", lambda _: b"\x00raw", fingerprint=b"f1")
    assert small.receipt.result == b"\x00raw"
    big = "x" * (64 * 1024)  # its JSON, with the quotes, is 2 bytes past 64 KiB
    large = client.call_guarded(permit, TOOL, "large", lambda _: big, fingerprint=b"f2")
    assert large.result == big
    import hashlib

    digest = hashlib.sha256(f'"{big}"'.encode()).hexdigest()
    assert large.receipt.result == b"sha256:" + digest.encode()


def test_a_cap_of_one_then_a_new_key_is_denied_with_the_numbers(client):
    permit = new_permit(client, cap=1)
    client.call_guarded(permit, TOOL, "charge-1", Tool(), request=REQUEST)
    with pytest.raises(Denied) as caught:
        client.call_guarded(permit, TOOL, "charge-2", never, request=REQUEST)
    e = caught.value
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.reason == "PERMIT_MAX_CALLS_EXCEEDED"
    assert (e.tool, e.limit, e.calls_made) == (TOOL, 1, 1)


def test_tool_failed_is_recorded_failed_and_replayed_as_such(client):
    permit = new_permit(client)

    def declined(attempt_id: str) -> Any:
        raise ToolFailed("card declined")

    with pytest.raises(ToolFailed) as caught:
        client.call_guarded(permit, TOOL, "charge-1", declined, request=REQUEST)
    assert not caught.value.replayed
    assert caught.value.attempt.state == pb.ATTEMPT_STATE_FAILED
    with pytest.raises(ToolFailed) as replay:
        client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST)
    assert replay.value.replayed
    assert replay.value.failure_reason == "card declined"
    assert replay.value.attempt_id == caught.value.attempt_id


def test_long_reasons_are_cut_to_what_atmost_keeps(client):
    permit = new_permit(client)

    def declined(attempt_id: str) -> Any:
        raise ToolFailed("é" * 600)  # 1200 bytes of UTF-8

    with pytest.raises(ToolFailed) as caught:
        client.call_guarded(permit, TOOL, "failed", declined, request=1)
    assert caught.value.attempt.failure_reason == "é" * 512

    def reset(attempt_id: str) -> Any:
        raise ConnectionResetError("ü" * 2000)

    with pytest.raises(OutcomeUncertain) as uncertain:
        client.call_guarded(permit, TOOL, "reset", reset, request=2)
    assert len(uncertain.value.attempt.uncertain_reason.encode()) == 1024


def test_not_sent_gives_the_slot_back(client):
    permit = new_permit(client, cap=1)

    def offline(attempt_id: str) -> Any:
        raise NotSent("the tool's host did not resolve")

    with pytest.raises(NotSent):
        client.call_guarded(permit, TOOL, "charge-1", offline, request=REQUEST)
    # The cap is 1 and the slot came back: a new key dispatches.
    tool = Tool()
    outcome = client.call_guarded(permit, TOOL, "charge-2", tool, request=REQUEST)
    assert not outcome.replayed and len(tool.sent) == 1


def test_a_lost_response_ends_uncertain_and_is_never_sent_again(client):
    # A lease of 1.5 s: the dispatch deadline is the lease less 1 s.
    permit = new_permit(client, cap=1, lease=1.5)
    release = threading.Event()
    sent: List[str] = []

    def hangs(attempt_id: str) -> Any:
        sent.append(attempt_id)
        release.wait(30)  # the response that never comes back (30 s: a broken deadline fails, never hangs)
        return {"tx": "late"}

    try:
        with pytest.raises(OutcomeUncertain) as caught:
            client.call_guarded(permit, TOOL, "charge-1", hangs, request=REQUEST)
        assert isinstance(caught.value.__cause__, TimeoutError)
        assert not caught.value.replayed
        assert caught.value.attempt_id == sent[0]
        listed = list(client.iter_uncertain(permit))
        assert [a.attempt_id for a in listed] == [sent[0]]
        assert "deadline" in listed[0].uncertain_reason
        # The same key: the same unknown, nothing sent.
        with pytest.raises(OutcomeUncertain) as replay:
            client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST)
        assert replay.value.replayed and replay.value.attempt_id == sent[0]
        # A new key: the slot is held by the unknown call.
        with pytest.raises(Denied) as denied:
            client.call_guarded(permit, TOOL, "charge-2", never, request=REQUEST)
        assert denied.value.reason == "PERMIT_MAX_CALLS_EXCEEDED"
        assert len(sent) == 1
    finally:
        release.set()


def test_an_explicit_dispatch_timeout_and_a_raising_dispatch_end_uncertain(client):
    permit = new_permit(client)
    release = threading.Event()
    try:
        with pytest.raises(OutcomeUncertain):
            client.call_guarded(
                permit, TOOL, "slow", lambda _: release.wait(30), request=1, dispatch_timeout=0.2
            )

        def reset(attempt_id: str) -> Any:
            raise ConnectionResetError("reset after sending")

        with pytest.raises(OutcomeUncertain) as caught:
            client.call_guarded(permit, TOOL, "reset", reset, request=2)
        assert isinstance(caught.value.__cause__, ConnectionResetError)
        attempts = {a.idempotency_key: a for a in client.iter_uncertain(permit)}
        assert set(attempts) == {"slow", "reset"}
        assert "ConnectionResetError: reset after sending" in attempts["reset"].uncertain_reason
    finally:
        release.set()


def test_a_dispatch_timeout_never_outlasts_the_lease(client):
    # Past the lease the attempt reads UNCERTAIN, an operator may resolve it
    # NotSent and the key be used again: a call still being sent then would
    # exceed the cap. So a timeout longer than the lease-based deadline (a
    # 1.5 s lease less the 1 s margin) is cut to it.
    permit = new_permit(client, cap=1, lease=1.5)
    release = threading.Event()
    sent: List[str] = []

    def hangs(attempt_id: str) -> Any:
        sent.append(attempt_id)
        release.wait(30)
        return {"tx": "late"}

    try:
        with pytest.raises(OutcomeUncertain) as caught:
            client.call_guarded(permit, TOOL, "charge-1", hangs, request=REQUEST, dispatch_timeout=5)
        assert not caught.value.replayed and caught.value.attempt_id == sent[0]
        assert caught.value.attempt.uncertain_reason == (
            "dispatch did not return within its deadline of 0.5 s"
        )
    finally:
        release.set()

    # The default 30 s lease: a longer timeout is cut to 29 s, a shorter one kept.
    roomy = new_permit(client)
    for key, timeout, granted in (("long", 60, 29.0), ("short", 5, 5.0)):
        with client.guard(roomy, TOOL, key, request=REQUEST, timeout=timeout) as call:
            assert call.timeout == granted
            call.succeeded({"tx": key})
    # A lease under the margin leaves nothing, whatever the timeout: given back unsent.
    short = new_permit(client, cap=1, lease=0.9)
    with pytest.raises(NotSent):
        client.call_guarded(short, TOOL, "charge-1", never, request=REQUEST, dispatch_timeout=5)
    assert client.get_permit(short).usage[0].calls_made == 0


def test_a_worker_thread_run_past_the_deadline_never_starts_dispatch(client, monkeypatch):
    # A loaded machine schedules the worker thread that runs dispatch late:
    # here it does not run until the test lets it, after call_guarded gave
    # up at the deadline. Begun then, the send would go out after the call
    # was settled. It never begins: dispatch was surely not called, so the
    # slot comes back (Commit NotSent) and NotSent is raised.
    permit = new_permit(client, cap=1)
    go = threading.Event()
    workers: List[threading.Thread] = []

    class Late(threading.Thread):
        def start(self) -> None:
            if self.name.startswith("atmost dispatch"):
                workers.append(self)
            super().start()

        def run(self) -> None:
            if self in workers:
                go.wait(30)  # until the test lets it (30 s: only a guard against a hang)
            super().run()

    monkeypatch.setattr(threading, "Thread", Late)
    tool = Tool()
    try:
        with pytest.raises(NotSent) as caught:
            client.call_guarded(permit, TOOL, "late", tool, request=REQUEST, dispatch_timeout=0.2)
    finally:
        go.set()
        for worker in workers:
            worker.join(30)
    assert len(workers) == 1 and not workers[0].is_alive()
    assert tool.sent == [], "dispatch began after the call gave up"
    assert "no time to dispatch" in str(caught.value) and caught.value.attempt_id
    assert client.get_permit(permit).usage[0].calls_made == 0
    monkeypatch.undo()
    # The slot and the key came back: the same key dispatches now.
    outcome = client.call_guarded(permit, TOOL, "late", tool, request=REQUEST)
    assert not outcome.replayed and tool.sent == [outcome.attempt_id]


def test_a_guarded_call_inside_dispatch_does_not_settle_the_outer_call(client):
    # The outer dispatch makes a guarded call of its own and lets its
    # NotSent or ToolFailed through. That tells what became of the inner
    # call, not the outer one, which went out: the outer call is uncertain,
    # its slot held. (Taken as the outer call's NotSent, it would give the
    # slot back, and the key be free to send again.)
    permit = new_permit(client)

    def offline(attempt_id: str) -> Any:
        raise NotSent("the mailer's host did not resolve")

    def declined(attempt_id: str) -> Any:
        raise ToolFailed("card declined")

    outer_sent: List[str] = []

    def outer(inner: Any) -> Any:
        def dispatch(attempt_id: str) -> Any:
            outer_sent.append(attempt_id)  # the outer call's side effect went out
            return client.call_guarded(permit, TOOL, f"inner-of-{attempt_id}", inner, request=2)

        return dispatch

    for key, inner, kind in (("outer-1", offline, NotSent), ("outer-2", declined, ToolFailed)):
        with pytest.raises(OutcomeUncertain) as caught:
            client.call_guarded(permit, TOOL, key, outer(inner), request=1)
        cause = caught.value.__cause__
        assert isinstance(cause, kind), cause
        assert cause.attempt_id and cause.attempt_id != caught.value.attempt_id
        assert caught.value.attempt.state == pb.ATTEMPT_STATE_UNCERTAIN
    # The context manager: the same.
    with pytest.raises(OutcomeUncertain) as caught:
        with client.guard(permit, TOOL, "outer-3", request=1) as call:
            outer_sent.append(call.attempt_id)
            client.call_guarded(permit, TOOL, "inner-of-outer-3", offline, request=2)
    assert isinstance(caught.value.__cause__, NotSent)

    uncertain = {a.idempotency_key: a.attempt_id for a in client.iter_uncertain(permit)}
    assert set(uncertain) == {"outer-1", "outer-2", "outer-3"}
    assert sorted(uncertain.values()) == sorted(outer_sent)
    # The three outer calls and the inner FAILED one hold their slots; the
    # inner NotSent ones gave theirs back.
    assert client.get_permit(permit).usage[0].calls_made == 4


def test_a_lease_too_short_to_send_in_gives_the_slot_back(client):
    permit = new_permit(client, cap=1, lease=0.9)  # less than the 1 s margin
    with pytest.raises(NotSent) as caught:
        client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST)
    assert caught.value.attempt_id
    assert client.get_permit(permit).usage[0].calls_made == 0


def test_a_restart_with_a_kept_token_settles_the_attempt_and_never_sends_again(client, server):
    # Process A authorizes with a token it keeps in its journal, sends, and
    # dies before reporting: its guarded call is dropped unsettled. The
    # restarted process makes the same call (key, request, token): atmost
    # redelivers the DISPATCH, and the call must not send again.
    permit = new_permit(client, cap=2)
    CHARGE = dict(request=REQUEST, cost=500)
    tool = Tool()
    token = b"kept in the journal with charge-1"
    crashed = client.guard(permit, TOOL, "charge-1", **CHARGE, holder_token=token).authorize()
    tool(crashed.attempt_id)
    del crashed

    retries: List[str] = []
    other = Retry(on_retry=lambda rpc, e, delay: retries.append(e.reason or ""))
    with pytest.raises(InProgress) as caught:
        # Another worker: the lease (30 s) is past the retry budget (10 s), so it is not waited for.
        client.call_guarded(
            permit,
            TOOL,
            "charge-1",
            never,
            request=REQUEST,
            cost=500,
            holder_token=os.urandom(16),
            retry=other,
        )
    assert caught.value.reason == "IDEMPOTENCY_IN_PROGRESS"
    assert caught.value.retry_after is not None and caught.value.retry_after > 10
    assert retries == []

    with Client(server.address) as restarted:
        with pytest.raises(HeldByEarlierRun) as held:
            restarted.call_guarded(permit, TOOL, "charge-1", tool, **CHARGE, holder_token=token)
        with pytest.raises(HeldByEarlierRun):
            with restarted.guard(permit, TOOL, "charge-1", **CHARGE, holder_token=token):
                raise AssertionError("the block ran on a DISPATCH an earlier run holds")
        assert tool.sent == [held.value.attempt_id], "never sent again"
        attempt = held.value.attempt
        assert attempt.state == pb.ATTEMPT_STATE_RESERVED, "nothing recorded"
        assert held.value.lease_remaining is not None and 0 < held.value.lease_remaining <= 30
        # Nothing says A never sent: settled uncertain, the slot stays held.
        settled = restarted.settle_uncertain(attempt, "restarted: the earlier run may have sent")
        assert settled.state == pb.ATTEMPT_STATE_UNCERTAIN
        with pytest.raises(OutcomeUncertain) as replay:
            restarted.call_guarded(permit, TOOL, "charge-1", never, **CHARGE, holder_token=token)
        assert replay.value.replayed and replay.value.attempt_id == attempt.attempt_id
        assert client.get_permit(permit).usage[0].calls_made == 1

        # charge-2: A died before sending (its journal says so): NotSent
        # frees the key, and the call made again is a fresh DISPATCH, sent once.
        token = b"kept in the journal with charge-2"
        client.guard(permit, TOOL, "charge-2", **CHARGE, holder_token=token).authorize()
        with pytest.raises(HeldByEarlierRun) as held:
            restarted.call_guarded(permit, TOOL, "charge-2", never, **CHARGE, holder_token=token)
        released = restarted.settle_not_sent(held.value.attempt)
        assert released.state == pb.ATTEMPT_STATE_RELEASED
        assert client.get_permit(permit).usage[0].calls_made == 1, "the slot came back"
        outcome = restarted.call_guarded(permit, TOOL, "charge-2", tool, **CHARGE, holder_token=token)
        assert not outcome.replayed and not outcome.redelivered
        assert outcome.attempt_id != held.value.attempt_id
    assert len(tool.sent) == 2
    assert client.get_permit(permit).usage[0].calls_made == 2


def test_the_dispatch_time_is_what_atmost_says_is_left_less_the_margin():
    # Instants: the first try sent at 100, the answered one at 100.5, its answer arrived at 100.7.
    def deadline(lease_remaining, lease, timeout, arrived=100.7):
        return dispatch_deadline(
            lease_remaining, lease, first_try=100.0, answered_try=100.5, arrived=arrived, timeout=timeout
        )

    # What atmost said was left, less the margin, counted from the answered try.
    assert deadline(30.0, 30.0, None) == (100.5 + 29.0, 29.0)  # a fresh DISPATCH: the whole lease
    assert deadline(1.5, 3.0, None) == (101.0, 0.5)  # a redelivery late in the lease: what is left
    assert deadline(1.5, 3.0, 5) == (101.0, 0.5)  # a longer timeout is cut to it
    assert deadline(1.5, 3.0, 0.2) == (100.7 + 0.2, 0.2)  # a shorter one is kept, from the arrival
    assert deadline(0.9, 3.0, 5)[0] < 100.7  # under the margin: no time, dispatch is not called
    # An answer that took 1.5 s to come back spent 1.5 s of the lease.
    assert deadline(3.0, 3.0, None, arrived=102.0) == (102.5, 2.0)
    assert deadline(2.0, 2.0, None, arrived=101.7)[0] < 101.7  # it took all of it: nothing left
    # A server that does not say: the whole lease, counted from the first try.
    assert deadline(None, 3.0, None) == (102.0, 2.0)
    assert deadline(None, 3.0, 5) == (102.0, 2.0)


def test_in_progress_waits_the_servers_retry_delay(client):
    # Another holder's attempt with a 2 s lease: the helper waits the RetryInfo
    # delay, and then finds the attempt UNCERTAIN (its lease ran out).
    permit = new_permit(client, lease=2.0)
    client.authorize(permit, TOOL, "charge-1", fingerprint(REQUEST), holder_token=b"the other holder")
    waits: List[tuple] = []
    retry = Retry(max_tries=10, on_retry=lambda rpc, e, delay: waits.append((e.reason, e.retry_after, delay)))
    with pytest.raises(OutcomeUncertain) as caught:
        client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST, retry=retry)
    assert caught.value.replayed
    assert caught.value.attempt.uncertain_reason == "lease_expired"
    assert waits
    for reason, retry_after, delay in waits:
        assert reason == "IDEMPOTENCY_IN_PROGRESS" and delay == retry_after and delay <= 2.0


def test_the_same_key_with_another_request_is_refused(client):
    permit = new_permit(client)
    client.call_guarded(permit, TOOL, "charge-1", Tool(), request=REQUEST)
    with pytest.raises(Denied) as caught:
        client.call_guarded(permit, TOOL, "charge-1", never, request={**REQUEST, "amount": 501})
    assert caught.value.reason == "IDEMPOTENCY_KEY_REUSED"


# === the context manager ===


def test_context_manager_dispatch_then_replay(client):
    permit = new_permit(client)
    tool = Tool()
    with client.guard(permit, TOOL, "charge-1", request=REQUEST, cost=5) as call:
        assert not call.replayed
        assert call.timeout == 29.0  # the 30 s lease less the 1 s margin
        assert 0 < call.time_left() <= 29.0
        outcome = call.succeeded(tool(call.attempt_id))
    assert outcome.result == {"tx": 981}
    with client.guard(permit, TOOL, "charge-1", request=REQUEST, cost=5) as call:
        assert call.replayed
        assert call.result == b'{"tx":981}'
        with pytest.raises(RuntimeError):
            call.succeeded("a replay has nothing to settle")
    assert len(tool.sent) == 1


def test_context_manager_endings(client):
    permit = new_permit(client, cap=3)
    with pytest.raises(ToolFailed):
        with client.guard(permit, TOOL, "failed", request=1):
            raise ToolFailed("insufficient funds")
    with pytest.raises(NotSent):
        with client.guard(permit, TOOL, "not-sent", request=2):
            raise NotSent()
    with pytest.raises(OutcomeUncertain) as raised:
        with client.guard(permit, TOOL, "raised", request=3):
            raise TimeoutError("read timed out")
    assert isinstance(raised.value.__cause__, TimeoutError)
    with pytest.raises(OutcomeUncertain) as unsettled:
        with client.guard(permit, TOOL, "unsettled", request=4):
            pass  # forgot call.succeeded(...)
    assert isinstance(unsettled.value.__cause__, RuntimeError)
    uncertain = {a.idempotency_key: a.uncertain_reason for a in client.iter_uncertain(permit)}
    assert set(uncertain) == {"raised", "unsettled"}
    assert "not settling" in uncertain["unsettled"] or "without settling" in uncertain["unsettled"]
    usage = client.get_permit(permit).usage[0]
    assert usage.calls_made == 3  # failed, raised, unsettled; not-sent gave its slot back


def test_replayed_failure_and_uncertainty_do_not_enter_the_block(client):
    permit = new_permit(client)
    with pytest.raises(ToolFailed):
        with client.guard(permit, TOOL, "k", request=1):
            raise ToolFailed("no")
    entered = []
    with pytest.raises(ToolFailed) as caught:
        with client.guard(permit, TOOL, "k", request=1):
            entered.append(1)
    assert caught.value.replayed and entered == []


# === the decorator ===


def test_decorator_arguments_must_be_json_or_a_request_given(client):
    @client.guarded(permit_id=new_permit(client), tool=TOOL, key="k")
    def send(handle: object, *, attempt_id: str) -> None:
        raise AssertionError("dispatched")

    with pytest.raises(ValueError):
        send(object())


def test_decorator(client):
    permit = new_permit(client)
    sent: List[tuple] = []

    @client.guarded(
        permit_id=permit,
        tool=TOOL,
        key=lambda order, amount: f"order-{order}",
        cost=lambda order, amount: amount,
    )
    def charge(order: int, amount: int, *, attempt_id: str) -> Any:
        sent.append((order, amount, attempt_id))
        return {"charged": amount}

    first = charge(7, 500)
    assert first.result == {"charged": 500} and not first.replayed
    assert first.receipt.cost == 500
    again = charge(7, 500)
    assert again.replayed and again.json() == {"charged": 500}
    assert sent == [(7, 500, first.attempt_id)]
    with pytest.raises(Denied) as caught:
        charge(7, 600)  # the same order with another amount: the same key, another request
    assert caught.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert charge.__name__ == "charge"


# === retries and recording failures ===


class Relay:
    """A loopback TCP relay between a client and a real atmost, started when
    the test says: the "server" that comes up late on a fixed port (the
    permit has to exist before the first try, so atmost itself is up).

    It copies bytes unchanged, reading the server's side as HTTP/2 frames so
    that it can lose one answer: with ``lose_response=n``, the connection is
    cut just before the first DATA frame of the n-th response (counted
    across connections), after atmost has applied and answered the request.
    With ``hold_response=n``, the n-th response is held there instead, for
    ``hold`` seconds (an answer slow on its way back): ``held_at`` and
    ``released_at`` are the instants (time.monotonic()) it was held and let go.
    With ``hold_first``, the first bytes of each connection (atmost's HTTP/2
    SETTINGS) are held that many seconds: a server slow to answer the
    connection, as over a long link or a loaded machine.
    """

    def __init__(
        self,
        port: int,
        upstream: str,
        lose_response: int = 0,
        hold_response: int = 0,
        hold: float = 0.0,
        hold_first: float = 0.0,
    ) -> None:
        host, _, up_port = upstream.rpartition(":")
        self.upstream = (host, int(up_port))
        self.lose_response = lose_response
        self.hold_response, self.hold = hold_response, hold
        self.held_at: Optional[float] = None
        self.released_at: Optional[float] = None
        self.hold_first = hold_first
        self.responses = 0
        self.lost = threading.Event()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", port))
        self.sockets: List[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self.sockets += [conn, up]
            threading.Thread(target=self._requests, args=(conn, up), daemon=True).start()
            threading.Thread(target=self._frames, args=(up, conn), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Client to server, unchanged."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            Relay._shut(dst)

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        """Server to client, frame by frame: 9 bytes of header (length 3,
        type 1, flags 1, stream id 4), then the payload; type 0 is DATA."""
        buffer, streams, first = b"", set(), True
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if first and self.hold_first:
                    time.sleep(self.hold_first)  # the fault itself: a server slow to say hello
                first = False
                buffer += data
                out = b""
                while len(buffer) >= 9:
                    size = 9 + int.from_bytes(buffer[:3], "big")
                    if len(buffer) < size:
                        break
                    stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    if buffer[3] == 0 and stream and stream not in streams:
                        streams.add(stream)
                        with self.lock:
                            self.responses += 1
                            lose = self.responses == self.lose_response
                            hold = self.responses == self.hold_response
                        if lose:
                            dst.sendall(out)
                            self.lost.set()
                            self._shut(src)
                            return
                        if hold:
                            dst.sendall(out)  # the answer's headers go; its message waits
                            out = b""
                            self.held_at = time.monotonic()
                            time.sleep(self.hold)  # the fault itself: an answer slow on its way back
                            self.released_at = time.monotonic()
                    out, buffer = out + buffer[:size], buffer[size:]
                dst.sendall(out)
        except OSError:
            pass
        finally:
            self._shut(dst)

    @staticmethod
    def _shut(s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            self._shut(s)
            s.close()


@pytest.fixture
def relays():
    started: List[Relay] = []
    yield started
    for relay in started:
        relay.close()


def test_authorize_is_retried_until_the_server_is_up(client, server, relays):
    permit = new_permit(client)
    port = free_port()
    failures: List[Any] = []

    def on_retry(rpc: str, error: Any, delay: float) -> None:
        failures.append(error)
        if not relays:  # the first try was refused: now the server comes up on that port
            relays.append(Relay(port, server.address))

    # The default limits (5 tries, 10 s): the channel's reconnect backoff must fit in them.
    with Client(f"127.0.0.1:{port}", retry=Retry(on_retry=on_retry)) as late:
        tool = Tool()
        outcome = late.call_guarded(permit, TOOL, "charge-1", tool, request=REQUEST)
    assert not outcome.replayed and len(tool.sent) == 1
    assert failures and all(isinstance(e, Unavailable) for e in failures)
    assert failures[0].code == grpc.StatusCode.UNAVAILABLE and failures[0].reason is None


def test_a_server_slow_to_answer_the_connection_is_waited_for(client, server, relays):
    # atmost's first bytes take 0.5 s to come (a far server's TLS handshake,
    # a loaded machine): the connection attempt waits for them, within the
    # call's deadline, rather than failing after 100 ms, which no retry
    # helps when every attempt is as slow.
    permit = new_permit(client)
    relay = Relay(free_port(), server.address, hold_first=0.5)
    relays.append(relay)
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}") as slow:
        assert slow.get_permit(permit).permit.permit_id == permit  # one try, no retries


def test_a_lost_authorize_answer_is_retried_with_the_same_holder_token(client, server, relays):
    permit = new_permit(client)
    relay = Relay(free_port(), server.address, lose_response=1)
    relays.append(relay)
    retried: List[str] = []
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}", retry=Retry(on_retry=lambda rpc, e, d: retried.append(rpc))) as c:
        tool = Tool()
        outcome = c.call_guarded(permit, TOOL, "charge-1", tool, request=REQUEST, cost=5)
    assert relay.lost.is_set() and retried == ["Authorize"]
    # The retry carried the first try's token: the same DISPATCH, told again.
    assert outcome.redelivered and not outcome.replayed
    assert len(tool.sent) == 1
    assert client.get_permit(permit).usage[0].calls_made == 1


def test_a_redelivered_dispatch_gets_only_what_is_left_of_the_lease(client, server, relays):
    # The first Authorize answer is lost; the retry, with the same token,
    # gets the DISPATCH redelivered, a lost answer and a backoff after
    # atmost reserved. The call gets what atmost says is left of the lease,
    # less the margin, not the whole lease counted from the redelivery.
    permit = new_permit(client, lease=3.0)
    relay = Relay(free_port(), server.address, lose_response=1)
    relays.append(relay)
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}") as c:
        with c.guard(permit, TOOL, "charge-1", request=REQUEST) as call:
            assert relay.lost.is_set() and call.redelivered
            expires, created = call.attempt.lease_expires_at, call.attempt.created_at
            lease = (expires.seconds - created.seconds) + (expires.nanos - created.nanos) / 1e9
            assert lease == 3.0
            assert call.lease_remaining is not None and call.lease_remaining < lease
            assert call.timeout == call.lease_remaining - LEASE_MARGIN
            call.succeeded({"tx": 1})
    assert client.get_permit(permit).usage[0].calls_made == 1


def test_an_answer_held_on_its_way_back_spends_the_lease(client, server, relays):
    # atmost reserves and answers a fresh DISPATCH (the whole 4 s lease
    # left), and the answer is held 1.5 s on its way back, past the 1 s
    # margin. Counted from the arrival, the dispatch would get 3 s and run
    # 0.5 s past the lease. It is counted from the Authorize try, sent
    # before the reservation: the dispatch gets what is left.
    permit = new_permit(client, lease=4.0)
    relay = Relay(free_port(), server.address, hold_response=1, hold=1.5)
    relays.append(relay)
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}") as c:
        with c.guard(permit, TOOL, "charge-1", request=REQUEST) as call:
            left = call.time_left()
            assert relay.held_at is not None and relay.released_at is not None
            held = relay.released_at - relay.held_at
            assert held >= 1.5 and not call.redelivered
            assert call.lease_remaining is not None and call.lease_remaining <= 4.0
            assert call.timeout == call.lease_remaining - LEASE_MARGIN
            # The try was sent before atmost answered, and so before the hold began.
            assert call.deadline < relay.held_at + call.timeout
            assert left < call.lease_remaining - LEASE_MARGIN - held
            call.succeeded({"tx": 1})
    assert client.get_permit(permit).usage[0].calls_made == 1


def test_an_answer_held_past_the_lease_less_the_margin_is_not_sent(client, server, relays):
    # A 2 s lease, its answer held 1.2 s: less than nothing is left after the
    # margin. Counted from the arrival it would get 1 s, and send until 0.2 s
    # past the lease. It is given back unsent, dispatch never called.
    permit = new_permit(client, cap=1, lease=2.0)
    relay = Relay(free_port(), server.address, hold_response=1, hold=1.2)
    relays.append(relay)
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}") as c:
        with pytest.raises(NotSent) as caught:
            c.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST, dispatch_timeout=30)
    assert relay.released_at is not None and relay.released_at - relay.held_at >= 1.2
    assert "no time to send" in str(caught.value)
    assert client.get_permit(permit).usage[0].calls_made == 0
    assert client.get_attempt(permit, "charge-1").attempt.state == pb.ATTEMPT_STATE_RELEASED


def test_a_lost_commit_answer_is_retried_and_answered_the_same(client, server, relays):
    permit = new_permit(client)
    relay = Relay(free_port(), server.address, lose_response=2)
    relays.append(relay)
    retried: List[str] = []
    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}", retry=Retry(on_retry=lambda rpc, e, d: retried.append(rpc))) as c:
        tool = Tool()
        outcome = c.call_guarded(permit, TOOL, "charge-1", tool, request=REQUEST)
    assert relay.lost.is_set() and retried == ["Commit"]
    assert outcome.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED and len(tool.sent) == 1
    replay = client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST)
    assert replay.receipt.receipt_id == outcome.receipt.receipt_id


@pytest.mark.parametrize("lose, rpc", [(1, "Authorize"), (2, "Commit")])
def test_a_retry_hook_that_raises_stops_nothing(client, server, relays, lose, rpc):
    # The lost answer makes one retry; the hook raises on it. The retry
    # still happens, and the outcome is still recorded.
    permit = new_permit(client)
    relay = Relay(free_port(), server.address, lose_response=lose)
    relays.append(relay)
    told: List[str] = []

    def broken_hook(rpc: str, error: Any, delay: float) -> None:
        told.append(rpc)
        raise RuntimeError("the metrics backend is down")

    port = relay.listener.getsockname()[1]
    with Client(f"127.0.0.1:{port}", retry=Retry(on_retry=broken_hook)) as c:
        tool = Tool()
        outcome = c.call_guarded(permit, TOOL, "charge-1", tool, request=REQUEST)
    assert relay.lost.is_set() and told == [rpc]
    assert outcome.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED and len(tool.sent) == 1
    replay = client.call_guarded(permit, TOOL, "charge-1", never, request=REQUEST)
    assert replay.replayed and replay.receipt.receipt_id == outcome.receipt.receipt_id


def test_a_commit_that_cannot_be_recorded_says_so(start_server):
    dying = start_server()
    with Client(dying.address, retry=Retry(max_tries=2, max_time=5)) as c:
        permit = new_permit(c)

        def sent_then_atmost_dies(attempt_id: str) -> Any:
            dying.stop()
            return {"tx": 1}

        with pytest.raises(CommitNotRecorded) as caught:
            c.call_guarded(permit, TOOL, "charge-1", sent_then_atmost_dies, request=REQUEST)
    e = caught.value
    assert e.outcome == "SUCCEEDED" and e.result == {"tx": 1} and e.attempt_id
    assert isinstance(e.__cause__, Unavailable)


def without_attempt(request: bytes, context: Any, forward: Any) -> bytes:
    """A broken server's Authorize: a DISPATCH (or REPLAY) that carries no attempt."""
    answer = pb.AuthorizeResponse.FromString(forward(request))
    answer.ClearField("attempt")
    return answer.SerializeToString()


def without_attempt_id(request: bytes, context: Any, forward: Any) -> bytes:
    """A broken server's Authorize: the attempt without its id."""
    answer = pb.AuthorizeResponse.FromString(forward(request))
    answer.attempt.attempt_id = ""
    return answer.SerializeToString()


@pytest.mark.parametrize("hook", [without_attempt, without_attempt_id])
def test_a_dispatch_without_an_attempt_is_refused_and_nothing_is_sent(server, front_end, hook):
    front = front_end(server.address, Authorize=hook)
    with Client(front.address) as c:
        permit = new_permit(c)
        with pytest.raises(AtmostError) as caught:
            c.call_guarded(permit, TOOL, "k", never, request=1)
        assert type(caught.value) is AtmostError
        assert "DECISION_DISPATCH without an attempt; nothing was sent" in str(caught.value)
        with pytest.raises(AtmostError):
            with c.guard(permit, TOOL, "k2", request=1):
                raise AssertionError("the block ran without an attempt")
        # Nothing to settle without an attempt id: Authorize only.
        assert front.calls == ["CreatePermit", "Authorize", "Authorize"]
        # A REPLAY without one is refused the same way.
        front.hooks.clear()
        c.call_guarded(permit, TOOL, "done", lambda _: {"tx": 1}, request=1)
        front.hooks["Authorize"] = hook
        with pytest.raises(AtmostError) as caught:
            c.call_guarded(permit, TOOL, "done", never, request=1)
        assert "DECISION_REPLAY without an attempt; nothing was sent" in str(caught.value)


def test_refusals_are_not_retried(client):
    retries: List[Any] = []
    retry = Retry(on_retry=lambda *a: retries.append(a))
    with pytest.raises(Denied) as caught:
        client.call_guarded("0190a5b2-0000-7000-8000-000000000000", TOOL, "k", never, request=1, retry=retry)
    assert caught.value.reason == "PERMIT_NOT_FOUND"
    with pytest.raises(InvalidRequest) as invalid:
        client.call_guarded("not-a-uuid", TOOL, "k", never, request=1, retry=retry)
    assert invalid.value.violations and invalid.value.violations[0][0] == "permit_id"
    assert retries == []


def test_a_request_without_one_json_form_is_refused_before_authorize(client):
    permit = new_permit(client)
    for key, request, path in (
        ("big", {"order": {"amount": 1e21}}, "/order/amount"),
        ("set", {"tags": {"a"}}, "/tags"),
        ("nan", [float("nan")], "/0"),
    ):
        with pytest.raises(FingerprintError) as caught:
            client.call_guarded(permit, TOOL, key, never, request=request)
        assert caught.value.path == path and path in str(caught.value)
        with pytest.raises(AtmostError) as unknown:
            client.get_attempt(permit, key)
        assert unknown.value.reason == "ATTEMPT_NOT_FOUND", "Authorize was never sent"
    assert all(u.calls_made == 0 for u in client.get_permit(permit).usage)


@pytest.mark.parametrize(
    "bad",
    [
        dict(request=1, fingerprint=b"f"),
        dict(),
        dict(request=1, cost=-1),
        dict(request=1, cost=1.5),
        dict(request=1, holder_token=b""),
        dict(request=1, dispatch_timeout=0),
        dict(request=float("nan")),
    ],
)
def test_bad_input_fails_before_anything_is_sent(bad):
    # No server on this port: a ValueError (not Unavailable) shows nothing was sent.
    with Client(f"127.0.0.1:{free_port()}") as nowhere:
        with pytest.raises(ValueError):
            nowhere.call_guarded("0190a5b2-0000-7000-8000-000000000000", TOOL, "k", never, **bad)
