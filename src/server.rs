//! Serving: [`run`] takes a bound listener, the [`App`] (store, clock and
//! limits) and a shutdown future, so `main` and every test start the server
//! the same way.

use crate::admission::Admission;
use crate::api::envoy::{self, ext_authz::ExtAuthzService, ext_proc::ExtProcService};
use crate::api::layers::{AdmissionLayer, AuthLayer, MessageLimit, RequestTimeout};
use crate::api::{
    self, Ctx, approvals::ApprovalsService, gate::GateService, permits::PermitsService,
    receipts::ReceiptsService,
};
use crate::auth::Authenticator;
use crate::domain::{Clock, SystemClock};
use crate::pb::{self, gate_server::GateServer, permits_server::PermitsServer};
use crate::store::{Backend, Store};
use crate::telemetry::{RpcLayer, Telemetry};
use crate::transport::{Limits, Track};
use envoy_types::pb::envoy::service::auth::v3::authorization_server::AuthorizationServer;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// Default admission limit: atmost RPCs running at once. Past peak, an
/// admitted request waits about this many / throughput for the store
/// (Little's law): see docs/performance.md, "Overload".
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;

/// Default longest wait for an admission slot ([`crate::admission`]).
pub const DEFAULT_MAX_QUEUE_WAIT: Duration = Duration::from_millis(10);

/// The service as configured: its store, its one clock and its limits.
pub struct App {
    store: Arc<Backend>,
    clock: Arc<dyn Clock>,
    store_timeout: Duration,
    health_interval: Duration,
    shutdown_grace: Duration,
    drain_delay: Duration,
    /// Cuts the drain delay short when it completes (a second SIGTERM).
    drain_interrupt: Option<std::pin::Pin<Box<dyn Future<Output = ()> + Send>>>,
    max_in_flight: usize,
    max_queue_wait: Duration,
    sweep_interval: Duration,
    /// The API keys; `None` is dev mode: no authentication.
    auth: Option<Arc<Authenticator>>,
    auth_reload_interval: Duration,
    reflection: bool,
    tls: Option<crate::transport::Tls>,
    receipts: Option<Arc<crate::receipts::ReceiptSigner>>,
    limits: Limits,
    /// The Envoy front doors' mapping; `None`: they are not served.
    envoy: Option<Arc<api::envoy::Mapping>>,
    telemetry: Telemetry,
    /// Where `GET /metrics` is served (`--metrics-listen`).
    metrics_listener: Option<TcpListener>,
    census_interval: Duration,
    /// Whether the HTTP/JSON edge is served, and where.
    http: crate::http::Serving,
    approval_waits: crate::domain::ApprovalWaits,
}

/// Most sweep batches run back to back before the sweeper sleeps again.
const SWEEP_ROUNDS: usize = 16;

/// Default time between the end of one uncertain census pass and the start
/// of the next ([`crate::telemetry::census`]).
pub const DEFAULT_CENSUS_INTERVAL: Duration = Duration::from_secs(10);

impl App {
    /// The defaults: system clock, 2 s store deadline, store health checked
    /// every second, no drain delay and 10 s to drain on shutdown, 512
    /// requests in flight, the store swept every second.
    pub fn new(store: Backend) -> Self {
        Self {
            store: Arc::new(store),
            clock: Arc::new(SystemClock),
            store_timeout: Duration::from_secs(2),
            health_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(10),
            drain_delay: Duration::ZERO,
            drain_interrupt: None,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_queue_wait: DEFAULT_MAX_QUEUE_WAIT,
            sweep_interval: Duration::from_secs(1),
            auth: None,
            auth_reload_interval: Duration::from_secs(1),
            reflection: true,
            tls: None,
            receipts: None,
            limits: Limits::default(),
            envoy: Some(Arc::new(api::envoy::Mapping::default())),
            telemetry: Telemetry::off(),
            metrics_listener: None,
            census_interval: DEFAULT_CENSUS_INTERVAL,
            http: crate::http::Serving::default(),
            approval_waits: crate::domain::ApprovalWaits::DEFAULT,
        }
    }

    /// The default and the longest wait of a permit's approval rules
    /// (--approval-wait-default, --approval-wait-max).
    pub fn with_approval_waits(mut self, waits: crate::domain::ApprovalWaits) -> Self {
        self.approval_waits = waits;
        self
    }

    /// Serves the Envoy front doors (ext_authz and ext_proc) with this
    /// mapping, or not at all with `None`. On by default, with the default
    /// mapping.
    pub fn with_envoy(mut self, mapping: Option<api::envoy::Mapping>) -> Self {
        self.envoy = mapping.map(Arc::new);
        self
    }

    /// Records spans and metrics through this handle
    /// ([`Telemetry::init`] or [`Telemetry::build`]); off by default.
    pub fn with_telemetry(mut self, telemetry: Telemetry) -> Self {
        self.telemetry = telemetry;
        self
    }

    /// Serves `GET /metrics` (Prometheus text) on this listener; the
    /// telemetry must have been built with Prometheus on.
    pub fn with_metrics_listener(mut self, listener: TcpListener) -> Self {
        self.metrics_listener = Some(listener);
        self
    }

    /// Where and how the HTTP/JSON edge is served: on `run`'s listener
    /// beside gRPC by default, on a listener of its own, or not at all.
    pub fn with_http(mut self, http: crate::http::Serving) -> Self {
        self.http = http;
        self
    }

    /// Time between uncertain census passes (while metrics are exported).
    pub fn with_census_interval(mut self, interval: Duration) -> Self {
        self.census_interval = interval;
        self
    }

    /// The transport limits ([`Limits`]; its defaults otherwise).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Signs every receipt answers carry with these keys, and publishes
    /// their public halves (atmost.v1.Receipts/GetSigningKeys).
    pub fn with_receipt_keys(mut self, keys: Arc<crate::receipts::ReceiptSigner>) -> Self {
        self.receipts = Some(keys);
        self
    }

    /// Serves over TLS (and mTLS, when it names a client CA), on every
    /// listener.
    pub fn with_tls(mut self, tls: crate::transport::Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Authenticates every atmost RPC against these API keys (reloaded on
    /// SIGHUP and when the file changes). Without it: dev mode.
    pub fn with_auth(mut self, auth: Arc<Authenticator>) -> Self {
        self.auth = Some(auth);
        self
    }

    /// How often the key file is checked for changes.
    pub fn with_auth_reload_interval(mut self, interval: Duration) -> Self {
        self.auth_reload_interval = interval;
        self
    }

    /// Serves server reflection and the HTTP/JSON edge's OpenAPI document
    /// (on by default; unauthenticated, so turn it off where the service's
    /// shape is not for everyone to read).
    pub fn with_reflection(mut self, on: bool) -> Self {
        self.reflection = on;
        self
    }

    /// How often the store drops what nothing can reach any more
    /// ([`Store::sweep`]).
    pub fn with_sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Replaces the clock (tests move time with a [`ManualClock`](crate::domain::ManualClock)).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// How long one store call may take before the RPC answers UNAVAILABLE.
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = timeout;
        self
    }

    /// How often the store is pinged to keep gRPC health up to date.
    pub fn with_health_interval(mut self, interval: Duration) -> Self {
        self.health_interval = interval;
        self
    }

    /// How many atmost RPCs may run at once; more wait for a slot (up to
    /// the queue wait) or are shed with UNAVAILABLE / OVERLOADED.
    pub fn with_max_in_flight(mut self, max: usize) -> Self {
        self.max_in_flight = max.max(1);
        self
    }

    /// The longest a request waits for an admission slot before it is shed.
    pub fn with_max_queue_wait(mut self, wait: Duration) -> Self {
        self.max_queue_wait = wait;
        self
    }

    /// How long in-flight RPCs may take to finish after shutdown begins.
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// How long the server keeps serving, and accepting connections, after
    /// shutdown begins and health reports NOT_SERVING: the time load
    /// balancers and readiness probes need to see it and stop sending new
    /// requests here. Then it stops accepting and drains within the
    /// shutdown grace. Zero (the default) stops accepting at once.
    pub fn with_drain_delay(mut self, delay: Duration) -> Self {
        self.drain_delay = delay;
        self
    }

    /// Ends the drain delay early when `interrupt` completes (`main` passes
    /// a second SIGTERM or Ctrl-C).
    pub fn with_drain_interrupt(
        mut self,
        interrupt: impl Future<Output = ()> + Send + 'static,
    ) -> Self {
        self.drain_interrupt = Some(Box::pin(interrupt));
        self
    }
}

/// Serves `atmost.v1.Gate`, `atmost.v1.Permits`, `grpc.health.v1.Health`,
/// server reflection and the Envoy front doors (ext_authz, ext_proc) on
/// `listener` until `shutdown` completes; then
/// reports NOT_SERVING, goes on serving for the drain delay, stops
/// accepting, and lets in-flight RPCs finish within the shutdown grace.
pub async fn run(
    listener: TcpListener,
    app: App,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let admission = Arc::new(Admission::new(app.max_in_flight, app.max_queue_wait));
    let ctx = Ctx {
        admission: admission.clone(),
        store: app.store.clone(),
        clock: app.clock.clone(),
        store_timeout: app.store_timeout,
        receipts: app.receipts.clone(),
        approval_waits: app.approval_waits,
        decisions: Default::default(),
    };
    let decisions = ctx.decisions.clone();
    let (reporter, health_service) = tonic_health::server::health_reporter();
    // Reflection in both versions: grpc.reflection.v1, and v1alpha for the
    // clients that still speak only it (grpcurl before 1.8.8, grpcio's
    // reflection client, grpcui).
    // The Envoy services are listed only when served.
    let envoy = app.envoy.clone();
    let reflection = || {
        let builder = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
        match envoy {
            Some(_) => builder.register_encoded_file_descriptor_set(envoy::FILE_DESCRIPTOR_SET),
            None => builder,
        }
    };
    let (reflection_v1, reflection_v1alpha) = if app.reflection {
        (
            Some(reflection().build_v1()?),
            Some(reflection().build_v1alpha()?),
        )
    } else {
        (None, None)
    };

    let drain_interrupt = app.drain_interrupt;
    let stop = CancellationToken::new();
    let watch_stop = CancellationToken::new();
    // The store's first ping sets every service's status before the port
    // is served (connections wait in the listen backlog meanwhile), so the
    // first probe hears the store's state: never NOT_FOUND for a service
    // not yet registered, never SERVING before the store answered.
    let services = health_services(app.envoy.is_some());
    let first = store_status(&ctx, None).await;
    set_all(&reporter, services, first).await;
    let mut health_task = tokio::spawn(watch_store(
        ctx.clone(),
        reporter.clone(),
        services,
        app.health_interval,
        watch_stop.clone(),
        first,
    ));

    let mut sweep_task = tokio::spawn(sweep_store(
        ctx.clone(),
        app.sweep_interval,
        watch_stop.clone(),
    ));

    let telemetry = app.telemetry.clone();
    telemetry.observe_admission(&admission);
    let census_task = telemetry.metrics().then(|| {
        tokio::spawn(census_store(
            ctx.clone(),
            telemetry.clone(),
            app.census_interval,
            watch_stop.clone(),
        ))
    });
    let metrics_task = app.metrics_listener.map(|listener| {
        tokio::spawn(crate::telemetry::prometheus::serve(
            listener,
            telemetry.clone(),
            watch_stop.clone(),
        ))
    });

    let files_task = tokio::spawn(watch_files(
        app.auth.clone(),
        app.receipts.clone(),
        app.auth_reload_interval,
        watch_stop.clone(),
    ));

    let limits = &app.limits;
    // Every service decodes and encodes messages up to the limits only. A
    // request message past its limit is refused first by MessageLimit
    // (below), with atmost's reason; tonic's own check stays behind it.
    macro_rules! sized {
        ($service:expr) => {
            $service
                .max_decoding_message_size(limits.max_request_bytes)
                .max_encoding_message_size(limits.max_response_bytes)
        };
    }
    // The Envoy front doors call the Gate's own methods (api::envoy).
    // ext_proc records outcomes after its streams end: shutdown waits for
    // them (`settling`, below).
    let settling = envoy::ext_proc::Settling::default();
    let (ext_authz, ext_proc) = match &app.envoy {
        Some(mapping) => (
            Some(tonic::service::interceptor::InterceptedService::new(
                sized!(AuthorizationServer::new(ExtAuthzService::new(
                    GateService::new(ctx.clone()),
                    mapping.clone(),
                ))),
                api::stamp,
            )),
            Some(tonic::service::interceptor::InterceptedService::new(
                sized!(ExternalProcessorServer::new(ExtProcService::new(
                    GateService::new(ctx.clone()),
                    mapping.clone(),
                    settling.clone(),
                ))),
                api::stamp,
            )),
        ),
        None => (None, None),
    };
    let (listeners, http_layer, cors) =
        app.http
            .into_layers(listener, limits, app.auth.is_some(), app.reflection);
    let http1 = crate::transport::http1(&listeners);
    let serve = limits
        .server(http1)
        // Outermost: a browser's preflight is answered, and its answers
        // marked, for the origins --http-cors-origins allows (none unless
        // given).
        .layer(tower::util::option_layer(cors))
        // An HTTP/JSON request becomes its RPC's gRPC request here, and
        // takes every layer below as a gRPC call does.
        .layer(http_layer)
        .layer(RequestTimeout(limits.request_timeout))
        .layer(RpcLayer::new(&telemetry))
        .layer(Track)
        .layer(AuthLayer::new(app.auth.clone()))
        .layer(AdmissionLayer::new(admission))
        // It acts on the body as the services read it, after auth and
        // admission have refused what they refuse unread.
        .layer(MessageLimit::new(limits.max_request_bytes))
        // Innermost: an HTTP/JSON request got this far, so its JSON may
        // now be parsed.
        .layer(crate::http::ReachedLayer)
        .add_service(sized!(health_service))
        .add_optional_service(reflection_v1.map(|s| sized!(s)))
        .add_optional_service(reflection_v1alpha.map(|s| sized!(s)))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            sized!(GateServer::new(GateService::new(ctx.clone()))),
            api::stamp,
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            sized!(PermitsServer::new(PermitsService::new(ctx.clone()))),
            api::stamp,
        ))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            sized!(pb::approvals_server::ApprovalsServer::new(
                ApprovalsService::new(ctx.clone())
            )),
            api::stamp,
        ))
        .add_service(sized!(pb::receipts_server::ReceiptsServer::new(
            ReceiptsService::new(ctx),
        )))
        .add_optional_service(ext_authz)
        .add_optional_service(ext_proc)
        .serve_with_incoming_shutdown(
            limits.incoming(listeners, app.tls),
            stop.clone().cancelled_owned(),
        );
    tokio::pin!(serve);

    // When the shutdown grace ends, once it has begun.
    let mut grace_end = None;
    let result = tokio::select! {
        result = &mut serve => result.map_err(Into::into),
        () = shutdown => {
            // Health first (with the store watcher stopped, so it cannot
            // flip it back; aborted, so a slow store ping cannot delay
            // this), then serve on for the drain delay while load
            // balancers and readiness probes see NOT_SERVING and stop
            // sending, then stop accepting and drain.
            health_task.abort();
            let _ = (&mut health_task).await;
            set_all(&reporter, services, ServingStatus::NotServing).await;
            // Calls waiting for an approval answer now: their callers ask
            // again, elsewhere.
            decisions.close();
            let interrupt = async move {
                match drain_interrupt {
                    Some(interrupt) => interrupt.await,
                    None => std::future::pending().await,
                }
            };
            let ended = if app.drain_delay.is_zero() {
                None
            } else {
                tracing::info!(delay = ?app.drain_delay, "shutting down: NOT_SERVING, still serving for the drain delay");
                tokio::select! {
                    result = &mut serve => Some(result),
                    () = tokio::time::sleep(app.drain_delay) => None,
                    () = interrupt => {
                        tracing::info!("drain delay cut short");
                        None
                    }
                }
            };
            grace_end = Some(tokio::time::Instant::now() + app.shutdown_grace);
            match ended {
                Some(result) => result.map_err(Into::into),
                None => {
                    tracing::info!(grace = ?app.shutdown_grace, "shutting down: no longer accepting, draining in-flight requests");
                    stop.cancel();
                    match tokio::time::timeout(app.shutdown_grace, &mut serve).await {
                        Ok(result) => result.map_err(Into::into),
                        Err(_) => {
                            tracing::warn!(grace = ?app.shutdown_grace, "drain timed out; closing");
                            Ok(())
                        }
                    }
                }
            }
        }
    };
    // ext_proc's outcomes still being recorded (their streams are gone):
    // within what is left of the grace, then each abandoned one is logged.
    let left = grace_end.map_or(app.shutdown_grace, |end| {
        end.saturating_duration_since(tokio::time::Instant::now())
    });
    settling.drain(left).await;
    watch_stop.cancel();
    if !health_task.is_finished() {
        let _ = health_task.await;
    }
    sweep_task.abort();
    let _ = (&mut sweep_task).await;
    files_task.abort();
    let _ = files_task.await;
    for task in census_task.into_iter().chain(metrics_task) {
        task.abort();
        let _ = task.await;
    }
    result
}

/// Runs the uncertain census while metrics are exported
/// ([`crate::telemetry::census`]): a reading at once, then one `interval`
/// after each ends, until `stop`, under the store deadline (no admission
/// slot: like the sweep, it is the server's own work). A reading is the
/// fleet's figures, counted by this replica when its turn comes
/// ([`Store::census`]); a failed one leaves the last figures, growing
/// older.
async fn census_store(ctx: Ctx, telemetry: Telemetry, interval: Duration, stop: CancellationToken) {
    let Some(census) = telemetry.census() else {
        return;
    };
    // Whether the last pass failed: a failure is logged once (WARN), and
    // the pass that ends it once (INFO), not every interval.
    let mut failing = false;
    loop {
        let complete = match ctx
            .deadline(ctx.store.census(ctx.clock.now(), interval))
            .await
        {
            Ok(f) => {
                let ms = |ms: i64| Duration::from_millis(u64::try_from(ms).unwrap_or(0));
                census.publish(f.uncertain, ms(f.oldest_age_ms), ms(f.age_ms));
                true
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(
                        error = %e,
                        "uncertain census failed: atmost_uncertain_* keep their last figures; \
                         retried every interval"
                    );
                }
                false
            }
        };
        if complete && failing {
            tracing::info!("uncertain census completed again");
        }
        failing = !complete;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Re-reads the key files (API keys, receipt keys) on SIGHUP, and every
/// `interval` those that changed, until `stop`. SIGHUP is caught even with
/// no file to read: its default action would end the process.
async fn watch_files(
    auth: Option<Arc<Authenticator>>,
    receipts: Option<Arc<crate::receipts::ReceiptSigner>>,
    interval: Duration,
    stop: CancellationToken,
) {
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let hup = async {
            match hangup.as_mut() {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup = std::future::pending::<()>();
        let force = tokio::select! {
            () = stop.cancelled() => return,
            () = hup => true,
            () = tokio::time::sleep(interval) => false,
        };
        if force && auth.is_none() && receipts.is_none() {
            tracing::info!("SIGHUP: no key file to reload");
        }
        if let Some(auth) = &auth {
            auth.refresh(force);
        }
        if let Some(receipts) = &receipts {
            receipts.refresh(force);
        }
    }
}

/// Sweeps the store every `interval` until `stop`: batches back to back
/// while they find something to drop (up to [`SWEEP_ROUNDS`]), so the sweep
/// keeps up with permits expiring faster than one batch an interval.
async fn sweep_store(ctx: Ctx, interval: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        for _ in 0..SWEEP_ROUNDS {
            match ctx.deadline(ctx.store.sweep(ctx.clock.now())).await {
                Ok(0) => break,
                Ok(dropped) => tracing::debug!(dropped, "swept"),
                Err(e) => {
                    tracing::debug!(error = %e, "sweep failed; retried next interval");
                    break;
                }
            }
        }
    }
}

/// The services whose health is reported: the server's (""), atmost's,
/// and the Envoy front doors' when served (an Envoy cluster's gRPC health
/// check names one).
fn health_services(envoy: bool) -> &'static [&'static str] {
    const ALL: &[&str] = &[
        "",
        "atmost.v1.Gate",
        "atmost.v1.Permits",
        envoy::EXT_AUTHZ_SERVICE,
        envoy::EXT_PROC_SERVICE,
    ];
    if envoy { ALL } else { &ALL[..3] }
}

async fn set_all(reporter: &HealthReporter, services: &[&str], status: ServingStatus) {
    for service in services {
        reporter.set_service_status(*service, status).await;
    }
}

/// The store's health now: SERVING if it answers its ping within the store
/// deadline. Logs the change from `last`.
async fn store_status(ctx: &Ctx, last: Option<ServingStatus>) -> ServingStatus {
    match ctx.deadline(ctx.store.ping()).await {
        Ok(()) => {
            if last == Some(ServingStatus::NotServing) {
                tracing::info!("store reachable again: SERVING");
            }
            ServingStatus::Serving
        }
        Err(e) => {
            if last != Some(ServingStatus::NotServing) {
                tracing::error!(error = %e, "store unreachable: NOT_SERVING");
            }
            ServingStatus::NotServing
        }
    }
}

/// Keeps gRPC health in step with the store, from `last` (already set):
/// SERVING while it answers, NOT_SERVING while it does not, until `stop`.
async fn watch_store(
    ctx: Ctx,
    reporter: HealthReporter,
    services: &'static [&'static str],
    interval: Duration,
    stop: CancellationToken,
    mut last: ServingStatus,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let status = store_status(&ctx, Some(last)).await;
        if stop.is_cancelled() {
            return;
        }
        if last != status {
            set_all(&reporter, services, status).await;
            last = status;
        }
    }
}
