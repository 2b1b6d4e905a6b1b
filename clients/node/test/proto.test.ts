/**
 * The .proto files this package ships are the repo's contract, byte for
 * byte (`npm run sync-proto` copies them), and the vendored googleapis
 * files keep their license header.
 */
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { PROTO_DIR } from "../src/index.js";
import { PACKAGE_DIR, REPO_ROOT } from "./support.js";

/** The folders of the repo's proto/ that scripts/sync-proto.mjs copies. */
const SYNCED_DIRS = ["atmost/v1", "google/api", "google/rpc"];

test("the package loads its protos from its own proto/", () => {
  assert.equal(PROTO_DIR, join(PACKAGE_DIR, "proto"));
});

for (const dir of SYNCED_DIRS) {
  test(`proto/${dir} is the repo's proto/${dir}: no drift (npm run sync-proto)`, () => {
    const repo = join(REPO_ROOT, "proto", dir);
    const ours = join(PACKAGE_DIR, "proto", dir);
    const names = (d: string) => readdirSync(d).filter((n) => n.endsWith(".proto")).sort();
    const repoNames = names(repo);
    assert.ok(repoNames.length > 0, `no .proto files in ${repo}`);
    assert.deepEqual(names(ours), repoNames, "the same files");
    for (const name of repoNames) {
      assert.ok(
        readFileSync(join(ours, name)).equals(readFileSync(join(repo, name))),
        `${dir}/${name} differs from the repo's: run npm run sync-proto`,
      );
    }
  });
}

test("the vendored google/rpc protos keep googleapis' license header", () => {
  for (const name of ["status.proto", "error_details.proto"]) {
    const text = readFileSync(join(PACKAGE_DIR, "proto", "google", "rpc", name), "utf8");
    assert.match(text, /^\/\/ Copyright \d{4} Google LLC\n/, name);
    assert.match(text, /Licensed under the Apache License, Version 2\.0/, name);
  }
});
