//! Reconciling across permits at scale: what a whole cross-permit
//! ListUncertain walk and an uncertain census cost when many permits are
//! live and few attempts are uncertain.
//!
//! For each store, in process through the [`Store`] trait: `--permits`
//! live permits (created `--in-flight` at a time), an attempt RESERVED
//! within its one-hour lease in each of `--reserved` of them (calls in
//! flight, which neither walk may count), and an attempt marked UNCERTAIN
//! in each of `--uncertain` others. Then, one call at a time, `--calls`
//! times each: the whole walk (pages of `--page` until no token is left),
//! checked to list exactly the uncertain attempts, each once; and a census,
//! checked to count exactly them. On Redis the store gets a prefix of this
//! run's own, unlinked at the end (or, without `--redis-url`, a
//! `redis-server` of its own).
//!
//! ```text
//! cross_scale --permits 100000 --uncertain 100 --json results.jsonl
//! ```

use atmost::domain::{
    AttemptState, AuthorizeCmd, Decision, GuardMode, MarkUncertainCmd, Millis, PermitSpec, Quotas,
    Scope, SystemClock, new_id,
};
use atmost::store::memory::MemoryStore;
use atmost::store::redis::{RedisConfig, RedisStore};
use atmost::store::{Cursor, Store};
use clap::Parser;
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::list_scale::StoreKind;

type BoxError = Box<dyn std::error::Error>;

#[derive(Parser, Debug)]
#[command(about = "Cross-permit ListUncertain and the census with many live permits.")]
pub struct Args {
    /// Live permits.
    #[arg(long, default_value_t = 100_000)]
    pub permits: usize,
    /// Permits holding one UNCERTAIN attempt each.
    #[arg(long, default_value_t = 100)]
    pub uncertain: usize,
    /// Permits holding one RESERVED attempt within its lease each.
    #[arg(long, default_value_t = 1_000)]
    pub reserved: usize,
    /// The page size of the walk.
    #[arg(long, default_value_t = 100)]
    pub page: usize,
    /// Timed walks and censuses, each.
    #[arg(long, default_value_t = 5)]
    pub calls: usize,
    /// Creations and reservations in flight at once.
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// The stores to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "memory,redis"
    )]
    pub stores: Vec<StoreKind>,
    /// A Redis to measure on (keys under a prefix of this run's own);
    /// without it, a redis-server of its own on a free port.
    #[arg(long)]
    pub redis_url: Option<String>,
    /// Also append each result as a JSON line here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

const TENANT: &str = "bench";
const TOOL: &str = "t";
const HOUR_MS: Millis = 3_600_000;

fn now() -> Millis {
    use atmost::domain::Clock as _;
    SystemClock.now()
}

fn scope() -> Scope {
    Scope {
        tenant: TENANT.into(),
        agent: None,
        key_id: "bench".into(),
    }
}

/// Runs the measurement and returns its rows (one per store).
pub async fn run(args: Args) -> Result<Vec<serde_json::Value>, BoxError> {
    let mut json = match &args.json {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?,
        ),
        None => None,
    };
    let mut rows = Vec::new();
    for &kind in &args.stores {
        let row = match kind {
            StoreKind::Memory => {
                let store = MemoryStore::new(60_000).with_quotas(Quotas::UNLIMITED);
                measure(&args, kind, Arc::new(store)).await?
            }
            StoreKind::Redis => {
                let server = match &args.redis_url {
                    Some(_) => None,
                    None => Some(atmost_testkit::RedisServer::start()?),
                };
                let url = match (&args.redis_url, &server) {
                    (Some(url), _) => url.clone(),
                    (None, Some(s)) => s.url(),
                    (None, None) => unreachable!(),
                };
                let prefix = format!("crossscale{}", uuid::Uuid::now_v7().simple());
                let store = RedisStore::connect(&RedisConfig::new(&url, &prefix))?
                    .with_quotas(Quotas::UNLIMITED);
                let result = measure(&args, kind, Arc::new(store)).await;
                unlink_prefix(&url, &prefix).await?;
                result?
            }
        };
        if let Some(f) = &mut json {
            writeln!(f, "{row}")?;
        }
        rows.push(row);
    }
    Ok(rows)
}

async fn measure<S: Store>(
    args: &Args,
    kind: StoreKind,
    store: Arc<S>,
) -> Result<serde_json::Value, BoxError> {
    let started = Instant::now();
    let ids = create_permits(&store, args.permits, args.in_flight).await?;
    let created = started.elapsed();
    if args.uncertain + args.reserved > ids.len() {
        return Err("--uncertain and --reserved need that many permits".into());
    }
    // Spread over the permits: every k-th is uncertain, the next reserved.
    let step = (ids.len() / (args.uncertain + args.reserved).max(1)).max(1);
    let mut chosen = ids.iter().step_by(step);
    let uncertain: Vec<String> = chosen.by_ref().take(args.uncertain).cloned().collect();
    let reserved: Vec<String> = chosen.take(args.reserved).cloned().collect();
    for id in &uncertain {
        let attempt = dispatch(&*store, id).await?;
        let cmd = MarkUncertainCmd {
            permit_id: id.clone(),
            idempotency_key: attempt.0,
            attempt_id: attempt.1,
            reason: "cross-scale".into(),
        };
        store.mark_uncertain(&scope(), &cmd, now()).await?;
    }
    for id in &reserved {
        dispatch(&*store, id).await?;
    }
    let expected: HashSet<&str> = uncertain.iter().map(String::as_str).collect();

    let mut walks = Vec::new();
    let mut pages = 0;
    for _ in 0..args.calls {
        let t = Instant::now();
        pages = walk(&*store, args.page, &expected).await?;
        walks.push(t.elapsed());
    }
    let mut censuses = Vec::new();
    for _ in 0..args.calls {
        let t = Instant::now();
        let figures = store.census(now(), Duration::ZERO).await?;
        censuses.push(t.elapsed());
        if figures.uncertain != expected.len() as u64 {
            return Err(format!(
                "the census counted {} where {} are uncertain",
                figures.uncertain,
                expected.len()
            )
            .into());
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (walk_ms, census_ms) = (ms(median(&mut walks)), ms(median(&mut censuses)));
    println!(
        "{:<7} {} permits ({} created in {:.1} s), {} uncertain, {} reserved: \
         the whole walk {} pages of {} in {walk_ms:.2} ms, the census {census_ms:.2} ms \
         (medians of {})",
        kind_name(kind),
        args.permits,
        ids.len(),
        created.as_secs_f64(),
        args.uncertain,
        args.reserved,
        pages,
        args.page,
        args.calls
    );
    Ok(serde_json::json!({
        "label": format!("cross-scale-{}", kind_name(kind)),
        "scenario": "cross_permit_reconcile",
        "store": kind_name(kind),
        "permits": args.permits,
        "uncertain": args.uncertain,
        "reserved": args.reserved,
        "page": args.page,
        "walk_pages": pages,
        "walk_ms": walk_ms,
        "census_ms": census_ms,
        "calls": args.calls,
    }))
}

fn kind_name(kind: StoreKind) -> &'static str {
    match kind {
        StoreKind::Memory => "memory",
        StoreKind::Redis => "redis",
    }
}

/// Creates `n` permits of [`TENANT`], `in_flight` at a time; their ids.
async fn create_permits<S: Store>(
    store: &Arc<S>,
    n: usize,
    in_flight: usize,
) -> Result<Vec<String>, BoxError> {
    let mut ids = Vec::with_capacity(n);
    let mut tasks = tokio::task::JoinSet::new();
    let mut made = 0;
    while ids.len() < n {
        while made < n && tasks.len() < in_flight {
            let store = store.clone();
            tasks.spawn(async move {
                let now = now();
                let spec = PermitSpec {
                    subject: "atmost-cross-scale".into(),
                    tools: vec![TOOL.into()],
                    expires_at: Some(now + 24 * HOUR_MS),
                    lease_ms: Some(HOUR_MS),
                    guard_mode: Some(GuardMode::Off),
                    ..PermitSpec::default()
                };
                let permit = spec.into_permit(new_id(now), now, TENANT)?;
                store.create_permit(permit).await.map(|p| p.permit_id)
            });
            made += 1;
        }
        match tasks.join_next().await {
            Some(done) => ids.push(done?.map_err(|e| e.to_string())?),
            None => break,
        }
    }
    Ok(ids)
}

/// One fresh key's DISPATCH in the permit: (key, attempt id).
async fn dispatch<S: Store>(store: &S, permit_id: &str) -> Result<(String, String), BoxError> {
    let cmd = AuthorizeCmd {
        permit_id: permit_id.to_owned(),
        tool: TOOL.into(),
        idempotency_key: "k".into(),
        request_fingerprint: vec![1],
        cost: 0,
        holder_token: Vec::new(),
        approval_summary: String::new(),
    };
    let at = now();
    let authorized = store.authorize(&scope(), &cmd, at, new_id(at)).await?;
    if authorized.decision != Decision::Dispatch {
        return Err(format!("{permit_id}: {:?}, not a DISPATCH", authorized.decision).into());
    }
    Ok((cmd.idempotency_key, authorized.attempt.attempt_id))
}

/// The whole cross-permit walk: its pages, checked to list the uncertain
/// permits' attempts, each once and UNCERTAIN, and nothing else.
async fn walk<S: Store>(
    store: &S,
    page: usize,
    expected: &HashSet<&str>,
) -> Result<usize, BoxError> {
    let mut seen = HashSet::new();
    let mut after: Option<Cursor> = None;
    let mut pages = 0;
    loop {
        let listed = store
            .list_uncertain(&scope(), None, after.as_ref(), page, now())
            .await?;
        pages += 1;
        for a in &listed.attempts {
            if a.state != AttemptState::Uncertain
                || !expected.contains(a.permit_id.as_str())
                || !seen.insert(a.permit_id.clone())
            {
                return Err(format!("{} listed wrongly ({:?})", a.permit_id, a.state).into());
            }
        }
        match listed.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if seen.len() != expected.len() {
        return Err(format!("the walk listed {} of {}", seen.len(), expected.len()).into());
    }
    Ok(pages)
}

/// Unlinks every key under `prefix` (SCAN, in batches).
async fn unlink_prefix(url: &str, prefix: &str) -> Result<(), BoxError> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("UNLINK")
                .arg(&keys)
                .exec_async(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}
