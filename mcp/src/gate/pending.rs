//! The calls awaiting approval under a key the proxy chose itself (derived
//! from the session, or fresh), so that the agent's retry of the same call
//! finds that key again.
//!
//! An agent told "awaiting approval, make the same call again later"
//! retries with the same tool and arguments, but in a new JSON-RPC request
//! (a new id, so a new derived key) or with no session at all (a fresh
//! key): it would ask again under another key, which a person would have
//! to approve anew, while the approved one lapsed unclaimed. So while a
//! call awaits approval, a call without a key of the agent's own that is
//! the same call (the same permit, the same fingerprint of tool and
//! arguments, in the same session, or in none) takes its key. An agent
//! that sends its own key never goes through here: its key is already
//! the same on every retry.
//!
//! The entries live in the proxy's memory only: after a restart, a
//! keyless retry is a new request (the old one lapses), unless the agent
//! sends the key it was told in `_meta`.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

/// The most calls remembered at once; past it, the one that lapses first
/// is forgotten (its agent's retry becomes a new request).
const MAX_CALLS: usize = 10_000;
/// How long an entry outlives its request's lapse: an approved call may be
/// claimed a lease past it, and a retry after the lapse should hear the
/// lapse (the key's DENIED) rather than ask anew at once.
const GRACE_MS: i64 = 3_600_000;
/// The lapse taken when atmost gave none: its longest approval wait.
const UNKNOWN_LAPSE_MS: i64 = 7 * 24 * 3_600_000;

/// What makes two calls the same call here.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Call {
    /// The session the call was served in; none for a call in no session.
    session: Option<String>,
    permit: String,
    /// The request's fingerprint (tool name and arguments).
    fingerprint: Vec<u8>,
}

impl Call {
    pub fn new(session: Option<String>, permit: &str, fingerprint: &[u8]) -> Self {
        Self {
            session,
            permit: permit.to_owned(),
            fingerprint: fingerprint.to_vec(),
        }
    }
}

struct Entry {
    key: String,
    /// Forgotten from then on (ms since the Unix epoch).
    until_ms: i64,
}

/// The calls awaiting approval, each with its key.
#[derive(Default)]
pub struct Pending(Mutex<HashMap<Call, Entry>>);

impl Pending {
    /// The key of the same call awaiting approval, if there is one.
    pub fn key(&self, call: &Call, now_ms: i64) -> Option<String> {
        let mut calls = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match calls.get(call) {
            Some(entry) if entry.until_ms > now_ms => Some(entry.key.clone()),
            Some(_) => {
                calls.remove(call);
                None
            }
            None => None,
        }
    }

    /// `call` awaits approval under `key` until `expires_at_ms` (0:
    /// unknown).
    pub fn awaiting(&self, call: Call, key: &str, expires_at_ms: i64, now_ms: i64) {
        let lapse = if expires_at_ms > 0 {
            expires_at_ms
        } else {
            now_ms.saturating_add(UNKNOWN_LAPSE_MS)
        };
        let mut calls = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !calls.contains_key(&call) && calls.len() >= MAX_CALLS {
            calls.retain(|_, e| e.until_ms > now_ms);
            if calls.len() >= MAX_CALLS
                && let Some(first) = calls
                    .iter()
                    .min_by_key(|(_, e)| e.until_ms)
                    .map(|(c, _)| c.clone())
            {
                calls.remove(&first);
            }
        }
        calls.insert(
            call,
            Entry {
                key: key.to_owned(),
                until_ms: lapse.saturating_add(GRACE_MS),
            },
        );
    }

    /// The call under `key` no longer awaits approval (sent, replayed,
    /// denied, lapsed...): the next same call is a new one.
    pub fn settled(&self, call: &Call, key: &str) {
        let mut calls = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if calls.get(call).is_some_and(|e| e.key == key) {
            calls.remove(call);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(session: Option<&str>, fingerprint: u8) -> Call {
        Call::new(session.map(str::to_owned), "p", &[fingerprint; 32])
    }

    #[test]
    fn the_same_call_finds_the_key_until_it_is_settled() {
        let pending = Pending::default();
        let now = 1_000_000;
        assert_eq!(pending.key(&call(Some("s"), 1), now), None);
        pending.awaiting(call(Some("s"), 1), "mcp:s:1", now + 60_000, now);
        assert_eq!(
            pending.key(&call(Some("s"), 1), now + 1).as_deref(),
            Some("mcp:s:1")
        );
        // Another session, no session, other arguments, another permit:
        // not the same call.
        assert_eq!(pending.key(&call(Some("t"), 1), now), None);
        assert_eq!(pending.key(&call(None, 1), now), None);
        assert_eq!(pending.key(&call(Some("s"), 2), now), None);
        assert_eq!(
            pending.key(&Call::new(Some("s".into()), "q", &[1; 32]), now),
            None
        );
        // Settled under another key (a newer entry replaced it): kept.
        pending.settled(&call(Some("s"), 1), "mcp:s:9");
        assert!(pending.key(&call(Some("s"), 1), now).is_some());
        pending.settled(&call(Some("s"), 1), "mcp:s:1");
        assert_eq!(pending.key(&call(Some("s"), 1), now), None);
    }

    #[test]
    fn an_entry_outlives_its_lapse_by_the_grace_only() {
        let pending = Pending::default();
        let now = 1_000_000;
        pending.awaiting(call(None, 1), "mcp:fresh:a", now + 1_000, now);
        assert!(
            pending
                .key(&call(None, 1), now + 1_000 + GRACE_MS - 1)
                .is_some()
        );
        assert_eq!(pending.key(&call(None, 1), now + 1_000 + GRACE_MS), None);
        assert_eq!(pending.len(), 0, "a lapsed entry is dropped when found");
        // No lapse known: atmost's longest wait.
        pending.awaiting(call(None, 2), "mcp:fresh:b", 0, now);
        assert!(
            pending
                .key(&call(None, 2), now + UNKNOWN_LAPSE_MS + GRACE_MS - 1)
                .is_some()
        );
    }

    #[test]
    fn past_the_limit_the_first_to_lapse_is_forgotten() {
        let pending = Pending::default();
        let now = 1_000_000;
        for n in 0..MAX_CALLS {
            let call = Call::new(None, "p", &n.to_be_bytes());
            pending.awaiting(call, &format!("k{n}"), now + 10_000 + n as i64, now);
        }
        pending.awaiting(call(None, 7), "new", now + 5_000_000, now);
        assert_eq!(pending.len(), MAX_CALLS);
        assert_eq!(
            pending.key(&Call::new(None, "p", &0usize.to_be_bytes()), now),
            None
        );
        assert!(
            pending
                .key(&Call::new(None, "p", &1usize.to_be_bytes()), now)
                .is_some()
        );
        assert_eq!(pending.key(&call(None, 7), now).as_deref(), Some("new"));
    }
}
