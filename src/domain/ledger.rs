//! The reference state machine: one permit, its usage and its attempts.
//!
//! Every transition checks everything before it changes anything, so an
//! error leaves the ledger exactly as it was. The Redis scripts in
//! `store/redis/*.lua` implement these same functions step for step.

use super::{
    Attempt, AttemptState, AuthorizeCmd, Authorized, CommitCmd, Decision, Error, GuardMode,
    MAX_AMOUNT, MarkUncertainCmd, Millis, Outcome, Permit, PermitStatus, PermitView, Receipt,
    ResolveCmd, Settled, Usage, invalid,
};
use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
pub struct Ledger {
    permit: Permit,
    /// Slots held per tool.
    calls: HashMap<String, u64>,
    committed: i64,
    reserved: i64,
    /// By idempotency key; ordered so listings page stably.
    attempts: BTreeMap<String, Attempt>,
    /// (tool, fingerprint) -> the latest key dispatched with them,
    /// for the duplicate guard: a pointer, checked against the attempt's
    /// full request on every read, so a stale entry is harmless.
    dup_index: HashMap<(String, Vec<u8>), String>,
    /// When an attempt was last settled: retention runs from the later of
    /// this and the permit's expiry.
    last_settled_at: Millis,
}

/// Who settles an attempt: the caller holding its attempt_id (Commit) or an
/// operator (Resolve), who may only settle what is UNCERTAIN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settler {
    Holder,
    Operator,
}

// === impl Ledger ===

impl Ledger {
    pub fn new(permit: Permit) -> Self {
        Self {
            permit,
            calls: HashMap::new(),
            committed: 0,
            reserved: 0,
            attempts: BTreeMap::new(),
            dup_index: HashMap::new(),
            last_settled_at: 0,
        }
    }

    pub fn permit(&self) -> &Permit {
        &self.permit
    }

    pub fn revoke(&mut self) -> Permit {
        self.permit.status = PermitStatus::Revoked;
        self.permit.clone()
    }

    pub fn view(&self) -> PermitView {
        PermitView {
            permit: self.permit.clone(),
            usage: self.permit.tools.iter().map(|t| self.usage(t)).collect(),
            budget_committed: self.committed,
            budget_reserved: self.reserved,
        }
    }

    pub fn usage(&self, tool: &str) -> Usage {
        Usage {
            tool: tool.to_owned(),
            calls_made: self.calls.get(tool).copied().unwrap_or(0),
            calls_limit: self.permit.max_calls_per_tool.get(tool).copied(),
            budget_remaining: self
                .permit
                .budget
                .map(|b| b - self.committed - self.reserved),
        }
    }

    /// Whether the ledger may be dropped at `now`: no attempt is RESERVED
    /// or UNCERTAIN (those are never dropped), and `retention_ms` has passed
    /// since the permit expired and since its last attempt was settled.
    pub fn retired(&self, now: Millis, retention_ms: Millis) -> bool {
        let since = self.permit.expires_at.max(self.last_settled_at);
        !self.attempts.values().any(|a| a.state.is_open())
            && now >= since.saturating_add(retention_ms)
    }

    /// Attempts UNCERTAIN at `now` (including RESERVED ones past their
    /// lease) whose key sorts after `after`, at most `limit` of them.
    pub fn uncertain_after(&self, after: &str, limit: usize, now: Millis) -> Vec<Attempt> {
        use std::ops::Bound::{Excluded, Unbounded};
        self.attempts
            .range::<str, _>((Excluded(after), Unbounded))
            .filter(|(_, a)| a.observed_state(now) == AttemptState::Uncertain)
            .take(limit)
            .map(|(_, a)| a.observed(now))
            .collect()
    }

    /// The order of checks:
    /// 1. the key exists (and was not released): same request -> REPLAY, or
    ///    IN_PROGRESS while RESERVED within its lease; different -> KEY_REUSED;
    /// 2. a new key: revoked -> expired -> tool in scope -> duplicate guard
    ///    -> cap -> budget; then reserve slot and cost and record the attempt.
    pub fn authorize(
        &mut self,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        if let Some(existing) = self.attempts.get(&cmd.idempotency_key)
            && existing.state != AttemptState::Released
        {
            if !existing.same_request(cmd) {
                return Err(Error::KeyReused {
                    idempotency_key: cmd.idempotency_key.clone(),
                });
            }
            let seen = existing.observed(now);
            if seen.state == AttemptState::Reserved {
                return Err(Error::InProgress {
                    idempotency_key: cmd.idempotency_key.clone(),
                    lease_expires_at: seen.lease_expires_at,
                    retry_after_ms: seen.lease_expires_at - now,
                });
            }
            return Ok(Authorized {
                decision: Decision::Replay,
                usage: self.usage(&seen.tool),
                attempt: seen,
                duplicate_of: None,
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
        if !permit.in_scope(&cmd.tool) {
            return Err(Error::ToolNotInScope {
                tool: cmd.tool.clone(),
            });
        }
        let duplicate_of = self.live_duplicate(&cmd.tool, &cmd.request_fingerprint, now);
        if let Some(earlier_key) = &duplicate_of
            && permit.duplicate_guard.mode == GuardMode::Enforce
        {
            return Err(Error::DuplicateSuspected {
                tool: cmd.tool.clone(),
                earlier_key: earlier_key.clone(),
            });
        }
        let calls_made = self.calls.get(&cmd.tool).copied().unwrap_or(0);
        if let Some(&limit) = permit.max_calls_per_tool.get(&cmd.tool)
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

        // Everything checked: reserve and record in one step.
        let attempt = Attempt {
            attempt_id,
            permit_id: permit.permit_id.clone(),
            tool: cmd.tool.clone(),
            idempotency_key: cmd.idempotency_key.clone(),
            request_fingerprint: cmd.request_fingerprint.clone(),
            cost: cmd.cost,
            state: AttemptState::Reserved,
            created_at: now,
            lease_expires_at: now + permit.lease_ms,
            receipt: None,
            failure_reason: String::new(),
            uncertain_reason: String::new(),
            duplicate_of: duplicate_of.clone(),
        };
        if permit.duplicate_guard.mode != GuardMode::Off {
            self.dup_index.insert(
                dup_key(&cmd.tool, &cmd.request_fingerprint),
                cmd.idempotency_key.clone(),
            );
        }
        *self.calls.entry(cmd.tool.clone()).or_default() += 1;
        self.reserved += cmd.cost;
        self.attempts
            .insert(cmd.idempotency_key.clone(), attempt.clone());
        Ok(Authorized {
            decision: Decision::Dispatch,
            usage: self.usage(&cmd.tool),
            attempt,
            duplicate_of,
        })
    }

    pub fn commit(
        &mut self,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.holder_attempt(&cmd.idempotency_key, &cmd.attempt_id)?;
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
        self.attempt(&cmd.idempotency_key)?;
        self.settle(
            &cmd.idempotency_key,
            &cmd.outcome,
            Settler::Operator,
            now,
            receipt_id,
        )
    }

    /// RESERVED (lease open or not) -> UNCERTAIN; UNCERTAIN stays as it is.
    pub fn mark_uncertain(
        &mut self,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        let attempt = self.holder_attempt(&cmd.idempotency_key, &cmd.attempt_id)?;
        match attempt.state {
            AttemptState::Reserved => {
                let attempt = self
                    .attempts
                    .get_mut(&cmd.idempotency_key)
                    .expect("checked");
                attempt.state = AttemptState::Uncertain;
                attempt.uncertain_reason = cmd.reason.clone();
                Ok(attempt.observed(now))
            }
            AttemptState::Uncertain => Ok(attempt.observed(now)),
            state => Err(Error::StateConflict { state }),
        }
    }

    // --- helpers ---

    fn attempt(&self, key: &str) -> Result<&Attempt, Error> {
        self.attempts
            .get(key)
            .ok_or_else(|| Error::AttemptNotFound {
                idempotency_key: key.to_owned(),
            })
    }

    /// The key's attempt, provided `attempt_id` is its fencing token.
    fn holder_attempt(&self, key: &str, attempt_id: &str) -> Result<&Attempt, Error> {
        let attempt = self.attempt(key)?;
        if attempt.attempt_id != attempt_id {
            return Err(Error::AttemptMismatch {
                idempotency_key: key.to_owned(),
            });
        }
        Ok(attempt)
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
                let receipt = attempt.receipt.as_ref().expect("succeeded has a receipt");
                if receipt.result == *result && receipt.cost == actual_cost.unwrap_or(attempt.cost)
                {
                    return Ok(self.settled(key, now));
                }
                return Err(Error::StateConflict { state });
            }
            Outcome::Failed { reason }
                if state == AttemptState::Failed && attempt.failure_reason == *reason =>
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
                let attempt = self.attempts.get_mut(key).expect("checked");
                attempt.state = AttemptState::Succeeded;
                attempt.receipt = Some(Receipt {
                    receipt_id,
                    result: result.clone(),
                    cost: actual,
                    issued_at: now,
                });
            }
            Outcome::Failed { reason } => {
                self.reserved -= reserved_cost;
                let attempt = self.attempts.get_mut(key).expect("checked");
                attempt.state = AttemptState::Failed;
                attempt.failure_reason = reason.clone();
            }
            Outcome::NotSent => {
                if state != AttemptState::Reserved {
                    // An uncertain call may have left: its slot stays held.
                    return Err(Error::StateConflict { state });
                }
                self.reserved -= reserved_cost;
                let attempt = self.attempts.get_mut(key).expect("checked");
                attempt.state = AttemptState::Released;
                let tool = attempt.tool.clone();
                let index_key = dup_key(&tool, &attempt.request_fingerprint);
                let fallback = attempt.duplicate_of.clone();
                if let Some(calls) = self.calls.get_mut(&tool) {
                    *calls -= 1;
                }
                if self.dup_index.get(&index_key).map(String::as_str) == Some(key) {
                    match fallback {
                        Some(earlier) => self.dup_index.insert(index_key, earlier),
                        None => self.dup_index.remove(&index_key),
                    };
                }
            }
        }
        self.last_settled_at = now;
        Ok(self.settled(key, now))
    }

    fn settled(&self, key: &str, now: Millis) -> Settled {
        let attempt = self.attempts[key].observed(now);
        Settled {
            usage: self.usage(&attempt.tool),
            attempt,
        }
    }

    /// The latest attempt dispatched with the same (tool, fingerprint), if
    /// it is not RELEASED and was created within the guard's window.
    fn live_duplicate(&self, tool: &str, fingerprint: &[u8], now: Millis) -> Option<String> {
        let guard = self.permit.duplicate_guard;
        if guard.mode == GuardMode::Off {
            return None;
        }
        let key = self.dup_index.get(&dup_key(tool, fingerprint))?;
        let earlier = self.attempts.get(key)?;
        let live = earlier.tool == tool
            && earlier.request_fingerprint == fingerprint
            && earlier.state != AttemptState::Released
            && now - earlier.created_at < guard.window_ms;
        live.then(|| key.clone())
    }
}

/// The duplicate guard's index key: the tool and the fingerprint. The Redis
/// store keys its index by a 48-bit hash of the two (lib.lua: dup_field),
/// where a collision can only overwrite a pointer: the guard may then miss
/// a duplicate, never report a false one.
fn dup_key(tool: &str, fingerprint: &[u8]) -> (String, Vec<u8>) {
    (tool.to_owned(), fingerprint.to_vec())
}
