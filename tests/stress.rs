//! The multi-replica stress checker in its short CI configuration: three
//! real replicas on one real Redis, 64 faulty agent loops for 20 s with a
//! replica SIGKILLed every 5 s, then the history check. Run it longer by
//! hand: `cargo run --release --bin atmost-stress -- --duration 10m`.

use std::process::Command;

#[test]
fn three_replicas_sixty_four_agents_no_violations() {
    let output = Command::new(env!("CARGO_BIN_EXE_atmost-stress"))
        .args(["--atmost-bin", env!("CARGO_BIN_EXE_atmost")])
        .args(["--replicas", "3", "--clients", "64", "--duration", "20s"])
        .args(["--kill-every", "5s"])
        .output()
        .expect("run atmost-stress");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("stress: "))
        .unwrap_or_else(|| panic!("no summary line; stderr:\n{stderr}"));
    assert!(output.status.success(), "{summary}\n{stderr}");
    assert!(summary.contains(", 0 violations"), "{summary}\n{stderr}");
    // It must have done real work, faults included.
    let number = |label: &str| -> u64 {
        let before = summary.split(label).next().expect("label");
        before
            .rsplit(|c: char| !c.is_ascii_digit())
            .find(|s| !s.is_empty())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    assert!(number(" dispatches") > 500, "{summary}");
    assert!(number(" dropped responses") > 50, "{summary}");
    assert!(number(" replica kills") >= 2, "{summary}");
}
