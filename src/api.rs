//! The gRPC edge: the `atmost.v1.Gate` and `atmost.v1.Permits` services.
//! Each handler decodes its request into a domain command, validates it,
//! calls the store with the service's one clock, and encodes the answer.
//! Errors become gRPC statuses only in [`status`].

pub mod convert;
pub mod gate;
pub mod permits;
pub mod status;

use crate::domain::{Clock, Error};
use crate::store::Backend;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// What every handler shares: the store, the clock and the store deadline.
#[derive(Clone)]
pub struct Ctx {
    pub store: Arc<Backend>,
    pub clock: Arc<dyn Clock>,
    /// Longest a store call may take before the RPC answers UNAVAILABLE.
    /// A call cut off here may still have been applied: a retry with the
    /// same idempotency key then sees it (REPLAY or IN_PROGRESS), never a
    /// second DISPATCH.
    pub store_timeout: Duration,
    /// Admission: at most this many store calls in flight; past it, requests
    /// are shed at once (OVERLOADED) instead of queueing without bound.
    pub in_flight: Arc<Semaphore>,
    pub max_in_flight: usize,
}

impl Ctx {
    /// Runs one store call under the store deadline, if there is room for
    /// it; sheds it (changing nothing) if there is not.
    pub async fn call<T>(&self, fut: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        let Ok(_slot) = self.in_flight.try_acquire() else {
            return Err(Error::Overloaded {
                in_flight: self.max_in_flight,
            });
        };
        self.deadline(fut).await
    }

    /// Runs one store call under the store deadline, without admission (for
    /// the health check, which must not be shed).
    pub async fn deadline<T>(
        &self,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        match tokio::time::timeout(self.store_timeout, fut).await {
            Ok(result) => result,
            Err(_) => Err(Error::StoreUnavailable(format!(
                "no answer within {:?}",
                self.store_timeout
            ))),
        }
    }
}
