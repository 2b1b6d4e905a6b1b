//! Transport limits: what one client may cost the server before a single
//! request is decoded. HTTP/2 and gRPC limits are handed to tonic and h2;
//! what they do not offer is here:
//!
//! - a cap on open connections ([`Limits::max_connections`]): past it, a
//!   new connection is closed as soon as it is accepted;
//! - a handshake deadline: a connection that has not finished its TLS
//!   handshake, if any, and sent the HTTP/2 preface (or an HTTP/1.1
//!   request's first bytes) within [`Limits::handshake_timeout`] is
//!   closed;
//! - an idle timeout: a connection with no RPC open for
//!   [`Limits::idle_timeout`] is closed (keepalive PINGs do not count);
//! - a hard end to a connection's life: tonic sends GOAWAY at
//!   [`Limits::max_connection_age`]; a connection still open
//!   [`Limits::max_connection_age_grace`] later is closed here (tonic's own
//!   grace, when set, replaces the GOAWAY instead of following it).
//!
//! Each accepted socket becomes a [`Conn`], which enforces the deadlines on
//! its reads, and over TLS ([`tls`]) the stream on top of it; [`Track`]
//! counts the RPCs open on each connection.

mod tls;

pub use tls::Tls;

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
use tokio_rustls::rustls::pki_types::CertificateDer;
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
    /// (MESSAGE_TOO_LARGE, [`crate::api::layers::MessageLimit`]) before their body is buffered.
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
    /// The TLS handshake, if any, and then the HTTP/2 preface (over
    /// HTTP/1.1, the request's first 24 bytes) must arrive within this,
    /// counted from the accept. [`Conn`] sits under TLS; over TLS the
    /// preface is counted on what TLS decrypts.
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

    /// tonic's server with these limits applied (the rest is [`Conn`]'s),
    /// taking HTTP/1.1 connections too if `http1` (for the HTTP/JSON edge;
    /// gRPC is HTTP/2 only).
    pub fn server(&self, http1: bool) -> tonic::transport::Server {
        tonic::transport::Server::builder()
            .max_concurrent_streams(self.max_concurrent_streams)
            .http2_max_header_list_size(self.max_header_list_bytes)
            .http2_keepalive_interval(Some(self.keepalive_interval))
            .http2_keepalive_timeout(Some(self.keepalive_timeout))
            .max_connection_age(self.max_connection_age)
            // The request timeout is RequestTimeout's, below the HTTP/JSON
            // edge.
            .accept_http1(http1)
            .http2_max_pending_accept_reset_streams(Some(self.max_pending_accept_reset_streams))
            .http2_max_local_error_reset_streams(Some(self.max_local_error_reset_streams))
    }

    /// The connections the listeners accept, each a [`Conn`] under these
    /// limits that knows what its listener [`Serves`], over `tls` if given
    /// (once its handshake is done, within the handshake timeout); past
    /// `max_connections` (all listeners together), a new one is closed at
    /// once.
    pub fn incoming(
        &self,
        listeners: Vec<(TcpListener, Serves)>,
        tls: Option<Tls>,
    ) -> impl Stream<Item = io::Result<Io>> + use<> {
        let http1 = http1(&listeners);
        let accepted = self.accepted(listeners);
        match tls {
            None => futures_util::future::Either::Left(accepted.map(|conn| conn.map(Io::Plain))),
            Some(tls) => futures_util::future::Either::Right(
                tls.accept(accepted, self.handshake_timeout, http1)
                    .map(|conn| conn.map(Io::Tls)),
            ),
        }
    }

    fn accepted(
        &self,
        listeners: Vec<(TcpListener, Serves)>,
    ) -> impl Stream<Item = io::Result<Conn>> + Send + use<> {
        let slots = Arc::new(Semaphore::new(self.max_connections.max(1)));
        let limits = Arc::new(self.clone());
        let refused = Arc::new(Refusals::default());
        // Small unary replies must not wait for Nagle's algorithm.
        let accepted = listeners.into_iter().map(|(listener, serves)| {
            TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .map(move |accepted| accepted.map(|stream| (stream, serves)))
        });
        tokio_stream::StreamExt::filter_map(
            futures_util::stream::select_all(accepted),
            move |accepted| match accepted {
                Err(e) => Some(Err(e)),
                Ok((stream, serves)) => match slots.clone().try_acquire_owned() {
                    Ok(slot) => Some(Ok(Conn::new(stream, slot, limits.clone(), serves))),
                    Err(_) => {
                        refused.note(limits.max_connections);
                        None
                    }
                },
            },
        )
    }
}

/// What a listener serves: the default `--listen` serves both edges; with
/// `--http-listen`, each serves one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    /// gRPC and HTTP/JSON, told apart by each request's content type.
    Both,
    /// gRPC only.
    Grpc,
    /// HTTP/JSON only.
    Json,
}

/// Whether HTTP/1.1 is served on `listeners`: where HTTP/JSON is, on any
/// of them (gRPC is HTTP/2's), so that an HTTP/1.1 caller on a gRPC-only
/// listener is told where JSON is served. Without it (`--http=false`) the
/// service is HTTP/2 only, as it was before the HTTP/JSON edge.
pub fn http1(listeners: &[(TcpListener, Serves)]) -> bool {
    listeners.iter().any(|(_, serves)| *serves != Serves::Grpc)
}

impl Serves {
    /// What the listener of `request`'s connection serves ([`Serves::Both`]
    /// for a request that did not come through [`Limits::incoming`]).
    pub fn of<B>(request: &http::Request<B>) -> Serves {
        conn_info(request).map_or(Serves::Both, |info| info.serves)
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

/// What tonic puts in every request's extensions for a connection.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub tcp: TcpConnectInfo,
    activity: Arc<Activity>,
    serves: Serves,
    /// Over TLS, the client's certificate chain if it sent one, verified
    /// against the client CA (`--tls-client-ca`).
    peer_certs: Option<Arc<[CertificateDer<'static>]>>,
}

/// One accepted connection under the [`Limits`]: it holds a connection
/// slot until dropped, and fails its reads (which closes it) past the
/// handshake deadline, the idle timeout or its age plus grace.
pub struct Conn {
    io: TcpStream,
    _slot: OwnedSemaphorePermit,
    limits: Arc<Limits>,
    accepted: Instant,
    /// Bytes of the HTTP preface read so far, up to its length.
    preface_read: u64,
    /// Over TLS, the preface is counted on the bytes the TLS stream
    /// decrypts, not on these ([`Conn::count_preface`]): the ClientHello
    /// alone would pass for it, and a client silent after its handshake
    /// would hold its slot until the idle timeout.
    preface_decrypted: bool,
    activity: Arc<Activity>,
    timer: Pin<Box<Sleep>>,
    serves: Serves,
}

impl Conn {
    fn new(io: TcpStream, slot: OwnedSemaphorePermit, limits: Arc<Limits>, serves: Serves) -> Self {
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
            preface_decrypted: false,
            activity,
            timer: Box::pin(tokio::time::sleep_until(first)),
            serves,
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
        if !self.preface_decrypted {
            self.count_preface(buf.filled().len() - before)?;
        }
        Poll::Ready(Ok(()))
    }
}

impl Conn {
    /// `read` more bytes of the peer's HTTP (its HTTP/2 preface, or an
    /// HTTP/1.1 request's first bytes): once the preface's length has
    /// come, the idle timeout applies instead of the handshake deadline.
    fn count_preface(&mut self, read: usize) -> io::Result<()> {
        if self.preface_read < PREFACE_LEN {
            self.preface_read = (self.preface_read + read as u64).min(PREFACE_LEN);
            if self.preface_read == PREFACE_LEN {
                let next = self.next_deadline(Instant::now())?;
                self.timer.as_mut().reset(next);
            }
        }
        Ok(())
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

impl Conn {
    fn info(&self, peer_certs: Option<Arc<[CertificateDer<'static>]>>) -> ConnInfo {
        ConnInfo {
            tcp: self.io.connect_info(),
            activity: self.activity.clone(),
            serves: self.serves,
            peer_certs,
        }
    }
}

/// A connection as served: in plaintext, or over TLS.
pub enum Io {
    Plain(Conn),
    Tls(tls::TlsConn),
}

impl Connected for Io {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        match self {
            Io::Plain(conn) => conn.info(None),
            Io::Tls(stream) => stream.get_ref().0.info(tls::peer_certs(stream)),
        }
    }
}

/// Each of [`Io`]'s methods, on the connection it is.
macro_rules! on_io {
    ($self:ident, $io:ident => $call:expr) => {
        match $self.get_mut() {
            Io::Plain($io) => {
                let $io = Pin::new($io);
                $call
            }
            Io::Tls($io) => {
                let $io = Pin::new(&mut **$io);
                $call
            }
        }
    };
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(conn) => Pin::new(conn).poll_read(cx, buf),
            Io::Tls(stream) => {
                let before = buf.filled().len();
                ready!(Pin::new(&mut **stream).poll_read(cx, buf))?;
                // What TLS decrypted is the preface's.
                stream
                    .get_mut()
                    .0
                    .count_preface(buf.filled().len() - before)?;
                Poll::Ready(Ok(()))
            }
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        on_io!(self, io => io.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_io!(self, io => io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_io!(self, io => io.poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        on_io!(self, io => io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(io) => io.is_write_vectored(),
            Io::Tls(io) => io.is_write_vectored(),
        }
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

/// The connection's info (none for a request that did not come through
/// [`Limits::incoming`]).
fn conn_info<B>(request: &http::Request<B>) -> Option<&ConnInfo> {
    request.extensions().get::<ConnInfo>()
}

/// The client certificate chain of `request`'s connection, if it came over
/// TLS with one, verified against `--tls-client-ca`.
pub fn peer_certs<B>(request: &http::Request<B>) -> Option<&[CertificateDer<'static>]> {
    conn_info(request)?.peer_certs.as_deref()
}

/// The connection's activity.
fn activity_of<B>(request: &http::Request<B>) -> Option<Arc<Activity>> {
    conn_info(request).map(|info| info.activity.clone())
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
