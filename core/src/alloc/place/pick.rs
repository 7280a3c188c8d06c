//! Choosing one request's GPUs on one node: which GPUs are eligible, what each costs under
//! the request's policy, the topology group they are taken from, and the working state the
//! picks are applied to.

use crate::enforcement::Enforcement;
use crate::sharing::Sharing;

use super::super::index::{GpuFree, NodeEntry, free_permille};
use super::super::request::{DeviceRequest, Policy, SliceSize, TopologyScope};
use super::super::taint::untolerated;
use super::{FULL_SCORE, Flat, IDLE_PENALTY, NO_PICK, TIER_ANY, TIER_NVLINK, TIER_PCIE, nominal};

/// Working state reused across nodes within one decision.
pub(super) struct Scratch {
    pub(super) gpus: Vec<Slot>,
    cand: Vec<Cand>,
    grouped: Vec<Cand>,
    pub(super) picks: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) free: GpuFree,
    /// Already picked by the claim being placed.
    pub(super) blocked: bool,
}

/// An eligible GPU; ordered by group, then cost, then device order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cand {
    group: u32,
    cost: u32,
    gpu: u32,
}

impl Scratch {
    pub(super) fn new(picks: usize) -> Self {
        Scratch {
            gpus: Vec::new(),
            cand: Vec::new(),
            grouped: Vec::new(),
            picks: vec![NO_PICK; picks],
        }
    }

    pub(super) fn reset(&mut self, node: &NodeEntry) {
        self.gpus.clear();
        self.gpus.extend(node.gpus.iter().map(|gpu| Slot {
            free: gpu.free,
            blocked: false,
        }));
        self.picks.fill(NO_PICK);
    }

    /// The GPUs [`eligible`] found, in device order.
    pub(super) fn cand_gpus(&self) -> impl Iterator<Item = u32> + '_ {
        self.cand.iter().map(|c| c.gpu)
    }

    pub(super) fn block_claim(&mut self, slots: std::ops::Range<usize>, blocked: bool) {
        for &pick in &self.picks[slots] {
            if let Some(slot) = self.gpus.get_mut(pick as usize) {
                slot.blocked = blocked;
            }
        }
    }
}

/// Free capacity score left on a GPU if the request takes it, or `None` when it does not fit.
fn fit_after(req: &DeviceRequest, free: &GpuFree, total_memory: u64) -> Option<u32> {
    match req.slice {
        None => free.idle.then_some(0),
        Some(size) => {
            let fits = !free.whole_held
                && free.memory >= size.memory_bytes
                && free.compute >= size.compute_percent
                && req.max_slices_per_gpu.is_none_or(|max| free.slices < max)
                && !sharing_conflicts(req.sharing, free)
                && !size_conflicts(req, size, free);
            fits.then(|| {
                let left = free_permille(
                    free.memory - size.memory_bytes,
                    free.compute - size.compute_percent,
                    total_memory,
                );
                u32::try_from(left).unwrap_or(FULL_SCORE)
            })
        }
    }
}

/// Whether a slice shared by `sharing` would put MPS and time-slicing on one GPU.
pub(super) fn sharing_conflicts(sharing: Sharing, free: &GpuFree) -> bool {
    match sharing {
        Sharing::Mps => free.time_sliced,
        Sharing::TimeSlicing => free.mps,
        Sharing::Exclusive => false,
    }
}

/// Whether an MPS slice of `size` would share a GPU held by its MPS server with slices of
/// another size: when the request or a slice already there requires [`Enforcement::Server`],
/// every MPS slice of the GPU must have one size, so that the server's limit is each one's
/// ([`crate::enforcement`]).
pub(super) fn size_conflicts(req: &DeviceRequest, size: SliceSize, free: &GpuFree) -> bool {
    req.sharing == Sharing::Mps
        && (req.enforcement == Enforcement::Server || free.server_held)
        && !free
            .mps_sizes
            .admits(size.memory_bytes, size.compute_percent)
}

/// Lower is better.
fn cost(policy: Policy, idle: bool, after: u32) -> u32 {
    match policy {
        Policy::BinPack | Policy::LeastFragmentation => u32::from(idle) * IDLE_PENALTY + after,
        Policy::Spread => FULL_SCORE.saturating_sub(after),
    }
}

/// Fills `scratch.cand` with the GPUs the request may take, in device order.
pub(super) fn eligible(req: &DeviceRequest, node: &NodeEntry, scratch: &mut Scratch) {
    scratch.cand.clear();
    for (at, (gpu, slot)) in node.gpus.iter().zip(&scratch.gpus).enumerate() {
        if slot.blocked || !req.selector.matches(&gpu.info) {
            continue;
        }
        if gpu.blocking_taints && untolerated(&gpu.info.taints, &req.tolerations).is_some() {
            continue;
        }
        if req.admin_access {
            // Every admin GPU costs the same: ties go to the lower device name.
            scratch.cand.push(Cand {
                group: 0,
                cost: 0,
                gpu: u32::try_from(at).unwrap_or(NO_PICK),
            });
        } else if let Some(after) = fit_after(req, &slot.free, gpu.info.memory_bytes) {
            scratch.cand.push(Cand {
                group: 0,
                cost: cost(req.policy, slot.free.idle, after),
                gpu: u32::try_from(at).unwrap_or(NO_PICK),
            });
        }
    }
}

/// Chooses the request's GPUs into its pick slots; returns the topology tier reached.
pub(super) fn choose(flat: &Flat<'_>, node: &NodeEntry, scratch: &mut Scratch) -> Option<u32> {
    let req = flat.req;
    let count = flat.count();
    eligible(req, node, scratch);
    if scratch.cand.len() < count {
        return None;
    }
    let picks = &mut scratch.picks[flat.slot..flat.slot + count];
    if count == 1 {
        let best = scratch.cand.iter().min_by_key(|c| (c.cost, c.gpu))?;
        picks[0] = best.gpu;
        return Some(TIER_NVLINK);
    }
    let nvlink = |at: u32| node.gpus.get(at as usize).and_then(|g| g.nvlink);
    let pcie = |at: u32| node.gpus.get(at as usize).and_then(|g| g.pcie);
    let (cand, grouped) = (&mut scratch.cand, &mut scratch.grouped);
    match req.topology {
        TopologyScope::NvLink => pick_grouped(cand, grouped, nvlink, picks).then_some(TIER_NVLINK),
        TopologyScope::PcieRoot => pick_grouped(cand, grouped, pcie, picks).then_some(TIER_PCIE),
        TopologyScope::Any => {
            if pick_grouped(cand, grouped, nvlink, picks) {
                Some(TIER_NVLINK)
            } else if pick_grouped(cand, grouped, pcie, picks) {
                Some(TIER_PCIE)
            } else {
                cand.sort_unstable_by_key(|c| (c.cost, c.gpu));
                for (pick, c) in picks.iter_mut().zip(cand.iter()) {
                    *pick = c.gpu;
                }
                Some(TIER_ANY)
            }
        }
    }
}

/// Picks `picks.len()` candidates from the one group that can hold them at the lowest total
/// cost (lowest group id on ties); false when no group is large enough.
fn pick_grouped(
    cand: &[Cand],
    grouped: &mut Vec<Cand>,
    group_of: impl Fn(u32) -> Option<u16>,
    picks: &mut [u32],
) -> bool {
    let count = picks.len();
    grouped.clear();
    grouped.extend(cand.iter().filter_map(|c| {
        group_of(c.gpu).map(|group| Cand {
            group: u32::from(group),
            ..*c
        })
    }));
    grouped.sort_unstable();
    let mut best: Option<(u64, usize)> = None;
    let mut start = 0;
    while start < grouped.len() {
        let group = grouped[start].group;
        let end = start + grouped[start..].partition_point(|c| c.group == group);
        if end - start >= count {
            let total: u64 = grouped[start..start + count]
                .iter()
                .map(|c| u64::from(c.cost))
                .sum();
            if best.is_none_or(|(best_total, _)| total < best_total) {
                best = Some((total, start));
            }
        }
        start = end;
    }
    let Some((_, start)) = best else {
        return false;
    };
    for (pick, c) in picks.iter_mut().zip(&grouped[start..start + count]) {
        *pick = c.gpu;
    }
    true
}

/// Applies a request's picks to the working state; returns their [`nominal`] consumption.
pub(super) fn take(flat: &Flat<'_>, node: &NodeEntry, scratch: &mut Scratch) -> u64 {
    if flat.req.admin_access {
        return 0;
    }
    let mut consumed = 0;
    for &pick in &scratch.picks[flat.slot..flat.slot + flat.count()] {
        let (Some(gpu), Some(slot)) = (
            node.gpus.get(pick as usize),
            scratch.gpus.get_mut(pick as usize),
        ) else {
            continue;
        };
        let free = &mut slot.free;
        match flat.req.slice {
            None => {
                free.whole_held = true;
                free.memory = 0;
                free.compute = 0;
            }
            Some(size) => {
                free.memory -= size.memory_bytes;
                free.compute -= size.compute_percent;
                free.slices += 1;
                free.mps |= flat.req.sharing == Sharing::Mps;
                free.time_sliced |= flat.req.sharing == Sharing::TimeSlicing;
                if flat.req.sharing == Sharing::Mps {
                    free.mps_sizes = free.mps_sizes.with(size.memory_bytes, size.compute_percent);
                    free.server_held |= flat.req.enforcement == Enforcement::Server;
                }
            }
        }
        free.idle = false;
        consumed += nominal(flat.req.slice, gpu.info.memory_bytes);
    }
    consumed
}
