//! Configuration from three places, in one order of precedence: a flag
//! beats its `ATMOST_*` environment variable, which beats the `--config`
//! TOML file, which beats the built-in default.
//!
//! The file's keys are the flags' names without `--` (`store-timeout =
//! "2s"`). Every key is checked against the command's settings and every
//! value through the same parser as its flag, before anything starts, and
//! an error names the file and the key. A value from the file becomes its
//! setting's default ([`FileSettings::apply`]), which is how clap ranks
//! it below the flag and the variable.

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The setting that names the file itself: not settable from the file.
pub const CONFIG_SETTING: &str = "config";

/// Settings whose values may carry credentials: `config check` masks the
/// password of every URL in them.
const URL_SETTINGS: &[&str] = &["redis-url"];

/// The values a `--config` file gives, each checked against `cmd`.
#[derive(Debug, Clone)]
pub struct FileSettings {
    path: PathBuf,
    /// (the setting's clap id, its value as it would be typed after the flag).
    values: Vec<(String, String)>,
}

impl FileSettings {
    /// Reads `path` and checks it against the settings of `cmd` (the
    /// subcommand whose flags it sets).
    pub fn load(path: &Path, cmd: &Command) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(path, &text, cmd)
    }

    /// [`FileSettings::load`] of `text`, as if read from `path`.
    pub fn parse(path: &Path, text: &str, cmd: &Command) -> Result<Self, String> {
        let at = |key: &str, what: String| format!("{}: {key}: {what}", path.display());
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| format!("{}: not TOML: {e}", path.display()))?;
        let mut values = Vec::with_capacity(table.len());
        for (key, value) in &table {
            let arg = settings(cmd)
                .find(|arg| arg.get_long() == Some(key.as_str()) && key != CONFIG_SETTING)
                .ok_or_else(|| {
                    let hint = settings(cmd)
                        .filter_map(|a| a.get_long())
                        .find(|long| long.replace('-', "_") == key.replace('-', "_"))
                        .map(|long| format!(" (did you mean \"{long}\"?)"))
                        .unwrap_or_default();
                    if key == CONFIG_SETTING {
                        at(key, "a configuration file cannot name another".into())
                    } else {
                        at(
                            key,
                            format!("no such setting{hint}; the keys are the flags of `atmost serve --help` without --"),
                        )
                    }
                })?;
            let text = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(n) => n.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    return Err(at(
                        key,
                        format!(
                            "a {} is not a value here: give a string, an integer or a boolean",
                            other.type_str()
                        ),
                    ));
                }
            };
            check_value(cmd, arg, &text).map_err(|e| at(key, e))?;
            values.push((arg.get_id().to_string(), text));
        }
        Ok(Self {
            path: path.to_path_buf(),
            values,
        })
    }

    /// `cmd` with each of the file's values as its setting's default: a flag
    /// or an environment variable still wins.
    pub fn apply(&self, mut cmd: Command) -> Command {
        for (id, value) in &self.values {
            let value = value.clone();
            cmd = cmd.mut_arg(id, move |arg| arg.default_value(value));
        }
        cmd
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file set `id`.
    pub fn sets(&self, id: &str) -> bool {
        self.values.iter().any(|(set, _)| set == id)
    }
}

/// The settings of `cmd` a file may set: its flags, without help and version.
fn settings(cmd: &Command) -> impl Iterator<Item = &clap::Arg> {
    cmd.get_arguments().filter(|arg| {
        arg.get_long().is_some()
            && !matches!(
                arg.get_action(),
                ArgAction::Help | ArgAction::HelpLong | ArgAction::HelpShort | ArgAction::Version
            )
    })
}

/// Runs `value` through `arg`'s own parser (a command of that one setting,
/// without its environment variable), so the file is held to what the flag
/// accepts.
fn check_value(cmd: &Command, arg: &clap::Arg, value: &str) -> Result<(), String> {
    let long = arg.get_long().unwrap_or_default();
    let one = Command::new(cmd.get_name().to_string())
        .no_binary_name(true)
        .arg(arg.clone().env(None::<&str>).required(false));
    let argv: Vec<OsString> = match arg.get_action() {
        // A switch: the file says true or false.
        ArgAction::SetTrue | ArgAction::SetFalse => {
            return match value {
                "true" | "false" => Ok(()),
                _ => Err(format!("{value:?} is not a boolean: give true or false")),
            };
        }
        // `--name=value`: a value that starts with '-' is still a value.
        _ => vec![format!("--{long}={value}").into()],
    };
    one.try_get_matches_from(argv).map(|_| ()).map_err(|e| {
        let rendered = e.render().to_string();
        let first = rendered.lines().next().unwrap_or_default();
        first.strip_prefix("error: ").unwrap_or(first).to_string()
    })
}

/// Where a setting's effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
    File(PathBuf),
    Default,
    /// Not set, and no default.
    Unset,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag => f.write_str("flag"),
            Source::Env(name) => write!(f, "environment {name}"),
            Source::File(path) => write!(f, "file {}", path.display()),
            Source::Default => f.write_str("default"),
            Source::Unset => f.write_str("not set"),
        }
    }
}

/// One setting as it takes effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effective {
    /// The flag's name without `--`, which is also the file's key.
    pub name: String,
    /// As typed, with the password of any URL masked; `None` when unset.
    pub value: Option<String>,
    pub source: Source,
}

/// Every setting of `cmd`, its value in `matches` and where it came from.
pub fn effective(
    cmd: &Command,
    matches: &ArgMatches,
    file: Option<&FileSettings>,
) -> Vec<Effective> {
    settings(cmd)
        .filter(|arg| !arg.is_hide_set())
        .map(|arg| {
            let id = arg.get_id().as_str();
            let name = arg.get_long().unwrap_or(id).to_string();
            let raw = matches.get_raw(id).map(|values| {
                values
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(",")
            });
            let source = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => Source::Flag,
                Some(ValueSource::EnvVariable) => Source::Env(
                    arg.get_env()
                        .map(|e| e.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
                Some(_) => match file {
                    Some(file) if file.sets(id) => Source::File(file.path.clone()),
                    _ => Source::Default,
                },
                None => Source::Unset,
            };
            let value = raw.map(|v| {
                if URL_SETTINGS.contains(&name.as_str()) {
                    mask_urls(&v)
                } else {
                    v
                }
            });
            Effective {
                name,
                value,
                source,
            }
        })
        .collect()
}

/// The comma-separated URLs of `text` with each password replaced by `****`:
/// the userinfo's (`redis://user:secret@host` -> `redis://user:****@host`)
/// and a `pass` or `password` query value, which redis-rs reads as the
/// password of a Unix-socket URL (`redis+unix:///run/redis.sock?pass=secret`).
pub fn mask_urls(text: &str) -> String {
    text.split(',')
        .map(|url| {
            let Some((scheme, rest)) = url.split_once("://") else {
                // No authority (`unix:/run/redis.sock?pass=...`): the query
                // may still hold a password.
                return mask_query(url);
            };
            // The authority ends at the first '/', '?' or '#'; its userinfo
            // at the last '@' in it.
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(end);
            let tail = mask_query(tail);
            match authority.rsplit_once('@') {
                Some((userinfo, host)) => {
                    let user = userinfo.split_once(':').map_or("", |(user, _)| user);
                    if userinfo.contains(':') {
                        format!("{scheme}://{user}:****@{host}{tail}")
                    } else {
                        // A lone userinfo is the password (redis://secret@host
                        // is read as AUTH secret by some clients).
                        format!("{scheme}://****@{host}{tail}")
                    }
                }
                None => format!("{scheme}://{authority}{tail}"),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The path, query and fragment of a URL with the value of each `pass` or
/// `password` query parameter replaced by `****`. The names are compared
/// as written and percent-decoded, in any case, so no spelling of them
/// slips through.
fn mask_query(tail: &str) -> String {
    let Some((path, rest)) = tail.split_once('?') else {
        return tail.to_string();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (rest, None),
    };
    let secret = |name: &str| {
        let decoded = percent_encoding::percent_decode_str(name)
            .decode_utf8_lossy()
            .to_ascii_lowercase();
        decoded == "pass" || decoded == "password"
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if secret(name) => format!("{name}=****"),
            _ => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    match fragment {
        Some(fragment) => format!("{path}?{query}#{fragment}"),
        None => format!("{path}?{query}"),
    }
}

/// A configuration as TOML a `--config` file accepts back (masked values
/// aside), each line commented with its source; unset settings commented out.
pub fn render_toml(settings: &[Effective]) -> String {
    let width = settings
        .iter()
        .filter(|s| s.value.is_some())
        .map(|s| s.name.len() + quoted_len(s.value.as_deref().unwrap_or_default()))
        .max()
        .unwrap_or(0)
        + 3;
    let mut out = String::new();
    for s in settings {
        match &s.value {
            Some(v) => {
                // The file's own name is not a setting it may hold.
                let comment = if s.name == CONFIG_SETTING { "# " } else { "" };
                let line = format!("{comment}{} = {}", s.name, toml_value(v));
                out.push_str(&format!("{line:<width$}  # {}\n", s.source));
            }
            None => out.push_str(&format!("# {} (not set)\n", s.name)),
        }
    }
    out
}

fn quoted_len(value: &str) -> usize {
    toml_value(value).len()
}

/// A value as TOML: integers and booleans bare, everything else a string.
fn toml_value(value: &str) -> String {
    if value == "true" || value == "false" || value.parse::<i64>().is_ok() {
        value.to_string()
    } else {
        // A JSON string is a TOML basic string (same quotes and escapes).
        serde_json::Value::String(value.to_string()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, value_parser};

    fn serve() -> Command {
        Command::new("serve")
            .no_binary_name(true)
            .arg(Arg::new("config").long("config").env("TEST_CONFIG_FILE"))
            .arg(
                Arg::new("listen")
                    .long("listen")
                    .env("TEST_CONFIG_LISTEN")
                    .default_value("127.0.0.1:50051"),
            )
            .arg(
                Arg::new("max_open")
                    .long("max-open")
                    .value_parser(value_parser!(u64))
                    .default_value("1000"),
            )
            .arg(
                Arg::new("allow_eviction")
                    .long("allow-eviction")
                    .action(ArgAction::SetTrue),
            )
            .arg(Arg::new("redis_url").long("redis-url"))
    }

    fn file(text: &str) -> Result<FileSettings, String> {
        FileSettings::parse(Path::new("atmost.toml"), text, &serve())
    }

    #[test]
    fn a_flag_beats_the_file_which_beats_the_default() {
        let f = file("listen = \"0.0.0.0:1\"\nmax-open = 7\nallow-eviction = true\n").unwrap();
        let m = f
            .apply(serve())
            .try_get_matches_from(["--max-open", "9"])
            .unwrap();
        assert_eq!(m.get_one::<String>("listen").unwrap(), "0.0.0.0:1");
        assert_eq!(*m.get_one::<u64>("max_open").unwrap(), 9);
        assert!(m.get_flag("allow_eviction"));
        let all = effective(&serve(), &m, Some(&f));
        let of = |name: &str| all.iter().find(|e| e.name == name).unwrap().clone();
        assert_eq!(
            of("listen").source,
            Source::File(PathBuf::from("atmost.toml"))
        );
        assert_eq!(of("max-open").source, Source::Flag);
        assert_eq!(of("max-open").value.as_deref(), Some("9"));
        assert_eq!(of("redis-url").source, Source::Unset);
        let defaults = serve().try_get_matches_from(Vec::<String>::new()).unwrap();
        assert!(!defaults.get_flag("allow_eviction"));
        assert_eq!(
            effective(&serve(), &defaults, None)[1].source,
            Source::Default
        );
    }

    #[test]
    fn every_bad_file_names_the_key_and_what_is_wrong() {
        let err = |text: &str| file(text).unwrap_err();
        assert!(
            err("max_open = 3").contains("max_open: no such setting (did you mean \"max-open\"?)"),
            "{}",
            err("max_open = 3")
        );
        assert!(err("nope = 1").contains("atmost.toml: nope: no such setting"));
        assert!(
            err("max-open = \"many\"").contains("atmost.toml: max-open: invalid value 'many'"),
            "{}",
            err("max-open = \"many\"")
        );
        assert!(err("max-open = -1").contains("max-open: invalid value '-1'"));
        assert!(
            err("allow-eviction = \"yes\"").contains("allow-eviction: \"yes\" is not a boolean")
        );
        assert!(
            err("listen = [1]").contains("listen: a array is not a value here")
                || err("listen = [1]").contains("listen: an array")
        );
        assert!(
            err("config = \"other.toml\"")
                .contains("config: a configuration file cannot name another")
        );
        assert!(err("listen = ").contains("atmost.toml: not TOML"));
    }

    #[test]
    fn passwords_in_urls_are_masked() {
        assert_eq!(
            mask_urls("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            mask_urls("rediss://atmost:s3cr@t@redis:6380/0,redis://:pw@other"),
            "rediss://atmost:****@redis:6380/0,redis://:****@other"
        );
        assert_eq!(mask_urls("redis://pw@h/1?x=y"), "redis://****@h/1?x=y");
    }

    #[test]
    fn passwords_in_query_strings_are_masked() {
        // redis-rs reads ?pass= as a Unix socket's password.
        assert_eq!(
            mask_urls("redis+unix:///run/redis.sock?db=2&pass=hunter2"),
            "redis+unix:///run/redis.sock?db=2&pass=****"
        );
        assert_eq!(
            mask_urls("unix:///s?password=a%26b&user=app#frag"),
            "unix:///s?password=****&user=app#frag"
        );
        // However the name is spelled or escaped; a value's '=' is the value's.
        assert_eq!(
            mask_urls("redis://h/0?PASS=x=y&%70ass=z&Password=w,redis://u:p@h?pass=q"),
            "redis://h/0?PASS=****&%70ass=****&Password=****,redis://u:****@h?pass=****"
        );
        assert_eq!(
            mask_urls("unix:/run/redis.sock?pass=x"),
            "unix:/run/redis.sock?pass=****"
        );
        // Other parameters, and a name that only starts like one, stay.
        assert_eq!(
            mask_urls("redis+unix:///s?passive=1&user=pass&protocol=resp3"),
            "redis+unix:///s?passive=1&user=pass&protocol=resp3"
        );
    }

    #[test]
    fn the_rendered_configuration_reads_back_as_the_same_values() {
        let f = file("max-open = 12\nallow-eviction = true\n").unwrap();
        let m = f
            .apply(serve())
            .try_get_matches_from(["--listen", "127.0.0.1:9"])
            .unwrap();
        let text = render_toml(&effective(&serve(), &m, Some(&f)));
        assert!(text.contains("# redis-url (not set)"), "{text}");
        let again = FileSettings::parse(Path::new("again.toml"), &text, &serve()).unwrap();
        let m2 = again
            .apply(serve())
            .try_get_matches_from(Vec::<String>::new())
            .unwrap();
        assert_eq!(m2.get_one::<String>("listen").unwrap(), "127.0.0.1:9");
        assert_eq!(*m2.get_one::<u64>("max_open").unwrap(), 12);
        assert!(m2.get_flag("allow_eviction"));
    }
}
