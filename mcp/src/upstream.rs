//! The one upstream MCP server the proxy forwards to: a Streamable HTTP
//! endpoint, or a child process over stdio. A connection that has closed
//! (the child exited, the HTTP client's worker stopped) is opened again on
//! the next request, so the proxy outlives an upstream restart.
//!
//! What matters to atmost is whether a tools/call may have reached the
//! upstream. The gate opens the connection ([`Upstream::connected`]) before
//! it asks atmost, so an upstream that cannot be reached costs no attempt.
//! Then [`call_tool`] answers [`CallError::NotSent`] only when the request
//! certainly did not reach it (the HTTP connection could not be opened, the
//! upstream refused the session or the credentials before running
//! anything, the child's stdin was closed before any byte of the request
//! was written), and [`CallError::Unknown`] for every other failure after
//! sending began.
//!
//! Over HTTP all agents' calls share one MCP session with the upstream.
//! When the upstream answers 404 to it (it restarted, or evicted the
//! session, or a replica that never had it answered), that request was not
//! run: it is sent once more in a new session, and later calls go there.
//! Calls still in flight in the old session keep their connection, and its
//! response streams, until they end: their answers may still come. rmcp's
//! own recovery (`reinit_on_expired_session`, on by default) is turned off
//! because it ends every request pending in the session with a JSON-RPC
//! error of its own making (-32603 "session was re-initialized before the
//! response arrived"), indistinguishable from the tool's answer but by its
//! text, and drops the answers still on their way.

use crate::child::{self, ChildProcess};
use crate::config::UpstreamSpec;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, ErrorCode,
    Implementation, ListToolsResult, PaginatedRequestParams,
};
use rmcp::service::{ClientInitializeError, Peer, RoleClient, RunningService, ServiceError};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::{ErrorData, ServiceExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

/// How long opening the upstream connection may take: TCP (and TLS) and
/// MCP's initialize handshake, or a child process's start and handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// The message of the error rmcp's HTTP client makes up for each request
/// pending when it re-initializes an expired session (only with
/// `reinit_on_expired_session`, which the proxy turns off): not an answer
/// of the upstream's.
const RMCP_REINITIALIZED: &str =
    "streamable HTTP session was re-initialized before the response arrived";

pub struct Upstream {
    spec: UpstreamSpec,
    /// The HTTP client, made once (its CA read at start-up).
    http: Option<reqwest::Client>,
    /// The connection new requests go to.
    connection: Mutex<Option<Session>>,
}

/// One connection to the upstream (over HTTP, one MCP session; else one
/// child process). It stays open while anything holds it: the
/// [`Upstream`] until it is replaced, and each call in flight on it.
#[derive(Clone)]
pub struct Session(Arc<Live>);

struct Live {
    service: Connection,
    /// The upstream answered 404 to this session: it no longer knows it.
    expired: AtomicBool,
}

impl Session {
    fn peer(&self) -> &Peer<RoleClient> {
        self.0.service.peer()
    }

    /// Whether new requests may go to it.
    pub fn usable(&self) -> bool {
        !self.0.expired.load(Ordering::Acquire)
            && !self.0.service.is_closed()
            && !self.peer().is_transport_closed()
    }

    /// The upstream's instructions to agents, if it gave some.
    pub fn instructions(&self) -> Option<String> {
        self.peer()
            .peer_info()
            .and_then(|info| info.instructions.clone())
    }
}

impl Upstream {
    /// Checks the spec (reads the CA file); connects on first use.
    pub fn new(spec: UpstreamSpec) -> Result<Self, String> {
        let http = match &spec {
            UpstreamSpec::Http { ca, .. } => {
                let mut builder = reqwest::Client::builder().connect_timeout(CONNECT_TIMEOUT);
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

    /// The connection new requests go to, connecting (again) when there is
    /// none, it has closed, or its session expired, within
    /// [`CONNECT_TIMEOUT`]. An error here means nothing was sent.
    pub async fn connected(&self) -> Result<Session, String> {
        let mut connection = self.connection.lock().await;
        if let Some(open) = connection.as_ref()
            && open.usable()
        {
            return Ok(open.clone());
        }
        if let Some(old) = connection.take() {
            if old.0.expired.load(Ordering::Acquire) {
                tracing::info!(upstream = %self.describe(), "the upstream no longer knows the session; opening a new one (calls in flight keep the old one)");
            } else {
                tracing::info!(upstream = %self.describe(), "the upstream connection closed; opening a new one");
            }
            // Closed once the calls in flight on it, if any, have ended.
            drop(old);
        }
        let open = tokio::time::timeout(CONNECT_TIMEOUT, self.connect())
            .await
            .map_err(|_| {
                format!(
                    "the upstream {} did not answer within {CONNECT_TIMEOUT:?}",
                    self.describe()
                )
            })??;
        let open = Session(Arc::new(Live {
            service: open,
            expired: AtomicBool::new(false),
        }));
        *connection = Some(open.clone());
        Ok(open)
    }

    /// A connection in place of `expired`, whose session the upstream no
    /// longer knows (an error: nothing was sent).
    async fn renew(&self, expired: &Session) -> Result<Session, String> {
        expired.0.expired.store(true, Ordering::Release);
        self.connected().await
    }

    async fn connect(&self) -> Result<Connection, String> {
        let config = ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("atmost-mcp", env!("CARGO_PKG_VERSION")),
        );
        let upstream = self.describe();
        let connection = match (&self.spec, &self.http) {
            (UpstreamSpec::Http { url, .. }, Some(http)) => {
                // No transparent re-initialization: a 404 to the session
                // comes back as SessionExpired (not sent), and the request
                // is sent once more in a new session (call_tool), leaving
                // the calls in flight in the old one alone (the module's
                // doc says why).
                let transport = StreamableHttpClientTransport::with_client(
                    http.clone(),
                    StreamableHttpClientTransportConfig::with_uri(url.as_str())
                        .reinit_on_expired_session(false),
                );
                config.serve(transport).await
            }
            (UpstreamSpec::Command { program, args }, _) => {
                let mut command = tokio::process::Command::new(program);
                command.args(args);
                let transport = ChildProcess::spawn(command)
                    .map_err(|e| format!("cannot start the upstream {upstream:?}: {e}"))?;
                config.serve(transport).await
            }
            (UpstreamSpec::Http { .. }, None) => unreachable!("an HTTP upstream has its client"),
        };
        let connection = connection
            .map_err(|e| format!("cannot open the upstream {upstream}: {}", with_sources(&e)))?;
        tracing::info!(%upstream, "connected to the upstream");
        Ok(connection)
    }

    /// Connects now if not yet connected (at start-up, for an early word in
    /// the log when the upstream cannot be reached).
    pub async fn warm_up(&self) -> Result<(), String> {
        self.connected().await.map(|_| ())
    }

    /// The upstream's instructions to agents, when connected and it has
    /// some.
    pub async fn instructions(&self) -> Option<String> {
        self.connected().await.ok()?.instructions()
    }

    /// One page of the upstream's tools.
    pub async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
    ) -> Result<ListToolsResult, CallError> {
        let session = self.connected().await.map_err(CallError::NotSent)?;
        match session.peer().list_tools(request.clone()).await {
            Err(e) if session_expired(&e) => {
                let session = self.renew(&session).await.map_err(CallError::NotSent)?;
                session.peer().list_tools(request).await.map_err(classify)
            }
            answer => answer.map_err(classify),
        }
    }

    /// Sends one tools/call in `session`. Only when the upstream answered
    /// 404 to the session, so did not run it, is it sent once more, in a
    /// new session.
    pub async fn call_tool(
        &self,
        session: Session,
        request: CallToolRequestParams,
    ) -> Result<CallToolResponse, CallError> {
        match session.peer().call_tool_once(request.clone()).await {
            Err(e) if session_expired(&e) => {
                tracing::info!(upstream = %self.describe(), "the upstream answered 404 to the session: the call was not run; sending it in a new session");
                let session = self.renew(&session).await.map_err(CallError::NotSent)?;
                session
                    .peer()
                    .call_tool_once(request)
                    .await
                    .map_err(classify)
            }
            answer => answer.map_err(classify),
        }
    }
}

/// Whether the request failed because the upstream answered 404 to its
/// session, which it does only for a session it does not know (and so
/// did not run the request in).
fn session_expired(error: &ServiceError) -> bool {
    let ServiceError::TransportSend(sending) = error else {
        return false;
    };
    matches!(
        sending
            .error
            .downcast_ref::<StreamableHttpError<reqwest::Error>>(),
        Some(StreamableHttpError::SessionExpired)
    )
}

/// An error and its sources in one line (a transport error's own text is
/// often only "error sending request"; its sources say what happened: a
/// refused connection, an untrusted certificate). Each said once.
fn with_sources(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = next_source(error);
    while let Some(s) = source {
        let said = s.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        source = next_source(s);
    }
    text
}

/// The error's source; two of rmcp's errors name the error beneath them
/// without giving it as their source.
fn next_source<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a (dyn std::error::Error + 'static)> {
    if let Some(source) = error.source() {
        return Some(source);
    }
    if let Some(ClientInitializeError::TransportError { error, .. }) = error.downcast_ref() {
        return Some(error);
    }
    match error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        Some(StreamableHttpError::Client(e)) => Some(e),
        _ => None,
    }
}

/// Sorts a failed request by whether it may have reached the upstream. A
/// JSON-RPC error is the upstream's answer, but for the one rmcp makes up
/// itself when it re-initializes a session (which the proxy does not let
/// it do; kept apart should it ever come): the request may have run.
fn classify(error: ServiceError) -> CallError {
    match error {
        ServiceError::McpError(made_up)
            if made_up.code == ErrorCode::INTERNAL_ERROR
                && made_up.message == RMCP_REINITIALIZED =>
        {
            CallError::Unknown(format!(
                "rmcp's HTTP client ended the request: {}",
                made_up.message
            ))
        }
        ServiceError::McpError(answer) => CallError::Answered(answer),
        ServiceError::TransportSend(ref sending) if never_sent(sending.error.as_ref()) => {
            CallError::NotSent(with_sources(&error))
        }
        other => CallError::Unknown(with_sources(&other)),
    }
}

/// Whether a transport's send error proves the request did not reach the
/// upstream's tool: the HTTP connection (TCP, TLS) could not be opened; the
/// upstream answered 404 to the session, which it does only for a session
/// it does not know and so did not run the request in; it answered 401 or
/// 403 with an authentication challenge, refusing the credentials before
/// anything ran; the child's stdin was closed before any byte of the
/// request was written. Any other failure may have come after the tool
/// ran: a broken pipe after part of the request was written among them,
/// since the child may have read all of it but the newline
/// ([`crate::child`]).
fn never_sent(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    if let Some(http) = error.downcast_ref::<StreamableHttpError<reqwest::Error>>() {
        return match http {
            StreamableHttpError::Client(e) => e.is_connect(),
            StreamableHttpError::SessionExpired
            | StreamableHttpError::AuthRequired(_)
            | StreamableHttpError::InsufficientScope(_) => true,
            _ => false,
        };
    }
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        return child::nothing_written(io);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_rmcp_makes_up_on_re_initializing_is_no_answer() {
        let made_up = ServiceError::McpError(ErrorData::internal_error(RMCP_REINITIALIZED, None));
        assert!(matches!(classify(made_up), CallError::Unknown(_)));
        // The upstream's own -32603 is its answer.
        let answered =
            ServiceError::McpError(ErrorData::internal_error("the ledger is down", None));
        assert!(matches!(classify(answered), CallError::Answered(_)));
    }

    #[test]
    fn a_lost_connection_is_unknown() {
        assert!(matches!(
            classify(ServiceError::TransportClosed),
            CallError::Unknown(_)
        ));
        assert!(!session_expired(&ServiceError::TransportClosed));
    }
}
