//! How the Redis store connects: its configuration, the deployment it
//! talks to (one server, a Cluster, or a primary found through Sentinel),
//! and the connection every operation runs on.
//!
//! Nothing here re-sends a command whose reply was lost: redis-rs's own
//! retries are off in every mode, so a script that may have run is never run
//! again behind the caller's back. The store retries only the replies that
//! say the script did *not* run ([`not_run`]: MOVED, ASK, TRYAGAIN,
//! CLUSTERDOWN, READONLY, LOADING, a function not found); a broken connection answers
//! UNAVAILABLE, and the caller's retry with the same key is answered from
//! what the first run recorded.

use crate::domain::{Error, Millis, invalid};
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, ConnectionAddr, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, ServerErrorKind,
    Value,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the Redis store connects and names its keys.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// One URL in standalone mode; in cluster and sentinel modes, a
    /// comma-separated list of seed nodes or Sentinels.
    pub url: String,
    pub mode: Mode,
    /// Whether a state change must reach a replica before atmost answers.
    pub durability: Durability,
    /// Prepended to every key (`<prefix>:{permit_id}:...`), so several
    /// deployments or test runs can share one Redis.
    pub prefix: String,
    /// How long finished attempts and the permit are kept past its expiry.
    pub retention_ms: Millis,
    /// How long to wait for a connection or a reply before failing.
    pub timeout: Duration,
    /// Serve even when Redis's `maxmemory-policy` may evict keys (see
    /// `eviction`): the operator accepts that an evicted finished attempt
    /// lets its key be dispatched again.
    pub allow_eviction: bool,
    /// Serve even when Redis will not tell its `maxmemory-policy` (INFO
    /// and CONFIG both disabled or not permitted): the operator vouches
    /// that it is `noeviction`.
    pub allow_unknown_eviction_policy: bool,
    /// Whose clock decides expiry, leases and key lifetimes.
    pub time: Time,
    /// For a `rediss://` URL: the CA (PEM) that signed Redis's certificate,
    /// instead of the system's trust store.
    pub tls_ca: Option<Vec<u8>>,
}

impl RedisConfig {
    /// One standalone Redis at `url` under `prefix`: durability `none`,
    /// 24 h retention, a 2 s timeout, Redis's clock, no eviction allowed
    /// (nor a policy Redis will not tell).
    pub fn new(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            mode: Mode::Standalone,
            durability: Durability::None,
            prefix: prefix.into(),
            retention_ms: 24 * 3600 * 1000,
            timeout: Duration::from_secs(2),
            allow_eviction: false,
            allow_unknown_eviction_policy: false,
            time: Time::Redis,
            tls_ca: None,
        }
    }
}

/// Which Redis deployment the URLs name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Mode {
    /// One Redis server (a primary, or a proxy in front of one).
    #[default]
    Standalone,
    /// A Redis Cluster, found from any of its nodes. A permit's keys share
    /// one hash tag, so each script runs on one shard.
    Cluster,
    /// The primary that these Sentinels name `master`, found again after a
    /// failover.
    Sentinel { master: String },
}

/// What a state change waits for before atmost answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// The primary's acknowledgement: a failover may lose the last writes
    /// (docs/guarantees.md, "Durability").
    #[default]
    None,
    /// The primary's and at least one replica's (`WAIT 1`); a replica that
    /// does not acknowledge in time answers UNAVAILABLE.
    Replica,
}

/// Whose clock the scripts decide on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Time {
    /// Redis's own (`TIME` in each script): one clock for every replica,
    /// however far their own clocks drift. What `atmost serve` uses.
    #[default]
    Redis,
    /// The `now` the service passes: for tests that move time with a
    /// manual clock. Redis still expires keys on its own clock, so a permit
    /// is forgotten on the caller's (lib.lua: forgotten).
    Caller,
}

/// How atmost connects to the Redis at `url`: with `TCP_NODELAY`, which
/// redis-rs leaves off. With Nagle's algorithm a pipelined script call waits
/// for the previous one's acknowledgement (p99 at 17 000 Authorize/s: 2.2-2.7
/// ms with it, 1.6-2.1 ms without; docs/performance.md).
pub fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    let info = url
        .trim()
        .into_connection_info()
        .map_err(|e| invalid("redis_url", e.to_string()))?;
    let nodelay = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(nodelay))
}

/// The URLs of a comma-separated list, each read as [`connection_info`].
fn connection_infos(urls: &str) -> Result<Vec<redis::ConnectionInfo>, Error> {
    let infos = urls
        .split(',')
        .filter(|u| !u.trim().is_empty())
        .map(connection_info)
        .collect::<Result<Vec<_>, _>>()?;
    if infos.is_empty() {
        return Err(invalid("redis_url", "names no Redis"));
    }
    Ok(infos)
}

/// The store's way to Redis, made lazily: a Redis that is down at start-up
/// is reported by the first request and by health checks, and picked up
/// when it comes.
#[derive(Clone)]
pub(super) enum Handle {
    /// One multiplexed connection, reconnected in the background.
    Single(ConnectionManager),
    /// redis-rs's cluster connection (one multiplexed connection per node,
    /// slots refreshed on MOVED), made on first use and made afresh from
    /// the seeds after a broken connection (see [`LazyCluster`]).
    Cluster(Arc<LazyCluster>),
    /// A connection to the primary the Sentinels name, found again after
    /// a broken connection or a READONLY reply.
    Sentinel(Arc<SentinelPrimary>),
}

/// redis-rs refreshes its slot map on MOVED, but not when a primary stops
/// answering: requests for its slots would go on failing against the dead
/// address after a replica took over. So a broken connection drops the
/// whole cluster connection, and the next call makes one afresh from the
/// seeds, reading the topology as the cluster sees it now (at most every
/// [`CLUSTER_RECONNECT`]).
pub(super) struct LazyCluster {
    client: redis::cluster::ClusterClient,
    /// The connection, and when it was made.
    conn: Mutex<Option<(ClusterConnection, std::time::Instant)>>,
    /// Held while one is made, so the callers waiting meanwhile share it
    /// rather than each making their own.
    connecting: tokio::sync::Mutex<()>,
}

/// The least time between two cluster connections made afresh.
const CLUSTER_RECONNECT: Duration = Duration::from_millis(250);

impl LazyCluster {
    async fn get(&self) -> Result<ClusterConnection, Error> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = self
            .client
            .get_async_connection()
            .await
            .map_err(unavailable)?;
        let mut current = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        Ok(current
            .get_or_insert((conn, std::time::Instant::now()))
            .0
            .clone())
    }

    fn current(&self) -> Option<ClusterConnection> {
        let current = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().map(|(conn, _)| conn.clone())
    }

    fn forget(&self) {
        let mut current = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if current
            .as_ref()
            .is_some_and(|(_, made)| made.elapsed() >= CLUSTER_RECONNECT)
        {
            tracing::warn!("a Redis Cluster node did not answer: reading the topology afresh");
            *current = None;
        }
    }
}

pub(super) struct SentinelPrimary {
    sentinels: tokio::sync::Mutex<SentinelClient>,
    master: String,
    config: redis::AsyncConnectionConfig,
    /// The primary's connection and address, until it fails.
    current: Mutex<Option<(MultiplexedConnection, String)>>,
}

impl Handle {
    /// The handle `config` names: its client, made lazy (a Tokio runtime
    /// must be current).
    pub(super) fn new(config: &RedisConfig) -> Result<Self, Error> {
        Ok(match ModeClient::of(config)? {
            ModeClient::Single(client) => {
                let manager_config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(config.timeout))
                    .set_response_timeout(Some(config.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                ConnectionManager::new_lazy_with_config(client, manager_config)
                    .map(Handle::Single)
                    .map_err(unavailable)?
            }
            ModeClient::Cluster(client) => Handle::Cluster(Arc::new(LazyCluster {
                client,
                conn: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
            })),
            ModeClient::Sentinel(sentinels, master) => {
                Handle::Sentinel(Arc::new(SentinelPrimary {
                    sentinels: tokio::sync::Mutex::new(sentinels),
                    master,
                    config: redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(config.timeout))
                        .set_response_timeout(Some(config.timeout)),
                    current: Mutex::new(None),
                }))
            }
        })
    }

    /// Whether [`Handle::new`] would accept `config`, decided without a
    /// runtime and without connecting: `atmost config check` runs it.
    pub(super) fn check(config: &RedisConfig) -> Result<(), Error> {
        ModeClient::of(config).map(drop)
    }
}

/// The redis-rs client of each mode, built from the configuration alone:
/// every URL parsed, the mode's rules and the TLS settings checked, nothing
/// connected (redis-rs connects only when asked).
enum ModeClient {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
    /// The Sentinels, and the name they know the primary by.
    Sentinel(SentinelClient, String),
}

impl ModeClient {
    fn of(config: &RedisConfig) -> Result<Self, Error> {
        let certs = || redis::TlsCertificates {
            client_tls: None,
            root_cert: config.tls_ca.clone(),
        };
        match &config.mode {
            Mode::Standalone => {
                if config.url.contains(',') {
                    return Err(invalid(
                        "redis_url",
                        "one URL in standalone mode (a list needs --redis-mode cluster or sentinel)",
                    ));
                }
                let info = connection_info(&config.url)?;
                let client = match &config.tls_ca {
                    Some(_) => redis::Client::build_with_tls(info, certs()),
                    None => redis::Client::open(info),
                }
                .map_err(|e| invalid("redis_url", e.to_string()))?;
                Ok(ModeClient::Single(client))
            }
            Mode::Cluster => {
                let infos = connection_infos(&config.url)?;
                let nodelay = infos[0].tcp_settings().clone();
                let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                    // No retry of a command whose reply was lost: the store
                    // retries only what did not run (see the module docs).
                    .retries(0)
                    .connection_timeout(config.timeout)
                    .response_timeout(config.timeout)
                    .tcp_settings(nodelay);
                if config.tls_ca.is_some() {
                    builder = builder.certs(certs());
                }
                let client = builder
                    .build()
                    .map_err(|e| invalid("redis_url", e.to_string()))?;
                Ok(ModeClient::Cluster(client))
            }
            Mode::Sentinel { master } => {
                if master.is_empty() {
                    return Err(invalid(
                        "redis_sentinel_master",
                        "sentinel mode needs the primary's name (--redis-sentinel-master)",
                    ));
                }
                let infos = connection_infos(&config.url)?;
                // The first URL's credentials, database and TLS are the
                // primary's (and the Sentinels', which are asked first).
                let first = &infos[0];
                let tls = matches!(first.addr(), ConnectionAddr::TcpTls { .. });
                let settings = first.redis_settings();
                let mut builder = SentinelClientBuilder::new(
                    infos.iter().map(|i| i.addr().clone()),
                    master,
                    SentinelServerType::Master,
                )
                .map_err(|e| invalid("redis_url", e.to_string()))?
                .set_client_to_redis_db(settings.db())
                .set_client_to_redis_tcp_settings(first.tcp_settings().clone())
                .set_client_to_sentinel_tcp_settings(first.tcp_settings().clone());
                if let Some(user) = settings.username() {
                    builder = builder
                        .set_client_to_redis_username(user)
                        .set_client_to_sentinel_username(user);
                }
                if let Some(password) = settings.password() {
                    builder = builder
                        .set_client_to_redis_password(password)
                        .set_client_to_sentinel_password(password);
                }
                if tls {
                    builder = builder
                        .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                        .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
                    if config.tls_ca.is_some() {
                        builder = builder
                            .set_client_to_redis_certificates(certs())
                            .set_client_to_sentinel_certificates(certs());
                    }
                }
                let sentinels = builder
                    .build()
                    .map_err(|e| invalid("redis_url", e.to_string()))?;
                Ok(ModeClient::Sentinel(sentinels, master.clone()))
            }
        }
    }
}

impl Handle {
    /// A connection to run commands on (made now if it was not yet).
    pub(super) async fn get(&self) -> Result<Conn, Error> {
        match self {
            Handle::Single(m) => Ok(Conn::Single(m.clone())),
            Handle::Cluster(lazy) => lazy.get().await.map(Conn::Cluster),
            Handle::Sentinel(s) => s.get().await.map(Conn::Primary),
        }
    }

    /// What `e` says of the connection: a broken connection or a READONLY
    /// reply (the primary was demoted) makes the next call ask the
    /// Sentinels again, or read the Cluster's topology afresh.
    pub(super) fn failed(&self, e: &RedisError) {
        if broken(e) || demoted(e) {
            self.reset();
        }
    }

    /// The next call asks the Sentinels again, or reads the Cluster's
    /// topology afresh (a single server's connection reconnects itself).
    pub(super) fn reset(&self) {
        match self {
            Handle::Single(_) => {}
            Handle::Cluster(c) => c.forget(),
            Handle::Sentinel(s) => s.forget(),
        }
    }

    /// In sentinel mode, the primary the Sentinels name now (its address);
    /// elsewhere none.
    pub(super) async fn named_primary(&self) -> Result<Option<String>, Error> {
        match self {
            Handle::Sentinel(s) => Ok(Some(s.discover().await?.addr().to_string())),
            _ => Ok(None),
        }
    }

    /// In sentinel mode: a connection to another server than `named` (a
    /// failover it has not noticed) is dropped, and the next call connects
    /// to the primary the Sentinels name.
    pub(super) fn forget_unless(&self, named: &str) {
        if let Handle::Sentinel(s) = self
            && let Some(current) = s.address()
            && current != named
        {
            tracing::warn!(old = %current, new = %named, "Sentinel names a new primary: reconnecting");
            s.forget();
        }
    }
}

impl SentinelPrimary {
    async fn get(&self) -> Result<MultiplexedConnection, Error> {
        if let Some(conn) = self.connection() {
            return Ok(conn);
        }
        // One discovery at a time; those who waited use its connection.
        let mut sentinels = self.sentinels.lock().await;
        if let Some(conn) = self.connection() {
            return Ok(conn);
        }
        let info = Self::ask(&mut sentinels).await?;
        let addr = info.addr().to_string();
        let conn = redis::Client::open(info)
            .map_err(unavailable)?
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
            .map_err(unavailable)?;
        tracing::info!(primary = %addr, master = %self.master, "connected to the primary Sentinel names");
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let conn = current.get_or_insert((conn, addr)).0.clone();
        // Held until the connection is stored, so those waiting use it.
        drop(sentinels);
        Ok(conn)
    }

    /// The primary's address as the Sentinels name it now, once it
    /// confirms (ROLE) that it is the primary.
    async fn discover(&self) -> Result<redis::ConnectionInfo, Error> {
        Self::ask(&mut *self.sentinels.lock().await).await
    }

    /// Asks the Sentinels (redis-rs checks with ROLE that the server they
    /// name is a primary).
    async fn ask(sentinels: &mut SentinelClient) -> Result<redis::ConnectionInfo, Error> {
        let client = sentinels.async_get_client().await.map_err(unavailable)?;
        Ok(client.get_connection_info().clone())
    }

    fn connection(&self) -> Option<MultiplexedConnection> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().map(|(conn, _)| conn.clone())
    }

    fn address(&self) -> Option<String> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().map(|(_, addr)| addr.clone())
    }

    fn forget(&self) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Connections for `--durability replica`, each lent to one script run
/// at a time. `WAIT` blocks the connection it runs on until a replica
/// acknowledges or the timeout passes, and everything pipelined behind it
/// waits too: on the shared multiplexed connection one slow acknowledgement
/// would hold up every request. Here a script and its `WAIT` hold one
/// connection of [`DURABLE_CONNECTIONS`], and the rest go on.
pub(super) struct DurablePool {
    handles: Vec<Handle>,
    free: Mutex<Vec<usize>>,
    slots: tokio::sync::Semaphore,
}

/// Connections of a [`DurablePool`] (per node on a Cluster): as many
/// acknowledged writes in flight at once.
pub(super) const DURABLE_CONNECTIONS: usize = 32;

impl DurablePool {
    pub(super) fn new(config: &RedisConfig) -> Result<Self, Error> {
        let handles = (0..DURABLE_CONNECTIONS)
            .map(|_| Handle::new(config))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            free: Mutex::new((0..handles.len()).collect()),
            slots: tokio::sync::Semaphore::new(handles.len()),
            handles,
        })
    }

    /// Every connection's handle.
    pub(super) fn handles(&self) -> &[Handle] {
        &self.handles
    }

    /// A connection of its own until the lease is dropped (waiting for one
    /// to be free: bounded by the store deadline).
    pub(super) async fn lease(&self) -> Lease<'_> {
        let permit = self
            .slots
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let index = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .expect("a permit means a free connection");
        Lease {
            pool: self,
            index,
            _permit: permit,
        }
    }
}

/// One connection of a [`DurablePool`], given back on drop.
pub(super) struct Lease<'a> {
    pool: &'a DurablePool,
    index: usize,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Lease<'_> {
    pub(super) fn handle(&self) -> &Handle {
        &self.pool.handles[self.index]
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.pool
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.index);
    }
}

/// A connection to run commands on: `redis::aio::ConnectionLike`, so every
/// command and script runs on it unchanged in each mode.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Primary(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Primary(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Primary(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Primary(c) => c.get_db(),
        }
    }
}

impl Conn {
    /// `FUNCTION LOAD` of atmost's library where `key`'s function runs: on
    /// a Cluster, the primary of its slot (so a missing function is
    /// answered per node, and a node that is down elsewhere does not fail
    /// the load). REPLACE: another replica may have loaded it meanwhile,
    /// and a library of this name has this very text (the name is its
    /// hash).
    pub(super) async fn load_library(&mut self, key: &[u8]) -> Result<(), RedisError> {
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD")
            .arg("REPLACE")
            .arg(super::scripts::library_text());
        match self {
            Conn::Cluster(c) => c.route_command(load, primary_of(key)).await.map(drop),
            other => load.exec_async(other).await,
        }
    }

    /// `FUNCTION LOAD REPLACE` of atmost's library on every primary: at
    /// start-up, while Redis has room (Redis refuses `FUNCTION LOAD` past
    /// `maxmemory`, as any write).
    pub(super) async fn load_library_everywhere(&mut self) -> Result<(), RedisError> {
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD")
            .arg("REPLACE")
            .arg(super::scripts::library_text());
        self.on_every_primary(load).await.map(drop)
    }

    /// `INFO <section>` of every primary: one on a single server, each
    /// shard's on a Cluster.
    pub(super) async fn info(&mut self, section: &str) -> Result<Vec<String>, RedisError> {
        let mut info = redis::cmd("INFO");
        info.arg(section);
        self.on_every_primary(info)
            .await?
            .into_iter()
            .map(|v| redis::from_redis_value::<String>(v).map_err(RedisError::from))
            .collect()
    }

    /// `PING` to every primary.
    pub(super) async fn ping(&mut self) -> Result<(), RedisError> {
        self.on_every_primary(redis::cmd("PING")).await.map(|_| ())
    }

    /// `cmd`'s reply from every primary it can reach: the one server's, or
    /// each Cluster shard's. redis-rs leaves out a primary it has no
    /// connection to (one that died, until its replica is promoted): that
    /// shard's requests fail on their own, and the others go on, their
    /// policies read; the promoted replica is read once it is connected (the
    /// health check reads the policy every second). A primary that answers
    /// an error fails the whole.
    async fn on_every_primary(&mut self, cmd: Cmd) -> Result<Vec<Value>, RedisError> {
        let Conn::Cluster(c) = self else {
            return Ok(vec![cmd.query_async(self).await?]);
        };
        let reply = c
            .route_command(
                cmd,
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
            )
            .await?;
        let replies: Vec<Value> = match reply {
            Value::Map(nodes) => nodes.into_iter().map(|(_, v)| v).collect(),
            one => vec![one],
        };
        if let Some(e) = replies.iter().find_map(|v| match v {
            Value::ServerError(e) => Some(e.clone()),
            _ => None,
        }) {
            return Err(e.into());
        }
        if replies.is_empty() {
            return Err(RedisError::from((
                redis::ErrorKind::ClusterConnectionNotFound,
                "no Cluster primary answered",
            )));
        }
        Ok(replies)
    }
}

/// The primary of `key`'s slot.
fn primary_of(key: &[u8]) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(
        key,
        SlotAddr::Master,
    )))
}

/// The server is no primary (any more), or not ready: READONLY, MASTERDOWN,
/// LOADING. The one to write to may now be another.
pub(super) fn demoted(e: &RedisError) -> bool {
    use ServerErrorKind as K;
    [K::ReadOnly, K::MasterDown, K::BusyLoading]
        .into_iter()
        .any(|k| e.kind() == k.into())
}

/// The connection broke or was refused: whatever answers next may be
/// another server (a restarted Redis, a promoted replica).
pub(super) fn broken(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
}

/// Replies that say the command did not run (the script was refused before
/// its first line): retried by the store, within the store deadline.
/// MOVED and ASK (the slot is elsewhere: a resharding or a failover; the
/// cluster connection refreshes its slots on MOVED), TRYAGAIN (keys split
/// during a migration), CLUSTERDOWN, READONLY (a demoted primary),
/// MASTERDOWN and LOADING (a replica or a restart catching up).
pub(super) fn not_run(e: &RedisError) -> bool {
    use ServerErrorKind as K;
    [
        K::Moved,
        K::Ask,
        K::TryAgain,
        K::ClusterDown,
        K::ReadOnly,
        K::MasterDown,
        K::BusyLoading,
    ]
    .into_iter()
    .any(|k| e.kind() == k.into())
}

/// Redis's answer to an `FCALL` of a function it does not have (atmost's
/// library not loaded there: a new or restarted server, `FUNCTION FLUSH`):
/// the function did not run. The answer is the function call's own (index
/// 0: first in a pipeline; redis-rs's cluster connection wraps even one
/// command's answer as a pipeline's).
pub(super) fn function_missing(e: &RedisError) -> bool {
    e.code() == Some("ERR")
        && e.clone().into_server_errors().is_some_and(|errors| {
            errors.iter().any(|(index, error)| {
                *index == 0
                    && error.code() == "ERR"
                    && error
                        .details()
                        .is_some_and(|d| d.starts_with("Function not found"))
            })
        })
}

/// A Redis that did not answer (or whose answer was lost): UNAVAILABLE.
pub(super) fn unavailable(e: redis::RedisError) -> Error {
    Error::StoreUnavailable(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{Error, Handle, Mode, RedisConfig, connection_info, connection_infos};

    #[test]
    fn connects_without_nagle_to_the_address_given() {
        let info = connection_info("redis://127.0.0.1:6390/3").unwrap();
        assert!(info.tcp_settings().nodelay());
        assert_eq!(info.addr().to_string(), "127.0.0.1:6390");
        assert_eq!(info.redis_settings().db(), 3);
        match connection_info("http://127.0.0.1:6390") {
            Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, "redis_url"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_list_of_urls_is_read_whole_or_refused() {
        let infos = connection_infos("redis://127.0.0.1:7000, redis://127.0.0.1:7001,").unwrap();
        assert_eq!(infos.len(), 2);
        assert_eq!(infos[1].addr().to_string(), "127.0.0.1:7001");
        assert!(infos.iter().all(|i| i.tcp_settings().nodelay()));
        for bad in ["", " , ", "redis://127.0.0.1:7000,http://x"] {
            match connection_infos(bad) {
                Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, "redis_url"),
                _ => panic!("{bad:?} accepted"),
            }
        }
    }

    #[test]
    fn each_mode_refuses_what_it_cannot_use() {
        let mut config = RedisConfig::new("redis://127.0.0.1:1,redis://127.0.0.1:2", "t");
        match Handle::new(&config) {
            Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, "redis_url"),
            _ => panic!("a list accepted in standalone mode"),
        }
        config.mode = Mode::Sentinel {
            master: String::new(),
        };
        match Handle::new(&config) {
            Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, "redis_sentinel_master"),
            _ => panic!("sentinel mode without a master name accepted"),
        }
        config.mode = Mode::Cluster;
        assert!(Handle::new(&config).is_ok(), "cluster: made lazily");
    }

    #[test]
    fn the_check_refuses_what_new_refuses_without_a_runtime_or_a_connection() {
        // No Tokio runtime here: Handle::new would need one for standalone.
        let mut config = RedisConfig::new("redis://127.0.0.1:1", "t");
        assert!(Handle::check(&config).is_ok());
        for (mode, url, field) in [
            (
                Mode::Standalone,
                "redis://127.0.0.1:1,redis://127.0.0.1:2",
                "redis_url",
            ),
            (Mode::Standalone, "redis://127.0.0.1:notaport", "redis_url"),
            (Mode::Standalone, "http://127.0.0.1:1", "redis_url"),
            (Mode::Cluster, "redis://127.0.0.1:1,nope", "redis_url"),
            (
                Mode::Sentinel {
                    master: String::new(),
                },
                "redis://127.0.0.1:1",
                "redis_sentinel_master",
            ),
        ] {
            config.mode = mode;
            config.url = url.into();
            match Handle::check(&config) {
                Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, field, "{url}"),
                other => panic!("{url}: {other:?}"),
            }
        }
    }
}
