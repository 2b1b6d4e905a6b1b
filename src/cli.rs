//! The binary's commands. [`serve`] runs the service: its flags
//! ([`serve::flags`]), what it checks before starting anything
//! ([`serve::prepare`]) and the wiring; [`config`] reads a `--config` file
//! under the flags and runs `config check`; [`receipt`] verifies offline.
//!
//! The rest is the operator CLI: `atmost permit`, `atmost uncertain`,
//! `atmost approval`, `atmost attempt` and `atmost demo`. Every command is a
//! client of a running atmost over gRPC, through `atmost-client`, with the
//! credentials any client has (an API key, TLS, a client certificate);
//! nothing here reaches a store. docs/cli.md is the manual.
//!
//! - [`show`]: what a command prints: tables for people, `--json` (the
//!   proto3 JSON of the response) for scripts, errors on stderr.
//! - [`permit`], [`uncertain`], [`approval`], [`attempt`]: one file per
//!   noun.
//! - [`demo`]: the timeout-then-new-key story, against a server in this
//!   process or `--server`.
//!
//! Exit codes, which scripts may rely on ([`Failure::exit_code`]): 0
//! success; 2 usage or invalid input (clap's own code, and
//! INVALID_REQUEST); 3 not found (PERMIT_NOT_FOUND, ATTEMPT_NOT_FOUND); 4
//! refused (any other reason atmost gives); 5 unavailable (no connection,
//! UNAVAILABLE, a deadline); 1 the demo's story went otherwise.

/// `println!` that a closed stdout (`atmost ... | head`) does not panic:
/// the rest of the output is dropped, and the command goes on to its end.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!`, likewise.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod approval;
pub mod attempt;
pub mod config;
pub mod demo;
pub mod permit;
pub mod receipt;
pub mod serve;
pub mod show;
pub mod uncertain;

use atmost_client::{Client, Reason};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tonic::Code;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// Where the commands of `permit`, `uncertain`, `approval` and `attempt`
/// send their calls, and how their answers are printed. Global: the flags
/// may come before or after the subcommand.
#[derive(clap::Args, Clone, Debug)]
pub struct Connection {
    /// The atmost to call: http://HOST:PORT, or https:// for TLS.
    #[arg(
        long,
        env = "ATMOST_SERVER",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    pub server: String,
    #[command(flatten)]
    pub credentials: Credentials,
    /// Print the response as one JSON document (proto3 JSON, the proto's
    /// JSON field names) on stdout; errors as one on stderr.
    #[arg(long, global = true)]
    pub json: bool,
}

/// What identifies this client to the server, and how long it waits.
/// (`Debug` by hand: the API key is redacted.)
#[derive(clap::Args, Clone)]
pub struct Credentials {
    /// API key, sent as `authorization: Bearer <key>` (a server with
    /// --auth-keys); without it, --api-key-file, else the environment's
    /// ATMOST_API_KEY. Prefer those two: a flag's value is visible to
    /// other users of the machine. Never printed.
    #[arg(long, value_name = "KEY", global = true)]
    pub api_key: Option<String>,
    /// Read the API key from this file (one line; surrounding whitespace
    /// is dropped). Overrides ATMOST_API_KEY.
    #[arg(long, value_name = "FILE", global = true, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// With an https:// server: the CA certificate (PEM) that signed the
    /// server's, instead of the system's trust store.
    #[arg(long, value_name = "FILE", global = true)]
    pub tls_ca: Option<PathBuf>,
    /// mTLS: this client certificate (PEM); with --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key", global = true)]
    pub tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert", global = true)]
    pub tls_key: Option<PathBuf>,
    /// The name to check the server's certificate against, when it is not
    /// the --server host (a server reached by IP address, say).
    #[arg(long, value_name = "NAME", global = true)]
    pub tls_server_name: Option<String>,
    /// How long to wait for the connection, and for each call (the call's
    /// gRPC deadline), e.g. 500ms, 10s.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub timeout: Duration,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("api_key_file", &self.api_key_file)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_server_name", &self.tls_server_name)
            .field("timeout", &self.timeout)
            .finish()
    }
}

// === failures and exit codes ===

/// Why a command failed; its exit code is the contract scripts rely on.
#[derive(Debug)]
pub enum Failure {
    /// Input the command cannot use (a file it cannot read, flags that do
    /// not go together): exit 2, nothing was sent.
    Usage(String),
    /// No connection to the server: exit 5, nothing was sent.
    Connect(String),
    /// The server (or the transport) answered an error: its exit code
    /// follows the reason.
    Rpc(atmost_client::Error),
    /// The demo's story went otherwise: exit 1.
    Story(String),
}

impl From<atmost_client::Error> for Failure {
    fn from(e: atmost_client::Error) -> Self {
        Failure::Rpc(e)
    }
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Usage(_) => 2,
            Failure::Connect(_) => 5,
            Failure::Story(_) => 1,
            Failure::Rpc(e) => rpc_exit_code(e),
        }
    }
}

/// 3 not found, 2 invalid input, 5 unavailable, 4 every other refusal.
fn rpc_exit_code(e: &atmost_client::Error) -> u8 {
    match e.reason() {
        Some(Reason::PermitNotFound | Reason::AttemptNotFound) => 3,
        Some(Reason::InvalidRequest) => 2,
        Some(Reason::StoreUnavailable | Reason::Overloaded | Reason::DeadlineExceeded) => 5,
        Some(_) => 4,
        // Not atmost's answer: the transport's (no connection, a deadline
        // passed on this side) or something in between.
        None => match e.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => 5,
            _ => 4,
        },
    }
}

/// Runs a command on a current-thread runtime and turns its outcome into
/// the exit code, printing a failure on stderr.
pub fn run<F>(json: bool, command: F) -> ExitCode
where
    F: Future<Output = Result<(), Failure>>,
{
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            errln!("atmost: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            show::failure(&failure, json);
            ExitCode::from(failure.exit_code())
        }
    }
}

// === connecting ===

/// A client of `server` with these credentials, connected (within the
/// timeout) or failed.
pub async fn connect(server: &str, credentials: &Credentials) -> Result<Client, Failure> {
    let tls = server.starts_with("https://");
    if !tls && !server.starts_with("http://") {
        return Err(Failure::Usage(format!(
            "--server {server:?}: give http://HOST:PORT, or https://HOST:PORT for TLS"
        )));
    }
    let mut endpoint = Endpoint::from_shared(server.to_owned())
        .map_err(|e| Failure::Usage(format!("--server {server:?}: {e}")))?
        .connect_timeout(credentials.timeout);
    let c = credentials;
    if tls {
        let mut config = ClientTlsConfig::new();
        config = match &c.tls_ca {
            Some(ca) => config.ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?)),
            None => config.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&c.tls_cert, &c.tls_key) {
            config = config.identity(Identity::from_pem(
                read(cert, "--tls-cert")?,
                read(key, "--tls-key")?,
            ));
        }
        if let Some(name) = &c.tls_server_name {
            config = config.domain_name(name);
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| Failure::Usage(format!("TLS: {e}")))?;
    } else if c.tls_ca.is_some() || c.tls_cert.is_some() || c.tls_server_name.is_some() {
        return Err(Failure::Usage(
            "--tls-ca, --tls-cert and --tls-server-name need an https:// --server".into(),
        ));
    }
    let api_key = api_key(c)?;
    let channel = endpoint.connect().await.map_err(|e| {
        // tonic's transport error says only "transport error"; its source
        // says what happened (refused, a handshake that failed).
        let mut why = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            // Layers often repeat the layer below's words: say each once.
            let said = s.to_string();
            if !why.ends_with(&said) {
                why = format!("{why}: {said}");
            }
            source = s.source();
        }
        Failure::Connect(format!("cannot connect to {server}: {why}"))
    })?;
    let client = Client::new(channel).with_timeout(c.timeout);
    match api_key {
        Some(key) => client.with_api_key(&key).map_err(|_| {
            Failure::Usage("the API key is not visible ASCII (it is not shown)".into())
        }),
        None => Ok(client),
    }
}

/// The environment variable read for the API key when no flag gives one.
/// (Read here, not by clap, so that --api-key-file overrides it rather than
/// conflicting with it.)
pub const API_KEY_ENV: &str = "ATMOST_API_KEY";

/// The API key: --api-key, --api-key-file, else ATMOST_API_KEY.
fn api_key(c: &Credentials) -> Result<Option<String>, Failure> {
    if let Some(key) = &c.api_key {
        return match key.is_empty() {
            true => Err(Failure::Usage("--api-key is empty".into())),
            false => Ok(Some(key.clone())),
        };
    }
    let key = match &c.api_key_file {
        Some(path) => {
            let text = String::from_utf8(read(path, "--api-key-file")?).map_err(|_| {
                Failure::Usage(format!("--api-key-file {}: not UTF-8 text", path.display()))
            })?;
            Some(text.trim().to_owned())
        }
        // Set but empty is taken as not set, as shells write it.
        None => std::env::var(API_KEY_ENV).ok().filter(|k| !k.is_empty()),
    };
    match key {
        Some(k) if k.is_empty() => Err(Failure::Usage("the API key is empty".into())),
        key => Ok(key),
    }
}

/// A file the command needs, or a usage failure naming it and its flag.
pub fn read(path: &Path, flag: &str) -> Result<Vec<u8>, Failure> {
    std::fs::read(path).map_err(|e| Failure::Usage(format!("{flag} {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::Connection;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        connection: Connection,
    }

    #[test]
    fn the_api_key_never_shows_in_debug_output() {
        let cli = Cli::parse_from(["atmost", "--api-key", "sk-live-7f3a9c"]);
        let shown = format!("{:?} {:#?}", cli.connection, cli.connection.credentials);
        assert!(!shown.contains("sk-live-7f3a9c"), "{shown}");
        assert!(shown.contains("api_key: Some(\"<redacted>\")"), "{shown}");
        let none = Cli::parse_from(["atmost"]);
        assert!(format!("{:?}", none.connection).contains("api_key: None"));
    }
}
