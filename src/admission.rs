//! Admission: how much store-bound work the server takes on at once, decided
//! before a request's body is read, so refusing the excess costs little.
//!
//! At most `max_in_flight` atmost RPCs (Gate and Permits) run at once. One
//! that finds them all busy waits for a slot, first come first served, but
//! never longer than `max_wait` from when the server read it: past it, it
//! is refused with UNAVAILABLE / OVERLOADED (and RetryInfo), having changed
//! nothing. The wait counts from the request's arrival, not from its first
//! poll: on a saturated machine the queue is the runtime's, ahead of any
//! slot (measured: at 150% of peak, no slot was ever short while requests
//! waited 0.3 s for a CPU), and a request already late is refused at once. A request that waited
//! the whole `max_wait` shows a standing queue, so, in the spirit of CoDel,
//! for the next [`INTERVAL`] a request that finds no free slot is refused at
//! once instead of joining the queue: the queue drains, and the requests
//! admitted meanwhile wait about as long as below the peak. A burst below
//! the peak waits a little instead of being refused.
//!
//! Health, reflection and the receipt keys are never shed.

use crate::api::status::to_status;
use crate::domain::Error;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// How long, after a request waited the whole `max_wait`, requests that
/// find no free slot are refused at once (CoDel's interval).
pub const INTERVAL: Duration = Duration::from_millis(100);

/// The admission state shared by every connection.
#[derive(Debug)]
pub struct Admission {
    slots: Arc<Semaphore>,
    max_in_flight: usize,
    max_wait: Duration,
    /// Until when (ns from `base`) a request without a free slot is
    /// refused at once.
    shed_until_ns: AtomicU64,
    base: Instant,
}

impl Admission {
    pub fn new(max_in_flight: usize, max_wait: Duration) -> Self {
        let max_in_flight = max_in_flight.max(1);
        Self {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            max_wait,
            shed_until_ns: AtomicU64::new(0),
            base: Instant::now(),
        }
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn overloaded(&self) -> Error {
        Error::Overloaded {
            in_flight: self.max_in_flight,
        }
    }

    /// A slot, held until the returned permit is dropped; or OVERLOADED.
    /// `arrived`: when the request reached the server. Its wait so far (for
    /// a CPU, before this was first polled) counts against `max_wait` too:
    /// past peak on a saturated machine the queue is the runtime's, ahead
    /// of any slot, and a request already late is refused at once, cheaply,
    /// instead of adding its work to the lateness of the rest.
    pub async fn admit(&self, arrived: Instant) -> Result<OwnedSemaphorePermit, Error> {
        let waited = arrived.elapsed();
        if waited > self.max_wait.max(MIN_SOJOURN) {
            self.dropping();
            return Err(self.overloaded());
        }
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        if self.now_ns() < self.shed_until_ns.load(Ordering::Relaxed) || self.max_wait.is_zero() {
            return Err(self.overloaded());
        }
        let left = self.max_wait.saturating_sub(waited);
        match tokio::time::timeout(left, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            // Closed (never: the semaphore lives as long as this), or the
            // whole wait passed: a standing queue.
            _ => {
                self.dropping();
                Err(self.overloaded())
            }
        }
    }

    /// A request waited the whole `max_wait`: for [`INTERVAL`], one that
    /// finds no free slot is refused at once.
    fn dropping(&self) {
        let until = self.now_ns().saturating_add(INTERVAL.as_nanos() as u64);
        self.shed_until_ns.fetch_max(until, Ordering::Relaxed);
    }
}

/// The least wait before admission a request may have had before it is
/// refused as late, whatever `max_wait` (0 means no wait for a slot, not
/// that any delay at all refuses).
const MIN_SOJOURN: Duration = Duration::from_millis(1);

/// Whether a path is an atmost RPC that reaches the store.
fn admitted_path(path: &str) -> bool {
    path.starts_with("/atmost.v1.Gate/") || path.starts_with("/atmost.v1.Permits/")
}

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

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Reads what a shed request's body has left, up to [`MAX_DRAINED`] bytes
/// and [`DRAIN_WAIT`], before it is answered. Answered with its body unread,
/// HTTP/2 would reset the stream (RST_STREAM NO_ERROR), and h2 counts such
/// resets against `--h2-max-local-resets`: a client shed a thousand times
/// on one connection would lose it, every RPC on it with it, to GOAWAY
/// ENHANCE_YOUR_CALM. A request's body has usually arrived with it.
async fn drain<B: http_body::Body>(body: B) {
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

/// The most of a shed request's body [`drain`] reads (a valid request is
/// at most about 70 KiB), and how long it waits for it.
const MAX_DRAINED: usize = 128 * 1024;
const DRAIN_WAIT: Duration = Duration::from_millis(5);

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
            match admission.admit(arrived).await {
                Ok(slot) => {
                    let response = inner.call(request).await;
                    drop(slot);
                    response
                }
                Err(e) => {
                    drain(request.into_body()).await;
                    Ok(to_status(e).into_http())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_waits_at_most_max_wait_then_sheds_at_once_for_an_interval() {
        let admission = Admission::new(1, Duration::from_millis(10));
        let held = admission
            .admit(tokio::time::Instant::now())
            .await
            .expect("a free slot");
        // No slot: waits the whole 10 ms, then is refused.
        let started = tokio::time::Instant::now();
        assert!(admission.admit(tokio::time::Instant::now()).await.is_err());
        assert_eq!(started.elapsed(), Duration::from_millis(10));
        // A standing queue: refused at once for the interval.
        let started = tokio::time::Instant::now();
        assert!(admission.admit(tokio::time::Instant::now()).await.is_err());
        assert_eq!(started.elapsed(), Duration::ZERO);
        // A free slot is taken even then.
        drop(held);
        let held = admission
            .admit(tokio::time::Instant::now())
            .await
            .expect("a free slot");
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_already_late_is_refused_at_once_with_slots_free() {
        let admission = Admission::new(4, Duration::from_millis(10));
        let arrived = Instant::now();
        tokio::time::advance(Duration::from_millis(11)).await;
        assert!(admission.admit(arrived).await.is_err(), "11 ms late");
        let arrived = Instant::now();
        tokio::time::advance(Duration::from_millis(9)).await;
        assert!(admission.admit(arrived).await.is_ok(), "9 ms: in time");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_freed_within_the_wait_admits_the_waiter() {
        let admission = Arc::new(Admission::new(1, Duration::from_millis(10)));
        let held = admission
            .admit(tokio::time::Instant::now())
            .await
            .expect("a free slot");
        let waiter = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit(tokio::time::Instant::now()).await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(held);
        assert!(waiter.await.expect("task").is_ok(), "admitted after 5 ms");
    }
}
