#![forbid(unsafe_code)]
//! # atmost-client
//!
//! A typed Rust client of atmost's `atmost.v1` gRPC services: one method per
//! RPC, and every failure as an [`Error`] whose [`Reason`] is read from the
//! `google.rpc.ErrorInfo` atmost attaches (domain `atmost`). The service's
//! own tools and tests use it, so the helpers every caller needs (connect,
//! create a permit, read a reason, list every page) exist once.
//!
//! For agents and gateways, [`Client::guarded`] wraps one side-effecting
//! call with atmost: Authorize (retried safely), the call dispatched at most
//! once under a deadline, its outcome committed or marked uncertain, typed
//! errors ([`GuardError`]). The crate's README (client/README.md) walks
//! through it step by step.
//!
//! ## Layout
//!
//! - `lib.rs`: [`Client`] and its RPCs, [`Error`], [`NewPermit`], time helpers.
//! - `connect.rs`: [`Client::builder`]: address, API key, TLS and mTLS.
//! - `guarded.rs`: [`Client::guarded`], [`GuardedCall`], [`DispatchError`],
//!   [`Outcome`], [`GuardError`].
//! - `fingerprint.rs`: [`fingerprint`], SHA-256 of RFC 8785 canonical JSON.
//!
//! The RPCs one by one:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use atmost_client::{Client, NewPermit, Reason, pb};
//! let client = Client::connect("http://127.0.0.1:50051").await?;
//! let permit = client
//!     .create_permit(NewPermit::new(["wallet.charge"]).cap("wallet.charge", 1).budget(500))
//!     .await?;
//! let answer = client
//!     .authorize(pb::AuthorizeRequest {
//!         permit_id: permit.permit_id,
//!         tool: "wallet.charge".into(),
//!         idempotency_key: "charge-1".into(),
//!         request_fingerprint: b"sha256 of the request".to_vec(),
//!         cost: 500,
//!         holder_token: Vec::new(),
//!         ..Default::default()
//!     })
//!     .await;
//! match answer {
//!     Ok(r) if r.decision() == pb::Decision::Dispatch => { /* send the call */ }
//!     Ok(_replay) => { /* the key's earlier outcome: send nothing */ }
//!     Err(e) if e.reason() == Some(Reason::PermitMaxCallsExceeded) => { /* stop */ }
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok(()) }
//! ```

mod connect;
mod fingerprint;
mod guarded;

pub use connect::{ClientBuilder, ConnectError};
pub use fingerprint::{FingerprintError, MAX_SAFE_NUMBER, fingerprint};
pub use guarded::{
    AttemptId, DEFAULT_MAX_RETRY_TIME, DEFAULT_MAX_TRIES, DispatchError, Dispatched, FIRST_BACKOFF,
    GuardError, GuardedCall, LEASE_MARGIN, MAX_BACKOFF, MAX_STORED_RESULT, Outcome, RetryLimits,
    Retrying, Unrecorded,
};

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::{ErrorInfo, StatusExt};

/// The generated messages and client stubs of `atmost.v1`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("atmost.v1");
}

/// Why atmost refused a request: `ErrorInfo.reason`, by name
/// (`pb::ErrorReason` of the wire contract). A name this client does not
/// know (a newer server) reads as [`Reason::Unspecified`].
pub use pb::ErrorReason as Reason;

use pb::{
    approvals_client::ApprovalsClient, gate_client::GateClient, permits_client::PermitsClient,
};

/// The `ErrorInfo.domain` of every atmost error.
pub const DOMAIN: &str = "atmost";

// === Client ===

/// A connection to one atmost (or a load balancer in front of several).
/// Cheap to clone: clones share the HTTP/2 channel.
#[derive(Clone, Debug)]
pub struct Client {
    channel: Channel,
    gate: GateClient<Channel>,
    permits: PermitsClient<Channel>,
    approvals: ApprovalsClient<Channel>,
    timeout: Option<Duration>,
    /// `Bearer <key>`, sent with every RPC when set.
    authorization: Option<tonic::metadata::AsciiMetadataValue>,
}

impl Client {
    /// Connects to `target`, e.g. `http://127.0.0.1:50051`.
    pub async fn connect(target: impl Into<String>) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(target.into())?
            .connect()
            .await?;
        Ok(Self::new(channel))
    }

    /// A client on an existing channel.
    pub fn new(channel: Channel) -> Self {
        Self {
            gate: GateClient::new(channel.clone()),
            permits: PermitsClient::new(channel.clone()),
            approvals: ApprovalsClient::new(channel.clone()),
            channel,
            timeout: None,
            authorization: None,
        }
    }

    /// Sends every RPC with `authorization: Bearer <key>` (an atmost
    /// started with `--auth-keys`). The key must be visible ASCII.
    pub fn with_api_key(
        mut self,
        key: &str,
    ) -> Result<Self, tonic::metadata::errors::InvalidMetadataValue> {
        self.authorization = Some(bearer(key)?);
        Ok(self)
    }

    /// The channel, for the other services atmost serves on it
    /// (`grpc.health.v1.Health`, server reflection).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Sends every RPC with this deadline (`grpc-timeout`): past it the
    /// server gives up and the call fails with DEADLINE_EXCEEDED, which
    /// says nothing about whether the request was applied.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        self.request_within(message, None)
    }

    /// A request with the client's deadline, shortened to `within` when
    /// that is sooner (a guarded call's retries share one time budget).
    fn request_within<T>(&self, message: T, within: Option<Duration>) -> tonic::Request<T> {
        self.request_held(message, within, Duration::ZERO)
    }

    /// [`Self::request_within`] for a call the server may hold open for
    /// `held` (an Authorize with `wait`): the client's deadline is longer
    /// by it.
    fn request_held<T>(
        &self,
        message: T,
        within: Option<Duration>,
        held: Duration,
    ) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        let timeout = match (self.timeout.map(|t| t + held), within) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(timeout) = timeout {
            request.set_timeout(timeout);
        }
        if let Some(value) = &self.authorization {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        request
    }

    // --- atmost.v1.Gate ---

    /// Asks for a DISPATCH before a side-effecting call. [`Client::guarded`]
    /// wraps this, the call and its Commit in one step.
    pub async fn authorize(
        &self,
        request: pb::AuthorizeRequest,
    ) -> Result<pb::AuthorizeResponse, Error> {
        self.authorize_within(request, None).await
    }

    /// Reports the outcome of a dispatched (or never sent) call.
    pub async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse, Error> {
        self.commit_within(request, None).await
    }

    /// The call was sent and its response lost: slot and money stay held.
    pub async fn mark_uncertain(
        &self,
        request: pb::MarkUncertainRequest,
    ) -> Result<pb::MarkUncertainResponse, Error> {
        self.mark_uncertain_within(request, None).await
    }

    pub(crate) async fn authorize_within(
        &self,
        request: pb::AuthorizeRequest,
        within: Option<Duration>,
    ) -> Result<pb::AuthorizeResponse, Error> {
        let held = request.wait.as_ref().map_or(Duration::ZERO, |w| {
            Duration::new(w.seconds.max(0) as u64, w.nanos.max(0) as u32)
        });
        let request = self.request_held(request, within, held);
        answer(self.gate.clone().authorize(request).await)
    }

    pub(crate) async fn commit_within(
        &self,
        request: pb::CommitRequest,
        within: Option<Duration>,
    ) -> Result<pb::CommitResponse, Error> {
        let request = self.request_within(request, within);
        answer(self.gate.clone().commit(request).await)
    }

    pub(crate) async fn mark_uncertain_within(
        &self,
        request: pb::MarkUncertainRequest,
        within: Option<Duration>,
    ) -> Result<pb::MarkUncertainResponse, Error> {
        let request = self.request_within(request, within);
        answer(self.gate.clone().mark_uncertain(request).await)
    }

    // --- atmost.v1.Permits ---

    pub async fn create_permit(&self, permit: impl Into<pb::Permit>) -> Result<pb::Permit, Error> {
        let request = self.request(pb::CreatePermitRequest {
            permit: Some(permit.into()),
        });
        answer(self.permits.clone().create_permit(request).await)
    }

    pub async fn get_permit(&self, permit_id: &str) -> Result<pb::GetPermitResponse, Error> {
        let request = self.request(pb::GetPermitRequest {
            permit_id: permit_id.into(),
        });
        answer(self.permits.clone().get_permit(request).await)
    }

    /// One idempotency key's attempt as atmost sees it now (a RESERVED one
    /// past its lease reads UNCERTAIN). Reads only.
    pub async fn get_attempt(
        &self,
        permit_id: &str,
        idempotency_key: &str,
    ) -> Result<pb::GetAttemptResponse, Error> {
        let request = self.request(pb::GetAttemptRequest {
            permit_id: permit_id.into(),
            idempotency_key: idempotency_key.into(),
        });
        answer(self.permits.clone().get_attempt(request).await)
    }

    pub async fn revoke_permit(&self, permit_id: &str) -> Result<pb::Permit, Error> {
        let request = self.request(pb::RevokePermitRequest {
            permit_id: permit_id.into(),
        });
        answer(self.permits.clone().revoke_permit(request).await)
    }

    /// One page of UNCERTAIN attempts (`permit_id` empty: across permits).
    pub async fn list_uncertain(
        &self,
        request: pb::ListUncertainRequest,
    ) -> Result<pb::ListUncertainResponse, Error> {
        let request = self.request(request);
        answer(self.permits.clone().list_uncertain(request).await)
    }

    /// Every UNCERTAIN attempt under `permit_id` (empty: across permits),
    /// following page tokens to the end. A page larger than `page_size`, or
    /// a token that comes round again, is a broken server: INTERNAL.
    pub async fn list_all_uncertain(
        &self,
        permit_id: &str,
        page_size: u32,
    ) -> Result<Vec<pb::Attempt>, Error> {
        let mut out = Vec::new();
        let mut token = String::new();
        let mut seen = std::collections::HashSet::new();
        loop {
            let page = self
                .list_uncertain(pb::ListUncertainRequest {
                    permit_id: permit_id.into(),
                    page_size,
                    page_token: token.clone(),
                })
                .await?;
            let limit = if page_size == 0 { 100 } else { page_size };
            if page.attempts.len() > limit as usize {
                return Err(Error::from(Status::internal(format!(
                    "ListUncertain answered {} attempts for a page of {limit}",
                    page.attempts.len()
                ))));
            }
            out.extend(page.attempts);
            if page.next_page_token.is_empty() {
                return Ok(out);
            }
            if !seen.insert(page.next_page_token.clone()) {
                return Err(Error::from(Status::internal(
                    "ListUncertain answered a page token it had answered before",
                )));
            }
            token = page.next_page_token;
        }
    }

    /// Settles an UNCERTAIN attempt after asking the tool what happened.
    pub async fn resolve(&self, request: pb::ResolveRequest) -> Result<pb::ResolveResponse, Error> {
        let request = self.request(request);
        answer(self.permits.clone().resolve(request).await)
    }

    // --- atmost.v1.Approvals ---

    /// One page of calls awaiting approval (`permit_id` empty: across the
    /// caller's tenant), oldest request first.
    pub async fn list_approvals(
        &self,
        request: pb::ListApprovalsRequest,
    ) -> Result<pb::ListApprovalsResponse, Error> {
        let request = self.request(request);
        answer(self.approvals.clone().list_approvals(request).await)
    }

    /// Approves one call awaiting approval (an approver's or admin's key,
    /// never the key that requested it).
    pub async fn approve(
        &self,
        permit_id: &str,
        idempotency_key: &str,
        attempt_id: &str,
    ) -> Result<pb::ApproveResponse, Error> {
        let request = self.request(pb::ApproveRequest {
            permit_id: permit_id.into(),
            idempotency_key: idempotency_key.into(),
            attempt_id: attempt_id.into(),
        });
        answer(self.approvals.clone().approve(request).await)
    }

    /// Denies one pending call, with a reason its requester is told.
    pub async fn deny(
        &self,
        permit_id: &str,
        idempotency_key: &str,
        attempt_id: &str,
        reason: &str,
    ) -> Result<pb::DenyResponse, Error> {
        let request = self.request(pb::DenyRequest {
            permit_id: permit_id.into(),
            idempotency_key: idempotency_key.into(),
            attempt_id: attempt_id.into(),
            reason: reason.into(),
        });
        answer(self.approvals.clone().deny(request).await)
    }
}

/// `Bearer <key>`, marked sensitive (kept out of debug output).
fn bearer(
    key: &str,
) -> Result<tonic::metadata::AsciiMetadataValue, tonic::metadata::errors::InvalidMetadataValue> {
    let mut value: tonic::metadata::AsciiMetadataValue = format!("Bearer {key}").parse()?;
    value.set_sensitive(true);
    Ok(value)
}

fn answer<T>(result: Result<tonic::Response<T>, Status>) -> Result<T, Error> {
    result.map(tonic::Response::into_inner).map_err(Error::from)
}

// === Error ===

/// A failed RPC: the gRPC status, and the `ErrorInfo` atmost attached to it
/// (absent when the failure did not come from atmost: a broken connection,
/// a proxy, a deadline passed on the client).
#[derive(Debug, Clone)]
pub struct Error {
    status: Status,
    info: Option<ErrorInfo>,
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        let info = status
            .get_details_error_info()
            .filter(|info| info.domain == DOMAIN);
        Self { status, info }
    }
}

impl Error {
    pub fn code(&self) -> Code {
        self.status.code()
    }

    /// atmost's reason, or `None` when atmost did not answer this failure.
    pub fn reason(&self) -> Option<Reason> {
        self.info
            .as_ref()
            .map(|i| Reason::from_str_name(&i.reason).unwrap_or(Reason::Unspecified))
    }

    /// The reason's name as sent (kept even when this client does not know it).
    pub fn reason_name(&self) -> Option<&str> {
        self.info.as_ref().map(|i| i.reason.as_str())
    }

    /// The reason's name, or the gRPC code's name when atmost did not
    /// answer (`Unavailable` from a broken connection): a label for counts
    /// and logs.
    pub fn reason_or_code(&self) -> String {
        self.reason_name()
            .map_or_else(|| format!("{:?}", self.code()), str::to_owned)
    }

    /// The ErrorInfo metadata (docs/api.md, "Errors", lists it per reason).
    pub fn metadata(&self) -> HashMap<String, String> {
        self.info
            .as_ref()
            .map(|i| i.metadata.clone())
            .unwrap_or_default()
    }

    /// One ErrorInfo metadata value, as sent.
    pub fn metadata_value(&self, key: &str) -> Option<&str> {
        self.info
            .as_ref()
            .and_then(|i| i.metadata.get(key))
            .map(String::as_str)
    }

    /// The tool the refusal is about (PERMIT_MAX_CALLS_EXCEEDED,
    /// TOOL_NOT_IN_SCOPE, TOOL_HELD_UNCERTAIN, DUPLICATE_REQUEST_SUSPECTED).
    pub fn tool(&self) -> Option<&str> {
        self.metadata_value("tool")
    }

    /// The limit that was reached: the tool's cap (PERMIT_MAX_CALLS_EXCEEDED)
    /// or a quota's limit (QUOTA_*). `None` when absent or not a number.
    pub fn limit(&self) -> Option<u64> {
        self.metadata_value("limit")?.parse().ok()
    }

    /// The tool's slots held when a new key was refused past its cap
    /// (PERMIT_MAX_CALLS_EXCEEDED). `None` when absent or not a number.
    pub fn calls_made(&self) -> Option<u64> {
        self.metadata_value("calls_made")?.parse().ok()
    }

    /// The `google.rpc.RetryInfo` delay (IDEMPOTENCY_IN_PROGRESS, OVERLOADED).
    pub fn retry_after(&self) -> Option<Duration> {
        self.status
            .get_details_retry_info()
            .and_then(|r| r.retry_delay)
    }

    /// The fields an INVALID_REQUEST names, in order.
    pub fn violated_fields(&self) -> Vec<String> {
        self.status
            .get_details_bad_request()
            .map(|b| b.field_violations.into_iter().map(|v| v.field).collect())
            .unwrap_or_default()
    }

    /// Whether the same request may be sent again as it is: atmost could not
    /// reach its store (nothing was decided; the same idempotency key gets
    /// the original reservation back if it was made), or refused the request
    /// before the store (shed, or past its deadline: nothing changed).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.reason(),
            Some(Reason::StoreUnavailable | Reason::Overloaded | Reason::DeadlineExceeded)
        )
    }

    pub fn status(&self) -> &Status {
        &self.status
    }

    pub fn into_status(self) -> Status {
        self.status
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.reason_name() {
            Some(reason) => write!(f, "{reason}: {}", self.status.message()),
            None => write!(f, "{:?}: {}", self.code(), self.status.message()),
        }
    }
}

impl std::error::Error for Error {}

// === permits ===

/// A permit to create: the tools in scope, and what limits them. Expires in
/// an hour of system time unless told otherwise.
///
/// ```
/// use atmost_client::NewPermit;
/// let permit = NewPermit::new(["search", "wallet.charge"])
///     .subject("agent-7")
///     .cap("wallet.charge", 1)
///     .budget(500)
///     .build();
/// assert_eq!(permit.max_calls_per_tool["wallet.charge"], 1);
/// ```
#[derive(Debug, Clone)]
pub struct NewPermit(pb::Permit);

impl NewPermit {
    pub fn new<T: Into<String>>(tools: impl IntoIterator<Item = T>) -> Self {
        Self(pb::Permit {
            tools: tools.into_iter().map(Into::into).collect(),
            expires_at: Some(timestamp(now_ms() + 3_600_000)),
            ..Default::default()
        })
    }

    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.0.subject = subject.into();
        self
    }

    /// At most `calls` slots for `tool` (0 disables it).
    pub fn cap(mut self, tool: impl Into<String>, calls: u64) -> Self {
        self.0.max_calls_per_tool.insert(tool.into(), calls);
        self
    }

    pub fn budget(mut self, budget: i64) -> Self {
        self.0.budget = Some(budget);
        self
    }

    pub fn currency(mut self, currency: impl Into<String>) -> Self {
        self.0.currency = currency.into();
        self
    }

    /// Expiry, in milliseconds since the Unix epoch.
    pub fn expires_at_ms(mut self, ms: i64) -> Self {
        self.0.expires_at = Some(timestamp(ms));
        self
    }

    /// How long a dispatch may stay open before it is presumed uncertain.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.0.lease = Some(duration(lease));
        self
    }

    pub fn duplicate_guard(
        mut self,
        mode: pb::DuplicateGuardMode,
        window: Option<Duration>,
    ) -> Self {
        self.0.duplicate_guard = Some(pb::DuplicateGuard {
            mode: mode as i32,
            window: window.map(duration),
        });
        self
    }

    /// What an UNCERTAIN attempt blocks: COUNT (the default: it holds a
    /// slot like any dispatch) or HOLD_TOOL (no new key of its tool
    /// dispatches until it is resolved).
    pub fn uncertain_policy(mut self, policy: pb::UncertainPolicy) -> Self {
        self.0.uncertain_policy = policy as i32;
        self
    }

    /// Calls of `tool` wait for a person's approval: those costing at
    /// least `cost_at_least` (every call with `None`), for at most `wait`
    /// (`None`: the server's default), with `approvers` distinct approvals
    /// (1, or 2 for a four-eyes rule).
    pub fn approval(
        mut self,
        tool: impl Into<String>,
        cost_at_least: Option<i64>,
        wait: Option<Duration>,
        approvers: u32,
    ) -> Self {
        self.0.approval_per_tool.insert(
            tool.into(),
            pb::ApprovalRule {
                cost_at_least,
                wait: wait.map(duration),
                approvers,
            },
        );
        self
    }

    pub fn build(self) -> pb::Permit {
        self.0
    }
}

impl From<NewPermit> for pb::Permit {
    fn from(p: NewPermit) -> Self {
        p.0
    }
}

// === time ===

/// Milliseconds since the Unix epoch, by the system clock.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A protobuf timestamp of `ms` milliseconds since the Unix epoch.
pub fn timestamp(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

/// Milliseconds since the Unix epoch of a protobuf timestamp.
pub fn millis(t: &prost_types::Timestamp) -> i64 {
    t.seconds * 1000 + i64::from(t.nanos) / 1_000_000
}

/// A protobuf duration.
pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

#[cfg(test)]
mod tests;

/// The README's examples, compiled as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
