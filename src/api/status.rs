//! The one mapping from [`Error`] to a gRPC status with
//! `google.rpc.ErrorInfo` (domain `atmost`), plus `RetryInfo` for
//! IN_PROGRESS and `BadRequest` field violations for INVALID_REQUEST.

use crate::domain::{Error, Millis};
use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The ErrorInfo domain of every atmost error.
pub const DOMAIN: &str = "atmost";

/// The retry delay suggested to a request shed under overload.
const OVERLOAD_RETRY_MS: u64 = 50;

/// RFC 3339 with milliseconds, for timestamps in ErrorInfo metadata.
pub fn rfc3339(ms: Millis) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(at).to_string()
}

pub fn to_status(error: Error) -> Status {
    let message = error.to_string();
    let (code, reason, metadata): (Code, &str, Vec<(&str, String)>) = match &error {
        Error::PermitNotFound { permit_id } => (
            Code::NotFound,
            "PERMIT_NOT_FOUND",
            vec![("permit_id", permit_id.clone())],
        ),
        Error::PermitRevoked { permit_id } => (
            Code::FailedPrecondition,
            "PERMIT_REVOKED",
            vec![("permit_id", permit_id.clone())],
        ),
        Error::PermitExpired {
            permit_id,
            expired_at,
        } => (
            Code::FailedPrecondition,
            "PERMIT_EXPIRED",
            vec![
                ("permit_id", permit_id.clone()),
                ("expired_at", rfc3339(*expired_at)),
            ],
        ),
        Error::ToolNotInScope { tool } => (
            Code::PermissionDenied,
            "TOOL_NOT_IN_SCOPE",
            vec![("tool", tool.clone())],
        ),
        Error::MaxCallsExceeded {
            tool,
            limit,
            calls_made,
        } => (
            Code::ResourceExhausted,
            "PERMIT_MAX_CALLS_EXCEEDED",
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
            "PERMIT_BUDGET_EXCEEDED",
            vec![
                ("budget", budget.to_string()),
                ("committed", committed.to_string()),
                ("reserved", reserved.to_string()),
                ("requested", requested.to_string()),
            ],
        ),
        Error::KeyReused { idempotency_key } => (
            Code::FailedPrecondition,
            "IDEMPOTENCY_KEY_REUSED",
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::InProgress {
            idempotency_key,
            lease_expires_at,
            ..
        } => (
            Code::Aborted,
            "IDEMPOTENCY_IN_PROGRESS",
            vec![
                ("idempotency_key", idempotency_key.clone()),
                ("lease_expires_at", rfc3339(*lease_expires_at)),
            ],
        ),
        Error::DuplicateSuspected { tool, earlier_key } => (
            Code::AlreadyExists,
            "DUPLICATE_REQUEST_SUSPECTED",
            vec![("tool", tool.clone()), ("earlier_key", earlier_key.clone())],
        ),
        Error::AttemptNotFound { idempotency_key } => (
            Code::NotFound,
            "ATTEMPT_NOT_FOUND",
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::AttemptMismatch { idempotency_key } => (
            Code::FailedPrecondition,
            "ATTEMPT_MISMATCH",
            vec![("idempotency_key", idempotency_key.clone())],
        ),
        Error::StateConflict { state } => (
            Code::FailedPrecondition,
            "ATTEMPT_STATE_CONFLICT",
            vec![("state", state.as_str().to_owned())],
        ),
        Error::InvalidRequest(_) => (Code::InvalidArgument, "INVALID_REQUEST", vec![]),
        Error::StoreUnavailable(_) => (Code::Unavailable, "STORE_UNAVAILABLE", vec![]),
        Error::Overloaded { in_flight } => (
            Code::Unavailable,
            "OVERLOADED",
            vec![("in_flight", in_flight.to_string())],
        ),
    };
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    let mut details = ErrorDetails::with_error_info(reason, DOMAIN, metadata);
    match &error {
        Error::InProgress { retry_after_ms, .. } => {
            details.set_retry_info(Some(Duration::from_millis((*retry_after_ms).max(0) as u64)));
        }
        Error::Overloaded { .. } => {
            details.set_retry_info(Some(Duration::from_millis(OVERLOAD_RETRY_MS)));
        }
        Error::InvalidRequest(violations) => {
            for v in violations {
                details.add_bad_request_violation(&v.field, &v.description);
            }
        }
        _ => {}
    }
    Status::with_error_details(code, message, details)
}
