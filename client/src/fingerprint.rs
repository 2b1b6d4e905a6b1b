//! The request fingerprint every atmost client computes the same way:
//! SHA-256 of the request's RFC 8785 (JSON Canonicalization Scheme) form in
//! UTF-8, so a Python agent and a Rust gateway that send the same JSON
//! request under one idempotency key are one request to atmost.

use serde::Serialize;
use sha2::{Digest, Sha256};

/// The largest magnitude a number in a fingerprinted request may have:
/// 2^53 - 1. Past it, doubles no longer hold every integer, so a
/// JavaScript reader (and RFC 8785, which prints every number as a double)
/// cannot tell 9007199254740993 from 9007199254740992: two different calls
/// would share a fingerprint. Send such a number as a string.
pub const MAX_SAFE_NUMBER: u64 = (1 << 53) - 1;

/// Why a request has no fingerprint: it holds a value JSON cannot carry
/// exactly (NaN, an infinity, a number past ±(2^53 - 1)) or something
/// that is not JSON at all (a map with non-string keys). `path` is where,
/// as a JSON Pointer (RFC 6901; empty for the whole request).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the request cannot be fingerprinted: {}: {why}", if .path.is_empty() { "the request" } else { .path.as_str() })]
pub struct FingerprintError {
    pub path: String,
    pub why: String,
}

/// SHA-256 of the RFC 8785 canonical JSON of `value`: keys sorted by UTF-16
/// code units, no whitespace, numbers as ECMAScript prints doubles, strings
/// with the minimal escapes. The vectors every client reproduces, and the
/// requests every client refuses, are in
/// `clients/testdata/fingerprint_vectors.json`.
///
/// ```
/// let a = atmost_client::fingerprint(&serde_json::json!({"amount": 500, "to": "acct_42"}))?;
/// let b: serde_json::Value = serde_json::from_str(r#"{ "to" : "acct_42", "amount" : 5e2 }"#).unwrap();
/// assert_eq!(a, atmost_client::fingerprint(&b)?);
/// // Past 2^53 - 1 two integers would share a fingerprint: refused.
/// let big: serde_json::Value = serde_json::from_str(r#"{"account": 9007199254740993}"#).unwrap();
/// assert!(atmost_client::fingerprint(&big).is_err());
/// # Ok::<(), atmost_client::FingerprintError>(())
/// ```
///
/// Any `Serialize` value is taken, so a struct with an `f64::NAN` field is
/// refused here rather than turned into `null` (as `serde_json::json!` and
/// `to_value` turn it, before any fingerprint could see it).
pub fn fingerprint<T: Serialize + ?Sized>(value: &T) -> Result<[u8; 32], FingerprintError> {
    // The request as it is (serde_json::to_value would make a NaN null and
    // serde_json_canonicalizer a u64 a double before anything could look).
    let tree = serde_value::to_value(value).map_err(|e| FingerprintError {
        path: String::new(),
        why: e.to_string(),
    })?;
    check_numbers(&tree, &mut String::new())?;
    let canonical = serde_json_canonicalizer::to_vec(&tree).map_err(|e| FingerprintError {
        path: String::new(),
        why: e.to_string(),
    })?;
    Ok(Sha256::digest(canonical).into())
}

/// Every number in `value` finite and within ±[`MAX_SAFE_NUMBER`]; `path`
/// is where `value` is.
fn check_numbers(value: &serde_value::Value, path: &mut String) -> Result<(), FingerprintError> {
    use serde_value::Value;
    let refuse = |why: String| {
        Err(FingerprintError {
            path: path.clone(),
            why,
        })
    };
    let past = |n: &dyn std::fmt::Display| {
        format!(
            "{n} is outside ±(2^53 - 1), where JSON numbers stop being exact: send it as a string"
        )
    };
    let float = |f: f64| {
        if !f.is_finite() {
            refuse(format!("{f} (NaN and the infinities have no JSON form)"))
        } else if f.abs() > MAX_SAFE_NUMBER as f64 {
            refuse(past(&f))
        } else {
            Ok(())
        }
    };
    let within = |magnitude: u64, n: &dyn std::fmt::Display| {
        if magnitude <= MAX_SAFE_NUMBER {
            Ok(())
        } else {
            refuse(past(n))
        }
    };
    match value {
        Value::U64(u) => within(*u, u),
        Value::I64(i) => within(i.unsigned_abs(), i),
        Value::U32(u) => within(u64::from(*u), u),
        Value::I32(i) => within(u64::from(i.unsigned_abs()), i),
        Value::F64(f) => float(*f),
        Value::F32(f) => float(f64::from(*f)),
        Value::Option(Some(inner)) | Value::Newtype(inner) => check_numbers(inner, path),
        Value::Seq(items) => items.iter().enumerate().try_for_each(|(i, item)| {
            let len = path.len();
            path.push_str(&format!("/{i}"));
            let checked = check_numbers(item, path);
            path.truncate(len);
            checked
        }),
        Value::Map(fields) => fields.iter().try_for_each(|(key, item)| {
            let len = path.len();
            path.push('/');
            let key = match key {
                Value::String(key) => key.clone(),
                other => format!("{other:?}"),
            };
            path.push_str(&key.replace('~', "~0").replace('/', "~1"));
            let checked = check_numbers(item, path);
            path.truncate(len);
            checked
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests;
