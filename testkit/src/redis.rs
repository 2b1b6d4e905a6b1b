//! The Redis of one test: its own `redis-server`, or a shared one named by
//! `REDIS_URL`; either way with a key prefix of its own, so tests run in
//! parallel without seeing each other's keys.

use crate::RedisServer;
use std::path::PathBuf;

/// A Redis for one test: its own `redis-server` on a free loopback port,
/// killed on drop (also when the test panics), or the one named by
/// `REDIS_URL`, shared, with a key prefix of this test's own.
pub struct Redis {
    pub url: String,
    pub prefix: String,
    server: Option<RedisServer>,
    /// A data directory of this Redis's own, removed on drop.
    data_dir: Option<PathBuf>,
}

fn prefix() -> String {
    format!("t{}", uuid::Uuid::now_v7().simple())
}

/// Empties Redis's functions: atmost's next call finds its function
/// missing (it did not run), loads its library and calls again.
pub async fn flush_scripts(conn: &mut redis::aio::MultiplexedConnection) {
    redis::cmd("FUNCTION")
        .arg("FLUSH")
        .exec_async(conn)
        .await
        .expect("FUNCTION FLUSH");
}

impl Redis {
    /// `REDIS_URL`'s Redis if it is set, else one of the test's own.
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

    /// A `redis-server` of this test's own with extra settings (e.g.
    /// `--maxmemory-policy allkeys-lru`).
    pub fn start_owned_with(args: &[&str]) -> Self {
        Self::owned(args, None)
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

    fn owned(args: &[&str], data_dir: Option<PathBuf>) -> Self {
        let server = RedisServer::start_with(args).unwrap_or_else(|e| panic!("{e}"));
        Self {
            url: server.url(),
            prefix: prefix(),
            server: Some(server),
            data_dir,
        }
    }

    /// A connection of the test's own to this Redis, beside atmost's.
    pub async fn connect(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("client")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis")
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

    /// Starts it again on the same port with other settings (empty).
    pub fn restart_with(&mut self, args: &[&str]) {
        self.server
            .as_mut()
            .expect("only an owned Redis can be restarted")
            .restart_with(args)
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
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.server.take();
        if let Some(dir) = self.data_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
