//! The HTTP/JSON edge: every RPC of `atmost.v1` at the path its
//! `google.api.http` option names ([`routes`]), with proto3 JSON bodies
//! and answers, and errors as `google.rpc.Status` in JSON ([`error`];
//! AIP-127, AIP-193), over HTTP/1.1 or HTTP/2 on the gRPC listener.
//!
//! It transcodes, as Envoy's `grpc_json_transcoder` does, but in process,
//! in front of the very service stack the gRPC edge runs: a JSON request
//! becomes its RPC's gRPC request (the RPC's path, the caller's headers,
//! its connection, and a body that becomes the request message when the
//! service reads it, [`body`]). So authentication, roles, tenants,
//! admission, the message limit, the handlers, the audit trail, spans and
//! metrics all see the request a gRPC caller would have sent, and nothing
//! is checked here that a gRPC call skips. The RPC's answer, a message or
//! a status, is written back as JSON.
//!
//! What is HTTP's own: the routes, the body's size and content type, the
//! `Idempotency-Key` header, the status table, `Retry-After` and
//! `Idempotent-Replayed` (docs/api.md, "HTTP/JSON").

mod body;
pub mod error;
pub mod routes;

use crate::admission::BoxFuture;
use bytes::Buf as _;
use http::{HeaderValue, Method, StatusCode, header};
use http_body::Body as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, Value};
use routes::{Miss, Routes};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tonic::{Code, Status};

/// The contract with google.rpc.Status and its details (build.rs).
const DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("http_descriptor");

/// The descriptor pool of [`DESCRIPTOR_SET`].
pub fn pool() -> DescriptorPool {
    DescriptorPool::decode(DESCRIPTOR_SET).expect("build.rs wrote a valid descriptor set")
}

/// A JSON request body's largest size, as a multiple of the request
/// message's (`--max-request-bytes`): JSON spells bytes in base64 and
/// names every field.
pub const JSON_BODY_FACTOR: usize = 4;

/// The header `Idempotent-Replayed: true` on an Authorize answered REPLAY.
const REPLAYED: &str = "idempotent-replayed";

/// What the edge needs: the routes, the descriptors, the limits.
#[derive(Debug)]
pub struct Edge {
    routes: Routes,
    rpc_status: MessageDescriptor,
    max_body_bytes: usize,
    max_response_bytes: usize,
    max_header_bytes: usize,
}

impl Edge {
    /// The edge of `atmost.v1` under these limits: a JSON body of up to
    /// [`JSON_BODY_FACTOR`] request messages, answers up to the response
    /// limit, headers up to the header list limit.
    pub fn new(limits: &crate::transport::Limits) -> Self {
        let pool = pool();
        Self {
            routes: Routes::of_package(&pool, "atmost.v1")
                .expect("the contract's routes (a unit test holds them)"),
            rpc_status: pool
                .get_message_by_name("google.rpc.Status")
                .expect("build.rs compiles google/rpc/status.proto"),
            max_body_bytes: limits.max_request_bytes.saturating_mul(JSON_BODY_FACTOR),
            max_response_bytes: limits.max_response_bytes,
            max_header_bytes: limits.max_header_list_bytes as usize,
        }
    }

    pub fn routes(&self) -> &Routes {
        &self.routes
    }
}

/// The tower layer in front of the gRPC stack: gRPC requests pass, others
/// are served as HTTP/JSON through the stack.
#[derive(Debug, Clone)]
pub struct HttpLayer {
    edge: Arc<Edge>,
}

impl HttpLayer {
    pub fn new(edge: Arc<Edge>) -> Self {
        Self { edge }
    }
}

impl<S> tower::Layer<S> for HttpLayer {
    type Service = HttpService<S>;

    fn layer(&self, inner: S) -> HttpService<S> {
        HttpService {
            inner,
            edge: self.edge.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct HttpService<S> {
    inner: S,
    edge: Arc<Edge>,
}

/// Whether a request is gRPC (`application/grpc`, `application/grpc+proto`).
fn is_grpc<B>(request: &http::Request<B>) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

type Request = http::Request<tonic::body::Body>;
type Response = http::Response<tonic::body::Body>;

impl<S> tower::Service<Request> for HttpService<S>
where
    S: tower::Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures_util::future::Either<S::Future, BoxFuture<Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        if is_grpc(&request) {
            return futures_util::future::Either::Left(self.inner.call(request));
        }
        // The service that was polled ready serves this request; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let edge = self.edge.clone();
        futures_util::future::Either::Right(Box::pin(
            async move { edge.serve(request, inner).await },
        ))
    }
}

impl Edge {
    async fn serve<S>(&self, request: Request, mut inner: S) -> Result<Response, S::Error>
    where
        S: tower::Service<Request, Response = Response>,
    {
        let (parts, body) = request.into_parts();
        let matched = match self.routes.find(&parts.method, parts.uri.path()) {
            Ok(matched) => matched,
            Err(miss) => return Ok(self.unrouted(&parts.method, parts.uri.path(), miss)),
        };
        let header_bytes: usize = parts
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 32)
            .sum();
        if header_bytes > self.max_header_bytes {
            return Ok(self.plain(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                Code::ResourceExhausted,
                format!(
                    "the request's headers are {header_bytes} bytes (HTTP/2's count), more than the {} this server reads",
                    self.max_header_bytes
                ),
            ));
        }
        // A write says it is JSON: a browser cannot send that to another
        // origin without asking first (CORS), so a page cannot post here.
        if parts.method != Method::GET && !is_json(parts.headers.get(header::CONTENT_TYPE)) {
            return Ok(self.plain(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Code::InvalidArgument,
                format!(
                    "{} {} takes a body of content-type application/json",
                    parts.method, matched.route.template
                ),
            ));
        }
        let route = matched.route;
        let read = Arc::new(AtomicBool::new(false));
        let params = body::Params {
            vars: matched.vars,
            query: parts.uri.query().map(str::to_owned),
            idempotency_keys: parts
                .headers
                .get_all("idempotency-key")
                .iter()
                .cloned()
                .collect(),
            content_length: parts
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse().ok()),
        };
        let grpc_body = body::transcode(
            body,
            route.rpc.input(),
            route.body.clone(),
            params,
            self.max_body_bytes,
            read.clone(),
        );
        let mut grpc = http::Request::new(grpc_body);
        *grpc.method_mut() = Method::POST;
        *grpc.uri_mut() = http::Uri::from_maybe_shared(route.grpc_path.clone())
            .expect("a gRPC path is a valid URI");
        *grpc.version_mut() = http::Version::HTTP_2;
        *grpc.extensions_mut() = parts.extensions;
        let headers = grpc.headers_mut();
        for (name, value) in &parts.headers {
            if !HOP_AND_BODY.contains(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
        let response = inner.call(grpc).await?;
        Ok(self.answer(response, route, &read).await)
    }

    /// The RPC's gRPC answer as JSON.
    async fn answer(
        &self,
        response: Response,
        route: &routes::Route,
        read: &AtomicBool,
    ) -> Response {
        let (parts, body) = response.into_parts();
        let outcome = match Status::from_header_map(&parts.headers) {
            // Trailers-only: refused before the handler (auth, admission).
            Some(status) => Err(status),
            None => match self.collect(body).await {
                Ok((data, trailers)) => match trailers.as_ref().and_then(Status::from_header_map) {
                    Some(status) if status.code() != Code::Ok => Err(status),
                    Some(_) => Ok(data),
                    None => Err(Status::internal("the RPC answered without a grpc-status")),
                },
                Err(status) => Err(status),
            },
        };
        let status = match outcome.and_then(|data| self.message(&data, route)) {
            Ok(message) => return self.success(message, route),
            Err(status) => status,
        };
        // tonic answers CANCELLED when the request timeout cuts the RPC
        // (transport::RequestTimeout): the client did not cancel, it would
        // not be reading. Still reading its body: 408; later: 504.
        if status.code() == Code::Cancelled {
            let (code, message) = if read.load(Ordering::Acquire) {
                (
                    StatusCode::GATEWAY_TIMEOUT,
                    "the RPC did not finish within the request timeout",
                )
            } else {
                (
                    StatusCode::REQUEST_TIMEOUT,
                    "the request's body did not arrive within the request timeout",
                )
            };
            return self.plain(code, Code::DeadlineExceeded, message.to_owned());
        }
        error::respond(&status, &self.rpc_status)
    }

    /// The response body's data and trailers, up to the response limit.
    async fn collect(
        &self,
        body: tonic::body::Body,
    ) -> Result<(bytes::Bytes, Option<http::HeaderMap>), Status> {
        let mut body = std::pin::pin!(body);
        let mut data = bytes::BytesMut::new();
        let mut trailers = None;
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            let frame =
                frame.map_err(|e| Status::internal(format!("the RPC's answer broke off: {e}")))?;
            match frame.into_data() {
                Ok(chunk) => {
                    if data.len() + chunk.len() > self.max_response_bytes + 5 {
                        return Err(Status::resource_exhausted(
                            "the answer is larger than the response limit",
                        ));
                    }
                    data.extend_from_slice(&chunk);
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers = Some(t);
                    }
                }
            }
        }
        Ok((data.freeze(), trailers))
    }

    /// The one message of a unary answer.
    fn message(&self, data: &[u8], route: &routes::Route) -> Result<DynamicMessage, Status> {
        let mut data = data;
        if data.len() < 5 || data[0] != 0 {
            return Err(Status::internal(
                "the RPC's answer is not one uncompressed message",
            ));
        }
        data.advance(1);
        let len = data.get_u32() as usize;
        if data.len() != len {
            return Err(Status::internal(
                "the RPC's answer is not one whole message",
            ));
        }
        DynamicMessage::decode(route.rpc.output(), data)
            .map_err(|e| Status::internal(format!("the RPC's answer does not decode: {e}")))
    }

    fn success(&self, message: DynamicMessage, route: &routes::Route) -> Response {
        let body = match serde_json::to_vec(&message) {
            Ok(body) => body,
            Err(e) => {
                return error::respond(
                    &Status::internal(format!("the answer could not be written as JSON: {e}")),
                    &self.rpc_status,
                );
            }
        };
        let mut response = error::json_response(StatusCode::OK, body);
        if route.grpc_path == "/atmost.v1.Gate/Authorize"
            && message.get_field_by_name("decision").as_deref()
                == Some(&Value::EnumNumber(crate::pb::Decision::Replay as i32))
        {
            response
                .headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
        }
        response
    }

    /// A refusal of the edge's own, before any RPC: no reason of the
    /// contract's applies, so no ErrorInfo.
    fn plain(&self, http: StatusCode, code: Code, message: String) -> Response {
        let mut response = error::respond(&Status::new(code, message), &self.rpc_status);
        *response.status_mut() = http;
        response
    }

    fn unrouted(&self, method: &Method, path: &str, miss: Miss) -> Response {
        match miss {
            Miss::Path => self.plain(
                StatusCode::NOT_FOUND,
                Code::NotFound,
                format!("no RPC is served at {path} (docs/api.md, \"HTTP/JSON\")"),
            ),
            Miss::Method(allowed) => {
                let names: Vec<&str> = allowed.iter().map(Method::as_str).collect();
                let mut response = self.plain(
                    StatusCode::METHOD_NOT_ALLOWED,
                    Code::Unimplemented,
                    format!("{path} takes {}, not {method}", names.join(" or ")),
                );
                if let Ok(value) = HeaderValue::from_str(&names.join(", ")) {
                    response.headers_mut().insert(header::ALLOW, value);
                }
                response
            }
        }
    }
}

/// The HTTP request's headers that describe its own body or hop, not the
/// call: left out of the gRPC request.
const HOP_AND_BODY: [header::HeaderName; 7] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::TRANSFER_ENCODING,
    header::CONNECTION,
    header::TE,
    header::UPGRADE,
    header::HOST,
];

/// `application/json`, with parameters (`; charset=utf-8`) or without.
fn is_json(value: Option<&HeaderValue>) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}
