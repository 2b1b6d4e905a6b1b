//! `envoy.service.auth.v3.Authorization/Check`: Envoy's external
//! authorization, asked once per HTTP request before it is routed.
//!
//! DISPATCH lets the request through with `x-atmost-attempt-id` (the
//! tool's own idempotency key), `x-atmost-permit-id` and
//! `x-atmost-idempotency-key` added upstream, and the attempt in the
//! filter's dynamic metadata; nothing is added to the response, so the
//! attempt's id (its fencing token, while it is open) never reaches the
//! client. Every other answer is a denied response Envoy sends the client
//! instead of calling the tool ([`super::Answer`]). ext_authz sees no
//! response, so nothing here commits: the upstream (or a reconciler)
//! settles the attempt through the Gate with the three headers
//! (docs/gateways.md, "Without ext_proc").

use super::{Answer, Headers, HttpRequest, Mapping, Reply, Unmapped};
use crate::api::gate::GateService;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::service::auth::v3::{
    CheckRequest, CheckResponse, DeniedHttpResponse, OkHttpResponse,
    authorization_server::Authorization, check_response::HttpResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use std::sync::Arc;
use tonic::{Request, Response, Status, metadata::MetadataMap};

/// The header Envoy adds to the CheckRequest whenever it buffered the
/// request's body for `with_request_body`: `"true"` when
/// `allow_partial_message` cut it, `"false"` when it is whole. Envoy
/// drops a client's own header of that name, and adds none without
/// `with_request_body` or for a request without a body
/// (check_request_utils.cc, `setHttpRequest`).
const PARTIAL_BODY: &str = "x-envoy-auth-partial-body";
/// On a replayed result sent base64-encoded (ext_authz carries a denied
/// response's body as text).
pub const RESULT_ENCODING_HEADER: &str = "x-atmost-result-encoding";

pub struct ExtAuthzService {
    gate: GateService,
    mapping: Arc<Mapping>,
}

impl ExtAuthzService {
    pub fn new(gate: GateService, mapping: Arc<Mapping>) -> Self {
        Self { gate, mapping }
    }
}

/// A header Envoy sets on the request or the response, replacing any the
/// client sent (so no client can forge an attempt id).
fn set(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            value,
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The CheckResponse of an answer.
pub(super) fn check_response(answer: Answer) -> CheckResponse {
    match answer {
        Answer::Forward(attempt) => CheckResponse {
            status: Some(RpcStatus {
                code: tonic::Code::Ok as i32,
                ..Default::default()
            }),
            dynamic_metadata: Some(super::attempt_metadata(&attempt)),
            // Upstream only, each replacing any the client sent: the
            // attempt is RESERVED while the tool runs, and its id is the
            // fencing token the Commit presents, so nothing goes downstream
            // (`response_headers_to_add` stays empty). A key is printable
            // ASCII and a permit id a UUID (the Gate's validation): both
            // are valid header values.
            http_response: Some(HttpResponse::OkResponse(OkHttpResponse {
                headers: super::upstream_headers(&attempt)
                    .into_iter()
                    .map(|(k, v)| set(k, v.to_owned()))
                    .collect(),
                ..Default::default()
            })),
        },
        Answer::Respond(reply) => {
            let Reply {
                status,
                reason,
                mut headers,
                body,
            } = reply;
            // A denied response's body is a string: a result that is not
            // UTF-8 (a replayed binary result) goes base64-encoded.
            let body = match String::from_utf8(body) {
                Ok(text) => text,
                Err(e) => {
                    use base64::Engine;
                    headers.push((RESULT_ENCODING_HEADER, "base64".to_owned()));
                    base64::engine::general_purpose::STANDARD.encode(e.into_bytes())
                }
            };
            CheckResponse {
                // Any code but OK denies; the HTTP status is the answer.
                status: Some(RpcStatus {
                    code: tonic::Code::PermissionDenied as i32,
                    message: reason,
                    ..Default::default()
                }),
                dynamic_metadata: None,
                http_response: Some(HttpResponse::DeniedResponse(DeniedHttpResponse {
                    status: Some(HttpStatus {
                        code: i32::from(status),
                    }),
                    headers: headers.into_iter().map(|(k, v)| set(k, v)).collect(),
                    body,
                })),
            }
        }
    }
}

/// Whether the request says it has a body, and how, as Envoy describes it
/// at header time: a `content-length` above 0, a `transfer-encoding`
/// (HTTP/1.1 chunked), or body bytes Envoy already counted (`size`, its
/// bytes received: 0 at header time without `with_request_body`). An
/// HTTP/2 or HTTP/3 request that sends DATA without a `content-length`
/// says none of these: its body cannot be seen here.
fn declared_body(headers: &Headers, size: i64, buffered: bool) -> Option<String> {
    if let Some(length) = headers.get("content-length") {
        // Envoy refuses a request whose content-length is not a number;
        // anything else but 0 is taken as a body, failing closed.
        let length = String::from_utf8_lossy(length);
        if length.trim().parse::<u64>() != Ok(0) {
            return Some(format!("content-length {}", length.trim()));
        }
    }
    // Envoy, buffering (`x-envoy-auth-partial-body` set), sends an empty
    // chunked body as it is: only a length it did not deliver says the
    // body went missing. A client's own copy of that header cannot excuse
    // a declared length (Envoy drops such copies; another gateway may not).
    if let Some(coding) = headers.get("transfer-encoding")
        && !buffered
    {
        return Some(format!(
            "transfer-encoding {}",
            String::from_utf8_lossy(coding).trim()
        ));
    }
    (size > 0).then(|| format!("{size} bytes received"))
}

#[tonic::async_trait]
impl Authorization for ExtAuthzService {
    async fn check(
        &self,
        request: Request<CheckRequest>,
    ) -> Result<Response<CheckResponse>, Status> {
        // The extensions carry the caller (its key's tenant and roles) and
        // its deadline, for the Gate to apply as to any Authorize.
        let (_, extensions, check) = request.into_parts();
        let attributes = check.attributes.unwrap_or_default();
        let http = attributes.request.and_then(|r| r.http).unwrap_or_default();
        // `headers` (merged, lower-case), or with `encode_raw_headers` the
        // raw list.
        let headers = if http.headers.is_empty() {
            Headers::new(
                http.header_map
                    .map(|m| m.headers)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|h| {
                        let value = if h.raw_value.is_empty() {
                            h.value.into_bytes()
                        } else {
                            h.raw_value
                        };
                        (h.key, value)
                    }),
            )
        } else {
            Headers::new(http.headers.into_iter().map(|(k, v)| (k, v.into_bytes())))
        };
        // `raw_body` with `pack_as_bytes`, else the text `body`.
        let body = if http.raw_body.is_empty() {
            http.body.into_bytes()
        } else {
            http.raw_body
        };
        let route_tool = self
            .mapping
            .tool
            .context_extension
            .as_ref()
            .and_then(|key| attributes.context_extensions.get(key))
            .map(String::as_str);

        let mut unmapped = None;
        if self.mapping.needs_body() {
            let partial = headers.get(PARTIAL_BODY);
            if partial == Some(b"true") {
                unmapped = Some(Unmapped::Invalid(vec![crate::domain::Violation {
                    field: "body".into(),
                    description: "longer than the gateway sends atmost (with_request_body \
                        max_request_bytes): the fingerprint needs all of it"
                        .into(),
                }]));
            } else if body.is_empty()
                && let Some(declared) = declared_body(&headers, http.size, partial.is_some())
            {
                unmapped = Some(Unmapped::Misconfigured(format!(
                    "the request has a body ({declared}) and the gateway sent none: the \
                     fingerprint needs it (ext_authz with_request_body, pack_as_bytes: true), \
                     or take the fingerprint from a header"
                )));
            }
        }
        let request = HttpRequest {
            method: &http.method,
            path: &http.path,
            headers: &headers,
            body: &body,
            route_tool,
            metadata: attributes.metadata_context.as_ref(),
        };
        let answer = match unmapped.map_or_else(|| self.mapping.authorize_request(&request), Err) {
            Ok(authorize) => Answer::of(
                self.gate
                    .do_authorize(Request::from_parts(
                        MetadataMap::new(),
                        extensions,
                        authorize,
                    ))
                    .await,
            ),
            Err(unmapped) => Answer::Respond(Reply::unmapped(unmapped)),
        };
        Ok(Response::new(check_response(answer)))
    }
}
