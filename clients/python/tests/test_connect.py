"""Connecting: the bearer API key (an atmost with --auth-keys) and TLS,
with the server's CA and with a client certificate (mTLS)."""

from __future__ import annotations

from typing import Any, List

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from atmost_client import AtmostError, Client, Denied, Retry, Unauthenticated, Unavailable

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


def test_a_wrong_key_is_a_refusal_of_the_guarded_call(auth_server, keys):
    # Every refusal of the call is Denied, authentication's too (SPEC B):
    # a caller that catches Denied is not surprised by a rotated key.
    with Client(auth_server.address, api_key=keys.admin) as admin:
        permit = admin.create_permit([TOOL]).permit_id
    retries: List[Any] = []
    with Client(
        auth_server.address, api_key="rotated-away", retry=Retry(on_retry=lambda *a: retries.append(a))
    ) as wrong:
        with pytest.raises(Denied) as caught:
            wrong.call_guarded(permit, TOOL, "k1", never, request={"n": 1})
    assert isinstance(caught.value, Unauthenticated)
    assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert retries == []
    with Client(auth_server.address, api_key=keys.admin) as admin:
        assert admin.get_permit(permit).usage[0].calls_made == 0


def never(attempt_id: str) -> Any:
    raise AssertionError(f"dispatched ({attempt_id}) where nothing may be sent")


def refuse(code: grpc.StatusCode, details: str, *error_details: Any):
    """A front end's hook that answers every call with ``code`` (and the
    google.rpc details given), sending nothing on to atmost."""

    def hook(request: bytes, context: grpc.ServicerContext, forward: Any) -> bytes:
        if not error_details:
            context.abort(code, details)
        packed = []
        for detail in error_details:
            wrapped = any_pb2.Any()
            wrapped.Pack(detail)
            packed.append(wrapped)
        status = status_pb2.Status(code=code.value[0], message=details, details=packed)
        context.abort_with_status(rpc_status.to_status(status))
        return b""

    return hook


@pytest.mark.parametrize(
    "code, kind",
    [
        (grpc.StatusCode.PERMISSION_DENIED, Denied),  # an authorizing proxy said no
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),  # a TLS front end wants a certificate
    ],
)
def test_a_refusal_by_a_front_end_without_errorinfo_is_denied(server, front_end, code, kind):
    with Client(server.address) as direct:
        permit = direct.create_permit([TOOL]).permit_id
    front = front_end(server.address, Authorize=refuse(code, "refused by the front end"))
    retries: List[Any] = []
    with Client(front.address, retry=Retry(on_retry=lambda *a: retries.append(a))) as c:
        with pytest.raises(Denied) as caught:
            c.call_guarded(permit, TOOL, "k1", never, request={"n": 1})
    assert isinstance(caught.value, kind)
    assert caught.value.code == code and caught.value.reason is None
    assert front.calls == ["Authorize"] and retries == []


def test_a_reason_newer_than_this_client_is_a_refusal(server, front_end):
    info = error_details_pb2.ErrorInfo(reason="TENANT_SUSPENDED", domain="atmost", metadata={"tenant": "t1"})
    front = front_end(
        server.address, Authorize=refuse(grpc.StatusCode.FAILED_PRECONDITION, "the tenant is suspended", info)
    )
    with Client(server.address) as direct:
        permit = direct.create_permit([TOOL]).permit_id
    with Client(front.address) as c:
        with pytest.raises(Denied) as caught:
            c.call_guarded(permit, TOOL, "k1", never, request={"n": 1})
    assert caught.value.reason == "TENANT_SUSPENDED" and caught.value.metadata == {"tenant": "t1"}
    assert front.calls == ["Authorize"]
    # A reason this client knows that is not a refusal stays what it was.
    conflict = error_details_pb2.ErrorInfo(reason="ATTEMPT_STATE_CONFLICT", domain="atmost")
    front.hooks["GetPermit"] = refuse(grpc.StatusCode.FAILED_PRECONDITION, "settled", conflict)
    with Client(front.address) as c:
        with pytest.raises(AtmostError) as plain:
            c.get_permit(permit)
    assert type(plain.value) is AtmostError and plain.value.reason == "ATTEMPT_STATE_CONFLICT"


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
