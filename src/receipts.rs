//! Signed receipts: every SUCCEEDED receipt atmost answers carries an
//! Ed25519 signature over a canonical encoding of what it attests, and the
//! id of the key that made it, so a tool provider (or an auditor) can check
//! offline that atmost issued it, unchanged, under which tenant's permit.
//!
//! The signature is made when the receipt is sent, not stored: Ed25519 is
//! deterministic, so the same receipt under the same key always carries
//! the same signature, and a key rotation signs old receipts anew.
//!
//! The canonical encoding, the bytes that are signed, opens with a tag
//! naming its version, so bytes of one version are never those of another:
//!
//! ```text
//! "atmost.receipt.v2" 0x00        (version 1: "atmost.receipt.v1" 0x00)
//! then each field as a 4-byte big-endian length and its bytes:
//!   tenant (version 2 only: the permit's; "" in dev mode, a zero length),
//!   permit_id, tool, idempotency_key, request_fingerprint, attempt_id,
//!   receipt_id, outcome ("SUCCEEDED"), SHA-256 of the result (32 bytes),
//!   cost (8 bytes, big-endian i64), issued_at (ms since the epoch,
//!   8 bytes, big-endian i64)
//! ```
//!
//! atmost signs version 2. Version 1, which atmost signed before, signs
//! no tenant: it still verifies, but proves nothing about whose permit the
//! receipt came from.

use crate::domain::{Attempt, Receipt};
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey};
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use sha2::{Digest, Sha256};
use std::path::Path;

/// A version of the canonical encoding, with what it signs beyond the
/// attempt and its receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding<'a> {
    /// Version 1: no tenant.
    V1,
    /// Version 2: the tenant of the receipt's permit ("" in dev mode).
    V2 { tenant: &'a str },
}

impl Encoding<'_> {
    /// The version atmost signs.
    pub const CURRENT: u32 = 2;

    /// Its number, as `Receipt.signature_version` carries it.
    pub fn version(self) -> u32 {
        match self {
            Encoding::V1 => 1,
            Encoding::V2 { .. } => 2,
        }
    }

    /// The tag that opens the signed bytes: the version is signed too.
    fn tag(self) -> &'static [u8] {
        match self {
            Encoding::V1 => b"atmost.receipt.v1\0",
            Encoding::V2 { .. } => b"atmost.receipt.v2\0",
        }
    }
}

/// The bytes a receipt's signature covers, in `encoding`.
pub fn canonical(
    encoding: Encoding,
    permit_id: &str,
    tool: &str,
    idempotency_key: &str,
    request_fingerprint: &[u8],
    attempt_id: &str,
    receipt: &Receipt,
) -> Vec<u8> {
    let mut out = encoding.tag().to_vec();
    let result_digest: [u8; 32] = Sha256::digest(&receipt.result).into();
    let tenant = match encoding {
        Encoding::V1 => None,
        Encoding::V2 { tenant } => Some(tenant.as_bytes()),
    };
    for field in tenant.into_iter().chain([
        permit_id.as_bytes(),
        tool.as_bytes(),
        idempotency_key.as_bytes(),
        request_fingerprint,
        attempt_id.as_bytes(),
        receipt.receipt_id.as_bytes(),
        b"SUCCEEDED",
        &result_digest,
        &receipt.cost.to_be_bytes(),
        &receipt.issued_at.to_be_bytes(),
    ]) {
        out.extend_from_slice(&(field.len() as u32).to_be_bytes());
        out.extend_from_slice(field);
    }
    out
}

/// A public key's id: hex of the first 8 bytes of SHA-256 of its 32 bytes.
pub fn key_id(key: &VerifyingKey) -> String {
    Sha256::digest(key.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The keys of a signer: one that signs, and every one whose signatures
/// still verify (the signing key's included).
#[derive(Debug)]
pub struct ReceiptKeys {
    signing: SigningKey,
    signing_id: String,
    verify: Vec<(String, VerifyingKey)>,
}

/// What checking a receipt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Signed by a known key, over exactly these fields.
    Verified,
    /// Signed by a known key, but not over these fields (or not at all).
    Forged,
    /// Signed by a key not among those given.
    UnknownKey,
}

impl ReceiptKeys {
    pub fn new(signing: SigningKey, also_verify: Vec<VerifyingKey>) -> Self {
        let public = signing.verifying_key();
        let signing_id = key_id(&public);
        let mut verify = vec![(signing_id.clone(), public)];
        for key in also_verify {
            let id = key_id(&key);
            if !verify.iter().any(|(known, _)| *known == id) {
                verify.push((id, key));
            }
        }
        Self {
            signing,
            signing_id,
            verify,
        }
    }

    /// Reads the signing key (PKCS#8 PEM, as `openssl genpkey -algorithm
    /// ed25519` writes it) and, optionally, more public keys to accept
    /// (SPKI PEM blocks, as `openssl pkey -pubout` writes them, one after
    /// another in one file): the keys of a rotation.
    pub fn load(signing: &Path, verify: Option<&Path>) -> Result<Self, String> {
        let read =
            |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
        let key = SigningKey::from_pkcs8_pem(&read(signing)?).map_err(|e| {
            format!(
                "{}: not an Ed25519 private key in PKCS#8 PEM: {e}",
                signing.display()
            )
        })?;
        let mut also = Vec::new();
        if let Some(path) = verify {
            let text = read(path)?;
            let blocks = pem_blocks(&text);
            // Every line belongs to a whole PEM block: a file half written,
            // or a key pasted without its armour, is refused, not read as
            // fewer keys.
            let covered: usize = blocks.iter().map(|b| b.lines().count()).sum();
            let lines = text.lines().filter(|l| !l.trim().is_empty()).count();
            if covered != lines {
                return Err(format!(
                    "{}: holds text outside complete PEM blocks (BEGIN ... END)",
                    path.display()
                ));
            }
            for block in blocks {
                also.push(VerifyingKey::from_public_key_pem(&block).map_err(|e| {
                    format!("{}: not an Ed25519 public key in PEM: {e}", path.display())
                })?);
            }
        }
        Ok(Self::new(key, also))
    }

    /// The id of the key that signs now.
    pub fn signing_key_id(&self) -> &str {
        &self.signing_id
    }

    /// (key id, public key, whether it signs now), for GetSigningKeys.
    pub fn public_keys(&self) -> impl Iterator<Item = (&str, &VerifyingKey, bool)> {
        self.verify
            .iter()
            .map(|(id, key)| (id.as_str(), key, *id == self.signing_id))
    }

    /// The signature of an attempt's receipt, in the current encoding
    /// (version 2): `tenant` is its permit's.
    pub fn sign(&self, tenant: &str, attempt: &Attempt, receipt: &Receipt) -> Vec<u8> {
        let message = canonical(
            Encoding::V2 { tenant },
            &attempt.permit_id,
            &attempt.tool,
            &attempt.idempotency_key,
            &attempt.request_fingerprint,
            &attempt.attempt_id,
            receipt,
        );
        self.signing.sign(&message).to_bytes().to_vec()
    }
}

/// The receipt keys in force, and the files they come from: read again on
/// SIGHUP and whenever either file changes (the server's file watch), so a rotation
/// (a new signing key, the old one moved to the verify keys) needs no
/// restart. Files that do not load keep the keys in force.
#[derive(Debug)]
pub struct ReceiptSigner {
    signing: std::path::PathBuf,
    verify: Option<std::path::PathBuf>,
    keys: std::sync::RwLock<std::sync::Arc<ReceiptKeys>>,
    /// SHA-256 of the files' contents last read.
    seen: std::sync::Mutex<[u8; 32]>,
}

impl ReceiptSigner {
    pub fn load(signing: &Path, verify: Option<&Path>) -> Result<Self, String> {
        // The digest first: a change while the keys are read is read again.
        let seen = Self::digest(signing, verify);
        let keys = ReceiptKeys::load(signing, verify)?;
        Ok(Self {
            signing: signing.to_owned(),
            verify: verify.map(Path::to_owned),
            keys: std::sync::RwLock::new(std::sync::Arc::new(keys)),
            seen: std::sync::Mutex::new(seen),
        })
    }

    fn digest(signing: &Path, verify: Option<&Path>) -> [u8; 32] {
        let mut hash = Sha256::new();
        for path in std::iter::once(signing).chain(verify) {
            hash.update(std::fs::read(path).unwrap_or_default());
            hash.update([0]);
        }
        hash.finalize().into()
    }

    /// The keys in force.
    pub fn current(&self) -> std::sync::Arc<ReceiptKeys> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the files again if they changed (or if `force`); Ok(true)
    /// when new keys took effect.
    pub fn reload(&self, force: bool) -> Result<bool, String> {
        let digest = Self::digest(&self.signing, self.verify.as_deref());
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if !force && *seen == digest {
                return Ok(false);
            }
            *seen = digest;
        }
        let keys = ReceiptKeys::load(&self.signing, self.verify.as_deref())?;
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = std::sync::Arc::new(keys);
        Ok(true)
    }

    /// [`ReceiptSigner::reload`], logged.
    pub fn refresh(&self, force: bool) {
        match self.reload(force) {
            Ok(true) => tracing::info!(
                key_id = self.current().signing_key_id(),
                "receipt keys reloaded"
            ),
            Ok(false) => {}
            Err(why) => tracing::error!(%why, "receipt keys not reloaded; the keys in force stay"),
        }
    }
}

/// Checks a signature made by `key_id` over `message` against `keys`.
pub fn verify(
    keys: &[(String, VerifyingKey)],
    key_id: &str,
    message: &[u8],
    signature: &[u8],
) -> Verdict {
    let Some((_, key)) = keys.iter().find(|(id, _)| id == key_id) else {
        return Verdict::UnknownKey;
    };
    match Signature::from_slice(signature) {
        Ok(sig) if key.verify(message, &sig).is_ok() => Verdict::Verified,
        _ => Verdict::Forged,
    }
}

/// The PEM blocks of a file holding several.
pub fn pem_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if line.starts_with("-----BEGIN ") {
            current.clear();
        }
        current.push_str(line);
        current.push('\n');
        if line.starts_with("-----END ") {
            blocks.push(std::mem::take(&mut current));
        }
    }
    blocks
}

/// The encoding a receipt names by its `signature_version` and `tenant`:
/// 2 signs the tenant; 1 signs none, and so does 0 (receipts signed before
/// version 2 name no version). A tenant given with version 1 was never
/// signed: refused, so that no reader takes it for proven.
pub fn encoding(signature_version: u32, tenant: &str) -> Result<Encoding<'_>, String> {
    match signature_version {
        0 | 1 if tenant.is_empty() => Ok(Encoding::V1),
        0 | 1 => Err(format!(
            "tenant {tenant:?} is given, but a version 1 signature does not cover a tenant"
        )),
        2 => Ok(Encoding::V2 { tenant }),
        v => Err(format!(
            "signature version {v} is not one this verifier knows (1, 2)"
        )),
    }
}

/// What [`verify_json`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub verdict: Verdict,
    /// The encoding's version the receipt names (1 or 2).
    pub version: u32,
    /// With version 2, the tenant it names (signed if `verdict` is
    /// Verified); `None` with version 1, which signs no tenant.
    pub tenant: Option<String>,
}

/// Checks the receipt of an attempt given as grpcurl prints it (proto3
/// JSON: camelCase or snake_case names, bytes in base64, `cost` a number
/// or a string, `issuedAt` RFC 3339, `signatureVersion` absent for a
/// receipt signed before version 2), against the public keys of a PEM
/// file (`atmost receipt verify`).
pub fn verify_json(attempt: &str, keys_pem: &str) -> Result<Checked, String> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let v: serde_json::Value =
        serde_json::from_str(attempt).map_err(|e| format!("not JSON: {e}"))?;
    // An AuthorizeResponse or CommitResponse is accepted too: its attempt.
    let a = v.get("attempt").unwrap_or(&v);
    // One spelling per field: a document carrying both could show a
    // reader values nobody signed.
    for obj in [a, a.get("receipt").unwrap_or(&serde_json::Value::Null)] {
        if let Some(map) = obj.as_object() {
            for (name, _) in map {
                let snake: String = name
                    .chars()
                    .flat_map(|c| {
                        if c.is_ascii_uppercase() {
                            vec!['_', c.to_ascii_lowercase()]
                        } else {
                            vec![c]
                        }
                    })
                    .collect();
                if snake != *name && map.contains_key(&snake) {
                    return Err(format!("{name} and {snake} are both given"));
                }
            }
        }
    }
    let field = |obj: &serde_json::Value, camel: &str, snake: &str| -> Option<serde_json::Value> {
        obj.get(camel).or_else(|| obj.get(snake)).cloned()
    };
    let text = |obj: &serde_json::Value, camel: &str, snake: &str| -> Result<String, String> {
        match field(obj, camel, snake) {
            Some(serde_json::Value::String(s)) => Ok(s),
            None => Ok(String::new()),
            Some(_) => Err(format!("{camel} is not a string")),
        }
    };
    let bytes = |obj: &serde_json::Value, camel: &str, snake: &str| -> Result<Vec<u8>, String> {
        b64.decode(text(obj, camel, snake)?)
            .map_err(|e| format!("{camel} is not base64: {e}"))
    };
    let r = field(a, "receipt", "receipt").ok_or("the attempt has no receipt")?;
    let cost = match field(&r, "cost", "cost") {
        None => 0,
        Some(serde_json::Value::Number(n)) => n.as_i64().ok_or("cost is not an integer")?,
        Some(serde_json::Value::String(s)) => s.parse().map_err(|_| "cost is not an integer")?,
        Some(_) => return Err("cost is not an integer".into()),
    };
    let issued = text(&r, "issuedAt", "issued_at")?;
    let issued_at = humantime::parse_rfc3339(&issued)
        .map_err(|e| format!("issuedAt {issued:?}: {e}"))?
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "issuedAt is before 1970")?
        .as_millis() as i64;
    let receipt = Receipt {
        receipt_id: text(&r, "receiptId", "receipt_id")?,
        result: bytes(&r, "result", "result")?,
        cost,
        issued_at,
    };
    let version = match field(&r, "signatureVersion", "signature_version") {
        None => Some(0),
        Some(serde_json::Value::Number(n)) => n.as_u64().and_then(|v| u32::try_from(v).ok()),
        Some(serde_json::Value::String(s)) => s.parse().ok(),
        Some(_) => None,
    }
    .ok_or("signatureVersion is not a version number")?;
    let tenant = text(&r, "tenant", "tenant")?;
    let encoding = encoding(version, &tenant)?;
    let message = canonical(
        encoding,
        &text(a, "permitId", "permit_id")?,
        &text(a, "tool", "tool")?,
        &text(a, "idempotencyKey", "idempotency_key")?,
        &bytes(a, "requestFingerprint", "request_fingerprint")?,
        &text(a, "attemptId", "attempt_id")?,
        &receipt,
    );
    let mut keys = Vec::new();
    for block in pem_blocks(keys_pem) {
        let key = VerifyingKey::from_public_key_pem(&block)
            .map_err(|e| format!("not an Ed25519 public key in PEM: {e}"))?;
        keys.push((key_id(&key), key));
    }
    if keys.is_empty() {
        return Err("no public key in the keys file".into());
    }
    Ok(Checked {
        verdict: verify(
            &keys,
            &text(&r, "keyId", "key_id")?,
            &message,
            &bytes(&r, "signature", "signature")?,
        ),
        version: encoding.version(),
        tenant: match encoding {
            Encoding::V1 => None,
            Encoding::V2 { tenant } => Some(tenant.to_owned()),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::AttemptState;

    fn attempt() -> (Attempt, Receipt) {
        let receipt = Receipt {
            receipt_id: "01a22e00-0000-7000-8000-000000000002".into(),
            result: b"wallet tx 981".to_vec(),
            cost: 250,
            issued_at: 1_767_225_600_000,
        };
        let attempt = Attempt {
            attempt_id: "01a22e00-0000-7000-8000-000000000001".into(),
            permit_id: "01a22e00-0000-7000-8000-000000000000".into(),
            tool: "payments.charge".into(),
            idempotency_key: "order-42".into(),
            request_fingerprint: vec![7; 32],
            cost: 250,
            state: AttemptState::Succeeded,
            created_at: 1_767_225_599_000,
            lease_expires_at: 1_767_225_629_000,
            receipt: Some(receipt.clone()),
            failure_reason: String::new(),
            uncertain_reason: String::new(),
            uncertain_since: 0,
            duplicate_of: None,
            reserved_by: String::new(),
            approval: None,
        };
        (attempt, receipt)
    }

    /// The bytes of `encoding` for an attempt and its receipt.
    fn bytes_of(encoding: Encoding, a: &Attempt, r: &Receipt) -> Vec<u8> {
        canonical(
            encoding,
            &a.permit_id,
            &a.tool,
            &a.idempotency_key,
            &a.request_fingerprint,
            &a.attempt_id,
            r,
        )
    }

    #[test]
    fn a_receipt_verifies_and_any_changed_field_is_forged() {
        let keys = ReceiptKeys::new(SigningKey::from_bytes(&[1; 32]), Vec::new());
        let (a, r) = attempt();
        let signature = keys.sign("acme", &a, &r);
        assert_eq!(signature, keys.sign("acme", &a, &r), "deterministic");
        let known: Vec<_> = keys.verify.clone();
        let check = |tenant: &str, a: &Attempt, r: &Receipt| {
            let m = bytes_of(Encoding::V2 { tenant }, a, r);
            verify(&known, keys.signing_key_id(), &m, &signature)
        };
        assert_eq!(check("acme", &a, &r), Verdict::Verified);
        type Edit = Box<dyn Fn(&mut String, &mut Attempt, &mut Receipt)>;
        let edits: Vec<Edit> = vec![
            Box::new(|t, _, _| t.push('x')),
            Box::new(|t, _, _| *t = "globex".into()),
            // Dev mode's tenant, "", is a field of length 0: not "acme".
            Box::new(|t, _, _| t.clear()),
            Box::new(|_, a, _| a.permit_id.push('x')),
            Box::new(|_, a, _| a.tool.push('x')),
            Box::new(|_, a, _| a.idempotency_key.push('x')),
            Box::new(|_, a, _| a.request_fingerprint[0] ^= 1),
            Box::new(|_, a, _| a.attempt_id.push('x')),
            Box::new(|_, _, r| r.receipt_id.push('x')),
            Box::new(|_, _, r| r.result.push(b'!')),
            Box::new(|_, _, r| r.cost += 1),
            Box::new(|_, _, r| r.issued_at += 1),
            // Moving bytes between fields changes the lengths.
            Box::new(|_, a, _| {
                a.tool = "payments.charg".into();
                a.idempotency_key = "eorder-42".into();
            }),
            Box::new(|t, a, _| {
                t.push('0');
                a.permit_id.remove(0);
            }),
        ];
        for (n, edit) in edits.iter().enumerate() {
            let (mut a, mut r) = attempt();
            let mut tenant = "acme".to_owned();
            edit(&mut tenant, &mut a, &mut r);
            assert_eq!(check(&tenant, &a, &r), Verdict::Forged, "edit {n}");
        }
        let other = ReceiptKeys::new(SigningKey::from_bytes(&[2; 32]), Vec::new());
        let m = bytes_of(Encoding::V2 { tenant: "acme" }, &a, &r);
        assert_eq!(
            verify(
                &known,
                other.signing_key_id(),
                &m,
                &other.sign("acme", &a, &r)
            ),
            Verdict::UnknownKey
        );
        assert_eq!(
            verify(&other.verify, other.signing_key_id(), &m, &signature),
            Verdict::Forged
        );
    }

    /// The version is signed: a version 1 signature never verifies as
    /// version 2 (under any tenant, dev mode's "" too), nor a version 2
    /// one as version 1.
    #[test]
    fn a_signature_of_one_version_is_forged_as_the_other() {
        let keys = ReceiptKeys::new(SigningKey::from_bytes(&[1; 32]), Vec::new());
        let (a, r) = attempt();
        let v1 = keys
            .signing
            .sign(&bytes_of(Encoding::V1, &a, &r))
            .to_bytes();
        let id = keys.signing_key_id();
        assert_eq!(
            verify(&keys.verify, id, &bytes_of(Encoding::V1, &a, &r), &v1),
            Verdict::Verified
        );
        for tenant in ["", "acme"] {
            let as_v2 = bytes_of(Encoding::V2 { tenant }, &a, &r);
            assert_eq!(verify(&keys.verify, id, &as_v2, &v1), Verdict::Forged);
            let v2 = keys.sign(tenant, &a, &r);
            assert_eq!(verify(&keys.verify, id, &as_v2, &v2), Verdict::Verified);
            let as_v1 = bytes_of(Encoding::V1, &a, &r);
            assert_eq!(verify(&keys.verify, id, &as_v1, &v2), Verdict::Forged);
        }
        // Dev mode's tenant is a field of length 0, after the tag.
        let dev = bytes_of(Encoding::V2 { tenant: "" }, &a, &r);
        assert!(dev.starts_with(b"atmost.receipt.v2\0\0\0\0\0\0\0\0\x24"));
        let acme = bytes_of(Encoding::V2 { tenant: "acme" }, &a, &r);
        assert!(acme.starts_with(b"atmost.receipt.v2\0\0\0\0\x04acme\0\0\0\x24"));
        assert_eq!(
            bytes_of(Encoding::V1, &a, &r)[18..],
            dev[22..],
            "version 2 is version 1's fields after the tenant"
        );
    }

    /// The version 1 signature of [`attempt`] under the key of seed
    /// `[1; 32]`, made by the code that signed version 1 (atmost at
    /// 7e0fdc3): the bytes of version 1 must never change.
    const V1_SIGNATURE: &str = "532af77ec1d547c75e25138f9301cc3afe9347781ee7340de811f7109f0f958abf1abfa4b4ac5bf9bcb66cf92c918837c9b536a8f5f6092ae5f7b63992362a05";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn version_1_signs_the_same_bytes_as_ever() {
        let keys = ReceiptKeys::new(SigningKey::from_bytes(&[1; 32]), Vec::new());
        let (a, r) = attempt();
        let m = bytes_of(Encoding::V1, &a, &r);
        let signature = keys.signing.sign(&m).to_bytes();
        assert_eq!(hex(&signature), V1_SIGNATURE);
        assert_eq!(
            verify(&keys.verify, keys.signing_key_id(), &m, &signature),
            Verdict::Verified
        );
    }

    /// A Commit answer of an atmost that signed version 1, as grpcurl
    /// printed it, and the keys it published (tests/data/receipt_v1).
    #[test]
    fn a_version_1_receipt_from_a_live_server_verifies() {
        let doc = include_str!("../tests/data/receipt_v1/commit.json");
        let pem = include_str!("../tests/data/receipt_v1/keys.pem");
        let checked = verify_json(doc, pem).expect("readable");
        assert_eq!(
            checked,
            Checked {
                verdict: Verdict::Verified,
                version: 1,
                tenant: None
            }
        );
        let changed = doc.replace("d2FsbGV0IHR4IDk4MQ==", "d2FsbGV0IHR4IDk4Mg==");
        assert_ne!(changed, doc);
        assert_eq!(
            verify_json(&changed, pem).map(|c| c.verdict),
            Ok(Verdict::Forged)
        );
        // Passed off as version 2, of any tenant: forged.
        let v1: serde_json::Value = serde_json::from_str(doc).expect("json");
        for tenant in [None, Some(""), Some("acme")] {
            let mut as_v2 = v1.clone();
            let receipt = &mut as_v2["attempt"]["receipt"];
            receipt["signatureVersion"] = 2.into();
            if let Some(t) = tenant {
                receipt["tenant"] = t.into();
            }
            let checked = verify_json(&as_v2.to_string(), pem).expect("readable");
            assert_eq!(checked.verdict, Verdict::Forged, "{tenant:?}");
            assert_eq!(checked.tenant.as_deref(), Some(tenant.unwrap_or("")));
        }
        // A tenant beside a version 1 signature was never signed.
        for version in [None, Some(1)] {
            let mut claimed = v1.clone();
            let receipt = &mut claimed["attempt"]["receipt"];
            receipt["tenant"] = "acme".into();
            if let Some(v) = version {
                receipt["signatureVersion"] = v.into();
            }
            let e = verify_json(&claimed.to_string(), pem).expect_err("an unsigned tenant");
            assert!(
                e.contains("version 1 signature does not cover a tenant"),
                "{e}"
            );
        }
    }

    /// A version 2 receipt as grpcurl prints it: VERIFIED with its tenant;
    /// its tenant changed, or its version, FORGED.
    #[test]
    fn a_version_2_receipt_verifies_as_json_with_its_tenant() {
        use base64::Engine;
        use ed25519_dalek::pkcs8::{EncodePublicKey, spki::der::pem::LineEnding};
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let keys = ReceiptKeys::new(SigningKey::from_bytes(&[1; 32]), Vec::new());
        let pem = keys
            .signing
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem");
        let (a, r) = attempt();
        let doc = |tenant: &str, version: serde_json::Value, signed_for: &str| {
            let mut receipt = serde_json::json!({
                "receiptId": r.receipt_id, "result": b64(&r.result), "cost": r.cost.to_string(),
                "issuedAt": "2026-01-01T00:00:00Z",
                "signature": b64(&keys.sign(signed_for, &a, &r)),
                "keyId": keys.signing_key_id(),
                "signatureVersion": version,
            });
            // proto3 JSON leaves out an empty string.
            if !tenant.is_empty() {
                receipt["tenant"] = tenant.into();
            }
            serde_json::json!({"attempt": {
                "permitId": a.permit_id, "tool": a.tool, "idempotencyKey": a.idempotency_key,
                "requestFingerprint": b64(&a.request_fingerprint), "attemptId": a.attempt_id,
                "receipt": receipt,
            }})
            .to_string()
        };
        assert_eq!(r.issued_at, 1_767_225_600_000, "2026-01-01T00:00:00Z");
        for tenant in ["acme", ""] {
            assert_eq!(
                verify_json(&doc(tenant, 2.into(), tenant), &pem),
                Ok(Checked {
                    verdict: Verdict::Verified,
                    version: 2,
                    tenant: Some(tenant.to_owned())
                })
            );
        }
        // The version as a string, as some proto3 JSON writers print it.
        assert_eq!(
            verify_json(&doc("acme", "2".into(), "acme"), &pem).map(|c| c.verdict),
            Ok(Verdict::Verified)
        );
        for (tenant, signed_for) in [("globex", "acme"), ("", "acme"), ("acme", "")] {
            assert_eq!(
                verify_json(&doc(tenant, 2.into(), signed_for), &pem).map(|c| c.verdict),
                Ok(Verdict::Forged),
                "{tenant:?} signed for {signed_for:?}"
            );
        }
        // Version 2 bytes read as version 1 (the version dropped): forged.
        assert_eq!(
            verify_json(&doc("", serde_json::Value::Null, ""), &pem).map(|c| c.verdict),
            Err("signatureVersion is not a version number".to_owned())
        );
        let mut dropped: serde_json::Value =
            serde_json::from_str(&doc("", 2.into(), "")).expect("json");
        dropped["attempt"]["receipt"]
            .as_object_mut()
            .expect("receipt")
            .remove("signatureVersion");
        assert_eq!(
            verify_json(&dropped.to_string(), &pem),
            Ok(Checked {
                verdict: Verdict::Forged,
                version: 1,
                tenant: None
            })
        );
        for bad in [
            serde_json::json!(3),
            serde_json::json!(-1),
            serde_json::json!("two"),
        ] {
            assert!(
                verify_json(&doc("acme", bad.clone(), "acme"), &pem).is_err(),
                "{bad}"
            );
        }
        let e = verify_json(&doc("acme", 3.into(), "acme"), &pem).expect_err("version 3");
        assert!(e.contains("signature version 3 is not one"), "{e}");
    }

    #[test]
    fn a_verify_keys_file_with_stray_text_is_refused() {
        use ed25519_dalek::pkcs8::{EncodePrivateKey, EncodePublicKey, spki::der::pem::LineEnding};
        let dir = std::env::temp_dir().join(format!("atmost-rk-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("dir");
        let signing = dir.join("s.pem");
        let key = SigningKey::from_bytes(&[1; 32]);
        std::fs::write(
            &signing,
            key.to_pkcs8_pem(LineEnding::LF).expect("pem").as_bytes(),
        )
        .expect("w");
        let public = SigningKey::from_bytes(&[2; 32])
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem");
        let verify = dir.join("v.pem");
        for (text, ok) in [
            (public.clone(), true),
            (String::new(), true),
            (format!("{public}\n\n"), true),
            ("MCowBQYDK2VwAyEA...".to_owned(), false),
            (public.lines().take(2).collect::<Vec<_>>().join("\n"), false),
            (format!("{public}junk\n"), false),
        ] {
            std::fs::write(&verify, &text).expect("w");
            assert_eq!(
                ReceiptKeys::load(&signing, Some(&verify)).is_ok(),
                ok,
                "{text:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_document_with_both_spellings_of_a_field_is_refused() {
        let doc = r#"{"permitId": "a", "permit_id": "b", "receipt": {}}"#;
        let e = verify_json(doc, "").expect_err("both spellings");
        assert!(e.contains("permitId and permit_id"), "{e}");
    }

    #[test]
    fn a_rotation_keeps_old_keys_verifying() {
        let old = SigningKey::from_bytes(&[1; 32]);
        let new = ReceiptKeys::new(SigningKey::from_bytes(&[2; 32]), vec![old.verifying_key()]);
        let ids: Vec<_> = new
            .public_keys()
            .map(|(id, _, current)| (id.to_owned(), current))
            .collect();
        assert_eq!(ids.len(), 2);
        assert_eq!(ids.iter().filter(|(_, c)| *c).count(), 1);
        assert_eq!(key_id(&old.verifying_key()).len(), 16);
    }
}
