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
            "envoy.service.auth.v3.Authorization",
            "envoy.service.ext_proc.v3.ExternalProcessor",
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
async fn flushed_functions_never_reach_a_client() {
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
            ..Default::default()
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

/// A `--config` file sets what no flag or variable sets, and loses to
/// both: flag > ATMOST_* variable > file > default, seen through the
/// server's answers (the permit-lifetime quota). A bad file, or settings
/// that contradict each other wherever they come from, stop it with exit 2
/// and the setting's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_ranks_below_flags_and_variables() {
    let _machine = shared().await;
    let dir = std::env::temp_dir().join(format!("atmost-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("atmost.toml");
    let file_arg = file.to_str().expect("utf-8 path");
    std::fs::write(
        &file,
        "max-permit-lifetime = \"2m\"\nlog-format = \"json\"\n",
    )
    .expect("write");
    // A permit of five minutes: refused under the file's 2m, accepted under
    // a variable's 1h, refused again under a flag's 2m.
    let five_minutes = |now: i64| NewPermit::new(["t"]).expires_at_ms(now + 5 * 60_000);
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64
    };
    for (args, env, accepted) in [
        (vec!["--config", file_arg], vec![], false),
        (
            vec!["--config", file_arg],
            vec![("ATMOST_MAX_PERMIT_LIFETIME", "1h")],
            true,
        ),
        (
            vec!["--config", file_arg, "--max-permit-lifetime", "2m"],
            vec![("ATMOST_MAX_PERMIT_LIFETIME", "1h")],
            false,
        ),
        (vec![], vec![("ATMOST_CONFIG", file_arg)], false),
        (vec![], vec![], true),
    ] {
        let process = spawn_atmost_with_env(&args, &env);
        let answer = process
            .client()
            .await
            .create_permit(five_minutes(now()))
            .await;
        match (accepted, answer) {
            (true, Ok(_)) => {}
            (false, Err(e)) => assert_eq!(
                e.reason_name(),
                Some("QUOTA_PERMIT_LIFETIME"),
                "{args:?} {env:?}: {e:?}"
            ),
            (accepted, answer) => panic!("{args:?} {env:?}: accepted {accepted}, got {answer:?}"),
        }
    }
    for (text, says) in [
        (
            "store_timeout = \"1s\"",
            "store_timeout: no such setting (did you mean \"store-timeout\"?)",
        ),
        (
            "store-timeout = \"2m\"",
            "store-timeout: invalid value '2m'",
        ),
        (
            "max-open-attempts = -1",
            "max-open-attempts: invalid value '-1'",
        ),
        (
            "allow-eviction = \"yes\"",
            "allow-eviction: \"yes\" is not a boolean",
        ),
        (
            "tls-cert = \"/nonexistent/cert.pem\"",
            "--tls-cert needs --tls-key",
        ),
        ("auth-keys = \"/nonexistent/keys.toml\"", "--auth-keys: "),
        ("store = [\"redis\"]", "store: a array is not a value here"),
        ("listen = ", "not TOML"),
    ] {
        std::fs::write(&file, text).expect("write");
        let (status, stderr) = run_to_exit(&["--config", file_arg]);
        assert_eq!(status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(says), "{text}: {stderr}");
    }
    let (status, stderr) = run_to_exit(&[
        "--config",
        dir.join("missing.toml").to_str().expect("utf-8"),
    ]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("missing.toml"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `atmost config check` prints what serve would run with, where each value
/// came from, and masks passwords; it exits 2 on what serve would refuse.
#[test]
fn config_check_prints_the_effective_configuration() {
    let dir = std::env::temp_dir().join(format!("atmost-config-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("atmost.toml");
    std::fs::write(
        &file,
        "redis-url = \"redis://app:hunter2@127.0.0.1:6379\"\nstore-timeout = \"3s\"\nmax-open-attempts = 7\n",
    )
    .expect("write");
    let check = |args: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
            .args(["config", "check", "--config", file.to_str().expect("utf-8")])
            .args(args)
            .env_clear()
            .envs(env.iter().copied())
            .output()
            .expect("atmost config check");
        (
            out.status.code(),
            String::from_utf8(out.stdout).expect("utf-8"),
            String::from_utf8(out.stderr).expect("utf-8"),
        )
    };
    let (code, stdout, stderr) = check(
        &["--max-open-attempts", "9"],
        &[("ATMOST_STORE_TIMEOUT", "4s")],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name} = ")) || l.starts_with(&format!("# {name} ")))
            .unwrap_or_else(|| panic!("no {name} in {stdout}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let from_file = format!("# file {}", file.display());
    assert_eq!(
        line("redis-url"),
        format!("redis-url = \"redis://app:****@127.0.0.1:6379\" {from_file}")
    );
    assert!(!stdout.contains("hunter2"), "{stdout}");
    assert_eq!(
        line("store-timeout"),
        "store-timeout = \"4s\" # environment ATMOST_STORE_TIMEOUT"
    );
    assert_eq!(line("max-open-attempts"), "max-open-attempts = 9 # flag");
    assert_eq!(line("retention"), "retention = \"24h\" # default");
    assert_eq!(line("auth-keys"), "# auth-keys (not set)");
    // What serve refuses, check refuses, with the same words.
    let (code, _, stderr) = check(&["--listen", "0.0.0.0:50051"], &[]);
    assert_eq!(code, Some(2));
    assert!(
        stderr.contains("refusing to serve 0.0.0.0:50051 without authentication"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// What stops `serve` at start-up stops `config check` too, with the same
/// words, and both exit 2: a Redis URL that does not parse, a key prefix
/// with braces, an OTLP compression or endpoint the exporter cannot use.
/// An address that cannot be bound is found by `serve` alone (`config
/// check` binds nothing: the port may be free where it will run), also
/// with exit 2 and the setting's name.
#[test]
fn config_check_refuses_what_serve_refuses_at_start_up() {
    let _machine = shared_blocking();
    let otlp = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1");
    // (serve's arguments, its environment, what both say)
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (
            &["--store", "redis", "--redis-url", "http://127.0.0.1:6379"],
            &[],
            "--redis-url: ",
        ),
        (
            &["--store", "redis", "--redis-url", "redis://127.0.0.1:port"],
            &[],
            "--redis-url: ",
        ),
        (
            &["--store", "redis", "--redis-prefix", "atmost{x}"],
            &[],
            "--redis-prefix: may not contain",
        ),
        (
            &[],
            &[otlp, ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")],
            "OTEL_EXPORTER_OTLP_COMPRESSION=gzip is not supported",
        ),
        (
            &[],
            &[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://bad host:4317")],
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://bad host:4317: not a URI",
        ),
    ];
    for (args, env, says) in cases {
        let mut serve = vec!["--listen", "127.0.0.1:0"];
        serve.extend_from_slice(args);
        let (status, stderr) = run_to_exit_with_env(&serve, env.iter().copied());
        assert_eq!(status.code(), Some(2), "serve {args:?} {env:?}: {stderr}");
        assert!(stderr.contains(says), "serve {args:?} {env:?}: {stderr}");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
            .args(["config", "check"])
            .args(*args)
            .envs(env.iter().copied())
            .output()
            .expect("atmost config check");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "check {args:?} {env:?}: {stderr}"
        );
        assert!(stderr.contains(says), "check {args:?} {env:?}: {stderr}");
    }

    // A port this test holds: serve cannot bind it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    for args in [
        vec!["--listen", addr.as_str()],
        vec!["--listen", "127.0.0.1:0", "--metrics-listen", addr.as_str()],
    ] {
        let flag = args[args.len() - 2];
        let (status, stderr) = run_to_exit_with_env(&args, std::iter::empty::<(&str, &str)>());
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("{flag} {addr}: ")), "{stderr}");
    }
}
