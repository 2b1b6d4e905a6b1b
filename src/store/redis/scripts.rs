//! atmost's Lua scripts: one table from a name to its `.lua` file (in
//! `lua/`, each with a KEYS/ARGV/Returns header) to the [`Script`] the store
//! runs. Adding a script is one line in `scripts!` and its file.
//!
//! `lua/lib.lua` is prepended to each, and each answers one msgpack string
//! ([`script_text`]).

use redis::{Cmd, Script, ToRedisArgs};
use std::sync::LazyLock;

const LIB: &str = include_str!("lua/lib.lua");

/// The text of a script as atmost sends it: `lib.lua`, then the script's
/// body run as a function whose result is packed into one msgpack string.
/// One bulk reply parses in a fraction of the time of the ~25 RESP values
/// an Authorize answer has (redis-rs's RESP parser was 7% of the server's
/// CPU); the store unpacks it with [`unpack_reply`](super::unpack_reply).
///
/// Each script begins with a `#!lua` line, kept first where Redis (7.0 or
/// later) reads it: a script that may write is then refused whole when
/// `maxmemory` is reached (without it, Redis refuses only its first
/// memory-growing write, and lets one that begins by deleting go on), and
/// the read-only ones say `flags=no-writes`, so reads go on meanwhile.
pub fn script_text(body: &str) -> String {
    let (shebang, body) = match body.strip_prefix("#!lua") {
        Some(_) => body.split_once('\n').unwrap_or((body, "")),
        None => ("", body),
    };
    format!("{shebang}\n{LIB}\nlocal function main()\n{body}\nend\nreturn cmsgpack.pack(main())")
}

/// The body of one of atmost's scripts by name (`authorize`, `settle`, ...),
/// for tools that run a script the way atmost does (the benchmark's Redis
/// ceiling).
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
}

/// Each script of [`TABLE`] as sent (with `lib.lua`), and its SHA-1,
/// computed once.
static SCRIPTS: LazyLock<Vec<(String, String)>> = LazyLock::new(|| {
    TABLE
        .iter()
        .map(|(_, body)| {
            let text = script_text(body);
            let sha = Script::new(&text).get_hash().to_owned();
            (text, sha)
        })
        .collect()
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

    /// The script as sent to Redis (`SCRIPT LOAD`).
    pub(super) fn text(self) -> &'static str {
        &SCRIPTS[self as usize].0
    }

    /// The script's name (its file's, without `.lua`).
    pub(super) fn name(self) -> &'static str {
        TABLE[self as usize].0
    }

    /// Whether the script may write (it is not `flags=no-writes`).
    pub(super) fn writes(self) -> bool {
        !TABLE[self as usize].1.starts_with("#!lua flags=no-writes")
    }
}

/// One run of a script: its keys and arguments, sent as `EVALSHA` (and
/// loaded where Redis answers NOSCRIPT, by the store).
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

    /// `EVALSHA <sha> <numkeys> <keys...> <args...>`.
    pub(super) fn evalsha(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&SCRIPTS[self.lua as usize].1)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::{Lua, TABLE, script_body};

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
        assert_eq!(TABLE[Lua::Settle as usize].0, "settle");
        assert!(Lua::Authorize.writes() && Lua::IndexPermit.writes());
        assert!(Lua::IndexTenant.writes());
        assert!(!Lua::GetPermit.writes() && !Lua::ListUncertain.writes());
        assert!(!Lua::GetAttempt.writes() && !Lua::Census.writes());
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
