//! The embedded store: every permit's [`Ledger`] in process memory, behind
//! one lock. It is the reference semantics of atmost and keeps nothing
//! across restarts.

use super::{CensusFigures, Cursor, Page, Store};
use crate::domain::{
    ApproveCmd, Attempt, AttemptState, AuthorizeCmd, Authorized, CommitCmd, DenyCmd, Error,
    GetAttemptCmd, Ledger, MarkUncertainCmd, Millis, Permit, PermitView, Quota, Quotas, ResolveCmd,
    Scope, Settled,
};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::{Arc, Mutex};

/// Most forgotten permits one [`Store::sweep`] drops (the lock is held
/// meanwhile).
const SWEEP_BATCH: usize = 1024;

#[derive(Debug)]
pub struct MemoryStore {
    /// A std mutex: every critical section is a few map operations with no
    /// await inside, so a blocking lock is cheaper than tokio's.
    inner: Mutex<Inner>,
    /// How long finished attempts and the permit are kept past its expiry.
    retention_ms: Millis,
    quotas: Quotas,
    /// Past this many bytes ([`Ledger::approx_bytes`] summed), new permits
    /// and new reservations are refused; 0: no limit.
    max_bytes: u64,
}

/// A permit's place in an ordered set: (a time, its id).
type Entry = (Millis, Arc<str>);

/// An open attempt's place in its tenant's index: (when it is or became
/// uncertain, its permit, its key).
type OpenEntry = (Millis, Arc<str>, Arc<str>);

#[derive(Debug, Default)]
struct Inner {
    /// Boxed, so the map moves pointers, not ledgers.
    ledgers: HashMap<Arc<str>, Box<Ledger>>,
    /// Every RESERVED or UNCERTAIN attempt, by tenant (a tenant leaves with
    /// its last one), in ListUncertain's order: those uncertain at `now`
    /// are the range up to `now`, so the cross-permit listing and the
    /// census cost what they count.
    open: BTreeMap<Arc<str>, BTreeSet<OpenEntry>>,
    /// Every attempt AWAITING_APPROVAL, by tenant, in ListApprovals'
    /// order: (created_at, permit, key). One whose request lapsed stays
    /// until its ledger writes the lapse (or is forgotten); the listing
    /// skips it.
    awaiting: BTreeMap<Arc<str>, BTreeSet<OpenEntry>>,
    /// Every permit with nothing open, by when it is forgotten
    /// ([`Ledger::forget_at`]).
    forget: BTreeSet<Entry>,
    /// Every permit not yet expired (and some expired ones not yet pruned),
    /// by tenant, by (expires_at, id): the tenant quota counts these.
    live: HashMap<Arc<str>, BTreeSet<Entry>>,
    /// [`Ledger::approx_bytes`] of every ledger held.
    bytes: usize,
}

impl MemoryStore {
    /// A store with the default [`Quotas`] and no size limit.
    pub fn new(retention_ms: Millis) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            retention_ms,
            quotas: Quotas::DEFAULT,
            max_bytes: 0,
        }
    }

    pub fn with_quotas(mut self, quotas: Quotas) -> Self {
        self.quotas = quotas;
        self
    }

    /// Refuses new permits and new reservations once the store holds about
    /// this many bytes (0: no limit). Nothing open is ever evicted.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// About how many bytes the store holds ([`Ledger::approx_bytes`]).
    pub fn approx_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The size quota's limit, if the store has reached it.
    fn full(&self, inner: &Inner) -> Option<u64> {
        (self.max_bytes != 0 && inner.bytes as u64 >= self.max_bytes).then_some(self.max_bytes)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the permit's ledger at `now`, keeping the forget set
    /// and the open index in step with it: `f` runs at most one ledger
    /// operation that changes state, and the ledger says how that moved an
    /// attempt in its open set. A permit past its retention is forgotten
    /// here, at the same instant the Redis store's keys expire; one outside
    /// the caller's scope answers as if it did not exist.
    fn with_ledger<T>(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
        f: impl FnOnce(&mut Ledger, Option<u64>, Millis) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let not_found = || Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        };
        let id = inner
            .ledgers
            .get_key_value(permit_id)
            .ok_or_else(not_found)?
            .0
            .clone();
        // Whether the store is full, read before the ledger is borrowed.
        let full = self.full(inner);
        let ledger = inner.ledgers.get_mut(&id).expect("just found");
        let before = self.place(ledger);
        if let Some(at) = before
            && now > at
        {
            inner.forget.remove(&(at, id.clone()));
            let forgotten = inner.ledgers.remove(&id);
            if let Some(ledger) = &forgotten {
                inner.forgotten(ledger, &id);
            }
            drop(guard);
            drop(forgotten); // freed outside the lock
            return Err(not_found());
        }
        if !ledger.permit().visible_to(scope) {
            return Err(not_found());
        }
        let bytes = ledger.approx_bytes();
        let out = f(ledger, full, now);
        inner.bytes = inner.bytes - bytes + ledger.approx_bytes();
        let after = self.place(ledger);
        if after != before {
            if let Some(at) = before {
                inner.forget.remove(&(at, id.clone()));
            }
            if let Some(at) = after {
                inner.forget.insert((at, id.clone()));
            }
        }
        // The cross-permit indexes follow the ledger's sets: for the open
        // set, the entry its operation removed, then the one it added.
        let change = ledger.take_open_change();
        let awaiting = ledger.take_awaiting_change();
        let tenant = ledger.permit().tenant.as_str();
        if let Some((at, key)) = change.removed {
            index_move(&mut inner.open, tenant, false, (at, id.clone(), key));
        }
        if let Some((at, key)) = change.added {
            index_move(&mut inner.open, tenant, true, (at, id.clone(), key));
        }
        for (added, at, key) in awaiting {
            index_move(&mut inner.awaiting, tenant, added, (at, id.clone(), key));
        }
        out
    }

    /// When the permit is forgotten; `None` while an attempt is open.
    fn place(&self, ledger: &Ledger) -> Option<Millis> {
        ledger.forget_at(self.retention_ms)
    }
}

/// Adds an entry to (or removes one from) a tenant's set of a per-tenant
/// index; a tenant leaves the index with its last entry.
fn index_move(
    index: &mut BTreeMap<Arc<str>, BTreeSet<OpenEntry>>,
    tenant: &str,
    added: bool,
    entry: OpenEntry,
) {
    if added {
        match index.get_mut(tenant) {
            Some(set) => {
                set.insert(entry);
            }
            None => {
                index.insert(Arc::from(tenant), BTreeSet::from([entry]));
            }
        }
    } else if let Some(set) = index.get_mut(tenant) {
        set.remove(&entry);
        if set.is_empty() {
            index.remove(tenant);
        }
    }
}

impl Inner {
    /// Drops a forgotten ledger's share of the accounting.
    fn forgotten(&mut self, ledger: &Ledger, id: &Arc<str>) {
        self.bytes -= ledger.approx_bytes();
        let permit = ledger.permit();
        // Requests that lapsed unwritten leave the approvals index with it.
        for (at, key) in ledger.awaiting() {
            let entry = (*at, id.clone(), key.clone());
            index_move(&mut self.awaiting, &permit.tenant, false, entry);
        }
        if let Some(live) = self.live.get_mut(permit.tenant.as_str()) {
            live.remove(&(permit.expires_at, id.clone()));
            if live.is_empty() {
                self.live.remove(permit.tenant.as_str());
            }
        }
    }
}

impl Store for MemoryStore {
    async fn create_permit(&self, permit: Permit) -> Result<Permit, Error> {
        let mut inner = self.lock();
        // Ids are fresh UUIDv7s: only a bug gives one twice, and the first
        // permit must not be overwritten (as on Redis).
        if inner.ledgers.contains_key(permit.permit_id.as_str()) {
            return Err(Error::StoreUnavailable(format!(
                "permit {} already exists: a permit id given twice",
                permit.permit_id
            )));
        }
        let now = permit.created_at;
        self.quotas.check_lifetime(&permit, now)?;
        if let Some(limit) = self.full(&inner) {
            return Err(Error::QuotaExceeded {
                quota: Quota::StoreFull,
                limit,
            });
        }
        let tenant: Arc<str> = Arc::from(permit.tenant.as_str());
        let live = inner.live.entry(tenant.clone()).or_default();
        while live.first().is_some_and(|(exp, _)| *exp <= now) {
            live.pop_first();
        }
        if let Err(e) = self.quotas.check_tenant(live.len()) {
            if live.is_empty() {
                inner.live.remove(&tenant);
            }
            return Err(e);
        }
        let id: Arc<str> = Arc::from(permit.permit_id.as_str());
        live.insert((permit.expires_at, id.clone()));
        let ledger = Box::new(Ledger::new(permit.clone()));
        if let Some(at) = self.place(&ledger) {
            inner.forget.insert((at, id.clone()));
        }
        inner.bytes += ledger.approx_bytes();
        inner.ledgers.insert(id.clone(), ledger);
        Ok(permit)
    }

    async fn get_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<PermitView, Error> {
        self.with_ledger(scope, permit_id, now, |l, _, now| Ok(l.view(now)))
    }

    async fn revoke_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<Permit, Error> {
        self.with_ledger(scope, permit_id, now, |l, _, now| Ok(l.revoke(now)))
    }

    async fn get_attempt(
        &self,
        scope: &Scope,
        cmd: &GetAttemptCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.get_attempt(&cmd.idempotency_key, now)
        })
    }

    async fn authorize(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, full, now| {
            l.authorize(scope, cmd, now, attempt_id, &self.quotas, full)
        })
    }

    async fn commit(
        &self,
        scope: &Scope,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.commit(scope, cmd, now, receipt_id)
        })
    }

    async fn mark_uncertain(
        &self,
        scope: &Scope,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.mark_uncertain(scope, cmd, now)
        })
    }

    async fn resolve(
        &self,
        scope: &Scope,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.resolve(cmd, now, receipt_id)
        })
    }

    async fn list_uncertain(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        if let Some(id) = permit_id {
            let after = after.and_then(|c| c.attempt_in(id));
            let attempts = self.with_ledger(scope, id, now, |l, _, now| {
                Ok(l.uncertain_after(after, limit, now))
            })?;
            return Ok(full_page(attempts, limit, Cursor::after));
        }

        // Across permits: the tenant's open index, up to `now`.
        let inner = self.lock();
        let mut page = Page::default();
        let Some(open) = inner.open.get(scope.tenant.as_str()) else {
            return Ok(page);
        };
        let start = match after {
            Some(c) => Bound::Excluded((
                c.at,
                Arc::from(c.permit_id.as_str()),
                Arc::from(c.idempotency_key.as_str()),
            )),
            None => Bound::Unbounded,
        };
        for (_, id, key) in open
            .range((start, Bound::Unbounded))
            .take_while(|(at, _, _)| *at <= now)
        {
            let ledger = inner.ledgers.get(id).ok_or_else(|| {
                Error::StoreUnavailable(format!("permit {id} is listed as open but has no ledger"))
            })?;
            if !ledger.permit().visible_to(scope) {
                continue;
            }
            let attempt = ledger.get_attempt(key, now)?;
            page.attempts.push(attempt);
            if page.attempts.len() == limit {
                return Ok(full_page(page.attempts, limit, Cursor::after));
            }
        }
        Ok(page)
    }

    async fn approve(
        &self,
        scope: &Scope,
        cmd: &ApproveCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.approve(scope, cmd, now)
        })
    }

    async fn deny(&self, scope: &Scope, cmd: &DenyCmd, now: Millis) -> Result<Settled, Error> {
        self.with_ledger(scope, &cmd.permit_id, now, |l, _, now| {
            l.deny(scope, cmd, now)
        })
    }

    async fn list_approvals(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        if let Some(id) = permit_id {
            let after = after.and_then(|c| c.attempt_in(id));
            let attempts = self.with_ledger(scope, id, now, |l, _, now| {
                l.write_lapses(now);
                Ok(l.awaiting_after(after, limit, now))
            })?;
            return Ok(full_page(attempts, limit, Cursor::after_request));
        }
        // Across permits: the tenant's approvals index. A request that
        // lapsed is skipped, and its ledger writes its lapses after the
        // page, which takes them out of the index: each is passed over
        // once, so listings cost what they return.
        let mut guard = self.lock();
        let inner = &mut *guard;
        let mut attempts = Vec::new();
        let mut lapsed = BTreeSet::new();
        if let Some(awaiting) = inner.awaiting.get(scope.tenant.as_str()) {
            let start = match after {
                Some(c) => Bound::Excluded((
                    c.at,
                    Arc::from(c.permit_id.as_str()),
                    Arc::from(c.idempotency_key.as_str()),
                )),
                None => Bound::Unbounded,
            };
            for (_, id, key) in awaiting.range((start, Bound::Unbounded)) {
                let ledger = inner.ledgers.get(id).ok_or_else(|| {
                    Error::StoreUnavailable(format!(
                        "permit {id} is listed as awaiting but has no ledger"
                    ))
                })?;
                if !ledger.permit().visible_to(scope) {
                    continue;
                }
                let attempt = ledger.get_attempt(key, now)?;
                if attempt.state != AttemptState::AwaitingApproval {
                    lapsed.insert(id.clone());
                    continue;
                }
                attempts.push(attempt);
                if attempts.len() == limit {
                    break;
                }
            }
        }
        for id in lapsed {
            let Some(ledger) = inner.ledgers.get_mut(&id) else {
                continue;
            };
            let bytes = ledger.approx_bytes();
            ledger.write_lapses(now);
            inner.bytes = inner.bytes - bytes + ledger.approx_bytes();
            let tenant = ledger.permit().tenant.clone();
            for (added, at, key) in ledger.take_awaiting_change() {
                index_move(&mut inner.awaiting, &tenant, added, (at, id.clone(), key));
            }
        }
        Ok(full_page(attempts, limit, Cursor::after_request))
    }

    async fn sweep(&self, now: Millis) -> Result<usize, Error> {
        let mut inner = self.lock();
        let mut dropped = Vec::new();
        while dropped.len() < SWEEP_BATCH
            && let Some((at, id)) = inner.forget.first().cloned()
            && now > at
        {
            inner.forget.pop_first();
            if let Some(ledger) = inner.ledgers.remove(&id) {
                inner.forgotten(&ledger, &id);
                dropped.push(ledger);
            }
        }
        drop(inner);
        // Freed outside the lock: a large ledger takes a while.
        Ok(dropped.len())
    }

    async fn ping(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Counts, tenant by tenant, the open index up to `now` (one process:
    /// no figures to share).
    async fn census(
        &self,
        now: Millis,
        _interval: std::time::Duration,
    ) -> Result<CensusFigures, Error> {
        let inner = self.lock();
        let mut figures = CensusFigures::default();
        for open in inner.open.values() {
            let mut uncertain = open.iter().take_while(|(at, _, _)| *at <= now);
            if let Some((since, _, _)) = uncertain.next() {
                figures.uncertain += 1 + uncertain.count() as u64;
                figures.oldest_age_ms = figures.oldest_age_ms.max(now - since);
            }
        }
        Ok(figures)
    }
}

/// A page of attempts; a full one continues after its last, at the
/// position `cursor` gives it.
pub(super) fn full_page(
    attempts: Vec<Attempt>,
    limit: usize,
    cursor: fn(&Attempt) -> Cursor,
) -> Page {
    let next = (attempts.len() == limit)
        .then(|| attempts.last())
        .flatten()
        .map(cursor);
    Page { attempts, next }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{DuplicateGuard, GuardMode, PermitStatus, UncertainPolicy, new_id};

    const T0: Millis = 1_800_000_000_000;
    const RETENTION: Millis = 1_000;

    fn permit(n: u128) -> Permit {
        Permit {
            permit_id: uuid::Uuid::from_u128(n).to_string(),
            subject: String::new(),
            tools: vec!["t".into()],
            max_calls_per_tool: Default::default(),
            budget: None,
            currency: String::new(),
            expires_at: T0 + 10,
            lease_ms: 5,
            duplicate_guard: DuplicateGuard {
                mode: GuardMode::Off,
                window_ms: 1,
            },
            uncertain_policy: UncertainPolicy::Count,
            status: PermitStatus::Active,
            created_at: T0,
            tenant: String::new(),
            agents: Vec::new(),
            approval_per_tool: Default::default(),
        }
    }

    /// (ledgers, open attempts, permits to forget).
    fn held(store: &MemoryStore) -> (usize, usize, usize) {
        let inner = store.lock();
        let open = inner.open.values().map(BTreeSet::len).sum();
        (inner.ledgers.len(), open, inner.forget.len())
    }

    /// The sweep drops forgotten ledgers from memory, never one with an
    /// open attempt, and keeps the two sets in step with the ledgers.
    #[tokio::test]
    async fn the_sweep_drops_forgotten_permits_and_keeps_open_ones() {
        let store = MemoryStore::new(RETENTION);
        for n in 0..3 {
            store.create_permit(permit(n)).await.expect("create");
        }
        let cmd = AuthorizeCmd {
            permit_id: permit(0).permit_id,
            tool: "t".into(),
            idempotency_key: "k".into(),
            request_fingerprint: vec![1],
            cost: 0,
            holder_token: Vec::new(),
            approval_summary: String::new(),
        };
        store
            .authorize(&Scope::default(), &cmd, T0, new_id(T0))
            .await
            .expect("authorize");
        assert_eq!(held(&store), (3, 1, 2));
        let forget_at = T0 + 10 + RETENTION;
        assert_eq!(store.sweep(forget_at).await, Ok(0));
        assert_eq!(store.sweep(forget_at + 1).await, Ok(2));
        assert_eq!(held(&store), (1, 1, 0));
        // The open one is still there, listed across permits once its lease
        // has passed.
        let page = store
            .list_uncertain(&Scope::default(), None, None, 10, forget_at + 1)
            .await
            .expect("list");
        assert_eq!(page.attempts.len(), 1);
        assert_eq!(page.next, None);
    }

    /// Once the requester was told its request lapsed (its Authorize
    /// wrote the lapse), an Approve whose clock was read a moment earlier
    /// and runs later cannot revive it.
    #[tokio::test]
    async fn a_late_approve_cannot_revive_a_lapse_another_reader_saw() {
        use crate::domain::{ApprovalRule, ApproveCmd, AttemptState};
        let store = MemoryStore::new(RETENTION);
        let mut p = permit(7);
        p.expires_at = T0 + 100_000;
        p.approval_per_tool.insert(
            "t".into(),
            ApprovalRule {
                cost_at_least: None,
                wait_ms: 1_000,
                approvers: 1,
            },
        );
        let permit_id = store.create_permit(p).await.expect("create").permit_id;
        let cmd = AuthorizeCmd {
            permit_id: permit_id.clone(),
            tool: "t".into(),
            idempotency_key: "k".into(),
            request_fingerprint: vec![1],
            cost: 0,
            holder_token: Vec::new(),
            approval_summary: String::new(),
        };
        let asked = store
            .authorize(&Scope::default(), &cmd, T0, new_id(T0))
            .await
            .expect("asked");
        // The requester asks again at the deadline: its denial, replayed.
        let seen = store
            .authorize(&Scope::default(), &cmd, T0 + 1_000, new_id(T0 + 1_000))
            .await
            .expect("asked again");
        assert_eq!(seen.attempt.state, AttemptState::Denied);
        let approve = ApproveCmd {
            permit_id,
            idempotency_key: "k".into(),
            attempt_id: asked.attempt.attempt_id,
        };
        assert_eq!(
            store.approve(&Scope::default(), &approve, T0 + 999).await,
            Err(Error::StateConflict {
                state: AttemptState::Denied
            })
        );
    }
}
