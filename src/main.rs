#![forbid(unsafe_code)]
//! The `atmost` binary: `atmost serve` runs the gRPC service; `permit`,
//! `uncertain`, `attempt` and `demo` are its operator CLI ([`cli`]).

mod cli;

use atmost::auth::Authenticator;
use atmost::config::{self, FileSettings};
use atmost::domain::Millis;
use atmost::store::{
    Backend,
    memory::MemoryStore,
    redis::{Durability, Mode, RedisConfig, RedisStore, Time},
};
use atmost::{App, run};
use clap::builder::TypedValueParser;
use clap::{Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

/// The transport limits' and quotas' defaults, for the flags' defaults.
const LIMITS: atmost::transport::Limits = atmost::transport::Limits::DEFAULT;
const QUOTAS: atmost::domain::Quotas = atmost::domain::Quotas::DEFAULT;

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

/// `atmost receipt verify`: the verdict's exit code.
fn receipt_verify(keys: &std::path::Path, attempt: &str) -> std::process::ExitCode {
    use atmost::receipts::{Verdict, verify_json};
    use std::io::Read;
    let input = match attempt {
        "-" => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).map(|_| text)
        }
        path => std::fs::read_to_string(path),
    };
    let verdict = input
        .map_err(|e| format!("{attempt}: {e}"))
        .and_then(|text| {
            let pem =
                std::fs::read_to_string(keys).map_err(|e| format!("{}: {e}", keys.display()))?;
            verify_json(&text, &pem)
        });
    match verdict.map(|c| (c.verdict, c.tenant)) {
        Ok((Verdict::Verified, tenant)) => {
            println!("VERIFIED");
            // What the signature proves about whose permit it was.
            match tenant {
                Some(t) if t.is_empty() => {
                    eprintln!("atmost: signed in version 2, tenant \"\" (dev mode, no keys)")
                }
                Some(t) => eprintln!("atmost: signed in version 2, tenant {t:?}"),
                None => eprintln!(
                    "atmost: signed in version 1, which signs no tenant: it proves nothing about whose permit the receipt came from"
                ),
            }
            std::process::ExitCode::SUCCESS
        }
        Ok((Verdict::Forged, _)) => {
            println!("FORGED");
            std::process::ExitCode::from(1)
        }
        Ok((Verdict::UnknownKey, _)) => {
            println!("UNKNOWN_KEY");
            std::process::ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("atmost: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum StoreKind {
    /// Process memory: nothing survives a restart. For trying atmost out.
    Memory,
    /// Redis: shared by any number of replicas.
    Redis,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RedisMode {
    /// One Redis server.
    Standalone,
    /// A Redis Cluster: --redis-url lists seed nodes.
    Cluster,
    /// The primary Sentinel names: --redis-url lists the Sentinels.
    Sentinel,
}

#[derive(Clone, Copy, ValueEnum)]
enum DurabilityArg {
    /// The primary acknowledged it.
    None,
    /// A replica acknowledged it too.
    Replica,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A TOML file of settings: keys are these flags' names without `--`
    /// (`store-timeout = "2s"`). A flag beats its ATMOST_* variable, which
    /// beats the file, which beats the default.
    #[arg(long, env = "ATMOST_CONFIG", value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "ATMOST_LISTEN", default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Where permits and attempts live.
    #[arg(long, env = "ATMOST_STORE", value_enum, default_value = "memory")]
    store: StoreKind,
    /// Redis URL (with --store redis); with --redis-mode cluster or
    /// sentinel, a comma-separated list of seed nodes or of Sentinels.
    #[arg(
        long,
        env = "ATMOST_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// What --redis-url names: one server, a Redis Cluster, or Sentinels.
    #[arg(
        long,
        env = "ATMOST_REDIS_MODE",
        value_enum,
        default_value = "standalone"
    )]
    redis_mode: RedisMode,
    /// With --redis-mode sentinel: the name the Sentinels know the primary
    /// by (their `sentinel monitor <name> ...`).
    #[arg(long, env = "ATMOST_REDIS_SENTINEL_MASTER", value_name = "NAME")]
    redis_sentinel_master: Option<String>,
    /// What a state change waits for before atmost answers: `none`, the
    /// primary (a failover may lose the last writes); `replica`, a replica
    /// too (WAIT 1; none in time answers UNAVAILABLE).
    #[arg(long, env = "ATMOST_DURABILITY", value_enum, default_value = "none")]
    durability: DurabilityArg,
    /// For a rediss:// URL: the CA certificate (PEM) that signed Redis's,
    /// instead of the system's trust store.
    #[arg(long, env = "ATMOST_REDIS_TLS_CA", value_name = "FILE")]
    redis_tls_ca: Option<std::path::PathBuf>,
    /// Prefix of every Redis key.
    #[arg(long, env = "ATMOST_REDIS_PREFIX", default_value = "atmost")]
    redis_prefix: String,
    /// Serve on a Redis whose maxmemory-policy may evict keys. It weakens the
    /// guarantee: an evicted finished attempt lets its key be dispatched
    /// again. Without it, atmost refuses such a Redis.
    #[arg(long, env = "ATMOST_ALLOW_EVICTION")]
    allow_eviction: bool,
    /// Serve on a Redis that will not tell its maxmemory-policy (neither
    /// INFO memory nor CONFIG GET permitted): you vouch that it is
    /// noeviction. If it is not, an evicted finished attempt lets its key be
    /// dispatched again. Without it, atmost refuses such a Redis; granting
    /// its Redis user +info lets it read the policy instead.
    #[arg(long, env = "ATMOST_ALLOW_UNKNOWN_EVICTION_POLICY")]
    allow_unknown_eviction_policy: bool,
    /// How long finished attempts and permits are kept past the permit's
    /// expiry (at most 10y).
    #[arg(long, env = "ATMOST_RETENTION", default_value = "24h", value_parser = retention)]
    retention: Duration,
    /// How long a store call may take before the RPC answers UNAVAILABLE
    /// (1ms to 60s).
    #[arg(long, env = "ATMOST_STORE_TIMEOUT", default_value = "2s", value_parser = store_timeout)]
    store_timeout: Duration,
    /// How long in-flight RPCs may take to finish on SIGTERM or Ctrl-C (at
    /// most 1h).
    #[arg(long, env = "ATMOST_SHUTDOWN_GRACE", default_value = "10s", value_parser = shutdown_grace)]
    shutdown_grace: Duration,
    /// On SIGTERM or Ctrl-C, how long to keep serving (and accepting) with
    /// health NOT_SERVING before --shutdown-grace begins, so load balancers
    /// and readiness probes stop sending first; a second signal cuts it
    /// short (at most 1h).
    #[arg(long, env = "ATMOST_DRAIN_DELAY", default_value = "0s", value_parser = shutdown_grace)]
    drain_delay: Duration,
    /// Store calls running at once; more wait for a slot, up to
    /// --max-queue-wait, then are refused with UNAVAILABLE / OVERLOADED.
    #[arg(long, env = "ATMOST_MAX_IN_FLIGHT", default_value_t = atmost::server::DEFAULT_MAX_IN_FLIGHT)]
    max_in_flight: usize,
    /// The longest a request waits for an admission slot (0s to 10s; 0s:
    /// refused at once).
    #[arg(long, env = "ATMOST_MAX_QUEUE_WAIT", default_value = "10ms", value_parser = queue_wait)]
    max_queue_wait: Duration,
    /// Tokio worker threads (default: the CPUs this process may use,
    /// cgroup quota included).
    #[arg(long, env = "ATMOST_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// API keys (a TOML file of SHA-256 digests, tenants and roles; see
    /// docs/api.md, "Authentication"): every atmost RPC then needs
    /// `authorization: Bearer <key>`. Re-read on SIGHUP and when it changes.
    /// Without it atmost runs in dev mode: no authentication, loopback only.
    #[arg(long, env = "ATMOST_AUTH_KEYS", value_name = "FILE")]
    auth_keys: Option<std::path::PathBuf>,
    /// Dev mode on a non-loopback address: anyone who reaches the port may
    /// call every RPC. For a trusted network only.
    #[arg(long, env = "ATMOST_INSECURE_NO_AUTH")]
    insecure_no_auth: bool,
    /// Serve over TLS with this certificate chain (PEM); with --tls-key.
    #[arg(long, env = "ATMOST_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "ATMOST_TLS_KEY", value_name = "FILE")]
    tls_key: Option<std::path::PathBuf>,
    /// mTLS: verify client certificates against this CA (PEM). A verified
    /// certificate can stand in for a key: --auth-keys maps its SAN to a
    /// tenant and roles. Needs --tls-cert and --auth-keys.
    #[arg(long, env = "ATMOST_TLS_CLIENT_CA", value_name = "FILE")]
    tls_client_ca: Option<std::path::PathBuf>,
    /// Sign every receipt with this Ed25519 key (PKCS#8 PEM: `openssl
    /// genpkey -algorithm ed25519`); its public key is published by
    /// atmost.v1.Receipts/GetSigningKeys. Without it receipts are unsigned.
    #[arg(long, env = "ATMOST_RECEIPT_SIGNING_KEY", value_name = "FILE")]
    receipt_signing_key: Option<std::path::PathBuf>,
    /// More Ed25519 public keys (PEM blocks in one file) whose signatures
    /// still verify: the previous keys of a rotation.
    #[arg(long, env = "ATMOST_RECEIPT_VERIFY_KEYS", value_name = "FILE")]
    receipt_verify_keys: Option<std::path::PathBuf>,
    /// Serve gRPC server reflection (unauthenticated: it shows the
    /// service's shape, no data). `--reflection=false` turns it off.
    #[arg(long, env = "ATMOST_REFLECTION", default_value_t = true, action = clap::ArgAction::Set)]
    reflection: bool,
    /// Serve the Envoy front doors on this port: ext_authz
    /// (envoy.service.auth.v3.Authorization/Check) and ext_proc
    /// (envoy.service.ext_proc.v3.ExternalProcessor/Process), for the agent
    /// role (docs/gateways.md). `--envoy=false` turns them off.
    #[arg(long, env = "ATMOST_ENVOY", default_value_t = true, action = clap::ArgAction::Set)]
    envoy: bool,
    /// The Envoy front doors' mapping (TOML): where the permit, tool, key,
    /// fingerprint and cost of a request come from, and how ext_proc
    /// settles an attempt from the response (docs/gateways.md, "The
    /// mapping"). Without it, the defaults.
    #[arg(long, env = "ATMOST_ENVOY_MAPPING", value_name = "FILE")]
    envoy_mapping: Option<std::path::PathBuf>,
    /// Connections open at once; past it a new connection is closed as soon
    /// as it is accepted (docs/security.md, "Transport limits").
    #[arg(long, env = "ATMOST_MAX_CONNECTIONS", default_value_t = LIMITS.max_connections,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000).map(|n| n as usize))]
    max_connections: usize,
    /// RPCs open at once on one connection (HTTP/2
    /// SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, env = "ATMOST_MAX_CONCURRENT_STREAMS", default_value_t = LIMITS.max_concurrent_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    max_concurrent_streams: u32,
    /// Largest request message, in bytes (the largest valid request is 75 939
    /// bytes); larger ones answer RESOURCE_EXHAUSTED / MESSAGE_TOO_LARGE
    /// before their body is read.
    #[arg(long, env = "ATMOST_MAX_REQUEST_BYTES", default_value_t = LIMITS.max_request_bytes,
          value_parser = clap::value_parser!(u32).range(80_000..=64 * 1024 * 1024).map(|n| n as usize))]
    max_request_bytes: usize,
    /// Largest response message, in bytes (a ListUncertain page of 1000 is
    /// up to 1.6 MiB; a smaller limit fails the RPCs whose answer is larger).
    #[arg(long, env = "ATMOST_MAX_RESPONSE_BYTES", default_value_t = LIMITS.max_response_bytes,
          value_parser = clap::value_parser!(u32).range(64 * 1024..=64 * 1024 * 1024).map(|n| n as usize))]
    max_response_bytes: usize,
    /// Largest header list of one request, in bytes (HTTP/2
    /// SETTINGS_MAX_HEADER_LIST_SIZE).
    #[arg(long, env = "ATMOST_MAX_HEADER_LIST_BYTES", default_value_t = LIMITS.max_header_list_bytes,
          value_parser = clap::value_parser!(u32).range(4096..=1024 * 1024))]
    max_header_list_bytes: u32,
    /// HTTP/2 PING interval on every connection (1s to 2h).
    #[arg(long, env = "ATMOST_KEEPALIVE_INTERVAL", default_value = "60s", value_parser = keepalive)]
    keepalive_interval: Duration,
    /// A peer that does not answer a PING within this is disconnected (1s
    /// to 2h).
    #[arg(long, env = "ATMOST_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = keepalive)]
    keepalive_timeout: Duration,
    /// A connection with no RPC open this long is closed (1s to 24h).
    #[arg(long, env = "ATMOST_IDLE_TIMEOUT", default_value = "5m", value_parser = connection_time)]
    idle_timeout: Duration,
    /// After this, a connection gets GOAWAY, so long-lived clients reconnect
    /// and spread over replicas (1s to 24h).
    #[arg(long, env = "ATMOST_MAX_CONNECTION_AGE", default_value = "10m", value_parser = connection_time)]
    max_connection_age: Duration,
    /// How long RPCs open at GOAWAY may still take before the connection is
    /// closed (0s to 1h).
    #[arg(long, env = "ATMOST_MAX_CONNECTION_AGE_GRACE", default_value = "30s", value_parser = shutdown_grace)]
    max_connection_age_grace: Duration,
    /// The HTTP/2 preface (plaintext) or the TLS handshake must arrive within this
    /// (100ms to 60s).
    #[arg(long, env = "ATMOST_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = handshake_timeout)]
    handshake_timeout: Duration,
    /// One RPC, its request body included, may take this long; past it the
    /// RPC answers CANCELLED (10ms to 1h).
    #[arg(long, env = "ATMOST_REQUEST_TIMEOUT", default_value = "10s", value_parser = request_timeout)]
    request_timeout: Duration,
    /// HTTP/2: streams a client may open and reset before the server
    /// accepts them (rapid reset); past it, GOAWAY.
    #[arg(long, env = "ATMOST_H2_MAX_PENDING_RESETS", default_value_t = LIMITS.max_pending_accept_reset_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    h2_max_pending_resets: usize,
    /// HTTP/2: streams the server may reset for protocol errors on one
    /// connection; past it, GOAWAY with ENHANCE_YOUR_CALM.
    #[arg(long, env = "ATMOST_H2_MAX_LOCAL_RESETS", default_value_t = LIMITS.max_local_error_reset_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    h2_max_local_resets: usize,
    /// Longest a permit may live: CreatePermit refuses an expires_at further
    /// from now (QUOTA_PERMIT_LIFETIME; 1m to 10y).
    #[arg(long, env = "ATMOST_MAX_PERMIT_LIFETIME", default_value = "30days", value_parser = permit_lifetime)]
    max_permit_lifetime: Duration,
    /// Most RESERVED or UNCERTAIN attempts one permit may hold; a new key
    /// past it is refused (QUOTA_OPEN_ATTEMPTS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_OPEN_ATTEMPTS", default_value_t = QUOTAS.max_open_attempts)]
    max_open_attempts: u64,
    /// Most idempotency keys one permit may record; a new key past it is
    /// refused (QUOTA_ATTEMPTS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_ATTEMPTS_PER_PERMIT", default_value_t = QUOTAS.max_attempts)]
    max_attempts_per_permit: u64,
    /// Most unexpired permits one tenant may hold; CreatePermit past it is
    /// refused (QUOTA_TENANT_PERMITS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_PERMITS_PER_TENANT", default_value_t = QUOTAS.max_permits_per_tenant)]
    max_permits_per_tenant: u64,
    /// The memory store's size, in bytes (estimated): past it, new permits
    /// and new keys are refused (QUOTA_STORE_FULL); nothing open is evicted.
    /// 0: no limit.
    #[arg(long, env = "ATMOST_MEMORY_MAX_BYTES", default_value_t = 1 << 30)]
    memory_max_bytes: u64,
    /// Serve Prometheus metrics (GET /metrics, plaintext HTTP) on this
    /// address. Traces and OTLP metrics are set by the OTEL_* variables
    /// (docs/telemetry.md).
    #[arg(long, env = "ATMOST_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// While metrics are exported: how often the census of UNCERTAIN
    /// attempts is read (on Redis one replica of the fleet counts per
    /// interval; 1s to 1h).
    #[arg(long, env = "ATMOST_UNCERTAIN_CENSUS_INTERVAL", default_value = "10s", value_parser = census_interval)]
    uncertain_census_interval: Duration,
    /// Log format (logs go to stderr; filter with RUST_LOG). Text has
    /// colours only when stderr is a terminal.
    #[arg(long, env = "ATMOST_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Where the audit trail goes, one JSON line per state-changing call:
    /// stderr, stdout, a file (appended to) or off. Written by a thread of
    /// its own from a bounded buffer (docs/api.md, "The audit trail").
    #[arg(
        long,
        env = "ATMOST_AUDIT_LOG",
        default_value = "stderr",
        value_name = "stderr|stdout|PATH|off"
    )]
    audit_log: atmost::audit::Output,
    /// Audit lines the buffer holds before --audit-when-full applies.
    #[arg(long, env = "ATMOST_AUDIT_BUFFER", default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    audit_buffer: u64,
    /// With the audit buffer full: block (the request waits for room, the
    /// trail stays whole) or drop (the event is lost). Counted either way:
    /// atmost_audit_events_delayed_total, atmost_audit_events_dropped_total.
    #[arg(
        long,
        env = "ATMOST_AUDIT_WHEN_FULL",
        value_enum,
        default_value = "block"
    )]
    audit_when_full: atmost::audit::WhenFull,
}

fn main() -> std::process::ExitCode {
    let (cli, matches, file) = match parse_cli(std::env::args_os().collect()) {
        Ok(parsed) => parsed,
        Err(Invalid::Clap(e)) => e.exit(),
        Err(Invalid::File(e)) => {
            eprintln!("atmost: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let args = match cli.command {
        Command::Serve(args) => *args,
        Command::Receipt(ReceiptCommand::Verify { keys, attempt }) => {
            return receipt_verify(&keys, &attempt);
        }
        Command::Permit(args) => return cli::run(args.connection.json, cli::permit::run(args)),
        Command::Uncertain(args) => {
            return cli::run(args.connection.json, cli::uncertain::run(args));
        }
        Command::Attempt(args) => return cli::run(args.connection.json, cli::attempt::run(args)),
        Command::Demo(args) => return cli::run(args.json, cli::demo::run(args)),
        Command::Config(ConfigCommand::Check(args)) => {
            return config_check(&args, &matches, file.as_ref());
        }
    };
    let prepared = match prepare(&args) {
        Ok(prepared) => prepared,
        Err(e) => {
            eprintln!("atmost: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        runtime.worker_threads(n.max(1));
    }
    let served = match runtime.enable_all().build() {
        Ok(runtime) => match init_logging(&runtime, &args) {
            Ok(telemetry) => {
                no_huge_pages();
                let served = runtime.block_on(serve(args, prepared, telemetry.clone()));
                // Flushes the spans and metrics, while the runtime the
                // exporters' channels run on is still there.
                telemetry.shutdown();
                // What the drain left running (it may end at its grace)
                // is dropped: an abandoned request's CANCELLED event is
                // queued then. A request waiting on a stuck audit output
                // is not waited for past a second.
                runtime.shutdown_timeout(Duration::from_secs(1));
                if let Err(why) = atmost::audit::flush(Duration::from_secs(10)) {
                    let counts = atmost::audit::counts();
                    eprintln!(
                        "atmost: the audit trail was not written out ({why}): {} events not \
                         written, {} lost to write errors",
                        counts.unwritten(),
                        counts
                            .write_errors
                            .load(std::sync::atomic::Ordering::Relaxed)
                    );
                }
                served
            }
            // The exporters the OTEL_* variables ask for could not be
            // built: a setting (prepare() found every case it knows).
            Err(e) => Err(Misconfigured(e).into()),
        },
        Err(e) => Err(e.into()),
    };
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // As written, not Debug-escaped: the operator reads this line.
            eprintln!("atmost: {e}");
            match e.is::<Misconfigured>() {
                true => std::process::ExitCode::from(2),
                false => std::process::ExitCode::FAILURE,
            }
        }
    }
}

/// A start-up failure that is a setting's (an address that cannot be
/// bound, an exporter that cannot be built): exit code 2, as for what
/// prepare() refuses. Exit code 1 is left for the rest: Redis refusing
/// (it evicts, it is too old) and failures while serving.
#[derive(Debug)]
struct Misconfigured(String);

impl std::fmt::Display for Misconfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Misconfigured {}

enum Invalid {
    /// Bad flags or variables: clap says so (and exits 2), or prints help.
    Clap(clap::Error),
    /// A --config file that cannot be read or says something wrong.
    File(String),
}

/// The command line, with a `--config` file's values (for `serve` and
/// `config check`) as the defaults of the settings it names, so that a flag
/// and an ATMOST_* variable still beat it. Returns the matches too, for
/// `config check` to say where each value came from.
fn parse_cli(
    argv: Vec<std::ffi::OsString>,
) -> Result<(Cli, clap::ArgMatches, Option<FileSettings>), Invalid> {
    use clap::{CommandFactory, FromArgMatches};
    let first = Cli::command()
        .try_get_matches_from(&argv)
        .map_err(Invalid::Clap)?;
    // The path of the settings `serve` takes, under either command.
    let path: &[&str] = match first.subcommand() {
        Some(("serve", _)) => &["serve"],
        Some(("config", sub)) if sub.subcommand_name() == Some("check") => &["config", "check"],
        _ => &[],
    };
    let mut serve = &first;
    for name in path {
        serve = serve.subcommand_matches(name).expect("matched above");
    }
    let named = match path.is_empty() {
        true => None,
        false => serve.get_one::<std::path::PathBuf>(config::CONFIG_SETTING),
    };
    let file = match named {
        Some(file) => {
            Some(FileSettings::load(file, &settings_command(path)).map_err(Invalid::File)?)
        }
        None => None,
    };
    let Some(settings) = &file else {
        let cli = Cli::from_arg_matches(&first).map_err(Invalid::Clap)?;
        return Ok((cli, first, None));
    };
    let command = match path {
        ["serve"] => Cli::command().mut_subcommand("serve", |c| settings.apply(c)),
        _ => Cli::command().mut_subcommand("config", |c| {
            c.mut_subcommand("check", |c| settings.apply(c))
        }),
    };
    let matches = command.try_get_matches_from(&argv).map_err(Invalid::Clap)?;
    let cli = Cli::from_arg_matches(&matches).map_err(Invalid::Clap)?;
    Ok((cli, matches, file))
}

/// The subcommand at `path` (its settings are `serve`'s).
fn settings_command(path: &[&str]) -> clap::Command {
    use clap::CommandFactory;
    let mut command = Cli::command();
    for name in path {
        command = command
            .find_subcommand(name)
            .expect("a subcommand of atmost")
            .clone();
    }
    command
}

/// `atmost config check`: the effective configuration, then whether `serve`
/// would accept it.
fn config_check(
    args: &ServeArgs,
    matches: &clap::ArgMatches,
    file: Option<&FileSettings>,
) -> std::process::ExitCode {
    let check = matches
        .subcommand_matches("config")
        .and_then(|m| m.subcommand_matches("check"))
        .expect("config check matched");
    let settings = config::effective(&settings_command(&["config", "check"]), check, file);
    print!("{}", config::render_toml(&settings));
    match prepare(args) {
        Ok(_) => {
            eprintln!("atmost: the configuration is valid");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("atmost: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

/// What `serve` reads and checks before it starts anything: every file it
/// names and every combination of settings, so that a mistake stops it at
/// once with the setting's name (and `config check` finds the same ones).
struct Prepared {
    retention_ms: Millis,
    quotas: atmost::domain::Quotas,
    /// With `--store redis`: how to reach it, checked.
    redis: Option<RedisConfig>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    receipts: Option<atmost::receipts::ReceiptSigner>,
    auth: Option<Authenticator>,
    /// The Envoy front doors' mapping; `None`: not served.
    envoy: Option<atmost::api::envoy::Mapping>,
}

fn prepare(args: &ServeArgs) -> Result<Prepared, String> {
    let read = |setting: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("--{setting} {}: {e}", path.display()))
    };
    let needs = |set: bool, setting: &str, other: &str| {
        if set {
            Err(format!("--{setting} needs --{other}"))
        } else {
            Ok(())
        }
    };
    // The OTEL_* variables: one atmost cannot honour stops it here too.
    atmost::telemetry::Plan::from_env(|name| std::env::var(name).ok())?;
    needs(
        args.tls_cert.is_some() && args.tls_key.is_none(),
        "tls-cert",
        "tls-key",
    )?;
    needs(
        args.tls_key.is_some() && args.tls_cert.is_none(),
        "tls-key",
        "tls-cert",
    )?;
    needs(
        args.tls_client_ca.is_some() && args.tls_cert.is_none(),
        "tls-client-ca",
        "tls-cert",
    )?;
    needs(
        args.tls_client_ca.is_some() && args.auth_keys.is_none(),
        "tls-client-ca",
        "auth-keys",
    )?;
    needs(
        args.receipt_verify_keys.is_some() && args.receipt_signing_key.is_none(),
        "receipt-verify-keys",
        "receipt-signing-key",
    )?;
    if !args.envoy && args.envoy_mapping.is_some() {
        return Err(
            "--envoy-mapping is for the Envoy front doors, which --envoy=false turns off".into(),
        );
    }
    if args.insecure_no_auth && args.auth_keys.is_some() {
        return Err("--insecure-no-auth and --auth-keys contradict each other: give one".into());
    }
    let redis = matches!(args.store, StoreKind::Redis);
    if redis && args.redis_sentinel_master.is_some() && args.redis_mode != RedisMode::Sentinel {
        return Err("--redis-sentinel-master is for --redis-mode sentinel".into());
    }
    if redis && args.redis_mode == RedisMode::Sentinel && args.redis_sentinel_master.is_none() {
        return Err("--redis-mode sentinel needs --redis-sentinel-master NAME".into());
    }
    if args.auth_keys.is_none() && !args.insecure_no_auth && !args.listen.ip().is_loopback() {
        return Err(format!(
            "refusing to serve {} without authentication: give --auth-keys FILE \
             (docs/api.md, \"Authentication\"), listen on a loopback address for dev mode, \
             or accept an open service with --insecure-no-auth",
            args.listen
        ));
    }
    let millis = |setting: &str, d: Duration| {
        Millis::try_from(d.as_millis()).map_err(|_| format!("--{setting} is too long"))
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let mut tls = tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(
                    read("tls-cert", cert)?,
                    read("tls-key", key)?,
                ),
            );
            if let Some(ca) = &args.tls_client_ca {
                // A client without a certificate may still present a key.
                tls = tls
                    .client_ca_root(tonic::transport::Certificate::from_pem(read(
                        "tls-client-ca",
                        ca,
                    )?))
                    .client_auth_optional(true);
            }
            Some(tls)
        }
        _ => None,
    };
    let retention_ms = millis("retention", args.retention)?;
    let redis_tls_ca = match &args.redis_tls_ca {
        Some(path) => Some(read("redis-tls-ca", path)?),
        None => None,
    };
    let redis = match args.store {
        StoreKind::Memory => None,
        StoreKind::Redis => {
            let config = RedisConfig {
                url: args.redis_url.clone(),
                mode: match args.redis_mode {
                    RedisMode::Standalone => Mode::Standalone,
                    RedisMode::Cluster => Mode::Cluster,
                    RedisMode::Sentinel => Mode::Sentinel {
                        master: args.redis_sentinel_master.clone().unwrap_or_default(),
                    },
                },
                durability: match args.durability {
                    DurabilityArg::None => Durability::None,
                    DurabilityArg::Replica => Durability::Replica,
                },
                prefix: args.redis_prefix.clone(),
                retention_ms,
                timeout: args.store_timeout,
                allow_eviction: args.allow_eviction,
                allow_unknown_eviction_policy: args.allow_unknown_eviction_policy,
                time: Time::Redis,
                tls_ca: redis_tls_ca,
            };
            // What RedisStore::connect would refuse (a URL that does not
            // parse, a prefix with braces), refused here, by setting.
            RedisStore::check(&config).map_err(|e| match e {
                atmost::domain::Error::InvalidRequest(violations) => violations
                    .iter()
                    .map(|v| format!("--{}: {}", v.field.replace('_', "-"), v.description))
                    .collect::<Vec<_>>()
                    .join("; "),
                other => other.to_string(),
            })?;
            Some(config)
        }
    };
    Ok(Prepared {
        retention_ms,
        quotas: atmost::domain::Quotas {
            max_permit_lifetime_ms: millis("max-permit-lifetime", args.max_permit_lifetime)?,
            max_open_attempts: args.max_open_attempts,
            max_attempts: args.max_attempts_per_permit,
            max_permits_per_tenant: args.max_permits_per_tenant,
        },
        redis,
        tls,
        receipts: match &args.receipt_signing_key {
            Some(signing) => Some(
                atmost::receipts::ReceiptSigner::load(signing, args.receipt_verify_keys.as_deref())
                    .map_err(|e| format!("--receipt-signing-key: {e}"))?,
            ),
            None => None,
        },
        auth: match &args.auth_keys {
            Some(path) => Some(Authenticator::load(path).map_err(|e| format!("--auth-keys: {e}"))?),
            None => None,
        },
        envoy: match (&args.envoy_mapping, args.envoy) {
            (Some(path), _) => Some(
                atmost::api::envoy::Mapping::load(path)
                    .map_err(|e| format!("--envoy-mapping: {e}"))?,
            ),
            (None, true) => Some(atmost::api::envoy::Mapping::default()),
            (None, false) => None,
        },
    })
}

async fn serve(
    args: ServeArgs,
    prepared: Prepared,
    telemetry: atmost::telemetry::Telemetry,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let Prepared {
        retention_ms,
        quotas,
        redis,
        tls,
        receipts,
        auth,
        envoy,
    } = prepared;
    let store = match redis {
        None => Backend::Memory(
            MemoryStore::new(retention_ms)
                .with_quotas(quotas)
                .with_max_bytes(args.memory_max_bytes),
        ),
        Some(config) => {
            // prepare() checked the configuration: what is left to fail
            // here is not a setting.
            let store = RedisStore::connect(&config)?.with_quotas(quotas);
            check_eviction(&store, args.store_timeout).await?;
            check_version(&store, args.store_timeout).await?;
            load_library(&store, args.store_timeout).await;
            Backend::Redis(store)
        }
    };
    let mut app = App::new(store)
        .with_store_timeout(args.store_timeout)
        .with_shutdown_grace(args.shutdown_grace)
        .with_drain_delay(args.drain_delay)
        .with_max_in_flight(args.max_in_flight)
        .with_max_queue_wait(args.max_queue_wait)
        .with_reflection(args.reflection)
        .with_envoy(envoy)
        .with_telemetry(telemetry)
        .with_census_interval(args.uncertain_census_interval)
        .with_limits(atmost::transport::Limits {
            max_connections: args.max_connections,
            max_concurrent_streams: args.max_concurrent_streams,
            max_request_bytes: args.max_request_bytes,
            max_response_bytes: args.max_response_bytes,
            max_header_list_bytes: args.max_header_list_bytes,
            keepalive_interval: args.keepalive_interval,
            keepalive_timeout: args.keepalive_timeout,
            idle_timeout: args.idle_timeout,
            max_connection_age: args.max_connection_age,
            max_connection_age_grace: args.max_connection_age_grace,
            handshake_timeout: args.handshake_timeout,
            request_timeout: args.request_timeout,
            max_pending_accept_reset_streams: args.h2_max_pending_resets,
            max_local_error_reset_streams: args.h2_max_local_resets,
        });
    if let Some(tls) = tls {
        app = app.with_tls(tls);
        tracing::info!(mtls = args.tls_client_ca.is_some(), "serving over TLS");
    }
    if let Some(keys) = receipts {
        tracing::info!(
            key_id = keys.current().signing_key_id(),
            "receipts are signed"
        );
        app = app.with_receipt_keys(std::sync::Arc::new(keys));
    }
    match auth {
        Some(auth) => {
            tracing::info!(keys = auth.keys().len(), file = ?args.auth_keys, "API keys loaded");
            app = app.with_auth(std::sync::Arc::new(auth));
        }
        None if args.insecure_no_auth && !args.listen.ip().is_loopback() => tracing::warn!(
            listen = %args.listen,
            "INSECURE: no authentication on a non-loopback address (--insecure-no-auth): \
             anyone who reaches this port may create permits and settle attempts"
        ),
        // prepare() refused a non-loopback address without either.
        None => tracing::warn!(
            "dev mode: no --auth-keys, so every caller may call every RPC; serving on loopback only"
        ),
    }

    if let Some(addr) = args.metrics_listen {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Misconfigured(format!("--metrics-listen {addr}: {e}")))?;
        let bound = listener.local_addr()?;
        // On stdout, so scripts and tests learn the port of
        // --metrics-listen :0; before the gRPC line, which stays the last
        // line at start-up (a reader that stops there misses nothing, and
        // nothing is written to a pipe it may have closed).
        println!("atmost metrics on {bound}");
        tracing::info!(addr = %bound, "serving /metrics");
        app = app.with_metrics_listener(listener);
    }

    // Listening for signals before the port is announced.
    let signals = signals();
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| Misconfigured(format!("--listen {}: {e}", args.listen)))?;
    let addr = listener.local_addr()?;
    // On stdout, so scripts and tests learn the port of --listen :0: the
    // last line at start-up (every listener is bound).
    println!("atmost listening on {addr}");
    tracing::info!(%addr, store = ?args.store_name(), "serving");
    let mut second = signals.clone();
    let app = app.with_drain_interrupt(async move {
        let _ = second.wait_for(|n| *n >= 2).await;
    });
    let mut first = signals;
    run(listener, app, async move {
        let _ = first.wait_for(|n| *n >= 1).await;
    })
    .await
}

/// Refuses to start on a Redis that may evict keys (unless allowed). A Redis
/// that does not answer yet is checked before the store serves anything.
async fn check_eviction(
    store: &RedisStore,
    timeout: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match tokio::time::timeout(timeout, store.eviction_policy()).await {
        Ok(Ok((_, Some(refusal)))) => Err(refusal.into()),
        Ok(Ok((_, None))) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "Redis unreachable at start-up: its maxmemory-policy is read before anything is served");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(
                "Redis did not answer at start-up: its maxmemory-policy is read before anything is served"
            );
            Ok(())
        }
    }
}

/// Loads atmost's library on every primary before serving, while Redis has
/// room for it (past `maxmemory` Redis refuses `FUNCTION LOAD`, and a node
/// without the library could then answer nothing). A Redis that does not
/// take it now (unreachable, or the ACL lacks `function|load`) is logged;
/// each call that finds its function missing loads it again.
async fn load_library(store: &RedisStore, timeout: Duration) {
    match tokio::time::timeout(timeout, store.load_library()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "atmost's Redis functions not loaded at start-up: the first call loads them")
        }
        Err(_) => tracing::warn!(
            "Redis did not answer FUNCTION LOAD at start-up: the first call loads atmost's functions"
        ),
    }
}

/// Refuses to start on a Redis older than 7.0, whose Lua cannot run
/// atmost's scripts (they open with `#!lua` lines): every RPC would answer
/// UNAVAILABLE. A Redis that does not answer yet is read by the first
/// request instead (and fails it the same way).
async fn check_version(
    store: &RedisStore,
    timeout: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match tokio::time::timeout(timeout, store.server_version()).await {
        Ok(Ok((major, minor))) if major < 7 => Err(format!(
            "Redis {major}.{minor} is too old: atmost needs Redis 7.0 or later \
             (its scripts declare themselves with #!lua lines)"
        )
        .into()),
        _ => Ok(()),
    }
}

impl ServeArgs {
    fn store_name(&self) -> &'static str {
        match self.store {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }
}

// === durations ===
//
// Every duration flag is bounded where it is parsed, so a typo fails at
// start-up with a clear error instead of saturating somewhere later (a
// retention of centuries once overflowed the Redis store's expiry
// arithmetic and deleted a permit at its first settle).

/// A duration within `min..=max`, as humantime reads it.
fn bounded(text: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < min || d > max {
        return Err(format!(
            "{} is out of range: from {} to {}",
            humantime::format_duration(d),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    Ok(d)
}

fn retention(text: &str) -> Result<Duration, String> {
    let max = Duration::from_millis(atmost::domain::MAX_RETENTION_MS as u64);
    bounded(text, Duration::ZERO, max)
}

fn store_timeout(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_millis(1), Duration::from_secs(60))
}

fn shutdown_grace(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::ZERO, Duration::from_secs(3600))
}

fn queue_wait(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::ZERO, Duration::from_secs(10))
}

fn permit_lifetime(text: &str) -> Result<Duration, String> {
    let max = Duration::from_millis(atmost::domain::MAX_RETENTION_MS as u64);
    bounded(text, Duration::from_secs(60), max)
}

fn keepalive(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_secs(1), Duration::from_secs(7200))
}

fn connection_time(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_secs(1), Duration::from_secs(24 * 3600))
}

fn handshake_timeout(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_millis(100), Duration::from_secs(60))
}

fn request_timeout(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_millis(10), Duration::from_secs(3600))
}

fn census_interval(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_secs(1), Duration::from_secs(3600))
}

/// Logs, and the traces and metrics the OTEL_* variables and
/// --metrics-listen ask for (inside the runtime, which the OTLP exporters
/// run on).
fn init_logging(
    runtime: &tokio::runtime::Runtime,
    args: &ServeArgs,
) -> Result<atmost::telemetry::Telemetry, String> {
    let _runtime = runtime.enter();
    let telemetry = atmost::telemetry::Telemetry::init(atmost::telemetry::Config {
        json_logs: matches!(args.log_format, LogFormat::Json),
        prometheus: args.metrics_listen.is_some(),
    })?;
    atmost::audit::install(&atmost::audit::Config {
        output: args.audit_log.clone(),
        buffer_lines: usize::try_from(args.audit_buffer).unwrap_or(usize::MAX),
        when_full: args.audit_when_full,
    })?;
    Ok(telemetry)
}

/// Counts SIGTERMs and Ctrl-Cs: the first starts the shutdown, a second cuts
/// the drain delay short.
fn signals() -> tokio::sync::watch::Receiver<u32> {
    let (count, signals) = tokio::sync::watch::channel(0u32);
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::spawn(async move {
        loop {
            #[cfg(unix)]
            let term_once = async {
                match term.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let term_once = std::future::pending::<()>();
            let ctrl_c = async {
                if tokio::signal::ctrl_c().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = ctrl_c => {}
                () = term_once => {}
            }
            count.send_modify(|n| *n += 1);
        }
    });
    signals
}

/// Turns transparent huge pages off for this process (inherited by its
/// threads), whatever the machine's THP mode: the kernel zeroes a huge page
/// whole on its first touch, which stalled a worker for about 5 ms on the
/// benchmark machine (docs/performance.md, "Huge pages"). Redis does the
/// same for itself.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::warn!(error = %e, "could not turn transparent huge pages off");
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{ArgAction, CommandFactory};

    /// A row of the README's configuration table: its flags, variables and
    /// default, as written.
    struct Row {
        flags: Vec<String>,
        envs: Vec<String>,
        default: String,
    }

    /// The items in backquotes of a table cell.
    fn quoted(cell: &str) -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    fn readme_rows() -> Vec<Row> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        let readme = std::fs::read_to_string(path).expect("README.md");
        let section = readme
            .split("\n## Configuration\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("README.md has a Configuration section");
        section
            .lines()
            .filter(|line| line.starts_with("| `--"))
            .map(|line| {
                let cells: Vec<&str> = line.split(" | ").collect();
                Row {
                    flags: quoted(cells[0]),
                    envs: quoted(cells[1]),
                    default: cells[2].to_string(),
                }
            })
            .collect()
    }

    /// The README's configuration table names every flag of `atmost serve`
    /// once, with the variable the code reads and the default it applies:
    /// a flag added, renamed or re-defaulted without the table fails here.
    #[test]
    fn the_readme_configuration_table_matches_the_flags() {
        let command = Cli::command();
        let serve = command.find_subcommand("serve").expect("serve");
        let mut documented = std::collections::BTreeSet::new();
        for row in readme_rows() {
            assert_eq!(
                row.flags.len(),
                row.envs.len(),
                "{:?}: one variable per flag",
                row.flags
            );
            let defaults = quoted(&row.default);
            for (i, (flag, env)) in row.flags.iter().zip(&row.envs).enumerate() {
                let long = flag.strip_prefix("--").expect("a flag");
                let arg = serve
                    .get_arguments()
                    .find(|a| a.get_long() == Some(long))
                    .unwrap_or_else(|| {
                        panic!("README documents {flag}, which serve does not have")
                    });
                assert!(
                    documented.insert(long.to_string()),
                    "{flag} documented twice"
                );
                assert_eq!(
                    arg.get_env()
                        .map(|e| e.to_string_lossy().into_owned())
                        .as_deref(),
                    Some(env.as_str()),
                    "{flag}'s variable"
                );
                let code_default: Vec<String> = arg
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect();
                match arg.get_action() {
                    ArgAction::SetTrue => assert_eq!(row.default, "off", "{flag} is a switch"),
                    _ if code_default.is_empty() => assert!(
                        !row.default.starts_with('`'),
                        "{flag} has no default in the code, but the README gives {:?}",
                        row.default
                    ),
                    _ => assert_eq!(
                        defaults.get(i),
                        Some(&code_default.join(",")),
                        "{flag}'s default: the README says {:?}",
                        row.default
                    ),
                }
            }
        }
        let flags: std::collections::BTreeSet<String> = serve
            .get_arguments()
            .filter(|a| {
                !matches!(
                    a.get_action(),
                    ArgAction::Help
                        | ArgAction::HelpLong
                        | ArgAction::HelpShort
                        | ArgAction::Version
                )
            })
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect();
        let missing: Vec<_> = flags.difference(&documented).collect();
        assert!(
            missing.is_empty(),
            "flags the README's table does not list: {missing:?}"
        );
    }
}
