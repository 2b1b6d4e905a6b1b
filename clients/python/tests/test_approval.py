"""Human approval through a live atmost with keys (the session's
``auth_server``: an agent, two approvers and an admin of one tenant, the
memory store): a call the permit's approval rule holds raises
AwaitingApproval without a wait; waited for, it dispatches once when an
approver approves, or raises ApprovalDenied when one denies, never
sending. The fake tool counts its side effects: "sent once" is a count."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Iterator, List

import grpc
import pytest

from atmost_client import (
    ApprovalDenied,
    AwaitingApproval,
    Client,
    Denied,
    Retry,
    approval_rule,
    pb,
)

TOOL = "payout"


class Tool:
    """A fake side-effecting tool: counts what it was sent."""

    def __init__(self) -> None:
        self.sent: List[str] = []

    def __call__(self, attempt_id: str) -> Any:
        self.sent.append(attempt_id)
        return {"paid": True}


def never(attempt_id: str) -> Any:
    raise AssertionError(f"dispatch called ({attempt_id}) where nothing may be sent")


@pytest.fixture
def clients(auth_server, keys) -> Iterator[dict]:
    made = {
        "admin": Client(auth_server.address, api_key=keys.admin),
        "agent": Client(auth_server.address, api_key=keys.agent),
        "alice": Client(auth_server.address, api_key=keys.approver),
        "bob": Client(auth_server.address, api_key=keys.approver_2),
    }
    yield made
    for c in made.values():
        c.close()


def new_permit(admin: Client, **rule: Any) -> str:
    """"payout" needs an approval from a cost of 1000 (unless ``rule``
    says otherwise), for 10 minutes; "refund" none."""
    rule = {"cost_at_least": 1000, "wait": 600, **rule}
    permit = admin.create_permit(
        [TOOL, "refund"],
        budget=1_000_000,
        approval_per_tool={TOOL: approval_rule(**rule)},
    )
    stored = permit.approval_per_tool[TOOL]
    assert (stored.cost_at_least if stored.HasField("cost_at_least") else None) == rule["cost_at_least"]
    return permit.permit_id


def later(seconds: float, action: Callable[[], Any]) -> Callable[[], Any]:
    """Runs ``action`` in a thread after ``seconds``; the returned join()
    waits for it and raises what it raised."""
    box: dict = {}

    def run() -> None:
        time.sleep(seconds)
        try:
            box["value"] = action()
        except BaseException as e:  # noqa: BLE001 (raised again in join)
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join(60)
        assert not thread.is_alive(), "the approver's thread did not finish"
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


def pay(agent: Client, permit: str, key: str, dispatch: Callable[[str], Any], **options: Any) -> Any:
    return agent.call_guarded(
        permit,
        TOOL,
        key,
        dispatch,
        request={"amount": 40_000, "key": key},
        cost=40_000,
        approval_summary=f"pay 40000 EUR ({key})",
        **options,
    )


def test_without_a_wait_the_call_raises_awaiting_and_sends_nothing(clients):
    admin, agent, alice = clients["admin"], clients["agent"], clients["alice"]
    permit = new_permit(admin)
    with pytest.raises(AwaitingApproval) as caught:
        pay(agent, permit, "payout-1", never)
    awaiting = caught.value
    assert awaiting.attempt_id
    assert awaiting.attempt.state == pb.ATTEMPT_STATE_AWAITING_APPROVAL
    now = datetime.datetime.now(datetime.timezone.utc)
    assert now < awaiting.expires_at <= now + datetime.timedelta(seconds=601)
    # The approvers see it, with the summary and the attempt id they need.
    [listed] = list(alice.iter_approvals(permit))
    assert (listed.idempotency_key, listed.attempt_id) == ("payout-1", awaiting.attempt_id)
    assert listed.approval.summary == "pay 40000 EUR (payout-1)"
    assert listed.approval.approvers_needed == 1
    # Asked again without a wait: the same attempt, still awaiting.
    with pytest.raises(AwaitingApproval) as again:
        pay(agent, permit, "payout-1", never)
    assert again.value.attempt_id == awaiting.attempt_id
    # Under the rule's threshold, or another tool: no approval needed.
    tool = Tool()
    small = agent.call_guarded(permit, TOOL, "small", tool, request={"amount": 5}, cost=5)
    assert small.result == {"paid": True}
    assert len(tool.sent) == 1


def test_an_approval_while_the_call_waits_dispatches_it_once(clients):
    admin, agent, alice = clients["admin"], clients["agent"], clients["alice"]
    permit = new_permit(admin)
    tool = Tool()
    with pytest.raises(AwaitingApproval) as caught:
        pay(agent, permit, "payout-1", tool)
    attempt_id = caught.value.attempt_id
    approved = later(0.3, lambda: alice.approve(permit, "payout-1", attempt_id))
    started = time.monotonic()
    done = pay(agent, permit, "payout-1", tool, approval_wait=30)
    took = time.monotonic() - started
    answer = approved()
    assert answer.attempt.state == pb.ATTEMPT_STATE_APPROVED
    assert answer.attempt.approval.decided_by == "py-approver"
    assert not done.replayed and not done.redelivered
    assert done.result == {"paid": True}
    assert done.attempt_id == attempt_id
    assert done.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED
    assert done.attempt.approval.approved_by == ["py-approver"]
    assert tool.sent == [attempt_id], "dispatched exactly once"
    assert took < 10, f"the held Authorize answered at the decision, not at the wait's end ({took:.1f} s)"
    # The same call again: a replay of the receipt, nothing sent.
    again = pay(agent, permit, "payout-1", never, approval_wait=30)
    assert again.replayed and again.json() == {"paid": True}
    assert list(alice.iter_approvals(permit)) == []


def test_a_denial_while_the_call_waits_raises_it_and_never_sends(clients):
    admin, agent, bob = clients["admin"], clients["agent"], clients["bob"]
    permit = new_permit(admin)
    with pytest.raises(AwaitingApproval) as caught:
        pay(agent, permit, "payout-2", never)
    attempt_id = caught.value.attempt_id
    denied = later(0.3, lambda: bob.deny(permit, "payout-2", attempt_id, "not today"))
    with pytest.raises(ApprovalDenied) as caught_denial:
        pay(agent, permit, "payout-2", never, approval_wait=30)
    assert denied().attempt.state == pb.ATTEMPT_STATE_DENIED
    denial = caught_denial.value
    assert (denial.denial_reason, denial.decided_by, denial.replayed) == ("not today", "py-approver-2", False)
    assert denial.attempt_id == attempt_id
    assert denial.reason is None  # no ErrorInfo: atmost answered a REPLAY, not an error
    # The key replays the denial from now on, waited for or not.
    for wait in (0, 30):
        with pytest.raises(ApprovalDenied) as replayed:
            pay(agent, permit, "payout-2", never, approval_wait=wait)
        assert (replayed.value.denial_reason, replayed.value.replayed) == ("not today", True)
    # The slot and the cost came back.
    usage = admin.get_permit(permit)
    assert {u.tool: u.calls_made for u in usage.usage}.get(TOOL, 0) == 0


def test_a_wait_that_runs_out_raises_awaiting(clients):
    admin, agent = clients["admin"], clients["agent"]
    permit = new_permit(admin)
    started = time.monotonic()
    with pytest.raises(AwaitingApproval) as caught:
        pay(agent, permit, "payout-3", never, approval_wait=datetime.timedelta(seconds=1.5))
    took = time.monotonic() - started
    assert 1.4 <= took < 6, took
    assert caught.value.attempt.state == pb.ATTEMPT_STATE_AWAITING_APPROVAL


def test_the_context_manager_and_the_decorator_wait_too(clients):
    admin, agent, alice = clients["admin"], clients["agent"], clients["alice"]
    permit = new_permit(admin, cost_at_least=None)
    with pytest.raises(AwaitingApproval):
        with agent.guard(permit, TOOL, "cm-1", request={"n": 1}, approval_summary="cm"):
            raise AssertionError("the block ran for a call awaiting approval")
    [listed] = list(alice.iter_approvals(permit))
    joined = later(0.3, lambda: alice.approve(permit, "cm-1", listed.attempt_id))
    with agent.guard(permit, TOOL, "cm-1", request={"n": 1}, approval_wait=30) as call:
        assert not call.replayed
        outcome = call.succeeded("sent")
    joined()
    assert outcome.attempt.state == pb.ATTEMPT_STATE_SUCCEEDED

    tool = Tool()

    @agent.guarded(
        permit_id=permit,
        tool=TOOL,
        key=lambda order: f"order-{order}",
        approval_summary=lambda order: f"payout for order {order}",
    )
    def payout(order: int, *, attempt_id: str) -> Any:
        return tool(attempt_id)

    with pytest.raises(AwaitingApproval):
        payout(7)
    [listed] = list(alice.iter_approvals(permit))
    assert listed.approval.summary == "payout for order 7"


def test_an_approval_late_in_a_long_hold_still_leaves_the_lease_to_send(clients):
    """A claim late in a held Authorize: its lease_remaining was measured
    at the claim, and counted from the ask's start it could be all gone.
    The call asks once more (the same token: the same DISPATCH, redelivered
    to it) and counts the lease from there."""
    admin, agent, alice = clients["admin"], clients["agent"], clients["alice"]
    permit = admin.create_permit(
        [TOOL], lease=3.0, approval_per_tool={TOOL: approval_rule(wait=600)}
    ).permit_id
    tool = Tool()
    with pytest.raises(AwaitingApproval) as caught:
        pay(agent, permit, "late", tool)
    approved = later(4.0, lambda: alice.approve(permit, "late", caught.value.attempt_id))
    call = agent.guard(
        permit, TOOL, "late", request={"amount": 40_000, "key": "late"}, cost=40_000, approval_wait=30
    )
    with call:
        assert call.time_left() > 1.0, call.time_left()
        call.succeeded(tool(call.attempt_id))
    approved()
    assert not call.redelivered
    assert tool.sent == [caught.value.attempt_id]


def test_a_hold_the_servers_request_timeout_cuts_is_asked_again_not_retried(start_server, tmp_path, keys):
    (tmp_path / "keys.toml").write_text(keys.toml())
    server = start_server("--auth-keys", str(tmp_path / "keys.toml"), "--request-timeout", "3s")
    retries: List[tuple] = []
    with (
        Client(server.address, api_key=keys.admin) as admin,
        Client(
            server.address, api_key=keys.agent, retry=Retry(on_retry=lambda *a: retries.append(a))
        ) as agent,
        Client(server.address, api_key=keys.approver) as alice,
    ):
        permit = new_permit(admin)
        tool = Tool()
        with pytest.raises(AwaitingApproval) as caught:
            pay(agent, permit, "cut", tool)
        approved = later(7.0, lambda: alice.approve(permit, "cut", caught.value.attempt_id))
        done = pay(agent, permit, "cut", tool, approval_wait=20)
        approved()
    assert done.result == {"paid": True} and tool.sent == [caught.value.attempt_id]
    assert retries == [], "a hold cut at the server's request timeout is no failure to back off from"


def test_nobody_approves_their_own_call_and_agents_never_approve(clients):
    admin, agent = clients["admin"], clients["agent"]
    permit = new_permit(admin)
    fingerprint = b"\x01" * 32
    mine = admin.authorize(permit, TOOL, "admins-own", fingerprint, cost=5000, approval_summary="mine")
    assert mine.decision == pb.DECISION_AWAIT_APPROVAL
    assert mine.approval_remaining.ToTimedelta() > datetime.timedelta(seconds=500)
    with pytest.raises(Denied) as own:
        admin.approve(permit, "admins-own", mine.attempt.attempt_id)
    assert own.value.reason == "APPROVER_IS_REQUESTER"
    assert own.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(Denied) as role:
        agent.approve(permit, "admins-own", mine.attempt.attempt_id)
    assert role.value.reason == "ROLE_NOT_ALLOWED"
    # A wait on the plain RPC: held until the deadline's end, still awaiting.
    started = time.monotonic()
    held = admin.authorize(permit, TOOL, "admins-own", fingerprint, cost=5000, wait=1.0)
    assert held.decision == pb.DECISION_AWAIT_APPROVAL
    assert 0.9 <= time.monotonic() - started < 5
    denied = admin.deny(permit, "admins-own", mine.attempt.attempt_id)
    assert denied.attempt.approval.denial_reason == "denied"


def test_the_options_are_checked_before_anything_is_sent(client):
    permit = "p"
    with pytest.raises(ValueError, match="approval_summary"):
        client.guard(permit, TOOL, "k", request={}, approval_summary="x" * 1025)
    for wait in (-1, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ValueError, match="approval_wait"):
            client.guard(permit, TOOL, "k", request={}, approval_wait=wait)
    with pytest.raises(TypeError, match="approval_per_tool"):
        client.create_permit([TOOL], approval_per_tool={TOOL: {"approvers": 1}})
    rule = approval_rule(wait=datetime.timedelta(minutes=5), approvers=2)
    assert (rule.HasField("cost_at_least"), rule.wait.seconds, rule.approvers) == (False, 300, 2)
