//! Several `atmost` processes sharing one real Redis: the cap holds across
//! replicas, because each reservation is one script run inside Redis.

use crate::support::*;
use pb::Decision;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_keys_through_two_replicas_dispatch_exactly_the_cap() {
    let _machine = shared().await;
    let redis = Redis::start();
    let args = redis.serve_args();
    let replicas = [spawn_atmost(&args), spawn_atmost(&args)];
    let clients = [replicas[0].client().await, replicas[1].client().await];

    let permit = clients[0]
        .create_permit(
            NewPermit::new(["wallet.charge"])
                .subject("replicas")
                .cap("wallet.charge", 5)
                .budget(1_000),
        )
        .await
        .expect("create")
        .permit_id;

    let mut tasks = Vec::new();
    for i in 0..64 {
        let client = clients[i % 2].clone();
        let permit = permit.clone();
        tasks.push(tokio::spawn(async move {
            client
                .authorize(pb::AuthorizeRequest {
                    permit_id: permit,
                    tool: "wallet.charge".into(),
                    idempotency_key: format!("charge-{i}"),
                    request_fingerprint: format!("request-{i}").into_bytes(),
                    cost: 10,
                    holder_token: Vec::new(),
                    ..Default::default()
                })
                .await
        }));
    }
    let mut dispatched = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(r) => {
                assert_eq!(r.decision(), Decision::Dispatch);
                dispatched.push(r.attempt.expect("attempt"));
            }
            Err(error) => {
                let (meta, _) = expect_error(
                    Err::<(), _>(error),
                    Code::ResourceExhausted,
                    "PERMIT_MAX_CALLS_EXCEEDED",
                );
                assert_eq!(meta["limit"], "5");
            }
        }
    }
    assert_eq!(dispatched.len(), 5, "exactly the cap dispatched");

    // Both replicas read the same state back.
    for client in &clients {
        let got = client.get_permit(&permit).await.expect("get");
        assert_eq!(got.usage[0].calls_made, 5);
        assert_eq!(got.budget_reserved, 50);
    }
    // A dispatch authorized on one replica commits through the other.
    let a = &dispatched[0];
    let r = clients[1]
        .commit(pb::CommitRequest {
            permit_id: a.permit_id.clone(),
            idempotency_key: a.idempotency_key.clone(),
            attempt_id: a.attempt_id.clone(),
            outcome: Some(not_sent()),
        })
        .await
        .expect("commit");
    assert_eq!(r.usage.expect("usage").calls_made, 4);
}
