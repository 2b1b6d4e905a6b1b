"""The HTTP/JSON edge over TLS: HTTP/1.1 and HTTP/2 clients both served,
a client certificate standing in for a key (mTLS) as over gRPC, and each
listener offering in ALPN only what it serves.

Certificates from a throwaway CA (python-trio's trustme); the server is
the real binary with --tls-cert, --tls-key and --tls-client-ca.
"""

from __future__ import annotations

import pathlib
import socket
import ssl
from typing import Iterator, Optional, Tuple

import grpc
import httpx
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import JSON, Keys, Server, b64, reason, tomorrow

# A DNS name (trustme issues no URI SANs; a SPIFFE id is read the same way).
SAN = "runner.agents.atmost.test"


class Tls:
    def __init__(self, tmp: pathlib.Path, keys: Keys) -> None:
        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        client = self.ca.issue_cert(SAN)
        self.ca_pem = tmp / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        self.server_cert, self.server_key = tmp / "server.pem", tmp / "server.key"
        server.private_key_pem.write_to_path(str(self.server_key))
        for i, pem in enumerate(server.cert_chain_pems):
            pem.write_to_path(str(self.server_cert), append=i > 0)
        self.client_cert, self.client_key = tmp / "client.pem", tmp / "client.key"
        client.private_key_pem.write_to_path(str(self.client_key))
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        self.keys = tmp / "keys.toml"
        self.keys.write_text(
            keys.toml()
            + f'[[cert]]\nid = "http-runner"\nsan = "{SAN}"\ntenant = "t1"\nroles = ["agent"]\n'
        )

    def args(self) -> list:
        return [
            "--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key),
            "--tls-client-ca", str(self.ca_pem), "--auth-keys", str(self.keys),
        ]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Tls:
    return Tls(tmp_path_factory.mktemp("tls"), keys)


@pytest.fixture(scope="module")
def tls_server(tls: Tls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server([*tls.args(), "--http-listen", "127.0.0.1:0"], tmp_path_factory.mktemp("tls-server"))
    yield server
    server.stop()


def context(tls: Tls, cert: Optional[Tuple[str, str]] = None) -> ssl.SSLContext:
    """A client's TLS: the throwaway CA trusted, and a certificate if given."""
    ctx = ssl.create_default_context(cafile=str(tls.ca_pem))
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def https(server: Server, tls: Tls, cert: Optional[Tuple[str, str]] = None, **kw) -> httpx.Client:
    return httpx.Client(base_url=f"https://{server.also['http']}", verify=context(tls, cert), timeout=30, **kw)


def test_http1_and_http2_clients_are_both_served_over_tls(tls_server: Server, tls: Tls, keys: Keys) -> None:
    # httpx without http2 offers only http/1.1 in ALPN, as requests and
    # Node's fetch do: a server offering only h2 would fail the handshake.
    with https(tls_server, tls, headers=keys.bearer("admin")) as h1:
        r = h1.post("/v1/permits", json={"tools": ["charge"], "expiresAt": tomorrow()}, headers=JSON)
        assert r.status_code == 200 and r.http_version == "HTTP/1.1", r.text
        permit = r.json()["permitId"]
    with https(tls_server, tls, headers=keys.bearer("admin"), http1=False, http2=True) as h2:
        r = h2.get(f"/v1/permits/{permit}")
        assert r.status_code == 200 and r.http_version == "HTTP/2", r.text


def test_a_client_certificate_stands_in_for_a_key(tls_server: Server, tls: Tls, keys: Keys) -> None:
    with https(tls_server, tls, headers=keys.bearer("admin")) as admin:
        permit = admin.post("/v1/permits", json={"tools": ["charge"], "expiresAt": tomorrow()}, headers=JSON).json()["permitId"]
    cert = (str(tls.client_cert), str(tls.client_key))
    with https(tls_server, tls, cert=cert) as runner:
        body = {"tool": "charge", "idempotencyKey": "k1", "requestFingerprint": b64(b"req")}
        r = runner.post(f"/v1/permits/{permit}/attempts:authorize", json=body, headers=JSON)
        assert r.status_code == 200 and r.json()["decision"] == "DECISION_DISPATCH", r.text
        # Its role is agent's, as the key file says.
        r = runner.post("/v1/permits", json={"tools": ["charge"], "expiresAt": tomorrow()}, headers=JSON)
        assert r.status_code == 403 and reason(r) == "ROLE_NOT_ALLOWED", r.text
    # Without a certificate or a key: UNAUTHENTICATED, over TLS as in plaintext.
    with https(tls_server, tls) as anonymous:
        r = anonymous.get(f"/v1/permits/{permit}")
        assert r.status_code == 401 and reason(r) == "UNAUTHENTICATED", r.text
    # A certificate another CA signed fails the handshake: nothing is answered.
    stranger = trustme.CA().issue_cert(SAN)
    with stranger.private_key_and_cert_chain_pem.tempfile() as both:
        with https(tls_server, tls, cert=(both, both)) as forged:
            with pytest.raises(httpx.HTTPError):
                forged.get(f"/v1/permits/{permit}")


def alpn(address: str, tls: Tls, offered: list) -> str:
    """The protocol the server picks of `offered` in the TLS handshake."""
    context = ssl.create_default_context(cafile=str(tls.ca_pem))
    context.set_alpn_protocols(offered)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname=host) as conn:
            return conn.selected_alpn_protocol()


def test_alpn_offers_http1_while_json_is_served(tls_server: Server, tls: Tls, tmp_path: pathlib.Path,
                                                keys: Keys) -> None:
    # Both listeners offer both while JSON is served: an HTTP/1.1 client on
    # the gRPC-only one hears where JSON is, as it would in plaintext.
    for address in (tls_server.also["http"], tls_server.address):
        assert alpn(address, tls, ["http/1.1"]) == "http/1.1"
        assert alpn(address, tls, ["h2", "http/1.1"]) == "h2"
    with httpx.Client(base_url=f"https://{tls_server.address}", verify=context(tls), timeout=30,
                      headers=keys.bearer("admin")) as h1:
        r = h1.get("/v1/signingKeys")
        assert r.status_code == 404 and "--http-listen" in r.json()["error"]["message"], r.text
    # gRPC over TLS as ever (Google's client).
    assert grpc_health(tls_server.address, tls) == health_pb2.HealthCheckResponse.SERVING
    # --http=false: h2 alone, as before the JSON edge.
    grpc_only = Server([*tls.args(), "--http=false"], tmp_path)
    try:
        assert alpn(grpc_only.address, tls, ["h2", "http/1.1"]) == "h2"
        with pytest.raises(ssl.SSLError, match="NO_APPLICATION_PROTOCOL|no application protocol"):
            alpn(grpc_only.address, tls, ["http/1.1"])
        assert grpc_health(grpc_only.address, tls) == health_pb2.HealthCheckResponse.SERVING
    finally:
        grpc_only.stop()


def grpc_health(address: str, tls: Tls) -> int:
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem.read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def test_a_client_silent_after_its_handshake_is_closed(tls: Tls, tmp_path: pathlib.Path) -> None:
    """The handshake timeout covers the TLS handshake and then the HTTP
    preface, counted on what TLS decrypts: the ClientHello's bytes do not
    pass for it, so a client that says nothing once it is through holds
    its connection slot for the handshake timeout, not the idle timeout."""
    # Long enough for a handshake on a busy machine; the read's guard is
    # far longer, and the idle timeout longer still.
    server = Server([*tls.args(), "--handshake-timeout", "3s", "--idle-timeout", "1h"], tmp_path)
    try:
        host, port = server.address.rsplit(":", 1)
        ctx = context(tls)
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection((host, int(port)), timeout=60) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as conn:
                # Closed by the server long before this read's guard: an EOF
                # (b"") or a reset, never the timeout.
                try:
                    got = conn.recv(1024)
                except (ConnectionResetError, ssl.SSLError):
                    got = b""
                assert got == b"", got
    finally:
        server.stop()


def test_both_edges_on_one_tls_listener(tls: Tls, tmp_path: pathlib.Path, keys: Keys) -> None:
    server = Server(tls.args(), tmp_path)
    try:
        with httpx.Client(base_url=f"https://{server.address}", verify=context(tls), timeout=30,
                          headers=keys.bearer("admin")) as h1:
            r = h1.get("/v1/signingKeys")
            assert r.status_code == 200 and r.http_version == "HTTP/1.1", r.text
        assert grpc_health(server.address, tls) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()
