//! The audit trail's events: one per state-changing RPC, written by
//! [`crate::audit`] (a JSON line each), whatever its answer: who called (the key's id
//! and tenant, never the key), which RPC, about which permit, tool and
//! idempotency key, what was decided (the decision or the attempt's state,
//! or the reason it was refused) and the attempt's id. Never a fingerprint,
//! a result or a secret.
//!
//! A request the caller abandons (it reset the stream, or its deadline
//! passed) while its store call was under way may still have been applied:
//! its event says `CANCELLED` when the handler is dropped.
//!
//! Values a caller chose are percent-encoded (any byte outside
//! `[A-Za-z0-9._:/-]`), so in text logs they hold no space, `=` or quote,
//! and cannot forge a field or a line.

use crate::auth::Identity;
use crate::domain::{Attempt, Error};
use std::fmt::Write;
use std::sync::Arc;

/// The caller of one RPC, taken before its request is consumed. Records
/// its event once: with [`Audit::record`], or as `CANCELLED` when dropped
/// before that.
pub struct Audit {
    rpc: &'static str,
    /// Whether the trail is on (`--audit-log`): when it is off, nothing is
    /// copied or formatted for it.
    enabled: bool,
    caller: Option<Arc<Identity>>,
    /// What the request is about ([`clean`]ed), for the event of a
    /// cancelled request.
    about: Option<(String, String, String)>,
}

/// The most bytes of one caller's value an event writes: every valid
/// value (a key is at most 255 bytes) fits; a longer, invalid one is cut
/// and its length given, so no request makes a long log line.
const MAX_LOGGED: usize = 256;

/// A caller's value, percent-encoded outside `[A-Za-z0-9._:/-]`, at most
/// [`MAX_LOGGED`] bytes of it.
fn clean(value: &str) -> String {
    let shown = &value.as_bytes()[..value.len().min(MAX_LOGGED)];
    let mut out = String::with_capacity(shown.len() + 16);
    for &b in shown {
        if b.is_ascii_alphanumeric() || b"._:/-".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    if value.len() > MAX_LOGGED {
        let _ = write!(out, "...({}%20bytes)", value.len());
    }
    out
}

/// The RPCs that write an event: their handlers each open an [`Audit`],
/// and the HTTP/JSON edge one for a request it could not make into theirs.
pub const AUDITED: [&str; 8] = [
    "Authorize",
    "Commit",
    "MarkUncertain",
    "CreatePermit",
    "RevokePermit",
    "Resolve",
    "Approve",
    "Deny",
];

impl Audit {
    pub fn of<T>(rpc: &'static str, request: &tonic::Request<T>) -> Self {
        Self::by(rpc, request.extensions().get::<Arc<Identity>>().cloned())
    }

    /// The event of `rpc` called by `caller` (`None`: dev mode).
    pub fn by(rpc: &'static str, caller: Option<Arc<Identity>>) -> Self {
        debug_assert!(AUDITED.contains(&rpc), "{rpc} is not in AUDITED");
        Self {
            rpc,
            enabled: crate::audit::enabled(),
            caller,
            about: None,
        }
    }

    /// What the request is about, known before the store is asked: the
    /// event of a request cancelled meanwhile names it.
    pub fn about(&mut self, permit_id: &str, tool: &str, idempotency_key: &str) {
        if !self.enabled {
            return;
        }
        self.about = Some((clean(permit_id), clean(tool), clean(idempotency_key)));
    }

    /// Records the RPC's answer: `outcome` is the decision, the attempt's
    /// state, or the refusal's reason name.
    pub fn record(
        mut self,
        permit_id: &str,
        tool: &str,
        idempotency_key: &str,
        outcome: &str,
        attempt_id: &str,
    ) {
        self.about = None;
        // The same answer, for the RPC's span and metrics.
        crate::telemetry::note(permit_id, tool, outcome);
        if !self.enabled {
            return;
        }
        self.emit(
            &clean(permit_id),
            &clean(tool),
            &clean(idempotency_key),
            outcome,
            attempt_id,
        );
    }

    /// Records a call about one attempt (Commit, MarkUncertain, Resolve):
    /// its state, or the reason it was refused.
    pub fn attempt(self, permit_id: &str, idempotency_key: &str, result: Result<&Attempt, &Error>) {
        match result {
            // The permit's id as atmost wrote it, however the caller did.
            Ok(a) => self.record(
                &a.permit_id,
                &a.tool,
                idempotency_key,
                a.state.as_str(),
                &a.attempt_id,
            ),
            Err(e) => self.record(permit_id, "", idempotency_key, e.reason().as_str(), ""),
        }
    }

    /// Writes the event; the caller's values already [`clean`]ed.
    fn emit(
        &self,
        permit_id: &str,
        tool: &str,
        idempotency_key: &str,
        outcome: &str,
        attempt_id: &str,
    ) {
        let (key_id, tenant) = match &self.caller {
            Some(c) => (c.key_id.as_str(), c.tenant.as_str()),
            None => ("", ""),
        };
        crate::audit::record(&crate::audit::Event {
            rpc: self.rpc,
            key_id,
            tenant,
            permit_id,
            tool,
            idempotency_key,
            outcome,
            attempt_id,
        });
    }
}

impl Drop for Audit {
    fn drop(&mut self) {
        if let Some((permit_id, tool, key)) = self.about.take() {
            self.emit(&permit_id, &tool, &key, "CANCELLED", "");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::clean;

    #[test]
    fn a_callers_value_cannot_forge_a_field() {
        assert_eq!(clean("charge-42"), "charge-42");
        assert_eq!(
            clean("k outcome=REPLAY \"x\"\n"),
            "k%20outcome%3DREPLAY%20%22x%22%0A"
        );
        assert_eq!(clean("é"), "%C3%A9");
    }

    #[test]
    fn a_long_value_is_cut_and_its_length_given() {
        let long = "x".repeat(1 << 20);
        let logged = clean(&long);
        assert_eq!(logged, format!("{}...(1048576%20bytes)", "x".repeat(256)));
        // Every valid key is written whole.
        let key = "~".repeat(255);
        assert_eq!(clean(&key), "%7E".repeat(255));
    }
}
