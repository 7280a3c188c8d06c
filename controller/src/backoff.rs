//! Per-object exponential back-off ([`BackoffConfig`], counted by [`ObjectBackoff`]): a leaf
//! below the context that holds the counts and the retry policy that uses them
//! ([`crate::retry`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Consecutive failures of one object after which a failed reconcile is logged as a warning
/// whatever its reason, and again every as many failures after that.
pub const KEEPS_FAILING_AFTER: u32 = 5;

/// Exponential per-object retry delays: `base`, `2·base`, `4·base`, … up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// Delay after the first failure.
    pub base: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl BackoffConfig {
    /// The delay after `failures` consecutive failures (1 for the first).
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(63);
        let factor = 1u64 << doublings;
        u32::try_from(factor)
            .ok()
            .and_then(|f| self.base.checked_mul(f))
            .map_or(self.max, |d| d.min(self.max))
    }
}

/// One failed reconcile, as [`ObjectBackoff::failed`] counted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// Consecutive failures of the object, this one included.
    pub count: u32,
    /// How long to wait before retrying it.
    pub retry_in: Duration,
}

/// Consecutive failures per object, for [`BackoffConfig::delay`]; reset by a success.
///
/// Keys are `controller/namespace/name`, so controllers can share one `Context`. Bounded: an
/// entry goes with the object's success, with [`ObjectBackoff::forget`] when the object is
/// deleted, and at the latest when the object has not failed for twice the longest delay (a
/// failing object is retried sooner than that, so only gone objects are pruned).
#[derive(Debug, Default)]
pub struct ObjectBackoff {
    failures: Mutex<HashMap<String, (u32, Instant)>>,
    /// Keys whose last failure was refused by the API server ([`ObjectBackoff::hold`]).
    held: Mutex<HashSet<String>>,
}

impl ObjectBackoff {
    /// Records a failure of `key`: how many in a row, and how long to wait before retrying.
    pub fn failed(&self, config: &BackoffConfig, key: &str) -> Failure {
        let now = Instant::now();
        let stale_after = config.max.saturating_mul(2);
        let mut failures = self.lock();
        failures.retain(|_, (_, last)| now.saturating_duration_since(*last) <= stale_after);
        let entry = failures.entry(key.to_owned()).or_insert((0, now));
        entry.0 = entry.0.saturating_add(1);
        entry.1 = now;
        Failure {
            count: entry.0,
            retry_in: config.delay(entry.0),
        }
    }

    /// Whether `key` failed recently enough that its next attempt is not due yet: less than
    /// the delay after its consecutive failures has passed since the last one. For writers
    /// outside kube-runtime's requeue (a periodic tick), which must skip an object in back-off
    /// themselves.
    pub(crate) fn backing_off(&self, config: &BackoffConfig, key: &str) -> bool {
        self.lock()
            .get(key)
            .is_some_and(|(count, last)| last.elapsed() < config.delay(*count))
    }

    /// How much longer `key`'s next attempt must wait, when its last failure was a refused
    /// write ([`ObjectBackoff::hold`]) and the delay after its consecutive failures has not
    /// passed yet.
    pub(crate) fn held_for(&self, config: &BackoffConfig, key: &str) -> Option<Duration> {
        let failures = self.lock();
        let (count, last) = failures.get(key)?;
        if !self.held(key) {
            return None;
        }
        config
            .delay(*count)
            .checked_sub(last.elapsed())
            .filter(|d| !d.is_zero())
    }

    /// Marks `key`'s current failure as one the API server refused: until its back-off delay
    /// has passed, `ObjectBackoff::held_for` tells reconciles to wait. A refusal does not
    /// go away by itself, and the object's own watch events (a rollback of the failed
    /// write's earlier steps changes it) would otherwise bring it back at once, in a loop.
    pub fn hold(&self, key: &str) {
        self.held_keys().insert(key.to_owned());
    }

    fn held(&self, key: &str) -> bool {
        self.held_keys().contains(key)
    }

    fn held_keys(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets the failures of `key` after it succeeded.
    pub fn succeeded(&self, key: &str) {
        self.forget(key);
    }

    /// Forgets `key`, whose object is gone.
    pub fn forget(&self, key: &str) {
        self.lock().remove(key);
        self.held_keys().remove(key);
    }

    /// Consecutive failures of `key` so far.
    pub fn failures(&self, key: &str) -> u32 {
        self.lock().get(key).map_or(0, |(count, _)| *count)
    }

    /// How many objects are failing now.
    #[cfg(test)]
    fn failing_objects(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u32, Instant)>> {
        // Counters stay meaningful whatever panicked while the lock was held.
        self.failures.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn delays_double_up_to_the_maximum() {
        let config = BackoffConfig {
            base: Duration::from_millis(500),
            max: Duration::from_secs(10),
        };
        let delays: Vec<Duration> = (1..=7).map(|n| config.delay(n)).collect();
        assert_eq!(
            delays,
            [500, 1000, 2000, 4000, 8000, 10_000, 10_000].map(Duration::from_millis)
        );
        assert_eq!(config.delay(u32::MAX), config.max);
    }

    #[test]
    fn failures_are_counted_per_object_and_reset_by_success() {
        let config = BackoffConfig::default();
        let backoff = ObjectBackoff::default();
        let failed = |key| backoff.failed(&config, key);
        assert_eq!(failed("gpuclass//a").retry_in, Duration::from_secs(1));
        assert_eq!(
            failed("gpuclass//a"),
            Failure {
                count: 2,
                retry_in: Duration::from_secs(2)
            }
        );
        assert_eq!(failed("gpuclass//b").retry_in, Duration::from_secs(1));
        assert_eq!(backoff.failures("gpuclass//a"), 2);
        backoff.succeeded("gpuclass//a");
        assert_eq!(backoff.failures("gpuclass//a"), 0);
        assert_eq!(failed("gpuclass//a").retry_in, Duration::from_secs(1));
        backoff.forget("gpuclass//b");
        assert_eq!(backoff.failing_objects(), 1);
    }

    #[test]
    fn objects_that_stopped_failing_long_ago_are_pruned() {
        // A zero maximum makes every earlier entry older than twice the longest delay.
        let config = BackoffConfig {
            base: Duration::ZERO,
            max: Duration::ZERO,
        };
        let backoff = ObjectBackoff::default();
        backoff.failed(&config, "resourceclaim/ns/gone");
        std::thread::sleep(Duration::from_millis(2));
        backoff.failed(&config, "resourceclaim/ns/other");
        assert_eq!(backoff.failures("resourceclaim/ns/gone"), 0);
        assert_eq!(backoff.failing_objects(), 1);
    }

    proptest! {
        #[test]
        fn delays_never_shrink_and_stay_within_bounds(base_ms in 1u64..10_000, max_ms in 1u64..1_000_000, n in 1u32..100) {
            let config = BackoffConfig {
                base: Duration::from_millis(base_ms),
                max: Duration::from_millis(max_ms),
            };
            prop_assert!(config.delay(n) <= config.max);
            prop_assert!(config.delay(n) <= config.delay(n + 1));
            prop_assert!(config.delay(1) == config.base.min(config.max));
        }
    }
}
