"""atmost_client: the Python client of atmost.

atmost is a permit and receipt boundary in front of side-effecting tool
calls: ask before (Authorize), tell after (Commit, MarkUncertain), and the
same idempotency key never dispatches twice. This package gives

- :class:`Client`: the connection (API key, TLS), one method per RPC
  (the Approvals service's too: ``list_approvals``, ``approve``, ``deny``;
  :func:`approval_rule` for a permit's ``approval_per_tool``);
- the guarded call, ``client.guard()`` / ``client.call_guarded()`` /
  ``@client.guarded()``: one tool call, sent at most once, its ending
  always recorded;
- the typed errors (:mod:`atmost_client.errors`);
- :func:`fingerprint`: SHA-256 of a request's RFC 8785 canonical JSON;
- :mod:`atmost_client.pb`: the wire messages.

Layout: ``client.py`` (Client, Retry), ``guard.py`` (the guarded call),
``errors.py``, ``fingerprint.py``, ``pb.py``, ``_pb/`` (generated stubs).
"""

from . import pb
from .client import Client, Retry, approval_rule
from .errors import (
    ApprovalDenied,
    AtmostError,
    AwaitingApproval,
    CommitNotRecorded,
    DeadlineExceeded,
    Denied,
    HeldByEarlierRun,
    InProgress,
    InvalidRequest,
    NotSent,
    OutcomeUncertain,
    ToolFailed,
    Unauthenticated,
    Unavailable,
)
from .fingerprint import FingerprintError, canonical_json, fingerprint
from .guard import GuardedCall, Outcome

__all__ = [
    "ApprovalDenied",
    "AtmostError",
    "AwaitingApproval",
    "Client",
    "CommitNotRecorded",
    "DeadlineExceeded",
    "Denied",
    "FingerprintError",
    "GuardedCall",
    "HeldByEarlierRun",
    "InProgress",
    "InvalidRequest",
    "NotSent",
    "Outcome",
    "OutcomeUncertain",
    "Retry",
    "ToolFailed",
    "Unauthenticated",
    "Unavailable",
    "approval_rule",
    "canonical_json",
    "fingerprint",
    "pb",
]
