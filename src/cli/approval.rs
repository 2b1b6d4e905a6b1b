//! `atmost approval list | approve | deny`: ListApprovals (every page),
//! Approve and Deny, the calls of a person who decides what a permit's
//! approval rules hold (a key with the approver or admin role).

use super::{Connection, Failure, connect, show, uncertain};
use atmost_client::pb;

/// How much of a call's summary the listing's table shows; `attempt get`
/// and `--json` show all of it.
const SUMMARY_COLUMN: usize = 48;

#[derive(clap::Args, Debug)]
pub struct ApprovalArgs {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: ApprovalCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum ApprovalCommand {
    /// List the calls awaiting approval (ListApprovals, page by page to the
    /// end), oldest request first, each with the attempt id that approve
    /// and deny take.
    List {
        /// Only this permit's; without it, every permit of the key's
        /// tenant.
        #[arg(long, value_name = "PERMIT_ID")]
        permit: Option<String>,
        /// Stop after N calls (the default: all of them).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
        /// Calls asked for per call to the server (1 to 1000).
        #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1000))]
        page_size: u32,
    },
    /// Approve one call awaiting approval (Approve). The key that
    /// requested it may not (APPROVER_IS_REQUESTER); a four-eyes rule
    /// needs a second, distinct key before the call may be sent.
    Approve {
        /// The permit's id.
        permit_id: String,
        /// The idempotency key of the call.
        key: String,
        /// The attempt approved, as `approval list` shows it: the approval
        /// binds to that exact request (another attempt under the key is
        /// ATTEMPT_MISMATCH).
        #[arg(long, value_name = "ID")]
        attempt_id: String,
    },
    /// Deny one call awaiting approval, or approved and not yet claimed
    /// (Deny): it is never sent, its slot and cost come back, and its key
    /// replays the denial.
    Deny {
        /// The permit's id.
        permit_id: String,
        /// The idempotency key of the call.
        key: String,
        /// The attempt denied, as `approval list` shows it.
        #[arg(long, value_name = "ID")]
        attempt_id: String,
        /// Told to the requester on every replay (at most 1024 bytes; the
        /// default: "denied").
        #[arg(long, value_name = "TEXT", default_value = "")]
        reason: String,
    },
}

pub async fn run(args: ApprovalArgs) -> Result<(), Failure> {
    let json = args.connection.json;
    let client = connect(&args.connection.server, &args.connection.credentials).await?;
    match args.command {
        ApprovalCommand::List {
            permit,
            limit,
            page_size,
        } => {
            let permit = permit.unwrap_or_default();
            let (attempts, rest) = list(&client, &permit, limit, page_size).await?;
            if json {
                let page = pb::ListApprovalsResponse {
                    attempts,
                    next_page_token: rest,
                };
                show::print_json(&show::json_value("ListApprovalsResponse", &page));
                return Ok(());
            }
            if attempts.is_empty() {
                outln!("no calls await approval");
                return Ok(());
            }
            outln!("{}", table(&attempts));
            let n = attempts.len();
            let s = if n == 1 { "" } else { "s" };
            match rest.is_empty() {
                true => outln!("\n{n} call{s} awaiting approval"),
                false => {
                    outln!("\n{n} call{s} awaiting approval shown; more remain past --limit")
                }
            }
        }
        ApprovalCommand::Approve {
            permit_id,
            key,
            attempt_id,
        } => {
            let approved = client.approve(&permit_id, &key, &attempt_id).await?;
            if json {
                show::print_json(&show::json_value("ApproveResponse", &approved));
                return Ok(());
            }
            let attempt = approved.attempt.unwrap_or_default();
            outln!(
                "approved {}: {}\n",
                show::text(&attempt.idempotency_key),
                show::state_explained(&attempt)
            );
            outln!("{}", show::attempt(&attempt));
        }
        ApprovalCommand::Deny {
            permit_id,
            key,
            attempt_id,
            reason,
        } => {
            let denied = client.deny(&permit_id, &key, &attempt_id, &reason).await?;
            if json {
                show::print_json(&show::json_value("DenyResponse", &denied));
                return Ok(());
            }
            let attempt = denied.attempt.unwrap_or_default();
            outln!(
                "denied {}: {}\n",
                show::text(&attempt.idempotency_key),
                show::state_explained(&attempt)
            );
            outln!("{}\n", show::attempt(&attempt));
            outln!("{}", show::usage(denied.usage.as_slice()));
        }
    }
    Ok(())
}

/// Every call awaiting approval (or the first `limit`), following page
/// tokens; and the token to go on from ("" when none remain).
async fn list(
    client: &atmost_client::Client,
    permit: &str,
    limit: Option<u32>,
    page_size: u32,
) -> Result<(Vec<pb::Attempt>, String), Failure> {
    uncertain::pages(
        "ListApprovals",
        limit,
        page_size,
        |page_size, page_token| {
            let call = client.list_approvals(pb::ListApprovalsRequest {
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

/// The calls, a line each. The summary is the requester's free text: it is
/// escaped (no terminal escape, no line of its own) and cut short.
fn table(attempts: &[pb::Attempt]) -> String {
    show::table(
        &[
            "PERMIT",
            "KEY",
            "TOOL",
            "COST",
            "REQUESTED",
            "EXPIRES",
            "APPROVALS",
            "SUMMARY",
            "ATTEMPT",
        ],
        &["COST", "APPROVALS"],
        attempts
            .iter()
            .map(|a| {
                let approval = a.approval.clone().unwrap_or_default();
                vec![
                    a.permit_id.clone(),
                    show::text(&a.idempotency_key),
                    a.tool.clone(),
                    a.cost.to_string(),
                    show::time(a.created_at.as_ref()),
                    show::time(approval.expires_at.as_ref()),
                    show::approvals(&approval, "/"),
                    show::short(&approval.summary, SUMMARY_COLUMN),
                    a.attempt_id.clone(),
                ]
            })
            .collect(),
    )
}
