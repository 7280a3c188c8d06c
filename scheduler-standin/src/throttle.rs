//! What bounds kube-scheduler's per-pod cost beyond its own CPU: how many nodes a cycle
//! filters, where the next cycle starts, and its client's rate limit.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Below this many nodes every node is filtered (`minFeasibleNodesToFind`,
/// kubernetes/kubernetes `pkg/scheduler/schedule_one.go`).
const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;
/// The floor of the adaptive percentage (`minFeasibleNodesPercentageToFind`).
const MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND: usize = 5;

/// How many feasible nodes a cycle looks for before it stops filtering, with
/// `percentageOfNodesToScore` unset (its default): kubernetes/kubernetes
/// `pkg/scheduler/schedule_one.go`, `numFeasibleNodesToFind`. Under 100 nodes, all of them;
/// otherwise `50 - nodes/125` percent (at least 5 %) of the nodes, at least 100 — at 500
/// nodes 46 %, 230 nodes.
pub fn num_feasible_nodes_to_find(nodes: usize) -> usize {
    if nodes < MIN_FEASIBLE_NODES_TO_FIND {
        return nodes;
    }
    let percentage = 50_usize
        .saturating_sub(nodes / 125)
        .max(MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND);
    (nodes * percentage / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// A client-side rate limit: `qps` requests per second on average, `burst` at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClientRateLimit {
    /// Requests per second refilled.
    pub qps: f64,
    /// The bucket's size.
    pub burst: u32,
}

impl ClientRateLimit {
    /// kube-scheduler's defaults, `clientConnection.qps: 50` and `burst: 100`
    /// (kubernetes/kubernetes `pkg/scheduler/apis/config/v1/defaults.go`,
    /// `SetDefaults_KubeSchedulerConfiguration`: "Scheduler has an opinion about QPS/Burst").
    pub const KUBE_SCHEDULER: Self = Self {
        qps: 50.0,
        burst: 100,
    };
}

/// client-go's token bucket (`flowcontrol.NewTokenBucketRateLimiter`, over
/// `golang.org/x/time/rate`'s `Limiter.Wait`): the bucket starts full; each request takes a
/// token, and when none is left the request waits for the time it takes to refill one.
/// Waiting requests reserve their token at once, so they are served in arrival order.
#[derive(Debug)]
pub(super) struct TokenBucket {
    limit: ClientRateLimit,
    /// Tokens left (negative: reserved by waiting requests) and when they were counted.
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub(super) fn new(limit: ClientRateLimit) -> Self {
        Self {
            limit,
            state: Mutex::new((f64::from(limit.burst), Instant::now())),
        }
    }

    /// Takes a token: the time the caller must wait before its request.
    fn reserve(&self) -> Duration {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let refilled = now.saturating_duration_since(state.1).as_secs_f64() * self.limit.qps;
        state.0 = (state.0 + refilled).min(f64::from(self.limit.burst)) - 1.0;
        state.1 = now;
        if state.0 >= 0.0 || self.limit.qps <= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-state.0 / self.limit.qps)
        }
    }

    /// Waits for a token.
    pub(super) async fn wait(&self) {
        let delay = self.reserve();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adaptive_percentage_is_upstreams() {
        assert_eq!(num_feasible_nodes_to_find(8), 8);
        assert_eq!(num_feasible_nodes_to_find(99), 99);
        assert_eq!(num_feasible_nodes_to_find(100), 100);
        assert_eq!(num_feasible_nodes_to_find(150), 100);
        assert_eq!(num_feasible_nodes_to_find(500), 230);
        assert_eq!(num_feasible_nodes_to_find(1000), 420);
        assert_eq!(num_feasible_nodes_to_find(5000), 500);
        assert_eq!(num_feasible_nodes_to_find(10_000), 500);
    }

    #[test]
    fn the_bucket_gives_its_burst_then_waits_a_refill_per_request() {
        let bucket = TokenBucket::new(ClientRateLimit {
            qps: 10.0,
            burst: 3,
        });
        for _ in 0..3 {
            assert_eq!(bucket.reserve(), Duration::ZERO);
        }
        let fourth = bucket.reserve();
        let fifth = bucket.reserve();
        assert!(fourth > Duration::from_millis(50) && fourth <= Duration::from_millis(100));
        assert!(fifth > Duration::from_millis(150) && fifth <= Duration::from_millis(200));
    }
}
