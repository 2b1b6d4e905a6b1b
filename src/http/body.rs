//! The request: a JSON body, the path's variables, the query and the
//! `Idempotency-Key` header, made into the RPC's request message when the
//! service reads its body, and only then: authentication and admission
//! decide before, as for gRPC, and a request they refuse is never parsed;
//! its body goes back to the edge ([`Passage`]), which reads and drops it
//! before answering ([`drain`]).
//!
//! Every problem is the domain's INVALID_REQUEST (or MESSAGE_TOO_LARGE),
//! answered by the RPC as if its own decoding had found it: counted and
//! traced like any refusal, and nothing is changed. A request of a
//! state-changing RPC that does not make its message is written to the
//! audit trail too, as the handler would have written its refusal.

use super::routes::BodyField;
use crate::api::audit::Audit;
use crate::api::status::to_status;
use crate::auth::Identity;
use crate::domain::{Error, invalid};
use bytes::{BufMut, Bytes, BytesMut};
use http_body::{Body as _, Frame};
use prost::Message as _;
use prost_reflect::{
    DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, Value,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use tonic::Status;

/// What the request says besides its body.
#[derive(Debug, Default)]
pub struct Params {
    /// The path's variables, decoded (or why not).
    pub vars: Vec<(FieldDescriptor, Result<String, String>)>,
    /// The query string, undecoded.
    pub query: Option<String>,
    /// Every `Idempotency-Key` header's value.
    pub idempotency_keys: Vec<http::HeaderValue>,
    /// The request's `Content-Length`, if it sent one.
    pub content_length: Option<u64>,
}

/// Between the edge's two halves, for one transcoded request: set by the
/// inner half ([`super::ReachedLayer`]) once the request has passed every
/// layer to its service, with its caller (`None` in dev mode). Until then
/// its body is not made into a message: a layer that refuses the request
/// (auth, admission) finds the body empty, and the JSON goes back here,
/// unread, for the edge to [`drain`].
#[derive(Debug, Default)]
pub struct Passage {
    caller: OnceLock<Option<Arc<Identity>>>,
    unread: std::sync::Mutex<Option<tonic::body::Body>>,
}

impl Passage {
    pub(super) fn reached(&self, caller: Option<Arc<Identity>>) {
        let _ = self.caller.set(caller);
    }

    /// The body of a request refused before its service, if it was.
    pub(super) fn take_unread(&self) -> Option<tonic::body::Body> {
        self.unread.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Reads what is left of a JSON body no RPC will read, and drops it, as
/// far as [`collect`] reads a body refused for its size (the JSON limit
/// and [`MAX_DRAINED`] more, or nothing past that by its
/// `Content-Length`) and for at most [`DRAIN_WAIT`]: over HTTP/1.1 an
/// answer sent with the body unread closes the connection, or is lost to
/// the reset.
pub async fn drain(body: tonic::body::Body, limit: usize, content_length: Option<u64>) {
    let _ = tokio::time::timeout(DRAIN_WAIT, collect(body, limit, content_length, false)).await;
}

/// The longest [`drain`] reads: long enough for a client that has sent its
/// whole body to be read on a busy machine, short enough that a client
/// that trickles cannot keep a refused request open.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// How the request's gRPC body is made.
pub struct Transcode {
    pub input: MessageDescriptor,
    pub field: BodyField,
    pub params: Params,
    /// The JSON body's largest size.
    pub limit: usize,
    /// Set once the whole JSON body has arrived.
    pub read: Arc<AtomicBool>,
    pub passage: Arc<Passage>,
    /// The RPC's name if it writes an audit event
    /// ([`crate::api::audit::AUDITED`]).
    pub audited: Option<&'static str>,
}

/// The request's gRPC body: one message, made from the HTTP request's JSON
/// body and its parameters, as a data frame; or the status that refuses
/// it, as the body's error (tonic answers with it). Empty if the request
/// never reached its service: whoever refused it answers.
pub fn transcode(body: tonic::body::Body, how: Transcode) -> tonic::body::Body {
    tonic::body::Body::new(Once(Some(Box::pin(async move {
        let Some(caller) = how.passage.caller.get().cloned() else {
            *how.passage.unread.lock().unwrap_or_else(|e| e.into_inner()) = Some(body);
            return Ok(None);
        };
        let json = collect(body, how.limit, how.params.content_length, true).await?;
        how.read.store(true, Ordering::Release);
        match message(how.input.clone(), &how.field, &json, &how.params) {
            Ok(message) => Ok(Some(frame(&message))),
            Err(e) => {
                if let Some(rpc) = how.audited {
                    let (permit_id, tool, key) = about(&how, &json);
                    Audit::by(rpc, caller).record(&permit_id, &tool, &key, e.reason().as_str(), "");
                }
                Err(to_status(e))
            }
        }
    }))))
}

/// What a request that did not make its message is about, as far as it
/// says, for its audit event: the permit, and the tool and idempotency key
/// if its RPC's request has them (as the handler's event would name
/// them), from the path, the `Idempotency-Key` header, or a body that is
/// the whole request and at least a JSON object.
fn about(how: &Transcode, json: &[u8]) -> (String, String, String) {
    /// The two fields of a body, whatever else it holds (skipped unread).
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct Named {
        tool: Option<serde_json::Value>,
        #[serde(rename = "idempotencyKey")]
        key: Option<serde_json::Value>,
        idempotency_key: Option<serde_json::Value>,
    }
    let var = |name: &str| {
        how.params
            .vars
            .iter()
            .find(|(f, _)| f.name() == name)
            .and_then(|(_, v)| v.as_deref().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    // (serde would read a JSON array as the struct's fields in order.)
    let object = json.trim_ascii_start().first() == Some(&b'{');
    let named: Named = match how.field {
        BodyField::All if object => serde_json::from_slice(json).unwrap_or_default(),
        _ => Named::default(),
    };
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) => Some(s),
        _ => None,
    };
    let has = |name: &str| how.input.get_field_by_name(name).is_some();
    let tool = match has("tool") {
        true => text(named.tool),
        false => None,
    };
    let key = match has("idempotency_key") {
        true => var("idempotency_key")
            .or_else(|| match how.params.idempotency_keys.as_slice() {
                [one] => crate::idempotency::header_key(one.as_bytes()).ok(),
                _ => None,
            })
            .or_else(|| text(named.key))
            .or_else(|| text(named.idempotency_key)),
        false => None,
    };
    (
        var("permit_id").unwrap_or_default(),
        tool.unwrap_or_default(),
        key.unwrap_or_default(),
    )
}

/// The JSON body, up to `limit` bytes (kept if `keep`); a longer one is
/// MESSAGE_TOO_LARGE. Before that answer, what is left of it is read and
/// dropped, up to [`MAX_DRAINED`] more bytes: over HTTP/1.1 an answer sent
/// while the client still sends is often lost to the reset that follows.
/// A body whose `Content-Length` is past even that is refused unread (and
/// a client that waits for `100 Continue`, as curl does for large bodies,
/// never sends it).
async fn collect(
    body: tonic::body::Body,
    limit: usize,
    content_length: Option<u64>,
    keep: bool,
) -> Result<Bytes, Status> {
    let too_large = |size: usize| to_status(Error::MessageTooLarge { limit, size });
    let drainable = limit.saturating_add(MAX_DRAINED);
    if let Some(length) = content_length.filter(|&n| n > drainable as u64) {
        return Err(too_large(usize::try_from(length).unwrap_or(usize::MAX)));
    }
    let mut body = std::pin::pin!(body);
    let mut json = BytesMut::new();
    let mut size = 0usize;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        // A body the client broke off (tonic would read a CANCELLED body
        // error as a body complete so far).
        let frame = frame.map_err(|e| to_status(invalid("body", format!("ended early: {e}"))))?;
        if let Ok(data) = frame.into_data() {
            size = size.saturating_add(data.len());
            if size > drainable {
                break;
            }
            if keep && size <= limit {
                json.put(data);
            }
        }
    }
    if size > limit {
        return Err(too_large(size));
    }
    Ok(json.freeze())
}

/// How much of a body past its limit is read, and dropped, before the
/// answer.
const MAX_DRAINED: usize = 1024 * 1024;

/// The request message: the body's JSON (into the whole message, or the
/// one field the route names), then every parameter, each checked against
/// what the body says.
fn message(
    input: MessageDescriptor,
    field: &BodyField,
    json: &[u8],
    params: &Params,
) -> Result<DynamicMessage, Error> {
    let mut message = match field {
        BodyField::None => {
            if !json.trim_ascii().is_empty() {
                return Err(invalid(
                    "body",
                    "this RPC takes no body: its fields go in the path and the query",
                ));
            }
            DynamicMessage::new(input.clone())
        }
        BodyField::All => from_json(input.clone(), json)?,
        BodyField::Field(field) => {
            let Kind::Message(of) = field.kind() else {
                unreachable!("routes only name message fields as the body")
            };
            let mut message = DynamicMessage::new(input.clone());
            message.set_field(field, Value::Message(from_json(of, json)?));
            message
        }
    };
    for (field, value) in &params.vars {
        let value = value
            .as_ref()
            .map_err(|why| invalid(field.name(), format!("the path's {} {why}", field.name())))?;
        set(&mut message, field, value, "the path")?;
    }
    if let Some(query) = params.query.as_deref().filter(|q| !q.is_empty()) {
        if matches!(field, BodyField::All) {
            return Err(invalid(
                "query",
                "this RPC takes its fields in the body, not in the query",
            ));
        }
        let mut seen: Vec<FieldDescriptor> = Vec::new();
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            let target = input
                .get_field_by_name(&name)
                .or_else(|| input.get_field_by_json_name(&name))
                .filter(|f| !matches!(f.kind(), Kind::Message(_)) && !f.is_list())
                .ok_or_else(|| invalid(&name, "no such query parameter"))?;
            if seen.contains(&target) {
                return Err(invalid(&name, "given twice in the query"));
            }
            seen.push(target.clone());
            set(&mut message, &target, &value, "the query")?;
        }
    }
    if !params.idempotency_keys.is_empty() {
        let key = match params.idempotency_keys.as_slice() {
            [one] => crate::idempotency::header_key(one.as_bytes())
                .map_err(|why| invalid("Idempotency-Key", why))?,
            _ => return Err(invalid("Idempotency-Key", "given more than once")),
        };
        let target = input.get_field_by_name("idempotency_key").ok_or_else(|| {
            invalid(
                "Idempotency-Key",
                format!(
                    "{} takes no idempotency key: it is not an idempotent write",
                    input.name().trim_end_matches("Request")
                ),
            )
        })?;
        set(&mut message, &target, &key, "the Idempotency-Key header")?;
    }
    Ok(message)
}

/// A message of `desc` from its proto3 JSON; an empty body is the empty
/// message. Unknown fields are refused.
fn from_json(desc: MessageDescriptor, json: &[u8]) -> Result<DynamicMessage, Error> {
    if json.trim_ascii().is_empty() {
        return Ok(DynamicMessage::new(desc));
    }
    let mut de = serde_json::Deserializer::from_slice(json);
    let message =
        DynamicMessage::deserialize_with_options(desc, &mut de, &DeserializeOptions::new())
            .and_then(|m| de.end().map(|()| m))
            .map_err(|e| invalid("body", format!("not the request's proto3 JSON: {e}")))?;
    Ok(message)
}

/// Sets one scalar field from a parameter's text, unless the body set it
/// to something else.
fn set(
    message: &mut DynamicMessage,
    field: &FieldDescriptor,
    text: &str,
    source: &str,
) -> Result<(), Error> {
    let value = scalar(field, text)
        .map_err(|why| invalid(field.name(), format!("{source}'s {} {why}", field.name())))?;
    if message.has_field(field) && *message.get_field(field) != value {
        return Err(invalid(
            field.name(),
            format!("{source} and the body give two different values"),
        ));
    }
    message.set_field(field, value);
    Ok(())
}

/// A parameter's text as the value of `field`, read as its proto3 JSON
/// string form would be.
fn scalar(field: &FieldDescriptor, text: &str) -> Result<Value, String> {
    let number = |what: &str| format!("is not {what}: {text:?}");
    Ok(match field.kind() {
        Kind::String => Value::String(text.to_owned()),
        Kind::Bool => match text {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(number("true or false")),
        },
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => {
            Value::I32(text.parse().map_err(|_| number("a 32-bit integer"))?)
        }
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => {
            Value::I64(text.parse().map_err(|_| number("a 64-bit integer"))?)
        }
        Kind::Uint32 | Kind::Fixed32 => Value::U32(
            text.parse()
                .map_err(|_| number("an unsigned 32-bit integer"))?,
        ),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(
            text.parse()
                .map_err(|_| number("an unsigned 64-bit integer"))?,
        ),
        // By name, or by number as proto3 JSON also reads an enum.
        Kind::Enum(e) => match e.get_value_by_name(text) {
            Some(v) => Value::EnumNumber(v.number()),
            None => Value::EnumNumber(text.parse().map_err(|_| {
                format!("is not one of {}'s names or a number: {text:?}", e.name())
            })?),
        },
        _ => return Err("cannot be given as text".into()),
    })
}

/// A gRPC message frame: uncompressed, its length, the message.
fn frame(message: &DynamicMessage) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    message.encode(&mut buf).expect("capacity reserved");
    buf.freeze()
}

type Pending = Pin<Box<dyn Future<Output = Result<Option<Bytes>, Status>> + Send>>;

/// A body of at most one data frame, or one error, computed when first
/// polled.
struct Once(Option<Pending>);

impl http_body::Body for Once {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let Some(pending) = self.0.as_mut() else {
            return Poll::Ready(None);
        };
        let result = std::task::ready!(pending.as_mut().poll(cx));
        self.0 = None;
        Poll::Ready(result.transpose().map(|r| r.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt as _;

    fn authorize(json: &'static str, passage: Arc<Passage>) -> tonic::body::Body {
        let input = crate::http::pool()
            .get_message_by_name("atmost.v1.AuthorizeRequest")
            .unwrap();
        transcode(
            tonic::body::Body::new(http_body_util::Full::new(Bytes::from_static(
                json.as_bytes(),
            ))),
            Transcode {
                input,
                field: BodyField::All,
                params: Params::default(),
                limit: 1024,
                read: Arc::default(),
                passage,
                audited: Some("Authorize"),
            },
        )
    }

    fn how(rpc_input: &str) -> Transcode {
        Transcode {
            input: crate::http::pool().get_message_by_name(rpc_input).unwrap(),
            field: BodyField::All,
            params: Params::default(),
            limit: 1024,
            read: Arc::default(),
            passage: Arc::default(),
            audited: None,
        }
    }

    /// A body that did not make its message names, for its audit event,
    /// only what its RPC's request has, and only from a JSON object.
    #[test]
    fn a_failed_body_names_what_its_request_has() {
        let authorize = how("atmost.v1.AuthorizeRequest");
        let named = |how: &Transcode, json: &str| {
            let (_, tool, key) = about(how, json.as_bytes());
            (tool, key)
        };
        let object = r#" {"tool": "charge", "idempotencyKey": "k1", "cost": "x"}"#;
        assert_eq!(named(&authorize, object), ("charge".into(), "k1".into()));
        let snake = r#"{"tool": "charge", "idempotency_key": "k1", "cost": "x"}"#;
        assert_eq!(named(&authorize, snake), ("charge".into(), "k1".into()));
        // An array is no request: serde would read it as the fields in order.
        assert_eq!(
            named(&authorize, r#"["charge", "k1"]"#),
            (String::new(), String::new())
        );
        // Commit's request has a key but no tool.
        let commit = how("atmost.v1.CommitRequest");
        assert_eq!(named(&commit, object), (String::new(), "k1".into()));
    }

    /// A query parameter reads as its field's proto3 JSON string would:
    /// an enum by name or by number.
    #[test]
    fn a_parameter_reads_as_its_json_string() {
        let permit = crate::http::pool()
            .get_message_by_name("atmost.v1.Permit")
            .unwrap();
        let policy = permit.get_field_by_name("uncertain_policy").unwrap();
        let by_name = scalar(&policy, "UNCERTAIN_POLICY_HOLD_TOOL").unwrap();
        assert!(
            matches!(by_name, Value::EnumNumber(n) if n > 0),
            "{by_name:?}"
        );
        assert_eq!(
            scalar(&policy, &by_name.as_enum_number().unwrap().to_string()).unwrap(),
            by_name
        );
        let why = scalar(&policy, "HOLD").unwrap_err();
        assert!(why.contains("names or a number"), "{why}");
        let subject = permit.get_field_by_name("subject").unwrap();
        assert_eq!(scalar(&subject, "7").unwrap(), Value::String("7".into()));
    }

    /// A request refused before its service (auth, admission) has its
    /// body drained, never parsed: what it sent does not matter.
    #[tokio::test]
    async fn a_request_that_never_reached_its_service_is_not_parsed() {
        let passage = Arc::new(Passage::default());
        let body = authorize("{not json", passage.clone());
        let collected = body.collect().await.expect("empty, no error");
        assert!(collected.to_bytes().is_empty());
        // Its JSON, unread, for the edge to drain.
        let unread = passage.take_unread().expect("handed back");
        let json = unread.collect().await.unwrap().to_bytes();
        assert_eq!(&json[..], b"{not json");
    }

    #[tokio::test]
    async fn a_request_that_reached_its_service_is_parsed() {
        let passage = Arc::new(Passage::default());
        passage.reached(None);
        let refused = authorize("{not json", passage.clone())
            .collect()
            .await
            .expect_err("not JSON");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        let frame = authorize(r#"{"tool": "charge", "cost": "7"}"#, passage)
            .collect()
            .await
            .expect("a message")
            .to_bytes();
        let message = crate::pb::AuthorizeRequest::decode(&frame[5..]).unwrap();
        assert_eq!((message.tool.as_str(), message.cost), ("charge", 7));
    }
}
