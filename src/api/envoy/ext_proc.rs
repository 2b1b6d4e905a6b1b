//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: Envoy's external
//! processing, one bidirectional stream per HTTP request that sees the
//! request and the response. The stream holds the attempt through the
//! whole cycle:
//!
//! ```text
//!  request headers (+ body, or trailers) ─▶ Authorize ─▶ DISPATCH: CONTINUE (forwarded)
//!                                                    └▶ otherwise: ImmediateResponse
//!  response headers (+ body) ─▶ Commit Succeeded (2xx) / Failed / MarkUncertain
//!    of a gRPC response: its grpc-status (headers, else trailers) ─▶ Succeeded
//!                        (0) / Failed (refused before acting: 3, 5-12, 16) /
//!                        as a 5xx (any other: the route's `otherwise`) /
//!                        MarkUncertain (none)
//!  the stream ends before CONTINUE reached Envoy ─▶ Commit NotSent, and
//!                                                   the stream fails
//!  the stream ends after it, before a response   ─▶ MarkUncertain
//!  a response while the request is awaited       ─▶ possibly an unauthorized
//!                                                   forward (or Envoy's own
//!                                                   local reply): logged
//!                                                   and counted
//! ```
//!
//! Each stream is driven by one task ([`Exchange`]), so an outcome is
//! recorded even when Envoy goes away mid-request. Every store call goes
//! through the Gate's own methods with the stream's caller; Authorize also
//! with its deadline, while the outcomes are recorded whatever the
//! deadline (a dispatched call's outcome must not be dropped for being
//! late), and asked again while the store cannot take them ([`Recorder`]).
//!
//! The stream never ends cleanly while a message of Envoy's is
//! unanswered: Envoy takes a clean end as "processing complete" and goes
//! on with the request. An attempt's id goes upstream (the request header,
//! the dynamic metadata), never to the client: the response passes with
//! the attempt's headers removed (the tool may echo them). A request held
//! for its body has them removed too, so that a client's own never reach
//! the tool unreplaced.
//!
//! Envoy requirements (docs/gateways.md): request and response headers
//! SEND (the defaults); a body fingerprint needs `request_body_mode:
//! BUFFERED`, which Envoy announces on the first message (1.34 and later),
//! and holds the request until the body's answer, and `request_trailer_mode:
//! SEND`: a request with no body data and trailers reaches atmost only
//! through its trailers (with SKIP, Envoy forwards it unseen; Envoy
//! announces its body modes, never its trailer modes, so atmost cannot
//! refuse that configuration: its hold answer asks for both trailer modes
//! SEND in a `mode_override`, which Envoy applies with
//! `allow_mode_override: true`; without it, atmost counts each such
//! forward when its response comes). A result from the response body needs
//! `response_body_mode: BUFFERED`, `STREAMED`, `FULL_DUPLEX_STREAMED` (each
//! chunk handed back, as the mode requires), or `BUFFERED_PARTIAL` (only
//! for a body that fits Envoy's buffer: of a part, only the status is
//! recorded); without one, the status is. A gRPC response's outcome needs
//! `response_trailer_mode: SEND` (its grpc-status is in its trailers,
//! unless trailers-only); without them it is UNCERTAIN.
//! Observability mode cannot gate anything and is refused.

use super::{
    ATTEMPT_HEADER, Answer, Headers, HttpRequest, KEY_HEADER, Mapping, PERMIT_ID_HEADER, Reply,
    Unmapped,
    mapping::{Otherwise, ResultMode, Settle},
};
use crate::api::{Deadline, gate::GateService};
use crate::domain::{DEFAULT_LEASE_MS, Error, MAX_RESULT_BYTES, MAX_TEXT_LEN};
use crate::pb;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::{
    ProcessingMode,
    processing_mode::{BodySendMode, HeaderSendMode},
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    StreamedBodyResponse, TrailersResponse, body_mutation, common_response::ResponseStatus,
    external_processor_server::ExternalProcessor, processing_request::Request as Message,
    processing_response::Response as Outgoing,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming, metadata::MetadataMap};

/// The dynamic metadata namespace of a forwarded request's attempt
/// (`metadata_options.receiving_namespaces` must allow it).
pub const METADATA_NAMESPACE: &str = "atmost";

pub struct ExtProcService {
    gate: Arc<GateService>,
    mapping: Arc<Mapping>,
    settling: Settling,
}

impl ExtProcService {
    /// `settling` tracks the streams' tasks, which outlive their streams
    /// (an outcome is recorded after Envoy has gone): the server waits
    /// for them at shutdown ([`Settling::drain`]).
    pub fn new(gate: GateService, mapping: Arc<Mapping>, settling: Settling) -> Self {
        Self {
            gate: Arc::new(gate),
            mapping,
            settling,
        }
    }
}

/// The streams' tasks and the outcomes they are recording, so that a
/// shutdown waits for them (up to `--shutdown-grace`) rather than letting
/// the runtime drop them silently, and names each one it abandons.
#[derive(Clone, Default)]
pub struct Settling {
    tracker: TaskTracker,
    /// The outcomes being asked of the store, by a number of their own.
    open: Arc<Mutex<HashMap<u64, Outstanding>>>,
    next: Arc<AtomicU64>,
}

/// One outcome being recorded.
struct Outstanding {
    rpc: &'static str,
    permit_id: String,
    attempt_id: String,
    outcome: &'static str,
}

/// An outcome's place in [`Settling`], given up when it is recorded (or
/// given up): dropped.
struct Entry {
    open: Arc<Mutex<HashMap<u64, Outstanding>>>,
    id: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl Settling {
    fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(task)
    }

    /// Registers an outcome being recorded until the returned entry drops.
    fn enter(&self, rpc: &'static str, attempt: &pb::Attempt, outcome: &'static str) -> Entry {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                id,
                Outstanding {
                    rpc,
                    permit_id: attempt.permit_id.clone(),
                    attempt_id: attempt.attempt_id.clone(),
                    outcome,
                },
            );
        Entry {
            open: self.open.clone(),
            id,
        }
    }

    /// At shutdown, once no new stream can start: waits up to `grace` for
    /// the streams' tasks, then logs, as an error, each outcome still not
    /// recorded (the runtime drops it on exit; its attempt turns UNCERTAIN
    /// at its lease). Returns how many were abandoned.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.tracker.close();
        if self.tracker.is_empty() {
            return 0;
        }
        tracing::info!(
            streams = self.tracker.len(),
            ?grace,
            "ext_proc: waiting for outcomes still being recorded"
        );
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
        {
            return 0;
        }
        let open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for o in open.values() {
            tracing::error!(
                rpc = o.rpc,
                permit_id = %o.permit_id,
                attempt_id = %o.attempt_id,
                outcome = o.outcome,
                ?grace,
                "ext_proc: shutting down with an outcome not recorded within --shutdown-grace: \
                 abandoned; the attempt turns UNCERTAIN at its lease"
            );
        }
        // Streams still waiting (for the tool's response, or on their
        // Authorize) have no outcome to name yet: counted, not lost from
        // sight. Their attempts turn UNCERTAIN at their leases.
        let tasks = self.tracker.len();
        if tasks > open.len() {
            tracing::error!(
                tasks,
                named = open.len(),
                ?grace,
                "ext_proc: shutting down with streams still open past --shutdown-grace \
                 (awaiting a response or an Authorize): abandoned; any attempt they hold turns \
                 UNCERTAIN at its lease"
            );
        }
        open.len()
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
            recorder: Recorder {
                gate: self.gate.clone(),
                extensions,
                settling: self.settling.clone(),
            },
            mapping: self.mapping.clone(),
            route_tool,
            tx,
            phase: Phase::Start,
            protocol: None,
            counters: crate::telemetry::EnvoyCounters::current(),
            pending: None,
            settling: None,
        };
        // The stream ends cleanly when the exchange is over, and with an
        // error if its task failed (a panic): a clean end would let Envoy
        // go on without atmost's answer.
        let on_failure = exchange.tx.clone();
        // Tracked: the task outlives the stream while it records an
        // outcome, and a shutdown waits for it.
        let task = self.settling.spawn(exchange.run(inbound));
        tokio::spawn(async move {
            // Panicked, or (should anything abort it) cancelled: either
            // way the stream must not end cleanly.
            if let Err(e) = task.await {
                tracing::error!(error = %e, "ext_proc: a stream's task failed; the stream fails");
                let _ = on_failure
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
    Forwarded(Held),
    /// A 2xx response's headers seen; its body is awaited as the result,
    /// or (gRPC) its trailers as the outcome.
    Responding(Responding),
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
            Phase::Responding(r) if r.grpc => "while the response trailers were awaited",
            Phase::Responding(_) => "while the response body was awaited",
            Phase::Done => "after the request was settled",
        }
    }
}

/// The attempt a DISPATCH reserved, and when its lease ends by this
/// process's clock: reckoned from the DISPATCH's arrival, so late by up to
/// the Authorize's own duration (the store started the lease while it
/// ran), never early.
struct Held {
    attempt: pb::Attempt,
    lease_end: Instant,
}

/// When the lease of a freshly reserved `attempt` ends, by this process's
/// clock: its length (the store's `lease_expires_at - created_at`) from
/// now. The store's clock may differ from this one (Redis's time), so only
/// the length is taken from it.
fn lease_end(attempt: &pb::Attempt) -> Instant {
    let ms = |t: &Option<prost_types::Timestamp>| {
        t.as_ref()
            .map(|t| t.seconds.saturating_mul(1000) + i64::from(t.nanos) / 1_000_000)
    };
    let lease = match (ms(&attempt.created_at), ms(&attempt.lease_expires_at)) {
        (Some(created), Some(expires)) => expires.saturating_sub(created),
        _ => DEFAULT_LEASE_MS,
    };
    Instant::now() + Duration::from_millis(u64::try_from(lease).unwrap_or(0))
}

/// A 2xx response whose outcome waits for more of it.
struct Responding {
    held: Held,
    status: u16,
    body: ResultBody,
    /// What the result is made of: the mapping's, or the status alone
    /// where atmost cannot see the whole body.
    result: ResultMode,
    /// A gRPC response: its outcome is its `grpc-status`, in its trailers.
    grpc: bool,
}

/// What a response's message settles the attempt as.
enum Verdict {
    Commit(Held, pb::commit_request::Outcome),
    Uncertain(Held, String),
    /// More of the response is awaited.
    Await(Responding),
}

/// Whether a response's `content-type` is gRPC's (`application/grpc`,
/// `application/grpc+proto`, `application/grpc-web`, ...): its outcome is
/// its `grpc-status`, whatever its HTTP status says.
fn is_grpc(content_type: Option<&[u8]>) -> bool {
    let Some(value) = content_type.and_then(|v| std::str::from_utf8(v).ok()) else {
        return false;
    };
    let media = value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media == "application/grpc"
        || media.starts_with("application/grpc+")
        || media.starts_with("application/grpc-web")
}

/// gRPC's status codes by number, as the gRPC specification names them.
const GRPC_CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// What a gRPC response's `grpc-status` (in a trailers-only response's
/// headers, or in its trailers) says.
enum GrpcOutcome {
    /// 0.
    Ok,
    /// A code that means the call was refused before it acted ([`refused`]):
    /// the reason to record, with `grpc-message`.
    Failed(String),
    /// Any other code: the call may have acted (CANCELLED, UNKNOWN,
    /// DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE, DATA_LOSS, or a code past
    /// 16). It goes the way of a 5xx: the route's `otherwise`, UNCERTAIN
    /// by default. Envoy's own local reply to a gRPC request is one of
    /// these: HTTP 200, trailers-only, its grpc-status mapped from the
    /// HTTP status (an upstream timeout's 504 reads 14, UNAVAILABLE).
    Otherwise(String),
    /// A value that is no status code: why.
    Unreadable(String),
}

/// Whether gRPC status `code` means the server refused the call before
/// acting on it: INVALID_ARGUMENT (3), NOT_FOUND (5), ALREADY_EXISTS (6),
/// PERMISSION_DENIED (7), FAILED_PRECONDITION (9), ABORTED (10),
/// OUT_OF_RANGE (11), UNIMPLEMENTED (12), UNAUTHENTICATED (16). Not
/// RESOURCE_EXHAUSTED (8): a gRPC server answers it for its own response
/// past its send limit too, after the handler acted.
fn refused(code: u32) -> bool {
    matches!(code, 3 | 5..=7 | 9..=12 | 16)
}

/// The `grpc-status` of `headers`, if they carry one.
fn grpc_outcome(headers: &Headers) -> Option<GrpcOutcome> {
    let raw = headers.get("grpc-status")?;
    let text = String::from_utf8_lossy(raw);
    let Ok(code) = text.trim().parse::<u32>() else {
        return Some(GrpcOutcome::Unreadable(format!(
            "the tool's gRPC response has an unreadable grpc-status {}",
            crate::domain::shown(&text)
        )));
    };
    if code == 0 {
        return Some(GrpcOutcome::Ok);
    }
    let name = GRPC_CODES
        .get(code as usize)
        .map_or(String::new(), |n| format!(" ({n})"));
    // grpc-message is percent-encoded UTF-8 (the gRPC HTTP/2 protocol).
    let message = headers
        .get("grpc-message")
        .map(|m| {
            percent_encoding::percent_decode(m)
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    let mut reason = format!("the tool answered gRPC status {code}{name}");
    if !message.is_empty() {
        reason.push_str(": ");
        reason.push_str(&message);
    }
    let reason = cut(reason, MAX_TEXT_LEN);
    Some(if refused(code) {
        GrpcOutcome::Failed(reason)
    } else {
        GrpcOutcome::Otherwise(reason)
    })
}

/// `text` cut to at most `max` bytes, at a character's boundary.
fn cut(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
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
    /// Whether a body message has arrived (an empty one included).
    seen: bool,
}

impl ResultBody {
    fn push(&mut self, chunk: &[u8]) {
        self.seen = true;
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

/// The status a stream ends with when it fails: never OK. A status whose
/// code is OK would end the stream as a clean close, which Envoy takes as
/// "processing complete" and goes on with the request (fail open); such a
/// status is made INTERNAL. None of the statuses atmost sends is known to
/// carry OK (a read error's status comes from tonic's decoder or h2), so
/// this is a guard, not a path any test drives.
fn failing(status: Status) -> Status {
    if status.code() == tonic::Code::Ok {
        tracing::error!(%status, "ext_proc: a failure with status OK; sent as INTERNAL");
        Status::internal(format!("atmost failed: {}", status.message()))
    } else {
        status
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
    /// The Gate, with the stream's caller and deadline.
    recorder: Recorder,
    mapping: Arc<Mapping>,
    route_tool: Option<String>,
    tx: Outbound,
    phase: Phase,
    /// The body modes Envoy announced on its first message.
    protocol: Option<ProtocolConfiguration>,
    /// The RPC's counters, for what the stream sees after it opened.
    counters: crate::telemetry::EnvoyCounters,
    /// A message that arrived while the store was being asked.
    pending: Option<ProcessingRequest>,
    /// The response's outcome, being recorded beside the stream (so that
    /// Envoy's next messages are answered meanwhile). atmost's side of the
    /// stream ends only once it is, but Envoy does not wait: it closes and
    /// resets its side as soon as its last message is answered, so the
    /// recording is in effect detached from the stream.
    settling: Option<JoinHandle<()>>,
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

/// The headers a DISPATCH sets on the request it forwards.
fn forward_headers(attempt: &pb::Attempt) -> Vec<HeaderValueOption> {
    super::upstream_headers(attempt)
        .into_iter()
        .map(|(k, v)| set(k, v))
        .collect()
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
    proceed_removing(set_headers, Vec::new())
}

/// CONTINUE, setting `set_headers` and removing `remove_headers`.
fn proceed_removing(
    set_headers: Vec<HeaderValueOption>,
    remove_headers: Vec<String>,
) -> CommonResponse {
    CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: (!set_headers.is_empty() || !remove_headers.is_empty()).then_some(
            HeaderMutation {
                set_headers,
                remove_headers,
            },
        ),
        ..Default::default()
    }
}

/// The headers that name an attempt (the ones a DISPATCH sets upstream).
/// Removed wherever atmost passes headers on without setting them: from
/// the response (the tool may echo them, and an open attempt's id, the
/// fencing token Commit checks, never reaches the client), and from a
/// request held for its body (a client's own would otherwise reach the
/// tool unreplaced when the DISPATCH answers trailers, which cannot set
/// headers).
fn attempt_headers() -> Vec<String> {
    [ATTEMPT_HEADER, PERMIT_ID_HEADER, KEY_HEADER]
        .map(str::to_owned)
        .to_vec()
}

/// CONTINUE of the request's headers, held for its body: nothing set yet,
/// the attempt's headers removed; and, for this request, both trailer
/// modes SEND, the body modes as Envoy announced them (`protocol`).
///
/// Envoy honours the override only with `allow_mode_override: true` (and
/// a matching entry in `allowed_override_modes`, if that is set), without
/// `send_body_without_waiting_for_header_response`, and with neither body
/// mode FULL_DUPLEX_STREAMED; otherwise it ignores it. Honoured, a request
/// of headers and trailers with no body data reaches atmost through its
/// trailers whatever `request_trailer_mode` says, instead of being
/// forwarded unseen; and a gRPC tool's grpc-status reaches it in the
/// response trailers. The response headers SEND, which atmost needs in
/// any case (and Envoy compares with an `allowed_override_modes` entry,
/// where DEFAULT would match none); the request header mode DEFAULT (Envoy
/// takes it as its configured one and leaves it out of that comparison);
/// the body modes as announced, unchanged.
fn hold_for_body(protocol: &ProtocolConfiguration) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Outgoing::RequestHeaders(HeadersResponse {
            response: Some(proceed_removing(Vec::new(), attempt_headers())),
        })),
        mode_override: Some(ProcessingMode {
            request_body_mode: protocol.request_body_mode,
            response_body_mode: protocol.response_body_mode,
            request_trailer_mode: HeaderSendMode::Send as i32,
            response_trailer_mode: HeaderSendMode::Send as i32,
            response_header_mode: HeaderSendMode::Send as i32,
            ..Default::default()
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
        // The response never carries an attempt's headers on to the
        // client, whatever the tool echoed.
        Message::ResponseHeaders(_) => Outgoing::ResponseHeaders(HeadersResponse {
            response: Some(proceed_removing(Vec::new(), attempt_headers())),
        }),
        Message::RequestBody(_) => Outgoing::RequestBody(BodyResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::ResponseBody(_) => Outgoing::ResponseBody(BodyResponse {
            response: Some(proceed(Vec::new())),
        }),
        Message::RequestTrailers(_) => Outgoing::RequestTrailers(TrailersResponse::default()),
        // Nor its trailers (a gRPC tool's come there).
        Message::ResponseTrailers(_) => Outgoing::ResponseTrailers(TrailersResponse {
            header_mutation: Some(HeaderMutation {
                remove_headers: attempt_headers(),
                ..Default::default()
            }),
        }),
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
                        let _ = self.tx.send(Err(failing(status))).await;
                        break;
                    }
                },
            };
            match self.step(message, &mut inbound).await {
                Flow::Next => {}
                Flow::Ended => break,
                Flow::Fail(status) => {
                    tracing::warn!(%status, "ext_proc: the stream broke the protocol; ended");
                    let _ = self.tx.send(Err(failing(status))).await;
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
            // No body came, and the trailers did (request_trailer_mode:
            // SEND): the body is empty, and the trailers' answer is the
            // decision.
            (Phase::Body { request, body }, Message::RequestTrailers(_)) => {
                self.authorize(request, &body, Stage::Trailers, inbound)
                    .await
            }
            (Phase::Forwarded(held), Message::ResponseHeaders(h)) => {
                self.response_headers(held, h).await
            }
            (
                Phase::Responding(responding),
                kind @ (Message::ResponseBody(_) | Message::ResponseTrailers(_)),
            ) => {
                let verdict = self.responding(responding, &kind);
                let answer = self.pass_on(&kind);
                let sent = self.send(answer).await;
                self.conclude(verdict);
                if sent { Flow::Next } else { Flow::Ended }
            }
            // The response while atmost still awaits the request: Envoy
            // may have forwarded a request atmost never authorized (held
            // for a body that never came, its trailers skipped; or its
            // headers never sent), or it is Envoy's own local reply (an
            // earlier filter's, or its own 413 / 408). Nothing was
            // reserved, so nothing can be settled: it is logged and
            // counted, and the answer goes on to the client (ending the
            // stream instead would have Envoy answer 500 for a call the
            // tool may have run, inviting a retry).
            (
                phase @ (Phase::Start | Phase::Body { .. }),
                kind @ (Message::ResponseHeaders(_)
                | Message::ResponseBody(_)
                | Message::ResponseTrailers(_)),
            ) => {
                self.unauthorized_forward(&phase, &kind);
                let answer = self.pass_on(&kind);
                if self.send(answer).await {
                    Flow::Next
                } else {
                    Flow::Ended
                }
            }
            // One stream carries one request: a second request's headers
            // would be forwarded on a CONTINUE without an Authorize.
            (Phase::Done, Message::RequestHeaders(_)) => Flow::Fail(Status::invalid_argument(
                "ext_proc: request_headers on a stream whose request was already decided: one \
                 stream carries one request, and this one is not authorized",
            )),
            // The request's body or trailers after the answer to its
            // headers (a body Envoy sends though the fingerprint does not
            // need it, even while the response comes), and anything after
            // the attempt was settled.
            (
                phase @ (Phase::Forwarded(_) | Phase::Responding(_)),
                kind @ (Message::RequestBody(_) | Message::RequestTrailers(_)),
            )
            | (phase @ Phase::Done, kind) => {
                self.phase = phase;
                let answer = self.pass_on(&kind);
                if self.send(answer).await {
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

    /// The response arrived while atmost still awaited the request
    /// (`phase`). Counted (`atmost.envoy.unauthorized_forwards`, by what
    /// was awaited) and logged with the route and the response's status.
    ///
    /// Before the request's headers (Phase::Start) it is a response to a
    /// request atmost never saw: most often an earlier filter's local reply
    /// (jwt_authn's 401, RBAC's 403, a rate limit's 429: Envoy runs the
    /// encoder filters for a local reply even when this filter's
    /// decodeHeaders never ran), or every request under
    /// `request_header_mode: SKIP`. atmost cannot tell them apart: a
    /// warning. While the body was awaited (Phase::Body) the request was
    /// possibly forwarded (no body data came and its trailers were
    /// skipped), or Envoy answered it itself (a 413 for a body past its
    /// buffer, a 408 for a request that timed out): an error, since the
    /// first is a misconfiguration that lets calls through uncounted.
    fn unauthorized_forward(&self, phase: &Phase, kind: &Message) {
        let status = match kind {
            Message::ResponseHeaders(h) => headers_of(h.headers.clone())
                .get(":status")
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default(),
            _ => String::new(),
        };
        let route_tool = self.route_tool.as_deref().unwrap_or("");
        match phase {
            Phase::Body { request, .. } => {
                let envoys_own = matches!(status.as_str(), "413" | "408");
                tracing::error!(
                    awaiting = "request_body",
                    received = kind_name(kind),
                    status = %status,
                    route_tool,
                    method = request.method.as_str(),
                    path = %crate::domain::shown(&request.path),
                    "ext_proc: an unauthorized forward, possibly: the response arrived while atmost \
                     still awaited the request's body, so the request may have reached the tool \
                     without an Authorize (nothing reserved, nothing counted). Envoy forwards a \
                     request held for its body when no body data comes and its trailers are \
                     skipped (set request_trailer_mode: SEND, or allow_mode_override: true); {}",
                    if envoys_own {
                        "this status is also Envoy's own answer to a body past its buffer (413) \
                         or a request that timed out (408), which never reached the tool"
                    } else {
                        "or the response is Envoy's own local reply, which never reached the tool"
                    }
                );
                self.counters.unauthorized_forward("request_body");
            }
            _ => {
                tracing::warn!(
                    awaiting = "request_headers",
                    received = kind_name(kind),
                    status = %status,
                    route_tool,
                    "ext_proc: a response to a request atmost never saw: an earlier filter's \
                     local reply (jwt_authn, RBAC, a rate limit), which reached no tool; or, \
                     under request_header_mode: SKIP, a request forwarded without an Authorize \
                     (nothing reserved, nothing counted)"
                );
                self.counters.unauthorized_forward("request_headers");
            }
        }
    }

    /// The answer to a message atmost passes on unchanged: [`pass`], but a
    /// body under `FULL_DUPLEX_STREAMED` (or `GRPC`) is handed back as the
    /// processor's streamed response: in those modes Envoy forwards only
    /// the body the processor streams back, and takes a plain CONTINUE for
    /// a spurious message.
    fn pass_on(&self, kind: &Message) -> ProcessingResponse {
        let streamed = |mode: Option<BodySendMode>| {
            matches!(
                mode,
                Some(BodySendMode::FullDuplexStreamed | BodySendMode::Grpc)
            )
        };
        match kind {
            Message::RequestBody(b) if streamed(self.request_body_mode()) => {
                echo(b, Outgoing::RequestBody)
            }
            Message::ResponseBody(b) if streamed(self.response_body_mode()) => {
                echo(b, Outgoing::ResponseBody)
            }
            _ => pass(kind),
        }
    }

    /// What a message of a 2xx response whose outcome was awaited settles.
    fn responding(&self, mut r: Responding, kind: &Message) -> Verdict {
        match kind {
            Message::ResponseBody(b) => {
                r.body.push(&b.body);
                // Whether the body atmost sees has ended with this message.
                let ended = match self.response_body_mode() {
                    // BUFFERED: the whole body in one message.
                    Some(BodySendMode::Buffered) => true,
                    // BUFFERED_PARTIAL: one message. With end_of_stream, the
                    // whole body. Without, either its first part (it outgrew
                    // Envoy's buffer; the rest passes by unseen) or the whole
                    // body ahead of trailers (Envoy's onTrailers sends what it
                    // queued with end_of_stream false). atmost cannot tell
                    // them apart, not even by the trailers: Envoy sends those
                    // after a part too. No body or digest of the result can
                    // be made of what may be a part, so only its status is
                    // recorded.
                    Some(BodySendMode::BufferedPartial) => {
                        if !b.end_of_stream && r.result != ResultMode::Status {
                            tracing::warn!(
                                permit_id = %r.held.attempt.permit_id,
                                seen = r.body.len,
                                "ext_proc: the response body reached atmost without its end \
                                 (response_body_mode BUFFERED_PARTIAL: it outgrew Envoy's \
                                 buffer, or trailers follow it, which atmost cannot tell \
                                 apart): the result recorded is the status alone; use \
                                 BUFFERED, or STREAMED, for a body or digest of any size"
                            );
                            r.result = ResultMode::Status;
                        }
                        true
                    }
                    // STREAMED, FULL_DUPLEX_STREAMED: chunks, the last with
                    // end_of_stream, unless trailers follow.
                    _ => b.end_of_stream,
                };
                if r.grpc {
                    if b.end_of_stream {
                        // No trailers follow, so no grpc-status will come.
                        let reason = format!(
                            "the tool's gRPC response (HTTP {}) ended without a grpc-status",
                            r.status
                        );
                        return Verdict::Uncertain(r.held, reason);
                    }
                    // The outcome is in the trailers.
                    return Verdict::Await(r);
                }
                if ended {
                    let result = r.body.result(r.result, r.status);
                    Verdict::Commit(r.held, succeeded(result))
                } else {
                    Verdict::Await(r)
                }
            }
            Message::ResponseTrailers(t) => {
                if !r.grpc {
                    // The trailers end the body (STREAMED's last chunk has
                    // no end_of_stream when trailers follow).
                    let result = r.body.result(r.result, r.status);
                    return Verdict::Commit(r.held, succeeded(result));
                }
                let trailers = headers_of(t.trailers.clone());
                match grpc_outcome(&trailers) {
                    Some(GrpcOutcome::Ok) => {
                        let result = r.body.result(r.result, r.status);
                        Verdict::Commit(r.held, succeeded(result))
                    }
                    Some(GrpcOutcome::Failed(reason)) => Verdict::Commit(r.held, failed(reason)),
                    Some(GrpcOutcome::Otherwise(reason)) => self.otherwise(r.held, reason),
                    Some(GrpcOutcome::Unreadable(reason)) => Verdict::Uncertain(r.held, reason),
                    None => {
                        let reason = format!(
                            "the tool's gRPC response (HTTP {}) ended without a grpc-status in \
                             its trailers",
                            r.status
                        );
                        Verdict::Uncertain(r.held, reason)
                    }
                }
            }
            _ => Verdict::Await(r),
        }
    }

    /// What an outcome that may have acted settles, by the route's
    /// `otherwise` (as a 5xx): UNCERTAIN, or Failed.
    fn otherwise(&self, held: Held, reason: String) -> Verdict {
        match self.mapping.response.otherwise {
            Otherwise::Uncertain => Verdict::Uncertain(held, reason),
            Otherwise::Failed => Verdict::Commit(held, failed(reason)),
        }
    }

    /// Records what `verdict` settles, beside the stream, or awaits more.
    fn conclude(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Commit(held, outcome) => self.settle(held, outcome),
            Verdict::Uncertain(held, reason) => {
                let recorder = self.recorder.clone();
                self.settling = Some(tokio::spawn(async move {
                    recorder
                        .mark_uncertain(&held.attempt, reason, held.lease_end)
                        .await;
                }));
            }
            Verdict::Await(responding) => self.phase = Phase::Responding(responding),
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
            // BUFFERED was announced, so the protocol is known.
            let hold = hold_for_body(&self.protocol.unwrap_or_default());
            return if self.send(hold).await {
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
        let call = Box::pin(self.recorder.gate.do_authorize(Request::from_parts(
            MetadataMap::new(),
            self.recorder.extensions.clone(),
            authorize,
        )));
        let (result, stream) = watching(call, inbound, &mut self.pending).await;
        match Answer::of(result) {
            Answer::Forward(attempt) => {
                let attempt = *attempt;
                let lease_end = lease_end(&attempt);
                if !matches!(stream, Watched::Open) {
                    // Envoy gave up on the request (its message timeout, the
                    // client reset), or its stream broke, before DISPATCH
                    // could reach it: it was never forwarded. The slot is
                    // given back first, so that a retry finds the key free.
                    self.recorder.commit(&attempt, not_sent(), lease_end).await;
                    self.phase = Phase::Done;
                    return self.unanswered(stream).await;
                }
                let response = ProcessingResponse {
                    response: Some(stage.proceed(forward_headers(&attempt))),
                    dynamic_metadata: Some(namespaced(&attempt)),
                    ..Default::default()
                };
                if self.send(response).await {
                    self.phase = Phase::Forwarded(Held { attempt, lease_end });
                    Flow::Next
                } else {
                    // The stream was gone: CONTINUE never reached Envoy.
                    self.recorder.commit(&attempt, not_sent(), lease_end).await;
                    self.phase = Phase::Done;
                    Flow::Ended
                }
            }
            Answer::Respond(reply) => {
                self.phase = Phase::Done;
                if matches!(stream, Watched::Open) {
                    self.refuse(reply).await
                } else {
                    self.unanswered(stream).await
                }
            }
        }
    }

    /// Ends a stream whose last message went unanswered: always with an
    /// error status, never cleanly. Envoy takes a processor stream that
    /// closes cleanly as "processing complete" and goes on with the
    /// request, and this one was never authorized. After a read error the
    /// error is that status; after Envoy closed its side ABORTED, in case
    /// it still waits (with `failure_mode_allow: false` it then fails the
    /// request). Envoy's own close is a half-close followed at once by a
    /// reset, so it normally reads neither: which error is sent is not the
    /// point, that it is never OK is.
    async fn unanswered(&mut self, stream: Watched) -> Flow {
        let status = match stream {
            Watched::Broken(status) => {
                tracing::debug!(%status, "ext_proc: the stream broke while the store decided");
                status
            }
            Watched::Open | Watched::Closed => Status::aborted(
                "the gateway closed the stream before atmost answered: the request is not \
                 authorized",
            ),
        };
        let _ = self.tx.send(Err(failing(status))).await;
        Flow::Ended
    }

    async fn response_headers(&mut self, held: Held, h: HttpHeaders) -> Flow {
        let headers = headers_of(h.headers);
        let Some(status) = headers
            .get(":status")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse::<u16>().ok())
        else {
            // Without a status nothing is known: the stream's end marks the
            // attempt UNCERTAIN.
            self.phase = Phase::Forwarded(held);
            return Flow::Fail(Status::invalid_argument(
                "response_headers without a :status",
            ));
        };
        // CONTINUE, nothing added and the attempt's headers removed (the
        // tool may echo them): the attempt is still open (its outcome is
        // recorded after this answer), and an open attempt's id, the
        // fencing token Commit checks, never goes to the client.
        let answer = pass(&Message::ResponseHeaders(HttpHeaders::default()));
        let verdict = self.verdict_on_headers(held, status, &headers, h.end_of_stream);
        let sent = self.send(answer).await;
        self.conclude(verdict);
        if sent { Flow::Next } else { Flow::Ended }
    }

    /// What a response's headers settle: its HTTP status, by the
    /// mapping's policy; of a 2xx, its result when its body is not
    /// awaited, and of a gRPC response, its `grpc-status` (trailers-only)
    /// or the wait for its trailers.
    fn verdict_on_headers(
        &self,
        held: Held,
        status: u16,
        headers: &Headers,
        end_of_stream: bool,
    ) -> Verdict {
        let policy = &self.mapping.response;
        match policy.settle(status) {
            Settle::Failed => {
                return Verdict::Commit(held, failed(format!("the tool answered HTTP {status}")));
            }
            Settle::Uncertain => {
                return Verdict::Uncertain(held, format!("the tool answered HTTP {status}"));
            }
            Settle::Succeeded => {}
        }
        let grpc = is_grpc(headers.get("content-type"));
        // No body: the result is that of an empty body, which it is.
        let empty = || ResultBody::default().result(policy.result, status);
        if grpc {
            // A trailers-only response carries its status in its headers.
            match grpc_outcome(headers) {
                Some(GrpcOutcome::Ok) => return Verdict::Commit(held, succeeded(empty())),
                Some(GrpcOutcome::Failed(reason)) => return Verdict::Commit(held, failed(reason)),
                Some(GrpcOutcome::Otherwise(reason)) => return self.otherwise(held, reason),
                Some(GrpcOutcome::Unreadable(reason)) => return Verdict::Uncertain(held, reason),
                None if end_of_stream => {
                    let reason = format!(
                        "the tool's gRPC response (HTTP {status}) ended without a grpc-status"
                    );
                    return Verdict::Uncertain(held, reason);
                }
                None => {}
            }
        } else if end_of_stream {
            return Verdict::Commit(held, succeeded(empty()));
        }
        let mode = self.response_body_mode();
        let body_seen = matches!(
            mode,
            Some(
                BodySendMode::Buffered
                    | BodySendMode::BufferedPartial
                    | BodySendMode::Streamed
                    | BodySendMode::FullDuplexStreamed
            )
        );
        let mut result = policy.result;
        if result != ResultMode::Status && !body_seen {
            // NONE, GRPC (gRPC's own proxyless ext_proc's mode, not
            // Envoy's: its messages would reach atmost de-framed), or not
            // announced: no body or digest can be made of what atmost does
            // not see. The status is what is known.
            tracing::warn!(
                permit_id = %held.attempt.permit_id,
                response_body_mode = body_mode(mode),
                "ext_proc: the result is the response body, which Envoy does not send atmost \
                 (response_body_mode BUFFERED, STREAMED, FULL_DUPLEX_STREAMED or \
                 BUFFERED_PARTIAL): the result recorded is the status alone"
            );
            result = ResultMode::Status;
        }
        if !grpc && result == ResultMode::Status {
            let result = ResultBody::default().result(ResultMode::Status, status);
            return Verdict::Commit(held, succeeded(result));
        }
        Verdict::Await(Responding {
            held,
            status,
            body: ResultBody::default(),
            result,
            grpc,
        })
    }

    /// Records the response's outcome beside the stream: the answer to
    /// Envoy has already been handed over, and Envoy's next messages are
    /// answered while the store is asked (and asked again). Envoy has
    /// usually closed and reset the stream long before the outcome is
    /// recorded or given up: the recording does not depend on it. Not
    /// tracked itself: the stream's task, which is, awaits it in
    /// [`Exchange::finish`], so a shutdown counts one task per stream.
    fn settle(&mut self, held: Held, outcome: pb::commit_request::Outcome) {
        let recorder = self.recorder.clone();
        self.settling = Some(tokio::spawn(async move {
            recorder
                .commit(&held.attempt, outcome, held.lease_end)
                .await;
        }));
    }

    /// What the end of the stream means for the attempt, once the
    /// response's outcome (if any) is recorded.
    async fn finish(&mut self) {
        if let Some(settling) = self.settling.take()
            && let Err(e) = settling.await
        {
            tracing::error!(error = %e, "ext_proc: recording an outcome failed");
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Forwarded(held) => {
                self.recorder
                    .mark_uncertain(
                        &held.attempt,
                        "the gateway's stream ended after the request was forwarded, before its response"
                            .into(),
                        held.lease_end,
                    )
                    .await;
            }
            // A 2xx and then the stream ended before its body's end: the
            // tool (or Envoy) may have given up midway, or, with part of a
            // STREAMED body seen, trailers followed it under
            // `response_trailer_mode: SKIP` (Envoy then sends no
            // end_of_stream). The result is not known either way: unsure,
            // so UNCERTAIN, the reason naming the setting that avoids it.
            Phase::Responding(Responding {
                held,
                status,
                body,
                grpc: true,
                ..
            }) => {
                let reason = format!(
                    "the gateway's stream ended after the tool's gRPC response (HTTP {status}{}), \
                     before its trailers: no grpc-status seen (the trailers reach atmost only \
                     with response_trailer_mode: SEND)",
                    if body.seen {
                        format!(", {} bytes of body", body.len)
                    } else {
                        String::new()
                    }
                );
                self.recorder
                    .mark_uncertain(&held.attempt, reason, held.lease_end)
                    .await;
            }
            Phase::Responding(Responding {
                held, status, body, ..
            }) => {
                let reason = if body.seen {
                    format!(
                        "the gateway's stream ended after {} bytes of the tool's HTTP {status} \
                         body, before its end (the tool or the gateway gave up midway; or \
                         trailers followed a STREAMED body, which then ends only with \
                         response_trailer_mode: SEND)",
                        body.len
                    )
                } else {
                    format!(
                        "the gateway's stream ended after the tool's HTTP {status}, before its body"
                    )
                };
                self.recorder
                    .mark_uncertain(&held.attempt, reason, held.lease_end)
                    .await;
            }
            Phase::Start | Phase::Body { .. } | Phase::Done => {}
        }
    }
}

// === recording outcomes ===

/// The first pause before an outcome is asked again; it doubles with each
/// try, up to [`MAX_BACKOFF`], jittered (half of it at random) so that the
/// streams a store blip failed together do not come back together.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// How long a Succeeded or Failed is asked at least, past the lease if
/// need be: an UNCERTAIN attempt still takes them from its holder, and
/// each one recorded is one an operator need not resolve. A minute rides
/// out a Redis failover (Sentinel's own default notices a dead primary in
/// 30 s).
const OUTCOME_PATIENCE: Duration = Duration::from_secs(60);

/// The Gate, as the stream's caller, for the outcomes.
///
/// Each outcome is asked again while the store cannot answer it for now
/// (STORE_UNAVAILABLE: unreachable, no answer within --store-timeout; or
/// OVERLOADED: shed by admission), never after a definitive answer (a
/// domain refusal: the attempt settled otherwise, resolved by an operator,
/// another attempt's id). Asking again is safe: a Commit or MarkUncertain
/// that reached the store and whose answer was lost is answered the same
/// when repeated with the same attempt id and outcome (a repeated NotSent
/// of a RELEASED attempt included, domain::ledger `settle`).
///
/// The outcomes go through admission like any store call, rather than
/// around it: admission is what keeps a struggling store from more work
/// than it can take, and it sheds only while every slot is busy, for a
/// moment (its queue wait, then CoDel's interval); an outcome that waits
/// a backoff and asks again costs the store nothing meanwhile, where
/// outcomes exempt from admission would pile onto the store exactly when
/// it is slowest.
///
/// These retries are not bounded by the streams Envoy holds open: Envoy
/// closes a stream right after its last answer, and the task asking
/// lives on, up to the lease (NotSent, MarkUncertain) or the lease or a
/// minute, whichever is later (Succeeded, Failed). Each holds at most one
/// outcome and no slot while it waits, so they are bounded by the
/// requests forwarded in that time, and a shutdown waits for them
/// ([`Settling`]).
///
/// Nor do they get in ahead of new Authorizes: admission's slots are one
/// first-come-first-served semaphore (crate::admission), with no
/// priority. Letting outcomes first would be worth it (each frees a slot
/// and an attempt, and each one refused is work for an operator if its
/// lease passes), but needs a second class of waiter in admission and a
/// way for the Gate's calls to say which they are: not a change to make
/// here. Meanwhile a shed outcome costs a backoff, not the outcome.
#[derive(Clone)]
struct Recorder {
    gate: Arc<GateService>,
    /// The stream's caller and deadline.
    extensions: http::Extensions,
    /// Where the outcomes being recorded are known, for a shutdown.
    settling: Settling,
}

impl Recorder {
    /// The stream's caller, without its deadline: an outcome is recorded
    /// however late (refusing it would leave the attempt to its lease).
    fn caller<T>(&self, message: T) -> Request<T> {
        let mut extensions = self.extensions.clone();
        extensions.remove::<Deadline>();
        Request::from_parts(MetadataMap::new(), extensions, message)
    }

    /// Commits `outcome`. NotSent is asked until the lease's end: after it
    /// the attempt is UNCERTAIN, which a holder's NotSent can no longer
    /// release. Succeeded and Failed are asked until then too, or for
    /// [`OUTCOME_PATIENCE`] if that is later.
    // The Gate's futures are boxed here: nested in this stream's own, they
    // made one state machine too deep for the compiler to lay out.
    async fn commit(
        &self,
        attempt: &pb::Attempt,
        outcome: pb::commit_request::Outcome,
        lease_end: Instant,
    ) {
        let until = asked_until(&outcome, lease_end);
        let name = match outcome {
            pb::commit_request::Outcome::NotSent(_) => "NotSent",
            pb::commit_request::Outcome::Succeeded(_) => "Succeeded",
            pb::commit_request::Outcome::Failed(_) => "Failed",
        };
        let _entry = self.settling.enter("Commit", attempt, name);
        let request = pb::CommitRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            outcome: Some(outcome),
        };
        let asked = retrying("Commit", attempt, until, || {
            Box::pin(self.gate.do_commit(self.caller(request.clone())))
        })
        .await;
        if let Err(e) = asked {
            gave_up("Commit", attempt, &e);
        }
    }

    /// MarkUncertain, asked until the lease's end: after it the attempt
    /// reads UNCERTAIN anyway, and only the reason would be added.
    async fn mark_uncertain(&self, attempt: &pb::Attempt, reason: String, lease_end: Instant) {
        let _entry = self.settling.enter("MarkUncertain", attempt, "Uncertain");
        let request = pb::MarkUncertainRequest {
            permit_id: attempt.permit_id.clone(),
            idempotency_key: attempt.idempotency_key.clone(),
            attempt_id: attempt.attempt_id.clone(),
            reason,
        };
        let asked = retrying("MarkUncertain", attempt, lease_end, || {
            Box::pin(self.gate.do_mark_uncertain(self.caller(request.clone())))
        })
        .await;
        if let Err(e) = asked {
            gave_up("MarkUncertain", attempt, &e);
        }
    }
}

/// Logs an outcome given up on: one the store could not take in time
/// (the attempt turns UNCERTAIN at its lease), or one it refused (a
/// domain refusal: the attempt was settled otherwise, resolved by an
/// operator, or is another attempt's id).
fn gave_up(rpc: &'static str, attempt: &pb::Attempt, e: &Error) {
    if transient(e) {
        tracing::warn!(
            rpc,
            permit_id = %attempt.permit_id,
            attempt_id = %attempt.attempt_id,
            error = %e,
            "ext_proc: the outcome could not be recorded in time; the attempt turns UNCERTAIN at \
             its lease"
        );
    } else if matches!(e, Error::StoreUnavailable(_)) {
        tracing::error!(
            rpc,
            permit_id = %attempt.permit_id,
            attempt_id = %attempt.attempt_id,
            error = %e,
            "ext_proc: the store will not decide on this permit's record until an operator \
             repairs it: nothing recorded; the attempt stays open and turns UNCERTAIN at its lease"
        );
    } else {
        tracing::warn!(
            rpc,
            permit_id = %attempt.permit_id,
            attempt_id = %attempt.attempt_id,
            error = %e,
            "ext_proc: the store refused the outcome (the attempt was settled otherwise, resolved, \
             or replaced): nothing recorded"
        );
    }
}

/// Until when `outcome` is asked: NotSent until the lease's end (after it
/// the attempt is UNCERTAIN, which a holder's NotSent can no longer
/// release), Succeeded and Failed until then or for [`OUTCOME_PATIENCE`]
/// if that is later.
fn asked_until(outcome: &pb::commit_request::Outcome, lease_end: Instant) -> Instant {
    match outcome {
        pb::commit_request::Outcome::NotSent(_) => lease_end,
        _ => lease_end.max(Instant::now() + OUTCOME_PATIENCE),
    }
}

/// What a store script answers, as STORE_UNAVAILABLE, when it will not
/// decide on a record it cannot read (src/store/redis/lua/lib.lua): the
/// record stays so until an operator repairs it, so asking again cannot
/// help. The store passes the words on; they are all that tells these
/// apart from a store that could not answer for now.
const STORE_WILL_NOT_DECIDE: [&str; 2] = [
    "unreadable permit record",
    "permit record lost while its attempts remain",
];

/// Whether the store may answer `e` otherwise if asked again: it could
/// not answer (or was not asked), as opposed to a decision, or to a
/// record it will never decide on.
fn transient(e: &Error) -> bool {
    match e {
        Error::StoreUnavailable(why) => !STORE_WILL_NOT_DECIDE.contains(&why.as_str()),
        Error::Overloaded { .. } => true,
        _ => false,
    }
}

/// Asks `once` until it answers, it fails other than [`transient`]ly, or
/// the next try would start after `until`.
async fn retrying<T, Fut>(
    rpc: &'static str,
    attempt: &pb::Attempt,
    until: Instant,
    mut once: impl FnMut() -> Fut,
) -> Result<T, Error>
where
    Fut: Future<Output = Result<T, Error>>,
{
    let mut tries: u32 = 0;
    loop {
        tries += 1;
        let error = match once().await {
            Ok(answer) => return Ok(answer),
            Err(error) => error,
        };
        let delay = backoff(tries);
        if !transient(&error) || Instant::now() + delay >= until {
            return Err(error);
        }
        tracing::debug!(
            rpc,
            tries,
            permit_id = %attempt.permit_id,
            attempt_id = %attempt.attempt_id,
            error = %error,
            ?delay,
            "ext_proc: an outcome could not be recorded yet; asking again"
        );
        tokio::time::sleep(delay).await;
    }
}

/// The pause after the `tries`-th try: [`FIRST_BACKOFF`] doubled per try
/// up to [`MAX_BACKOFF`], of which a random half is waited.
fn backoff(tries: u32) -> Duration {
    let full = FIRST_BACKOFF
        .saturating_mul(1 << tries.saturating_sub(1).min(16))
        .min(MAX_BACKOFF);
    let half = full / 2;
    // The random bits of a UUIDv7 (uuid's own generator, as for attempt
    // ids): no random-number crate of its own for a jitter.
    let random = uuid::Uuid::now_v7().as_u128() as u64;
    half + Duration::from_micros(random % (half.as_micros() as u64 + 1))
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

fn failed(reason: String) -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::Failed(pb::Failed { reason })
}

/// A body under `FULL_DUPLEX_STREAMED` or `GRPC` handed back unchanged:
/// in those modes Envoy forwards what the processor streams back.
fn echo(b: &HttpBody, answer: fn(BodyResponse) -> Outgoing) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(answer(BodyResponse {
            response: Some(CommonResponse {
                status: ResponseStatus::Continue as i32,
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body: b.body.clone(),
                            end_of_stream: b.end_of_stream,
                            end_of_stream_without_message: b.end_of_stream_without_message,
                            grpc_message_compressed: b.grpc_message_compressed,
                            ..Default::default()
                        },
                    )),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

fn not_sent() -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::NotSent(pb::NotSent {})
}

/// How Envoy's side of the stream stood when a store call returned.
enum Watched {
    /// Open: the answer can be handed over.
    Open,
    /// Envoy closed its side cleanly before the answer (it gave up).
    Closed,
    /// A message atmost could not read (one past --max-request-bytes, a
    /// decoding error), or a reset: the stream is broken with this status.
    Broken(Status),
}

/// Runs `call` (a store call, never cancelled halfway) while watching the
/// stream: a message that arrives meanwhile is kept in `pending`; an end
/// or an error is reported, never taken for the other.
async fn watching<T>(
    call: impl Future<Output = T>,
    inbound: &mut Streaming<ProcessingRequest>,
    pending: &mut Option<ProcessingRequest>,
) -> (T, Watched) {
    tokio::pin!(call);
    let mut stream = Watched::Open;
    loop {
        tokio::select! {
            // The stream first: an end that has already arrived is seen
            // before a DISPATCH is handed over.
            biased;
            next = inbound.message(),
                if matches!(stream, Watched::Open) && pending.is_none() => match next {
                Ok(Some(message)) => *pending = Some(message),
                Ok(None) => stream = Watched::Closed,
                Err(status) => stream = Watched::Broken(status),
            },
            out = &mut call => return (out, stream),
        }
    }
}

/// One of each answer this module gives, for the descriptor test.
#[cfg(test)]
pub(super) fn every_response(attempt: &pb::Attempt) -> Vec<ProcessingResponse> {
    let forward = ProcessingResponse {
        response: Some(Stage::Body.proceed(forward_headers(attempt))),
        dynamic_metadata: Some(namespaced(attempt)),
        ..Default::default()
    };
    let refused = immediate(Reply::refusal(&crate::domain::Error::KeyReused {
        idempotency_key: "k".into(),
    }));
    // A body handed back under FULL_DUPLEX_STREAMED.
    let streamed = HttpBody {
        body: b"b".to_vec(),
        end_of_stream: true,
        ..Default::default()
    };
    let hold = hold_for_body(&ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::Streamed as i32,
        ..Default::default()
    });
    let mut all = vec![
        forward,
        refused,
        hold,
        echo(&streamed, Outgoing::RequestBody),
        echo(&streamed, Outgoing::ResponseBody),
    ];
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Runs `retrying` against a scripted store: `answer(try)` is the
    /// answer to the `try`-th call (1-based). The instants of the calls,
    /// and the result.
    async fn scripted(
        until: Instant,
        mut answer: impl FnMut(u32) -> Result<(), Error>,
    ) -> (Vec<Instant>, Result<(), Error>) {
        let calls = Mutex::new(Vec::new());
        let tries = AtomicU32::new(0);
        let result = retrying("Commit", &pb::Attempt::default(), until, || {
            calls.lock().unwrap().push(Instant::now());
            let n = tries.fetch_add(1, Ordering::Relaxed) + 1;
            std::future::ready(answer(n))
        })
        .await;
        (calls.into_inner().unwrap(), result)
    }

    fn unavailable() -> Error {
        Error::StoreUnavailable("no answer within --store-timeout".into())
    }

    #[tokio::test(start_paused = true)]
    async fn not_sent_is_asked_until_the_lease_ends_and_no_later() {
        let start = Instant::now();
        let lease_end = start + Duration::from_secs(5);
        let until = asked_until(&not_sent(), lease_end);
        assert_eq!(until, lease_end);
        let (calls, result) = scripted(until, |_| Err(unavailable())).await;
        assert!(matches!(result, Err(Error::StoreUnavailable(_))));
        assert!(calls.len() > 3, "asked again: {}", calls.len());
        assert!(calls.iter().all(|&t| t < lease_end), "a try past the lease");
        assert!(Instant::now() <= lease_end, "given up at the lease's end");
    }

    #[tokio::test(start_paused = true)]
    async fn succeeded_and_failed_are_asked_past_the_lease_up_to_the_bound() {
        let start = Instant::now();
        let lease_end = start + Duration::from_secs(5);
        for outcome in [
            succeeded(b"ok".to_vec()),
            pb::commit_request::Outcome::Failed(pb::Failed {
                reason: "HTTP 402".into(),
            }),
        ] {
            let begun = Instant::now();
            let until = asked_until(&outcome, lease_end);
            assert_eq!(until, begun + OUTCOME_PATIENCE);
            let (calls, result) = scripted(until, |_| Err(unavailable())).await;
            assert!(result.is_err());
            assert!(calls.iter().any(|&t| t > lease_end), "asked past the lease");
            assert!(calls.iter().all(|&t| t < until), "asked past the bound");
            assert!(Instant::now() <= until);
        }
        // A lease longer than the patience bounds them instead.
        let long = Instant::now() + OUTCOME_PATIENCE * 2;
        assert_eq!(asked_until(&succeeded(Vec::new()), long), long);
    }

    #[tokio::test(start_paused = true)]
    async fn overloaded_and_store_unavailable_are_asked_again() {
        let until = Instant::now() + Duration::from_secs(60);
        let (calls, result) = scripted(until, |n| match n {
            1 => Err(Error::Overloaded { in_flight: 512 }),
            2 => Err(unavailable()),
            _ => Ok(()),
        })
        .await;
        assert!(result.is_ok());
        assert_eq!(calls.len(), 3);
        assert!(calls[1] > calls[0] && calls[2] > calls[1], "with a pause");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_is_never_asked_again() {
        let until = Instant::now() + Duration::from_secs(60);
        for refusal in [
            Error::StateConflict {
                state: crate::domain::AttemptState::Succeeded,
            },
            Error::AttemptMismatch {
                idempotency_key: "k".into(),
            },
            Error::StoreUnavailable("unreadable permit record".into()),
            Error::StoreUnavailable("permit record lost while its attempts remain".into()),
        ] {
            let shown = refusal.to_string();
            let mut refusal = Some(refusal);
            let (calls, result) =
                scripted(until, |_| Err(refusal.take().unwrap_or_else(unavailable))).await;
            assert_eq!(calls.len(), 1, "{shown} asked again");
            assert_eq!(result.unwrap_err().to_string(), shown);
        }
    }

    /// The words STORE_WILL_NOT_DECIDE matches are the scripts' own.
    #[test]
    fn the_records_the_store_will_not_decide_on_are_the_scripts_words() {
        let lib = include_str!("../../store/redis/lua/lib.lua");
        for why in STORE_WILL_NOT_DECIDE {
            assert!(
                lib.contains(&format!("'{why}'")),
                "lib.lua no longer says {why:?}"
            );
        }
    }

    #[test]
    fn the_backoff_doubles_to_its_bound_with_half_of_it_at_random() {
        for tries in 1..40 {
            let full = (FIRST_BACKOFF * 2u32.pow(tries.min(20) - 1)).min(MAX_BACKOFF);
            let pause = backoff(tries);
            assert!(
                pause >= full / 2 && pause <= full,
                "try {tries}: {pause:?} outside [{:?}, {full:?}]",
                full / 2
            );
        }
    }

    #[test]
    fn grpc_content_types_are_told_from_others() {
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc-web",
            "application/grpc-web-text+proto",
            "application/grpc; charset=utf-8",
        ] {
            assert!(is_grpc(Some(grpc.as_bytes())), "{grpc}");
        }
        for other in ["application/json", "application/grpcx", "text/plain", ""] {
            assert!(!is_grpc(Some(other.as_bytes())), "{other}");
        }
        assert!(!is_grpc(None));
    }

    #[test]
    fn a_grpc_status_reads_as_its_outcome() {
        let of = |pairs: &[(&str, &str)]| {
            grpc_outcome(&Headers::new(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())),
            ))
        };
        assert!(of(&[]).is_none());
        assert!(matches!(of(&[("grpc-status", "0")]), Some(GrpcOutcome::Ok)));
        match of(&[
            ("grpc-status", "14"),
            ("grpc-message", "try%20later%E2%9C%93"),
        ]) {
            Some(GrpcOutcome::Otherwise(reason)) => assert_eq!(
                reason,
                "the tool answered gRPC status 14 (UNAVAILABLE): try later\u{2713}"
            ),
            _ => panic!("14 may have acted"),
        }
        match of(&[("grpc-status", "99")]) {
            Some(GrpcOutcome::Otherwise(reason)) => {
                assert_eq!(reason, "the tool answered gRPC status 99")
            }
            _ => panic!("99 may have acted"),
        }
        // Refused before acting: Failed; the codes that may have acted go
        // the way of a 5xx.
        for code in 1..=20u32 {
            let text = code.to_string();
            let outcome = of(&[("grpc-status", text.as_str())]);
            let expected_failed = [3, 5, 6, 7, 9, 10, 11, 12, 16].contains(&code);
            match outcome {
                Some(GrpcOutcome::Failed(_)) => assert!(expected_failed, "{code} Failed"),
                Some(GrpcOutcome::Otherwise(_)) => assert!(!expected_failed, "{code} otherwise"),
                _ => panic!("{code}: neither"),
            }
        }
        assert!(matches!(
            of(&[("grpc-status", "OK")]),
            Some(GrpcOutcome::Unreadable(_))
        ));
        // A message past what a reason may hold is cut, at a character.
        let long = "\u{e9}".repeat(MAX_TEXT_LEN);
        match of(&[("grpc-status", "2"), ("grpc-message", &long)]) {
            Some(GrpcOutcome::Otherwise(reason)) => assert!(reason.len() <= MAX_TEXT_LEN),
            _ => panic!("2 may have acted"),
        }
    }

    #[test]
    fn a_failure_never_ends_the_stream_ok() {
        let status = failing(Status::ok("no"));
        assert_eq!(status.code(), tonic::Code::Internal);
        let status = failing(Status::out_of_range("too big"));
        assert_eq!(status.code(), tonic::Code::OutOfRange);
    }
}
