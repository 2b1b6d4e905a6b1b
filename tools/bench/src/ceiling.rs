//! The benchmark's Redis ceiling (a), and the connection strategy beside
//! it: the authorize script driven the way the Redis store drives it, so
//! the ceiling cannot measure another path.
//!
//! Every call is built by the store's own code
//! ([`RedisStore::authorize_command`]: the same keys, the same arguments,
//! byte for byte) on permits the store created ([`Store::create_permit`]),
//! and every reply is read by the store's own reader
//! ([`RedisStore::authorize_reply`]): a call that is not a fresh DISPATCH
//! (a refusal, a replay, an error) stops the run with what it was. Each
//! strategy sends the same calls through
//!
//! - `multiplexed`: one `redis::aio::ConnectionManager` shared by every
//!   task, requests pipelined on it (what the Redis store does);
//! - `connections-N`: N connections, the tasks spread over them (with N
//!   at the concurrency, one call in flight on each, as `redis-benchmark
//!   -c N` does);
//! - `pool-N`: a `deadpool-redis` pool of N connections, one checkout per
//!   call (deadpool recycles a connection on every checkout).
//!
//! For each: calls/s, latency percentiles, this client's own CPU per call
//! (utime + stime from /proc/self/stat) and Redis's own time per script
//! run (`INFO commandstats` after `CONFIG RESETSTAT`: meaningful on a
//! Redis nothing else uses, as the benchmark's).

use atmost::domain::{
    AuthorizeCmd, Clock, Decision, PermitSpec, Quotas, Scope, SystemClock, new_id,
};
use atmost::store::Store;
use atmost::store::redis::{RedisConfig, RedisStore, connection_info};
use clap::Parser;
use hdrhistogram::Histogram;
use redis::aio::ConnectionManager;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser, Debug)]
#[command(
    about = "The authorize script as the Redis store sends it: Redis's ceiling, by connection strategy."
)]
pub struct Args {
    /// The Redis to measure (its commandstats are reset: one nothing else
    /// uses).
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: String,
    /// Tasks calling at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Calls per strategy (after a warmup of a tenth as many).
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// Permits the calls are spread over (as the load generator does).
    #[arg(long, default_value_t = 16)]
    pub permits: usize,
    /// Strategies, in order: multiplexed, connections-N, pool-N.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "multiplexed,connections-64,pool-8,pool-64"
    )]
    pub strategies: Vec<String>,
    /// Append each strategy's result as one JSON line to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One way of getting a connection for a call.
#[derive(Clone)]
enum Strategy {
    Multiplexed(ConnectionManager),
    /// One connection per task, by task number.
    Connections(Arc<Vec<ConnectionManager>>),
    Pool(deadpool_redis::Pool),
}

impl Strategy {
    async fn open(
        name: &str,
        client: &redis::Client,
        info: &redis::ConnectionInfo,
    ) -> Result<Self, BoxError> {
        let size = |prefix: &str| -> Result<Option<usize>, BoxError> {
            name.strip_prefix(prefix)
                .map(|n| {
                    n.parse::<usize>()
                        .map_err(|e| format!("{name}: {e}").into())
                })
                .transpose()
        };
        if name == "multiplexed" {
            return Ok(Self::Multiplexed(
                ConnectionManager::new(client.clone()).await?,
            ));
        }
        if let Some(n) = size("connections-")? {
            let mut conns = Vec::with_capacity(n);
            for _ in 0..n.max(1) {
                conns.push(ConnectionManager::new(client.clone()).await?);
            }
            return Ok(Self::Connections(Arc::new(conns)));
        }
        if let Some(n) = size("pool-")? {
            let pool = deadpool_redis::Pool::builder(deadpool_redis::Manager::new(info.clone())?)
                .max_size(n.max(1))
                .runtime(deadpool_redis::Runtime::Tokio1)
                .build()?;
            return Ok(Self::Pool(pool));
        }
        Err(format!("no strategy {name:?}: multiplexed, connections-N or pool-N").into())
    }

    async fn call(&self, task: usize, cmd: &redis::Cmd) -> redis::RedisResult<Vec<u8>> {
        match self {
            Self::Multiplexed(conn) => cmd.query_async(&mut conn.clone()).await,
            Self::Connections(conns) => {
                cmd.query_async(&mut conns[task % conns.len()].clone())
                    .await
            }
            Self::Pool(pool) => {
                let mut conn = pool.get().await.map_err(|e| {
                    redis::RedisError::from((redis::ErrorKind::Io, "pool", e.to_string()))
                })?;
                cmd.query_async(&mut conn).await
            }
        }
    }
}

fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

/// The request one call makes: a fresh key and fingerprint for call `n`.
fn command(permit_id: &str, run: &str, n: u64) -> AuthorizeCmd {
    AuthorizeCmd {
        permit_id: permit_id.to_owned(),
        tool: "search".into(),
        idempotency_key: format!("{run}-{n}"),
        // 32 bytes, unique per key (as a SHA-256 would be).
        request_fingerprint: (0..4u64)
            .flat_map(|i| (n ^ (i << 60)).to_le_bytes())
            .collect(),
        cost: 1,
        holder_token: Vec::new(),
        approval_summary: String::new(),
    }
}

/// `n` calls over `concurrency` tasks, keys `{run}-{i}` spread over the
/// permits; every one must be a fresh DISPATCH. The latency histogram.
async fn drive(
    store: &Arc<RedisStore>,
    strategy: &Strategy,
    permits: &Arc<Vec<String>>,
    run: &str,
    concurrency: usize,
    n: u64,
) -> Result<Histogram<u64>, BoxError> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for task in 0..concurrency.max(1) {
        let (store, strategy, permits, next) = (
            store.clone(),
            strategy.clone(),
            permits.clone(),
            next.clone(),
        );
        let run = run.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new(3).expect("histogram");
            let scope = Scope::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, BoxError>(hist);
                }
                let cmd = command(&permits[i as usize % permits.len()], &run, i);
                let now = SystemClock.now();
                let started = Instant::now();
                let wire = store.authorize_command(&scope, &cmd, now, &new_id(now));
                let packed = strategy.call(task, &wire).await?;
                // Read as the store reads it: part of the work, and the
                // proof that this call took the path it claims.
                let answer = RedisStore::authorize_reply(&cmd, &packed)
                    .map_err(|e| format!("call {i}: not a DISPATCH but {e}"))?;
                if answer.decision != Decision::Dispatch || answer.redelivered {
                    return Err(format!(
                        "call {i}: {:?} (redelivered: {}), not a fresh DISPATCH",
                        answer.decision, answer.redelivered
                    )
                    .into());
                }
                hist.record(started.elapsed().as_micros() as u64)
                    .expect("record");
            }
        }));
    }
    let mut all = Histogram::<u64>::new(3).expect("histogram");
    for t in tasks {
        all.add(t.await??).expect("merge");
    }
    Ok(all)
}

/// Runs every strategy of `args` and reports each.
pub async fn run(args: Args) -> Result<(), BoxError> {
    let info = connection_info(&args.redis_url)?;
    let client = redis::Client::open(info.clone())?;
    let prefix = format!("ceiling{}", uuid::Uuid::now_v7().simple());
    // As the benchmark's server runs: dev mode, Redis's clock, no quota on
    // open attempts or keys (--max-open-attempts 0 --max-attempts-per-permit 0).
    let store = Arc::new(
        RedisStore::connect(&RedisConfig::new(args.redis_url.clone(), prefix.clone()))?
            .with_quotas(Quotas {
                max_open_attempts: 0,
                max_attempts: 0,
                ..Quotas::DEFAULT
            }),
    );
    let mut admin = ConnectionManager::new(client.clone()).await?;
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(atmost::store::redis::library_text())
        .exec_async(&mut admin)
        .await?;
    println!(
        "{:<16} {:>10} {:>9} {:>9} {:>9} {:>16} {:>18}",
        "strategy", "calls/s", "p50", "p99", "p99.9", "client cpu/call", "Redis time/script"
    );
    let measured = measure(&args, &store, &client, &info, &mut admin).await;
    // Leave nothing behind in a shared Redis, whatever happened.
    let cleaned = cleanup(&mut admin, &prefix).await;
    measured.and(cleaned)
}

/// Each strategy of `args` in turn, reported.
async fn measure(
    args: &Args,
    store: &Arc<RedisStore>,
    client: &redis::Client,
    info: &redis::ConnectionInfo,
    admin: &mut ConnectionManager,
) -> Result<(), BoxError> {
    for name in &args.strategies {
        let strategy = Strategy::open(name, client, info).await?;
        let now = SystemClock.now();
        let mut permits = Vec::with_capacity(args.permits);
        for _ in 0..args.permits.max(1) {
            let spec = PermitSpec {
                subject: "atmost-bench".into(),
                tools: vec!["search".into()],
                expires_at: Some(now + 86_400_000),
                ..PermitSpec::default()
            };
            permits.push(
                store
                    .create_permit(spec.into_permit(new_id(now), now, "")?)
                    .await?
                    .permit_id,
            );
        }
        let permits = Arc::new(permits);
        let run = format!("r{}", uuid::Uuid::now_v7().simple());
        drive(
            store,
            &strategy,
            &permits,
            &format!("{run}w"),
            args.concurrency,
            (args.requests / 10).max(1),
        )
        .await?;
        redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .exec_async(admin)
            .await?;
        let ticks = cpu_ticks();
        let started = Instant::now();
        let hist = drive(
            store,
            &strategy,
            &permits,
            &run,
            args.concurrency,
            args.requests,
        )
        .await?;
        let elapsed = started.elapsed().as_secs_f64();
        let (calls, usec) = crate::command_stats(admin, "fcall").await?;
        let usec_per_call = usec as f64 / calls.max(1) as f64;
        if calls < args.requests {
            return Err(format!(
                "{name}: Redis counted {calls} FCALL for {} calls",
                args.requests
            )
            .into());
        }
        // CLK_TCK is 100 on Linux: one tick is 10 ms.
        let cpu_us = (cpu_ticks() - ticks) as f64 * 10_000.0 / args.requests as f64;
        let rate = args.requests as f64 / elapsed;
        let q = |p: f64| hist.value_at_quantile(p);
        println!(
            "{name:<16} {rate:>10.0} {:>7}us {:>7}us {:>7}us {cpu_us:>14.1}us {usec_per_call:>16.2}us",
            q(0.5),
            q(0.99),
            q(0.999)
        );
        if let Some(path) = &args.json {
            let line = serde_json::json!({
                "label": "redis-ceiling", "strategy": name,
                "concurrency": args.concurrency, "requests": args.requests,
                "rps": rate, "p50_us": q(0.5), "p99_us": q(0.99), "p999_us": q(0.999),
                "client_cpu_us_per_call": cpu_us, "script_usec_per_call": usec_per_call,
            });
            crate::append_json(path, &line)?;
        }
    }
    Ok(())
}

/// Deletes every key under `prefix` (UNLINK: a permit's attempts hash
/// holds a run's worth of records, which DEL would free within the
/// connection's response timeout, or not).
async fn cleanup(admin: &mut ConnectionManager, prefix: &str) -> Result<(), BoxError> {
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(admin)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK").arg(&keys).exec_async(admin).await?;
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    Ok(())
}
