//! Conversions between the wire types of `atmost.v1` and the domain.
//! Decoding never validates business rules (the domain does); it only
//! reports what cannot even be represented (a missing oneof, a timestamp
//! out of range) as an INVALID_REQUEST field violation.

use crate::domain::{
    self, ApprovalRuleSpec, ApprovalWaits, ApproveCmd, AttemptState, AuthorizeCmd, CommitCmd,
    DenyCmd, Error, GetAttemptCmd, GuardMode, MarkUncertainCmd, Millis, Outcome, PermitSpec,
    PermitStatus, ResolveCmd, UncertainPolicy, invalid,
};
use crate::pb;
use crate::receipts::{Encoding, ReceiptKeys};
use crate::store::Cursor;
use prost_types::{Duration, Timestamp};

// === time ===

/// The latest whole second accepted: 9999-12-31T23:59:59Z.
const MAX_SECONDS: i64 = domain::MAX_TIMESTAMP_MS / 1000;

pub fn timestamp(ms: Millis) -> Timestamp {
    Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn millis_of_timestamp(t: &Timestamp, field: &str) -> Result<Millis, Error> {
    if !(0..=MAX_SECONDS).contains(&t.seconds) || !(0..1_000_000_000).contains(&t.nanos) {
        return Err(invalid(field, "out of range"));
    }
    Ok(t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)
}

pub fn duration(ms: Millis) -> Duration {
    Duration {
        seconds: ms / 1000,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

pub fn millis_of_duration(d: &Duration, field: &str) -> Result<Millis, Error> {
    if !(0..=domain::MAX_DURATION_MS / 1000).contains(&d.seconds)
        || !(0..1_000_000_000).contains(&d.nanos)
    {
        return Err(invalid(field, "must be positive and at most 7 days"));
    }
    Ok(d.seconds * 1000 + i64::from(d.nanos) / 1_000_000)
}

// === requests ===

pub fn authorize_cmd(r: pb::AuthorizeRequest) -> AuthorizeCmd {
    AuthorizeCmd {
        permit_id: r.permit_id,
        tool: r.tool,
        idempotency_key: r.idempotency_key,
        request_fingerprint: r.request_fingerprint,
        cost: r.cost,
        holder_token: r.holder_token,
        approval_summary: r.approval_summary,
    }
}

/// How long an Authorize may wait for an approval's decision.
pub const MAX_APPROVAL_WAIT_MS: Millis = 60_000;

/// AuthorizeRequest.wait: 0 (absent) to 60 s.
pub fn approval_wait(r: &pb::AuthorizeRequest) -> Result<Millis, Error> {
    let Some(wait) = &r.wait else { return Ok(0) };
    match millis_of_duration(wait, "wait") {
        Ok(ms) if ms <= MAX_APPROVAL_WAIT_MS => Ok(ms),
        _ => Err(invalid("wait", "must be within 0..=60 s")),
    }
}

pub fn approve_cmd(r: pb::ApproveRequest) -> ApproveCmd {
    ApproveCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
        attempt_id: r.attempt_id,
    }
}

pub fn deny_cmd(r: pb::DenyRequest) -> DenyCmd {
    DenyCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
        attempt_id: r.attempt_id,
        reason: r.reason,
    }
}

fn succeeded(s: pb::Succeeded) -> Outcome {
    Outcome::Succeeded {
        result: s.result,
        actual_cost: s.actual_cost,
    }
}

fn failed(f: pb::Failed) -> Outcome {
    Outcome::Failed { reason: f.reason }
}

pub fn commit_cmd(r: pb::CommitRequest) -> Result<CommitCmd, Error> {
    use pb::commit_request::Outcome as O;
    let outcome = match r.outcome {
        Some(O::Succeeded(s)) => succeeded(s),
        Some(O::Failed(f)) => failed(f),
        Some(O::NotSent(_)) => Outcome::NotSent,
        None => {
            return Err(invalid(
                "outcome",
                "one of succeeded, failed or not_sent is required",
            ));
        }
    };
    Ok(CommitCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
        attempt_id: r.attempt_id,
        outcome,
    })
}

pub fn mark_uncertain_cmd(r: pb::MarkUncertainRequest) -> MarkUncertainCmd {
    MarkUncertainCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
        attempt_id: r.attempt_id,
        reason: r.reason,
    }
}

pub fn get_attempt_cmd(r: pb::GetAttemptRequest) -> GetAttemptCmd {
    GetAttemptCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
    }
}

pub fn resolve_cmd(r: pb::ResolveRequest) -> Result<ResolveCmd, Error> {
    use pb::resolve_request::Outcome as O;
    let outcome = match r.outcome {
        Some(O::Succeeded(s)) => succeeded(s),
        Some(O::Failed(f)) => failed(f),
        Some(O::NotSent(_)) => Outcome::NotSent,
        None => {
            return Err(invalid(
                "outcome",
                "one of succeeded, failed or not_sent is required",
            ));
        }
    };
    Ok(ResolveCmd {
        permit_id: r.permit_id,
        idempotency_key: r.idempotency_key,
        attempt_id: r.attempt_id,
        outcome,
    })
}

/// A permit as CreatePermit asks for it; `waits` are the server's bounds on
/// an approval's wait.
pub fn permit_spec(p: Option<pb::Permit>, waits: ApprovalWaits) -> Result<PermitSpec, Error> {
    let p = p.ok_or_else(|| invalid("permit", "is required"))?;
    let guard = p.duplicate_guard.unwrap_or_default();
    let guard_mode = match pb::DuplicateGuardMode::try_from(guard.mode) {
        Ok(pb::DuplicateGuardMode::Unspecified) => None,
        Ok(pb::DuplicateGuardMode::Off) => Some(GuardMode::Off),
        Ok(pb::DuplicateGuardMode::Log) => Some(GuardMode::Log),
        Ok(pb::DuplicateGuardMode::Enforce) => Some(GuardMode::Enforce),
        Err(_) => return Err(invalid("permit.duplicate_guard.mode", "unknown mode")),
    };
    let uncertain_policy = match pb::UncertainPolicy::try_from(p.uncertain_policy) {
        Ok(pb::UncertainPolicy::Unspecified) => None,
        Ok(pb::UncertainPolicy::Count) => Some(UncertainPolicy::Count),
        Ok(pb::UncertainPolicy::HoldTool) => Some(UncertainPolicy::HoldTool),
        Err(_) => return Err(invalid("permit.uncertain_policy", "unknown policy")),
    };
    Ok(PermitSpec {
        permit_id: p.permit_id,
        subject: p.subject,
        tools: p.tools,
        max_calls_per_tool: p.max_calls_per_tool.into_iter().collect(),
        budget: p.budget,
        currency: p.currency,
        expires_at: p
            .expires_at
            .as_ref()
            .map(|t| millis_of_timestamp(t, "permit.expires_at"))
            .transpose()?,
        lease_ms: p
            .lease
            .as_ref()
            .map(|d| millis_of_duration(d, "permit.lease"))
            .transpose()?,
        guard_mode,
        uncertain_policy,
        guard_window_ms: guard
            .window
            .as_ref()
            .map(|d| millis_of_duration(d, "permit.duplicate_guard.window"))
            .transpose()?,
        agents: p.agents,
        approval_per_tool: p
            .approval_per_tool
            .into_iter()
            .map(|(tool, rule)| {
                let wait_ms = rule
                    .wait
                    .as_ref()
                    .map(|d| millis_of_duration(d, "permit.approval_per_tool"))
                    .transpose()?;
                let spec = ApprovalRuleSpec {
                    cost_at_least: rule.cost_at_least,
                    wait_ms,
                    approvers: rule.approvers,
                };
                Ok((tool, spec))
            })
            .collect::<Result<_, Error>>()?,
        approval_waits: waits,
        server_fields_set: !p.tenant.is_empty()
            || p.status != pb::PermitStatus::Unspecified as i32
            || p.created_at.is_some(),
    })
}

// === page tokens ===
//
// A token is the hex of "2<uncertain_since, 15 digits><permit_id><key>",
// the last attempt listed (the permit id is a 36-character UUID): opaque to
// clients, checked here. "2": the order since atmost keeps an uncertain
// index (by uncertain_since first); a token of the earlier order (by the
// permit's expiry: its text began with a digit of a 15-digit time, "0") is
// refused, so a listing under way when atmost is upgraded starts over
// instead of skipping what the new order puts before it.

pub fn page_token(c: &Cursor) -> String {
    use std::fmt::Write;
    let text = format!("2{:015}{}{}", c.at, c.permit_id, c.idempotency_key);
    let mut token = String::with_capacity(2 * text.len());
    for b in text.bytes() {
        let _ = write!(token, "{b:02x}");
    }
    token
}

pub fn cursor(token: &str) -> Result<Cursor, Error> {
    let bad = || {
        invalid(
            "page_token",
            "not a token from a previous ListUncertain response",
        )
    };
    if !token.len().is_multiple_of(2) || !token.is_ascii() {
        return Err(bad());
    }
    let bytes = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&token[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| bad())?;
    // A token is all ASCII (digits, a UUID, a printable-ASCII key), so
    // every slice below falls on a character boundary.
    let text = String::from_utf8(bytes)
        .ok()
        .filter(|t| t.is_ascii())
        .ok_or_else(bad)?;
    let Some(text) = text.strip_prefix('2') else {
        return Err(if text.starts_with('0') {
            invalid(
                "page_token",
                "from a listing by an earlier version of atmost, in another order: \
                 start the listing over without a token",
            )
        } else {
            bad()
        });
    };
    if text.len() <= 51 {
        return Err(bad());
    }
    let (at, rest) = text.split_at(15);
    if !at.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let uncertain_since = at.parse().map_err(|_| bad())?;
    let (permit, key) = rest.split_at(36);
    let permit_id = domain::canonical_id(permit).ok_or_else(bad)?;
    if !domain::valid_key(key) {
        return Err(bad());
    }
    Ok(Cursor {
        at: uncertain_since,
        permit_id,
        idempotency_key: key.to_owned(),
    })
}

// === responses ===

fn state(s: AttemptState) -> pb::AttemptState {
    match s {
        AttemptState::Reserved => pb::AttemptState::Reserved,
        AttemptState::Succeeded => pb::AttemptState::Succeeded,
        AttemptState::Failed => pb::AttemptState::Failed,
        AttemptState::Uncertain => pb::AttemptState::Uncertain,
        AttemptState::Released => pb::AttemptState::Released,
        AttemptState::AwaitingApproval => pb::AttemptState::AwaitingApproval,
        AttemptState::Denied => pb::AttemptState::Denied,
        AttemptState::Approved => pb::AttemptState::Approved,
    }
}

fn approval(a: domain::Approval) -> pb::Approval {
    pb::Approval {
        summary: a.summary,
        expires_at: Some(timestamp(a.expires_at)),
        approvers_needed: a.approvers_needed,
        approved_by: a.approved_by,
        decided_by: a.decided_by,
        decided_at: (a.decided_at > 0).then(|| timestamp(a.decided_at)),
        denial_reason: a.denial_reason,
    }
}

/// An attempt on the wire; a SUCCEEDED one's receipt signed with `keys`
/// when atmost has them, for `tenant`, its permit's. The caller's scope
/// tenant is that: a store answers only for a permit of the scope's tenant
/// (PERMIT_NOT_FOUND otherwise), so every attempt an answer carries is one.
pub fn attempt(a: domain::Attempt, tenant: &str, keys: Option<&ReceiptKeys>) -> pb::Attempt {
    // Only a SUCCEEDED attempt's receipt is ever signed.
    let signed = match (&a.receipt, keys) {
        (Some(r), Some(keys)) if a.state == AttemptState::Succeeded => Some((
            keys.sign(tenant, &a, r),
            keys.signing_key_id().to_owned(),
            tenant.to_owned(),
            Encoding::CURRENT,
        )),
        _ => None,
    };
    let (signature, key_id, tenant, signature_version) = signed.unwrap_or_default();
    pb::Attempt {
        attempt_id: a.attempt_id,
        permit_id: a.permit_id,
        tool: a.tool,
        idempotency_key: a.idempotency_key,
        request_fingerprint: a.request_fingerprint,
        state: state(a.state) as i32,
        cost: a.cost,
        created_at: Some(timestamp(a.created_at)),
        // None for a call that was never dispatched (awaiting approval, or
        // denied).
        lease_expires_at: (a.lease_expires_at > 0).then(|| timestamp(a.lease_expires_at)),
        receipt: a.receipt.map(|r| pb::Receipt {
            receipt_id: r.receipt_id,
            result: r.result,
            cost: r.cost,
            issued_at: Some(timestamp(r.issued_at)),
            signature,
            key_id,
            tenant,
            signature_version,
        }),
        failure_reason: a.failure_reason,
        uncertain_reason: a.uncertain_reason,
        uncertain_since: (a.uncertain_since > 0).then(|| timestamp(a.uncertain_since)),
        reserved_by: a.reserved_by,
        approval: a.approval.map(approval),
    }
}

pub fn usage(u: domain::Usage) -> pb::Usage {
    pb::Usage {
        tool: u.tool,
        calls_made: u.calls_made,
        calls_limit: u.calls_limit,
        budget_remaining: u.budget_remaining,
    }
}

pub fn permit(p: domain::Permit) -> pb::Permit {
    pb::Permit {
        permit_id: p.permit_id,
        subject: p.subject,
        tools: p.tools,
        max_calls_per_tool: p.max_calls_per_tool.into_iter().collect(),
        budget: p.budget,
        currency: p.currency,
        expires_at: Some(timestamp(p.expires_at)),
        lease: Some(duration(p.lease_ms)),
        duplicate_guard: Some(pb::DuplicateGuard {
            mode: match p.duplicate_guard.mode {
                GuardMode::Off => pb::DuplicateGuardMode::Off,
                GuardMode::Log => pb::DuplicateGuardMode::Log,
                GuardMode::Enforce => pb::DuplicateGuardMode::Enforce,
            } as i32,
            window: Some(duration(p.duplicate_guard.window_ms)),
        }),
        status: match p.status {
            PermitStatus::Active => pb::PermitStatus::Active,
            PermitStatus::Revoked => pb::PermitStatus::Revoked,
        } as i32,
        created_at: Some(timestamp(p.created_at)),
        tenant: p.tenant,
        agents: p.agents,
        approval_per_tool: p
            .approval_per_tool
            .into_iter()
            .map(|(tool, rule)| {
                let rule = pb::ApprovalRule {
                    cost_at_least: rule.cost_at_least,
                    wait: Some(duration(rule.wait_ms)),
                    approvers: rule.approvers,
                };
                (tool, rule)
            })
            .collect(),
        uncertain_policy: match p.uncertain_policy {
            UncertainPolicy::Count => pb::UncertainPolicy::Count,
            UncertainPolicy::HoldTool => pb::UncertainPolicy::HoldTool,
        } as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::{cursor, page_token};
    use crate::store::Cursor;
    use proptest::prelude::*;

    fn hex(text: &[u8]) -> String {
        text.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn a_token_reads_back_as_its_cursor() {
        let permit_id = "0190a6e0-0000-7000-8000-000000000001".to_owned();
        for (at, key) in [(1_767_225_600_000, "order-42 (retry)"), (0, "k")] {
            let c = Cursor {
                at,
                permit_id: permit_id.clone(),
                idempotency_key: key.to_owned(),
            };
            assert_eq!(cursor(&page_token(&c)), Ok(c));
        }
    }

    /// A token of the order before the uncertain index (by the permit's
    /// expiry) is refused, saying to start over: read in the new order it
    /// would skip attempts.
    #[test]
    fn a_token_of_the_earlier_order_is_refused() {
        let old = hex(b"0017672256000000190a6e0-0000-7000-8000-000000000001");
        let e = cursor(&old).expect_err("an earlier token");
        assert!(e.to_string().contains("start the listing over"), "{e}");
    }

    #[test]
    fn a_token_that_is_not_one_is_invalid_never_a_panic() {
        let mut split_char = b"00000000000000".to_vec();
        split_char.extend("é".as_bytes()); // across bytes 14 and 15
        split_char.extend(b"a".repeat(35));
        for token in [
            String::new(),
            "zz".into(),
            "0".into(),
            hex(&split_char),
            hex(b"2000000000000001not-a-uuid-at-all-but-36-characters-long:k"),
            hex(b"200000000000000x0190a6e0-0000-7000-8000-000000000001k"),
            hex(b"20000000000000010190a6e0-0000-7000-8000-000000000001"),
            hex(b"20000000000000010190a6e0-0000-7000-8000-000000000001\x01"),
        ] {
            assert!(cursor(&token).is_err(), "{token}");
        }
    }

    proptest! {
        #[test]
        fn any_token_is_a_cursor_or_invalid(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = cursor(&hex(&bytes));
        }
    }
}
