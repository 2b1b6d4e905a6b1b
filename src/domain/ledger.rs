//! The reference state machine: one permit, its usage and its attempts.
//!
//! Every transition checks everything before it changes anything, so an
//! error leaves the ledger exactly as it was. The Redis scripts in
//! `store/redis/lua/*.lua` implement these same functions step for step.

use super::{
    Approval, ApproveCmd, Attempt, AttemptState, AuthorizeCmd, Authorized, CommitCmd, Decision,
    DenyCmd, Error, GuardMode, MAX_AMOUNT, MarkUncertainCmd, Millis, Outcome, PERMIT_REVOKED,
    Permit, PermitStatus, PermitView, Quota, Quotas, Receipt, ResolveCmd, Scope, Settled,
    UncertainPolicy, Usage,
    attempt::{lapse_reason, observe},
    invalid,
};
use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;

/// An idempotency key, shared by the attempts map and the duplicate guard's
/// index (and by `duplicate_of`), so each key is stored once.
type Key = Arc<str>;

/// Fixed costs of [`Ledger::approx_bytes`], per permit, tool, attempt and
/// receipt: the structs, the boxes and the maps' nodes around them.
const PERMIT_BYTES: usize = 1024;
const TOOL_BYTES: usize = 64;
const ATTEMPT_BYTES: usize = 320;
const RECEIPT_BYTES: usize = 96;

#[derive(Debug, Clone)]
pub struct Ledger {
    permit: Permit,
    /// Slots held, by the tool's index in `permit.tools`.
    calls: Vec<u64>,
    /// Call caps, by the tool's index in `permit.tools`; `None`: no cap.
    limits: Vec<Option<u64>>,
    committed: i64,
    reserved: i64,
    /// By idempotency key. A B-tree, not a hash map: at a million records
    /// its nodes waste less room than a hash table's spare capacity (477
    /// against 372 bytes per RESERVED attempt, measured as RSS growth).
    attempts: BTreeMap<Key, Record>,
    /// The RESERVED and UNCERTAIN attempts, by (when they are or became
    /// uncertain, key): the lease's end for a RESERVED one, its
    /// `uncertain_since` for an UNCERTAIN one. Those uncertain at `now` are
    /// the range up to `now`, so a listing costs what it returns.
    open: BTreeSet<(Millis, Key)>,
    /// With [`UncertainPolicy::HoldTool`], the same per tool (by the tool's
    /// index), so "is this tool held?" is one look at its first entry.
    /// Empty with [`UncertainPolicy::Count`].
    held: Vec<BTreeSet<(Millis, Key)>>,
    /// A keyed hash of (tool, fingerprint) -> the latest key dispatched with
    /// them, for the duplicate guard: a pointer, checked against the
    /// attempt's full request on every read, so a stale entry is harmless.
    /// Two requests whose hashes collide (2^-64, with a per-ledger random
    /// key) can only overwrite each other's pointer: the guard may then miss
    /// a duplicate, never report a false one, as in the Redis store.
    dup_index: HashMap<u64, Key>,
    dup_hasher: RandomState,
    /// [`Ledger::approx_bytes`].
    bytes: usize,
    /// When an attempt was last settled: retention runs from the later of
    /// this and the permit's expiry.
    last_settled_at: Millis,
    /// The key ids that reserved this permit's attempts, each stored once
    /// ([`Record::reserved_by`] is an index here; index 0 is "", dev mode).
    /// A permit sees the few keys of its tenant's agents.
    holders: Vec<Arc<str>>,
    /// How `open` moved since it was last taken, for a store that mirrors
    /// the open set in an index of its own ([`Ledger::take_open_change`]).
    open_change: OpenChange,
    /// The attempts AWAITING_APPROVAL or APPROVED, by (deadline, key):
    /// those whose deadline is past are DENIED for every reader, and the
    /// next transition writes it ([`Ledger::lapse`]), returning their slots
    /// and costs, so no background job is needed.
    pending: BTreeSet<(Millis, Key)>,
    /// The attempts AWAITING_APPROVAL, by (created_at, key): ListApprovals'
    /// order.
    awaiting: BTreeSet<(Millis, Key)>,
    /// How `awaiting` moved since it was last taken
    /// ([`Ledger::take_awaiting_change`]): (added, created_at, key), in order.
    awaiting_change: Vec<(bool, Millis, Key)>,
}

/// How one operation moved an attempt in the open set: the entry it left
/// and the one it took, each (when it is or became uncertain, key). An
/// operation moves at most one attempt, so this is exact only when taken
/// after every operation: two operations' changes would merge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenChange {
    pub removed: Option<(Millis, Arc<str>)>,
    pub added: Option<(Millis, Arc<str>)>,
}

/// One attempt as the ledger keeps it: the permit and the key are the
/// ledger's and the map's, the tool is an index, and what only settled or
/// uncertain attempts carry sits behind one pointer. (An [`Attempt`] spells
/// all of it out, for answers.)
#[derive(Debug, Clone)]
#[cfg_attr(feature = "model", derive(Hash, PartialEq, Eq))]
struct Record {
    attempt_id: Box<str>,
    fingerprint: Box<[u8]>,
    cost: i64,
    created_at: Millis,
    lease_expires_at: Millis,
    tool: u16,
    state: AttemptState,
    /// Who reserved it: an index into [`Ledger::holders`].
    reserved_by: u32,
    detail: Option<Box<Detail>>,
    duplicate_of: Option<Key>,
}

#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "model", derive(Hash, PartialEq, Eq))]
struct Detail {
    receipt: Option<Receipt>,
    failure_reason: String,
    uncertain_reason: String,
    /// The holder token of a RESERVED attempt (empty: none); dropped when
    /// it stops being RESERVED, since only then does it redeliver.
    holder_token: Box<[u8]>,
    /// When a marked UNCERTAIN attempt became uncertain: the earlier of its
    /// lease's end and the MarkUncertain.
    uncertain_since: Millis,
    /// A call that needed approval: its request and outcome. Its
    /// `expires_at` is the record's `lease_expires_at` while pending.
    approval: Option<Approval>,
}

impl Record {
    fn observed_state(&self, now: Millis) -> AttemptState {
        observe(self.state, self.lease_expires_at, now)
    }

    fn detail(&mut self) -> &mut Detail {
        self.detail.get_or_insert_with(Box::default)
    }

    fn failure_reason(&self) -> &str {
        self.detail.as_ref().map_or("", |d| &d.failure_reason)
    }

    fn receipt(&self) -> Option<&Receipt> {
        self.detail.as_ref().and_then(|d| d.receipt.as_ref())
    }

    fn holder_token(&self) -> &[u8] {
        self.detail.as_ref().map_or(&[], |d| &d.holder_token)
    }

    fn approval(&self) -> Option<&Approval> {
        self.detail.as_ref().and_then(|d| d.approval.as_ref())
    }

    /// Its place in the open set while RESERVED or UNCERTAIN: when it is
    /// (or became) uncertain.
    fn open_at(&self) -> Millis {
        match self.state {
            AttemptState::Uncertain => self.detail.as_ref().map_or(0, |d| d.uncertain_since),
            _ => self.lease_expires_at,
        }
    }
}

/// Who settles an attempt: the caller holding its attempt_id (Commit) or an
/// operator (Resolve), who may only settle what is UNCERTAIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settler {
    Holder,
    Operator,
}

/// For the protocol's model checker (tools/model), which keeps ledgers in
/// the states it explores and tells states apart: everything a later
/// command reads. Of the permit, only its status (the one field a command
/// changes). The duplicate guard's index is taken in key order; its hashes
/// agree between ledgers cloned from one, as a model's are.
#[cfg(feature = "model")]
impl Ledger {
    #[allow(clippy::type_complexity)]
    fn essence(
        &self,
    ) -> (
        (PermitStatus, &[u64], i64, i64),
        &BTreeMap<Key, Record>,
        (&BTreeSet<(Millis, Key)>, &[BTreeSet<(Millis, Key)>]),
        Vec<(&u64, &Key)>,
        (Millis, &[Arc<str>], &BTreeSet<(Millis, Key)>),
    ) {
        let mut dup: Vec<_> = self.dup_index.iter().collect();
        dup.sort();
        (
            (
                self.permit.status,
                &self.calls,
                self.committed,
                self.reserved,
            ),
            &self.attempts,
            (&self.open, &self.held),
            dup,
            (self.last_settled_at, &self.holders, &self.pending),
        )
    }
}

#[cfg(feature = "model")]
impl std::hash::Hash for Ledger {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.essence().hash(state);
    }
}

#[cfg(feature = "model")]
impl PartialEq for Ledger {
    fn eq(&self, other: &Self) -> bool {
        self.essence() == other.essence()
    }
}

#[cfg(feature = "model")]
impl Eq for Ledger {}

// === impl Ledger ===

impl Ledger {
    pub fn new(permit: Permit) -> Self {
        let limits = permit
            .tools
            .iter()
            .map(|t| permit.max_calls_per_tool.get(t).copied())
            .collect();
        let held = match permit.uncertain_policy {
            UncertainPolicy::Count => Vec::new(),
            UncertainPolicy::HoldTool => vec![BTreeSet::new(); permit.tools.len()],
        };
        Self {
            calls: vec![0; permit.tools.len()],
            limits,
            permit,
            committed: 0,
            reserved: 0,
            attempts: BTreeMap::new(),
            open: BTreeSet::new(),
            held,
            dup_index: HashMap::new(),
            dup_hasher: RandomState::new(),
            last_settled_at: 0,
            bytes: 0,
            holders: vec![Arc::from("")],
            open_change: OpenChange::default(),
            pending: BTreeSet::new(),
            awaiting: BTreeSet::new(),
            awaiting_change: Vec::new(),
        }
        .with_permit_bytes()
    }

    /// Charges the permit's own record (its fields and per-tool state).
    fn with_permit_bytes(mut self) -> Self {
        let p = &self.permit;
        self.bytes = PERMIT_BYTES
            + p.permit_id.len()
            + p.subject.len()
            + p.currency.len()
            + p.tenant.len()
            + p.agents.iter().map(|a| a.len() + 24).sum::<usize>()
            + p.tools
                .iter()
                .map(|t| 2 * t.len() + TOOL_BYTES)
                .sum::<usize>();
        self
    }

    /// About how much memory this ledger holds, in bytes: a fixed cost per
    /// permit, tool and attempt, plus every variable-length value stored
    /// (measured against RSS: docs/performance.md). Never less than what
    /// was stored: values dropped later (a holder token) are not refunded.
    pub fn approx_bytes(&self) -> usize {
        self.bytes
    }

    pub fn permit(&self) -> &Permit {
        &self.permit
    }

    /// Stops new keys; a call still awaiting approval (or approved and
    /// not yet claimed) is denied ("permit_revoked"): nothing was sent for
    /// it, and a revoked permit sends nothing new.
    pub fn revoke(&mut self, now: Millis) -> Permit {
        self.lapse(now);
        self.permit.status = PermitStatus::Revoked;
        while let Some((_, key)) = self.pending.first().cloned() {
            self.deny_pending(&key, PERMIT_REVOKED, "", now);
        }
        self.permit.clone()
    }

    pub fn view(&self, now: Millis) -> PermitView {
        // Pending calls past their deadline are DENIED for every reader,
        // written or not: their slots and costs are not held.
        let mut calls = self.calls.clone();
        let mut reserved = self.reserved;
        for (_, key) in self.pending.range(..(now + 1, Key::from(""))) {
            let record = &self.attempts[key];
            calls[usize::from(record.tool)] -= 1;
            reserved -= record.cost;
        }
        let remaining = self.permit.budget.map(|b| b - self.committed - reserved);
        PermitView {
            permit: self.permit.clone(),
            usage: (0..self.permit.tools.len())
                .map(|t| Usage {
                    calls_made: calls[t],
                    budget_remaining: remaining,
                    ..self.usage(t)
                })
                .collect(),
            budget_committed: self.committed,
            budget_reserved: reserved,
        }
    }

    /// Writes what every reader already sees: each pending call whose
    /// deadline is past `now` is DENIED, its slot and cost returned. Run
    /// first by every transition, so their checks and usage count only
    /// what is held at `now`. Changes nothing any reader can tell.
    fn lapse(&mut self, now: Millis) {
        while let Some((deadline, key)) = self.pending.first().cloned()
            && deadline <= now
        {
            let state = self.attempts[&key].state;
            self.deny_pending(&key, lapse_reason(state), "", deadline);
        }
    }

    /// [`Ledger::lapse`], for a store that passes over lapsed requests
    /// (the memory store's listing): the next transition would write the
    /// same.
    pub fn write_lapses(&mut self, now: Millis) {
        self.lapse(now);
    }

    /// A pending call (AWAITING_APPROVAL or APPROVED) -> DENIED at `at`,
    /// by `by` for `reason`: its slot and cost come back.
    fn deny_pending(&mut self, key: &Key, reason: &str, by: &str, at: Millis) {
        let record = self.attempts.get_mut(key).expect("pending attempts exist");
        let (deadline, created_at, was) =
            (record.lease_expires_at, record.created_at, record.state);
        record.state = AttemptState::Denied;
        self.calls[usize::from(record.tool)] -= 1;
        self.reserved -= record.cost;
        self.bytes += reason.len() + by.len();
        let approval = record
            .detail()
            .approval
            .as_mut()
            .expect("a pending attempt has an approval");
        approval.denial_reason = reason.to_owned();
        approval.decided_by = by.to_owned();
        approval.decided_at = at;
        self.pending.remove(&(deadline, key.clone()));
        if was == AttemptState::AwaitingApproval {
            self.awaiting_remove(created_at, key);
        }
        self.dup_forget(key);
    }

    fn awaiting_remove(&mut self, created_at: Millis, key: &Key) {
        self.awaiting.remove(&(created_at, key.clone()));
        self.awaiting_change.push((false, created_at, key.clone()));
    }

    /// The attempts AWAITING_APPROVAL (some may have lapsed), by
    /// (created_at, key).
    pub fn awaiting(&self) -> impl Iterator<Item = &(Millis, Arc<str>)> {
        self.awaiting.iter()
    }

    /// How the AWAITING_APPROVAL set moved since this was last taken
    /// (added or removed, created_at, key), in order: the memory store
    /// keeps its tenant's ListApprovals index in step with it.
    pub fn take_awaiting_change(&mut self) -> Vec<(bool, Millis, Arc<str>)> {
        std::mem::take(&mut self.awaiting_change)
    }

    /// Attempts AWAITING_APPROVAL at `now`, in (created_at, key) order
    /// after `after`, at most `limit` of them.
    pub fn awaiting_after(
        &self,
        after: Option<(Millis, &str)>,
        limit: usize,
        now: Millis,
    ) -> Vec<Attempt> {
        use std::ops::Bound::{Excluded, Unbounded};
        let start = after.map_or(Unbounded, |(at, key)| Excluded((at, Key::from(key))));
        self.awaiting
            .range((start, Unbounded))
            .map(|(_, key)| self.attempt_at(key, now))
            .filter(|a| a.state == AttemptState::AwaitingApproval)
            .take(limit)
            .collect()
    }

    /// Approve one pending call: an approval by a key that has not
    /// approved it yet, and did not request it; the last one the rule
    /// needs makes it APPROVED, for its requester to claim (its next
    /// same-key Authorize is the DISPATCH) within a lease from now, or by
    /// the request's own deadline if that is later.
    pub fn approve(
        &mut self,
        scope: &Scope,
        cmd: &ApproveCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.lapse(now);
        let record = self.holder_attempt(&cmd.idempotency_key, &cmd.attempt_id)?;
        let state = record.observed_state(now);
        let Some(approval) = record.approval() else {
            return Err(Error::StateConflict { state });
        };
        let me = scope.key_id.as_str();
        // In dev mode (no keys) every caller is "": nobody could approve.
        if !me.is_empty() && me == &*self.holders[record.reserved_by as usize] {
            return Err(Error::ApproverIsRequester {
                idempotency_key: cmd.idempotency_key.clone(),
            });
        }
        let repeat = approval.approved_by.iter().any(|k| k == me);
        if repeat && state != AttemptState::Denied {
            // Recorded already (and whatever followed): answered as it is.
            return Ok(self.attempt_at(&cmd.idempotency_key, now));
        }
        if state != AttemptState::AwaitingApproval {
            return Err(Error::StateConflict { state });
        }
        let (key, record) = self
            .attempts
            .get_key_value(cmd.idempotency_key.as_str())
            .expect("checked");
        let key = key.clone();
        let (deadline, created_at) = (record.lease_expires_at, record.created_at);
        let claim_by = (now + self.permit.lease_ms)
            .max(deadline)
            .min(self.permit.expires_at.max(deadline));
        self.bytes += me.len() + 24;
        let record = self.attempts.get_mut(&key).expect("checked");
        let approval = record.detail().approval.as_mut().expect("checked");
        approval.approved_by.push(me.to_owned());
        if approval.approved_by.len() >= approval.approvers_needed as usize {
            approval.decided_by = me.to_owned();
            approval.decided_at = now;
            approval.expires_at = claim_by;
            record.state = AttemptState::Approved;
            record.lease_expires_at = claim_by;
            self.pending.remove(&(deadline, key.clone()));
            self.pending.insert((claim_by, key.clone()));
            self.awaiting_remove(created_at, &key);
        }
        Ok(self.attempt_at(&key, now))
    }

    /// Deny one pending call: DENIED, its slot and cost come back, and its
    /// key replays the denial. The same denial again answers the same.
    pub fn deny(&mut self, scope: &Scope, cmd: &DenyCmd, now: Millis) -> Result<Settled, Error> {
        self.lapse(now);
        let (key, record) = self
            .attempts
            .get_key_value(cmd.idempotency_key.as_str())
            .map(|(k, r)| (k.clone(), r))
            .ok_or_else(|| Error::AttemptNotFound {
                idempotency_key: cmd.idempotency_key.clone(),
            })?;
        self.holder_attempt(&cmd.idempotency_key, &cmd.attempt_id)?;
        match record.state {
            AttemptState::AwaitingApproval | AttemptState::Approved => {
                self.deny_pending(&key, &cmd.reason, &scope.key_id, now);
            }
            AttemptState::Denied
                if record.approval().map(|a| a.denial_reason.as_str())
                    == Some(cmd.reason.as_str()) => {}
            _ => {
                return Err(Error::StateConflict {
                    state: record.observed_state(now),
                });
            }
        }
        Ok(self.settled(&key, now))
    }

    /// Usage of the tool at index `tool` of the permit's tools.
    fn usage(&self, tool: usize) -> Usage {
        Usage {
            tool: self.permit.tools[tool].clone(),
            calls_made: self.calls[tool],
            calls_limit: self.limits[tool],
            budget_remaining: self
                .permit
                .budget
                .map(|b| b - self.committed - self.reserved),
        }
    }

    /// Whether an attempt is RESERVED or UNCERTAIN.
    pub fn has_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// How the open set moved since this was last taken (nothing once
    /// taken): the memory store takes it after every operation and keeps
    /// its cross-permit index in step with it, without looking the attempt
    /// up again.
    pub fn take_open_change(&mut self) -> OpenChange {
        std::mem::take(&mut self.open_change)
    }

    /// When the permit and its attempts are forgotten (the ledger is gone
    /// once `now` is past it): `retention_ms` after the later of the
    /// permit's expiry and the settling of its last open attempt; never
    /// while an attempt is RESERVED or UNCERTAIN. (Redis expires the
    /// permit's keys at the same instant: lib.lua, unpin.)
    pub fn forget_at(&self, retention_ms: Millis) -> Option<Millis> {
        (!self.has_open()).then(|| self.permit.expires_at.max(self.last_settled_at) + retention_ms)
    }

    /// Attempts UNCERTAIN at `now` (including RESERVED ones past their
    /// lease), in (uncertain_since, key) order after `after`, at most
    /// `limit` of them: one range read of the open set.
    pub fn uncertain_after(
        &self,
        after: Option<(Millis, &str)>,
        limit: usize,
        now: Millis,
    ) -> Vec<Attempt> {
        use std::ops::Bound::{Excluded, Unbounded};
        let start = after.map_or(Unbounded, |(at, key)| Excluded((at, Key::from(key))));
        self.open
            .range((start, Unbounded))
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .map(|(_, key)| self.attempt_at(key, now))
            .collect()
    }

    /// The order of checks:
    /// 1. the key exists (and was not released): same request -> REPLAY, or
    ///    IN_PROGRESS while RESERVED within its lease; different -> KEY_REUSED;
    /// 2. a new key: revoked -> expired -> tool in scope -> not held
    ///    (HOLD_TOOL) -> duplicate guard -> cap -> budget -> quotas (open
    ///    attempts, then recorded keys); then reserve slot and cost and
    ///    record the attempt.
    pub fn authorize(
        &mut self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
        quotas: &Quotas,
        store_full: Option<u64>,
    ) -> Result<Authorized, Error> {
        // Calls whose approval lapsed return their slots before anything
        // is read: every answer's usage counts only what is held at `now`.
        self.lapse(now);
        if let Some((key, existing)) = self.attempts.get_key_value(cmd.idempotency_key.as_str())
            && existing.state != AttemptState::Released
        {
            let same_request = self.permit.tools[usize::from(existing.tool)] == cmd.tool
                && *existing.fingerprint == *cmd.request_fingerprint
                && existing.cost == cmd.cost;
            if !same_request {
                return Err(Error::KeyReused {
                    idempotency_key: cmd.idempotency_key.clone(),
                });
            }
            let holds = scope.holds(&self.holders[existing.reserved_by as usize]);
            match existing.observed_state(now) {
                AttemptState::AwaitingApproval => {
                    let mut attempt = self.attempt_view(key, existing, now);
                    if !holds {
                        attempt.attempt_id.clear();
                    }
                    return Ok(Authorized {
                        decision: Decision::AwaitApproval,
                        usage: self.usage(usize::from(existing.tool)),
                        attempt,
                        duplicate_of: None,
                        redelivered: false,
                        lease_remaining_ms: 0,
                        approval_remaining_ms: existing.lease_expires_at - now,
                    });
                }
                AttemptState::Approved => {
                    if holds {
                        // The claim is this call's first dispatch: a held
                        // tool stops it as it stops a new key (it stays
                        // APPROVED, to be claimed once the hold lifts).
                        let tool = usize::from(existing.tool);
                        if let Some((at, held_key)) = self.held.get(tool).and_then(|h| h.first())
                            && *at <= now
                        {
                            return Err(Error::ToolHeld {
                                tool: cmd.tool.clone(),
                                uncertain_key: held_key.to_string(),
                            });
                        }
                        let key = key.clone();
                        return Ok(self.claim(&key, cmd, now));
                    }
                    // Someone else's approved call: it waits for its
                    // requester to claim it.
                    let mut attempt = self.attempt_view(key, existing, now);
                    attempt.attempt_id.clear();
                    return Ok(Authorized {
                        decision: Decision::AwaitApproval,
                        usage: self.usage(usize::from(existing.tool)),
                        attempt,
                        duplicate_of: None,
                        redelivered: false,
                        lease_remaining_ms: 0,
                        approval_remaining_ms: existing.lease_expires_at - now,
                    });
                }
                _ => {}
            }
            if existing.observed_state(now) == AttemptState::Reserved {
                // The same holder, whose DISPATCH answer was lost, gets it
                // again: the same attempt, nothing more reserved.
                if holds
                    && !cmd.holder_token.is_empty()
                    && existing.holder_token() == cmd.holder_token.as_slice()
                {
                    return Ok(Authorized {
                        decision: Decision::Dispatch,
                        usage: self.usage(usize::from(existing.tool)),
                        attempt: self.attempt_view(key, existing, now),
                        // The first answer's duplicate warning, repeated.
                        duplicate_of: existing.duplicate_of.as_ref().map(|k| k.to_string()),
                        redelivered: true,
                        lease_remaining_ms: existing.lease_expires_at - now,
                        approval_remaining_ms: 0,
                    });
                }
                return Err(Error::InProgress {
                    idempotency_key: cmd.idempotency_key.clone(),
                    lease_expires_at: existing.lease_expires_at,
                    retry_after_ms: existing.lease_expires_at - now,
                });
            }
            let mut attempt = self.attempt_view(key, existing, now);
            // An open attempt's id is the fencing token of its Commit and
            // MarkUncertain: it goes only to the caller holding it.
            if attempt.state.is_open() && !holds {
                attempt.attempt_id.clear();
            }
            return Ok(Authorized {
                decision: Decision::Replay,
                usage: self.usage(usize::from(existing.tool)),
                attempt,
                duplicate_of: None,
                redelivered: false,
                lease_remaining_ms: 0,
                approval_remaining_ms: 0,
            });
        }

        let permit = &self.permit;
        if permit.status == PermitStatus::Revoked {
            return Err(Error::PermitRevoked {
                permit_id: permit.permit_id.clone(),
            });
        }
        if now >= permit.expires_at {
            return Err(Error::PermitExpired {
                permit_id: permit.permit_id.clone(),
                expired_at: permit.expires_at,
            });
        }
        let Some(tool) = permit.tools.iter().position(|t| *t == cmd.tool) else {
            return Err(Error::ToolNotInScope {
                tool: cmd.tool.clone(),
            });
        };
        // Held while the tool has an attempt uncertain at `now` (with
        // UncertainPolicy::HoldTool only: `held` is empty otherwise).
        if let Some((at, key)) = self.held.get(tool).and_then(|h| h.first())
            && *at <= now
        {
            return Err(Error::ToolHeld {
                tool: cmd.tool.clone(),
                uncertain_key: key.to_string(),
            });
        }
        // The guard's index key, unless the guard is off.
        let dup_hash = (permit.duplicate_guard.mode != GuardMode::Off)
            .then(|| self.dup_hash(tool, &cmd.request_fingerprint));
        let duplicate_of = dup_hash
            .and_then(|hash| self.live_duplicate(hash, tool, &cmd.request_fingerprint, now));
        if let Some(earlier_key) = &duplicate_of
            && permit.duplicate_guard.mode == GuardMode::Enforce
        {
            return Err(Error::DuplicateSuspected {
                tool: cmd.tool.clone(),
                earlier_key: earlier_key.to_string(),
            });
        }
        let calls_made = self.calls[tool];
        if let Some(limit) = self.limits[tool]
            && calls_made >= limit
        {
            return Err(Error::MaxCallsExceeded {
                tool: cmd.tool.clone(),
                limit,
                calls_made,
            });
        }
        // A permit without a budget still stops at the accounting ceiling,
        // so no total can overflow (or lose precision in Lua).
        let budget = permit.budget.unwrap_or(MAX_AMOUNT);
        if self.committed + self.reserved + cmd.cost > budget {
            return Err(Error::BudgetExceeded {
                budget,
                committed: self.committed,
                reserved: self.reserved,
                requested: cmd.cost,
            });
        }
        // Last, the quotas: a released key re-reserved is no new record.
        quotas.check_attempts(
            self.open.len() + self.pending.len(),
            self.attempts.len(),
            !self.attempts.contains_key(cmd.idempotency_key.as_str()),
        )?;
        // The memory store, full: no new reservation (replays go on).
        if let Some(limit) = store_full {
            return Err(super::quota::exceeded(Quota::StoreFull, limit));
        }

        // Everything checked: reserve and record in one step. A call the
        // permit's approval rule holds reserves the same, but waits.
        let lease_ms = permit.lease_ms;
        let approval = permit
            .approval_for(&cmd.tool, cmd.cost)
            .map(|rule| Approval {
                summary: cmd.approval_summary.clone(),
                expires_at: (now + rule.wait_ms).min(permit.expires_at),
                approvers_needed: rule.approvers,
                ..Approval::default()
            });
        let reserved_by = self.holder_index(&scope.key_id);
        let key: Key = Arc::from(cmd.idempotency_key.as_str());
        let detail = match &approval {
            Some(approval) => Some(Box::new(Detail {
                approval: Some(approval.clone()),
                ..Detail::default()
            })),
            // Only an attempt with a holder token pays for a Detail now.
            None => (!cmd.holder_token.is_empty()).then(|| {
                Box::new(Detail {
                    holder_token: cmd.holder_token.as_slice().into(),
                    ..Detail::default()
                })
            }),
        };
        let record = Record {
            attempt_id: attempt_id.into_boxed_str(),
            fingerprint: cmd.request_fingerprint.as_slice().into(),
            cost: cmd.cost,
            created_at: now,
            lease_expires_at: approval.as_ref().map_or(now + lease_ms, |a| a.expires_at),
            tool: u16::try_from(tool).expect("at most MAX_TOOLS tools"),
            state: match approval {
                Some(_) => AttemptState::AwaitingApproval,
                None => AttemptState::Reserved,
            },
            reserved_by,
            detail,
            duplicate_of: duplicate_of.clone(),
        };
        if let Some(hash) = dup_hash {
            self.dup_index.insert(hash, key.clone());
        }
        if let Some(approval) = &approval {
            self.pending.insert((approval.expires_at, key.clone()));
            self.awaiting.insert((now, key.clone()));
            self.awaiting_change.push((true, now, key.clone()));
            self.bytes += approval.summary.len() + 64;
        } else {
            self.open_insert(record.lease_expires_at, tool, &key);
        }
        self.calls[tool] += 1;
        self.reserved += cmd.cost;
        let attempt = self.attempt_view(&key, &record, now);
        self.bytes += ATTEMPT_BYTES + 2 * key.len() + cmd.request_fingerprint.len();
        self.bytes += cmd.holder_token.len();
        let key_len = key.len();
        if let Some(released) = self.attempts.insert(key, record) {
            // A released key re-reserved: its record is replaced.
            self.bytes -= ATTEMPT_BYTES + 2 * key_len + released.fingerprint.len();
        }
        let awaiting = approval.map(|a| a.expires_at - now);
        Ok(Authorized {
            decision: match awaiting {
                Some(_) => Decision::AwaitApproval,
                None => Decision::Dispatch,
            },
            usage: self.usage(tool),
            attempt,
            duplicate_of: duplicate_of.map(|k| k.to_string()),
            redelivered: false,
            lease_remaining_ms: if awaiting.is_some() { 0 } else { lease_ms },
            approval_remaining_ms: awaiting.unwrap_or(0),
        })
    }

    /// The requester claims its APPROVED call: it turns RESERVED with a
    /// fresh lease from now, held by this call's holder token, and this is
    /// its one DISPATCH (a lost answer is redelivered by the token, as for
    /// any reservation).
    fn claim(&mut self, key: &Key, cmd: &AuthorizeCmd, now: Millis) -> Authorized {
        let lease_ms = self.permit.lease_ms;
        let record = self.attempts.get_mut(key).expect("checked");
        let (deadline, tool) = (record.lease_expires_at, usize::from(record.tool));
        record.state = AttemptState::Reserved;
        record.lease_expires_at = now + lease_ms;
        record.detail().holder_token = cmd.holder_token.as_slice().into();
        self.bytes += cmd.holder_token.len();
        self.pending.remove(&(deadline, key.clone()));
        self.open_insert(now + lease_ms, tool, key);
        let record = &self.attempts[key];
        Authorized {
            decision: Decision::Dispatch,
            usage: self.usage(tool),
            attempt: self.attempt_view(key, record, now),
            duplicate_of: record.duplicate_of.as_ref().map(|k| k.to_string()),
            redelivered: false,
            lease_remaining_ms: lease_ms,
            approval_remaining_ms: 0,
        }
    }

    pub fn commit(
        &mut self,
        scope: &Scope,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.lapse(now);
        self.held_attempt(scope, &cmd.idempotency_key, &cmd.attempt_id)?;
        self.settle(
            &cmd.idempotency_key,
            &cmd.outcome,
            Settler::Holder,
            now,
            receipt_id,
        )
    }

    pub fn resolve(
        &mut self,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.lapse(now);
        if cmd.attempt_id.is_empty() {
            self.attempt(&cmd.idempotency_key)?;
        } else {
            self.holder_attempt(&cmd.idempotency_key, &cmd.attempt_id)?;
        }
        self.settle(
            &cmd.idempotency_key,
            &cmd.outcome,
            Settler::Operator,
            now,
            receipt_id,
        )
    }

    /// The key's attempt as every reader sees it at `now` (a RESERVED one
    /// past its lease is UNCERTAIN): GetAttempt. Changes nothing.
    pub fn get_attempt(&self, key: &str, now: Millis) -> Result<Attempt, Error> {
        self.attempt(key)?;
        Ok(self.attempt_at(key, now))
    }

    /// RESERVED (lease open or not) -> UNCERTAIN; UNCERTAIN stays as it is.
    pub fn mark_uncertain(
        &mut self,
        scope: &Scope,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.lapse(now);
        let record = self.held_attempt(scope, &cmd.idempotency_key, &cmd.attempt_id)?;
        let observed = record.observed_state(now);
        match record.state {
            AttemptState::Reserved => {
                let (key, record) = self
                    .attempts
                    .get_key_value(cmd.idempotency_key.as_str())
                    .expect("checked");
                let (key, tool, lease) = (
                    key.clone(),
                    usize::from(record.tool),
                    record.lease_expires_at,
                );
                // Uncertain from now on, or since its lease ended if that
                // was earlier: it never moves later in the listing order.
                let since = lease.min(now);
                self.open_remove(lease, tool, &key);
                self.open_insert(since, tool, &key);
                let record = self.attempts.get_mut(&key).expect("checked");
                record.state = AttemptState::Uncertain;
                self.bytes += cmd.reason.len();
                let detail = record.detail();
                detail.uncertain_reason = cmd.reason.clone();
                detail.uncertain_since = since;
                detail.holder_token = Box::default();
                Ok(self.attempt_at(&cmd.idempotency_key, now))
            }
            AttemptState::Uncertain => Ok(self.attempt_at(&cmd.idempotency_key, now)),
            _ => Err(Error::StateConflict { state: observed }),
        }
    }

    // --- helpers ---

    fn attempt(&self, key: &str) -> Result<&Record, Error> {
        self.attempts
            .get(key)
            .ok_or_else(|| Error::AttemptNotFound {
                idempotency_key: key.to_owned(),
            })
    }

    /// The key's attempt, provided `attempt_id` is its fencing token.
    fn holder_attempt(&self, key: &str, attempt_id: &str) -> Result<&Record, Error> {
        let attempt = self.attempt(key)?;
        if *attempt.attempt_id != *attempt_id {
            return Err(Error::AttemptMismatch {
                idempotency_key: key.to_owned(),
            });
        }
        Ok(attempt)
    }

    /// [`Self::holder_attempt`], provided the caller also holds it: the
    /// attempt was reserved by its key ([`Scope::holds`]). Checked after
    /// the fencing token, so a caller without the id learns nothing more.
    fn held_attempt(&self, scope: &Scope, key: &str, attempt_id: &str) -> Result<&Record, Error> {
        let attempt = self.holder_attempt(key, attempt_id)?;
        if !scope.holds(&self.holders[attempt.reserved_by as usize]) {
            return Err(Error::AttemptHolderMismatch {
                idempotency_key: key.to_owned(),
            });
        }
        Ok(attempt)
    }

    /// The index of `key_id` in [`Self::holders`], added if new (charged
    /// to [`Self::approx_bytes`] once).
    fn holder_index(&mut self, key_id: &str) -> u32 {
        if let Some(i) = self.holders.iter().position(|h| **h == *key_id) {
            return i as u32;
        }
        self.bytes += TOOL_BYTES + key_id.len();
        self.holders.push(Arc::from(key_id));
        u32::try_from(self.holders.len() - 1).expect("fewer than 2^32 keys")
    }

    /// The one place an outcome is applied, for Commit and Resolve alike.
    /// A repeat of the outcome already recorded answers the same again.
    fn settle(
        &mut self,
        key: &str,
        outcome: &Outcome,
        by: Settler,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        let attempt = self.attempt(key)?;
        let state = attempt.observed_state(now);
        let settleable = match by {
            Settler::Holder => state.is_open(),
            Settler::Operator => state == AttemptState::Uncertain,
        };
        match outcome {
            _ if settleable => {}
            Outcome::Succeeded {
                result,
                actual_cost,
            } if state == AttemptState::Succeeded => {
                let receipt = attempt.receipt().expect("succeeded has a receipt");
                if receipt.result == *result && receipt.cost == actual_cost.unwrap_or(attempt.cost)
                {
                    return Ok(self.settled(key, now));
                }
                return Err(Error::StateConflict { state });
            }
            Outcome::Failed { reason }
                if state == AttemptState::Failed && attempt.failure_reason() == reason =>
            {
                return Ok(self.settled(key, now));
            }
            Outcome::NotSent if state == AttemptState::Released => {
                return Ok(self.settled(key, now));
            }
            _ => return Err(Error::StateConflict { state }),
        }

        // The attempt is open (RESERVED or UNCERTAIN) and may be settled.
        let reserved_cost = attempt.cost;
        let (open_at, tool) = (attempt.open_at(), usize::from(attempt.tool));
        match outcome {
            Outcome::Succeeded {
                result,
                actual_cost,
            } => {
                let actual = actual_cost.unwrap_or(reserved_cost);
                if actual > reserved_cost {
                    return Err(invalid(
                        "succeeded.actual_cost",
                        format!("may not exceed the reserved cost {reserved_cost}"),
                    ));
                }
                self.reserved -= reserved_cost;
                self.committed += actual;
                self.bytes += RECEIPT_BYTES + receipt_id.len() + result.len();
                let record = self.attempts.get_mut(key).expect("checked");
                record.state = AttemptState::Succeeded;
                record.detail().receipt = Some(Receipt {
                    receipt_id,
                    result: result.clone(),
                    cost: actual,
                    issued_at: now,
                });
            }
            Outcome::Failed { reason } => {
                self.reserved -= reserved_cost;
                self.bytes += reason.len();
                let record = self.attempts.get_mut(key).expect("checked");
                record.state = AttemptState::Failed;
                record.detail().failure_reason = reason.clone();
            }
            Outcome::NotSent => {
                if by == Settler::Holder && state != AttemptState::Reserved {
                    // An uncertain call may have left: its slot stays held,
                    // until an operator verifies it never took effect.
                    return Err(Error::StateConflict { state });
                }
                self.reserved -= reserved_cost;
                let record = self.attempts.get_mut(key).expect("checked");
                record.state = AttemptState::Released;
                self.calls[usize::from(record.tool)] -= 1;
                self.dup_forget(key);
            }
        }
        // Settled: no longer RESERVED, so its token redelivers nothing.
        if let Some(detail) = self.attempts.get_mut(key).and_then(|r| r.detail.as_mut()) {
            detail.holder_token = Box::default();
        }
        let owned = self.attempts.get_key_value(key).expect("checked").0.clone();
        self.open_remove(open_at, tool, &owned);
        self.last_settled_at = now;
        Ok(self.settled(key, now))
    }

    fn open_insert(&mut self, at: Millis, tool: usize, key: &Key) {
        self.open.insert((at, key.clone()));
        self.open_change.added = Some((at, key.clone()));
        if let Some(held) = self.held.get_mut(tool) {
            held.insert((at, key.clone()));
        }
    }

    fn open_remove(&mut self, at: Millis, tool: usize, key: &Key) {
        let entry = (at, key.clone());
        self.open.remove(&entry);
        self.open_change.removed = Some(entry.clone());
        if let Some(held) = self.held.get_mut(tool) {
            held.remove(&entry);
        }
    }

    fn settled(&self, key: &str, now: Millis) -> Settled {
        let (key, record) = self.attempts.get_key_value(key).expect("checked");
        Settled {
            usage: self.usage(usize::from(record.tool)),
            attempt: self.attempt_view(key, record, now),
        }
    }

    /// The attempt under `key`, which exists, as readers see it at `now`.
    fn attempt_at(&self, key: &str, now: Millis) -> Attempt {
        let (key, record) = self.attempts.get_key_value(key).expect("checked");
        self.attempt_view(key, record, now)
    }

    /// The attempt as readers see it at `now` (see [`Attempt::into_observed`]).
    fn attempt_view(&self, key: &str, record: &Record, now: Millis) -> Attempt {
        let detail = record.detail.as_deref();
        Attempt {
            attempt_id: record.attempt_id.to_string(),
            permit_id: self.permit.permit_id.clone(),
            tool: self.permit.tools[usize::from(record.tool)].clone(),
            idempotency_key: key.to_owned(),
            request_fingerprint: record.fingerprint.to_vec(),
            cost: record.cost,
            state: record.state,
            created_at: record.created_at,
            // A pending or denied call has no lease: it was never sent.
            lease_expires_at: match record.state {
                AttemptState::AwaitingApproval | AttemptState::Approved | AttemptState::Denied => 0,
                _ => record.lease_expires_at,
            },
            receipt: record.receipt().cloned(),
            failure_reason: record.failure_reason().to_owned(),
            uncertain_reason: detail
                .map(|d| d.uncertain_reason.clone())
                .unwrap_or_default(),
            uncertain_since: match record.state {
                AttemptState::Uncertain => record.open_at(),
                _ => 0,
            },
            duplicate_of: record.duplicate_of.as_ref().map(|k| k.to_string()),
            reserved_by: self.holders[record.reserved_by as usize].to_string(),
            approval: detail.and_then(|d| d.approval.clone()),
        }
        .into_observed(now)
    }

    /// An attempt that was never sent (RELEASED, DENIED) leaves the
    /// duplicate guard's index: if it is the latest under its (tool,
    /// fingerprint), the earlier live key it was a duplicate of takes its
    /// place.
    fn dup_forget(&mut self, key: &str) {
        let record = &self.attempts[key];
        let dup_hash = self.dup_hash(usize::from(record.tool), &record.fingerprint);
        let fallback = record.duplicate_of.clone();
        if self.dup_index.get(&dup_hash).map(|k| &**k) == Some(key) {
            match fallback {
                Some(earlier) => self.dup_index.insert(dup_hash, earlier),
                None => self.dup_index.remove(&dup_hash),
            };
        }
    }

    /// The duplicate guard's index key: a keyed hash of the tool and the
    /// fingerprint. (The Redis store uses 48 bits of SHA-1 of the two,
    /// lib.lua: dup_field.)
    fn dup_hash(&self, tool: usize, fingerprint: &[u8]) -> u64 {
        self.dup_hasher.hash_one((tool, fingerprint))
    }

    /// The latest attempt dispatched with the same (tool, fingerprint), if
    /// it is not RELEASED and was created within the guard's window (asked
    /// only while the guard is on).
    fn live_duplicate(
        &self,
        dup_hash: u64,
        tool: usize,
        fingerprint: &[u8],
        now: Millis,
    ) -> Option<Key> {
        let key = self.dup_index.get(&dup_hash)?;
        let earlier = self.attempts.get(&**key)?;
        let live = usize::from(earlier.tool) == tool
            && *earlier.fingerprint == *fingerprint
            && match earlier.observed_state(now) {
                AttemptState::Released | AttemptState::Denied => false,
                // Waiting for a person, it is as live as the moment it asked.
                AttemptState::AwaitingApproval | AttemptState::Approved => true,
                _ => now - earlier.created_at < self.permit.duplicate_guard.window_ms,
            };
        live.then(|| key.clone())
    }
}

#[cfg(test)]
mod tests;
