"""Keys, roles and tenants over HTTP: the gRPC edge's, through the same
layer."""

from __future__ import annotations

import json
import pathlib
import socket
import time
from typing import Dict, List

import httpx
import pytest

from conftest import JSON, Api, Keys, Server, b64, reason, tomorrow


def test_keys_roles_and_tenants(auth_server: Server, keys: Keys) -> None:
    anonymous = Api(auth_server)
    r = anonymous.post("/v1/permits", {"tools": ["t"]})
    assert r.status_code == 401 and reason(r) == "UNAUTHENTICATED", r.text
    assert r.headers["www-authenticate"] == "Bearer"
    wrong = Api(auth_server, {"authorization": "Bearer nope"})
    assert wrong.get("/v1/uncertain").status_code == 401
    # The receipt keys are open to every caller.
    assert anonymous.get("/v1/signingKeys").status_code == 200

    admin = Api(auth_server, keys.bearer("admin"))
    # With keys, any Host is answered: a key, not the name, lets one in.
    r = admin.get("/v1/signingKeys", headers={"host": "atmost.internal.example"})
    assert r.status_code == 200, r.text
    agent = Api(auth_server, keys.bearer("agent"))
    operator = Api(auth_server, keys.bearer("operator"))
    other = Api(auth_server, keys.bearer("other"))
    r = agent.post("/v1/permits", {"tools": ["charge"], "expiresAt": tomorrow()})
    assert r.status_code == 403 and reason(r) == "ROLE_NOT_ALLOWED", r.text
    permit = admin.permit()
    r = agent.authorize(permit, "k1")
    assert r.status_code == 200, r.text
    attempt = r.json()["attempt"]
    # An operator may not authorize; it may list what is uncertain.
    assert reason(operator.authorize(permit, "k2")) == "ROLE_NOT_ALLOWED"
    agent.post(f"/v1/permits/{permit}/attempts/k1:markUncertain", {"attemptId": attempt["attemptId"]})
    listed = operator.get("/v1/uncertain").json()
    assert [a["idempotencyKey"] for a in listed["attempts"]] == ["k1"]
    # Another tenant sees nothing of t1's and changes nothing.
    assert other.get(f"/v1/permits/{permit}").status_code == 404
    assert other.get("/v1/uncertain").json() == {}
    r = other.post(f"/v1/permits/{permit}/attempts/k1:resolve", {"succeeded": {"result": b64(b"x")}})
    assert r.status_code == 404 and reason(r) == "PERMIT_NOT_FOUND", r.text
    assert admin.get(f"/v1/permits/{permit}/attempts/k1").json()["attempt"]["state"] == "ATTEMPT_STATE_UNCERTAIN"
    for api in (anonymous, wrong, admin, agent, operator, other):
        api.close()



def audit_lines(path: pathlib.Path, until, within: float = 30.0) -> List[Dict[str, str]]:
    """The audit trail's lines once `until(lines)` holds (the writer
    writes within tens of milliseconds; the bound is a guard, not a
    measurement)."""
    give_up = time.monotonic() + within
    while True:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if until(lines) or time.monotonic() > give_up:
            return lines
        time.sleep(0.05)


def test_a_request_that_does_not_make_its_message_is_audited(keys: Keys, tmp_path: pathlib.Path) -> None:
    """As the handler writes its own refusals: a state-changing RPC whose
    JSON does not make its request is written, with its caller; a read is
    not; a request refused before its service is written once, by the
    layer that refused it, its body never parsed."""
    (tmp_path / "keys.toml").write_text(keys.toml())
    trail = tmp_path / "audit.jsonl"
    server = Server(["--auth-keys", str(tmp_path / "keys.toml"), "--audit-log", str(trail)], tmp_path)
    try:
        admin = Api(server, keys.bearer("admin"))
        agent = Api(server, keys.bearer("agent"))
        permit = admin.permit()
        # A read with a bad query: refused, not audited.
        r = agent.get(f"/v1/permits/{permit}?nope=1")
        assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
        # No key and a body that is not JSON: the auth layer's refusal.
        r = httpx.post(f"{server.url}/v1/permits/{permit}/attempts:authorize", content=b"{not json",
                       headers=JSON, timeout=30)
        assert r.status_code == 401 and reason(r) == "UNAUTHENTICATED", r.text
        # An unknown field, and a header contradicting the body.
        r = agent.authorize(permit, "k1", bogus=1)
        assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
        body = {"tool": "charge", "idempotencyKey": "k2", "requestFingerprint": b64(b"req")}
        r = agent.post(f"/v1/permits/{permit}/attempts:authorize", body, headers={"idempotency-key": '"k3"'})
        assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
        assert "two different values" in r.json()["error"]["message"], r.text

        lines = audit_lines(trail, lambda lines: len(lines) >= 4)
        assert [(l["rpc"], l["outcome"]) for l in lines] == [
            ("CreatePermit", "CREATED"),
            ("Authorize", "UNAUTHENTICATED"),
            ("Authorize", "INVALID_REQUEST"),
            ("Authorize", "INVALID_REQUEST"),
        ], lines
        # Who, and about what, as the handler's own refusal would say.
        for line, key in zip(lines[2:], ["k1", "k3"]):
            assert (line["key_id"], line["tenant"], line["permit_id"]) == ("http-agent", "t1", permit), line
            assert (line["tool"], line["idempotency_key"]) == ("charge", key), line
        # Nothing was reserved.
        usage = admin.usage(permit)["usage"][0]
        assert usage.get("callsMade", "0") == "0", usage
        for api in (admin, agent):
            api.close()
    finally:
        server.stop()


def refused_three_times_on_one_connection(
    server: Server, path: str, content_type: str, status: bytes
) -> List[bytes]:
    """POSTs a 200 KiB body to `path` three times on one HTTP/1.1
    connection, each answered `status` without closing it; the bodies."""
    # Past the 128 KiB any refused gRPC body is drained, within the JSON
    # body limit (512 KiB).
    big = json.dumps({"tool": "x" * (200 * 1024)}).encode()
    host, port = server.address.rsplit(":", 1)
    bodies = []
    with socket.create_connection((host, int(port)), timeout=30) as s:
        reader = s.makefile("rb")
        for _ in range(3):
            s.sendall(
                f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {content_type}\r\n".encode()
                + f"content-length: {len(big)}\r\n\r\n".encode() + big
            )
            line = reader.readline()
            assert line.startswith(b"HTTP/1.1 " + status), line
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                assert not line.lower().startswith(b"connection: close"), line
            bodies.append(reader.read(length))
    return bodies


def test_a_refused_request_has_its_body_read_and_keeps_its_connection(auth_server: Server) -> None:
    """A body the auth layer refuses is read, unparsed, up to what a body
    refused for its size is: the client hears the refusal and its
    HTTP/1.1 connection goes on (a body left unread would close it)."""
    for body in refused_three_times_on_one_connection(auth_server, "/v1/permits", "application/json", b"401"):
        assert b"UNAUTHENTICATED" in body


@pytest.mark.parametrize(
    "path, content_type, status",
    [
        # No route: the edge's own 404.
        ("/v1/nope", "application/json", b"404"),
        # A route, and a body that is not JSON: the edge's own 415.
        ("/v1/permits", "text/plain", b"415"),
    ],
)
def test_the_edges_own_refusals_read_the_body_and_keep_the_connection(
    auth_server: Server, path: str, content_type: str, status: bytes
) -> None:
    """A request the edge refuses itself, before any layer, has its body
    read as the auth layer's refusals do: its HTTP/1.1 connection goes on."""
    refused_three_times_on_one_connection(auth_server, path, content_type, status)

def test_a_refused_request_waiting_for_100_continue_is_not_asked_for_its_body(auth_server: Server) -> None:
    """A client that waits for `100 Continue` before sending (curl does
    for large bodies) hears the refusal first: draining its body would ask
    for an upload that is thrown away."""
    host, port = auth_server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/permits HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: 300000\r\n\r\n"
        )
        status = s.makefile("rb").readline()
        assert status.startswith(b"HTTP/1.1 401"), status
