//! Who is calling, and what they may call: bearer API keys from the
//! `--auth-keys` file, the roles each RPC needs, and the layer that checks
//! both before any atmost service sees a request.
//!
//! The key file stores only SHA-256 digests of the keys:
//!
//! ```toml
//! [[key]]
//! id = "ops-1"          # shown in logs and errors, never the key
//! sha256 = "<hex of SHA-256 of the key>"
//! tenant = "acme"
//! roles = ["operator"]  # any of: agent, operator, admin
//! ```
//!
//! With mTLS (`--tls-client-ca`), a verified client certificate can stand
//! in for a key: the same file maps a certificate identity (a SAN URI or
//! DNS name) to a tenant and roles:
//!
//! ```toml
//! [[cert]]
//! id = "runner"                                    # shown in logs
//! san = "spiffe://cluster.local/ns/agents/sa/runner"
//! tenant = "acme"
//! roles = ["agent"]
//! ```
//!
//! A caller sends `authorization: Bearer <key>`. A missing or unknown key
//! answers UNAUTHENTICATED; a key without a role the RPC accepts answers
//! PERMISSION_DENIED / ROLE_NOT_ALLOWED. Neither reaches a service, so
//! neither reads or changes anything. gRPC health and server reflection
//! are not atmost RPCs and need no key.
//!
//! The file is read again on SIGHUP and whenever it changes (the server's file watch: [`Authenticator::refresh`]); a
//! file that does not parse keeps the keys in force and logs why.

use crate::domain::{Error, valid_name};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;
use subtle::ConstantTimeEq;

/// What a key may do (docs/api.md, "Roles").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Callers around a dispatch: Authorize, Commit, MarkUncertain,
    /// GetPermit, GetAttempt; and gateways, through the Envoy front doors
    /// (ext_authz Check, ext_proc Process).
    Agent,
    /// Reconcilers: GetPermit, GetAttempt, ListUncertain, Resolve.
    Operator,
    /// People who decide the calls a permit holds for approval:
    /// ListApprovals, Approve, Deny, GetPermit, GetAttempt. Never given to
    /// an agent's key: an agent must not approve calls.
    Approver,
    /// Everything, including CreatePermit and RevokePermit.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Agent => "agent",
            Role::Operator => "operator",
            Role::Approver => "approver",
            Role::Admin => "admin",
        }
    }

    fn parse(name: &str) -> Option<Role> {
        [Role::Agent, Role::Operator, Role::Approver, Role::Admin]
            .into_iter()
            .find(|r| r.as_str() == name)
    }
}

/// What anyone may call, key or not: the receipts' public keys (that one
/// method), gRPC health and server reflection (turned off with
/// `--reflection=false`).
const OPEN_SERVICES: &[&str] = &[
    "/atmost.v1.Receipts/GetSigningKeys",
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// The roles that may call each RPC, by its gRPC path; `None` only for the
/// open services. Any other path, including one of a service added later,
/// is an admin's: the table fails closed.
pub fn allowed_roles(path: &str) -> Option<&'static [Role]> {
    use Role::{Admin, Agent, Approver, Operator};
    if OPEN_SERVICES
        .iter()
        .any(|open| path.starts_with(open) && (open.ends_with('/') || path == *open))
    {
        return None;
    }
    // The Envoy front doors authorize and settle calls, as an agent does
    // through the Gate: a gateway's key needs the agent role.
    if matches!(
        path,
        "/envoy.service.auth.v3.Authorization/Check"
            | "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    ) {
        return Some(&[Agent, Admin]);
    }
    Some(match path.strip_prefix("/atmost.v1.") {
        Some("Gate/Authorize" | "Gate/Commit" | "Gate/MarkUncertain") => &[Agent, Admin],
        Some("Permits/GetPermit" | "Permits/GetAttempt") => &[Agent, Operator, Approver, Admin],
        Some("Permits/ListUncertain" | "Permits/Resolve") => &[Operator, Admin],
        Some("Approvals/ListApprovals" | "Approvals/Approve" | "Approvals/Deny") => {
            &[Approver, Admin]
        }
        _ => &[Admin],
    })
}

/// A caller atmost knows: put into each authenticated request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The key's id from the file: logged, never the key.
    pub key_id: String,
    pub tenant: String,
    pub roles: Vec<Role>,
}

/// One parsed key file.
#[derive(Debug, Default)]
pub struct Keys {
    entries: Vec<([u8; 32], Arc<Identity>)>,
    /// Client-certificate identities (SAN URI or DNS name).
    certs: std::collections::HashMap<String, Arc<Identity>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    #[serde(default)]
    key: Vec<KeyEntry>,
    #[serde(default)]
    cert: Vec<CertEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CertEntry {
    id: String,
    san: String,
    tenant: String,
    roles: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    id: String,
    sha256: String,
    tenant: String,
    roles: Vec<String>,
}

/// One entry's identity, checked: its id (unique across the file), tenant
/// and roles.
fn identity(
    at: &str,
    id: String,
    tenant: String,
    roles: &[String],
    ids: &mut HashSet<String>,
) -> Result<Arc<Identity>, String> {
    if !valid_name(&id) {
        return Err(format!("{at}: id must be 1..=64 of [A-Za-z0-9._-]"));
    }
    if !ids.insert(id.clone()) {
        return Err(format!("{at}: the id is given twice"));
    }
    if !valid_name(&tenant) {
        return Err(format!("{at}: tenant must be 1..=64 of [A-Za-z0-9._-]"));
    }
    if roles.is_empty() {
        return Err(format!("{at}: roles must name at least one role"));
    }
    let roles = roles
        .iter()
        .map(|r| {
            Role::parse(r).ok_or_else(|| {
                format!("{at}: unknown role {r:?} (agent, operator, approver or admin)")
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if roles.contains(&Role::Agent) && roles.contains(&Role::Approver) {
        return Err(format!(
            "{at}: a key may not be both agent and approver: an agent never approves calls"
        ));
    }
    Ok(Arc::new(Identity {
        key_id: id,
        tenant,
        roles,
    }))
}

fn digest_of_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Keys {
    /// Parses a key file, checking every entry: the error names the first
    /// entry that is wrong and why (the keys in force stay as they are).
    pub fn parse(text: &str) -> Result<Keys, String> {
        // toml's own message quotes the offending line, which may hold a
        // key pasted by mistake: only the line number and what is wrong.
        let file: KeyFile = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            match line {
                Some(line) => format!("line {line}: {}", e.message()),
                None => e.message().to_owned(),
            }
        })?;
        let mut ids = HashSet::new();
        let mut digests = HashSet::new();
        let mut entries = Vec::with_capacity(file.key.len());
        for (n, k) in file.key.into_iter().enumerate() {
            let at = format!("key {} (id {:?})", n + 1, k.id);
            let identity = identity(&at, k.id, k.tenant, &k.roles, &mut ids)?;
            let digest = digest_of_hex(&k.sha256.to_ascii_lowercase())
                .ok_or_else(|| format!("{at}: sha256 must be 64 hex digits"))?;
            if !digests.insert(digest) {
                return Err(format!("{at}: the same key is listed twice"));
            }
            entries.push((digest, identity));
        }
        let mut certs = std::collections::HashMap::new();
        for (n, c) in file.cert.into_iter().enumerate() {
            let at = format!("cert {} (id {:?})", n + 1, c.id);
            let identity = identity(&at, c.id, c.tenant, &c.roles, &mut ids)?;
            if c.san.is_empty() || c.san.len() > 255 || !c.san.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(format!("{at}: san must be a SAN URI or DNS name"));
            }
            if certs.insert(c.san, identity).is_some() {
                return Err(format!("{at}: the same san is listed twice"));
            }
        }
        Ok(Keys { entries, certs })
    }

    /// The identity a verified client certificate with these SANs maps to
    /// (the first SAN the file names).
    pub fn certificate(&self, sans: &[String]) -> Option<Arc<Identity>> {
        sans.iter().find_map(|san| self.certs.get(san).cloned())
    }

    /// Keys and certificate identities.
    pub fn len(&self) -> usize {
        self.entries.len() + self.certs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The identity of a presented key. Every stored digest is compared, in
    /// constant time, whichever matches: how long this takes says nothing
    /// about which key (or how much of one) was right.
    pub fn authenticate(&self, key: &[u8]) -> Option<Arc<Identity>> {
        let presented: [u8; 32] = Sha256::digest(key).into();
        let mut found = None;
        for (digest, identity) in &self.entries {
            if bool::from(digest.ct_eq(&presented)) {
                found = Some(identity.clone());
            }
        }
        found
    }
}

/// What identifies one version of the file on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    digest: [u8; 32],
}

/// The keys in force, and the file they come from.
#[derive(Debug)]
pub struct Authenticator {
    path: PathBuf,
    keys: RwLock<Arc<Keys>>,
    /// The version of the file last read (parsed or not), so an unchanged
    /// file is not parsed again, nor a broken one logged every second.
    seen: Mutex<Option<Stamp>>,
}

impl Authenticator {
    /// Reads the key file at start-up: a file that cannot be read or parsed
    /// is an error (atmost does not start on it).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref().to_owned();
        let (stamp, text) = read(&path)?;
        let keys = Keys::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self {
            path,
            keys: RwLock::new(Arc::new(keys)),
            seen: Mutex::new(Some(stamp)),
        })
    }

    /// The keys in force.
    pub fn keys(&self) -> Arc<Keys> {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the file again if it changed (or if `force`): new keys take
    /// effect for the next request; a file that does not parse keeps the
    /// keys in force and says why. Ok(true) when new keys took effect.
    pub fn reload(&self, force: bool) -> Result<bool, String> {
        let (stamp, text) = read(&self.path)?;
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if !force && seen.as_ref() == Some(&stamp) {
                return Ok(false);
            }
            *seen = Some(stamp);
        }
        let keys = Keys::parse(&text).map_err(|e| format!("{}: {e}", self.path.display()))?;
        // An empty file is far likelier a write caught halfway (or a
        // mount being swapped) than an intent to lock everyone out.
        if keys.is_empty() && !self.keys().is_empty() {
            return Err(format!(
                "{}: no key and no certificate in the file; the keys in force stay \
                 (replace the file whole, by a rename)",
                self.path.display()
            ));
        }
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(keys);
        Ok(true)
    }

    /// The caller of a request: its bearer key, or else its verified
    /// client certificate (mTLS). A key that is given must be known: it
    /// is never passed over for the certificate.
    fn identify<B>(&self, request: &http::Request<B>) -> Result<Arc<Identity>, Error> {
        let unauthenticated = |why: &str| Error::Unauthenticated {
            why: why.to_owned(),
        };
        let Some(value) = request.headers().get(http::header::AUTHORIZATION) else {
            let sans = peer_sans(request);
            if sans.is_empty() {
                return Err(unauthenticated(
                    "no authorization metadata (Bearer <key>) and no client certificate",
                ));
            }
            return self
                .keys()
                .certificate(&sans)
                .ok_or_else(|| unauthenticated("a client certificate the key file does not name"));
        };
        let key = value
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .filter(|k| !k.is_empty())
            .ok_or_else(|| unauthenticated("authorization is not \"Bearer <key>\""))?;
        self.keys()
            .authenticate(key)
            .ok_or_else(|| unauthenticated("unknown key"))
    }
}

/// The SAN URIs and DNS names of the client certificate the TLS handshake
/// verified (against `--tls-client-ca`); none without one.
fn peer_sans<B>(request: &http::Request<B>) -> Vec<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let Some(certs) = crate::transport::peer_certs(request) else {
        return Vec::new();
    };
    let Some(Ok((_, cert))) = certs.first().map(|der| X509Certificate::from_der(der)) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            _ => None,
        })
        .collect()
}

fn read(path: &Path) -> Result<(Stamp, String), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = std::fs::metadata(path).ok();
    let stamp = Stamp {
        modified: meta.as_ref().and_then(|m| m.modified().ok()),
        len: text.len() as u64,
        digest: Sha256::digest(text.as_bytes()).into(),
    };
    Ok((stamp, text))
}

impl Authenticator {
    /// [`Authenticator::reload`], logged: new keys take effect for the
    /// next request on connections already open; a file that does not
    /// load keeps the keys in force.
    pub fn refresh(&self, force: bool) {
        match self.reload(force) {
            Ok(true) => tracing::info!(
                keys = self.keys().len(),
                file = %self.path.display(),
                "API keys reloaded"
            ),
            Ok(false) => {}
            Err(why) => tracing::error!(%why, "API key file not reloaded; the keys in force stay"),
        }
    }
}

/// The caller of one request, or why it may not call.
pub(crate) fn check<B>(
    auth: &Authenticator,
    request: &http::Request<B>,
    path: &str,
    allowed: &[Role],
) -> Result<Arc<Identity>, Error> {
    let identity = auth.identify(request)?;
    if !identity.roles.iter().any(|r| allowed.contains(r)) {
        return Err(Error::RoleNotAllowed {
            key_id: identity.key_id.clone(),
            rpc: rpc_name(path),
            allowed: allowed
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(identity)
}

/// The RPC a refusal names: the request's path, cut to 128 bytes (a path
/// no RPC has is refused too, and a client may send kilobytes of it).
fn rpc_name(path: &str) -> String {
    const MAX: usize = 128;
    let name = path.trim_start_matches('/');
    if name.len() <= MAX {
        return name.to_owned();
    }
    let end = (0..=MAX).rev().find(|&i| name.is_char_boundary(i));
    format!("{}...", &name[..end.unwrap_or(0)])
}

#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod tests;
