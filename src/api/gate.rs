//! `atmost.v1.Gate`: Authorize, Commit, MarkUncertain.
//!
//! Each RPC is one method whose error is still the domain's ([`Error`]):
//! the gRPC service maps it to a status ([`to_status`]), and the Envoy
//! front doors ([`super::envoy`]) to an HTTP answer. Both run exactly this
//! path: validation, the caller's scope and deadline, admission, the
//! store, the audit trail.

use super::{
    Ctx, Deadline, approvals::Decisions, audit::Audit, convert, layers::WaitAllowance, scope_of,
    status::to_status,
};
use crate::auth::Role;
use crate::domain::{AuthorizeCmd, Authorized, Decision, Error, Scope, new_id};
use crate::pb::{self, gate_server::Gate};
use crate::store::Backend;
use crate::store::Store;
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

pub struct GateService {
    ctx: Ctx,
}

impl GateService {
    pub fn new(ctx: Ctx) -> Self {
        Self { ctx }
    }
}

/// The reason of a refusal, for the audit trail.
fn refused(e: &Error) -> &'static str {
    e.reason().as_str()
}

#[tonic::async_trait]
impl Gate for GateService {
    async fn authorize(
        &self,
        request: Request<pb::AuthorizeRequest>,
    ) -> Result<Response<pb::AuthorizeResponse>, Status> {
        self.do_authorize(request)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        self.do_commit(request)
            .await
            .map(Response::new)
            .map_err(to_status)
    }

    async fn mark_uncertain(
        &self,
        request: Request<pb::MarkUncertainRequest>,
    ) -> Result<Response<pb::MarkUncertainResponse>, Status> {
        self.do_mark_uncertain(request)
            .await
            .map(Response::new)
            .map_err(to_status)
    }
}

impl GateService {
    /// One store Authorize, at the clock's now.
    async fn authorize_once(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        deadline: Deadline,
    ) -> Result<Authorized, Error> {
        let now = self.ctx.clock.now();
        self.ctx
            .call(
                deadline,
                self.ctx.store.authorize(scope, cmd, now, new_id(now)),
            )
            .await
    }

    /// Authorize with AuthorizeRequest.wait: while the call awaits
    /// approval, the answer waits for its decision (woken by an Approve or
    /// Deny of this process at once, and looking at a shared store again
    /// every [`Decisions::RECHECK`]), for at most `wait_ms`, never past the
    /// caller's deadline (less a margin for the answer's trip) nor the
    /// request's own lapse. Asking again is a read, or the claim of an
    /// approved call: what a same-key retry would do, without the RPC.
    async fn authorize_waiting(
        &self,
        scope: &Scope,
        cmd: &AuthorizeCmd,
        deadline: Deadline,
        wait: Duration,
    ) -> Result<Authorized, Error> {
        const MARGIN: Duration = Duration::from_millis(250);
        let decisions = &self.ctx.decisions;
        let mut sub = decisions.subscribe();
        let mut until = Instant::now() + wait;
        if let Some(at) = deadline.at() {
            until = until.min(Instant::from_std(at.checked_sub(MARGIN).unwrap_or(at)));
        }
        let recheck = matches!(*self.ctx.store, Backend::Redis(_)).then_some(Decisions::RECHECK);
        loop {
            // The last look comes after the wait is over.
            let authorized = self.authorize_once(scope, cmd, deadline).await?;
            if authorized.decision != Decision::AwaitApproval
                || decisions.is_closed()
                || Instant::now() >= until
            {
                return Ok(authorized);
            }
            // A lapse is a decision too: look again just after it.
            let lapse = Instant::now()
                + Duration::from_millis(authorized.approval_remaining_ms.max(0) as u64 + 1);
            decisions
                .wait(
                    &mut sub,
                    &cmd.permit_id,
                    &cmd.idempotency_key,
                    until.min(lapse),
                    recheck,
                )
                .await;
        }
    }

    /// Authorize, as the Gate serves it. The request's extensions carry the
    /// caller ([`crate::auth::Identity`]) and its [`Deadline`].
    pub async fn do_authorize(
        &self,
        request: Request<pb::AuthorizeRequest>,
    ) -> Result<pb::AuthorizeResponse, Error> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Authorize", &request);
        let scope = scope_of(&request, &[Role::Admin]);
        let wait = convert::approval_wait(request.get_ref());
        let allowance = request.extensions().get::<WaitAllowance>().cloned();
        let mut cmd = convert::authorize_cmd(request.into_inner());
        audit.about(&cmd.permit_id, &cmd.tool, &cmd.idempotency_key);
        // Every violation at once: the command's and the wait's.
        let checked = match (cmd.validate(), wait) {
            (Ok(()), Ok(wait)) => Ok(wait),
            (Err(Error::InvalidRequest(mut v)), Err(Error::InvalidRequest(w))) => {
                v.extend(w);
                Err(Error::InvalidRequest(v))
            }
            (Err(e), _) | (Ok(()), Err(e)) => Err(e),
        };
        let result = match checked {
            Ok(0) => self.authorize_once(&scope, &cmd, deadline).await,
            Ok(wait_ms) => {
                // The request timeout would cut the wait short: it may
                // take its wait more (the request is read by now).
                let wait = Duration::from_millis(wait_ms as u64);
                if let Some(allowance) = &allowance {
                    allowance.extend(wait);
                }
                self.authorize_waiting(&scope, &cmd, deadline, wait).await
            }
            Err(e) => Err(e),
        };
        let (outcome, attempt_id) = match &result {
            Ok(a) => (
                match (a.decision, a.redelivered) {
                    (Decision::Dispatch, false) => "DISPATCH",
                    (Decision::Dispatch, true) => "REDELIVERED",
                    (Decision::Replay, _) => "REPLAY",
                    (Decision::AwaitApproval, _) => "AWAIT_APPROVAL",
                },
                a.attempt.attempt_id.as_str(),
            ),
            Err(e) => (refused(e), ""),
        };
        audit.record(
            &cmd.permit_id,
            &cmd.tool,
            &cmd.idempotency_key,
            outcome,
            attempt_id,
        );
        let authorized = result?;
        if let (Decision::Dispatch, Some(earlier_key)) =
            (authorized.decision, &authorized.duplicate_of)
        {
            crate::telemetry::note_duplicate();
            tracing::warn!(
                permit_id = %cmd.permit_id,
                tool = %cmd.tool,
                idempotency_key = %cmd.idempotency_key,
                earlier_key = %earlier_key,
                "duplicate request suspected: a new key carries the same request as an earlier dispatch (guard LOG: dispatched anyway)"
            );
        }
        Ok(pb::AuthorizeResponse {
            decision: match authorized.decision {
                Decision::Dispatch => pb::Decision::Dispatch,
                Decision::Replay => pb::Decision::Replay,
                Decision::AwaitApproval => pb::Decision::AwaitApproval,
            } as i32,
            attempt: Some(convert::attempt(
                authorized.attempt,
                &scope.tenant,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
            usage: Some(convert::usage(authorized.usage)),
            duplicate_of: authorized.duplicate_of.unwrap_or_default(),
            redelivered: authorized.redelivered,
            lease_remaining: (authorized.decision == Decision::Dispatch)
                .then(|| convert::duration(authorized.lease_remaining_ms.max(0))),
            approval_remaining: (authorized.decision == Decision::AwaitApproval)
                .then(|| convert::duration(authorized.approval_remaining_ms.max(0))),
        })
    }

    /// Commit, as the Gate serves it.
    pub async fn do_commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<pb::CommitResponse, Error> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Commit", &request);
        let scope = scope_of(&request, &[Role::Admin]);
        let r = request.into_inner();
        let (permit_id, key) = (r.permit_id.clone(), r.idempotency_key.clone());
        audit.about(&permit_id, "", &key);
        let now = self.ctx.clock.now();
        let result = match convert::commit_cmd(r).and_then(|mut cmd| cmd.validate().map(|()| cmd)) {
            Ok(cmd) => {
                self.ctx
                    .call(
                        deadline,
                        self.ctx.store.commit(&scope, &cmd, now, new_id(now)),
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        audit.attempt(&permit_id, &key, result.as_ref().map(|s| &s.attempt));
        let settled = result?;
        Ok(pb::CommitResponse {
            attempt: Some(convert::attempt(
                settled.attempt,
                &scope.tenant,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
            usage: Some(convert::usage(settled.usage)),
        })
    }

    /// MarkUncertain, as the Gate serves it.
    pub async fn do_mark_uncertain(
        &self,
        request: Request<pb::MarkUncertainRequest>,
    ) -> Result<pb::MarkUncertainResponse, Error> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("MarkUncertain", &request);
        let scope = scope_of(&request, &[Role::Admin]);
        let mut cmd = convert::mark_uncertain_cmd(request.into_inner());
        audit.about(&cmd.permit_id, "", &cmd.idempotency_key);
        let now = self.ctx.clock.now();
        let result = match cmd.validate() {
            Ok(()) => {
                self.ctx
                    .call(deadline, self.ctx.store.mark_uncertain(&scope, &cmd, now))
                    .await
            }
            Err(e) => Err(e),
        };
        audit.attempt(&cmd.permit_id, &cmd.idempotency_key, result.as_ref());
        let attempt = result?;
        Ok(pb::MarkUncertainResponse {
            attempt: Some(convert::attempt(
                attempt,
                &scope.tenant,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
        })
    }
}
