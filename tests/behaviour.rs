//! The behavioural suite: every test runs over real gRPC on a loopback port,
//! against the memory store, a real Redis, and a real Redis Cluster (3
//! primaries, 3 replicas: permits land on all three shards).

use crate::support::*;
use pb::{AttemptState, Decision};
use tonic::Code;

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = super::shared().await;
                    super::$name(super::Harness::start(super::Kind::Memory).await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = super::shared().await;
                    super::$name(super::Harness::start(super::Kind::Redis).await).await;
                }
            )*
        }
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = super::shared().await;
                    super::$name(super::Harness::start(super::Kind::Cluster).await).await;
                }
            )*
        }
    };
}

mod authorize;
mod concurrency;
mod duplicate_guard;
mod get_attempt;
mod hold_tool;
mod permits;
mod quotas;
mod settle;
mod uncertain;

fn state(a: &pb::Attempt) -> AttemptState {
    a.state()
}

/// (committed, reserved, remaining) of a permit's budget, as GetPermit reads it.
async fn budget(h: &Harness, permit_id: &str) -> (i64, i64, Option<i64>) {
    let got = h.get(permit_id).await.expect("get");
    (
        got.budget_committed,
        got.budget_reserved,
        got.budget_remaining,
    )
}

async fn usage_of(h: &Harness, permit_id: &str, tool: &str) -> pb::Usage {
    h.get(permit_id)
        .await
        .expect("get")
        .usage
        .into_iter()
        .find(|u| u.tool == tool)
        .expect("tool usage")
}

/// A permit over tool "t" that expires in 60 s.
async fn permit_expiring(h: &Harness) -> String {
    let mut p = h.permit(&["t"]);
    p.expires_at = Some(atmost_client::timestamp(h.now_ms() + 60_000));
    p.lease = Some(prost_types::Duration {
        seconds: 600,
        nanos: 0,
    });
    h.create(p).await.permit_id
}
