//! Attempts (one idempotency key under one permit), the commands that move
//! them, and what those commands answer.

use super::{
    Error, LEASE_EXPIRED, MARKED_UNCERTAIN, MAX_AMOUNT, MAX_FINGERPRINT_LEN, MAX_HOLDER_TOKEN_LEN,
    MAX_RESULT_BYTES, MAX_TEXT_LEN, Millis, Usage, Violations, canonical_id, valid_key, valid_tool,
};

/// The states of the attempt state machine.
///
/// ```text
/// RESERVED ──Commit Succeeded──▶ SUCCEEDED   (receipt stored, cost committed, slot kept)
///    │  ╲───Commit Failed─────▶ FAILED      (cost released, slot kept)
///    │   ╲──Commit NotSent────▶ RELEASED    (slot and cost returned, key free again)
///    └──MarkUncertain / lease passes──▶ UNCERTAIN ──Commit or Resolve──▶ SUCCEEDED | FAILED
///
/// A call that needs approval (the permit's approval rule) starts earlier:
///
/// AWAITING_APPROVAL ──Approve (1 or 2)──▶ APPROVED ──requester's Authorize──▶ RESERVED
///    └──Deny / deadline passes──▶ DENIED ◀──Deny / deadline passes──┘
/// ```
///
/// AWAITING_APPROVAL and APPROVED hold the slot and the cost like RESERVED;
/// DENIED returns both, like RELEASED, but keeps the key (it replays).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttemptState {
    Reserved,
    Succeeded,
    Failed,
    Uncertain,
    Released,
    AwaitingApproval,
    Denied,
    Approved,
}

impl AttemptState {
    /// RESERVED and UNCERTAIN attempts hold a slot and reserved money, and
    /// must never disappear on their own.
    pub fn is_open(self) -> bool {
        matches!(self, Self::Reserved | Self::Uncertain)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "RESERVED",
            Self::Succeeded => "SUCCEEDED",
            Self::Failed => "FAILED",
            Self::Uncertain => "UNCERTAIN",
            Self::Released => "RELEASED",
            Self::AwaitingApproval => "AWAITING_APPROVAL",
            Self::Denied => "DENIED",
            Self::Approved => "APPROVED",
        }
    }

    /// AWAITING_APPROVAL and APPROVED: slot and cost held, nothing may be
    /// sent yet, and the state lapses into DENIED at a deadline.
    pub fn is_pending(self) -> bool {
        matches!(self, Self::AwaitingApproval | Self::Approved)
    }
}

/// A call's request for approval and its outcome, as the attempt carries it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Approval {
    /// The caller's description of the call (its claim, not checked).
    pub summary: String,
    /// When a pending request lapses: its deadline while AWAITING_APPROVAL,
    /// its claim deadline while APPROVED.
    pub expires_at: Millis,
    /// 1 or 2.
    pub approvers_needed: u32,
    /// Key ids, in order.
    pub approved_by: Vec<String>,
    /// Who denied it or completed its approval ("" before, and in dev mode).
    pub decided_by: String,
    /// When it was decided (0: not yet). For a lapse, the deadline.
    pub decided_at: Millis,
    /// Set once DENIED.
    pub denial_reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Receipt {
    pub receipt_id: String,
    pub result: Vec<u8>,
    /// The cost actually committed.
    pub cost: i64,
    pub issued_at: Millis,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// UUIDv7; a fencing token for Commit and MarkUncertain.
    pub attempt_id: String,
    pub permit_id: String,
    pub tool: String,
    pub idempotency_key: String,
    pub request_fingerprint: Vec<u8>,
    pub cost: i64,
    /// The stored state. Readers see [`Attempt::into_observed`], which turns a
    /// RESERVED attempt past its lease into UNCERTAIN.
    pub state: AttemptState,
    pub created_at: Millis,
    pub lease_expires_at: Millis,
    pub receipt: Option<Receipt>,
    pub failure_reason: String,
    pub uncertain_reason: String,
    /// While UNCERTAIN: when it became so (the lease's end, or when it was
    /// marked, whichever came first); 0 otherwise. Listings order a
    /// permit's uncertain attempts by it.
    pub uncertain_since: Millis,
    /// The earlier live key with the same (tool, fingerprint) when this
    /// attempt was dispatched (duplicate guard LOG); the guard's index falls
    /// back to it if this attempt is released.
    pub duplicate_of: Option<String>,
    /// The key id of the caller whose Authorize reserved it ("" in dev
    /// mode): only that key (or an admin) may Commit or MarkUncertain it,
    /// and is told its attempt_id while it is open ([`super::Scope::holds`]).
    pub reserved_by: String,
    /// Set for a call that needed approval.
    pub approval: Option<Approval>,
}

impl Attempt {
    /// The state every reader sees at `now`: a RESERVED attempt whose lease
    /// has passed *is* UNCERTAIN, with no background job needed.
    pub fn observed_state(&self, now: Millis) -> AttemptState {
        let deadline = match &self.approval {
            Some(a) if self.state.is_pending() => a.expires_at,
            _ => self.lease_expires_at,
        };
        observe(self.state, deadline, now)
    }

    /// The attempt as readers see it at `now` (see [`Attempt::observed_state`]).
    pub fn into_observed(mut self, now: Millis) -> Attempt {
        let observed = self.observed_state(now);
        if self.state == observed {
            return self;
        }
        if observed == AttemptState::Uncertain {
            self.uncertain_reason = LEASE_EXPIRED.to_owned();
            self.uncertain_since = self.lease_expires_at;
        } else if let Some(approval) = &mut self.approval {
            approval.denial_reason = lapse_reason(self.state).to_owned();
            approval.decided_at = approval.expires_at;
            approval.decided_by.clear();
        }
        self.state = observed;
        self
    }
}

/// Why a pending attempt in `state` reads DENIED once its deadline passed.
pub(super) fn lapse_reason(state: AttemptState) -> &'static str {
    match state {
        AttemptState::Approved => APPROVAL_UNCLAIMED,
        _ => APPROVAL_EXPIRED,
    }
}

/// The state of an attempt stored as `state` whose deadline (its lease's
/// end, or a pending approval's) is `deadline`, as readers see it at
/// `now`: a RESERVED one past it is UNCERTAIN, a pending one DENIED.
pub(super) fn observe(state: AttemptState, deadline: Millis, now: Millis) -> AttemptState {
    match state {
        AttemptState::Reserved if now >= deadline => AttemptState::Uncertain,
        AttemptState::AwaitingApproval | AttemptState::Approved if now >= deadline => {
            AttemptState::Denied
        }
        state => state,
    }
}

/// The denial reason of a request nobody decided before its deadline.
pub const APPROVAL_EXPIRED: &str = "approval_expired";
/// The denial reason of an approved call its requester did not claim in time.
pub const APPROVAL_UNCLAIMED: &str = "approval_unclaimed";
/// The denial reason of a pending request when its permit is revoked.
pub const PERMIT_REVOKED: &str = "permit_revoked";
/// The denial reason Deny records when it is given none.
pub const DENIED: &str = "denied";
/// Longest approval summary, in bytes.
pub const MAX_SUMMARY_LEN: usize = 1024;

/// Ask to reserve a slot and `cost` for one idempotency key before dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthorizeCmd {
    pub permit_id: String,
    pub tool: String,
    pub idempotency_key: String,
    pub request_fingerprint: Vec<u8>,
    pub cost: i64,
    /// The caller's proof that it is the same holder across retries of one
    /// logical call (empty: none). A same-key retry with the same request
    /// and token while the attempt is RESERVED within its lease is answered
    /// DISPATCH again ([`Authorized::redelivered`]), reserving nothing more.
    pub holder_token: Vec<u8>,
    /// For a call that needs approval: the caller's description of it,
    /// stored when the approval is first requested (ignored otherwise).
    pub approval_summary: String,
}

/// What a caller reports after dispatching (or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Succeeded {
        result: Vec<u8>,
        actual_cost: Option<i64>,
    },
    Failed {
        reason: String,
    },
    NotSent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitCmd {
    pub permit_id: String,
    pub idempotency_key: String,
    pub attempt_id: String,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkUncertainCmd {
    pub permit_id: String,
    pub idempotency_key: String,
    pub attempt_id: String,
    pub reason: String,
}

/// Reads one key's attempt (GetAttempt): changes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetAttemptCmd {
    pub permit_id: String,
    pub idempotency_key: String,
}

/// An approver approves one pending call, named by its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApproveCmd {
    pub permit_id: String,
    pub idempotency_key: String,
    pub attempt_id: String,
}

/// An approver denies one pending call, with a reason for the requester.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenyCmd {
    pub permit_id: String,
    pub idempotency_key: String,
    pub attempt_id: String,
    pub reason: String,
}

/// An operator settles an UNCERTAIN attempt after reconciling with the tool.
/// `NotSent` means the operator verified that the call never took effect:
/// the slot and the cost come back, which a holder's NotSent cannot do once
/// the attempt is UNCERTAIN (its call may have left).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveCmd {
    pub permit_id: String,
    pub idempotency_key: String,
    /// The attempt reconciled (empty: whichever the key holds). Required
    /// with `NotSent`: a retried release must never hit a newer attempt.
    pub attempt_id: String,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A fresh reservation: the only answer on which a caller may send.
    Dispatch,
    /// The key's existing outcome; nothing may be sent.
    Replay,
    /// The call waits for a person's approval: nothing may be sent yet.
    AwaitApproval,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorized {
    pub decision: Decision,
    pub attempt: Attempt,
    pub usage: Usage,
    pub duplicate_of: Option<String>,
    /// This DISPATCH repeats one already given to the same holder token for
    /// the same attempt: nothing more was reserved.
    pub redelivered: bool,
    /// For a DISPATCH, how long its lease has left at the store's `now`
    /// (the whole lease for a fresh reservation, less for a redelivery);
    /// 0 for a REPLAY. A caller sends only within it.
    pub lease_remaining_ms: Millis,
    /// For AWAIT_APPROVAL, how long until the request lapses at the
    /// store's `now`; 0 otherwise.
    pub approval_remaining_ms: Millis,
}

/// The answer of Commit and Resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    pub attempt: Attempt,
    pub usage: Usage,
}

// === validation ===
//
// Each command is checked whole before it reaches a store, so a malformed
// request fails with every violation listed and changes nothing. Ids are
// rewritten to their canonical form, because they become parts of keys.

fn check_permit_id(v: &mut Violations, permit_id: &mut String) {
    match canonical_id(permit_id) {
        Some(id) => *permit_id = id,
        None => v.check(false, "permit_id", "must be a UUID"),
    }
}

fn check_key(v: &mut Violations, key: &str) {
    v.check(
        valid_key(key),
        "idempotency_key",
        "must be 1..=255 printable ASCII characters",
    );
}

fn check_attempt_id(v: &mut Violations, attempt_id: &mut String) {
    match canonical_id(attempt_id) {
        Some(id) => *attempt_id = id,
        None => v.check(false, "attempt_id", "must be a UUID"),
    }
}

fn check_outcome(v: &mut Violations, outcome: &Outcome) {
    match outcome {
        Outcome::Succeeded {
            result,
            actual_cost,
        } => {
            v.check(
                result.len() <= MAX_RESULT_BYTES,
                "succeeded.result",
                format!("at most {MAX_RESULT_BYTES} bytes"),
            );
            if let Some(cost) = actual_cost {
                v.check(
                    (0..=MAX_AMOUNT).contains(cost),
                    "succeeded.actual_cost",
                    format!("must be within 0..={MAX_AMOUNT}"),
                );
            }
        }
        Outcome::Failed { reason } => v.check(
            reason.len() <= MAX_TEXT_LEN,
            "failed.reason",
            format!("at most {MAX_TEXT_LEN} bytes"),
        ),
        Outcome::NotSent => {}
    }
}

impl AuthorizeCmd {
    pub fn validate(&mut self) -> Result<(), Error> {
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        v.check(
            valid_tool(&self.tool),
            "tool",
            "must be 1..=128 of [A-Za-z0-9._:/-]",
        );
        check_key(&mut v, &self.idempotency_key);
        v.check(
            (1..=MAX_FINGERPRINT_LEN).contains(&self.request_fingerprint.len()),
            "request_fingerprint",
            "must be 1..=64 bytes",
        );
        v.check(
            (0..=MAX_AMOUNT).contains(&self.cost),
            "cost",
            format!("must be within 0..={MAX_AMOUNT}"),
        );
        v.check(
            self.holder_token.len() <= MAX_HOLDER_TOKEN_LEN,
            "holder_token",
            format!("at most {MAX_HOLDER_TOKEN_LEN} bytes"),
        );
        v.check(
            self.approval_summary.len() <= MAX_SUMMARY_LEN,
            "approval_summary",
            format!("at most {MAX_SUMMARY_LEN} bytes"),
        );
        v.into_result()
    }
}

impl ApproveCmd {
    pub fn validate(&mut self) -> Result<(), Error> {
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        check_attempt_id(&mut v, &mut self.attempt_id);
        v.into_result()
    }
}

impl DenyCmd {
    /// Also fills in the default reason, so every store records the same.
    pub fn validate(&mut self) -> Result<(), Error> {
        if self.reason.is_empty() {
            self.reason = DENIED.to_owned();
        }
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        check_attempt_id(&mut v, &mut self.attempt_id);
        v.check(
            self.reason.len() <= MAX_TEXT_LEN,
            "reason",
            format!("at most {MAX_TEXT_LEN} bytes"),
        );
        v.into_result()
    }
}

impl CommitCmd {
    pub fn validate(&mut self) -> Result<(), Error> {
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        check_attempt_id(&mut v, &mut self.attempt_id);
        check_outcome(&mut v, &self.outcome);
        v.into_result()
    }
}

impl MarkUncertainCmd {
    /// Also fills in the default reason, so every store records the same.
    pub fn validate(&mut self) -> Result<(), Error> {
        if self.reason.is_empty() {
            self.reason = MARKED_UNCERTAIN.to_owned();
        }
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        check_attempt_id(&mut v, &mut self.attempt_id);
        v.check(
            self.reason.len() <= MAX_TEXT_LEN,
            "reason",
            format!("at most {MAX_TEXT_LEN} bytes"),
        );
        v.into_result()
    }
}

impl GetAttemptCmd {
    pub fn validate(&mut self) -> Result<(), Error> {
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        v.into_result()
    }
}

impl ResolveCmd {
    pub fn validate(&mut self) -> Result<(), Error> {
        let mut v = Violations::default();
        check_permit_id(&mut v, &mut self.permit_id);
        check_key(&mut v, &self.idempotency_key);
        if self.attempt_id.is_empty() {
            v.check(
                self.outcome != Outcome::NotSent,
                "attempt_id",
                "is required with not_sent: the attempt whose call was verified never sent",
            );
        } else {
            check_attempt_id(&mut v, &mut self.attempt_id);
        }
        check_outcome(&mut v, &self.outcome);
        v.into_result()
    }
}

/// Validates a permit id on its own (GetPermit, RevokePermit, ListUncertain).
pub fn validate_permit_id(permit_id: &str) -> Result<String, Error> {
    canonical_id(permit_id).ok_or_else(|| super::invalid("permit_id", "must be a UUID"))
}
