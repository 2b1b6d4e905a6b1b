//! The production store: Redis (or anything that speaks its protocol and
//! runs its Lua), shared by any number of atmost replicas.
//!
//! Every transition is exactly one script run (EVALSHA, reloaded on
//! NOSCRIPT, which means the script did not run). The scripts live next to
//! this file as `.lua` files with a KEYS/ARGV/return header; `lib.lua` is
//! prepended to each, and each answers one msgpack string
//! ([`script_text`]). All keys of a permit carry the hash tag `{permit_id}`
//! and are passed in KEYS, so a permit lives in one Cluster slot.
//!
//! The connection is one multiplexed [`ConnectionManager`]: requests from
//! all tasks are pipelined on it, a dropped (timed out) request cannot
//! desynchronise it, and it reconnects in the background after Redis
//! returns. It never re-sends a command on its own: a reply lost to a broken
//! connection is an error here (UNAVAILABLE to the caller), and the caller's
//! retry with the same key is answered from what the first run recorded.

use super::{AFTER_ALL_KEYS, Cursor, INDEX_SKEW_MARGIN_MS, MAX_PERMITS_PER_PAGE, Page, Store};
use crate::domain::{
    Attempt, AttemptState, AuthorizeCmd, Authorized, CommitCmd, Decision, DuplicateGuard, Error,
    GuardMode, MarkUncertainCmd, Millis, Outcome, Permit, PermitStatus, PermitView, Receipt,
    ResolveCmd, Settled, Usage, invalid,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{IntoConnectionInfo, Script, Value};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

const LIB: &str = include_str!("redis/lib.lua");

/// The text of a script as atmost sends it: `lib.lua`, then the script's
/// body run as a function whose result is packed into one msgpack string.
/// One bulk reply parses in a fraction of the time of the ~25 RESP values
/// an Authorize answer has (redis-rs's RESP parser was 7% of the server's
/// CPU); [`RedisStore::run`] unpacks it.
pub fn script_text(body: &str) -> String {
    format!("{LIB}\nlocal function main()\n{body}\nend\nreturn cmsgpack.pack(main())")
}

fn script(body: &str) -> Script {
    Script::new(&script_text(body))
}

/// The body of one of atmost's scripts by name (`authorize`, `settle`, ...),
/// for tools that run a script the way atmost does (the benchmark's Redis
/// ceiling).
pub fn script_body(name: &str) -> Option<&'static str> {
    Some(match name {
        "create_permit" => include_str!("redis/create_permit.lua"),
        "revoke_permit" => include_str!("redis/revoke_permit.lua"),
        "authorize" => include_str!("redis/authorize.lua"),
        "settle" => include_str!("redis/settle.lua"),
        "mark_uncertain" => include_str!("redis/mark_uncertain.lua"),
        "list_uncertain" => include_str!("redis/list_uncertain.lua"),
        _ => return None,
    })
}

struct Scripts {
    create_permit: Script,
    revoke_permit: Script,
    authorize: Script,
    settle: Script,
    mark_uncertain: Script,
    list_uncertain: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
    let named = |name| script(script_body(name).expect("a script of atmost's"));
    Scripts {
        create_permit: named("create_permit"),
        revoke_permit: named("revoke_permit"),
        authorize: named("authorize"),
        settle: named("settle"),
        mark_uncertain: named("mark_uncertain"),
        list_uncertain: named("list_uncertain"),
    }
});

/// Permits scanned per pipelined batch when listing across all permits.
const LIST_BATCH: usize = 64;

/// How the Redis store connects and names its keys.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: String,
    /// Prepended to every key (`<prefix>:{permit_id}:...`), so several
    /// deployments or test runs can share one Redis.
    pub prefix: String,
    /// How long finished attempts and the permit are kept past its expiry.
    pub retention_ms: Millis,
    /// How long to wait for a connection or a reply before failing.
    pub timeout: Duration,
}

#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    retention_ms: Millis,
    /// How long one cross-permit ListUncertain page may scan: half the
    /// store deadline.
    scan_budget: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// How atmost connects to the Redis at `url`: with `TCP_NODELAY`, which
/// redis-rs leaves off. With Nagle's algorithm a pipelined script call waits
/// for the previous one's acknowledgement (p99 at 17 000 Authorize/s: 2.2-2.7
/// ms with it, 1.6-2.1 ms without; docs/performance.md).
pub fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    let info = url
        .into_connection_info()
        .map_err(|e| invalid("redis_url", e.to_string()))?;
    let nodelay = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(nodelay))
}

fn unavailable(e: redis::RedisError) -> Error {
    Error::StoreUnavailable(e.to_string())
}

/// The keys of one permit, in the order every script expects them.
struct PermitKeys {
    permit: String,
    attempts: String,
    open: String,
    dup: String,
}

// === impl RedisStore ===

impl RedisStore {
    /// Connects (lazily: a Redis that is down at start-up is reported by the
    /// first request and by health checks, and picked up when it comes).
    pub fn connect(config: &RedisConfig) -> Result<Self, Error> {
        if config.prefix.contains(['{', '}']) {
            return Err(invalid("redis_prefix", "may not contain '{' or '}'"));
        }
        let client = redis::Client::open(connection_info(&config.url)?).map_err(unavailable)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.timeout))
            .set_response_timeout(Some(config.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_millis(500));
        let conn =
            ConnectionManager::new_lazy_with_config(client, manager_config).map_err(unavailable)?;
        Ok(Self {
            conn,
            prefix: config.prefix.clone(),
            retention_ms: config.retention_ms,
            scan_budget: config.timeout / 2,
        })
    }

    fn keys(&self, permit_id: &str) -> PermitKeys {
        let base = format!("{}:{{{permit_id}}}", self.prefix);
        PermitKeys {
            permit: format!("{base}:permit"),
            attempts: format!("{base}:attempts"),
            open: format!("{base}:open"),
            dup: format!("{base}:dup"),
        }
    }

    /// The cross-permit index: permits that may hold open attempts. A permit
    /// enters it before CreatePermit answers (so before any reservation),
    /// and leaves only once no new key can open an attempt under it.
    fn index_key(&self) -> String {
        format!("{}:permits", self.prefix)
    }

    /// Runs a script and unpacks its msgpack reply (see [`script_text`]).
    async fn run(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<Value>, Error> {
        let mut conn = self.conn.clone();
        let packed: Vec<u8> = inv.invoke_async(&mut conn).await.map_err(unavailable)?;
        unpack_reply(&packed)
    }
}

impl Store for RedisStore {
    async fn create_permit(&self, permit: Permit) -> Result<Permit, Error> {
        let k = self.keys(&permit.permit_id);
        let mut inv = SCRIPTS.create_permit.prepare_invoke();
        inv.key(&k.permit)
            .arg(permit.expires_at.saturating_add(self.retention_ms));
        for (field, value) in encode_permit(&permit) {
            inv.arg(field).arg(value);
        }
        let mut f = Fields::new(self.run(&inv).await?);
        if f.string()? != "OK" {
            return Err(Error::StoreUnavailable(format!(
                "permit id {} already taken",
                permit.permit_id
            )));
        }
        // Then the cross-permit index, before CreatePermit answers: nobody
        // knows the id until then, so no attempt can exist under a permit
        // the index does not know. (Indexing first would let a concurrent
        // ListUncertain see an indexed permit with no hash yet and tidy it
        // away for good.) If this fails the caller gets UNAVAILABLE and an
        // unknown, unused permit expires with its retention.
        let mut conn = self.conn.clone();
        redis::cmd("ZADD")
            .arg(self.index_key())
            .arg(0)
            .arg(&permit.permit_id)
            .exec_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(permit)
    }

    async fn get_permit(&self, permit_id: &str) -> Result<PermitView, Error> {
        let mut conn = self.conn.clone();
        let reply: Vec<Value> = redis::cmd("HGETALL")
            .arg(self.keys(permit_id).permit)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        decode_permit(permit_id, reply)
    }

    async fn revoke_permit(&self, permit_id: &str) -> Result<Permit, Error> {
        let mut inv = SCRIPTS.revoke_permit.prepare_invoke();
        inv.key(self.keys(permit_id).permit);
        let reply = self.run(&inv).await?;
        decode_permit(permit_id, reply).map(|view| view.permit)
    }

    async fn authorize(
        &self,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        debug_assert_eq!(id_ms(&attempt_id), Some(now), "ids are new_id(now)");
        let k = self.keys(&cmd.permit_id);
        let mut inv = SCRIPTS.authorize.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .key(&k.dup)
            .arg(now)
            .arg(&cmd.tool)
            .arg(&cmd.idempotency_key)
            .arg(&cmd.request_fingerprint)
            .arg(cmd.cost)
            .arg(id_bytes(&attempt_id));
        let mut f = Fields::new(self.run(&inv).await?);
        let decision = match f.string()?.as_str() {
            "DISPATCH" => Decision::Dispatch,
            "REPLAY" => Decision::Replay,
            "ERR" => {
                return Err(match f.string()?.as_str() {
                    "KEY_REUSED" => Error::KeyReused {
                        idempotency_key: cmd.idempotency_key.clone(),
                    },
                    "IN_PROGRESS" => {
                        let lease_expires_at = f.int()?;
                        Error::InProgress {
                            idempotency_key: cmd.idempotency_key.clone(),
                            lease_expires_at,
                            retry_after_ms: lease_expires_at - now,
                        }
                    }
                    "PERMIT_NOT_FOUND" => Error::PermitNotFound {
                        permit_id: cmd.permit_id.clone(),
                    },
                    "PERMIT_REVOKED" => Error::PermitRevoked {
                        permit_id: cmd.permit_id.clone(),
                    },
                    "PERMIT_EXPIRED" => Error::PermitExpired {
                        permit_id: cmd.permit_id.clone(),
                        expired_at: f.int()?,
                    },
                    "TOOL_NOT_IN_SCOPE" => Error::ToolNotInScope {
                        tool: cmd.tool.clone(),
                    },
                    "DUPLICATE_REQUEST_SUSPECTED" => Error::DuplicateSuspected {
                        tool: cmd.tool.clone(),
                        earlier_key: f.string()?,
                    },
                    "PERMIT_MAX_CALLS_EXCEEDED" => Error::MaxCallsExceeded {
                        tool: cmd.tool.clone(),
                        limit: f.int()? as u64,
                        calls_made: f.int()? as u64,
                    },
                    "PERMIT_BUDGET_EXCEEDED" => Error::BudgetExceeded {
                        budget: f.int()?,
                        committed: f.int()?,
                        reserved: f.int()?,
                        requested: cmd.cost,
                    },
                    other => return Err(malformed(other)),
                });
            }
            other => return Err(malformed(other)),
        };
        let attempt = decode_attempt(&cmd.permit_id, f.array()?)?;
        let usage = decode_usage(f.array()?)?;
        let duplicate_of = Some(f.string()?).filter(|k| !k.is_empty());
        Ok(Authorized {
            decision,
            attempt,
            usage,
            duplicate_of,
        })
    }

    async fn commit(
        &self,
        cmd: &CommitCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.settle(
            &cmd.permit_id,
            &cmd.idempotency_key,
            &cmd.attempt_id,
            &cmd.outcome,
            now,
            receipt_id,
        )
        .await
    }

    async fn mark_uncertain(&self, cmd: &MarkUncertainCmd, now: Millis) -> Result<Attempt, Error> {
        let k = self.keys(&cmd.permit_id);
        let mut inv = SCRIPTS.mark_uncertain.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .arg(now)
            .arg(&cmd.idempotency_key)
            .arg(id_bytes(&cmd.attempt_id))
            .arg(&cmd.reason);
        let mut f = Fields::new(self.run(&inv).await?);
        match f.string()?.as_str() {
            "OK" => decode_attempt(&cmd.permit_id, f.array()?),
            "ERR" => Err(attempt_error(&mut f, &cmd.permit_id, &cmd.idempotency_key)?),
            other => Err(malformed(other)),
        }
    }

    async fn resolve(
        &self,
        cmd: &ResolveCmd,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        self.settle(
            &cmd.permit_id,
            &cmd.idempotency_key,
            "",
            &cmd.outcome,
            now,
            receipt_id,
        )
        .await
    }

    async fn list_uncertain(
        &self,
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        let mut page = Page::default();
        if let Some(id) = permit_id {
            let after_key = after.map_or("", |c| c.idempotency_key.as_str());
            let (found, _, attempts) = self.list_one(id, after_key, limit, now).await?;
            if !found {
                return Err(Error::PermitNotFound {
                    permit_id: id.to_owned(),
                });
            }
            page.attempts = attempts;
            page.next = full_page_cursor(&page.attempts, limit);
            return Ok(page);
        }

        // Across permits: walk the index in id order, one script run per
        // permit, bounded in permits and in time so the page fits well
        // inside the store deadline; a short page carries a cursor on.
        let started = std::time::Instant::now();
        let mut conn = self.conn.clone();
        let mut from = match after {
            Some(c) => format!("[{}", c.permit_id),
            None => "-".to_owned(),
        };
        let mut scanned = 0;
        let mut last_scanned = None;
        'scan: loop {
            let ids: Vec<String> = redis::cmd("ZRANGEBYLEX")
                .arg(self.index_key())
                .arg(&from)
                .arg("+")
                .arg("LIMIT")
                .arg(0)
                .arg(LIST_BATCH)
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            let Some(last) = ids.last() else {
                return Ok(page);
            };
            from = format!("({last}");
            for id in ids {
                // At least one permit per page, so paging always advances.
                if scanned > 0
                    && (scanned == MAX_PERMITS_PER_PAGE || started.elapsed() >= self.scan_budget)
                {
                    break 'scan;
                }
                scanned += 1;
                let after_key = match after {
                    Some(c) if c.permit_id == id => c.idempotency_key.as_str(),
                    _ => "",
                };
                let (_, removable, attempts) = self
                    .list_one(&id, after_key, limit - page.attempts.len(), now)
                    .await?;
                if removable {
                    redis::cmd("ZREM")
                        .arg(self.index_key())
                        .arg(&id)
                        .exec_async(&mut conn)
                        .await
                        .map_err(unavailable)?;
                }
                page.attempts.extend(attempts);
                if page.attempts.len() == limit {
                    page.next = full_page_cursor(&page.attempts, limit);
                    return Ok(page);
                }
                last_scanned = Some(id);
            }
        }
        // Out of permits or time for this page: continue after the last
        // permit looked into.
        page.next = last_scanned.map(|permit_id| Cursor {
            permit_id,
            idempotency_key: AFTER_ALL_KEYS.to_owned(),
        });
        Ok(page)
    }

    async fn ping(&self) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        redis::cmd("PING")
            .exec_async(&mut conn)
            .await
            .map_err(unavailable)
    }
}

impl RedisStore {
    /// Commit (with the holder's `attempt_id`) and Resolve (`attempt_id`
    /// empty: an operator) run the same script, as they share the domain's
    /// `Ledger::settle`.
    async fn settle(
        &self,
        permit_id: &str,
        key: &str,
        attempt_id: &str,
        outcome: &Outcome,
        now: Millis,
        receipt_id: String,
    ) -> Result<Settled, Error> {
        debug_assert_eq!(id_ms(&receipt_id), Some(now), "ids are new_id(now)");
        let k = self.keys(permit_id);
        let (kind, payload, actual_cost): (&str, &[u8], Option<i64>) = match outcome {
            Outcome::Succeeded {
                result,
                actual_cost,
            } => ("succeeded", result, *actual_cost),
            Outcome::Failed { reason } => ("failed", reason.as_bytes(), None),
            Outcome::NotSent => ("not_sent", b"", None),
        };
        let mut inv = SCRIPTS.settle.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .key(&k.dup)
            .arg(now)
            .arg(key)
            .arg(id_bytes(attempt_id))
            .arg(kind)
            .arg(payload)
            .arg(actual_cost.map(|c| c.to_string()).unwrap_or_default())
            .arg(id_bytes(&receipt_id))
            .arg(if attempt_id.is_empty() {
                "operator"
            } else {
                "holder"
            })
            .arg(self.retention_ms);
        let mut f = Fields::new(self.run(&inv).await?);
        match f.string()?.as_str() {
            "OK" => Ok(Settled {
                attempt: decode_attempt(permit_id, f.array()?)?,
                usage: decode_usage(f.array()?)?,
            }),
            "ERR" => Err(attempt_error(&mut f, permit_id, key)?),
            other => Err(malformed(other)),
        }
    }

    /// One permit's uncertain attempts: (permit found, may leave the index,
    /// attempts).
    async fn list_one(
        &self,
        permit_id: &str,
        after_key: &str,
        limit: usize,
        now: Millis,
    ) -> Result<(bool, bool, Vec<Attempt>), Error> {
        let k = self.keys(permit_id);
        let mut inv = SCRIPTS.list_uncertain.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .arg(now)
            .arg(after_key)
            .arg(limit)
            .arg(INDEX_SKEW_MARGIN_MS);
        let mut f = Fields::new(self.run(&inv).await?);
        let found = f.int()? == 1;
        let removable = f.int()? == 1;
        let mut attempts = Vec::new();
        while let Some(value) = f.next() {
            attempts.push(decode_attempt(permit_id, as_array(value)?)?);
        }
        Ok((found, removable, attempts))
    }
}

/// A full page continues after its last attempt.
fn full_page_cursor(attempts: &[Attempt], limit: usize) -> Option<Cursor> {
    (attempts.len() == limit)
        .then(|| attempts.last())
        .flatten()
        .map(|a| Cursor {
            permit_id: a.permit_id.clone(),
            idempotency_key: a.idempotency_key.clone(),
        })
}

// === encoding ===

fn guard_code(mode: GuardMode) -> i64 {
    match mode {
        GuardMode::Off => 0,
        GuardMode::Log => 1,
        GuardMode::Enforce => 2,
    }
}

fn encode_permit(p: &Permit) -> Vec<(String, Vec<u8>)> {
    let mut fields: Vec<(String, Vec<u8>)> = vec![
        ("subject".into(), p.subject.clone().into_bytes()),
        ("currency".into(), p.currency.clone().into_bytes()),
        ("tools".into(), p.tools.join("\n").into_bytes()),
        ("exp".into(), p.expires_at.to_string().into_bytes()),
        ("lease".into(), p.lease_ms.to_string().into_bytes()),
        (
            "gmode".into(),
            guard_code(p.duplicate_guard.mode).to_string().into_bytes(),
        ),
        (
            "gwin".into(),
            p.duplicate_guard.window_ms.to_string().into_bytes(),
        ),
        ("status".into(), b"1".to_vec()),
        ("created".into(), p.created_at.to_string().into_bytes()),
        ("committed".into(), b"0".to_vec()),
        ("reserved".into(), b"0".to_vec()),
        ("open".into(), b"0".to_vec()),
    ];
    if let Some(budget) = p.budget {
        fields.push(("budget".into(), budget.to_string().into_bytes()));
    }
    for tool in &p.tools {
        let cap = p
            .max_calls_per_tool
            .get(tool)
            .map(u64::to_string)
            .unwrap_or_default();
        fields.push((format!("t:{tool}"), cap.into_bytes()));
    }
    fields
}

/// Ids (attempt, receipt) are stored as their 16 bytes, not 36 characters:
/// 40 bytes less per finished attempt. Empty stays empty (no id).
fn id_bytes(id: &str) -> Vec<u8> {
    match uuid::Uuid::try_parse(id) {
        Ok(u) => u.as_bytes().to_vec(),
        Err(_) => id.as_bytes().to_vec(),
    }
}

// === decoding ===

/// The millisecond timestamp a UUIDv7 id carries (lib.lua: id_ms).
fn id_ms(id: &str) -> Option<Millis> {
    let (secs, nanos) = uuid::Uuid::try_parse(id).ok()?.get_timestamp()?.to_unix();
    Some(secs as Millis * 1000 + Millis::from(nanos / 1_000_000))
}

fn id_text(bytes: &[u8]) -> Result<String, Error> {
    if bytes.is_empty() {
        return Ok(String::new());
    }
    uuid::Uuid::from_slice(bytes)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| malformed("an id that is not 16 bytes"))
}

fn malformed(what: impl std::fmt::Display) -> Error {
    Error::StoreUnavailable(format!("unexpected reply from the store: {what}"))
}

/// Reads a script's reply array field by field.
struct Fields(std::vec::IntoIter<Value>);

impl Fields {
    fn new(values: Vec<Value>) -> Self {
        Self(values.into_iter())
    }

    fn next(&mut self) -> Option<Value> {
        self.0.next()
    }

    fn value(&mut self) -> Result<Value, Error> {
        self.0.next().ok_or_else(|| malformed("reply too short"))
    }

    fn bytes(&mut self) -> Result<Vec<u8>, Error> {
        match self.value()? {
            Value::BulkString(b) => Ok(b),
            Value::SimpleString(s) => Ok(s.into_bytes()),
            other => Err(malformed(format!("{other:?} where bytes were expected"))),
        }
    }

    fn string(&mut self) -> Result<String, Error> {
        String::from_utf8(self.bytes()?).map_err(|_| malformed("invalid UTF-8"))
    }

    fn int(&mut self) -> Result<i64, Error> {
        match self.value()? {
            Value::Int(i) => Ok(i),
            Value::BulkString(b) => parse_int(&b),
            other => Err(malformed(format!(
                "{other:?} where an integer was expected"
            ))),
        }
    }

    fn array(&mut self) -> Result<Vec<Value>, Error> {
        as_array(self.value()?)
    }
}

/// A script's reply, as packed by [`script_text`], unpacked into the list
/// of values the script returned.
pub fn unpack_reply(packed: &[u8]) -> Result<Vec<Value>, Error> {
    as_array(from_msgpack(&mut &packed[..])?)
}

/// Unpacks a script's msgpack reply straight into the RESP values the
/// decoders read, with no intermediate tree: Lua strings come as msgpack
/// strings, Lua integers as integers, Lua sequences as arrays (cmsgpack packs
/// nothing else from atmost's scripts).
fn from_msgpack(rd: &mut &[u8]) -> Result<Value, Error> {
    use rmp::Marker;
    use rmp::decode::RmpRead;
    fn bad(e: impl std::fmt::Debug) -> Error {
        malformed(format!("a reply that is not msgpack: {e:?}"))
    }
    fn bytes(rd: &mut &[u8], len: usize) -> Result<Value, Error> {
        if rd.len() < len {
            return Err(malformed("a truncated reply"));
        }
        let (head, rest) = rd.split_at(len);
        *rd = rest;
        Ok(Value::BulkString(head.to_vec()))
    }
    fn array(rd: &mut &[u8], len: usize) -> Result<Value, Error> {
        // Every element takes at least a byte: a corrupt length cannot
        // make this allocate more than the reply's size.
        let mut values = Vec::with_capacity(len.min(rd.len()));
        for _ in 0..len {
            values.push(from_msgpack(rd)?);
        }
        Ok(Value::Array(values))
    }
    let int = |v: Result<i64, _>| v.map(Value::Int).map_err(bad);
    match rmp::decode::read_marker(rd).map_err(|e| bad(e.0))? {
        Marker::Null => Ok(Value::Nil),
        Marker::FixPos(n) => Ok(Value::Int(n.into())),
        Marker::FixNeg(n) => Ok(Value::Int(n.into())),
        Marker::U8 => int(rd.read_data_u8().map(i64::from)),
        Marker::U16 => int(rd.read_data_u16().map(i64::from)),
        Marker::U32 => int(rd.read_data_u32().map(i64::from)),
        Marker::U64 => {
            let v = rd.read_data_u64().map_err(bad)?;
            i64::try_from(v)
                .map(Value::Int)
                .map_err(|_| malformed("an integer out of range"))
        }
        Marker::I8 => int(rd.read_data_i8().map(i64::from)),
        Marker::I16 => int(rd.read_data_i16().map(i64::from)),
        Marker::I32 => int(rd.read_data_i32().map(i64::from)),
        Marker::I64 => int(rd.read_data_i64()),
        Marker::FixStr(n) => bytes(rd, n.into()),
        Marker::Str8 | Marker::Bin8 => {
            let n = rd.read_data_u8().map_err(bad)?;
            bytes(rd, n.into())
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = rd.read_data_u16().map_err(bad)?;
            bytes(rd, n.into())
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = rd.read_data_u32().map_err(bad)?;
            bytes(rd, n as usize)
        }
        Marker::FixArray(n) => array(rd, n.into()),
        Marker::Array16 => {
            let n = rd.read_data_u16().map_err(bad)?;
            array(rd, n.into())
        }
        Marker::Array32 => {
            let n = rd.read_data_u32().map_err(bad)?;
            array(rd, n as usize)
        }
        other => Err(malformed(format!("{other:?} in a script reply"))),
    }
}

fn as_array(value: Value) -> Result<Vec<Value>, Error> {
    match value {
        Value::Array(values) => Ok(values),
        other => Err(malformed(format!("{other:?} where an array was expected"))),
    }
}

fn parse_int(bytes: &[u8]) -> Result<i64, Error> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| malformed("not an integer"))
}

fn decode_state(code: i64) -> Result<AttemptState, Error> {
    Ok(match code {
        1 => AttemptState::Reserved,
        2 => AttemptState::Succeeded,
        3 => AttemptState::Failed,
        4 => AttemptState::Uncertain,
        5 => AttemptState::Released,
        other => return Err(malformed(format!("attempt state {other}"))),
    })
}

/// Decodes lib.lua's `attempt_reply`.
fn decode_attempt(permit_id: &str, values: Vec<Value>) -> Result<Attempt, Error> {
    let mut f = Fields::new(values);
    let attempt_id = id_text(&f.bytes()?)?;
    let tool = f.string()?;
    let request_fingerprint = f.bytes()?;
    let cost = f.int()?;
    let state = decode_state(f.int()?)?;
    let created_at = f.int()?;
    let lease_expires_at = f.int()?;
    let receipt_id = id_text(&f.bytes()?)?;
    let result = f.bytes()?;
    let receipt_cost = f.int()?;
    let issued_at = f.int()?;
    let failure_reason = f.string()?;
    let uncertain_reason = f.string()?;
    let idempotency_key = f.string()?;
    let receipt = (state == AttemptState::Succeeded).then_some(Receipt {
        receipt_id,
        result,
        cost: receipt_cost,
        issued_at,
    });
    Ok(Attempt {
        attempt_id,
        permit_id: permit_id.to_owned(),
        tool,
        idempotency_key,
        request_fingerprint,
        cost,
        state,
        created_at,
        lease_expires_at,
        receipt,
        failure_reason,
        uncertain_reason,
        duplicate_of: None,
    })
}

/// Decodes lib.lua's `usage_reply`.
fn decode_usage(values: Vec<Value>) -> Result<Usage, Error> {
    let mut f = Fields::new(values);
    let tool = f.string()?;
    let calls_made = f.int()? as u64;
    let has_limit = f.int()? == 1;
    let limit = f.int()? as u64;
    let has_budget = f.int()? == 1;
    let remaining = f.int()?;
    Ok(Usage {
        tool,
        calls_made,
        calls_limit: has_limit.then_some(limit),
        budget_remaining: has_budget.then_some(remaining),
    })
}

/// The errors of settle.lua and mark_uncertain.lua, after "ERR".
fn attempt_error(f: &mut Fields, permit_id: &str, key: &str) -> Result<Error, Error> {
    Ok(match f.string()?.as_str() {
        "PERMIT_NOT_FOUND" => Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        },
        "ATTEMPT_NOT_FOUND" => Error::AttemptNotFound {
            idempotency_key: key.to_owned(),
        },
        "ATTEMPT_MISMATCH" => Error::AttemptMismatch {
            idempotency_key: key.to_owned(),
        },
        "ATTEMPT_STATE_CONFLICT" => Error::StateConflict {
            state: decode_state(f.int()?)?,
        },
        "ACTUAL_COST_TOO_HIGH" => invalid(
            "succeeded.actual_cost",
            format!("may not exceed the reserved cost {}", f.int()?),
        ),
        other => return Err(malformed(other)),
    })
}

/// Decodes a permit hash (HGETALL's flat field/value list).
fn decode_permit(permit_id: &str, reply: Vec<Value>) -> Result<PermitView, Error> {
    let mut f = Fields::new(reply);
    let mut map: HashMap<String, Vec<u8>> = HashMap::new();
    while let Some(field) = f.next() {
        let Value::BulkString(field) = field else {
            // {"ERR", "PERMIT_NOT_FOUND"} from revoke_permit.lua.
            break;
        };
        let field = String::from_utf8(field).map_err(|_| malformed("field name"))?;
        if field == "ERR" {
            break;
        }
        map.insert(field, f.bytes()?);
    }
    if !map.contains_key("exp") {
        return Err(Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        });
    }
    let text = |name: &str| -> String {
        map.get(name)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let int = |name: &str| -> Result<i64, Error> { map.get(name).map_or(Ok(0), |b| parse_int(b)) };
    let tools: Vec<String> = text("tools").split('\n').map(str::to_owned).collect();
    let mut max_calls_per_tool = std::collections::BTreeMap::new();
    let mut usage = Vec::with_capacity(tools.len());
    let budget = map.get("budget").map(|b| parse_int(b)).transpose()?;
    let committed = int("committed")?;
    let reserved = int("reserved")?;
    for tool in &tools {
        let cap = match map.get(&format!("t:{tool}")) {
            Some(b) if !b.is_empty() => Some(parse_int(b)? as u64),
            _ => None,
        };
        if let Some(cap) = cap {
            max_calls_per_tool.insert(tool.clone(), cap);
        }
        usage.push(Usage {
            tool: tool.clone(),
            calls_made: int(&format!("n:{tool}"))? as u64,
            calls_limit: cap,
            budget_remaining: budget.map(|b| b - committed - reserved),
        });
    }
    let permit = Permit {
        permit_id: permit_id.to_owned(),
        subject: text("subject"),
        tools,
        max_calls_per_tool,
        budget,
        currency: text("currency"),
        expires_at: int("exp")?,
        lease_ms: int("lease")?,
        duplicate_guard: DuplicateGuard {
            mode: match int("gmode")? {
                0 => GuardMode::Off,
                2 => GuardMode::Enforce,
                _ => GuardMode::Log,
            },
            window_ms: int("gwin")?,
        },
        status: if int("status")? == 2 {
            PermitStatus::Revoked
        } else {
            PermitStatus::Active
        },
        created_at: int("created")?,
    };
    Ok(PermitView {
        permit,
        usage,
        budget_committed: committed,
        budget_reserved: reserved,
    })
}

#[cfg(test)]
mod tests {
    use super::{Error, Value, connection_info, unpack_reply};

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
    fn unpacks_what_cmsgpack_packs() {
        // ["DISPATCH", 7, -2, 300, [nil, "\x01\x02"]] as Redis's cmsgpack packs it.
        let packed = [
            0x95, 0xa8, b'D', b'I', b'S', b'P', b'A', b'T', b'C', b'H', 0x07, 0xfe, 0xcd, 0x01,
            0x2c, 0x92, 0xc0, 0xa2, 0x01, 0x02,
        ];
        assert_eq!(
            unpack_reply(&packed).unwrap(),
            vec![
                Value::BulkString(b"DISPATCH".to_vec()),
                Value::Int(7),
                Value::Int(-2),
                Value::Int(300),
                Value::Array(vec![Value::Nil, Value::BulkString(vec![1, 2])]),
            ]
        );
    }

    #[test]
    fn a_malformed_reply_is_an_error_not_a_guess() {
        for packed in [
            &[][..],                                                 // nothing
            &[0x92, 0x01],                   // an array of two holding one value
            &[0xa5, b'a'],                   // a string shorter than its length
            &[0xdd, 0xff, 0xff, 0xff, 0xff], // 4 billion elements promised, none sent
            &[0xcb, 0, 0, 0, 0, 0, 0, 0, 0], // a float: no script returns one
            &[0x01],                         // not an array
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], // u64 past i64
        ] {
            assert!(unpack_reply(packed).is_err(), "{packed:?}");
        }
    }
}
