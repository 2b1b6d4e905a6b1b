//! The uncertain census: how many attempts are UNCERTAIN, and how long the
//! oldest has been, without a scan per scrape.
//!
//! A RESERVED attempt becomes UNCERTAIN when its lease passes, with no
//! write anywhere, so no counter kept by the transitions can know the
//! number. Both stores keep an index of open attempts by when they are or
//! become uncertain (docs/architecture.md, "The uncertain index"), so a
//! count is a range count per shard ([`Store::census`](crate::store::Store::census)).
//! While metrics are exported, each replica reads the census every
//! `--uncertain-census-interval` (10 s by default); on Redis one replica of
//! the fleet counts per interval and the others read its figures. A read
//! replaces the figures; a failed one keeps the old ones, whose age keeps
//! growing. The gauges read the last figures. Until a first read there are
//! no figures (the two gauges are absent), and the census age counts from
//! start-up: a replica whose store has never answered still says how long
//! it has been blind.
//!
//! What the figures mean: the attempts UNCERTAIN when their shard was
//! counted (each shard atomically, the store's clock deciding, Redis's for
//! Redis), as old as `atmost.uncertain.census.age`: an attempt marked or
//! resolved since is not in them. The oldest attempt's age is its age when
//! counted plus the time since, so it keeps growing between counts
//! (overstated, by at most the census age, if that attempt has been
//! resolved since). Every replica reports the whole store: aggregate
//! replicas with `max`, never `sum`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The last complete pass's figures.
#[derive(Debug)]
pub struct Census {
    /// When the census began (at start-up): before a first pass completes,
    /// its age counts from here.
    started: Instant,
    last: Mutex<Option<Pass>>,
}

impl Default for Census {
    fn default() -> Self {
        Self::since(Instant::now())
    }
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
    /// The last pass's figures; `None` before the first pass completes.
    pub figures: Option<Figures>,
    /// Since the last pass completed; before the first, since start-up.
    pub census_age: Duration,
}

/// What a complete pass counted, read now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub uncertain: u64,
    /// Zero when none is uncertain.
    pub oldest_age: Duration,
}

impl Census {
    /// A census that began at `started`.
    pub fn since(started: Instant) -> Self {
        Self {
            started,
            last: Mutex::new(None),
        }
    }

    /// A pass completed `age` ago (another replica's, read from the
    /// store, or this one's, zero): `uncertain` attempts, the oldest
    /// uncertain for `oldest_age` when counted (zero: none).
    pub fn publish(&self, uncertain: u64, oldest_age: Duration, age: Duration) {
        let now = Instant::now();
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pass {
            uncertain,
            oldest_age,
            completed: now.checked_sub(age).unwrap_or(now),
        });
    }

    /// The figures as of now: the last pass's and its age, or, before the
    /// first pass completes, none and the time since start-up (so
    /// `AtmostUncertainCensusStale` fires for a replica whose store never
    /// answered, instead of the gauges staying silent).
    pub fn read(&self) -> Reading {
        let Some(pass) = *self.last.lock().unwrap_or_else(|e| e.into_inner()) else {
            return Reading {
                figures: None,
                census_age: self.started.elapsed(),
            };
        };
        let census_age = pass.completed.elapsed();
        Reading {
            figures: Some(Figures {
                uncertain: pass.uncertain,
                oldest_age: if pass.uncertain == 0 {
                    Duration::ZERO
                } else {
                    pass.oldest_age + census_age
                },
            }),
            census_age,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Census;
    use std::time::{Duration, Instant};

    #[test]
    fn before_the_first_pass_no_figures_and_an_age_from_start_up() {
        let hour = Duration::from_secs(3600);
        let started = Instant::now().checked_sub(hour).expect("an hour ago");
        let census = Census::since(started);
        let r = census.read();
        assert_eq!(r.figures, None);
        assert!(r.census_age >= hour, "{r:?}");
        // A pass completes: its age counts from then.
        census.publish(0, Duration::ZERO, Duration::ZERO);
        assert!(census.read().census_age < hour);
    }

    #[test]
    fn the_oldest_age_grows_with_the_census_age() {
        let census = Census::default();
        census.publish(3, Duration::from_secs(40), Duration::ZERO);
        let r = census.read();
        let figures = r.figures.expect("a pass");
        assert_eq!(figures.uncertain, 3);
        assert_eq!(figures.oldest_age, Duration::from_secs(40) + r.census_age);
        census.publish(0, Duration::ZERO, Duration::ZERO);
        let figures = census.read().figures.expect("a pass");
        assert_eq!(figures.oldest_age, Duration::ZERO);
    }
}
