//! What `serve` reads and checks before it starts anything.

use super::flags::{DurabilityArg, RedisMode, ServeArgs, StoreKind};
use atmost::auth::Authenticator;
use atmost::domain::Millis;
use atmost::store::redis::{Durability, Mode, RedisConfig, RedisStore, Time};
use std::time::Duration;

/// What `serve` reads and checks before it starts anything: every file it
/// names and every combination of settings, so that a mistake stops it at
/// once with the setting's name (and `config check` finds the same ones).
pub struct Prepared {
    pub retention_ms: Millis,
    pub quotas: atmost::domain::Quotas,
    /// With `--store redis`: how to reach it, checked.
    pub redis: Option<RedisConfig>,
    pub tls: Option<atmost::transport::Tls>,
    pub receipts: Option<atmost::receipts::ReceiptSigner>,
    pub auth: Option<Authenticator>,
    /// The Envoy front doors' mapping; `None`: not served.
    pub envoy: Option<atmost::api::envoy::Mapping>,
    /// The origins allowed to call the HTTP/JSON edge from a browser.
    pub cors: atmost::http::Cors,
}

pub fn prepare(args: &ServeArgs) -> Result<Prepared, String> {
    let read = |setting: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("--{setting} {}: {e}", path.display()))
    };
    let needs = |set: bool, setting: &str, other: &str| {
        if set {
            Err(format!("--{setting} needs --{other}"))
        } else {
            Ok(())
        }
    };
    // The OTEL_* variables: one atmost cannot honour stops it here too.
    atmost::telemetry::Plan::from_env(|name| std::env::var(name).ok())?;
    if args.approval_wait_default > args.approval_wait_max {
        return Err(format!(
            "--approval-wait-default ({:?}) is longer than --approval-wait-max ({:?})",
            args.approval_wait_default, args.approval_wait_max
        ));
    }
    needs(
        args.tls_cert.is_some() && args.tls_key.is_none(),
        "tls-cert",
        "tls-key",
    )?;
    needs(
        args.tls_key.is_some() && args.tls_cert.is_none(),
        "tls-key",
        "tls-cert",
    )?;
    needs(
        args.tls_client_ca.is_some() && args.tls_cert.is_none(),
        "tls-client-ca",
        "tls-cert",
    )?;
    needs(
        args.tls_client_ca.is_some() && args.auth_keys.is_none(),
        "tls-client-ca",
        "auth-keys",
    )?;
    needs(
        args.receipt_verify_keys.is_some() && args.receipt_signing_key.is_none(),
        "receipt-verify-keys",
        "receipt-signing-key",
    )?;
    if !args.envoy && args.envoy_mapping.is_some() {
        return Err(
            "--envoy-mapping is for the Envoy front doors, which --envoy=false turns off".into(),
        );
    }
    if !args.http && args.http_listen.is_some() {
        return Err("--http-listen is for the HTTP/JSON edge, which --http=false turns off".into());
    }
    if args.http_listen == Some(args.listen) && args.listen.port() != 0 {
        return Err(format!(
            "--http-listen {} is --listen's address: give it another port, or leave it out to serve HTTP/JSON on --listen",
            args.listen
        ));
    }
    // (An empty value, as a template leaves ATMOST_HTTP_CORS_ORIGINS, is
    // none.)
    let cors = atmost::http::Cors::parse(&args.http_cors_origins)
        .map_err(|e| format!("--http-cors-origins: {e}"))?;
    if !args.http && cors != atmost::http::Cors::Off {
        return Err(
            "--http-cors-origins is for the HTTP/JSON edge, which --http=false turns off".into(),
        );
    }
    // Without keys a page of an allowed origin could call every RPC from
    // any visitor's browser: CORS is for a service that asks for a key.
    if args.auth_keys.is_none() && cors != atmost::http::Cors::Off {
        return Err(
            "--http-cors-origins needs --auth-keys: without keys, a page of an allowed origin could call every RPC from its visitors' browsers".into(),
        );
    }
    if args.insecure_no_auth && args.auth_keys.is_some() {
        return Err("--insecure-no-auth and --auth-keys contradict each other: give one".into());
    }
    let redis = matches!(args.store, StoreKind::Redis);
    if redis && args.redis_sentinel_master.is_some() && args.redis_mode != RedisMode::Sentinel {
        return Err("--redis-sentinel-master is for --redis-mode sentinel".into());
    }
    if redis && args.redis_mode == RedisMode::Sentinel && args.redis_sentinel_master.is_none() {
        return Err("--redis-mode sentinel needs --redis-sentinel-master NAME".into());
    }
    if let Some(addr) = args
        .non_loopback()
        .filter(|_| args.auth_keys.is_none() && !args.insecure_no_auth)
    {
        return Err(format!(
            "refusing to serve {addr} without authentication: give --auth-keys FILE \
             (docs/api.md, \"Authentication\"), listen on a loopback address for dev mode, \
             or accept an open service with --insecure-no-auth"
        ));
    }
    let millis = |setting: &str, d: Duration| {
        Millis::try_from(d.as_millis()).map_err(|_| format!("--{setting} is too long"))
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let ca = match &args.tls_client_ca {
                Some(ca) => Some(read("tls-client-ca", ca)?),
                None => None,
            };
            Some(atmost::transport::Tls::from_pem(
                &read("tls-cert", cert)?,
                &read("tls-key", key)?,
                ca.as_deref(),
            )?)
        }
        _ => None,
    };
    let retention_ms = millis("retention", args.retention)?;
    let redis_tls_ca = match &args.redis_tls_ca {
        Some(path) => Some(read("redis-tls-ca", path)?),
        None => None,
    };
    let redis = match args.store {
        StoreKind::Memory => None,
        StoreKind::Redis => {
            let config = RedisConfig {
                url: args.redis_url.clone(),
                mode: match args.redis_mode {
                    RedisMode::Standalone => Mode::Standalone,
                    RedisMode::Cluster => Mode::Cluster,
                    RedisMode::Sentinel => Mode::Sentinel {
                        master: args.redis_sentinel_master.clone().unwrap_or_default(),
                    },
                },
                durability: match args.durability {
                    DurabilityArg::None => Durability::None,
                    DurabilityArg::Replica => Durability::Replica,
                },
                prefix: args.redis_prefix.clone(),
                retention_ms,
                timeout: args.store_timeout,
                allow_eviction: args.allow_eviction,
                allow_unknown_eviction_policy: args.allow_unknown_eviction_policy,
                time: Time::Redis,
                tls_ca: redis_tls_ca,
            };
            // What RedisStore::connect would refuse (a URL that does not
            // parse, a prefix with braces), refused here, by setting.
            RedisStore::check(&config).map_err(|e| match e {
                atmost::domain::Error::InvalidRequest(violations) => violations
                    .iter()
                    .map(|v| format!("--{}: {}", v.field.replace('_', "-"), v.description))
                    .collect::<Vec<_>>()
                    .join("; "),
                other => other.to_string(),
            })?;
            Some(config)
        }
    };
    Ok(Prepared {
        retention_ms,
        quotas: atmost::domain::Quotas {
            max_permit_lifetime_ms: millis("max-permit-lifetime", args.max_permit_lifetime)?,
            max_open_attempts: args.max_open_attempts,
            max_attempts: args.max_attempts_per_permit,
            max_permits_per_tenant: args.max_permits_per_tenant,
        },
        redis,
        tls,
        receipts: match &args.receipt_signing_key {
            Some(signing) => Some(
                atmost::receipts::ReceiptSigner::load(signing, args.receipt_verify_keys.as_deref())
                    .map_err(|e| format!("--receipt-signing-key: {e}"))?,
            ),
            None => None,
        },
        auth: match &args.auth_keys {
            Some(path) => Some(Authenticator::load(path).map_err(|e| format!("--auth-keys: {e}"))?),
            None => None,
        },
        envoy: match (&args.envoy_mapping, args.envoy) {
            (Some(path), _) => Some(
                atmost::api::envoy::Mapping::load(path)
                    .map_err(|e| format!("--envoy-mapping: {e}"))?,
            ),
            (None, true) => Some(atmost::api::envoy::Mapping::default()),
            (None, false) => None,
        },
        cors,
    })
}
