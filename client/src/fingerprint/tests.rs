//! Every vector of `clients/testdata/fingerprint_vectors.json` (made with
//! Python's `rfc8785`, not with any client's code): parsed with serde_json,
//! canonicalized, hashed; and every request it lists as refused, refused.

use std::collections::BTreeMap;

use super::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn shared() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../clients/testdata/fingerprint_vectors.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_json::from_str(&text).expect("the vectors parse")
}

#[test]
fn every_shared_vector_is_reproduced() {
    let file = shared();
    let vectors = file["vectors"].as_array().expect("a list of vectors");
    assert!(
        vectors.len() >= 14,
        "the file lost vectors: {}",
        vectors.len()
    );
    for v in vectors {
        let name = v["name"].as_str().expect("name");
        let input: serde_json::Value =
            serde_json::from_str(v["json"].as_str().expect("json")).expect(name);
        let canonical = serde_json_canonicalizer::to_string(&input).expect(name);
        assert_eq!(
            canonical,
            v["canonical"].as_str().expect("canonical"),
            "{name}"
        );
        assert_eq!(
            hex(&fingerprint(&input).expect(name)),
            v["sha256"].as_str().expect("sha256"),
            "{name}"
        );
    }
}

#[test]
fn every_shared_refusal_is_refused_where_the_number_is() {
    let file = shared();
    let refused = file["refused"].as_array().expect("a list of refusals");
    assert!(
        refused.len() >= 7,
        "the file lost refusals: {}",
        refused.len()
    );
    for r in refused {
        let name = r["name"].as_str().expect("name");
        let input: serde_json::Value =
            serde_json::from_str(r["json"].as_str().expect("json")).expect(name);
        let error = fingerprint(&input).expect_err(name);
        assert_eq!(error.path, r["path"].as_str().expect("path"), "{name}");
        assert!(error.why.contains("2^53"), "{name}: {error}");
    }
}

#[test]
fn every_value_json_cannot_hold_is_refused() {
    let file = shared();
    let names: Vec<&str> = file["not_json"]
        .as_array()
        .expect("a list of values")
        .iter()
        .map(|v| v["name"].as_str().expect("name"))
        .collect();
    assert!(names.len() >= 4, "the file lost values: {names:?}");
    for name in names {
        let refused = match name {
            "NaN" => fingerprint(&f64::NAN),
            "Infinity" => fingerprint(&BTreeMap::from([("x", f64::INFINITY)])),
            "-Infinity" => fingerprint(&[1.0, f64::NEG_INFINITY]),
            "NaN at depth" => fingerprint(&BTreeMap::from([(
                "z",
                vec![BTreeMap::from([("b", f64::NAN)])],
            )])),
            other => panic!("no Rust value for the shared case {other:?}: add one"),
        };
        let error = refused.expect_err(name);
        assert!(error.why.contains("NaN"), "{name}: {error}");
    }
}

#[test]
fn the_largest_safe_numbers_are_taken() {
    for n in [MAX_SAFE_NUMBER as f64, -(MAX_SAFE_NUMBER as f64)] {
        assert!(fingerprint(&n).is_ok(), "{n}");
    }
    assert!(fingerprint(&MAX_SAFE_NUMBER).is_ok());
    assert!(fingerprint(&-(MAX_SAFE_NUMBER as i64)).is_ok());
    assert!(fingerprint(&(MAX_SAFE_NUMBER + 1)).is_err());
    assert!(fingerprint(&(-(MAX_SAFE_NUMBER as i64) - 1)).is_err());
    assert!(fingerprint(&i64::MIN).is_err());
}

#[test]
fn the_same_request_written_differently_has_one_fingerprint() {
    let a = serde_json::json!({"amount": 500, "currency": "EUR"});
    let b: serde_json::Value =
        serde_json::from_str("{ \"currency\": \"EUR\",\n \"amount\": 5.00e2 }").expect("json");
    assert_eq!(fingerprint(&a), fingerprint(&b));
    let c = serde_json::json!({"amount": 501, "currency": "EUR"});
    assert_ne!(fingerprint(&a), fingerprint(&c));
}
