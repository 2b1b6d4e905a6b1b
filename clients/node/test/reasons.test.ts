/**
 * Every reason of the wire contract (atmost.v1.ErrorReason in
 * proto/atmost/v1/types.proto) is placed: a refusal this client raises as
 * Denied, or one of the reasons read by their own kind. A reason added to
 * the proto fails here until it is placed.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { DENIED_REASONS } from "../src/index.js";
import { PACKAGE_DIR } from "./support.js";

/** The reasons that are not refusals of what the request asks, and what they are raised as. */
const NOT_DENIED = new Map([
  ["IDEMPOTENCY_IN_PROGRESS", "InProgress"],
  ["STORE_UNAVAILABLE", "Unavailable: retried"],
  ["OVERLOADED", "Unavailable: retried"],
  ["DEADLINE_EXCEEDED", "Unavailable: retried"],
  ["INVALID_REQUEST", "AtmostError with fieldViolations"],
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
});
