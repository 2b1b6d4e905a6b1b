"""Live atmost servers for the HTTP/JSON tests: real processes, never a mock.

Each server is `atmost serve --listen 127.0.0.1:0` from ATMOST_BIN, its
address read from its first stdout line, killed at the end whatever
happened. `api` runs a test once per store: the memory store, and Redis
(a `redis-server` of the session's own on a unix socket, no persistence).
Every request goes through httpx, over HTTP/1.1 unless a test asks for
HTTP/2.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pathlib
import queue
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

import httpx
import pytest

#: How long a process may take to start before the test fails: a guard
#: against a hang, not a measurement.
START_TIMEOUT = 60.0
JSON = {"content-type": "application/json"}


def atmost_bin() -> str:
    path = os.environ.get("ATMOST_BIN")
    if not path or not pathlib.Path(path).is_file():
        raise RuntimeError(f"ATMOST_BIN does not name an atmost binary: {path!r} (tests/http/test.sh sets it)")
    return path


class Server:
    """One `atmost serve` process."""

    def __init__(self, args: List[str], tmp: pathlib.Path, listen: str = "127.0.0.1:0",
                 env: Optional[Dict[str, str]] = None) -> None:
        settings = env or {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("ATMOST_")}
        env["ATMOST_AUDIT_LOG"] = "off"
        env.update(settings)
        self.stderr_path = tmp / f"atmost-{secrets.token_hex(4)}.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.process = subprocess.Popen(
            [atmost_bin(), "serve", "--listen", listen, *args],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        lines: "queue.Queue[bytes]" = queue.Queue()

        def read() -> None:
            for line in iter(self.process.stdout.readline, b""):
                lines.put(line)
                if line.startswith(b"atmost listening on "):
                    return
            lines.put(b"")

        threading.Thread(target=read, daemon=True).start()
        #: What stdout said before the last start-up line, as
        #: {"http": ADDR, "metrics": ADDR}.
        self.also: Dict[str, str] = {}
        give_up = time.monotonic() + START_TIMEOUT
        while True:
            try:
                line = lines.get(timeout=max(0.0, give_up - time.monotonic())).decode("utf-8", "replace").strip()
            except queue.Empty:
                line = ""
            if line.startswith("atmost listening on "):
                break
            words = line.split(" ")
            if len(words) == 4 and words[0] == "atmost" and words[2] == "on":
                self.also[words[1]] = words[3]
                continue
            self.stop()
            raise RuntimeError(f"atmost did not start (stdout {line!r}): {self.stderr()}")
        self.address = line[len("atmost listening on ") :]
        self.url = f"http://{self.address}"
        self.http_url = f"http://{self.also['http']}" if "http" in self.also else self.url

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._stderr.close()


class Redis:
    """A `redis-server` of the session's own, on a unix socket."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.dir = tempfile.mkdtemp(prefix="atmost-http-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.process = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir],
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

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Api:
    """One server's HTTP/JSON API through httpx, with the calls the tests
    repeat. Every method returns the httpx.Response."""

    def __init__(self, server: Server, headers: Optional[Dict[str, str]] = None) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url, headers=headers or {}, timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        headers = {**JSON, **kw.pop("headers", {})}
        return self.http.post(path, json=body if body is not None else {}, headers=headers, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.http.get(path, **kw)

    def permit(self, **spec: Any) -> str:
        body = {"tools": ["charge"], "expiresAt": tomorrow(), **spec}
        r = self.post("/v1/permits", body)
        assert r.status_code == 200, r.text
        return r.json()["permitId"]

    def authorize(self, permit: str, key: str, fingerprint: bytes = b"req-1", **fields: Any) -> httpx.Response:
        body = {
            "tool": "charge",
            "idempotencyKey": key,
            "requestFingerprint": b64(fingerprint),
            **fields,
        }
        return self.post(f"/v1/permits/{permit}/attempts:authorize", body)

    def commit(self, permit: str, key: str, attempt_id: str, outcome: Dict[str, Any]) -> httpx.Response:
        return self.post(
            f"/v1/permits/{permit}/attempts/{quote(key)}:commit",
            {"attemptId": attempt_id, **outcome},
        )

    def usage(self, permit: str) -> Dict[str, Any]:
        r = self.get(f"/v1/permits/{permit}")
        assert r.status_code == 200, r.text
        return r.json()


def tomorrow() -> str:
    """An expiry within every permit lifetime quota (30 days at most)."""
    import datetime

    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def quote(segment: str) -> str:
    """A path segment, every reserved character percent-encoded."""
    from urllib.parse import quote as q

    return q(segment, safe="")


def reason(response: httpx.Response) -> str:
    """The ErrorInfo reason of an error answer."""
    for detail in response.json()["error"]["details"]:
        if detail["@type"] == "type.googleapis.com/google.rpc.ErrorInfo":
            return detail["reason"]
    raise AssertionError(f"no ErrorInfo in {response.text}")


@pytest.fixture(scope="session")
def redis() -> Iterator[Redis]:
    r = Redis()
    yield r
    r.stop()


@pytest.fixture(scope="session", params=["memory", "redis"])
def store_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "memory":
        args = ["--store", "memory"]
    else:
        redis = request.getfixturevalue("redis")
        # Each run its own prefix: the session's Redis is shared.
        args = ["--store", "redis", "--redis-url", redis.url, "--redis-prefix", f"http-{secrets.token_hex(4)}"]
    server = Server(args, tmp)
    yield server
    server.stop()


@pytest.fixture
def api(store_server: Server) -> Iterator[Api]:
    a = Api(store_server)
    yield a
    a.close()


# === keys ===


class Keys:
    """API keys of an --auth-keys file, random for each run: an admin, an
    operator, an approver and an agent in tenant t1, an admin in tenant t2."""

    def __init__(self) -> None:
        names = ["admin", "operator", "approver", "agent", "other"]
        self.keys = {name: f"{name}-{secrets.token_hex(16)}" for name in names}

    def toml(self) -> str:
        roles = {"admin": ("admin", "t1"), "operator": ("operator", "t1"), "approver": ("approver", "t1"),
                 "agent": ("agent", "t1"), "other": ("admin", "t2")}
        out = ""
        for name, key in self.keys.items():
            role, tenant = roles[name]
            digest = hashlib.sha256(key.encode()).hexdigest()
            out += f'[[key]]\nid = "http-{name}"\nsha256 = "{digest}"\ntenant = "{tenant}"\nroles = ["{role}"]\n\n'
        return out

    def bearer(self, name: str) -> Dict[str, str]:
        return {"authorization": f"Bearer {self.keys[name]}"}


@pytest.fixture(scope="session")
def keys() -> Keys:
    return Keys()


@pytest.fixture(scope="session")
def auth_server(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("auth")
    path = tmp / "keys.toml"
    path.write_text(keys.toml())
    server = Server(["--auth-keys", str(path)], tmp)
    yield server
    server.stop()
