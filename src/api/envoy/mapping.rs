//! The mapping from an HTTP request, as Envoy describes it, to the fields
//! of an Authorize: where the permit, the tool, the idempotency key, the
//! fingerprint and the cost come from; and, for ext_proc, how the tool's
//! response settles the attempt. Read once at start-up from the TOML file
//! `--envoy-mapping` names (docs/gateways.md, "The mapping"); without it,
//! [`Mapping::default`].
//!
//! Every value is checked when the file is read, and an error names the
//! file and the setting: a mapping that would send requests to the wrong
//! tool, or take a cost from nowhere, never starts.

use crate::domain::{MAX_AMOUNT, valid_tool};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// Where the permit comes from: one source, never a fallback, so that a
/// permit bound to a verified JWT cannot be swapped by a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermitSource {
    /// A request header (default `x-atmost-permit`).
    Header(String),
    /// A claim of the JWT Envoy's `jwt_authn` filter verified, which it put
    /// in the request's dynamic metadata (`payload_in_metadata`).
    Jwt {
        /// The dynamic metadata namespace (jwt_authn's, by default).
        namespace: String,
        /// The `payload_in_metadata` name in jwt_authn's config.
        payload: String,
        /// The claim's path in the payload, split at dots.
        claim: Vec<String>,
    },
}

/// One segment of a route's path template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Matches this text exactly.
    Literal(String),
    /// `{name}`: matches any one non-empty segment.
    Any,
}

/// One row of the route table: requests whose method and path match are
/// calls of `tool`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Upper case; `None` matches every method.
    method: Option<String>,
    segments: Vec<Segment>,
    /// The template ends in `/*`: any rest of the path matches.
    rest: bool,
    pub tool: String,
    /// How the file names it: `tool.route[1] (POST /v1/x -> t)`.
    shown: String,
}

impl Route {
    /// Whether `method` and `path` (what precedes its first `?`: the query
    /// string is ignored) match. The table matches only a path
    /// [`plain_path`] passed.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        self.matches_parts(method, &parts(path), false)
    }

    /// Whether `method` and the path's segments match, each literal
    /// segment byte for byte or (`folded`) as an upstream may: ignoring
    /// ASCII case, the method's too, and a HEAD run as the GET (Express,
    /// Rails, Spring and ASP.NET Core all do).
    fn matches_parts(&self, method: &str, given: &[&str], folded: bool) -> bool {
        let method_matches = |m: &str| match folded {
            false => m == method,
            true => {
                m.eq_ignore_ascii_case(method)
                    || (m.eq_ignore_ascii_case("GET") && method.eq_ignore_ascii_case("HEAD"))
            }
        };
        if self.method.as_deref().is_some_and(|m| !method_matches(m)) {
            return false;
        }
        if given.is_empty()
            || given.len() < self.segments.len()
            || (!self.rest && given.len() != self.segments.len())
        {
            return false;
        }
        self.segments
            .iter()
            .zip(given)
            .all(|(segment, part)| match segment {
                Segment::Literal(text) if folded => text.eq_ignore_ascii_case(part),
                Segment::Literal(text) => text == part,
                Segment::Any => !part.is_empty(),
            })
    }
}

/// The segments of `path` (what precedes its first `?`); none when it
/// does not start with `/`.
fn parts(path: &str) -> Vec<&str> {
    let path = path.split('?').next().unwrap_or_default();
    match path.strip_prefix('/') {
        Some(path) => path.split('/').collect(),
        None => Vec::new(),
    }
}

/// The route of `routes` that names the tool of `method` and `path` (a
/// path [`plain_path`] passed): the first that matches it byte for byte,
/// if any. Else why not: an upstream that matches routes ignoring ASCII
/// case (Express, ASP.NET Core) or reads the last segment's `.suffix` as
/// a format (Rails' `(.:format)`, Spring's suffix match before 5.3: what
/// follows any dot with text before it) could run the path as
/// an earlier route (or, when none matches, as any route) naming another
/// tool: `/v1/charges/abc/CAPTURE` or `capture.json` as
/// `/v1/charges/{id}/capture`, while its bytes fit only a catch-all. Only
/// the template's literal segments are folded against; a `{name}`
/// matches any segment.
pub fn route_of<'r>(
    routes: &'r [Route],
    method: &str,
    path: &str,
) -> Result<Option<&'r Route>, String> {
    let given = parts(path);
    let matched = routes
        .iter()
        .position(|r| r.matches_parts(method, &given, false));
    let earlier = &routes[..matched.unwrap_or(routes.len())];
    let tool = matched.map(|n| routes[n].tool.as_str());
    // The path as such an upstream reads it: its case folded, and its last
    // segment whole or cut at any of its dots with text before it (Rails
    // cuts at the last, Spring's `capture.*` reads `capture.tar.gz` too).
    let last = given.len().saturating_sub(1);
    let stems = given.last().into_iter().flat_map(|segment| {
        segment
            .match_indices('.')
            .map(|(at, _)| &segment[..at])
            .filter(|stem| !stem.is_empty())
    });
    let forms: Vec<Vec<&str>> = std::iter::once(given.clone())
        .chain(stems.map(|stem| {
            let mut form = given.clone();
            form[last] = stem;
            form
        }))
        .collect();
    let misread = earlier.iter().find(|r| {
        Some(r.tool.as_str()) != tool
            && forms.iter().any(|form| r.matches_parts(method, form, true))
    });
    match misread {
        None => Ok(matched.map(|n| &routes[n])),
        Some(other) => Err(format!(
            "the path {} matches {}, but an upstream that ignores case or a '.format' suffix could read it as {}",
            crate::domain::shown(path.split('?').next().unwrap_or_default()),
            matched.map_or("no route".to_owned(), |n| routes[n].shown.clone()),
            other.shown,
        )),
    }
}

/// What is wrong with one segment of a path (`last`: the path's final
/// one), for [`plain_path`] and the route templates alike: an empty
/// segment, `.` or `..`, or a character an upstream may decode or split
/// at. A path segment is RFC 3986's `segment`, its `pchar`s unreserved
/// (`A-Z a-z 0-9 - . _ ~`), sub-delims (`! $ & ' ( ) * + , ; =`), `:` and
/// `@`, less the two an upstream may read as something else: `%` (a
/// percent-encoding it decodes: `%63apture` is `capture`, `%2F` a `/`)
/// and `;` (a path parameter, which servlet containers cut off:
/// `capture;x=1` is `capture`). Anything else, a backslash (read as `/` by
/// some servers and by Envoy's own normalisation) or `#` among them, is
/// no character of a path at all.
fn segment_problem(segment: &str, last: bool) -> Option<String> {
    match segment {
        "" if last => return Some("ends in '/' (an empty last segment)".into()),
        "" => return Some("has an empty segment ('//')".into()),
        "." | ".." => return Some(format!("has a {segment:?} segment")),
        _ => {}
    }
    segment.chars().find_map(|c| match c {
        '%' => Some("is percent-encoded ('%')".to_owned()),
        ';' => Some("has a path parameter (';')".to_owned()),
        'A'..='Z'
        | 'a'..='z'
        | '0'..='9'
        | '-'
        | '.'
        | '_'
        | '~'
        | '!'
        | '$'
        | '&'
        | '\''
        | '('
        | ')'
        | '*'
        | '+'
        | ','
        | '='
        | ':'
        | '@' => None,
        other => Some(format!(
            "has {other:?}, which is no character of a URI path (RFC 3986)"
        )),
    })
}

/// The path of `path` (what precedes its first `?`; the query is neither
/// matched nor checked) when it is in its one plain form, the only form
/// the route table matches: it starts with `/`, and no segment is empty
/// (`//`, a trailing `/`: only the root `/` ends in one), `.` or `..`, or
/// holds a `%`, a `;` or any character that is not a URI path's. Else
/// why not. An upstream may read any other form as another route than the
/// one the table would match (`capture/`, `./capture`, `%63apture` as
/// `capture`), so such a path is refused before any route is matched,
/// never matched to whatever route its raw bytes happen to fit.
pub fn plain_path(path: &str) -> Result<&str, String> {
    let path = path.split('?').next().unwrap_or_default();
    let Some(rest) = path.strip_prefix('/') else {
        return Err(format!(
            "the path {} does not start with '/'",
            crate::domain::shown(path)
        ));
    };
    if rest.is_empty() {
        return Ok(path);
    }
    let segments: Vec<&str> = rest.split('/').collect();
    let last = segments.len() - 1;
    match segments
        .iter()
        .enumerate()
        .find_map(|(n, segment)| segment_problem(segment, n == last))
    {
        Some(problem) => Err(format!("the path {} {problem}", crate::domain::shown(path))),
        None => Ok(path),
    }
}

/// Where the tool name comes from, first match wins in this order: the
/// route's own configuration (ext_authz `context_extensions`, ext_proc
/// gRPC initial metadata), the route table, then a request header (only
/// when configured: a client then names its own tool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolSources {
    /// ext_authz: the key of the route's `check_settings.context_extensions`.
    pub context_extension: Option<String>,
    /// ext_proc: the gRPC metadata the route adds to its stream
    /// (`grpc_initial_metadata`).
    pub grpc_metadata: Option<String>,
    pub routes: Vec<Route>,
    pub header: Option<String>,
}

/// How the request fingerprint is made.
///
/// Neither source takes any other header into the fingerprint: a header
/// that selects the effect (an account header, `:authority` where one
/// route serves several hosts) is not compared, so the same key with
/// another such header replays the first call instead of being refused
/// as a reused key. There is no setting listing headers for the
/// fingerprint: where they matter, the client sends a fingerprint of its
/// own that covers them ([`FingerprintSource::Header`]), or each account
/// or host gets a route (and tool) of its own (docs/gateways.md, "The
/// mapping").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FingerprintSource {
    /// SHA-256 of the method, the path and the body: Envoy must send the
    /// body (ext_authz `with_request_body`, ext_proc `request_body_mode:
    /// BUFFERED`).
    Request,
    /// The bytes of a header the client sends (1..=64 bytes).
    Header(String),
}

/// Where the cost comes from: a header when configured and present, else
/// the tool's default, else `default`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostSource {
    pub header: Option<String>,
    pub tools: BTreeMap<String, i64>,
    pub default: i64,
}

/// What a successful response stores as the attempt's result (ext_proc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultMode {
    /// The response body (its SHA-256 instead when it is over 64 KiB).
    Body,
    /// `sha256:<hex>` of the response body.
    Digest,
    /// `HTTP <status>`: the body is not read.
    Status,
}

/// What a response that is not 2xx and not in the failed set does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Otherwise {
    /// MarkUncertain: the tool may have acted (a 5xx, say).
    Uncertain,
    /// Commit Failed.
    Failed,
}

/// How the tool's response settles the attempt (ext_proc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponsePolicy {
    pub result: ResultMode,
    /// Inclusive ranges of statuses that mean the tool refused: Failed.
    failed: Vec<(u16, u16)>,
    pub otherwise: Otherwise,
}

/// What a response status settles an attempt as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Succeeded,
    Failed,
    Uncertain,
}

impl ResponsePolicy {
    pub fn settle(&self, status: u16) -> Settle {
        if (200..300).contains(&status) {
            Settle::Succeeded
        } else if self
            .failed
            .iter()
            .any(|(lo, hi)| (*lo..=*hi).contains(&status))
        {
            Settle::Failed
        } else {
            match self.otherwise {
                Otherwise::Uncertain => Settle::Uncertain,
                Otherwise::Failed => Settle::Failed,
            }
        }
    }
}

/// The whole mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub permit: PermitSource,
    pub tool: ToolSources,
    /// The idempotency key's header (the IETF draft's `Idempotency-Key`).
    pub key_header: String,
    pub fingerprint: FingerprintSource,
    pub cost: CostSource,
    pub response: ResponsePolicy,
}

/// The defaults, as docs/gateways.md lists them.
pub const DEFAULT_PERMIT_HEADER: &str = "x-atmost-permit";
pub const DEFAULT_JWT_PAYLOAD: &str = "jwt_payload";
/// The dynamic metadata namespace Envoy's jwt_authn filter writes.
pub const DEFAULT_JWT_NAMESPACE: &str = "envoy.filters.http.jwt_authn";
pub const DEFAULT_CONTEXT_EXTENSION: &str = "atmost.tool";
pub const DEFAULT_GRPC_METADATA: &str = "x-atmost-tool";
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";
pub const DEFAULT_FINGERPRINT_HEADER: &str = "x-atmost-fingerprint";

impl Default for Mapping {
    fn default() -> Self {
        Self::parse(Path::new("(defaults)"), "").expect("the defaults are valid")
    }
}

// === the file ===

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    permit: PermitFile,
    #[serde(default)]
    tool: ToolFile,
    #[serde(default)]
    key: KeyFile,
    #[serde(default)]
    fingerprint: FingerprintFile,
    #[serde(default)]
    cost: CostFile,
    #[serde(default)]
    response: ResponseFile,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct PermitFile {
    from: Option<String>,
    header: Option<String>,
    jwt_claim: Option<String>,
    jwt_payload: Option<String>,
    jwt_namespace: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct ToolFile {
    context_extension: Option<String>,
    grpc_metadata: Option<String>,
    header: Option<String>,
    #[serde(default)]
    route: Vec<RouteFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteFile {
    method: Option<String>,
    path: String,
    tool: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    header: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FingerprintFile {
    from: Option<String>,
    header: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CostFile {
    header: Option<String>,
    default: Option<i64>,
    #[serde(default)]
    tools: BTreeMap<String, i64>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ResponseFile {
    result: Option<String>,
    failed: Option<Vec<StatusEntry>>,
    otherwise: Option<String>,
}

/// A status (`402`) or a class (`"4xx"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum StatusEntry {
    Code(i64),
    Class(String),
}

/// A header name as Envoy passes it: lower case. `""` turns an optional
/// source off.
fn header_name(at: &str, name: &str) -> Result<String, String> {
    let lower = name.to_ascii_lowercase();
    match http::HeaderName::from_bytes(lower.as_bytes()) {
        Ok(_) if !lower.starts_with(':') => Ok(lower),
        _ => Err(format!("{at}: {name:?} is not a header name")),
    }
}

/// An optional header: absent or `""` is none.
fn optional_header(at: &str, name: Option<String>) -> Result<Option<String>, String> {
    match name.as_deref() {
        None | Some("") => Ok(None),
        Some(name) => header_name(at, name).map(Some),
    }
}

fn cost(at: &str, cost: i64) -> Result<i64, String> {
    if (0..=MAX_AMOUNT).contains(&cost) {
        Ok(cost)
    } else {
        Err(format!("{at}: {cost} is not within 0..={MAX_AMOUNT}"))
    }
}

fn tool(at: &str, tool: &str) -> Result<String, String> {
    if valid_tool(tool) {
        Ok(tool.to_owned())
    } else {
        Err(format!(
            "{at}: {tool:?} is not a tool name (1..=128 of [A-Za-z0-9._:/-])"
        ))
    }
}

fn route(at: &str, row: RouteFile) -> Result<Route, String> {
    let method = match row.method.as_deref() {
        None | Some("*") => None,
        Some(m) if !m.is_empty() && m.bytes().all(|b| b.is_ascii_alphabetic()) => {
            Some(m.to_ascii_uppercase())
        }
        Some(m) => {
            return Err(format!(
                "{at}.method: {m:?} is not an HTTP method (or \"*\")"
            ));
        }
    };
    let Some(path) = row.path.strip_prefix('/') else {
        return Err(format!("{at}.path: {:?} must start with '/'", row.path));
    };
    if row.path.contains(['?', '#']) {
        return Err(format!(
            "{at}.path: {:?}: a template matches the path only, without a query",
            row.path
        ));
    }
    let parts: Vec<&str> = path.split('/').collect();
    let rest = parts.last() == Some(&"*");
    let fixed = if rest {
        &parts[..parts.len() - 1]
    } else {
        &parts[..]
    };
    let mut segments = Vec::with_capacity(fixed.len());
    for (n, part) in fixed.iter().enumerate() {
        segments.push(
            if part.starts_with('{') && part.ends_with('}') && part.len() > 2 {
                Segment::Any
            } else if part.contains(['{', '}', '*']) {
                return Err(format!(
                    "{at}.path: {:?}: a segment is text, {{name}}, or a final *",
                    row.path
                ));
            } else if row.path == "/" {
                Segment::Literal(String::new())
            } else if let Some(problem) = segment_problem(part, n + 1 == parts.len()) {
                // A request path like this one is refused before the table
                // is read (plain_path): the route could never match.
                return Err(format!(
                    "{at}.path: {:?} {problem}: the route table matches plain paths only",
                    row.path
                ));
            } else {
                Segment::Literal((*part).to_owned())
            },
        );
    }
    let tool = tool(&format!("{at}.tool"), &row.tool)?;
    Ok(Route {
        shown: format!(
            "{at} ({} {} -> {tool})",
            method.as_deref().unwrap_or("*"),
            row.path
        ),
        method,
        segments,
        rest,
        tool,
    })
}

fn statuses(entries: Vec<StatusEntry>) -> Result<Vec<(u16, u16)>, String> {
    let at = "response.failed";
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let range = match entry {
            StatusEntry::Code(code) if (100..=599).contains(&code) => (code as u16, code as u16),
            StatusEntry::Code(code) => return Err(format!("{at}: {code} is not an HTTP status")),
            StatusEntry::Class(class) => {
                let digit = class
                    .strip_suffix("xx")
                    .and_then(|d| d.parse::<u16>().ok())
                    .filter(|d| (1..=5).contains(d))
                    .ok_or_else(|| {
                        format!("{at}: {class:?} is neither a status (402) nor a class (\"4xx\")")
                    })?;
                (digit * 100, digit * 100 + 99)
            }
        };
        if range.0 <= 299 && range.1 >= 200 {
            return Err(format!(
                "{at}: a 2xx status is a success (Commit Succeeded), never Failed"
            ));
        }
        ranges.push(range);
    }
    Ok(ranges)
}

impl Mapping {
    /// Reads and checks the mapping file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(path, &text)
    }

    /// [`Mapping::load`] of `text`, as if read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, String> {
        let file: File = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            match line {
                Some(line) => format!("{}: line {line}: {}", path.display(), e.message()),
                None => format!("{}: {}", path.display(), e.message()),
            }
        })?;
        Self::check(file).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn check(file: File) -> Result<Self, String> {
        let p = file.permit;
        let permit = match p.from.as_deref().unwrap_or("header") {
            "header" => {
                if p.jwt_claim.is_some() || p.jwt_payload.is_some() || p.jwt_namespace.is_some() {
                    return Err(
                        "permit: jwt-claim, jwt-payload and jwt-namespace are for from = \"jwt\"; the permit has one source"
                            .into(),
                    );
                }
                PermitSource::Header(header_name(
                    "permit.header",
                    p.header.as_deref().unwrap_or(DEFAULT_PERMIT_HEADER),
                )?)
            }
            "jwt" => {
                if p.header.is_some() {
                    return Err(
                        "permit: header is for from = \"header\"; the permit has one source".into(),
                    );
                }
                let claim = p.jwt_claim.ok_or(
                    "permit: from = \"jwt\" needs jwt-claim (the claim naming the permit)",
                )?;
                let path: Vec<String> = claim.split('.').map(str::to_owned).collect();
                if path.iter().any(String::is_empty) {
                    return Err(format!("permit.jwt-claim: {claim:?} is not a claim path"));
                }
                let payload = p.jwt_payload.unwrap_or_else(|| DEFAULT_JWT_PAYLOAD.into());
                if payload.is_empty() {
                    return Err("permit.jwt-payload: must not be empty".into());
                }
                let namespace = p
                    .jwt_namespace
                    .unwrap_or_else(|| DEFAULT_JWT_NAMESPACE.into());
                if namespace.is_empty() {
                    return Err("permit.jwt-namespace: must not be empty".into());
                }
                PermitSource::Jwt {
                    namespace,
                    payload,
                    claim: path,
                }
            }
            other => {
                return Err(format!(
                    "permit.from: {other:?}: give \"header\" or \"jwt\""
                ));
            }
        };

        let t = file.tool;
        let tool_sources = ToolSources {
            context_extension: match t.context_extension {
                None => Some(DEFAULT_CONTEXT_EXTENSION.into()),
                Some(name) if name.is_empty() => None,
                Some(name) => Some(name),
            },
            grpc_metadata: match t.grpc_metadata {
                None => Some(DEFAULT_GRPC_METADATA.into()),
                Some(name) if name.is_empty() => None,
                Some(name) => Some(header_name("tool.grpc-metadata", &name)?),
            },
            routes: t
                .route
                .into_iter()
                .enumerate()
                .map(|(n, row)| route(&format!("tool.route[{}]", n + 1), row))
                .collect::<Result<_, _>>()?,
            header: optional_header("tool.header", t.header)?,
        };

        let key_header = header_name(
            "key.header",
            file.key.header.as_deref().unwrap_or(DEFAULT_KEY_HEADER),
        )?;

        let f = file.fingerprint;
        let fingerprint = match f.from.as_deref().unwrap_or("request") {
            "request" => {
                if f.header.is_some() {
                    return Err(
                        "fingerprint.header is for from = \"header\"; from = \"request\" hashes the request"
                            .into(),
                    );
                }
                FingerprintSource::Request
            }
            "header" => FingerprintSource::Header(header_name(
                "fingerprint.header",
                f.header.as_deref().unwrap_or(DEFAULT_FINGERPRINT_HEADER),
            )?),
            other => {
                return Err(format!(
                    "fingerprint.from: {other:?}: give \"request\" or \"header\""
                ));
            }
        };

        let c = file.cost;
        let cost_source = CostSource {
            header: optional_header("cost.header", c.header)?,
            default: cost("cost.default", c.default.unwrap_or(0))?,
            tools: c
                .tools
                .into_iter()
                .map(|(name, n)| {
                    let at = format!("cost.tools.{name:?}");
                    Ok((tool(&at, &name)?, cost(&at, n)?))
                })
                .collect::<Result<_, String>>()?,
        };

        let r = file.response;
        let response = ResponsePolicy {
            result: match r.result.as_deref().unwrap_or("body") {
                "body" => ResultMode::Body,
                "digest" => ResultMode::Digest,
                "status" => ResultMode::Status,
                other => {
                    return Err(format!(
                        "response.result: {other:?}: give \"body\", \"digest\" or \"status\""
                    ));
                }
            },
            failed: statuses(
                r.failed
                    .unwrap_or_else(|| vec![StatusEntry::Class("4xx".into())]),
            )?,
            otherwise: match r.otherwise.as_deref().unwrap_or("uncertain") {
                "uncertain" => Otherwise::Uncertain,
                "failed" => Otherwise::Failed,
                other => {
                    return Err(format!(
                        "response.otherwise: {other:?}: give \"uncertain\" or \"failed\""
                    ));
                }
            },
        };

        Ok(Mapping {
            permit,
            tool: tool_sources,
            key_header,
            fingerprint,
            cost: cost_source,
            response,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The capture (its literal `capture` spelled as written) and, when
    /// `catch_all`, a catch-all to a free read after it.
    fn table(catch_all: bool) -> Vec<Route> {
        let mut text = String::from(
            "[[tool.route]]\nmethod = \"POST\"\npath = \"/v1/charges/{id}/capture\"\ntool = \"wallet.capture\"\n",
        );
        if catch_all {
            text.push_str("[[tool.route]]\npath = \"/v1/*\"\ntool = \"wallet.read\"\n");
        }
        routes(&text)
    }

    /// The route table of a mapping file's text.
    fn routes(text: &str) -> Vec<Route> {
        Mapping::parse(Path::new("t.toml"), text)
            .expect("a valid mapping")
            .tool
            .routes
    }

    fn tool<'r>(routes: &'r [Route], method: &str, path: &str) -> Result<Option<&'r str>, String> {
        route_of(routes, method, path).map(|r| r.map(|r| r.tool.as_str()))
    }

    /// A path the capture's bytes do not fit but whose case or format
    /// suffix folds onto it is refused, naming the route it could be read
    /// as, with the catch-all after the capture and without one.
    #[test]
    fn a_path_that_folds_onto_an_earlier_route_of_another_tool_is_refused() {
        for catch_all in [true, false] {
            let routes = table(catch_all);
            let matched = if catch_all {
                "matches tool.route[2] (* /v1/* -> wallet.read)"
            } else {
                "matches no route"
            };
            for (method, path) in [
                ("POST", "/v1/charges/abc/CAPTURE"),
                ("POST", "/v1/charges/abc/Capture"),
                ("POST", "/v1/charges/abc/capture.json"),
                ("POST", "/v1/charges/abc/capture.JSON"),
                ("POST", "/v1/charges/abc/CAPTURE.json"),
                ("POST", "/v1/charges/abc/capture.tar.gz"),
                ("POST", "/v1/charges/abc/CAPTURE?x=1"),
                // The method's case too (ASP.NET Core ignores it).
                ("post", "/v1/charges/abc/capture"),
                ("Post", "/v1/charges/abc/capture.json"),
            ] {
                let why = tool(&routes, method, path).expect_err(path);
                assert!(why.contains(matched), "{method} {path}: {why}");
                assert!(
                    why.ends_with(
                        "could read it as tool.route[1] (POST /v1/charges/{id}/capture -> wallet.capture)"
                    ),
                    "{method} {path}: {why}"
                );
                let shown = crate::domain::shown(path.split('?').next().unwrap());
                assert!(why.starts_with(&format!("the path {shown} ")), "{why}");
            }
        }
        // A HEAD runs the GET on most upstreams.
        let text = "[[tool.route]]\nmethod = \"GET\"\npath = \"/v1/reports/{id}/export\"\ntool = \"reports.export\"\n[[tool.route]]\npath = \"/v1/*\"\ntool = \"wallet.read\"\n";
        let routes = routes(text);
        let why = tool(&routes, "HEAD", "/v1/reports/r1/export").expect_err("HEAD");
        assert!(
            why.ends_with("(GET /v1/reports/{id}/export -> reports.export)"),
            "{why}"
        );
        assert_eq!(
            tool(&routes, "GET", "/v1/reports/r1/export"),
            Ok(Some("reports.export"))
        );
        // Not even the catch-all's `/v1` matches: any route it folds onto.
        let why = tool(&table(true), "POST", "/V1/CHARGES/abc/capture").expect_err("folded");
        assert!(why.contains("matches no route"), "{why}");
        assert!(
            why.ends_with("as tool.route[1] (POST /v1/charges/{id}/capture -> wallet.capture)"),
            "{why}"
        );
    }

    /// What matches its own route byte for byte, or folds onto no earlier
    /// route of another tool, passes.
    #[test]
    fn a_path_that_folds_onto_its_own_route_passes() {
        let routes = table(true);
        for (method, path, named) in [
            ("POST", "/v1/charges/abc/capture", Some("wallet.capture")),
            (
                "POST",
                "/v1/charges/abc/capture?f=x.JSON",
                Some("wallet.capture"),
            ),
            // The id is no literal: its case and its dots are the id's.
            (
                "POST",
                "/v1/charges/ABC.json/capture",
                Some("wallet.capture"),
            ),
            ("POST", "/v1/charges/abc", Some("wallet.read")),
            (
                "POST",
                "/v1/charges/abc/capture/refunds",
                Some("wallet.read"),
            ),
            // No `.suffix` without a stem before it.
            ("POST", "/v1/charges/abc/.capture", Some("wallet.read")),
            // Not a POST: the capture is no route of it, whatever the case.
            ("GET", "/v1/charges/abc/CAPTURE", Some("wallet.read")),
            ("POST", "/v2/charges/abc/capture", None),
        ] {
            assert_eq!(tool(&routes, method, path), Ok(named), "{method} {path}");
        }
        // A route folds onto itself: `/v1/*` reads `/V1/x` as no route.
        let routes = table(false);
        assert_eq!(
            tool(&routes, "POST", "/v1/charges/abc/capture"),
            Ok(Some("wallet.capture"))
        );
        assert_eq!(
            tool(&routes, "POST", "/v1/charges/abc/refund.json"),
            Ok(None)
        );
    }

    /// An earlier route naming the same tool leaves nothing to steer; a
    /// literal the table spells in capitals is folded against too.
    #[test]
    fn a_path_that_folds_onto_the_same_tool_passes() {
        let routes = routes(
            r#"
[[tool.route]]
path = "/v1/Charges/{id}"
tool = "wallet.read"
[[tool.route]]
path = "/v1/*"
tool = "wallet.read"
[[tool.route]]
path = "/v1/Reports/{id}"
tool = "reports.export"
"#,
        );
        assert_eq!(
            tool(&routes, "GET", "/v1/charges/abc"),
            Ok(Some("wallet.read"))
        );
        assert_eq!(
            tool(&routes, "GET", "/v1/Charges/abc"),
            Ok(Some("wallet.read"))
        );
        // A later route is no other reading of the catch-all's path.
        assert_eq!(
            tool(&routes, "GET", "/v1/reports/abc"),
            Ok(Some("wallet.read"))
        );
        let routes = Mapping::parse(
            Path::new("t.toml"),
            "[[tool.route]]\npath = \"/v1/Reports/{id}\"\ntool = \"reports.export\"\n",
        )
        .unwrap()
        .tool
        .routes;
        let why = tool(&routes, "GET", "/v1/reports/abc").expect_err("folded");
        assert!(
            why.contains("tool.route[1] (* /v1/Reports/{id} -> reports.export)"),
            "{why}"
        );
    }
}
