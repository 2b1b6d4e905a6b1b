//! Quotas: each refuses with RESOURCE_EXHAUSTED and its own reason, says its
//! limit, changes nothing (read back), and lets what is already there go on
//! (replays, settles).

use super::*;
use atmost::domain::Quotas;

on_each_store!(
    a_permit_may_not_outlive_the_lifetime_quota,
    open_attempts_past_the_quota_wait_for_a_settle,
    keys_past_the_quota_need_a_new_permit,
    a_tenant_holds_at_most_its_quota_of_unexpired_permits,
);

fn quota_error<T: std::fmt::Debug>(result: Result<T, Error>, reason: &str, limit: u64) {
    let (metadata, error) = expect_error(result, Code::ResourceExhausted, reason);
    assert_eq!(
        metadata.get("limit").map(String::as_str),
        Some(limit.to_string().as_str()),
        "{error:?}"
    );
}

async fn a_permit_may_not_outlive_the_lifetime_quota(kind: Kind) {
    let h = Harness::start_with_quotas(kind, Quotas::DEFAULT, 0).await;
    let max = Quotas::DEFAULT.max_permit_lifetime_ms;
    let mut longest = h.permit(&["t"]);
    longest.expires_at = Some(atmost_client::timestamp(h.now_ms() + max));
    h.create(longest).await;
    let mut longer = h.permit(&["t"]);
    longer.expires_at = Some(atmost_client::timestamp(h.now_ms() + max + 1000));
    quota_error(
        h.client.create_permit(longer).await,
        "QUOTA_PERMIT_LIFETIME",
        max as u64,
    );
}

async fn open_attempts_past_the_quota_wait_for_a_settle(kind: Kind) {
    let quotas = Quotas {
        max_open_attempts: 2,
        ..Quotas::DEFAULT
    };
    let h = Harness::start_with_quotas(kind, quotas, 0).await;
    let permit = h.create_with(&["t"], &[("t", 5)], Some(100)).await;
    let a = h.dispatch(&permit, "t", "k1", b"1", 10).await;
    h.dispatch(&permit, "t", "k2", b"2", 10).await;
    let before = h.get(&permit).await.expect("get");
    quota_error(
        h.authorize(&permit, "t", "k3", b"3", 10).await,
        "QUOTA_OPEN_ATTEMPTS",
        2,
    );
    assert_eq!(
        h.get(&permit).await.expect("get"),
        before,
        "nothing changed"
    );
    // The open ones go on: their holder may settle them.
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    h.dispatch(&permit, "t", "k3", b"3", 10).await;
}

async fn keys_past_the_quota_need_a_new_permit(kind: Kind) {
    let quotas = Quotas {
        max_attempts: 2,
        ..Quotas::DEFAULT
    };
    let h = Harness::start_with_quotas(kind, quotas, 0).await;
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k1", b"1", 1).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    let b = h.dispatch(&permit, "t", "k2", b"2", 1).await;
    h.commit(&b, not_sent()).await.expect("not sent");
    let before = h.get(&permit).await.expect("get");
    quota_error(
        h.authorize(&permit, "t", "k3", b"3", 1).await,
        "QUOTA_ATTEMPTS",
        2,
    );
    assert_eq!(
        h.get(&permit).await.expect("get"),
        before,
        "nothing changed"
    );
    // A recorded key replays, and a released one is no new record.
    let replay = h
        .authorize(&permit, "t", "k1", b"1", 1)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    h.dispatch(&permit, "t", "k2", b"2", 1).await;
    // A new permit has room.
    let next = h.create_with(&["t"], &[], None).await;
    h.dispatch(&next, "t", "k3", b"3", 1).await;
}

async fn a_tenant_holds_at_most_its_quota_of_unexpired_permits(kind: Kind) {
    let quotas = Quotas {
        max_permits_per_tenant: 2,
        ..Quotas::DEFAULT
    };
    let h = Harness::start_with_quotas(kind, quotas, 0).await;
    let mut short = h.permit(&["t"]);
    short.expires_at = Some(atmost_client::timestamp(h.now_ms() + 10_000));
    let short = h.create(short).await.permit_id;
    h.create_with(&["t"], &[], None).await;
    quota_error(
        h.create_with_result(&["t"]).await,
        "QUOTA_TENANT_PERMITS",
        2,
    );
    // Refused whole: no third permit is listed, the first two still are.
    let listed = h
        .client
        .list_uncertain(pb::ListUncertainRequest::default())
        .await
        .expect("list");
    assert!(listed.attempts.is_empty(), "{listed:?}");
    h.get(&short)
        .await
        .expect("the first permit is still there");
    // Once one has expired, there is room again.
    h.clock.advance(10_000);
    h.create_with(&["t"], &[], None).await;
}

/// The memory store past its size: no new permit and no new reservation,
/// while replays and settles of what it holds go on (nothing open is ever
/// evicted to make room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_refuses_new_state_past_its_size_and_keeps_serving_the_rest() {
    let _machine = crate::support::shared().await;
    let h = Harness::start_with_quotas(Kind::Memory, Quotas::DEFAULT, 16 * 1024).await;
    let permit = h.create_with(&["t"], &[], None).await;
    let first = h.dispatch(&permit, "t", "k0", b"0", 1).await;
    // Fill it with 1 KiB results until a new reservation is refused.
    let mut n = 1;
    let refused = loop {
        let key = format!("k{n}");
        match h.authorize(&permit, "t", &key, b"f", 1).await {
            Ok(r) => {
                let attempt = r.attempt.expect("attempt");
                h.commit(&attempt, succeeded(&[b'r'; 1024], None))
                    .await
                    .expect("a commit goes on");
            }
            Err(e) => break e,
        }
        n += 1;
        assert!(n < 64, "16 KiB held more than 63 results of 1 KiB");
    };
    quota_error(Err::<(), _>(refused), "QUOTA_STORE_FULL", 16 * 1024);
    quota_error(
        h.create_with_result(&["t"]).await,
        "QUOTA_STORE_FULL",
        16 * 1024,
    );
    // What it holds goes on: the open attempt settles, keys replay.
    h.commit(&first, succeeded(b"late", None))
        .await
        .expect("an open attempt still settles");
    let replay = h
        .authorize(&permit, "t", "k1", b"f", 1)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
}
