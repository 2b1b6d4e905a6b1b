/**
 * What the tests share: a real atmost process per test file (or per test),
 * started from ATMOST_BIN on a free loopback port and always killed, a
 * redis-server that can be stopped under it, and small helpers (a permit, a
 * throwaway PKI made with openssl).
 */
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { createHash, randomUUID } from "node:crypto";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { connect, createServer, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import { Client, type ClientOptions, type NewPermit, type Permit } from "../src/index.js";

/** clients/node/ (this file runs from clients/node/dist/test/). */
export const PACKAGE_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const REPO_ROOT = resolve(PACKAGE_DIR, "..", "..");

/** The atmost binary: $ATMOST_BIN, else the debug build under $CARGO_TARGET_DIR (default target/) of the repo. */
export function atmostBin(): string {
  const bin = process.env.ATMOST_BIN
    ? resolve(process.env.ATMOST_BIN)
    : resolve(REPO_ROOT, process.env.CARGO_TARGET_DIR ?? "target", "debug", "atmost");
  if (!existsSync(bin)) {
    throw new Error(`no atmost binary at ${bin}: build it (cargo build -p atmost --bin atmost) or set ATMOST_BIN`);
  }
  return bin;
}

const running = new Set<ChildProcess>();
const scratch = new Set<string>();

function cleanUp(): void {
  for (const child of running) child.kill("SIGKILL");
  running.clear();
  for (const dir of scratch) rmSync(dir, { recursive: true, force: true });
  scratch.clear();
}
// Whatever ends the test process, the servers it started end with it.
process.on("exit", cleanUp);
for (const signal of ["SIGINT", "SIGTERM"] as const) {
  process.on(signal, () => {
    cleanUp();
    process.exit(1);
  });
}

/** A directory removed when the test process exits. */
export function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), "atmost-node-client-"));
  scratch.add(dir);
  return dir;
}

/** One running `atmost serve`. */
export class Atmost {
  private constructor(
    readonly process: ChildProcess,
    /** `host:port` from its `atmost listening on ADDR` line. */
    readonly address: string,
  ) {}

  /**
   * Starts atmost with the memory store on `listen` (default a free port
   * the server picks) and waits for its listening line.
   */
  static async start(args: string[] = [], listen = "127.0.0.1:0"): Promise<Atmost> {
    const child = spawn(atmostBin(), ["serve", "--listen", listen, ...args], {
      stdio: ["ignore", "pipe", "pipe"],
      // No audit trail in the captured stderr (nothing here reads it).
      env: { ...process.env, RUST_LOG: process.env.RUST_LOG ?? "warn", ATMOST_AUDIT_LOG: "off" },
    });
    running.add(child);
    let stderr = "";
    child.stderr!.setEncoding("utf8");
    child.stderr!.on("data", (chunk: string) => {
      stderr = (stderr + chunk).slice(-4000);
    });
    const lines = createInterface({ input: child.stdout! });
    const address = await new Promise<string>((resolveAddress, reject) => {
      const exited = (code: number | null, signal: string | null) =>
        reject(new Error(`atmost exited (${code ?? signal}) before listening:\n${stderr}`));
      child.once("exit", exited);
      child.once("error", reject);
      lines.on("line", (line) => {
        const match = /^atmost listening on (\S+)$/.exec(line);
        if (match) {
          child.off("exit", exited);
          resolveAddress(match[1]);
        }
      });
    });
    // Keep draining stdout so the server never blocks on a full pipe.
    child.stdout!.resume();
    return new Atmost(child, address);
  }

  /** Kills the server and waits until it is gone. */
  async stop(): Promise<void> {
    running.delete(this.process);
    if (this.process.exitCode !== null || this.process.signalCode !== null) return;
    const gone = new Promise((r) => this.process.once("exit", r));
    this.process.kill("SIGKILL");
    await gone;
  }

  client(options: Partial<ClientOptions> = {}): Client {
    return new Client({ address: this.address, ...options });
  }
}

/**
 * A `redis-server` of the test's own, without persistence, on a unix socket
 * (no port to race for); killed by {@link Redis.stop} or when the test
 * process exits. {@link Redis.pause} stops the process (SIGSTOP) and
 * {@link Redis.resume} continues it: meanwhile the commands atmost sends
 * wait in the socket, unanswered, and run when it resumes, as behind a
 * stalled network.
 */
export class Redis {
  private constructor(
    readonly process: ChildProcess,
    /** The URL atmost takes: `unix:///...`. */
    readonly url: string,
  ) {}

  static async start(): Promise<Redis> {
    const socket = join(tempDir(), "redis.sock");
    const child = spawn("redis-server", ["--port", "0", "--unixsocket", socket, "--unixsocketperm", "700", "--save", "", "--appendonly", "no"], {
      stdio: ["ignore", "ignore", "pipe"],
      cwd: dirname(socket),
    });
    running.add(child);
    let stderr = "";
    child.stderr!.setEncoding("utf8");
    child.stderr!.on("data", (chunk: string) => {
      stderr = (stderr + chunk).slice(-4000);
    });
    const failed = new Promise<never>((_, reject) => {
      child.once("error", (error) => reject(new Error(`redis-server could not run (is it installed?): ${error.message}`)));
      child.once("exit", (code, signal) => reject(new Error(`redis-server exited (${code ?? signal}):\n${stderr}`)));
    });
    failed.catch(() => {}); // raised by the race below while starting; later exits are stop()'s
    const redis = new Redis(child, `unix://${socket}`);
    // A hang guard only, as for atmost's start.
    const giveUp = performance.now() + 60_000;
    while (!(await Promise.race([pong(socket), failed]))) {
      if (performance.now() > giveUp) {
        await redis.stop();
        throw new Error(`redis-server did not answer on ${socket}:\n${stderr}`);
      }
      await new Promise((r) => setTimeout(r, 20));
    }
    return redis;
  }

  pause(): void {
    this.process.kill("SIGSTOP");
  }

  resume(): void {
    this.process.kill("SIGCONT");
  }

  /** Kills the server (a stopped one too) and waits until it is gone. */
  async stop(): Promise<void> {
    running.delete(this.process);
    if (this.process.exitCode !== null || this.process.signalCode !== null) return;
    const gone = new Promise((r) => this.process.once("exit", r));
    this.process.kill("SIGKILL");
    await gone;
  }
}

/** Whether a Redis answers PING on the unix socket `path`. */
function pong(path: string): Promise<boolean> {
  return new Promise((resolvePong) => {
    const socket = connect(path);
    let reply = "";
    socket.setTimeout(1_000, () => socket.destroy());
    socket.on("connect", () => socket.write("PING\r\n"));
    socket.on("data", (chunk) => {
      reply += chunk.toString("latin1");
      if (reply.includes("\r\n")) socket.destroy();
    });
    socket.on("error", () => {});
    socket.on("close", () => resolvePong(reply === "+PONG\r\n"));
  });
}

/**
 * Stops `child` (SIGSTOP) and waits until every one of its threads is
 * stopped. The kernel wakes one thread to take the signal and stops the
 * others after it has run: on a busy machine a worker thread can answer a
 * request sent meanwhile, so a test that needs a process that answers
 * nothing waits for this.
 */
export async function freeze(child: ChildProcess): Promise<void> {
  child.kill("SIGSTOP");
  const giveUp = performance.now() + 10_000;
  const state = (stat: string) => stat.charAt(stat.lastIndexOf(")") + 2);
  if (child.exitCode !== null || child.signalCode !== null) throw new Error(`pid ${child.pid} has exited: nothing to freeze`);
  for (;;) {
    const tasks = readdirSync(`/proc/${child.pid}/task`);
    const running = tasks.filter((task) => {
      try {
        return state(readFileSync(`/proc/${child.pid}/task/${task}/stat`, "utf8")) !== "T";
      } catch {
        return false; // a thread that has exited
      }
    });
    if (running.length === 0) return;
    if (performance.now() > giveUp) throw new Error(`pid ${child.pid}: ${running.length} threads still running 10 s after SIGSTOP`);
    await new Promise((r) => setTimeout(r, 2));
  }
}

/** A loopback port nothing listens on right now. */
export async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const port = (server.address() as { port: number }).port;
  await new Promise((r) => server.close(r));
  return port;
}

/** A permit for the next hour over `tools`, each capped as `caps` says. */
export function createPermit(client: Client, tools: string[], caps: Record<string, number> = {}, more: Partial<NewPermit> = {}): Promise<Permit> {
  return client.createPermit({
    subject: "node-client-test",
    tools,
    maxCallsPerTool: caps,
    expiresAt: { seconds: Math.floor(Date.now() / 1000) + 3600 },
    ...more,
  });
}

/** A fresh idempotency key. */
export function key(label: string): string {
  return `${label}-${randomUUID()}`;
}

/** A fake tool that counts the calls that reached it. */
export class FakeTool {
  calls: string[] = [];
  /** Records one side effect for `attemptId`. */
  hit(attemptId: string): void {
    this.calls.push(attemptId);
  }
}

/** An atmost key file (docs/api.md, "Authentication and roles"). */
export function keyFile(entries: { id: string; key: string; roles: string[]; tenant?: string }[], extra = ""): string {
  const text =
    entries
      .map(
        (e) =>
          `[[key]]\nid = "${e.id}"\nsha256 = "${createHash("sha256").update(e.key).digest("hex")}"\n` +
          `tenant = "${e.tenant ?? "test"}"\nroles = [${e.roles.map((r) => `"${r}"`).join(", ")}]\n`,
      )
      .join("\n") + extra;
  const path = join(tempDir(), "keys.toml");
  writeFileSync(path, text);
  return path;
}

/** PEM files of a throwaway CA and the certificates it issued, made with openssl. */
export class Pki {
  readonly dir = tempDir();
  readonly caPem: string;
  private readonly caKey: string;

  constructor() {
    this.caKey = join(this.dir, "ca.key");
    this.caPem = join(this.dir, "ca.pem");
    openssl([
      "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
      "-keyout", this.caKey, "-out", this.caPem, "-days", "2", "-subj", "/CN=atmost node client test CA",
      "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    ]);
  }

  /** A certificate for `san` (e.g. `IP:127.0.0.1`, `URI:spiffe://...`): [cert path, key path]. */
  issue(name: string, san: string, usage: "serverAuth" | "clientAuth"): { cert: string; key: string } {
    const key = join(this.dir, `${name}.key`);
    const csr = join(this.dir, `${name}.csr`);
    const cert = join(this.dir, `${name}.pem`);
    const ext = join(this.dir, `${name}.ext`);
    writeFileSync(ext, `basicConstraints=CA:FALSE\nsubjectAltName=${san}\nextendedKeyUsage=${usage}\nkeyUsage=digitalSignature\n`);
    openssl(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", csr, "-subj", `/CN=${name}`]);
    openssl(["x509", "-req", "-in", csr, "-CA", this.caPem, "-CAkey", this.caKey, "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext]);
    return { cert, key };
  }
}

function openssl(args: string[]): void {
  try {
    execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
  } catch (error) {
    throw new Error(`openssl ${args.join(" ")} failed: ${(error as { stderr?: Buffer }).stderr?.toString() ?? error}`);
  }
}

/** One HTTP/2 frame atmost sent, as {@link frameRelay} hands it over. */
export interface Frame {
  /** The whole frame: 9 bytes of header (length 3, type 1, flags 1, stream id 4), then the payload. */
  bytes: Buffer;
  type: number;
  flags: number;
  stream: number;
  /** For the first DATA frame of a response: which response it is (1, 2, ...), counted across connections; else undefined. */
  response?: number;
}

/**
 * A loopback TCP relay to atmost at `address`, listening on a free port,
 * that reads atmost's side as HTTP/2 frames and forwards what `edit`
 * makes of each (the frame as it is, another, or a promise of one),
 * in order: a frame held holds every frame after it on its connection. The
 * client's side is forwarded as it is. `close` cuts every connection.
 */
export async function frameRelay(address: string, edit: (frame: Frame) => Buffer | Promise<Buffer>): Promise<{ address: string; close: () => void }> {
  const [host, port] = [address.slice(0, address.lastIndexOf(":")), Number(address.slice(address.lastIndexOf(":") + 1))];
  const sockets = new Set<Socket>();
  let responses = 0;
  const server = createServer((downstream) => {
    const upstream = connect(port, host);
    const cut = () => {
      downstream.destroy();
      upstream.destroy();
    };
    for (const s of [downstream, upstream]) {
      sockets.add(s);
      s.on("close", () => {
        sockets.delete(s);
        cut();
      });
      s.on("error", cut);
    }
    downstream.pipe(upstream);
    const streams = new Set<number>();
    let buffer = Buffer.alloc(0);
    let forwarding: Promise<void> = Promise.resolve();
    // atmost's side is frames from its first byte (its preface is a SETTINGS frame).
    upstream.on("data", (chunk: Buffer) => {
      buffer = Buffer.concat([buffer, chunk]);
      while (buffer.length >= 9) {
        const size = 9 + buffer.readUIntBE(0, 3);
        if (buffer.length < size) break;
        const bytes = buffer.subarray(0, size);
        buffer = buffer.subarray(size);
        const frame: Frame = { bytes, type: bytes[3], flags: bytes[4], stream: bytes.readUInt32BE(5) & 0x7fffffff };
        if (frame.type === 0 && frame.stream !== 0 && !streams.has(frame.stream)) {
          streams.add(frame.stream);
          frame.response = ++responses;
        }
        forwarding = forwarding
          .then(() => edit(frame))
          .then((out) => {
            if (!downstream.destroyed) downstream.write(out);
          }, cut);
      }
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return {
    address: `127.0.0.1:${(server.address() as { port: number }).port}`,
    close: () => {
      for (const s of sockets) s.destroy();
      server.close();
    },
  };
}
