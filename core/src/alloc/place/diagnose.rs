//! Why a pod fits no node: the candidate that came closest (most requests placed, then most
//! GPUs fitting the failing request, then most matching it), found without diagnosing every
//! node, and the message naming what kept its GPUs out.

use std::cmp::Reverse;

use crate::sharing::Sharing;

use super::super::index::{GpuEntry, GpuFree, NodeEntry};
use super::super::request::{DeviceRequest, GpuSelector, SliceSize, TopologyScope};
use super::super::taint::{DeviceTaint, untolerated};
use super::super::unplaceable::{BestCandidate, Unplaceable, UnplaceableReason};
use super::pick::{Scratch, choose, sharing_conflicts, size_conflicts, take};
use super::{Flat, Plan};

/// Why one node could not take the pod.
pub(super) struct Diagnosis<'a> {
    pub(super) node: &'a str,
    /// Requests placed before the failing one.
    placed: usize,
    /// GPUs that fit the failing request completely, topology included.
    together: u32,
    /// GPUs that match its selector.
    matching: u32,
    /// The figure the message reports: `matching` for a selector failure, else `together`.
    pub(super) found: u32,
    pub(super) kind: UnplaceableReason,
    /// Index of the failing request in the plan's placement order (equal to `placed`).
    pub(super) flat: usize,
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
    /// MPS slices of another size on a GPU whose server holds its slices.
    slice_size: u32,
    memory: u32,
    compute: u32,
    tainted: u32,
}

impl Diagnosis<'_> {
    /// Higher came closer: more requests placed, then more GPUs that fit the failing one,
    /// then more that match its selector.
    pub(super) fn rank(&self) -> (usize, u32, u32) {
        (self.placed, self.together, self.matching)
    }
}

impl Plan<'_> {
    pub(super) fn explain(&self, mut nodes: Vec<&NodeEntry>, asked: usize) -> Unplaceable {
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
    pub(super) fn closest<'n>(&self, nodes: Vec<&'n NodeEntry>) -> Option<Diagnosis<'n>> {
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
    pub(super) fn closest_exhaustive<'n>(
        &self,
        nodes: Vec<&'n NodeEntry>,
    ) -> Option<Diagnosis<'n>> {
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
        if fits_or_counts(req, gpu, &slot.free, &mut blockers, &mut taint) {
            fitting += 1;
            fitting_nvlink.extend(gpu.nvlink);
            fitting_pcie.extend(gpu.pcie);
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

/// True when the matching `gpu` (free as `free`) fits `req`; else counts what keeps it out
/// in `blockers` (and notes the first untolerated taint in `taint`).
fn fits_or_counts<'n>(
    req: &DeviceRequest,
    gpu: &'n GpuEntry,
    free: &GpuFree,
    blockers: &mut Blockers,
    taint: &mut Option<(&'n str, &'n DeviceTaint)>,
) -> bool {
    let untolerated = gpu
        .blocking_taints
        .then(|| untolerated(&gpu.info.taints, &req.tolerations))
        .flatten();
    match req.slice {
        _ if untolerated.is_some() => {
            blockers.tainted += 1;
            *taint = taint.or(untolerated.map(|t| (gpu.info.device.as_str(), t)));
        }
        _ if req.admin_access => return true,
        None if !free.idle => blockers.in_use += 1,
        Some(_) if free.whole_held => blockers.in_use += 1,
        Some(_) if req.max_slices_per_gpu.is_some_and(|max| free.slices >= max) => {
            blockers.max_slices += 1;
        }
        Some(_) if sharing_conflicts(req.sharing, free) => blockers.sharing += 1,
        Some(size) if size_conflicts(req, size, free) => blockers.slice_size += 1,
        Some(size) if free.memory < size.memory_bytes => blockers.memory += 1,
        Some(size) if free.compute < size.compute_percent => blockers.compute += 1,
        _ => return true,
    }
    false
}

impl Blockers {
    /// The constraint that kept the most matching GPUs out (in this order on ties).
    fn dominant(&self) -> UnplaceableReason {
        let ranked = [
            (self.in_use, UnplaceableReason::InUse),
            (self.max_slices, UnplaceableReason::MaxSlices),
            (
                self.sharing + self.slice_size,
                UnplaceableReason::SharingConflict,
            ),
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
    if b.slice_size > 0 {
        parts.push(format!(
            "{} carrying MPS slices of another size held by their MPS server (enforcement Server)",
            b.slice_size
        ));
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
fn format_bytes(bytes: u64) -> String {
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
