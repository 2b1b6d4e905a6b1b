//! The MCP server the agents see: tools/list passes through to the
//! upstream; tools/call goes through the [`Gate`]. Nothing else is offered
//! (no resources, prompts or completions): the proxy stands in front of
//! tools.

use crate::gate::{Gate, Origin};
use crate::upstream::CallError;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, Implementation, ListToolsResult,
    PaginatedRequestParams, ResultType, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler};
use std::sync::Arc;

/// One per session (rmcp makes one per Streamable HTTP session, one for
/// stdio); cheap to clone, sharing the gate.
#[derive(Clone)]
pub struct Proxy {
    pub gate: Arc<Gate>,
    /// The upstream's instructions, read when the proxy started.
    pub instructions: Option<String>,
}

impl ServerHandler for Proxy {
    fn get_info(&self) -> ServerConfig {
        let mut info = ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("atmost-mcp", env!("CARGO_PKG_VERSION")));
        info.instructions = self.instructions.clone();
        info
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
        let origin = Origin {
            request_id: Some(ctx.id.clone()),
            headers: ctx
                .extensions
                .get::<http::request::Parts>()
                .map(|parts| parts.headers.clone()),
        };
        self.gate.call_tool(request, ctx.meta, origin).await
    }
}
