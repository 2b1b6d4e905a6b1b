//! The cross-client test: the scripted situations of
//! clients/testdata/guarded_situations.json run through the Rust, Python
//! and Node clients' guarded calls against one live atmost (per store), and
//! each runner's answers compared with the file's expectations (the
//! contract of docs/clients.md) and with the other runners'.
//!
//! For each store (memory, then Redis) it starts one `atmost serve` with
//! API keys (the testkit's [`AtmostProcess`]), creates a permit per
//! situation per language (languages never share a permit or an API key),
//! runs the three runners at once, each with a facts file (the address, its
//! key, a wrong key, a closed port, its permits), then reads every
//! attempt's recorded state back with GetAttempt. A runner that cannot be
//! started, exits non-zero or leaves a situation out fails its situations:
//! nothing is skipped. The last line is `cross client: N passed, M failed`
//! (one check per situation per language, plus one per situation for the
//! languages agreeing); any failure exits 1.
//!
//! Run by scripts/cross_client.sh, which names every part:
//!
//! ```text
//! cross_client --situations FILE --atmost BIN --rust RUNNER
//!     --python PYTHON RUNNER.py --node NODE RUNNER.js [--store memory|redis|both]
//! ```

use atmost_client::{Client, NewPermit};
use atmost_testkit::{AtmostProcess, Redis};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LANGUAGES: [&str; 3] = ["rust", "python", "node"];
const ADMIN: &str = "cross-admin-0123456789abcdef";
const WRONG_KEY: &str = "not-a-key-atmost-knows";
/// A hang guard only: a runner still going after this is killed and fails.
const RUNNER_LIMIT: Duration = Duration::from_secs(300);

/// How to run one language's runner: the command before its two arguments.
struct Runner {
    language: &'static str,
    command: Vec<String>,
}

struct Args {
    situations: PathBuf,
    atmost: PathBuf,
    runners: Vec<Runner>,
    stores: Vec<&'static str>,
}

fn usage(why: &str) -> ! {
    eprintln!(
        "cross_client: {why}\nusage: cross_client --situations FILE --atmost BIN --rust RUNNER \
         --python PYTHON RUNNER.py --node NODE RUNNER.js [--store memory|redis|both]"
    );
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut args = std::env::args().skip(1);
    let (mut situations, mut atmost, mut stores) = (None, None, vec!["memory", "redis"]);
    let mut runners: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let value = |args: &mut dyn Iterator<Item = String>, flag: &str| {
        args.next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
    };
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--situations" => situations = Some(PathBuf::from(value(&mut args, &flag))),
            "--atmost" => atmost = Some(PathBuf::from(value(&mut args, &flag))),
            "--rust" => {
                runners.insert("rust", vec![value(&mut args, &flag)]);
            }
            "--python" | "--node" => {
                let command = vec![value(&mut args, &flag), value(&mut args, &flag)];
                runners.insert(if flag == "--python" { "python" } else { "node" }, command);
            }
            "--store" => {
                stores = match value(&mut args, &flag).as_str() {
                    "memory" => vec!["memory"],
                    "redis" => vec!["redis"],
                    "both" => vec!["memory", "redis"],
                    other => usage(&format!("unknown store {other}")),
                }
            }
            other => usage(&format!("unknown argument {other}")),
        }
    }
    let runners = LANGUAGES
        .iter()
        .map(|&language| Runner {
            language,
            command: runners
                .remove(language)
                .unwrap_or_else(|| usage(&format!("no runner for {language}: --{language}"))),
        })
        .collect();
    Args {
        situations: situations.unwrap_or_else(|| usage("no --situations")),
        atmost: atmost.unwrap_or_else(|| usage("no --atmost")),
        runners,
        stores,
    }
}

fn main() {
    let args = parse_args();
    let text = std::fs::read_to_string(&args.situations)
        .unwrap_or_else(|e| usage(&format!("read {}: {e}", args.situations.display())));
    let file: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| usage(&format!("parse {}: {e}", args.situations.display())));
    if let Err(why) = check_file(&file) {
        usage(&format!("{}: {why}", args.situations.display()));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut tally = Tally::default();
    for store in &args.stores {
        runtime.block_on(run_store(store, &args, &file, &mut tally));
    }
    println!(
        "cross client: {} passed, {} failed",
        tally.passed, tally.failed
    );
    if tally.failed > 0 || tally.passed == 0 {
        std::process::exit(1);
    }
}

#[derive(Default)]
struct Tally {
    passed: u32,
    failed: u32,
}

impl Tally {
    fn count(&mut self, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }
}

/// The file says what the harness needs: every expectation names the
/// fields every call is compared on, and recorded keys are keys called.
fn check_file(file: &Value) -> Result<(), String> {
    file["tool"].as_str().ok_or("no tool")?;
    let situations = file["situations"].as_array().ok_or("no situations")?;
    let mut names = std::collections::BTreeSet::new();
    for s in situations {
        let name = s["name"].as_str().ok_or("a situation without a name")?;
        if !names.insert(name) {
            return Err(format!("{name} twice"));
        }
        if let Some(languages) = s["languages"].as_array()
            && (languages.is_empty() || languages.iter().any(|l| !LANGUAGES.iter().any(|k| l == k)))
        {
            return Err(format!("{name}: languages are some of {LANGUAGES:?}"));
        }
        let calls = s["calls"].as_array().ok_or(format!("{name}: no calls"))?;
        for call in calls {
            for field in ["kind", "reason", "replayed", "dispatched"] {
                if call["expect"].get(field).is_none() {
                    return Err(format!("{name}: a call expects no {field}"));
                }
            }
        }
        for key in s["recorded"]
            .as_object()
            .ok_or(format!("{name}: no recorded"))?
            .keys()
        {
            if !calls.iter().any(|c| c["key"] == key.as_str()) {
                return Err(format!("{name}: recorded {key} is no call's key"));
            }
        }
    }
    Ok(())
}

fn applies(situation: &Value, language: &str) -> bool {
    situation["languages"]
        .as_array()
        .is_none_or(|l| l.iter().any(|l| l == language))
}

fn agent_key(language: &str) -> String {
    format!("cross-agent-{language}-0123456789abcdef")
}

fn key_entry(id: &str, key: &str, role: &str) -> String {
    let sha: String = Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "[[key]]\nid = \"{id}\"\nsha256 = \"{sha}\"\ntenant = \"acme\"\nroles = [\"{role}\"]\n\n"
    )
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn run_store(store: &str, args: &Args, file: &Value, tally: &mut Tally) {
    let dir = Scratch(
        std::env::temp_dir().join(format!("atmost-cross-{}", uuid::Uuid::now_v7().simple())),
    );
    std::fs::create_dir_all(&dir.0).expect("a scratch directory");
    let keys = dir.0.join("keys.toml");
    let mut entries = key_entry("cross-admin", ADMIN, "admin");
    for language in LANGUAGES {
        entries += &key_entry(&format!("cross-{language}"), &agent_key(language), "agent");
    }
    std::fs::write(&keys, entries).expect("write the key file");
    let redis = (store == "redis").then(Redis::start);
    let mut serve = vec![
        "--auth-keys".to_owned(),
        keys.to_str().expect("a UTF-8 path").to_owned(),
    ];
    if let Some(redis) = &redis {
        serve.extend(redis.serve_args());
    }
    let server = AtmostProcess::spawn(&args.atmost, &serve)
        .unwrap_or_else(|e| panic!("start {}: {e}", args.atmost.display()));
    let address = server.addr().to_string();
    let admin = Client::builder(&address)
        .api_key(ADMIN)
        .connect()
        .await
        .expect("the admin's client");
    let tool = file["tool"].as_str().expect("checked");
    let situations = file["situations"].as_array().expect("checked");
    // A port nothing listens on (free when asked).
    let unreachable = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a loopback port")
        .to_string();

    // Permits, per language per situation, and each runner's facts.
    let mut permits: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
    let mut children: Vec<(&'static str, std::io::Result<Child>, PathBuf, PathBuf)> = Vec::new();
    for runner in &args.runners {
        let mut mine = BTreeMap::new();
        for s in situations.iter().filter(|s| applies(s, runner.language)) {
            let name = s["name"].as_str().expect("checked").to_owned();
            let id = match &s["permit"] {
                Value::String(unknown) if unknown == "unknown" => uuid::Uuid::now_v7().to_string(),
                permit => create_permit(&admin, tool, permit).await,
            };
            mine.insert(name, id);
        }
        let facts = json!({
            "address": address,
            "api_key": agent_key(runner.language),
            "wrong_api_key": WRONG_KEY,
            "unreachable_address": unreachable,
            "permits": mine,
        });
        let facts_path = dir.0.join(format!("facts-{}.json", runner.language));
        std::fs::write(&facts_path, facts.to_string()).expect("write facts");
        let (out, err) = (
            dir.0.join(format!("{}.out", runner.language)),
            dir.0.join(format!("{}.err", runner.language)),
        );
        let child = spawn_runner(runner, &args.situations, &facts_path, &out, &err);
        permits.insert(runner.language, mine);
        children.push((runner.language, child, out, err));
    }

    // The three at once; each one's lines by situation.
    let mut lines: BTreeMap<&str, BTreeMap<String, Value>> = BTreeMap::new();
    let mut trouble: BTreeMap<&str, String> = BTreeMap::new();
    let deadline = Instant::now() + RUNNER_LIMIT;
    for (language, child, out, err) in children {
        let status = match child {
            Err(e) => Err(format!("could not be started: {e}")),
            Ok(mut child) => wait(&mut child, deadline),
        };
        let stdout = std::fs::read_to_string(&out).unwrap_or_default();
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        let mut seen = BTreeMap::new();
        let mut bad = Vec::new();
        for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Value>(line) {
                Ok(v) if v["language"] == language && v["situation"].is_string() => {
                    seen.insert(v["situation"].as_str().expect("a string").to_owned(), v);
                }
                _ => bad.push(format!("not a situation's line: {line}")),
            }
        }
        if let Err(why) = status {
            bad.push(why);
        }
        if !bad.is_empty() {
            trouble.insert(
                language,
                format!(
                    "{}\n    its stderr:\n{}",
                    bad.join("\n    "),
                    indent(&stderr, 6)
                ),
            );
        }
        lines.insert(language, seen);
    }
    for (language, why) in &trouble {
        println!("cross client [{store}] the {language} runner: {why}");
        tally.count(false);
    }

    for s in situations {
        let name = s["name"].as_str().expect("checked");
        let mut verdicts = Vec::new();
        let mut notes = Vec::new();
        let mut seen: Vec<(&str, Option<Value>)> = Vec::new();
        for runner in &args.runners {
            let language = runner.language;
            if !applies(s, language) {
                continue;
            }
            let recorded = read_recorded(&admin, &permits[language][name], s).await;
            let line = lines[language].get(name);
            let problems = match line {
                None => vec!["printed no line for it".to_owned()],
                Some(line) => compare(s, line, &recorded),
            };
            verdicts.push(format!(
                "{language} {}",
                if problems.is_empty() { "ok" } else { "FAILED" }
            ));
            notes.extend(problems.iter().map(|p| format!("{language}: {p}")));
            tally.count(problems.is_empty());
            seen.push((language, line.map(|l| projection(l, &recorded))));
        }
        let agree = seen.iter().all(|(_, p)| match (p, &seen[0].1) {
            (Some(p), Some(first)) => same(p, first),
            _ => false,
        });
        tally.count(agree);
        if !agree {
            for (language, p) in &seen {
                let shown = p.as_ref().map_or("(no line)".to_owned(), Value::to_string);
                notes.push(format!("{language} saw {shown}"));
            }
        }
        println!(
            "cross client [{store}] {name}: {}; {}",
            verdicts.join(", "),
            if agree { "they agree" } else { "they DIFFER" }
        );
        for note in notes {
            println!("    {note}");
        }
    }
    drop(server);
    drop(redis);
}

/// The attempt of each key the situation names, as atmost recorded it.
async fn read_recorded(
    admin: &Client,
    permit_id: &str,
    situation: &Value,
) -> BTreeMap<String, Value> {
    let mut recorded = BTreeMap::new();
    for key in situation["recorded"].as_object().expect("checked").keys() {
        let seen = match admin.get_attempt(permit_id, key).await {
            Ok(answer) => match answer.attempt {
                Some(attempt) => {
                    let mut state = attempt
                        .state()
                        .as_str_name()
                        .trim_start_matches("ATTEMPT_STATE_")
                        .to_owned();
                    if state == "UNCERTAIN" && attempt.uncertain_reason == "lease_expired" {
                        state = "UNCERTAIN(lease_expired)".to_owned();
                    }
                    let mut seen = json!({"state": state, "cost": attempt.cost});
                    if let Some(receipt) = &attempt.receipt {
                        seen["cost"] = json!(receipt.cost);
                        seen["result"] = serde_json::from_slice(&receipt.result).unwrap_or_else(
                            |_| json!({"$bytes": String::from_utf8_lossy(&receipt.result)}),
                        );
                    }
                    if !attempt.failure_reason.is_empty() {
                        seen["failure_reason"] = json!(attempt.failure_reason);
                    }
                    seen
                }
                None => json!({"state": "error:GetAttempt answered no attempt"}),
            },
            Err(e) => match e.reason_name() {
                Some("ATTEMPT_NOT_FOUND" | "PERMIT_NOT_FOUND") => json!({"state": "none"}),
                _ => json!({"state": format!("error:{}", e.reason_or_code())}),
            },
        };
        recorded.insert(key.clone(), seen);
    }
    recorded
}

/// Where a runner's line differs from the situation's expectations.
fn compare(situation: &Value, line: &Value, recorded: &BTreeMap<String, Value>) -> Vec<String> {
    let mut problems = Vec::new();
    let calls = situation["calls"].as_array().expect("checked");
    let seen = line["calls"].as_array().map_or(&[][..], Vec::as_slice);
    if seen.len() != calls.len() {
        problems.push(format!(
            "{} calls reported, {} made",
            seen.len(),
            calls.len()
        ));
    }
    for (i, (call, got)) in calls.iter().zip(seen).enumerate() {
        let mut wrong = Vec::new();
        for (field, want) in call["expect"].as_object().expect("checked") {
            if field == "message_contains" {
                let message = got["message"].as_str().unwrap_or("");
                if !message.contains(want.as_str().unwrap_or_default()) {
                    wrong.push(format!("the message does not name {want}"));
                }
                continue;
            }
            let value = got.get(field).unwrap_or(&Value::Null);
            if !same(want, value) {
                wrong.push(format!("{field} {value}, expected {want}"));
            }
        }
        if !wrong.is_empty() {
            let message = got["message"]
                .as_str()
                .map_or(String::new(), |m| format!(" ({m})"));
            problems.push(format!("call {}: {}{message}", i + 1, wrong.join(", ")));
        }
    }
    for (key, want) in situation["recorded"].as_object().expect("checked") {
        let got = &recorded[key];
        for (field, w) in want.as_object().into_iter().flatten() {
            let value = got.get(field).unwrap_or(&Value::Null);
            if !same(w, value) {
                problems.push(format!("recorded {key}: {field} {value}, expected {w}"));
            }
        }
    }
    problems
}

/// What the languages must agree on, beyond the expectations: each call's
/// kind, reasons, counts, costs and (of a REPLAY) the stored result, and
/// what atmost recorded.
fn projection(line: &Value, recorded: &BTreeMap<String, Value>) -> Value {
    const FIELDS: [&str; 8] = [
        "kind",
        "reason",
        "failure_reason",
        "replayed",
        "dispatched",
        "as_dispatched",
        "receipt_cost",
        "unrecorded",
    ];
    let calls: Vec<Value> = line["calls"]
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|call| {
            let mut p: serde_json::Map<String, Value> = FIELDS
                .iter()
                .filter_map(|f| call.get(*f).map(|v| (f.to_string(), v.clone())))
                .collect();
            if call["replayed"] == true {
                p.insert("result".into(), call["result"].clone());
            }
            Value::Object(p)
        })
        .collect();
    json!({"calls": calls, "recorded": recorded})
}

/// JSON equality, numbers by value (1 and 1.0 are the same number).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

fn indent(text: &str, by: usize) -> String {
    let pad = " ".repeat(by);
    text.lines()
        .map(|l| format!("{pad}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn create_permit(admin: &Client, tool: &str, permit: &Value) -> String {
    let mut new = NewPermit::new([tool]);
    if let Some(cap) = permit["cap"].as_u64() {
        new = new.cap(tool, cap);
    }
    if let Some(budget) = permit["budget"].as_i64() {
        new = new.budget(budget);
    }
    if let Some(ms) = permit["lease_ms"].as_u64() {
        new = new.lease(Duration::from_millis(ms));
    }
    admin
        .create_permit(new)
        .await
        .unwrap_or_else(|e| panic!("create a permit {permit}: {e}"))
        .permit_id
}

fn spawn_runner(
    runner: &Runner,
    situations: &Path,
    facts: &Path,
    out: &Path,
    err: &Path,
) -> std::io::Result<Child> {
    let (program, rest) = runner.command.split_first().expect("a command");
    Command::new(program)
        .args(rest)
        .arg(situations)
        .arg(facts)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(out)?)
        .stderr(std::fs::File::create(err)?)
        .spawn()
}

/// Waits for a runner until `deadline` (then kills it): Ok on exit 0.
fn wait(child: &mut Child, deadline: Instant) -> Result<(), String> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("exited with {status}")),
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("still running after {RUNNER_LIMIT:?}: killed"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("cannot wait for it: {e}")),
        }
    }
}
