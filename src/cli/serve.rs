//! `atmost serve`: the runtime, logging and telemetry, the store, the
//! listeners, and the signals that stop it.

pub mod flags;
pub mod prepare;

use atmost::store::{Backend, memory::MemoryStore, redis::RedisStore};
use atmost::{App, run};
use flags::{LogFormat, ServeArgs};
use prepare::{Prepared, prepare};
use std::time::Duration;
use tokio::net::TcpListener;

/// `atmost serve` with its flags: exit code 0 after a clean shutdown, 2
/// for a setting it refuses, 1 for the rest.
pub fn main(args: ServeArgs) -> std::process::ExitCode {
    let prepared = match prepare(&args) {
        Ok(prepared) => prepared,
        Err(e) => {
            eprintln!("atmost: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        runtime.worker_threads(n.max(1));
    }
    let served = match runtime.enable_all().build() {
        Ok(runtime) => match init_logging(&runtime, &args) {
            Ok(telemetry) => {
                no_huge_pages();
                let served = runtime.block_on(serve(args, prepared, telemetry.clone()));
                // Flushes the spans and metrics, while the runtime the
                // exporters' channels run on is still there.
                telemetry.shutdown();
                // What the drain left running (it may end at its grace)
                // is dropped: an abandoned request's CANCELLED event is
                // queued then. A request waiting on a stuck audit output
                // is not waited for past a second.
                runtime.shutdown_timeout(Duration::from_secs(1));
                if let Err(why) = atmost::audit::flush(Duration::from_secs(10)) {
                    let counts = atmost::audit::counts();
                    eprintln!(
                        "atmost: the audit trail was not written out ({why}): {} events not \
                         written, {} lost to write errors",
                        counts.unwritten(),
                        counts
                            .write_errors
                            .load(std::sync::atomic::Ordering::Relaxed)
                    );
                }
                served
            }
            // The exporters the OTEL_* variables ask for could not be
            // built: a setting (prepare() found every case it knows).
            Err(e) => Err(Misconfigured(e).into()),
        },
        Err(e) => Err(e.into()),
    };
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // As written, not Debug-escaped: the operator reads this line.
            eprintln!("atmost: {e}");
            match e.is::<Misconfigured>() {
                true => std::process::ExitCode::from(2),
                false => std::process::ExitCode::FAILURE,
            }
        }
    }
}

/// A start-up failure that is a setting's (an address that cannot be
/// bound, an exporter that cannot be built): exit code 2, as for what
/// prepare() refuses. Exit code 1 is left for the rest: Redis refusing
/// (it evicts, it is too old) and failures while serving.
#[derive(Debug)]
struct Misconfigured(String);

impl std::fmt::Display for Misconfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Misconfigured {}

async fn serve(
    args: ServeArgs,
    prepared: Prepared,
    telemetry: atmost::telemetry::Telemetry,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let Prepared {
        retention_ms,
        quotas,
        redis,
        tls,
        receipts,
        auth,
        envoy,
        cors,
    } = prepared;
    let store = match redis {
        None => Backend::Memory(
            MemoryStore::new(retention_ms)
                .with_quotas(quotas)
                .with_max_bytes(args.memory_max_bytes),
        ),
        Some(config) => {
            // prepare() checked the configuration: what is left to fail
            // here is not a setting.
            let store = RedisStore::connect(&config)?.with_quotas(quotas);
            check_eviction(&store, args.store_timeout).await?;
            check_version(&store, args.store_timeout).await?;
            load_library(&store, args.store_timeout).await;
            Backend::Redis(store)
        }
    };
    let mut app = App::new(store)
        .with_store_timeout(args.store_timeout)
        .with_shutdown_grace(args.shutdown_grace)
        .with_drain_delay(args.drain_delay)
        .with_max_in_flight(args.max_in_flight)
        .with_max_queue_wait(args.max_queue_wait)
        .with_reflection(args.reflection)
        .with_envoy(envoy)
        .with_telemetry(telemetry)
        .with_census_interval(args.uncertain_census_interval)
        .with_approval_waits(atmost::domain::ApprovalWaits {
            default_ms: args.approval_wait_default.as_millis() as i64,
            max_ms: args.approval_wait_max.as_millis() as i64,
        })
        .with_limits(atmost::transport::Limits {
            max_connections: args.max_connections,
            max_concurrent_streams: args.max_concurrent_streams,
            max_request_bytes: args.max_request_bytes,
            max_response_bytes: args.max_response_bytes,
            max_header_list_bytes: args.max_header_list_bytes,
            keepalive_interval: args.keepalive_interval,
            keepalive_timeout: args.keepalive_timeout,
            idle_timeout: args.idle_timeout,
            max_connection_age: args.max_connection_age,
            max_connection_age_grace: args.max_connection_age_grace,
            handshake_timeout: args.handshake_timeout,
            request_timeout: args.request_timeout,
            max_pending_accept_reset_streams: args.h2_max_pending_resets,
            max_local_error_reset_streams: args.h2_max_local_resets,
        });
    if let Some(tls) = tls {
        app = app.with_tls(tls);
        tracing::info!(mtls = args.tls_client_ca.is_some(), "serving over TLS");
    }
    if let Some(keys) = receipts {
        tracing::info!(
            key_id = keys.current().signing_key_id(),
            "receipts are signed"
        );
        app = app.with_receipt_keys(std::sync::Arc::new(keys));
    }
    match auth {
        Some(auth) => {
            tracing::info!(keys = auth.keys().len(), file = ?args.auth_keys, "API keys loaded");
            app = app.with_auth(std::sync::Arc::new(auth));
        }
        None if args.non_loopback().is_some() => tracing::warn!(
            listen = %args.non_loopback().expect("matched"),
            "INSECURE: no authentication on a non-loopback address (--insecure-no-auth): \
             anyone who reaches this port may create permits and settle attempts"
        ),
        // prepare() refused a non-loopback address without either.
        None => tracing::warn!(
            "dev mode: no --auth-keys, so every caller may call every RPC; serving on loopback only"
        ),
    }

    if let Some(addr) = args.metrics_listen {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Misconfigured(format!("--metrics-listen {addr}: {e}")))?;
        let bound = listener.local_addr()?;
        // On stdout, so scripts and tests learn the port of
        // --metrics-listen :0; before the gRPC line, which stays the last
        // line at start-up (a reader that stops there misses nothing, and
        // nothing is written to a pipe it may have closed).
        println!("atmost metrics on {bound}");
        tracing::info!(addr = %bound, "serving /metrics");
        app = app.with_metrics_listener(listener);
    }

    let place = match (args.http, args.http_listen) {
        (false, _) => atmost::http::Place::Off,
        (true, None) => atmost::http::Place::Shared,
        (true, Some(addr)) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| Misconfigured(format!("--http-listen {addr}: {e}")))?;
            let bound = listener.local_addr()?;
            // As the metrics line: before the last line at start-up.
            println!("atmost http on {bound}");
            tracing::info!(addr = %bound, "serving HTTP/JSON on its own listener");
            atmost::http::Place::Own(listener)
        }
    };
    app = app.with_http(atmost::http::Serving {
        place,
        cors,
        // Open on purpose only where the edge itself listens off loopback:
        // on loopback, dev mode's Host check stays (--insecure-no-auth, or
        // a gRPC listener elsewhere, opens nothing more there).
        open: args.auth_keys.is_none()
            && args.insecure_no_auth
            && !args.http_listen.unwrap_or(args.listen).ip().is_loopback(),
    });

    // Listening for signals before the port is announced.
    let signals = signals();
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| Misconfigured(format!("--listen {}: {e}", args.listen)))?;
    let addr = listener.local_addr()?;
    // On stdout, so scripts and tests learn the port of --listen :0: the
    // last line at start-up (every listener is bound).
    println!("atmost listening on {addr}");
    tracing::info!(%addr, store = ?args.store_name(), "serving");
    let mut second = signals.clone();
    let app = app.with_drain_interrupt(async move {
        let _ = second.wait_for(|n| *n >= 2).await;
    });
    let mut first = signals;
    run(listener, app, async move {
        let _ = first.wait_for(|n| *n >= 1).await;
    })
    .await
}

/// Refuses to start on a Redis that may evict keys (unless allowed). A Redis
/// that does not answer yet is checked before the store serves anything.
async fn check_eviction(
    store: &RedisStore,
    timeout: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match tokio::time::timeout(timeout, store.eviction_policy()).await {
        Ok(Ok((_, Some(refusal)))) => Err(refusal.into()),
        Ok(Ok((_, None))) => Ok(()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "Redis unreachable at start-up: its maxmemory-policy is read before anything is served");
            Ok(())
        }
        Err(_) => {
            tracing::warn!(
                "Redis did not answer at start-up: its maxmemory-policy is read before anything is served"
            );
            Ok(())
        }
    }
}

/// Loads atmost's library on every primary before serving, while Redis has
/// room for it (past `maxmemory` Redis refuses `FUNCTION LOAD`, and a node
/// without the library could then answer nothing). A Redis that does not
/// take it now (unreachable, or the ACL lacks `function|load`) is logged;
/// each call that finds its function missing loads it again.
async fn load_library(store: &RedisStore, timeout: Duration) {
    match tokio::time::timeout(timeout, store.load_library()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "atmost's Redis functions not loaded at start-up: the first call loads them")
        }
        Err(_) => tracing::warn!(
            "Redis did not answer FUNCTION LOAD at start-up: the first call loads atmost's functions"
        ),
    }
}

/// Refuses to start on a Redis older than 7.0, whose Lua cannot run
/// atmost's scripts (they open with `#!lua` lines): every RPC would answer
/// UNAVAILABLE. A Redis that does not answer yet is read by the first
/// request instead (and fails it the same way).
async fn check_version(
    store: &RedisStore,
    timeout: Duration,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match tokio::time::timeout(timeout, store.server_version()).await {
        Ok(Ok((major, minor))) if major < 7 => Err(format!(
            "Redis {major}.{minor} is too old: atmost needs Redis 7.0 or later \
             (its scripts declare themselves with #!lua lines)"
        )
        .into()),
        _ => Ok(()),
    }
}

/// Logs, and the traces and metrics the OTEL_* variables and
/// --metrics-listen ask for (inside the runtime, which the OTLP exporters
/// run on).
fn init_logging(
    runtime: &tokio::runtime::Runtime,
    args: &ServeArgs,
) -> Result<atmost::telemetry::Telemetry, String> {
    let _runtime = runtime.enter();
    let telemetry = atmost::telemetry::Telemetry::init(atmost::telemetry::Config {
        json_logs: matches!(args.log_format, LogFormat::Json),
        prometheus: args.metrics_listen.is_some(),
    })?;
    atmost::audit::install(&atmost::audit::Config {
        output: args.audit_log.clone(),
        buffer_lines: usize::try_from(args.audit_buffer).unwrap_or(usize::MAX),
        when_full: args.audit_when_full,
    })?;
    Ok(telemetry)
}

/// Counts SIGTERMs and Ctrl-Cs: the first starts the shutdown, a second cuts
/// the drain delay short.
fn signals() -> tokio::sync::watch::Receiver<u32> {
    let (count, signals) = tokio::sync::watch::channel(0u32);
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::spawn(async move {
        loop {
            #[cfg(unix)]
            let term_once = async {
                match term.as_mut() {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let term_once = std::future::pending::<()>();
            let ctrl_c = async {
                if tokio::signal::ctrl_c().await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = ctrl_c => {}
                () = term_once => {}
            }
            count.send_modify(|n| *n += 1);
        }
    });
    signals
}

/// Turns transparent huge pages off for this process (inherited by its
/// threads), whatever the machine's THP mode: the kernel zeroes a huge page
/// whole on its first touch, which stalled a worker for about 5 ms on the
/// benchmark machine (docs/performance.md, "Huge pages"). Redis does the
/// same for itself.
fn no_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        tracing::warn!(error = %e, "could not turn transparent huge pages off");
    }
}
