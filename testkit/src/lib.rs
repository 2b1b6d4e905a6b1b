#![forbid(unsafe_code)]
//! # atmost-testkit
//!
//! Real parts for atmost's tests, its stress checker and its benchmarks;
//! nothing here stands in for Redis or for the server. A dev-dependency
//! only: the service never links it.
//!
//! - [`RedisServer`]: a `redis-server` of one's own on a free loopback
//!   port, killed on drop.
//! - [`Redis`]: the Redis of one test: its own [`RedisServer`], or the one
//!   `REDIS_URL` names, with a key prefix of the test's own.
//! - [`AtmostProcess`]: the real `atmost serve` binary, killed on drop.
//! - [`topology::RedisCluster`], [`topology::RedisSentinel`]: a Redis
//!   Cluster, and a primary with a replica and three Sentinels.
//! - [`proxy::Proxy`]: a loopback TCP proxy that delays or loses Redis's
//!   replies while the commands still run.

mod process;
pub mod proxy;
mod redis;
pub mod topology;

pub use process::{AtmostProcess, RedisServer, Tethered};
pub use redis::{Redis, flush_scripts};
