#![forbid(unsafe_code)]
//! atmost-stress: the multi-replica stress checker.
//!
//! Starts R `atmost serve --store redis` processes on one Redis, drives C
//! concurrent clients that behave like agent loops under faults (client
//! deadlines that drop responses, same-key and new-key retries, commits of
//! all three outcomes, MarkUncertain, abandoned attempts left to their
//! leases, optionally SIGKILLed replicas), records every client-side
//! observation, and then checks the history against what the replicas read
//! back. [`run`] returns a [`Summary`]; the binary prints it and exits
//! non-zero on any violation. The test suite calls [`run`] directly.
//!
//! ```text
//! cargo build --release --workspace    # atmost-stress, and the atmost it starts
//! target/release/atmost-stress --replicas 3 --clients 64 --duration 60s
//! ```

use atmost_client::{Client, Error, NewPermit, pb};
use atmost_testkit::topology::RedisCluster;
use atmost_testkit::{AtmostProcess, RedisServer};
use clap::Parser;
use pb::{Decision, commit_request::Outcome};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser, Debug)]
#[command(about = "Drive atmost replicas with faulty agent loops and check at-most-N afterwards.")]
pub struct Args {
    /// atmost processes sharing one Redis.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Concurrent agent loops.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// How long to drive load.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Stop after this many RPCs, if sooner.
    #[arg(long)]
    pub max_ops: Option<u64>,
    /// Permits to spread the load over.
    #[arg(long, default_value_t = 8)]
    pub permits: usize,
    /// Lease of every permit: abandoned attempts turn UNCERTAIN after it.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// Share of RPCs whose response the client drops (a deadline of 0-3 ms).
    #[arg(long, default_value_t = 0.12)]
    pub drop_rate: f64,
    /// SIGKILL and restart one replica this often (0: never).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub kill_every: Duration,
    /// Seed of the agents' choices (default: from the clock; printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Use this Redis instead of starting a redis-server (keys get a fresh
    /// prefix).
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    /// With --redis-mode cluster: use this Redis Cluster (comma-separated
    /// seed URLs) instead of starting one.
    #[arg(long, env = "REDIS_CLUSTER_URLS")]
    pub redis_cluster_urls: Option<String>,
    /// `standalone`, or `cluster`: a Redis Cluster (3 primaries, 3
    /// replicas) of its own unless --redis-cluster-urls names one.
    #[arg(long, default_value = "standalone")]
    pub redis_mode: String,
    /// The replicas' `--durability` (`none` or `replica`).
    #[arg(long, default_value = "none")]
    pub durability: String,
    /// On a Cluster of its own (always, then): SIGKILL the primary that holds the first
    /// permit this long into the load, restart it once its replica is
    /// promoted (it rejoins as the new primary's replica), and report the
    /// failover (0: never).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub failover_after: Duration,
    /// The atmost binary (default: next to this one).
    #[arg(long)]
    pub atmost_bin: Option<PathBuf>,
}

const CHARGE: &str = "wallet.charge";
const SEARCH: &str = "search";

// === history ===

/// What a client asked to do with an attempt it holds.
#[derive(Debug, Clone, PartialEq)]
enum Action {
    Succeeded { result: Vec<u8>, actual: i64 },
    Failed,
    NotSent,
    Mark,
    Abandon,
}

#[derive(Debug, Default)]
struct AttemptRecord {
    cost: i64,
    /// The one action its holder took, and whether an answer came back.
    action: Option<Action>,
    confirmed: bool,
    /// NotSent was refused because the lease had passed: it is UNCERTAIN.
    went_uncertain: bool,
    /// Receipts seen for it: (receipt_id, result, cost).
    receipts: Vec<(String, Vec<u8>, i64)>,
}

/// Everything one client saw of one idempotency key (keys are per client).
#[derive(Debug, Default)]
struct KeyHistory {
    permit: usize,
    tool: &'static str,
    /// Attempt ids of DISPATCH decisions, in order.
    dispatches: Vec<String>,
    /// Attempt ids a NotSent was sent for (answered or not).
    not_sent_sent: HashSet<String>,
    /// Authorize calls that got no answer: they may have reserved.
    unknown_authorizes: u32,
    attempts: BTreeMap<String, AttemptRecord>,
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    /// DISPATCH answers that repeated a held attempt to its holder token.
    redelivered: AtomicU64,
    dropped: AtomicU64,
    kills: AtomicU64,
    dispatches: AtomicU64,
    /// Errors that did not come from atmost (no ErrorInfo).
    transport: AtomicU64,
    /// Answers that were errors (transport or UNAVAILABLE) after the
    /// failover's kill, and when the last came.
    failover: std::sync::Mutex<Option<FailoverWatch>>,
}

/// What the agents saw after a primary was killed.
struct FailoverWatch {
    killed_at: Instant,
    promoted_at: Option<Instant>,
    failed: u64,
    /// The last failed request: when it was sent, and answered.
    last_failure: Option<(Instant, Instant)>,
}

struct Ctx {
    clients: Vec<Client>,
    permits: Vec<String>,
    lease: Duration,
    drop_rate: f64,
    deadline: Instant,
    max_ops: u64,
    counters: Counters,
    stop: AtomicBool,
}

impl Ctx {
    fn done(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
            || Instant::now() >= self.deadline
            || self.counters.ops.load(Ordering::Relaxed) >= self.max_ops
    }
}

/// One RPC with a fault: with `drop_rate` the client gives up after 0-3 ms,
/// whatever the server did. `None` means "no answer": the outcome is unknown.
async fn call<T>(
    ctx: &Ctx,
    rng: &mut fastrand::Rng,
    rpc: impl Future<Output = Result<T, Error>>,
) -> Option<Result<T, Error>> {
    ctx.counters.ops.fetch_add(1, Ordering::Relaxed);
    let limit = if rng.f64() < ctx.drop_rate {
        Duration::from_micros(rng.u64(0..3_000))
    } else {
        Duration::from_secs(5)
    };
    let sent = Instant::now();
    let answer = tokio::time::timeout(limit, rpc).await;
    // A failure of the store, for the failover report: UNAVAILABLE from the
    // store, no answer from the replica, or none within the 5 s limit (not
    // a drop the client chose, nor a request shed or past its deadline).
    let store_failed = match &answer {
        Ok(Err(e)) => e.reason().is_none() || e.reason_name() == Some("STORE_UNAVAILABLE"),
        Err(_) => limit == Duration::from_secs(5),
        Ok(Ok(_)) => false,
    };
    if store_failed {
        let mut watch = ctx
            .counters
            .failover
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Those sent from the kill on.
        if let Some(w) = watch.as_mut().filter(|w| sent >= w.killed_at) {
            w.failed += 1;
            let now = Instant::now();
            w.last_failure = Some(
                w.last_failure
                    .map_or((sent, now), |(s, a)| (s.max(sent), a.max(now))),
            );
        }
    }
    match answer {
        Err(_) => {
            ctx.counters.dropped.fetch_add(1, Ordering::Relaxed);
            None
        }
        // No answer from atmost itself (a transport failure, such as a
        // killed replica or an HTTP/2 GOAWAY, carries no ErrorInfo), or the
        // store could not answer: the outcome is unknown too.
        Ok(Err(e)) if e.reason().is_none() => {
            ctx.counters.transport.fetch_add(1, Ordering::Relaxed);
            None
        }
        // The store could not answer (unknown), or the request was shed
        // before it reached the store (nothing happened): retry either way.
        Ok(Err(e)) if e.is_retryable() => None,
        Ok(r) => Some(r),
    }
}

// === the agent loop ===

async fn agent(ctx: Arc<Ctx>, id: usize, seed: u64) -> (Vec<KeyHistory>, Vec<String>) {
    let mut rng = fastrand::Rng::with_seed(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut keys: Vec<KeyHistory> = Vec::new();
    let mut violations = Vec::new();
    let mut n = 0;
    while !ctx.done() {
        let permit = rng.usize(..ctx.permits.len());
        let tool = if rng.bool() { CHARGE } else { SEARCH };
        let fingerprint: Vec<u8> = (0..16).map(|_| rng.u8(..)).collect();
        let cost = rng.i64(0..=3);
        // Half the intents carry a holder token, made once for the logical
        // call and sent with each of its retries: a same-key retry after a
        // lost DISPATCH answer is then told DISPATCH again (redelivered).
        let token: Vec<u8> = if rng.bool() {
            (0..16).map(|_| rng.u8(..)).collect()
        } else {
            Vec::new()
        };
        // One intent; after a lost answer the agent retries with the same
        // key or (as agent frameworks do) with a fresh one.
        let mut key_index = new_key(&mut keys, permit, tool);
        let mut tries = 0;
        while tries < 4 && !ctx.done() {
            tries += 1;
            let key = format!("a{id}-{key_index}");
            let _ = n;
            n += 1;
            let client = &ctx.clients[rng.usize(..ctx.clients.len())];
            let request = pb::AuthorizeRequest {
                permit_id: ctx.permits[permit].clone(),
                tool: tool.into(),
                idempotency_key: key.clone(),
                request_fingerprint: fingerprint.clone(),
                cost,
                holder_token: token.clone(),
                ..Default::default()
            };
            let h = &mut keys[key_index];
            match call(&ctx, &mut rng, client.authorize(request)).await {
                None => {
                    h.unknown_authorizes += 1;
                    if rng.bool() {
                        key_index = new_key(&mut keys, permit, tool);
                    }
                    continue;
                }
                Some(Ok(r)) => {
                    let attempt = r.attempt.clone().unwrap_or_default();
                    let record = h.attempts.entry(attempt.attempt_id.clone()).or_default();
                    record.cost = attempt.cost;
                    if let Some(receipt) = &attempt.receipt {
                        record.receipts.push((
                            receipt.receipt_id.clone(),
                            receipt.result.clone(),
                            receipt.cost,
                        ));
                    }
                    if r.decision() == Decision::Dispatch {
                        ctx.counters.dispatches.fetch_add(1, Ordering::Relaxed);
                        if r.redelivered {
                            ctx.counters.redelivered.fetch_add(1, Ordering::Relaxed);
                        }
                        // A redelivery repeats the key's held attempt: the
                        // history counts each attempt's DISPATCH once (the
                        // check below fails a redelivery of anything else).
                        if !(r.redelivered && h.dispatches.last() == Some(&attempt.attempt_id)) {
                            h.dispatches.push(attempt.attempt_id.clone());
                        }
                        act(
                            &ctx,
                            &mut rng,
                            &mut keys[key_index],
                            &key,
                            &attempt,
                            &mut violations,
                        )
                        .await;
                        // Sometimes reuse a key freed by NotSent for a new intent.
                        if keys[key_index].attempts[&attempt.attempt_id].action
                            == Some(Action::NotSent)
                            && keys[key_index].attempts[&attempt.attempt_id].confirmed
                            && rng.f64() < 0.3
                        {
                            continue;
                        }
                    }
                    break;
                }
                Some(Err(status)) => match status.reason_or_code().as_str() {
                    "IDEMPOTENCY_IN_PROGRESS" => {
                        if rng.bool() {
                            tokio::time::sleep(ctx.lease / 2).await;
                        } else {
                            key_index = new_key(&mut keys, permit, tool);
                        }
                    }
                    // Refusals that change nothing. The quotas are reached
                    // under faults: dropped answers leave attempts open.
                    "PERMIT_MAX_CALLS_EXCEEDED"
                    | "PERMIT_BUDGET_EXCEEDED"
                    | "PERMIT_EXPIRED"
                    | "DUPLICATE_REQUEST_SUSPECTED"
                    | "QUOTA_OPEN_ATTEMPTS"
                    | "QUOTA_ATTEMPTS" => break,
                    other => {
                        violations.push(format!("{key}: Authorize answered {other}: {status:?}"));
                        break;
                    }
                },
            }
        }
    }
    (keys, violations)
}

fn new_key(keys: &mut Vec<KeyHistory>, permit: usize, tool: &'static str) -> usize {
    keys.push(KeyHistory {
        permit,
        tool,
        ..KeyHistory::default()
    });
    keys.len() - 1
}

/// What the holder of a fresh DISPATCH does: commit one of three outcomes,
/// mark it uncertain, or walk away. Lost answers are retried (same request)
/// a few times.
async fn act(
    ctx: &Ctx,
    rng: &mut fastrand::Rng,
    h: &mut KeyHistory,
    key: &str,
    attempt: &pb::Attempt,
    violations: &mut Vec<String>,
) {
    let roll = rng.f64();
    let action = if roll < 0.45 {
        let result: Vec<u8> = (0..8).map(|_| rng.u8(..)).collect();
        Action::Succeeded {
            result,
            actual: rng.i64(0..=attempt.cost),
        }
    } else if roll < 0.60 {
        Action::Failed
    } else if roll < 0.75 {
        Action::NotSent
    } else if roll < 0.87 {
        Action::Mark
    } else {
        Action::Abandon
    };
    let record = h.attempts.get_mut(&attempt.attempt_id).expect("recorded");
    record.action = Some(action.clone());
    if action == Action::NotSent {
        h.not_sent_sent.insert(attempt.attempt_id.clone());
    }
    if action == Action::Abandon {
        return;
    }
    // Whether an earlier try of this action went unanswered (and so may
    // have been applied).
    let mut unanswered = false;
    for _ in 0..6 {
        let client = ctx.clients[rng.usize(..ctx.clients.len())].clone();
        let answer = match &action {
            Action::Mark => call(
                ctx,
                rng,
                client.mark_uncertain(pb::MarkUncertainRequest {
                    permit_id: attempt.permit_id.clone(),
                    idempotency_key: key.into(),
                    attempt_id: attempt.attempt_id.clone(),
                    reason: "stress: response lost".into(),
                }),
            )
            .await
            .map(|r| r.map(|m| m.attempt)),
            outcome => {
                let outcome = match outcome {
                    Action::Succeeded { result, actual } => Outcome::Succeeded(pb::Succeeded {
                        result: result.clone(),
                        actual_cost: Some(*actual),
                    }),
                    Action::Failed => Outcome::Failed(pb::Failed {
                        reason: "stress: declined".into(),
                    }),
                    _ => Outcome::NotSent(pb::NotSent {}),
                };
                call(
                    ctx,
                    rng,
                    client.commit(pb::CommitRequest {
                        permit_id: attempt.permit_id.clone(),
                        idempotency_key: key.into(),
                        attempt_id: attempt.attempt_id.clone(),
                        outcome: Some(outcome),
                    }),
                )
                .await
                .map(|r| r.map(|c| c.attempt))
            }
        };
        let record = h.attempts.get_mut(&attempt.attempt_id).expect("recorded");
        match answer {
            None => {
                unanswered = true;
                continue;
            }
            Some(Ok(settled)) => {
                record.confirmed = true;
                if let Some(receipt) = settled.and_then(|a| a.receipt) {
                    record
                        .receipts
                        .push((receipt.receipt_id, receipt.result, receipt.cost));
                }
                return;
            }
            Some(Err(status)) => {
                let why = status.reason_or_code();
                if action == Action::NotSent && why == "ATTEMPT_STATE_CONFLICT" {
                    // The lease passed first: it is UNCERTAIN now, held, and
                    // the NotSent released nothing: it no longer excuses a
                    // second DISPATCH of this key.
                    record.went_uncertain = true;
                    record.confirmed = true;
                    h.not_sent_sent.remove(&attempt.attempt_id);
                } else if action == Action::NotSent
                    && why == "ATTEMPT_MISMATCH"
                    && unanswered
                    && h.unknown_authorizes > 0
                {
                    // An unanswered try released the key, and then a late
                    // Authorize of this key (one whose answer this client
                    // gave up on) reserved it afresh: the key now holds an
                    // attempt this client never saw. That is the service
                    // working as specified, not a violation. It counts as a
                    // confirmed NotSent, so the final check still fails if
                    // this attempt was in fact never released (it would be
                    // listed as UNCERTAIN), and the unseen attempt must be
                    // explained by the unanswered Authorize.
                    record.confirmed = true;
                } else {
                    violations.push(format!("{key}: {action:?} answered {why}: {status:?}"));
                }
                return;
            }
        }
    }
}

// === fixed races ===

/// 10 parallel identical calls on one key: exactly one DISPATCH. 10 distinct
/// keys racing a budget of 7 at cost 2: exactly 3 DISPATCH.
async fn fixed_races(clients: &[Client], expires_at_ms: i64, rounds: usize) -> Vec<String> {
    let mut violations = Vec::new();
    for round in 0..rounds {
        for (name, budget, same_key, want) in
            [("same-key", None, true, 1), ("budget", Some(7), false, 3)]
        {
            let permit = create_permit(
                &clients[0],
                expires_at_ms,
                budget,
                None,
                Duration::from_secs(30),
            )
            .await;
            let mut tasks = Vec::new();
            for i in 0..10 {
                let client = clients[i % clients.len()].clone();
                let permit = permit.clone();
                tasks.push(tokio::spawn(async move {
                    let key = if same_key {
                        "k".to_string()
                    } else {
                        format!("k{i}")
                    };
                    client
                        .authorize(pb::AuthorizeRequest {
                            permit_id: permit,
                            tool: CHARGE.into(),
                            idempotency_key: key.clone(),
                            request_fingerprint: if same_key {
                                b"same".to_vec()
                            } else {
                                key.into_bytes()
                            },
                            cost: 2,
                            holder_token: Vec::new(),
                            ..Default::default()
                        })
                        .await
                }));
            }
            let mut dispatched = 0;
            for t in tasks {
                match t.await {
                    Ok(Ok(r)) if r.decision() == Decision::Dispatch => dispatched += 1,
                    Ok(Ok(r)) => violations.push(format!("{name} race: unexpected {r:?}")),
                    Ok(Err(s)) => {
                        let expected = if same_key {
                            "IDEMPOTENCY_IN_PROGRESS"
                        } else {
                            "PERMIT_BUDGET_EXCEEDED"
                        };
                        if s.reason_or_code() != expected {
                            violations.push(format!("{name} race: unexpected {s:?}"));
                        }
                    }
                    Err(e) => violations.push(format!("{name} race: task failed {e}")),
                }
            }
            if dispatched != want {
                violations.push(format!(
                    "{name} race round {round}: {dispatched} DISPATCH, want exactly {want}"
                ));
            }
        }
    }
    violations
}

async fn create_permit(
    client: &Client,
    expires_at_ms: i64,
    budget: Option<i64>,
    cap: Option<u64>,
    lease: Duration,
) -> String {
    let mut permit = NewPermit::new([CHARGE, SEARCH])
        .subject("atmost-stress")
        .currency("EUR")
        .expires_at_ms(expires_at_ms)
        .lease(lease)
        .duplicate_guard(pb::DuplicateGuardMode::Log, None);
    if let Some(cap) = cap {
        permit = permit.cap(CHARGE, cap);
    }
    if let Some(budget) = budget {
        permit = permit.budget(budget);
    }
    client
        .create_permit(permit)
        .await
        .expect("create permit")
        .permit_id
}

// === the check ===

async fn list_all(client: &Client, permit_id: &str) -> Vec<pb::Attempt> {
    client
        .list_all_uncertain(permit_id, 1000)
        .await
        .expect("list uncertain")
}

/// Checks the merged history against what the store reads back, once every
/// lease has passed (so every open attempt is UNCERTAIN and listed).
async fn check(
    client: &Client,
    permits: &[String],
    caps: &[Option<u64>],
    budgets: &[Option<i64>],
    keys: &[(String, KeyHistory)],
) -> Vec<String> {
    let mut v = Vec::new();
    let everywhere: HashSet<String> = list_all(client, "")
        .await
        .into_iter()
        .map(|a| a.attempt_id)
        .collect();
    for (p, permit_id) in permits.iter().enumerate() {
        let view = client.get_permit(permit_id).await.expect("get permit");
        let listed: HashMap<String, pb::Attempt> = list_all(client, permit_id)
            .await
            .into_iter()
            .map(|a| (a.attempt_id.clone(), a))
            .collect();
        let mut slots: HashMap<&str, u64> = HashMap::new();
        let mut committed = 0i64;
        let reserved: i64 = listed.values().map(|a| a.cost).sum();
        for a in listed.values() {
            *slots
                .entry(if a.tool == CHARGE { CHARGE } else { SEARCH })
                .or_default() += 1;
            if !everywhere.contains(&a.attempt_id) {
                v.push(format!(
                    "{}: listed under its permit but not by ListUncertain across permits",
                    a.idempotency_key
                ));
            }
        }
        let mut listed_by_key: HashMap<&str, Vec<&String>> = HashMap::new();
        for a in listed.values() {
            listed_by_key
                .entry(a.idempotency_key.as_str())
                .or_default()
                .push(&a.attempt_id);
        }
        let mut known_keys: HashMap<&str, &KeyHistory> = HashMap::new();
        for (key, h) in keys.iter().filter(|(_, h)| h.permit == p) {
            known_keys.insert(key.as_str(), h);
            // A key never gets two DISPATCHes without a NotSent between them.
            for pair in h.dispatches.windows(2) {
                if !h.not_sent_sent.contains(&pair[0]) {
                    v.push(format!(
                        "{key}: second DISPATCH {} while {} was never released",
                        pair[1], pair[0]
                    ));
                }
            }
            let mut ids: HashSet<&String> = h.attempts.keys().collect();
            ids.extend(
                listed_by_key
                    .get(key.as_str())
                    .into_iter()
                    .flatten()
                    .copied(),
            );
            if ids.len() > 1 + h.not_sent_sent.len() {
                v.push(format!(
                    "{key}: {} attempts but only {} NotSent",
                    ids.len(),
                    h.not_sent_sent.len()
                ));
            }
            for (id, r) in &h.attempts {
                let is_listed = listed.contains_key(id);
                // Every REPLAY and answer of an attempt shows one receipt.
                let distinct: HashSet<_> = r.receipts.iter().collect();
                if distinct.len() > 1 {
                    v.push(format!("{key}/{id}: receipts differ: {distinct:?}"));
                }
                if let (Some(Action::Succeeded { result, actual }), Some((_, got, got_cost))) =
                    (&r.action, r.receipts.first())
                    && (got != result || got_cost != actual)
                {
                    v.push(format!("{key}/{id}: receipt {got:?}/{got_cost} is not the committed {result:?}/{actual}"));
                }
                let must_list = match (&r.action, r.confirmed) {
                    _ if r.went_uncertain => Some(true),
                    (Some(Action::Succeeded { actual, .. }), true) => {
                        committed += actual;
                        *slots.entry(h.tool).or_default() += 1;
                        Some(false)
                    }
                    (Some(Action::Failed), true) => {
                        *slots.entry(h.tool).or_default() += 1;
                        Some(false)
                    }
                    (Some(Action::NotSent), true) => Some(false),
                    (Some(Action::Mark | Action::Abandon) | None, _) => Some(true),
                    (Some(Action::Succeeded { actual, .. }), false) => {
                        if !is_listed {
                            committed += actual;
                            *slots.entry(h.tool).or_default() += 1;
                        }
                        None
                    }
                    (Some(Action::Failed), false) => {
                        if !is_listed {
                            *slots.entry(h.tool).or_default() += 1;
                        }
                        None
                    }
                    (Some(Action::NotSent), false) => None,
                };
                match must_list {
                    Some(true) if !is_listed => v.push(format!(
                        "{key}/{id}: open attempt ({:?}) vanished: not UNCERTAIN in ListUncertain",
                        r.action
                    )),
                    Some(false) if is_listed => v.push(format!(
                        "{key}/{id}: settled ({:?}) but listed as UNCERTAIN",
                        r.action
                    )),
                    _ => {}
                }
            }
        }
        // Nothing is open that no client could have caused.
        for a in listed.values() {
            let known = known_keys.get(a.idempotency_key.as_str());
            let explained = known.is_some_and(|h| {
                h.attempts.contains_key(&a.attempt_id) || h.unknown_authorizes > 0
            });
            if !explained {
                v.push(format!(
                    "{}/{}: UNCERTAIN attempt no client asked for",
                    a.idempotency_key, a.attempt_id
                ));
            }
        }
        for u in &view.usage {
            let expected = slots.get(u.tool.as_str()).copied().unwrap_or(0);
            if u.calls_made != expected {
                v.push(format!(
                    "permit {p} {}: calls_made {} but the history implies {expected}",
                    u.tool, u.calls_made
                ));
            }
            if u.tool == CHARGE
                && let Some(cap) = caps[p]
                && u.calls_made > cap
            {
                v.push(format!(
                    "permit {p}: {} slots held past the cap {cap}",
                    u.calls_made
                ));
            }
        }
        if view.budget_committed != committed || view.budget_reserved != reserved {
            v.push(format!(
                "permit {p}: committed/reserved {}/{} but the history implies {committed}/{reserved}",
                view.budget_committed, view.budget_reserved
            ));
        }
        if let Some(budget) = budgets[p]
            && view.budget_committed + view.budget_reserved > budget
        {
            v.push(format!(
                "permit {p}: {} committed + {} reserved exceeds the budget {budget}",
                view.budget_committed, view.budget_reserved
            ));
        }
    }
    v
}

// === the run ===

/// What one run did and found.
#[derive(Debug)]
pub struct Summary {
    pub replicas: usize,
    pub clients: usize,
    pub seed: u64,
    pub ops: u64,
    pub dispatches: u64,
    /// Of the dispatches, those redelivered to the same holder token.
    pub redelivered: u64,
    pub dropped_responses: u64,
    pub replica_kills: u64,
    /// RPCs that failed in transport (killed replicas, HTTP/2 GOAWAY),
    /// counted as lost answers.
    pub transport_failures: u64,
    /// With --failover-after: the failover as the agents saw it.
    pub failover: Option<FailoverReport>,
    pub violations: Vec<String>,
}

/// A killed primary, as the agents saw it.
#[derive(Debug, Clone)]
pub struct FailoverReport {
    /// RPCs sent from the kill on that the store failed: UNAVAILABLE from
    /// the store, no answer from the replica, or none within 5 s.
    pub failed_requests: u64,
    /// From the kill until the cluster named the replica primary.
    pub promoted_after: Duration,
    /// From the kill to the sending of the last request that failed so:
    /// requests sent after it were served.
    pub resumed_after: Duration,
    /// From the kill to the last failure's answer (a request can wait up to
    /// the store timeout for it).
    pub last_failure_answered_after: Duration,
}

impl std::fmt::Display for Summary {
    /// One line; `, 0 violations` is what a clean run says.
    fn fmt(&self, f_: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f_,
            "stress: {} replicas, {} clients, {} ops, {} dispatches ({} redelivered), {} faults injected ({} dropped responses, {} replica kills), {} violations (seed {})",
            self.replicas,
            self.clients,
            self.ops,
            self.dispatches,
            self.redelivered,
            self.dropped_responses + self.replica_kills,
            self.dropped_responses,
            self.replica_kills,
            self.violations.len(),
            self.seed,
        )?;
        if let Some(f) = &self.failover {
            write!(
                f_,
                "; failover: {} requests failed, replica promoted {:.2} s after the kill, \
                 requests sent from {:.2} s on served (the last failure answered at {:.2} s)",
                f.failed_requests,
                f.promoted_after.as_secs_f64(),
                f.resumed_after.as_secs_f64(),
                f.last_failure_answered_after.as_secs_f64()
            )?;
        }
        Ok(())
    }
}

/// Runs the checker as `args` say: starts its replicas (and a Redis, unless
/// given one), drives the agents, checks the history, stops everything.
/// When `interrupt` completes the load ends early; the check still runs and
/// the processes the run started are still stopped.
pub async fn run(
    args: Args,
    interrupt: impl Future<Output = ()> + Send + 'static,
) -> Result<Summary, Box<dyn std::error::Error>> {
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let bin = match args.atmost_bin {
        Some(b) => b,
        None => std::env::current_exe()?.with_file_name("atmost"),
    };
    let cluster_mode = args.redis_mode == "cluster";
    let failover = !args.failover_after.is_zero();
    if failover && !cluster_mode {
        return Err("--failover-after needs --redis-mode cluster".into());
    }
    let given = if cluster_mode {
        args.redis_cluster_urls.clone().filter(|_| !failover)
    } else {
        args.redis_url.clone()
    };
    let (_redis, cluster, url) = match (given, cluster_mode) {
        (Some(url), _) => (None, None, url),
        (None, false) => {
            let r = RedisServer::start()?;
            let url = r.url();
            (Some(r), None, url)
        }
        (None, true) => {
            let c = tokio::task::spawn_blocking(|| RedisCluster::start(3, 1, &[])).await??;
            let url = c.urls();
            (None, Some(c), url)
        }
    };
    let prefix = format!("stress{}", uuid::Uuid::now_v7().simple());
    let replica_args = [
        "--store",
        "redis",
        "--redis-url",
        &url,
        "--redis-mode",
        &args.redis_mode,
        "--durability",
        &args.durability,
        "--redis-prefix",
        &prefix,
        "--store-timeout",
        "2s",
    ];
    let mut replicas = Vec::new();
    for _ in 0..args.replicas.max(1) {
        replicas.push(AtmostProcess::spawn(&bin, &replica_args)?);
    }
    let mut clients = Vec::new();
    for r in &replicas {
        clients.push(r.client().await);
    }
    let expires_at_ms = atmost_client::now_ms() + 3_600_000;

    let mut violations = fixed_races(&clients, expires_at_ms, 20).await;

    let mut rng = fastrand::Rng::with_seed(seed);
    let mut permits = Vec::new();
    let mut caps = Vec::new();
    let mut budgets = Vec::new();
    for _ in 0..args.permits.max(1) {
        let cap = rng.bool().then(|| rng.u64(1..40));
        let budget = rng.bool().then(|| rng.i64(20..400));
        permits.push(create_permit(&clients[0], expires_at_ms, budget, cap, args.lease).await);
        caps.push(cap);
        budgets.push(budget);
    }

    let ctx = Arc::new(Ctx {
        clients: clients.clone(),
        permits: permits.clone(),
        lease: args.lease,
        drop_rate: args.drop_rate,
        deadline: Instant::now() + args.duration,
        max_ops: args.max_ops.unwrap_or(u64::MAX),
        counters: Counters::default(),
        stop: AtomicBool::new(false),
    });
    {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            interrupt.await;
            ctx.stop.store(true, Ordering::Relaxed);
        });
    }
    let agents: Vec<_> = (0..args.clients)
        .map(|i| tokio::spawn(agent(ctx.clone(), i, seed)))
        .collect();

    // Replica kills: SIGKILL one, restart it on the same address (clients'
    // channels reconnect to it).
    let replicas = Arc::new(std::sync::Mutex::new(replicas));
    let killer = (!args.kill_every.is_zero()).then(|| {
        let (ctx, replicas, every) = (ctx.clone(), replicas.clone(), args.kill_every);
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed.rotate_left(7));
            loop {
                tokio::time::sleep(every).await;
                if ctx.done() {
                    return;
                }
                let replicas = replicas.clone();
                let i = rng.usize(..ctx.clients.len());
                let restarted = tokio::task::spawn_blocking(move || {
                    let mut all = replicas.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = all[i].kill();
                    std::thread::sleep(Duration::from_millis(200));
                    all[i].restart()
                })
                .await;
                ctx.counters.kills.fetch_add(1, Ordering::Relaxed);
                if !matches!(restarted, Ok(Ok(()))) {
                    eprintln!("stress: could not restart a replica: {restarted:?}");
                    ctx.stop.store(true, Ordering::Relaxed);
                    return;
                }
            }
        })
    });

    // The failover: SIGKILL the primary that holds the first permit.
    let cluster = Arc::new(std::sync::Mutex::new(cluster));
    let failover = (!args.failover_after.is_zero()).then(|| {
        let (ctx, cluster, after) = (ctx.clone(), cluster.clone(), args.failover_after);
        let key = format!("{prefix}:{{{}}}:permit", permits[0]);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            tokio::task::spawn_blocking(move || {
                let mut cluster = cluster.lock().unwrap_or_else(|e| e.into_inner());
                let cluster = cluster.as_mut().expect("a cluster of its own");
                let seed = cluster.nodes[0].port();
                let slot = atmost_testkit::topology::redis_cli(seed, &["cluster", "keyslot", &key])
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .expect("CLUSTER KEYSLOT");
                let primary = cluster.primary_of_slot(slot).expect("the slot's primary");
                let watch = || {
                    ctx.counters
                        .failover
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                };
                *watch() = Some(FailoverWatch {
                    killed_at: Instant::now(),
                    promoted_at: None,
                    failed: 0,
                    last_failure: None,
                });
                cluster.node(primary).kill();
                eprintln!("stress: killed the primary on port {primary} (slot {slot})");
                let deadline = Instant::now() + Duration::from_secs(60);
                while cluster.primary_of_slot(slot).is_none_or(|p| p == primary) {
                    if Instant::now() > deadline {
                        eprintln!("stress: no replica promoted within 60 s");
                        ctx.stop.store(true, Ordering::Relaxed);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                if let Some(w) = watch().as_mut() {
                    w.promoted_at = Some(Instant::now());
                }
                if let Err(e) = cluster.node(primary).restart() {
                    eprintln!("stress: could not restart the old primary: {e}");
                    ctx.stop.store(true, Ordering::Relaxed);
                }
            })
            .await
        })
    });

    let mut keys: Vec<(String, KeyHistory)> = Vec::new();
    for (i, a) in agents.into_iter().enumerate() {
        let (histories, mut agent_violations) = a.await?;
        violations.append(&mut agent_violations);
        keys.extend(
            histories
                .into_iter()
                .enumerate()
                .map(|(k, h)| (format!("a{i}-{k}"), h)),
        );
    }
    if let Some(killer) = killer {
        killer.await?;
    }
    if let Some(failover) = failover {
        failover.await??;
    }
    // Let every lease pass: each open attempt is then UNCERTAIN, and listed.
    // (plus the replicas' store deadline, so a late script run has landed).
    tokio::time::sleep(args.lease + Duration::from_millis(2_500)).await;
    violations.extend(check(&clients[0], &permits, &caps, &budgets, &keys).await);

    let c = &ctx.counters;
    Ok(Summary {
        replicas: args.replicas.max(1),
        clients: args.clients,
        seed,
        ops: c.ops.load(Ordering::Relaxed),
        dispatches: c.dispatches.load(Ordering::Relaxed),
        redelivered: c.redelivered.load(Ordering::Relaxed),
        dropped_responses: c.dropped.load(Ordering::Relaxed),
        replica_kills: c.kills.load(Ordering::Relaxed),
        transport_failures: c.transport.load(Ordering::Relaxed),
        failover: c
            .failover
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|w| FailoverReport {
                failed_requests: w.failed,
                promoted_after: w.promoted_at.map_or(Duration::ZERO, |t| t - w.killed_at),
                resumed_after: w
                    .last_failure
                    .map_or(Duration::ZERO, |(sent, _)| sent - w.killed_at),
                last_failure_answered_after: w
                    .last_failure
                    .map_or(Duration::ZERO, |(_, answered)| answered - w.killed_at),
            }),
        violations,
    })
}
