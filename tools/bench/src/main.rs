#![forbid(unsafe_code)]
//! `atmost-bench`: parses the arguments and runs [`atmost_bench::generate`]
//! on a runtime of `--threads` workers.

use clap::Parser;

// The same allocator as the server: the generator shares the server's cores,
// so its own malloc time would be taken from the server.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = atmost_bench::Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        runtime.worker_threads(n.max(1));
    }
    runtime
        .enable_all()
        .build()?
        .block_on(atmost_bench::generate(args))
}
