//! Errors as JSON: the gRPC status an RPC answered, as
//! `{"error": {"code", "message", "status", "details"}}` (AIP-193): `code`
//! is the HTTP status, `status` the gRPC code's name, `details` the
//! status's own details (ErrorInfo with the reason, RetryInfo,
//! BadRequest) in proto3 JSON, so every reason reads as over gRPC.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use prost_reflect::{DynamicMessage, MessageDescriptor};
use tonic::{Code, Status};
use tonic_types::StatusExt as _;

/// The HTTP status and the name of each gRPC code: the standard mapping
/// (google.rpc.Code's comments, grpc-gateway's and Envoy's transcoders).
pub fn http_of(code: Code) -> (StatusCode, &'static str) {
    match code {
        Code::Ok => (StatusCode::OK, "OK"),
        // 499: client closed request (nginx's), as google.rpc.Code says.
        Code::Cancelled => (client_closed(), "CANCELLED"),
        Code::Unknown => (StatusCode::INTERNAL_SERVER_ERROR, "UNKNOWN"),
        Code::InvalidArgument => (StatusCode::BAD_REQUEST, "INVALID_ARGUMENT"),
        Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "DEADLINE_EXCEEDED"),
        Code::NotFound => (StatusCode::NOT_FOUND, "NOT_FOUND"),
        Code::AlreadyExists => (StatusCode::CONFLICT, "ALREADY_EXISTS"),
        Code::PermissionDenied => (StatusCode::FORBIDDEN, "PERMISSION_DENIED"),
        Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "RESOURCE_EXHAUSTED"),
        Code::FailedPrecondition => (StatusCode::BAD_REQUEST, "FAILED_PRECONDITION"),
        Code::Aborted => (StatusCode::CONFLICT, "ABORTED"),
        Code::OutOfRange => (StatusCode::BAD_REQUEST, "OUT_OF_RANGE"),
        Code::Unimplemented => (StatusCode::NOT_IMPLEMENTED, "UNIMPLEMENTED"),
        Code::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL"),
        Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE"),
        Code::DataLoss => (StatusCode::INTERNAL_SERVER_ERROR, "DATA_LOSS"),
        Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "UNAUTHENTICATED"),
    }
}

fn client_closed() -> StatusCode {
    StatusCode::from_u16(499).expect("a valid status")
}

/// Where HTTP's own conventions say more than the code: the IETF
/// Idempotency-Key draft's 422 for a key reused with another request
/// (IN_PROGRESS is ABORTED, already its 409), and 413 for a body too large.
fn http_of_reason(reason: &str) -> Option<StatusCode> {
    match reason {
        "IDEMPOTENCY_KEY_REUSED" => Some(StatusCode::UNPROCESSABLE_ENTITY),
        "MESSAGE_TOO_LARGE" => Some(StatusCode::PAYLOAD_TOO_LARGE),
        _ => None,
    }
}

/// `status` as an HTTP answer. `rpc_status` is google.rpc.Status's
/// descriptor, in a pool that knows every detail atmost sends.
pub fn respond(
    status: &Status,
    rpc_status: &MessageDescriptor,
) -> http::Response<tonic::body::Body> {
    let (mut code, name) = http_of(status.code());
    let info = status.get_details_error_info();
    if let Some(http) = info.as_ref().and_then(|i| http_of_reason(&i.reason)) {
        code = http;
    }
    let details = match DynamicMessage::decode(rpc_status.clone(), status.details()) {
        Ok(decoded) => serde_json::to_value(&decoded)
            .ok()
            .and_then(|mut v| v.get_mut("details").map(serde_json::Value::take)),
        Err(e) => {
            tracing::warn!(error = %e, "a status's details are not a google.rpc.Status; answered without them");
            None
        }
    }
    .unwrap_or_else(|| serde_json::Value::Array(vec![]));
    let body = serde_json::json!({
        "error": {
            "code": code.as_u16(),
            "message": status.message(),
            "status": name,
            "details": details,
        }
    });
    let mut response = json_response(code, serde_json::to_vec(&body).unwrap_or_default());
    let headers = response.headers_mut();
    if let Some(delay) = status.get_details_retry_info().and_then(|r| r.retry_delay) {
        let secs = delay.as_millis().div_ceil(1000).max(1);
        headers.insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
    }
    if status.code() == Code::Unauthenticated {
        headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

/// A JSON answer.
pub fn json_response(
    code: StatusCode,
    body: impl Into<Bytes>,
) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(http_body_util::Full::new(
        body.into(),
    )));
    *response.status_mut() = code;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_standard_http_status() {
        let all = [
            (Code::Ok, 200),
            (Code::Cancelled, 499),
            (Code::Unknown, 500),
            (Code::InvalidArgument, 400),
            (Code::DeadlineExceeded, 504),
            (Code::NotFound, 404),
            (Code::AlreadyExists, 409),
            (Code::PermissionDenied, 403),
            (Code::ResourceExhausted, 429),
            (Code::FailedPrecondition, 400),
            (Code::Aborted, 409),
            (Code::OutOfRange, 400),
            (Code::Unimplemented, 501),
            (Code::Internal, 500),
            (Code::Unavailable, 503),
            (Code::DataLoss, 500),
            (Code::Unauthenticated, 401),
        ];
        for (code, http) in all {
            let (status, name) = http_of(code);
            assert_eq!(status.as_u16(), http, "{code:?}");
            // google.rpc.Code's names, as grpc's own Code prints them.
            assert_eq!(
                name.replace('_', "").to_lowercase(),
                format!("{code:?}").to_lowercase(),
                "{code:?}"
            );
        }
    }
}
