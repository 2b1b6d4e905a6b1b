//! The mapping file, the mapping of one request, the answer table, and the
//! vendored descriptors against the messages the server speaks. The front
//! doors themselves are tested through the real server in
//! `tests/envoy.rs`.

use super::mapping::{Otherwise, PermitSource, ResultMode, Settle};
use super::*;
use crate::domain::{AttemptState, Quota};
use std::path::Path;

fn parse(text: &str) -> Result<Mapping, String> {
    Mapping::parse(Path::new("m.toml"), text)
}

// === the file ===

#[test]
fn the_defaults_are_the_documented_ones() {
    let m = Mapping::default();
    assert_eq!(m.permit, PermitSource::Header("x-atmost-permit".into()));
    assert_eq!(m.tool.context_extension.as_deref(), Some("atmost.tool"));
    assert_eq!(m.tool.grpc_metadata.as_deref(), Some("x-atmost-tool"));
    assert_eq!(m.tool.header, None, "a client-named tool is opt-in");
    assert!(m.tool.routes.is_empty());
    assert_eq!(m.key_header, "idempotency-key");
    assert!(m.needs_body());
    assert_eq!(m.cost.header, None, "a client-named cost is opt-in");
    assert_eq!(m.cost.default, 0);
    assert_eq!(m.response.result, ResultMode::Body);
    assert_eq!(m.response.otherwise, Otherwise::Uncertain);
    assert_eq!(m.response.settle(200), Settle::Succeeded);
    assert_eq!(m.response.settle(204), Settle::Succeeded);
    assert_eq!(m.response.settle(402), Settle::Failed);
    assert_eq!(m.response.settle(499), Settle::Failed);
    assert_eq!(m.response.settle(500), Settle::Uncertain);
    assert_eq!(m.response.settle(302), Settle::Uncertain);
}

#[test]
fn a_full_file_reads_as_written() {
    let m = parse(
        r#"
[permit]
from = "jwt"
jwt-claim = "atmost.permit"
jwt-payload = "claims"
jwt-namespace = "dev.agentgateway.jwt"

[tool]
context-extension = ""
grpc-metadata = "X-Route-Tool"
header = "X-Tool"
[[tool.route]]
method = "post"
path = "/v1/charges/{id}/capture"
tool = "wallet.capture"

[key]
header = "X-Request-Key"

[fingerprint]
from = "header"
header = "x-fp"

[cost]
header = "x-cost"
default = 7
tools = { "wallet.capture" = 500 }

[response]
result = "digest"
failed = [402, "5xx"]
otherwise = "failed"
"#,
    )
    .expect("valid");
    assert_eq!(
        m.permit,
        PermitSource::Jwt {
            namespace: "dev.agentgateway.jwt".into(),
            payload: "claims".into(),
            claim: vec!["atmost".into(), "permit".into()],
        }
    );
    assert_eq!(m.tool.context_extension, None);
    assert_eq!(m.tool.grpc_metadata.as_deref(), Some("x-route-tool"));
    assert_eq!(m.tool.header.as_deref(), Some("x-tool"));
    assert_eq!(m.key_header, "x-request-key");
    assert!(!m.needs_body());
    assert_eq!(m.cost.header.as_deref(), Some("x-cost"));
    assert_eq!(m.cost.tools["wallet.capture"], 500);
    assert_eq!(m.response.result, ResultMode::Digest);
    assert_eq!(m.response.settle(402), Settle::Failed);
    assert_eq!(m.response.settle(401), Settle::Failed, "otherwise = failed");
    assert_eq!(m.response.settle(503), Settle::Failed);
    let route = &m.tool.routes[0];
    assert!(route.matches("POST", "/v1/charges/ch_1/capture"));
    assert!(route.matches("POST", "/v1/charges/ch_1/capture?expand=all"));
    assert!(!route.matches("GET", "/v1/charges/ch_1/capture"));
    assert!(!route.matches("POST", "/v1/charges//capture"));
    assert!(!route.matches("POST", "/v1/charges/ch_1/capture/more"));
    assert!(!route.matches("POST", "/v1/charges/ch_1"));
}

#[test]
fn route_templates_match_segments_and_a_final_rest() {
    let m = parse(
        r#"
[[tool.route]]
path = "/tools/*"
tool = "any.tool"
[[tool.route]]
method = "GET"
path = "/"
tool = "root"
"#,
    )
    .unwrap();
    let rest = &m.tool.routes[0];
    assert!(rest.matches("DELETE", "/tools/a/b/c"));
    assert!(rest.matches("POST", "/tools/"));
    assert!(!rest.matches("POST", "/other/a"));
    assert!(!rest.matches("POST", "tools/a"));
    let root = &m.tool.routes[1];
    assert!(root.matches("GET", "/"));
    assert!(root.matches("GET", "/?q=1"));
    assert!(!root.matches("GET", "/a"));
}

/// The route table matches a path in its one plain form only: any form
/// an upstream could read as another path is refused, with what is wrong;
/// the query is neither matched nor checked.
#[test]
fn only_a_plain_path_is_matched() {
    for plain in [
        "/",
        "/?q=%2F..//",
        "/v1/charges/ch_1/capture",
        "/v1/charges/ch_1/capture?expand=a/../b&x=%20",
        "/v1/a.b/~x-y_z/!$&'()*+,=:@",
        "/v1/...",
    ] {
        assert_eq!(
            mapping::plain_path(plain),
            Ok(plain.split('?').next().unwrap()),
            "{plain}"
        );
    }
    for (path, says) in [
        ("/v1/charges/abc/capture/", "ends in '/'"),
        ("/v1/charges//abc/capture", "an empty segment ('//')"),
        ("//v1/charges/abc/capture", "an empty segment ('//')"),
        ("/v1/charges/abc/./capture", "a \".\" segment"),
        ("/v1/charges/abc/x/../capture", "a \"..\" segment"),
        ("/v1/charges/abc/capture/.", "a \".\" segment"),
        ("/v1/charges/abc/%63apture", "percent-encoded"),
        ("/v1/charges/abc%2Fcapture", "percent-encoded"),
        ("/v1/charges/abc/%2e%2e/capture", "percent-encoded"),
        ("/v1/charges/abc/capture;x=1", "path parameter (';')"),
        ("/v1/charges/abc/..;/capture", "path parameter (';')"),
        ("/v1/charges/abc\\capture", "'\\\\', which is no character"),
        ("/v1/charges/abc/capture#x", "'#', which is no character"),
        ("/v1/charges/a b", "' ', which is no character"),
        ("/v1/charges/caf\u{e9}", "no character of a URI path"),
        ("v1/charges/abc/capture", "does not start with '/'"),
        ("*", "does not start with '/'"),
        ("", "does not start with '/'"),
    ] {
        let why = mapping::plain_path(path).expect_err(path);
        assert!(why.contains(says), "{path}: {why}");
        assert!(why.starts_with("the path \""), "{path}: {why}");
    }
}

/// A route template in a form no plain path has could never match: the
/// file is refused.
#[test]
fn a_template_that_is_not_a_plain_path_is_refused() {
    for (template, says) in [
        ("/v1/charges/", "ends in '/'"),
        ("/v1//charges", "empty segment"),
        ("/v1/./charges", "\".\" segment"),
        ("/v1/../charges/*", "\"..\" segment"),
        ("/v1/%63harges", "percent-encoded"),
        ("/v1/charges;v=2", "path parameter"),
        ("/v1\\\\charges", "no character of a URI path"),
    ] {
        let error = parse(&format!(
            "[[tool.route]]\npath = \"{template}\"\ntool = \"t\"\n"
        ))
        .expect_err(template);
        assert!(
            error.contains("tool.route[1].path") && error.contains(says),
            "{template}: {error}"
        );
    }
    for fine in ["/", "/*", "/v1/*", "/v1/{id}/x", "/v1/a.b"] {
        parse(&format!(
            "[[tool.route]]\npath = \"{fine}\"\ntool = \"t\"\n"
        ))
        .expect(fine);
    }
}

#[test]
fn every_bad_file_names_the_setting_and_what_is_wrong() {
    let cases = [
        ("nope = 1", "unknown field `nope`"),
        ("[permit]\nheadr = \"x\"", "unknown field `headr`"),
        ("[permit]\nfrom = \"cookie\"", "permit.from: \"cookie\""),
        (
            "[permit]\nheader = \"x\"\njwt-claim = \"p\"",
            "jwt-claim, jwt-payload and jwt-namespace are for from = \"jwt\"",
        ),
        ("[permit]\nfrom = \"jwt\"", "needs jwt-claim"),
        (
            "[permit]\nfrom = \"jwt\"\njwt-claim = \"a..b\"",
            "permit.jwt-claim: \"a..b\"",
        ),
        (
            "[permit]\nfrom = \"jwt\"\njwt-claim = \"p\"\nheader = \"x\"",
            "header is for from = \"header\"",
        ),
        (
            "[permit]\nheader = \"bad header\"",
            "permit.header: \"bad header\"",
        ),
        ("[key]\nheader = \":path\"", "key.header: \":path\""),
        (
            "[[tool.route]]\npath = \"/a\"\ntool = \"bad tool\"",
            "tool.route[1].tool: \"bad tool\"",
        ),
        (
            "[[tool.route]]\npath = \"a\"\ntool = \"t\"",
            "tool.route[1].path: \"a\" must start with '/'",
        ),
        (
            "[[tool.route]]\npath = \"/a?b=1\"\ntool = \"t\"",
            "without a query",
        ),
        (
            "[[tool.route]]\npath = \"/a/{x\"\ntool = \"t\"",
            "a segment is text, {name}, or a final *",
        ),
        (
            "[[tool.route]]\nmethod = \"P OST\"\npath = \"/a\"\ntool = \"t\"",
            "tool.route[1].method",
        ),
        (
            "[fingerprint]\nheader = \"x-fp\"",
            "fingerprint.header is for from = \"header\"",
        ),
        (
            "[fingerprint]\nfrom = \"body\"",
            "fingerprint.from: \"body\"",
        ),
        ("[cost]\ndefault = -1", "cost.default: -1"),
        (
            "[cost]\ntools = { \"t\" = 9007199254740992 }",
            "cost.tools.\"t\": 9007199254740992",
        ),
        ("[cost]\ntools = { \"b a d\" = 1 }", "cost.tools.\"b a d\""),
        ("[response]\nresult = \"all\"", "response.result: \"all\""),
        (
            "[response]\nfailed = [\"2xx\"]",
            "a 2xx status is a success",
        ),
        ("[response]\nfailed = [204]", "a 2xx status is a success"),
        ("[response]\nfailed = [600]", "600 is not an HTTP status"),
        ("[response]\nfailed = [\"4x\"]", "neither a status"),
        (
            "[response]\notherwise = \"retry\"",
            "response.otherwise: \"retry\"",
        ),
        ("[permit", "m.toml: line 1"),
    ];
    for (text, expected) in cases {
        let error = parse(text).expect_err(text);
        assert!(error.starts_with("m.toml: "), "{text}: {error}");
        assert!(error.contains(expected), "{text}: {error}");
    }
}

// === one request ===

fn headers(pairs: &[(&str, &str)]) -> Headers {
    Headers::new(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())),
    )
}

const PERMIT: &str = "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f5";

fn request<'a>(headers: &'a Headers, route_tool: Option<&'a str>) -> HttpRequest<'a> {
    HttpRequest {
        method: "POST",
        path: "/v1/charges?x=1",
        headers,
        body: b"{\"amount\":500}",
        route_tool,
        metadata: None,
    }
}

fn violations(result: Result<pb::AuthorizeRequest, Unmapped>) -> Vec<(String, String)> {
    match result {
        Err(Unmapped::Invalid(v)) => v.into_iter().map(|v| (v.field, v.description)).collect(),
        other => panic!("expected violations, got {other:?}"),
    }
}

#[test]
fn the_default_mapping_reads_each_source() {
    let h = headers(&[
        ("x-atmost-permit", PERMIT),
        ("Idempotency-Key", "\"charge-\\\"1\\\"\""),
    ]);
    let a = Mapping::default()
        .authorize_request(&request(&h, Some("wallet.charge")))
        .expect("mapped");
    assert_eq!(a.permit_id, PERMIT);
    assert_eq!(a.tool, "wallet.charge");
    assert_eq!(
        a.idempotency_key, "charge-\"1\"",
        "the IETF draft's sf-string, unescaped"
    );
    assert_eq!(
        a.request_fingerprint,
        Sha256::digest(b"POST\n/v1/charges?x=1\n{\"amount\":500}").to_vec()
    );
    assert_eq!(a.cost, 0);
    assert!(a.holder_token.is_empty());
    let bare = headers(&[("x-atmost-permit", PERMIT), ("idempotency-key", " k-1 ")]);
    let a = Mapping::default()
        .authorize_request(&request(&bare, Some("t")))
        .unwrap();
    assert_eq!(a.idempotency_key, "k-1", "a bare token, trimmed");
}

/// A key that opens a structured-field string must be one whole string:
/// two `Idempotency-Key` headers Envoy's `headers` map joined with a comma
/// are refused, never taken as one key.
#[test]
fn a_key_that_is_not_one_structured_field_string_is_refused() {
    for (value, says) in [
        ("\"a\",\"b\"", "two idempotency keys joined"),
        ("\"a\", \"b\"", "two idempotency keys joined"),
        ("\"abc", "closing quote"),
        ("\"a\";x=1", "parameters"),
        ("\"a\\x\"", "escape only"),
        ("\"caf\u{e9}\"", "printable ASCII"),
        ("\" x \"", "leading or trailing spaces"),
        ("\" \"", "leading or trailing spaces"),
    ] {
        let h = headers(&[("x-atmost-permit", PERMIT), ("idempotency-key", value)]);
        let found = violations(Mapping::default().authorize_request(&request(&h, Some("t"))));
        assert_eq!(found.len(), 1, "{value}: {found:?}");
        assert_eq!(found[0].0, "header idempotency-key", "{value}");
        assert!(found[0].1.contains(says), "{value}: {found:?}");
    }
    // A bare token with a comma is a key like any other (the Gate judges it).
    let h = headers(&[("x-atmost-permit", PERMIT), ("idempotency-key", "a,b")]);
    let a = Mapping::default()
        .authorize_request(&request(&h, Some("t")))
        .expect("mapped");
    assert_eq!(a.idempotency_key, "a,b");
}

#[test]
fn every_missing_source_is_reported_at_once() {
    let h = headers(&[]);
    let found = violations(Mapping::default().authorize_request(&request(&h, None)));
    let fields: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(
        fields,
        ["header x-atmost-permit", "header idempotency-key", "tool"]
    );
    assert!(found[2].1.contains("POST \"/v1/charges?x=1\""), "{found:?}");
}

#[test]
fn a_source_given_twice_is_refused() {
    let h = headers(&[
        ("x-atmost-permit", PERMIT),
        ("idempotency-key", "a"),
        ("idempotency-key", "b"),
    ]);
    let found = violations(Mapping::default().authorize_request(&request(&h, Some("t"))));
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].0, "header idempotency-key");
    assert!(found[0].1.contains("more than once"));
}

#[test]
fn the_tool_comes_from_the_route_then_the_table_then_a_header() {
    let m = parse(
        r#"
[tool]
header = "x-tool"
[[tool.route]]
method = "POST"
path = "/v1/charges"
tool = "from.table"
"#,
    )
    .unwrap();
    let h = headers(&[
        ("x-atmost-permit", PERMIT),
        ("idempotency-key", "k"),
        ("x-tool", "from.header"),
    ]);
    let tool = |route: Option<&str>, path: &str| {
        let mut r = request(&h, route);
        r.path = path;
        m.authorize_request(&r).unwrap().tool
    };
    assert_eq!(tool(Some("from.route"), "/v1/charges"), "from.route");
    assert_eq!(tool(None, "/v1/charges?q"), "from.table");
    assert_eq!(tool(None, "/elsewhere"), "from.header");
    // Without the header source, a client's header names nothing.
    let h2 = headers(&[
        ("x-atmost-permit", PERMIT),
        ("idempotency-key", "k"),
        ("x-atmost-tool", "chosen.by.client"),
    ]);
    let found = violations(Mapping::default().authorize_request(&request(&h2, None)));
    assert_eq!(found[0].0, "tool");
}

/// With a route table, a path that is not plain is refused before any
/// route is matched, whatever else the request lacks; a tool the route
/// names leaves the path to Envoy's routing, and without a table there is
/// nothing to steer.
#[test]
fn a_path_the_table_cannot_match_plainly_is_refused_first() {
    let m = parse(
        r#"
[[tool.route]]
method = "POST"
path = "/v1/charges/{id}/capture"
tool = "wallet.capture"
[[tool.route]]
path = "/v1/*"
tool = "wallet.read"
"#,
    )
    .unwrap();
    let h = headers(&[("x-atmost-permit", PERMIT), ("idempotency-key", "k")]);
    let with = |path: &'static str, route: Option<&'static str>, h: &Headers| {
        let mut r = request(h, route);
        r.path = path;
        m.authorize_request(&r)
    };
    assert_eq!(
        with("/v1/charges/abc/capture?x=1", None, &h).unwrap().tool,
        "wallet.capture"
    );
    assert_eq!(
        with("/v1/charges/abc", None, &h).unwrap().tool,
        "wallet.read"
    );
    match with("/v1/charges/abc/capture/", None, &headers(&[])) {
        Err(Unmapped::PathNotCanonical(why)) => assert!(why.contains("ends in '/'"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        with("/v1/charges/abc/capture/", Some("from.route"), &h)
            .unwrap()
            .tool,
        "from.route"
    );
    let found = violations(Mapping::default().authorize_request(&HttpRequest {
        path: "/v1//x/",
        ..request(&h, None)
    }));
    assert_eq!(found[0].0, "tool", "no table: no tool, and no path refusal");
}

#[test]
fn the_permit_comes_from_a_verified_jwt_claim_only() {
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    let m = parse("[permit]\nfrom = \"jwt\"\njwt-claim = \"atmost.permit\"\n").unwrap();
    let object = |fields: Vec<(&str, Value)>| Value {
        kind: Some(Kind::StructValue(Struct {
            fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        })),
    };
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    };
    let payload = object(vec![
        ("sub", string("agent-7")),
        ("atmost", object(vec![("permit", string(PERMIT))])),
    ]);
    let metadata = Metadata {
        filter_metadata: [(
            mapping::DEFAULT_JWT_NAMESPACE.to_owned(),
            Struct {
                fields: [("jwt_payload".to_owned(), payload)].into_iter().collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    };
    // The header is not a source when the permit comes from the JWT.
    let h = headers(&[("x-atmost-permit", "forged"), ("idempotency-key", "k")]);
    let mut r = request(&h, Some("t"));
    r.metadata = Some(&metadata);
    assert_eq!(m.authorize_request(&r).unwrap().permit_id, PERMIT);
    r.metadata = None;
    let found = violations(m.authorize_request(&r));
    assert_eq!(found[0].0, "jwt claim atmost.permit");
}

#[test]
fn a_header_fingerprint_and_costs() {
    let m = parse(
        r#"
[fingerprint]
from = "header"
[cost]
header = "x-cost"
default = 3
tools = { "priced" = 500 }
"#,
    )
    .unwrap();
    let with = |pairs: &[(&str, &str)], tool: &str| {
        let mut all = vec![("x-atmost-permit", PERMIT), ("idempotency-key", "k")];
        all.extend_from_slice(pairs);
        let h = headers(&all);
        m.authorize_request(&request(&h, Some(tool)))
    };
    let a = with(
        &[("x-atmost-fingerprint", "fp-1"), ("x-cost", "42")],
        "priced",
    )
    .unwrap();
    assert_eq!(a.request_fingerprint, b"fp-1");
    assert_eq!(a.cost, 42, "the header beats the tool's default");
    let a = with(&[("x-atmost-fingerprint", "fp-1")], "priced").unwrap();
    assert_eq!(a.cost, 500, "the tool's default");
    let a = with(&[("x-atmost-fingerprint", "fp-1")], "other").unwrap();
    assert_eq!(a.cost, 3, "the mapping's default");
    let found = violations(with(&[("x-cost", "5 EUR")], "priced"));
    let fields: Vec<&str> = found.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(fields, ["header x-atmost-fingerprint", "header x-cost"]);
    // A negative cost is the Gate's to refuse (its validation), not read
    // as anything else here.
    assert_eq!(
        with(&[("x-atmost-fingerprint", "f"), ("x-cost", "-5")], "t")
            .unwrap()
            .cost,
        -5
    );
}

// === the answers ===

/// One error of each reason.
fn error_of(reason: Reason) -> Error {
    let key = || "k".to_owned();
    match reason {
        Reason::PermitNotFound => Error::PermitNotFound {
            permit_id: PERMIT.into(),
        },
        Reason::PermitRevoked => Error::PermitRevoked {
            permit_id: PERMIT.into(),
        },
        Reason::PermitExpired => Error::PermitExpired {
            permit_id: PERMIT.into(),
            expired_at: 0,
        },
        Reason::ToolNotInScope => Error::ToolNotInScope { tool: "t".into() },
        Reason::MaxCallsExceeded => Error::MaxCallsExceeded {
            tool: "t".into(),
            limit: 1,
            calls_made: 1,
        },
        Reason::BudgetExceeded => Error::BudgetExceeded {
            budget: 1,
            committed: 1,
            reserved: 0,
            requested: 1,
        },
        Reason::KeyReused => Error::KeyReused {
            idempotency_key: key(),
        },
        Reason::ApproverIsRequester => Error::ApproverIsRequester {
            idempotency_key: key(),
        },
        Reason::InProgress => Error::InProgress {
            idempotency_key: key(),
            lease_expires_at: 0,
            retry_after_ms: 1_001,
        },
        Reason::DuplicateSuspected => Error::DuplicateSuspected {
            tool: "t".into(),
            earlier_key: key(),
        },
        Reason::AttemptNotFound => Error::AttemptNotFound {
            idempotency_key: key(),
        },
        Reason::AttemptHolderMismatch => Error::AttemptHolderMismatch {
            idempotency_key: key(),
        },
        Reason::AttemptMismatch => Error::AttemptMismatch {
            idempotency_key: key(),
        },
        Reason::StateConflict => Error::StateConflict {
            state: AttemptState::Succeeded,
        },
        Reason::InvalidRequest => Error::InvalidRequest(vec![Violation {
            field: "cost".into(),
            description: "must be within 0..=9007199254740991".into(),
        }]),
        Reason::StoreUnavailable => Error::StoreUnavailable("down".into()),
        Reason::Overloaded => Error::Overloaded { in_flight: 512 },
        Reason::DeadlineExceeded => Error::DeadlineExceeded,
        Reason::ToolHeld => Error::ToolHeld {
            tool: "t".into(),
            uncertain_key: key(),
        },
        Reason::Unauthenticated => Error::Unauthenticated { why: "no".into() },
        Reason::RoleNotAllowed => Error::RoleNotAllowed {
            key_id: "k".into(),
            rpc: "r".into(),
            allowed: "agent".into(),
        },
        Reason::QuotaPermitLifetime => quota(Quota::PermitLifetime),
        Reason::QuotaOpenAttempts => quota(Quota::OpenAttempts),
        Reason::QuotaAttempts => quota(Quota::Attempts),
        Reason::QuotaTenantPermits => quota(Quota::TenantPermits),
        Reason::QuotaStoreFull => quota(Quota::StoreFull),
        Reason::MessageTooLarge => Error::MessageTooLarge {
            limit: 131_072,
            size: 200_000,
        },
    }
}

fn quota(quota: Quota) -> Error {
    Error::QuotaExceeded { quota, limit: 1 }
}

/// A status for every reason, and the reply that carries it: a reason
/// added to the contract fails here until it has its status (and, through
/// [`the_answers_table_in_the_docs_is_what_the_code_answers`], its row in
/// docs/gateways.md).
#[test]
fn every_reason_has_its_http_status() {
    let expected = |reason: Reason| match reason {
        Reason::PermitNotFound
        | Reason::PermitRevoked
        | Reason::PermitExpired
        | Reason::ToolNotInScope
        | Reason::AttemptHolderMismatch
        | Reason::ApproverIsRequester => 403,
        Reason::MaxCallsExceeded | Reason::BudgetExceeded => 429,
        Reason::KeyReused => 422,
        Reason::InProgress => 409,
        Reason::InvalidRequest => 400,
        Reason::StoreUnavailable => 503,
        Reason::Overloaded => 503,
        Reason::DeadlineExceeded => 504,
        Reason::DuplicateSuspected | Reason::ToolHeld => 409,
        Reason::QuotaPermitLifetime
        | Reason::QuotaOpenAttempts
        | Reason::QuotaAttempts
        | Reason::QuotaTenantPermits
        | Reason::QuotaStoreFull => 429,
        Reason::AttemptNotFound | Reason::AttemptMismatch | Reason::StateConflict => 409,
        Reason::Unauthenticated => 401,
        Reason::RoleNotAllowed => 403,
        Reason::MessageTooLarge => 413,
    };
    for &reason in Reason::ALL {
        let error = error_of(reason);
        assert_eq!(error.reason(), reason);
        assert_eq!(http_status(&error), expected(reason), "{reason:?}");
        let reply = Reply::refusal(&error);
        assert_eq!(reply.status, expected(reason));
        assert_eq!(reply.reason, reason.as_str());
        assert!(
            reply
                .headers
                .contains(&(REASON_HEADER, reason.as_str().to_owned()))
        );
        let body: serde_json::Value = serde_json::from_slice(&reply.body).expect("JSON");
        assert_eq!(body["reason"], reason.as_str());
        if reason == Reason::StoreUnavailable {
            // The store's own words stay in the log.
            assert!(
                !body["message"].as_str().unwrap().contains("down"),
                "{body}"
            );
        } else {
            assert_eq!(body["message"], error.to_string());
        }
    }
}

/// The contract's reasons no answer of a front door carries, and why: the
/// others must each have their row in docs/gateways.md's Answers table.
const NOT_ANSWERED_OVER_HTTP: &[Reason] = &[
    // Commit's and MarkUncertain's, never Authorize's.
    Reason::AttemptNotFound,
    Reason::AttemptMismatch,
    Reason::AttemptHolderMismatch,
    Reason::StateConflict,
    // Approve's, never Authorize's.
    Reason::ApproverIsRequester,
    // The authentication layer refuses the gateway's gRPC call itself
    // (docs/gateways.md, "Authentication"): Envoy answers, not atmost.
    Reason::Unauthenticated,
    Reason::RoleNotAllowed,
    // The transport refuses the gateway's gRPC message itself, one past
    // --max-request-bytes (docs/gateways.md, "Answers"): Envoy answers.
    Reason::MessageTooLarge,
];

/// The rows of docs/gateways.md's "Answers" table, read from the file: each
/// reason a row names (in backticks, in its first or its
/// `x-atmost-reason` column, `QUOTA_*` standing for every quota), with the
/// row's HTTP status (`None`: forwarded).
fn documented_answers() -> Vec<(String, Option<u16>)> {
    let docs = include_str!("../../../docs/gateways.md");
    let section = docs
        .split("\n## Answers\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/gateways.md has its Answers section");
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 4, "an Answers row has 4 cells: {line}");
        if cells[0] == "atmost's answer" || cells[0].starts_with("---") {
            continue;
        }
        let status = match cells[1] {
            "forwarded" => None,
            text => Some(
                text.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|digits| digits.parse::<u16>().ok())
                    .unwrap_or_else(|| panic!("no HTTP status in {line}")),
            ),
        };
        let named: Vec<&str> = [cells[0], cells[2]]
            .iter()
            .flat_map(|cell| cell.split('`').skip(1).step_by(2))
            .filter(|name| {
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b == b'_' || b == b'*')
            })
            .collect();
        if status.is_none() {
            rows.push((cells[0].to_owned(), None));
        }
        for name in named {
            match name.strip_suffix('*') {
                Some(prefix) => {
                    let quotas: Vec<_> = Reason::ALL
                        .iter()
                        .filter(|r| r.as_str().starts_with(prefix))
                        .collect();
                    assert!(!quotas.is_empty(), "{name} names no reason: {line}");
                    rows.extend(quotas.iter().map(|r| (r.as_str().to_owned(), status)));
                }
                None => rows.push((name.to_owned(), status)),
            }
        }
    }
    rows
}

/// What the code answers for `name`: a contract reason's refusal, a
/// replay, or the front doors' own GATEWAY_MISCONFIGURED; `None` for a
/// name the code does not know.
fn answered_status(name: &str) -> Option<u16> {
    if let Some(&reason) = Reason::ALL.iter().find(|r| r.as_str() == name) {
        let error = error_of(reason);
        assert_eq!(Reply::refusal(&error).status, http_status(&error));
        return Some(http_status(&error));
    }
    let replay = |state: pb::AttemptState| {
        let mut attempt = pb::Attempt {
            attempt_id: "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f6".into(),
            ..Default::default()
        };
        attempt.set_state(state);
        let reply = Reply::replay(attempt);
        assert_eq!(reply.reason, name);
        Some(reply.status)
    };
    match name {
        reasons::REPLAY_SUCCEEDED => replay(pb::AttemptState::Succeeded),
        reasons::REPLAY_FAILED => replay(pb::AttemptState::Failed),
        reasons::REPLAY_UNCERTAIN => replay(pb::AttemptState::Uncertain),
        reasons::REPLAY_DENIED => replay(pb::AttemptState::Denied),
        reasons::AWAITING_APPROVAL => {
            let answer = Answer::of(Ok(pb::AuthorizeResponse {
                decision: pb::Decision::AwaitApproval as i32,
                attempt: Some(pb::Attempt::default()),
                approval_remaining: Some(prost_types::Duration {
                    seconds: 600,
                    nanos: 0,
                }),
                ..Default::default()
            }));
            let Answer::Respond(reply) = answer else {
                panic!("a call awaiting approval is never forwarded: {answer:?}");
            };
            assert_eq!(reply.reason, name);
            let retry = reply.headers.iter().find(|(h, _)| *h == "retry-after");
            assert_eq!(retry.map(|(_, v)| v.as_str()), Some("10"), "{reply:?}");
            Some(reply.status)
        }
        reasons::GATEWAY_MISCONFIGURED => {
            Some(Reply::unmapped(Unmapped::Misconfigured("no body".into())).status)
        }
        reasons::PATH_NOT_CANONICAL => {
            let reply = Reply::unmapped(Unmapped::PathNotCanonical("ends in '/'".into()));
            assert_eq!(reply.reason, name);
            Some(reply.status)
        }
        _ => None,
    }
}

/// docs/gateways.md's Answers table, read from the file, against the
/// code, both ways: every reason a row names is one the code answers,
/// with the row's status; every reason the code answers has its one row;
/// DISPATCH is forwarded.
#[test]
fn the_answers_table_in_the_docs_is_what_the_code_answers() {
    let rows = documented_answers();
    let mut seen = std::collections::BTreeSet::new();
    for (name, status) in &rows {
        let Some(status) = status else {
            assert_eq!(name, "DISPATCH", "only DISPATCH is forwarded");
            let dispatch = Answer::of(Ok(pb::AuthorizeResponse {
                decision: pb::Decision::Dispatch as i32,
                attempt: Some(pb::Attempt::default()),
                ..Default::default()
            }));
            assert!(matches!(dispatch, Answer::Forward(_)), "{dispatch:?}");
            continue;
        };
        assert!(seen.insert(name.clone()), "{name} has two rows");
        let code = answered_status(name)
            .unwrap_or_else(|| panic!("the docs name {name}, which the code never answers"));
        assert_eq!(
            code, *status,
            "docs/gateways.md answers {name} with {status}, the code with {code}"
        );
    }
    assert!(
        rows.iter()
            .any(|(name, status)| name == "DISPATCH" && status.is_none()),
        "the DISPATCH row"
    );
    let answered = Reason::ALL
        .iter()
        .filter(|r| !NOT_ANSWERED_OVER_HTTP.contains(r))
        .map(|r| r.as_str())
        .chain([
            reasons::REPLAY_SUCCEEDED,
            reasons::REPLAY_FAILED,
            reasons::REPLAY_UNCERTAIN,
            reasons::REPLAY_DENIED,
            reasons::AWAITING_APPROVAL,
            reasons::GATEWAY_MISCONFIGURED,
            reasons::PATH_NOT_CANONICAL,
        ]);
    for name in answered {
        assert!(
            seen.contains(name),
            "{name} has no row in docs/gateways.md's Answers"
        );
    }
}

/// A replay carries the attempt's id (header and body) only for a settled
/// attempt: an open one's id is its fencing token, for the gateway's side
/// only.
#[test]
fn a_replay_names_the_attempt_only_once_it_is_settled() {
    let id = "0190f3c2-7a1b-7c3d-8e4f-a0b1c2d3e4f6";
    let replay = |state: pb::AttemptState| {
        let mut attempt = pb::Attempt {
            attempt_id: id.into(),
            ..Default::default()
        };
        attempt.set_state(state);
        let reply = Reply::replay(attempt);
        let header = reply
            .headers
            .iter()
            .find(|(k, _)| *k == ATTEMPT_HEADER)
            .map(|(_, v)| v.clone());
        (header, String::from_utf8_lossy(&reply.body).contains(id))
    };
    assert_eq!(replay(pb::AttemptState::Succeeded).0.as_deref(), Some(id));
    assert_eq!(
        replay(pb::AttemptState::Failed),
        (Some(id.to_owned()), true)
    );
    for open in [
        pb::AttemptState::Uncertain,
        pb::AttemptState::Reserved,
        pb::AttemptState::Unspecified,
    ] {
        assert_eq!(replay(open), (None, false), "{open:?}");
    }
}

#[test]
fn a_refusal_carries_the_errorinfo_metadata_and_retry_after() {
    let reply = Reply::refusal(&error_of(Reason::MaxCallsExceeded));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(
        body["metadata"],
        serde_json::json!({"tool": "t", "limit": "1", "calls_made": "1"})
    );
    assert!(!reply.headers.iter().any(|(k, _)| *k == "retry-after"));
    let reply = Reply::refusal(&error_of(Reason::InProgress));
    assert!(
        reply.headers.contains(&("retry-after", "2".to_owned())),
        "1001 ms, rounded up: {:?}",
        reply.headers
    );
    let reply = Reply::refusal(&error_of(Reason::InvalidRequest));
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["violations"][0]["field"], "cost");
    let reply = Reply::unmapped(Unmapped::Misconfigured("no body".into()));
    assert_eq!(reply.status, 500);
    assert_eq!(reply.reason, reasons::GATEWAY_MISCONFIGURED);
}

// === the descriptors reflection serves ===

/// Every field set in `message` is one the descriptor knows, however deep.
fn no_unknown_fields(message: &prost_reflect::DynamicMessage, at: &str) {
    use prost_reflect::Value as V;
    assert_eq!(
        message.unknown_fields().count(),
        0,
        "{at}: fields the vendored descriptor does not know"
    );
    for (field, value) in message.fields() {
        let at = format!("{at}.{}", field.name());
        match value {
            V::Message(m) => no_unknown_fields(m, &at),
            V::List(items) => items.iter().for_each(|v| {
                if let V::Message(m) = v {
                    no_unknown_fields(m, &at)
                }
            }),
            V::Map(entries) => entries.values().for_each(|v| {
                if let V::Message(m) = v {
                    no_unknown_fields(m, &at)
                }
            }),
            _ => {}
        }
    }
}

#[test]
fn the_vendored_descriptors_describe_the_messages_served() {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
    use envoy_types::pb::envoy::service::auth::v3 as authz;
    use envoy_types::pb::envoy::service::ext_proc::v3 as proc_;
    use prost::Message as _;
    let pool = prost_reflect::DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("descriptors");
    for (service, method) in [(EXT_AUTHZ_SERVICE, "Check"), (EXT_PROC_SERVICE, "Process")] {
        let s = pool.get_service_by_name(service).expect(service);
        assert!(
            s.methods().any(|m| m.name() == method),
            "{service}/{method}"
        );
    }
    let check = |name: &str, bytes: Vec<u8>| {
        let desc = pool.get_message_by_name(name).expect(name);
        let decoded = prost_reflect::DynamicMessage::decode(desc, bytes.as_slice()).expect(name);
        no_unknown_fields(&decoded, name);
    };
    let header = HeaderValue {
        key: "k".into(),
        value: "v".into(),
        raw_value: b"v".to_vec(),
    };
    let metadata = envoy_types::pb::envoy::config::core::v3::Metadata {
        filter_metadata: [(mapping::DEFAULT_JWT_NAMESPACE.to_owned(), Struct::default())]
            .into_iter()
            .collect(),
        ..Default::default()
    };
    let request = authz::CheckRequest {
        attributes: Some(authz::AttributeContext {
            request: Some(authz::attribute_context::Request {
                http: Some(authz::attribute_context::HttpRequest {
                    id: "id".into(),
                    method: "POST".into(),
                    headers: [("a".to_owned(), "b".to_owned())].into_iter().collect(),
                    header_map: Some(HeaderMap {
                        headers: vec![header.clone()],
                    }),
                    path: "/p".into(),
                    host: "h".into(),
                    size: 3,
                    body: "abc".into(),
                    raw_body: b"abc".to_vec(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            context_extensions: [("atmost.tool".to_owned(), "t".to_owned())]
                .into_iter()
                .collect(),
            metadata_context: Some(metadata.clone()),
            ..Default::default()
        }),
    };
    check(
        "envoy.service.auth.v3.CheckRequest",
        request.encode_to_vec(),
    );
    let attempt = pb::Attempt {
        attempt_id: "a".into(),
        ..Default::default()
    };
    for answer in [
        Answer::Forward(Box::new(attempt.clone())),
        Answer::Respond(Reply::refusal(&error_of(Reason::InProgress))),
    ] {
        let response = ext_authz::check_response(answer);
        check(
            "envoy.service.auth.v3.CheckResponse",
            response.encode_to_vec(),
        );
    }
    let processing = proc_::ProcessingRequest {
        request: Some(proc_::processing_request::Request::RequestHeaders(
            proc_::HttpHeaders {
                headers: Some(HeaderMap {
                    headers: vec![header],
                }),
                end_of_stream: true,
                ..Default::default()
            },
        )),
        metadata_context: Some(metadata),
        observability_mode: false,
        protocol_config: Some(proc_::ProtocolConfiguration {
            request_body_mode: 2,
            response_body_mode: 2,
            send_body_without_waiting_for_header_response: true,
        }),
        ..Default::default()
    };
    check(
        "envoy.service.ext_proc.v3.ProcessingRequest",
        processing.encode_to_vec(),
    );
    for response in ext_proc::every_response(&attempt) {
        check(
            "envoy.service.ext_proc.v3.ProcessingResponse",
            response.encode_to_vec(),
        );
    }
}
