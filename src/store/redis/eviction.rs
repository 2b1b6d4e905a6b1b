//! Whether Redis may evict atmost's keys. Under memory pressure any
//! `maxmemory-policy` but `noeviction` deletes keys: `volatile-*` those with
//! a TTL, which includes a permit's finished attempts, so a retry of a
//! SUCCEEDED key would find no record and be dispatched again (a double
//! charge); `allkeys-*` even RESERVED and UNCERTAIN attempts. With
//! `noeviction`, a write past `maxmemory` fails whole (every writing script
//! opens with a `#!lua` line, so Redis refuses it before it runs) and
//! atmost answers UNAVAILABLE.
//!
//! The store reads the policy before it serves anything, again with every
//! health check (every second), since `CONFIG SET` can change it, and again
//! before the next operation after a broken connection, since a restart or a
//! failover can: on an evicting Redis it answers UNAVAILABLE and health turns
//! NOT_SERVING, unless the operator accepted the risk (`--allow-eviction`).
//! The policy is read from `INFO memory`, or else `CONFIG GET` (managed
//! services often disable CONFIG); where neither answers, the policy cannot
//! be read: it serves and says so loudly.

use super::conn::Conn;
use super::conn::unavailable;
use crate::domain::Error;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// What Redis says of its eviction policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Policy {
    /// `noeviction`: nothing is ever evicted.
    NoEviction,
    /// Any other policy, by name: Redis deletes keys under memory pressure.
    Evicts(String),
    /// Redis would not say (CONFIG disabled, renamed or not permitted), and why.
    Unknown(String),
}

/// The store has not read the policy yet.
const UNCHECKED: u8 = 0;
/// It may serve: `noeviction`, eviction accepted, or a policy it cannot read.
const SERVE: u8 = 1;
/// Redis evicts, and the operator did not accept it.
const REFUSE: u8 = 2;

/// The last reading of the policy, shared by the store's clones.
#[derive(Debug, Clone)]
pub(super) struct Guard {
    state: Arc<AtomicU8>,
    /// The policy last read, for logs and for the refusal's message.
    last: Arc<Mutex<Option<Policy>>>,
    allow_eviction: bool,
}

impl Guard {
    pub(super) fn new(allow_eviction: bool) -> Self {
        Self {
            state: Arc::new(AtomicU8::new(UNCHECKED)),
            last: Arc::new(Mutex::new(None)),
            allow_eviction,
        }
    }

    /// Reads the policy and records whether the store may serve on it,
    /// logging each change. Redis unreachable: UNAVAILABLE, nothing recorded.
    pub(super) async fn check(&self, conn: &mut Conn) -> Result<Policy, Error> {
        let policy = read(conn).await?;
        let serve = match &policy {
            Policy::NoEviction | Policy::Unknown(_) => true,
            Policy::Evicts(_) => self.allow_eviction,
        };
        self.state
            .store(if serve { SERVE } else { REFUSE }, Ordering::SeqCst);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() != Some(&policy) {
            match &policy {
                Policy::NoEviction => tracing::info!("Redis maxmemory-policy is noeviction"),
                Policy::Evicts(name) if serve => tracing::warn!(
                    policy = %name,
                    "Redis may evict keys and --allow-eviction accepts it: a finished \
                     attempt evicted under memory pressure lets its key be dispatched again"
                ),
                Policy::Evicts(name) => tracing::error!(
                    policy = %name,
                    "{}", refusal(name)
                ),
                Policy::Unknown(why) => tracing::warn!(
                    %why,
                    "could not read Redis's maxmemory-policy; serving anyway: make sure it is \
                     noeviction, or a finished attempt evicted under memory pressure lets its \
                     key be dispatched again"
                ),
            }
            *last = Some(policy.clone());
        }
        Ok(policy)
    }

    /// The connection broke: whatever answers next (a restarted Redis, a
    /// promoted replica) is read again before anything runs on it.
    pub(super) fn forget(&self) {
        self.state.store(UNCHECKED, Ordering::SeqCst);
    }

    /// Ok when the store may serve. Until the policy has been read once,
    /// reads it first: nothing runs on a Redis not yet known to keep keys.
    pub(super) async fn admit(&self, conn: &mut Conn) -> Result<(), Error> {
        if self.state.load(Ordering::Relaxed) == UNCHECKED {
            self.check(conn).await?;
        }
        match self.state.load(Ordering::Relaxed) {
            SERVE => Ok(()),
            _ => {
                let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
                let name = match last.as_ref() {
                    Some(Policy::Evicts(name)) => name.as_str(),
                    _ => "not noeviction",
                };
                Err(Error::StoreUnavailable(refusal(name)))
            }
        }
    }
}

/// Why atmost will not serve on an evicting Redis, and what to do about it.
pub fn refusal(policy: &str) -> String {
    format!(
        "Redis's maxmemory-policy is {policy}: under memory pressure it may evict a \
         finished attempt, and a retry of its key would then be dispatched again (a double \
         charge). Set maxmemory-policy noeviction (redis.conf, or CONFIG SET \
         maxmemory-policy noeviction), or start atmost with --allow-eviction to accept the risk"
    )
}

/// The policy, from `INFO memory` (which an ACL can grant without CONFIG
/// GET, whose `*` would also show other settings, passwords included), or
/// else from `CONFIG GET maxmemory-policy`. A server that answers both with
/// an error (disabled, no permission) gives [`Policy::Unknown`]; one that
/// does not answer, UNAVAILABLE.
async fn read(conn: &mut Conn) -> Result<Policy, Error> {
    match conn.info("memory").await {
        Ok(texts) => {
            // Each primary's (a Cluster's shards each have their own): one
            // that evicts decides.
            let names: Option<Vec<&str>> = texts.iter().map(|t| info_policy(t)).collect();
            if let Some(names) = names.filter(|n| !n.is_empty()) {
                return Ok(match names.into_iter().find(|name| *name != "noeviction") {
                    None => Policy::NoEviction,
                    Some(name) => Policy::Evicts(name.to_owned()),
                });
            }
        }
        Err(e) if matches!(e.code(), Some("ERR" | "NOPERM")) => {}
        Err(e) => return Err(unavailable(e)),
    }
    read_config(conn).await
}

/// `maxmemory_policy` in an `INFO memory` reply.
fn info_policy(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|l| l.strip_prefix("maxmemory_policy:"))
        .map(str::trim)
        .filter(|name| !name.is_empty())
}

/// `CONFIG GET maxmemory-policy`.
async fn read_config(conn: &mut Conn) -> Result<Policy, Error> {
    let reply: Result<redis::Value, redis::RedisError> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    match reply {
        // [name, value] over RESP2, {name: value} over RESP3.
        Ok(value) => Ok(match policy_name(value).as_deref() {
            Some("noeviction") => Policy::NoEviction,
            Some(name) => Policy::Evicts(name.to_owned()),
            None => Policy::Unknown("CONFIG GET maxmemory-policy answered nothing".into()),
        }),
        Err(e) if matches!(e.code(), Some("ERR" | "NOPERM")) => Ok(Policy::Unknown(e.to_string())),
        Err(e) => Err(unavailable(e)),
    }
}

/// The value of `CONFIG GET maxmemory-policy`'s one pair.
fn policy_name(reply: redis::Value) -> Option<String> {
    use redis::Value;
    let value = match reply {
        Value::Array(mut pair) if pair.len() == 2 => pair.pop()?,
        Value::Map(mut pairs) if pairs.len() == 1 => pairs.pop()?.1,
        _ => return None,
    };
    match value {
        Value::BulkString(b) => String::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{info_policy, policy_name};
    use redis::Value;

    #[test]
    fn the_policy_is_read_from_info_memory() {
        let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:volatile-lru\r\n";
        assert_eq!(info_policy(info), Some("volatile-lru"));
        assert_eq!(info_policy("# Memory\r\n"), None);
    }

    #[test]
    fn the_policy_is_read_from_resp2_and_resp3_replies() {
        let name = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let resp2 = Value::Array(vec![name("maxmemory-policy"), name("noeviction")]);
        let resp3 = Value::Map(vec![(name("maxmemory-policy"), name("allkeys-lru"))]);
        assert_eq!(policy_name(resp2).as_deref(), Some("noeviction"));
        assert_eq!(policy_name(resp3).as_deref(), Some("allkeys-lru"));
        assert_eq!(policy_name(Value::Array(vec![])), None);
        assert_eq!(policy_name(Value::Nil), None);
    }
}
