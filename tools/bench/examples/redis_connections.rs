#![forbid(unsafe_code)]
//! The Redis connection strategy, measured (docs/performance.md): the
//! authorize script as the Redis store sends it (`script_text`, EVALSHA, a
//! fresh key each call), driven by the same number of concurrent
//! tasks through
//!
//! - `multiplexed`: one `redis::aio::ConnectionManager` shared by every task
//!   (what the Redis store uses): requests are pipelined on one connection;
//! - `pool-N`: a `deadpool-redis` pool of N connections, one checkout per
//!   call (deadpool recycles a connection on every checkout with
//!   UNWATCH + PING).
//!
//! Reports calls/s, latency percentiles and the client's own CPU per call
//! (utime + stime of this process, from /proc/self/stat), side by side.
//!
//! ```text
//! cargo run --release --example redis_connections -- --redis-url redis://127.0.0.1:6379
//! ```

use atmost::domain::new_id;
use atmost::store::redis::{connection_info, script_body, script_text, unpack_reply};
use clap::Parser;
use hdrhistogram::Histogram;
use redis::Script;
use redis::aio::ConnectionManager;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

#[derive(Parser, Debug)]
#[command(about = "Multiplexed connection against a deadpool pool, on atmost's authorize script.")]
struct Args {
    /// The Redis to measure against; only loopback addresses belong here.
    #[arg(long, env = "REDIS_URL")]
    redis_url: String,
    /// Tasks calling at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Calls per strategy (after a warmup of a tenth as many).
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Pool sizes to measure (the multiplexed connection is always measured).
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    pool_sizes: Vec<usize>,
    /// Append each result as one JSON line to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One way of getting a connection for a call.
#[derive(Clone)]
enum Strategy {
    Multiplexed(ConnectionManager),
    Pool(deadpool_redis::Pool),
}

impl Strategy {
    async fn eval(&self, inv: &redis::ScriptInvocation<'_>) -> redis::RedisResult<redis::Value> {
        match self {
            Strategy::Multiplexed(conn) => inv.invoke_async(&mut conn.clone()).await,
            Strategy::Pool(pool) => {
                let mut conn = pool.get().await.map_err(|e| {
                    redis::RedisError::from((redis::ErrorKind::Io, "pool", e.to_string()))
                })?;
                inv.invoke_async(&mut conn).await
            }
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
}

/// Runs `n` calls over `concurrency` tasks, with keys `key-{phase}-{i}`
/// (fresh in every phase, so every call is a new reservation); returns the
/// latency histogram.
async fn drive(
    strategy: &Strategy,
    script: &Arc<Script>,
    prefix: &str,
    phase: &'static str,
    concurrency: usize,
    n: u64,
) -> Histogram<u64> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (strategy, script, next) = (strategy.clone(), script.clone(), next.clone());
        let base = format!("{prefix}:{{00000000-0000-7000-8000-000000000000}}");
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new(3).expect("histogram");
            let keys = ["permit", "attempts", "open", "dup", "held"].map(|k| format!("{base}:{k}"));
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return hist;
                }
                let now = now_ms();
                let id = uuid::Uuid::parse_str(&new_id(now)).expect("uuid");
                let mut inv = script.prepare_invoke();
                for k in &keys {
                    inv.key(k);
                }
                // "": Redis's clock, as `atmost serve` runs the script.
                inv.arg("")
                    .arg("search")
                    .arg(format!("key-{phase}-{i}"))
                    .arg(format!("fp-{i:032}").as_bytes())
                    .arg(1)
                    .arg(id.as_bytes().as_slice())
                    .arg(""); // no holder token
                let started = Instant::now();
                let reply = strategy.eval(&inv).await;
                // Only a fresh reservation counts: anything else took a
                // shorter path through the script. Unpacking the reply is
                // part of the work, as in the Redis store.
                let decision = match &reply {
                    Ok(redis::Value::BulkString(packed)) => {
                        unpack_reply(packed).ok().and_then(|v| v.into_iter().next())
                    }
                    _ => None,
                };
                assert_eq!(
                    decision,
                    Some(redis::Value::BulkString(b"DISPATCH".to_vec())),
                    "{reply:?}"
                );
                hist.record(started.elapsed().as_micros() as u64)
                    .expect("record");
            }
        }));
    }
    let mut all = Histogram::<u64>::new(3).expect("histogram");
    for t in tasks {
        all.add(t.await.expect("task")).expect("merge");
    }
    all
}

async fn setup_permit(conn: &mut ConnectionManager, prefix: &str) -> redis::RedisResult<()> {
    let permit = format!("{prefix}:{{00000000-0000-7000-8000-000000000000}}:permit");
    let exp = now_ms() + 86_400_000;
    // The fields authorize.lua reads, as the store writes them.
    redis::cmd("HSET")
        .arg(&permit)
        .arg(&[
            ("exp", exp.to_string()),
            ("fa", (exp + 86_400_000).to_string()),
            ("status", "1".into()),
            ("lease", "30000".into()),
            ("gmode", "1".into()),
            ("gwin", "600000".into()),
            ("committed", "0".into()),
            ("reserved", "0".into()),
            ("open", "0".into()),
            ("t:search", String::new()),
        ])
        .exec_async(conn)
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // The same connection settings as atmost's store, for every strategy.
    let info = connection_info(&args.redis_url)?;
    let client = redis::Client::open(info.clone())?;
    let script = Arc::new(Script::new(&script_text(
        script_body("authorize").expect("the authorize script"),
    )));
    let mut strategies = vec![(
        "multiplexed".to_owned(),
        Strategy::Multiplexed(ConnectionManager::new(client.clone()).await?),
    )];
    for size in &args.pool_sizes {
        let pool = deadpool_redis::Pool::builder(deadpool_redis::Manager::new(info.clone())?)
            .max_size(*size)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()?;
        strategies.push((format!("pool-{size}"), Strategy::Pool(pool)));
    }
    let mut admin = ConnectionManager::new(client).await?;
    println!(
        "{:<12} {:>10} {:>9} {:>9} {:>9} {:>14}",
        "strategy", "calls/s", "p50", "p99", "p99.9", "client cpu/call"
    );
    for (name, strategy) in &strategies {
        let prefix = format!("connbench-{}", uuid::Uuid::now_v7().simple());
        setup_permit(&mut admin, &prefix).await?;
        drive(
            strategy,
            &script,
            &prefix,
            "warmup",
            args.concurrency,
            args.requests / 10,
        )
        .await;
        let ticks = cpu_ticks();
        let started = Instant::now();
        let hist = drive(
            strategy,
            &script,
            &prefix,
            "measured",
            args.concurrency,
            args.requests,
        )
        .await;
        let elapsed = started.elapsed().as_secs_f64();
        // CLK_TCK is 100 on Linux: one tick is 10 ms.
        let cpu_us = (cpu_ticks() - ticks) as f64 * 10_000.0 / args.requests as f64;
        let rate = args.requests as f64 / elapsed;
        let q = |p: f64| hist.value_at_quantile(p);
        println!(
            "{name:<12} {rate:>10.0} {:>7}us {:>7}us {:>7}us {cpu_us:>12.1}us",
            q(0.5),
            q(0.99),
            q(0.999)
        );
        if let Some(path) = &args.json {
            let line = serde_json::json!({
                "label": "redis-connections", "strategy": name,
                "concurrency": args.concurrency, "requests": args.requests,
                "rps": rate, "p50_us": q(0.5), "p99_us": q(0.99), "p999_us": q(0.999),
                "client_cpu_us_per_call": cpu_us,
            });
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            writeln!(f, "{line}")?;
        }
        // Leave nothing behind in a shared Redis.
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}:*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut admin)
                .await?;
            if !keys.is_empty() {
                redis::cmd("DEL").arg(&keys).exec_async(&mut admin).await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(())
}
