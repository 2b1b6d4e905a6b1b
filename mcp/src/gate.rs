//! One tools/call through atmost: the call's permit, idempotency key,
//! fingerprint and cost; the guarded call of atmost's Rust client
//! (Authorize, the call forwarded at most once on DISPATCH, Commit or
//! MarkUncertain); and its outcome as the agent sees it: the tool's result
//! (now, or replayed from the receipt), an isError result of the proxy's
//! own for a call that awaits a person's approval, or a JSON-RPC error
//! whose `data` says why (docs/gateways.md, "atmost-mcp", lists every
//! case).

use crate::config::{Costs, PermitSource};
use crate::upstream::{CallError, Session, Upstream};
use atmost_client::{
    AttemptId, Client, DispatchError, Dispatched, GuardError, GuardedCall, Outcome, Unrecorded,
};
use pending::Pending;
use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorCode, MetaObject,
    RequestId, RequestMetaObject, ResultType,
};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// `params._meta` key: the agent's idempotency key for this call.
pub const META_IDEMPOTENCY_KEY: &str = "io.atmost/idempotency-key";
/// `_meta` key on the forwarded request and on the result: the attempt id,
/// for the upstream to use as its own idempotency key.
pub const META_ATTEMPT_ID: &str = "io.atmost/attempt-id";
/// `_meta` key on the result: the key the call was authorized under (the
/// one to retry with when the key was derived).
pub const META_KEY_USED: &str = "io.atmost/idempotency-key";
/// `_meta` key on the result: true when it is the key's earlier outcome.
pub const META_REPLAYED: &str = "io.atmost/replayed";
/// `_meta` key on an answer of the proxy's own (a call awaiting approval):
/// why the call was not sent.
pub const META_REASON: &str = "io.atmost/reason";
/// `_meta` key on the answer to a call awaiting approval: when its request
/// lapses if nobody decides it (RFC 3339, UTC).
pub const META_APPROVAL_EXPIRES_AT: &str = "io.atmost/approval-expires-at";

/// JSON-RPC error codes (implementation-defined server errors,
/// -32000..-32099, clear of the ones MCP and its SDKs use).
pub mod code {
    /// atmost refused the call (cap, budget, scope, revoked, expired,
    /// unknown permit, key reused, in progress, ...). Nothing was sent.
    pub const DENIED: i32 = -32080;
    /// atmost could not be asked (unreachable, store unavailable) or
    /// answered something unusable. Nothing was sent; the same key may be
    /// tried again.
    pub const UNAVAILABLE: i32 = -32081;
    /// The call may or may not have taken effect (now, or replayed). It is
    /// not sent again under this key; an operator resolves it.
    pub const UNCERTAIN: i32 = -32082;
    /// The call was certainly not sent (the upstream could not be reached);
    /// its slot was given back and the key is free.
    pub const NOT_SENT: i32 = -32083;
}

/// The reasons the proxy itself gives in an error's `data.reason` (atmost's
/// own reasons, by name, for everything atmost refused).
pub mod reason {
    pub const PERMIT_MISSING: &str = "PERMIT_MISSING";
    pub const INVALID_IDEMPOTENCY_KEY: &str = "INVALID_IDEMPOTENCY_KEY";
    pub const INVALID_ARGUMENTS: &str = "INVALID_ARGUMENTS";
    pub const UNSUPPORTED_REQUEST: &str = "UNSUPPORTED_REQUEST";
    pub const OUTCOME_UNCERTAIN: &str = "OUTCOME_UNCERTAIN";
    pub const NOT_SENT: &str = "NOT_SENT";
    pub const OUTCOME_NOT_RECORDED: &str = "OUTCOME_NOT_RECORDED";
    pub const ATMOST_UNAVAILABLE: &str = "ATMOST_UNAVAILABLE";
    pub const PROXY_STOPPING: &str = "PROXY_STOPPING";
    pub const AWAITING_APPROVAL: &str = "AWAITING_APPROVAL";
    pub const APPROVAL_DENIED: &str = "APPROVAL_DENIED";
}

/// The longest failure reason atmost stores (docs/api.md, "Limits").
const MAX_REASON_BYTES: usize = 1024;
/// The longest idempotency key atmost takes.
const MAX_KEY_BYTES: usize = 255;
/// The longest approval summary atmost takes.
const MAX_SUMMARY_BYTES: usize = 1024;
/// With `--approval-wait`, the longest part of it one guarded call waits
/// for a decision: between parts the proxy looks whether it is stopping,
/// so a call held for approval (nothing sent) never holds its exit up for
/// longer than this.
const APPROVAL_WAIT_STEP: Duration = Duration::from_secs(5);

/// What every tools/call is checked with: atmost, the permit's source, the
/// cost table, the upstream.
pub struct Gate {
    pub client: Client,
    pub permits: PermitSource,
    pub costs: Costs,
    pub dispatch_timeout: Option<Duration>,
    /// How long a tools/call may be held open waiting for a person's
    /// decision when the permit's approval rule holds it (0: not at all;
    /// the agent is told to call again later).
    pub approval_wait: Duration,
    pub upstream: Arc<Upstream>,
    /// The session id of a transport that has one for the whole process
    /// (stdio: one agent, one session), made at start-up.
    pub process_session: Option<String>,
    /// The guarded calls running, which the proxy lets end before it exits
    /// ([`Gate::settle`]).
    pub calls: TaskTracker,
    /// Over HTTP, the answers to tools/calls not yet written out to their
    /// agents (proxy.rs, [`crate::proxy::Answering`]), which the proxy
    /// waits for before it ends the sessions.
    pub answers: TaskTracker,
    /// Cancelled when the proxy stops waiting for the upstream's answers
    /// ([`Gate::abandon`]).
    pub abandoned: CancellationToken,
    /// The calls awaiting approval under a key the proxy chose, which the
    /// agent's keyless retry of the same call takes again (pending.rs).
    pending: Pending,
    /// Set when the proxy takes no more calls ([`Gate::stop`]). A call is
    /// spawned into [`Gate::calls`] only under this lock, having seen it
    /// unset: once `stop` has returned, every call is either tracked or
    /// refused, so [`Gate::settle`] misses none.
    stopping: Mutex<bool>,
}

/// Where the call came from, as far as the key and the permit care.
#[derive(Debug, Default, Clone)]
pub struct Origin {
    /// The JSON-RPC request id.
    pub request_id: Option<RequestId>,
    /// The HTTP request's headers (Streamable HTTP only).
    pub headers: Option<http::HeaderMap>,
    /// The session rmcp served the request in: its `Mcp-Session-Id`, or the
    /// stdio process's. None when the request came in no session (the
    /// stateless protocol), even if it carries an `Mcp-Session-Id` header:
    /// rmcp did not serve it in that session, so the header is not taken
    /// as one.
    pub session: Option<String>,
}

/// How the key was chosen (logged; an operator reading a key knows where
/// it came from by its shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeySource {
    /// `_meta["io.atmost/idempotency-key"]`.
    Agent,
    /// The session and the JSON-RPC request id.
    Session,
    /// Neither a key nor a session: a key of its own, so the call is a new
    /// intent (counted against the cap) and can never replay another's.
    Fresh,
    /// No key of the agent's, and the same call (permit, tool, arguments,
    /// session or none) awaits approval: its key, which the proxy chose
    /// (derived or fresh) when it was first asked.
    Pending,
}

/// The upstream's answer to a call dispatched now, kept whole for the
/// agent (what atmost stores of it may be shortened).
enum Fresh {
    Result(CallToolResult),
    Error(ErrorData),
}

impl Gate {
    pub fn new(
        client: Client,
        permits: PermitSource,
        costs: Costs,
        dispatch_timeout: Option<Duration>,
        approval_wait: Duration,
        upstream: Arc<Upstream>,
        process_session: Option<String>,
    ) -> Self {
        Self {
            client,
            permits,
            costs,
            dispatch_timeout,
            approval_wait,
            upstream,
            process_session,
            calls: TaskTracker::new(),
            answers: TaskTracker::new(),
            abandoned: CancellationToken::new(),
            pending: Pending::default(),
            stopping: Mutex::new(false),
        }
    }

    /// Takes no more calls: each tools/call from now on is refused before
    /// atmost is asked (`-32083` `PROXY_STOPPING`). The calls already
    /// running go on.
    pub fn stop(&self) {
        *self.stopping.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }

    fn stopping(&self) -> bool {
        *self.stopping.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until every guarded call has ended: its outcome recorded
    /// (Commit, MarkUncertain) or, if atmost could not take it, given up
    /// after the client's retries. Each call waits for the upstream at most
    /// until its dispatch deadline, so this ends too. Calls that come in
    /// meanwhile are refused ([`Gate::stop`]).
    pub async fn settle(&self) {
        self.stop();
        self.calls.close();
        let running = self.calls.len();
        if running > 0 {
            tracing::info!(
                calls = running,
                "waiting for the calls in flight to end and be recorded"
            );
        }
        self.calls.wait().await;
    }

    /// Stops waiting for the upstream: each call whose request went out is
    /// marked uncertain now (MarkUncertain), and a call authorized from now
    /// on is not sent (Commit NotSent).
    pub fn abandon(&self) {
        if !self.abandoned.is_cancelled() {
            tracing::warn!(
                calls = self.calls.len(),
                "no longer waiting for the upstream: the calls in flight are marked uncertain"
            );
        }
        self.abandoned.cancel();
    }

    /// Authorizes `request` with atmost, forwards it on DISPATCH, records
    /// the outcome, and answers the agent. The guarded call runs in a task
    /// of its own: an agent that goes away mid-call does not stop the
    /// outcome from being recorded, and the proxy waits for it before it
    /// exits ([`Gate::settle`]).
    pub async fn call_tool(
        self: &Arc<Self>,
        request: CallToolRequestParams,
        meta: RequestMetaObject,
        origin: Origin,
    ) -> Result<CallToolResponse, ErrorData> {
        if request.input_responses.is_some() || request.request_state.is_some() {
            return Err(invalid(
                reason::UNSUPPORTED_REQUEST,
                "atmost-mcp does not forward input_required rounds (inputResponses, requestState)",
                json!({}),
            ));
        }
        let tool = request.name.to_string();
        let permit = self.permit(&origin)?;
        let (key, source) = self.key(&meta, &origin)?;
        // The fingerprint before anything is asked: arguments it cannot
        // hold exactly (a number past ±(2^53 - 1), which two different
        // requests would share) are the agent's to fix.
        let arguments = request.arguments.clone().unwrap_or_default();
        let canonical = json!({"name": tool, "arguments": Value::Object(arguments)});
        let fingerprint = {
            let ctx = Answer {
                permit: &permit,
                tool: &tool,
                key: &key,
            };
            if self.stopping() {
                return Err(ctx.stopping());
            }
            atmost_client::fingerprint(&canonical).map_err(|e| {
                ctx.error(
                    ErrorCode::INVALID_PARAMS.0,
                    reason::INVALID_ARGUMENTS,
                    format!("{e}: nothing was authorized or sent"),
                    json!({"path": e.path}),
                )
            })?
        };
        // Without a key of the agent's, the same call as one awaiting
        // approval is its retry: it takes that call's key (pending.rs).
        let same_call = (source != KeySource::Agent)
            .then(|| pending::Call::new(origin.session.clone(), &permit, &fingerprint));
        let (key, source) = match same_call
            .as_ref()
            .and_then(|call| self.pending.key(call, now_ms()))
        {
            Some(key) => (key, KeySource::Pending),
            None => (key, source),
        };
        let ctx = Answer {
            permit: &permit,
            tool: &tool,
            key: &key,
        };
        // The upstream first: one that cannot be reached costs no attempt.
        let session = self.upstream.connected().await.map_err(|why| {
            tracing::warn!(%permit, %tool, %key, %why, "the upstream cannot be reached; not authorized");
            let mut data = json!({
                "reason": reason::NOT_SENT,
                "tool": tool,
                "permit_id": permit,
                "idempotency_key": key,
            });
            data["upstream_error"] = why.clone().into();
            ErrorData::new(
                ErrorCode(code::NOT_SENT),
                "the upstream could not be reached: nothing was authorized or sent, and the key is free",
                Some(data),
            )
        })?;

        let asked = Asked {
            permit: permit.clone(),
            tool: tool.clone(),
            key: key.clone(),
            fingerprint: fingerprint.to_vec(),
            cost: self.costs.of(&tool),
            summary: approval_summary(&tool, &canonical["arguments"]),
        };
        let fresh: Arc<Mutex<Option<Fresh>>> = Arc::default();
        let forward = Forward {
            upstream: Arc::clone(&self.upstream),
            session,
            request,
            forwarded: forwarded_meta(meta),
            slot: Arc::clone(&fresh),
            abandoned: self.abandoned.clone(),
        };
        let gate = Arc::clone(self);
        let guarded = async move { gate.guarded(asked, forward).await };
        let task = {
            let stopping = self.stopping.lock().unwrap_or_else(PoisonError::into_inner);
            if *stopping {
                // Stopped while the upstream was being reached.
                return Err(ctx.stopping());
            }
            self.calls.spawn(guarded)
        };
        let outcome = match task.await {
            Ok(outcome) => outcome,
            Err(e) => {
                // A panic in the guarded call: nothing more is known.
                tracing::error!(%permit, %tool, %key, error = %e, "the guarded call stopped");
                return Err(ErrorData::internal_error(
                    format!("the guarded call stopped: {e}"),
                    None,
                ));
            }
        };
        let fresh = fresh.lock().map(|mut f| f.take()).unwrap_or(None);
        log(&ctx, source, &outcome);
        if let Some(call) = same_call {
            match &outcome {
                Err(GuardError::AwaitingApproval { expires_at_ms, .. }) => {
                    self.pending.awaiting(call, &key, *expires_at_ms, now_ms());
                }
                // atmost could not be asked, or the call is being sent
                // under the key right now: the retry still needs the key.
                Err(
                    GuardError::Unavailable(_) | GuardError::Rpc(_) | GuardError::InProgress(_),
                ) => {}
                _ => self.pending.settled(&call, &key),
            }
        }
        ctx.answer(outcome, fresh)
    }

    /// The guarded call, which waits for a person's decision, when the
    /// permit's approval rule holds it, for up to `--approval-wait` in
    /// steps of [`APPROVAL_WAIT_STEP`]: a proxy told to stop meanwhile
    /// stops waiting (nothing was sent; the agent is told to call again).
    async fn guarded(&self, asked: Asked, mut forward: Forward) -> Result<Outcome, GuardError> {
        let until = Instant::now() + self.approval_wait;
        let mut waited = false;
        loop {
            let wait = until
                .saturating_duration_since(Instant::now())
                .min(APPROVAL_WAIT_STEP);
            let mut call = GuardedCall::new(&asked.permit, &asked.tool, &asked.key)
                .fingerprint(asked.fingerprint.clone())
                .cost(asked.cost)
                .approval_summary(asked.summary.clone())
                .approval_wait(wait);
            if let Some(timeout) = self.dispatch_timeout {
                call = call.dispatch_timeout(timeout);
            }
            let this = forward.clone();
            let mut outcome = self
                .client
                .guarded(call, move |attempt_id| this.send(attempt_id))
                .await;
            // A denial that came while this call waited (between two
            // steps) is news to it, not a replay.
            if let Err(GuardError::ApprovalDenied { replayed, .. }) = &mut outcome
                && waited
            {
                *replayed = false;
            }
            if !matches!(outcome, Err(GuardError::AwaitingApproval { .. }))
                || Instant::now() >= until
                || self.stopping()
                || self.abandoned.is_cancelled()
            {
                return outcome;
            }
            waited = true;
            // Still waiting: a connection to the upstream that closed
            // meanwhile is opened again for the dispatch (if it cannot
            // be, the dispatch finds out).
            if !forward.session.usable()
                && let Ok(session) = self.upstream.connected().await
            {
                forward.session = session;
            }
        }
    }

    /// --permit, or the request's --permit-header (never both: the
    /// configuration refuses that), which must come exactly once.
    fn permit(&self, origin: &Origin) -> Result<String, ErrorData> {
        let name = match &self.permits {
            PermitSource::Fixed(permit) => return Ok(permit.clone()),
            PermitSource::Header(name) => name,
        };
        let mut values = origin.headers.iter().flat_map(|h| h.get_all(name));
        let value = values.next();
        if value.is_some() && values.next().is_some() {
            // A gateway that appends rather than sets the header: which one
            // it set is not known, and the agent's own must never win.
            return Err(invalid(
                reason::PERMIT_MISSING,
                &format!(
                    "the {name} header came more than once: the gateway must set it, replacing any the agent sent"
                ),
                json!({}),
            ));
        }
        match value {
            Some(value) => match value.to_str().map(str::trim) {
                Ok(permit) if !permit.is_empty() => Ok(permit.to_owned()),
                _ => Err(invalid(
                    reason::PERMIT_MISSING,
                    &format!("the {name} header is empty or not visible ASCII"),
                    json!({}),
                )),
            },
            None => Err(invalid(
                reason::PERMIT_MISSING,
                &format!("no permit: send the {name} header"),
                json!({}),
            )),
        }
    }

    /// The agent's key from `_meta`, else one derived from the session and
    /// the JSON-RPC request id, else a fresh one.
    fn key(
        &self,
        meta: &RequestMetaObject,
        origin: &Origin,
    ) -> Result<(String, KeySource), ErrorData> {
        match meta.get(META_IDEMPOTENCY_KEY) {
            Some(Value::String(key)) => return Ok((key.clone(), KeySource::Agent)),
            Some(other) => {
                return Err(invalid(
                    reason::INVALID_IDEMPOTENCY_KEY,
                    &format!("_meta[\"{META_IDEMPOTENCY_KEY}\"] must be a string, not {other}"),
                    json!({}),
                ));
            }
            None => {}
        }
        // Only a session rmcp served the request in, never the header
        // alone: a stateless request is in no session, so an
        // Mcp-Session-Id it carries (a stale one, say) must not make its
        // key collide with that session's calls. This guards against
        // accidents only. A client that knows a live session's id can send
        // a legacy request in that session (rmcp checks only that the
        // session is live), or put a derived key in _meta itself: the
        // session id is a bearer secret, and the agents of one proxy share
        // its tenant and permit anyway (docs/gateways.md, "Which key to
        // use").
        Ok(match (&origin.session, &origin.request_id) {
            (Some(session), Some(id)) => (derived_key(session, id), KeySource::Session),
            _ => (
                format!("mcp:fresh:{}", uuid::Uuid::new_v4()),
                KeySource::Fresh,
            ),
        })
    }
}

/// What atmost is asked for one tools/call.
struct Asked {
    permit: String,
    tool: String,
    key: String,
    fingerprint: Vec<u8>,
    cost: i64,
    summary: String,
}

/// The call to forward on DISPATCH, and where its answer goes.
#[derive(Clone)]
struct Forward {
    upstream: Arc<Upstream>,
    session: Session,
    request: CallToolRequestParams,
    /// The agent's `_meta` to forward ([`forwarded_meta`]).
    forwarded: Map<String, Value>,
    slot: Arc<Mutex<Option<Fresh>>>,
    abandoned: CancellationToken,
}

impl Forward {
    /// The guarded call's dispatch: the request, with the attempt id in
    /// its `_meta`, sent once.
    async fn send(self, attempt_id: AttemptId) -> Result<Dispatched, DispatchError> {
        if self.abandoned.is_cancelled() {
            // The proxy is stopping: not sent now.
            return Err(DispatchError::NotSent);
        }
        let mut meta = self.forwarded;
        meta.insert(META_ATTEMPT_ID.into(), attempt_id.as_str().into());
        let mut request = self.request;
        request.meta = Some(RequestMetaObject(MetaObject(meta)));
        tokio::select! {
            biased;
            answer = dispatch(&self.upstream, self.session, request, &self.slot) => answer,
            () = self.abandoned.cancelled() => Err(DispatchError::unknown(
                "atmost-mcp stopped before the upstream answered",
            )),
        }
    }
}

/// What the approvers are shown of a call (AuthorizeRequest's
/// approval_summary, stored when the call is first asked for): the tool's
/// name and its arguments as JSON, cut to fit atmost's 1024 bytes. It is
/// the proxy's description; the fingerprint is what the approval binds.
fn approval_summary(tool: &str, arguments: &Value) -> String {
    let whole = format!("{tool} {arguments}");
    if whole.len() <= MAX_SUMMARY_BYTES {
        return whole;
    }
    let mut end = MAX_SUMMARY_BYTES - '…'.len_utf8();
    while !whole.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &whole[..end])
}

/// Now, in ms since the Unix epoch.
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// `ms` since the Unix epoch as RFC 3339 (UTC, whole seconds); None for
/// 0, which atmost gives when it does not know.
fn rfc3339(ms: i64) -> Option<String> {
    let ms = u64::try_from(ms).ok().filter(|ms| *ms > 0)?;
    let at = UNIX_EPOCH.checked_add(Duration::from_millis(ms))?;
    Some(humantime::format_rfc3339_seconds(at).to_string())
}

/// `mcp:<session>:<request id as JSON>`, or `mcp:sha256:<hex>` of the same
/// when that is not a key atmost takes (too long, not printable ASCII).
pub fn derived_key(session: &str, id: &RequestId) -> String {
    let id = serde_json::to_string(id).unwrap_or_default();
    let key = format!("mcp:{session}:{id}");
    if key.len() <= MAX_KEY_BYTES && key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("mcp:sha256:{hex}")
}

/// The agent's `_meta` to forward, without the protocol's own keys (the
/// proxy's connection to the upstream sets its own).
fn forwarded_meta(meta: RequestMetaObject) -> Map<String, Value> {
    let RequestMetaObject(MetaObject(mut map)) = meta;
    map.retain(|k, _| !k.starts_with("io.modelcontextprotocol/") && k != "progressToken");
    map
}

/// The guarded call's dispatch: the request sent once; its answer kept in
/// `slot` for the agent and told to the guarded call.
async fn dispatch(
    upstream: &Upstream,
    session: Session,
    request: CallToolRequestParams,
    slot: &Mutex<Option<Fresh>>,
) -> Result<Dispatched, DispatchError> {
    let keep = |fresh: Fresh| {
        if let Ok(mut s) = slot.lock() {
            *s = Some(fresh);
        }
    };
    match upstream.call_tool(session, request).await {
        Ok(CallToolResponse::Complete(result)) => {
            let stored = serde_json::to_vec(&result).map_err(DispatchError::unknown)?;
            let failed = result.is_error == Some(true);
            let reason = failed.then(|| failure_record(&Fresh::Result(result.clone())));
            keep(Fresh::Result(result));
            match reason {
                Some(reason) => Err(DispatchError::Failed(reason)),
                None => Ok(Dispatched::bytes(stored)),
            }
        }
        Ok(CallToolResponse::InputRequired(_)) => Err(DispatchError::unknown(
            "the upstream answered input_required, which atmost-mcp does not forward",
        )),
        Ok(CallToolResponse::Task(_)) => Err(DispatchError::unknown(
            "the upstream answered with a task, which atmost-mcp does not follow",
        )),
        Ok(_) => Err(DispatchError::unknown(
            "the upstream answered a kind of result atmost-mcp does not know",
        )),
        Err(CallError::Answered(error)) => {
            let reason = failure_record(&Fresh::Error(error.clone()));
            keep(Fresh::Error(error));
            Err(DispatchError::Failed(reason))
        }
        Err(CallError::NotSent(why)) => {
            tracing::warn!(%why, "not sent to the upstream");
            Err(DispatchError::NotSent)
        }
        Err(e @ CallError::Unknown(_)) => Err(DispatchError::unknown(e.to_string())),
    }
}

// === what atmost stores of a refusal ===

/// A failure as atmost stores it (at most 1024 bytes): the isError
/// result's JSON, or `{"error": {...}}` for a JSON-RPC error; shortened to
/// fit, still valid JSON, so a replay gives the agent the same kind of
/// answer.
fn failure_record(fresh: &Fresh) -> String {
    match fresh {
        Fresh::Result(result) => {
            let whole = serde_json::to_string(result).unwrap_or_default();
            if whole.len() <= MAX_REASON_BYTES {
                return whole;
            }
            let text: String = result
                .content
                .iter()
                .filter_map(|c| c.as_text().map(|t| t.text.as_str()))
                .collect::<Vec<_>>()
                .join("\n");
            fit(&text, |t| {
                serde_json::to_string(&CallToolResult::error(vec![ContentBlock::text(t)]))
                    .unwrap_or_default()
            })
        }
        Fresh::Error(error) => {
            let whole = json!({"error": error}).to_string();
            if whole.len() <= MAX_REASON_BYTES {
                return whole;
            }
            fit(&error.message, |m| {
                json!({"error": {"code": error.code.0, "message": m}}).to_string()
            })
        }
    }
}

/// `render(text cut short)` at most [`MAX_REASON_BYTES`] long.
fn fit(text: &str, render: impl Fn(&str) -> String) -> String {
    let mut keep = text.len();
    loop {
        let mut end = keep.min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cut = if end < text.len() {
            format!("{}…", &text[..end])
        } else {
            text.to_owned()
        };
        let rendered = render(&cut);
        if rendered.len() <= MAX_REASON_BYTES || end == 0 {
            return rendered;
        }
        keep = end.saturating_sub(rendered.len() - MAX_REASON_BYTES + 8);
    }
}

// === the answer to the agent ===

/// The call's names, for errors and logs.
struct Answer<'a> {
    permit: &'a str,
    tool: &'a str,
    key: &'a str,
}

impl Answer<'_> {
    fn answer(
        &self,
        outcome: Result<Outcome, GuardError>,
        fresh: Option<Fresh>,
    ) -> Result<CallToolResponse, ErrorData> {
        match outcome {
            Ok(outcome) => {
                let attempt_id = outcome.attempt.attempt_id.clone();
                let result = match (outcome.replayed, fresh) {
                    (false, Some(Fresh::Result(result))) => result,
                    _ => stored_success(&outcome.result),
                };
                Ok(self.result(result, &attempt_id, outcome.replayed))
            }
            Err(GuardError::ToolFailed {
                attempt_id,
                reason,
                replayed,
            }) => {
                let fresh = if replayed { None } else { fresh };
                match fresh.unwrap_or_else(|| stored_failure(&reason)) {
                    Fresh::Result(result) => Ok(self.result(result, attempt_id.as_str(), replayed)),
                    Fresh::Error(error) => Err(error),
                }
            }
            Err(GuardError::CommitNotRecorded {
                attempt_id,
                outcome,
                source,
            }) => {
                // The tool answered but atmost could not record it: the
                // agent still gets the answer; the attempt reads UNCERTAIN
                // at its lease, for an operator to resolve.
                match (outcome, fresh) {
                    (Unrecorded::Succeeded { .. } | Unrecorded::Failed { .. }, Some(fresh)) => {
                        match fresh {
                            Fresh::Result(result) => {
                                Ok(self.result(result, attempt_id.as_str(), false))
                            }
                            Fresh::Error(error) => Err(error),
                        }
                    }
                    (outcome, _) => Err(self.error(
                        code::UNCERTAIN,
                        reason::OUTCOME_NOT_RECORDED,
                        format!(
                            "atmost could not record the call's outcome ({}): it reads UNCERTAIN at its lease, for an operator to resolve",
                            source.reason_or_code()
                        ),
                        json!({"attempt_id": attempt_id.as_str(), "outcome": unrecorded_name(&outcome)}),
                    )),
                }
            }
            Err(GuardError::OutcomeUncertain {
                attempt_id,
                reason,
                replayed,
                ..
            }) => Err(self.error(
                code::UNCERTAIN,
                reason::OUTCOME_UNCERTAIN,
                format!(
                    "the call's outcome is unknown{}: it is not sent again under this key; an operator resolves it ({reason})",
                    if replayed { " (replayed)" } else { "" }
                ),
                json!({"attempt_id": attempt_id.as_str(), "replayed": replayed, "uncertain_reason": reason}),
            )),
            Err(GuardError::NotSent { attempt_id } | GuardError::NoTimeToDispatch { attempt_id }) => {
                Err(self.error(
                    code::NOT_SENT,
                    reason::NOT_SENT,
                    "the call was not sent to the upstream (it could not be reached); its slot was given back and the key is free".into(),
                    json!({"attempt_id": attempt_id.as_str()}),
                ))
            }
            Err(GuardError::AwaitingApproval {
                attempt_id,
                expires_at_ms,
            }) => Ok(self.awaiting_approval(attempt_id.as_str(), expires_at_ms)),
            Err(GuardError::ApprovalDenied {
                attempt_id,
                reason,
                decided_by,
                replayed,
            }) => Err(self.error(
                code::DENIED,
                reason::APPROVAL_DENIED,
                format!("the call was denied approval ({reason}): it was never sent; do not retry it"),
                json!({"attempt_id": attempt_id.as_str(), "denial_reason": reason, "decided_by": decided_by, "replayed": replayed}),
            )),
            Err(GuardError::Denied(e) | GuardError::InProgress(e)) => Err(self.refusal(code::DENIED, &e)),
            Err(GuardError::InvalidRequest(e)) => {
                let mut error = self.refusal(ErrorCode::INVALID_PARAMS.0, &e);
                if let Some(Value::Object(data)) = &mut error.data {
                    data.insert("fields".into(), json!(e.violated_fields()));
                }
                Err(error)
            }
            Err(GuardError::Unavailable(e) | GuardError::Rpc(e)) => {
                let mut error = self.refusal(code::UNAVAILABLE, &e);
                if let Some(Value::Object(data)) = &mut error.data
                    && e.reason().is_none()
                {
                    data.insert("reason".into(), reason::ATMOST_UNAVAILABLE.into());
                }
                Err(error)
            }
            // The proxy gives no holder token (each call's is the guarded
            // call's own random one), so no earlier run can hold its call;
            // and it fingerprints the request itself before asking
            // (call_tool), so an invalid call is a setting of its own.
            Err(
                e @ (GuardError::NoRandomness(_)
                | GuardError::HeldByEarlierRun { .. }
                | GuardError::InvalidCall(_)),
            ) => {
                Err(ErrorData::internal_error(e.to_string(), None))
            }
        }
    }

    /// The tool's result, marked with the attempt and whether it is a replay.
    fn result(
        &self,
        mut result: CallToolResult,
        attempt_id: &str,
        replayed: bool,
    ) -> CallToolResponse {
        // A legacy upstream sends no resultType; an agent on 2026-07-28
        // requires it (rmcp drops it again for an agent on an older
        // version).
        result.result_type.get_or_insert(ResultType::COMPLETE);
        let meta = result.meta.get_or_insert_with(MetaObject::default);
        meta.0.insert(META_ATTEMPT_ID.into(), attempt_id.into());
        meta.0.insert(META_KEY_USED.into(), self.key.into());
        meta.0.insert(META_REPLAYED.into(), replayed.into());
        CallToolResponse::Complete(result)
    }

    /// The answer to a call the permit's approval rule holds: nothing was
    /// sent. A tool error (an isError result), not a JSON-RPC error: MCP
    /// clients give a tool's errors to the model, which is to act on this
    /// one (make the same call again later), and may keep protocol errors
    /// from it. The text says what to do; `structuredContent` and `_meta`
    /// say the same for programs.
    fn awaiting_approval(&self, attempt_id: &str, expires_at_ms: i64) -> CallToolResponse {
        let expires_at = rfc3339(expires_at_ms);
        let lapse = match &expires_at {
            Some(at) => format!(
                "If nobody approves it by {at}, the request lapses and the call is never sent."
            ),
            None => "If nobody approves it in time, the request lapses and the call is never sent."
                .to_owned(),
        };
        let message = format!(
            "Not sent: this call of \"{tool}\" is waiting for a person's approval. Do not change it: \
             make the same call again later (not at once: a person decides first), with exactly \
             the same arguments (idempotency key \"{key}\"). Once a person approves it, that call \
             is sent, once, and returns the tool's result. {lapse}",
            tool = self.tool,
            key = self.key,
        );
        let mut structured = json!({
            "reason": reason::AWAITING_APPROVAL,
            "message": message,
            "tool": self.tool,
            "permit_id": self.permit,
            "idempotency_key": self.key,
            "attempt_id": attempt_id,
        });
        let mut meta = MetaObject::default();
        meta.0
            .insert(META_REASON.into(), reason::AWAITING_APPROVAL.into());
        if let Some(at) = expires_at {
            structured["approval_expires_at"] = at.clone().into();
            structured["approval_expires_at_ms"] = expires_at_ms.into();
            meta.0.insert(META_APPROVAL_EXPIRES_AT.into(), at.into());
        }
        let mut result = CallToolResult::error(vec![ContentBlock::text(message)]);
        result.structured_content = Some(structured);
        result.meta = Some(meta);
        self.result(result, attempt_id, false)
    }

    /// atmost's refusal: its reason, the tool, and the ErrorInfo numbers.
    fn refusal(&self, code: i32, e: &atmost_client::Error) -> ErrorData {
        let reason = e.reason_or_code();
        let mut data = json!({"metadata": e.metadata()});
        if let Some(limit) = e.limit() {
            data["limit"] = limit.into();
        }
        if let Some(calls_made) = e.calls_made() {
            data["calls_made"] = calls_made.into();
        }
        if let Some(retry_after) = e.retry_after() {
            data["retry_after_ms"] = (retry_after.as_millis() as u64).into();
        }
        let mut error = self.error(
            code,
            &reason,
            format!(
                "atmost refused the call: {reason}: {}",
                e.status().message()
            ),
            data,
        );
        if let (Some(tool), Some(Value::Object(data))) = (e.tool(), &mut error.data) {
            data.insert("tool".into(), tool.into());
        }
        error
    }

    /// The refusal of a call that came in once the proxy was stopping.
    fn stopping(&self) -> ErrorData {
        self.error(
            code::NOT_SENT,
            reason::PROXY_STOPPING,
            "atmost-mcp is stopping: atmost was not asked and nothing was sent; the key's state is unchanged"
                .into(),
            json!({}),
        )
    }

    /// A JSON-RPC error whose `data` names the reason, the tool, the permit
    /// and the key, with `extra` besides.
    fn error(&self, code: i32, reason: &str, message: String, extra: Value) -> ErrorData {
        let mut data = json!({
            "reason": reason,
            "tool": self.tool,
            "permit_id": self.permit,
            "idempotency_key": self.key,
        });
        if let (Value::Object(data), Value::Object(extra)) = (&mut data, extra) {
            data.extend(extra);
        }
        ErrorData::new(ErrorCode(code), message, Some(data))
    }
}

/// A bad request from the agent: INVALID_PARAMS with the reason in `data`.
fn invalid(reason: &str, message: &str, extra: Value) -> ErrorData {
    let mut data = json!({"reason": reason});
    if let (Value::Object(data), Value::Object(extra)) = (&mut data, extra) {
        data.extend(extra);
    }
    ErrorData::invalid_params(message.to_owned(), Some(data))
}

/// A SUCCEEDED receipt's result as a tool result: the CallToolResult the
/// proxy stored, else the bytes as text (a result an operator gave with
/// Resolve, or the digest atmost keeps of one over 64 KiB).
fn stored_success(stored: &[u8]) -> CallToolResult {
    if let Ok(result) = serde_json::from_slice::<CallToolResult>(stored) {
        return result;
    }
    let text = String::from_utf8_lossy(stored);
    let text = if text.starts_with("sha256:") && stored.len() == 71 {
        format!(
            "The call succeeded earlier; its result was over 64 KiB, so atmost kept only its digest ({text})."
        )
    } else {
        text.into_owned()
    };
    CallToolResult::success(vec![ContentBlock::text(text)])
}

/// A FAILED attempt's stored reason as the agent's answer: the isError
/// result or the JSON-RPC error the proxy stored, else the reason as an
/// isError result's text (a reason an operator gave with Resolve).
fn stored_failure(reason: &str) -> Fresh {
    if let Ok(Value::Object(object)) = serde_json::from_str::<Value>(reason) {
        if let Some(error) = object.get("error")
            && let Ok(error) = serde_json::from_value::<ErrorData>(error.clone())
        {
            return Fresh::Error(error);
        }
        if let Ok(result) = serde_json::from_value::<CallToolResult>(Value::Object(object)) {
            return Fresh::Result(result);
        }
    }
    Fresh::Result(CallToolResult::error(vec![ContentBlock::text(reason)]))
}

fn unrecorded_name(outcome: &Unrecorded) -> &'static str {
    match outcome {
        Unrecorded::Succeeded { .. } => "SUCCEEDED",
        Unrecorded::Failed { .. } => "FAILED",
        Unrecorded::NotSent => "NOT_SENT",
        Unrecorded::Uncertain { .. } => "UNCERTAIN",
    }
}

/// One line per call: what was asked and how it ended.
fn log(ctx: &Answer<'_>, source: KeySource, outcome: &Result<Outcome, GuardError>) {
    let (permit, tool, key) = (ctx.permit, ctx.tool, ctx.key);
    match outcome {
        Ok(o) => tracing::info!(
            permit, tool, key, key_source = ?source, attempt_id = %o.attempt.attempt_id,
            replayed = o.replayed, "tools/call succeeded"
        ),
        Err(GuardError::AwaitingApproval {
            attempt_id,
            expires_at_ms,
        }) => tracing::info!(
            permit, tool, key, key_source = ?source, %attempt_id, expires_at_ms,
            "tools/call awaits approval: not sent"
        ),
        Err(e @ GuardError::CommitNotRecorded { .. }) => tracing::error!(
            permit, tool, key, key_source = ?source, error = %e, "tools/call outcome not recorded"
        ),
        Err(e) => tracing::info!(
            permit, tool, key, key_source = ?source, error = %e, "tools/call did not succeed"
        ),
    }
}

mod pending;

#[cfg(test)]
mod tests;
