//! TLS on the listeners, terminated here rather than by tonic: tonic's
//! server offers only `h2` in ALPN, so a client that offers only
//! `http/1.1` (most HTTP/1.1 clients over TLS: Python's requests, Node's
//! fetch, `curl --http1.1`) would fail the handshake before the HTTP/JSON
//! edge could answer it. The listeners offer `h2`, and `http/1.1` too
//! while HTTP/JSON is served (so that an HTTP/1.1 client on a gRPC-only
//! listener hears where JSON is served, as it would in plaintext). The
//! handshakes run beside the accept loop, each within the handshake
//! timeout, so a slow one delays no other connection.

use super::Conn;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_stream::{Stream, StreamExt};

/// The server's certificate and key and, with a client CA, mTLS: a client
/// certificate is then optional (a client without one may still send an
/// API key), and one the CA did not sign fails the handshake.
#[derive(Clone)]
pub struct Tls {
    /// ALPN `h2` only: gRPC alone is served (`--http=false`).
    h2: Arc<ServerConfig>,
    /// ALPN `h2` and `http/1.1`: HTTP/JSON is served.
    h2_and_http1: Arc<ServerConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

impl Tls {
    /// From PEM: the certificate chain (leaf first), its private key, and
    /// the CA that signs client certificates. Each error names its flag.
    pub fn from_pem(cert: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("--tls-cert: not PEM certificates: {e}"))?;
        if chain.is_empty() {
            return Err("--tls-cert: no certificate in it".into());
        }
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| format!("--tls-key: not a PEM private key: {e}"))?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let certs = CertificateDer::pem_slice_iter(ca)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| format!("--tls-client-ca: not PEM certificates: {e}"))?;
                // As tonic read it: a bundle's certificates that cannot be
                // trust anchors are passed over, as long as one can.
                let mut roots = RootCertStore::empty();
                let (_, unusable) = roots.add_parsable_certificates(certs);
                if roots.is_empty() {
                    return Err(format!(
                        "--tls-client-ca: no CA certificate in it ({unusable} that cannot be one)"
                    ));
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| format!("--tls-client-ca: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| format!("--tls-cert, --tls-key: {e}"))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let h2 = Arc::new(config.clone());
        config.alpn_protocols.push(b"http/1.1".to_vec());
        Ok(Self {
            h2,
            h2_and_http1: Arc::new(config),
        })
    }

    /// The connections of `accepted` once each has finished its TLS
    /// handshake within `timeout`, offering `http/1.1` too if `http1`; one
    /// that fails or does not finish in time is closed (and logged at
    /// DEBUG), nothing else waits for it. The HTTP preface is then counted
    /// on what the handshake decrypts (`Conn::count_preface`).
    pub(super) fn accept(
        self,
        accepted: impl Stream<Item = io::Result<Conn>> + Send + 'static,
        timeout: Duration,
        http1: bool,
    ) -> impl Stream<Item = io::Result<TlsConn>> + Send + 'static {
        let acceptor =
            tokio_rustls::TlsAcceptor::from(if http1 { self.h2_and_http1 } else { self.h2 });
        let accepted = Box::pin(accepted);
        let state = (accepted, JoinSet::new(), acceptor);
        futures_util::stream::unfold(
            state,
            move |(mut accepted, mut handshakes, acceptor)| async move {
                loop {
                    tokio::select! {
                        next = accepted.next() => match next {
                            None => return None,
                            Some(Err(e)) => return Some((Err(e), (accepted, handshakes, acceptor))),
                            Some(Ok(mut conn)) => {
                                conn.preface_decrypted = true;
                                let handshake = acceptor.accept(conn);
                                handshakes.spawn(tokio::time::timeout(timeout, handshake));
                            }
                        },
                        Some(done) = handshakes.join_next() => match done {
                            Ok(Ok(Ok(stream))) => {
                                return Some((Ok(Box::new(stream)), (accepted, handshakes, acceptor)));
                            }
                            Ok(Ok(Err(e))) => tracing::debug!(error = %e, "TLS handshake failed"),
                            Ok(Err(_)) => tracing::debug!("TLS handshake timed out"),
                            Err(e) => tracing::debug!(error = %e, "TLS handshake task ended"),
                        },
                    }
                }
            },
        )
    }
}

/// A connection over TLS.
pub type TlsConn = Box<tokio_rustls::server::TlsStream<Conn>>;

/// The client's certificate chain, if it sent one (verified against the
/// client CA by then).
pub(super) fn peer_certs(conn: &TlsConn) -> Option<Arc<[CertificateDer<'static>]>> {
    conn.get_ref().1.peer_certificates().map(Arc::from)
}
