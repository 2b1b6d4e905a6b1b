//! SIGTERM drains.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_an_in_flight_authorize_and_exits_zero() {
    let _machine = shared().await;
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
