//! The command line (every flag has an environment variable too) and the
//! cost table file, read and checked once at start-up: a bad value stops
//! the proxy before it serves anything, saying which flag and why.
//!
//! The environment variables are ATMOST_MCP_*, except the two a client of
//! atmost means the same way as the operator CLI does (ATMOST_SERVER,
//! ATMOST_API_KEY): the server's own ATMOST_TLS_CERT and the like name
//! its certificate, not a client's, and must not be picked up here.

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use serde::Deserialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The largest cost atmost accepts (docs/api.md: 0..=2^53-1).
const MAX_COST: i64 = (1 << 53) - 1;

/// atmost-mcp: an MCP proxy that asks atmost before every tools/call.
///
/// It serves MCP to agents (Streamable HTTP on --listen, or stdio with
/// --stdio) and forwards to one upstream MCP server (--upstream URL, or a
/// command after `--` run as a child process over stdio). tools/list
/// passes through; each tools/call is authorized by atmost first and sent
/// only on DISPATCH, then committed from its result.
#[derive(Parser, Debug, Clone)]
#[command(name = "atmost-mcp", version, after_help = AFTER_HELP)]
pub struct Args {
    /// The atmost to ask: http://HOST:PORT, or https://HOST:PORT for TLS.
    #[arg(long, env = "ATMOST_SERVER", default_value = "http://127.0.0.1:50051")]
    pub server: String,
    /// Read atmost's API key from this file (surrounding whitespace is
    /// dropped); without it, the environment's ATMOST_API_KEY. The key
    /// needs the agent role.
    #[arg(long, env = "ATMOST_MCP_API_KEY_FILE", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// With an https:// --server: the CA certificate (PEM) that signed
    /// atmost's, instead of the system's trust store.
    #[arg(long, env = "ATMOST_MCP_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// mTLS to atmost: this client certificate (PEM); with --tls-key.
    #[arg(
        long,
        env = "ATMOST_MCP_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// mTLS to atmost: the private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "ATMOST_MCP_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// The name atmost's certificate must carry, when it is not the
    /// --server host.
    #[arg(long, env = "ATMOST_MCP_TLS_SERVER_NAME", value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// Each atmost RPC's deadline (Authorize, Commit, MarkUncertain), and
    /// the time to open the connection.
    #[arg(long, env = "ATMOST_MCP_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,

    /// The upstream MCP server's Streamable HTTP endpoint (http:// or
    /// https://, e.g. http://127.0.0.1:8000/mcp). Or, instead, give the
    /// upstream's command after `--`.
    #[arg(long, env = "ATMOST_MCP_UPSTREAM", value_name = "URL")]
    pub upstream: Option<String>,
    /// With an https:// --upstream: a CA certificate (PEM) to trust besides
    /// the system's.
    #[arg(long, env = "ATMOST_MCP_UPSTREAM_TLS_CA", value_name = "FILE")]
    pub upstream_tls_ca: Option<PathBuf>,
    /// The upstream as a command, run as a child process speaking MCP on
    /// its stdin and stdout (started again if it exits).
    #[arg(last = true, value_name = "COMMAND")]
    pub upstream_command: Vec<String>,

    /// Serve MCP over Streamable HTTP on this address, at the path /mcp.
    #[arg(
        long,
        env = "ATMOST_MCP_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:8080",
        conflicts_with = "stdio"
    )]
    pub listen: SocketAddr,
    /// Serve MCP on stdin and stdout instead (one agent, one session), for
    /// an agent that starts the proxy as its MCP server.
    #[arg(long)]
    pub stdio: bool,
    /// A Host header value the HTTP server accepts (repeat); by default
    /// only loopback names (localhost, 127.0.0.1, ::1), which guards a
    /// local proxy against DNS rebinding. Name the proxy's own host names
    /// when agents reach it over the network.
    #[arg(
        long = "allowed-host",
        env = "ATMOST_MCP_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    pub allowed_hosts: Vec<String>,

    /// The permit every tools/call is authorized under. Give it or
    /// --permit-header, not both.
    #[arg(long, env = "ATMOST_MCP_PERMIT", value_name = "ID")]
    pub permit: Option<String>,
    /// Instead of --permit: read each call's permit from this HTTP request
    /// header (e.g. x-atmost-permit), sent by the agent's HTTP client with
    /// every request. Not with --permit. Off unless given: any agent that
    /// reaches the proxy may name any permit of the proxy's atmost tenant,
    /// so use it only behind a gateway that sets the header itself,
    /// overwriting any the agent sent (a request with the header more than
    /// once is refused).
    #[arg(long, env = "ATMOST_MCP_PERMIT_HEADER", value_name = "NAME")]
    pub permit_header: Option<String>,
    /// The cost table (TOML): `default = N` and a `[tools]` table of
    /// `name = N`, in minor units. Without it every call costs 0.
    #[arg(long, env = "ATMOST_MCP_COSTS", value_name = "FILE")]
    pub costs: Option<PathBuf>,
    /// How long a dispatched tools/call may take before its outcome is
    /// taken as unknown (MarkUncertain); by default the attempt's lease
    /// less 1 s. More than 0.
    #[arg(long, env = "ATMOST_MCP_DISPATCH_TIMEOUT", value_parser = parse_dispatch_timeout)]
    pub dispatch_timeout: Option<Duration>,
    /// How long a tools/call the permit's approval rule holds may stay
    /// open waiting for a person's decision, and be sent as soon as it is
    /// approved. 0 (the default): answered at once, the agent told to make
    /// the same call again later. Keep it below the agents' own request
    /// timeout.
    #[arg(long, env = "ATMOST_MCP_APPROVAL_WAIT", value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration)]
    pub approval_wait: Duration,
    /// Log lines as JSON instead of text (on stderr; RUST_LOG filters).
    #[arg(long, env = "ATMOST_MCP_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

const AFTER_HELP: &str = "\
Examples:
  atmost-mcp --permit 0193c7a2-... --upstream http://127.0.0.1:8000/mcp --listen 127.0.0.1:8080
  atmost-mcp --stdio --permit 0193c7a2-... --costs costs.toml -- python server.py

See mcp/README.md and docs/gateways.md (\"atmost-mcp\").";

/// --dispatch-timeout: a duration, not 0 (a call given no time to run
/// could never be sent: every one would fail).
fn parse_dispatch_timeout(text: &str) -> Result<Duration, String> {
    let timeout = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if timeout.is_zero() {
        return Err("0 leaves no time to send any call: give more than 0, or leave it out for the lease less 1 s".into());
    }
    Ok(timeout)
}

/// Where the upstream MCP server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamSpec {
    Http { url: String, ca: Option<PathBuf> },
    Command { program: String, args: Vec<String> },
}

impl Args {
    /// The flags from the command line and the environment (clap's
    /// `Args::parse`, then [`Args::from_matches`]); a bad one prints
    /// clap's error and exits 2.
    pub fn from_command_line() -> Self {
        let matches = Self::command().get_matches();
        Self::from_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// The flags of parsed `matches`, with ATMOST_MCP_PERMIT and
    /// ATMOST_MCP_PERMIT_HEADER set but empty taken as not set, as a shell
    /// or a template writes them (the atmost CLI takes an empty
    /// ATMOST_API_KEY the same way). Else `ATMOST_MCP_PERMIT_HEADER=` next
    /// to `--permit` would read as both.
    pub fn from_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = Self::from_arg_matches(matches)?;
        for (id, value) in [
            ("permit", &mut args.permit),
            ("permit_header", &mut args.permit_header),
        ] {
            if matches.value_source(id) == Some(ValueSource::EnvVariable)
                && value.as_deref() == Some("")
            {
                *value = None;
            }
        }
        Ok(args)
    }

    /// The upstream, from --upstream or the command after `--` (exactly
    /// one of them).
    pub fn upstream_spec(&self) -> Result<UpstreamSpec, String> {
        match (&self.upstream, self.upstream_command.split_first()) {
            (Some(_), Some(_)) => {
                Err("give --upstream URL or a command after `--`, not both".into())
            }
            (None, None) => {
                Err("no upstream: give --upstream URL, or the upstream's command after `--`".into())
            }
            (Some(url), None) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!(
                        "--upstream {url:?}: give an http:// or https:// URL"
                    ));
                }
                if self.upstream_tls_ca.is_some() && !url.starts_with("https://") {
                    return Err("--upstream-tls-ca needs an https:// --upstream".into());
                }
                Ok(UpstreamSpec::Http {
                    url: url.clone(),
                    ca: self.upstream_tls_ca.clone(),
                })
            }
            (None, Some((program, args))) => {
                if self.upstream_tls_ca.is_some() {
                    return Err("--upstream-tls-ca needs an https:// --upstream".into());
                }
                Ok(UpstreamSpec::Command {
                    program: program.clone(),
                    args: args.to_vec(),
                })
            }
        }
    }

    /// Where the permit of a call comes from: --permit or --permit-header,
    /// exactly one. Both are refused, not ranked: a header that could
    /// override the pinned permit would let any agent that reaches the
    /// proxy name any permit of its tenant.
    pub fn permit_source(&self) -> Result<PermitSource, String> {
        if let Some(permit) = &self.permit
            && permit.trim().is_empty()
        {
            return Err("--permit (ATMOST_MCP_PERMIT) is empty".into());
        }
        match (&self.permit, &self.permit_header) {
            (Some(_), Some(_)) => Err(
                "give --permit (ATMOST_MCP_PERMIT) or --permit-header (ATMOST_MCP_PERMIT_HEADER), \
                 not both: the header would let any agent name another permit than the pinned one"
                    .into(),
            ),
            (None, None) => Err("no permit: give --permit ID, or --permit-header NAME".into()),
            (Some(permit), None) => Ok(PermitSource::Fixed(permit.clone())),
            (None, Some(name)) => {
                let header = http::HeaderName::try_from(name.as_str())
                    .map_err(|_| {
                        format!(
                            "--permit-header (ATMOST_MCP_PERMIT_HEADER) {name:?}: not an HTTP header name"
                        )
                    })?;
                if self.stdio {
                    return Err(
                        "--permit-header needs HTTP: over --stdio there are no headers".into(),
                    );
                }
                Ok(PermitSource::Header(header))
            }
        }
    }
}

/// The permit of a call: the configured one, or the request's header.
#[derive(Debug, Clone)]
pub enum PermitSource {
    /// --permit: every call's.
    Fixed(String),
    /// --permit-header: each HTTP request names its own.
    Header(http::HeaderName),
}

// === the cost table ===

/// What a call of each tool reserves in atmost, in the permit's minor
/// units: the tool's entry, else the default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Costs {
    default: i64,
    tools: HashMap<String, i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CostsFile {
    #[serde(default)]
    default: i64,
    #[serde(default)]
    tools: HashMap<String, i64>,
}

impl Costs {
    pub fn of(&self, tool: &str) -> i64 {
        self.tools.get(tool).copied().unwrap_or(self.default)
    }

    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--costs {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("--costs {}: {e}", path.display()))
    }

    /// The table from TOML text: `default = N` and `[tools]` with
    /// `name = N`; every cost in 0..=2^53-1, nothing else in the file.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: CostsFile = toml::from_str(text).map_err(|e| e.to_string().trim().to_owned())?;
        let check = |what: &str, cost: i64| {
            if (0..=MAX_COST).contains(&cost) {
                Ok(())
            } else {
                Err(format!("{what} = {cost}: a cost is 0..=2^53-1 minor units"))
            }
        };
        check("default", file.default)?;
        let mut names: Vec<_> = file.tools.iter().collect();
        names.sort();
        for (tool, cost) in names {
            check(&format!("tools.{tool:?}"), *cost)?;
        }
        Ok(Self {
            default: file.default,
            tools: file.tools,
        })
    }
}

#[cfg(test)]
mod tests;
