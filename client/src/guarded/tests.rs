//! The guarded call's local decisions: which answers are retried and how
//! each failure is typed, the backoff, what is stored for a result, the
//! settings refused before any RPC. The calls themselves run against a live
//! atmost in the service's integration suite (`tests/clients.rs`).

use super::*;
use std::collections::HashMap;
use tonic_types::{ErrorDetails, StatusExt};

fn atmost_error(code: Code, reason: &str, metadata: &[(&str, &str)]) -> Error {
    let metadata: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Error::from(Status::with_error_details(
        code,
        "refused",
        ErrorDetails::with_error_info(reason, crate::DOMAIN, metadata),
    ))
}

#[test]
fn authorize_retries_only_what_cannot_dispatch_twice() {
    let retried = [
        atmost_error(Code::Unavailable, "STORE_UNAVAILABLE", &[]),
        atmost_error(Code::Unavailable, "OVERLOADED", &[]),
        atmost_error(Code::DeadlineExceeded, "DEADLINE_EXCEEDED", &[]),
        atmost_error(Code::Aborted, "IDEMPOTENCY_IN_PROGRESS", &[]),
        Error::from(Status::unavailable("tcp connect error: Connection refused")),
        Error::from(Status::deadline_exceeded("transport deadline")),
        Error::from(Status::cancelled("Timeout expired")),
    ];
    for e in &retried {
        assert!(authorize_may_retry(e), "{e}");
    }
    let refused = [
        atmost_error(Code::ResourceExhausted, "PERMIT_MAX_CALLS_EXCEEDED", &[]),
        atmost_error(Code::FailedPrecondition, "IDEMPOTENCY_KEY_REUSED", &[]),
        atmost_error(Code::Unauthenticated, "UNAUTHENTICATED", &[]),
        atmost_error(Code::InvalidArgument, "INVALID_REQUEST", &[]),
        atmost_error(Code::NotFound, "PERMIT_NOT_FOUND", &[]),
        Error::from(Status::internal("h2 protocol error")),
        Error::from(Status::unauthenticated("a proxy said no")),
    ];
    for e in &refused {
        assert!(!authorize_may_retry(e), "{e}");
        assert!(!settle_may_retry(e), "{e}");
    }
    // A Commit is never retried on IN_PROGRESS (no Commit answers it).
    assert!(!settle_may_retry(&retried[3]));
    assert!(settle_may_retry(&retried[4]));
}

#[test]
fn a_connection_that_broke_mid_call_is_retried_like_unavailable() {
    // What tonic answers when the connection breaks while a call is on
    // it: UNKNOWN, no ErrorInfo, the I/O error among its causes.
    let broke = Error::from(Status::from_error(Box::new(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "stream closed because of a broken pipe",
    ))));
    assert_eq!(broke.code(), Code::Unknown);
    assert!(authorize_may_retry(&broke) && settle_may_retry(&broke));
    assert!(matches!(
        authorize_refused(broke),
        GuardError::Unavailable(_)
    ));
    // The body of an answer cut off (tonic's "h2 protocol error", an
    // h2 I/O error no unit test can make): tests/clients.rs, through a
    // relay that cuts the connection.
    // UNKNOWN for any other cause, or atmost's own word, is not retried.
    let unknown = Error::from(Status::unknown("a proxy's answer"));
    assert!(!authorize_may_retry(&unknown));
    let answered = atmost_error(Code::Unknown, "STORE_UNAVAILABLE", &[]);
    assert!(!authorize_may_retry(&answered));
}

#[test]
fn each_refusal_has_its_kind() {
    let kind = |e: Error| match authorize_refused(e) {
        GuardError::Denied(_) => "denied",
        GuardError::InProgress(_) => "in progress",
        GuardError::Unavailable(_) => "unavailable",
        GuardError::InvalidRequest(_) => "invalid",
        GuardError::Rpc(_) => "rpc",
        other => panic!("{other:?}"),
    };
    for (e, want) in [
        (
            atmost_error(Code::ResourceExhausted, "PERMIT_BUDGET_EXCEEDED", &[]),
            "denied",
        ),
        (
            atmost_error(Code::ResourceExhausted, "QUOTA_OPEN_ATTEMPTS", &[]),
            "denied",
        ),
        (
            atmost_error(Code::Unauthenticated, "UNAUTHENTICATED", &[]),
            "denied",
        ),
        (
            atmost_error(Code::Aborted, "IDEMPOTENCY_IN_PROGRESS", &[]),
            "in progress",
        ),
        (
            atmost_error(Code::Unavailable, "STORE_UNAVAILABLE", &[]),
            "unavailable",
        ),
        (Error::from(Status::unavailable("refused")), "unavailable"),
        (
            atmost_error(Code::InvalidArgument, "INVALID_REQUEST", &[]),
            "invalid",
        ),
        (
            atmost_error(Code::FailedPrecondition, "ATTEMPT_HOLDER_MISMATCH", &[]),
            "denied",
        ),
        // A reason this client does not know refuses the call.
        (
            atmost_error(Code::FailedPrecondition, "A_NEWER_REASON", &[]),
            "denied",
        ),
        // Without atmost's ErrorInfo: a proxy or a TLS front end that
        // refuses the caller refuses the call; one that finds the request
        // malformed finds it invalid; anything else is the base error.
        (Error::from(Status::permission_denied("proxy")), "denied"),
        (Error::from(Status::unauthenticated("front end")), "denied"),
        (Error::from(Status::invalid_argument("proxy")), "invalid"),
        (Error::from(Status::internal("proxy")), "rpc"),
        (Error::from(Status::unknown("proxy")), "rpc"),
        (Error::from(Status::not_found("no such route")), "rpc"),
    ] {
        assert_eq!(kind(e.clone()), want, "{e}");
    }
}

#[test]
fn a_cap_refusal_reads_tool_limit_and_calls_made_as_numbers() {
    let e = atmost_error(
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
        &[
            ("tool", "wallet.charge"),
            ("limit", "1"),
            ("calls_made", "1"),
        ],
    );
    let g = authorize_refused(e);
    let e = g.error().expect("the answer");
    assert_eq!(g.reason(), Some(Reason::PermitMaxCallsExceeded));
    assert_eq!(e.tool(), Some("wallet.charge"));
    assert_eq!(e.limit(), Some(1));
    assert_eq!(e.calls_made(), Some(1));
    let odd = atmost_error(Code::ResourceExhausted, "QUOTA_ATTEMPTS", &[("limit", "x")]);
    assert_eq!(odd.limit(), None, "not a number reads as absent");
    assert_eq!(odd.tool(), None);
}

#[test]
fn backoff_doubles_from_50ms_to_2s_with_jitter_in_its_upper_half() {
    for (tries, ceiling_ms) in [
        (1, 50),
        (2, 100),
        (3, 200),
        (6, 1600),
        (7, 2000),
        (40, 2000),
    ] {
        let ceiling = Duration::from_millis(ceiling_ms);
        for _ in 0..50 {
            let d = backoff(tries);
            assert!(d >= ceiling / 2 && d <= ceiling, "try {tries}: {d:?}");
        }
    }
}

#[test]
fn a_result_over_64_kib_is_stored_as_its_digest() {
    let small = vec![7u8; MAX_STORED_RESULT];
    assert_eq!(stored_result(&small), small);
    let big = vec![7u8; MAX_STORED_RESULT + 1];
    let stored = String::from_utf8(stored_result(&big)).expect("ASCII");
    let hex: String = Sha256::digest(&big)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(stored, format!("sha256:{hex}"));
}

#[test]
fn reasons_are_cut_on_a_character_boundary() {
    assert_eq!(truncate("short", 1024), "short");
    let long = "é".repeat(600); // 1200 bytes
    let cut = truncate(&long, 1024);
    assert_eq!(cut.len(), 1024);
    assert_eq!(truncate("aé", 2), "a");
}

#[test]
fn results_become_bytes_or_json() {
    assert_eq!(Dispatched::from(b"raw".to_vec()).result, b"raw");
    assert_eq!(Dispatched::from(&b"raw"[..]).result, b"raw");
    let json = Dispatched::from(serde_json::json!({"tx": 981}));
    assert_eq!(json.result, br#"{"tx":981}"#);
    assert_eq!(Dispatched::bytes("x").actual_cost(3).actual_cost, Some(3));
}

#[test]
fn any_error_raised_in_dispatch_is_an_unknown_outcome() {
    fn send() -> Result<(), DispatchError> {
        Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))?;
        Ok(())
    }
    assert!(matches!(send(), Err(DispatchError::Unknown(_))));
}

#[test]
fn settings_that_allow_no_call_are_refused_before_any_rpc() {
    let base = || GuardedCall::new("p", "t", "k").fingerprint(b"fp".to_vec());
    for (call, says) in [
        (GuardedCall::new("p", "t", "k"), "no request"),
        (base().holder_token(Vec::new()), "holder_token is empty"),
        (base().max_tries(0), "max_tries is 0"),
        (base().max_retry_time(Duration::ZERO), "max_retry_time is 0"),
        (
            base().dispatch_timeout(Duration::ZERO),
            "dispatch_timeout is 0",
        ),
    ] {
        match call.check() {
            Err(GuardError::InvalidCall(why)) => assert!(why.contains(says), "{why}"),
            other => panic!("{call:?}: {other:?}"),
        }
    }
    assert!(base().check().is_ok());
    let json = GuardedCall::new("p", "t", "k").request(&serde_json::json!({"a": 1}));
    assert_eq!(
        json.fingerprint.clone().and_then(Result::ok).as_deref(),
        Some(&crate::fingerprint(&serde_json::json!({"a": 1})).unwrap()[..])
    );
    // A request JSON cannot carry exactly is refused before any RPC.
    let big: serde_json::Value = serde_json::from_str(r#"{"id": 9007199254740993}"#).unwrap();
    match GuardedCall::new("p", "t", "k").request(&big).check() {
        Err(GuardError::InvalidCall(why)) => {
            assert!(why.contains("/id") && why.contains("2^53"), "{why}")
        }
        other => panic!("{other:?}"),
    }
    let nan = std::collections::BTreeMap::from([("amount", f64::NAN)]);
    match GuardedCall::new("p", "t", "k").request(&nan).check() {
        Err(GuardError::InvalidCall(why)) => assert!(why.contains("NaN"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_dispatch_timeout_only_shortens_the_lease_based_deadline() {
    let arrived = Instant::now();
    let lease = Duration::from_millis(1_500);
    let ms = |d: Instant| d.duration_since(arrived).as_millis();
    let deadline = |timeout: Option<u64>| {
        ms(dispatch_deadline(
            lease,
            arrived,
            arrived,
            timeout.map(Duration::from_millis),
        ))
    };
    assert_eq!(deadline(None), 500, "the lease less the 1 s margin");
    assert_eq!(deadline(Some(5_000)), 500, "a longer timeout is cut to it");
    assert_eq!(deadline(Some(200)), 200, "a shorter one is kept");
    // A lease under the margin leaves nothing, whatever the timeout.
    let none = dispatch_deadline(
        Duration::from_millis(900),
        arrived,
        arrived,
        Some(Duration::from_secs(5)),
    );
    assert_eq!(none, arrived);
    // A redelivery counted from the first try, 300 ms before it arrived:
    // the lease's deadline is 200 ms after the arrival, and so is the
    // timeout's of 5 s.
    let first_try = arrived - Duration::from_millis(300);
    let redelivered = dispatch_deadline(lease, first_try, arrived, Some(Duration::from_secs(5)));
    assert_eq!(ms(redelivered), 200);
}

/// An attempt whose lease is `lease_ms` long on the server's clock.
fn attempt_with_lease(lease_ms: i64) -> pb::Attempt {
    let created = 1_767_225_600_000;
    pb::Attempt {
        attempt_id: "0190a5b2-0000-7000-8000-000000000001".into(),
        created_at: Some(crate::timestamp(created)),
        lease_expires_at: Some(crate::timestamp(created + lease_ms)),
        ..Default::default()
    }
}

#[test]
fn the_lease_atmost_says_is_left_is_counted_from_the_answered_try() {
    // Three tries: the first at `first_try`; the one answered begun 400 ms
    // later; its answer arrived 300 ms after that.
    let first_try = Instant::now();
    let answered_try = first_try + Duration::from_millis(400);
    let arrived = answered_try + Duration::from_millis(300);
    let attempt = attempt_with_lease(3_000);
    let ms = |d: Instant| d.saturating_duration_since(arrived).as_millis();
    let window = |left: Option<u64>| {
        lease_window(
            left.map(Duration::from_millis),
            &attempt,
            first_try,
            answered_try,
        )
        .expect("a lease")
    };
    let deadline = |left: Option<u64>, timeout: Option<u64>| {
        let w = window(left);
        dispatch_deadline(w.lease, w.from, arrived, timeout.map(Duration::from_millis))
    };
    // A fresh DISPATCH, the whole lease left when the try was sent: the
    // answer's 300 ms trip is counted against it.
    assert_eq!(ms(deadline(Some(3_000), None)), 1_700);
    // A redelivery late in the lease: what is left, not the whole lease,
    // whatever the timeout; a shorter timeout (from the arrival) is kept.
    assert_eq!(ms(deadline(Some(1_500), None)), 200);
    assert_eq!(ms(deadline(Some(1_500), Some(5_000))), 200);
    assert_eq!(ms(deadline(Some(1_500), Some(100))), 100);
    // An answer that took all that was left above the margin leaves no
    // time at all, so dispatch is not called; so does less than the
    // margin, whose deadline passed when the try was sent.
    assert_eq!(deadline(Some(1_300), Some(5_000)), arrived);
    assert_eq!(
        deadline(Some(1_299), Some(5_000)),
        arrived - Duration::from_millis(1)
    );
    assert_eq!(deadline(Some(999), Some(5_000)), answered_try);
    assert_eq!(deadline(Some(0), None), answered_try);
    // A server that does not say: the whole lease from the first try,
    // 700 ms before the arrival.
    assert_eq!(ms(deadline(None, None)), 1_300);
    assert_eq!(ms(deadline(None, Some(5_000))), 1_300);
    // How a dispatch dropped at the lease's deadline names it.
    assert_eq!(
        window(Some(1_500)).to_string(),
        "1.5s left when the answered Authorize try was sent"
    );
    assert_eq!(
        window(None).to_string(),
        "a 3s lease from the first Authorize try"
    );
    let unknown = lease_window(None, &pb::Attempt::default(), first_try, answered_try);
    assert!(matches!(unknown, Err(GuardError::Rpc(_))), "{unknown:?}");
}

#[test]
fn a_timeout_or_a_lease_past_what_the_clock_holds_is_no_panic() {
    let now = Instant::now();
    let lease = Duration::from_millis(1_500);
    // Duration::MAX as "no timeout but the lease": the lease decides.
    let by_lease = dispatch_deadline(lease, now, now, Some(Duration::MAX));
    assert_eq!(by_lease, now + Duration::from_millis(500));
    // An absurd lease from a broken server: decades, or the timeout.
    assert!(dispatch_deadline(Duration::MAX, now, now, None) > now + Duration::from_secs(3_600));
    let by_timeout = dispatch_deadline(Duration::MAX, now, now, Some(Duration::from_secs(2)));
    assert_eq!(by_timeout, now + Duration::from_secs(2));
}

#[test]
fn a_negative_lease_remaining_is_no_time() {
    let negative = prost_types::Duration {
        seconds: -1,
        nanos: 0,
    };
    assert_eq!(duration_of(negative), Duration::ZERO);
    let left = crate::duration(Duration::from_millis(1_234));
    assert_eq!(duration_of(left), Duration::from_millis(1_234));
}

#[test]
fn a_status_without_details_still_reads() {
    // StatusExt is what Error uses; a plain status has no RetryInfo.
    let e = Error::from(Status::unavailable("down"));
    assert_eq!(e.retry_after(), None);
    assert!(e.status().get_details_error_info().is_none());
}

#[test]
fn a_commit_answered_without_the_success_keeps_the_whole_result() {
    let id = || AttemptId("0190a5b2-0000-7000-8000-000000000001".into());
    let receipt = pb::Receipt {
        receipt_id: "r-1".into(),
        result: b"stored".to_vec(),
        ..Default::default()
    };
    let succeeded = pb::Attempt {
        state: pb::AttemptState::Succeeded as i32,
        receipt: Some(receipt.clone()),
        ..Default::default()
    };
    let outcome = committed(id(), succeeded.clone(), b"whole".to_vec()).expect("recorded");
    assert_eq!(
        (outcome.result.as_slice(), outcome.replayed, outcome.receipt),
        (&b"whole"[..], false, receipt.clone())
    );
    // A broken server: no receipt, or an attempt that did not succeed.
    let without_receipt = pb::Attempt {
        receipt: None,
        ..succeeded.clone()
    };
    let failed = pb::Attempt {
        state: pb::AttemptState::Failed as i32,
        ..succeeded
    };
    for (settled, says) in [
        (without_receipt, "Succeeded without a receipt"),
        (failed, "Failed with a receipt"),
        (pb::Attempt::default(), "Unspecified without a receipt"),
    ] {
        match committed(id(), settled, b"whole".to_vec()) {
            Err(GuardError::CommitNotRecorded {
                attempt_id,
                outcome: Unrecorded::Succeeded { result },
                source,
            }) => {
                assert_eq!((attempt_id, result.as_slice()), (id(), &b"whole"[..]));
                assert_eq!(source.code(), Code::Internal);
                assert!(source.to_string().contains(says), "{source}");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_panic_reads_as_its_message() {
    let text = |p: Box<dyn std::any::Any + Send>| panic_message(&*p).to_owned();
    assert_eq!(text(Box::new("static")), "static");
    assert_eq!(text(Box::new(String::from("formatted 7"))), "formatted 7");
    assert_eq!(text(Box::new(7)), "(a panic without a message)");
}

/// Fails `failures` times with UNAVAILABLE, then answers; records when
/// each try was begun.
fn flaky(
    failures: usize,
    begun: &std::sync::Mutex<Vec<Instant>>,
) -> impl FnMut(Option<Duration>) -> std::future::Ready<Result<usize, Error>> + '_ {
    move |_| {
        let mut begun = begun.lock().expect("tries");
        begun.push(Instant::now());
        std::future::ready(match begun.len() {
            n if n <= failures => Err(Error::from(Status::unavailable("down"))),
            n => Ok(n),
        })
    }
}

#[tokio::test]
async fn retrying_answers_when_the_answered_try_was_begun() {
    let tries = std::sync::Mutex::new(Vec::new());
    let limits = RetryLimits::default();
    let (answer, begun) = retrying(&limits, None, "Authorize", authorize_may_retry, |_| {
        let n = {
            let mut tries = tries.lock().expect("tries");
            tries.push(Instant::now());
            tries.len()
        };
        async move {
            // Each answer takes its time to come back.
            tokio::time::sleep(Duration::from_millis(20)).await;
            match n {
                1 | 2 => Err(Error::from(Status::unavailable("down"))),
                n => Ok(n),
            }
        }
    })
    .await
    .expect("the third try answers");
    let tries = tries.lock().expect("tries");
    assert_eq!((answer, tries.len()), (3, 3));
    assert!(
        tries[1] < begun && begun <= tries[2],
        "the third try's start, not its answer's arrival: {begun:?} in {tries:?}"
    );
}

#[tokio::test]
async fn a_panicking_retry_hook_is_ignored_and_the_retry_goes_on() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = seen.clone();
    let observer: RetryObserver = Arc::new(move |r: &Retrying<'_>| {
        hook.lock().expect("seen").push((r.rpc, r.tries));
        panic!("the log sink is gone");
    });
    let tries = std::sync::Mutex::new(Vec::new());
    let limits = RetryLimits::default();
    let (answer, _) = retrying(
        &limits,
        Some(&observer),
        "Commit",
        settle_may_retry,
        flaky(2, &tries),
    )
    .await
    .expect("retried through the hook's panics");
    assert_eq!(answer, 3);
    assert_eq!(*seen.lock().expect("seen"), [("Commit", 1), ("Commit", 2)]);
}
