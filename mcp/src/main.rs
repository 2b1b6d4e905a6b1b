#![forbid(unsafe_code)]
//! # atmost-mcp
//!
//! An MCP proxy that puts atmost in front of every `tools/call`: it serves
//! MCP to agents (Streamable HTTP at `/mcp`, or stdio) and forwards to one
//! upstream MCP server (Streamable HTTP, or a child process over stdio).
//! `tools/list` passes through; each `tools/call` is authorized by atmost
//! first, sent only on DISPATCH, and its outcome committed (a result with
//! `isError: true` is FAILED), marked uncertain when the upstream's answer
//! is lost, or given back (NotSent) when it was never sent. A REPLAY
//! answers the original result without calling the upstream. It is a
//! client of atmost over gRPC like any gateway, through atmost's Rust
//! client (`atmost-client`) and its guarded call. It exits only once the
//! calls in flight are recorded (docs/gateways.md, "Outcomes").
//!
//! ## Layout
//!
//! - `main.rs`: start-up: flags, logging, the atmost client, serving.
//! - `config.rs`: the flags and the cost table file.
//! - `proxy.rs`: the MCP server handler the agents talk to.
//! - `gate.rs`: one tools/call through atmost: permit, key, fingerprint,
//!   cost, the guarded call, and the answer (result, the tool error of a
//!   call awaiting approval, or JSON-RPC error).
//! - `upstream.rs`: the connection to the upstream, reopened when closed,
//!   and whether a failed call may have reached it.
//! - `child.rs`: the upstream as a child process over stdio, and whether a
//!   broken pipe left the request wholly unwritten.

mod child;
mod config;
mod gate;
mod proxy;
mod upstream;

use config::{Args, Costs, LogFormat};
use gate::Gate;
use proxy::{Answering, Proxy};
use rmcp::ServiceExt;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use std::io::{IsTerminal, Write};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_util::sync::CancellationToken;
use tonic::transport::ClientTlsConfig;
use upstream::Upstream;

/// The environment variable read for atmost's API key when no file is given.
const API_KEY_ENV: &str = "ATMOST_API_KEY";

fn main() -> ExitCode {
    let args = Args::from_command_line();
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("atmost-mcp: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(why)) => {
            eprintln!("atmost-mcp: {why}");
            ExitCode::from(2)
        }
        Err(Failure::Serve(why)) => {
            eprintln!("atmost-mcp: {why}");
            ExitCode::FAILURE
        }
    }
}

/// Why the proxy stopped: a configuration it cannot use (exit 2, nothing
/// served), or a failure while serving (exit 1).
enum Failure {
    Usage(String),
    Serve(String),
}

async fn run(args: Args) -> Result<(), Failure> {
    // reqwest (the upstream over https) takes rustls's process-wide
    // provider: ring, as atmost itself uses. Already installed is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let upstream_spec = args.upstream_spec().map_err(Failure::Usage)?;
    let permits = args.permit_source().map_err(Failure::Usage)?;
    let costs = match &args.costs {
        Some(path) => Costs::read(path).map_err(Failure::Usage)?,
        None => Costs::default(),
    };
    let client = atmost_client(&args)?;
    let upstream = Arc::new(Upstream::new(upstream_spec).map_err(Failure::Usage)?);
    let instructions = match upstream.warm_up().await {
        Ok(()) => upstream.instructions().await,
        Err(why) => {
            tracing::warn!(%why, "the upstream cannot be reached yet; trying again on each request");
            None
        }
    };
    let gate = Arc::new(Gate::new(
        client,
        permits,
        costs,
        args.dispatch_timeout,
        args.approval_wait,
        upstream,
        args.stdio.then(|| uuid::Uuid::new_v4().to_string()),
    ));
    let mut signals = StopSignals::new();

    // However serving ends, the guarded calls still running are waited
    // for (Gate::settle) before the runtime, and they with it, is dropped:
    // a call sent but never recorded would stay RESERVED until its lease.
    if args.stdio {
        let running = Proxy::new(Arc::clone(&gate), instructions)
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| Failure::Serve(format!("stdio: {e}")))?;
        let stop = running.cancellation_token();
        let watch = tokio::spawn({
            let gate = Arc::clone(&gate);
            async move {
                signals.next().await;
                // Whoever runs a stdio server and signals it kills it soon
                // after (the MCP SDKs' stdio clients close stdin, SIGTERM
                // a few seconds later, SIGKILL after that): the calls
                // still out are recorded as uncertain now.
                gate.abandon();
                stop.cancel();
                signals.next().await;
                exit_now();
            }
        });
        // stdin closed (the agent is gone), or the signal.
        let served = running.waiting().await;
        gate.settle().await;
        watch.abort();
        served.map_err(|e| Failure::Serve(format!("stdio: {e}")))?;
        return Ok(());
    }

    // Two tokens: `shutdown`, cancelled by the first signal, stops the
    // listener (axum's graceful shutdown); `sessions`, rmcp's own, ends
    // every session and response stream at once, and rmcp then gives its
    // handlers only 2 s to answer: an answer later than that would be
    // recorded but never reach its agent, whose retry (with a derived key,
    // in a new session) is a new intent. So `sessions` is cancelled only
    // once the calls in flight are recorded and the answers written out.
    let shutdown = CancellationToken::new();
    let sessions = CancellationToken::new();
    let mut config = StreamableHttpServerConfig::default();
    config.cancellation_token = sessions.clone();
    if !args.allowed_hosts.is_empty() {
        config = config.with_allowed_hosts(args.allowed_hosts.clone());
    }
    // A new handler for each session and each stateless request: a
    // handler knows whether it serves a session (proxy.rs).
    let handlers = Arc::clone(&gate);
    let service = StreamableHttpService::new(
        move || Ok(Proxy::new(Arc::clone(&handlers), instructions.clone())),
        LocalSessionManager::default().into(),
        config,
    );
    let router = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(tracked));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Failure::Serve(format!("--listen {}: {e}", args.listen)))?;
    let address = listener
        .local_addr()
        .map_err(|e| Failure::Serve(format!("--listen {}: {e}", args.listen)))?;
    // The first stdout line says where (with --listen 127.0.0.1:0, the
    // port the system chose): scripts and tests read it.
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "atmost-mcp listening on http://{address}/mcp");
    let _ = stdout.flush();
    tracing::info!(%address, server = %args.server, "serving MCP over Streamable HTTP at /mcp");
    let watch = tokio::spawn({
        let gate = Arc::clone(&gate);
        let shutdown = shutdown.clone();
        async move {
            signals.next().await;
            tracing::info!(
                "stopping: no new connections or calls; the calls in flight are waited for and answered (a second SIGTERM or Ctrl-C marks them uncertain, a third exits at once)"
            );
            gate.stop();
            shutdown.cancel();
            signals.next().await;
            gate.abandon();
            signals.next().await;
            exit_now();
        }
    });
    let mut server = tokio::spawn(
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.clone().cancelled_owned())
            .into_future(),
    );
    let served = tokio::select! {
        served = &mut server => served,
        () = shutdown.cancelled() => {
            gate.settle().await;
            gate.answers.close();
            if !gate.answers.is_empty() {
                tracing::info!(calls = gate.answers.len(), "waiting for the calls' answers to be written out");
            }
            gate.answers.wait().await;
            // What is left (the sessions' standalone streams, requests
            // other than calls) ends with the sessions, and the graceful
            // shutdown then completes.
            sessions.cancel();
            server.await
        }
    };
    sessions.cancel();
    gate.settle().await;
    watch.abort();
    match served {
        Ok(served) => served.map_err(|e| Failure::Serve(format!("serving: {e}"))),
        Err(e) => Err(Failure::Serve(format!("serving: {e}"))),
    }
}

/// Gives each request an [`Answering`], held by its response body until
/// that has ended (written out, or dropped: the agent went away).
async fn tracked(
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let answering = Answering::default();
    request.extensions_mut().insert(answering.clone());
    next.run(request).await.map(|body| {
        axum::body::Body::new(Tracked {
            body,
            answering: Some(answering),
        })
    })
}

/// A response body that holds its request's [`Answering`] until it ends.
struct Tracked {
    body: axum::body::Body,
    answering: Option<Answering>,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_))))
            && let Some(answering) = self.answering.take()
        {
            answering.written();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(answering) = self.answering.take() {
            answering.written();
        }
    }
}

/// The signal after the proxy's last step of stopping: it exits now, the
/// calls still out unrecorded (RESERVED until their lease).
fn exit_now() -> ! {
    tracing::warn!(
        "signalled again: exiting now, without waiting for the calls still out to be recorded"
    );
    std::process::exit(1);
}

/// SIGTERM and Ctrl-C (SIGINT), listened for from start-up, so that none
/// is missed between two waits.
struct StopSignals {
    #[cfg(unix)]
    listening: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl StopSignals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let listening = signal(SignalKind::terminate())
                .and_then(|term| Ok((term, signal(SignalKind::interrupt())?)))
                .ok();
            Self { listening }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The next one.
    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some((term, interrupt)) = &mut self.listening {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// atmost's client: connected on the first call (an atmost not up yet is
/// an UNAVAILABLE the guarded call retries, not a start-up failure).
fn atmost_client(args: &Args) -> Result<atmost_client::Client, Failure> {
    let server = &args.server;
    let tls = server.starts_with("https://");
    if !tls && !server.starts_with("http://") {
        return Err(Failure::Usage(format!(
            "--server {server:?}: give http://HOST:PORT, or https://HOST:PORT for TLS"
        )));
    }
    let mut builder = atmost_client::Client::builder(server.clone())
        .timeout(args.timeout)
        .connect_timeout(args.timeout);
    if tls {
        let mut config = ClientTlsConfig::new();
        config = match &args.tls_ca {
            Some(ca) => config.ca_certificate(tonic::transport::Certificate::from_pem(read(
                ca, "--tls-ca",
            )?)),
            None => config.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
            config = config.identity(tonic::transport::Identity::from_pem(
                read(cert, "--tls-cert")?,
                read(key, "--tls-key")?,
            ));
        }
        if let Some(name) = &args.tls_server_name {
            config = config.domain_name(name);
        }
        builder = builder.tls_config(config);
    } else if args.tls_ca.is_some() || args.tls_cert.is_some() || args.tls_server_name.is_some() {
        return Err(Failure::Usage(
            "--tls-ca, --tls-cert and --tls-server-name need an https:// --server".into(),
        ));
    }
    let key = match &args.api_key_file {
        Some(path) => {
            let text = String::from_utf8(read(path, "--api-key-file")?).map_err(|_| {
                Failure::Usage(format!("--api-key-file {}: not UTF-8 text", path.display()))
            })?;
            let key = text.trim().to_owned();
            if key.is_empty() {
                return Err(Failure::Usage(format!(
                    "--api-key-file {}: empty",
                    path.display()
                )));
            }
            Some(key)
        }
        // Set but empty is taken as not set, as shells write it.
        None => std::env::var(API_KEY_ENV).ok().filter(|k| !k.is_empty()),
    };
    if let Some(key) = key {
        builder = builder.api_key(key);
    }
    builder
        .connect_lazy()
        .map_err(|e| Failure::Usage(format!("--server {server}: {e}")))
}

fn read(path: &std::path::Path, flag: &str) -> Result<Vec<u8>, Failure> {
    std::fs::read(path).map_err(|e| Failure::Usage(format!("{flag} {}: {e}", path.display())))
}

/// Logs on stderr (stdout may be the MCP stream), filtered by RUST_LOG
/// (default: info for the proxy, errors from rmcp, whose warnings repeat
/// each error answer the proxy logs already, warnings from the rest).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,atmost_mcp=info,rmcp=error"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
