#![forbid(unsafe_code)]
// The store's futures nest deep (as in the server: src/lib.rs).
#![recursion_limit = "256"]
//! `redis_ceiling`: the benchmark's Redis ceiling (a), the authorize script
//! exactly as the Redis store sends it, by connection strategy; parses
//! [`atmost_bench::ceiling::Args`] and runs it. Fails on any call that is not
//! a fresh DISPATCH.

use clap::Parser;

// The same allocator as the server and the load generator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    atmost_bench::ceiling::run(atmost_bench::ceiling::Args::parse()).await
}
