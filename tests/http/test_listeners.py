"""Where each edge is served, and to which browser pages.

By default one listener serves gRPC and HTTP/JSON, told apart by content
type. With --http-listen the JSON edge moves to its own port: each
listener then refuses the other edge's requests, in that edge's own terms.
--http=false serves gRPC alone. CORS is off unless --http-cors-origins
names origins. Bad settings stop atmost before it listens (exit code 2).
"""

from __future__ import annotations

import pathlib
import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import JSON, START_TIMEOUT, Keys, Server, atmost_bin, tomorrow

PERMIT = {"tools": ["charge"], "expiresAt": tomorrow()}


def grpc_health(address: str) -> health_pb2.HealthCheckResponse:
    """grpc.health.v1 Check over a real gRPC client."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)


def create_permit(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/permits", json=PERMIT, headers=JSON, timeout=30)


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: pathlib.Path):
    servers = []

    def start(*args: str) -> Server:
        s = Server(list(args), tmp_path)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def test_one_listener_serves_both_edges(server) -> None:
    s = server()
    assert "http" not in s.also
    assert grpc_health(s.address).status == health_pb2.HealthCheckResponse.SERVING
    r = create_permit(s.url)
    assert r.status_code == 200, r.text


def test_http_listen_gives_each_edge_its_own_port(server) -> None:
    s = server("--http-listen", "127.0.0.1:0")
    assert s.also["http"] != s.address
    # Each edge where it belongs.
    r = create_permit(s.http_url)
    assert r.status_code == 200, r.text
    permit = r.json()["permitId"]
    assert grpc_health(s.address).status == health_pb2.HealthCheckResponse.SERVING
    # JSON on the gRPC port: refused in JSON, saying where it is served.
    authorize = {"tool": "charge", "idempotencyKey": "k1", "requestFingerprint": "cmVxLTE="}
    r = httpx.post(f"{s.url}/v1/permits/{permit}/attempts:authorize", json=authorize, headers=JSON, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["status"] == "NOT_FOUND" and "--http-listen" in error["message"], error
    # gRPC on the JSON port: refused in gRPC, saying where it is served.
    with pytest.raises(grpc.RpcError) as refused:
        grpc_health(s.also["http"])
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "--listen" in refused.value.details()
    # The refused Authorize reserved nothing; the same on the JSON port does.
    r = httpx.get(f"{s.http_url}/v1/permits/{permit}", timeout=30)
    assert r.status_code == 200 and r.json()["usage"][0].get("callsMade", "0") == "0", r.text
    r = httpx.post(f"{s.http_url}/v1/permits/{permit}/attempts:authorize", json=authorize, headers=JSON, timeout=30)
    assert r.status_code == 200 and r.json()["decision"] == "DECISION_DISPATCH", r.text


def test_http_false_serves_grpc_alone(server) -> None:
    """gRPC and nothing else, as before there was a JSON edge: HTTP/2
    only, and a JSON request over it told where it stands."""
    s = server("--http=false")
    assert grpc_health(s.address).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(httpx.RemoteProtocolError):
        create_permit(s.url)
    with httpx.Client(http1=False, http2=True) as h2:
        r = h2.post(f"{s.url}/v1/permits", json=PERMIT, headers=JSON, timeout=30)
    assert r.status_code == 404, r.text
    assert "--http=false" in r.json()["error"]["message"]


PREFLIGHT = {
    "access-control-request-method": "POST",
    "access-control-request-headers": "content-type,authorization,idempotency-key",
}


def test_cors_is_off_by_default(server) -> None:
    s = server()
    origin = {"origin": "https://console.example.com"}
    r = httpx.options(f"{s.url}/v1/permits", headers={**origin, **PREFLIGHT}, timeout=30)
    assert "access-control-allow-origin" not in r.headers, r.headers
    r = httpx.post(f"{s.url}/v1/permits", json=PERMIT, headers={**JSON, **origin}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.fixture
def key_file(keys: Keys, tmp_path: pathlib.Path) -> str:
    path = tmp_path / "keys.toml"
    path.write_text(keys.toml())
    return str(path)


def test_cors_allows_the_origins_given_and_no_other(server, key_file: str, keys: Keys) -> None:
    # Given as an operator may write it: upper case, the default port.
    s = server("--auth-keys", key_file, "--http-cors-origins", "https://Console.Example.com:443,http://localhost:3000")
    admin = keys.bearer("admin")
    for origin in ["https://console.example.com", "http://localhost:3000"]:
        r = httpx.options(f"{s.url}/v1/permits", headers={"origin": origin, **PREFLIGHT}, timeout=30)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        allowed = r.headers["access-control-allow-headers"].split(",")
        assert {"content-type", "authorization", "idempotency-key"} <= set(allowed)
        assert "access-control-allow-credentials" not in r.headers
        r = httpx.post(f"{s.url}/v1/permits", json=PERMIT, headers={**JSON, **admin, "origin": origin}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert set(r.headers["access-control-expose-headers"].split(",")) == {"retry-after", "idempotent-replayed"}
    for other in ["https://evil.example", "http://console.example.com", "https://console.example.com:8443"]:
        r = httpx.options(f"{s.url}/v1/permits", headers={"origin": other, **PREFLIGHT}, timeout=30)
        assert "access-control-allow-origin" not in r.headers, (other, r.headers)


def test_cors_any_origin(server, key_file: str) -> None:
    s = server("--auth-keys", key_file, "--http-cors-origins", "*")
    r = httpx.options(f"{s.url}/v1/permits", headers={"origin": "https://any.example", **PREFLIGHT}, timeout=30)
    assert r.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--http-cors-origins", "https://console.example.com/"], "is not an origin"),
        (["--http-cors-origins", "https://console.example.com/app"], "is not an origin"),
        (["--http-cors-origins", "ftp://console.example.com"], "is not an origin"),
        (["--http-cors-origins", "console.example.com"], "is not an origin"),
        (["--http-cors-origins", "https://user@console.example.com"], "is not an origin"),
        (["--http-cors-origins", "*,https://console.example.com"], "give it alone"),
        (["--http=false", "--http-listen", "127.0.0.1:0"], "--http-listen"),
        (["--http=false", "--http-cors-origins", "*"], "--http=false turns off"),
        (["--http-listen", "0.0.0.0:0"], "without authentication"),
        # Without keys, CORS would let a page drive the service from its
        # visitors' browsers.
        (["--http-cors-origins", "https://console.example.com"], "needs --auth-keys"),
        (["--insecure-no-auth", "--http-cors-origins", "*"], "needs --auth-keys"),
        (["--http-listen", "not-an-address"], "--http-listen"),
    ],
)
def test_bad_settings_stop_it_before_it_listens(args, says) -> None:
    done = subprocess.run(
        [atmost_bin(), "serve", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        timeout=START_TIMEOUT,
        env={"ATMOST_AUDIT_LOG": "off", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == b"", done.stdout
    assert says in done.stderr.decode(), done.stderr


def test_the_loopback_host_check_holds_on_every_listener_and_insecure_loopback(server) -> None:
    s = server("--http-listen", "127.0.0.1:0")
    r = httpx.get(f"{s.http_url}/v1/signingKeys", headers={"host": "evil.example"}, timeout=30)
    assert r.status_code == 403, r.text
    # HTTP/2's :authority is the Host there.
    with httpx.Client(http1=False, http2=True) as h2:
        r = h2.get(f"{s.http_url}/v1/signingKeys", headers={"host": "evil.example"}, timeout=30)
        assert r.http_version == "HTTP/2" and r.status_code == 403, r.text
    # --insecure-no-auth on loopback opens nothing more: still dev mode.
    s = server("--insecure-no-auth")
    r = httpx.get(f"{s.url}/v1/signingKeys", headers={"host": "evil.example"}, timeout=30)
    assert r.status_code == 403, r.text


def test_an_open_grpc_listener_leaves_a_loopback_json_edge_checked(tmp_path: pathlib.Path) -> None:
    s = Server(["--http-listen", "127.0.0.1:0", "--insecure-no-auth"], tmp_path, listen="0.0.0.0:0")
    try:
        r = httpx.get(f"{s.http_url}/v1/signingKeys", headers={"host": "evil.example"}, timeout=30)
        assert r.status_code == 403, r.text
    finally:
        s.stop()
    # The JSON edge itself off loopback, open on purpose: any Host.
    s = Server(["--insecure-no-auth"], tmp_path, listen="0.0.0.0:0")
    try:
        port = s.address.rsplit(":", 1)[1]
        r = httpx.get(f"http://127.0.0.1:{port}/v1/signingKeys", headers={"host": "atmost.internal.example"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_reflection_false_hides_the_openapi_document_too(server) -> None:
    s = server()
    assert httpx.get(f"{s.url}/v1/openapi.json", timeout=30).status_code == 200
    s = server("--reflection=false")
    r = httpx.get(f"{s.url}/v1/openapi.json", timeout=30)
    assert r.status_code == 404 and "--reflection=false" in r.json()["error"]["message"], r.text
    # The API itself is served as ever.
    assert create_permit(s.url).status_code == 200


def test_an_empty_cors_setting_is_none(tmp_path: pathlib.Path) -> None:
    """As a deployment template leaves it: ATMOST_HTTP_CORS_ORIGINS="" is
    no CORS, not an origin given (which would need --auth-keys)."""
    s = Server([], tmp_path, env={"ATMOST_HTTP_CORS_ORIGINS": ""})
    try:
        origin = {"origin": "https://console.example.com"}
        r = httpx.options(f"{s.url}/v1/permits", headers={**origin, **PREFLIGHT}, timeout=30)
        assert "access-control-allow-origin" not in r.headers, r.headers
    finally:
        s.stop()
