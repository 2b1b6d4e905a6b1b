//! The behavioural suite: every test runs over real gRPC on a loopback port,
//! once against the memory store and once against a real Redis.

use crate::support::*;
use pb::{AttemptState, Decision};
use tonic::Code;

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::start(super::Kind::Memory).await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::start(super::Kind::Redis).await).await;
                }
            )*
        }
    };
}

on_both_stores!(
    create_permit_fills_defaults,
    create_permit_rejects_bad_input,
    unknown_permit_is_not_found,
    dispatch_commit_succeeded_then_replay_returns_receipt,
    repeated_commit_answers_the_same_and_contradiction_is_refused,
    failed_refunds_cost_and_keeps_slot,
    not_sent_returns_slot_and_frees_key,
    same_key_in_flight_is_in_progress,
    same_key_different_request_is_reused,
    cap_exceeded_reports_tool_limit_calls_made,
    cap_of_zero_disables_tool,
    replay_survives_cap_expiry_and_revocation,
    budget_exceeded_reports_amounts,
    actual_cost_defaults_and_may_not_exceed_reservation,
    tool_not_in_scope,
    order_of_checks,
    lease_expiry_turns_reserved_into_uncertain,
    mark_uncertain_holds_slot_and_money,
    resolve_settles_only_uncertain,
    attempt_not_found_and_mismatch,
    list_uncertain_pages_within_and_across_permits,
    duplicate_guard_off,
    duplicate_guard_log,
    duplicate_guard_enforce,
    malformed_requests_change_nothing,
    concurrent_distinct_keys_respect_cap,
    concurrent_same_key_dispatches_once,
    timeout_then_new_key_story,
    permits_created_during_listing_are_never_lost,
    unlimited_budget_stops_at_the_accounting_ceiling,
);

fn state(a: &pb::Attempt) -> AttemptState {
    a.state()
}

/// (committed, reserved, remaining) of a permit's budget, as GetPermit reads it.
async fn budget(h: &Harness, permit_id: &str) -> (i64, i64, Option<i64>) {
    let got = h.get(permit_id).await.expect("get");
    (
        got.budget_committed,
        got.budget_reserved,
        got.budget_remaining,
    )
}

async fn usage_of(h: &Harness, permit_id: &str, tool: &str) -> pb::Usage {
    h.get(permit_id)
        .await
        .expect("get")
        .usage
        .into_iter()
        .find(|u| u.tool == tool)
        .expect("tool usage")
}

async fn create_permit_fills_defaults(h: Harness) {
    let mut p = h.permit(&["search", "payments.charge"]);
    p.max_calls_per_tool.insert("payments.charge".into(), 3);
    p.budget = Some(1000);
    let created = h.create(p.clone()).await;
    assert!(uuid::Uuid::parse_str(&created.permit_id).is_ok());
    assert_eq!(created.tools, p.tools);
    assert_eq!(created.status(), pb::PermitStatus::Active);
    assert_eq!(created.lease.as_ref().map(|d| d.seconds), Some(30));
    let guard = created.duplicate_guard.expect("guard");
    assert_eq!(guard.mode(), pb::DuplicateGuardMode::Log);
    assert_eq!(guard.window.map(|d| d.seconds), Some(600));
    assert!(created.created_at.is_some());
    assert_eq!(created.expires_at, p.expires_at);

    let got = h.get(&created.permit_id).await.expect("get");
    assert_eq!(got.permit.as_ref(), Some(&created));
    assert_eq!(got.budget_committed, 0);
    assert_eq!(got.budget_reserved, 0);
    assert_eq!(got.budget_remaining, Some(1000));
    let usage: Vec<_> = got
        .usage
        .iter()
        .map(|u| {
            (
                u.tool.as_str(),
                u.calls_made,
                u.calls_limit,
                u.budget_remaining,
            )
        })
        .collect();
    assert_eq!(
        usage,
        vec![
            ("search", 0, None, Some(1000)),
            ("payments.charge", 0, Some(3), Some(1000)),
        ]
    );
}

async fn create_permit_rejects_bad_input(h: Harness) {
    type Mutation = Box<dyn Fn(&mut pb::Permit)>;
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "permit.permit_id",
            Box::new(|p| p.permit_id = uuid::Uuid::now_v7().to_string()),
        ),
        (
            "permit.max_calls_per_tool",
            Box::new(|p| {
                p.max_calls_per_tool.insert("other".into(), 1);
            }),
        ),
        ("permit.expires_at", Box::new(|p| p.expires_at = None)),
        ("permit.tools", Box::new(|p| p.tools.clear())),
        (
            "permit.tools",
            Box::new(|p| p.tools.push("bad tool".into())),
        ),
        ("permit.tools", Box::new(|p| p.tools.push("search".into()))),
        (
            "permit.tools",
            Box::new(|p| p.tools = (0..257).map(|i| format!("t{i}")).collect()),
        ),
        ("permit.budget", Box::new(|p| p.budget = Some(-1))),
        ("permit.budget", Box::new(|p| p.budget = Some(1 << 53))),
        (
            "permit.max_calls_per_tool",
            Box::new(|p| {
                p.max_calls_per_tool.insert("search".into(), u64::MAX);
            }),
        ),
        (
            "permit.status",
            Box::new(|p| p.status = pb::PermitStatus::Revoked as i32),
        ),
        (
            "permit.lease",
            Box::new(|p| {
                p.lease = Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 0,
                })
            }),
        ),
    ];
    for (field, mutate) in cases {
        let mut p = h.permit(&["search"]);
        mutate(&mut p);
        let result = h.client.create_permit(p).await;
        let (_, status) = expect_error(result, Code::InvalidArgument, "INVALID_REQUEST");
        assert!(
            status.violated_fields().iter().any(|f| f == field),
            "{field}: {status:?}"
        );
    }
    // An expiry in the past.
    let mut p = h.permit(&["search"]);
    p.expires_at = Some(atmost_client::timestamp(h.now_ms() - 1));
    let result = h.client.create_permit(p).await;
    expect_error(result, Code::InvalidArgument, "INVALID_REQUEST");
}

async fn unknown_permit_is_not_found(h: Harness) {
    let id = uuid::Uuid::now_v7().to_string();
    let (meta, _) = expect_error(
        h.authorize(&id, "search", "k1", b"fp", 1).await,
        Code::NotFound,
        "PERMIT_NOT_FOUND",
    );
    assert_eq!(meta["permit_id"], id);
    expect_error(h.get(&id).await, Code::NotFound, "PERMIT_NOT_FOUND");
    let revoke = h.client.revoke_permit(&id).await;
    expect_error(revoke, Code::NotFound, "PERMIT_NOT_FOUND");
    expect_error(
        h.list(&id, 10, "").await,
        Code::NotFound,
        "PERMIT_NOT_FOUND",
    );
}

async fn dispatch_commit_succeeded_then_replay_returns_receipt(h: Harness) {
    let permit = h
        .create_with(&["payments.charge"], &[("payments.charge", 3)], Some(1000))
        .await;
    let r = h
        .authorize(&permit, "payments.charge", "order-42", b"fp-42", 250)
        .await
        .expect("authorize");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert!(r.duplicate_of.is_empty());
    let attempt = r.attempt.expect("attempt");
    assert_eq!(state(&attempt), AttemptState::Reserved);
    assert_eq!(attempt.cost, 250);
    assert_eq!(attempt.permit_id, permit);
    assert_eq!(attempt.request_fingerprint, b"fp-42");
    let lease = attempt.lease_expires_at.expect("lease").seconds
        - attempt.created_at.expect("created").seconds;
    assert_eq!(lease, 30);
    let usage = r.usage.expect("usage");
    assert_eq!(
        (usage.calls_made, usage.calls_limit, usage.budget_remaining),
        (1, Some(3), Some(750))
    );

    let committed = h
        .commit(&attempt, succeeded(b"charge ch_1", None))
        .await
        .expect("commit");
    let done = committed.attempt.expect("attempt");
    assert_eq!(state(&done), AttemptState::Succeeded);
    let receipt = done.receipt.clone().expect("receipt");
    assert_eq!(receipt.result, b"charge ch_1");
    assert_eq!(receipt.cost, 250);
    assert!(uuid::Uuid::parse_str(&receipt.receipt_id).is_ok());
    assert_eq!(committed.usage.expect("usage").budget_remaining, Some(750));

    let replay = h
        .authorize(&permit, "payments.charge", "order-42", b"fp-42", 250)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    let replayed = replay.attempt.expect("attempt");
    assert_eq!(replayed.attempt_id, attempt.attempt_id);
    assert_eq!(replayed.receipt, Some(receipt));
    let got = h.get(&permit).await.expect("get");
    assert_eq!((got.budget_committed, got.budget_reserved), (250, 0));
    assert_eq!(got.usage[0].calls_made, 1, "a replay consumes no slot");
}

async fn repeated_commit_answers_the_same_and_contradiction_is_refused(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 5).await;
    let first = h
        .commit(&a, succeeded(b"ok", Some(4)))
        .await
        .expect("commit");
    let again = h
        .commit(&a, succeeded(b"ok", Some(4)))
        .await
        .expect("repeat");
    assert_eq!(first, again);
    let (meta, _) = expect_error(
        h.commit(&a, succeeded(b"other", Some(4))).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    assert_eq!(meta["state"], "SUCCEEDED");
    expect_error(
        h.commit(&a, failed("no")).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    expect_error(
        h.commit(&a, not_sent()).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    expect_error(
        h.mark_uncertain(&a, "x").await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );

    let b = h.dispatch(&permit, "t", "k2", b"fp2", 5).await;
    let first = h.commit(&b, failed("card declined")).await.expect("failed");
    assert_eq!(
        h.commit(&b, failed("card declined")).await.expect("repeat"),
        first
    );
    let (meta, _) = expect_error(
        h.commit(&b, failed("other reason")).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    assert_eq!(meta["state"], "FAILED");
}

async fn failed_refunds_cost_and_keeps_slot(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 7).await;
    let r = h.commit(&a, failed("card declined")).await.expect("commit");
    let done = r.attempt.expect("attempt");
    assert_eq!(state(&done), AttemptState::Failed);
    assert_eq!(done.failure_reason, "card declined");
    let usage = r.usage.expect("usage");
    assert_eq!((usage.calls_made, usage.budget_remaining), (1, Some(10)));
    // The slot is kept: a dispatch went out.
    expect_error(
        h.authorize(&permit, "t", "k2", b"fp2", 1).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 7)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        state(replay.attempt.as_ref().expect("a")),
        AttemptState::Failed
    );
    assert_eq!(budget(&h, &permit).await, (0, 0, Some(10)));
}

async fn not_sent_returns_slot_and_frees_key(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 4).await;
    expect_error(
        h.authorize(&permit, "t", "other", b"fp-other", 4).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    let r = h.commit(&a, not_sent()).await.expect("not sent");
    assert_eq!(
        state(r.attempt.as_ref().expect("a")),
        AttemptState::Released
    );
    let usage = r.usage.expect("usage");
    assert_eq!((usage.calls_made, usage.budget_remaining), (0, Some(10)));
    // Repeated NotSent from the same attempt answers RELEASED again.
    let again = h.commit(&a, not_sent()).await.expect("repeat");
    assert_eq!(
        state(again.attempt.as_ref().expect("a")),
        AttemptState::Released
    );
    expect_error(
        h.commit(&a, succeeded(b"x", None)).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    // The key is free: any request under it is a new intent with a new id.
    let b = h.dispatch(&permit, "t", "k", b"another request", 3).await;
    assert_ne!(b.attempt_id, a.attempt_id);
    // The old attempt id no longer fences the key.
    expect_error(
        h.commit(&a, not_sent()).await,
        Code::FailedPrecondition,
        "ATTEMPT_MISMATCH",
    );
    let got = h.get(&permit).await.expect("get");
    assert_eq!((got.usage[0].calls_made, got.budget_reserved), (1, 3));
}

async fn same_key_in_flight_is_in_progress(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 1).await;
    h.clock.advance(10_000);
    let (meta, status) = expect_error(
        h.authorize(&permit, "t", "k", b"fp", 1).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    assert_eq!(meta["idempotency_key"], "k");
    let lease = a.lease_expires_at.expect("lease");
    let expected = atmost::api::status::rfc3339(atmost_client::millis(&lease));
    assert_eq!(meta["lease_expires_at"], expected);
    assert_eq!(
        status.retry_after(),
        Some(std::time::Duration::from_secs(20)),
        "RetryInfo: {status:?}"
    );
    let got = h.get(&permit).await.expect("get");
    assert_eq!(got.usage[0].calls_made, 1);
}

async fn same_key_different_request_is_reused(h: Harness) {
    let permit = h.create_with(&["t", "u"], &[], None).await;
    h.dispatch(&permit, "t", "k", b"fp", 1).await;
    for (tool, fp, cost) in [("t", &b"other"[..], 1), ("u", b"fp", 1), ("t", b"fp", 2)] {
        let (meta, _) = expect_error(
            h.authorize(&permit, tool, "k", fp, cost).await,
            Code::FailedPrecondition,
            "IDEMPOTENCY_KEY_REUSED",
        );
        assert_eq!(meta["idempotency_key"], "k");
    }
}

async fn cap_exceeded_reports_tool_limit_calls_made(h: Harness) {
    let permit = h.create_with(&["t", "free"], &[("t", 2)], None).await;
    h.dispatch(&permit, "t", "k1", b"1", 0).await;
    h.dispatch(&permit, "t", "k2", b"2", 0).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "t", "k3", b"3", 0).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    assert_eq!(
        (
            meta["tool"].as_str(),
            meta["limit"].as_str(),
            meta["calls_made"].as_str()
        ),
        ("t", "2", "2")
    );
    // A tool with no cap has no bound.
    for i in 0..20 {
        h.dispatch(
            &permit,
            "free",
            &format!("f{i}"),
            format!("{i}").as_bytes(),
            0,
        )
        .await;
    }
    assert_eq!(usage_of(&h, &permit, "free").await.calls_limit, None);
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 2);
}

async fn cap_of_zero_disables_tool(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 0)], None).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "t", "k", b"fp", 0).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    assert_eq!(meta["limit"], "0");
    assert_eq!(usage_of(&h, &permit, "t").await.calls_limit, Some(0));
}

async fn replay_survives_cap_expiry_and_revocation(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 1).await;
    h.commit(&a, succeeded(b"r", None)).await.expect("commit");
    // At the cap: an honest retry still replays.
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 1)
        .await
        .expect("replay at cap");
    assert_eq!(replay.decision(), Decision::Replay);

    let b = {
        let p2 = h.create_with(&["t"], &[], None).await;
        h.dispatch(&p2, "t", "k", b"fp", 1).await
    };
    // Revoked: new keys stop, replays and commits go on.
    let revoked = h.client.revoke_permit(&b.permit_id).await.expect("revoke");
    assert_eq!(revoked.status(), pb::PermitStatus::Revoked);
    let (meta, _) = expect_error(
        h.authorize(&b.permit_id, "t", "new", b"new", 1).await,
        Code::FailedPrecondition,
        "PERMIT_REVOKED",
    );
    assert_eq!(meta["permit_id"], b.permit_id);
    expect_error(
        h.authorize(&b.permit_id, "t", "k", b"fp", 1).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    h.commit(&b, succeeded(b"late", None))
        .await
        .expect("commit after revoke");
    let replay = h
        .authorize(&b.permit_id, "t", "k", b"fp", 1)
        .await
        .expect("replay after revoke");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        h.get(&b.permit_id)
            .await
            .expect("get")
            .permit
            .expect("p")
            .status(),
        pb::PermitStatus::Revoked
    );

    // Expired: the same.
    let c = h
        .dispatch(&permit_expiring(&h).await, "t", "k", b"fp", 1)
        .await;
    h.clock.advance(61_000);
    let (meta, _) = expect_error(
        h.authorize(&c.permit_id, "t", "new", b"new", 1).await,
        Code::FailedPrecondition,
        "PERMIT_EXPIRED",
    );
    assert_eq!(meta["permit_id"], c.permit_id);
    assert!(meta["expired_at"].ends_with('Z'), "{meta:?}");
    h.commit(&c, failed("declined"))
        .await
        .expect("commit after expiry");
    let replay = h
        .authorize(&c.permit_id, "t", "k", b"fp", 1)
        .await
        .expect("replay after expiry");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        state(replay.attempt.as_ref().expect("a")),
        AttemptState::Failed
    );
}

/// A permit over tool "t" that expires in 60 s.
async fn permit_expiring(h: &Harness) -> String {
    let mut p = h.permit(&["t"]);
    p.expires_at = Some(atmost_client::timestamp(h.now_ms() + 60_000));
    p.lease = Some(prost_types::Duration {
        seconds: 600,
        nanos: 0,
    });
    h.create(p).await.permit_id
}

async fn budget_exceeded_reports_amounts(h: Harness) {
    let permit = h.create_with(&["t"], &[], Some(5)).await;
    let a = h.dispatch(&permit, "t", "k1", b"1", 2).await;
    h.commit(&a, succeeded(b"", None)).await.expect("commit");
    h.dispatch(&permit, "t", "k2", b"2", 2).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "t", "k3", b"3", 2).await,
        Code::ResourceExhausted,
        "PERMIT_BUDGET_EXCEEDED",
    );
    assert_eq!(
        (
            meta["budget"].as_str(),
            meta["committed"].as_str(),
            meta["reserved"].as_str(),
            meta["requested"].as_str()
        ),
        ("5", "2", "2", "2")
    );
    // Exactly what is left still fits.
    h.dispatch(&permit, "t", "k4", b"4", 1).await;
    assert_eq!(budget(&h, &permit).await, (2, 3, Some(0)));
}

async fn actual_cost_defaults_and_may_not_exceed_reservation(h: Harness) {
    let permit = h.create_with(&["t"], &[], Some(100)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 10).await;
    let (_, status) = expect_error(
        h.commit(&a, succeeded(b"", Some(11))).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(status.violated_fields(), vec!["succeeded.actual_cost"]);
    let r = h.commit(&a, succeeded(b"", Some(6))).await.expect("commit");
    assert_eq!(r.attempt.expect("a").receipt.expect("r").cost, 6);
    assert_eq!(budget(&h, &permit).await, (6, 0, Some(94)));
    // Without actual_cost the reserved cost is committed, and a repeat
    // without it matches a commit that named it.
    let b = h.dispatch(&permit, "t", "k2", b"fp2", 10).await;
    h.commit(&b, succeeded(b"x", None)).await.expect("commit");
    h.commit(&b, succeeded(b"x", Some(10)))
        .await
        .expect("same outcome");
    assert_eq!(h.get(&permit).await.expect("get").budget_committed, 16);
}

async fn tool_not_in_scope(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "other.tool", "k", b"fp", 0).await,
        Code::PermissionDenied,
        "TOOL_NOT_IN_SCOPE",
    );
    assert_eq!(meta["tool"], "other.tool");
}

async fn order_of_checks(h: Harness) {
    // revoked before expired before scope.
    let p = permit_expiring(&h).await;
    h.client.revoke_permit(&p).await.expect("revoke");
    h.clock.advance(61_000);
    expect_error(
        h.authorize(&p, "nope", "k", b"fp", 0).await,
        Code::FailedPrecondition,
        "PERMIT_REVOKED",
    );
    let p = permit_expiring(&h).await;
    h.clock.advance(61_000);
    expect_error(
        h.authorize(&p, "nope", "k", b"fp", 0).await,
        Code::FailedPrecondition,
        "PERMIT_EXPIRED",
    );
    // scope before guard, cap and budget.
    let mut spec = h.permit(&["t"]);
    spec.max_calls_per_tool.insert("t".into(), 1);
    spec.budget = Some(1);
    spec.duplicate_guard = Some(pb::DuplicateGuard {
        mode: pb::DuplicateGuardMode::Enforce as i32,
        window: None,
    });
    let p = h.create(spec).await.permit_id;
    h.dispatch(&p, "t", "k1", b"fp", 1).await;
    expect_error(
        h.authorize(&p, "nope", "k2", b"fp", 5).await,
        Code::PermissionDenied,
        "TOOL_NOT_IN_SCOPE",
    );
    // guard before cap: the same request under a new key, cap and budget full.
    expect_error(
        h.authorize(&p, "t", "k2", b"fp", 5).await,
        Code::AlreadyExists,
        "DUPLICATE_REQUEST_SUSPECTED",
    );
    // cap before budget.
    expect_error(
        h.authorize(&p, "t", "k2", b"fp2", 5).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    // An existing key is answered before any permit check.
    h.client.revoke_permit(&p).await.expect("revoke");
    expect_error(
        h.authorize(&p, "t", "k1", b"fp", 2).await,
        Code::FailedPrecondition,
        "IDEMPOTENCY_KEY_REUSED",
    );
    expect_error(
        h.authorize(&p, "t", "k1", b"fp", 1).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    // budget is checked last, with room in the cap.
    let p = h.create_with(&["t"], &[("t", 5)], Some(1)).await;
    expect_error(
        h.authorize(&p, "t", "k", b"fp", 2).await,
        Code::ResourceExhausted,
        "PERMIT_BUDGET_EXCEEDED",
    );
}

async fn lease_expiry_turns_reserved_into_uncertain(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 3).await;
    assert!(h.list_all(&permit, 10).await.is_empty());
    h.clock.advance(30_000);
    // Every reader sees UNCERTAIN the instant the lease passes.
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 3)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    let seen = replay.attempt.expect("a");
    assert_eq!(state(&seen), AttemptState::Uncertain);
    assert_eq!(seen.uncertain_reason, "lease_expired");
    let listed = h.list_all(&permit, 10).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].attempt_id, a.attempt_id);
    assert_eq!(state(&listed[0]), AttemptState::Uncertain);
    assert_eq!(h.list_all("", 10).await.len(), 1, "listed across permits");
    // Slot and money stay held; nothing may be re-sent, not even by NotSent.
    let (meta, _) = expect_error(
        h.commit(&a, not_sent()).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    assert_eq!(meta["state"], "UNCERTAIN");
    expect_error(
        h.authorize(&permit, "t", "k2", b"fp2", 1).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    let got = h.get(&permit).await.expect("get");
    assert_eq!((got.usage[0].calls_made, got.budget_reserved), (1, 3));
    // The holder may still report what happened.
    let r = h
        .commit(&a, succeeded(b"late but fine", None))
        .await
        .expect("commit");
    assert_eq!(
        state(r.attempt.as_ref().expect("a")),
        AttemptState::Succeeded
    );
    assert!(h.list_all(&permit, 10).await.is_empty());
}

async fn mark_uncertain_holds_slot_and_money(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 4).await;
    let r = h
        .mark_uncertain(&a, "deadline exceeded")
        .await
        .expect("mark");
    let m = r.attempt.expect("a");
    assert_eq!(state(&m), AttemptState::Uncertain);
    assert_eq!(m.uncertain_reason, "deadline exceeded");
    // Idempotent.
    let again = h
        .mark_uncertain(&a, "deadline exceeded")
        .await
        .expect("again");
    assert_eq!(again.attempt.expect("a"), m);
    let got = h.get(&permit).await.expect("get");
    assert_eq!(
        (
            got.usage[0].calls_made,
            got.budget_reserved,
            got.budget_remaining
        ),
        (1, 4, Some(6))
    );
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 4)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        state(replay.attempt.as_ref().expect("a")),
        AttemptState::Uncertain
    );
    expect_error(
        h.commit(&a, not_sent()).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    // An empty reason gets a default.
    let b = h
        .dispatch(&h.create_with(&["t"], &[], None).await, "t", "k", b"fp", 0)
        .await;
    let r = h.mark_uncertain(&b, "").await.expect("mark");
    assert_eq!(r.attempt.expect("a").uncertain_reason, "marked_uncertain");
    // The holder settles it with a receipt.
    let r = h
        .commit(&a, failed("declined after all"))
        .await
        .expect("commit");
    assert_eq!(state(r.attempt.as_ref().expect("a")), AttemptState::Failed);
    assert_eq!(h.get(&permit).await.expect("get").budget_reserved, 0);
}

async fn resolve_settles_only_uncertain(h: Harness) {
    let permit = h.create_with(&["t"], &[], Some(100)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 10).await;
    let (meta, _) = expect_error(
        h.resolve(&permit, "k", resolved_succeeded(b"r", None))
            .await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    assert_eq!(meta["state"], "RESERVED");
    h.mark_uncertain(&a, "lost").await.expect("mark");
    let r = h
        .resolve(&permit, "k", resolved_succeeded(b"found it", Some(8)))
        .await
        .expect("resolve");
    let done = r.attempt.expect("a");
    assert_eq!(state(&done), AttemptState::Succeeded);
    assert_eq!(done.receipt.as_ref().expect("r").result, b"found it");
    assert_eq!(r.usage.expect("u").budget_remaining, Some(92));
    // Repeating the same resolution answers the same; a different one is refused.
    let again = h
        .resolve(&permit, "k", resolved_succeeded(b"found it", Some(8)))
        .await
        .expect("again");
    assert_eq!(again.attempt.expect("a"), done);
    expect_error(
        h.resolve(&permit, "k", resolved_failed("no")).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 10)
        .await
        .expect("replay");
    assert_eq!(replay.attempt.expect("a").receipt, done.receipt);

    // Failed: the money comes back, the slot stays.
    let b = h.dispatch(&permit, "t", "k2", b"fp2", 10).await;
    h.clock.advance(30_000);
    let r = h
        .resolve(&permit, "k2", resolved_failed("never charged"))
        .await
        .expect("resolve");
    assert_eq!(state(r.attempt.as_ref().expect("a")), AttemptState::Failed);
    let got = h.get(&permit).await.expect("get");
    assert_eq!(
        (
            got.usage[0].calls_made,
            got.budget_committed,
            got.budget_reserved
        ),
        (2, 8, 0)
    );
    // A released attempt is not the operator's to resolve.
    let c = h.dispatch(&permit, "t", "k3", b"fp3", 1).await;
    h.commit(&c, not_sent()).await.expect("not sent");
    expect_error(
        h.resolve(&permit, "k3", resolved_failed("x")).await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    let (meta, _) = expect_error(
        h.resolve(&permit, "missing", resolved_failed("x")).await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    assert_eq!(meta["idempotency_key"], "missing");
    let _ = b;
}

async fn attempt_not_found_and_mismatch(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let mut ghost = a.clone();
    ghost.idempotency_key = "ghost".into();
    let (meta, _) = expect_error(
        h.commit(&ghost, not_sent()).await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    assert_eq!(meta["idempotency_key"], "ghost");
    expect_error(
        h.mark_uncertain(&ghost, "x").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    let mut wrong = a.clone();
    wrong.attempt_id = uuid::Uuid::now_v7().to_string();
    let (meta, _) = expect_error(
        h.commit(&wrong, not_sent()).await,
        Code::FailedPrecondition,
        "ATTEMPT_MISMATCH",
    );
    assert_eq!(meta["idempotency_key"], "k");
    expect_error(
        h.mark_uncertain(&wrong, "x").await,
        Code::FailedPrecondition,
        "ATTEMPT_MISMATCH",
    );
    // Nothing changed.
    let replay = h.authorize(&permit, "t", "k", b"fp", 0).await;
    expect_error(replay, Code::Aborted, "IDEMPOTENCY_IN_PROGRESS");
}

async fn list_uncertain_pages_within_and_across_permits(h: Harness) {
    let p1 = h.create_with(&["t"], &[], None).await;
    let p2 = h.create_with(&["t"], &[], None).await;
    let p3 = h.create_with(&["t"], &[], None).await; // never uncertain
    let mut expected = Vec::new();
    for (permit, n) in [(&p1, 5), (&p2, 3)] {
        for i in 0..n {
            let a = h
                .dispatch(
                    permit,
                    "t",
                    &format!("key-{i}"),
                    format!("fp{i}").as_bytes(),
                    0,
                )
                .await;
            if i % 2 == 0 {
                h.mark_uncertain(&a, "lost").await.expect("mark");
            }
            expected.push(a.attempt_id);
        }
    }
    h.dispatch(&p3, "t", "settled", b"x", 0).await;
    // Before the leases pass only the marked ones are uncertain.
    assert_eq!(h.list_all(&p1, 2).await.len(), 3);
    h.clock.advance(30_000);
    let p3_attempt = h.list_all(&p3, 10).await;
    assert_eq!(p3_attempt.len(), 1, "lease-expired attempts are listed");
    for page_size in [1, 2, 3, 100] {
        let one: Vec<_> = h
            .list_all(&p1, page_size)
            .await
            .into_iter()
            .map(|a| a.attempt_id)
            .collect();
        assert_eq!(one, expected[..5].to_vec(), "page size {page_size}");
        let all: Vec<_> = h
            .list_all("", page_size)
            .await
            .into_iter()
            .map(|a| a.attempt_id)
            .collect();
        assert_eq!(all.len(), 9, "page size {page_size}");
        for id in &expected {
            assert!(all.contains(id));
        }
    }
    let (_, status) = expect_error(
        h.list(&p1, 10, "zz").await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(status.violated_fields(), vec!["page_token"]);
    let page = h.list(&p1, 1, "").await.expect("page");
    expect_error(
        h.list(&p2, 1, &page.next_page_token).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    expect_error(
        h.list(&p1, 1001, "").await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
}

async fn guarded_permit(h: &Harness, mode: pb::DuplicateGuardMode) -> String {
    let mut p = h.permit(&["t"]);
    p.duplicate_guard = Some(pb::DuplicateGuard {
        mode: mode as i32,
        window: Some(prost_types::Duration {
            seconds: 60,
            nanos: 0,
        }),
    });
    h.create(p).await.permit_id
}

async fn duplicate_guard_off(h: Harness) {
    let permit = guarded_permit(&h, pb::DuplicateGuardMode::Off).await;
    h.dispatch(&permit, "t", "k1", b"same", 1).await;
    let r = h
        .authorize(&permit, "t", "k2", b"same", 1)
        .await
        .expect("authorize");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert!(r.duplicate_of.is_empty());
}

async fn duplicate_guard_log(h: Harness) {
    let permit = guarded_permit(&h, pb::DuplicateGuardMode::Log).await;
    let first = h.dispatch(&permit, "t", "k1", b"same", 1).await;
    let r = h
        .authorize(&permit, "t", "k2", b"same", 1)
        .await
        .expect("authorize");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert_eq!(r.duplicate_of, "k1");
    let second = r.attempt.expect("attempt");
    // A different fingerprint is no duplicate.
    let r = h
        .authorize(&permit, "t", "k3", b"different", 1)
        .await
        .expect("authorize");
    assert!(r.duplicate_of.is_empty());
    // k2 released (never sent): the guard falls back to k1, still live.
    h.commit(&second, not_sent()).await.expect("not sent");
    let r = h
        .authorize(&permit, "t", "k4", b"same", 1)
        .await
        .expect("authorize");
    assert_eq!(r.duplicate_of, "k1");
    // Released attempts never count, and neither do those outside the window.
    h.commit(r.attempt.as_ref().expect("a"), not_sent())
        .await
        .expect("not sent");
    h.commit(&first, not_sent()).await.expect("not sent");
    let r = h
        .authorize(&permit, "t", "k5", b"same", 1)
        .await
        .expect("authorize");
    assert!(r.duplicate_of.is_empty(), "{r:?}");
    h.clock.advance(60_000);
    let r = h
        .authorize(&permit, "t", "k6", b"same", 1)
        .await
        .expect("authorize");
    assert!(r.duplicate_of.is_empty(), "outside the window: {r:?}");
    // Fingerprints that share their first bytes are still different
    // requests, and one does not hide the other from the guard.
    h.dispatch(&permit, "t", "k7", b"0123456789abcdef-a", 1)
        .await;
    for (key, fp, duplicate_of) in [
        ("k8", &b"0123456789abcdef-b"[..], ""),
        ("k9", b"0123456789abcdef-a", "k7"),
        ("k10", b"0123456789abcdef-b", "k8"),
    ] {
        let r = h
            .authorize(&permit, "t", key, fp, 1)
            .await
            .expect("authorize");
        assert_eq!(r.duplicate_of, duplicate_of, "{key}");
    }
}

async fn duplicate_guard_enforce(h: Harness) {
    let permit = guarded_permit(&h, pb::DuplicateGuardMode::Enforce).await;
    let first = h.dispatch(&permit, "t", "k1", b"same", 1).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "t", "k2", b"same", 1).await,
        Code::AlreadyExists,
        "DUPLICATE_REQUEST_SUSPECTED",
    );
    assert_eq!(
        (meta["tool"].as_str(), meta["earlier_key"].as_str()),
        ("t", "k1")
    );
    // Every state but RELEASED counts.
    h.commit(&first, failed("declined")).await.expect("failed");
    expect_error(
        h.authorize(&permit, "t", "k2", b"same", 1).await,
        Code::AlreadyExists,
        "DUPLICATE_REQUEST_SUSPECTED",
    );
    assert_eq!(
        usage_of(&h, &permit, "t").await.calls_made,
        1,
        "a refused duplicate takes no slot"
    );
    h.clock.advance(60_000);
    let second = h.dispatch(&permit, "t", "k2", b"same", 1).await;
    h.commit(&second, not_sent()).await.expect("not sent");
    h.dispatch(&permit, "t", "k3", b"same", 1).await;
}

async fn malformed_requests_change_nothing(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], None).await;
    let long_key = "k".repeat(256);
    let long_tool = "t".repeat(129);
    let cases: Vec<(&str, String, &str, Vec<u8>, i64)> = vec![
        ("idempotency_key", permit.clone(), "t", b"fp".to_vec(), 0),
        ("idempotency_key", permit.clone(), "t", b"fp".to_vec(), 0),
        ("tool", permit.clone(), "bad tool!", b"fp".to_vec(), 0),
        ("tool", permit.clone(), &long_tool, b"fp".to_vec(), 0),
        ("request_fingerprint", permit.clone(), "t", vec![], 0),
        ("request_fingerprint", permit.clone(), "t", vec![7; 65], 0),
        ("cost", permit.clone(), "t", b"fp".to_vec(), -1),
        ("permit_id", "not-a-uuid".into(), "t", b"fp".to_vec(), 0),
    ];
    for (i, (field, permit_id, tool, fp, cost)) in cases.into_iter().enumerate() {
        let key = match i {
            0 => "",
            1 => long_key.as_str(),
            _ => "k",
        };
        let (_, status) = expect_error(
            h.authorize(&permit_id, tool, key, &fp, cost).await,
            Code::InvalidArgument,
            "INVALID_REQUEST",
        );
        assert_eq!(status.violated_fields(), vec![field], "{status:?}");
    }
    for key in ["tab\there", "bad\u{1}key", "caf\u{e9}"] {
        expect_error(
            h.authorize(&permit, "t", key, b"fp", 0).await,
            Code::InvalidArgument,
            "INVALID_REQUEST",
        );
    }
    let a = h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let huge = vec![0u8; 64 * 1024 + 1];
    let (_, status) = expect_error(
        h.commit(&a, succeeded(&huge, None)).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(status.violated_fields(), vec!["succeeded.result"]);
    let no_outcome = h
        .client
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "k".into(),
            attempt_id: a.attempt_id.clone(),
            outcome: None,
        })
        .await;
    expect_error(no_outcome, Code::InvalidArgument, "INVALID_REQUEST");
    let mut bad_id = a.clone();
    bad_id.attempt_id = "nope".into();
    expect_error(
        h.commit(&bad_id, not_sent()).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    // A maximal result is fine, and the attempt was untouched until then.
    let max = vec![1u8; 64 * 1024];
    let r = h.commit(&a, succeeded(&max, None)).await.expect("commit");
    assert_eq!(
        r.attempt.expect("a").receipt.expect("r").result.len(),
        64 * 1024
    );
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 1);
}

/// Sends the requests all at once; returns how many got DISPATCH and the
/// refusals.
async fn race(h: &Harness, requests: Vec<pb::AuthorizeRequest>) -> (usize, Vec<Error>) {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let client = h.client.clone();
            tokio::spawn(async move { client.authorize(request).await })
        })
        .collect();
    let mut dispatched = 0;
    let mut refused = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Ok(r) => {
                assert_eq!(r.decision(), Decision::Dispatch);
                dispatched += 1;
            }
            Err(s) => refused.push(s),
        }
    }
    (dispatched, refused)
}

fn request(permit: &str, key: &str, fingerprint: &[u8]) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: fingerprint.to_vec(),
        cost: 1,
    }
}

async fn concurrent_distinct_keys_respect_cap(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 5)], None).await;
    let requests = (0..64)
        .map(|i| request(&permit, &format!("key-{i}"), format!("fp-{i}").as_bytes()))
        .collect();
    let (dispatched, refused) = race(&h, requests).await;
    assert_eq!(dispatched, 5);
    for s in refused {
        expect_error(
            Err::<(), _>(s),
            Code::ResourceExhausted,
            "PERMIT_MAX_CALLS_EXCEEDED",
        );
    }
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 5);
}

async fn concurrent_same_key_dispatches_once(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let requests = (0..10).map(|_| request(&permit, "same", b"fp")).collect();
    let (dispatched, refused) = race(&h, requests).await;
    assert_eq!(dispatched, 1);
    for s in refused {
        expect_error(Err::<(), _>(s), Code::Aborted, "IDEMPOTENCY_IN_PROGRESS");
    }
}

/// docs/api.md's worked example, step by step.
async fn timeout_then_new_key_story(h: Harness) {
    let permit = h
        .create_with(&["wallet.charge"], &[("wallet.charge", 1)], Some(500))
        .await;
    let a = h
        .dispatch(
            &permit,
            "wallet.charge",
            "charge-1",
            b"fp(charge 5 EUR)",
            500,
        )
        .await;
    // The response is lost: the caller cannot know whether the wallet was charged.
    h.mark_uncertain(&a, "client deadline exceeded")
        .await
        .expect("mark");
    // The agent loop retries with a fresh key: refused, not a second charge.
    let (meta, _) = expect_error(
        h.authorize(
            &permit,
            "wallet.charge",
            "charge-2",
            b"fp(charge 5 EUR)",
            500,
        )
        .await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    assert_eq!(
        (
            meta["tool"].as_str(),
            meta["limit"].as_str(),
            meta["calls_made"].as_str()
        ),
        ("wallet.charge", "1", "1")
    );
    // The same key replays the same unknown.
    let replay = h
        .authorize(
            &permit,
            "wallet.charge",
            "charge-1",
            b"fp(charge 5 EUR)",
            500,
        )
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        state(replay.attempt.as_ref().expect("a")),
        AttemptState::Uncertain
    );
    // The reconciler finds the charge and resolves it.
    let listed = h.list_all("", 100).await;
    assert_eq!(listed.len(), 1);
    h.resolve(
        &permit,
        "charge-1",
        resolved_succeeded(b"wallet tx 981", None),
    )
    .await
    .expect("resolve");
    let replay = h
        .authorize(
            &permit,
            "wallet.charge",
            "charge-1",
            b"fp(charge 5 EUR)",
            500,
        )
        .await
        .expect("replay");
    let receipt = replay.attempt.expect("a").receipt.expect("receipt");
    assert_eq!(receipt.result, b"wallet tx 981");
    assert!(h.list_all("", 100).await.is_empty());
}

/// Creating permits while a reconciler lists across all of them never
/// hides a permit's uncertain attempts from that listing.
async fn permits_created_during_listing_are_never_lost(h: Harness) {
    let h = std::sync::Arc::new(h);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lister = {
        let (h, stop) = (h.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                h.list_all("", 50).await;
            }
        })
    };
    let mut expected = Vec::new();
    for i in 0..150 {
        let permit = h.create_with(&["t"], &[], None).await;
        let a = h.dispatch(&permit, "t", &format!("k{i}"), b"fp", 0).await;
        h.mark_uncertain(&a, "lost").await.expect("mark");
        expected.push(a.attempt_id);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    lister.await.expect("lister");
    let listed: std::collections::HashSet<_> = h
        .list_all("", 100)
        .await
        .into_iter()
        .map(|a| a.attempt_id)
        .collect();
    let missing = expected.iter().filter(|id| !listed.contains(*id)).count();
    assert_eq!(
        missing, 0,
        "uncertain attempts missing from ListUncertain{{}}"
    );
}

async fn unlimited_budget_stops_at_the_accounting_ceiling(h: Harness) {
    const MAX_AMOUNT: i64 = (1 << 53) - 1;
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k1", b"1", MAX_AMOUNT).await;
    let (meta, _) = expect_error(
        h.authorize(&permit, "t", "k2", b"2", 1).await,
        Code::ResourceExhausted,
        "PERMIT_BUDGET_EXCEEDED",
    );
    assert_eq!(meta["budget"], MAX_AMOUNT.to_string());
    assert_eq!(meta["reserved"], MAX_AMOUNT.to_string());
    h.commit(&a, succeeded(b"", Some(MAX_AMOUNT - 1)))
        .await
        .expect("commit");
    h.dispatch(&permit, "t", "k2", b"2", 1).await;
    assert_eq!(budget(&h, &permit).await, (MAX_AMOUNT - 1, 1, None));
}
