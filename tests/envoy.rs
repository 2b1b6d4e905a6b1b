//! The Envoy front doors through the real server over gRPC, on both
//! stores: a test client plays Envoy, sending Envoy's own protobuf
//! messages (the `envoy-types` crate's) in the order and shape Envoy sends
//! them. No Envoy binary runs here (none is available on these machines);
//! docs/gateways.md says what these tests prove instead.
//!
//! - `ext_authz`: every row of the answer table, the mapping's sources,
//!   the ext_authz-only Commit path, keys and tenants, reflection.
//! - `ext_proc`: the lifecycle of one stream per request (Authorize on the
//!   request, Commit on the response, NotSent when the stream ends before
//!   the request was forwarded, MarkUncertain after), over raw HTTP/2 so
//!   that each frame, its end-of-stream flag and each reset goes as Envoy
//!   sends it.

mod ext_authz;
mod ext_proc;

use crate::support::*;
use atmost::api::envoy::Mapping;

/// A mapping from the text of its file.
fn mapping(text: &str) -> Mapping {
    Mapping::parse(std::path::Path::new("test-mapping.toml"), text).expect("a valid mapping")
}

/// The attempt of `key` as atmost sees it now.
async fn attempt(h: &Harness, permit_id: &str, key: &str) -> pb::Attempt {
    h.client
        .get_attempt(permit_id, key)
        .await
        .unwrap_or_else(|e| panic!("GetAttempt {key}: {e:?}"))
        .attempt
        .expect("attempt")
}

/// Waits until the attempt of `key` is in `state` (the server records an
/// outcome after the stream is gone); fails after 15 s.
async fn until_state(
    h: &Harness,
    permit_id: &str,
    key: &str,
    state: pb::AttemptState,
) -> pb::Attempt {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let a = attempt(h, permit_id, key).await;
        if a.state() == state {
            return a;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{key} never became {state:?}: {a:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// The fingerprint the default mapping makes of a request.
fn fingerprint(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    atmost::api::envoy::request_fingerprint(method, path, body)
}
