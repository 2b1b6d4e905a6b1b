//! Test support: real `redis-server` processes on free loopback ports, the
//! real server over gRPC on a loopback port, and helpers to read errors.
//! Nothing here stands in for Redis or for the server.

#![allow(dead_code)]

pub mod proxy;

use atmost::domain::ManualClock;
use atmost::pb::{self, gate_client::GateClient, permits_client::PermitsClient};
use atmost::store::{
    Backend,
    memory::MemoryStore,
    redis::{RedisConfig, RedisStore},
};
use atmost::testkit::{AtmostProcess, RedisServer};
use atmost::{App, run};
use std::collections::HashMap;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;

pub const DAY_MS: i64 = 24 * 3_600_000;

// === Redis ===

/// A Redis for one test: its own `redis-server` on a free loopback port,
/// killed on drop (also when the test panics), or the one named by
/// `REDIS_URL`, shared, with a key prefix of this test's own.
pub struct Redis {
    pub url: String,
    pub prefix: String,
    server: Option<RedisServer>,
    /// A data directory of this Redis's own, removed on drop.
    data_dir: Option<std::path::PathBuf>,
}

fn prefix() -> String {
    format!("t{}", uuid::Uuid::now_v7().simple())
}

/// Empties Redis's script cache: atmost's next script send meets NOSCRIPT.
pub async fn flush_scripts(conn: &mut redis::aio::MultiplexedConnection) {
    redis::cmd("SCRIPT")
        .arg("FLUSH")
        .exec_async(conn)
        .await
        .expect("SCRIPT FLUSH");
}

impl Redis {
    /// A connection of the test's own to this Redis, beside atmost's.
    pub async fn connect(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis")
    }

    pub fn start() -> Self {
        match std::env::var("REDIS_URL") {
            Ok(url) => Self {
                url,
                prefix: prefix(),
                server: None,
                data_dir: None,
            },
            Err(_) => Self::start_owned(),
        }
    }

    /// Always a `redis-server` of this test's own (REDIS_URL or not), for
    /// tests that kill and restart it.
    pub fn start_owned() -> Self {
        Self::owned(&[], None)
    }

    /// An owned `redis-server` that persists every write to an append-only
    /// file (fsynced before it answers) in a directory of its own, so a
    /// [`Redis::restart`] after a kill keeps the data (but not the script
    /// cache).
    pub fn start_persistent() -> Self {
        let dir =
            std::env::temp_dir().join(format!("atmost-redis-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("create the Redis data directory");
        let dir_arg = dir.to_string_lossy().into_owned();
        let args = [
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            &dir_arg,
        ];
        Self::owned(&args, Some(dir.clone()))
    }

    fn owned(args: &[&str], data_dir: Option<std::path::PathBuf>) -> Self {
        let server = RedisServer::start_with(args).unwrap_or_else(|e| panic!("{e}"));
        Self {
            url: server.url(),
            prefix: prefix(),
            server: Some(server),
            data_dir,
        }
    }

    /// Kills the Redis process (what it did not persist is lost).
    pub fn kill(&mut self) {
        if let Some(server) = &mut self.server {
            server.kill();
        }
    }

    /// Starts it again on the same port: empty, or with the data of a
    /// [`Redis::start_persistent`] one.
    pub fn restart(&mut self) {
        self.server
            .as_mut()
            .expect("only an owned Redis can be restarted")
            .restart()
            .expect("restart redis-server");
    }

    /// The flags that point an `atmost serve` process at this Redis.
    pub fn serve_args(&self) -> Vec<String> {
        [
            "--store",
            "redis",
            "--redis-url",
            &self.url,
            "--redis-prefix",
            &self.prefix,
        ]
        .map(String::from)
        .to_vec()
    }

    pub fn store(&self) -> RedisStore {
        RedisStore::connect(&RedisConfig {
            url: self.url.clone(),
            prefix: self.prefix.clone(),
            retention_ms: DAY_MS,
            timeout: Duration::from_secs(2),
        })
        .expect("redis store")
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.server.take();
        if let Some(dir) = self.data_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

// === the server ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Memory,
    Redis,
}

/// The real server, in process on a loopback port, with a manual clock.
pub struct Harness {
    pub gate: GateClient<Channel>,
    pub permits: PermitsClient<Channel>,
    pub channel: Channel,
    pub clock: ManualClock,
    pub kind: Kind,
    pub redis: Option<Redis>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    pub async fn start(kind: Kind) -> Self {
        let redis = (kind == Kind::Redis).then(Redis::start);
        let backend = match &redis {
            Some(r) => Backend::Redis(r.store()),
            None => Backend::Memory(MemoryStore::new(DAY_MS)),
        };
        Self::serve(kind, backend, redis, |app| app).await
    }

    pub async fn serve(
        kind: Kind,
        backend: Backend,
        redis: Option<Redis>,
        configure: impl FnOnce(App) -> App,
    ) -> Self {
        let clock = ManualClock::starting_now();
        let app = configure(App::new(backend).with_clock(clock.clone()));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            run(listener, app, async {
                let _ = stopped.await;
            })
            .await
            .expect("server ran");
        });
        let channel = Channel::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connect");
        Self {
            gate: GateClient::new(channel.clone()),
            permits: PermitsClient::new(channel.clone()),
            channel,
            clock,
            kind,
            redis,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the server and waits for it to finish.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.expect("server task");
        }
    }

    pub fn now_ms(&self) -> i64 {
        use atmost::domain::Clock;
        self.clock.now()
    }

    /// A permit template: the given tools, expiring in an hour, no caps.
    pub fn permit(&self, tools: &[&str]) -> pb::Permit {
        pb::Permit {
            subject: "agent-test".into(),
            tools: tools.iter().map(|t| t.to_string()).collect(),
            expires_at: Some(atmost::api::convert::timestamp(self.now_ms() + 3_600_000)),
            currency: "EUR".into(),
            ..Default::default()
        }
    }

    pub async fn create(&self, permit: pb::Permit) -> pb::Permit {
        self.permits
            .clone()
            .create_permit(pb::CreatePermitRequest {
                permit: Some(permit),
            })
            .await
            .expect("create permit")
            .into_inner()
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
    ) -> Result<pb::AuthorizeResponse, Status> {
        self.gate
            .clone()
            .authorize(pb::AuthorizeRequest {
                permit_id: permit_id.into(),
                tool: tool.into(),
                idempotency_key: key.into(),
                request_fingerprint: fingerprint.to_vec(),
                cost,
            })
            .await
            .map(|r| r.into_inner())
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
    ) -> Result<pb::CommitResponse, Status> {
        self.gate
            .clone()
            .commit(pb::CommitRequest {
                permit_id: attempt.permit_id.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                attempt_id: attempt.attempt_id.clone(),
                outcome: Some(outcome),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn mark_uncertain(
        &self,
        attempt: &pb::Attempt,
        reason: &str,
    ) -> Result<pb::MarkUncertainResponse, Status> {
        self.gate
            .clone()
            .mark_uncertain(pb::MarkUncertainRequest {
                permit_id: attempt.permit_id.clone(),
                idempotency_key: attempt.idempotency_key.clone(),
                attempt_id: attempt.attempt_id.clone(),
                reason: reason.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn resolve(
        &self,
        permit_id: &str,
        key: &str,
        outcome: pb::resolve_request::Outcome,
    ) -> Result<pb::ResolveResponse, Status> {
        self.permits
            .clone()
            .resolve(pb::ResolveRequest {
                permit_id: permit_id.into(),
                idempotency_key: key.into(),
                outcome: Some(outcome),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn get(&self, permit_id: &str) -> Result<pb::GetPermitResponse, Status> {
        self.permits
            .clone()
            .get_permit(pb::GetPermitRequest {
                permit_id: permit_id.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    pub async fn list(
        &self,
        permit_id: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<pb::ListUncertainResponse, Status> {
        self.permits
            .clone()
            .list_uncertain(pb::ListUncertainRequest {
                permit_id: permit_id.into(),
                page_size,
                page_token: page_token.into(),
            })
            .await
            .map(|r| r.into_inner())
    }

    /// Every uncertain attempt, following page tokens.
    pub async fn list_all(&self, permit_id: &str, page_size: u32) -> Vec<pb::Attempt> {
        let mut out = Vec::new();
        let mut token = String::new();
        for _ in 0..10_000 {
            let page = self.list(permit_id, page_size, &token).await.expect("list");
            assert!(page.attempts.len() <= page_size as usize);
            out.extend(page.attempts);
            if page.next_page_token.is_empty() {
                return out;
            }
            token = page.next_page_token;
        }
        panic!("ListUncertain never ended");
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
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

pub fn resolved_failed(reason: &str) -> pb::resolve_request::Outcome {
    pb::resolve_request::Outcome::Failed(pb::Failed {
        reason: reason.into(),
    })
}

// === errors ===

/// Asserts that `result` failed with `code` and ErrorInfo `reason` in the
/// `atmost` domain; returns the ErrorInfo metadata and the status.
#[track_caller]
pub fn expect_error<T: std::fmt::Debug>(
    result: Result<T, Status>,
    code: Code,
    reason: &str,
) -> (HashMap<String, String>, Status) {
    let status = match result {
        Ok(v) => panic!("expected {code:?}/{reason}, got {v:?}"),
        Err(s) => s,
    };
    assert_eq!(status.code(), code, "{status:?}");
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.reason, reason, "{status:?}");
    assert_eq!(info.domain, "atmost");
    (info.metadata, status)
}

/// The fields named by a status's BadRequest details.
pub fn violated_fields(status: &Status) -> Vec<String> {
    status
        .get_details_bad_request()
        .map(|b| b.field_violations.into_iter().map(|v| v.field).collect())
        .unwrap_or_default()
}

// === the binary ===

/// The real `atmost` binary (`atmost serve --listen 127.0.0.1:0 <args>`),
/// killed on drop.
pub struct Process(AtmostProcess);

impl Process {
    pub fn spawn<S: AsRef<str>>(args: &[S]) -> Self {
        let bin = std::path::Path::new(env!("CARGO_BIN_EXE_atmost"));
        let args: Vec<&str> = args.iter().map(AsRef::as_ref).collect();
        Self(AtmostProcess::spawn(bin, &args).expect("start atmost"))
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.0.addr()))
            .expect("uri")
            .connect()
            .await
            .expect("connect")
    }
}

impl std::ops::Deref for Process {
    type Target = AtmostProcess;
    fn deref(&self) -> &AtmostProcess {
        &self.0
    }
}

impl std::ops::DerefMut for Process {
    fn deref_mut(&mut self) -> &mut AtmostProcess {
        &mut self.0
    }
}
