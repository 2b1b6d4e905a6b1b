//! The one error type of atmost. Every failure a caller can see is a variant
//! here; `api::status` maps each to a gRPC status and `google.rpc.ErrorInfo`
//! in a single exhaustive match.

use super::{AttemptState, Millis};

/// A malformed field, reported as a `google.rpc.BadRequest` field violation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub field: String,
    pub description: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("permit {permit_id} not found")]
    PermitNotFound { permit_id: String },
    #[error("permit {permit_id} is revoked")]
    PermitRevoked { permit_id: String },
    #[error("permit {permit_id} expired")]
    PermitExpired {
        permit_id: String,
        expired_at: Millis,
    },
    #[error("tool {tool:?} is not in the permit's scope")]
    ToolNotInScope { tool: String },
    #[error("tool {tool:?} reached its cap of {limit} calls")]
    MaxCallsExceeded {
        tool: String,
        limit: u64,
        calls_made: u64,
    },
    #[error(
        "cost {requested} does not fit the budget {budget} ({committed} committed, {reserved} reserved)"
    )]
    BudgetExceeded {
        budget: i64,
        committed: i64,
        reserved: i64,
        requested: i64,
    },
    #[error("idempotency key {idempotency_key:?} is bound to a different request")]
    KeyReused { idempotency_key: String },
    #[error("idempotency key {idempotency_key:?} has an attempt in flight")]
    InProgress {
        idempotency_key: String,
        lease_expires_at: Millis,
        /// How long until the lease passes, from the request's `now`.
        retry_after_ms: Millis,
    },
    #[error("same request as {earlier_key:?}, dispatched within the duplicate window")]
    DuplicateSuspected { tool: String, earlier_key: String },
    #[error("no attempt for idempotency key {idempotency_key:?}")]
    AttemptNotFound { idempotency_key: String },
    #[error("attempt_id does not match the attempt of key {idempotency_key:?}")]
    AttemptMismatch { idempotency_key: String },
    #[error("outcome contradicts the attempt's state {state:?}")]
    StateConflict { state: AttemptState },
    #[error("invalid request: {}", describe(.0))]
    InvalidRequest(Vec<Violation>),
    #[error("store unavailable: {0}")]
    StoreUnavailable(String),
    /// Load shedding: the request was refused before it reached the store,
    /// so it changed nothing and may be retried as it is.
    #[error("overloaded: {in_flight} requests in flight")]
    Overloaded { in_flight: usize },
}

fn describe(violations: &[Violation]) -> String {
    violations
        .iter()
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect::<Vec<_>>()
        .join("; ")
}
