//! Permits: what an operator grants, and the usage counted against it.

use super::{
    DEFAULT_GUARD_WINDOW_MS, DEFAULT_LEASE_MS, Error, MAX_AMOUNT, MAX_DURATION_MS, MAX_TEXT_LEN,
    MAX_TOOLS, Millis, Violations, shown, valid_tool,
};
use std::collections::{BTreeMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PermitStatus {
    Active,
    Revoked,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardMode {
    Off,
    Log,
    Enforce,
}

/// What an UNCERTAIN attempt blocks for new keys of its tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UncertainPolicy {
    /// It holds a slot like any dispatch: new keys stop at the cap.
    #[default]
    Count,
    /// No new key of the tool dispatches while the tool has one.
    HoldTool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DuplicateGuard {
    pub mode: GuardMode,
    pub window_ms: Millis,
}

/// A durable authorization, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permit {
    pub permit_id: String,
    pub subject: String,
    /// Exact tool names in scope, in the order the operator gave them.
    pub tools: Vec<String>,
    /// Per-tool call caps; a tool with no entry has no cap.
    pub max_calls_per_tool: BTreeMap<String, u64>,
    /// Total budget in minor units; `None` is unlimited.
    pub budget: Option<i64>,
    pub currency: String,
    pub expires_at: Millis,
    pub lease_ms: Millis,
    pub duplicate_guard: DuplicateGuard,
    pub uncertain_policy: UncertainPolicy,
    pub status: PermitStatus,
    pub created_at: Millis,
    /// The tenant of the key that created it ("" without keys).
    pub tenant: String,
    /// Agent key ids that may use it; empty: any agent of the tenant.
    pub agents: Vec<String>,
    /// Tools whose calls need a person's approval, by tool name.
    pub approval_per_tool: BTreeMap<String, ApprovalRule>,
}

/// When a tool's calls need approval, how long they may wait for it, and
/// how many distinct approvers they need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ApprovalRule {
    /// `None`: every call; `Some(c)`: calls costing at least `c`.
    pub cost_at_least: Option<i64>,
    pub wait_ms: Millis,
    /// 1 or 2.
    pub approvers: u32,
}

impl ApprovalRule {
    pub fn applies_to(&self, cost: i64) -> bool {
        self.cost_at_least.is_none_or(|at_least| cost >= at_least)
    }
}

/// An approval rule as a client asks for it: the wait and the approvers
/// may be left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApprovalRuleSpec {
    pub cost_at_least: Option<i64>,
    pub wait_ms: Option<Millis>,
    /// 0 means 1.
    pub approvers: u32,
}

/// The server's bounds on an approval's wait (--approval-wait-default,
/// --approval-wait-max).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApprovalWaits {
    pub default_ms: Millis,
    pub max_ms: Millis,
}

impl ApprovalWaits {
    /// 15 minutes by default, at most 7 days.
    pub const DEFAULT: Self = Self {
        default_ms: 15 * 60_000,
        max_ms: MAX_DURATION_MS,
    };
}

impl Default for ApprovalWaits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl Permit {
    /// The approval rule that holds a call of the tool at `tool` costing
    /// `cost`, if any.
    pub fn approval_for(&self, tool: &str, cost: i64) -> Option<&ApprovalRule> {
        self.approval_per_tool
            .get(tool)
            .filter(|rule| rule.applies_to(cost))
    }

    /// Whether a caller in `scope` may see and use this permit; if not, it
    /// answers exactly as if the permit did not exist.
    pub fn visible_to(&self, scope: &Scope) -> bool {
        self.tenant == scope.tenant
            && match &scope.agent {
                Some(key_id) => self.agents.is_empty() || self.agents.contains(key_id),
                None => true,
            }
    }
}

/// Whose request it is: which permits it may see and use, and which of
/// their attempts it may settle.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// The caller's tenant ("" without keys: dev mode).
    pub tenant: String,
    /// An agent's key id, for the RPCs a permit's `agents` list limits
    /// (`None`: not limited, e.g. an admin key).
    pub agent: Option<String>,
    /// The caller's key id, whatever its roles ("" without keys): an
    /// attempt its Authorize reserves is recorded as reserved by it
    /// ([`crate::domain::Attempt::reserved_by`]).
    pub key_id: String,
}

impl Scope {
    /// Whether this caller holds an attempt reserved by `reserved_by`: may
    /// Commit or MarkUncertain it, and is given its attempt_id while it is
    /// open. A limited caller (an agent key) holds only what its own key
    /// reserved; a caller no `agents` list limits (an admin key, dev mode)
    /// holds every attempt of its tenant. An attempt reserved by "" (in
    /// dev mode, or recorded by a version that did not record it) is held
    /// by every caller that sees its permit.
    pub fn holds(&self, reserved_by: &str) -> bool {
        match &self.agent {
            None => true,
            Some(me) => reserved_by.is_empty() || *me == reserved_by,
        }
    }
}

/// Most agent key ids a permit may name.
pub const MAX_AGENTS: usize = 64;

impl Permit {
    pub fn in_scope(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t == tool)
    }
}

/// A permit as a client asks for it: every field optional or unchecked.
/// [`PermitSpec::into_permit`] validates it and fills in the defaults.
#[derive(Debug, Clone, Default)]
pub struct PermitSpec {
    /// Must be empty: the server assigns ids.
    pub permit_id: String,
    pub subject: String,
    pub tools: Vec<String>,
    pub max_calls_per_tool: BTreeMap<String, u64>,
    pub budget: Option<i64>,
    pub currency: String,
    /// Required.
    pub expires_at: Option<Millis>,
    pub lease_ms: Option<Millis>,
    pub guard_mode: Option<GuardMode>,
    pub guard_window_ms: Option<Millis>,
    pub uncertain_policy: Option<UncertainPolicy>,
    pub agents: Vec<String>,
    pub approval_per_tool: BTreeMap<String, ApprovalRuleSpec>,
    /// The server's bounds on an approval's wait.
    pub approval_waits: ApprovalWaits,
    /// Set when the client supplied a status or a creation time: both are
    /// the server's to set.
    pub server_fields_set: bool,
}

impl PermitSpec {
    /// Validates every field (reporting all violations at once) and builds
    /// the permit to store under `permit_id`, created at `now` by a caller
    /// of `tenant`.
    pub fn into_permit(
        self,
        permit_id: String,
        now: Millis,
        tenant: &str,
    ) -> Result<Permit, Error> {
        let mut v = Violations::default();
        v.check(
            self.permit_id.is_empty(),
            "permit.permit_id",
            "must be empty: the server assigns permit ids",
        );
        v.check(
            !self.server_fields_set,
            "permit.status",
            "status, created_at and tenant are set by the server",
        );
        v.check(
            self.agents.len() <= MAX_AGENTS,
            "permit.agents",
            format!("at most {MAX_AGENTS} agent key ids"),
        );
        let mut agents = HashSet::new();
        for agent in &self.agents {
            v.check_with(crate::domain::valid_name(agent), "permit.agents", || {
                format!(
                    "{} is not a key id (1..=64 of [A-Za-z0-9._-])",
                    shown(agent)
                )
            });
            v.check_with(agents.insert(agent.as_str()), "permit.agents", || {
                format!("{} is listed twice", shown(agent))
            });
        }
        v.check(
            self.subject.len() <= MAX_TEXT_LEN,
            "permit.subject",
            format!("at most {MAX_TEXT_LEN} bytes"),
        );
        v.check(
            self.currency.len() <= 16,
            "permit.currency",
            "at most 16 bytes",
        );
        v.check(
            !self.tools.is_empty(),
            "permit.tools",
            "at least one tool is required",
        );
        v.check(
            self.tools.len() <= MAX_TOOLS,
            "permit.tools",
            format!("at most {MAX_TOOLS} tools"),
        );
        let mut seen = HashSet::new();
        for tool in &self.tools {
            v.check_with(valid_tool(tool), "permit.tools", || {
                format!("{} is not 1..=128 of [A-Za-z0-9._:/-]", shown(tool))
            });
            v.check_with(seen.insert(tool.as_str()), "permit.tools", || {
                format!("{} is listed twice", shown(tool))
            });
        }
        for (tool, cap) in &self.max_calls_per_tool {
            v.check_with(
                seen.contains(tool.as_str()),
                "permit.max_calls_per_tool",
                || format!("{} has a cap but is not in tools", shown(tool)),
            );
            v.check_with(
                *cap <= MAX_AMOUNT as u64,
                "permit.max_calls_per_tool",
                || format!("the cap of {} exceeds {MAX_AMOUNT}", shown(tool)),
            );
        }
        if let Some(budget) = self.budget {
            v.check(
                (0..=MAX_AMOUNT).contains(&budget),
                "permit.budget",
                format!("must be within 0..={MAX_AMOUNT}"),
            );
        }
        match self.expires_at {
            None => v.check(false, "permit.expires_at", "is required"),
            Some(at) => v.check(at > now, "permit.expires_at", "must be in the future"),
        }
        let lease_ms = self.lease_ms.unwrap_or(DEFAULT_LEASE_MS);
        v.check(
            (1..=MAX_DURATION_MS).contains(&lease_ms),
            "permit.lease",
            "must be positive and at most 7 days",
        );
        let window_ms = self.guard_window_ms.unwrap_or(DEFAULT_GUARD_WINDOW_MS);
        v.check(
            (1..=MAX_DURATION_MS).contains(&window_ms),
            "permit.duplicate_guard.window",
            "must be positive and at most 7 days",
        );
        let mut approval_per_tool = BTreeMap::new();
        let waits = self.approval_waits;
        for (tool, rule) in &self.approval_per_tool {
            let field = "permit.approval_per_tool";
            v.check_with(seen.contains(tool.as_str()), field, || {
                format!("{} has an approval rule but is not in tools", shown(tool))
            });
            if let Some(cost) = rule.cost_at_least {
                v.check_with((0..=MAX_AMOUNT).contains(&cost), field, || {
                    format!(
                        "the cost_at_least of {} must be within 0..={MAX_AMOUNT}",
                        shown(tool)
                    )
                });
            }
            let wait_ms = rule.wait_ms.unwrap_or(waits.default_ms);
            v.check_with((1000..=waits.max_ms).contains(&wait_ms), field, || {
                format!(
                    "the wait of {} must be at least 1 s and at most {} s (--approval-wait-max)",
                    shown(tool),
                    waits.max_ms / 1000
                )
            });
            let approvers = rule.approvers.max(1);
            v.check_with(approvers <= 2, field, || {
                format!("the approvers of {} must be 1 or 2", shown(tool))
            });
            v.check_with(approvers == 1 || !tenant.is_empty(), field, || {
                format!(
                    "the four-eyes rule of {} needs keys (--auth-keys): without them every caller is the same",
                    shown(tool)
                )
            });
            approval_per_tool.insert(
                tool.clone(),
                ApprovalRule {
                    cost_at_least: rule.cost_at_least,
                    wait_ms,
                    approvers,
                },
            );
        }
        v.into_result()?;
        Ok(Permit {
            permit_id,
            subject: self.subject,
            tools: self.tools,
            max_calls_per_tool: self.max_calls_per_tool,
            budget: self.budget,
            currency: self.currency,
            expires_at: self.expires_at.unwrap_or_default(),
            lease_ms,
            duplicate_guard: DuplicateGuard {
                mode: self.guard_mode.unwrap_or(GuardMode::Log),
                window_ms,
            },
            uncertain_policy: self.uncertain_policy.unwrap_or_default(),
            status: PermitStatus::Active,
            created_at: now,
            tenant: tenant.to_owned(),
            agents: self.agents,
            approval_per_tool,
        })
    }
}

/// Usage of one tool under a permit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub tool: String,
    /// Slots held: attempts RESERVED, SUCCEEDED, FAILED or UNCERTAIN.
    pub calls_made: u64,
    /// `None`: no cap.
    pub calls_limit: Option<u64>,
    /// `None`: unlimited budget.
    pub budget_remaining: Option<i64>,
}

/// A permit with all of its usage, as GetPermit shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitView {
    pub permit: Permit,
    /// One per tool in scope, in the permit's order.
    pub usage: Vec<Usage>,
    pub budget_committed: i64,
    pub budget_reserved: i64,
}

impl PermitView {
    pub fn budget_remaining(&self) -> Option<i64> {
        self.permit
            .budget
            .map(|b| b - self.budget_committed - self.budget_reserved)
    }
}
