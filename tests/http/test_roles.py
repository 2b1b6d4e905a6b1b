"""Every RPC over both edges with each role: the same table.

The RPCs are the operations the OpenAPI document lists (each names its
gRPC path); each is called over HTTP/JSON and over gRPC (grpcio, the raw
method) with an admin's, an operator's, an approver's and an agent's key and with
none.
A call is let in unless it is refused UNAUTHENTICATED or ROLE_NOT_ALLOWED;
what follows (an empty request's INVALID_REQUEST, an unknown permit) is
the same on both edges and not this test's.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Set

import grpc
import httpx
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import JSON, Keys, Server

ROLES = ["admin", "operator", "approver", "agent", None]

#: docs/api.md, "Authentication and roles"; None: any caller, with no key.
EXPECTED: Dict[str, Set[Optional[str]]] = {
    "/atmost.v1.Gate/Authorize": {"agent", "admin"},
    "/atmost.v1.Gate/Commit": {"agent", "admin"},
    "/atmost.v1.Gate/MarkUncertain": {"agent", "admin"},
    "/atmost.v1.Permits/GetPermit": {"agent", "operator", "approver", "admin"},
    "/atmost.v1.Permits/GetAttempt": {"agent", "operator", "approver", "admin"},
    "/atmost.v1.Permits/ListUncertain": {"operator", "admin"},
    "/atmost.v1.Permits/Resolve": {"operator", "admin"},
    "/atmost.v1.Permits/CreatePermit": {"admin"},
    "/atmost.v1.Permits/RevokePermit": {"admin"},
    "/atmost.v1.Approvals/ListApprovals": {"approver", "admin"},
    "/atmost.v1.Approvals/Approve": {"approver", "admin"},
    "/atmost.v1.Approvals/Deny": {"approver", "admin"},
    "/atmost.v1.Receipts/GetSigningKeys": {"admin", "operator", "approver", "agent", None},
}

PERMIT = "01a238ca-7e3a-7923-bf66-574b0b511439"


def headers(keys: Keys, role: Optional[str]) -> Dict[str, str]:
    return keys.bearer(role) if role else {}


def refused_over_http(server: Server, keys: Keys, method: str, template: str, role: Optional[str]) -> bool:
    path = template.replace("{permit_id}", PERMIT).replace("{idempotency_key}", "k-1")
    body = b"{}" if method == "post" else None
    r = httpx.request(method.upper(), server.url + path, content=body,
                      headers={**JSON, **headers(keys, role)}, timeout=30)
    if r.status_code not in (401, 403):
        return False
    reasons = [d.get("reason") for d in r.json()["error"]["details"]]
    assert reasons and reasons[0] in ("UNAUTHENTICATED", "ROLE_NOT_ALLOWED"), r.text
    return True


def refused_over_grpc(channel: grpc.Channel, keys: Keys, grpc_path: str, role: Optional[str]) -> bool:
    call = channel.unary_unary(grpc_path)  # raw bytes both ways
    metadata = [(k, v) for k, v in headers(keys, role).items()]
    try:
        call(b"", metadata=metadata, timeout=30)
        return False
    except grpc.RpcError as e:
        status = rpc_status.from_call(e)
        reasons = []
        for detail in status.details if status else []:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reasons.append(info.reason)
        return bool(set(reasons) & {"UNAUTHENTICATED", "ROLE_NOT_ALLOWED"})


def test_every_rpc_has_one_role_table_on_both_edges(auth_server: Server, keys: Keys) -> None:
    # The document is open, as reflection is: no key.
    document = httpx.get(auth_server.url + "/v1/openapi.json", timeout=30).json()
    rpcs: Dict[str, list] = {}
    for template, methods in document["paths"].items():
        for method, op in methods.items():
            grpc_path = re.search(r"gRPC: `([^`]+)`", op["description"]).group(1)
            rpcs.setdefault(grpc_path, []).append((method, template))
    assert set(rpcs) == set(EXPECTED), "an RPC added or gone: give it its row"
    with grpc.insecure_channel(auth_server.address) as channel:
        for grpc_path, bindings in rpcs.items():
            over_grpc = {role for role in ROLES if not refused_over_grpc(channel, keys, grpc_path, role)}
            assert over_grpc == EXPECTED[grpc_path], (grpc_path, "gRPC", over_grpc)
            for method, template in bindings:
                over_http = {role for role in ROLES
                             if not refused_over_http(auth_server, keys, method, template, role)}
                assert over_http == over_grpc, (grpc_path, method, template, over_http, over_grpc)
