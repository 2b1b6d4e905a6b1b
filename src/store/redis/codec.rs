//! Records <-> Redis values: the permit hash, ids as 16 bytes, and the codes
//! under which guard modes, permit statuses and attempt states are stored
//! (the same numbers as `lua/lib.lua`'s constants).

use super::reply::{Fields, malformed, parse_int};
use crate::domain::{
    ApprovalRule, AttemptState, DuplicateGuard, Error, GuardMode, MAX_AMOUNT, MAX_DURATION_MS,
    Permit, PermitStatus, PermitView, UncertainPolicy, Usage,
};
use redis::Value;
use std::collections::{BTreeMap, HashMap};

// === codes ===

/// A guard mode as stored in `gmode` (lib.lua: GUARD_OFF, GUARD_LOG, GUARD_ENFORCE).
pub(super) fn guard_code(mode: GuardMode) -> i64 {
    match mode {
        GuardMode::Off => 0,
        GuardMode::Log => 1,
        GuardMode::Enforce => 2,
    }
}

fn decode_guard(code: i64) -> Result<GuardMode, Error> {
    Ok(match code {
        0 => GuardMode::Off,
        1 => GuardMode::Log,
        2 => GuardMode::Enforce,
        other => return Err(malformed(format!("guard mode {other}"))),
    })
}

/// A permit status as stored in `status` (lib.lua: STATUS_ACTIVE, STATUS_REVOKED).
pub(super) fn status_code(status: PermitStatus) -> i64 {
    match status {
        PermitStatus::Active => 1,
        PermitStatus::Revoked => 2,
    }
}

fn decode_status(code: i64) -> Result<PermitStatus, Error> {
    Ok(match code {
        1 => PermitStatus::Active,
        2 => PermitStatus::Revoked,
        other => return Err(malformed(format!("permit status {other}"))),
    })
}

/// An attempt state as stored and replied (lib.lua: RESERVED ... RELEASED,
/// AWAITING, DENIED, APPROVED).
pub(super) fn decode_state(code: i64) -> Result<AttemptState, Error> {
    Ok(match code {
        1 => AttemptState::Reserved,
        2 => AttemptState::Succeeded,
        3 => AttemptState::Failed,
        4 => AttemptState::Uncertain,
        5 => AttemptState::Released,
        6 => AttemptState::AwaitingApproval,
        7 => AttemptState::Denied,
        8 => AttemptState::Approved,
        other => return Err(malformed(format!("attempt state {other}"))),
    })
}

// === approval rules ===

/// A tool's approval rule as stored in `ap:<tool>` (lib.lua:
/// permit_value): "<cost_at_least>:<wait ms>:<approvers>", cost_at_least
/// "" for every call.
pub(super) fn encode_rule(rule: &ApprovalRule) -> String {
    format!(
        "{}:{}:{}",
        rule.cost_at_least
            .map(|c| c.to_string())
            .unwrap_or_default(),
        rule.wait_ms,
        rule.approvers
    )
}

/// [`encode_rule`]'s value back, if it is one atmost writes: the cost
/// within 0..=MAX_AMOUNT, the wait 1 ms to 7 days, 1 or 2 approvers, each
/// number as `%d` writes it (as lib.lua reads it).
pub(super) fn decode_rule(value: &[u8]) -> Option<ApprovalRule> {
    let text = std::str::from_utf8(value).ok()?;
    let mut parts = text.split(':');
    let (at_least, wait, approvers) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    // "0", or digits without a leading zero (lib.lua: uint).
    let number = |s: &str| -> Option<i64> {
        let canonical = s == "0"
            || (!s.is_empty()
                && !s.starts_with('0')
                && s.len() <= 16
                && s.bytes().all(|b| b.is_ascii_digit()));
        s.parse()
            .ok()
            .filter(|n| canonical && (0..=MAX_AMOUNT).contains(n))
    };
    let cost_at_least = match at_least {
        "" => None,
        s => Some(number(s)?),
    };
    let wait_ms = number(wait).filter(|w| (1..=MAX_DURATION_MS).contains(w))?;
    let approvers = match approvers {
        "1" => 1,
        "2" => 2,
        _ => return None,
    };
    Some(ApprovalRule {
        cost_at_least,
        wait_ms,
        approvers,
    })
}

// === permits ===

/// The permit hash's fields at creation (lib.lua lists them).
pub(super) fn encode_permit(p: &Permit) -> Vec<(String, Vec<u8>)> {
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
        (
            "status".into(),
            status_code(p.status).to_string().into_bytes(),
        ),
        ("created".into(), p.created_at.to_string().into_bytes()),
        ("committed".into(), b"0".to_vec()),
        ("reserved".into(), b"0".to_vec()),
        ("open".into(), b"0".to_vec()),
    ];
    if let Some(budget) = p.budget {
        fields.push(("budget".into(), budget.to_string().into_bytes()));
    }
    // Absent: count (lib.lua: holds).
    if p.uncertain_policy == UncertainPolicy::HoldTool {
        fields.push(("upol".into(), b"1".to_vec()));
    }
    // Absent: "" (dev mode) and any agent (lib.lua: visible).
    if !p.tenant.is_empty() {
        fields.push(("ten".into(), p.tenant.clone().into_bytes()));
    }
    if !p.agents.is_empty() {
        fields.push(("agents".into(), p.agents.join("\n").into_bytes()));
    }
    for tool in &p.tools {
        let cap = p
            .max_calls_per_tool
            .get(tool)
            .map(u64::to_string)
            .unwrap_or_default();
        fields.push((format!("t:{tool}"), cap.into_bytes()));
    }
    // Absent: no approval rule, and no script reads the pending set
    // (lib.lua: appr).
    if !p.approval_per_tool.is_empty() {
        fields.push(("appr".into(), b"1".to_vec()));
    }
    for (tool, rule) in &p.approval_per_tool {
        fields.push((format!("ap:{tool}"), encode_rule(rule).into_bytes()));
    }
    fields
}

/// Decodes a permit hash (HGETALL's flat field/value list; empty when
/// there is no such permit). Every field [`encode_permit`] writes must be
/// there; only `budget` (unlimited), `n:<tool>` (no call yet), `appr` and
/// `ap:<tool>` (no approval rule) may be absent. An approval rule must be
/// one [`encode_rule`] writes, for a tool in scope, on a permit whose
/// `appr` says it has one.
pub(super) fn decode_permit(permit_id: &str, hash: Vec<Value>) -> Result<PermitView, Error> {
    let mut f = Fields::new(hash);
    let mut map: HashMap<String, Vec<u8>> = HashMap::new();
    while !f.done() {
        let field = f.string()?;
        map.insert(field, f.bytes()?);
    }
    if map.is_empty() {
        return Err(Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        });
    }
    let bytes = |name: &str| {
        map.get(name)
            .ok_or_else(|| malformed(format!("permit field {name} missing")))
    };
    let text = |name: &str| {
        String::from_utf8(bytes(name)?.clone())
            .map_err(|_| malformed(format!("permit field {name} not UTF-8")))
    };
    let number = |name: &str, b: &[u8]| {
        parse_int(b).ok_or_else(|| malformed(format!("permit field {name} not an integer")))
    };
    let int = |name: &str| number(name, bytes(name)?);
    let count = |name: &str| {
        let n = int(name)?;
        u64::try_from(n).map_err(|_| malformed(format!("permit field {name} is {n}")))
    };
    let tools: Vec<String> = text("tools")?.split('\n').map(str::to_owned).collect();
    let mut max_calls_per_tool = BTreeMap::new();
    let mut usage = Vec::with_capacity(tools.len());
    // Amounts are 0..=MAX_AMOUNT as atmost writes them: out of range, the
    // budget left below would overflow.
    let amount = |name: &str, n: i64| {
        if (0..=MAX_AMOUNT).contains(&n) {
            Ok(n)
        } else {
            Err(malformed(format!("permit field {name} is {n}")))
        }
    };
    let budget = map
        .get("budget")
        .map(|b| amount("budget", number("budget", b)?))
        .transpose()?;
    let committed = amount("committed", int("committed")?)?;
    let reserved = amount("reserved", int("reserved")?)?;
    for tool in &tools {
        // "" is no cap; every tool in scope has the field.
        let cap_field = format!("t:{tool}");
        let cap = if bytes(&cap_field)?.is_empty() {
            None
        } else {
            Some(count(&cap_field)?)
        };
        if let Some(cap) = cap {
            max_calls_per_tool.insert(tool.clone(), cap);
        }
        // Written by the tool's first Authorize.
        let calls_field = format!("n:{tool}");
        let calls_made = if map.contains_key(&calls_field) {
            count(&calls_field)?
        } else {
            0
        };
        usage.push(Usage {
            tool: tool.clone(),
            calls_made,
            calls_limit: cap,
            budget_remaining: budget.map(|b| b - committed - reserved),
        });
    }
    let mut approval_per_tool = BTreeMap::new();
    for (field, value) in &map {
        let Some(tool) = field.strip_prefix("ap:") else {
            continue;
        };
        let rule = decode_rule(value)
            .ok_or_else(|| malformed(format!("permit field {field} not an approval rule")))?;
        if !tools.iter().any(|t| t == tool) {
            return Err(malformed(format!(
                "permit field {field} for a tool not in scope"
            )));
        }
        approval_per_tool.insert(tool.to_owned(), rule);
    }
    match map.get("appr").map(Vec::as_slice) {
        None if !approval_per_tool.is_empty() => {
            return Err(malformed("approval rules on a permit without appr"));
        }
        None | Some(b"1") => {}
        Some(_) => return Err(malformed("permit field appr")),
    }
    let permit = Permit {
        permit_id: permit_id.to_owned(),
        subject: text("subject")?,
        tools,
        max_calls_per_tool,
        budget,
        currency: text("currency")?,
        expires_at: int("exp")?,
        lease_ms: int("lease")?,
        duplicate_guard: DuplicateGuard {
            mode: decode_guard(int("gmode")?)?,
            window_ms: int("gwin")?,
        },
        uncertain_policy: match map.get("upol").map(Vec::as_slice) {
            None => UncertainPolicy::Count,
            Some(b"1") => UncertainPolicy::HoldTool,
            Some(_) => return Err(malformed("permit field upol")),
        },
        status: decode_status(int("status")?)?,
        created_at: int("created")?,
        tenant: match map.get("ten") {
            Some(_) => text("ten")?,
            None => String::new(),
        },
        agents: match map.get("agents") {
            Some(_) => text("agents")?.split('\n').map(str::to_owned).collect(),
            None => Vec::new(),
        },
        approval_per_tool,
    };
    Ok(PermitView {
        permit,
        usage,
        budget_committed: committed,
        budget_reserved: reserved,
    })
}

// === ids ===

/// Ids (attempt, receipt) are stored as their 16 bytes, not 36 characters:
/// 40 bytes less per finished attempt. Empty stays empty (no id).
pub(super) fn id_bytes(id: &str) -> Vec<u8> {
    match uuid::Uuid::try_parse(id) {
        Ok(u) => u.as_bytes().to_vec(),
        Err(_) => id.as_bytes().to_vec(),
    }
}

/// An id stored as 16 bytes, back in canonical text ("" stays "").
pub(super) fn id_text(bytes: &[u8]) -> Result<String, Error> {
    if bytes.is_empty() {
        return Ok(String::new());
    }
    uuid::Uuid::from_slice(bytes)
        .map(|u| u.hyphenated().to_string())
        .map_err(|_| malformed("an id that is not 16 bytes"))
}

#[cfg(test)]
mod tests {
    use super::{decode_permit, decode_rule, encode_permit, encode_rule};
    use crate::domain::{
        ApprovalRule, DuplicateGuard, Error, GuardMode, MAX_AMOUNT, MAX_DURATION_MS, Permit,
        PermitStatus, UncertainPolicy,
    };
    use redis::Value;

    fn permit() -> Permit {
        Permit {
            permit_id: "0190a6e0-0000-7000-8000-000000000001".into(),
            subject: "agent-7".into(),
            tools: vec!["search".into(), "payments.charge".into()],
            max_calls_per_tool: [("payments.charge".to_owned(), 3)].into(),
            budget: Some(1000),
            currency: "EUR".into(),
            expires_at: 1_767_225_600_000,
            lease_ms: 30_000,
            duplicate_guard: DuplicateGuard {
                mode: GuardMode::Enforce,
                window_ms: 600_000,
            },
            uncertain_policy: UncertainPolicy::HoldTool,
            status: PermitStatus::Active,
            created_at: 1_767_222_000_000,
            tenant: "acme".into(),
            agents: vec!["agent-1".into(), "agent-2".into()],
            approval_per_tool: [
                (
                    "payments.charge".to_owned(),
                    ApprovalRule {
                        cost_at_least: Some(100),
                        wait_ms: 900_000,
                        approvers: 2,
                    },
                ),
                (
                    "search".to_owned(),
                    ApprovalRule {
                        cost_at_least: None,
                        wait_ms: 1,
                        approvers: 1,
                    },
                ),
            ]
            .into(),
        }
    }

    /// The permit's hash as HGETALL answers it, with `change` applied to
    /// its fields first.
    fn stored(change: impl FnOnce(&mut Vec<(String, Vec<u8>)>)) -> Result<Permit, Error> {
        let p = permit();
        let mut fields = encode_permit(&p);
        change(&mut fields);
        let hash = fields
            .into_iter()
            .flat_map(|(k, v)| [Value::BulkString(k.into_bytes()), Value::BulkString(v)])
            .collect();
        decode_permit(&p.permit_id, hash).map(|view| view.permit)
    }

    fn set(fields: &mut [(String, Vec<u8>)], name: &str, value: &str) {
        let field = fields.iter_mut().find(|(k, _)| k == name).expect(name);
        field.1 = value.as_bytes().to_vec();
    }

    fn unavailable(result: Result<Permit, Error>) -> bool {
        matches!(result, Err(Error::StoreUnavailable(_)))
    }

    #[test]
    fn a_permit_reads_back_as_written() {
        assert_eq!(stored(|_| {}), Ok(permit()));
        // Absent budget: unlimited. n:<tool> appears with the first call.
        let unlimited = stored(|f| f.retain(|(k, _)| k != "budget"));
        assert_eq!(unlimited.unwrap().budget, None);
        let revoked = stored(|f| set(f, "status", "2"));
        assert_eq!(revoked.unwrap().status, PermitStatus::Revoked);
        let off = stored(|f| set(f, "gmode", "0"));
        assert_eq!(off.unwrap().duplicate_guard.mode, GuardMode::Off);
        // Absent uncertain policy: count.
        let count = stored(|f| f.retain(|(k, _)| k != "upol"));
        assert_eq!(count.unwrap().uncertain_policy, UncertainPolicy::Count);
    }

    #[test]
    fn approval_rules_read_back_as_written() {
        let none = stored(|f| f.retain(|(k, _)| k != "appr" && !k.starts_with("ap:")));
        assert_eq!(none.unwrap().approval_per_tool, Default::default());
        for rule in [
            ApprovalRule {
                cost_at_least: Some(0),
                wait_ms: MAX_DURATION_MS,
                approvers: 1,
            },
            ApprovalRule {
                cost_at_least: Some(MAX_AMOUNT),
                wait_ms: 1000,
                approvers: 2,
            },
        ] {
            assert_eq!(decode_rule(encode_rule(&rule).as_bytes()), Some(rule));
        }
        assert_eq!(
            encode_rule(&ApprovalRule {
                cost_at_least: None,
                wait_ms: 60_000,
                approvers: 2
            }),
            ":60000:2"
        );
    }

    /// A rule field as lib.lua would not read it (lib.lua: permit_value):
    /// UNAVAILABLE, as for every other field; so is a rule on a permit
    /// whose appr does not say it has one, or for a tool not in scope.
    #[test]
    fn a_malformed_approval_rule_is_an_error_not_a_default() {
        let rule = "ap:payments.charge";
        for value in [
            "",
            "x",
            "100:900000",
            "100:900000:2:1",
            "100:900000:3",
            "100:900000:0",
            "-1:900000:1",
            "01:900000:1",
            "1e3:900000:1",
            "9007199254740992:900000:1",
            "100:0:1",
            "100:604800001:1",
            "100::1",
            "100: 9:1",
            "+1:900000:1",
            "\u{ff}:1:1",
        ] {
            assert!(unavailable(stored(|f| set(f, rule, value))), "{value:?}");
            assert_eq!(decode_rule(value.as_bytes()), None, "{value:?}");
        }
        assert!(unavailable(stored(|f| f.retain(|(k, _)| k != "appr"))));
        for appr in ["0", "", "2", "true"] {
            assert!(unavailable(stored(|f| set(f, "appr", appr))), "appr={appr}");
        }
        assert!(unavailable(stored(
            |f| f.push(("ap:other".into(), b":1000:1".to_vec()))
        )));
        assert!(unavailable(stored(
            |f| f.push(("ap:search".into(), vec![0xff]))
        )));
    }

    #[test]
    fn no_hash_is_no_permit() {
        assert_eq!(
            decode_permit("p", Vec::new()),
            Err(Error::PermitNotFound {
                permit_id: "p".into()
            })
        );
    }

    #[test]
    fn an_unknown_guard_mode_or_status_is_an_error_not_a_default() {
        for (field, code) in [
            ("gmode", "3"),
            ("gmode", "-1"),
            ("status", "0"),
            ("status", "3"),
            ("upol", "0"),
            ("upol", "2"),
        ] {
            assert!(
                unavailable(stored(|f| set(f, field, code))),
                "{field}={code}"
            );
        }
    }

    #[test]
    fn a_missing_or_unreadable_field_is_an_error_not_a_default() {
        // Every field written at creation but `open`, which GetPermit does
        // not show (the scripts that need it refuse a record without it).
        let numbers = [
            "exp",
            "lease",
            "gmode",
            "gwin",
            "status",
            "created",
            "committed",
            "reserved",
            "t:search",
        ];
        for name in ["subject", "currency", "tools"].iter().chain(&numbers) {
            assert!(
                unavailable(stored(|f| f.retain(|(k, _)| k != name))),
                "{name} missing"
            );
        }
        for name in numbers {
            assert!(unavailable(stored(|f| set(f, name, "x"))), "{name}=x");
        }
        assert!(unavailable(stored(|f| set(f, "budget", "many"))));
        assert!(unavailable(stored(|f| set(f, "t:payments.charge", "-1"))));
        let not_utf8 = |f: &mut Vec<(String, Vec<u8>)>| f[0].1 = vec![0xff];
        assert!(unavailable(stored(not_utf8)), "subject not UTF-8");
        assert!(unavailable(stored(
            |f| f.push(("n:search".into(), b"x".to_vec()))
        )));
    }

    /// Found by fuzzing the Redis replies: amounts out of range made the
    /// budget left overflow (a panic in a debug build, a wrong number in
    /// a release one).
    #[test]
    fn an_amount_out_of_range_is_an_error_not_an_overflow() {
        let min = i64::MIN.to_string();
        for (name, value) in [
            ("committed", min.as_str()),
            ("reserved", min.as_str()),
            ("committed", "-1"),
            ("budget", "-1"),
            ("reserved", "9007199254740992"),
        ] {
            assert!(
                unavailable(stored(|f| set(f, name, value))),
                "{name}={value}"
            );
        }
        let max = (crate::domain::MAX_AMOUNT).to_string();
        assert!(stored(|f| set(f, "budget", &max)).is_ok());
    }
}
