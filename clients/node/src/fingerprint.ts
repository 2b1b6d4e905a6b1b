/**
 * The request fingerprint every atmost client computes the same way:
 * SHA-256 of the RFC 8785 (JSON Canonicalization Scheme) text of the
 * request, in UTF-8. Canonical JSON comes from `canonicalize`, by the RFC's
 * author; clients/testdata/fingerprint_vectors.json holds the vectors the
 * Rust, Python and TypeScript helpers must all reproduce.
 */
import { createHash } from "node:crypto";
import canonicalize from "canonicalize";

/**
 * The RFC 8785 canonical JSON text of `value`. Throws a TypeError for a
 * value JSON cannot represent (undefined, a function, a BigInt, NaN or an
 * infinity, a lone surrogate, a cycle).
 */
export function canonicalJson(value: unknown): string {
  let text: string | undefined;
  try {
    text = canonicalize(value);
  } catch (error) {
    throw new TypeError(`not a JSON value: ${(error as Error).message}`, { cause: error });
  }
  if (text === undefined) throw new TypeError(`not a JSON value: ${typeof value}`);
  return text;
}

/** SHA-256 of the canonical JSON of `value`: 32 bytes. */
export function fingerprint(value: unknown): Buffer {
  return createHash("sha256").update(canonicalJson(value), "utf8").digest();
}
