//! The Redis settings atmost relies on, on real redis-server processes:
//! an evicting `maxmemory-policy` is refused (at start-up, when Redis
//! comes up later, and when it is changed at run time) unless the operator
//! accepts it; a Redis whose CONFIG is disabled is read from INFO; one that
//! tells neither is refused the same way unless the operator vouches for
//! it; with `noeviction` and `maxmemory` reached, writes fail whole and
//! service resumes once memory is freed; the README's ACL is all atmost
//! needs, in both durability modes.

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

/// Managed services disable CONFIG: atmost then reads the policy from INFO
/// memory, and serves on `noeviction` and refuses an evicting one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_config_the_policy_is_read_from_info() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--rename-command", "CONFIG", ""]);
    let process = spawn_atmost(&redis.serve_args());
    let client = process.client().await;
    wait_health(&client, ServingStatus::Serving).await;
    dispatches(&client).await;
    drop(process);
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
}

/// The flag that accepts a policy nobody can read.
const UNKNOWN_FLAG: &str = "--allow-unknown-eviction-policy";

/// `serve_args` of `redis` as the ACL user `user` (password `pw`).
fn serve_as(redis: &Redis, user: &str) -> Vec<String> {
    let url = redis
        .url
        .replacen("redis://", &format!("redis://{user}:pw@"), 1);
    vec![
        "--store".into(),
        "redis".into(),
        "--redis-url".into(),
        url,
        "--redis-prefix".into(),
        redis.prefix.clone(),
    ]
}

/// Creates (or changes) the ACL user `user`, password `pw`: every command
/// and key, less `denied` (e.g. `-info`).
async fn acl_user(redis: &Redis, user: &str, denied: &[&str]) {
    let mut admin = redis.connect().await;
    let mut setuser = redis::cmd("ACL");
    setuser
        .arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg(denied);
    let _: () = setuser.query_async(&mut admin).await.expect("ACL SETUSER");
}

/// A Redis that tells its policy neither in INFO memory nor through
/// CONFIG GET (both not permitted to atmost's user, or both disabled) may
/// be evicting: atmost refuses to start on it, naming the flag that
/// accepts it, and serves with that flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_redis_will_not_tell_is_refused_unless_accepted() {
    let _machine = shared().await;
    // A managed-Redis default: an evicting policy, and a user that may run
    // neither INFO nor CONFIG.
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "volatile-lru"]);
    acl_user(&redis, "blind", &["-info", "-config"]).await;
    let args = serve_as(&redis, "blind");
    let (status, stderr) = run_to_exit(&args);
    assert!(!status.success(), "{status:?}");
    assert!(
        stderr.contains("would not tell its maxmemory-policy")
            && stderr.contains("no permissions to run the 'info' command")
            && stderr.contains(UNKNOWN_FLAG)
            && stderr.contains("+info"),
        "the refusal says why and how to fix it: {stderr}"
    );
    // INFO and CONFIG disabled outright: the same.
    let disabled = Redis::start_owned_with(&[
        "--rename-command",
        "CONFIG",
        "",
        "--rename-command",
        "INFO",
        "",
    ]);
    let (status, stderr) = run_to_exit(&disabled.serve_args());
    assert!(!status.success(), "{status:?}");
    assert!(stderr.contains(UNKNOWN_FLAG), "{stderr}");
    // Accepted by the operator (the flag, or its variable): it serves,
    // health SERVING.
    let mut with_flag = args;
    with_flag.push(UNKNOWN_FLAG.into());
    for process in [
        spawn_atmost(&with_flag),
        spawn_atmost_with_env(
            &disabled.serve_args(),
            &[("ATMOST_ALLOW_UNKNOWN_EVICTION_POLICY", "true")],
        ),
    ] {
        let client = process.client().await;
        wait_health(&client, ServingStatus::Serving).await;
        dispatches(&client).await;
    }
}

/// How many INFO commands Redis refused (`rejected_calls` of
/// `cmdstat_info`): one per policy check of atmost's that met the refusal.
async fn rejected_info_calls(redis: &Redis) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut redis.connect().await)
        .await
        .expect("INFO commandstats");
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_info:"))
        .and_then(|l| l.split(',').find_map(|f| f.strip_prefix("rejected_calls=")))
        .map_or(0, |n| n.trim().parse().expect("a count"))
}

/// A policy that becomes unreadable at run time (atmost's user loses
/// `+info`) stops service as an evicting one does: NOT_SERVING, every
/// request UNAVAILABLE naming the flag, one error in the log, until the
/// user may read it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_turns_unreadable_stops_service_until_readable() {
    let _machine = shared().await;
    let redis = Redis::start_owned();
    acl_user(&redis, "atmost", &["-config"]).await;
    let log = std::env::temp_dir().join(format!(
        "atmost-unknown-policy-{}.jsonl",
        uuid::Uuid::now_v7().simple()
    ));
    let mut args = serve_as(&redis, "atmost");
    args.extend(["--log-format".into(), "json".into()]);
    let process = AtmostProcess::spawn_logged(
        std::path::Path::new(env!("CARGO_BIN_EXE_atmost")),
        &args,
        &[("RUST_LOG", "error")],
        &log,
    )
    .expect("start atmost");
    let client = process.client().await;
    wait_health(&client, ServingStatus::Serving).await;
    let permit = client
        .create_permit(NewPermit::new(["t"]))
        .await
        .expect("create permit")
        .permit_id;

    acl_user(&redis, "atmost", &["-config", "-info"]).await;
    wait_health(&client, ServingStatus::NotServing).await;
    // Three health checks meet the refusal (each is an INFO Redis rejects).
    let (checked, deadline) = (
        rejected_info_calls(&redis).await,
        Instant::now() + Duration::from_secs(30),
    );
    while rejected_info_calls(&redis).await < checked + 3 {
        assert!(Instant::now() < deadline, "no health check ran");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for key in ["k1", "k2", "k3"] {
        let refused = client
            .authorize(pb::AuthorizeRequest {
                permit_id: permit.clone(),
                tool: "t".into(),
                idempotency_key: key.into(),
                request_fingerprint: b"fp".to_vec(),
                cost: 0,
                holder_token: Vec::new(),
                ..Default::default()
            })
            .await;
        let (_, error) = expect_error(refused, Code::Unavailable, "STORE_UNAVAILABLE");
        assert!(error.status().message().contains(UNKNOWN_FLAG), "{error:?}");
    }

    acl_user(&redis, "atmost", &["-config"]).await;
    wait_health(&client, ServingStatus::Serving).await;
    let r = authorize_new_key(&client, permit).await;
    assert_eq!(r.decision(), Decision::Dispatch);
    drop(process);
    let text = std::fs::read_to_string(&log).expect("the log");
    let _ = std::fs::remove_file(&log);
    let refusals = text
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|event| {
            event["level"] == "ERROR"
                && event["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("Redis would not tell"))
        })
        .count();
    assert_eq!(
        refusals, 1,
        "one error for the change, not one per check: {text}"
    );
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

/// The README's ACL lines (the block marked `readme-check: redis-acl`):
/// the first, for every deployment, then those under a comment starting
/// with each of `modes` (e.g. "with --durability replica"), each line split
/// into its words as `redis-cli` would.
fn readme_acl(modes: &[&str]) -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let block: Vec<&str> = readme
        .split_once("<!-- readme-check: redis-acl -->\n```text\n")
        .and_then(|(_, rest)| rest.split_once("\n```").map(|(block, _)| block))
        .expect("README.md has a block marked readme-check: redis-acl")
        .lines()
        .collect();
    let mut sections: Vec<(&str, Vec<Vec<String>>)> = Vec::new();
    for line in block {
        match line.strip_prefix("# ") {
            Some(comment) => sections.push((comment, Vec::new())),
            None => {
                assert!(!line.contains(['"', '\'']), "no quoting: {line}");
                let (_, lines) = sections.last_mut().expect("a comment first");
                lines.push(line.split_whitespace().map(String::from).collect());
            }
        }
    }
    let mut wanted = vec![sections[0].1.clone()];
    for mode in modes {
        let (_, lines) = sections
            .iter()
            .find(|(comment, _)| comment.starts_with(mode))
            .unwrap_or_else(|| panic!("the README's ACL has no lines {mode:?}"));
        wanted.push(lines.clone());
    }
    wanted.concat()
}

/// Runs the README's ACL (see [`readme_acl`]) on `admin`, as written: the
/// user `atmost`, password `PASSWORD`, the default prefix.
async fn create_readme_user(admin: &mut redis::aio::MultiplexedConnection, modes: &[&str]) {
    for line in readme_acl(modes) {
        let mut cmd = redis::cmd(&line[0]);
        cmd.arg(&line[1..]);
        let _: () = cmd
            .query_async(admin)
            .await
            .unwrap_or_else(|e| panic!("{line:?}: {e}"));
    }
}

/// The Redis link over TLS (rustls, with the CA given by
/// --redis-tls-ca) as the README's ACL user: the whole cycle works; a
/// wrong password is NOT_SERVING and UNAVAILABLE.
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
    create_readme_user(&mut admin, &[]).await;

    let serve = |password: &str| {
        spawn_atmost(&[
            "--store",
            "redis",
            "--redis-url",
            &format!("rediss://atmost:{password}@localhost:{tls_port}"),
            "--redis-tls-ca",
            &ca,
        ])
    };
    let process = serve("PASSWORD");
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
        ..Default::default()
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
        .arg("PASSWORD")
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
        &format!("rediss://atmost:PASSWORD@localhost:{tls_port}"),
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

/// The README's ACL, its lines run as written, is all atmost needs in each
/// durability mode (`replica`: with its line, and a replica): a whole cycle
/// through the binary (create, dispatch, commit, replay, mark uncertain,
/// list, get, resolve, revoke), the census (it counts the uncertain
/// attempt) and the sweep (a store as that user, at a time past the
/// permit's expiry, closes it), health SERVING throughout, and nothing in
/// the log at error level or refused for permission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_acl_is_all_atmost_needs_in_each_durability_mode() {
    use atmost::store::Store;
    use atmost::store::redis::{Durability, RedisConfig, RedisStore, Time};
    use atmost_testkit::RedisServer;
    let _machine = shared().await;
    for (durability, modes) in [
        ("none", &[][..]),
        ("replica", &["with --durability replica"]),
    ] {
        let primary = RedisServer::start().expect("primary");
        let replica = (durability == "replica").then(|| {
            let of = primary.port().to_string();
            let replica = RedisServer::start_on(|_| {
                vec!["--replicaof".into(), "127.0.0.1".into(), of.clone()]
            })
            .expect("replica");
            atmost_testkit::topology::wait_replicas_online(primary.port(), 1).expect("in sync");
            replica
        });
        let mut admin = redis::Client::open(primary.url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect as the default user");
        create_readme_user(&mut admin, modes).await;
        let url = format!("redis://atmost:PASSWORD@127.0.0.1:{}", primary.port());
        let log = std::env::temp_dir().join(format!(
            "atmost-readme-acl-{durability}-{}.jsonl",
            uuid::Uuid::now_v7().simple()
        ));
        let process = AtmostProcess::spawn_logged(
            std::path::Path::new(env!("CARGO_BIN_EXE_atmost")),
            &[
                "--store",
                "redis",
                "--redis-url",
                &url,
                "--durability",
                durability,
                "--metrics-listen",
                "127.0.0.1:0",
                "--uncertain-census-interval",
                "1s",
                "--log-format",
                "json",
            ],
            // The sweep's failures are logged at debug.
            &[("RUST_LOG", "atmost=debug")],
            &log,
        )
        .expect("start atmost");
        let client = process.client().await;
        wait_health(&client, ServingStatus::Serving).await;

        let expires_at = atmost_client::now_ms() + 60_000;
        let permit = client
            .create_permit(NewPermit::new(["t"]).expires_at_ms(expires_at).build())
            .await
            .expect("create")
            .permit_id;
        let request = |key: &str| pb::AuthorizeRequest {
            permit_id: permit.clone(),
            tool: "t".into(),
            idempotency_key: key.into(),
            request_fingerprint: b"fp".to_vec(),
            cost: 0,
            holder_token: Vec::new(),
            ..Default::default()
        };
        let a = client.authorize(request("k1")).await.expect("authorize");
        assert_eq!(a.decision(), Decision::Dispatch, "{durability}");
        let a = a.attempt.expect("an attempt");
        client
            .commit(pb::CommitRequest {
                permit_id: permit.clone(),
                idempotency_key: "k1".into(),
                attempt_id: a.attempt_id,
                outcome: Some(succeeded(b"ok", None)),
            })
            .await
            .expect("commit");
        let replay = client.authorize(request("k1")).await.expect("replay");
        assert_eq!(replay.decision(), Decision::Replay, "{durability}");
        let b = client
            .authorize(request("k2"))
            .await
            .expect("authorize k2")
            .attempt
            .expect("an attempt");
        client
            .mark_uncertain(pb::MarkUncertainRequest {
                permit_id: permit.clone(),
                idempotency_key: "k2".into(),
                attempt_id: b.attempt_id.clone(),
                reason: "lost".into(),
            })
            .await
            .expect("mark uncertain");
        let listed = client.list_all_uncertain("", 10).await.expect("list");
        assert_eq!(listed.len(), 1, "{durability}: {listed:?}");
        // The census, as this user, counts it.
        let metrics = process.metrics_addr().expect("metrics");
        let deadline = Instant::now() + Duration::from_secs(30);
        while crate::telemetry::scrape(metrics)
            .await
            .get("atmost_uncertain_attempts")
            != Some(&1.0)
        {
            assert!(
                Instant::now() < deadline,
                "{durability}: the census never counted it"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let got = client
            .get_attempt(&permit, "k2")
            .await
            .expect("get attempt");
        assert_eq!(
            got.attempt.expect("the attempt").state(),
            pb::AttemptState::Uncertain,
            "{durability}"
        );
        client
            .resolve(pb::ResolveRequest {
                permit_id: permit.clone(),
                idempotency_key: "k2".into(),
                attempt_id: b.attempt_id,
                outcome: Some(resolved_succeeded(b"ok", None)),
            })
            .await
            .expect("resolve");
        let view = client.get_permit(&permit).await.expect("get permit");
        assert_eq!(view.usage[0].calls_made, 2, "{durability}");
        client.revoke_permit(&permit).await.expect("revoke");

        // The sweep, as this user, at a time past the permit's expiry.
        let store = RedisStore::connect(&RedisConfig {
            url: url.clone(),
            durability: match durability {
                "none" => Durability::None,
                _ => Durability::Replica,
            },
            time: Time::Caller,
            ..RedisConfig::new("", "atmost")
        })
        .expect("store");
        let later = expires_at + 2 * atmost::store::INDEX_MARGIN_MS;
        assert_eq!(
            store
                .sweep(later)
                .await
                .expect("the sweep, as the README's user"),
            1,
            "{durability}: the revoked permit leaves the index"
        );
        wait_health(&client, ServingStatus::Serving).await;
        // The write that follows each durable script leaves nothing behind.
        let left: Vec<String> = redis::cmd("KEYS")
            .arg("atmost:sync:*")
            .query_async(&mut admin)
            .await
            .expect("KEYS");
        assert!(left.is_empty(), "{durability}: {left:?}");

        drop(process);
        drop(replica);
        let text = std::fs::read_to_string(&log).expect("the log");
        let _ = std::fs::remove_file(&log);
        for line in text.lines() {
            assert!(
                !line.to_ascii_lowercase().contains("noperm")
                    && !line.contains("no permissions")
                    && !line.contains("\"level\":\"ERROR\""),
                "{durability}: {line}"
            );
        }
    }
}
