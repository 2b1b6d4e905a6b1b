//! ext_proc v3 (`envoy.service.ext_proc.v3.ExternalProcessor/Process`)
//! through the real server, on both stores. Each test plays Envoy's
//! ext_proc filter over raw HTTP/2: one stream per HTTP request, the
//! ProcessingRequest messages in Envoy's order (request headers with the
//! protocol configuration, the BUFFERED body, response headers, the
//! response body), each waiting for its answer as Envoy does, and the
//! stream's end as Envoy ends it: closed after the response, closed
//! before atmost's answer (its message timeout), or reset (the client went
//! away). A request counts as sent to the tool only when Envoy would
//! forward it: on CONTINUE.

use super::{attempt, fingerprint, mapping, until_state};
use crate::support::*;
use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{
    BodySendMode, HeaderSendMode,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration, body_mutation::Mutation, common_response::ResponseStatus,
    processing_request::Request as Message, processing_response::Response as Answer,
};
use envoy_types::pb::google::protobuf::value::Kind as V;
use pb::AttemptState;
use prost::Message as _;
use std::collections::HashMap;
use tonic::Code;

const TOOL: &str = "wallet.charge";
const PATH: &str = "/v1/charges";
const BODY: &[u8] = br#"{"amount":500,"currency":"EUR"}"#;
/// How long a test waits for an answer before it fails (a hang guard,
/// never a timing assertion).
const PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

// === Envoy's side of one stream ===

/// One ext_proc stream, as Envoy's filter drives it, over its own HTTP/2
/// connection.
struct Envoy {
    connection: h2::client::SendRequest<Bytes>,
    send: h2::SendStream<Bytes>,
    /// `None` once the server ended the stream.
    body: h2::RecvStream,
    /// gRPC frames read and not yet decoded.
    buf: Vec<u8>,
    /// The stream's grpc-status, once known.
    status: Option<tonic::Status>,
    addr: std::net::SocketAddr,
    /// The first message carries the protocol configuration.
    first: bool,
    /// What the filter is configured with (ProtocolConfiguration).
    protocol: Option<ProtocolConfiguration>,
    /// The connection's PINGs ([`Envoy::delivered`]).
    pings: h2::PingPong,
}

/// Envoy's ProcessingMode for atmost: bodies BUFFERED both ways.
fn buffered() -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::Buffered as i32,
        send_body_without_waiting_for_header_response: false,
    })
}

impl Envoy {
    /// Opens a stream with these gRPC initial metadata (the route's
    /// `x-atmost-tool`, the gateway's `authorization`), the bodies BUFFERED.
    async fn open(h: &Harness, metadata: &[(&str, &str)]) -> Self {
        Self::open_with(h, metadata, buffered()).await
    }

    async fn open_with(
        h: &Harness,
        metadata: &[(&str, &str)],
        protocol: Option<ProtocolConfiguration>,
    ) -> Self {
        Self::open_at(h.addr, metadata, protocol).await
    }

    /// [`Envoy::open_with`] to the server at `addr`.
    async fn open_at(
        addr: std::net::SocketAddr,
        metadata: &[(&str, &str)],
        protocol: Option<ProtocolConfiguration>,
    ) -> Self {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut connection, mut driver) = h2::client::handshake(tcp).await.expect("HTTP/2");
        let pings = driver
            .ping_pong()
            .expect("the connection's PINGs, taken once");
        tokio::spawn(driver);
        let mut request = http::Request::builder()
            .method("POST")
            .uri(format!(
                "http://{addr}/envoy.service.ext_proc.v3.ExternalProcessor/Process"
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        for (k, v) in metadata {
            request = request.header(*k, *v);
        }
        let (response, send) = connection
            .send_request(request.body(()).unwrap(), false)
            .expect("open the stream");
        let (head, body) = tokio::time::timeout(PATIENCE, response)
            .await
            .expect("response headers within the patience")
            .expect("response headers")
            .into_parts();
        // A refusal before the service (no key, say) is trailers-only.
        let status = tonic::Status::from_header_map(&head.headers);
        Self {
            connection,
            send,
            body,
            buf: Vec::new(),
            status,
            addr,
            first: true,
            protocol,
            pings,
        }
    }

    /// Returns once the server's HTTP/2 connection has taken in what this
    /// stream sent so far (within its flow-control window): frames are
    /// read in order, and a PING sent after them is answered after. Two
    /// PINGs, since a PING may leave in the same write as frames queued
    /// before it, ahead of them; the second leaves after that write.
    async fn delivered(&mut self) {
        for _ in 0..2 {
            tokio::time::timeout(PATIENCE, self.pings.ping(h2::Ping::opaque()))
                .await
                .expect("a PING answered within the patience")
                .expect("a PING answered");
        }
    }

    /// Sends one message; `end` closes Envoy's side in the same frame.
    fn send(&mut self, mut message: ProcessingRequest, end: bool) {
        if std::mem::take(&mut self.first) {
            message.protocol_config = self.protocol;
        }
        let bytes = message.encode_to_vec();
        let mut frame = vec![0u8];
        frame.extend((bytes.len() as u32).to_be_bytes());
        frame.extend(bytes);
        self.send
            .send_data(Bytes::from(frame), end)
            .expect("send a message");
    }

    /// The next answer; `None` when the server ended the stream (then
    /// [`Envoy::status`] says how).
    async fn recv(&mut self) -> Option<ProcessingResponse> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes(self.buf[1..5].try_into().unwrap()) as usize;
                if self.buf.len() >= 5 + len {
                    let message =
                        ProcessingResponse::decode(&self.buf[5..5 + len]).expect("decode");
                    self.buf.drain(..5 + len);
                    return Some(message);
                }
            }
            // A server that never answers fails the test, never hangs it.
            let next = tokio::time::timeout(PATIENCE, self.body.data())
                .await
                .expect("an answer from atmost within the patience");
            match next {
                Some(Ok(chunk)) => {
                    let _ = self.body.flow_control().release_capacity(chunk.len());
                    self.buf.extend_from_slice(&chunk);
                }
                Some(Err(e)) => panic!("the stream broke: {e}"),
                None => {
                    if self.status.is_none() {
                        let trailers = tokio::time::timeout(PATIENCE, self.body.trailers())
                            .await
                            .expect("trailers within the patience")
                            .expect("trailers");
                        self.status = Some(
                            trailers
                                .as_ref()
                                .and_then(tonic::Status::from_header_map)
                                .unwrap_or_else(|| tonic::Status::unknown("no grpc-status")),
                        );
                    }
                    return None;
                }
            }
        }
    }

    /// Sends these messages in one DATA frame, as Envoy may when it sends
    /// the body without waiting for the headers' answer: atmost has them
    /// all before it answers the first.
    fn send_together(&mut self, messages: Vec<ProcessingRequest>) {
        let mut frame = Vec::new();
        for mut message in messages {
            if std::mem::take(&mut self.first) {
                message.protocol_config = self.protocol;
            }
            let bytes = message.encode_to_vec();
            frame.push(0u8);
            frame.extend((bytes.len() as u32).to_be_bytes());
            frame.extend(bytes);
        }
        self.send
            .send_data(Bytes::from(frame), false)
            .expect("send the messages");
    }

    /// Sends one message and waits for its answer, as Envoy does.
    async fn exchange(&mut self, message: ProcessingRequest) -> ProcessingResponse {
        self.send(message, false);
        self.recv().await.expect("an answer")
    }

    /// Envoy's filter is done: it closes its side, and the server ends the
    /// stream once it has recorded what it must. The stream's status.
    async fn close(mut self) -> Code {
        self.send.send_data(Bytes::new(), true).expect("half-close");
        assert!(self.recv().await.is_none(), "no answer after the end");
        self.status.expect("a status").code()
    }

    /// The stream ended by the server: its status.
    async fn ended(self) -> Code {
        self.ended_with().await.code()
    }

    /// The stream ended by the server: its whole status.
    async fn ended_with(mut self) -> tonic::Status {
        assert!(self.recv().await.is_none(), "no answer expected");
        self.status.expect("a status")
    }

    /// The stream ended by the server refusing a message past
    /// --max-request-bytes (128 KiB): RESOURCE_EXHAUSTED /
    /// MESSAGE_TOO_LARGE, with the limit.
    async fn ended_too_large(self) {
        let status = self.ended_with().await;
        let (metadata, _) = expect_error(
            Err::<(), _>(Error::from(status)),
            Code::ResourceExhausted,
            "MESSAGE_TOO_LARGE",
        );
        let limit = atmost::transport::Limits::DEFAULT.max_request_bytes;
        assert_eq!(metadata["limit"], limit.to_string());
    }

    /// The downstream client went away: Envoy resets the stream. Returns
    /// once the server's connection has read the reset (a health check on
    /// the same connection, after it, has been answered).
    async fn reset(mut self) {
        self.send.send_reset(h2::Reason::CANCEL);
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/grpc.health.v1.Health/Check", self.addr))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
        let (response, mut send) = self.connection.send_request(request, false).unwrap();
        send.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .unwrap();
        let mut body = response.await.expect("health").into_body();
        while body.data().await.is_some() {}
    }
}

fn header(key: &str, value: &str) -> HeaderValue {
    // Envoy sends header values as raw_value.
    HeaderValue {
        key: key.to_owned(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// The request headers Envoy sends for `method` `path`.
fn request_headers(
    method: &str,
    path: &str,
    extra: &[(&str, &str)],
    end: bool,
) -> ProcessingRequest {
    let mut headers = vec![
        header(":authority", "tools.example.com"),
        header(":path", path),
        header(":method", method),
        header(":scheme", "https"),
        header("content-type", "application/json"),
        header("x-forwarded-proto", "https"),
        header("x-request-id", "3cb7e724-0743-4509-ab4c-7df78decc7a0"),
    ];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        request: Some(Message::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn request_body(body: &[u8]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(status: u16, end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":status", &status.to_string()),
                    header("content-type", "application/json"),
                ],
            }),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(body: &[u8], end: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::ResponseBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Response headers with these headers beside `:status` (a gRPC tool's
/// `content-type`, a trailers-only `grpc-status`).
fn response_headers_with(status: u16, extra: &[(&str, &str)], end: bool) -> ProcessingRequest {
    let mut headers = vec![header(":status", &status.to_string())];
    headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    ProcessingRequest {
        request: Some(Message::ResponseHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// The response's trailers, as Envoy sends them (`response_trailer_mode:
/// SEND`).
fn response_trailers(trailers: &[(&str, &str)]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::ResponseTrailers(HttpTrailers {
            trailers: Some(HeaderMap {
                headers: trailers.iter().map(|(k, v)| header(k, v)).collect(),
            }),
        })),
        ..Default::default()
    }
}

/// The request's trailers, as Envoy sends them (`request_trailer_mode:
/// SEND`).
fn request_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Message::RequestTrailers(HttpTrailers {
            trailers: Some(HeaderMap {
                headers: vec![header("x-checksum", "0")],
            }),
        })),
        ..Default::default()
    }
}

/// A CONTINUE for this message kind: the headers it sets.
#[track_caller]
fn continued(answer: &ProcessingResponse) -> HashMap<String, String> {
    let common = match answer.response.as_ref().expect("a response") {
        Answer::RequestHeaders(h) | Answer::ResponseHeaders(h) => h.response.clone(),
        Answer::RequestBody(b) | Answer::ResponseBody(b) => b.response.clone(),
        other => panic!("expected CONTINUE, got {other:?}"),
    }
    .unwrap_or_default();
    assert_eq!(common.status(), ResponseStatus::Continue);
    common
        .header_mutation
        .map(|m| m.set_headers)
        .unwrap_or_default()
        .into_iter()
        .map(|o| {
            let h = o.header.unwrap();
            (h.key, String::from_utf8(h.raw_value).unwrap())
        })
        .collect()
}

/// A CONTINUE for this message kind: the headers it removes.
#[track_caller]
fn removed(answer: &ProcessingResponse) -> Vec<String> {
    let common = match answer.response.as_ref().expect("a response") {
        Answer::RequestHeaders(h) | Answer::ResponseHeaders(h) => h.response.clone(),
        Answer::RequestBody(b) | Answer::ResponseBody(b) => b.response.clone(),
        other => panic!("expected CONTINUE, got {other:?}"),
    }
    .unwrap_or_default();
    common
        .header_mutation
        .map(|m| m.remove_headers)
        .unwrap_or_default()
}

/// The headers that name an attempt.
const ATTEMPT_HEADERS: [&str; 3] = [
    "x-atmost-attempt-id",
    "x-atmost-permit-id",
    "x-atmost-idempotency-key",
];

/// This CONTINUE removes every header that names an attempt.
#[track_caller]
fn strips_attempt_headers(answer: &ProcessingResponse) {
    let removed = removed(answer);
    for header in ATTEMPT_HEADERS {
        assert!(
            removed.iter().any(|r| r == header),
            "{header} not removed: {removed:?}"
        );
    }
}

/// The answer holding a request for its body asks Envoy (where
/// `allow_mode_override` lets it) for both trailer modes SEND for this
/// request, the body modes as Envoy announced them (`protocol`), the
/// header modes left DEFAULT (Envoy's configured ones).
#[track_caller]
fn asks_for_trailers(answer: &ProcessingResponse, protocol: Option<ProtocolConfiguration>) {
    let protocol = protocol.expect("a hold needs the announced body modes");
    let mode = answer
        .mode_override
        .expect("the hold answer overrides the trailer modes");
    assert_eq!(
        (
            mode.request_trailer_mode(),
            mode.response_trailer_mode(),
            mode.request_body_mode,
            mode.response_body_mode,
            mode.request_header_mode(),
            mode.response_header_mode(),
        ),
        (
            HeaderSendMode::Send,
            HeaderSendMode::Send,
            protocol.request_body_mode,
            protocol.response_body_mode,
            HeaderSendMode::Default,
            HeaderSendMode::Send,
        ),
        "{mode:?}"
    );
}

/// An ImmediateResponse: (status, headers, body).
#[track_caller]
fn immediate(answer: &ProcessingResponse) -> (u16, HashMap<String, String>, Vec<u8>) {
    match answer.response.as_ref().expect("a response") {
        Answer::ImmediateResponse(r) => (
            r.status.as_ref().unwrap().code as u16,
            r.headers
                .clone()
                .unwrap_or_default()
                .set_headers
                .into_iter()
                .map(|o| {
                    let h = o.header.unwrap();
                    (h.key, String::from_utf8(h.raw_value).unwrap())
                })
                .collect(),
            r.body.clone(),
        ),
        other => panic!("expected an ImmediateResponse, got {other:?}"),
    }
}

/// What Envoy did with one request.
#[derive(Debug)]
enum Sent {
    /// Forwarded it to the tool: the attempt id atmost added.
    Forwarded(String),
    /// Answered the client itself: (status, headers, body).
    Answered(u16, HashMap<String, String>, Vec<u8>),
}

/// The request phase of one POST with a body, as Envoy runs it with the
/// body BUFFERED: headers (answered CONTINUE, the request held), then the
/// body, whose answer decides.
async fn post(envoy: &mut Envoy, headers: &[(&str, &str)], body: &[u8]) -> Sent {
    post_to(envoy, PATH, headers, body).await
}

/// [`post`] to `path`.
async fn post_to(envoy: &mut Envoy, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Sent {
    let answer = envoy
        .exchange(request_headers("POST", path, headers, false))
        .await;
    if let Some(Answer::ImmediateResponse(_)) = &answer.response {
        let (status, headers, body) = immediate(&answer);
        return Sent::Answered(status, headers, body);
    }
    assert!(
        continued(&answer).is_empty(),
        "the request is held for its body"
    );
    // A client's own attempt headers never reach the tool.
    strips_attempt_headers(&answer);
    asks_for_trailers(&answer, envoy.protocol);
    let answer = envoy.exchange(request_body(body)).await;
    match &answer.response {
        Some(Answer::RequestBody(_)) => {
            let set = continued(&answer);
            let id = set["x-atmost-attempt-id"].clone();
            // The attempt in the dynamic metadata, atmost's namespace.
            // Upstream, beside it, what the tool's Commit presents, as
            // atmost used them (ext_authz's "Without ext_proc" contract).
            let ns = &answer.dynamic_metadata.as_ref().unwrap().fields["atmost"];
            match &ns.kind {
                Some(V::StructValue(s)) => {
                    for (field, header) in [
                        ("attempt_id", "x-atmost-attempt-id"),
                        ("permit_id", "x-atmost-permit-id"),
                        ("idempotency_key", "x-atmost-idempotency-key"),
                    ] {
                        match &s.fields[field].kind {
                            Some(V::StringValue(v)) => assert_eq!(v, &set[header], "{header}"),
                            other => panic!("{other:?}"),
                        }
                    }
                }
                other => panic!("{other:?}"),
            }
            Sent::Forwarded(id)
        }
        _ => {
            let (status, headers, body) = immediate(&answer);
            Sent::Answered(status, headers, body)
        }
    }
}

fn charge_headers<'a>(permit: &'a str, key: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![("x-atmost-permit", permit), ("idempotency-key", key)]
}

#[track_caller]
fn forwarded(sent: Sent) -> String {
    match sent {
        Sent::Forwarded(id) => id,
        other => panic!("expected the request forwarded, got {other:?}"),
    }
}

/// Answered with `status` and `reason`: the headers and body.
#[track_caller]
fn answered(sent: Sent, status: u16, reason: &str) -> (HashMap<String, String>, Vec<u8>) {
    match sent {
        Sent::Answered(got, headers, body) => {
            assert_eq!(
                (got, headers["x-atmost-reason"].as_str()),
                (status, reason),
                "{}",
                String::from_utf8_lossy(&body)
            );
            (headers, body)
        }
        other => panic!("expected {status} {reason}, got {other:?}"),
    }
}

/// A CONTINUE of the response that adds nothing and removes the headers
/// that name an attempt (the tool may echo them): above all the attempt's
/// id, the fencing token of an attempt still open (its outcome is recorded
/// after this answer), must never reach the client.
#[track_caller]
fn passed_on(answer: &ProcessingResponse) {
    let set = continued(answer);
    assert!(
        !set.contains_key("x-atmost-attempt-id"),
        "an open attempt's id on the response: {set:?}"
    );
    strips_attempt_headers(answer);
}

/// The tool's response, as Envoy passes it through: headers, then the
/// BUFFERED body; each answered CONTINUE, the attempt's id not added.
async fn tool_answers(envoy: &mut Envoy, status: u16, body: &[u8]) {
    let answer = envoy.exchange(response_headers(status, false)).await;
    passed_on(&answer);
    let answer = envoy.exchange(response_body(body, true)).await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
}

async fn open_charge(h: &Harness) -> Envoy {
    Envoy::open(h, &[("x-atmost-tool", TOOL)]).await
}

/// A charge of `key` whose headers atmost answered, holding the request
/// for its body (nothing reserved yet).
async fn held_for_body(h: &Harness, permit: &str, key: &str) -> Envoy {
    let mut envoy = open_charge(h).await;
    let answer = envoy
        .exchange(request_headers(
            "POST",
            PATH,
            &charge_headers(permit, key),
            false,
        ))
        .await;
    assert!(continued(&answer).is_empty());
    envoy
}

// === the lifecycle ===

/// Request -> Authorize -> forwarded -> 200 -> Commit Succeeded with the
/// body as the result; the same key on a new stream replays it (200,
/// Idempotent-Replayed) and is never forwarded again.
async fn a_full_cycle_commits_the_result_and_a_retry_replays_it(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 1)], None).await;
    let mut envoy = open_charge(&h).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "order-1"), BODY).await);
    let a = attempt(&h, &permit, "order-1").await;
    // A RESERVED attempt's id (its fencing token) is withheld by GetAttempt;
    // once settled it reads back, the id forwarded.
    assert_eq!(
        (a.attempt_id.as_str(), a.state()),
        ("", AttemptState::Reserved)
    );
    assert_eq!(a.request_fingerprint, fingerprint("POST", PATH, BODY));
    tool_answers(&mut envoy, 200, br#"{"charge":"ch_1"}"#).await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "order-1").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.receipt.unwrap().result, br#"{"charge":"ch_1"}"#);

    let mut retry = open_charge(&h).await;
    let (headers, body) = answered(
        post(&mut retry, &charge_headers(&permit, "order-1"), BODY).await,
        200,
        "REPLAY_SUCCEEDED",
    );
    assert_eq!(body, br#"{"charge":"ch_1"}"#);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["x-atmost-attempt-id"], id);
    assert_eq!(retry.close().await, Code::Ok);
    let usage = h.get(&permit).await.unwrap().usage;
    assert_eq!(usage[0].calls_made, 1, "one dispatch");
}

/// A GET without a body is authorized on its headers, and its 204
/// (headers only) settles it.
async fn a_request_without_a_body_is_authorized_on_its_headers(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut envoy = open_charge(&h).await;
    let answer = envoy
        .exchange(request_headers(
            "GET",
            "/v1/balance",
            &charge_headers(&permit, "get-1"),
            true,
        ))
        .await;
    assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
    let id = continued(&answer)["x-atmost-attempt-id"].clone();
    let answer = envoy.exchange(response_headers(204, true)).await;
    passed_on(&answer);
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "get-1").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id, "the id forwarded upstream");
    assert_eq!(
        a.request_fingerprint,
        fingerprint("GET", "/v1/balance", b"")
    );
    assert!(a.receipt.unwrap().result.is_empty());
}

/// A request with trailers and no body data: the DISPATCH answers the
/// trailers, which cannot set headers, so the attempt's headers a client
/// sent itself (a forged id) would reach the tool unreplaced. They are
/// removed when the request's headers are answered, before anything is
/// forwarded; the tool's echo of them is removed from the response.
async fn attempt_headers_are_never_forged_upstream_nor_echoed_downstream(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut envoy = open_charge(&h).await;
    let mut headers = charge_headers(&permit, "trailed");
    headers.extend([
        ("x-atmost-attempt-id", "forged"),
        ("x-atmost-permit-id", "forged"),
        ("x-atmost-idempotency-key", "forged"),
    ]);
    let answer = envoy
        .exchange(request_headers("POST", PATH, &headers, false))
        .await;
    assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
    assert!(continued(&answer).is_empty(), "held for its body");
    strips_attempt_headers(&answer);
    // No body, then trailers (gRPC-style): Envoy sends the trailers,
    // whose answer is the DISPATCH.
    let trailers = ProcessingRequest {
        request: Some(Message::RequestTrailers(Default::default())),
        ..Default::default()
    };
    let answer = envoy.exchange(trailers).await;
    assert!(
        matches!(answer.response, Some(Answer::RequestTrailers(_))),
        "{answer:?}"
    );
    let id = attempt_id_of(&answer);
    // The tool echoes the attempt's headers: the response removes them.
    let answer = envoy.exchange(response_headers(200, false)).await;
    passed_on(&answer);
    let answer = envoy.exchange(response_body(b"ok", true)).await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "trailed").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id);
}

/// The attempt id in a DISPATCH's dynamic metadata.
#[track_caller]
fn attempt_id_of(answer: &ProcessingResponse) -> String {
    let ns = &answer.dynamic_metadata.as_ref().expect("metadata").fields["atmost"];
    match &ns.kind {
        Some(V::StructValue(s)) => match &s.fields["attempt_id"].kind {
            Some(V::StringValue(v)) => v.clone(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

/// A status in the failed set (4xx by default): Commit Failed, and the
/// key is not sent again (409).
async fn a_refusing_tool_fails_the_attempt(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut envoy = open_charge(&h).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "declined"), BODY).await);
    tool_answers(&mut envoy, 402, br#"{"error":"card_declined"}"#).await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "declined").await;
    assert_eq!(a.state(), AttemptState::Failed);
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.failure_reason, "the tool answered HTTP 402");

    let mut retry = open_charge(&h).await;
    answered(
        post(&mut retry, &charge_headers(&permit, "declined"), BODY).await,
        409,
        "REPLAY_FAILED",
    );
}

/// Any other status (a 5xx: the tool may have acted): MarkUncertain. The
/// slot stays held: a new key past the cap is 429, the key itself 409.
async fn a_5xx_leaves_the_attempt_uncertain(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 1)], None).await;
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "flaky"), BODY).await);
    tool_answers(&mut envoy, 503, b"upstream connect error").await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "flaky").await;
    assert_eq!(a.state(), AttemptState::Uncertain);
    assert_eq!(a.uncertain_reason, "the tool answered HTTP 503");

    let mut other = open_charge(&h).await;
    answered(
        post(&mut other, &charge_headers(&permit, "flaky-2"), BODY).await,
        429,
        "PERMIT_MAX_CALLS_EXCEEDED",
    );
    let mut same = open_charge(&h).await;
    answered(
        post(&mut same, &charge_headers(&permit, "flaky"), BODY).await,
        409,
        "REPLAY_UNCERTAIN",
    );
}

/// Forwarded, and no response ever: the client reset (Envoy resets the
/// stream), Envoy closed the stream, or the response ended between its
/// status and its body. Each is MarkUncertain: the call may have acted.
async fn a_lost_response_is_marked_uncertain(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "reset"), BODY).await);
    envoy.reset().await;
    let a = until_state(&h, &permit, "reset", AttemptState::Uncertain).await;
    assert_eq!(
        a.uncertain_reason,
        "the gateway's stream ended after the request was forwarded, before its response"
    );

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "closed"), BODY).await);
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "closed").await;
    assert_eq!(a.state(), AttemptState::Uncertain);

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "half"), BODY).await);
    let answer = envoy.exchange(response_headers(200, false)).await;
    passed_on(&answer);
    envoy.reset().await;
    let a = until_state(&h, &permit, "half", AttemptState::Uncertain).await;
    assert_eq!(
        a.uncertain_reason,
        "the gateway's stream ended after the tool's HTTP 200, before its body"
    );

    // A response body past --max-request-bytes (128 KiB): atmost cannot
    // read it, the stream fails (Envoy fails the request), and the call,
    // which reached the tool, is UNCERTAIN.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "huge"), BODY).await);
    let answer = envoy.exchange(response_headers(200, false)).await;
    passed_on(&answer);
    envoy.send(response_body(&vec![b'x'; 200 * 1024], true), false);
    envoy.ended_too_large().await;
    until_state(&h, &permit, "huge", AttemptState::Uncertain).await;

    // Response headers without a status: nothing is known, the stream
    // fails, and the attempt is UNCERTAIN.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "nostatus"), BODY).await);
    envoy.send(
        ProcessingRequest {
            request: Some(Message::ResponseHeaders(HttpHeaders::default())),
            ..Default::default()
        },
        false,
    );
    assert_eq!(envoy.ended().await, Code::InvalidArgument);
    assert_eq!(
        attempt(&h, &permit, "nostatus").await.state(),
        AttemptState::Uncertain
    );
}

/// The stream ends before atmost's DISPATCH reaches Envoy (Envoy closes it
/// with the body: its message timeout fired, or the client left): the
/// request was never forwarded, so Commit NotSent returns the slot, and
/// the same key dispatches afresh.
async fn a_stream_ended_before_the_answer_is_not_sent(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 1)], None).await;
    let mut envoy = held_for_body(&h, &permit, "gone").await;
    // The body, and the end of Envoy's side, in one frame. The stream
    // ends with an error, never cleanly: Envoy takes a clean end as "go
    // on", and this request was never authorized.
    envoy.send(request_body(BODY), true);
    assert_eq!(envoy.ended().await, Code::Aborted);
    let a = attempt(&h, &permit, "gone").await;
    assert_eq!(a.state(), AttemptState::Released);
    assert_eq!(h.get(&permit).await.unwrap().usage[0].calls_made, 0);

    let mut again = open_charge(&h).await;
    let id = forwarded(post(&mut again, &charge_headers(&permit, "gone"), BODY).await);
    assert_ne!(id, a.attempt_id, "a new attempt");
}

/// A message atmost cannot read (past --max-request-bytes, 128 KiB) arrives
/// while the Authorize it answers runs (here in the same frame as the body
/// it authorizes): the stream fails with that error, never ends cleanly
/// (Envoy would take that as "go on" and forward a request atmost never
/// answered), no CONTINUE is sent, and the DISPATCH is given back with
/// NotSent: the key is free and the slot back.
async fn a_read_error_while_the_store_decides_fails_the_stream(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 1)], None).await;
    let mut envoy = held_for_body(&h, &permit, "broken").await;
    envoy.send_together(vec![
        request_body(BODY),
        request_body(&vec![b'x'; 200 * 1024]),
    ]);
    // ended(): no answer at all before the end, so no CONTINUE.
    envoy.ended_too_large().await;
    let a = until_state(&h, &permit, "broken", AttemptState::Released).await;
    assert_eq!(h.get(&permit).await.unwrap().usage[0].calls_made, 0);

    let mut again = open_charge(&h).await;
    let id = forwarded(post(&mut again, &charge_headers(&permit, "broken"), BODY).await);
    assert_ne!(id, a.attempt_id, "a new attempt");
}

/// Refusals through ext_proc: the request is answered, never forwarded.
async fn refusals_answer_instead_of_forwarding(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut first = open_charge(&h).await;
    forwarded(post(&mut first, &charge_headers(&permit, "busy"), BODY).await);

    let mut second = open_charge(&h).await;
    let (headers, _) = answered(
        post(&mut second, &charge_headers(&permit, "busy"), BODY).await,
        409,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    assert!(headers["retry-after"].parse::<u64>().unwrap() >= 1);
    assert_eq!(second.close().await, Code::Ok);

    let mut third = open_charge(&h).await;
    answered(
        post(
            &mut third,
            &charge_headers(&permit, "busy"),
            b"{\"amount\":1}",
        )
        .await,
        422,
        "IDEMPOTENCY_KEY_REUSED",
    );
    let mut fourth = open_charge(&h).await;
    let (_, body) = answered(
        post(&mut fourth, &[("x-atmost-permit", &permit)], BODY).await,
        400,
        "INVALID_REQUEST",
    );
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["violations"][0]["field"], "header idempotency-key");

    // The refused streams changed nothing: the first is still in flight.
    assert_eq!(
        attempt(&h, &permit, "busy").await.state(),
        AttemptState::Reserved
    );
}

/// The route table matches a path in its one plain form only, on ext_proc
/// too: each path an upstream may run as the capture while its bytes fit
/// the catch-all is answered 400 with what is wrong, with a body to come
/// or none, reserving nothing; a plain path still maps to the capture.
async fn a_path_the_route_table_could_misread_is_refused(kind: Kind) {
    let h = Harness::start_configured(kind, |app| app.with_envoy(Some(mapping(super::STEERABLE))))
        .await;
    let permit = super::steerable_permit(&h).await;
    // Every path is tried, with its body and with none, and each one not
    // refused is named.
    let mut steered = Vec::new();
    for (n, (path, says)) in super::STEERING_PATHS.iter().enumerate() {
        // No x-atmost-tool: the route leaves the tool to the table.
        let key = format!("steer-{n}");
        let mut envoy = Envoy::open(&h, &[]).await;
        match post_to(&mut envoy, path, &charge_headers(&permit, &key), BODY).await {
            Sent::Answered(400, headers, body)
                if headers["x-atmost-reason"] == "PATH_NOT_CANONICAL" =>
            {
                super::refused_path(&serde_json::from_slice(&body).unwrap(), path, says);
                assert_eq!(envoy.close().await, Code::Ok);
            }
            other => steered.push(format!("{path}: {other:?}")),
        }
        let key = format!("steer-{n}-headers");
        let mut envoy = Envoy::open(&h, &[]).await;
        let answer = envoy
            .exchange(request_headers(
                "POST",
                path,
                &charge_headers(&permit, &key),
                true,
            ))
            .await;
        match &answer.response {
            Some(Answer::ImmediateResponse(_)) => {
                let (status, headers, body) = immediate(&answer);
                assert_eq!(
                    (status, headers["x-atmost-reason"].as_str()),
                    (400, "PATH_NOT_CANONICAL"),
                    "{path}"
                );
                super::refused_path(&serde_json::from_slice(&body).unwrap(), path, says);
                assert_eq!(envoy.close().await, Code::Ok);
            }
            Some(Answer::RequestHeaders(_)) => steered.push(format!(
                "{path} without a body: forwarded with {:?}",
                continued(&answer)
            )),
            other => steered.push(format!("{path} without a body: {other:?}")),
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
    let mut envoy = Envoy::open(&h, &[]).await;
    forwarded(
        post_to(
            &mut envoy,
            "/v1/charges/abc/capture?expand=balance",
            &charge_headers(&permit, "capture"),
            BODY,
        )
        .await,
    );
    let a = attempt(&h, &permit, "capture").await;
    assert_eq!((a.tool.as_str(), a.cost), ("wallet.capture", 1000));
    assert_eq!(
        super::usage(&h, &permit).await,
        (
            vec![("wallet.capture".into(), 1), ("wallet.read".into(), 0)],
            1000
        )
    );
}

/// What Envoy's configuration must give, refused before anything is
/// reserved: a body fingerprint without the BUFFERED body mode (or an
/// Envoy that does not say), observability mode, a request whose headers
/// were not sent.
async fn an_envoy_configuration_that_cannot_gate_is_refused(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;

    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], None).await;
    let (_, body) = answered(
        post(&mut envoy, &charge_headers(&permit, "m-1"), BODY).await,
        500,
        "GATEWAY_MISCONFIGURED",
    );
    assert!(String::from_utf8_lossy(&body).contains("request_body_mode"));
    let streamed = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Streamed as i32,
        ..Default::default()
    });
    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], streamed).await;
    answered(
        post(&mut envoy, &charge_headers(&permit, "m-1"), BODY).await,
        500,
        "GATEWAY_MISCONFIGURED",
    );

    let mut envoy = open_charge(&h).await;
    let mut observed = request_headers("POST", PATH, &charge_headers(&permit, "m-1"), false);
    observed.observability_mode = true;
    envoy.send(observed, false);
    assert_eq!(envoy.ended().await, Code::FailedPrecondition);

    // request_header_mode SKIP: the body comes first, and the request is
    // refused before it is forwarded. (Its response, arriving first, is
    // an unauthorized forward: a_response_to_a_request_never_authorized_
    // is_logged_and_counted.)
    let mut envoy = open_charge(&h).await;
    envoy.send(request_body(BODY), false);
    assert_eq!(envoy.ended().await, Code::InvalidArgument);

    // A request body past --max-request-bytes: the stream fails, never
    // ends cleanly (Envoy would then forward without atmost's answer).
    let mut envoy = held_for_body(&h, &permit, "m-1").await;
    envoy.send(request_body(&vec![b'x'; 200 * 1024]), false);
    envoy.ended_too_large().await;

    expect_error(
        h.client.get_attempt(&permit, "m-1").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
}

/// The result as the mapping asks: a digest; the body streamed in chunks;
/// a body over 64 KiB stored as its digest.
async fn results_follow_the_mapping(kind: Kind) {
    use sha2::{Digest, Sha256};
    let hex = |b: &[u8]| -> String {
        Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    };
    let h = Harness::start_configured(kind, |app| {
        app.with_envoy(Some(mapping("[response]\nresult = \"digest\"\n")))
    })
    .await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut envoy = open_charge(&h).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "d-1"), BODY).await);
    tool_answers(&mut envoy, 201, b"secret result").await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "d-1").await;
    assert_eq!(a.attempt_id, id);
    assert_eq!(
        a.receipt.unwrap().result,
        format!("sha256:{}", hex(b"secret result")).into_bytes()
    );

    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let streamed = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::Streamed as i32,
        ..Default::default()
    });
    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], streamed).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "s-1"), BODY).await);
    let answer = envoy.exchange(response_headers(200, false)).await;
    passed_on(&answer);
    for (chunk, end) in [(&b"part one, "[..], false), (b"part two", true)] {
        let answer = envoy.exchange(response_body(chunk, end)).await;
        assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    }
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "s-1").await;
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.receipt.unwrap().result, b"part one, part two");

    let big = vec![b'x'; 70 * 1024];
    let mut envoy = open_charge(&h).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "big"), BODY).await);
    tool_answers(&mut envoy, 200, &big).await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "big").await;
    assert_eq!(a.attempt_id, id);
    assert_eq!(
        a.receipt.unwrap().result,
        format!("sha256:{}", hex(&big)).into_bytes()
    );
}

/// `response_body_mode: BUFFERED_PARTIAL`: Envoy sends the body in one
/// message, whole if it fits its buffer (end_of_stream), else only its
/// first part, the rest passing by unseen. A whole body is the result; of
/// a part no body or digest can be made, so the result is the status
/// alone (never an empty body passed off as the result).
async fn a_buffered_partial_body_is_the_result_only_when_whole(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let partial = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::BufferedPartial as i32,
        ..Default::default()
    });
    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], partial).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "p-whole"), BODY).await);
    passed_on(&envoy.exchange(response_headers(200, false)).await);
    let answer = envoy.exchange(response_body(b"all of it", true)).await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "p-whole").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.receipt.unwrap().result, b"all of it");

    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], partial).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "p-part"), BODY).await);
    passed_on(&envoy.exchange(response_headers(200, false)).await);
    let answer = envoy
        .exchange(response_body(b"the first part", false))
        .await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "p-part").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.receipt.unwrap().result, b"HTTP 200");
}

/// Response trailers after the body. STREAMED: Envoy sends every chunk
/// without end_of_stream, then the trailers (`response_trailer_mode:
/// SEND`), which complete the body; under SKIP it sends nothing more and
/// closes, as it does when the tool or Envoy gave up midway: the result is
/// not known, so the attempt is UNCERTAIN, its reason naming the setting.
/// BUFFERED_PARTIAL sends a body that fits ahead of trailers without
/// end_of_stream, as it sends a part of a larger one (then the trailers
/// too): the status alone.
async fn a_response_body_followed_by_trailers_is_settled(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mode = |response: BodySendMode| {
        Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: response as i32,
            ..Default::default()
        })
    };
    let trailers = || ProcessingRequest {
        request: Some(Message::ResponseTrailers(Default::default())),
        ..Default::default()
    };
    for (key, response, send_trailers, result) in [
        (
            "streamed-send",
            BodySendMode::Streamed,
            true,
            Some(&b"part one, part two"[..]),
        ),
        ("streamed-skip", BodySendMode::Streamed, false, None),
        (
            "partial-send",
            BodySendMode::BufferedPartial,
            true,
            Some(&b"HTTP 200"[..]),
        ),
    ] {
        let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], mode(response)).await;
        forwarded(post(&mut envoy, &charge_headers(&permit, key), BODY).await);
        passed_on(&envoy.exchange(response_headers(200, false)).await);
        let chunks: &[&[u8]] = match response {
            BodySendMode::Streamed => &[b"part one, ", b"part two"],
            _ => &[b"part one, part two"],
        };
        for chunk in chunks {
            let answer = envoy.exchange(response_body(chunk, false)).await;
            assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
        }
        if send_trailers {
            let answer = envoy.exchange(trailers()).await;
            match &answer.response {
                // Nothing of the open attempt reaches the client in them.
                Some(Answer::ResponseTrailers(t)) => {
                    let mut removed = t.header_mutation.clone().unwrap().remove_headers;
                    removed.sort();
                    assert_eq!(
                        removed,
                        [
                            "x-atmost-attempt-id",
                            "x-atmost-idempotency-key",
                            "x-atmost-permit-id"
                        ],
                        "{key}"
                    );
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        assert_eq!(envoy.close().await, Code::Ok, "{key}");
        match result {
            Some(result) => {
                let a = until_state(&h, &permit, key, AttemptState::Succeeded).await;
                assert_eq!(a.receipt.unwrap().result, result, "{key}");
            }
            None => {
                let a = until_state(&h, &permit, key, AttemptState::Uncertain).await;
                assert!(
                    a.uncertain_reason.contains("response_trailer_mode: SEND"),
                    "{key}: {}",
                    a.uncertain_reason
                );
            }
        }
    }
}

// === the slow store ===

/// A charge of `key` whose Authorize is held at Redis (its replies held
/// at a proxy), the request headers answered and the body sent: the
/// store is deciding.
struct Held {
    h: Harness,
    permit: String,
    envoy: Envoy,
    proxy: proxy::Proxy,
    _redis: Redis,
}

async fn held_at_redis(key: &str) -> Held {
    let redis = Redis::start();
    let proxy = proxy::Proxy::for_redis(&redis.url).await;
    let store = redis_store(
        &proxy.url(),
        &redis.prefix,
        std::time::Duration::from_secs(30),
    );
    let h = Harness::serve(atmost::store::Backend::Redis(store), None, |app| app).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 1)], None).await;
    let mut envoy = held_for_body(&h, &permit, key).await;
    proxy.set_mode(proxy::HOLD);
    envoy.send(request_body(BODY), false);
    assert!(
        proxy
            .wait_count(key, 1, std::time::Duration::from_secs(15))
            .await,
        "the Authorize reached Redis"
    );
    Held {
        h,
        permit,
        envoy,
        proxy,
        _redis: redis,
    }
}

/// Redis slow to answer the Authorize (replies held at a proxy), and Envoy
/// resets the stream meanwhile (its message timeout, the client gone):
/// when the DISPATCH comes, nobody will forward it, so it is given back
/// with NotSent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_while_the_store_decides_is_not_sent() {
    let _machine = shared().await;
    let Held {
        h,
        permit,
        envoy,
        proxy,
        _redis,
    } = held_at_redis("slow").await;
    envoy.reset().await;
    proxy.set_mode(proxy::Mode::Pass);
    let a = until_state(&h, &permit, "slow", AttemptState::Released).await;
    assert!(!a.attempt_id.is_empty());
    assert_eq!(h.get(&permit).await.unwrap().usage[0].calls_made, 0);
}

/// The same through a slow store: the Authorize is held at Redis, and
/// the message atmost cannot read arrives meanwhile. When the DISPATCH
/// comes, the stream fails with the read's error (never a clean end, no
/// CONTINUE) and the DISPATCH is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_error_while_redis_holds_the_authorize_fails_the_stream() {
    let _machine = shared().await;
    let Held {
        h,
        permit,
        mut envoy,
        proxy,
        _redis,
    } = held_at_redis("held").await;
    envoy.send(request_body(&vec![b'x'; 200 * 1024]), false);
    // The oversized message's length prefix is at the server before Redis
    // answers: the stream is watched first when the DISPATCH comes.
    envoy.delivered().await;
    proxy.set_mode(proxy::Mode::Pass);
    envoy.ended_too_large().await;
    let a = until_state(&h, &permit, "held", AttemptState::Released).await;
    assert!(!a.attempt_id.is_empty());
    assert_eq!(h.get(&permit).await.unwrap().usage[0].calls_made, 0);
}

/// Redis refuses writes for a moment (maxmemory reached under
/// `noeviction`: every write is refused whole, before it runs) just as
/// the tool's 200 comes back: the Commit is refused, asked again, and
/// recorded once Redis takes writes again, instead of being dropped (the
/// attempt would have turned UNCERTAIN at its lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_refuses_for_a_moment_is_asked_again() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "noeviction"]);
    let proxy = proxy::Proxy::for_redis(&redis.url).await;
    let store = redis_store(
        &proxy.url(),
        &redis.prefix,
        std::time::Duration::from_secs(2),
    );
    let h = Harness::serve(atmost::store::Backend::Redis(store), Some(redis), |app| app).await;
    let mut conn = h.redis.as_ref().expect("redis").connect().await;
    let maxmemory = |bytes: u64| {
        ::redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .clone()
    };
    let permit = h.create_with(&[TOOL], &[(TOOL, 2)], None).await;
    // A whole cycle first, so that Redis has every script: each try of
    // the Commit below is then one command.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "warm"), BODY).await);
    tool_answers(&mut envoy, 200, b"warm").await;
    assert_eq!(envoy.close().await, Code::Ok);

    let mut envoy = open_charge(&h).await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "blip"), BODY).await);
    let _: () = maxmemory(1)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET maxmemory");
    let before = proxy.count("blip");
    tool_answers(&mut envoy, 200, br#"{"charge":"ch_2"}"#).await;
    assert!(
        proxy
            .wait_count("blip", before + 2, std::time::Duration::from_secs(15))
            .await,
        "the refused Commit was asked again: {:?}",
        proxy.commands()
    );
    let _: () = maxmemory(0)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET maxmemory");
    // The stream ends once the outcome is recorded.
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "blip").await;
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.receipt.unwrap().result, br#"{"charge":"ch_2"}"#);
}

/// A process of the real binary, killed if a test fails before it ends.
struct Running(Option<std::process::Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The real binary on `redis`, with this --shutdown-grace, its log (error
/// level) written to a file: the process, its address, the log's path.
fn spawn_logged(redis: &Redis, grace: &str) -> (Running, std::net::SocketAddr, std::path::PathBuf) {
    use std::io::BufRead;
    let log = std::env::temp_dir().join(format!(
        "atmost-ext-proc-shutdown-{}.log",
        uuid::Uuid::now_v7().simple()
    ));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", "redis"])
        .args(["--redis-url", &redis.url, "--redis-prefix", &redis.prefix])
        .args(["--store-timeout", "2s", "--shutdown-grace", grace])
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("the log file"))
        .spawn()
        .expect("start atmost");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    stdout.read_line(&mut line).expect("its first line");
    let addr = line
        .trim()
        .strip_prefix("atmost listening on ")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("atmost did not start: {line:?}"));
    (Running(Some(child)), addr, log)
}

/// A permit for [`TOOL`] created through the server at `addr`, and a
/// whole cycle through it (so that Redis has every script).
async fn permit_at(addr: std::net::SocketAddr) -> (Client, String) {
    let client = Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let permit = client
        .create_permit(
            NewPermit::new([TOOL])
                .subject("agent-test")
                .currency("EUR")
                .expires_at_ms(now_ms + 3_600_000)
                .build(),
        )
        .await
        .expect("create permit")
        .permit_id;
    let mut envoy = Envoy::open_at(addr, &[("x-atmost-tool", TOOL)], buffered()).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "warm"), BODY).await);
    tool_answers(&mut envoy, 200, b"warm").await;
    assert_eq!(envoy.close().await, Code::Ok);
    (client, permit)
}

async fn set_maxmemory(redis: &Redis, bytes: u64) {
    let mut conn = redis.connect().await;
    let _: () = ::redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(bytes)
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET maxmemory");
}

/// Forwards a request for `key`, and the tool's 200 comes back while Redis
/// refuses writes: its Commit is being asked again. Envoy is then done
/// with the stream (it resets it). The attempt id.
async fn a_commit_refused_for_now(
    addr: std::net::SocketAddr,
    redis: &Redis,
    permit: &str,
    key: &str,
) -> String {
    let mut envoy = Envoy::open_at(addr, &[("x-atmost-tool", TOOL)], buffered()).await;
    let id = forwarded(post(&mut envoy, &charge_headers(permit, key), BODY).await);
    set_maxmemory(redis, 1).await;
    tool_answers(&mut envoy, 200, key.as_bytes()).await;
    envoy.reset().await;
    id
}

/// Sends SIGTERM.
fn sigterm(running: &Running) {
    let child = running.0.as_ref().expect("running");
    let term = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
}

/// Waits for the exit (a hang guard, not a timing assertion); the log's
/// text.
async fn exited(mut running: Running, log: &std::path::Path) -> String {
    let mut child = running.0.take().expect("running");
    tokio::time::timeout(PATIENCE, tokio::task::spawn_blocking(move || child.wait()))
        .await
        .expect("atmost exited within the patience")
        .expect("wait")
        .expect("its exit status");
    let text = std::fs::read_to_string(log).expect("the log");
    let _ = std::fs::remove_file(log);
    text
}

/// SIGTERM to the real binary while an outcome is being asked again
/// (Redis refuses writes: maxmemory under `noeviction`) and still is when
/// --shutdown-grace runs out: the shutdown names the outcome it abandons
/// in an error line, instead of the runtime dropping it silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_names_each_outcome_it_abandons() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "noeviction"]);
    let (child, addr, log) = spawn_logged(&redis, "1s");
    let (_client, permit) = permit_at(addr).await;
    let id = a_commit_refused_for_now(addr, &redis, &permit, "late").await;
    sigterm(&child);
    let text = exited(child, &log).await;
    let abandoned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("abandoned") && l.contains(&id))
        .collect();
    assert_eq!(abandoned.len(), 1, "one line names the attempt: {text}");
    assert!(
        abandoned[0].contains("Succeeded") && abandoned[0].contains(&permit),
        "{}",
        abandoned[0]
    );
    // Its stream is the one named: none is counted as waiting unnamed.
    assert!(!text.contains("streams still open"), "{text}");
}

/// The same, but Redis takes writes again during the grace: the shutdown
/// waits for the outcome, which is recorded (read back through a second
/// process on the same Redis), and abandons nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_waits_for_an_outcome_being_recorded() {
    let _machine = shared().await;
    let redis = Redis::start_owned_with(&["--maxmemory-policy", "noeviction"]);
    let (child, addr, log) = spawn_logged(&redis, "60s");
    let (_client, permit) = permit_at(addr).await;
    let id = a_commit_refused_for_now(addr, &redis, &permit, "in-time").await;
    sigterm(&child);
    set_maxmemory(&redis, 0).await;
    let text = exited(child, &log).await;
    assert!(!text.contains("abandoned"), "{text}");
    let (again, addr, log) = spawn_logged(&redis, "1s");
    let client = Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let a = client
        .get_attempt(&permit, "in-time")
        .await
        .expect("GetAttempt")
        .attempt
        .expect("the attempt");
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.receipt.unwrap().result, b"in-time");
    drop(again);
    let _ = std::fs::remove_file(&log);
}

// === keys ===

/// The gateway authenticates with its key in the stream's initial
/// metadata (grpc_service initial_metadata); without one, the stream is
/// refused before anything is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_key_opens_the_stream() {
    use crate::auth::{KeyFile, entry};
    let _machine = shared().await;
    let keys = KeyFile::new(
        &[
            entry("admin-1", "admin-key-0123456789", "acme", "\"admin\""),
            entry("gateway-1", "gateway-key-0123456789", "acme", "\"agent\""),
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
    let permit = admin
        .create_permit(h.permit(&[TOOL]))
        .await
        .unwrap()
        .permit_id;

    let refused = Envoy::open(&h, &[("x-atmost-tool", TOOL)]).await;
    assert_eq!(
        refused.status.map(|s| s.code()),
        Some(Code::Unauthenticated)
    );

    let mut envoy = Envoy::open(
        &h,
        &[
            ("x-atmost-tool", TOOL),
            ("authorization", "Bearer gateway-key-0123456789"),
        ],
    )
    .await;
    let id = forwarded(post(&mut envoy, &charge_headers(&permit, "keyed"), BODY).await);
    tool_answers(&mut envoy, 200, b"ok").await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = admin
        .get_attempt(&permit, "keyed")
        .await
        .unwrap()
        .attempt
        .unwrap();
    assert_eq!(a.state(), AttemptState::Succeeded);
    assert_eq!(a.attempt_id, id);
}

// === requests and responses atmost must not miss ===

/// Headers without END_STREAM, then trailers with it, no DATA (a body-less
/// request with trailers): Envoy sends the request headers
/// (end_of_stream false), atmost holds them for the body (nothing set,
/// nothing reserved), and, with `request_trailer_mode: SEND`, the
/// trailers, which complete an empty body: their answer is the one
/// DISPATCH. The tool's 200 then settles it.
async fn a_request_of_headers_then_trailers_is_authorized_once(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[(TOOL, 2)], None).await;
    let mut envoy = open_charge(&h).await;
    let answer = envoy
        .exchange(request_headers(
            "POST",
            PATH,
            &charge_headers(&permit, "trailed-only"),
            false,
        ))
        .await;
    assert!(matches!(answer.response, Some(Answer::RequestHeaders(_))));
    assert!(continued(&answer).is_empty(), "held: no attempt yet");
    assert!(answer.dynamic_metadata.is_none(), "held: no attempt yet");
    // Where Envoy allows it, the trailers are asked for, whatever
    // request_trailer_mode says.
    asks_for_trailers(&answer, buffered());
    expect_error(
        h.client.get_attempt(&permit, "trailed-only").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    let answer = envoy.exchange(request_trailers()).await;
    assert!(
        matches!(answer.response, Some(Answer::RequestTrailers(_))),
        "{answer:?}"
    );
    let id = attempt_id_of(&answer);
    let a = attempt(&h, &permit, "trailed-only").await;
    assert_eq!(a.state(), AttemptState::Reserved);
    assert_eq!(a.request_fingerprint, fingerprint("POST", PATH, b""));
    assert_eq!(super::usage(&h, &permit).await.0, [(TOOL.to_owned(), 1)]);
    tool_answers(&mut envoy, 200, b"ok").await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = attempt(&h, &permit, "trailed-only").await;
    assert_eq!(
        (a.state(), a.attempt_id.as_str()),
        (AttemptState::Succeeded, id.as_str())
    );
    assert_eq!(
        super::usage(&h, &permit).await.0,
        [(TOOL.to_owned(), 1)],
        "one dispatch"
    );
}

/// The same request under `request_trailer_mode: SKIP` (or any request
/// under `request_header_mode: SKIP`): Envoy forwards it without a word to
/// atmost, which learns of it only when the tool's response arrives while
/// it still awaits the request. Nothing was reserved: it is counted in
/// `atmost_envoy_unauthorized_forwards_total` and logged with the route and
/// the status, and the answer goes on to the client, its attempt headers
/// removed, never a 500 for a call that may have run. While the body was
/// awaited it is an error, "possibly" forwarded (Envoy's own 413 for a
/// body past its buffer reads the same, and is named so); before the
/// request's headers a warning: most often an earlier filter's local reply
/// (a jwt_authn 401), for a request atmost never saw. The real binary, on
/// each store, read through its log and its /metrics.
async fn a_response_to_a_request_never_authorized_is_logged_and_counted(kind: Kind) {
    let redis = (kind == Kind::Redis).then(Redis::start);
    let mut args = redis.as_ref().map(Redis::serve_args).unwrap_or_default();
    args.extend(["--metrics-listen".to_owned(), "127.0.0.1:0".to_owned()]);
    let log = std::env::temp_dir().join(format!(
        "atmost-ext-proc-unauthorized-{}.log",
        uuid::Uuid::now_v7().simple()
    ));
    let server = AtmostProcess::spawn_logged(
        std::path::Path::new(env!("CARGO_BIN_EXE_atmost")),
        &args,
        // Plain text, so that a field reads `status=401`.
        &[("RUST_LOG", "warn"), ("NO_COLOR", "1")],
        &log,
    )
    .expect("start atmost");
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let client = server.client().await;
    let permit = client
        .create_permit(
            NewPermit::new([TOOL])
                .expires_at_ms(atmost_client::now_ms() + 3_600_000)
                .build(),
        )
        .await
        .expect("create permit")
        .permit_id;

    // Held for a body that never comes; the trailers skipped.
    let mut envoy = Envoy::open_at(server.addr(), &[("x-atmost-tool", TOOL)], buffered()).await;
    let answer = envoy
        .exchange(request_headers(
            "POST",
            PATH,
            &charge_headers(&permit, "unseen"),
            false,
        ))
        .await;
    assert!(continued(&answer).is_empty(), "held for its body");
    let answer = envoy.exchange(response_headers(200, false)).await;
    assert!(
        matches!(answer.response, Some(Answer::ResponseHeaders(_))),
        "{answer:?}"
    );
    passed_on(&answer);
    let answer = envoy.exchange(response_body(b"charged", true)).await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    assert_eq!(envoy.close().await, Code::Ok);

    // Held for its body, which outgrew Envoy's buffer: Envoy's own 413.
    let mut envoy = Envoy::open_at(server.addr(), &[("x-atmost-tool", TOOL)], buffered()).await;
    let answer = envoy
        .exchange(request_headers(
            "POST",
            PATH,
            &charge_headers(&permit, "too-large"),
            false,
        ))
        .await;
    assert!(continued(&answer).is_empty(), "held for its body");
    passed_on(&envoy.exchange(response_headers(413, true)).await);
    assert_eq!(envoy.close().await, Code::Ok);

    // No request headers at all: an earlier filter's local reply (a
    // jwt_authn 401), or request_header_mode: SKIP.
    let mut envoy = Envoy::open_at(server.addr(), &[("x-atmost-tool", TOOL)], buffered()).await;
    let answer = envoy.exchange(response_headers(401, true)).await;
    passed_on(&answer);
    assert_eq!(envoy.close().await, Code::Ok);

    for key in ["unseen", "too-large"] {
        expect_error(
            client.get_attempt(&permit, key).await,
            Code::NotFound,
            "ATTEMPT_NOT_FOUND",
        );
    }
    let samples = crate::telemetry::scrape(metrics).await;
    for (awaiting, count) in [("request_body", 2.0), ("request_headers", 1.0)] {
        let series = format!("atmost_envoy_unauthorized_forwards_total{{awaiting=\"{awaiting}\"}}");
        assert_eq!(samples.get(&series), Some(&count), "{series}: {samples:#?}");
    }
    drop(server);
    let text = std::fs::read_to_string(&log).expect("the log");
    let _ = std::fs::remove_file(&log);
    let possibly: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("an unauthorized forward, possibly"))
        .collect();
    assert_eq!(possibly.len(), 2, "{text}");
    for (line, status) in possibly.iter().zip(["200", "413"]) {
        assert!(
            line.contains("ERROR")
                && line.contains("request_body")
                && line.contains(&format!("status={status}"))
                && line.contains("POST")
                && line.contains(PATH)
                && line.contains(TOOL),
            "the route and the status: {line}"
        );
    }
    assert!(
        possibly[1].contains("Envoy's own answer to a body past its buffer (413)"),
        "{}",
        possibly[1]
    );
    let never_saw: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("a response to a request atmost never saw"))
        .collect();
    assert_eq!(never_saw.len(), 1, "{text}");
    assert!(
        never_saw[0].contains("WARN")
            && never_saw[0].contains("request_headers")
            && never_saw[0].contains("status=401")
            && never_saw[0].contains(TOOL),
        "{}",
        never_saw[0]
    );
}

/// One stream carries one request. Request headers on a stream whose
/// request was decided (settled, or refused) are never CONTINUEd without
/// an Authorize: the stream fails (Envoy then fails the request), nothing
/// is reserved.
async fn a_second_request_on_a_finished_stream_is_refused(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "first"), BODY).await);
    tool_answers(&mut envoy, 200, b"ok").await;
    envoy.send(
        request_headers("POST", PATH, &charge_headers(&permit, "second"), true),
        false,
    );
    assert_eq!(envoy.ended().await, Code::InvalidArgument);

    // After a refusal (the key in flight on another stream).
    let mut other = open_charge(&h).await;
    forwarded(post(&mut other, &charge_headers(&permit, "busy"), BODY).await);
    let mut envoy = open_charge(&h).await;
    answered(
        post(&mut envoy, &charge_headers(&permit, "busy"), BODY).await,
        409,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    envoy.send(
        request_headers(
            "GET",
            "/v1/balance",
            &charge_headers(&permit, "third"),
            true,
        ),
        false,
    );
    assert_eq!(envoy.ended().await, Code::InvalidArgument);

    for key in ["second", "third"] {
        expect_error(
            h.client.get_attempt(&permit, key).await,
            Code::NotFound,
            "ATTEMPT_NOT_FOUND",
        );
    }
    // The stream's error goes out before its end waits for the Commit,
    // which is recorded beside it: waited for, not read at once.
    until_state(&h, &permit, "first", AttemptState::Succeeded).await;
    assert_eq!(super::usage(&h, &permit).await.0, [(TOOL.to_owned(), 2)]);
}

/// A gRPC tool answers HTTP 200 whatever the call's outcome: its
/// grpc-status decides, read from a trailers-only response's headers, or
/// from the response's trailers (`response_trailer_mode: SEND`). 0 is
/// Succeeded (the body the result), a code that means refused before
/// acting Failed (the code, its name and grpc-message in the reason), a
/// code that means the call may have acted as a 5xx (UNCERTAIN by
/// default), none by the stream's end UNCERTAIN.
async fn a_grpc_response_is_settled_by_its_grpc_status(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let grpc = |content_type| [("content-type", content_type)];
    let trailers_passed = |answer: &ProcessingResponse| match &answer.response {
        Some(Answer::ResponseTrailers(t)) => {
            let removed = t.header_mutation.clone().unwrap_or_default().remove_headers;
            for header in ATTEMPT_HEADERS {
                assert!(removed.iter().any(|r| r == header), "{header}: {removed:?}");
            }
        }
        other => panic!("expected the trailers passed on, got {other:?}"),
    };

    // Trailers-only: the status in the headers, the stream's end with them.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-only"), BODY).await);
    let mut headers = grpc("application/grpc-web+proto").to_vec();
    headers.extend([("grpc-status", "5"), ("grpc-message", "no%20such%20charge")]);
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &headers, true))
            .await,
    );
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-only", AttemptState::Failed).await;
    assert_eq!(
        a.failure_reason,
        "the tool answered gRPC status 5 (NOT_FOUND): no such charge"
    );

    // A code that means the call may have acted goes the way of a 5xx
    // (the route's `otherwise`, UNCERTAIN by default): here Envoy's own
    // local reply to a gRPC request after DISPATCH, an upstream timeout
    // (504) mapped to 14 UNAVAILABLE, trailers-only; and 4
    // DEADLINE_EXCEEDED in the trailers. A code that means refused before
    // acting, 9 FAILED_PRECONDITION, is Failed, trailers-only too.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-unavailable"), BODY).await);
    let mut headers = grpc("application/grpc").to_vec();
    headers.extend([
        ("grpc-status", "14"),
        ("grpc-message", "upstream%20request%20timeout"),
    ]);
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &headers, true))
            .await,
    );
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-unavailable", AttemptState::Uncertain).await;
    assert_eq!(
        a.uncertain_reason,
        "the tool answered gRPC status 14 (UNAVAILABLE): upstream request timeout"
    );

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-deadline"), BODY).await);
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &grpc("application/grpc"), false))
            .await,
    );
    trailers_passed(
        &envoy
            .exchange(response_trailers(&[("grpc-status", "4")]))
            .await,
    );
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-deadline", AttemptState::Uncertain).await;
    assert_eq!(
        a.uncertain_reason,
        "the tool answered gRPC status 4 (DEADLINE_EXCEEDED)"
    );

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-precondition"), BODY).await);
    let mut headers = grpc("application/grpc").to_vec();
    headers.push(("grpc-status", "9"));
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &headers, true))
            .await,
    );
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-precondition", AttemptState::Failed).await;
    assert_eq!(
        a.failure_reason,
        "the tool answered gRPC status 9 (FAILED_PRECONDITION)"
    );

    // The status in the trailers, after the body: a failure, and a success.
    for (key, content_type, status, state) in [
        ("g-failed", "application/grpc", "7", AttemptState::Failed),
        (
            "g-ok",
            "application/grpc+proto",
            "0",
            AttemptState::Succeeded,
        ),
    ] {
        let mut envoy = open_charge(&h).await;
        forwarded(post(&mut envoy, &charge_headers(&permit, key), BODY).await);
        passed_on(
            &envoy
                .exchange(response_headers_with(200, &grpc(content_type), false))
                .await,
        );
        // BUFFERED: the body in one message, end_of_stream false (the
        // trailers follow).
        let answer = envoy
            .exchange(response_body(b"\0\0\0\0\x02ok", false))
            .await;
        assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
        let answer = envoy
            .exchange(response_trailers(&[
                ("grpc-status", status),
                ("grpc-message", "denied"),
            ]))
            .await;
        trailers_passed(&answer);
        assert_eq!(envoy.close().await, Code::Ok, "{key}");
        let a = until_state(&h, &permit, key, state).await;
        match state {
            AttemptState::Failed => assert_eq!(
                a.failure_reason,
                "the tool answered gRPC status 7 (PERMISSION_DENIED): denied"
            ),
            _ => assert_eq!(a.receipt.unwrap().result, b"\0\0\0\0\x02ok"),
        }
    }

    // No grpc-status: trailers skipped (the stream ends after the body), or
    // trailers without one. Not known: UNCERTAIN.
    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-skipped"), BODY).await);
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &grpc("application/grpc"), false))
            .await,
    );
    let answer = envoy
        .exchange(response_body(b"\0\0\0\0\x02ok", false))
        .await;
    assert!(matches!(answer.response, Some(Answer::ResponseBody(_))));
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-skipped", AttemptState::Uncertain).await;
    assert!(
        a.uncertain_reason.contains("no grpc-status")
            && a.uncertain_reason.contains("response_trailer_mode: SEND"),
        "{}",
        a.uncertain_reason
    );

    let mut envoy = open_charge(&h).await;
    forwarded(post(&mut envoy, &charge_headers(&permit, "g-none"), BODY).await);
    passed_on(
        &envoy
            .exchange(response_headers_with(200, &grpc("application/grpc"), false))
            .await,
    );
    trailers_passed(&envoy.exchange(response_trailers(&[("x-other", "1")])).await);
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "g-none", AttemptState::Uncertain).await;
    assert!(
        a.uncertain_reason.contains("without a grpc-status"),
        "{}",
        a.uncertain_reason
    );
}

/// `response_body_mode: FULL_DUPLEX_STREAMED`: Envoy streams the body to
/// atmost and forwards only what atmost streams back. Each chunk is handed
/// back as it came (a plain CONTINUE is a spurious answer there, and the
/// client would get no body), and the chunks are the result, as STREAMED's
/// are; also when the status settled the attempt first. Where Envoy sends
/// atmost no body (`NONE`; `GRPC`, gRPC's proxyless ext_proc's, not Envoy's) the
/// result is the status alone, never an empty body passed off as the
/// tool's.
async fn a_body_atmost_streams_back_or_never_sees_is_recorded_truly(kind: Kind) {
    let h = Harness::start(kind).await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let mode = |response: BodySendMode| {
        Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: response as i32,
            ..Default::default()
        })
    };
    let handed_back = |answer: &ProcessingResponse, chunk: &[u8], end: bool| match &answer.response
    {
        Some(Answer::ResponseBody(b)) => {
            let common = b.response.clone().unwrap_or_default();
            assert_eq!(common.status(), ResponseStatus::Continue);
            match common.body_mutation.and_then(|m| m.mutation) {
                Some(Mutation::StreamedResponse(r)) => {
                    assert_eq!((r.body.as_slice(), r.end_of_stream), (chunk, end));
                }
                other => panic!("expected the chunk streamed back, got {other:?}"),
            }
        }
        other => panic!("expected a body answer, got {other:?}"),
    };
    let full_duplex = mode(BodySendMode::FullDuplexStreamed);
    for (key, status, state) in [
        ("fd-ok", 200, AttemptState::Succeeded),
        ("fd-declined", 402, AttemptState::Failed),
    ] {
        let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], full_duplex).await;
        forwarded(post(&mut envoy, &charge_headers(&permit, key), BODY).await);
        passed_on(&envoy.exchange(response_headers(status, false)).await);
        for (chunk, end) in [(&b"part one, "[..], false), (b"part two", true)] {
            let answer = envoy.exchange(response_body(chunk, end)).await;
            handed_back(&answer, chunk, end);
        }
        assert_eq!(envoy.close().await, Code::Ok, "{key}");
        let a = until_state(&h, &permit, key, state).await;
        if state == AttemptState::Succeeded {
            assert_eq!(a.receipt.unwrap().result, b"part one, part two");
        }
    }

    for (key, response) in [
        ("none", BodySendMode::None),
        ("grpc-mode", BodySendMode::Grpc),
    ] {
        let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], mode(response)).await;
        forwarded(post(&mut envoy, &charge_headers(&permit, key), BODY).await);
        passed_on(&envoy.exchange(response_headers(200, false)).await);
        assert_eq!(envoy.close().await, Code::Ok, "{key}");
        let a = until_state(&h, &permit, key, AttemptState::Succeeded).await;
        assert_eq!(a.receipt.unwrap().result, b"HTTP 200", "{key}");
    }
}

/// `request_body_mode: FULL_DUPLEX_STREAMED`, the fingerprint from a
/// header (a body fingerprint needs BUFFERED): the request is authorized
/// on its headers, and Envoy forwards only the body atmost streams back.
/// Each chunk is handed back as it came, in order, the last with
/// end_of_stream: the first sent with the headers, so that it arrives
/// while Authorize runs and waits for the DISPATCH; the next after it.
async fn a_full_duplex_request_body_is_streamed_back_in_order(kind: Kind) {
    let h = Harness::start_configured(kind, |app| {
        app.with_envoy(Some(mapping("[fingerprint]\nfrom = \"header\"\n")))
    })
    .await;
    let permit = h.create_with(&[TOOL], &[], None).await;
    let protocol = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::Buffered as i32,
        ..Default::default()
    });
    let chunk = |body: &[u8], end: bool| ProcessingRequest {
        request: Some(Message::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    };
    let handed_back = |answer: &ProcessingResponse| match &answer.response {
        Some(Answer::RequestBody(b)) => {
            let common = b.response.clone().unwrap_or_default();
            assert_eq!(common.status(), ResponseStatus::Continue);
            match common.body_mutation.and_then(|m| m.mutation) {
                Some(Mutation::StreamedResponse(r)) => (r.body, r.end_of_stream),
                other => panic!("expected the chunk streamed back, got {other:?}"),
            }
        }
        other => panic!("expected a request body answer, got {other:?}"),
    };
    let mut envoy = Envoy::open_with(&h, &[("x-atmost-tool", TOOL)], protocol).await;
    let mut headers = charge_headers(&permit, "fd-request");
    headers.push(("x-atmost-fingerprint", "fd-request-1"));
    envoy.send_together(vec![
        request_headers("POST", PATH, &headers, false),
        chunk(b"part one, ", false),
    ]);
    let answer = envoy.recv().await.expect("the headers' answer");
    assert!(
        matches!(answer.response, Some(Answer::RequestHeaders(_))),
        "{answer:?}"
    );
    let id = continued(&answer)["x-atmost-attempt-id"].clone();
    let mut echoed = vec![handed_back(
        &envoy.recv().await.expect("the first chunk's answer"),
    )];
    echoed.push(handed_back(&envoy.exchange(chunk(b"part two", true)).await));
    assert_eq!(
        echoed,
        [
            (b"part one, ".to_vec(), false),
            (b"part two".to_vec(), true)
        ]
    );
    tool_answers(&mut envoy, 200, b"ok").await;
    assert_eq!(envoy.close().await, Code::Ok);
    let a = until_state(&h, &permit, "fd-request", AttemptState::Succeeded).await;
    assert_eq!(a.attempt_id, id);
    assert_eq!(a.receipt.unwrap().result, b"ok");
    assert_eq!(super::usage(&h, &permit).await.0, [(TOOL.to_owned(), 1)]);
}

on_each_store!(
    a_full_cycle_commits_the_result_and_a_retry_replays_it,
    a_request_without_a_body_is_authorized_on_its_headers,
    attempt_headers_are_never_forged_upstream_nor_echoed_downstream,
    a_refusing_tool_fails_the_attempt,
    a_5xx_leaves_the_attempt_uncertain,
    a_lost_response_is_marked_uncertain,
    a_stream_ended_before_the_answer_is_not_sent,
    refusals_answer_instead_of_forwarding,
    an_envoy_configuration_that_cannot_gate_is_refused,
    results_follow_the_mapping,
    a_read_error_while_the_store_decides_fails_the_stream,
    a_buffered_partial_body_is_the_result_only_when_whole,
    a_response_body_followed_by_trailers_is_settled,
    a_path_the_route_table_could_misread_is_refused,
    a_request_of_headers_then_trailers_is_authorized_once,
    a_response_to_a_request_never_authorized_is_logged_and_counted,
    a_second_request_on_a_finished_stream_is_refused,
    a_grpc_response_is_settled_by_its_grpc_status,
    a_body_atmost_streams_back_or_never_sees_is_recorded_truly,
    a_full_duplex_request_body_is_streamed_back_in_order,
);
