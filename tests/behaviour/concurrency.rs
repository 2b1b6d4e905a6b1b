//! Races: many keys against one cap, one key from many callers.

use super::*;

on_both_stores!(
    concurrent_distinct_keys_respect_cap,
    concurrent_same_key_dispatches_once,
);

/// Sends the requests all at once; returns how many got DISPATCH and the
/// refusals.
async fn race(h: &Harness, requests: Vec<pb::AuthorizeRequest>) -> (usize, Vec<Error>) {
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let client = h.client.clone();
            tokio::spawn(async move { client.authorize(request).await })
        })
        .collect();
    let mut dispatched = 0;
    let mut refused = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            Ok(r) => {
                assert_eq!(r.decision(), Decision::Dispatch);
                dispatched += 1;
            }
            Err(s) => refused.push(s),
        }
    }
    (dispatched, refused)
}

fn request(permit: &str, key: &str, fingerprint: &[u8]) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: fingerprint.to_vec(),
        cost: 1,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

async fn concurrent_distinct_keys_respect_cap(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 5)], None).await;
    let requests = (0..64)
        .map(|i| request(&permit, &format!("key-{i}"), format!("fp-{i}").as_bytes()))
        .collect();
    let (dispatched, refused) = race(&h, requests).await;
    assert_eq!(dispatched, 5);
    for s in refused {
        expect_error(
            Err::<(), _>(s),
            Code::ResourceExhausted,
            "PERMIT_MAX_CALLS_EXCEEDED",
        );
    }
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 5);
}

async fn concurrent_same_key_dispatches_once(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    let requests = (0..10).map(|_| request(&permit, "same", b"fp")).collect();
    let (dispatched, refused) = race(&h, requests).await;
    assert_eq!(dispatched, 1);
    for s in refused {
        expect_error(Err::<(), _>(s), Code::Aborted, "IDEMPOTENCY_IN_PROGRESS");
    }
}
