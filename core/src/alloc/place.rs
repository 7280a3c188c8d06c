//! Placement of all of a pod's controller-allocated claims on one node.
//!
//! Per node, requests are placed greedily (whole-GPU requests and larger requests first) on a
//! working copy of the node's free capacity, so that the pod's requests never over-commit a
//! GPU together. Each request takes the `count` eligible GPUs of the best topology group
//! (NVLink domain, then PCIe root, then the whole node for scope `Any`) that its policy scores
//! best. Nodes are ranked by topology first, then by the free capacity they keep, then by name.
//!
//! To stay fast on large clusters, nodes are first pruned with per-node aggregates, then
//! evaluated in order of an optimistic bound of their score; evaluation stops as soon as no
//! remaining node can beat the best one found. Only when nothing fits are all candidates
//! examined again, to explain why.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::index::{Index, NodeAggregates, NodeEntry, per_mille};
use super::model::{ClaimPlacement, PlacedDevice, PodPlacement};
use super::prioritized::place_first_available;
use super::request::{DeviceRequest, PodRequest, Policy, SliceSize, TopologyScope};
use super::unplaceable::{Unplaceable, UnplaceableReason};

use self::pick::{Scratch, choose, take};
use self::validate::validate;

pub use self::fragment::{PlacementContext, place_where_with, place_with, place_without_gpus};

mod diagnose;
mod fragment;
mod pick;
#[cfg(test)]
mod tests;
mod validate;

/// Most devices one request may ask for; more is an invalid request.
pub(crate) const MAX_DEVICES_PER_REQUEST: u32 = 1024;

/// Places all claims of `pod` on one of `candidate_nodes`.
///
/// Candidates are node names that passed the pod's scheduling constraints; names the index
/// does not know are ignored, and their order does not matter. Within a request the `count`
/// GPUs are distinct; within a claim every device is distinct (a claim's allocation never
/// names a device twice); different claims of the pod may share a GPU through slices. A
/// whole-GPU request needs GPUs no claim uses; a slice needs a GPU nobody holds whole with
/// enough free memory and compute and, when `max_slices_per_gpu` is set, fewer slices than
/// that. For `count` > 1, `NVLink` and `PCIeRoot` scopes need all GPUs in one domain / behind
/// one root; `Any` prefers that too. For `count` = 1 the scope has no effect.
///
/// Each request chooses among its eligible GPUs by its own policy: BinPack takes GPUs already
/// in use before idle ones, then those left with the least free capacity; Spread those left
/// with the most. Nodes are ranked by the topology achieved (NVLink before PCIe root before
/// anything), then by the policy of the pod's first request applied to the node's total free
/// capacity after placement, then by name. Ties between GPUs go to the lower device name.
/// The result depends only on the index, the pod and the set of candidates.
///
/// A GPU with a `NoSchedule` or `NoExecute` taint that a request does not tolerate is not
/// eligible for it (see [`taint`](super::taint)). An admin-access request takes `count` whole
/// GPUs whoever uses them and consumes nothing. A request with
/// [`first_available`](DeviceRequest::first_available) subrequests is placed as its first
/// subrequest that fits: combinations of the pod's subrequests are tried in order (the first
/// request's choice changing slowest, as kube-scheduler's allocator backtracks), and the
/// first combination that fits any candidate goes to its best node.
///
/// # Errors
///
/// [`Unplaceable`] when no candidate fits, naming the failing request, why, and the node
/// that came closest.
pub fn place(
    index: &Index,
    pod: &PodRequest,
    candidate_nodes: &[&str],
) -> Result<PodPlacement, Unplaceable> {
    place_first_available(pod, |pod| {
        let nodes = candidate_nodes.iter().filter_map(|name| index.entry(name));
        place_among(pod, nodes, candidate_nodes.len())
    })
}

/// [`place`] over the index's nodes for which `is_candidate(node name)` is true.
///
/// Faster than building a list of names for [`place`] when the candidates are most of the
/// index: it walks the index's nodes in memory order instead of looking each name up.
/// `is_candidate` is called once per node of the index.
///
/// # Errors
///
/// As [`place`].
pub fn place_where(
    index: &Index,
    pod: &PodRequest,
    mut is_candidate: impl FnMut(&str) -> bool,
) -> Result<PodPlacement, Unplaceable> {
    let mut asked = 0;
    let nodes = index.entries().filter(|node| {
        let candidate = is_candidate(&node.name);
        asked += usize::from(candidate);
        candidate
    });
    let nodes: Vec<&NodeEntry> = nodes.collect();
    place_first_available(pod, |pod| place_among(pod, nodes.iter().copied(), asked))
}

/// The placement decision over known candidate nodes; `asked` is how many candidates the
/// caller named, for the message when none is known. LeastFragmentation places as BinPack
/// here: [`fragment`] places by it when it knows the workload.
fn place_among<'i>(
    pod: &PodRequest,
    candidates: impl Iterator<Item = &'i NodeEntry>,
    asked: usize,
) -> Result<PodPlacement, Unplaceable> {
    let plan = Plan::new(pod)?;
    let mut scratch = Scratch::new(plan.total_picks);
    let mut known: Vec<&NodeEntry> = Vec::with_capacity(candidates.size_hint().0);
    let mut bounds: Vec<(Key, usize)> = Vec::with_capacity(known.capacity());
    let mut memo = ConsumptionMemo::default();
    for node in candidates {
        if plan.may_fit(node) {
            let (tiers, policy) = plan.bound(node, &mut memo);
            bounds.push(((tiers, policy, Reverse(node.order)), known.len()));
        }
        known.push(node);
    }
    let mut best: Option<(Key, usize)> = None;
    let mut best_picks = Vec::new();
    let mut consider = |(bound, at): (Key, usize), best: &mut Option<(Key, usize)>| {
        let node = known[at];
        if let Some(eval) = plan.evaluate(node, &mut scratch) {
            let key = (eval.tiers, plan.policy_value(node, eval.consumed), bound.2);
            if best.as_ref().is_none_or(|(best_key, _)| key > *best_key) {
                *best = Some((key, at));
                best_picks.clone_from(&scratch.picks);
            }
        }
    };
    // Usually the node with the best bound fits and reaches its bound, which no other node
    // can beat: one linear pass and one evaluation.
    let top = bounds
        .iter()
        .enumerate()
        .max_by_key(|(_, (bound, _))| *bound)
        .map(|(i, _)| i);
    if let Some(top) = top {
        let first = bounds.swap_remove(top);
        consider(first, &mut best);
        if best.as_ref().is_some_and(|(key, _)| *key >= first.0) {
            bounds.clear();
        }
        let mut queue = BinaryHeap::from(bounds);
        while let Some(next) = queue.pop() {
            if best.as_ref().is_some_and(|(key, _)| next.0 <= *key) {
                break;
            }
            consider(next, &mut best);
        }
    }
    match best {
        Some((_, at)) => Ok(plan.placement(known[at], &best_picks)),
        None => Err(plan.explain(known, asked)),
    }
}

/// Node ranking: topology tiers, policy value, name order (reversed so that `max` is the
/// lowest name).
type Key = (u32, i64, Reverse<u64>);

/// [`Plan::consumption`] by the node's (smallest, largest) GPU memory: clusters have few GPU
/// models, and the divisions it saves dominate the cost of bounding a thousand nodes.
#[derive(Default)]
struct ConsumptionMemo {
    entries: Vec<((u64, u64), (u64, u64))>,
}

impl ConsumptionMemo {
    const CAPACITY: usize = 8;

    fn get(&mut self, plan: &Plan<'_>, agg: &NodeAggregates) -> (u64, u64) {
        let sizes = (agg.min_total_memory, agg.max_total_memory);
        if let Some((_, found)) = self.entries.iter().find(|(key, _)| *key == sizes) {
            return *found;
        }
        let value = plan.consumption(agg);
        if self.entries.len() < Self::CAPACITY {
            self.entries.push((sizes, value));
        }
        value
    }
}

/// Topology tiers a request can reach; higher is better.
const TIER_NVLINK: u32 = 2;
const TIER_PCIE: u32 = 1;
const TIER_ANY: u32 = 0;

/// BinPack cost added to an idle GPU, larger than any free-capacity score, so that used GPUs
/// always come first.
const IDLE_PENALTY: u32 = 4096;
/// [`free_permille`] of an idle GPU.
const FULL_SCORE: u32 = 2000;

/// Marks an unused pick slot.
const NO_PICK: u32 = u32::MAX;

/// A pod's requests, validated and ordered for placement.
struct Plan<'p> {
    pod: &'p PodRequest,
    /// Requests in placement order.
    flats: Vec<Flat<'p>>,
    /// Pick slots of each claim: `claim_slots[c]..claim_slots[c + 1]`.
    claim_slots: Vec<usize>,
    total_picks: usize,
    whole_needed: u32,
    max_claim_devices: u32,
    node_policy: Policy,
}

/// One request and where its picks go.
struct Flat<'p> {
    claim: usize,
    /// First pick slot; the request owns `slot..slot + count`.
    slot: usize,
    req: &'p DeviceRequest,
}

impl Flat<'_> {
    fn count(&self) -> usize {
        self.req.count as usize
    }
}

/// Outcome of placing every request on one node.
struct Eval {
    tiers: u32,
    /// Sum of [`nominal`] over the picks.
    consumed: u64,
}

impl<'p> Plan<'p> {
    fn new(pod: &'p PodRequest) -> Result<Self, Unplaceable> {
        let mut flats = Vec::new();
        let mut claim_slots = vec![0];
        let mut slot = 0;
        let mut whole_needed = 0u32;
        let mut max_claim_devices = 0u32;
        for (claim_at, claim) in pod.claims.iter().enumerate() {
            let mut claim_devices = 0u32;
            for req in &claim.requests {
                validate(&claim.key, req)?;
                flats.push(Flat {
                    claim: claim_at,
                    slot,
                    req,
                });
                slot += req.count as usize;
                claim_devices = claim_devices.saturating_add(req.count);
                if req.slice.is_none() && !req.admin_access {
                    whole_needed = whole_needed.saturating_add(req.count);
                }
            }
            max_claim_devices = max_claim_devices.max(claim_devices);
            claim_slots.push(slot);
        }
        let Some(first) = flats.first() else {
            return Err(Unplaceable::new(
                UnplaceableReason::InvalidRequest,
                "the pod's claims have no requests to place".to_owned(),
            ));
        };
        let node_policy = first.req.policy;
        // Hardest first: whole GPUs, then more devices, then bigger slices; admin access,
        // which takes nothing from the others, last.
        flats.sort_by_key(|f| {
            let size = f.req.slice.unwrap_or_default();
            (
                f.req.admin_access,
                f.req.slice.is_some(),
                Reverse(f.req.count),
                Reverse(size.memory_bytes),
                Reverse(size.compute_percent),
                f.slot,
            )
        });
        Ok(Plan {
            pod,
            flats,
            claim_slots,
            total_picks: slot,
            whole_needed,
            max_claim_devices,
            node_policy,
        })
    }

    /// Cheap necessary conditions from the node's aggregates.
    fn may_fit(&self, node: &NodeEntry) -> bool {
        let agg = &node.agg;
        let gpus = u32::try_from(node.gpus.len()).unwrap_or(u32::MAX);
        if self.max_claim_devices > gpus || self.whole_needed > agg.idle_gpus {
            return false;
        }
        self.flats.iter().all(|flat| {
            let req = flat.req;
            let slice_fits = req.slice.is_none_or(|size| {
                agg.open_gpus >= req.count
                    && agg.max_free_memory >= size.memory_bytes
                    && agg.max_free_compute >= size.compute_percent
            });
            let topology_fits = req.count <= 1
                || match req.topology {
                    TopologyScope::Any => true,
                    TopologyScope::NvLink => agg.max_nvlink_group >= req.count,
                    TopologyScope::PcieRoot => agg.max_pcie_group >= req.count,
                };
            slice_fits && topology_fits
        })
    }

    /// An upper bound of the node's (tiers, policy value).
    fn bound(&self, node: &NodeEntry, memo: &mut ConsumptionMemo) -> (u32, i64) {
        let agg = &node.agg;
        let tiers = self.flats.iter().map(|f| tier_bound(f.req, agg)).sum();
        let (least, most) = memo.get(self, agg);
        let policy = match self.node_policy {
            Policy::BinPack | Policy::LeastFragmentation => {
                -to_i64(agg.free_score.saturating_sub(most))
            }
            Policy::Spread => to_i64(agg.free_score.saturating_sub(least)),
        };
        (tiers, policy)
    }

    /// Lowest and highest total [`nominal`] consumption of the pod on a node of these sizes.
    fn consumption(&self, agg: &NodeAggregates) -> (u64, u64) {
        let mut least = 0u64;
        let mut most = 0u64;
        for flat in self.flats.iter().filter(|f| !f.req.admin_access) {
            let (low, high) = consumption_bounds(flat.req.slice, agg);
            least += low * u64::from(flat.req.count);
            most += high * u64::from(flat.req.count);
        }
        (least, most)
    }

    fn policy_value(&self, node: &NodeEntry, consumed: u64) -> i64 {
        let left = to_i64(node.agg.free_score.saturating_sub(consumed));
        match self.node_policy {
            Policy::BinPack | Policy::LeastFragmentation => -left,
            Policy::Spread => left,
        }
    }

    /// Places every request on `node`; the picks are left in `scratch.picks`.
    fn evaluate(&self, node: &NodeEntry, scratch: &mut Scratch) -> Option<Eval> {
        scratch.reset(node);
        let mut eval = Eval {
            tiers: 0,
            consumed: 0,
        };
        for flat in &self.flats {
            let tier = self.place_one(flat, node, scratch)?;
            eval.tiers += tier;
            eval.consumed += take(flat, node, scratch);
        }
        Some(eval)
    }

    /// Chooses the GPUs of one request, keeping the claim's own devices distinct.
    fn place_one(&self, flat: &Flat<'_>, node: &NodeEntry, scratch: &mut Scratch) -> Option<u32> {
        let claim = self.claim_range(flat.claim);
        scratch.block_claim(claim.clone(), true);
        let tier = choose(flat, node, scratch);
        scratch.block_claim(claim, false);
        tier
    }

    fn claim_range(&self, claim: usize) -> std::ops::Range<usize> {
        self.claim_slots[claim]..self.claim_slots[claim + 1]
    }

    fn placement(&self, node: &NodeEntry, picks: &[u32]) -> PodPlacement {
        let mut slot = 0;
        let admin_requests = self
            .pod
            .claims
            .iter()
            .flat_map(|claim| {
                claim
                    .requests
                    .iter()
                    .filter(|req| req.admin_access)
                    .map(|req| (claim.key.clone(), req.name.clone()))
            })
            .collect();
        let claims = self
            .pod
            .claims
            .iter()
            .map(|claim| {
                let mut devices = Vec::new();
                for req in &claim.requests {
                    let mut chosen: Vec<u32> = picks[slot..slot + req.count as usize].to_vec();
                    slot += req.count as usize;
                    chosen.sort_unstable();
                    devices.extend(chosen.into_iter().filter_map(|at| {
                        let gpu = node.gpus.get(at as usize)?;
                        Some(PlacedDevice {
                            request: req.name.clone(),
                            device: gpu.info.device.clone(),
                            gpu_uuid: gpu.info.uuid.clone(),
                            slice: req.slice,
                            sharing: req.sharing,
                            time_slice_interval: req.time_slice_interval,
                            enforcement: req.enforcement,
                        })
                    }));
                }
                ClaimPlacement {
                    key: claim.key.clone(),
                    devices,
                }
            })
            .collect();
        PodPlacement {
            node: node.name.clone(),
            claims,
            admin_requests,
        }
    }
}

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn tier_bound(req: &DeviceRequest, agg: &NodeAggregates) -> u32 {
    if req.count <= 1 {
        return TIER_NVLINK;
    }
    match req.topology {
        TopologyScope::NvLink => TIER_NVLINK,
        TopologyScope::PcieRoot => TIER_PCIE,
        TopologyScope::Any if agg.max_nvlink_group >= req.count => TIER_NVLINK,
        TopologyScope::Any if agg.max_pcie_group >= req.count => TIER_PCIE,
        TopologyScope::Any => TIER_ANY,
    }
}

/// What one device of this size takes from a node's free capacity score, as the node ranking
/// counts it: a whole GPU 2000, a slice its memory share of the GPU plus its compute share
/// (each 0–1000). Independent of how full the GPU already is, so that [`Plan::bound`] is exact
/// on nodes of one GPU model and equal nodes are not all evaluated.
fn nominal(slice: Option<SliceSize>, total_memory: u64) -> u64 {
    let Some(size) = slice else {
        return u64::from(FULL_SCORE);
    };
    let memory = if total_memory == 0 {
        1000
    } else {
        per_mille(size.memory_bytes, total_memory)
    };
    memory + u64::from(size.compute_percent) * 10
}

/// Lowest and highest [`nominal`] of one device of this size on the node.
fn consumption_bounds(slice: Option<SliceSize>, agg: &NodeAggregates) -> (u64, u64) {
    (
        nominal(slice, agg.max_total_memory),
        nominal(slice, agg.min_total_memory),
    )
}
