//! Quotas: how much state one permit, one tenant or the whole memory store
//! may hold. Each is checked inside the transition it limits (under the
//! memory store's lock, inside the Redis script), refuses with its own
//! reason ([`Quota`]), and changes nothing when it does.

use super::{Error, Millis, Permit, Quota};

/// The limits; 0 for a count means no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quotas {
    /// Longest a permit may live: expires_at - now at CreatePermit.
    pub max_permit_lifetime_ms: Millis,
    /// Most RESERVED or UNCERTAIN attempts one permit may hold.
    pub max_open_attempts: u64,
    /// Most idempotency keys one permit may record.
    pub max_attempts: u64,
    /// Most unexpired permits one tenant may hold.
    pub max_permits_per_tenant: u64,
}

impl Quotas {
    /// The defaults of `atmost serve`.
    pub const DEFAULT: Quotas = Quotas {
        max_permit_lifetime_ms: 30 * 24 * 3_600_000,
        max_open_attempts: 1_000,
        max_attempts: 10_000,
        max_permits_per_tenant: 100_000,
    };

    /// No quota at all (tests of other behaviour; never the binary's).
    pub const UNLIMITED: Quotas = Quotas {
        max_permit_lifetime_ms: super::MAX_TIMESTAMP_MS,
        max_open_attempts: 0,
        max_attempts: 0,
        max_permits_per_tenant: 0,
    };

    /// CreatePermit: the permit's lifetime from `now`.
    pub fn check_lifetime(&self, permit: &Permit, now: Millis) -> Result<(), Error> {
        if permit.expires_at.saturating_sub(now) > self.max_permit_lifetime_ms {
            return Err(exceeded(
                Quota::PermitLifetime,
                u64::try_from(self.max_permit_lifetime_ms).unwrap_or(0),
            ));
        }
        Ok(())
    }

    /// Authorize of a new key (`is_new`: no record of it, not even a
    /// released one) on a permit holding `open` open attempts and
    /// `recorded` keys.
    pub fn check_attempts(&self, open: usize, recorded: usize, is_new: bool) -> Result<(), Error> {
        if reached(self.max_open_attempts, open) {
            return Err(exceeded(Quota::OpenAttempts, self.max_open_attempts));
        }
        if is_new && reached(self.max_attempts, recorded) {
            return Err(exceeded(Quota::Attempts, self.max_attempts));
        }
        Ok(())
    }

    /// CreatePermit: a tenant holding `live` unexpired permits.
    pub fn check_tenant(&self, live: usize) -> Result<(), Error> {
        if reached(self.max_permits_per_tenant, live) {
            return Err(exceeded(Quota::TenantPermits, self.max_permits_per_tenant));
        }
        Ok(())
    }
}

impl Default for Quotas {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Whether a count has reached a limit (0: no limit).
fn reached(limit: u64, count: usize) -> bool {
    limit != 0 && count as u64 >= limit
}

pub(super) fn exceeded(quota: Quota, limit: u64) -> Error {
    Error::QuotaExceeded { quota, limit }
}
