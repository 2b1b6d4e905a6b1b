//! Transport abuse: what one client may cost the server, tried through the
//! real binary with each limit's flag (docs/security.md, "Transport
//! limits"). Raw HTTP/2 frames are written by hand where a well-behaved
//! client library would refuse to misbehave. Every test ends by checking
//! that a well-behaved client is still served, and runs on both stores.
//! Waits are bounded by guards that fail the test; nothing here measures
//! speed.

use crate::support::*;
use prost::Message;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

on_each_store!(
    streams_past_the_limit_are_refused,
    stalled_bodies_cost_bounded_memory_and_are_cut_by_the_request_timeout,
    connections_without_a_preface_are_closed,
    a_flood_of_resets_gets_goaway,
    protocol_errors_past_the_cap_get_goaway,
    thousands_of_watch_streams_and_the_connection_cap,
    idle_connections_are_closed_but_open_rpcs_keep_them,
    old_connections_get_goaway_then_close_after_the_grace,
    oversized_headers_and_messages_are_refused,
    a_stalled_tls_handshake_is_closed,
    a_client_refused_thousands_of_times_keeps_its_connection,
    a_peer_that_does_not_answer_pings_is_disconnected,
);

/// An `atmost serve` process on `kind`'s store with `flags`.
struct Served {
    process: AtmostProcess,
    redis: Option<Redis>,
}

fn serve(kind: Kind, flags: &[&str]) -> Served {
    let redis = (kind == Kind::Redis).then(Redis::start);
    let mut args: Vec<String> = redis.as_ref().map(Redis::serve_args).unwrap_or_default();
    args.extend(flags.iter().map(|s| (*s).to_owned()));
    Served {
        process: spawn_atmost(&args),
        redis,
    }
}

impl Served {
    fn addr(&self) -> std::net::SocketAddr {
        self.process.addr()
    }

    /// Every key the server stored on Redis (nothing on the memory store,
    /// whose state is read through the RPCs).
    async fn stored(&self) -> std::collections::BTreeSet<String> {
        let Some(redis) = &self.redis else {
            return Default::default();
        };
        let mut conn = ::redis::Client::open(redis.url.as_str())
            .expect("a Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis");
        ::redis::cmd("KEYS")
            .arg(format!("{}:*", redis.prefix))
            .query_async(&mut conn)
            .await
            .expect("KEYS")
    }

    /// The server's resident memory, in KiB.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.process.pid()))
            .expect("/proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    /// A well-behaved client on a connection of its own is served: a
    /// permit is created and its first Authorize dispatches.
    async fn still_serves(&self) {
        let client = atmost_client::Client::connect(format!("http://{}", self.addr()))
            .await
            .expect("connect");
        self.still_serves_on(&client).await;
    }

    async fn still_serves_on(&self, client: &atmost_client::Client) {
        let permit = client
            .create_permit(NewPermit::new(["wallet.charge"]))
            .await
            .expect("a well-behaved client is served");
        let authorized = client
            .authorize(pb::AuthorizeRequest {
                permit_id: permit.permit_id.clone(),
                tool: "wallet.charge".into(),
                idempotency_key: "k1".into(),
                request_fingerprint: b"f".to_vec(),
                ..Default::default()
            })
            .await
            .expect("authorize");
        assert_eq!(authorized.decision(), pb::Decision::Dispatch);
    }
}

// === raw HTTP/2 ===

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const RST_STREAM: u8 = 3;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;
const ACK: u8 = 1;
const REFUSED_STREAM: u32 = 7;
const CANCEL: u32 = 8;
const ENHANCE_YOUR_CALM: u32 = 0xb;
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// How long any one wait may take before the test fails.
const GUARD: Duration = Duration::from_secs(15);

#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl Frame {
    /// The error code of a RST_STREAM or GOAWAY frame.
    fn error_code(&self) -> u32 {
        let at = if self.kind == GOAWAY { 4 } else { 0 };
        u32::from_be_bytes(self.payload[at..at + 4].try_into().expect("4 bytes"))
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend(payload);
    out
}

/// An HPACK integer with a 7-bit prefix (string lengths, no Huffman).
fn hpack_len(out: &mut Vec<u8>, mut n: usize) {
    if n < 127 {
        out.push(n as u8);
        return;
    }
    out.push(127);
    n -= 127;
    while n >= 128 {
        out.push((n % 128 + 128) as u8);
        n /= 128;
    }
    out.push(n as u8);
}

/// A header block of literals without indexing: a gRPC request to `path`.
fn request_headers(path: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    let fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "atmost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    for (name, value) in fields.iter().chain(extra) {
        block.push(0);
        hpack_len(&mut block, name.len());
        block.extend(name.as_bytes());
        hpack_len(&mut block, value.len());
        block.extend(value.as_bytes());
    }
    block
}

/// A gRPC message prefix declaring `len` bytes, followed by `body`.
fn grpc_message(len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend(len.to_be_bytes());
    out.extend(body);
    out
}

/// One connection speaking HTTP/2 frame by frame.
struct Raw {
    io: TcpStream,
}

impl Raw {
    /// Connects, sends the preface and an empty SETTINGS, and acknowledges
    /// the server's SETTINGS (from then on its limits apply).
    async fn connect(addr: std::net::SocketAddr) -> Self {
        let mut raw = Self {
            io: TcpStream::connect(addr).await.expect("connect"),
        };
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        raw.send(&hello).await;
        loop {
            let f = raw.next().await.expect("the server's SETTINGS");
            if f.kind == SETTINGS && f.flags & ACK == 0 {
                raw.send(&frame(SETTINGS, ACK, 0, &[])).await;
                return raw;
            }
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.expect("write");
    }

    /// Opens stream `id` to `path`, ending it if `end`.
    async fn open(&mut self, id: u32, path: &str, end: bool) {
        let flags = END_HEADERS | if end { END_STREAM } else { 0 };
        self.send(&frame(HEADERS, flags, id, &request_headers(path, &[])))
            .await;
    }

    /// The next frame, or None when the server closed the connection.
    async fn next(&mut self) -> Option<Frame> {
        let mut head = [0u8; 9];
        match tokio::time::timeout(GUARD, self.io.read_exact(&mut head)).await {
            Err(_) => panic!("no frame within {GUARD:?}"),
            Ok(Err(_)) => return None,
            Ok(Ok(_)) => {}
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0; len];
        self.io.read_exact(&mut payload).await.ok()?;
        Some(Frame {
            kind: head[3],
            flags: head[4],
            stream: u32::from_be_bytes(head[5..9].try_into().expect("4 bytes")) & 0x7fff_ffff,
            payload,
        })
    }

    /// Frames until the connection closes; fails past the guard.
    async fn until_closed(&mut self) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next().await {
            frames.push(f);
        }
        frames
    }

    /// Frames until one matches `want`; fails if the connection closes first.
    async fn until(&mut self, want: impl Fn(&Frame) -> bool) -> (Vec<Frame>, Frame) {
        let mut before = Vec::new();
        loop {
            let f = self
                .next()
                .await
                .unwrap_or_else(|| panic!("closed before the frame awaited; got {before:?}"));
            if want(&f) {
                return (before, f);
            }
            before.push(f);
        }
    }
}

/// Whether the peer closed `io` (EOF or reset) within the guard.
async fn closed_by_server(io: &mut TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(GUARD, io.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// An HTTP/2 client connection (the h2 crate), for requests whose answer
/// must be read: it decodes the server's compressed headers.
async fn h2_client(addr: std::net::SocketAddr) -> h2::client::SendRequest<bytes::Bytes> {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (h2, connection) = h2::client::handshake(tcp).await.expect("HTTP/2");
    tokio::spawn(connection);
    h2
}

/// Opens a gRPC call to `path` on `h2` and sends `body` without ending the
/// stream (the rest of the message never comes).
async fn stalled_call(
    h2: &mut h2::client::SendRequest<bytes::Bytes>,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    *h2 = h2.clone().ready().await.expect("a stream slot");
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("http://atmost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let (response, mut send) = h2
        .send_request(request.body(()).expect("request"), false)
        .expect("send");
    send.send_data(bytes::Bytes::from(body), false)
        .expect("send data");
    (response, send)
}

/// The gRPC status code of an answered call.
async fn grpc_status(response: h2::client::ResponseFuture) -> tonic::Code {
    grpc_answer(response).await.code()
}

/// The gRPC status of an answered call (trailers, or trailers-only headers).
async fn grpc_answer(response: h2::client::ResponseFuture) -> tonic::Status {
    let response = tokio::time::timeout(GUARD, response)
        .await
        .expect("an answer within the guard")
        .expect("a response");
    let (head, mut body) = response.into_parts();
    if let Some(status) = tonic::Status::from_header_map(&head.headers) {
        return status;
    }
    while let Some(chunk) = body.data().await {
        let _ = chunk.map(|c| body.flow_control().release_capacity(c.len()));
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    tonic::Status::from_header_map(&trailers).expect("a grpc-status")
}

// === the tests ===

/// Past SETTINGS_MAX_CONCURRENT_STREAMS, new streams are refused
/// (REFUSED_STREAM): a client cannot open unbounded work on one connection.
async fn streams_past_the_limit_are_refused(kind: Kind) {
    let served = serve(kind, &["--max-concurrent-streams", "8"]);
    let mut raw = Raw::connect(served.addr()).await;
    let mut flood = Vec::new();
    for i in 0..200u32 {
        flood.extend(frame(
            HEADERS,
            END_HEADERS,
            2 * i + 1,
            &request_headers("/atmost.v1.Gate/Authorize", &[]),
        ));
    }
    raw.send(&flood).await;
    let mut refused = 0;
    while refused < 192 {
        let f = raw.next().await.expect("still open");
        assert_ne!(f.kind, GOAWAY, "{f:?}");
        if f.kind == RST_STREAM {
            assert_eq!(f.error_code(), REFUSED_STREAM, "{f:?}");
            assert!(
                f.stream > 15,
                "one of the first 8 streams was refused: {f:?}"
            );
            refused += 1;
        }
    }
    served.still_serves().await;
}

/// Bodies that trickle in cost what was sent, not what they declare, and
/// are cut by --request-timeout: the stalled RPCs answer CANCELLED and the
/// server's memory stays bounded.
async fn stalled_bodies_cost_bounded_memory_and_are_cut_by_the_request_timeout(kind: Kind) {
    let served = serve(kind, &["--request-timeout", "2s"]);
    let before = served.rss_kib();
    let mut calls = Vec::new();
    for _ in 0..4 {
        let mut h2 = h2_client(served.addr()).await;
        for _ in 0..100 {
            // Declares 120 KB (under the 128 KiB limit), sends 1 KB.
            calls.push(
                stalled_call(
                    &mut h2,
                    "/atmost.v1.Permits/CreatePermit",
                    grpc_message(120_000, &[b'x'; 1000]),
                    &[],
                )
                .await,
            );
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown_mib = served.rss_kib().saturating_sub(before) / 1024;
    println!("400 stalled bodies: RSS grew by {grown_mib} MiB");
    assert!(
        grown_mib < 64,
        "400 stalled bodies grew the server by {grown_mib} MiB"
    );
    for (response, _send) in calls {
        assert_eq!(grpc_status(response).await, tonic::Code::Cancelled);
    }
    served.still_serves().await;
}

/// A connection that does not send the HTTP/2 preface within
/// --handshake-timeout is closed, whatever it sent instead.
async fn connections_without_a_preface_are_closed(kind: Kind) {
    let served = serve(kind, &["--handshake-timeout", "300ms"]);
    let mut silent = TcpStream::connect(served.addr()).await.expect("connect");
    let mut partial = TcpStream::connect(served.addr()).await.expect("connect");
    partial.write_all(&PREFACE[..10]).await.expect("write");
    assert!(
        closed_by_server(&mut silent).await,
        "a silent connection stayed open"
    );
    assert!(
        closed_by_server(&mut partial).await,
        "half a preface stayed open"
    );
    served.still_serves().await;
}

/// Streams opened and reset at once (rapid reset, CVE-2023-44487) past
/// --h2-max-pending-resets end the connection with GOAWAY
/// ENHANCE_YOUR_CALM.
async fn a_flood_of_resets_gets_goaway(kind: Kind) {
    let served = serve(kind, &["--h2-max-pending-resets", "20"]);
    let mut raw = Raw::connect(served.addr()).await;
    let mut flood = Vec::new();
    for i in 0..2000u32 {
        let id = 2 * i + 1;
        flood.extend(frame(
            HEADERS,
            END_HEADERS,
            id,
            &request_headers("/atmost.v1.Gate/Authorize", &[]),
        ));
        flood.extend(frame(RST_STREAM, 0, id, &CANCEL.to_be_bytes()));
    }
    // The server may close while the flood is still being written.
    let _ = raw.io.write_all(&flood).await;
    let (_, goaway) = raw.until(|f| f.kind == GOAWAY).await;
    assert_eq!(goaway.error_code(), ENHANCE_YOUR_CALM, "{goaway:?}");
    served.still_serves().await;
}

/// Streams the server must reset because the client broke the protocol
/// (here: opened past the stream limit) end the connection with GOAWAY
/// ENHANCE_YOUR_CALM past --h2-max-local-resets.
async fn protocol_errors_past_the_cap_get_goaway(kind: Kind) {
    let served = serve(
        kind,
        &[
            "--max-concurrent-streams",
            "1",
            "--h2-max-local-resets",
            "10",
        ],
    );
    let mut raw = Raw::connect(served.addr()).await;
    let mut flood = Vec::new();
    for i in 0..100u32 {
        flood.extend(frame(
            HEADERS,
            END_HEADERS,
            2 * i + 1,
            &request_headers("/atmost.v1.Gate/Authorize", &[]),
        ));
    }
    let _ = raw.io.write_all(&flood).await;
    let (before, goaway) = raw.until(|f| f.kind == GOAWAY).await;
    assert_eq!(goaway.error_code(), ENHANCE_YOUR_CALM, "{goaway:?}");
    let resets = before.iter().filter(|f| f.kind == RST_STREAM).count();
    assert!(resets <= 11, "{resets} resets before GOAWAY");
    served.still_serves().await;
}

/// 2000 Health/Watch streams over 20 connections cost bounded memory; past
/// --max-connections, a new connection is closed at once, and the clients
/// already connected keep being served.
async fn thousands_of_watch_streams_and_the_connection_cap(kind: Kind) {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let served = serve(kind, &["--max-connections", "24"]);
    let other = atmost_client::Client::connect(format!("http://{}", served.addr()))
        .await
        .expect("connect");
    served.still_serves_on(&other).await;
    let before = served.rss_kib();

    let mut streams = Vec::new();
    for _ in 0..20 {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", served.addr()))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        for _ in 0..100 {
            let mut health = HealthClient::new(channel.clone());
            let mut stream = health
                .watch(HealthCheckRequest::default())
                .await
                .expect("watch")
                .into_inner();
            let first = stream.message().await.expect("status").expect("a status");
            assert_eq!(first.status(), ServingStatus::Serving);
            streams.push(stream);
        }
    }
    let grown_mib = served.rss_kib().saturating_sub(before) / 1024;
    println!("2000 Health/Watch streams: RSS grew by {grown_mib} MiB");
    assert!(
        grown_mib < 128,
        "2000 watch streams grew the server by {grown_mib} MiB"
    );

    // 21 connections are open: 3 more get the server's SETTINGS, the rest
    // are closed as soon as they are accepted.
    let mut admitted = Vec::new();
    let mut refused = 0;
    for _ in 0..10 {
        let mut io = TcpStream::connect(served.addr()).await.expect("connect");
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        let _ = io.write_all(&hello).await;
        let mut head = [0u8; 9];
        match tokio::time::timeout(GUARD, io.read_exact(&mut head)).await {
            Ok(Ok(_)) => {
                assert_eq!(head[3], SETTINGS);
                admitted.push(io);
            }
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("a connection past the cap was neither served nor closed"),
        }
    }
    assert_eq!((admitted.len(), refused), (3, 7));
    served.still_serves_on(&other).await;
    // A slot freed is a slot a new client gets.
    drop(admitted.pop());
    drop(streams);
    tokio::time::sleep(Duration::from_millis(200)).await;
    served.still_serves().await;
}

/// A connection with no RPC open for --idle-timeout is closed; an open
/// stream (a Health/Watch) keeps it, however quiet.
async fn idle_connections_are_closed_but_open_rpcs_keep_them(kind: Kind) {
    // A handshake deadline past the guard: only the idle timeout can close it.
    let served = serve(
        kind,
        &["--idle-timeout", "1s", "--handshake-timeout", "60s"],
    );
    let mut raw = Raw::connect(served.addr()).await;
    raw.open(1, "/grpc.health.v1.Health/Watch", false).await;
    raw.send(&frame(DATA, END_STREAM, 1, &grpc_message(0, &[])))
        .await;
    raw.until(|f| f.kind == DATA && f.stream == 1).await;
    // The store's first health check may repeat the initial SERVING (a
    // watch opened before it ran sees both): let it come.
    while let Ok(Some(f)) = tokio::time::timeout(Duration::from_millis(500), raw.next()).await {
        assert!(
            f.kind == DATA && f.stream == 1,
            "only the watch moves: {f:?}"
        );
    }
    // Three idle timeouts with the watch open: nothing but its stream.
    let quiet = tokio::time::timeout(Duration::from_secs(3), raw.next()).await;
    assert!(
        quiet.is_err(),
        "the connection moved while a watch was open: {quiet:?}"
    );
    // The watch ends; the connection is closed about a second later.
    raw.send(&frame(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()))
        .await;
    let rest = raw.until_closed().await;
    assert!(rest.iter().all(|f| f.kind != HEADERS), "{rest:?}");
    served.still_serves().await;
}

/// At --max-connection-age a connection gets GOAWAY (so the client
/// reconnects, perhaps to another replica); one still open
/// --max-connection-age-grace later is closed.
async fn old_connections_get_goaway_then_close_after_the_grace(kind: Kind) {
    let served = serve(
        kind,
        &[
            "--max-connection-age",
            "1s",
            "--max-connection-age-grace",
            "1s",
        ],
    );
    let mut raw = Raw::connect(served.addr()).await;
    raw.open(1, "/grpc.health.v1.Health/Watch", false).await;
    raw.send(&frame(DATA, END_STREAM, 1, &grpc_message(0, &[])))
        .await;
    let (_, goaway) = raw.until(|f| f.kind == GOAWAY).await;
    assert_eq!(goaway.error_code(), 0, "GOAWAY NO_ERROR: {goaway:?}");
    // The watch never ends by itself: the grace ends the connection.
    raw.until_closed().await;
    served.still_serves().await;
}

/// Header lists past --max-header-list-bytes and messages past
/// --max-request-bytes are refused before anything is decoded;
/// responses past --max-response-bytes are not sent.
async fn oversized_headers_and_messages_are_refused(kind: Kind) {
    let served = serve(
        kind,
        &[
            "--max-header-list-bytes",
            "4096",
            "--max-request-bytes",
            "80000",
            "--max-response-bytes",
            "65536",
        ],
    );
    let addr = served.addr();
    let client = atmost_client::Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");

    // A 5 KB header: the stream is refused (431, or reset).
    let mut h2 = h2_client(addr).await;
    let big = "x".repeat(5000);
    let (response, _send) = stalled_call(
        &mut h2,
        "/atmost.v1.Gate/Authorize",
        Vec::new(),
        &[("x-big", &big)],
    )
    .await;
    match tokio::time::timeout(GUARD, response)
        .await
        .expect("an answer")
    {
        Ok(response) => assert_eq!(response.status(), 431, "{response:?}"),
        Err(e) => assert!(e.is_reset(), "{e:?}"),
    }

    // A message declaring 10 MB answers at once, before any body arrives:
    // RESOURCE_EXHAUSTED, with its reason and the limit.
    let stored = served.stored().await;
    let (response, _send) = stalled_call(
        &mut h2,
        "/atmost.v1.Permits/CreatePermit",
        grpc_message(10_000_000, b""),
        &[],
    )
    .await;
    too_large(
        Err::<(), _>(Error::from(grpc_answer(response).await)),
        10_000_000,
    );

    // Through a client library: a 100 KB CreatePermit is refused whole.
    let create = |permit: pb::Permit| pb::CreatePermitRequest {
        permit: Some(permit),
    };
    let permit = pb::Permit {
        tools: vec!["t".repeat(100_000)],
        ..Default::default()
    };
    let size = create(permit.clone()).encoded_len();
    too_large(client.create_permit(permit).await, size);
    assert_eq!(
        served.stored().await,
        stored,
        "a refused CreatePermit stored nothing"
    );

    // A message of exactly the limit is read: this one is refused for
    // what it says (a subject too long), not for its size.
    let mut permit = NewPermit::new(["t"]).build();
    let mut n = 80_000 - create(permit.clone()).encoded_len();
    loop {
        permit.subject = "s".repeat(n);
        match create(permit.clone()).encoded_len() {
            80_000 => break,
            len => n = n + 80_000 - len,
        }
    }
    expect_error(
        client.create_permit(permit).await,
        tonic::Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    // A large valid CreatePermit is created: 64 000 bytes, so that its
    // answer, the permit as large, fits --max-response-bytes.
    let mut permit = largest_valid_permit();
    while create(permit.clone()).encoded_len() > 64_000 {
        let tool = permit.tools.pop().expect("a tool");
        permit.max_calls_per_tool.remove(&tool);
    }
    let tools = permit.tools.len();
    let created = client
        .create_permit(permit)
        .await
        .expect("a large valid permit");
    assert_eq!(created.tools.len(), tools);

    // An Authorize past the limit (a 100 KB fingerprint) reserves nothing.
    let permit = client
        .create_permit(NewPermit::new(["t"]))
        .await
        .expect("create");
    let stored = served.stored().await;
    let authorize = pb::AuthorizeRequest {
        permit_id: permit.permit_id.clone(),
        tool: "t".into(),
        idempotency_key: "big".into(),
        request_fingerprint: vec![b'f'; 100_000],
        ..Default::default()
    };
    let size = authorize.encoded_len();
    too_large(client.authorize(authorize).await, size);
    expect_error(
        client.get_attempt(&permit.permit_id, "big").await,
        tonic::Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    assert_eq!(
        served.stored().await,
        stored,
        "a refused Authorize stored nothing"
    );

    // A Commit whose answer (the 64 KiB result) is past the response limit.
    let attempt = client
        .authorize(pb::AuthorizeRequest {
            permit_id: permit.permit_id.clone(),
            tool: "t".into(),
            idempotency_key: "k".into(),
            request_fingerprint: b"f".to_vec(),
            ..Default::default()
        })
        .await
        .expect("authorize")
        .attempt
        .expect("attempt");
    let err = client
        .commit(pb::CommitRequest {
            permit_id: permit.permit_id.clone(),
            idempotency_key: "k".into(),
            attempt_id: attempt.attempt_id,
            outcome: Some(succeeded(&vec![b'r'; 64 * 1024], None)),
        })
        .await
        .expect_err("an answer past the response limit");
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
    served.still_serves().await;
}

/// Asserts that `result` is the refusal of a message of `size` bytes past
/// `--max-request-bytes` 80000.
#[track_caller]
fn too_large<T: std::fmt::Debug>(result: Result<T, Error>, size: usize) {
    let (metadata, error) =
        expect_error(result, tonic::Code::ResourceExhausted, "MESSAGE_TOO_LARGE");
    assert_eq!(metadata["limit"], "80000", "{error:?}");
    assert_eq!(metadata["size"], size.to_string(), "{error:?}");
}

/// A CreatePermit's permit at every field's bound: the largest valid one.
fn largest_valid_permit() -> pb::Permit {
    use atmost::domain::{MAX_AGENTS, MAX_AMOUNT, MAX_TEXT_LEN, MAX_TOOL_LEN, MAX_TOOLS};
    let tools: Vec<String> = (0..MAX_TOOLS)
        .map(|i| format!("{i:0>width$}", width = MAX_TOOL_LEN))
        .collect();
    pb::Permit {
        subject: "s".repeat(MAX_TEXT_LEN),
        currency: "EUR".into(),
        max_calls_per_tool: tools
            .iter()
            .map(|t| (t.clone(), MAX_AMOUNT as u64))
            .collect(),
        tools,
        budget: Some(MAX_AMOUNT),
        agents: (0..MAX_AGENTS).map(|i| format!("{i:0>64}")).collect(),
        ..NewPermit::new(["t"]).build()
    }
}

/// Over TLS, a handshake that stalls after its first bytes (past the
/// preface's length in raw bytes) is closed at --handshake-timeout.
async fn a_stalled_tls_handshake_is_closed(kind: Kind) {
    let pki = Pki::new();
    let (cert, key) = pki.issue(&["localhost"]);
    let dir = std::env::temp_dir().join(format!("atmost-tls-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write pem");
        path.to_str().expect("utf-8").to_owned()
    };
    let (cert, key) = (write("server.pem", &cert), write("server.key", &key));
    let served = serve(
        kind,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--handshake-timeout",
            "300ms",
        ],
    );
    let mut io = TcpStream::connect(served.addr()).await.expect("connect");
    // A TLS record header announcing a 512-byte ClientHello, and 40 bytes.
    let mut hello = vec![0x16, 0x03, 0x01, 0x02, 0x00];
    hello.extend([0x01, 0x00, 0x01, 0xfc]);
    hello.extend([0x03; 36]);
    io.write_all(&hello).await.expect("write");
    assert!(
        closed_by_server(&mut io).await,
        "a stalled TLS handshake stayed open"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client refused again and again on one connection keeps it. A request
/// refused before its body was read (by the auth layer, or by admission
/// before decoding) would be answered with the body unread, and HTTP/2
/// then resets the stream (RST_STREAM NO_ERROR): h2 counts such resets
/// against --h2-max-local-resets, so the 1025th refusal cost the client its
/// connection (GOAWAY ENHANCE_YOUR_CALM) and every RPC on it. Found by the
/// overload sweep, where shed clients lost whole connections. Both refuse
/// after reading the body (`admission::drain`).
async fn a_client_refused_thousands_of_times_keeps_its_connection(kind: Kind) {
    let keys = crate::auth::KeyFile::new(&crate::auth::entry(
        "admin-1",
        "the-right-key",
        "acme",
        "\"admin\"",
    ));
    let served = serve(kind, &["--auth-keys", keys.path.to_str().expect("utf-8")]);
    let request = pb::GetPermitRequest {
        permit_id: uuid::Uuid::now_v7().to_string(),
    };
    let call = |h2: h2::client::SendRequest<bytes::Bytes>, key: &'static str| {
        let body = bytes::Bytes::from(grpc_message(
            request.encoded_len() as u32,
            &request.encode_to_vec(),
        ));
        async move {
            let mut h2 = h2.ready().await.expect("the connection is still open");
            let (response, mut send) = h2
                .send_request(
                    http::Request::post("http://atmost/atmost.v1.Permits/GetPermit")
                        .header("content-type", "application/grpc")
                        .header("te", "trailers")
                        .header("authorization", format!("Bearer {key}"))
                        .body(())
                        .expect("request"),
                    false,
                )
                .expect("send");
            // The body a moment after the headers, as a busy client's may
            // come: the refusal must not be answered before it.
            tokio::time::sleep(Duration::from_millis(1)).await;
            // A machine too slow for even the drain's wait finds the
            // stream already answered; what counts is the connection.
            let _ = send.send_data(body, true);
            grpc_status(response).await
        }
    };
    let h2 = h2_client(served.addr()).await;
    for i in 0..1100 {
        assert_eq!(
            call(h2.clone(), "a-wrong-key").await,
            tonic::Code::Unauthenticated,
            "call {i}"
        );
    }
    // The same connection, with the right key: served.
    assert_eq!(
        call(h2.clone(), "the-right-key").await,
        tonic::Code::NotFound
    );
}

/// A peer that stops answering HTTP/2 PINGs (a crashed client, a dropped
/// NAT entry) is disconnected --keepalive-timeout after a PING, even with
/// an RPC open, so a dead peer gives its connection slot back.
async fn a_peer_that_does_not_answer_pings_is_disconnected(kind: Kind) {
    let served = serve(
        kind,
        &[
            "--keepalive-interval",
            "1s",
            "--keepalive-timeout",
            "1s",
            "--idle-timeout",
            "1h",
        ],
    );
    let mut raw = Raw::connect(served.addr()).await;
    // An open watch: the idle timeout cannot be what closes it.
    raw.open(1, "/grpc.health.v1.Health/Watch", false).await;
    raw.send(&frame(DATA, END_STREAM, 1, &grpc_message(0, &[])))
        .await;
    // This peer reads, and never answers a PING.
    let (_, ping) = raw.until(|f| f.kind == PING).await;
    assert_eq!(ping.flags & ACK, 0, "{ping:?}");
    raw.until_closed().await;
    served.still_serves().await;
}
