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
pub mod openapi;
pub mod routes;

use crate::api::layers::{BoxFuture, RequestTimedOut};
use crate::transport::Serves;
use bytes::Buf as _;
use http::{HeaderValue, Method, StatusCode, header};
use http_body::Body as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, Value};
use routes::{Matched, Miss, Routes};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use tokio::net::TcpListener;
use tonic::{Code, Status};
use tower_http::cors::{AllowOrigin, CorsLayer};

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
    /// The OpenAPI document ([`openapi`]), made once; `None` with
    /// `--reflection=false`, which hides the API's shape.
    openapi: Option<bytes::Bytes>,
    /// Why a listener that serves gRPC only refuses a JSON request.
    json_elsewhere: &'static str,
    /// Dev mode (no keys, loopback only): only a request naming a loopback
    /// host is answered, so that a web page whose DNS name was rebound to
    /// this machine cannot call it from the developer's browser.
    loopback_hosts_only: bool,
}

impl Edge {
    /// The edge of `atmost.v1` under these limits: a JSON body of up to
    /// [`JSON_BODY_FACTOR`] request messages, answers up to the response
    /// limit, headers up to the header list limit.
    pub fn new(limits: &crate::transport::Limits) -> Self {
        let pool = pool();
        let routes = Routes::of_package(&pool, "atmost.v1")
            .expect("the contract's routes (a unit test holds them)");
        Self {
            openapi: Some(openapi::document(&routes).into()),
            routes,
            rpc_status: pool
                .get_message_by_name("google.rpc.Status")
                .expect("build.rs compiles google/rpc/status.proto"),
            max_body_bytes: limits.max_request_bytes.saturating_mul(JSON_BODY_FACTOR),
            max_response_bytes: limits.max_response_bytes,
            max_header_bytes: limits.max_header_list_bytes as usize,
            json_elsewhere: "HTTP/JSON is not served (--http=false)",
            loopback_hosts_only: false,
        }
    }

    pub fn routes(&self) -> &Routes {
        &self.routes
    }
}

/// Where the HTTP/JSON edge is served.
#[derive(Debug, Default)]
pub enum Place {
    /// On the gRPC listener, each request told apart by its content type.
    #[default]
    Shared,
    /// On a listener of its own (`--http-listen`); the gRPC listener then
    /// serves gRPC only, and this one HTTP/JSON only.
    Own(TcpListener),
    /// Not at all (`--http=false`).
    Off,
}

/// How the HTTP/JSON edge is served: where, and to which browser pages.
#[derive(Debug, Default)]
pub struct Serving {
    pub place: Place,
    pub cors: Cors,
    /// Served without keys on purpose (`--insecure-no-auth`): any Host is
    /// answered. Otherwise, without keys, only a loopback Host is.
    pub open: bool,
}

impl Serving {
    /// The listeners to accept on (the gRPC one first) with what each
    /// serves, the edge's layer, and the CORS layer if any origin is
    /// allowed. The OpenAPI document is served if `described` (as server
    /// reflection is).
    pub fn into_layers(
        self,
        grpc: TcpListener,
        limits: &crate::transport::Limits,
        authenticated: bool,
        described: bool,
    ) -> (Vec<(TcpListener, Serves)>, HttpLayer, Option<CorsLayer>) {
        let mut edge = Edge::new(limits);
        edge.loopback_hosts_only = !authenticated && !self.open;
        if !described {
            edge.openapi = None;
        }
        let listeners = match self.place {
            Place::Shared => vec![(grpc, Serves::Both)],
            Place::Own(http) => {
                edge.json_elsewhere =
                    "HTTP/JSON is served on its own listener (--http-listen), not on this one";
                vec![(grpc, Serves::Grpc), (http, Serves::Json)]
            }
            Place::Off => vec![(grpc, Serves::Grpc)],
        };
        let cors = self.cors.layer(&edge.routes);
        (listeners, HttpLayer::new(Arc::new(edge)), cors)
    }
}

/// The browser origins that may call the HTTP/JSON edge (CORS,
/// `--http-cors-origins`). Off by default: no CORS header is sent, so a
/// page of another origin can read no answer, and cannot send a JSON
/// write at all (its preflight is refused).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Cors {
    #[default]
    Off,
    /// `*`: any page. Credentials (cookies) are never allowed; a page still
    /// needs an API key.
    AnyOrigin,
    /// These origins, each `scheme://host[:port]` as a browser sends it.
    Origins(Vec<String>),
}

/// How long a browser may cache a preflight's answer.
const CORS_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(600);

impl Cors {
    /// The allowed origins as given: none (off), `*`, or origins, each
    /// `http://` or `https://`, a host, an optional port, and nothing else.
    /// Each is kept as a browser serializes it (lower case, without its
    /// scheme's default port).
    pub fn parse(origins: &[String]) -> Result<Cors, String> {
        let origins: Vec<&str> = origins
            .iter()
            .map(|o| o.trim())
            .filter(|o| !o.is_empty())
            .collect();
        if origins.is_empty() {
            return Ok(Cors::Off);
        }
        if origins.contains(&"*") {
            return match origins.len() {
                1 => Ok(Cors::AnyOrigin),
                _ => Err("`*` allows every origin: give it alone".into()),
            };
        }
        let mut parsed = Vec::with_capacity(origins.len());
        for origin in origins {
            let why = |what: &str| {
                format!(
                    "{origin:?} is not an origin ({what}): give scheme://host[:port], e.g. https://console.example.com"
                )
            };
            let uri: http::Uri = origin.parse().map_err(|_| why("not a URL"))?;
            let default_port = match uri.scheme_str() {
                Some("https") => 443,
                Some("http") => 80,
                _ => return Err(why("the scheme is http or https")),
            };
            let authority = uri.authority().ok_or_else(|| why("no host"))?;
            if authority.as_str().contains('@') {
                return Err(why("no user name"));
            }
            if uri.path_and_query().is_some_and(|p| p.as_str() != "/") || origin.ends_with('/') {
                return Err(why("no path, not even /"));
            }
            let host = authority.host().to_ascii_lowercase();
            let serialized = match authority.port_u16() {
                Some(port) if port != default_port => {
                    format!("{}://{host}:{port}", uri.scheme_str().unwrap_or_default())
                }
                _ => format!("{}://{host}", uri.scheme_str().unwrap_or_default()),
            };
            if !parsed.contains(&serialized) {
                parsed.push(serialized);
            }
        }
        Ok(Cors::Origins(parsed))
    }

    /// The layer that answers preflights and marks answers for the allowed
    /// origins: the routes' methods, the request headers a caller sends
    /// (authorization, content-type, Idempotency-Key, traceparent), and
    /// the answer headers it may read (Retry-After, Idempotent-Replayed).
    fn layer(&self, routes: &Routes) -> Option<CorsLayer> {
        let origins = match self {
            Cors::Off => return None,
            Cors::AnyOrigin => AllowOrigin::any(),
            Cors::Origins(origins) => AllowOrigin::list(
                origins
                    .iter()
                    .map(|o| HeaderValue::from_str(o).expect("parse() kept only origins")),
            ),
        };
        let mut methods: Vec<Method> = Vec::new();
        for route in routes.iter() {
            if !methods.contains(&route.http_method) {
                methods.push(route.http_method.clone());
            }
        }
        Some(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods(methods)
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::HeaderName::from_static("idempotency-key"),
                    header::HeaderName::from_static("traceparent"),
                    header::HeaderName::from_static("tracestate"),
                ])
                .expose_headers([
                    header::RETRY_AFTER,
                    header::HeaderName::from_static(REPLAYED),
                ])
                .max_age(CORS_MAX_AGE),
        )
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

/// Whether a request is gRPC: `application/grpc`, alone or followed by
/// `+` (`application/grpc+proto`) or `;` (parameters).
fn is_grpc<B>(request: &http::Request<B>) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.as_bytes().strip_prefix(b"application/grpc"))
        .is_some_and(|rest| matches!(rest.first(), None | Some(b'+' | b';')))
}

/// The first `grpc-*` header of a request that is not gRPC. Each means
/// something to tonic, which acts on some outside every layer
/// (`grpc-timeout` would cut the RPC short with a gRPC answer, an empty
/// 200 to an HTTP client): over HTTP/JSON they are refused, not passed on.
fn grpc_header<B>(request: &http::Request<B>) -> Option<&header::HeaderName> {
    request
        .headers()
        .keys()
        .find(|name| name.as_str().starts_with("grpc-"))
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
        let refusal = match (Serves::of(&request), is_grpc(&request)) {
            // gRPC is HTTP/2's (its status comes in trailers, and HTTP/1's
            // header limits are not the ones --max-header-list-bytes sets).
            (Serves::Both | Serves::Grpc, true) if request.version() != http::Version::HTTP_2 => {
                Some(self.edge.plain(
                    StatusCode::HTTP_VERSION_NOT_SUPPORTED,
                    Code::Unimplemented,
                    format!("gRPC is served over HTTP/2 only, not {:?}", request.version()),
                ))
            }
            (Serves::Both | Serves::Grpc, true) => {
                return futures_util::future::Either::Left(self.inner.call(request));
            }
            (Serves::Both | Serves::Json, false) => grpc_header(&request).map(|name| {
                self.edge.plain(
                    StatusCode::BAD_REQUEST,
                    Code::InvalidArgument,
                    format!(
                        "{name} is a gRPC header: an HTTP/JSON request sends none (the server's --request-timeout bounds it)"
                    ),
                )
            }),
            // A gRPC caller is told in gRPC, a JSON caller in JSON.
            (Serves::Json, true) => Some(
                Status::unimplemented(
                    "this listener (--http-listen) serves HTTP/JSON only; gRPC is served on --listen",
                )
                .into_http(),
            ),
            (Serves::Grpc, false) => Some(self.edge.plain(
                StatusCode::NOT_FOUND,
                Code::NotFound,
                self.edge.json_elsewhere.to_string(),
            )),
        };
        if let Some(refusal) = refusal {
            // tonic's own timeout runs around this service: with a
            // `grpc-timeout` the refusal must be ready when first polled,
            // before that timeout is (else a 1 ns one answers an empty 200
            // while the body is still read). Its body goes unread.
            if request.headers().contains_key("grpc-timeout") {
                return futures_util::future::Either::Right(Box::pin(std::future::ready(Ok(
                    refusal,
                ))));
            }
            let leftover = Leftover::of(request.version(), request.headers());
            let body = request.into_body();
            let edge = self.edge.clone();
            return futures_util::future::Either::Right(Box::pin(async move {
                Ok(edge.drained(body, leftover, refusal).await)
            }));
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

/// The edge's inner half, the innermost layer: marks a transcoded request
/// as having reached its service, past authentication and admission, with
/// its caller. Only then is its JSON made into the request message
/// ([`body::Passage`]): a request refused or shed before is never parsed.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReachedLayer;

impl<S> tower::Layer<S> for ReachedLayer {
    type Service = Reached<S>;

    fn layer(&self, inner: S) -> Reached<S> {
        Reached { inner }
    }
}

#[derive(Debug, Clone)]
pub struct Reached<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for Reached<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> S::Future {
        if let Some(passage) = request.extensions().get::<Arc<body::Passage>>() {
            passage.reached(
                request
                    .extensions()
                    .get::<Arc<crate::auth::Identity>>()
                    .cloned(),
            );
        }
        self.inner.call(request)
    }
}

impl Edge {
    /// The route of a request, or the edge's own answer before any RPC
    /// (a Host dev mode refuses, the OpenAPI document, no route, headers
    /// too large, a write that is not JSON).
    fn early(&self, parts: &http::request::Parts) -> Result<Matched<'_>, Box<Response>> {
        if self.loopback_hosts_only {
            // HTTP/2's :authority (or an absolute URI), else Host.
            let host: Option<String> = match parts.uri.authority() {
                Some(authority) => Some(authority.host().to_owned()),
                None => parts
                    .headers
                    .get(header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<http::uri::Authority>().ok())
                    .map(|a| a.host().to_owned()),
            };
            if !host.as_deref().is_some_and(is_loopback_host) {
                return Err(Box::new(self.plain(
                    StatusCode::FORBIDDEN,
                    Code::PermissionDenied,
                    format!(
                        "without --auth-keys (dev mode) HTTP/JSON is answered only for a loopback host (localhost, 127.0.0.1, [::1]), not {:?}: a page whose DNS name was rebound to this machine would send that",
                        host.as_deref().unwrap_or("none")
                    ),
                )));
            }
        }
        if parts.method == Method::GET && parts.uri.path() == openapi::PATH {
            return Err(Box::new(match &self.openapi {
                Some(document) => error::json_response(StatusCode::OK, document.clone()),
                None => self.plain(
                    StatusCode::NOT_FOUND,
                    Code::NotFound,
                    "the OpenAPI document is not served here (--reflection=false)".into(),
                ),
            }));
        }
        let matched = match self.routes.find(&parts.method, parts.uri.path()) {
            Ok(matched) => matched,
            Err(miss) => {
                return Err(Box::new(self.unrouted(
                    &parts.method,
                    parts.uri.path(),
                    miss,
                )));
            }
        };
        let header_bytes: usize = parts
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + 32)
            .sum();
        if header_bytes > self.max_header_bytes {
            return Err(Box::new(self.plain(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                Code::ResourceExhausted,
                format!(
                    "the request's headers are {header_bytes} bytes (HTTP/2's count), more than the {} this server reads",
                    self.max_header_bytes
                ),
            )));
        }
        // A write says it is JSON: a browser cannot send that to another
        // origin without asking first (CORS), so a page cannot post here.
        if parts.method != Method::GET && !is_json(parts.headers.get(header::CONTENT_TYPE)) {
            return Err(Box::new(self.plain(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Code::InvalidArgument,
                format!(
                    "{} {} takes a body of content-type application/json",
                    parts.method, matched.route.template
                ),
            )));
        }
        Ok(matched)
    }

    async fn serve<S>(&self, request: Request, mut inner: S) -> Result<Response, S::Error>
    where
        S: tower::Service<Request, Response = Response>,
    {
        let (parts, body) = request.into_parts();
        let leftover = Leftover::of(parts.version, &parts.headers);
        let matched = match self.early(&parts) {
            Ok(matched) => matched,
            Err(answer) => return Ok(self.drained(body, leftover, *answer).await),
        };
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
            content_length: leftover.content_length,
        };
        let passage = Arc::new(body::Passage::default());
        let rpc = route.rpc.name();
        let grpc_body = body::transcode(
            body,
            body::Transcode {
                input: route.rpc.input(),
                field: route.body.clone(),
                params,
                limit: self.max_body_bytes,
                read: read.clone(),
                passage: passage.clone(),
                audited: crate::api::audit::AUDITED
                    .iter()
                    .find(|name| **name == rpc)
                    .copied(),
            },
        );
        let mut grpc = http::Request::new(grpc_body);
        *grpc.method_mut() = Method::POST;
        *grpc.uri_mut() = http::Uri::from_maybe_shared(route.grpc_path.clone())
            .expect("a gRPC path is a valid URI");
        *grpc.version_mut() = http::Version::HTTP_2;
        *grpc.extensions_mut() = parts.extensions;
        grpc.extensions_mut().insert(passage.clone());
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
        // Refused before its service (auth, admission): its body, unread.
        if let Some(unread) = passage.take_unread() {
            self.drain(unread, leftover).await;
        }
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
        let timed_out = parts.extensions.get::<RequestTimedOut>().is_some();
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
        // The request timeout cut the RPC (api::layers::RequestTimeout,
        // CANCELLED): the client did not cancel, it would not be reading.
        // Still reading its body: 408; later: 504.
        if timed_out {
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
                    // As tonic answers a gRPC caller (it checks first).
                    if data.len() + chunk.len() > self.max_response_bytes + 5 {
                        return Err(Status::out_of_range(
                            "the answer is larger than the response limit (--max-response-bytes)",
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

impl Edge {
    /// `answer`, once what the request's body has left is read
    /// ([`Edge::drain`]).
    async fn drained(
        &self,
        body: tonic::body::Body,
        leftover: Leftover,
        answer: Response,
    ) -> Response {
        self.drain(body, leftover).await;
        answer
    }

    /// Reads what a refused request's body has left, as its HTTP version
    /// needs. HTTP/1.1: as far as a body refused for its size is read
    /// ([`body::drain`]), or the answer closes the connection under a
    /// client about to reuse it; none of it while the client waits for
    /// `100 Continue` (reading would invite the upload). HTTP/2: as a
    /// refused gRPC request's ([`crate::api::layers::drain`]), so that
    /// refusals do not add up to resets that cost the connection.
    async fn drain(&self, body: tonic::body::Body, leftover: Leftover) {
        match leftover.version {
            http::Version::HTTP_2 => crate::api::layers::drain(body).await,
            _ if leftover.expects_continue => {}
            _ => body::drain(body, self.max_body_bytes, leftover.content_length).await,
        }
    }
}

/// What [`Edge::drain`] needs of a request once its body is apart.
#[derive(Debug, Clone, Copy)]
struct Leftover {
    version: http::Version,
    /// `Expect: 100-continue`: the client sends its body only if asked.
    expects_continue: bool,
    content_length: Option<u64>,
}

impl Leftover {
    fn of(version: http::Version, headers: &http::HeaderMap) -> Self {
        Self {
            version,
            expects_continue: headers
                .get(header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue")),
            content_length: content_length(headers),
        }
    }
}

/// A request's `Content-Length`, if it sent one that reads.
fn content_length(headers: &http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok())
}

/// `localhost` (or a name under it, which browsers resolve to loopback
/// themselves), or a loopback address: IPv4 `127.0.0.0/8`, IPv6 `[::1]`.
fn is_loopback_host(host: &str) -> bool {
    let lower = host.to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    if let Some(v6) = name.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6
            .parse::<std::net::Ipv6Addr>()
            .is_ok_and(|ip| ip.is_loopback());
    }
    name.parse::<std::net::Ipv4Addr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// `application/json`, with parameters (`; charset=utf-8`) or without.
fn is_json(value: Option<&HeaderValue>) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

#[cfg(test)]
mod tests {
    use super::{is_grpc, is_loopback_host};

    #[test]
    fn loopback_hosts_are_loopback_names_and_addresses_only() {
        for host in [
            "localhost",
            "LOCALHOST",
            "localhost.",
            "app.localhost",
            "127.0.0.1",
            "127.9.9.9",
            "[::1]",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "evil.example",
            "localhost.evil.example",
            "localhostx",
            "10.0.0.1",
            "0.0.0.0",
            "[::ffff:127.0.0.1]",
            "[::]",
            "::1",
            "",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn grpc_is_its_content_type_exactly() {
        let with = |ct: &str| {
            let request = http::Request::builder()
                .header(http::header::CONTENT_TYPE, ct)
                .body(())
                .unwrap();
            is_grpc(&request)
        };
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=x",
        ] {
            assert!(with(ct), "{ct}");
        }
        for ct in [
            "application/grpc-web",
            "application/grpcx",
            "application/json",
            "text/plain",
        ] {
            assert!(!with(ct), "{ct}");
        }
        assert!(!is_grpc(&http::Request::new(())));
    }
}
