//! The duplicate guard in each mode.

use super::*;

on_both_stores!(
    duplicate_guard_off,
    duplicate_guard_log,
    duplicate_guard_enforce,
);

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
