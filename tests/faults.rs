//! Faults, against real processes only: a `redis-server` killed under load
//! and restarted with its data, an atmost replica SIGKILLed between
//! Authorize and Commit, replies from Redis slowed down or lost on the way
//! back (a loopback proxy, `support::proxy`), and SIGTERM while an RPC is
//! in flight. In every case atmost fails closed (UNAVAILABLE, never a
//! guess) and never gives a second DISPATCH for one idempotency key.

use crate::support::proxy::{HOLD, Mode, Proxy};
use crate::support::*;
use atmost::store::Backend;
use pb::{AttemptState, Decision};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// The store deadline of the in-process servers here: small, so a dead or
/// slow Redis is noticed quickly.
const STORE_TIMEOUT: Duration = Duration::from_millis(500);
/// The client's deadline on every RPC: far above the store deadline, so an
/// RPC that ends in DEADLINE_EXCEEDED means atmost did not answer in time.
const RPC_DEADLINE: Duration = Duration::from_secs(10);
/// Replies slower than the store deadline.
const SLOW: Duration = Duration::from_secs(2);
/// Upper bound of every polling loop.
const PATIENCE: Duration = Duration::from_secs(15);

// One file per fault.
mod lost_replies;
mod redis_killed;
mod replica_killed;
mod script_sends;
mod shedding;
mod sigterm;

// === helpers ===

/// A client that sends every RPC with [`RPC_DEADLINE`].
fn with_deadline(client: &Client) -> Client {
    client.clone().with_timeout(RPC_DEADLINE)
}

/// UNAVAILABLE with ErrorInfo STORE_UNAVAILABLE: atmost's own "the store did
/// not answer", not a transport error.
fn is_store_unavailable(e: &Error) -> bool {
    e.code() == Code::Unavailable && e.reason_name() == Some("STORE_UNAVAILABLE")
}

fn is_in_progress(e: &Error) -> bool {
    e.code() == Code::Aborted && e.reason_name() == Some("IDEMPOTENCY_IN_PROGRESS")
}

fn authorize_request(permit_id: &str, key: &str, cost: i64) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit_id.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: key.as_bytes().to_vec(),
        cost,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

async fn authorize(
    client: &Client,
    permit_id: &str,
    key: &str,
    cost: i64,
) -> Result<pb::AuthorizeResponse, Error> {
    client
        .authorize(authorize_request(permit_id, key, cost))
        .await
}

/// Retries `call` while the store is unavailable (a loaded machine may miss
/// the small store deadline now and then); any other answer is returned.
async fn until_available<T, F, Fut>(what: &str, mut call: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        match call().await {
            Err(e) if is_store_unavailable(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                eprintln!("{what}: {e:?}");
                return Err(e);
            }
            ok => return ok,
        }
    }
}

/// A permit over tool "t" expiring in an hour of wall-clock time (for the
/// atmost processes, which run on the system clock).
fn wall_permit(cap: Option<u64>, budget: Option<i64>, lease: Option<Duration>) -> pb::Permit {
    let mut p = NewPermit::new(["t"]).subject("faults").currency("EUR");
    if let Some(cap) = cap {
        p = p.cap("t", cap);
    }
    if let Some(budget) = budget {
        p = p.budget(budget);
    }
    if let Some(lease) = lease {
        p = p.lease(lease);
    }
    p.build()
}

async fn create(client: &Client, permit: pb::Permit) -> String {
    until_available("create permit", || client.create_permit(permit.clone()))
        .await
        .expect("create permit")
        .permit_id
}

/// Authorizes fresh keys `<stem>-0`, `<stem>-1`, ... until one gets a
/// DISPATCH (a key whose answer was lost to a missed store deadline is
/// recorded in `sent` and left behind); returns the attempt.
async fn fresh_dispatch(
    client: &Client,
    permit_id: &str,
    stem: &str,
    sent: &mut BTreeSet<String>,
) -> pb::Attempt {
    for i in 0..20 {
        let key = format!("{stem}-{i}");
        sent.insert(key.clone());
        match authorize(client, permit_id, &key, 1).await {
            Ok(r) => {
                assert_eq!(r.decision(), Decision::Dispatch, "{key}: {r:?}");
                return r.attempt.expect("attempt");
            }
            Err(e) if is_store_unavailable(&e) => {}
            Err(e) => panic!("{key}: {e:?}"),
        }
    }
    panic!("no DISPATCH for {stem} in 20 tries");
}

/// The real server in process, on a RedisStore that reaches its own Redis
/// through `proxy`.
async fn proxied_harness() -> (Proxy, Harness) {
    proxied_harness_with(|app| app).await
}

async fn proxied_harness_with(
    configure: impl FnOnce(atmost::App) -> atmost::App,
) -> (Proxy, Harness) {
    let redis = Redis::start_owned();
    let proxy = Proxy::for_redis(&redis.url).await;
    let store = redis_store(&proxy.url(), &redis.prefix, STORE_TIMEOUT);
    let h = Harness::serve(Backend::Redis(store), Some(redis), |app| {
        configure(
            app.with_store_timeout(STORE_TIMEOUT)
                .with_health_interval(Duration::from_millis(50)),
        )
    })
    .await;
    (proxy, h)
}

/// A permit of the in-process harness (its manual clock) over tool "t".
async fn harness_permit(h: &Harness, cap: Option<u64>) -> String {
    let mut p = h.permit(&["t"]);
    p.max_calls_per_tool = cap.map(|n| ("t".to_string(), n)).into_iter().collect();
    create(&with_deadline(&h.client), p).await
}

/// Retries Authorize of `key` until atmost answers something other than
/// STORE_UNAVAILABLE, and asserts that answer is the key's existing
/// reservation (IN_PROGRESS or a REPLAY), never a DISPATCH. Returns how many
/// RPCs it took.
async fn expect_original_reservation(client: &Client, permit_id: &str, key: &str) -> usize {
    let deadline = Instant::now() + PATIENCE;
    for rpcs in 1.. {
        match authorize(client, permit_id, key, 1).await {
            Err(e) if is_in_progress(&e) => return rpcs,
            Ok(r) if r.decision() == Decision::Replay => return rpcs,
            Err(e) if is_store_unavailable(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("the retry of {key} must see its reservation: {other:?}"),
        }
    }
    unreachable!()
}

async fn calls_made(client: &Client, permit_id: &str) -> u64 {
    let view = until_available("get permit", || client.get_permit(permit_id))
        .await
        .expect("get permit");
    view.usage[0].calls_made
}
