"""Hostile HTTP input: each refused with a bounded error, nothing changed."""

from __future__ import annotations

import json
import socket
import time
from typing import Iterator, List

import pytest

from conftest import JSON, Api, Server, b64, reason


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """A memory-store server with a 1 s request timeout."""
    server = Server(["--request-timeout", "1s"], tmp_path_factory.mktemp("quick"))
    api = Api(server)
    yield api
    api.close()
    server.stop()


def raw(server: Server, request: bytes, read_timeout: float = 10.0) -> bytes:
    """Sends `request` on a socket of its own and reads until the server
    closes or `read_timeout` passes."""
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=read_timeout) as s:
        s.sendall(request)
        chunks: List[bytes] = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and b"content-length: 0" not in chunks[0]:
                    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
                    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                    if length and len(rest) >= length[0]:
                        break
        except socket.timeout:
            pass
        return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_bad_bodies_are_refused_with_the_reason_and_change_nothing(quick: Api) -> None:
    permit = quick.permit(maxCallsPerTool={"charge": 1})
    path = f"/v1/permits/{permit}/attempts:authorize"
    base = {"tool": "charge", "idempotencyKey": "k", "requestFingerprint": b64(b"r")}
    bodies = [
        b'{"tool": ',  # malformed
        b"[1, 2]",  # not an object
        json.dumps({**base, "tool": 5}).encode(),  # a wrong type
        json.dumps({**base, "cost": "99999999999999999999"}).encode(),  # past int64
        json.dumps({**base, "cost": 1e300}).encode(),
        json.dumps({**base, "cost": 1.5}).encode(),
        json.dumps({**base, "unknownField": 1}).encode(),
        json.dumps({**base, "requestFingerprint": "not base64!"}).encode(),
        b"[" * 100_000 + b"]" * 100_000,  # nesting past any parser's depth
        json.dumps(base).encode() + b" trailing",
        b"\xff\xfe not utf-8",
    ]
    for body in bodies:
        r = quick.http.post(path, content=body, headers=JSON)
        assert r.status_code == 400, (body[:40], r.text)
        assert reason(r) == "INVALID_REQUEST", r.text
        assert len(r.content) < 4096, "a bounded answer"
    assert quick.usage(permit)["usage"][0].get("callsMade", "0") == "0"
    assert quick.get(f"/v1/permits/{permit}/attempts/k").status_code == 404


def test_a_body_too_large_is_413_read_or_unread(quick: Api) -> None:
    permit = quick.permit()
    path = f"/v1/permits/{permit}/attempts:authorize"
    big = json.dumps({"tool": "x" * (600 * 1024)}).encode()
    r = quick.http.post(path, content=big, headers=JSON)
    assert r.status_code == 413 and reason(r) == "MESSAGE_TOO_LARGE", r.text
    # Chunked, no Content-Length: cut once the limit is passed.
    r = quick.http.post(path, content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]), headers=JSON)
    assert r.status_code == 413 and reason(r) == "MESSAGE_TOO_LARGE", r.text
    # A Content-Length past the limit and the 1 MiB drained after it:
    # refused unread (the body is never sent, the answer comes anyway).
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        "content-length: 10000000\r\n\r\n"
    ).encode()
    answer = raw(quick.server, head)
    assert status_of(answer) == 413 and b"MESSAGE_TOO_LARGE" in answer, answer[:300]
    assert quick.usage(permit)["usage"][0].get("callsMade", "0") == "0"


def test_a_slow_body_is_cut_by_the_request_timeout(quick: Api) -> None:
    permit = quick.permit()
    head = (
        f"POST /v1/permits/{permit}/attempts:authorize HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        "content-type: application/json\r\ncontent-length: 200\r\n\r\n{"
    ).encode()
    started = time.monotonic()
    answer = raw(quick.server, head)
    assert status_of(answer) == 408, answer[:300]
    assert time.monotonic() - started < 8, "cut near the 1 s request timeout"
    assert quick.usage(permit)["usage"][0].get("callsMade", "0") == "0"


def test_ten_thousand_headers_are_refused(quick: Api) -> None:
    permit = quick.permit()
    headers = "".join(f"x-h{i}: v\r\n" for i in range(10_000))
    request = (
        f"GET /v1/permits/{permit} HTTP/1.1\r\nhost: 127.0.0.1\r\n{headers}\r\n"
    ).encode()
    answer = raw(quick.server, request)
    assert status_of(answer) == 431, answer[:300]
    # Fewer, but past the header list limit (16 KiB): the edge's own 431.
    r = quick.get(f"/v1/permits/{permit}", headers={f"x-h{i}": "v" * 400 for i in range(60)})
    assert r.status_code == 431, r.text


def test_routing_and_content_type(quick: Api) -> None:
    r = quick.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    r = quick.http.delete("/v1/permits")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    # A write without application/json: a browser's cross-origin form post.
    r = quick.http.post("/v1/permits", content=b'{"tools":["t"]}', headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text
    r = quick.http.post("/v1/permits", data={"tools": "t"})
    assert r.status_code == 415, r.text
    # A query where the body holds every field; a GET with a body.
    permit = quick.permit()
    r = quick.http.post(f"/v1/permits/{permit}:revoke?x=1", content=b"{}", headers=JSON)
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST"
    r = quick.http.request("GET", f"/v1/permits/{permit}", content=b'{"permitId":"x"}')
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST"
    assert quick.usage(permit)["permit"]["status"] == "PERMIT_STATUS_ACTIVE"


def test_grpc_headers_are_refused_and_grpc_is_http2_only(quick: Api) -> None:
    permit = quick.permit()
    path = f"/v1/permits/{permit}/attempts:authorize"
    body = {"tool": "charge", "idempotencyKey": "k-grpc", "requestFingerprint": b64(b"r")}
    # tonic would act on these outside every layer: a 1 ns grpc-timeout
    # would answer an empty 200 to a call that may have reserved.
    for name, value in [("grpc-timeout", "1n"), ("grpc-encoding", "gzip"), ("grpc-accept-encoding", "gzip")]:
        r = quick.post(path, body, headers={name: value})
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert name in r.json()["error"]["message"], r.text
    # gRPC over HTTP/1.1: refused, not half-served.
    r = quick.http.post("/atmost.v1.Gate/Authorize", content=b"\0\0\0\0\0", headers={"content-type": "application/grpc"})
    assert r.status_code == 505, (r.status_code, r.text)
    # A content type that only starts like gRPC's is not gRPC: a JSON write
    # must say application/json.
    r = quick.http.post(path, json=body, headers={"content-type": "application/grpc-web"})
    assert r.status_code == 415, (r.status_code, r.text)
    assert quick.usage(permit)["usage"][0].get("callsMade", "0") == "0"


def test_a_grpc_timeout_is_refused_before_it_can_run_out(quick: Api) -> None:
    """tonic's own timeout runs around the edge: a JSON request with a
    1 ns grpc-timeout whose body is still on its way is refused (400) at
    once, not answered by that timeout with an empty 200."""
    permit = quick.permit()
    body = json.dumps({"tool": "charge", "idempotencyKey": "k-slow", "requestFingerprint": b64(b"r")}).encode()
    host, port = quick.server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            f"POST /v1/permits/{permit}/attempts:authorize HTTP/1.1\r\nhost: 127.0.0.1\r\n".encode()
            + f"content-type: application/json\r\ngrpc-timeout: 1n\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body[:5]
        )
        status = s.makefile("rb").readline()
    assert status.startswith(b"HTTP/1.1 400"), status
    assert quick.usage(permit)["usage"][0].get("callsMade", "0") == "0"


def test_path_tricks_find_no_rpc(quick: Api) -> None:
    permit = quick.permit()
    for method, path in [
        ("GET", f"//v1/permits/{permit}"),
        ("GET", f"/V1/permits/{permit}"),
        ("GET", f"/v1%2Fpermits/{permit}"),
        ("GET", f"/v1/permits/{permit}/"),
        ("GET", f"/v1/permits/x/../{permit}"),
        ("GET", f"/v1/./permits/{permit}"),
        ("POST", "/v1/permits/"),
        ("GET", f"/v1/permits/{permit}/attempts"),
        ("GET", "/atmost.v1.Permits/GetPermit"),
        ("POST", "/grpc.health.v1.Health/Check"),
    ]:
        request = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}".encode()
        answer = raw(quick.server, request)
        assert status_of(answer) in (404, 405), (method, path, answer[:300])


def test_dev_mode_answers_only_a_loopback_host(quick: Api) -> None:
    """No keys on loopback: a page whose DNS name was rebound to this
    machine sends its own name as Host, and is refused."""
    for host in ["localhost", "127.0.0.1", "[::1]", "app.localhost"]:
        r = quick.get("/v1/signingKeys", headers={"host": f"{host}:1234"})
        assert r.status_code == 200, (host, r.text)
    for host in ["evil.example", "evil.example:50051", "10.0.0.1", "localhost.evil.example"]:
        r = quick.post("/v1/permits", {"tools": ["t"], "expiresAt": "2030-01-01T00:00:00Z"}, headers={"host": host})
        assert r.status_code == 403, (host, r.text)
        assert "loopback" in r.json()["error"]["message"], r.text
    r = quick.http.get("/v1/signingKeys", headers={"host": ""})
    assert r.status_code in (400, 403), r.text
