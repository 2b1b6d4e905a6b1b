// Copies the wire contract, ../../proto/atmost/v1/*.proto, into this
// package's proto/ (the files the client loads at run time and ships).
// Run after any change to the contract: `npm run sync-proto`. The drift test
// (test/proto.test.ts) fails while the two differ.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkg = join(dirname(fileURLToPath(import.meta.url)), "..");
const from = join(pkg, "..", "..", "proto", "atmost", "v1");
const to = join(pkg, "proto", "atmost", "v1");

const names = readdirSync(from).filter((n) => n.endsWith(".proto"));
if (names.length === 0) {
  console.error(`sync-proto: no .proto files in ${from}`);
  process.exit(1);
}
// Whole-directory replacement, so a file removed from the contract goes too.
rmSync(to, { recursive: true, force: true });
mkdirSync(to, { recursive: true });
for (const name of names) copyFileSync(join(from, name), join(to, name));
console.log(`sync-proto: ${names.length} files from ${from}`);
