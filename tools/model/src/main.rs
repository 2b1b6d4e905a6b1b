//! `atmost-model`: the protocol's model check at bounds of your choice (the
//! test runs [`Bounds::AGENTS`]): `cargo run -p atmost-model --release --
//! --agents 3 --calls 2`. Prints the states explored and each property's
//! verdict; exits 1 if a property fails.

use atmost_model::{Bounds, Holes, Protocol};
use clap::Parser;
use stateright::{Checker, Model};
use std::time::Instant;

#[derive(Parser)]
struct Args {
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
    #[arg(long, default_value_t = Bounds::AGENTS.ticks)]
    ticks: u8,
    /// Put hole 1 back (the store ignores which agent calls).
    #[arg(long)]
    hole_1: bool,
    /// Put hole 2 back (the client sends on any redelivery).
    #[arg(long)]
    hole_2: bool,
    /// Checker threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() {
    let a = Args::parse();
    let bounds = Bounds {
        agents: a.agents,
        calls: a.calls,
        tries: a.tries,
        crashes: a.crashes,
        losses: a.losses,
        duplicates: a.duplicates,
        ticks: a.ticks,
    };
    let protocol = Protocol::new(bounds).with_holes(Holes {
        store_ignores_the_agent: a.hole_1,
        client_sends_on_any_redelivery: a.hole_2,
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
        let ok = match p.expectation {
            stateright::Expectation::Sometimes => found.is_some(),
            _ => found.is_none(),
        };
        failed |= !ok;
        println!("{} {}", if ok { "ok  " } else { "FAIL" }, p.name);
        if let (false, Some(path)) = (ok, found) {
            println!("{:#?}", path.into_actions());
        }
    }
    std::process::exit(i32::from(failed));
}
