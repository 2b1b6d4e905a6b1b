//! Script replies: the msgpack string every script answers, unpacked into
//! RESP values ([`unpack_reply`]), read field by field ([`Fields`]) into
//! attempts and usage, and the one decoder of every script's verdict or
//! error ([`open`]). Anything atmost cannot read is an error
//! (UNAVAILABLE, logged), never a guess.

use super::codec::{decode_state, id_text};
use crate::domain::{
    Approval, Attempt, AttemptState, Error, Reason, Receipt, Usage, invalid, valid_key,
};
use redis::Value;

// === unreadable replies ===

/// A reply atmost cannot read: UNAVAILABLE, as the store's answer is
/// unknown.
/// Logged here, once per reply: a store that answers what atmost does not
/// understand is a bug or a version mismatch for an operator to see.
pub(super) fn malformed(what: impl std::fmt::Display) -> Error {
    let error =
        Error::StoreUnavailable(format!("unexpected reply from the store: {}", capped(what)));
    tracing::error!(%error, "store reply not understood");
    error
}

/// Most bytes of a reply's own text an error repeats: a hostile or corrupt
/// reply (a string of megabytes where a number was due) must not make an
/// error of megabytes for the client.
const MAX_ECHO: usize = 256;

/// `what`, written up to [`MAX_ECHO`] bytes ("..." when cut): formatting
/// stops there, so a huge value is never written out whole.
fn capped(what: impl std::fmt::Display) -> String {
    use std::fmt::Write;
    struct Capped(String);
    impl Write for Capped {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let room = MAX_ECHO - self.0.len();
            if s.len() <= room {
                self.0.push_str(s);
                return Ok(());
            }
            let end = (0..=room).rev().find(|&i| s.is_char_boundary(i));
            self.0.push_str(&s[..end.unwrap_or(0)]);
            Err(std::fmt::Error)
        }
    }
    let mut out = Capped(String::new());
    if write!(out, "{what}").is_err() {
        out.0.push_str("...");
    }
    out.0
}

// === reading replies ===

/// Reads a script's reply array field by field.
pub(super) struct Fields(std::vec::IntoIter<Value>);

impl Fields {
    pub(super) fn new(values: Vec<Value>) -> Self {
        Self(values.into_iter())
    }

    /// Whether every field has been read.
    pub(super) fn done(&self) -> bool {
        self.0.len() == 0
    }

    fn value(&mut self) -> Result<Value, Error> {
        self.0.next().ok_or_else(|| malformed("reply too short"))
    }

    pub(super) fn bytes(&mut self) -> Result<Vec<u8>, Error> {
        match self.value()? {
            Value::BulkString(b) => Ok(b),
            Value::SimpleString(s) => Ok(s.into_bytes()),
            other => Err(malformed(format!("{other:?} where bytes were expected"))),
        }
    }

    pub(super) fn string(&mut self) -> Result<String, Error> {
        String::from_utf8(self.bytes()?).map_err(|_| malformed("invalid UTF-8"))
    }

    pub(super) fn int(&mut self) -> Result<i64, Error> {
        match self.value()? {
            Value::Int(i) => Ok(i),
            Value::BulkString(b) => parse_int(&b).ok_or_else(|| malformed("not an integer")),
            other => Err(malformed(format!(
                "{other:?} where an integer was expected"
            ))),
        }
    }

    /// A count (calls, a cap): an integer that is not negative.
    pub(super) fn count(&mut self) -> Result<u64, Error> {
        let n = self.int()?;
        u64::try_from(n).map_err(|_| malformed(format!("a count of {n}")))
    }

    /// 1 or 0.
    pub(super) fn flag(&mut self) -> Result<bool, Error> {
        match self.int()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(malformed(format!("a flag of {other}"))),
        }
    }

    pub(super) fn array(&mut self) -> Result<Vec<Value>, Error> {
        as_array(self.value()?)
    }
}

// === msgpack ===

/// A script's reply, as packed by its function ([`library_text`](super::library_text)),
/// unpacked into the list of values the script returned.
pub fn unpack_reply(packed: &[u8]) -> Result<Vec<Value>, Error> {
    as_array(from_msgpack(&mut &packed[..], 0)?)
}

/// How deep a script reply may nest arrays: atmost's are at most three
/// deep (a listing: reply, attempt, fields). A deeper one is malformed,
/// never a recursion as deep as the reply is long.
const MAX_DEPTH: usize = 8;

/// Unpacks a script's msgpack reply straight into the RESP values the
/// decoders read, with no intermediate tree: Lua strings come as msgpack
/// strings, Lua integers as integers, Lua sequences as arrays (cmsgpack packs
/// nothing else from atmost's scripts).
fn from_msgpack(rd: &mut &[u8], depth: usize) -> Result<Value, Error> {
    use rmp::Marker;
    use rmp::decode::RmpRead;
    fn bad(e: impl std::fmt::Debug) -> Error {
        malformed(format!("a reply that is not msgpack: {e:?}"))
    }
    fn bytes(rd: &mut &[u8], len: usize) -> Result<Value, Error> {
        if rd.len() < len {
            return Err(malformed("a truncated reply"));
        }
        let (head, rest) = rd.split_at(len);
        *rd = rest;
        Ok(Value::BulkString(head.to_vec()))
    }
    fn array(rd: &mut &[u8], len: usize, depth: usize) -> Result<Value, Error> {
        if depth >= MAX_DEPTH {
            return Err(malformed("a reply nested deeper than atmost's"));
        }
        // Every element takes at least a byte: a corrupt length cannot
        // make this allocate more than the reply's size.
        let mut values = Vec::with_capacity(len.min(rd.len()));
        for _ in 0..len {
            values.push(from_msgpack(rd, depth + 1)?);
        }
        Ok(Value::Array(values))
    }
    let int = |v: Result<i64, _>| v.map(Value::Int).map_err(bad);
    match rmp::decode::read_marker(rd).map_err(|e| bad(e.0))? {
        Marker::Null => Ok(Value::Nil),
        Marker::FixPos(n) => Ok(Value::Int(n.into())),
        Marker::FixNeg(n) => Ok(Value::Int(n.into())),
        Marker::U8 => int(rd.read_data_u8().map(i64::from)),
        Marker::U16 => int(rd.read_data_u16().map(i64::from)),
        Marker::U32 => int(rd.read_data_u32().map(i64::from)),
        Marker::U64 => {
            let v = rd.read_data_u64().map_err(bad)?;
            i64::try_from(v)
                .map(Value::Int)
                .map_err(|_| malformed("an integer out of range"))
        }
        Marker::I8 => int(rd.read_data_i8().map(i64::from)),
        Marker::I16 => int(rd.read_data_i16().map(i64::from)),
        Marker::I32 => int(rd.read_data_i32().map(i64::from)),
        Marker::I64 => int(rd.read_data_i64()),
        Marker::FixStr(n) => bytes(rd, n.into()),
        Marker::Str8 | Marker::Bin8 => {
            let n = rd.read_data_u8().map_err(bad)?;
            bytes(rd, n.into())
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = rd.read_data_u16().map_err(bad)?;
            bytes(rd, n.into())
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = rd.read_data_u32().map_err(bad)?;
            bytes(rd, n as usize)
        }
        Marker::FixArray(n) => array(rd, n.into(), depth),
        Marker::Array16 => {
            let n = rd.read_data_u16().map_err(bad)?;
            array(rd, n.into(), depth)
        }
        Marker::Array32 => {
            let n = rd.read_data_u32().map_err(bad)?;
            array(rd, n as usize, depth)
        }
        other => Err(malformed(format!("{other:?} in a script reply"))),
    }
}

fn as_array(value: Value) -> Result<Vec<Value>, Error> {
    match value {
        Value::Array(values) => Ok(values),
        other => Err(malformed(format!("{other:?} where an array was expected"))),
    }
}

/// An integer as Redis stores it (decimal text), if it is one.
pub(super) fn parse_int(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

// === records in replies ===

/// Decodes lib.lua's `attempt_reply`: 16 fields, and a 17th (the approval)
/// for a call that needed approval.
pub(super) fn decode_attempt(permit_id: &str, values: Vec<Value>) -> Result<Attempt, Error> {
    let mut f = Fields::new(values);
    let attempt_id = id_text(&f.bytes()?)?;
    let tool = f.string()?;
    let request_fingerprint = f.bytes()?;
    let cost = f.int()?;
    let state = decode_state(f.int()?)?;
    let created_at = f.int()?;
    let lease_expires_at = f.int()?;
    let receipt_id = id_text(&f.bytes()?)?;
    let result = f.bytes()?;
    let receipt_cost = f.int()?;
    let issued_at = f.int()?;
    let failure_reason = f.string()?;
    let uncertain_reason = f.string()?;
    let idempotency_key = f.string()?;
    let uncertain_since = f.int()?;
    let reserved_by = f.string()?;
    let approval = if f.done() {
        None
    } else {
        Some(decode_approval(f.array()?)?)
    };
    if approval.is_none()
        && matches!(
            state,
            AttemptState::AwaitingApproval | AttemptState::Denied | AttemptState::Approved
        )
    {
        return Err(malformed(format!(
            "a {} attempt without its approval",
            state.as_str()
        )));
    }
    let receipt = (state == AttemptState::Succeeded).then_some(Receipt {
        receipt_id,
        result,
        cost: receipt_cost,
        issued_at,
    });
    Ok(Attempt {
        attempt_id,
        permit_id: permit_id.to_owned(),
        tool,
        idempotency_key,
        request_fingerprint,
        cost,
        state,
        created_at,
        lease_expires_at,
        receipt,
        failure_reason,
        uncertain_reason,
        uncertain_since,
        duplicate_of: None,
        reserved_by,
        approval,
    })
}

/// Decodes the approval of lib.lua's `attempt_reply`: summary, expires_at,
/// approvers needed (1 or 2), approved_by (key ids), decided_by,
/// decided_at, denial reason.
fn decode_approval(values: Vec<Value>) -> Result<Approval, Error> {
    let mut f = Fields::new(values);
    let summary = f.string()?;
    let expires_at = f.int()?;
    let approvers_needed = match f.int()? {
        n @ (1 | 2) => n as u32,
        other => return Err(malformed(format!("{other} approvers needed"))),
    };
    let mut approvers = Fields::new(f.array()?);
    let mut approved_by = Vec::new();
    while !approvers.done() {
        approved_by.push(approvers.string()?);
    }
    let decided_by = f.string()?;
    let decided_at = f.int()?;
    let denial_reason = f.string()?;
    Ok(Approval {
        summary,
        expires_at,
        approvers_needed,
        approved_by,
        decided_by,
        decided_at,
        denial_reason,
    })
}

/// Decodes lib.lua's `usage_reply`.
pub(super) fn decode_usage(values: Vec<Value>) -> Result<Usage, Error> {
    let mut f = Fields::new(values);
    let tool = f.string()?;
    let calls_made = f.count()?;
    let has_limit = f.flag()?;
    let limit = f.count()?;
    let has_budget = f.flag()?;
    let remaining = f.int()?;
    Ok(Usage {
        tool,
        calls_made,
        calls_limit: has_limit.then_some(limit),
        budget_remaining: has_budget.then_some(remaining),
    })
}

// === verdicts and error replies ===

/// What a script's error reply is about: the request's own values, which
/// the scripts do not send back. `None` where the request has no such value
/// (a reason that needs one is then a reply atmost cannot read).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct About<'a> {
    pub permit_id: &'a str,
    pub idempotency_key: Option<&'a str>,
    pub tool: Option<&'a str>,
    /// The cost the request asked to reserve.
    pub cost: Option<i64>,
}

impl<'a> About<'a> {
    pub(super) fn permit(permit_id: &'a str) -> Self {
        Self {
            permit_id,
            ..Self::default()
        }
    }

    /// A request about one idempotency key.
    pub(super) fn key(permit_id: &'a str, idempotency_key: &'a str) -> Self {
        Self {
            permit_id,
            idempotency_key: Some(idempotency_key),
            ..Self::default()
        }
    }
}

/// Another attempt's idempotency key, as a script names it in an error:
/// one a request could have had, or a reply atmost cannot read.
fn stored_key(f: &mut Fields) -> Result<String, Error> {
    let key = f.string()?;
    if valid_key(&key) {
        Ok(key)
    } else {
        Err(malformed("an idempotency key that is not one"))
    }
}

fn given<T>(value: Option<T>, what: &str) -> Result<T, Error> {
    value.ok_or_else(|| malformed(format!("a reason about the request's {what}")))
}

/// Opens a script's reply, for every script: `{verdict, ...}` with a
/// verdict ("OK", or Authorize's "DISPATCH" and "REPLAY") gives the verdict
/// and the fields after it; `{"ERR", REASON, ...}` is the [`Error`] of that
/// [`Reason`], built from the fields after the name.
pub(super) fn open(values: Vec<Value>, about: &About) -> Result<(String, Fields), Error> {
    let mut f = Fields::new(values);
    let verdict = f.string()?;
    if verdict != "ERR" {
        return Ok((verdict, f));
    }
    let name = f.string()?;
    let reason =
        Reason::from_name(&name).ok_or_else(|| malformed(format!("error reason {name:?}")))?;
    Err(script_error(reason, &mut f, about)?)
}

/// [`open`] for the scripts whose only verdict is "OK".
pub(super) fn open_ok(values: Vec<Value>, about: &About) -> Result<Fields, Error> {
    match open(values, about)? {
        (verdict, f) if verdict == "OK" => Ok(f),
        (other, _) => Err(malformed(format!("verdict {other:?}"))),
    }
}

/// The error a script reported, from the fields after the reason's name
/// (each script's header lists them).
fn script_error(reason: Reason, f: &mut Fields, about: &About) -> Result<Error, Error> {
    let permit_id = about.permit_id.to_owned();
    let key = || given(about.idempotency_key, "idempotency key").map(str::to_owned);
    let tool = || given(about.tool, "tool").map(str::to_owned);
    Ok(match reason {
        Reason::PermitNotFound => Error::PermitNotFound { permit_id },
        Reason::PermitRevoked => Error::PermitRevoked { permit_id },
        Reason::PermitExpired => Error::PermitExpired {
            permit_id,
            expired_at: f.int()?,
        },
        Reason::ToolNotInScope => Error::ToolNotInScope { tool: tool()? },
        Reason::MaxCallsExceeded => Error::MaxCallsExceeded {
            tool: tool()?,
            limit: f.count()?,
            calls_made: f.count()?,
        },
        Reason::BudgetExceeded => Error::BudgetExceeded {
            budget: f.int()?,
            committed: f.int()?,
            reserved: f.int()?,
            requested: given(about.cost, "cost")?,
        },
        Reason::KeyReused => Error::KeyReused {
            idempotency_key: key()?,
        },
        Reason::InProgress => Error::InProgress {
            idempotency_key: key()?,
            lease_expires_at: f.int()?,
            retry_after_ms: f.int()?,
        },
        Reason::ToolHeld => Error::ToolHeld {
            tool: tool()?,
            uncertain_key: stored_key(f)?,
        },
        Reason::DuplicateSuspected => Error::DuplicateSuspected {
            tool: tool()?,
            earlier_key: stored_key(f)?,
        },
        Reason::AttemptNotFound => Error::AttemptNotFound {
            idempotency_key: key()?,
        },
        Reason::AttemptMismatch => Error::AttemptMismatch {
            idempotency_key: key()?,
        },
        Reason::AttemptHolderMismatch => Error::AttemptHolderMismatch {
            idempotency_key: key()?,
        },
        Reason::ApproverIsRequester => Error::ApproverIsRequester {
            idempotency_key: key()?,
        },
        Reason::StateConflict => Error::StateConflict {
            state: decode_state(f.int()?)?,
        },
        Reason::InvalidRequest => {
            let field = capped(f.string()?);
            invalid(&field, capped(f.string()?))
        }
        Reason::StoreUnavailable => {
            // A script that would not decide (an unreadable record): the
            // operator must hear of it, as of any reply not understood.
            let why = capped(f.string()?);
            tracing::error!(%why, "a store script refused to decide");
            Error::StoreUnavailable(why)
        }
        Reason::QuotaOpenAttempts
        | Reason::QuotaAttempts
        | Reason::QuotaTenantPermits
        | Reason::QuotaPermitLifetime
        | Reason::QuotaStoreFull => Error::QuotaExceeded {
            quota: crate::domain::Quota::of(reason).expect("a quota's reason"),
            limit: f.count()?,
        },
        // Decided before the store (shedding, the deadline, keys, the
        // transport): no script answers them.
        Reason::Overloaded
        | Reason::DeadlineExceeded
        | Reason::Unauthenticated
        | Reason::RoleNotAllowed
        | Reason::MessageTooLarge => {
            return Err(malformed(format!("{} from a script", reason.as_str())));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{About, Value, open, open_ok, unpack_reply};
    use crate::domain::{AttemptState, Error, Reason, invalid};

    #[test]
    fn unpacks_what_cmsgpack_packs() {
        // ["DISPATCH", 7, -2, 300, [nil, "\x01\x02"]] as Redis's cmsgpack packs it.
        let packed = [
            0x95, 0xa8, b'D', b'I', b'S', b'P', b'A', b'T', b'C', b'H', 0x07, 0xfe, 0xcd, 0x01,
            0x2c, 0x92, 0xc0, 0xa2, 0x01, 0x02,
        ];
        assert_eq!(
            unpack_reply(&packed).unwrap(),
            vec![
                Value::BulkString(b"DISPATCH".to_vec()),
                Value::Int(7),
                Value::Int(-2),
                Value::Int(300),
                Value::Array(vec![Value::Nil, Value::BulkString(vec![1, 2])]),
            ]
        );
    }

    #[test]
    fn a_malformed_reply_is_an_error_not_a_guess() {
        for packed in [
            &[][..],                                                 // nothing
            &[0x92, 0x01],                   // an array of two holding one value
            &[0xa5, b'a'],                   // a string shorter than its length
            &[0xdd, 0xff, 0xff, 0xff, 0xff], // 4 billion elements promised, none sent
            &[0xcb, 0, 0, 0, 0, 0, 0, 0, 0], // a float: no script returns one
            &[0x01],                         // not an array
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], // u64 past i64
        ] {
            assert!(unpack_reply(packed).is_err(), "{packed:?}");
        }
    }

    /// A hostile or corrupt reply nested a million deep is an error, not
    /// a stack overflow.
    #[test]
    fn a_reply_nested_too_deep_is_malformed_not_a_crash() {
        let deep = vec![0x91u8; 1_000_000]; // fixarray(1), a million times
        assert!(unpack_reply(&deep).is_err());
        let mut ok = vec![0x91u8; 3];
        ok.push(0x01);
        assert!(unpack_reply(&ok).is_ok());
    }

    proptest::proptest! {
        /// Whatever bytes Redis (or something pretending to be it) sends,
        /// decoding answers a value or STORE_UNAVAILABLE, never a panic
        /// (src/store/redis/fuzz.rs goes further).
        #[test]
        fn any_reply_decodes_or_is_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            if let Err(e) = unpack_reply(&bytes) {
                proptest::prop_assert!(matches!(e, Error::StoreUnavailable(_)), "{e:?}");
            }
        }
    }

    fn reply(values: &[&str]) -> Vec<Value> {
        values
            .iter()
            .map(|v| Value::BulkString(v.as_bytes().to_vec()))
            .collect()
    }

    /// An Authorize's context: every value a reason may need.
    fn about() -> About<'static> {
        About {
            tool: Some("search"),
            cost: Some(25),
            ..About::key("p1", "k1")
        }
    }

    fn error_of(values: &[&str], about: &About) -> Error {
        open(reply(values), about).err().expect("an error reply")
    }

    #[test]
    fn every_reason_a_script_returns_decodes_to_its_error() {
        for &reason in Reason::ALL {
            let fields: &[&str] = match reason {
                Reason::PermitExpired => &["900"],
                Reason::MaxCallsExceeded => &["3", "3"],
                Reason::BudgetExceeded => &["100", "50", "40"],
                Reason::InProgress => &["1500", "500"],
                Reason::DuplicateSuspected | Reason::ToolHeld => &["k0"],
                Reason::StateConflict => &["2"],
                Reason::QuotaOpenAttempts
                | Reason::QuotaAttempts
                | Reason::QuotaTenantPermits
                | Reason::QuotaPermitLifetime
                | Reason::QuotaStoreFull => &["100"],
                Reason::InvalidRequest => &["succeeded.actual_cost", "too high"],
                Reason::StoreUnavailable => &["a permit id given twice"],
                Reason::Overloaded
                | Reason::DeadlineExceeded
                | Reason::Unauthenticated
                | Reason::RoleNotAllowed
                | Reason::MessageTooLarge => continue,
                _ => &[],
            };
            let mut values = vec!["ERR", reason.as_str()];
            values.extend(fields);
            assert_eq!(error_of(&values, &about()).reason(), reason, "{reason:?}");
        }
        assert_eq!(
            error_of(&["ERR", "IDEMPOTENCY_IN_PROGRESS", "1500", "500"], &about()),
            Error::InProgress {
                idempotency_key: "k1".into(),
                lease_expires_at: 1500,
                retry_after_ms: 500,
            }
        );
        assert_eq!(
            error_of(&["ERR", "TOOL_HELD_UNCERTAIN", "k0"], &about()),
            Error::ToolHeld {
                tool: "search".into(),
                uncertain_key: "k0".into(),
            }
        );
        assert_eq!(
            error_of(&["ERR", "ATTEMPT_STATE_CONFLICT", "2"], &about()),
            Error::StateConflict {
                state: AttemptState::Succeeded
            }
        );
        assert_eq!(
            error_of(
                &[
                    "ERR",
                    "INVALID_REQUEST",
                    "succeeded.actual_cost",
                    "too high"
                ],
                &about()
            ),
            invalid("succeeded.actual_cost", "too high")
        );
    }

    #[test]
    fn an_unknown_reason_is_an_error_not_a_guess() {
        let unavailable =
            |e: Error| matches!(e, Error::StoreUnavailable(m) if m.starts_with("unexpected reply"));
        // Old spellings, a made-up name, and a reason no script may give.
        for name in [
            "KEY_REUSED",
            "ACTUAL_COST_TOO_HIGH",
            "PERMIT_EXISTS",
            "NOPE",
            "OVERLOADED",
            "DEADLINE_EXCEEDED",
        ] {
            assert!(unavailable(error_of(&["ERR", name], &about())), "{name}");
        }
        // A reason whose fields are missing, or that needs what the request
        // did not have (Settle has no tool).
        assert!(unavailable(error_of(&["ERR", "PERMIT_EXPIRED"], &about())));
        assert!(unavailable(error_of(
            &["ERR", "ATTEMPT_STATE_CONFLICT", "9"],
            &about()
        )));
        let settle = About::key("p1", "k1");
        assert!(unavailable(error_of(
            &["ERR", "TOOL_NOT_IN_SCOPE"],
            &settle
        )));
        // A verdict a script does not give.
        assert!(unavailable(
            open_ok(reply(&["DISPATCH"]), &about()).err().unwrap()
        ));
        assert!(open_ok(reply(&["OK"]), &about()).is_ok());
    }

    /// Found by fuzzing: a reply that was not understood was echoed whole
    /// into the client's error (megabytes for a long string where a number
    /// was due), and so were a script error's texts and keys.
    #[test]
    fn a_huge_reply_makes_a_small_error() {
        let huge = "\0".repeat(1 << 20);
        let small = |e: Error| matches!(&e, Error::StoreUnavailable(m) if m.len() < 400);
        let errors = [
            error_of(&["ERR", &huge], &about()),
            error_of(&["ERR", "STORE_UNAVAILABLE", &huge], &about()),
            error_of(&["ERR", "TOOL_HELD_UNCERTAIN", &huge], &about()),
            error_of(&["ERR", "DUPLICATE_REQUEST_SUSPECTED", "k\n"], &about()),
            open_ok(reply(&[&huge]), &about())
                .err()
                .expect("a verdict no script gives"),
        ];
        for error in errors {
            assert!(small(error.clone()), "{:.100}", error.to_string());
        }
        let Error::InvalidRequest(v) =
            error_of(&["ERR", "INVALID_REQUEST", &huge, &huge], &about())
        else {
            panic!("INVALID_REQUEST");
        };
        assert!(v[0].field.len() < 300 && v[0].description.len() < 300);
        let nested = vec![Value::Array(vec![Value::BulkString(vec![0; 1 << 20])])];
        let error = open(nested, &about()).err().expect("not a verdict");
        assert!(small(error));
    }
}
