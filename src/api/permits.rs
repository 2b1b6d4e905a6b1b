//! `atmost.v1.Permits`: CreatePermit, GetPermit, GetAttempt, RevokePermit,
//! ListUncertain, Resolve.

use super::{Ctx, Deadline, audit::Audit, convert, scope_of, status::to_status, tenant_of};
use crate::auth::{Identity, Role};
use crate::domain::new_id;
use crate::domain::{AttemptState, Error, invalid, validate_permit_id};
use crate::pb::{self, permits_server::Permits};
use crate::store::Store;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// ListUncertain's page size when the request gives none.
pub const DEFAULT_PAGE_SIZE: usize = 100;
/// ListUncertain's largest page.
pub const MAX_PAGE_SIZE: usize = 1000;

pub struct PermitsService {
    ctx: Ctx,
}

impl PermitsService {
    pub fn new(ctx: Ctx) -> Self {
        Self { ctx }
    }
}

#[tonic::async_trait]
impl Permits for PermitsService {
    async fn create_permit(
        &self,
        request: Request<pb::CreatePermitRequest>,
    ) -> Result<Response<pb::Permit>, Status> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("CreatePermit", &request);
        audit.about("", "", "");
        let scope = tenant_of(&request);
        let now = self.ctx.clock.now();
        let result =
            match convert::permit_spec(request.into_inner().permit, self.ctx.approval_waits)
                .and_then(|spec| spec.into_permit(new_id(now), now, &scope.tenant))
            {
                Ok(permit) => {
                    self.ctx
                        .call(deadline, self.ctx.store.create_permit(permit))
                        .await
                }
                Err(e) => Err(e),
            };
        match &result {
            Ok(p) => audit.record(&p.permit_id, "", "", "CREATED", ""),
            Err(e) => audit.record("", "", "", e.reason().as_str(), ""),
        }
        let permit = result.map_err(to_status)?;
        // The subject is free text: written escaped, it cannot forge a line.
        tracing::info!(
            permit_id = %permit.permit_id,
            subject = %permit.subject.escape_debug(),
            "permit created"
        );
        Ok(Response::new(convert::permit(permit)))
    }

    async fn get_permit(
        &self,
        request: Request<pb::GetPermitRequest>,
    ) -> Result<Response<pb::GetPermitResponse>, Status> {
        let deadline = Deadline::of(&request);
        let scope = scope_of(&request, &[Role::Admin, Role::Operator, Role::Approver]);
        let id = validate_permit_id(&request.into_inner().permit_id).map_err(to_status)?;
        crate::telemetry::note_permit(&id);
        let view = self
            .ctx
            .call(
                deadline,
                self.ctx.store.get_permit(&scope, &id, self.ctx.clock.now()),
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::GetPermitResponse {
            budget_remaining: view.budget_remaining(),
            budget_committed: view.budget_committed,
            budget_reserved: view.budget_reserved,
            usage: view.usage.into_iter().map(convert::usage).collect(),
            permit: Some(convert::permit(view.permit)),
        }))
    }

    async fn get_attempt(
        &self,
        request: Request<pb::GetAttemptRequest>,
    ) -> Result<Response<pb::GetAttemptResponse>, Status> {
        let deadline = Deadline::of(&request);
        // As GetPermit: an agent key sees only the permits that name it
        // (or name no agent); operators and admins are not limited.
        let scope = scope_of(&request, &[Role::Admin, Role::Operator, Role::Approver]);
        let reconciler = reconciles(&request);
        let approves = has_role(&request, Role::Approver);
        let mut cmd = convert::get_attempt_cmd(request.into_inner());
        cmd.validate().map_err(to_status)?;
        crate::telemetry::note_permit(&cmd.permit_id);
        let mut attempt = self
            .ctx
            .call(
                deadline,
                self.ctx
                    .store
                    .get_attempt(&scope, &cmd, self.ctx.clock.now()),
            )
            .await
            .map_err(to_status)?;
        // The attempt_id is the fencing token Commit and MarkUncertain
        // take. An open attempt's belongs to its holder, who has it from
        // Authorize: a reader given it could Commit NotSent while the
        // holder is still sending (the slot and the key freed, a second
        // DISPATCH), or Commit Failed on a call that may have happened.
        // So a RESERVED attempt's is never read back, and an UNCERTAIN
        // one's only by those who may Resolve it anyway (as ListUncertain
        // shows it them). A settled attempt's id can settle nothing more.
        // A pending call's id is for those who may approve it (the
        // listing shows it them): once approved and claimed, it is the
        // reservation's fencing token.
        match attempt.state {
            AttemptState::Reserved => attempt.attempt_id.clear(),
            AttemptState::Uncertain if !reconciler => attempt.attempt_id.clear(),
            AttemptState::AwaitingApproval | AttemptState::Approved if !approves => {
                attempt.attempt_id.clear()
            }
            _ => {}
        }
        Ok(Response::new(pb::GetAttemptResponse {
            attempt: Some(convert::attempt(
                attempt,
                &scope.tenant,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
        }))
    }

    async fn revoke_permit(
        &self,
        request: Request<pb::RevokePermitRequest>,
    ) -> Result<Response<pb::Permit>, Status> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("RevokePermit", &request);
        let scope = tenant_of(&request);
        let raw_id = request.into_inner().permit_id;
        audit.about(&raw_id, "", "");
        let result = match validate_permit_id(&raw_id) {
            Ok(id) => {
                self.ctx
                    .call(
                        deadline,
                        self.ctx
                            .store
                            .revoke_permit(&scope, &id, self.ctx.clock.now()),
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        match &result {
            Ok(p) => audit.record(&p.permit_id, "", "", "REVOKED", ""),
            Err(e) => audit.record(&raw_id, "", "", e.reason().as_str(), ""),
        }
        let permit = result.map_err(to_status)?;
        // Revoked, the calls waiting for approval are denied: their waits end.
        self.ctx.decisions.decided_all(&permit.permit_id);
        tracing::info!(permit_id = %permit.permit_id, "permit revoked");
        Ok(Response::new(convert::permit(permit)))
    }

    async fn list_uncertain(
        &self,
        request: Request<pb::ListUncertainRequest>,
    ) -> Result<Response<pb::ListUncertainResponse>, Status> {
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
                self.ctx.store.list_uncertain(
                    &scope,
                    permit_id.as_deref(),
                    after.as_ref(),
                    limit,
                    now,
                ),
            )
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::ListUncertainResponse {
            attempts: page
                .attempts
                .into_iter()
                .map(|a| {
                    convert::attempt(
                        a,
                        &scope.tenant,
                        self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
                    )
                })
                .collect(),
            next_page_token: page
                .next
                .as_ref()
                .map(convert::page_token)
                .unwrap_or_default(),
        }))
    }

    async fn resolve(
        &self,
        request: Request<pb::ResolveRequest>,
    ) -> Result<Response<pb::ResolveResponse>, Status> {
        let deadline = Deadline::of(&request);
        let mut audit = Audit::of("Resolve", &request);
        let scope = tenant_of(&request);
        let r = request.into_inner();
        let (permit_id, key) = (r.permit_id.clone(), r.idempotency_key.clone());
        audit.about(&permit_id, "", &key);
        let now = self.ctx.clock.now();
        let result = match convert::resolve_cmd(r).and_then(|mut cmd| cmd.validate().map(|()| cmd))
        {
            Ok(cmd) => {
                self.ctx
                    .call(
                        deadline,
                        self.ctx.store.resolve(&scope, &cmd, now, new_id(now)),
                    )
                    .await
            }
            Err(e) => Err(e),
        };
        audit.attempt(&permit_id, &key, result.as_ref().map(|s| &s.attempt));
        let settled = result.map_err(to_status)?;
        tracing::info!(
            permit_id = %settled.attempt.permit_id,
            idempotency_key = %settled.attempt.idempotency_key,
            state = settled.attempt.state.as_str(),
            "uncertain attempt resolved"
        );
        Ok(Response::new(pb::ResolveResponse {
            attempt: Some(convert::attempt(
                settled.attempt,
                &scope.tenant,
                self.ctx.receipts.as_ref().map(|s| s.current()).as_deref(),
            )),
            usage: Some(convert::usage(settled.usage)),
        }))
    }
}

/// Whether the caller may reconcile UNCERTAIN attempts (ListUncertain,
/// Resolve): a key with the operator or admin role, or any caller in dev
/// mode, where no key is checked and every caller may call every RPC.
fn reconciles<T>(request: &Request<T>) -> bool {
    has_role(request, Role::Operator)
}

/// Whether the caller has `role` or is an admin; any caller in dev mode.
fn has_role<T>(request: &Request<T>, role: Role) -> bool {
    match request.extensions().get::<Arc<Identity>>() {
        Some(caller) => caller.roles.iter().any(|r| *r == role || *r == Role::Admin),
        None => true,
    }
}

type ListArgs = (Option<String>, Option<crate::store::Cursor>, usize);

/// A listing's permit (none: across the tenant), cursor and page size.
pub(super) fn list_args(
    permit_id: &str,
    page_size: u32,
    page_token: &str,
) -> Result<ListArgs, Error> {
    let permit_id = if permit_id.is_empty() {
        None
    } else {
        Some(validate_permit_id(permit_id)?)
    };
    let limit = match page_size as usize {
        0 => DEFAULT_PAGE_SIZE,
        n if n <= MAX_PAGE_SIZE => n,
        _ => return Err(invalid("page_size", "at most 1000")),
    };
    let after = if page_token.is_empty() {
        None
    } else {
        let cursor = convert::cursor(page_token)?;
        if permit_id.as_ref().is_some_and(|p| *p != cursor.permit_id) {
            return Err(invalid(
                "page_token",
                "belongs to a listing of another permit",
            ));
        }
        Some(cursor)
    };
    Ok((permit_id, after, limit))
}
