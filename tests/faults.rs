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
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

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

async fn health(client: &Client) -> Result<ServingStatus, Error> {
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    request.set_timeout(RPC_DEADLINE);
    HealthClient::new(client.channel())
        .check(request)
        .await
        .map(|r| r.into_inner().status())
        .map_err(Error::from)
}

async fn wait_health(client: &Client, want: ServingStatus) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if health(client).await.ok() == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "health never became {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

// === 1. Redis killed under load, restarted with its data ===

/// What one load RPC saw.
struct Sample {
    key: String,
    started: Instant,
    finished: Instant,
    outcome: Result<Decision, Error>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_fails_closed_and_resumes_with_its_data() {
    let _machine = timing_sensitive().await;
    let redis = Redis::start_persistent();
    let store = redis_store(&redis.url, &redis.prefix, STORE_TIMEOUT);
    let mut h = Harness::serve(Backend::Redis(store), Some(redis), |app| {
        app.with_store_timeout(STORE_TIMEOUT)
            .with_health_interval(Duration::from_millis(50))
    })
    .await;
    let client = with_deadline(&h.client);
    let permit = harness_permit(&h, None).await;
    wait_health(&client, ServingStatus::Serving).await;

    // Before the kill: one attempt settled, one left RESERVED.
    let mut sent = BTreeSet::new();
    let settled = fresh_dispatch(&client, &permit, "pre-settled", &mut sent).await;
    let committed = until_available("commit", || {
        client.commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: settled.idempotency_key.clone(),
            attempt_id: settled.attempt_id.clone(),
            outcome: Some(succeeded(b"receipt before the kill", None)),
        })
    })
    .await
    .expect("commit");
    let receipt = committed
        .attempt
        .and_then(|a| a.receipt)
        .expect("a receipt");
    let reserved = fresh_dispatch(&client, &permit, "pre-reserved", &mut sent).await;

    // Load: three clients sending Authorize with fresh keys, bounded in count.
    let stop = Arc::new(AtomicBool::new(false));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let dispatched = Arc::new(AtomicUsize::new(0));
    let during_outage = Arc::new(AtomicUsize::new(0));
    let mut load = Vec::new();
    for loader in 0..3 {
        let (client, permit) = (client.clone(), permit.clone());
        let (stop, killed_at) = (stop.clone(), killed_at.clone());
        let (dispatched, during_outage) = (dispatched.clone(), during_outage.clone());
        load.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            for i in 0..400 {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let key = format!("load-{loader}-{i}");
                let started = Instant::now();
                let outcome = authorize(&client, &permit, &key, 1)
                    .await
                    .map(|r| r.decision());
                let finished = Instant::now();
                if matches!(outcome, Ok(Decision::Dispatch)) {
                    dispatched.fetch_add(1, Ordering::SeqCst);
                }
                if killed_at
                    .lock()
                    .expect("kill time")
                    .is_some_and(|k| started >= k)
                {
                    during_outage.fetch_add(1, Ordering::SeqCst);
                }
                samples.push(Sample {
                    key,
                    started,
                    finished,
                    outcome,
                });
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            samples
        }));
    }
    let deadline = Instant::now() + PATIENCE;
    while dispatched.load(Ordering::SeqCst) < 10 {
        assert!(Instant::now() < deadline, "the load never got going");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Kill Redis (SIGKILL) in the middle of it.
    h.redis.as_mut().expect("redis").kill();
    let killed = Instant::now();
    *killed_at.lock().expect("kill time") = Some(killed);

    // While it is down every RPC is UNAVAILABLE / STORE_UNAVAILABLE within
    // its deadline, never a decision.
    let probe = fresh_key_probe(&client, &permit, &mut sent).await;
    assert!(is_store_unavailable(&probe), "new key: {probe:?}");
    let replay = authorize(&client, &permit, &settled.idempotency_key, 1).await;
    assert!(
        replay.as_ref().is_err_and(is_store_unavailable),
        "replay: {replay:?}"
    );
    let get = client.get_permit(&permit).await;
    assert!(get.as_ref().is_err_and(is_store_unavailable), "{get:?}");
    let list = client
        .list_uncertain(pb::ListUncertainRequest::default())
        .await;
    assert!(list.as_ref().is_err_and(is_store_unavailable), "{list:?}");
    wait_health(&client, ServingStatus::NotServing).await;
    let deadline = Instant::now() + PATIENCE;
    while during_outage.load(Ordering::SeqCst) < 6 {
        assert!(Instant::now() < deadline, "no load during the outage");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Back on the same port, with its data but an empty script cache.
    let restarting = Instant::now();
    h.redis.as_mut().expect("redis").restart();
    let back = Instant::now();
    // Service resumes on its own within 2 s: a new key gets its DISPATCH.
    let mut resumed = None;
    for i in 0..1_000 {
        let key = format!("after-{i}");
        sent.insert(key.clone());
        match authorize(&client, &permit, &key, 1).await {
            Ok(r) if r.decision() == Decision::Dispatch => {
                resumed = Some(back.elapsed());
                break;
            }
            Err(s) if is_store_unavailable(&s) && back.elapsed() < PATIENCE => {
                assert!(!mentions_noscript(&s), "{s:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("after the restart, {key}: {other:?}"),
        }
    }
    let resumed = resumed.expect("a DISPATCH after the restart");
    assert!(
        resumed <= Duration::from_secs(2),
        "service resumed {resumed:?} after Redis returned"
    );
    // Pre-kill keys replay from the data that survived.
    let replay = authorize(&client, &permit, &settled.idempotency_key, 1)
        .await
        .expect("replay of the settled key");
    assert_eq!(replay.decision(), Decision::Replay);
    let attempt = replay.attempt.expect("attempt");
    assert_eq!(attempt.state(), AttemptState::Succeeded);
    assert_eq!(attempt.receipt, Some(receipt));
    let again = authorize(&client, &permit, &reserved.idempotency_key, 1).await;
    assert!(
        again.as_ref().is_err_and(is_in_progress),
        "the reserved key: {again:?}"
    );
    wait_health(&client, ServingStatus::Serving).await;

    stop.store(true, Ordering::SeqCst);
    let mut samples = Vec::new();
    for task in load {
        samples.extend(task.await.expect("load task"));
    }
    let mut outage = 0;
    let mut load_dispatched = Vec::new();
    for s in &samples {
        sent.insert(s.key.clone());
        match &s.outcome {
            Ok(Decision::Dispatch) => load_dispatched.push(s.key.clone()),
            Err(status) if is_store_unavailable(status) => {
                assert!(!mentions_noscript(status), "{}: {status:?}", s.key);
            }
            other => panic!("{}: {other:?}", s.key),
        }
        if s.started >= killed && s.finished <= restarting {
            outage += 1;
            assert!(
                s.outcome.as_ref().is_err_and(is_store_unavailable),
                "{} while Redis was down: {:?}",
                s.key,
                s.outcome
            );
        }
    }
    eprintln!(
        "{} load RPCs, {} dispatched, {outage} entirely during the outage; resumed {resumed:?} after Redis returned",
        samples.len(),
        load_dispatched.len()
    );
    assert!(outage > 0, "no load RPC ran entirely while Redis was down");

    // Every DISPATCH given survived the restart: its key is still RESERVED.
    for key in &load_dispatched {
        let r = authorize(&client, &permit, key, 1).await;
        assert!(r.as_ref().is_err_and(is_in_progress), "{key}: {r:?}");
    }
    // Every key whose answer was lost either ran (IN_PROGRESS) or did not
    // (DISPATCH now); either way each key holds exactly one slot.
    for key in &sent {
        if load_dispatched.contains(key) {
            continue;
        }
        let r = until_available(key, || authorize(&client, &permit, key, 1)).await;
        match r {
            Ok(r) => assert!(
                matches!(r.decision(), Decision::Dispatch | Decision::Replay),
                "{key}: {r:?}"
            ),
            Err(s) => assert!(is_in_progress(&s), "{key}: {s:?}"),
        }
    }
    let view = until_available("get permit", || client.get_permit(&permit))
        .await
        .expect("get permit");
    assert_eq!(view.usage[0].calls_made, sent.len() as u64);
    assert_eq!(
        view.budget_committed + view.budget_reserved,
        sent.len() as i64
    );
}

/// One Authorize of a fresh key while Redis is down; returns its error.
async fn fresh_key_probe(client: &Client, permit: &str, sent: &mut BTreeSet<String>) -> Error {
    sent.insert("down-probe".into());
    match authorize(client, permit, "down-probe", 1).await {
        Ok(r) => panic!("a decision while Redis is down: {r:?}"),
        Err(s) => s,
    }
}

fn mentions_noscript(e: &Error) -> bool {
    e.status()
        .message()
        .to_ascii_lowercase()
        .contains("noscript")
}

// === 2. A replica SIGKILLed between Authorize and Commit ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_between_authorize_and_commit_leaves_the_attempt_uncertain() {
    let _machine = timing_sensitive().await;
    use std::os::unix::process::ExitStatusExt;
    let redis = Redis::start();
    let args = redis.serve_args();
    let mut a = spawn_atmost(&args);
    let b = spawn_atmost(&args);
    let (via_a, via_b) = (
        with_deadline(&a.client().await),
        with_deadline(&b.client().await),
    );

    let lease = Duration::from_secs(2);
    let permit = create(&via_b, wall_permit(Some(2), Some(1_000), Some(lease))).await;
    // Through A: one call settled, then one dispatched and never reported.
    let first = authorize(&via_a, &permit, "k0", 100)
        .await
        .expect("authorize k0");
    assert_eq!(first.decision(), Decision::Dispatch);
    let first = first.attempt.expect("attempt");
    via_a
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "k0".into(),
            attempt_id: first.attempt_id,
            outcome: Some(succeeded(b"done", None)),
        })
        .await
        .expect("commit k0");
    let open = authorize(&via_a, &permit, "k1", 200)
        .await
        .expect("authorize k1");
    assert_eq!(open.decision(), Decision::Dispatch);
    let open = open.attempt.expect("attempt");
    let lease_ends = atmost_client::millis(&open.lease_expires_at.expect("lease"));

    let status = a.kill().expect("SIGKILL replica A");
    assert_eq!(status.signal(), Some(9), "{status:?}");

    // Through B: IN_PROGRESS while the lease runs, then the same unknown.
    let mut in_progress = 0;
    let deadline = Instant::now() + PATIENCE;
    let uncertain = loop {
        assert!(Instant::now() < deadline, "k1 never became UNCERTAIN");
        let asked = atmost_client::now_ms();
        let r = authorize(&via_b, &permit, "k1", 200).await;
        let answered = atmost_client::now_ms();
        match r {
            Err(s) if is_in_progress(&s) => {
                // atmost's clock read between `asked` and `answered`.
                assert!(asked < lease_ends, "IN_PROGRESS after the lease: {s:?}");
                let meta = s.metadata();
                assert_eq!(
                    meta["lease_expires_at"],
                    atmost::api::status::rfc3339(lease_ends)
                );
                in_progress += 1;
                // The held slot counts against the cap already.
                let (meta, _) = expect_error(
                    authorize(&via_b, &permit, &format!("k2-{in_progress}"), 1).await,
                    Code::ResourceExhausted,
                    "PERMIT_MAX_CALLS_EXCEEDED",
                );
                assert_eq!(meta["calls_made"], "2");
            }
            Ok(r) => {
                assert_eq!(r.decision(), Decision::Replay, "{r:?}");
                assert!(answered >= lease_ends, "UNCERTAIN within the lease: {r:?}");
                break r.attempt.expect("attempt");
            }
            Err(s) => panic!("k1 through B: {s:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(in_progress > 0, "never saw k1 IN_PROGRESS");
    assert_eq!(uncertain.state(), AttemptState::Uncertain);
    assert_eq!(uncertain.uncertain_reason, "lease_expired");
    assert_eq!(uncertain.attempt_id, open.attempt_id);

    // The reconciler finds it, under the permit and across all permits.
    let list = via_b
        .list_uncertain(pb::ListUncertainRequest {
            permit_id: permit.clone(),
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(list.attempts.len(), 1, "{list:?}");
    assert_eq!(list.attempts[0].idempotency_key, "k1");
    assert_eq!(list.attempts[0].attempt_id, open.attempt_id);
    assert_eq!(list.attempts[0].uncertain_reason, "lease_expired");
    let everywhere = via_b
        .list_uncertain(pb::ListUncertainRequest::default())
        .await
        .expect("list everywhere");
    assert!(
        everywhere
            .attempts
            .iter()
            .any(|x| x.permit_id == permit && x.idempotency_key == "k1"),
        "{everywhere:?}"
    );

    // The cap stays exact: the uncertain call keeps its slot and money.
    let (meta, _) = expect_error(
        authorize(&via_b, &permit, "k2", 1).await,
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    assert_eq!(meta["limit"], "2");
    assert_eq!(meta["calls_made"], "2");
    let view = &via_b.get_permit(&permit).await.expect("get permit");
    assert_eq!(view.usage[0].calls_made, 2);
    assert_eq!(view.budget_committed, 100);
    assert_eq!(view.budget_reserved, 200);
    // And nothing is re-dispatched: the key replays the same unknown.
    let again = authorize(&via_b, &permit, "k1", 200)
        .await
        .expect("replay k1");
    assert_eq!(again.decision(), Decision::Replay);
    assert_eq!(again.attempt.expect("attempt").attempt_id, open.attempt_id);
    drop(redis);
}

// === 3. Slow and lost replies ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_or_lost_replies_answer_unavailable_and_the_retry_sees_the_reservation() {
    let _machine = timing_sensitive().await;
    let (proxy, h) = proxied_harness().await;
    let client = with_deadline(&h.client);
    // Load the script, so the runs below are the first and only try.
    let warm = harness_permit(&h, None).await;
    fresh_dispatch(&client, &warm, "warm", &mut BTreeSet::new()).await;

    for mode in [Mode::Delay(SLOW), Mode::DropReplies] {
        let permit = harness_permit(&h, Some(3)).await;
        let key = format!("{mode:?}");
        proxy.set_mode(mode);
        let started = Instant::now();
        let r = authorize(&client, &permit, &key, 1).await;
        assert!(
            r.as_ref().is_err_and(is_store_unavailable),
            "{mode:?}: a lost answer must be UNAVAILABLE, not a guess: {r:?}"
        );
        assert!(started.elapsed() < RPC_DEADLINE);
        // The command did reach Redis (and ran there).
        assert!(proxy.wait_count(&key, 1, PATIENCE).await, "{mode:?}");
        assert_eq!(proxy.count_command("EVALSHA", &key), 1, "{mode:?}");
        if mode == Mode::DropReplies {
            assert!(proxy.swallowed_bytes() > 0, "no reply was dropped");
        }
        proxy.set_mode(Mode::Pass);
        assert!(proxy.wait_flushed(PATIENCE).await);

        expect_original_reservation(&client, &permit, &key).await;
        assert_eq!(calls_made(&client, &permit).await, 1, "{mode:?}");
    }
}

// === 4. One RPC, one script send ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_authorize_sends_its_script_once() {
    let _machine = timing_sensitive().await;
    let (proxy, h) = proxied_harness().await;
    let client = with_deadline(&h.client);
    let permit = harness_permit(&h, Some(5)).await;
    let mut direct = h.redis.as_ref().expect("redis").connect().await;

    // With an empty script cache, one Authorize is EVALSHA (NOSCRIPT: it did
    // not run), SCRIPT LOAD, EVALSHA again: two sends, one run, one
    // reservation.
    flush_scripts(&mut direct).await;
    let loads = proxy.count_command("SCRIPT", "LOAD");
    let r = until_available("authorize", || authorize(&client, &permit, "noscript", 1))
        .await
        .expect("authorize after SCRIPT FLUSH");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert_eq!(proxy.count_command("SCRIPT", "LOAD"), loads + 1);
    assert_eq!(
        proxy.count_command("EVALSHA", "noscript"),
        2,
        "{:?}",
        proxy.commands()
    );
    assert_eq!(calls_made(&client, &permit).await, 1);

    // The script is loaded now. An Authorize whose reply comes after the
    // store deadline sends its script exactly once, even once the late
    // reply arrives.
    proxy.set_mode(HOLD);
    let r = authorize(&client, &permit, "late", 1).await;
    assert!(r.as_ref().is_err_and(is_store_unavailable), "{r:?}");
    assert!(proxy.wait_count("late", 1, PATIENCE).await);
    assert_eq!(proxy.count_command("EVALSHA", "late"), 1);
    proxy.set_mode(Mode::Pass);
    assert!(proxy.wait_flushed(PATIENCE).await, "the late reply");
    // Give a re-send, if there were one, the time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        proxy.count_command("EVALSHA", "late"),
        1,
        "{:?}",
        proxy.commands()
    );
    assert_eq!(proxy.count_command("SCRIPT", "LOAD"), loads + 1);

    // The late run holds the key's one reservation: the retry sees it, and
    // each retry RPC is one more send.
    let rpcs = expect_original_reservation(&client, &permit, "late").await;
    assert_eq!(proxy.count_command("EVALSHA", "late"), 1 + rpcs);
    assert_eq!(calls_made(&client, &permit).await, 2);
}

// === 5. SIGTERM drains ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_in_flight_authorize_and_exits_zero() {
    let _machine = timing_sensitive().await;
    let redis = Redis::start_owned();
    let proxy = Proxy::for_redis(&redis.url).await;
    let url = proxy.url();
    let grace = Duration::from_secs(10);
    let mut process = spawn_atmost(&[
        "--store",
        "redis",
        "--redis-url",
        &url,
        "--redis-prefix",
        &redis.prefix,
        "--store-timeout",
        "5s",
        "--shutdown-grace",
        "10s",
    ]);
    let client = with_deadline(&process.client().await);
    let permit = create(&client, wall_permit(None, None, None)).await;
    fresh_dispatch(&client, &permit, "warm", &mut BTreeSet::new()).await;
    let mut watch = HealthClient::new(client.channel())
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner();
    let first = watch.message().await.expect("watch").expect("a status");
    assert_eq!(first.status(), ServingStatus::Serving);

    // Hold Redis's replies right after a health ping went through (the
    // store watcher then sleeps a second), and start an Authorize.
    let pings = proxy.count_command("PING", "");
    let deadline = Instant::now() + PATIENCE;
    while proxy.count_command("PING", "") == pings {
        assert!(Instant::now() < deadline, "no health ping");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(proxy.wait_flushed(PATIENCE).await);
    proxy.set_mode(HOLD);
    let in_flight = tokio::spawn({
        let (client, permit) = (client.clone(), permit.clone());
        async move { authorize(&client, &permit, "in-flight", 1).await }
    });
    assert!(
        proxy.wait_count("in-flight", 1, PATIENCE).await,
        "the Authorize reached Redis"
    );

    // SIGTERM while its answer is held.
    let pid = process.pid().to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
    let terminated = Instant::now();

    // The existing channel's health watch turns NOT_SERVING during the
    // drain, while the Authorize is still held (unless a health ping was
    // held too: then only once the replies are released).
    let mut not_serving = Box::pin(async move {
        while let Ok(Some(update)) = watch.message().await {
            if update.status() == ServingStatus::NotServing {
                return true;
            }
        }
        false
    });
    let seen_while_held = tokio::time::timeout(Duration::from_secs(3), &mut not_serving)
        .await
        .ok();
    eprintln!("NOT_SERVING while the Authorize was held: {seen_while_held:?}");
    if seen_while_held == Some(true) {
        // Draining: with an RPC in flight and the grace far from over, the
        // process must still be there a while later.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let early = process.try_wait();
        assert!(early.is_none(), "exited with an RPC in flight: {early:?}");
    }
    proxy.set_mode(Mode::Pass);
    let seen = match seen_while_held {
        Some(seen) => seen,
        None => tokio::time::timeout(PATIENCE, &mut not_serving)
            .await
            .unwrap_or(false),
    };
    assert!(seen, "health never reported NOT_SERVING during the drain");
    // Closes the watch stream, which would otherwise hold the drain open.
    drop(not_serving);

    // The in-flight RPC still gets its answer, and the process exits 0
    // within the grace.
    let r = in_flight
        .await
        .expect("in-flight task")
        .expect("the in-flight Authorize was answered");
    assert_eq!(r.decision(), Decision::Dispatch);
    let status = tokio::task::spawn_blocking(move || {
        while terminated.elapsed() < grace {
            if let Some(status) = process.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    })
    .await
    .expect("waiter")
    .expect("exited within the shutdown grace");
    assert!(status.success(), "{status:?}");
}

// === 6. Load shedding ===

/// Past the admission limit a request is refused at once with UNAVAILABLE /
/// OVERLOADED (and RetryInfo), without touching the store, instead of
/// queueing behind a slow Redis; health is not shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_limit_requests_are_shed_at_once() {
    let _machine = timing_sensitive().await;
    let (proxy, h) = proxied_harness_with(|app| app.with_max_in_flight(2)).await;
    let permit = harness_permit(&h, None).await;
    // Warm the script cache, so each slow request is one delayed reply.
    authorize(&with_deadline(&h.client), &permit, "warm", 1)
        .await
        .expect("warm");
    proxy.set_mode(Mode::Delay(Duration::from_millis(300)));
    let slow: Vec<_> = (0..2)
        .map(|i| {
            let client = with_deadline(&h.client);
            let permit = permit.clone();
            tokio::spawn(async move { authorize(&client, &permit, &format!("slow-{i}"), 1).await })
        })
        .collect();
    assert!(
        proxy.wait_count("slow-1", 1, PATIENCE).await,
        "both reached Redis"
    );
    let before = proxy.count("shed");
    let started = Instant::now();
    let shed = authorize(&with_deadline(&h.client), &permit, "shed", 1).await;
    let (meta, status) = expect_error(shed, Code::Unavailable, "OVERLOADED");
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "shed at once, not queued"
    );
    assert_eq!(meta["in_flight"], "2");
    assert!(status.retry_after().is_some(), "RetryInfo: {status:?}");
    assert_eq!(
        proxy.count("shed"),
        before,
        "a shed request never reaches the store"
    );
    assert_eq!(
        health(&with_deadline(&h.client)).await.expect("health"),
        ServingStatus::Serving
    );
    for t in slow {
        let r = t
            .await
            .expect("task")
            .expect("admitted requests are answered");
        assert_eq!(r.decision(), Decision::Dispatch);
    }
    proxy.set_mode(Mode::Pass);
    // Room again: the same request now goes through.
    let r = authorize(&with_deadline(&h.client), &permit, "shed", 1)
        .await
        .expect("admitted");
    assert_eq!(r.decision(), Decision::Dispatch);
}
