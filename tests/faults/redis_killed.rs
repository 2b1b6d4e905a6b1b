//! Redis killed under load, restarted with its data.

use super::*;

/// What one load RPC saw.
struct Sample {
    key: String,
    started: Instant,
    finished: Instant,
    outcome: Result<Decision, Error>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_fails_closed_and_resumes_with_its_data() {
    let _machine = shared().await;
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

    // Back on the same port, with its data, but without atmost's functions
    // (they came back from the append-only file: flushed, so the requests
    // under load meet "function not found" and load the library at once).
    let restarting = Instant::now();
    h.redis.as_mut().expect("redis").restart();
    crate::support::flush_scripts(&mut h.redis.as_ref().expect("redis").connect().await).await;
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
    let message = e.status().message().to_ascii_lowercase();
    message.contains("noscript") || message.contains("function not found")
}
