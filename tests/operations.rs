//! What operators and orchestrators rely on: gRPC health and reflection,
//! failing closed while Redis is unreachable, script reloads after a Redis
//! restart, a clean exit on SIGTERM, and no transparent huge pages.

use crate::support::*;
use pb::Decision;
use std::time::{Duration, Instant};
use tonic::Code;

async fn redis_harness() -> Harness {
    let redis = Redis::start_owned();
    let store = atmost::store::Backend::Redis(redis_store(
        &redis.url,
        &redis.prefix,
        Duration::from_secs(2),
    ));
    Harness::serve(store, Some(redis), |app| {
        app.with_health_interval(Duration::from_millis(50))
            .with_store_timeout(Duration::from_millis(500))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_serving_for_every_service() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Memory).await;
    for service in ["", "atmost.v1.Gate", "atmost.v1.Permits"] {
        assert_eq!(
            health(&h.client, service).await.expect("health check"),
            ServingStatus::Serving,
            "{service:?}"
        );
    }
}

/// The service names a reflection client of version `$v` (`v1`, `v1alpha`)
/// lists on `$channel`.
macro_rules! reflected_services {
    ($v:ident, $channel:expr) => {{
        use tonic_reflection::pb::$v::{
            ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
            server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
        };
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut responses = ServerReflectionClient::new($channel)
            .server_reflection_info(tokio_stream::once(request))
            .await
            .expect("reflection")
            .into_inner();
        let response = responses
            .message()
            .await
            .expect("message")
            .expect("one response");
        let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
            panic!("unexpected {response:?}");
        };
        list.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
    }};
}

/// Reflection answers in both versions: v1, and v1alpha for the clients
/// that speak only it (grpcurl before 1.8.8, grpcio's reflection client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Memory).await;
    let listed = [
        reflected_services!(v1, h.client.channel()),
        reflected_services!(v1alpha, h.client.channel()),
    ];
    for names in listed {
        for want in [
            "atmost.v1.Gate",
            "atmost.v1.Permits",
            "atmost.v1.Receipts",
            "grpc.health.v1.Health",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_and_recovers() {
    let _machine = shared().await;
    let mut h = redis_harness().await;
    let permit = h.create_with(&["t"], &[("t", 3)], None).await;
    h.dispatch(&permit, "t", "before", b"fp", 0).await;
    wait_health(&h.client, ServingStatus::Serving).await;

    h.redis.as_mut().expect("redis").kill();
    // Every RPC answers UNAVAILABLE / STORE_UNAVAILABLE, never a decision.
    for key in ["k1", "k2", "before"] {
        let started = Instant::now();
        let (_, status) = expect_error(
            h.authorize(&permit, "t", key, b"fp", 0).await,
            Code::Unavailable,
            "STORE_UNAVAILABLE",
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{status:?} took {:?}",
            started.elapsed()
        );
    }
    expect_error(h.get(&permit).await, Code::Unavailable, "STORE_UNAVAILABLE");
    expect_error(
        h.list("", 10, "").await,
        Code::Unavailable,
        "STORE_UNAVAILABLE",
    );
    wait_health(&h.client, ServingStatus::NotServing).await;

    // A fresh Redis (empty: no permit, no scripts) on the same port.
    h.redis.as_mut().expect("redis").restart();
    wait_health(&h.client, ServingStatus::Serving).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match h.authorize(&permit, "t", "k1", b"fp", 0).await {
            Err(s) if s.code() == Code::NotFound => break,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("after the restart: {other:?}"),
        }
    }
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "after", b"fp", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_script_cache_never_reaches_a_client() {
    let _machine = shared().await;
    let h = redis_harness().await;
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "k1", b"1", 0).await;
    let mut conn = h.redis.as_ref().expect("redis").connect().await;
    flush_scripts(&mut conn).await;
    let a = h.dispatch(&permit, "t", "k2", b"2", 0).await;
    flush_scripts(&mut conn).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    flush_scripts(&mut conn).await;
    let replay = h
        .authorize(&permit, "t", "k2", b"2", 0)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero() {
    let _machine = shared().await;
    let mut process = spawn_atmost::<&str>(&[]);
    let client = process.client().await;
    assert_eq!(
        health(&client, "").await.expect("health"),
        ServingStatus::Serving
    );
    let r = client
        .authorize(pb::AuthorizeRequest {
            permit_id: uuid::Uuid::now_v7().to_string(),
            tool: "t".into(),
            idempotency_key: "k".into(),
            request_fingerprint: b"fp".to_vec(),
            cost: 0,
            holder_token: Vec::new(),
        })
        .await;
    expect_error(r, Code::NotFound, "PERMIT_NOT_FOUND");
    let status = process
        .terminate(Duration::from_secs(10))
        .expect("exited within 10 s");
    assert!(status.success(), "{status:?}");
}

/// Sends SIGTERM to the process and returns at once.
fn sigterm(process: &AtmostProcess) {
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &process.pid().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(sent.success(), "kill -TERM: {sent:?}");
}

/// Polls the process's exit for at most `within`.
async fn exited(process: &mut AtmostProcess, within: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = process.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A rollout's drain (docs/deploy.md, "Rollouts"): on SIGTERM health turns
/// NOT_SERVING at once, and for `--drain-delay` atmost still accepts new
/// connections and serves them, so load balancers and readiness probes
/// see NOT_SERVING before the replica stops answering; then it refuses new
/// connections, drains within `--shutdown-grace` (an open Health/Watch
/// holds it that long) and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_serves_not_serving_for_the_drain_delay_then_drains() {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let _machine = shared().await;
    let delay = Duration::from_secs(3);
    let grace = Duration::from_secs(2);
    let mut process = spawn_atmost(&["--drain-delay", "3s", "--shutdown-grace", "2s"]);
    let addr = process.addr();
    let client = process.client().await;
    let mut watch = HealthClient::new(client.channel())
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("watch")
        .into_inner();
    let first = watch.message().await.expect("watch").expect("a status");
    assert_eq!(first.status(), ServingStatus::Serving);

    sigterm(&process);
    let signalled = Instant::now();
    let turned = tokio::time::timeout(Duration::from_secs(1), watch.message())
        .await
        .expect("NOT_SERVING within a second of SIGTERM")
        .expect("watch")
        .expect("a status");
    assert_eq!(turned.status(), ServingStatus::NotServing);

    // Within the delay: a new connection is accepted and served.
    let fresh = Client::connect(format!("http://{addr}"))
        .await
        .expect("a new connection during the drain delay");
    assert_eq!(
        health(&fresh, "").await.expect("health"),
        ServingStatus::NotServing
    );
    let permit = fresh
        .create_permit(
            NewPermit::new(["t"])
                .subject("drain")
                .currency("EUR")
                .build(),
        )
        .await
        .expect("CreatePermit during the drain delay")
        .permit_id;
    let answer = authorize_new_key(&fresh, permit).await;
    assert_eq!(answer.decision(), Decision::Dispatch);
    assert!(
        signalled.elapsed() < delay,
        "the checks took {:?}, past the drain delay: they prove nothing",
        signalled.elapsed()
    );

    // Past the delay: no new connection, while the open watch keeps the
    // process draining.
    tokio::time::sleep((delay + Duration::from_millis(500)).saturating_sub(signalled.elapsed()))
        .await;
    assert!(process.try_wait().is_none(), "exited before the grace");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "a new connection was accepted after the drain delay"
    );
    let status = exited(&mut process, delay + grace + Duration::from_secs(3))
        .await
        .expect("exited");
    assert!(status.success(), "{status:?}");
    let took = signalled.elapsed();
    assert!(
        took >= delay && took < delay + grace + Duration::from_secs(2),
        "exited {took:?} after SIGTERM (drain delay {delay:?}, grace {grace:?})"
    );
}

/// A second SIGTERM (or Ctrl-C) during the drain delay cuts it short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_cuts_the_drain_delay_short() {
    let _machine = shared().await;
    let mut process = spawn_atmost(&["--drain-delay", "1h"]);
    let client = process.client().await;
    assert_eq!(
        health(&client, "").await.expect("health"),
        ServingStatus::Serving
    );
    sigterm(&process);
    wait_health(&client, ServingStatus::NotServing).await;
    assert!(
        process.try_wait().is_none(),
        "exited within the drain delay"
    );
    sigterm(&process);
    let status = exited(&mut process, Duration::from_secs(10))
        .await
        .expect("exited within 10 s of the second SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// The server turns transparent huge pages off for itself, whatever the
/// machine's THP mode: the first touch of one stalled a worker for about
/// 5 ms on the benchmark machine (docs/performance.md, "Huge pages").
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_runs_without_transparent_huge_pages() {
    let _machine = shared().await;
    let process = spawn_atmost::<&str>(&[]);
    let client = process.client().await;
    assert_eq!(
        health(&client, "").await.expect("health"),
        ServingStatus::Serving
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", process.pid()))
        .expect("the server's /proc status");
    let thp = status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .expect("a kernel that reports THP_enabled (Linux 5.0 or later)");
    assert_eq!(thp.trim(), "0", "THP_enabled in /proc/<pid>/status");
}

/// Every duration flag is bounded where it is parsed: out of range, atmost
/// refuses to start and says what the range is (a retention of centuries
/// once overflowed the Redis store's expiry arithmetic). At the bound, it
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_out_of_range_refuse_to_start() {
    let _machine = shared().await;
    for (flag, value) in [
        ("--retention", "11y"),
        ("--retention", "300000000y"),
        ("--store-timeout", "0s"),
        ("--store-timeout", "2m"),
        ("--shutdown-grace", "2h"),
        ("--drain-delay", "2h"),
        ("--keepalive-interval", "0s"),
        ("--keepalive-timeout", "3h"),
        ("--idle-timeout", "25h"),
        ("--max-connection-age", "0s"),
        ("--max-connection-age-grace", "2h"),
        ("--handshake-timeout", "50ms"),
        ("--request-timeout", "2h"),
    ] {
        let (status, stderr) = run_to_exit(&[flag, value]);
        assert!(!status.success(), "{flag} {value} started");
        assert!(stderr.contains("out of range"), "{flag} {value}: {stderr}");
    }
    // Numbers too: a message limit below the largest valid request, no
    // connections, no streams.
    for (flag, value) in [
        ("--max-request-bytes", "1000"),
        ("--max-response-bytes", "1000"),
        ("--max-connections", "0"),
        ("--max-concurrent-streams", "0"),
        ("--max-header-list-bytes", "100"),
        ("--h2-max-pending-resets", "0"),
        ("--h2-max-local-resets", "0"),
    ] {
        let (status, stderr) = run_to_exit(&[flag, value]);
        assert!(!status.success(), "{flag} {value} started");
        assert!(stderr.contains("is not in"), "{flag} {value}: {stderr}");
    }
    let process = spawn_atmost(&["--retention", "10y", "--shutdown-grace", "1h"]);
    let client = process.client().await;
    assert_eq!(
        health(&client, "").await.expect("health"),
        ServingStatus::Serving
    );
}

/// Every flag of `atmost serve` has a row in the README's configuration
/// table that names its environment variable and its default.
#[test]
fn every_flag_is_in_the_readme_with_its_env_and_default() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args(["serve", "--help"])
        .output()
        .expect("atmost serve --help");
    let help = String::from_utf8(help.stdout).expect("utf-8 help");
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let rows: Vec<&str> = readme.lines().filter(|l| l.starts_with("| `--")).collect();
    let mut flags = 0;
    // Each option's block: "      --flag <VALUE>" up to the next one.
    for block in help.split("\n      --").skip(1) {
        let flag = format!("--{}", block.split([' ', '\n']).next().expect("a name"));
        if flag == "--help" {
            continue;
        }
        flags += 1;
        let field = |label: &str| {
            block
                .lines()
                .find_map(|l| l.trim().strip_prefix(label))
                .map(|v| v.trim_end_matches(']').trim_end_matches('=').to_owned())
        };
        let row = rows
            .iter()
            .find(|r| {
                // The flag's own row: named in the first cell.
                r.split(" | ")
                    .next()
                    .is_some_and(|c| c.contains(&format!("`{flag}`")))
            })
            .unwrap_or_else(|| panic!("{flag} has no row in the README's configuration table"));
        let env = field("[env: ").unwrap_or_else(|| panic!("{flag} reads no env variable"));
        assert!(
            row.contains(&format!("`{env}`")),
            "{flag}: {env} not in {row}"
        );
        if let Some(default) = field("[default: ") {
            assert!(
                row.contains(&format!("`{default}`")),
                "{flag}: default {default} not in {row}"
            );
        }
    }
    assert!(flags >= 30, "read {flags} flags from --help");
}
