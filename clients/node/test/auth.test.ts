/**
 * Bearer keys (atmost with --auth-keys): the key goes as
 * `authorization: Bearer <key>` on every call; a wrong one is the typed
 * UNAUTHENTICATED error and is never retried.
 */
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";

import { Client, Denied, type RetryEvent } from "../src/index.js";
import { Atmost, FakeTool, createPermit, key, keyFile } from "./support.js";

const ADMIN = "node-client-admin-key";
const AGENT = "node-client-agent-key";

describe("bearer key authentication", { timeout: 60_000 }, () => {
  let atmost: Atmost;
  const clients: Client[] = [];
  const connect = (apiKey?: string) => {
    const client = atmost.client(apiKey === undefined ? {} : { apiKey });
    clients.push(client);
    return client;
  };

  before(async () => {
    const keys = keyFile([
      { id: "admin", key: ADMIN, roles: ["admin"] },
      { id: "agent", key: AGENT, roles: ["agent"] },
    ]);
    atmost = await Atmost.start(["--auth-keys", keys]);
  });
  after(async () => {
    for (const c of clients) c.close();
    await atmost?.stop();
  });

  test("the right keys work: admin creates a permit, the agent's guarded call dispatches", async () => {
    const permit = await createPermit(connect(ADMIN), ["search"]);
    assert.equal(permit.tenant, "test");
    const tool = new FakeTool();
    const out = await connect(AGENT).guarded(
      { permitId: permit.permitId, tool: "search", idempotencyKey: key("auth"), request: { q: "atmost" } },
      async (id) => {
        tool.hit(id);
        return ["result"];
      },
    );
    assert.deepEqual(out.result, ["result"]);
    assert.equal(tool.calls.length, 1);
  });

  test("a wrong key raises UNAUTHENTICATED at once, never retried, nothing dispatched", async () => {
    const permit = await createPermit(connect(ADMIN), ["search"]);
    for (const client of [connect("not-a-key-atmost-knows"), connect()]) {
      const tool = new FakeTool();
      const retries: RetryEvent[] = [];
      const error = await client
        .guarded(
          {
            permitId: permit.permitId,
            tool: "search",
            idempotencyKey: key("wrong"),
            request: { q: "atmost" },
            onRetry: (e) => retries.push(e),
          },
          async (id) => tool.hit(id),
        )
        .then(
          () => assert.fail("a wrong key was accepted"),
          (e: unknown) => e,
        );
      assert.ok(error instanceof Denied, String(error));
      assert.equal(error.code, Code.UNAUTHENTICATED);
      assert.equal(error.reason, "UNAUTHENTICATED");
      assert.deepEqual(retries, []);
      assert.equal(tool.calls.length, 0);
    }
  });

  test("a key without the RPC's role is ROLE_NOT_ALLOWED, with its metadata", async () => {
    const error = await createPermit(connect(AGENT), ["search"]).then(
      () => assert.fail("an agent key created a permit"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof Denied, String(error));
    assert.equal(error.code, Code.PERMISSION_DENIED);
    assert.equal(error.reason, "ROLE_NOT_ALLOWED");
    assert.equal(error.metadata.key_id, "agent");
    assert.equal(error.metadata.rpc, "atmost.v1.Permits/CreatePermit");
  });

  test("an API key that cannot be a header value is refused before connecting", () => {
    for (const apiKey of ["", "two words", "line\nbreak", "é"]) {
      assert.throws(() => new Client({ address: atmost.address, apiKey }), /apiKey must be/, JSON.stringify(apiKey));
    }
  });
});
