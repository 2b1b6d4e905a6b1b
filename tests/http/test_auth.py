"""Keys, roles and tenants over HTTP: the gRPC edge's, through the same
layer."""

from __future__ import annotations

from conftest import Api, Keys, Server, b64, reason, tomorrow


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
