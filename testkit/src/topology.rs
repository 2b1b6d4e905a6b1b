//! Replicated Redis topologies of real `redis-server` processes on free
//! loopback ports: a Redis Cluster (`redis-cli --cluster create`) and a
//! primary with a replica watched by Sentinels. Every process is tethered
//! to this one ([`crate::process::Tethered`]): killed on drop, and also when
//! the test process ends without dropping it.

use crate::RedisServer;
use crate::process::free_port;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// `redis-cli -p <port> <args>`: its output, or why it failed.
pub fn redis_cli(port: u16, args: &[&str]) -> Result<String, String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .map_err(|e| format!("redis-cli: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `check` every 50 ms until it holds or `within` passes.
fn wait_until(within: Duration, what: &str, mut check: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("{what}: not within {within:?}"))
}

/// Waits until the primary on `port` has `n` replicas in sync (`state=online`:
/// the first full copy done; until then `WAIT` counts none of them).
pub fn wait_replicas_online(port: u16, n: usize) -> Result<(), String> {
    wait_until(Duration::from_secs(30), "replicas in sync", || {
        redis_cli(port, &["info", "replication"]).is_ok_and(|i| {
            i.contains(&format!("connected_slaves:{n}\r\n"))
                && i.matches("state=online").count() == n
        })
    })
}

/// A data directory of its own, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(kind: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("atmost-{kind}-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("create a Redis data directory");
        Self(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A Redis Cluster: `primaries` shards, each with `replicas` replicas.
pub struct RedisCluster {
    /// Every node, by port (killed ones stay, not running).
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts the nodes with `extra` settings, joins them with
    /// `redis-cli --cluster create`, and waits until every node reports
    /// the cluster ok and agrees on all 16384 slots.
    pub fn start(primaries: usize, replicas: usize, extra: &[&str]) -> Result<Self, String> {
        let mut nodes = Vec::new();
        for _ in 0..primaries * (1 + replicas) {
            // Each in its own directory (RedisServer's): nodes.conf, and a
            // replica's copy, which a restarted node loads.
            let node = RedisServer::start_on(|port| {
                let mut args: Vec<String> = vec![
                    "--cluster-enabled".into(),
                    "yes".into(),
                    "--cluster-port".into(),
                    free_port().to_string(),
                    "--cluster-config-file".into(),
                    format!("nodes-{port}.conf"),
                    "--cluster-node-timeout".into(),
                    "1000".into(),
                    // The first copy to a replica at once, not after 5 s.
                    "--repl-diskless-sync-delay".into(),
                    "0".into(),
                ];
                args.extend(extra.iter().map(|s| s.to_string()));
                args
            })
            .map_err(|e| e.to_string())?;
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addrs.iter().map(String::as_str));
        let replicas_arg = replicas.to_string();
        create.extend(["--cluster-replicas", &replicas_arg, "--cluster-yes"]);
        let out = Command::new("redis-cli")
            .args(&create)
            .output()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let cluster = Self { nodes };
        cluster.wait_ok(Duration::from_secs(30))?;
        for primary in cluster.primaries() {
            wait_replicas_online(primary, replicas)?;
        }
        Ok(cluster)
    }

    /// The comma-separated seed URLs of every node, for `--redis-url`.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running node reports `cluster_state:ok` and
    /// `redis-cli --cluster check` finds every slot covered and agreed on.
    pub fn wait_ok(&self, within: Duration) -> Result<(), String> {
        let ports = self.running_ports();
        wait_until(within, "cluster ok on every node", || {
            ports.iter().all(|p| {
                redis_cli(*p, &["cluster", "info"]).is_ok_and(|i| i.contains("cluster_state:ok"))
            }) && redis_cli(
                ports[0],
                &["--cluster", "check", &format!("127.0.0.1:{}", ports[0])],
            )
            .is_ok_and(|o| o.contains("[OK] All 16384 slots covered") && !o.contains("[ERR]"))
        })
    }

    fn running_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.is_running_now())
            .map(RedisServer::port)
            .collect()
    }

    /// The ports of the nodes that are primaries now (from `CLUSTER
    /// NODES`, as the first running node sees it), with slots.
    pub fn primaries(&self) -> Vec<u16> {
        self.primary_slots()
            .into_iter()
            .map(|(port, _)| port)
            .collect()
    }

    /// The primary that holds `slot` now.
    pub fn primary_of_slot(&self, slot: u16) -> Option<u16> {
        self.primary_slots()
            .into_iter()
            .find(|(_, ranges)| ranges.iter().any(|r| r.contains(&slot)))
            .map(|(port, _)| port)
    }

    /// Each live primary's port and slot ranges, from `CLUSTER NODES` as
    /// the first running node sees it (`<id> <ip:port@bus> <flags> ...`,
    /// slot ranges from the ninth field on).
    fn primary_slots(&self) -> Vec<(u16, Vec<std::ops::RangeInclusive<u16>>)> {
        let nodes = self
            .running_ports()
            .into_iter()
            .find_map(|p| redis_cli(p, &["cluster", "nodes"]).ok())
            .unwrap_or_default();
        nodes
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                    return None;
                }
                let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
                let ranges = f[8..]
                    .iter()
                    .filter_map(|range| {
                        let mut ends = range.split('-').map(|n| n.parse::<u16>().ok());
                        let first = ends.next()??;
                        Some(first..=ends.next().map_or(Some(first), |e| e)?)
                    })
                    .collect();
                Some((port, ranges))
            })
            .collect()
    }

    /// The node on `port`.
    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a node of this cluster")
    }
}

/// One primary, one replica, and three Sentinels (quorum 2) that call the
/// primary `master`.
pub struct RedisSentinel {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
    pub master: String,
    _dir: Dir,
}

impl RedisSentinel {
    /// Starts them (the data nodes with `extra` settings), and waits until
    /// every Sentinel knows the replica and the other two Sentinels.
    pub fn start(extra: &[&str]) -> Result<Self, String> {
        let dir = Dir::new("sentinel");
        let master = "atmost-primary".to_owned();
        let data = |args: Vec<String>| {
            let mut all = args;
            all.extend(["--repl-diskless-sync-delay".into(), "0".into()]);
            all.extend(extra.iter().map(|s| s.to_string()));
            all
        };
        let primary = RedisServer::start_on(|_| data(Vec::new())).map_err(|e| e.to_string())?;
        let of = primary.port().to_string();
        let replica = RedisServer::start_on(|_| {
            data(vec!["--replicaof".into(), "127.0.0.1".into(), of.clone()])
        })
        .map_err(|e| e.to_string())?;
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let conf = dir.0.join(format!("sentinel-{i}.conf"));
            // Sentinel rewrites its configuration file: one each.
            std::fs::write(
                &conf,
                format!(
                    "sentinel monitor {master} 127.0.0.1 {of} 2\n\
                     sentinel down-after-milliseconds {master} 1000\n\
                     sentinel failover-timeout {master} 10000\n\
                     sentinel parallel-syncs {master} 1\n"
                ),
            )
            .map_err(|e| e.to_string())?;
            let conf = conf.to_string_lossy().into_owned();
            let sentinel = RedisServer::start_on(|_| {
                // The configuration file first, as redis-server needs.
                vec![conf.clone(), "--sentinel".into()]
            })
            .map_err(|e| e.to_string())?;
            sentinels.push(sentinel);
        }
        wait_replicas_online(primary.port(), 1)?;
        let s = Self {
            primary,
            replica,
            sentinels,
            master,
            _dir: dir,
        };
        for sentinel in &s.sentinels {
            let port = sentinel.port();
            wait_until(
                Duration::from_secs(30),
                "Sentinel sees the replica and its peers",
                || {
                    redis_cli(port, &["sentinel", "master", &s.master]).is_ok_and(|out| {
                        let lines: Vec<&str> = out.lines().collect();
                        let field = |name: &str| {
                            lines
                                .iter()
                                .position(|l| *l == name)
                                .and_then(|i| lines.get(i + 1))
                                .copied()
                        };
                        field("num-slaves") == Some("1")
                            && field("num-other-sentinels") == Some("2")
                    })
                },
            )?;
        }
        Ok(s)
    }

    /// The comma-separated Sentinel URLs, for `--redis-url`.
    pub fn urls(&self) -> String {
        self.sentinels
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The primary's port as the first answering Sentinel names it.
    pub fn named_primary(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let out = redis_cli(
                s.port(),
                &["sentinel", "get-master-addr-by-name", &self.master],
            )
            .ok()?;
            out.lines().nth(1)?.trim().parse().ok()
        })
    }
}
