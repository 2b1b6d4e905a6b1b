"""Connecting: the bearer API key (an atmost with --auth-keys) and TLS,
with the server's CA and with a client certificate (mTLS)."""

from __future__ import annotations

from typing import Any, List

import grpc
import pytest

from atmost_client import Client, Denied, Retry, Unauthenticated, Unavailable

TOOL = "wallet.charge"


def test_the_right_key_works_and_roles_apply(auth_server, keys):
    with (
        Client(auth_server.address, api_key=keys.admin) as admin,
        Client(auth_server.address, api_key=keys.agent) as agent,
    ):
        permit = admin.create_permit([TOOL]).permit_id
        sent: List[str] = []
        outcome = agent.call_guarded(permit, TOOL, "k1", lambda a: sent.append(a) or "ok", request={"n": 1})
        assert outcome.result == "ok" and sent == [outcome.attempt_id]
        with pytest.raises(Denied) as caught:
            agent.create_permit([TOOL])
        assert caught.value.reason == "ROLE_NOT_ALLOWED"
        assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("api_key", ["wrong-key", None])
def test_a_wrong_or_missing_key_is_unauthenticated_and_never_retried(auth_server, keys, api_key):
    with Client(auth_server.address, api_key=keys.admin) as admin:
        permit = admin.create_permit([TOOL]).permit_id
    retries: List[Any] = []
    with Client(
        auth_server.address, api_key=api_key, retry=Retry(on_retry=lambda *a: retries.append(a))
    ) as wrong:
        with pytest.raises(Unauthenticated) as caught:
            wrong.get_permit(permit)
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert caught.value.reason == "UNAUTHENTICATED"

        def never(attempt_id: str) -> Any:
            raise AssertionError("dispatched without a valid key")

        with pytest.raises(Unauthenticated):
            wrong.call_guarded(permit, TOOL, "k1", never, request={"n": 1})
    assert retries == []


def test_a_key_that_is_not_visible_ascii_is_refused_before_connecting():
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", api_key="two words")


def test_tls_with_the_servers_ca(tls_server, ca, keys):
    with Client(tls_server.address, root_certificates=ca.cert_pem.bytes(), api_key=keys.admin) as c:
        permit = c.create_permit([TOOL]).permit_id
        outcome = c.call_guarded(permit, TOOL, "k1", lambda a: {"over": "tls"}, request={"n": 1})
        assert outcome.result == {"over": "tls"}


def test_mtls_a_client_certificate_stands_in_for_a_key(tls_server, ca, keys, tmp_path):
    with Client(tls_server.address, root_certificates=ca.cert_pem.bytes(), api_key=keys.admin) as admin:
        permit = admin.create_permit([TOOL]).permit_id
    cert = ca.issue_cert(keys.cert_san)
    cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    # File paths this time (PEM bytes work as well).
    with Client(
        tls_server.address,
        root_certificates=str(tmp_path / "ca.pem"),
        certificate_chain=str(tmp_path / "client.pem"),
        private_key=str(tmp_path / "client.key"),
    ) as runner:
        outcome = runner.call_guarded(permit, TOOL, "k1", lambda a: "by certificate", request={"n": 2})
        assert outcome.result == "by certificate"
        with pytest.raises(Denied) as caught:  # the certificate's role is agent
            runner.create_permit([TOOL])
        assert caught.value.reason == "ROLE_NOT_ALLOWED"


def test_tls_without_the_ca_fails_the_handshake(tls_server, keys):
    with Client(tls_server.address, tls=True, api_key=keys.admin) as c:
        with pytest.raises(Unavailable) as caught:
            c.get_permit("0190a5b2-0000-7000-8000-000000000000")
        assert caught.value.reason is None  # not atmost's answer: the transport's


def test_a_plaintext_client_cannot_talk_to_the_tls_server(tls_server, keys):
    with Client(tls_server.address, api_key=keys.admin) as c:
        with pytest.raises(Unavailable):
            c.get_permit("0190a5b2-0000-7000-8000-000000000000")


def test_mtls_needs_both_halves():
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", certificate_chain=b"-----BEGIN CERTIFICATE-----")


def test_certificates_that_are_not_pem_are_refused(tmp_path):
    with pytest.raises(ValueError, match="root_certificates is not PEM"):
        Client("127.0.0.1:1", root_certificates=b"garbage")
    with pytest.raises(ValueError, match="cannot read"):
        Client("127.0.0.1:1", root_certificates=str(tmp_path / "missing.pem"))
