/**
 * The README's example is examples/charge.ts, word for word, and it works:
 * run against a live atmost with a fake wallet, the same order charges
 * once, and a second order past the cap is refused.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import { chargeOrder, type Wallet } from "../examples/charge.js";
import type { Client } from "../src/index.js";
import { Atmost, PACKAGE_DIR, createPermit } from "./support.js";

test("README.md shows examples/charge.ts as it is", () => {
  const readme = readFileSync(join(PACKAGE_DIR, "README.md"), "utf8");
  const example = readFileSync(join(PACKAGE_DIR, "examples", "charge.ts"), "utf8");
  assert.ok(readme.includes("```ts\n" + example + "```\n"), "the README's example block differs from examples/charge.ts");
});

describe("the README's example against atmost", { timeout: 60_000 }, () => {
  let atmost: Atmost;
  let client: Client;
  before(async () => {
    atmost = await Atmost.start();
    client = atmost.client();
  });
  after(async () => {
    client?.close();
    await atmost?.stop();
  });

  test("an order charges once however often it is retried; a second order is refused by the cap", async () => {
    const permit = await createPermit(client, ["wallet.charge"], { "wallet.charge": 1 }, { budget: 500 });
    const charges: string[] = [];
    const wallet: Wallet = {
      async charge({ idempotencyKey }) {
        charges.push(idempotencyKey);
        return { tx: `tx-${charges.length}` };
      },
    };
    assert.equal(await chargeOrder(client, permit.permitId, wallet, "1234"), "tx-1");
    assert.equal(await chargeOrder(client, permit.permitId, wallet, "1234"), "tx-1", "the retry replays");
    assert.equal(await chargeOrder(client, permit.permitId, wallet, "5678"), "refused: PERMIT_MAX_CALLS_EXCEEDED");
    assert.equal(charges.length, 1);
  });
});
