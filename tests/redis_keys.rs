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
    // The census (census.lua) reads the uncertain index, not the permits:
    // a member not of the shape atmost writes fails the pass, never counts
    // as nothing uncertain.
    {
        use atmost::store::Store as _;
        let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(2));
        let _: () = redis::cmd("ZADD")
            .arg(format!("{}:uncertain:{{0}}", redis.prefix))
            .arg(0)
            .arg("0000000000000:p:k")
            .query_async(&mut conn)
            .await
            .expect("ZADD");
        match store.census(h.now_ms(), std::time::Duration::ZERO).await {
            Err(atmost::domain::Error::StoreUnavailable(why)) => {
                assert!(why.contains("uncertain index member"), "{why}");
            }
            other => panic!("the census read an unreadable member: {other:?}"),
        }
        let _: () = redis::cmd("ZREM")
            .arg(format!("{}:uncertain:{{0}}", redis.prefix))
            .arg("0000000000000:p:k")
            .query_async(&mut conn)
            .await
            .expect("ZREM");
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

// === the tenants index ===

/// Far past the wall clock (as in the model test): Redis expires keys on
/// its own clock, the store decides on this one (`Time::Caller`).
const T0: atmost::domain::Millis = 4_102_444_800_000;
const HOUR_MS: atmost::domain::Millis = 3_600_000;

/// A permit of `tenant` over tool "t", created at `created_at`, with a 1 s
/// lease.
fn tenant_permit(
    id: u128,
    tenant: &str,
    created_at: atmost::domain::Millis,
    expires_at: atmost::domain::Millis,
) -> atmost::domain::Permit {
    use atmost::domain::{DuplicateGuard, GuardMode, Permit, PermitStatus, UncertainPolicy};
    Permit {
        permit_id: uuid::Uuid::from_u128(id).to_string(),
        subject: "agent".into(),
        tools: vec!["t".into()],
        max_calls_per_tool: Default::default(),
        budget: None,
        currency: String::new(),
        expires_at,
        lease_ms: 1_000,
        duplicate_guard: DuplicateGuard {
            mode: GuardMode::Off,
            window_ms: 1,
        },
        uncertain_policy: UncertainPolicy::Count,
        status: PermitStatus::Active,
        created_at,
        tenant: tenant.into(),
        agents: Vec::new(),
        approval_per_tool: Default::default(),
    }
}

fn scope_of(tenant: &str) -> atmost::domain::Scope {
    atmost::domain::Scope {
        tenant: tenant.into(),
        ..Default::default()
    }
}

/// Opens key `key` under the permit at `now`: RESERVED, UNCERTAIN once its
/// 1 s lease has passed. Its attempt id.
async fn open_attempt(
    store: &atmost::store::redis::RedisStore,
    permit: &atmost::domain::Permit,
    key: &str,
    now: atmost::domain::Millis,
) -> String {
    use atmost::store::Store as _;
    let cmd = atmost::domain::AuthorizeCmd {
        permit_id: permit.permit_id.clone(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: vec![1],
        cost: 0,
        holder_token: Vec::new(),
        approval_summary: String::new(),
    };
    store
        .authorize(
            &scope_of(&permit.tenant),
            &cmd,
            now,
            atmost::domain::new_id(now),
        )
        .await
        .expect("authorize")
        .attempt
        .attempt_id
}

/// Opens key `key` under the permit at `now` ([`open_attempt`]) and marks
/// it UNCERTAIN at `marked`: the attempt as marked.
async fn uncertain_attempt(
    store: &atmost::store::redis::RedisStore,
    permit: &atmost::domain::Permit,
    key: &str,
    now: atmost::domain::Millis,
    marked: atmost::domain::Millis,
) -> atmost::domain::Attempt {
    use atmost::store::Store as _;
    let cmd = atmost::domain::MarkUncertainCmd {
        permit_id: permit.permit_id.clone(),
        idempotency_key: key.into(),
        attempt_id: open_attempt(store, permit, key, now).await,
        reason: "lost".into(),
    };
    store
        .mark_uncertain(&scope_of(&permit.tenant), &cmd, marked)
        .await
        .expect("mark")
}

/// A connection to the shared test Cluster at `urls`.
async fn cluster_conn(urls: &str) -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClient::new(urls.split(',').collect::<Vec<_>>())
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("connect to the Cluster")
}

/// The tenants index as Redis holds it: (tenant, token) per member, in
/// order.
async fn tenants_index(
    conn: &mut impl redis::aio::ConnectionLike,
    prefix: &str,
) -> Vec<(String, String)> {
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(format!("{prefix}:tenants"))
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .expect("ZRANGE the tenants index");
    members
        .iter()
        .map(|m| {
            let (tenant, token) = m.split_once('\n').expect("<tenant>\\n<token>");
            (tenant.to_owned(), token.to_owned())
        })
        .collect()
}

fn entry(permit: &atmost::domain::Permit) -> (String, String) {
    (permit.tenant.clone(), permit.permit_id.clone())
}

/// Sweeps until a call drops nothing.
async fn sweep_all(store: &atmost::store::redis::RedisStore, now: atmost::domain::Millis) {
    use atmost::store::Store as _;
    for _ in 0..8 {
        if store.sweep(now).await.expect("sweep") == 0 {
            return;
        }
    }
    panic!("the sweep still drops something after 8 calls");
}

/// A census pass's UNCERTAIN attempts.
async fn census_count(
    store: &atmost::store::redis::RedisStore,
    now: atmost::domain::Millis,
) -> u64 {
    use atmost::store::Store as _;
    store
        .census(now, std::time::Duration::ZERO)
        .await
        .expect("census")
        .uncertain
}

/// The tenants index follows the tenants' permits: a tenant leaves it when
/// the sweep drops its last index entry (its permit past retention, or
/// expired by the margin and closed), stays while a permit may still hold
/// an open attempt, and comes back with its next permit; the census counts
/// every UNCERTAIN attempt throughout. On one Redis and on a Cluster, where
/// the tenants index and each tenant's index are in slots of their own.
async fn the_tenants_index_shrinks_with_the_last_permit(
    store: atmost::store::redis::RedisStore,
    conn: &mut impl redis::aio::ConnectionLike,
    prefix: &str,
) {
    use atmost::domain::Outcome;
    use atmost::store::{INDEX_MARGIN_MS, Store as _};
    // (On a Cluster the store draws another id, in a slot of its
    // uncertain index: each permit as stored.)
    let mut created = Vec::new();
    for (n, tenant, expires_at) in [
        (1, "acme", T0 + HOUR_MS),
        (2, "acme", T0 + 2 * HOUR_MS),
        (3, "globex", T0 + HOUR_MS),
    ] {
        let p = tenant_permit(n, tenant, T0, expires_at);
        created.push(store.create_permit(p).await.expect("create"));
    }
    let [_a1, a2, g1] = <[_; 3]>::try_from(created).expect("three");
    let lost = open_attempt(&store, &g1, "lost", T0).await;
    assert_eq!(
        tenants_index(conn, prefix).await,
        [entry(&a2), entry(&g1)],
        "each tenant once, with its latest permit's id"
    );

    // a1 expired by the margin: dropped, but acme still has a2.
    let now = T0 + HOUR_MS + INDEX_MARGIN_MS + 1;
    sweep_all(&store, now).await;
    assert_eq!(tenants_index(conn, prefix).await, [entry(&a2), entry(&g1)]);
    assert_eq!(census_count(&store, now).await, 1);

    // a2 past its retention: acme's index is empty and acme leaves; globex
    // stays, its permit holding an UNCERTAIN attempt.
    let now = T0 + 2 * HOUR_MS + DAY_MS + 1;
    sweep_all(&store, now).await;
    assert_eq!(tenants_index(conn, prefix).await, [entry(&g1)]);
    let acme_index: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}:permits:acme"))
        .query_async(conn)
        .await
        .expect("EXISTS");
    assert!(!acme_index, "acme's index is empty");
    assert_eq!(census_count(&store, now).await, 1, "globex's attempt");

    // A new permit brings acme back, and the census finds its attempt.
    let a3 = store
        .create_permit(tenant_permit(4, "acme", now, now + HOUR_MS))
        .await
        .expect("create");
    assert_eq!(tenants_index(conn, prefix).await, [entry(&a3), entry(&g1)]);
    let open = open_attempt(&store, &a3, "k", now).await;
    let now = now + 1_000;
    assert_eq!(census_count(&store, now).await, 2);
    sweep_all(&store, now).await;
    assert_eq!(tenants_index(conn, prefix).await, [entry(&a3), entry(&g1)]);

    // globex's attempt resolved: its permit leaves its index, globex the
    // tenants index.
    let resolve = atmost::domain::ResolveCmd {
        permit_id: g1.permit_id.clone(),
        idempotency_key: "lost".into(),
        attempt_id: lost,
        outcome: Outcome::Failed {
            reason: "declined".into(),
        },
    };
    store
        .resolve(
            &scope_of("globex"),
            &resolve,
            now,
            atmost::domain::new_id(now),
        )
        .await
        .expect("resolve");
    sweep_all(&store, now).await;
    assert_eq!(tenants_index(conn, prefix).await, [entry(&a3)]);

    // And acme's last one, once resolved and expired: nothing is left.
    let resolve = atmost::domain::ResolveCmd {
        permit_id: a3.permit_id.clone(),
        idempotency_key: "k".into(),
        attempt_id: open,
        outcome: Outcome::NotSent,
    };
    store
        .resolve(
            &scope_of("acme"),
            &resolve,
            now,
            atmost::domain::new_id(now),
        )
        .await
        .expect("resolve");
    let now = now + HOUR_MS + INDEX_MARGIN_MS;
    sweep_all(&store, now).await;
    assert_eq!(tenants_index(conn, prefix).await, []);
    assert_eq!(census_count(&store, now).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_index_shrinks_with_the_last_permit_on_redis() {
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    the_tenants_index_shrinks_with_the_last_permit(store, &mut conn, &redis.prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenants_index_shrinks_with_the_last_permit_on_a_cluster() {
    let _machine = shared().await;
    let urls = tokio::task::block_in_place(shared_cluster);
    let prefix = format!("t{}", uuid::Uuid::now_v7().simple());
    let store = cluster_store(urls, &prefix, std::time::Duration::from_secs(5));
    let mut conn = cluster_conn(urls).await;
    the_tenants_index_shrinks_with_the_last_permit(store, &mut conn, &prefix).await;
}

/// A cross-permit listing and the census cost what is uncertain, not what
/// is live: with 300 live permits, 100 of them holding an attempt in
/// flight (RESERVED within its lease) and 3 an UNCERTAIN one, the whole
/// walk runs one script for the index and one per uncertain permit, and
/// the census one, counted by Redis itself (INFO commandstats, on a Redis
/// of this test's own). A walk over every permit ran 300.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_permit_listing_and_the_census_read_only_what_is_uncertain() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let redis = Redis::start_owned();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let scope = scope_of("acme");
    let mut uncertain = Vec::new();
    for n in 0..300u128 {
        let p = store
            .create_permit(tenant_permit(1_000 + n, "acme", T0, T0 + HOUR_MS))
            .await
            .expect("create");
        if n % 100 == 1 {
            uncertain_attempt(&store, &p, "k", T0, T0 + 10).await;
            uncertain.push(p.permit_id);
        } else if n % 3 == 0 {
            open_attempt(&store, &p, "k", T0).await;
        }
    }
    let fcalls = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut conn)
                .await
                .expect("INFO");
            info.lines()
                .find_map(|l| l.strip_prefix("cmdstat_fcall:calls="))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse::<u64>().expect("a count"))
        }
    };
    // Within every lease (1 s): only the marked ones are uncertain.
    let now = T0 + 500;
    let before = fcalls(&mut conn).await;
    let page = store
        .list_uncertain(&scope, None, None, 100, now)
        .await
        .expect("list");
    let walked = fcalls(&mut conn).await - before;
    let mut listed: Vec<String> = page.attempts.iter().map(|a| a.permit_id.clone()).collect();
    listed.sort();
    uncertain.sort();
    assert_eq!(listed, uncertain);
    assert_eq!(page.next, None);
    assert_eq!(walked, 1 + 3, "scripts run by the whole walk");
    let before = fcalls(&mut conn).await;
    assert_eq!(census_count(&store, now).await, 3);
    assert_eq!(
        fcalls(&mut conn).await - before,
        1,
        "scripts run by the census"
    );
}

/// An uncertain attempt whose permit record is gone (a hand DEL, a partial
/// restore) while the index still names it: the cross-permit listing
/// answers UNAVAILABLE instead of leaving it out (the census still counts
/// it), never a silent gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexed_attempt_of_a_permit_that_is_gone_is_unavailable() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let scope = scope_of("acme");
    let p = store
        .create_permit(tenant_permit(7, "acme", T0, T0 + HOUR_MS))
        .await
        .expect("create");
    uncertain_attempt(&store, &p, "k", T0, T0 + 1).await;
    let _: () = redis::cmd("DEL")
        .arg(format!("{}:{{{}}}:permit", redis.prefix, p.permit_id))
        .arg(format!("{}:{{{}}}:attempts", redis.prefix, p.permit_id))
        .query_async(&mut conn)
        .await
        .expect("DEL");
    match store.list_uncertain(&scope, None, None, 10, T0 + 2).await {
        Err(atmost::domain::Error::StoreUnavailable(why)) => {
            assert!(why.contains("permit that is gone"), "{why}");
        }
        other => panic!("an indexed attempt left out: {other:?}"),
    }
    assert_eq!(census_count(&store, T0 + 2).await, 1);
}

/// The cross-permit listing reads the index and then the attempts, two
/// readings of Redis's clock: an attempt listed as past its lease on the
/// first is left out, not refused, if the second (the clock stepped back)
/// finds it within its lease. Here the second reading is passed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_listed_before_a_clock_step_back_is_left_out_not_refused() {
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    use atmost::store::Store as _;
    let p = store
        .create_permit(tenant_permit(8, "acme", T0, T0 + HOUR_MS))
        .await
        .expect("create");
    open_attempt(&store, &p, "k", T0).await;
    let lease = T0 + 1_000;
    crate::support::load_library(&mut conn).await;
    let function = atmost::store::redis::function_name("uncertain_attempts").expect("the script");
    let id = &p.permit_id;
    let prefix = &redis.prefix;
    for (now, listed) in [(lease, 1), (lease - 1, 0)] {
        let packed: Vec<u8> = redis::cmd("FCALL")
            .arg(function)
            .arg(4)
            .arg(format!("{prefix}:{{{id}}}:permit"))
            .arg(format!("{prefix}:{{{id}}}:attempts"))
            .arg(format!("{prefix}:{{{id}}}:open"))
            .arg(format!("{prefix}:uncertain:{{0}}:t:acme"))
            .arg(now.to_string())
            .arg("acme")
            .arg("")
            .arg(format!("{lease:015}:k"))
            .query_async(&mut conn)
            .await
            .expect("FCALL");
        let reply = atmost::store::redis::unpack_reply(&packed).expect("a reply");
        assert_eq!(reply.len(), 1 + listed, "at {now}: {reply:?}");
    }
}

/// Figures another replica published "after" now (Redis's clock stepped
/// back since) while it holds the turn are not read as just counted: this
/// replica counts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn census_figures_from_after_now_are_counted_afresh() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let now = T0 + 10_000;
    let _: () = redis::cmd("HSET")
        .arg(format!("{}:census:{{c}}", redis.prefix))
        .arg("uncertain")
        .arg("99")
        .arg("oldest")
        .arg("0")
        .arg("at")
        .arg((now + 60_000).to_string())
        .arg("until")
        .arg((now + 5_000).to_string())
        .arg("by")
        .arg("another replica")
        .query_async(&mut conn)
        .await
        .expect("HSET");
    let figures = store
        .census(now, std::time::Duration::from_secs(10))
        .await
        .expect("census");
    assert_eq!((figures.uncertain, figures.age_ms), (0, 0), "{figures:?}");
}

/// An open attempt missing from its permit's open set while the index
/// still names it (a partial restore, a hand ZREM): UNAVAILABLE, never a
/// silent gap in the cross-permit listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexed_attempt_missing_from_the_open_set_is_unavailable() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let p = store
        .create_permit(tenant_permit(9, "acme", T0, T0 + HOUR_MS))
        .await
        .expect("create");
    open_attempt(&store, &p, "k", T0).await;
    let _: () = redis::cmd("DEL")
        .arg(format!("{}:{{{}}}:open", redis.prefix, p.permit_id))
        .query_async(&mut conn)
        .await
        .expect("DEL");
    match store
        .list_uncertain(&scope_of("acme"), None, None, 10, T0 + 2_000)
        .await
    {
        Err(atmost::domain::Error::StoreUnavailable(why)) => {
            assert!(why.contains("open set disagrees"), "{why}");
        }
        other => panic!("an indexed attempt left out: {other:?}"),
    }
}

/// On a Cluster the uncertain index is sharded by slot: every permit is
/// placed in one of its 64 slots (so its scripts write its shard), a
/// listing across permits merges the shards in order and finds every
/// uncertain attempt once, the census counts them all, and a permit outside
/// those slots (one an earlier version created under the same prefix,
/// here a copy of a permit's keys under another id) is refused before
/// anything is reserved, since no walk would find its attempts; an id no
/// permit has stays PERMIT_NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_uncertain_index_is_sharded_by_slot_on_a_cluster() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let urls = tokio::task::block_in_place(shared_cluster);
    let prefix = format!("u{}", uuid::Uuid::now_v7().simple());
    let store = cluster_store(urls, &prefix, std::time::Duration::from_secs(5));
    let mut conn = cluster_conn(urls).await;
    let scope = scope_of("acme");
    // Cluster's slot of a permit's keys (their hash tag, the id).
    let slot = |id: &str| crc16::State::<crc16::XMODEM>::calculate(id.as_bytes()) % 16384;
    let mut slots = std::collections::HashSet::new();
    let mut marked = Vec::new();
    for n in 0..24 {
        let p = store
            .create_permit(tenant_permit(100 + n, "acme", T0, T0 + HOUR_MS))
            .await
            .expect("create");
        slots.insert(slot(&p.permit_id));
        let a = uncertain_attempt(&store, &p, "k", T0 + n as i64, T0 + 100 + n as i64).await;
        marked.push((a.uncertain_since, p.permit_id.clone()));
    }
    assert!(slots.len() > 8, "24 permits in {} slots", slots.len());
    assert!(
        slots.iter().all(|s| s % 256 == 0),
        "{slots:?}: each in a shard's slot"
    );
    // Pages of 5 across every shard, in order, each attempt once.
    let now = T0 + 1_000;
    let (mut listed, mut after) = (Vec::new(), None);
    loop {
        let page = store
            .list_uncertain(&scope, None, after.as_ref(), 5, now)
            .await
            .expect("list");
        listed.extend(
            page.attempts
                .iter()
                .map(|a| (a.uncertain_since, a.permit_id.clone())),
        );
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    marked.sort();
    assert_eq!(listed, marked, "every uncertain attempt, in order, once");
    assert_eq!(census_count(&store, now).await, 24);

    // A permit's keys copied under an id in a slot of no shard.
    let source = &marked[0].1;
    let legacy = (0u128..)
        .map(|n| uuid::Uuid::from_u128(0xabc0_0000 + n).to_string())
        .find(|id| slot(id) % 256 != 0)
        .expect("an id outside the shards");
    let dump: Vec<u8> = redis::cmd("DUMP")
        .arg(format!("{prefix}:{{{source}}}:permit"))
        .query_async(&mut conn)
        .await
        .expect("DUMP");
    let _: () = redis::cmd("RESTORE")
        .arg(format!("{prefix}:{{{legacy}}}:permit"))
        .arg(0)
        .arg(dump)
        .query_async(&mut conn)
        .await
        .expect("RESTORE");
    let cmd = atmost::domain::AuthorizeCmd {
        permit_id: legacy.clone(),
        tool: "t".into(),
        idempotency_key: "new".into(),
        request_fingerprint: vec![1],
        cost: 0,
        holder_token: Vec::new(),
        approval_summary: String::new(),
    };
    match store
        .authorize(&scope, &cmd, now, atmost::domain::new_id(now))
        .await
    {
        Err(atmost::domain::Error::StoreUnavailable(why)) => {
            assert!(why.contains("earlier version"), "{why}");
        }
        other => panic!("a permit outside the shards was served: {other:?}"),
    }
    let attempts: bool = redis::cmd("EXISTS")
        .arg(format!("{prefix}:{{{legacy}}}:attempts"))
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    assert!(!attempts, "nothing reserved");
    let unknown = atmost::domain::AuthorizeCmd {
        permit_id: uuid::Uuid::from_u128(0xdead).to_string(),
        ..cmd
    };
    assert!(matches!(
        store
            .authorize(&scope, &unknown, now, atmost::domain::new_id(now))
            .await,
        Err(atmost::domain::Error::PermitNotFound { .. })
    ));
}

/// The race the token is for: the sweep reads acme's entry, drops acme's
/// last permit and sees the index empty; before it removes the entry,
/// CreatePermit indexes a new permit of acme and writes acme's entry. The
/// sweep is stopped there by holding Redis's reply (the proxy switches to
/// holding before the sweep's last ZREM of acme's index reaches Redis), so
/// the interleaving is exact. The sweep's removal then meets a new token
/// and removes nothing: the new permit, with its open attempt, stays
/// reachable by the sweep and the census.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_created_while_the_sweep_lets_its_tenant_go_keeps_it() {
    use atmost::store::{INDEX_MARGIN_MS, Store as _};
    let _machine = shared().await;
    let redis = Redis::start();
    let held = proxy::Proxy::for_redis(&redis.url).await;
    let timeout = std::time::Duration::from_secs(10);
    let sweeper = redis_store(&held.url(), &redis.prefix, timeout);
    let store = redis_store(&redis.url, &redis.prefix, timeout);
    let mut conn = redis.connect().await;
    let a1 = tenant_permit(1, "acme", T0, T0 + HOUR_MS);
    store.create_permit(a1.clone()).await.expect("create");
    assert_eq!(tenants_index(&mut conn, &redis.prefix).await, [entry(&a1)]);

    let now = T0 + HOUR_MS + INDEX_MARGIN_MS + 1;
    let index = format!("{}:permits:acme", redis.prefix);
    held.hold_from("ZREM", &index);
    let sweep = tokio::spawn(async move { sweeper.sweep(now).await });
    // The sweep's ZREM of a1 (and the EXISTS after it) ran; their replies
    // are held.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while held.count_command("ZREM", &index) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweep never dropped a1: {:?}",
            held.commands()
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let in_index: usize = redis::cmd("ZCARD")
        .arg(&index)
        .query_async(&mut conn)
        .await
        .expect("ZCARD");
    assert_eq!(in_index, 0, "the sweep saw acme's index empty");

    let a2 = tenant_permit(2, "acme", now, now + HOUR_MS);
    store.create_permit(a2.clone()).await.expect("create");
    open_attempt(&store, &a2, "k", now).await;
    held.set_mode(proxy::Mode::Pass);
    let swept = sweep.await.expect("sweep task");
    assert_eq!(
        held.count_command("ZREM", &format!("{}:tenants", redis.prefix)),
        1,
        "the sweep tried to let acme go: {:?}",
        held.commands()
    );
    assert_eq!(
        tenants_index(&mut conn, &redis.prefix).await,
        [entry(&a2)],
        "acme stays, with a2's token"
    );
    assert_eq!(swept, Ok(1), "a1 dropped, and nothing else");
    let now = now + 1_000;
    assert_eq!(
        census_count(&store, now).await,
        1,
        "a2's attempt is counted"
    );
    sweep_all(&store, now + 2 * HOUR_MS).await;
    assert_eq!(tenants_index(&mut conn, &redis.prefix).await, [entry(&a2)]);
    assert_eq!(census_count(&store, now + 2 * HOUR_MS).await, 1);
}

/// A tenants index member this version cannot read (another version's, or
/// written by hand) fails the census, never counted as nothing, and the
/// sweep leaves it in place; index_tenant.lua refuses a tenant or a token
/// that cannot make an entry, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_tenants_index_entry_is_unavailable_and_left_alone() {
    use atmost::store::Store as _;
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let a1 = tenant_permit(1, "acme", T0, T0 + HOUR_MS);
    store.create_permit(a1.clone()).await.expect("create");
    let key = format!("{}:tenants", redis.prefix);

    crate::support::load_library(&mut conn).await;
    let function = atmost::store::redis::function_name("index_tenant").expect("index_tenant.lua");
    for (tenant, token) in [
        ("", "t"),
        ("a\nb", "t"),
        ("a b", "t"),
        (&"a".repeat(65)[..], "t"),
        ("acme", ""),
        ("acme", "x\ny"),
    ] {
        let packed: Vec<u8> = redis::cmd("FCALL")
            .arg(function)
            .arg(1)
            .arg(&key)
            .arg(tenant)
            .arg(token)
            .query_async(&mut conn)
            .await
            .expect("FCALL index_tenant");
        let reply = atmost::store::redis::unpack_reply(&packed).expect("a msgpack reply");
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => format!("{other:?}"),
        };
        assert_eq!(
            reply.iter().take(2).map(text).collect::<Vec<_>>(),
            ["ERR", "STORE_UNAVAILABLE"],
            "{tenant:?} {token:?}: {reply:?}"
        );
        assert_eq!(
            tenants_index(&mut conn, &redis.prefix).await,
            [entry(&a1)],
            "{tenant:?} {token:?} changed the tenants index"
        );
    }

    let _: () = redis::cmd("ZADD")
        .arg(&key)
        .arg(0)
        .arg("no-token")
        .query_async(&mut conn)
        .await
        .expect("ZADD");
    store
        .sweep(T0 + 2 * HOUR_MS)
        .await
        .expect("the sweep goes on");
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .expect("ZRANGE");
    assert_eq!(
        members,
        ["no-token"],
        "acme left; the unreadable entry stays"
    );
}

// === approvals ===

/// `permit`, with tool t's calls needing one approval, waiting `wait_ms`.
fn with_rule(
    mut permit: atmost::domain::Permit,
    wait_ms: atmost::domain::Millis,
) -> atmost::domain::Permit {
    permit.approval_per_tool.insert(
        "t".into(),
        atmost::domain::ApprovalRule {
            cost_at_least: None,
            wait_ms,
            approvers: 1,
        },
    );
    permit
}

/// An approver's scope in `tenant`: not limited to any agent.
fn approver_of(tenant: &str) -> atmost::domain::Scope {
    atmost::domain::Scope {
        tenant: tenant.into(),
        agent: None,
        key_id: "ap".into(),
    }
}

fn request_cmd(permit: &atmost::domain::Permit, key: &str) -> atmost::domain::AuthorizeCmd {
    atmost::domain::AuthorizeCmd {
        permit_id: permit.permit_id.clone(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: key.as_bytes().to_vec(),
        cost: 0,
        holder_token: Vec::new(),
        approval_summary: format!("call {key}"),
    }
}

/// Asks for key `key` under the permit at `now`: its call awaits approval.
async fn request(
    store: &atmost::store::redis::RedisStore,
    permit: &atmost::domain::Permit,
    key: &str,
    now: atmost::domain::Millis,
) -> atmost::domain::Attempt {
    use atmost::store::Store as _;
    let r = store
        .authorize(
            &scope_of(&permit.tenant),
            &request_cmd(permit, key),
            now,
            atmost::domain::new_id(now),
        )
        .await
        .expect("authorize");
    assert_eq!(r.decision, atmost::domain::Decision::AwaitApproval, "{r:?}");
    r.attempt
}

/// The members of a sorted set, in order.
async fn zset(conn: &mut impl redis::aio::ConnectionLike, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .expect("ZRANGE")
}

/// A permit with an approval rule keeps its calls awaiting approval in two
/// sets of its own (by deadline, by creation), under its hash tag, that
/// live and expire with its other keys: pinned while an attempt is open
/// (here the claim of an approved call), expiring with the permit
/// otherwise; and each call in its tenant's approvals index (a shard of
/// its own, outside the permit's keys) until it is decided, or until the
/// sweep closes the permit it lapsed with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_sets_share_the_permits_tag_and_expire_with_it() {
    use atmost::domain::{ApproveCmd, AttemptState, CommitCmd, Decision, Outcome};
    use atmost::store::{INDEX_MARGIN_MS, Store as _};
    let _machine = shared().await;
    let redis = Redis::start();
    let store = redis_store(&redis.url, &redis.prefix, std::time::Duration::from_secs(5));
    let mut conn = redis.connect().await;
    let prefix = &redis.prefix;
    let expires_at = T0 + HOUR_MS;
    let p = with_rule(tenant_permit(1, "acme", T0, expires_at), 600_000);
    store.create_permit(p.clone()).await.expect("create");
    let id = &p.permit_id;
    let k = request(&store, &p, "k", T0).await;
    request(&store, &p, "k2", T0 + 1).await;

    let base = format!("{prefix}:{{{id}}}");
    let own = ["permit", "attempts", "pending", "awaiting"].map(|k| format!("{base}:{k}"));
    let index = format!("{prefix}:approvals:{{0}}:t:acme");
    let mut stored: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    stored.sort();
    let mut expected = vec![
        format!("{prefix}:permits:acme"),
        format!("{prefix}:tenants"),
        index.clone(),
    ];
    expected.extend(own.iter().cloned());
    expected.sort();
    assert_eq!(stored, expected, "every key of the permit under its tag");
    assert_eq!(
        zset(&mut conn, &format!("{base}:pending")).await,
        [
            format!("{:015}:k", T0 + 600_000),
            format!("{:015}:k2", T0 + 1 + 600_000)
        ]
    );
    assert_eq!(
        zset(&mut conn, &format!("{base}:awaiting")).await,
        [format!("{T0:015}:k"), format!("{:015}:k2", T0 + 1)]
    );
    assert_eq!(
        zset(&mut conn, &index).await,
        [
            format!("{T0:015}:{id}:k"),
            format!("{:015}:{id}:k2", T0 + 1)
        ]
    );
    // Nothing open: every key expires with the permit.
    for key in &own {
        assert_eq!(
            pexpiretime(&mut conn, key).await,
            expires_at + DAY_MS,
            "{key}"
        );
    }

    // Approved: no longer awaiting, anywhere.
    let approve = ApproveCmd {
        permit_id: id.clone(),
        idempotency_key: "k".into(),
        attempt_id: k.attempt_id.clone(),
    };
    let approved = store
        .approve(&approver_of("acme"), &approve, T0 + 10)
        .await
        .expect("approve");
    assert_eq!(approved.state, AttemptState::Approved);
    assert_eq!(
        zset(&mut conn, &format!("{base}:awaiting")).await,
        [format!("{:015}:k2", T0 + 1)]
    );
    assert_eq!(
        zset(&mut conn, &index).await,
        [format!("{:015}:{id}:k2", T0 + 1)]
    );
    // Claimed: open, so every key of the permit is pinned.
    let claimed = store
        .authorize(
            &scope_of("acme"),
            &request_cmd(&p, "k"),
            T0 + 20,
            atmost::domain::new_id(T0 + 20),
        )
        .await
        .expect("claim");
    assert_eq!(claimed.decision, Decision::Dispatch);
    for key in &own {
        assert_eq!(pexpiretime(&mut conn, key).await, -1, "{key} pinned");
    }
    let commit = CommitCmd {
        permit_id: id.clone(),
        idempotency_key: "k".into(),
        attempt_id: k.attempt_id.clone(),
        outcome: Outcome::Succeeded {
            result: b"ok".to_vec(),
            actual_cost: None,
        },
    };
    store
        .commit(
            &scope_of("acme"),
            &commit,
            T0 + 30,
            atmost::domain::new_id(T0 + 30),
        )
        .await
        .expect("commit");
    for key in &own {
        assert_eq!(
            pexpiretime(&mut conn, key).await,
            expires_at + DAY_MS,
            "{key}"
        );
    }

    // k2 lapsed with the permit's expiry, unwritten: the sweep that closes
    // the permit drops its index entry (the index key goes with it), and
    // leaves the permit's own records to expire with it.
    let now = expires_at + INDEX_MARGIN_MS + 1;
    sweep_all(&store, now).await;
    let exists: bool = redis::cmd("EXISTS")
        .arg(&index)
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    assert!(
        !exists,
        "the approvals index keeps nothing of a closed permit"
    );
    let read = store
        .get_attempt(
            &scope_of("acme"),
            &atmost::domain::GetAttemptCmd {
                permit_id: id.clone(),
                idempotency_key: "k2".into(),
            },
            now,
        )
        .await
        .expect("k2");
    assert_eq!(read.state, AttemptState::Denied);
    assert_eq!(
        read.approval.expect("its approval").denial_reason,
        atmost::domain::APPROVAL_EXPIRED
    );
    let view = store
        .get_permit(&scope_of("acme"), id, now)
        .await
        .expect("get");
    assert_eq!(
        (view.usage[0].calls_made, view.budget_reserved),
        (1, 0),
        "k's slot; k2's returned"
    );
}

/// On a Cluster the approvals index is sharded by slot, as the uncertain
/// index is: ListApprovals across permits merges the shards in
/// (created_at, permit, key) order, each call once, in pages, leaving out
/// what was decided or lapsed, and another tenant's calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_are_listed_across_permits_in_order_on_a_cluster() {
    use atmost::domain::{ApproveCmd, DenyCmd};
    use atmost::store::Store as _;
    let _machine = shared().await;
    let urls = tokio::task::block_in_place(shared_cluster);
    let prefix = format!("a{}", uuid::Uuid::now_v7().simple());
    let store = cluster_store(urls, &prefix, std::time::Duration::from_secs(5));
    let mut requested = Vec::new();
    for n in 0..16 {
        // The first request lapses at T0 + 1 s, the others wait ten minutes.
        let wait = if n == 0 { 1_000 } else { 600_000 };
        let p = with_rule(tenant_permit(200 + n, "acme", T0, T0 + HOUR_MS), wait);
        let p = store.create_permit(p).await.expect("create");
        let a = request(&store, &p, "k", T0 + n as i64).await;
        requested.push((a.created_at, p.permit_id.clone(), a.attempt_id));
    }
    let globex = store
        .create_permit(with_rule(
            tenant_permit(300, "globex", T0, T0 + HOUR_MS),
            600_000,
        ))
        .await
        .expect("create");
    request(&store, &globex, "k", T0).await;
    let slots: std::collections::HashSet<u16> = requested
        .iter()
        .map(|(_, id, _)| crc16::State::<crc16::XMODEM>::calculate(id.as_bytes()) % 16384)
        .collect();
    assert!(slots.len() > 4, "16 permits in {} slots", slots.len());

    let now = T0 + 2_000;
    let (_, approved, approved_id) = &requested[3];
    store
        .approve(
            &approver_of("acme"),
            &ApproveCmd {
                permit_id: approved.clone(),
                idempotency_key: "k".into(),
                attempt_id: approved_id.clone(),
            },
            now,
        )
        .await
        .expect("approve");
    let (_, denied, denied_id) = &requested[7];
    store
        .deny(
            &approver_of("acme"),
            &DenyCmd {
                permit_id: denied.clone(),
                idempotency_key: "k".into(),
                attempt_id: denied_id.clone(),
                reason: "no".into(),
            },
            now,
        )
        .await
        .expect("deny");
    let expected: Vec<(i64, String)> = requested
        .iter()
        .enumerate()
        .filter(|(n, _)| ![0, 3, 7].contains(n))
        .map(|(_, (at, id, _))| (*at, id.clone()))
        .collect();
    let (mut listed, mut after) = (Vec::new(), None);
    loop {
        let page = store
            .list_approvals(&approver_of("acme"), None, after.as_ref(), 5, now)
            .await
            .expect("list");
        assert!(page.attempts.len() <= 5);
        listed.extend(
            page.attempts
                .iter()
                .map(|a| (a.created_at, a.permit_id.clone())),
        );
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(listed, expected, "every waiting call, in order, once");
}
