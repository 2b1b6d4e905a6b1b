/**
 * The typed errors: one base, {@link AtmostError}, with the gRPC code, the
 * atmost reason (`ErrorInfo.reason`, docs/api.md "Errors"), its metadata and
 * the message; and one class per kind a caller handles differently.
 *
 * Failures of an RPC become {@link Denied}, {@link InvalidRequest},
 * {@link InProgress}, {@link Unavailable} or the base class. The guarded call adds the outcomes
 * of a dispatch: {@link ToolFailed}, {@link NotSent}, {@link OutcomeUncertain}
 * and {@link CommitNotRecorded}; and, for a call that waits for a person's
 * approval, {@link AwaitingApproval} and {@link ApprovalDenied}.
 * `ToolFailed` and `NotSent` are also what a dispatch function throws to
 * tell the helper what happened.
 */
import { status as Code, type ServiceError } from "@grpc/grpc-js";

import { DOMAIN, readDetails, type FieldViolation } from "./details.js";
import type { Attempt__Output as Attempt } from "./generated/atmost/v1/Attempt.js";

/** What {@link AtmostError}'s constructor takes; every part optional. */
export interface AtmostErrorInit {
  code?: Code;
  reason?: string;
  metadata?: Record<string, string>;
  retryAfterMs?: number;
  fieldViolations?: FieldViolation[];
  attemptId?: string;
  cause?: unknown;
}

/** The base of every error this package raises. */
export class AtmostError extends Error {
  /** The gRPC status code; absent for an outcome of the guarded call that no RPC answered. */
  readonly code?: Code;
  /** atmost's `ErrorInfo.reason` (docs/api.md, "Errors"); absent when atmost did not answer (a broken connection, a proxy). */
  readonly reason?: string;
  /** The ErrorInfo metadata (`tool`, `limit`, `calls_made`, ...); empty when none. */
  readonly metadata: Readonly<Record<string, string>>;
  /** The message the status carried, without the reason prefix of `message`. */
  readonly details: string;
  /** The `google.rpc.RetryInfo` delay in milliseconds (IDEMPOTENCY_IN_PROGRESS, OVERLOADED). */
  readonly retryAfterMs?: number;
  /** The fields an INVALID_REQUEST names (google.rpc.BadRequest), in order. */
  readonly fieldViolations: readonly FieldViolation[];
  /** The attempt this error is about, when there is one (the guarded call's outcomes). */
  readonly attemptId?: string;

  constructor(details: string, init: AtmostErrorInit = {}) {
    const label = init.reason ?? (init.code === undefined ? undefined : Code[init.code]);
    super(label ? `${label}: ${details}` : details, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = new.target.name;
    this.code = init.code;
    this.reason = init.reason;
    this.metadata = Object.freeze({ ...(init.metadata ?? {}) });
    this.details = details;
    this.retryAfterMs = init.retryAfterMs;
    this.fieldViolations = Object.freeze([...(init.fieldViolations ?? [])]);
    this.attemptId = init.attemptId;
  }

  /** The gRPC code's name (`RESOURCE_EXHAUSTED`), or undefined. */
  get codeName(): string | undefined {
    return this.code === undefined ? undefined : Code[this.code];
  }

  /** Metadata `tool`: the tool refused (cap, scope, hold, duplicate). */
  get tool(): string | undefined {
    return this.metadata.tool;
  }

  /** Metadata `limit` as a number: the cap, or a quota's limit. */
  get limit(): number | undefined {
    return numeric(this.metadata.limit);
  }

  /** Metadata `calls_made` as a number: the slots the tool holds. */
  get callsMade(): number | undefined {
    return numeric(this.metadata.calls_made);
  }
}

function numeric(value: string | undefined): number | undefined {
  if (value === undefined || !/^-?\d+$/.test(value)) return undefined;
  return Number(value);
}

/**
 * atmost refused: PERMIT_MAX_CALLS_EXCEEDED, PERMIT_BUDGET_EXCEEDED,
 * TOOL_NOT_IN_SCOPE, PERMIT_REVOKED, PERMIT_EXPIRED, PERMIT_NOT_FOUND,
 * IDEMPOTENCY_KEY_REUSED, TOOL_HELD_UNCERTAIN, DUPLICATE_REQUEST_SUSPECTED,
 * the quotas, UNAUTHENTICATED, ROLE_NOT_ALLOWED; for a Commit or
 * MarkUncertain, ATTEMPT_HOLDER_MISMATCH (another key reserved the
 * attempt); for an Approve, APPROVER_IS_REQUESTER (the key requested the
 * call itself). Nothing was reserved and nothing may be sent; the same
 * request fails the same way.
 */
export class Denied extends AtmostError {}

/**
 * INVALID_REQUEST (or INVALID_ARGUMENT from anything in between): the
 * request is malformed, `fieldViolations` name the fields (BadRequest).
 * Nothing was reserved or sent; the same request fails the same way.
 */
export class InvalidRequest extends AtmostError {}

/**
 * IDEMPOTENCY_IN_PROGRESS: the key's attempt is RESERVED by another holder
 * (another holder_token, or none). `retryAfterMs` is the time to its lease's
 * end; send nothing.
 */
export class InProgress extends AtmostError {}

/**
 * No decision is known: UNAVAILABLE (STORE_UNAVAILABLE, OVERLOADED, or the
 * connection failed), DEADLINE_EXCEEDED, or CANCELLED without atmost's
 * ErrorInfo (atmost's --request-timeout answers CANCELLED "Timeout
 * expired"). The request may or may not have been applied; sent again with
 * the same idempotency key it gets the original reservation back, never a
 * second one.
 */
export class Unavailable extends AtmostError {}

/** The reasons {@link Denied} stands for. */
export const DENIED_REASONS: ReadonlySet<string> = new Set([
  "PERMIT_NOT_FOUND",
  "PERMIT_REVOKED",
  "PERMIT_EXPIRED",
  "TOOL_NOT_IN_SCOPE",
  "TOOL_HELD_UNCERTAIN",
  "PERMIT_MAX_CALLS_EXCEEDED",
  "PERMIT_BUDGET_EXCEEDED",
  "IDEMPOTENCY_KEY_REUSED",
  "DUPLICATE_REQUEST_SUSPECTED",
  "UNAUTHENTICATED",
  "ROLE_NOT_ALLOWED",
  "QUOTA_PERMIT_LIFETIME",
  "QUOTA_OPEN_ATTEMPTS",
  "QUOTA_ATTEMPTS",
  "QUOTA_TENANT_PERMITS",
  "QUOTA_STORE_FULL",
  "ATTEMPT_HOLDER_MISMATCH",
  "APPROVER_IS_REQUESTER",
]);

/**
 * The reasons this client knows that are not refusals: raised as
 * {@link InProgress}, {@link InvalidRequest}, {@link Unavailable} or the
 * base class. Any other reason (one added to atmost after this client) is
 * read as a refusal, {@link Denied}, unless its code says transient or
 * invalid.
 */
const OTHER_REASONS: ReadonlySet<string> = new Set([
  "IDEMPOTENCY_IN_PROGRESS",
  "INVALID_REQUEST",
  "STORE_UNAVAILABLE",
  "OVERLOADED",
  "DEADLINE_EXCEEDED",
  "ATTEMPT_NOT_FOUND",
  "ATTEMPT_MISMATCH",
  "ATTEMPT_STATE_CONFLICT",
  "MESSAGE_TOO_LARGE",
]);

/**
 * The typed error of a failed RPC. The class follows atmost's reason when
 * there is one (an ErrorInfo of domain "atmost"), else the gRPC code (a
 * transport failure, a proxy's answer): {@link InProgress} for
 * IDEMPOTENCY_IN_PROGRESS; {@link Denied} for a refusal, for a reason this
 * client does not know, and for UNAUTHENTICATED or PERMISSION_DENIED
 * without atmost's ErrorInfo; {@link InvalidRequest} for INVALID_REQUEST or
 * INVALID_ARGUMENT; {@link Unavailable} for UNAVAILABLE, DEADLINE_EXCEEDED,
 * or CANCELLED without ErrorInfo; the base class for anything else.
 */
export function fromServiceError(error: ServiceError): AtmostError {
  const found = readDetails(error.metadata);
  const info = found.errorInfo?.domain === DOMAIN ? found.errorInfo : undefined;
  const init: AtmostErrorInit = {
    code: error.code,
    reason: info?.reason,
    metadata: info?.metadata,
    retryAfterMs: found.retryAfterMs,
    fieldViolations: found.fieldViolations,
    cause: error,
  };
  const details = error.details || error.message;
  if (info?.reason === "IDEMPOTENCY_IN_PROGRESS") return new InProgress(details, init);
  if (info !== undefined && DENIED_REASONS.has(info.reason)) return new Denied(details, init);
  if (info?.reason === "INVALID_REQUEST" || error.code === Code.INVALID_ARGUMENT) return new InvalidRequest(details, init);
  switch (error.code) {
    case Code.UNAVAILABLE:
    case Code.DEADLINE_EXCEEDED:
      return new Unavailable(details, init);
    case Code.CANCELLED:
      if (info === undefined) return new Unavailable(details, init);
      break;
    case Code.UNAUTHENTICATED:
    case Code.PERMISSION_DENIED:
      // Refused before atmost's own checks (a proxy, a TLS front end).
      if (info === undefined) return new Denied(details, init);
  }
  // A reason atmost added after this client: atmost's word, not a transport
  // failure, and not one to retry or to send past.
  if (info !== undefined && !OTHER_REASONS.has(info.reason)) return new Denied(details, init);
  return new AtmostError(details, init);
}

// === the outcomes of a guarded call ===

/** Options of the outcome errors the guarded call raises. */
export interface OutcomeInit {
  attemptId?: string;
  attempt?: Attempt;
  replayed?: boolean;
  cause?: unknown;
}

/**
 * The tool answered and refused. A dispatch throws `new ToolFailed(reason)`;
 * the guarded call commits Failed(reason) (cost released, slot kept) and
 * raises a ToolFailed of its own, naming the attempt, and raises one with
 * `replayed` when the key's attempt had already FAILED. One that names
 * another attempt (a guarded call's, thrown through a dispatch) is not a
 * dispatch's report: the guarded call takes it as an unknown outcome.
 */
export class ToolFailed extends AtmostError {
  /** What the tool said: the Failed reason recorded. */
  readonly failureReason: string;
  /** Whether this is the key's earlier outcome, replayed (nothing was sent now). */
  readonly replayed: boolean;
  readonly attempt?: Attempt;

  /** `failureReason` that is not a string is stringified (`String(reason)`). */
  constructor(failureReason: string, init: OutcomeInit = {}) {
    const reason = text(failureReason);
    super(init.replayed ? `tool failed (replayed): ${reason}` : `tool failed: ${reason}`, init);
    this.failureReason = reason;
    this.replayed = init.replayed ?? false;
    this.attempt = init.attempt;
  }
}

/**
 * The call never left. A dispatch throws `new NotSent()` only when it knows
 * nothing reached the tool; the guarded call commits NotSent (slot and cost
 * come back, the key is free) and raises a NotSent of its own, naming the
 * attempt. One that names another attempt (a guarded call's, thrown through
 * a dispatch) is not a dispatch's report: the guarded call takes it as an
 * unknown outcome, and keeps the slot.
 */
export class NotSent extends AtmostError {
  readonly attempt?: Attempt;

  constructor(details = "the call was not sent", init: OutcomeInit = {}) {
    super(details, init);
    this.attempt = init.attempt;
  }
}

/**
 * The call may or may not have taken effect: the dispatch threw, hung past
 * its deadline, or the key's attempt is UNCERTAIN (`replayed`). The attempt
 * is recorded UNCERTAIN (slot and cost held); nothing is sent again, and an
 * operator resolves it (ListUncertain, Resolve).
 */
export class OutcomeUncertain extends AtmostError {
  readonly replayed: boolean;
  readonly attempt?: Attempt;

  constructor(details: string, init: OutcomeInit = {}) {
    super(details, init);
    this.replayed = init.replayed ?? false;
    this.attempt = init.attempt;
  }
}

/**
 * The key's attempt is RESERVED by an earlier run of this call: atmost
 * redelivered its DISPATCH to the `holderToken` you gave, and this call
 * cannot know whether that run sent it. `dispatch` was not called and
 * nothing was recorded. Settle it: {@link Client.settleNotSent} only if you
 * know the call never left (your own durable journal says so), else
 * {@link Client.settleUncertain}; left alone, it turns UNCERTAIN at its
 * lease and an operator resolves it. `attempt` is the RESERVED attempt
 * (what the settle methods take), `leaseRemainingMs` what atmost said was
 * left of its lease (absent from a server that does not say).
 */
export class HeldByEarlierRun extends AtmostError {
  declare readonly attemptId: string;
  readonly attempt: Attempt;
  readonly leaseRemainingMs?: number;

  constructor(attempt: Attempt, leaseRemainingMs?: number) {
    super(
      `an earlier run of this call holds attempt ${attempt.attemptId}, and atmost cannot know whether it sent: settle it NotSent only if you know it did not, else mark it uncertain`,
      { attemptId: attempt.attemptId },
    );
    this.attempt = attempt;
    this.leaseRemainingMs = leaseRemainingMs;
  }
}

/**
 * The call waits for a person's approval (the permit's `approvalPerTool`
 * rule holds it) and no decision came within the guarded call's
 * `approvalWaitMs` (0 by default: not waited for at all). Nothing was
 * sent; the slot and the cost stay reserved until the request lapses at
 * `expiresAt` (absent when atmost did not say). Make the same call again
 * (the same key and request) to wait on, or to dispatch once approved.
 * `attempt` is the attempt as atmost answered it (AWAITING_APPROVAL, with
 * its `approval`).
 */
export class AwaitingApproval extends AtmostError {
  declare readonly attemptId: string;
  readonly attempt: Attempt;
  readonly expiresAt?: Date;

  constructor(attempt: Attempt) {
    const at = attempt.approval?.expiresAt;
    const expiresAt = at ? new Date(Number(at.seconds) * 1000 + Math.floor(at.nanos / 1e6)) : undefined;
    super(`attempt ${attempt.attemptId} awaits approval${expiresAt ? ` (until ${expiresAt.toISOString()})` : ""}: nothing was sent`, {
      attemptId: attempt.attemptId,
    });
    this.attempt = attempt;
    this.expiresAt = expiresAt;
  }
}

/**
 * A person denied the call, or nobody decided in time (`denialReason`
 * `approval_expired`; `approval_unclaimed` for an approval the requester
 * did not come back for in time; `permit_revoked`). It was never sent, and
 * the key replays this denial for good: a new call needs a new key.
 * `denialReason` is the approver's reason (the attempt's
 * `approval.denialReason`; `reason` stays the ErrorInfo reason of
 * {@link AtmostError}, absent here), `decidedBy` the approver's key id
 * (empty for a lapse, and in dev mode), `replayed` false when this call
 * waited for the decision, true when the key was already denied before it
 * asked.
 */
export class ApprovalDenied extends AtmostError {
  declare readonly attemptId: string;
  readonly attempt: Attempt;
  readonly denialReason: string;
  readonly decidedBy: string;
  readonly replayed: boolean;

  constructor(attempt: Attempt, replayed: boolean) {
    const denialReason = attempt.approval?.denialReason ?? "";
    const decidedBy = attempt.approval?.decidedBy ?? "";
    super(
      `the call was denied approval${decidedBy ? ` by ${decidedBy}` : ""}${replayed ? " (replayed)" : ""}: ${denialReason}; nothing was sent`,
      { attemptId: attempt.attemptId },
    );
    this.attempt = attempt;
    this.denialReason = denialReason;
    this.decidedBy = decidedBy;
    this.replayed = replayed;
  }
}

/** What the guarded call was recording when it could not. */
export type RecordedOutcome = "succeeded" | "failed" | "not_sent" | "uncertain";

/**
 * The dispatch ended but its outcome could not be recorded: Commit or
 * MarkUncertain still failed after their retries, was refused, threw (a
 * closed client), or answered without the SUCCEEDED receipt; or the actual
 * cost given was not one atmost takes (then nothing was sent to record it).
 * `cause` is why. The attempt ends UNCERTAIN at its lease, and an operator
 * resolves it; `result` holds what the tool returned, when it succeeded,
 * `outcomeReason` the Failed or uncertain reason being recorded. `code`,
 * `reason` and `metadata` are the cause's, when it is an AtmostError.
 */
export class CommitNotRecorded extends AtmostError {
  readonly outcome: RecordedOutcome;
  readonly result?: unknown;
  readonly outcomeReason?: string;

  constructor(attemptId: string, outcome: RecordedOutcome, cause: unknown, result?: unknown, outcomeReason?: string) {
    const rpc = cause instanceof AtmostError ? cause : undefined;
    super(`the outcome (${outcome}) of attempt ${attemptId} could not be recorded: ${describeThrown(cause, false)}`, {
      code: rpc?.code,
      reason: rpc?.reason,
      metadata: { ...rpc?.metadata },
      attemptId,
      cause,
    });
    this.outcome = outcome;
    this.result = result;
    this.outcomeReason = outcomeReason;
  }
}

/** `value` as text, whatever it is (String() throws for an object without a primitive form, and for a revoked Proxy so does everything else). */
export function text(value: unknown): string {
  if (typeof value === "string") return value;
  try {
    return String(value);
  } catch {
    try {
      return Object.prototype.toString.call(value);
    } catch {
      return `[${typeof value}]`;
    }
  }
}

/**
 * What was thrown, as text, whatever it is: an Error as `name: message`
 * (or its message alone), anything else as {@link text}. Never throws: an
 * Error whose `name` or `message` getter throws, or a Proxy whose traps do,
 * reads as {@link text} of it.
 */
export function describeThrown(value: unknown, withName = true): string {
  try {
    if (value instanceof Error) {
      const message = text(value.message);
      return withName ? `${text(value.name)}: ${message}` : message;
    }
  } catch {
    // a getter or a proxy trap that throws: read as a value like any other
  }
  return text(value);
}
