//! Commit and Resolve: receipts, refunds, released slots, repeats and contradictions.

use super::*;

on_both_stores!(
    dispatch_commit_succeeded_then_replay_returns_receipt,
    repeated_commit_answers_the_same_and_contradiction_is_refused,
    failed_refunds_cost_and_keeps_slot,
    not_sent_returns_slot_and_frees_key,
    actual_cost_defaults_and_may_not_exceed_reservation,
    attempt_not_found_and_mismatch,
    resolve_settles_only_uncertain,
    resolve_not_sent_returns_a_slot_never_used,
);

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

/// An operator who verified with the tool's provider that an UNCERTAIN call
/// never took effect resolves it NotSent, naming the attempt: RELEASED, the
/// slot and the cost back, the key free for a new call. The holder cannot,
/// once the attempt is UNCERTAIN (its call may have left); and a retried
/// NotSent never releases a newer attempt of the key (ATTEMPT_MISMATCH).
async fn resolve_not_sent_returns_a_slot_never_used(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 10).await;
    let (_, error) = expect_error(
        h.resolve(&permit, "k", resolved_not_sent()).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(
        error.violated_fields(),
        ["attempt_id"],
        "NotSent names its attempt"
    );
    expect_error(
        h.resolve_attempt(&permit, "k", &a.attempt_id, resolved_not_sent())
            .await,
        Code::FailedPrecondition,
        "ATTEMPT_STATE_CONFLICT",
    );
    h.mark_uncertain(&a, "lost").await.expect("mark");
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
    let r = h
        .resolve_attempt(&permit, "k", &a.attempt_id, resolved_not_sent())
        .await
        .expect("resolve not sent");
    assert_eq!(r.attempt.expect("a").state(), AttemptState::Released);
    let usage = r.usage.expect("usage");
    assert_eq!((usage.calls_made, usage.budget_remaining), (0, Some(10)));
    assert!(h.list_all(&permit, 10).await.is_empty());
    // A repeat answers the same; the key and the slot serve a new call.
    h.resolve_attempt(&permit, "k", &a.attempt_id, resolved_not_sent())
        .await
        .expect("the same again");
    let again = h.dispatch(&permit, "t", "k", b"fp", 10).await;
    assert_ne!(again.attempt_id, a.attempt_id);
    assert_eq!(budget(&h, &permit).await, (0, 10, Some(0)));
    // The new call goes UNCERTAIN; a late retry of the first NotSent must not
    // release it: nobody verified that one.
    h.mark_uncertain(&again, "lost").await.expect("mark");
    expect_error(
        h.resolve_attempt(&permit, "k", &a.attempt_id, resolved_not_sent())
            .await,
        Code::FailedPrecondition,
        "ATTEMPT_MISMATCH",
    );
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 1);
}
