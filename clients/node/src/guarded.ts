/**
 * The guarded call: one side-effecting tool call wrapped with atmost, the
 * same contract as the Rust and Python helpers.
 *
 *  1. One holder token (16 random bytes unless given) for every Authorize
 *     try of this call, so a DISPATCH whose answer was lost is redelivered
 *     to it (docs/api.md, "Recovering a lost DISPATCH"). Redelivered to a
 *     token the caller gave, it is not dispatched: an earlier run may have
 *     sent it ({@link HeldByEarlierRun}).
 *  2. Authorize, retried only where that is safe (retry.ts), always with the
 *     same key, fingerprint, cost and token.
 *  3. REPLAY: dispatch is never called; the stored outcome is returned or
 *     raised.
 *  3a. AWAIT_APPROVAL (the permit's approval rule holds the call): asked
 *     again within `approvalWaitMs`, atmost holding each ask open for up
 *     to 55 s; then a DISPATCH goes on as below, a REPLAY of the DENIED
 *     attempt raises {@link ApprovalDenied}, and a call still undecided
 *     {@link AwaitingApproval}. Nothing is sent before the approval.
 *  4. DISPATCH: `dispatch(attemptId, signal)` runs under a deadline (what
 *     atmost says is left of the lease, less a margin, counted from the
 *     start of the Authorize try it answered), then exactly one of Commit
 *     Succeeded / Failed / NotSent or MarkUncertain records what happened;
 *     whatever keeps it from being recorded is CommitNotRecorded, carrying
 *     the result. Nothing is ever sent twice in one call.
 */
import { createHash, randomBytes } from "node:crypto";
import { status as Code } from "@grpc/grpc-js";

import {
  ApprovalDenied,
  AtmostError,
  AwaitingApproval,
  CommitNotRecorded,
  HeldByEarlierRun,
  NotSent,
  OutcomeUncertain,
  ToolFailed,
  describeThrown,
  text,
  type RecordedOutcome,
} from "./errors.js";
import { fingerprint as fingerprintOf } from "./fingerprint.js";
import { isAuthorizeRetryable, isTransient, retryPolicy, withRetries, type RetryEvent, type RetryPolicy } from "./retry.js";
import type { Attempt, AuthorizeResponse, Duration, Receipt, Timestamp } from "./types.js";
import type { CallOptions, Client } from "./client.js";

/** One logical call. Keep `idempotencyKey` (and `holderToken`, if you persist one) the same across your own retries of it. */
export interface GuardedCall {
  permitId: string;
  tool: string;
  /** Stable for one logical call across every retry of it; a new key is a new call. */
  idempotencyKey: string;
  /** The request: any JSON value, fingerprinted with {@link fingerprint}. Give this or `fingerprint`. */
  request?: unknown;
  /** An explicit request fingerprint, 1..=64 bytes, instead of `request`. */
  fingerprint?: Uint8Array;
  /** Minor units to reserve (default 0). */
  cost?: number;
  /**
   * 1..=64 bytes proving this caller holds the call; default 16 random bytes
   * per guarded call. Give your own, kept with the call (in your journal),
   * only to recover the attempt after a restart and settle it: a DISPATCH
   * redelivered to it raises {@link HeldByEarlierRun}, never a second send.
   */
  holderToken?: Uint8Array;
  /**
   * The dispatch's deadline in milliseconds from when the DISPATCH arrived,
   * never past the default: what atmost said is left of the attempt's lease,
   * minus a 1 s margin, counted from the start of the Authorize try it
   * answered.
   */
  dispatchTimeoutMs?: number;
  /** How long Authorize, Commit and MarkUncertain are each retried (default 5 tries, 10 s). */
  retry?: RetryPolicy;
  /** Told before each retry's wait (logging, metrics); what it throws is ignored. */
  onRetry?: (event: RetryEvent) => void;
  /**
   * For a call the permit's approval rule holds: a short description shown
   * to the approvers (at most 1024 bytes of UTF-8). It is the caller's
   * claim; the request's fingerprint is what the approval binds to.
   */
  approvalSummary?: string;
  /**
   * How long the call may wait for a person's decision, in milliseconds
   * (default 0: not at all). atmost holds each Authorize open for up to
   * 55 s of it (AuthorizeRequest.wait), so ten minutes is ten calls, not a
   * poll loop. Approved in time: dispatched as usual. Denied (or lapsed):
   * {@link ApprovalDenied}. Still waiting at the end:
   * {@link AwaitingApproval}; nothing was sent, and the same call (same key
   * and request) made again picks up where it left off.
   */
  approvalWaitMs?: number;
}

/**
 * The caller's side effect. `attemptId` is the attempt's id: forward it to
 * the tool as the tool's own idempotency key. `signal` aborts at the
 * dispatch deadline. Return the tool's result (bytes as they are, anything
 * else is stored as its JSON), or `withActualCost(result, cost)` when the
 * call cost less than reserved; throw {@link ToolFailed} when the tool
 * answered and refused, {@link NotSent} only when nothing reached the tool.
 * A ToolFailed or NotSent that a guarded call made inside `dispatch` raised
 * (it names that call's attempt) is not this call's report: like any other
 * error, it marks this attempt UNCERTAIN.
 */
export type Dispatch<T> = (attemptId: string, signal: AbortSignal) => Promise<T | WithActualCost<T>> | T | WithActualCost<T>;

/**
 * A dispatch's result with the cost the call really had, to Commit instead
 * of the reserved one (atmost takes at most that): what {@link withActualCost}
 * makes. The outcome's `result` is `result`, its receipt's `cost` the
 * actual cost.
 */
export class WithActualCost<T> {
  constructor(
    readonly result: T,
    /** An integer from 0 to 2^63-1 (a number or a BigInt); anything else is CommitNotRecorded, nothing recorded. */
    readonly actualCost: number | bigint,
  ) {}
}

/** What a dispatch returns to commit `result` with the `actualCost` the call had instead of the reserved cost. */
export function withActualCost<T>(result: T, actualCost: number | bigint): WithActualCost<T> {
  return new WithActualCost(result, actualCost);
}

/** This call dispatched and the tool succeeded: `result` is what dispatch returned (unwrapped from {@link WithActualCost}). */
export interface FreshOutcome<T> {
  replayed: false;
  result: T;
  attempt: Attempt;
  receipt: Receipt;
}

/**
 * The key had already succeeded: nothing was sent now, and `result` is the
 * stored bytes (a JSON result's UTF-8 text; `sha256:<hex>` for one over
 * 64 KiB).
 */
export interface ReplayedOutcome {
  replayed: true;
  result: Buffer;
  attempt: Attempt;
  receipt: Receipt;
}

export type GuardedOutcome<T> = FreshOutcome<T> | ReplayedOutcome;

/** The largest result atmost stores; a larger one is stored as `sha256:<hex>`. */
export const MAX_RESULT_BYTES = 64 * 1024;
/** Subtracted from the lease when no dispatch timeout is given. */
export const LEASE_MARGIN_MS = 1_000;
/** atmost's limit on Failed and MarkUncertain reasons. */
const MAX_REASON_BYTES = 1024;
/** atmost's limit on an approval summary. */
const MAX_SUMMARY_BYTES = 1024;
/**
 * The longest atmost is asked to hold one Authorize open for an approval's
 * decision (it takes at most 60 s): a longer `approvalWaitMs` is several
 * calls, one after the other.
 */
export const MAX_APPROVAL_HOLD_MS = 55_000;
/**
 * A held Authorize that atmost's own `--request-timeout` cut off (CANCELLED
 * without ErrorInfo) after at least this long is taken as "still waiting",
 * and the following asks hold for what it lasted, less the margin.
 */
const MIN_CUT_MS = 2_000;
const CUT_MARGIN_MS = 1_000;
const MAX_COST = Number.MAX_SAFE_INTEGER;
/** The largest actual cost Commit carries (an int64). */
const MAX_ACTUAL_COST = 2n ** 63n - 1n;

export async function runGuarded<T>(client: Client, call: GuardedCall, dispatch: Dispatch<T>): Promise<GuardedOutcome<T>> {
  const input = checkCall(call);
  if (typeof dispatch !== "function") throw new TypeError("dispatch must be a function (attemptId, signal) => result");
  const retry = retryPolicy(call.retry, "retry");
  const { permitId, idempotencyKey } = input;
  // Each try's deadline: what is left of the retry budget, or the client's
  // own deadline when sooner, as the Rust and Python clients do. With the
  // client's whole deadline, one try hanging on a stalled atmost would
  // outlast the budget by up to that long.
  const within = (leftMs: number): CallOptions => ({ deadlineMs: Math.min(client.deadlineMs, leftMs) });
  // A held ask (an Authorize with a wait) gets the wait on top of both.
  const heldWithin = (leftMs: number, waitMs: number): CallOptions => ({ deadlineMs: Math.min(client.deadlineMs + waitMs, leftMs) });

  // Before the first try: any reservation a try of this call made is younger.
  const firstTry = performance.now();
  // Before the try that was answered: atmost decided on it (and measured
  // its leaseRemaining) after this instant, so a deadline counted from here
  // ends no later than the lease, however long the answer took to arrive.
  let answeredTry = firstTry;
  // One ask: the same request every time, held open for `waitMs` when > 0.
  const ask = (leftMs: number, waitMs = 0): Promise<AuthorizeResponse> => {
    answeredTry = performance.now();
    return client.authorize(
      {
        permitId,
        tool: input.tool,
        idempotencyKey,
        requestFingerprint: input.fingerprint,
        cost: input.cost,
        holderToken: input.holderToken,
        approvalSummary: input.approvalSummary,
        wait: waitMs > 0 ? durationOf(waitMs) : null,
      },
      waitMs > 0 ? heldWithin(leftMs, waitMs) : within(leftMs),
    );
  };
  let answer = await withRetries("Authorize", retry, isAuthorizeRetryable, call.onRetry, (leftMs) => ask(leftMs));
  let redelivered = answer.redelivered;
  const waited = answer.decision === "DECISION_AWAIT_APPROVAL";
  if (waited) ({ answer, redelivered } = await awaitDecision(answer, ask, input.approvalWaitMs, retry, call.onRetry));
  // The caller's dispatch timeout counts from here: the local clock only.
  const arrived = performance.now();
  const attempt = answer.attempt;
  if (attempt === null || attempt.attemptId === "") {
    throw new AtmostError(`Authorize answered ${answer.decision} without an attempt`);
  }
  if (answer.decision === "DECISION_AWAIT_APPROVAL") throw new AwaitingApproval(attempt);
  // A denial this call waited for is news, not a replay.
  if (answer.decision === "DECISION_REPLAY" && attempt.state === "ATTEMPT_STATE_DENIED") throw new ApprovalDenied(attempt, !waited);
  if (answer.decision === "DECISION_REPLAY") return replay(attempt);
  if (answer.decision !== "DECISION_DISPATCH") {
    throw new AtmostError(`Authorize answered an unknown decision ${String(answer.decision)}; nothing was sent`);
  }

  const attemptId = attempt.attemptId;
  const leaseRemainingMs = answer.leaseRemaining === null ? undefined : Math.max(durationMs(answer.leaseRemaining), 0);
  // A redelivery to this call's own random token repeats a reservation one
  // of its earlier tries made, whose answer was lost: nothing was sent. To a
  // token the caller gave, it may repeat an earlier run's, which may have.
  if (redelivered && !input.tokenIsOurs) throw new HeldByEarlierRun(attempt, leaseRemainingMs);
  // Every failure to record, whatever it is (an RPC error through every
  // try, a client closed under the call, which grpc-js throws for), is
  // CommitNotRecorded, carrying what the dispatch gave.
  const record = async <R>(
    rpc: string,
    outcome: RecordedOutcome,
    send: (options: CallOptions) => Promise<R>,
    result?: unknown,
    outcomeReason?: string,
  ): Promise<R> => {
    try {
      return await withRetries(rpc, retry, isTransient, call.onRetry, (leftMs) => send(within(leftMs)));
    } catch (error) {
      throw new CommitNotRecorded(attemptId, outcome, error, result, outcomeReason);
    }
  };
  const commitNotSent = () =>
    record("Commit", "not_sent", (options) => client.commit({ permitId, idempotencyKey, attemptId, notSent: {} }, options));

  // The lease is counted from the start of the Authorize try atmost
  // answered, the dispatch timeout from the DISPATCH's arrival.
  const leaseFrom = leaseRemainingMs === undefined ? firstTry : answeredTry;
  const byLeaseMs = (leaseRemainingMs ?? leaseMs(attempt)) - LEASE_MARGIN_MS;
  const grantedMs = dispatchTimeMs(leaseRemainingMs, leaseMs(attempt), arrived - leaseFrom, input.dispatchTimeoutMs);
  // What the deadline is, in the terms it was set in: the caller's timeout
  // (from the DISPATCH) when it is the sooner, else the lease less the
  // margin (from the Authorize try).
  const deadline = `${Math.round(input.dispatchTimeoutMs !== undefined && input.dispatchTimeoutMs <= grantedMs ? input.dispatchTimeoutMs : byLeaseMs)} ms`;
  const leftMs = grantedMs - (performance.now() - arrived);
  if (!(leftMs > 0)) {
    // Sending now could land after the lease, when an operator may already
    // have reconciled the attempt: give the slot back instead.
    const released = await commitNotSent();
    throw new NotSent(
      `the lease leaves no time to dispatch (${deadline} after its ${LEASE_MARGIN_MS} ms margin, from the Authorize try; ${Math.round(arrived - leaseFrom)} ms of it had passed when the DISPATCH arrived); nothing was sent`,
      { attemptId, attempt: released.attempt ?? undefined },
    );
  }

  const ran = await runDispatch(dispatch, attemptId, leftMs);

  if (ran.ok) {
    let result = ran.value as T;
    try {
      let actualCost: number | string | undefined;
      if (isA(ran.value, WithActualCost)) {
        result = ran.value.result as T;
        // Not an integer atmost takes: nothing is recorded, and the attempt
        // turns UNCERTAIN at its lease.
        actualCost = checkActualCost(ran.value.actualCost);
      }
      const stored = encodeResult(result);
      const done = await record(
        "Commit",
        "succeeded",
        (options) => client.commit({ permitId, idempotencyKey, attemptId, succeeded: { result: stored, actualCost } }, options),
        result,
      );
      const receipt = done.attempt?.receipt;
      if (!done.attempt || done.attempt.state !== "ATTEMPT_STATE_SUCCEEDED" || !receipt) {
        // A broken answer: what atmost recorded is unknown here.
        throw new AtmostError(
          `Commit of attempt ${attemptId} answered ${done.attempt ? `${done.attempt.state}${receipt ? "" : " without a receipt"}` : "without the attempt"}, not SUCCEEDED with a receipt`,
          { attemptId },
        );
      }
      return { replayed: false, result, attempt: done.attempt, receipt };
    } catch (error) {
      // Whatever kept the success from being recorded, the result is not lost.
      throw error instanceof CommitNotRecorded ? error : new CommitNotRecorded(attemptId, "succeeded", error, result);
    }
  }

  const error = ran.error;
  // The dispatch's own report, read once. One that cannot be read (a getter
  // or a Proxy's trap that throws) reports nothing: uncertain, as any error.
  let own: { failed: string } | { notSent: string } | undefined;
  try {
    if (error instanceof ToolFailed && ours(error, attemptId)) own = { failed: clip(text(error.failureReason)) };
    else if (error instanceof NotSent && ours(error, attemptId)) own = { notSent: text(error.details) };
  } catch {
    own = undefined;
  }
  if (own !== undefined && "failed" in own) {
    const reason = own.failed;
    const done = await record(
      "Commit",
      "failed",
      (options) => client.commit({ permitId, idempotencyKey, attemptId, failed: { reason } }, options),
      undefined,
      reason,
    );
    throw new ToolFailed(reason, { attemptId, attempt: done.attempt ?? undefined, cause: error });
  }
  if (own !== undefined && "notSent" in own) {
    const done = await commitNotSent();
    throw new NotSent(own.notSent, { attemptId, attempt: done.attempt ?? undefined, cause: error });
  }
  return uncertain(error, ran.timedOut ? `dispatch deadline of ${deadline} passed` : `dispatch threw ${describeThrown(error)}`);

  async function uncertain(cause: unknown, why: string): Promise<never> {
    const reason = clip(why);
    const done = await record(
      "MarkUncertain",
      "uncertain",
      (options) => client.markUncertain({ permitId, idempotencyKey, attemptId, reason }, options),
      undefined,
      reason,
    );
    throw new OutcomeUncertain(`attempt ${attemptId} is UNCERTAIN (${reason}): it may have taken effect; it is not sent again`, {
      attemptId,
      attempt: done.attempt ?? undefined,
      cause,
    });
  }
}

/**
 * While the call awaits approval, asks again (the same request and holder
 * token) with a wait of at most 55 s each, atmost holding the call open
 * until the decision, within `approvalWaitMs`: the first answer that is not
 * AWAIT_APPROVAL, or the last one; and whether its DISPATCH, if it is one,
 * was a redelivery. Each ask's deadline and retry budget are longer by its
 * wait.
 */
async function awaitDecision(
  first: AuthorizeResponse,
  ask: (leftMs: number, waitMs?: number) => Promise<AuthorizeResponse>,
  approvalWaitMs: number,
  retry: Required<RetryPolicy>,
  onRetry: ((event: RetryEvent) => void) | undefined,
): Promise<{ answer: AuthorizeResponse; redelivered: boolean }> {
  const until = performance.now() + approvalWaitMs;
  let hold = MAX_APPROVAL_HOLD_MS;
  let held = false;
  let answer = first;
  while (answer.decision === "DECISION_AWAIT_APPROVAL") {
    const leftMs = until - performance.now();
    if (leftMs <= 0) break;
    const waitMs = Math.min(leftMs, hold);
    const last = answer;
    const policy = { maxTries: retry.maxTries, maxTotalMs: retry.maxTotalMs + waitMs };
    answer = await withRetries("Authorize", policy, isAuthorizeRetryable, onRetry, async (budgetMs) => {
      const asked = performance.now();
      try {
        return await ask(budgetMs, waitMs);
      } catch (error) {
        const cut = performance.now() - asked;
        // atmost's --request-timeout (10 s by default) ends a held call
        // before its wait, CANCELLED "Timeout expired": nothing changed (the
        // call still waits, as last answered), and the next asks hold less.
        if (error instanceof AtmostError && error.code === Code.CANCELLED && error.reason === undefined && cut >= MIN_CUT_MS) {
          hold = Math.max(Math.min(hold, cut - CUT_MARGIN_MS), MIN_CUT_MS - CUT_MARGIN_MS);
          return last;
        }
        throw error;
      }
    });
    held = true;
  }
  if (answer.decision !== "DECISION_DISPATCH" || !held) return { answer, redelivered: answer.redelivered };
  // atmost claimed the approved call while it held the ask open: the
  // leaseRemaining it sent was measured then, up to the whole wait after the
  // ask was sent, and the ask's start is all this process can count it from
  // (a claim late in a long hold would leave no time to send). Asked once
  // more without a wait (the same holder token), atmost redelivers the same
  // DISPATCH to this call, which has sent nothing, with what is left of the
  // lease now, counted from a try just sent. Should that ask fail, the first
  // answer stands, its deadline counted from the held ask: shorter, never
  // longer than the lease.
  let again: AuthorizeResponse;
  try {
    again = await withRetries("Authorize", retry, isAuthorizeRetryable, onRetry, (budgetMs) => ask(budgetMs));
  } catch (error) {
    if (error instanceof AtmostError) return { answer, redelivered: answer.redelivered };
    throw error;
  }
  const same = again.decision === "DECISION_DISPATCH" && again.redelivered && again.attempt?.attemptId === answer.attempt?.attemptId;
  return { answer: same ? again : answer, redelivered: answer.redelivered };
}

/**
 * Whether a ToolFailed or NotSent is the dispatch's own report on this
 * attempt: one it made, naming no attempt (or this one). One that names
 * another attempt, or is a replay, was raised by a guarded call made inside
 * the dispatch and passed through it: it tells what became of that inner
 * call, not of this one, which may well have sent (the inner call did, or
 * tried). Honoured, a NotSent would give this call's slot back; so it is
 * treated like any other error: MarkUncertain.
 */
function ours(error: ToolFailed | NotSent, attemptId: string): boolean {
  if (error instanceof ToolFailed && error.replayed) return false;
  return error.attemptId === undefined || error.attemptId === attemptId;
}

/** `value instanceof kind`, and false where asking throws (a Proxy whose getPrototypeOf trap throws, a revoked one). */
function isA<C>(value: unknown, kind: abstract new (...args: never[]) => C): value is C {
  try {
    return value instanceof kind;
  } catch {
    return false;
  }
}

/** A REPLAY: the key's recorded outcome, nothing sent. */
function replay(attempt: Attempt): ReplayedOutcome {
  const attemptId = attempt.attemptId;
  switch (attempt.state) {
    case "ATTEMPT_STATE_SUCCEEDED":
      if (!attempt.receipt) throw new AtmostError(`attempt ${attemptId} replayed SUCCEEDED without a receipt`, { attemptId });
      return { replayed: true, result: attempt.receipt.result, attempt, receipt: attempt.receipt };
    case "ATTEMPT_STATE_FAILED":
      throw new ToolFailed(attempt.failureReason, { attemptId, attempt, replayed: true });
    case "ATTEMPT_STATE_UNCERTAIN":
      throw new OutcomeUncertain(
        `attempt ${attemptId} is UNCERTAIN (${attempt.uncertainReason}): the same unknown, replayed; nothing was sent`,
        { attemptId, attempt, replayed: true },
      );
    default:
      throw new AtmostError(`Authorize replayed attempt ${attemptId} in state ${attempt.state}; nothing was sent`, { attemptId });
  }
}

type Ran<T> = { ok: true; value: T | WithActualCost<T> } | { ok: false; error: unknown; timedOut: boolean };

/**
 * Calls dispatch once, racing it against the deadline. At the deadline the
 * signal aborts and the call is over for the helper, whatever the dispatch
 * does later (its late result or error is dropped).
 */
async function runDispatch<T>(dispatch: Dispatch<T>, attemptId: string, leftMs: number): Promise<Ran<T>> {
  const controller = new AbortController();
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => {
      const error = new DOMException("the dispatch deadline passed", "TimeoutError");
      controller.abort(error);
      reject(error);
    }, Math.max(0, leftMs));
  });
  try {
    // Inside then(), so a dispatch that throws synchronously is caught too.
    const value = await Promise.race([Promise.resolve().then(() => dispatch(attemptId, controller.signal)), deadline]);
    return { ok: true, value: value as T | WithActualCost<T> };
  } catch (error) {
    return { ok: false, error, timedOut: controller.signal.aborted && error === controller.signal.reason };
  } finally {
    clearTimeout(timer);
  }
}

/**
 * The bytes Commit stores: bytes as they are, anything else as its UTF-8
 * JSON.stringify text (NaN and the infinities become `null` there;
 * `undefined`, a dispatch that returns nothing, is `null`); over 64 KiB,
 * `sha256:<hex>` of them. A result JSON.stringify cannot write at all (a
 * BigInt, a cycle, a function or a symbol as the whole result, a toJSON
 * that throws, a Proxy whose traps throw) is stored empty: the call went
 * out, so its success is recorded all the same, and a replay returns an
 * empty result.
 */
export function encodeResult(value: unknown): Buffer {
  let bytes: Buffer;
  try {
    if (value instanceof Uint8Array) {
      bytes = Buffer.from(value.buffer, value.byteOffset, value.byteLength);
    } else {
      const json = JSON.stringify(value === undefined ? null : value);
      if (json === undefined) return Buffer.alloc(0);
      bytes = Buffer.from(json, "utf8");
    }
  } catch {
    // Whatever stops it (a cycle, a BigInt, a throwing toJSON, a Proxy
    // whose traps throw or that only looks like bytes): stored empty.
    return Buffer.alloc(0);
  }
  if (bytes.length <= MAX_RESULT_BYTES) return bytes;
  return Buffer.from(`sha256:${createHash("sha256").update(bytes).digest("hex")}`, "ascii");
}

/**
 * The milliseconds dispatch gets, counted from when the DISPATCH arrived.
 * `leaseRemainingMs` is what atmost said was left of the lease, measured on
 * the store's clock when it decided, after the Authorize try it answered
 * was sent: counted from that try's start, `sinceTryMs` before the arrival,
 * it ends before the lease does however long the answer took, and
 * {@link LEASE_MARGIN_MS} is kept in hand. From a server that does not say
 * (undefined), the attempt's whole `leaseMs` counted from the call's first
 * Authorize try (then `sinceTryMs` is since that one): every reservation a
 * try of this call can hold was made after it was sent. The caller's
 * `timeoutMs`, from the arrival, can only shorten it: past the lease the
 * attempt reads UNCERTAIN, an operator may resolve it NotSent and the key
 * be used again, and a call still sent then would exceed the cap.
 */
export function dispatchTimeMs(
  leaseRemainingMs: number | undefined,
  leaseMs: number,
  sinceTryMs: number,
  timeoutMs: number | undefined,
): number {
  const byLease = (leaseRemainingMs ?? leaseMs) - LEASE_MARGIN_MS - sinceTryMs;
  return timeoutMs === undefined ? byLease : Math.min(timeoutMs, byLease);
}

/** The actual cost as Commit sends it (a decimal string past 2^53-1); a TypeError or RangeError if it is not an integer from 0 to 2^63-1. */
function checkActualCost(cost: unknown): number | string {
  if (typeof cost !== "number" && typeof cost !== "bigint") {
    throw new TypeError(`the actual cost must be an integer from 0 to 2^63-1 (a number or a BigInt), got a ${typeof cost}: ${text(cost)}`);
  }
  const exact = typeof cost === "bigint" ? cost : Number.isInteger(cost) ? BigInt(cost) : undefined;
  if (exact === undefined || exact < 0n || exact > MAX_ACTUAL_COST) {
    throw new RangeError(`the actual cost must be an integer from 0 to 2^63-1, got ${text(cost)}${typeof cost === "bigint" ? "n" : ""}`);
  }
  return exact <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(exact) : exact.toString();
}

/** Milliseconds (>= 0) as a google.protobuf.Duration. */
export function durationOf(ms: number): Duration {
  const nanos = Math.round(ms * 1e6);
  return { seconds: Math.floor(nanos / 1e9), nanos: nanos % 1e9 };
}

function durationMs(d: Duration): number {
  return d.seconds * 1000 + Math.floor(d.nanos / 1e6);
}

function leaseMs(attempt: Attempt): number {
  if (!attempt.createdAt || !attempt.leaseExpiresAt) return Number.NaN;
  return millis(attempt.leaseExpiresAt) - millis(attempt.createdAt);
}

function millis(t: Timestamp): number {
  return t.seconds * 1000 + Math.floor(t.nanos / 1e6);
}

/** A reason cut to atmost's 1024 bytes, on a character boundary. */
export function clip(reason: string): string {
  if (Buffer.byteLength(reason, "utf8") <= MAX_REASON_BYTES) return reason;
  let out = "";
  let bytes = 0;
  for (const ch of reason) {
    const n = Buffer.byteLength(ch, "utf8");
    if (bytes + n > MAX_REASON_BYTES - 3) break;
    out += ch;
    bytes += n;
  }
  return `${out}...`;
}


interface CheckedCall {
  permitId: string;
  tool: string;
  idempotencyKey: string;
  fingerprint: Buffer;
  cost: number;
  holderToken: Buffer;
  /** The token was made here, for this call only (not given by the caller): a redelivery to it repeats this call's own reservation. */
  tokenIsOurs: boolean;
  dispatchTimeoutMs?: number;
  approvalSummary: string;
  approvalWaitMs: number;
}

/** Every input checked before anything is sent; a bad one is a TypeError or RangeError naming it. */
function checkCall(call: GuardedCall): CheckedCall {
  if (call === null || typeof call !== "object") throw new TypeError("the guarded call must be an object");
  for (const name of ["permitId", "tool", "idempotencyKey"] as const) {
    if (typeof call[name] !== "string" || call[name] === "") throw new TypeError(`${name} must be a non-empty string`);
  }
  const hasRequest = "request" in call;
  if (hasRequest === (call.fingerprint !== undefined)) {
    throw new TypeError("give exactly one of request (a JSON value) and fingerprint (bytes)");
  }
  let fp: Buffer;
  if (call.fingerprint !== undefined) {
    fp = bytes(call.fingerprint, "fingerprint");
  } else {
    fp = fingerprintOf(call.request);
  }
  const cost = call.cost ?? 0;
  if (!Number.isSafeInteger(cost) || cost < 0 || cost > MAX_COST) {
    throw new RangeError(`cost must be an integer from 0 to 2^53-1, got ${String(cost)}`);
  }
  const holderToken = call.holderToken === undefined ? randomBytes(16) : bytes(call.holderToken, "holderToken");
  const timeout = call.dispatchTimeoutMs;
  if (timeout !== undefined && (typeof timeout !== "number" || !Number.isFinite(timeout) || timeout <= 0)) {
    throw new RangeError(`dispatchTimeoutMs must be a finite number of milliseconds > 0, got ${String(timeout)}`);
  }
  if (call.onRetry !== undefined && typeof call.onRetry !== "function") throw new TypeError("onRetry must be a function");
  const summary = call.approvalSummary ?? "";
  if (typeof summary !== "string") throw new TypeError("approvalSummary must be a string");
  if (Buffer.byteLength(summary, "utf8") > MAX_SUMMARY_BYTES) {
    throw new RangeError(`approvalSummary is longer than ${MAX_SUMMARY_BYTES} bytes of UTF-8`);
  }
  const approvalWaitMs = call.approvalWaitMs ?? 0;
  if (typeof approvalWaitMs !== "number" || !Number.isFinite(approvalWaitMs) || approvalWaitMs < 0) {
    throw new RangeError(`approvalWaitMs must be a finite number of milliseconds >= 0, got ${String(approvalWaitMs)}`);
  }
  return {
    permitId: call.permitId,
    tool: call.tool,
    idempotencyKey: call.idempotencyKey,
    fingerprint: fp,
    cost,
    holderToken,
    tokenIsOurs: call.holderToken === undefined,
    dispatchTimeoutMs: timeout,
    approvalSummary: summary,
    approvalWaitMs,
  };
}

function bytes(value: Uint8Array, name: string): Buffer {
  if (!(value instanceof Uint8Array)) throw new TypeError(`${name} must be bytes (a Uint8Array or Buffer)`);
  if (value.byteLength < 1 || value.byteLength > 64) throw new RangeError(`${name} must be 1 to 64 bytes, got ${value.byteLength}`);
  return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
}
