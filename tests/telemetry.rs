//! Telemetry, from the outside: a real `atmost serve` process exports its
//! spans (and OTLP metrics) to an OTLP receiver in the test (the
//! collector's own gRPC services, generated for tonic), and serves
//! Prometheus text on `--metrics-listen`, scraped after a known sequence of
//! calls on each store.

use crate::support::{NewPermit, Redis, pb, spawn_atmost_with_env};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
    metrics_service_server::{MetricsService, MetricsServiceServer},
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
    trace_service_server::{TraceService, TraceServiceServer},
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a test waits for what the server sends on its own schedule
/// (a span batch, a census pass) before it fails: a bound, not a measure.
const PATIENCE: Duration = Duration::from_secs(30);

// === an OTLP receiver ===

/// Everything the receiver was sent, as sent.
#[derive(Clone, Default)]
struct Received {
    traces: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    metrics: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.traces.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tonic::async_trait]
impl MetricsService for Received {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.metrics.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportMetricsServiceResponse::default()))
    }
}

impl Received {
    /// Serves the collector's trace and metrics services on a loopback
    /// port until the test's runtime ends: its address.
    async fn start(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let router = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(self.clone()))
            .add_service(MetricsServiceServer::new(self.clone()));
        tokio::spawn(
            router.serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        addr
    }

    fn spans(&self) -> Vec<Span> {
        let traces = self.traces.lock().unwrap();
        traces
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|r| &r.scope_spans)
            .flat_map(|s| s.spans.clone())
            .collect()
    }

    /// Every byte the receiver was sent, re-encoded.
    fn all_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for r in self.traces.lock().unwrap().iter() {
            out.extend(r.encode_to_vec());
        }
        for r in self.metrics.lock().unwrap().iter() {
            out.extend(r.encode_to_vec());
        }
        out
    }

    /// Waits until `ready` holds of the spans received (or fails).
    async fn wait_spans(&self, what: &str, ready: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let spans = self.spans();
            if ready(&spans) {
                return spans;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not received within {PATIENCE:?}; got {:#?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v: &AnyValue| v.value.as_ref())
}

fn string_attr(span: &Span, key: &str) -> Option<String> {
    match attr(&span.attributes, key) {
        Some(Value::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn int_attr(span: &Span, key: &str) -> Option<i64> {
    match attr(&span.attributes, key) {
        Some(Value::IntValue(i)) => Some(*i),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// A request carrying the caller's W3C trace context.
fn traced<T>(message: T, traceparent: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().expect("ascii"));
    request
        .metadata_mut()
        .insert("tracestate", "caller=1".parse().expect("ascii"));
    request
}

// Values no export may carry.
const FINGERPRINT: &[u8] = b"FINGERPRINT-a1b2c3-never-exported";
const RESULT: &[u8] = b"RESULT-d4e5f6-never-exported";
const HOLDER_TOKEN: &[u8] = b"HOLDER-TOKEN-0a9b8c-never-exported";
const KEY: &str = "idem-key-7f3e-never-exported";

/// The environment that points a server's OTLP exports at `receiver`,
/// flushing spans every 50 ms and metrics every 200 ms.
fn otlp_env(receiver: std::net::SocketAddr) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{receiver}")),
        ("OTEL_SERVICE_NAME", "atmost-under-test".into()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50".into()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "200".into()),
    ]
}

async fn spans_join_the_callers_trace(redis: Option<Redis>) {
    let received = Received::default();
    let receiver = received.start().await;
    let env = otlp_env(receiver);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let args = redis.as_ref().map(Redis::serve_args).unwrap_or_default();
    let server = spawn_atmost_with_env(&args, &env);
    let client = server.client().await;
    let mut gate = pb::gate_client::GateClient::new(client.channel());

    let permit = client
        .create_permit(
            NewPermit::new(["wallet.charge"])
                .subject("agent-7")
                .expires_at_ms(now_ms() + 3_600_000),
        )
        .await
        .expect("create");
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{parent_id}-01");
    let authorize = pb::AuthorizeRequest {
        permit_id: permit.permit_id.clone(),
        tool: "wallet.charge".into(),
        idempotency_key: KEY.into(),
        request_fingerprint: FINGERPRINT.to_vec(),
        cost: 0,
        holder_token: HOLDER_TOKEN.to_vec(),
        ..Default::default()
    };
    let dispatched = gate
        .authorize(traced(authorize.clone(), &traceparent))
        .await
        .expect("authorize")
        .into_inner();
    let attempt_id = dispatched.attempt.expect("attempt").attempt_id;
    // The same key with another request: refused, in a trace of its own.
    let refused_trace = "0af7651916cd43dd8448eb211c80319c";
    let refused = gate
        .authorize(traced(
            pb::AuthorizeRequest {
                request_fingerprint: b"another request".to_vec(),
                ..authorize.clone()
            },
            &format!("00-{refused_trace}-b7ad6b7169203331-01"),
        ))
        .await
        .expect_err("key reused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    gate.commit(traced(
        pb::CommitRequest {
            permit_id: permit.permit_id.clone(),
            idempotency_key: KEY.into(),
            attempt_id: attempt_id.clone(),
            outcome: Some(crate::support::succeeded(RESULT, None)),
        },
        &traceparent,
    ))
    .await
    .expect("commit");

    let store_span = if redis.is_some() { 2 } else { 1 };
    let spans = received
        .wait_spans("the Authorize, Commit and refusal spans", |spans| {
            let ours = spans
                .iter()
                .filter(|s| hex(&s.trace_id) == trace_id)
                .count();
            let theirs = spans
                .iter()
                .filter(|s| hex(&s.trace_id) == refused_trace)
                .count();
            // Each RPC: its span, its store call (and on Redis the script).
            ours >= 2 * (1 + store_span) && theirs > store_span
        })
        .await;

    let rpc = |trace: &str, name: &str| -> Vec<Span> {
        spans
            .iter()
            .filter(|s| hex(&s.trace_id) == trace && s.name == name)
            .cloned()
            .collect()
    };
    let authorized = rpc(trace_id, "atmost.v1.Gate/Authorize");
    assert_eq!(authorized.len(), 1, "{spans:#?}");
    let a = &authorized[0];
    assert_eq!(
        hex(&a.parent_span_id),
        parent_id,
        "the caller's span is the parent"
    );
    assert_eq!(a.kind, 2, "SPAN_KIND_SERVER");
    assert_eq!(string_attr(a, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(
        string_attr(a, "rpc.service").as_deref(),
        Some("atmost.v1.Gate")
    );
    assert_eq!(string_attr(a, "rpc.method").as_deref(), Some("Authorize"));
    assert_eq!(int_attr(a, "rpc.grpc.status_code"), Some(0));
    assert_eq!(string_attr(a, "permit_id"), Some(permit.permit_id.clone()));
    assert_eq!(string_attr(a, "tool").as_deref(), Some("wallet.charge"));
    assert_eq!(string_attr(a, "decision").as_deref(), Some("DISPATCH"));
    assert_eq!(string_attr(a, "attempt_id"), None);
    assert_eq!(string_attr(a, "reason"), None);

    // The store call is its child, named by the operation; on Redis the
    // script run is the store call's child, named by the script.
    let children: Vec<&Span> = spans
        .iter()
        .filter(|s| s.parent_span_id == a.span_id)
        .collect();
    assert_eq!(
        children.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["authorize"],
        "{spans:#?}"
    );
    let scripts: Vec<&str> = spans
        .iter()
        .filter(|s| s.parent_span_id == children[0].span_id)
        .map(|s| s.name.as_str())
        .collect();
    let expected: &[&str] = if redis.is_some() { &["authorize"] } else { &[] };
    assert_eq!(scripts, expected);

    let denied = rpc(refused_trace, "atmost.v1.Gate/Authorize");
    assert_eq!(denied.len(), 1);
    let d = &denied[0];
    assert_eq!(hex(&d.parent_span_id), "b7ad6b7169203331");
    assert_eq!(string_attr(d, "decision").as_deref(), Some("DENIED"));
    assert_eq!(
        string_attr(d, "reason").as_deref(),
        Some("IDEMPOTENCY_KEY_REUSED")
    );
    assert_eq!(int_attr(d, "rpc.grpc.status_code"), Some(9));

    let committed = rpc(trace_id, "atmost.v1.Gate/Commit");
    assert_eq!(committed.len(), 1);
    let c = &committed[0];
    assert_eq!(hex(&c.parent_span_id), parent_id);
    assert_eq!(string_attr(c, "attempt_id"), None);
    assert_eq!(string_attr(c, "tool").as_deref(), Some("wallet.charge"));

    // The OTLP metrics carry the same decision.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let found = received.metrics.lock().unwrap().iter().any(|r| {
            r.resource_metrics
                .iter()
                .flat_map(|r| &r.scope_metrics)
                .flat_map(|s| &s.metrics)
                .any(|m| m.name == "atmost.decisions")
        });
        if found {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no atmost.decisions over OTLP"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Never a fingerprint, a result, a holder token, an idempotency key or
    // an attempt id (the fencing token Commit takes).
    let sent = received.all_bytes();
    for secret in [
        FINGERPRINT,
        RESULT,
        HOLDER_TOKEN,
        KEY.as_bytes(),
        attempt_id.as_bytes(),
    ] {
        assert!(
            !sent.windows(secret.len()).any(|w| w == secret),
            "{} was exported",
            String::from_utf8_lossy(secret)
        );
    }
    // The resource names the service as configured.
    let traces = received.traces.lock().unwrap();
    let resource = traces[0].resource_spans[0]
        .resource
        .as_ref()
        .expect("a resource");
    assert!(matches!(
        attr(&resource.attributes, "service.name"),
        Some(Value::StringValue(name)) if name == "atmost-under-test"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_join_the_callers_trace_memory() {
    let _machine = crate::support::shared().await;
    spans_join_the_callers_trace(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_join_the_callers_trace_redis() {
    let _machine = crate::support::shared().await;
    spans_join_the_callers_trace(Some(Redis::start())).await;
}

// === Prometheus ===

/// `GET /metrics`: the samples, by name and labels as written
/// (`name{a="x",b="y"}`).
pub async fn scrape(addr: std::net::SocketAddr) -> HashMap<String, f64> {
    let text = get(addr, "/metrics").await;
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("a sample");
            (series.to_owned(), value.parse().expect("a number"))
        })
        .collect()
}

/// One HTTP/1.0 GET: the whole answer.
pub async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: atmost\r\n\r\n").as_bytes())
        .await
        .expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read");
    answer
}

/// A sample's value, 0 when the series is absent (a counter never added
/// to).
fn value(samples: &HashMap<String, f64>, series: &str) -> f64 {
    samples.get(series).copied().unwrap_or(0.0)
}

/// Scrapes until `ready` holds (or fails): for the census gauges, which
/// change when a pass completes.
async fn scrape_until(
    addr: std::net::SocketAddr,
    what: &str,
    ready: impl Fn(&HashMap<String, f64>) -> bool,
) -> HashMap<String, f64> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let samples = scrape(addr).await;
        if ready(&samples) {
            return samples;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not seen within {PATIENCE:?}; last scrape {samples:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn authorize(permit_id: &str, key: &str, fingerprint: &[u8]) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit_id.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: fingerprint.to_vec(),
        cost: 0,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

async fn a_scrape_counts_each_decision_and_the_uncertain(redis: Option<Redis>) {
    let mut args = redis.as_ref().map(Redis::serve_args).unwrap_or_default();
    args.extend([
        "--metrics-listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--uncertain-census-interval".to_owned(),
        "1s".to_owned(),
    ]);
    let server = spawn_atmost_with_env::<String>(&args, &[]);
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let client = server.client().await;
    let permit = |guard| {
        NewPermit::new(["t"])
            .expires_at_ms(now_ms() + 3_600_000)
            .duplicate_guard(guard, None)
    };
    let logged = client
        .create_permit(permit(pb::DuplicateGuardMode::Log))
        .await
        .expect("create");
    let enforced = client
        .create_permit(permit(pb::DuplicateGuardMode::Enforce))
        .await
        .expect("create");
    let a = logged.permit_id.as_str();
    let b = enforced.permit_id.as_str();

    let k1 = client
        .authorize(authorize(a, "k1", b"fp1"))
        .await
        .expect("dispatch");
    let in_progress = client
        .authorize(authorize(a, "k1", b"fp1"))
        .await
        .unwrap_err();
    assert_eq!(in_progress.reason_name(), Some("IDEMPOTENCY_IN_PROGRESS"));
    let reused = client
        .authorize(authorize(a, "k1", b"fp2"))
        .await
        .unwrap_err();
    assert_eq!(reused.reason_name(), Some("IDEMPOTENCY_KEY_REUSED"));
    let k2 = client
        .authorize(authorize(a, "k2", b"fp1"))
        .await
        .expect("dispatch");
    assert_eq!(k2.duplicate_of, "k1", "the guard logs and dispatches");
    let invalid = client
        .authorize(authorize("", "k3", b"fp"))
        .await
        .unwrap_err();
    assert_eq!(invalid.reason_name(), Some("INVALID_REQUEST"));
    client
        .commit(pb::CommitRequest {
            permit_id: a.into(),
            idempotency_key: "k1".into(),
            attempt_id: k1.attempt.expect("attempt").attempt_id,
            outcome: Some(crate::support::succeeded(b"r", None)),
        })
        .await
        .expect("commit");
    let replay = client
        .authorize(authorize(a, "k1", b"fp1"))
        .await
        .expect("replay");
    assert_eq!(replay.decision, pb::Decision::Replay as i32);
    let b1 = client
        .authorize(authorize(b, "k1", b"same"))
        .await
        .expect("dispatch");
    let suspected = client
        .authorize(authorize(b, "k2", b"same"))
        .await
        .unwrap_err();
    assert_eq!(suspected.reason_name(), Some("DUPLICATE_REQUEST_SUSPECTED"));
    client
        .commit(pb::CommitRequest {
            permit_id: b.into(),
            idempotency_key: "k1".into(),
            attempt_id: b1.attempt.expect("attempt").attempt_id,
            outcome: Some(crate::support::not_sent()),
        })
        .await
        .expect("not sent");

    // Nothing is uncertain yet: k2 is RESERVED within its lease.
    let samples = scrape_until(metrics, "a census pass", |s| {
        s.contains_key("atmost_uncertain_attempts")
    })
    .await;
    assert_eq!(value(&samples, "atmost_uncertain_attempts"), 0.0);
    assert_eq!(value(&samples, "atmost_uncertain_oldest_age_seconds"), 0.0);

    let k2_id = k2.attempt.expect("attempt").attempt_id;
    client
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: a.into(),
            idempotency_key: "k2".into(),
            attempt_id: k2_id.clone(),
            reason: "response lost".into(),
        })
        .await
        .expect("mark uncertain");
    let samples = scrape_until(metrics, "the marked attempt", |s| {
        value(s, "atmost_uncertain_attempts") == 1.0
    })
    .await;
    assert!(value(&samples, "atmost_uncertain_oldest_age_seconds") > 0.0);
    assert!(samples.contains_key("atmost_uncertain_census_age_seconds"));

    client
        .resolve(pb::ResolveRequest {
            permit_id: a.into(),
            idempotency_key: "k2".into(),
            attempt_id: k2_id,
            outcome: Some(crate::support::resolved_not_sent()),
        })
        .await
        .expect("resolve");
    let samples = scrape_until(metrics, "the resolved attempt", |s| {
        value(s, "atmost_uncertain_attempts") == 0.0
    })
    .await;
    assert_eq!(value(&samples, "atmost_uncertain_oldest_age_seconds"), 0.0);

    // A RESERVED attempt past its lease is UNCERTAIN with no call at all.
    let short = client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(now_ms() + 3_600_000)
                .lease(Duration::from_millis(1)),
        )
        .await
        .expect("create");
    client
        .authorize(authorize(&short.permit_id, "k1", b"fp"))
        .await
        .expect("dispatch");
    let samples = scrape_until(metrics, "the lease that ran out", |s| {
        value(s, "atmost_uncertain_attempts") == 1.0
    })
    .await;

    // Every count, exactly.
    let expected = [
        (
            r#"atmost_decisions_total{decision="DISPATCH",reason=""}"#,
            4.0,
        ),
        (
            r#"atmost_decisions_total{decision="REPLAY",reason=""}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="IDEMPOTENCY_IN_PROGRESS"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="IDEMPOTENCY_KEY_REUSED"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="DUPLICATE_REQUEST_SUSPECTED"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="DENIED",reason="INVALID_REQUEST"}"#,
            1.0,
        ),
        (
            r#"atmost_decisions_total{decision="REDELIVERED",reason=""}"#,
            0.0,
        ),
        (
            r#"atmost_duplicate_guard_hits_total{action="dispatched"}"#,
            1.0,
        ),
        (
            r#"atmost_duplicate_guard_hits_total{action="refused"}"#,
            1.0,
        ),
        (
            r#"atmost_errors_total{reason="IDEMPOTENCY_KEY_REUSED",rpc_method="Authorize"}"#,
            1.0,
        ),
        (
            r#"atmost_store_duration_seconds_count{operation="authorize",outcome="ok"}"#,
            5.0,
        ),
        (
            r#"atmost_store_duration_seconds_count{operation="authorize",outcome="error"}"#,
            3.0,
        ),
        (
            r#"atmost_store_duration_seconds_count{operation="resolve",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"rpc_server_call_duration_seconds_count{rpc_grpc_status_code="0",rpc_method="Authorize",rpc_service="atmost.v1.Gate",rpc_system="grpc"}"#,
            5.0,
        ),
        (
            r#"rpc_server_call_duration_seconds_count{rpc_grpc_status_code="3",rpc_method="Authorize",rpc_service="atmost.v1.Gate",rpc_system="grpc"}"#,
            1.0,
        ),
        (
            r#"rpc_server_call_duration_seconds_count{rpc_grpc_status_code="0",rpc_method="CreatePermit",rpc_service="atmost.v1.Permits",rpc_system="grpc"}"#,
            3.0,
        ),
        (
            r#"rpc_server_call_duration_seconds_count{rpc_grpc_status_code="0",rpc_method="MarkUncertain",rpc_service="atmost.v1.Gate",rpc_system="grpc"}"#,
            1.0,
        ),
        (r#"atmost_admission_shed_total{stage="queue"}"#, 0.0),
        (r#"atmost_admission_in_flight"#, 0.0),
        (r#"atmost_admission_limit"#, 512.0),
        (r#"atmost_build_info{version="0.1.0"}"#, 1.0),
        ("atmost_uncertain_attempts", 1.0),
    ];
    let mut wrong = Vec::new();
    for (series, want) in expected {
        let got = value(&samples, series);
        if got != want {
            wrong.push(format!("{series}: {got}, expected {want}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{wrong:#?}\nscraped: {:#?}",
        samples
            .iter()
            .filter(|(k, _)| !k.contains("_bucket"))
            .collect::<Vec<_>>()
    );
    // No permit id, key or tenant ever labels a series.
    for series in samples.keys() {
        for id in [a, b, short.permit_id.as_str(), "k1", "k2"] {
            assert!(!series.contains(&format!("\"{id}\"")), "{series}");
        }
    }
    // Only /metrics is served.
    assert!(get(metrics, "/").await.starts_with("HTTP/1.0 404"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_each_decision_and_the_uncertain_memory() {
    let _machine = crate::support::shared().await;
    a_scrape_counts_each_decision_and_the_uncertain(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_counts_each_decision_and_the_uncertain_redis() {
    let _machine = crate::support::shared().await;
    a_scrape_counts_each_decision_and_the_uncertain(Some(Redis::start())).await;
}

/// A configuration the server cannot honour stops it at start-up, naming
/// the variable.
#[test]
fn an_otel_setting_atmost_cannot_honour_stops_it_at_start_up() {
    let _machine = crate::support::shared_blocking();
    for (var, value, said) in [
        (
            "OTEL_TRACES_EXPORTER",
            "zipkin",
            "OTEL_TRACES_EXPORTER=zipkin",
        ),
        ("OTEL_METRICS_EXPORTER", "prometheus", "--metrics-listen"),
    ] {
        let (status, stderr) = crate::support::run_to_exit_with_env(
            &["--listen", "127.0.0.1:0"],
            [
                (var, value),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1"),
            ],
        );
        assert!(!status.success());
        assert!(stderr.contains(said), "{stderr}");
    }
    let (status, stderr) = crate::support::run_to_exit_with_env(
        &["--listen", "127.0.0.1:0"],
        [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ],
    );
    assert!(!status.success());
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"),
        "{stderr}"
    );
}

/// The metric names a live server exports once every instrument has a
/// sample (a decision, an error, a duplicate dispatched, a store call, a
/// census pass), read from its `/metrics`: what deploy/'s rules and
/// dashboard may use (tests/deploy.rs).
pub async fn exported_metric_names() -> std::collections::BTreeSet<String> {
    let args = [
        "--metrics-listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--uncertain-census-interval".to_owned(),
        "1s".to_owned(),
    ];
    let server = spawn_atmost_with_env::<String>(&args, &[]);
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let client = server.client().await;
    let permit = client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(now_ms() + 3_600_000)
                .duplicate_guard(pb::DuplicateGuardMode::Log, None),
        )
        .await
        .expect("create");
    for key in ["k1", "k2"] {
        client
            .authorize(authorize(&permit.permit_id, key, b"fp"))
            .await
            .expect("dispatch");
    }
    client
        .authorize(authorize("", "k", b"fp"))
        .await
        .expect_err("invalid");
    let samples = scrape_until(metrics, "a census pass", |s| {
        s.contains_key("atmost_uncertain_attempts")
            && s.contains_key(r#"atmost_duplicate_guard_hits_total{action="dispatched"}"#)
    })
    .await;
    samples
        .keys()
        .map(|series| series.split('{').next().expect("a name").to_owned())
        .collect()
}

/// While the store cannot be reached the census keeps its last figures and
/// says how old they are; once it can, a pass replaces them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_census_that_cannot_run_keeps_its_figures_and_says_how_old() {
    let _machine = crate::support::shared().await;
    let mut redis = Redis::start_persistent();
    let mut args = redis.serve_args();
    args.extend([
        "--metrics-listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--uncertain-census-interval".to_owned(),
        "1s".to_owned(),
        "--store-timeout".to_owned(),
        "200ms".to_owned(),
    ]);
    let server = spawn_atmost_with_env::<String>(&args, &[]);
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let client = server.client().await;
    // A lease of 1 ms: UNCERTAIN as soon as it is reserved.
    let permit = client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(now_ms() + 3_600_000)
                .lease(Duration::from_millis(1)),
        )
        .await
        .expect("create");
    client
        .authorize(authorize(&permit.permit_id, "k1", b"fp"))
        .await
        .expect("dispatch");
    scrape_until(metrics, "the lease that ran out", |s| {
        value(s, "atmost_uncertain_attempts") == 1.0
    })
    .await;

    redis.kill();
    // No pass can complete now: the census age passes several intervals.
    let stale = scrape_until(metrics, "a stale census", |s| {
        value(s, "atmost_uncertain_census_age_seconds") > 3.0
    })
    .await;
    assert_eq!(value(&stale, "atmost_uncertain_attempts"), 1.0, "kept");
    let later = scrape(metrics).await;
    assert!(
        value(&later, "atmost_uncertain_census_age_seconds")
            >= value(&stale, "atmost_uncertain_census_age_seconds")
    );

    redis.restart();
    let fresh = scrape_until(metrics, "a pass after Redis came back", |s| {
        value(s, "atmost_uncertain_census_age_seconds")
            < value(&stale, "atmost_uncertain_census_age_seconds")
    })
    .await;
    assert_eq!(value(&fresh, "atmost_uncertain_attempts"), 1.0);
}

/// A replica started while Redis is down has no census pass to report: the
/// two figures are absent (not a false 0), and the census age counts from
/// start-up, so `AtmostUncertainCensusStale` fires for it as for a replica
/// whose census stopped; once Redis answers, a pass reports the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_census_that_never_completed_says_how_long_since_start_up() {
    let _machine = crate::support::shared().await;
    let mut redis = Redis::start_persistent();
    redis.kill();
    let mut args = redis.serve_args();
    args.extend([
        "--metrics-listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--uncertain-census-interval".to_owned(),
        "1s".to_owned(),
        "--store-timeout".to_owned(),
        "200ms".to_owned(),
    ]);
    let server = spawn_atmost_with_env::<String>(&args, &[]);
    let metrics = server.metrics_addr().expect("atmost metrics on ADDR");
    let blind = scrape_until(metrics, "a census age with no pass behind it", |s| {
        value(s, "atmost_uncertain_census_age_seconds") > 3.0
    })
    .await;
    for absent in [
        "atmost_uncertain_attempts",
        "atmost_uncertain_oldest_age_seconds",
    ] {
        assert!(!blind.contains_key(absent), "{absent} without a pass");
    }

    redis.restart();
    let counted = scrape_until(metrics, "the first pass", |s| {
        s.contains_key("atmost_uncertain_attempts")
    })
    .await;
    assert_eq!(value(&counted, "atmost_uncertain_attempts"), 0.0);
    assert_eq!(value(&counted, "atmost_uncertain_oldest_age_seconds"), 0.0);
    assert!(
        counted.contains_key("atmost_uncertain_oldest_age_seconds"),
        "{counted:?}"
    );
    assert!(
        value(&counted, "atmost_uncertain_census_age_seconds")
            < value(&blind, "atmost_uncertain_census_age_seconds")
    );
}
