//! Signed receipts: each SUCCEEDED receipt carries an Ed25519 signature a
//! tool provider can check offline with the keys atmost publishes.

use crate::support::*;
use atmost::receipts::Verdict;
use ed25519_dalek::pkcs8::{EncodePrivateKey, EncodePublicKey, spki::der::pem::LineEnding};
use ed25519_dalek::{SigningKey, VerifyingKey};

/// An attempt as grpcurl prints it (proto3 JSON: empty fields left out).
fn as_grpcurl(a: &pb::Attempt, r: &pb::Receipt) -> String {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let mut receipt = serde_json::json!({
        "receiptId": r.receipt_id, "result": b64(&r.result), "cost": r.cost.to_string(),
        "issuedAt": atmost::api::status::rfc3339(atmost_client::millis(r.issued_at.as_ref().expect("t"))),
        "signature": b64(&r.signature), "keyId": r.key_id,
    });
    if !r.tenant.is_empty() {
        receipt["tenant"] = r.tenant.clone().into();
    }
    if r.signature_version != 0 {
        receipt["signatureVersion"] = r.signature_version.into();
    }
    serde_json::json!({"attempt": {
        "permitId": a.permit_id, "tool": a.tool, "idempotencyKey": a.idempotency_key,
        "requestFingerprint": b64(&a.request_fingerprint), "attemptId": a.attempt_id,
        "receipt": receipt,
    }})
    .to_string()
}

/// `atmost receipt verify --keys KEYS` on `input`: its exit code, its
/// standard output and its standard error.
fn offline(keys: &std::path::Path, input: String) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args(["receipt", "verify", "--keys", keys.to_str().expect("utf-8")])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("atmost receipt verify");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("wait");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    )
}

/// [`offline`]'s exit code and standard output.
fn verdict(keys: &std::path::Path, input: String) -> (Option<i32>, String) {
    let (code, out, _) = offline(keys, input);
    (code, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_are_signed_and_verify_offline_with_the_published_keys() {
    let _machine = shared().await;
    let dir = std::env::temp_dir().join(format!("atmost-receipts-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let old = SigningKey::from_bytes(&[7; 32]);
    let new = SigningKey::from_bytes(&[9; 32]);
    let signing = dir.join("signing.pem");
    std::fs::write(
        &signing,
        new.to_pkcs8_pem(LineEnding::LF).expect("pem").as_bytes(),
    )
    .expect("write");
    let verify_keys = dir.join("verify.pem");
    std::fs::write(
        &verify_keys,
        old.verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem"),
    )
    .expect("write");
    let process = spawn_atmost(&[
        "--receipt-signing-key",
        signing.to_str().expect("utf-8"),
        "--receipt-verify-keys",
        verify_keys.to_str().expect("utf-8"),
    ]);
    let client = process.client().await;

    let keys = published(&client).await;
    assert_eq!(keys.len(), 2, "the signing key and the previous one");
    let current: Vec<_> = keys.iter().filter(|(_, _, c)| *c).collect();
    assert_eq!(current.len(), 1);
    assert_eq!(current[0].1, new.verifying_key());
    let known: Vec<(String, VerifyingKey)> =
        keys.iter().map(|(id, k, _)| (id.clone(), *k)).collect();

    let permit = client
        .create_permit(
            NewPermit::new(["pay"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("create")
        .permit_id;
    let request = pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "pay".into(),
        idempotency_key: "charge-1".into(),
        request_fingerprint: b"the canonical request".to_vec(),
        cost: 250,
        holder_token: Vec::new(),
        ..Default::default()
    };
    let a = client
        .authorize(request.clone())
        .await
        .expect("authorize")
        .attempt
        .expect("a");
    let settled = client
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "charge-1".into(),
            attempt_id: a.attempt_id.clone(),
            outcome: Some(succeeded(b"wallet tx 981", Some(200))),
        })
        .await
        .expect("commit")
        .attempt
        .expect("a");
    let receipt = settled.receipt.clone().expect("a receipt");
    assert_eq!(receipt.key_id, current[0].0);
    // Signed in version 2, for dev mode's tenant.
    assert_eq!(
        (receipt.signature_version, receipt.tenant.as_str()),
        (2, "")
    );
    // What a tool provider checks: the fields it knows, the receipt, the
    // signature, the published keys.
    let check =
        |attempt: &pb::Attempt, receipt: &pb::Receipt| check_receipt(&known, attempt, receipt);
    assert_eq!(check(&settled, &receipt), Verdict::Verified);
    // A replay carries the same receipt, signed the same.
    let replay = client
        .authorize(request)
        .await
        .expect("replay")
        .attempt
        .expect("a");
    assert_eq!(replay.receipt.as_ref(), Some(&receipt));
    // Tampering: a changed result or cost is forged; an unknown key id is
    // unknown.
    let mut forged = receipt.clone();
    forged.result = b"wallet tx 982".to_vec();
    assert_eq!(check(&settled, &forged), Verdict::Forged);
    let mut forged = receipt.clone();
    forged.cost = 1;
    assert_eq!(check(&settled, &forged), Verdict::Forged);
    let mut elsewhere = settled.clone();
    elsewhere.idempotency_key = "charge-2".into();
    assert_eq!(check(&elsewhere, &receipt), Verdict::Forged);
    let mut unknown = receipt.clone();
    unknown.key_id = "0000000000000000".into();
    assert_eq!(check(&settled, &unknown), Verdict::UnknownKey);

    // Offline, with the binary: the attempt as grpcurl prints it.
    let published_pem: String = keys
        .iter()
        .map(|(_, k, _)| k.to_public_key_pem(LineEnding::LF).expect("pem"))
        .collect();
    let keys_file = dir.join("published.pem");
    std::fs::write(&keys_file, &published_pem).expect("write");
    let stranger = dir.join("stranger.pem");
    std::fs::write(
        &stranger,
        SigningKey::from_bytes(&[3; 32])
            .verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem"),
    )
    .expect("write");
    assert_eq!(
        offline(&keys_file, as_grpcurl(&settled, &receipt)),
        (
            Some(0),
            "VERIFIED".into(),
            "atmost: signed in version 2, tenant \"\" (dev mode, no keys)".into()
        )
    );
    let mut forged = receipt.clone();
    forged.result = b"wallet tx 982".to_vec();
    assert_eq!(
        verdict(&keys_file, as_grpcurl(&settled, &forged)),
        (Some(1), "FORGED".into())
    );
    assert_eq!(
        verdict(&stranger, as_grpcurl(&settled, &receipt)),
        (Some(3), "UNKNOWN_KEY".into())
    );
    assert_eq!(verdict(&keys_file, "not json".into()).0, Some(2));

    // Rotation without a restart: a new signing key, the current one kept
    // for verification. Within a second the new key signs and both are
    // published, so the receipt signed before still verifies.
    let newer = SigningKey::from_bytes(&[11; 32]);
    let both = format!(
        "{}{}",
        old.verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem"),
        new.verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("pem")
    );
    std::fs::write(&verify_keys, both).expect("write");
    std::fs::write(
        &signing,
        newer.to_pkcs8_pem(LineEnding::LF).expect("pem").as_bytes(),
    )
    .expect("write");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let rotated = loop {
        let keys = published(&client).await;
        if keys
            .iter()
            .any(|(_, k, current)| *current && *k == newer.verifying_key())
        {
            break keys;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the new key never took over"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(rotated.len(), 3);
    let replay = client.authorize(pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "pay".into(),
        idempotency_key: "charge-1".into(),
        request_fingerprint: b"the canonical request".to_vec(),
        cost: 250,
        holder_token: Vec::new(),
        ..Default::default()
    });
    let resigned = replay
        .await
        .expect("replay")
        .attempt
        .expect("a")
        .receipt
        .expect("r");
    assert_ne!(
        resigned.key_id, receipt.key_id,
        "signed anew by the new key"
    );
    let all: Vec<(String, VerifyingKey)> =
        rotated.iter().map(|(id, k, _)| (id.clone(), *k)).collect();
    for r in [&receipt, &resigned] {
        assert_eq!(check_receipt(&all, &settled, r), Verdict::Verified);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without a signing key, receipts are unsigned and no key is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_signing_key_receipts_are_unsigned() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Memory).await;
    assert!(published(&h.client).await.is_empty());
    let permit = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let r = h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    let receipt = r.attempt.expect("a").receipt.expect("r");
    assert!(receipt.signature.is_empty() && receipt.key_id.is_empty());
    assert!(receipt.tenant.is_empty() && receipt.signature_version == 0);
}

const ACME: &str = "acme-admin-0123456789abcdef";
const GLOBEX: &str = "globex-admin-0123456789abcdef";

/// Each tenant's receipts name the tenant of their permit, under the
/// signature: a receipt of one tenant's permit never verifies as the
/// other's, nor with its version dropped to 1, whichever RPC answered it
/// (Commit, a REPLAY, GetAttempt, Resolve); offline, the binary says
/// which tenant a verified receipt proves, and that a version 1 receipt
/// (signed before version 2) proves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_signs_the_tenant_of_its_permit() {
    use crate::auth::{KeyFile, entry};
    let _machine = shared().await;
    let keys = KeyFile::new(
        &[
            entry("acme-admin", ACME, "acme", "\"admin\""),
            entry("globex-admin", GLOBEX, "globex", "\"admin\""),
        ]
        .concat(),
    );
    let signer = SigningKey::from_bytes(&[5; 32]);
    let signing = keys.beside(
        "receipt-key.pem",
        &signer.to_pkcs8_pem(LineEnding::LF).expect("pem"),
    );
    let process = spawn_atmost(&[
        "--auth-keys",
        keys.path.to_str().expect("utf-8"),
        "--receipt-signing-key",
        &signing,
    ]);
    let anonymous = process.client().await;
    let known: Vec<(String, VerifyingKey)> = published(&anonymous)
        .await
        .into_iter()
        .map(|(id, k, _)| (id, k))
        .collect();

    let mut signed = Vec::new();
    for (tenant, key) in [("acme", ACME), ("globex", GLOBEX)] {
        let client = anonymous.clone().with_api_key(key).expect("ascii");
        let permit = client
            .create_permit(
                NewPermit::new(["pay"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await
            .expect("create");
        assert_eq!(permit.tenant, tenant);
        let request = |key: &str| pb::AuthorizeRequest {
            permit_id: permit.permit_id.clone(),
            tool: "pay".into(),
            idempotency_key: key.into(),
            request_fingerprint: b"the canonical request".to_vec(),
            cost: 5,
            holder_token: Vec::new(),
            ..Default::default()
        };
        // Commit, then a REPLAY and GetAttempt of the same key.
        let a = client
            .authorize(request("charge-1"))
            .await
            .expect("authorize")
            .attempt
            .expect("a");
        let committed = client
            .commit(pb::CommitRequest {
                permit_id: permit.permit_id.clone(),
                idempotency_key: "charge-1".into(),
                attempt_id: a.attempt_id,
                outcome: Some(succeeded(b"wallet tx 981", None)),
            })
            .await
            .expect("commit")
            .attempt
            .expect("a");
        let replayed = client
            .authorize(request("charge-1"))
            .await
            .expect("replay")
            .attempt
            .expect("a");
        let read = client
            .get_attempt(&permit.permit_id, "charge-1")
            .await
            .expect("get")
            .attempt
            .expect("a");
        // Resolve: an UNCERTAIN attempt settled by the admin.
        let b = client
            .authorize(request("charge-2"))
            .await
            .expect("authorize")
            .attempt
            .expect("a");
        client
            .mark_uncertain(pb::MarkUncertainRequest {
                permit_id: permit.permit_id.clone(),
                idempotency_key: "charge-2".into(),
                attempt_id: b.attempt_id,
                reason: "timeout".into(),
            })
            .await
            .expect("mark");
        let resolved = client
            .resolve(pb::ResolveRequest {
                permit_id: permit.permit_id.clone(),
                idempotency_key: "charge-2".into(),
                attempt_id: String::new(),
                outcome: Some(resolved_succeeded(b"wallet tx 982", None)),
            })
            .await
            .expect("resolve")
            .attempt
            .expect("a");
        for (rpc, attempt) in [
            ("Commit", &committed),
            ("REPLAY", &replayed),
            ("GetAttempt", &read),
            ("Resolve", &resolved),
        ] {
            let r = attempt.receipt.as_ref().expect("a receipt");
            assert_eq!(
                (r.tenant.as_str(), r.signature_version),
                (tenant, 2),
                "{rpc}"
            );
            assert_eq!(
                check_receipt(&known, attempt, r),
                Verdict::Verified,
                "{rpc}"
            );
        }
        assert_eq!(replayed.receipt, committed.receipt);
        assert_eq!(read.receipt, committed.receipt);
        signed.push(committed);
    }

    // Each tenant's receipt passed off as the other's, as dev mode's, or
    // as version 1 (which signs no tenant): forged.
    for (n, attempt) in signed.iter().enumerate() {
        let other = &signed[1 - n].receipt.as_ref().expect("r").tenant;
        let r = attempt.receipt.as_ref().expect("r");
        for (claim, tenant, version) in [
            ("the other tenant", other.as_str(), 2),
            ("dev mode", "", 2),
            ("version 1", "", 0),
            ("version 1", "", 1),
        ] {
            let mut forged = r.clone();
            forged.tenant = tenant.into();
            forged.signature_version = version;
            assert_eq!(
                check_receipt(&known, attempt, &forged),
                Verdict::Forged,
                "{} as {claim}",
                r.tenant
            );
        }
    }

    // Offline, with the binary.
    let keys_file = std::path::PathBuf::from(
        keys.beside(
            "published.pem",
            &signer
                .verifying_key()
                .to_public_key_pem(LineEnding::LF)
                .expect("pem"),
        ),
    );
    let acme = &signed[0];
    let acme_receipt = acme.receipt.clone().expect("r");
    assert_eq!(
        offline(&keys_file, as_grpcurl(acme, &acme_receipt)),
        (
            Some(0),
            "VERIFIED".into(),
            "atmost: signed in version 2, tenant \"acme\"".into()
        )
    );
    let mut as_globex = acme_receipt.clone();
    as_globex.tenant = "globex".into();
    assert_eq!(
        verdict(&keys_file, as_grpcurl(acme, &as_globex)),
        (Some(1), "FORGED".into())
    );
    let mut downgraded = acme_receipt.clone();
    downgraded.tenant.clear();
    downgraded.signature_version = 0;
    assert_eq!(
        verdict(&keys_file, as_grpcurl(acme, &downgraded)),
        (Some(1), "FORGED".into())
    );
    // A tenant beside no version: unsigned, so refused as unusable.
    let mut unversioned = acme_receipt.clone();
    unversioned.signature_version = 0;
    let (code, out, err) = offline(&keys_file, as_grpcurl(acme, &unversioned));
    assert_eq!((code, out.as_str()), (Some(2), ""), "{err}");
    assert!(
        err.contains("a version 1 signature does not cover a tenant"),
        "{err}"
    );

    // A receipt an atmost signed in version 1 still verifies, and is said
    // to prove no tenant.
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/receipt_v1");
    let (code, out, err) = offline(
        &data.join("keys.pem"),
        std::fs::read_to_string(data.join("commit.json")).expect("the v1 receipt"),
    );
    assert_eq!((code, out.as_str()), (Some(0), "VERIFIED"), "{err}");
    assert_eq!(
        err,
        "atmost: signed in version 1, which signs no tenant: it proves nothing about whose permit the receipt came from"
    );
}
