//! The attack campaign, against two real atmost replicas on one Redis with
//! real credentials (two tenants): what a buggy or prompt-injected agent,
//! or another tenant, might try. docs/security.md lists each attack with
//! its verdict and the test that proves it.

use crate::auth::{KeyFile, entry};
use crate::support::*;
use atmost::receipts::Verdict;
use ed25519_dalek::pkcs8::{EncodePrivateKey, spki::der::pem::LineEnding};
use pb::Decision;
use std::time::Duration;
use tonic::Code;

const ADMIN: &str = "acme-admin-0123456789abcdef";
const AGENT: &str = "acme-agent-0123456789abcdef";
const OTHER: &str = "globex-admin-0123456789abcdef";

struct Campaign {
    keys: KeyFile,
    _redis: Redis,
    replicas: [AtmostProcess; 2],
}

impl Campaign {
    fn start() -> Self {
        let keys = KeyFile::new(
            &[
                entry("acme-admin", ADMIN, "acme", "\"admin\""),
                entry("acme-agent", AGENT, "acme", "\"agent\""),
                entry("globex-admin", OTHER, "globex", "\"admin\""),
            ]
            .concat(),
        );
        let redis = Redis::start();
        // Both replicas sign receipts with the same key (a Secret).
        let signing = keys.dir.join("receipt-key.pem");
        std::fs::write(
            &signing,
            ed25519_dalek::SigningKey::from_bytes(&[5; 32])
                .to_pkcs8_pem(LineEnding::LF)
                .expect("pem")
                .as_bytes(),
        )
        .expect("write");
        let mut args = redis.serve_args();
        args.extend([
            "--auth-keys".to_owned(),
            keys.path.to_str().expect("utf-8").to_owned(),
            "--receipt-signing-key".to_owned(),
            signing.to_str().expect("utf-8").to_owned(),
        ]);
        let replicas = [spawn_atmost(&args), spawn_atmost(&args)];
        Self {
            keys,
            _redis: redis,
            replicas,
        }
    }

    /// A client of replica `n` with `key`.
    async fn client(&self, n: usize, key: &str) -> atmost_client::Client {
        self.replicas[n]
            .client()
            .await
            .with_api_key(key)
            .expect("ascii")
    }
}

fn authorize(permit: &str, tool: &str, key: &str, fp: &[u8], cost: i64) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit.into(),
        tool: tool.into(),
        idempotency_key: key.into(),
        request_fingerprint: fp.to_vec(),
        cost,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_attack_campaign() {
    let _machine = shared().await;
    let c = Campaign::start();
    let admin = [c.client(0, ADMIN).await, c.client(1, ADMIN).await];
    let agent = [c.client(0, AGENT).await, c.client(1, AGENT).await];
    let other = [c.client(0, OTHER).await, c.client(1, OTHER).await];
    let permit = |budget: Option<i64>| {
        let mut p = NewPermit::new(["pay", "search"])
            .expires_at_ms(atmost_client::now_ms() + 600_000)
            .duplicate_guard(pb::DuplicateGuardMode::Off, None)
            .build();
        p.budget = budget;
        p
    };

    // 1. Parallel identical calls, across both replicas: one DISPATCH.
    let p1 = admin[0]
        .create_permit(permit(None))
        .await
        .expect("create")
        .permit_id;
    let racers: Vec<_> = (0..20)
        .map(|i| {
            let client = agent[i % 2].clone();
            let request = authorize(&p1, "pay", "charge-1", b"same", 1);
            tokio::spawn(async move { client.authorize(request).await })
        })
        .collect();
    let mut dispatched = 0;
    for r in racers {
        match r.await.expect("task") {
            Ok(a) if a.decision() == Decision::Dispatch => dispatched += 1,
            Ok(a) => panic!("{a:?}"),
            Err(e) => assert_eq!(e.reason_name(), Some("IDEMPOTENCY_IN_PROGRESS"), "{e:?}"),
        }
    }
    assert_eq!(dispatched, 1, "parallel identical calls");

    // 2. The budget race: 10 fresh keys at cost 2 against a budget of 7,
    //    across both replicas: exactly 3 admitted.
    let p2 = admin[1]
        .create_permit(permit(Some(7)))
        .await
        .expect("create")
        .permit_id;
    let racers: Vec<_> = (0..10)
        .map(|i| {
            let client = agent[i % 2].clone();
            let request = authorize(&p2, "pay", &format!("k{i}"), format!("fp{i}").as_bytes(), 2);
            tokio::spawn(async move { client.authorize(request).await })
        })
        .collect();
    let mut admitted = 0;
    for r in racers {
        match r.await.expect("task") {
            Ok(a) if a.decision() == Decision::Dispatch => admitted += 1,
            Ok(a) => panic!("{a:?}"),
            Err(e) => assert_eq!(e.reason_name(), Some("PERMIT_BUDGET_EXCEEDED"), "{e:?}"),
        }
    }
    assert_eq!(admitted, 3, "the budget race");
    let view = admin[0].get_permit(&p2).await.expect("get");
    assert_eq!((view.budget_reserved, view.budget_remaining), (6, Some(1)));

    // 3. Scope escape: a tool out of scope, and tricks on a tool's name.
    for tool in [
        "transfer",
        "PAY",
        "pay ",
        " pay",
        "pay\0",
        "pay/../search",
        "pay\n",
        "pa",
        "payy",
    ] {
        let r = agent[0]
            .authorize(authorize(&p1, tool, &format!("esc-{tool:?}"), b"x", 0))
            .await;
        let e = r.expect_err(tool);
        assert!(
            matches!(
                e.reason_name(),
                Some("TOOL_NOT_IN_SCOPE" | "INVALID_REQUEST")
            ),
            "{tool:?}: {e:?}"
        );
    }

    // 4. Another tenant, through either replica: nothing of acme's exists.
    for (n, client) in other.iter().enumerate() {
        let not_found = |r: Result<(), atmost_client::Error>| {
            expect_error(r, Code::NotFound, "PERMIT_NOT_FOUND");
        };
        not_found(client.get_permit(&p1).await.map(drop));
        not_found(
            client
                .authorize(authorize(&p1, "pay", &format!("x{n}"), b"x", 0))
                .await
                .map(drop),
        );
        not_found(
            client
                .authorize(authorize(&p1, "pay", "charge-1", b"same", 1))
                .await
                .map(drop),
        );
        not_found(client.revoke_permit(&p1).await.map(drop));
        not_found(
            client
                .resolve(pb::ResolveRequest {
                    permit_id: p1.clone(),
                    idempotency_key: "charge-1".into(),
                    attempt_id: String::new(),
                    outcome: Some(resolved_succeeded(b"forged receipt", None)),
                })
                .await
                .map(drop),
        );
        let listed = client
            .list_all_uncertain("", 100)
            .await
            .expect("own listing");
        assert!(listed.is_empty(), "{listed:?}");
    }

    // 5. An agent key calling operator and admin RPCs.
    expect_error(
        agent[1].create_permit(permit(None)).await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    expect_error(
        agent[1].revoke_permit(&p1).await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    expect_error(
        agent[0].list_all_uncertain("", 10).await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    expect_error(
        agent[0]
            .resolve(pb::ResolveRequest {
                permit_id: p1.clone(),
                idempotency_key: "charge-1".into(),
                attempt_id: String::new(),
                outcome: Some(resolved_not_sent()),
            })
            .await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );

    // 6. A removed key, on connections both replicas already hold open.
    c.keys
        .write(&entry("acme-admin", ADMIN, "acme", "\"admin\""));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for client in &agent {
        loop {
            match client.get_permit(&p1).await {
                Err(e) if e.reason_name() == Some("UNAUTHENTICATED") => break,
                _ if std::time::Instant::now() > deadline => panic!("the removed key still works"),
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    admin[1].get_permit(&p1).await.expect("the kept key works");

    // 7. Receipt tampering (the admin's calls: the agent's key is gone):
    //    a receipt issued through one replica and
    //    replayed through the other verifies with the published keys;
    //    any signed field changed, or a key atmost does not publish, fails.
    let p3 = admin[0]
        .create_permit(permit(None))
        .await
        .expect("create")
        .permit_id;
    let request = authorize(&p3, "pay", "order-7", b"the request", 5);
    let a = admin[0]
        .authorize(request.clone())
        .await
        .expect("authorize")
        .attempt
        .expect("a");
    admin[0]
        .commit(pb::CommitRequest {
            permit_id: p3.clone(),
            idempotency_key: "order-7".into(),
            attempt_id: a.attempt_id.clone(),
            outcome: Some(succeeded(b"shipped", Some(4))),
        })
        .await
        .expect("commit");
    let replayed = admin[1]
        .authorize(request)
        .await
        .expect("replay")
        .attempt
        .expect("a");
    let keys: Vec<(String, ed25519_dalek::VerifyingKey)> = published(&c.replicas[1].client().await)
        .await
        .into_iter()
        .map(|(id, key, _)| (id, key))
        .collect();
    let check = |a: &pb::Attempt| check_receipt(&keys, a, a.receipt.as_ref().expect("receipt"));
    assert_eq!(check(&replayed), Verdict::Verified);
    let signed_for = replayed.receipt.as_ref().expect("r");
    assert_eq!(
        (signed_for.tenant.as_str(), signed_for.signature_version),
        ("acme", 2)
    );
    type Tamper = fn(&mut pb::Attempt);
    let tampers: [(&str, Tamper); 13] = [
        ("tenant", |a| {
            a.receipt.as_mut().expect("r").tenant = "globex".into()
        }),
        // Passed off as version 1, which signs no tenant.
        ("signature_version", |a| {
            let r = a.receipt.as_mut().expect("r");
            r.signature_version = 1;
            r.tenant.clear();
        }),
        ("permit_id", |a| {
            a.permit_id = uuid::Uuid::now_v7().to_string()
        }),
        ("tool", |a| a.tool = "search".into()),
        ("idempotency_key", |a| a.idempotency_key = "order-8".into()),
        ("request_fingerprint", |a| a.request_fingerprint.push(0)),
        ("attempt_id", |a| {
            a.attempt_id = uuid::Uuid::now_v7().to_string()
        }),
        ("receipt_id", |a| {
            a.receipt.as_mut().expect("r").receipt_id = uuid::Uuid::now_v7().to_string()
        }),
        ("result", |a| {
            a.receipt.as_mut().expect("r").result = b"refunded".to_vec()
        }),
        ("cost", |a| a.receipt.as_mut().expect("r").cost = 0),
        ("issued_at", |a| {
            let t = a
                .receipt
                .as_mut()
                .expect("r")
                .issued_at
                .as_mut()
                .expect("t");
            t.seconds += 1;
        }),
        ("signature", |a| {
            a.receipt.as_mut().expect("r").signature[0] ^= 1
        }),
        ("key_id", |a| {
            a.receipt.as_mut().expect("r").key_id = "0123456789abcdef".into()
        }),
    ];
    for (field, tamper) in tampers {
        let mut forged = replayed.clone();
        tamper(&mut forged);
        let expected = if field == "key_id" {
            Verdict::UnknownKey
        } else {
            Verdict::Forged
        };
        assert_eq!(check(&forged), expected, "{field}");
    }

    // Nothing above changed what the attacks could have: one slot on p1.
    let view = admin[0].get_permit(&p1).await.expect("get");
    let pay = view.usage.iter().find(|u| u.tool == "pay").expect("pay");
    assert_eq!(pay.calls_made, 1);
}

// === another agent of the tenant (issue 24, hole 1) ===

/// Agent A's call charged (or may have: its answer was lost) and A marked
/// it UNCERTAIN. Agent B of the same tenant, on a permit open to every
/// agent, retries A's key with the same request: it must learn neither the
/// attempt's id nor be able to settle it. Before, the REPLAY handed B the
/// id and B's Commit Failed gave the money back: the budget read 100 again
/// for a call that may have charged 100, and a new key spent it twice.
async fn another_agent_can_neither_learn_nor_settle_an_open_attempt(kind: Kind) {
    const A: &str = "acme-agent-a-0123456789";
    const B: &str = "acme-agent-b-0123456789";
    let keys = KeyFile::new(
        &[
            entry("acme-admin", ADMIN, "acme", "\"admin\""),
            entry("agent-a", A, "acme", "\"agent\""),
            entry("agent-b", B, "acme", "\"agent\""),
        ]
        .concat(),
    );
    let h = crate::auth::authed_harness_on(&keys, kind).await;
    let key = |k: &str| h.client.clone().with_api_key(k).expect("ascii");
    let (admin, a, b) = (key(ADMIN), key(A), key(B));
    let mut p = h.permit(&["pay"]);
    p.budget = Some(100);
    p.max_calls_per_tool = [("pay".to_owned(), 2)].into();
    let permit = admin.create_permit(p).await.expect("create").permit_id;
    let charge = |k: &str, token: &[u8]| pb::AuthorizeRequest {
        holder_token: token.to_vec(),
        ..authorize(&permit, "pay", k, b"charge 100 to acct_42", 100)
    };

    let held = a.authorize(charge("k1", b"")).await.expect("A dispatches");
    assert_eq!(held.decision(), Decision::Dispatch);
    let held = held.attempt.expect("attempt");
    assert_eq!(held.reserved_by, "agent-a");
    a.mark_uncertain(pb::MarkUncertainRequest {
        permit_id: permit.clone(),
        idempotency_key: "k1".into(),
        attempt_id: held.attempt_id.clone(),
        reason: "response lost".into(),
    })
    .await
    .expect("A marks it");

    // B retries A's key: the same unknown, without its fencing token.
    let seen = b.authorize(charge("k1", b"")).await.expect("replay");
    assert_eq!(seen.decision(), Decision::Replay);
    let seen = seen.attempt.expect("attempt");
    assert_eq!(seen.state(), pb::AttemptState::Uncertain);
    assert_eq!(seen.attempt_id, "", "B is given A's open attempt's id");
    assert_eq!(seen.reserved_by, "agent-a");

    // B holding the id anyway (from a log, say) settles nothing.
    let forged_commit = |outcome| pb::CommitRequest {
        permit_id: permit.clone(),
        idempotency_key: "k1".into(),
        attempt_id: held.attempt_id.clone(),
        outcome: Some(outcome),
    };
    for outcome in [failed("declined"), succeeded(b"forged", Some(0))] {
        let (meta, _) = expect_error(
            b.commit(forged_commit(outcome)).await,
            Code::PermissionDenied,
            "ATTEMPT_HOLDER_MISMATCH",
        );
        assert_eq!(meta["idempotency_key"], "k1");
    }
    expect_error(
        b.mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit.clone(),
            idempotency_key: "k1".into(),
            attempt_id: held.attempt_id.clone(),
            reason: "b".into(),
        })
        .await,
        Code::PermissionDenied,
        "ATTEMPT_HOLDER_MISMATCH",
    );
    // The money stays held: a new key does not fit.
    let view = admin.get_permit(&permit).await.expect("get");
    assert_eq!(
        (view.budget_reserved, view.budget_remaining),
        (100, Some(0))
    );
    expect_error(
        b.authorize(charge("k2", b"")).await,
        Code::ResourceExhausted,
        "PERMIT_BUDGET_EXCEEDED",
    );

    // A redelivery is A's alone, even to B presenting A's holder token.
    let cheap = |k: &str, token: &[u8]| pb::AuthorizeRequest {
        holder_token: token.to_vec(),
        ..authorize(&permit, "pay", k, b"a free lookup", 0)
    };
    let first = a
        .authorize(cheap("k3", b"A's token"))
        .await
        .expect("dispatch");
    expect_error(
        b.authorize(cheap("k3", b"A's token")).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    let again = a.authorize(cheap("k3", b"A's token")).await.expect("again");
    assert!(again.redelivered);
    assert_eq!(again.attempt, first.attempt);

    // A, retrying its own key, gets its id back and settles it; the id of
    // a settled attempt is then anyone's to read.
    let own = a.authorize(charge("k1", b"")).await.expect("replay");
    assert_eq!(own.attempt.expect("attempt").attempt_id, held.attempt_id);
    a.commit(forged_commit(succeeded(b"charged", None)))
        .await
        .expect("A commits");
    let settled = b.authorize(charge("k1", b"")).await.expect("replay");
    assert_eq!(
        settled.attempt.expect("attempt").attempt_id,
        held.attempt_id
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_agent_can_neither_learn_nor_settle_an_open_attempt_on_memory() {
    let _machine = shared().await;
    another_agent_can_neither_learn_nor_settle_an_open_attempt(Kind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_agent_can_neither_learn_nor_settle_an_open_attempt_on_redis() {
    let _machine = shared().await;
    another_agent_can_neither_learn_nor_settle_an_open_attempt(Kind::Redis).await;
}
