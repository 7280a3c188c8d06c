//! The workload as the placement has seen it: a decayed histogram of pod kinds, learned
//! online from every pod the caller shows it, from which [`Distribution`]s are built.

use super::frag::{Distribution, HostAmounts, TaskShape};
use super::request::{DeviceRequest, PodRequest};

/// A decayed histogram of the pod kinds seen: each pod counts 1 when seen, and every count
/// halves over `half_life` later pods, so the distribution follows a workload that changes.
/// At most `capacity` kinds are kept; a new kind replaces the rarest.
///
/// The caller shows it every pod it sees ([`Workload::observe`]), the controller's own pods
/// and, when it knows them, pods without GPUs; [`Workload::distribution`] is rebuilt only
/// when enough has been seen since the last build, so that placements between rebuilds see
/// one distribution (and caches keyed on its version stay valid).
#[derive(Debug, Clone)]
pub struct Workload {
    kinds: Vec<(TaskShape, f64)>,
    /// Weight of the next pod seen (grows instead of every count decaying).
    increment: f64,
    /// Per-pod growth of `increment`: `2^(1 / half_life)`.
    growth: f64,
    capacity: usize,
    /// Pods seen since the distribution was last built.
    since_build: u64,
    seen: u64,
    built: Distribution,
}

/// Share of the pods the distribution covers: the most frequent kinds up to this share,
/// as the paper's typical pods (`--pod-popularity-threshold 95`).
const COVERAGE: f64 = 0.95;
/// Rescale weights before they overflow.
const RESCALE_AT: f64 = 1e100;

impl Default for Workload {
    /// Half-life 5,000 pods, 64 kinds.
    fn default() -> Self {
        Workload::new(5_000, 64)
    }
}

impl Workload {
    /// An empty histogram: counts halve over `half_life` pods (at least 1), at most
    /// `capacity` kinds (at least 1).
    pub fn new(half_life: u32, capacity: usize) -> Self {
        Workload {
            kinds: Vec::new(),
            increment: 1.0,
            growth: 2f64.powf(1.0 / f64::from(half_life.max(1))),
            capacity: capacity.max(1),
            since_build: 0,
            seen: 0,
            built: Distribution::default(),
        }
    }

    /// Counts one pod of kind `shape`.
    pub fn observe(&mut self, shape: TaskShape) {
        self.seen += 1;
        self.since_build += 1;
        self.increment *= self.growth;
        if self.increment > RESCALE_AT {
            for (_, weight) in &mut self.kinds {
                *weight /= self.increment;
            }
            self.increment = 1.0;
        }
        if let Some((_, weight)) = self.kinds.iter_mut().find(|(s, _)| *s == shape) {
            *weight += self.increment;
            return;
        }
        if self.kinds.len() >= self.capacity
            && let Some(rarest) = self
                .kinds
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.1.total_cmp(&b.1.1))
                .map(|(at, _)| at)
        {
            self.kinds.swap_remove(rarest);
        }
        self.kinds.push((shape, self.increment));
    }

    /// Pods seen.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// The current distribution: the most frequent kinds covering 95 % of the weight,
    /// normalized. Rebuilt when the pods seen since the last build reach 1/16 of the pods
    /// seen in all (at least 16, at most the half-life), else the last build.
    pub fn distribution(&mut self) -> &Distribution {
        let due = (self.seen / 16).clamp(16, self.half_life());
        if self.since_build >= due || (self.built.is_empty() && self.seen > 0) {
            self.rebuild();
        }
        &self.built
    }

    /// The distribution of everything seen so far, rebuilt now.
    pub fn rebuild(&mut self) -> &Distribution {
        let mut kinds: Vec<&(TaskShape, f64)> = self.kinds.iter().collect();
        kinds.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = kinds.iter().map(|(_, w)| w).sum();
        let mut covered = 0.0;
        let mut taken = 0;
        while taken < kinds.len() && covered < COVERAGE * total {
            covered += kinds[taken].1;
            taken += 1;
        }
        let version = self.built.version() + 1;
        self.built =
            Distribution::new(kinds[..taken].iter().map(|(s, w)| (s.clone(), *w)), version);
        self.since_build = 0;
        &self.built
    }

    fn half_life(&self) -> u64 {
        // growth = 2^(1/h)  =>  h = 1 / log2(growth)
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let h = (1.0 / self.growth.log2()).round() as u64;
        h.max(16)
    }
}

impl TaskShape {
    /// The kind of a pod that asks `pod` of GPUs and `host` of its node: the GPU part of its
    /// first request (for a request with subrequests, its first subrequest), with the count of
    /// every request of the same size added up. Pods whose requests differ in size are
    /// approximated by the first one, which covers the common one-claim pod exactly.
    pub fn of(pod: &PodRequest, host: HostAmounts) -> Self {
        let first_choice = |r: &'_ DeviceRequest| -> DeviceRequest {
            r.first_available
                .first()
                .cloned()
                .unwrap_or_else(|| r.clone())
        };
        let requests: Vec<DeviceRequest> = pod
            .claims
            .iter()
            .flat_map(|c| &c.requests)
            .filter(|r| !r.admin_access)
            .map(first_choice)
            .collect();
        let Some(first) = requests.first() else {
            return TaskShape {
                host,
                ..TaskShape::default()
            };
        };
        let gpus = requests
            .iter()
            .filter(|r| r.slice == first.slice && r.selector == first.selector)
            .map(|r| r.count)
            .fold(0u32, u32::saturating_add);
        TaskShape {
            gpus,
            slice: first.slice,
            selector: first.selector.clone(),
            host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::request::{ClaimRequest, SliceSize};
    use super::*;

    fn shape(gpus: u32, compute: u8, cpu: i64) -> TaskShape {
        TaskShape {
            gpus,
            slice: (compute < 100).then_some(SliceSize {
                memory_bytes: 0,
                compute_percent: compute,
            }),
            host: HostAmounts {
                milli_cpu: cpu,
                memory: 0,
            },
            ..TaskShape::default()
        }
    }

    #[test]
    fn the_distribution_keeps_the_frequent_kinds_and_forgets_old_ones() {
        let mut workload = Workload::new(100, 8);
        for _ in 0..90 {
            workload.observe(shape(1, 50, 1000));
        }
        for _ in 0..10 {
            workload.observe(shape(8, 100, 64_000));
        }
        workload.observe(shape(1, 10, 1));
        let shares: Vec<(TaskShape, f64)> = workload.rebuild().shapes().collect();
        // 95 % coverage: the single rare pod is left out.
        assert_eq!(shares.len(), 2);
        let half = shares.iter().find(|(s, _)| s.gpus == 1).unwrap().1;
        assert!(half > 0.85 && half < 0.95, "{half}");
        // 300 pods later (three half-lives) of whole GPUs, the slices weigh about 1/8 as much.
        for _ in 0..300 {
            workload.observe(shape(1, 100, 1000));
        }
        let shares: Vec<(TaskShape, f64)> = workload.rebuild().shapes().collect();
        let whole = shares
            .iter()
            .find(|(s, _)| s.slice.is_none() && s.gpus == 1)
            .unwrap()
            .1;
        assert!(whole > 0.9, "{whole}");
    }

    #[test]
    fn capacity_evicts_the_rarest_kind_and_builds_are_batched() {
        let mut workload = Workload::new(1000, 2);
        workload.observe(shape(1, 50, 1));
        workload.observe(shape(1, 50, 1));
        workload.observe(shape(1, 20, 1));
        workload.observe(shape(1, 30, 1));
        let kinds: Vec<u8> = workload
            .kinds
            .iter()
            .filter_map(|(s, _)| s.slice.map(|s| s.compute_percent))
            .collect();
        assert_eq!(kinds, [50, 30]);
        let first = workload.distribution().version();
        workload.observe(shape(1, 50, 1));
        assert_eq!(workload.distribution().version(), first);
        for _ in 0..16 {
            workload.observe(shape(1, 50, 1));
        }
        assert_eq!(workload.distribution().version(), first + 1);
    }

    #[test]
    fn a_pod_request_becomes_its_first_requests_kind() {
        let size = SliceSize {
            memory_bytes: 1 << 30,
            compute_percent: 20,
        };
        let pod = PodRequest {
            claims: vec![
                ClaimRequest {
                    key: "a".into(),
                    requests: vec![DeviceRequest::slices("s", 1, size)],
                },
                ClaimRequest {
                    key: "b".into(),
                    requests: vec![DeviceRequest::slices("s", 2, size)],
                },
            ],
        };
        let host = HostAmounts {
            milli_cpu: 4000,
            memory: 1 << 33,
        };
        let kind = TaskShape::of(&pod, host);
        assert_eq!((kind.gpus, kind.slice, kind.host), (3, Some(size), host));
        assert_eq!(TaskShape::of(&PodRequest::default(), host).gpus, 0);
    }
}
