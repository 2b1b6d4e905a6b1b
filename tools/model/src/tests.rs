//! The checks `scripts/test.sh` runs: every state within [`Bounds::AGENTS`],
//! [`Bounds::AGENTS_BUDGET`], [`Bounds::RESTARTS`], [`Bounds::GATEWAY`]
//! and the approval searches ([`Bounds::APPROVALS`],
//! [`Bounds::APPROVALS_RESTARTS`], [`Bounds::APPROVALS_RETRIES`]) with no
//! hole planted, then each hole of issue 24 put back and found, each
//! broken gateway, and each broken approval.

use super::*;
use stateright::{Checker, HasDiscoveries};
use std::time::Instant;

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The search's size, written to the process's stderr itself (not
/// `println!`, which the test harness captures), so `cargo test` always
/// shows how many states were explored.
fn report(protocol: &Protocol, checker: &impl Checker<Protocol>, started: Instant) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "atmost-model: {:?} {:?}: {} states ({} unique), depth {}, in {:.1?}",
        protocol.bounds,
        protocol.holes,
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
}

/// Explores every state within the bounds: no always-property fails
/// anywhere, and each of `witnesses` (sometimes-properties) is reached, so
/// none of them holds only because nothing happened.
fn holds_everywhere(bounds: Bounds, witnesses: &[&str]) {
    let protocol = Protocol::new(bounds);
    let started = Instant::now();
    let checker = protocol.checker().threads(threads()).spawn_bfs().join();
    report(&protocol, &checker, started);
    assert!(
        checker.is_done(),
        "the search stopped before the last state"
    );
    for property in protocol.properties() {
        let found = checker.discovery(property.name);
        match property.expectation {
            stateright::Expectation::Sometimes => {
                if witnesses.contains(&property.name) {
                    assert!(found.is_some(), "never reached: {}", property.name);
                }
            }
            _ => {
                if let Some(path) = found {
                    panic!("{} fails:\n{:#?}", property.name, path.into_actions());
                }
            }
        }
    }
    for name in witnesses {
        assert!(
            protocol.properties().iter().any(|p| p.name == *name),
            "no property {name:?}"
        );
    }
}

/// Searches with `holes` planted until `property` fails, and the path that
/// breaks it (breadth first: about the shortest). It searches on past
/// other properties a hole also breaks (hole 2's late send also breaks "a
/// slot is given back only for a call the tool never ran").
fn finds(bounds: Bounds, holes: Holes, property: &'static str) -> Vec<Action> {
    let until = HasDiscoveries::AnyOf([property].into());
    finds_each(bounds, holes, until, &[property]).remove(0)
}

/// Searches with `holes` planted until `until`; the path that breaks each
/// of `properties`, which must all be broken.
fn finds_each(
    bounds: Bounds,
    holes: Holes,
    until: HasDiscoveries,
    properties: &[&'static str],
) -> Vec<Vec<Action>> {
    let protocol = Protocol::new(bounds).with_holes(holes);
    let started = Instant::now();
    let checker = protocol
        .checker()
        .threads(threads())
        .finish_when(until)
        .spawn_bfs()
        .join();
    report(&protocol, &checker, started);
    properties
        .iter()
        .map(|property| {
            let path = checker
                .discovery(property)
                .unwrap_or_else(|| panic!("not found: {property}"));
            let actions = path.into_actions();
            println!("{property}, broken by:\n{actions:#?}");
            actions
        })
        .collect()
}

#[test]
fn agents_sharing_a_key_keep_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::AGENTS,
        &[
            "a lease runs out",
            "a new key is refused by the limit at one call",
            "the operator resolves an attempt",
        ],
    );
}

#[test]
fn agents_sharing_a_key_keep_the_budget_in_every_state() {
    holds_everywhere(
        Bounds::AGENTS_BUDGET,
        &[
            "a lease runs out",
            "a second call is sent",
            "a new key is refused by the limit at one call",
            "the operator resolves an attempt",
        ],
    );
}

#[test]
fn an_agent_that_retries_and_restarts_keeps_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::RESTARTS,
        &[
            "a lost DISPATCH is redelivered",
            "a lease runs out",
            "the operator resolves an attempt",
            "a restarted agent settles an earlier run's attempt",
        ],
    );
}

/// Hole 1 put back: agent B is handed A's UNCERTAIN attempt by a REPLAY and
/// its Commit Failed is taken, returning money A's call may have spent.
#[test]
fn it_finds_hole_1_another_agent_settles_an_uncertain_attempt() {
    let path = finds(
        // No id learnt elsewhere: the REPLAY must hand it over.
        Bounds {
            leaks: 0,
            ..Bounds::AGENTS
        },
        Holes {
            store_ignores_the_agent: true,
            ..Holes::default()
        },
        "no agent settles another's attempt",
    );
    assert!(
        path.iter()
            .any(|a| matches!(a, Action::SettleHanded { .. })),
        "{path:#?}"
    );
}

/// Half of hole 1's fix taken out: the REPLAY withholds the id, but an id
/// learnt elsewhere settles another agent's attempt.
#[test]
fn it_finds_a_settle_that_ignores_the_holder() {
    let path = finds(
        Bounds::AGENTS,
        Holes {
            settle_ignores_the_holder: true,
            ..Holes::default()
        },
        "no agent settles another's attempt",
    );
    assert!(
        path.iter()
            .any(|a| matches!(a, Action::SettleLeaked { .. })),
        "{path:#?}"
    );
}

/// Hole 2 put back: a restart that kept its holder token is told DISPATCH
/// again and sends again.
#[test]
fn it_finds_hole_2_a_restart_with_its_token_sends_again() {
    finds(
        Bounds::RESTARTS,
        Holes {
            client_sends_on_any_redelivery: true,
            ..Holes::default()
        },
        "no key is sent twice without a NotSent between",
    );
}

/// The gateway in the loop: it forwards only on DISPATCH, may lose the
/// tool's response and reports as the ext_proc door does; the promise
/// holds in every state, and each gateway path is reached.
#[test]
fn requests_behind_the_gateway_keep_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::GATEWAY,
        &[
            "a lease runs out",
            "a new key is refused by the limit at one call",
            "the operator resolves an attempt",
            "the gateway gives back a DISPATCH it never forwarded",
            "a forward whose response was lost is resolved",
            "an outcome of an attempt since reserved again is refused",
        ],
    );
}

/// A gateway that forwards on the request's headers, before atmost's
/// DISPATCH: the tool runs a call no reservation holds.
#[test]
fn it_finds_a_gateway_that_forwards_before_dispatch() {
    let path = finds(
        Bounds::GATEWAY,
        Holes {
            gateway_forwards_before_dispatch: true,
            ..Holes::default()
        },
        "the gateway forwards only what the store holds RESERVED",
    );
    // Forwarded before the store ran its Authorize.
    let forward = path
        .iter()
        .position(|a| matches!(a, Action::Forward { .. }))
        .unwrap_or_else(|| panic!("no forward: {path:#?}"));
    assert!(
        !path[..forward]
            .iter()
            .any(|a| matches!(a, Action::Serve { .. })),
        "{path:#?}"
    );
}

/// A gateway that commits NotSent once the tool's response is lost: the
/// slot of a call that ran goes back, and a second request runs the tool
/// again past the cap.
#[test]
fn it_finds_a_gateway_that_commits_not_sent_after_a_lost_response() {
    let released = "a slot is given back only for a call the tool never ran";
    let cap = "sends per tool never exceed the cap";
    let paths = finds_each(
        Bounds::GATEWAY,
        Holes {
            gateway_not_sent_after_lost_response: true,
            ..Holes::default()
        },
        HasDiscoveries::AllOf([released, cap].into()),
        &[released, cap],
    );
    for path in &paths {
        assert!(
            path.iter()
                .any(|a| matches!(a, Action::ResponseLost { mark: true, .. })),
            "{path:#?}"
        );
    }
    let forwards = paths[1]
        .iter()
        .filter(|a| matches!(a, Action::Forward { .. }))
        .count();
    assert_eq!(forwards, 2, "{:#?}", paths[1]);
}

/// Human approval: two agents on one key or two, one approver; the
/// promise and the approval properties hold in every state, and each
/// path of a request is reached (approved and sent, denied, also once
/// approved, lapsed unanswered, lapsed unclaimed, a second key refused
/// while one waits).
#[test]
fn calls_awaiting_approval_keep_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::APPROVALS,
        &[
            "a lease runs out",
            "a new key is refused by the limit at one call",
            "the operator resolves an attempt",
            "an approved call is claimed and sent",
            "an approver denies a call",
            "an approver denies a call already approved",
            "a request nobody decided lapses",
            "an approved call nobody claimed lapses",
        ],
    );
}

/// Two approvers, an agent that crashes and restarts while it waits or
/// holds its claim, and a revocation.
#[test]
fn an_agent_awaiting_two_approvers_restarts_and_keeps_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::APPROVALS_RESTARTS,
        &[
            "a lease runs out",
            "the operator resolves an attempt",
            "a restarted agent settles an earlier run's attempt",
            "an approved call is claimed and sent",
            "a call is approved by two approvers",
            "an approver denies a call",
            "an approver denies a call already approved",
            "a request nobody decided lapses",
            "an approved call nobody claimed lapses",
            "a revocation denies a pending call",
        ],
    );
}

/// A claim whose answer is lost is asked for again with the same holder
/// token: redelivered, and sent once.
#[test]
fn an_agent_that_retries_its_claim_keeps_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::APPROVALS_RETRIES,
        &[
            "a lost DISPATCH is redelivered",
            "a lost claim is redelivered to its requester, to send",
            "an approved call is claimed and sent",
            "a request nobody decided lapses",
            "an approved call nobody claimed lapses",
        ],
    );
}

const APPROVED_FIRST: &str =
    "every call sent was approved first, by enough approvers none of which is its requester";

/// A client that takes AWAIT_APPROVAL for a go: it sends a call nobody
/// approved.
#[test]
fn it_finds_a_client_that_sends_on_await_approval() {
    let path = finds(
        Bounds::APPROVALS,
        Holes {
            client_sends_on_await_approval: true,
            ..Holes::default()
        },
        APPROVED_FIRST,
    );
    assert!(
        path.iter().any(|a| matches!(a, Action::Send { .. }))
            && !path.iter().any(|a| matches!(a, Action::Approve { .. })),
        "{path:#?}"
    );
}

/// An agent's key that may approve, and a store told no key id: the
/// requester approves its own call, which is then claimed and sent.
#[test]
fn it_finds_a_requester_that_approves_its_own_call() {
    let path = finds(
        Bounds::APPROVALS,
        Holes {
            requester_approves: true,
            ..Holes::default()
        },
        APPROVED_FIRST,
    );
    assert!(
        path.iter().any(|a| matches!(a, Action::SelfApprove { .. }))
            && !path.iter().any(|a| matches!(a, Action::Approve { .. })),
        "{path:#?}"
    );
}

/// Hole 1 with approval: the store does not know which agent calls, so
/// another agent's Authorize of the same key claims the approved call and
/// sends it.
#[test]
fn it_finds_hole_1_another_agent_claims_an_approved_call() {
    let path = finds(
        Bounds::APPROVALS,
        Holes {
            store_ignores_the_agent: true,
            ..Holes::default()
        },
        "an attempt is sent only by the agent that reserved it",
    );
    assert!(
        path.iter().any(|a| matches!(a, Action::Approve { .. })),
        "{path:#?}"
    );
}

/// Behind the gateway, every call needing approval: the door answers 202
/// and forwards nothing; a request of the same key (the client's retry)
/// claims the approved call, forwarded once.
#[test]
fn requests_behind_the_gateway_awaiting_approval_keep_the_promise_in_every_state() {
    holds_everywhere(
        Bounds::GATEWAY_APPROVALS,
        &[
            "a new key is refused by the limit at one call",
            "an approved call is claimed and sent",
            "an approver denies a call",
            "a request nobody decided lapses",
            "an approved call nobody claimed lapses",
            "a forward whose response was lost is resolved",
        ],
    );
}
