// Copies the wire contract, ../../proto/atmost/v1/*.proto, and the
// googleapis protos it imports or its errors carry (../../proto/google/api,
// ../../proto/google/rpc), into this package's proto/ (the files the client
// loads at run time and ships). Run after any change to the contract:
// `npm run sync-proto`. The drift test (test/proto.test.ts) fails while the
// two differ.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

// test/proto.test.ts names the same folders.
const SYNCED_DIRS = ["atmost/v1", "google/api", "google/rpc"];

const pkg = join(dirname(fileURLToPath(import.meta.url)), "..");
const repo = join(pkg, "..", "..", "proto");

let copied = 0;
for (const dir of SYNCED_DIRS) {
  const from = join(repo, dir);
  const to = join(pkg, "proto", dir);
  const names = readdirSync(from).filter((n) => n.endsWith(".proto"));
  if (names.length === 0) {
    console.error(`sync-proto: no .proto files in ${from}`);
    process.exit(1);
  }
  // Whole-directory replacement, so a file removed from the contract goes too.
  rmSync(to, { recursive: true, force: true });
  mkdirSync(to, { recursive: true });
  for (const name of names) copyFileSync(join(from, name), join(to, name));
  copied += names.length;
}
console.log(`sync-proto: ${copied} files from ${repo}`);
