//! The uncertain census: how many attempts are UNCERTAIN, and how long the
//! oldest has been, without a scan per scrape.
//!
//! A RESERVED attempt becomes UNCERTAIN when its lease passes, with no
//! write anywhere, so no counter kept by the transitions can know the
//! number; and on a Redis Cluster a script can only touch its own permit's
//! slot, so no global counter can be kept either. Instead, while metrics
//! are exported, each replica walks every tenant's index of permits that
//! may hold an open attempt, in bounded batches
//! ([`Store::census`](crate::store::Store::census): 64 permits and one
//! read-only script per permit on Redis), one pass every
//! `--uncertain-census-interval` (10 s by default) after the previous pass
//! ends. A completed pass replaces the figures; a failed one keeps the old
//! ones, whose age keeps growing. The gauges read the last figures.
//!
//! What the figures mean: the attempts UNCERTAIN when the pass looked at
//! their permit (each permit is read atomically, the permits one after the
//! other; the store's clock decides, Redis's for Redis). They are as old as
//! `atmost.uncertain.census.age` plus the pass's duration at most: an
//! attempt marked or resolved since is not in them. The oldest attempt's
//! age is its age when its permit was read plus the time since the pass
//! completed, so it keeps growing between passes (overstated, by at most
//! the census age, if that attempt has been resolved since). Every replica
//! counts the whole store: aggregate replicas with `max`, never `sum`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The last complete pass's figures.
#[derive(Debug, Default)]
pub struct Census {
    last: Mutex<Option<Pass>>,
}

#[derive(Debug, Clone, Copy)]
struct Pass {
    uncertain: u64,
    /// The oldest attempt's age when its permit was read.
    oldest_age: Duration,
    completed: Instant,
}

/// What the gauges report, read now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub uncertain: u64,
    /// Zero when none is uncertain.
    pub oldest_age: Duration,
    /// Since the pass completed.
    pub census_age: Duration,
}

impl Census {
    /// A pass completed: `uncertain` attempts, the oldest uncertain for
    /// `oldest_age` when read (zero: none).
    pub fn publish(&self, uncertain: u64, oldest_age: Duration) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pass {
            uncertain,
            oldest_age,
            completed: Instant::now(),
        });
    }

    /// The figures as of now, or `None` before the first pass completes.
    pub fn read(&self) -> Option<Reading> {
        let pass = (*self.last.lock().unwrap_or_else(|e| e.into_inner()))?;
        let census_age = pass.completed.elapsed();
        Some(Reading {
            uncertain: pass.uncertain,
            oldest_age: if pass.uncertain == 0 {
                Duration::ZERO
            } else {
                pass.oldest_age + census_age
            },
            census_age,
        })
    }
}

/// The running totals of one pass, batch by batch.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub uncertain: u64,
    pub oldest_age: Duration,
}

impl Tally {
    pub fn add(&mut self, batch: &crate::store::CensusBatch) {
        self.uncertain += batch.uncertain;
        let age = Duration::from_millis(u64::try_from(batch.oldest_age_ms).unwrap_or(0));
        self.oldest_age = self.oldest_age.max(age);
    }
}

#[cfg(test)]
mod tests {
    use super::Census;
    use std::time::Duration;

    #[test]
    fn nothing_before_the_first_pass_then_the_oldest_age_grows_with_the_census_age() {
        let census = Census::default();
        assert_eq!(census.read(), None);
        census.publish(3, Duration::from_secs(40));
        let r = census.read().expect("a pass");
        assert_eq!(r.uncertain, 3);
        assert_eq!(r.oldest_age, Duration::from_secs(40) + r.census_age);
        census.publish(0, Duration::ZERO);
        assert_eq!(census.read().expect("a pass").oldest_age, Duration::ZERO);
    }
}
