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
//! services often disable CONFIG). Where neither tells it (both disabled or
//! not permitted), Redis may be evicting for all atmost knows (managed
//! services often default to `volatile-lru`): it is refused the same way,
//! unless the operator vouches for it (`--allow-unknown-eviction-policy`,
//! or `--allow-eviction`, which accepts any policy).

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
    /// Redis would not say (INFO and CONFIG disabled, renamed or not
    /// permitted), and what each answered.
    Unknown(String),
}

/// The store has not read the policy yet.
const UNCHECKED: u8 = 0;
/// It may serve: `noeviction`, or a policy the operator accepted.
const SERVE: u8 = 1;
/// Redis evicts, or would not say, and the operator did not accept it.
const REFUSE: u8 = 2;

/// The last reading of the policy, shared by the store's clones.
#[derive(Debug, Clone)]
pub(super) struct Guard {
    state: Arc<AtomicU8>,
    /// The policy last read, for logs and for the refusal's message.
    last: Arc<Mutex<Option<Policy>>>,
    allow_eviction: bool,
    allow_unknown: bool,
}

impl Guard {
    /// `allow_eviction`: serve on any policy; `allow_unknown`: serve where
    /// the policy cannot be read.
    pub(super) fn new(allow_eviction: bool, allow_unknown: bool) -> Self {
        Self {
            state: Arc::new(AtomicU8::new(UNCHECKED)),
            last: Arc::new(Mutex::new(None)),
            allow_eviction,
            allow_unknown,
        }
    }

    /// Why the store will not serve on `policy`; `None` when it may.
    pub(super) fn refusal(&self, policy: &Policy) -> Option<String> {
        match policy {
            Policy::NoEviction => None,
            Policy::Evicts(_) if self.allow_eviction => None,
            Policy::Unknown(_) if self.allow_eviction || self.allow_unknown => None,
            Policy::Evicts(name) => Some(refusal(name)),
            Policy::Unknown(why) => Some(unknown_refusal(why)),
        }
    }

    /// Reads the policy and records whether the store may serve on it,
    /// logging each change. Redis unreachable: UNAVAILABLE, nothing recorded.
    pub(super) async fn check(&self, conn: &mut Conn) -> Result<Policy, Error> {
        let policy = read(conn).await?;
        let refused = self.refusal(&policy);
        self.state.store(
            if refused.is_none() { SERVE } else { REFUSE },
            Ordering::SeqCst,
        );
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() != Some(&policy) {
            match (&policy, refused) {
                (Policy::Evicts(name), Some(why)) => tracing::error!(policy = %name, "{why}"),
                (_, Some(why)) => tracing::error!("{why}"),
                (Policy::NoEviction, None) => {
                    tracing::info!("Redis maxmemory-policy is noeviction")
                }
                (Policy::Evicts(name), None) => tracing::warn!(
                    policy = %name,
                    "Redis may evict keys and --allow-eviction accepts it: a finished \
                     attempt evicted under memory pressure lets its key be dispatched again"
                ),
                (Policy::Unknown(why), None) => tracing::warn!(
                    %why,
                    "Redis would not tell its maxmemory-policy, and {} accepts it: unless \
                     it is noeviction, a finished attempt evicted under memory pressure lets \
                     its key be dispatched again",
                    if self.allow_unknown {
                        "--allow-unknown-eviction-policy"
                    } else {
                        "--allow-eviction"
                    }
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
                let why = last
                    .as_ref()
                    .and_then(|policy| self.refusal(policy))
                    .unwrap_or_else(|| refusal("not noeviction"));
                Err(Error::StoreUnavailable(why))
            }
        }
    }
}

/// Why atmost will not serve on an evicting Redis, and what to do about it.
fn refusal(policy: &str) -> String {
    format!(
        "Redis's maxmemory-policy is {policy}: under memory pressure it may evict a \
         finished attempt, and a retry of its key would then be dispatched again (a double \
         charge). Set maxmemory-policy noeviction (redis.conf, or CONFIG SET \
         maxmemory-policy noeviction), or start atmost with --allow-eviction to accept the risk"
    )
}

/// Why atmost will not serve on a Redis that would not tell its policy
/// (`why`: what INFO and CONFIG answered), and what to do about it.
fn unknown_refusal(why: &str) -> String {
    format!(
        "Redis would not tell its maxmemory-policy ({why}): unless it is noeviction, Redis \
         may evict a finished attempt under memory pressure, and a retry of its key would \
         then be dispatched again (a double charge). Grant atmost's Redis user +info (INFO \
         memory shows the policy), or make sure the policy is noeviction and start atmost \
         with --allow-unknown-eviction-policy to accept the risk"
    )
}

/// The policy, from `INFO memory` (which an ACL can grant without CONFIG
/// GET, whose `*` would also show other settings, passwords included), or
/// else from `CONFIG GET maxmemory-policy`. A server that answers both with
/// an error (disabled, no permission) or without the policy gives
/// [`Policy::Unknown`]; one that does not answer, UNAVAILABLE.
async fn read(conn: &mut Conn) -> Result<Policy, Error> {
    let info = match conn.info("memory").await {
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
            "INFO memory has no maxmemory_policy".to_owned()
        }
        Err(e) if matches!(e.code(), Some("ERR" | "NOPERM")) => format!("INFO memory: {e}"),
        Err(e) => return Err(unavailable(e)),
    };
    Ok(match read_config(conn).await? {
        Policy::Unknown(config) => Policy::Unknown(format!("{info}; {config}")),
        known => known,
    })
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
        Err(e) if matches!(e.code(), Some("ERR" | "NOPERM")) => {
            Ok(Policy::Unknown(format!("CONFIG GET: {e}")))
        }
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
    use super::{Guard, Policy, info_policy, policy_name};
    use redis::Value;

    #[test]
    fn a_policy_redis_will_not_tell_is_refused_unless_accepted() {
        let unknown = Policy::Unknown("INFO memory: NOPERM; CONFIG GET: NOPERM".into());
        let evicts = Policy::Evicts("volatile-lru".into());
        let refused = |guard: &Guard, policy: &Policy| guard.refusal(policy).is_some();
        let strict = Guard::new(false, false);
        assert!(!refused(&strict, &Policy::NoEviction));
        assert!(refused(&strict, &evicts));
        let why = strict.refusal(&unknown).expect("refused");
        assert!(why.contains("--allow-unknown-eviction-policy") && why.contains("+info"));
        assert!(why.contains("INFO memory: NOPERM"), "{why}");
        // Vouched for: the unknown one only.
        let vouched = Guard::new(false, true);
        assert!(!refused(&vouched, &unknown));
        assert!(refused(&vouched, &evicts));
        // Any policy accepted, an unknown one too.
        let any = Guard::new(true, false);
        assert!(!refused(&any, &unknown) && !refused(&any, &evicts));
    }

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
