//! The MCP server the agents see: tools/list passes through to the
//! upstream; tools/call goes through the [`Gate`]. Nothing else is offered
//! (no resources, prompts or completions): the proxy stands in front of
//! tools.

use crate::gate::{Gate, Origin};
use crate::upstream::CallError;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, InitializeRequestParams,
    InitializeResult, ListToolsResult, PaginatedRequestParams, ResultType, ServerCapabilities,
    ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio_util::task::task_tracker::TaskTrackerToken;

/// The handler of one session (stdio, or a Streamable HTTP session), or of
/// one stateless request: rmcp's Streamable HTTP service asks its factory
/// for a new one per session and per stateless request. Not `Clone`, so
/// that no two of them share [`Proxy::in_session`].
pub struct Proxy {
    pub gate: Arc<Gate>,
    /// The upstream's instructions, read when the proxy started.
    pub instructions: Option<String>,
    /// Set when this handler answered `initialize`: rmcp then serves it as
    /// a session's, and hands it only that session's requests. Over
    /// Streamable HTTP rmcp routes a request with an `Mcp-Session-Id` to
    /// the session's handler only after checking that it is a live session
    /// of its own (else 404); a request of the stateless protocol
    /// (2026-07-28) goes to a handler made for it alone, which never
    /// answered `initialize`, whatever `Mcp-Session-Id` it carries
    /// (rmcp's tower.rs, `handle_post`). rmcp checks nothing more: any
    /// client that knows a live session's id is served in that session,
    /// so the id is a bearer secret and a derived key only keeps apart
    /// calls that do not mean to collide (docs/gateways.md).
    in_session: AtomicBool,
}

impl Proxy {
    pub fn new(gate: Arc<Gate>, instructions: Option<String>) -> Self {
        Self {
            gate,
            instructions,
            in_session: AtomicBool::new(false),
        }
    }

    /// The session this request was served in, if any. Over stdio, the
    /// process's: the connection is one agent's. Over Streamable HTTP, the
    /// request's `Mcp-Session-Id` when this handler serves a session (rmcp
    /// routed the request here by that id, having checked only that the
    /// session is live); else none, whatever session its headers name.
    fn session(&self, headers: Option<&http::HeaderMap>) -> Option<String> {
        let Some(headers) = headers else {
            return self.gate.process_session.clone();
        };
        if !self.in_session.load(Ordering::Acquire) {
            return None;
        }
        headers
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

impl ServerHandler for Proxy {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("atmost-mcp", env!("CARGO_PKG_VERSION")));
        info.instructions = self.instructions.clone();
        info
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        // rmcp's own initialize, plus: this handler now serves a session.
        ctx.peer.set_peer_info(request.clone());
        let answer = self.negotiate_initialize(&request)?;
        self.in_session.store(true, Ordering::Release);
        Ok(answer)
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        _ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        match self.gate.upstream.list_tools(request).await {
            Ok(mut tools) => {
                tools.result_type.get_or_insert(ResultType::COMPLETE);
                Ok(tools)
            }
            Err(CallError::Answered(error)) => Err(error),
            Err(e) => Err(ErrorData::internal_error(format!("tools/list: {e}"), None)),
        }
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // rmcp hands the request's `_meta` over in ctx.meta (not in
        // request.meta), and the HTTP request's head in the extensions.
        let parts = ctx.extensions.get::<http::request::Parts>();
        // Over HTTP: this request's answer is a call's, to be written out
        // before the proxy ends the sessions.
        if let Some(answering) = parts.and_then(|p| p.extensions.get::<Answering>()) {
            answering.hold(self.gate.answers.token());
        }
        let headers = parts.map(|parts| parts.headers.clone());
        let origin = Origin {
            request_id: Some(ctx.id.clone()),
            session: self.session(headers.as_ref()),
            headers,
        };
        self.gate.call_tool(request, ctx.meta, origin).await
    }
}

/// Put in each HTTP request's extensions (main.rs) and held by its response
/// body until that has been written out: the tools/call handler puts a
/// token of [`Gate::answers`] in it, so the proxy, stopping, waits for the
/// answers of the calls in flight but not for other requests (a tools/list
/// the upstream never answers, say). The token goes when the body ends,
/// or when both the body and the handler are gone (the agent went away).
#[derive(Clone, Default)]
pub struct Answering(Arc<Mutex<Option<TaskTrackerToken>>>);

impl Answering {
    fn hold(&self, token: TaskTrackerToken) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(token);
    }

    /// The answer is out.
    pub fn written(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
    }
}
