//! ext_authz v3 (`envoy.service.auth.v3.Authorization/Check`) through the
//! real server, on both stores: one CheckRequest per HTTP request, shaped
//! as Envoy's ext_authz filter sends it (lower-case headers with the
//! pseudo-headers, the path with its query, the body with
//! `with_request_body` and `pack_as_bytes`, the route's
//! `context_extensions`, jwt_authn's payload in `metadata_context`).

use super::{attempt, fingerprint, mapping};
use crate::support::*;
use envoy_types::pb::envoy::config::core::v3::{Address, Metadata, SocketAddress, address};
use envoy_types::pb::envoy::service::auth::v3::{
    AttributeContext, CheckRequest, CheckResponse, attribute_context,
    authorization_client::AuthorizationClient, check_response::HttpResponse,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind as V};
use pb::AttemptState;
use std::collections::HashMap;
use tonic::Code;

const TOOL: &str = "wallet.charge";
const PATH: &str = "/v1/charges?expand=balance";
const BODY: &[u8] = br#"{"amount":500,"currency":"EUR"}"#;

fn peer(ip: &str, port: u32) -> attribute_context::Peer {
    attribute_context::Peer {
        address: Some(Address {
            address: Some(address::Address::SocketAddress(SocketAddress {
                address: ip.into(),
                port_specifier: Some(
                    envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(
                        port,
                    ),
                ),
                ..Default::default()
            })),
        }),
        ..Default::default()
    }
}

/// A CheckRequest as Envoy's ext_authz filter builds it for `method`
/// `path` with these headers and body, on a route whose
/// `check_settings.context_extensions` name `tool`, with
/// `with_request_body { pack_as_bytes: true }`: a request with a body is
/// checked once Envoy has buffered it, so `size` (its bytes received) is
/// the body's length, the body is in `raw_body`, and Envoy adds
/// `x-envoy-auth-partial-body: false` (check_request_utils.cc); a request
/// without one is checked at its headers, with neither.
fn check_request(
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    tool: Option<&str>,
) -> CheckRequest {
    let mut all: HashMap<String, String> = [
        (":authority", "tools.example.com"),
        (":method", method),
        (":path", path),
        (":scheme", "https"),
        ("content-type", "application/json"),
        ("user-agent", "agent-loop/1.0"),
        ("x-forwarded-proto", "https"),
        ("x-request-id", "8f1c5b9e-1f3a-4c55-9c0e-2b7d7c8a9e01"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    if !body.is_empty() {
        all.insert("content-length".into(), body.len().to_string());
        all.insert("x-envoy-auth-partial-body".into(), "false".into());
    }
    for (k, v) in headers {
        all.insert(k.to_ascii_lowercase(), (*v).to_owned());
    }
    CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(peer("10.0.3.7", 49152)),
            destination: Some(peer("10.0.0.2", 8443)),
            request: Some(attribute_context::Request {
                time: Some(envoy_types::pb::google::protobuf::Timestamp {
                    seconds: atmost_client::now_ms() / 1000,
                    nanos: 0,
                }),
                http: Some(attribute_context::HttpRequest {
                    id: "8f1c5b9e-1f3a-4c55-9c0e-2b7d7c8a9e01".into(),
                    method: method.into(),
                    headers: all,
                    path: path.into(),
                    host: "tools.example.com".into(),
                    scheme: "https".into(),
                    size: if body.is_empty() {
                        0
                    } else {
                        body.len() as i64
                    },
                    protocol: "HTTP/1.1".into(),
                    // with_request_body { pack_as_bytes: true }
                    raw_body: body.to_vec(),
                    ..Default::default()
                }),
            }),
            context_extensions: tool
                .map(|t| {
                    [("atmost.tool".to_owned(), t.to_owned())]
                        .into_iter()
                        .collect()
                })
                .unwrap_or_default(),
            ..Default::default()
        }),
    }
}

/// A charge of `key` under `permit`.
fn charge(permit: &str, key: &str) -> CheckRequest {
    check_request(
        "POST",
        PATH,
        &[("x-atmost-permit", permit), ("idempotency-key", key)],
        BODY,
        Some(TOOL),
    )
}

/// The HttpRequest of a CheckRequest.
fn http(request: &mut CheckRequest) -> &mut attribute_context::HttpRequest {
    request
        .attributes
        .as_mut()
        .unwrap()
        .request
        .as_mut()
        .unwrap()
        .http
        .as_mut()
        .unwrap()
}

/// The CheckRequest Envoy sends without `with_request_body`: it asks at
/// the request's headers, before any of the body arrived, so `size` (its
/// bytes received) is 0, there is no body and no
/// `x-envoy-auth-partial-body`; the headers are the client's.
fn without_request_body(mut request: CheckRequest) -> CheckRequest {
    let http = http(&mut request);
    http.raw_body.clear();
    http.size = 0;
    http.headers.remove("x-envoy-auth-partial-body");
    request
}

/// The CheckRequest Envoy sends with `encode_raw_headers: true`: the
/// headers in `header_map`, one entry per occurrence, each value in
/// `raw_value`, and the `headers` map empty; `more` are further
/// occurrences, after the rest.
fn raw_headers(mut request: CheckRequest, more: &[(&str, &str)]) -> CheckRequest {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    let http = http(&mut request);
    let mut headers: Vec<(String, String)> = http.headers.drain().collect();
    headers.sort();
    headers.extend(more.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    http.header_map = Some(HeaderMap {
        headers: headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                raw_value: value.into_bytes(),
                ..Default::default()
            })
            .collect(),
    });
    request
}

/// What Envoy does with a CheckResponse.
#[derive(Debug)]
enum Checked {
    /// Forwards, adding these headers upstream and downstream.
    Allowed {
        upstream: HashMap<String, String>,
        downstream: HashMap<String, String>,
        metadata: Struct,
    },
    /// Answers the client itself.
    Denied {
        status: u16,
        headers: HashMap<String, String>,
        body: String,
    },
}

fn read(response: CheckResponse) -> Checked {
    let code = response.status.as_ref().map_or(0, |s| s.code);
    let headers = |list: Vec<envoy_types::pb::envoy::config::core::v3::HeaderValueOption>| {
        list.into_iter()
            .map(|o| {
                let h = o.header.expect("header");
                (h.key, h.value)
            })
            .collect::<HashMap<_, _>>()
    };
    match response.http_response.expect("http_response") {
        HttpResponse::OkResponse(ok) => {
            assert_eq!(code, 0, "an OK response with status {code}");
            // Each replaces whatever the client sent under that name.
            for o in &ok.headers {
                assert_eq!(
                    o.append_action(),
                    envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd,
                    "{o:?}"
                );
            }
            Checked::Allowed {
                upstream: headers(ok.headers),
                downstream: headers(ok.response_headers_to_add),
                metadata: response.dynamic_metadata.expect("metadata"),
            }
        }
        HttpResponse::DeniedResponse(denied) => {
            assert_ne!(code, 0, "a denied response must carry a non-OK status");
            Checked::Denied {
                status: denied.status.expect("status").code as u16,
                headers: headers(denied.headers),
                body: denied.body,
            }
        }
        HttpResponse::ErrorResponse(e) => panic!("an error response: {e:?}"),
    }
}

async fn check_with(h: &Harness, request: tonic::Request<CheckRequest>) -> Checked {
    read(
        AuthorizationClient::new(h.client.channel())
            .check(request)
            .await
            .expect("Check")
            .into_inner(),
    )
}

async fn check(h: &Harness, request: CheckRequest) -> Checked {
    check_with(h, tonic::Request::new(request)).await
}

/// The request was forwarded: the headers Envoy adds to it upstream
/// (the attempt's id, the permit id and the key as atmost used them).
/// Nothing is added to the response the client gets: while the tool runs
/// the attempt is RESERVED, and its id is the fencing token of its Commit.
#[track_caller]
fn forwarded(checked: Checked) -> HashMap<String, String> {
    match checked {
        Checked::Allowed {
            upstream,
            downstream,
            metadata,
        } => {
            assert_eq!(
                downstream,
                HashMap::new(),
                "nothing goes downstream, least of all the open attempt's id"
            );
            let field = |k: &str| match metadata.fields.get(k).and_then(|v| v.kind.as_ref()) {
                Some(V::StringValue(s)) => s.clone(),
                other => panic!("metadata {k}: {other:?}"),
            };
            assert_eq!(field("attempt_id"), upstream["x-atmost-attempt-id"]);
            assert_eq!(field("permit_id"), upstream["x-atmost-permit-id"]);
            assert_eq!(
                field("idempotency_key"),
                upstream["x-atmost-idempotency-key"]
            );
            assert_eq!(field("tool"), TOOL);
            upstream
        }
        denied => panic!("expected the request forwarded, got {denied:?}"),
    }
}

/// The request was forwarded: the attempt's id.
#[track_caller]
fn allowed(checked: Checked) -> String {
    forwarded(checked)["x-atmost-attempt-id"].clone()
}

/// The request was answered with `status` and `reason`: the headers and
/// the JSON body.
#[track_caller]
fn denied(
    checked: Checked,
    status: u16,
    reason: &str,
) -> (HashMap<String, String>, serde_json::Value) {
    match checked {
        Checked::Denied {
            status: got,
            headers,
            body,
        } => {
            assert_eq!(
                (got, headers["x-atmost-reason"].as_str()),
                (status, reason),
                "{body}"
            );
            assert_eq!(headers["content-type"], "application/json");
            let json: serde_json::Value = serde_json::from_str(&body).expect("a JSON body");
            assert_eq!(json["reason"], reason);
            (headers, json)
        }
        allowed => panic!("expected {status} {reason}, got {allowed:?}"),
    }
}

/// A permit for `wallet.charge` (cap 1) and `search` (no cap).
async fn wallet_permit(h: &Harness) -> String {
    h.create_with(&[TOOL, "search"], &[(TOOL, 1)], Some(10_000))
        .await
}

// === the answers ===

/// DISPATCH: forwarded with the attempt's id, the attempt RESERVED with
/// the request's fingerprint; the upstream commits it through the Gate
/// with nothing but the x-atmost-* headers it received (the ext_authz-only
/// Commit path), though the client wrote its key as a structured-field
/// string with escapes and its permit id in upper case; the same key
/// again replays the result with 200, never calling the tool.
async fn dispatch_then_the_upstream_commits_and_the_key_replays(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    // The IETF draft's sf-string: the key atmost uses is order-"1".
    let sent_key = r#""order-\"1\"""#;
    let key = r#"order-"1""#;
    let upstream = forwarded(check(&h, charge(&permit.to_uppercase(), sent_key)).await);
    let id = upstream["x-atmost-attempt-id"].clone();
    assert_eq!(upstream["x-atmost-permit-id"], permit);
    assert_eq!(upstream["x-atmost-idempotency-key"], key);
    let a = attempt(&h, &permit, key).await;
    // GetAttempt withholds a RESERVED attempt's id (its fencing token):
    // the upstream has it from the headers, and the Commit below with it
    // is what shows it is the reservation's.
    assert_eq!(a.attempt_id, "");
    assert_eq!(a.state(), AttemptState::Reserved);
    assert_eq!(a.tool, TOOL);
    assert_eq!(a.request_fingerprint, fingerprint("POST", PATH, BODY));
    assert_eq!(a.cost, 0);

    // The upstream commits with the three headers it received, and only
    // them.
    h.client
        .commit(pb::CommitRequest {
            permit_id: upstream["x-atmost-permit-id"].clone(),
            idempotency_key: upstream["x-atmost-idempotency-key"].clone(),
            attempt_id: upstream["x-atmost-attempt-id"].clone(),
            outcome: Some(succeeded(br#"{"charge":"ch_1"}"#, None)),
        })
        .await
        .expect("commit with the forwarded headers");
    assert_eq!(attempt(&h, &permit, key).await.attempt_id, id);

    match check(&h, charge(&permit, sent_key)).await {
        Checked::Denied {
            status,
            headers,
            body,
        } => {
            assert_eq!(status, 200, "the stored result, as the tool gave it");
            assert_eq!(body, r#"{"charge":"ch_1"}"#);
            assert_eq!(headers["idempotent-replayed"], "true");
            assert_eq!(headers["x-atmost-reason"], "REPLAY_SUCCEEDED");
            // Settled: its id is no fencing token any more.
            assert_eq!(headers["x-atmost-attempt-id"], id);
            assert!(!headers["x-atmost-receipt-id"].is_empty());
        }
        other => panic!("expected the replay, got {other:?}"),
    }
    // One dispatch: the cap of 1 is used, nothing more was reserved.
    let usage = h.get(&permit).await.unwrap().usage;
    assert_eq!(usage.iter().find(|u| u.tool == TOOL).unwrap().calls_made, 1);
}

/// A result that is not UTF-8 replays base64-encoded (a denied response's
/// body is a string), and says so.
async fn a_binary_result_replays_base64_encoded(kind: Kind) {
    use base64::Engine;
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    let id = allowed(check(&h, charge(&permit, "bin-1")).await);
    let result = [0u8, 159, 146, 150, 255];
    h.client
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "bin-1".into(),
            attempt_id: id,
            outcome: Some(succeeded(&result, None)),
        })
        .await
        .unwrap();
    match check(&h, charge(&permit, "bin-1")).await {
        Checked::Denied {
            status,
            headers,
            body,
        } => {
            assert_eq!(status, 200);
            assert_eq!(headers["x-atmost-result-encoding"], "base64");
            assert_eq!(
                base64::engine::general_purpose::STANDARD
                    .decode(body)
                    .unwrap(),
                result
            );
        }
        other => panic!("{other:?}"),
    }
}

/// The same key while its call is in flight: 409 with Retry-After; with
/// another request: 422; a new key past the cap: 429 with the numbers.
async fn in_flight_reused_and_capped(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    allowed(check(&h, charge(&permit, "k-1")).await);

    let (headers, body) = denied(
        check(&h, charge(&permit, "k-1")).await,
        409,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    let retry: u64 = headers["retry-after"].parse().expect("seconds");
    assert!((1..=30).contains(&retry), "within the 30 s lease: {retry}");
    assert_eq!(body["metadata"]["idempotency_key"], "k-1");

    let mut other = charge(&permit, "k-1");
    http(&mut other).raw_body = br#"{"amount":900,"currency":"EUR"}"#.to_vec();
    denied(check(&h, other).await, 422, "IDEMPOTENCY_KEY_REUSED");

    let (_, body) = denied(
        check(&h, charge(&permit, "k-2")).await,
        429,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    assert_eq!(body["metadata"]["limit"], "1");
    assert_eq!(body["metadata"]["calls_made"], "1");
    // Refusals reserve nothing.
    expect_error(
        h.client.get_attempt(&permit, "k-2").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
}

/// The cost from the tool's default in the mapping, then from a header:
/// past the budget, 429.
async fn costs_come_from_the_mapping_and_the_budget_refuses(kind: Kind) {
    let h = Harness::start_configured(kind, |app| {
        app.with_envoy(Some(mapping(
            "[cost]\nheader = \"x-atmost-cost\"\ntools = { \"wallet.charge\" = 600 }\n",
        )))
    })
    .await;
    let permit = h.create_with(&[TOOL], &[], Some(1_000)).await;
    allowed(check(&h, charge(&permit, "c-1")).await);
    assert_eq!(attempt(&h, &permit, "c-1").await.cost, 600);
    let (_, body) = denied(
        check(&h, charge(&permit, "c-2")).await,
        429,
        "PERMIT_BUDGET_EXCEEDED",
    );
    assert_eq!(body["metadata"]["requested"], "600");
    let mut cheap = charge(&permit, "c-3");
    http(&mut cheap)
        .headers
        .insert("x-atmost-cost".into(), "400".into());
    allowed(check(&h, cheap).await);
    assert_eq!(attempt(&h, &permit, "c-3").await.cost, 400);
}

/// A key whose call went UNCERTAIN, or FAILED: 409 and the reason, never
/// forwarded again.
async fn uncertain_and_failed_keys_are_not_sent_again(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let lost = allowed(check(&h, charge(&permit, "lost")).await);
    h.client
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit.clone(),
            idempotency_key: "lost".into(),
            attempt_id: lost.clone(),
            reason: "upstream timed out".into(),
        })
        .await
        .unwrap();
    let (headers, body) = denied(
        check(&h, charge(&permit, "lost")).await,
        409,
        "REPLAY_UNCERTAIN",
    );
    // UNCERTAIN is open: its id (the fencing token an operator's or the
    // tool's MarkUncertain and Commit present) never reaches the client,
    // neither in a header nor in the body.
    assert_eq!(headers.get("x-atmost-attempt-id"), None, "{headers:?}");
    assert_eq!(body.get("attempt_id"), None, "{body}");
    assert!(!body.to_string().contains(&lost), "{body}");
    assert_eq!(body["uncertain_reason"], "upstream timed out");
    assert_eq!(body["state"], "ATTEMPT_STATE_UNCERTAIN");

    let refused = allowed(check(&h, charge(&permit, "refused")).await);
    h.client
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "refused".into(),
            attempt_id: refused.clone(),
            outcome: Some(failed("card declined")),
        })
        .await
        .unwrap();
    let (headers, body) = denied(
        check(&h, charge(&permit, "refused")).await,
        409,
        "REPLAY_FAILED",
    );
    assert_eq!(body["failure_reason"], "card declined");
    // FAILED is settled: its id may go to the client.
    assert_eq!(headers["x-atmost-attempt-id"], refused);
    assert_eq!(body["attempt_id"], refused.as_str());
}

/// Unknown, revoked and expired permits and a tool out of scope: 403.
async fn permit_refusals_are_403(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    let unknown = "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f5";
    denied(
        check(&h, charge(unknown, "p-1")).await,
        403,
        "PERMIT_NOT_FOUND",
    );

    let mut out_of_scope = charge(&permit, "p-2");
    out_of_scope
        .attributes
        .as_mut()
        .unwrap()
        .context_extensions
        .insert("atmost.tool".into(), "bank.transfer".into());
    let (_, body) = denied(check(&h, out_of_scope).await, 403, "TOOL_NOT_IN_SCOPE");
    assert_eq!(body["metadata"]["tool"], "bank.transfer");

    let revoked = wallet_permit(&h).await;
    h.client.revoke_permit(&revoked).await.unwrap();
    denied(
        check(&h, charge(&revoked, "p-3")).await,
        403,
        "PERMIT_REVOKED",
    );

    h.clock.advance(2 * 3_600_000);
    denied(
        check(&h, charge(&permit, "p-4")).await,
        403,
        "PERMIT_EXPIRED",
    );
}

/// What the client must fix: 400 with every violation, nothing asked of
/// the store.
async fn malformed_requests_are_400(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    let (_, body) = denied(
        check(&h, check_request("POST", PATH, &[], BODY, None)).await,
        400,
        "INVALID_REQUEST",
    );
    let fields: Vec<&str> = body["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        ["header x-atmost-permit", "header idempotency-key", "tool"]
    );

    // The Gate's own validation: a permit id that is no UUID, a key that
    // is not printable ASCII.
    let (_, body) = denied(
        check(&h, charge("not-a-uuid", "k\u{7f}")).await,
        400,
        "INVALID_REQUEST",
    );
    let fields: Vec<&str> = body["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["field"].as_str().unwrap())
        .collect();
    assert_eq!(fields, ["permit_id", "idempotency_key"]);

    // A body Envoy cut short (allow_partial_message): no fingerprint of
    // part of it.
    let partial = check_request(
        "POST",
        PATH,
        &[
            ("x-atmost-permit", &permit),
            ("idempotency-key", "big"),
            ("x-envoy-auth-partial-body", "true"),
        ],
        BODY,
        Some(TOOL),
    );
    let (_, body) = denied(check(&h, partial).await, 400, "INVALID_REQUEST");
    assert_eq!(body["violations"][0]["field"], "body");
    expect_error(
        h.client.get_attempt(&permit, "big").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
}

/// A request with a body Envoy did not send (no `with_request_body`): 500,
/// the gateway operator's to fix; nothing reserved. Envoy then asks at the
/// headers, before any of the body arrived: `size` is 0 and no
/// `x-envoy-auth-partial-body` comes, so the body shows only in what the
/// client declared: its `content-length`, or HTTP/1.1's chunked
/// `transfer-encoding`. A request without a body passes as before, and a
/// header-sourced fingerprint needs no body at all.
async fn a_body_envoy_did_not_send_is_a_misconfiguration(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;

    let request = without_request_body(charge(&permit, "nobody"));
    assert_eq!(http(&mut request.clone()).size, 0, "as Envoy sends it");
    let (_, body) = denied(check(&h, request).await, 500, "GATEWAY_MISCONFIGURED");
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("with_request_body"), "{body}");
    assert!(message.contains("content-length 31"), "{body}");

    let mut chunked = without_request_body(charge(&permit, "nobody"));
    let headers = &mut http(&mut chunked).headers;
    headers.remove("content-length");
    headers.insert("transfer-encoding".into(), "chunked".into());
    let (_, body) = denied(check(&h, chunked).await, 500, "GATEWAY_MISCONFIGURED");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("transfer-encoding chunked"),
        "{body}"
    );
    // The same with encode_raw_headers.
    let raw = raw_headers(without_request_body(charge(&permit, "nobody")), &[]);
    denied(check(&h, raw).await, 500, "GATEWAY_MISCONFIGURED");
    expect_error(
        h.client.get_attempt(&permit, "nobody").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );

    // A client's own x-envoy-auth-partial-body is not what Envoy sends
    // (Envoy drops it), and it excuses nothing: "true" is a 400, "false"
    // with a declared length and no body is still the misconfiguration.
    let mut forged = without_request_body(charge(&permit, "nobody"));
    http(&mut forged)
        .headers
        .insert("x-envoy-auth-partial-body".into(), "true".into());
    denied(check(&h, forged).await, 400, "INVALID_REQUEST");
    let mut forged = without_request_body(charge(&permit, "nobody"));
    http(&mut forged)
        .headers
        .insert("x-envoy-auth-partial-body".into(), "false".into());
    denied(check(&h, forged).await, 500, "GATEWAY_MISCONFIGURED");
    expect_error(
        h.client.get_attempt(&permit, "nobody").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );

    // An empty chunked body, as Envoy buffering it sends it
    // (`x-envoy-auth-partial-body: false`, no bytes): nothing is missing.
    let mut empty = check_request(
        "POST",
        PATH,
        &[
            ("x-atmost-permit", &permit),
            ("idempotency-key", "empty-chunked"),
            ("transfer-encoding", "chunked"),
            ("x-envoy-auth-partial-body", "false"),
        ],
        b"",
        Some(TOOL),
    );
    http(&mut empty).headers.remove("content-length");
    allowed(check(&h, empty).await);

    // No body, no content-length: nothing is missing.
    let get = check_request(
        "GET",
        "/v1/charges/ch_1",
        &[("x-atmost-permit", &permit), ("idempotency-key", "get-1")],
        b"",
        Some("search"),
    );
    match check(&h, without_request_body(get)).await {
        Checked::Allowed { .. } => {}
        other => panic!("a request without a body: {other:?}"),
    }
}

/// With the fingerprint from a header, the body is not needed: a request
/// whose body Envoy did not send is authorized.
async fn a_header_fingerprint_needs_no_body(kind: Kind) {
    let h = Harness::start_configured(kind, |app| {
        app.with_envoy(Some(mapping("[fingerprint]\nfrom = \"header\"\n")))
    })
    .await;
    let permit = wallet_permit(&h).await;
    let mut request = without_request_body(charge(&permit, "fp-1"));
    http(&mut request)
        .headers
        .insert("x-atmost-fingerprint".into(), "client-fp".into());
    allowed(check(&h, request).await);
    assert_eq!(
        attempt(&h, &permit, "fp-1").await.request_fingerprint,
        b"client-fp"
    );
}

/// With `encode_raw_headers: true` Envoy sends each occurrence of a
/// header on its own in `header_map` (values in `raw_value`): a request is
/// read from it as from `headers`, and an `Idempotency-Key` given twice is
/// a 400 instead of one key (Envoy's `headers` map joins the two with
/// ","); a permit header given twice too. Nothing is reserved.
async fn repeated_headers_in_the_raw_header_map_are_400(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    let upstream = forwarded(check(&h, raw_headers(charge(&permit, "raw-1"), &[])).await);
    assert_eq!(upstream["x-atmost-idempotency-key"], "raw-1");
    assert_eq!(attempt(&h, &permit, "raw-1").await.tool, TOOL);

    let twice = raw_headers(charge(&permit, "raw-2"), &[("idempotency-key", "raw-3")]);
    let (_, body) = denied(check(&h, twice).await, 400, "INVALID_REQUEST");
    assert_eq!(
        body["violations"],
        serde_json::json!([{
            "field": "header idempotency-key",
            "description": "given more than once: send one value",
        }])
    );
    let other = "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f5";
    let two_permits = raw_headers(charge(&permit, "raw-4"), &[("x-atmost-permit", other)]);
    let (_, body) = denied(check(&h, two_permits).await, 400, "INVALID_REQUEST");
    assert_eq!(body["violations"][0]["field"], "header x-atmost-permit");
    for key in ["raw-2", "raw-3", "raw-4"] {
        expect_error(
            h.client.get_attempt(&permit, key).await,
            Code::NotFound,
            "ATTEMPT_NOT_FOUND",
        );
    }
}

/// A Check whose deadline (Envoy's ext_authz timeout, sent as
/// grpc-timeout) passed before its turn: 504, and the store never asked.
async fn a_check_past_its_deadline_reserves_nothing(kind: Kind) {
    use prost::Message;
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    // atmost's own refusal (504), or tonic's server timeout when it fires
    // before the body has even been read (then the handler never ran at
    // all): as for the Gate (behaviour::authorize). Either way, nothing is
    // reserved.
    match raw_unary(
        h.addr,
        "/envoy.service.auth.v3.Authorization/Check",
        &charge(&permit, "late"),
        "1n",
    )
    .await
    {
        Ok(bytes) => {
            let response = CheckResponse::decode(bytes.as_slice()).expect("decode");
            denied(read(response), 504, "DEADLINE_EXCEEDED");
        }
        Err(e) if e.code() == Code::Cancelled && e.reason().is_none() => {}
        Err(e) => panic!("a Check past its deadline: {e:?}"),
    }
    expect_error(
        h.client.get_attempt(&permit, "late").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
}

/// A CheckRequest past --max-request-bytes (128 KiB: a body Envoy
/// buffered that large) is refused as its length prefix arrives, before
/// the door reads it: RESOURCE_EXHAUSTED / MESSAGE_TOO_LARGE with the
/// limit, and nothing reserved (Envoy answers as its failure mode says).
/// One of exactly the limit is checked as any other.
async fn a_check_past_the_message_limit_reserves_nothing(kind: Kind) {
    use prost::Message;
    let h = Harness::start(kind).await;
    let permit = wallet_permit(&h).await;
    let limit = atmost::transport::Limits::DEFAULT.max_request_bytes;
    let sized = |key: &str, body: usize| {
        check_request(
            "POST",
            PATH,
            &[("x-atmost-permit", &permit), ("idempotency-key", key)],
            &vec![b'x'; body],
            Some(TOOL),
        )
    };
    let big = sized("big", limit);
    let size = big.encoded_len();
    let refused = AuthorizationClient::new(h.client.channel())
        .check(big)
        .await
        .map_err(Error::from);
    let (metadata, _) = expect_error(refused, Code::ResourceExhausted, "MESSAGE_TOO_LARGE");
    assert_eq!(metadata["limit"], limit.to_string());
    assert_eq!(metadata["size"], size.to_string());
    expect_error(
        h.client.get_attempt(&permit, "big").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );

    // A body cut to make the message exactly the limit: dispatched.
    let mut body = limit - (size - limit);
    let fits = loop {
        let request = sized("fits", body);
        match request.encoded_len() {
            len if len == limit => break request,
            len => body = body + limit - len,
        }
    };
    allowed(check(&h, fits).await);
}

// === the mapping's other sources ===

/// The permit from the JWT jwt_authn verified (metadata_context), the tool
/// from the route table, the fingerprint from a header the client sends.
async fn jwt_permit_route_table_and_header_fingerprint(kind: Kind) {
    let h = Harness::start_configured(kind, |app| {
        app.with_envoy(Some(mapping(
            r#"
[permit]
from = "jwt"
jwt-claim = "atmost.permit"

[[tool.route]]
method = "POST"
path = "/v1/charges"
tool = "wallet.charge"

[[tool.route]]
path = "/v1/search/*"
tool = "search"

[fingerprint]
from = "header"
"#,
        )))
    })
    .await;
    let permit = wallet_permit(&h).await;
    let jwt = |permit: &str| {
        let string = |s: &str| Value {
            kind: Some(V::StringValue(s.into())),
        };
        let object = |fields: Vec<(&str, Value)>| Value {
            kind: Some(V::StructValue(Struct {
                fields: fields.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            })),
        };
        Metadata {
            filter_metadata: [(
                "envoy.filters.http.jwt_authn".to_owned(),
                Struct {
                    fields: [(
                        "jwt_payload".to_owned(),
                        object(vec![
                            ("sub", string("agent-7")),
                            ("atmost", object(vec![("permit", string(permit))])),
                        ]),
                    )]
                    .into_iter()
                    .collect(),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        }
    };
    let request = |path: &str, key: &str, with_jwt: bool| {
        let mut r = check_request(
            "POST",
            path,
            &[
                // Not a source when the permit comes from the JWT.
                ("x-atmost-permit", "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f5"),
                ("idempotency-key", key),
                ("x-atmost-fingerprint", "client-fp-1"),
            ],
            BODY,
            None,
        );
        if with_jwt {
            r.attributes.as_mut().unwrap().metadata_context = Some(jwt(&permit));
        }
        r
    };
    let upstream = forwarded(check(&h, request("/v1/charges", "j-1", true)).await);
    let id = upstream["x-atmost-attempt-id"].clone();
    // The permit the JWT names, not the header's: the upstream gets it
    // although no header of the request carries it.
    assert_eq!(upstream["x-atmost-permit-id"], permit);
    let a = attempt(&h, &permit, "j-1").await;
    assert_eq!((a.attempt_id.as_str(), a.tool.as_str()), ("", TOOL));
    assert_eq!(a.request_fingerprint, b"client-fp-1");
    // The id forwarded is the reservation's: MarkUncertain with only the
    // forwarded headers takes it, and an UNCERTAIN attempt's id reads back
    // (dev mode may Resolve it).
    h.client
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: upstream["x-atmost-permit-id"].clone(),
            idempotency_key: upstream["x-atmost-idempotency-key"].clone(),
            attempt_id: upstream["x-atmost-attempt-id"].clone(),
            reason: "checked by the test".into(),
        })
        .await
        .expect("the forwarded headers name the attempt");
    assert_eq!(attempt(&h, &permit, "j-1").await.attempt_id, id);
    match check(&h, request("/v1/search/docs?q=x", "j-2", true)).await {
        Checked::Allowed { .. } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(attempt(&h, &permit, "j-2").await.tool, "search");
    let (_, body) = denied(
        check(&h, request("/v1/charges", "j-3", false)).await,
        400,
        "INVALID_REQUEST",
    );
    assert_eq!(body["violations"][0]["field"], "jwt claim atmost.permit");
    let (_, body) = denied(
        check(&h, request("/v2/other", "j-4", true)).await,
        400,
        "INVALID_REQUEST",
    );
    assert_eq!(body["violations"][0]["field"], "tool");
}

/// The route table matches a path in its one plain form only: each path
/// an upstream may run as the capture while its bytes fit the catch-all is
/// refused (400, what is wrong), reserving nothing; a plain path still maps
/// to the capture, and a tool the route names leaves the path to Envoy.
async fn a_path_the_route_table_could_misread_is_refused(kind: Kind) {
    let h = Harness::start_configured(kind, |app| app.with_envoy(Some(mapping(super::STEERABLE))))
        .await;
    let permit = super::steerable_permit(&h).await;
    let to = |path: &str, key: &str, tool: Option<&str>| {
        check_request(
            "POST",
            path,
            &[("x-atmost-permit", &permit), ("idempotency-key", key)],
            BODY,
            tool,
        )
    };
    // Every path is tried, and each one not refused is named.
    let mut steered = Vec::new();
    for (n, (path, says)) in super::STEERING_PATHS.iter().enumerate() {
        let key = format!("steer-{n}");
        match check(&h, to(path, &key, None)).await {
            Checked::Denied {
                status: 400,
                headers,
                body,
            } if headers["x-atmost-reason"] == "PATH_NOT_CANONICAL" => {
                assert_eq!(headers["content-type"], "application/json");
                super::refused_path(&serde_json::from_str(&body).unwrap(), path, says);
                expect_error(
                    h.client.get_attempt(&permit, &key).await,
                    Code::NotFound,
                    "ATTEMPT_NOT_FOUND",
                );
            }
            other => steered.push(format!("{path}: {other:?}")),
        }
    }
    assert!(steered.is_empty(), "not refused: {steered:#?}");
    assert_eq!(
        super::usage(&h, &permit).await,
        (
            vec![("wallet.capture".into(), 0), ("wallet.read".into(), 0)],
            0
        ),
        "nothing reserved"
    );

    let plain = "/v1/charges/abc/capture?expand=balance&next=/a/../b/";
    assert!(matches!(
        check(&h, to(plain, "capture", None)).await,
        Checked::Allowed { .. }
    ));
    let a = attempt(&h, &permit, "capture").await;
    assert_eq!((a.tool.as_str(), a.cost), ("wallet.capture", 1000));
    assert!(matches!(
        check(&h, to("/v1/charges/abc", "read", None)).await,
        Checked::Allowed { .. }
    ));
    assert_eq!(attempt(&h, &permit, "read").await.tool, "wallet.read");
    // The route's own tool (its context extension): Envoy's route match
    // chose it, and the table is not read.
    assert!(matches!(
        check(&h, to("/v1/charges/abc/", "routed", Some("wallet.read"))).await,
        Checked::Allowed { .. }
    ));
    assert_eq!(
        super::usage(&h, &permit).await,
        (
            vec![("wallet.capture".into(), 1), ("wallet.read".into(), 2)],
            1000
        )
    );
}

// === the store ===

/// Redis down: 503, fail closed; back up, the same key dispatches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_unreachable_is_503_and_nothing_passes() {
    let _machine = shared().await;
    let mut redis = Redis::start_persistent();
    let store = redis_store(
        &redis.url,
        &redis.prefix,
        std::time::Duration::from_millis(500),
    );
    let h = Harness::serve(atmost::store::Backend::Redis(store), None, |app| app).await;
    let permit = wallet_permit(&h).await;
    redis.kill();
    let (_, body) = denied(
        check(&h, charge(&permit, "down")).await,
        503,
        "STORE_UNAVAILABLE",
    );
    // The store's own words stay in atmost's log: the gateway's client
    // learns only that nothing was decided.
    assert_eq!(
        body["message"],
        "the store could not be reached or could not confirm: nothing was decided; try again"
    );
    // Back up (with what it had persisted), the same key is a fresh
    // DISPATCH: the 503 reserved nothing.
    redis.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        match check(&h, charge(&permit, "down")).await {
            Checked::Denied { status: 503, .. } => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "Redis never came back"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => {
                allowed(other);
                break;
            }
        }
    }
}

// === keys, tenants, reflection ===

/// With API keys, the gateway sends its own (Envoy's grpc_service
/// initial_metadata): no key is refused before anything is read; a key
/// without the agent role too; the key's tenant scopes the permits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_authenticates_with_an_agent_key_of_its_tenant() {
    use crate::auth::{KeyFile, entry};
    let _machine = shared().await;
    let keys = KeyFile::new(
        &[
            entry("admin-1", "admin-key-0123456789", "acme", "\"admin\""),
            entry("gateway-1", "gateway-key-0123456789", "acme", "\"agent\""),
            entry("ops-1", "ops-key-0123456789", "acme", "\"operator\""),
            entry("gateway-2", "other-key-0123456789", "globex", "\"agent\""),
        ]
        .concat(),
    );
    let auth = std::sync::Arc::new(atmost::auth::Authenticator::load(&keys.path).unwrap());
    let h = Harness::serve(
        atmost::store::Backend::Memory(atmost::store::memory::MemoryStore::new(DAY_MS)),
        None,
        |app| app.with_auth(auth),
    )
    .await;
    let admin = h
        .client
        .clone()
        .with_api_key("admin-key-0123456789")
        .unwrap();
    let mut p = h.permit(&[TOOL]);
    p.max_calls_per_tool = [(TOOL.to_owned(), 1)].into_iter().collect();
    let permit = admin.create_permit(p).await.unwrap().permit_id;
    let with_key = |key: Option<&str>, request: CheckRequest| {
        let mut r = tonic::Request::new(request);
        if let Some(key) = key {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {key}").parse().unwrap());
        }
        r
    };
    let client = AuthorizationClient::new(h.client.channel());
    let status = client
        .clone()
        .check(with_key(None, charge(&permit, "a-1")))
        .await
        .expect_err("no key");
    assert_eq!(status.code(), Code::Unauthenticated);
    let status = client
        .clone()
        .check(with_key(Some("ops-key-0123456789"), charge(&permit, "a-1")))
        .await
        .expect_err("an operator's key");
    assert_eq!(status.code(), Code::PermissionDenied);
    // Another tenant's gateway: the permit does not exist for it.
    denied(
        check_with(
            &h,
            with_key(Some("other-key-0123456789"), charge(&permit, "a-1")),
        )
        .await,
        403,
        "PERMIT_NOT_FOUND",
    );
    allowed(
        check_with(
            &h,
            with_key(Some("gateway-key-0123456789"), charge(&permit, "a-1")),
        )
        .await,
    );
    let a = admin
        .get_attempt(&permit, "a-1")
        .await
        .unwrap()
        .attempt
        .unwrap();
    assert_eq!(a.state(), AttemptState::Reserved);
}

/// Reflection lists both Envoy services (grpcurl can call Check) and
/// health reports them; `--envoy=false` serves neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_and_health_name_the_envoy_services_and_they_can_be_turned_off() {
    let _machine = shared().await;
    let services = |h: &Harness| {
        let channel = h.client.channel();
        async move {
            use tonic_reflection::pb::v1::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
                server_reflection_request::MessageRequest,
                server_reflection_response::MessageResponse,
            };
            let mut answers = ServerReflectionClient::new(channel)
                .server_reflection_info(tokio_stream::iter(vec![ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(MessageRequest::ListServices(String::new())),
                }]))
                .await
                .expect("reflection")
                .into_inner();
            let answer = answers.message().await.expect("answer").expect("one");
            match answer.message_response {
                Some(MessageResponse::ListServicesResponse(list)) => {
                    list.service.into_iter().map(|s| s.name).collect::<Vec<_>>()
                }
                other => panic!("{other:?}"),
            }
        }
    };
    let h = Harness::start(Kind::Memory).await;
    let listed = services(&h).await;
    for name in [
        "envoy.service.auth.v3.Authorization",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "atmost.v1.Gate",
    ] {
        assert!(listed.iter().any(|s| s == name), "{name} in {listed:?}");
    }
    for name in [
        "envoy.service.auth.v3.Authorization",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(
            health(&h.client, name).await.expect("health"),
            ServingStatus::Serving
        );
    }

    let off = Harness::start_configured(Kind::Memory, |app| app.with_envoy(None)).await;
    let listed = services(&off).await;
    assert!(
        !listed.iter().any(|s| s.starts_with("envoy.")),
        "{listed:?}"
    );
    let status = AuthorizationClient::new(off.client.channel())
        .check(CheckRequest::default())
        .await
        .expect_err("not served");
    assert_eq!(status.code(), Code::Unimplemented);
}

/// docs/gateways.md's grpcurl example is a request atmost accepts: its
/// JSON, read through the descriptors reflection serves (as grpcurl reads
/// it), is forwarded, and the same command again is 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpcurl_example_in_the_docs_is_served() {
    let _machine = shared().await;
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/gateways.md"))
        .expect("docs/gateways.md");
    let block = docs
        .split("<!-- gateways-check: grpcurl-check -->")
        .nth(1)
        .and_then(|rest| rest.split("```sh\n").nth(1))
        .and_then(|rest| rest.split("\n```").next())
        .expect("the marked grpcurl block");
    assert!(
        block.contains("envoy.service.auth.v3.Authorization/Check"),
        "{block}"
    );
    let json = block
        .split("<<EOF\n")
        .nth(1)
        .and_then(|rest| rest.split("\nEOF").next())
        .expect("a heredoc");
    let h = Harness::start(Kind::Memory).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let json = json.replace("$PERMIT", &permit);
    let pool = prost_reflect::DescriptorPool::decode(atmost::api::envoy::FILE_DESCRIPTOR_SET)
        .expect("descriptors");
    let desc = pool
        .get_message_by_name("envoy.service.auth.v3.CheckRequest")
        .expect("CheckRequest");
    let mut de = serde_json::Deserializer::from_str(&json);
    let dynamic = prost_reflect::DynamicMessage::deserialize(desc, &mut de).expect("the JSON");
    let request = <CheckRequest as prost::Message>::decode(
        prost::Message::encode_to_vec(&dynamic).as_slice(),
    )
    .unwrap();
    let id = allowed(check(&h, request.clone()).await);
    uuid::Uuid::parse_str(&id).expect("the attempt's id is forwarded");
    let a = attempt(&h, &permit, "order-1").await;
    assert_eq!(
        (a.state(), a.attempt_id.as_str()),
        (AttemptState::Reserved, "")
    );
    denied(check(&h, request).await, 409, "IDEMPOTENCY_IN_PROGRESS");
}

/// With metrics on, a Check is an RPC of its own in the RPC metrics, its
/// store call is timed, and its answers are counted as an Authorize's:
/// decisions, and refusals by reason, though each Check answers gRPC OK
/// (docs/telemetry.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_is_measured() {
    let _machine = shared().await;
    let server = spawn_atmost(&["--metrics-listen", "127.0.0.1:0"]);
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let client = server.client().await;
    let permit = client
        .create_permit(
            NewPermit::new([TOOL])
                .expires_at_ms(atmost_client::now_ms() + 3_600_000)
                .build(),
        )
        .await
        .unwrap()
        .permit_id;
    let mut gateway = AuthorizationClient::new(client.channel());
    let mut check = async |request| read(gateway.check(request).await.unwrap().into_inner());
    assert!(matches!(
        check(charge(&permit, "measured")).await,
        Checked::Allowed { .. }
    ));
    denied(
        check(charge(&permit, "measured")).await,
        409,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    let no_key = check_request(
        "POST",
        PATH,
        &[("x-atmost-permit", &permit)],
        BODY,
        Some(TOOL),
    );
    denied(check(no_key).await, 400, "INVALID_REQUEST");
    // The duplicate guard, enforced: the same request under a new key.
    let guarded = client
        .create_permit(
            NewPermit::new([TOOL])
                .expires_at_ms(atmost_client::now_ms() + 3_600_000)
                .duplicate_guard(pb::DuplicateGuardMode::Enforce, None),
        )
        .await
        .unwrap()
        .permit_id;
    assert!(matches!(
        check(charge(&guarded, "first")).await,
        Checked::Allowed { .. }
    ));
    denied(
        check(charge(&guarded, "second")).await,
        409,
        "DUPLICATE_REQUEST_SUSPECTED",
    );
    let samples = crate::telemetry::scrape(metrics).await;
    let count = |prefix: &str, label: &str| {
        samples
            .iter()
            .filter(|(k, _)| k.starts_with(prefix) && k.contains(label))
            .map(|(_, v)| *v)
            .sum::<f64>()
    };
    assert_eq!(
        count(
            "rpc_server_call_duration_seconds_count",
            "rpc_method=\"Check\""
        ),
        5.0,
        "{samples:#?}"
    );
    for (series, n) in [
        (
            r#"atmost_decisions_total{decision="DISPATCH",reason=""}"#,
            2.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="DUPLICATE_REQUEST_SUSPECTED"}"#,
            1.0,
        ),
        (
            r#"atmost_duplicate_guard_hits_total{action="refused"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="IDEMPOTENCY_IN_PROGRESS"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="INVALID_REQUEST"}"#,
            1.0,
        ),
        (
            r#"atmost_errors_total{reason="IDEMPOTENCY_IN_PROGRESS",rpc_method="Check"}"#,
            1.0,
        ),
        (
            r#"atmost_errors_total{reason="INVALID_REQUEST",rpc_method="Check"}"#,
            1.0,
        ),
    ] {
        assert_eq!(samples.get(series), Some(&n), "{series}: {samples:#?}");
    }
    assert_eq!(
        count(
            "atmost_store_duration_seconds_count",
            "operation=\"authorize\""
        ),
        4.0,
        "{samples:#?}"
    );
}

/// The binary reads `--envoy-mapping` at start-up: a bad file stops it
/// (exit 2, naming the file and the setting), as does a mapping with
/// `--envoy=false`; a good one takes effect; `--envoy=false` serves no
/// front door.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_reads_the_mapping_at_start_up() {
    let _machine = shared().await;
    let dir = std::env::temp_dir().join(format!("atmost-envoy-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[tool.route]]\npath = \"/v1/charges\"\ntool = \"no spaces\"\n",
    )
    .unwrap();
    let (status, stderr) = run_to_exit(&["--envoy-mapping", bad.to_str().unwrap()]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--envoy-mapping: {}: tool.route[1].tool",
            bad.display()
        )),
        "{stderr}"
    );
    let good = dir.join("good.toml");
    std::fs::write(
        &good,
        "[[tool.route]]\nmethod = \"POST\"\npath = \"/v1/charges\"\ntool = \"wallet.charge\"\n",
    )
    .unwrap();
    let (status, stderr) =
        run_to_exit(&["--envoy=false", "--envoy-mapping", good.to_str().unwrap()]);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--envoy=false"), "{stderr}");

    let process = spawn_atmost(&["--envoy-mapping", good.to_str().unwrap()]);
    let client = process.client().await;
    let permit = client
        .create_permit(
            NewPermit::new([TOOL])
                .expires_at_ms(atmost_client::now_ms() + 3_600_000)
                .build(),
        )
        .await
        .unwrap()
        .permit_id;
    // No context extension: the route table names the tool.
    let response = AuthorizationClient::new(client.channel())
        .check(check_request(
            "POST",
            "/v1/charges",
            &[("x-atmost-permit", &permit), ("idempotency-key", "bin-1")],
            BODY,
            None,
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(read(response), Checked::Allowed { .. }));
    let a = client
        .get_attempt(&permit, "bin-1")
        .await
        .unwrap()
        .attempt
        .unwrap();
    assert_eq!(a.tool, TOOL);

    let off = spawn_atmost(&["--envoy=false"]);
    let status = AuthorizationClient::new(off.client().await.channel())
        .check(CheckRequest::default())
        .await
        .expect_err("not served");
    assert_eq!(status.code(), Code::Unimplemented);
    let _ = std::fs::remove_dir_all(&dir);
}

on_each_store!(
    dispatch_then_the_upstream_commits_and_the_key_replays,
    a_binary_result_replays_base64_encoded,
    in_flight_reused_and_capped,
    costs_come_from_the_mapping_and_the_budget_refuses,
    uncertain_and_failed_keys_are_not_sent_again,
    permit_refusals_are_403,
    malformed_requests_are_400,
    a_body_envoy_did_not_send_is_a_misconfiguration,
    a_header_fingerprint_needs_no_body,
    repeated_headers_in_the_raw_header_map_are_400,
    a_check_past_its_deadline_reserves_nothing,
    a_check_past_the_message_limit_reserves_nothing,
    jwt_permit_route_table_and_header_fingerprint,
    a_path_the_route_table_could_misread_is_refused,
);
