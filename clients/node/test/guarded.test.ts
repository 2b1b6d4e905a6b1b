/**
 * The guarded call against a live atmost (memory store, dev mode): every
 * path of the client contract, with a fake tool that counts the side
 * effects that reached it.
 */
import assert from "node:assert/strict";
import { createHash, randomBytes } from "node:crypto";
import { connect, createServer, type Server, type Socket } from "node:net";
import { after, before, describe, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";

import {
  AtmostError,
  Client,
  CommitNotRecorded,
  DEFAULT_RETRY,
  Denied,
  FingerprintError,
  HeldByEarlierRun,
  InProgress,
  InvalidRequest,
  NotSent,
  OutcomeUncertain,
  ToolFailed,
  Unavailable,
  dispatchTimeMs,
  fingerprint,
  type Dispatch,
  type RetryEvent,
} from "../src/index.js";
import { Atmost, FakeTool, createPermit, freePort, freeze, key } from "./support.js";

const TOOL = "wallet.charge";
const CHARGE = { amount: 500, currency: "EUR", to: "acct_42" };

// A hang guard only: nothing asserts on time.
describe("guarded call", { timeout: 120_000 }, () => {
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

  const callsMade = async (permitId: string) => (await client.getPermit(permitId)).usage.find((u) => u.tool === TOOL)!.callsMade;

  test("DISPATCH then Commit Succeeded; the same key REPLAYs the result without dispatching", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 });
    const tool = new FakeTool();
    const k = key("charge");
    const call = { permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE, cost: 0 };

    const first = await client.guarded(call, async (attemptId, signal) => {
      assert.equal(signal.aborted, false);
      tool.hit(attemptId);
      return { tx: 981, attempt: attemptId };
    });
    assert.equal(first.replayed, false);
    assert.deepEqual(first.result, { tx: 981, attempt: first.attempt.attemptId });
    assert.equal(first.attempt.state, "ATTEMPT_STATE_SUCCEEDED");
    assert.deepEqual(first.attempt.requestFingerprint, fingerprint(CHARGE));
    assert.deepEqual(tool.calls, [first.attempt.attemptId], "dispatch got the attempt id");

    const again = await client.guarded(call, async (attemptId) => {
      tool.hit(attemptId);
      return "never";
    });
    assert.equal(again.replayed, true);
    assert.equal(tool.calls.length, 1, "a REPLAY never dispatches");
    assert.equal(again.receipt.receiptId, first.receipt.receiptId);
    assert.ok(Buffer.isBuffer(again.result));
    assert.deepEqual(JSON.parse(again.result.toString("utf8")), first.result);
    assert.equal(await callsMade(permit.permitId), 1);
  });

  test("a cap of 1 then a NEW key: Denied PERMIT_MAX_CALLS_EXCEEDED with tool, limit and calls_made", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 });
    const tool = new FakeTool();
    const dispatch = async (attemptId: string) => tool.hit(attemptId);
    await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("one"), request: CHARGE }, dispatch);

    const retries: RetryEvent[] = [];
    const error = await rejection(
      client.guarded(
        { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("two"), request: CHARGE, onRetry: (e) => retries.push(e) },
        dispatch,
      ),
    );
    assert.ok(error instanceof Denied, String(error));
    assert.equal(error.code, Code.RESOURCE_EXHAUSTED);
    assert.equal(error.reason, "PERMIT_MAX_CALLS_EXCEEDED");
    assert.equal(error.tool, TOOL);
    assert.equal(error.limit, 1);
    assert.equal(error.callsMade, 1);
    assert.equal(error.metadata.calls_made, "1");
    assert.equal(tool.calls.length, 1, "nothing dispatched for the refused key");
    assert.deepEqual(retries, [], "a refusal is never retried");
  });

  test("ToolFailed from dispatch commits FAILED; the same key raises it again, replayed", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 2 });
    const tool = new FakeTool();
    const call = { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("declined"), request: CHARGE };

    const error = await rejection(
      client.guarded(call, async (attemptId) => {
        tool.hit(attemptId);
        throw new ToolFailed("card declined");
      }),
    );
    assert.ok(error instanceof ToolFailed, String(error));
    assert.equal(error.replayed, false);
    assert.equal(error.failureReason, "card declined");
    assert.equal(error.attemptId, tool.calls[0]);
    assert.equal(error.attempt?.state, "ATTEMPT_STATE_FAILED");

    const replayed = await rejection(client.guarded(call, async (attemptId) => tool.hit(attemptId)));
    assert.ok(replayed instanceof ToolFailed, String(replayed));
    assert.equal(replayed.replayed, true);
    assert.equal(replayed.failureReason, "card declined");
    assert.equal(tool.calls.length, 1);
    assert.equal(await callsMade(permit.permitId), 1, "FAILED keeps its slot");
  });

  test("NotSent from dispatch commits NotSent: the slot comes back and a new key dispatches", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 });
    const tool = new FakeTool();
    const k = key("offline");
    const error = await rejection(
      client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE }, async () => {
        throw new NotSent("the wallet's circuit breaker is open");
      }),
    );
    assert.ok(error instanceof NotSent, String(error));
    assert.ok(error.attemptId);
    assert.equal(error.attempt?.state, "ATTEMPT_STATE_RELEASED");
    assert.equal(await callsMade(permit.permitId), 0, "the slot is back");

    const next = await client.guarded(
      { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("next"), request: CHARGE },
      async (attemptId) => tool.hit(attemptId),
    );
    assert.equal(next.replayed, false);
    assert.equal(tool.calls.length, 1);
    assert.equal(await callsMade(permit.permitId), 1);
  });

  test("the lost response: a dispatch that hangs past its deadline ends UNCERTAIN, is sent once, and the key stays the same unknown", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 3 });
    const tool = new FakeTool();
    const k = key("lost-response");
    let aborted: AbortSignal | undefined;
    const call = { permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE, dispatchTimeoutMs: 300 };

    const error = await rejection(
      client.guarded(call, (attemptId, signal) => {
        tool.hit(attemptId);
        aborted = signal;
        return new Promise<never>(() => {}); // sent; the answer never comes
      }),
    );
    assert.ok(error instanceof OutcomeUncertain, String(error));
    assert.equal(error.replayed, false);
    assert.equal(error.attempt?.state, "ATTEMPT_STATE_UNCERTAIN");
    assert.equal(aborted?.aborted, true, "the dispatch's signal fired at the deadline");
    assert.equal(tool.calls.length, 1, "never re-sent");
    const attemptId = tool.calls[0];
    assert.equal(error.attemptId, attemptId);

    // Read back by an operator's listing: UNCERTAIN, with the helper's reason.
    const listed = await client.listUncertain({ permitId: permit.permitId });
    assert.deepEqual(
      listed.attempts.map((a) => [a.attemptId, a.idempotencyKey]),
      [[attemptId, k]],
    );
    assert.match(listed.attempts[0].uncertainReason, /dispatch deadline of 300 ms passed/);
    assert.equal(await callsMade(permit.permitId), 1, "the slot stays held");

    const again = await rejection(client.guarded(call, async (id) => tool.hit(id)));
    assert.ok(again instanceof OutcomeUncertain, String(again));
    assert.equal(again.replayed, true);
    assert.equal(again.attemptId, attemptId);
    assert.equal(tool.calls.length, 1, "the same key never dispatches again");
  });

  test("a dispatch that throws anything else is marked UNCERTAIN, chained to its error", async () => {
    const permit = await createPermit(client, [TOOL]);
    const reset = new Error("connection reset after the request was written");
    const error = await rejection(
      client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("reset"), request: CHARGE }, async () => {
        throw reset;
      }),
    );
    assert.ok(error instanceof OutcomeUncertain, String(error));
    assert.equal(error.cause, reset);
    const [listed] = (await client.listUncertain({ permitId: permit.permitId })).attempts;
    assert.equal(listed.attemptId, error.attemptId);
    assert.equal(listed.uncertainReason, "dispatch threw Error: connection reset after the request was written");
  });

  test("without a dispatch timeout the deadline is the lease minus 1 s; a lease of 1 s leaves none and nothing is sent", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 }, { lease: { seconds: 1, nanos: 500_000_000 } });
    const tool = new FakeTool();
    const hung = await rejection(
      client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("lease"), request: CHARGE }, (id) => {
        tool.hit(id);
        return new Promise<never>(() => {});
      }),
    );
    assert.ok(hung instanceof OutcomeUncertain, String(hung));
    assert.match(hung.message, /dispatch deadline of 500 ms passed/);

    const short = await createPermit(client, [TOOL], { [TOOL]: 1 }, { lease: { seconds: 1, nanos: 0 } });
    const refused = await rejection(
      client.guarded({ permitId: short.permitId, tool: TOOL, idempotencyKey: key("short"), request: CHARGE }, (id) => tool.hit(id)),
    );
    assert.ok(refused instanceof NotSent, String(refused));
    assert.equal(refused.attempt?.state, "ATTEMPT_STATE_RELEASED");
    assert.equal(tool.calls.length, 1, "nothing sent under the 1 s lease");
    assert.equal(await callsMade(short.permitId), 0);
  });

  test("a dispatchTimeoutMs past the lease is cut to the lease minus 1 s; under a 1 s lease nothing is sent whatever the timeout", async () => {
    // Past the lease the attempt reads UNCERTAIN, an operator may resolve it
    // NotSent and the key be used again: a call still being sent then would
    // exceed the cap.
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 }, { lease: { seconds: 1, nanos: 500_000_000 } });
    const tool = new FakeTool();
    const hung = await rejection(
      client.guarded(
        { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("long-timeout"), request: CHARGE, dispatchTimeoutMs: 5_000 },
        (id) => {
          tool.hit(id);
          return new Promise<never>(() => {});
        },
      ),
    );
    assert.ok(hung instanceof OutcomeUncertain, String(hung));
    assert.equal(hung.attempt?.uncertainReason, "dispatch deadline of 500 ms passed");
    assert.equal(tool.calls.length, 1);

    const short = await createPermit(client, [TOOL], { [TOOL]: 1 }, { lease: { seconds: 1, nanos: 0 } });
    const refused = await rejection(
      client.guarded(
        { permitId: short.permitId, tool: TOOL, idempotencyKey: key("short"), request: CHARGE, dispatchTimeoutMs: 5_000 },
        (id) => tool.hit(id),
      ),
    );
    assert.ok(refused instanceof NotSent, String(refused));
    assert.equal(refused.attempt?.state, "ATTEMPT_STATE_RELEASED");
    assert.equal(tool.calls.length, 1, "nothing sent under the 1 s lease");
    assert.equal(await callsMade(short.permitId), 0);
  });

  test("a ToolFailed or NotSent of a guarded call made inside dispatch does not settle the outer call: it is UNCERTAIN", async () => {
    // The inner call's error tells what became of the inner call, not of
    // the outer one, which went out. Taken as the outer call's NotSent, it
    // would give the slot back, and the key be free to send again.
    const permit = await createPermit(client, [TOOL]);
    const outerSent: string[] = [];
    const cases: [string, Dispatch<never>, typeof NotSent | typeof ToolFailed][] = [
      [
        key("outer-not-sent"),
        () => {
          throw new NotSent("the mailer's host did not resolve");
        },
        NotSent,
      ],
      [
        key("outer-failed"),
        () => {
          throw new ToolFailed("card declined");
        },
        ToolFailed,
      ],
    ];
    for (const [k, inner, kind] of cases) {
      const error = await rejection(
        client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE }, async (attemptId) => {
          outerSent.push(attemptId); // the outer call's side effect went out
          return client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: `inner-of-${attemptId}`, request: 2 }, inner);
        }),
      );
      assert.ok(error instanceof OutcomeUncertain, String(error));
      assert.ok(error.cause instanceof kind, String(error.cause));
      assert.ok(error.cause.attemptId && error.cause.attemptId !== error.attemptId, "the inner call's error names the inner attempt");
      assert.equal(error.attempt?.state, "ATTEMPT_STATE_UNCERTAIN");
    }
    const listed = await client.listUncertain({ permitId: permit.permitId });
    assert.deepEqual(listed.attempts.map((a) => a.attemptId).sort(), [...outerSent].sort());
    assert.equal(await callsMade(permit.permitId), 3, "the two outer calls and the inner FAILED one hold their slots");
  });

  test("a restart with a kept holder token: the DISPATCH redelivered to it is never sent again; HeldByEarlierRun is settled uncertain or, known unsent, NotSent", async () => {
    // Process A makes the guarded call with a token it keeps in its journal,
    // and dies after its dispatch started: its channel is gone, so nothing
    // is reported. The restarted process makes the same call (key, request,
    // token): atmost redelivers the DISPATCH, and it must not be sent again.
    const permit = await createPermit(client, [TOOL], { [TOOL]: 2 });
    const tool = new FakeTool();
    const crash = async (k: string, token: Buffer, send: boolean) => {
      const a = atmost.client();
      const died = await rejection(
        a.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE, holderToken: token }, (attemptId) => {
          if (send) tool.hit(attemptId);
          a.close(); // the process dies: nothing more reaches atmost
          throw new Error("process A died");
        }),
      );
      assert.ok(!(died instanceof OutcomeUncertain), `A could not report: ${String(died)}`);
    };
    const charge1 = key("restart-sent");
    const token1 = randomBytes(16);
    await crash(charge1, token1, true);
    assert.equal(tool.calls.length, 1);

    const retries: RetryEvent[] = [];
    const other = await rejection(
      client.guarded(
        { permitId: permit.permitId, tool: TOOL, idempotencyKey: charge1, request: CHARGE, holderToken: randomBytes(16), onRetry: (e) => retries.push(e) },
        (id) => tool.hit(id),
      ),
    );
    assert.ok(other instanceof InProgress, String(other));
    // RetryInfo: the time to the lease's end, 30 s, past the 10 s retry
    // budget: raised at once, not slept on into the budget's end.
    assert.ok((other.retryAfterMs ?? 0) > DEFAULT_RETRY.maxTotalMs, `retryAfterMs ${other.retryAfterMs}`);
    assert.deepEqual(retries, [], "no wait begun that would end past the budget");

    const restarted = atmost.client();
    try {
      const held = await rejection(
        restarted.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: charge1, request: CHARGE, holderToken: token1 }, (id) => tool.hit(id)),
      );
      assert.ok(held instanceof HeldByEarlierRun, String(held));
      assert.deepEqual(tool.calls, [held.attemptId], "never sent again");
      assert.equal(held.attempt.state, "ATTEMPT_STATE_RESERVED", "nothing recorded");
      assert.ok(held.leaseRemainingMs !== undefined && held.leaseRemainingMs > 0 && held.leaseRemainingMs <= 30_000, String(held.leaseRemainingMs));
      // Nothing says A never sent: settled uncertain, the slot stays held.
      const settled = await restarted.settleUncertain(held.attempt, "restarted: the earlier run may have sent");
      assert.equal(settled.state, "ATTEMPT_STATE_UNCERTAIN");
      const replayed = await rejection(
        restarted.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: charge1, request: CHARGE, holderToken: token1 }, (id) => tool.hit(id)),
      );
      assert.ok(replayed instanceof OutcomeUncertain && replayed.replayed, String(replayed));
      assert.equal(replayed.attemptId, held.attemptId);
      assert.equal(await callsMade(permit.permitId), 1);

      // A second key, whose run died before sending (its journal says so):
      // NotSent frees the key, and the call made again is a fresh DISPATCH,
      // sent once.
      const charge2 = key("restart-unsent");
      const token2 = randomBytes(16);
      await crash(charge2, token2, false);
      const held2 = await rejection(
        restarted.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: charge2, request: CHARGE, holderToken: token2 }, (id) => tool.hit(id)),
      );
      assert.ok(held2 instanceof HeldByEarlierRun, String(held2));
      const released = await restarted.settleNotSent(held2.attempt);
      assert.equal(released.state, "ATTEMPT_STATE_RELEASED");
      assert.equal(await callsMade(permit.permitId), 1, "the slot came back");
      const again = await restarted.guarded(
        { permitId: permit.permitId, tool: TOOL, idempotencyKey: charge2, request: CHARGE, holderToken: token2 },
        async (id) => {
          tool.hit(id);
          return "charged";
        },
      );
      assert.equal(again.replayed, false);
      assert.notEqual(again.attempt.attemptId, held2.attemptId);
      assert.equal(tool.calls.length, 2);
      assert.equal(await callsMade(permit.permitId), 2);
    } finally {
      restarted.close();
    }
  });

  test("the dispatch time is what atmost says is left of the lease, less the margin", () => {
    // From the DISPATCH's arrival: leaseRemainingMs, leaseMs, since the try the lease counts from, timeout.
    // leaseRemaining is counted from the start of the Authorize try it
    // answered, 700 ms before the DISPATCH arrived here.
    assert.equal(dispatchTimeMs(30_000, 30_000, 700, undefined), 28_300, "a fresh DISPATCH: the whole lease was left, less the answer's way");
    assert.equal(dispatchTimeMs(1_500, 3_000, 0, undefined), 500, "a redelivery late in the lease: what is left");
    assert.equal(dispatchTimeMs(1_500, 3_000, 0, 5_000), 500, "a longer timeout is cut to it");
    assert.equal(dispatchTimeMs(1_500, 3_000, 0, 200), 200, "a shorter one is kept");
    assert.equal(dispatchTimeMs(3_000, 3_000, 1_500, 5_000), 500, "an answer 1.5 s on its way: only what is left");
    assert.ok(dispatchTimeMs(999, 3_000, 0, 5_000) <= 0, "under the margin: no time, dispatch is not called");
    assert.ok(dispatchTimeMs(3_000, 3_000, 2_500, 5_000) <= 0, "an answer that took the lease less the margin: no time");
    assert.equal(dispatchTimeMs(undefined, 3_000, 700, undefined), 1_300, "a server that does not say: the whole lease from the first try");
    assert.equal(dispatchTimeMs(undefined, 3_000, 700, 5_000), 1_300);
  });

  test("results: bytes are stored as they are; over 64 KiB, sha256:<hex> is stored and the caller gets the whole result", async () => {
    const permit = await createPermit(client, [TOOL]);
    const raw = Buffer.from([0, 1, 2, 254, 255]);
    const bytesCall = { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("bytes"), request: CHARGE };
    await client.guarded(bytesCall, async () => raw);
    const bytesReplay = await client.guarded(bytesCall, async () => Buffer.alloc(0));
    assert.ok(bytesReplay.replayed);
    assert.deepEqual(bytesReplay.result, raw);

    const big = { blob: "x".repeat(70_000) };
    const bigCall = { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("big"), request: CHARGE };
    const fresh = await client.guarded(bigCall, async () => big);
    assert.deepEqual(fresh.result, big);
    const digest = createHash("sha256").update(JSON.stringify(big)).digest("hex");
    assert.equal(fresh.receipt.result.toString("ascii"), `sha256:${digest}`);
    const replay = await client.guarded(bigCall, async () => null);
    assert.ok(replay.replayed);
    assert.equal(replay.result.toString("ascii"), `sha256:${digest}`);
  });

  test("bad input fails with a clear error before anything is sent", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 });
    const tool = new FakeTool();
    const dispatch = async (id: string) => tool.hit(id);
    const base = { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("bad"), request: CHARGE };
    const cases: [string, unknown, RegExp][] = [
      ["no permit id", { ...base, permitId: "" }, /permitId must be a non-empty string/],
      ["both request and fingerprint", { ...base, fingerprint: Buffer.alloc(32) }, /exactly one of request/],
      ["neither", { permitId: base.permitId, tool: TOOL, idempotencyKey: base.idempotencyKey }, /exactly one of request/],
      ["a request JSON cannot hold", { ...base, request: undefined }, /not a JSON value/],
      ["a negative cost", { ...base, cost: -1 }, /cost must be an integer/],
      ["a fractional cost", { ...base, cost: 1.5 }, /cost must be an integer/],
      ["an empty holder token", { ...base, holderToken: Buffer.alloc(0) }, /holderToken must be 1 to 64 bytes/],
      ["a 65-byte fingerprint", { permitId: base.permitId, tool: TOOL, idempotencyKey: base.idempotencyKey, fingerprint: Buffer.alloc(65) }, /fingerprint must be 1 to 64 bytes/],
      ["a zero dispatch timeout", { ...base, dispatchTimeoutMs: 0 }, /dispatchTimeoutMs must be/],
      ["zero tries", { ...base, retry: { maxTries: 0 } }, /retry.maxTries must be/],
      ["a zero retry budget", { ...base, retry: { maxTotalMs: 0 } }, /retry.maxTotalMs must be/],
    ];
    for (const [name, call, message] of cases) {
      await assert.rejects(client.guarded(call as never, dispatch), message, name);
    }
    await assert.rejects(client.guarded(base, "not a function" as never), /dispatch must be a function/);
    assert.equal(tool.calls.length, 0);
    assert.equal(await callsMade(permit.permitId), 0, "nothing was reserved");
  });

  test("a request the fingerprint cannot take is a TypeError naming where, before anything is asked or sent", async () => {
    const permit = await createPermit(client, [TOOL], { [TOOL]: 1 });
    const tool = new FakeTool();
    const requests: [unknown, string][] = [
      [{ ...CHARGE, account: 2 ** 53 }, "/account"],
      [{ ...CHARGE, amount: 1e21 }, "/amount"],
      [{ ...CHARGE, to: new Map([["iban", "x"]]) }, "/to"],
      [[CHARGE, , CHARGE], "/1"], // a hole
    ];
    for (const [request, path] of requests) {
      const error = await rejection(
        client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("unfit"), request }, async (id) => tool.hit(id)),
      );
      assert.ok(error instanceof TypeError && error instanceof FingerprintError, String(error));
      assert.equal(error.path, path);
    }
    assert.equal(tool.calls.length, 0);
    assert.equal(await callsMade(permit.permitId), 0, "nothing was reserved");
  });

  test("a request atmost finds malformed is INVALID_REQUEST with its field violations, not retried", async () => {
    const permit = await createPermit(client, [TOOL]);
    const retries: RetryEvent[] = [];
    const error = await rejection(
      client.guarded(
        { permitId: permit.permitId, tool: TOOL, idempotencyKey: "k".repeat(256), request: CHARGE, onRetry: (e) => retries.push(e) },
        async () => "never",
      ),
    );
    assert.ok(error instanceof InvalidRequest && !(error instanceof Denied), String(error));
    assert.equal(error.code, Code.INVALID_ARGUMENT);
    assert.equal(error.reason, "INVALID_REQUEST");
    assert.deepEqual(
      error.fieldViolations.map((v) => v.field),
      ["idempotency_key"],
    );
    assert.deepEqual(retries, []);
  });
});

describe("guarded call, with atmost going away or coming late", { timeout: 120_000 }, () => {
  test("Commit that cannot reach atmost raises CommitNotRecorded with the attempt id and the result", async () => {
    const atmost = await Atmost.start();
    const client = atmost.client();
    try {
      const permit = await createPermit(client, [TOOL]);
      const tool = new FakeTool();
      const retries: RetryEvent[] = [];
      const error = await rejection(
        client.guarded(
          {
            permitId: permit.permitId,
            tool: TOOL,
            idempotencyKey: key("gone"),
            request: CHARGE,
            retry: { maxTries: 3 },
            onRetry: (e) => retries.push(e),
          },
          async (attemptId) => {
            tool.hit(attemptId);
            await atmost.stop(); // the tool answered; atmost is gone
            return { tx: 7 };
          },
        ),
      );
      assert.ok(error instanceof CommitNotRecorded, String(error));
      assert.equal(error.attemptId, tool.calls[0]);
      assert.equal(error.outcome, "succeeded");
      assert.deepEqual(error.result, { tx: 7 });
      assert.ok(error.cause instanceof Unavailable, String(error.cause));
      assert.equal(error.code, Code.UNAVAILABLE);
      assert.deepEqual(
        retries.map((r) => [r.rpc, r.tryNumber]),
        [
          ["Commit", 1],
          ["Commit", 2],
        ],
        "Commit retried up to maxTries",
      );
      assert.equal(tool.calls.length, 1);
    } finally {
      client.close();
      await atmost.stop();
    }
  });

  test("retries on UNAVAILABLE: the address refuses the first try, accepts a moment later, and the call succeeds", async () => {
    const atmost = await Atmost.start();
    const setup = atmost.client();
    const permit = await createPermit(setup, [TOOL], { [TOOL]: 1 });
    setup.close();
    // Nothing listens on `port` until the first retry; then a loopback TCP
    // relay to the running atmost opens on it. To the client this is a
    // server that was not up yet.
    const port = await freePort();
    const relay = tcpRelay(atmost.address);
    const client = new Client({ address: `127.0.0.1:${port}` });
    try {
      const tool = new FakeTool();
      const retries: RetryEvent[] = [];
      const out = await client.guarded(
        {
          permitId: permit.permitId,
          tool: TOOL,
          idempotencyKey: key("late"),
          request: CHARGE,
          retry: { maxTries: 20, maxTotalMs: 30_000 },
          onRetry: (event) => {
            retries.push(event);
            if (retries.length === 1) relay.listen(port, "127.0.0.1");
          },
        },
        async (attemptId) => {
          tool.hit(attemptId);
          return "charged";
        },
      );
      assert.equal(out.result, "charged");
      assert.ok(retries.length >= 1);
      const first = retries[0];
      assert.equal(first.rpc, "Authorize");
      assert.ok(first.error instanceof Unavailable, String(first.error));
      assert.equal(first.error.reason, undefined, "a transport failure: atmost never answered");
      assert.ok(retries.every((r) => r.rpc === "Authorize" && r.error instanceof Unavailable));
      assert.equal(tool.calls.length, 1);
    } finally {
      client.close();
      relay.close();
      await atmost.stop();
    }
  });

  test("a DISPATCH redelivered after a lost answer to the call's own token is sent once, with only what atmost says is left of its lease", async () => {
    // The first Authorize answer is lost; the retry, with the same token,
    // gets the DISPATCH redelivered, a lost answer and a backoff after
    // atmost reserved. Given the whole lease less the margin from the
    // redelivery, 2000 ms of a 3 s lease, it would overrun the lease by
    // that long.
    const atmost = await Atmost.start();
    const setup = atmost.client();
    const permit = await createPermit(setup, [TOOL], {}, { lease: { seconds: 3, nanos: 0 } });
    setup.close();
    const relay = answerLosingRelay(atmost.address, 1);
    await new Promise<void>((r) => relay.server.listen(0, "127.0.0.1", r));
    const client = new Client({ address: `127.0.0.1:${(relay.server.address() as { port: number }).port}` });
    try {
      const tool = new FakeTool();
      const retries: RetryEvent[] = [];
      const error = await rejection(
        client.guarded(
          { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("redelivered"), request: CHARGE, onRetry: (e) => retries.push(e) },
          (attemptId, signal) => {
            tool.hit(attemptId);
            return new Promise<never>((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
          },
        ),
      );
      assert.equal(relay.lost(), true, "the first answer was lost");
      assert.deepEqual(
        retries.map((r) => r.rpc),
        ["Authorize"],
      );
      assert.ok(error instanceof OutcomeUncertain, String(error));
      const granted = /dispatch deadline of (-?\d+) ms passed/.exec(error.message);
      assert.ok(granted, error.message);
      assert.ok(Number(granted[1]) < 2000, `granted ${granted[1]} ms, the whole lease less the margin or more`);
      assert.equal(tool.calls.length, 1);
      const usage = (await client.getPermit(permit.permitId)).usage.find((u) => u.tool === TOOL)!;
      assert.equal(usage.callsMade, 1, "the redelivery reserved nothing more");
    } finally {
      client.close();
      relay.close();
      await atmost.stop();
    }
  });

  test("each Authorize and Commit try is given what is left of the retry budget, not the client's deadline", async () => {
    // The client's deadline (10 min) is far past the budget (30 s). The
    // first tries are refused (nothing listens yet), the relay opens at the
    // first retry, and the call goes through: every try, the late ones
    // included, got at most the budget left when it started.
    const atmost = await Atmost.start();
    const setup = atmost.client();
    const permit = await createPermit(setup, [TOOL], { [TOOL]: 1 });
    setup.close();
    const port = await freePort();
    const relay = tcpRelay(atmost.address);
    const client = new Client({ address: `127.0.0.1:${port}`, deadlineMs: 600_000 });
    // Spies on the real methods: the requests still go to atmost.
    const given: [string, number | undefined][] = [];
    const authorize = client.authorize.bind(client);
    const commit = client.commit.bind(client);
    client.authorize = (request, options) => {
      given.push(["Authorize", options?.deadlineMs]);
      return authorize(request, options);
    };
    client.commit = (request, options) => {
      given.push(["Commit", options?.deadlineMs]);
      return commit(request, options);
    };
    const maxTotalMs = 30_000;
    try {
      const tool = new FakeTool();
      let retries = 0;
      const out = await client.guarded(
        {
          permitId: permit.permitId,
          tool: TOOL,
          idempotencyKey: key("budget"),
          request: CHARGE,
          retry: { maxTries: 20, maxTotalMs },
          onRetry: () => {
            if (++retries === 1) relay.listen(port, "127.0.0.1");
          },
        },
        async (attemptId) => {
          tool.hit(attemptId);
          return "charged";
        },
      );
      assert.equal(out.result, "charged");
      assert.equal(tool.calls.length, 1);
      const tries = given.filter(([rpc]) => rpc === "Authorize").map(([, ms]) => ms);
      assert.ok(tries.length >= 2, `the first Authorize was refused and retried: ${JSON.stringify(given)}`);
      assert.deepEqual(
        given.map(([rpc]) => rpc),
        [...tries.map(() => "Authorize"), "Commit"],
      );
      for (const [rpc, ms] of given) {
        assert.ok(ms !== undefined && ms > 0 && ms <= maxTotalMs, `${rpc} was given ${ms} ms, not what is left of the ${maxTotalMs} ms budget`);
      }
      for (let i = 1; i < tries.length; i++) {
        assert.ok(tries[i]! < tries[i - 1]!, `try ${i + 1} was given ${tries[i]} ms, try ${i} ${tries[i - 1]} ms: the budget only shrinks`);
      }
    } finally {
      client.close();
      relay.close();
      await atmost.stop();
    }
  });

  test("an Authorize try on a stalled atmost ends with the retry budget, not the client's deadline", { timeout: 60_000 }, async () => {
    // atmost stopped (SIGSTOP): its socket accepts, nothing answers. Given
    // the budget left (1 s), the try ends DEADLINE_EXCEEDED, no wait fits
    // in the budget, and that is raised. Given the client's deadline
    // (10 min), it would hang: the hang guard then lets atmost go on, its
    // DISPATCH comes through, and the call's success fails the test.
    const atmost = await Atmost.start();
    const client = atmost.client({ deadlineMs: 600_000 });
    const hangGuard = setTimeout(() => atmost.process.kill("SIGCONT"), 30_000);
    try {
      const permit = await createPermit(client, [TOOL]);
      const tool = new FakeTool();
      await freeze(atmost.process);
      const error = await rejection(
        client.guarded(
          { permitId: permit.permitId, tool: TOOL, idempotencyKey: key("stalled"), request: CHARGE, retry: { maxTotalMs: 1_000 } },
          async (attemptId) => tool.hit(attemptId),
        ),
      );
      assert.ok(error instanceof Unavailable, String(error));
      assert.equal(error.code, Code.DEADLINE_EXCEEDED);
      assert.equal(error.reason, undefined, "the client's deadline, not atmost's answer");
      assert.equal(tool.calls.length, 0);
    } finally {
      clearTimeout(hangGuard);
      atmost.process.kill("SIGCONT");
      client.close();
      await atmost.stop();
    }
  });

  test("a retry observer that throws is ignored: the retry goes on", async () => {
    const atmost = await Atmost.start();
    const setup = atmost.client();
    const permit = await createPermit(setup, [TOOL], { [TOOL]: 1 });
    setup.close();
    const port = await freePort();
    const relay = tcpRelay(atmost.address);
    const client = new Client({ address: `127.0.0.1:${port}` });
    try {
      const tool = new FakeTool();
      let told = 0;
      const out = await client.guarded(
        {
          permitId: permit.permitId,
          tool: TOOL,
          idempotencyKey: key("observer"),
          request: CHARGE,
          retry: { maxTries: 20, maxTotalMs: 30_000 },
          onRetry: () => {
            if (++told === 1) relay.listen(port, "127.0.0.1");
            throw new Error("a broken logging hook");
          },
        },
        async (attemptId) => {
          tool.hit(attemptId);
          return "charged";
        },
      );
      assert.ok(told >= 1);
      assert.equal(out.result, "charged");
      assert.equal(tool.calls.length, 1);
    } finally {
      client.close();
      relay.close();
      await atmost.stop();
    }
  });

  test("retries on UNAVAILABLE reach an atmost started a moment later on the same port", async () => {
    // The memory store starts empty, so the permit is unknown to the new
    // process: its PERMIT_NOT_FOUND, after the refused first try, proves
    // the retry reached it.
    const port = await freePort();
    let started: Promise<Atmost> | undefined;
    const client = new Client({ address: `127.0.0.1:${port}` });
    try {
      const tool = new FakeTool();
      const retries: RetryEvent[] = [];
      const error = await rejection(
        client.guarded(
          {
            permitId: "01a22f97-50b2-7dfa-9a32-7b58c1d65b82",
            tool: TOOL,
            idempotencyKey: key("late-server"),
            request: CHARGE,
            retry: { maxTries: 20, maxTotalMs: 30_000 },
            onRetry: (event) => {
              retries.push(event);
              if (started === undefined) {
                started = Atmost.start([], `127.0.0.1:${port}`);
                started.catch(() => {}); // a failed start is raised by the await below
              }
            },
          },
          async (attemptId) => tool.hit(attemptId),
        ),
      );
      assert.ok(started, "the first try failed and was retried");
      assert.ok(error instanceof Denied, String(error));
      assert.equal(error.reason, "PERMIT_NOT_FOUND");
      assert.ok(retries.every((r) => r.rpc === "Authorize" && r.error instanceof Unavailable && r.error.reason === undefined));
      assert.equal(tool.calls.length, 0);
    } finally {
      client.close();
      await (await started)?.stop();
    }
  });
});

/** The error a promise rejects with (failing the test if it resolves). */
async function rejection(promise: Promise<unknown>): Promise<Error> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof Error, `rejected with a non-Error: ${String(error)}`);
    return error;
  }
  assert.fail("expected a rejection, got a result");
}

/**
 * A TCP relay to `address` that loses one answer: it reads atmost's side as
 * HTTP/2 frames (9 bytes of header: length 3, type 1, flags 1, stream id 4;
 * type 0 is DATA) and cuts the connection just before the first DATA frame
 * of the `lose`-th response (counted across connections), after atmost has
 * applied and answered the request. Not listening until told.
 */
function answerLosingRelay(address: string, lose: number): { server: Server; lost: () => boolean; close: () => void } {
  const [host, port] = [address.slice(0, address.lastIndexOf(":")), Number(address.slice(address.lastIndexOf(":") + 1))];
  const sockets = new Set<Socket>();
  let responses = 0;
  let lost = false;
  const server = createServer((downstream) => {
    const upstream = connect(port, host);
    const cut = () => {
      downstream.destroy();
      upstream.destroy();
    };
    for (const s of [downstream, upstream]) {
      sockets.add(s);
      s.on("close", () => {
        sockets.delete(s);
        cut();
      });
      s.on("error", cut);
    }
    downstream.pipe(upstream);
    const streams = new Set<number>();
    let buffer = Buffer.alloc(0);
    upstream.on("data", (chunk: Buffer) => {
      if (downstream.destroyed) return;
      buffer = Buffer.concat([buffer, chunk]);
      let whole = 0;
      while (buffer.length - whole >= 9) {
        const size = 9 + buffer.readUIntBE(whole, 3);
        if (buffer.length - whole < size) break;
        const stream = buffer.readUInt32BE(whole + 5) & 0x7fffffff;
        if (buffer[whole + 3] === 0 && stream !== 0 && !streams.has(stream)) {
          streams.add(stream);
          responses += 1;
          if (responses === lose) {
            lost = true;
            downstream.write(buffer.subarray(0, whole), cut);
            return;
          }
        }
        whole += size;
      }
      downstream.write(buffer.subarray(0, whole));
      buffer = buffer.subarray(whole);
    });
  });
  return {
    server,
    lost: () => lost,
    close: () => {
      for (const s of sockets) s.destroy();
      server.close();
    },
  };
}

/** A TCP server that forwards every connection to `address`; not listening until told. */
function tcpRelay(address: string): Server {
  const [host, port] = [address.slice(0, address.lastIndexOf(":")), Number(address.slice(address.lastIndexOf(":") + 1))];
  const sockets = new Set<Socket>();
  const server = createServer((downstream) => {
    const upstream = connect(port, host);
    for (const s of [downstream, upstream]) {
      sockets.add(s);
      s.on("close", () => sockets.delete(s));
      s.on("error", () => {
        downstream.destroy();
        upstream.destroy();
      });
    }
    downstream.pipe(upstream).pipe(downstream);
  });
  const close = server.close.bind(server);
  server.close = (callback?: (err?: Error) => void) => {
    for (const s of sockets) s.destroy();
    return close(callback);
  };
  return server;
}
