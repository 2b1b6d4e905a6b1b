//! Signed receipts: each SUCCEEDED receipt carries an Ed25519 signature a
//! tool provider can check offline with the keys atmost publishes.

use crate::support::*;
use atmost::receipts::Verdict;
use ed25519_dalek::pkcs8::{EncodePrivateKey, EncodePublicKey, spki::der::pem::LineEnding};
use ed25519_dalek::{SigningKey, VerifyingKey};

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
    let as_grpcurl = |a: &pb::Attempt, r: &pb::Receipt| {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        serde_json::json!({"attempt": {
            "permitId": a.permit_id, "tool": a.tool, "idempotencyKey": a.idempotency_key,
            "requestFingerprint": b64(&a.request_fingerprint), "attemptId": a.attempt_id,
            "receipt": {
                "receiptId": r.receipt_id, "result": b64(&r.result), "cost": r.cost.to_string(),
                "issuedAt": atmost::api::status::rfc3339(atmost_client::millis(r.issued_at.as_ref().expect("t"))),
                "signature": b64(&r.signature), "keyId": r.key_id,
            }
        }})
        .to_string()
    };
    let offline = |keys: &std::path::Path, input: String| {
        use std::io::Write;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
            .args(["receipt", "verify", "--keys", keys.to_str().expect("utf-8")])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
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
        )
    };
    assert_eq!(
        offline(&keys_file, as_grpcurl(&settled, &receipt)),
        (Some(0), "VERIFIED".into())
    );
    let mut forged = receipt.clone();
    forged.result = b"wallet tx 982".to_vec();
    assert_eq!(
        offline(&keys_file, as_grpcurl(&settled, &forged)),
        (Some(1), "FORGED".into())
    );
    assert_eq!(
        offline(&stranger, as_grpcurl(&settled, &receipt)),
        (Some(3), "UNKNOWN_KEY".into())
    );
    assert_eq!(offline(&keys_file, "not json".into()).0, Some(2));

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
}
