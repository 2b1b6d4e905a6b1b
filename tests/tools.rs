//! The project's tools, run in process against real servers: the
//! multi-replica stress checker in its short CI configuration, a smoke run
//! of every scenario of the load generator, and a tiny run of the
//! ListUncertain scale measurement. None asserts a speed: benchmarks are
//! not tests (scripts/bench.sh measures; docs/performance.md reports). The
//! first two load the machine, so each runs alone
//! ([`exclusive`](crate::support::exclusive)): every other test waits.

use crate::support::*;
use clap::Parser;

/// The JSON lines a tool appended to `path`, which is removed.
fn take_rows(path: &std::path::Path) -> Vec<serde_json::Value> {
    let lines = std::fs::read_to_string(path).expect("results");
    let _ = std::fs::remove_file(path);
    lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

/// Three real replicas on one real Redis, 64 faulty agent loops for 20 s
/// with a replica SIGKILLed every 5 s, then the history check. Run it longer
/// by hand as the README's "Tests" says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_three_replicas_sixty_four_agents_no_violations() {
    let _alone = exclusive().await;
    let args = atmost_stress::Args::parse_from([
        "atmost-stress",
        "--atmost-bin",
        env!("CARGO_BIN_EXE_atmost"),
        "--replicas",
        "3",
        "--clients",
        "64",
        "--duration",
        "20s",
        "--kill-every",
        "5s",
    ]);
    let summary = atmost_stress::run(args, std::future::pending())
        .await
        .expect("the stress run");
    println!("{summary}");
    assert!(
        summary.violations.is_empty(),
        "{summary}\n{:#?}",
        summary.violations
    );
    // It must have done real work, faults included.
    assert!(summary.dispatches > 500, "{summary}");
    // Holder tokens recovered DISPATCHes whose answers were lost.
    assert!(summary.redelivered > 0, "{summary}");
    assert!(summary.dropped_responses > 50, "{summary}");
    assert!(summary.replica_kills >= 2, "{summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_every_scenario_against_the_real_server() {
    let _alone = exclusive().await;
    // As bench.sh starts it: the scenarios leave attempts open by the
    // thousand on a few permits, past the quotas (a fast run of `contended`
    // opened its 1 001st on one permit in 300 ms).
    let server = spawn_atmost(&["--max-open-attempts", "0", "--max-attempts-per-permit", "0"]);
    let json = std::env::temp_dir().join(format!("atmost-bench-{}.jsonl", uuid::Uuid::now_v7()));
    let target = format!("http://{}", server.addr());
    // Every scenario closed-loop, then authorize open-loop (the pacer).
    let runs = [
        "health",
        "authorize",
        "http-authorize",
        "cycle",
        "replay",
        "contended",
    ]
    .map(|s| (s, None))
    .into_iter()
    .chain([("authorize", Some("100"))]);
    for (scenario, rate) in runs {
        let mut argv = vec![
            "atmost-bench",
            "--target",
            &target,
            "--scenario",
            scenario,
            "--duration",
            "300ms",
            "--warmup",
            "0s",
            "--concurrency",
            "8",
            "--permits",
            "2",
            "--json",
            json.to_str().expect("a UTF-8 temp path"),
        ];
        argv.extend(rate.map(|r| ["--rate", r]).into_iter().flatten());
        atmost_bench::generate(atmost_bench::Args::parse_from(argv))
            .await
            .unwrap_or_else(|e| panic!("{scenario}: {e}"));
    }
    let rows = take_rows(&json);
    assert_eq!(rows.len(), 7);
    for row in rows {
        assert!(row["requests"].as_u64().unwrap_or(0) > 0, "{row}");
        assert_eq!(row["errors"].as_u64(), Some(0), "{row}");
    }
}

/// The Redis ceiling (`redis_ceiling`) drives the authorize script with
/// the store's own invocation and reads each reply with the store's own
/// reader: tiny, every strategy on a Redis of its own (it resets the
/// commandstats), each reported with Redis's time per script; nothing is
/// left behind. A reply that is not a DISPATCH is an error to that reader
/// (here, the same call on a permit that does not exist), which the tool
/// turns into a failed run. No figure is asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redis_ceiling_runs_the_stores_own_calls() {
    use atmost::store::redis::{RedisConfig, RedisStore};
    let _machine = shared().await;
    let redis = Redis::start_owned();
    let json = std::env::temp_dir().join(format!("atmost-ceiling-{}.jsonl", uuid::Uuid::now_v7()));
    let args = atmost_bench::ceiling::Args::parse_from([
        "redis_ceiling",
        "--redis-url",
        &redis.url,
        "--requests",
        "200",
        "--concurrency",
        "4",
        "--permits",
        "2",
        "--strategies",
        "multiplexed,connections-4,pool-2",
        "--json",
        json.to_str().expect("a UTF-8 temp path"),
    ]);
    atmost_bench::ceiling::run(args)
        .await
        .expect("every call a fresh DISPATCH");
    let rows = take_rows(&json);
    let strategies: Vec<_> = rows.iter().map(|r| r["strategy"].as_str()).collect();
    assert_eq!(
        strategies,
        [Some("multiplexed"), Some("connections-4"), Some("pool-2")]
    );
    for row in &rows {
        assert!(row["rps"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        assert!(
            row["script_usec_per_call"].as_f64().unwrap_or(0.0) > 0.0,
            "{row}"
        );
    }
    let mut conn = redis.connect().await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("ceiling*")
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert!(left.is_empty(), "{left:?}");

    // The same call on a permit that does not exist: an error to the
    // store's reader, not a DISPATCH.
    let store = RedisStore::connect(&RedisConfig::new(redis.url.clone(), redis.prefix.clone()))
        .expect("store");
    load_library(&mut conn).await;
    let cmd = atmost::domain::AuthorizeCmd {
        permit_id: uuid::Uuid::now_v7().to_string(),
        tool: "t".into(),
        idempotency_key: "k".into(),
        request_fingerprint: vec![1; 32],
        cost: 1,
        holder_token: Vec::new(),
        approval_summary: String::new(),
    };
    let now = atmost_client::now_ms();
    let packed: Vec<u8> = store
        .authorize_command(&Default::default(), &cmd, now, &atmost::domain::new_id(now))
        .query_async(&mut conn)
        .await
        .expect("the script runs");
    let refused = RedisStore::authorize_reply(&cmd, &packed).expect_err("no such permit");
    assert_eq!(refused.reason().as_str(), "PERMIT_NOT_FOUND", "{refused:?}");
}

/// A generator run whose calls did not take the path their scenario
/// claims fails, after its report, unless `--allow-errors` names each kind
/// of error it met: here `authorize` on a server that lets each permit
/// hold one open attempt, so all but the first call per permit are
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bench_run_that_did_not_take_its_path_fails() {
    let _machine = shared().await;
    let server = spawn_atmost(&["--max-open-attempts", "1"]);
    let target = format!("http://{}", server.addr());
    // Over gRPC and over the HTTP/JSON edge alike.
    for scenario in ["authorize", "http-authorize"] {
        let run = |allow: &'static str| {
            let target = target.clone();
            async move {
                let mut argv = vec![
                    "atmost-bench",
                    "--target",
                    &target,
                    "--scenario",
                    scenario,
                    "--requests",
                    "20",
                    "--concurrency",
                    "2",
                    "--permits",
                    "2",
                ];
                if !allow.is_empty() {
                    argv.extend(["--allow-errors", allow]);
                }
                atmost_bench::generate(atmost_bench::Args::parse_from(argv)).await
            }
        };
        let failed = run("").await.expect_err("refusals are not DISPATCHes");
        assert!(
            failed.to_string().contains("QUOTA_OPEN_ATTEMPTS"),
            "{scenario}: {failed}"
        );
        let failed = run("OVERLOADED").await.expect_err("not the error allowed");
        assert!(
            failed.to_string().contains("QUOTA_OPEN_ATTEMPTS"),
            "{scenario}: {failed}"
        );
        run("OVERLOADED,QUOTA_OPEN_ATTEMPTS")
            .await
            .expect("every error allowed");
    }
}

/// The ListUncertain scale measurement (docs/performance.md, "ListUncertain
/// at scale"), tiny: both stores, 10 and 30 open attempts, pages of 5 and
/// 10. The tool checks every page it times (its size, every attempt
/// UNCERTAIN); here, that it reports every measurement, leaves no key
/// behind and puts the SLOWLOG settings back. No figure is asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_scale_measures_both_stores_and_cleans_up() {
    let _machine = shared().await;
    let redis = Redis::start();
    let mut conn = redis.connect().await;
    let before = slowlog_settings(&mut conn).await;
    let json =
        std::env::temp_dir().join(format!("atmost-list-scale-{}.jsonl", uuid::Uuid::now_v7()));
    let args = atmost_bench::list_scale::Args::parse_from([
        "list_scale",
        "--sizes",
        "10,30",
        "--pages",
        "5,10",
        "--calls",
        "10",
        "--redis-url",
        &redis.url,
        "--json",
        json.to_str().expect("a UTF-8 temp path"),
    ]);
    let rows = atmost_bench::list_scale::run(args)
        .await
        .expect("the measurement");
    let lines = std::fs::read_to_string(&json).expect("results");
    let _ = std::fs::remove_file(&json);
    assert_eq!(lines.lines().count(), rows.len());
    // Per store and size: one fill, and 2 pages x 2 listings x 2 scopes.
    assert_eq!(rows.len(), 2 * 2 * (1 + 8), "{rows:#?}");
    for row in &rows {
        let redis_store = row["store"] == "redis";
        match row["scenario"].as_str() {
            Some("list_uncertain") => {
                assert!(row["p50_us"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
                assert_eq!(row["redis_script_us"].is_number(), redis_store, "{row}");
            }
            Some("list_uncertain_fill") if redis_store => {
                assert!(row["redis_bytes_per_open_attempt"].is_number(), "{row}");
                assert!(row["slowlog_list_entries"].is_number(), "{row}");
            }
            Some("list_uncertain_fill") => {}
            _ => panic!("an unexpected row: {row}"),
        }
    }
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("listscale*")
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(slowlog_settings(&mut conn).await, before);
}

async fn slowlog_settings(conn: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
    redis::cmd("CONFIG")
        .arg("GET")
        .arg("slowlog-*")
        .query_async(conn)
        .await
        .expect("CONFIG GET slowlog-*")
}
