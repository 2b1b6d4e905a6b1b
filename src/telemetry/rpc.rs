//! One RPC's telemetry, in one place: [`RpcLayer`] opens the span (its
//! parent the caller's `traceparent`), times the call, and when the answer
//! has gone maps its outcome to the span's attributes and to the metrics.
//! What only the handler knows (the permit, the tool, the decision) it
//! notes with [`note`] or [`note_permit`], and the one mapping
//! of errors to statuses notes the reason ([`note_reason`]); the notes go
//! to a task-local slot the layer reads back, so a handler records in one
//! line and nothing is recorded twice.

use super::{SPAN_TARGET, Shared};
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The atmost RPCs: (path, service, method). Any other path under
/// `/atmost.v1.` (one this version does not serve) is `_OTHER`, as the RPC
/// conventions name an unknown method, so labels stay bounded.
const METHODS: &[(&str, &str, &str)] = &[
    ("/atmost.v1.Gate/Authorize", "atmost.v1.Gate", "Authorize"),
    ("/atmost.v1.Gate/Commit", "atmost.v1.Gate", "Commit"),
    (
        "/atmost.v1.Gate/MarkUncertain",
        "atmost.v1.Gate",
        "MarkUncertain",
    ),
    (
        "/atmost.v1.Permits/CreatePermit",
        "atmost.v1.Permits",
        "CreatePermit",
    ),
    (
        "/atmost.v1.Permits/GetPermit",
        "atmost.v1.Permits",
        "GetPermit",
    ),
    (
        "/atmost.v1.Permits/GetAttempt",
        "atmost.v1.Permits",
        "GetAttempt",
    ),
    (
        "/atmost.v1.Permits/RevokePermit",
        "atmost.v1.Permits",
        "RevokePermit",
    ),
    (
        "/atmost.v1.Permits/ListUncertain",
        "atmost.v1.Permits",
        "ListUncertain",
    ),
    ("/atmost.v1.Permits/Resolve", "atmost.v1.Permits", "Resolve"),
    (
        "/atmost.v1.Approvals/ListApprovals",
        "atmost.v1.Approvals",
        "ListApprovals",
    ),
    (
        "/atmost.v1.Approvals/Approve",
        "atmost.v1.Approvals",
        "Approve",
    ),
    ("/atmost.v1.Approvals/Deny", "atmost.v1.Approvals", "Deny"),
    (
        "/atmost.v1.Receipts/GetSigningKeys",
        "atmost.v1.Receipts",
        "GetSigningKeys",
    ),
    // The Envoy front doors (crate::api::envoy): a Check, or a whole
    // ext_proc stream, is one RPC here.
    (
        "/envoy.service.auth.v3.Authorization/Check",
        "envoy.service.auth.v3.Authorization",
        "Check",
    ),
    (
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "Process",
    ),
];

/// An RPC as the telemetry names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Method {
    /// `atmost.v1.Gate/Authorize`: the span's name.
    pub(crate) name: &'static str,
    pub(crate) service: &'static str,
    pub(crate) method: &'static str,
}

impl Method {
    fn of(path: &str) -> Option<Self> {
        if let Some(&(path, service, method)) = METHODS.iter().find(|(p, _, _)| *p == path) {
            return Some(Self {
                name: &path[1..],
                service,
                method,
            });
        }
        path.starts_with("/atmost.v1.").then_some(Self {
            name: "atmost.v1/_OTHER",
            service: "_OTHER",
            method: "_OTHER",
        })
    }

    fn is_authorize(self) -> bool {
        self.name == "atmost.v1.Gate/Authorize"
    }

    /// ext_authz's Check: an Authorize whose refusals are answered inside
    /// a gRPC OK (an HTTP answer in the CheckResponse).
    fn is_check(self) -> bool {
        self.name == "envoy.service.auth.v3.Authorization/Check"
    }
}

/// What the handler and the error mapping noted about the RPC.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    /// Authorize's answer: DISPATCH, REDELIVERED or REPLAY.
    decision: Option<&'static str>,
    /// The ErrorInfo reason of the error answered.
    reason: Option<&'static str>,
    /// Authorize dispatched a new key whose request matched an earlier
    /// dispatch (`duplicate_of` set).
    duplicate_dispatched: bool,
}

/// The RPC being served, for the code it calls.
struct Current {
    outcome: Cell<Outcome>,
    shared: Arc<Shared>,
}

tokio::task_local! {
    static CURRENT: Current;
}

// === what handlers note ===

/// The longest value of a caller's a span attribute takes: every valid
/// permit id and tool fits; an invalid one is cut.
const MAX_ATTRIBUTE: usize = 256;

fn cut(value: &str) -> &str {
    if value.len() <= MAX_ATTRIBUTE {
        return value;
    }
    let mut end = MAX_ATTRIBUTE;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// What a handler learned about its RPC: the permit and the tool (empty:
/// not known), and `outcome` as the audit trail writes it (Authorize's
/// decision, an attempt's state, or a refusal's reason). Called by
/// [`crate::api::audit::Audit`] for every writing RPC. Never the attempt's
/// id: it is the fencing token Commit takes, operator data like the audit
/// trail, and a trace backend is seldom kept as close.
pub fn note(permit_id: &str, tool: &str, outcome: &str) {
    let _ = CURRENT.try_with(|current| {
        let decision = match outcome {
            "DISPATCH" => Some("DISPATCH"),
            "REDELIVERED" => Some("REDELIVERED"),
            "REPLAY" => Some("REPLAY"),
            "AWAIT_APPROVAL" => Some("AWAIT_APPROVAL"),
            _ => None,
        };
        if decision.is_some() {
            let mut o = current.outcome.get();
            o.decision = decision;
            current.outcome.set(o);
        }
        if current.shared.traces {
            let span = tracing::Span::current();
            for (field, value) in [("permit_id", permit_id), ("tool", tool)] {
                if !value.is_empty() {
                    span.record(field, cut(value));
                }
            }
            if let Some(decision) = decision {
                span.record("decision", decision);
            }
        }
    });
}

/// An Approve that completed a call's approval, or a Deny: `outcome`
/// (`approved`, `denied`) and how long the call had waited for it
/// (`atmost.approval.decision.duration`).
pub fn note_approval_decided(outcome: &'static str, waited: std::time::Duration) {
    let _ = CURRENT.try_with(|current| {
        if let Some(instruments) = &current.shared.instruments {
            instruments.approval_decided(outcome, waited);
        }
    });
}

/// The permit a read-only RPC (GetPermit, ListUncertain) is about.
pub fn note_permit(permit_id: &str) {
    note(permit_id, "", "");
}

/// Authorize dispatched a new key whose request matched an earlier
/// dispatch (the duplicate guard in LOG mode: `duplicate_of` set).
pub fn note_duplicate() {
    let _ = CURRENT.try_with(|current| {
        let mut o = current.outcome.get();
        o.duplicate_dispatched = true;
        current.outcome.set(o);
    });
}

/// The reason of the error the RPC answers ([`crate::api::status::to_status`]
/// calls it, so every error is noted once, wherever it was decided).
pub fn note_reason(reason: &'static str) {
    let _ = CURRENT.try_with(|current| {
        let mut o = current.outcome.get();
        o.reason = Some(reason);
        current.outcome.set(o);
    });
}

/// The counters of an Envoy front door's own task: an ext_proc stream is
/// driven by a task spawned beside its RPC, outside the RPC's task-local
/// notes, so it takes these with it when the stream opens
/// ([`EnvoyCounters::current`]). Counting nothing when metrics are off.
#[derive(Clone, Default)]
pub struct EnvoyCounters {
    shared: Option<Arc<Shared>>,
}

impl EnvoyCounters {
    /// The counters of the RPC being served (none outside an observed RPC).
    pub fn current() -> Self {
        Self {
            shared: CURRENT.try_with(|c| c.shared.clone()).ok(),
        }
    }

    /// An ext_proc request forwarded to the tool without an Authorize
    /// (`atmost.envoy.unauthorized_forwards`): its response arrived while
    /// atmost still awaited `awaiting`.
    pub fn unauthorized_forward(&self, awaiting: &'static str) {
        if let Some(instruments) = self.shared.as_ref().and_then(|s| s.instruments.as_ref()) {
            instruments.unauthorized_forward(awaiting);
        }
    }
}

/// Runs one store call (`operation`: the [`Store`](crate::store::Store)
/// method) in a child span of the RPC's, and times it. Outside an observed
/// RPC (telemetry off, or the server's own sweep) it is the call itself:
/// no span, no clock read, no allocation, no larger future.
pub fn store_call<'a, T: Send + 'a, E: Send + 'a>(
    operation: &'static str,
    store: &'static str,
    call: impl Future<Output = Result<T, E>> + Send + 'a,
) -> impl Future<Output = Result<T, E>> + Send + 'a {
    use tokio_util::either::Either;
    let Ok(shared) = CURRENT.try_with(|c| c.shared.clone()) else {
        return Either::Left(call);
    };
    let span = tracing::info_span!(
        target: SPAN_TARGET,
        "store",
        otel.name = operation,
        otel.kind = "internal",
        atmost.store = store,
        atmost.store.operation = operation,
    );
    Either::Right(Box::pin(async move {
        let started = Instant::now();
        let result = call.instrument(span).await;
        if let Some(instruments) = &shared.instruments {
            instruments.store_call(operation, result.is_ok(), started.elapsed());
        }
        result
    }))
}

// === the layer ===

/// The tower layer in front of every service: a span and the metrics for
/// each atmost RPC. Outermost, so it also sees what authentication and
/// admission refuse.
#[derive(Clone)]
pub struct RpcLayer {
    shared: Option<Arc<Shared>>,
}

impl RpcLayer {
    pub fn new(telemetry: &super::Telemetry) -> Self {
        Self {
            shared: telemetry.shared().cloned(),
        }
    }
}

impl<S> tower::Layer<S> for RpcLayer {
    type Service = Observed<S>;

    fn layer(&self, inner: S) -> Observed<S> {
        Observed {
            inner,
            shared: self.shared.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Observed<S> {
    inner: S,
    shared: Option<Arc<Shared>>,
}

/// The gRPC metadata, for the propagator.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Observed<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    /// The inner service's own future when nothing is observed: with
    /// telemetry off (and for health and reflection) this layer costs a
    /// branch, no allocation.
    type Future =
        tokio_util::either::Either<S::Future, BoxFuture<Result<Self::Response, Self::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        use tokio_util::either::Either;
        let Some(shared) = &self.shared else {
            return Either::Left(self.inner.call(request));
        };
        let Some(method) = Method::of(request.uri().path()) else {
            return Either::Left(self.inner.call(request));
        };
        let shared = shared.clone();
        // The service that was polled ready serves this request; a clone
        // takes its place for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let span = if shared.traces {
            let span = tracing::info_span!(
                target: SPAN_TARGET,
                "rpc",
                otel.name = method.name,
                otel.kind = "server",
                otel.status_code = tracing::field::Empty,
                rpc.system = "grpc",
                rpc.service = method.service,
                rpc.method = method.method,
                rpc.grpc.status_code = tracing::field::Empty,
                permit_id = tracing::field::Empty,
                tool = tracing::field::Empty,
                decision = tracing::field::Empty,
                reason = tracing::field::Empty,
            );
            let parent = TraceContextPropagator::new().extract(&Headers(request.headers()));
            let _ = span.set_parent(parent);
            span
        } else {
            tracing::Span::none()
        };
        let mut finish = Finish {
            shared: shared.clone(),
            method,
            span: span.clone(),
            started: Instant::now(),
            outcome: Outcome::default(),
            done: false,
        };
        let current = Current {
            outcome: Cell::new(Outcome::default()),
            shared,
        };
        Either::Right(Box::pin(CURRENT.scope(current, async move {
            let response = inner.call(request).instrument(span).await;
            finish.outcome = CURRENT.with(|c| c.outcome.get());
            let response = response?;
            // A unary error is trailers-only: its status is in the headers.
            // A success's (or an encoding failure's) comes in the trailers,
            // when the body ends.
            let status = grpc_status(response.headers());
            if let Some(code) = status {
                finish.finish(code);
                return Ok(response);
            }
            Ok(response.map(|body| tonic::body::Body::new(Timed { body, finish })))
        })))
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Records the RPC once: when its status is known, or, if it never is (the
/// caller went away), as CANCELLED when dropped.
struct Finish {
    shared: Arc<Shared>,
    method: Method,
    span: tracing::Span,
    started: Instant,
    outcome: Outcome,
    done: bool,
}

/// gRPC's CANCELLED.
const CANCELLED: i32 = 1;

impl Finish {
    fn finish(&mut self, code: i32) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let elapsed = self.started.elapsed();
        let o = self.outcome;
        // Authorize's decision: what it answered; any error is DENIED. A
        // call the caller abandoned was answered nothing: no decision. A
        // Check answers OK either way: a refusal noted its reason.
        let (decision, reason) = if self.method.is_check() {
            match (code, o.decision, o.reason) {
                (0, Some(d), _) => (Some(d), None),
                (0, None, Some(reason)) => (Some("DENIED"), Some(reason)),
                (0, None, None) | (CANCELLED, _, _) => (None, None),
                _ => (Some("DENIED"), o.reason),
            }
        } else {
            let reason = if code == 0 { None } else { o.reason };
            let decision = match (code, o.decision) {
                (0, Some(d)) => Some(d),
                (0, None) | (CANCELLED, _) => None,
                _ => Some("DENIED"),
            }
            .filter(|_| self.method.is_authorize());
            (decision, reason)
        };
        if self.shared.traces {
            self.span.record("rpc.grpc.status_code", code);
            if let Some(reason) = reason {
                self.span.record("reason", reason);
            }
            if let Some(decision) = decision {
                self.span.record("decision", decision);
            }
            // Server spans: the codes that say the server failed are
            // errors (the RPC conventions); a refusal is not.
            if matches!(code, 2 | 4 | 12 | 13 | 14 | 15) {
                self.span.record("otel.status_code", "error");
            }
        }
        if let Some(instruments) = &self.shared.instruments {
            instruments.rpc(
                self.method,
                code,
                reason,
                decision,
                o.duplicate_dispatched,
                elapsed,
            );
        }
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.finish(CANCELLED);
    }
}

/// A response body that records its RPC when its trailers (or its end)
/// come.
struct Timed {
    body: tonic::body::Body,
    finish: Finish,
}

impl http_body::Body for Timed {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_status) {
                    self.finish.finish(code);
                }
            }
            Poll::Ready(Some(Err(status))) => {
                let code = i32::from(status.code());
                self.finish.finish(code);
            }
            // Ended without a status: gRPC reads that as OK only with a
            // grpc-status trailer, so this is not a clean answer.
            Poll::Ready(None) => self.finish.finish(2),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::{METHODS, Method};
    use prost::Message;

    /// Every method the services declare has its row, so no real RPC is
    /// reported as `_OTHER`.
    #[test]
    fn every_rpc_of_the_contract_is_named() {
        let mut declared = Vec::new();
        let sets = [
            crate::pb::FILE_DESCRIPTOR_SET,
            crate::api::envoy::FILE_DESCRIPTOR_SET,
        ]
        .map(|bytes| prost_types::FileDescriptorSet::decode(bytes).expect("descriptor set"));
        for file in sets.into_iter().flat_map(|set| set.file) {
            for service in &file.service {
                for method in &service.method {
                    declared.push(format!(
                        "/{}.{}/{}",
                        file.package(),
                        service.name(),
                        method.name()
                    ));
                }
            }
        }
        declared.sort();
        let mut named: Vec<String> = METHODS.iter().map(|(p, _, _)| (*p).to_owned()).collect();
        named.sort();
        assert_eq!(declared, named);
        for (path, service, method) in METHODS {
            assert_eq!(*path, format!("/{service}/{method}"));
        }
        let m = Method::of("/atmost.v1.Gate/Authorize").expect("named");
        assert_eq!(m.name, "atmost.v1.Gate/Authorize");
        assert_eq!(
            Method::of("/atmost.v1.Gate/Nope").map(|m| m.method),
            Some("_OTHER")
        );
        assert_eq!(Method::of("/grpc.health.v1.Health/Check"), None);
    }
}
