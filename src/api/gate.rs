//! `atmost.v1.Gate`: Authorize, Commit, MarkUncertain.

use super::{Ctx, Deadline, convert, scope_of, status::to_status};
use crate::auth::Role;
use crate::domain::Decision;
use crate::domain::new_id;
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

#[tonic::async_trait]
impl Gate for GateService {
    async fn authorize(
        &self,
        request: Request<pb::AuthorizeRequest>,
    ) -> Result<Response<pb::AuthorizeResponse>, Status> {
        let deadline = Deadline::of(&request);
        let scope = scope_of(&request, &[Role::Admin]);
        let mut cmd = convert::authorize_cmd(request.into_inner());
        cmd.validate().map_err(to_status)?;
        let now = self.ctx.clock.now();
        let authorized = self
            .ctx
            .call(
                deadline,
                self.ctx.store.authorize(&scope, &cmd, now, new_id(now)),
            )
            .await
            .map_err(to_status)?;
        if let (Decision::Dispatch, Some(earlier_key)) =
            (authorized.decision, &authorized.duplicate_of)
        {
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
            attempt: Some(convert::attempt(authorized.attempt)),
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
        let scope = scope_of(&request, &[Role::Admin]);
        let mut cmd = convert::commit_cmd(request.into_inner()).map_err(to_status)?;
        cmd.validate().map_err(to_status)?;
        let now = self.ctx.clock.now();
        let settled = self
            .ctx
            .call(
                deadline,
                self.ctx.store.commit(&scope, &cmd, now, new_id(now)),
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::CommitResponse {
            attempt: Some(convert::attempt(settled.attempt)),
            usage: Some(convert::usage(settled.usage)),
        }))
    }

    async fn mark_uncertain(
        &self,
        request: Request<pb::MarkUncertainRequest>,
    ) -> Result<Response<pb::MarkUncertainResponse>, Status> {
        let deadline = Deadline::of(&request);
        let scope = scope_of(&request, &[Role::Admin]);
        let mut cmd = convert::mark_uncertain_cmd(request.into_inner());
        cmd.validate().map_err(to_status)?;
        let now = self.ctx.clock.now();
        let attempt = self
            .ctx
            .call(deadline, self.ctx.store.mark_uncertain(&scope, &cmd, now))
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::MarkUncertainResponse {
            attempt: Some(convert::attempt(attempt)),
        }))
    }
}
