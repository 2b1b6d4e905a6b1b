/**
 * Every reason of the wire contract (atmost.v1.ErrorReason in
 * proto/atmost/v1/types.proto) is placed: a refusal this client raises as
 * Denied, or one of the reasons read by their own kind. A reason added to
 * the proto fails here until it is placed. And every row of the
 * classification (SPEC B): fromServiceError over each reason with the code
 * atmost answers it with, and the answers that carry no ErrorInfo of
 * atmost's (a proxy, a TLS front end, the transport).
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { Metadata, status as Code, type ServiceError } from "@grpc/grpc-js";

import { AtmostError, DENIED_REASONS, Denied, InProgress, InvalidRequest, Unavailable, fromServiceError } from "../src/index.js";
import { rpcTypes } from "../src/proto.js";
import { PACKAGE_DIR } from "./support.js";

/** The reasons that are not refusals of what the request asks, and what they are raised as. */
const NOT_DENIED = new Map([
  ["IDEMPOTENCY_IN_PROGRESS", "InProgress"],
  ["STORE_UNAVAILABLE", "Unavailable: retried"],
  ["OVERLOADED", "Unavailable: retried"],
  ["DEADLINE_EXCEEDED", "Unavailable: retried"],
  ["INVALID_REQUEST", "InvalidRequest with fieldViolations"],
  ["ATTEMPT_NOT_FOUND", "AtmostError: a settle of a key the permit never saw"],
  ["ATTEMPT_MISMATCH", "AtmostError: a stale attempt id"],
  ["ATTEMPT_STATE_CONFLICT", "AtmostError: the attempt is settled otherwise"],
  ["MESSAGE_TOO_LARGE", "AtmostError with limit: the request was larger than the server reads"],
]);

test("every reason of the proto is placed", () => {
  const proto = readFileSync(join(PACKAGE_DIR, "proto", "atmost", "v1", "types.proto"), "utf8");
  const body = /enum ErrorReason \{([^}]*)\}/.exec(proto);
  assert.ok(body, "no enum ErrorReason in types.proto");
  const reasons = [...body[1].matchAll(/^\s*([A-Z_]+) = \d+;/gm)].map((m) => m[1]).filter((r) => r !== "ERROR_REASON_UNSPECIFIED");
  assert.ok(reasons.length > 20, `only ${reasons.length} reasons read`);
  for (const reason of reasons) {
    assert.ok(DENIED_REASONS.has(reason) !== NOT_DENIED.has(reason), `${reason} is placed exactly once`);
  }
  assert.deepEqual([...DENIED_REASONS, ...NOT_DENIED.keys()].sort(), [...reasons].sort());
  assert.ok(DENIED_REASONS.has("ATTEMPT_HOLDER_MISMATCH"));
  assert.ok(DENIED_REASONS.has("APPROVER_IS_REQUESTER"));
});

/** A failed call as grpc-js hands it over: `code`, the message, and atmost's status details in the trailers. */
function failed(code: Code, info?: { reason: string; domain?: string }, violations: { field: string; description: string }[] = []): ServiceError {
  const metadata = new Metadata();
  const details = [];
  if (info) {
    const errorInfo = rpcTypes.ErrorInfo.encode(rpcTypes.ErrorInfo.fromObject({ reason: info.reason, domain: info.domain ?? "atmost", metadata: { tool: "t" } })).finish();
    details.push({ type_url: "type.googleapis.com/google.rpc.ErrorInfo", value: errorInfo });
  }
  if (violations.length > 0) {
    const bad = rpcTypes.BadRequest.encode(rpcTypes.BadRequest.fromObject({ field_violations: violations })).finish();
    details.push({ type_url: "type.googleapis.com/google.rpc.BadRequest", value: bad });
  }
  if (details.length > 0) {
    const status = rpcTypes.Status.encode(rpcTypes.Status.fromObject({ code, message: "m", details })).finish();
    metadata.set("grpc-status-details-bin", Buffer.from(status));
  }
  return Object.assign(new Error(`${code} m`), { code, details: "m", metadata });
}

/** The gRPC code atmost answers each reason with (the comments of enum ErrorReason). */
const CODE_OF: Record<string, Code> = {
  PERMIT_NOT_FOUND: Code.NOT_FOUND,
  PERMIT_REVOKED: Code.FAILED_PRECONDITION,
  PERMIT_EXPIRED: Code.FAILED_PRECONDITION,
  TOOL_NOT_IN_SCOPE: Code.PERMISSION_DENIED,
  PERMIT_MAX_CALLS_EXCEEDED: Code.RESOURCE_EXHAUSTED,
  PERMIT_BUDGET_EXCEEDED: Code.RESOURCE_EXHAUSTED,
  IDEMPOTENCY_KEY_REUSED: Code.FAILED_PRECONDITION,
  IDEMPOTENCY_IN_PROGRESS: Code.ABORTED,
  DUPLICATE_REQUEST_SUSPECTED: Code.ALREADY_EXISTS,
  ATTEMPT_NOT_FOUND: Code.NOT_FOUND,
  ATTEMPT_MISMATCH: Code.FAILED_PRECONDITION,
  ATTEMPT_STATE_CONFLICT: Code.FAILED_PRECONDITION,
  INVALID_REQUEST: Code.INVALID_ARGUMENT,
  STORE_UNAVAILABLE: Code.UNAVAILABLE,
  OVERLOADED: Code.UNAVAILABLE,
  DEADLINE_EXCEEDED: Code.DEADLINE_EXCEEDED,
  TOOL_HELD_UNCERTAIN: Code.FAILED_PRECONDITION,
  UNAUTHENTICATED: Code.UNAUTHENTICATED,
  ROLE_NOT_ALLOWED: Code.PERMISSION_DENIED,
  QUOTA_PERMIT_LIFETIME: Code.RESOURCE_EXHAUSTED,
  QUOTA_OPEN_ATTEMPTS: Code.RESOURCE_EXHAUSTED,
  QUOTA_ATTEMPTS: Code.RESOURCE_EXHAUSTED,
  QUOTA_TENANT_PERMITS: Code.RESOURCE_EXHAUSTED,
  QUOTA_STORE_FULL: Code.RESOURCE_EXHAUSTED,
  MESSAGE_TOO_LARGE: Code.RESOURCE_EXHAUSTED,
  ATTEMPT_HOLDER_MISMATCH: Code.PERMISSION_DENIED,
  APPROVER_IS_REQUESTER: Code.PERMISSION_DENIED,
};

/** The class of `error`, by name: the exact one, not a base it shares. */
const kind = (error: AtmostError) => error.constructor.name;

test("each reason of atmost is raised as its kind", () => {
  for (const reason of DENIED_REASONS) {
    assert.ok(reason in CODE_OF, `${reason} has no code here`);
    assert.equal(kind(fromServiceError(failed(CODE_OF[reason], { reason }))), "Denied", reason);
  }
  for (const [reason, placed] of NOT_DENIED) {
    const error = fromServiceError(failed(CODE_OF[reason], { reason }));
    assert.equal(kind(error), placed.split(/[ :]/)[0], reason);
    assert.equal(error.reason, reason);
    assert.equal(error.metadata.tool, "t");
  }
});

test("every row of the classification, with and without atmost's ErrorInfo", () => {
  const rows: [string, ServiceError, new (...args: never[]) => AtmostError][] = [
    ["a reason this client does not know: a refusal", failed(Code.FAILED_PRECONDITION, { reason: "PERMIT_SOMETHING_NEW" }), Denied],
    ["a reason this client does not know, RESOURCE_EXHAUSTED", failed(Code.RESOURCE_EXHAUSTED, { reason: "QUOTA_SOMETHING_NEW" }), Denied],
    ["a reason this client does not know, UNAVAILABLE: transient", failed(Code.UNAVAILABLE, { reason: "STORE_SOMETHING_NEW" }), Unavailable],
    ["a reason this client does not know, INVALID_ARGUMENT", failed(Code.INVALID_ARGUMENT, { reason: "SOMETHING_NEW" }), InvalidRequest],
    ["UNAUTHENTICATED without ErrorInfo (a proxy)", failed(Code.UNAUTHENTICATED), Denied],
    ["PERMISSION_DENIED without ErrorInfo (a TLS front end)", failed(Code.PERMISSION_DENIED), Denied],
    ["UNAUTHENTICATED with another domain's ErrorInfo", failed(Code.UNAUTHENTICATED, { reason: "EXPIRED_TOKEN", domain: "proxy.example" }), Denied],
    ["INVALID_ARGUMENT without ErrorInfo", failed(Code.INVALID_ARGUMENT), InvalidRequest],
    ["UNAVAILABLE without ErrorInfo (a broken connection)", failed(Code.UNAVAILABLE), Unavailable],
    ["DEADLINE_EXCEEDED without ErrorInfo", failed(Code.DEADLINE_EXCEEDED), Unavailable],
    ["CANCELLED without ErrorInfo (a timeout)", failed(Code.CANCELLED), Unavailable],
    ["IDEMPOTENCY_IN_PROGRESS", failed(Code.ABORTED, { reason: "IDEMPOTENCY_IN_PROGRESS" }), InProgress],
    ["INTERNAL without ErrorInfo", failed(Code.INTERNAL), AtmostError],
    ["UNKNOWN without ErrorInfo", failed(Code.UNKNOWN), AtmostError],
    ["another domain's reason, FAILED_PRECONDITION", failed(Code.FAILED_PRECONDITION, { reason: "X", domain: "proxy.example" }), AtmostError],
    ["ATTEMPT_STATE_CONFLICT", failed(Code.FAILED_PRECONDITION, { reason: "ATTEMPT_STATE_CONFLICT" }), AtmostError],
  ];
  for (const [name, error, want] of rows) assert.equal(kind(fromServiceError(error)), want.name, name);

  const invalid = fromServiceError(failed(Code.INVALID_ARGUMENT, { reason: "INVALID_REQUEST" }, [{ field: "idempotency_key", description: "too long" }]));
  assert.ok(invalid instanceof InvalidRequest && !(invalid instanceof Denied));
  assert.deepEqual(invalid.fieldViolations, [{ field: "idempotency_key", description: "too long" }]);
});
