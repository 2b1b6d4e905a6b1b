//! The one mapping from [`Error`] to a gRPC status with
//! `google.rpc.ErrorInfo` (domain `atmost`), plus `RetryInfo` for
//! IN_PROGRESS and `BadRequest` field violations for INVALID_REQUEST.
//! The Envoy front doors (`api::envoy`) read the same table
//! ([`code_and_metadata`], [`retry_after`]) for their HTTP answers.

use crate::domain::{Error, MAX_TIMESTAMP_MS, Millis};
use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every atmost error.
pub const DOMAIN: &str = "atmost";

/// The retry delay suggested to a request shed under overload.
const OVERLOAD_RETRY_MS: u64 = 50;

/// RFC 3339 with milliseconds, for timestamps in ErrorInfo metadata. A
/// time past the end of year 9999, which humantime cannot write (and
/// `to_string` would panic on), and which only a corrupt store could hold,
/// shows as that last instant.
pub fn rfc3339(ms: Millis) -> String {
    let ms = ms.clamp(0, MAX_TIMESTAMP_MS);
    let at = UNIX_EPOCH + Duration::from_millis(ms as u64);
    humantime::format_rfc3339_millis(at).to_string()
}

/// The status of `error`; its reason is also noted for the RPC's
/// telemetry ([`crate::telemetry::note_reason`]), so every error answered
/// is counted once, wherever it was decided.
pub fn to_status(error: Error) -> Status {
    crate::telemetry::note_reason(error.reason().as_str());
    let message = error.to_string();
    let (code, metadata) = code_and_metadata(&error);
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let mut details = ErrorDetails::with_error_info(error.reason().as_str(), DOMAIN, metadata);
    if let Some(delay) = retry_after(&error) {
        details.set_retry_info(Some(delay));
    }
    if let Error::InvalidRequest(violations) = &error {
        for v in violations {
            details.add_bad_request_violation(&v.field, &v.description);
        }
    }
    Status::with_error_details(code, message, details)
}

/// How long a caller refused with `error` should wait before it retries
/// as it is: the time to the lease's end for IDEMPOTENCY_IN_PROGRESS, a
/// short pause for OVERLOADED; `None` when a retry as is cannot succeed
/// by waiting. The RetryInfo of [`to_status`], for the Envoy front doors'
/// `Retry-After`.
pub fn retry_after(error: &Error) -> Option<Duration> {
    match error {
        Error::InProgress { retry_after_ms, .. } => {
            Some(Duration::from_millis((*retry_after_ms).max(0) as u64))
        }
        Error::Overloaded { .. } => Some(Duration::from_millis(OVERLOAD_RETRY_MS)),
        _ => None,
    }
}

/// The gRPC code of `error` and its ErrorInfo metadata: the one table
/// [`to_status`] and the Envoy front doors (`api::envoy`) both answer from.
pub fn code_and_metadata(error: &Error) -> (Code, Vec<(&'static str, String)>) {
    match error {
        Error::PermitNotFound { permit_id } => {
            (Code::NotFound, vec![("permit_id", permit_id.clone())])
        }
        Error::PermitRevoked { permit_id } => (
            Code::FailedPrecondition,
            vec![("permit_id", permit_id.clone())],
        ),
        Error::PermitExpired {
            permit_id,
            expired_at,
        } => (
            Code::FailedPrecondition,
            vec![
                ("permit_id", permit_id.clone()),
                ("expired_at", rfc3339(*expired_at)),
            ],
        ),
        Error::ToolNotInScope { tool } => (Code::PermissionDenied, vec![("tool", tool.clone())]),
        Error::MaxCallsExceeded {
            tool,
            limit,
            calls_made,
        } => (
            Code::ResourceExhausted,
            vec![
                ("tool", tool.clone()),
                ("limit", limit.to_string()),
                ("calls_made", calls_made.to_string()),
            ],
        ),
        Error::BudgetExceeded {
            budget,
            committed,
            reserved,
            requested,
        } => (
            Code::ResourceExhausted,
            vec![
                ("budget", budget.to_string()),
                ("committed", committed.to_string()),
                ("reserved", reserved.to_string()),
                ("requested", requested.to_string()),
            ],
        ),
        Error::KeyReused { idempotency_key } => (
            Code::FailedPrecondition,
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::AttemptHolderMismatch { idempotency_key }
        | Error::ApproverIsRequester { idempotency_key } => (
            Code::PermissionDenied,
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::InProgress {
            idempotency_key,
            lease_expires_at,
            ..
        } => (
            Code::Aborted,
            vec![
                ("idempotency_key", idempotency_key.clone()),
                ("lease_expires_at", rfc3339(*lease_expires_at)),
            ],
        ),
        Error::ToolHeld {
            tool,
            uncertain_key,
        } => (
            Code::FailedPrecondition,
            vec![
                ("tool", tool.clone()),
                ("uncertain_key", uncertain_key.clone()),
            ],
        ),
        Error::DuplicateSuspected { tool, earlier_key } => (
            Code::AlreadyExists,
            vec![("tool", tool.clone()), ("earlier_key", earlier_key.clone())],
        ),
        Error::AttemptNotFound { idempotency_key } => (
            Code::NotFound,
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::AttemptMismatch { idempotency_key } => (
            Code::FailedPrecondition,
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::StateConflict { state } => (
            Code::FailedPrecondition,
            vec![("state", state.as_str().to_owned())],
        ),
        Error::InvalidRequest(_) => (Code::InvalidArgument, vec![]),
        Error::StoreUnavailable(_) => (Code::Unavailable, vec![]),
        Error::Overloaded { in_flight } => (
            Code::Unavailable,
            vec![("in_flight", in_flight.to_string())],
        ),
        Error::DeadlineExceeded => (Code::DeadlineExceeded, vec![]),
        Error::Unauthenticated { .. } => (Code::Unauthenticated, vec![]),
        Error::RoleNotAllowed {
            key_id,
            rpc,
            allowed,
        } => (
            Code::PermissionDenied,
            vec![
                ("key_id", key_id.clone()),
                ("rpc", rpc.clone()),
                ("allowed_roles", allowed.clone()),
            ],
        ),
        Error::QuotaExceeded { limit, .. } => {
            (Code::ResourceExhausted, vec![("limit", limit.to_string())])
        }
        // gRPC's code for a message past the receiver's limit.
        Error::MessageTooLarge { limit, size } => (
            Code::ResourceExhausted,
            vec![("limit", limit.to_string()), ("size", size.to_string())],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{DOMAIN, to_status};
    use crate::domain::{Error, Reason};
    use crate::pb;
    use std::collections::BTreeSet;
    use tonic_types::StatusExt;

    /// The contract's ErrorReason values, but ERROR_REASON_UNSPECIFIED.
    fn proto_reasons() -> BTreeSet<&'static str> {
        (0..=i32::from(u8::MAX))
            .filter_map(|v| pb::ErrorReason::try_from(v).ok())
            .filter(|r| *r != pb::ErrorReason::Unspecified)
            .map(|r| r.as_str_name())
            .collect()
    }

    #[test]
    fn the_domain_reasons_are_the_contracts() {
        let domain: BTreeSet<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(domain.len(), Reason::ALL.len(), "a name given twice");
        assert_eq!(domain, proto_reasons());
        for &reason in Reason::ALL {
            assert!(pb::ErrorReason::from_str_name(reason.as_str()).is_some());
            assert_eq!(Reason::from_name(reason.as_str()), Some(reason));
        }
        assert_eq!(Reason::KeyReused.as_str(), "IDEMPOTENCY_KEY_REUSED");
        assert_eq!(Reason::from_name("KEY_REUSED"), None);
        assert_eq!(Reason::from_name("ERROR_REASON_UNSPECIFIED"), None);
    }

    /// Found by fuzzing the Redis replies: a script's error naming a time
    /// past year 9999 made `to_status` panic.
    #[test]
    fn a_time_past_year_9999_is_written_not_a_panic() {
        let error = |at| Error::InProgress {
            idempotency_key: "k".into(),
            lease_expires_at: at,
            retry_after_ms: 0,
        };
        for at in [253_402_300_800_000, i64::MAX, i64::MIN] {
            let info = to_status(error(at)).get_details_error_info().unwrap();
            assert!(info.metadata["lease_expires_at"].starts_with(if at < 0 {
                "1970-01-01T"
            } else {
                "9999-12-31T"
            }));
        }
    }

    #[test]
    fn the_status_carries_the_errors_reason() {
        let error = Error::KeyReused {
            idempotency_key: "k".into(),
        };
        let info = to_status(error.clone()).get_details_error_info().unwrap();
        assert_eq!(info.reason, error.reason().as_str());
        assert_eq!(info.domain, DOMAIN);
    }
}
