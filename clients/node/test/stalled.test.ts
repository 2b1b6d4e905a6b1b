/**
 * CANCELLED without atmost's ErrorInfo is retried as the same request.
 *
 * atmost's --request-timeout answers an RPC that takes too long with
 * CANCELLED "Timeout expired" and no ErrorInfo; what it had sent its store
 * may still run. docs/api.md: such an answer says nothing about whether the
 * request applied, retry with the same key. Here the store is a real Redis
 * stopped (SIGSTOP) under a real atmost whose request timeout is far below
 * its store timeout: the try is answered CANCELLED, Redis resumes at the
 * retry, and the first try's command runs before the retry's.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";

import { Client, OutcomeUncertain, Unavailable, type RetryEvent } from "../src/index.js";
import { Atmost, FakeTool, Redis, createPermit, key } from "./support.js";

const TOOL = "wallet.charge";
const CHARGE = { amount: 500, currency: "EUR", to: "acct_42" };

// A hang guard only: nothing asserts on time.
describe("a stalled store: CANCELLED is retried", { timeout: 120_000 }, () => {
  let redis: Redis;
  let atmost: Atmost;
  let client: Client;

  before(async () => {
    redis = await Redis.start();
    // A request timeout far below the store timeout: a stalled request is
    // answered CANCELLED, never STORE_UNAVAILABLE.
    atmost = await Atmost.start(["--store", "redis", "--redis-url", redis.url, "--request-timeout", "500ms", "--store-timeout", "30s"]);
    client = atmost.client();
    // The first call finds atmost's functions missing, and atmost loads
    // them and calls again; a first call stalled past the request timeout
    // would be dropped after that answer, not applied. Run the calls once
    // (Authorize, Commit, MarkUncertain), so a stalled command is the one
    // that runs when Redis resumes.
    const permit = await createPermit(client, [TOOL]);
    await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("warm"), request: 1 }, () => "ok");
    await assert.rejects(
      client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("warm"), request: 2 }, () => {
        throw new Error("reset after sending");
      }),
      OutcomeUncertain,
    );
  });
  after(async () => {
    client?.close();
    redis?.resume();
    await atmost?.stop();
    await redis?.stop();
  });

  /** The retries seen; the hook resumes Redis at the first. */
  const retrying = () => {
    const seen: RetryEvent[] = [];
    return {
      seen,
      onRetry: (event: RetryEvent) => {
        seen.push(event);
        redis.resume();
      },
    };
  };
  const isCancelled = (event: RetryEvent) => {
    assert.ok(event.error instanceof Unavailable, String(event.error));
    assert.equal(event.error.code, Code.CANCELLED);
    assert.equal(event.error.reason, undefined, "not atmost's word: no ErrorInfo");
  };
  const callsMade = async (permitId: string) => (await client.getPermit(permitId)).usage.find((u) => u.tool === TOOL)!.callsMade;

  test("a CANCELLED Authorize is retried with the same holder token: the first try's reservation comes back", async () => {
    const permit = await createPermit(client, [TOOL]);
    const tool = new FakeTool();
    const { seen, onRetry } = retrying();
    redis.pause(); // the first Authorize stalls
    let out;
    try {
      out = await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("authorize"), request: CHARGE, onRetry }, (attemptId) => {
        tool.hit(attemptId);
        return "charged";
      });
    } finally {
      redis.resume();
    }
    assert.deepEqual(
      seen.map((e) => e.rpc),
      ["Authorize"],
    );
    isCancelled(seen[0]);
    assert.equal(out.result, "charged");
    assert.deepEqual(tool.calls, [out.attempt.attemptId], "dispatched once");
    assert.equal(await callsMade(permit.permitId), 1, "one reservation: the retry got the first try's back");
  });

  test("a reservation the store made late gets what it says is left of its lease, not a lease counted from the first try", async () => {
    // The first Authorize stalls in Redis for atmost's 500 ms request
    // timeout; the store reserves when it resumes, at the retry, and the
    // retry gets that reservation redelivered. Counted from the first try,
    // a 1.49 s lease less the 1 s margin would leave nothing after the
    // stall, and the call would be given back unsent; what atmost says is
    // left, less the margin, is what the dispatch gets.
    const permit = await createPermit(client, [TOOL], {}, { lease: { seconds: 1, nanos: 490_000_000 } });
    const tool = new FakeTool();
    const { seen, onRetry } = retrying();
    redis.pause(); // the first Authorize stalls
    let error: unknown;
    try {
      await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("late"), request: CHARGE, onRetry }, (attemptId, signal) => {
        tool.hit(attemptId);
        return new Promise<never>((_, reject) => signal.addEventListener("abort", () => reject(signal.reason)));
      });
    } catch (e) {
      error = e;
    } finally {
      redis.resume();
    }
    assert.deepEqual(
      seen.map((e) => e.rpc),
      ["Authorize"],
    );
    assert.ok(error instanceof OutcomeUncertain, String(error));
    const granted = /dispatch deadline of (-?\d+) ms passed/.exec(error.message);
    assert.ok(granted, error.message);
    assert.ok(Number(granted[1]) > 0 && Number(granted[1]) <= 490, `granted ${granted[1]} ms of a 1.49 s lease`);
    assert.deepEqual(tool.calls, [error.attemptId], "dispatched once");
  });

  test("a CANCELLED Commit is retried as the same request and answered the same", async () => {
    const permit = await createPermit(client, [TOOL]);
    const tool = new FakeTool();
    const { seen, onRetry } = retrying();
    const k = key("commit");
    let out;
    try {
      out = await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE, onRetry }, (attemptId) => {
        tool.hit(attemptId);
        redis.pause(); // the tool answered; the Commit that follows stalls
        return { tx: 981 };
      });
    } finally {
      redis.resume();
    }
    assert.deepEqual(
      seen.map((e) => e.rpc),
      ["Commit"],
    );
    isCancelled(seen[0]);
    assert.equal(out.replayed, false);
    assert.equal(out.attempt.state, "ATTEMPT_STATE_SUCCEEDED");
    assert.deepEqual(tool.calls, [out.attempt.attemptId]);
    const replay = await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: k, request: CHARGE }, (attemptId) => tool.hit(attemptId));
    assert.equal(replay.replayed, true);
    assert.equal(replay.receipt.receiptId, out.receipt.receiptId);
    assert.equal(tool.calls.length, 1);
  });

  test("a CANCELLED MarkUncertain is retried: the attempt ends UNCERTAIN, not unrecorded", async () => {
    const permit = await createPermit(client, [TOOL]);
    const { seen, onRetry } = retrying();
    let error: unknown;
    try {
      await client.guarded({ permitId: permit.permitId, tool: TOOL, idempotencyKey: key("uncertain"), request: CHARGE, onRetry }, () => {
        redis.pause(); // the MarkUncertain that follows stalls
        throw new Error("reset after sending");
      });
    } catch (e) {
      error = e;
    } finally {
      redis.resume();
    }
    assert.deepEqual(
      seen.map((e) => e.rpc),
      ["MarkUncertain"],
    );
    isCancelled(seen[0]);
    assert.ok(error instanceof OutcomeUncertain, String(error));
    const [listed] = (await client.listUncertain({ permitId: permit.permitId })).attempts;
    assert.equal(listed.attemptId, error.attemptId);
    assert.equal(listed.uncertainReason, "dispatch threw Error: reset after sending");
  });
});
