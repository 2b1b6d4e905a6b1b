//! Connecting with credentials: [`Client::builder`] gathers the address, an
//! API key, TLS (a CA, and a client identity for mTLS) and a deadline, and
//! connects once. It is tonic's own `Endpoint` and `ClientTlsConfig`
//! underneath (rustls with ring, as the server), so anything it does not
//! name can be passed as a whole [`ClientTlsConfig`].

use crate::Client;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// How to reach one atmost: `Client::builder("127.0.0.1:50051")`, then
/// credentials, then [`connect`](Self::connect) (or
/// [`connect_lazy`](Self::connect_lazy)).
///
/// ```no_run
/// # async fn demo(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<(), atmost_client::ConnectError> {
/// let client = atmost_client::Client::builder("atmost.internal:50051")
///     .api_key("agent-secret")
///     .tls_ca_pem(ca_pem)
///     .tls_identity_pem(cert_pem, key_pem) // mTLS, when the server asks for it
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ClientBuilder {
    address: String,
    api_key: Option<String>,
    tls: Option<ClientTlsConfig>,
    timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
}

/// By hand: a derived `Debug` would print the API key, and tonic's
/// `ClientTlsConfig` prints a client identity's private key. The key is
/// shown as redacted, TLS as whether it is configured.
impl std::fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("address", &self.address)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.as_ref().map(|_| "<configured>"))
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

/// Why a [`ClientBuilder`] could not make a client.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The API key cannot be sent as an HTTP header (it must be visible
    /// ASCII).
    #[error(
        "the API key is not visible ASCII, so it cannot be sent as `authorization: Bearer <key>`"
    )]
    InvalidApiKey,
    /// tonic refused the address or the TLS configuration, or the
    /// connection (TCP, TLS handshake) failed.
    #[error("cannot connect to atmost: {0}")]
    Transport(#[from] tonic::transport::Error),
}

impl Client {
    /// Starts a [`ClientBuilder`] for `address`: `host:port`, or a URI
    /// (`http://...`, `https://...`). Without a scheme, `https://` is used
    /// when TLS is configured and `http://` otherwise.
    pub fn builder(address: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            address: address.into(),
            api_key: None,
            tls: None,
            timeout: None,
            connect_timeout: None,
        }
    }
}

impl ClientBuilder {
    /// Sends every RPC with `authorization: Bearer <key>` (an atmost
    /// started with `--auth-keys`).
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(key.into());
        self
    }

    /// TLS, trusting the CA certificate(s) in `pem` (the server's
    /// `--tls-cert` must chain to one). May be given more than once.
    pub fn tls_ca_pem(mut self, pem: impl AsRef<[u8]>) -> Self {
        let tls = self.tls.take().unwrap_or_default();
        self.tls = Some(tls.ca_certificate(Certificate::from_pem(pem)));
        self
    }

    /// mTLS: presents this certificate chain and private key (PEM) to a
    /// server started with `--tls-client-ca`; a certificate whose SAN the
    /// key file maps stands in for an API key.
    pub fn tls_identity_pem(
        mut self,
        cert_pem: impl AsRef<[u8]>,
        key_pem: impl AsRef<[u8]>,
    ) -> Self {
        let tls = self.tls.take().unwrap_or_default();
        self.tls = Some(tls.identity(Identity::from_pem(cert_pem, key_pem)));
        self
    }

    /// The name the server's certificate is checked against, when it is
    /// not the address's host (connecting by IP to a certificate for
    /// `localhost`, say).
    pub fn tls_domain_name(mut self, name: impl Into<String>) -> Self {
        let tls = self.tls.take().unwrap_or_default();
        self.tls = Some(tls.domain_name(name));
        self
    }

    /// TLS exactly as configured here (replaces the `tls_*` settings made
    /// before it): for what the methods above do not name, such as the
    /// system's roots (with the matching tonic feature).
    pub fn tls_config(mut self, tls: ClientTlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sends every RPC with this deadline ([`Client::with_timeout`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Gives up on opening a connection (TCP and TLS) after this long.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }

    /// Connects now: fails if the server cannot be reached or the TLS
    /// handshake fails.
    pub async fn connect(self) -> Result<Client, ConnectError> {
        let (endpoint, finish) = self.endpoint()?;
        let channel = endpoint.connect().await?;
        Ok(finish(Client::new(channel)))
    }

    /// Connects on the first RPC, and again after a broken connection:
    /// a server not up yet is an UNAVAILABLE answer to that RPC (which
    /// [`Client::guarded`] retries), not an error here.
    pub fn connect_lazy(self) -> Result<Client, ConnectError> {
        let (endpoint, finish) = self.endpoint()?;
        Ok(finish(Client::new(endpoint.connect_lazy())))
    }

    /// The endpoint, and what turns a client on it into the configured one.
    #[allow(clippy::type_complexity)]
    fn endpoint(self) -> Result<(Endpoint, impl FnOnce(Client) -> Client), ConnectError> {
        let address = if self.address.contains("://") {
            self.address
        } else if self.tls.is_some() {
            format!("https://{}", self.address)
        } else {
            format!("http://{}", self.address)
        };
        let mut endpoint = Endpoint::from_shared(address)?;
        if let Some(tls) = self.tls {
            endpoint = endpoint.tls_config(tls)?;
        }
        if let Some(timeout) = self.connect_timeout {
            endpoint = endpoint.connect_timeout(timeout);
        }
        // Checked before connecting: a key that cannot be sent is known now.
        let authorization = match &self.api_key {
            Some(key) => Some(crate::bearer(key).map_err(|_| ConnectError::InvalidApiKey)?),
            None => None,
        };
        let timeout = self.timeout;
        let finish = move |mut client: Client| {
            client.authorization = authorization;
            client.timeout = timeout;
            client
        };
        Ok((endpoint, finish))
    }
}
