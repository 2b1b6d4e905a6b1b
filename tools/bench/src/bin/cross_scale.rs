#![forbid(unsafe_code)]
// The store's futures nest deep (as in the server: src/lib.rs).
#![recursion_limit = "256"]
//! `cross_scale`: reconciling across permits at scale (docs/performance.md,
//! "Reconciling across permits"); parses
//! [`atmost_bench::cross_scale::Args`] and runs it.

use clap::Parser;

// The same allocator as the server and the load generator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = atmost_bench::cross_scale::Args::parse();
    atmost_bench::cross_scale::run(args).await.map(drop)
}
