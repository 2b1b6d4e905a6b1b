//! UNCERTAIN attempts: leases, MarkUncertain, ListUncertain paging, and the worked example of docs/api.md.

use super::*;

on_both_stores!(
    lease_expiry_turns_reserved_into_uncertain,
    mark_uncertain_holds_slot_and_money,
    list_uncertain_pages_within_and_across_permits,
    permits_created_during_listing_are_never_lost,
    a_large_page_lists_every_attempt_once_in_order,
    timeout_then_new_key_story,
);

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

async fn list_uncertain_pages_within_and_across_permits(h: Harness) {
    let p1 = h.create_with(&["t"], &[], None).await;
    let p2 = h.create_with(&["t"], &[], None).await;
    let p3 = h.create_with(&["t"], &[], None).await; // never uncertain
    // In a permit's listing, attempts come by when they became uncertain,
    // then by key: the marked ones (now), then those whose lease passes.
    let mut expected = Vec::new();
    for (permit, n) in [(&p1, 5), (&p2, 3)] {
        let (mut marked, mut leased) = (Vec::new(), Vec::new());
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
                marked.push(a.attempt_id);
            } else {
                leased.push(a.attempt_id);
            }
        }
        expected.extend(marked);
        expected.extend(leased);
    }
    h.dispatch(&p3, "t", "settled", b"x", 0).await;
    // Before the leases pass only the marked ones are uncertain.
    assert_eq!(h.list_all(&p1, 2).await.len(), 3);
    let marked_at = h.now_ms();
    h.clock.advance(30_000);
    // Each says since when it is uncertain: when it was marked, or when
    // its lease ended.
    for a in h.list_all(&p1, 10).await {
        let since = atmost_client::millis(a.uncertain_since.as_ref().expect("since"));
        let lease_end = atmost_client::millis(a.lease_expires_at.as_ref().expect("lease"));
        match a.uncertain_reason.as_str() {
            "lost" => assert_eq!(since, marked_at),
            _ => assert_eq!(since, lease_end),
        }
    }
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

/// A page larger than one store read (the Redis store reads 200 attempts
/// per script run) still lists each uncertain attempt once, in order.
async fn a_large_page_lists_every_attempt_once_in_order(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let mut expected = Vec::new();
    for i in 0..450 {
        let key = format!("k{i:04}");
        let a = h.dispatch(&permit, "t", &key, key.as_bytes(), 0).await;
        expected.push(key);
        if i % 3 == 0 {
            h.mark_uncertain(&a, "lost").await.expect("mark");
        }
    }
    // Marked ones first (uncertain since now), then the leases (all end
    // at the same instant): each group in key order.
    h.clock.advance(30_000);
    let (marked, leased): (Vec<_>, Vec<_>) =
        expected.iter().enumerate().partition(|(i, _)| i % 3 == 0);
    let expected: Vec<&String> = marked.into_iter().chain(leased).map(|(_, k)| k).collect();
    for page_size in [1000, 250, 200, 199] {
        let listed: Vec<String> = h
            .list_all(&permit, page_size)
            .await
            .into_iter()
            .map(|a| a.idempotency_key)
            .collect();
        assert_eq!(
            listed.iter().collect::<Vec<_>>(),
            expected,
            "page size {page_size}"
        );
    }
}
