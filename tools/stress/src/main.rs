#![forbid(unsafe_code)]
//! `atmost-stress`: runs the checker ([`atmost_stress::run`]), prints the
//! first violations and the summary line, and exits 1 on any violation (2
//! if the run itself failed).

use clap::Parser;

#[tokio::main]
async fn main() {
    // Ctrl-C ends the load early; the check still runs.
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    match atmost_stress::run(atmost_stress::Args::parse(), interrupt).await {
        Ok(summary) => {
            for v in summary.violations.iter().take(30) {
                eprintln!("violation: {v}");
            }
            eprintln!(
                "stress: {} RPCs failed in transport (killed replicas, HTTP/2 GOAWAY): counted as lost answers",
                summary.transport_failures
            );
            println!("{summary}");
            if !summary.violations.is_empty() {
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("stress: {e}");
            std::process::exit(2);
        }
    }
}
