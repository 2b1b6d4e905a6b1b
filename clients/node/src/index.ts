/**
 * @atmost/client: the TypeScript client of atmost.
 *
 * Layout:
 * - client.ts: {@link Client}, one channel, a method per RPC, `guarded`;
 *   `approvalRule` for a permit's `approvalPerTool`.
 * - guarded.ts: the guarded-call helper (Authorize, dispatch, Commit).
 * - retry.ts: which failures are retried, and how long.
 * - errors.ts: the typed errors; details.ts reads ErrorInfo / RetryInfo /
 *   BadRequest from the `grpc-status-details-bin` trailer.
 * - fingerprint.ts: SHA-256 of RFC 8785 canonical JSON.
 * - proto.ts: loads proto/ at run time; types.ts names the generated
 *   message interfaces.
 */
export { Client, DEFAULT_CHANNEL_OPTIONS, DEFAULT_DEADLINE_MS, approvalRule } from "./client.js";
export type { ApprovalRuleOptions, CallOptions, ClientOptions, TlsOptions } from "./client.js";
export {
  dispatchTimeMs,
  durationOf,
  encodeResult,
  LEASE_MARGIN_MS,
  MAX_APPROVAL_HOLD_MS,
  MAX_RESULT_BYTES,
  WithActualCost,
  withActualCost,
} from "./guarded.js";
export type { Dispatch, FreshOutcome, GuardedCall, GuardedOutcome, ReplayedOutcome } from "./guarded.js";
export {
  ApprovalDenied,
  AtmostError,
  AwaitingApproval,
  CommitNotRecorded,
  DENIED_REASONS,
  Denied,
  HeldByEarlierRun,
  InProgress,
  InvalidRequest,
  NotSent,
  OutcomeUncertain,
  ToolFailed,
  Unavailable,
  fromServiceError,
} from "./errors.js";
export type { AtmostErrorInit, OutcomeInit, RecordedOutcome } from "./errors.js";
export { DOMAIN } from "./details.js";
export type { FieldViolation } from "./details.js";
export { BACKOFF_BASE_MS, BACKOFF_CAP_MS, DEFAULT_RETRY, backoffMs } from "./retry.js";
export type { RetryEvent, RetryPolicy } from "./retry.js";
export { FingerprintError, MAX_SAFE_NUMBER, canonicalJson, fingerprint } from "./fingerprint.js";
export { PROTO_DIR } from "./proto.js";
export type * from "./types.js";
