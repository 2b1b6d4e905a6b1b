//! The one error type of atmost. Every failure a caller can see is a variant
//! here; `api::status` maps each to a gRPC status and `google.rpc.ErrorInfo`
//! in a single exhaustive match.
//!
//! Each variant has one [`Reason`], whose name is the ErrorInfo reason on
//! the wire (the contract's `ErrorReason` values) and the name the Redis
//! scripts return: one vocabulary from Lua to the client.

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
    #[error(
        "tool {tool:?} is held: attempt {uncertain_key:?} is UNCERTAIN; resolve it before a new key"
    )]
    ToolHeld { tool: String, uncertain_key: String },
    #[error("same request as {earlier_key:?}, dispatched within the duplicate window")]
    DuplicateSuspected { tool: String, earlier_key: String },
    #[error("no attempt for idempotency key {idempotency_key:?}")]
    AttemptNotFound { idempotency_key: String },
    #[error("attempt_id does not match the attempt of key {idempotency_key:?}")]
    AttemptMismatch { idempotency_key: String },
    #[error("outcome contradicts the attempt's state {state:?}")]
    StateConflict { state: AttemptState },
    /// Another key reserved the attempt: only that key (or an admin) may
    /// Commit or MarkUncertain it; an operator may Resolve it.
    #[error(
        "the attempt of key {idempotency_key:?} was reserved by another key: only that key may settle it (an operator resolves it)"
    )]
    AttemptHolderMismatch { idempotency_key: String },
    /// Approve by the key that requested the call.
    #[error(
        "the call of key {idempotency_key:?} was requested by this key: nobody approves their own request"
    )]
    ApproverIsRequester { idempotency_key: String },
    #[error("invalid request: {}", describe(.0))]
    InvalidRequest(Vec<Violation>),
    #[error("store unavailable: {0}")]
    StoreUnavailable(String),
    /// Load shedding: the request was refused before it reached the store,
    /// so it changed nothing and may be retried as it is.
    #[error("overloaded: {in_flight} requests in flight")]
    Overloaded { in_flight: usize },
    /// No credential, or one atmost does not know: nothing was read.
    #[error("unauthenticated: {why}")]
    Unauthenticated { why: String },
    /// The caller's key has none of the roles the RPC needs.
    #[error("key {key_id:?} may not call {rpc}: it needs one of the roles {allowed}")]
    RoleNotAllowed {
        key_id: String,
        rpc: String,
        allowed: String,
    },
    /// The caller's deadline had passed before the store was asked: nothing
    /// changed.
    #[error("the caller's deadline passed before the store was asked; nothing changed")]
    DeadlineExceeded,
    /// A quota ([`Quota`]) has no room: nothing changed.
    #[error("{} (limit {limit})", quota.describe())]
    QuotaExceeded { quota: Quota, limit: u64 },
    /// A request message longer than the server reads, refused by the
    /// transport as its length prefix arrived: nothing was read.
    #[error(
        "the request message is {size} bytes, more than the {limit} this server reads; nothing was read"
    )]
    MessageTooLarge { limit: usize, size: usize },
}

/// The quotas (domain::Quotas holds their limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    PermitLifetime,
    OpenAttempts,
    Attempts,
    TenantPermits,
    StoreFull,
}

impl Quota {
    pub const fn reason(self) -> Reason {
        match self {
            Quota::PermitLifetime => Reason::QuotaPermitLifetime,
            Quota::OpenAttempts => Reason::QuotaOpenAttempts,
            Quota::Attempts => Reason::QuotaAttempts,
            Quota::TenantPermits => Reason::QuotaTenantPermits,
            Quota::StoreFull => Reason::QuotaStoreFull,
        }
    }

    /// The quota of a reason, if it names one.
    pub fn of(reason: Reason) -> Option<Quota> {
        [
            Quota::PermitLifetime,
            Quota::OpenAttempts,
            Quota::Attempts,
            Quota::TenantPermits,
            Quota::StoreFull,
        ]
        .into_iter()
        .find(|q| q.reason() == reason)
    }

    const fn describe(self) -> &'static str {
        match self {
            Quota::PermitLifetime => {
                "the permit would live longer than the longest lifetime allowed (ms)"
            }
            Quota::OpenAttempts => {
                "the permit has as many RESERVED or UNCERTAIN attempts as allowed; settle or resolve some first"
            }
            Quota::Attempts => {
                "the permit records as many idempotency keys as allowed; use a new permit"
            }
            Quota::TenantPermits => "the tenant has as many unexpired permits as allowed",
            Quota::StoreFull => {
                "the store holds as much as it may (bytes); nothing open is evicted to make room"
            }
        }
    }
}

fn describe(violations: &[Violation]) -> String {
    violations
        .iter()
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Declares [`Reason`] from one table, so each name is written once.
macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// Why a request failed, by the name clients see as the ErrorInfo
        /// reason (proto: `atmost.v1.ErrorReason`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
        }

        impl Reason {
            /// Every reason, in the contract's order.
            pub const ALL: &[Reason] = &[$(Reason::$variant,)*];

            /// The wire name, e.g. `IDEMPOTENCY_KEY_REUSED`.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $name,)*
                }
            }

            /// The reason of a wire name; `None` for a name atmost does not
            /// define.
            pub fn from_name(name: &str) -> Option<Reason> {
                match name {
                    $($name => Some(Reason::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

reasons! {
    PermitNotFound = "PERMIT_NOT_FOUND",
    PermitRevoked = "PERMIT_REVOKED",
    PermitExpired = "PERMIT_EXPIRED",
    ToolNotInScope = "TOOL_NOT_IN_SCOPE",
    MaxCallsExceeded = "PERMIT_MAX_CALLS_EXCEEDED",
    BudgetExceeded = "PERMIT_BUDGET_EXCEEDED",
    KeyReused = "IDEMPOTENCY_KEY_REUSED",
    InProgress = "IDEMPOTENCY_IN_PROGRESS",
    DuplicateSuspected = "DUPLICATE_REQUEST_SUSPECTED",
    AttemptNotFound = "ATTEMPT_NOT_FOUND",
    AttemptMismatch = "ATTEMPT_MISMATCH",
    StateConflict = "ATTEMPT_STATE_CONFLICT",
    InvalidRequest = "INVALID_REQUEST",
    StoreUnavailable = "STORE_UNAVAILABLE",
    /// Shed before the store: no store returns it.
    Overloaded = "OVERLOADED",
    /// Refused before the store: no store returns it.
    DeadlineExceeded = "DEADLINE_EXCEEDED",
    ToolHeld = "TOOL_HELD_UNCERTAIN",
    /// Refused before the service: no store returns it.
    Unauthenticated = "UNAUTHENTICATED",
    /// Refused before the service: no store returns it.
    RoleNotAllowed = "ROLE_NOT_ALLOWED",
    QuotaPermitLifetime = "QUOTA_PERMIT_LIFETIME",
    QuotaOpenAttempts = "QUOTA_OPEN_ATTEMPTS",
    QuotaAttempts = "QUOTA_ATTEMPTS",
    QuotaTenantPermits = "QUOTA_TENANT_PERMITS",
    QuotaStoreFull = "QUOTA_STORE_FULL",
    /// Refused by the transport: no store returns it.
    MessageTooLarge = "MESSAGE_TOO_LARGE",
    AttemptHolderMismatch = "ATTEMPT_HOLDER_MISMATCH",
    ApproverIsRequester = "APPROVER_IS_REQUESTER",
}

impl Error {
    /// The reason of this error, as clients see it.
    pub fn reason(&self) -> Reason {
        match self {
            Error::PermitNotFound { .. } => Reason::PermitNotFound,
            Error::PermitRevoked { .. } => Reason::PermitRevoked,
            Error::PermitExpired { .. } => Reason::PermitExpired,
            Error::ToolNotInScope { .. } => Reason::ToolNotInScope,
            Error::MaxCallsExceeded { .. } => Reason::MaxCallsExceeded,
            Error::BudgetExceeded { .. } => Reason::BudgetExceeded,
            Error::KeyReused { .. } => Reason::KeyReused,
            Error::InProgress { .. } => Reason::InProgress,
            Error::DuplicateSuspected { .. } => Reason::DuplicateSuspected,
            Error::AttemptNotFound { .. } => Reason::AttemptNotFound,
            Error::AttemptMismatch { .. } => Reason::AttemptMismatch,
            Error::StateConflict { .. } => Reason::StateConflict,
            Error::AttemptHolderMismatch { .. } => Reason::AttemptHolderMismatch,
            Error::ApproverIsRequester { .. } => Reason::ApproverIsRequester,
            Error::InvalidRequest(_) => Reason::InvalidRequest,
            Error::StoreUnavailable(_) => Reason::StoreUnavailable,
            Error::Overloaded { .. } => Reason::Overloaded,
            Error::DeadlineExceeded => Reason::DeadlineExceeded,
            Error::ToolHeld { .. } => Reason::ToolHeld,
            Error::Unauthenticated { .. } => Reason::Unauthenticated,
            Error::RoleNotAllowed { .. } => Reason::RoleNotAllowed,
            Error::QuotaExceeded { quota, .. } => quota.reason(),
            Error::MessageTooLarge { .. } => Reason::MessageTooLarge,
        }
    }
}
