//! The HTTP/JSON edge's Authorize, for the `http-authorize` scenario: a
//! JSON POST over HTTP/2 without TLS (h2c), its answer read as JSON.

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// One HTTP/2 connection to atmost's HTTP/JSON edge.
pub struct Connection {
    send: SendRequest<Full<Bytes>>,
    authority: String,
}

impl Connection {
    /// Connects to `target` (`http://HOST:PORT`).
    pub async fn open(target: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let uri: http::Uri = target.parse()?;
        let authority = uri
            .authority()
            .ok_or("the target names no host")?
            .to_string();
        let tcp = tokio::net::TcpStream::connect(&authority).await?;
        tcp.set_nodelay(true)?;
        let (send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await?;
        tokio::spawn(connection);
        Ok(Self { send, authority })
    }

    /// Authorize `key` on `permit` (the gRPC scenario's request, in proto3
    /// JSON): the decision's name, or the refusal's reason.
    pub async fn authorize(
        &self,
        permit: &str,
        key: &str,
        fingerprint: &[u8],
    ) -> Result<String, String> {
        let body = serde_json::json!({
            "tool": "search",
            "idempotencyKey": key,
            "requestFingerprint": base64::engine::general_purpose::STANDARD.encode(fingerprint),
            "cost": "1",
        });
        let request = http::Request::post(format!(
            "http://{}/v1/permits/{permit}/attempts:authorize",
            self.authority
        ))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
        let mut send = self.send.clone();
        send.ready().await.map_err(|_| "UNAVAILABLE".to_owned())?;
        let response = send
            .send_request(request)
            .await
            .map_err(|_| "UNAVAILABLE".to_owned())?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|_| "UNAVAILABLE".to_owned())?
            .to_bytes();
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|_| format!("NOT_JSON_{}", status.as_u16()))?;
        if !status.is_success() {
            let reason = json["error"]["details"]
                .as_array()
                .and_then(|d| d.iter().find_map(|d| d["reason"].as_str()))
                .or_else(|| json["error"]["status"].as_str())
                .unwrap_or("HTTP_ERROR");
            return Err(reason.to_owned());
        }
        Ok(json["decision"]
            .as_str()
            .unwrap_or("NO_DECISION")
            .to_owned())
    }
}
