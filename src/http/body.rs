//! The request: a JSON body, the path's variables, the query and the
//! `Idempotency-Key` header, made into the RPC's request message when the
//! service reads its body: authentication and admission decide before it is
//! read, as for gRPC. (A refusal then drains the body, as it drains a gRPC
//! one: for up to 100 ms, which reads and parses a body of up to the
//! JSON body limit.)
//!
//! Every problem is the domain's INVALID_REQUEST (or MESSAGE_TOO_LARGE),
//! answered by the RPC as if its own decoding had found it: counted,
//! traced and audited like any refusal, and nothing is changed.

use super::routes::BodyField;
use crate::api::status::to_status;
use crate::domain::{Error, invalid};
use bytes::{BufMut, Bytes, BytesMut};
use http_body::{Body as _, Frame};
use prost::Message as _;
use prost_reflect::{
    DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, Value,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// The request's gRPC body: one message, made from the HTTP request's JSON
/// body (read up to `limit` bytes) and `params`, as a data frame; or the
/// status that refuses it, as the body's error (tonic answers with it).
/// `read` is set once the whole JSON body has arrived.
pub fn transcode(
    body: tonic::body::Body,
    input: MessageDescriptor,
    field: BodyField,
    params: Params,
    limit: usize,
    read: Arc<AtomicBool>,
) -> tonic::body::Body {
    tonic::body::Body::new(Once(Some(Box::pin(async move {
        let json = collect(body, limit, params.content_length).await?;
        read.store(true, Ordering::Release);
        let message = message(input, &field, &json, &params).map_err(to_status)?;
        Ok(frame(&message))
    }))))
}

/// The JSON body, up to `limit` bytes; a longer one is MESSAGE_TOO_LARGE.
/// Before that answer, what is left of it is read and dropped, up to
/// [`MAX_DRAINED`] more bytes: over HTTP/1.1 an answer sent while the
/// client still sends is often lost to the reset that follows. A body
/// whose `Content-Length` is past even that is refused unread (and a
/// client that waits for `100 Continue`, as curl does for large bodies,
/// never sends it).
async fn collect(
    body: tonic::body::Body,
    limit: usize,
    content_length: Option<u64>,
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
            if size <= limit {
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
        Kind::Enum(e) => match e.get_value_by_name(text) {
            Some(v) => Value::EnumNumber(v.number()),
            None => return Err(format!("is not one of {}'s names: {text:?}", e.name())),
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

type Pending = Pin<Box<dyn Future<Output = Result<Bytes, Status>> + Send>>;

/// A body of one data frame, or one error, computed when first polled.
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
        Poll::Ready(Some(result.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_none()
    }
}
