//! Unit tests of the reference state machine, on one [`Ledger`] with time
//! passed in: no store, no server, no clock. Every command goes through
//! [`Bench::run`], which checks that a refused command left the ledger
//! exactly as it was (its view, every attempt as stored, the duplicate
//! guard's index and the retention mark).
//!
//! The same rules are held over gRPC on both stores by `tests/behaviour.rs`
//! and against the Redis scripts by `tests/model.rs`.

use super::*;
use crate::domain::{DuplicateGuard, LEASE_EXPIRED};
use std::collections::BTreeMap;

const T0: Millis = 1_800_000_000_000;
const LEASE: Millis = 30_000;
const WINDOW: Millis = 60_000;
const LIFETIME: Millis = 3_600_000;
const RETENTION: Millis = 86_400_000;

/// Tools "t" and "u", no caps, no budget, guard LOG (the default).
fn permit() -> Permit {
    Permit {
        permit_id: "0190f3a2-7b1c-7d4e-8f00-0123456789ab".into(),
        subject: "unit".into(),
        tools: vec!["t".into(), "u".into()],
        max_calls_per_tool: BTreeMap::new(),
        budget: None,
        currency: "EUR".into(),
        expires_at: T0 + LIFETIME,
        lease_ms: LEASE,
        duplicate_guard: DuplicateGuard {
            mode: GuardMode::Log,
            window_ms: WINDOW,
        },
        uncertain_policy: UncertainPolicy::Count,
        status: PermitStatus::Active,
        created_at: T0,
        tenant: String::new(),
        agents: Vec::new(),
        approval_per_tool: BTreeMap::new(),
    }
}

fn cap(p: &mut Permit, tool: &str, n: u64) {
    p.max_calls_per_tool.insert(tool.into(), n);
}

fn guard(p: &mut Permit, mode: GuardMode) {
    p.duplicate_guard.mode = mode;
}

fn succeeded(result: &str, actual_cost: Option<i64>) -> Outcome {
    Outcome::Succeeded {
        result: result.as_bytes().to_vec(),
        actual_cost,
    }
}

fn failed(reason: &str) -> Outcome {
    Outcome::Failed {
        reason: reason.into(),
    }
}

fn conflict(state: AttemptState) -> Error {
    Error::StateConflict { state }
}

/// Everything a command could change: the view (permit, calls, caps,
/// committed, reserved), every attempt as stored (the lease not applied),
/// the duplicate guard's index, the open and held sets and the retention
/// mark.
#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    view: PermitView,
    attempts: BTreeMap<String, Attempt>,
    dup_index: BTreeMap<u64, String>,
    open: Vec<(Millis, String)>,
    held: Vec<Vec<(Millis, String)>>,
    last_settled_at: Millis,
}

fn entries(set: &BTreeSet<(Millis, Key)>) -> Vec<(Millis, String)> {
    set.iter().map(|(at, key)| (*at, key.to_string())).collect()
}

fn snapshot(ledger: &Ledger) -> Snapshot {
    Snapshot {
        view: ledger.view(0),
        // Seen at the dawn of time, no lease has passed: the stored state.
        attempts: ledger
            .attempts
            .iter()
            .map(|(key, record)| {
                (
                    key.to_string(),
                    ledger.attempt_view(key, record, Millis::MIN),
                )
            })
            .collect(),
        dup_index: ledger
            .dup_index
            .iter()
            .map(|(hash, key)| (*hash, key.to_string()))
            .collect(),
        open: entries(&ledger.open),
        held: ledger.held.iter().map(entries).collect(),
        last_settled_at: ledger.last_settled_at,
    }
}

/// One ledger, the time of the next command, and fresh ids.
struct Bench {
    ledger: Ledger,
    now: Millis,
    ids: u32,
    /// Who calls the Gate's commands (default: dev mode, not limited).
    caller: Scope,
}

impl Bench {
    fn new() -> Self {
        Self::with(|_| {})
    }

    fn with(edit: impl FnOnce(&mut Permit)) -> Self {
        let mut p = permit();
        edit(&mut p);
        Self {
            ledger: Ledger::new(p),
            now: T0,
            ids: 0,
            caller: Scope::default(),
        }
    }

    /// "t" capped at one call, a budget of 10: where a held slot and held
    /// money both show.
    fn one_call_and_ten() -> Self {
        Self::with(|p| {
            cap(p, "t", 1);
            p.budget = Some(10);
        })
    }

    fn advance(&mut self, ms: Millis) {
        self.now += ms;
    }

    fn at(&mut self, now: Millis) {
        self.now = now;
    }

    /// The next commands come from agent key `key_id` (limited by the
    /// permit's agents list, as the Gate's agent keys are).
    fn as_agent(&mut self, key_id: &str) {
        self.caller = Scope {
            tenant: String::new(),
            agent: Some(key_id.into()),
            key_id: key_id.into(),
        };
    }

    /// The next commands come from an admin key, which no agents list
    /// limits.
    fn as_admin(&mut self, key_id: &str) {
        self.caller = Scope {
            tenant: String::new(),
            agent: None,
            key_id: key_id.into(),
        };
    }

    /// `attempt-1`, `receipt-2`, ...: each command gets the next number.
    fn fresh(&mut self, kind: &str) -> String {
        self.ids += 1;
        format!("{kind}-{}", self.ids)
    }

    fn permit_id(&self) -> String {
        self.ledger.permit().permit_id.clone()
    }

    /// Runs one command at `now`: a refused one must change nothing.
    fn run<T>(
        &mut self,
        command: impl FnOnce(&mut Ledger, Millis) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let before = snapshot(&self.ledger);
        let awaiting_before = entries(&self.ledger.awaiting);
        // With calls pending, those whose approval lapses by `now` read
        // DENIED before the command as after it: a refused command may
        // write that (Ledger::lapse), and nothing else.
        let lapsed = (!self.ledger.pending.is_empty()).then(|| {
            let mut ledger = self.ledger.clone();
            ledger.lapse(self.now);
            ledger.take_awaiting_change();
            snapshot(&ledger)
        });
        let result = command(&mut self.ledger, self.now);
        if let Err(e) = &result {
            assert_eq!(
                snapshot(&self.ledger),
                lapsed.unwrap_or_else(|| before.clone()),
                "refused with {e:?}, yet the ledger changed"
            );
        }
        // The awaiting change says how the awaiting set moved (the memory
        // store's approvals index follows it).
        let mut mirrored = awaiting_before;
        for (added, at, key) in self.ledger.take_awaiting_change() {
            let entry = (at, key.to_string());
            if added {
                mirrored.push(entry);
                mirrored.sort();
            } else {
                assert!(mirrored.contains(&entry), "removed {entry:?}, not awaiting");
                mirrored.retain(|e| *e != entry);
            }
        }
        assert_eq!(
            mirrored,
            entries(&self.ledger.awaiting),
            "the awaiting change"
        );
        // The open change says exactly how the open set moved (the memory
        // store's cross-permit index follows it): applied to the set
        // before, it gives the set after.
        let change = self.ledger.take_open_change();
        let mut mirrored = before.open.clone();
        if let Some((at, key)) = &change.removed {
            let entry = (*at, key.to_string());
            assert!(mirrored.contains(&entry), "removed {entry:?}, not open");
            mirrored.retain(|e| *e != entry);
        }
        if let Some((at, key)) = &change.added {
            mirrored.push((*at, key.to_string()));
            mirrored.sort();
        }
        assert_eq!(
            mirrored,
            entries(&self.ledger.open),
            "the open change {change:?} is not how the open set moved"
        );
        assert_eq!(self.ledger.take_open_change(), OpenChange::default());
        result
    }

    fn authorize(
        &mut self,
        tool: &str,
        key: &str,
        fp: &str,
        cost: i64,
    ) -> Result<Authorized, Error> {
        self.authorize_as(tool, key, fp, cost, "")
    }

    /// Authorize with a holder token ("" for none).
    fn authorize_as(
        &mut self,
        tool: &str,
        key: &str,
        fp: &str,
        cost: i64,
        token: &str,
    ) -> Result<Authorized, Error> {
        let cmd = AuthorizeCmd {
            permit_id: self.permit_id(),
            tool: tool.into(),
            idempotency_key: key.into(),
            request_fingerprint: fp.as_bytes().to_vec(),
            cost,
            holder_token: token.as_bytes().to_vec(),
            approval_summary: String::new(),
        };
        let id = self.fresh("attempt");
        let caller = self.caller.clone();
        self.run(|l, now| l.authorize(&caller, &cmd, now, id, &Quotas::UNLIMITED, None))
    }

    /// Authorize, which must answer DISPATCH.
    fn dispatch(&mut self, tool: &str, key: &str, fp: &str, cost: i64) -> Attempt {
        let r = self
            .authorize(tool, key, fp, cost)
            .unwrap_or_else(|e| panic!("{key}: {e:?}"));
        assert_eq!(r.decision, Decision::Dispatch, "{key}");
        r.attempt
    }

    fn commit(&mut self, a: &Attempt, outcome: Outcome) -> Result<Settled, Error> {
        self.commit_as(&a.idempotency_key, &a.attempt_id, outcome)
    }

    fn commit_as(
        &mut self,
        key: &str,
        attempt_id: &str,
        outcome: Outcome,
    ) -> Result<Settled, Error> {
        let cmd = CommitCmd {
            permit_id: self.permit_id(),
            idempotency_key: key.into(),
            attempt_id: attempt_id.into(),
            outcome,
        };
        let id = self.fresh("receipt");
        let caller = self.caller.clone();
        self.run(|l, now| l.commit(&caller, &cmd, now, id))
    }

    fn mark(&mut self, a: &Attempt, reason: &str) -> Result<Attempt, Error> {
        self.mark_as(&a.idempotency_key, &a.attempt_id, reason)
    }

    fn mark_as(&mut self, key: &str, attempt_id: &str, reason: &str) -> Result<Attempt, Error> {
        let cmd = MarkUncertainCmd {
            permit_id: self.permit_id(),
            idempotency_key: key.into(),
            attempt_id: attempt_id.into(),
            reason: reason.into(),
        };
        let caller = self.caller.clone();
        self.run(|l, now| l.mark_uncertain(&caller, &cmd, now))
    }

    fn resolve(&mut self, key: &str, outcome: Outcome) -> Result<Settled, Error> {
        self.resolve_attempt(key, "", outcome)
    }

    /// Resolve naming the reconciled attempt ("" for whichever the key holds).
    fn resolve_attempt(
        &mut self,
        key: &str,
        attempt_id: &str,
        outcome: Outcome,
    ) -> Result<Settled, Error> {
        let cmd = ResolveCmd {
            permit_id: self.permit_id(),
            idempotency_key: key.into(),
            attempt_id: attempt_id.into(),
            outcome,
        };
        let id = self.fresh("receipt");
        self.run(|l, now| l.resolve(&cmd, now, id))
    }

    /// (committed, reserved)
    fn budget(&self) -> (i64, i64) {
        let v = self.ledger.view(self.now);
        (v.budget_committed, v.budget_reserved)
    }

    fn usage(&self, tool: &str) -> Usage {
        let v = self.ledger.view(self.now);
        v.usage
            .into_iter()
            .find(|u| u.tool == tool)
            .expect("a tool in scope")
    }

    fn calls(&self, tool: &str) -> u64 {
        self.usage(tool).calls_made
    }

    fn max_calls(&self, tool: &str) -> Error {
        let usage = self.usage(tool);
        Error::MaxCallsExceeded {
            tool: tool.into(),
            limit: usage.calls_limit.expect("a capped tool"),
            calls_made: usage.calls_made,
        }
    }

    /// The attempt under `key` as stored (no lease applied).
    fn stored(&self, key: &str) -> Attempt {
        self.ledger.attempt_at(key, Millis::MIN)
    }
}

// === Authorize: an existing key ===

#[test]
fn a_fresh_key_dispatches_and_reserves_a_slot_and_its_cost() {
    let mut b = Bench::with(|p| p.budget = Some(10));
    b.advance(5);
    let r = b.authorize("t", "k", "fp", 4).expect("authorize");
    assert_eq!((r.decision, r.duplicate_of), (Decision::Dispatch, None));
    let a = r.attempt;
    assert_eq!(a.attempt_id, "attempt-1", "the id it was given");
    assert_eq!(
        (a.tool.as_str(), a.idempotency_key.as_str(), a.cost),
        ("t", "k", 4)
    );
    assert_eq!(a.request_fingerprint, b"fp");
    assert_eq!(a.state, AttemptState::Reserved);
    assert_eq!((a.created_at, a.lease_expires_at), (T0 + 5, T0 + 5 + LEASE));
    assert_eq!(a.receipt, None);
    assert_eq!(
        r.usage,
        Usage {
            tool: "t".into(),
            calls_made: 1,
            calls_limit: None,
            budget_remaining: Some(6),
        }
    );
    assert_eq!(b.budget(), (0, 4));
    assert_eq!(b.calls("u"), 0, "the slot is the tool's own");
    assert_eq!(b.stored("k"), a);
}

#[test]
fn the_same_request_replays_a_succeeded_attempt_with_its_receipt() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 5);
    let done = b.commit(&a, succeeded("ok", Some(3))).expect("commit");
    b.advance(1_000);
    let r = b.authorize("t", "k", "fp", 5).expect("replay");
    assert_eq!(r.decision, Decision::Replay);
    assert_eq!(r.attempt, done.attempt);
    assert_eq!(r.attempt.receipt.expect("a receipt").result, b"ok");
    assert_eq!(r.usage, done.usage, "a replay takes no slot");
    assert_eq!(b.budget(), (3, 0));
}

#[test]
fn the_same_request_replays_failed_and_uncertain_attempts_as_they_stand() {
    let mut b = Bench::new();
    let declined = b.dispatch("t", "declined", "1", 1);
    b.commit(&declined, failed("card declined"))
        .expect("failed");
    let lost = b.dispatch("t", "lost", "2", 1);
    b.mark(&lost, "deadline").expect("mark");
    b.dispatch("t", "late", "3", 1);
    b.advance(LEASE);
    for (key, fp, state, reason) in [
        ("declined", "1", AttemptState::Failed, ""),
        ("lost", "2", AttemptState::Uncertain, "deadline"),
        ("late", "3", AttemptState::Uncertain, LEASE_EXPIRED),
    ] {
        let before = snapshot(&b.ledger);
        let r = b.authorize("t", key, fp, 1).expect("replay");
        assert_eq!(
            (r.decision, r.attempt.state),
            (Decision::Replay, state),
            "{key}"
        );
        assert_eq!(r.attempt.uncertain_reason, reason, "{key}");
        assert_eq!(snapshot(&b.ledger), before, "a replay changes nothing");
    }
    assert_eq!(b.stored("declined").failure_reason, "card declined");
    assert_eq!(b.calls("t"), 3);
}

#[test]
fn the_same_request_is_in_progress_while_reserved_within_its_lease() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 1);
    let in_progress = |retry_after_ms| Error::InProgress {
        idempotency_key: "k".into(),
        lease_expires_at: T0 + LEASE,
        retry_after_ms,
    };
    b.advance(10_000);
    assert_eq!(b.authorize("t", "k", "fp", 1), Err(in_progress(20_000)));
    b.at(a.lease_expires_at - 1);
    assert_eq!(b.authorize("t", "k", "fp", 1), Err(in_progress(1)));
    // The instant the lease passes it is UNCERTAIN: replayed, not in progress.
    b.at(a.lease_expires_at);
    let r = b.authorize("t", "k", "fp", 1).expect("replay");
    assert_eq!(
        (r.decision, r.attempt.state),
        (Decision::Replay, AttemptState::Uncertain)
    );
}

#[test]
fn a_used_key_with_another_tool_fingerprint_or_cost_is_key_reused() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 1);
    let reused = |b: &mut Bench| {
        for (tool, fp, cost) in [("u", "fp", 1), ("t", "other", 1), ("t", "fp", 2)] {
            assert_eq!(
                b.authorize(tool, "k", fp, cost),
                Err(Error::KeyReused {
                    idempotency_key: "k".into()
                }),
                "{tool} {fp} {cost}"
            );
        }
    };
    reused(&mut b);
    b.commit(&a, succeeded("ok", None)).expect("commit");
    reused(&mut b);
}

// === Authorize: the order of checks for a new key ===

#[test]
fn revoked_is_checked_before_expired() {
    let mut b = Bench::new();
    b.ledger.revoke(b.now);
    b.at(T0 + LIFETIME);
    assert_eq!(
        b.authorize("nope", "k", "fp", 0),
        Err(Error::PermitRevoked {
            permit_id: b.permit_id()
        })
    );
}

#[test]
fn expired_is_checked_before_scope_from_the_instant_of_expiry() {
    let mut b = Bench::new();
    b.at(T0 + LIFETIME - 1);
    b.dispatch("t", "k1", "fp", 0);
    b.at(T0 + LIFETIME);
    assert_eq!(
        b.authorize("nope", "k2", "fp", 0),
        Err(Error::PermitExpired {
            permit_id: b.permit_id(),
            expired_at: T0 + LIFETIME,
        })
    );
}

/// A guard or a cap can only be hit by a tool in scope, so this is as far
/// as the pair can be told apart: an out-of-scope tool with the fingerprint
/// of a live attempt under ENFORCE, the budget spent, is out of scope.
#[test]
fn scope_is_checked_before_the_duplicate_guard() {
    let mut b = Bench::with(|p| {
        guard(p, GuardMode::Enforce);
        p.budget = Some(1);
    });
    b.dispatch("t", "k1", "fp", 1);
    assert_eq!(
        b.authorize("nope", "k2", "fp", 1),
        Err(Error::ToolNotInScope {
            tool: "nope".into()
        })
    );
}

#[test]
fn the_duplicate_guard_is_checked_before_the_cap() {
    let mut b = Bench::with(|p| {
        guard(p, GuardMode::Enforce);
        cap(p, "t", 1);
    });
    b.dispatch("t", "k1", "fp", 0);
    assert_eq!(
        b.authorize("t", "k2", "fp", 0),
        Err(Error::DuplicateSuspected {
            tool: "t".into(),
            earlier_key: "k1".into(),
        })
    );
}

#[test]
fn the_cap_is_checked_before_the_budget() {
    let mut b = Bench::with(|p| {
        cap(p, "t", 1);
        p.budget = Some(1);
    });
    b.dispatch("t", "k1", "1", 1);
    assert_eq!(
        b.authorize("t", "k2", "2", 5),
        Err(Error::MaxCallsExceeded {
            tool: "t".into(),
            limit: 1,
            calls_made: 1,
        })
    );
}

#[test]
fn the_budget_is_checked_last_and_may_be_spent_to_the_last_unit() {
    let mut b = Bench::with(|p| p.budget = Some(10));
    let a = b.dispatch("t", "k1", "1", 6);
    assert_eq!(
        b.authorize("t", "k2", "2", 5),
        Err(Error::BudgetExceeded {
            budget: 10,
            committed: 0,
            reserved: 6,
            requested: 5,
        })
    );
    b.commit(&a, succeeded("", Some(2))).expect("commit");
    b.dispatch("t", "k2", "2", 8);
    assert_eq!(b.usage("t").budget_remaining, Some(0));
    assert_eq!(
        b.authorize("t", "k3", "3", 1),
        Err(Error::BudgetExceeded {
            budget: 10,
            committed: 2,
            reserved: 8,
            requested: 1,
        })
    );
    b.dispatch("t", "k3", "3", 0);
}

#[test]
fn an_existing_key_is_answered_before_any_permit_check() {
    // The lease outlives the permit, so an attempt is still in flight when
    // the permit expires.
    let mut b = Bench::with(|p| {
        cap(p, "t", 2);
        p.lease_ms = 2 * LIFETIME;
    });
    let done = b.dispatch("t", "done", "1", 0);
    let done = b.commit(&done, succeeded("ok", None)).expect("commit");
    let open = b.dispatch("t", "open", "2", 0);
    let answered = |b: &mut Bench, new_key: Error| {
        let r = b.authorize("t", "done", "1", 0).expect("replay");
        assert_eq!((r.decision, &r.attempt), (Decision::Replay, &done.attempt));
        assert_eq!(
            b.authorize("t", "open", "2", 0),
            Err(Error::InProgress {
                idempotency_key: "open".into(),
                lease_expires_at: open.lease_expires_at,
                retry_after_ms: open.lease_expires_at - b.now,
            })
        );
        assert_eq!(
            b.authorize("t", "open", "other", 0),
            Err(Error::KeyReused {
                idempotency_key: "open".into()
            })
        );
        assert_eq!(b.authorize("t", "new", "3", 0), Err(new_key));
    };
    let at_cap = b.max_calls("t");
    answered(&mut b, at_cap);
    b.at(T0 + LIFETIME);
    let expired = Error::PermitExpired {
        permit_id: b.permit_id(),
        expired_at: T0 + LIFETIME,
    };
    answered(&mut b, expired);
    b.ledger.revoke(b.now);
    let revoked = b.ledger.revoke(b.now);
    assert_eq!(
        revoked.status,
        PermitStatus::Revoked,
        "revoking twice is fine"
    );
    let revoked = Error::PermitRevoked {
        permit_id: b.permit_id(),
    };
    answered(&mut b, revoked);
}

// === Commit ===

#[test]
fn succeeded_commits_the_reserved_cost_by_default() {
    let mut b = Bench::with(|p| p.budget = Some(10));
    let a = b.dispatch("t", "k", "fp", 7);
    b.advance(100);
    let s = b.commit(&a, succeeded("ok", None)).expect("commit");
    assert_eq!(s.attempt.state, AttemptState::Succeeded);
    assert_eq!(
        s.attempt.receipt,
        Some(Receipt {
            receipt_id: "receipt-2".into(),
            result: b"ok".to_vec(),
            cost: 7,
            issued_at: T0 + 100,
        })
    );
    assert_eq!((s.usage.calls_made, s.usage.budget_remaining), (1, Some(3)));
    assert_eq!(b.budget(), (7, 0));
}

#[test]
fn succeeded_commits_an_actual_cost_up_to_the_reservation() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k1", "1", 7);
    let Err(Error::InvalidRequest(violations)) = b.commit(&a, succeeded("ok", Some(8))) else {
        panic!("an actual cost above the reservation is invalid");
    };
    let fields: Vec<_> = violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(fields, ["succeeded.actual_cost"]);
    let s = b.commit(&a, succeeded("ok", Some(4))).expect("commit");
    assert_eq!(s.attempt.receipt.expect("receipt").cost, 4);
    assert_eq!(
        b.budget(),
        (4, 0),
        "the rest of the reservation is returned"
    );
    let a = b.dispatch("t", "k2", "2", 5);
    b.commit(&a, succeeded("ok", Some(5))).expect("commit");
    assert_eq!(b.budget(), (9, 0));
}

#[test]
fn a_repeated_commit_answers_the_same_and_a_contradicting_one_conflicts() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k1", "1", 5);
    let first = b.commit(&a, succeeded("ok", Some(4))).expect("commit");
    b.advance(1_000);
    let again = b.commit(&a, succeeded("ok", Some(4))).expect("repeat");
    assert_eq!(again, first, "the same receipt, not a new one");
    for outcome in [
        succeeded("other", Some(4)),
        succeeded("ok", None),
        failed("no"),
        Outcome::NotSent,
    ] {
        assert_eq!(
            b.commit(&a, outcome.clone()),
            Err(conflict(AttemptState::Succeeded)),
            "{outcome:?}"
        );
    }

    let a = b.dispatch("t", "k2", "2", 5);
    let first = b.commit(&a, failed("declined")).expect("commit");
    assert_eq!(b.commit(&a, failed("declined")), Ok(first));
    for outcome in [failed("other"), succeeded("ok", None), Outcome::NotSent] {
        assert_eq!(
            b.commit(&a, outcome.clone()),
            Err(conflict(AttemptState::Failed)),
            "{outcome:?}"
        );
    }
}

#[test]
fn failed_releases_the_cost_and_keeps_the_slot() {
    let mut b = Bench::one_call_and_ten();
    let a = b.dispatch("t", "k", "fp", 7);
    let s = b.commit(&a, failed("card declined")).expect("commit");
    assert_eq!(s.attempt.state, AttemptState::Failed);
    assert_eq!(s.attempt.failure_reason, "card declined");
    assert_eq!(
        (s.usage.calls_made, s.usage.budget_remaining),
        (1, Some(10))
    );
    assert_eq!(b.budget(), (0, 0));
    let at_cap = b.max_calls("t");
    assert_eq!(
        b.authorize("t", "k2", "2", 0),
        Err(at_cap),
        "a dispatch went out"
    );
}

#[test]
fn not_sent_returns_the_slot_and_the_cost_and_frees_the_key() {
    let mut b = Bench::one_call_and_ten();
    let a = b.dispatch("t", "k", "fp", 4);
    let s = b.commit(&a, Outcome::NotSent).expect("not sent");
    assert_eq!(s.attempt.state, AttemptState::Released);
    assert_eq!(
        (s.usage.calls_made, s.usage.budget_remaining),
        (0, Some(10))
    );
    assert_eq!(b.budget(), (0, 0));
    // Until the key is used again, NotSent answers RELEASED again and
    // nothing else may settle it.
    assert_eq!(b.commit(&a, Outcome::NotSent), Ok(s));
    let released = conflict(AttemptState::Released);
    assert_eq!(b.commit(&a, succeeded("ok", None)).unwrap_err(), released);
    assert_eq!(b.commit(&a, failed("x")).unwrap_err(), released);
    assert_eq!(b.resolve("k", failed("x")).unwrap_err(), released);
    assert_eq!(b.mark(&a, "x").unwrap_err(), released);
    // The key is free: any request under it is a new intent with a new id.
    let again = b.dispatch("u", "k", "another request", 3);
    assert_ne!(again.attempt_id, a.attempt_id);
    assert_eq!(b.budget(), (0, 3));
    assert_eq!((b.calls("t"), b.calls("u")), (0, 1));
    // And the old id no longer fences it.
    assert_eq!(
        b.commit(&a, Outcome::NotSent),
        Err(Error::AttemptMismatch {
            idempotency_key: "k".into()
        })
    );
}

#[test]
fn not_sent_once_the_lease_has_passed_is_a_state_conflict() {
    let mut b = Bench::with(|p| p.budget = Some(10));
    let early = b.dispatch("t", "early", "1", 1);
    let late = b.dispatch("t", "late", "2", 2);
    let marked = b.dispatch("t", "marked", "3", 3);
    b.mark(&marked, "lost").expect("mark");
    b.at(T0 + LEASE - 1);
    b.commit(&early, Outcome::NotSent)
        .expect("within the lease");
    b.at(T0 + LEASE);
    for a in [&late, &marked] {
        assert_eq!(
            b.commit(a, Outcome::NotSent),
            Err(conflict(AttemptState::Uncertain)),
            "{}",
            a.idempotency_key
        );
    }
    // An uncertain call may have left: both slots and both costs stay held.
    assert_eq!((b.calls("t"), b.budget()), (2, (0, 5)));
}

#[test]
fn the_holder_may_settle_an_uncertain_attempt() {
    let mut b = Bench::new();
    let marked = b.dispatch("t", "marked", "1", 3);
    b.mark(&marked, "lost").expect("mark");
    let late = b.dispatch("t", "late", "2", 4);
    b.advance(LEASE);
    let s = b
        .commit(&marked, succeeded("late but fine", None))
        .expect("commit");
    assert_eq!(s.attempt.state, AttemptState::Succeeded);
    let s = b.commit(&late, failed("declined")).expect("commit");
    assert_eq!(s.attempt.state, AttemptState::Failed);
    assert_eq!((b.calls("t"), b.budget()), (2, (3, 0)));
}

// === GetAttempt ===

#[test]
fn get_attempt_reads_what_a_replay_would_and_changes_nothing() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 4);
    let read = |b: &mut Bench, key: &str| {
        let before = snapshot(&b.ledger);
        let got = b.ledger.get_attempt(key, b.now);
        assert_eq!(snapshot(&b.ledger), before, "a read changed the ledger");
        got
    };
    assert_eq!(read(&mut b, "k"), Ok(b.ledger.attempt_at("k", b.now)));
    assert_eq!(
        read(&mut b, "k").map(|g| g.state),
        Ok(AttemptState::Reserved)
    );
    // Past its lease it reads UNCERTAIN, as every reader sees it.
    b.advance(LEASE);
    let late = read(&mut b, "k").expect("read");
    assert_eq!(
        (late.state, late.uncertain_reason.as_str()),
        (AttemptState::Uncertain, LEASE_EXPIRED)
    );
    assert_eq!(b.stored("k").state, AttemptState::Reserved);
    b.commit(&a, succeeded("tx 1", None)).expect("commit");
    let done = read(&mut b, "k").expect("read");
    assert_eq!(done.state, AttemptState::Succeeded);
    assert_eq!(done.receipt.map(|r| r.result), Some(b"tx 1".to_vec()));
    assert_eq!(
        read(&mut b, "nope"),
        Err(Error::AttemptNotFound {
            idempotency_key: "nope".into()
        })
    );
}

// === MarkUncertain ===

#[test]
fn mark_uncertain_holds_the_slot_and_the_money() {
    let mut b = Bench::one_call_and_ten();
    let a = b.dispatch("t", "k", "fp", 4);
    let m = b.mark(&a, "deadline exceeded").expect("mark");
    assert_eq!(m.state, AttemptState::Uncertain);
    assert_eq!(m.uncertain_reason, "deadline exceeded");
    assert_eq!(b.stored("k"), m);
    assert_eq!((b.calls("t"), b.budget()), (1, (0, 4)));
    let at_cap = b.max_calls("t");
    assert_eq!(b.authorize("t", "k2", "2", 0), Err(at_cap));
}

#[test]
fn mark_uncertain_is_idempotent() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 4);
    let first = b.mark(&a, "first").expect("mark");
    let before = snapshot(&b.ledger);
    b.advance(LEASE);
    assert_eq!(b.mark(&a, "second"), Ok(first), "returned unchanged");
    assert_eq!(snapshot(&b.ledger), before);
}

#[test]
fn mark_uncertain_after_the_lease_replaces_lease_expired() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 4);
    b.advance(LEASE);
    let r = b.authorize("t", "k", "fp", 4).expect("replay");
    assert_eq!(r.attempt.uncertain_reason, LEASE_EXPIRED);
    let m = b.mark(&a, "lost").expect("mark");
    assert_eq!(
        (m.state, m.uncertain_reason.as_str()),
        (AttemptState::Uncertain, "lost")
    );
    assert_eq!(b.stored("k").state, AttemptState::Uncertain);
}

#[test]
fn mark_uncertain_conflicts_on_a_settled_attempt() {
    let mut b = Bench::new();
    for (n, outcome, state) in [
        (1, succeeded("ok", None), AttemptState::Succeeded),
        (2, failed("no"), AttemptState::Failed),
        (3, Outcome::NotSent, AttemptState::Released),
    ] {
        let a = b.dispatch("t", &format!("k{n}"), &n.to_string(), 1);
        b.commit(&a, outcome).expect("commit");
        assert_eq!(b.mark(&a, "lost"), Err(conflict(state)));
    }
}

// === holder tokens ===

/// The holder whose DISPATCH answer was lost retries the same key with its
/// token and is told DISPATCH again: the same attempt, nothing more
/// reserved; it can then send, or give the slot back with NotSent. Another
/// token, or none, is IN_PROGRESS; once the attempt is no longer RESERVED
/// within its lease, the token redelivers nothing.
#[test]
fn the_same_holder_token_is_told_dispatch_again_while_reserved() {
    let mut b = Bench::with(|p| {
        p.max_calls_per_tool.insert("t".into(), 1);
        p.budget = Some(10);
    });
    let first = b
        .authorize_as("t", "k", "fp", 10, "holder-1")
        .expect("dispatch");
    assert!(!first.redelivered);
    let again = b
        .authorize_as("t", "k", "fp", 10, "holder-1")
        .expect("again");
    assert_eq!(again.decision, Decision::Dispatch);
    assert!(again.redelivered);
    assert_eq!(again.attempt, first.attempt);
    assert_eq!(
        (b.calls("t"), b.budget()),
        (1, (0, 10)),
        "nothing more reserved"
    );
    for other in ["holder-2", ""] {
        assert!(
            matches!(
                b.authorize_as("t", "k", "fp", 10, other),
                Err(Error::InProgress { .. })
            ),
            "{other:?}"
        );
    }
    // A different request under the key is still KEY_REUSED, token or not.
    assert!(matches!(
        b.authorize_as("t", "k", "other", 10, "holder-1"),
        Err(Error::KeyReused { .. })
    ));
    // The redelivered holder gives the slot back.
    b.commit(&again.attempt, Outcome::NotSent)
        .expect("not sent");
    assert_eq!((b.calls("t"), b.budget()), (0, (0, 0)));

    // Past the lease the attempt is UNCERTAIN: the token gets its REPLAY.
    let held = b
        .authorize_as("t", "k2", "fp2", 1, "holder-1")
        .expect("dispatch");
    b.at(held.attempt.lease_expires_at);
    let late = b
        .authorize_as("t", "k2", "fp2", 1, "holder-1")
        .expect("replay");
    assert_eq!(late.decision, Decision::Replay);
    assert!(!late.redelivered);
    assert_eq!(late.attempt.state, AttemptState::Uncertain);
}

/// A DISPATCH says how long its lease has left at the ledger's `now`: the
/// whole lease when fresh, what remains of it when redelivered later.
#[test]
fn a_dispatch_carries_the_lease_left() {
    let mut b = Bench::new();
    let first = b.authorize_as("t", "k", "fp", 1, "tok").expect("dispatch");
    assert_eq!(first.lease_remaining_ms, LEASE);
    b.advance(LEASE - 250);
    let again = b.authorize_as("t", "k", "fp", 1, "tok").expect("again");
    assert!(again.redelivered);
    assert_eq!(again.lease_remaining_ms, 250);
    b.advance(250);
    let replay = b.authorize_as("t", "k", "fp", 1, "tok").expect("replay");
    assert_eq!(replay.decision, Decision::Replay);
    assert_eq!(replay.lease_remaining_ms, 0);
}

/// Issue 24, hole 1: agent B of the same tenant, on a permit open to every
/// agent, retries agent A's key with the same request. B must neither
/// learn the id of A's open attempt nor settle it: a Commit Failed by B
/// would hand back the money of a call that may have charged.
#[test]
fn only_the_key_that_reserved_an_attempt_settles_it() {
    let mut b = Bench::with(|p| p.budget = Some(100));
    b.as_agent("agent-a");
    let a = b.dispatch("t", "k1", "fp", 100);
    assert_eq!(a.reserved_by, "agent-a");
    b.mark(&a, "response lost").expect("A marks it");

    b.as_agent("agent-b");
    let seen = b.authorize("t", "k1", "fp", 100).expect("replay");
    assert_eq!(seen.decision, Decision::Replay);
    assert_eq!(seen.attempt.state, AttemptState::Uncertain);
    assert_eq!(
        seen.attempt.attempt_id, "",
        "B is not given A's fencing token"
    );
    assert_eq!(seen.attempt.reserved_by, "agent-a");
    // Even holding the id (from a log, say), B may not settle it: refused,
    // and (Bench::run) nothing changed.
    fn mismatch<T>(r: Result<T, Error>) -> bool {
        matches!(r, Err(Error::AttemptHolderMismatch { ref idempotency_key }) if idempotency_key == "k1")
    }
    assert!(mismatch(b.commit(&a, failed("tool said no"))));
    assert!(mismatch(b.commit(&a, succeeded("ok", None))));
    assert!(mismatch(b.mark(&a, "b")));
    assert_eq!(b.budget(), (0, 100), "the money stays held");
    // A wrong id is still a mismatch of the id, telling B nothing more.
    assert!(matches!(
        b.commit_as("k1", "attempt-x", failed("no")),
        Err(Error::AttemptMismatch { .. })
    ));

    // A itself, retrying, gets its id back and settles it.
    b.as_agent("agent-a");
    let own = b.authorize("t", "k1", "fp", 100).expect("replay");
    assert_eq!(own.attempt.attempt_id, a.attempt_id);
    b.commit(&a, succeeded("charged", None)).expect("A commits");
    // Settled, the id can settle nothing more: every reader may see it.
    b.as_agent("agent-b");
    let done = b.authorize("t", "k1", "fp", 100).expect("replay");
    assert_eq!(done.attempt.attempt_id, a.attempt_id);
    assert!(mismatch(b.commit(&a, succeeded("charged", None))));
}

/// The same holds while RESERVED past its lease (UNCERTAIN for every
/// reader), for a redelivery (another key's token is no proof), and for an
/// admin's attempt; an admin key, which no agents list limits, holds every
/// attempt of its tenant.
#[test]
fn another_key_is_never_the_holder() {
    let mut b = Bench::with(|p| p.budget = Some(100));
    b.as_agent("agent-a");
    let a = b
        .authorize_as("t", "k1", "fp", 10, "token")
        .expect("dispatch")
        .attempt;
    b.as_agent("agent-b");
    assert!(matches!(
        b.authorize_as("t", "k1", "fp", 10, "token"),
        Err(Error::InProgress { .. })
    ));
    b.advance(LEASE);
    let late = b.authorize("t", "k1", "fp", 10).expect("replay");
    assert_eq!(late.attempt.state, AttemptState::Uncertain);
    assert_eq!(late.attempt.attempt_id, "");
    assert!(matches!(
        b.commit(&a, failed("no")),
        Err(Error::AttemptHolderMismatch { .. })
    ));

    b.as_admin("admin-1");
    let admins = b.dispatch("t", "k2", "fp2", 10);
    assert_eq!(admins.reserved_by, "admin-1");
    b.as_agent("agent-a");
    assert!(matches!(
        b.mark(&admins, "x"),
        Err(Error::AttemptHolderMismatch { .. })
    ));
    b.as_admin("admin-2");
    b.commit(&a, failed("provider says no"))
        .expect("an admin settles A's");
    b.mark(&admins, "x").expect("and the other admin's");
}

// === Resolve ===

#[test]
fn resolve_settles_only_an_uncertain_attempt() {
    let mut b = Bench::with(|p| p.budget = Some(100));
    let marked = b.dispatch("t", "marked", "1", 10);
    let late = b.dispatch("t", "late", "2", 10);
    let released = b.dispatch("t", "released", "3", 10);
    b.commit(&released, Outcome::NotSent).expect("not sent");
    assert_eq!(
        b.resolve("marked", succeeded("r", None)),
        Err(conflict(AttemptState::Reserved)),
        "RESERVED within its lease is the holder's"
    );
    b.mark(&marked, "lost").expect("mark");
    let s = b
        .resolve("marked", succeeded("found it", Some(8)))
        .expect("resolve");
    assert_eq!(s.attempt.state, AttemptState::Succeeded);
    assert_eq!(s.attempt.receipt.expect("receipt").result, b"found it");
    assert_eq!(s.usage.budget_remaining, Some(82));
    assert_eq!(
        b.resolve("late", failed("never charged")),
        Err(conflict(AttemptState::Reserved))
    );
    b.at(late.lease_expires_at);
    let s = b.resolve("late", failed("never charged")).expect("resolve");
    assert_eq!(s.attempt.state, AttemptState::Failed);
    assert_eq!(
        b.resolve("released", failed("x")),
        Err(conflict(AttemptState::Released))
    );
    assert_eq!((b.calls("t"), b.budget()), (2, (8, 0)));
}

/// An operator who verified with the tool's provider that an UNCERTAIN call
/// never took effect returns its slot and cost: the key is free again. A
/// holder cannot (its call may have left), nor can an operator while the
/// attempt is RESERVED within its lease.
#[test]
fn resolve_not_sent_returns_a_slot_that_was_never_used() {
    let mut b = Bench::with(|p| {
        p.budget = Some(10);
        p.max_calls_per_tool.insert("t".into(), 1);
    });
    let a = b.dispatch("t", "k", "1", 10);
    assert_eq!(
        b.resolve_attempt("k", &a.attempt_id, Outcome::NotSent),
        Err(conflict(AttemptState::Reserved)),
        "RESERVED within its lease is the holder's"
    );
    b.mark(&a, "lost").expect("mark");
    assert_eq!(
        b.commit(&a, Outcome::NotSent),
        Err(conflict(AttemptState::Uncertain)),
        "the holder cannot: its call may have left"
    );
    assert_eq!((b.calls("t"), b.budget()), (1, (0, 10)));
    let s = b
        .resolve_attempt("k", &a.attempt_id, Outcome::NotSent)
        .expect("verified never sent");
    assert_eq!(s.attempt.state, AttemptState::Released);
    assert_eq!((b.calls("t"), b.budget()), (0, (0, 0)));
    // A repeat answers the same; the key and the slot serve a new call.
    assert_eq!(
        b.resolve_attempt("k", &a.attempt_id, Outcome::NotSent),
        Ok(s)
    );
    let again = b.dispatch("t", "k", "1", 10);
    assert_ne!(again.attempt_id, a.attempt_id);
    assert_eq!((b.calls("t"), b.budget()), (1, (0, 10)));
    // A late retry of the first NotSent never releases the newer attempt.
    b.mark(&again, "lost").expect("mark");
    assert!(matches!(
        b.resolve_attempt("k", &a.attempt_id, Outcome::NotSent),
        Err(Error::AttemptMismatch { .. })
    ));
    assert_eq!((b.calls("t"), b.budget()), (1, (0, 10)));
}

#[test]
fn a_repeated_resolve_answers_the_same_and_a_different_one_conflicts() {
    let mut b = Bench::new();
    for (key, outcome, other, state) in [
        (
            "s",
            succeeded("found", None),
            failed("no"),
            AttemptState::Succeeded,
        ),
        ("f", failed("no"), failed("other"), AttemptState::Failed),
    ] {
        let a = b.dispatch("t", key, key, 1);
        b.mark(&a, "lost").expect("mark");
        let first = b.resolve(key, outcome.clone()).expect("resolve");
        b.advance(1_000);
        assert_eq!(b.resolve(key, outcome), Ok(first), "{key}");
        assert_eq!(b.resolve(key, other), Err(conflict(state)), "{key}");
    }
}

// === Unknown keys and wrong attempt ids ===

#[test]
fn an_unknown_key_is_attempt_not_found() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 0);
    let not_found = Error::AttemptNotFound {
        idempotency_key: "ghost".into(),
    };
    let commit = b.commit_as("ghost", &a.attempt_id, Outcome::NotSent);
    assert_eq!(commit.unwrap_err(), not_found);
    let mark = b.mark_as("ghost", &a.attempt_id, "x");
    assert_eq!(mark.unwrap_err(), not_found);
    assert_eq!(b.resolve("ghost", failed("x")).unwrap_err(), not_found);
}

#[test]
fn a_wrong_attempt_id_is_attempt_mismatch_in_any_state() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 0);
    let mismatch = |b: &mut Bench| {
        let wrong = Error::AttemptMismatch {
            idempotency_key: "k".into(),
        };
        assert_eq!(
            b.commit_as("k", "attempt-other", Outcome::NotSent),
            Err(wrong.clone())
        );
        assert_eq!(b.mark_as("k", "attempt-other", "x"), Err(wrong));
    };
    mismatch(&mut b);
    b.commit(&a, succeeded("ok", None)).expect("commit");
    mismatch(&mut b);
}

// === Caps and budget ===

#[test]
fn a_cap_of_zero_disables_the_tool() {
    let mut b = Bench::with(|p| cap(p, "t", 0));
    assert_eq!(
        b.authorize("t", "k", "fp", 0),
        Err(Error::MaxCallsExceeded {
            tool: "t".into(),
            limit: 0,
            calls_made: 0,
        })
    );
    assert_eq!(b.usage("t").calls_limit, Some(0));
    b.dispatch("u", "k", "fp", 0);
}

#[test]
fn a_tool_without_a_cap_has_no_bound() {
    let mut b = Bench::with(|p| cap(p, "t", 2));
    for i in 0..100 {
        b.dispatch("u", &format!("u{i}"), &i.to_string(), 0);
    }
    b.dispatch("t", "t1", "1", 0);
    b.dispatch("t", "t2", "2", 0);
    let at_cap = b.max_calls("t");
    assert_eq!(b.authorize("t", "t3", "3", 0), Err(at_cap));
    assert_eq!(b.usage("u").calls_limit, None);
    assert_eq!((b.calls("t"), b.calls("u")), (2, 100));
}

#[test]
fn an_unlimited_budget_stops_at_max_amount() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k1", "1", MAX_AMOUNT);
    assert_eq!(
        b.authorize("t", "k2", "2", 1),
        Err(Error::BudgetExceeded {
            budget: MAX_AMOUNT,
            committed: 0,
            reserved: MAX_AMOUNT,
            requested: 1,
        })
    );
    b.dispatch("t", "free", "0", 0);
    b.commit(&a, succeeded("", Some(MAX_AMOUNT - 1)))
        .expect("commit");
    b.dispatch("t", "k2", "2", 1);
    assert_eq!(b.budget(), (MAX_AMOUNT - 1, 1));
    assert_eq!(b.usage("t").budget_remaining, None, "still unlimited");
    assert!(matches!(
        b.authorize("t", "k3", "3", 1),
        Err(Error::BudgetExceeded { .. })
    ));
}

// === Duplicate guard ===

#[test]
fn duplicate_guard_off_never_looks() {
    let mut b = Bench::with(|p| guard(p, GuardMode::Off));
    b.dispatch("t", "k1", "same", 1);
    let r = b.authorize("t", "k2", "same", 1).expect("authorize");
    assert_eq!((r.decision, r.duplicate_of), (Decision::Dispatch, None));
    assert!(b.ledger.dup_index.is_empty(), "nothing is indexed");
}

#[test]
fn duplicate_guard_log_dispatches_and_names_the_latest_earlier_key() {
    let mut b = Bench::new();
    b.dispatch("t", "k1", "same", 1);
    for (tool, key, fp, duplicate_of) in [
        ("t", "k2", "same", Some("k1")),
        ("t", "k3", "different", None),
        ("u", "k4", "same", None),
        ("t", "k5", "same", Some("k2")),
    ] {
        let r = b.authorize(tool, key, fp, 1).expect("authorize");
        assert_eq!(r.decision, Decision::Dispatch, "{key}");
        assert_eq!(r.duplicate_of.as_deref(), duplicate_of, "{key}");
        assert_eq!(r.attempt.duplicate_of.as_deref(), duplicate_of, "{key}");
    }
}

#[test]
fn duplicate_guard_enforce_refuses_while_the_earlier_attempt_stands() {
    let mut b = Bench::with(|p| guard(p, GuardMode::Enforce));
    b.dispatch("t", "open", "1", 1);
    let done = b.dispatch("t", "done", "2", 1);
    b.commit(&done, succeeded("ok", None)).expect("commit");
    let declined = b.dispatch("t", "declined", "3", 1);
    b.commit(&declined, failed("no")).expect("commit");
    let refused = |b: &mut Bench| {
        for (fp, earlier_key) in [("1", "open"), ("2", "done"), ("3", "declined")] {
            assert_eq!(
                b.authorize("t", "retry", fp, 1).unwrap_err(),
                Error::DuplicateSuspected {
                    tool: "t".into(),
                    earlier_key: earlier_key.into(),
                }
            );
        }
    };
    refused(&mut b);
    b.advance(LEASE);
    assert_eq!(
        b.stored("open").observed_state(b.now),
        AttemptState::Uncertain
    );
    refused(&mut b);
}

#[test]
fn the_duplicate_window_ends_window_ms_after_the_earlier_attempt_was_created() {
    for mode in [GuardMode::Log, GuardMode::Enforce] {
        for (at, within) in [(T0 + WINDOW - 1, true), (T0 + WINDOW, false)] {
            let mut b = Bench::with(|p| guard(p, mode));
            b.dispatch("t", "k1", "same", 1);
            b.at(at);
            let r = b.authorize("t", "k2", "same", 1);
            match (mode, within) {
                (GuardMode::Enforce, true) => {
                    assert!(matches!(r, Err(Error::DuplicateSuspected { .. })))
                }
                _ => {
                    let r = r.expect("dispatch");
                    let duplicate_of = within.then_some("k1");
                    assert_eq!(r.duplicate_of.as_deref(), duplicate_of, "{mode:?} {at}");
                }
            }
        }
    }
}

#[test]
fn a_released_attempt_is_no_duplicate() {
    let mut b = Bench::with(|p| guard(p, GuardMode::Enforce));
    let a = b.dispatch("t", "k1", "same", 1);
    b.commit(&a, Outcome::NotSent).expect("not sent");
    let r = b.authorize("t", "k2", "same", 1).expect("authorize");
    assert_eq!((r.decision, r.duplicate_of), (Decision::Dispatch, None));
}

#[test]
fn the_guard_falls_back_to_duplicate_of_when_the_latest_attempt_is_released() {
    let mut b = Bench::new();
    b.dispatch("t", "k1", "same", 1);
    let k2 = b.dispatch("t", "k2", "same", 1);
    b.commit(&k2, Outcome::NotSent).expect("not sent");
    let k3 = b.authorize("t", "k3", "same", 1).expect("authorize");
    assert_eq!(
        k3.duplicate_of.as_deref(),
        Some("k1"),
        "k2 released: back to k1"
    );
    // Releasing an earlier attempt leaves the latest one indexed.
    let k4 = b.authorize("t", "k4", "same", 1).expect("authorize");
    assert_eq!(k4.duplicate_of.as_deref(), Some("k3"));
    b.commit(&k3.attempt, Outcome::NotSent).expect("not sent");
    let k5 = b.authorize("t", "k5", "same", 1).expect("authorize");
    assert_eq!(k5.duplicate_of.as_deref(), Some("k4"));
    // The last one standing released without an earlier one: unindexed.
    let mut b = Bench::new();
    let only = b.dispatch("t", "k1", "same", 1);
    b.commit(&only, Outcome::NotSent).expect("not sent");
    assert!(b.ledger.dup_index.is_empty());
}

// === Listing and retirement ===

#[test]
fn uncertain_after_pages_through_attempts_uncertain_at_the_same_instant_in_key_order() {
    let mut b = Bench::new();
    b.dispatch("t", "d", "d", 0); // its lease passes
    b.advance(LEASE);
    for (key, outcome) in [
        ("a", None),
        ("b", Some(succeeded("ok", None))),
        ("c", Some(Outcome::NotSent)),
        ("e", Some(failed("no"))),
        ("f", None),
    ] {
        let a = b.dispatch("t", key, key, 0);
        match outcome {
            Some(outcome) => assert!(b.commit(&a, outcome).is_ok()),
            None => assert!(b.mark(&a, "lost").is_ok()),
        }
    }
    b.dispatch("t", "g", "g", 0); // RESERVED within its lease
    // All three became uncertain at T0 + LEASE: key order among them.
    let keys = |after: &str, limit| -> Vec<String> {
        let after = (!after.is_empty()).then_some((T0 + LEASE, after));
        b.ledger
            .uncertain_after(after, limit, b.now)
            .into_iter()
            .map(|a| a.idempotency_key)
            .collect()
    };
    assert_eq!(keys("", 10), ["a", "d", "f"]);
    assert_eq!(keys("", 2), ["a", "d"]);
    assert_eq!(keys("d", 2), ["f"]);
    assert_eq!(keys("b", 10), ["d", "f"]);
    assert_eq!(keys("f", 10), Vec::<String>::new());
    assert_eq!(keys("", 0), Vec::<String>::new());
    let listed = b.ledger.uncertain_after(Some((T0 + LEASE, "c")), 1, b.now);
    assert_eq!(
        (listed[0].state, listed[0].uncertain_reason.as_str()),
        (AttemptState::Uncertain, LEASE_EXPIRED)
    );
}

#[test]
fn uncertain_after_lists_by_when_each_became_uncertain() {
    let mut b = Bench::new();
    let z = b.dispatch("t", "z", "z", 0); // lease ends at T0 + LEASE
    b.advance(10);
    let y = b.dispatch("t", "y", "y", 0); // lease ends 10 ms later
    b.advance(10);
    let x = b.dispatch("t", "x", "x", 0);
    b.mark(&x, "lost").expect("mark"); // uncertain since T0 + 20
    let keys = |b: &Bench| -> Vec<(Millis, String)> {
        b.ledger
            .uncertain_after(None, 10, b.now)
            .into_iter()
            .map(|a| (a.uncertain_since, a.idempotency_key))
            .collect()
    };
    assert_eq!(keys(&b), [(T0 + 20, "x".to_owned())]);
    b.at(T0 + LEASE + 10);
    assert_eq!(
        keys(&b),
        [
            (T0 + 20, "x".to_owned()),
            (T0 + LEASE, "z".to_owned()),
            (T0 + LEASE + 10, "y".to_owned())
        ]
    );
    // Marking one whose lease has passed keeps its place.
    b.mark(&z, "lost").expect("mark");
    assert_eq!(keys(&b)[1], (T0 + LEASE, "z".to_owned()));
    // A cursor continues after (uncertain_since, key), and a settled
    // attempt leaves the listing.
    b.commit(&y, failed("no")).expect("commit");
    let after = b.ledger.uncertain_after(Some((T0 + 20, "x")), 10, b.now);
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].idempotency_key, "z");
}

#[test]
fn hold_tool_refuses_new_keys_of_a_tool_while_it_has_an_uncertain_attempt() {
    let mut b = Bench::with(|p| p.uncertain_policy = UncertainPolicy::HoldTool);
    let k1 = b.dispatch("t", "k1", "a", 1);
    // RESERVED within its lease holds nothing.
    b.dispatch("t", "k2", "b", 1);
    b.mark(&k1, "lost").expect("mark");
    let held = Error::ToolHeld {
        tool: "t".into(),
        uncertain_key: "k1".into(),
    };
    assert_eq!(b.authorize("t", "k3", "c", 1).unwrap_err(), held);
    // Another tool is not held; the same key still replays.
    b.dispatch("u", "k4", "d", 1);
    assert_eq!(
        b.authorize("t", "k1", "a", 1).expect("replay").decision,
        Decision::Replay
    );
    // Scope is checked first, the cap after the hold.
    assert_eq!(
        b.authorize("nope", "k5", "e", 1).unwrap_err(),
        Error::ToolNotInScope {
            tool: "nope".into()
        }
    );
    // Resolved: lifted at once.
    b.resolve("k1", succeeded("ok", None)).expect("resolve");
    b.dispatch("t", "k3", "c", 1);
    // A lease that passes holds too, from the instant it ends.
    let lease_end = b.now + LEASE;
    b.at(lease_end - 1);
    b.dispatch("t", "k6", "f", 1);
    b.at(lease_end);
    match b.authorize("t", "k7", "g", 1).unwrap_err() {
        Error::ToolHeld { uncertain_key, .. } => assert_eq!(uncertain_key, "k2"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hold_tool_comes_before_the_cap() {
    let mut b = Bench::with(|p| {
        p.uncertain_policy = UncertainPolicy::HoldTool;
        cap(p, "t", 1);
    });
    let k1 = b.dispatch("t", "k1", "a", 1);
    b.mark(&k1, "lost").expect("mark");
    assert!(matches!(
        b.authorize("t", "k2", "b", 1).unwrap_err(),
        Error::ToolHeld { .. }
    ));
    // With COUNT, the same state answers the cap.
    let mut c = Bench::with(|p| cap(p, "t", 1));
    let k1 = c.dispatch("t", "k1", "a", 1);
    c.mark(&k1, "lost").expect("mark");
    assert!(matches!(
        c.authorize("t", "k2", "b", 1).unwrap_err(),
        Error::MaxCallsExceeded { .. }
    ));
}

fn forgotten(ledger: &Ledger, now: Millis) -> bool {
    ledger.forget_at(RETENTION).is_some_and(|at| now > at)
}

#[test]
fn a_ledger_is_forgotten_a_retention_after_its_expiry() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 0);
    b.commit(&a, succeeded("ok", None)).expect("commit");
    let end = T0 + LIFETIME + RETENTION;
    assert_eq!(b.ledger.forget_at(RETENTION), Some(end));
    // As Redis expires a key: once now is past it.
    assert!(!forgotten(&b.ledger, end));
    assert!(forgotten(&b.ledger, end + 1));
}

#[test]
fn a_ledger_with_an_open_attempt_is_never_forgotten() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 0);
    assert_eq!(b.ledger.forget_at(RETENTION), None, "RESERVED");
    b.mark(&a, "lost").expect("mark");
    assert_eq!(b.ledger.forget_at(RETENTION), None, "UNCERTAIN");
    b.commit(&a, failed("no")).expect("commit");
    assert!(forgotten(&b.ledger, Millis::MAX));
}

#[test]
fn retention_runs_from_a_settle_after_expiry() {
    let mut b = Bench::new();
    let a = b.dispatch("t", "k", "fp", 0);
    b.at(T0 + LIFETIME + 5);
    b.commit(&a, succeeded("late", None)).expect("commit");
    let end = T0 + LIFETIME + 5 + RETENTION;
    assert!(!forgotten(&b.ledger, T0 + LIFETIME + RETENTION + 1));
    assert!(!forgotten(&b.ledger, end));
    assert!(forgotten(&b.ledger, end + 1));
}

// === The property ===

mod property {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// "nope" is out of scope.
    const TOOLS: [&str; 3] = ["t", "u", "nope"];
    const KEYS: [&str; 4] = ["k0", "k1", "k2", "k3"];

    #[derive(Debug, Clone)]
    enum Step {
        Authorize {
            tool: usize,
            key: usize,
            fp: u8,
            cost: i64,
            /// 0: none; 1, 2: two holders' tokens.
            token: u8,
        },
        /// With the attempt id the key was last dispatched with, or a stale
        /// one.
        Commit {
            key: usize,
            outcome: Outcome,
            stale: bool,
        },
        MarkUncertain {
            key: usize,
        },
        Resolve {
            key: usize,
            outcome: Outcome,
        },
        Revoke,
        Advance(Millis),
    }

    fn a_permit() -> impl Strategy<Value = Permit> {
        let mode = prop_oneof![
            Just(GuardMode::Off),
            Just(GuardMode::Log),
            Just(GuardMode::Enforce)
        ];
        let caps = proptest::collection::vec(proptest::option::of(0u64..4), 2);
        let budget = proptest::option::of(0i64..12);
        let durations = (1i64..6_000, 1i64..6_000, 1i64..40_000);
        (caps, budget, mode, durations).prop_map(|(caps, budget, mode, (lease, window, life))| {
            let mut p = permit();
            for (tool, n) in TOOLS.iter().zip(caps) {
                if let Some(n) = n {
                    cap(&mut p, tool, n);
                }
            }
            p.budget = budget;
            p.duplicate_guard = DuplicateGuard {
                mode,
                window_ms: window,
            };
            p.lease_ms = lease;
            p.expires_at = T0 + life;
            p
        })
    }

    /// Succeeded or Failed.
    fn a_settlement() -> impl Strategy<Value = Outcome> {
        prop_oneof![
            (0u8..2, proptest::option::of(0i64..5)).prop_map(|(r, actual_cost)| {
                Outcome::Succeeded {
                    result: vec![r],
                    actual_cost,
                }
            }),
            (0u8..2).prop_map(|r| failed(&r.to_string())),
        ]
    }

    fn a_step() -> impl Strategy<Value = Step> {
        let cost = prop_oneof![8 => 0i64..5, 1 => Just(MAX_AMOUNT / 2 + 1), 1 => Just(MAX_AMOUNT)];
        let outcome = || prop_oneof![2 => a_settlement(), 1 => Just(Outcome::NotSent)];
        prop_oneof![
            5 => (0..TOOLS.len(), 0..KEYS.len(), 0u8..3, cost, 0u8..3)
                .prop_map(|(tool, key, fp, cost, token)| Step::Authorize { tool, key, fp, cost, token }),
            4 => (0..KEYS.len(), outcome(), proptest::bool::weighted(0.1))
                .prop_map(|(key, outcome, stale)| Step::Commit { key, outcome, stale }),
            2 => (0..KEYS.len()).prop_map(|key| Step::MarkUncertain { key }),
            2 => (0..KEYS.len(), outcome()).prop_map(|(key, outcome)| Step::Resolve { key, outcome }),
            1 => Just(Step::Revoke),
            3 => (0i64..4_000).prop_map(Step::Advance),
        ]
    }

    /// What the test itself saw answered, independently of the ledger.
    #[derive(Default)]
    struct Seen {
        /// key -> (tool, attempt id) of the key's latest DISPATCH.
        dispatched: HashMap<usize, (usize, String)>,
        /// Keys whose latest dispatched attempt was since released by NotSent.
        released: HashSet<usize>,
        /// DISPATCH answers less releases, by tool.
        slots: [u64; 2],
    }

    impl Seen {
        /// A redelivered DISPATCH: the same attempt, still held, nothing
        /// more reserved; it must be the key's latest one, never released.
        fn redelivered(&mut self, key: usize, attempt_id: &str) {
            let latest = self.dispatched.get(&key).map(|(_, id)| id.as_str());
            assert_eq!(
                latest,
                Some(attempt_id),
                "{} redelivered another attempt",
                KEYS[key]
            );
            assert!(
                !self.released.contains(&key),
                "{} redelivered after NotSent",
                KEYS[key]
            );
        }

        fn dispatch(&mut self, key: usize, tool: usize, attempt_id: String) {
            assert!(
                !self.dispatched.contains_key(&key) || self.released.contains(&key),
                "{} dispatched again without NotSent in between",
                KEYS[key]
            );
            self.dispatched.insert(key, (tool, attempt_id));
            self.released.remove(&key);
            self.slots[tool] += 1;
        }

        fn not_sent(&mut self, key: usize) {
            if self.released.insert(key) {
                self.slots[self.dispatched[&key].0] -= 1;
            }
        }

        fn attempt_id(&self, key: usize, stale: bool) -> String {
            match self.dispatched.get(&key) {
                Some((_, id)) if !stale => id.clone(),
                _ => "attempt-stale".into(),
            }
        }
    }

    /// `before` is the ledger before the step, which ran at `then`;
    /// `verified_not_sent` the key an operator's Resolve NotSent released in
    /// it, if any: the one way an uncertain slot may come back.
    fn invariants(
        ledger: &Ledger,
        before: &Snapshot,
        then: Millis,
        seen: &Seen,
        verified_not_sent: Option<&str>,
    ) {
        let view = ledger.view(then);
        for (i, usage) in view.usage.iter().enumerate() {
            if let Some(cap) = usage.calls_limit {
                assert!(usage.calls_made <= cap, "{usage:?} over its cap");
            }
            let held = ledger
                .attempts
                .values()
                .filter(|r| usize::from(r.tool) == i && r.state != AttemptState::Released)
                .count();
            assert_eq!(usage.calls_made, held as u64, "calls of {}", usage.tool);
            assert_eq!(
                usage.calls_made, seen.slots[i],
                "dispatches of {}",
                usage.tool
            );
        }
        let (committed, reserved) = (view.budget_committed, view.budget_reserved);
        assert!(committed >= 0 && reserved >= 0);
        assert!(committed + reserved <= view.permit.budget.unwrap_or(MAX_AMOUNT));
        let open: i64 = ledger
            .attempts
            .values()
            .filter(|r| r.state.is_open())
            .map(|r| r.cost)
            .sum();
        assert_eq!(reserved, open, "reserved is the cost of the open attempts");
        let receipts: i64 = ledger
            .attempts
            .values()
            .filter_map(|r| r.receipt())
            .map(|r| r.cost)
            .sum();
        assert_eq!(committed, receipts, "committed is the sum of the receipts");

        // The open set is exactly the open attempts, each at its place.
        let open: Vec<(Millis, String)> = {
            let mut open: Vec<_> = ledger
                .attempts
                .iter()
                .filter(|(_, r)| r.state.is_open())
                .map(|(key, r)| (r.open_at(), key.to_string()))
                .collect();
            open.sort();
            open
        };
        assert_eq!(entries(&ledger.open), open, "the open set");
        for (tool, held) in ledger.held.iter().enumerate() {
            let of_tool: Vec<_> = open
                .iter()
                .filter(|(_, key)| usize::from(ledger.attempts[key.as_str()].tool) == tool)
                .cloned()
                .collect();
            assert_eq!(entries(held), of_tool, "the held set of tool {tool}");
        }

        let after = snapshot(ledger);
        for was in before.attempts.values() {
            let is = after
                .attempts
                .get(&was.idempotency_key)
                .expect("a key never disappears");
            match was.state {
                AttemptState::Reserved
                | AttemptState::Uncertain
                | AttemptState::AwaitingApproval
                | AttemptState::Approved => {
                    assert_eq!(is.attempt_id, was.attempt_id, "an open attempt disappeared");
                }
                AttemptState::Succeeded | AttemptState::Failed | AttemptState::Denied => {
                    assert_eq!(is, was, "a settled attempt changed");
                }
                AttemptState::Released => {}
            }
            if was.observed_state(then) == AttemptState::Uncertain
                && verified_not_sent != Some(was.idempotency_key.as_str())
            {
                assert_ne!(
                    is.state,
                    AttemptState::Released,
                    "an uncertain slot came back"
                );
            }
        }
    }

    fn run(permit: Permit, steps: &[Step]) {
        let mut b = Bench::with(|p| *p = permit);
        let mut seen = Seen::default();
        for step in steps {
            let (before, then) = (snapshot(&b.ledger), b.now);
            let mut verified_not_sent = None;
            match step {
                &Step::Authorize {
                    tool,
                    key,
                    fp,
                    cost,
                    token,
                } => {
                    let token = ["", "holder-1", "holder-2"][usize::from(token)];
                    let r = b.authorize_as(TOOLS[tool], KEYS[key], &fp.to_string(), cost, token);
                    match r {
                        Ok(r) if r.redelivered => {
                            assert_eq!(r.decision, Decision::Dispatch);
                            assert_eq!(
                                r.attempt.state,
                                AttemptState::Reserved,
                                "only a RESERVED attempt within its lease redelivers"
                            );
                            assert_eq!(snapshot(&b.ledger), before, "a redelivery changed");
                            seen.redelivered(key, &r.attempt.attempt_id);
                        }
                        Ok(r) if r.decision == Decision::Dispatch => {
                            seen.dispatch(key, tool, r.attempt.attempt_id)
                        }
                        Ok(_) => assert_eq!(snapshot(&b.ledger), before, "a replay changed"),
                        Err(_) => {}
                    }
                }
                Step::Commit {
                    key,
                    outcome,
                    stale,
                } => {
                    let id = seen.attempt_id(*key, *stale);
                    let r = b.commit_as(KEYS[*key], &id, outcome.clone());
                    if r.is_ok() && *outcome == Outcome::NotSent {
                        seen.not_sent(*key);
                    }
                }
                &Step::MarkUncertain { key } => {
                    let id = seen.attempt_id(key, false);
                    let _ = b.mark_as(KEYS[key], &id, "lost");
                }
                Step::Resolve { key, outcome } => {
                    // As a reconciler would: naming the attempt it listed.
                    let id = seen.attempt_id(*key, false);
                    let r = b.resolve_attempt(KEYS[*key], &id, outcome.clone());
                    if r.is_ok() && *outcome == Outcome::NotSent {
                        seen.not_sent(*key);
                        verified_not_sent = Some(KEYS[*key]);
                    }
                }
                Step::Revoke => {
                    b.ledger.revoke(b.now);
                }
                &Step::Advance(ms) => b.advance(ms),
            }
            invariants(&b.ledger, &before, then, &seen, verified_not_sent);
        }
    }

    proptest! {
        // 256 cases unless PROPTEST_CASES says otherwise.
        #![proptest_config(ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn invariants_hold_after_every_step(
            permit in a_permit(),
            steps in proptest::collection::vec(a_step(), 1..60),
        ) {
            run(permit, &steps);
        }
    }
}

/// Human approval: calls a permit's approval rule holds.
mod approval {
    use super::*;
    use crate::domain::{
        APPROVAL_EXPIRED, APPROVAL_UNCLAIMED, ApprovalRule, ApproveCmd, DENIED, DenyCmd,
        PERMIT_REVOKED,
    };

    const WAIT: Millis = 600_000;

    /// "t" needs one approval for calls of cost 100 or more, "u" two
    /// (four eyes) for every call; "t" capped at `cap`, a budget of 1000.
    fn bench(cap_t: u64) -> Bench {
        let mut b = Bench::with(|p| {
            cap(p, "t", cap_t);
            p.budget = Some(1000);
            p.tenant = "acme".into();
            p.approval_per_tool.insert(
                "t".into(),
                ApprovalRule {
                    cost_at_least: Some(100),
                    wait_ms: WAIT,
                    approvers: 1,
                },
            );
            p.approval_per_tool.insert(
                "u".into(),
                ApprovalRule {
                    cost_at_least: None,
                    wait_ms: WAIT,
                    approvers: 2,
                },
            );
        });
        b.as_agent("agent-1");
        b
    }

    impl Bench {
        fn awaiting(&mut self, tool: &str, key: &str, cost: i64) -> Attempt {
            let r = self
                .authorize(tool, key, "fp", cost)
                .unwrap_or_else(|e| panic!("{key}: {e:?}"));
            assert_eq!(r.decision, Decision::AwaitApproval, "{key}: {r:?}");
            assert_eq!(r.attempt.state, AttemptState::AwaitingApproval);
            assert_eq!(r.lease_remaining_ms, 0);
            r.attempt
        }

        /// Runs `f` as approver key `key_id`, then goes back to agent-1.
        fn as_approver<T>(&mut self, key_id: &str, f: impl FnOnce(&mut Bench) -> T) -> T {
            self.as_admin(key_id);
            let out = f(self);
            self.as_agent("agent-1");
            out
        }

        fn approve(&mut self, a: &Attempt) -> Result<Attempt, Error> {
            let cmd = ApproveCmd {
                permit_id: self.permit_id(),
                idempotency_key: a.idempotency_key.clone(),
                attempt_id: a.attempt_id.clone(),
            };
            let caller = self.caller.clone();
            self.run(|l, now| l.approve(&caller, &cmd, now))
        }

        fn deny(&mut self, a: &Attempt, reason: &str) -> Result<Settled, Error> {
            // The default DenyCmd::validate fills in (the test ids are
            // not UUIDs, which it also checks).
            let reason = if reason.is_empty() { DENIED } else { reason };
            let cmd = DenyCmd {
                permit_id: self.permit_id(),
                idempotency_key: a.idempotency_key.clone(),
                attempt_id: a.attempt_id.clone(),
                reason: reason.into(),
            };
            let caller = self.caller.clone();
            self.run(|l, now| l.deny(&caller, &cmd, now))
        }

        fn held(&self) -> (u64, i64) {
            let v = self.ledger.view(self.now);
            (v.usage[0].calls_made, v.budget_reserved)
        }
    }

    #[test]
    fn a_call_below_the_threshold_dispatches_and_one_at_it_waits_holding_slot_and_cost() {
        let mut b = bench(5);
        b.dispatch("t", "cheap", "fp", 99);
        let a = b.awaiting("t", "dear", 100);
        assert_eq!(
            b.held(),
            (2, 199),
            "the waiting call holds its slot and cost"
        );
        let approval = a.approval.expect("an approval");
        assert_eq!(approval.expires_at, T0 + WAIT);
        assert_eq!(approval.approvers_needed, 1);
        assert_eq!(a.lease_expires_at, 0, "no lease: nothing may be sent");
        // The same key, later: the same answer, with less time left.
        b.advance(1_000);
        let r = b.authorize("t", "dear", "fp", 100).expect("asked again");
        assert_eq!(r.decision, Decision::AwaitApproval);
        assert_eq!(r.approval_remaining_ms, WAIT - 1_000);
        assert_eq!(r.attempt.attempt_id, a.attempt_id);
        assert_eq!(b.held(), (2, 199), "asking again reserves nothing more");
        // Another agent asking with the key learns the state, not the id.
        b.as_agent("agent-2");
        let r = b
            .authorize("t", "dear", "fp", 100)
            .expect("asked by another");
        assert_eq!(r.decision, Decision::AwaitApproval);
        assert_eq!(r.attempt.attempt_id, "");
    }

    #[test]
    fn approved_the_requester_gets_one_dispatch_and_a_fresh_lease() {
        let mut b = bench(5);
        let a = b.awaiting("t", "k", 100);
        b.advance(5_000);
        let approved = b.as_approver("alice", |b| b.approve(&a)).expect("approved");
        assert_eq!(approved.state, AttemptState::Approved);
        let approval = approved.approval.expect("approval");
        assert_eq!(approval.approved_by, ["alice"]);
        assert_eq!(approval.decided_by, "alice");
        assert_eq!(approval.decided_at, T0 + 5_000);
        // Another agent cannot claim it.
        b.as_agent("agent-2");
        let r = b.authorize("t", "k", "fp", 100).expect("asked by another");
        assert_eq!(r.decision, Decision::AwaitApproval);
        b.as_agent("agent-1");
        b.advance(1_000);
        let r = b.authorize_as("t", "k", "fp", 100, "tok").expect("claimed");
        assert_eq!(r.decision, Decision::Dispatch);
        assert!(!r.redelivered);
        assert_eq!(r.attempt.state, AttemptState::Reserved);
        assert_eq!(r.attempt.attempt_id, a.attempt_id);
        assert_eq!(r.attempt.lease_expires_at, T0 + 6_000 + LEASE);
        assert_eq!(r.lease_remaining_ms, LEASE);
        // Exactly once: the same token is a redelivery, anything else waits.
        let again = b.authorize_as("t", "k", "fp", 100, "tok").expect("again");
        assert!(again.redelivered);
        assert_eq!(
            b.authorize("t", "k", "fp", 100).map(|r| r.decision),
            Err(Error::InProgress {
                idempotency_key: "k".into(),
                lease_expires_at: T0 + 6_000 + LEASE,
                retry_after_ms: LEASE,
            })
        );
        let done = b
            .commit(&r.attempt, succeeded("paid", None))
            .expect("committed");
        assert_eq!(done.attempt.state, AttemptState::Succeeded);
        assert_eq!(
            done.attempt.approval.expect("kept").approved_by,
            ["alice"],
            "the receipt's attempt says who approved it"
        );
        let replay = b.authorize("t", "k", "fp", 100).expect("replayed");
        assert_eq!(replay.decision, Decision::Replay);
    }

    #[test]
    fn nobody_approves_their_own_call_but_in_dev_mode_anyone_may() {
        let mut b = bench(5);
        let a = b.awaiting("t", "k", 100);
        assert_eq!(
            b.as_approver("agent-1", |b| b.approve(&a)),
            Err(Error::ApproverIsRequester {
                idempotency_key: "k".into()
            })
        );
        // Dev mode: no keys, every caller is "".
        let mut dev = Bench::with(|p| {
            p.approval_per_tool.insert(
                "t".into(),
                ApprovalRule {
                    cost_at_least: None,
                    wait_ms: WAIT,
                    approvers: 1,
                },
            );
        });
        let a = dev.authorize("t", "k", "fp", 1).expect("asked").attempt;
        assert_eq!(
            dev.approve(&a).expect("approved").state,
            AttemptState::Approved
        );
    }

    #[test]
    fn four_eyes_needs_two_distinct_approvers() {
        let mut b = bench(5);
        let a = b.awaiting("u", "k", 1);
        let once = b.as_approver("alice", |b| b.approve(&a)).expect("first");
        assert_eq!(once.state, AttemptState::AwaitingApproval);
        assert_eq!(
            once.approval.as_ref().expect("approval").approved_by,
            ["alice"]
        );
        // The same approver again changes nothing.
        let twice = b.as_approver("alice", |b| b.approve(&a)).expect("repeat");
        assert_eq!(twice, once);
        let r = b.authorize("u", "k", "fp", 1).expect("still waiting");
        assert_eq!(r.decision, Decision::AwaitApproval);
        let done = b.as_approver("bob", |b| b.approve(&a)).expect("second");
        assert_eq!(done.state, AttemptState::Approved);
        let approval = done.approval.clone().expect("approval");
        assert_eq!(approval.approved_by, ["alice", "bob"]);
        assert_eq!(approval.decided_by, "bob");
        // Repeats after completion answer as it is.
        assert_eq!(b.as_approver("alice", |b| b.approve(&a)), Ok(done.clone()));
        assert_eq!(
            b.authorize("u", "k", "fp", 1).expect("claimed").decision,
            Decision::Dispatch
        );
    }

    #[test]
    fn denied_returns_slot_and_cost_and_the_key_replays_the_denial() {
        let mut b = bench(1);
        let a = b.awaiting("t", "k", 100);
        assert_eq!(b.held(), (1, 100));
        assert!(matches!(
            b.authorize("t", "k2", "fp2", 100),
            Err(Error::MaxCallsExceeded { .. })
        ));
        let denied = b
            .as_approver("alice", |b| b.deny(&a, "too large"))
            .expect("denied");
        assert_eq!(denied.attempt.state, AttemptState::Denied);
        assert_eq!(denied.usage.calls_made, 0);
        assert_eq!(b.held(), (0, 0), "slot and cost came back");
        let approval = denied.attempt.approval.clone().expect("approval");
        assert_eq!(
            (
                approval.denial_reason.as_str(),
                approval.decided_by.as_str()
            ),
            ("too large", "alice")
        );
        let r = b.authorize("t", "k", "fp", 100).expect("replayed");
        assert_eq!(r.decision, Decision::Replay);
        assert_eq!(r.attempt.state, AttemptState::Denied);
        // The same denial again is the same; another decision conflicts.
        assert_eq!(
            b.as_approver("alice", |b| b.deny(&a, "too large"))
                .map(|s| s.attempt),
            Ok(denied.attempt.clone())
        );
        assert_eq!(
            b.as_approver("bob", |b| b.deny(&a, "other")),
            Err(conflict(AttemptState::Denied))
        );
        assert_eq!(
            b.as_approver("bob", |b| b.approve(&a)),
            Err(conflict(AttemptState::Denied))
        );
        // The slot is free for another key.
        b.awaiting("t", "k2", 100);
    }

    #[test]
    fn a_request_past_its_deadline_is_denied_for_every_reader_without_a_write() {
        let mut b = bench(1);
        let a = b.awaiting("t", "k", 100);
        b.at(T0 + WAIT);
        // Read before any write: DENIED, the slot and the cost free.
        let read = b.ledger.get_attempt("k", b.now).expect("read");
        assert_eq!(read.state, AttemptState::Denied);
        let approval = read.approval.expect("approval");
        assert_eq!(approval.denial_reason, APPROVAL_EXPIRED);
        assert_eq!(approval.decided_at, T0 + WAIT);
        assert_eq!(b.held(), (0, 0));
        assert_eq!(b.ledger.awaiting_after(None, 10, b.now), []);
        assert_eq!(
            b.as_approver("alice", |b| b.approve(&a)),
            Err(conflict(AttemptState::Denied))
        );
        let r = b.authorize("t", "k", "fp", 100).expect("replayed");
        assert_eq!(r.decision, Decision::Replay);
        assert_eq!(r.attempt.state, AttemptState::Denied);
        // The next key takes the slot the lapse returned.
        b.awaiting("t", "k2", 100);
        let stored = b.ledger.get_attempt("k", b.now).expect("read");
        assert_eq!(stored.approval.expect("a").denial_reason, APPROVAL_EXPIRED);
    }

    #[test]
    fn an_approval_its_requester_never_claims_lapses_and_returns_its_slot() {
        let mut b = bench(1);
        let a = b.awaiting("t", "k", 100);
        b.advance(WAIT - 1_000);
        b.as_approver("alice", |b| b.approve(&a)).expect("approved");
        // Claimable for a lease from the approval (later than the deadline).
        b.advance(LEASE - 1);
        assert_eq!(
            b.ledger.get_attempt("k", b.now).expect("read").state,
            AttemptState::Approved
        );
        b.advance(1);
        let read = b.ledger.get_attempt("k", b.now).expect("read");
        assert_eq!(read.state, AttemptState::Denied);
        assert_eq!(read.approval.expect("a").denial_reason, APPROVAL_UNCLAIMED);
        assert_eq!(b.held(), (0, 0));
        let r = b.authorize("t", "k", "fp", 100).expect("replayed");
        assert_eq!(r.decision, Decision::Replay);
    }

    #[test]
    fn pending_calls_never_exceed_the_cap_or_the_budget() {
        let mut b = bench(5);
        let mut waiting = 0;
        for i in 0..50 {
            match b.authorize("t", &format!("k{i}"), &format!("fp{i}"), 150) {
                Ok(r) => {
                    assert_eq!(r.decision, Decision::AwaitApproval);
                    waiting += 1;
                }
                Err(Error::MaxCallsExceeded { .. } | Error::BudgetExceeded { .. }) => {}
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(waiting, 5);
        assert_eq!(b.held(), (5, 750));
        assert_eq!(b.ledger.awaiting_after(None, 100, b.now).len(), 5);
    }

    #[test]
    fn revoking_denies_what_is_pending() {
        let mut b = bench(5);
        let a = b.awaiting("t", "k1", 100);
        let c = b.awaiting("t", "k2", 100);
        b.as_approver("alice", |b| b.approve(&c)).expect("approved");
        b.ledger.revoke(b.now);
        b.ledger.take_awaiting_change();
        for key in ["k1", "k2"] {
            let read = b.ledger.get_attempt(key, b.now).expect("read");
            assert_eq!(read.state, AttemptState::Denied, "{key}");
            assert_eq!(read.approval.expect("a").denial_reason, PERMIT_REVOKED);
        }
        assert_eq!(b.held(), (0, 0));
        assert_eq!(
            b.authorize("t", "k2", "fp", 100).map(|r| r.decision),
            Ok(Decision::Replay),
            "an approved call is not sent once its permit is revoked"
        );
        let _ = a;
    }

    #[test]
    fn approve_and_deny_need_the_attempt_id_and_settling_waits_for_the_dispatch() {
        let mut b = bench(5);
        let a = b.awaiting("t", "k", 100);
        let other = Attempt {
            attempt_id: "attempt-999".into(),
            ..a.clone()
        };
        let mismatch = Err(Error::AttemptMismatch {
            idempotency_key: "k".into(),
        });
        assert_eq!(b.as_approver("alice", |b| b.approve(&other)), mismatch);
        assert_eq!(
            b.as_approver("alice", |b| b.deny(&other, ""))
                .map(|s| s.attempt),
            mismatch
        );
        // Nothing was sent: nothing to commit or mark.
        assert_eq!(
            b.commit(&a, Outcome::NotSent),
            Err(conflict(AttemptState::AwaitingApproval))
        );
        assert_eq!(
            b.mark(&a, "lost"),
            Err(conflict(AttemptState::AwaitingApproval))
        );
        // A call that needed no approval cannot be approved.
        let plain = b.dispatch("t", "cheap", "fp", 1);
        assert_eq!(
            b.as_approver("alice", |b| b.approve(&plain)),
            Err(conflict(AttemptState::Reserved))
        );
    }

    #[test]
    fn the_duplicate_guard_sees_a_waiting_call_and_forgets_a_denied_one() {
        let mut b = bench(5);
        guard(&mut b.ledger.permit, GuardMode::Enforce);
        let a = b.awaiting("t", "k1", 100);
        assert!(matches!(
            b.authorize("t", "k2", "fp", 100),
            Err(Error::DuplicateSuspected { .. })
        ));
        b.as_approver("alice", |b| b.deny(&a, "no"))
            .expect("denied");
        b.awaiting("t", "k2", 100);
    }

    #[test]
    fn the_listing_is_oldest_first_and_skips_what_lapsed_or_was_decided() {
        let mut b = bench(10);
        let k1 = b.awaiting("t", "k1", 100);
        b.advance(1);
        b.ledger
            .permit
            .approval_per_tool
            .get_mut("t")
            .unwrap()
            .wait_ms = 10;
        b.awaiting("t", "k2", 100);
        b.advance(1);
        b.ledger
            .permit
            .approval_per_tool
            .get_mut("t")
            .unwrap()
            .wait_ms = WAIT;
        b.awaiting("t", "k3", 100);
        b.advance(1);
        b.awaiting("t", "k4", 100);
        b.as_approver("alice", |b| b.approve(&k1))
            .expect("approved");
        b.advance(10);
        let listed = |b: &Bench, after: Option<(Millis, &str)>| {
            b.ledger
                .awaiting_after(after, 10, b.now)
                .into_iter()
                .map(|a| a.idempotency_key)
                .collect::<Vec<_>>()
        };
        assert_eq!(listed(&b, None), ["k3", "k4"]);
        assert_eq!(listed(&b, Some((T0 + 2, "k3"))), ["k4"]);
        assert_eq!(b.ledger.awaiting_after(None, 1, b.now).len(), 1);
    }

    #[test]
    fn a_held_tool_holds_an_approved_call_too() {
        let mut b = bench(5);
        b.ledger.permit.uncertain_policy = UncertainPolicy::HoldTool;
        b.ledger.held = vec![BTreeSet::new(); b.ledger.permit.tools.len()];
        let big = b.awaiting("t", "big", 500);
        let small = b.dispatch("t", "small", "fp-small", 1);
        b.mark(&small, "lost").expect("marked");
        b.as_approver("alice", |b| b.approve(&big))
            .expect("approved");
        assert_eq!(
            b.authorize("t", "big", "fp", 500).map(|r| r.decision),
            Err(Error::ToolHeld {
                tool: "t".into(),
                uncertain_key: "small".into()
            })
        );
        b.as_admin("ops");
        b.resolve("small", failed("declined")).expect("resolved");
        b.as_agent("agent-1");
        assert_eq!(
            b.authorize("t", "big", "fp", 500).map(|r| r.decision),
            Ok(Decision::Dispatch),
            "the hold lifted, the approved call goes"
        );
    }

    #[test]
    fn the_duplicate_guard_sees_a_waiting_call_past_its_window() {
        let mut b = bench(5);
        guard(&mut b.ledger.permit, GuardMode::Enforce);
        b.awaiting("t", "k1", 100);
        b.advance(WINDOW + 1);
        assert!(matches!(
            b.authorize("t", "k2", "fp", 100),
            Err(Error::DuplicateSuspected { .. })
        ));
    }

    #[test]
    fn a_denied_duplicate_hands_the_guard_back_to_the_call_it_repeated() {
        let mut b = bench(5);
        let x = b.dispatch("t", "x", "fp", 1);
        b.commit(&x, succeeded("ok", None)).expect("committed");
        // LOG: the same request under a new key is flagged, and waits.
        let y = b.authorize("t", "y", "fp", 100).expect("asked");
        assert_eq!(y.duplicate_of.as_deref(), Some("x"));
        b.as_approver("alice", |b| b.deny(&y.attempt, "no"))
            .expect("denied");
        let z = b.authorize("t", "z", "fp", 100).expect("asked");
        assert_eq!(
            z.duplicate_of.as_deref(),
            Some("x"),
            "x is still the one it repeats"
        );
    }

    #[test]
    fn every_answer_counts_a_lapse_as_returned() {
        let mut b = bench(5);
        b.awaiting("t", "k", 100);
        b.at(T0 + WAIT);
        let replay = b.authorize("t", "k", "fp", 100).expect("replayed");
        assert_eq!(replay.decision, Decision::Replay);
        assert_eq!(replay.usage.calls_made, 0, "{replay:?}");
        assert_eq!(replay.usage.budget_remaining, Some(1000));
    }
}
