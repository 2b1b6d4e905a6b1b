//! Authentication and roles: bearer API keys from `--auth-keys`, the roles
//! each RPC accepts, reloading the key file, and dev mode.

use crate::support::*;
use atmost::auth::Authenticator;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

const ADMIN: &str = "admin-secret-0123456789";
const AGENT: &str = "agent-secret-0123456789";
const OPS: &str = "ops-secret-0123456789";

pub fn entry(id: &str, key: &str, tenant: &str, roles: &str) -> String {
    let sha: String = Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "[[key]]\nid = \"{id}\"\nsha256 = \"{sha}\"\ntenant = \"{tenant}\"\nroles = [{roles}]\n\n"
    )
}

fn three_keys() -> String {
    [
        entry("admin-1", ADMIN, "acme", "\"admin\""),
        entry("agent-1", AGENT, "acme", "\"agent\""),
        entry("ops-1", OPS, "acme", "\"operator\""),
    ]
    .concat()
}

/// A key file in a fresh temporary directory (removed on drop).
pub struct KeyFile {
    pub dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl KeyFile {
    pub fn new(text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("atmost-keys-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("keys.toml");
        let file = Self { dir, path };
        file.write(text);
        file
    }

    /// Replaces the file whole (write, then rename), as an operator's tool
    /// or a mounted Secret does.
    pub fn write(&self, text: &str) {
        let next = self.dir.join("keys.toml.next");
        std::fs::write(&next, text).expect("write keys");
        std::fs::rename(&next, &self.path).expect("rename keys");
    }

    /// Writes `text` to `name` beside the key file (a certificate or a
    /// key, removed with it) and returns its path, for a flag.
    pub fn beside(&self, name: &str, text: &str) -> String {
        let path = self.dir.join(name);
        std::fs::write(&path, text).expect("write pem");
        path.to_str().expect("utf-8").to_owned()
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn authed_harness(keys: &KeyFile) -> Harness {
    authed_harness_on(keys, Kind::Memory).await
}

pub async fn authed_harness_on(keys: &KeyFile, kind: Kind) -> Harness {
    let auth = Arc::new(Authenticator::load(&keys.path).expect("keys load"));
    let redis = (kind == Kind::Redis).then(Redis::start);
    let backend = match &redis {
        Some(r) => {
            atmost::store::Backend::Redis(redis_store(&r.url, &r.prefix, Duration::from_secs(2)))
        }
        None => atmost::store::Backend::Memory(atmost::store::memory::MemoryStore::new(DAY_MS)),
    };
    Harness::serve(backend, redis, |app| {
        app.with_auth(auth)
            .with_auth_reload_interval(Duration::from_millis(20))
    })
    .await
}

fn as_key(h: &Harness, key: &str) -> atmost_client::Client {
    h.client.clone().with_api_key(key).expect("an ASCII key")
}

fn authorize_request(permit_id: &str, key: &str) -> pb::AuthorizeRequest {
    pb::AuthorizeRequest {
        permit_id: permit_id.into(),
        tool: "t".into(),
        idempotency_key: key.into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 0,
        holder_token: Vec::new(),
        ..Default::default()
    }
}

fn expect_denied<T: std::fmt::Debug>(
    result: Result<T, atmost_client::Error>,
    key_id: &str,
    rpc: &str,
    allowed: &str,
) {
    let (meta, _) = expect_error(result, Code::PermissionDenied, "ROLE_NOT_ALLOWED");
    assert_eq!(meta["key_id"], key_id);
    assert_eq!(meta["rpc"], rpc);
    assert_eq!(meta["allowed_roles"], allowed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rpc_needs_a_known_key_with_a_role_that_may_call_it() {
    let _machine = shared().await;
    let keys = KeyFile::new(&three_keys());
    let h = authed_harness(&keys).await;
    let (admin, agent, ops) = (as_key(&h, ADMIN), as_key(&h, AGENT), as_key(&h, OPS));

    // No key, an unknown key, or not a bearer token: UNAUTHENTICATED.
    expect_error(
        h.client.create_permit(h.permit(&["t"])).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    for wrong in [as_key(&h, "not-a-key"), as_key(&h, &ADMIN[1..])] {
        expect_error(
            wrong.create_permit(h.permit(&["t"])).await,
            Code::Unauthenticated,
            "UNAUTHENTICATED",
        );
    }
    let mut basic = tonic::Request::new(atmost::pb::GetPermitRequest::default());
    basic.metadata_mut().insert(
        "authorization",
        format!("Basic {ADMIN}").parse().expect("ascii"),
    );
    let status = atmost::pb::permits_client::PermitsClient::new(h.client.channel())
        .get_permit(basic)
        .await
        .expect_err("not a bearer token");
    assert_eq!(status.code(), Code::Unauthenticated);

    // admin: everything.
    let permit = admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("admin creates")
        .permit_id;
    // agent: Authorize, Commit, MarkUncertain, GetPermit.
    let a = agent
        .authorize(authorize_request(&permit, "k1"))
        .await
        .expect("agent authorizes");
    let attempt = a.attempt.expect("attempt");
    agent
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit.clone(),
            idempotency_key: "k1".into(),
            attempt_id: attempt.attempt_id.clone(),
            reason: "lost".into(),
        })
        .await
        .expect("agent marks");
    agent
        .get_permit(&permit)
        .await
        .expect("agent reads its permit");
    agent
        .get_attempt(&permit, "k1")
        .await
        .expect("agent reads its attempt");
    expect_denied(
        agent.create_permit(h.permit(&["t"])).await,
        "agent-1",
        "atmost.v1.Permits/CreatePermit",
        "admin",
    );
    expect_denied(
        agent.revoke_permit(&permit).await,
        "agent-1",
        "atmost.v1.Permits/RevokePermit",
        "admin",
    );
    expect_denied(
        agent
            .list_uncertain(pb::ListUncertainRequest {
                permit_id: permit.clone(),
                page_size: 10,
                page_token: String::new(),
            })
            .await,
        "agent-1",
        "atmost.v1.Permits/ListUncertain",
        "operator, admin",
    );
    expect_denied(
        agent
            .resolve(pb::ResolveRequest {
                permit_id: permit.clone(),
                idempotency_key: "k1".into(),
                attempt_id: String::new(),
                outcome: Some(resolved_failed("forged")),
            })
            .await,
        "agent-1",
        "atmost.v1.Permits/Resolve",
        "operator, admin",
    );
    // operator: GetPermit, ListUncertain, Resolve; never a dispatch.
    expect_denied(
        ops.authorize(authorize_request(&permit, "k2")).await,
        "ops-1",
        "atmost.v1.Gate/Authorize",
        "agent, admin",
    );
    expect_denied(
        ops.create_permit(h.permit(&["t"])).await,
        "ops-1",
        "atmost.v1.Permits/CreatePermit",
        "admin",
    );
    let listed = ops
        .list_uncertain(pb::ListUncertainRequest {
            permit_id: permit.clone(),
            page_size: 10,
            page_token: String::new(),
        })
        .await
        .expect("ops lists");
    assert_eq!(listed.attempts.len(), 1);
    let read = ops.get_attempt(&permit, "k1").await.expect("ops reads");
    assert_eq!(read.attempt.as_ref(), listed.attempts.first());
    ops.resolve(pb::ResolveRequest {
        permit_id: permit.clone(),
        idempotency_key: "k1".into(),
        attempt_id: String::new(),
        outcome: Some(resolved_failed("declined")),
    })
    .await
    .expect("ops resolves");
    // The refused calls changed nothing: one slot, no k2.
    let view = ops.get_permit(&permit).await.expect("ops reads");
    assert_eq!(view.usage[0].calls_made, 1);
    admin.revoke_permit(&permit).await.expect("admin revokes");

    // Health and reflection need no key.
    assert_eq!(
        health(&h.client, "atmost.v1.Gate").await.expect("health"),
        ServingStatus::Serving
    );
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            h.client.channel(),
        );
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let mut stream = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .expect("reflection without a key")
        .into_inner();
    assert!(stream.message().await.expect("a message").is_some());
}

/// The key file is read again when it changes, on the connections already
/// open; a file that does not parse keeps the keys in force.
/// GetAttempt hands out an attempt's fencing token (its attempt_id) only
/// to whom it cannot hurt: never while the attempt is RESERVED (its holder
/// has it from Authorize), and while UNCERTAIN only to operators and admins,
/// who may Resolve it anyway. Another agent of the tenant, reading the key
/// another worker holds, gets no id to Commit NotSent (freeing the slot
/// while that worker sends) or Commit Failed (releasing the cost of a call
/// that may have happened) with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_attempt_gives_an_open_attempts_token_only_to_reconcilers() {
    const SECOND_AGENT: &str = "agent-two-secret-0123456789";
    let _machine = shared().await;
    let keys = KeyFile::new(
        &[
            three_keys(),
            entry("agent-2", SECOND_AGENT, "acme", "\"agent\""),
        ]
        .concat(),
    );
    let h = authed_harness(&keys).await;
    let (admin, holder, ops) = (as_key(&h, ADMIN), as_key(&h, AGENT), as_key(&h, OPS));
    let other = as_key(&h, SECOND_AGENT);
    let permit = admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("create")
        .permit_id;
    let held = holder
        .authorize(authorize_request(&permit, "k1"))
        .await
        .expect("dispatch")
        .attempt
        .expect("an attempt");
    assert!(!held.attempt_id.is_empty());
    let id_read_by = |client: atmost_client::Client| {
        let permit = permit.clone();
        async move {
            client
                .get_attempt(&permit, "k1")
                .await
                .expect("get")
                .attempt
                .expect("an attempt")
                .attempt_id
        }
    };
    // RESERVED: nobody reads it, whatever the role.
    for reader in [&other, &holder, &ops, &admin] {
        assert_eq!(id_read_by(reader.clone()).await, "");
    }
    holder
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: permit.clone(),
            idempotency_key: "k1".into(),
            attempt_id: held.attempt_id.clone(),
            reason: "lost".into(),
        })
        .await
        .expect("mark");
    // UNCERTAIN: operators and admins read it; agents do not.
    assert_eq!(id_read_by(other.clone()).await, "");
    assert_eq!(id_read_by(holder.clone()).await, "");
    assert_eq!(id_read_by(ops.clone()).await, held.attempt_id);
    assert_eq!(id_read_by(admin.clone()).await, held.attempt_id);
    // The other agent has nothing to settle it with.
    let (_, e) = expect_error(
        other
            .commit(pb::CommitRequest {
                permit_id: permit.clone(),
                idempotency_key: "k1".into(),
                attempt_id: id_read_by(other.clone()).await,
                outcome: Some(pb::commit_request::Outcome::Failed(pb::Failed {
                    reason: "forged".into(),
                })),
            })
            .await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(e.violated_fields(), ["attempt_id"]);
    let still = ops.get_attempt(&permit, "k1").await.expect("get");
    assert_eq!(
        still.attempt.expect("an attempt").state(),
        pb::AttemptState::Uncertain
    );
    // Once settled, the id settles nothing more: every reader sees it.
    ops.resolve(pb::ResolveRequest {
        permit_id: permit.clone(),
        idempotency_key: "k1".into(),
        attempt_id: held.attempt_id.clone(),
        outcome: Some(resolved_failed("declined")),
    })
    .await
    .expect("resolve");
    assert_eq!(id_read_by(other).await, held.attempt_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_key_file_takes_effect_on_open_connections_and_a_broken_one_changes_nothing() {
    let _machine = shared().await;
    let keys = KeyFile::new(&three_keys());
    let h = authed_harness(&keys).await;
    let admin = as_key(&h, ADMIN);
    admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("admin creates");

    // The admin key is removed (its holder left): refused on the same
    // connection, while a new key works, with no restart.
    const NEW_ADMIN: &str = "new-admin-secret-0123456789";
    keys.write(&entry("admin-2", NEW_ADMIN, "acme", "\"admin\""));
    let refused = until(|| async { admin.create_permit(h.permit(&["t"])).await.is_err() }).await;
    assert!(refused, "the removed key still works");
    expect_error(
        admin.create_permit(h.permit(&["t"])).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let new_admin = as_key(&h, NEW_ADMIN);
    new_admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("the new key works");

    // A broken file: the keys in force stay.
    keys.write("[[key]]\nid = \"half written");
    tokio::time::sleep(Duration::from_millis(200)).await;
    new_admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("still in force");
    // An empty one (a write caught halfway): the keys in force stay too.
    keys.write("");
    tokio::time::sleep(Duration::from_millis(200)).await;
    new_admin
        .create_permit(h.permit(&["t"]))
        .await
        .expect("still in force");
    expect_error(
        admin.create_permit(h.permit(&["t"])).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
}

/// Polls `check` until it holds (up to 5 s).
async fn until<F, Fut>(check: F) -> bool
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The real binary: `--auth-keys` at start-up, and SIGHUP reloads the file
/// (SIGHUP's default action would end the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_with_keys_and_reloads_them_on_sighup() {
    let _machine = shared().await;
    let keys = KeyFile::new(&three_keys());
    let process = spawn_atmost(&["--auth-keys", keys.path.to_str().expect("utf-8 path")]);
    let client = process.client().await;
    expect_error(
        client
            .create_permit(
                NewPermit::new(["t"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let admin = client.clone().with_api_key(ADMIN).expect("ascii");
    admin
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("admin creates");

    const NEW_ADMIN: &str = "sighup-admin-secret-0123456789";
    keys.write(&entry("admin-2", NEW_ADMIN, "acme", "\"admin\""));
    let status = std::process::Command::new("kill")
        .args(["-HUP", &process.pid().to_string()])
        .status()
        .expect("kill -HUP");
    assert!(status.success());
    let new_admin = client.clone().with_api_key(NEW_ADMIN).expect("ascii");
    let works = until(|| async {
        new_admin
            .create_permit(
                NewPermit::new(["t"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await
            .is_ok()
    })
    .await;
    assert!(
        works,
        "the reloaded key works, and the process survived SIGHUP"
    );
    expect_error(
        admin
            .create_permit(
                NewPermit::new(["t"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
}

/// Runs `atmost serve <args>` (with its own --listen), expected to exit;
/// its exit status and stderr.
fn refused(args: &[&str]) -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .arg("serve")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run atmost");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Without keys atmost is in dev mode: loopback only, unless told it is
/// meant to be open; a key file that cannot be read stops it at start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_is_loopback_only_and_a_bad_key_file_stops_start_up() {
    let _machine = shared().await;
    let (status, stderr) = refused(&["--listen", "0.0.0.0:0"]);
    assert!(!status.success());
    assert!(
        stderr.contains("without authentication") && stderr.contains("--auth-keys"),
        "{stderr}"
    );

    let missing =
        std::env::temp_dir().join(format!("atmost-no-such-{}.toml", uuid::Uuid::now_v7()));
    let (status, stderr) = refused(&[
        "--listen",
        "127.0.0.1:0",
        "--auth-keys",
        missing.to_str().expect("utf-8"),
    ]);
    assert!(!status.success());
    assert!(
        stderr.contains(missing.to_str().expect("utf-8")),
        "{stderr}"
    );

    let broken = KeyFile::new(&entry("a b", "k", "acme", "\"agent\""));
    let (status, stderr) = refused(&[
        "--listen",
        "127.0.0.1:0",
        "--auth-keys",
        broken.path.to_str().expect("utf-8"),
    ]);
    assert!(!status.success());
    assert!(
        stderr.contains("key 1 (id \"a b\"): id must be"),
        "{stderr}"
    );

    let (status, stderr) = refused(&[
        "--listen",
        "127.0.0.1:0",
        "--auth-keys",
        broken.path.to_str().expect("utf-8"),
        "--insecure-no-auth",
    ]);
    assert!(!status.success());
    assert!(
        stderr.contains("--insecure-no-auth and --auth-keys contradict each other"),
        "{stderr}"
    );

    // Open on purpose: it serves (reached here over loopback).
    let open = spawn_atmost(&["--insecure-no-auth"]);
    let client = open.client().await;
    client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("open");
}

/// `--reflection=false` turns reflection off; the services still answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_can_be_turned_off() {
    let _machine = shared().await;
    let process = spawn_atmost(&["--reflection=false"]);
    let client = process.client().await;
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
            client.channel(),
        );
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let status = reflection
        .server_reflection_info(tokio_stream::once(request))
        .await
        .expect_err("no reflection");
    assert_eq!(status.code(), Code::Unimplemented);
    client
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("the services answer");
}

/// Two tenants on one atmost: a permit belongs to the tenant of the key
/// that created it, and another tenant's keys find nothing, on both stores.
async fn tenants_are_isolated(kind: Kind) {
    const OTHER_ADMIN: &str = "globex-admin-secret-0123456789";
    const OTHER_OPS: &str = "globex-ops-secret-0123456789";
    const SECOND_AGENT: &str = "agent-two-secret-0123456789";
    let keys = KeyFile::new(
        &[
            three_keys(),
            entry("agent-2", SECOND_AGENT, "acme", "\"agent\""),
            entry("globex-admin", OTHER_ADMIN, "globex", "\"admin\""),
            entry("globex-ops", OTHER_OPS, "globex", "\"operator\""),
        ]
        .concat(),
    );
    let h = authed_harness_on(&keys, kind).await;
    let (admin, agent, ops) = (as_key(&h, ADMIN), as_key(&h, AGENT), as_key(&h, OPS));
    let (other_admin, other_ops) = (as_key(&h, OTHER_ADMIN), as_key(&h, OTHER_OPS));

    // The server sets the tenant; a client may not.
    let mut spec = h.permit(&["t"]);
    spec.agents = vec!["agent-1".into()];
    let permit = admin.create_permit(spec).await.expect("create");
    assert_eq!(permit.tenant, "acme");
    assert_eq!(permit.agents, ["agent-1"]);
    let mut forged = h.permit(&["t"]);
    forged.tenant = "globex".into();
    let (_, e) = expect_error(
        admin.create_permit(forged).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(e.violated_fields(), vec!["permit.status"]);
    let id = permit.permit_id;
    let a = agent
        .authorize(authorize_request(&id, "k1"))
        .await
        .expect("agent-1 may")
        .attempt
        .expect("a");
    agent
        .mark_uncertain(pb::MarkUncertainRequest {
            permit_id: id.clone(),
            idempotency_key: "k1".into(),
            attempt_id: a.attempt_id.clone(),
            reason: "lost".into(),
        })
        .await
        .expect("mark");

    // Another tenant: every RPC answers as if the permit did not exist.
    let not_found = |r: Result<(), atmost_client::Error>| {
        expect_error(r, Code::NotFound, "PERMIT_NOT_FOUND");
    };
    not_found(other_admin.get_permit(&id).await.map(drop));
    not_found(other_admin.get_attempt(&id, "k1").await.map(drop));
    not_found(other_ops.get_attempt(&id, "k1").await.map(drop));
    not_found(
        other_admin
            .authorize(authorize_request(&id, "k2"))
            .await
            .map(drop),
    );
    not_found(
        other_admin
            .authorize(authorize_request(&id, "k1"))
            .await
            .map(drop),
    );
    not_found(
        other_admin
            .commit(pb::CommitRequest {
                permit_id: id.clone(),
                idempotency_key: "k1".into(),
                attempt_id: a.attempt_id.clone(),
                outcome: Some(succeeded(b"forged", None)),
            })
            .await
            .map(drop),
    );
    not_found(
        other_ops
            .resolve(pb::ResolveRequest {
                permit_id: id.clone(),
                idempotency_key: "k1".into(),
                attempt_id: String::new(),
                outcome: Some(resolved_succeeded(b"forged receipt", None)),
            })
            .await
            .map(drop),
    );
    not_found(other_admin.revoke_permit(&id).await.map(drop));
    not_found(
        other_ops
            .list_uncertain(pb::ListUncertainRequest {
                permit_id: id.clone(),
                page_size: 10,
                page_token: String::new(),
            })
            .await
            .map(drop),
    );
    let everywhere = other_ops
        .list_uncertain(pb::ListUncertainRequest::default())
        .await
        .expect("its own tenant's listing");
    assert!(everywhere.attempts.is_empty(), "{everywhere:?}");
    // Its own tenant sees it all.
    let own = ops
        .list_uncertain(pb::ListUncertainRequest::default())
        .await
        .expect("list");
    assert_eq!(own.attempts.len(), 1);

    // An agent the permit does not name finds nothing either; operators
    // and admins of the tenant are not limited by the list.
    let second = as_key(&h, SECOND_AGENT);
    not_found(second.get_permit(&id).await.map(drop));
    not_found(second.get_attempt(&id, "k1").await.map(drop));
    not_found(
        second
            .authorize(authorize_request(&id, "k3"))
            .await
            .map(drop),
    );
    ops.get_permit(&id).await.expect("an operator reads it");
    let seen = ops.get_attempt(&id, "k1").await.expect("and its attempt");
    assert_eq!(
        seen.attempt.expect("a").state(),
        pb::AttemptState::Uncertain
    );
    agent
        .get_attempt(&id, "k1")
        .await
        .expect("the agent it names reads it");
    admin
        .authorize(authorize_request(&id, "k4"))
        .await
        .expect("an admin may");

    // Nothing the other tenant tried changed anything.
    let view = admin.get_permit(&id).await.expect("get");
    assert_eq!(view.usage[0].calls_made, 2);
    assert_eq!(view.permit.expect("p").status(), pb::PermitStatus::Active);
    let replay = agent
        .authorize(authorize_request(&id, "k1"))
        .await
        .expect("replay");
    assert_eq!(
        replay.attempt.expect("a").state(),
        pb::AttemptState::Uncertain
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_on_memory() {
    let _machine = shared().await;
    tenants_are_isolated(Kind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_on_redis() {
    let _machine = shared().await;
    tenants_are_isolated(Kind::Redis).await;
}

/// Every state-changing RPC leaves one event on the audit trail (a JSON
/// line with target `atmost::audit`, on stderr by default), refused ones
/// too: who, which RPC, which permit, tool
/// and key, what was decided. Never a key, a fingerprint or a result, and a
/// subject with a newline cannot forge a log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_changing_rpcs_leave_an_audit_trail() {
    use std::io::BufRead;
    let _machine = shared().await;
    let keys = KeyFile::new(&three_keys());
    let log = keys.dir.join("stderr.jsonl");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--auth-keys",
        ])
        .arg(&keys.path)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start atmost");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .strip_prefix("atmost listening on ")
        .expect("listening");
    let client = atmost_client::Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let (admin, agent) = (
        client.clone().with_api_key(ADMIN).expect("ascii"),
        client.clone().with_api_key(AGENT).expect("ascii"),
    );
    let spec = || {
        let mut p = NewPermit::new(["t"])
            .expires_at_ms(atmost_client::now_ms() + 60_000)
            .build();
        p.subject = "agent-7\n{\"forged\":\"line\"}".into();
        p
    };
    expect_error(
        client.create_permit(spec()).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let permit = admin.create_permit(spec()).await.expect("create").permit_id;
    let mut request = authorize_request(&permit, "charge-1");
    request.request_fingerprint = b"FINGERPRINT-BYTES".to_vec();
    let a = agent
        .authorize(request.clone())
        .await
        .expect("authorize")
        .attempt
        .expect("a");
    agent
        .commit(pb::CommitRequest {
            permit_id: permit.clone(),
            idempotency_key: "charge-1".into(),
            attempt_id: a.attempt_id.clone(),
            outcome: Some(succeeded(b"SECRET-RESULT", None)),
        })
        .await
        .expect("commit");
    agent.authorize(request).await.expect("replay");
    expect_error(
        agent.revoke_permit(&permit).await,
        Code::PermissionDenied,
        "ROLE_NOT_ALLOWED",
    );
    // SIGTERM: the audit trail is flushed on the way out.
    stop(&mut child);

    let text = std::fs::read_to_string(&log).expect("log");
    let mut trail = Vec::new();
    for line in text.lines() {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON event per line ({e}): {line:?}"));
        for secret in ["FINGERPRINT", "SECRET-RESULT", ADMIN, AGENT, "forged\":"] {
            assert!(!line.contains(secret), "{secret:?} in the log: {line}");
        }
        if event["target"] == "atmost::audit" {
            let f = &event;
            let s = |k: &str| f[k].as_str().unwrap_or_default().to_owned();
            trail.push((
                s("rpc"),
                s("key_id"),
                s("tenant"),
                s("permit_id"),
                s("idempotency_key"),
                s("outcome"),
                s("attempt_id"),
            ));
        }
    }
    let expected = vec![
        ("CreatePermit", "", "", "", "", "UNAUTHENTICATED", ""),
        (
            "CreatePermit",
            "admin-1",
            "acme",
            permit.as_str(),
            "",
            "CREATED",
            "",
        ),
        (
            "Authorize",
            "agent-1",
            "acme",
            permit.as_str(),
            "charge-1",
            "DISPATCH",
            a.attempt_id.as_str(),
        ),
        (
            "Commit",
            "agent-1",
            "acme",
            permit.as_str(),
            "charge-1",
            "SUCCEEDED",
            a.attempt_id.as_str(),
        ),
        (
            "Authorize",
            "agent-1",
            "acme",
            permit.as_str(),
            "charge-1",
            "REPLAY",
            a.attempt_id.as_str(),
        ),
        (
            "RevokePermit",
            "agent-1",
            "",
            "",
            "",
            "ROLE_NOT_ALLOWED",
            "",
        ),
    ];
    let expected: Vec<_> = expected
        .into_iter()
        .map(|(a, b, c, d, e, f, g)| {
            (
                a.to_owned(),
                b.to_owned(),
                c.to_owned(),
                d.to_owned(),
                e.to_owned(),
                f.to_owned(),
                g.to_owned(),
            )
        })
        .collect();
    assert_eq!(trail, expected);
    // The subject is logged escaped, on its own line.
    assert!(text.contains(r#""subject":"agent-7\\n{"#), "{text}");
}

/// SIGTERM, then the exit (a SIGKILL after 20 s).
fn stop(child: &mut std::process::Child) {
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("atmost did not exit within 20 s of SIGTERM");
}

/// A TLS channel to `addr`, trusting `ca`, presenting `identity` if given.
async fn tls_client(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&(String, String)>,
) -> Result<atmost_client::Client, tonic::transport::Error> {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(atmost_client::Client::new(channel))
}

/// TLS to callers, and mTLS: a client certificate the CA verified, whose
/// SAN the key file names, stands in for a key; any other is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_client_certificates_authenticate_callers() {
    let _machine = shared().await;
    let pki = Pki::new();
    let server = pki.issue(&["localhost"]);
    let runner = pki.issue(&["spiffe://test/ns/agents/sa/runner"]);
    let stranger = pki.issue(&["spiffe://test/ns/agents/sa/stranger"]);
    let other_ca = Pki::new();
    let forged = other_ca.issue(&["spiffe://test/ns/agents/sa/runner"]);

    let keys = KeyFile::new(&format!(
        "{}[[cert]]\nid = \"runner\"\nsan = \"spiffe://test/ns/agents/sa/runner\"\ntenant = \"acme\"\nroles = [\"agent\"]\n",
        three_keys()
    ));
    let file = |name: &str, text: &str| keys.beside(name, text);
    let (cert, key, ca) = (
        file("server.pem", &server.0),
        file("server.key", &server.1),
        file("ca.pem", &pki.ca_pem),
    );
    let process = spawn_atmost(&[
        "--auth-keys",
        keys.path.to_str().expect("utf-8"),
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ]);
    let addr = process.addr();

    // Plaintext gets no answer from a TLS port.
    let plain = atmost_client::Client::connect(format!("http://{addr}")).await;
    if let Ok(plain) = plain {
        let r = plain.get_permit(&uuid::Uuid::now_v7().to_string()).await;
        assert!(
            r.as_ref().is_err_and(|e| e.reason_name().is_none()),
            "{r:?}"
        );
    }

    // Over TLS, a key works as before; no key and no certificate does not.
    let tls = tls_client(addr, &pki.ca_pem, None).await.expect("tls");
    expect_error(
        tls.create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    let admin = tls.clone().with_api_key(ADMIN).expect("ascii");
    let permit = admin
        .create_permit(
            NewPermit::new(["t"])
                .expires_at_ms(atmost_client::now_ms() + 60_000)
                .build(),
        )
        .await
        .expect("admin over TLS")
        .permit_id;

    // The runner's certificate: an agent of acme, no key needed.
    let runner_client = tls_client(addr, &pki.ca_pem, Some(&runner))
        .await
        .expect("mtls");
    let r = runner_client
        .authorize(authorize_request(&permit, "k1"))
        .await
        .expect("agent by certificate");
    assert_eq!(r.decision(), pb::Decision::Dispatch);
    expect_denied(
        runner_client
            .create_permit(
                NewPermit::new(["t"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await,
        "runner",
        "atmost.v1.Permits/CreatePermit",
        "admin",
    );
    // A certificate the CA signed but the file does not name: refused.
    let stranger_client = tls_client(addr, &pki.ca_pem, Some(&stranger))
        .await
        .expect("mtls");
    expect_error(
        stranger_client
            .authorize(authorize_request(&permit, "k2"))
            .await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    );
    // A certificate another CA signed, with the runner's SAN: the
    // handshake fails; nothing is answered.
    match tls_client(addr, &pki.ca_pem, Some(&forged)).await {
        Err(_) => {}
        Ok(c) => {
            let r = c.authorize(authorize_request(&permit, "k3")).await;
            assert!(
                r.as_ref().is_err_and(|e| e.reason_name().is_none()),
                "{r:?}"
            );
        }
    }
    let view = admin.get_permit(&permit).await.expect("get");
    assert_eq!(
        view.usage[0].calls_made, 1,
        "only the runner's call counted"
    );
}

/// A caller that gives up while its Authorize's script is on its way to
/// Redis (here: held by a proxy past the caller's 300 ms deadline) leaves
/// a CANCELLED event: the reservation may have been made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_leaves_a_cancelled_audit_event() {
    use crate::support::proxy::{HOLD, Mode, Proxy};
    use std::io::BufRead;
    let _machine = shared().await;
    let redis = Redis::start_owned();
    let proxy = Proxy::for_redis(&redis.url).await;
    let dir = std::env::temp_dir().join(format!("atmost-cancel-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let log = dir.join("stderr.jsonl");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_atmost"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--store",
            "redis",
        ])
        .args(["--redis-url", &proxy.url(), "--redis-prefix", &redis.prefix])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start atmost");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .strip_prefix("atmost listening on ")
        .expect("listening")
        .to_owned();
    let client = atmost_client::Client::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let permit = until_created(&client).await;
    proxy.set_mode(HOLD);
    let r = client
        .clone()
        .with_timeout(Duration::from_millis(300))
        .authorize(authorize_request(&permit, "abandoned"))
        .await;
    assert!(r.is_err(), "{r:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.set_mode(Mode::Pass);
    // SIGTERM: the audit trail is flushed on the way out.
    stop(&mut child);
    let text = std::fs::read_to_string(&log).expect("log");
    let cancelled = text.lines().any(|line| {
        let f: serde_json::Value = serde_json::from_str(line).expect("JSON");
        f["target"] == "atmost::audit"
            && f["rpc"] == "Authorize"
            && f["idempotency_key"] == "abandoned"
            && f["outcome"] == "CANCELLED"
    });
    assert!(cancelled, "no CANCELLED event in:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// CreatePermit, retried while the store comes up.
async fn until_created(client: &atmost_client::Client) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match client
            .create_permit(
                NewPermit::new(["t"])
                    .expires_at_ms(atmost_client::now_ms() + 60_000)
                    .build(),
            )
            .await
        {
            Ok(p) => return p.permit_id,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}
