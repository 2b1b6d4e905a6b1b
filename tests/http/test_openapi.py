"""The OpenAPI document at /v1/openapi.json: valid OpenAPI 3.1 by a
validator nobody here wrote, and true of the live server: every operation
it lists is called, each request checked against its schema before it is
sent and each answer against its schema after."""

from __future__ import annotations

import secrets
from typing import Any, Dict, Optional

import httpx
import pytest
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate

from conftest import JSON, Api, b64, quote, tomorrow


@pytest.fixture
def document(api: Api) -> Dict[str, Any]:
    r = api.get("/v1/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    return r.json()


def test_the_document_is_valid_openapi_3_1(document: Dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.1")
    validate(document)


def strict(schema: Any) -> Any:
    """`schema` with no property but those it names: the document allows
    more (a later version may answer more), this server must not."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def check(document: Dict[str, Any], schema: Dict[str, Any], value: Any, what: str) -> None:
    """`value` against `schema` (formats too), its references into the
    document, every object closed to properties it does not name."""
    root = strict({**schema, "components": document["components"]})
    validator = OAS31Validator(root, format_checker=OAS31Validator.FORMAT_CHECKER)
    errors = list(validator.iter_errors(value))
    assert not errors, f"{what}: {[e.message for e in errors]} in {value!r}"


def test_the_schemas_refuse_what_the_server_refuses(api: Api, document: Dict[str, Any]) -> None:
    """A oneof's two fields at once: the schema and the server both refuse."""
    op = document["paths"]["/v1/permits/{permit_id}/attempts/{idempotency_key}:commit"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    both = {"attemptId": "01a238ca-7e3a-7923-bf66-574b0b511439", "succeeded": {}, "failed": {}}
    errors = list(OAS31Validator({**schema, "components": document["components"]}).iter_errors(both))
    assert errors, "the schema lets a oneof's two fields through"
    r = api.post("/v1/permits/01a238ca-7e3a-7923-bf66-574b0b511439/attempts/k:commit", both)
    assert r.status_code == 400 and "oneof" in r.json()["error"]["message"].lower(), r.text
    # By the proto's names too, which the edge also reads.
    by_proto = {"attemptId": both["attemptId"], "succeeded": {}, "not_sent": {}}
    assert list(OAS31Validator({**schema, "components": document["components"]}).iter_errors(by_proto))
    # The receipt keys need no key; everything else names the bearer scheme.
    keys = document["paths"]["/v1/signingKeys"]["get"]
    assert keys["security"] == [], keys
    assert document["security"] == [{"apiKey": []}]


def test_every_operation_is_served_as_the_document_says(api: Api, document: Dict[str, Any]) -> None:
    operations = {
        op["operationId"]: (path, method, op)
        for path, methods in document["paths"].items()
        for method, op in methods.items()
    }
    called = set()

    def call(operation: str, path_params: Dict[str, str], body: Optional[Dict[str, Any]] = None,
             query: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        template, method, op = operations[operation]
        declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
        assert declared == set(path_params), (operation, declared)
        for p in op.get("parameters", []):
            if p["in"] == "query" and query and p["name"] in query:
                check(document, p["schema"], query[p["name"]], f"{operation} ?{p['name']}")
        assert set(query or {}) <= {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
        path = template
        for name, value in path_params.items():
            path = path.replace("{" + name + "}", quote(value))
        if body is not None:
            check(document, op["requestBody"]["content"]["application/json"]["schema"], body, f"{operation} body")
        else:
            assert "requestBody" not in op or method == "get", operation
        r = api.http.request(method.upper(), path, json=body, params=query, headers=JSON if body is not None else {})
        assert r.status_code == 200, (operation, r.status_code, r.text)
        check(document, op["responses"]["200"]["content"]["application/json"]["schema"], r.json(), f"{operation} answer")
        called.add(operation)
        return r.json()

    # An error answer matches the document's Error too.
    missing = api.get("/v1/permits/01a238ca-7e3a-7923-bf66-574b0b511439")
    assert missing.status_code == 404
    check(document, {"$ref": "#/components/schemas/Error"}, missing.json(), "a 404")

    permit = call("Permits_CreatePermit", {}, {
        "subject": "agent-7", "tools": ["charge", "refund"], "maxCallsPerTool": {"charge": 2, "refund": 1},
        "budget": "900", "currency": "EUR", "expiresAt": tomorrow(),
    })["permitId"]
    call("Permits_GetPermit", {"permit_id": permit})
    lost, done = f"k-{secrets.token_hex(4)}", f"k-{secrets.token_hex(4)}"
    auth = {"tool": "charge", "requestFingerprint": b64(b"req"), "cost": 300}
    first = call("Gate_Authorize", {"permit_id": permit}, {**auth, "idempotencyKey": lost})
    call("Gate_MarkUncertain", {"permit_id": permit, "idempotency_key": lost},
         {"attemptId": first["attempt"]["attemptId"], "reason": "timeout"})
    listed = [op for op in operations if op.startswith("Permits_ListUncertain")]
    assert len(listed) == 2, listed
    for op in listed:
        params = {"permit_id": permit} if "{permit_id}" in operations[op][0] else {}
        page = call(op, params, query={"pageSize": 10})
        assert lost in [a["idempotencyKey"] for a in page["attempts"]]
    call("Permits_GetAttempt", {"permit_id": permit, "idempotency_key": lost})
    call("Permits_Resolve", {"permit_id": permit, "idempotency_key": lost},
         {"attemptId": first["attempt"]["attemptId"], "succeeded": {"result": b64(b"tx 981")}})
    second = call("Gate_Authorize", {"permit_id": permit}, {**auth, "idempotencyKey": done})
    call("Gate_Commit", {"permit_id": permit, "idempotency_key": done},
         {"attemptId": second["attempt"]["attemptId"], "succeeded": {"result": b64(b"tx 982")}})
    # Human approval (dev mode: any caller may approve).
    held = call("Permits_CreatePermit", {}, {
        "tools": ["payout"], "expiresAt": tomorrow(),
        "approvalPerTool": {"payout": {"costAtLeast": "100", "wait": "600s", "approvers": 1}},
    })
    assert held["approvalPerTool"]["payout"]["wait"] == "600s", held
    pay = {"tool": "payout", "requestFingerprint": b64(b"pay"), "cost": 500, "approvalSummary": "pay 5 EUR"}
    asked = [call("Gate_Authorize", {"permit_id": held["permitId"]}, {**pay, "idempotencyKey": k})
             for k in ("pay-1", "pay-2")]
    assert [a["decision"] for a in asked] == ["DECISION_AWAIT_APPROVAL"] * 2, asked
    listed = [op for op in operations if op.startswith("Approvals_ListApprovals")]
    assert len(listed) == 2, listed
    for op in listed:
        params = {"permit_id": held["permitId"]} if "{permit_id}" in operations[op][0] else {}
        page = call(op, params, query={"pageSize": 10})
        assert [a["approval"]["summary"] for a in page["attempts"]] == ["pay 5 EUR"] * 2, page
    approved = call("Approvals_Approve", {"permit_id": held["permitId"], "idempotency_key": "pay-1"},
                    {"attemptId": asked[0]["attempt"]["attemptId"]})
    assert approved["attempt"]["state"] == "ATTEMPT_STATE_APPROVED", approved
    denied = call("Approvals_Deny", {"permit_id": held["permitId"], "idempotency_key": "pay-2"},
                  {"attemptId": asked[1]["attempt"]["attemptId"], "reason": "no"})
    assert denied["attempt"]["approval"]["denialReason"] == "no", denied
    call("Permits_RevokePermit", {"permit_id": permit}, {})
    call("Receipts_GetSigningKeys", {})
    assert called == set(operations), f"listed but not called: {set(operations) - called}"
