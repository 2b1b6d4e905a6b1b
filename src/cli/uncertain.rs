//! `atmost uncertain list | resolve`: ListUncertain (every page) and
//! Resolve, the reconciler's two calls.

use super::{Connection, Failure, connect, read, show};
use atmost_client::pb;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct UncertainArgs {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: UncertainCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum UncertainCommand {
    /// List the attempts whose outcome is unknown (ListUncertain, page by
    /// page to the end), RESERVED ones past their lease included.
    List {
        /// Only this permit's; without it, every permit of the key's
        /// tenant, oldest first.
        #[arg(long, value_name = "PERMIT_ID")]
        permit: Option<String>,
        /// Stop after N attempts (the default: all of them).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
        /// Attempts asked for per call (1 to 1000): smaller pages make
        /// shorter calls on a busy server.
        #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1000))]
        page_size: u32,
    },
    /// Settle an UNCERTAIN attempt once the tool's provider has said what
    /// happened (Resolve, an operator's): it succeeded, it failed, or it
    /// never took effect.
    Resolve(Box<ResolveArgs>),
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("outcome").required(true)))]
pub struct ResolveArgs {
    /// The permit's id.
    pub permit_id: String,
    /// The idempotency key of the UNCERTAIN attempt.
    pub key: String,
    /// The call took effect: a receipt is stored and its cost committed.
    #[arg(long, group = "outcome")]
    pub succeeded: bool,
    /// With --succeeded: the tool's result as text (stored in the receipt).
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["result_file", "failed", "not_sent"])]
    pub result: Option<String>,
    /// With --succeeded: the tool's result, read from a file (any bytes).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["failed", "not_sent"])]
    pub result_file: Option<PathBuf>,
    /// With --succeeded: what it cost, at most the reserved cost (the
    /// default: the reserved cost).
    #[arg(long, value_name = "N", conflicts_with_all = ["failed", "not_sent"])]
    pub actual_cost: Option<i64>,
    /// The call went out and the tool refused it: the cost is released,
    /// the slot kept.
    #[arg(long, value_name = "REASON", group = "outcome")]
    pub failed: Option<String>,
    /// The call never took effect, on the tool provider's word: the slot
    /// and the cost come back and the key is free for a new call. A wrong
    /// one gives a slot to a call that was made, so it needs --attempt-id
    /// (the attempt you checked: a retried command never releases a newer
    /// one) and --yes.
    #[arg(long, group = "outcome", requires_all = ["attempt_id", "yes"])]
    pub not_sent: bool,
    /// The attempt reconciled, as `uncertain list` or `attempt get` shows
    /// it; another attempt under the key is then ATTEMPT_MISMATCH.
    /// Required with --not-sent.
    #[arg(long, value_name = "ID")]
    pub attempt_id: Option<String>,
    /// Confirms --not-sent.
    #[arg(long)]
    pub yes: bool,
}

pub async fn run(args: UncertainArgs) -> Result<(), Failure> {
    let json = args.connection.json;
    let outcome = match &args.command {
        UncertainCommand::Resolve(r) => Some(outcome(r)?),
        UncertainCommand::List { .. } => None,
    };
    let client = connect(&args.connection.server, &args.connection.credentials).await?;
    match args.command {
        UncertainCommand::List {
            permit,
            limit,
            page_size,
        } => {
            let permit = permit.unwrap_or_default();
            let (attempts, rest) = list(&client, &permit, limit, page_size).await?;
            if json {
                let page = pb::ListUncertainResponse {
                    attempts,
                    next_page_token: rest,
                };
                show::print_json(&show::json_value("ListUncertainResponse", &page));
                return Ok(());
            }
            if attempts.is_empty() {
                outln!("no uncertain attempts");
                return Ok(());
            }
            outln!("{}", table(&attempts));
            let n = attempts.len();
            let s = if n == 1 { "" } else { "s" };
            match rest.is_empty() {
                true => outln!("\n{n} uncertain attempt{s}"),
                false => outln!("\n{n} uncertain attempt{s} shown; more remain past --limit"),
            }
        }
        UncertainCommand::Resolve(r) => {
            let resolved = client
                .resolve(pb::ResolveRequest {
                    permit_id: r.permit_id.clone(),
                    idempotency_key: r.key.clone(),
                    attempt_id: r.attempt_id.clone().unwrap_or_default(),
                    outcome,
                })
                .await?;
            if json {
                show::print_json(&show::json_value("ResolveResponse", &resolved));
                return Ok(());
            }
            let attempt = resolved.attempt.unwrap_or_default();
            outln!(
                "resolved {}: {}\n",
                show::text(&attempt.idempotency_key),
                show::state(&attempt)
            );
            outln!("{}\n", show::attempt(&attempt));
            outln!("{}", show::usage(resolved.usage.as_slice()));
        }
    }
    Ok(())
}

/// The outcome the flags name (the group makes it exactly one).
fn outcome(r: &ResolveArgs) -> Result<pb::resolve_request::Outcome, Failure> {
    use pb::resolve_request::Outcome;
    if let Some(reason) = &r.failed {
        return Ok(Outcome::Failed(pb::Failed {
            reason: reason.clone(),
        }));
    }
    if r.not_sent {
        return Ok(Outcome::NotSent(pb::NotSent {}));
    }
    let result = match (&r.result, &r.result_file) {
        (_, Some(path)) => read(path, "--result-file")?,
        (Some(text), None) => text.clone().into_bytes(),
        (None, None) => Vec::new(),
    };
    Ok(Outcome::Succeeded(pb::Succeeded {
        result,
        actual_cost: r.actual_cost,
    }))
}

/// Every uncertain attempt (or the first `limit`), following page tokens;
/// and the token to go on from ("" when none remain).
async fn list(
    client: &atmost_client::Client,
    permit: &str,
    limit: Option<u32>,
    page_size: u32,
) -> Result<(Vec<pb::Attempt>, String), Failure> {
    pages(
        "ListUncertain",
        limit,
        page_size,
        |page_size, page_token| {
            let call = client.list_uncertain(pb::ListUncertainRequest {
                permit_id: permit.into(),
                page_size,
                page_token,
            });
            async move {
                let page = call.await?;
                Ok((page.attempts, page.next_page_token))
            }
        },
    )
    .await
}

/// Every attempt a paged listing (`rpc`) gives, or the first `limit`:
/// `page(page_size, page_token)` is one call, answering the page's
/// attempts and the next token. Also the token to go on from ("" when
/// none remain). A listing that answers more than it was asked for, or a
/// token it gave before, is refused rather than followed forever.
pub(super) async fn pages<F, P>(
    rpc: &str,
    limit: Option<u32>,
    page_size: u32,
    mut page: F,
) -> Result<(Vec<pb::Attempt>, String), Failure>
where
    F: FnMut(u32, String) -> P,
    P: Future<Output = Result<(Vec<pb::Attempt>, String), atmost_client::Error>>,
{
    let mut out = Vec::new();
    let mut token = String::new();
    let mut seen = std::collections::HashSet::new();
    loop {
        let left = limit.map_or(page_size, |l| l - out.len() as u32);
        let page_size = left.min(page_size);
        let (attempts, next) = page(page_size, token.clone()).await?;
        if attempts.len() > page_size as usize {
            return Err(broken(rpc, "a page larger than asked for"));
        }
        out.extend(attempts);
        token = next;
        if token.is_empty() || limit.is_some_and(|l| out.len() as u32 >= l) {
            return Ok((out, token));
        }
        if !seen.insert(token.clone()) {
            return Err(broken(rpc, "a page token it had answered before"));
        }
    }
}

fn broken(rpc: &str, what: &str) -> Failure {
    Failure::Rpc(tonic::Status::internal(format!("{rpc} answered {what}")).into())
}

fn table(attempts: &[pb::Attempt]) -> String {
    show::table(
        &[
            "PERMIT", "KEY", "TOOL", "COST", "SINCE", "REASON", "ATTEMPT",
        ],
        &["COST"],
        attempts
            .iter()
            .map(|a| {
                vec![
                    a.permit_id.clone(),
                    show::text(&a.idempotency_key),
                    a.tool.clone(),
                    a.cost.to_string(),
                    show::time(a.uncertain_since.as_ref()),
                    show::text(&a.uncertain_reason),
                    a.attempt_id.clone(),
                ]
            })
            .collect(),
    )
}
