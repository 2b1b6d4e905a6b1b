/**
 * What the guarded call records, and what it hands back, for each way a
 * dispatch can end (SPEC E): a result with its actual cost, an actual cost
 * atmost cannot take, results JSON writes only in part or not at all, a
 * client closed under the call (grpc-js throws then), and a Commit that
 * answers without the SUCCEEDED receipt (a relay rewrites atmost's answer).
 * Against a live atmost; `direct` reads back what atmost recorded.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import protobuf from "protobufjs";

import {
  AtmostError,
  Client,
  CommitNotRecorded,
  OutcomeUncertain,
  PROTO_DIR,
  ToolFailed,
  NotSent,
  withActualCost,
  type Dispatch,
} from "../src/index.js";
import { Atmost, FakeTool, createPermit, frameRelay, key, type Frame } from "./support.js";

const TOOL = "wallet.charge";
const CHARGE = { amount: 500, currency: "EUR", to: "acct_42" };

describe("what a dispatch's end records", { timeout: 120_000 }, () => {
  let atmost: Atmost;
  let direct: Client;
  let permitId: string;

  before(async () => {
    atmost = await Atmost.start();
    direct = atmost.client();
    permitId = (await createPermit(direct, [TOOL], { [TOOL]: 100 }, { budget: 1_000_000 })).permitId;
  });
  after(async () => {
    direct?.close();
    await atmost?.stop();
  });

  const call = (label: string, cost = 0) => ({ permitId, tool: TOOL, idempotencyKey: key(label), request: CHARGE, cost });
  const stateOf = async (idempotencyKey: string) => (await direct.getAttempt(permitId, idempotencyKey)).attempt!;

  test("withActualCost commits the actual cost: the receipt's cost, fresh and replayed", async () => {
    for (const actual of [300, 0, 200n]) {
      const c = call(`actual-${actual}`, 500);
      const out = await direct.guarded(c, async () => withActualCost({ tx: 7 }, actual));
      assert.equal(out.replayed, false);
      assert.deepEqual(out.result, { tx: 7 }, "the result, unwrapped");
      const typed: { tx: number } | Buffer = out.result; // the result's own type, not the wrapper's
      assert.ok(typed);
      assert.equal(out.receipt.cost, Number(actual));
      assert.equal(out.attempt.state, "ATTEMPT_STATE_SUCCEEDED");
      const replay = await direct.guarded(c, () => assert.fail("a replay dispatched"));
      assert.equal(replay.receipt.cost, Number(actual));
      assert.deepEqual(JSON.parse(replay.result.toString("utf8")), { tx: 7 });
    }
  });

  test("an actual cost that is not an integer from 0 to 2^63-1 records nothing: CommitNotRecorded carries the whole result", async () => {
    const bad: unknown[] = [1.5, 2 ** 63, "3", -1, Number.NaN, Infinity, undefined, null, -1n, 2n ** 63n];
    for (const cost of bad) {
      const c = call("bad-cost", 500);
      const result = { tx: 8, cost: String(cost) };
      const tool = new FakeTool();
      const error = await rejection(
        direct.guarded(c, async (attemptId) => {
          tool.hit(attemptId);
          return withActualCost(result, cost as number);
        }),
      );
      assert.ok(error instanceof CommitNotRecorded, `${String(cost)}: ${String(error)}`);
      assert.equal(error.outcome, "succeeded");
      assert.equal(error.result, result, "the whole result");
      assert.equal(error.attemptId, tool.calls[0]);
      assert.ok(error.cause instanceof RangeError || error.cause instanceof TypeError, String(error.cause));
      assert.match(String(error.cause), /actual cost must be an integer from 0 to 2\^63-1/);
      assert.equal((await stateOf(c.idempotencyKey)).state, "ATTEMPT_STATE_RESERVED", "nothing recorded: UNCERTAIN at its lease");
    }
    // In range for the client, past the reservation for atmost: refused, and the result kept.
    const c = call("over-reserved", 500);
    const error = await rejection(direct.guarded(c, async () => withActualCost("charged", 2n ** 63n - 1n)));
    assert.ok(error instanceof CommitNotRecorded, String(error));
    assert.equal(error.result, "charged");
    assert.ok(error.cause instanceof AtmostError && error.cause.code !== undefined, String(error.cause));
    assert.equal((await stateOf(c.idempotencyKey)).state, "ATTEMPT_STATE_RESERVED");
  });

  test("NaN and the infinities in a result are stored as null; the caller gets the result as the tool gave it", async () => {
    const result = { a: Number.NaN, b: [Infinity, -Infinity], c: 1 };
    const out = await direct.guarded(call("nan-result"), async () => result);
    assert.equal(out.result, result);
    assert.equal(out.receipt.result.toString("utf8"), '{"a":null,"b":[null,null],"c":1}');
  });

  test("a result JSON cannot write at all is committed Succeeded with an empty stored result; the caller gets it as given", async () => {
    const cycle: Record<string, unknown> = { n: 1 };
    cycle.self = cycle;
    const results: [string, unknown][] = [
      ["a BigInt", 5n],
      ["a BigInt inside", { n: [1n] }],
      ["a cycle", cycle],
      ["a function", () => "f"],
      ["a symbol", Symbol("s")],
      ["a toJSON that throws", { toJSON: () => assert.fail("no JSON for this") }],
      // Asking what it is throws (instanceof WithActualCost, Uint8Array), and so does JSON.stringify.
      ["a Proxy whose traps throw", new Proxy({}, { getPrototypeOf: boom, ownKeys: boom })],
      // instanceof Uint8Array says yes, but its bytes cannot be read.
      ["a Proxy that only looks like bytes", new Proxy(new Uint8Array([1, 2]), {})],
    ];
    for (const [name, result] of results) {
      const c = call("unwritable");
      const out = await direct.guarded(c, async () => result);
      assert.equal(out.replayed, false, name);
      assert.equal(out.result, result, name);
      assert.equal(out.attempt.state, "ATTEMPT_STATE_SUCCEEDED", name);
      assert.equal(out.receipt.result.length, 0, `${name}: stored empty`);
      const replay = await direct.guarded(c, () => assert.fail("a replay dispatched"));
      assert.ok(replay.replayed && replay.result.length === 0, `${name}: a replay returns an empty result`);
    }
  });

  test("a ToolFailed with a reason that is not a string commits Failed with it as text", async () => {
    const c = call("failed-number");
    const error = await rejection(
      direct.guarded(c, async () => {
        throw new ToolFailed(402 as unknown as string);
      }),
    );
    assert.ok(error instanceof ToolFailed, String(error));
    assert.equal(error.failureReason, "402");
    assert.equal(error.attempt?.state, "ATTEMPT_STATE_FAILED");
    assert.equal(error.attempt?.failureReason, "402");
  });

  test("a dispatch that throws a value String() cannot write is marked UNCERTAIN all the same", async () => {
    const c = call("odd-throw");
    const thrown: unknown = Object.create(null);
    const error = await rejection(
      direct.guarded(c, async () => {
        throw thrown;
      }),
    );
    assert.ok(error instanceof OutcomeUncertain, String(error));
    assert.equal(error.cause, thrown);
    assert.equal((await stateOf(c.idempotencyKey)).state, "ATTEMPT_STATE_UNCERTAIN");
  });

  test("a dispatch that throws an error whose name, message or kind cannot be read is marked UNCERTAIN all the same", async () => {
    const noMessage = new Error("hidden");
    Object.defineProperty(noMessage, "message", { get: boom });
    const noName = new TypeError("hidden");
    Object.defineProperty(noName, "name", { get: boom });
    const { proxy: revoked, revoke } = Proxy.revocable(new Error("revoked"), {});
    revoke();
    const thrownValues: [string, unknown, string][] = [
      ["message", noMessage, "dispatch threw [object Error]"],
      ["name", noName, "dispatch threw [object Error]"],
      // instanceof throws for these two: even ToolFailed / NotSent cannot be asked.
      ["prototype", new Proxy(new Error("trapped"), { getPrototypeOf: boom }), "dispatch threw Error: trapped"],
      ["revoked", revoked, "dispatch threw [object]"],
      // A ToolFailed whose reason cannot be read reports nothing: uncertain, not Failed.
      ["reason", new Proxy(new ToolFailed("declined"), { get: boom }), "dispatch threw [object]"],
    ];
    for (const [label, thrown, reason] of thrownValues) {
      const c = call(`unreadable-${label}`);
      const error = await rejection(
        direct.guarded(c, async () => {
          throw thrown;
        }),
      );
      assert.ok(error instanceof OutcomeUncertain, `${label}: ${String(error)}`);
      assert.equal(error.cause, thrown, label);
      const attempt = await stateOf(c.idempotencyKey);
      assert.equal(attempt.state, "ATTEMPT_STATE_UNCERTAIN", label);
      assert.equal(attempt.uncertainReason, reason, label);
    }
  });

  test("the client closed while dispatch runs: grpc-js throws on Commit, and CommitNotRecorded carries the result or the reason", async () => {
    const cases: [string, Dispatch<unknown>, string, unknown, string | undefined][] = [
      ["a result", async () => ({ tx: 9 }), "succeeded", { tx: 9 }, undefined],
      ["ToolFailed", async () => Promise.reject(new ToolFailed("card declined")), "failed", undefined, "card declined"],
      ["NotSent", async () => Promise.reject(new NotSent()), "not_sent", undefined, undefined],
      ["another error", async () => Promise.reject(new Error("reset")), "uncertain", undefined, "dispatch threw Error: reset"],
    ];
    for (const [name, ends, outcome, result, outcomeReason] of cases) {
      const closing = atmost.client();
      const c = call("closed");
      const error = await rejection(
        closing.guarded(c, (attemptId, signal) => {
          closing.close();
          return ends(attemptId, signal);
        }),
      );
      assert.ok(error instanceof CommitNotRecorded, `${name}: ${String(error)}`);
      assert.equal(error.outcome, outcome, name);
      assert.deepEqual(error.result, result, name);
      assert.equal(error.outcomeReason, outcomeReason, name);
      assert.ok(error.attemptId, name);
      assert.ok(error.cause instanceof Error && !(error.cause instanceof AtmostError), `${name}: ${String(error.cause)}`);
      assert.match(error.message, /shut down/, name);
      assert.equal((await stateOf(c.idempotencyKey)).state, "ATTEMPT_STATE_RESERVED", `${name}: nothing recorded`);
    }
  });

  test("a Commit answered without a SUCCEEDED attempt carrying a receipt is CommitNotRecorded with the whole result", async () => {
    const root = new protobuf.Root();
    root.resolvePath = (_origin: string, target: string) => join(PROTO_DIR, target);
    root.loadSync("atmost/v1/gate.proto", { keepCase: true });
    const CommitResponse = root.lookupType("atmost.v1.CommitResponse");
    const answers: [string, (answer: { attempt?: { state?: number; receipt?: unknown } }) => object][] = [
      ["no attempt", () => ({})],
      ["no receipt", (a) => ({ attempt: { ...a.attempt, receipt: undefined } })],
      ["RESERVED", (a) => ({ attempt: { ...a.attempt, state: 1 } })],
    ];
    for (const [name, broken] of answers) {
      // The second answer on the relay is the Commit's (the first, Authorize's).
      const relay = await frameRelay(atmost.address, (frame) => (frame.response === 2 ? rewrite(frame, CommitResponse, broken) : frame.bytes));
      const client = new Client({ address: relay.address });
      try {
        const c = call("broken-commit");
        const result = { tx: 10, name };
        const error = await rejection(client.guarded(c, async () => result));
        assert.ok(error instanceof CommitNotRecorded, `${name}: ${String(error)}`);
        assert.equal(error.outcome, "succeeded");
        assert.equal(error.result, result, `${name}: the result is not dropped`);
        assert.match(error.message, /not SUCCEEDED with a receipt/, name);
        // What atmost did: the Commit went through, the answer was broken on the way.
        assert.equal((await stateOf(c.idempotencyKey)).state, "ATTEMPT_STATE_SUCCEEDED", name);
      } finally {
        client.close();
        relay.close();
      }
    }
  });
});

/** `frame`, a DATA frame holding one whole gRPC message of `type`, with the message replaced by what `edit` makes of it. */
function rewrite(frame: Frame, type: protobuf.Type, edit: (message: never) => object): Buffer {
  const payload = frame.bytes.subarray(9);
  assert.equal(frame.flags & 0x8, 0, "a padded DATA frame");
  assert.equal(payload[0], 0, "a compressed message");
  assert.equal(payload.readUInt32BE(1), payload.length - 5, "the message spans frames");
  const message = type.toObject(type.decode(payload.subarray(5)), { defaults: false, enums: Number });
  const encoded = type.encode(type.fromObject(edit(message as never))).finish();
  const out = Buffer.alloc(9 + 5 + encoded.length);
  out.writeUIntBE(5 + encoded.length, 0, 3);
  frame.bytes.copy(out, 3, 3, 9);
  out.writeUInt32BE(encoded.length, 10);
  Buffer.from(encoded).copy(out, 14);
  return out;
}

/** The error a promise rejects with (failing the test if it resolves). */
/** A getter or a Proxy trap that throws. */
function boom(): never {
  throw new Error("this cannot be read");
}

async function rejection(promise: Promise<unknown>): Promise<Error> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof Error, `rejected with a non-Error: ${String(error)}`);
    return error;
  }
  assert.fail("expected a rejection, got a result");
}
