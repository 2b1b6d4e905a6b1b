//! `atmost permit create | get | revoke`: CreatePermit, GetPermit and
//! RevokePermit.

use super::{Connection, Failure, connect, show};
use atmost_client::{NewPermit, pb};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct PermitArgs {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: PermitCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum PermitCommand {
    /// Create a permit (CreatePermit, an admin's); prints its id first.
    Create(Box<CreateArgs>),
    /// Show a permit, its budget and its usage per tool (GetPermit).
    Get {
        /// The permit's id (any form of its UUID).
        permit_id: String,
    },
    /// Stop new idempotency keys under a permit (RevokePermit, an
    /// admin's). Commits, MarkUncertain, Resolve and replays of existing
    /// attempts keep working. Revoking twice is fine.
    Revoke {
        /// The permit's id.
        permit_id: String,
    },
}

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    /// A tool in scope (repeat, or separate with commas). A tool named by
    /// --cap or --approval is in scope too.
    #[arg(
        long = "tool",
        value_name = "NAME",
        value_delimiter = ',',
        required_unless_present_any = ["caps", "approvals"]
    )]
    pub tools: Vec<String>,
    /// At most N calls of TOOL (repeat for each tool); 0 disables it. A
    /// tool without a cap has none.
    #[arg(long = "cap", value_name = "TOOL=N", value_parser = cap)]
    pub caps: Vec<(String, u64)>,
    /// Calls of TOOL wait for a person's approval (repeat for each tool):
    /// every call, or with =N only those costing at least N.
    #[arg(long = "approval", value_name = "TOOL[=N]", value_parser = approval)]
    pub approvals: Vec<(String, Option<i64>)>,
    /// How long a call of an --approval tool may wait for its decision
    /// before it lapses as denied (the server's default: 15m).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, requires = "approvals")]
    pub approval_wait: Option<Duration>,
    /// Distinct approvers each call of an --approval tool needs: 1 (the
    /// default) or 2, a four-eyes rule (which needs a server with keys).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=2), requires = "approvals")]
    pub approvers: Option<u32>,
    /// Total budget in minor units; none: unlimited.
    #[arg(long, value_name = "N")]
    pub budget: Option<i64>,
    /// The budget's currency (informational), e.g. EUR.
    #[arg(long, default_value = "")]
    pub currency: String,
    /// Expiry from now, e.g. 1h, 30m, 7days (the default: 1h).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration, conflicts_with = "expires_at")]
    pub expires_in: Option<Duration>,
    /// Expiry as an RFC 3339 time, e.g. 2026-05-01T12:00:00Z or
    /// 2026-05-01T14:00:00+02:00.
    #[arg(long, value_name = "TIME", value_parser = rfc3339)]
    pub expires_at: Option<i64>,
    /// How long a dispatch may stay open before it is presumed uncertain
    /// (the server's default: 30s).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub lease: Option<Duration>,
    /// What to do with a new key carrying the request of a recent one (the
    /// server's default: log).
    #[arg(long, value_enum, value_name = "MODE")]
    pub duplicate_guard: Option<GuardArg>,
    /// How far back the duplicate guard looks (the server's default: 10m).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub duplicate_window: Option<Duration>,
    /// What an UNCERTAIN attempt blocks (the server's default: count).
    #[arg(long, value_enum, value_name = "POLICY")]
    pub uncertain_policy: Option<PolicyArg>,
    /// Which agent or task holds the permit (free text).
    #[arg(long, default_value = "")]
    pub subject: String,
    /// An agent key id that may use the permit (repeat, or separate with
    /// commas); none: any agent of the tenant.
    #[arg(long = "agent", value_name = "KEY_ID", value_delimiter = ',')]
    pub agents: Vec<String>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum GuardArg {
    /// Not looked for.
    Off,
    /// Dispatched anyway, the earlier key named and logged.
    Log,
    /// Refused: DUPLICATE_REQUEST_SUSPECTED.
    Enforce,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum PolicyArg {
    /// It holds a slot like any dispatch: new keys go on within the cap.
    Count,
    /// No new key of its tool dispatches until it is resolved.
    HoldTool,
}

/// `TOOL=N`.
fn cap(s: &str) -> Result<(String, u64), String> {
    let (tool, n) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: give TOOL=N, e.g. wallet.charge=1"))?;
    let n = n
        .parse()
        .map_err(|_| format!("{s:?}: {n:?} is not a number of calls"))?;
    if tool.is_empty() {
        return Err(format!("{s:?}: no tool before '='"));
    }
    Ok((tool.to_owned(), n))
}

/// `TOOL` or `TOOL=N` (tool names never hold '=').
fn approval(s: &str) -> Result<(String, Option<i64>), String> {
    let (tool, cost) = match s.split_once('=') {
        None => (s, None),
        Some((tool, n)) => {
            let n = n
                .parse()
                .map_err(|_| format!("{s:?}: {n:?} is not a cost (minor units)"))?;
            (tool, Some(n))
        }
    };
    if tool.is_empty() {
        return Err(format!("{s:?}: give TOOL or TOOL=N, e.g. payout=1000"));
    }
    Ok((tool.to_owned(), cost))
}

/// An RFC 3339 time, in milliseconds since the Unix epoch.
fn rfc3339(s: &str) -> Result<i64, String> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("{s:?}: not an RFC 3339 time ({e})"))?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).map_err(|_| format!("{s:?}: out of range"))
}

pub async fn run(args: PermitArgs) -> Result<(), Failure> {
    let json = args.connection.json;
    let client = connect(&args.connection.server, &args.connection.credentials).await?;
    match args.command {
        PermitCommand::Create(create) => {
            let permit = client.create_permit(new_permit(&create)?).await?;
            if json {
                show::print_json(&show::json_value("Permit", &permit));
            } else {
                outln!("created permit {}\n", permit.permit_id);
                outln!("{}", show::permit(&permit, None));
            }
        }
        PermitCommand::Get { permit_id } => {
            let got = client.get_permit(&permit_id).await?;
            if json {
                show::print_json(&show::json_value("GetPermitResponse", &got));
            } else {
                let permit = got.permit.clone().unwrap_or_default();
                let budget = (
                    got.budget_committed,
                    got.budget_reserved,
                    got.budget_remaining,
                );
                outln!("{}\n", show::permit(&permit, Some(budget)));
                outln!("{}", show::usage(&got.usage));
            }
        }
        PermitCommand::Revoke { permit_id } => {
            let permit = client.revoke_permit(&permit_id).await?;
            if json {
                show::print_json(&show::json_value("Permit", &permit));
            } else {
                outln!("revoked permit {}\n", permit.permit_id);
                outln!("{}", show::permit(&permit, None));
            }
        }
    }
    Ok(())
}

/// The permit the flags describe. The server checks its rules (and names
/// every one broken); here only what the wire cannot carry is refused.
fn new_permit(a: &CreateArgs) -> Result<pb::Permit, Failure> {
    let mut tools = a.tools.clone();
    let named = a.caps.iter().map(|(tool, _)| tool);
    for tool in named.chain(a.approvals.iter().map(|(tool, _)| tool)) {
        if !tools.contains(tool) {
            tools.push(tool.clone());
        }
    }
    let expires_at = match (a.expires_at, a.expires_in) {
        (Some(at), _) => at,
        (None, expires_in) => {
            let ms = expires_in.unwrap_or(Duration::from_secs(3600)).as_millis();
            let ms = i64::try_from(ms)
                .map_err(|_| Failure::Usage("--expires-in: too far ahead".into()))?;
            atmost_client::now_ms().saturating_add(ms)
        }
    };
    let mut p = NewPermit::new(tools)
        .subject(a.subject.clone())
        .currency(a.currency.clone())
        .expires_at_ms(expires_at);
    for (tool, n) in &a.caps {
        p = p.cap(tool.clone(), *n);
    }
    for (tool, cost_at_least) in &a.approvals {
        let approvers = a.approvers.unwrap_or(1);
        p = p.approval(tool.clone(), *cost_at_least, a.approval_wait, approvers);
    }
    if let Some(budget) = a.budget {
        p = p.budget(budget);
    }
    if let Some(lease) = a.lease {
        p = p.lease(lease);
    }
    if a.duplicate_guard.is_some() || a.duplicate_window.is_some() {
        let mode = match a.duplicate_guard {
            None => pb::DuplicateGuardMode::Unspecified,
            Some(GuardArg::Off) => pb::DuplicateGuardMode::Off,
            Some(GuardArg::Log) => pb::DuplicateGuardMode::Log,
            Some(GuardArg::Enforce) => pb::DuplicateGuardMode::Enforce,
        };
        p = p.duplicate_guard(mode, a.duplicate_window);
    }
    if let Some(policy) = a.uncertain_policy {
        p = p.uncertain_policy(match policy {
            PolicyArg::Count => pb::UncertainPolicy::Count,
            PolicyArg::HoldTool => pb::UncertainPolicy::HoldTool,
        });
    }
    let mut permit = p.build();
    permit.agents = a.agents.clone();
    Ok(permit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_times_parse_or_say_why_not() {
        assert_eq!(cap("wallet.charge=1"), Ok(("wallet.charge".into(), 1)));
        assert!(cap("wallet.charge").unwrap_err().contains("TOOL=N"));
        assert!(cap("t=-1").unwrap_err().contains("not a number"));
        assert!(cap("=3").is_err());
        assert_eq!(approval("payout"), Ok(("payout".into(), None)));
        assert_eq!(approval("payout=1000"), Ok(("payout".into(), Some(1000))));
        assert!(approval("payout=lots").unwrap_err().contains("not a cost"));
        assert!(approval("=5").unwrap_err().contains("TOOL=N"));
        assert_eq!(rfc3339("1970-01-01T00:00:01.5Z"), Ok(1500));
        assert_eq!(rfc3339("1970-01-01T01:00:00+01:00"), Ok(0));
        assert!(rfc3339("tomorrow").is_err());
    }
}
