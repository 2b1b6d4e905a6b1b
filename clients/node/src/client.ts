/**
 * The client: one channel to atmost, a promise-returning method per RPC of
 * atmost.v1 (Gate, Permits, Approvals, Receipts), every failure a typed error
 * (errors.ts), and {@link Client.guarded}, the helper that wraps one
 * side-effecting call (guarded.ts).
 */
import * as grpc from "@grpc/grpc-js";

import { AtmostError, fromServiceError } from "./errors.js";
import { clip, durationOf, runGuarded, type Dispatch, type GuardedCall, type GuardedOutcome } from "./guarded.js";
import { DEFAULT_RETRY, isTransient, withRetries } from "./retry.js";
import { atmostV1 } from "./proto.js";
import type { ApprovalsClient } from "./generated/atmost/v1/Approvals.js";
import type { GateClient } from "./generated/atmost/v1/Gate.js";
import type { PermitsClient } from "./generated/atmost/v1/Permits.js";
import type { ReceiptsClient } from "./generated/atmost/v1/Receipts.js";
import type {
  ApproveRequest,
  ApproveResponse,
  Attempt,
  AuthorizeRequest,
  AuthorizeResponse,
  CommitRequest,
  CommitResponse,
  DenyRequest,
  DenyResponse,
  GetAttemptResponse,
  GetPermitResponse,
  GetSigningKeysResponse,
  ListApprovalsRequest,
  ListApprovalsResponse,
  ListUncertainRequest,
  ListUncertainResponse,
  MarkUncertainRequest,
  MarkUncertainResponse,
  NewApprovalRule,
  NewPermit,
  Permit,
  ResolveRequest,
  ResolveResponse,
} from "./types.js";

/** TLS to atmost (`--tls-cert`, `--tls-key`; `--tls-client-ca` for mTLS). */
export interface TlsOptions {
  /** PEM of the CA that signed atmost's certificate; absent: Node's default roots. */
  rootCa?: Buffer | string;
  /** mTLS: this client's certificate chain (PEM); `key` is then required. */
  cert?: Buffer | string;
  /** mTLS: the private key (PEM) of `cert`. */
  key?: Buffer | string;
  /**
   * The name atmost's certificate is checked against (and sent as SNI),
   * when it is not the host in `address`: e.g. `localhost` for a
   * certificate issued to it, reached as 127.0.0.1.
   */
  serverName?: string;
}

export interface ClientOptions {
  /** atmost's address: `host:port` (or any grpc-js target, `dns:///atmost:50051`). */
  address: string;
  /** Sent as `authorization: Bearer <key>` with every call (atmost with `--auth-keys`). */
  apiKey?: string;
  /** Connect over TLS; absent: plaintext. */
  tls?: TlsOptions;
  /** Each RPC's deadline in milliseconds unless the call says otherwise (default 10 000). */
  deadlineMs?: number;
  /** More grpc-js channel options; they override the defaults below. */
  channelOptions?: grpc.ChannelOptions;
}

/** Options of one RPC. */
export interface CallOptions {
  /** This call's deadline in milliseconds (default: the client's). */
  deadlineMs?: number;
}

export const DEFAULT_DEADLINE_MS = 10_000;

/**
 * grpc-js waits 1 s, then up to 120 s, before reconnecting, and fails calls
 * at once meanwhile; the guarded call's own retries (50 ms doubling to 2 s)
 * would all land inside that first second. Reconnecting on the same
 * schedule lets a retry find a server that came back.
 */
export const DEFAULT_CHANNEL_OPTIONS: grpc.ChannelOptions = {
  "grpc.initial_reconnect_backoff_ms": 100,
  "grpc.max_reconnect_backoff_ms": 2_000,
};

type Callback<T> = (error: grpc.ServiceError | null, value?: T) => void;

/** A connection to atmost. Close it with {@link Client.close}. */
export class Client {
  private readonly gate: GateClient;
  private readonly permits: PermitsClient;
  private readonly receipts: ReceiptsClient;
  private readonly approvals: ApprovalsClient;
  private readonly authorization?: string;
  /** Each RPC's deadline in milliseconds, unless the call gives its own ({@link ClientOptions.deadlineMs}). */
  readonly deadlineMs: number;

  constructor(options: ClientOptions) {
    if (typeof options?.address !== "string" || options.address === "") {
      throw new TypeError("address must be a non-empty string such as 127.0.0.1:50051");
    }
    if (options.apiKey !== undefined) {
      // A header value: visible ASCII, so the key can never break the header.
      if (typeof options.apiKey !== "string" || !/^[\x21-\x7e]+$/.test(options.apiKey)) {
        throw new TypeError("apiKey must be a non-empty string of visible ASCII characters");
      }
      this.authorization = `Bearer ${options.apiKey}`;
    }
    this.deadlineMs = checkDeadline(options.deadlineMs ?? DEFAULT_DEADLINE_MS, "deadlineMs");
    const credentials = channelCredentials(options.tls);
    const channelOptions: grpc.ChannelOptions = { ...DEFAULT_CHANNEL_OPTIONS };
    if (options.tls?.serverName !== undefined) {
      if (typeof options.tls.serverName !== "string" || options.tls.serverName === "") {
        throw new TypeError("tls.serverName must be a non-empty string");
      }
      channelOptions["grpc.ssl_target_name_override"] = options.tls.serverName;
    }
    Object.assign(channelOptions, options.channelOptions);
    this.gate = new atmostV1.Gate(options.address, credentials, channelOptions);
    // One channel (one HTTP/2 connection) for the four services.
    const shared = { ...channelOptions, channelOverride: this.gate.getChannel() };
    this.permits = new atmostV1.Permits(options.address, credentials, shared);
    this.receipts = new atmostV1.Receipts(options.address, credentials, shared);
    this.approvals = new atmostV1.Approvals(options.address, credentials, shared);
  }

  /**
   * Closes the channel: new calls fail at once; calls already open run to
   * their answer or their deadline (grpc-js does not cancel them).
   */
  close(): void {
    this.gate.close();
  }

  // === atmost.v1.Gate ===

  /**
   * Asks for a DISPATCH before a side-effecting call. With `wait` (at most
   * 60 s), atmost holds a call that awaits approval open until the decision
   * or the wait's end; the default deadline is then the client's plus the
   * wait.
   */
  authorize(request: AuthorizeRequest, options?: CallOptions): Promise<AuthorizeResponse> {
    const held = request.wait ? Number(String(request.wait.seconds ?? 0)) * 1000 + (request.wait.nanos ?? 0) / 1e6 : 0;
    if (options?.deadlineMs === undefined && held > 0) options = { ...options, deadlineMs: this.deadlineMs + held };
    return this.unary(options, (md, opts, cb) => this.gate.authorize(request, md, opts, cb));
  }

  /** Reports the outcome of a dispatched (or never sent) call. */
  commit(request: CommitRequest, options?: CallOptions): Promise<CommitResponse> {
    return this.unary(options, (md, opts, cb) => this.gate.commit(request, md, opts, cb));
  }

  /** The call was sent and its response lost: slot and money stay held. */
  markUncertain(request: MarkUncertainRequest, options?: CallOptions): Promise<MarkUncertainResponse> {
    return this.unary(options, (md, opts, cb) => this.gate.markUncertain(request, md, opts, cb));
  }

  // === atmost.v1.Permits ===

  /** Stores a new permit; atmost assigns its id and fills the defaults. */
  createPermit(permit: NewPermit, options?: CallOptions): Promise<Permit> {
    return this.unary(options, (md, opts, cb) => this.permits.createPermit({ permit }, md, opts, cb));
  }

  getPermit(permitId: string, options?: CallOptions): Promise<GetPermitResponse> {
    return this.unary(options, (md, opts, cb) => this.permits.getPermit({ permitId }, md, opts, cb));
  }

  /**
   * One key's attempt as atmost sees it now (a RESERVED one past its lease
   * reads UNCERTAIN, `lease_expired`). Reads only. A key the permit never
   * saw is an AtmostError ATTEMPT_NOT_FOUND; an unknown permit Denied
   * PERMIT_NOT_FOUND.
   */
  getAttempt(permitId: string, idempotencyKey: string, options?: CallOptions): Promise<GetAttemptResponse> {
    return this.unary(options, (md, opts, cb) => this.permits.getAttempt({ permitId, idempotencyKey }, md, opts, cb));
  }

  /** Stops new keys; existing attempts keep working. */
  revokePermit(permitId: string, options?: CallOptions): Promise<Permit> {
    return this.unary(options, (md, opts, cb) => this.permits.revokePermit({ permitId }, md, opts, cb));
  }

  /** One page of UNCERTAIN attempts (`permitId` empty: across permits). */
  listUncertain(request: ListUncertainRequest, options?: CallOptions): Promise<ListUncertainResponse> {
    return this.unary(options, (md, opts, cb) => this.permits.listUncertain(request, md, opts, cb));
  }

  /** Settles an UNCERTAIN attempt after asking the tool what happened. */
  resolve(request: ResolveRequest, options?: CallOptions): Promise<ResolveResponse> {
    return this.unary(options, (md, opts, cb) => this.permits.resolve(request, md, opts, cb));
  }

  // === atmost.v1.Approvals ===

  /**
   * One page of calls AWAITING_APPROVAL (`permitId` empty or absent: across
   * the caller's tenant), oldest request first, each with its `approval`
   * (summary, expiry, approvals so far) and the `attemptId` that
   * {@link Client.approve} and {@link Client.deny} need. An approver's or
   * admin's key.
   */
  listApprovals(request: ListApprovalsRequest = {}, options?: CallOptions): Promise<ListApprovalsResponse> {
    return this.unary(options, (md, opts, cb) => this.approvals.listApprovals(request, md, opts, cb));
  }

  /**
   * Approves one call awaiting approval, named by `permitId`,
   * `idempotencyKey` and `attemptId` (an approver's or admin's key; never
   * the key that requested it: `Denied` APPROVER_IS_REQUESTER). With a
   * four-eyes rule the call stays AWAITING_APPROVAL until a second,
   * distinct key approves. Repeating an approval answers the attempt as it is.
   */
  approve(request: ApproveRequest, options?: CallOptions): Promise<ApproveResponse> {
    return this.unary(options, (md, opts, cb) => this.approvals.approve(request, md, opts, cb));
  }

  /**
   * Denies one call awaiting approval (or approved and not yet claimed):
   * DENIED, the slot and the cost come back, nothing was sent, and the key
   * replays the denial with `reason` (at most 1024 bytes; empty: "denied").
   */
  deny(request: DenyRequest, options?: CallOptions): Promise<DenyResponse> {
    return this.unary(options, (md, opts, cb) => this.approvals.deny(request, md, opts, cb));
  }

  // === atmost.v1.Receipts ===

  /** The public keys that verify signed receipts (no API key needed). */
  getSigningKeys(options?: CallOptions): Promise<GetSigningKeysResponse> {
    return this.unary(options, (md, opts, cb) => this.receipts.getSigningKeys({}, md, opts, cb));
  }

  // === the guarded call ===

  /**
   * Runs one side-effecting call under atmost: Authorize (retried safely,
   * one holder token), `dispatch(attemptId, signal)` only on DISPATCH and
   * under a deadline, then Commit or MarkUncertain. README.md, "The guarded
   * call", says what each outcome raises.
   */
  guarded<T>(call: GuardedCall, dispatch: Dispatch<T>): Promise<GuardedOutcome<T>> {
    return runGuarded(this, call, dispatch);
  }

  /**
   * Commit NotSent for an attempt you hold and know was never sent: the
   * slot, the cost and the key come back. For the `attempt` of
   * {@link HeldByEarlierRun} when your own durable record says the earlier
   * run never sent it; anything less than that knowledge is
   * {@link Client.settleUncertain}. Retried like the guarded call's Commit
   * (5 tries, 10 s); resolves to the attempt as recorded, RELEASED.
   */
  async settleNotSent(attempt: Attempt): Promise<Attempt> {
    const { permitId, idempotencyKey, attemptId } = attempt;
    const done = await withRetries("Commit", DEFAULT_RETRY, isTransient, undefined, (leftMs) =>
      this.commit({ permitId, idempotencyKey, attemptId, notSent: {} }, { deadlineMs: Math.min(this.deadlineMs, leftMs) }),
    );
    return recorded(done.attempt, "Commit");
  }

  /**
   * MarkUncertain for an attempt you hold whose call may have gone out (the
   * `attempt` of {@link HeldByEarlierRun}, say): the slot and the cost stay
   * held, nothing is sent again, and an operator resolves it. `reason` is
   * cut to the 1024 bytes atmost keeps. Retried like the guarded call's
   * MarkUncertain; resolves to the attempt as recorded, UNCERTAIN.
   */
  async settleUncertain(attempt: Attempt, reason: string): Promise<Attempt> {
    const { permitId, idempotencyKey, attemptId } = attempt;
    const clipped = clip(reason);
    const done = await withRetries("MarkUncertain", DEFAULT_RETRY, isTransient, undefined, (leftMs) =>
      this.markUncertain({ permitId, idempotencyKey, attemptId, reason: clipped }, { deadlineMs: Math.min(this.deadlineMs, leftMs) }),
    );
    return recorded(done.attempt, "MarkUncertain");
  }

  private unary<T>(
    options: CallOptions | undefined,
    start: (metadata: grpc.Metadata, callOptions: grpc.CallOptions, callback: Callback<T>) => void,
  ): Promise<T> {
    const deadlineMs = options?.deadlineMs === undefined ? this.deadlineMs : checkDeadline(options.deadlineMs, "deadlineMs");
    const metadata = new grpc.Metadata();
    if (this.authorization !== undefined) metadata.set("authorization", this.authorization);
    return new Promise<T>((resolve, reject) => {
      start(metadata, { deadline: Date.now() + deadlineMs }, (error, value) => {
        if (error) reject(fromServiceError(error));
        else resolve(value as T);
      });
    });
  }
}

/** How a tool's calls wait for a person: {@link approvalRule}'s input. */
export interface ApprovalRuleOptions {
  /** Only calls whose cost is at least this (minor units) need approval; absent: every call. */
  costAtLeast?: number;
  /** How long a request may wait for its decision before it lapses as if denied; absent: the server's `--approval-wait-default`. */
  waitMs?: number;
  /** Distinct approvals needed: 1 (the default) or 2, a four-eyes rule (which needs keys). */
  approvers?: number;
}

/**
 * A permit's approval rule for one tool, for `approvalPerTool` in
 * {@link Client.createPermit}:
 * `{ approvalPerTool: { payout: approvalRule({ costAtLeast: 1000, waitMs: 600_000 }) } }`.
 */
export function approvalRule(options: ApprovalRuleOptions = {}): NewApprovalRule {
  const approvers = options.approvers ?? 1;
  if (!Number.isSafeInteger(approvers) || approvers < 0) throw new RangeError(`approvers must be 1 or 2, got ${String(approvers)}`);
  const rule: NewApprovalRule = { approvers };
  if (options.costAtLeast !== undefined) {
    if (!Number.isSafeInteger(options.costAtLeast) || options.costAtLeast < 0) {
      throw new RangeError(`costAtLeast must be an integer >= 0, got ${String(options.costAtLeast)}`);
    }
    rule.costAtLeast = options.costAtLeast;
  }
  if (options.waitMs !== undefined) rule.wait = durationOf(checkDeadline(options.waitMs, "waitMs"));
  return rule;
}

function recorded(attempt: Attempt | null, rpc: string): Attempt {
  if (attempt === null) throw new AtmostError(`${rpc} answered without the attempt`);
  return attempt;
}

function checkDeadline(value: number, name: string): number {
  if (typeof value !== "number" || !Number.isFinite(value) || value <= 0) {
    throw new RangeError(`${name} must be a finite number of milliseconds > 0, got ${String(value)}`);
  }
  return value;
}

function pem(value: Buffer | string | undefined, name: string): Buffer | undefined {
  if (value === undefined) return undefined;
  if (typeof value === "string") return Buffer.from(value, "utf8");
  if (Buffer.isBuffer(value)) return value;
  throw new TypeError(`tls.${name} must be PEM text (a string or a Buffer)`);
}

function channelCredentials(tls: TlsOptions | undefined): grpc.ChannelCredentials {
  if (tls === undefined) return grpc.credentials.createInsecure();
  const rootCa = pem(tls.rootCa, "rootCa");
  const cert = pem(tls.cert, "cert");
  const key = pem(tls.key, "key");
  if ((cert === undefined) !== (key === undefined)) {
    throw new TypeError("tls.cert and tls.key go together: give both for mTLS, or neither");
  }
  return grpc.credentials.createSsl(rootCa ?? null, key ?? null, cert ?? null);
}
