/**
 * The request fingerprint every atmost client computes the same way:
 * SHA-256 of the RFC 8785 (JSON Canonicalization Scheme) text of the
 * request, in UTF-8. Canonical JSON comes from `canonicalize`, by the RFC's
 * author; clients/testdata/fingerprint_vectors.json holds the vectors the
 * Rust, Python and TypeScript helpers must all reproduce, and the requests
 * they all refuse.
 *
 * The request is checked first, whole, here: `canonicalize` alone writes a
 * nested Map or Set as `{}` (two different requests, one fingerprint), a
 * sparse array as invalid text, and any double as itself, so 2^53 and
 * 2^53 + 1 would share a fingerprint.
 */
import { createHash } from "node:crypto";
import canonicalize from "canonicalize";

/**
 * The largest magnitude a number in a fingerprinted request may have:
 * 2^53 - 1. Past it doubles no longer hold every integer, so two different
 * requests (9007199254740993 and 9007199254740992) would share a
 * fingerprint. Send such a number as a string.
 */
export const MAX_SAFE_NUMBER = Number.MAX_SAFE_INTEGER;

/**
 * A request that has no fingerprint: it holds something JSON cannot carry
 * exactly. `path` is where, as a JSON Pointer (RFC 6901; `""` is the whole
 * request), `why` what is there. A TypeError, thrown before any RPC.
 */
export class FingerprintError extends TypeError {
  readonly path: string;
  readonly why: string;

  constructor(path: string, why: string) {
    super(`not a JSON value the fingerprint can take, at ${path === "" ? 'the whole request (JSON Pointer "")' : path}: ${why}`);
    this.name = "FingerprintError";
    this.path = path;
    this.why = why;
  }
}

/**
 * The RFC 8785 canonical JSON text of `value`, read as JSON.stringify reads
 * it: a `toJSON()` method is called (with the key, as JSON.stringify calls
 * it) and its answer taken instead (a Date is its ISO text), boxed
 * primitives are unwrapped, and an object property whose value is
 * `undefined` is left out. Throws a {@link FingerprintError} (a TypeError)
 * naming where, for a number outside ±(2^53-1), NaN, an infinity, and
 * every value with no JSON form at any depth: a BigInt, a function, a
 * symbol, `undefined` in an array or as the whole value, a hole of a
 * sparse array, a Map, a Set, any other object that is not a plain object
 * or an array and has no toJSON, a cycle, a lone surrogate.
 */
export function canonicalJson(value: unknown): string {
  const plain = jsonValue(value, "", "", new Set());
  if (plain === OMIT) throw new FingerprintError("", describeAbsent(value));
  return canonicalize(plain) as string;
}

/** SHA-256 of the canonical JSON of `value`: 32 bytes. */
export function fingerprint(value: unknown): Buffer {
  return createHash("sha256").update(canonicalJson(value), "utf8").digest();
}

/** What JSON.stringify leaves out (undefined, from a toJSON too); refused anywhere but as a property's value. */
const OMIT: unique symbol = Symbol("omit");

type Plain = null | boolean | number | string | Plain[] | { [key: string]: Plain };

/**
 * `value` (at `path`, under the property or index `key`) as a plain JSON
 * value, or {@link OMIT} for undefined; throws a FingerprintError for
 * anything JSON cannot carry exactly. `ancestors` are the objects being
 * read around it, for cycles.
 */
function jsonValue(value: unknown, key: string, path: string, ancestors: Set<object>): Plain | typeof OMIT {
  if ((typeof value === "object" && value !== null) || typeof value === "function") {
    const toJSON = (value as { toJSON?: unknown }).toJSON;
    if (typeof toJSON === "function") value = toJSON.call(value, key);
  }
  // Boxed primitives, unwrapped as JSON.stringify unwraps them.
  if (value instanceof Number || value instanceof String || value instanceof Boolean) value = value.valueOf();
  switch (typeof value) {
    case "undefined":
      return OMIT;
    case "boolean":
      return value;
    case "string":
      if (loneSurrogate(value)) throw new FingerprintError(path, "a string with a lone surrogate has no UTF-8 form");
      return value;
    case "number":
      if (!Number.isFinite(value)) throw new FingerprintError(path, `${value} has no JSON form (NaN and the infinities)`);
      if (Math.abs(value) > MAX_SAFE_NUMBER) {
        throw new FingerprintError(path, `${value} is outside ±(2^53-1), where JSON numbers stop being exact: send it as a string`);
      }
      return value;
    case "bigint":
      throw new FingerprintError(path, `the BigInt ${value}n has no JSON form: send it as a string`);
    case "symbol":
      throw new FingerprintError(path, "a symbol has no JSON form");
    case "function":
      throw new FingerprintError(path, "a function has no JSON form");
  }
  if (value === null) return null;
  const object = value as object;
  if (ancestors.has(object)) throw new FingerprintError(path, "a cycle: the value contains itself");
  ancestors.add(object);
  try {
    if (Array.isArray(object)) {
      const items: Plain[] = [];
      for (let i = 0; i < object.length; i++) {
        const at = `${path}/${i}`;
        if (!(i in object)) throw new FingerprintError(at, "a hole of a sparse array has no JSON form");
        const item = jsonValue(object[i], String(i), at, ancestors);
        if (item === OMIT) throw new FingerprintError(at, describeAbsent(object[i]));
        items.push(item);
      }
      return items;
    }
    const proto: unknown = Object.getPrototypeOf(object);
    if (proto !== Object.prototype && proto !== null) throw new FingerprintError(path, notPlain(object));
    // A null prototype, so that a "__proto__" key stays a key.
    const fields: { [key: string]: Plain } = Object.create(null);
    for (const name of Object.keys(object)) {
      const at = `${path}/${name.replaceAll("~", "~0").replaceAll("/", "~1")}`;
      if (loneSurrogate(name)) throw new FingerprintError(at, "a key with a lone surrogate has no UTF-8 form");
      const field = jsonValue((object as Record<string, unknown>)[name], name, at, ancestors);
      if (field !== OMIT) fields[name] = field;
    }
    return fields;
  } finally {
    ancestors.delete(object);
  }
}

/** Why an undefined (or a toJSON's undefined) is refused where it stands. */
function describeAbsent(original: unknown): string {
  return original === undefined
    ? "undefined has no JSON form (in an array or as the whole request; an object property that is undefined is left out)"
    : "its toJSON() returned undefined, which has no JSON form here";
}

function notPlain(object: object): string {
  if (object instanceof Map) return "a Map has no JSON form: make it a plain object";
  if (object instanceof Set) return "a Set has no JSON form: make it an array";
  const name = (object as { constructor?: { name?: unknown } }).constructor?.name;
  return `${typeof name === "string" && name !== "" ? `a ${name}` : "an object"} is not a plain object or an array and has no toJSON(), so it has no JSON form`;
}

/** Whether `text` holds a surrogate not part of a pair (in `u` mode a pair is one code point, so only a lone one matches). */
function loneSurrogate(text: string): boolean {
  return /[\ud800-\udfff]/u.test(text);
}
