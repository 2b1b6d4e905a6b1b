//! The Redis store's key layout and retention, read straight from Redis:
//! one hash tag per permit, open attempts pinned, finished ones expiring
//! `retention` after the permit (or after the last settle, if later).

use crate::support::*;

async fn pexpiretime(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME")
        .arg(key)
        .query_async(conn)
        .await
        .expect("PEXPIRETIME")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_attempts_pin_keys_and_finished_ones_expire_after_retention() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Redis).await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    let mut spec = h.permit(&["t"]);
    let expires_at = h.now_ms() + 60_000;
    spec.expires_at = Some(atmost_client::timestamp(expires_at));
    let permit = h.create(spec).await.permit_id;
    let base = format!("{}:{{{permit}}}", redis.prefix);
    let keys = ["permit", "attempts", "dup"].map(|k| format!("{base}:{k}"));

    // Every key of the permit carries the same hash tag (one Cluster slot),
    // and they are all there is under this test's prefix.
    let mut stored: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}:*", redis.prefix))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    stored.sort();
    assert_eq!(
        stored,
        vec![format!("{}:permits", redis.prefix), keys[0].clone()]
    );
    for k in &keys {
        let tag = &k[k.find('{').expect("{")..=k.find('}').expect("}")];
        assert_eq!(tag, format!("{{{permit}}}"));
    }

    assert_eq!(pexpiretime(&mut conn, &keys[0]).await, expires_at + DAY_MS);

    let a = h.dispatch(&permit, "t", "k", b"fp", 1).await;
    let b = h.dispatch(&permit, "t", "k2", b"fp2", 1).await;
    for k in &keys {
        assert_eq!(
            pexpiretime(&mut conn, k).await,
            -1,
            "{k} pinned while attempts are open"
        );
    }
    h.mark_uncertain(&b, "lost").await.expect("mark");
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    for k in &keys {
        assert_eq!(
            pexpiretime(&mut conn, k).await,
            -1,
            "{k} pinned while one is UNCERTAIN"
        );
    }

    // Settled two days after expiry: kept for a full retention from then.
    h.clock.advance(2 * DAY_MS);
    h.resolve(&permit, "k2", resolved_failed("never charged"))
        .await
        .expect("resolve");
    let settled_at = h.now_ms();
    for k in &keys {
        assert_eq!(pexpiretime(&mut conn, k).await, settled_at + DAY_MS, "{k}");
    }
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 1)
        .await
        .expect("replay");
    assert_eq!(replay.attempt.expect("a").receipt.expect("r").result, b"ok");
}

/// A permit record this version cannot read (a status or guard mode it does
/// not know, a counter missing or not a number: another version's or a
/// hand-edited record) answers UNAVAILABLE, through the scripts, GetPermit
/// and the uncertain census alike, and the refused call writes nothing:
/// never a default, never a decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_permit_record_is_unavailable_never_a_guess() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Redis).await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    // (field, new value or None to delete it, whether Commit reads it,
    // whether GetPermit does; tests/redis_corruption.rs has every field of
    // every script)
    for (field, value, commit_reads_it, get_reads_it) in [
        ("gmode", Some("7"), false, true),
        ("status", Some("3"), false, true),
        ("reserved", None, true, true),
        ("open", Some("x"), true, true),
        ("n:t", Some("x"), true, true),
    ] {
        let permit = h.create_with(&["t"], &[], None).await;
        let open = h.dispatch(&permit, "t", "open", b"open", 1).await;
        let key = format!("{}:{{{permit}}}:permit", redis.prefix);
        let edit = match value {
            Some(v) => redis::cmd("HSET").arg(&key).arg(field).arg(v).clone(),
            None => redis::cmd("HDEL").arg(&key).arg(field).clone(),
        };
        let _: i64 = edit.query_async(&mut conn).await.expect("edit the record");
        let before: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("HGETALL");
        expect_error(
            h.authorize(&permit, "t", "k", b"fp", 1).await,
            tonic::Code::Unavailable,
            "STORE_UNAVAILABLE",
        );
        let attempts = format!("{}:{{{permit}}}:attempts", redis.prefix);
        let recorded: bool = redis::cmd("HEXISTS")
            .arg(&attempts)
            .arg("k")
            .query_async(&mut conn)
            .await
            .expect("HEXISTS");
        assert!(
            !recorded,
            "{field}: a refused Authorize recorded an attempt"
        );
        if commit_reads_it {
            expect_error(
                h.commit(&open, succeeded(b"ok", None)).await,
                tonic::Code::Unavailable,
                "STORE_UNAVAILABLE",
            );
        }
        if get_reads_it {
            expect_error(
                h.get(&permit).await,
                tonic::Code::Unavailable,
                "STORE_UNAVAILABLE",
            );
        }
        let after: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("HGETALL");
        assert_eq!(before, after, "{field}: a refused call changed the permit");
    }
    // The census (census.lua) reads the open counter too: the permit whose
    // counter is "x" fails the pass, never counts as nothing open.
    {
        use atmost::store::Store as _;
        let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(2));
        match store.census(None, h.now_ms()).await {
            Err(atmost::domain::Error::StoreUnavailable(why)) => {
                assert!(why.contains("unreadable permit record"), "{why}");
            }
            other => panic!("the census read an unreadable counter: {other:?}"),
        }
    }

    // An open attempt whose state this version does not know: its replay
    // and every listing that meets it answer UNAVAILABLE; it is neither
    // replayed as something else nor skipped.
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "k", b"fp", 1).await;
    let attempts = format!("{}:{{{permit}}}:attempts", redis.prefix);
    let _: () = redis::cmd("EVAL")
        .arg(
            "local t = cmsgpack.unpack(redis.call('HGET', KEYS[1], ARGV[1])) \
             t[5] = 9 redis.call('HSET', KEYS[1], ARGV[1], cmsgpack.pack(t))",
        )
        .arg(1)
        .arg(&attempts)
        .arg("k")
        .query_async(&mut conn)
        .await
        .expect("set an unknown state");
    expect_error(
        h.authorize(&permit, "t", "k", b"fp", 1).await,
        tonic::Code::Unavailable,
        "STORE_UNAVAILABLE",
    );
    // A listing reads only what is uncertain at its `now`: past the lease,
    // this attempt is in its range.
    h.clock.advance(30_000);
    for listed in [&permit[..], ""] {
        expect_error(
            h.list(listed, 10, "").await,
            tonic::Code::Unavailable,
            "STORE_UNAVAILABLE",
        );
    }
}

/// The longest retention on a permit that expires at the latest instant a
/// timestamp may name: when its last open attempt settles, its keys are
/// given that far-off expiry, not deleted (expiry plus retention once
/// overflowed in Lua and PEXPIREAT deleted them at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_retention_on_the_latest_expiry_deletes_nothing() {
    use atmost::domain::{MAX_RETENTION_MS, MAX_TIMESTAMP_MS};
    let _machine = shared().await;
    let redis = Redis::start();
    let store = atmost::store::redis::RedisStore::connect(&atmost::store::redis::RedisConfig {
        url: redis.url.clone(),
        prefix: redis.prefix.clone(),
        retention_ms: MAX_RETENTION_MS,
        timeout: std::time::Duration::from_secs(2),
        allow_eviction: false,
        time: atmost::store::redis::Time::Caller,
        tls_ca: None,
        ..atmost::store::redis::RedisConfig::new("", "")
    })
    .expect("the longest retention is accepted")
    // A permit lifetime no flag allows (the library's own bounds).
    .with_quotas(atmost::domain::Quotas::UNLIMITED);
    let h = Harness::serve(atmost::store::Backend::Redis(store), Some(redis), |app| app).await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    let latest = MAX_TIMESTAMP_MS - 999; // whole seconds on the wire
    let mut spec = h.permit(&["t"]);
    spec.expires_at = Some(atmost_client::timestamp(latest));
    let permit = h.create(spec).await.permit_id;
    let a = h.dispatch(&permit, "t", "k", b"fp", 1).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    for k in ["permit", "attempts", "dup"] {
        let key = format!("{}:{{{permit}}}:{k}", redis.prefix);
        assert_eq!(
            pexpiretime(&mut conn, &key).await,
            latest + MAX_RETENTION_MS,
            "{key}"
        );
    }
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 1)
        .await
        .expect("replay");
    assert_eq!(replay.attempt.expect("a").receipt.expect("r").result, b"ok");

    let too_long = atmost::store::redis::RedisStore::connect(&atmost::store::redis::RedisConfig {
        url: redis.url.clone(),
        prefix: redis.prefix.clone(),
        retention_ms: MAX_RETENTION_MS + 1,
        timeout: std::time::Duration::from_secs(2),
        allow_eviction: false,
        time: atmost::store::redis::Time::Caller,
        tls_ca: None,
        ..atmost::store::redis::RedisConfig::new("", "")
    });
    assert!(too_long.is_err(), "a retention past the bound is refused");
}

async fn index_size(conn: &mut redis::aio::MultiplexedConnection, prefix: &str) -> usize {
    redis::cmd("ZCARD")
        .arg(format!("{prefix}:permits"))
        .query_async(conn)
        .await
        .expect("ZCARD")
}

/// Waits for the sweeper to bring the index to `size`; the size it ended at.
async fn sweep_to(
    conn: &mut redis::aio::MultiplexedConnection,
    prefix: &str,
    size: usize,
) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = index_size(conn, prefix).await;
        if now == size || std::time::Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The cross-permit index shrinks back: the sweeper drops every expired
/// permit with nothing open, keeps one with an UNCERTAIN attempt (which
/// the cross-permit listing must still find), and drops it once resolved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cross_permit_index_shrinks_back_once_permits_expire() {
    use atmost::store::INDEX_MARGIN_MS;
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(2));
    let h = Harness::serve(atmost::store::Backend::Redis(store), Some(redis), |app| {
        app.with_sweep_interval(std::time::Duration::from_millis(20))
    })
    .await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    let expires_at = h.now_ms() + 3_600_000;
    let mut permits = Vec::new();
    for _ in 0..100 {
        permits.push(h.create_with(&["t"], &[], None).await);
    }
    let done = h.dispatch(&permits[0], "t", "k", b"fp", 0).await;
    h.commit(&done, succeeded(b"ok", None))
        .await
        .expect("commit");
    let lost = h.dispatch(&permits[1], "t", "k", b"fp", 0).await;
    h.mark_uncertain(&lost, "lost").await.expect("mark");
    assert_eq!(index_size(&mut conn, &redis.prefix).await, 100);

    // Live permits stay, however often the sweeper comes by.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(index_size(&mut conn, &redis.prefix).await, 100);
    // Expired (by the margin that covers a step back of the clock): only
    // the one with an open attempt is left.
    h.clock.set(expires_at + INDEX_MARGIN_MS + 1);
    assert_eq!(sweep_to(&mut conn, &redis.prefix, 1).await, 1);
    // A permit that left the index is closed to new keys, even if Redis's
    // clock steps back before its expiry (NTP, a failover to a node whose
    // clock is behind): no attempt can open where the index would miss it.
    h.clock.set(expires_at - 60_000);
    let (meta, _) = expect_error(
        h.authorize(&permits[5], "t", "after-close", b"fp", 0).await,
        tonic::Code::FailedPrecondition,
        "PERMIT_EXPIRED",
    );
    assert_eq!(
        meta["expired_at"],
        atmost::api::status::rfc3339(expires_at),
        "{meta:?}"
    );
    // The one with an UNCERTAIN attempt was not closed: it stays indexed.
    h.dispatch(&permits[1], "t", "still-open", b"fp2", 0).await;
    h.clock.set(expires_at + INDEX_MARGIN_MS + 1);
    let listed: Vec<_> = h
        .list_all("", 10)
        .await
        .into_iter()
        .map(|a| a.idempotency_key)
        .collect();
    assert_eq!(listed, ["k", "still-open"]);
    for key in ["k", "still-open"] {
        h.resolve(&permits[1], key, resolved_failed("declined"))
            .await
            .expect("resolve");
    }
    assert_eq!(sweep_to(&mut conn, &redis.prefix, 0).await, 0);
    assert!(h.list_all("", 10).await.is_empty());
}

/// All of a permit's keys expire together, so a permit hash gone while its
/// attempts remain is a lost record (evicted, or deleted by hand): every
/// RPC that meets it answers UNAVAILABLE, never PERMIT_NOT_FOUND (the
/// caller would read that as "nothing was ever reserved").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_hash_lost_with_attempts_left_is_unavailable() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Redis).await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let _: () = redis::cmd("DEL")
        .arg(format!("{}:{{{permit}}}:permit", redis.prefix))
        .query_async(&mut conn)
        .await
        .expect("DEL");
    for result in [
        h.authorize(&permit, "t", "k", b"fp", 0).await.map(drop),
        h.authorize(&permit, "t", "new", b"fp2", 0).await.map(drop),
        h.commit(&a, succeeded(b"ok", None)).await.map(drop),
        h.mark_uncertain(&a, "lost").await.map(drop),
        h.get(&permit).await.map(drop),
        h.list(&permit, 10, "").await.map(drop),
    ] {
        expect_error(result, tonic::Code::Unavailable, "STORE_UNAVAILABLE");
    }
}
