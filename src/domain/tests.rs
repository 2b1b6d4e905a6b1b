//! Unit tests of the pure pieces: ids, input limits and the lease rule. The
//! state machine has its own in `ledger/tests.rs`, and runs over gRPC on
//! both stores in `tests/behaviour/`.

use super::*;

#[test]
fn ids_carry_the_clock_time_in_milliseconds() {
    for now in [0, 1, 999, 1_767_225_600_123, (1 << 48) - 1] {
        let id = uuid::Uuid::parse_str(&super::new_id(now)).expect("a uuid");
        assert_eq!(id.get_version_num(), 7);
        // What lib.lua's id_ms reads: the first 48 bits, big-endian.
        let ms = id.as_bytes()[..6]
            .iter()
            .fold(0i64, |ms, b| ms * 256 + i64::from(*b));
        assert_eq!(ms, now);
    }
    assert_ne!(
        super::new_id(5),
        super::new_id(5),
        "ids at the same time differ"
    );
}

#[test]
fn tool_names_are_bounded_and_restricted() {
    assert!(valid_tool("payments.charge:v2/eu-west_1"));
    assert!(valid_tool(&"t".repeat(MAX_TOOL_LEN)));
    assert!(!valid_tool(&"t".repeat(MAX_TOOL_LEN + 1)));
    for bad in ["", "has space", "new\nline", "brace{", "é"] {
        assert!(!valid_tool(bad), "{bad:?}");
    }
}

#[test]
fn keys_are_printable_ascii_up_to_255_bytes() {
    assert!(valid_key(" ~!{}"));
    assert!(valid_key(&"k".repeat(MAX_KEY_LEN)));
    assert!(!valid_key(&"k".repeat(MAX_KEY_LEN + 1)));
    for bad in ["", "tab\t", "del\u{7f}", "é"] {
        assert!(!valid_key(bad), "{bad:?}");
    }
}

#[test]
fn ids_must_be_uuids_and_are_canonicalised() {
    let id = "0190F3A2-7B1C-7D4E-8F00-0123456789AB";
    assert_eq!(
        canonical_id(id).as_deref(),
        Some("0190f3a2-7b1c-7d4e-8f00-0123456789ab")
    );
    for bad in ["", "x", "{0190f3a2-7b1c-7d4e-8f00-0123456789ab}x"] {
        assert_eq!(canonical_id(bad), None, "{bad:?}");
    }
}

#[test]
fn every_form_of_one_uuid_is_that_uuid_and_nothing_else_is() {
    let canonical = "0190f3a2-7b1c-7d4e-8f00-0123456789ab";
    for same in [
        canonical,
        "0190F3A2-7B1C-7D4E-8F00-0123456789AB",
        "0190f3a27b1c7d4e8f000123456789ab",
        "0190F3A27B1C7D4E8F000123456789AB",
        "{0190f3a2-7b1c-7d4e-8f00-0123456789ab}",
        "{0190F3A2-7B1C-7D4E-8F00-0123456789AB}",
        "urn:uuid:0190f3a2-7b1c-7d4e-8f00-0123456789ab",
        "urn:uuid:0190F3A2-7B1C-7D4E-8F00-0123456789AB",
        "URN:UUID:0190F3A2-7B1C-7D4E-8F00-0123456789AB",
        "Urn:Uuid:0190f3a2-7b1c-7d4e-8f00-0123456789ab",
    ] {
        assert_eq!(canonical_id(same).as_deref(), Some(canonical), "{same:?}");
    }
    for other in [
        "urn:uuid:0190f3a27b1c7d4e8f000123456789ab",
        "urn:uuid:{0190f3a2-7b1c-7d4e-8f00-0123456789ab}",
        "URN:UUID:",
        "urn:uuid:0190f3a2-7b1c-7d4e-8f00-0123456789a",
        "{0190f3a27b1c7d4e8f000123456789ab}",
        "{0190f3a2-7b1c-7d4e-8f00-0123456789ab",
        " 0190f3a2-7b1c-7d4e-8f00-0123456789ab",
        "0190f3a2-7b1c-7d4e-8f00-0123456789ab\n",
        "0190-f3a27b1c-7d4e-8f00-0123456789ab",
        "urn:isbn:0190f3a2-7b1c-7d4e-8f00-012",
        "urn:uuid\u{e9}0190f3a2-7b1c-7d4e-8f00-0123456789ab",
    ] {
        assert_eq!(canonical_id(other), None, "{other:?}");
    }
}

fn attempt(state: AttemptState, lease_expires_at: Millis) -> Attempt {
    Attempt {
        attempt_id: String::new(),
        permit_id: String::new(),
        tool: "t".into(),
        idempotency_key: "k".into(),
        request_fingerprint: vec![1],
        cost: 0,
        state,
        created_at: 0,
        lease_expires_at,
        receipt: None,
        failure_reason: String::new(),
        uncertain_reason: String::new(),
        uncertain_since: 0,
        duplicate_of: None,
        reserved_by: String::new(),
        approval: None,
    }
}

#[test]
fn a_reserved_attempt_is_uncertain_the_instant_its_lease_passes() {
    let a = attempt(AttemptState::Reserved, 1_000);
    assert_eq!(a.observed_state(999), AttemptState::Reserved);
    assert_eq!(a.observed_state(1_000), AttemptState::Uncertain);
    let seen = a.clone().into_observed(1_000);
    assert_eq!(seen.state, AttemptState::Uncertain);
    assert_eq!(seen.uncertain_reason, LEASE_EXPIRED);
    // Only RESERVED attempts are affected by the lease.
    for state in [
        AttemptState::Succeeded,
        AttemptState::Failed,
        AttemptState::Released,
    ] {
        assert_eq!(attempt(state, 0).observed_state(5), state);
    }
}

#[test]
fn mark_uncertain_fills_in_a_default_reason() {
    let mut cmd = MarkUncertainCmd {
        permit_id: uuid::Uuid::now_v7().to_string(),
        idempotency_key: "k".into(),
        attempt_id: uuid::Uuid::now_v7().to_string(),
        reason: String::new(),
    };
    cmd.validate().expect("valid");
    assert_eq!(cmd.reason, MARKED_UNCERTAIN);
}

#[test]
fn a_permit_spec_reports_every_violation_at_once() {
    let spec = PermitSpec {
        permit_id: "chosen".into(),
        tools: vec!["ok".into(), "not ok".into()],
        budget: Some(-5),
        ..PermitSpec::default()
    };
    let Err(Error::InvalidRequest(violations)) = spec.into_permit("id".into(), 0, "") else {
        panic!("expected violations");
    };
    let fields: Vec<_> = violations.iter().map(|v| v.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "permit.permit_id",
            "permit.tools",
            "permit.budget",
            "permit.expires_at"
        ]
    );
}

/// Found by fuzzing: 48 *characters* of a value could escape to ten bytes
/// each (`\u{10ffff}`), so 16 violations made an error of 26 KB.
#[test]
fn an_echoed_value_is_48_escaped_characters_at_most() {
    assert_eq!(shown("search"), "\"search\"");
    assert_eq!(shown(&"a".repeat(48)), format!("\"{}\"", "a".repeat(48)));
    assert_eq!(
        shown(&"a".repeat(49)),
        format!("\"{}\"... (49 bytes)", "a".repeat(48))
    );
    for c in ['\u{10ffff}', '\0', '\n', 'é', '\u{301}', '🦀'] {
        let value = c.to_string().repeat(1000);
        let echoed = shown(&value);
        let escaped = echoed.split('"').nth(1).expect("quoted");
        assert!(escaped.chars().count() <= 48, "{echoed}");
        assert!(echoed.ends_with(&format!("... ({} bytes)", value.len())));
    }
}

#[test]
fn approval_rules_are_validated_with_the_permit() {
    use crate::domain::{ApprovalRuleSpec, ApprovalWaits};
    let spec = |rules: Vec<(&str, ApprovalRuleSpec)>| PermitSpec {
        tools: vec!["pay".into(), "refund".into()],
        expires_at: Some(10_000_000),
        approval_per_tool: rules.into_iter().map(|(t, r)| (t.to_owned(), r)).collect(),
        approval_waits: ApprovalWaits {
            default_ms: 60_000,
            max_ms: 3_600_000,
        },
        ..PermitSpec::default()
    };
    // Defaults: the server's wait, one approver.
    let permit = spec(vec![("pay", ApprovalRuleSpec::default())])
        .into_permit("id".into(), 0, "acme")
        .expect("valid");
    let rule = permit.approval_per_tool["pay"];
    assert_eq!(
        (rule.cost_at_least, rule.wait_ms, rule.approvers),
        (None, 60_000, 1)
    );
    assert!(permit.approval_for("pay", 0).is_some());
    assert!(permit.approval_for("refund", 0).is_none());
    let threshold = ApprovalRuleSpec {
        cost_at_least: Some(100),
        ..Default::default()
    };
    let permit = spec(vec![("pay", threshold)])
        .into_permit("id".into(), 0, "acme")
        .expect("valid");
    assert!(permit.approval_for("pay", 99).is_none());
    assert!(permit.approval_for("pay", 100).is_some());
    // Each bad rule is named, all at once, and nothing is built.
    let bad = |rule: ApprovalRuleSpec, tool: &str, tenant: &str| {
        let Err(Error::InvalidRequest(v)) =
            spec(vec![(tool, rule)]).into_permit("id".into(), 0, tenant)
        else {
            panic!("{rule:?} on {tool} accepted");
        };
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].field, "permit.approval_per_tool");
        v[0].description.clone()
    };
    let d = bad(ApprovalRuleSpec::default(), "other", "acme");
    assert!(d.contains("not in tools"), "{d}");
    let d = bad(
        ApprovalRuleSpec {
            cost_at_least: Some(-1),
            ..Default::default()
        },
        "pay",
        "acme",
    );
    assert!(d.contains("cost_at_least"), "{d}");
    for wait_ms in [999, 3_600_001] {
        let rule = ApprovalRuleSpec {
            wait_ms: Some(wait_ms),
            ..Default::default()
        };
        let d = bad(rule, "pay", "acme");
        assert!(d.contains("--approval-wait-max"), "{d}");
    }
    let d = bad(
        ApprovalRuleSpec {
            approvers: 3,
            ..Default::default()
        },
        "pay",
        "acme",
    );
    assert!(d.contains("1 or 2"), "{d}");
    let four_eyes = ApprovalRuleSpec {
        approvers: 2,
        ..Default::default()
    };
    let d = bad(four_eyes, "pay", "");
    assert!(d.contains("needs keys"), "{d}");
    assert!(
        spec(vec![("pay", four_eyes)])
            .into_permit("id".into(), 0, "acme")
            .is_ok()
    );
}
