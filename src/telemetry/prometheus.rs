//! `--metrics-listen`: `GET /metrics` answers every metric as Prometheus
//! text (HTTP/1.1, plaintext, unauthenticated: it holds no id, key or
//! tenant). Anything else is 404, or 405 for another method on /metrics.

use super::Telemetry;
use http_body_util::Full;
use hyper::body::Bytes;
use std::convert::Infallible;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A scraper must send its request line and headers within this.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `/metrics` on `listener` until `stop`.
pub async fn serve(listener: TcpListener, telemetry: Telemetry, stop: CancellationToken) {
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: try again shortly.
                    tracing::warn!(error = %e, "metrics listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let telemetry = telemetry.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let answer = respond(&telemetry, &request);
                async move { Ok::<_, Infallible>(answer) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                () = stop.cancelled() => {}
            }
        });
    }
}

fn respond<B>(telemetry: &Telemetry, request: &http::Request<B>) -> http::Response<Full<Bytes>> {
    let answer = |status: http::StatusCode, body: String| {
        http::Response::builder()
            .status(status)
            .header(
                http::header::CONTENT_TYPE,
                if status.is_success() {
                    "text/plain; version=0.0.4; charset=utf-8"
                } else {
                    "text/plain; charset=utf-8"
                },
            )
            .body(Full::new(Bytes::from(body)))
            .expect("a valid response")
    };
    if request.uri().path() != "/metrics" {
        return answer(
            http::StatusCode::NOT_FOUND,
            "not found: try /metrics\n".into(),
        );
    }
    if request.method() != http::Method::GET && request.method() != http::Method::HEAD {
        return answer(
            http::StatusCode::METHOD_NOT_ALLOWED,
            "/metrics answers GET\n".into(),
        );
    }
    match telemetry.prometheus_text() {
        Some(text) => answer(http::StatusCode::OK, text),
        None => answer(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "metrics unavailable\n".into(),
        ),
    }
}
