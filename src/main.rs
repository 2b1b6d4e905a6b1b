#![forbid(unsafe_code)]
//! The `atmost` binary: its commands, each run by a module of [`cli`]:
//! `serve` runs the service ([`cli::serve`]: flags, checks, wiring);
//! `permit`, `uncertain`, `approval`, `attempt` and `demo` are the
//! operator CLI;
//! `receipt verify` and `config check` work offline.

mod cli;

use clap::{Parser, Subcommand};
use cli::serve::flags::ServeArgs;

// glibc's malloc and free were about a fifth of the server's CPU per
// Authorize in the profile (docs/performance.md). Built with `no_thp`
// (Cargo.toml), so it never asks for transparent huge pages; `main` also
// turns them off for the whole process.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    version,
    about = "A permit and receipt boundary in front of side-effecting tool calls: at most N dispatches per tool per permit."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the atmost.v1 Gate and Permits services over gRPC.
    Serve(Box<ServeArgs>),
    /// Work with receipts.
    #[command(subcommand)]
    Receipt(ReceiptCommand),
    /// Create, show and revoke permits on a running atmost (docs/cli.md).
    Permit(cli::permit::PermitArgs),
    /// List and resolve the attempts whose outcome is unknown.
    Uncertain(cli::uncertain::UncertainArgs),
    /// List, approve and deny the calls awaiting a person's approval.
    Approval(cli::approval::ApprovalArgs),
    /// Show one idempotency key's attempt.
    Attempt(cli::attempt::AttemptArgs),
    /// Play the story of a timeout, then a retry with a new key, against an
    /// atmost in this process (or --server), narrating each decision.
    Demo(cli::demo::DemoArgs),
    /// Check a configuration without serving.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Prints the configuration `atmost serve` would run with, given the
    /// same flags, ATMOST_* variables and --config file: each setting, its
    /// value (passwords masked) and where it came from, as TOML a --config
    /// file accepts. Checks it as `serve` does at start, without connecting
    /// to Redis or listening (a port already taken is found by `serve`
    /// alone); exits 0 when it is valid, 2 when not.
    Check(Box<ServeArgs>),
}

#[derive(Subcommand)]
enum ReceiptCommand {
    /// Check a receipt offline. Reads an attempt as grpcurl prints it (or
    /// an Authorize or Commit response holding one) and prints VERIFIED,
    /// FORGED or UNKNOWN_KEY; exits 0, 1 or 3 (2: unusable input). A
    /// verified receipt's tenant is said on standard error: version 2
    /// signs it, version 1 (receipts signed before it) does not.
    Verify {
        /// The public keys to trust (PEM blocks, e.g. from `openssl pkey
        /// -pubout`, or made from GetSigningKeys).
        #[arg(long, value_name = "FILE")]
        keys: std::path::PathBuf,
        /// The attempt's JSON; `-` (the default) for standard input.
        #[arg(default_value = "-")]
        attempt: String,
    },
}

fn main() -> std::process::ExitCode {
    let (cli, matches, file) = match cli::config::parse(std::env::args_os().collect()) {
        Ok(parsed) => parsed,
        Err(cli::config::Invalid::Clap(e)) => e.exit(),
        Err(cli::config::Invalid::File(e)) => {
            eprintln!("atmost: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match cli.command {
        Command::Serve(args) => cli::serve::main(*args),
        Command::Receipt(ReceiptCommand::Verify { keys, attempt }) => {
            cli::receipt::verify(&keys, &attempt)
        }
        Command::Permit(args) => cli::run(args.connection.json, cli::permit::run(args)),
        Command::Uncertain(args) => cli::run(args.connection.json, cli::uncertain::run(args)),
        Command::Approval(args) => cli::run(args.connection.json, cli::approval::run(args)),
        Command::Attempt(args) => cli::run(args.connection.json, cli::attempt::run(args)),
        Command::Demo(args) => cli::run(args.json, cli::demo::run(args)),
        Command::Config(ConfigCommand::Check(args)) => {
            cli::config::check(&args, &matches, file.as_ref())
        }
    }
}
