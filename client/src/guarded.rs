//! The guarded call: one side-effecting tool call wrapped with atmost, the
//! way every atmost client helper does it (Rust, Python, TypeScript).
//!
//! 1. **Authorize**, with a holder token made once for the call, retried
//!    only where a retry cannot dispatch twice (UNAVAILABLE,
//!    DEADLINE_EXCEEDED, IDEMPOTENCY_IN_PROGRESS), always as the same
//!    request.
//! 2. **REPLAY**: the key's earlier outcome, and nothing is dispatched.
//! 3. **DISPATCH**: the caller's `dispatch` runs once, under a deadline
//!    (the lease atmost says is left, less [`LEASE_MARGIN`], counted from
//!    when the Authorize try it answered was sent); what it says decides
//!    the report: Commit Succeeded, Failed or NotSent, or MarkUncertain
//!    when the outcome is unknown (a panic of `dispatch` is marked
//!    uncertain, then resumed). Nothing is ever sent twice
//!    within one guarded call. A DISPATCH *redelivered* to a token the
//!    caller gave ([`GuardedCall::holder_token`]) is not dispatched: an
//!    earlier run may have sent it, so the call answers
//!    [`GuardError::HeldByEarlierRun`] for the caller to settle.
//! 4. **Commit / MarkUncertain**, retried like Authorize; if they cannot be
//!    recorded, [`GuardError::CommitNotRecorded`] says so and names the
//!    attempt (its lease turns it UNCERTAIN; an operator resolves it).
//!
//! What it cannot do: if the task running the guarded call is dropped (or
//! killed) while `dispatch` runs, nothing is reported; the attempt stays
//! RESERVED until its lease passes and then reads UNCERTAIN, as atmost
//! promises for any holder that goes away. A restarted process that kept
//! the call's holder token gets [`GuardError::HeldByEarlierRun`] within the
//! lease and settles the attempt with [`Client::settle_not_sent`] or
//! [`Client::settle_uncertain`].

// A GuardError is made at most once per tool call, beside several network
// round trips: its size is nothing, and boxing what it carries would only
// make every caller's match read through one more indirection. (The one
// whole attempt a variant carries, HeldByEarlierRun's, is boxed: it alone
// would triple every variant's size.)
#![allow(clippy::result_large_err)]

use crate::{Client, Error, Reason, pb};
use sha2::{Digest, Sha256};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Code, Status};

/// Tries of one RPC (the first included) unless told otherwise.
pub const DEFAULT_MAX_TRIES: u32 = 5;
/// Time all tries of one RPC may take unless told otherwise.
pub const DEFAULT_MAX_RETRY_TIME: Duration = Duration::from_secs(10);
/// The first backoff; it doubles per try, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(50);
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// `dispatch` must finish this long before the attempt's lease ends (a
/// dispatch timeout only shortens that): the lease is decided on the
/// server's clock and counted here on this process's, from when the
/// answered Authorize try was sent (the answer's trip is counted against
/// it); the margin covers the two clocks' rates.
pub const LEASE_MARGIN: Duration = Duration::from_secs(1);
/// The largest result atmost stores (docs/api.md, "Limits"). A larger one
/// is stored as the text `sha256:<hex>` of its digest.
pub const MAX_STORED_RESULT: usize = 64 * 1024;
/// The longest failure or uncertainty reason atmost stores.
const MAX_REASON_BYTES: usize = 1024;

// === the call ===

/// The attempt id a DISPATCH carries: forward it to the tool as the tool's
/// own idempotency key, so a call that is sent twice by anything outside
/// atmost still takes effect once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttemptId(String);

impl AttemptId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::fmt::Display for AttemptId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for AttemptId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// How Authorize, Commit and MarkUncertain are retried: each RPC gets at
/// most `max_tries` tries within `max_time`, whichever ends first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryLimits {
    pub max_tries: u32,
    pub max_time: Duration,
}

impl Default for RetryLimits {
    fn default() -> Self {
        Self {
            max_tries: DEFAULT_MAX_TRIES,
            max_time: DEFAULT_MAX_RETRY_TIME,
        }
    }
}

/// A retry about to happen, for [`GuardedCall::on_retry`]: which RPC, how
/// many tries it has had, the error of the last, and the wait before the
/// next.
#[derive(Debug)]
pub struct Retrying<'a> {
    pub rpc: &'static str,
    pub tries: u32,
    pub error: &'a Error,
    pub delay: Duration,
}

type RetryObserver = Arc<dyn Fn(&Retrying<'_>) + Send + Sync>;

/// One logical tool call: `GuardedCall::new(permit_id, tool, key)`, then
/// the request (or its fingerprint) and the options. Keep `key` stable
/// across your own retries of the same logical call: that is what makes
/// them replays instead of second dispatches.
#[derive(Clone)]
pub struct GuardedCall {
    permit_id: String,
    tool: String,
    key: String,
    fingerprint: Option<Result<Vec<u8>, crate::FingerprintError>>,
    cost: i64,
    holder_token: Option<Vec<u8>>,
    dispatch_timeout: Option<Duration>,
    retry: RetryLimits,
    on_retry: Option<RetryObserver>,
    approval_summary: String,
    approval_wait: Duration,
}

impl std::fmt::Debug for GuardedCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedCall")
            .field("permit_id", &self.permit_id)
            .field("tool", &self.tool)
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .field("cost", &self.cost)
            .field("holder_token", &self.holder_token.as_ref().map(|_| "<set>"))
            .field("dispatch_timeout", &self.dispatch_timeout)
            .field("retry", &self.retry)
            .field("approval_wait", &self.approval_wait)
            .finish_non_exhaustive()
    }
}

impl GuardedCall {
    pub fn new(
        permit_id: impl Into<String>,
        tool: impl Into<String>,
        idempotency_key: impl Into<String>,
    ) -> Self {
        Self {
            permit_id: permit_id.into(),
            tool: tool.into(),
            key: idempotency_key.into(),
            fingerprint: None,
            cost: 0,
            holder_token: None,
            dispatch_timeout: None,
            retry: RetryLimits::default(),
            on_retry: None,
            approval_summary: String::new(),
            approval_wait: Duration::ZERO,
        }
    }

    /// For a call the permit's approval rule holds: a short description
    /// for the approvers (at most 1024 bytes), shown to them as the
    /// caller's claim; the request's fingerprint is what the approval
    /// binds to.
    pub fn approval_summary(mut self, summary: impl Into<String>) -> Self {
        self.approval_summary = summary.into();
        self
    }

    /// How long the call may wait for a person's decision when the
    /// permit's approval rule holds it (default: not at all). atmost holds
    /// each Authorize open for up to a minute of it (AuthorizeRequest.wait),
    /// so a wait of ten minutes is ten calls, not a poll loop. Approved in
    /// time: dispatched as usual. Denied (or lapsed):
    /// [`GuardError::ApprovalDenied`]. Still waiting at the end:
    /// [`GuardError::AwaitingApproval`]; nothing was sent, and the same
    /// call (same key and request) made again picks up where it left off.
    pub fn approval_wait(mut self, wait: Duration) -> Self {
        self.approval_wait = wait;
        self
    }

    /// The request (a `serde_json::Value` or anything `Serialize`),
    /// fingerprinted with [`crate::fingerprint`] (SHA-256 of its RFC 8785
    /// canonical JSON). One JSON cannot carry exactly (NaN, an infinity, a
    /// number past ±(2^53 - 1)) makes the call fail with
    /// [`GuardError::InvalidCall`] before anything is asked.
    pub fn request<T: serde::Serialize + ?Sized>(mut self, request: &T) -> Self {
        self.fingerprint = Some(crate::fingerprint(request).map(|f| f.to_vec()));
        self
    }

    /// An explicit fingerprint (1..=64 bytes) instead of a JSON request.
    pub fn fingerprint(mut self, fingerprint: impl Into<Vec<u8>>) -> Self {
        self.fingerprint = Some(Ok(fingerprint.into()));
        self
    }

    /// The cost to reserve, in minor units (default 0).
    pub fn cost(mut self, cost: i64) -> Self {
        self.cost = cost;
        self
    }

    /// The holder token (1..=64 bytes) to send instead of 16 random bytes
    /// made for this call: for a caller that keeps it with the call (say in
    /// its journal) so that, restarted, it can recover the attempt an
    /// earlier run reserved and settle it, never to send it again. Within
    /// the lease, the same key, request and token then answer
    /// [`GuardError::HeldByEarlierRun`] instead of IDEMPOTENCY_IN_PROGRESS;
    /// `dispatch` is not called (atmost cannot know whether the earlier run
    /// sent). A fresh DISPATCH to it is dispatched as usual (docs/api.md,
    /// "Recovering a lost DISPATCH"). Never give one token to two workers.
    pub fn holder_token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.holder_token = Some(token.into());
        self
    }

    /// How long `dispatch` may run, from when the DISPATCH arrived; never
    /// past the default, what atmost said is left of the attempt's lease
    /// less [`LEASE_MARGIN`], counted from when the Authorize try it
    /// answered was sent (a longer timeout is cut to it).
    pub fn dispatch_timeout(mut self, timeout: Duration) -> Self {
        self.dispatch_timeout = Some(timeout);
        self
    }

    /// Tries per RPC, the first included (default 5).
    pub fn max_tries(mut self, tries: u32) -> Self {
        self.retry.max_tries = tries;
        self
    }

    /// Time all tries of one RPC may take (default 10 s).
    pub fn max_retry_time(mut self, time: Duration) -> Self {
        self.retry.max_time = time;
        self
    }

    /// Called before each retry (for logs and metrics). A panic in it is
    /// caught and ignored (the panic hook has printed it): the retry goes
    /// on as if it had returned.
    pub fn on_retry(mut self, observer: impl Fn(&Retrying<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Arc::new(observer));
        self
    }

    /// What cannot be left to the server to refuse: a missing fingerprint,
    /// limits that allow no try, and an empty token (sent, it would mean
    /// "no token" and silently lose the recovery it was given for).
    fn check(&self) -> Result<(), GuardError> {
        let invalid = |what: &str| Err(GuardError::InvalidCall(what.to_owned()));
        match &self.fingerprint {
            None => return invalid("no request: give .request(&json) or .fingerprint(bytes)"),
            Some(Err(e)) => return invalid(&e.to_string()),
            Some(Ok(_)) => {}
        }
        if self.holder_token.as_ref().is_some_and(Vec::is_empty) {
            return invalid("holder_token is empty: give 1..=64 bytes, or none for a random one");
        }
        if self.retry.max_tries == 0 {
            return invalid("max_tries is 0: at least one try is needed");
        }
        if self.retry.max_time.is_zero() {
            return invalid("max_retry_time is 0: no try could be made");
        }
        if self.approval_summary.len() > 1024 {
            return invalid("approval_summary is longer than 1024 bytes");
        }
        if self.dispatch_timeout.is_some_and(|t| t.is_zero()) {
            return invalid("dispatch_timeout is 0: dispatch could never run");
        }
        Ok(())
    }
}

// === what dispatch says ===

/// What the tool answered: the result to store in the receipt and, if the
/// call cost less than reserved, its actual cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatched {
    pub result: Vec<u8>,
    pub actual_cost: Option<i64>,
}

impl Dispatched {
    /// A result stored as these bytes.
    pub fn bytes(result: impl Into<Vec<u8>>) -> Self {
        Self {
            result: result.into(),
            actual_cost: None,
        }
    }

    /// A result stored as its JSON text (UTF-8).
    pub fn json(result: &serde_json::Value) -> Self {
        Self::bytes(result.to_string())
    }

    /// The cost to commit instead of the reserved one: 0 up to that. atmost
    /// checks it: one out of range (negative, above the reservation) is
    /// refused (INVALID_REQUEST, not retried), nothing is recorded, and the
    /// call answers [`GuardError::CommitNotRecorded`] carrying the whole
    /// result; the attempt turns UNCERTAIN at its lease.
    pub fn actual_cost(mut self, cost: i64) -> Self {
        self.actual_cost = Some(cost);
        self
    }
}

impl From<Vec<u8>> for Dispatched {
    fn from(result: Vec<u8>) -> Self {
        Self::bytes(result)
    }
}

impl From<&[u8]> for Dispatched {
    fn from(result: &[u8]) -> Self {
        Self::bytes(result)
    }
}

impl From<serde_json::Value> for Dispatched {
    fn from(result: serde_json::Value) -> Self {
        Self::json(&result)
    }
}

/// How `dispatch` says the call did not succeed. `?` on any other error
/// makes it [`Unknown`](Self::Unknown): when in doubt, the call may have
/// taken effect.
#[derive(Debug)]
pub enum DispatchError {
    /// The tool answered and refused (a declined card, a validation error):
    /// Commit Failed with this reason. The slot stays used.
    Failed(String),
    /// The call certainly never left (the connection to the tool could not
    /// be opened, say): Commit NotSent gives the slot and the cost back.
    NotSent,
    /// Anything else: it may have taken effect. MarkUncertain, and nothing
    /// is sent again.
    Unknown(Box<dyn std::error::Error + Send + Sync>),
}

impl DispatchError {
    pub fn failed(reason: impl Into<String>) -> Self {
        Self::Failed(reason.into())
    }

    pub fn unknown(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Unknown(error.into())
    }
}

/// Any error is an unknown outcome (this is why `DispatchError` is not
/// itself a `std::error::Error`: it could not be both).
impl<E: std::error::Error + Send + Sync + 'static> From<E> for DispatchError {
    fn from(error: E) -> Self {
        Self::Unknown(Box::new(error))
    }
}

impl std::fmt::Display for DispatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(reason) => write!(f, "the tool refused: {reason}"),
            Self::NotSent => f.write_str("the call was not sent"),
            Self::Unknown(e) => write!(f, "outcome unknown: {e}"),
        }
    }
}

// === what the guarded call answers ===

/// A call that succeeded, now or earlier.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The tool's result: in full when dispatched now; as stored when
    /// `replayed` (a result over 64 KiB was stored as `sha256:<hex>`).
    pub result: Vec<u8>,
    /// The key's earlier outcome: nothing was dispatched by this call.
    pub replayed: bool,
    /// The attempt, SUCCEEDED.
    pub attempt: pb::Attempt,
    /// Its receipt (signed when atmost has a signing key).
    pub receipt: pb::Receipt,
}

/// The outcome a guarded call could not get recorded.
#[derive(Debug)]
pub enum Unrecorded {
    /// The tool succeeded with this result (the caller still has it).
    Succeeded {
        result: Vec<u8>,
    },
    Failed {
        reason: String,
    },
    NotSent,
    /// The outcome is unknown; why.
    Uncertain {
        reason: String,
    },
}

/// Why a guarded call did not return an [`Outcome`]. The variants that
/// carry an [`Error`] keep atmost's answer whole: its code, its reason and
/// the ErrorInfo metadata ([`Error::tool`], [`Error::limit`],
/// [`Error::calls_made`], [`Error::retry_after`]).
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// atmost refused the call: PERMIT_MAX_CALLS_EXCEEDED,
    /// PERMIT_BUDGET_EXCEEDED, TOOL_NOT_IN_SCOPE, PERMIT_REVOKED,
    /// PERMIT_EXPIRED, PERMIT_NOT_FOUND, IDEMPOTENCY_KEY_REUSED,
    /// TOOL_HELD_UNCERTAIN, DUPLICATE_REQUEST_SUSPECTED, the quotas,
    /// UNAUTHENTICATED, ROLE_NOT_ALLOWED, a reason this client does not
    /// know; or UNAUTHENTICATED or PERMISSION_DENIED without atmost's
    /// ErrorInfo (a proxy, a TLS front end). Nothing was dispatched.
    #[error("atmost refused the call: {0}")]
    Denied(#[source] Error),
    /// Another holder's call under the same key is in flight (and stayed so
    /// through the retries). Nothing was dispatched.
    #[error("the key's call is in flight elsewhere: {0}")]
    InProgress(#[source] Error),
    /// atmost could not be reached, or answered UNAVAILABLE or
    /// DEADLINE_EXCEEDED, through every try. Nothing was dispatched; the
    /// same call (same key) may be made again.
    #[error("atmost unavailable: {0}")]
    Unavailable(#[source] Error),
    /// atmost found the request malformed (INVALID_REQUEST; the fields are
    /// in [`Error::violated_fields`]), or INVALID_ARGUMENT came without a
    /// reason this client knows. Nothing was dispatched.
    #[error("atmost found the request invalid: {0}")]
    InvalidRequest(#[source] Error),
    /// Any other failure that is not atmost's word (no ErrorInfo: a proxy,
    /// a broken answer) and not worth a retry. Nothing was dispatched.
    #[error("the Authorize call failed: {0}")]
    Rpc(#[source] Error),
    /// The tool refused: now (Commit Failed recorded) or, when `replayed`,
    /// earlier under this key.
    #[error("the tool refused{}: {reason}", if *.replayed { " (replayed)" } else { "" })]
    ToolFailed {
        attempt_id: AttemptId,
        reason: String,
        replayed: bool,
    },
    /// The call may or may not have taken effect: now (marked UNCERTAIN, with
    /// the dispatch's error as the source) or, when `replayed`, earlier under
    /// this key. It is never sent again; an operator resolves it
    /// (ListUncertain, Resolve).
    #[error("outcome uncertain{} for attempt {attempt_id}: {reason}", if *.replayed { " (replayed)" } else { "" })]
    OutcomeUncertain {
        attempt_id: AttemptId,
        reason: String,
        replayed: bool,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The call waits for a person's approval (the permit's approval rule)
    /// and no decision came within [`GuardedCall::approval_wait`]. Nothing
    /// was sent; the slot and the cost stay reserved until the request
    /// lapses at `expires_at`. Make the same call (same key and request)
    /// again to wait on, or to dispatch once approved.
    #[error(
        "attempt {attempt_id} awaits approval (until {expires_at_ms} ms since the epoch): nothing was sent"
    )]
    AwaitingApproval {
        attempt_id: AttemptId,
        /// When the request lapses, in ms since the Unix epoch (0: unknown).
        expires_at_ms: i64,
    },
    /// A person denied the call, or nobody decided in time
    /// (`approval_expired`), or its permit was revoked. It was never sent
    /// and the key replays this denial: a new call needs a new key.
    #[error("the call was denied approval{}: {reason}", if *.replayed { " (replayed)" } else { "" })]
    ApprovalDenied {
        attempt_id: AttemptId,
        reason: String,
        /// The approver's key id ("" for a lapse).
        decided_by: String,
        replayed: bool,
    },
    /// `dispatch` said the call was never sent; Commit NotSent gave the
    /// slot and the cost back, and the key is free.
    #[error("the call was not sent; attempt {attempt_id} released")]
    NotSent { attempt_id: AttemptId },
    /// The DISPATCH left less time before the lease's end than the margin,
    /// so `dispatch` was not called; Commit NotSent gave the slot back.
    #[error("no time left in attempt {attempt_id}'s lease to dispatch; released unsent")]
    NoTimeToDispatch { attempt_id: AttemptId },
    /// The key's attempt is RESERVED by an earlier run of this call: atmost
    /// redelivered its DISPATCH to the holder token the caller gave
    /// ([`GuardedCall::holder_token`]), and this call cannot know whether
    /// that run sent. `dispatch` was not called and nothing was recorded.
    /// Settle it: [`Client::settle_not_sent`] only if you know the call
    /// never left (your own durable journal says so), else
    /// [`Client::settle_uncertain`]; left alone, it turns UNCERTAIN at its
    /// lease and an operator resolves it. `lease_remaining`: what atmost
    /// said was left of the lease (`None` from a server that does not say).
    #[error(
        "an earlier run of this call holds attempt {attempt_id}, and atmost cannot know whether it sent: settle it NotSent only if you know it did not, else mark it uncertain"
    )]
    HeldByEarlierRun {
        attempt_id: AttemptId,
        /// The attempt, RESERVED, as the settle methods take it.
        attempt: Box<pb::Attempt>,
        lease_remaining: Option<Duration>,
    },
    /// The outcome could not be recorded (Commit or MarkUncertain failed
    /// through every try, was refused, or was answered without the attempt
    /// it recorded: Commit Succeeded without a SUCCEEDED attempt and its
    /// receipt, from a broken server). The attempt reads UNCERTAIN once
    /// its lease passes; an operator resolves it with what `outcome` says.
    #[error("the outcome of attempt {attempt_id} could not be recorded: {source}")]
    CommitNotRecorded {
        attempt_id: AttemptId,
        outcome: Unrecorded,
        #[source]
        source: Error,
    },
    /// The call was not made: a setting is out of range.
    #[error("invalid guarded call: {0}")]
    InvalidCall(String),
    /// No holder token could be made: the system's random source failed.
    #[error("cannot make a holder token: {0}")]
    NoRandomness(String),
}

impl GuardError {
    /// atmost's answer (or the transport's), when this error carries one.
    pub fn error(&self) -> Option<&Error> {
        match self {
            Self::Denied(e)
            | Self::InProgress(e)
            | Self::Unavailable(e)
            | Self::InvalidRequest(e)
            | Self::Rpc(e)
            | Self::CommitNotRecorded { source: e, .. } => Some(e),
            _ => None,
        }
    }

    /// atmost's reason, when this error carries its answer.
    pub fn reason(&self) -> Option<Reason> {
        self.error().and_then(Error::reason)
    }

    /// The attempt this error is about, when one was dispatched or replayed.
    pub fn attempt_id(&self) -> Option<&AttemptId> {
        match self {
            Self::ToolFailed { attempt_id, .. }
            | Self::OutcomeUncertain { attempt_id, .. }
            | Self::NotSent { attempt_id }
            | Self::NoTimeToDispatch { attempt_id }
            | Self::HeldByEarlierRun { attempt_id, .. }
            | Self::AwaitingApproval { attempt_id, .. }
            | Self::ApprovalDenied { attempt_id, .. }
            | Self::CommitNotRecorded { attempt_id, .. } => Some(attempt_id),
            _ => None,
        }
    }
}

// === the guarded call ===

impl Client {
    /// Makes one side-effecting call under atmost: Authorize, then on
    /// DISPATCH `dispatch(attempt_id)` once under a deadline and the
    /// outcome reported, on REPLAY the key's earlier outcome without
    /// calling `dispatch`. See the module docs for each step.
    ///
    /// ```no_run
    /// # async fn demo(client: atmost_client::Client, permit_id: String) -> Result<(), Box<dyn std::error::Error>> {
    /// use atmost_client::{DispatchError, GuardedCall, GuardError, Reason};
    /// let request = serde_json::json!({"amount": 500, "to": "acct_42"});
    /// let call = GuardedCall::new(&permit_id, "wallet.charge", "charge-1")
    ///     .request(&request)
    ///     .cost(500);
    /// match client
    ///     .guarded(call, |attempt_id| async move {
    ///         // Send the charge with attempt_id as the wallet's idempotency key.
    ///         Ok::<_, DispatchError>(b"wallet tx 981".to_vec())
    ///     })
    ///     .await
    /// {
    ///     Ok(outcome) => println!("charged (replayed: {})", outcome.replayed),
    ///     Err(GuardError::Denied(e)) if e.reason() == Some(Reason::PermitMaxCallsExceeded) => {
    ///         println!("cap {:?} reached on {:?}", e.limit(), e.tool());
    ///     }
    ///     Err(e) => return Err(e.into()),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn guarded<F, Fut, R>(
        &self,
        call: GuardedCall,
        dispatch: F,
    ) -> Result<Outcome, GuardError>
    where
        F: FnOnce(AttemptId) -> Fut,
        Fut: Future<Output = Result<R, DispatchError>>,
        R: Into<Dispatched>,
    {
        call.check()?;
        let (holder_token, token_is_ours) = match &call.holder_token {
            Some(token) => (token.clone(), false),
            None => {
                let mut token = vec![0u8; 16];
                getrandom::fill(&mut token).map_err(|e| GuardError::NoRandomness(e.to_string()))?;
                (token, true)
            }
        };
        let request = pb::AuthorizeRequest {
            permit_id: call.permit_id.clone(),
            tool: call.tool.clone(),
            idempotency_key: call.key.clone(),
            request_fingerprint: call
                .fingerprint
                .clone()
                .and_then(Result::ok)
                .unwrap_or_default(),
            cost: call.cost,
            holder_token,
            approval_summary: call.approval_summary.clone(),
            ..Default::default()
        };
        // Before the first try: any reservation a try of this call made is
        // younger.
        let first_try = Instant::now();
        let (answer, answered_try) = retrying(
            &call.retry,
            call.on_retry.as_ref(),
            "Authorize",
            authorize_may_retry,
            |within| self.authorize_within(request.clone(), within),
        )
        .await
        .map_err(authorize_refused)?;
        let waited = answer.decision() == pb::Decision::AwaitApproval;
        let (answer, answered_try) = match answer.decision() {
            pb::Decision::AwaitApproval => {
                self.await_decision(&call, request.clone(), answer, answered_try)
                    .await?
            }
            _ => (answer, answered_try),
        };
        // A DISPATCH that ended a held ask came at some point of it: its
        // lease would be counted from the ask's start, perhaps most of a
        // minute ago. Asked again at once (the same token: a redelivery of
        // this call's own claim, nothing more reserved), it is counted
        // from now.
        let claimed_here =
            waited && answer.decision() == pb::Decision::Dispatch && !answer.redelivered;
        let (answer, answered_try) = if claimed_here {
            // Failing that, the first answer stands, counted as it was.
            retrying(
                &call.retry,
                call.on_retry.as_ref(),
                "Authorize",
                authorize_may_retry,
                |within| self.authorize_within(request.clone(), within),
            )
            .await
            .ok()
            .filter(|(again, _)| {
                again.decision() == pb::Decision::Dispatch
                    && again.attempt.as_ref().map(|a| &a.attempt_id)
                        == answer.attempt.as_ref().map(|a| &a.attempt_id)
            })
            .unwrap_or((answer, answered_try))
        } else {
            (answer, answered_try)
        };
        let arrived = Instant::now();
        let attempt = answer
            .attempt
            .clone()
            .ok_or_else(|| broken("Authorize answered without an attempt"))?;
        match answer.decision() {
            // A denial this call waited for is news, not a replay.
            pb::Decision::Replay => replay(attempt, waited),
            pb::Decision::AwaitApproval => Err(awaiting(&attempt)),
            pb::Decision::Dispatch => {
                let lease_remaining = answer.lease_remaining.map(duration_of);
                // A redelivery to this call's own random token repeats a
                // reservation one of its earlier tries made, whose answer
                // was lost: nothing was sent. To a token the caller gave,
                // it may repeat an earlier run's, which may have sent.
                if answer.redelivered && !token_is_ours && !claimed_here {
                    return Err(GuardError::HeldByEarlierRun {
                        attempt_id: AttemptId(attempt.attempt_id.clone()),
                        attempt: Box::new(attempt),
                        lease_remaining,
                    });
                }
                let window = lease_window(lease_remaining, &attempt, first_try, answered_try)?;
                let deadline =
                    dispatch_deadline(window.lease, window.from, arrived, call.dispatch_timeout);
                self.dispatch_once(&call, attempt, &window, arrived, deadline, dispatch)
                    .await
            }
            other => Err(broken(&format!("Authorize answered decision {other:?}"))),
        }
    }

    /// While the call awaits approval, asks again with the same request
    /// and a `wait` (at most a minute each, the server holding the call
    /// open until the decision), within [`GuardedCall::approval_wait`]: the
    /// first answer that is not AWAIT_APPROVAL, or the last one.
    async fn await_decision(
        &self,
        call: &GuardedCall,
        request: pb::AuthorizeRequest,
        mut answer: pb::AuthorizeResponse,
        mut answered_try: Instant,
    ) -> Result<(pb::AuthorizeResponse, Instant), GuardError> {
        const MAX_WAIT: Duration = Duration::from_secs(55);
        // A server that answers a held ask at once (it is stopping, or
        // predates `wait`) is asked again after a pause, not in a loop.
        const PAUSE: Duration = Duration::from_millis(500);
        const MAX_PAUSE: Duration = Duration::from_secs(5);
        let until = Instant::now() + call.approval_wait;
        let mut pause = PAUSE;
        let mut asked_at: Option<(Instant, Duration)> = None;
        while answer.decision() == pb::Decision::AwaitApproval {
            if let Some((at, wait)) = asked_at
                && at.elapsed() < wait / 2
            {
                let left = until.saturating_duration_since(Instant::now());
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let wait = left.min(MAX_WAIT);
            asked_at = Some((Instant::now(), wait));
            let mut asked = request.clone();
            asked.wait = Some(crate::duration(wait));
            // Each try may take the wait and then the usual retry time.
            let limits = RetryLimits {
                max_tries: call.retry.max_tries,
                max_time: call.retry.max_time + wait,
            };
            (answer, answered_try) = retrying(
                &limits,
                call.on_retry.as_ref(),
                "Authorize",
                authorize_may_retry,
                |within| self.authorize_within(asked.clone(), within),
            )
            .await
            .map_err(authorize_refused)?;
        }
        Ok((answer, answered_try))
    }

    async fn dispatch_once<F, Fut, R>(
        &self,
        call: &GuardedCall,
        attempt: pb::Attempt,
        window: &LeaseWindow,
        arrived: Instant,
        deadline: Instant,
        dispatch: F,
    ) -> Result<Outcome, GuardError>
    where
        F: FnOnce(AttemptId) -> Fut,
        Fut: Future<Output = Result<R, DispatchError>>,
        R: Into<Dispatched>,
    {
        let attempt_id = AttemptId(attempt.attempt_id.clone());
        let time = deadline.saturating_duration_since(Instant::now());
        if time.is_zero() {
            self.report(call, &attempt, Report::NotSent).await?;
            return Err(GuardError::NoTimeToDispatch { attempt_id });
        }
        // `dispatch` is called inside the future, so a panic in the call,
        // in any poll of its future or in the conversion is caught alike.
        let id = attempt_id.clone();
        let mut run = Box::pin(async move { dispatch(id).await.map(Into::<Dispatched>::into) });
        let caught = std::future::poll_fn(|cx| {
            match std::panic::catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx))) {
                Ok(poll) => poll.map(Ok),
                Err(panic) => Poll::Ready(Err(panic)),
            }
        });
        let ended = tokio::time::timeout(time, caught).await;
        // A dispatch cut off at its deadline (or that panicked) is dropped
        // now, before the report and its retries: whatever it holds (a
        // connection whose drop cancels the request, a lock) goes with it.
        drop(run);
        let ran = match ended {
            Ok(Ok(ran)) => ran,
            Ok(Err(panic)) => {
                // It may have sent: MarkUncertain, as for any unknown
                // outcome, then the panic goes on (if the record fails,
                // the attempt turns UNCERTAIN at its lease all the same).
                let reason = format!("dispatch panicked: {}", panic_message(&*panic));
                let reason = truncate(&reason, MAX_REASON_BYTES).to_owned();
                let _ = self.report(call, &attempt, Report::Uncertain(reason)).await;
                std::panic::resume_unwind(panic);
            }
            Err(elapsed) => {
                let reason = match call.dispatch_timeout {
                    Some(timeout) if later(arrived, timeout) == deadline => format!(
                        "dispatch still running at its deadline, {timeout:?} after the DISPATCH: dropped"
                    ),
                    _ => format!(
                        "dispatch still running at its deadline, {LEASE_MARGIN:?} before the lease's end ({window}): dropped"
                    ),
                };
                return self
                    .uncertain(call, &attempt, reason, Box::new(elapsed))
                    .await;
            }
        };
        match ran {
            Ok(dispatched) => {
                let settled = self
                    .report(
                        call,
                        &attempt,
                        Report::Succeeded {
                            stored: stored_result(&dispatched.result),
                            actual_cost: dispatched.actual_cost,
                        },
                    )
                    .await
                    .map_err(|e| e.with_result(dispatched.result.clone()))?;
                committed(attempt_id, settled, dispatched.result)
            }
            Err(DispatchError::Failed(reason)) => {
                let stored = truncate(&reason, MAX_REASON_BYTES).to_owned();
                self.report(call, &attempt, Report::Failed(stored)).await?;
                Err(GuardError::ToolFailed {
                    attempt_id,
                    reason,
                    replayed: false,
                })
            }
            Err(DispatchError::NotSent) => {
                self.report(call, &attempt, Report::NotSent).await?;
                Err(GuardError::NotSent { attempt_id })
            }
            Err(DispatchError::Unknown(error)) => {
                let reason = format!("dispatch failed: {error}");
                self.uncertain(call, &attempt, reason, error).await
            }
        }
    }

    /// MarkUncertain, then the error that says so.
    async fn uncertain(
        &self,
        call: &GuardedCall,
        attempt: &pb::Attempt,
        reason: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> Result<Outcome, GuardError> {
        let reason = truncate(&reason, MAX_REASON_BYTES).to_owned();
        self.report(call, attempt, Report::Uncertain(reason.clone()))
            .await?;
        Err(GuardError::OutcomeUncertain {
            attempt_id: AttemptId(attempt.attempt_id.clone()),
            reason,
            replayed: false,
            source: Some(source),
        })
    }

    /// Records `report` (Commit or MarkUncertain, retried as the same
    /// request); the attempt as it then stands.
    async fn report(
        &self,
        call: &GuardedCall,
        attempt: &pb::Attempt,
        report: Report,
    ) -> Result<pb::Attempt, GuardError> {
        use pb::commit_request::Outcome as Commit;
        let (permit_id, key, attempt_id) = (
            attempt.permit_id.clone(),
            attempt.idempotency_key.clone(),
            attempt.attempt_id.clone(),
        );
        let commit = |outcome: Commit| pb::CommitRequest {
            permit_id: permit_id.clone(),
            idempotency_key: key.clone(),
            attempt_id: attempt_id.clone(),
            outcome: Some(outcome),
        };
        let (limits, observer) = (&call.retry, call.on_retry.as_ref());
        let answer = match &report {
            Report::Succeeded {
                stored,
                actual_cost,
            } => {
                let request = commit(Commit::Succeeded(pb::Succeeded {
                    result: stored.clone(),
                    actual_cost: *actual_cost,
                }));
                self.commit_retried(limits, observer, request).await
            }
            Report::Failed(reason) => {
                let request = commit(Commit::Failed(pb::Failed {
                    reason: reason.clone(),
                }));
                self.commit_retried(limits, observer, request).await
            }
            Report::NotSent => {
                let request = commit(Commit::NotSent(pb::NotSent {}));
                self.commit_retried(limits, observer, request).await
            }
            Report::Uncertain(reason) => {
                let request = pb::MarkUncertainRequest {
                    permit_id: permit_id.clone(),
                    idempotency_key: key.clone(),
                    attempt_id: attempt_id.clone(),
                    reason: reason.clone(),
                };
                self.mark_uncertain_retried(limits, observer, request).await
            }
        };
        let source = match answer {
            Ok(Some(attempt)) => return Ok(attempt),
            Ok(None) => broken_answer(match report {
                Report::Uncertain(_) => "MarkUncertain answered without the attempt",
                _ => "Commit answered without the attempt",
            }),
            Err(source) => source,
        };
        Err(GuardError::CommitNotRecorded {
            attempt_id: AttemptId(attempt_id),
            outcome: report.unrecorded(),
            source,
        })
    }

    /// Commit, retried as the same request; the attempt it answers.
    async fn commit_retried(
        &self,
        limits: &RetryLimits,
        observer: Option<&RetryObserver>,
        request: pb::CommitRequest,
    ) -> Result<Option<pb::Attempt>, Error> {
        retrying(limits, observer, "Commit", settle_may_retry, |within| {
            self.commit_within(request.clone(), within)
        })
        .await
        .map(|(r, _)| r.attempt)
    }

    /// MarkUncertain, retried as the same request; the attempt it answers.
    async fn mark_uncertain_retried(
        &self,
        limits: &RetryLimits,
        observer: Option<&RetryObserver>,
        request: pb::MarkUncertainRequest,
    ) -> Result<Option<pb::Attempt>, Error> {
        retrying(
            limits,
            observer,
            "MarkUncertain",
            settle_may_retry,
            |within| self.mark_uncertain_within(request.clone(), within),
        )
        .await
        .map(|(r, _)| r.attempt)
    }
}

/// Runs `once` until it succeeds, fails in a way `may_retry` does not
/// allow, or the retry limits are reached; each try's deadline is the
/// time left. Waits the error's RetryInfo delay, else a backoff; a wait
/// that would end past the time limit is not begun. The answer, and
/// when the try it answers was begun (before its request was sent). A
/// panic of the `observer` is caught and ignored: the retry goes on.
async fn retrying<T, Fut>(
    limits: &RetryLimits,
    observer: Option<&RetryObserver>,
    rpc: &'static str,
    may_retry: fn(&Error) -> bool,
    mut once: impl FnMut(Option<Duration>) -> Fut,
) -> Result<(T, Instant), Error>
where
    Fut: Future<Output = Result<T, Error>>,
{
    let limits = *limits;
    let start = Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let begun = Instant::now();
        let left = limits
            .max_time
            .saturating_sub(begun.saturating_duration_since(start));
        let error = match once(Some(left)).await {
            Ok(answer) => return Ok((answer, begun)),
            Err(error) => error,
        };
        if !may_retry(&error) || tries >= limits.max_tries {
            return Err(error);
        }
        let delay = error.retry_after().unwrap_or_else(|| backoff(tries));
        if start.elapsed() + delay >= limits.max_time {
            return Err(error);
        }
        if let Some(observe) = observer {
            // The panic hook has printed it; a log line must
            // not turn a safe retry into a failed call.
            let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
                observe(&Retrying {
                    rpc,
                    tries,
                    error: &error,
                    delay,
                })
            }));
        }
        tokio::time::sleep(delay).await;
    }
}

// === settling an attempt an earlier run holds ===

impl Client {
    /// Commit NotSent for an attempt this caller holds and knows was never
    /// sent: the slot, the cost and the key come back. For the attempt of
    /// [`GuardError::HeldByEarlierRun`] when your own durable record says
    /// the earlier run never sent it; anything less than that knowledge is
    /// [`settle_uncertain`](Self::settle_uncertain). Retried like the
    /// guarded call's Commit (the default [`RetryLimits`]); the attempt as
    /// recorded, RELEASED.
    pub async fn settle_not_sent(&self, attempt: &pb::Attempt) -> Result<pb::Attempt, Error> {
        let request = pb::CommitRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            outcome: Some(pb::commit_request::Outcome::NotSent(pb::NotSent {})),
        };
        self.commit_retried(&RetryLimits::default(), None, request)
            .await?
            .ok_or_else(|| Error::from(Status::internal("Commit answered without the attempt")))
    }

    /// MarkUncertain for an attempt this caller holds whose call may have
    /// gone out (the attempt of [`GuardError::HeldByEarlierRun`], say): the
    /// slot and the cost stay held, nothing is sent again, and an operator
    /// resolves it. `reason` is cut to the 1024 bytes atmost keeps.
    /// Retried like the guarded call's MarkUncertain; the attempt as
    /// recorded, UNCERTAIN.
    pub async fn settle_uncertain(
        &self,
        attempt: &pb::Attempt,
        reason: impl Into<String>,
    ) -> Result<pb::Attempt, Error> {
        let reason = reason.into();
        let request = pb::MarkUncertainRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            reason: truncate(&reason, MAX_REASON_BYTES).to_owned(),
        };
        self.mark_uncertain_retried(&RetryLimits::default(), None, request)
            .await?
            .ok_or_else(|| {
                Error::from(Status::internal(
                    "MarkUncertain answered without the attempt",
                ))
            })
    }
}

/// What the guarded call reports after dispatch.
enum Report {
    Succeeded {
        stored: Vec<u8>,
        actual_cost: Option<i64>,
    },
    Failed(String),
    NotSent,
    Uncertain(String),
}

impl Report {
    fn unrecorded(self) -> Unrecorded {
        match self {
            // The full result replaces this in `with_result`.
            Self::Succeeded { stored, .. } => Unrecorded::Succeeded { result: stored },
            Self::Failed(reason) => Unrecorded::Failed { reason },
            Self::NotSent => Unrecorded::NotSent,
            Self::Uncertain(reason) => Unrecorded::Uncertain { reason },
        }
    }
}

impl GuardError {
    /// A success that could not be recorded carries the tool's whole
    /// result, not the digest that would have been stored.
    fn with_result(mut self, result: Vec<u8>) -> Self {
        if let Self::CommitNotRecorded {
            outcome: Unrecorded::Succeeded { result: r },
            ..
        } = &mut self
        {
            *r = result;
        }
        self
    }
}

// === decisions ===

/// The key's earlier outcome, as the guarded call answers it.
/// A call still awaiting approval, as the error that says so.
fn awaiting(attempt: &pb::Attempt) -> GuardError {
    GuardError::AwaitingApproval {
        attempt_id: AttemptId(attempt.attempt_id.clone()),
        expires_at_ms: attempt
            .approval
            .as_ref()
            .and_then(|a| a.expires_at.as_ref())
            .map_or(0, crate::millis),
    }
}

fn replay(attempt: pb::Attempt, waited: bool) -> Result<Outcome, GuardError> {
    let attempt_id = AttemptId(attempt.attempt_id.clone());
    match attempt.state() {
        pb::AttemptState::Denied => {
            let approval = attempt.approval.unwrap_or_default();
            Err(GuardError::ApprovalDenied {
                attempt_id,
                reason: approval.denial_reason,
                decided_by: approval.decided_by,
                replayed: !waited,
            })
        }
        pb::AttemptState::Succeeded => {
            let receipt = attempt
                .receipt
                .clone()
                .ok_or_else(|| broken("a SUCCEEDED replay without a receipt"))?;
            Ok(Outcome {
                result: receipt.result.clone(),
                replayed: true,
                attempt,
                receipt,
            })
        }
        pb::AttemptState::Failed => Err(GuardError::ToolFailed {
            attempt_id,
            reason: attempt.failure_reason,
            replayed: true,
        }),
        pb::AttemptState::Uncertain => Err(GuardError::OutcomeUncertain {
            attempt_id,
            reason: attempt.uncertain_reason,
            replayed: true,
            source: None,
        }),
        other => Err(broken(&format!("a REPLAY of an attempt {other:?}"))),
    }
}

/// What is left of a DISPATCH's lease, and from when to count it on this
/// process's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LeaseWindow {
    from: Instant,
    lease: Duration,
    /// From a server without `lease_remaining`: the attempt's whole lease.
    whole: bool,
}

/// How the reason of a dispatch dropped at the lease's deadline names it.
impl std::fmt::Display for LeaseWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.whole {
            false => write!(
                f,
                "{:?} left when the answered Authorize try was sent",
                self.lease
            ),
            true => write!(f, "a {:?} lease from the first Authorize try", self.lease),
        }
    }
}

/// atmost's `lease_remaining`, counted from when the Authorize try it
/// answers was begun (`answered_try`): decided on the store's clock after
/// that try was sent and just before the answer left, so the whole trip
/// there and back, however long the answer took, is counted against the
/// lease, and [`LEASE_MARGIN`] covers the clocks' rates. From a server that
/// does not send it, the attempt's whole lease (`lease_expires_at -
/// created_at`, on the server's clock) counted from the `first_try`: every
/// reservation a try of this call can hold was made after it was sent, so
/// the lease cannot be overrun however long a lost answer and the retries
/// took.
fn lease_window(
    lease_remaining: Option<Duration>,
    attempt: &pb::Attempt,
    first_try: Instant,
    answered_try: Instant,
) -> Result<LeaseWindow, GuardError> {
    Ok(match lease_remaining {
        Some(left) => LeaseWindow {
            from: answered_try,
            lease: left,
            whole: false,
        },
        None => LeaseWindow {
            from: first_try,
            lease: lease_of(attempt)?,
            whole: true,
        },
    })
}

/// A protobuf duration; a negative one (no time) as zero.
fn duration_of(d: prost_types::Duration) -> Duration {
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

/// When `dispatch` must be done: `lease` less [`LEASE_MARGIN`], counted
/// from `from` ([`lease_window`]). A caller's `timeout`, counted from when
/// the DISPATCH `arrived`, can only shorten it: past the lease the attempt
/// reads UNCERTAIN, an operator may resolve it NotSent and the key be used
/// again, and a call still being sent then would exceed the cap.
fn dispatch_deadline(
    lease: Duration,
    from: Instant,
    arrived: Instant,
    timeout: Option<Duration>,
) -> Instant {
    let by_lease = later(from, lease.saturating_sub(LEASE_MARGIN));
    match timeout {
        Some(timeout) => by_lease.min(later(arrived, timeout)),
        None => by_lease,
    }
}

/// `d` after `at`; a `d` past what the clock holds (`Duration::MAX` as a
/// timeout, an absurd lease from a broken server) as decades.
fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .unwrap_or_else(|| at + Duration::from_secs(1 << 30))
}

/// The attempt's lease by the server's clock: lease_expires_at - created_at.
fn lease_of(attempt: &pb::Attempt) -> Result<Duration, GuardError> {
    match (&attempt.created_at, &attempt.lease_expires_at) {
        (Some(created), Some(expires)) => {
            let ms = crate::millis(expires) - crate::millis(created);
            Ok(Duration::from_millis(ms.max(0) as u64))
        }
        _ => Err(broken("a DISPATCH without created_at and lease_expires_at")),
    }
}

/// An answer no atmost gives: reported as INTERNAL, not worked around.
fn broken(what: &str) -> GuardError {
    GuardError::Rpc(broken_answer(what))
}

fn broken_answer(what: &str) -> Error {
    Error::from(Status::internal(format!(
        "atmost answered what the guarded call cannot use: {what}"
    )))
}

/// The success atmost recorded: the attempt `settled` SUCCEEDED, with its
/// receipt. Any other answer to Commit Succeeded (a broken server) shows
/// nothing recorded, and the caller keeps the tool's whole result:
/// [`GuardError::CommitNotRecorded`].
fn committed(
    attempt_id: AttemptId,
    settled: pb::Attempt,
    result: Vec<u8>,
) -> Result<Outcome, GuardError> {
    match settled.receipt.clone() {
        Some(receipt) if settled.state() == pb::AttemptState::Succeeded => Ok(Outcome {
            result,
            replayed: false,
            attempt: settled,
            receipt,
        }),
        _ => Err(GuardError::CommitNotRecorded {
            attempt_id,
            outcome: Unrecorded::Succeeded { result },
            source: broken_answer(&format!(
                "Commit Succeeded answered with an attempt {:?} {} a receipt",
                settled.state(),
                if settled.receipt.is_some() {
                    "with"
                } else {
                    "without"
                }
            )),
        }),
    }
}

/// What a panic said, when it said it in text.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a panic without a message)")
}

/// A failure whose request may be sent again as it is: nothing was
/// decided, or what was decided is given back to the same request (the
/// same key replays; the same Commit answers the same). CANCELLED without
/// ErrorInfo is how tonic reports its own deadline ("Timeout expired");
/// UNKNOWN without ErrorInfo, caused by an I/O error, how it reports a
/// connection that broke while the call was on it ("transport error", "h2
/// protocol error": reset, closed, a broken pipe), answer lost or not.
fn transient(error: &Error) -> bool {
    match error.code() {
        Code::Unavailable | Code::DeadlineExceeded => true,
        Code::Cancelled => error.reason().is_none(),
        Code::Unknown => error.reason().is_none() && connection_broke(error),
        _ => false,
    }
}

/// Whether an I/O error is among the causes of `error` (an h2 error keeps
/// its I/O error to itself: [`h2::Error::is_io`]).
fn connection_broke(error: &Error) -> bool {
    use std::error::Error as _;
    let mut cause = error.status().source();
    while let Some(e) = cause {
        if e.is::<std::io::Error>() || e.downcast_ref::<h2::Error>().is_some_and(h2::Error::is_io) {
            return true;
        }
        cause = e.source();
    }
    false
}

fn authorize_may_retry(error: &Error) -> bool {
    transient(error) || error.reason() == Some(Reason::IdempotencyInProgress)
}

fn settle_may_retry(error: &Error) -> bool {
    transient(error)
}

/// The typed error of an Authorize that did not answer. INVALID_ARGUMENT
/// without a reason this client knows is an invalid request whoever said it;
/// UNAUTHENTICATED or PERMISSION_DENIED without atmost's ErrorInfo (a
/// proxy, a TLS front end) refuses the call as atmost's own would.
fn authorize_refused(error: Error) -> GuardError {
    let (code, reason) = (error.code(), error.reason());
    if reason == Some(Reason::IdempotencyInProgress) {
        GuardError::InProgress(error)
    } else if transient(&error) {
        GuardError::Unavailable(error)
    } else if reason == Some(Reason::InvalidRequest)
        || (code == Code::InvalidArgument && matches!(reason, None | Some(Reason::Unspecified)))
    {
        GuardError::InvalidRequest(error)
    } else if reason.is_some() || matches!(code, Code::Unauthenticated | Code::PermissionDenied) {
        GuardError::Denied(error)
    } else {
        GuardError::Rpc(error)
    }
}

/// The wait before try `tries + 1`: 50 ms doubling per try, at most 2 s,
/// drawn from its upper half so retrying callers spread out.
fn backoff(tries: u32) -> Duration {
    let ceiling = FIRST_BACKOFF
        .saturating_mul(1u32 << (tries.saturating_sub(1)).min(16))
        .min(MAX_BACKOFF);
    let half = ceiling / 2;
    let jitter = getrandom::u64().unwrap_or(0) % (half.as_micros() as u64 + 1);
    half + Duration::from_micros(jitter)
}

/// What atmost stores for `result`: itself, or past 64 KiB the text
/// `sha256:<hex>` of its digest.
fn stored_result(result: &[u8]) -> Vec<u8> {
    if result.len() <= MAX_STORED_RESULT {
        return result.to_vec();
    }
    let hex: String = Sha256::digest(result)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}").into_bytes()
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests;
