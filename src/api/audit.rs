//! The audit trail: one structured event per state-changing RPC (tracing
//! target `atmost::audit`), whatever its answer: who called (the key's id
//! and tenant, never the key), which RPC, about which permit, tool and
//! idempotency key, what was decided (the decision or the attempt's state,
//! or the reason it was refused) and the attempt's id. Never a fingerprint,
//! a result or a secret. Every value is either checked by validation (ids,
//! tool names, printable keys) or written escaped, so a caller cannot forge
//! a line of the trail.

use crate::auth::Identity;
use std::sync::Arc;

/// The caller of one RPC, taken before its request is consumed.
pub struct Audit {
    rpc: &'static str,
    caller: Option<Arc<Identity>>,
}

impl Audit {
    pub fn of<T>(rpc: &'static str, request: &tonic::Request<T>) -> Self {
        Self {
            rpc,
            caller: request.extensions().get::<Arc<Identity>>().cloned(),
        }
    }

    /// Records the RPC's answer: `outcome` is the decision, the attempt's
    /// state, or the refusal's reason name.
    pub fn record(
        &self,
        permit_id: &str,
        tool: &str,
        idempotency_key: &str,
        outcome: &str,
        attempt_id: &str,
    ) {
        let (key_id, tenant) = match &self.caller {
            Some(c) => (c.key_id.as_str(), c.tenant.as_str()),
            None => ("", ""),
        };
        tracing::info!(
            target: "atmost::audit",
            rpc = self.rpc,
            key_id,
            tenant,
            // Escaped (a refused request's values were never validated):
            // a newline cannot start a forged line.
            permit_id = %permit_id.escape_debug(),
            tool = %tool.escape_debug(),
            idempotency_key = %idempotency_key.escape_debug(),
            outcome,
            attempt_id,
            "audit"
        );
    }
}
