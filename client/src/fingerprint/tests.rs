//! Every vector of `clients/testdata/fingerprint_vectors.json` (made with
//! Python's `rfc8785`, not with any client's code): parsed with serde_json,
//! canonicalized, hashed.

use super::*;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_shared_vector_is_reproduced() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../clients/testdata/fingerprint_vectors.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let file: serde_json::Value = serde_json::from_str(&text).expect("the vectors parse");
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
            hex(&fingerprint(&input)),
            v["sha256"].as_str().expect("sha256"),
            "{name}"
        );
    }
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
