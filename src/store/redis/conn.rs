//! How the Redis store connects: its configuration, the connection address
//! and the one multiplexed [`ConnectionManager`].

use crate::domain::{Error, Millis, invalid};
use redis::IntoConnectionInfo;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use std::time::Duration;

/// How the Redis store connects and names its keys.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    pub url: String,
    /// Prepended to every key (`<prefix>:{permit_id}:...`), so several
    /// deployments or test runs can share one Redis.
    pub prefix: String,
    /// How long finished attempts and the permit are kept past its expiry.
    pub retention_ms: Millis,
    /// How long to wait for a connection or a reply before failing.
    pub timeout: Duration,
    /// Serve even when Redis's `maxmemory-policy` may evict keys (see
    /// `eviction`): the operator accepts that an evicted finished attempt
    /// lets its key be dispatched again.
    pub allow_eviction: bool,
    /// Whose clock decides expiry, leases and key lifetimes.
    pub time: Time,
    /// For a `rediss://` URL: the CA (PEM) that signed Redis's certificate,
    /// instead of the system's trust store.
    pub tls_ca: Option<Vec<u8>>,
}

/// Whose clock the scripts decide on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Time {
    /// Redis's own (`TIME` in each script): one clock for every replica,
    /// however far their own clocks drift. What `atmost serve` uses.
    #[default]
    Redis,
    /// The `now` the service passes: for tests that move time with a
    /// manual clock. Redis still expires keys on its own clock, so a permit
    /// is forgotten on the caller's (lib.lua: forgotten).
    Caller,
}

/// How atmost connects to the Redis at `url`: with `TCP_NODELAY`, which
/// redis-rs leaves off. With Nagle's algorithm a pipelined script call waits
/// for the previous one's acknowledgement (p99 at 17 000 Authorize/s: 2.2-2.7
/// ms with it, 1.6-2.1 ms without; docs/performance.md).
pub fn connection_info(url: &str) -> Result<redis::ConnectionInfo, Error> {
    let info = url
        .into_connection_info()
        .map_err(|e| invalid("redis_url", e.to_string()))?;
    let nodelay = info.tcp_settings().clone().set_nodelay(true);
    Ok(info.set_tcp_settings(nodelay))
}

/// The store's one connection, made lazily: a Redis that is down at
/// start-up is reported by the first request and by health checks, and
/// picked up when it comes. Redis Cluster and Sentinel connections land here
/// next.
pub(super) fn manager(config: &RedisConfig) -> Result<ConnectionManager, Error> {
    let info = connection_info(&config.url)?;
    let client = match &config.tls_ca {
        Some(ca) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.clone()),
            },
        ),
        None => redis::Client::open(info),
    }
    .map_err(|e| invalid("redis_url", e.to_string()))?;
    let manager_config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.timeout))
        .set_response_timeout(Some(config.timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_lazy_with_config(client, manager_config).map_err(unavailable)
}

/// A Redis that did not answer (or whose answer was lost): UNAVAILABLE.
pub(super) fn unavailable(e: redis::RedisError) -> Error {
    Error::StoreUnavailable(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{Error, connection_info};

    #[test]
    fn connects_without_nagle_to_the_address_given() {
        let info = connection_info("redis://127.0.0.1:6390/3").unwrap();
        assert!(info.tcp_settings().nodelay());
        assert_eq!(info.addr().to_string(), "127.0.0.1:6390");
        assert_eq!(info.redis_settings().db(), 3);
        match connection_info("http://127.0.0.1:6390") {
            Err(Error::InvalidRequest(v)) => assert_eq!(v[0].field, "redis_url"),
            other => panic!("{other:?}"),
        }
    }
}
