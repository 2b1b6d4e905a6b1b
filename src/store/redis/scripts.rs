//! atmost's Lua scripts: one table from a name to its `.lua` file (in
//! `lua/`, each with a KEYS/ARGV/Returns header) to the function the store
//! calls. Adding a script is one line in `scripts!` and its file.
//!
//! The scripts are one Redis Functions library ([`library_text`]):
//! `lib.lua` once, then each script's body as a function, registered as
//! `<library>_<name>` and called with `FCALL`. Each answers one msgpack
//! string.

use redis::{Cmd, Script, ToRedisArgs};
use std::sync::LazyLock;

const LIB: &str = include_str!("lua/lib.lua");

/// atmost's Functions library, as the store loads it (`FUNCTION LOAD`):
/// `lib.lua` once, then each script's body as a local function of `KEYS`
/// and `ARGV` whose result is packed into one msgpack string, each
/// registered as `<library>_<name>`.
///
/// A library runs `lib.lua` once, when it is loaded: an `EVALSHA` ran it
/// (its 32 functions and constant tables made afresh) on every call,
/// about 4.7 us of Redis's time per call. One bulk reply parses in a
/// fraction of the time of the ~25 RESP values an Authorize answer has
/// (redis-rs's RESP parser was 7% of the server's CPU); the store unpacks
/// it with [`unpack_reply`](super::unpack_reply).
///
/// The library's name carries a hash of its text, so versions of atmost
/// with different scripts sharing one Redis each call their own. A
/// function that may write has no flags: Redis (7.0 or later) then refuses
/// it whole when `maxmemory` is reached (a script that began by deleting
/// is not let on), and the read-only ones (a body that begins
/// `#!lua flags=no-writes`) say `no-writes`, so reads go on meanwhile.
pub fn library_text() -> &'static str {
    &LIBRARY.text
}

/// The name of the library [`library_text`] defines:
/// `atmost_<12 hex digits of the SHA-1 of its code>`.
pub fn library_name() -> &'static str {
    &LIBRARY.name
}

/// The Functions name of one of atmost's scripts by name (`authorize`,
/// `settle`, ...), for tools that call a script the way atmost does.
pub fn function_name(script: &str) -> Option<&'static str> {
    TABLE
        .iter()
        .position(|(n, _)| *n == script)
        .map(|i| LIBRARY.functions[i].as_str())
}

/// The body of one of atmost's scripts by name (its `.lua` file).
pub fn script_body(name: &str) -> Option<&'static str> {
    TABLE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, body)| *body)
}

/// The one table: `Variant => "name"` reads `lua/name.lua`.
macro_rules! scripts {
    ($($variant:ident => $name:literal,)*) => {
        /// One of atmost's scripts, as the store names it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Lua {
            $($variant,)*
        }

        /// (name, body), in the order of [`Lua`]'s variants.
        const TABLE: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("lua/", $name, ".lua"))),)*
        ];
    };
}

scripts! {
    CreatePermit => "create_permit",
    GetPermit => "get_permit",
    GetAttempt => "get_attempt",
    RevokePermit => "revoke_permit",
    Authorize => "authorize",
    Settle => "settle",
    MarkUncertain => "mark_uncertain",
    ListUncertain => "list_uncertain",
    ClosePermit => "close_permit",
    IndexPermit => "index_permit",
    IndexTenant => "index_tenant",
    Census => "census",
    CensusTurn => "census_turn",
    CensusPublish => "census_publish",
    ListIndex => "list_index",
    UncertainAttempts => "uncertain_attempts",
    Approve => "approve",
    Deny => "deny",
    ListApprovals => "list_approvals",
    AwaitingAttempts => "awaiting_attempts",
}

/// The library, made once from [`LIB`] and [`TABLE`].
struct Library {
    name: String,
    text: String,
    /// Each script's function name, in the order of [`TABLE`].
    functions: Vec<String>,
}

static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    use std::fmt::Write as _;
    let mut code = format!("{LIB}\n");
    for (name, body) in TABLE {
        let body = body.strip_prefix("#!lua").map_or(*body, |_| {
            body.split_once('\n').map_or("", |(_, rest)| rest)
        });
        let _ = write!(
            code,
            "local function script_{name}(KEYS, ARGV)\n{body}\nend\n"
        );
    }
    // The registrations name the library; the name is the hash of the
    // whole text with a placeholder for it, so two texts that differ
    // anywhere (a flag, the packing) never share a name.
    const NAME: &str = "atmost_LIBRARY";
    for (name, body) in TABLE {
        let function = format!("{NAME}_{name}");
        let flags = if body.starts_with("#!lua flags=no-writes") {
            ", flags = {'no-writes'}"
        } else {
            ""
        };
        let _ = writeln!(
            code,
            "redis.register_function{{function_name = '{function}', callback = \
             function(keys, args) return cmsgpack.pack(script_{name}(keys, args)) end{flags}}}"
        );
    }
    let text = format!("#!lua name={NAME}\n{code}");
    let hash = Script::new(&text).get_hash().to_owned();
    let library = format!("atmost_{}", &hash[..12]);
    Library {
        text: text.replace(NAME, &library),
        functions: TABLE
            .iter()
            .map(|(name, _)| format!("{library}_{name}"))
            .collect(),
        name: library,
    }
});

impl Lua {
    /// A fresh invocation of this script, to add its keys and arguments to.
    pub(super) fn prepare_invoke(self) -> Invocation {
        Invocation {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// The script's name (its file's, without `.lua`).
    pub(super) fn name(self) -> &'static str {
        TABLE[self as usize].0
    }

    /// Its function's name in the library.
    pub(super) fn function(self) -> &'static str {
        &LIBRARY.functions[self as usize]
    }

    /// Whether the script may write (it is not `flags=no-writes`).
    pub(super) fn writes(self) -> bool {
        !TABLE[self as usize].1.starts_with("#!lua flags=no-writes")
    }
}

/// One run of a script: its keys and arguments, sent as `FCALL` (the
/// library loaded where Redis answers that the function is not found, by
/// the store).
pub(super) struct Invocation {
    pub(super) lua: Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Invocation {
    pub(super) fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub(super) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// The first key: it names the slot (every key of a run shares its
    /// hash tag).
    pub(super) fn slot_key(&self) -> &[u8] {
        self.keys.first().map_or(&[], Vec::as_slice)
    }

    /// `FCALL <function> <numkeys> <keys...> <args...>`.
    pub(super) fn fcall(&self) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(self.lua.function())
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::{LIBRARY, Lua, TABLE, function_name, library_name, library_text, script_body};

    #[test]
    fn every_script_is_found_by_its_name() {
        for (name, body) in TABLE {
            assert_eq!(script_body(name), Some(*body));
            let (shebang, header) = body.split_once('\n').expect("lines");
            assert!(
                shebang == "#!lua" || shebang == "#!lua flags=no-writes",
                "{name}: {shebang}"
            );
            assert!(header.starts_with(&format!("-- {name}.lua:")), "{name}");
        }
        assert_eq!(script_body("lib"), None);
        assert_eq!(function_name("lib"), None);
        assert!(library_name().starts_with("atmost_") && library_name().len() == 19);
        assert!(library_text().starts_with(&format!("#!lua name={}\n", library_name())));
        assert_eq!(
            function_name("authorize"),
            Some(format!("{}_authorize", library_name()).as_str())
        );
        assert_eq!(
            Lua::Census.function(),
            LIBRARY.functions[Lua::Census as usize]
        );
        // Each read-only script is registered no-writes, and no other.
        let no_writes = library_text().matches("flags = {'no-writes'}").count();
        let read_only = TABLE
            .iter()
            .filter(|(_, b)| b.starts_with("#!lua flags=no-writes"))
            .count();
        assert_eq!(no_writes, read_only);
        assert_eq!(TABLE[Lua::Settle as usize].0, "settle");
        assert!(Lua::Authorize.writes() && Lua::IndexPermit.writes());
        assert!(Lua::IndexTenant.writes());
        assert!(!Lua::GetPermit.writes() && !Lua::ListUncertain.writes());
        assert!(!Lua::GetAttempt.writes() && !Lua::Census.writes());
        assert!(!Lua::ListIndex.writes() && !Lua::UncertainAttempts.writes());
        assert!(Lua::CensusTurn.writes() && Lua::CensusPublish.writes());
        assert!(Lua::Approve.writes() && Lua::Deny.writes());
        assert!(!Lua::ListApprovals.writes() && !Lua::AwaitingAttempts.writes());
        assert_eq!(Lua::Census.name(), "census");
    }

    /// Every `{'ERR', 'NAME', ...}` a script can return names a domain
    /// [`Reason`](crate::domain::Reason): the store decodes no other.
    #[test]
    fn every_error_a_script_returns_is_a_domain_reason() {
        let lib = ("lib", super::LIB);
        let mut found = 0;
        for (name, body) in TABLE.iter().copied().chain([lib]) {
            for (_, rest) in body
                .match_indices("'ERR', '")
                .map(|(i, _)| body.split_at(i + 8))
            {
                let reason = rest.split('\'').next().expect("a quoted name");
                assert!(
                    crate::domain::Reason::from_name(reason).is_some(),
                    "{name}.lua returns {reason:?}, which is not a domain reason"
                );
                found += 1;
            }
        }
        assert!(
            found >= 15,
            "only {found} error returns found: is the scan broken?"
        );
    }
}
