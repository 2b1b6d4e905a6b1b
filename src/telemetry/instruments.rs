//! The one set of metric instruments. Names follow the OpenTelemetry RPC
//! conventions where one exists (`rpc.server.call.duration`), `atmost.*`
//! otherwise; the Prometheus names follow from them (dots become
//! underscores, the unit and `_total` are appended).
//!
//! Every label has a bounded set of values: an RPC method (10), a gRPC code
//! (17), an ErrorInfo reason (the contract's ~30), a decision (4), a store
//! operation (12). Never a permit, a key, a tenant or anything a caller
//! chose.

use super::Shared;
use super::rpc::Method;
use crate::admission::Admission;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, MeterProvider as _};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Latency buckets, in seconds: from 0.1 ms (an in-memory call) to 10 s
/// (past the longest store deadline a caller would wait).
const SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// The instruments, made once from the meter provider.
pub struct Instruments {
    meter: opentelemetry::metrics::Meter,
    /// `rpc.server.call.duration` (s): every atmost RPC, by method and
    /// gRPC status code.
    rpc_duration: Histogram<f64>,
    /// `atmost.decisions`: Authorize's answers, by decision (DISPATCH,
    /// REDELIVERED, REPLAY, DENIED) and reason (DENIED's, else "").
    decisions: Counter<u64>,
    /// `atmost.errors`: every error answered, by method and reason.
    errors: Counter<u64>,
    /// `atmost.duplicate_guard.hits`: a new key whose request matched an
    /// earlier dispatch, by what the guard did (`dispatched`: LOG mode,
    /// `duplicate_of` set; `refused`: DUPLICATE_REQUEST_SUSPECTED).
    duplicates: Counter<u64>,
    /// `atmost.store.duration` (s): store calls made by RPCs, by operation
    /// and outcome (`ok`, or `error` for any error the store answered).
    store_duration: Histogram<f64>,
    /// `atmost.envoy.unauthorized_forwards`: ext_proc streams whose
    /// request reached the tool without an Authorize (its response arrived
    /// while atmost still awaited the request), by what atmost awaited
    /// (`request_headers`, `request_body`).
    unauthorized_forwards: Counter<u64>,
    /// `atmost.approval.decision.duration` (s): how long a call waited for
    /// a person, by outcome (`approved`: the last approval the rule needs;
    /// `denied`). A lapse is seen by no RPC, so it is not here: it is the
    /// rule's wait.
    approval_decisions: Histogram<f64>,
}

/// How long a call waits for a person, in seconds: a minute to a week.
const HUMAN_SECONDS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
    604800.0,
];

impl Instruments {
    pub(super) fn new(provider: &SdkMeterProvider) -> Self {
        let meter = provider.meter("atmost");
        let seconds = |name: &'static str, description: &'static str| {
            meter
                .f64_histogram(name)
                .with_unit("s")
                .with_description(description)
                .with_boundaries(SECONDS.to_vec())
                .build()
        };
        let instruments = Self {
            rpc_duration: seconds(
                "rpc.server.call.duration",
                "How long each atmost RPC took, from its arrival to its status",
            ),
            store_duration: seconds(
                "atmost.store.duration",
                "How long each store call an RPC made took",
            ),
            decisions: meter
                .u64_counter("atmost.decisions")
                .with_description("Authorize answers, by decision and (for DENIED) reason")
                .build(),
            errors: meter
                .u64_counter("atmost.errors")
                .with_description("Errors answered, by RPC method and ErrorInfo reason")
                .build(),
            duplicates: meter
                .u64_counter("atmost.duplicate_guard.hits")
                .with_description(
                    "New keys whose request matched an earlier dispatch, by what the guard did",
                )
                .build(),
            unauthorized_forwards: meter
                .u64_counter("atmost.envoy.unauthorized_forwards")
                .with_description(
                    "ext_proc requests forwarded to the tool without an Authorize (their \
                     response arrived while atmost awaited the request), by what was awaited",
                )
                .build(),
            approval_decisions: meter
                .f64_histogram("atmost.approval.decision.duration")
                .with_unit("s")
                .with_description(
                    "How long a call waited for a person's decision, by outcome (approved, denied)",
                )
                .with_boundaries(HUMAN_SECONDS.to_vec())
                .build(),
            meter,
        };
        // Build information: one series, always 1.
        instruments
            .meter
            .u64_observable_gauge("atmost.build.info")
            .with_description("The atmost version serving (always 1)")
            .with_callback(|observer| {
                observer.observe(1, &[KeyValue::new("version", env!("CARGO_PKG_VERSION"))]);
            })
            .build();
        // The audit trail's losses and waits (crate::audit): process-wide
        // counters, zero while no trail is installed.
        let audit = [
            (
                "atmost.audit.events.delayed",
                "Audit events that found the buffer full and waited for room (--audit-when-full block)",
                &crate::audit::counts().delayed,
            ),
            (
                "atmost.audit.events.dropped",
                "Audit events lost to a full buffer (--audit-when-full drop; in either \
                 mode, the events of calls the authentication layer refused)",
                &crate::audit::counts().dropped,
            ),
            (
                "atmost.audit.write_errors",
                "Audit lines the output refused (a full disk, a closed pipe): lost",
                &crate::audit::counts().write_errors,
            ),
        ];
        for (name, description, count) in audit {
            instruments
                .meter
                .u64_observable_counter(name)
                .with_description(description)
                .with_callback(move |observer| {
                    observer.observe(count.load(std::sync::atomic::Ordering::Relaxed), &[]);
                })
                .build();
        }
        instruments
    }

    /// One RPC, once its status is known.
    pub(super) fn rpc(
        &self,
        method: Method,
        code: i32,
        reason: Option<&'static str>,
        decision: Option<&'static str>,
        duplicate_dispatched: bool,
        elapsed: Duration,
    ) {
        self.rpc_duration.record(
            elapsed.as_secs_f64(),
            &[
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", method.service),
                KeyValue::new("rpc.method", method.method),
                KeyValue::new("rpc.grpc.status_code", i64::from(code)),
            ],
        );
        if let Some(reason) = reason {
            self.errors.add(
                1,
                &[
                    KeyValue::new("rpc.method", method.method),
                    KeyValue::new("reason", reason),
                ],
            );
        }
        if let Some(decision) = decision {
            self.decisions.add(
                1,
                &[
                    KeyValue::new("decision", decision),
                    KeyValue::new("reason", reason.unwrap_or("")),
                ],
            );
        }
        let refused = reason == Some(crate::domain::Reason::DuplicateSuspected.as_str());
        // An Authorize's or a Check's refusal (a Check answers it in a gRPC
        // OK, with its decision DENIED).
        if duplicate_dispatched || (refused && decision == Some("DENIED")) {
            let action = if refused { "refused" } else { "dispatched" };
            self.duplicates.add(1, &[KeyValue::new("action", action)]);
        }
    }

    /// A call's approval completed, or its denial.
    pub(super) fn approval_decided(&self, outcome: &'static str, waited: Duration) {
        self.approval_decisions
            .record(waited.as_secs_f64(), &[KeyValue::new("outcome", outcome)]);
    }

    /// One store call made by an RPC.
    pub(super) fn store_call(&self, operation: &'static str, ok: bool, elapsed: Duration) {
        self.store_duration.record(
            elapsed.as_secs_f64(),
            &[
                KeyValue::new("operation", operation),
                KeyValue::new("outcome", if ok { "ok" } else { "error" }),
            ],
        );
    }

    /// An ext_proc request that reached the tool unauthorized: its response
    /// arrived while atmost still awaited `awaiting` (`request_headers`,
    /// `request_body`).
    pub(super) fn unauthorized_forward(&self, awaiting: &'static str) {
        self.unauthorized_forwards
            .add(1, &[KeyValue::new("awaiting", awaiting)]);
    }

    /// Admission, read when metrics are collected: slots in use, the
    /// limit, and requests shed by where they were refused.
    pub(super) fn observe_admission(&self, admission: &Arc<Admission>) {
        let weak: Weak<Admission> = Arc::downgrade(admission);
        let w = weak.clone();
        self.meter
            .u64_observable_gauge("atmost.admission.in_flight")
            .with_description("Store calls holding an admission slot (at most --max-in-flight)")
            .with_callback(move |observer| {
                if let Some(a) = w.upgrade() {
                    observer.observe(a.in_flight() as u64, &[]);
                }
            })
            .build();
        let w = weak.clone();
        self.meter
            .u64_observable_gauge("atmost.admission.limit")
            .with_description("--max-in-flight: the admission slots")
            .with_callback(move |observer| {
                if let Some(a) = w.upgrade() {
                    observer.observe(a.limit() as u64, &[]);
                }
            })
            .build();
        self.meter
            .u64_observable_counter("atmost.admission.shed")
            .with_description(
                "Requests refused with OVERLOADED, by stage: before_body (late, or a standing \
                 queue), queue (no slot within --max-queue-wait)",
            )
            .with_callback(move |observer| {
                if let Some(a) = weak.upgrade() {
                    let (before_body, queue) = a.shed();
                    observer.observe(before_body, &[KeyValue::new("stage", "before_body")]);
                    observer.observe(queue, &[KeyValue::new("stage", "queue")]);
                }
            })
            .build();
    }

    /// The uncertain census ([`super::census`]), read when metrics are
    /// collected. Before the first pass completes, the census age (from
    /// start-up) alone: there are no figures to report.
    pub(super) fn observe_census(&self, shared: &Arc<Shared>) {
        let weak = Arc::downgrade(shared);
        let read = move || weak.upgrade().map(|s| s.census.read());
        let r = read.clone();
        self.meter
            .u64_observable_gauge("atmost.uncertain.attempts")
            .with_description(
                "UNCERTAIN attempts (marked, or RESERVED past their lease) the last complete \
                 census pass counted, across all tenants",
            )
            .with_callback(move |observer| {
                if let Some(f) = r().and_then(|c| c.figures) {
                    observer.observe(f.uncertain, &[]);
                }
            })
            .build();
        let r = read.clone();
        self.meter
            .f64_observable_gauge("atmost.uncertain.oldest_age")
            .with_unit("s")
            .with_description(
                "How long the oldest UNCERTAIN attempt the last complete census pass found has \
                 been uncertain, now (0: none)",
            )
            .with_callback(move |observer| {
                if let Some(f) = r().and_then(|c| c.figures) {
                    observer.observe(f.oldest_age.as_secs_f64(), &[]);
                }
            })
            .build();
        self.meter
            .f64_observable_gauge("atmost.uncertain.census.age")
            .with_unit("s")
            .with_description(
                "How long ago the census pass behind the uncertain gauges completed \
                 (before the first: how long ago the census started)",
            )
            .with_callback(move |observer| {
                if let Some(c) = read() {
                    observer.observe(c.census_age.as_secs_f64(), &[]);
                }
            })
            .build();
    }
}
