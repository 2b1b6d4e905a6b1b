"""``Client.get_attempt`` (Permits.GetAttempt) against a live atmost: a key's
attempt read back in each state the Gate RPCs put it in, and the typed
errors for an unknown key, an unknown permit and a malformed id."""

from __future__ import annotations

import grpc
import pytest

from atmost_client import AtmostError, Denied, InvalidRequest, fingerprint, pb

TOOL = "wallet.charge"
REQUEST = {"amount": 500, "currency": "EUR", "to": "acct_42"}
#: A well-formed UUIDv7 no permit has.
UNKNOWN_PERMIT = "0190a5b2-0000-7000-8000-000000000000"


def test_each_state_reads_back_as_the_gate_left_it(client):
    permit = client.create_permit([TOOL], budget=10_000).permit_id

    def authorize(key: str) -> pb.Attempt:
        answer = client.authorize(permit, TOOL, key, fingerprint(REQUEST), cost=500)
        assert answer.decision == pb.DECISION_DISPATCH
        return answer.attempt

    reserved = authorize("reserved")
    read = client.get_attempt(permit, "reserved").attempt
    assert read.state == pb.ATTEMPT_STATE_RESERVED
    assert (read.attempt_id, read.permit_id) == (reserved.attempt_id, permit)
    assert read.idempotency_key == "reserved"
    assert (read.tool, read.cost, read.request_fingerprint) == (TOOL, 500, fingerprint(REQUEST))
    assert read.lease_expires_at == reserved.lease_expires_at
    # It only reads: the slot and the money are as Authorize left them.
    usage = client.get_permit(permit)
    assert (usage.usage[0].calls_made, usage.budget_reserved) == (1, 500)

    succeeded = authorize("succeeded")
    committed = client.commit(permit, "succeeded", succeeded.attempt_id, result=b'{"tx":981}')
    read = client.get_attempt(permit, "succeeded").attempt
    assert read.state == pb.ATTEMPT_STATE_SUCCEEDED
    assert read.attempt_id == succeeded.attempt_id
    assert read.receipt.result == b'{"tx":981}'
    assert read.receipt.receipt_id == committed.attempt.receipt.receipt_id

    uncertain = authorize("uncertain")
    client.mark_uncertain(permit, "uncertain", uncertain.attempt_id, "reset after sending")
    read = client.get_attempt(permit, "uncertain").attempt
    assert read.state == pb.ATTEMPT_STATE_UNCERTAIN
    assert read.attempt_id == uncertain.attempt_id
    assert read.uncertain_reason == "reset after sending"
    assert read.HasField("uncertain_since")

    failed = authorize("failed")
    client.commit(permit, "failed", failed.attempt_id, failed="card declined")
    read = client.get_attempt(permit, "failed").attempt
    assert (read.state, read.failure_reason) == (pb.ATTEMPT_STATE_FAILED, "card declined")

    released = authorize("released")
    client.commit(permit, "released", released.attempt_id, not_sent=True)
    read = client.get_attempt(permit, "released").attempt
    assert (read.state, read.attempt_id) == (pb.ATTEMPT_STATE_RELEASED, released.attempt_id)


def test_an_unknown_key_is_attempt_not_found(client):
    permit = client.create_permit([TOOL]).permit_id
    with pytest.raises(AtmostError) as caught:
        client.get_attempt(permit, "never-authorized")
    e = caught.value
    # Neither a refusal of the permit nor something to retry: a plain AtmostError.
    assert type(e) is AtmostError
    assert e.code == grpc.StatusCode.NOT_FOUND
    assert e.reason == "ATTEMPT_NOT_FOUND"
    assert e.metadata["idempotency_key"] == "never-authorized"


def test_an_unknown_permit_is_denied_permit_not_found(client):
    with pytest.raises(Denied) as caught:
        client.get_attempt(UNKNOWN_PERMIT, "k")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason == "PERMIT_NOT_FOUND"


def test_a_malformed_permit_id_and_key_are_invalid_request_naming_each(client):
    with pytest.raises(InvalidRequest) as caught:
        client.get_attempt("not-a-uuid", "")
    assert caught.value.reason == "INVALID_REQUEST"
    assert {field for field, _ in caught.value.violations} == {"permit_id", "idempotency_key"}
