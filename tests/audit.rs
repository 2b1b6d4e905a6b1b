//! The audit trail's writer (`--audit-log`, `--audit-buffer`,
//! `--audit-when-full`), on the real binary: a file of JSON lines and logs
//! without colour codes; an output that stops taking lines (a FIFO nobody
//! reads yet), where `drop` loses events but counts every one, and `block`
//! holds the requests until the output takes them again and loses none.
//! What each event holds is `auth`'s test.

use crate::support::{AtmostProcess, NewPermit, pb, shared};
use crate::telemetry::scrape;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A directory of this test's own, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("atmost-{name}-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("dir");
        Self(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start(args: &[&str], log: &Path) -> AtmostProcess {
    let bin = Path::new(env!("CARGO_BIN_EXE_atmost"));
    AtmostProcess::spawn_logged(bin, args, &[("RUST_LOG", "info")], log).expect("start atmost")
}

async fn new_permit(client: &atmost_client::Client) -> String {
    client
        .create_permit(NewPermit::new(["t"]).expires_at_ms(atmost_client::now_ms() + 600_000))
        .await
        .expect("create")
        .permit_id
}

fn authorize(permit_id: &str, key: &str) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit_id.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: vec![7; 32],
        cost: 0,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

/// `n` Authorizes with fresh keys, 16 at a time: how many succeeded.
async fn authorize_many(client: &atmost_client::Client, permit_id: &str, n: usize) -> usize {
    let mut calls = tokio::task::JoinSet::new();
    for worker in 0..16 {
        let (client, permit_id) = (client.clone(), permit_id.to_owned());
        calls.spawn(async move {
            let mut ok = 0;
            for i in (worker..n).step_by(16) {
                let r = client
                    .authorize(authorize(&permit_id, &format!("k-{i}")))
                    .await;
                ok += usize::from(r.is_ok());
            }
            ok
        });
    }
    let mut ok = 0;
    while let Some(done) = calls.join_next().await {
        ok += done.expect("worker");
    }
    ok
}

/// The trail's counters, from `/metrics`.
async fn audit_counts(process: &AtmostProcess) -> (f64, f64, f64) {
    let samples = scrape(process.metrics_addr().expect("metrics")).await;
    let value = |name: &str| samples.get(name).copied().unwrap_or(0.0);
    (
        value("atmost_audit_events_delayed_total"),
        value("atmost_audit_events_dropped_total"),
        value("atmost_audit_write_errors_total"),
    )
}

/// A FIFO at `path`, opened for reading and writing by this process: the
/// server's open for appending does not wait for a reader, and nothing is
/// read from it until the test reads.
fn fifo(path: &Path) -> Fifo {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    std::io::BufReader::new(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .expect("open the FIFO"),
    )
}

type Fifo = std::io::BufReader<std::fs::File>;

/// Reads `want` lines from `fifo` on a thread of its own (at most 60 s):
/// each, parsed as JSON, and the reader, to read on.
async fn read_lines(mut fifo: Fifo, want: usize) -> (Vec<serde_json::Value>, Fifo) {
    let read = tokio::task::spawn_blocking(move || {
        let mut lines = Vec::with_capacity(want);
        let mut line = String::new();
        while lines.len() < want {
            line.clear();
            fifo.read_line(&mut line).expect("read the FIFO");
            let event = serde_json::from_str(line.trim_end())
                .unwrap_or_else(|e| panic!("not one JSON event per line ({e}): {line:?}"));
            lines.push(event);
        }
        (lines, fifo)
    });
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the trail's lines within 60 s")
        .expect("reader")
}

/// After the server has exited: the FIFO holds nothing more (a line of
/// this test's own, written now, is the next one read).
fn nothing_more(mut fifo: Fifo) {
    use std::io::Write as _;
    let mut end: &std::fs::File = fifo.get_ref();
    end.write_all(b"end of the trail\n")
        .expect("write the FIFO");
    let mut line = String::new();
    fifo.read_line(&mut line).expect("read the FIFO");
    assert_eq!(line, "end of the trail\n", "a line after the counted ones");
}

/// A server whose audit trail goes to a FIFO nobody reads yet (an output
/// that stopped taking lines), with a permit on which every Authorize may
/// stay open.
struct Stuck {
    _dir: Dir,
    reader: Fifo,
    process: AtmostProcess,
    client: atmost_client::Client,
    permit: String,
}

async fn stuck(name: &str, extra: &[&str]) -> Stuck {
    let dir = Dir::new(name);
    let path = dir.0.join("audit.fifo");
    let reader = fifo(&path);
    let mut args = vec!["--audit-log", path.to_str().expect("utf-8")];
    // More open attempts on one permit than the default quota.
    args.extend(["--max-open-attempts", "0"]);
    args.extend(extra);
    let process = start(&args, &dir.0.join("stderr.log"));
    let client = process.client().await;
    let permit = new_permit(&client).await;
    Stuck {
        _dir: dir,
        reader,
        process,
        client,
        permit,
    }
}

/// `--audit-log PATH`: the events are JSON lines in the file, not on
/// stderr; the text logs on stderr (a file, not a terminal) carry no
/// colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trail_goes_to_its_file_and_the_logs_carry_no_colour() {
    let _machine = shared().await;
    let dir = Dir::new("audit-file");
    let (trail, log) = (dir.0.join("audit.jsonl"), dir.0.join("stderr.log"));
    let mut process = start(&["--audit-log", trail.to_str().expect("utf-8")], &log);
    let client = process.client().await;
    let permit = new_permit(&client).await;
    client
        .authorize(authorize(&permit, "to-a-file"))
        .await
        .expect("authorize");
    assert!(process.terminate(Duration::from_secs(20)).is_some());

    let text = std::fs::read_to_string(&trail).expect("the trail");
    let events: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let seen: Vec<_> = events
        .iter()
        .map(|e| (e["rpc"].as_str(), e["outcome"].as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (Some("CreatePermit"), Some("CREATED")),
            (Some("Authorize"), Some("DISPATCH"))
        ]
    );
    assert!(events.iter().all(|e| e["target"] == "atmost::audit"));
    let logs = std::fs::read_to_string(&log).expect("the log");
    assert!(logs.contains("permit created"), "the logs: {logs}");
    assert!(
        !logs.contains("atmost::audit"),
        "the trail on stderr: {logs}"
    );
    assert!(!logs.contains('\u{1b}'), "colour codes in a file: {logs:?}");
}

/// `--audit-log` a file that cannot be opened: exit code 2, the flag and
/// the path named, before serving.
#[test]
fn an_audit_log_that_cannot_be_opened_stops_the_start() {
    let _machine = crate::support::shared_blocking();
    let dir = Dir::new("audit-missing");
    let path = dir.0.join("no-such-dir").join("audit.jsonl");
    let path = path.to_str().expect("utf-8");
    let (status, stderr) = crate::support::run_to_exit(&["--audit-log", path]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("--audit-log {path}: ")),
        "{stderr}"
    );
    let (status, stderr) = crate::support::run_to_exit(&["--audit-buffer", "0"]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--audit-buffer"), "{stderr}");
}

/// `drop`: with the output stuck, every request is still answered; the
/// events that found the buffer full are lost and counted, and the ones
/// written plus the ones counted are all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_drops_events_and_counts_each() {
    let _machine = shared().await;
    let Stuck {
        _dir,
        reader,
        mut process,
        client,
        permit,
    } = stuck(
        "audit-drop",
        &[
            "--audit-buffer",
            "1",
            "--audit-when-full",
            "drop",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    // Far more than the pipe (64 KiB) and the writer's buffer hold.
    const N: usize = 2000;
    assert_eq!(authorize_many(&client, &permit, N).await, N);
    let (delayed, dropped, errors) = audit_counts(&process).await;
    assert_eq!((delayed, errors), (0.0, 0.0));
    assert!(dropped >= 1.0, "nothing dropped with the output stuck");
    let events = 1 + N;
    let written = events - dropped as usize;
    let (lines, reader) = read_lines(reader, written).await;
    assert_eq!(lines.len(), written);
    assert_eq!(lines[0]["rpc"], "CreatePermit");
    assert!(lines[1..].iter().all(|e| e["outcome"] == "DISPATCH"));
    assert_eq!(audit_counts(&process).await.1, dropped);
    // Nothing more was written than was counted as not dropped.
    assert!(process.terminate(Duration::from_secs(20)).is_some());
    nothing_more(reader);
}

/// `block`: with the output stuck, the requests with an event to write
/// wait (counted), health and metrics go on; once the output takes lines
/// again every request is answered and no event is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_blocks_the_requests_and_loses_nothing() {
    let _machine = shared().await;
    let Stuck {
        _dir,
        reader,
        mut process,
        client,
        permit,
    } = stuck(
        "audit-block",
        &["--audit-buffer", "1", "--metrics-listen", "127.0.0.1:0"],
    )
    .await;
    const N: usize = 1500;
    let calls = {
        let (client, permit) = (client.clone(), permit.clone());
        tokio::spawn(async move { authorize_many(&client, &permit, N).await })
    };
    // The requests wait on the trail; the metrics endpoint still answers.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (delayed, dropped, errors) = audit_counts(&process).await;
        assert_eq!((dropped, errors), (0.0, 0.0));
        if delayed >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no request waited on the stuck trail"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !calls.is_finished(),
        "every request answered with the output stuck"
    );
    tokio::time::timeout(Duration::from_secs(10), crate::support::health(&client, ""))
        .await
        .expect("health goes on while requests wait on the trail")
        .expect("health");
    let (lines, reader) = read_lines(reader, 1 + N).await;
    assert_eq!(calls.await.expect("calls"), N);
    assert_eq!(lines[0]["rpc"], "CreatePermit");
    let mut keys: Vec<_> = lines[1..]
        .iter()
        .map(|e| e["idempotency_key"].as_str().expect("a key").to_owned())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), N, "every Authorize's event, once");
    let (delayed, dropped, errors) = audit_counts(&process).await;
    assert!(delayed >= 1.0);
    assert_eq!((dropped, errors), (0.0, 0.0));
    assert!(process.terminate(Duration::from_secs(20)).is_some());
    nothing_more(reader);
}

/// SIGTERM with events still queued behind a stuck output: atmost waits
/// for the output (up to 10 s) and writes every one out before it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_writes_out_the_queue_before_the_exit() {
    let _machine = shared().await;
    let Stuck {
        _dir,
        reader,
        mut process,
        client,
        permit,
    } = stuck("audit-exit", &[]).await;
    // More than the pipe and the writer's batch hold, less than the queue
    // (65 536 lines): no request waits, the rest stays queued.
    const N: usize = 1000;
    assert_eq!(authorize_many(&client, &permit, N).await, N);
    drop(client);
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &process.pid().to_string()])
        .status();
    // The server waits for the output: it is still there.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        process.try_wait().is_none(),
        "exited with its queue unwritten"
    );
    let (lines, reader) = read_lines(reader, 1 + N).await;
    assert_eq!(lines[0]["rpc"], "CreatePermit");
    assert!(lines[1..].iter().all(|e| e["outcome"] == "DISPATCH"));
    let status = process.terminate(Duration::from_secs(20)).expect("exited");
    assert!(status.success(), "{status:?}");
    nothing_more(reader);
}
