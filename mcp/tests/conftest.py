"""Real processes for the atmost-mcp tests, never a mock.

- atmost: `atmost serve --listen 127.0.0.1:0` from ATMOST_BIN, on the
  memory store or on a redis-server of the test run's own (unix socket);
  its address read from its first stdout line. Permits are made and read
  with the same binary's CLI (`atmost permit create --json`, ...).
- the upstream: tests/upstream.py, the official Python SDK's MCPServer,
  whose tools write every side effect to a ledger file.
- the proxy: atmost-mcp from ATMOST_MCP_BIN, its address read from its
  first stdout line.
- the agents: the official Python SDK's Client (mcp.client.Client).
- approvers (test_approval.py): atmost with API keys, its Approvals
  service (ListApprovals, Approve, Deny) and CreatePermit with an approval
  rule called through atmost's own HTTP/JSON edge (the same services as
  gRPC, on the same port) with an approver's key and an admin's.

Every process started is killed at the end, whatever happened.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import pathlib
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Iterator, List, Optional

import anyio
import mcp_types
import pytest
from mcp.shared.message import SessionMessage

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
UPSTREAM = HERE / "upstream.py"
PIPE_UPSTREAM = HERE / "pipe_upstream.py"
#: How long a process may take to say it listens, and how long a state
#: polled for may take to appear, before the test fails. Guards against a
#: hang, never a measurement.
PATIENCE = 60.0


def binary(env: str, name: str) -> pathlib.Path:
    explicit = os.environ.get(env)
    if explicit:
        path = pathlib.Path(explicit)
    else:
        target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", "target"))
        path = (target if target.is_absolute() else REPO / target) / "debug" / name
    if not path.is_file():
        raise RuntimeError(f"no {name} binary at {path}: build it or set {env}")
    return path


def atmost_bin() -> pathlib.Path:
    return binary("ATMOST_BIN", "atmost")


def proxy_bin() -> pathlib.Path:
    return binary("ATMOST_MCP_BIN", "atmost-mcp")


def clean_env() -> Dict[str, str]:
    """The environment without any ATMOST_* setting of the caller's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ATMOST_")}


class Process:
    """A process whose first stdout line starts with `prefix`; the rest of
    that line is its address. Its stderr goes to a file, shown on failure."""

    def __init__(self, argv: List[str], prefix: str, tmp: pathlib.Path, env=None) -> None:
        self.argv = argv
        self.stderr_path = tmp / f"{pathlib.Path(argv[0]).name}-{secrets.token_hex(4)}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=env if env is not None else clean_env(),
        )
        lines: "queue.Queue[bytes]" = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.process.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=PATIENCE).decode("utf-8", "replace").strip()
        except queue.Empty:
            line = ""
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start (stdout {line!r}): {self.stderr()}")
        self.address = line[len(prefix) :]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


# === atmost ===


class Redis:
    """A redis-server of the run's own, on a unix socket, no persistence."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: the Redis-store tests need it")
        self.dir = tempfile.mkdtemp(prefix="atmost-mcp-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.process = subprocess.Popen(
            [exe, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + PATIENCE
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise RuntimeError(f"redis-server did not start on {self.socket}")
            time.sleep(0.02)
        self.url = f"unix://{self.socket}"

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(self.socket)
                s.sendall(b"PING\r\n")
                return s.recv(16) == b"+PONG\r\n"
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Atmost:
    """One `atmost serve`, and its CLI pointed at it."""

    def __init__(self, tmp: pathlib.Path, args: List[str], scheme: str = "http", cli_args=()) -> None:
        self.server = Process([str(atmost_bin()), "serve", "--listen", "127.0.0.1:0", *args],
                              "atmost listening on ", tmp)
        self.url = f"{scheme}://{self.server.address}"
        self.cli_args = list(cli_args)

    def cli(self, *args: str) -> Any:
        """`atmost ARGS --server URL --json`: its JSON answer; a failure raises."""
        done = subprocess.run(
            [str(atmost_bin()), *args, "--server", self.url, *self.cli_args, "--json"],
            capture_output=True, env=clean_env(), timeout=PATIENCE,
        )
        if done.returncode != 0:
            raise RuntimeError(f"atmost {' '.join(args)}: exit {done.returncode}: {done.stderr.decode()}")
        return json.loads(done.stdout)

    def permit(self, *flags: str) -> str:
        """A new permit (`atmost permit create FLAGS`), its id."""
        return self.cli("permit", "create", *flags)["permitId"]

    def calls_made(self, permit: str, tool: str) -> int:
        usage = self.cli("permit", "get", permit)["usage"]
        return int(next(u for u in usage if u["tool"] == tool)["callsMade"])

    def attempt(self, permit: str, key: str) -> Dict[str, Any]:
        return self.cli("attempt", "get", permit, key)["attempt"]

    def receipt_json(self, permit: str, key: str) -> Any:
        """The SUCCEEDED attempt's stored result, as JSON."""
        receipt = self.attempt(permit, key)["receipt"]
        return json.loads(base64.b64decode(receipt["result"]))

    def wait_for_state(self, permit: str, key: str, state: str) -> Dict[str, Any]:
        give_up = time.monotonic() + PATIENCE
        while True:
            attempt = self.attempt(permit, key)
            if attempt["state"] == f"ATTEMPT_STATE_{state}":
                return attempt
            if time.monotonic() > give_up:
                raise AssertionError(f"attempt {key} stayed {attempt['state']}, never {state}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session", params=["memory", "redis"])
def atmost(request, tmp_path_factory) -> Iterator[Atmost]:
    """atmost on each store in turn: the tests using it run twice."""
    tmp = tmp_path_factory.mktemp(f"atmost-{request.param}")
    redis = None
    args: List[str] = []
    if request.param == "redis":
        redis = Redis()
        args = ["--store", "redis", "--redis-url", redis.url]
    server = Atmost(tmp, args)
    yield server
    server.stop()
    if redis is not None:
        redis.stop()


@pytest.fixture(scope="session")
def memory_atmost(tmp_path_factory) -> Iterator[Atmost]:
    """One atmost on the memory store, for the tests about the proxy's own
    configuration."""
    server = Atmost(tmp_path_factory.mktemp("atmost-plain"), [])
    yield server
    server.stop()


class ApprovalAtmost(Atmost):
    """atmost with API keys: an admin's (the CLI's, and permits), the
    proxy's (agent role) and an approver's, all of one tenant. Permits with
    an approval rule, ListApprovals, Approve and Deny go through atmost's
    HTTP/JSON edge, which serves the same RPCs as gRPC on the same port."""

    APPROVER = "alice"

    def __init__(self, tmp: pathlib.Path, args: List[str]) -> None:
        self.admin_key, self.agent_key, self.approver_key = (secrets.token_hex(16) for _ in range(3))

        def entry(name: str, key: str, role: str) -> str:
            digest = hashlib.sha256(key.encode()).hexdigest()
            return f'[[key]]\nid = "{name}"\nsha256 = "{digest}"\ntenant = "t"\nroles = ["{role}"]\n\n'

        keys = tmp / "keys.toml"
        keys.write_text(entry("admin", self.admin_key, "admin") + entry("proxy", self.agent_key, "agent")
                        + entry(self.APPROVER, self.approver_key, "approver"))
        admin_file = tmp / "admin.key"
        admin_file.write_text(self.admin_key + "\n")
        self.agent_key_file = tmp / "agent.key"
        self.agent_key_file.write_text(self.agent_key + "\n")
        super().__init__(tmp, ["--auth-keys", str(keys), *args], cli_args=["--api-key-file", str(admin_file)])

    def _json(self, key: str, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=PATIENCE) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code}: {e.read().decode(errors='replace')}") from None

    def approval_permit(self, caps: Dict[str, int], approval: List[str], tools: List[str] = ()) -> str:
        """A new permit whose calls of the `approval` tools wait for one
        approver (CreatePermit, as the admin), its id."""
        permit = {
            "tools": sorted({*tools, *caps, *approval}),
            "maxCallsPerTool": {tool: str(cap) for tool, cap in caps.items()},
            "approvalPerTool": {tool: {} for tool in approval},
            "expiresAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600)),
        }
        return self._json(self.admin_key, "POST", "/v1/permits", permit)["permitId"]

    def approvals(self, permit: str) -> List[Dict[str, Any]]:
        """The permit's calls awaiting approval, as its approver sees them
        (ListApprovals)."""
        return self._json(self.approver_key, "GET", f"/v1/permits/{permit}/approvals").get("attempts", [])

    def awaiting(self, permit: str, key: str) -> Dict[str, Any]:
        """The call under `key` in the approver's list, once it is there."""
        give_up = time.monotonic() + PATIENCE
        while True:
            found = [a for a in self.approvals(permit) if a["idempotencyKey"] == key]
            if found:
                return found[0]
            if time.monotonic() > give_up:
                raise AssertionError(f"{key} never awaited approval")
            time.sleep(0.05)

    def approve(self, permit: str, key: str, attempt_id: str) -> Dict[str, Any]:
        path = f"/v1/permits/{permit}/attempts/{urllib.parse.quote(key, safe='')}:approve"
        return self._json(self.approver_key, "POST", path, {"attemptId": attempt_id})["attempt"]

    def deny(self, permit: str, key: str, attempt_id: str, reason: str) -> Dict[str, Any]:
        path = f"/v1/permits/{permit}/attempts/{urllib.parse.quote(key, safe='')}:deny"
        return self._json(self.approver_key, "POST", path, {"attemptId": attempt_id, "reason": reason})["attempt"]


@pytest.fixture(scope="session", params=["memory", "redis"])
def approval_atmost(request, tmp_path_factory) -> Iterator[ApprovalAtmost]:
    """atmost with keys on each store in turn: the tests using it run twice."""
    tmp = tmp_path_factory.mktemp(f"atmost-keys-{request.param}")
    redis = None
    args: List[str] = []
    if request.param == "redis":
        redis = Redis()
        args = ["--store", "redis", "--redis-url", redis.url]
    server = ApprovalAtmost(tmp, args)
    yield server
    server.stop()
    if redis is not None:
        redis.stop()


# === the upstream ===


class Upstream:
    """tests/upstream.py over Streamable HTTP, with its ledger."""

    def __init__(self, tmp: pathlib.Path, tls: List[str] = ()) -> None:
        self.tmp = tmp
        self.tls = list(tls)
        self.ledger = tmp / "ledger.jsonl"
        self.ledger.touch()
        self.release_dir = tmp / "release"
        self.release_dir.mkdir(exist_ok=True)
        self.port = 0
        self.start()

    def start(self) -> None:
        """Starts it (again, on the same port once it had one)."""
        self.process = Process(
            [sys.executable, str(UPSTREAM), "--ledger", str(self.ledger),
             "--release", str(self.release_dir), "--port", str(self.port), *self.tls],
            "upstream listening on ", self.tmp,
        )
        self.url = self.process.address
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def entries(self, tool: Optional[str] = None) -> List[Dict[str, Any]]:
        """The upstream's own record of what it did."""
        lines = self.ledger.read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        return [e for e in entries if tool is None or e["tool"] == tool]

    def wait_for_entries(self, n: int, tool: Optional[str] = None) -> List[Dict[str, Any]]:
        give_up = time.monotonic() + PATIENCE
        while len(self.entries(tool)) < n:
            if time.monotonic() > give_up:
                raise AssertionError(f"the upstream never wrote {n} {tool} entries")
            time.sleep(0.02)
        return self.entries(tool)

    def release(self, label: str) -> None:
        (self.release_dir / label).touch()

    def control(self, action: str) -> int:
        """POST /control/ACTION (tests/upstream.py): how many sessions it acted on."""
        base = self.url.rsplit("/mcp", 1)[0]
        with urllib.request.urlopen(urllib.request.Request(f"{base}/control/{action}", method="POST"),
                                    timeout=PATIENCE) as answer:
            return int(json.loads(answer.read())["sessions"])

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def upstream(tmp_path) -> Iterator[Upstream]:
    u = Upstream(tmp_path)
    yield u
    u.stop()


# === the proxy ===


class Proxy:
    def __init__(self, tmp: pathlib.Path, args: List[str], env=None) -> None:
        self.process = Process([str(proxy_bin()), "--listen", "127.0.0.1:0", *args],
                               "atmost-mcp listening on ", tmp, env=env)
        self.url = self.process.address

    def stderr(self) -> str:
        return self.process.stderr()

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def start_proxy(tmp_path) -> Iterator:
    """start_proxy(ARGS...) -> Proxy over HTTP, stopped after the test."""
    started: List[Proxy] = []

    def start(*args: str, env=None) -> Proxy:
        proxy = Proxy(tmp_path, list(args), env=env)
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


async def wait_for_stderr(path: pathlib.Path, text: str, exited) -> None:
    """Until the process's stderr (the file at `path`) says `text`; fails
    if the process ended first (`exited()` gives its exit code, or None
    while it runs)."""
    give_up = time.monotonic() + PATIENCE
    while text not in path.read_text(errors="replace"):
        code = exited()
        if code is not None:
            raise AssertionError(f"the proxy exited ({code}) without saying {text!r}: {path.read_text()[-3000:]}")
        if time.monotonic() > give_up:
            raise AssertionError(f"the proxy never said {text!r}: {path.read_text()[-3000:]}")
        await anyio.sleep(0.02)


class StdioProxy:
    """atmost-mcp --stdio, started by the test, with an MCP transport over
    its stdin and stdout for the SDK's Client. Leaving the transport only
    closes the proxy's stdin, as an agent that quits does; the proxy is left
    to end by itself (the SDK's own stdio client signals it 2 s later)."""

    def __init__(self, tmp: pathlib.Path, args: List[str]) -> None:
        self.argv = [str(proxy_bin()), "--stdio", *args]
        self.stderr_path = tmp / f"atmost-mcp-stdio-{secrets.token_hex(4)}.stderr"
        self.process = None

    @contextlib.asynccontextmanager
    async def transport(self):
        with open(self.stderr_path, "wb") as stderr:
            self.process = await anyio.open_process(self.argv, stderr=stderr, env=clean_env())
        process = self.process
        to_agent, from_proxy = anyio.create_memory_object_stream(0)
        to_proxy, from_agent = anyio.create_memory_object_stream(0)

        async def read() -> None:
            async with to_agent:
                buffer = b""
                async for chunk in process.stdout:
                    *lines, buffer = (buffer + chunk).split(b"\n")
                    for line in lines:
                        if line.strip():
                            message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                            await to_agent.send(SessionMessage(message))

        async def write() -> None:
            async with from_agent:
                async for message in from_agent:
                    line = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send(line.encode() + b"\n")

        async with anyio.create_task_group() as group:
            group.start_soon(read)
            group.start_soon(write)
            try:
                yield from_proxy, to_proxy
            finally:
                await process.stdin.aclose()
                group.cancel_scope.cancel()

    async def said(self, text: str) -> None:
        await wait_for_stderr(self.stderr_path, text, lambda: self.process.returncode)

    async def exited(self) -> int:
        with anyio.fail_after(PATIENCE):
            return await self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


@pytest.fixture
def start_stdio_proxy(tmp_path) -> Iterator:
    """start_stdio_proxy(ARGS...) -> StdioProxy, killed after the test if still running."""
    started: List[StdioProxy] = []

    def start(*args: str) -> StdioProxy:
        proxy = StdioProxy(tmp_path, list(args))
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


def run_proxy(*args: str, env=None) -> subprocess.CompletedProcess:
    """The proxy run to its end (for configurations it must refuse)."""
    return subprocess.run([str(proxy_bin()), *args], capture_output=True, timeout=PATIENCE,
                          env=env if env is not None else clean_env(), stdin=subprocess.DEVNULL)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
