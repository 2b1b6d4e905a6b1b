//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: Envoy's external
//! processing, one bidirectional stream per HTTP request that sees the
//! request and the response. The stream holds the attempt through the
//! whole cycle:
//!
//! ```text
//!  request headers (+ body) ─▶ Authorize ─▶ DISPATCH: CONTINUE (forwarded)
//!                                        └▶ otherwise: ImmediateResponse
//!  response headers (+ body) ─▶ Commit Succeeded (2xx) / Failed / MarkUncertain
//!  the stream ends before CONTINUE reached Envoy ─▶ Commit NotSent
//!  the stream ends after it, before a response   ─▶ MarkUncertain
//! ```
//!
//! Each stream is driven by one task ([`Exchange`]), so an outcome is
//! recorded even when Envoy goes away mid-request. Every store call goes
//! through the Gate's own methods with the stream's caller; Authorize also
//! with its deadline, while the outcomes are recorded whatever the
//! deadline (a dispatched call's outcome must not be dropped for being
//! late).
//!
//! Envoy requirements (docs/gateways.md): request and response headers
//! SEND (the defaults); a body fingerprint needs `request_body_mode:
//! BUFFERED`, which Envoy announces on the first message (1.34 and later),
//! and holds the request until the body's answer; a result from the
//! response body needs `response_body_mode: BUFFERED` or `STREAMED`.
//! Observability mode cannot gate anything and is refused.

use super::{
    ATTEMPT_HEADER, Answer, Headers, HttpRequest, Mapping, Reply, Unmapped,
    mapping::{ResultMode, Settle},
};
use crate::api::{Deadline, gate::GateService};
use crate::domain::MAX_RESULT_BYTES;
use crate::pb;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration, TrailersResponse,
    common_response::ResponseStatus, external_processor_server::ExternalProcessor,
    processing_request::Request as Message, processing_response::Response as Outgoing,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use sha2::{Digest, Sha256};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming, metadata::MetadataMap};

/// The dynamic metadata namespace of a forwarded request's attempt
/// (`metadata_options.receiving_namespaces` must allow it).
pub const METADATA_NAMESPACE: &str = "atmost";

pub struct ExtProcService {
    gate: Arc<GateService>,
    mapping: Arc<Mapping>,
}

impl ExtProcService {
    pub fn new(gate: GateService, mapping: Arc<Mapping>) -> Self {
        Self {
            gate: Arc::new(gate),
            mapping,
        }
    }
}

type Outbound = mpsc::Sender<Result<ProcessingResponse, Status>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProcService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (metadata, extensions, inbound) = request.into_parts();
        // The route names its tool in the stream's initial metadata
        // (ExtProcPerRoute grpc_initial_metadata).
        let route_tool = self
            .mapping
            .tool
            .grpc_metadata
            .as_ref()
            .and_then(|key| metadata.get(key.as_str()))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // One answer per message, and Envoy reads them as they come.
        let (tx, rx) = mpsc::channel(4);
        let exchange = Exchange {
            gate: self.gate.clone(),
            mapping: self.mapping.clone(),
            extensions,
            route_tool,
            tx,
            phase: Phase::Start,
            protocol: None,
            pending: None,
        };
        // The stream ends cleanly when the exchange is over, and with an
        // error if it panicked: a clean end would let Envoy go on without
        // atmost's answer.
        let on_panic = exchange.tx.clone();
        let task = tokio::spawn(exchange.run(inbound));
        tokio::spawn(async move {
            if let Err(e) = task.await
                && e.is_panic()
            {
                tracing::error!("ext_proc: a stream's task panicked; the stream fails");
                let _ = on_panic
                    .send(Err(Status::internal("atmost failed while processing")))
                    .await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

// === one stream ===

/// Where one HTTP request is in its cycle.
enum Phase {
    /// Nothing seen yet.
    Start,
    /// The request's headers seen; its body is awaited for the fingerprint.
    Body { request: Described, body: Vec<u8> },
    /// DISPATCH, and CONTINUE handed to Envoy: the request may have been
    /// forwarded, so only its response (or MarkUncertain) settles it.
    Forwarded(pb::Attempt),
    /// A 2xx response's headers seen; its body is awaited as the result.
    Responding {
        attempt: pb::Attempt,
        status: u16,
        body: ResultBody,
    },
    /// Nothing more to record: settled, answered instead of forwarded, or
    /// never reserved.
    Done,
}

impl Phase {
    fn describe(&self) -> &'static str {
        match self {
            Phase::Start => "before the request headers",
            Phase::Body { .. } => "while the request body was awaited",
            Phase::Forwarded(_) => "while the response was awaited",
            Phase::Responding { .. } => "while the response body was awaited",
            Phase::Done => "after the request was settled",
        }
    }
}

/// A request's headers, kept until its body arrives.
struct Described {
    method: String,
    path: String,
    headers: Headers,
    metadata: Option<Metadata>,
}

/// The response body, as much as a result needs: the first
/// [`MAX_RESULT_BYTES`] + 1 bytes and the SHA-256 of all of it.
#[derive(Default)]
struct ResultBody {
    kept: Vec<u8>,
    hash: Sha256,
    len: usize,
}

impl ResultBody {
    fn push(&mut self, chunk: &[u8]) {
        self.hash.update(chunk);
        self.len += chunk.len();
        let room = (MAX_RESULT_BYTES + 1).saturating_sub(self.kept.len());
        self.kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }

    fn digest(self) -> Vec<u8> {
        let hex: String = self
            .hash
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("sha256:{hex}").into_bytes()
    }

    /// The result to store: the body itself when it fits, else its digest.
    fn result(self, mode: ResultMode, status: u16) -> Vec<u8> {
        match mode {
            ResultMode::Status => format!("HTTP {status}").into_bytes(),
            ResultMode::Digest => self.digest(),
            ResultMode::Body if self.len <= MAX_RESULT_BYTES => self.kept,
            ResultMode::Body => self.digest(),
        }
    }
}

/// What the loop does after a message.
enum Flow {
    Next,
    /// The stream is over (seen ending while the store was asked, or our
    /// answer could not be handed over).
    Ended,
    /// A protocol error: end the stream with this status (Envoy then
    /// fails the request, with `failure_mode_allow: false`).
    Fail(Status),
}

struct Exchange {
    gate: Arc<GateService>,
    mapping: Arc<Mapping>,
    /// The stream's caller and deadline.
    extensions: http::Extensions,
    route_tool: Option<String>,
    tx: Outbound,
    phase: Phase,
    /// The body modes Envoy announced on its first message.
    protocol: Option<ProtocolConfiguration>,
    /// A message that arrived while the store was being asked.
    pending: Option<ProcessingRequest>,
}

/// A header Envoy sets, replacing any the client or the tool sent. Envoy
/// sends header values as `raw_value`, and reads them so.
fn set(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn headers_of(map: Option<HeaderMap>) -> Headers {
    Headers::new(
        map.map(|m| m.headers)
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
}

/// CONTINUE, setting these headers.
fn proceed(set_headers: Vec<HeaderValueOption>) -> CommonResponse {
    CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: (!set_headers.is_empty()).then_some(HeaderMutation {
            set_headers,
            remove_headers: Vec::new(),
        }),
        ..Default::default()
    }
}

/// The answer to a message of `kind`, CONTINUE without changes.
fn pass(kind: &Message) -> ProcessingResponse {
    let response = match kind {
        Message::RequestHeaders(_) => Outgoing::RequestHeaders(HeadersResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::ResponseHeaders(_) => Outgoing::ResponseHeaders(HeadersResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::RequestBody(_) => Outgoing::RequestBody(BodyResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::ResponseBody(_) => Outgoing::ResponseBody(BodyResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::RequestTrailers(_) => Outgoing::RequestTrailers(TrailersResponse::default()),
        Message::ResponseTrailers(_) => Outgoing::ResponseTrailers(TrailersResponse::default()),
    };
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

fn kind_name(message: &Message) -> &'static str {
    match message {
        Message::RequestHeaders(_) => "request_headers",
        Message::ResponseHeaders(_) => "response_headers",
        Message::RequestBody(_) => "request_body",
        Message::ResponseBody(_) => "response_body",
        Message::RequestTrailers(_) => "request_trailers",
        Message::ResponseTrailers(_) => "response_trailers",
    }
}

/// The answer Envoy sends the client instead of forwarding.
fn immediate(reply: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Outgoing::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(reply.status),
            }),
            headers: Some(HeaderMutation {
                set_headers: reply.headers.iter().map(|(k, v)| set(k, v)).collect(),
                remove_headers: Vec::new(),
            }),
            body: reply.body,
            grpc_status: None,
            // %RESPONSE_CODE_DETAILS% in Envoy's access log.
            details: format!("atmost_{}", reply.reason),
        })),
        ..Default::default()
    }
}

/// The attempt as dynamic metadata, in atmost's namespace.
fn namespaced(attempt: &pb::Attempt) -> Struct {
    Struct {
        fields: [(
            METADATA_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(super::attempt_metadata(attempt))),
            },
        )]
        .into_iter()
        .collect(),
    }
}

fn body_mode(mode: Option<BodySendMode>) -> &'static str {
    mode.map_or("not announced (Envoy before 1.34)", |m| m.as_str_name())
}

impl Exchange {
    /// Reads Envoy's messages until the stream ends, then records what the
    /// end means for the attempt.
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let message = match self.pending.take() {
                Some(message) => message,
                None => match inbound.message().await {
                    Ok(Some(message)) => message,
                    Ok(None) => break,
                    Err(status) => {
                        // A message atmost could not read (one past
                        // --max-request-bytes, say), or a reset. Never a
                        // clean end in answer: Envoy would go on without
                        // atmost, forwarding a request it never authorized.
                        tracing::debug!(%status, "ext_proc: the stream ended with an error");
                        let _ = self.tx.send(Err(status)).await;
                        break;
                    }
                },
            };
            match self.step(message, &mut inbound).await {
                Flow::Next => {}
                Flow::Ended => break,
                Flow::Fail(status) => {
                    tracing::warn!(%status, "ext_proc: the stream broke the protocol; ended");
                    let _ = self.tx.send(Err(status)).await;
                    break;
                }
            }
        }
        self.finish().await;
    }

    /// Hands one answer to Envoy; false when the stream is gone.
    async fn send(&self, response: ProcessingResponse) -> bool {
        self.tx.send(Ok(response)).await.is_ok()
    }

    async fn step(
        &mut self,
        message: ProcessingRequest,
        inbound: &mut Streaming<ProcessingRequest>,
    ) -> Flow {
        if message.observability_mode {
            return Flow::Fail(Status::failed_precondition(
                "ext_proc observability_mode: Envoy forwards without waiting for atmost's \
                 answer, so nothing can be gated; turn observability_mode off",
            ));
        }
        if self.protocol.is_none() {
            self.protocol = message.protocol_config;
        }
        let Some(kind) = message.request else {
            return Flow::Fail(Status::invalid_argument(
                "a ProcessingRequest with no request_headers, body or trailers",
            ));
        };
        match (std::mem::replace(&mut self.phase, Phase::Done), kind) {
            (Phase::Start, Message::RequestHeaders(h)) => {
                self.request_headers(h, message.metadata_context, inbound)
                    .await
            }
            (Phase::Body { request, mut body }, Message::RequestBody(b)) => {
                body.extend_from_slice(&b.body);
                // BUFFERED sends the whole body in one message (its
                // end_of_stream is false only when trailers follow).
                self.authorize(request, &body, Stage::Body, inbound).await
            }
            (Phase::Body { request, body }, Message::RequestTrailers(_)) => {
                self.authorize(request, &body, Stage::Trailers, inbound)
                    .await
            }
            (Phase::Forwarded(attempt), Message::ResponseHeaders(h)) => {
                self.response_headers(attempt, h).await
            }
            (
                Phase::Responding {
                    attempt,
                    status,
                    mut body,
                },
                kind @ (Message::ResponseBody(_) | Message::ResponseTrailers(_)),
            ) => {
                let complete = match &kind {
                    Message::ResponseBody(b) => {
                        body.push(&b.body);
                        b.end_of_stream || self.response_body_mode() == Some(BodySendMode::Buffered)
                    }
                    _ => true,
                };
                let sent = self.send(pass(&kind)).await;
                if complete {
                    let result = body.result(self.mapping.response.result, status);
                    self.commit(&attempt, succeeded(result)).await;
                } else {
                    self.phase = Phase::Responding {
                        attempt,
                        status,
                        body,
                    };
                }
                if sent { Flow::Next } else { Flow::Ended }
            }
            // The request's body or trailers after the answer to its
            // headers (a body Envoy sends though the fingerprint does not
            // need it), and anything after the attempt was settled.
            (
                phase @ Phase::Forwarded(_),
                kind @ (Message::RequestBody(_) | Message::RequestTrailers(_)),
            )
            | (phase @ Phase::Done, kind) => {
                self.phase = phase;
                if self.send(pass(&kind)).await {
                    Flow::Next
                } else {
                    Flow::Ended
                }
            }
            (phase, kind) => {
                let error = Status::invalid_argument(format!(
                    "ext_proc: {} {}: atmost needs the request headers first and the response \
                     headers before the response body (request_header_mode and \
                     response_header_mode SEND)",
                    kind_name(&kind),
                    phase.describe()
                ));
                if matches!(phase, Phase::Start) {
                    tracing::error!(
                        "ext_proc: a request reached atmost without its headers: it was not \
                         authorized, and may have been forwarded (request_header_mode must be SEND)"
                    );
                }
                self.phase = phase;
                Flow::Fail(error)
            }
        }
    }

    fn request_body_mode(&self) -> Option<BodySendMode> {
        self.protocol.as_ref().map(|p| p.request_body_mode())
    }

    fn response_body_mode(&self) -> Option<BodySendMode> {
        self.protocol.as_ref().map(|p| p.response_body_mode())
    }

    async fn request_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<Metadata>,
        inbound: &mut Streaming<ProcessingRequest>,
    ) -> Flow {
        let headers = headers_of(h.headers);
        let pseudo = |name: &str| {
            headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        let (Some(method), Some(path)) = (pseudo(":method"), pseudo(":path")) else {
            return Flow::Fail(Status::invalid_argument(
                "request_headers without :method and :path",
            ));
        };
        let request = Described {
            method,
            path,
            headers,
            metadata,
        };
        if self.mapping.needs_body() && !h.end_of_stream {
            // The body must reach atmost before Envoy forwards anything:
            // BUFFERED holds the request until the body's answer. Any other
            // mode would forward the headers as soon as they are answered.
            if self.request_body_mode() != Some(BodySendMode::Buffered) {
                let why = format!(
                    "the fingerprint needs the request body, and Envoy's request_body_mode is {}: \
                     set processing_mode.request_body_mode: BUFFERED (Envoy 1.34 or later), or \
                     take the fingerprint from a header",
                    body_mode(self.request_body_mode())
                );
                return self
                    .refuse(Reply::unmapped(Unmapped::Misconfigured(why)))
                    .await;
            }
            self.phase = Phase::Body {
                request,
                body: Vec::new(),
            };
            return if self
                .send(pass(&Message::RequestHeaders(HttpHeaders::default())))
                .await
            {
                Flow::Next
            } else {
                Flow::Ended
            };
        }
        self.authorize(request, &[], Stage::Headers, inbound).await
    }

    /// Answers instead of forwarding; nothing was reserved, or it is a
    /// replay.
    async fn refuse(&mut self, reply: Reply) -> Flow {
        self.phase = Phase::Done;
        if self.send(immediate(reply)).await {
            Flow::Next
        } else {
            Flow::Ended
        }
    }

    /// Authorizes the request through the Gate and answers the message
    /// that completed it.
    async fn authorize(
        &mut self,
        request: Described,
        body: &[u8],
        stage: Stage,
        inbound: &mut Streaming<ProcessingRequest>,
    ) -> Flow {
        let view = HttpRequest {
            method: &request.method,
            path: &request.path,
            headers: &request.headers,
            body,
            route_tool: self.route_tool.as_deref(),
            metadata: request.metadata.as_ref(),
        };
        let authorize = match self.mapping.authorize_request(&view) {
            Ok(authorize) => authorize,
            Err(unmapped) => return self.refuse(Reply::unmapped(unmapped)).await,
        };
        let call = Box::pin(self.gate.do_authorize(Request::from_parts(
            MetadataMap::new(),
            self.extensions.clone(),
            authorize,
        )));
        let (result, ended) = watching(call, inbound, &mut self.pending).await;
        match Answer::of(result) {
            Answer::Forward(attempt) => {
                let attempt = *attempt;
                if ended {
                    // Envoy gave up on the request (its message timeout, the
                    // client reset) before DISPATCH could reach it: it was
                    // never forwarded.
                    self.commit(&attempt, not_sent()).await;
                    self.phase = Phase::Done;
                    return Flow::Ended;
                }
                let headers = vec![set(ATTEMPT_HEADER, &attempt.attempt_id)];
                let response = ProcessingResponse {
                    response: Some(stage.proceed(headers)),
                    dynamic_metadata: Some(namespaced(&attempt)),
                    ..Default::default()
                };
                if self.send(response).await {
                    self.phase = Phase::Forwarded(attempt);
                    Flow::Next
                } else {
                    // The stream was gone: CONTINUE never reached Envoy.
                    self.commit(&attempt, not_sent()).await;
                    self.phase = Phase::Done;
                    Flow::Ended
                }
            }
            Answer::Respond(reply) => {
                if ended {
                    self.phase = Phase::Done;
                    return Flow::Ended;
                }
                self.refuse(reply).await
            }
        }
    }

    async fn response_headers(&mut self, attempt: pb::Attempt, h: HttpHeaders) -> Flow {
        let headers = headers_of(h.headers);
        let Some(status) = headers
            .get(":status")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse::<u16>().ok())
        else {
            // Without a status nothing is known: the stream's end marks the
            // attempt UNCERTAIN.
            self.phase = Phase::Forwarded(attempt);
            return Flow::Fail(Status::invalid_argument(
                "response_headers without a :status",
            ));
        };
        let answer = ProcessingResponse {
            response: Some(Outgoing::ResponseHeaders(HeadersResponse {
                response: Some(proceed(vec![set(ATTEMPT_HEADER, &attempt.attempt_id)])),
            })),
            ..Default::default()
        };
        let policy = &self.mapping.response;
        match policy.settle(status) {
            Settle::Succeeded => {
                let body_follows = !h.end_of_stream
                    && policy.result != ResultMode::Status
                    && matches!(
                        self.response_body_mode(),
                        Some(BodySendMode::Buffered | BodySendMode::Streamed)
                    );
                if body_follows {
                    self.phase = Phase::Responding {
                        attempt,
                        status,
                        body: ResultBody::default(),
                    };
                    return if self.send(answer).await {
                        Flow::Next
                    } else {
                        Flow::Ended
                    };
                }
                if !h.end_of_stream && policy.result != ResultMode::Status {
                    tracing::warn!(
                        response_body_mode = body_mode(self.response_body_mode()),
                        "ext_proc: the result is the response body, which Envoy does not send \
                         atmost (response_body_mode BUFFERED or STREAMED): recorded as an empty body"
                    );
                }
                let sent = self.send(answer).await;
                let result = ResultBody::default().result(policy.result, status);
                self.commit(&attempt, succeeded(result)).await;
                if sent { Flow::Next } else { Flow::Ended }
            }
            Settle::Failed => {
                let sent = self.send(answer).await;
                self.commit(
                    &attempt,
                    pb::commit_request::Outcome::Failed(pb::Failed {
                        reason: format!("the tool answered HTTP {status}"),
                    }),
                )
                .await;
                if sent { Flow::Next } else { Flow::Ended }
            }
            Settle::Uncertain => {
                let sent = self.send(answer).await;
                self.mark_uncertain(&attempt, format!("the tool answered HTTP {status}"))
                    .await;
                if sent { Flow::Next } else { Flow::Ended }
            }
        }
    }

    /// What the end of the stream means for the attempt.
    async fn finish(&mut self) {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Forwarded(attempt) => {
                self.mark_uncertain(
                    &attempt,
                    "the gateway's stream ended after the request was forwarded, before its response"
                        .into(),
                )
                .await;
            }
            Phase::Responding {
                attempt, status, ..
            } => {
                self.mark_uncertain(
                    &attempt,
                    format!(
                        "the gateway's stream ended after the tool's HTTP {status}, before its body"
                    ),
                )
                .await;
            }
            Phase::Start | Phase::Body { .. } | Phase::Done => {}
        }
    }

    /// The stream's caller, without its deadline: an outcome is recorded
    /// however late (refusing it would leave the attempt to its lease).
    fn caller<T>(&self, message: T) -> Request<T> {
        let mut extensions = self.extensions.clone();
        extensions.remove::<Deadline>();
        Request::from_parts(MetadataMap::new(), extensions, message)
    }

    // The Gate's futures are boxed here: nested in this stream's own, they
    // made one state machine too deep for the compiler to lay out.
    async fn commit(&self, attempt: &pb::Attempt, outcome: pb::commit_request::Outcome) {
        let request = self.caller(pb::CommitRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            outcome: Some(outcome),
        });
        if let Err(e) = Box::pin(self.gate.do_commit(request)).await {
            tracing::warn!(
                permit_id = %attempt.permit_id,
                attempt_id = %attempt.attempt_id,
                error = %e,
                "ext_proc: the outcome could not be recorded; the attempt turns UNCERTAIN at its lease"
            );
        }
    }

    async fn mark_uncertain(&self, attempt: &pb::Attempt, reason: String) {
        let request = self.caller(pb::MarkUncertainRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            reason,
        });
        if let Err(e) = Box::pin(self.gate.do_mark_uncertain(request)).await {
            tracing::warn!(
                permit_id = %attempt.permit_id,
                attempt_id = %attempt.attempt_id,
                error = %e,
                "ext_proc: MarkUncertain failed; the attempt turns UNCERTAIN at its lease"
            );
        }
    }
}

/// Which part of the request an Authorize answers.
#[derive(Clone, Copy)]
enum Stage {
    Headers,
    Body,
    Trailers,
}

impl Stage {
    /// CONTINUE for this message, setting `headers` on the request.
    fn proceed(self, headers: Vec<HeaderValueOption>) -> Outgoing {
        match self {
            Stage::Headers => Outgoing::RequestHeaders(HeadersResponse {
                response: Some(proceed(headers)),
            }),
            Stage::Body => Outgoing::RequestBody(BodyResponse {
                response: Some(proceed(headers)),
            }),
            // A trailers answer cannot set headers; the metadata still
            // carries the attempt.
            Stage::Trailers => Outgoing::RequestTrailers(TrailersResponse::default()),
        }
    }
}

fn succeeded(result: Vec<u8>) -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::Succeeded(pb::Succeeded {
        result,
        actual_cost: None,
    })
}

fn not_sent() -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::NotSent(pb::NotSent {})
}

/// Runs `call` (a store call, never cancelled halfway) while watching the
/// stream: a message that arrives meanwhile is kept in `pending`; the
/// stream's end is reported as `true`.
async fn watching<T>(
    call: impl Future<Output = T>,
    inbound: &mut Streaming<ProcessingRequest>,
    pending: &mut Option<ProcessingRequest>,
) -> (T, bool) {
    tokio::pin!(call);
    let mut ended = false;
    loop {
        tokio::select! {
            // The stream first: an end that has already arrived is seen
            // before a DISPATCH is handed over.
            biased;
            next = inbound.message(), if !ended && pending.is_none() => match next {
                Ok(Some(message)) => *pending = Some(message),
                Ok(None) | Err(_) => ended = true,
            },
            out = &mut call => return (out, ended),
        }
    }
}

/// One of each answer this module gives, for the descriptor test.
#[cfg(test)]
pub(super) fn every_response(attempt: &pb::Attempt) -> Vec<ProcessingResponse> {
    let forward = ProcessingResponse {
        response: Some(Stage::Body.proceed(vec![set(ATTEMPT_HEADER, &attempt.attempt_id)])),
        dynamic_metadata: Some(namespaced(attempt)),
        ..Default::default()
    };
    let refused = immediate(Reply::refusal(&crate::domain::Error::KeyReused {
        idempotency_key: "k".into(),
    }));
    let mut all = vec![forward, refused];
    all.extend(
        [
            Message::RequestHeaders(HttpHeaders::default()),
            Message::ResponseHeaders(HttpHeaders::default()),
            Message::RequestBody(Default::default()),
            Message::ResponseBody(Default::default()),
            Message::RequestTrailers(Default::default()),
            Message::ResponseTrailers(Default::default()),
        ]
        .iter()
        .map(pass),
    );
    all
}
