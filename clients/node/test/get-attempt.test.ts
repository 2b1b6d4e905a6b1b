/**
 * `client.getAttempt` (Permits.GetAttempt) against a live atmost: a key's
 * attempt read back in each state the Gate RPCs put it in, and the typed
 * errors for an unknown key, an unknown permit and a malformed id.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";

import { AtmostError, Denied, fingerprint, type Attempt, type Client } from "../src/index.js";
import { Atmost, createPermit, key } from "./support.js";

const TOOL = "wallet.charge";
const CHARGE = { amount: 500, currency: "EUR", to: "acct_42" };
/** A well-formed UUIDv7 no permit has. */
const UNKNOWN_PERMIT = "0190a5b2-0000-7000-8000-000000000000";

// A hang guard only: nothing asserts on time.
describe("getAttempt", { timeout: 60_000 }, () => {
  let atmost: Atmost;
  let client: Client;

  before(async () => {
    atmost = await Atmost.start();
    client = atmost.client();
  });
  after(async () => {
    client?.close();
    await atmost?.stop();
  });

  /** A DISPATCH for a fresh key under `permitId`: the key and its attempt. */
  const authorize = async (permitId: string, label: string): Promise<[string, Attempt]> => {
    const k = key(label);
    const answer = await client.authorize({ permitId, tool: TOOL, idempotencyKey: k, requestFingerprint: fingerprint(CHARGE), cost: 500 });
    assert.equal(answer.decision, "DECISION_DISPATCH");
    assert.ok(answer.attempt);
    return [k, answer.attempt];
  };
  const read = async (permitId: string, k: string): Promise<Attempt> => {
    const { attempt } = await client.getAttempt(permitId, k);
    assert.ok(attempt, "GetAttempt answered an attempt");
    return attempt;
  };

  test("each state reads back as the Gate left it: RESERVED, SUCCEEDED, UNCERTAIN, FAILED, RELEASED", async () => {
    const { permitId } = await createPermit(client, [TOOL], {}, { budget: 10_000 });

    const [reservedKey, reserved] = await authorize(permitId, "reserved");
    let attempt = await read(permitId, reservedKey);
    assert.equal(attempt.state, "ATTEMPT_STATE_RESERVED");
    assert.equal(attempt.attemptId, reserved.attemptId);
    assert.equal(attempt.permitId, permitId);
    assert.equal(attempt.idempotencyKey, reservedKey);
    assert.equal(attempt.tool, TOOL);
    assert.equal(attempt.cost, 500);
    assert.deepEqual(attempt.requestFingerprint, fingerprint(CHARGE));
    assert.deepEqual(attempt.leaseExpiresAt, reserved.leaseExpiresAt);
    // It only reads: the slot and the money are as Authorize left them.
    const usage = await client.getPermit(permitId);
    assert.equal(usage.usage[0].callsMade, 1);
    assert.equal(usage.budgetReserved, 500);

    const [succeededKey, succeeded] = await authorize(permitId, "succeeded");
    const committed = await client.commit({
      permitId,
      idempotencyKey: succeededKey,
      attemptId: succeeded.attemptId,
      succeeded: { result: Buffer.from('{"tx":981}') },
    });
    attempt = await read(permitId, succeededKey);
    assert.equal(attempt.state, "ATTEMPT_STATE_SUCCEEDED");
    assert.equal(attempt.attemptId, succeeded.attemptId);
    assert.deepEqual(attempt.receipt?.result, Buffer.from('{"tx":981}'));
    assert.equal(attempt.receipt?.receiptId, committed.attempt?.receipt?.receiptId);

    const [uncertainKey, uncertain] = await authorize(permitId, "uncertain");
    await client.markUncertain({ permitId, idempotencyKey: uncertainKey, attemptId: uncertain.attemptId, reason: "reset after sending" });
    attempt = await read(permitId, uncertainKey);
    assert.equal(attempt.state, "ATTEMPT_STATE_UNCERTAIN");
    assert.equal(attempt.attemptId, uncertain.attemptId);
    assert.equal(attempt.uncertainReason, "reset after sending");
    assert.ok(attempt.uncertainSince, "uncertainSince is set");

    const [failedKey, failed] = await authorize(permitId, "failed");
    await client.commit({ permitId, idempotencyKey: failedKey, attemptId: failed.attemptId, failed: { reason: "card declined" } });
    attempt = await read(permitId, failedKey);
    assert.equal(attempt.state, "ATTEMPT_STATE_FAILED");
    assert.equal(attempt.failureReason, "card declined");

    const [releasedKey, released] = await authorize(permitId, "released");
    await client.commit({ permitId, idempotencyKey: releasedKey, attemptId: released.attemptId, notSent: {} });
    attempt = await read(permitId, releasedKey);
    assert.equal(attempt.state, "ATTEMPT_STATE_RELEASED");
    assert.equal(attempt.attemptId, released.attemptId);
  });

  test("a key the permit never saw is NOT_FOUND / ATTEMPT_NOT_FOUND naming the key, a plain AtmostError", async () => {
    const { permitId } = await createPermit(client, [TOOL]);
    const error = await client.getAttempt(permitId, "never-authorized").then(
      () => assert.fail("expected ATTEMPT_NOT_FOUND"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof AtmostError, String(error));
    // Neither a refusal of the permit nor something to retry.
    assert.equal(error.constructor, AtmostError);
    assert.equal(error.code, Code.NOT_FOUND);
    assert.equal(error.reason, "ATTEMPT_NOT_FOUND");
    assert.equal(error.metadata.idempotency_key, "never-authorized");
  });

  test("an unknown permit is Denied PERMIT_NOT_FOUND", async () => {
    const error = await client.getAttempt(UNKNOWN_PERMIT, "k").then(
      () => assert.fail("expected PERMIT_NOT_FOUND"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof Denied, String(error));
    assert.equal(error.code, Code.NOT_FOUND);
    assert.equal(error.reason, "PERMIT_NOT_FOUND");
  });

  test("a malformed permit id and key are INVALID_REQUEST naming each field", async () => {
    const error = await client.getAttempt("not-a-uuid", "").then(
      () => assert.fail("expected INVALID_REQUEST"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof AtmostError, String(error));
    assert.equal(error.code, Code.INVALID_ARGUMENT);
    assert.equal(error.reason, "INVALID_REQUEST");
    assert.deepEqual(error.fieldViolations.map((v) => v.field).sort(), ["idempotency_key", "permit_id"]);
  });
});
