//! An exhaustive model check of atmost's protocol (issue 24; docs/guarantees.md,
//! "Model-checked").
//!
//! The system around one permit: agents that Authorize, send, Commit,
//! MarkUncertain, retry with the same key or give up, present a holder
//! token, crash and restart with or without their memory; one operator who
//! lists what is UNCERTAIN and Resolves it with what the tool's provider
//! says; a store that takes any request off the network and runs it (one
//! serving loop stands for any number of replicas: they hold no state, and
//! each request is one atomic step of the store, so N replicas interleave
//! exactly as the requests do); a network that loses, duplicates and reorders requests and
//! replies (a lost reply is also a replica whose answer came too late:
//! after the store applied it); and a clock whose steps end leases and the
//! permit. The store is the **real [`Ledger`]**, the reference semantics
//! the memory store runs and the Redis scripts are held to
//! (tests/model.rs): not a copy.
//!
//! [stateright] explores every state reachable within the [`Bounds`] and
//! checks the [`Protocol`]'s properties in each: the promise as the world
//! sees it (what was really sent and charged), not only the ledger's
//! accounting. [`Holes`] puts back the two protocol holes of issue 24, so
//! a test shows the check finds each.
//!
//! With [`Bounds::gateway`] the callers are HTTP clients behind one
//! gateway (Envoy with atmost's ext_proc door, docs/gateways.md): each
//! request is one stream that Authorizes under the gateway's key with no
//! holder token, forwards to the tool only on DISPATCH, may lose the
//! tool's response, and reports as the door does (Succeeded, Failed,
//! NotSent if never forwarded, MarkUncertain or nothing once the response
//! is lost). Two more [`Holes`] break that gateway.
//!
//! With [`Bounds::approvers`] the permit's tool needs human approval for
//! every call (issue 27): an Authorize reserves the slot and the cost and
//! answers AWAIT_APPROVAL; approvers (keys of their own, never an agent's)
//! Approve or Deny what they see listed, as ListApprovals shows it or as
//! it showed it a while ago (a decision may come on a stale listing); a
//! request lapses at its deadline, an approval unclaimed at its claim
//! deadline; the requester asks again with the same key and holder token,
//! and its Authorize claims the approved call (one DISPATCH, redelivered
//! to the same token if its answer is lost). The operator may revoke the
//! permit. Two more [`Holes`] break approval.
//!
//! What the agents do is the clients' contract (docs/clients.md), written
//! here as a state machine: the model checks the protocol those rules and
//! the Ledger make together, not the clients' code.

#![forbid(unsafe_code)]

use atmost::domain::{
    APPROVAL_EXPIRED, APPROVAL_UNCLAIMED, ApprovalRule, ApproveCmd, AttemptState, AuthorizeCmd,
    CommitCmd, DENIED, Decision, DenyCmd, DuplicateGuard, Error, GuardMode, LEASE_EXPIRED, Ledger,
    MarkUncertainCmd, Millis, Outcome, PERMIT_REVOKED, Permit, PermitStatus, Quotas, ResolveCmd,
    Scope, UncertainPolicy,
};
use stateright::{Model, Property};
use std::collections::BTreeMap;

// === the world ===

/// The one tool, capped at [`Limit::cap`] calls.
pub const TOOL: &str = "wallet.charge";
/// Every call's cost.
pub const COST: i64 = 100;
/// The idempotency keys agents choose from: the same key is the same
/// request (the same fingerprint), whichever agent sends it.
pub const KEYS: [&str; 2] = ["k1", "k2"];
/// One clock step.
pub const TICK_MS: Millis = 1_000;
/// A lease lasts two steps; the permit expires after three.
pub const LEASE_TICKS: u8 = 2;
pub const EXPIRY_TICKS: u8 = 3;
/// A call needing approval waits two steps for it (at most until the
/// permit expires); approved, it may be claimed for a lease from the
/// approval, or until the request's own deadline if that is later.
pub const APPROVAL_WAIT_TICKS: u8 = 2;
const T0: Millis = 1_767_225_600_000;
const PERMIT_ID: &str = "0190f3a2-7b1c-7d4e-8f00-0123456789ab";
/// Most attempts ListUncertain returns in one page (the model never holds
/// more).
const PAGE: usize = 16;

/// Which of the permit's limits the search puts at one call, the other at
/// two: a limit of two calls no bounded search here can exceed, so each
/// search checks one limit, and the other holds only as a bystander.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Limit {
    /// One call per tool; a budget of two calls: only the cap can refuse
    /// a second key.
    Cap,
    /// A budget of one call; two calls per tool: only the budget can
    /// refuse a second key.
    Budget,
}

impl Limit {
    pub fn cap(self) -> u64 {
        match self {
            Limit::Cap => 1,
            Limit::Budget => 2,
        }
    }

    pub fn budget(self) -> i64 {
        match self {
            Limit::Cap => 2 * COST,
            Limit::Budget => COST,
        }
    }
}

/// How far the search goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The limit at one call.
    pub limit: Limit,
    /// Agents, each with its own agent key (`agent-0`, `agent-1`, ...).
    pub agents: u8,
    /// Logical calls each agent makes (each with a key it chooses).
    pub calls: u8,
    /// Tries of one RPC, the first included.
    pub tries: u8,
    /// Crashes, of all agents together.
    pub crashes: u8,
    /// Messages the network may lose (a lost reply is also a replica that
    /// answered after its caller's deadline).
    pub losses: u8,
    /// Requests it may deliver twice.
    pub duplicates: u8,
    /// Commits (NotSent) or MarkUncertains an agent sends for another
    /// agent's attempt, its id learnt elsewhere (a log, an upstream's
    /// header).
    pub leaks: u8,
    /// Clock steps.
    pub ticks: u8,
    /// The agents are HTTP clients behind one gateway, each call one
    /// request (one ext_proc stream): see [`Phase::Forwarded`].
    pub gateway: bool,
    /// Approvals every call of the tool needs (1 or 2; 0: no approval
    /// rule, every call dispatches at once).
    pub approvers: u8,
    /// Approvers, each with its own key (`approver-0`, ...), none an
    /// agent's.
    pub approver_keys: u8,
    /// Times an agent told AWAIT_APPROVAL asks again (the same request,
    /// key and holder token), each with its own `tries`.
    pub polls: u8,
    /// The operator may revoke the permit (once), which denies every
    /// pending call.
    pub revoke: bool,
}

impl Bounds {
    /// What `cargo test` explores on every run, in three searches (each
    /// state count is in docs/guarantees.md): several agents on one key,
    /// over a network that loses and duplicates, one of them settling
    /// another's attempt by a leaked id, under the cap ...
    pub const AGENTS: Bounds = Bounds {
        limit: Limit::Cap,
        agents: 2,
        calls: 1,
        tries: 1,
        crashes: 0,
        losses: 1,
        duplicates: 1,
        leaks: 1,
        ticks: 3,
        gateway: false,
        approvers: 0,
        approver_keys: 0,
        polls: 0,
        revoke: false,
    };

    /// ... the same under the budget (no leaked id: the holder check is
    /// the same under either limit) ...
    pub const AGENTS_BUDGET: Bounds = Bounds {
        limit: Limit::Budget,
        leaks: 0,
        ..Self::AGENTS
    };

    /// ... and one agent that retries, crashes and restarts, with or
    /// without its memory.
    pub const RESTARTS: Bounds = Bounds {
        limit: Limit::Cap,
        agents: 1,
        calls: 1,
        tries: 2,
        crashes: 1,
        losses: 1,
        duplicates: 0,
        leaks: 0,
        ticks: 3,
        gateway: false,
        approvers: 0,
        approver_keys: 0,
        polls: 0,
        revoke: false,
    };

    /// A fourth search: two requests behind the gateway under the cap, of
    /// one key (the store cannot tell a client's retry from another
    /// client's request: one gateway key, no holder token, so only the
    /// attempt id fences a late outcome) or of two, over a network that
    /// loses one message (`--duplicates 1` as well: 7 times the states).
    pub const GATEWAY: Bounds = Bounds {
        limit: Limit::Cap,
        agents: 2,
        calls: 1,
        tries: 1,
        crashes: 0,
        losses: 1,
        duplicates: 0,
        leaks: 0,
        ticks: 3,
        gateway: true,
        approvers: 0,
        approver_keys: 0,
        polls: 0,
        revoke: false,
    };

    /// Human approval (issue 27), three more searches, every call
    /// needing approval. Two agents on one key or two, each asking once
    /// more after AWAIT_APPROVAL, one approver, over a network that loses
    /// one message, under the cap (a pending call holds its slot: another
    /// key is refused) ...
    pub const APPROVALS: Bounds = Bounds {
        limit: Limit::Cap,
        agents: 2,
        calls: 1,
        tries: 1,
        crashes: 0,
        losses: 1,
        duplicates: 0,
        leaks: 0,
        ticks: 3,
        gateway: false,
        approvers: 1,
        approver_keys: 1,
        polls: 1,
        revoke: false,
    };

    /// ... one agent that crashes and restarts, with or without its
    /// memory, its call needing two approvers, the operator free to
    /// revoke the permit ...
    pub const APPROVALS_RESTARTS: Bounds = Bounds {
        limit: Limit::Cap,
        agents: 1,
        calls: 1,
        tries: 1,
        crashes: 1,
        losses: 1,
        duplicates: 0,
        leaks: 0,
        ticks: 3,
        gateway: false,
        approvers: 2,
        approver_keys: 2,
        polls: 1,
        revoke: true,
    };

    /// ... and one agent that retries each RPC once: a claim whose answer
    /// was lost is redelivered to the same holder token, which sends it.
    pub const APPROVALS_RETRIES: Bounds = Bounds {
        tries: 2,
        crashes: 0,
        approvers: 1,
        approver_keys: 1,
        revoke: false,
        ..Self::APPROVALS_RESTARTS
    };

    /// Two requests behind the gateway, every call needing one approval:
    /// the door answers the first 202 (AWAITING_APPROVAL), and a request
    /// of the same key, once approved, claims it.
    pub const GATEWAY_APPROVALS: Bounds = Bounds {
        approvers: 1,
        approver_keys: 1,
        ..Self::GATEWAY
    };
}

/// The protocol holes of issue 24, broken gateways and broken approvals,
/// put back for the tests that show the check finds them. None is
/// reachable otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holes {
    /// Hole 1: the store does not know which agent calls (every agent key
    /// runs unlimited, as before attempts recorded who reserved them), so a
    /// REPLAY hands any agent an open attempt's id and its Commit counts.
    pub store_ignores_the_agent: bool,
    /// Hole 2: the client sends on every redelivered DISPATCH, also after a
    /// restart that kept its holder token, with a deadline of a whole lease
    /// from when the answer arrived.
    pub client_sends_on_any_redelivery: bool,
    /// Half of hole 1's fix taken out: a REPLAY still withholds the id,
    /// but Commit and MarkUncertain do not check who reserved the attempt
    /// (they run as an operator's would), so an id learnt elsewhere
    /// settles it.
    pub settle_ignores_the_holder: bool,
    /// A gateway that forwards the request on its headers without waiting
    /// for atmost's DISPATCH (as with ext_proc's observability mode, or a
    /// processor failure with `failure_mode_allow: true`).
    pub gateway_forwards_before_dispatch: bool,
    /// A gateway that commits NotSent when the tool's response is lost
    /// (taking the lost response for a request that never left).
    pub gateway_not_sent_after_lost_response: bool,
    /// A client that takes AWAIT_APPROVAL for a go (it got an attempt id)
    /// and sends within a lease from then.
    pub client_sends_on_await_approval: bool,
    /// The approver role not kept from agents' keys, and Approve run
    /// without the caller's key id (as in dev mode, where every caller is
    /// the empty key id and the store cannot tell the requester from an
    /// approver): an agent approves its own call.
    pub requester_approves: bool,
}

/// The model: bounds, and which holes are planted.
#[derive(Debug, Clone, Copy)]
pub struct Protocol {
    pub bounds: Bounds,
    pub holes: Holes,
}

/// A key, by its index in [`KEYS`].
type Key = u8;
/// An attempt: its key and how many reservations of that key came before.
pub type Gen = (Key, u8);

fn attempt_id((key, generation): Gen) -> String {
    format!("{}.{generation}", KEYS[usize::from(key)])
}

fn parse_attempt(id: &str) -> Option<Gen> {
    let (key, generation) = id.split_once('.')?;
    let key = KEYS.iter().position(|k| *k == key)?;
    Some((key as Key, generation.parse().ok()?))
}

fn agent_name(agent: u8) -> String {
    format!("agent-{agent}")
}

fn approver_name(approver: u8) -> String {
    format!("approver-{approver}")
}

/// Who approved a call, as a bit of [`Fate::approvals`]: approvers first,
/// agents from bit 8.
fn approver_bit(approver: u8) -> u16 {
    1 << approver
}

fn agent_bit(agent: u8) -> u16 {
    1 << (8 + agent)
}

// === the state ===

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// Clock steps since the start.
    pub now: u8,
    pub ledger: Ledger,
    pub agents: Vec<Agent>,
    /// Messages in flight, sorted (a multiset).
    pub net: Vec<Msg>,
    pub crashes_left: u8,
    pub losses_left: u8,
    pub duplicates_left: u8,
    pub leaks_left: u8,
    /// What really happened, which no participant sees whole.
    pub world: World,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Agent {
    pub calls_left: u8,
    /// The current logical call's number (its holder token's).
    pub call: u8,
    /// The last request sent; only its reply is read.
    pub seq: u8,
    pub phase: Phase,
    /// What the agent's own durable memory holds of the current call: kept
    /// by a restart "with memory", lost by one without.
    pub journal: Option<Journal>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Journal {
    pub key: Key,
    pub token: u8,
    /// Written before sending: the call may have left.
    pub maybe_sent: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    /// Waiting for Authorize's answer.
    Authorizing {
        key: Key,
        token: u8,
        /// A restarted run of an earlier call, with its journal.
        restored: bool,
        maybe_sent: bool,
        tries: u8,
        /// Times it asked again after AWAIT_APPROVAL.
        polls: u8,
    },
    /// Told AWAIT_APPROVAL (with the attempt's id, if its own): it asks
    /// again later with the same key and holder token, gives up or
    /// crashes.
    Awaiting {
        key: Key,
        token: u8,
        restored: bool,
        maybe_sent: bool,
        polls: u8,
        attempt: Option<Gen>,
    },
    /// Told REPLAY of an UNCERTAIN attempt, with its id when atmost gave
    /// it: the agent accepts it, or settles what it was handed.
    Replayed {
        key: Key,
        attempt: Gen,
    },
    /// Holding a DISPATCH: may send before `deadline` (a clock step).
    Holding {
        key: Key,
        attempt: Gen,
        deadline: u8,
    },
    /// Behind the gateway only: the request was forwarded on a DISPATCH
    /// and the tool ran it, answering `result` (Succeeded or Failed), an
    /// answer the gateway has not seen yet and may never see.
    Forwarded {
        key: Key,
        attempt: Gen,
        result: Report,
    },
    /// Waiting for Commit's or MarkUncertain's answer.
    Reporting {
        key: Key,
        attempt: Gen,
        report: Report,
        tries: u8,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Report {
    Succeeded,
    Failed,
    NotSent,
    Uncertain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Msg {
    Request { agent: u8, seq: u8, body: Request },
    Reply { agent: u8, seq: u8, body: Reply },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Request {
    Authorize {
        key: Key,
        token: u8,
    },
    Report {
        key: Key,
        attempt: Gen,
        report: Report,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reply {
    /// A DISPATCH, and the clock step its lease ends at (from
    /// `lease_remaining`).
    Dispatch {
        attempt: Gen,
        redelivered: bool,
        lease_end: u8,
    },
    /// A REPLAY: of an UNCERTAIN attempt (with its id, if given) or a
    /// settled one.
    Replay {
        attempt: Option<Gen>,
        uncertain: bool,
    },
    InProgress,
    /// AWAIT_APPROVAL: pending (or approved for another agent to claim),
    /// with the attempt's id if this agent requested it.
    AwaitApproval {
        attempt: Option<Gen>,
    },
    /// Any other refusal (cap, budget, expired, a holder mismatch, ...).
    Refused,
    Settled,
}

/// What happened to one attempt in the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fate {
    /// The agent whose Authorize reserved it.
    pub reserved_by: u8,
    /// Times the tool ran it.
    pub runs: u8,
    /// Its call took effect and charged (the tool succeeded, or its answer
    /// was lost after it did).
    pub charged: bool,
    /// The first outcome the store settled it with.
    pub settled: Option<AttemptState>,
    /// The gateway forwarded it and lost the tool's response.
    pub response_lost: bool,
    /// The store answered DISPATCH for it (at once, or its claim once
    /// approved).
    pub dispatched: bool,
    /// It needed approval: who approved it, as the store accepted each
    /// approval (an [`approver_bit`] or an [`agent_bit`]).
    pub approvals: u16,
}

impl Fate {
    fn sent(&self) -> bool {
        self.runs > 0
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct World {
    /// Reservations made per key (the next attempt's generation).
    pub reservations: [u8; KEYS.len()],
    pub fates: BTreeMap<Gen, Fate>,
    /// Calls that really left, of the tool.
    pub sends: u8,
    /// Per key, calls that left since its last verified NotSent.
    pub sends_since_release: [u8; KEYS.len()],
    /// Money the tool's provider really charged.
    pub charged: i64,
    /// The store accepted a Commit or MarkUncertain from an agent that did
    /// not reserve the attempt.
    pub settled_by_another: bool,
    /// The store changed a settled attempt's outcome.
    pub outcome_changed: bool,
    /// The gateway forwarded a call that the store did not hold RESERVED
    /// for it.
    pub forwarded_unreserved: bool,
    // Witnesses that the search reached what it is meant to explore.
    pub redelivered: bool,
    pub restart_settled: bool,
    pub resolved: bool,
    pub second_call_sent: bool,
    /// A new key was refused by the limit at one call.
    pub refused_by_the_limit: bool,
    /// The gateway gave back a DISPATCH it never forwarded (NotSent).
    pub gateway_gave_back: bool,
    /// The operator resolved an attempt whose response the gateway lost.
    pub lost_response_resolved: bool,
    /// Behind the gateway, the store refused an outcome of an earlier
    /// attempt of a key reserved again since.
    pub stale_refused: bool,
    /// A call was sent without the approvals it needs, by distinct
    /// approvers none of which is its requester, all given before.
    pub sent_unapproved: bool,
    /// A call needing approval was sent while the store did not hold that
    /// attempt of its key RESERVED, for its request, with its approvals.
    pub sent_not_as_approved: bool,
    /// An attempt was sent by an agent other than the one that reserved
    /// it.
    pub sent_by_another: bool,
    // Witnesses of approval.
    pub approved_sent: bool,
    pub two_approvals: bool,
    pub denied: bool,
    /// An approver denied a call already approved (a stale listing).
    pub denied_approved: bool,
    /// A requester that lost its claim's answer holds it, redelivered.
    pub claim_redelivered: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// An idle agent starts a call under a key.
    Start {
        agent: u8,
        key: Key,
    },
    /// Its RPC's deadline passed, or it was refused for now: the same
    /// request again.
    Retry {
        agent: u8,
    },
    /// No tries left: the call ends without an answer.
    GiveUp {
        agent: u8,
    },
    /// The agent sends the call; the tool answers `result` (`Uncertain`:
    /// the answer is lost after the call took effect).
    Send {
        agent: u8,
        result: Report,
    },
    /// The deadline passed before sending: the slot goes back. Behind
    /// the gateway: the stream ended before the DISPATCH was handed to
    /// it (its message timeout, the client left), at any time.
    TooLate {
        agent: u8,
    },
    /// The gateway forwards the request on its DISPATCH and the tool runs
    /// it, answering `result` (Succeeded: 2xx; Failed: it refused).
    Forward {
        agent: u8,
        result: Report,
    },
    /// The tool's response reaches the gateway, which commits it.
    Respond {
        agent: u8,
    },
    /// The tool's response is lost (the connection broke, the stream
    /// ended): the gateway marks the attempt UNCERTAIN (`mark`), or records
    /// nothing and leaves it to the lease.
    ResponseLost {
        agent: u8,
        mark: bool,
    },
    /// Told of an UNCERTAIN attempt with its id: do nothing more.
    Accept {
        agent: u8,
    },
    /// ... or settle what it was handed (Commit Failed): the store must
    /// refuse it unless this agent holds it.
    SettleHanded {
        agent: u8,
    },
    /// The agent sends a Commit Failed or a MarkUncertain for another
    /// agent's open attempt, whose id it learnt elsewhere; it reads no
    /// answer.
    SettleLeaked {
        agent: u8,
        attempt: Gen,
        report: Report,
    },
    /// The agent's process dies and starts again, with or without its
    /// journal.
    Crash {
        agent: u8,
        memory: bool,
    },
    /// The store takes a request off the network and runs it.
    Serve {
        msg: Msg,
    },
    Deliver {
        msg: Msg,
    },
    Lose {
        msg: Msg,
    },
    Duplicate {
        msg: Msg,
    },
    /// The operator resolves a listed UNCERTAIN attempt with what the
    /// tool's provider says of it.
    Resolve {
        attempt: Gen,
    },
    /// An agent told AWAIT_APPROVAL asks again: the same request.
    Poll {
        agent: u8,
    },
    /// An approver approves a call it saw listed AWAITING_APPROVAL (now,
    /// or earlier: the store decides what its approval still counts for).
    Approve {
        approver: u8,
        attempt: Gen,
    },
    /// An approver denies a call it saw listed.
    Deny {
        attempt: Gen,
    },
    /// Only with [`Holes::requester_approves`]: an agent approves its own
    /// pending call.
    SelfApprove {
        agent: u8,
    },
    /// The operator revokes the permit.
    Revoke,
    Tick,
}

// === the model ===

impl Protocol {
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            holes: Holes::default(),
        }
    }

    pub fn with_holes(mut self, holes: Holes) -> Self {
        self.holes = holes;
        self
    }

    fn permit(&self) -> Permit {
        Permit {
            permit_id: PERMIT_ID.into(),
            subject: "model".into(),
            tools: vec![TOOL.into()],
            max_calls_per_tool: [(TOOL.to_owned(), self.bounds.limit.cap())].into(),
            budget: Some(self.bounds.limit.budget()),
            currency: "EUR".into(),
            expires_at: T0 + Millis::from(EXPIRY_TICKS) * TICK_MS,
            lease_ms: Millis::from(LEASE_TICKS) * TICK_MS,
            // The duplicate guard is not modelled: every key's request is
            // its own.
            duplicate_guard: DuplicateGuard {
                mode: GuardMode::Off,
                window_ms: 0,
            },
            uncertain_policy: UncertainPolicy::Count,
            status: PermitStatus::Active,
            created_at: T0,
            tenant: String::new(),
            // Open to every agent of the tenant: the case of hole 1.
            agents: Vec::new(),
            // Every call, when approval is on.
            approval_per_tool: (self.bounds.approvers > 0)
                .then(|| {
                    let rule = ApprovalRule {
                        cost_at_least: None,
                        wait_ms: Millis::from(APPROVAL_WAIT_TICKS) * TICK_MS,
                        approvers: u32::from(self.bounds.approvers),
                    };
                    (TOOL.to_owned(), rule)
                })
                .into_iter()
                .collect(),
        }
    }

    /// An approver's key: an admin-like scope, never an agent's.
    fn approver_scope(approver: u8) -> Scope {
        Scope {
            tenant: String::new(),
            agent: None,
            key_id: approver_name(approver),
        }
    }

    /// The Gate's scope of an agent's key: limited to that agent, unless
    /// hole 1 is planted (or, for a Commit or MarkUncertain, its second
    /// half). Behind the gateway every stream calls with the gateway's key.
    fn scope(&self, agent: u8, settles: bool) -> Scope {
        let key_id = if self.bounds.gateway {
            "gateway".to_owned()
        } else {
            agent_name(agent)
        };
        let unlimited =
            self.holes.store_ignores_the_agent || (settles && self.holes.settle_ignores_the_holder);
        Scope {
            tenant: String::new(),
            agent: (!unlimited).then(|| key_id.clone()),
            key_id,
        }
    }

    /// What a replica does with a request: one store call, and its answer.
    fn serve(&self, s: &mut State, agent: u8, body: Request) -> Reply {
        let now = ms(s.now);
        let scope = self.scope(agent, matches!(body, Request::Report { .. }));
        match body {
            Request::Authorize { key, token } => {
                let generation = s.world.reservations[usize::from(key)];
                let cmd = AuthorizeCmd {
                    permit_id: PERMIT_ID.into(),
                    tool: TOOL.into(),
                    idempotency_key: KEYS[usize::from(key)].into(),
                    request_fingerprint: KEYS[usize::from(key)].as_bytes().to_vec(),
                    cost: COST,
                    // The gateway's door presents no holder token: nothing
                    // is redelivered to it.
                    holder_token: if self.bounds.gateway {
                        Vec::new()
                    } else {
                        vec![token]
                    },
                    approval_summary: String::new(),
                };
                let id = attempt_id((key, generation));
                match s
                    .ledger
                    .authorize(&scope, &cmd, now, id, &Quotas::UNLIMITED, None)
                {
                    Ok(a) => {
                        let given = parse_attempt(&a.attempt.attempt_id);
                        match (a.decision, given) {
                            (Decision::Dispatch, Some(attempt)) => {
                                if a.redelivered {
                                    s.world.redelivered = true;
                                } else if let Some(fate) = s.world.fates.get_mut(&attempt) {
                                    // The claim of an approved call. Behind
                                    // the gateway, by any request of the
                                    // gateway's key (a client's retry: the
                                    // door answered the first 202), which
                                    // holds it from now on.
                                    fate.dispatched = true;
                                    if self.bounds.gateway {
                                        fate.reserved_by = agent;
                                    }
                                } else {
                                    s.world.reserve(key, attempt, agent, true);
                                }
                                Reply::Dispatch {
                                    attempt,
                                    redelivered: a.redelivered,
                                    lease_end: s.now + ticks(a.lease_remaining_ms),
                                }
                            }
                            (Decision::Dispatch, None) => panic!("a DISPATCH without an id: {a:?}"),
                            (Decision::AwaitApproval, attempt) => {
                                // A new request's first answer: it reserved.
                                if let Some(attempt) = attempt
                                    && !s.world.fates.contains_key(&attempt)
                                {
                                    s.world.reserve(key, attempt, agent, false);
                                }
                                Reply::AwaitApproval { attempt }
                            }
                            (Decision::Replay, attempt) => Reply::Replay {
                                attempt,
                                uncertain: a.attempt.state == AttemptState::Uncertain,
                            },
                        }
                    }
                    Err(Error::InProgress { .. }) => Reply::InProgress,
                    Err(e) => {
                        let limit = match self.bounds.limit {
                            Limit::Cap => matches!(e, Error::MaxCallsExceeded { .. }),
                            Limit::Budget => matches!(e, Error::BudgetExceeded { .. }),
                        };
                        s.world.refused_by_the_limit |= limit;
                        Reply::Refused
                    }
                }
            }
            Request::Report {
                key,
                attempt,
                report,
            } => {
                let idempotency_key: String = KEYS[usize::from(key)].into();
                let result = match report {
                    Report::Uncertain => {
                        let cmd = MarkUncertainCmd {
                            permit_id: PERMIT_ID.into(),
                            idempotency_key,
                            attempt_id: attempt_id(attempt),
                            reason: "response lost".into(),
                        };
                        s.ledger.mark_uncertain(&scope, &cmd, now).map(|a| a.state)
                    }
                    _ => {
                        let cmd = CommitCmd {
                            permit_id: PERMIT_ID.into(),
                            idempotency_key,
                            attempt_id: attempt_id(attempt),
                            outcome: outcome(report),
                        };
                        s.ledger
                            .commit(&scope, &cmd, now, format!("r.{}", attempt_id(attempt)))
                            .map(|settled| settled.attempt.state)
                    }
                };
                match result {
                    Ok(state) => {
                        let fate = s.world.fates.get(&attempt).copied();
                        if fate.is_some_and(|f| f.reserved_by != agent) {
                            s.world.settled_by_another = true;
                        }
                        if self.bounds.gateway && state == AttemptState::Released {
                            s.world.gateway_gave_back = true;
                        }
                        s.world.settle(attempt, state);
                        Reply::Settled
                    }
                    Err(_) => {
                        // Behind the gateway, an outcome of an attempt the
                        // key has moved past (a duplicate, a late retry):
                        // only the id fences it, every stream being the
                        // gateway's key.
                        s.world.stale_refused |= self.bounds.gateway
                            && s.world.reservations[usize::from(key)] > attempt.1 + 1;
                        Reply::Refused
                    }
                }
            }
        }
    }

    /// An agent reads the answer to its request.
    fn read(&self, s: &mut State, agent: u8, reply: Reply) {
        if self.bounds.gateway {
            return self.read_gateway(s, agent, reply);
        }
        let now = s.now;
        let a = &mut s.agents[usize::from(agent)];
        match (a.phase, reply) {
            (
                Phase::Authorizing {
                    key,
                    restored,
                    maybe_sent,
                    ..
                },
                Reply::Dispatch {
                    attempt,
                    redelivered,
                    lease_end,
                },
            ) => {
                if restored && redelivered && !self.holes.client_sends_on_any_redelivery {
                    // An earlier run holds it and may have sent: settle, never
                    // send again; NotSent only if its journal knows it did not.
                    s.world.restart_settled = true;
                    let report = if maybe_sent {
                        Report::Uncertain
                    } else {
                        Report::NotSent
                    };
                    a.report(key, attempt, report, &mut s.net, agent);
                } else {
                    s.world.claim_redelivered |= redelivered
                        && s.world
                            .fates
                            .get(&attempt)
                            .is_some_and(|f| f.approvals != 0);
                    let deadline = if restored && self.holes.client_sends_on_any_redelivery {
                        now + LEASE_TICKS
                    } else {
                        lease_end
                    };
                    a.phase = Phase::Holding {
                        key,
                        attempt,
                        deadline,
                    };
                    if let Some(j) = &mut a.journal {
                        j.maybe_sent = true;
                    }
                }
            }
            (
                Phase::Authorizing { key, .. },
                Reply::AwaitApproval {
                    attempt: Some(attempt),
                },
            ) if self.holes.client_sends_on_await_approval => {
                a.phase = Phase::Holding {
                    key,
                    attempt,
                    deadline: now + LEASE_TICKS,
                };
                if let Some(j) = &mut a.journal {
                    j.maybe_sent = true;
                }
            }
            (
                Phase::Authorizing {
                    key,
                    token,
                    restored,
                    maybe_sent,
                    polls,
                    ..
                },
                Reply::AwaitApproval { attempt },
            ) => {
                a.phase = Phase::Awaiting {
                    key,
                    token,
                    restored,
                    maybe_sent,
                    polls,
                    attempt,
                }
            }
            (
                Phase::Authorizing { key, .. },
                Reply::Replay {
                    attempt: Some(attempt),
                    uncertain: true,
                },
            ) => a.phase = Phase::Replayed { key, attempt },
            (Phase::Authorizing { .. }, Reply::Replay { .. } | Reply::Refused) => a.finish(),
            (Phase::Reporting { .. }, Reply::Settled | Reply::Refused) => a.finish(),
            // IN_PROGRESS and UNAVAILABLE: the agent retries or gives up.
            _ => {}
        }
    }

    /// The gateway's door reads the store's answer for one stream: a
    /// DISPATCH it holds until it hands it to the gateway; any other
    /// answer ends the request (IN_PROGRESS and REPLAY are 409s, a refusal
    /// is its status: nothing is forwarded).
    fn read_gateway(&self, s: &mut State, agent: u8, reply: Reply) {
        let a = &mut s.agents[usize::from(agent)];
        match (a.phase, reply) {
            (
                Phase::Authorizing { key, .. },
                Reply::Dispatch {
                    attempt, lease_end, ..
                },
            ) => {
                a.phase = Phase::Holding {
                    key,
                    attempt,
                    deadline: lease_end,
                }
            }
            (Phase::Authorizing { .. }, _) | (Phase::Reporting { .. }, _) => a.finish(),
            _ => {}
        }
    }

    /// What one request behind the gateway can do next (no crashes, no
    /// leaked ids: the gateway is one key, and the door's stream holds
    /// the attempt).
    fn gateway_actions(&self, s: &State, agent: u8, a: &Agent, actions: &mut Vec<Action>) {
        let results = [Report::Succeeded, Report::Failed];
        match a.phase {
            Phase::Idle if a.calls_left > 0 => {
                actions.extend((0..KEYS.len() as Key).map(|key| Action::Start { agent, key }));
            }
            Phase::Idle => {}
            Phase::Replayed { .. } => unreachable!("the door hands no REPLAY over"),
            Phase::Awaiting { .. } => unreachable!("the door answers 202 and ends the stream"),
            Phase::Authorizing { tries, .. } | Phase::Reporting { tries, .. } => {
                let answered = s.net.iter().any(
                    |m| matches!(m, Msg::Reply { agent: to, seq, .. } if *to == agent && *seq == a.seq),
                );
                // The door asks an outcome again, never an Authorize: the
                // stream ends (503) and its client may send again.
                let again = matches!(a.phase, Phase::Reporting { .. }) && tries < self.bounds.tries;
                if answered {
                } else if again {
                    actions.push(Action::Retry { agent });
                } else {
                    actions.push(Action::GiveUp { agent });
                }
                if self.holes.gateway_forwards_before_dispatch
                    && matches!(a.phase, Phase::Authorizing { .. })
                {
                    actions.extend(results.map(|result| Action::Forward { agent, result }));
                }
            }
            Phase::Holding { deadline, .. } => {
                // The door hands the DISPATCH over within the lease, or the
                // stream ends first.
                if s.now < deadline {
                    actions.extend(results.map(|result| Action::Forward { agent, result }));
                }
                actions.push(Action::TooLate { agent });
            }
            Phase::Forwarded { .. } => {
                actions.push(Action::Respond { agent });
                for mark in [true, false] {
                    actions.push(Action::ResponseLost { agent, mark });
                }
            }
        }
    }

    /// Whether the store holds `attempt` RESERVED for the request the
    /// gateway is about to forward; without an attempt (a forward before
    /// the DISPATCH), whether it holds one of `key` that `agent`'s
    /// request reserved and nothing ran yet.
    fn reserved(s: &State, agent: u8, key: Key, attempt: Option<Gen>) -> bool {
        let Ok(a) = s.ledger.get_attempt(KEYS[usize::from(key)], ms(s.now)) else {
            return false;
        };
        let Some(g) = parse_attempt(&a.attempt_id) else {
            return false;
        };
        a.state == AttemptState::Reserved
            && match attempt {
                Some(attempt) => g == attempt,
                None => s
                    .world
                    .fates
                    .get(&g)
                    .is_some_and(|f| f.reserved_by == agent && f.runs == 0),
            }
    }
}

/// What the ledger's attempts hold, as each reads at the state's time.
struct Held {
    /// Slots: calls pending approval, dispatched and not given back.
    slots: u64,
    /// Money reserved: calls pending, RESERVED or UNCERTAIN.
    reserved: i64,
    committed: i64,
}

fn held(s: &State) -> Held {
    let mut h = Held {
        slots: 0,
        reserved: 0,
        committed: 0,
    };
    for key in KEYS {
        let Ok(a) = s.ledger.get_attempt(key, ms(s.now)) else {
            continue;
        };
        match a.state {
            AttemptState::AwaitingApproval
            | AttemptState::Approved
            | AttemptState::Reserved
            | AttemptState::Uncertain => {
                h.slots += 1;
                h.reserved += a.cost;
            }
            AttemptState::Succeeded => {
                h.slots += 1;
                h.committed += a.receipt.map_or(0, |r| r.cost);
            }
            AttemptState::Failed => h.slots += 1,
            AttemptState::Released | AttemptState::Denied => {}
        }
    }
    h
}

/// Whether a key's attempt reads DENIED for `reason`.
fn denied_for(s: &State, reason: &str) -> bool {
    KEYS.iter().any(|key| {
        s.ledger.get_attempt(key, ms(s.now)).is_ok_and(|a| {
            a.state == AttemptState::Denied
                && a.approval.is_some_and(|ap| ap.denial_reason == reason)
        })
    })
}

/// The sequence number of a request whose answer its agent never reads
/// (an agent's own never reach it within the bounds).
const UNREAD: u8 = u8::MAX;

fn ms(tick: u8) -> Millis {
    T0 + Millis::from(tick) * TICK_MS
}

/// Whole clock steps in `lease_remaining` (leases are whole steps here).
fn ticks(ms: Millis) -> u8 {
    u8::try_from(ms / TICK_MS).expect("a lease of a few steps")
}

fn outcome(report: Report) -> Outcome {
    match report {
        Report::Succeeded => Outcome::Succeeded {
            result: b"charged".to_vec(),
            actual_cost: None,
        },
        Report::Failed => Outcome::Failed {
            reason: "declined".into(),
        },
        Report::NotSent => Outcome::NotSent,
        Report::Uncertain => unreachable!("MarkUncertain is no Commit"),
    }
}

impl Agent {
    fn finish(&mut self) {
        self.phase = Phase::Idle;
        self.calls_left -= 1;
        self.call += 1;
        // No answer is read any more (State::forget_unread).
        self.seq += 1;
        self.journal = None;
    }

    fn send(&mut self, net: &mut Vec<Msg>, agent: u8, body: Request) {
        self.seq += 1;
        insert(
            net,
            Msg::Request {
                agent,
                seq: self.seq,
                body,
            },
        );
    }

    fn authorize(&mut self, net: &mut Vec<Msg>, agent: u8, key: Key, restored: bool) {
        let journal = *self.journal.get_or_insert(Journal {
            key,
            // One token per logical call of one agent: never shared.
            token: (agent << 4) | self.call,
            maybe_sent: false,
        });
        self.phase = Phase::Authorizing {
            key,
            token: journal.token,
            restored,
            maybe_sent: journal.maybe_sent,
            tries: 1,
            polls: 0,
        };
        self.send(
            net,
            agent,
            Request::Authorize {
                key,
                token: journal.token,
            },
        );
    }

    fn report(&mut self, key: Key, attempt: Gen, report: Report, net: &mut Vec<Msg>, agent: u8) {
        self.phase = Phase::Reporting {
            key,
            attempt,
            report,
            tries: 1,
        };
        self.send(
            net,
            agent,
            Request::Report {
                key,
                attempt,
                report,
            },
        );
    }
}

impl World {
    /// `agent`'s Authorize reserved `attempt` of `key`: at once (a
    /// DISPATCH), or pending approval.
    fn reserve(&mut self, key: Key, attempt: Gen, agent: u8, dispatched: bool) {
        self.reservations[usize::from(key)] += 1;
        self.fates.insert(
            attempt,
            Fate {
                reserved_by: agent,
                runs: 0,
                charged: false,
                settled: None,
                response_lost: false,
                dispatched,
                approvals: 0,
            },
        );
    }

    /// The tool runs a call of `key` (of `attempt`, when the caller knows
    /// it) and answers `result`; `Uncertain`: it took effect, and its answer
    /// is lost.
    fn run(&mut self, key: Key, attempt: Option<Gen>, result: Report) {
        if self.sends > 0 {
            self.second_call_sent = true;
        }
        self.sends += 1;
        self.sends_since_release[usize::from(key)] += 1;
        let charged = result != Report::Failed;
        if charged {
            self.charged += COST;
        }
        if let Some(fate) = attempt.and_then(|a| self.fates.get_mut(&a)) {
            fate.runs += 1;
            fate.charged |= charged;
        }
    }

    fn settle(&mut self, attempt: Gen, state: AttemptState) {
        let settled = matches!(
            state,
            AttemptState::Succeeded
                | AttemptState::Failed
                | AttemptState::Released
                | AttemptState::Denied
        );
        if let Some(fate) = self.fates.get_mut(&attempt) {
            match fate.settled {
                Some(first) if first != state => self.outcome_changed = true,
                None if settled => fate.settled = Some(state),
                _ => {}
            }
        }
        if state == AttemptState::Released {
            self.sends_since_release[usize::from(attempt.0)] = 0;
        }
    }
}

fn insert(net: &mut Vec<Msg>, msg: Msg) {
    let at = net.binary_search(&msg).unwrap_or_else(|at| at);
    net.insert(at, msg);
}

fn remove(net: &mut Vec<Msg>, msg: &Msg) {
    if let Ok(at) = net.binary_search(msg) {
        net.remove(at);
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let agent = Agent {
            calls_left: self.bounds.calls,
            call: 0,
            seq: 0,
            phase: Phase::Idle,
            journal: None,
        };
        vec![State {
            now: 0,
            ledger: Ledger::new(self.permit()),
            agents: vec![agent; usize::from(self.bounds.agents)],
            net: Vec::new(),
            crashes_left: self.bounds.crashes,
            losses_left: self.bounds.losses,
            duplicates_left: self.bounds.duplicates,
            leaks_left: self.bounds.leaks,
            world: World::default(),
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (i, a) in s.agents.iter().enumerate() {
            let agent = i as u8;
            if self.bounds.gateway {
                self.gateway_actions(s, agent, a, actions);
                continue;
            }
            match a.phase {
                Phase::Idle if a.calls_left > 0 => {
                    actions.extend((0..KEYS.len() as Key).map(|key| Action::Start { agent, key }));
                }
                Phase::Idle => {}
                Phase::Authorizing { tries, .. } | Phase::Reporting { tries, .. } => {
                    // Its deadline passes while the request (or, once
                    // lost, nothing) is on its way; an answer already on
                    // its way arrives first, unless the network loses it.
                    let answered = s.net.iter().any(
                        |m| matches!(m, Msg::Reply { agent: to, seq, .. } if *to == agent && *seq == a.seq),
                    );
                    if answered {
                    } else if tries < self.bounds.tries {
                        actions.push(Action::Retry { agent });
                    } else {
                        actions.push(Action::GiveUp { agent });
                    }
                }
                Phase::Holding { deadline, .. } if s.now < deadline => {
                    for result in [Report::Succeeded, Report::Failed, Report::Uncertain] {
                        actions.push(Action::Send { agent, result });
                    }
                }
                Phase::Holding { .. } => actions.push(Action::TooLate { agent }),
                Phase::Awaiting { polls, attempt, .. } => {
                    // Later (a decision may come first, or none), the same
                    // request again; or the agent stops waiting.
                    if polls < self.bounds.polls {
                        actions.push(Action::Poll { agent });
                    }
                    actions.push(Action::GiveUp { agent });
                    if self.holes.requester_approves && attempt.is_some() {
                        actions.push(Action::SelfApprove { agent });
                    }
                }
                Phase::Forwarded { .. } => unreachable!("only behind the gateway"),
                Phase::Replayed { attempt, .. } => {
                    actions.push(Action::Accept { agent });
                    // Another's attempt, handed over: would the store let
                    // this agent settle it? (Its own it settles honestly.)
                    if s.world
                        .fates
                        .get(&attempt)
                        .is_some_and(|f| f.reserved_by != agent)
                    {
                        actions.push(Action::SettleHanded { agent });
                    }
                }
            }
            if s.leaks_left > 0 {
                for (attempt, fate) in &s.world.fates {
                    if fate.reserved_by != agent && fate.settled.is_none() {
                        // A Commit (NotSent: the one that frees the slot)
                        // and a MarkUncertain: the holder check of each.
                        for report in [Report::NotSent, Report::Uncertain] {
                            actions.push(Action::SettleLeaked {
                                agent,
                                attempt: *attempt,
                                report,
                            });
                        }
                    }
                }
            }
            if s.crashes_left > 0 && a.phase != Phase::Idle {
                actions.push(Action::Crash {
                    agent,
                    memory: true,
                });
                actions.push(Action::Crash {
                    agent,
                    memory: false,
                });
            }
        }
        let mut last = None;
        for msg in &s.net {
            if last == Some(msg) {
                continue; // the same message twice: the same actions
            }
            last = Some(msg);
            match msg {
                Msg::Request { .. } => {
                    actions.push(Action::Serve { msg: *msg });
                    // A reply read twice changes nothing (the agent has
                    // moved on), so only requests are duplicated.
                    if s.duplicates_left > 0 {
                        actions.push(Action::Duplicate { msg: *msg });
                    }
                }
                Msg::Reply { .. } => actions.push(Action::Deliver { msg: *msg }),
            }
            // A lost reply is also a replica that answered too late (the
            // store applied the request; the caller saw UNAVAILABLE or its
            // own deadline, and may retry): the same to the agent.
            if s.losses_left > 0 {
                actions.push(Action::Lose { msg: *msg });
            }
        }
        // The operator's ListUncertain, and a Resolve of each listed.
        for listed in s.ledger.uncertain_after(None, PAGE, ms(s.now)) {
            if let Some(attempt) = parse_attempt(&listed.attempt_id) {
                actions.push(Action::Resolve { attempt });
            }
        }
        if self.bounds.revoke && s.ledger.permit().status == PermitStatus::Active {
            actions.push(Action::Revoke);
        }
        // The approvers' ListApprovals: what is AWAITING_APPROVAL now, or
        // was when an approver listed it (every call that needed approval:
        // its decision may come after another's, a lapse, a claim). Each
        // approver approves a call once; any one may deny it, once.
        if self.bounds.approvers > 0 {
            let now = ms(s.now);
            for (attempt, fate) in &s.world.fates {
                let Ok(a) = s.ledger.get_attempt(KEYS[usize::from(attempt.0)], now) else {
                    continue;
                };
                // Its key's attempt now (a released key reserved again is
                // another's call), as the store records it: decided or not.
                if a.attempt_id != attempt_id(*attempt) || a.approval.is_none() {
                    continue;
                }
                for approver in 0..self.bounds.approver_keys {
                    if fate.approvals & approver_bit(approver) == 0 {
                        actions.push(Action::Approve {
                            approver,
                            attempt: *attempt,
                        });
                    }
                }
                if fate.settled.is_none() {
                    actions.push(Action::Deny { attempt: *attempt });
                }
            }
        }
        if s.now < self.bounds.ticks {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        self.step(&mut s, action)?;
        s.forget_unread();
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "sends per tool never exceed the cap",
                |p: &Protocol, s: &State| u64::from(s.world.sends) <= p.bounds.limit.cap(),
            ),
            Property::always(
                "no key is sent twice without a NotSent between",
                |_: &Protocol, s: &State| s.world.sends_since_release.iter().all(|n| *n <= 1),
            ),
            Property::always(
                "the tool runs each attempt at most once",
                |_: &Protocol, s: &State| s.world.fates.values().all(|f| f.runs <= 1),
            ),
            Property::always(
                "a slot is given back only for a call the tool never ran",
                |_: &Protocol, s: &State| {
                    s.world
                        .fates
                        .values()
                        .all(|f| f.settled != Some(AttemptState::Released) || !f.sent())
                },
            ),
            Property::always(
                "the gateway forwards only what the store holds RESERVED",
                |_: &Protocol, s: &State| !s.world.forwarded_unreserved,
            ),
            Property::always(
                "reserved plus committed never exceeds the budget",
                |p: &Protocol, s: &State| {
                    let v = s.ledger.view(ms(s.now));
                    v.budget_committed + v.budget_reserved <= p.bounds.limit.budget()
                },
            ),
            Property::always(
                "the provider never charges more than the budget",
                |p: &Protocol, s: &State| s.world.charged <= p.bounds.limit.budget(),
            ),
            Property::always(
                "a settled attempt never changes its outcome",
                |_: &Protocol, s: &State| {
                    !s.world.outcome_changed
                        && s.world.fates.iter().all(|(g, fate)| {
                            let Some(first) = fate.settled else {
                                return true;
                            };
                            match s.ledger.get_attempt(KEYS[usize::from(g.0)], ms(s.now)) {
                                Ok(a) if a.attempt_id == attempt_id(*g) => a.state == first,
                                // A released key reserved again: a new attempt.
                                Ok(_) => first == AttemptState::Released,
                                Err(_) => false,
                            }
                        })
                },
            ),
            Property::always(
                "every UNCERTAIN attempt stays listed for the operator",
                |_: &Protocol, s: &State| {
                    let now = ms(s.now);
                    let listed = s.ledger.uncertain_after(None, PAGE, now);
                    KEYS.iter().all(|key| match s.ledger.get_attempt(key, now) {
                        Ok(a) if a.state == AttemptState::Uncertain => listed
                            .iter()
                            .any(|l| l.idempotency_key == *key && l.attempt_id == a.attempt_id),
                        _ => true,
                    })
                },
            ),
            Property::always(
                "an attempt never settled stays RESERVED or UNCERTAIN, or before its DISPATCH pending or DENIED",
                |_: &Protocol, s: &State| {
                    let now = ms(s.now);
                    s.world
                        .fates
                        .iter()
                        .filter(|(_, fate)| fate.settled.is_none())
                        .all(|(g, fate)| {
                            matches!(
                                s.ledger.get_attempt(KEYS[usize::from(g.0)], now),
                                Ok(a) if a.attempt_id == attempt_id(*g)
                                    && if fate.dispatched {
                                        matches!(a.state, AttemptState::Reserved | AttemptState::Uncertain)
                                    } else {
                                        // Denied only by a lapse or a revocation.
                                        a.state.is_pending() || a.state == AttemptState::Denied
                                    }
                            )
                        })
                },
            ),
            Property::always(
                "every call sent was approved first, by enough approvers none of which is its requester",
                |_: &Protocol, s: &State| !s.world.sent_unapproved,
            ),
            Property::always(
                "a call is sent only as the attempt approved for its request",
                |_: &Protocol, s: &State| !s.world.sent_not_as_approved,
            ),
            // The three below only where calls need approval: without it no
            // attempt is ever DENIED, and the other properties check the cap
            // and the money already (these hold there too, but would make
            // those searches about half as slow again).
            Property::always(
                "a key whose attempt was DENIED never dispatches nor sends",
                |p: &Protocol, s: &State| {
                    if p.bounds.approvers == 0 {
                        return true;
                    }
                    let now = ms(s.now);
                    s.world.fates.iter().all(|(g, fate)| {
                        let denied = fate.settled == Some(AttemptState::Denied)
                            || matches!(
                                s.ledger.get_attempt(KEYS[usize::from(g.0)], now),
                                Ok(a) if a.attempt_id == attempt_id(*g) && a.state == AttemptState::Denied
                            );
                        // Its key replays the denial: never reserved again.
                        !denied
                            || (!fate.dispatched
                                && !fate.sent()
                                && s.world.reservations[usize::from(g.0)] == g.1 + 1)
                    })
                },
            ),
            Property::always(
                "an attempt is sent only by the agent that reserved it",
                |_: &Protocol, s: &State| !s.world.sent_by_another,
            ),
            Property::always(
                "calls pending, approved and dispatched never exceed the cap",
                |p: &Protocol, s: &State| {
                    p.bounds.approvers == 0 || held(s).slots <= p.bounds.limit.cap()
                },
            ),
            Property::always(
                "the ledger holds slots and money only for calls pending, open or settled",
                |p: &Protocol, s: &State| {
                    if p.bounds.approvers == 0 {
                        return true;
                    }
                    let v = s.ledger.view(ms(s.now));
                    let h = held(s);
                    v.usage[0].calls_made == h.slots
                        && v.budget_reserved == h.reserved
                        && v.budget_committed == h.committed
                },
            ),
            Property::always(
                "no agent settles another's attempt",
                |_: &Protocol, s: &State| !s.world.settled_by_another,
            ),
            // Witnesses: the search reaches each path the promise is about.
            Property::sometimes(
                "a lost DISPATCH is redelivered",
                |_: &Protocol, s: &State| s.world.redelivered,
            ),
            Property::sometimes("a lease runs out", |_: &Protocol, s: &State| {
                s.ledger
                    .uncertain_after(None, PAGE, ms(s.now))
                    .iter()
                    .any(|a| a.uncertain_reason == LEASE_EXPIRED)
            }),
            Property::sometimes("a second call is sent", |_: &Protocol, s: &State| {
                s.world.second_call_sent
            }),
            Property::sometimes(
                "a new key is refused by the limit at one call",
                |_: &Protocol, s: &State| s.world.refused_by_the_limit,
            ),
            Property::sometimes(
                "the operator resolves an attempt",
                |_: &Protocol, s: &State| s.world.resolved,
            ),
            Property::sometimes(
                "a restarted agent settles an earlier run's attempt",
                |_: &Protocol, s: &State| s.world.restart_settled,
            ),
            Property::sometimes(
                "the gateway gives back a DISPATCH it never forwarded",
                |_: &Protocol, s: &State| s.world.gateway_gave_back,
            ),
            Property::sometimes(
                "an outcome of an attempt since reserved again is refused",
                |_: &Protocol, s: &State| s.world.stale_refused,
            ),
            Property::sometimes(
                "a forward whose response was lost is resolved",
                |_: &Protocol, s: &State| s.world.lost_response_resolved,
            ),
            Property::sometimes(
                "an approved call is claimed and sent",
                |_: &Protocol, s: &State| s.world.approved_sent,
            ),
            Property::sometimes(
                "a call is approved by two approvers",
                |_: &Protocol, s: &State| s.world.two_approvals,
            ),
            Property::sometimes("an approver denies a call", |_: &Protocol, s: &State| {
                s.world.denied
            }),
            Property::sometimes(
                "an approver denies a call already approved",
                |_: &Protocol, s: &State| s.world.denied_approved,
            ),
            Property::sometimes(
                "a request nobody decided lapses",
                |_: &Protocol, s: &State| denied_for(s, APPROVAL_EXPIRED),
            ),
            Property::sometimes(
                "an approved call nobody claimed lapses",
                |_: &Protocol, s: &State| denied_for(s, APPROVAL_UNCLAIMED),
            ),
            Property::sometimes(
                "a revocation denies a pending call",
                |_: &Protocol, s: &State| denied_for(s, PERMIT_REVOKED),
            ),
            Property::sometimes(
                "a lost claim is redelivered to its requester, to send",
                |_: &Protocol, s: &State| s.world.claim_redelivered,
            ),
        ]
    }

    fn within_boundary(&self, _: &State) -> bool {
        true
    }
}

impl Protocol {
    /// One action's effect on `s`; `None` if it has none.
    fn step(&self, s: &mut State, action: Action) -> Option<()> {
        match action {
            Action::Start { agent, key } => {
                let a = &mut s.agents[usize::from(agent)];
                a.authorize(&mut s.net, agent, key, false);
            }
            Action::Retry { agent } => {
                let a = &mut s.agents[usize::from(agent)];
                let body = match &mut a.phase {
                    Phase::Authorizing {
                        key, token, tries, ..
                    } => {
                        *tries += 1;
                        Request::Authorize {
                            key: *key,
                            token: *token,
                        }
                    }
                    Phase::Reporting {
                        key,
                        attempt,
                        report,
                        tries,
                    } => {
                        *tries += 1;
                        Request::Report {
                            key: *key,
                            attempt: *attempt,
                            report: *report,
                        }
                    }
                    _ => return None,
                };
                a.send(&mut s.net, agent, body);
            }
            Action::GiveUp { agent } => s.agents[usize::from(agent)].finish(),
            Action::Send { agent, result } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Holding { key, attempt, .. } = a.phase else {
                    return None;
                };
                self.sends(s, agent, key, attempt);
                s.world.run(key, Some(attempt), result);
                let a = &mut s.agents[usize::from(agent)];
                a.report(key, attempt, result, &mut s.net, agent);
            }
            Action::Forward { agent, result } => {
                let a = &s.agents[usize::from(agent)];
                let (key, attempt) = match a.phase {
                    Phase::Holding { key, attempt, .. } => (key, Some(attempt)),
                    // Only with the hole: its headers went on before the
                    // DISPATCH.
                    Phase::Authorizing { key, .. } => (key, None),
                    _ => return None,
                };
                if !Self::reserved(s, agent, key, attempt) {
                    s.world.forwarded_unreserved = true;
                }
                if let Some(attempt) = attempt {
                    self.sends(s, agent, key, attempt);
                }
                s.world.run(key, attempt, result);
                let a = &mut s.agents[usize::from(agent)];
                match attempt {
                    Some(attempt) => {
                        a.phase = Phase::Forwarded {
                            key,
                            attempt,
                            result,
                        }
                    }
                    // The request went its way: the door's answer, when it
                    // comes, changes nothing.
                    None => a.finish(),
                }
            }
            Action::Respond { agent } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Forwarded {
                    key,
                    attempt,
                    result,
                } = a.phase
                else {
                    return None;
                };
                a.report(key, attempt, result, &mut s.net, agent);
            }
            Action::ResponseLost { agent, mark } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Forwarded { key, attempt, .. } = a.phase else {
                    return None;
                };
                if let Some(fate) = s.world.fates.get_mut(&attempt) {
                    fate.response_lost = true;
                }
                let report = if self.holes.gateway_not_sent_after_lost_response {
                    Report::NotSent
                } else {
                    Report::Uncertain
                };
                if mark {
                    a.report(key, attempt, report, &mut s.net, agent);
                } else {
                    a.finish();
                }
            }
            Action::TooLate { agent } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Holding { key, attempt, .. } = a.phase else {
                    return None;
                };
                a.report(key, attempt, Report::NotSent, &mut s.net, agent);
            }
            Action::Accept { agent } => s.agents[usize::from(agent)].finish(),
            Action::SettleHanded { agent } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Replayed { key, attempt } = a.phase else {
                    return None;
                };
                a.report(key, attempt, Report::Failed, &mut s.net, agent);
            }
            Action::SettleLeaked {
                agent,
                attempt,
                report,
            } => {
                s.leaks_left -= 1;
                // A sequence number the agent never reads an answer to.
                let body = Request::Report {
                    key: attempt.0,
                    attempt,
                    report,
                };
                insert(
                    &mut s.net,
                    Msg::Request {
                        agent,
                        seq: UNREAD,
                        body,
                    },
                );
            }
            Action::Crash { agent, memory } => {
                s.crashes_left -= 1;
                let a = &mut s.agents[usize::from(agent)];
                match (memory, a.journal) {
                    (true, Some(journal)) => {
                        a.authorize(&mut s.net, agent, journal.key, true);
                    }
                    _ => a.finish(),
                }
            }
            Action::Serve { msg, .. } => {
                let Msg::Request { agent, seq, body } = msg else {
                    return None;
                };
                remove(&mut s.net, &msg);
                let reply = self.serve(s, agent, body);
                insert(
                    &mut s.net,
                    Msg::Reply {
                        agent,
                        seq,
                        body: reply,
                    },
                );
            }
            Action::Deliver { msg } => {
                let Msg::Reply { agent, seq, body } = msg else {
                    return None;
                };
                remove(&mut s.net, &msg);
                if s.agents[usize::from(agent)].seq == seq {
                    self.read(s, agent, body);
                }
            }
            Action::Lose { msg } => {
                s.losses_left -= 1;
                remove(&mut s.net, &msg);
            }
            Action::Duplicate { msg } => {
                s.duplicates_left -= 1;
                insert(&mut s.net, msg);
            }
            Action::Resolve { attempt } => {
                let fate = s.world.fates.get(&attempt).copied()?;
                // What the provider says: it charged, it declined, or the
                // call never arrived.
                let report = match (fate.sent(), fate.charged) {
                    (true, true) => Report::Succeeded,
                    (true, false) => Report::Failed,
                    (false, _) => Report::NotSent,
                };
                let cmd = ResolveCmd {
                    permit_id: PERMIT_ID.into(),
                    idempotency_key: KEYS[usize::from(attempt.0)].into(),
                    attempt_id: attempt_id(attempt),
                    outcome: outcome(report),
                };
                let receipt = format!("r.{}", attempt_id(attempt));
                let state = s
                    .ledger
                    .resolve(&cmd, ms(s.now), receipt)
                    .ok()?
                    .attempt
                    .state;
                s.world.resolved = true;
                s.world.lost_response_resolved |= fate.response_lost;
                s.world.settle(attempt, state);
            }
            Action::Poll { agent } => {
                let a = &mut s.agents[usize::from(agent)];
                let Phase::Awaiting {
                    key,
                    token,
                    restored,
                    maybe_sent,
                    polls,
                    ..
                } = a.phase
                else {
                    return None;
                };
                a.phase = Phase::Authorizing {
                    key,
                    token,
                    restored,
                    maybe_sent,
                    tries: 1,
                    polls: polls + 1,
                };
                a.send(&mut s.net, agent, Request::Authorize { key, token });
            }
            Action::Approve { approver, attempt } => {
                self.approve(s, &Self::approver_scope(approver), attempt)?;
                let fate = s.world.fates.get_mut(&attempt)?;
                fate.approvals |= approver_bit(approver);
                s.world.two_approvals |= fate.approvals.count_ones() >= 2;
            }
            Action::SelfApprove { agent } => {
                let Phase::Awaiting {
                    attempt: Some(attempt),
                    ..
                } = s.agents[usize::from(agent)].phase
                else {
                    return None;
                };
                // The hole: the store is told no key id (as in dev mode).
                let scope = Scope {
                    tenant: String::new(),
                    agent: None,
                    key_id: String::new(),
                };
                self.approve(s, &scope, attempt)?;
                s.world.fates.get_mut(&attempt)?.approvals |= agent_bit(agent);
            }
            Action::Deny { attempt } => {
                let key = KEYS[usize::from(attempt.0)];
                let now = ms(s.now);
                let was = s.ledger.get_attempt(key, now).ok()?.state;
                let cmd = DenyCmd {
                    permit_id: PERMIT_ID.into(),
                    idempotency_key: key.into(),
                    attempt_id: attempt_id(attempt),
                    reason: DENIED.into(),
                };
                let state = s
                    .ledger
                    .deny(&Self::approver_scope(0), &cmd, now)
                    .ok()?
                    .attempt
                    .state;
                s.world.denied = true;
                s.world.denied_approved |= was == AttemptState::Approved;
                s.world.settle(attempt, state);
            }
            Action::Revoke => {
                s.ledger.revoke(ms(s.now));
            }
            Action::Tick => s.now += 1,
        }
        Some(())
    }

    /// An approval of `attempt` by `scope`; `None` unless the store
    /// accepted it as a new one (a repeat answers the same, changing
    /// nothing).
    fn approve(&self, s: &mut State, scope: &Scope, attempt: Gen) -> Option<()> {
        let key = KEYS[usize::from(attempt.0)];
        let now = ms(s.now);
        let approvals =
            |a: atmost::domain::Attempt| a.approval.map_or(0, |ap| ap.approved_by.len());
        let before = approvals(s.ledger.get_attempt(key, now).ok()?);
        let cmd = ApproveCmd {
            permit_id: PERMIT_ID.into(),
            idempotency_key: key.into(),
            attempt_id: attempt_id(attempt),
        };
        let after = approvals(s.ledger.approve(scope, &cmd, now).ok()?);
        (after > before).then_some(())
    }

    /// `agent` sends `attempt` of `key` (the tool is about to run it):
    /// what the world records of who sent what, and with which approvals.
    fn sends(&self, s: &mut State, agent: u8, key: Key, attempt: Gen) {
        let needed = usize::from(self.bounds.approvers);
        let fate = s.world.fates.get(&attempt).copied();
        if fate.is_some_and(|f| f.reserved_by != agent) {
            s.world.sent_by_another = true;
        }
        if needed == 0 {
            return;
        }
        // Approved, before now, by distinct approvers none of which is
        // the requester: as the approvers really did.
        let approved = fate.is_some_and(|f| {
            (f.approvals & !agent_bit(f.reserved_by)).count_ones() as usize >= needed
        });
        s.world.sent_unapproved |= !approved;
        s.world.approved_sent |= approved;
        // ... and as the store holds it: this attempt of the key, for
        // this request, claimed, with its approvals recorded.
        let as_approved = s
            .ledger
            .get_attempt(KEYS[usize::from(key)], ms(s.now))
            .is_ok_and(|a| {
                a.attempt_id == attempt_id(attempt)
                    && a.state == AttemptState::Reserved
                    && a.request_fingerprint == KEYS[usize::from(key)].as_bytes()
                    && a.approval.is_some_and(|ap| {
                        ap.approved_by.len() >= needed && ap.approvers_needed as usize == needed
                    })
            });
        s.world.sent_not_as_approved |= !as_approved;
    }
}

impl State {
    /// Drops every answer its agent will not read (it reads only the answer
    /// to its last request), so states differ only in what can matter. The
    /// agents' earlier requests stay: a replica may still run them.
    fn forget_unread(&mut self) {
        let agents = &self.agents;
        self.net.retain(|m| match m {
            Msg::Reply { agent, seq, .. } => agents[usize::from(*agent)].seq == *seq,
            Msg::Request { .. } => true,
        });
    }
}

#[cfg(test)]
mod tests;
