//! The OpenAPI 3.1 document of the HTTP/JSON edge, made at start-up from
//! what the edge itself serves: the routes ([`super::routes`]) and the
//! contract's descriptors, their comments as descriptions. Nothing in it is
//! written by hand but the error body, which is the edge's own
//! ([`super::error`]). Served at `GET /v1/openapi.json`.
//!
//! Schemas follow the proto3 JSON mapping as the edge reads and writes it:
//! lowerCamelCase names, enums by name, 64-bit integers as strings (or
//! numbers, on input), bytes in base64, Timestamp in RFC 3339, Duration as
//! `"1.5s"`. Nothing is `required`: proto3 JSON leaves out a field at its
//! default, and the service's own validation says what a request lacks.
//! Objects name their lowerCamelCase properties and allow more (the edge
//! reads the proto's names too); a oneof's fields exclude each other.

use super::routes::{BodyField, Route, Routes};
use prost_reflect::{EnumDescriptor, FieldDescriptor, FileDescriptor, Kind, MessageDescriptor};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// Where the document is served (a `GET`).
pub const PATH: &str = "/v1/openapi.json";

/// The document, as JSON text.
pub fn document(routes: &Routes) -> Vec<u8> {
    let mut schemas = Schemas::default();
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    let mut ids: BTreeMap<String, usize> = BTreeMap::new();
    for route in routes.iter() {
        // One id per operation: an RPC's additional bindings are numbered.
        let rpc = format!("{}_{}", route.rpc.parent_service().name(), route.rpc.name());
        let n = ids.entry(rpc.clone()).or_default();
        *n += 1;
        let id = match *n {
            1 => rpc,
            n => format!("{rpc}_{n}"),
        };
        let operation = operation(route, id, &mut schemas);
        paths
            .entry(route.template.clone())
            .or_default()
            .insert(route.http_method.as_str().to_ascii_lowercase(), operation);
    }
    let mut components = schemas.done();
    components.insert("Error".into(), error_schema());
    let document = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "atmost",
            "version": env!("CARGO_PKG_VERSION"),
            "summary": "A permit and receipt boundary in front of side-effecting tool calls: at most N dispatches per tool per permit.",
            "description": "The HTTP/JSON edge of atmost.v1: each operation is the gRPC RPC its operationId names, with the same decisions, errors, roles and tenants (docs/api.md, \"HTTP/JSON\"). Made from the protos' google.api.http options.",
            "license": {"name": "see the repository"},
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key of --auth-keys. Without --auth-keys (dev mode, loopback only) none is needed.",
                },
            },
        },
        "security": [{"apiKey": []}],
    });
    serde_json::to_vec_pretty(&document).expect("a JSON value serializes")
}

fn operation(route: &Route, id: String, schemas: &mut Schemas) -> Value {
    let rpc = &route.rpc;
    let service = rpc.parent_service();
    let input = rpc.input();
    let mut parameters = Vec::new();
    let in_path: Vec<&FieldDescriptor> = route.path_fields().collect();
    for field in &in_path {
        parameters.push(json!({
            "name": field.name(),
            "in": "path",
            "required": true,
            "description": comment(&field.parent_file(), field.path()),
            "schema": schemas.field(field),
        }));
    }
    // What the body does not hold may come in the query: scalars only.
    if !matches!(route.body, BodyField::All) {
        for field in input.fields() {
            let in_body = matches!(&route.body, BodyField::Field(b) if *b == field);
            // As the edge reads a query (body::scalar): no bytes or floats.
            if in_path.contains(&&field)
                || in_body
                || field.is_list()
                || field.is_map()
                || matches!(
                    field.kind(),
                    Kind::Message(_) | Kind::Bytes | Kind::Float | Kind::Double
                )
            {
                continue;
            }
            parameters.push(json!({
                "name": field.json_name(),
                "in": "query",
                "description": comment(&field.parent_file(), field.path()),
                "schema": schemas.field(&field),
            }));
        }
    }
    if input.get_field_by_name("idempotency_key").is_some() {
        parameters.push(json!({
            "name": "Idempotency-Key",
            "in": "header",
            "description": "The idempotency key as the IETF httpapi draft sends it: a structured-field string (\"k-1\") or the bare key. One that contradicts the path or the body is refused.",
            "schema": {"type": "string"},
        }));
    }
    let mut op = json!({
        "operationId": id,
        "tags": [service.name()],
        "summary": summary(&comment(&rpc.parent_file(), rpc.path())),
        "description": format!("{}\n\ngRPC: `{}`", comment(&rpc.parent_file(), rpc.path()), route.grpc_path),
        "parameters": parameters,
        "responses": {
            "200": {
                "description": format!("The {}.", rpc.output().name()),
                "content": {"application/json": {"schema": schemas.message(&rpc.output())}},
            },
            "default": {
                "description": "A refusal or a failure: google.rpc.Status as JSON (AIP-193), the HTTP status from the gRPC code.",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            },
        },
    });
    // An RPC every caller may call (the receipt keys) needs no key.
    if crate::auth::allowed_roles(&route.grpc_path).is_none() {
        op["security"] = json!([]);
    }
    let body = match &route.body {
        BodyField::None => None,
        BodyField::All => Some(schemas.message(&input)),
        BodyField::Field(field) => Some(schemas.field(field)),
    };
    if let Some(schema) = body {
        op["requestBody"] = json!({
            "required": true,
            "content": {"application/json": {"schema": schema}},
        });
    }
    op
}

/// The error body the edge writes (super::error::respond).
fn error_schema() -> Value {
    json!({
        "type": "object",
        "description": "google.rpc.Status in JSON (AIP-193).",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "code": {"type": "integer", "description": "The HTTP status."},
                    "message": {"type": "string"},
                    "status": {"type": "string", "description": "The gRPC code's name (NOT_FOUND)."},
                    "details": {
                        "type": "array",
                        "description": "ErrorInfo (the reason, as over gRPC), RetryInfo, BadRequest, in proto3 JSON with their @type.",
                        "items": {
                            "type": "object",
                            "properties": {"@type": {"type": "string"}},
                            "required": ["@type"],
                            "additionalProperties": true,
                        },
                    },
                },
                "required": ["code", "message", "status", "details"],
            },
        },
        "required": ["error"],
    })
}

/// The first sentence of a description.
fn summary(description: &str) -> String {
    let flat = description.split_whitespace().collect::<Vec<_>>().join(" ");
    match flat.find(". ") {
        Some(end) => flat[..=end].to_owned(),
        None => flat,
    }
}

/// The leading comment of the element at `path` in `file`, trimmed.
fn comment(file: &FileDescriptor, path: &[i32]) -> String {
    file.file_descriptor_proto()
        .source_code_info
        .as_ref()
        .and_then(|info| info.location.iter().find(|l| l.path == path))
        .and_then(|l| l.leading_comments.as_deref())
        .map(|c| {
            c.lines()
                .map(str::trim)
                .collect::<Vec<_>>()
                .join("\n")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

/// The message and enum schemas referred to, by full name.
#[derive(Default)]
struct Schemas {
    done: BTreeMap<String, Value>,
}

impl Schemas {
    fn done(self) -> Map<String, Value> {
        self.done.into_iter().collect()
    }

    /// A reference to `message`'s schema (made once), or its JSON form
    /// for a well-known type.
    fn message(&mut self, message: &MessageDescriptor) -> Value {
        match message.full_name() {
            "google.protobuf.Timestamp" => {
                return json!({"type": "string", "format": "date-time"});
            }
            "google.protobuf.Duration" => {
                return json!({"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]{1,9})?s$"});
            }
            _ => {}
        }
        let name = message.full_name().to_owned();
        if !self.done.contains_key(&name) {
            // Placed first, so a message that refers to itself ends.
            self.done.insert(name.clone(), Value::Null);
            let mut properties = Map::new();
            for field in message.fields() {
                let mut schema = self.field(&field);
                let mut description = comment(&field.parent_file(), field.path());
                if let Some(oneof) = field.containing_oneof().filter(|o| !o.is_synthetic()) {
                    let note = format!(
                        "One of `{}`: at most one of its fields is set.",
                        oneof.name()
                    );
                    description = if description.is_empty() {
                        note
                    } else {
                        format!("{description}\n\n{note}")
                    };
                }
                if !description.is_empty() {
                    schema = with_description(schema, description);
                }
                properties.insert(field.json_name().to_owned(), schema);
            }
            // Open to more: the edge also reads the proto's own field
            // names, and a later version may answer more fields.
            let mut schema = json!({
                "type": "object",
                "properties": properties,
            });
            // A oneof: at most one of its fields (each pair excluded).
            let mut exclusive = Vec::new();
            for oneof in message.oneofs().filter(|o| !o.is_synthetic()) {
                // Each field by either name the edge reads.
                let fields: Vec<Vec<String>> = oneof
                    .fields()
                    .map(|f| {
                        let mut names = vec![f.json_name().to_owned()];
                        if f.name() != f.json_name() {
                            names.push(f.name().to_owned());
                        }
                        names
                    })
                    .collect();
                for (i, a) in fields.iter().enumerate() {
                    for b in &fields[i + 1..] {
                        for x in a {
                            for y in b {
                                exclusive.push(json!({"not": {"required": [x, y]}}));
                            }
                        }
                    }
                }
            }
            if !exclusive.is_empty() {
                schema["allOf"] = Value::Array(exclusive);
            }
            let description = comment(&message.parent_file(), message.path());
            if !description.is_empty() {
                schema["description"] = Value::String(description);
            }
            self.done.insert(name.clone(), schema);
        }
        json!({"$ref": format!("#/components/schemas/{name}")})
    }

    fn field(&mut self, field: &FieldDescriptor) -> Value {
        if field.is_map() {
            let Kind::Message(entry) = field.kind() else {
                unreachable!("a map field's kind is its entry message")
            };
            let value = entry.map_entry_value_field();
            return json!({"type": "object", "additionalProperties": self.kind(&value.kind())});
        }
        let one = self.kind(&field.kind());
        match field.is_list() {
            true => json!({"type": "array", "items": one}),
            false => one,
        }
    }

    fn kind(&mut self, kind: &Kind) -> Value {
        match kind {
            Kind::Double | Kind::Float => json!({"type": "number"}),
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
                json!({"type": "integer", "format": "int32"})
            }
            Kind::Uint32 | Kind::Fixed32 => {
                json!({"type": "integer", "format": "uint32", "minimum": 0})
            }
            // A string on output; a string or a number on input.
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
                json!({"type": ["string", "integer"], "format": "int64", "pattern": "^-?[0-9]+$"})
            }
            Kind::Uint64 | Kind::Fixed64 => {
                json!({"type": ["string", "integer"], "format": "uint64", "pattern": "^[0-9]+$", "minimum": 0})
            }
            Kind::Bool => json!({"type": "boolean"}),
            Kind::String => json!({"type": "string"}),
            Kind::Bytes => json!({"type": "string", "contentEncoding": "base64"}),
            Kind::Enum(e) => self.enumeration(e),
            Kind::Message(m) => self.message(m),
        }
    }

    fn enumeration(&mut self, e: &EnumDescriptor) -> Value {
        let name = e.full_name().to_owned();
        if !self.done.contains_key(&name) {
            let names: Vec<String> = e.values().map(|v| v.name().to_owned()).collect();
            let mut schema = json!({"type": "string", "enum": names});
            let description = comment(&e.parent_file(), e.path());
            if !description.is_empty() {
                schema["description"] = Value::String(description);
            }
            self.done.insert(name.clone(), schema);
        }
        json!({"$ref": format!("#/components/schemas/{name}")})
    }
}

/// `schema` with a description: beside a `$ref` (which OpenAPI 3.1 allows).
fn with_description(mut schema: Value, description: String) -> Value {
    if let Value::Object(map) = &mut schema {
        map.insert("description".into(), Value::String(description));
    }
    schema
}

/// The pool's own check that the document was made from these routes.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_an_operation_and_every_reference_resolves() {
        let pool = super::super::pool();
        let routes = Routes::of_package(&pool, "atmost.v1").unwrap();
        let doc: Value = serde_json::from_slice(&document(&routes)).unwrap();
        let mut operations = 0;
        let mut ids = std::collections::HashSet::new();
        for (path, methods) in doc["paths"].as_object().unwrap() {
            for (method, op) in methods.as_object().unwrap() {
                operations += 1;
                let route = routes
                    .iter()
                    .find(|r| {
                        r.template == *path && r.http_method.as_str().eq_ignore_ascii_case(method)
                    })
                    .unwrap_or_else(|| panic!("{method} {path} is no route"));
                let rpc = format!("{}_{}", route.rpc.parent_service().name(), route.rpc.name());
                let id = op["operationId"].as_str().unwrap();
                assert!(id == rpc || id.starts_with(&format!("{rpc}_")), "{id}");
                assert!(ids.insert(id.to_owned()), "{id} twice");
                assert!(
                    !op["summary"].as_str().unwrap().is_empty(),
                    "{path}: a summary from the proto's comment"
                );
            }
        }
        assert_eq!(operations, routes.iter().count());
        let text = serde_json::to_string(&doc).unwrap();
        for reference in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = reference.split('"').next().unwrap();
            assert!(
                doc["components"]["schemas"]
                    .get(name)
                    .is_some_and(|s| !s.is_null()),
                "{name}"
            );
        }
    }
}
