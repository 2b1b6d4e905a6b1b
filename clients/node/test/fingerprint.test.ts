/**
 * The fingerprint helper reproduces every vector of
 * clients/testdata/fingerprint_vectors.json (made with Python's rfc8785,
 * not with this code): each input parsed by JSON.parse, then canonicalized
 * and hashed.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { canonicalJson, fingerprint } from "../src/index.js";
import { REPO_ROOT } from "./support.js";

interface Vector {
  name: string;
  json: string;
  canonical: string;
  sha256: string;
}

const file = join(REPO_ROOT, "clients", "testdata", "fingerprint_vectors.json");
const vectors = (JSON.parse(readFileSync(file, "utf8")) as { vectors: Vector[] }).vectors;

test("the vector file has vectors", () => {
  // Guards the loop below from passing on an empty or renamed list.
  assert.ok(vectors.length >= 10, `${vectors.length} vectors in ${file}`);
});

for (const v of vectors) {
  test(`fingerprint vector: ${v.name}`, () => {
    const value: unknown = JSON.parse(v.json);
    assert.equal(canonicalJson(value), v.canonical);
    const digest = fingerprint(value);
    assert.equal(digest.length, 32);
    assert.equal(digest.toString("hex"), v.sha256);
  });
}

test("a value JSON cannot represent is refused, not fingerprinted", () => {
  for (const bad of [undefined, () => 1, 1n, Number.NaN, Infinity, "\ud800"]) {
    assert.throws(() => fingerprint(bad), TypeError, String(bad));
  }
  const cycle: Record<string, unknown> = {};
  cycle.self = cycle;
  assert.throws(() => fingerprint(cycle), TypeError);
});
