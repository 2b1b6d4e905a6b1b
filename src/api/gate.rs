//! `atmost.v1.Gate`: Authorize, Commit, MarkUncertain.

use super::{Ctx, Deadline, audit::Audit, convert, scope_of, status::to_status};
use crate::auth::Role;
use crate::domain::{Decision, Error, new_id};
use crate::pb::{self, gate_server::Gate};
use crate::store::Store;
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
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Authorize", &request);
        let scope = scope_of(&request, &[Role::Admin]);
        let mut cmd = convert::authorize_cmd(request.into_inner());
        audit.about(&cmd.permit_id, &cmd.tool, &cmd.idempotency_key);
        let now = self.ctx.clock.now();
        let result = match cmd.validate() {
            Ok(()) => {
                self.ctx
                    .call(
                        deadline,
                        self.ctx.store.authorize(&scope, &cmd, now, new_id(now)),
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        let (outcome, attempt_id) = match &result {
            Ok(a) => (
                match (a.decision, a.redelivered) {
                    (Decision::Dispatch, false) => "DISPATCH",
                    (Decision::Dispatch, true) => "REDELIVERED",
                    (Decision::Replay, _) => "REPLAY",
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
        let authorized = result.map_err(to_status)?;
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
        Ok(Response::new(pb::AuthorizeResponse {
            decision: match authorized.decision {
                Decision::Dispatch => pb::Decision::Dispatch,
                Decision::Replay => pb::Decision::Replay,
            } as i32,
            attempt: Some(convert::attempt(
                authorized.attempt,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
            usage: Some(convert::usage(authorized.usage)),
            duplicate_of: authorized.duplicate_of.unwrap_or_default(),
            redelivered: authorized.redelivered,
        }))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
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
        let settled = result.map_err(to_status)?;
        Ok(Response::new(pb::CommitResponse {
            attempt: Some(convert::attempt(
                settled.attempt,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
            usage: Some(convert::usage(settled.usage)),
        }))
    }

    async fn mark_uncertain(
        &self,
        request: Request<pb::MarkUncertainRequest>,
    ) -> Result<Response<pb::MarkUncertainResponse>, Status> {
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
        let attempt = result.map_err(to_status)?;
        Ok(Response::new(pb::MarkUncertainResponse {
            attempt: Some(convert::attempt(
                attempt,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
        }))
    }
}
