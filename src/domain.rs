//! The pure, I/O-free model of atmost: permits, attempts, the state machine
//! and the order of checks. Nothing here touches the network, a clock or a
//! random number generator; callers pass `now` and fresh ids in.
//!
//! [`Ledger`] is the reference semantics: the memory store runs it directly,
//! and the Redis store's Lua scripts are a line-by-line translation of it,
//! held to the same behaviour by the shared test suite.

mod attempt;
mod clock;
mod error;
mod ledger;
mod permit;
mod quota;

pub use attempt::{
    APPROVAL_EXPIRED, APPROVAL_UNCLAIMED, Approval, ApproveCmd, Attempt, AttemptState,
    AuthorizeCmd, Authorized, CommitCmd, DENIED, Decision, DenyCmd, GetAttemptCmd, MAX_SUMMARY_LEN,
    MarkUncertainCmd, Outcome, PERMIT_REVOKED, Receipt, ResolveCmd, Settled, validate_permit_id,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{Error, Quota, Reason, Violation};
pub use ledger::{Ledger, OpenChange};
pub use permit::{
    ApprovalRule, ApprovalRuleSpec, ApprovalWaits, DuplicateGuard, GuardMode, MAX_AGENTS, Permit,
    PermitSpec, PermitStatus, PermitView, Scope, UncertainPolicy, Usage,
};
pub use quota::Quotas;

/// Milliseconds since the Unix epoch: the one time unit of the model.
pub type Millis = i64;

/// Largest amount (cost, budget) accepted: 2^53 - 1, so that every sum stays
/// exact in the Redis store's Lua numbers (IEEE doubles).
pub const MAX_AMOUNT: i64 = (1 << 53) - 1;
/// Largest `Succeeded.result`, in bytes.
pub const MAX_RESULT_BYTES: usize = 64 * 1024;
/// Most tools one permit may scope.
pub const MAX_TOOLS: usize = 256;
/// Longest idempotency key, in bytes.
pub const MAX_KEY_LEN: usize = 255;
/// Longest tool name, in bytes.
pub const MAX_TOOL_LEN: usize = 128;
/// Longest request fingerprint, in bytes.
pub const MAX_FINGERPRINT_LEN: usize = 64;
/// Longest holder token, in bytes.
pub const MAX_HOLDER_TOKEN_LEN: usize = 64;
/// Longest free-text field (subject, failure and uncertain reasons), in bytes.
pub const MAX_TEXT_LEN: usize = 1024;
/// Default lease of a dispatch before it is presumed uncertain.
pub const DEFAULT_LEASE_MS: Millis = 30_000;
/// Default duplicate-guard window.
pub const DEFAULT_GUARD_WINDOW_MS: Millis = 10 * 60_000;
/// Longest lease or guard window accepted: 7 days.
pub const MAX_DURATION_MS: Millis = 7 * 24 * 3_600_000;
/// The latest instant a timestamp may name: 9999-12-31T23:59:59.999Z.
pub const MAX_TIMESTAMP_MS: Millis = 253_402_300_799_999;
/// Longest `--retention`: 10 years of 365.25 days (humantime's `10y`).
pub const MAX_RETENTION_MS: Millis = 10 * 31_557_600_000;
// Every expiry plus retention (the Redis store's PEXPIREAT, in Lua numbers)
// stays exact and far from overflow: below 2^53.
const _: () = assert!(MAX_TIMESTAMP_MS + MAX_RETENTION_MS < MAX_AMOUNT);

/// The uncertain reason of a RESERVED attempt whose lease has passed.
pub const LEASE_EXPIRED: &str = "lease_expired";
/// The uncertain reason stored when MarkUncertain gives none.
pub const MARKED_UNCERTAIN: &str = "marked_uncertain";

/// Checks a key id or a tenant name: 1..=64 of `[A-Za-z0-9._-]`, safe in
/// logs, metadata and Redis key names.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Checks a tool name: 1..=128 of `[A-Za-z0-9._:/-]`.
pub fn valid_tool(tool: &str) -> bool {
    !tool.is_empty()
        && tool.len() <= MAX_TOOL_LEN
        && tool
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'/' | b'-'))
}

/// Checks an idempotency key: 1..=255 printable ASCII characters.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Parses an id that must be a UUID and returns it in canonical form
/// (lower-case, hyphenated). Ids become parts of store keys, so nothing but
/// a canonical UUID may pass. Every way of writing the same UUID is that
/// UUID: hyphenated, 32 hex digits, braced, or as a URN, in either case.
pub fn canonical_id(id: &str) -> Option<String> {
    // A URN's "urn:" and its namespace are case-insensitive (RFC 8141), so
    // "URN:UUID:..." names the same UUID as "urn:uuid:...", which is all
    // the uuid crate reads. A URN holds the hyphenated form only.
    const URN: &str = "urn:uuid:";
    let id = match id.get(..URN.len()) {
        Some(prefix) if prefix.eq_ignore_ascii_case(URN) => {
            let uuid = &id[URN.len()..];
            if uuid.len() != 36 {
                return None;
            }
            uuid
        }
        _ => id,
    };
    uuid::Uuid::try_parse(id)
        .ok()
        .map(|u| u.hyphenated().to_string())
}

/// A fresh UUIDv7 for a permit, attempt or receipt, whose timestamp is
/// `now` (not the system time, so an injected clock governs it too): the
/// Redis store reads an attempt's creation time and a receipt's issue time
/// from their ids instead of storing each twice.
pub fn new_id(now: Millis) -> String {
    let ms = u64::try_from(now).unwrap_or(0);
    let ts = uuid::Timestamp::from_unix(uuid::NoContext, ms / 1000, (ms % 1000) as u32 * 1_000_000);
    uuid::Uuid::new_v7(ts).hyphenated().to_string()
}

/// Collects field violations and turns them into one [`Error::InvalidRequest`].
#[derive(Debug, Default)]
pub(crate) struct Violations(Vec<Violation>, usize);

/// Most field violations one error reports; the rest are counted in one
/// last violation, so an error stays a few KiB whatever the input.
pub const MAX_VIOLATIONS: usize = 16;

/// A value from a request, as an error may echo it: escaped, and at most
/// 48 characters of that, with its length when it is cut. (48 escaped, not
/// 48 of the value: one character may escape to ten, `\u{10ffff}`.)
pub fn shown(value: &str) -> String {
    const PREFIX: usize = 48;
    let mut escaped = String::new();
    for c in value.chars() {
        let e = c.escape_debug();
        if escaped.len() + e.clone().map(char::len_utf8).sum::<usize>() > PREFIX {
            return format!("\"{escaped}\"... ({} bytes)", value.len());
        }
        escaped.extend(e);
    }
    format!("\"{escaped}\"")
}

impl Violations {
    pub(crate) fn check(&mut self, ok: bool, field: &str, description: impl Into<String>) {
        if !ok {
            self.push(field, || description.into());
        }
    }

    /// [`Violations::check`] whose description is only made when it is
    /// reported (in loops over a request's many values).
    pub(crate) fn check_with(
        &mut self,
        ok: bool,
        field: &str,
        description: impl FnOnce() -> String,
    ) {
        if !ok {
            self.push(field, description);
        }
    }

    fn push(&mut self, field: &str, description: impl FnOnce() -> String) {
        if self.0.len() < MAX_VIOLATIONS {
            self.0.push(Violation {
                field: field.to_owned(),
                description: description(),
            });
        } else {
            self.1 += 1;
        }
    }

    pub(crate) fn into_result(mut self) -> Result<(), Error> {
        if self.1 > 0 {
            self.0.push(Violation {
                field: "request".into(),
                description: format!("and {} more violations", self.1),
            });
        }
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidRequest(self.0))
        }
    }
}

/// One violation as a finished error, for checks that find a single problem.
pub(crate) fn invalid(field: &str, description: impl Into<String>) -> Error {
    Error::InvalidRequest(vec![Violation {
        field: field.to_owned(),
        description: description.into(),
    }])
}

#[cfg(test)]
mod tests;
