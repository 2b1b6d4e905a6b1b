//! Where permits and attempts live: one trait, two backends.
//!
//! - [`memory`]: the embedded default and the reference semantics (it runs
//!   the domain [`Ledger`](crate::domain::Ledger) under a lock). Keeps
//!   nothing across restarts.
//! - [`redis`]: the production store, shared by any number of replicas.
//!   Each transition is one Lua script run; all keys of a permit share the
//!   hash tag `{permit_id}`.
//!
//! Every method takes `now` from the service's clock. The memory store
//! decides on it; the Redis store decides on Redis's clock, which every
//! replica shares (unless configured to take the caller's, for tests). A
//! store that cannot answer returns [`Error::StoreUnavailable`]: it never
//! guesses.

pub mod memory;
pub mod redis;

use crate::domain::{
    ApproveCmd, Attempt, AuthorizeCmd, Authorized, CommitCmd, DenyCmd, Error, GetAttemptCmd,
    MarkUncertainCmd, Millis, Permit, PermitView, ResolveCmd, Scope, Settled,
};
use std::future::Future;

/// A position in a listing's order: the last attempt listed. Across
/// permits, attempts are in (at, permit_id, idempotency_key) order, oldest
/// first; under one permit, in (at, idempotency_key) order. `at` is when
/// the attempt became uncertain for ListUncertain, and when it was
/// requested (created_at) for ListApprovals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub at: Millis,
    pub permit_id: String,
    pub idempotency_key: String,
}

impl Cursor {
    /// After this uncertain attempt (ListUncertain).
    pub fn after(attempt: &Attempt) -> Self {
        Self {
            at: attempt.uncertain_since,
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
        }
    }

    /// After this attempt awaiting approval (ListApprovals).
    pub fn after_request(attempt: &Attempt) -> Self {
        Self {
            at: attempt.created_at,
            ..Self::after(attempt)
        }
    }

    /// The attempt to continue after, when the cursor is inside `permit_id`.
    pub fn attempt_in(&self, permit_id: &str) -> Option<(Millis, &str)> {
        (self.permit_id == permit_id).then_some((self.at, self.idempotency_key.as_str()))
    }
}

/// One page of uncertain attempts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    pub attempts: Vec<Attempt>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<Cursor>,
}

/// The uncertain census ([`Store::census`]): the whole store, across every
/// tenant, at one moment on the store's clock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CensusFigures {
    /// Attempts UNCERTAIN (marked, or RESERVED past their lease).
    pub uncertain: u64,
    /// How long the oldest of them had been uncertain when counted (0:
    /// none).
    pub oldest_age_ms: Millis,
    /// How long ago they were counted (another replica's count, on Redis:
    /// one census per fleet per interval).
    pub age_ms: Millis,
}

/// How long past its expiry a permit stays in the Redis store's
/// cross-permit index once no attempt is open. New keys stop at expiry on
/// Redis's one clock; the margin covers that clock stepping back a little.
pub const INDEX_MARGIN_MS: Millis = 60_000;

/// The stores' shared contract. Every call about a permit carries the
/// caller's [`Scope`]: a permit outside it answers PERMIT_NOT_FOUND, exactly
/// as one that does not exist, decided in the same atomic step as the rest. Every id handed in (`attempt_id`,
/// `receipt_id`) must be [`crate::domain::new_id`] of the same `now` the call
/// carries: the Redis store reads an attempt's creation time and a receipt's
/// issue time back from their ids.
pub trait Store: Send + Sync + 'static {
    /// Stores a validated permit (its id is fresh).
    fn create_permit(&self, permit: Permit) -> impl Future<Output = Result<Permit, Error>> + Send;
    fn get_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> impl Future<Output = Result<PermitView, Error>> + Send;
    fn revoke_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> impl Future<Output = Result<Permit, Error>> + Send;
    /// The key's attempt as every reader sees it at `now` (a RESERVED one
    /// past its lease is UNCERTAIN, `lease_expired`). Reads only.
    /// PERMIT_NOT_FOUND for a permit outside the scope, as everywhere;
    /// ATTEMPT_NOT_FOUND for a key the permit never saw.
    fn get_attempt(
        &self,
        scope: &Scope,
        cmd: &GetAttemptCmd,
        now: Millis,
    ) -> impl Future<Output = Result<Attempt, Error>> + Send;
    /// Runs the order of checks and, for a new key that passes, reserves the
    /// slot and cost and records the attempt as `attempt_id`, atomically.
    fn authorize(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> impl Future<Output = Result<Authorized, Error>> + Send;
    fn commit(
        &self,
        scope: &Scope,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> impl Future<Output = Result<Settled, Error>> + Send;
    fn mark_uncertain(
        &self,
        scope: &Scope,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> impl Future<Output = Result<Attempt, Error>> + Send;
    fn resolve(
        &self,
        scope: &Scope,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> impl Future<Output = Result<Settled, Error>> + Send;
    /// Attempts UNCERTAIN at `now` after `after`, under one permit or (with
    /// `permit_id` `None`) across all permits of the scope's tenant, at
    /// most `limit`. Across permits it costs what it returns, whatever the
    /// number of permits: both stores keep an index of open attempts by
    /// when they are (or become) uncertain.
    fn list_uncertain(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> impl Future<Output = Result<Page, Error>> + Send;
    /// Approves a call awaiting approval as the scope's key
    /// ([`crate::domain::Ledger::approve`]).
    fn approve(
        &self,
        scope: &Scope,
        cmd: &ApproveCmd,
        now: Millis,
    ) -> impl Future<Output = Result<Attempt, Error>> + Send;
    /// Denies a pending call ([`crate::domain::Ledger::deny`]).
    fn deny(
        &self,
        scope: &Scope,
        cmd: &DenyCmd,
        now: Millis,
    ) -> impl Future<Output = Result<Settled, Error>> + Send;
    /// Attempts AWAITING_APPROVAL at `now` after `after`, in (created_at,
    /// permit_id, idempotency_key) order, under one permit or across the
    /// scope's tenant, at most `limit`.
    fn list_approvals(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> impl Future<Output = Result<Page, Error>> + Send;
    /// Housekeeping, run every few seconds by the server: drops a bounded
    /// batch of what nothing can reach any more (permits past retention,
    /// index entries of permits that can never hold an open attempt again,
    /// tenants with nothing left in their index).
    /// Returns how many it dropped.
    fn sweep(&self, now: Millis) -> impl Future<Output = Result<usize, Error>> + Send;
    /// Succeeds when the store can serve requests (for health checks).
    fn ping(&self) -> impl Future<Output = Result<(), Error>> + Send;
    /// The uncertain census (crate::telemetry::census), across every
    /// tenant, at `now` (Redis: on its own clock). Changes nothing but the
    /// Redis store's shared figures: a replica counts when the fleet's
    /// figures are older than `interval` and no other replica has taken the
    /// turn; otherwise it reads them ([`CensusFigures::age_ms`]). With
    /// `interval` zero it counts, and shares nothing.
    fn census(
        &self,
        now: Millis,
        interval: std::time::Duration,
    ) -> impl Future<Output = Result<CensusFigures, Error>> + Send;
}

/// The backend chosen at start-up.
pub enum Backend {
    Memory(memory::MemoryStore),
    Redis(redis::RedisStore),
}

/// Calls the chosen store, as one store call of the RPC's telemetry
/// (a child span, timed by operation: [`crate::telemetry::store_call`]).
macro_rules! delegate {
    ($self:ident, $op:literal, $store:ident => $call:expr) => {
        match $self {
            Backend::Memory($store) => crate::telemetry::store_call($op, "memory", $call).await,
            Backend::Redis($store) => crate::telemetry::store_call($op, "redis", $call).await,
        }
    };
}

impl Store for Backend {
    async fn create_permit(&self, permit: Permit) -> Result<Permit, Error> {
        delegate!(self, "create_permit", s => s.create_permit(permit))
    }
    async fn get_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<PermitView, Error> {
        delegate!(self, "get_permit", s => s.get_permit(scope, permit_id, now))
    }
    async fn revoke_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<Permit, Error> {
        delegate!(self, "revoke_permit", s => s.revoke_permit(scope, permit_id, now))
    }
    async fn get_attempt(
        &self,
        scope: &Scope,
        cmd: &GetAttemptCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        delegate!(self, "get_attempt", s => s.get_attempt(scope, cmd, now))
    }
    async fn authorize(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        delegate!(self, "authorize", s => s.authorize(scope, cmd, now, attempt_id))
    }
    async fn commit(
        &self,
        scope: &Scope,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        delegate!(self, "commit", s => s.commit(scope, cmd, now, receipt_id))
    }
    async fn mark_uncertain(
        &self,
        scope: &Scope,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        delegate!(self, "mark_uncertain", s => s.mark_uncertain(scope, cmd, now))
    }
    async fn resolve(
        &self,
        scope: &Scope,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        delegate!(self, "resolve", s => s.resolve(scope, cmd, now, receipt_id))
    }
    async fn list_uncertain(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        delegate!(self, "list_uncertain", s => s.list_uncertain(scope, permit_id, after, limit, now))
    }
    async fn approve(
        &self,
        scope: &Scope,
        cmd: &ApproveCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        delegate!(self, "approve", s => s.approve(scope, cmd, now))
    }
    async fn deny(&self, scope: &Scope, cmd: &DenyCmd, now: Millis) -> Result<Settled, Error> {
        delegate!(self, "deny", s => s.deny(scope, cmd, now))
    }
    async fn list_approvals(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        delegate!(self, "list_approvals", s => s.list_approvals(scope, permit_id, after, limit, now))
    }
    async fn sweep(&self, now: Millis) -> Result<usize, Error> {
        delegate!(self, "sweep", s => s.sweep(now))
    }
    async fn ping(&self) -> Result<(), Error> {
        delegate!(self, "ping", s => s.ping())
    }
    async fn census(
        &self,
        now: Millis,
        interval: std::time::Duration,
    ) -> Result<CensusFigures, Error> {
        delegate!(self, "census", s => s.census(now, interval))
    }
}
