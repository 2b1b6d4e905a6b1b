//! The project's tools, run in process against real servers: the
//! multi-replica stress checker in its short CI configuration, a smoke run
//! of every scenario of the load generator, and a tiny run of the
//! ListUncertain scale measurement. None asserts a speed: benchmarks are
//! not tests (scripts/bench.sh measures; docs/performance.md reports). The
//! first two load the machine, so each runs alone
//! ([`exclusive`](crate::support::exclusive)): every other test waits.

use crate::support::*;
use clap::Parser;

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
    let runs = ["health", "authorize", "cycle", "replay", "contended"]
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
    let lines = std::fs::read_to_string(&json).expect("results");
    let _ = std::fs::remove_file(&json);
    let rows: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(rows.len(), 6);
    for row in rows {
        assert!(row["requests"].as_u64().unwrap_or(0) > 0, "{row}");
        assert_eq!(row["errors"].as_u64(), Some(0), "{row}");
    }
}

/// `--print-script` prints what the Redis store sends (bench.sh's Redis
/// ceiling runs it with redis-benchmark): a script a real Redis loads and
/// runs, answering as the store's own run would. An unknown name fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_prints_the_scripts_the_redis_store_sends() {
    let _machine = shared().await;
    let mut printed = Vec::new();
    atmost_bench::print_script("authorize", &mut printed).expect("a script named authorize");
    let text = String::from_utf8(printed).expect("UTF-8");
    let body = atmost::store::redis::script_body("authorize").expect("authorize");
    assert_eq!(text, atmost::store::redis::script_text(body));
    let redis = Redis::start();
    let mut conn = redis.connect().await;
    let permit = format!("{}:{{{}}}", redis.prefix, uuid::Uuid::now_v7());
    let keys = ["permit", "attempts", "open", "dup"].map(|k| format!("{permit}:{k}"));
    let id = atmost::domain::new_id(1_767_225_600_000);
    let packed: Vec<u8> = redis::Script::new(&text)
        .key(&keys[..])
        .arg("1767225600000")
        .arg("t")
        .arg("k")
        .arg("fp")
        .arg("1")
        .arg(
            uuid::Uuid::parse_str(&id)
                .expect("uuid")
                .as_bytes()
                .as_slice(),
        )
        .arg("")
        .invoke_async(&mut conn)
        .await
        .expect("the printed script runs");
    let reply = atmost::store::redis::unpack_reply(&packed).expect("a reply the store reads");
    assert_eq!(
        reply[..2],
        [
            redis::Value::BulkString(b"ERR".to_vec()),
            redis::Value::BulkString(b"PERMIT_NOT_FOUND".to_vec())
        ]
    );

    assert!(atmost_bench::print_script("no_such_script", &mut Vec::new()).is_err());
    let refused = atmost_bench::generate(atmost_bench::Args::parse_from([
        "atmost-bench",
        "--print-script",
        "no_such_script",
    ]))
    .await;
    assert!(refused.is_err(), "an unknown name must fail");
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
