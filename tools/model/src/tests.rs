//! The check `scripts/test.sh` runs: every state within [`Bounds::CI`],
//! with no hole planted, then each hole of issue 24 put back and found.

use super::*;
use stateright::Checker;
use std::time::Instant;

fn explore(protocol: Protocol) -> impl Checker<Protocol> {
    let started = Instant::now();
    let checker = protocol
        .checker()
        .threads(std::thread::available_parallelism().map_or(1, |n| n.get()))
        .spawn_bfs()
        .join();
    println!(
        "{:?} {:?}: {} states ({} unique), depth {}, in {:.1?}",
        protocol.bounds,
        protocol.holes,
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

#[test]
fn the_protocol_keeps_its_promise_in_every_state() {
    let checker = explore(Protocol::new(Bounds::CI));
    // Every always-property held in every state, and every witness was
    // reached (so none of them holds only because nothing happened).
    checker.assert_properties();
    assert!(
        checker.is_done(),
        "the search stopped before the last state"
    );
}

#[test]
fn it_finds_hole_1_another_agent_settles_an_uncertain_attempt() {
    let checker = explore(Protocol::new(Bounds::CI).with_holes(Holes {
        store_ignores_the_agent: true,
        ..Holes::default()
    }));
    let path = checker
        .discovery("no agent settles another's attempt")
        .expect("hole 1 found");
    println!("hole 1: {:#?}", path.into_actions());
}

#[test]
fn it_finds_hole_2_a_restart_with_its_token_sends_again() {
    let checker = explore(Protocol::new(Bounds::CI).with_holes(Holes {
        client_sends_on_any_redelivery: true,
        ..Holes::default()
    }));
    let path = checker
        .discovery("no key is sent twice without a NotSent between")
        .expect("hole 2 found");
    println!("hole 2: {:#?}", path.into_actions());
}
