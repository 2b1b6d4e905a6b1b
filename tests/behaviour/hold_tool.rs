//! The uncertain policy HOLD_TOOL: while a tool has an UNCERTAIN attempt,
//! no new key of that tool dispatches; the same key still replays, and the
//! hold lifts the moment the last one is resolved.

use super::*;

on_both_stores!(
    hold_tool_refuses_new_keys_until_the_unknown_is_cleared,
    hold_tool_comes_after_scope_and_before_the_cap,
    count_is_the_default_and_an_unknown_policy_is_refused,
);

async fn hold_permit(h: &Harness, tools: &[&str], cap: Option<(&str, u64)>) -> String {
    let mut p = NewPermit::new(tools.iter().copied())
        .expires_at_ms(h.now_ms() + 3_600_000)
        .uncertain_policy(pb::UncertainPolicy::HoldTool);
    if let Some((tool, n)) = cap {
        p = p.cap(tool, n);
    }
    let permit = h.create(p.build()).await;
    assert_eq!(permit.uncertain_policy(), pb::UncertainPolicy::HoldTool);
    permit.permit_id
}

fn expect_held(result: Result<pb::AuthorizeResponse, Error>, tool: &str, uncertain_key: &str) {
    let (meta, _) = expect_error(result, Code::FailedPrecondition, "TOOL_HELD_UNCERTAIN");
    assert_eq!(meta["tool"], tool);
    assert_eq!(meta["uncertain_key"], uncertain_key);
}

async fn hold_tool_refuses_new_keys_until_the_unknown_is_cleared(h: Harness) {
    let permit = hold_permit(&h, &["pay", "search"], None).await;
    let a = h.dispatch(&permit, "pay", "charge-1", b"fp1", 0).await;
    // RESERVED within its lease holds nothing.
    h.dispatch(&permit, "pay", "charge-2", b"fp2", 0).await;
    h.mark_uncertain(&a, "response lost").await.expect("mark");
    expect_held(
        h.authorize(&permit, "pay", "charge-3", b"fp3", 0).await,
        "pay",
        "charge-1",
    );
    // The refusal changed nothing.
    let view = h.get(&permit).await.expect("get");
    assert_eq!(view.usage[0].calls_made, 2);
    // Another tool is not held; the same key replays as it stands.
    h.dispatch(&permit, "search", "q-1", b"q", 0).await;
    let replay = h
        .authorize(&permit, "pay", "charge-1", b"fp1", 0)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    assert_eq!(
        state(replay.attempt.as_ref().expect("a")),
        AttemptState::Uncertain
    );
    // Resolved: lifted at once.
    h.resolve(&permit, "charge-1", resolved_succeeded(b"tx 1", None))
        .await
        .expect("resolve");
    h.dispatch(&permit, "pay", "charge-3", b"fp3", 0).await;
    // A lease that passes holds the tool too (charge-2 and charge-3 are
    // RESERVED; charge-2's lease ends first), until both are settled.
    h.clock.advance(30_000);
    expect_held(
        h.authorize(&permit, "pay", "charge-4", b"fp4", 0).await,
        "pay",
        "charge-2",
    );
    // (q-1 of "search" is uncertain too, and holds only its own tool.)
    let listed: Vec<_> = h
        .list_all(&permit, 10)
        .await
        .into_iter()
        .map(|a| a.idempotency_key)
        .collect();
    assert_eq!(listed, ["charge-2", "charge-3", "q-1"]);
    h.resolve(&permit, "charge-2", resolved_failed("declined"))
        .await
        .expect("resolve");
    expect_held(
        h.authorize(&permit, "pay", "charge-4", b"fp4", 0).await,
        "pay",
        "charge-3",
    );
    h.resolve(&permit, "charge-3", resolved_failed("declined"))
        .await
        .expect("resolve");
    h.dispatch(&permit, "pay", "charge-4", b"fp4", 0).await;
}

async fn hold_tool_comes_after_scope_and_before_the_cap(h: Harness) {
    let permit = hold_permit(&h, &["pay"], Some(("pay", 1))).await;
    let a = h.dispatch(&permit, "pay", "charge-1", b"fp1", 0).await;
    // Within the lease: the cap answers.
    expect_error(
        h.authorize(&permit, "pay", "charge-2", b"fp2", 0).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    h.mark_uncertain(&a, "lost").await.expect("mark");
    // Scope first, then the hold, before the cap.
    expect_error(
        h.authorize(&permit, "other", "x", b"x", 0).await,
        Code::PermissionDenied,
        "TOOL_NOT_IN_SCOPE",
    );
    expect_held(
        h.authorize(&permit, "pay", "charge-2", b"fp2", 0).await,
        "pay",
        "charge-1",
    );
    // An operator verified it never took effect: slot back, hold lifted.
    h.resolve_attempt(&permit, "charge-1", &a.attempt_id, resolved_not_sent())
        .await
        .expect("resolve not sent");
    h.dispatch(&permit, "pay", "charge-2", b"fp2", 0).await;
}

async fn count_is_the_default_and_an_unknown_policy_is_refused(h: Harness) {
    let permit = h.create(h.permit(&["pay"])).await;
    assert_eq!(permit.uncertain_policy(), pb::UncertainPolicy::Count);
    let a = h.dispatch(&permit.permit_id, "pay", "k1", b"1", 0).await;
    h.mark_uncertain(&a, "lost").await.expect("mark");
    // COUNT: an uncertain attempt holds only its slot.
    h.dispatch(&permit.permit_id, "pay", "k2", b"2", 0).await;

    let mut unknown = h.permit(&["pay"]);
    unknown.uncertain_policy = 7;
    let (_, error) = expect_error(
        h.client.create_permit(unknown).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(error.violated_fields(), vec!["permit.uncertain_policy"]);
}
