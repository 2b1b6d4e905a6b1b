/**
 * The Node runner of the cross-client test (scripts/cross_client.sh): each
 * situation of clients/testdata/guarded_situations.json through the
 * package's public `client.guarded`, one JSON line per situation on stdout:
 * what each call returned or raised, and how many times it ran dispatch.
 * The harness (examples/cross_client.rs) compares the lines with the file's
 * expectations and with the Rust and Python runners'. Not a test file
 * (test.sh runs dist/test/*.test.js); built with the package:
 *
 *   node dist/test/situations-runner.js <guarded_situations.json> <facts.json>
 *
 * `facts.json`: `address`, `api_key`, `wrong_api_key`,
 * `unreachable_address`, and `permits` (situation name -> the permit id the
 * harness made for this language).
 *
 * What the package may not export yet (InvalidRequest, withActualCost) is
 * looked up by name at run time, so that this file builds either way: a
 * missing withActualCost is reported as `unsupported`, a missing class is
 * simply never the kind.
 */
import { readFileSync } from "node:fs";

import * as atmost from "../src/index.js";

const LANGUAGE = "node";
const pkg = atmost as unknown as Record<string, unknown>;

type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

interface Facts {
  address: string;
  api_key: string;
  wrong_api_key: string;
  unreachable_address: string;
  permits: Record<string, string>;
}

interface DispatchSpec {
  return?: Json;
  actual_cost?: number;
  refuse?: string;
  not_sent?: boolean;
  error?: string;
  hang?: boolean;
}

interface Call {
  key: string;
  request: string;
  cost?: number;
  tool?: string;
  api_key?: string;
  server?: string;
  dispatch?: DispatchSpec;
}

interface Situation {
  name: string;
  languages?: string[];
  calls: Call[];
}

const NON_FINITE: Record<string, number> = { $NaN: NaN, $Infinity: Infinity, "$-Infinity": -Infinity };

/** A parsed JSON value with "$NaN", "$Infinity" and "$-Infinity" made the numbers they name. */
function native(value: Json): unknown {
  if (typeof value === "string") return value in NON_FINITE ? NON_FINITE[value] : value;
  if (Array.isArray(value)) return value.map(native);
  if (value !== null && typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, native(v)]));
  }
  return value;
}

/** `value` as JSON can print it: bytes as the JSON they hold (else their text), a non-finite number as its marker. */
function portable(value: unknown): Json {
  if (value instanceof Uint8Array) {
    const text = Buffer.from(value).toString("utf8");
    try {
      return JSON.parse(text) as Json;
    } catch {
      return { $bytes: text };
    }
  }
  if (typeof value === "number") {
    if (Number.isNaN(value)) return "$NaN";
    if (!Number.isFinite(value)) return value > 0 ? "$Infinity" : "$-Infinity";
    return value;
  }
  if (value === null || value === undefined) return null;
  if (typeof value === "boolean" || typeof value === "string") return value;
  if (Array.isArray(value)) return value.map(portable);
  if (typeof value === "object") {
    return Object.fromEntries(Object.entries(value as Record<string, unknown>).map(([k, v]) => [k, portable(v)]));
  }
  return { $node: String(value) };
}

/** The kind's name the situations file uses (the most specific class first). */
function kind(error: unknown): string {
  for (const [cls, name] of [
    ["CommitNotRecorded", "CommitNotRecorded"],
    ["HeldByEarlierRun", "HeldByEarlierRun"],
    ["OutcomeUncertain", "OutcomeUncertain"],
    ["NotSent", "NotSent"],
    ["ToolFailed", "ToolFailed"],
    ["InProgress", "InProgress"],
    ["Unavailable", "Unavailable"],
    ["InvalidRequest", "InvalidRequest"],
    ["Denied", "Denied"],
    ["AtmostError", "Rpc"],
  ] as const) {
    const ctor = pkg[cls];
    if (typeof ctor === "function" && error instanceof (ctor as new (...args: never[]) => unknown)) return name;
  }
  if (error instanceof TypeError) return "invalid-argument";
  return `other:${error instanceof Error ? error.name : typeof error}`;
}

async function runCall(facts: Facts, tool: string, permitId: string, call: Call): Promise<Record<string, unknown>> {
  const spec = call.dispatch;
  const withActualCost = pkg.withActualCost;
  if (spec?.actual_cost !== undefined && typeof withActualCost !== "function") {
    return { kind: "unsupported", message: "the package exports no withActualCost", dispatched: 0 };
  }
  const client = new atmost.Client({
    address: call.server === "unreachable" ? facts.unreachable_address : facts.address,
    apiKey: call.api_key === "wrong" ? facts.wrong_api_key : facts.api_key,
  });
  let dispatched = 0;
  const returned: unknown[] = [];
  const result = (): unknown => {
    const value = spec === undefined ? { sent: "by mistake" } : native(spec.return ?? null);
    returned.push(value);
    return value;
  };
  const dispatch = async (): Promise<unknown> => {
    dispatched += 1;
    if (spec === undefined) return result();
    if (spec.refuse !== undefined) throw new atmost.ToolFailed(spec.refuse);
    if (spec.not_sent) throw new atmost.NotSent("the runner's dispatch never sent it");
    if (spec.error !== undefined) throw Object.assign(new Error(spec.error), { code: "ECONNRESET" });
    if (spec.hang) await new Promise<never>(() => {});
    const value = result();
    return spec.actual_cost === undefined ? value : (withActualCost as (r: unknown, c: number) => unknown)(value, spec.actual_cost);
  };
  try {
    const outcome = await client.guarded(
      {
        permitId,
        tool: call.tool ?? tool,
        idempotencyKey: call.key,
        request: native(JSON.parse(call.request) as Json),
        cost: call.cost ?? 0,
      },
      dispatch,
    );
    return {
      kind: "none",
      reason: null,
      replayed: outcome.replayed,
      dispatched,
      result: portable(outcome.result),
      as_dispatched: !outcome.replayed && returned.length > 0 && outcome.result === returned[0],
      receipt_cost: outcome.receipt.cost,
    };
  } catch (error) {
    return observedError(error, dispatched, returned);
  } finally {
    client.close();
  }
}

function observedError(error: unknown, dispatched: number, returned: unknown[]): Record<string, unknown> {
  const e = error as { reason?: string; replayed?: boolean; cause?: { reason?: string }; name?: string; message?: string };
  const seen: Record<string, unknown> = {
    kind: kind(error),
    reason: e?.reason ?? (error instanceof atmost.CommitNotRecorded ? (e.cause?.reason ?? null) : null),
    replayed: e?.replayed === true,
    dispatched,
    message: error instanceof Error ? `${error.name}: ${error.message}` : String(error),
  };
  if (error instanceof atmost.ToolFailed) seen.failure_reason = error.failureReason;
  if (error instanceof atmost.CommitNotRecorded) {
    seen.unrecorded = String(error.outcome).toUpperCase();
    if (error.result !== undefined) {
      seen.result = portable(error.result);
      seen.as_dispatched = returned.length > 0 && error.result === returned[0];
    }
  }
  return seen;
}

async function main(args: string[]): Promise<number> {
  if (args.length !== 2) {
    console.error("usage: situations-runner.js <guarded_situations.json> <facts.json>");
    return 2;
  }
  const file = JSON.parse(readFileSync(args[0], "utf8")) as { tool: string; situations: Situation[] };
  const facts = JSON.parse(readFileSync(args[1], "utf8")) as Facts;
  for (const situation of file.situations) {
    if (!(situation.languages ?? [LANGUAGE]).includes(LANGUAGE)) continue;
    const permitId = facts.permits[situation.name];
    if (permitId === undefined) throw new Error(`facts name no permit for ${situation.name}`);
    const calls: Record<string, unknown>[] = [];
    for (const call of situation.calls) {
      // The calls after one this language cannot make depend on it.
      if (calls.at(-1)?.kind === "unsupported") {
        calls.push({ kind: "unsupported", message: "an earlier call was not made", dispatched: 0 });
      } else {
        calls.push(await runCall(facts, file.tool, permitId, call));
      }
    }
    process.stdout.write(`${JSON.stringify({ situation: situation.name, language: LANGUAGE, calls })}\n`);
  }
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
