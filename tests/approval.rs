//! Human approval through the real server, on each store: a call the
//! permit's approval rule holds waits (slot and cost reserved), is
//! approved by another key or denied, or lapses; the requester's same key
//! then dispatches once, or replays the denial. Keys: an agent, two
//! approvers and an admin, one tenant.

use crate::auth::{KeyFile, entry};
use crate::support::*;
use atmost::store::Backend;
use atmost::store::memory::MemoryStore;
use pb::{AttemptState, Decision};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

const AGENT: &str = "agent-secret-approval-0123";
const ALICE: &str = "alice-secret-approval-0123";
const BOB: &str = "bob-secret-approval-0123";
const ADMIN: &str = "admin-secret-approval-0123";
const WAIT: Duration = Duration::from_secs(600);

macro_rules! on_every_store {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = crate::support::shared().await;
                    super::$name(super::World::start(crate::support::Kind::Memory).await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = crate::support::shared().await;
                    super::$name(super::World::start(crate::support::Kind::Redis).await).await;
                }
            )*
        }
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = crate::support::shared().await;
                    super::$name(super::World::start(crate::support::Kind::Cluster).await).await;
                }
            )*
        }
    };
}

on_every_store!(
    a_payout_above_the_threshold_waits_is_approved_by_another_key_and_dispatches_once,
    a_denied_call_never_dispatches_and_replays_its_denial,
    a_request_nobody_decides_lapses_and_returns_its_slot,
    fifty_concurrent_requests_against_a_cap_of_five_leave_five_pending,
    agents_never_approve_and_nobody_approves_their_own_call,
    the_four_eyes_rule_needs_two_distinct_approvers,
    a_waiting_authorize_is_one_call_answered_at_the_decision,
    approvers_list_what_waits_oldest_first_across_permits,
    the_rust_guarded_call_waits_for_the_decision_then_dispatches_or_raises,
    an_approval_late_in_a_held_ask_still_leaves_its_lease_to_send,
);

/// The server with keys, and a client per key.
struct World {
    h: Harness,
    agent: Client,
    alice: Client,
    bob: Client,
    admin: Client,
    _keys: KeyFile,
}

impl World {
    async fn start(kind: Kind) -> Self {
        let keys = KeyFile::new(
            &[
                entry("agent-1", AGENT, "acme", "\"agent\""),
                entry("alice", ALICE, "acme", "\"approver\""),
                entry("bob", BOB, "acme", "\"approver\""),
                entry("admin-1", ADMIN, "acme", "\"admin\""),
            ]
            .concat(),
        );
        let auth = Arc::new(atmost::auth::Authenticator::load(&keys.path).expect("keys"));
        let redis = (kind == Kind::Redis).then(Redis::start);
        let prefix = format!("t{}", uuid::Uuid::now_v7().simple());
        let backend = match (kind, &redis) {
            (Kind::Memory, _) => Backend::Memory(MemoryStore::new(DAY_MS)),
            (Kind::Redis, Some(r)) => {
                Backend::Redis(redis_store(&r.url, &r.prefix, Duration::from_secs(2)))
            }
            (Kind::Cluster, _) => {
                let urls = tokio::task::block_in_place(shared_cluster);
                Backend::Redis(cluster_store(urls, &prefix, Duration::from_secs(2)))
            }
            (Kind::Redis, None) => unreachable!(),
        };
        let h = Harness::serve(backend, redis, |app| app.with_auth(auth)).await;
        let as_key = |key: &str| h.client.clone().with_api_key(key).expect("ascii");
        Self {
            agent: as_key(AGENT),
            alice: as_key(ALICE),
            bob: as_key(BOB),
            admin: as_key(ADMIN),
            h,
            _keys: keys,
        }
    }

    /// "payout" needs `approvers` approvals from a cost of 1000, capped
    /// at `cap`, budget 100 000; "refund" needs none.
    async fn permit(&self, cap: u64, approvers: u32) -> String {
        let permit = NewPermit::new(["payout", "refund"])
            .expires_at_ms(self.h.now_ms() + 3_600_000)
            .cap("payout", cap)
            .budget(100_000)
            .approval("payout", Some(1000), Some(WAIT), approvers)
            .build();
        let created = self.admin.create_permit(permit).await.expect("create");
        let rule = &created.approval_per_tool["payout"];
        assert_eq!(rule.cost_at_least, Some(1000));
        assert_eq!(rule.approvers, approvers.max(1));
        let got = self
            .admin
            .get_permit(&created.permit_id)
            .await
            .expect("get");
        assert_eq!(
            got.permit.expect("permit").approval_per_tool,
            created.approval_per_tool,
            "GetPermit shows the rule"
        );
        created.permit_id
    }

    fn request(&self, permit: &str, key: &str, cost: i64) -> pb::AuthorizeRequest {
        pb::AuthorizeRequest {
            permit_id: permit.into(),
            tool: "payout".into(),
            idempotency_key: key.into(),
            request_fingerprint: format!("payout {key} {cost}").into_bytes(),
            cost,
            holder_token: b"holder-of-this-call".to_vec(),
            approval_summary: format!("pay {cost} EUR to IBAN DE00 ({key})"),
            ..Default::default()
        }
    }

    async fn ask(&self, permit: &str, key: &str, cost: i64) -> pb::AuthorizeResponse {
        self.agent
            .authorize(self.request(permit, key, cost))
            .await
            .unwrap_or_else(|e| panic!("{key}: {e:?}"))
    }

    async fn awaiting(&self, permit: &str, key: &str, cost: i64) -> pb::Attempt {
        let r = self.ask(permit, key, cost).await;
        assert_eq!(r.decision(), Decision::AwaitApproval, "{key}: {r:?}");
        assert!(r.lease_remaining.is_none(), "nothing may be sent: {r:?}");
        assert!(r.approval_remaining.is_some(), "{r:?}");
        let attempt = r.attempt.expect("attempt");
        assert_eq!(attempt.state(), AttemptState::AwaitingApproval);
        assert!(attempt.lease_expires_at.is_none(), "no lease yet");
        attempt
    }

    async fn usage(&self, permit: &str) -> (u64, i64) {
        let got = self.admin.get_permit(permit).await.expect("get");
        (got.usage[0].calls_made, got.budget_reserved)
    }
}

async fn a_payout_above_the_threshold_waits_is_approved_by_another_key_and_dispatches_once(
    w: World,
) {
    let permit = w.permit(3, 1).await;
    // Below the threshold: no approval.
    let small = w.ask(&permit, "small", 999).await;
    assert_eq!(small.decision(), Decision::Dispatch);
    let attempt = w.awaiting(&permit, "payout-1", 40_000).await;
    let approval = attempt.approval.clone().expect("approval");
    assert_eq!(approval.summary, "pay 40000 EUR to IBAN DE00 (payout-1)");
    assert_eq!(approval.approvers_needed, 1);
    assert_eq!((w.usage(&permit).await), (2, 40_999), "slot and cost held");
    // Asked again: the same pending answer.
    let again = w.ask(&permit, "payout-1", 40_000).await;
    assert_eq!(again.decision(), Decision::AwaitApproval);
    assert_eq!(w.usage(&permit).await, (2, 40_999), "nothing more reserved");
    // The approver finds it in the listing, with its summary and id.
    let listed = w
        .alice
        .list_approvals(pb::ListApprovalsRequest::default())
        .await
        .expect("list");
    assert_eq!(listed.attempts.len(), 1, "{listed:?}");
    let pending = &listed.attempts[0];
    assert_eq!(pending.attempt_id, attempt.attempt_id);
    assert_eq!(
        pending.approval.as_ref().expect("a").summary,
        approval.summary
    );
    let approved = w
        .alice
        .approve(&permit, "payout-1", &pending.attempt_id)
        .await
        .expect("approve")
        .attempt
        .expect("attempt");
    assert_eq!(approved.state(), AttemptState::Approved);
    assert_eq!(
        approved.approval.as_ref().expect("a").approved_by,
        ["alice"]
    );
    // The requester's same key: DISPATCH, once.
    let go = w.ask(&permit, "payout-1", 40_000).await;
    assert_eq!(go.decision(), Decision::Dispatch, "{go:?}");
    assert!(!go.redelivered);
    let reserved = go.attempt.expect("attempt");
    assert_eq!(reserved.state(), AttemptState::Reserved);
    assert!(go.lease_remaining.is_some());
    // A retry with another holder token is IN_PROGRESS, not a second one.
    let mut other = w.request(&permit, "payout-1", 40_000);
    other.holder_token = b"someone else".to_vec();
    expect_error(
        w.agent.authorize(other).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    w.agent
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "payout-1".into(),
            attempt_id: reserved.attempt_id.clone(),
            outcome: Some(succeeded(b"transfer 7731", None)),
        })
        .await
        .expect("commit");
    let replay = w.ask(&permit, "payout-1", 40_000).await;
    assert_eq!(replay.decision(), Decision::Replay);
    let done = replay.attempt.expect("attempt");
    assert_eq!(done.state(), AttemptState::Succeeded);
    assert_eq!(done.receipt.expect("receipt").result, b"transfer 7731");
    assert_eq!(done.approval.expect("kept").approved_by, ["alice"]);
    assert!(
        w.alice
            .list_approvals(pb::ListApprovalsRequest::default())
            .await
            .expect("list")
            .attempts
            .is_empty()
    );
}

async fn a_denied_call_never_dispatches_and_replays_its_denial(w: World) {
    let permit = w.permit(1, 1).await;
    let attempt = w.awaiting(&permit, "payout-1", 5_000).await;
    let denied = w
        .bob
        .deny(
            &permit,
            "payout-1",
            &attempt.attempt_id,
            "unknown beneficiary",
        )
        .await
        .expect("deny");
    let a = denied.attempt.expect("attempt");
    assert_eq!(a.state(), AttemptState::Denied);
    assert_eq!(denied.usage.expect("usage").calls_made, 0);
    assert_eq!(w.usage(&permit).await, (0, 0), "slot and cost came back");
    for _ in 0..2 {
        let replay = w.ask(&permit, "payout-1", 5_000).await;
        assert_eq!(replay.decision(), Decision::Replay);
        let a = replay.attempt.expect("attempt");
        assert_eq!(a.state(), AttemptState::Denied);
        let approval = a.approval.expect("approval");
        assert_eq!(approval.denial_reason, "unknown beneficiary");
        assert_eq!(approval.decided_by, "bob");
    }
    let (meta, _) = expect_error(
        w.alice
            .approve(&permit, "payout-1", &attempt.attempt_id)
            .await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    assert_eq!(meta["state"], "DENIED");
    // The slot is free for another call.
    w.awaiting(&permit, "payout-2", 5_000).await;
}

async fn a_request_nobody_decides_lapses_and_returns_its_slot(w: World) {
    let permit = w.permit(1, 1).await;
    let attempt = w.awaiting(&permit, "payout-1", 5_000).await;
    w.h.clock.advance(WAIT.as_millis() as i64);
    assert_eq!(w.usage(&permit).await, (0, 0), "lapsed: nothing held");
    let read = w
        .admin
        .get_attempt(&permit, "payout-1")
        .await
        .expect("get")
        .attempt
        .expect("attempt");
    assert_eq!(read.state(), AttemptState::Denied);
    assert_eq!(read.approval.expect("a").denial_reason, "approval_expired");
    let replay = w.ask(&permit, "payout-1", 5_000).await;
    assert_eq!(replay.decision(), Decision::Replay);
    expect_error(
        w.alice
            .approve(&permit, "payout-1", &attempt.attempt_id)
            .await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    w.awaiting(&permit, "payout-2", 5_000).await;
}

async fn fifty_concurrent_requests_against_a_cap_of_five_leave_five_pending(w: World) {
    let permit = w.permit(5, 1).await;
    let w = Arc::new(w);
    let asks = (0..50).map(|i| {
        let (w, permit) = (w.clone(), permit.clone());
        tokio::spawn(async move {
            w.agent
                .authorize(w.request(&permit, &format!("payout-{i}"), 2_000))
                .await
        })
    });
    let mut pending = 0;
    for ask in asks {
        match ask.await.expect("joined") {
            Ok(r) => {
                assert_eq!(r.decision(), Decision::AwaitApproval, "{r:?}");
                pending += 1;
            }
            Err(e) => assert_eq!(e.reason_name(), Some("PERMIT_MAX_CALLS_EXCEEDED"), "{e:?}"),
        }
    }
    assert_eq!(pending, 5);
    assert_eq!(w.usage(&permit).await, (5, 10_000));
    let listed = w
        .alice
        .list_approvals(pb::ListApprovalsRequest {
            permit_id: permit.clone(),
            page_size: 2,
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(listed.attempts.len(), 2);
    assert!(!listed.next_page_token.is_empty());
}

async fn agents_never_approve_and_nobody_approves_their_own_call(w: World) {
    let permit = w.permit(5, 1).await;
    let attempt = w.awaiting(&permit, "payout-1", 5_000).await;
    expect_error(
        w.agent
            .approve(&permit, "payout-1", &attempt.attempt_id)
            .await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    expect_error(
        w.agent
            .list_approvals(pb::ListApprovalsRequest::default())
            .await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    // An admin may both ask and approve, but never its own request.
    let mut own = w.request(&permit, "admin-payout", 5_000);
    own.request_fingerprint = b"admin's own".to_vec();
    let asked = w.admin.authorize(own).await.expect("asked");
    assert_eq!(asked.decision(), Decision::AwaitApproval);
    let own_id = asked.attempt.expect("attempt").attempt_id;
    let (meta, _) = expect_error(
        w.admin.approve(&permit, "admin-payout", &own_id).await,
        Code::PermissionDenied,
        "APPROVER_IS_REQUESTER",
    );
    assert_eq!(meta["idempotency_key"], "admin-payout");
    // Both still wait; another key may approve them.
    let approved = w
        .admin
        .approve(&permit, "payout-1", &attempt.attempt_id)
        .await
        .expect("an admin approves the agent's call");
    assert_eq!(approved.attempt.expect("a").state(), AttemptState::Approved);
}

async fn the_four_eyes_rule_needs_two_distinct_approvers(w: World) {
    let permit = w.permit(5, 2).await;
    let attempt = w.awaiting(&permit, "payout-1", 50_000).await;
    let id = &attempt.attempt_id;
    let first = w
        .alice
        .approve(&permit, "payout-1", id)
        .await
        .expect("alice");
    let first = first.attempt.expect("a");
    assert_eq!(first.state(), AttemptState::AwaitingApproval);
    // Alice again is the same approval, not a second.
    let again = w
        .alice
        .approve(&permit, "payout-1", id)
        .await
        .expect("again");
    assert_eq!(again.attempt.expect("a"), first);
    assert_eq!(
        w.ask(&permit, "payout-1", 50_000).await.decision(),
        Decision::AwaitApproval
    );
    let second = w.bob.approve(&permit, "payout-1", id).await.expect("bob");
    let second = second.attempt.expect("a");
    assert_eq!(second.state(), AttemptState::Approved);
    assert_eq!(second.approval.expect("a").approved_by, ["alice", "bob"]);
    assert_eq!(
        w.ask(&permit, "payout-1", 50_000).await.decision(),
        Decision::Dispatch
    );
}

async fn a_waiting_authorize_is_one_call_answered_at_the_decision(w: World) {
    let permit = w.permit(5, 1).await;
    let attempt = w.awaiting(&permit, "payout-1", 5_000).await;
    let w = Arc::new(w);
    let waiting = {
        let (w, permit) = (w.clone(), permit.clone());
        tokio::spawn(async move {
            let mut r = w.request(&permit, "payout-1", 5_000);
            r.wait = Some(prost_types::Duration {
                seconds: 30,
                nanos: 0,
            });
            let started = std::time::Instant::now();
            (w.agent.authorize(r).await, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "it waits for the decision");
    w.alice
        .approve(&permit, "payout-1", &attempt.attempt_id)
        .await
        .expect("approve");
    let (answer, took) = waiting.await.expect("joined");
    let answer = answer.expect("answered");
    assert_eq!(answer.decision(), Decision::Dispatch, "{answer:?}");
    assert!(
        took < Duration::from_secs(10),
        "answered at the decision: {took:?}"
    );
    // Nobody decides: the wait ends at its bound with the pending answer.
    w.awaiting(&permit, "payout-2", 5_000).await;
    let mut r = w.request(&permit, "payout-2", 5_000);
    r.wait = Some(prost_types::Duration {
        seconds: 1,
        nanos: 0,
    });
    let started = std::time::Instant::now();
    let answer = w.agent.authorize(r).await.expect("answered");
    assert_eq!(answer.decision(), Decision::AwaitApproval);
    assert!(started.elapsed() >= Duration::from_millis(900));
    // Longer than 60 s is refused.
    let mut r = w.request(&permit, "payout-2", 5_000);
    r.wait = Some(prost_types::Duration {
        seconds: 61,
        nanos: 0,
    });
    expect_error(
        w.agent.authorize(r).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
}

async fn approvers_list_what_waits_oldest_first_across_permits(w: World) {
    let first = w.permit(5, 1).await;
    let second = w.permit(5, 1).await;
    let mut expected = Vec::new();
    for (i, permit) in [&first, &second, &first, &second].into_iter().enumerate() {
        w.h.clock.advance(1);
        let key = format!("payout-{i}");
        w.awaiting(permit, &key, 2_000).await;
        expected.push(key);
    }
    let mut listed = Vec::new();
    let mut token = String::new();
    loop {
        let page = w
            .bob
            .list_approvals(pb::ListApprovalsRequest {
                page_size: 3,
                page_token: token,
                ..Default::default()
            })
            .await
            .expect("list");
        listed.extend(page.attempts.into_iter().map(|a| a.idempotency_key));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(listed, expected);
    let under_first = w
        .bob
        .list_approvals(pb::ListApprovalsRequest {
            permit_id: first.clone(),
            ..Default::default()
        })
        .await
        .expect("list");
    let keys: Vec<_> = under_first
        .attempts
        .iter()
        .map(|a| a.idempotency_key.as_str())
        .collect();
    assert_eq!(keys, ["payout-0", "payout-2"]);
}

async fn the_rust_guarded_call_waits_for_the_decision_then_dispatches_or_raises(w: World) {
    use atmost_client::{GuardError, GuardedCall};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let permit = w.permit(5, 1).await;
    let w = Arc::new(w);
    let sends = Arc::new(AtomicUsize::new(0));
    let call = |key: &str, wait: Duration| {
        GuardedCall::new(permit.clone(), "payout", key)
            .request(&serde_json::json!({"amount": 40_000, "key": key}))
            .cost(40_000)
            .approval_summary(format!("pay 40000 EUR ({key})"))
            .approval_wait(wait)
    };
    let tool = |sends: Arc<AtomicUsize>| {
        move |_id| async move {
            sends.fetch_add(1, Ordering::SeqCst);
            Ok::<_, atmost_client::DispatchError>(atmost_client::Dispatched::bytes(
                b"paid".to_vec(),
            ))
        }
    };
    // No wait: the call says it awaits approval, and sends nothing.
    let e = w
        .agent
        .guarded(call("payout-1", Duration::ZERO), tool(sends.clone()))
        .await
        .expect_err("awaits approval");
    let GuardError::AwaitingApproval {
        attempt_id,
        expires_at_ms,
    } = e
    else {
        panic!("{e:?}");
    };
    assert!(expires_at_ms > w.h.now_ms());
    // Waiting: an approver approves meanwhile, and the call goes out once.
    let approver = {
        let (w, permit, id) = (w.clone(), permit.clone(), attempt_id.as_str().to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            w.alice
                .approve(&permit, "payout-1", &id)
                .await
                .expect("approve");
        })
    };
    let done = w
        .agent
        .guarded(
            call("payout-1", Duration::from_secs(30)),
            tool(sends.clone()),
        )
        .await
        .expect("approved and dispatched");
    approver.await.expect("approver");
    assert_eq!(done.result, b"paid");
    assert!(!done.replayed);
    assert_eq!(sends.load(Ordering::SeqCst), 1);
    // Denied while it waits: the call raises, and never sends.
    let e = w
        .agent
        .guarded(call("payout-2", Duration::ZERO), tool(sends.clone()))
        .await
        .expect_err("awaits");
    let id = e.attempt_id().expect("id").as_str().to_owned();
    let denier = {
        let (w, permit) = (w.clone(), permit.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            w.bob
                .deny(&permit, "payout-2", &id, "not today")
                .await
                .expect("deny");
        })
    };
    let e = w
        .agent
        .guarded(
            call("payout-2", Duration::from_secs(30)),
            tool(sends.clone()),
        )
        .await
        .expect_err("denied");
    denier.await.expect("denier");
    let GuardError::ApprovalDenied {
        reason,
        decided_by,
        replayed,
        ..
    } = e
    else {
        panic!("{e:?}");
    };
    assert_eq!(
        (reason.as_str(), decided_by.as_str(), replayed),
        ("not today", "bob", false)
    );
    assert_eq!(
        sends.load(Ordering::SeqCst),
        1,
        "a denied call is never sent"
    );
}

/// A waiting Authorize may outlast the request timeout by its wait (the
/// request is read by then): with a timeout of 1 s, a decision after 1.5 s
/// still reaches the call that waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_outlasts_the_request_timeout() {
    let _machine = shared().await;
    let limits = atmost::transport::Limits {
        request_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let h = Harness::start_configured(Kind::Memory, |app| app.with_limits(limits)).await;
    let permit = h
        .create(
            NewPermit::new(["payout"])
                .expires_at_ms(h.now_ms() + 3_600_000)
                .approval("payout", None, Some(WAIT), 1)
                .build(),
        )
        .await
        .permit_id;
    let request = pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "payout".into(),
        idempotency_key: "k".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 1,
        ..Default::default()
    };
    let asked = h.client.authorize(request.clone()).await.expect("asked");
    assert_eq!(asked.decision(), Decision::AwaitApproval);
    let id = asked.attempt.expect("attempt").attempt_id;
    let waiting = {
        let client = h.client.clone();
        let mut request = request.clone();
        request.wait = Some(prost_types::Duration {
            seconds: 20,
            nanos: 0,
        });
        tokio::spawn(async move { client.authorize(request).await })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Dev mode: no keys, so anyone may approve.
    h.client.approve(&permit, "k", &id).await.expect("approve");
    let answer = waiting.await.expect("joined").expect("answered");
    assert_eq!(answer.decision(), Decision::Dispatch, "{answer:?}");
}

/// The DISPATCH that ends a held ask may come late in it: the guarded
/// call counts its lease from when it learnt of it, not from the ask's
/// start (a 3 s lease, approved 4 s into the wait, is still sent).
async fn an_approval_late_in_a_held_ask_still_leaves_its_lease_to_send(w: World) {
    use atmost_client::GuardedCall;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let permit = NewPermit::new(["payout"])
        .expires_at_ms(w.h.now_ms() + 3_600_000)
        .lease(Duration::from_secs(3))
        .approval("payout", None, Some(WAIT), 1)
        .build();
    let permit = w
        .admin
        .create_permit(permit)
        .await
        .expect("create")
        .permit_id;
    let w = Arc::new(w);
    let listed = {
        let (w, permit) = (w.clone(), permit.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let page = w
                .alice
                .list_approvals(pb::ListApprovalsRequest {
                    permit_id: permit.clone(),
                    ..Default::default()
                })
                .await
                .expect("list");
            let id = &page.attempts.first().expect("one waits").attempt_id;
            w.alice.approve(&permit, "late", id).await.expect("approve");
        })
    };
    let sends = Arc::new(AtomicUsize::new(0));
    let counted = sends.clone();
    let done = w
        .agent
        .guarded(
            GuardedCall::new(permit.clone(), "payout", "late")
                .request(&serde_json::json!({"late": true}))
                .approval_wait(Duration::from_secs(30)),
            move |_id| async move {
                counted.fetch_add(1, Ordering::SeqCst);
                Ok::<_, atmost_client::DispatchError>(atmost_client::Dispatched::bytes(
                    b"ok".to_vec(),
                ))
            },
        )
        .await
        .expect("sent within its lease");
    listed.await.expect("approver");
    assert_eq!(done.result, b"ok");
    assert_eq!(sends.load(Ordering::SeqCst), 1);
}
