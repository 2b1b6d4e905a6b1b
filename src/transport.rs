//! Transport limits: what one client may cost the server before a single
//! request is decoded. HTTP/2 and gRPC limits are handed to tonic and h2;
//! what they do not offer is here:
//!
//! - a cap on open connections ([`Limits::max_connections`]): past it, a
//!   new connection is closed as soon as it is accepted;
//! - a handshake deadline: a connection that has not sent the HTTP/2
//!   preface within [`Limits::handshake_timeout`] is closed;
//! - an idle timeout: a connection with no RPC open for
//!   [`Limits::idle_timeout`] is closed (keepalive PINGs do not count);
//! - a hard end to a connection's life: tonic sends GOAWAY at
//!   [`Limits::max_connection_age`]; a connection still open
//!   [`Limits::max_connection_age_grace`] later is closed here (tonic's own
//!   grace, when set, replaces the GOAWAY instead of following it).
//!
//! Each accepted socket becomes a [`Conn`], which enforces the deadlines on
//! its reads; [`Track`] counts the RPCs open on each connection.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

/// The transport limits, each a `serve` flag (README, "Configuration").
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once; more are closed on accept.
    pub max_connections: usize,
    /// HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: RPCs open at once on one
    /// connection.
    pub max_concurrent_streams: u32,
    /// Largest request message decoded; larger ones are refused
    /// (MESSAGE_TOO_LARGE, [`MessageLimit`]) before their body is buffered.
    pub max_request_bytes: usize,
    /// Largest response message encoded.
    pub max_response_bytes: usize,
    /// HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE.
    pub max_header_list_bytes: u32,
    /// HTTP/2 PING interval; a peer that does not answer within
    /// `keepalive_timeout` is disconnected.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// A connection with no RPC open this long is closed.
    pub idle_timeout: Duration,
    /// GOAWAY after this long, so long-lived clients reconnect and spread
    /// over replicas; closed `max_connection_age_grace` later.
    pub max_connection_age: Duration,
    pub max_connection_age_grace: Duration,
    /// The TLS handshake (over TLS) or the HTTP/2 preface (in plaintext)
    /// must arrive within this. [`Conn`] sits under TLS and counts the
    /// preface on the bytes it reads, so over TLS it is the handshake's.
    pub handshake_timeout: Duration,
    /// One RPC's handler, body reading included, may take this long
    /// (tonic answers CANCELLED past it).
    pub request_timeout: Duration,
    /// h2: streams the client opened and reset before the server accepted
    /// them (rapid reset, CVE-2023-44487); past it, GOAWAY.
    pub max_pending_accept_reset_streams: usize,
    /// h2: streams the server had to reset because the client broke the
    /// protocol; past it, GOAWAY (ENHANCE_YOUR_CALM).
    pub max_local_error_reset_streams: usize,
}

/// The HTTP/2 client preface ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"): its
/// length is what a connection must send within the handshake timeout.
const PREFACE_LEN: u64 = 24;

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl Limits {
    /// The defaults (`serve`'s flags show them).
    pub const DEFAULT: Self = Self {
        max_connections: 4096,
        // A client queues the RPCs past it on its own side, out of
        // admission's sight (docs/performance.md, "Overload").
        max_concurrent_streams: 1024,
        // The largest valid request is 75 939 bytes (a CreatePermit at
        // every bound, or a Commit with a 64 KiB result).
        max_request_bytes: 128 * 1024,
        // A ListUncertain page of 1000 attempts is at most 1.6 MiB; 4 MiB
        // is what gRPC clients accept by default.
        max_response_bytes: 4 * 1024 * 1024,
        max_header_list_bytes: 16 * 1024,
        keepalive_interval: Duration::from_secs(60),
        keepalive_timeout: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(300),
        max_connection_age: Duration::from_secs(600),
        max_connection_age_grace: Duration::from_secs(30),
        handshake_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(10),
        max_pending_accept_reset_streams: 20,
        max_local_error_reset_streams: 1024,
    };

    /// tonic's server with these limits applied (the rest is [`Conn`]'s).
    pub fn server(&self) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_max_header_list_size(self.max_header_list_bytes)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .max_connection_age(self.max_connection_age)
            // The request timeout is RequestTimeout's, below the HTTP/JSON
            // edge; HTTP/1.1 is served for that edge (gRPC is HTTP/2 only).
            .accept_http1(true)
            .http2_max_pending_accept_reset_streams(Some(self.max_pending_accept_reset_streams))
            .http2_max_local_error_reset_streams(Some(self.max_local_error_reset_streams))
    }

    /// The TLS config with the handshake timeout applied.
    pub fn tls(&self, tls: tonic::transport::ServerTlsConfig) -> tonic::transport::ServerTlsConfig {
        tls.timeout(self.handshake_timeout)
    }

    /// The connections `listener` accepts, each a [`Conn`] under these
    /// limits; past `max_connections`, a new one is closed at once.
    pub fn incoming(&self, listener: TcpListener) -> impl Stream<Item = io::Result<Conn>> + use<> {
        let slots = Arc::new(Semaphore::new(self.max_connections.max(1)));
        let limits = Arc::new(self.clone());
        let refused = Arc::new(Refusals::default());
        // Small unary replies must not wait for Nagle's algorithm.
        TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .filter_map(move |accepted| match accepted {
                Err(e) => Some(Err(e)),
                Ok(stream) => match slots.clone().try_acquire_owned() {
                    Ok(slot) => Some(Ok(Conn::new(stream, slot, limits.clone()))),
                    Err(_) => {
                        refused.note(limits.max_connections);
                        None
                    }
                },
            })
    }
}

/// Connections closed for want of a slot, logged at most once a second.
#[derive(Default)]
struct Refusals {
    count: AtomicU64,
    last_log_s: AtomicU64,
}

impl Refusals {
    fn note(&self, max: usize) {
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if self.last_log_s.swap(now_s, Ordering::Relaxed) != now_s {
            tracing::warn!(
                max_connections = max,
                refused_total = count,
                "connection limit reached: closing new connections"
            );
        }
    }
}

/// RPCs open on one connection, and since when none has been.
#[derive(Debug, Default)]
pub struct Activity {
    open: AtomicUsize,
    /// Milliseconds from the connection's accept to its last RPC's end.
    idle_since_ms: AtomicU64,
    accepted: std::sync::OnceLock<Instant>,
}

impl Activity {
    fn start(self: &Arc<Self>) -> OpenRpc {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenRpc(self.clone())
    }

    /// When the connection may be closed for idleness, if no RPC is open.
    fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let accepted = *self.accepted.get()?;
        Some(accepted + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire)) + idle)
    }
}

/// An open RPC; its drop (the response's end) may start the idle clock.
struct OpenRpc(Arc<Activity>);

impl Drop for OpenRpc {
    fn drop(&mut self) {
        if let Some(accepted) = self.0.accepted.get() {
            let ms = u64::try_from(accepted.elapsed().as_millis()).unwrap_or(u64::MAX);
            self.0.idle_since_ms.store(ms, Ordering::Release);
        }
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What tonic puts in every request's extensions for a [`Conn`].
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub tcp: TcpConnectInfo,
    activity: Arc<Activity>,
}

/// One accepted connection under the [`Limits`]: it holds a connection
/// slot until dropped, and fails its reads (which closes it) past the
/// handshake deadline, the idle timeout or its age plus grace.
pub struct Conn {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
    limits: Arc<Limits>,
    accepted: Instant,
    /// Bytes read so far, up to the preface's length.
    preface_read: u64,
    activity: Arc<Activity>,
    timer: Pin<Box<Sleep>>,
}

impl Conn {
    fn new(io: TcpStream, slot: OwnedSemaphorePermit, limits: Arc<Limits>) -> Self {
        let accepted = Instant::now();
        let activity = Arc::new(Activity::default());
        let _ = activity.accepted.set(accepted);
        let first = accepted + limits.handshake_timeout;
        Self {
            io,
            _slot: slot,
            limits,
            accepted,
            preface_read: 0,
            activity,
            timer: Box::pin(tokio::time::sleep_until(first)),
        }
    }

    /// The next instant a deadline may pass, or the error that closes the
    /// connection if one has.
    fn next_deadline(&self, now: Instant) -> io::Result<Instant> {
        let end =
            self.accepted + self.limits.max_connection_age + self.limits.max_connection_age_grace;
        if now >= end {
            return Err(closed("past its maximum age and grace"));
        }
        let next = if self.preface_read < PREFACE_LEN {
            let at = self.accepted + self.limits.handshake_timeout;
            if now >= at {
                return Err(closed("no HTTP/2 preface within the handshake timeout"));
            }
            at
        } else {
            match self.activity.idle_deadline(self.limits.idle_timeout) {
                Some(at) if now >= at => return Err(closed("idle")),
                Some(at) => at,
                // An RPC is open: look again an idle timeout from now.
                None => now + self.limits.idle_timeout,
            }
        };
        Ok(next.min(end))
    }

    /// Fails once a deadline has passed; otherwise re-arms the timer, whose
    /// wake-up makes the connection's task read (and so check) again.
    fn poll_deadlines(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let next = self.next_deadline(Instant::now())?;
            self.timer.as_mut().reset(next);
        }
        Ok(())
    }
}

fn closed(why: &'static str) -> io::Error {
    tracing::debug!(why, "closing connection");
    io::Error::new(io::ErrorKind::TimedOut, format!("connection closed: {why}"))
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.poll_deadlines(cx)?;
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.io).poll_read(cx, buf))?;
        let read = (buf.filled().len() - before) as u64;
        if self.preface_read < PREFACE_LEN {
            self.preface_read = (self.preface_read + read).min(PREFACE_LEN);
            if self.preface_read == PREFACE_LEN {
                // Handshake done: from now on the idle timeout applies.
                let next = self.next_deadline(Instant::now())?;
                self.timer.as_mut().reset(next);
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            tcp: self.io.connect_info(),
            activity: self.activity.clone(),
        }
    }
}

// === the request timeout ===

/// The request timeout ([`Limits::request_timeout`]): an RPC whose handler
/// has not answered within it is cut off with CANCELLED "Timeout expired",
/// as tonic's own server timeout answers. It is a layer here, inside the
/// HTTP/JSON edge ([`crate::http`]) rather than around it as tonic's is,
/// so that edge answers a timed-out JSON request in JSON. (tonic still
/// applies a gRPC caller's own `grpc-timeout`.)
#[derive(Debug, Clone, Copy)]
pub struct RequestTimeout(pub Duration);

impl<S> tower::Layer<S> for RequestTimeout {
    type Service = TimedOut<S>;

    fn layer(&self, inner: S) -> TimedOut<S> {
        TimedOut {
            inner,
            timeout: self.0,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TimedOut<S> {
    inner: S,
    timeout: Duration,
}

type Timed<F, E> = futures_util::future::Map<
    tokio::time::Timeout<F>,
    fn(
        Result<Result<http::Response<tonic::body::Body>, E>, tokio::time::error::Elapsed>,
    ) -> Result<http::Response<tonic::body::Body>, E>,
>;

impl<S, B> tower::Service<http::Request<B>> for TimedOut<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Timed<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use futures_util::FutureExt as _;
        tokio::time::timeout(self.timeout, self.inner.call(request)).map(|answered| {
            answered.unwrap_or_else(|_| Ok(tonic::Status::cancelled("Timeout expired").into_http()))
        })
    }
}

// === counting open RPCs ===

/// A tower layer that counts each RPC as open on its connection from its
/// request's arrival to its response body's end, for the idle timeout.
#[derive(Debug, Clone, Copy, Default)]
pub struct Track;

impl<S> tower::Layer<S> for Track {
    type Service = Tracked<S>;

    fn layer(&self, inner: S) -> Tracked<S> {
        Tracked { inner }
    }
}

#[derive(Debug, Clone)]
pub struct Tracked<S> {
    inner: S,
}

/// The connection's activity, whether it came in plain or over TLS.
fn activity_of<B>(request: &http::Request<B>) -> Option<Arc<Activity>> {
    let ext = request.extensions();
    ext.get::<ConnInfo>()
        .or_else(|| {
            ext.get::<tonic::transport::server::TlsConnectInfo<ConnInfo>>()
                .map(|tls| tls.get_ref())
        })
        .map(|info| info.activity.clone())
}

impl<S, B> tower::Service<http::Request<B>> for Tracked<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let open = activity_of(&request).map(|a| a.start());
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            Ok(match open {
                Some(open) => {
                    response.map(|body| tonic::body::Body::new(Held { body, _open: open }))
                }
                None => response,
            })
        })
    }
}

/// A response body that keeps its RPC counted as open until it ends.
struct Held {
    body: tonic::body::Body,
    _open: OpenRpc,
}

impl http_body::Body for Held {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

// === the request message limit ===

/// A tower layer that refuses a request message longer than
/// `--max-request-bytes` with RESOURCE_EXHAUSTED / `MESSAGE_TOO_LARGE`,
/// the limit in its ErrorInfo, on every service, unary or streaming.
///
/// tonic checks the same length itself (`max_decoding_message_size`), but
/// answers a bare OUT_OF_RANGE, and for a unary RPC before any handler
/// runs, so no handler could say more; rewriting its answer afterwards
/// would mean recognising its message text, in headers for a unary RPC
/// and in trailers for a stream. Here the request's body is read as
/// it streams past: each gRPC message opens with a 5-byte prefix (a flag,
/// then its length, big-endian), and a prefix declaring more than the
/// limit fails the body with atmost's status at once, before tonic has
/// reserved or read anything of it. tonic hands on a body error that is a
/// `Status` as it is: a unary RPC answers it (trailers-only), and a
/// streaming handler reads it from its stream like any read error, so
/// ext_proc's fail-closed handling of a broken stream stays as it was.
/// Messages before the oversized one (in the same DATA frame, say) are
/// passed on first, as tonic would have decoded them. tonic's own limit
/// stays set behind this one, for what it also bounds (a message's size
/// once decompressed).
#[derive(Debug, Clone, Copy)]
pub struct MessageLimit {
    limit: usize,
}

impl MessageLimit {
    /// Refuses messages longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self { limit }
    }
}

impl<S> tower::Layer<S> for MessageLimit {
    type Service = MessageLimited<S>;

    fn layer(&self, inner: S) -> MessageLimited<S> {
        MessageLimited {
            inner,
            limit: self.limit,
        }
    }
}

#[derive(Debug, Clone)]
pub struct MessageLimited<S> {
    inner: S,
    limit: usize,
}

impl<S, B> tower::Service<http::Request<B>> for MessageLimited<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
    B: http_body::Body<Data = bytes::Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> S::Future {
        let limit = self.limit;
        self.inner.call(request.map(|body| {
            tonic::body::Body::new(Limited {
                body,
                frames: Frames::new(limit),
                refused: None,
                done: false,
            })
        }))
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where a request body stands in its gRPC framing.
#[derive(Debug)]
struct Frames {
    limit: usize,
    /// Bytes of the current message still to come after its prefix.
    left: usize,
    /// The prefix read so far (`have` bytes of it).
    prefix: [u8; 5],
    have: usize,
}

impl Frames {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            left: 0,
            prefix: [0; 5],
            have: 0,
        }
    }

    /// Follows the framing through `chunk`, the body's next bytes. A
    /// prefix declaring more than the limit: `(at, size)`, where `at` is
    /// where that prefix starts in `chunk` (0 when it started in an
    /// earlier chunk) and `size` its declared length.
    fn scan(&mut self, chunk: &[u8]) -> Option<(usize, usize)> {
        let mut i = 0;
        let mut start = 0;
        while i < chunk.len() {
            if self.left > 0 {
                let n = self.left.min(chunk.len() - i);
                self.left -= n;
                i += n;
                continue;
            }
            if self.have == 0 {
                start = i;
            }
            self.prefix[self.have] = chunk[i];
            self.have += 1;
            i += 1;
            if self.have == self.prefix.len() {
                self.have = 0;
                let [_, a, b, c, d] = self.prefix;
                let size = u32::from_be_bytes([a, b, c, d]) as usize;
                if size > self.limit {
                    return Some((start, size));
                }
                self.left = size;
            }
        }
        None
    }
}

/// A request body that fails with MESSAGE_TOO_LARGE at the prefix of a
/// message past the limit ([`MessageLimit`]).
struct Limited<B> {
    body: B,
    frames: Frames,
    /// The refusal, once the bytes before its prefix are handed on.
    refused: Option<tonic::Status>,
    /// Refused: nothing more is read.
    done: bool,
}

impl<B> http_body::Body for Limited<B>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let this = self.get_mut();
        if let Some(refused) = this.refused.take() {
            return Poll::Ready(Some(Err(refused)));
        }
        if this.done {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut this.body).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(tonic::Status::from_error(e.into())))),
            None => return Poll::Ready(None),
        };
        let Some((at, size)) = frame.data_ref().and_then(|data| this.frames.scan(data)) else {
            return Poll::Ready(Some(Ok(frame)));
        };
        this.done = true;
        let refused = crate::api::status::to_status(crate::domain::Error::MessageTooLarge {
            limit: this.frames.limit,
            size,
        });
        match frame.into_data() {
            Ok(mut before) if at > 0 => {
                before.truncate(at);
                this.refused = Some(refused);
                Poll::Ready(Some(Ok(http_body::Frame::data(before))))
            }
            _ => Poll::Ready(Some(Err(refused))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.refused.is_none() && (self.done || self.body.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::{Frames, Limits};
    use crate::domain::{MAX_AGENTS, MAX_KEY_LEN, MAX_RESULT_BYTES, MAX_TEXT_LEN, MAX_TOOLS};
    use crate::pb;
    use prost::Message;

    /// A gRPC message: its 5-byte prefix declaring `size`, and `body`.
    fn message(size: u32, body: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend(size.to_be_bytes());
        out.extend(body);
        out
    }

    /// The framing is followed across chunks however they are cut: a
    /// message at the limit passes, the prefix of one past it is found
    /// where it starts, even split over chunks.
    #[test]
    fn a_prefix_past_the_limit_is_found_wherever_the_chunks_cut() {
        let mut stream = message(10, &[7; 10]);
        stream.extend(message(3, b"abc"));
        let at = stream.len();
        stream.extend(message(11, b""));
        for cut in 0..=stream.len() {
            let mut frames = Frames::new(10);
            let (first, second) = stream.split_at(cut);
            let found = match frames.scan(first) {
                Some((start, size)) => (start, size),
                None => {
                    let (start, size) = frames.scan(second).expect("the prefix past the limit");
                    if cut > at {
                        // Begun in the first chunk: it starts the second.
                        assert_eq!(start, 0, "cut at {cut}");
                        (at, size)
                    } else {
                        (cut + start, size)
                    }
                }
            };
            assert_eq!(found, (at, 11), "cut at {cut}");
        }
        let mut frames = Frames::new(10);
        assert_eq!(
            frames.scan(&stream[..at]),
            None,
            "messages at the limit pass"
        );
        assert_eq!(
            frames.scan(&message(u32::MAX, b"")),
            Some((0, u32::MAX as usize))
        );
    }

    /// The default message limits fit the largest valid messages, sized
    /// from the field limits: a CreatePermit at every bound, a Commit of a
    /// 64 KiB result with the longest key, and a ListUncertain page of 1000
    /// attempts at every bound.
    #[test]
    fn the_largest_valid_requests_fit_the_default_limit() {
        let tools: Vec<String> = (0..MAX_TOOLS).map(|i| format!("{i:0>128}")).collect();
        let create = pb::CreatePermitRequest {
            permit: Some(pb::Permit {
                subject: "s".repeat(MAX_TEXT_LEN),
                currency: "c".repeat(16),
                max_calls_per_tool: tools.iter().map(|t| (t.clone(), u64::MAX)).collect(),
                tools,
                budget: Some(i64::MAX),
                agents: (0..MAX_AGENTS).map(|i| format!("{i:0>64}")).collect(),
                ..Default::default()
            }),
        };
        let commit = pb::CommitRequest {
            permit_id: uuid::Uuid::nil().to_string(),
            idempotency_key: "k".repeat(MAX_KEY_LEN),
            attempt_id: uuid::Uuid::nil().to_string(),
            outcome: Some(pb::commit_request::Outcome::Succeeded(pb::Succeeded {
                result: vec![0xff; MAX_RESULT_BYTES],
                actual_cost: Some(i64::MAX),
            })),
        };
        let ts = Some(prost_types::Timestamp {
            seconds: i64::MAX,
            nanos: 999_999_999,
        });
        let attempt = pb::Attempt {
            attempt_id: uuid::Uuid::nil().to_string(),
            permit_id: uuid::Uuid::nil().to_string(),
            tool: "t".repeat(128),
            idempotency_key: "k".repeat(MAX_KEY_LEN),
            request_fingerprint: vec![0xff; 64],
            state: i32::MAX,
            cost: i64::MAX,
            created_at: ts,
            lease_expires_at: ts,
            uncertain_reason: "r".repeat(MAX_TEXT_LEN),
            uncertain_since: ts,
            ..Default::default()
        };
        let page = pb::ListUncertainResponse {
            attempts: vec![attempt; crate::api::permits::MAX_PAGE_SIZE],
            next_page_token: "p".repeat(512),
        };
        let answer = page.encoded_len();
        let most = Limits::DEFAULT.max_response_bytes;
        println!("largest ListUncertain page: {answer} bytes (limit {most})");
        assert!(answer < most, "{answer} bytes");
        let limit = Limits::DEFAULT.max_request_bytes;
        for (rpc, size) in [
            ("CreatePermit", create.encoded_len()),
            ("Commit", commit.encoded_len()),
        ] {
            println!("largest valid {rpc}: {size} bytes (limit {limit})");
            assert!(size < limit, "{rpc}: {size} bytes");
        }
    }
}
