//! How a status becomes an [`Error`]: what the client reads out of it. The
//! RPCs themselves are exercised against the real server by the service's
//! integration suite (tests/), which makes every call through this client.

use super::*;
use tonic_types::ErrorDetails;

fn atmost_error(code: Code, reason: &str, domain: &str) -> Status {
    let metadata = HashMap::from([("tool".to_owned(), "wallet.charge".to_owned())]);
    Status::with_error_details(
        code,
        "refused",
        ErrorDetails::with_error_info(reason, domain, metadata),
    )
}

#[test]
fn an_atmost_error_reads_as_its_reason_and_metadata() {
    let e = Error::from(atmost_error(
        Code::ResourceExhausted,
        "PERMIT_MAX_CALLS_EXCEEDED",
        DOMAIN,
    ));
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(e.reason(), Some(Reason::PermitMaxCallsExceeded));
    assert_eq!(e.reason_name(), Some("PERMIT_MAX_CALLS_EXCEEDED"));
    assert_eq!(e.reason_or_code(), "PERMIT_MAX_CALLS_EXCEEDED");
    assert_eq!(e.metadata()["tool"], "wallet.charge");
    assert!(!e.is_retryable());
    assert_eq!(
        e.to_string(),
        "PERMIT_MAX_CALLS_EXCEEDED: refused",
        "Display leads with the reason"
    );
}

#[test]
fn a_reason_this_client_does_not_know_is_unspecified_but_kept() {
    let e = Error::from(atmost_error(Code::Aborted, "SOME_NEWER_REASON", DOMAIN));
    assert_eq!(e.reason(), Some(Reason::Unspecified));
    assert_eq!(e.reason_name(), Some("SOME_NEWER_REASON"));
}

#[test]
fn a_failure_atmost_did_not_answer_has_no_reason() {
    // Another service's ErrorInfo (a proxy in between), and no details at
    // all (a broken connection): neither is atmost's word.
    for status in [
        atmost_error(Code::Unavailable, "STORE_UNAVAILABLE", "proxy.example"),
        Status::unavailable("connection reset"),
    ] {
        let e = Error::from(status);
        assert_eq!(e.reason(), None);
        assert_eq!(e.reason_or_code(), "Unavailable");
        assert!(e.metadata().is_empty());
        assert!(
            !e.is_retryable(),
            "only atmost's own word makes a retry safe"
        );
    }
}

#[test]
fn store_unavailable_and_overloaded_are_retryable_as_they_are() {
    for reason in ["STORE_UNAVAILABLE", "OVERLOADED"] {
        assert!(Error::from(atmost_error(Code::Unavailable, reason, DOMAIN)).is_retryable());
    }
}

#[test]
fn retry_info_and_field_violations_are_read() {
    let mut details = ErrorDetails::with_error_info("INVALID_REQUEST", DOMAIN, HashMap::new());
    details.set_retry_info(Some(Duration::from_millis(1500)));
    details.add_bad_request_violation("tool", "must be 1..=128 of [A-Za-z0-9._:/-]");
    details.add_bad_request_violation("cost", "must be within 0..=9007199254740991");
    let e = Error::from(Status::with_error_details(
        Code::InvalidArgument,
        "invalid",
        details,
    ));
    assert_eq!(e.retry_after(), Some(Duration::from_millis(1500)));
    assert_eq!(e.violated_fields(), ["tool", "cost"]);
}

#[test]
fn timestamps_round_trip_in_milliseconds() {
    for ms in [0, 1, 999, 1_767_225_600_123, -1, -1_001] {
        assert_eq!(millis(&timestamp(ms)), ms, "{ms}");
        let t = timestamp(ms);
        assert!((0..1_000_000_000).contains(&t.nanos), "{t:?}");
    }
    assert_eq!(
        duration(Duration::from_millis(2_500)),
        prost_types::Duration {
            seconds: 2,
            nanos: 500_000_000
        }
    );
}

#[test]
fn new_permit_builds_what_it_is_told() {
    let p = NewPermit::new(["search", "wallet.charge"])
        .subject("agent-7")
        .cap("wallet.charge", 1)
        .budget(500)
        .currency("EUR")
        .expires_at_ms(1_767_225_600_000)
        .lease(Duration::from_secs(5))
        .duplicate_guard(pb::DuplicateGuardMode::Enforce, None)
        .build();
    assert_eq!(p.tools, ["search", "wallet.charge"]);
    assert_eq!(p.max_calls_per_tool.len(), 1);
    assert_eq!(p.budget, Some(500));
    assert_eq!(p.expires_at.as_ref().map(millis), Some(1_767_225_600_000));
    assert_eq!(p.lease.map(|d| d.seconds), Some(5));
    assert_eq!(
        p.duplicate_guard.map(|g| g.mode()),
        Some(pb::DuplicateGuardMode::Enforce)
    );
    // Unless told, it expires an hour from now.
    let default = NewPermit::new(["t"]).build();
    let left = millis(&default.expires_at.expect("an expiry")) - now_ms();
    assert!((3_590_000..=3_600_000).contains(&left), "{left}");
}

#[test]
fn a_builder_never_shows_its_api_key_or_tls_private_key_in_debug_output() {
    const KEY_PEM: &str =
        "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIKEY-BYTES\n-----END PRIVATE KEY-----\n";
    let builder = Client::builder("127.0.0.1:50051")
        .api_key("sk-live-7f3a9c")
        .tls_identity_pem(
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
            KEY_PEM,
        )
        .timeout(Duration::from_secs(3));
    let shown = format!("{builder:?} {builder:#?}");
    for secret in ["sk-live-7f3a9c", "KEY-BYTES", "PRIVATE KEY"] {
        assert!(!shown.contains(secret), "{secret} in {shown}");
    }
    assert!(shown.contains("api_key: Some(\"<redacted>\")"), "{shown}");
    assert!(shown.contains("127.0.0.1:50051"), "{shown}");
    // tonic prints key bytes as numbers: none of the PEM's bytes either.
    let key_bytes = format!("{:?}", KEY_PEM.as_bytes());
    assert!(!shown.contains(&key_bytes[1..40]), "{shown}");
}
