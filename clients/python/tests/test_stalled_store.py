"""CANCELLED without atmost's ErrorInfo is retried as the same request.

atmost's ``--request-timeout`` answers an RPC that takes too long with
CANCELLED "Timeout expired" and no ErrorInfo; what it had sent its store
may still run. docs/api.md: such an answer says nothing about whether the
request applied, retry with the same key. Here the store is a real Redis
stopped (SIGSTOP) under a real atmost whose request timeout is far below
its store timeout: the try is answered CANCELLED, Redis resumes at the
retry, and the first try's command runs before the retry's.
"""

from __future__ import annotations

from typing import Any, Iterator, List, NamedTuple, Tuple

import grpc
import pytest
from conftest import Redis, Server

from atmost_client import AtmostError, Client, OutcomeUncertain, Retry, Unavailable
from atmost_client.guard import LEASE_MARGIN

TOOL = "wallet.charge"
REQUEST = {"amount": 500, "currency": "EUR", "to": "acct_42"}


class Stalling(NamedTuple):
    redis: Redis
    client: Client


@pytest.fixture(scope="module")
def stalling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stalling]:
    redis = Redis()
    server = None
    try:
        # A request timeout far below the store timeout: a stalled request
        # is answered CANCELLED, never STORE_UNAVAILABLE.
        timeouts = ["--request-timeout", "500ms", "--store-timeout", "30s"]
        server = Server(
            ["--store", "redis", "--redis-url", redis.url, *timeouts], tmp=tmp_path_factory.mktemp("stalling")
        )
        with Client(server.address) as client:
            # The first call finds atmost's functions missing, and atmost
            # loads them and calls again; a first call stalled past the
            # request timeout would be dropped after that answer, not
            # applied. Run the calls once (Authorize, Commit,
            # MarkUncertain), so a stalled command is the one that runs
            # when Redis resumes.
            permit = client.create_permit([TOOL]).permit_id
            client.call_guarded(permit, TOOL, "warm-commit", lambda attempt_id: 1, request=1)
            with pytest.raises(OutcomeUncertain):
                client.call_guarded(permit, TOOL, "warm-uncertain", _reset, request=2)
            yield Stalling(redis, client)
    finally:
        redis.resume()
        if server is not None:
            server.stop()
        redis.stop()


def _reset(attempt_id: str) -> Any:
    raise ConnectionResetError("reset after sending")


def _retries(redis: Redis) -> Tuple[List[Tuple[str, AtmostError]], Retry]:
    """The retries seen, and a Retry that resumes Redis at the first."""
    seen: List[Tuple[str, AtmostError]] = []

    def on_retry(rpc: str, error: AtmostError, delay: float) -> None:
        seen.append((rpc, error))
        redis.resume()

    return seen, Retry(on_retry=on_retry)


def _cancelled(error: AtmostError) -> None:
    assert isinstance(error, Unavailable), repr(error)
    assert error.code == grpc.StatusCode.CANCELLED and error.reason is None, repr(error)


def test_a_cancelled_authorize_is_retried_with_the_same_holder_token(stalling):
    client, redis = stalling.client, stalling.redis
    permit = client.create_permit([TOOL]).permit_id
    seen, retry = _retries(redis)
    sent: List[str] = []

    def dispatch(attempt_id: str) -> Any:
        sent.append(attempt_id)
        return {"tx": 981}

    redis.pause()  # the first Authorize stalls
    try:
        outcome = client.call_guarded(permit, TOOL, "charge-1", dispatch, request=REQUEST, retry=retry)
    finally:
        redis.resume()
    assert [rpc for rpc, _ in seen] == ["Authorize"]
    _cancelled(seen[0][1])
    # The first try reserved when Redis resumed; the retry carried its token
    # and got that reservation back, not a second one.
    assert outcome.redelivered and not outcome.replayed
    assert sent == [outcome.attempt_id]
    assert client.get_permit(permit).usage[0].calls_made == 1


def test_a_reservation_made_late_gets_what_the_store_says_is_left_of_its_lease(stalling):
    # The first Authorize stalls in Redis for the server's 500 ms request
    # timeout; the store reserves when it resumes, at the retry, and the
    # retry gets that reservation redelivered. The lease began when the
    # store reserved, not when this call first tried: counted from the
    # first try, a 1.49 s lease less the 1 s margin would leave nothing
    # after the stall, and the call would be given back unsent. What atmost
    # says is left, less the margin, is what the dispatch gets.
    client, redis = stalling.client, stalling.redis
    permit = client.create_permit([TOOL], lease=1.49).permit_id
    seen, retry = _retries(redis)
    redis.pause()
    try:
        with client.guard(permit, TOOL, "charge-1", request=REQUEST, retry=retry) as call:
            assert [rpc for rpc, _ in seen] == ["Authorize"] and call.redelivered
            assert call.lease_remaining is not None and call.lease_remaining <= 1.49
            assert call.timeout == call.lease_remaining - LEASE_MARGIN
            call.succeeded({"tx": 981})
    finally:
        redis.resume()
    assert client.get_permit(permit).usage[0].calls_made == 1


def test_a_cancelled_commit_is_retried_and_answered_the_same(stalling):
    client, redis = stalling.client, stalling.redis
    permit = client.create_permit([TOOL]).permit_id
    seen, retry = _retries(redis)
    sent: List[str] = []

    def dispatch(attempt_id: str) -> Any:
        sent.append(attempt_id)
        redis.pause()  # the tool answered; the Commit that follows stalls
        return {"tx": 981}

    try:
        outcome = client.call_guarded(permit, TOOL, "charge-1", dispatch, request=REQUEST, retry=retry)
    finally:
        redis.resume()
    assert [rpc for rpc, _ in seen] == ["Commit"]
    _cancelled(seen[0][1])
    assert not outcome.replayed and outcome.result == {"tx": 981} and sent == [outcome.attempt_id]
    replay = client.call_guarded(permit, TOOL, "charge-1", _never, request=REQUEST)
    assert replay.replayed and replay.receipt.receipt_id == outcome.receipt.receipt_id


def test_a_cancelled_mark_uncertain_is_retried(stalling):
    client, redis = stalling.client, stalling.redis
    permit = client.create_permit([TOOL]).permit_id
    seen, retry = _retries(redis)

    def dispatch(attempt_id: str) -> Any:
        redis.pause()  # the MarkUncertain that follows stalls
        raise ConnectionResetError("reset after sending")

    try:
        with pytest.raises(OutcomeUncertain) as caught:
            client.call_guarded(permit, TOOL, "charge-1", dispatch, request=REQUEST, retry=retry)
    finally:
        redis.resume()
    assert [rpc for rpc, _ in seen] == ["MarkUncertain"]
    _cancelled(seen[0][1])
    assert not caught.value.replayed
    [attempt] = client.iter_uncertain(permit)
    assert attempt.attempt_id == caught.value.attempt_id
    assert attempt.uncertain_reason == "ConnectionResetError: reset after sending"


def _never(attempt_id: str) -> Any:
    raise AssertionError(f"dispatch called ({attempt_id}) where nothing may be sent")
