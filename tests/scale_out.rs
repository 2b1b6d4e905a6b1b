//! Scale-out on real replicated Redis: a Redis Cluster (3 primaries, 3
//! replicas), a primary with a replica, and Sentinel (1 primary, 1 replica,
//! 3 Sentinels), all `redis-server` processes on free loopback ports,
//! tethered to this process. The behavioural suite itself also runs on the
//! shared Cluster (`behaviour::*::cluster`).

use crate::support::*;
use atmost::store::Backend;
use atmost::store::redis::{Durability, Mode, RedisConfig, RedisStore, Time};
use atmost_testkit::RedisServer;
use atmost_testkit::topology::{RedisCluster, RedisSentinel, redis_cli};
use pb::Decision;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use tonic::Code;

/// A store on `url` in `mode`, deciding on the caller's clock (the
/// harness's), under a fresh prefix.
fn store(url: &str, mode: Mode, durability: Durability, timeout: Duration) -> RedisStore {
    let prefix = format!("t{}", uuid::Uuid::now_v7().simple());
    store_under(&prefix, url, mode, durability, timeout)
}

/// [`store`] under `prefix`: another atmost replica of the same deployment.
fn store_under(
    prefix: &str,
    url: &str,
    mode: Mode,
    durability: Durability,
    timeout: Duration,
) -> RedisStore {
    RedisStore::connect(&RedisConfig {
        url: url.to_owned(),
        mode,
        durability,
        timeout,
        retention_ms: DAY_MS,
        time: Time::Caller,
        ..RedisConfig::new("", prefix)
    })
    .expect("store")
}

/// The real server, in process, on `store`.
async fn serve(store: RedisStore) -> Harness {
    Harness::serve(Backend::Redis(store), None, |app| app).await
}

/// The slot of a permit's keys.
fn slot_of(port: u16, permit_id: &str) -> u16 {
    redis_cli(port, &["cluster", "keyslot", &format!("{{{permit_id}}}")])
        .expect("CLUSTER KEYSLOT")
        .trim()
        .parse()
        .expect("a slot")
}

/// `calls=` of `cmdstat_<name>` in a node's `INFO commandstats`.
fn calls(port: u16, name: &str) -> u64 {
    let info = redis_cli(port, &["info", "commandstats"]).expect("INFO commandstats");
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

async fn poll_until(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Permits land on every shard (their ids are random, their keys share
/// one hash tag), each shard answers for its own, and the cross-permit
/// listing, which walks the tenant's index on one shard and reads each
/// permit on its own, finds every uncertain attempt on all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_spread_over_every_primary_and_are_listed_across_them() {
    let _machine = shared().await;
    let h = Harness::start(Kind::Cluster).await;
    let seed: u16 = shared_cluster()
        .split(',')
        .next()
        .and_then(|u| u.rsplit(':').next()?.parse().ok())
        .expect("a seed port");
    let mut shards = HashSet::new();
    let mut marked = HashSet::new();
    for i in 0..24 {
        let permit = h.create_with(&["t"], &[], None).await;
        let a = h.dispatch(&permit, "t", &format!("k{i}"), b"fp", 1).await;
        h.mark_uncertain(&a, "timeout").await.expect("mark");
        marked.insert((permit.clone(), a.idempotency_key.clone()));
        let out = redis_cli(seed, &["cluster", "shards"]).expect("CLUSTER SHARDS");
        let slot = slot_of(seed, &permit);
        // The shard: which slot range of CLUSTER SHARDS holds it.
        let ranges: Vec<(u16, u16)> = out
            .lines()
            .collect::<Vec<_>>()
            .windows(3)
            .filter(|w| w[0] == "slots")
            .filter_map(|w| Some((w[1].parse().ok()?, w[2].parse().ok()?)))
            .collect();
        let shard = ranges
            .iter()
            .position(|(a, b)| (*a..=*b).contains(&slot))
            .unwrap_or_else(|| panic!("slot {slot} in no shard of {ranges:?}"));
        shards.insert(shard);
    }
    assert_eq!(shards.len(), 3, "24 permits landed on {shards:?}");
    let listed: HashSet<(String, String)> = h
        .client
        .list_all_uncertain("", 5)
        .await
        .expect("list across permits")
        .into_iter()
        .map(|a| (a.permit_id, a.idempotency_key))
        .collect();
    assert_eq!(listed, marked, "the listing across shards");
}

/// Each cluster started here is its own (these tests kill and move things).
fn own_cluster() -> RedisCluster {
    RedisCluster::start(3, 1, &[]).unwrap_or_else(|e| panic!("{e}"))
}

/// A slot moved to another primary under a live permit: the store's next
/// script meets MOVED (it did not run), follows it, and the key replays;
/// a shard that lost its functions (function not found: it did not run) is
/// sent the library and answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moved_slots_and_flushed_scripts_are_followed_not_guessed() {
    let _machine = shared().await;
    let cluster = own_cluster();
    let h = serve(store(
        &cluster.urls(),
        Mode::Cluster,
        Durability::None,
        Duration::from_secs(2),
    ))
    .await;
    let permit = h.create_with(&["t"], &[("t", 1)], None).await;
    let a = h.dispatch(&permit, "t", "k", b"fp", 1).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    let seed = cluster.nodes[0].port();
    let slot = slot_of(seed, &permit);
    let from = cluster.primary_of_slot(slot).expect("the slot's primary");
    let to = cluster
        .primaries()
        .into_iter()
        .find(|p| *p != from)
        .expect("another primary");
    let id = |port: u16| {
        redis_cli(port, &["cluster", "myid"])
            .expect("CLUSTER MYID")
            .trim()
            .to_owned()
    };
    let (from_id, to_id) = (id(from), id(to));
    let slot_arg = slot.to_string();
    redis_cli(
        to,
        &["cluster", "setslot", &slot_arg, "importing", &from_id],
    )
    .expect("importing");
    redis_cli(
        from,
        &["cluster", "setslot", &slot_arg, "migrating", &to_id],
    )
    .expect("migrating");
    let keys = redis_cli(from, &["cluster", "getkeysinslot", &slot_arg, "100"]).expect("keys");
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(keys.len() >= 3, "the permit's keys: {keys:?}");
    let to_arg = to.to_string();
    let mut migrate = vec!["migrate", "127.0.0.1", &to_arg, "", "0", "5000", "keys"];
    migrate.extend(keys.iter().copied());
    redis_cli(from, &migrate).expect("MIGRATE");
    for p in cluster.primaries() {
        redis_cli(p, &["cluster", "setslot", &slot_arg, "node", &to_id]).expect("setslot node");
    }
    assert_eq!(cluster.primary_of_slot(slot), Some(to), "the slot moved");

    let before = calls(to, "fcall");
    let replay = h
        .authorize(&permit, "t", "k", b"fp", 1)
        .await
        .expect("the key after its slot moved");
    assert_eq!(replay.decision(), Decision::Replay, "{replay:?}");
    assert_eq!(replay.attempt.expect("a").attempt_id, a.attempt_id);
    assert!(
        calls(to, "fcall") > before,
        "the script ran on the new primary"
    );
    let refused = h.authorize(&permit, "t", "k2", b"fp", 1).await.unwrap_err();
    assert_eq!(refused.reason_name(), Some("PERMIT_MAX_CALLS_EXCEEDED"));

    // Every primary forgets its functions: each permit's shard is sent the
    // library.
    let primaries = cluster.primaries();
    for p in &primaries {
        redis_cli(*p, &["function", "flush"]).expect("FUNCTION FLUSH");
    }
    let loads: Vec<u64> = primaries
        .iter()
        .map(|p| calls(*p, "function|load"))
        .collect();
    let mut i = 0;
    while !primaries
        .iter()
        .zip(&loads)
        .all(|(p, before)| calls(*p, "function|load") > *before)
    {
        assert!(i < 60, "60 permits and a shard never had a script sent");
        let p = h.create_with(&["t"], &[], None).await;
        h.dispatch(&p, "t", &format!("n{i}"), b"fp", 1).await;
        i += 1;
    }
}

/// `--durability replica`: a write no replica acknowledges answers
/// UNAVAILABLE (the outcome is unknown: the primary has it), and the
/// same-key retry, once a replica is back, is answered from what the
/// primary recorded: one reservation, never two. `none` answers from the
/// primary alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durability_replica_waits_for_a_replica_and_a_same_key_retry_resolves_a_shortfall() {
    let _machine = shared().await;
    let primary = RedisServer::start().expect("primary");
    let replica_args = || {
        vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            primary.port().to_string(),
        ]
    };
    let mut replica = RedisServer::start_on(|_| replica_args()).expect("replica");
    let synced = |port: u16| {
        redis_cli(port, &["info", "replication"])
            .is_ok_and(|i| i.contains("connected_slaves:1") && i.contains("state=online"))
    };
    poll_until(Duration::from_secs(10), "replica in sync", || {
        synced(primary.port())
    })
    .await;

    let durable = serve(store(
        &primary.url(),
        Mode::Standalone,
        Durability::Replica,
        Duration::from_secs(1),
    ))
    .await;
    let permit = durable.create_with(&["t"], &[("t", 2)], None).await;
    let a = durable.dispatch(&permit, "t", "k1", b"fp", 1).await;
    durable
        .commit(&a, succeeded(b"ok", None))
        .await
        .expect("commit, acknowledged by the replica");

    // No replica: the write lands on the primary, unacknowledged.
    replica.kill();
    poll_until(Duration::from_secs(10), "primary sees no replica", || {
        redis_cli(primary.port(), &["info", "replication"])
            .is_ok_and(|i| i.contains("connected_slaves:0"))
    })
    .await;
    let started = Instant::now();
    let e = durable
        .authorize(&permit, "t", "k2", b"fp", 0)
        .await
        .expect_err("no replica acknowledged it");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(e.reason_name(), Some("STORE_UNAVAILABLE"), "{e:?}");
    assert!(
        e.to_string().contains("no replica acknowledged"),
        "WAIT's shortfall, not a timeout: {e:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "answered after WAIT's timeout (half the store timeout): {:?}",
        started.elapsed()
    );

    replica = RedisServer::start_on(|_| replica_args()).expect("replica back");
    poll_until(Duration::from_secs(10), "replica in sync again", || {
        synced(primary.port())
    })
    .await;
    // The same key: the reservation the primary recorded (in flight), not
    // a second one.
    // (A replica just back may still miss WAIT's 500 ms on a busy machine:
    // UNAVAILABLE, and the caller retries, as callers do.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let e = durable
            .authorize(&permit, "t", "k2", b"fp", 0)
            .await
            .expect_err("k2 is reserved");
        if e.code() != Code::Unavailable || Instant::now() > deadline {
            break e;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        retry.reason_name(),
        Some("IDEMPOTENCY_IN_PROGRESS"),
        "{retry:?}"
    );
    let refused = durable.authorize(&permit, "t", "k3", b"fp", 0).await;
    assert_eq!(
        refused.unwrap_err().reason_name(),
        Some("PERMIT_MAX_CALLS_EXCEEDED"),
        "k1 and k2 hold the two calls"
    );

    // `none` does not wait for the replica.
    replica.kill();
    let fast = serve(store(
        &primary.url(),
        Mode::Standalone,
        Durability::None,
        Duration::from_secs(1),
    ))
    .await;
    let p = fast.create_with(&["t"], &[], None).await;
    fast.dispatch(&p, "t", "k", b"fp", 0).await;
}

/// Sentinel: the store asks the Sentinels for the primary, and after the
/// primary dies and a replica is promoted, finds the new one. With
/// `--durability replica` every answered write is on the promoted replica
/// (the key replays after the failover), and writes wait until the new
/// primary has a replica again: the old one, restarted empty, which
/// Sentinel turns into its replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_finds_the_primary_and_follows_a_failover() {
    let _machine = shared().await;
    let mut topology = RedisSentinel::start(&[]).unwrap_or_else(|e| panic!("{e}"));
    let h = serve(store(
        &topology.urls(),
        Mode::Sentinel {
            master: topology.master.clone(),
        },
        Durability::Replica,
        Duration::from_secs(2),
    ))
    .await;
    let permit = h.create_with(&["t"], &[("t", 2)], None).await;
    let a = h.dispatch(&permit, "t", "k1", b"fp", 1).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    assert!(
        calls(topology.primary.port(), "fcall") > 0,
        "ran on the primary"
    );

    let old = topology.primary.port();
    topology.primary.kill();
    let killed = Instant::now();
    poll_until(
        Duration::from_secs(30),
        "Sentinel promotes the replica",
        || topology.named_primary() == Some(topology.replica.port()),
    )
    .await;
    // No replica yet: a write cannot be acknowledged (the first tries may
    // meet the broken connection to the dead primary instead).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let e = h.authorize(&permit, "t", "k1", b"fp", 1).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        if e.to_string().contains("no replica acknowledged") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never refused for want of a replica: {e:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    topology.primary.restart().expect("the old primary, back");
    // Requests fail (UNAVAILABLE) until then; after, they reach the new one.
    let mut answered = None;
    while answered.is_none() {
        assert!(
            killed.elapsed() < Duration::from_secs(40),
            "no service after the failover"
        );
        match h.authorize(&permit, "t", "k1", b"fp", 1).await {
            Ok(r) => answered = Some(r),
            Err(e) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let replay = answered.expect("answered");
    assert_eq!(
        replay.decision(),
        Decision::Replay,
        "k1 survived the failover"
    );
    assert_eq!(replay.attempt.expect("a").attempt_id, a.attempt_id);
    assert!(
        redis_cli(topology.replica.port(), &["info", "replication"])
            .is_ok_and(|i| i.contains("role:master") && i.contains("connected_slaves:1")),
        "the old primary (port {old}) serves as the new one's replica"
    );
    h.dispatch(&permit, "t", "k2", b"fp", 1).await;
}

/// The failover report: three atmost replicas under load from 32 agent
/// loops on a Cluster of the stress checker's own; 6 s in, the primary that
/// holds a permit is SIGKILLed, its replica promoted, and it rejoins as the
/// new primary's replica. Once with each `--durability`; the history check
/// then looks for over-admissions and lost keys. docs/guarantees.md,
/// "Durability and failover", reports these figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_report_under_load_for_each_durability() {
    let _alone = exclusive().await;
    use clap::Parser;
    // `replica` resumes once the old primary has rejoined and copied the
    // new one's data: more time after the kill. (When it resumed is
    // reported, not asserted: on this 2-core machine a replica that falls
    // behind by the WAIT timeout under load fails a write at any time.)
    for (durability, duration) in [("none", "20s"), ("replica", "30s")] {
        let args = atmost_stress::Args::parse_from([
            "atmost-stress",
            "--atmost-bin",
            env!("CARGO_BIN_EXE_atmost"),
            "--replicas",
            "3",
            "--clients",
            "32",
            "--duration",
            duration,
            "--drop-rate",
            "0",
            "--redis-mode",
            "cluster",
            "--durability",
            durability,
            "--failover-after",
            "6s",
        ]);
        let summary = atmost_stress::run(args, std::future::pending())
            .await
            .expect("the stress run");
        println!("failover, --durability {durability}: {summary}");
        for v in &summary.violations {
            println!("  violation: {v}");
        }
        let failover = summary.failover.clone().expect("a failover report");
        assert!(
            failover.promoted_after > Duration::ZERO,
            "a replica was promoted: {summary}"
        );
        assert!(
            failover.resumed_after > Duration::ZERO,
            "requests failed after the kill: {summary}"
        );

        assert!(summary.dispatches > 500, "{summary}");
        if durability == "replica" {
            assert!(
                summary.violations.is_empty(),
                "{summary}\n{:#?}",
                summary.violations
            );
        }
    }
}

/// The pid of the `redis-server` on `port`.
fn redis_pid(port: u16) -> String {
    redis_cli(port, &["info", "server"])
        .expect("INFO server")
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .expect("process_id")
        .trim()
        .to_owned()
}

fn signal(pid: &str, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, pid])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// What each `--durability` promises across a failover, shown on the
/// write it is about: the replica is frozen (SIGSTOP) and its link cut so it
/// misses it, the primary dies, the replica wakes and Sentinel promotes it.
///
/// - `none`: the write was answered DISPATCH from the primary alone; the
///   promoted replica never had it, so the same key is dispatched again. Two
///   DISPATCHes for one key: what asynchronous replication can cost.
/// - `replica`: no replica acknowledged the write, so it was answered
///   UNAVAILABLE; the caller did not dispatch, and its same-key retry after
///   the failover is the first DISPATCH it is given (with its holder token:
///   tries answered UNAVAILABLE while the new primary had no replica yet
///   reserved the key, and the one acknowledged redelivers it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_loses_an_unreplicated_write_and_only_replica_durability_never_answered_it() {
    let _machine = shared().await;
    for durability in [Durability::None, Durability::Replica] {
        let mut topology = RedisSentinel::start(&[]).unwrap_or_else(|e| panic!("{e}"));
        let h = serve(store(
            &topology.urls(),
            Mode::Sentinel {
                master: topology.master.clone(),
            },
            durability,
            Duration::from_secs(1),
        ))
        .await;
        let permit = h.create_with(&["t"], &[("t", 5)], None).await;
        h.dispatch(&permit, "t", "before", b"fp", 1).await;

        // Frozen, with its link cut (the primary's socket to it closed), so
        // nothing the primary writes next reaches it.
        let replica_pid = redis_pid(topology.replica.port());
        signal(&replica_pid, "-STOP");
        redis_cli(
            topology.primary.port(),
            &["client", "kill", "type", "replica"],
        )
        .expect("CLIENT KILL TYPE replica");
        // One logical call, its holder token sent with each try: a try
        // whose DISPATCH was not acknowledged is answered DISPATCH again on
        // the next (redelivered), not IN_PROGRESS.
        let call = || {
            h.client.authorize(pb::AuthorizeRequest {
                permit_id: permit.clone(),
                tool: "t".into(),
                idempotency_key: "k".into(),
                request_fingerprint: b"fp".to_vec(),
                cost: 1,
                holder_token: b"the one call".to_vec(),
                ..Default::default()
            })
        };
        let first = call().await;
        topology.primary.kill();
        signal(&replica_pid, "-CONT");
        poll_until(
            Duration::from_secs(30),
            "Sentinel promotes the replica",
            || topology.named_primary() == Some(topology.replica.port()),
        )
        .await;
        // The old primary comes back empty and becomes the new one's
        // replica, so `replica` durability can acknowledge again.
        topology.primary.restart().expect("the old primary, back");
        let deadline = Instant::now() + Duration::from_secs(30);
        let second = loop {
            match call().await {
                Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other.expect("the same key after the failover"),
            }
        };
        // What was acknowledged before the freeze survives either way.
        let deadline = Instant::now() + Duration::from_secs(30);
        let before = loop {
            match h.authorize(&permit, "t", "before", b"fp", 1).await {
                // The old primary may still be copying the new one's data.
                Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => break other,
            }
        };
        assert_eq!(
            before
                .map(|r| r.decision())
                .map_err(|e| e.reason_name().map(str::to_owned)),
            Err(Some("IDEMPOTENCY_IN_PROGRESS".to_owned())),
            "{durability:?}: the key reserved before the freeze is still held"
        );
        match durability {
            Durability::None => {
                let first = first.expect("answered by the primary alone");
                assert_eq!(first.decision(), Decision::Dispatch);
                assert_eq!(
                    second.decision(),
                    Decision::Dispatch,
                    "none: the promoted replica never had k, so k is dispatched again"
                );
                assert_ne!(
                    second.attempt.expect("a").attempt_id,
                    first.attempt.expect("a").attempt_id
                );
            }
            Durability::Replica => {
                let e = first.expect_err("no replica acknowledged it");
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                assert_eq!(
                    second.decision(),
                    Decision::Dispatch,
                    "replica: the first DISPATCH k ever got"
                );
            }
        }
    }
}

/// No blind retry on a Cluster: a script whose reply is lost (the commands
/// reach Redis and run; the answers never come back) is sent once, answered
/// UNAVAILABLE, and never re-sent by the cluster client behind the caller's
/// back. The caller's same-key retry is answered from what it recorded.
/// (The primary announces a fault proxy's port, so every client reaches it
/// through the proxy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_on_a_cluster_is_unavailable_and_never_resent() {
    let _machine = shared().await;
    let cluster = own_cluster();
    let seed = cluster.nodes[0].port();
    let permit = uuid::Uuid::now_v7().to_string();
    // The permit's primary, behind a proxy it announces.
    let primary = cluster
        .primary_of_slot(slot_of(seed, &permit))
        .expect("a primary");
    let proxy = proxy::Proxy::start(([127, 0, 0, 1], primary).into()).await;
    let proxy_port = proxy.addr().port().to_string();
    redis_cli(
        primary,
        &["config", "set", "cluster-announce-port", &proxy_port],
    )
    .expect("announce the proxy");
    let announced = format!("127.0.0.1:{proxy_port}@");
    poll_until(
        Duration::from_secs(20),
        "every node sees the proxy's port",
        || {
            cluster.nodes.iter().all(|n| {
                redis_cli(n.port(), &["cluster", "nodes"]).is_ok_and(|o| o.contains(&announced))
            })
        },
    )
    .await;
    let h = serve(store(
        &cluster.urls(),
        Mode::Cluster,
        Durability::None,
        Duration::from_secs(1),
    ))
    .await;
    // Permits until one lands behind the proxy.
    let mut permit = String::new();
    for _ in 0..60 {
        let p = h.create_with(&["t"], &[("t", 3)], None).await;
        // (CLUSTER NODES names it by the port it announces.)
        if cluster.primary_of_slot(slot_of(seed, &p)) == Some(proxy.addr().port()) {
            permit = p;
            break;
        }
    }
    assert!(!permit.is_empty(), "no permit on the proxied primary in 60");
    let request = || pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "t".into(),
        idempotency_key: "lost-reply-key".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 1,
        holder_token: b"holder".to_vec(),
        ..Default::default()
    };
    // The node has the library loaded (a missing function's answer lost
    // would prove nothing).
    h.dispatch(&permit, "t", "warm-up", b"fp", 1).await;
    // The reply is swallowed, then the connection breaks (the proxy closes
    // a connection that lost a reply when the mode changes): what a client
    // with retries would answer by reconnecting and sending it again.
    proxy.set_mode(proxy::Mode::DropReplies);
    let (client, first) = (h.client.clone(), request());
    let pending = tokio::spawn(async move { client.authorize(first).await });
    poll_until(Duration::from_secs(5), "the script reached Redis", || {
        proxy.count_command("FCALL", "lost-reply-key") == 1
    })
    .await;
    // The answer comes at the store deadline, its reply swallowed: only
    // then does the mode change (changed as soon as the script was seen, a
    // reply Redis sent a moment later, on a loaded machine, got through).
    let e = pending
        .await
        .expect("the call")
        .expect_err("the reply was lost");
    proxy.set_mode(proxy::Mode::Pass);
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    // Long enough for any retry redis-rs might make to have been sent.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        proxy.count_command("FCALL", "lost-reply-key"),
        1,
        "the script was sent once: {:?}",
        proxy.commands().len()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let again = loop {
        match h.client.authorize(request()).await {
            Err(e) if e.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other.expect("the same-key retry"),
        }
    };
    // It ran the first time: the same holder is handed the same attempt.
    assert_eq!(again.decision(), Decision::Dispatch, "{again:?}");
    assert!(again.redelivered, "{again:?}");
    assert_eq!(
        usage_calls(&h, &permit).await,
        2,
        "warm-up and one reservation, not two"
    );
}

async fn usage_calls(h: &Harness, permit: &str) -> u64 {
    h.get(permit)
        .await
        .expect("get")
        .usage
        .into_iter()
        .find(|u| u.tool == "t")
        .map_or(0, |u| u.calls_made)
}

/// `--durability replica` through two atmost replicas: an answer that
/// writes nothing (a redelivery) must not be acknowledged on the strength
/// of a replica that has not got the reservation it reads. The replica is
/// frozen (still connected, acknowledging nothing new): the reservation
/// through A is UNAVAILABLE, and so is the same holder's retry through B
/// (whose connection wrote nothing before), until the replica has it.
/// (Redis 7.0.15 already makes a WAIT from a connection that wrote nothing
/// wait here: this passes without the write atmost adds before each WAIT,
/// which keeps it so where WAIT counts only the connection's own writes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_is_acknowledged_only_once_a_replica_has_the_reservation() {
    let _machine = shared().await;
    let primary = RedisServer::start().expect("primary");
    let of = primary.port().to_string();
    let replica = RedisServer::start_on(|_| {
        vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            of.clone(),
            "--repl-diskless-sync-delay".into(),
            "0".into(),
        ]
    })
    .expect("replica");
    atmost_testkit::topology::wait_replicas_online(primary.port(), 1).expect("in sync");
    let prefix = format!("t{}", uuid::Uuid::now_v7().simple());
    let start = || async {
        serve(store_under(
            &prefix,
            &primary.url(),
            Mode::Standalone,
            Durability::Replica,
            Duration::from_secs(1),
        ))
        .await
    };
    let (a, b) = (start().await, start().await);
    let permit = a.create_with(&["t"], &[], None).await;
    let request = || pb::AuthorizeRequest {
        permit_id: permit.clone(),
        tool: "t".into(),
        idempotency_key: "k".into(),
        request_fingerprint: b"fp".to_vec(),
        cost: 1,
        holder_token: b"holder".to_vec(),
        ..Default::default()
    };
    let pid = redis_pid(replica.port());
    signal(&pid, "-STOP");
    let through_a = a.client.authorize(request()).await;
    let through_b = b.client.authorize(request()).await;
    signal(&pid, "-CONT");
    let e = through_a.expect_err("A's reservation unacknowledged");
    assert!(e.to_string().contains("no replica acknowledged"), "{e:?}");
    let e = through_b.expect_err("B's redelivery reads the unacknowledged reservation");
    assert!(e.to_string().contains("no replica acknowledged"), "{e:?}");
    let r = b
        .client
        .authorize(request())
        .await
        .expect("the replica has it now");
    assert_eq!(r.decision(), Decision::Dispatch);
    assert!(r.redelivered, "{r:?}");
}
