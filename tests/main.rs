//! atmost's integration suite: one test binary, one module per topic.
//! Every test talks to the real server over gRPC on a loopback port and to
//! real `redis-server` processes (its own, on free loopback ports, or
//! `REDIS_URL` with a key prefix of its own).
//!
//! - `attacks`: the attack campaign, two replicas with real credentials.
//! - `audit`: the audit trail's writer: its file, and an output that
//!   stops taking lines (`drop` counts every loss, `block` loses none).
//! - `auth`: API keys, roles, tenants, TLS and mTLS, the audit trail,
//!   reloading the key file, dev mode.
//! - `behaviour`: every behaviour case, once on each store.
//! - `clients`: the Rust client's guarded call on each store: dispatch,
//!   replay, refusals, the lost response and the lost DISPATCH (its
//!   deadline, late in the lease), a restart with a kept holder token, a
//!   server not up yet, outcomes that cannot be recorded, keys, TLS and
//!   mTLS.
//! - `cli`: the operator CLI and `atmost demo`, the binary run against a
//!   live server: tables, `--json`, exit codes, API keys, TLS.
//! - `campaign`: hostile input, one table of requests through the server
//!   on each store: exact codes and reasons, bounded errors, the store
//!   read back unchanged.
//! - `model`: the Redis scripts against the reference state machine,
//!   random sequences (proptest).
//! - `replicas`: several processes on one Redis.
//! - `scale_out`: Redis Cluster (permits on every shard, moved slots,
//!   flushed scripts), `--durability replica` against a primary whose
//!   replica is gone, Sentinel through a failover, and the failover
//!   report under load from three replicas.
//! - `clock_skew`: two processes on one Redis whose own clocks disagree by
//!   16 s (libfaketime): leases and expiry follow Redis's clock.
//! - `deploy`: the manifests of `deploy/` (Dockerfile, compose,
//!   Kubernetes) parsed and checked against the binary, which must serve
//!   with their configuration.
//! - `envoy`: the Envoy front doors (ext_authz, ext_proc), driven with
//!   Envoy's own messages in Envoy's order, on both stores.
//! - `faults`: Redis killed, a replica killed, replies slow or lost,
//!   SIGTERM mid-flight, load shedding.
//! - `operations`: health, reflection, failing closed, script reloads,
//!   SIGTERM, huge pages.
//! - `receipts`: signed receipts, verified offline with the published keys.
//! - `redis_corruption`: every script, each value it reads corrupted in
//!   turn: STORE_UNAVAILABLE, and every key as it was.
//! - `redis_keys`: the Redis key layout and retention, read from Redis.
//! - `redis_settings`: eviction policies refused or accepted, CONFIG
//!   disabled, a policy Redis will not tell, `maxmemory` reached, the
//!   README's ACL in both durability modes.
//! - `telemetry`: spans sent to an OTLP receiver in the test (the caller's
//!   trace joined, the attributes, nothing secret), and the Prometheus
//!   scrape after a known sequence of calls on each store.
//! - `tools`: the stress checker and the load generator, in process.
//! - `transport`: transport abuse against each limit's flag: streams past
//!   the limit, stalled bodies, missing prefaces, reset floods, thousands
//!   of watch streams, idle and old connections, oversized messages.
//!
//! The README's commands are checked by `scripts/readme.sh`, which
//! `scripts/test.sh` runs after this suite.

mod support;

mod approval;
mod attacks;
mod audit;
pub mod auth;
mod behaviour;
mod campaign;
mod cli;
mod clients;
mod clock_skew;
mod deploy;
mod envoy;
mod faults;
mod model;
mod operations;
mod receipts;
mod redis_corruption;
mod redis_keys;
mod redis_settings;
mod replicas;
mod scale_out;
mod telemetry;
mod tools;
mod transport;
