//! What the CLI prints. People get aligned lines and tables; scripts get,
//! with `--json`, the RPC's response as one proto3 JSON document (the
//! proto's JSON names, 64-bit integers as strings, bytes in base64,
//! timestamps in RFC 3339: what grpcurl prints), encoded from the same
//! descriptor set server reflection serves. Text a caller chose (a
//! subject, a reason, a result) is printed escaped when it holds control
//! characters, so it cannot move the cursor or forge a line.

use super::Failure;
use atmost_client::pb;
use comfy_table::{CellAlignment, Table, presets};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use std::sync::LazyLock;
use std::time::{Duration, UNIX_EPOCH};

// === JSON ===

static POOL: LazyLock<Result<DescriptorPool, String>> = LazyLock::new(|| {
    DescriptorPool::decode(atmost::pb::FILE_DESCRIPTOR_SET).map_err(|e| e.to_string())
});

/// `message` (of type `atmost.v1.<name>`) as proto3 JSON. Fields at their
/// default are written too (`"callsMade": "0"`), so a script finds every
/// field; an absent message or optional field (no receipt, no budget) is
/// left out.
pub fn json_value(name: &str, message: &impl Message) -> serde_json::Value {
    let encoded = (|| {
        let pool = POOL.as_ref().map_err(String::clone)?;
        let full = format!("atmost.v1.{name}");
        let descriptor = pool
            .get_message_by_name(&full)
            .ok_or_else(|| format!("no message {full}"))?;
        let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
            .map_err(|e| e.to_string())?;
        let options = SerializeOptions::new().skip_default_fields(false);
        dynamic
            .serialize_with_options(serde_json::value::Serializer, &options)
            .map_err(|e| e.to_string())
    })();
    // The descriptor set is this binary's own: only a build that does not
    // match its proto/ could fail here.
    encoded.unwrap_or_else(|e| panic!("encoding atmost.v1.{name} as JSON: {e}"))
}

/// Prints one JSON document on stdout.
pub fn print_json(value: &serde_json::Value) {
    outln!("{value}");
}

// === failures ===

/// A failure on stderr: the reason, the message and the ErrorInfo
/// metadata, as lines or (with `--json`) one JSON document.
pub fn failure(failure: &Failure, json: bool) {
    let (code, reason, message, metadata) = match failure {
        Failure::Usage(m) => ("INVALID_ARGUMENT".to_owned(), None, m.clone(), Vec::new()),
        Failure::Connect(m) => ("UNAVAILABLE".to_owned(), None, m.clone(), Vec::new()),
        Failure::Story(m) => ("UNKNOWN".to_owned(), None, m.clone(), Vec::new()),
        Failure::Rpc(e) => {
            let mut metadata: Vec<_> = e.metadata().into_iter().collect();
            metadata.sort();
            (
                code_name(e.code()),
                e.reason_name().map(str::to_owned),
                e.status().message().to_owned(),
                metadata,
            )
        }
    };
    if json {
        let value = serde_json::json!({
            "error": {
                "code": code,
                "reason": reason,
                "message": message,
                "metadata": metadata
                    .into_iter()
                    .map(|(k, v)| (k, serde_json::Value::String(v)))
                    .collect::<serde_json::Map<_, _>>(),
            }
        });
        errln!("{value}");
        return;
    }
    match (&reason, failure) {
        (Some(reason), _) => errln!("atmost: {reason} ({code}): {}", text(&message)),
        (None, Failure::Rpc(_)) => errln!("atmost: {code}: {}", text(&message)),
        (None, _) => errln!("atmost: {}", text(&message)),
    }
    for (key, value) in metadata {
        errln!("  {key}: {}", text(&value));
    }
}

/// The gRPC code's canonical name (NOT_FOUND, UNAVAILABLE, ...).
fn code_name(code: tonic::Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

// === text ===

/// Free text as it may be printed: as it is, or quoted and escaped when it
/// holds a control character (a terminal escape, a newline), a Unicode
/// line or paragraph separator, or a bidirectional override.
pub fn text(s: &str) -> String {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if s.chars().any(unsafe_char) {
        format!("{s:?}")
    } else {
        s.to_owned()
    }
}

/// Free text for a table's cell: as [`text`] prints it, cut to `max`
/// characters (the last three `...`) so that a long one cannot push the
/// columns after it away; `-` when empty.
pub fn short(s: &str, max: usize) -> String {
    let shown = text(s);
    if shown.is_empty() {
        return "-".into();
    }
    if shown.chars().count() <= max {
        return shown;
    }
    let mut cut: String = shown.chars().take(max.saturating_sub(3)).collect();
    cut.push_str("...");
    cut
}

/// Bytes a caller gave (a result): as text when they are printable UTF-8,
/// else `base64:...`.
pub fn bytes(b: &[u8]) -> String {
    use base64::Engine;
    match std::str::from_utf8(b) {
        Ok(s) => text(s),
        Err(_) => format!(
            "base64:{}",
            base64::engine::general_purpose::STANDARD.encode(b)
        ),
    }
}

/// A protobuf timestamp in RFC 3339 (UTC, milliseconds).
pub fn time(t: Option<&prost_types::Timestamp>) -> String {
    match t {
        Some(t) => match u64::try_from(atmost_client::millis(t)) {
            Ok(ms) => {
                humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
            }
            Err(_) => format!("{}s before 1970", -t.seconds),
        },
        None => "-".into(),
    }
}

/// A protobuf duration as people write it (30s, 10m).
pub fn duration(d: Option<&prost_types::Duration>) -> String {
    match d {
        Some(d) => humantime::format_duration(Duration::new(
            d.seconds.max(0) as u64,
            d.nanos.max(0) as u32,
        ))
        .to_string(),
        None => "-".into(),
    }
}

/// The enum value's name without its type's prefix (ACTIVE, UNCERTAIN).
pub fn enum_name(full: &str, prefix: &str) -> String {
    full.strip_prefix(prefix).unwrap_or(full).to_owned()
}

pub fn state(a: &pb::Attempt) -> String {
    enum_name(a.state().as_str_name(), "ATTEMPT_STATE_")
}

/// The state with what explains it, in parentheses: an UNCERTAIN
/// attempt's reason, the approvals a call awaiting approval has so far
/// (`AWAITING_APPROVAL (1 of 2 approvals)`), a DENIED one's reason.
pub fn state_explained(a: &pb::Attempt) -> String {
    let state = state(a);
    let why = match (a.state(), &a.approval) {
        _ if !a.uncertain_reason.is_empty() => text(&a.uncertain_reason),
        (pb::AttemptState::AwaitingApproval, Some(approval)) => {
            format!("{} approvals", approvals(approval, " of "))
        }
        (pb::AttemptState::Denied, Some(approval)) if !approval.denial_reason.is_empty() => {
            text(&approval.denial_reason)
        }
        _ => return state,
    };
    format!("{state} ({why})")
}

/// The approvals a call has against those it needs (`1/2` with `sep`
/// "/", `1 of 2` with " of ").
pub fn approvals(approval: &pb::Approval, sep: &str) -> String {
    format!(
        "{}{sep}{}",
        approval.approved_by.len(),
        approval.approvers_needed.max(1)
    )
}

/// A key id an answer names: "" is dev mode's, where keys have no ids.
fn key_id(id: &str) -> String {
    match id {
        "" => "(no key: dev mode)".into(),
        id => text(id),
    }
}

// === tables ===

/// Rows of "field  value", aligned: one record.
pub fn fields(rows: &[(&str, String)]) -> String {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    for (field, value) in rows {
        table.add_row(vec![field.to_string(), value.clone()]);
    }
    trimmed(&table)
}

/// A table with a header row; numeric columns (named in `right`) aligned
/// right.
pub fn table(header: &[&str], right: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    table.set_header(header.to_vec());
    for (i, name) in header.iter().enumerate() {
        if right.contains(name)
            && let Some(column) = table.column_mut(i)
        {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    for row in rows {
        table.add_row(row);
    }
    trimmed(&table)
}

/// comfy-table pads every cell by one space on each side: the lines
/// without the first and trailing ones, so they start at the margin.
fn trimmed(table: &Table) -> String {
    table
        .lines()
        .map(|line| {
            let line = line.strip_prefix(' ').unwrap_or(&line);
            line.trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

// === records ===

/// An attempt, one field a line.
pub fn attempt(a: &pb::Attempt) -> String {
    let state = state_explained(a);
    // GetAttempt leaves an open attempt's id (its fencing token) empty
    // unless the caller may resolve it (docs/api.md, GetAttempt).
    let id = match a.attempt_id.as_str() {
        "" => "(withheld: open attempt)".to_owned(),
        id => id.to_owned(),
    };
    let mut rows = vec![
        ("attempt", id),
        ("permit", a.permit_id.clone()),
        ("key", text(&a.idempotency_key)),
        ("tool", a.tool.clone()),
        ("state", state),
        ("cost", a.cost.to_string()),
        ("created", time(a.created_at.as_ref())),
        ("lease ends", time(a.lease_expires_at.as_ref())),
    ];
    if a.uncertain_since.is_some() {
        rows.push(("uncertain since", time(a.uncertain_since.as_ref())));
    }
    if !a.failure_reason.is_empty() {
        rows.push(("failure", text(&a.failure_reason)));
    }
    if let Some(approval) = &a.approval {
        let pending = a.state() == pb::AttemptState::AwaitingApproval;
        rows.extend(approval_rows(approval, pending));
    }
    if let Some(r) = &a.receipt {
        rows.push(("receipt", r.receipt_id.clone()));
        rows.push(("result", bytes(&r.result)));
        rows.push(("actual cost", r.cost.to_string()));
        rows.push(("issued", time(r.issued_at.as_ref())));
        if !r.key_id.is_empty() {
            rows.push(("signed by", r.key_id.clone()));
        }
    }
    fields(&rows)
}

/// A call's approval: the requester's summary (escaped, never cut here),
/// when it lapses, who approved and decided it, and why it was denied.
fn approval_rows(approval: &pb::Approval, pending: bool) -> Vec<(&'static str, String)> {
    let summary = match approval.summary.as_str() {
        "" => "-".to_owned(),
        summary => text(summary),
    };
    let approved_by = match approval.approved_by.as_slice() {
        [] if pending => "nobody yet".to_owned(),
        [] => "nobody".to_owned(),
        ids => ids
            .iter()
            .map(|id| key_id(id))
            .collect::<Vec<_>>()
            .join(", "),
    };
    let mut rows = vec![
        ("summary", summary),
        ("approval expires", time(approval.expires_at.as_ref())),
        (
            "approved by",
            format!("{approved_by} ({})", approvals(approval, " of ")),
        ),
    ];
    if !approval.decided_by.is_empty() || approval.decided_at.is_some() {
        rows.push((
            "decided by",
            format!(
                "{} at {}",
                key_id(&approval.decided_by),
                time(approval.decided_at.as_ref())
            ),
        ));
    }
    if !approval.denial_reason.is_empty() {
        rows.push(("denial reason", text(&approval.denial_reason)));
    }
    rows
}

/// A permit's approval rule for one tool, as people read it.
fn rule(tool: &str, rule: &pb::ApprovalRule) -> String {
    let calls = match rule.cost_at_least {
        Some(cost) => format!("calls costing at least {cost}"),
        None => "every call".into(),
    };
    let wait = match &rule.wait {
        Some(_) => duration(rule.wait.as_ref()),
        None => "the server's default".into(),
    };
    let approvers = match rule.approvers.max(1) {
        1 => "1 approver".to_owned(),
        n => format!("{n} distinct approvers"),
    };
    format!("{tool}: {calls}, {approvers}, wait {wait}")
}

/// A permit, one field a line; `budget` is what GetPermit adds (committed,
/// reserved, remaining), when known.
pub fn permit(p: &pb::Permit, budget: Option<(i64, i64, Option<i64>)>) -> String {
    let guard = p.duplicate_guard.unwrap_or_default();
    let mut budget_text = match p.budget {
        Some(b) if p.currency.is_empty() => b.to_string(),
        Some(b) => format!("{b} {}", text(&p.currency)),
        None => "unlimited".into(),
    };
    if let Some((committed, reserved, remaining)) = budget {
        budget_text = format!(
            "{budget_text} (committed {committed}, reserved {reserved}, remaining {})",
            remaining.map_or("unlimited".into(), |r| r.to_string())
        );
    }
    let mut rows = vec![
        ("permit", p.permit_id.clone()),
        ("subject", text(&p.subject)),
        (
            "status",
            enum_name(p.status().as_str_name(), "PERMIT_STATUS_"),
        ),
        ("tools", p.tools.join(", ")),
        ("budget", budget_text),
        ("created", time(p.created_at.as_ref())),
        ("expires", time(p.expires_at.as_ref())),
        ("lease", duration(p.lease.as_ref())),
        (
            "duplicate guard",
            format!(
                "{}, window {}",
                enum_name(guard.mode().as_str_name(), "DUPLICATE_GUARD_MODE_"),
                duration(guard.window.as_ref())
            ),
        ),
        (
            "uncertain policy",
            enum_name(p.uncertain_policy().as_str_name(), "UNCERTAIN_POLICY_"),
        ),
        (
            "agents",
            if p.agents.is_empty() {
                "any agent of the tenant".into()
            } else {
                p.agents.join(", ")
            },
        ),
    ];
    let mut rules: Vec<_> = p.approval_per_tool.iter().collect();
    rules.sort_by_key(|(tool, _)| *tool);
    for (tool, r) in rules {
        rows.push(("needs approval", rule(tool, r)));
    }
    if !p.tenant.is_empty() {
        rows.insert(1, ("tenant", text(&p.tenant)));
    }
    fields(&rows)
}

/// Usage per tool: calls made against the cap.
pub fn usage(usage: &[pb::Usage]) -> String {
    table(
        &["TOOL", "CALLS", "CAP"],
        &["CALLS", "CAP"],
        usage
            .iter()
            .map(|u| {
                vec![
                    u.tool.clone(),
                    u.calls_made.to_string(),
                    u.calls_limit.map_or("none".into(), |n| n.to_string()),
                ]
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_uses_the_protos_json_names_and_keeps_defaults() {
        let a = pb::Attempt {
            attempt_id: "a".into(),
            idempotency_key: "k".into(),
            state: pb::AttemptState::Uncertain as i32,
            cost: 500,
            request_fingerprint: vec![0xff],
            ..Default::default()
        };
        let v = json_value("Attempt", &a);
        assert_eq!(v["idempotencyKey"], "k");
        assert_eq!(v["state"], "ATTEMPT_STATE_UNCERTAIN");
        assert_eq!(v["cost"], "500");
        assert_eq!(v["requestFingerprint"], "/w==");
        assert_eq!(v["failureReason"], "");
        assert!(v.get("receipt").is_none(), "{v}");
    }

    #[test]
    fn control_characters_are_escaped_and_plain_text_is_not() {
        assert_eq!(text("agent-7"), "agent-7");
        assert_eq!(text("a\u{1b}[2Jb"), "\"a\\u{1b}[2Jb\"");
        assert_eq!(text("two\nlines"), "\"two\\nlines\"");
        assert_eq!(bytes(&[0xff, 0]), "base64:/wA=");
        assert_eq!(text("a\u{2028}b"), "\"a\\u{2028}b\"");
    }

    #[test]
    fn table_cells_of_free_text_are_escaped_then_cut() {
        assert_eq!(short("pay 5 EUR", 48), "pay 5 EUR");
        assert_eq!(short("", 48), "-");
        assert_eq!(short(&"x".repeat(60), 10), "xxxxxxx...");
        let forged = short("ok\nFORGED \u{1b}[2J", 48);
        assert!(
            !forged.contains('\n') && !forged.contains('\u{1b}'),
            "{forged}"
        );
        assert_eq!(short("a\nb", 4), "\"...");
    }

    #[test]
    fn an_attempt_shows_its_approval() {
        let a = pb::Attempt {
            state: pb::AttemptState::AwaitingApproval as i32,
            approval: Some(pb::Approval {
                summary: "pay\n100".into(),
                approvers_needed: 2,
                approved_by: vec!["alice".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(state_explained(&a), "AWAITING_APPROVAL (1 of 2 approvals)");
        let shown = attempt(&a);
        assert!(shown.contains("summary           \"pay\\n100\""), "{shown}");
        assert!(
            shown.contains("approved by       alice (1 of 2)"),
            "{shown}"
        );
        assert!(!shown.contains("decided by"), "{shown}");
    }

    #[test]
    fn codes_read_as_grpc_names() {
        assert_eq!(code_name(tonic::Code::NotFound), "NOT_FOUND");
        assert_eq!(code_name(tonic::Code::Unavailable), "UNAVAILABLE");
        assert_eq!(
            code_name(tonic::Code::ResourceExhausted),
            "RESOURCE_EXHAUSTED"
        );
    }
}
