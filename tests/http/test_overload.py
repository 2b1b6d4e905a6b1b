"""Shedding over HTTP: OVERLOADED is 503 with Retry-After, as over gRPC
it is UNAVAILABLE with RetryInfo.

One admission slot (--max-in-flight 1, 50 ms of queue wait) and a Redis of the
test's own stopped (SIGSTOP): the first Authorize to be admitted holds the
slot while its store call waits, so the other is refused after its wait. Redis
then resumes and the held one is answered.
"""

from __future__ import annotations

import os
import pathlib
import signal
import threading
import time
from typing import List

import httpx

from conftest import START_TIMEOUT, Api, Redis, Server, b64, reason


def test_overloaded_is_503_with_retry_after(tmp_path: pathlib.Path) -> None:
    redis = Redis()
    server = Server(
        ["--store", "redis", "--redis-url", redis.url, "--redis-prefix", "overload",
         "--max-in-flight", "1", "--max-queue-wait", "50ms", "--store-timeout", "60s",
         "--request-timeout", "60s"],
        tmp_path,
    )
    api = Api(server)
    stopped = False
    try:
        permit = api.permit(maxCallsPerTool={"charge": 5})
        answers: List[httpx.Response] = []
        lock = threading.Lock()

        failures: List[BaseException] = []

        def authorize(k: str) -> None:
            try:
                with httpx.Client(base_url=server.url, timeout=START_TIMEOUT) as c:
                    r = c.post(f"/v1/permits/{permit}/attempts:authorize",
                               json={"tool": "charge", "idempotencyKey": k, "requestFingerprint": b64(k.encode())},
                               headers={"content-type": "application/json"})
            except BaseException as e:  # reported below, not lost in the thread
                with lock:
                    failures.append(e)
                return
            with lock:
                answers.append(r)

        os.kill(redis.process.pid, signal.SIGSTOP)
        stopped = True
        calls = [threading.Thread(target=authorize, args=(k,), daemon=True) for k in ("k-1", "k-2")]
        for t in calls:
            t.start()
        # One is refused at once; the other waits on the stopped Redis.
        give_up = time.monotonic() + START_TIMEOUT
        while time.monotonic() < give_up:
            with lock:
                if answers or failures:
                    break
            time.sleep(0.01)
        with lock:
            assert not failures, failures
            assert len(answers) == 1, "one Authorize refused while the other holds the slot"
            shed = answers[0]
        assert shed.status_code == 503, shed.text
        assert reason(shed) == "OVERLOADED", shed.text
        assert int(shed.headers["retry-after"]) >= 1, shed.headers
        os.kill(redis.process.pid, signal.SIGCONT)
        stopped = False
        for t in calls:
            t.join(START_TIMEOUT)
        assert not failures, failures
        held = [r for r in answers if r is not shed]
        assert len(held) == 1 and held[0].status_code == 200, [r.text for r in answers]
        assert held[0].json()["decision"] == "DECISION_DISPATCH"
        # The refused one reserved nothing: one call made.
        assert api.usage(permit)["usage"][0]["callsMade"] == "1"
    finally:
        if stopped:
            os.kill(redis.process.pid, signal.SIGCONT)
        api.close()
        server.stop()
        redis.stop()
