//! The request fingerprint every atmost client computes the same way:
//! SHA-256 of the request's RFC 8785 (JSON Canonicalization Scheme) form in
//! UTF-8, so a Python agent and a Rust gateway that send the same JSON
//! request under one idempotency key are one request to atmost.

use sha2::{Digest, Sha256};

/// SHA-256 of the RFC 8785 canonical JSON of `value`: keys sorted by UTF-16
/// code units, no whitespace, numbers as ECMAScript prints doubles, strings
/// with the minimal escapes. The vectors every client reproduces are in
/// `clients/testdata/fingerprint_vectors.json`.
///
/// ```
/// let a = atmost_client::fingerprint(&serde_json::json!({"amount": 500, "to": "acct_42"}));
/// let b: serde_json::Value = serde_json::from_str(r#"{ "to" : "acct_42", "amount" : 5e2 }"#).unwrap();
/// assert_eq!(a, atmost_client::fingerprint(&b));
/// ```
///
/// A `serde_json::Value` always canonicalizes (its keys are strings, its
/// numbers finite), so this cannot fail; it would panic only on a number
/// no double can hold, which exists only when something in the build turns
/// on serde_json's `arbitrary_precision` feature.
pub fn fingerprint(value: &serde_json::Value) -> [u8; 32] {
    let canonical = serde_json_canonicalizer::to_vec(value)
        .expect("a serde_json::Value canonicalizes: string keys, finite numbers");
    Sha256::digest(canonical).into()
}

#[cfg(test)]
mod tests;
