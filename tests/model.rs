//! Model-based test: random sequences of operations run against the pure
//! domain model (`Ledger`, what the memory store runs) and against the Redis
//! store on a real redis-server, with the same ids and the same clock. Every
//! observable result must be identical after every step, so the Lua scripts
//! are held to the reference semantics, including lease and permit expiry.

use crate::support::{Redis, redis_store_with, shared_blocking};
use atmost::domain::{
    ApprovalRule, ApproveCmd, Attempt, AttemptState, AuthorizeCmd, Authorized, CommitCmd, Decision,
    DenyCmd, DuplicateGuard, Error, GetAttemptCmd, GuardMode, MAX_AMOUNT, MarkUncertainCmd, Millis,
    Outcome, Permit, PermitStatus, Quotas, ResolveCmd, Scope, UncertainPolicy,
};
use atmost::store::{Cursor, Store, memory::MemoryStore, redis::RedisStore};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};

/// 2100-01-01: far past the wall clock, because Redis expires keys on its
/// own clock (PEXPIREAT at expiry plus retention) while the scripts decide
/// on this one (`Time::Caller`): a T0 the wall clock had passed would see
/// Redis delete permits the model keeps.
const T0: Millis = 4_102_444_800_000;
/// Short, so cases run past it: a permit is forgotten this long after its
/// expiry (or its last settle), on both stores at the same instant.
const RETENTION_MS: Millis = 8_000;
/// Three tools in scope, and one out of it.
const TOOLS: [&str; 4] = ["alpha", "beta", "gamma", "out.of.scope"];
const IN_SCOPE: usize = 3;
/// Odd but valid keys too: the characters ZRANGEBYLEX reads as range
/// markers (`(`, `[`, `-`, `+`), the highest printable one (`~`), and the
/// longest key allowed.
const KEYS: [&str; 7] = ["k0", "k1", "(k", "[k", "-", "+", "~"];

fn key_name(key: usize) -> String {
    match KEYS.get(key) {
        Some(k) => (*k).to_owned(),
        None => "k".repeat(atmost::domain::MAX_KEY_LEN),
    }
}

const KEY_COUNT: usize = KEYS.len() + 1;

#[derive(Debug, Clone)]
struct PermitConfig {
    cap_alpha: Option<u64>,
    cap_beta: Option<u64>,
    cap_gamma: Option<u64>,
    budget: Option<i64>,
    guard: GuardMode,
    window_ms: Millis,
    lease_ms: Millis,
    lifetime_ms: Millis,
    policy: UncertainPolicy,
    /// The approval rules of alpha and beta (gamma never has one).
    rule_alpha: Option<ApprovalRule>,
    rule_beta: Option<ApprovalRule>,
}

#[derive(Debug, Clone)]
enum Op {
    Authorize {
        permit: usize,
        tool: usize,
        key: usize,
        fp: u8,
        cost: i64,
        /// 0: no holder token; 1 and 2: two holders' tokens.
        token: u8,
    },
    Commit {
        permit: usize,
        key: usize,
        outcome: Outcome,
        stale_id: bool,
    },
    MarkUncertain {
        permit: usize,
        key: usize,
        reason: u8,
    },
    Resolve {
        permit: usize,
        key: usize,
        outcome: Outcome,
    },
    Revoke {
        permit: usize,
    },
    Get {
        permit: usize,
    },
    GetAttempt {
        permit: usize,
        key: usize,
    },
    List {
        permit: Option<usize>,
        limit: usize,
    },
    Advance {
        ms: Millis,
    },
    /// Both stores' housekeeping ([`Store::sweep`]); what it may drop, no
    /// later answer may miss.
    Sweep,
    /// Permit 2 created now, on the first such step (until then every
    /// operation on it fails alike): perhaps after the sweep let its
    /// tenant go with permit 0's last index entry.
    Create,
    /// A whole census pass on both stores ([`Store::census`]): the same
    /// UNCERTAIN attempts and the same oldest age, so no sweep hid a
    /// permit from it.
    Census,
    /// An approver approves the key's call (with `latest`, the call last
    /// answered AWAIT_APPROVAL, if any), with the attempt id the test last
    /// saw for it (or a stale one).
    Approve {
        permit: usize,
        key: usize,
        latest: bool,
        approver: Approver,
        stale_id: bool,
    },
    /// An approver denies it, for one of two reasons.
    Deny {
        permit: usize,
        key: usize,
        latest: bool,
        approver: Approver,
        reason: u8,
        stale_id: bool,
    },
    /// The Authorize last answered AWAIT_APPROVAL, sent again by this
    /// step's caller (0: no holder token; 1 and 2: two holders'): waiting
    /// still, its claim once approved, or its denial replayed.
    Again {
        token: u8,
    },
    /// ListApprovals, under one permit or across the approver's tenant,
    /// every page.
    ListApprovals {
        permit: Option<usize>,
        limit: usize,
        approver: Approver,
    },
}

/// Who approves or denies (an approver key is never an agent's: not
/// limited to a permit's agents, `api::tenant_of`).
#[derive(Debug, Clone, Copy)]
enum Approver {
    /// Two approver keys of the permit's tenant.
    Ap1,
    Ap2,
    /// The key ids that request calls: an approval by the requester is
    /// refused.
    A1,
    Admin,
    /// No key id.
    NoKeyId,
    /// Another tenant's approver: sees nothing.
    Stranger,
}

fn approver() -> impl Strategy<Value = Approver> {
    prop_oneof![
        4 => Just(Approver::Ap1),
        3 => Just(Approver::Ap2),
        2 => Just(Approver::A1),
        1 => Just(Approver::Admin),
        1 => Just(Approver::NoKeyId),
        1 => Just(Approver::Stranger),
    ]
}

/// The approver's scope about `permit`, as the Approvals service builds it
/// (`api::tenant_of`: never limited to an agent); in dev mode
/// `Scope::default()`.
fn approver_scope(permit: usize, approver: Approver, dev: bool) -> Scope {
    if dev {
        return Scope::default();
    }
    let own = TENANTS[permit % 2];
    let (tenant, key_id) = match approver {
        Approver::Ap1 => (own, "ap1"),
        Approver::Ap2 => (own, "ap2"),
        Approver::A1 => (own, "a1"),
        Approver::Admin => (own, "admin"),
        Approver::NoKeyId => (own, ""),
        Approver::Stranger => (TENANTS[(permit + 1) % 2], "b-ap"),
    };
    Scope {
        tenant: tenant.into(),
        agent: None,
        key_id: key_id.into(),
    }
}

/// An approval rule: for calls costing at least 1 to 3, or for every call;
/// a wait short enough for cases to run past it; one or two approvers.
fn approval_rule() -> impl Strategy<Value = Option<ApprovalRule>> {
    let rule = (proptest::option::of(1i64..4), 1_000i64..8_000, 1u32..=2).prop_map(
        |(cost_at_least, wait_ms, approvers)| ApprovalRule {
            cost_at_least,
            wait_ms,
            approvers,
        },
    );
    prop_oneof![2 => Just(None), 3 => rule.prop_map(Some)]
}

fn permit_config() -> impl Strategy<Value = PermitConfig> {
    (
        (
            proptest::option::of(0u64..4),
            proptest::option::of(0u64..3),
            proptest::option::of(0u64..7),
        ),
        proptest::option::of(0i64..12),
        prop_oneof![
            Just(GuardMode::Off),
            Just(GuardMode::Log),
            Just(GuardMode::Enforce)
        ],
        1_000i64..6_000,
        1_000i64..6_000,
        5_000i64..40_000,
        prop_oneof![
            Just(UncertainPolicy::Count),
            Just(UncertainPolicy::HoldTool)
        ],
        (approval_rule(), approval_rule()),
    )
        .prop_map(
            |(
                (cap_alpha, cap_beta, cap_gamma),
                budget,
                guard,
                window_ms,
                lease_ms,
                lifetime_ms,
                policy,
                (rule_alpha, rule_beta),
            )| PermitConfig {
                cap_alpha,
                cap_beta,
                cap_gamma,
                budget,
                guard,
                window_ms,
                lease_ms,
                lifetime_ms,
                policy,
                rule_alpha,
                rule_beta,
            },
        )
}

/// What Commit and Resolve accept: Succeeded, Failed or NotSent.
fn outcome() -> BoxedStrategy<Outcome> {
    let succeeded =
        (0u8..2, proptest::option::of(0i64..4)).prop_map(|(r, actual_cost)| Outcome::Succeeded {
            result: vec![r; r as usize + 1],
            actual_cost,
        });
    let failed = (0u8..2).prop_map(|r| Outcome::Failed {
        reason: format!("reason-{r}"),
    });
    prop_oneof![succeeded, failed, Just(Outcome::NotSent)].boxed()
}

/// Fingerprints 0 and 2 share their first 8 bytes but are different
/// requests, which the duplicate guard must tell apart.
fn fingerprint(n: u8) -> Vec<u8> {
    match n {
        2 => [[0u8; 8], [1u8; 8]].concat(),
        n => vec![n; 8],
    }
}

/// Mostly small costs, sometimes at the accounting ceiling.
fn cost() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => 0i64..4,
        1 => Just(MAX_AMOUNT / 2 + 1),
        1 => Just(MAX_AMOUNT),
    ]
}

/// The operations, the approval ones (Approve, Deny, Again, ListApprovals,
/// and Authorize of alpha and beta, the tools with rules) `approvals` times
/// their usual weight.
fn op(approvals: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..3, 0..TOOLS.len(), 0..KEY_COUNT, 0u8..3, cost(), 0u8..3)
            .prop_map(|(permit, tool, key, fp, cost, token)| Op::Authorize { permit, tool, key, fp, cost, token }),
        2 * approvals - 1 => (0usize..3, 0usize..2, 0..KEY_COUNT, 0u8..3, cost(), 0u8..3)
            .prop_map(|(permit, tool, key, fp, cost, token)| Op::Authorize { permit, tool, key, fp, cost, token }),
        4 => (0usize..3, 0..KEY_COUNT, outcome(), proptest::bool::weighted(0.1))
            .prop_map(|(permit, key, outcome, stale_id)| Op::Commit { permit, key, outcome, stale_id }),
        2 => (0usize..3, 0..KEY_COUNT, 0u8..2)
            .prop_map(|(permit, key, reason)| Op::MarkUncertain { permit, key, reason }),
        2 => (0usize..3, 0..KEY_COUNT, outcome())
            .prop_map(|(permit, key, outcome)| Op::Resolve { permit, key, outcome }),
        1 => (0usize..3).prop_map(|permit| Op::Revoke { permit }),
        1 => (0usize..3).prop_map(|permit| Op::Get { permit }),
        1 => (0usize..3, 0..KEY_COUNT).prop_map(|(permit, key)| Op::GetAttempt { permit, key }),
        1 => (proptest::option::of(0usize..3), 1usize..4)
            .prop_map(|(permit, limit)| Op::List { permit, limit }),
        3 => (0i64..4_000).prop_map(|ms| Op::Advance { ms }),
        // Far enough for expiry and retention to pass.
        1 => (10_000i64..50_000).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Sweep),
        1 => Just(Op::Create),
        1 => Just(Op::Census),
        3 * approvals => (0usize..3, 0..KEY_COUNT, proptest::bool::weighted(0.7), approver(), proptest::bool::weighted(0.1))
            .prop_map(|(permit, key, latest, approver, stale_id)| Op::Approve { permit, key, latest, approver, stale_id }),
        2 * approvals => (0usize..3, 0..KEY_COUNT, proptest::bool::weighted(0.5), approver(), 0u8..2, proptest::bool::weighted(0.1))
            .prop_map(|(permit, key, latest, approver, reason, stale_id)| Op::Deny { permit, key, latest, approver, reason, stale_id }),
        3 * approvals => (0u8..3).prop_map(|token| Op::Again { token }),
        approvals => (proptest::option::of(0usize..3), 1usize..4, approver())
            .prop_map(|(permit, limit, approver)| Op::ListApprovals { permit, limit, approver }),
    ]
}

fn permit_of(index: usize, c: &PermitConfig, dev: bool) -> Permit {
    let mut caps = BTreeMap::new();
    if let Some(n) = c.cap_alpha {
        caps.insert("alpha".to_string(), n);
    }
    if let Some(n) = c.cap_beta {
        caps.insert("beta".to_string(), n);
    }
    if let Some(n) = c.cap_gamma {
        caps.insert("gamma".to_string(), n);
    }
    // Four eyes need keys (PermitSpec::into_permit): one approver in dev
    // mode.
    let rules = [("alpha", c.rule_alpha), ("beta", c.rule_beta)]
        .into_iter()
        .filter_map(|(tool, rule)| {
            let rule = rule?;
            Some((
                tool.to_string(),
                ApprovalRule {
                    approvers: if dev { 1 } else { rule.approvers },
                    ..rule
                },
            ))
        })
        .collect();
    Permit {
        permit_id: uuid::Uuid::from_u128(0xA000 + index as u128).to_string(),
        subject: format!("model-{index}"),
        tools: TOOLS[..IN_SCOPE].iter().map(|t| t.to_string()).collect(),
        max_calls_per_tool: caps,
        budget: c.budget,
        currency: "EUR".into(),
        expires_at: T0 + c.lifetime_ms,
        lease_ms: c.lease_ms,
        duplicate_guard: DuplicateGuard {
            mode: c.guard,
            window_ms: c.window_ms,
        },
        uncertain_policy: c.policy,
        status: PermitStatus::Active,
        created_at: T0,
        // Permits 0 and 2 are one tenant's, 1 another's, limited to agent
        // a1; in dev mode all three are tenant "".
        tenant: if dev { "" } else { TENANTS[index % 2] }.into(),
        agents: if index == 1 {
            vec!["a1".into()]
        } else {
            Vec::new()
        },
        approval_per_tool: rules,
    }
}

const TENANTS: [&str; 2] = ["acme", "globex"];

/// Who makes a step's call, with keys configured.
#[derive(Debug, Clone, Copy)]
enum Caller {
    /// Agent key a1 of the permit's tenant, the one permit 1 names.
    A1,
    /// Agent key a2 of the permit's tenant: not named by permit 1, and
    /// not the holder of a1's attempts.
    A2,
    /// An admin key of the permit's tenant: holds every attempt, while an
    /// agent does not hold the ones it reserved.
    Admin,
    /// No key id: what an attempt recorded before attempts recorded their
    /// holder reads as (reserved by ""), which every agent holds.
    NoKeyId,
    /// Another tenant's agent key, then admin key: they must see nothing.
    Stranger,
    StrangerAdmin,
}

fn caller() -> impl Strategy<Value = Caller> {
    prop_oneof![
        8 => Just(Caller::A1),
        3 => Just(Caller::A2),
        3 => Just(Caller::Admin),
        1 => Just(Caller::NoKeyId),
        1 => Just(Caller::Stranger),
        1 => Just(Caller::StrangerAdmin),
    ]
}

/// The scope of `caller`'s step about `permit`, as the Gate builds it
/// (`api::scope_of`): a key's tenant and id, and its id as `agent` unless
/// the key is an admin's. In dev mode (no keys) every caller is
/// `Scope::default()`: tenant "", not limited, key id "".
fn scope_for(permit: usize, caller: Caller, dev: bool) -> Scope {
    if dev {
        return Scope::default();
    }
    let own = TENANTS[permit % 2];
    let other = TENANTS[(permit + 1) % 2];
    let (tenant, key_id, limited) = match caller {
        Caller::A1 => (own, "a1", true),
        Caller::A2 => (own, "a2", true),
        Caller::Admin => (own, "admin", false),
        Caller::NoKeyId => (own, "", false),
        Caller::Stranger => (other, "b1", true),
        Caller::StrangerAdmin => (other, "b-admin", false),
    };
    Scope {
        tenant: tenant.into(),
        agent: limited.then(|| key_id.into()),
        key_id: key_id.into(),
    }
}

/// The owner's scope, not limited to an agent: for the checks.
fn owner(permit: &Permit) -> Scope {
    Scope {
        tenant: permit.tenant.clone(),
        agent: None,
        key_id: "admin".into(),
    }
}

/// What the test saw answered, held to the promise itself and not only to
/// agreement between the stores: never two DISPATCHes for one key without a
/// NotSent between them, at most the cap of slots per tool (DISPATCHes less
/// releases), never more than the budget.
#[derive(Default)]
struct Promise {
    /// (permit, key) -> its latest DISPATCH's attempt id, and whether that
    /// attempt was released since.
    latest: HashMap<(usize, usize), (String, bool)>,
    /// (permit, tool) -> DISPATCHes less releases.
    slots: HashMap<(usize, String), u64>,
}

impl Promise {
    fn authorized(
        &mut self,
        permit: usize,
        key: usize,
        r: &Authorized,
    ) -> Result<(), TestCaseError> {
        if r.decision != Decision::Dispatch {
            return Ok(());
        }
        let id = &r.attempt.attempt_id;
        if r.redelivered {
            prop_assert_eq!(
                r.attempt.state,
                AttemptState::Reserved,
                "only a RESERVED attempt within its lease redelivers"
            );
            prop_assert_eq!(
                self.latest.get(&(permit, key)),
                Some(&(id.clone(), false)),
                "a redelivery must repeat the key's held attempt"
            );
            return Ok(());
        }
        if let Some((earlier, released)) = self.latest.get(&(permit, key)) {
            prop_assert!(
                *released,
                "{:?} dispatched again ({}) without NotSent after {}",
                key_name(key),
                id,
                earlier
            );
        }
        self.latest.insert((permit, key), (id.clone(), false));
        *self
            .slots
            .entry((permit, r.attempt.tool.clone()))
            .or_default() += 1;
        Ok(())
    }

    fn settled(&mut self, permit: usize, key: usize, attempt: &Attempt) {
        if attempt.state != AttemptState::Released {
            return;
        }
        if let Some((id, released)) = self.latest.get_mut(&(permit, key))
            && *id == attempt.attempt_id
            && !*released
        {
            *released = true;
            *self
                .slots
                .get_mut(&(permit, attempt.tool.clone()))
                .expect("a dispatched tool") -= 1;
        }
    }

    /// The store's own counts agree with what was given, and stay within
    /// the caps and the budget.
    async fn holds(
        &self,
        redis: &RedisStore,
        permits: &[Permit],
        now: Millis,
    ) -> Result<(), TestCaseError> {
        for (p, permit) in permits.iter().enumerate() {
            let view = match redis
                .get_permit(&owner(permit), &permit.permit_id, now)
                .await
            {
                Ok(view) => view,
                // Forgotten past its retention: nothing left to hold.
                Err(Error::PermitNotFound { .. }) => continue,
                Err(e) => return Err(TestCaseError::fail(e.to_string())),
            };
            for u in &view.usage {
                let given = self.slots.get(&(p, u.tool.clone())).copied().unwrap_or(0);
                // Calls waiting on approval (or approved, not yet claimed)
                // hold slots they were never dispatched with.
                if permit.approval_per_tool.contains_key(&u.tool) {
                    prop_assert!(
                        u.calls_made >= given,
                        "slots of {} under permit {}: {} held, {} given",
                        &u.tool,
                        p,
                        u.calls_made,
                        given
                    );
                } else {
                    prop_assert_eq!(
                        u.calls_made,
                        given,
                        "slots of {} under permit {}",
                        &u.tool,
                        p
                    );
                }
                if let Some(cap) = u.calls_limit {
                    prop_assert!(
                        u.calls_made <= cap,
                        "{} slots of {} past its cap {}",
                        u.calls_made,
                        &u.tool,
                        cap
                    );
                }
            }
            let budget = view.permit.budget.unwrap_or(MAX_AMOUNT);
            prop_assert!(
                view.budget_committed + view.budget_reserved <= budget,
                "permit {} over its budget: {:?}",
                p,
                view
            );
        }
        Ok(())
    }
}

/// The model keeps an internal back-pointer that no reader sees.
fn visible(mut a: Attempt) -> Attempt {
    a.duplicate_of = None;
    a
}

/// A step as a failure shows it: its caller (none in dev mode), its op.
struct Call<'a> {
    caller: Option<Caller>,
    op: &'a Op,
}

impl std::fmt::Debug for Call<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.caller {
            Some(caller) => write!(f, "as {caller:?}: {:?}", self.op),
            None => write!(f, "in dev mode: {:?}", self.op),
        }
    }
}

fn check<T: PartialEq + std::fmt::Debug>(
    step: usize,
    op: &impl std::fmt::Debug,
    model: T,
    redis: T,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        &model,
        &redis,
        "step {} {:?}: model (left) and Redis (right) differ",
        step,
        op
    );
    Ok(())
}

/// A whole census pass: (UNCERTAIN attempts, the oldest one's age).
async fn census_pass(store: &impl Store, now: Millis) -> Result<(u64, Millis), Error> {
    let figures = store.census(now, std::time::Duration::ZERO).await?;
    Ok((figures.uncertain, figures.oldest_age_ms))
}

/// What the cases reached, over a whole run: the approval paths must be
/// exercised, not only agreed on.
static AWAITED: AtomicUsize = AtomicUsize::new(0);
static CLAIMED: AtomicUsize = AtomicUsize::new(0);
static APPROVED: AtomicUsize = AtomicUsize::new(0);
static DENIED: AtomicUsize = AtomicUsize::new(0);
static LAPSED: AtomicUsize = AtomicUsize::new(0);
static REVOKED: AtomicUsize = AtomicUsize::new(0);
static LISTED: AtomicUsize = AtomicUsize::new(0);

fn count(counter: &AtomicUsize) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Counts what an attempt in an answer shows of its approval.
fn note_approval(a: &Attempt) {
    if let Some(approval) = &a.approval {
        match approval.denial_reason.as_str() {
            "approval_expired" | "approval_unclaimed" => count(&LAPSED),
            "permit_revoked" => count(&REVOKED),
            _ => {}
        }
    }
}

/// Quotas small enough for random sequences to reach them (of 8 keys, a
/// permit may record 6 and hold 4 open), so both stores refuse alike.
const QUOTAS: Quotas = Quotas {
    max_open_attempts: 4,
    max_attempts: 6,
    ..Quotas::DEFAULT
};

async fn run_case(
    url: &str,
    configs: &[PermitConfig; 2],
    dev: bool,
    ops: &[(Caller, Op)],
) -> Result<(), TestCaseError> {
    let model = MemoryStore::new(RETENTION_MS).with_quotas(QUOTAS);
    let prefix = format!("m{}", uuid::Uuid::now_v7().simple());
    let redis = redis_store_with(
        url,
        &prefix,
        std::time::Duration::from_secs(5),
        RETENTION_MS,
    )
    .with_quotas(QUOTAS);
    let mut permits: Vec<Permit> = configs
        .iter()
        .enumerate()
        .map(|(i, c)| permit_of(i, c, dev))
        .collect();
    for p in &permits {
        let a = model.create_permit(p.clone()).await;
        let b = redis.create_permit(p.clone()).await;
        check(0, &Op::Get { permit: 0 }, a, b)?;
    }
    // A permit id given twice (only a bug could): both refuse it alike and
    // keep the first.
    let again = permits[0].clone();
    check(
        0,
        &Op::Get { permit: 0 },
        model.create_permit(again.clone()).await,
        redis.create_permit(again).await,
    )?;
    // Permit 2 is not created until an Op::Create: until then every
    // operation on it must fail alike.
    permits.push(permit_of(2, &configs[0], dev));
    let mut created_late = false;
    let mut now = T0;
    // Ids carry their creation time, as the service makes them.
    let fresh = |now| atmost::domain::new_id(now);
    // The attempt id each key last received, as a holder would keep it.
    let mut held: HashMap<(usize, usize), String> = HashMap::new();
    let mut promise = Promise::default();
    // The Authorize last answered AWAIT_APPROVAL: (permit, key, command).
    let mut waiting: Option<(usize, usize, AuthorizeCmd)> = None;

    for (step, (caller, op)) in ops.iter().enumerate() {
        let call = &Call {
            caller: (!dev).then_some(*caller),
            op,
        };
        let scope = |permit| scope_for(permit, *caller, dev);
        match op {
            Op::Again { token } => {
                let Some((permit, key, cmd)) = &waiting else {
                    continue;
                };
                let (permit, key) = (*permit, *key);
                let cmd = AuthorizeCmd {
                    holder_token: match token {
                        0 => Vec::new(),
                        n => format!("holder-{n}").into_bytes(),
                    },
                    ..cmd.clone()
                };
                let id = fresh(now);
                let a = model.authorize(&scope(permit), &cmd, now, id.clone()).await;
                let b = redis.authorize(&scope(permit), &cmd, now, id).await;
                if let Ok(r) = &a
                    && !r.attempt.attempt_id.is_empty()
                {
                    held.insert((permit, key), r.attempt.attempt_id.clone());
                }
                let a = a.map(|mut r| {
                    r.attempt = visible(r.attempt);
                    r
                });
                if let Ok(r) = &a {
                    promise.authorized(permit, key, r)?;
                    match r.decision {
                        Decision::AwaitApproval => count(&AWAITED),
                        Decision::Dispatch if r.attempt.approval.is_some() && !r.redelivered => {
                            count(&CLAIMED)
                        }
                        _ => note_approval(&r.attempt),
                    }
                }
                check(step, call, a, b)?;
            }
            Op::Authorize {
                permit,
                tool,
                key,
                fp,
                cost,
                token,
            } => {
                let cmd = AuthorizeCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    tool: TOOLS[*tool].into(),
                    idempotency_key: key_name(*key),
                    request_fingerprint: fingerprint(*fp),
                    cost: *cost,
                    holder_token: match token {
                        0 => Vec::new(),
                        n => format!("holder-{n}").into_bytes(),
                    },
                    approval_summary: format!("call {key} for {cost}"),
                };
                let id = fresh(now);
                let a = model
                    .authorize(&scope(*permit), &cmd, now, id.clone())
                    .await;
                let b = redis.authorize(&scope(*permit), &cmd, now, id).await;
                // The id, when this caller was given it (a REPLAY to
                // another agent withholds it: the id known stays).
                if let Ok(r) = &a
                    && !r.attempt.attempt_id.is_empty()
                {
                    held.insert((*permit, *key), r.attempt.attempt_id.clone());
                }
                let a = a.map(|mut r| {
                    r.attempt = visible(r.attempt);
                    r
                });
                if let Ok(r) = &a {
                    promise.authorized(*permit, *key, r)?;
                    if r.decision == Decision::AwaitApproval {
                        waiting = Some((*permit, *key, cmd.clone()));
                    }
                    match r.decision {
                        Decision::AwaitApproval => count(&AWAITED),
                        Decision::Dispatch if r.attempt.approval.is_some() && !r.redelivered => {
                            count(&CLAIMED)
                        }
                        _ => note_approval(&r.attempt),
                    }
                }
                check(step, call, a, b)?;
            }
            Op::Commit {
                permit,
                key,
                outcome,
                stale_id,
            } => {
                let attempt_id = match (held.get(&(*permit, *key)), stale_id) {
                    (Some(id), false) => id.clone(),
                    _ => uuid::Uuid::from_u128(u128::MAX).to_string(),
                };
                let cmd = CommitCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                    attempt_id,
                    outcome: outcome.clone(),
                };
                let id = fresh(now);
                let a = model
                    .commit(&scope(*permit), &cmd, now, id.clone())
                    .await
                    .map(|mut s| {
                        s.attempt = visible(s.attempt);
                        s
                    });
                let b = redis.commit(&scope(*permit), &cmd, now, id).await;
                if let Ok(s) = &a {
                    promise.settled(*permit, *key, &s.attempt);
                }
                check(step, call, a, b)?;
            }
            Op::MarkUncertain {
                permit,
                key,
                reason,
            } => {
                let cmd = MarkUncertainCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                    attempt_id: held
                        .get(&(*permit, *key))
                        .cloned()
                        .unwrap_or_else(|| uuid::Uuid::from_u128(u128::MAX).to_string()),
                    reason: format!("lost-{reason}"),
                };
                let a = model
                    .mark_uncertain(&scope(*permit), &cmd, now)
                    .await
                    .map(visible);
                let b = redis.mark_uncertain(&scope(*permit), &cmd, now).await;
                check(step, call, a, b)?;
            }
            Op::Resolve {
                permit,
                key,
                outcome,
            } => {
                let cmd = ResolveCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                    // The attempt a reconciler would have listed, when the
                    // test saw one; NotSent without one is the edge's to refuse.
                    attempt_id: held.get(&(*permit, *key)).cloned().unwrap_or_default(),
                    outcome: outcome.clone(),
                };
                let id = fresh(now);
                let a = model
                    .resolve(&scope(*permit), &cmd, now, id.clone())
                    .await
                    .map(|mut s| {
                        s.attempt = visible(s.attempt);
                        s
                    });
                let b = redis.resolve(&scope(*permit), &cmd, now, id).await;
                if let Ok(s) = &a {
                    promise.settled(*permit, *key, &s.attempt);
                }
                check(step, call, a, b)?;
            }
            Op::Revoke { permit } => {
                let id = &permits[*permit].permit_id;
                check(
                    step,
                    call,
                    model.revoke_permit(&scope(*permit), id, now).await,
                    redis.revoke_permit(&scope(*permit), id, now).await,
                )?;
            }
            Op::Get { permit } => {
                let id = &permits[*permit].permit_id;
                check(
                    step,
                    call,
                    model.get_permit(&scope(*permit), id, now).await,
                    redis.get_permit(&scope(*permit), id, now).await,
                )?;
            }
            Op::GetAttempt { permit, key } => {
                let cmd = GetAttemptCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                };
                let a = model
                    .get_attempt(&scope(*permit), &cmd, now)
                    .await
                    .map(visible);
                if let Ok(attempt) = &a {
                    note_approval(attempt);
                }
                let b = redis.get_attempt(&scope(*permit), &cmd, now).await;
                check(step, call, a, b)?;
            }
            Op::List { permit, limit } => {
                let id = permit.map(|p| permits[p].permit_id.clone());
                // Listings are an operator's: not limited to one agent.
                let scope = Scope {
                    agent: None,
                    ..scope(permit.unwrap_or(step % 2))
                };
                let mut after: Option<Cursor> = None;
                loop {
                    let a = model
                        .list_uncertain(&scope, id.as_deref(), after.as_ref(), *limit, now)
                        .await;
                    let b = redis
                        .list_uncertain(&scope, id.as_deref(), after.as_ref(), *limit, now)
                        .await;
                    let a = a.map(|mut p| {
                        p.attempts = p.attempts.into_iter().map(visible).collect();
                        p
                    });
                    check(step, call, a.clone(), b)?;
                    match a.ok().and_then(|p| p.next) {
                        Some(next) => after = Some(next),
                        None => break,
                    }
                }
            }
            Op::Approve {
                permit,
                key,
                latest,
                approver,
                stale_id,
            } => {
                let (permit, key) = match (&waiting, latest) {
                    (Some((p, k, _)), true) => (p, k),
                    _ => (permit, key),
                };
                let cmd = ApproveCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                    attempt_id: match (held.get(&(*permit, *key)), stale_id) {
                        (Some(id), false) => id.clone(),
                        _ => uuid::Uuid::from_u128(u128::MAX).to_string(),
                    },
                };
                let scope = approver_scope(*permit, *approver, dev);
                let a = model.approve(&scope, &cmd, now).await.map(visible);
                let b = redis.approve(&scope, &cmd, now).await;
                if let Ok(attempt) = &a
                    && attempt.state == AttemptState::Approved
                {
                    count(&APPROVED);
                }
                check(step, call, a, b)?;
            }
            Op::Deny {
                permit,
                key,
                latest,
                approver,
                reason,
                stale_id,
            } => {
                let (permit, key) = match (&waiting, latest) {
                    (Some((p, k, _)), true) => (p, k),
                    _ => (permit, key),
                };
                let cmd = DenyCmd {
                    permit_id: permits[*permit].permit_id.clone(),
                    idempotency_key: key_name(*key),
                    attempt_id: match (held.get(&(*permit, *key)), stale_id) {
                        (Some(id), false) => id.clone(),
                        _ => uuid::Uuid::from_u128(u128::MAX).to_string(),
                    },
                    // The reasons a lapse and a revocation write too: a
                    // denial repeated for one of them answers the same.
                    reason: ["too large", "approval_expired"][usize::from(*reason)].into(),
                };
                let scope = approver_scope(*permit, *approver, dev);
                let a = model.deny(&scope, &cmd, now).await.map(|mut s| {
                    s.attempt = visible(s.attempt);
                    s
                });
                let b = redis.deny(&scope, &cmd, now).await;
                if a.is_ok() {
                    count(&DENIED);
                }
                check(step, call, a, b)?;
            }
            Op::ListApprovals {
                permit,
                limit,
                approver,
            } => {
                let id = permit.map(|p| permits[p].permit_id.clone());
                let scope = approver_scope(permit.unwrap_or(step % 2), *approver, dev);
                let mut after: Option<Cursor> = None;
                loop {
                    let a = model
                        .list_approvals(&scope, id.as_deref(), after.as_ref(), *limit, now)
                        .await
                        .map(|mut p| {
                            p.attempts = p.attempts.into_iter().map(visible).collect();
                            p
                        });
                    let b = redis
                        .list_approvals(&scope, id.as_deref(), after.as_ref(), *limit, now)
                        .await;
                    if let Ok(page) = &a {
                        LISTED.fetch_add(page.attempts.len(), Ordering::Relaxed);
                    }
                    check(step, call, a.clone(), b)?;
                    match a.ok().and_then(|p| p.next) {
                        Some(next) => after = Some(next),
                        None => break,
                    }
                }
            }
            Op::Advance { ms } => now += ms,
            Op::Create if !created_late => {
                created_late = true;
                let late = Permit {
                    created_at: now,
                    expires_at: now + configs[0].lifetime_ms,
                    ..permit_of(2, &configs[0], dev)
                };
                permits[2] = late.clone();
                check(
                    step,
                    call,
                    model.create_permit(late.clone()).await,
                    redis.create_permit(late).await,
                )?;
            }
            Op::Create => {}
            Op::Census => check(
                step,
                call,
                census_pass(&model, now).await,
                census_pass(&redis, now).await,
            )?,
            Op::Sweep => {
                let a = model.sweep(now).await;
                let b = redis.sweep(now).await;
                prop_assert!(a.is_ok() && b.is_ok(), "sweep: {:?} {:?}", a, b);
            }
        }
        promise.holds(&redis, &permits[..2], now).await?;
    }
    // Finally, the whole state must agree.
    for p in &permits {
        check(
            ops.len(),
            &Op::Get { permit: 0 },
            model.get_permit(&owner(p), &p.permit_id, now).await,
            redis.get_permit(&owner(p), &p.permit_id, now).await,
        )?;
    }
    Ok(())
}

#[test]
fn redis_store_matches_the_model() {
    let _machine = shared_blocking();
    // One redis-server for the whole property, stopped when this test ends
    // (pass or fail); each case uses its own key prefix.
    let redis = Redis::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // MODEL_CASES=5000 for a deeper run than CI's.
    let cases = std::env::var("MODEL_CASES").map_or(256, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("MODEL_CASES={v:?}: not a number of cases"))
    });
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        max_shrink_iters: 4_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strategy = (
        [permit_config(), permit_config()],
        // One case in eight runs in dev mode (no keys), where every step's
        // caller is Scope::default() whatever Caller was drawn.
        proptest::bool::weighted(0.125),
        // Half the cases weigh the approval operations three times.
        prop_oneof![
            proptest::collection::vec((caller(), op(1)), 1..60),
            proptest::collection::vec((caller(), op(3)), 1..60),
        ],
    );
    let result = runner.run(&strategy, |(configs, dev, ops)| {
        rt.block_on(run_case(&redis.url, &configs, dev, &ops))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The approval paths were taken, not only agreed on (with the default
    // 256 cases, each many times).
    let reached = [
        ("AWAIT_APPROVAL answers", &AWAITED),
        ("claims of an approved call", &CLAIMED),
        ("approvals completed", &APPROVED),
        ("denials answered", &DENIED),
        ("lapsed requests read", &LAPSED),
        ("requests denied by a revocation read", &REVOKED),
        ("calls listed awaiting approval", &LISTED),
    ]
    .map(|(what, n)| (what, n.load(Ordering::Relaxed)));
    eprintln!("model: {cases} cases reached {reached:?}");
    if cases >= 64 {
        for (what, n) in reached {
            assert!(n > 0, "no {what} in {cases} cases: {reached:?}");
        }
    }
}
