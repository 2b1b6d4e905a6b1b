//! The operator CLI and `atmost demo`: the real binary run against a live
//! server (in process on each store, or a spawned `atmost serve`), its
//! tables and `--json` read back, its exit codes (0, 2, 3, 4, 5, and 1 for
//! a story that went otherwise), API keys and TLS.

use crate::auth::{KeyFile, entry};
use crate::support::*;
use std::sync::Arc;
use std::time::Duration;

on_each_store!(
    permit_commands_print_tables_and_json,
    uncertain_and_attempt_commands_list_resolve_and_read,
    api_keys_are_sent_never_shown_and_a_wrong_one_is_refused,
    the_demo_against_a_server_leaves_what_the_story_says,
);

// === running the binary ===

/// How one run of the binary ended.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The one JSON document on stdout.
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON document ({e}): {self:?}"))
    }

    /// The one JSON document on stderr (`--json`'s errors).
    fn json_error(&self) -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_str(&self.stderr)
            .unwrap_or_else(|e| panic!("stderr is not one JSON document ({e}): {self:?}"));
        v["error"].clone()
    }

    #[track_caller]
    fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }

    #[track_caller]
    fn exits(self, code: i32) -> Self {
        assert_eq!(self.code, code, "{self:?}");
        self
    }
}

/// `atmost <args>` with these environment variables (and none of the
/// caller's ATMOST_ ones), to its end: at most 60 s.
async fn atmost(args: &[&str], env: &[(&str, &str)]) -> Run {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || run_blocking(&args, &env))
        .await
        .expect("the run")
}

fn run_blocking(args: &[String], env: &[(String, String)]) -> Run {
    use std::io::Read;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args(args)
        .env_remove("ATMOST_SERVER")
        .env_remove("ATMOST_API_KEY")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run atmost");
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            r.read_to_string(&mut text).expect("read output");
            text
        })
    };
    let stdout = pipe(Box::new(child.stdout.take().expect("stdout")));
    let stderr = pipe(Box::new(child.stderr.take().expect("stderr")));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("atmost {args:?} still running after 60 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Run {
        code: status.code().expect("exited, not killed by a signal"),
        stdout: stdout.join().expect("stdout"),
        stderr: stderr.join().expect("stderr"),
    }
}

fn url(h: &Harness) -> String {
    format!("http://{}", h.addr)
}

/// `atmost <noun> <verb...> --server <h> <rest>`.
async fn on(h: &Harness, args: &[&str]) -> Run {
    let server = url(h);
    let mut all = args.to_vec();
    all.extend(["--server", server.as_str()]);
    atmost(&all, &[]).await
}

/// The first line of a table row that starts with `field`, split on runs
/// of spaces.
fn row<'a>(text: &'a str, field: &str) -> Vec<&'a str> {
    let line = text
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no line {field:?} in\n{text}"));
    line[field.len()..].split_whitespace().collect()
}

/// An address where nothing listens: a port bound, then let go.
fn nothing_there() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    format!("http://{addr}")
}

// === permit ===

async fn permit_commands_print_tables_and_json(kind: Kind) {
    let h = Harness::start(kind).await;
    let created = on(
        &h,
        &[
            "permit",
            "create",
            "--tool",
            "search",
            "--cap",
            "wallet.charge=1",
            "--budget",
            "500",
            "--currency",
            "EUR",
            "--subject",
            "agent-7",
            "--expires-in",
            "2h",
            "--lease",
            "1m",
            "--duplicate-guard",
            "enforce",
            "--duplicate-window",
            "5m",
            "--uncertain-policy",
            "hold-tool",
        ],
    )
    .await
    .ok();
    // The id comes first, on a line of its own words.
    let first = created.stdout.lines().next().expect("a first line");
    let id = first
        .strip_prefix("created permit ")
        .unwrap_or_else(|| panic!("first line {first:?}"))
        .to_owned();
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    assert_eq!(row(&created.stdout, "tools"), ["search,", "wallet.charge"]);
    assert_eq!(
        row(&created.stdout, "duplicate guard"),
        ["ENFORCE,", "window", "5m"]
    );
    // What the server stored is what the flags said.
    let got = h.get(&id).await.expect("get");
    let permit = got.permit.clone().expect("permit");
    assert_eq!(permit.tools, ["search", "wallet.charge"]);
    assert_eq!(permit.max_calls_per_tool["wallet.charge"], 1);
    assert_eq!(
        (permit.budget, permit.currency.as_str()),
        (Some(500), "EUR")
    );
    assert_eq!(permit.subject, "agent-7");
    assert_eq!(permit.lease.map(|d| d.seconds), Some(60));
    let guard = permit.duplicate_guard.expect("guard");
    assert_eq!(guard.mode(), pb::DuplicateGuardMode::Enforce);
    assert_eq!(guard.window.map(|d| d.seconds), Some(300));
    assert_eq!(permit.uncertain_policy(), pb::UncertainPolicy::HoldTool);
    let expires = atmost_client::millis(permit.expires_at.as_ref().expect("expiry"));
    let created_at = atmost_client::millis(permit.created_at.as_ref().expect("created"));
    assert!(
        (expires - created_at - 7_200_000).abs() < 60_000,
        "{permit:?}"
    );

    // --json: the proto's JSON names, 64-bit integers as strings.
    let json = on(
        &h,
        &[
            "permit",
            "create",
            "--cap",
            "wallet.charge=1",
            "--expires-at",
            "2099-01-01T00:00:00+02:00",
            "--agent",
            "a1,a2",
            "--json",
        ],
    )
    .await;
    // Past the server's 30-day lifetime quota: refused (4), said in JSON.
    let json = json.exits(4);
    let error = json.json_error();
    assert_eq!(error["reason"], "QUOTA_PERMIT_LIFETIME", "{json:?}");
    assert_eq!(error["code"], "RESOURCE_EXHAUSTED");
    assert!(error["metadata"]["limit"].is_string(), "{error}");
    assert!(json.stdout.is_empty(), "{json:?}");
    let created = on(
        &h,
        &[
            "permit",
            "create",
            "--cap",
            "wallet.charge=1",
            "--agent",
            "a1,a2",
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(created["maxCallsPerTool"]["wallet.charge"], "1");
    assert_eq!(created["tools"], serde_json::json!(["wallet.charge"]));
    assert_eq!(created["agents"], serde_json::json!(["a1", "a2"]));
    assert_eq!(created["status"], "PERMIT_STATUS_ACTIVE");
    let second = created["permitId"].as_str().expect("an id").to_owned();
    // No expiry flag: an hour from now.
    let p = h.get(&second).await.expect("get").permit.expect("permit");
    let expires = atmost_client::millis(p.expires_at.as_ref().expect("expiry"));
    assert!((expires - atmost_client::now_ms() - 3_600_000).abs() < 60_000);

    // permit get: the record, the budget, the usage per tool.
    h.dispatch(&id, "wallet.charge", "k1", b"fp", 200).await;
    let shown = on(&h, &["permit", "get", &id]).await.ok();
    assert_eq!(row(&shown.stdout, "permit"), [id.as_str()]);
    assert_eq!(row(&shown.stdout, "subject"), ["agent-7"]);
    assert_eq!(
        row(&shown.stdout, "budget"),
        [
            "500",
            "EUR",
            "(committed",
            "0,",
            "reserved",
            "200,",
            "remaining",
            "300)"
        ]
    );
    assert_eq!(row(&shown.stdout, "TOOL"), ["CALLS", "CAP"]);
    assert_eq!(row(&shown.stdout, "search"), ["0", "none"]);
    assert_eq!(row(&shown.stdout, "wallet.charge"), ["1", "1"]);
    let json = on(&h, &["permit", "get", &id, "--json"]).await.ok().json();
    assert_eq!(json["budgetReserved"], "200");
    assert_eq!(json["budgetCommitted"], "0");
    assert_eq!(json["budgetRemaining"], "300");
    assert_eq!(json["permit"]["permitId"], id.as_str());
    assert_eq!(json["usage"][1]["tool"], "wallet.charge");
    assert_eq!(json["usage"][1]["callsMade"], "1");
    assert_eq!(json["usage"][1]["callsLimit"], "1");
    assert_eq!(json["usage"][0]["callsMade"], "0");
    assert!(json["usage"][0].get("callsLimit").is_none(), "{json}");

    // permit revoke, twice: fine both times.
    let revoked = on(&h, &["permit", "revoke", &id]).await.ok();
    assert_eq!(
        revoked.stdout.lines().next(),
        Some(format!("revoked permit {id}").as_str())
    );
    assert_eq!(row(&revoked.stdout, "status"), ["REVOKED"]);
    let again = on(&h, &["permit", "revoke", &id, "--json"])
        .await
        .ok()
        .json();
    assert_eq!(again["status"], "PERMIT_STATUS_REVOKED");
    let permit = h.get(&id).await.expect("get").permit.expect("permit");
    assert_eq!(permit.status(), pb::PermitStatus::Revoked);

    // 3: not found, with the reason and its metadata on stderr.
    let unknown = uuid::Uuid::now_v7().to_string();
    for verb in ["get", "revoke"] {
        let r = on(&h, &["permit", verb, &unknown]).await.exits(3);
        assert!(r.stderr.contains("PERMIT_NOT_FOUND (NOT_FOUND)"), "{r:?}");
        assert!(r.stderr.contains(&format!("permit_id: {unknown}")), "{r:?}");
        assert!(r.stdout.is_empty(), "{r:?}");
    }
    let r = on(&h, &["permit", "get", &unknown, "--json"])
        .await
        .exits(3);
    assert_eq!(r.json_error()["reason"], "PERMIT_NOT_FOUND");
    assert_eq!(r.json_error()["metadata"]["permit_id"], unknown.as_str());

    // 2: usage, and input the server calls invalid; nothing is created.
    let before = on(&h, &["uncertain", "list", "--json"]).await.ok().stdout;
    for (args, says) in [
        (&["permit", "create"][..], "--tool"),
        (&["permit", "create", "--cap", "wallet.charge"], "TOOL=N"),
        (
            &["permit", "create", "--tool", "t", "--expires-in", "soon"],
            "soon",
        ),
        (
            &[
                "permit",
                "create",
                "--tool",
                "t",
                "--expires-at",
                "tomorrow",
            ],
            "RFC 3339",
        ),
        (
            &[
                "permit",
                "create",
                "--tool",
                "t",
                "--expires-in",
                "1h",
                "--expires-at",
                "2099-01-01T00:00:00Z",
            ],
            "cannot be used with",
        ),
        (
            &["permit", "create", "--tool", "t", "--lease", "8days"],
            "permit.lease",
        ),
        (&["permit", "create", "--tool", "bad tool"], "permit.tools"),
        (&["permit", "get", "not-a-uuid"], "INVALID_REQUEST"),
        (&["permit", "frobnicate"], "unrecognized subcommand"),
    ] {
        let r = on(&h, args).await.exits(2);
        assert!(r.stderr.contains(says), "{args:?}: {r:?}");
    }
    let r = atmost(&["permit", "get", &id, "--server", "127.0.0.1:50051"], &[])
        .await
        .exits(2);
    assert!(r.stderr.contains("http://HOST:PORT"), "{r:?}");
    assert_eq!(
        on(&h, &["uncertain", "list", "--json"]).await.ok().stdout,
        before
    );
}

// === uncertain and attempt ===

async fn uncertain_and_attempt_commands_list_resolve_and_read(kind: Kind) {
    let h = Harness::start(kind).await;
    let a = h.create_with(&["t"], &[("t", 3)], Some(100)).await;
    let b = h.create_with(&["t"], &[], None).await;
    let mut marked = Vec::new();
    for (permit, key, cost) in [(&a, "k1", 5), (&a, "k2", 6), (&a, "k3", 7), (&b, "kb", 0)] {
        let attempt = h.dispatch(permit, "t", key, key.as_bytes(), cost).await;
        h.mark_uncertain(&attempt, &format!("lost {key}"))
            .await
            .expect("mark");
        marked.push(attempt);
    }
    // RESERVED within its lease: not uncertain, not listed.
    h.dispatch(&b, "t", "held", b"held", 0).await;

    // Every uncertain attempt, in a table.
    let listed = on(&h, &["uncertain", "list"]).await.ok();
    assert_eq!(
        row(&listed.stdout, "PERMIT"),
        ["KEY", "TOOL", "COST", "SINCE", "REASON", "ATTEMPT"]
    );
    for m in &marked {
        let line = listed
            .stdout
            .lines()
            .find(|l| l.contains(&m.attempt_id))
            .unwrap_or_else(|| panic!("{} not listed:\n{}", m.idempotency_key, listed.stdout));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words[0], m.permit_id);
        assert_eq!(words[1], m.idempotency_key);
        assert_eq!(words[3], m.cost.to_string());
    }
    assert!(!listed.stdout.contains("held"), "{}", listed.stdout);
    assert!(
        listed.stdout.ends_with("4 uncertain attempts\n"),
        "{listed:?}"
    );

    // Page by page to the end, a page of one at a time: the same four.
    let all = on(&h, &["uncertain", "list", "--page-size", "1", "--json"])
        .await
        .ok()
        .json();
    let ids = |v: &serde_json::Value| -> Vec<String> {
        v["attempts"]
            .as_array()
            .expect("attempts")
            .iter()
            .map(|a| a["attemptId"].as_str().expect("id").to_owned())
            .collect()
    };
    let mut expected: Vec<String> = marked.iter().map(|m| m.attempt_id.clone()).collect();
    let mut got = ids(&all);
    assert_eq!(got.len(), 4, "{all}");
    got.sort();
    expected.sort();
    assert_eq!(got, expected);
    assert_eq!(all["nextPageToken"], "");
    // --limit stops early and says where to go on from.
    let two = on(&h, &["uncertain", "list", "--limit", "2", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(ids(&two).len(), 2);
    assert_ne!(two["nextPageToken"], "", "{two}");
    let limited = on(&h, &["uncertain", "list", "--limit", "3"]).await.ok();
    assert!(
        limited
            .stdout
            .ends_with("3 uncertain attempts shown; more remain past --limit\n"),
        "{limited:?}"
    );
    // One permit's, in the order they became uncertain.
    let only_a = on(&h, &["uncertain", "list", "--permit", &a, "--json"])
        .await
        .ok()
        .json();
    let keys: Vec<&str> = only_a["attempts"]
        .as_array()
        .expect("attempts")
        .iter()
        .map(|a| a["idempotencyKey"].as_str().expect("key"))
        .collect();
    assert_eq!(keys, ["k1", "k2", "k3"]);
    assert_eq!(only_a["attempts"][0]["state"], "ATTEMPT_STATE_UNCERTAIN");
    assert_eq!(only_a["attempts"][0]["uncertainReason"], "lost k1");
    assert_eq!(only_a["attempts"][0]["cost"], "5");

    // attempt get: one key's attempt.
    let shown = on(&h, &["attempt", "get", &a, "k1"]).await.ok();
    assert_eq!(
        row(&shown.stdout, "attempt"),
        [marked[0].attempt_id.as_str()]
    );
    assert_eq!(row(&shown.stdout, "state"), ["UNCERTAIN", "(lost", "k1)"]);
    assert_eq!(row(&shown.stdout, "cost"), ["5"]);
    let json = on(&h, &["attempt", "get", &a, "k1", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(json["attempt"]["attemptId"], marked[0].attempt_id.as_str());
    assert_eq!(json["attempt"]["state"], "ATTEMPT_STATE_UNCERTAIN");
    assert_eq!(json["attempt"]["idempotencyKey"], "k1");
    let r = on(&h, &["attempt", "get", &a, "never"]).await.exits(3);
    assert!(r.stderr.contains("ATTEMPT_NOT_FOUND"), "{r:?}");
    assert!(r.stderr.contains("idempotency_key: never"), "{r:?}");
    on(&h, &["attempt", "get", &a]).await.exits(2);
    // A RESERVED attempt: its id is its holder's fencing token, withheld.
    let held = on(&h, &["attempt", "get", &b, "held"]).await.ok();
    assert_eq!(row(&held.stdout, "state"), ["RESERVED"]);
    assert_eq!(
        row(&held.stdout, "attempt"),
        ["(withheld:", "open", "attempt)"]
    );
    let json = on(&h, &["attempt", "get", &b, "held", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(json["attempt"]["attemptId"], "");

    // resolve --succeeded: a receipt with the result and the cost given.
    let done = on(
        &h,
        &[
            "uncertain",
            "resolve",
            &a,
            "k1",
            "--succeeded",
            "--result",
            "wallet tx 981",
            "--actual-cost",
            "3",
        ],
    )
    .await
    .ok();
    assert_eq!(done.stdout.lines().next(), Some("resolved k1: SUCCEEDED"));
    assert_eq!(row(&done.stdout, "result"), ["wallet", "tx", "981"]);
    assert_eq!(row(&done.stdout, "actual cost"), ["3"]);
    let got = h.client.get_attempt(&a, "k1").await.expect("get");
    let receipt = got.attempt.expect("a").receipt.expect("receipt");
    assert_eq!(
        (receipt.result.as_slice(), receipt.cost),
        (&b"wallet tx 981"[..], 3)
    );
    // --result-file: any bytes, shown in JSON as base64.
    let dir = KeyFile::new("");
    let file = dir.dir.join("result.bin");
    std::fs::write(&file, [0xff, 0x00, b'x']).expect("write");
    let json = on(
        &h,
        &[
            "uncertain",
            "resolve",
            &a,
            "k2",
            "--succeeded",
            "--result-file",
            file.to_str().expect("utf-8"),
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(json["attempt"]["receipt"]["result"], "/wB4");
    assert_eq!(json["attempt"]["state"], "ATTEMPT_STATE_SUCCEEDED");
    assert_eq!(json["usage"]["callsMade"], "3");
    // --failed.
    let failed = on(
        &h,
        &["uncertain", "resolve", &a, "k3", "--failed", "declined"],
    )
    .await
    .ok();
    assert_eq!(failed.stdout.lines().next(), Some("resolved k3: FAILED"));
    assert_eq!(row(&failed.stdout, "failure"), ["declined"]);

    // --not-sent gives the slot back: it needs the attempt and --yes, and
    // without them nothing is sent.
    let kb = &marked[3];
    for args in [
        &["uncertain", "resolve", &b, "kb", "--not-sent"][..],
        &["uncertain", "resolve", &b, "kb", "--not-sent", "--yes"],
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--not-sent",
            "--attempt-id",
            &kb.attempt_id,
        ],
        &["uncertain", "resolve", &b, "kb"],
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--succeeded",
            "--failed",
            "x",
        ],
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--failed",
            "x",
            "--result",
            "r",
        ],
        &["uncertain", "resolve", &b, "kb", "--result", "r"],
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--failed",
            "x",
            "--actual-cost",
            "1",
        ],
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--not-sent",
            "--yes",
            "--attempt-id",
            &kb.attempt_id,
            "--actual-cost",
            "0",
        ],
    ] {
        on(&h, args).await.exits(2);
    }
    let still = h.client.get_attempt(&b, "kb").await.expect("get");
    assert_eq!(
        still.attempt.expect("a").state(),
        pb::AttemptState::Uncertain
    );
    // The operator's flow: the id as the listing shows it.
    let listed_b = on(&h, &["uncertain", "list", "--permit", &b, "--json"])
        .await
        .ok()
        .json();
    let kb_id = listed_b["attempts"][0]["attemptId"]
        .as_str()
        .expect("an attempt id")
        .to_owned();
    assert_eq!(kb_id, kb.attempt_id);
    let released = on(
        &h,
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--not-sent",
            "--attempt-id",
            &kb_id,
            "--yes",
        ],
    )
    .await
    .ok();
    assert_eq!(
        released.stdout.lines().next(),
        Some("resolved kb: RELEASED")
    );
    assert_eq!(row(&released.stdout, "t "), ["1", "none"], "{released:?}");
    // 4: a resolution that contradicts the one recorded, with its state.
    let r = on(&h, &["uncertain", "resolve", &b, "kb", "--failed", "x"])
        .await
        .exits(4);
    assert!(r.stderr.contains("ATTEMPT_STATE_CONFLICT"), "{r:?}");
    assert!(r.stderr.contains("state: RELEASED"), "{r:?}");
    // 4 too: another attempt's id.
    let r = on(
        &h,
        &[
            "uncertain",
            "resolve",
            &b,
            "kb",
            "--failed",
            "x",
            "--attempt-id",
            &marked[0].attempt_id,
        ],
    )
    .await
    .exits(4);
    assert!(r.stderr.contains("ATTEMPT_MISMATCH"), "{r:?}");

    let empty = on(&h, &["uncertain", "list"]).await.ok();
    assert_eq!(empty.stdout, "no uncertain attempts\n");
    let json = on(&h, &["uncertain", "list", "--json"]).await.ok().json();
    assert_eq!(json["attempts"], serde_json::json!([]));
}

// === credentials ===

const ADMIN: &str = "cli-admin-secret-0123456789";
const AGENT: &str = "cli-agent-secret-0123456789";

async fn harness_with_keys(kind: Kind, keys: &KeyFile) -> Harness {
    let auth = Arc::new(atmost::auth::Authenticator::load(&keys.path).expect("keys load"));
    let redis = (kind == Kind::Redis).then(Redis::start);
    let backend = match &redis {
        Some(r) => {
            atmost::store::Backend::Redis(redis_store(&r.url, &r.prefix, Duration::from_secs(2)))
        }
        None => atmost::store::Backend::Memory(atmost::store::memory::MemoryStore::new(DAY_MS)),
    };
    Harness::serve(backend, redis, |app| app.with_auth(auth)).await
}

async fn api_keys_are_sent_never_shown_and_a_wrong_one_is_refused(kind: Kind) {
    let keys = KeyFile::new(
        &[
            entry("cli-admin", ADMIN, "acme", "\"admin\""),
            entry("cli-agent", AGENT, "acme", "\"agent\""),
        ]
        .concat(),
    );
    let h = harness_with_keys(kind, &keys).await;
    let create = ["permit", "create", "--cap", "wallet.charge=1", "--json"];
    // No key: refused (4).
    let r = on(&h, &create).await.exits(4);
    assert_eq!(r.json_error()["reason"], "UNAUTHENTICATED", "{r:?}");
    // A wrong key: refused, and never shown.
    let wrong = "wrong-secret-key-0123456789";
    let mut args = create.to_vec();
    args.extend(["--api-key", wrong]);
    let r = on(&h, &args).await.exits(4);
    assert_eq!(r.json_error()["reason"], "UNAUTHENTICATED", "{r:?}");
    assert!(
        !r.stderr.contains(wrong) && !r.stdout.contains(wrong),
        "{r:?}"
    );
    // The admin key by flag, by file, and from the environment.
    let mut args = create.to_vec();
    args.extend(["--api-key", ADMIN]);
    let made = on(&h, &args).await.ok().json();
    assert_eq!(made["tenant"], "acme");
    let id = made["permitId"].as_str().expect("id").to_owned();
    let file = keys.dir.join("admin.key");
    std::fs::write(&file, format!("{ADMIN}\n")).expect("write");
    let server = url(&h);
    let by_file = [
        "permit",
        "get",
        &id,
        "--server",
        &server,
        "--api-key-file",
        file.to_str().expect("utf-8"),
    ];
    let r = atmost(&by_file, &[("ATMOST_API_KEY", wrong)]).await.ok();
    assert_eq!(row(&r.stdout, "tenant"), ["acme"]);
    let r = atmost(
        &["permit", "get", &id, "--server", &server],
        &[("ATMOST_API_KEY", ADMIN)],
    )
    .await
    .ok();
    assert!(
        !r.stdout.contains(ADMIN) && !r.stderr.contains(ADMIN),
        "{r:?}"
    );
    // ATMOST_SERVER names the server when --server does not.
    atmost(
        &["permit", "get", &id],
        &[("ATMOST_API_KEY", ADMIN), ("ATMOST_SERVER", &server)],
    )
    .await
    .ok();
    // Both flags at once: usage. A missing key file: usage, nothing sent.
    let mut args = by_file.to_vec();
    args.extend(["--api-key", ADMIN]);
    atmost(&args, &[]).await.exits(2);
    let r = atmost(
        &[
            "permit",
            "get",
            &id,
            "--server",
            &server,
            "--api-key-file",
            "/nonexistent/key",
        ],
        &[],
    )
    .await
    .exits(2);
    assert!(
        r.stderr.contains("--api-key-file /nonexistent/key"),
        "{r:?}"
    );
    // A role the RPC does not allow: refused (4), with the metadata.
    let r = atmost(
        &[
            "permit",
            "revoke",
            &id,
            "--server",
            &server,
            "--api-key",
            AGENT,
        ],
        &[],
    )
    .await
    .exits(4);
    assert!(
        r.stderr.contains("ROLE_NOT_ALLOWED (PERMISSION_DENIED)"),
        "{r:?}"
    );
    assert!(r.stderr.contains("key_id: cli-agent"), "{r:?}");
    assert!(
        r.stderr.contains("rpc: atmost.v1.Permits/RevokePermit"),
        "{r:?}"
    );
    // ... and the demo, whose first call is an admin's, stops there (4);
    // with the admin key it plays to the end.
    let r = atmost(&["demo", "--server", &server, "--api-key", AGENT], &[])
        .await
        .exits(4);
    assert!(r.stderr.contains("ROLE_NOT_ALLOWED"), "{r:?}");
    let r = atmost(
        &["demo", "--server", &server, "--json"],
        &[("ATMOST_API_KEY", ADMIN)],
    )
    .await
    .ok();
    assert_eq!(r.stdout.lines().count(), 8, "{r:?}");
}

// === approval ===

const ALICE: &str = "cli-alice-secret-0123456789";
const BOB: &str = "cli-bob-secret-0123456789";

/// `atmost <args> --server <h> --api-key <key>`.
async fn as_key(h: &Harness, key: &str, args: &[&str]) -> Run {
    let mut all = args.to_vec();
    all.extend(["--api-key", key]);
    on(h, &all).await
}

/// An agent's calls held for approval, listed, approved (once by one key,
/// once by two for a four-eyes rule) and denied by approvers through the
/// CLI, each read back with the client. The memory store: approval rules
/// are the store's, and the CLI is the same on each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_commands_list_approve_and_deny() {
    let _machine = shared().await;
    let keys = KeyFile::new(
        &[
            entry("cli-admin", ADMIN, "acme", "\"admin\""),
            entry("cli-agent", AGENT, "acme", "\"agent\""),
            entry("cli-alice", ALICE, "acme", "\"approver\""),
            entry("cli-bob", BOB, "acme", "\"approver\""),
        ]
        .concat(),
    );
    let h = harness_with_keys(Kind::Memory, &keys).await;
    let client = |key: &str| h.client.clone().with_api_key(key).expect("ascii");
    let (admin, agent) = (client(ADMIN), client(AGENT));
    // "payout" waits for one approver from a cost of 1000; every
    // "transfer" for two.
    let permit = admin
        .create_permit(
            NewPermit::new(["payout", "transfer"])
                .expires_at_ms(h.now_ms() + 3_600_000)
                .budget(100_000)
                .approval("payout", Some(1000), Some(Duration::from_secs(600)), 1)
                .approval("transfer", None, None, 2)
                .build(),
        )
        .await
        .expect("create")
        .permit_id;
    let ask = |client: Client, tool: &str, key: &str, cost: i64, summary: &str| {
        let request = pb::AuthorizeRequest {
            permit_id: permit.clone(),
            tool: tool.into(),
            idempotency_key: key.into(),
            request_fingerprint: format!("{tool} {key} {cost}").into_bytes(),
            cost,
            holder_token: b"holder".to_vec(),
            approval_summary: summary.into(),
            ..Default::default()
        };
        async move {
            let r = client.authorize(request).await.expect("authorize");
            assert_eq!(r.decision(), pb::Decision::AwaitApproval, "{r:?}");
            r.attempt.expect("attempt")
        }
    };
    let forged = "pay 1 EUR\u{1b}[2J\nFORGED-LINE\u{2028}x";
    let long = format!("pay 9000 EUR to {}", "X".repeat(300));
    let p1 = ask(
        agent.clone(),
        "payout",
        "p-1",
        5_000,
        "pay 5000 EUR to DE00",
    )
    .await;
    let p2 = ask(agent.clone(), "payout", "p-2", 2_000, forged).await;
    let p3 = ask(agent.clone(), "payout", "p-3", 9_000, &long).await;
    let t1 = ask(agent.clone(), "transfer", "t-1", 10, "move 10").await;

    // permit get shows the rules.
    let shown = as_key(&h, ADMIN, &["permit", "get", &permit]).await.ok();
    let rules: Vec<&str> = shown
        .stdout
        .lines()
        .filter(|l| l.starts_with("needs approval"))
        .collect();
    assert_eq!(rules.len(), 2, "{}", shown.stdout);
    assert!(
        rules[0].ends_with("payout: calls costing at least 1000, 1 approver, wait 10m"),
        "{rules:?}"
    );
    assert!(
        rules[1].ends_with("transfer: every call, 2 distinct approvers, wait 15m"),
        "{rules:?}"
    );

    // The approver's table: every call, its approvals, its summary escaped
    // and cut, its attempt id; nothing a summary holds makes a line.
    let listed = as_key(&h, ALICE, &["approval", "list"]).await.ok();
    assert_eq!(
        row(&listed.stdout, "PERMIT"),
        [
            "KEY",
            "TOOL",
            "COST",
            "REQUESTED",
            "EXPIRES",
            "APPROVALS",
            "SUMMARY",
            "ATTEMPT"
        ]
    );
    for (a, approvals) in [(&p1, "0/1"), (&p2, "0/1"), (&p3, "0/1"), (&t1, "0/2")] {
        let line = listed
            .stdout
            .lines()
            .find(|l| l.contains(&a.attempt_id))
            .unwrap_or_else(|| panic!("{} not listed:\n{}", a.idempotency_key, listed.stdout));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words[0], permit);
        assert_eq!(words[1], a.idempotency_key);
        assert_eq!(words[2], a.tool);
        assert_eq!(words[3], a.cost.to_string());
        assert_eq!(words[6], approvals, "{line}");
        assert_eq!(words.last(), Some(&a.attempt_id.as_str()), "{line}");
    }
    assert_eq!(
        listed.stdout.lines().count(),
        1 + 4 + 2,
        "{}",
        listed.stdout
    );
    assert!(!listed.stdout.contains('\u{1b}'), "{:?}", listed.stdout);
    assert!(!listed.stdout.contains('\u{2028}'), "{:?}", listed.stdout);
    assert!(
        listed
            .stdout
            .contains(r#""pay 1 EUR\u{1b}[2J\nFORGED-LINE\u{2028}x""#),
        "{}",
        listed.stdout
    );
    assert!(listed.stdout.contains("pay 5000 EUR to DE00"));
    assert!(!listed.stdout.contains(&long), "cut short");
    assert!(listed.stdout.contains("pay 9000 EUR to XXX"));
    assert!(
        listed.stdout.ends_with("4 calls awaiting approval\n"),
        "{listed:?}"
    );

    // --json: the ListApprovalsResponse, the summaries as they are; page by
    // page to the end; --limit; --permit.
    let all = as_key(
        &h,
        ALICE,
        &["approval", "list", "--page-size", "1", "--json"],
    )
    .await
    .ok()
    .json();
    let keys_of = |v: &serde_json::Value| -> Vec<String> {
        v["attempts"]
            .as_array()
            .expect("attempts")
            .iter()
            .map(|a| a["idempotencyKey"].as_str().expect("key").to_owned())
            .collect()
    };
    assert_eq!(keys_of(&all), ["p-1", "p-2", "p-3", "t-1"], "oldest first");
    assert_eq!(all["nextPageToken"], "");
    assert_eq!(all["attempts"][1]["approval"]["summary"], forged);
    assert_eq!(all["attempts"][1]["attemptId"], p2.attempt_id.as_str());
    assert_eq!(
        all["attempts"][1]["state"],
        "ATTEMPT_STATE_AWAITING_APPROVAL"
    );
    assert_eq!(all["attempts"][3]["approval"]["approversNeeded"], 2);
    assert!(
        all["attempts"][0]["approval"]["expiresAt"].is_string(),
        "{all}"
    );
    let two = as_key(&h, ALICE, &["approval", "list", "--limit", "2", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(keys_of(&two), ["p-1", "p-2"]);
    assert_ne!(two["nextPageToken"], "", "{two}");
    let limited = as_key(&h, ALICE, &["approval", "list", "--limit", "1"])
        .await
        .ok();
    assert!(
        limited
            .stdout
            .ends_with("1 call awaiting approval shown; more remain past --limit\n"),
        "{limited:?}"
    );
    let elsewhere = admin
        .create_permit(h.permit(&["payout"]))
        .await
        .expect("create")
        .permit_id;
    let none = as_key(&h, ALICE, &["approval", "list", "--permit", &elsewhere])
        .await
        .ok();
    assert_eq!(none.stdout, "no calls await approval\n");

    // Agents never approve, nor list: ROLE_NOT_ALLOWED (4).
    for args in [
        &["approval", "list"][..],
        &[
            "approval",
            "approve",
            &permit,
            "p-1",
            "--attempt-id",
            &p1.attempt_id,
        ],
        &[
            "approval",
            "deny",
            &permit,
            "p-1",
            "--attempt-id",
            &p1.attempt_id,
        ],
    ] {
        let r = as_key(&h, AGENT, args).await.exits(4);
        assert!(
            r.stderr.contains("ROLE_NOT_ALLOWED (PERMISSION_DENIED)"),
            "{args:?}: {r:?}"
        );
        assert!(r.stderr.contains("key_id: cli-agent"), "{r:?}");
        assert!(r.stdout.is_empty(), "{r:?}");
    }
    // The attempt id is required: usage (2), nothing sent.
    for args in [
        &["approval", "approve", &permit, "p-1"][..],
        &["approval", "deny", &permit, "p-1", "--reason", "no"],
        &["approval", "approve", &permit],
    ] {
        let r = as_key(&h, ALICE, args).await.exits(2);
        assert!(r.stdout.is_empty(), "{r:?}");
    }
    // Another attempt's id: ATTEMPT_MISMATCH (4); a key never asked: 3.
    let r = as_key(
        &h,
        ALICE,
        &[
            "approval",
            "approve",
            &permit,
            "p-1",
            "--attempt-id",
            &p2.attempt_id,
        ],
    )
    .await
    .exits(4);
    assert!(r.stderr.contains("ATTEMPT_MISMATCH"), "{r:?}");
    let r = as_key(
        &h,
        ALICE,
        &[
            "approval",
            "approve",
            &permit,
            "never",
            "--attempt-id",
            &p1.attempt_id,
        ],
    )
    .await
    .exits(3);
    assert!(r.stderr.contains("ATTEMPT_NOT_FOUND"), "{r:?}");
    let state = |key: &'static str| {
        let admin = admin.clone();
        let permit = permit.clone();
        async move {
            admin
                .get_attempt(&permit, key)
                .await
                .expect("get")
                .attempt
                .expect("attempt")
        }
    };
    assert_eq!(
        state("p-1").await.state(),
        pb::AttemptState::AwaitingApproval
    );

    // approve: the id as the listing shows it.
    let p1_id = all["attempts"][0]["attemptId"].as_str().expect("id");
    let approved = as_key(
        &h,
        ALICE,
        &["approval", "approve", &permit, "p-1", "--attempt-id", p1_id],
    )
    .await
    .ok();
    assert_eq!(
        approved.stdout.lines().next(),
        Some("approved p-1: APPROVED"),
        "{approved:?}"
    );
    assert_eq!(
        row(&approved.stdout, "approved by"),
        ["cli-alice", "(1", "of", "1)"]
    );
    assert_eq!(
        row(&approved.stdout, "decided by")[..2],
        ["cli-alice", "at"]
    );
    assert_eq!(
        row(&approved.stdout, "summary"),
        ["pay", "5000", "EUR", "to", "DE00"]
    );
    let read = state("p-1").await;
    assert_eq!(read.state(), pb::AttemptState::Approved);
    assert_eq!(read.approval.expect("approval").approved_by, ["cli-alice"]);

    // Four eyes: the first approval leaves it waiting, the second (JSON)
    // approves it.
    let first = as_key(
        &h,
        ALICE,
        &[
            "approval",
            "approve",
            &permit,
            "t-1",
            "--attempt-id",
            &t1.attempt_id,
        ],
    )
    .await
    .ok();
    assert_eq!(
        first.stdout.lines().next(),
        Some("approved t-1: AWAITING_APPROVAL (1 of 2 approvals)"),
        "{first:?}"
    );
    assert_eq!(
        row(&first.stdout, "state"),
        ["AWAITING_APPROVAL", "(1", "of", "2", "approvals)"]
    );
    assert_eq!(
        state("t-1").await.state(),
        pb::AttemptState::AwaitingApproval
    );
    let second = as_key(
        &h,
        BOB,
        &[
            "approval",
            "approve",
            &permit,
            "t-1",
            "--attempt-id",
            &t1.attempt_id,
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(second["attempt"]["state"], "ATTEMPT_STATE_APPROVED");
    assert_eq!(
        second["attempt"]["approval"]["approvedBy"],
        serde_json::json!(["cli-alice", "cli-bob"])
    );
    assert_eq!(state("t-1").await.state(), pb::AttemptState::Approved);

    // deny, with a reason: DENIED, the slot and the cost back.
    let denied = as_key(
        &h,
        BOB,
        &[
            "approval",
            "deny",
            &permit,
            "p-2",
            "--attempt-id",
            &p2.attempt_id,
            "--reason",
            "unknown beneficiary",
        ],
    )
    .await
    .ok();
    assert_eq!(
        denied.stdout.lines().next(),
        Some("denied p-2: DENIED (unknown beneficiary)"),
        "{denied:?}"
    );
    assert_eq!(
        row(&denied.stdout, "denial reason"),
        ["unknown", "beneficiary"]
    );
    assert_eq!(row(&denied.stdout, "TOOL"), ["CALLS", "CAP"]);
    assert!(!denied.stdout.contains('\u{1b}'), "{:?}", denied.stdout);
    let read = state("p-2").await;
    assert_eq!(read.state(), pb::AttemptState::Denied);
    let approval = read.approval.expect("approval");
    assert_eq!(approval.denial_reason, "unknown beneficiary");
    assert_eq!(approval.decided_by, "cli-bob");
    // The denied call replays its denial to the agent.
    let replay = agent
        .authorize(pb::AuthorizeRequest {
            permit_id: permit.clone(),
            tool: "payout".into(),
            idempotency_key: "p-2".into(),
            request_fingerprint: b"payout p-2 2000".to_vec(),
            cost: 2_000,
            holder_token: b"holder".to_vec(),
            ..Default::default()
        })
        .await
        .expect("replay");
    assert_eq!(replay.decision(), pb::Decision::Replay);
    // attempt get shows the decision.
    let got = as_key(&h, ADMIN, &["attempt", "get", &permit, "p-2"])
        .await
        .ok();
    assert_eq!(
        row(&got.stdout, "state"),
        ["DENIED", "(unknown", "beneficiary)"]
    );
    assert_eq!(row(&got.stdout, "decided by")[..2], ["cli-bob", "at"]);
    assert_eq!(
        row(&got.stdout, "approved by"),
        ["nobody", "(0", "of", "1)"]
    );
    assert!(
        got.stdout
            .contains(r#""pay 1 EUR\u{1b}[2J\nFORGED-LINE\u{2028}x""#)
    );
    // ... and, to the agent, a pending call without its attempt id.
    let got = as_key(&h, AGENT, &["attempt", "get", &permit, "p-3"])
        .await
        .ok();
    assert_eq!(
        row(&got.stdout, "state"),
        ["AWAITING_APPROVAL", "(0", "of", "1", "approvals)"]
    );
    assert_eq!(
        row(&got.stdout, "attempt"),
        ["(withheld:", "open", "attempt)"]
    );
    assert_eq!(row(&got.stdout, "approval expires").len(), 1);
    // deny --json, without a reason.
    let json = as_key(
        &h,
        ALICE,
        &[
            "approval",
            "deny",
            &permit,
            "p-3",
            "--attempt-id",
            &p3.attempt_id,
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(json["attempt"]["state"], "ATTEMPT_STATE_DENIED");
    assert_eq!(json["usage"]["tool"], "payout");
    assert_eq!(state("p-3").await.state(), pb::AttemptState::Denied);
    // A decided call cannot be decided otherwise: ATTEMPT_STATE_CONFLICT (4).
    let r = as_key(
        &h,
        ALICE,
        &[
            "approval",
            "approve",
            &permit,
            "p-2",
            "--attempt-id",
            &p2.attempt_id,
        ],
    )
    .await
    .exits(4);
    assert!(r.stderr.contains("ATTEMPT_STATE_CONFLICT"), "{r:?}");
    assert!(r.stderr.contains("state: DENIED"), "{r:?}");

    // Nobody approves their own call: the admin asks, then tries (4).
    let own = ask(admin.clone(), "payout", "own", 3_000, "the admin's own").await;
    let approve_own = [
        "approval",
        "approve",
        &permit,
        "own",
        "--attempt-id",
        &own.attempt_id,
    ];
    let r = as_key(&h, ADMIN, &approve_own).await.exits(4);
    assert!(
        r.stderr
            .contains("APPROVER_IS_REQUESTER (PERMISSION_DENIED)"),
        "{r:?}"
    );
    assert!(r.stderr.contains("idempotency_key: own"), "{r:?}");
    let mut json = approve_own.to_vec();
    json.push("--json");
    let r = as_key(&h, ADMIN, &json).await.exits(4);
    assert_eq!(r.json_error()["reason"], "APPROVER_IS_REQUESTER", "{r:?}");
    assert_eq!(r.json_error()["metadata"]["idempotency_key"], "own");
    assert_eq!(
        state("own").await.state(),
        pb::AttemptState::AwaitingApproval
    );
    // Another key may.
    as_key(&h, ALICE, &approve_own).await.ok();

    let empty = as_key(&h, ALICE, &["approval", "list"]).await.ok();
    assert_eq!(empty.stdout, "no calls await approval\n");
    let json = as_key(&h, ALICE, &["approval", "list", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(json["attempts"], serde_json::json!([]));
}

/// `permit create --approval`: the rules the flags describe, as stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_create_takes_approval_rules() {
    let _machine = shared().await;
    let keys = KeyFile::new(&entry("cli-admin", ADMIN, "acme", "\"admin\""));
    let h = harness_with_keys(Kind::Memory, &keys).await;
    let created = as_key(
        &h,
        ADMIN,
        &[
            "permit",
            "create",
            "--tool",
            "search",
            "--approval",
            "payout=1000",
            "--approval",
            "mcp:bank/transfer",
            "--approval-wait",
            "10m",
            "--approvers",
            "2",
        ],
    )
    .await
    .ok();
    let id = created
        .stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("created permit "))
        .expect("the id first")
        .to_owned();
    assert_eq!(
        row(&created.stdout, "tools"),
        ["search,", "payout,", "mcp:bank/transfer"]
    );
    let rules: Vec<&str> = created
        .stdout
        .lines()
        .filter(|l| l.starts_with("needs approval"))
        .collect();
    assert_eq!(rules.len(), 2, "{}", created.stdout);
    assert!(
        rules[0].ends_with("mcp:bank/transfer: every call, 2 distinct approvers, wait 10m"),
        "{rules:?}"
    );
    let admin = h.client.clone().with_api_key(ADMIN).expect("ascii");
    let permit = admin
        .get_permit(&id)
        .await
        .expect("get")
        .permit
        .expect("permit");
    let payout = &permit.approval_per_tool["payout"];
    assert_eq!(payout.cost_at_least, Some(1000));
    assert_eq!(payout.approvers, 2);
    assert_eq!(payout.wait.map(|d| d.seconds), Some(600));
    assert_eq!(
        permit.approval_per_tool["mcp:bank/transfer"].cost_at_least,
        None
    );
    // Without --approvers: one; JSON shows the rule.
    let json = as_key(
        &h,
        ADMIN,
        &["permit", "create", "--approval", "payout", "--json"],
    )
    .await
    .ok()
    .json();
    assert_eq!(json["approvalPerTool"]["payout"]["approvers"], 1);
    assert_eq!(json["tools"], serde_json::json!(["payout"]));
    // Flags that do not go together, or a rule the server refuses.
    for (args, says) in [
        (
            &["permit", "create", "--tool", "t", "--approvers", "2"][..],
            "--approval",
        ),
        (
            &["permit", "create", "--tool", "t", "--approval-wait", "1m"],
            "--approval",
        ),
        (
            &["permit", "create", "--approval", "t", "--approvers", "3"],
            "3",
        ),
        (&["permit", "create", "--approval", "t=lots"], "not a cost"),
        (&["permit", "create", "--approval", "t=-1"], "cost_at_least"),
    ] {
        let r = as_key(&h, ADMIN, args).await.exits(2);
        assert!(r.stderr.contains(says), "{args:?}: {r:?}");
    }
}

/// A server that is not there: 5, for every command, and the demo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_not_there_is_exit_5() {
    let _machine = shared().await;
    let server = nothing_there();
    let id = uuid::Uuid::now_v7().to_string();
    for args in [
        &["permit", "get", &id][..],
        &["permit", "create", "--tool", "t"],
        &["uncertain", "list"],
        &["uncertain", "resolve", &id, "k", "--failed", "x"],
        &["attempt", "get", &id, "k"],
        &["approval", "list"],
        &["approval", "approve", &id, "k", "--attempt-id", &id],
        &["approval", "deny", &id, "k", "--attempt-id", &id],
        &["demo"],
    ] {
        let mut all = args.to_vec();
        all.extend(["--server", server.as_str(), "--timeout", "5s"]);
        let r = atmost(&all, &[]).await.exits(5);
        assert!(r.stderr.contains("cannot connect to"), "{args:?}: {r:?}");
    }
    let r = atmost(
        &["attempt", "get", &id, "k", "--server", &server, "--json"],
        &[],
    )
    .await
    .exits(5);
    assert_eq!(r.json_error()["code"], "UNAVAILABLE", "{r:?}");
}

/// TLS: the server's certificate checked against --tls-ca, under the
/// name --tls-server-name gives; a client certificate stands in for a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_a_client_certificate() {
    let _machine = shared().await;
    let pki = Pki::new();
    let server_cert = pki.issue(&["localhost"]);
    let runner = pki.issue(&["spiffe://test/ns/agents/sa/runner"]);
    let keys = KeyFile::new(&format!(
        "{}[[cert]]\nid = \"runner\"\nsan = \"spiffe://test/ns/agents/sa/runner\"\ntenant = \"acme\"\nroles = [\"agent\"]\n",
        entry("cli-admin", ADMIN, "acme", "\"admin\"")
    ));
    let file = |name: &str, text: &str| keys.beside(name, text);
    let (cert, key, ca) = (
        file("server.pem", &server_cert.0),
        file("server.key", &server_cert.1),
        file("ca.pem", &pki.ca_pem),
    );
    let (runner_cert, runner_key) = (file("runner.pem", &runner.0), file("runner.key", &runner.1));
    let process = spawn_atmost(&[
        "--auth-keys",
        keys.path.to_str().expect("utf-8"),
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    let server = format!("https://{}", process.addr());
    let tls = [
        "--server",
        server.as_str(),
        "--tls-ca",
        &ca,
        "--tls-server-name",
        "localhost",
    ];
    let mut args = vec![
        "permit",
        "create",
        "--tool",
        "t",
        "--api-key",
        ADMIN,
        "--json",
    ];
    args.extend(tls);
    let id = atmost(&args, &[]).await.ok().json()["permitId"]
        .as_str()
        .expect("id")
        .to_owned();
    // The client certificate of an agent: it may read the permit, not
    // revoke it.
    let mut args = vec![
        "permit",
        "get",
        &id,
        "--tls-cert",
        &runner_cert,
        "--tls-key",
        &runner_key,
    ];
    args.extend(tls);
    atmost(&args, &[]).await.ok();
    let mut args = vec![
        "permit",
        "revoke",
        &id,
        "--tls-cert",
        &runner_cert,
        "--tls-key",
        &runner_key,
    ];
    args.extend(tls);
    let r = atmost(&args, &[]).await.exits(4);
    assert!(r.stderr.contains("key_id: runner"), "{r:?}");
    // The system's trust store does not know this CA: no connection (5).
    let r = atmost(
        &[
            "permit",
            "get",
            &id,
            "--server",
            &server,
            "--api-key",
            ADMIN,
            "--tls-server-name",
            "localhost",
        ],
        &[],
    )
    .await
    .exits(5);
    assert!(r.stderr.contains("cannot connect to"), "{r:?}");
    // TLS flags with a plaintext URL, or a CA file that is not there: usage.
    let plain = format!("http://{}", process.addr());
    atmost(
        &["permit", "get", &id, "--server", &plain, "--tls-ca", &ca],
        &[],
    )
    .await
    .exits(2);
    atmost(
        &[
            "permit",
            "get",
            &id,
            "--server",
            &server,
            "--tls-ca",
            "/nonexistent/ca.pem",
        ],
        &[],
    )
    .await
    .exits(2);
    // A certificate without its key: usage (clap's).
    atmost(
        &[
            "permit",
            "get",
            &id,
            "--server",
            &server,
            "--tls-cert",
            &runner_cert,
        ],
        &[],
    )
    .await
    .exits(2);
}

// === the demo ===

/// The names and answers of the story's steps, in order.
const STORY: [(&str, &str); 8] = [
    ("create_permit", "ACTIVE"),
    ("authorize", "DISPATCH"),
    ("mark_uncertain", "UNCERTAIN"),
    (
        "retry_new_key",
        "PERMIT_MAX_CALLS_EXCEEDED (tool=wallet.charge, limit=1, calls_made=1)",
    ),
    ("retry_same_key", "REPLAY UNCERTAIN"),
    (
        "list_uncertain",
        "charge-1 UNCERTAIN (client deadline exceeded)",
    ),
    ("resolve", "SUCCEEDED"),
    ("replay_receipt", "REPLAY SUCCEEDED, receipt"),
];

/// The demo's JSON lines, each checked against the story: every step ok,
/// its answer the one the story has.
fn story_lines(r: &Run) -> Vec<serde_json::Value> {
    let lines: Vec<serde_json::Value> = r
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert_eq!(lines.len(), STORY.len(), "{r:?}");
    for (i, (line, (name, got))) in lines.iter().zip(STORY).enumerate() {
        assert_eq!(line["step"], i + 1, "{line}");
        assert_eq!(line["name"], name, "{line}");
        assert_eq!(line["ok"], true, "{line}");
        assert_eq!(line["expect"], line["got"], "{line}");
        let said = line["got"].as_str().expect("got");
        assert!(said.starts_with(got), "step {name}: {said:?}, not {got:?}");
    }
    let receipt = lines[6]["detail"]["receiptId"].as_str().expect("receipt");
    assert_eq!(
        lines[7]["got"],
        format!("REPLAY SUCCEEDED, receipt {receipt}: wallet tx 981")
    );
    assert_eq!(
        lines[3]["detail"]["metadata"],
        serde_json::json!({"tool": "wallet.charge", "limit": "1", "calls_made": "1"})
    );
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_plays_the_story_on_a_server_of_its_own() {
    let _machine = shared().await;
    story_lines(&atmost(&["demo", "--json"], &[]).await.ok());
    // ATMOST_SERVER is not the demo's: it still runs its own.
    let r = atmost(&["demo"], &[("ATMOST_SERVER", &nothing_there())])
        .await
        .ok();
    for line in [
        "   CreatePermit -> ACTIVE (permit ",
        "   Authorize -> DISPATCH (attempt ",
        "   MarkUncertain -> UNCERTAIN",
        "   Authorize -> PERMIT_MAX_CALLS_EXCEEDED (tool=wallet.charge, limit=1, calls_made=1)",
        "   Authorize -> REPLAY UNCERTAIN",
        "   ListUncertain -> charge-1 UNCERTAIN (client deadline exceeded)",
        "   Resolve -> SUCCEEDED",
        "   Authorize -> REPLAY SUCCEEDED, receipt ",
        "Every step got the answer the story expects",
    ] {
        assert!(
            r.stdout.lines().any(|l| l.starts_with(line)),
            "no line {line:?} in\n{}",
            r.stdout
        );
    }
    assert!(r.stdout.contains("in this process"), "{}", r.stdout);
    assert!(!r.stdout.contains("NOT AS EXPECTED"), "{}", r.stdout);
}

async fn the_demo_against_a_server_leaves_what_the_story_says(kind: Kind) {
    let h = Harness::start(kind).await;
    let r = on(&h, &["demo", "--json"]).await.ok();
    let lines = story_lines(&r);
    // The server holds what the story says: one charge, settled.
    let permit = lines[0]["detail"]["permitId"].as_str().expect("permit");
    let got = h.get(permit).await.expect("get");
    assert_eq!(got.usage[0].calls_made, 1);
    assert_eq!((got.budget_committed, got.budget_reserved), (500, 0));
    let attempt = h
        .client
        .get_attempt(permit, "charge-1")
        .await
        .expect("get")
        .attempt
        .expect("a");
    assert_eq!(attempt.state(), pb::AttemptState::Succeeded);
    assert_eq!(
        attempt.receipt.expect("receipt").result,
        b"wallet tx 981".to_vec()
    );
    expect_error(
        h.client.get_attempt(permit, "charge-2").await,
        tonic::Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    // The human telling against the same server: the key lines.
    let r = on(&h, &["demo"]).await.ok();
    assert!(
        r.stdout.contains(&format!("against http://{}", h.addr)),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(
            "Authorize -> PERMIT_MAX_CALLS_EXCEEDED (tool=wallet.charge, limit=1, calls_made=1)"
        ),
        "{}",
        r.stdout
    );
}

/// A server whose answers are not the story's: the demo says which step
/// went otherwise and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_story_that_goes_otherwise_exits_1() {
    let _machine = shared().await;
    // Permits may live 30 minutes: the story's hour is refused.
    let process = spawn_atmost(&["--max-permit-lifetime", "30m"]);
    let server = format!("http://{}", process.addr());
    let r = atmost(&["demo", "--server", &server, "--json"], &[])
        .await
        .exits(1);
    let line: serde_json::Value = serde_json::from_str(r.stdout.trim()).expect("one line");
    assert_eq!(line["name"], "create_permit");
    assert_eq!(line["ok"], false);
    assert_eq!(line["got"], "QUOTA_PERMIT_LIFETIME");
    let r = atmost(&["demo", "--server", &server], &[]).await.exits(1);
    assert!(
        r.stdout
            .contains("NOT AS EXPECTED: the story expects ACTIVE"),
        "{r:?}"
    );
    assert!(
        r.stderr
            .contains("step 1 (create_permit) got QUOTA_PERMIT_LIFETIME"),
        "{r:?}"
    );
}
