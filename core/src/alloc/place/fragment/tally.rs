//! A node state's fragmentation kept per GPU kind of the distribution, so that a placement
//! that changes a few GPUs is evaluated in one pass over the kinds instead of over every GPU.

use super::super::super::frag::{Distribution, FreeGpu, Group, HostAmounts, STRANDED_WEIGHT};
use super::super::super::index::GpuEntry;

/// Per GPU kind of the distribution: how many of the node's GPUs fit one GPU's part of it,
/// and their free share; and the node's free share.
#[derive(Debug, Clone, Default)]
pub(super) struct Tally {
    count: Vec<u32>,
    share: Vec<f64>,
    free: f64,
}

fn fits(group: &Group, gpu: &FreeGpu, entry: &GpuEntry) -> bool {
    gpu.fits(group) && (group.selector.is_empty() || group.selector.matches(&entry.info))
}

impl Tally {
    /// The tally of GPUs `gpus` (`entries` their inventory).
    pub(super) fn reset(&mut self, dist: &Distribution, entries: &[GpuEntry], gpus: &[FreeGpu]) {
        self.count.clear();
        self.share.clear();
        for group in &dist.groups {
            let (mut count, mut share) = (0, 0.0);
            for (gpu, entry) in gpus.iter().zip(entries) {
                if fits(group, gpu, entry) {
                    count += 1;
                    share += gpu.share;
                }
            }
            self.count.push(count);
            self.share.push(share);
        }
        self.free = gpus.iter().map(|g| g.share).sum();
    }

    /// GPU `entry` went from `old` to `new`.
    pub(super) fn change(
        &mut self,
        dist: &Distribution,
        entry: &GpuEntry,
        old: &FreeGpu,
        new: &FreeGpu,
    ) {
        for (at, group) in dist.groups.iter().enumerate() {
            if fits(group, old, entry) {
                self.count[at] -= 1;
                self.share[at] -= old.share;
            }
            if fits(group, new, entry) {
                self.count[at] += 1;
                self.share[at] += new.share;
            }
        }
        self.free += new.share - old.share;
    }

    /// What the LeastFragmentation policy minimizes, fragmented plus weighted stranded GPUs,
    /// with free CPU and memory `host` and `hosted` its weights per GPU kind ([`hosted`]).
    pub(super) fn objective(
        &self,
        dist: &Distribution,
        hosted: &[f64],
        host: Option<HostAmounts>,
    ) -> f64 {
        let mut weight = dist.no_gpu;
        let mut usable = 0.0;
        for (at, group) in dist.groups.iter().enumerate() {
            weight += group.weight;
            if self.count[at] >= group.gpus {
                usable += hosted[at] * self.share[at];
            }
        }
        let fragmented = (self.free * weight - usable).max(0.0);
        let stranded = host.map_or(0.0, |h| dist.stranded(self.free, h));
        fragmented + STRANDED_WEIGHT * stranded
    }
}

/// Per GPU kind of the distribution, the weight of its pods whose CPU and memory `host` has
/// room for (all of them when `host` is unknown).
pub(super) fn hosted(dist: &Distribution, host: Option<HostAmounts>, out: &mut Vec<f64>) {
    out.clear();
    out.extend(dist.groups.iter().map(|group| {
        match host {
            None => group.weight,
            Some(free) => group
                .hosts
                .iter()
                .take_while(|(h, _)| h.milli_cpu <= free.milli_cpu)
                .filter(|(h, _)| h.memory <= free.memory)
                .map(|(_, w)| w)
                .sum(),
        }
    }));
}
