#![forbid(unsafe_code)]
//! atmost-bench: the load generator.
//!
//! Drives one scenario against a running atmost, closed-loop (N requests in
//! flight) or open-loop (`--rate`: requests start on a fixed schedule and
//! latency is measured from the scheduled start, so a slow server cannot
//! hide behind fewer requests; requests the generator itself could not
//! start, past its own in-flight limit, are counted as
//! CLIENT_IN_FLIGHT_LIMIT errors, not as latencies; so are the server's
//! refusals: the percentiles are the answered requests'). Prints one line, and
//! with `--json FILE` appends the result as one JSON object. The binary
//! parses [`Args`] and calls [`generate`]; the test suite calls it directly.
//!
//! ```text
//! atmost-bench --scenario authorize --concurrency 64 --duration 10s
//! atmost-bench --scenario cycle --rate 20000 --duration 10s --json results.jsonl
//! ```
//!
//! [`list_scale`] (the `list_scale` binary) measures ListUncertain as a
//! permit's open attempts grow, driving the stores in process; [`ceiling`]
//! (the `redis_ceiling` binary) drives the authorize script as the Redis
//! store does, for the Redis ceiling; [`cross_scale`] (the `cross_scale`
//! binary) walks ListUncertain across many live permits and counts the
//! census.

pub mod ceiling;
pub mod cross_scale;
pub mod list_scale;

mod http_json;

use atmost_client::{Client, NewPermit, pb};
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Scenario {
    /// Authorize with fresh keys on permits without caps.
    Authorize,
    /// Authorize a fresh key, then Commit Succeeded (two RPCs).
    Cycle,
    /// Authorize keys that already succeeded: REPLAY.
    Replay,
    /// Every client on one permit with a cap.
    Contended,
    /// grpc.health.v1 Check: the transport's ceiling, no store.
    Health,
    /// Authorize as `authorize`, over the HTTP/JSON edge: a JSON POST on
    /// HTTP/2 (h2c), as many connections, each answer read as JSON.
    HttpAuthorize,
}

#[derive(Parser, Debug)]
#[command(about = "Load generator for atmost: throughput and latency of one scenario.")]
pub struct Args {
    /// The atmost to load.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub target: String,
    #[arg(long, value_enum)]
    pub scenario: Scenario,
    /// Errors this run may meet (reasons or codes, e.g. `OVERLOADED` for
    /// a run past the peak): any other, or any error without this, fails
    /// the run after its report. A run whose calls did not take the path
    /// its scenario claims measured something else.
    #[arg(long, value_delimiter = ',', value_name = "KIND,...")]
    pub allow_errors: Vec<String>,
    /// Requests in flight (closed loop), or the most in flight (open loop).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Open loop: start this many requests per second on a fixed schedule.
    #[arg(long)]
    pub rate: Option<u64>,
    /// How long to measure.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Closed loop: stop after this many requests (all measured, no warmup).
    #[arg(long)]
    pub requests: Option<u64>,
    /// Load before measuring starts.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
    /// HTTP/2 connections to spread the requests over.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Permits to spread fresh keys over (authorize, cycle, replay).
    #[arg(long, default_value_t = 16)]
    pub permits: usize,
    /// A label for this run in the output (e.g. the store).
    #[arg(long, default_value = "")]
    pub label: String,
    /// Append the result as one JSON line to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Open loop: the pacer's shortest sleep. Requests due within one tick
    /// start together; a shorter tick starts them closer to their schedule
    /// and costs the generator (and the server) more wake-ups.
    #[arg(long, default_value = "250us", value_parser = humantime::parse_duration)]
    pub tick: Duration,
    /// Tokio worker threads of the generator (default: one per CPU).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// What every request task needs.
struct Plan {
    scenario: Scenario,
    clients: Vec<Client>,
    /// The HTTP/JSON edge's connections (http-authorize).
    http: Vec<http_json::Connection>,
    permits: Vec<String>,
    /// Keys that already succeeded, for the replay scenario.
    replay_keys: Vec<(usize, String)>,
    run: String,
}

/// One request of the scenario; `n` numbers requests across the run.
async fn one(plan: &Plan, n: u64) -> Result<(), String> {
    let client = &plan.clients[n as usize % plan.clients.len()];
    let rpc = |e: atmost_client::Error| e.reason_or_code();
    match plan.scenario {
        Scenario::Health => {
            HealthClient::new(client.channel())
                .check(HealthCheckRequest {
                    service: String::new(),
                })
                .await
                .map_err(|e| rpc(e.into()))?;
        }
        Scenario::Authorize | Scenario::Contended | Scenario::Cycle => {
            let permit = match plan.scenario {
                Scenario::Contended => &plan.permits[0],
                _ => &plan.permits[n as usize % plan.permits.len()],
            };
            let key = format!("{}-{n}", plan.run);
            let r = client
                .authorize(authorize_request(permit, &key, n))
                .await
                .map_err(rpc)?;
            if r.decision() != pb::Decision::Dispatch {
                return Err("NOT_DISPATCH".into());
            }
            if let Scenario::Cycle = plan.scenario {
                let attempt = r.attempt.unwrap_or_default();
                client
                    .commit(pb::CommitRequest {
                        permit_id: permit.clone(),
                        idempotency_key: key,
                        attempt_id: attempt.attempt_id,
                        outcome: Some(pb::commit_request::Outcome::Succeeded(pb::Succeeded {
                            result: b"bench result 16b".to_vec(),
                            actual_cost: None,
                        })),
                    })
                    .await
                    .map_err(rpc)?;
            }
        }
        Scenario::HttpAuthorize => {
            let permit = &plan.permits[n as usize % plan.permits.len()];
            let key = format!("{}-{n}", plan.run);
            let connection = &plan.http[n as usize % plan.http.len()];
            let decision = connection.authorize(permit, &key, &fingerprint(n)).await?;
            if decision != "DECISION_DISPATCH" {
                return Err("NOT_DISPATCH".into());
            }
        }
        Scenario::Replay => {
            let (permit, key) = &plan.replay_keys[n as usize % plan.replay_keys.len()];
            let seq = key
                .rsplit('-')
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let r = client
                .authorize(authorize_request(&plan.permits[*permit], key, seq))
                .await
                .map_err(rpc)?;
            if r.decision() != pb::Decision::Replay {
                return Err("NOT_REPLAY".into());
            }
        }
    }
    Ok(())
}

/// A 32-byte fingerprint for request `n`, unique per request (as a
/// SHA-256 would be).
pub fn fingerprint(n: u64) -> Vec<u8> {
    (0..4u64)
        .flat_map(|i| (n ^ (i << 60)).to_le_bytes())
        .collect()
}

/// `calls` and `usec` of `cmdstat_<command>` in `INFO commandstats` (0, 0
/// when the command has not run since the last `CONFIG RESETSTAT`).
pub async fn command_stats(
    conn: &mut impl redis::aio::ConnectionLike,
    command: &str,
) -> Result<(u64, u64), Box<dyn std::error::Error + Send + Sync>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let prefix = format!("cmdstat_{command}:");
    let Some(stats) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
        return Ok((0, 0));
    };
    let (mut calls, mut usec) = (0, 0);
    for kv in stats.split(',') {
        match kv.split_once('=') {
            Some(("calls", v)) => calls = v.trim().parse()?,
            Some(("usec", v)) => usec = v.trim().parse()?,
            _ => {}
        }
    }
    Ok((calls, usec))
}

fn authorize_request(permit: &str, key: &str, n: u64) -> pb::AuthorizeRequest {
    let fingerprint = fingerprint(n);
    pb::AuthorizeRequest {
        permit_id: permit.to_owned(),
        tool: "search".into(),
        idempotency_key: key.to_owned(),
        request_fingerprint: fingerprint,
        cost: 1,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

async fn create_permits(client: &Client, count: usize, cap: Option<u64>) -> Vec<String> {
    let expires_at_ms = atmost_client::now_ms() + 86_400_000;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let mut permit = NewPermit::new(["search"])
            .subject("atmost-bench")
            .expires_at_ms(expires_at_ms);
        if let Some(cap) = cap {
            permit = permit.cap("search", cap);
        }
        let permit = client.create_permit(permit).await.expect("create a permit");
        out.push(permit.permit_id);
    }
    out
}

/// Results of one worker (closed loop) or of the whole run (open loop).
struct Tally {
    /// From the scheduled start (open loop) or the send (closed loop).
    latency: Histogram<u64>,
    /// From the actual send: the server's share, without the generator's
    /// own scheduling lag (tokio timers tick in milliseconds).
    service: Histogram<u64>,
    errors: BTreeMap<String, u64>,
    /// Errors during the warmup: not in the figures, but a run that met
    /// one did not take its path either.
    warmup_errors: BTreeMap<String, u64>,
}

impl Tally {
    fn new() -> Self {
        let histogram = || Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram");
        Self {
            latency: histogram(),
            service: histogram(),
            errors: BTreeMap::new(),
            warmup_errors: BTreeMap::new(),
        }
    }

    /// An answer during the warmup: only an error is kept.
    fn warmup(&mut self, result: Result<(), String>) {
        if let Err(e) = result {
            *self.warmup_errors.entry(e).or_default() += 1;
        }
    }

    /// The latencies are those of answered requests only: a refusal (shed,
    /// or never started) is counted by its kind, not timed.
    fn record(&mut self, scheduled: Instant, sent: Instant, result: Result<(), String>) {
        let micros = |from: Instant| (from.elapsed().as_micros().max(1) as u64).min(60_000_000);
        match result {
            Ok(()) => {
                let _ = self.latency.record(micros(scheduled));
                let _ = self.service.record(micros(sent));
            }
            Err(e) => *self.errors.entry(e).or_default() += 1,
        }
    }

    fn merge(&mut self, other: Tally) {
        let _ = self.latency.add(&other.latency);
        let _ = self.service.add(&other.service);
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (k, v) in other.warmup_errors {
            *self.warmup_errors.entry(k).or_default() += v;
        }
    }
}

async fn closed_loop(plan: Arc<Plan>, args: &Args, measure_from: Instant, end: Instant) -> Tally {
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let plan = plan.clone();
            let stride = args.concurrency as u64;
            let limit = args.requests.unwrap_or(u64::MAX);
            tokio::spawn(async move {
                let mut tally = Tally::new();
                let mut n = w as u64;
                while Instant::now() < end && n < limit {
                    let started = Instant::now();
                    let result = one(&plan, n).await;
                    if started >= measure_from {
                        tally.record(started, started, result);
                    } else {
                        tally.warmup(result);
                    }
                    n += stride;
                }
                tally
            })
        })
        .collect();
    let mut total = Tally::new();
    for w in workers {
        total.merge(w.await.expect("worker"));
    }
    total
}

async fn open_loop(
    plan: Arc<Plan>,
    args: &Args,
    rate: u64,
    measure_from: Instant,
    end: Instant,
) -> Tally {
    let tally = Arc::new(std::sync::Mutex::new(Tally::new()));
    let slots = u32::try_from(args.concurrency).unwrap_or(u32::MAX);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(slots as usize));
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let tick = args.tick;
    let runtime = tokio::runtime::Handle::current();
    // The pacer is a thread of its own that sleeps with the kernel's
    // high-resolution timers (tokio's timer ticks in milliseconds, which
    // would start the requests due within a tick together and count up to
    // a tick of the generator's lateness against the server). Each wake-up
    // starts every request that has come due, and it sleeps at least
    // `--tick`, so a high rate costs batches, not a wake-up per request.
    let pacer = {
        let (tally, in_flight) = (tally.clone(), in_flight.clone());
        tokio::task::spawn_blocking(move || {
            let start = Instant::now();
            let mut shed_by_client = 0u64;
            let mut n = 0u64;
            loop {
                let now = Instant::now();
                let mut scheduled = start + interval.mul_f64(n as f64);
                while scheduled <= now && scheduled < end {
                    match in_flight.clone().try_acquire_owned() {
                        Ok(slot) => {
                            let (plan, tally) = (plan.clone(), tally.clone());
                            runtime.spawn(async move {
                                let sent = Instant::now();
                                let result = one(&plan, n).await;
                                // Latency counts from the scheduled start: a
                                // request that started late because the last
                                // ones were slow pays for it.
                                let mut tally = tally.lock().expect("tally");
                                if scheduled >= measure_from {
                                    tally.record(scheduled, sent, result);
                                } else {
                                    tally.warmup(result);
                                }
                                drop(slot);
                            });
                        }
                        Err(_) if scheduled >= measure_from => shed_by_client += 1,
                        Err(_) => {}
                    }
                    n += 1;
                    scheduled = start + interval.mul_f64(n as f64);
                }
                if scheduled >= end {
                    return shed_by_client;
                }
                std::thread::sleep(scheduled.saturating_duration_since(now).max(tick));
            }
        })
    };
    let shed_by_client = pacer.await.expect("pacer");
    // Every request holds a slot until it has been recorded.
    let _all = in_flight.acquire_many(slots).await.expect("semaphore open");
    let mut tally = std::mem::replace(&mut *tally.lock().expect("tally"), Tally::new());
    if shed_by_client > 0 {
        tally
            .errors
            .insert("CLIENT_IN_FLIGHT_LIMIT".into(), shed_by_client);
    }
    tally
}

/// Drives the scenario `args` ask for and reports it; fails if the run
/// met an error `--allow-errors` does not name.
pub async fn generate(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let scenario = args.scenario;
    let mut clients = Vec::new();
    for _ in 0..args.connections.max(1) {
        clients.push(Client::connect(args.target.clone()).await?);
    }
    let run = format!("r{}", uuid::Uuid::now_v7().simple());
    let permits = match scenario {
        Scenario::Health => Vec::new(),
        Scenario::Contended => create_permits(&clients[0], 1, Some(1_000_000_000)).await,
        _ => create_permits(&clients[0], args.permits.max(1), None).await,
    };
    let mut http = Vec::new();
    if let Scenario::HttpAuthorize = scenario {
        for _ in 0..args.connections.max(1) {
            http.push(http_json::Connection::open(&args.target).await?);
        }
    }
    let mut plan = Plan {
        scenario,
        clients: clients.clone(),
        http,
        permits,
        replay_keys: Vec::new(),
        run: run.clone(),
    };
    if let Scenario::Replay = scenario {
        // 10 000 keys that succeeded, replayed round-robin.
        let setup = Plan {
            scenario: Scenario::Cycle,
            ..plan
        };
        let setup = Arc::new(setup);
        let tasks: Vec<_> = (0..64u64)
            .map(|w| {
                let setup = setup.clone();
                tokio::spawn(async move {
                    let mut n = w;
                    while n < 10_000 {
                        one(&setup, n).await.expect("replay setup");
                        n += 64;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await?;
        }
        let setup = Arc::try_unwrap(setup).ok().expect("setup done");
        plan = Plan {
            scenario: Scenario::Replay,
            replay_keys: (0..10_000u64)
                .map(|n| {
                    (
                        (n as usize) % setup.permits.len(),
                        format!("{}-{n}", setup.run),
                    )
                })
                .collect(),
            ..setup
        };
    }

    let plan = Arc::new(plan);
    let started = Instant::now();
    let (measure_from, end) = match args.requests {
        Some(_) => (started, started + Duration::from_secs(24 * 3600)),
        None => (started + args.warmup, started + args.warmup + args.duration),
    };
    let tally = match args.rate {
        Some(rate) => open_loop(plan, &args, rate.max(1), measure_from, end).await,
        None => closed_loop(plan, &args, measure_from, end).await,
    };
    let elapsed = match args.requests {
        Some(_) => started.elapsed(),
        None => args.duration,
    };
    report(&args, scenario, &tally, elapsed)?;
    let unexpected: BTreeMap<_, _> = tally
        .errors
        .iter()
        .chain(&tally.warmup_errors)
        .filter(|(kind, _)| !args.allow_errors.contains(kind))
        .collect();
    if !unexpected.is_empty() {
        return Err(format!(
            "{scenario:?}: calls did not take the scenario's path: {unexpected:?} \
             (--allow-errors names the kinds a run may meet)"
        )
        .into());
    }
    Ok(())
}

fn report(
    args: &Args,
    scenario: Scenario,
    tally: &Tally,
    elapsed: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    let h = &tally.latency;
    let errors: u64 = tally.errors.values().sum();
    // The histogram holds the answered requests; errors are counted apart.
    let answered = h.len();
    let requests = answered + errors;
    let rpcs_per_request = if let Scenario::Cycle = scenario { 2 } else { 1 };
    let throughput = requests as f64 / elapsed.as_secs_f64();
    let q = |p: f64| h.value_at_quantile(p);
    println!(
        "{:<10} {:<8} {:>10} {:>12.0}/s {:>8}us p50 {:>8}us p90 {:>8}us p99 {:>8}us p99.9 {:>8} errors{}",
        format!("{:?}", scenario).to_lowercase(),
        args.label,
        args.rate
            .map_or_else(|| format!("c={}", args.concurrency), |r| format!("r={r}")),
        throughput,
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        errors,
        if tally.errors.is_empty() {
            String::new()
        } else {
            format!(" {:?}", tally.errors)
        },
    );
    if let Some(path) = &args.json {
        let line = serde_json::json!({
            "scenario": format!("{:?}", scenario).to_lowercase(),
            "label": args.label,
            "mode": if args.rate.is_some() { "open" } else { "closed" },
            "concurrency": args.concurrency,
            "target_rate": args.rate,
            "duration_s": elapsed.as_secs_f64(),
            "warmup_s": if args.requests.is_some() { 0.0 } else { args.warmup.as_secs_f64() },
            "requests": requests,
            "rpcs_per_request": rpcs_per_request,
            "throughput_rps": throughput,
            "ok_rps": answered as f64 / elapsed.as_secs_f64(),
            "errors": errors,
            "error_kinds": tally.errors,
            "p50_us": q(0.5),
            "p90_us": q(0.9),
            "p99_us": q(0.99),
            "p999_us": q(0.999),
            "max_us": h.max(),
            "service_p50_us": tally.service.value_at_quantile(0.5),
            "service_p99_us": tally.service.value_at_quantile(0.99),
            "service_p999_us": tally.service.value_at_quantile(0.999),
        });
        append_json(path, &line)?;
    }
    Ok(())
}

/// Appends `line` to the results file at `path`, as one JSON line.
pub fn append_json(path: &std::path::Path, line: &serde_json::Value) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(f, "{line}")
}
