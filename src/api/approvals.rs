//! `atmost.v1.Approvals`: ListApprovals, Approve, Deny, for the people
//! (approver or admin keys) who decide the calls a permit holds for them.

use super::{
    Ctx, Deadline, audit::Audit, convert, permits::list_args, status::to_status, tenant_of,
};
use crate::domain::Attempt;
use crate::pb::{self, approvals_server::Approvals};
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Approvals and denials decided by this process, for the Authorize calls
/// waiting on them (AuthorizeRequest.wait): each wakes at the decision of
/// its own call, at once. A decision made by another replica (the Redis
/// store) is seen at the next look at the store, every
/// [`Decisions::RECHECK`] of a wait.
#[derive(Debug)]
pub struct Decisions {
    tx: broadcast::Sender<Arc<(String, String)>>,
    /// Cancelled when the server stops serving: every wait ends at once.
    closing: CancellationToken,
}

/// A waiter's place in line, taken before it reads the store, so that no
/// decision made after the read is missed.
pub struct Subscription(broadcast::Receiver<Arc<(String, String)>>);

impl Default for Decisions {
    fn default() -> Self {
        Self {
            tx: broadcast::channel(256).0,
            closing: CancellationToken::new(),
        }
    }
}

impl Decisions {
    /// How often a waiting Authorize looks at a shared store again.
    pub const RECHECK: Duration = Duration::from_secs(2);

    pub fn subscribe(&self) -> Subscription {
        Subscription(self.tx.subscribe())
    }

    /// Every call of the permit was decided (RevokePermit denies them all).
    pub fn decided_all(&self, permit_id: &str) {
        self.decided(permit_id, "");
    }

    /// A call was approved or denied: its waiters look again.
    pub fn decided(&self, permit_id: &str, idempotency_key: &str) {
        // No receiver is no waiter: nothing to wake.
        let _ = self
            .tx
            .send(Arc::new((permit_id.to_owned(), idempotency_key.to_owned())));
    }

    /// The server stops serving: every wait ends now.
    pub fn close(&self) {
        self.closing.cancel();
    }

    /// Waits until the call (permit, key) is decided here, `until`, the
    /// `recheck` (if any) has passed, or the server closes; which one it
    /// was does not matter, since the caller then reads the store.
    pub async fn wait(
        &self,
        sub: &mut Subscription,
        permit_id: &str,
        idempotency_key: &str,
        until: Instant,
        recheck: Option<Duration>,
    ) {
        let until = match recheck {
            Some(every) => until.min(Instant::now() + every),
            None => until,
        };
        let decided = async {
            loop {
                match sub.0.recv().await {
                    Ok(call)
                        if call.0 == permit_id
                            && (call.1.is_empty() || call.1 == idempotency_key) =>
                    {
                        return;
                    }
                    Ok(_) => {}
                    // Missed some: one of them may be ours.
                    Err(broadcast::error::RecvError::Lagged(_)) => return,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
                }
            }
        };
        tokio::select! {
            () = decided => {}
            () = tokio::time::sleep_until(until) => {}
            () = self.closing.cancelled() => {}
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closing.is_cancelled()
    }
}

pub struct ApprovalsService {
    ctx: Ctx,
}

impl ApprovalsService {
    pub fn new(ctx: Ctx) -> Self {
        Self { ctx }
    }

    fn attempt(&self, a: Attempt, tenant: &str) -> pb::Attempt {
        convert::attempt(
            a,
            tenant,
            self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
        )
    }
}

/// How long the call waited for its decision, on the store's clock (a
/// repeated decision counts again).
fn waited(attempt: &Attempt) -> Duration {
    let decided_at = attempt.approval.as_ref().map_or(0, |a| a.decided_at);
    Duration::from_millis((decided_at - attempt.created_at).max(0) as u64)
}

#[tonic::async_trait]
impl Approvals for ApprovalsService {
    async fn list_approvals(
        &self,
        request: Request<pb::ListApprovalsRequest>,
    ) -> Result<Response<pb::ListApprovalsResponse>, Status> {
        let deadline = Deadline::of(&request);
        let scope = tenant_of(&request);
        let r = request.into_inner();
        let (permit_id, after, limit) =
            list_args(&r.permit_id, r.page_size, &r.page_token).map_err(to_status)?;
        crate::telemetry::note_permit(permit_id.as_deref().unwrap_or_default());
        let now = self.ctx.clock.now();
        let page = self
            .ctx
            .call(
                deadline,
                self.ctx.store.list_approvals(
                    &scope,
                    permit_id.as_deref(),
                    after.as_ref(),
                    limit,
                    now,
                ),
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListApprovalsResponse {
            attempts: page
                .attempts
                .into_iter()
                .map(|a| self.attempt(a, &scope.tenant))
                .collect(),
            next_page_token: page
                .next
                .as_ref()
                .map(convert::page_token)
                .unwrap_or_default(),
        }))
    }

    async fn approve(
        &self,
        request: Request<pb::ApproveRequest>,
    ) -> Result<Response<pb::ApproveResponse>, Status> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Approve", &request);
        let scope = tenant_of(&request);
        let mut cmd = convert::approve_cmd(request.into_inner());
        let (permit_id, key) = (cmd.permit_id.clone(), cmd.idempotency_key.clone());
        audit.about(&permit_id, "", &key);
        let now = self.ctx.clock.now();
        let result = match cmd.validate() {
            Ok(()) => {
                self.ctx
                    .call(deadline, self.ctx.store.approve(&scope, &cmd, now))
                    .await
            }
            Err(e) => Err(e),
        };
        audit.attempt(&permit_id, &key, result.as_ref());
        let attempt = result.map_err(to_status)?;
        self.ctx
            .decisions
            .decided(&attempt.permit_id, &attempt.idempotency_key);
        // The approval that completed it (not the first of two).
        if let Some(approval) = &attempt.approval
            && attempt.state == crate::domain::AttemptState::Approved
            && approval.decided_by == scope.key_id
        {
            crate::telemetry::note_approval_decided("approved", waited(&attempt));
        }
        tracing::info!(
            permit_id = %attempt.permit_id,
            idempotency_key = %attempt.idempotency_key.escape_debug(),
            approver = %scope.key_id,
            state = attempt.state.as_str(),
            "call approved"
        );
        Ok(Response::new(pb::ApproveResponse {
            attempt: Some(self.attempt(attempt, &scope.tenant)),
        }))
    }

    async fn deny(
        &self,
        request: Request<pb::DenyRequest>,
    ) -> Result<Response<pb::DenyResponse>, Status> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Deny", &request);
        let scope = tenant_of(&request);
        let mut cmd = convert::deny_cmd(request.into_inner());
        let (permit_id, key) = (cmd.permit_id.clone(), cmd.idempotency_key.clone());
        audit.about(&permit_id, "", &key);
        let now = self.ctx.clock.now();
        let result = match cmd.validate() {
            Ok(()) => {
                self.ctx
                    .call(deadline, self.ctx.store.deny(&scope, &cmd, now))
                    .await
            }
            Err(e) => Err(e),
        };
        audit.attempt(&permit_id, &key, result.as_ref().map(|s| &s.attempt));
        let settled = result.map_err(to_status)?;
        self.ctx
            .decisions
            .decided(&settled.attempt.permit_id, &settled.attempt.idempotency_key);
        if settled
            .attempt
            .approval
            .as_ref()
            .is_some_and(|a| a.decided_by == scope.key_id)
        {
            crate::telemetry::note_approval_decided("denied", waited(&settled.attempt));
        }
        tracing::info!(
            permit_id = %settled.attempt.permit_id,
            idempotency_key = %settled.attempt.idempotency_key.escape_debug(),
            approver = %scope.key_id,
            "call denied"
        );
        Ok(Response::new(pb::DenyResponse {
            attempt: Some(self.attempt(settled.attempt, &scope.tenant)),
            usage: Some(convert::usage(settled.usage)),
        }))
    }
}
