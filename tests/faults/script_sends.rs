//! One RPC, one script send.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_authorize_sends_its_script_once() {
    let _machine = shared().await;
    let (proxy, h) = proxied_harness().await;
    let client = with_deadline(&h.client);
    let permit = harness_permit(&h, Some(5)).await;
    let mut direct = h.redis.as_ref().expect("redis").connect().await;

    // With no functions loaded, one Authorize is FCALL (function not
    // found: it did not run), FUNCTION LOAD, FCALL again: two sends, one
    // run, one reservation.
    flush_scripts(&mut direct).await;
    let loads = proxy.count_command("FUNCTION", "LOAD");
    let r = until_available("authorize", || authorize(&client, &permit, "noscript", 1))
        .await
        .expect("authorize after FUNCTION FLUSH");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert_eq!(proxy.count_command("FUNCTION", "LOAD"), loads + 1);
    assert_eq!(
        proxy.count_command("FCALL", "noscript"),
        2,
        "{:?}",
        proxy.commands()
    );
    assert_eq!(calls_made(&client, &permit).await, 1);
    // One library holds every script: GetPermit loaded nothing more.
    assert_eq!(proxy.count_command("FUNCTION", "LOAD"), loads + 1);
    let loads = proxy.count_command("FUNCTION", "LOAD");

    // The script is loaded now. An Authorize whose reply comes after the
    // store deadline sends its script exactly once, even once the late
    // reply arrives.
    proxy.set_mode(HOLD);
    let r = authorize(&client, &permit, "late", 1).await;
    assert!(r.as_ref().is_err_and(is_store_unavailable), "{r:?}");
    assert!(proxy.wait_count("late", 1, PATIENCE).await);
    assert_eq!(proxy.count_command("FCALL", "late"), 1);
    proxy.set_mode(Mode::Pass);
    assert!(proxy.wait_flushed(PATIENCE).await, "the late reply");
    // Give a re-send, if there were one, the time to show.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        proxy.count_command("FCALL", "late"),
        1,
        "{:?}",
        proxy.commands()
    );
    assert_eq!(proxy.count_command("FUNCTION", "LOAD"), loads);

    // The late run holds the key's one reservation: the retry sees it, and
    // each retry RPC is one more send.
    let rpcs = expect_original_reservation(&client, &permit, "late").await;
    assert_eq!(proxy.count_command("FCALL", "late"), 1 + rpcs);
    assert_eq!(calls_made(&client, &permit).await, 2);
}
