//! Admission: how much store-bound work the server takes on at once.
//!
//! Two steps. Before a request's body is read ([`crate::api::layers::AdmissionLayer`]), a
//! request that is already late, or that arrives while a standing queue is
//! being shed, is refused: refusing the excess there costs little. Once
//! the request is decoded ([`Admission::admit`], from `api::Ctx::call`), it
//! takes a slot for its store call: a body that trickles in never holds
//! one.
//!
//! At most `max_in_flight` store calls (of Gate and Permits RPCs) run at
//! once. One that finds them all busy waits for a slot, first come first
//! served, but never longer than `max_wait`: past it, it is refused with
//! UNAVAILABLE / OVERLOADED (and RetryInfo), having changed nothing. A
//! request that waited the whole `max_wait` shows a standing queue, so, in
//! the spirit of CoDel, for the next [`INTERVAL`] a request that finds no
//! free slot is refused at once, before its body is decoded: the queue
//! drains, and the requests admitted meanwhile wait about as long as below
//! the peak. A burst below the peak waits a little instead of being
//! refused.
//!
//! On a saturated machine the queue is also the runtime's, ahead of any
//! slot (measured: at 150% of peak, with 100 streams per connection, no
//! slot was ever short while requests waited 0.3 s for a CPU). So the layer
//! also times how long each request waited before a worker first ran it,
//! and once every request has come later than `max_wait` for an
//! [`INTERVAL`], it refuses the late ones before decoding them.
//!
//! Health, reflection and the receipt keys are never shed.

use crate::domain::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Since when (ns from `base`) every request has come late; 0: the
    /// last one was in time.
    late_since_ns: AtomicU64,
    base: Instant,
    /// Requests refused before their body was read, and after waiting for
    /// a slot (or finding none while shedding): for the metrics.
    shed_before_body: AtomicU64,
    shed_queue: AtomicU64,
}

impl Admission {
    pub fn new(max_in_flight: usize, max_wait: Duration) -> Self {
        let max_in_flight = max_in_flight.max(1);
        Self {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            max_wait,
            shed_until_ns: AtomicU64::new(0),
            late_since_ns: AtomicU64::new(0),
            base: Instant::now(),
            shed_before_body: AtomicU64::new(0),
            shed_queue: AtomicU64::new(0),
        }
    }

    /// Store calls holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.max_in_flight
            .saturating_sub(self.slots.available_permits())
    }

    /// The number of slots (`--max-in-flight`).
    pub fn limit(&self) -> usize {
        self.max_in_flight
    }

    /// Requests refused so far: (before their body, waiting for a slot).
    pub fn shed(&self) -> (u64, u64) {
        (
            self.shed_before_body.load(Ordering::Relaxed),
            self.shed_queue.load(Ordering::Relaxed),
        )
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn overloaded(&self) -> Error {
        Error::Overloaded {
            in_flight: self.max_in_flight,
        }
    }

    /// Before the request's body is decoded: refuses, cheaply, a request
    /// that came late (it waited longer than `max_wait` for a worker) once
    /// every request has for an [`INTERVAL`], and, while a standing queue
    /// is being shed, one that would find no free slot.
    pub fn precheck(&self, arrived: Instant) -> Result<(), Error> {
        if self.late(arrived) {
            self.dropping();
            return Err(self.shed_at(&self.shed_before_body));
        }
        if self.slots.available_permits() == 0 && self.shedding() {
            return Err(self.shed_at(&self.shed_before_body));
        }
        Ok(())
    }

    /// OVERLOADED, counted where it was decided.
    fn shed_at(&self, counter: &AtomicU64) -> Error {
        counter.fetch_add(1, Ordering::Relaxed);
        self.overloaded()
    }

    /// A slot for one store call, held until the permit is dropped; or
    /// OVERLOADED after waiting `max_wait` for one. Taken once the request
    /// is decoded, so a body that trickles in never holds a slot.
    pub async fn admit(&self) -> Result<OwnedSemaphorePermit, Error> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        if self.shedding() || self.max_wait.is_zero() {
            return Err(self.shed_at(&self.shed_queue));
        }
        match tokio::time::timeout(self.max_wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            // Closed (never: the semaphore lives as long as this), or the
            // whole wait passed: a standing queue.
            _ => {
                self.dropping();
                Err(self.shed_at(&self.shed_queue))
            }
        }
    }

    /// Whether a request that arrived at `arrived` is late, CoDel's way:
    /// it waited longer than `max_wait`, and so has every request since
    /// the first late one at least [`INTERVAL`] ago. One slow moment (a
    /// busy machine, a pause) refuses nothing; a standing queue does.
    fn late(&self, arrived: Instant) -> bool {
        if arrived.elapsed() <= self.max_wait.max(MIN_SOJOURN) {
            self.late_since_ns.store(0, Ordering::Relaxed);
            return false;
        }
        // 0 means "not late": the first late moment is stored as 1 or more.
        let now = self.now_ns().max(1);
        match self
            .late_since_ns
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => false,
            Err(since) => now.saturating_sub(since) >= INTERVAL.as_nanos() as u64,
        }
    }

    fn shedding(&self) -> bool {
        self.now_ns() < self.shed_until_ns.load(Ordering::Relaxed)
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
pub(crate) fn admitted_path(path: &str) -> bool {
    path.starts_with("/atmost.v1.Gate/")
        || path.starts_with("/atmost.v1.Permits/")
        || path == "/envoy.service.auth.v3.Authorization/Check"
        || path == "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_queue_waits_at_most_max_wait_then_sheds_at_once_for_an_interval() {
        let admission = Admission::new(1, Duration::from_millis(10));
        let held = admission.admit().await.expect("a free slot");
        // No slot: waits the whole 10 ms, then is refused.
        let started = Instant::now();
        assert!(admission.admit().await.is_err());
        assert_eq!(started.elapsed(), Duration::from_millis(10));
        // A standing queue: refused at once for the interval, before the
        // body too.
        let started = Instant::now();
        assert!(admission.admit().await.is_err());
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert!(admission.precheck(Instant::now()).is_err());
        // Counted where each was refused, for the metrics.
        assert_eq!(admission.shed(), (1, 2));
        assert_eq!((admission.in_flight(), admission.limit()), (1, 1));
        // A free slot is taken even then.
        drop(held);
        assert!(admission.precheck(Instant::now()).is_ok());
        let held = admission.admit().await.expect("a free slot");
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_late_for_an_interval_are_refused_before_their_body() {
        let admission = Admission::new(4, Duration::from_millis(10));
        // A request that waited 11 ms before its first poll.
        async fn late(admission: &Admission) -> Result<(), Error> {
            let arrived = Instant::now();
            tokio::time::advance(Duration::from_millis(11)).await;
            admission.precheck(arrived)
        }
        // One late request, or a run of them shorter than the interval:
        // a slow moment, refused nothing.
        // (The first is seen 11 ms in; the tenth 99 ms after it.)
        for _ in 0..10 {
            assert!(late(&admission).await.is_ok());
        }
        // Late for the whole interval: a standing queue, refused.
        assert!(late(&admission).await.is_err(), "late for 110 ms");
        // One in time ends it.
        assert!(admission.precheck(Instant::now()).is_ok());
        tokio::time::advance(INTERVAL).await;
        assert!(late(&admission).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_freed_within_the_wait_admits_the_waiter() {
        let admission = Arc::new(Admission::new(1, Duration::from_millis(10)));
        let held = admission.admit().await.expect("a free slot");
        let waiter = tokio::spawn({
            let admission = admission.clone();
            async move { admission.admit().await.map(drop) }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        drop(held);
        assert!(waiter.await.expect("task").is_ok(), "admitted after 5 ms");
    }
}
