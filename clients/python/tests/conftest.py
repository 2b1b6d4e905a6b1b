"""Live atmost servers for the tests: real processes, never a mock.

Each server is `atmost serve --listen 127.0.0.1:0` (memory store) from
ATMOST_BIN (default ${CARGO_TARGET_DIR:-target}/debug/atmost), its address
read from its first stdout line; every process started is killed at the
end, whatever happened. Three are shared by the session: a plain one, one
with --auth-keys (an admin, an agent and two approvers of one tenant: the
human-approval tests use it), and one over TLS (with client certificates
and keys).
A test that needs the store to stall starts its own redis-server
(:class:`Redis`) and an atmost on it. A test of what no atmost answers (a
proxy in front of it refusing the call, a broken server) puts a
:class:`FrontEnd` of its own, a real gRPC server, between the client and a
real atmost.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent import futures
from typing import Callable, Dict, Iterator, List, Optional

import grpc
import pytest
import trustme

import atmost_client

REPO = pathlib.Path(__file__).resolve().parents[3]
#: How long a server may take to print its address before the test fails.
#: A guard against a hang, not a measurement.
START_TIMEOUT = 60.0


def atmost_bin() -> pathlib.Path:
    explicit = os.environ.get("ATMOST_BIN")
    if explicit:
        path = pathlib.Path(explicit)
    else:
        target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", "target"))
        path = (target if target.is_absolute() else REPO / target) / "debug" / "atmost"
    if not path.is_file():
        raise RuntimeError(
            f"no atmost binary at {path}: build it (cargo build -p atmost --bin atmost) or set ATMOST_BIN"
        )
    return path


class Server:
    """One `atmost serve` process."""

    def __init__(
        self, args: List[str], listen: str = "127.0.0.1:0", tmp: Optional[pathlib.Path] = None
    ) -> None:
        # atmost reads every flag from ATMOST_* too: none of the caller's may leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATMOST_")}
        # No audit trail in the server's stderr file (nothing here reads it).
        env["ATMOST_AUDIT_LOG"] = "off"
        self.stderr_path = (
            tmp or pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
        ) / f"atmost-{secrets.token_hex(4)}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.process = subprocess.Popen(
            [str(atmost_bin()), "serve", "--listen", listen, *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        lines: "queue.Queue[bytes]" = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.process.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=START_TIMEOUT).decode("utf-8", "replace").strip()
        except queue.Empty:
            line = ""
        prefix = "atmost listening on "
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"atmost did not start (stdout {line!r}): {self.stderr()}")
        self.address = line[len(prefix) :]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


@pytest.fixture
def start_server(tmp_path: pathlib.Path) -> Iterator:
    """start_server(*args, listen=...) -> Server, stopped after the test."""
    started: List[Server] = []

    def start(*args: str, listen: str = "127.0.0.1:0") -> Server:
        server = Server(list(args), listen, tmp_path)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server([], tmp=tmp_path_factory.mktemp("plain"))
    yield s
    s.stop()


@pytest.fixture
def client(server: Server) -> Iterator[atmost_client.Client]:
    with atmost_client.Client(server.address) as c:
        yield c


# === keys and certificates ===


class Keys:
    """API keys of a --auth-keys file: one per role (two approvers), random
    for each run, all in tenant t1."""

    def __init__(self) -> None:
        self.admin = "admin-" + secrets.token_hex(16)
        self.agent = "agent-" + secrets.token_hex(16)
        #: Key ids py-approver and py-approver-2 (role approver: they
        #: list, approve and deny calls awaiting approval, and nothing else).
        self.approver = "approver-" + secrets.token_hex(16)
        self.approver_2 = "approver2-" + secrets.token_hex(16)
        #: The SAN of the client certificate the file maps (role agent).
        self.cert_san = "runner.agents.atmost.test"

    def toml(self) -> str:
        def entry(id_: str, key: str, role: str) -> str:
            digest = hashlib.sha256(key.encode()).hexdigest()
            return f'[[key]]\nid = "{id_}"\nsha256 = "{digest}"\ntenant = "t1"\nroles = ["{role}"]\n\n'

        cert = f'[[cert]]\nid = "runner"\nsan = "{self.cert_san}"\ntenant = "t1"\nroles = ["agent"]\n'
        return (
            entry("py-admin", self.admin, "admin")
            + entry("py-agent", self.agent, "agent")
            + entry("py-approver", self.approver, "approver")
            + entry("py-approver-2", self.approver_2, "approver")
            + cert
        )


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "keys.toml").write_text(keys.toml())
    s = Server(["--auth-keys", str(tmp / "keys.toml")], tmp=tmp)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    """A throwaway CA; it signs the TLS server's certificate and the client's."""
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_server(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, keys: Keys) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp / "server.pem"))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(tmp / "server.pem"), append=True)
    cert.private_key_pem.write_to_path(str(tmp / "server.key"))
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    (tmp / "keys.toml").write_text(keys.toml())
    s = Server(
        [
            "--tls-cert",
            str(tmp / "server.pem"),
            "--tls-key",
            str(tmp / "server.key"),
            "--tls-client-ca",
            str(tmp / "ca.pem"),
            "--auth-keys",
            str(tmp / "keys.toml"),
        ],
        tmp=tmp,
    )
    yield s
    s.stop()


def free_port() -> int:
    """A loopback port nobody listens on now (for a server started later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# === a Redis that can stall ===


class Redis:
    """A `redis-server` of the test's own, without persistence, on a unix
    socket (no port to race for), killed by :meth:`stop`. :meth:`pause`
    stops the process (SIGSTOP) and :meth:`resume` continues it: meanwhile
    the commands atmost sends wait in the socket, unanswered, and run when
    it resumes, as behind a stalled network."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: the stalled-store tests run a Redis of their own"
            )
        # Short: a unix socket's path must fit in about 100 bytes.
        self.dir = tempfile.mkdtemp(prefix="atmost-py-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        settings = ["--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700"]
        settings += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        self.process = subprocess.Popen(
            [binary, *settings],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + START_TIMEOUT
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

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # SIGKILL ends a stopped process too
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# === a gRPC front end in front of atmost ===

#: hook(request bytes, context, forward) -> response bytes; forward(request
#: bytes) sends the request on to atmost and returns its answer's bytes (an
#: error atmost answers is passed back as it is, details and all).
Hook = Callable[[bytes, grpc.ServicerContext, Callable[[bytes], bytes]], bytes]


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


class FrontEnd:
    """A gRPC server (grpcio, on a free loopback port) in front of a real
    atmost, what a proxy or a TLS front end is: every call goes on to atmost
    as its bytes, with its ``authorization``, and its answer comes back as
    atmost gave it, unless ``hooks`` has the method's name (``"Commit"``):
    then the hook answers, forwarding or not. For the answers no atmost
    gives: a refusal without atmost's ErrorInfo, a broken server's."""

    def __init__(self, upstream: str, hooks: Optional[Dict[str, Hook]] = None) -> None:
        self.hooks = dict(hooks or {})
        #: The method names called, in order.
        self.calls: List[str] = []
        self._channel = grpc.insecure_channel(upstream)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                method = details.method
                return grpc.unary_unary_rpc_method_handler(
                    lambda request, context: front._handle(method, request, context)
                )

        self._server.add_generic_rpc_handlers((Handler(),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.address = f"127.0.0.1:{port}"

    def _handle(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        name = method.rsplit("/", 1)[-1]
        self.calls.append(name)

        def forward(body: bytes) -> bytes:
            metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
            try:
                return self._channel.unary_unary(method)(
                    body, metadata=metadata, timeout=context.time_remaining()
                )
            except grpc.RpcError as e:
                context.abort_with_status(_Status(e.code(), e.details(), e.trailing_metadata() or ()))
                raise  # abort_with_status raises; never reached

        hook = self.hooks.get(name)
        return hook(request, context, forward) if hook is not None else forward(request)

    def stop(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()


@pytest.fixture
def front_end() -> Iterator:
    """front_end(upstream, **hooks) -> FrontEnd, stopped after the test."""
    started: List[FrontEnd] = []

    def start(upstream: str, **hooks: Hook) -> FrontEnd:
        front = FrontEnd(upstream, hooks)
        started.append(front)
        return front

    yield start
    for front in started:
        front.stop()
