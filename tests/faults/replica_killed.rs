//! A replica SIGKILLed between Authorize and Commit.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_between_authorize_and_commit_leaves_the_attempt_uncertain() {
    let _machine = shared().await;
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
