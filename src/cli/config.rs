//! The command line with a `--config` file under it, and
//! `atmost config check`.

use super::serve::flags::ServeArgs;
use super::serve::prepare::prepare;
use crate::Cli;
use atmost::config::{self, FileSettings};

pub enum Invalid {
    /// Bad flags or variables: clap says so (and exits 2), or prints help.
    Clap(clap::Error),
    /// A --config file that cannot be read or says something wrong.
    File(String),
}

/// The command line, with a `--config` file's values (for `serve` and
/// `config check`) as the defaults of the settings it names, so that a flag
/// and an ATMOST_* variable still beat it. Returns the matches too, for
/// `config check` to say where each value came from.
pub fn parse(
    argv: Vec<std::ffi::OsString>,
) -> Result<(Cli, clap::ArgMatches, Option<FileSettings>), Invalid> {
    use clap::{CommandFactory, FromArgMatches};
    let first = Cli::command()
        .try_get_matches_from(&argv)
        .map_err(Invalid::Clap)?;
    // The path of the settings `serve` takes, under either command.
    let path: &[&str] = match first.subcommand() {
        Some(("serve", _)) => &["serve"],
        Some(("config", sub)) if sub.subcommand_name() == Some("check") => &["config", "check"],
        _ => &[],
    };
    let mut serve = &first;
    for name in path {
        serve = serve.subcommand_matches(name).expect("matched above");
    }
    let named = match path.is_empty() {
        true => None,
        false => serve.get_one::<std::path::PathBuf>(config::CONFIG_SETTING),
    };
    let file = match named {
        Some(file) => {
            Some(FileSettings::load(file, &settings_command(path)).map_err(Invalid::File)?)
        }
        None => None,
    };
    let Some(settings) = &file else {
        let cli = Cli::from_arg_matches(&first).map_err(Invalid::Clap)?;
        return Ok((cli, first, None));
    };
    let command = match path {
        ["serve"] => Cli::command().mut_subcommand("serve", |c| settings.apply(c)),
        _ => Cli::command().mut_subcommand("config", |c| {
            c.mut_subcommand("check", |c| settings.apply(c))
        }),
    };
    let matches = command.try_get_matches_from(&argv).map_err(Invalid::Clap)?;
    let cli = Cli::from_arg_matches(&matches).map_err(Invalid::Clap)?;
    Ok((cli, matches, file))
}

/// The subcommand at `path` (its settings are `serve`'s).
fn settings_command(path: &[&str]) -> clap::Command {
    use clap::CommandFactory;
    let mut command = Cli::command();
    for name in path {
        command = command
            .find_subcommand(name)
            .expect("a subcommand of atmost")
            .clone();
    }
    command
}

/// `atmost config check`: the effective configuration, then whether `serve`
/// would accept it.
pub fn check(
    args: &ServeArgs,
    matches: &clap::ArgMatches,
    file: Option<&FileSettings>,
) -> std::process::ExitCode {
    let check = matches
        .subcommand_matches("config")
        .and_then(|m| m.subcommand_matches("check"))
        .expect("config check matched");
    let settings = config::effective(&settings_command(&["config", "check"]), check, file);
    print!("{}", config::render_toml(&settings));
    match prepare(args) {
        Ok(_) => {
            eprintln!("atmost: the configuration is valid");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("atmost: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
