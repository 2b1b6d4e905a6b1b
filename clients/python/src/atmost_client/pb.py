"""The generated messages and enums of ``atmost.v1``, in one namespace.

``pb.Permit``, ``pb.AuthorizeRequest``, ``pb.Attempt``,
``pb.ATTEMPT_STATE_UNCERTAIN``, ``pb.DECISION_DISPATCH``, ``pb.ApprovalRule``... The stubs
themselves live in ``atmost_client._pb`` (generated: see
clients/python/generate_stubs.py).
"""

from ._pb.approvals_pb2 import *  # noqa: F401,F403
from ._pb.gate_pb2 import *  # noqa: F401,F403
from ._pb.permits_pb2 import *  # noqa: F401,F403
from ._pb.receipts_pb2 import *  # noqa: F401,F403
from ._pb.types_pb2 import *  # noqa: F401,F403

del DESCRIPTOR  # noqa: F821 (each module's file descriptor; meaningless once merged)
