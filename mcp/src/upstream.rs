//! The one upstream MCP server the proxy forwards to: a Streamable HTTP
//! endpoint, or a child process over stdio. A connection that has closed
//! (the child exited, the HTTP client's worker stopped) is opened again on
//! the next request, so the proxy outlives an upstream restart.
//!
//! What matters to atmost is whether a tools/call may have reached the
//! upstream: [`Upstream::call_tool`] answers [`CallError::NotSent`] only
//! when it certainly did not (no connection could be opened, the upstream
//! said the session was unknown, the child's stdin was already closed), and
//! [`CallError::Unknown`] for every other failure after sending began.

use crate::config::UpstreamSpec;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, Implementation,
    ListToolsResult, PaginatedRequestParams,
};
use rmcp::service::{Peer, RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use rmcp::{ErrorData, ServiceExt};
use tokio::sync::Mutex;

type Connection = RunningService<RoleClient, ClientConfig>;

/// Why a call to the upstream returned no result.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The upstream answered the request with a JSON-RPC error.
    #[error("the upstream answered an error: {0}")]
    Answered(ErrorData),
    /// The request certainly never reached the upstream.
    #[error("not sent to the upstream: {0}")]
    NotSent(String),
    /// The request may have reached the upstream; what happened is unknown.
    #[error("the upstream's answer was lost: {0}")]
    Unknown(String),
}

pub struct Upstream {
    spec: UpstreamSpec,
    /// The HTTP client, made once (its CA read at start-up).
    http: Option<reqwest::Client>,
    connection: Mutex<Option<Connection>>,
}

impl Upstream {
    /// Checks the spec (reads the CA file); connects on first use.
    pub fn new(spec: UpstreamSpec) -> Result<Self, String> {
        let http = match &spec {
            UpstreamSpec::Http { ca, .. } => {
                let mut builder = reqwest::Client::builder();
                if let Some(path) = ca {
                    let pem = std::fs::read(path)
                        .map_err(|e| format!("--upstream-tls-ca {}: {e}", path.display()))?;
                    let certs = reqwest::Certificate::from_pem_bundle(&pem)
                        .map_err(|e| format!("--upstream-tls-ca {}: {e}", path.display()))?;
                    builder = builder.tls_certs_merge(certs);
                }
                Some(
                    builder
                        .build()
                        .map_err(|e| format!("the upstream's HTTP client: {e}"))?,
                )
            }
            UpstreamSpec::Command { .. } => None,
        };
        Ok(Self {
            spec,
            http,
            connection: Mutex::new(None),
        })
    }

    /// For logs: the URL, or the command.
    pub fn describe(&self) -> String {
        match &self.spec {
            UpstreamSpec::Http { url, .. } => url.clone(),
            UpstreamSpec::Command { program, args } => std::iter::once(program.as_str())
                .chain(args.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }

    /// The open connection's peer, connecting (again) when there is none
    /// or it has closed. An error here means nothing was sent.
    async fn peer(&self) -> Result<Peer<RoleClient>, String> {
        let mut connection = self.connection.lock().await;
        if let Some(open) = connection.as_ref()
            && !open.is_closed()
            && !open.peer().is_transport_closed()
        {
            return Ok(open.peer().clone());
        }
        if let Some(closed) = connection.take() {
            tracing::info!(upstream = %self.describe(), "the upstream connection closed; opening a new one");
            drop(closed);
        }
        let open = self.connect().await?;
        let peer = open.peer().clone();
        *connection = Some(open);
        Ok(peer)
    }

    async fn connect(&self) -> Result<Connection, String> {
        let config = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("atmost-mcp", env!("CARGO_PKG_VERSION")),
        );
        let upstream = self.describe();
        let connection = match (&self.spec, &self.http) {
            (UpstreamSpec::Http { url, .. }, Some(http)) => {
                let transport = StreamableHttpClientTransport::with_client(
                    http.clone(),
                    StreamableHttpClientTransportConfig::with_uri(url.as_str()),
                );
                config.serve(transport).await
            }
            (UpstreamSpec::Command { program, args }, _) => {
                let mut command = tokio::process::Command::new(program);
                command.args(args);
                let transport = TokioChildProcess::new(command)
                    .map_err(|e| format!("cannot start the upstream {upstream:?}: {e}"))?;
                config.serve(transport).await
            }
            (UpstreamSpec::Http { .. }, None) => unreachable!("an HTTP upstream has its client"),
        };
        let connection =
            connection.map_err(|e| format!("cannot open the upstream {upstream}: {e}"))?;
        tracing::info!(%upstream, "connected to the upstream");
        Ok(connection)
    }

    /// Connects now if not yet connected (at start-up, for an early word in
    /// the log when the upstream cannot be reached).
    pub async fn warm_up(&self) -> Result<(), String> {
        self.peer().await.map(|_| ())
    }

    /// The upstream's instructions to agents, when connected and it has
    /// some.
    pub async fn instructions(&self) -> Option<String> {
        let peer = self.peer().await.ok()?;
        peer.peer_info().and_then(|info| info.instructions.clone())
    }

    /// One page of the upstream's tools.
    pub async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
    ) -> Result<ListToolsResult, CallError> {
        let peer = self.peer().await.map_err(CallError::NotSent)?;
        peer.list_tools(request).await.map_err(classify)
    }

    /// Sends one tools/call, once (never retried here).
    pub async fn call_tool(
        &self,
        request: CallToolRequestParams,
    ) -> Result<CallToolResponse, CallError> {
        let peer = self.peer().await.map_err(CallError::NotSent)?;
        peer.call_tool_once(request).await.map_err(classify)
    }
}

/// Sorts a failed request by whether it may have reached the upstream.
fn classify(error: ServiceError) -> CallError {
    match error {
        ServiceError::McpError(answer) => CallError::Answered(answer),
        ServiceError::TransportSend(ref sending) if never_sent(sending.error.as_ref()) => {
            CallError::NotSent(error.to_string())
        }
        other => CallError::Unknown(other.to_string()),
    }
}

/// Whether a transport's send error proves the request did not reach the
/// upstream: the HTTP connection (TCP, TLS) could not be opened; the
/// upstream answered 404 to the session, which it does only for a session
/// it does not know and so did not run the request in; the child's stdin
/// was closed (it had exited) before the request was written.
fn never_sent(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    if let Some(http) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        return match http {
            StreamableHttpError::Client(e) => e.is_connect(),
            StreamableHttpError::SessionExpired => true,
            _ => false,
        };
    }
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        return io.kind() == std::io::ErrorKind::BrokenPipe;
    }
    false
}
