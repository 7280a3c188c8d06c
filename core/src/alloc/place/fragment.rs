//! The LeastFragmentation policy: the node and GPUs whose use leaves the cluster's free GPU
//! capacity most usable by the pods it runs.
//!
//! Per candidate node, the pod's requests are placed on a working copy of the node (a slice
//! of one GPU on the GPU that leaves the least fragmentation; other requests as BinPack picks
//! them), and the node is scored by how much the placement changes its fragmentation against
//! the learned [`Distribution`]: FGD's measure (fragmented GPUs) plus half the GPUs its CPU
//! and memory can no longer feed (stranded GPUs), minus what the placement spares pods
//! without GPUs ([`Steering`]). As in FGD's scheduler plugin (hkust-adsl/
//! kubernetes-scheduler-simulator, `pkg/simulator/plugin/fgd_score.go`,
//! `calculateGpuShareFragExtendScore`), the change is mapped to a score of 0–100 by
//! `int(sigmoid(change in GPUs) × 100)`, and nodes of equal score are told apart by a fixed
//! hash of their name: among near-equal placements the choice is spread over the cluster,
//! which on the openb trace packs better than always taking the smallest change.

use std::hash::Hasher as _;

use self::tally::{Tally, hosted};
use super::super::frag::{Distribution, FreeGpu, HostAmounts, HostState, STRANDED_WEIGHT};
use super::super::hash::{FastMap, WordHasher};
use super::super::index::{Index, NodeEntry};
use super::super::prioritized::place_first_available;
use super::super::request::Policy;
use super::super::steer::Steering;
use super::super::unplaceable::Unplaceable;
use super::pick::{Scratch, eligible, take};
use super::{Flat, Plan, PodPlacement, place_among};

/// What the LeastFragmentation policy knows besides the index.
#[derive(Clone, Copy)]
pub struct PlacementContext<'a> {
    /// The pod kinds the cluster runs and their shares, as learned by a
    /// [`Workload`](super::super::Workload). Empty: the policy places as BinPack.
    pub workload: &'a Distribution,
    /// What the pod being placed requests of its node.
    pub pod: HostAmounts,
    /// A node's CPU and memory, by node name; `None` where unknown (every pod kind then counts
    /// as fitting the node's CPU and memory).
    pub hosts: &'a dyn Fn(&str) -> Option<HostState>,
    /// Pods without GPUs are placed by kube-scheduler's default scoring: prefer using the
    /// nodes it would put them on where they would strand GPUs ([`Steering`]).
    pub steer_pods_without_gpus: bool,
}

impl std::fmt::Debug for PlacementContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlacementContext")
            .field("workload", self.workload)
            .field("pod", &self.pod)
            .field("steer_pods_without_gpus", &self.steer_pods_without_gpus)
            .finish_non_exhaustive()
    }
}

/// Node ranking: topology tiers, score, hash of the name.
type Key = (u32, i64, u64);

/// One node's evaluation: topology tiers, fragmentation removed, picks; `None` when the pod
/// does not fit.
type Outcome = Option<(u32, f64, Vec<u32>)>;

/// The policy's score of removing `removed` GPUs of fragmentation.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn score(removed: f64) -> i64 {
    let sigmoid = 1.0 / (1.0 + (-removed).exp());
    (sigmoid * 100.0) as i64
}

/// A fixed pseudo-random order of nodes.
fn name_hash(name: &str) -> u64 {
    let mut hasher = WordHasher::default();
    hasher.write(name.as_bytes());
    hasher.finish()
}

/// The pod's placement: by the LeastFragmentation policy when its first request asks for it
/// and the workload is known, else as [`place`](super::place) places it.
fn place_by_policy(
    pod: &super::PodRequest,
    index: &Index,
    candidates: Vec<&NodeEntry>,
    asked: usize,
    ctx: &PlacementContext<'_>,
) -> Result<PodPlacement, Unplaceable> {
    let plan = Plan::new(pod)?;
    if plan.node_policy == Policy::LeastFragmentation && !ctx.workload.is_empty() {
        return place_least_fragmentation(&plan, index, candidates, asked, ctx);
    }
    place_among(pod, candidates.into_iter(), asked)
}

/// Places the pod by the LeastFragmentation policy on the best of `candidates`.
fn place_least_fragmentation(
    plan: &Plan<'_>,
    index: &Index,
    candidates: Vec<&NodeEntry>,
    asked: usize,
    ctx: &PlacementContext<'_>,
) -> Result<PodPlacement, Unplaceable> {
    let steering = if ctx.steer_pods_without_gpus {
        Steering::new(index, ctx.workload, ctx.hosts)
    } else {
        None
    };
    let mut eval = Evaluation {
        plan,
        ctx,
        scratch: Scratch::new(plan.total_picks),
        gpus: Vec::new(),
        tally: Tally::default(),
        hosted_after: Vec::new(),
        hosted_before: Vec::new(),
    };
    let mut memo = Memo::default();
    let mut best: Option<(Key, usize, Vec<u32>)> = None;
    for (at, node) in candidates.iter().enumerate() {
        let host = (ctx.hosts)(&node.name).map(|h| h.free());
        memo.hosts.push(host);
        if !plan.may_fit(node) {
            continue;
        }
        let outcome = memo.outcome(&candidates, at, host, &mut eval);
        let Some((tiers, removed, picks)) = outcome else {
            continue;
        };
        let bonus = steering.as_ref().map_or(0.0, |s| s.bonus(node));
        let key = (tiers, score(removed + bonus), name_hash(&node.name));
        if best.as_ref().is_none_or(|(k, _, _)| key > *k) {
            best = Some((key, at, picks));
        }
    }
    match best {
        Some((_, at, picks)) => Ok(plan.placement(candidates[at], &picks)),
        None => Err(plan.explain(candidates, asked)),
    }
}

/// Nodes in one state (idle nodes of one kind, mostly) place alike: each state is evaluated
/// once per decision.
#[derive(Default)]
struct Memo {
    /// Digest → the first candidate in that state and its outcome.
    seen: FastMap<u64, (usize, Outcome)>,
    /// Free CPU and memory of the candidates so far.
    hosts: Vec<Option<HostAmounts>>,
}

impl Memo {
    /// The outcome of candidate `at`, whose free host is `host` (pushed last to `hosts`).
    fn outcome(
        &mut self,
        candidates: &[&NodeEntry],
        at: usize,
        host: Option<HostAmounts>,
        eval: &mut Evaluation<'_, '_>,
    ) -> Outcome {
        let node = candidates[at];
        let print = fingerprint(node, host);
        let known = print
            .and_then(|p| self.seen.get(&p))
            .filter(|(first, _)| same_state(candidates[*first], self.hosts[*first], node, host));
        if let Some((_, outcome)) = known {
            return outcome.clone();
        }
        let outcome = eval
            .node(node, host)
            .map(|(tiers, removed)| (tiers, removed, eval.scratch.picks.clone()));
        if let Some(print) = print {
            self.seen
                .entry(print)
                .or_insert_with(|| (at, outcome.clone()));
        }
        outcome
    }
}

/// Reused buffers of one decision.
struct Evaluation<'p, 'c> {
    plan: &'p Plan<'p>,
    ctx: &'c PlacementContext<'c>,
    scratch: Scratch,
    /// The working copy's GPUs as the measure sees them.
    gpus: Vec<FreeGpu>,
    tally: Tally,
    /// Weights per GPU kind of the pods the node's CPU and memory have room for, after the
    /// pod.
    hosted_after: Vec<f64>,
    hosted_before: Vec<f64>,
}

impl Evaluation<'_, '_> {
    /// Places every request on `node`; the topology tiers reached and the fragmentation the
    /// placement removes (negative: adds), or `None` when the pod does not fit.
    fn node(&mut self, node: &NodeEntry, host: Option<HostAmounts>) -> Option<(u32, f64)> {
        let dist = self.ctx.workload;
        let host_after = host.map(|h| h.minus(self.ctx.pod));
        self.scratch.reset(node);
        self.gpus.clear();
        self.gpus.extend(
            node.gpus
                .iter()
                .map(|g| FreeGpu::new(&g.free, g.info.memory_bytes)),
        );
        self.tally.reset(dist, &node.gpus, &self.gpus);
        hosted(dist, host, &mut self.hosted_before);
        hosted(dist, host_after, &mut self.hosted_after);
        let before = self.tally.objective(dist, &self.hosted_before, host);
        let mut tiers = 0;
        for flat in &self.plan.flats {
            let tier = if single_slice(flat) {
                self.least_fragmenting_gpu(flat, node, host_after)
            } else {
                self.plan.place_one(flat, node, &mut self.scratch)
            }?;
            tiers += tier;
            take(flat, node, &mut self.scratch);
            self.update(flat, node);
        }
        let after = self.tally.objective(dist, &self.hosted_after, host_after);
        Some((tiers, before - after))
    }

    /// Brings `gpus` and the tally up to the working copy after `flat`'s picks.
    fn update(&mut self, flat: &Flat<'_>, node: &NodeEntry) {
        let picks = &self.scratch.picks[flat.slot..flat.slot + flat.count()];
        for &pick in picks {
            let at = pick as usize;
            let (Some(slot), Some(entry)) = (self.scratch.gpus.get(at), node.gpus.get(at)) else {
                continue;
            };
            let new = FreeGpu::new(&slot.free, entry.info.memory_bytes);
            self.tally
                .change(self.ctx.workload, entry, &self.gpus[at], &new);
            self.gpus[at] = new;
        }
    }

    /// Chooses the GPU of a one-slice request: the one whose use leaves the least
    /// fragmentation (lowest device on ties).
    fn least_fragmenting_gpu(
        &mut self,
        flat: &Flat<'_>,
        node: &NodeEntry,
        host_after: Option<HostAmounts>,
    ) -> Option<u32> {
        let claim = self.plan.claim_range(flat.claim);
        self.scratch.block_claim(claim.clone(), true);
        eligible(flat.req, node, &mut self.scratch);
        self.scratch.block_claim(claim, false);
        let size = flat.req.slice?;
        let dist = self.ctx.workload;
        let mut best: Option<(f64, u32)> = None;
        let mut tried: Vec<(u64, u8, bool, u64)> = Vec::new();
        let mut trial = Tally::default();
        for gpu in self.scratch.cand_gpus() {
            let at = gpu as usize;
            let (slot, entry) = (self.scratch.gpus.get(at)?, node.gpus.get(at)?);
            // GPUs of one model in one free state score alike: try each state once.
            let state = (
                slot.free.memory,
                slot.free.compute,
                slot.free.idle,
                entry.info.memory_bytes,
            );
            if tried.contains(&state) {
                continue;
            }
            tried.push(state);
            let mut free = slot.free;
            free.memory -= size.memory_bytes;
            free.compute -= size.compute_percent;
            free.idle = false;
            trial.clone_from(&self.tally);
            let new = FreeGpu::new(&free, entry.info.memory_bytes);
            trial.change(dist, entry, &self.gpus[at], &new);
            let left = trial.objective(dist, &self.hosted_after, host_after);
            if best.is_none_or(|(b, _)| left < b) {
                best = Some((left, gpu));
            }
        }
        let (_, gpu) = best?;
        self.scratch.picks[flat.slot] = gpu;
        Some(super::TIER_NVLINK)
    }
}

/// A digest of what the evaluation of `node` with free `host` depends on, its GPUs' free
/// states above all; `None` when a GPU carries taints that block some requests (the
/// evaluation then depends on the request's tolerations). Equal digests are confirmed with
/// [`same_state`].
fn fingerprint(node: &NodeEntry, host: Option<HostAmounts>) -> Option<u64> {
    let mut hasher = WordHasher::default();
    hasher.write_usize(node.gpus.len());
    if let Some(h) = host {
        hasher.write_i64(h.milli_cpu);
        hasher.write_i64(h.memory);
    }
    for gpu in &node.gpus {
        if gpu.blocking_taints {
            return None;
        }
        let free = gpu.free;
        hasher.write_u64(free.memory ^ gpu.info.memory_bytes.rotate_left(17));
        hasher.write_u64(
            u64::from(free.compute)
                | u64::from(free.slices) << 8
                | u64::from(free.whole_held) << 40
                | u64::from(free.idle) << 41
                | u64::from(free.mps) << 42
                | u64::from(free.time_sliced) << 43,
        );
    }
    Some(hasher.finish())
}

/// Whether nodes `a` and `b` with free hosts `ha` and `hb` place every pod alike.
fn same_state(
    a: &NodeEntry,
    ha: Option<HostAmounts>,
    b: &NodeEntry,
    hb: Option<HostAmounts>,
) -> bool {
    ha == hb
        && a.gpus.len() == b.gpus.len()
        && a.gpus.iter().zip(&b.gpus).all(|(x, y)| {
            x.free == y.free
                && x.nvlink == y.nvlink
                && x.pcie == y.pcie
                && x.blocking_taints == y.blocking_taints
                && x.info.memory_bytes == y.info.memory_bytes
                && x.info.compute_capability == y.info.compute_capability
                && x.info.product == y.info.product
        })
}

/// One request for one slice (not admin access): its GPU is chosen by fragmentation.
fn single_slice(flat: &Flat<'_>) -> bool {
    flat.req.count == 1 && flat.req.slice.is_some() && !flat.req.admin_access
}

/// What the policy minimizes on a node state: fragmented plus weighted stranded GPUs.
fn objective(
    dist: &Distribution,
    node: &NodeEntry,
    gpus: &[FreeGpu],
    host: Option<HostAmounts>,
) -> f64 {
    let frag = dist.measure(&node.gpus, gpus, host);
    frag.fragmented_gpus + STRANDED_WEIGHT * frag.stranded_gpus
}

/// [`place`](super::place) with what the LeastFragmentation policy knows besides the index:
/// a pod whose first request asks for that policy is placed by it (see the module docs);
/// other pods, and every pod when `ctx.workload` is empty, exactly as by `place`.
///
/// # Errors
///
/// As [`place`](super::place).
pub fn place_with(
    index: &Index,
    pod: &super::PodRequest,
    candidate_nodes: &[&str],
    ctx: &PlacementContext<'_>,
) -> Result<PodPlacement, Unplaceable> {
    let nodes: Vec<&NodeEntry> = candidate_nodes
        .iter()
        .filter_map(|name| index.entry(name))
        .collect();
    place_first_available(pod, |pod| {
        place_by_policy(pod, index, nodes.clone(), candidate_nodes.len(), ctx)
    })
}

/// [`place_where`](super::place_where) with what the LeastFragmentation policy knows, as
/// [`place_with`].
///
/// # Errors
///
/// As [`place`](super::place).
pub fn place_where_with(
    index: &Index,
    pod: &super::PodRequest,
    mut is_candidate: impl FnMut(&str) -> bool,
    ctx: &PlacementContext<'_>,
) -> Result<PodPlacement, Unplaceable> {
    let mut asked = 0;
    let nodes: Vec<&NodeEntry> = index
        .entries()
        .filter(|node| {
            let candidate = is_candidate(&node.name);
            asked += usize::from(candidate);
            candidate
        })
        .collect();
    place_first_available(pod, |pod| {
        place_by_policy(pod, index, nodes.clone(), asked, ctx)
    })
}

/// The node of the index for which `is_candidate` is true (and whose CPU and memory
/// `ctx.hosts` knows) where a pod without GPUs, asking `ctx.pod` of its node, leaves the least
/// fragmentation, scored and tie-broken as the LeastFragmentation policy scores pods with
/// GPUs; `None` when no such node has the CPU and memory for it.
///
/// kerf's controller never places pods without GPUs (kube-scheduler does); this is the policy
/// applied to them, for comparisons with schedulers that place every pod (the `openb`
/// benchmark's "all pods" rows) and for a scheduler extension that wants it.
pub fn place_without_gpus(
    index: &Index,
    mut is_candidate: impl FnMut(&str) -> bool,
    ctx: &PlacementContext<'_>,
) -> Option<String> {
    let dist = ctx.workload;
    let mut gpus: Vec<FreeGpu> = Vec::new();
    let mut best: Option<((i64, u64), &NodeEntry)> = None;
    let mut seen: FastMap<u64, (&NodeEntry, HostAmounts, i64)> = FastMap::default();
    for node in index.entries().filter(|n| is_candidate(&n.name)) {
        let Some(host) = (ctx.hosts)(&node.name).map(|h| h.free()) else {
            continue;
        };
        if host.milli_cpu < ctx.pod.milli_cpu || host.memory < ctx.pod.memory {
            continue;
        }
        let print = fingerprint(node, Some(host));
        let known = print
            .and_then(|p| seen.get(&p))
            .filter(|(first, first_host, _)| same_state(first, Some(*first_host), node, Some(host)))
            .map(|(_, _, score)| *score);
        let score = known.unwrap_or_else(|| {
            gpus.clear();
            gpus.extend(
                node.gpus
                    .iter()
                    .map(|g| FreeGpu::new(&g.free, g.info.memory_bytes)),
            );
            let before = objective(dist, node, &gpus, Some(host));
            let after = objective(dist, node, &gpus, Some(host.minus(ctx.pod)));
            let score = score(before - after);
            if let Some(p) = print {
                seen.entry(p).or_insert((node, host, score));
            }
            score
        });
        let key = (score, name_hash(&node.name));
        if best.as_ref().is_none_or(|(k, _)| key > *k) {
            best = Some((key, node));
        }
    }
    best.map(|(_, node)| node.name.clone())
}

mod tally;
#[cfg(test)]
mod tests;
