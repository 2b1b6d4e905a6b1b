//! Records <-> Redis values: the permit hash, ids as 16 bytes, and the codes
//! under which guard modes, permit statuses and attempt states are stored
//! (the same numbers as `lua/lib.lua`'s constants).

use super::reply::{Fields, malformed, parse_int};
use crate::domain::{
    AttemptState, DuplicateGuard, Error, GuardMode, Millis, Permit, PermitStatus, PermitView, Usage,
};
use redis::Value;
use std::collections::HashMap;

// === codes ===

/// A guard mode as stored in `gmode` (lib.lua: GUARD_OFF, GUARD_ENFORCE).
pub(super) fn guard_code(mode: GuardMode) -> i64 {
    match mode {
        GuardMode::Off => 0,
        GuardMode::Log => 1,
        GuardMode::Enforce => 2,
    }
}

/// An attempt state as stored and replied (lib.lua: RESERVED ... RELEASED).
pub(super) fn decode_state(code: i64) -> Result<AttemptState, Error> {
    Ok(match code {
        1 => AttemptState::Reserved,
        2 => AttemptState::Succeeded,
        3 => AttemptState::Failed,
        4 => AttemptState::Uncertain,
        5 => AttemptState::Released,
        other => return Err(malformed(format!("attempt state {other}"))),
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
        ("status".into(), b"1".to_vec()),
        ("created".into(), p.created_at.to_string().into_bytes()),
        ("committed".into(), b"0".to_vec()),
        ("reserved".into(), b"0".to_vec()),
        ("open".into(), b"0".to_vec()),
    ];
    if let Some(budget) = p.budget {
        fields.push(("budget".into(), budget.to_string().into_bytes()));
    }
    for tool in &p.tools {
        let cap = p
            .max_calls_per_tool
            .get(tool)
            .map(u64::to_string)
            .unwrap_or_default();
        fields.push((format!("t:{tool}"), cap.into_bytes()));
    }
    fields
}

/// Decodes a permit hash (HGETALL's flat field/value list).
pub(super) fn decode_permit(permit_id: &str, hash: Vec<Value>) -> Result<PermitView, Error> {
    let mut f = Fields::new(hash);
    let mut map: HashMap<String, Vec<u8>> = HashMap::new();
    while !f.done() {
        let field = f.string()?;
        map.insert(field, f.bytes()?);
    }
    if !map.contains_key("exp") {
        return Err(Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        });
    }
    let text = |name: &str| -> String {
        map.get(name)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let number = |b: &[u8]| parse_int(b).ok_or_else(|| malformed("not an integer"));
    let int = |name: &str| -> Result<i64, Error> { map.get(name).map_or(Ok(0), |b| number(b)) };
    let tools: Vec<String> = text("tools").split('\n').map(str::to_owned).collect();
    let mut max_calls_per_tool = std::collections::BTreeMap::new();
    let mut usage = Vec::with_capacity(tools.len());
    let budget = map.get("budget").map(|b| number(b)).transpose()?;
    let committed = int("committed")?;
    let reserved = int("reserved")?;
    for tool in &tools {
        let cap = match map.get(&format!("t:{tool}")) {
            Some(b) if !b.is_empty() => Some(number(b)? as u64),
            _ => None,
        };
        if let Some(cap) = cap {
            max_calls_per_tool.insert(tool.clone(), cap);
        }
        usage.push(Usage {
            tool: tool.clone(),
            calls_made: int(&format!("n:{tool}"))? as u64,
            calls_limit: cap,
            budget_remaining: budget.map(|b| b - committed - reserved),
        });
    }
    let permit = Permit {
        permit_id: permit_id.to_owned(),
        subject: text("subject"),
        tools,
        max_calls_per_tool,
        budget,
        currency: text("currency"),
        expires_at: int("exp")?,
        lease_ms: int("lease")?,
        duplicate_guard: DuplicateGuard {
            mode: match int("gmode")? {
                0 => GuardMode::Off,
                2 => GuardMode::Enforce,
                _ => GuardMode::Log,
            },
            window_ms: int("gwin")?,
        },
        status: if int("status")? == 2 {
            PermitStatus::Revoked
        } else {
            PermitStatus::Active
        },
        created_at: int("created")?,
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

/// The millisecond timestamp a UUIDv7 id carries (lib.lua: id_ms).
pub(super) fn id_ms(id: &str) -> Option<Millis> {
    let (secs, nanos) = uuid::Uuid::try_parse(id).ok()?.get_timestamp()?.to_unix();
    Some(secs as Millis * 1000 + Millis::from(nanos / 1_000_000))
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
