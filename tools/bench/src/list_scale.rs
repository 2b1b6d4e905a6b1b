//! ListUncertain at scale: what one page costs as a permit's open set grows.
//!
//! For each size N and each store, in process through the
//! [`Store`](atmost::store::Store) trait (far faster to fill than gRPC):
//! one permit (no caps, no budget, duplicate guard OFF, a one-hour lease),
//! N distinct keys authorized `--in-flight` at a time, so N attempts are
//! RESERVED within their lease. Then pages of each of `--pages` (100, the
//! default page, and 1000, the largest) are timed one call at a time, in two
//! situations:
//!
//! - `expired`: the page's attempts are RESERVED ones whose lease has
//!   passed, listed at the instant the page-th earliest lease ends (the
//!   Redis store through a second handle on the caller's clock; every other
//!   attempt is still within its lease);
//! - `marked`: `--uncertain` attempts (as many as the largest page) spread
//!   over the fill marked UNCERTAIN by MarkUncertain, listed now (Redis's
//!   own clock).
//!
//! each for one permit and across all permits (`permit_id` None). Every
//! page is checked: the number of attempts expected, all UNCERTAIN (and, when
//! marked, the marked ones).
//!
//! On Redis it also reports `used_memory` per open attempt, the time Redis
//! spent in list_uncertain.lua per script run (INFO commandstats, FCALL, before
//! and after), and the SLOWLOG at `--slowlog-us` (10 ms): reset before the
//! fill and read after it, reset before the listing and read after it
//! (`slowlog-max-len` raised to 10 000 meanwhile, so none is lost). The
//! previous settings are put back at the end. Without `--redis-url` it
//! starts a `redis-server` of its own on a free loopback port; a Redis given
//! by URL gets keys under a prefix of this run's own, unlinked after each
//! size (an interrupted run leaves them: open attempts never expire).
//!
//! ```text
//! list_scale --sizes 1000,100000,1000000 --json results.jsonl
//! ```

use atmost::domain::{
    AttemptState, AuthorizeCmd, Clock, Decision, GuardMode, MarkUncertainCmd, Millis, PermitSpec,
    Scope, SystemClock, new_id,
};
use atmost::store::Store;
use atmost::store::memory::MemoryStore;
use atmost::store::redis::{RedisConfig, RedisStore, Time, function_name};
use clap::{Parser, ValueEnum};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    Memory,
    Redis,
}

impl StoreKind {
    fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "ListUncertain at scale: one page's cost as a permit's open attempts grow.")]
pub struct Args {
    /// Open attempts in the permit, one fill per size.
    #[arg(long, value_delimiter = ',', default_value = "1000,100000,1000000")]
    pub sizes: Vec<u64>,
    /// The stores to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "memory,redis"
    )]
    pub stores: Vec<StoreKind>,
    /// The Redis to fill (default: a redis-server of its own on a free
    /// loopback port).
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Attempts per ListUncertain page, each measured on the same fill
    /// (ListUncertain's default page is 100, its largest 1000).
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub pages: Vec<usize>,
    /// Attempts marked UNCERTAIN out of each fill (default: the largest
    /// page).
    #[arg(long)]
    pub uncertain: Option<usize>,
    /// Timed pages per measurement (after a tenth as many untimed).
    #[arg(long, default_value_t = 200)]
    pub calls: usize,
    /// Authorize calls in flight while filling.
    #[arg(long, default_value_t = 256)]
    pub in_flight: usize,
    /// The SLOWLOG threshold, in microseconds.
    #[arg(long, default_value_t = 10_000)]
    pub slowlog_us: u64,
    /// Append every result as one JSON line to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

const TOOL: &str = "search";
const LEASE_MS: Millis = 3_600_000;
const DAY_MS: Millis = 86_400_000;

/// What a fill left to list: every lease end, and the attempts chosen to
/// be marked (key, attempt id).
struct Filled {
    leases: Vec<Millis>,
    chosen: Vec<(String, String)>,
    took: Duration,
}

/// The timings of one measurement, in microseconds.
struct Timings {
    p50: f64,
    p99: f64,
    max: f64,
}

fn timings(mut took: Vec<Duration>) -> Timings {
    took.sort();
    let at = |q: f64| {
        let i = ((took.len() as f64 * q).ceil() as usize).clamp(1, took.len()) - 1;
        took[i].as_secs_f64() * 1e6
    };
    Timings {
        p50: at(0.5),
        p99: at(0.99),
        max: at(1.0),
    }
}

fn now() -> Millis {
    SystemClock.now()
}

use crate::fingerprint;

/// One permit as the measurement wants it: one tool, no cap, no budget,
/// duplicate guard OFF, a lease of an hour, expiring in a day.
fn new_permit(now: Millis) -> Result<atmost::domain::Permit, BoxError> {
    let spec = PermitSpec {
        subject: "atmost-list-scale".into(),
        tools: vec![TOOL.into()],
        expires_at: Some(now + DAY_MS),
        lease_ms: Some(LEASE_MS),
        guard_mode: Some(GuardMode::Off),
        ..PermitSpec::default()
    };
    Ok(spec.into_permit(new_id(now), now, "")?)
}

/// Authorizes `n` fresh keys, `in_flight` at a time, every one a DISPATCH.
async fn fill<S: Store>(
    store: &Arc<S>,
    permit_id: &str,
    run: &str,
    n: u64,
    in_flight: usize,
    marked: usize,
) -> Result<Filled, BoxError> {
    let started = Instant::now();
    let step = (n / marked.max(1) as u64).max(1);
    let workers = (in_flight.max(1) as u64).min(n.max(1));
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..workers {
        let (store, permit_id, run) = (store.clone(), permit_id.to_owned(), run.to_owned());
        tasks.spawn(async move {
            let mut leases = Vec::with_capacity((n / workers + 1) as usize);
            let mut chosen = Vec::new();
            let mut i = w;
            while i < n {
                let cmd = AuthorizeCmd {
                    permit_id: permit_id.clone(),
                    tool: TOOL.into(),
                    idempotency_key: format!("{run}-{i}"),
                    request_fingerprint: fingerprint(i),
                    cost: 1,
                    holder_token: Vec::new(),
                    approval_summary: String::new(),
                };
                let now = now();
                let r = store
                    .authorize(&Scope::default(), &cmd, now, new_id(now))
                    .await
                    .map_err(|e| format!("authorize {}: {e}", cmd.idempotency_key))?;
                if r.decision != Decision::Dispatch || r.redelivered {
                    return Err(format!(
                        "authorize {}: not a fresh DISPATCH",
                        cmd.idempotency_key
                    ));
                }
                leases.push(r.attempt.lease_expires_at);
                if i % step == 0 && ((i / step) as usize) < marked {
                    chosen.push((cmd.idempotency_key, r.attempt.attempt_id));
                }
                i += workers;
            }
            Ok::<_, String>((leases, chosen))
        });
    }
    let mut filled = Filled {
        leases: Vec::with_capacity(n as usize),
        chosen: Vec::new(),
        took: Duration::ZERO,
    };
    while let Some(done) = tasks.join_next().await {
        let (leases, chosen) = done??;
        filled.leases.extend(leases);
        filled.chosen.extend(chosen);
    }
    filled.took = started.elapsed();
    Ok(filled)
}

/// Times `calls` pages (after a tenth as many untimed), checking each: the
/// `expected` number of attempts, all UNCERTAIN at `now`, and, when given,
/// only keys of `only`.
#[allow(clippy::too_many_arguments)]
async fn time_pages<S: Store>(
    store: &S,
    permit_id: Option<&str>,
    page: usize,
    calls: usize,
    now: impl Fn() -> Millis,
    expected: usize,
    only: Option<&HashSet<&str>>,
) -> Result<Vec<Duration>, BoxError> {
    let mut took = Vec::with_capacity(calls);
    for call in 0..calls + calls / 10 {
        let at = now();
        let started = Instant::now();
        let listed = store
            .list_uncertain(&Scope::default(), permit_id, None, page, at)
            .await?;
        let elapsed = started.elapsed();
        if listed.attempts.len() != expected {
            return Err(format!(
                "a page of {} attempts where {expected} were expected",
                listed.attempts.len()
            )
            .into());
        }
        for a in &listed.attempts {
            if a.state != AttemptState::Uncertain
                || only.is_some_and(|keys| !keys.contains(a.idempotency_key.as_str()))
            {
                return Err(format!("{} listed as {:?}", a.idempotency_key, a.state).into());
            }
        }
        if call >= calls / 10 {
            took.push(elapsed);
        }
    }
    Ok(took)
}

/// The Redis side of the measurement: a plain connection for INFO, SLOWLOG
/// and cleanup, beside the store's own.
struct RedisSide {
    conn: redis::aio::MultiplexedConnection,
    url: String,
    prefix: String,
    /// Function name -> script name, to tell atmost's scripts in the
    /// SLOWLOG.
    scripts: BTreeMap<String, &'static str>,
    /// The SLOWLOG settings found, put back at the end.
    slowlog_before: Vec<(&'static str, String)>,
    /// A redis-server of our own, if none was given.
    _server: Option<atmost_testkit::RedisServer>,
}

/// One SLOWLOG entry: microseconds, and the command (FCALL named by its
/// script, and for list_uncertain.lua the page size asked for).
#[derive(Debug)]
struct SlowEntry {
    micros: i64,
    command: String,
    page: Option<u64>,
}

/// The SLOWLOG settings the measurement changes: the threshold, and room for
/// every entry of a run.
const SLOWLOG_SETTINGS: [&str; 2] = ["slowlog-log-slower-than", "slowlog-max-len"];

impl RedisSide {
    async fn open(url: Option<&str>, slowlog_us: u64) -> Result<Self, BoxError> {
        let (server, url) = match url {
            Some(url) => (None, url.to_owned()),
            None => {
                let server = atmost_testkit::RedisServer::start()?;
                let url = server.url();
                (Some(server), url)
            }
        };
        let client = redis::Client::open(atmost::store::redis::connection_info(&url)?)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let mut slowlog_before = Vec::new();
        for (name, value) in SLOWLOG_SETTINGS.into_iter().zip([slowlog_us, 10_000]) {
            let found: Vec<String> = redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async(&mut conn)
                .await?;
            if let Some(found) = found.get(1) {
                slowlog_before.push((name, found.clone()));
            }
            redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .exec_async(&mut conn)
                .await?;
        }
        let scripts = [
            "create_permit",
            "get_permit",
            "revoke_permit",
            "authorize",
            "settle",
            "mark_uncertain",
            "list_uncertain",
        ]
        .into_iter()
        .filter_map(|name| Some((function_name(name)?.to_owned(), name)))
        .collect();
        Ok(Self {
            conn,
            url,
            prefix: format!("listscale{}", uuid::Uuid::now_v7().simple()),
            scripts,
            slowlog_before,
            _server: server,
        })
    }

    fn store(&self, time: Time) -> Result<RedisStore, BoxError> {
        Ok(RedisStore::connect(&RedisConfig {
            url: self.url.clone(),
            prefix: self.prefix.clone(),
            retention_ms: 60_000,
            timeout: Duration::from_secs(10),
            allow_eviction: false,
            time,
            tls_ca: None,
            ..RedisConfig::new("", "")
        })?
        // A million open attempts on one permit: far past the quotas.
        .with_quotas(atmost::domain::Quotas::UNLIMITED))
    }

    async fn info_field(&mut self, section: &str, field: &str) -> Result<i64, BoxError> {
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut self.conn)
            .await?;
        info.lines()
            .find_map(|l| {
                l.strip_prefix(field)?
                    .strip_prefix(':')?
                    .trim()
                    .parse()
                    .ok()
            })
            .ok_or_else(|| format!("INFO {section} has no {field}").into())
    }

    /// Calls of FCALL so far and the microseconds Redis spent in them
    /// (INFO commandstats; a script's time includes its own commands').
    async fn fcall_stats(&mut self) -> Result<(i64, i64), BoxError> {
        let (calls, usec) = crate::command_stats(&mut self.conn, "fcall")
            .await
            .map_err(|e| -> BoxError { e })?;
        Ok((i64::try_from(calls)?, i64::try_from(usec)?))
    }

    async fn slowlog_reset(&mut self) -> Result<(), BoxError> {
        redis::cmd("SLOWLOG")
            .arg("RESET")
            .exec_async(&mut self.conn)
            .await?;
        Ok(())
    }

    async fn slowlog(&mut self) -> Result<Vec<SlowEntry>, BoxError> {
        let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg(1000)
            .query_async(&mut self.conn)
            .await?;
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            redis::Value::SimpleString(s) => s.clone(),
            other => format!("{other:?}"),
        };
        let mut out = Vec::new();
        for entry in entries {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let micros = match fields.get(2) {
                Some(redis::Value::Int(us)) => *us,
                _ => -1,
            };
            let args: Vec<String> = match fields.get(3) {
                Some(redis::Value::Array(args)) => args.iter().map(text).collect(),
                _ => Vec::new(),
            };
            let mut command = args.first().cloned().unwrap_or_default().to_uppercase();
            let mut page = None;
            if command != "FCALL"
                && let Some(key) = args.get(1)
            {
                // Which of a permit's keys ("...:open"): Redis 7.0 also
                // logs the commands a script runs.
                command = format!("{command} :{}", key.rsplit(':').next().unwrap_or(key));
            } else if command == "FCALL"
                && let Some(name) = args.get(1).and_then(|f| self.scripts.get(f))
            {
                command = format!("FCALL {name}.lua");
                if *name == "list_uncertain" {
                    // FCALL function 3 KEYS[1..3] now after limit margin
                    page = args.get(8).and_then(|limit| limit.parse().ok());
                }
            }
            out.push(SlowEntry {
                micros,
                command,
                page,
            });
        }
        Ok(out)
    }

    /// Waits until Redis has freed what UNLINK handed to its background
    /// thread, so the next fill's memory reading starts from rest.
    async fn settle_memory(&mut self) -> Result<(), BoxError> {
        for _ in 0..600 {
            if self
                .info_field("memory", "lazyfree_pending_objects")
                .await?
                == 0
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Unlinks one permit's keys and the indexes (lib.lua's layout), which
    /// hold that permit alone.
    async fn drop_permit(&mut self, permit_id: &str) -> Result<(), BoxError> {
        let base = format!("{}:{{{permit_id}}}", self.prefix);
        let mut unlink = redis::cmd("UNLINK");
        for k in ["permit", "attempts", "open", "dup", "held"] {
            unlink.arg(format!("{base}:{k}"));
        }
        unlink.exec_async(&mut self.conn).await?;
        redis::cmd("UNLINK")
            .arg(format!("{}:permits", self.prefix))
            .arg(format!("{}:uncertain:{{0}}", self.prefix))
            .arg(format!("{}:uncertain:{{0}}:t:", self.prefix))
            .exec_async(&mut self.conn)
            .await?;
        self.settle_memory().await
    }

    async fn restore(&mut self) -> Result<(), BoxError> {
        for (name, value) in &self.slowlog_before {
            redis::cmd("CONFIG")
                .arg("SET")
                .arg(*name)
                .arg(value)
                .exec_async(&mut self.conn)
                .await?;
        }
        Ok(())
    }
}

/// The results so far: printed as they come, and as JSON lines.
struct Out {
    rows: Vec<serde_json::Value>,
    json: Option<std::fs::File>,
}

impl Out {
    fn push(&mut self, row: serde_json::Value) -> Result<(), BoxError> {
        if let Some(f) = &mut self.json {
            writeln!(f, "{row}")?;
        }
        self.rows.push(row);
        Ok(())
    }
}

/// Runs the measurement `args` ask for and returns the rows it wrote (one
/// per fill, one per timed measurement).
pub async fn run(args: Args) -> Result<Vec<serde_json::Value>, BoxError> {
    let json = match &args.json {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => None,
    };
    let mut out = Out {
        rows: Vec::new(),
        json,
    };
    let mut redis = match args.stores.contains(&StoreKind::Redis) {
        true => Some(RedisSide::open(args.redis_url.as_deref(), args.slowlog_us).await?),
        false => None,
    };
    println!(
        "ListUncertain: time per page, one call at a time, {} calls; \
         'in Redis': list_uncertain.lua's own time per script run (INFO commandstats)",
        args.calls
    );
    println!(
        "{:<7}{:>9}{:>6}  {:<8}{:<8}{:>10}{:>10}{:>10}{:>11}",
        "store", "open", "page", "listing", "scope", "p50", "p99", "max", "in Redis"
    );
    let result = measure_all(&args, redis.as_mut(), &mut out).await;
    if let Some(redis) = redis.as_mut() {
        redis.restore().await?;
    }
    result?;
    Ok(out.rows)
}

async fn measure_all(
    args: &Args,
    mut redis: Option<&mut RedisSide>,
    out: &mut Out,
) -> Result<(), BoxError> {
    for &kind in &args.stores {
        for &n in &args.sizes {
            match kind {
                StoreKind::Memory => {
                    let store = Arc::new(
                        MemoryStore::new(60_000).with_quotas(atmost::domain::Quotas::UNLIMITED),
                    );
                    measure(args, kind, n, &store, &store, None, out).await?;
                }
                StoreKind::Redis => {
                    let side = redis
                        .as_deref_mut()
                        .expect("a Redis side for the Redis store");
                    let store = Arc::new(side.store(Time::Redis)?);
                    warm_up(&store, side).await?;
                    let caller = Arc::new(side.store(Time::Caller)?);
                    measure(args, kind, n, &store, &caller, Some(side), out).await?;
                }
            }
        }
    }
    Ok(())
}

/// One permit, one key marked and listed, then dropped: Redis loads the
/// library before the first memory reading, so no fill is charged for it.
async fn warm_up(store: &Arc<RedisStore>, side: &mut RedisSide) -> Result<(), BoxError> {
    let permit = store.create_permit(new_permit(now())?).await?;
    let filled = fill(store, &permit.permit_id, "warm-up", 1, 1, 1).await?;
    for (key, attempt_id) in filled.chosen {
        let cmd = MarkUncertainCmd {
            permit_id: permit.permit_id.clone(),
            idempotency_key: key,
            attempt_id,
            reason: "list-scale".into(),
        };
        store.mark_uncertain(&Scope::default(), &cmd, now()).await?;
    }
    for scope in [Some(permit.permit_id.as_str()), None] {
        store
            .list_uncertain(&Scope::default(), scope, None, 1, now())
            .await?;
    }
    side.drop_permit(&permit.permit_id).await
}

/// One fill of `n` and its measurements. `at_caller_time` is the same
/// store deciding on the `now` it is given (the memory store always does).
async fn measure<S: Store>(
    args: &Args,
    kind: StoreKind,
    n: u64,
    store: &Arc<S>,
    at_caller_time: &Arc<S>,
    mut redis: Option<&mut RedisSide>,
    out: &mut Out,
) -> Result<(), BoxError> {
    let label = format!("list-scale-{}", kind.name());
    let permit = store.create_permit(new_permit(now())?).await?;
    let permit_id = permit.permit_id.clone();
    let run = format!("r{}", uuid::Uuid::now_v7().simple());

    let mut memory_before = 0;
    if let Some(r) = redis.as_deref_mut() {
        memory_before = r.info_field("memory", "used_memory").await?;
        r.slowlog_reset().await?;
    }
    let largest = args.pages.iter().copied().max().unwrap_or(0);
    let to_mark = args.uncertain.unwrap_or(largest);
    let filled = fill(store, &permit_id, &run, n, args.in_flight, to_mark).await?;
    let mut fill_row = serde_json::json!({
        "label": label,
        "scenario": "list_uncertain_fill",
        "store": kind.name(),
        "open": n,
        "fill_s": filled.took.as_secs_f64(),
        "fill_rps": n as f64 / filled.took.as_secs_f64(),
    });
    let mut fill_note = String::new();
    if let Some(r) = redis.as_deref_mut() {
        let memory_after = r.info_field("memory", "used_memory").await?;
        let slow_fill = r.slowlog().await?;
        let per_attempt = (memory_after - memory_before) as f64 / n.max(1) as f64;
        fill_row["redis_bytes_per_open_attempt"] = per_attempt.round().into();
        fill_row["slowlog_threshold_us"] = args.slowlog_us.into();
        fill_row["slowlog_fill_entries"] = slow_fill.len().into();
        fill_row["slowlog_fill_max_us"] = slow_fill.iter().map(|e| e.micros).max().into();
        fill_note = format!(
            ", {per_attempt:.0} B of Redis memory per open attempt, SLOWLOG >{} ms during the fill: {}",
            args.slowlog_us / 1000,
            describe(&slow_fill)
        );
        r.slowlog_reset().await?;
    }

    // A full page of RESERVED attempts past their lease: listed at the end
    // of the page-th earliest lease, every later one still within its own.
    let mut leases = filled.leases;
    let mut phases = Vec::new();
    for &page in &args.pages {
        let expected = page.min(leases.len());
        let expired_at = match expected {
            0 => now(),
            k => *leases.select_nth_unstable(k - 1).1,
        };
        for scope in [Some(permit_id.as_str()), None] {
            let t = timed(&mut redis, async {
                let store = &**at_caller_time;
                time_pages(
                    store,
                    scope,
                    page,
                    args.calls,
                    || expired_at,
                    expected,
                    None,
                )
                .await
            })
            .await?;
            phases.push((page, "expired", scope.is_some(), t));
        }
    }
    drop(leases);

    // Then the marked ones: uncertain since now, before every lease ends.
    let marked: HashSet<&str> = filled.chosen.iter().map(|(k, _)| k.as_str()).collect();
    for (key, attempt_id) in &filled.chosen {
        let cmd = MarkUncertainCmd {
            permit_id: permit_id.clone(),
            idempotency_key: key.clone(),
            attempt_id: attempt_id.clone(),
            reason: "list-scale".into(),
        };
        store.mark_uncertain(&Scope::default(), &cmd, now()).await?;
    }
    for &page in &args.pages {
        let expected = page.min(marked.len());
        for scope in [Some(permit_id.as_str()), None] {
            let t = timed(&mut redis, async {
                let store = &**store;
                time_pages(store, scope, page, args.calls, now, expected, Some(&marked)).await
            })
            .await?;
            phases.push((page, "marked", scope.is_some(), t));
        }
    }

    let slow_list = match redis.as_deref_mut() {
        Some(r) => Some(r.slowlog().await?),
        None => None,
    };
    for (page, listing, one_permit, (took, redis_us)) in phases {
        let t = timings(took);
        let scope = if one_permit { "permit" } else { "all" };
        println!(
            "{:<7}{:>9}{:>6}  {:<8}{:<8}{:>8.0}us{:>8.0}us{:>8.0}us{:>11}",
            kind.name(),
            n,
            page,
            listing,
            scope,
            t.p50,
            t.p99,
            t.max,
            redis_us.map_or_else(|| "-".into(), |us| format!("{us:.0}us")),
        );
        out.push(serde_json::json!({
            "label": label,
            "scenario": "list_uncertain",
            "store": kind.name(),
            "open": n,
            "listing": listing,
            "scope": scope,
            "page": page,
            "calls": args.calls,
            "p50_us": t.p50,
            "p99_us": t.p99,
            "max_us": t.max,
            "redis_script_us": redis_us,
        }))?;
    }
    if let Some(slow) = &slow_list {
        fill_row["slowlog_list_entries"] = slow.len().into();
        fill_row["slowlog_list_max_us"] = slow.iter().map(|e| e.micros).max().into();
        fill_row["slowlog_list"] = slow
            .iter()
            .map(|e| serde_json::json!({"us": e.micros, "command": e.command, "page": e.page}))
            .collect();
        fill_note.push_str(&format!("; during the listing: {}", describe(slow)));
    }
    println!(
        "{:<7}{:>9}  filled in {:.1} s ({:.0}/s){fill_note}",
        kind.name(),
        n,
        filled.took.as_secs_f64(),
        n as f64 / filled.took.as_secs_f64(),
    );
    out.push(fill_row)?;

    if let Some(r) = redis {
        r.drop_permit(&permit_id).await?;
    }
    Ok(())
}

/// Runs one measurement, and on Redis reads around it the time Redis spent
/// in list_uncertain.lua per script run (a page of up to 200 attempts is
/// one run, a larger one several; a page
/// across permits also reads the index, one ZRANGEBYLEX, not counted).
async fn timed(
    redis: &mut Option<&mut RedisSide>,
    pages: impl Future<Output = Result<Vec<Duration>, BoxError>>,
) -> Result<(Vec<Duration>, Option<f64>), BoxError> {
    let before = match redis.as_deref_mut() {
        Some(r) => Some(r.fcall_stats().await?),
        None => None,
    };
    let took = pages.await?;
    let per_page = match (redis.as_deref_mut(), before) {
        (Some(r), Some((calls0, usec0))) => {
            let (calls1, usec1) = r.fcall_stats().await?;
            Some((usec1 - usec0) as f64 / (calls1 - calls0).max(1) as f64)
        }
        _ => None,
    };
    Ok((took, per_page))
}

fn describe(slow: &[SlowEntry]) -> String {
    if slow.is_empty() {
        return "no entry".into();
    }
    let mut by_command: BTreeMap<(&str, Option<u64>), (usize, i64)> = BTreeMap::new();
    for e in slow {
        let c = by_command.entry((&e.command, e.page)).or_default();
        c.0 += 1;
        c.1 = c.1.max(e.micros);
    }
    by_command
        .iter()
        .map(|((cmd, page), (count, max))| {
            let page = page.map_or_else(String::new, |p| format!(", page {p}"));
            format!("{count} x {cmd}{page} (max {:.1} ms)", *max as f64 / 1e3)
        })
        .collect::<Vec<_>>()
        .join(", ")
}
