//! The Envoy front doors: `envoy.service.auth.v3.Authorization/Check`
//! ([`ext_authz`]) and `envoy.service.ext_proc.v3.ExternalProcessor/Process`
//! ([`ext_proc`]), served on atmost's gRPC port behind the same
//! authentication and admission layers as the Gate.
//!
//! They are translators, nothing more. A request, as Envoy describes it,
//! becomes an `AuthorizeRequest` through the [`Mapping`]; that request goes
//! through [`GateService::do_authorize`](super::gate::GateService), the
//! very path `atmost.v1.Gate/Authorize` takes (validation, the caller's
//! tenant and agent scope, its deadline, admission, the store, the audit
//! trail); and the answer, or the domain's [`Error`], becomes an HTTP
//! answer here ([`Answer`]), in one table ([`http_status`]). ext_proc's
//! Commit and MarkUncertain go through the Gate's methods the same way.
//!
//! The messages are the `envoy-types` crate's, generated from Envoy's own
//! protos; `proto/vendor/` holds those protos for server reflection only.

pub mod ext_authz;
pub mod ext_proc;
pub mod mapping;
#[cfg(test)]
mod tests;

use crate::domain::{Error, Reason, Violation};
use crate::pb;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
pub use mapping::Mapping;
use sha2::{Digest, Sha256};

/// The Envoy services' descriptor set, for server reflection (built from
/// `proto/vendor/` by build.rs).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/envoy_descriptor.bin"));

/// The gRPC service names, for reflection, health and the auth table.
pub const EXT_AUTHZ_SERVICE: &str = "envoy.service.auth.v3.Authorization";
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Added to a forwarded request: the attempt's id, for the tool to use as
/// its own idempotency key (and to settle the attempt with). A replay's
/// answer carries it only for a settled attempt ([`Reply`]'s replay).
pub const ATTEMPT_HEADER: &str = "x-atmost-attempt-id";
/// Added upstream on DISPATCH beside the attempt id: the permit id and the
/// idempotency key as atmost used them (the permit may come from a JWT
/// claim, the key from a structured-field string), for the upstream's
/// Commit.
pub const PERMIT_ID_HEADER: &str = "x-atmost-permit-id";
pub const KEY_HEADER: &str = "x-atmost-idempotency-key";

/// The headers both doors set on a forwarded request, each replacing any
/// the client sent (so no client can forge one): the tool's idempotency
/// key and what its Commit presents. Upstream only: the attempt is open
/// while the tool runs. A key is printable ASCII without edge spaces and
/// a permit id a UUID: both are valid header values.
pub(crate) fn upstream_headers(attempt: &pb::Attempt) -> [(&'static str, &str); 3] {
    [
        (ATTEMPT_HEADER, attempt.attempt_id.as_str()),
        (PERMIT_ID_HEADER, attempt.permit_id.as_str()),
        (KEY_HEADER, attempt.idempotency_key.as_str()),
    ]
}

/// On every answer atmost gives instead of the tool: why.
pub const REASON_HEADER: &str = "x-atmost-reason";
/// On a replayed result (the IETF idempotency-key draft's header).
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The front doors' own reasons, beside the contract's `ErrorReason`s.
pub mod reasons {
    /// The key's call succeeded before: its stored result is the answer.
    pub const REPLAY_SUCCEEDED: &str = "REPLAY_SUCCEEDED";
    /// The key's call failed before (the tool refused it).
    pub const REPLAY_FAILED: &str = "REPLAY_FAILED";
    /// The key's call was sent and its outcome is unknown.
    pub const REPLAY_UNCERTAIN: &str = "REPLAY_UNCERTAIN";
    /// The key's call waits for a person's approval: 202, retry the same
    /// request (same Idempotency-Key) after Retry-After.
    pub const AWAITING_APPROVAL: &str = "AWAITING_APPROVAL";
    /// The key's call was denied (or its approval lapsed): never sent.
    pub const REPLAY_DENIED: &str = "REPLAY_DENIED";
    /// Envoy's configuration does not give what the mapping needs (the
    /// body, say): the gateway operator's to fix, not the client's.
    pub const GATEWAY_MISCONFIGURED: &str = "GATEWAY_MISCONFIGURED";
    /// The route table would name the tool, and the path is not in its one
    /// plain form ([`super::mapping::plain_path`]), or its case or a format
    /// suffix aside it matches an earlier route naming another tool
    /// ([`super::mapping::route_of`]): an upstream could read it as another
    /// route than the one it matches.
    pub const PATH_NOT_CANONICAL: &str = "PATH_NOT_CANONICAL";
}

// === the request ===

/// A request's headers as Envoy sends them: names in lower case, values
/// as bytes.
#[derive(Debug, Default)]
pub(crate) struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    pub(crate) fn new(pairs: impl IntoIterator<Item = (String, Vec<u8>)>) -> Self {
        Self(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
        )
    }

    /// The one value of `name`; `Err` when the header is given more than
    /// once (which of two idempotency keys is meant?).
    fn one(&self, name: &str) -> Result<Option<&[u8]>, ()> {
        let mut found = self.0.iter().filter(|(k, _)| k == name);
        match (found.next(), found.next()) {
            (Some((_, v)), None) => Ok(Some(v)),
            (None, _) => Ok(None),
            (Some(_), Some(_)) => Err(()),
        }
    }

    /// Any value of `name` (for Envoy's own headers).
    pub(crate) fn get(&self, name: &str) -> Option<&[u8]> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| &v[..])
    }
}

/// Reads a request's headers for the mapping, noting each problem.
struct Reader<'h> {
    headers: &'h Headers,
    violations: Vec<Violation>,
}

impl<'h> Reader<'h> {
    /// The header's one value, if given; a header given twice is a
    /// violation.
    fn optional(&mut self, name: &str) -> Option<&'h [u8]> {
        match self.headers.one(name) {
            Ok(value) => value,
            Err(()) => {
                self.violations.push(violation(
                    format!("header {name}"),
                    "given more than once: send one value",
                ));
                None
            }
        }
    }

    /// [`Reader::optional`], and its absence a violation too (`why` it is
    /// needed).
    fn required(&mut self, name: &str, why: &str) -> Option<&'h [u8]> {
        if self.headers.one(name) == Ok(None) {
            self.violations.push(violation(
                format!("header {name}"),
                format!("missing: {why}"),
            ));
            return None;
        }
        self.optional(name)
    }
}

/// One HTTP request, as either front door describes it to the mapping.
pub(crate) struct HttpRequest<'a> {
    pub method: &'a str,
    /// The path with its query string.
    pub path: &'a str,
    pub headers: &'a Headers,
    /// The whole body (empty when there is none).
    pub body: &'a [u8],
    /// The tool the route names: ext_authz's context extension, or
    /// ext_proc's gRPC initial metadata.
    pub route_tool: Option<&'a str>,
    /// The request's dynamic metadata (jwt_authn's payload lives there).
    pub metadata: Option<&'a Metadata>,
}

/// Why a request could not be mapped to an Authorize. Nothing was asked
/// of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unmapped {
    /// The request lacks or garbles what the mapping reads: 400, the
    /// client's to fix.
    Invalid(Vec<Violation>),
    /// Envoy does not send what the mapping needs: 500, the gateway
    /// operator's to fix.
    Misconfigured(String),
    /// The route table would name the tool and the path is not plain, or
    /// could be read as an earlier route naming another tool (why): 400,
    /// before anything was reserved.
    PathNotCanonical(String),
}

fn violation(field: impl Into<String>, description: impl Into<String>) -> Violation {
    Violation {
        field: field.into(),
        description: description.into(),
    }
}

/// A header's value as text; the Gate's own validation judges it.
fn text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).into_owned()
}

/// An `Idempotency-Key` value ([`crate::idempotency::header_key`]), which
/// the doors forward to the tool in a header: that cannot carry edge
/// spaces (HTTP/1.1 trims them, HTTP/2 refuses them), so its Commit would
/// name another key.
fn idempotency_key(value: &[u8]) -> Result<String, &'static str> {
    let key = crate::idempotency::header_key(value)?;
    if key.trim() != key {
        return Err("a key with leading or trailing spaces cannot be forwarded in a header");
    }
    Ok(key)
}

/// SHA-256 of the method, the path (with its query) and the body, each
/// but the last ended by a newline (neither a method nor a path holds one).
pub fn request_fingerprint(method: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut hash = Sha256::new();
    hash.update(method.as_bytes());
    hash.update(b"\n");
    hash.update(path.as_bytes());
    hash.update(b"\n");
    hash.update(body);
    hash.finalize().to_vec()
}

/// The string at `path` in a JWT payload, if there is one.
fn claim<'a>(payload: &'a Struct, path: &[String]) -> Option<&'a str> {
    let (last, parents) = path.split_last()?;
    let mut at = payload;
    for name in parents {
        match at.fields.get(name)?.kind.as_ref()? {
            Kind::StructValue(inner) => at = inner,
            _ => return None,
        }
    }
    match at.fields.get(last)?.kind.as_ref()? {
        Kind::StringValue(s) => Some(s),
        _ => None,
    }
}

impl Mapping {
    /// Whether the fingerprint needs the request's body.
    pub fn needs_body(&self) -> bool {
        self.fingerprint == mapping::FingerprintSource::Request
    }

    /// The Authorize this request asks for. Reading only: every rule
    /// (what a key, a permit id, a tool or a cost may be) is the Gate's
    /// validation's, applied when the request is authorized. Every missing
    /// or unreadable source is reported, not just the first.
    pub(crate) fn authorize_request(
        &self,
        request: &HttpRequest<'_>,
    ) -> Result<pb::AuthorizeRequest, Unmapped> {
        // The table matches plain paths only: any other form of a path is
        // refused before a route is matched, whatever else the request
        // holds, and so is a path an upstream could read as an earlier
        // route naming another tool. A tool the route names leaves the
        // path to Envoy's routing.
        let routed = if request.route_tool.is_none() && !self.tool.routes.is_empty() {
            let path = mapping::plain_path(request.path).map_err(Unmapped::PathNotCanonical)?;
            mapping::route_of(&self.tool.routes, request.method, path)
                .map_err(Unmapped::PathNotCanonical)?
        } else {
            None
        };
        let mut read = Reader {
            headers: request.headers,
            violations: Vec::new(),
        };

        let permit_id = match &self.permit {
            mapping::PermitSource::Header(name) => {
                read.required(name, "it names the permit").map(text)
            }
            mapping::PermitSource::Jwt {
                namespace,
                payload,
                claim: path,
            } => {
                let found = request
                    .metadata
                    .and_then(|m| m.filter_metadata.get(namespace))
                    .and_then(|ns| ns.fields.get(payload))
                    .and_then(|v| match v.kind.as_ref() {
                        Some(Kind::StructValue(p)) => claim(p, path),
                        _ => None,
                    });
                if found.is_none() {
                    read.violations.push(violation(
                        format!("jwt claim {}", path.join(".")),
                        format!(
                            "missing: no verified JWT names the permit (metadata {namespace:?}, payload {payload:?})"
                        ),
                    ));
                }
                found.map(str::to_owned)
            }
        };

        let key = match read
            .required(
                &self.key_header,
                "every guarded request needs its idempotency key",
            )
            .map(idempotency_key)
        {
            Some(Ok(key)) => Some(key),
            Some(Err(why)) => {
                read.violations
                    .push(violation(format!("header {}", self.key_header), why));
                None
            }
            None => None,
        };

        let from_header = match &self.tool.header {
            Some(name) => read.optional(name).map(text),
            None => None,
        };
        let tool = request
            .route_tool
            .map(str::to_owned)
            .or_else(|| routed.map(|r| r.tool.clone()))
            .or(from_header);
        if tool.is_none() {
            read.violations.push(violation(
                "tool",
                format!(
                    "no tool for {} {}: the route names none and no route of the mapping matches",
                    request.method,
                    crate::domain::shown(request.path)
                ),
            ));
        }

        let fingerprint = match &self.fingerprint {
            mapping::FingerprintSource::Request => Some(request_fingerprint(
                request.method,
                request.path,
                request.body,
            )),
            mapping::FingerprintSource::Header(name) => read
                .required(name, "it carries the request's fingerprint")
                .map(<[u8]>::to_vec),
        };

        let cost_header = match &self.cost.header {
            Some(name) => read.optional(name).map(|v| (name, v)),
            None => None,
        };
        let cost = match cost_header {
            Some((name, value)) => match text(value).trim().parse::<i64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    read.violations.push(violation(
                        format!("header {name}"),
                        "must be an integer amount in minor units",
                    ));
                    None
                }
            },
            None => Some(
                tool.as_ref()
                    .and_then(|t| self.cost.tools.get(t).copied())
                    .unwrap_or(self.cost.default),
            ),
        };

        match (permit_id, tool, key, fingerprint, cost) {
            (Some(permit_id), Some(tool), Some(idempotency_key), Some(fp), Some(cost))
                if read.violations.is_empty() =>
            {
                Ok(pb::AuthorizeRequest {
                    permit_id,
                    tool,
                    idempotency_key,
                    request_fingerprint: fp,
                    cost,
                    holder_token: Vec::new(),
                    ..Default::default()
                })
            }
            _ => Err(Unmapped::Invalid(read.violations)),
        }
    }
}

// === the answer ===

/// What a front door tells Envoy about one request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Answer {
    /// Forward the request: atmost reserved the attempt (DISPATCH).
    Forward(Box<pb::Attempt>),
    /// Answer the client instead; the tool is not called.
    Respond(Reply),
}

/// An HTTP answer given instead of the tool's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pub status: u16,
    /// Its `x-atmost-reason`: a contract reason, or one of [`reasons`].
    pub reason: String,
    /// Every header, `x-atmost-reason` included.
    pub headers: Vec<(&'static str, String)>,
    pub body: Vec<u8>,
}

/// The HTTP status of each refusal: the one table (docs/gateways.md,
/// "Answers"). Exhaustive, so a new reason cannot go unmapped.
pub fn http_status(error: &Error) -> u16 {
    match error.reason() {
        Reason::PermitNotFound
        | Reason::PermitRevoked
        | Reason::PermitExpired
        | Reason::ToolNotInScope
        | Reason::RoleNotAllowed
        | Reason::AttemptHolderMismatch
        | Reason::ApproverIsRequester => 403,
        Reason::MaxCallsExceeded
        | Reason::BudgetExceeded
        | Reason::QuotaPermitLifetime
        | Reason::QuotaOpenAttempts
        | Reason::QuotaAttempts
        | Reason::QuotaTenantPermits
        | Reason::QuotaStoreFull => 429,
        Reason::KeyReused => 422,
        Reason::InProgress
        | Reason::DuplicateSuspected
        | Reason::ToolHeld
        | Reason::AttemptNotFound
        | Reason::AttemptMismatch
        | Reason::StateConflict => 409,
        Reason::InvalidRequest => 400,
        Reason::Unauthenticated => 401,
        Reason::StoreUnavailable | Reason::Overloaded => 503,
        Reason::DeadlineExceeded => 504,
        // Refused by the transport on the gateway's own gRPC call, so no
        // front door answers it; 413 if one ever did.
        Reason::MessageTooLarge => 413,
    }
}

/// A small JSON body: `{"reason", "message", ...}`.
fn json(value: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&value).unwrap_or_default()
}

/// Retry-After in whole seconds, rounded up (never earlier than advised).
fn retry_after_secs(delay: std::time::Duration) -> String {
    delay.as_millis().div_ceil(1000).to_string()
}

impl Reply {
    fn new(status: u16, reason: &str, body: Vec<u8>) -> Self {
        Self {
            status,
            reason: reason.to_owned(),
            headers: vec![
                (REASON_HEADER, reason.to_owned()),
                ("content-type", "application/json".to_owned()),
            ],
            body,
        }
    }

    /// A refusal: its status, its reason, and the ErrorInfo metadata the
    /// Gate would have sent, as JSON.
    pub(crate) fn refusal(error: &Error) -> Self {
        let (_, metadata) = super::status::code_and_metadata(error);
        let reason = error.reason().as_str();
        // A Check answers its refusals inside a gRPC OK: noted here, they
        // are counted as an Authorize's (docs/telemetry.md).
        crate::telemetry::note_reason(reason);
        // The store's own words (a Redis error's text) are the operator's,
        // in the log; the gateway's client only learns nothing was decided.
        let message = match error {
            Error::StoreUnavailable(detail) => {
                tracing::warn!(%detail, "envoy: the store is unavailable; answered 503");
                "the store could not be reached or could not confirm: nothing was decided; try again"
                    .to_owned()
            }
            other => other.to_string(),
        };
        let mut body = serde_json::json!({
            "reason": reason,
            "message": message,
        });
        if !metadata.is_empty() {
            body["metadata"] = metadata
                .into_iter()
                .map(|(k, v)| (k.to_owned(), serde_json::Value::String(v)))
                .collect::<serde_json::Map<_, _>>()
                .into();
        }
        if let Error::InvalidRequest(violations) = error {
            body["violations"] = violations
                .iter()
                .map(|v| serde_json::json!({"field": v.field, "description": v.description}))
                .collect::<Vec<_>>()
                .into();
        }
        let mut reply = Self::new(http_status(error), reason, json(body));
        if let Some(delay) = super::status::retry_after(error) {
            reply.headers.push(("retry-after", retry_after_secs(delay)));
        }
        reply
    }

    /// A request the mapping could not read.
    pub(crate) fn unmapped(unmapped: Unmapped) -> Self {
        match unmapped {
            Unmapped::Invalid(violations) => Self::refusal(&Error::InvalidRequest(violations)),
            Unmapped::Misconfigured(why) => {
                crate::telemetry::note_reason(reasons::GATEWAY_MISCONFIGURED);
                tracing::error!(%why, "the gateway's configuration does not give what the Envoy mapping needs");
                Self::new(
                    500,
                    reasons::GATEWAY_MISCONFIGURED,
                    json(serde_json::json!({
                        "reason": reasons::GATEWAY_MISCONFIGURED,
                        "message": why,
                    })),
                )
            }
            Unmapped::PathNotCanonical(why) => {
                crate::telemetry::note_reason(reasons::PATH_NOT_CANONICAL);
                Self::new(
                    400,
                    reasons::PATH_NOT_CANONICAL,
                    json(serde_json::json!({
                        "reason": reasons::PATH_NOT_CANONICAL,
                        "message": "the path is not in the one form the route table matches: an upstream could read it as another route; send it without empty, '.' or '..' segments, a trailing '/', percent-encoding, ';' or '\\', with each route's literal segments as the table spells them and no '.format' suffix",
                        "violations": [{"field": "path", "description": why}],
                    })),
                )
            }
        }
    }

    /// A REPLAY: the stored result of a call that succeeded (status 200,
    /// the result as the body), or why there is none.
    ///
    /// The attempt's id goes to the client only when the attempt is
    /// settled (SUCCEEDED, FAILED): the id of an open attempt (UNCERTAIN;
    /// RESERVED never replays) is the fencing token its Commit or
    /// MarkUncertain presents, which GetAttempt withholds too, and the
    /// client on the other side of a gateway must never hold it.
    fn replay(attempt: pb::Attempt) -> Self {
        use pb::AttemptState as S;
        let state = attempt.state();
        let settled = matches!(state, S::Succeeded | S::Failed);
        let attempt_id = attempt.attempt_id.clone();
        let mut reply = match state {
            S::Succeeded => {
                let receipt = attempt.receipt.unwrap_or_default();
                Self {
                    status: 200,
                    reason: reasons::REPLAY_SUCCEEDED.to_owned(),
                    headers: vec![
                        (REASON_HEADER, reasons::REPLAY_SUCCEEDED.to_owned()),
                        (REPLAYED_HEADER, "true".to_owned()),
                        ("x-atmost-receipt-id", receipt.receipt_id),
                    ],
                    body: receipt.result,
                }
            }
            S::Failed => Self::new(
                409,
                reasons::REPLAY_FAILED,
                json(serde_json::json!({
                    "reason": reasons::REPLAY_FAILED,
                    "message": "this idempotency key's call was sent before and the tool refused it; it is not sent again",
                    "attempt_id": attempt.attempt_id,
                    "failure_reason": attempt.failure_reason,
                })),
            ),
            S::Denied => {
                let approval = attempt.approval.unwrap_or_default();
                Self::new(
                    403,
                    reasons::REPLAY_DENIED,
                    json(serde_json::json!({
                        "reason": reasons::REPLAY_DENIED,
                        "message": "this idempotency key's call was denied approval (or its approval lapsed); it was never sent and is not asked again",
                        "denial_reason": approval.denial_reason,
                        "decided_by": approval.decided_by,
                    })),
                )
            }
            // UNCERTAIN, and (never from a REPLAY) anything else: no
            // outcome to give, and nothing is sent.
            S::Uncertain
            | S::Reserved
            | S::Released
            | S::AwaitingApproval
            | S::Approved
            | S::Unspecified => Self::new(
                409,
                reasons::REPLAY_UNCERTAIN,
                json(serde_json::json!({
                    "reason": reasons::REPLAY_UNCERTAIN,
                    "message": "this idempotency key's call was sent before and its outcome is unknown; it is not sent again until an operator resolves it",
                    "state": state.as_str_name(),
                    "uncertain_reason": attempt.uncertain_reason,
                })),
            ),
        };
        if settled {
            reply.headers.push((ATTEMPT_HEADER, attempt_id));
        }
        reply
    }

    /// A call awaiting approval: 202 Accepted, nothing sent; the client
    /// retries the same request with the same Idempotency-Key after
    /// Retry-After (at most 10 s, never past the request's deadline), and
    /// is forwarded once the call is approved.
    fn awaiting(r: &pb::AuthorizeResponse) -> Self {
        let remaining = r
            .approval_remaining
            .map(|d| std::time::Duration::new(d.seconds.max(0) as u64, d.nanos.max(0) as u32))
            .unwrap_or_default();
        let approval = r
            .attempt
            .as_ref()
            .and_then(|a| a.approval.clone())
            .unwrap_or_default();
        crate::telemetry::note_reason(reasons::AWAITING_APPROVAL);
        let mut reply = Self::new(
            202,
            reasons::AWAITING_APPROVAL,
            json(serde_json::json!({
                "reason": reasons::AWAITING_APPROVAL,
                "message": "this call waits for a person's approval and was not sent; send the same request with the same Idempotency-Key again after Retry-After",
                "approval_expires_at": approval.expires_at.map(|t| super::status::rfc3339(t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)),
                "approvers_needed": approval.approvers_needed,
                "approvals": approval.approved_by.len(),
            })),
        );
        let retry = remaining.clamp(
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(10),
        );
        reply.headers.push(("retry-after", retry_after_secs(retry)));
        reply
    }
}

impl Answer {
    /// The answer to an Authorize, as the Gate gave it.
    pub(crate) fn of(result: Result<pb::AuthorizeResponse, Error>) -> Self {
        match result {
            Ok(r) => {
                let decision = r.decision();
                let attempt = r.attempt.unwrap_or_default();
                match decision {
                    pb::Decision::Dispatch => Answer::Forward(Box::new(attempt)),
                    pb::Decision::AwaitApproval => {
                        let r = pb::AuthorizeResponse {
                            attempt: Some(attempt),
                            ..r
                        };
                        Answer::Respond(Reply::awaiting(&r))
                    }
                    pb::Decision::Replay | pb::Decision::Unspecified => {
                        Answer::Respond(Reply::replay(attempt))
                    }
                }
            }
            Err(e) => Answer::Respond(Reply::refusal(&e)),
        }
    }
}

/// The dynamic metadata of a forwarded request (Envoy access logs read it
/// as `%DYNAMIC_METADATA(<filter>:attempt_id)%`).
pub(crate) fn attempt_metadata(attempt: &pb::Attempt) -> Struct {
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    Struct {
        fields: [
            ("permit_id", string(&attempt.permit_id)),
            ("tool", string(&attempt.tool)),
            ("idempotency_key", string(&attempt.idempotency_key)),
            ("attempt_id", string(&attempt.attempt_id)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
    }
}
