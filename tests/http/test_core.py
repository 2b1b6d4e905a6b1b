"""The behaviour suite's core cases over HTTP/JSON, on both stores: the
same decisions and the same reasons as over gRPC, with HTTP's statuses."""

from __future__ import annotations

import secrets

import httpx

from conftest import Api, b64, quote, reason, tomorrow


def key() -> str:
    return f"k-{secrets.token_hex(4)}"


def test_dispatch_then_replay_with_the_recorded_outcome(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 1})
    k = key()
    first = api.authorize(permit, k)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["decision"] == "DECISION_DISPATCH"
    assert "idempotent-replayed" not in first.headers
    assert body["usage"]["callsMade"] == "1", "64-bit integers are strings"
    committed = api.commit(permit, k, body["attempt"]["attemptId"], {"succeeded": {"result": b64(b"ok")}})
    assert committed.status_code == 200, committed.text
    assert committed.json()["attempt"]["state"] == "ATTEMPT_STATE_SUCCEEDED"
    again = api.authorize(permit, k)
    assert again.status_code == 200
    assert again.json()["decision"] == "DECISION_REPLAY"
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["attempt"]["receipt"]["result"] == b64(b"ok")


def test_the_idempotency_key_header_names_the_key(api: Api) -> None:
    permit = api.permit()
    k = key()
    body = {"tool": "charge", "requestFingerprint": b64(b"r")}
    path = f"/v1/permits/{permit}/attempts:authorize"
    r = api.post(path, body, headers={"idempotency-key": f'"{k}"'})
    assert r.status_code == 200, r.text
    assert r.json()["attempt"]["idempotencyKey"] == k
    # The same key in the body and the header: one key.
    r = api.post(path, {**body, "idempotencyKey": k}, headers={"idempotency-key": f'"{k}"'})
    assert r.status_code == 409 and reason(r) == "IDEMPOTENCY_IN_PROGRESS", r.text
    # Two different keys: refused, nothing reserved.
    r = api.post(path, {**body, "idempotencyKey": "other"}, headers={"idempotency-key": f'"{k}"'})
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
    # No key at all: the draft's 400.
    r = api.post(path, body)
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "1"


def test_the_idempotency_key_header_bare_repeated_or_where_no_key_is(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 5})
    body = {"tool": "charge", "requestFingerprint": b64(b"r")}
    path = f"/v1/permits/{permit}/attempts:authorize"
    # Bare, as many clients send it: the key.
    k = key()
    r = api.post(path, body, headers={"idempotency-key": k})
    assert r.status_code == 200 and r.json()["attempt"]["idempotencyKey"] == k, r.text
    attempt = r.json()["attempt"]["attemptId"]
    # Two headers, a bad escape, parameters: 400, nothing reserved.
    for headers in [
        [("idempotency-key", '"a"'), ("idempotency-key", '"b"')],
        [("idempotency-key", r'"a\x"')],
        [("idempotency-key", '"a";x=1')],
        [("idempotency-key", '"a", "b"')],
    ]:
        r = api.http.post(path, json=body, headers=[("content-type", "application/json"), *headers])
        assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", (headers, r.text)
        assert "Idempotency-Key" in r.text, r.text
    # An RPC without a key refuses the header.
    r = api.post("/v1/permits", {"tools": ["charge"], "expiresAt": tomorrow()}, headers={"idempotency-key": '"k"'})
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
    # One whose path names the key: the header must say the same.
    commit = f"/v1/permits/{permit}/attempts/{quote(k)}:commit"
    r = api.post(commit, {"attemptId": attempt, "notSent": {}}, headers={"idempotency-key": '"another"'})
    assert r.status_code == 400 and reason(r) == "INVALID_REQUEST", r.text
    r = api.post(commit, {"attemptId": attempt, "notSent": {}}, headers={"idempotency-key": f'"{k}"'})
    assert r.status_code == 200, r.text
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "0"


def test_a_key_reused_with_another_request_is_422(api: Api) -> None:
    permit = api.permit()
    k = key()
    first = api.authorize(permit, k, b"one").json()
    api.commit(permit, k, first["attempt"]["attemptId"], {"succeeded": {}})
    r = api.authorize(permit, k, b"two")
    assert r.status_code == 422, r.text
    assert reason(r) == "IDEMPOTENCY_KEY_REUSED"
    assert r.json()["error"]["status"] == "FAILED_PRECONDITION"


def test_a_key_in_progress_is_409_with_retry_after(api: Api) -> None:
    permit = api.permit()
    k = key()
    assert api.authorize(permit, k).status_code == 200
    r = api.authorize(permit, k)
    assert r.status_code == 409, r.text
    assert reason(r) == "IDEMPOTENCY_IN_PROGRESS"
    assert r.json()["error"]["status"] == "ABORTED"
    # The lease is 30 s: retry within it, never sooner than a second.
    assert 1 <= int(r.headers["retry-after"]) <= 30
    retry = [d for d in r.json()["error"]["details"] if d["@type"].endswith("RetryInfo")]
    assert retry and retry[0]["retryDelay"].endswith("s")


def test_the_cap_holds_a_new_key_past_it(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 2})
    for _ in range(2):
        assert api.authorize(permit, key()).status_code == 200
    r = api.authorize(permit, key())
    assert r.status_code == 429, r.text
    assert reason(r) == "PERMIT_MAX_CALLS_EXCEEDED"
    info = r.json()["error"]["details"][0]
    assert info["metadata"] == {"tool": "charge", "limit": "2", "calls_made": "2"}
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "2"


def test_the_budget_holds(api: Api) -> None:
    permit = api.permit(budget="100")
    assert api.authorize(permit, key(), cost="60").status_code == 200
    r = api.authorize(permit, key(), cost=41)  # a number on input is read too
    assert r.status_code == 429 and reason(r) == "PERMIT_BUDGET_EXCEEDED", r.text
    assert api.usage(permit)["budgetReserved"] == "60"


def test_not_sent_gives_the_slot_back_and_frees_the_key(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 1})
    k = key()
    attempt = api.authorize(permit, k).json()["attempt"]
    r = api.commit(permit, k, attempt["attemptId"], {"notSent": {}})
    assert r.status_code == 200, r.text
    assert r.json()["attempt"]["state"] == "ATTEMPT_STATE_RELEASED"
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "0"
    again = api.authorize(permit, k)
    assert again.status_code == 200 and again.json()["decision"] == "DECISION_DISPATCH"


def test_uncertain_is_held_listed_and_resolved(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 1}, budget="500")
    k = key() + "/with:colon"
    attempt = api.authorize(permit, k, cost="200").json()["attempt"]
    r = api.post(
        f"/v1/permits/{permit}/attempts/{quote(k)}:markUncertain",
        {"attemptId": attempt["attemptId"], "reason": "timeout"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["attempt"]["state"] == "ATTEMPT_STATE_UNCERTAIN"
    # Slot and money stay held.
    assert reason(api.authorize(permit, key())) == "PERMIT_MAX_CALLS_EXCEEDED"
    assert api.usage(permit)["budgetReserved"] == "200"
    listed = api.get(f"/v1/permits/{permit}/uncertain", params={"pageSize": 10}).json()
    assert [a["idempotencyKey"] for a in listed["attempts"]] == [k]
    across = api.get("/v1/uncertain", params={"page_size": "1000"}).json()
    assert k in [a["idempotencyKey"] for a in across["attempts"]]
    got = api.get(f"/v1/permits/{permit}/attempts/{quote(k)}").json()
    assert got["attempt"]["state"] == "ATTEMPT_STATE_UNCERTAIN"
    r = api.post(
        f"/v1/permits/{permit}/attempts/{quote(k)}:resolve",
        {"attemptId": attempt["attemptId"], "notSent": {}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["attempt"]["state"] == "ATTEMPT_STATE_RELEASED"
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "0"
    assert api.get(f"/v1/permits/{permit}/uncertain").json() == {}


def test_hold_tool_refuses_the_tool_while_an_attempt_is_uncertain(api: Api) -> None:
    permit = api.permit(uncertainPolicy="UNCERTAIN_POLICY_HOLD_TOOL")
    k = key()
    attempt = api.authorize(permit, k).json()["attempt"]
    api.post(f"/v1/permits/{permit}/attempts/{k}:markUncertain", {"attemptId": attempt["attemptId"]})
    r = api.authorize(permit, key())
    assert r.status_code == 400 and reason(r) == "TOOL_HELD_UNCERTAIN", r.text
    assert r.json()["error"]["details"][0]["metadata"]["uncertain_key"] == k


def test_the_holder_token_redelivers_a_lost_dispatch(api: Api) -> None:
    permit = api.permit(maxCallsPerTool={"charge": 1})
    k = key()
    token = b64(b"holder-1")
    first = api.authorize(permit, k, holderToken=token).json()
    again = api.authorize(permit, k, holderToken=token)
    assert again.status_code == 200, again.text
    assert again.json()["decision"] == "DECISION_DISPATCH"
    assert again.json()["redelivered"] is True
    assert again.json()["attempt"]["attemptId"] == first["attempt"]["attemptId"]
    # A redelivered DISPATCH is not a replay: the holder may send.
    assert "idempotent-replayed" not in again.headers
    other = api.authorize(permit, k, holderToken=b64(b"holder-2"))
    assert other.status_code == 409 and reason(other) == "IDEMPOTENCY_IN_PROGRESS"
    assert api.usage(permit)["usage"][0].get("callsMade", "0") == "1"


def test_revoke_stops_new_keys_and_an_unknown_permit_is_404(api: Api) -> None:
    permit = api.permit()
    r = api.post(f"/v1/permits/{permit}:revoke")
    assert r.status_code == 200 and r.json()["status"] == "PERMIT_STATUS_REVOKED", r.text
    r = api.authorize(permit, key())
    assert r.status_code == 400 and reason(r) == "PERMIT_REVOKED"
    missing = "01a238ca-7e3a-7923-bf66-574b0b511439"
    r = api.get(f"/v1/permits/{missing}")
    assert r.status_code == 404 and reason(r) == "PERMIT_NOT_FOUND"


def test_signing_keys_and_http2(api: Api) -> None:
    assert api.get("/v1/signingKeys").json() == {}
    # HTTP/2 without TLS (prior knowledge), as `curl --http2-prior-knowledge`.
    with httpx.Client(
        base_url=api.server.url,
        transport=httpx.HTTPTransport(http1=False, http2=True),
    ) as h2:
        r = h2.get(f"/v1/permits/{api.permit()}")
        assert r.status_code == 200 and r.http_version == "HTTP/2"
