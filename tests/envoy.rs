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
/// outcome after the stream is gone); fails after 15 s. An attempt not
/// found yet is waited for too: an Authorize held at a Redis proxy may be
/// answered "function not found" once the hold ends, and run again after a GetAttempt
/// has overtaken it.
async fn until_state(
    h: &Harness,
    permit_id: &str,
    key: &str,
    state: pb::AttemptState,
) -> pb::Attempt {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let a = match h.client.get_attempt(permit_id, key).await {
            Ok(r) => r.attempt.expect("attempt"),
            Err(e) if e.reason_name() == Some("ATTEMPT_NOT_FOUND") => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{key} never became {state:?}: not found"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
            Err(e) => panic!("GetAttempt {key}: {e:?}"),
        };
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

/// A route table a path's raw bytes could steer: the capture (cap 1 in
/// [`steerable_permit`], cost 1000) and a catch-all to a free read.
const STEERABLE: &str = r#"
[[tool.route]]
method = "POST"
path = "/v1/charges/{id}/capture"
tool = "wallet.capture"

[[tool.route]]
path = "/v1/*"
tool = "wallet.read"

[cost]
tools = { "wallet.capture" = 1000 }
"#;

/// What the refusal of a path that folds onto the capture says.
const READ_AS_CAPTURE: &str =
    "could read it as tool.route[1] (POST /v1/charges/{id}/capture -> wallet.capture)";

/// Paths many upstreams run as `/v1/charges/abc/capture` whose bytes fit
/// only [`STEERABLE`]'s catch-all, each with what the refusal says: forms
/// that are not plain, and plain ones an upstream that ignores case or a
/// format suffix reads as the capture.
const STEERING_PATHS: &[(&str, &str)] = &[
    ("/v1/charges/abc/capture/", "ends in '/'"),
    ("/v1/charges/abc//capture", "an empty segment ('//')"),
    ("/v1/charges/abc/./capture", "a \".\" segment"),
    ("/v1/charges/abc/x/../capture", "a \"..\" segment"),
    ("/v1/charges/abc/%63apture", "percent-encoded"),
    ("/v1/charges%2Fabc%2Fcapture", "percent-encoded"),
    ("/v1/charges/abc/capture;x=1", "a path parameter (';')"),
    ("/v1/charges/abc\\capture", "no character of a URI path"),
    ("/v1/charges/abc/CAPTURE", READ_AS_CAPTURE),
    ("/v1/charges/abc/Capture", READ_AS_CAPTURE),
    ("/v1/charges/abc/capture.json", READ_AS_CAPTURE),
    ("/v1/charges/abc/capture.JSON", READ_AS_CAPTURE),
];

/// A permit over [`STEERABLE`]'s tools: one capture, a budget of 1000.
async fn steerable_permit(h: &Harness) -> String {
    h.create_with(
        &["wallet.capture", "wallet.read"],
        &[("wallet.capture", 1)],
        Some(1_000),
    )
    .await
}

/// Each tool's calls made under `permit_id`, and the budget reserved.
async fn usage(h: &Harness, permit_id: &str) -> (Vec<(String, u64)>, i64) {
    let permit = h.get(permit_id).await.expect("GetPermit");
    (
        permit
            .usage
            .iter()
            .map(|u| (u.tool.clone(), u.calls_made))
            .collect(),
        permit.budget_reserved,
    )
}

/// The refusal of a path the route table cannot match plainly: the
/// violation names the path and says what is wrong.
#[track_caller]
fn refused_path(body: &serde_json::Value, path: &str, says: &str) {
    assert_eq!(body["reason"], "PATH_NOT_CANONICAL", "{path}: {body}");
    let violation = &body["violations"][0];
    assert_eq!(violation["field"], "path", "{path}: {body}");
    let description = violation["description"].as_str().unwrap_or_default();
    assert!(description.contains(says), "{path}: {body}");
}
