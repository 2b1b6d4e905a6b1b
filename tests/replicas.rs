//! Several `atmost` processes sharing one real Redis: the cap holds across
//! replicas, because each reservation is one script run inside Redis.

mod support;

use atmost::pb::{self, Decision, gate_client::GateClient, permits_client::PermitsClient};
use support::*;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_keys_through_two_replicas_dispatch_exactly_the_cap() {
    let redis = Redis::start();
    let args = redis.serve_args();
    let replicas = [Process::spawn(&args), Process::spawn(&args)];
    let channels = [replicas[0].channel().await, replicas[1].channel().await];

    let expires_at = atmost::api::convert::timestamp(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_millis() as i64
            + 3_600_000,
    );
    let permit = PermitsClient::new(channels[0].clone())
        .create_permit(pb::CreatePermitRequest {
            permit: Some(pb::Permit {
                subject: "replicas".into(),
                tools: vec!["wallet.charge".into()],
                max_calls_per_tool: [("wallet.charge".to_string(), 5)].into(),
                budget: Some(1_000),
                expires_at: Some(expires_at),
                ..Default::default()
            }),
        })
        .await
        .expect("create")
        .into_inner()
        .permit_id;

    let mut tasks = Vec::new();
    for i in 0..64 {
        let mut gate = GateClient::new(channels[i % 2].clone());
        let permit = permit.clone();
        tasks.push(tokio::spawn(async move {
            gate.authorize(pb::AuthorizeRequest {
                permit_id: permit,
                tool: "wallet.charge".into(),
                idempotency_key: format!("charge-{i}"),
                request_fingerprint: format!("request-{i}").into_bytes(),
                cost: 10,
            })
            .await
        }));
    }
    let mut dispatched = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(r) => {
                let r = r.into_inner();
                assert_eq!(r.decision(), Decision::Dispatch);
                dispatched.push(r.attempt.expect("attempt"));
            }
            Err(status) => {
                let (meta, _) = expect_error(
                    Err::<(), _>(status),
                    Code::ResourceExhausted,
                    "PERMIT_MAX_CALLS_EXCEEDED",
                );
                assert_eq!(meta["limit"], "5");
            }
        }
    }
    assert_eq!(dispatched.len(), 5, "exactly the cap dispatched");

    // Both replicas read the same state back.
    for channel in &channels {
        let got = PermitsClient::new(channel.clone())
            .get_permit(pb::GetPermitRequest {
                permit_id: permit.clone(),
            })
            .await
            .expect("get")
            .into_inner();
        assert_eq!(got.usage[0].calls_made, 5);
        assert_eq!(got.budget_reserved, 50);
    }
    // A dispatch authorized on one replica commits through the other.
    let a = &dispatched[0];
    let r = GateClient::new(channels[1].clone())
        .commit(pb::CommitRequest {
            permit_id: a.permit_id.clone(),
            idempotency_key: a.idempotency_key.clone(),
            attempt_id: a.attempt_id.clone(),
            outcome: Some(not_sent()),
        })
        .await
        .expect("commit")
        .into_inner();
    assert_eq!(r.usage.expect("usage").calls_made, 4);
}
