"""Every reason of the wire contract (atmost.v1.ErrorReason) is placed: a
refusal this client raises as Denied, or one of the reasons read by their
own kind. A reason added to the proto fails here until it is placed."""

from atmost_client import pb
from atmost_client.errors import DENIED_REASONS, OTHER_REASONS

#: The reasons that are not refusals of what the request asks, and why.
NOT_DENIED = {
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


def test_every_reason_of_the_proto_is_placed():
    reasons = set(pb.ErrorReason.keys()) - {"ERROR_REASON_UNSPECIFIED"}
    assert not DENIED_REASONS & NOT_DENIED
    assert reasons == DENIED_REASONS | NOT_DENIED
    assert "ATTEMPT_HOLDER_MISMATCH" in DENIED_REASONS
    assert "APPROVER_IS_REQUESTER" in DENIED_REASONS
    # What the client reads as a reason newer than itself (Denied) is what this test does not know.
    assert OTHER_REASONS == NOT_DENIED
