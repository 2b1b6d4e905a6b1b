//! Script replies: the msgpack string every script answers, unpacked into
//! RESP values ([`unpack_reply`]), read field by field ([`Fields`]) into
//! attempts and usage. Anything atmost cannot read is an error, never a
//! guess.

use super::codec::{decode_state, id_text};
use crate::domain::{Attempt, AttemptState, Error, Receipt, Usage, invalid};
use redis::Value;

// === errors ===

/// A reply atmost cannot read: UNAVAILABLE, as the store's answer is
/// unknown.
pub(super) fn malformed(what: impl std::fmt::Display) -> Error {
    Error::StoreUnavailable(format!("unexpected reply from the store: {what}"))
}

// === reading replies ===

/// Reads a script's reply array field by field.
pub(super) struct Fields(std::vec::IntoIter<Value>);

impl Fields {
    pub(super) fn new(values: Vec<Value>) -> Self {
        Self(values.into_iter())
    }

    pub(super) fn next(&mut self) -> Option<Value> {
        self.0.next()
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
            Value::BulkString(b) => parse_int(&b),
            other => Err(malformed(format!(
                "{other:?} where an integer was expected"
            ))),
        }
    }

    pub(super) fn array(&mut self) -> Result<Vec<Value>, Error> {
        as_array(self.value()?)
    }
}

// === msgpack ===

/// A script's reply, as packed by [`script_text`](super::script_text),
/// unpacked into the list of values the script returned.
pub fn unpack_reply(packed: &[u8]) -> Result<Vec<Value>, Error> {
    as_array(from_msgpack(&mut &packed[..])?)
}

/// Unpacks a script's msgpack reply straight into the RESP values the
/// decoders read, with no intermediate tree: Lua strings come as msgpack
/// strings, Lua integers as integers, Lua sequences as arrays (cmsgpack packs
/// nothing else from atmost's scripts).
fn from_msgpack(rd: &mut &[u8]) -> Result<Value, Error> {
    use rmp::Marker;
    use rmp::decode::RmpRead;
    fn bad(e: impl std::fmt::Debug) -> Error {
        malformed(format!("a reply that is not msgpack: {e:?}"))
    }
    pub(super) fn bytes(rd: &mut &[u8], len: usize) -> Result<Value, Error> {
        if rd.len() < len {
            return Err(malformed("a truncated reply"));
        }
        let (head, rest) = rd.split_at(len);
        *rd = rest;
        Ok(Value::BulkString(head.to_vec()))
    }
    pub(super) fn array(rd: &mut &[u8], len: usize) -> Result<Value, Error> {
        // Every element takes at least a byte: a corrupt length cannot
        // make this allocate more than the reply's size.
        let mut values = Vec::with_capacity(len.min(rd.len()));
        for _ in 0..len {
            values.push(from_msgpack(rd)?);
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
        Marker::FixArray(n) => array(rd, n.into()),
        Marker::Array16 => {
            let n = rd.read_data_u16().map_err(bad)?;
            array(rd, n.into())
        }
        Marker::Array32 => {
            let n = rd.read_data_u32().map_err(bad)?;
            array(rd, n as usize)
        }
        other => Err(malformed(format!("{other:?} in a script reply"))),
    }
}

pub(super) fn as_array(value: Value) -> Result<Vec<Value>, Error> {
    match value {
        Value::Array(values) => Ok(values),
        other => Err(malformed(format!("{other:?} where an array was expected"))),
    }
}

pub(super) fn parse_int(bytes: &[u8]) -> Result<i64, Error> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| malformed("not an integer"))
}

// === records in replies ===

/// Decodes lib.lua's `attempt_reply`.
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
        duplicate_of: None,
    })
}

/// Decodes lib.lua's `usage_reply`.
pub(super) fn decode_usage(values: Vec<Value>) -> Result<Usage, Error> {
    let mut f = Fields::new(values);
    let tool = f.string()?;
    let calls_made = f.int()? as u64;
    let has_limit = f.int()? == 1;
    let limit = f.int()? as u64;
    let has_budget = f.int()? == 1;
    let remaining = f.int()?;
    Ok(Usage {
        tool,
        calls_made,
        calls_limit: has_limit.then_some(limit),
        budget_remaining: has_budget.then_some(remaining),
    })
}

/// The errors of settle.lua and mark_uncertain.lua, after "ERR".
pub(super) fn attempt_error(f: &mut Fields, permit_id: &str, key: &str) -> Result<Error, Error> {
    Ok(match f.string()?.as_str() {
        "PERMIT_NOT_FOUND" => Error::PermitNotFound {
            permit_id: permit_id.to_owned(),
        },
        "ATTEMPT_NOT_FOUND" => Error::AttemptNotFound {
            idempotency_key: key.to_owned(),
        },
        "ATTEMPT_MISMATCH" => Error::AttemptMismatch {
            idempotency_key: key.to_owned(),
        },
        "ATTEMPT_STATE_CONFLICT" => Error::StateConflict {
            state: decode_state(f.int()?)?,
        },
        "ACTUAL_COST_TOO_HIGH" => invalid(
            "succeeded.actual_cost",
            format!("may not exceed the reserved cost {}", f.int()?),
        ),
        other => return Err(malformed(other)),
    })
}

#[cfg(test)]
mod tests {
    use super::{Value, unpack_reply};

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
}
