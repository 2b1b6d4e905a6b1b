//! The production store: Redis (or anything that speaks its protocol and
//! runs its Lua), shared by any number of atmost replicas.
//!
//! Every transition is exactly one script run (EVALSHA, reloaded on
//! NOSCRIPT, which means the script did not run). The scripts live in
//! `redis/lua/` as `.lua` files with a KEYS/ARGV/Returns header; `lib.lua` is
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
//!
//! This file holds the operations: each builds its script invocation, runs
//! it and decodes the reply. Beside it, in `redis/`: `conn` (configuration
//! and the connection), `eviction` (no service on a Redis that may evict
//! keys), `scripts` (the script table), `codec` (records <-> Redis values)
//! and `reply` (reading script replies).

mod codec;
mod conn;
mod eviction;
mod reply;
mod scripts;

pub use conn::{RedisConfig, connection_info};
pub use eviction::{Policy as EvictionPolicy, refusal as eviction_refusal};
pub use reply::unpack_reply;
pub use scripts::{script_body, script_text};

use super::{AFTER_ALL_KEYS, Cursor, INDEX_SKEW_MARGIN_MS, MAX_PERMITS_PER_PAGE, Page, Store};
use crate::domain::{
    Attempt, AuthorizeCmd, Authorized, CommitCmd, Decision, Error, MAX_RETENTION_MS,
    MarkUncertainCmd, Millis, Outcome, Permit, PermitView, ResolveCmd, Settled, invalid,
};
use codec::{decode_permit, encode_permit, id_bytes, id_ms};
use conn::unavailable;
use redis::Value;
use redis::aio::ConnectionManager;
use reply::{About, decode_attempt, decode_usage, malformed, open, open_ok};
use scripts::Lua;
use std::time::Duration;

/// Permits scanned per pipelined batch when listing across all permits.
const LIST_BATCH: usize = 64;

/// The Redis store: one multiplexed connection and the key prefix.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    retention_ms: Millis,
    /// How long one cross-permit ListUncertain page may scan: half the
    /// store deadline.
    scan_budget: Duration,
    /// Whether Redis may evict keys, as last read: nothing is served on a
    /// Redis that does, unless the operator accepted it.
    eviction: eviction::Guard,
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
}

// === impl RedisStore ===

impl RedisStore {
    /// Connects (lazily: a Redis that is down at start-up is reported by the
    /// first request and by health checks, and picked up when it comes).
    pub fn connect(config: &RedisConfig) -> Result<Self, Error> {
        if config.prefix.contains(['{', '}']) {
            return Err(invalid("redis_prefix", "may not contain '{' or '}'"));
        }
        if !(0..=MAX_RETENTION_MS).contains(&config.retention_ms) {
            return Err(invalid("retention", "must be within 0 and 10 years"));
        }
        Ok(Self {
            conn: conn::manager(config)?,
            prefix: config.prefix.clone(),
            retention_ms: config.retention_ms,
            scan_budget: config.timeout / 2,
            eviction: eviction::Guard::new(config.allow_eviction),
        })
    }

    /// Reads Redis's `maxmemory-policy` now (at start-up, to refuse an
    /// evicting Redis before serving; the store also reads it before its
    /// first operation and with every health check).
    pub async fn eviction_policy(&self) -> Result<EvictionPolicy, Error> {
        let mut conn = self.conn.clone();
        self.eviction.check(&mut conn).await
    }

    /// A Redis error as the caller sees it (UNAVAILABLE). A broken or
    /// refused connection may come back to a restarted Redis, or to another
    /// after a failover, whose eviction policy nobody has read: the policy is
    /// read again before the next operation.
    fn lost(&self, e: redis::RedisError) -> Error {
        if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
            self.eviction.forget();
        }
        unavailable(e)
    }

    /// The connection, once Redis is known not to evict (see [`eviction`]).
    async fn conn(&self) -> Result<ConnectionManager, Error> {
        let mut conn = self.conn.clone();
        self.eviction.admit(&mut conn).await?;
        Ok(conn)
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

    /// Runs a script and unpacks its msgpack reply (see [`script_text`]),
    /// for [`open`] to read.
    async fn run(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<Value>, Error> {
        let mut conn = self.conn().await?;
        let packed: Vec<u8> = inv
            .invoke_async(&mut conn)
            .await
            .map_err(|e| self.lost(e))?;
        unpack_reply(&packed)
    }
}

// === the operations ===

impl Store for RedisStore {
    async fn create_permit(&self, permit: Permit) -> Result<Permit, Error> {
        let k = self.keys(&permit.permit_id);
        let mut inv = Lua::CreatePermit.prepare_invoke();
        inv.key(&k.permit)
            .arg(permit.expires_at.saturating_add(self.retention_ms));
        for (field, value) in encode_permit(&permit) {
            inv.arg(field).arg(value);
        }
        open_ok(self.run(&inv).await?, &About::permit(&permit.permit_id))?;
        // Then the cross-permit index, before CreatePermit answers: nobody
        // knows the id until then, so no attempt can exist under a permit
        // the index does not know. (Indexing first would let a concurrent
        // ListUncertain see an indexed permit with no hash yet and tidy it
        // away for good.) If this fails the caller gets UNAVAILABLE and an
        // unknown, unused permit expires with its retention.
        let mut conn = self.conn().await?;
        redis::cmd("ZADD")
            .arg(self.index_key())
            .arg(0)
            .arg(&permit.permit_id)
            .exec_async(&mut conn)
            .await
            .map_err(|e| self.lost(e))?;
        Ok(permit)
    }

    async fn get_permit(&self, permit_id: &str) -> Result<PermitView, Error> {
        let mut conn = self.conn().await?;
        let reply: Vec<Value> = redis::cmd("HGETALL")
            .arg(self.keys(permit_id).permit)
            .query_async(&mut conn)
            .await
            .map_err(|e| self.lost(e))?;
        decode_permit(permit_id, reply)
    }

    async fn revoke_permit(&self, permit_id: &str) -> Result<Permit, Error> {
        let mut inv = Lua::RevokePermit.prepare_invoke();
        inv.key(self.keys(permit_id).permit);
        let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
        decode_permit(permit_id, f.array()?).map(|view| view.permit)
    }

    async fn authorize(
        &self,
        cmd: &AuthorizeCmd,
        now: Millis,
        attempt_id: String,
    ) -> Result<Authorized, Error> {
        debug_assert_eq!(id_ms(&attempt_id), Some(now), "ids are new_id(now)");
        let k = self.keys(&cmd.permit_id);
        let mut inv = Lua::Authorize.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .key(&k.dup)
            .arg(now)
            .arg(&cmd.tool)
            .arg(&cmd.idempotency_key)
            .arg(&cmd.request_fingerprint)
            .arg(cmd.cost)
            .arg(id_bytes(&attempt_id))
            .arg(&cmd.holder_token);
        let about = About {
            tool: Some(&cmd.tool),
            cost: Some(cmd.cost),
            ..About::key(&cmd.permit_id, &cmd.idempotency_key, now)
        };
        let (verdict, mut f) = open(self.run(&inv).await?, &about)?;
        let (decision, redelivered) = match verdict.as_str() {
            "DISPATCH" => (Decision::Dispatch, false),
            "REDELIVERED" => (Decision::Dispatch, true),
            "REPLAY" => (Decision::Replay, false),
            other => return Err(malformed(format!("verdict {other:?}"))),
        };
        let attempt = decode_attempt(&cmd.permit_id, f.array()?)?;
        let usage = decode_usage(f.array()?)?;
        let duplicate_of = Some(f.string()?).filter(|k| !k.is_empty());
        Ok(Authorized {
            decision,
            attempt,
            usage,
            duplicate_of,
            redelivered,
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
            false,
            &cmd.outcome,
            now,
            receipt_id,
        )
        .await
    }

    async fn mark_uncertain(&self, cmd: &MarkUncertainCmd, now: Millis) -> Result<Attempt, Error> {
        let k = self.keys(&cmd.permit_id);
        let mut inv = Lua::MarkUncertain.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .arg(now)
            .arg(&cmd.idempotency_key)
            .arg(id_bytes(&cmd.attempt_id))
            .arg(&cmd.reason);
        let about = About::key(&cmd.permit_id, &cmd.idempotency_key, now);
        let mut f = open_ok(self.run(&inv).await?, &about)?;
        decode_attempt(&cmd.permit_id, f.array()?)
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
        permit_id: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        now: Millis,
    ) -> Result<Page, Error> {
        let mut page = Page::default();
        if let Some(id) = permit_id {
            let after_key = after.map_or("", |c| c.idempotency_key.as_str());
            let (_, attempts) = self.list_one(id, after_key, limit, now).await?;
            page.attempts = attempts;
            page.next = full_page_cursor(&page.attempts, limit);
            return Ok(page);
        }

        // Across permits: walk the index in id order, one script run per
        // permit, bounded in permits and in time so the page fits well
        // inside the store deadline; a short page carries a cursor on.
        let started = std::time::Instant::now();
        let mut conn = self.conn().await?;
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
                .map_err(|e| self.lost(e))?;
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
                let (removable, attempts) = match self
                    .list_one(&id, after_key, limit - page.attempts.len(), now)
                    .await
                {
                    // Gone with its retention: it leaves the index.
                    Err(Error::PermitNotFound { .. }) => (true, Vec::new()),
                    other => other?,
                };
                if removable {
                    redis::cmd("ZREM")
                        .arg(self.index_key())
                        .arg(&id)
                        .exec_async(&mut conn)
                        .await
                        .map_err(|e| self.lost(e))?;
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

    /// Redis answers, and (read afresh: CONFIG SET or a failover can change
    /// it) does not evict.
    async fn ping(&self) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        redis::cmd("PING")
            .exec_async(&mut conn)
            .await
            .map_err(|e| self.lost(e))?;
        self.eviction.check(&mut conn).await?;
        self.eviction.admit(&mut conn).await
    }
}

impl RedisStore {
    /// Commit (the holder, with its `attempt_id`) and Resolve (an operator,
    /// with the reconciled `attempt_id` or "" for whichever the key holds)
    /// run the same script, as they share the domain's `Ledger::settle`.
    #[allow(clippy::too_many_arguments)]
    async fn settle(
        &self,
        permit_id: &str,
        key: &str,
        attempt_id: &str,
        operator: bool,
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
        let mut inv = Lua::Settle.prepare_invoke();
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
            .arg(if operator { "operator" } else { "holder" })
            .arg(self.retention_ms);
        let mut f = open_ok(self.run(&inv).await?, &About::key(permit_id, key, now))?;
        Ok(Settled {
            attempt: decode_attempt(permit_id, f.array()?)?,
            usage: decode_usage(f.array()?)?,
        })
    }

    /// One permit's uncertain attempts: (may leave the index, attempts).
    async fn list_one(
        &self,
        permit_id: &str,
        after_key: &str,
        limit: usize,
        now: Millis,
    ) -> Result<(bool, Vec<Attempt>), Error> {
        let k = self.keys(permit_id);
        let mut inv = Lua::ListUncertain.prepare_invoke();
        inv.key(&k.permit)
            .key(&k.attempts)
            .key(&k.open)
            .arg(now)
            .arg(after_key)
            .arg(limit)
            .arg(INDEX_SKEW_MARGIN_MS);
        let mut f = open_ok(self.run(&inv).await?, &About::permit(permit_id))?;
        let removable = f.flag()?;
        let mut attempts = Vec::new();
        while !f.done() {
            attempts.push(decode_attempt(permit_id, f.array()?)?);
        }
        Ok((removable, attempts))
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
