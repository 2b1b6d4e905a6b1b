/**
 * The dispatch deadline of a fresh DISPATCH is counted from the start of
 * the Authorize try atmost answered: `leaseRemaining` is measured when
 * atmost decides, and the answer may take long to arrive. Here a relay
 * holds atmost's answer to the Authorize (every byte from its message on)
 * before the client sees it; counted from the answer's arrival, the
 * dispatch would run past the lease, when the attempt reads UNCERTAIN and
 * an operator may settle it NotSent and free the key.
 */
import assert from "node:assert/strict";
import { setTimeout as sleep } from "node:timers/promises";
import { describe, test } from "node:test";

import { Client, LEASE_MARGIN_MS, NotSent, OutcomeUncertain, type Timestamp } from "../src/index.js";
import { Atmost, FakeTool, createPermit, frameRelay, key } from "./support.js";

const TOOL = "wallet.charge";
const LEASE_MS = 3_000;

/** atmost, a permit with a 3 s lease, and a client whose first answer (the Authorize's) the relay holds `holdMs`. */
async function held(holdMs: number) {
  const atmost = await Atmost.start();
  const direct = atmost.client();
  const permit = await createPermit(direct, [TOOL], { [TOOL]: 1 }, { lease: { seconds: LEASE_MS / 1000, nanos: 0 } });
  let heldMs: number | undefined;
  const relay = await frameRelay(atmost.address, async (frame) => {
    if (frame.response === 1) {
      const from = performance.now();
      await sleep(holdMs);
      heldMs = performance.now() - from;
    }
    return frame.bytes;
  });
  const client = new Client({ address: relay.address });
  return {
    direct,
    permit,
    client,
    heldMs: () => heldMs,
    async stop() {
      client.close();
      direct.close();
      relay.close();
      await atmost.stop();
    },
  };
}

const millis = (t: Timestamp | null) => (t === null ? Number.NaN : t.seconds * 1000 + t.nanos / 1e6);

describe("the dispatch deadline counts from the Authorize try answered", { timeout: 60_000 }, () => {
  test("an answer held 1.5 s of a 3 s lease: dispatch gets what is left less the margin, and its signal fires before the lease ends", async () => {
    const setup = await held(1_500);
    try {
      const tool = new FakeTool();
      let ranMs: number | undefined;
      const error = await setup.client
        .guarded({ permitId: setup.permit.permitId, tool: TOOL, idempotencyKey: key("held"), request: { amount: 1 } }, (attemptId, signal) => {
          tool.hit(attemptId);
          const start = performance.now();
          return new Promise<never>((_, reject) =>
            signal.addEventListener("abort", () => {
              ranMs = performance.now() - start;
              reject(signal.reason);
            }),
          );
        })
        .then(
          () => assert.fail("a dispatch that never answers succeeded"),
          (e: unknown) => e,
        );
      const heldMs = setup.heldMs();
      assert.ok(heldMs !== undefined && heldMs > LEASE_MARGIN_MS, `the relay held the answer ${heldMs} ms, past the margin`);
      assert.ok(error instanceof OutcomeUncertain, String(error));
      assert.equal(tool.calls.length, 1);
      // Given what was left, the lease less the margin less the hold (under
      // 500 ms), not the 2000 ms counted from the answer's arrival: the bound
      // is halfway between, so a late timer on a busy machine cannot fail it.
      const left = LEASE_MS - LEASE_MARGIN_MS - heldMs;
      assert.ok(ranMs !== undefined && ranMs < left + heldMs / 2, `dispatch ran ${ranMs} ms after the answer was held ${heldMs} ms (${left} ms were left)`);
      // On atmost's clock: the MarkUncertain that followed the signal came
      // before the lease's end (past it, uncertain_since is the lease's end).
      const attempt = error.attempt!;
      assert.equal(attempt.state, "ATTEMPT_STATE_UNCERTAIN");
      assert.match(attempt.uncertainReason, /^dispatch deadline of \d+ ms passed$/);
      assert.ok(
        millis(attempt.uncertainSince) < millis(attempt.leaseExpiresAt),
        `marked uncertain at ${JSON.stringify(attempt.uncertainSince)}, the lease ended at ${JSON.stringify(attempt.leaseExpiresAt)}`,
      );
    } finally {
      await setup.stop();
    }
  });

  test("an answer held 2.2 s of a 3 s lease leaves less than the margin: nothing is sent, the slot is given back", async () => {
    const setup = await held(2_200);
    try {
      const tool = new FakeTool();
      const error = await setup.client
        .guarded({ permitId: setup.permit.permitId, tool: TOOL, idempotencyKey: key("too-late"), request: { amount: 1 } }, (attemptId) => {
          tool.hit(attemptId);
          return "sent";
        })
        .then(
          () => assert.fail("dispatched with less than the margin left"),
          (e: unknown) => e,
        );
      assert.ok((setup.heldMs() ?? 0) > LEASE_MS - LEASE_MARGIN_MS, `the relay held the answer ${setup.heldMs()} ms, past the lease less the margin`);
      assert.ok(error instanceof NotSent, String(error));
      assert.equal(error.attempt?.state, "ATTEMPT_STATE_RELEASED");
      assert.deepEqual(tool.calls, [], "dispatch was not called");
      const usage = (await setup.direct.getPermit(setup.permit.permitId)).usage.find((u) => u.tool === TOOL);
      assert.equal(usage?.callsMade ?? 0, 0, "the slot came back");
    } finally {
      await setup.stop();
    }
  });
});
