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

use crate::mps::TimeSliceInterval;
use crate::slice::Sharing;

use super::index::{GpuFree, Index, NodeAggregates, NodeEntry, free_permille, per_mille};
use super::model::{DeviceUse, UseKind};
use super::prioritized::place_first_available;
use super::request::{DeviceRequest, GpuSelector, PodRequest, Policy, SliceSize, TopologyScope};
use super::taint::{DeviceTaint, untolerated};
use super::unplaceable::{BestCandidate, Unplaceable, UnplaceableReason};

/// Most devices one request may ask for; more is an invalid request.
pub const MAX_DEVICES_PER_REQUEST: u32 = 1024;

/// Where a pod's claims go: one node, and per claim the devices of each request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The node every claim of the pod is placed on.
    pub node: String,
    /// One entry per claim of the [`PodRequest`], in its order.
    pub claims: Vec<ClaimPlacement>,
    /// `(claim key, request name)` of every placed request with admin access: its devices
    /// use nothing.
    pub admin_requests: Vec<(String, String)>,
}

impl Placement {
    /// True when `request` of claim `claim_key` was placed with admin access.
    pub fn is_admin(&self, claim_key: &str, request: &str) -> bool {
        self.admin_requests
            .iter()
            .any(|(claim, name)| claim == claim_key && name == request)
    }

    /// The usage `claim`'s devices put on the node, for [`Index::set_claim_usage`]: as
    /// [`ClaimPlacement::device_uses`] without admin-access devices, which use nothing (as
    /// kube-scheduler leaves admin-access results out of the devices in use).
    pub fn claim_uses(&self, claim: &ClaimPlacement) -> Vec<DeviceUse> {
        let mut uses = claim.device_uses(&self.node);
        if !self.admin_requests.is_empty() {
            let mut at = 0;
            uses.retain(|_| {
                let keep = !self.is_admin(&claim.key, &claim.devices[at].request);
                at += 1;
                keep
            });
        }
        uses
    }
}

/// The devices placed for one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimPlacement {
    /// The claim's key (UID), as in the [`ClaimRequest`](super::ClaimRequest).
    pub key: String,
    /// Request by request (in the claim's order), each request's devices by device name.
    pub devices: Vec<PlacedDevice>,
}

/// One device placed for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedDevice {
    /// The request's name.
    pub request: String,
    /// Device name, e.g. `gpu-3`.
    pub device: String,
    /// UUID of the GPU, so the node can check it prepares the GPU that was placed.
    pub gpu_uuid: String,
    /// The slice reserved on the GPU; `None` for a whole GPU.
    pub slice: Option<SliceSize>,
    /// Sharing strategy of the request.
    pub sharing: Sharing,
    /// Time slice of the request ([`DeviceRequest::time_slice_interval`]).
    pub time_slice_interval: Option<TimeSliceInterval>,
}

impl ClaimPlacement {
    /// The usage this claim's devices put on `node` if all of them used their GPU; see
    /// [`Placement::claim_uses`], which leaves admin-access devices out.
    pub fn device_uses(&self, node: &str) -> Vec<DeviceUse> {
        self.devices
            .iter()
            .map(|device| DeviceUse {
                node: node.to_owned(),
                device: device.device.clone(),
                kind: match device.slice {
                    None => UseKind::Whole,
                    Some(size) => UseKind::Slice {
                        memory_bytes: size.memory_bytes,
                        compute_percent: size.compute_percent,
                        sharing: device.sharing,
                    },
                },
            })
            .collect()
    }
}

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
) -> Result<Placement, Unplaceable> {
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
) -> Result<Placement, Unplaceable> {
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
/// caller named, for the message when none is known.
fn place_among<'i>(
    pod: &PodRequest,
    candidates: impl Iterator<Item = &'i NodeEntry>,
    asked: usize,
) -> Result<Placement, Unplaceable> {
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

/// Working state reused across nodes within one decision.
struct Scratch {
    gpus: Vec<Slot>,
    cand: Vec<Cand>,
    grouped: Vec<Cand>,
    picks: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    free: GpuFree,
    /// Already picked by the claim being placed.
    blocked: bool,
}

/// An eligible GPU; ordered by group, then cost, then device order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cand {
    group: u32,
    cost: u32,
    gpu: u32,
}

impl Scratch {
    fn new(picks: usize) -> Self {
        Scratch {
            gpus: Vec::new(),
            cand: Vec::new(),
            grouped: Vec::new(),
            picks: vec![NO_PICK; picks],
        }
    }

    fn reset(&mut self, node: &NodeEntry) {
        self.gpus.clear();
        self.gpus.extend(node.gpus.iter().map(|gpu| Slot {
            free: gpu.free,
            blocked: false,
        }));
        self.picks.fill(NO_PICK);
    }

    fn block_claim(&mut self, slots: std::ops::Range<usize>, blocked: bool) {
        for &pick in &self.picks[slots] {
            if let Some(slot) = self.gpus.get_mut(pick as usize) {
                slot.blocked = blocked;
            }
        }
    }
}

fn invalid(claim: &str, req: &DeviceRequest, what: &str) -> Unplaceable {
    Unplaceable::new(
        UnplaceableReason::InvalidRequest,
        format!("request {:?}: {what}", req.name),
    )
    .for_request(claim, &req.name, req.count)
}

fn validate(claim: &str, req: &DeviceRequest) -> Result<(), Unplaceable> {
    if !req.first_available.is_empty() {
        // place_first_available replaces every such request by one of its subrequests.
        return Err(invalid(claim, req, "subrequests cannot have subrequests"));
    }
    if req.admin_access && req.slice.is_some() {
        return Err(invalid(
            claim,
            req,
            "admin access takes whole GPUs, not slices",
        ));
    }
    if req.count == 0 {
        return Err(invalid(claim, req, "count must be at least 1"));
    }
    if req.count > MAX_DEVICES_PER_REQUEST {
        return Err(invalid(
            claim,
            req,
            &format!("count {} is more than {MAX_DEVICES_PER_REQUEST}", req.count),
        ));
    }
    if let Some(size) = req.slice {
        if size.compute_percent > 100 {
            return Err(invalid(
                claim,
                req,
                &format!("compute {}% is more than 100%", size.compute_percent),
            ));
        }
        if size.memory_bytes == 0 && size.compute_percent == 0 {
            return Err(invalid(
                claim,
                req,
                "a slice must reserve memory or compute",
            ));
        }
    }
    if req.max_slices_per_gpu == Some(0) {
        return Err(invalid(claim, req, "max slices per GPU must be at least 1"));
    }
    Ok(())
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
            Policy::BinPack => -to_i64(agg.free_score.saturating_sub(most)),
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
            Policy::BinPack => -left,
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

    fn placement(&self, node: &NodeEntry, picks: &[u32]) -> Placement {
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
                        })
                    }));
                }
                ClaimPlacement {
                    key: claim.key.clone(),
                    devices,
                }
            })
            .collect();
        Placement {
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

/// Free capacity score left on a GPU if the request takes it, or `None` when it does not fit.
fn fit_after(req: &DeviceRequest, free: &GpuFree, total_memory: u64) -> Option<u32> {
    match req.slice {
        None => free.idle.then_some(0),
        Some(size) => {
            let fits = !free.whole_held
                && free.memory >= size.memory_bytes
                && free.compute >= size.compute_percent
                && req.max_slices_per_gpu.is_none_or(|max| free.slices < max)
                && !sharing_conflicts(req.sharing, free);
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
fn sharing_conflicts(sharing: Sharing, free: &GpuFree) -> bool {
    match sharing {
        Sharing::Mps => free.time_sliced,
        Sharing::TimeSlicing => free.mps,
        Sharing::Exclusive => false,
    }
}

/// Lower is better.
fn cost(policy: Policy, idle: bool, after: u32) -> u32 {
    match policy {
        Policy::BinPack => u32::from(idle) * IDLE_PENALTY + after,
        Policy::Spread => FULL_SCORE.saturating_sub(after),
    }
}

/// Fills `scratch.cand` with the GPUs the request may take, in device order.
fn eligible(req: &DeviceRequest, node: &NodeEntry, scratch: &mut Scratch) {
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
fn choose(flat: &Flat<'_>, node: &NodeEntry, scratch: &mut Scratch) -> Option<u32> {
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
fn take(flat: &Flat<'_>, node: &NodeEntry, scratch: &mut Scratch) -> u64 {
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
            }
        }
        free.idle = false;
        consumed += nominal(flat.req.slice, gpu.info.memory_bytes);
    }
    consumed
}

/// Why one node could not take the pod.
struct Diagnosis<'a> {
    node: &'a str,
    /// Requests placed before the failing one.
    placed: usize,
    /// GPUs that fit the failing request completely, topology included.
    together: u32,
    /// GPUs that match its selector.
    matching: u32,
    /// The figure the message reports: `matching` for a selector failure, else `together`.
    found: u32,
    kind: UnplaceableReason,
    /// Index of the failing request in the plan's placement order (equal to `placed`).
    flat: usize,
    blockers: Blockers,
    fitting: u32,
    /// The first matching GPU kept out by a taint, and that taint.
    taint: Option<(&'a str, &'a DeviceTaint)>,
}

/// Matching GPUs that did not fit, by the first constraint they broke.
#[derive(Debug, Default, Clone, Copy)]
struct Blockers {
    in_use: u32,
    max_slices: u32,
    sharing: u32,
    memory: u32,
    compute: u32,
    tainted: u32,
}

impl Diagnosis<'_> {
    /// Higher came closer: more requests placed, then more GPUs that fit the failing one,
    /// then more that match its selector.
    fn rank(&self) -> (usize, u32, u32) {
        (self.placed, self.together, self.matching)
    }
}

impl Plan<'_> {
    fn explain(&self, mut nodes: Vec<&NodeEntry>, asked: usize) -> Unplaceable {
        nodes.sort_by_key(|node| node.order);
        nodes.dedup_by_key(|node| node.order);
        if nodes.is_empty() {
            let message = if asked == 0 {
                "no candidate nodes: no node passed the pod's scheduling constraints".to_owned()
            } else {
                format!("none of the {asked} candidate nodes has GPUs of this driver")
            };
            return Unplaceable::new(UnplaceableReason::NoCandidateNodes, message);
        }
        let best = self.closest(nodes);
        match best {
            Some(diagnosis) => self.describe(&diagnosis),
            // Placement and diagnosis evaluate nodes alike, so this means a bug, not a fit.
            None => Unplaceable::new(
                UnplaceableReason::InUse,
                "no candidate node fits the pod's requests together".to_owned(),
            ),
        }
    }

    /// The diagnosis of highest rank among `nodes` (sorted by order), the lowest order among
    /// equals: what diagnosing every node in order and keeping strictly better ones gives.
    ///
    /// Nodes are diagnosed in order of an upper bound of their rank and the search stops when
    /// no node left can beat or tie the best one found; on a full cluster that skips nearly
    /// every node, where diagnosing all of them made explanations cost milliseconds.
    fn closest<'n>(&self, nodes: Vec<&'n NodeEntry>) -> Option<Diagnosis<'n>> {
        let mut ranked: Vec<((usize, u32, u32), &NodeEntry)> = nodes
            .into_iter()
            .map(|node| (self.rank_bound(node), node))
            .collect();
        // Stable: equal bounds keep ascending node order.
        ranked.sort_by_key(|(bound, _)| Reverse(*bound));
        let mut scratch = Scratch::new(self.total_picks);
        let mut best: Option<(Diagnosis<'n>, u64)> = None;
        for (bound, node) in ranked {
            if let Some((b, order)) = &best
                && (bound < b.rank() || (bound == b.rank() && node.order > *order))
            {
                break;
            }
            let Some(diagnosis) = self.diagnose(node, &mut scratch) else {
                continue;
            };
            let better = best.as_ref().is_none_or(|(b, order)| {
                diagnosis.rank() > b.rank() || (diagnosis.rank() == b.rank() && node.order < *order)
            });
            if better {
                best = Some((diagnosis, node.order));
            }
        }
        best.map(|(diagnosis, _)| diagnosis)
    }

    /// An upper bound of [`Diagnosis::rank`] on `node`, from its aggregates. Only pods of one
    /// request get a tight bound (their failing request is always the first); `together` is
    /// at most the GPUs that could take the request alone, `matching` at most the node's GPUs.
    fn rank_bound(&self, node: &NodeEntry) -> (usize, u32, u32) {
        let gpus = u32::try_from(node.gpus.len()).unwrap_or(u32::MAX);
        let [flat] = self.flats.as_slice() else {
            return (self.flats.len().saturating_sub(1), u32::MAX, u32::MAX);
        };
        let agg = &node.agg;
        let together = match flat.req.slice {
            None if flat.req.admin_access => gpus,
            None => agg.idle_gpus,
            Some(size)
                if agg.max_free_memory < size.memory_bytes
                    || agg.max_free_compute < size.compute_percent =>
            {
                0
            }
            Some(_) => agg.open_gpus,
        };
        (0, together.min(gpus), gpus)
    }

    /// Every node diagnosed in order, keeping strictly better ones: the reference that
    /// [`Plan::closest`] must agree with.
    #[cfg(test)]
    fn closest_exhaustive<'n>(&self, nodes: Vec<&'n NodeEntry>) -> Option<Diagnosis<'n>> {
        let mut scratch = Scratch::new(self.total_picks);
        let mut best: Option<Diagnosis<'_>> = None;
        for node in nodes {
            if let Some(diagnosis) = self.diagnose(node, &mut scratch)
                && best.as_ref().is_none_or(|b| diagnosis.rank() > b.rank())
            {
                best = Some(diagnosis);
            }
        }
        best
    }

    fn diagnose<'n>(&self, node: &'n NodeEntry, scratch: &mut Scratch) -> Option<Diagnosis<'n>> {
        scratch.reset(node);
        for (placed, flat) in self.flats.iter().enumerate() {
            let claim = self.claim_range(flat.claim);
            scratch.block_claim(claim.clone(), true);
            let chosen = choose(flat, node, scratch);
            if chosen.is_none() {
                let diagnosis = failure(flat, placed, node, scratch);
                scratch.block_claim(claim, false);
                return Some(diagnosis);
            }
            scratch.block_claim(claim, false);
            take(flat, node, scratch);
        }
        None
    }

    fn describe(&self, diagnosis: &Diagnosis<'_>) -> Unplaceable {
        let flat = &self.flats[diagnosis.flat];
        let req = flat.req;
        let claim = &self.pod.claims[flat.claim].key;
        let gpus = if req.count == 1 { "GPU" } else { "GPUs" };
        let selector = describe_selector(&req.selector);
        let wanted = match (diagnosis.kind, req.slice) {
            (UnplaceableReason::Selector, _) => format!("{} {gpus}{selector}", req.count),
            (_, None) if req.admin_access => {
                format!("{} {gpus}{selector} for admin access", req.count)
            }
            (_, None) => format!("{} free whole {gpus}{selector}", req.count),
            (_, Some(size)) => format!(
                "{} {gpus}{selector} with {} free",
                req.count,
                describe_size(size)
            ),
        };
        let topology = match req.topology {
            _ if req.count <= 1 => "",
            TopologyScope::Any => "",
            TopologyScope::NvLink => " on one NVLink domain",
            TopologyScope::PcieRoot => " behind one PCIe root",
        };
        let mut message = format!(
            "request {:?}: no node has {wanted}{topology}; best: {} has {}",
            req.name, diagnosis.node, diagnosis.found
        );
        message.push_str(&describe_blockers(diagnosis, req));
        if diagnosis.placed > 0 {
            message.push_str(", counting the pod's other requests placed there first");
        }
        Unplaceable::new(diagnosis.kind, message)
            .for_request(claim, &req.name, req.count)
            .with_best(BestCandidate {
                node: diagnosis.node.to_owned(),
                found: diagnosis.found,
            })
    }
}

/// Counts, for the request that failed on a node, how far the node got and why not further.
fn failure<'n>(
    flat: &Flat<'_>,
    placed: usize,
    node: &'n NodeEntry,
    scratch: &Scratch,
) -> Diagnosis<'n> {
    let req = flat.req;
    let mut matching = 0u32;
    let mut blockers = Blockers::default();
    let mut fitting_nvlink: Vec<u16> = Vec::new();
    let mut fitting_pcie: Vec<u16> = Vec::new();
    let mut fitting = 0u32;
    let mut taint = None;
    for (gpu, slot) in node.gpus.iter().zip(&scratch.gpus) {
        if slot.blocked || !req.selector.matches(&gpu.info) {
            continue;
        }
        matching += 1;
        let free = &slot.free;
        let untolerated = gpu
            .blocking_taints
            .then(|| untolerated(&gpu.info.taints, &req.tolerations))
            .flatten();
        match req.slice {
            _ if untolerated.is_some() => {
                blockers.tainted += 1;
                taint = taint.or(untolerated.map(|t| (gpu.info.device.as_str(), t)));
            }
            _ if req.admin_access => {
                fitting += 1;
                fitting_nvlink.extend(gpu.nvlink);
                fitting_pcie.extend(gpu.pcie);
            }
            None if !free.idle => blockers.in_use += 1,
            Some(_) if free.whole_held => blockers.in_use += 1,
            Some(_) if req.max_slices_per_gpu.is_some_and(|max| free.slices >= max) => {
                blockers.max_slices += 1;
            }
            Some(_) if sharing_conflicts(req.sharing, free) => blockers.sharing += 1,
            Some(size) if free.memory < size.memory_bytes => blockers.memory += 1,
            Some(size) if free.compute < size.compute_percent => blockers.compute += 1,
            _ => {
                fitting += 1;
                fitting_nvlink.extend(gpu.nvlink);
                fitting_pcie.extend(gpu.pcie);
            }
        }
    }
    let together = match req.topology {
        _ if req.count <= 1 => fitting,
        TopologyScope::Any => fitting,
        TopologyScope::NvLink => largest_run(&mut fitting_nvlink),
        TopologyScope::PcieRoot => largest_run(&mut fitting_pcie),
    };
    let (kind, found) = if matching < req.count {
        (UnplaceableReason::Selector, matching)
    } else if fitting < req.count {
        (blockers.dominant(), together)
    } else {
        (UnplaceableReason::Topology, together)
    };
    Diagnosis {
        node: &node.name,
        placed,
        together,
        matching,
        found,
        kind,
        flat: placed,
        blockers,
        fitting,
        taint,
    }
}

impl Blockers {
    /// The constraint that kept the most matching GPUs out (in this order on ties).
    fn dominant(&self) -> UnplaceableReason {
        let ranked = [
            (self.in_use, UnplaceableReason::InUse),
            (self.max_slices, UnplaceableReason::MaxSlices),
            (self.sharing, UnplaceableReason::SharingConflict),
            (self.memory, UnplaceableReason::InsufficientMemory),
            (self.compute, UnplaceableReason::InsufficientCompute),
            (self.tainted, UnplaceableReason::Tainted),
        ];
        let mut best = ranked[0];
        for candidate in &ranked[1..] {
            if candidate.0 > best.0 {
                best = *candidate;
            }
        }
        best.1
    }
}

fn largest_run(ids: &mut [u16]) -> u32 {
    ids.sort_unstable();
    ids.chunk_by(|a, b| a == b)
        .map(|run| u32::try_from(run.len()).unwrap_or(u32::MAX))
        .max()
        .unwrap_or(0)
}

fn describe_selector(selector: &GpuSelector) -> String {
    let mut parts = Vec::new();
    if !selector.product_names.is_empty() {
        let names: Vec<String> = selector
            .product_names
            .iter()
            .map(|p| format!("{p:?}"))
            .collect();
        parts.push(format!("product {}", names.join(" or ")));
    }
    if let Some(min) = selector.min_memory_bytes {
        parts.push(format!("at least {} memory", format_bytes(min)));
    }
    if let Some(min) = selector.min_compute_capability {
        parts.push(format!("compute capability {min} or newer"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

fn describe_size(size: SliceSize) -> String {
    match (size.memory_bytes, size.compute_percent) {
        (0, compute) => format!("{compute}% compute"),
        (memory, 0) => format!("{} memory", format_bytes(memory)),
        (memory, compute) => format!("{} memory and {compute}% compute", format_bytes(memory)),
    }
}

fn describe_blockers(diagnosis: &Diagnosis<'_>, req: &DeviceRequest) -> String {
    let b = diagnosis.blockers;
    let mut parts = Vec::new();
    if diagnosis.kind == UnplaceableReason::Topology {
        let domains = match req.topology {
            TopologyScope::PcieRoot => "PCIe roots",
            _ => "NVLink domains",
        };
        return format!(
            " ({} fit, but spread over {domains} or without one)",
            diagnosis.fitting
        );
    }
    if b.in_use > 0 {
        parts.push(format!("{} in use", b.in_use));
    }
    if b.max_slices > 0 {
        let max = req.max_slices_per_gpu.unwrap_or_default();
        parts.push(format!("{} at the limit of {max} slices", b.max_slices));
    }
    if b.sharing > 0 {
        let other = match req.sharing {
            Sharing::Mps => "time-sliced",
            _ => "MPS",
        };
        parts.push(format!("{} carrying {other} slices", b.sharing));
    }
    if b.memory > 0 {
        parts.push(format!("{} with too little memory free", b.memory));
    }
    if b.compute > 0 {
        parts.push(format!("{} with too little compute free", b.compute));
    }
    if b.tainted > 0 {
        parts.push(format!("{} tainted", b.tainted));
    }
    let text = if parts.is_empty() {
        String::new()
    } else {
        format!(" (of its matching GPUs, {})", parts.join(", "))
    };
    match diagnosis.taint {
        Some((device, taint)) => {
            format!("{text}; {device} is tainted {taint} and the request does not tolerate it")
        }
        None => text,
    }
}

/// Bytes with the largest binary suffix that keeps them whole (`20Gi`, `1536Mi`).
pub(super) fn format_bytes(bytes: u64) -> String {
    const SUFFIXES: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    SUFFIXES
        .iter()
        .find(|(_, shift)| bytes != 0 && bytes.trailing_zeros() >= *shift)
        .map_or_else(
            || bytes.to_string(),
            |(name, shift)| format!("{}{name}", bytes >> shift),
        )
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::alloc::{ClaimRequest, GpuInfo, NodeGpus};
    use crate::inventory::ComputeCapability;

    const GI: u64 = 1 << 30;

    fn node(name: String, gpus: usize) -> NodeGpus {
        let gpus = (0..gpus)
            .map(|g| GpuInfo {
                device: format!("gpu-{g}"),
                uuid: format!("GPU-{name}-{g}"),
                product: if g % 3 == 2 { "L4" } else { "H100" }.into(),
                memory_bytes: 80 * GI,
                multiprocessors: 132,
                compute_capability: ComputeCapability { major: 9, minor: 0 },
                nvlink_domain: (g % 4 != 3).then(|| format!("d{}", g / 4)),
                pcie_root: Some(format!("p{}", g / 2)),
                numa: None,
                taints: Vec::new(),
            })
            .collect();
        NodeGpus { node: name, gpus }
    }

    fn request_strategy() -> impl Strategy<Value = DeviceRequest> {
        (
            1u32..4,
            prop::option::of((0u64..81, 0u8..101)),
            0usize..3,
            any::<bool>(),
            prop::option::of(1u32..4),
        )
            .prop_map(|(count, slice, topology, l4, max_slices)| {
                let mut r = match slice {
                    Some((gi, compute)) => DeviceRequest::slices(
                        "s",
                        count,
                        SliceSize {
                            memory_bytes: gi * GI,
                            compute_percent: compute.max(u8::from(gi == 0)),
                        },
                    ),
                    None => DeviceRequest::whole("w", count),
                };
                r.topology = [
                    TopologyScope::Any,
                    TopologyScope::NvLink,
                    TopologyScope::PcieRoot,
                ][topology];
                if l4 {
                    r.selector.product_names = vec!["L4".into()];
                }
                r.max_slices_per_gpu = max_slices;
                r
            })
    }

    /// Claims that disagree on the interval still share a GPU (the node keeps the first
    /// one's); each placed device carries its own request's.
    #[test]
    fn placed_devices_carry_their_request_interval() {
        let mut index = Index::new();
        index.upsert_node(node("n00".into(), 1));
        for (key, interval) in [
            ("a", Some(TimeSliceInterval::Long)),
            ("b", Some(TimeSliceInterval::Short)),
            ("c", None),
        ] {
            let mut request = DeviceRequest::slices(
                "s",
                1,
                SliceSize {
                    memory_bytes: 10 * GI,
                    compute_percent: 0,
                },
            );
            request.sharing = Sharing::TimeSlicing;
            request.time_slice_interval = interval;
            let pod = PodRequest {
                claims: vec![ClaimRequest {
                    key: key.into(),
                    requests: vec![request],
                }],
            };
            let placement = place(&index, &pod, &["n00"]).expect("fits");
            let device = &placement.claims[0].devices[0];
            assert_eq!(
                (
                    device.device.as_str(),
                    device.sharing,
                    device.time_slice_interval
                ),
                ("gpu-0", Sharing::TimeSlicing, interval)
            );
            index.apply(&placement);
        }
    }

    proptest! {
        /// The pruned search for the closest node finds the same diagnosis as diagnosing
        /// every node.
        #[test]
        fn closest_agrees_with_diagnosing_every_node(
            gpus in prop::collection::vec(1usize..9, 1..12),
            uses in prop::collection::vec((0usize..12, 0usize..9, prop::option::of((1u64..60, 1u8..80))), 0..60),
            pod in prop::collection::vec(prop::collection::vec(request_strategy(), 1..3), 1..3),
        ) {
            let mut index = Index::new();
            for (n, &count) in gpus.iter().enumerate() {
                index.upsert_node(node(format!("n{n:02}"), count));
            }
            for (i, (n, g, slice)) in uses.into_iter().enumerate() {
                let (name, device) = (format!("n{:02}", n % gpus.len()), format!("gpu-{g}"));
                let u = match slice {
                    Some((gi, compute)) => DeviceUse::slice(name, device, gi * GI, compute),
                    None => DeviceUse::whole(name, device),
                };
                index.set_claim_usage(&format!("c{i}"), vec![u]);
            }
            let pod = PodRequest {
                claims: pod
                    .into_iter()
                    .enumerate()
                    .map(|(c, requests)| ClaimRequest { key: format!("k{c}"), requests })
                    .collect(),
            };
            let Ok(plan) = Plan::new(&pod) else { return Ok(()) };
            let mut nodes: Vec<&NodeEntry> = index.entries().collect();
            nodes.sort_by_key(|n| n.order);
            let fast = plan.closest(nodes.clone());
            let slow = plan.closest_exhaustive(nodes);
            let key = |d: &Diagnosis<'_>| (d.node.to_owned(), d.rank(), d.flat, d.found, d.kind);
            prop_assert_eq!(fast.as_ref().map(key), slow.as_ref().map(key));
        }
    }
}
