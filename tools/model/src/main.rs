//! `atmost-model`: the protocol's model check at bounds of your choice
//! (defaults: [`Bounds::AGENTS`]): `cargo run -p atmost-model --release --
//! --agents 3 --calls 2`; `--gateway` puts the agents behind the gateway;
//! `--approvers 1 --approver-keys 1 --polls 1` makes every call wait for
//! approval ([`Bounds::APPROVALS`]; `--revoke` lets the operator revoke
//! the permit).
//! Prints the states explored and each property's verdict (a witness the
//! bounds never reach is "not reached", which is no failure); exits 1 if
//! an always-property fails.

use atmost_model::{Bounds, Holes, Limit, Protocol};
use clap::Parser;
use stateright::{Checker, Model};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Which limit is at one call (the other at two).
    #[arg(long, value_enum, default_value_t = Bounds::AGENTS.limit)]
    limit: Limit,
    #[arg(long, default_value_t = Bounds::AGENTS.agents)]
    agents: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.calls)]
    calls: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.tries)]
    tries: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.crashes)]
    crashes: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.losses)]
    losses: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.duplicates)]
    duplicates: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.leaks)]
    leaks: u8,
    #[arg(long, default_value_t = Bounds::AGENTS.ticks)]
    ticks: u8,
    /// The agents are HTTP clients behind one gateway (no crashes, no
    /// leaked ids there): `--gateway --duplicates 0` is Bounds::GATEWAY's
    /// search.
    #[arg(long)]
    gateway: bool,
    /// Approvals every call needs (1 or 2; 0: no approval rule).
    #[arg(long, default_value_t = Bounds::AGENTS.approvers)]
    approvers: u8,
    /// Approvers, each with its own key.
    #[arg(long, default_value_t = Bounds::AGENTS.approver_keys)]
    approver_keys: u8,
    /// Times an agent told AWAIT_APPROVAL asks again.
    #[arg(long, default_value_t = Bounds::AGENTS.polls)]
    polls: u8,
    /// The operator may revoke the permit.
    #[arg(long)]
    revoke: bool,
    /// Put hole 1 back (the store ignores which agent calls).
    #[arg(long)]
    hole_1: bool,
    /// Put hole 2 back (the client sends on any redelivery).
    #[arg(long)]
    hole_2: bool,
    /// Take the holder check out of Commit and MarkUncertain only.
    #[arg(long)]
    settle_ignores_the_holder: bool,
    /// A gateway that forwards before atmost's DISPATCH.
    #[arg(long)]
    gateway_forwards_before_dispatch: bool,
    /// A gateway that commits NotSent once the tool's response is lost.
    #[arg(long)]
    gateway_not_sent_after_lost_response: bool,
    /// A client that sends on AWAIT_APPROVAL.
    #[arg(long)]
    client_sends_on_await_approval: bool,
    /// Agents approve their own calls, the store told no key id.
    #[arg(long)]
    requester_approves: bool,
    /// Checker threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() {
    let a = Args::parse();
    let bounds = Bounds {
        limit: a.limit,
        agents: a.agents,
        calls: a.calls,
        tries: a.tries,
        crashes: a.crashes,
        losses: a.losses,
        duplicates: a.duplicates,
        leaks: a.leaks,
        ticks: a.ticks,
        gateway: a.gateway,
        approvers: a.approvers,
        approver_keys: a.approver_keys,
        polls: a.polls,
        revoke: a.revoke,
    };
    let protocol = Protocol::new(bounds).with_holes(Holes {
        store_ignores_the_agent: a.hole_1,
        client_sends_on_any_redelivery: a.hole_2,
        settle_ignores_the_holder: a.settle_ignores_the_holder,
        gateway_forwards_before_dispatch: a.gateway_forwards_before_dispatch,
        gateway_not_sent_after_lost_response: a.gateway_not_sent_after_lost_response,
        client_sends_on_await_approval: a.client_sends_on_await_approval,
        requester_approves: a.requester_approves,
    });
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let started = Instant::now();
    let checker = protocol.checker().threads(threads).spawn_bfs().join();
    println!(
        "{bounds:?}: {} states, {} unique, depth {}, {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    let mut failed = false;
    for p in protocol.properties() {
        let found = checker.discovery(p.name);
        let verdict = match (p.expectation, found) {
            (stateright::Expectation::Sometimes, Some(_)) => "reached    ",
            (stateright::Expectation::Sometimes, None) => "not reached",
            (_, None) => "ok         ",
            (_, Some(path)) => {
                failed = true;
                println!(
                    "FAIL        {}, broken by:\n{:#?}",
                    p.name,
                    path.into_actions()
                );
                continue;
            }
        };
        println!("{verdict} {}", p.name);
    }
    std::process::exit(i32::from(failed));
}
