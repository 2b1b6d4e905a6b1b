//! The gRPC edge: the `atmost.v1.Gate` and `atmost.v1.Permits` services,
//! and the Envoy front doors ([`envoy`]: ext_authz and ext_proc), which
//! call the Gate's own methods. Each handler decodes its request into a
//! domain command, validates it, calls the store with the service's one
//! clock, and encodes the answer. Errors become gRPC statuses only in
//! [`status`] (and HTTP answers, from the same table, in [`envoy`]).

pub mod approvals;
pub mod audit;
pub mod convert;
pub mod envoy;
#[cfg(test)]
pub(crate) mod fuzz;
pub mod gate;
pub mod layers;
pub mod permits;
pub mod receipts;
pub mod status;

use crate::auth::{Identity, Role};
use crate::domain::{Clock, Error, Scope};
use crate::store::Backend;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::metadata::MetadataMap;

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
    /// Slots for store calls ([`crate::admission`]).
    pub admission: Arc<crate::admission::Admission>,
    /// Signs the receipts answers carry; `None`: unsigned.
    pub receipts: Option<Arc<crate::receipts::ReceiptSigner>>,
    /// The bounds on an approval rule's wait (--approval-wait-default,
    /// --approval-wait-max).
    pub approval_waits: crate::domain::ApprovalWaits,
    /// Wakes the Authorize calls waiting for an approval decided here.
    pub decisions: Arc<approvals::Decisions>,
}

impl Ctx {
    /// Runs one store call under the store deadline, if the caller still
    /// waits for it; refuses it (changing nothing) if not. `fut` is not
    /// polled when refused, so no store transition starts. It waits up to
    /// `--max-queue-wait` for an admission slot ([`crate::admission`]),
    /// held for the store call only.
    pub async fn call<T>(
        &self,
        deadline: Deadline,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if deadline.passed() {
            return Err(Error::DeadlineExceeded);
        }
        let _slot = self.admission.admit().await?;
        // The wait for a slot may have outlasted the caller.
        if deadline.passed() {
            return Err(Error::DeadlineExceeded);
        }
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

// === the caller's deadline ===

/// The caller's [`Scope`]: the tenant of its key ("" in dev mode), and,
/// for an RPC a permit's `agents` list limits, its key id unless the key
/// holds one of the `unlimited` roles.
pub fn scope_of<T>(request: &tonic::Request<T>, unlimited: &[Role]) -> Scope {
    match request.extensions().get::<Arc<Identity>>() {
        Some(caller) => Scope {
            tenant: caller.tenant.clone(),
            agent: (!caller.roles.iter().any(|r| unlimited.contains(r)))
                .then(|| caller.key_id.clone()),
            key_id: caller.key_id.clone(),
        },
        None => Scope::default(),
    }
}

/// [`scope_of`] for an RPC no `agents` list limits.
pub fn tenant_of<T>(request: &tonic::Request<T>) -> Scope {
    scope_of(
        request,
        &[Role::Agent, Role::Operator, Role::Approver, Role::Admin],
    )
}

/// When the caller stops waiting: the moment its request reached the
/// service plus its `grpc-timeout`, if it sent one. A request whose deadline
/// has passed when its turn comes never starts a store transition: the
/// caller has gone, and a late transition (an Authorize after the key's
/// holder released it) would change state nobody asked to change any more.
/// (tonic also cancels a handler at the deadline, but only at its first
/// wait, which for the Redis store is after the script was sent.)
#[derive(Debug, Clone, Copy, Default)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// The deadline [`stamp`] recorded on `request` (none without it).
    pub fn of<T>(request: &tonic::Request<T>) -> Self {
        request
            .extensions()
            .get::<Deadline>()
            .copied()
            .unwrap_or_default()
    }

    fn passed(self) -> bool {
        self.0.is_some_and(|at| Instant::now() >= at)
    }

    /// When the caller stops waiting, if it said.
    pub fn at(self) -> Option<Instant> {
        self.0
    }
}

/// An interceptor for every atmost service: records the request's
/// [`Deadline`] as it arrives, before its body is decoded.
pub fn stamp(mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    // Only a request with a deadline gets an extension (the first one
    // allocates the request's extension map): none is the default.
    if let Some(at) = grpc_timeout(request.metadata()).and_then(|t| Instant::now().checked_add(t)) {
        request.extensions_mut().insert(Deadline(Some(at)));
    }
    Ok(request)
}

/// The `grpc-timeout` header: up to 8 digits and a unit (H, M, S, m, u, n),
/// per the gRPC over HTTP/2 spec. A malformed one is ignored, as tonic
/// ignores it.
fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::grpc_timeout;
    use std::time::Duration;
    use tonic::metadata::MetadataMap;

    fn parse(value: &str) -> Option<Duration> {
        let mut m = MetadataMap::new();
        m.insert("grpc-timeout", value.parse().expect("ascii"));
        grpc_timeout(&m)
    }

    #[test]
    fn grpc_timeout_reads_every_unit_and_ignores_what_is_malformed() {
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("10S"), Some(Duration::from_secs(10)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("1n"), Some(Duration::from_nanos(1)));
        assert_eq!(parse("99999999S"), Some(Duration::from_secs(99_999_999)));
        for bad in ["", "S", "123456789S", "10", "10s", "-1S", "1.5S", "10X"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&MetadataMap::new()), None);
    }
}
