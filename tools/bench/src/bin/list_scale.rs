#![forbid(unsafe_code)]
//! `list_scale`: ListUncertain at scale (docs/performance.md, "ListUncertain
//! at scale"); parses [`atmost_bench::list_scale::Args`] and runs it.

use clap::Parser;

// The same allocator as the server and the load generator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = atmost_bench::list_scale::Args::parse();
    atmost_bench::list_scale::run(args).await.map(drop)
}
