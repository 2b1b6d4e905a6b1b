//! A smoke check that the load generator still works end to end against
//! the real binary. It asserts no speed: benchmarks are not tests
//! (scripts/bench.sh measures; docs/performance.md reports).

mod support;

use std::process::Command;
use support::Process;

#[test]
fn atmost_bench_runs_every_scenario_against_the_real_server() {
    let server = Process::spawn::<&str>(&[]);
    let json = std::env::temp_dir().join(format!("atmost-bench-{}.jsonl", uuid::Uuid::now_v7()));
    // Every scenario closed-loop, then authorize open-loop (the pacer).
    let runs = ["health", "authorize", "cycle", "replay", "contended"]
        .map(|s| (s, None))
        .into_iter()
        .chain([("authorize", Some("500"))]);
    for (scenario, rate) in runs {
        let status = Command::new(env!("CARGO_BIN_EXE_atmost-bench"))
            .args(["--target", &format!("http://{}", server.addr())])
            .args([
                "--scenario",
                scenario,
                "--duration",
                "300ms",
                "--warmup",
                "0s",
            ])
            .args(["--concurrency", "8", "--permits", "2"])
            .args(rate.map(|r| ["--rate", r]).into_iter().flatten())
            .arg("--json")
            .arg(&json)
            .status()
            .expect("run atmost-bench");
        assert!(status.success(), "{scenario}: {status:?}");
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

#[test]
fn atmost_bench_prints_the_scripts_the_redis_store_sends() {
    let bench = || Command::new(env!("CARGO_BIN_EXE_atmost-bench"));
    let out = bench()
        .args(["--print-script", "authorize"])
        .output()
        .expect("run atmost-bench");
    assert!(out.status.success(), "{out:?}");
    let body = atmost::store::redis::script_body("authorize").expect("authorize");
    assert_eq!(
        String::from_utf8(out.stdout).expect("utf-8"),
        atmost::store::redis::script_text(body)
    );
    let out = bench()
        .args(["--print-script", "no_such_script"])
        .output()
        .expect("run atmost-bench");
    assert!(!out.status.success(), "an unknown name must fail: {out:?}");
}
