//! The gRPC edge's tower layers, run in front of every service (and so
//! behind the HTTP/JSON edge too, which transcodes into them). Each asks a
//! core piece for its verdict (who is calling: [`crate::auth`]; whether
//! there is room: [`crate::admission`]; how long a request may take and how
//! large its messages may be: [`crate::transport::Limits`]) and encodes a
//! refusal as a gRPC status ([`super::status`]), the one place it becomes
//! one.

use super::status::to_status;
use crate::admission::{Admission, admitted_path};
use crate::auth::{Authenticator, allowed_roles, check};
use crate::domain::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::time::Instant;

/// The tower layer that admits requests to the store-bound services.
#[derive(Debug, Clone)]
pub struct AdmissionLayer {
    admission: Arc<Admission>,
}

impl AdmissionLayer {
    pub fn new(admission: Arc<Admission>) -> Self {
        Self { admission }
    }
}

impl<S> tower::Layer<S> for AdmissionLayer {
    type Service = Admitted<S>;

    fn layer(&self, inner: S) -> Admitted<S> {
        Admitted {
            inner,
            admission: self.admission.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Admitted<S> {
    inner: S,
    admission: Arc<Admission>,
}

/// The future of a boxed tower service (the admission and auth layers).
pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Reads what a refused request's body has left, up to [`MAX_DRAINED`] bytes
/// and [`DRAIN_WAIT`], before it is answered. Answered with its body unread,
/// HTTP/2 would reset the stream (RST_STREAM NO_ERROR), and h2 counts such
/// resets against `--h2-max-local-resets`: a client shed a thousand times
/// on one connection would lose it, every RPC on it with it, to GOAWAY
/// ENHANCE_YOUR_CALM. A request's body has usually arrived with it.
pub(crate) async fn drain<B: http_body::Body>(body: B) {
    let mut body = std::pin::pin!(body);
    let mut read = 0usize;
    let _ = tokio::time::timeout(DRAIN_WAIT, async {
        while read <= MAX_DRAINED {
            match std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
                Some(Ok(frame)) => {
                    read += frame.data_ref().map_or(0, bytes::Buf::remaining);
                }
                _ => return,
            }
        }
    })
    .await;
}

/// The answer to a request refused before its service ran (by admission,
/// or by the auth layer): its error, once its body is [`drain`]ed.
pub(crate) async fn refuse<B: http_body::Body>(
    body: B,
    error: Error,
) -> http::Response<tonic::body::Body> {
    drain(body).await;
    to_status(error).into_http()
}

/// The most of a shed request's body [`drain`] reads (a valid request is
/// at most 75 939 bytes), and how long it waits for it.
const MAX_DRAINED: usize = 128 * 1024;
const DRAIN_WAIT: Duration = Duration::from_millis(100);

impl<S, B> tower::Service<http::Request<B>> for Admitted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // The service that was polled ready serves this request; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !admitted_path(request.uri().path()) {
            return Box::pin(inner.call(request));
        }
        // Called as the connection reads the request; the future below is
        // first polled when a worker is free for it.
        let arrived = Instant::now();
        let admission = self.admission.clone();
        Box::pin(async move {
            match admission.precheck(arrived) {
                Ok(()) => inner.call(request).await,
                Err(e) => Ok(refuse(request.into_body(), e).await),
            }
        })
    }
}

// === the layer ===

/// Checks every atmost RPC's caller before the service sees it. Without an
/// [`Authenticator`] (dev mode), lets everything through.
#[derive(Clone, Default)]
pub struct AuthLayer {
    auth: Option<Arc<Authenticator>>,
}

impl AuthLayer {
    pub fn new(auth: Option<Arc<Authenticator>>) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthService {
            inner,
            auth: self.auth.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Option<Arc<Authenticator>>,
}

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if let (Some(auth), Some(allowed)) = (&self.auth, allowed_roles(request.uri().path())) {
            match check(auth, &request, request.uri().path(), allowed) {
                Ok(identity) => {
                    request.extensions_mut().insert(identity);
                }
                Err(e) => {
                    // The audit trail's event for a call refused here: the
                    // key's id when it was known, never the key.
                    let key_id = match &e {
                        Error::RoleNotAllowed { key_id, .. } => key_id.as_str(),
                        _ => "",
                    };
                    // Never waiting for room (audit::record_refusal), so
                    // this connection's task goes on at once.
                    crate::audit::record_refusal(&crate::audit::Event {
                        rpc: request.uri().path().rsplit('/').next().unwrap_or_default(),
                        key_id,
                        outcome: e.reason().as_str(),
                        ..crate::audit::Event::default()
                    });
                    // After its body is read ([`refuse`]).
                    return Box::pin(async move { Ok(refuse(request.into_body(), e).await) });
                }
            }
        }
        // The service that was polled ready serves this request; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(inner.call(request))
    }
}

// === the request timeout ===

/// The request timeout ([`crate::transport::Limits::request_timeout`]): an RPC whose handler
/// has not answered within it is cut off with CANCELLED "Timeout expired",
/// as tonic's own server timeout answers, marked [`RequestTimedOut`]. It
/// is a layer here, inside the HTTP/JSON edge ([`crate::http`]) rather
/// than around it as tonic's is, so that edge answers a timed-out JSON
/// request in JSON. (tonic still applies a gRPC caller's own
/// `grpc-timeout`, outside every layer; the HTTP/JSON edge refuses any
/// `grpc-*` header.)
#[derive(Debug, Clone, Copy)]
pub struct RequestTimeout(pub Duration);

/// In the extensions of the answer [`RequestTimeout`] gives: the RPC was
/// cut off by the server's timeout, not cancelled by its caller.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimedOut;

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

/// The one RPC whose handler may ask for more time: an Authorize with
/// `wait`, held open for an approval's decision (docs/api.md, "Human
/// approval"). Its request carries a [`WaitAllowance`].
const WAITING_RPC: &str = "/atmost.v1.Gate/Authorize";

/// More time an RPC's handler may take past the request timeout, granted
/// by the handler itself once its request is read (so a stalled body is
/// still cut at the timeout): in the extensions of an Authorize's request.
#[derive(Debug, Clone, Default)]
pub struct WaitAllowance(Arc<std::sync::atomic::AtomicU64>);

impl WaitAllowance {
    /// The RPC may take `by` more than the request timeout (at most one
    /// grant counts: the largest).
    pub fn extend(&self, by: Duration) {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.0.fetch_max(ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn granted(&self) -> Duration {
        Duration::from_millis(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }
}

pin_project_lite::pin_project! {
    /// The handler's future under the request timeout, extended by its
    /// [`WaitAllowance`] if it has one.
    pub struct Timed<F> {
        #[pin]
        inner: F,
        #[pin]
        sleep: tokio::time::Sleep,
        start: tokio::time::Instant,
        timeout: Duration,
        allowance: Option<WaitAllowance>,
    }
}

impl<F, E> Future for Timed<F>
where
    F: Future<Output = Result<http::Response<tonic::body::Body>, E>>,
{
    type Output = Result<http::Response<tonic::body::Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(answer) = this.inner.poll(cx) {
            return Poll::Ready(answer);
        }
        while this.sleep.as_mut().poll(cx).is_ready() {
            let granted = this.allowance.as_ref().map(WaitAllowance::granted);
            let deadline = *this.start + *this.timeout + granted.unwrap_or_default();
            if deadline <= this.sleep.deadline() {
                let mut answer = tonic::Status::cancelled("Timeout expired").into_http();
                answer.extensions_mut().insert(RequestTimedOut);
                return Poll::Ready(Ok(answer));
            }
            this.sleep.as_mut().reset(deadline);
        }
        Poll::Pending
    }
}

impl<S, B> tower::Service<http::Request<B>> for TimedOut<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Timed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let allowance = (request.uri().path() == WAITING_RPC).then(|| {
            let allowance = WaitAllowance::default();
            request.extensions_mut().insert(allowance.clone());
            allowance
        });
        let start = tokio::time::Instant::now();
        Timed {
            inner: self.inner.call(request),
            sleep: tokio::time::sleep_until(start + self.timeout),
            start,
            timeout: self.timeout,
            allowance,
        }
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
        let refused = to_status(crate::domain::Error::MessageTooLarge {
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
    use super::Frames;
    use crate::domain::{MAX_AGENTS, MAX_KEY_LEN, MAX_RESULT_BYTES, MAX_TEXT_LEN, MAX_TOOLS};
    use crate::pb;
    use crate::transport::Limits;
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
            attempts: vec![attempt; super::super::permits::MAX_PAGE_SIZE],
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
