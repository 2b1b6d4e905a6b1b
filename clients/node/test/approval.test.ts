/**
 * Human approval through a live atmost with keys (an agent, two approvers
 * and an admin of one tenant; the memory store): a call the permit's
 * approval rule holds throws AwaitingApproval without a wait; waited for,
 * it dispatches once when an approver approves, or throws ApprovalDenied
 * when one denies, never sending. The fake tool counts the side effects
 * that reached it.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { status as Code } from "@grpc/grpc-js";

import {
  ApprovalDenied,
  AwaitingApproval,
  Client,
  Denied,
  approvalRule,
  type GuardedCall,
  type RetryEvent,
} from "../src/index.js";
import { Atmost, FakeTool, createPermit, key, keyFile } from "./support.js";

const TOOL = "payout";
const KEYS = {
  agent: "node-approval-agent-key",
  alice: "node-approval-alice-key",
  bob: "node-approval-bob-key",
  admin: "node-approval-admin-key",
};
const keys = () =>
  keyFile([
    { id: "agent-1", key: KEYS.agent, roles: ["agent"] },
    { id: "alice", key: KEYS.alice, roles: ["approver"] },
    { id: "bob", key: KEYS.bob, roles: ["approver"] },
    { id: "admin-1", key: KEYS.admin, roles: ["admin"] },
  ]);

/** What a promise rejects with (a failure if it resolves). */
async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    (value) => assert.fail(`resolved where it should reject: ${JSON.stringify(value)}`),
    (error: unknown) => error,
  );
}

/** A dispatch that may never run. */
const never = async (attemptId: string) => assert.fail(`dispatch called (${attemptId}) where nothing may be sent`);

describe("human approval", { timeout: 120_000 }, () => {
  let atmost: Atmost;
  let agent: Client, alice: Client, bob: Client, admin: Client;
  const clients: Client[] = [];

  before(async () => {
    atmost = await Atmost.start(["--auth-keys", keys()]);
    const as = (apiKey: string) => {
      const client = atmost.client({ apiKey });
      clients.push(client);
      return client;
    };
    [agent, alice, bob, admin] = [as(KEYS.agent), as(KEYS.alice), as(KEYS.bob), as(KEYS.admin)];
  });
  after(async () => {
    for (const c of clients) c.close();
    await atmost?.stop();
  });

  /** "payout" needs an approval from a cost of 1000, for 10 minutes; "refund" none. */
  const newPermit = async (more: Parameters<typeof createPermit>[3] = {}) =>
    (
      await createPermit(admin, [TOOL, "refund"], {}, {
        budget: 1_000_000,
        approvalPerTool: { [TOOL]: approvalRule({ costAtLeast: 1000, waitMs: 600_000 }) },
        ...more,
      })
    ).permitId;

  const payout = (permitId: string, idempotencyKey: string, more: Partial<GuardedCall> = {}): GuardedCall => ({
    permitId,
    tool: TOOL,
    idempotencyKey,
    request: { amount: 40_000, key: idempotencyKey },
    cost: 40_000,
    approvalSummary: `pay 40000 EUR (${idempotencyKey})`,
    ...more,
  });

  const paid = (tool: FakeTool) => async (attemptId: string) => {
    tool.hit(attemptId);
    return { paid: true };
  };

  test("without a wait the call throws AwaitingApproval and sends nothing", async () => {
    const permitId = await newPermit();
    const permit = (await admin.getPermit(permitId)).permit!;
    assert.equal(permit.approvalPerTool[TOOL].costAtLeast, 1000);
    assert.equal(permit.approvalPerTool[TOOL].wait?.seconds, 600);
    const k = key("payout");
    const error = await rejection(agent.guarded(payout(permitId, k), never));
    assert.ok(error instanceof AwaitingApproval, String(error));
    assert.ok(error.attemptId);
    assert.equal(error.attempt.state, "ATTEMPT_STATE_AWAITING_APPROVAL");
    assert.ok(error.expiresAt && error.expiresAt.getTime() > Date.now() && error.expiresAt.getTime() <= Date.now() + 601_000, String(error.expiresAt));
    // The approvers see it, with the summary and the attempt id they need.
    const listed = await alice.listApprovals({ permitId });
    assert.deepEqual(
      listed.attempts.map((a) => [a.idempotencyKey, a.attemptId, a.approval?.summary, a.approval?.approversNeeded]),
      [[k, error.attemptId, `pay 40000 EUR (${k})`, 1]],
    );
    assert.equal(listed.nextPageToken, "");
    assert.ok((await alice.listApprovals()).attempts.some((a) => a.attemptId === error.attemptId), "across the tenant too");
    // Asked again without a wait: the same attempt, still awaiting.
    const again = await rejection(agent.guarded(payout(permitId, k), never));
    assert.ok(again instanceof AwaitingApproval && again.attemptId === error.attemptId);
    // Under the rule's threshold: no approval needed.
    const tool = new FakeTool();
    const small = await agent.guarded({ permitId, tool: TOOL, idempotencyKey: key("small"), request: { amount: 5 }, cost: 5 }, paid(tool));
    assert.deepEqual(small.result, { paid: true });
    assert.equal(tool.calls.length, 1);
  });

  test("an approval while the call waits dispatches it once", async () => {
    const permitId = await newPermit();
    const tool = new FakeTool();
    const k = key("payout");
    const pending = await rejection(agent.guarded(payout(permitId, k), paid(tool)));
    assert.ok(pending instanceof AwaitingApproval, String(pending));
    const approved = sleep(300).then(() => alice.approve({ permitId, idempotencyKey: k, attemptId: pending.attemptId }));
    const started = performance.now();
    const done = await agent.guarded(payout(permitId, k, { approvalWaitMs: 30_000 }), paid(tool));
    const took = performance.now() - started;
    const answer = await approved;
    assert.equal(answer.attempt?.state, "ATTEMPT_STATE_APPROVED");
    assert.equal(answer.attempt?.approval?.decidedBy, "alice");
    assert.equal(done.replayed, false);
    assert.deepEqual(done.result, { paid: true });
    assert.equal(done.attempt.attemptId, pending.attemptId);
    assert.equal(done.attempt.state, "ATTEMPT_STATE_SUCCEEDED");
    assert.deepEqual(done.attempt.approval?.approvedBy, ["alice"]);
    assert.deepEqual(tool.calls, [pending.attemptId], "dispatched exactly once");
    assert.ok(took < 10_000, `the held Authorize answered at the decision, not at the wait's end (${took} ms)`);
    // The same call again: a replay of the receipt, nothing sent.
    const again = await agent.guarded(payout(permitId, k, { approvalWaitMs: 30_000 }), never);
    assert.equal(again.replayed, true);
    assert.deepEqual(JSON.parse(again.result.toString("utf8")), { paid: true });
    assert.deepEqual((await alice.listApprovals({ permitId })).attempts, []);
  });

  test("a denial while the call waits throws ApprovalDenied and never sends", async () => {
    const permitId = await newPermit();
    const k = key("payout");
    const pending = await rejection(agent.guarded(payout(permitId, k), never));
    assert.ok(pending instanceof AwaitingApproval, String(pending));
    const denied = sleep(300).then(() => bob.deny({ permitId, idempotencyKey: k, attemptId: pending.attemptId, reason: "not today" }));
    const error = await rejection(agent.guarded(payout(permitId, k, { approvalWaitMs: 30_000 }), never));
    assert.equal((await denied).attempt?.state, "ATTEMPT_STATE_DENIED");
    assert.ok(error instanceof ApprovalDenied, String(error));
    assert.deepEqual([error.denialReason, error.decidedBy, error.replayed], ["not today", "bob", false]);
    assert.equal(error.attemptId, pending.attemptId);
    assert.equal(error.reason, undefined, "no ErrorInfo: atmost answered a REPLAY, not an error");
    // The key replays the denial from now on, waited for or not.
    for (const approvalWaitMs of [0, 30_000]) {
      const replayed = await rejection(agent.guarded(payout(permitId, k, { approvalWaitMs }), never));
      assert.ok(replayed instanceof ApprovalDenied, String(replayed));
      assert.deepEqual([replayed.denialReason, replayed.replayed], ["not today", true]);
    }
    // The slot and the cost came back.
    const usage = (await admin.getPermit(permitId)).usage.find((u) => u.tool === TOOL);
    assert.equal(usage?.callsMade, 0);
  });

  test("a wait that runs out throws AwaitingApproval", async () => {
    const permitId = await newPermit();
    const started = performance.now();
    const error = await rejection(agent.guarded(payout(permitId, key("payout"), { approvalWaitMs: 1_500 }), never));
    const took = performance.now() - started;
    assert.ok(error instanceof AwaitingApproval, String(error));
    assert.ok(took >= 1_400 && took < 6_000, `${took} ms`);
  });

  test("an approval late in a long hold still leaves the lease to send", async () => {
    // The claim's leaseRemaining was measured at the claim, up to the whole
    // hold after the ask was sent: counted from the ask's start it could be
    // all gone. The call asks once more (the same token: the same DISPATCH,
    // redelivered to it) and counts the lease from there.
    const permitId = await newPermit({ lease: { seconds: 3 } });
    const tool = new FakeTool();
    const k = key("late");
    const pending = await rejection(agent.guarded(payout(permitId, k), never));
    assert.ok(pending instanceof AwaitingApproval, String(pending));
    const approved = sleep(4_000).then(() => alice.approve({ permitId, idempotencyKey: k, attemptId: pending.attemptId }));
    const done = await agent.guarded(payout(permitId, k, { approvalWaitMs: 30_000 }), paid(tool));
    await approved;
    assert.equal(done.replayed, false);
    assert.deepEqual(tool.calls, [pending.attemptId]);
  });

  test("nobody approves their own call, agents never approve; a plain Authorize may hold", async () => {
    const permitId = await newPermit();
    const k = key("admins-own");
    const request = { permitId, tool: TOOL, idempotencyKey: k, requestFingerprint: Buffer.alloc(32, 1), cost: 5000, approvalSummary: "mine" };
    const mine = await admin.authorize(request);
    assert.equal(mine.decision, "DECISION_AWAIT_APPROVAL");
    assert.ok(mine.approvalRemaining && mine.approvalRemaining.seconds > 500);
    const own = await rejection(admin.approve({ permitId, idempotencyKey: k, attemptId: mine.attempt!.attemptId }));
    assert.ok(own instanceof Denied, String(own));
    assert.equal(own.reason, "APPROVER_IS_REQUESTER");
    assert.equal(own.code, Code.PERMISSION_DENIED);
    const role = await rejection(agent.approve({ permitId, idempotencyKey: k, attemptId: mine.attempt!.attemptId }));
    assert.ok(role instanceof Denied && role.reason === "ROLE_NOT_ALLOWED", String(role));
    // A wait on the plain RPC: held to its end, still awaiting.
    const started = performance.now();
    const held = await admin.authorize({ ...request, wait: { seconds: 1 } });
    assert.equal(held.decision, "DECISION_AWAIT_APPROVAL");
    const took = performance.now() - started;
    assert.ok(took >= 900 && took < 5_000, `${took} ms`);
    const denied = await admin.deny({ permitId, idempotencyKey: k, attemptId: mine.attempt!.attemptId });
    assert.equal(denied.attempt?.approval?.denialReason, "denied");
  });

  test("the options are checked before anything is sent", async () => {
    const call = payout("p", "k");
    await assert.rejects(agent.guarded({ ...call, approvalSummary: "x".repeat(1025) }, never), RangeError);
    for (const approvalWaitMs of [-1, Number.NaN, Number.POSITIVE_INFINITY]) {
      await assert.rejects(agent.guarded({ ...call, approvalWaitMs }, never), RangeError);
    }
    assert.throws(() => approvalRule({ waitMs: 0 }), RangeError);
    assert.deepEqual(approvalRule({ waitMs: 300_000, approvers: 2 }), { approvers: 2, wait: { seconds: 300, nanos: 0 } });
  });
});

describe("a hold atmost's request timeout cuts", { timeout: 60_000 }, () => {
  let atmost: Atmost;
  const clients: Client[] = [];
  before(async () => {
    atmost = await Atmost.start(["--auth-keys", keys(), "--request-timeout", "3s"]);
  });
  after(async () => {
    for (const c of clients) c.close();
    await atmost?.stop();
  });

  test("is asked again, holding less, not retried as a failure", async () => {
    const as = (apiKey: string) => {
      const client = atmost.client({ apiKey });
      clients.push(client);
      return client;
    };
    const [agent, alice, admin] = [as(KEYS.agent), as(KEYS.alice), as(KEYS.admin)];
    const { permitId } = await createPermit(admin, [TOOL], {}, { approvalPerTool: { [TOOL]: approvalRule({ waitMs: 600_000 }) } });
    const tool = new FakeTool();
    const retries: RetryEvent[] = [];
    const k = key("cut");
    const call: GuardedCall = { permitId, tool: TOOL, idempotencyKey: k, request: { k }, onRetry: (e) => retries.push(e) };
    const pending = await rejection(agent.guarded(call, never));
    assert.ok(pending instanceof AwaitingApproval, String(pending));
    const approved = sleep(7_000).then(() => alice.approve({ permitId, idempotencyKey: k, attemptId: pending.attemptId }));
    const done = await agent.guarded({ ...call, approvalWaitMs: 20_000 }, async (id) => {
      tool.hit(id);
      return "sent";
    });
    await approved;
    assert.equal(done.result, "sent");
    assert.deepEqual(tool.calls, [pending.attemptId]);
    assert.deepEqual(retries, [], "a hold cut at the server's request timeout is no failure to back off from");
  });
});
