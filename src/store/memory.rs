//! The embedded store: every permit's [`Ledger`] in process memory, behind
//! one lock. It is the reference semantics of atmost and keeps nothing
//! across restarts.

use super::{AFTER_ALL_KEYS, Cursor, MAX_PERMITS_PER_PAGE, Page, Store};
use crate::domain::{
    Attempt, AuthorizeCmd, Authorized, CommitCmd, Error, Ledger, MarkUncertainCmd, Millis, Permit,
    PermitView, ResolveCmd, Settled,
};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Mutex;

/// Every this many new permits, ledgers past retention are dropped.
const PRUNE_EVERY: u64 = 1024;

#[derive(Debug)]
pub struct MemoryStore {
    /// A std mutex: every critical section is a few map operations with no
    /// await inside, so a blocking lock is cheaper than tokio's.
    inner: Mutex<Inner>,
    /// How long finished attempts and the permit are kept past its expiry.
    retention_ms: Millis,
}

#[derive(Debug, Default)]
struct Inner {
    /// Ordered by permit id so cross-permit listings page stably; boxed, so
    /// the tree's nodes move pointers, not ledgers.
    ledgers: BTreeMap<String, Box<Ledger>>,
    created: u64,
}

impl MemoryStore {
    pub fn new(retention_ms: Millis) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            retention_ms,
        }
    }

    fn with_ledger<T>(
        &self,
        permit_id: &str,
        f: impl FnOnce(&mut Ledger) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.ledgers.get_mut(permit_id) {
            Some(ledger) => f(ledger),
            None => Err(Error::PermitNotFound {
                permit_id: permit_id.to_owned(),
            }),
        }
    }
}

impl Inner {
    /// Drops retired ledgers (see [`Ledger::retired`]): RESERVED and
    /// UNCERTAIN attempts never disappear.
    fn prune(&mut self, now: Millis, retention_ms: Millis) {
        self.ledgers.retain(|_, l| !l.retired(now, retention_ms));
    }
}

impl Store for MemoryStore {
    async fn create_permit(&self, permit: Permit) -> Result<Permit, Error> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Ids are fresh UUIDv7s: only a bug gives one twice, and the first
        // permit must not be overwritten (as on Redis).
        if inner.ledgers.contains_key(&permit.permit_id) {
            return Err(Error::StoreUnavailable(format!(
                "permit {} already exists: a permit id given twice",
                permit.permit_id
            )));
        }
        inner.created += 1;
        if inner.created.is_multiple_of(PRUNE_EVERY) {
            inner.prune(permit.created_at, self.retention_ms);
        }
        inner.ledgers.insert(
            permit.permit_id.clone(),
            Box::new(Ledger::new(permit.clone())),
        );
        Ok(permit)
    }

    async fn get_permit(&self, permit_id: &str) -> Result<PermitView, Error> {
        self.with_ledger(permit_id, |l| Ok(l.view()))
    }

    async fn revoke_permit(&self, permit_id: &str) -> Result<Permit, Error> {
        self.with_ledger(permit_id, |l| Ok(l.revoke()))
    }

    async fn authorize(
        &self,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        self.with_ledger(&cmd.permit_id, |l| l.authorize(cmd, now, attempt_id))
    }

    async fn commit(
        &self,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.with_ledger(&cmd.permit_id, |l| l.commit(cmd, now, receipt_id))
    }

    async fn mark_uncertain(&self, cmd: &MarkUncertainCmd, now: Millis) -> Result<Attempt, Error> {
        self.with_ledger(&cmd.permit_id, |l| l.mark_uncertain(cmd, now))
    }

    async fn resolve(
        &self,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.with_ledger(&cmd.permit_id, |l| l.resolve(cmd, now, receipt_id))
    }

    async fn list_uncertain(
        &self,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(id) = permit_id
            && !inner.ledgers.contains_key(id)
        {
            return Err(Error::PermitNotFound {
                permit_id: id.to_owned(),
            });
        }
        let start = match (permit_id, after) {
            (_, Some(c)) => Bound::Included(c.permit_id.as_str()),
            (Some(p), None) => Bound::Included(p),
            (None, None) => Bound::Unbounded,
        };
        let mut page = Page::default();
        let ledgers = inner
            .ledgers
            .range::<str, _>((start, Bound::Unbounded))
            .take_while(|(id, _)| permit_id.is_none_or(|p| p == id.as_str()))
            .take(MAX_PERMITS_PER_PAGE);
        let mut last_permit = None;
        for (id, ledger) in ledgers {
            let after_key = match after {
                Some(c) if c.permit_id == *id => c.idempotency_key.as_str(),
                _ => "",
            };
            let found = ledger.uncertain_after(after_key, limit - page.attempts.len(), now);
            page.attempts.extend(found);
            last_permit = Some(id);
            if page.attempts.len() == limit {
                let last = page.attempts.last().expect("limit > 0");
                page.next = Some(Cursor {
                    permit_id: last.permit_id.clone(),
                    idempotency_key: last.idempotency_key.clone(),
                });
                return Ok(page);
            }
        }
        // The scan stopped short of the end: continue after the last permit.
        if permit_id.is_none()
            && let Some(id) = last_permit
            && inner
                .ledgers
                .range::<str, _>((Bound::Excluded(id.as_str()), Bound::Unbounded))
                .next()
                .is_some()
        {
            page.next = Some(Cursor {
                permit_id: id.clone(),
                idempotency_key: AFTER_ALL_KEYS.to_owned(),
            });
        }
        Ok(page)
    }

    async fn ping(&self) -> Result<(), Error> {
        Ok(())
    }
}
