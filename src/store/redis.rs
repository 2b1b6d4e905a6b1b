//! The production store: Redis (or anything that speaks its protocol and
//! runs its Lua), shared by any number of atmost replicas.
//!
//! Every transition is exactly one script run: one function of atmost's
//! Redis Functions library, by `FCALL` (the library loaded where Redis
//! answers that the function is not found, which means it did not run).
//! The scripts live in `redis/lua/` as `.lua` files with a KEYS/ARGV/Returns
//! header; `lib.lua` comes once before them in the library, and each
//! answers one msgpack string ([`library_text`]). All keys of a permit
//! carry the hash tag `{permit_id}` and are passed in KEYS, so a permit
//! lives in one Cluster slot.
//!
//! The connection (`conn`) is one multiplexed connection per Redis server:
//! to one server, to each Cluster node, or to the primary Sentinel names.
//! Requests from all tasks are pipelined on it, and a dropped (timed out)
//! request cannot desynchronise it. Nothing re-sends a command whose reply
//! was lost: that is an error here (UNAVAILABLE to the caller), and the
//! caller's retry with the same key is answered from what the first run
//! recorded. Only replies that say the script did not run (MOVED, READONLY,
//! a function not found, ...) are retried, within the store deadline. With
//! `--durability replica`, each writing script is followed on the same
//! connection by `WAIT 1`, and atmost answers once a replica has it.
//!
//! This file holds the operations: each builds its script invocation, runs
//! it and decodes the reply. Beside it, in `redis/`: `conn` (configuration
//! and the connection), `eviction` (no service on a Redis that may evict
//! keys), `scripts` (the script table), `codec` (records <-> Redis values)
//! and `reply` (reading script replies).

mod codec;
mod conn;
mod eviction;
#[cfg(test)]
mod fuzz;
mod reply;
mod scripts;
mod shards;

pub use conn::{Durability, Mode, RedisConfig, Time, connection_info};
pub use eviction::Policy as EvictionPolicy;
pub use reply::unpack_reply;
pub use scripts::{function_name, library_name, library_text, script_body};

use super::memory::full_page;
use super::{CensusFigures, Cursor, INDEX_MARGIN_MS, Page, Store};
use crate::domain::{
    ApproveCmd, Attempt, AuthorizeCmd, Authorized, CommitCmd, Decision, DenyCmd, Error,
    GetAttemptCmd, MAX_RETENTION_MS, MarkUncertainCmd, Millis, Outcome, Permit, PermitView, Quotas,
    ResolveCmd, Scope, Settled, invalid,
};
use codec::{decode_permit, encode_permit, id_bytes};
use conn::{Conn, DurablePool, Handle, broken, demoted, function_missing, not_run, unavailable};
use redis::Value;
use reply::{About, decode_attempt, decode_usage, malformed, open, open_ok};
use scripts::{Invocation, Lua};
use shards::Shards;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Index entries read per batch when listing across all permits or
/// sweeping.
const LIST_BATCH: usize = 64;

/// Most tenants one sweep call walks (see [`Store::sweep`]): the next call
/// goes on after them.
const SWEEP_TENANTS: usize = 64;

/// Most attempts one list_uncertain.lua run reads: about 1.5 ms of Redis's
/// time (5 us per attempt), so a page of 1000 never shows in a 10 ms
/// SLOWLOG (docs/performance.md, "ListUncertain at scale").
const LIST_CHUNK: usize = 200;

/// Most script runs one cross-permit ListUncertain page has in flight at
/// once (reading the attempts its index members name).
const READS_IN_FLIGHT: usize = 32;

/// Most runs of a script that Redis refused before it ran (MOVED, READONLY,
/// ...): the first, then retries after 10, 20, 40, ... ms, about 1.3 s in
/// all, cut short by the store deadline.
const NOT_RUN_TRIES: u32 = 8;

/// The Redis store: its connection and the key prefix.
#[derive(Clone)]
pub struct RedisStore {
    conn: Handle,
    /// With `--durability replica`: the connections writing scripts and
    /// their `WAIT` run on.
    durable: Option<Arc<DurablePool>>,
    /// How long `WAIT` waits for a replica: half the store timeout, so a
    /// shortfall is answered before the caller's deadline.
    wait_ms: u64,
    prefix: String,
    retention_ms: Millis,
    /// Whether Redis may evict keys, as last read: nothing is served on a
    /// Redis that does, unless the operator accepted it.
    eviction: eviction::Guard,
    time: Time,
    /// Where this replica's sweep of each tenant's index goes on from (an
    /// index member; none: from the start).
    sweep_from: Arc<Mutex<HashMap<String, String>>>,
    /// Where this replica's sweep of the tenants index goes on from (the
    /// last member it read; none: a new round, dev mode's index first).
    sweep_tenants_from: Arc<Mutex<Option<String>>>,
    quotas: Quotas,
    /// Where the uncertain index lives.
    shards: Shards,
    /// This process's token for its census turn (census_turn.lua).
    census_token: String,
    /// How long one cross-permit ListUncertain page may read: half the
    /// store deadline (a page past it ends short, with a cursor on).
    scan_budget: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The keys of one permit, in the order every script expects them.
struct PermitKeys {
    permit: String,
    attempts: String,
    open: String,
    dup: String,
    held: String,
    /// The calls awaiting approval or approved, by deadline.
    pending: String,
    /// The calls awaiting approval, by creation.
    awaiting: String,
}

impl PermitKeys {
    /// The permit's first five keys, in the order every script expects them.
    fn all(&self, inv: &mut Invocation) {
        inv.key(&self.permit)
            .key(&self.attempts)
            .key(&self.open)
            .key(&self.dup)
            .key(&self.held);
    }
}

/// A permit's member in the cross-permit index: "<expires_at, 15
/// digits>:<permit_id>", so the index sorts (and pages) by expiry, then id.
fn index_member(expires_at: Millis, permit_id: &str) -> String {
    format!("{expires_at:015}:{permit_id}")
}

/// (expires_at, permit_id) of an index member.
fn parse_index_member(member: &str) -> Result<(Millis, &str), Error> {
    member
        .split_once(':')
        .and_then(|(at, id)| Some((at.parse().ok()?, id)))
        .ok_or_else(|| malformed(format!("index member {member:?}")))
}

/// The tenant of a tenants index member, "<tenant>\n<token>"
/// (index_tenant.lua). Tenant names are `[A-Za-z0-9._-]`, all after "\v",
/// so the index sorts by tenant name and a tenant's members sort in
/// ["<tenant>\n", "<tenant>\v").
fn parse_tenant_member(member: &str) -> Result<&str, Error> {
    member
        .split_once('\n')
        .filter(|(tenant, token)| crate::domain::valid_name(tenant) && !token.is_empty())
        .map(|(tenant, _)| tenant)
        .ok_or_else(|| malformed(format!("tenants index member {member:?}")))
}

/// An attempt's member in a permit's open set (lib.lua: open_add).
fn open_member(at: Millis, key: &str) -> String {
    format!("{at:015}:{key}")
}

/// A cursor's place in a cross-permit index (uncertain or approvals):
/// "<at, 15 digits>:<permit id>:<key>".
fn index_position(c: &Cursor) -> String {
    format!("{:015}:{}:{}", c.at, c.permit_id, c.idempotency_key)
}

/// The cursor after a member of a cross-permit index.
fn member_cursor((at, id, key): &(Millis, String, String)) -> Cursor {
    Cursor {
        at: *at,
        permit_id: id.clone(),
        idempotency_key: key.clone(),
    }
}

/// A task of a cross-permit listing, joined: a panic goes on unwinding (a
/// bug, not a store that did not answer); a task cancelled is UNAVAILABLE.
fn joined<T>(task: Result<T, tokio::task::JoinError>) -> Result<T, Error> {
    task.map_err(|e| match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => Error::StoreUnavailable("a listing task was cancelled".into()),
    })
}

/// (at, permit id, key) of a member of the uncertain or the approvals
/// index, "<at, 15 digits>:<permit id>:<key>" (lib.lua: index_member; a
/// permit id, a canonical UUID, holds no ':', a key may).
fn parse_uncertain_member(member: &str) -> Result<(Millis, String, String), Error> {
    let bad = || malformed(format!("uncertain or approvals index member {member:?}"));
    let (at, rest) = member.split_at_checked(15).ok_or_else(bad)?;
    let rest = rest.strip_prefix(':').ok_or_else(bad)?;
    let (id, key) = rest
        .split_once(':')
        .filter(|(id, key)| {
            crate::domain::canonical_id(id).as_deref() == Some(*id) && !key.is_empty()
        })
        .ok_or_else(bad)?;
    if !at.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    Ok((
        at.parse().map_err(|_| bad())?,
        id.to_owned(),
        key.to_owned(),
    ))
}

// === impl RedisStore ===

impl RedisStore {
    /// Connects (lazily: a Redis that is down at start-up is reported by the
    /// first request and by health checks, and picked up when it comes).
    pub fn connect(config: &RedisConfig) -> Result<Self, Error> {
        Self::check_settings(config)?;
        Ok(Self {
            conn: Handle::new(config)?,
            durable: match config.durability {
                conn::Durability::None => None,
                conn::Durability::Replica => Some(Arc::new(DurablePool::new(config)?)),
            },
            wait_ms: u64::try_from(config.timeout.as_millis() / 2)
                .unwrap_or(u64::MAX)
                .max(1),
            prefix: config.prefix.clone(),
            retention_ms: config.retention_ms,
            eviction: eviction::Guard::new(
                config.allow_eviction,
                config.allow_unknown_eviction_policy,
            ),
            time: config.time,
            sweep_from: Arc::default(),
            sweep_tenants_from: Arc::default(),
            quotas: Quotas::DEFAULT,
            shards: Shards::new(config.mode == conn::Mode::Cluster),
            census_token: crate::domain::new_id(0),
            scan_budget: config.timeout / 2,
        })
    }

    /// Whether [`connect`](Self::connect) would accept `config`: every
    /// check it makes (the prefix, the retention, each URL and the mode's
    /// rules), without a runtime and without connecting. `atmost config
    /// check` and `serve`'s start-up run it, so a mistake is found before
    /// anything starts, with exit code 2.
    pub fn check(config: &RedisConfig) -> Result<(), Error> {
        Self::check_settings(config)?;
        Handle::check(config)
    }

    fn check_settings(config: &RedisConfig) -> Result<(), Error> {
        if config.prefix.contains(['{', '}']) {
            return Err(invalid("redis_prefix", "may not contain '{' or '}'"));
        }
        if !(0..=MAX_RETENTION_MS).contains(&config.retention_ms) {
            return Err(invalid("retention", "must be within 0 and 10 years"));
        }
        Ok(())
    }

    /// The scripts' last two ARGV: the caller's tenant and its agent key id
    /// ("" when not limited).
    fn scope_args(inv: &mut Invocation, scope: &Scope) {
        inv.arg(&scope.tenant)
            .arg(scope.agent.as_deref().unwrap_or_default());
    }

    /// Enforces these quotas (the default ones otherwise).
    pub fn with_quotas(mut self, quotas: Quotas) -> Self {
        self.quotas = quotas;
        self
    }

    /// The scripts' ARGV[1]: "" (Redis's clock) or the caller's `now`.
    fn now_arg(&self, now: Millis) -> String {
        match self.time {
            Time::Redis => String::new(),
            Time::Caller => now.to_string(),
        }
    }

    /// Reads Redis's `maxmemory-policy` now (at start-up, to refuse an
    /// evicting Redis, or one that will not tell, before serving; the store
    /// also reads it before its first operation and with every health
    /// check): the policy, and why the store will not serve on it (`None`:
    /// it may).
    pub async fn eviction_policy(&self) -> Result<(EvictionPolicy, Option<String>), Error> {
        let mut conn = self.conn.get().await?;
        let policy = self.eviction.check(&mut conn).await?;
        let refused = self.eviction.refusal(&policy);
        Ok((policy, refused))
    }

    /// Loads atmost's Functions library on every primary (at start-up: a
    /// node that lacks it later, after a restart without persistence or a
    /// `FUNCTION FLUSH`, is sent it by the call that finds it missing).
    pub async fn load_library(&self) -> Result<(), Error> {
        let mut conn = self.conn.get().await?;
        conn.load_library_everywhere()
            .await
            .map_err(|e| self.lost(e))
    }

    /// Redis's version (major, minor), from `INFO server` (the oldest of a
    /// Cluster's primaries): atmost's scripts need 7.0 or later.
    pub async fn server_version(&self) -> Result<(u32, u32), Error> {
        let mut conn = self.conn.get().await?;
        let infos = conn.info("server").await.map_err(|e| self.lost(e))?;
        let versions = infos
            .iter()
            .map(|info| parse_version(info))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| malformed("INFO server without a redis_version"))?;
        versions
            .into_iter()
            .min()
            .ok_or_else(|| malformed("INFO server answered nothing"))
    }

    /// A Redis error as the caller sees it (UNAVAILABLE). A broken or
    /// refused connection may come back to a restarted Redis, or to another
    /// after a failover, whose eviction policy nobody has read: the policy is
    /// read again before the next operation.
    fn lost(&self, e: redis::RedisError) -> Error {
        self.noticed(&e);
        unavailable(e)
    }

    /// What an error tells of the connection (see [`Self::lost`]): after a
    /// broken connection or a demoted primary the eviction policy is read
    /// again, and the next call goes to the Sentinels or reads the Cluster's
    /// topology afresh ([`Handle::failed`]).
    fn noticed(&self, e: &redis::RedisError) {
        if broken(e) || demoted(e) {
            self.eviction.forget();
        }
        self.conn.failed(e);
    }

    /// The connection, once Redis is known not to evict (see [`eviction`]).
    async fn conn(&self) -> Result<Conn, Error> {
        let mut conn = self.conn.get().await?;
        if let Err(e) = self.eviction.admit(&mut conn).await {
            // The policy could not be read (or refuses): perhaps from a
            // server that is gone; the next call connects afresh.
            self.conn.reset();
            return Err(e);
        }
        Ok(conn)
    }

    /// `<prefix>:sync:{tag}`: in the slot of `key` (its hash tag, or the
    /// whole key when it has none), written and deleted after each durable
    /// script.
    /// atmost's keys have braces only around their tag (prefixes may not
    /// hold them, tenants are `[A-Za-z0-9._-]`, permit ids UUIDs).
    fn sync_key(&self, key: &[u8]) -> Vec<u8> {
        let tag = shards::hash_tag(key);
        let mut sync = format!("{}:sync:{{", self.prefix).into_bytes();
        sync.extend_from_slice(tag);
        sync.push(b'}');
        sync
    }

    /// The ten keys of the scripts that move attempts (authorize, settle,
    /// mark_uncertain, approve, deny, revoke_permit; get_permit reads the
    /// first eight): the permit's five, its shard of `tenant`'s uncertain
    /// index and of the fleet's, its pending and awaiting sets, and its
    /// shard of `tenant`'s approvals index (lib.lua).
    fn script_keys(&self, inv: &mut Invocation, permit_id: &str, tenant: &str) {
        let k = self.keys(permit_id);
        k.all(inv);
        let tag = self.shards.tag(permit_id);
        inv.key(self.uncertain_key(tag, Some(tenant)))
            .key(self.uncertain_key(tag, None))
            .key(&k.pending)
            .key(&k.awaiting)
            .key(self.approvals_key(tag, tenant));
    }

    /// A shard of the uncertain index: `tenant`'s, or with `None` the
    /// fleet's.
    fn uncertain_key(&self, tag: &str, tenant: Option<&str>) -> String {
        match tenant {
            Some(tenant) => format!("{}:uncertain:{{{tag}}}:t:{tenant}", self.prefix),
            None => format!("{}:uncertain:{{{tag}}}", self.prefix),
        }
    }

    /// A shard of `tenant`'s approvals index: its calls awaiting approval,
    /// by (created, permit id, key), in the slot of the permits whose
    /// shard it is (lib.lua).
    fn approvals_key(&self, tag: &str, tenant: &str) -> String {
        format!("{}:approvals:{{{tag}}}:t:{tenant}", self.prefix)
    }

    /// Refuses, on a Cluster, a permit outside the uncertain index's
    /// shards: one created by a version of atmost that kept no index, under
    /// the same prefix (README, "Upgrading": never mix versions on one
    /// prefix), whose attempts would be in no shard a listing reads. An id
    /// no permit has is PERMIT_NOT_FOUND, as everywhere (GetPermit says).
    async fn placed(&self, scope: &Scope, permit_id: &str, now: Millis) -> Result<(), Error> {
        if self.shards.place(permit_id) {
            return Ok(());
        }
        self.get_permit(scope, permit_id, now).await?;
        Err(Error::StoreUnavailable(format!(
            "permit {permit_id} was created by an earlier version of atmost \
             (not in a slot of the uncertain index): serve it with that version"
        )))
    }

    fn keys(&self, permit_id: &str) -> PermitKeys {
        let base = format!("{}:{{{permit_id}}}", self.prefix);
        PermitKeys {
            permit: format!("{base}:permit"),
            attempts: format!("{base}:attempts"),
            open: format!("{base}:open"),
            dup: format!("{base}:dup"),
            held: format!("{base}:held"),
            pending: format!("{base}:pending"),
            awaiting: format!("{base}:awaiting"),
        }
    }

    /// A tenant's cross-permit index: its permits that may hold open
    /// attempts, by [`index_member`]. A permit enters it before
    /// CreatePermit answers (so before any reservation), and leaves once it
    /// has no open attempt and is expired, so no new key can open one: when
    /// a listing or the sweep comes by. One key per tenant, so it works
    /// unchanged when permits live on different Cluster shards (each
    /// listing call runs on its permit's). Dev mode's tenant "" has
    /// `<prefix>:permits`.
    fn index_key(&self, tenant: &str) -> String {
        if tenant.is_empty() {
            format!("{}:permits", self.prefix)
        } else {
            format!("{}:permits:{tenant}", self.prefix)
        }
    }

    /// The tenants index: every tenant whose index may hold a permit, by
    /// [`parse_tenant_member`], so the sweep and the census find each index
    /// (dev mode's is walked besides). A tenant enters it with each new
    /// permit, once the permit is indexed, and leaves it when the sweep
    /// finds its index empty ([`Store::sweep`]).
    fn tenants_key(&self) -> String {
        format!("{}:tenants", self.prefix)
    }

    /// The fleet's last census figures and whose turn it is to count them
    /// (census_turn.lua).
    fn census_key(&self) -> String {
        format!("{}:census:{{c}}", self.prefix)
    }

    /// Runs a script and unpacks its msgpack reply (see [`library_text`]),
    /// for [`open`] to read.
    ///
    /// A reply that says the script did not run (MOVED, READONLY, ...) is
    /// retried on a fresh connection, with a backoff; any other error,
    /// and a lost reply above all, answers UNAVAILABLE.
    async fn run(&self, inv: &Invocation) -> Result<Vec<Value>, Error> {
        use tracing::Instrument as _;
        // A child span of the store call, per script run (no key, no
        // argument: the script's name only).
        let span = tracing::info_span!(
            target: crate::telemetry::SPAN_TARGET,
            "redis",
            otel.name = inv.lua.name(),
            otel.kind = "client",
            db.system.name = "redis",
            db.operation.name = "FCALL",
            atmost.script = inv.lua.name(),
        );
        self.run_script(inv).instrument(span).await
    }

    async fn run_script(&self, inv: &Invocation) -> Result<Vec<Value>, Error> {
        let mut backoff = Duration::from_millis(10);
        let mut tries = 1;
        loop {
            let mut conn = self.conn().await?;
            let result = match &self.durable {
                Some(pool) if inv.lua.writes() => {
                    let lease = pool.lease().await;
                    let mut conn = lease.handle().get().await?;
                    let result = self.run_once(&mut conn, inv, true).await;
                    if let Err(e) = &result {
                        lease.handle().failed(e);
                    }
                    result
                }
                _ => self.run_once(&mut conn, inv, false).await,
            };
            match result {
                Ok(packed) => return unpack_reply(&packed),
                Err(e) if not_run(&e) && tries < NOT_RUN_TRIES => {
                    self.noticed(&e);
                    tracing::debug!(error = %e, "script not run; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    tries += 1;
                }
                Err(e) => return Err(self.lost(e)),
            }
        }
    }

    /// One `FCALL` (loading the library where Redis answers that the
    /// function is not found, which means it did not run), followed on the
    /// same connection by `WAIT 1` if `wait`.
    async fn run_once(
        &self,
        conn: &mut Conn,
        inv: &Invocation,
        wait: bool,
    ) -> redis::RedisResult<Vec<u8>> {
        let mut loaded = false;
        loop {
            let result = if wait {
                // One pipeline: they go out together on one connection,
                // to the script's node. WAIT waits for what this connection
                // last wrote; a script that wrote nothing (a replay) may
                // have read what another connection wrote and no replica
                // has yet, so a write always follows it (in its slot), and
                // WAIT then covers everything the script could have seen.
                // That write is HSET then DEL of a key of atmost's own,
                // commands the scripts already need, so no extra ACL grant:
                // HSET is replicated even when it changes nothing, and the
                // DEL leaves nothing behind.
                let sync = self.sync_key(inv.slot_key());
                let mut pipe = redis::pipe();
                pipe.add_command(inv.fcall())
                    .cmd("HSET")
                    .arg(&sync)
                    .arg("w")
                    .arg(1)
                    .ignore()
                    .cmd("DEL")
                    .arg(&sync)
                    .ignore()
                    .cmd("WAIT")
                    .arg(1)
                    .arg(self.wait_ms);
                pipe.query_async::<(Vec<u8>, i64)>(conn)
                    .await
                    .and_then(|(packed, replicas)| match replicas {
                        0 => Err(redis::RedisError::from((
                            redis::ErrorKind::Client,
                            "no replica acknowledged the write in time",
                            format!(
                                "WAIT 1 {} answered 0: the outcome is unknown after a failover; \
                                 retry with the same key",
                                self.wait_ms
                            ),
                        ))),
                        _ => Ok(packed),
                    })
            } else {
                inv.fcall().query_async(conn).await
            };
            match result {
                Err(e) if function_missing(&e) && !loaded => {
                    conn.load_library(inv.slot_key()).await?;
                    loaded = true;
                }
                other => return other,
            }
        }
    }
}

/// The benchmark's Redis ceiling drives the authorize script exactly as
/// [`Store::authorize`] does, through these: the same invocation, the same
/// reading of its reply.
impl RedisStore {
    /// The script call of [`Store::authorize`] for `cmd`.
    fn authorize_invocation(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: &str,
    ) -> Invocation {
        let mut inv = Lua::Authorize.prepare_invoke();
        self.script_keys(&mut inv, &cmd.permit_id, &scope.tenant);
        inv.arg(self.now_arg(now))
            .arg(&cmd.tool)
            .arg(&cmd.idempotency_key)
            .arg(&cmd.request_fingerprint)
            .arg(cmd.cost)
            .arg(id_bytes(attempt_id))
            .arg(&cmd.holder_token);
        Self::scope_args(&mut inv, scope);
        inv.arg(self.quotas.max_open_attempts)
            .arg(self.quotas.max_attempts)
            .arg(&scope.key_id)
            .arg(&cmd.approval_summary);
        inv
    }

    /// The `FCALL` that [`Store::authorize`] sends for `cmd`, byte for
    /// byte (the library must be loaded: [`library_text`]), for a tool
    /// that drives Redis the way the store does (the benchmark's ceiling).
    /// No retry, no reload, no `WAIT`: those are the store's.
    pub fn authorize_command(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: &str,
    ) -> redis::Cmd {
        self.authorize_invocation(scope, cmd, now, attempt_id)
            .fcall()
    }

    /// A reply to [`Self::authorize_command`], read as [`Store::authorize`]
    /// reads it: the answer, or the error the store would return.
    pub fn authorize_reply(cmd: &AuthorizeCmd, packed: &[u8]) -> Result<Authorized, Error> {
        read_authorized(cmd, unpack_reply(packed)?)
    }
}

/// authorize.lua's reply (unpacked), for `cmd`.
fn read_authorized(cmd: &AuthorizeCmd, reply: Vec<Value>) -> Result<Authorized, Error> {
    let about = About {
        tool: Some(&cmd.tool),
        cost: Some(cmd.cost),
        ..About::key(&cmd.permit_id, &cmd.idempotency_key)
    };
    let (verdict, mut f) = open(reply, &about)?;
    let (decision, redelivered) = match verdict.as_str() {
        "DISPATCH" => (Decision::Dispatch, false),
        "REDELIVERED" => (Decision::Dispatch, true),
        "REPLAY" => (Decision::Replay, false),
        "AWAIT_APPROVAL" => (Decision::AwaitApproval, false),
        other => return Err(malformed(format!("verdict {other:?}"))),
    };
    let attempt = decode_attempt(&cmd.permit_id, f.array()?)?;
    let usage = decode_usage(f.array()?)?;
    let duplicate_of = Some(f.string()?).filter(|k| !k.is_empty());
    // The lease left, or for AWAIT_APPROVAL the wait left.
    let remaining_ms = f.int()?;
    let waits = decision == Decision::AwaitApproval;
    Ok(Authorized {
        decision,
        attempt,
        usage,
        duplicate_of,
        redelivered,
        lease_remaining_ms: if waits { 0 } else { remaining_ms },
        approval_remaining_ms: if waits { remaining_ms } else { 0 },
    })
}

// === the operations ===

impl Store for RedisStore {
    async fn create_permit(&self, mut permit: Permit) -> Result<Permit, Error> {
        self.quotas.check_lifetime(&permit, permit.created_at)?;
        // On a Cluster, an id in a slot of the uncertain index's placed
        // shards (one in 256 ids: a few microseconds of drawing).
        while !self.shards.place(&permit.permit_id) {
            permit.permit_id = crate::domain::new_id(permit.created_at);
        }
        let k = self.keys(&permit.permit_id);
        let mut inv = Lua::CreatePermit.prepare_invoke();
        inv.key(&k.permit)
            .arg(permit.expires_at.saturating_add(self.retention_ms));
        for (field, value) in encode_permit(&permit) {
            inv.arg(field).arg(value);
        }
        open_ok(self.run(&inv).await?, &About::permit(&permit.permit_id))?;
        // Then the tenant's permits index, before CreatePermit answers:
        // nobody knows the id until then, so no attempt can exist under a
        // permit the sweep does not know. (Indexing first would let a
        // concurrent sweep see an indexed permit with no hash yet and tidy
        // it away for good.) If this fails the caller gets UNAVAILABLE and
        // an unknown, unused permit expires with its retention.
        // The tenant's quota is counted and the index added to in one
        // script on the index alone (one key: one Cluster slot); then the
        // tenant enters the tenants index with this permit's id as its
        // token, after the index holds the permit: a sweep that removes the
        // tenant's entry read it before it saw the index empty, so any
        // permit indexed before that entry was written is in what it saw,
        // and a later entry has another token, which its removal misses
        // (Store::sweep). If this last step fails, the permit is indexed
        // but nobody knows its id: no attempt can open under it.
        let mut conn = self.conn().await?;
        let mut inv = Lua::IndexPermit.prepare_invoke();
        inv.key(self.index_key(&permit.tenant))
            .arg(self.now_arg(permit.created_at))
            .arg(self.quotas.max_permits_per_tenant)
            .arg(index_member(permit.expires_at, &permit.permit_id));
        if let Err(refused) = open_ok(self.run(&inv).await?, &About::permit(&permit.permit_id)) {
            // Refused: nobody knows the permit's id, so its record goes
            // (or, if this fails, expires with its retention).
            redis::cmd("DEL")
                .arg(&k.permit)
                .exec_async(&mut conn)
                .await
                .map_err(|e| self.lost(e))?;
            return Err(refused);
        }
        if !permit.tenant.is_empty() {
            self.index_tenant(&permit.tenant, &permit.permit_id).await?;
        }
        Ok(permit)
    }

    async fn get_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<PermitView, Error> {
        let mut inv = Lua::GetPermit.prepare_invoke();
        self.script_keys(&mut inv, permit_id, &scope.tenant);
        inv.arg(self.now_arg(now));
        Self::scope_args(&mut inv, scope);
        let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
        decode_permit(permit_id, f.array()?)
    }

    async fn revoke_permit(
        &self,
        scope: &Scope,
        permit_id: &str,
        now: Millis,
    ) -> Result<Permit, Error> {
        let mut inv = Lua::RevokePermit.prepare_invoke();
        self.script_keys(&mut inv, permit_id, &scope.tenant);
        inv.arg(self.now_arg(now));
        Self::scope_args(&mut inv, scope);
        let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
        decode_permit(permit_id, f.array()?).map(|view| view.permit)
    }

    async fn get_attempt(
        &self,
        scope: &Scope,
        cmd: &GetAttemptCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        let k = self.keys(&cmd.permit_id);
        let mut inv = Lua::GetAttempt.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .arg(self.now_arg(now))
            .arg(&cmd.idempotency_key);
        Self::scope_args(&mut inv, scope);
        let about = About::key(&cmd.permit_id, &cmd.idempotency_key);
        let mut f = open_ok(self.run(&inv).await?, &about)?;
        decode_attempt(&cmd.permit_id, f.array()?)
    }

    async fn authorize(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        self.placed(scope, &cmd.permit_id, now).await?;
        let inv = self.authorize_invocation(scope, cmd, now, &attempt_id);
        read_authorized(cmd, self.run(&inv).await?)
    }

    async fn commit(
        &self,
        scope: &Scope,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.settle(
            scope,
            &cmd.permit_id,
            &cmd.idempotency_key,
            &cmd.attempt_id,
            false,
            &cmd.outcome,
            now,
            receipt_id,
        )
        .await
    }

    async fn mark_uncertain(
        &self,
        scope: &Scope,
        cmd: &MarkUncertainCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        self.placed(scope, &cmd.permit_id, now).await?;
        let mut inv = Lua::MarkUncertain.prepare_invoke();
        self.script_keys(&mut inv, &cmd.permit_id, &scope.tenant);
        inv.arg(self.now_arg(now))
            .arg(&cmd.idempotency_key)
            .arg(id_bytes(&cmd.attempt_id))
            .arg(&cmd.reason);
        Self::scope_args(&mut inv, scope);
        let about = About::key(&cmd.permit_id, &cmd.idempotency_key);
        let mut f = open_ok(self.run(&inv).await?, &about)?;
        decode_attempt(&cmd.permit_id, f.array()?)
    }

    async fn resolve(
        &self,
        scope: &Scope,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.settle(
            scope,
            &cmd.permit_id,
            &cmd.idempotency_key,
            &cmd.attempt_id,
            true,
            &cmd.outcome,
            now,
            receipt_id,
        )
        .await
    }

    async fn list_uncertain(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        if let Some(id) = permit_id {
            let after = after.and_then(|c| c.attempt_in(id));
            let listed = self.list_one(scope, id, after, limit, now).await?;
            return Ok(full_page(listed, limit, Cursor::after));
        }
        // Across permits: the tenant's uncertain index, every shard (one
        // outside a Cluster) read at once, merged in order.
        let started = std::time::Instant::now();
        let after_member = after.map(index_position);
        let members = self
            .index_members(
                |tag| self.uncertain_key(tag, Some(&scope.tenant)),
                after_member.as_deref(),
                limit,
                now,
            )
            .await?;
        // More may follow only when the page is full of members.
        let mut next = (members.len() == limit)
            .then(|| members.last())
            .flatten()
            .map(member_cursor);
        // The attempts, where each permit lives; one settled meanwhile is
        // left out. Past the scan budget the page ends short, after the
        // last run read.
        let (attempts, read) = self
            .read_members(&members, started, |id, list| {
                self.uncertain_attempts(scope, id, list, now)
            })
            .await?;
        if read < members.len() {
            next = read
                .checked_sub(1)
                .map(|last| member_cursor(&members[last]));
        }
        Ok(Page { attempts, next })
    }

    async fn approve(
        &self,
        scope: &Scope,
        cmd: &ApproveCmd,
        now: Millis,
    ) -> Result<Attempt, Error> {
        let mut inv = Lua::Approve.prepare_invoke();
        self.script_keys(&mut inv, &cmd.permit_id, &scope.tenant);
        inv.arg(self.now_arg(now))
            .arg(&cmd.idempotency_key)
            .arg(id_bytes(&cmd.attempt_id));
        Self::scope_args(&mut inv, scope);
        inv.arg(&scope.key_id);
        let about = About::key(&cmd.permit_id, &cmd.idempotency_key);
        let mut f = open_ok(self.run(&inv).await?, &about)?;
        decode_attempt(&cmd.permit_id, f.array()?)
    }

    async fn deny(&self, scope: &Scope, cmd: &DenyCmd, now: Millis) -> Result<Settled, Error> {
        let mut inv = Lua::Deny.prepare_invoke();
        self.script_keys(&mut inv, &cmd.permit_id, &scope.tenant);
        inv.arg(self.now_arg(now))
            .arg(&cmd.idempotency_key)
            .arg(id_bytes(&cmd.attempt_id))
            .arg(&cmd.reason);
        Self::scope_args(&mut inv, scope);
        inv.arg(&scope.key_id);
        let about = About::key(&cmd.permit_id, &cmd.idempotency_key);
        let mut f = open_ok(self.run(&inv).await?, &about)?;
        Ok(Settled {
            attempt: decode_attempt(&cmd.permit_id, f.array()?)?,
            usage: decode_usage(f.array()?)?,
        })
    }

    async fn list_approvals(
        &self,
        scope: &Scope,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        if let Some(id) = permit_id {
            let after = after.and_then(|c| c.attempt_in(id));
            let listed = self.awaiting_one(scope, id, after, limit, now).await?;
            return Ok(full_page(listed, limit, Cursor::after_request));
        }
        // Across permits: the tenant's approvals index, every shard read at
        // once, merged in order, as ListUncertain's; requests that lapsed
        // (their lapse not yet written) are skipped, and more are read
        // until the page is full or the index ends.
        let started = std::time::Instant::now();
        let mut from = after.map(index_position);
        let mut attempts = Vec::new();
        while attempts.len() < limit {
            let want = limit - attempts.len();
            let members = self
                .index_members(
                    |tag| self.approvals_key(tag, &scope.tenant),
                    from.as_deref(),
                    want,
                    now,
                )
                .await?;
            let (found, read) = self
                .read_members(&members, started, |id, list| {
                    self.awaiting_attempts(scope, id, list, now)
                })
                .await?;
            attempts.extend(found);
            let Some(last) = read.checked_sub(1).map(|last| &members[last]) else {
                break;
            };
            // Past the scan budget the page ends short, after the last
            // member read; the index's end ends it.
            let short = Page {
                next: Some(member_cursor(last)),
                ..Page::default()
            };
            if read < members.len() {
                return Ok(Page { attempts, ..short });
            }
            if members.len() < want {
                break;
            }
            if attempts.len() < limit && started.elapsed() >= self.scan_budget {
                return Ok(Page { attempts, ..short });
            }
            from = Some(index_position(&member_cursor(last)));
        }
        Ok(full_page(attempts, limit, Cursor::after_request))
    }

    /// Walks this replica's next batch of tenants (at most
    /// [`SWEEP_TENANTS`] of the tenants index, after the last call's; a new
    /// round starts with dev mode's index), and each one's next batch of
    /// index entries of permits expired more than [`INDEX_MARGIN_MS`] ago,
    /// dropping those with no open attempt (or gone): an index keeps only
    /// permits that may still hold one. Each walk wraps around to its
    /// start when it reaches the end.
    ///
    /// A tenant whose index the walk saw empty leaves the tenants index:
    /// the sweep removes the exact member it read, "<tenant>\n<token>",
    /// and read it before it saw the index empty. Any permit whose
    /// CreatePermit wrote that member (or an earlier one) was indexed
    /// before, so it is not live (it was closed and dropped); a permit
    /// indexed since wrote another token, so the removal removes nothing
    /// (`create_permit`). A tenant with a live permit stays in the tenants
    /// index whatever the interleaving, and one whose removal fails halfway
    /// merely stays too.
    async fn sweep(&self, now: Millis) -> Result<usize, Error> {
        let mut conn = self.conn().await?;
        let after = self
            .sweep_tenants_from
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut dropped = 0;
        let from = match after {
            Some(last) => format!("({last}"),
            None => {
                dropped += self.sweep_tenant(&mut conn, "", now).await?.0;
                "-".to_owned()
            }
        };
        let members = self.tenants_page(&mut conn, &from, SWEEP_TENANTS).await?;
        // The next sweep goes on after this batch, whatever happens to it.
        *self
            .sweep_tenants_from
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = members
            .last()
            .filter(|_| members.len() == SWEEP_TENANTS)
            .cloned();
        for member in &members {
            // A member this version cannot read stays: never dropped on a
            // guess.
            let Ok(tenant) = parse_tenant_member(member) else {
                tracing::warn!(member, "unreadable tenants index member left in place");
                continue;
            };
            let (n, empty) = self.sweep_tenant(&mut conn, tenant, now).await?;
            dropped += n;
            if empty && self.forget_tenant(&mut conn, member).await? {
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// The fleet's figures when another replica counted them within
    /// `interval`; otherwise this replica counts, if the turn is its
    /// (census_turn.lua): one census.lua run per shard of the uncertain
    /// index, each atomic, and publishes them.
    async fn census(&self, now: Millis, interval: Duration) -> Result<CensusFigures, Error> {
        if interval.is_zero() {
            return self.count_uncertain(now).await.map(|(figures, _)| figures);
        }
        let interval_ms = u64::try_from(interval.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let figures = self.census_key();
        let mut inv = Lua::CensusTurn.prepare_invoke();
        inv.key(&figures)
            .arg(self.now_arg(now))
            .arg(interval_ms)
            .arg(&self.census_token);
        let (verdict, mut f) = open(self.run(&inv).await?, &About::default())?;
        let read_at = f.int()?;
        if verdict == "FIGURES" {
            let (uncertain, oldest_age_ms, at) = (f.count()?, f.int()?, f.int()?);
            // (Figures from after `read_at`, the clock having stepped back
            // while another replica holds the turn, are counted afresh:
            // their age is not known.)
            if at > 0 && at <= read_at {
                return Ok(CensusFigures {
                    uncertain,
                    oldest_age_ms,
                    age_ms: read_at - at,
                });
            }
            // None published yet (or none readable), and another replica
            // counts: count too.
        } else if verdict != "COUNT" {
            return Err(malformed(format!("census verdict {verdict:?}")));
        }
        let (counted, at) = self.count_uncertain(now).await?;
        let at = at.min(read_at);
        let mut inv = Lua::CensusPublish.prepare_invoke();
        inv.key(&figures)
            .arg(counted.uncertain)
            .arg(counted.oldest_age_ms)
            .arg(at)
            .arg(interval_ms)
            .arg(&self.census_token);
        open_ok(self.run(&inv).await?, &About::default())?;
        Ok(counted)
    }

    /// Redis answers, and (read afresh: CONFIG SET or a failover can change
    /// it) does not evict.
    async fn ping(&self) -> Result<(), Error> {
        // Sentinel mode: every connection, the durable ones included, to the
        // primary the Sentinels name now.
        if let Some(named) = self.conn.named_primary().await? {
            self.conn.forget_unless(&named);
            for handle in self.durable.iter().flat_map(|pool| pool.handles()) {
                handle.forget_unless(&named);
            }
        }
        let mut conn = self.conn.get().await?;
        conn.ping().await.map_err(|e| self.lost(e))?;
        self.eviction.check(&mut conn).await?;
        self.eviction.admit(&mut conn).await
    }
}

impl RedisStore {
    /// The members of a tenant's cross-permit index (uncertain or
    /// approvals: `key` names its shard by tag) after `after`, up to `now`:
    /// every shard (one outside a Cluster) read at once (list_index.lua),
    /// merged in order, at most `limit`.
    async fn index_members(
        &self,
        key: impl Fn(&str) -> String,
        after: Option<&str>,
        limit: usize,
        now: Millis,
    ) -> Result<Vec<(Millis, String, String)>, Error> {
        use tracing::Instrument as _;
        let mut shard_reads = tokio::task::JoinSet::new();
        for tag in self.shards.placed() {
            let mut inv = Lua::ListIndex.prepare_invoke();
            inv.key(key(tag))
                .arg(self.now_arg(now))
                .arg(after.unwrap_or_default())
                .arg(limit);
            let store = self.clone();
            shard_reads.spawn(
                async move {
                    let mut f = open_ok(store.run(&inv).await?, &About::default())?;
                    let mut members = Vec::new();
                    while !f.done() {
                        members.push(parse_uncertain_member(&f.string()?)?);
                    }
                    Ok::<_, Error>(members)
                }
                .in_current_span(),
            );
        }
        let mut members = Vec::new();
        while let Some(read) = shard_reads.join_next().await {
            members.extend(joined(read)??);
        }
        members.sort_unstable();
        members.truncate(limit);
        Ok(members)
    }

    /// The attempts the index `members` name, where each permit lives:
    /// runs of at most [`LIST_CHUNK`] members of one permit
    /// (`run(permit_id, members)`: uncertain_attempts.lua or
    /// awaiting_attempts.lua), [`READS_IN_FLIGHT`] at once, in the members'
    /// order; a run's permit not found (gone, or not the caller's) gives
    /// none. Past the scan budget (counted from `started`) it stops after
    /// the last batch read. The attempts, and how many members were read.
    async fn read_members(
        &self,
        members: &[(Millis, String, String)],
        started: std::time::Instant,
        run: impl Fn(&str, &[String]) -> Invocation,
    ) -> Result<(Vec<Attempt>, usize), Error> {
        use tracing::Instrument as _;
        let mut runs: Vec<(String, Vec<String>, usize)> = Vec::new();
        for (i, (at, id, key)) in members.iter().enumerate() {
            match runs.last_mut() {
                Some((p, list, last)) if p == id && list.len() < LIST_CHUNK => {
                    list.push(open_member(*at, key));
                    *last = i;
                }
                _ => runs.push((id.clone(), vec![open_member(*at, key)], i)),
            }
        }
        let mut attempts = Vec::new();
        // How many members were read.
        let mut read = 0;
        for batch in runs.chunks(READS_IN_FLIGHT) {
            if read > 0 && started.elapsed() >= self.scan_budget {
                break;
            }
            let mut reads = tokio::task::JoinSet::new();
            for (i, (id, list, _)) in batch.iter().enumerate() {
                let inv = run(id, list);
                let (store, id) = (self.clone(), id.clone());
                reads.spawn(
                    async move {
                        let read = store.run(&inv).await.and_then(|reply| {
                            let mut f = open_ok(reply, &About::permit(&id))?;
                            let mut found = Vec::new();
                            while !f.done() {
                                found.push(decode_attempt(&id, f.array()?)?);
                            }
                            Ok(found)
                        });
                        (i, read)
                    }
                    .in_current_span(),
                );
            }
            let mut found = vec![Vec::new(); batch.len()];
            while let Some(done) = reads.join_next().await {
                let (i, one) = joined(done)?;
                found[i] = match one {
                    // Gone since it was listed, or not the caller's to
                    // see (the scripts say which is an error).
                    Err(Error::PermitNotFound { .. }) => Vec::new(),
                    other => other?,
                };
            }
            // In the runs' order, each run's in its members': the merged
            // order.
            attempts.extend(found.into_iter().flatten());
            read = batch.last().map_or(read, |(_, _, last)| *last + 1);
        }
        Ok((attempts, read))
    }

    /// awaiting_attempts.lua for `members` (awaiting-set members) of one
    /// permit, as `scope` reads them.
    fn awaiting_attempts(
        &self,
        scope: &Scope,
        permit_id: &str,
        members: &[String],
        now: Millis,
    ) -> Invocation {
        let k = self.keys(permit_id);
        let mut inv = Lua::AwaitingAttempts.prepare_invoke();
        inv.key(&k.permit).key(&k.attempts).arg(self.now_arg(now));
        Self::scope_args(&mut inv, scope);
        for member in members {
            inv.arg(member);
        }
        inv
    }

    /// One permit's calls awaiting approval at `now` after `after`, in
    /// (created, key) order: a page of at most `limit`, read in script
    /// runs of at most [`LIST_CHUNK`] members of its awaiting set (those
    /// whose request lapsed are skipped, and the next run goes on after
    /// the last member read).
    async fn awaiting_one(
        &self,
        scope: &Scope,
        permit_id: &str,
        after: Option<(Millis, &str)>,
        limit: usize,
        now: Millis,
    ) -> Result<Vec<Attempt>, Error> {
        let k = self.keys(permit_id);
        let mut after = after.map(|(at, key)| open_member(at, key));
        let mut listed = Vec::new();
        while listed.len() < limit {
            let chunk = (limit - listed.len()).min(LIST_CHUNK);
            let mut inv = Lua::ListApprovals.prepare_invoke();
            inv.key(&k.permit)
                .key(&k.attempts)
                .key(&k.awaiting)
                .arg(self.now_arg(now))
                .arg(after.as_deref().unwrap_or_default())
                .arg(chunk);
            Self::scope_args(&mut inv, scope);
            let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
            let read = f.count()?;
            let last = f.string()?;
            while !f.done() {
                listed.push(decode_attempt(permit_id, f.array()?)?);
            }
            if read < chunk as u64 {
                break;
            }
            after = Some(last);
        }
        Ok(listed)
    }

    /// uncertain_attempts.lua for `members` (open-set members) of one
    /// permit, as `scope` reads them.
    fn uncertain_attempts(
        &self,
        scope: &Scope,
        permit_id: &str,
        members: &[String],
        now: Millis,
    ) -> Invocation {
        let k = self.keys(permit_id);
        let mut inv = Lua::UncertainAttempts.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .key(self.uncertain_key(self.shards.tag(permit_id), Some(&scope.tenant)))
            .arg(self.now_arg(now));
        Self::scope_args(&mut inv, scope);
        for member in members {
            inv.arg(member);
        }
        inv
    }

    /// Commit (the holder, with its `attempt_id`) and Resolve (an operator,
    /// with the reconciled `attempt_id` or "" for whichever the key holds)
    /// run the same script, as they share the domain's `Ledger::settle`.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        scope: &Scope,
        permit_id: &str,
        key: &str,
        attempt_id: &str,
        operator: bool,
        outcome: &Outcome,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        let (kind, payload, actual_cost): (&str, &[u8], Option<i64>) = match outcome {
            Outcome::Succeeded {
                result,
                actual_cost,
            } => ("succeeded", result, *actual_cost),
            Outcome::Failed { reason } => ("failed", reason.as_bytes(), None),
            Outcome::NotSent => ("not_sent", b"", None),
        };
        let mut inv = Lua::Settle.prepare_invoke();
        self.script_keys(&mut inv, permit_id, &scope.tenant);
        inv.arg(self.now_arg(now))
            .arg(key)
            .arg(id_bytes(attempt_id))
            .arg(kind)
            .arg(payload)
            .arg(actual_cost.map(|c| c.to_string()).unwrap_or_default())
            .arg(id_bytes(&receipt_id))
            .arg(if operator { "operator" } else { "holder" })
            .arg(self.retention_ms);
        Self::scope_args(&mut inv, scope);
        let mut f = open_ok(self.run(&inv).await?, &About::key(permit_id, key))?;
        Ok(Settled {
            attempt: decode_attempt(permit_id, f.array()?)?,
            usage: decode_usage(f.array()?)?,
        })
    }

    /// One permit's attempts uncertain at `now` after `after`: a page of
    /// at most `limit` (at least 1).
    /// A page is read in script runs of at most [`LIST_CHUNK`] attempts, so
    /// no one run holds Redis long (a page needs no atomicity: each run goes
    /// on after the last attempt of the one before, as pages do).
    async fn list_one(
        &self,
        scope: &Scope,
        permit_id: &str,
        after: Option<(Millis, &str)>,
        limit: usize,
        now: Millis,
    ) -> Result<Vec<Attempt>, Error> {
        let k = self.keys(permit_id);
        let mut after = after.map(|(at, key)| open_member(at, key));
        let mut listed = Vec::new();
        loop {
            let chunk = (limit - listed.len()).min(LIST_CHUNK);
            let mut inv = Lua::ListUncertain.prepare_invoke();
            inv.key(&k.permit)
                .key(&k.attempts)
                .key(&k.open)
                .arg(self.now_arg(now))
                .arg(after.as_deref().unwrap_or_default())
                .arg(chunk);
            Self::scope_args(&mut inv, scope);
            let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
            let mut got = 0;
            while !f.done() {
                listed.push(decode_attempt(permit_id, f.array()?)?);
                got += 1;
            }
            after = listed
                .last()
                .map(|a| open_member(a.uncertain_since, &a.idempotency_key));
            if got < chunk || listed.len() == limit {
                return Ok(listed);
            }
        }
    }

    /// Closes a permit of `tenant` for new keys if it may leave the
    /// cross-permit index (expired by the margin with nothing open), and
    /// drops its lapsed requests from the approvals index; whether it may
    /// (closed, or gone).
    async fn close(&self, permit_id: &str, tenant: &str, now: Millis) -> Result<bool, Error> {
        let k = self.keys(permit_id);
        let mut inv = Lua::ClosePermit.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.awaiting)
            .key(self.approvals_key(self.shards.tag(permit_id), tenant))
            .arg(self.now_arg(now))
            .arg(INDEX_MARGIN_MS);
        match self
            .run(&inv)
            .await
            .and_then(|r| open_ok(r, &About::permit(permit_id)))
        {
            Ok(mut f) => f.flag(),
            Err(Error::PermitNotFound { .. }) => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// The census counted here: every shard of the uncertain index, each
    /// atomically (census.lua), and the earliest shard's time.
    async fn count_uncertain(&self, now: Millis) -> Result<(CensusFigures, Millis), Error> {
        let mut counted = CensusFigures::default();
        let mut at = Millis::MAX;
        for tag in self.shards.placed() {
            let mut inv = Lua::Census.prepare_invoke();
            inv.key(self.uncertain_key(tag, None))
                .arg(self.now_arg(now));
            let mut f = open_ok(self.run(&inv).await?, &About::default())?;
            let (shard_now, uncertain, since) = (f.int()?, f.count()?, f.int()?);
            at = at.min(shard_now);
            counted.uncertain += uncertain;
            if uncertain > 0 {
                counted.oldest_age_ms = counted.oldest_age_ms.max(shard_now - since);
            }
        }
        Ok((counted, at))
    }

    /// Puts a new permit's tenant in the tenants index, with the permit's
    /// id as its token (index_tenant.lua).
    async fn index_tenant(&self, tenant: &str, permit_id: &str) -> Result<(), Error> {
        let mut inv = Lua::IndexTenant.prepare_invoke();
        inv.key(self.tenants_key()).arg(tenant).arg(permit_id);
        open_ok(self.run(&inv).await?, &About::permit(permit_id)).map(drop)
    }

    /// Removes this exact member from the tenants index (its tenant's index
    /// was seen empty after it was read); whether it was there.
    async fn forget_tenant(&self, conn: &mut Conn, member: &str) -> Result<bool, Error> {
        redis::cmd("ZREM")
            .arg(self.tenants_key())
            .arg(member)
            .query_async(conn)
            .await
            .map_err(|e| self.lost(e))
    }

    /// Up to `limit` members of the tenants index from `from` (a ZRANGEBYLEX
    /// bound), in name order.
    async fn tenants_page(
        &self,
        conn: &mut Conn,
        from: &str,
        limit: usize,
    ) -> Result<Vec<String>, Error> {
        redis::cmd("ZRANGEBYLEX")
            .arg(self.tenants_key())
            .arg(from)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(conn)
            .await
            .map_err(|e| self.lost(e))
    }

    /// One tenant's batch of [`Store::sweep`]: how many entries it dropped,
    /// and whether the index was empty when last read.
    async fn sweep_tenant(
        &self,
        conn: &mut Conn,
        tenant: &str,
        now: Millis,
    ) -> Result<(usize, bool), Error> {
        let from = {
            let cursors = self.sweep_from.lock().unwrap_or_else(|e| e.into_inner());
            match cursors.get(tenant) {
                Some(member) => format!("({member}"),
                None => "-".to_owned(),
            }
        };
        // Members of permits expired by the margin sort before this one.
        let until = format!("({:015}", now.saturating_sub(INDEX_MARGIN_MS));
        // With whether the index holds anything at all, in the same round
        // trip.
        let (members, exists): (Vec<String>, bool) = redis::pipe()
            .cmd("ZRANGEBYLEX")
            .arg(self.index_key(tenant))
            .arg(&from)
            .arg(&until)
            .arg("LIMIT")
            .arg(0)
            .arg(LIST_BATCH)
            .cmd("EXISTS")
            .arg(self.index_key(tenant))
            .query_async(conn)
            .await
            .map_err(|e| self.lost(e))?;
        let mut empty = !exists;
        // The next sweep goes on after this batch, whatever happens to it.
        {
            let mut cursors = self.sweep_from.lock().unwrap_or_else(|e| e.into_inner());
            match members.last() {
                Some(last) if members.len() == LIST_BATCH => {
                    cursors.insert(tenant.to_owned(), last.clone());
                }
                _ => {
                    cursors.remove(tenant);
                }
            }
        }
        let mut dropped = 0;
        for member in &members {
            // A member this version cannot read (another version's, under
            // the same prefix) stays: never dropped on a guess.
            let Ok((_, id)) = parse_index_member(member) else {
                tracing::warn!(member, "unreadable index member left in place");
                continue;
            };
            if self.close(id, tenant, now).await? {
                empty = self.unindex(conn, tenant, member).await?;
                dropped += 1;
            }
        }
        Ok((dropped, empty))
    }

    /// Drops an index member (after its permit was closed, or is gone);
    /// whether the index is empty after it.
    async fn unindex(&self, conn: &mut Conn, tenant: &str, member: &str) -> Result<bool, Error> {
        let (exists,): (bool,) = redis::pipe()
            .cmd("ZREM")
            .arg(self.index_key(tenant))
            .arg(member)
            .ignore()
            .cmd("EXISTS")
            .arg(self.index_key(tenant))
            .query_async(conn)
            .await
            .map_err(|e| self.lost(e))?;
        Ok(!exists)
    }
}

/// (major, minor) of `redis_version:7.0.15` in an `INFO server` reply.
fn parse_version(info: &str) -> Option<(u32, u32)> {
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))?
        .trim();
    let mut parts = version.split('.').map(str::parse::<u32>);
    Some((parts.next()?.ok()?, parts.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::{RedisConfig, RedisStore, parse_version};

    /// The key written after a durable script shares its slot: the permit's
    /// hash tag, or for a key without one (a tenant's index) the whole key.
    #[tokio::test]
    async fn the_sync_key_is_in_the_slot_of_the_script() {
        use redis::cluster_routing::Slot;
        let store = RedisStore::connect(&RedisConfig::new("redis://127.0.0.1:1", "p")).unwrap();
        let slot = |k: &[u8]| Slot::for_key(k);
        for key in [
            &b"p:{0190-abc}:permit"[..],
            b"p:permits:tenant-a",
            b"p:permits",
        ] {
            let sync = store.sync_key(key);
            assert!(sync.starts_with(b"p:sync:{"), "{sync:?}");
            assert_eq!(slot(&sync), slot(key), "{}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn reads_the_version_from_info_server() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(parse_version(info), Some((7, 0)));
        assert_eq!(parse_version("redis_version:6.2.14\n"), Some((6, 2)));
        assert_eq!(parse_version("redis_version:x\n"), None);
        assert_eq!(parse_version("# Server\n"), None);
    }
}
