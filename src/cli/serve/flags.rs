//! The flags of `atmost serve` (each with its ATMOST_* variable), and
//! the bounds of its durations.

use clap::ValueEnum;
use clap::builder::TypedValueParser;
use std::net::SocketAddr;
use std::time::Duration;

/// The transport limits' and quotas' defaults, for the flags' defaults.
const LIMITS: atmost::transport::Limits = atmost::transport::Limits::DEFAULT;
const QUOTAS: atmost::domain::Quotas = atmost::domain::Quotas::DEFAULT;

#[derive(Clone, Copy, ValueEnum)]
pub enum StoreKind {
    /// Process memory: nothing survives a restart. For trying atmost out.
    Memory,
    /// Redis: shared by any number of replicas.
    Redis,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RedisMode {
    /// One Redis server.
    Standalone,
    /// A Redis Cluster: --redis-url lists seed nodes.
    Cluster,
    /// The primary Sentinel names: --redis-url lists the Sentinels.
    Sentinel,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum DurabilityArg {
    /// The primary acknowledged it.
    None,
    /// A replica acknowledged it too.
    Replica,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A TOML file of settings: keys are these flags' names without `--`
    /// (`store-timeout = "2s"`). A flag beats its ATMOST_* variable, which
    /// beats the file, which beats the default.
    #[arg(long, env = "ATMOST_CONFIG", value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,
    /// Address to listen on.
    #[arg(long, env = "ATMOST_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Where permits and attempts live.
    #[arg(long, env = "ATMOST_STORE", value_enum, default_value = "memory")]
    pub store: StoreKind,
    /// Redis URL (with --store redis); with --redis-mode cluster or
    /// sentinel, a comma-separated list of seed nodes or of Sentinels.
    #[arg(
        long,
        env = "ATMOST_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,
    /// What --redis-url names: one server, a Redis Cluster, or Sentinels.
    #[arg(
        long,
        env = "ATMOST_REDIS_MODE",
        value_enum,
        default_value = "standalone"
    )]
    pub redis_mode: RedisMode,
    /// With --redis-mode sentinel: the name the Sentinels know the primary
    /// by (their `sentinel monitor <name> ...`).
    #[arg(long, env = "ATMOST_REDIS_SENTINEL_MASTER", value_name = "NAME")]
    pub redis_sentinel_master: Option<String>,
    /// What a state change waits for before atmost answers: `none`, the
    /// primary (a failover may lose the last writes); `replica`, a replica
    /// too (WAIT 1; none in time answers UNAVAILABLE).
    #[arg(long, env = "ATMOST_DURABILITY", value_enum, default_value = "none")]
    pub durability: DurabilityArg,
    /// For a rediss:// URL: the CA certificate (PEM) that signed Redis's,
    /// instead of the system's trust store.
    #[arg(long, env = "ATMOST_REDIS_TLS_CA", value_name = "FILE")]
    pub redis_tls_ca: Option<std::path::PathBuf>,
    /// Prefix of every Redis key.
    #[arg(long, env = "ATMOST_REDIS_PREFIX", default_value = "atmost")]
    pub redis_prefix: String,
    /// Serve on a Redis whose maxmemory-policy may evict keys. It weakens the
    /// guarantee: an evicted finished attempt lets its key be dispatched
    /// again. Without it, atmost refuses such a Redis.
    #[arg(long, env = "ATMOST_ALLOW_EVICTION")]
    pub allow_eviction: bool,
    /// Serve on a Redis that will not tell its maxmemory-policy (neither
    /// INFO memory nor CONFIG GET permitted): you vouch that it is
    /// noeviction. If it is not, an evicted finished attempt lets its key be
    /// dispatched again. Without it, atmost refuses such a Redis; granting
    /// its Redis user +info lets it read the policy instead.
    #[arg(long, env = "ATMOST_ALLOW_UNKNOWN_EVICTION_POLICY")]
    pub allow_unknown_eviction_policy: bool,
    /// How long finished attempts and permits are kept past the permit's
    /// expiry (at most 10y).
    #[arg(long, env = "ATMOST_RETENTION", default_value = "24h", value_parser = retention)]
    pub retention: Duration,
    /// How long a store call may take before the RPC answers UNAVAILABLE
    /// (1ms to 60s).
    #[arg(long, env = "ATMOST_STORE_TIMEOUT", default_value = "2s", value_parser = store_timeout)]
    pub store_timeout: Duration,
    /// How long in-flight RPCs may take to finish on SIGTERM or Ctrl-C (at
    /// most 1h).
    #[arg(long, env = "ATMOST_SHUTDOWN_GRACE", default_value = "10s", value_parser = shutdown_grace)]
    pub shutdown_grace: Duration,
    /// On SIGTERM or Ctrl-C, how long to keep serving (and accepting) with
    /// health NOT_SERVING before --shutdown-grace begins, so load balancers
    /// and readiness probes stop sending first; a second signal cuts it
    /// short (at most 1h).
    #[arg(long, env = "ATMOST_DRAIN_DELAY", default_value = "0s", value_parser = shutdown_grace)]
    pub drain_delay: Duration,
    /// Store calls running at once; more wait for a slot, up to
    /// --max-queue-wait, then are refused with UNAVAILABLE / OVERLOADED.
    #[arg(long, env = "ATMOST_MAX_IN_FLIGHT", default_value_t = atmost::server::DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// The longest a request waits for an admission slot (0s to 10s; 0s:
    /// refused at once).
    #[arg(long, env = "ATMOST_MAX_QUEUE_WAIT", default_value = "10ms", value_parser = queue_wait)]
    pub max_queue_wait: Duration,
    /// Tokio worker threads (default: the CPUs this process may use,
    /// cgroup quota included).
    #[arg(long, env = "ATMOST_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
    /// API keys (a TOML file of SHA-256 digests, tenants and roles; see
    /// docs/api.md, "Authentication"): every atmost RPC then needs
    /// `authorization: Bearer <key>`. Re-read on SIGHUP and when it changes.
    /// Without it atmost runs in dev mode: no authentication, loopback only.
    #[arg(long, env = "ATMOST_AUTH_KEYS", value_name = "FILE")]
    pub auth_keys: Option<std::path::PathBuf>,
    /// Dev mode on a non-loopback address: anyone who reaches the port may
    /// call every RPC. For a trusted network only.
    #[arg(long, env = "ATMOST_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Serve over TLS with this certificate chain (PEM); with --tls-key.
    #[arg(long, env = "ATMOST_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "ATMOST_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<std::path::PathBuf>,
    /// mTLS: verify client certificates against this CA (PEM). A verified
    /// certificate can stand in for a key: --auth-keys maps its SAN to a
    /// tenant and roles. Needs --tls-cert and --auth-keys.
    #[arg(long, env = "ATMOST_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<std::path::PathBuf>,
    /// Sign every receipt with this Ed25519 key (PKCS#8 PEM: `openssl
    /// genpkey -algorithm ed25519`); its public key is published by
    /// atmost.v1.Receipts/GetSigningKeys. Without it receipts are unsigned.
    #[arg(long, env = "ATMOST_RECEIPT_SIGNING_KEY", value_name = "FILE")]
    pub receipt_signing_key: Option<std::path::PathBuf>,
    /// More Ed25519 public keys (PEM blocks in one file) whose signatures
    /// still verify: the previous keys of a rotation.
    #[arg(long, env = "ATMOST_RECEIPT_VERIFY_KEYS", value_name = "FILE")]
    pub receipt_verify_keys: Option<std::path::PathBuf>,
    /// Serve gRPC server reflection and the HTTP/JSON edge's OpenAPI
    /// document, /v1/openapi.json (unauthenticated: they show the
    /// service's shape, no data). `--reflection=false` turns both off.
    #[arg(long, env = "ATMOST_REFLECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub reflection: bool,
    /// Serve the Envoy front doors on this port: ext_authz
    /// (envoy.service.auth.v3.Authorization/Check) and ext_proc
    /// (envoy.service.ext_proc.v3.ExternalProcessor/Process), for the agent
    /// role (docs/gateways.md). `--envoy=false` turns them off.
    #[arg(long, env = "ATMOST_ENVOY", default_value_t = true, action = clap::ArgAction::Set)]
    pub envoy: bool,
    /// The Envoy front doors' mapping (TOML): where the permit, tool, key,
    /// fingerprint and cost of a request come from, and how ext_proc
    /// settles an attempt from the response (docs/gateways.md, "The
    /// mapping"). Without it, the defaults.
    #[arg(long, env = "ATMOST_ENVOY_MAPPING", value_name = "FILE")]
    pub envoy_mapping: Option<std::path::PathBuf>,
    /// Serve the HTTP/JSON edge: every RPC at its REST path with JSON
    /// bodies (docs/api.md, "HTTP/JSON"), on --listen beside gRPC unless
    /// --http-listen gives it a port of its own. `--http=false` turns it
    /// off.
    #[arg(long, env = "ATMOST_HTTP", default_value_t = true, action = clap::ArgAction::Set)]
    pub http: bool,
    /// Serve the HTTP/JSON edge on this address instead, under the same
    /// TLS, keys and limits; --listen then serves gRPC only.
    #[arg(long, env = "ATMOST_HTTP_LISTEN", value_name = "ADDR")]
    pub http_listen: Option<SocketAddr>,
    /// Browser origins that may call the HTTP/JSON edge (CORS), comma
    /// separated (`https://console.example.com`), or `*` for any; needs
    /// --auth-keys. None by default: no page of another origin can read an
    /// answer or send a write.
    #[arg(
        long,
        env = "ATMOST_HTTP_CORS_ORIGINS",
        value_name = "ORIGINS",
        value_delimiter = ','
    )]
    pub http_cors_origins: Vec<String>,
    /// Connections open at once; past it a new connection is closed as soon
    /// as it is accepted (docs/security.md, "Transport limits").
    #[arg(long, env = "ATMOST_MAX_CONNECTIONS", default_value_t = LIMITS.max_connections,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000).map(|n| n as usize))]
    pub max_connections: usize,
    /// RPCs open at once on one connection (HTTP/2
    /// SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, env = "ATMOST_MAX_CONCURRENT_STREAMS", default_value_t = LIMITS.max_concurrent_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_concurrent_streams: u32,
    /// Largest request message, in bytes (the largest valid request is 75 939
    /// bytes); larger ones answer RESOURCE_EXHAUSTED / MESSAGE_TOO_LARGE
    /// before their body is read.
    #[arg(long, env = "ATMOST_MAX_REQUEST_BYTES", default_value_t = LIMITS.max_request_bytes,
          value_parser = clap::value_parser!(u32).range(80_000..=64 * 1024 * 1024).map(|n| n as usize))]
    pub max_request_bytes: usize,
    /// Largest response message, in bytes (a ListUncertain page of 1000 is
    /// up to 1.6 MiB; a smaller limit fails the RPCs whose answer is larger).
    #[arg(long, env = "ATMOST_MAX_RESPONSE_BYTES", default_value_t = LIMITS.max_response_bytes,
          value_parser = clap::value_parser!(u32).range(64 * 1024..=64 * 1024 * 1024).map(|n| n as usize))]
    pub max_response_bytes: usize,
    /// Largest header list of one request, in bytes (HTTP/2
    /// SETTINGS_MAX_HEADER_LIST_SIZE).
    #[arg(long, env = "ATMOST_MAX_HEADER_LIST_BYTES", default_value_t = LIMITS.max_header_list_bytes,
          value_parser = clap::value_parser!(u32).range(4096..=1024 * 1024))]
    pub max_header_list_bytes: u32,
    /// HTTP/2 PING interval on every connection (1s to 2h).
    #[arg(long, env = "ATMOST_KEEPALIVE_INTERVAL", default_value = "60s", value_parser = keepalive)]
    pub keepalive_interval: Duration,
    /// A peer that does not answer a PING within this is disconnected (1s
    /// to 2h).
    #[arg(long, env = "ATMOST_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = keepalive)]
    pub keepalive_timeout: Duration,
    /// A connection with no RPC open this long is closed (1s to 24h).
    #[arg(long, env = "ATMOST_IDLE_TIMEOUT", default_value = "5m", value_parser = connection_time)]
    pub idle_timeout: Duration,
    /// After this, a connection gets GOAWAY, so long-lived clients reconnect
    /// and spread over replicas (1s to 24h).
    #[arg(long, env = "ATMOST_MAX_CONNECTION_AGE", default_value = "10m", value_parser = connection_time)]
    pub max_connection_age: Duration,
    /// How long RPCs open at GOAWAY may still take before the connection is
    /// closed (0s to 1h).
    #[arg(long, env = "ATMOST_MAX_CONNECTION_AGE_GRACE", default_value = "30s", value_parser = shutdown_grace)]
    pub max_connection_age_grace: Duration,
    /// The TLS handshake, if any, and then the HTTP/2 preface (an HTTP/1.1
    /// request's first bytes) must arrive within this
    /// (100ms to 60s).
    #[arg(long, env = "ATMOST_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = handshake_timeout)]
    pub handshake_timeout: Duration,
    /// One RPC, its request body included, may take this long; past it the
    /// RPC answers CANCELLED (10ms to 1h).
    #[arg(long, env = "ATMOST_REQUEST_TIMEOUT", default_value = "10s", value_parser = request_timeout)]
    pub request_timeout: Duration,
    /// HTTP/2: streams a client may open and reset before the server
    /// accepts them (rapid reset); past it, GOAWAY.
    #[arg(long, env = "ATMOST_H2_MAX_PENDING_RESETS", default_value_t = LIMITS.max_pending_accept_reset_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub h2_max_pending_resets: usize,
    /// HTTP/2: streams the server may reset for protocol errors on one
    /// connection; past it, GOAWAY with ENHANCE_YOUR_CALM.
    #[arg(long, env = "ATMOST_H2_MAX_LOCAL_RESETS", default_value_t = LIMITS.max_local_error_reset_streams,
          value_parser = clap::value_parser!(u32).range(1..=100_000).map(|n| n as usize))]
    pub h2_max_local_resets: usize,
    /// Longest a permit may live: CreatePermit refuses an expires_at further
    /// from now (QUOTA_PERMIT_LIFETIME; 1m to 10y).
    #[arg(long, env = "ATMOST_MAX_PERMIT_LIFETIME", default_value = "30days", value_parser = permit_lifetime)]
    pub max_permit_lifetime: Duration,
    /// Most RESERVED or UNCERTAIN attempts one permit may hold; a new key
    /// past it is refused (QUOTA_OPEN_ATTEMPTS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_OPEN_ATTEMPTS", default_value_t = QUOTAS.max_open_attempts)]
    pub max_open_attempts: u64,
    /// Most idempotency keys one permit may record; a new key past it is
    /// refused (QUOTA_ATTEMPTS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_ATTEMPTS_PER_PERMIT", default_value_t = QUOTAS.max_attempts)]
    pub max_attempts_per_permit: u64,
    /// Most unexpired permits one tenant may hold; CreatePermit past it is
    /// refused (QUOTA_TENANT_PERMITS). 0: no limit.
    #[arg(long, env = "ATMOST_MAX_PERMITS_PER_TENANT", default_value_t = QUOTAS.max_permits_per_tenant)]
    pub max_permits_per_tenant: u64,
    /// The memory store's size, in bytes (estimated): past it, new permits
    /// and new keys are refused (QUOTA_STORE_FULL); nothing open is evicted.
    /// 0: no limit.
    #[arg(long, env = "ATMOST_MEMORY_MAX_BYTES", default_value_t = 1 << 30)]
    pub memory_max_bytes: u64,
    /// Serve Prometheus metrics (GET /metrics, plaintext HTTP) on this
    /// address. Traces and OTLP metrics are set by the OTEL_* variables
    /// (docs/telemetry.md).
    #[arg(long, env = "ATMOST_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// While metrics are exported: how often the census of UNCERTAIN
    /// attempts is read (on Redis one replica of the fleet counts per
    /// interval; 1s to 1h).
    #[arg(long, env = "ATMOST_UNCERTAIN_CENSUS_INTERVAL", default_value = "10s", value_parser = census_interval)]
    pub uncertain_census_interval: Duration,
    /// How long a call a permit's approval rule holds waits for a person
    /// when the rule gives no wait (1s to 7d, at most
    /// --approval-wait-max).
    #[arg(long, env = "ATMOST_APPROVAL_WAIT_DEFAULT", default_value = "15m", value_parser = approval_wait)]
    pub approval_wait_default: Duration,
    /// The longest wait an approval rule may give (1s to 7d).
    #[arg(long, env = "ATMOST_APPROVAL_WAIT_MAX", default_value = "7d", value_parser = approval_wait)]
    pub approval_wait_max: Duration,
    /// Log format (logs go to stderr; filter with RUST_LOG). Text has
    /// colours only when stderr is a terminal.
    #[arg(long, env = "ATMOST_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Where the audit trail goes, one JSON line per state-changing call:
    /// stderr, stdout, a file (appended to) or off. Written by a thread of
    /// its own from a bounded buffer (docs/api.md, "The audit trail").
    #[arg(
        long,
        env = "ATMOST_AUDIT_LOG",
        default_value = "stderr",
        value_name = "stderr|stdout|PATH|off"
    )]
    pub audit_log: atmost::audit::Output,
    /// Audit lines the buffer holds before --audit-when-full applies.
    #[arg(long, env = "ATMOST_AUDIT_BUFFER", default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    pub audit_buffer: u64,
    /// With the audit buffer full: block (the request waits for room, the
    /// trail stays whole) or drop (the event is lost). Counted either way:
    /// atmost_audit_events_delayed_total, atmost_audit_events_dropped_total.
    #[arg(
        long,
        env = "ATMOST_AUDIT_WHEN_FULL",
        value_enum,
        default_value = "block"
    )]
    pub audit_when_full: atmost::audit::WhenFull,
}

impl ServeArgs {
    pub fn store_name(&self) -> &'static str {
        match self.store {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }

    /// The first address served off loopback: `--listen`, then
    /// `--http-listen` (which `--http=false` leaves unserved).
    pub fn non_loopback(&self) -> Option<SocketAddr> {
        std::iter::once(self.listen)
            .chain(self.http_listen.filter(|_| self.http))
            .find(|addr| !addr.ip().is_loopback())
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

fn approval_wait(text: &str) -> Result<Duration, String> {
    bounded(
        text,
        Duration::from_secs(1),
        Duration::from_secs(7 * 24 * 3600),
    )
}

fn census_interval(text: &str) -> Result<Duration, String> {
    bounded(text, Duration::from_secs(1), Duration::from_secs(3600))
}

#[cfg(test)]
mod tests {
    use crate::Cli;
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
