//! The Redis settings atmost relies on, on real redis-server processes:
//! an evicting `maxmemory-policy` is refused (at start-up, when Redis
//! comes up later, and when it is changed at run time) unless the operator
//! accepts it; a Redis whose CONFIG is disabled is served with a warning;
//! with `noeviction` and `maxmemory` reached, writes fail whole and service
//! resumes once memory is freed.

use crate::support::*;
use atmost::store::Backend;
use pb::Decision;
use std::time::{Duration, Instant};
use tonic::Code;

/// Calls `call` until atmost refuses it because Redis's `maxmemory-policy`
/// is `policy` (within 15 s); every answer until then must be
/// UNAVAILABLE too (Redis still coming up), never a decision.
async fn refused_for_eviction<T, F, Fut>(policy: &str, mut call: F)
where
    T: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, error) = expect_error(call().await, Code::Unavailable, "STORE_UNAVAILABLE");
        let why = format!("maxmemory-policy is {policy}");
        if error.status().message().contains(&why) {
            return;
        }
        assert!(Instant::now() < deadline, "never refused: {error:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn dispatches(client: &Client) {
    let permit = client
        .create_permit(NewPermit::new(["t"]))
        .await
        .expect("create permit")
        .permit_id;
    let r = authorize_new_key(client, permit).await;
    assert_eq!(r.decision(), Decision::Dispatch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_refused_at_start_up_unless_allowed() {
    let _machine = shared().await;
    for policy in ["volatile-lru", "allkeys-lru", "volatile-ttl"] {
        let redis = Redis::start_owned_with(&["--maxmemory-policy", policy]);
        let (status, stderr) = run_to_exit(&redis.serve_args());
        assert!(!status.success(), "{policy}: {status:?}");
        assert!(
            stderr.contains(&format!("maxmemory-policy is {policy}"))
                && stderr.contains("--allow-eviction"),
            "{policy}: the refusal says why and how to fix it: {stderr}"
        );
    }
    // Accepted by the operator: it serves.
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "allkeys-lru"]);
    let mut args = redis.serve_args();
    args.push("--allow-eviction".into());
    let process = spawn_atmost(&args);
    dispatches(&process.client().await).await;
}

/// A Redis that is down when atmost starts is checked before anything is
/// served on it: if it comes up evicting, every request is UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_comes_up_evicting_is_never_served() {
    let _machine = shared().await;
    let mut redis = Redis::start_owned_with(&["--maxmemory-policy", "allkeys-lru"]);
    redis.kill();
    let process = spawn_atmost(&redis.serve_args());
    let client = process.client().await.with_timeout(Duration::from_secs(10));
    redis.restart();
    refused_for_eviction("allkeys-lru", || {
        client.create_permit(NewPermit::new(["t"]))
    })
    .await;
    wait_health(&client, ServingStatus::NotServing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_changed_at_run_time_stops_service_until_restored() {
    let _machine = shared().await;
    let redis = Redis::start_owned();
    let store = redis_store(&redis.url, &redis.prefix, Duration::from_secs(2));
    let h = Harness::serve(Backend::Redis(store), Some(redis), |app| {
        app.with_health_interval(Duration::from_millis(50))
    })
    .await;
    let mut conn = h.redis.as_ref().expect("redis").connect().await;
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "before", b"1", 0).await;
    let config_set = |policy: &'static str| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .clone()
    };
    let _: () = config_set("volatile-lru")
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
    wait_health(&h.client, ServingStatus::NotServing).await;
    let (_, error) = expect_error(
        h.authorize(&permit, "t", "during", b"2", 0).await,
        Code::Unavailable,
        "STORE_UNAVAILABLE",
    );
    assert!(
        error
            .status()
            .message()
            .contains("maxmemory-policy is volatile-lru")
    );
    let _: () = config_set("noeviction")
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
    wait_health(&h.client, ServingStatus::Serving).await;
    h.dispatch(&permit, "t", "after", b"3", 0).await;
    assert_eq!(h.get(&permit).await.expect("get").usage[0].calls_made, 2);
}

/// A Redis that comes back from a restart (or a failover) evicting is read
/// again before the first operation runs on it, not only at the next health
/// check: no request is ever served on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_evicting_is_refused_before_any_operation() {
    let _machine = shared().await;
    let redis = Redis::start_owned();
    let store = redis_store(&redis.url, &redis.prefix, Duration::from_secs(2));
    // No health check in the way: only the operations can notice.
    let mut h = Harness::serve(Backend::Redis(store), Some(redis), |app| {
        app.with_health_interval(Duration::from_secs(3600))
    })
    .await;
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "before", b"1", 0).await;
    h.redis
        .as_mut()
        .expect("redis")
        .restart_with(&["--maxmemory-policy", "allkeys-lru"]);
    let (h, mut i) = (&h, 0);
    refused_for_eviction("allkeys-lru", || {
        i += 1;
        let (key, permit) = (format!("after-{i}"), permit.clone());
        async move { h.authorize(&permit, "t", &key, b"2", 0).await }
    })
    .await;
}

/// Managed services disable CONFIG (atmost then reads the policy from INFO
/// memory); where INFO is disabled too, the policy cannot be read, and
/// atmost serves (with a loud warning in its log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_config_it_serves_with_a_warning() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--rename-command", "CONFIG", ""]);
    let process = spawn_atmost(&redis.serve_args());
    let client = process.client().await;
    wait_health(&client, ServingStatus::Serving).await;
    dispatches(&client).await;
    drop(process);
    // CONFIG off, and an evicting policy: INFO still tells it, and atmost
    // refuses.
    let evicting = Redis::start_owned_with(&[
        "--rename-command",
        "CONFIG",
        "",
        "--maxmemory-policy",
        "allkeys-lru",
    ]);
    let (status, stderr) = run_to_exit(&evicting.serve_args());
    assert!(!status.success());
    assert!(
        stderr.contains("maxmemory-policy is allkeys-lru"),
        "{stderr}"
    );
    let redis = Redis::start_owned_with(&[
        "--rename-command",
        "CONFIG",
        "",
        "--rename-command",
        "INFO",
        "",
    ]);
    let process = spawn_atmost(&redis.serve_args());
    let client = process.client().await;
    wait_health(&client, ServingStatus::Serving).await;
    dispatches(&client).await;
}

/// With `noeviction` and `maxmemory` reached, every write answers
/// UNAVAILABLE and changes nothing (a script is refused at its first write,
/// and atmost's scripts check everything before it); reads go on; once
/// memory is freed, service resumes where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maxmemory_reached_refuses_writes_whole_and_resumes() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "noeviction"]);
    let store = redis_store(&redis.url, &redis.prefix, Duration::from_secs(2));
    let h = Harness::serve(Backend::Redis(store), Some(redis), |app| app).await;
    let redis = h.redis.as_ref().expect("redis");
    let mut conn = redis.connect().await;
    let permit = h.create_with(&["t"], &[("t", 5)], Some(100)).await;
    let before = h.dispatch(&permit, "t", "before", b"1", 10).await;

    // 2 MiB of keys of the test's own, then a maxmemory 1 MiB below what
    // Redis uses: over the limit by far more than a client buffer moves
    // (filling up to the limit alone leaves Redis a few bytes under it once
    // the refused command's buffer is freed).
    let filler = vec![b'x'; 64 * 1024];
    for i in 0..32 {
        let _: () = redis::cmd("SET")
            .arg(format!("{}:filler:{i}", redis.prefix))
            .arg(&filler)
            .query_async(&mut conn)
            .await
            .expect("SET filler");
    }
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(&mut conn)
        .await
        .expect("INFO");
    let used: i64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used - 1024 * 1024)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET maxmemory");

    for (what, refused) in [
        (
            "Authorize",
            h.authorize(&permit, "t", "during", b"2", 10)
                .await
                .map(drop),
        ),
        (
            "Commit",
            h.commit(&before, succeeded(b"ok", None)).await.map(drop),
        ),
        ("CreatePermit", h.create_with_result(&["t"]).await.map(drop)),
    ] {
        let (_, error) = expect_error(refused, Code::Unavailable, "STORE_UNAVAILABLE");
        assert!(
            error.status().message().contains("OOM"),
            "{what}: {error:?}"
        );
    }
    // Nothing was half-applied, and reads still answer.
    let view = h.get(&permit).await.expect("reads go on");
    assert_eq!(view.usage[0].calls_made, 1);
    assert_eq!((view.budget_committed, view.budget_reserved), (0, 10));
    let attempts = format!("{}:{{{permit}}}:attempts", redis.prefix);
    let during: bool = redis::cmd("HEXISTS")
        .arg(&attempts)
        .arg("during")
        .query_async(&mut conn)
        .await
        .expect("HEXISTS");
    assert!(!during, "a refused Authorize left an attempt");

    // Memory freed: service resumes where it was.
    for i in 0..32 {
        let _: i64 = redis::cmd("DEL")
            .arg(format!("{}:filler:{i}", redis.prefix))
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
    h.commit(&before, succeeded(b"ok", None))
        .await
        .expect("commit after memory was freed");
    h.dispatch(&permit, "t", "during", b"2", 10).await;
    let view = h.get(&permit).await.expect("get");
    assert_eq!(view.usage[0].calls_made, 2);
    assert_eq!((view.budget_committed, view.budget_reserved), (10, 10));
}

/// The ACL atmost needs, as the README gives it: its key prefix,
/// the commands its scripts and checks run, nothing else.
pub fn atmost_acl(user: &str, password: &str, prefix: &str) -> Vec<String> {
    let mut acl = vec![
        "ACL",
        "SETUSER",
        user,
        "on",
        "resetkeys",
        "resetchannels",
        "-@all",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    acl.push(format!(">{password}"));
    acl.push(format!("~{prefix}:*"));
    for command in [
        // Outside scripts: scripts, the indexes, the checks.
        "+evalsha",
        "+script|load",
        "+zadd",
        "+zrangebylex",
        "+zlexcount",
        "+zscore",
        "+zrem",
        "+sadd",
        "+smembers",
        "+ping",
        "+info",
        "+config|get",
        // Inside the scripts.
        "+hget",
        "+hmget",
        "+hset",
        "+hdel",
        "+hlen",
        "+zcard",
        "+del",
        "+hgetall",
        "+exists",
        "+persist",
        "+pexpireat",
        "+time",
    ] {
        acl.push(command.to_owned());
    }
    acl
}

/// The Redis link over TLS (rustls, with the CA given by
/// --redis-tls-ca) as an ACL user with only what atmost needs: the whole
/// cycle works; a wrong password is NOT_SERVING and UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_redis_as_an_acl_user_with_only_what_atmost_needs() {
    let _machine = shared().await;
    let pki = Pki::new();
    let (cert, key) = pki.issue(&["localhost"]);
    let dir = std::env::temp_dir().join(format!("atmost-redis-tls-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8").to_owned()
    };
    let (cert, key, ca) = (
        file("redis.pem", &cert),
        file("redis.key", &key),
        file("ca.pem", &pki.ca_pem),
    );
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    let redis = Redis::start_owned_with(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ]);
    let mut admin = redis.connect().await;
    let _: () = redis::cmd("ACL")
        .arg(&atmost_acl("atmost", "s3cret", &redis.prefix)[1..])
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");

    let serve = |password: &str| {
        spawn_atmost(&[
            "--store",
            "redis",
            "--redis-url",
            &format!("rediss://atmost:{password}@localhost:{tls_port}"),
            "--redis-tls-ca",
            &ca,
            "--redis-prefix",
            &redis.prefix,
        ])
    };
    let process = serve("s3cret");
    let client = process.client().await;
    dispatches(&client).await;
    let permit = client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("create over TLS")
        .permit_id;
    let request = pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "t".into(),
        idempotency_key: "k".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 0,
        holder_token: Vec::new(),
    };
    let a = client
        .authorize(request.clone())
        .await
        .expect("authorize")
        .attempt
        .expect("a");
    client
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit.clone(),
            idempotency_key: "k".into(),
            attempt_id: a.attempt_id,
            reason: "lost".into(),
        })
        .await
        .expect("mark");
    assert_eq!(
        client.list_all_uncertain("", 10).await.expect("list").len(),
        1
    );
    client
        .resolve(pb::ResolveRequest {
            permit_id: permit.clone(),
            idempotency_key: "k".into(),
            attempt_id: String::new(),
            outcome: Some(resolved_succeeded(b"ok", None)),
        })
        .await
        .expect("resolve");
    let replay = client.authorize(request).await.expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    client.revoke_permit(&permit).await.expect("revoke");
    // The user can read nothing outside its prefix.
    let outside: redis::RedisResult<()> = redis::cmd("AUTH")
        .arg("atmost")
        .arg("s3cret")
        .query_async(&mut admin)
        .await;
    outside.expect("auth as atmost");
    let denied: redis::RedisResult<Option<String>> = redis::cmd("GET")
        .arg("elsewhere")
        .query_async(&mut admin)
        .await;
    assert!(denied.is_err(), "{denied:?}");

    let wrong = serve("wrong");
    let client = wrong.client().await;
    let r = client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await;
    expect_error(r, Code::Unavailable, "STORE_UNAVAILABLE");
    // Without the CA, Redis's certificate is not trusted: nothing served.
    let untrusted = spawn_atmost(&[
        "--store",
        "redis",
        "--redis-url",
        &format!("rediss://atmost:s3cret@localhost:{tls_port}"),
        "--redis-prefix",
        &redis.prefix,
    ]);
    let r = untrusted
        .client()
        .await
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await;
    expect_error(r, Code::Unavailable, "STORE_UNAVAILABLE");
    let _ = std::fs::remove_dir_all(&dir);
}
