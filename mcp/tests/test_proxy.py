"""atmost-mcp end to end: the official Python MCP SDK's client calls tools
through the proxy, which asks a live atmost over gRPC and forwards to the
SDK's MCPServer. The upstream's ledger is its own count of side effects:
it never exceeds the permit's cap, whatever the agents retry, lose or
re-key; and a replay gives back the original result without reaching the
upstream.

The tests taking the `atmost` fixture run once per store (memory, Redis).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import signal
import sys
from typing import Any, Dict, List, Optional

import anyio
import httpx2
import pytest
from conftest import (
    PATIENCE,
    PIPE_UPSTREAM,
    UPSTREAM,
    Atmost,
    Upstream,
    clean_env,
    proxy_bin,
    run_proxy,
    wait_for_stderr,
)
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, REQUEST_TIMEOUT

pytestmark = pytest.mark.anyio

KEY = "io.atmost/idempotency-key"
ATTEMPT = "io.atmost/attempt-id"
REPLAYED = "io.atmost/replayed"
DENIED, UNAVAILABLE, UNCERTAIN, NOT_SENT = -32080, -32081, -32082, -32083


# === helpers ===


async def call(agent: Client, tool: str, arguments: Dict[str, Any], key: Optional[str] = None, **kw):
    """tools/call, with the idempotency key in _meta when given."""
    meta = {KEY: key} if key is not None else None
    return await agent.call_tool(tool, arguments, meta=meta, **kw)


async def charge(agent: Client, amount: int, key: Optional[str] = None, hold: str = "", **kw):
    arguments: Dict[str, Any] = {"amount": amount}
    if hold:
        arguments["hold"] = hold
    return await call(agent, "charge", arguments, key, **kw)


async def refused(coroutine) -> MCPError:
    """The JSON-RPC error the call ends with (it must end with one)."""
    with pytest.raises(MCPError) as caught:
        await coroutine
    return caught.value


def body(result) -> Dict[str, Any]:
    """A tool result without the proxy's _meta: what the upstream answered."""
    return result.model_dump(mode="json", by_alias=True, exclude={"meta"}, exclude_none=True)


def tx(result) -> str:
    """The ledger entry id the charge answered with."""
    return json.loads(result.content[0].text)["tx"]


def permit_args(atmost: Atmost, upstream: Upstream, permit: str, *more: str) -> List[str]:
    return ["--server", atmost.url, "--upstream", upstream.url, "--permit", permit, *more]


# === replays ===


async def test_replay_returns_the_original_result(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "charge=3")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))

    async with Client(proxy.url, mode="legacy") as agent:
        first = await charge(agent, 500, key="order-1")
        again = await charge(agent, 500, key="order-1")
    # Another session, on the stateless 2026-07-28 protocol: the key is the
    # agent's, not the session's.
    async with Client(proxy.url, mode="auto") as other:
        assert other.protocol_version == "2026-07-28"
        third = await charge(other, 500, key="order-1")

    entries = upstream.entries("charge")
    assert len(entries) == 1
    assert not first.is_error and first.meta[REPLAYED] is False
    assert again.meta[REPLAYED] is True and third.meta[REPLAYED] is True
    assert body(first) == body(again) == body(third)
    assert tx(first) == entries[0]["id"]
    # The upstream was told the attempt id (its own idempotency key).
    assert entries[0]["attempt_id"] == first.meta[ATTEMPT] == again.meta[ATTEMPT] == third.meta[ATTEMPT]
    # atmost's receipt is the CallToolResult as the upstream gave it.
    stored = atmost.receipt_json(permit, "order-1")
    assert stored["content"] == body(first)["content"]
    # The fingerprint is SHA-256 of the RFC 8785 JSON of the name and the
    # arguments (for this ASCII, integer-only request, sorted compact JSON).
    canonical = json.dumps({"name": "charge", "arguments": {"amount": 500}}, sort_keys=True, separators=(",", ":"))
    fingerprint = base64.b64encode(hashlib.sha256(canonical.encode()).digest()).decode()
    assert atmost.attempt(permit, "order-1")["requestFingerprint"] == fingerprint

    # Another request under the same key: refused, nothing sent.
    async with Client(proxy.url, mode="legacy") as agent:
        error = await refused(charge(agent, 900, key="order-1"))
    assert error.code == DENIED
    assert error.error.data["reason"] == "IDEMPOTENCY_KEY_REUSED"
    assert len(upstream.entries("charge")) == 1
    assert atmost.calls_made(permit, "charge") == 1


async def test_refused_call_is_failed_and_replays_the_refusal(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "refuse=2")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        first = await call(agent, "refuse", {"why": "card declined"}, key="pay-1")
        again = await call(agent, "refuse", {"why": "card declined"}, key="pay-1")
    assert first.is_error is True and first.meta[REPLAYED] is False
    assert again.is_error is True and again.meta[REPLAYED] is True
    assert body(first) == body(again)
    assert atmost.attempt(permit, "pay-1")["state"] == "ATTEMPT_STATE_FAILED"
    # The tool ran once; a refusal keeps its slot.
    assert len(upstream.entries("refuse")) == 1
    assert atmost.calls_made(permit, "refuse") == 1


# === lost responses ===


async def test_lost_response_then_retry_with_the_same_key_replays(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "charge=1")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        # The agent gives up waiting while the upstream holds its answer.
        lost = await refused(charge(agent, 700, key="lost-1", hold="lost-1", read_timeout_seconds=0.5))
        assert lost.code == REQUEST_TIMEOUT
        upstream.wait_for_entries(1, "charge")
        upstream.release("lost-1")
        # The proxy still records the answer the agent never saw.
        atmost.wait_for_state(permit, "lost-1", "SUCCEEDED")
        retried = await charge(agent, 700, key="lost-1", hold="lost-1")
    entries = upstream.entries("charge")
    assert len(entries) == 1
    assert retried.meta[REPLAYED] is True
    assert tx(retried) == entries[0]["id"]
    assert atmost.calls_made(permit, "charge") == 1


async def test_upstream_past_the_dispatch_timeout_is_uncertain(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "charge=2")
    proxy = start_proxy(*permit_args(atmost, upstream, permit, "--dispatch-timeout", "1s"))
    async with Client(proxy.url, mode="legacy") as agent:
        error = await refused(charge(agent, 100, key="slow-1", hold="never"))
        assert error.code == UNCERTAIN
        data = error.error.data
        assert data["reason"] == "OUTCOME_UNCERTAIN" and data["replayed"] is False
        assert data["tool"] == "charge" and data["idempotency_key"] == "slow-1"
        attempt = atmost.attempt(permit, "slow-1")
        assert attempt["state"] == "ATTEMPT_STATE_UNCERTAIN"
        assert attempt["attemptId"] == data["attempt_id"]
        assert len(upstream.entries("charge")) == 1  # it was sent

        # The same key: the same unknown, never sent again.
        again = await refused(charge(agent, 100, key="slow-1", hold="never"))
        assert again.code == UNCERTAIN and again.error.data["replayed"] is True
        assert len(upstream.entries("charge")) == 1

        # A new key is a new intent: the uncertain call holds its slot.
        await charge(agent, 100, key="slow-2")
        capped = await refused(charge(agent, 100, key="slow-3"))
    assert capped.code == DENIED
    assert capped.error.data["reason"] == "PERMIT_MAX_CALLS_EXCEEDED"
    assert capped.error.data["limit"] == 2 and capped.error.data["calls_made"] == 2
    assert len(upstream.entries("charge")) == 2


async def test_connection_lost_after_sending_is_uncertain_and_unsent_calls_are_released(
    atmost, upstream, start_proxy
):
    permit = atmost.permit("--cap", "charge=2")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    outcome: Dict[str, MCPError] = {}

    async with Client(proxy.url, mode="legacy") as agent:

        async def held_call() -> None:
            outcome["error"] = await refused(charge(agent, 300, key="cut-1", hold="forever"))

        async with anyio.create_task_group() as group:
            group.start_soon(held_call)
            # The request reached the upstream: now its connection dies.
            await anyio.to_thread.run_sync(upstream.wait_for_entries, 1, "charge")
            upstream.process.kill()
        assert outcome["error"].code == UNCERTAIN
        assert outcome["error"].error.data["reason"] == "OUTCOME_UNCERTAIN"
        assert atmost.attempt(permit, "cut-1")["state"] == "ATTEMPT_STATE_UNCERTAIN"
        assert atmost.calls_made(permit, "charge") == 1

        # The upstream is down: a call cannot be sent; its slot comes back.
        unsent = await refused(charge(agent, 300, key="down-1"))
        assert unsent.code == NOT_SENT and unsent.error.data["reason"] == "NOT_SENT"
        assert atmost.attempt(permit, "down-1")["state"] == "ATTEMPT_STATE_RELEASED"
        assert atmost.calls_made(permit, "charge") == 1

        # Back up (same port): the free key goes through, then the cap holds.
        upstream.start()
        done = await charge(agent, 300, key="down-1")
        assert done.meta[REPLAYED] is False
        capped = await refused(charge(agent, 300, key="down-2"))
    assert capped.error.data["reason"] == "PERMIT_MAX_CALLS_EXCEEDED"
    assert len(upstream.entries("charge")) == 2
    assert atmost.calls_made(permit, "charge") == 2


async def test_a_session_the_upstream_forgot_mid_call_is_no_refusal(atmost, upstream, start_proxy):
    """All agents' calls share the proxy's one session with the upstream.
    The upstream forgets it while two charges run in it (as one that
    restarted, evicted it, or a replica that never had it answers 404).
    The next call gets 404, so was not run, and goes out in a new session.
    The two in flight are not refused by that. rmcp's own recovery would
    end them with an error of its making (-32603 "session was
    re-initialized before the response arrived"), which the proxy took for
    the upstream's answer: FAILED, the charge's slot and cost kept as a
    refusal's, the agent told the tool refused. Here one answers later on
    its stream (SUCCEEDED), and the other's stream is closed without an
    answer (UNCERTAIN)."""
    permit = atmost.permit("--cap", "charge=4")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    outcome: Dict[str, Any] = {}
    answered = {"kept": anyio.Event(), "cut": anyio.Event()}

    async with Client(proxy.url, mode="legacy") as agent, Client(proxy.url, mode="legacy") as other:

        async def held(key: str) -> None:
            try:
                outcome[key] = await charge(agent, 10, key=key, hold=key)
            except MCPError as e:
                outcome[key] = e
            answered[key].set()

        async with anyio.create_task_group() as group:
            group.start_soon(held, "kept")
            group.start_soon(held, "cut")
            await anyio.to_thread.run_sync(upstream.wait_for_entries, 2, "charge")
            assert await anyio.to_thread.run_sync(upstream.control, "forget-sessions") == 1
            # Another call in the shared session: 404, then sent in a new one.
            after = await charge(other, 10, key="after")
            assert after.meta[REPLAYED] is False
            upstream.release("kept")
            await answered["kept"].wait()
            assert await anyio.to_thread.run_sync(upstream.control, "end-forgotten") == 1
            await answered["cut"].wait()
        # The new session serves on.
        later = await charge(agent, 10, key="later")

    states = {key: atmost.attempt(permit, key)["state"] for key in ("kept", "cut", "after", "later")}
    assert states == {
        "kept": "ATTEMPT_STATE_SUCCEEDED",
        "cut": "ATTEMPT_STATE_UNCERTAIN",
        "after": "ATTEMPT_STATE_SUCCEEDED",
        "later": "ATTEMPT_STATE_SUCCEEDED",
    }
    kept = outcome["kept"]
    assert not isinstance(kept, MCPError), kept.error
    assert kept.is_error is not True and kept.meta[REPLAYED] is False
    cut = outcome["cut"]
    assert isinstance(cut, MCPError), cut
    assert cut.code == UNCERTAIN and cut.error.data["reason"] == "OUTCOME_UNCERTAIN", cut.error
    # The 404'd request was not run, so sending it again ran it once.
    entries = upstream.entries("charge")
    assert len(entries) == 4
    assert {tx(kept), tx(after), tx(later)} <= {e["id"] for e in entries}
    assert atmost.calls_made(permit, "charge") == 4


async def test_the_same_key_twice_at_once_is_sent_once(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "charge=2")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    outcome: Dict[str, Any] = {}
    async with Client(proxy.url, mode="legacy") as a, Client(proxy.url, mode="legacy") as b:

        async def first() -> None:
            outcome["first"] = await charge(a, 5, key="same", hold="same")

        async with anyio.create_task_group() as group:
            group.start_soon(first)
            await anyio.to_thread.run_sync(upstream.wait_for_entries, 1, "charge")
            # Another agent, the same key, while the first call is out.
            busy = await refused(charge(b, 5, key="same", hold="same"))
            upstream.release("same")
        assert busy.code == DENIED
        assert busy.error.data["reason"] == "IDEMPOTENCY_IN_PROGRESS"
        later = await charge(b, 5, key="same", hold="same")
    assert later.meta[REPLAYED] is True and body(later) == body(outcome["first"])
    assert len(upstream.entries("charge")) == 1
    assert atmost.calls_made(permit, "charge") == 1


# === many agents ===


async def test_many_agents_retrying_and_rekeying_never_exceed_the_cap(atmost, upstream, start_proxy):
    cap = 5
    permit = atmost.permit("--cap", f"charge={cap}")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    answers: Dict[str, List[Any]] = {}

    async def agent(n: int) -> None:
        async with Client(proxy.url, mode="legacy" if n % 2 else "auto") as session:
            for k in range(3):
                key = f"agent{n}-intent{k}"
                for _try in range(2):  # every intent retried once with its key
                    try:
                        answers.setdefault(key, []).append(await charge(session, 10, key=key))
                    except MCPError as e:
                        answers.setdefault(key, []).append(e)

    async with anyio.create_task_group() as group:
        for n in range(8):
            group.start_soon(agent, n)

    entries = upstream.entries("charge")
    assert len(entries) == cap  # 24 intents, 48 calls: the upstream ran exactly the cap
    succeeded = {k: a for k, a in answers.items() if not isinstance(a[0], MCPError)}
    assert len(succeeded) == cap
    for key, (first, retry) in succeeded.items():
        assert not isinstance(retry, MCPError), key
        assert retry.meta[REPLAYED] is True and body(retry) == body(first)
    assert sorted(tx(a[0]) for a in succeeded.values()) == sorted(e["id"] for e in entries)
    for key, tries in answers.items():
        if key in succeeded:
            continue
        for error in tries:
            assert isinstance(error, MCPError), key
            assert error.code == DENIED
            assert error.error.data["reason"] == "PERMIT_MAX_CALLS_EXCEEDED"
            assert error.error.data["limit"] == cap
    assert atmost.calls_made(permit, "charge") == cap


# === denials ===


async def test_denials_carry_the_reason_tool_limit_and_calls_made(atmost, upstream, start_proxy):
    permit = atmost.permit("--cap", "charge=1")
    proxy = start_proxy(*permit_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        await charge(agent, 50, key="d-1")

        capped = await refused(charge(agent, 50, key="d-2"))
        assert capped.code == DENIED
        assert "PERMIT_MAX_CALLS_EXCEEDED" in capped.message
        assert capped.error.data == {
            "reason": "PERMIT_MAX_CALLS_EXCEEDED",
            "tool": "charge",
            "limit": 1,
            "calls_made": 1,
            "permit_id": permit,
            "idempotency_key": "d-2",
            "metadata": {"tool": "charge", "limit": "1", "calls_made": "1"},
        }

        scope = await refused(call(agent, "echo", {"text": "hi"}, key="d-3"))
        assert scope.code == DENIED
        assert scope.error.data["reason"] == "TOOL_NOT_IN_SCOPE"
        assert scope.error.data["tool"] == "echo"

        atmost.cli("permit", "revoke", permit)
        revoked = await refused(charge(agent, 50, key="d-4"))
        assert revoked.error.data["reason"] == "PERMIT_REVOKED"
        # Revocation stops new keys only: the earlier one still replays.
        replay = await charge(agent, 50, key="d-1")
        assert replay.meta[REPLAYED] is True

    unknown = "0190f3a0-0000-7000-8000-000000000000"
    stranger = start_proxy(*permit_args(atmost, upstream, unknown))
    async with Client(stranger.url, mode="legacy") as agent:
        missing = await refused(charge(agent, 50, key="d-5"))
    assert missing.code == DENIED
    assert missing.error.data["reason"] == "PERMIT_NOT_FOUND"
    assert len(upstream.entries("charge")) == 1
    assert upstream.entries("echo") == []


# === arguments ===


async def test_arguments_a_fingerprint_cannot_hold_exactly_are_refused(memory_atmost, upstream, start_proxy):
    """A number past ±(2^53 - 1) is one two different requests would share
    as a fingerprint (9007199254740993 and 9007199254740992 are one double),
    so atmost could replay one's result for the other. Such a call is
    refused as INVALID_PARAMS, naming where, before atmost is asked:
    nothing recorded, nothing sent."""
    permit = memory_atmost.permit("--cap", "charge=2")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        for key, arguments, path in [
            ("big-1", {"amount": 1, "account": 9007199254740993}, "/arguments/account"),
            ("big-2", {"amount": -(2**53)}, "/arguments/amount"),
            ("big-3", {"amount": 1, "meta": {"ids": [1, 1e21]}}, "/arguments/meta/ids/1"),
        ]:
            error = await refused(call(agent, "charge", arguments, key=key))
            assert error.code == INVALID_PARAMS, error.error
            assert error.error.data == {
                "reason": "INVALID_ARGUMENTS",
                "path": path,
                "tool": "charge",
                "permit_id": permit,
                "idempotency_key": key,
            }
            assert path in error.message
            with pytest.raises(RuntimeError, match="ATTEMPT_NOT_FOUND"):
                memory_atmost.attempt(permit, key)
        # 2^53 - 1 itself is exact.
        done = await call(agent, "charge", {"amount": 2**53 - 1}, key="edge")
        assert done.meta[REPLAYED] is False
    assert [e["amount"] for e in upstream.entries("charge")] == [2**53 - 1]
    assert memory_atmost.calls_made(permit, "charge") == 1


# === keys ===


async def test_keys_derived_from_the_session(memory_atmost, upstream, start_proxy):
    permit = memory_atmost.permit("--cap", "charge=3")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        a = await charge(agent, 1)
        b = await charge(agent, 1)
        # Two requests of the session are two intents, each keyed by the
        # session and its JSON-RPC id; the key used comes back in _meta.
        derived = re.compile(r"mcp:([0-9a-f-]{36}):([0-9]+)")
        session_a, id_a = derived.fullmatch(a.meta[KEY]).groups()
        session_b, id_b = derived.fullmatch(b.meta[KEY]).groups()
        assert session_a == session_b and id_a != id_b
        assert memory_atmost.attempt(permit, b.meta[KEY])["state"] == "ATTEMPT_STATE_SUCCEEDED"
        # An agent that lost the answer retries with the key it was told.
        again = await charge(agent, 1, key=b.meta[KEY])
        assert again.meta[REPLAYED] is True and body(again) == body(b)
    async with Client(proxy.url, mode="auto") as stateless:
        # No session on 2026-07-28: each call without a key is its own intent.
        c = await charge(stateless, 1)
        assert c.meta[KEY].startswith("mcp:fresh:")
    assert len(upstream.entries("charge")) == 3

    async with Client(proxy.url, mode="legacy") as agent:
        bad = await refused(agent.call_tool("charge", {"amount": 1}, meta={KEY: 42}))
    assert bad.code == INVALID_PARAMS
    assert bad.error.data["reason"] == "INVALID_IDEMPOTENCY_KEY"
    assert len(upstream.entries("charge")) == 3


async def test_a_stateless_request_naming_a_session_gets_a_key_of_its_own(memory_atmost, upstream, start_proxy):
    """A stateless (2026-07-28) request is served in no session, whatever
    Mcp-Session-Id header it carries. Sending another session's id (live,
    then ended) with the JSON-RPC id of one of that session's calls must
    not get that call's derived key: not its result as a replay, not
    KEY_REUSED. The call gets a fresh key and is a new intent."""
    permit = memory_atmost.permit("--cap", "charge=10")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    derived = re.compile(r"mcp:([0-9a-f-]{36}):([0-9]+)")
    sent: List[Any] = []

    async def note_call(request) -> None:
        message = json.loads(request.content or b"null")
        if isinstance(message, dict) and message.get("method") == "tools/call":
            sent.append((message["id"], request.headers.get_list("mcp-session-id")))

    def forger(session_id: str) -> Client:
        # The SDK's own stateless client; its HTTP client adds the header.
        http = httpx2.AsyncClient(headers={"mcp-session-id": session_id},
                                  event_hooks={"request": [note_call]},
                                  timeout=httpx2.Timeout(30.0, read=300.0))
        return Client(streamable_http_client(proxy.url, http_client=http), mode="auto")

    async with Client(proxy.url, mode="legacy") as victim:
        mine = [await charge(victim, 5) for _ in range(4)]
        derived_keys = [derived.fullmatch(r.meta[KEY]).groups() for r in mine]
        session_id = derived_keys[0][0]
        victim_ids = {int(i) for _, i in derived_keys}
        async with forger(session_id) as live:
            assert live.protocol_version == "2026-07-28"
            while_live = await charge(live, 5)
    # The session has ended: in session mode rmcp no longer knows it.
    ended = {"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {}}
    async with httpx2.AsyncClient(timeout=30.0) as http:
        answer = await http.post(proxy.url, json=ended, headers={
            "accept": "application/json, text/event-stream", "mcp-session-id": session_id,
            "mcp-protocol-version": "2025-11-25"})
    assert answer.status_code == 404
    async with forger(session_id) as stale:
        assert stale.protocol_version == "2026-07-28"
        after_end = await charge(stale, 5)

    # The forged calls did name the session and request ids of it (else
    # this test would prove nothing): with the session's keys they would
    # replay.
    assert len(sent) == 2
    for call_id, header in sent:
        assert call_id in victim_ids
        assert header == [session_id]
    for forged in (while_live, after_end):
        assert forged.meta[KEY].startswith("mcp:fresh:")
        assert forged.meta[REPLAYED] is False
        assert forged.meta[ATTEMPT] not in {r.meta[ATTEMPT] for r in mine}
    # Two new intents, each run by the upstream; the session's own results
    # were not handed out.
    entries = upstream.entries("charge")
    assert len(entries) == 6
    assert sorted(tx(r) for r in [*mine, while_live, after_end]) == sorted(e["id"] for e in entries)
    assert memory_atmost.calls_made(permit, "charge") == 6


async def test_permit_from_a_header(memory_atmost, upstream, start_proxy):
    first = memory_atmost.permit("--cap", "charge=1")
    second = memory_atmost.permit("--cap", "charge=1")
    proxy = start_proxy("--server", memory_atmost.url, "--upstream", upstream.url,
                        "--permit-header", "x-atmost-permit")

    def agent(permit: Optional[str]) -> Client:
        headers = {"x-atmost-permit": permit} if permit else {}
        http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
        return Client(streamable_http_client(proxy.url, http_client=http), mode="legacy")

    async with agent(first) as a:
        await charge(a, 5, key="h-1")
        capped = await refused(charge(a, 5, key="h-2"))
        assert capped.error.data["reason"] == "PERMIT_MAX_CALLS_EXCEEDED"
        assert capped.error.data["permit_id"] == first
    async with agent(second) as b:
        done = await charge(b, 5, key="h-2")
        assert done.meta[REPLAYED] is False
    async with agent(None) as c:
        missing = await refused(charge(c, 5, key="h-3"))
        assert missing.code == INVALID_PARAMS
        assert missing.error.data["reason"] == "PERMIT_MISSING"
    assert len(upstream.entries("charge")) == 2


async def test_a_permit_header_sent_twice_is_refused(memory_atmost, upstream, start_proxy):
    """Behind a gateway that appends its permit header to the agent's
    instead of replacing it, the request carries two. Taking the first
    would let the agent's own win: the call is refused, nothing sent."""
    mine = memory_atmost.permit("--cap", "charge=1")
    gateways = memory_atmost.permit("--cap", "charge=1")
    proxy = start_proxy("--server", memory_atmost.url, "--upstream", upstream.url,
                        "--permit-header", "x-atmost-permit")
    sent: List[List[str]] = []

    async def note_call(request) -> None:
        message = json.loads(request.content or b"null")
        if isinstance(message, dict) and message.get("method") == "tools/call":
            sent.append(request.headers.get_list("x-atmost-permit"))

    for twice in ([mine, gateways], [gateways, gateways]):
        http = httpx2.AsyncClient(headers=[("x-atmost-permit", p) for p in twice],
                                  event_hooks={"request": [note_call]},
                                  timeout=httpx2.Timeout(30.0, read=300.0))
        async with Client(streamable_http_client(proxy.url, http_client=http), mode="legacy") as agent:
            error = await refused(charge(agent, 5, key="twice"))
        assert error.code == INVALID_PARAMS
        assert error.error.data["reason"] == "PERMIT_MISSING"
        assert "x-atmost-permit header came more than once" in error.error.message
    # Both requests did carry the header twice (else this proves nothing).
    assert sent == [[mine, gateways], [gateways, gateways]]
    assert upstream.entries() == []
    assert memory_atmost.calls_made(mine, "charge") == 0
    assert memory_atmost.calls_made(gateways, "charge") == 0


# === transports ===


async def test_tools_list_and_instructions_pass_through(memory_atmost, upstream, start_proxy):
    permit = memory_atmost.permit("--cap", "charge=1")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    async with Client(upstream.url, mode="legacy") as direct:
        expected = (await direct.list_tools()).tools
        instructions = direct.instructions
    async with Client(proxy.url, mode="legacy") as agent:
        listed = (await agent.list_tools()).tools
        assert agent.instructions == instructions
    dump = lambda tools: sorted((t.name, json.dumps(t.input_schema, sort_keys=True)) for t in tools)
    assert dump(listed) == dump(expected)
    assert {t.name for t in listed} == {"charge", "refuse", "crash", "echo"}
    assert upstream.entries() == []


async def test_stdio_agent_and_child_process_upstream(memory_atmost, tmp_path):
    permit = memory_atmost.permit("--cap", "charge=2", "--cap", "crash=1")
    ledger = tmp_path / "ledger.jsonl"
    ledger.touch()
    params = StdioServerParameters(
        command=str(proxy_bin()),
        args=["--stdio", "--server", memory_atmost.url, "--permit", permit, "--",
              sys.executable, str(UPSTREAM), "--stdio", "--ledger", str(ledger)],
        env=clean_env(),
    )

    def entries(tool: str) -> List[Dict[str, Any]]:
        return [e for e in map(json.loads, ledger.read_text().splitlines()) if e["tool"] == tool]

    async with Client(params, mode="legacy") as agent:
        first = await charge(agent, 20, key="s-1")
        again = await charge(agent, 20, key="s-1")
        assert again.meta[REPLAYED] is True and body(again) == body(first)
        # The child exits after its side effect, without answering.
        lost = await refused(call(agent, "crash", {}, key="s-2"))
        assert lost.code == UNCERTAIN
        assert memory_atmost.attempt(permit, "s-2")["state"] == "ATTEMPT_STATE_UNCERTAIN"
        # The next call starts the upstream again; without a key it is keyed
        # by the stdio session (one per proxy process) and the request id.
        second = await charge(agent, 20)
        assert second.meta[KEY].startswith("mcp:") and not second.meta[KEY].startswith("mcp:fresh:")
        capped = await refused(charge(agent, 20, key="s-3"))
        assert capped.error.data["reason"] == "PERMIT_MAX_CALLS_EXCEEDED"
    assert len(entries("charge")) == 2
    assert len(entries("crash")) == 1


async def test_a_stdio_agent_that_quits_mid_call_leaves_the_proxy_to_record_it(
    memory_atmost, upstream, start_stdio_proxy
):
    """The agent gives up on a call and closes the proxy's stdin while the
    upstream still runs it. The proxy waits for the call (within its
    dispatch deadline) before it exits, and records its answer: SUCCEEDED,
    not left RESERVED by a proxy that exited with the call in flight."""
    permit = memory_atmost.permit("--cap", "charge=2")
    proxy = start_stdio_proxy("--server", memory_atmost.url, "--permit", permit, "--upstream", upstream.url)
    async with Client(proxy.transport(), mode="legacy") as agent:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: charge(agent, 30, key="eof-1", hold="eof-1"))
            await anyio.to_thread.run_sync(upstream.wait_for_entries, 1, "charge")
            group.cancel_scope.cancel()
    # stdin is closed: the proxy waits for the call still out.
    await proxy.said("waiting for the calls in flight to end and be recorded")
    assert memory_atmost.attempt(permit, "eof-1")["state"] == "ATTEMPT_STATE_RESERVED"
    upstream.release("eof-1")
    assert await proxy.exited() == 0
    assert memory_atmost.attempt(permit, "eof-1")["state"] == "ATTEMPT_STATE_SUCCEEDED"
    stored = memory_atmost.receipt_json(permit, "eof-1")
    assert json.loads(stored["content"][0]["text"])["tx"] == upstream.entries("charge")[0]["id"]


async def test_a_stdio_proxy_signalled_after_its_agent_quit_marks_the_call_uncertain(memory_atmost, upstream):
    """The SDK's own stdio client, leaving, closes the proxy's stdin,
    sends SIGTERM 2 s later and SIGKILL 2 s after that. The proxy, told to
    stop while a call it sent is still out, marks it UNCERTAIN before it
    exits, rather than leaving it RESERVED."""
    permit = memory_atmost.permit("--cap", "charge=2")
    params = StdioServerParameters(
        command=str(proxy_bin()),
        args=["--stdio", "--server", memory_atmost.url, "--permit", permit, "--upstream", upstream.url],
        env=clean_env(),
    )
    async with Client(params, mode="legacy") as agent:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: charge(agent, 30, key="term-1", hold="never"))
            await anyio.to_thread.run_sync(upstream.wait_for_entries, 1, "charge")
            group.cancel_scope.cancel()
    # The SDK has closed the proxy's stdin, signalled it, and seen it end.
    attempt = memory_atmost.attempt(permit, "term-1")
    assert attempt["state"] == "ATTEMPT_STATE_UNCERTAIN", attempt
    # Marked by the proxy, not read so at the end of its lease.
    assert "atmost-mcp stopped before the upstream answered" in attempt["uncertainReason"], attempt
    assert len(upstream.entries("charge")) == 1


async def test_a_stopped_http_proxy_records_and_answers_the_calls_in_flight(memory_atmost, upstream, start_proxy):
    """SIGTERM stops the HTTP proxy taking connections; the calls in flight
    are waited for, recorded, and answered to their agents, however long
    after the signal the upstream answers. A second SIGTERM stops the wait:
    the calls still out are marked UNCERTAIN, their agents told so, and the
    proxy exits."""
    permit = memory_atmost.permit("--cap", "charge=3")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    process = proxy.process.process
    answers: Dict[str, Any] = {}

    async def held(agent: Client, key: str) -> None:
        try:
            answers[key] = await charge(agent, 1, key=key, hold=key)
        except Exception as e:  # kept, for the assertions below to show
            answers[key] = e

    async with Client(proxy.url, mode="legacy") as agent:
        # The SDK lists the tools before it takes a tool's first result (to
        # check it against the tool's output schema): done now, while the
        # proxy still takes connections.
        await agent.list_tools()
        # Both calls end with an answer; a lost one would leave its agent
        # waiting, and the test failing here.
        with anyio.fail_after(PATIENCE):
            async with anyio.create_task_group() as group:
                group.start_soon(held, agent, "stop-1")
                group.start_soon(held, agent, "stop-2")
                await anyio.to_thread.run_sync(upstream.wait_for_entries, 2, "charge")
                process.send_signal(signal.SIGTERM)
                await wait_for_stderr(proxy.process.stderr_path, "stopping: no new connections", process.poll)
                # The upstream answers later than rmcp waits for its
                # handlers once its sessions are ended (2 s): this sleep
                # is the case under test, not a synchronisation.
                await anyio.sleep(3)
                upstream.release("stop-1")
                await anyio.to_thread.run_sync(memory_atmost.wait_for_state, permit, "stop-1", "SUCCEEDED")
                assert memory_atmost.attempt(permit, "stop-2")["state"] == "ATTEMPT_STATE_RESERVED"
                process.send_signal(signal.SIGTERM)
                assert await anyio.to_thread.run_sync(lambda: process.wait(timeout=PATIENCE)) == 0
    entries = upstream.entries("charge")
    assert len(entries) == 2
    first = answers["stop-1"]
    assert not isinstance(first, Exception), repr(first)
    assert not first.is_error and first.meta[REPLAYED] is False
    assert tx(first) == next(e["id"] for e in entries if e["hold"] == "stop-1")
    second = answers["stop-2"]
    assert isinstance(second, MCPError) and second.code == UNCERTAIN, repr(second)
    attempt = memory_atmost.attempt(permit, "stop-2")
    assert attempt["state"] == "ATTEMPT_STATE_UNCERTAIN", attempt
    assert attempt["attemptId"] == second.error.data["attempt_id"]
    assert "atmost-mcp stopped before the upstream answered" in attempt["uncertainReason"], attempt


async def test_a_third_signal_exits_at_once(memory_atmost, upstream, start_proxy):
    """A connection that never ends (a request whose body never comes)
    keeps the graceful shutdown waiting after the first two signals; the
    third exits at once rather than being swallowed."""
    import socket

    permit = memory_atmost.permit("--cap", "charge=1")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit))
    process = proxy.process.process
    host, port = proxy.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=PATIENCE) as stuck:
        stuck.sendall(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\nExpect: 100-continue\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        # The server asks for the body once the proxy reads it: the request
        # is being served, and its body never comes.
        assert stuck.recv(64).startswith(b"HTTP/1.1 100 Continue"), "the proxy never read the request"
        process.send_signal(signal.SIGTERM)
        await wait_for_stderr(proxy.process.stderr_path, "stopping: no new connections", process.poll)
        process.send_signal(signal.SIGTERM)
        await wait_for_stderr(proxy.process.stderr_path, "no longer waiting for the upstream", process.poll)
        assert process.poll() is None, "the stuck request kept it serving"
        process.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(lambda: process.wait(timeout=PATIENCE))
    assert code == 1
    assert "signalled again: exiting now" in proxy.stderr()


async def test_a_broken_pipe_to_a_child_that_read_the_request_is_uncertain(memory_atmost, start_proxy, tmp_path):
    """EPIPE on the child's stdin proves only that the bytes of that one
    write were not delivered: here the newline after a request whose JSON
    the child has whole (tests/pipe_upstream.py, which reads as Go's
    json.Decoder does, charges, and closes its stdin before the proxy can
    write the newline). The call is UNCERTAIN, not given back. A call
    none of whose bytes were written, the pipe being already broken, is
    NOT_SENT."""
    permit = memory_atmost.permit("--cap", "charge=3")
    ledger = tmp_path / "ledger.jsonl"
    ledger.touch()
    proxy = start_proxy("--server", memory_atmost.url, "--permit", permit, "--",
                        sys.executable, str(PIPE_UPSTREAM), "--ledger", str(ledger))

    def entries() -> List[Dict[str, Any]]:
        return [json.loads(line) for line in ledger.read_text().splitlines()]

    async with Client(proxy.url, mode="legacy") as agent:
        # Listed now: the SDK lists the tools after a call to a tool it has
        # not seen, and the child reads nothing but the trap after the first.
        await agent.list_tools()
        first = await call(agent, "charge", {"amount": 1, "pad": ""}, key="pipe-1")
        sized = json.loads(first.content[0].text)
        # The next request is the same but for its id, amount and pad: its
        # JSON, newline aside, fills the child's stdin pipe exactly.
        pad = sized["pipe"] - sized["length"] - (len(str(sized["id"] + 1)) - len(str(sized["id"])))
        lost = await refused(call(agent, "charge", {"amount": 2, "pad": "x" * pad}, key="pipe-2"))
        # The charge happened, on a request of exactly the pipe's size...
        assert not [e for e in entries() if e["tool"] == "error"], entries()
        charged = entries()[-1]
        assert charged["amount"] == 2 and charged["length"] == sized["pipe"]
        assert charged["attempt_id"] == lost.error.data["attempt_id"]
        # ...so it is not given back.
        assert lost.code == UNCERTAIN, lost.error
        assert lost.error.data["reason"] == "OUTCOME_UNCERTAIN"
        # The write failed (not the read: the child's stdout is still open).
        assert "Broken pipe" in lost.error.data["uncertain_reason"], lost.error.data
        assert memory_atmost.attempt(permit, "pipe-2")["state"] == "ATTEMPT_STATE_UNCERTAIN"

        # The pipe stays broken: nothing of the next call is written.
        unsent = await refused(call(agent, "charge", {"amount": 3, "pad": ""}, key="pipe-3"))
        assert unsent.code == NOT_SENT, unsent.error
        assert memory_atmost.attempt(permit, "pipe-3")["state"] == "ATTEMPT_STATE_RELEASED"
    assert [e["amount"] for e in entries()] == [1, 2]
    assert memory_atmost.calls_made(permit, "charge") == 2


async def test_https_upstream_trusted_through_its_ca(memory_atmost, tmp_path, start_proxy):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "up.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "up.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    upstream = Upstream(tmp_path, tls=["--tls-cert", str(tmp_path / "up.pem"), "--tls-key", str(tmp_path / "up.key")])
    try:
        assert upstream.url.startswith("https://")
        permit = memory_atmost.permit("--cap", "charge=2")
        trusted = start_proxy(*permit_args(memory_atmost, upstream, permit, "--upstream-tls-ca", str(tmp_path / "ca.pem")))
        untrusted = start_proxy(*permit_args(memory_atmost, upstream, permit))
        async with Client(trusted.url, mode="legacy") as agent:
            done = await charge(agent, 1, key="tls-1")
            assert done.meta[REPLAYED] is False
        async with Client(untrusted.url, mode="legacy") as agent:
            # The handshake fails: the proxy has no upstream to send to, so
            # it does not even ask atmost.
            unsent = await refused(charge(agent, 1, key="tls-2"))
        assert unsent.code == NOT_SENT
        assert "attempt_id" not in unsent.error.data
        assert "certificate" in unsent.error.data["upstream_error"].lower()
        assert memory_atmost.calls_made(permit, "charge") == 1
        assert len(upstream.entries("charge")) == 1
    finally:
        upstream.stop()


def test_only_allowed_hosts_are_served(memory_atmost, upstream, start_proxy):
    permit = memory_atmost.permit("--cap", "charge=1")
    loopback_only = start_proxy(*permit_args(memory_atmost, upstream, permit))
    named = start_proxy(*permit_args(memory_atmost, upstream, permit, "--allowed-host", "mcp.internal"))
    initialize = {
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    headers = {"accept": "application/json, text/event-stream", "host": "mcp.internal"}
    with httpx2.Client(timeout=30.0) as http:
        # A Host the proxy was not told about (DNS rebinding): refused.
        assert http.post(loopback_only.url, json=initialize, headers=headers).status_code == 403
        assert http.post(named.url, json=initialize, headers=headers).status_code == 200


# === atmost's side: TLS, keys, costs, unreachable ===


async def test_tls_and_api_keys(tmp_path, upstream, start_proxy):
    import secrets

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "both.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    admin, agent_key = secrets.token_hex(16), secrets.token_hex(16)

    def entry(name: str, key: str, role: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return f'[[key]]\nid = "{name}"\nsha256 = "{digest}"\ntenant = "t"\nroles = ["{role}"]\n\n'

    (tmp_path / "keys.toml").write_text(entry("admin", admin, "admin") + entry("proxy", agent_key, "agent"))
    (tmp_path / "admin.key").write_text(admin + "\n")
    (tmp_path / "agent.key").write_text(agent_key + "\n")
    (tmp_path / "wrong.key").write_text("not-a-key\n")
    server = Atmost(
        tmp_path,
        ["--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"),
         "--auth-keys", str(tmp_path / "keys.toml")],
        scheme="https",
        cli_args=["--tls-ca", str(tmp_path / "ca.pem"), "--api-key-file", str(tmp_path / "admin.key")],
    )
    try:
        permit = server.permit("--cap", "charge=2")
        common = ["--server", server.url, "--tls-ca", str(tmp_path / "ca.pem"),
                  "--upstream", upstream.url, "--permit", permit]
        good = start_proxy(*common, "--api-key-file", str(tmp_path / "agent.key"))
        from_env = start_proxy(*common, env={**clean_env(), "ATMOST_API_KEY": agent_key})
        wrong = start_proxy(*common, "--api-key-file", str(tmp_path / "wrong.key"))
        no_ca = start_proxy("--server", server.url, "--upstream", upstream.url, "--permit", permit,
                            "--api-key-file", str(tmp_path / "agent.key"))
        async with Client(good.url, mode="legacy") as agent:
            await charge(agent, 1, key="t-1")
        async with Client(from_env.url, mode="legacy") as agent:
            await charge(agent, 1, key="t-2")
        async with Client(wrong.url, mode="legacy") as agent:
            refusal = await refused(charge(agent, 1, key="t-3"))
        assert refusal.code == DENIED and refusal.error.data["reason"] == "UNAUTHENTICATED"
        async with Client(no_ca.url, mode="legacy") as agent:
            untrusted = await refused(charge(agent, 1, key="t-4"))
        # A certificate the system does not trust: atmost cannot be asked.
        assert untrusted.code == UNAVAILABLE
        assert len(upstream.entries("charge")) == 2
    finally:
        server.stop()


async def test_costs_come_from_the_table(memory_atmost, upstream, start_proxy, tmp_path):
    (tmp_path / "costs.toml").write_text('default = 1\n\n[tools]\ncharge = 200\n')
    permit = memory_atmost.permit("--tool", "charge,echo", "--budget", "500")
    proxy = start_proxy(*permit_args(memory_atmost, upstream, permit, "--costs", str(tmp_path / "costs.toml")))
    async with Client(proxy.url, mode="legacy") as agent:
        await charge(agent, 1, key="c-1")
        await charge(agent, 1, key="c-2")
        over = await refused(charge(agent, 1, key="c-3"))
        assert over.code == DENIED and over.error.data["reason"] == "PERMIT_BUDGET_EXCEEDED"
        await call(agent, "echo", {"text": "a"}, key="c-4")  # the default cost, 1
    usage = memory_atmost.cli("permit", "get", permit)
    assert int(usage["budgetCommitted"]) == 401
    assert len(upstream.entries("charge")) == 2


async def test_atmost_unreachable_fails_closed(upstream, start_proxy):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proxy = start_proxy("--server", dead, "--upstream", upstream.url, "--permit",
                        "0190f3a0-0000-7000-8000-000000000000", "--timeout", "1s")
    async with Client(proxy.url, mode="legacy") as agent:
        error = await refused(charge(agent, 1, key="u-1"))
    assert error.code == UNAVAILABLE
    assert error.error.data["reason"] == "ATMOST_UNAVAILABLE"
    assert upstream.entries() == []


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--permit", "p"], {}, "no upstream"),
        (["--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--", "python3"], {}, "not both"),
        (["--permit", "p", "--upstream", "ftp://x"], {}, "http:// or https://"),
        (["--upstream", "http://127.0.0.1:9/mcp"], {}, "no permit"),
        (["--stdio", "--permit-header", "x-p", "--upstream", "http://127.0.0.1:9/mcp"], {}, "needs HTTP"),
        (["--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--tls-ca", "/x"], {}, "need an https://"),
        (["--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--costs", "/nonexistent.toml"], {}, "--costs"),
        # No time to send any call: every one would fail.
        (["--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--dispatch-timeout", "0s"], {},
         "--dispatch-timeout"),
        # A pinned permit and a header that could name another: refused,
        # by flags or by their variables.
        (["--permit", "p", "--permit-header", "x-p", "--upstream", "http://127.0.0.1:9/mcp"], {},
         "give --permit (ATMOST_MCP_PERMIT) or --permit-header (ATMOST_MCP_PERMIT_HEADER), not both"),
        (["--upstream", "http://127.0.0.1:9/mcp"], {"ATMOST_MCP_PERMIT": "p", "ATMOST_MCP_PERMIT_HEADER": "x-p"},
         "give --permit (ATMOST_MCP_PERMIT) or --permit-header (ATMOST_MCP_PERMIT_HEADER), not both"),
        # A permit variable set but empty (a template's `VAR=`) counts as
        # not set: the flags get as far as the missing cost table, not
        # "not both" or an empty header name.
        (["--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--costs", "/nonexistent.toml"],
         {"ATMOST_MCP_PERMIT_HEADER": ""}, "--costs /nonexistent.toml"),
        (["--permit-header", "x-p", "--upstream", "http://127.0.0.1:9/mcp", "--costs", "/nonexistent.toml"],
         {"ATMOST_MCP_PERMIT": ""}, "--costs /nonexistent.toml"),
        (["--upstream", "http://127.0.0.1:9/mcp"], {"ATMOST_MCP_PERMIT": "", "ATMOST_MCP_PERMIT_HEADER": ""},
         "no permit"),
        # Set but blank is not empty: refused, naming the variable.
        (["--upstream", "http://127.0.0.1:9/mcp"], {"ATMOST_MCP_PERMIT": " "}, "--permit (ATMOST_MCP_PERMIT) is empty"),
    ],
)
def test_bad_configuration_is_refused(args, env, says):
    done = run_proxy(*args, env={**clean_env(), **env})
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.decode()
    assert done.stdout == b""


@pytest.mark.parametrize(
    "text, says",
    [
        ("default = -1\n", "default = -1"),
        ("[tools]\ncharge = 9007199254740992\n", 'tools."charge"'),
        ("budget = 3\n", "unknown field"),
        ("[tools]\ncharge = \"cheap\"\n", "invalid type"),
    ],
)
def test_bad_cost_table_is_refused(tmp_path, text, says):
    (tmp_path / "costs.toml").write_text(text)
    done = run_proxy("--permit", "p", "--upstream", "http://127.0.0.1:9/mcp", "--costs", str(tmp_path / "costs.toml"))
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.decode()
