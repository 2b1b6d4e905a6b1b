//! Property-based fuzzing of what the authentication layer reads from a
//! request before any service runs: its path and its `authorization`
//! header. The properties: no panic; a caller is known only by a key of
//! the file, given exactly as `Bearer <key>`, and holding a role the path
//! allows; any refusal is UNAUTHENTICATED or ROLE_NOT_ALLOWED, small
//! ([`small_status`]). Runs with `cargo test -p atmost --lib fuzz`.

use super::{Authenticator, Role, allowed_roles, check};
use crate::api::fuzz::{config, re, small_status};
use crate::domain::Reason;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;
use sha2::{Digest, Sha256};
use std::sync::OnceLock;

/// The keys of the file, by the roles they hold.
const KEYS: &[(&str, &str)] = &[("agent-key", "agent"), ("admin-key", "admin")];

/// An authenticator reading a key file of [`KEYS`] (written once, in the
/// temporary directory).
fn authenticator() -> &'static Authenticator {
    static AUTH: OnceLock<Authenticator> = OnceLock::new();
    AUTH.get_or_init(|| {
        let file: String = KEYS
            .iter()
            .map(|(key, role)| {
                let sha: String = Sha256::digest(key.as_bytes())
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                format!("[[key]]\nid = \"{role}-1\"\nsha256 = \"{sha}\"\ntenant = \"t\"\nroles = [\"{role}\"]\n")
            })
            .collect();
        let path = std::env::temp_dir().join(format!("atmost-fuzz-keys-{}.toml", std::process::id()));
        std::fs::write(&path, file).expect("a temporary file");
        let auth = Authenticator::load(&path).expect("the key file loads");
        let _ = std::fs::remove_file(&path);
        auth
    })
}

/// A request path: an RPC's, an open service's, one no service has, or
/// one of kilobytes (HTTP/2 lets 16 KiB of headers through).
fn path() -> BoxedStrategy<String> {
    let rpcs = vec![
        "/atmost.v1.Gate/Authorize",
        "/atmost.v1.Gate/Commit",
        "/atmost.v1.Permits/CreatePermit",
        "/atmost.v1.Permits/ListUncertain",
        "/atmost.v1.Permits/RevokePermit",
        "/atmost.v1.Receipts/GetSigningKeys",
        "/grpc.health.v1.Health/Check",
        "/",
    ];
    prop_oneof![
        4 => select(rpcs).prop_map(str::to_owned),
        2 => re("/[A-Za-z0-9._~%/-]{0,64}"),
        1 => (select(&['a', '%', '/', '.'][..]), 0usize..=16_384)
            .prop_map(|(c, n)| format!("/atmost.v1.Gate/{}", c.to_string().repeat(n))),
    ]
    .boxed()
}

/// An `authorization` header's bytes, or none.
fn authorization() -> BoxedStrategy<Option<Vec<u8>>> {
    let known = select(KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>());
    prop_oneof![
        1 => Just(None),
        4 => known.clone().prop_map(|k| Some(format!("Bearer {k}").into_bytes())),
        // A known key, near misses around it.
        3 => (
            known,
            select(&["Bearer ", "Bearer  ", "bearer ", "Basic ", "Bearer", ""][..]),
            select(&["", " ", "\t", "x", "="][..]),
        )
            .prop_map(|(k, scheme, tail)| Some(format!("{scheme}{k}{tail}").into_bytes())),
        2 => proptest::collection::vec(any::<u8>(), 0..80).prop_map(Some),
        1 => (any::<u8>(), 0usize..=16_384).prop_map(|(b, n)| {
            let mut v = b"Bearer ".to_vec();
            v.extend(std::iter::repeat_n(b, n));
            Some(v)
        }),
    ]
    .boxed()
}

fn check_request(path: &str, authorization: Option<&[u8]>) -> Result<(), TestCaseError> {
    let mut request = http::Request::builder();
    if let Some(value) = authorization {
        // What HTTP/2 would not carry never reaches the layer.
        let Ok(value) = http::HeaderValue::from_bytes(value) else {
            return Ok(());
        };
        request = request.header(http::header::AUTHORIZATION, value);
    }
    let Ok(request) = request.uri(path).body(()) else {
        return Ok(());
    };
    let path = request.uri().path();
    let Some(allowed) = allowed_roles(path) else {
        return Ok(());
    };
    match check(authenticator(), &request, path, allowed) {
        Ok(identity) => {
            let key = KEYS
                .iter()
                .find(|(key, _)| authorization == Some(format!("Bearer {key}").as_bytes()));
            prop_assert!(key.is_some(), "known by {authorization:?}");
            prop_assert!(identity.roles.iter().any(|r| allowed.contains(r)));
            prop_assert!(identity.roles != [Role::Agent] || !path.contains("CreatePermit"));
        }
        Err(e) => {
            let reason = e.reason();
            prop_assert!(
                matches!(reason, Reason::Unauthenticated | Reason::RoleNotAllowed),
                "{reason:?}"
            );
            small_status(e)?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn any_caller_is_known_by_its_key_or_refused_small(
        path in path(),
        authorization in authorization(),
    ) {
        check_request(&path, authorization.as_deref())?;
    }
}

/// Found by the property above: a refused call echoed its whole path as
/// the RPC it may not call, twice (message and metadata): 32 KiB for a
/// 16 KiB path.
#[test]
fn a_long_path_is_named_short() {
    let path = format!("/atmost.v1.Gate/{}", "a".repeat(16_000));
    let request = http::Request::builder()
        .uri(path.as_str())
        .header(http::header::AUTHORIZATION, "Bearer agent-key")
        .body(())
        .expect("a request");
    let allowed = allowed_roles(&path).expect("admin only");
    let error = check(authenticator(), &request, &path, allowed).expect_err("an agent");
    let crate::domain::Error::RoleNotAllowed { rpc, .. } = &error else {
        panic!("{error:?}");
    };
    assert_eq!(rpc.len(), 131, "{rpc}");
    assert!(rpc.starts_with("atmost.v1.Gate/aaa") && rpc.ends_with("a..."));
    small_status(error).expect("a small error");
}
