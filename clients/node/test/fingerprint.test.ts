/**
 * The fingerprint helper reproduces every vector of
 * clients/testdata/fingerprint_vectors.json (made with Python's rfc8785,
 * not with this code): each input parsed by JSON.parse, then canonicalized
 * and hashed; it refuses every request the file lists as refused, every
 * value it names that no JSON holds (built here as JavaScript values), and
 * the values only JavaScript has, with a TypeError naming where.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { FingerprintError, canonicalJson, fingerprint } from "../src/index.js";
import { REPO_ROOT } from "./support.js";

interface Vector {
  name: string;
  json: string;
  canonical: string;
  sha256: string;
}

interface Refused {
  name: string;
  json: string;
  path: string;
}

const file = join(REPO_ROOT, "clients", "testdata", "fingerprint_vectors.json");
const shared = JSON.parse(readFileSync(file, "utf8")) as { vectors: Vector[]; refused: Refused[]; not_json: { name: string }[] };
const vectors = shared.vectors;

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

/** Asserts that `value` is refused with a TypeError naming `path`, and returns it. */
function refusedAt(value: unknown, path: string, label: string): FingerprintError {
  let thrown: unknown;
  try {
    canonicalJson(value);
  } catch (error) {
    thrown = error;
  }
  assert.ok(thrown instanceof TypeError, `${label}: refused with a TypeError, got ${String(thrown)}`);
  assert.ok(thrown instanceof FingerprintError, `${label}: ${String(thrown)}`);
  assert.equal(thrown.path, path, `${label}: ${thrown.message}`);
  assert.ok(thrown.message.includes(path === "" ? 'JSON Pointer ""' : `at ${path}:`), `${label}: the message names ${JSON.stringify(path)}: ${thrown.message}`);
  assert.throws(() => fingerprint(value), FingerprintError, label);
  return thrown;
}

test("the vector file lists refusals and values no JSON holds", () => {
  assert.ok(shared.refused.length >= 7, `${shared.refused.length} refusals in ${file}`);
  assert.ok(shared.not_json.length >= 4, `${shared.not_json.length} not_json values in ${file}`);
});

for (const r of shared.refused) {
  test(`refused vector: ${r.name}`, () => {
    const error = refusedAt(JSON.parse(r.json), r.path, r.name);
    assert.match(error.why, /2\^53/, r.name);
  });
}

/** Each not_json name of the shared file, built as a JavaScript value. */
const NOT_JSON: Record<string, unknown> = {
  NaN: Number.NaN,
  Infinity: { x: Infinity },
  "-Infinity": [1, -Infinity],
  "NaN at depth": { z: [{ b: Number.NaN }] },
};
const NOT_JSON_PATH: Record<string, string> = { NaN: "", Infinity: "/x", "-Infinity": "/1", "NaN at depth": "/z/0/b" };

for (const { name } of shared.not_json) {
  test(`not_json value: ${name}`, () => {
    assert.ok(Object.hasOwn(NOT_JSON, name), `no JavaScript value for the shared case ${JSON.stringify(name)}: add one`);
    const error = refusedAt(NOT_JSON[name], NOT_JSON_PATH[name], name);
    assert.match(error.why, /NaN|Infinity/, name);
  });
}

test("numbers past ±(2^53-1) are refused wherever they are, the largest safe ones are taken", () => {
  for (const n of [2 ** 53, -(2 ** 53), 1e21, 1e30, Number.MAX_VALUE]) refusedAt({ a: [{ n }] }, "/a/0/n", String(n));
  for (const n of [Number.MAX_SAFE_INTEGER, -Number.MAX_SAFE_INTEGER, 4503599627370495.5, 5e-324, -0]) {
    assert.doesNotThrow(() => fingerprint([n]), String(n));
  }
});

test("values with no JSON form are refused at any depth, naming where, before canonicalize writes them", () => {
  const sparse = [1, , 3]; // eslint-disable-line no-sparse-arrays
  const cycle: Record<string, unknown> = { a: 1 };
  cycle.self = { back: cycle };
  class Point {
    constructor(
      readonly x: number,
      readonly y: number,
    ) {}
  }
  const cases: [string, unknown, string][] = [
    ["a Map", { m: new Map([["a", 1]]) }, "/m"],
    ["a Set", [new Set([1])], "/0"],
    ["a function", { f: () => 1 }, "/f"],
    ["a function as the whole value", () => 1, ""],
    ["a symbol", { s: [Symbol("s")] }, "/s/0"],
    ["a BigInt", { amount: 500n }, "/amount"],
    ["a BigInt as the whole value", 1n, ""],
    ["undefined in an array", [1, undefined], "/1"],
    ["undefined as the whole value", undefined, ""],
    ["a sparse array's hole", { list: sparse }, "/list/1"],
    ["a class instance without toJSON", { at: new Point(1, 2) }, "/at"],
    ["a typed array", { bytes: new Uint8Array([1]) }, "/bytes"],
    ["a regular expression", [/x/], "/0"],
    ["a cycle", cycle, "/self/back"],
    ["a toJSON that returns undefined, in an array", [{ toJSON: () => undefined }], "/0"],
    ["a lone surrogate", { s: "\ud800" }, "/s"],
    ["a lone surrogate in a key", { ["k\udc00"]: 1 }, "/k\udc00"],
    ["keys escaped as RFC 6901 says", { "a/b": { "m~n": [Number.NaN] } }, "/a~1b/m~0n/0"],
  ];
  for (const [name, value, path] of cases) refusedAt(value, path, name);
});

test("values with toJSON are taken as it returns them, and undefined properties are left out, as JSON.stringify does", () => {
  const at = new Date(Date.UTC(2026, 0, 2, 3, 4, 5));
  assert.equal(canonicalJson({ at }), JSON.stringify({ at: at.toISOString() }));
  assert.deepEqual(fingerprint([at]), fingerprint([at.toISOString()]));
  // toJSON gets the key, as JSON.stringify gives it; what it returns is read on.
  const keyed = { toJSON: (key: string) => ({ key, n: 2 }) };
  assert.equal(canonicalJson({ b: keyed, a: [keyed] }), '{"a":[{"key":"0","n":2}],"b":{"key":"b","n":2}}');
  assert.throws(() => canonicalJson({ x: { toJSON: () => ({ big: 2 ** 60 }) } }), (e: unknown) => e instanceof FingerprintError && e.path === "/x/big");
  assert.equal(canonicalJson({ a: 1, b: undefined, c: { d: undefined } }), '{"a":1,"c":{}}');
  assert.deepEqual(fingerprint({ a: 1, b: undefined }), fingerprint({ a: 1 }));
  // Boxed primitives are their values; a "__proto__" key stays a key; the same object twice is no cycle.
  assert.equal(canonicalJson([new Number(5), new String("s"), new Boolean(false)]), '[5,"s",false]');
  assert.equal(canonicalJson(JSON.parse('{"__proto__": {"x": 1}}')), '{"__proto__":{"x":1}}');
  const shared = { n: 1 };
  assert.equal(canonicalJson({ a: shared, b: [shared] }), '{"a":{"n":1},"b":[{"n":1}]}');
  assert.equal(canonicalJson(Object.assign(Object.create(null), { z: 1, y: 2 })), '{"y":2,"z":1}');
});
