/**
 * Retrying one RPC of the guarded call: only the failures after which
 * sending the same request again is safe (the server dedupes it by its
 * idempotency key, or it answers the same), with the RetryInfo delay when
 * atmost sent one, else exponential backoff with jitter, within a number of
 * tries and a total time.
 */
import { setTimeout as sleep } from "node:timers/promises";
import { status as Code } from "@grpc/grpc-js";

import { AtmostError } from "./errors.js";

/** How long the guarded call keeps retrying one RPC. */
export interface RetryPolicy {
  /** Tries in all, the first included (default 5). */
  maxTries?: number;
  /**
   * Total time in milliseconds (default 10 000): each try's deadline is
   * what is left of it (or the client's own deadline, when sooner), and no
   * wait begins that would end past it; the last error is raised instead.
   */
  maxTotalMs?: number;
}

/** What {@link RetryPolicy} fills in. */
export const DEFAULT_RETRY = { maxTries: 5, maxTotalMs: 10_000 } as const;

/** The first backoff delay, doubled each try up to {@link BACKOFF_CAP_MS}. */
export const BACKOFF_BASE_MS = 50;
export const BACKOFF_CAP_MS = 2_000;

/** One retry about to wait: what failed, and how long the wait is. */
export interface RetryEvent {
  /** The RPC: "Authorize", "Commit" or "MarkUncertain". */
  rpc: string;
  /** The try that failed, from 1. */
  tryNumber: number;
  error: AtmostError;
  delayMs: number;
}

/**
 * The delay before try `failed + 1` without RetryInfo: 50 ms doubling,
 * capped at 2 s, drawn from its upper half ("equal jitter"), so callers
 * that failed together do not retry together.
 */
export function backoffMs(failed: number): number {
  const ceiling = Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** (failed - 1));
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

/**
 * UNAVAILABLE (store, overload, transport), DEADLINE_EXCEEDED, or CANCELLED
 * without atmost's ErrorInfo (a timeout: atmost's --request-timeout answers
 * CANCELLED "Timeout expired"): no decision known, and the same request
 * answers the same.
 */
export function isTransient(error: AtmostError): boolean {
  switch (error.code) {
    case Code.UNAVAILABLE:
    case Code.DEADLINE_EXCEEDED:
      return true;
    case Code.CANCELLED:
      return error.reason === undefined;
    default:
      return false;
  }
}

/** Authorize also waits out IDEMPOTENCY_IN_PROGRESS (another holder's lease). */
export function isAuthorizeRetryable(error: AtmostError): boolean {
  return isTransient(error) || (error.code === Code.ABORTED && error.reason === "IDEMPOTENCY_IN_PROGRESS");
}

/** Checks a policy, filling in the defaults. */
export function retryPolicy(policy: RetryPolicy | undefined, name: string): Required<RetryPolicy> {
  const maxTries = policy?.maxTries ?? DEFAULT_RETRY.maxTries;
  const maxTotalMs = policy?.maxTotalMs ?? DEFAULT_RETRY.maxTotalMs;
  if (!Number.isSafeInteger(maxTries) || maxTries < 1) {
    throw new RangeError(`${name}.maxTries must be an integer >= 1, got ${String(maxTries)}`);
  }
  if (typeof maxTotalMs !== "number" || !Number.isFinite(maxTotalMs) || maxTotalMs <= 0) {
    throw new RangeError(`${name}.maxTotalMs must be a finite number of milliseconds > 0, got ${String(maxTotalMs)}`);
  }
  return { maxTries, maxTotalMs };
}

/** The least deadline a try is given, when the budget is (all but) spent. */
const MIN_TRY_MS = 1;

/**
 * Runs `call(leftMs)` until it succeeds, fails with an error `retryable`
 * refuses, or the policy is spent; then raises the last error. `leftMs` is
 * what is left of `maxTotalMs` as the try starts (at least 1 ms): the
 * try's deadline, so a try that hangs ends with the budget rather than
 * with the client's whole deadline.
 */
export async function withRetries<T>(
  rpc: string,
  policy: Required<RetryPolicy>,
  retryable: (error: AtmostError) => boolean,
  onRetry: ((event: RetryEvent) => void) | undefined,
  call: (leftMs: number) => Promise<T>,
): Promise<T> {
  const start = performance.now();
  for (let tryNumber = 1; ; tryNumber++) {
    try {
      return await call(Math.max(policy.maxTotalMs - (performance.now() - start), MIN_TRY_MS));
    } catch (error) {
      if (!(error instanceof AtmostError) || !retryable(error) || tryNumber >= policy.maxTries) throw error;
      const delayMs = error.retryAfterMs ?? backoffMs(tryNumber);
      if (performance.now() - start + delayMs > policy.maxTotalMs) throw error;
      try {
        onRetry?.({ rpc, tryNumber, error, delayMs });
      } catch {
        // A broken logging hook must not stop a Commit from being recorded.
      }
      await sleep(delayMs);
    }
  }
}
