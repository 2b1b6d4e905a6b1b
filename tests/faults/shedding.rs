//! Load shedding.

use super::*;

/// Past the admission limit a request waits at most the queue wait (10 ms)
/// and is then refused with UNAVAILABLE / OVERLOADED (and RetryInfo),
/// without touching the store, instead of queueing behind a slow Redis;
/// health is not shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_in_flight_limit_requests_are_shed_at_once() {
    let _machine = shared().await;
    let (proxy, h) = proxied_harness_with(|app| app.with_max_in_flight(2)).await;
    let permit = harness_permit(&h, None).await;
    // Load the library first, so each slow request is one delayed reply.
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
        "shed after the queue wait, not queued behind the store"
    );
    assert_eq!(meta["in_flight"], "2");
    assert!(status.retry_after().is_some(), "RetryInfo: {status:?}");
    assert_eq!(
        proxy.count("shed"),
        before,
        "a shed request never reaches the store"
    );
    assert_eq!(
        health(&h.client, "").await.expect("health"),
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
