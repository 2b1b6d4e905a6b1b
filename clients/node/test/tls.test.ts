/**
 * TLS: the client trusts atmost's certificate through the CA given
 * (`tls.rootCa`), and presents a client certificate for mTLS, which atmost
 * maps to a tenant and roles (`[[cert]]` in the key file). The PKI is made
 * here with openssl, for 127.0.0.1.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, describe, test } from "node:test";
import { status as Code } from "@grpc/grpc-js";

import { Client, Denied, Unavailable } from "../src/index.js";
import { Atmost, FakeTool, Pki, createPermit, key, keyFile } from "./support.js";

const ADMIN = "node-client-tls-admin-key";
const RUNNER_SAN = "spiffe://test/ns/agents/sa/runner";

describe("TLS and client certificates", { timeout: 60_000 }, () => {
  let atmost: Atmost;
  let pki: Pki;
  let runner: { cert: string; key: string };
  let stranger: { cert: string; key: string };
  const clients: Client[] = [];
  const connect = (options: Partial<ConstructorParameters<typeof Client>[0]>) => {
    const client = atmost.client({ deadlineMs: 5_000, ...options });
    clients.push(client);
    return client;
  };

  before(async () => {
    pki = new Pki();
    const server = pki.issue("server", "DNS:localhost,IP:127.0.0.1", "serverAuth");
    runner = pki.issue("runner", `URI:${RUNNER_SAN}`, "clientAuth");
    stranger = pki.issue("stranger", "URI:spiffe://test/ns/agents/sa/stranger", "clientAuth");
    const keys = keyFile(
      [{ id: "admin", key: ADMIN, roles: ["admin"] }],
      `\n[[cert]]\nid = "runner"\nsan = "${RUNNER_SAN}"\ntenant = "test"\nroles = ["agent"]\n`,
    );
    atmost = await Atmost.start([
      "--auth-keys", keys,
      "--tls-cert", server.cert,
      "--tls-key", server.key,
      "--tls-client-ca", pki.caPem,
    ]);
  });
  after(async () => {
    for (const c of clients) c.close();
    await atmost?.stop();
  });

  test("over TLS with the CA: a key works, and a client certificate stands in for one (mTLS)", async () => {
    const ca = readFileSync(pki.caPem);
    const admin = connect({ apiKey: ADMIN, tls: { rootCa: ca, serverName: "localhost" } });
    const permit = await createPermit(admin, ["search"]);

    const agent = connect({
      tls: {
        rootCa: ca.toString("utf8"),
        cert: readFileSync(runner.cert),
        key: readFileSync(runner.key),
        serverName: "localhost",
      },
    });
    const tool = new FakeTool();
    const out = await agent.guarded(
      { permitId: permit.permitId, tool: "search", idempotencyKey: key("mtls"), request: { q: "tls" } },
      async (id) => {
        tool.hit(id);
        return "found";
      },
    );
    assert.equal(out.result, "found");
    assert.equal(tool.calls.length, 1);
  });

  test("a certificate the key file does not name is UNAUTHENTICATED", async () => {
    const ca = readFileSync(pki.caPem);
    const client = connect({
      tls: { rootCa: ca, cert: readFileSync(stranger.cert), key: readFileSync(stranger.key), serverName: "localhost" },
    });
    const error = await client.getPermit("01a22f97-50b2-7dfa-9a32-7b58c1d65b82").then(
      () => assert.fail("an unknown certificate was accepted"),
      (e: unknown) => e,
    );
    assert.ok(error instanceof Denied, String(error));
    assert.equal(error.reason, "UNAUTHENTICATED");
  });

  test("without the CA (or over plaintext) no call gets through", async () => {
    for (const client of [connect({ apiKey: ADMIN, tls: { serverName: "localhost" } }), connect({ apiKey: ADMIN })]) {
      const error = await client.getPermit("01a22f97-50b2-7dfa-9a32-7b58c1d65b82").then(
        () => assert.fail("the call got through"),
        (e: unknown) => e,
      );
      assert.ok(error instanceof Unavailable, String(error));
      assert.equal(error.code, Code.UNAVAILABLE);
      assert.equal(error.reason, undefined, "atmost never answered");
    }
  });

  test("a client certificate without its key is refused before connecting", () => {
    assert.throws(
      () => new Client({ address: atmost.address, tls: { cert: readFileSync(runner.cert) } }),
      /tls.cert and tls.key go together/,
    );
  });
});
