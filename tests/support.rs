//! What the suite's topics share: the real server in process on a loopback
//! port ([`Harness`]), the real binary ([`spawn_atmost`]), and the assertions on
//! errors. Processes, per-test Redis and the fault proxy come from
//! `atmost-testkit`; every RPC goes through `atmost-client`. Nothing here
//! stands in for Redis or for the server.

pub use atmost_client::{Client, Error, NewPermit, pb};
pub use atmost_testkit::{AtmostProcess, Redis, flush_scripts, proxy};

use atmost::domain::ManualClock;
use atmost::store::{
    Backend,
    memory::MemoryStore,
    redis::{RedisConfig, RedisStore},
};
use atmost::{App, run};
use std::collections::HashMap;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::Code;

pub const DAY_MS: i64 = 24 * 3_600_000;

/// Runs each `async fn name(kind: Kind)` once per store, as
/// `memory::name` and `redis::name`, sharing the machine.
macro_rules! on_each_store {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = crate::support::shared().await;
                    super::$name(crate::support::Kind::Memory).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let _machine = crate::support::shared().await;
                    super::$name(crate::support::Kind::Redis).await;
                }
            )*
        }
    };
}
pub(crate) use on_each_store;

// === the machine ===

/// One test binary runs every topic, as many tests at a time as the machine
/// has cores. The tests that load the machine (the stress checker, the load
/// generator) hold this exclusively and so run alone, as they did when each
/// was a binary of its own; every other test holds it shared.
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Runs alone: no other test runs until the guard drops.
pub async fn exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    MACHINE.write().await
}

/// Runs beside other tests, never beside one that runs alone.
pub async fn shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    MACHINE.read().await
}

/// [`shared`], for a test that is not async.
pub fn shared_blocking() -> tokio::sync::RwLockReadGuard<'static, ()> {
    MACHINE.blocking_read()
}

// === stores and processes ===

/// A Redis store on `url` under `prefix`, keeping finished attempts a day,
/// deciding on the caller's clock (tests move it).
pub fn redis_store(url: &str, prefix: &str, timeout: Duration) -> RedisStore {
    redis_store_with(url, prefix, timeout, DAY_MS)
}

/// [`redis_store`] with another retention.
pub fn redis_store_with(
    url: &str,
    prefix: &str,
    timeout: Duration,
    retention_ms: atmost::domain::Millis,
) -> RedisStore {
    RedisStore::connect(&RedisConfig {
        url: url.to_owned(),
        prefix: prefix.to_owned(),
        retention_ms,
        timeout,
        allow_eviction: false,
        time: atmost::store::redis::Time::Caller,
        tls_ca: None,
        ..atmost::store::redis::RedisConfig::new("", "")
    })
    .expect("redis store")
}

/// The real `atmost` binary of this build (`atmost serve --listen
/// 127.0.0.1:0 <args>`), killed on drop.
pub fn spawn_atmost<S: AsRef<str>>(args: &[S]) -> AtmostProcess {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_atmost"));
    AtmostProcess::spawn(bin, args).expect("start atmost")
}

/// [`spawn_atmost`] with extra environment variables.
pub fn spawn_atmost_with_env<S: AsRef<str>>(args: &[S], env: &[(&str, &str)]) -> AtmostProcess {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_atmost"));
    AtmostProcess::spawn_with_env(bin, args, env).expect("start atmost")
}

/// Runs `atmost serve --listen 127.0.0.1:0 <args>`, expected to refuse to
/// start, and returns its exit status and stderr; fails if it is still
/// running after 15 s.
pub fn run_to_exit<S: AsRef<str>>(args: &[S]) -> (std::process::ExitStatus, String) {
    let mut all = vec!["--listen", "127.0.0.1:0"];
    all.extend(args.iter().map(AsRef::as_ref));
    run_to_exit_with_env(&all, std::iter::empty::<(&str, &str)>())
}

/// `atmost serve <args>` with these environment variables, expected to
/// refuse to start: its exit status and stderr (fails after 15 s).
pub fn run_to_exit_with_env<K: AsRef<std::ffi::OsStr>, V: AsRef<std::ffi::OsStr>>(
    args: &[&str],
    env: impl IntoIterator<Item = (K, V)>,
) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .arg("serve")
        .args(args)
        .envs(env)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run atmost");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("atmost {args:?} started, where it had to refuse");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    (status, stderr)
}

/// atmost's Functions library, loaded as the store loads it, for a test
/// that calls a script directly.
pub async fn load_library(conn: &mut redis::aio::MultiplexedConnection) {
    redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(atmost::store::redis::library_text())
        .exec_async(conn)
        .await
        .expect("FUNCTION LOAD");
}

/// Authorizes a new key ("k", cost 0) on `permit_id`: the answer.
pub async fn authorize_new_key(client: &Client, permit_id: String) -> pb::AuthorizeResponse {
    client
        .authorize(pb::AuthorizeRequest {
            permit_id,
            tool: "t".into(),
            idempotency_key: "k".into(),
            request_fingerprint: b"fp".to_vec(),
            cost: 0,
            holder_token: Vec::new(),
            ..Default::default()
        })
        .await
        .expect("authorize")
}

// === the server ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Memory,
    Redis,
    /// The Redis Cluster this test binary shares ([`shared_cluster`]), with
    /// a key prefix of the test's own and `--durability replica`.
    Cluster,
}

/// The 3-primary, 3-replica Redis Cluster the tests of this binary share
/// (each under a key prefix of its own), started by the first that asks;
/// or the one `REDIS_CLUSTER_URLS` names (comma-separated seed URLs). Its
/// processes are tethered to this one and end with it.
pub fn shared_cluster() -> &'static str {
    static CLUSTER: std::sync::OnceLock<(String, Option<atmost_testkit::topology::RedisCluster>)> =
        std::sync::OnceLock::new();
    let (urls, _) = CLUSTER.get_or_init(|| match std::env::var("REDIS_CLUSTER_URLS") {
        Ok(urls) => (urls, None),
        Err(_) => {
            let cluster = atmost_testkit::topology::RedisCluster::start(3, 1, &[])
                .unwrap_or_else(|e| panic!("start a Redis Cluster: {e}"));
            (cluster.urls(), Some(cluster))
        }
    });
    urls
}

/// A Redis store on the Cluster at `urls` under `prefix`, like
/// [`redis_store`], with `--durability replica`: every state change is on a
/// replica before it is answered.
pub fn cluster_store(urls: &str, prefix: &str, timeout: Duration) -> RedisStore {
    RedisStore::connect(&RedisConfig {
        url: urls.to_owned(),
        mode: atmost::store::redis::Mode::Cluster,
        durability: atmost::store::redis::Durability::Replica,
        timeout,
        retention_ms: DAY_MS,
        time: atmost::store::redis::Time::Caller,
        ..RedisConfig::new("", prefix)
    })
    .expect("cluster store")
}

/// The real server, in process on a loopback port, with a manual clock.
pub struct Harness {
    pub client: Client,
    pub addr: std::net::SocketAddr,
    pub clock: ManualClock,
    pub redis: Option<Redis>,
    /// Stops the server when the harness is dropped.
    stop: Option<oneshot::Sender<()>>,
}

impl Harness {
    pub async fn start(kind: Kind) -> Self {
        Self::start_with_quotas(kind, atmost::domain::Quotas::DEFAULT, 0).await
    }

    /// [`start`](Self::start) with these quotas, and for the memory store
    /// this size limit (0: none).
    pub async fn start_with_quotas(
        kind: Kind,
        quotas: atmost::domain::Quotas,
        memory_max_bytes: u64,
    ) -> Self {
        let (backend, redis) = Self::backend(kind, quotas, memory_max_bytes);
        Self::serve(backend, redis, |app| app).await
    }

    /// [`start`](Self::start), with the server configured by `configure`
    /// (the Envoy mapping, say).
    pub async fn start_configured(kind: Kind, configure: impl FnOnce(App) -> App) -> Self {
        let (backend, redis) = Self::backend(kind, atmost::domain::Quotas::DEFAULT, 0);
        Self::serve(backend, redis, configure).await
    }

    /// The store of `kind`, and the Redis started for it.
    fn backend(
        kind: Kind,
        quotas: atmost::domain::Quotas,
        memory_max_bytes: u64,
    ) -> (Backend, Option<Redis>) {
        let redis = (kind == Kind::Redis).then(Redis::start);
        let backend = match (kind, &redis) {
            (Kind::Cluster, _) => {
                let urls = tokio::task::block_in_place(shared_cluster);
                let prefix = format!("t{}", uuid::Uuid::now_v7().simple());
                Backend::Redis(
                    cluster_store(urls, &prefix, Duration::from_secs(2)).with_quotas(quotas),
                )
            }
            (Kind::Memory, _) => Backend::Memory(
                MemoryStore::new(DAY_MS)
                    .with_quotas(quotas)
                    .with_max_bytes(memory_max_bytes),
            ),
            (Kind::Redis, Some(r)) => Backend::Redis(
                redis_store(&r.url, &r.prefix, Duration::from_secs(2)).with_quotas(quotas),
            ),
            (Kind::Redis, None) => unreachable!("a Redis was started for Kind::Redis"),
        };
        (backend, redis)
    }

    /// The server on `backend`, configured by `configure`.
    pub async fn serve(
        backend: Backend,
        redis: Option<Redis>,
        configure: impl FnOnce(App) -> App,
    ) -> Self {
        let clock = ManualClock::starting_now();
        let app = configure(App::new(backend).with_clock(clock.clone()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            run(listener, app, async {
                let _ = stopped.await;
            })
            .await
            .expect("server ran");
        });
        let client = Client::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        Self {
            client,
            addr,
            clock,
            redis,
            stop: Some(stop),
        }
    }

    pub fn now_ms(&self) -> i64 {
        use atmost::domain::Clock;
        self.clock.now()
    }

    /// A permit template: the given tools, expiring in an hour of the
    /// server's clock, no caps.
    pub fn permit(&self, tools: &[&str]) -> pb::Permit {
        NewPermit::new(tools.iter().copied())
            .subject("agent-test")
            .currency("EUR")
            .expires_at_ms(self.now_ms() + 3_600_000)
            .build()
    }

    pub async fn create(&self, permit: pb::Permit) -> pb::Permit {
        self.client
            .create_permit(permit)
            .await
            .expect("create permit")
    }

    /// Tries to create a permit over `tools`.
    pub async fn create_with_result(&self, tools: &[&str]) -> Result<pb::Permit, Error> {
        self.client.create_permit(self.permit(tools)).await
    }

    /// Creates a permit over `tools` with per-tool caps and a budget.
    pub async fn create_with(
        &self,
        tools: &[&str],
        caps: &[(&str, u64)],
        budget: Option<i64>,
    ) -> String {
        let mut p = self.permit(tools);
        p.max_calls_per_tool = caps.iter().map(|(t, n)| (t.to_string(), *n)).collect();
        p.budget = budget;
        self.create(p).await.permit_id
    }

    pub async fn authorize(
        &self,
        permit_id: &str,
        tool: &str,
        key: &str,
        fingerprint: &[u8],
        cost: i64,
    ) -> Result<pb::AuthorizeResponse, Error> {
        self.client
            .authorize(pb::AuthorizeRequest {
                permit_id: permit_id.into(),
                tool: tool.into(),
                idempotency_key: key.into(),
                request_fingerprint: fingerprint.to_vec(),
                cost,
                holder_token: Vec::new(),
                ..Default::default()
            })
            .await
    }

    /// Authorizes and asserts a DISPATCH; returns the attempt.
    pub async fn dispatch(
        &self,
        permit_id: &str,
        tool: &str,
        key: &str,
        fingerprint: &[u8],
        cost: i64,
    ) -> pb::Attempt {
        let r = self
            .authorize(permit_id, tool, key, fingerprint, cost)
            .await
            .unwrap_or_else(|s| panic!("authorize {key}: {s:?}"));
        assert_eq!(r.decision(), pb::Decision::Dispatch, "{key}: {r:?}");
        r.attempt.expect("attempt")
    }

    pub async fn commit(
        &self,
        attempt: &pb::Attempt,
        outcome: pb::commit_request::Outcome,
    ) -> Result<pb::CommitResponse, Error> {
        self.client
            .commit(pb::CommitRequest {
                permit_id: attempt.permit_id.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                attempt_id: attempt.attempt_id.clone(),
                outcome: Some(outcome),
            })
            .await
    }

    pub async fn mark_uncertain(
        &self,
        attempt: &pb::Attempt,
        reason: &str,
    ) -> Result<pb::MarkUncertainResponse, Error> {
        self.client
            .mark_uncertain(pb::MarkUncertainRequest {
                permit_id: attempt.permit_id.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                attempt_id: attempt.attempt_id.clone(),
                reason: reason.into(),
            })
            .await
    }

    pub async fn resolve(
        &self,
        permit_id: &str,
        key: &str,
        outcome: pb::resolve_request::Outcome,
    ) -> Result<pb::ResolveResponse, Error> {
        self.resolve_attempt(permit_id, key, "", outcome).await
    }

    /// Resolve naming the reconciled attempt ("" for whichever the key
    /// holds; required with NotSent).
    pub async fn resolve_attempt(
        &self,
        permit_id: &str,
        key: &str,
        attempt_id: &str,
        outcome: pb::resolve_request::Outcome,
    ) -> Result<pb::ResolveResponse, Error> {
        self.client
            .resolve(pb::ResolveRequest {
                permit_id: permit_id.into(),
                idempotency_key: key.into(),
                attempt_id: attempt_id.into(),
                outcome: Some(outcome),
            })
            .await
    }

    pub async fn get(&self, permit_id: &str) -> Result<pb::GetPermitResponse, Error> {
        self.client.get_permit(permit_id).await
    }

    pub async fn list(
        &self,
        permit_id: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<pb::ListUncertainResponse, Error> {
        self.client
            .list_uncertain(pb::ListUncertainRequest {
                permit_id: permit_id.into(),
                page_size,
                page_token: page_token.into(),
            })
            .await
    }

    /// Every uncertain attempt, following page tokens.
    pub async fn list_all(&self, permit_id: &str, page_size: u32) -> Vec<pb::Attempt> {
        self.client
            .list_all_uncertain(permit_id, page_size)
            .await
            .expect("list")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// === a raw call ===

/// One unary gRPC call to `path` (e.g. `/atmost.v1.Gate/Authorize`) over a
/// raw HTTP/2 stream, with the `grpc-timeout` header set to `grpc_timeout`
/// and not enforced on this side: what the server answers a request whose
/// deadline has passed when its turn comes (a tonic client would have given
/// up first). Returns the response message's bytes, or the error.
pub async fn raw_unary(
    addr: std::net::SocketAddr,
    path: &str,
    message: &impl prost::Message,
    grpc_timeout: &str,
) -> Result<Vec<u8>, Error> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut h2, connection) = h2::client::handshake(tcp).await.expect("HTTP/2");
    tokio::spawn(connection);
    let request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", grpc_timeout)
        .body(())
        .expect("request");
    let (response, mut send) = h2.send_request(request, false).expect("send");
    let body = message.encode_to_vec();
    let mut frame = vec![0u8];
    frame.extend((body.len() as u32).to_be_bytes());
    frame.extend(body);
    // The server may answer (a deadline already past) and close the
    // stream before the message is sent: its answer is read all the same.
    let _ = send.send_data(bytes::Bytes::from(frame), true);
    let (head, mut body) = response.await.expect("response").into_parts();
    let mut received = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("body");
        let _ = body.flow_control().release_capacity(chunk.len());
        received.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    // A trailers-only answer carries its status in the headers.
    let status = tonic::Status::from_header_map(&trailers)
        .or_else(|| tonic::Status::from_header_map(&head.headers))
        .expect("a grpc-status");
    match status.code() {
        Code::Ok => Ok(received.get(5..).unwrap_or_default().to_vec()),
        _ => Err(Error::from(status)),
    }
}

// === health ===

pub use tonic_health::pb::health_check_response::ServingStatus;

/// `grpc.health.v1.Health/Check` of `service` ("" for the whole server),
/// with a 10 s deadline.
pub async fn health(client: &Client, service: &str) -> Result<ServingStatus, Error> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: service.into(),
    });
    request.set_timeout(Duration::from_secs(10));
    HealthClient::new(client.channel())
        .check(request)
        .await
        .map(|r| r.into_inner().status())
        .map_err(Error::from)
}

/// Polls the server's health until it reports `want`, for at most 15 s.
pub async fn wait_health(client: &Client, want: ServingStatus) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while health(client, "").await.ok() != Some(want) {
        assert!(
            std::time::Instant::now() < deadline,
            "health never became {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// === outcomes ===

pub fn succeeded(result: &[u8], actual_cost: Option<i64>) -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::Succeeded(pb::Succeeded {
        result: result.to_vec(),
        actual_cost,
    })
}

pub fn failed(reason: &str) -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::Failed(pb::Failed {
        reason: reason.into(),
    })
}

pub fn not_sent() -> pb::commit_request::Outcome {
    pb::commit_request::Outcome::NotSent(pb::NotSent {})
}

pub fn resolved_succeeded(result: &[u8], actual_cost: Option<i64>) -> pb::resolve_request::Outcome {
    pb::resolve_request::Outcome::Succeeded(pb::Succeeded {
        result: result.to_vec(),
        actual_cost,
    })
}

/// An operator verified with the tool's provider that the call never took
/// effect.
pub fn resolved_not_sent() -> pb::resolve_request::Outcome {
    pb::resolve_request::Outcome::NotSent(pb::NotSent {})
}

pub fn resolved_failed(reason: &str) -> pb::resolve_request::Outcome {
    pb::resolve_request::Outcome::Failed(pb::Failed {
        reason: reason.into(),
    })
}

// === errors ===

/// Asserts that `result` failed with `code` and ErrorInfo `reason` in the
/// `atmost` domain; returns the ErrorInfo metadata and the error.
#[track_caller]
pub fn expect_error<T: std::fmt::Debug>(
    result: Result<T, Error>,
    code: Code,
    reason: &str,
) -> (HashMap<String, String>, Error) {
    let error = match result {
        Ok(v) => panic!("expected {code:?}/{reason}, got {v:?}"),
        Err(e) => e,
    };
    assert_eq!(error.code(), code, "{error:?}");
    // Only an ErrorInfo of the `atmost` domain gives a reason name.
    assert_eq!(error.reason_name(), Some(reason), "{error:?}");
    (error.metadata(), error)
}

// === certificates ===

/// A CA, and certificates it signs, for the TLS tests.
pub struct Pki {
    pub ca_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    pub fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().expect("key");
        let ca = params.self_signed(&key).expect("ca");
        Self {
            ca_pem: ca.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// (certificate PEM, key PEM) for these SANs (DNS names, or URIs when
    /// they contain "://").
    pub fn issue(&self, sans: &[&str]) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.subject_alt_names = sans
            .iter()
            .map(|s| {
                let name = (*s).try_into().expect("ia5");
                if s.contains("://") {
                    rcgen::SanType::URI(name)
                } else {
                    rcgen::SanType::DnsName(name)
                }
            })
            .collect();
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
}

// === receipts ===

/// The keys atmost publishes, fetched with no API key.
pub async fn published(
    client: &atmost_client::Client,
) -> Vec<(String, ed25519_dalek::VerifyingKey, bool)> {
    let keys = atmost::pb::receipts_client::ReceiptsClient::new(client.channel())
        .get_signing_keys(atmost::pb::GetSigningKeysRequest {})
        .await
        .expect("GetSigningKeys needs no key")
        .into_inner()
        .keys;
    keys.into_iter()
        .map(|k| {
            assert_eq!(k.algorithm, "ed25519");
            let bytes: [u8; 32] = k.public_key.as_slice().try_into().expect("32 bytes");
            (
                k.key_id,
                ed25519_dalek::VerifyingKey::from_bytes(&bytes).expect("a key"),
                k.current,
            )
        })
        .collect()
}

/// Checks an attempt's receipt as it came over the wire against `keys`,
/// as a tool provider would: the fields it knows, the encoding the receipt
/// names (its `signature_version`, its `tenant`), the signature.
pub fn check_receipt(
    keys: &[(String, ed25519_dalek::VerifyingKey)],
    attempt: &pb::Attempt,
    receipt: &pb::Receipt,
) -> atmost::receipts::Verdict {
    let signed = atmost::domain::Receipt {
        receipt_id: receipt.receipt_id.clone(),
        result: receipt.result.clone(),
        cost: receipt.cost,
        issued_at: atmost_client::millis(receipt.issued_at.as_ref().expect("issued_at")),
    };
    let encoding = atmost::receipts::encoding(receipt.signature_version, &receipt.tenant)
        .expect("a version this verifier knows");
    let message = atmost::receipts::canonical(
        encoding,
        &attempt.permit_id,
        &attempt.tool,
        &attempt.idempotency_key,
        &attempt.request_fingerprint,
        &attempt.attempt_id,
        &signed,
    );
    atmost::receipts::verify(keys, &receipt.key_id, &message, &receipt.signature)
}
