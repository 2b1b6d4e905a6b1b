//! `atmost demo`: the timeout-then-new-key story of docs/api.md ("Worked
//! example"), played against a real atmost, step by step.
//!
//! The story is told once, in [`story`]: each step says what happens, makes
//! its call, and states the answer the story expects. A [`Teller`] only
//! formats it: narration for people, or one JSON line per step for
//! machines. Exit 0 only when every step got the answer expected.

use super::{Credentials, Failure, connect, show};
use atmost::store::{Backend, memory::MemoryStore};
use atmost_client::{Client, NewPermit, pb};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Play against this atmost (http://HOST:PORT, or https://) instead of
    /// one started in this process on the memory store. With --auth-keys
    /// there, the key needs the admin role: the story creates a permit,
    /// authorizes and resolves. (ATMOST_SERVER is not read: without this
    /// flag the demo never touches a real deployment.)
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    #[command(flatten)]
    pub credentials: Credentials,
    /// One JSON line per step: step, name, rpc, expect, got, ok, detail.
    #[arg(long)]
    pub json: bool,
    /// Wait this long before each call, to read along (e.g. 3s).
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub pace: Duration,
}

pub async fn run(args: DemoArgs) -> Result<(), Failure> {
    match &args.server {
        Some(server) => {
            let client = connect(server, &args.credentials).await?;
            story(&client, &mut teller(&args, server)).await
        }
        None => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| Failure::Connect(format!("cannot listen on 127.0.0.1: {e}")))?;
            let addr = listener
                .local_addr()
                .map_err(|e| Failure::Connect(e.to_string()))?;
            let app = atmost::App::new(Backend::Memory(MemoryStore::new(24 * 3_600_000)));
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(atmost::run(listener, app, async {
                let _ = stopped.await;
            }));
            let client = connect(&format!("http://{addr}"), &args.credentials).await?;
            let about = format!("an atmost in this process on {addr}, memory store");
            let told = story(&client, &mut teller(&args, &about)).await;
            drop(client);
            let _ = stop.send(());
            // The server's end is not the story's: it is not waited for
            // past a moment.
            let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
            told
        }
    }
}

fn teller(args: &DemoArgs, server: &str) -> Teller {
    Teller {
        json: args.json,
        pace: args.pace,
        server: server.to_owned(),
        n: 0,
    }
}

/// One step as told: what it did, the answer the story expects, and the
/// answer it got.
struct Step {
    name: &'static str,
    rpc: &'static str,
    expect: String,
    got: String,
    /// Ids and metadata the answer carried, for machines.
    detail: serde_json::Value,
    /// The id people want to see beside the answer (a permit's, an
    /// attempt's), if any.
    id: Option<String>,
}

const TOOL: &str = "wallet.charge";
const COST: i64 = 500;

/// The story: docs/api.md, "Worked example: the timeout, then a new key".
async fn story(client: &Client, t: &mut Teller) -> Result<(), Failure> {
    t.open();
    // The request the agent means to send; its fingerprint binds the key.
    let fingerprint =
        Sha256::digest(br#"{"amount":500,"currency":"EUR","wallet":"w-42"}"#).to_vec();
    let authorize = |permit: &str, key: &str| pb::AuthorizeRequest {
        permit_id: permit.into(),
        tool: TOOL.into(),
        idempotency_key: key.into(),
        request_fingerprint: fingerprint.clone(),
        cost: COST,
        holder_token: Vec::new(),
        ..Default::default()
    };

    t.says(
        "An agent may charge a customer's wallet once. The platform gives it a\n\
         permit: wallet.charge capped at 1 call, a budget of 500 EUR, for an hour.",
    )
    .await;
    let permit = client
        .create_permit(
            NewPermit::new([TOOL])
                .subject("demo agent")
                .cap(TOOL, 1)
                .budget(COST)
                .currency("EUR"),
        )
        .await;
    let permit_id = permit
        .as_ref()
        .map_or(String::new(), |p| p.permit_id.clone());
    t.step(Step {
        name: "create_permit",
        rpc: "CreatePermit",
        expect: "ACTIVE".into(),
        got: answer(&permit, |p| {
            show::enum_name(p.status().as_str_name(), "PERMIT_STATUS_")
        })?,
        detail: json!({ "permitId": permit_id }),
        id: Some(format!("permit {permit_id}")),
    })?;

    t.says(
        "Before charging, the agent asks atmost: Authorize wallet.charge, 500 EUR,\n\
         idempotency key charge-1.",
    )
    .await;
    let first = client.authorize(authorize(&permit_id, "charge-1")).await;
    let attempt = first
        .as_ref()
        .ok()
        .and_then(|r| r.attempt.clone())
        .unwrap_or_default();
    t.step(Step {
        name: "authorize",
        rpc: "Authorize",
        expect: "DISPATCH".into(),
        got: answer(&first, decision)?,
        detail: json!({ "attemptId": attempt.attempt_id, "key": "charge-1" }),
        id: Some(format!("attempt {}", attempt.attempt_id)),
    })?;

    t.says(
        "DISPATCH: the agent sends the charge to the wallet... and the response is\n\
         lost (its client deadline passes). It cannot know whether the wallet was\n\
         charged, so it says so: MarkUncertain. The slot and the 500 stay held.",
    )
    .await;
    let marked = client
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit_id.clone(),
            idempotency_key: "charge-1".into(),
            attempt_id: attempt.attempt_id.clone(),
            reason: "client deadline exceeded".into(),
        })
        .await;
    t.step(Step {
        name: "mark_uncertain",
        rpc: "MarkUncertain",
        expect: "UNCERTAIN".into(),
        got: answer(&marked, |r| {
            r.attempt.as_ref().map_or("no attempt".into(), show::state)
        })?,
        detail: json!({ "attemptId": attempt.attempt_id, "key": "charge-1" }),
        id: None,
    })?;

    t.says(
        "The agent loop sees a failure and retries, as loops do, with a NEW key:\n\
         charge-2. A new key is a new intent, counted against the cap before\n\
         anything is sent.",
    )
    .await;
    let retry = client.authorize(authorize(&permit_id, "charge-2")).await;
    let metadata = retry
        .as_ref()
        .err()
        .map(atmost_client::Error::metadata)
        .unwrap_or_default();
    t.step(Step {
        name: "retry_new_key",
        rpc: "Authorize",
        expect: "PERMIT_MAX_CALLS_EXCEEDED (tool=wallet.charge, limit=1, calls_made=1)".into(),
        got: answer(&retry, decision)?,
        detail: json!({ "key": "charge-2", "metadata": metadata }),
        id: None,
    })?;

    t.says(
        "No second charge. Retried with the same key, charge-1, atmost replays\n\
         what it knows: the same unknown, nothing to send.",
    )
    .await;
    let same = client.authorize(authorize(&permit_id, "charge-1")).await;
    t.step(Step {
        name: "retry_same_key",
        rpc: "Authorize",
        expect: "REPLAY UNCERTAIN".into(),
        got: answer(&same, decision)?,
        detail: json!({ "key": "charge-1" }),
        id: None,
    })?;

    t.says("An operator (or a reconciler) lists what is uncertain under the permit.")
        .await;
    let listed = client.list_all_uncertain(&permit_id, 100).await;
    t.step(Step {
        name: "list_uncertain",
        rpc: "ListUncertain",
        expect: "charge-1 UNCERTAIN (client deadline exceeded)".into(),
        got: answer(&listed, |attempts| {
            let each: Vec<String> = attempts
                .iter()
                .map(|a| {
                    format!(
                        "{} {} ({})",
                        a.idempotency_key,
                        show::state(a),
                        a.uncertain_reason
                    )
                })
                .collect();
            if each.is_empty() {
                "nothing".into()
            } else {
                each.join(", ")
            }
        })?,
        detail: json!({
            "attemptIds": listed.as_ref().map_or(Vec::new(), |l| {
                l.iter().map(|a| a.attempt_id.clone()).collect::<Vec<_>>()
            })
        }),
        id: None,
    })?;

    t.says(
        "The operator asks the wallet's provider about charge-1: it went through,\n\
         as transaction 981. Resolve: Succeeded, with that result.",
    )
    .await;
    let resolved = client
        .resolve(pb::ResolveRequest {
            permit_id: permit_id.clone(),
            idempotency_key: "charge-1".into(),
            attempt_id: attempt.attempt_id.clone(),
            outcome: Some(pb::resolve_request::Outcome::Succeeded(pb::Succeeded {
                result: b"wallet tx 981".to_vec(),
                actual_cost: None,
            })),
        })
        .await;
    let receipt_id = resolved
        .as_ref()
        .ok()
        .and_then(|r| r.attempt.as_ref())
        .and_then(|a| a.receipt.as_ref())
        .map(|r| r.receipt_id.clone())
        .unwrap_or_default();
    t.step(Step {
        name: "resolve",
        rpc: "Resolve",
        expect: "SUCCEEDED".into(),
        got: answer(&resolved, |r| {
            r.attempt.as_ref().map_or("no attempt".into(), show::state)
        })?,
        detail: json!({ "receiptId": receipt_id }),
        id: None,
    })?;

    t.says(
        "From now on, the same key replays the receipt: whoever retries charge-1\n\
         learns it succeeded, and nothing is sent again.",
    )
    .await;
    let last = client.authorize(authorize(&permit_id, "charge-1")).await;
    t.step(Step {
        name: "replay_receipt",
        rpc: "Authorize",
        expect: format!("REPLAY SUCCEEDED, receipt {receipt_id}: wallet tx 981"),
        got: answer(&last, |r| {
            let receipt = r.attempt.as_ref().and_then(|a| a.receipt.clone());
            match receipt {
                Some(rc) => format!(
                    "{}, receipt {}: {}",
                    decision(r),
                    rc.receipt_id,
                    show::bytes(&rc.result)
                ),
                None => decision(r),
            }
        })?,
        detail: json!({ "receiptId": receipt_id }),
        id: None,
    })?;
    t.close();
    Ok(())
}

/// What an answer says, for comparing with the story's expectation: the
/// decision (and a replay's state), or the error's reason (with a cap's
/// metadata). A server that cannot be reached (exit 5), or a key it does
/// not take (exit 4), ends the story: no step has an answer to compare.
fn answer<T>(
    result: &Result<T, atmost_client::Error>,
    said: impl Fn(&T) -> String,
) -> Result<String, Failure> {
    use atmost_client::Reason;
    match result {
        Ok(value) => Ok(said(value)),
        Err(e)
            if Failure::Rpc(e.clone()).exit_code() == 5
                || matches!(
                    e.reason(),
                    Some(Reason::Unauthenticated | Reason::RoleNotAllowed)
                ) =>
        {
            Err(Failure::Rpc(e.clone()))
        }
        Err(e) => {
            let m = e.metadata();
            Ok(match e.reason_name() {
                Some("PERMIT_MAX_CALLS_EXCEEDED") => format!(
                    "PERMIT_MAX_CALLS_EXCEEDED (tool={}, limit={}, calls_made={})",
                    m.get("tool").map_or("", String::as_str),
                    m.get("limit").map_or("", String::as_str),
                    m.get("calls_made").map_or("", String::as_str),
                ),
                Some(reason) => reason.to_owned(),
                None => e.to_string(),
            })
        }
    }
}

/// DISPATCH, or REPLAY and the replayed attempt's state.
fn decision(r: &pb::AuthorizeResponse) -> String {
    let decision = show::enum_name(r.decision().as_str_name(), "DECISION_");
    match (r.decision(), &r.attempt) {
        (pb::Decision::Replay, Some(a)) => format!("{decision} {}", show::state(a)),
        _ => decision,
    }
}

// === telling ===

/// Formats the story: for people, or one JSON line per step.
struct Teller {
    json: bool,
    pace: Duration,
    server: String,
    n: usize,
}

impl Teller {
    fn open(&self) {
        if !self.json {
            outln!("atmost demo: an agent's timeout, then a retry with a new key");
            outln!(
                "(the worked example of docs/api.md, against {})",
                self.server
            );
        }
    }

    /// What happens next, before the call is made.
    async fn says(&mut self, text: &str) {
        self.n += 1;
        if !self.json {
            outln!();
            for (i, line) in text.lines().enumerate() {
                match i {
                    0 => outln!("{}. {line}", self.n),
                    _ => outln!("   {line}"),
                }
            }
        }
        if !self.pace.is_zero() {
            tokio::time::sleep(self.pace).await;
        }
    }

    /// The call's answer: on, or the story ends here (exit 1).
    fn step(&mut self, step: Step) -> Result<(), Failure> {
        let ok = step.got == step.expect;
        if self.json {
            let line = json!({
                "step": self.n,
                "name": step.name,
                "rpc": step.rpc,
                "expect": step.expect,
                "got": step.got,
                "ok": ok,
                "detail": step.detail,
            });
            outln!("{line}");
        } else {
            match &step.id {
                Some(id) => outln!("   {} -> {} ({id})", step.rpc, step.got),
                None => outln!("   {} -> {}", step.rpc, step.got),
            }
            if !ok {
                outln!("   NOT AS EXPECTED: the story expects {}", step.expect);
            }
        }
        match ok {
            true => Ok(()),
            false => Err(Failure::Story(format!(
                "step {} ({}) got {}, where the story expects {}",
                self.n, step.name, step.got, step.expect
            ))),
        }
    }

    fn close(&self) {
        if !self.json {
            outln!();
            outln!(
                "Every step got the answer the story expects: one charge at most went\n\
                 out, the retry with a new key was refused before anything was sent,\n\
                 and the one unknown was settled on the provider's word."
            );
        }
    }
}
