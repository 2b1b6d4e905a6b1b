//! Telemetry: traces and metrics, beside the logs.
//!
//! - **Traces.** A span per atmost RPC (Gate, Permits, Receipts), named
//!   `atmost.v1.Gate/Authorize` and so on, whose parent is the caller's
//!   W3C `traceparent` (and `tracestate`) from the gRPC metadata, so it
//!   joins the caller's trace; a child span per store call, and under a
//!   Redis store call one per Lua script it runs. Attributes: the OTel RPC
//!   conventions' `rpc.system`, `rpc.service`, `rpc.method`,
//!   `rpc.grpc.status_code`, and atmost's `permit_id`, `tool`, `decision`
//!   and `reason` (the ErrorInfo reason of an error). Never a fingerprint,
//!   a result, a holder token, an idempotency key, an attempt id or a key.
//! - **Metrics.** One set of instruments ([`instruments`]), read by a
//!   Prometheus exporter (`--metrics-listen`, [`prometheus`]) and by a
//!   periodic OTLP exporter, whichever are configured.
//!
//! OTLP export is configured by the standard `OTEL_*` environment variables
//! only, and is off unless they ask for it ([`Plan`]). When both exports
//! are off, nothing here is on the request path: no layer, no span is
//! created (tracing's callsite check answers "never"), nothing is counted.
//!
//! docs/telemetry.md lists every name, label and variable.

pub mod census;
pub mod instruments;
pub mod prometheus;
pub mod rpc;

pub use census::Census;
pub use instruments::Instruments;
pub use rpc::{
    EnvoyCounters, RpcLayer, note, note_approval_decided, note_duplicate, note_permit, note_reason,
    store_call,
};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{MetricExporter, SpanExporter};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::sync::Arc;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The `tracing` target of atmost's spans: only the OpenTelemetry layer
/// sees it (the log output does not change when traces are on).
pub const SPAN_TARGET: &str = "atmost::otel";

/// What the service exports, decided once at start-up: the handle the
/// server and the handlers record through. The default is off.
#[derive(Clone, Default)]
pub struct Telemetry {
    shared: Option<Arc<Shared>>,
}

pub(crate) struct Shared {
    /// The instruments; `None` when no metrics are exported.
    pub(crate) instruments: Option<Instruments>,
    /// Whether spans are exported.
    pub(crate) traces: bool,
    pub(crate) census: Census,
    tracer_provider: Option<SdkTracerProvider>,
    meter_provider: Option<SdkMeterProvider>,
    registry: Option<::prometheus::Registry>,
}

/// Which exports the `OTEL_*` environment asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Plan {
    /// Spans over OTLP.
    pub otlp_traces: bool,
    /// Metrics over OTLP.
    pub otlp_metrics: bool,
}

impl Plan {
    /// Reads the plan from the environment (`env` returns a variable's
    /// value; the process's own in production, a map in tests). An OTLP
    /// signal is on when its `OTEL_<SIGNAL>_EXPORTER` is `otlp`, or is unset
    /// while an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or the
    /// signal's own) is set; `none`, or `OTEL_SDK_DISABLED=true`, turns it
    /// off. What atmost cannot honour fails start-up with a clear error: an
    /// exporter other than `otlp`/`none` (Prometheus is `--metrics-listen`),
    /// an OTLP protocol other than `grpc`, a compression (none is built in),
    /// or an endpoint that is not an `http://`, `https://` or `unix:`
    /// address. These are
    /// every way [`Telemetry::build`] can fail on the environment, so
    /// `atmost config check`, which reads the plan and builds nothing,
    /// finds them too.
    pub fn from_env(env: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(Self::default());
        }
        let endpoint = set("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
        let signal = |exporter: &str, own_endpoint: &str, protocol: &str, compression: &str| {
            let on = match set(exporter).map(|v| v.trim().to_ascii_lowercase()) {
                None => endpoint || set(own_endpoint).is_some(),
                Some(v) if v == "none" => false,
                Some(v) if v == "otlp" => true,
                Some(v) => {
                    return Err(format!(
                        "{exporter}={v} is not supported: atmost exports `otlp` (or `none`){}",
                        if v == "prometheus" {
                            "; for Prometheus, serve /metrics with --metrics-listen"
                        } else {
                            ""
                        }
                    ));
                }
            };
            if on {
                for name in [protocol, "OTEL_EXPORTER_OTLP_PROTOCOL"] {
                    if let Some(p) = set(name).filter(|p| p.trim() != "grpc") {
                        return Err(format!(
                            "{name}={p} is not supported: atmost sends OTLP over gRPC (`grpc`)"
                        ));
                    }
                }
                // The exporter is built without gzip or zstd: it would
                // refuse (or ignore) them when built, after this check.
                for name in [compression, "OTEL_EXPORTER_OTLP_COMPRESSION"] {
                    if let Some(c) = set(name).filter(|c| !c.trim().eq_ignore_ascii_case("none")) {
                        return Err(format!(
                            "{name}={c} is not supported: atmost sends OTLP uncompressed \
                             (leave it unset, or `none`)"
                        ));
                    }
                }
                // The endpoint the exporter will use: the signal's own, else
                // the shared one (else its default, http://localhost:4317).
                for name in [own_endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT"] {
                    if let Some(e) = set(name) {
                        check_endpoint(e.trim()).map_err(|why| format!("{name}={e}: {why}"))?;
                        break;
                    }
                }
            }
            Ok(on)
        };
        Ok(Self {
            otlp_traces: signal(
                "OTEL_TRACES_EXPORTER",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
            )?,
            otlp_metrics: signal(
                "OTEL_METRICS_EXPORTER",
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
                "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
            )?,
        })
    }
}

/// An OTLP/gRPC endpoint as the exporter reads it (through tonic's
/// `Endpoint`): `unix:PATH` (a Unix socket), or a URI with a host whose
/// scheme is `http` or `https` (one without a scheme gets `https://`, or
/// `http://` with `OTEL_EXPORTER_OTLP_INSECURE`: either parses alike).
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    if let Some(path) = endpoint.strip_prefix("unix:") {
        return match path.trim_start_matches('/').is_empty() {
            true => Err("names no socket".into()),
            false => Ok(()),
        };
    }
    let schemed = endpoint
        .split_once("://")
        .is_some_and(|(scheme, _)| !scheme.contains(['/', '?', '#']));
    let uri = match schemed {
        true => endpoint.to_owned(),
        false => format!("https://{endpoint}"),
    };
    let endpoint = tonic::transport::Endpoint::from_shared(uri)
        .map_err(|_| "not a URI (give http://HOST:PORT or https://HOST:PORT)".to_owned())?;
    let uri = endpoint.uri();
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err("atmost sends OTLP over gRPC to an http://, https:// or unix: address".into());
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err("names no host".into());
    }
    Ok(())
}

/// How the binary sets up telemetry ([`Telemetry::init`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Config {
    /// Logs as JSON lines instead of text.
    pub json_logs: bool,
    /// Serve Prometheus text (`--metrics-listen` given).
    pub prometheus: bool,
}

impl Telemetry {
    /// Nothing exported.
    pub fn off() -> Self {
        Self::default()
    }

    /// The binary's set-up: reads the [`Plan`] from the process's
    /// environment, builds the exporters it asks for, and installs the
    /// global `tracing` subscriber: the logs (stderr, filtered by
    /// `RUST_LOG`, as before) and, when traces are exported, the
    /// OpenTelemetry layer for atmost's spans. Call it inside the Tokio
    /// runtime (the OTLP exporters' gRPC channels live on it), once.
    pub fn init(config: Config) -> Result<Self, String> {
        let plan = Plan::from_env(|name| std::env::var(name).ok())?;
        let telemetry = Self::build(plan, config.prometheus)?;
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
            // atmost's spans are for the OpenTelemetry layer alone.
            .add_directive(format!("{SPAN_TARGET}=off").parse().expect("a directive"));
        // Colour codes only for a person reading a terminal, never into a
        // file or a pipe.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let Some(provider) = telemetry
            .shared
            .as_ref()
            .and_then(|s| s.tracer_provider.as_ref())
        else {
            // No spans exported: the logs alone, set up exactly as they
            // are without telemetry (one global filter, which a disabled
            // callsite never consults again; a per-layer filter is asked
            // on every call).
            let logs = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_ansi(ansi)
                .with_writer(std::io::stderr);
            let installed = if config.json_logs {
                logs.json().try_init()
            } else {
                logs.try_init()
            };
            installed.map_err(|e| format!("setting up logging: {e}"))?;
            return Ok(telemetry);
        };
        let logs = tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr);
        let logs = if config.json_logs {
            logs.json().with_filter(filter).boxed()
        } else {
            logs.with_filter(filter).boxed()
        };
        let spans = {
            {
                tracing_opentelemetry::layer()
                    .with_tracer(provider.tracer("atmost"))
                    .with_location(false)
                    .with_threads(false)
                    .with_tracked_inactivity(false)
                    .with_level(false)
                    .with_target(false)
                    // Only atmost's spans: no log event becomes a span
                    // event (events carry idempotency keys and more).
                    .with_filter(
                        tracing_subscriber::filter::Targets::new()
                            .with_target(SPAN_TARGET, tracing::Level::TRACE),
                    )
            }
        };
        tracing_subscriber::registry()
            .with(logs)
            .with(spans)
            .try_init()
            .map_err(|e| format!("setting up logging: {e}"))?;
        Ok(telemetry)
    }

    /// The exporters of `plan` (plus Prometheus if `prometheus`), without
    /// touching the global subscriber: what [`init`](Self::init) installs,
    /// and what an in-process server uses for its metrics.
    pub fn build(plan: Plan, prometheus: bool) -> Result<Self, String> {
        if plan == Plan::default() && !prometheus {
            return Ok(Self::off());
        }
        let resource = resource();
        let tracer_provider = if plan.otlp_traces {
            let exporter = SpanExporter::builder()
                .with_tonic()
                .build()
                .map_err(|e| format!("the OTLP trace exporter (OTEL_*): {e}"))?;
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource.clone())
                    .build(),
            )
        } else {
            None
        };
        let registry = prometheus.then(::prometheus::Registry::new);
        let meter_provider = if plan.otlp_metrics || prometheus {
            let mut builder = SdkMeterProvider::builder().with_resource(resource);
            if let Some(registry) = &registry {
                let reader = opentelemetry_prometheus::exporter()
                    .with_registry(registry.clone())
                    // Labels are the instruments' own: no otel_scope_*.
                    .scope_info_enabled(false)
                    .build()
                    .map_err(|e| format!("the Prometheus exporter: {e}"))?;
                builder = builder.with_reader(reader);
            }
            if plan.otlp_metrics {
                let exporter = MetricExporter::builder()
                    .with_tonic()
                    .build()
                    .map_err(|e| format!("the OTLP metric exporter (OTEL_*): {e}"))?;
                // Every OTEL_METRIC_EXPORT_INTERVAL (60 s by default).
                builder = builder.with_periodic_exporter(exporter);
            }
            Some(builder.build())
        } else {
            None
        };
        let instruments = meter_provider.as_ref().map(Instruments::new);
        let shared = Arc::new(Shared {
            instruments,
            traces: tracer_provider.is_some(),
            census: Census::default(),
            tracer_provider,
            meter_provider,
            registry,
        });
        if let Some(instruments) = &shared.instruments {
            instruments.observe_census(&shared);
        }
        Ok(Self {
            shared: Some(shared),
        })
    }

    /// Whether metrics are exported (the uncertain census runs only then).
    pub fn metrics(&self) -> bool {
        self.shared
            .as_ref()
            .is_some_and(|s| s.instruments.is_some())
    }

    /// Whether spans are exported.
    pub fn traces(&self) -> bool {
        self.shared.as_ref().is_some_and(|s| s.traces)
    }

    pub(crate) fn shared(&self) -> Option<&Arc<Shared>> {
        self.shared.as_ref()
    }

    /// The census results the uncertain gauges report ([`census`]).
    pub fn census(&self) -> Option<&Census> {
        self.shared.as_ref().map(|s| &s.census)
    }

    /// Reports the admission state (slots in use, requests shed).
    pub fn observe_admission(&self, admission: &Arc<crate::admission::Admission>) {
        if let Some(instruments) = self.shared.as_ref().and_then(|s| s.instruments.as_ref()) {
            instruments.observe_admission(admission);
        }
    }

    /// Every metric as Prometheus text, or `None` without
    /// `--metrics-listen`.
    pub fn prometheus_text(&self) -> Option<String> {
        let registry = self.shared.as_ref()?.registry.as_ref()?;
        ::prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .map_err(|e| tracing::warn!(error = %e, "encoding the metrics"))
            .ok()
    }

    /// Sends what is still buffered (spans, the last metrics) and stops
    /// the exporters; waits at most the exporters' timeouts
    /// (`OTEL_EXPORTER_OTLP_TIMEOUT`, 10 s by default). Call it before the
    /// runtime is dropped.
    pub fn shutdown(&self) {
        let Some(shared) = &self.shared else { return };
        if let Some(provider) = &shared.tracer_provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "flushing the spans");
        }
        if let Some(provider) = &shared.meter_provider
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "flushing the metrics");
        }
    }
}

/// The resource every signal carries: `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES` as given, `service.name` "atmost" when
/// neither names one, and `service.version`.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    let builder = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if named {
        builder.build()
    } else {
        builder.with_service_name("atmost").build()
    }
}

#[cfg(test)]
mod tests {
    use super::Plan;
    use std::collections::HashMap;

    fn plan(vars: &[(&str, &str)]) -> Result<Plan, String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Plan::from_env(|name| vars.get(name).cloned())
    }

    const BOTH: Plan = Plan {
        otlp_traces: true,
        otlp_metrics: true,
    };

    #[test]
    fn a_compression_or_an_endpoint_the_exporter_would_refuse_is_refused_here() {
        let on = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317");
        for (name, value) in [
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
            ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "brotli"),
        ] {
            let e = plan(&[on, (name, value)]).expect_err(name);
            assert!(
                e.contains(&format!("{name}={value} is not supported")),
                "{e}"
            );
        }
        assert_eq!(
            plan(&[on, ("OTEL_EXPORTER_OTLP_COMPRESSION", "none")]),
            Ok(BOTH)
        );
        // Off, the compression is never used: nothing to refuse.
        assert_eq!(
            plan(&[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")]),
            Ok(Plan::default())
        );
        for (name, bad) in [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://bad host:4317"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector:4317"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "unix://"),
            ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://[::1"),
        ] {
            let e = plan(&[(name, bad)]).expect_err(bad);
            assert!(e.starts_with(&format!("{name}={bad}: ")), "{e}");
        }
        for good in [
            "http://127.0.0.1:4317",
            "https://otel-collector.monitoring:4317",
            "otel-collector:4317",
            "http://[::1]:4317/",
            "unix:///run/otel/otlp.sock",
        ] {
            assert_eq!(
                plan(&[("OTEL_EXPORTER_OTLP_ENDPOINT", good)]),
                Ok(BOTH),
                "{good}"
            );
        }
        // A signal's own endpoint is the one its exporter uses.
        assert_eq!(
            plan(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "not a uri"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://x:4317"),
                ("OTEL_METRICS_EXPORTER", "none"),
            ]),
            Ok(Plan {
                otlp_traces: true,
                otlp_metrics: false
            })
        );
    }

    #[test]
    fn nothing_is_exported_unless_the_environment_asks() {
        assert_eq!(plan(&[]), Ok(Plan::default()));
        assert_eq!(plan(&[("OTEL_SERVICE_NAME", "a")]), Ok(Plan::default()));
        assert_eq!(
            plan(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]),
            Ok(Plan::default())
        );
    }

    #[test]
    fn an_endpoint_or_otlp_turns_a_signal_on_and_none_turns_it_off() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317");
        assert_eq!(plan(&[endpoint]), Ok(BOTH));
        assert_eq!(
            plan(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]),
            Ok(Plan {
                otlp_traces: false,
                otlp_metrics: true
            })
        );
        assert_eq!(
            plan(&[endpoint, ("OTEL_METRICS_EXPORTER", "None")]),
            Ok(Plan {
                otlp_traces: true,
                otlp_metrics: false
            })
        );
        assert_eq!(
            plan(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://x:4317")]),
            Ok(Plan {
                otlp_traces: true,
                otlp_metrics: false
            })
        );
        assert_eq!(
            plan(&[("OTEL_METRICS_EXPORTER", "otlp")]),
            Ok(Plan {
                otlp_traces: false,
                otlp_metrics: true
            })
        );
        assert_eq!(
            plan(&[endpoint, ("OTEL_SDK_DISABLED", "true")]),
            Ok(Plan::default())
        );
        assert_eq!(
            plan(&[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]),
            Ok(BOTH)
        );
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        let e = plan(&[("OTEL_METRICS_EXPORTER", "prometheus")]).unwrap_err();
        assert!(e.contains("--metrics-listen"), "{e}");
        let e = plan(&[("OTEL_TRACES_EXPORTER", "zipkin")]).unwrap_err();
        assert!(e.starts_with("OTEL_TRACES_EXPORTER=zipkin"), "{e}");
        let e = plan(&[endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")]).unwrap_err();
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"),
            "{e}"
        );
        let e = plan(&[
            endpoint,
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
            ("OTEL_METRICS_EXPORTER", "none"),
        ])
        .unwrap_err();
        assert!(e.contains("TRACES_PROTOCOL"), "{e}");
        // A protocol for a signal that is off is not read.
        assert_eq!(
            plan(&[
                ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json"),
                ("OTEL_TRACES_EXPORTER", "otlp")
            ]),
            Ok(Plan {
                otlp_traces: true,
                otlp_metrics: false
            })
        );
    }
}
