//! Two real `atmost serve --store redis` processes on one Redis whose own
//! clocks disagree by 16 s: libfaketime puts one 8 s ahead of real time and
//! the other 8 s behind. Leases, permit expiry and attempt times follow
//! Redis's clock, the one every replica shares, so neither replica sees a
//! lease pass or a permit expire early or late; and an attempt one replica
//! has shown UNCERTAIN never returns its slot through a holder's NotSent
//! sent to the other.
//!
//! The premise is checked first: each process stamps a new permit's
//! `created_at` with its own clock, so those show the offsets really hold
//! (the test cannot pass because libfaketime did nothing).

use crate::support::*;
use atmost_client::{millis, now_ms};
use std::path::PathBuf;
use std::time::Duration;
use tonic::Code;

/// How far each replica's clock is off real time (one ahead, one behind).
const SKEW_MS: i64 = 8_000;
/// The permit's lease: shorter than the skew, so a replica deciding on its
/// own clock would see it pass at once (ahead) or 8 s late (behind).
const LEASE_MS: i64 = 2_000;
/// Room for the calls themselves and a busy machine: far below the skew.
const SLACK_MS: i64 = 1_000;

/// libfaketime's preload library. Its absence fails the test (it is not
/// skipped): `scripts/test.sh` installs it.
fn libfaketime() -> PathBuf {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .collect();
    candidates.push("/usr/lib/faketime/libfaketime.so.1".into());
    candidates.push("/usr/local/lib/faketime/libfaketime.so.1".into());
    candidates
        .into_iter()
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is not installed (no /usr/lib/*/faketime/libfaketime.so.1): \
                 the clock-skew test needs it to run replicas with clocks off; \
                 install it with `apt-get install libfaketime` (scripts/test.sh does)"
            )
        })
}

/// `atmost serve <args>` with its wall clock shifted by `offset` (e.g.
/// "+8s"); its monotonic clock, which tokio's timers use, stays true.
fn spawn_skewed(args: &[String], offset: &str) -> AtmostProcess {
    let preload = libfaketime();
    spawn_atmost_with_env(
        args,
        &[
            ("LD_PRELOAD", &preload.to_string_lossy()),
            ("FAKETIME", offset),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ],
    )
}

/// Asserts `at` lies within `[from, to]` widened by the slack; all in ms.
#[track_caller]
fn assert_between(what: &str, at: i64, from: i64, to: i64) {
    assert!(
        from - SLACK_MS <= at && at <= to + SLACK_MS,
        "{what}: {at} is {} ms from [{from}, {to}] (slack {SLACK_MS} ms)",
        if at < from { at - from } else { at - to },
    );
}

/// Sleeps until real time `ms` has passed by a margin.
async fn sleep_past(ms: i64) {
    let wait = ms + 300 - now_ms();
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
}

fn attempt_of(r: pb::AuthorizeResponse, key: &str) -> pb::Attempt {
    assert_eq!(r.decision(), pb::Decision::Dispatch, "{key}: {r:?}");
    r.attempt.expect("attempt")
}

fn authorize(permit_id: &str, key: &str) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit_id.into(),
        tool: "wallet.charge".into(),
        idempotency_key: key.into(),
        request_fingerprint: key.as_bytes().to_vec(),
        cost: 10,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

fn commit_not_sent(a: &pb::Attempt) -> pb::CommitRequest {
    pb::CommitRequest {
        permit_id: a.permit_id.clone(),
        idempotency_key: a.idempotency_key.clone(),
        attempt_id: a.attempt_id.clone(),
        outcome: Some(not_sent()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_with_skewed_clocks_decide_on_redis_time() {
    let _machine = shared().await;
    let redis = Redis::start();
    let args = redis.serve_args();
    let fast_process = spawn_skewed(&args, &format!("+{}s", SKEW_MS / 1000));
    let slow_process = spawn_skewed(&args, &format!("-{}s", SKEW_MS / 1000));
    let fast = fast_process.client().await;
    let slow = slow_process.client().await;

    // The premise: each replica's own clock is off by the skew. CreatePermit
    // stamps created_at with the service's clock, not Redis's.
    let before = now_ms();
    let probe = fast
        .create_permit(NewPermit::new(["wallet.charge"]).subject("fast"))
        .await
        .expect("create through the fast replica");
    let after = now_ms();
    assert_between(
        "the fast replica's clock (created_at)",
        millis(probe.created_at.as_ref().expect("created_at")),
        before + SKEW_MS,
        after + SKEW_MS,
    );

    // The permit under test, created through the slow replica (whose clock
    // accepts an expiry 4 s ahead; the fast one's would call it past). The
    // fast replica, deciding on its own clock, would call it expired now.
    let t0 = now_ms();
    let expires_at = t0 + 4_000;
    let permit = slow
        .create_permit(
            NewPermit::new(["wallet.charge"])
                .subject("clock-skew")
                .lease(Duration::from_millis(LEASE_MS as u64))
                .expires_at_ms(expires_at),
        )
        .await
        .expect("create through the slow replica");
    assert_between(
        "the slow replica's clock (created_at)",
        millis(permit.created_at.as_ref().expect("created_at")),
        t0 - SKEW_MS,
        now_ms() - SKEW_MS,
    );
    let permit = permit.permit_id;

    // One key through each replica: both dispatch (the fast one would
    // otherwise answer PERMIT_EXPIRED), each attempt created and leased on
    // Redis's clock, which is real time here, not the replica's.
    let mut attempts = Vec::new();
    for (name, client) in [("slow", &slow), ("fast", &fast)] {
        let key = format!("via-{name}");
        let before = now_ms();
        let r = client
            .authorize(authorize(&permit, &key))
            .await
            .unwrap_or_else(|e| panic!("authorize {key} through the {name} replica: {e:?}"));
        let after = now_ms();
        let a = attempt_of(r, &key);
        assert_eq!(a.state(), pb::AttemptState::Reserved, "{key}");
        assert_between(
            &format!("{key}: created_at"),
            millis(a.created_at.as_ref().expect("created_at")),
            before,
            after,
        );
        assert_between(
            &format!("{key}: lease_expires_at"),
            millis(a.lease_expires_at.as_ref().expect("lease_expires_at")),
            before + LEASE_MS,
            after + LEASE_MS,
        );
        attempts.push(a);
    }

    // Neither lease has passed for Redis, so neither replica lists them (the
    // fast one, 8 s ahead, would have seen both leases as passed).
    for (name, client) in [("fast", &fast), ("slow", &slow)] {
        let listed = client
            .list_all_uncertain(&permit, 10)
            .await
            .expect("list uncertain");
        assert!(
            listed.is_empty(),
            "the {name} replica lists an attempt uncertain before its lease passed: {listed:?}"
        );
    }

    // Once the leases have passed in real time, both replicas show both
    // attempts UNCERTAIN since their lease's end (the slow one, 8 s
    // behind, would still have seen them RESERVED).
    let lease_end = attempts
        .iter()
        .map(|a| millis(a.lease_expires_at.as_ref().expect("lease_expires_at")))
        .max()
        .expect("two attempts");
    sleep_past(lease_end).await;
    for (name, client) in [("fast", &fast), ("slow", &slow)] {
        let listed = client
            .list_all_uncertain(&permit, 10)
            .await
            .expect("list uncertain");
        let mut keys: Vec<&str> = listed.iter().map(|a| a.idempotency_key.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["via-fast", "via-slow"],
            "listed by the {name} replica"
        );
        for a in &listed {
            assert_eq!(a.state(), pb::AttemptState::Uncertain, "{a:?}");
            assert_eq!(a.uncertain_reason, "lease_expired", "{a:?}");
            assert_eq!(a.uncertain_since, a.lease_expires_at, "{a:?}");
        }
    }

    // The fast replica has shown them UNCERTAIN: the holder's NotSent through
    // the slow replica, whose own clock is still before both leases' end,
    // is refused, and the slots stay taken.
    for a in &attempts {
        let (meta, _) = expect_error(
            slow.commit(commit_not_sent(a)).await,
            Code::FailedPrecondition,
            "ATTEMPT_STATE_CONFLICT",
        );
        assert_eq!(meta["state"], "UNCERTAIN", "{}", a.idempotency_key);
    }
    for (name, client) in [("fast", &fast), ("slow", &slow)] {
        let got = client.get_permit(&permit).await.expect("get permit");
        assert_eq!(
            got.usage[0].calls_made, 2,
            "through the {name} replica: both slots stay taken"
        );
    }

    // Past the expiry in real time, the slow replica (whose own clock is
    // 8 s before it) authorizes no new key.
    sleep_past(expires_at).await;
    let (meta, _) = expect_error(
        slow.authorize(authorize(&permit, "after-expiry")).await,
        Code::FailedPrecondition,
        "PERMIT_EXPIRED",
    );
    assert!(meta.contains_key("expired_at"), "{meta:?}");
}
