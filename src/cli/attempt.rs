//! `atmost attempt get`: GetAttempt, one key's attempt as every reader
//! sees it now.

use super::{Connection, Failure, connect, show};

#[derive(clap::Args, Debug)]
pub struct AttemptArgs {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: AttemptCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum AttemptCommand {
    /// Show one idempotency key's attempt (GetAttempt): its state (a
    /// RESERVED one past its lease is UNCERTAIN), its receipt or reason.
    Get {
        /// The permit's id.
        permit_id: String,
        /// The idempotency key.
        key: String,
    },
}

pub async fn run(args: AttemptArgs) -> Result<(), Failure> {
    let client = connect(&args.connection.server, &args.connection.credentials).await?;
    match args.command {
        AttemptCommand::Get { permit_id, key } => {
            let got = client.get_attempt(&permit_id, &key).await?;
            if args.connection.json {
                show::print_json(&show::json_value("GetAttemptResponse", &got));
            } else {
                outln!("{}", show::attempt(&got.attempt.unwrap_or_default()));
            }
        }
    }
    Ok(())
}
