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
//! What the agents do is the clients' contract (docs/clients.md), written
//! here as a state machine: the model checks the protocol those rules and
//! the Ledger make together, not the clients' code.

#![forbid(unsafe_code)]

use atmost::domain::{
    AttemptState, AuthorizeCmd, CommitCmd, Decision, DuplicateGuard, Error, GuardMode,
    LEASE_EXPIRED, Ledger, MarkUncertainCmd, Millis, Outcome, Permit, PermitStatus, Quotas,
    ResolveCmd, Scope, UncertainPolicy,
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
    };
}

/// The protocol holes of issue 24, put back for the test that shows the
/// check finds them. Neither is reachable otherwise.
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
            approval_per_tool: Default::default(),
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
                                } else {
                                    s.world.reservations[usize::from(key)] += 1;
                                    s.world.fates.insert(
                                        attempt,
                                        Fate {
                                            reserved_by: agent,
                                            runs: 0,
                                            charged: false,
                                            settled: None,
                                            response_lost: false,
                                        },
                                    );
                                }
                                Reply::Dispatch {
                                    attempt,
                                    redelivered: a.redelivered,
                                    lease_end: s.now + ticks(a.lease_remaining_ms),
                                }
                            }
                            (Decision::Dispatch, None) => panic!("a DISPATCH without an id: {a:?}"),
                            (Decision::AwaitApproval, _) => {
                                unreachable!("the model's permit has no approval rule")
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
            AttemptState::Succeeded | AttemptState::Failed | AttemptState::Released
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
                "an attempt never settled stays RESERVED or UNCERTAIN",
                |_: &Protocol, s: &State| {
                    let now = ms(s.now);
                    s.world
                        .fates
                        .iter()
                        .filter(|(_, fate)| fate.settled.is_none())
                        .all(|(g, _)| {
                            matches!(
                                s.ledger.get_attempt(KEYS[usize::from(g.0)], now),
                                Ok(a) if a.attempt_id == attempt_id(*g)
                                    && matches!(a.state, AttemptState::Reserved | AttemptState::Uncertain)
                            )
                        })
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
                s.world.run(key, Some(attempt), result);
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
            Action::Tick => s.now += 1,
        }
        Some(())
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
