//! Authorize: the order of checks, each refusal with its metadata, replays.

use super::*;

on_both_stores!(
    same_key_in_flight_is_in_progress,
    same_key_different_request_is_reused,
    cap_exceeded_reports_tool_limit_calls_made,
    cap_of_zero_disables_tool,
    replay_survives_cap_expiry_and_revocation,
    budget_exceeded_reports_amounts,
    tool_not_in_scope,
    order_of_checks,
    unlimited_budget_stops_at_the_accounting_ceiling,
    malformed_requests_change_nothing,
    a_request_past_its_deadline_changes_nothing,
    the_same_holder_token_recovers_a_lost_dispatch,
);

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

/// A request whose caller's deadline (grpc-timeout) has passed when its turn
/// comes never starts a store transition: DEADLINE_EXCEEDED, retryable as it
/// is, nothing changed. (Without the check, the memory store answered it
/// and the Redis store sent its script before tonic's own timeout fired.)
/// A tonic client gives up at its own deadline before any answer, so the
/// calls go over a raw HTTP/2 stream that sends the header and waits.
async fn a_request_past_its_deadline_changes_nothing(h: Harness) {
    // atmost's own refusal, or tonic's server timeout when it fires before
    // the body has even been read (then the handler never ran at all).
    let refused_late = |what: &str, result: Result<Vec<u8>, Error>| match result {
        Err(e) if e.code() == Code::DeadlineExceeded => {
            assert_eq!(e.reason_name(), Some("DEADLINE_EXCEEDED"), "{what}: {e:?}");
            assert!(e.is_retryable());
        }
        Err(e) if e.code() == Code::Cancelled && e.reason().is_none() => {}
        other => panic!("{what} past its deadline: {other:?}"),
    };
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let authorize = pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "t".into(),
        idempotency_key: "k".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 1,
        holder_token: Vec::new(),
        ..Default::default()
    };
    const AUTHORIZE: &str = "/atmost.v1.Gate/Authorize";
    refused_late(
        "Authorize",
        raw_unary(h.addr, AUTHORIZE, &authorize, "1n").await,
    );
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 0);
    assert_eq!(budget(&h, &permit).await, (0, 0, Some(10)));

    // The key and the cap are untouched: the same request, on time, gets
    // its DISPATCH (through the same raw call, so the call itself works).
    let answer = raw_unary(h.addr, AUTHORIZE, &authorize, "10S")
        .await
        .expect("on time");
    let answer = <pb::AuthorizeResponse as prost::Message>::decode(&answer[..]).expect("decode");
    assert_eq!(answer.decision(), Decision::Dispatch);
    let a = answer.attempt.expect("attempt");

    // A late NotSent returns nothing either.
    let not_sent_late = pb::CommitRequest {
        permit_id: permit.clone(),
        idempotency_key: "k".into(),
        attempt_id: a.attempt_id.clone(),
        outcome: Some(not_sent()),
    };
    refused_late(
        "Commit",
        raw_unary(h.addr, "/atmost.v1.Gate/Commit", &not_sent_late, "1n").await,
    );
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 1);
    h.commit(&a, succeeded(b"ok", None)).await.expect("on time");
}

/// A caller whose DISPATCH answer was lost retries the same key with the
/// same holder_token and is told DISPATCH again (`redelivered`): the same
/// attempt, nothing more reserved, so it can send or give the slot back with
/// NotSent. A second worker with another token, or none, is IN_PROGRESS.
async fn the_same_holder_token_recovers_a_lost_dispatch(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], Some(10)).await;
    let request = |token: &[u8]| pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "t".into(),
        idempotency_key: "charge-1".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 10,
        holder_token: token.to_vec(),
        ..Default::default()
    };
    let first = h
        .client
        .authorize(request(b"worker-a"))
        .await
        .expect("first");
    assert_eq!(first.decision(), Decision::Dispatch);
    assert!(!first.redelivered);
    // Its answer was lost; the same holder asks again.
    let again = h
        .client
        .authorize(request(b"worker-a"))
        .await
        .expect("again");
    assert_eq!(again.decision(), Decision::Dispatch);
    assert!(again.redelivered);
    assert_eq!(again.attempt, first.attempt);
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 1);
    assert_eq!(budget(&h, &permit).await, (0, 10, Some(0)));
    for other in [&b"worker-b"[..], b""] {
        expect_error(
            h.client.authorize(request(other)).await,
            Code::Aborted,
            "IDEMPOTENCY_IN_PROGRESS",
        );
    }
    let (_, error) = expect_error(
        h.client.authorize(request(&[7; 65])).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(error.violated_fields(), ["holder_token"]);
    // The redelivered holder never sent: the slot comes back.
    let attempt = again.attempt.expect("attempt");
    h.commit(&attempt, not_sent()).await.expect("not sent");
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 0);
    // Settled, the token redelivers nothing: a new call gets a new attempt.
    let next = h
        .client
        .authorize(request(b"worker-a"))
        .await
        .expect("next");
    assert!(!next.redelivered);
    assert_ne!(next.attempt.expect("a").attempt_id, attempt.attempt_id);
}
