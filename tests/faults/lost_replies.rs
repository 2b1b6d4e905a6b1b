//! Slow and lost replies.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_or_lost_replies_answer_unavailable_and_the_retry_sees_the_reservation() {
    let _machine = shared().await;
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
        assert_eq!(proxy.count_command("FCALL", &key), 1, "{mode:?}");
        if mode == Mode::DropReplies {
            assert!(proxy.swallowed_bytes() > 0, "no reply was dropped");
        }
        proxy.set_mode(Mode::Pass);
        assert!(proxy.wait_flushed(PATIENCE).await);

        expect_original_reservation(&client, &permit, &key).await;
        assert_eq!(calls_made(&client, &permit).await, 1, "{mode:?}");
    }
}
