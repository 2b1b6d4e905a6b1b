"""atmost-mcp and human approval (issue 27): a permit's approval rule holds
a tool's calls until a person approves them. The proxy never forwards a
held call: it answers a tool error (isError) the model can read, saying
the call waits for approval and to make the same call again later. Once an
approver has approved it (atmost's Approvals service, with an approver's
key), the same call again is forwarded exactly once and answers the tool's
result; a denied one answers the denial and is never forwarded.

The agents are the official Python MCP SDK's Client; the approver calls
atmost itself (conftest.ApprovalAtmost). The upstream's ledger is its own
record of every side effect. Every test runs on both stores.
"""

from __future__ import annotations

import calendar
import json
import re
import signal
import time
from typing import Any, Dict, List, Optional

import anyio
import pytest
from conftest import PATIENCE, ApprovalAtmost, Upstream, wait_for_stderr
from mcp.client import Client
from mcp.shared.exceptions import MCPError

pytestmark = pytest.mark.anyio

KEY = "io.atmost/idempotency-key"
ATTEMPT = "io.atmost/attempt-id"
REPLAYED = "io.atmost/replayed"
REASON = "io.atmost/reason"
EXPIRES = "io.atmost/approval-expires-at"
DENIED = -32080
DERIVED = re.compile(r"mcp:([0-9a-f-]{36}):([0-9]+)")


async def charge(agent: Client, amount: int, key: Optional[str] = None):
    meta = {KEY: key} if key is not None else None
    return await agent.call_tool("charge", {"amount": amount}, meta=meta)


async def refused(coroutine) -> MCPError:
    with pytest.raises(MCPError) as caught:
        await coroutine
    return caught.value


def body(result) -> Dict[str, Any]:
    return result.model_dump(mode="json", by_alias=True, exclude={"meta"}, exclude_none=True)


def proxy_args(atmost: ApprovalAtmost, upstream: Upstream, permit: str, *more: str) -> List[str]:
    return ["--server", atmost.url, "--api-key-file", str(atmost.agent_key_file),
            "--upstream", upstream.url, "--permit", permit, *more]


def awaits_approval(result, key: Optional[str] = None) -> str:
    """Checks that `result` is the proxy's answer to a held call; its
    attempt id."""
    assert result.is_error is True, result
    text = result.content[0].text
    assert "waiting for a person's approval" in text and "Not sent" in text, text
    assert "same call again later" in text and "same arguments" in text, text
    meta = result.meta
    assert meta[REASON] == "AWAITING_APPROVAL" and meta[REPLAYED] is False, meta
    if key is not None:
        assert meta[KEY] == key
    assert f'"{meta[KEY]}"' in text, "the text names the key"
    # The request's lapse, in the text, in _meta and in structuredContent
    # (the server's default wait: 15 minutes).
    expires = meta[EXPIRES]
    assert expires in text
    lapse = calendar.timegm(time.strptime(expires, "%Y-%m-%dT%H:%M:%SZ"))
    assert 14 * 60 < lapse - time.time() <= 15 * 60 + 5, expires
    structured = result.structured_content
    assert structured["reason"] == "AWAITING_APPROVAL"
    assert structured["message"] == text
    assert structured["idempotency_key"] == meta[KEY]
    assert structured["attempt_id"] == meta[ATTEMPT]
    assert structured["approval_expires_at"] == expires
    return meta[ATTEMPT]


async def test_a_held_call_is_not_sent_until_approved_then_sent_once(approval_atmost, upstream, start_proxy):
    atmost = approval_atmost
    permit = atmost.approval_permit({"charge": 3}, approval=["charge", "echo"])
    proxy = start_proxy(*proxy_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        held = await charge(agent, 500, key="pay-1")
        attempt = awaits_approval(held, "pay-1")
        assert held.structured_content["tool"] == "charge"
        assert held.structured_content["permit_id"] == permit
        # Asked again before anyone decided: the same answer, still unsent.
        again = await charge(agent, 500, key="pay-1")
        assert awaits_approval(again, "pay-1") == attempt
        assert upstream.entries() == []

        # The approver sees the call, described by the proxy.
        pending = atmost.awaiting(permit, "pay-1")
        assert pending["attemptId"] == attempt
        assert pending["state"] == "ATTEMPT_STATE_AWAITING_APPROVAL"
        assert pending["approval"]["summary"] == 'charge {"amount":500}'
        approved = atmost.approve(permit, "pay-1", attempt)
        assert approved["state"] == "ATTEMPT_STATE_APPROVED"
        assert upstream.entries() == []  # an approval alone sends nothing

        # The same call again: forwarded, once, and its result answered.
        sent = await charge(agent, 500, key="pay-1")
        assert not sent.is_error, sent
        assert sent.meta[REPLAYED] is False and sent.meta[ATTEMPT] == attempt
        entries = upstream.entries("charge")
        assert len(entries) == 1 and entries[0]["attempt_id"] == attempt and entries[0]["amount"] == 500
        assert json.loads(sent.content[0].text)["tx"] == entries[0]["id"]
        # And after that it replays.
        replay = await charge(agent, 500, key="pay-1")
        assert replay.meta[REPLAYED] is True and body(replay) == body(sent)

        # Long arguments: the summary is cut to atmost's 1024 bytes.
        long = await agent.call_tool("echo", {"text": "é" * 3000}, meta={KEY: "echo-1"})
        awaits_approval(long, "echo-1")
        summary = atmost.awaiting(permit, "echo-1")["approval"]["summary"]
        assert summary.startswith('echo {"text":"éé') and summary.endswith("…")
        assert 1000 < len(summary.encode()) <= 1024
    assert len(upstream.entries("charge")) == 1
    assert atmost.attempt(permit, "pay-1")["state"] == "ATTEMPT_STATE_SUCCEEDED"
    assert atmost.calls_made(permit, "charge") == 1


async def test_a_keyless_retry_of_a_held_call_finds_its_key(approval_atmost, upstream, start_proxy):
    """An agent that sends no key of its own retries in a new JSON-RPC
    request (a new derived key), or with no session at all (a fresh key
    each time). While the call waits for approval, the same call (tool,
    arguments, session) takes the key it was first asked under, so the
    approval is found and the call is sent once; other arguments are
    another call."""
    atmost = approval_atmost
    permit = atmost.approval_permit({"charge": 10}, approval=["charge"])
    proxy = start_proxy(*proxy_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        first = await charge(agent, 700)
        attempt = awaits_approval(first)
        key = first.meta[KEY]
        assert DERIVED.fullmatch(key), key
        retry = await charge(agent, 700)
        assert awaits_approval(retry, key) == attempt
        other = await charge(agent, 701)
        awaits_approval(other)
        assert other.meta[KEY] != key
        atmost.approve(permit, key, atmost.awaiting(permit, key)["attemptId"])
        sent = await charge(agent, 700)
        assert not sent.is_error and sent.meta[KEY] == key and sent.meta[ATTEMPT] == attempt
        assert [e["amount"] for e in upstream.entries("charge")] == [700]
        # Sent: the same call once more is a new intent, held anew.
        later = await charge(agent, 700)
        awaits_approval(later)
        assert later.meta[KEY] not in (key, other.meta[KEY])
    # Another session: not the same call as this one's.
    async with Client(proxy.url, mode="legacy") as stranger:
        theirs = await charge(stranger, 701)
        awaits_approval(theirs)
        assert theirs.meta[KEY] != other.meta[KEY]
    # No session (2026-07-28): fresh keys, and the retry still finds its own.
    async with Client(proxy.url, mode="auto") as stateless:
        assert stateless.protocol_version == "2026-07-28"
        a = await charge(stateless, 900)
        awaits_approval(a)
        assert a.meta[KEY].startswith("mcp:fresh:")
        b = await charge(stateless, 900)
        assert awaits_approval(b, a.meta[KEY]) == a.meta[ATTEMPT]
    assert [e["amount"] for e in upstream.entries("charge")] == [700]
    held = {a["idempotencyKey"] for a in atmost.approvals(permit)}
    assert held == {other.meta[KEY], later.meta[KEY], theirs.meta[KEY], a.meta[KEY]}


async def test_a_denied_call_is_never_sent(approval_atmost, upstream, start_proxy):
    atmost = approval_atmost
    permit = atmost.approval_permit({"charge": 3}, approval=["charge"])
    proxy = start_proxy(*proxy_args(atmost, upstream, permit))
    async with Client(proxy.url, mode="legacy") as agent:
        attempt = awaits_approval(await charge(agent, 5000, key="big-1"))
        denied = atmost.deny(permit, "big-1", attempt, "over today's limit")
        assert denied["state"] == "ATTEMPT_STATE_DENIED"
        for _ in range(2):
            error = await refused(charge(agent, 5000, key="big-1"))
            assert error.code == DENIED
            assert "over today's limit" in error.message and "do not retry" in error.message
            data = error.error.data
            assert data["reason"] == "APPROVAL_DENIED" and data["denial_reason"] == "over today's limit"
            assert data["decided_by"] == ApprovalAtmost.APPROVER and data["attempt_id"] == attempt
            assert data["idempotency_key"] == "big-1" and data["tool"] == "charge"

        # Without a key: the retry hears the denial; the same call after
        # that is a new request for approval.
        first = await charge(agent, 6000)
        key = first.meta[KEY]
        atmost.deny(permit, key, awaits_approval(first), "no")
        error = await refused(charge(agent, 6000))
        assert error.error.data["reason"] == "APPROVAL_DENIED"
        assert error.error.data["idempotency_key"] == key
        anew = await charge(agent, 6000)
        awaits_approval(anew)
        assert anew.meta[KEY] != key
    assert upstream.entries() == []
    assert atmost.attempt(permit, "big-1")["state"] == "ATTEMPT_STATE_DENIED"
    # A denied call gives its slot back: only the last request holds one.
    assert atmost.calls_made(permit, "charge") == 1


async def test_approval_wait_holds_the_call_open_until_it_is_decided(approval_atmost, upstream, start_proxy):
    """With --approval-wait the tools/call stays open while it waits: sent
    and answered with the tool's result as soon as it is approved, or
    answered the denial."""
    atmost = approval_atmost
    permit = atmost.approval_permit({"charge": 3}, approval=["charge"])
    proxy = start_proxy(*proxy_args(atmost, upstream, permit, "--approval-wait", "60s"))
    answers: Dict[str, Any] = {}

    async def held(agent: Client, key: str) -> None:
        try:
            answers[key] = await charge(agent, 42, key=key)
        except MCPError as e:
            answers[key] = e

    async with Client(proxy.url, mode="legacy") as agent:
        await agent.list_tools()
        with anyio.fail_after(PATIENCE):
            async with anyio.create_task_group() as group:
                group.start_soon(held, agent, "w-1")
                group.start_soon(held, agent, "w-2")
                one = await anyio.to_thread.run_sync(atmost.awaiting, permit, "w-1")
                two = await anyio.to_thread.run_sync(atmost.awaiting, permit, "w-2")
                # Held across a few of the proxy's 5 s steps, unanswered.
                await anyio.sleep(6)
                assert answers == {} and upstream.entries() == []
                atmost.approve(permit, "w-1", one["attemptId"])
                atmost.deny(permit, "w-2", two["attemptId"], "not this one")
    sent = answers["w-1"]
    assert not isinstance(sent, MCPError) and not sent.is_error, sent
    assert sent.meta[REPLAYED] is False and sent.meta[ATTEMPT] == one["attemptId"]
    denied = answers["w-2"]
    assert isinstance(denied, MCPError) and denied.code == DENIED, denied
    assert denied.error.data["denial_reason"] == "not this one" and denied.error.data["replayed"] is False
    entries = upstream.entries("charge")
    assert [e["attempt_id"] for e in entries] == [one["attemptId"]]


async def test_a_held_call_does_not_hold_up_the_proxys_exit(approval_atmost, upstream, start_proxy):
    """A call held open by a long --approval-wait (nothing sent) is answered
    "awaiting approval" soon after SIGTERM, and the proxy exits; the call
    still waits in atmost, for the agent's later retry."""
    atmost = approval_atmost
    permit = atmost.approval_permit({"charge": 3}, approval=["charge"])
    proxy = start_proxy(*proxy_args(atmost, upstream, permit, "--approval-wait", "10m"))
    process = proxy.process.process
    answers: Dict[str, Any] = {}
    async with Client(proxy.url, mode="legacy") as agent:
        await agent.list_tools()

        async def held() -> None:
            answers["stop-1"] = await charge(agent, 9, key="stop-1")

        with anyio.fail_after(PATIENCE):
            async with anyio.create_task_group() as group:
                group.start_soon(held)
                await anyio.to_thread.run_sync(atmost.awaiting, permit, "stop-1")
                process.send_signal(signal.SIGTERM)
                await wait_for_stderr(proxy.process.stderr_path, "stopping: no new connections", process.poll)
        awaits_approval(answers["stop-1"], "stop-1")
        assert await anyio.to_thread.run_sync(lambda: process.wait(timeout=PATIENCE)) == 0
    assert atmost.attempt(permit, "stop-1")["state"] == "ATTEMPT_STATE_AWAITING_APPROVAL"
    assert upstream.entries() == []
