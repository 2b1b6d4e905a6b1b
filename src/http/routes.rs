//! The route table: each RPC's `google.api.http` option, read from the
//! contract's descriptors at start-up. Nothing else defines a path.
//!
//! A template is literal segments and `{field}` variables, each one whole
//! segment, with an optional `:verb` after the last (AIP-136). A variable
//! matches one segment, percent-decoded (an idempotency key with a `/` is
//! sent as `%2F`); the verb is what follows the last `:` of the last
//! segment, so a key may itself contain `:`.

use http::Method;
use prost_reflect::{DescriptorPool, FieldDescriptor, Kind, MethodDescriptor, Value};

/// Where a request's JSON body goes.
#[derive(Debug, Clone)]
pub enum BodyField {
    /// No body: every field is in the path or the query (`GET`).
    None,
    /// The whole request message (`body: "*"`).
    All,
    /// One message field of the request (`body: "permit"`).
    Field(FieldDescriptor),
}

#[derive(Debug, Clone)]
enum Segment {
    Literal(String),
    Field(FieldDescriptor),
}

/// One binding of an RPC to an HTTP method and path.
#[derive(Debug, Clone)]
pub struct Route {
    pub http_method: Method,
    /// The template as the proto writes it: `/v1/permits/{permit_id}`.
    pub template: String,
    pub body: BodyField,
    /// The RPC.
    pub rpc: MethodDescriptor,
    /// The RPC's gRPC path: `/atmost.v1.Gate/Authorize`.
    pub grpc_path: String,
    segments: Vec<Segment>,
    verb: Option<String>,
}

/// A matched request: its route and its path variables, each decoded (or
/// why it could not be).
#[derive(Debug)]
pub struct Matched<'a> {
    pub route: &'a Route,
    pub vars: Vec<(FieldDescriptor, Result<String, String>)>,
}

/// Why no route matched.
#[derive(Debug, PartialEq, Eq)]
pub enum Miss {
    /// No template matches the path.
    Path,
    /// Templates match the path, with these methods only.
    Method(Vec<Method>),
}

#[derive(Debug, Clone, Default)]
pub struct Routes {
    routes: Vec<Route>,
}

impl Routes {
    /// Every RPC of the services of `package` in `pool`, by its
    /// `google.api.http` option and its additional bindings. An RPC
    /// without one, or a template this edge cannot serve, is an error: the
    /// contract is checked when the server starts (and by a unit test).
    pub fn of_package(pool: &DescriptorPool, package: &str) -> Result<Self, String> {
        let http = pool
            .get_extension_by_name("google.api.http")
            .ok_or("google.api.http is not in the descriptor pool")?;
        let mut routes = Vec::new();
        for service in pool.services().filter(|s| s.package_name() == package) {
            for rpc in service.methods() {
                let options = rpc.options();
                if !options.has_extension(&http) {
                    return Err(format!("{} has no google.api.http option", rpc.full_name()));
                }
                let Value::Message(rule) = options.get_extension(&http).into_owned() else {
                    return Err(format!(
                        "{}: google.api.http is not a message",
                        rpc.full_name()
                    ));
                };
                let mut rules = vec![rule.clone()];
                if let Some(Value::List(more)) = rule
                    .get_field_by_name("additional_bindings")
                    .map(|v| v.into_owned())
                {
                    rules.extend(more.into_iter().filter_map(|v| match v {
                        Value::Message(m) => Some(m),
                        _ => None,
                    }));
                }
                for rule in rules {
                    routes.push(
                        Route::of(&rpc, &rule).map_err(|e| format!("{}: {e}", rpc.full_name()))?,
                    );
                }
            }
        }
        if routes.is_empty() {
            return Err(format!("no RPC of {package} in the descriptor pool"));
        }
        Ok(Self { routes })
    }

    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    /// The route of `method` on `path` (without its query).
    pub fn find(&self, method: &Method, path: &str) -> Result<Matched<'_>, Miss> {
        let mut allowed = Vec::new();
        for route in &self.routes {
            if let Some(vars) = route.matches(path) {
                if route.http_method == *method {
                    return Ok(Matched { route, vars });
                }
                if !allowed.contains(&route.http_method) {
                    allowed.push(route.http_method.clone());
                }
            }
        }
        if allowed.is_empty() {
            Err(Miss::Path)
        } else {
            Err(Miss::Method(allowed))
        }
    }
}

impl Route {
    /// The fields the path's variables set, in the template's order.
    pub fn path_fields(&self) -> impl Iterator<Item = &FieldDescriptor> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Field(f) => Some(f),
            Segment::Literal(_) => None,
        })
    }

    fn of(rpc: &MethodDescriptor, rule: &prost_reflect::DynamicMessage) -> Result<Self, String> {
        let text = |name: &str| match rule.get_field_by_name(name).as_deref() {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            _ => None,
        };
        let (http_method, template) = [
            (Method::GET, "get"),
            (Method::POST, "post"),
            (Method::PUT, "put"),
            (Method::DELETE, "delete"),
            (Method::PATCH, "patch"),
        ]
        .into_iter()
        .find_map(|(m, name)| text(name).map(|t| (m, t)))
        .ok_or("a rule without a get, post, put, delete or patch pattern")?;
        let input = rpc.input();
        let body = match text("body").as_deref() {
            None => BodyField::None,
            Some("*") => BodyField::All,
            Some(name) => {
                let field = input
                    .get_field_by_name(name)
                    .ok_or_else(|| format!("body names {name}, not a field of the request"))?;
                if !matches!(field.kind(), Kind::Message(_)) || field.is_list() {
                    return Err(format!("body names {name}, which is not a message field"));
                }
                BodyField::Field(field)
            }
        };
        let rest = template
            .strip_prefix('/')
            .ok_or_else(|| format!("{template}: a template starts with /"))?;
        let (rest, verb) = match rest.rsplit_once(':') {
            // A `:` inside a variable's braces is not a verb.
            Some((path, verb)) if !verb.contains('}') => (path, Some(verb.to_owned())),
            _ => (rest, None),
        };
        let mut segments = Vec::new();
        for segment in rest.split('/') {
            if let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                let field = input
                    .get_field_by_name(name)
                    .filter(|f| f.kind() == Kind::String && !f.is_list())
                    .ok_or_else(|| format!("{template}: {{{name}}} is not a string field of the request (only {{field}} variables are served)"))?;
                segments.push(Segment::Field(field));
            } else if segment.is_empty() || segment.contains(['{', '}', '*', '=']) {
                return Err(format!(
                    "{template}: segment {segment:?} is not served (only literals and {{field}} variables)"
                ));
            } else {
                segments.push(Segment::Literal(segment.to_owned()));
            }
        }
        Ok(Self {
            http_method,
            body,
            grpc_path: format!("/{}/{}", rpc.parent_service().full_name(), rpc.name()),
            rpc: rpc.clone(),
            template,
            segments,
            verb,
        })
    }

    /// The path's variables, if it matches this template.
    fn matches(&self, path: &str) -> Option<Vec<(FieldDescriptor, Result<String, String>)>> {
        let mut rest = path.strip_prefix('/')?;
        if let Some(verb) = &self.verb {
            rest = rest.strip_suffix(verb.as_str())?.strip_suffix(':')?;
        }
        let mut vars = Vec::new();
        let mut parts = rest.split('/');
        for segment in &self.segments {
            let part = parts.next()?;
            match segment {
                Segment::Literal(literal) => {
                    if part != literal {
                        return None;
                    }
                }
                // An empty segment names no resource.
                Segment::Field(_) if part.is_empty() => return None,
                Segment::Field(field) => {
                    let value = percent_encoding::percent_decode_str(part)
                        .decode_utf8()
                        .map(|s| s.into_owned())
                        .map_err(|_| "is not UTF-8 once percent-decoded".to_owned());
                    vars.push((field.clone(), value));
                }
            }
        }
        parts.next().is_none().then_some(vars)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes() -> Routes {
        Routes::of_package(&super::super::pool(), "atmost.v1").expect("the contract's routes")
    }

    fn found(method: Method, path: &str) -> (String, Vec<(String, String)>) {
        let routes = routes();
        let m = routes.find(&method, path).expect(path);
        (
            m.route.grpc_path.clone(),
            m.vars
                .into_iter()
                .map(|(f, v)| (f.name().to_owned(), v.expect("decoded")))
                .collect(),
        )
    }

    #[test]
    fn every_rpc_of_the_contract_has_a_route() {
        let pool = super::super::pool();
        let routes = routes();
        for service in pool.services().filter(|s| s.package_name() == "atmost.v1") {
            for rpc in service.methods() {
                assert!(
                    routes.iter().any(|r| r.rpc.full_name() == rpc.full_name()),
                    "{} has no route",
                    rpc.full_name()
                );
            }
        }
    }

    #[test]
    fn paths_match_their_rpc_with_the_variables_decoded() {
        assert_eq!(
            found(Method::POST, "/v1/permits/p1/attempts:authorize"),
            (
                "/atmost.v1.Gate/Authorize".into(),
                vec![("permit_id".into(), "p1".into())]
            )
        );
        // A key with `/` and `:` in it: encoded, and the verb is the last `:`.
        assert_eq!(
            found(Method::POST, "/v1/permits/p1/attempts/order%2F7:a:commit"),
            (
                "/atmost.v1.Gate/Commit".into(),
                vec![
                    ("permit_id".into(), "p1".into()),
                    ("idempotency_key".into(), "order/7:a".into())
                ]
            )
        );
        assert_eq!(
            found(Method::GET, "/v1/permits/p1/attempts/k%20x").1[1].1,
            "k x"
        );
        assert_eq!(
            found(Method::GET, "/v1/uncertain").0,
            "/atmost.v1.Permits/ListUncertain"
        );
        assert_eq!(
            found(Method::GET, "/v1/permits/p1/uncertain"),
            (
                "/atmost.v1.Permits/ListUncertain".into(),
                vec![("permit_id".into(), "p1".into())]
            )
        );
        assert_eq!(
            found(Method::POST, "/v1/permits").0,
            "/atmost.v1.Permits/CreatePermit"
        );
    }

    #[test]
    fn a_path_no_rpc_has_or_a_wrong_method_is_told_apart() {
        let routes = routes();
        for path in [
            "/",
            "/v1",
            "/v1/permits/",
            "/v1/permits/p1/attempts",
            "/v2/permits",
            "v1/permits",
        ] {
            assert_eq!(
                routes.find(&Method::GET, path).unwrap_err(),
                Miss::Path,
                "{path}"
            );
        }
        assert_eq!(
            routes.find(&Method::DELETE, "/v1/permits").unwrap_err(),
            Miss::Method(vec![Method::POST])
        );
        assert_eq!(
            routes
                .find(&Method::GET, "/v1/permits/p1/attempts:authorize")
                .unwrap_err(),
            Miss::Method(vec![Method::POST]),
            "no GET has that shape"
        );
        let bad = routes
            .find(&Method::GET, "/v1/permits/%FF")
            .expect("matched, its variable undecodable");
        assert!(bad.vars[0].1.is_err());
    }
}
