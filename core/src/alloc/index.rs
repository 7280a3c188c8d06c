//! The controller's view of free capacity: inventory per node plus the uses of every claim,
//! updated incrementally as watch events arrive.

use std::collections::BTreeMap;
use std::ops::Bound;

use crate::enforcement::Enforcement;
use crate::sharing::Sharing;

use super::hash::FastMap;
use super::model::PodPlacement;
use super::model::{DeviceUse, GpuInfo, NodeGpus, UseKind};
use super::taint::DeviceTaint;

/// Free capacity of every GPU of every node, kept up to date from inventory and claim events.
///
/// Inventory ([`Index::upsert_node`]) and usage ([`Index::set_claim_usage`]) are independent:
/// usage of a device whose node is not (yet) known is kept and applies once the node arrives,
/// because watch events of slices and claims come in any order. Each update costs time in
/// proportion to what it changes (the node's GPUs, the claim's devices), never a rebuild.
///
/// Claims are keyed by their UID: unlike `namespace/name` it does not survive deletion and
/// re-creation, so a stale delete event can never remove a new claim's usage.
#[derive(Debug, Default, Clone)]
pub struct Index {
    nodes: Vec<NodeEntry>,
    by_name: FastMap<String, usize>,
    /// Node name -> order key: keys sort like names, so placement breaks ties by comparing
    /// integers instead of strings. Keys leave gaps so that a new node rarely renumbers.
    order: BTreeMap<String, u64>,
    /// node -> device -> usage, for known and unknown nodes alike.
    usage: FastMap<String, FastMap<String, RawUsage>>,
    claims: FastMap<String, Vec<DeviceUse>>,
}

/// How a device is used, summed over every claim that uses it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuUsage {
    /// Claims that hold the device whole (more than one means an over-commit by someone).
    pub whole_holders: u32,
    /// Slices on the device.
    pub slices: u32,
    /// Memory reserved by the slices, in bytes (saturating).
    pub slice_memory_bytes: u64,
    /// Compute percent reserved by the slices (may exceed 100 if others over-committed).
    pub slice_compute_percent: u32,
    /// Slices shared through MPS.
    pub mps_slices: u32,
    /// Slices shared by time-slicing.
    pub time_sliced_slices: u32,
    /// The sizes of the MPS slices.
    pub mps_sizes: MpsSizes,
    /// MPS slices whose class requires [`Enforcement::Server`].
    pub server_held_slices: u32,
}

/// The sizes of the MPS slices on one GPU: its MPS server holds every one of them only while
/// they have one size ([`crate::enforcement`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum MpsSizes {
    /// No MPS slice.
    #[default]
    None,
    /// Every MPS slice reserves this much memory (bytes) and compute (percent).
    One {
        /// Memory in bytes.
        memory_bytes: u64,
        /// Compute percent.
        compute_percent: u8,
    },
    /// Slices of different sizes.
    Mixed,
}

impl MpsSizes {
    fn of(sizes: &[(u64, u8)]) -> Self {
        match sizes.split_first() {
            None => MpsSizes::None,
            Some((&(memory_bytes, compute_percent), rest))
                if rest.iter().all(|&s| s == (memory_bytes, compute_percent)) =>
            {
                MpsSizes::One {
                    memory_bytes,
                    compute_percent,
                }
            }
            Some(_) => MpsSizes::Mixed,
        }
    }

    /// The sizes with one more slice of `memory_bytes` and `compute_percent`.
    pub(super) fn with(self, memory_bytes: u64, compute_percent: u8) -> Self {
        match self {
            MpsSizes::None => MpsSizes::One {
                memory_bytes,
                compute_percent,
            },
            one @ MpsSizes::One {
                memory_bytes: m,
                compute_percent: c,
            } if (m, c) == (memory_bytes, compute_percent) => one,
            _ => MpsSizes::Mixed,
        }
    }

    /// True when a slice of `memory_bytes` and `compute_percent` keeps them one size.
    pub(super) fn admits(self, memory_bytes: u64, compute_percent: u8) -> bool {
        self.with(memory_bytes, compute_percent) != MpsSizes::Mixed
    }
}

impl GpuUsage {
    /// True when no claim uses the device.
    pub fn is_idle(&self) -> bool {
        self.whole_holders == 0 && self.slices == 0
    }
}

/// Exact sums, so that removing a use always undoes adding it.
#[derive(Debug, Clone, Default)]
struct RawUsage {
    whole: u32,
    slices: u32,
    memory: u128,
    compute: u64,
    mps: u32,
    time_sliced: u32,
    /// `(memory, compute)` of every MPS slice, one entry per use.
    mps_sizes: Vec<(u64, u8)>,
    server_held: u32,
    /// Keys of the claims using the device, one entry per use.
    holders: Vec<String>,
}

impl RawUsage {
    fn summary(&self) -> GpuUsage {
        GpuUsage {
            whole_holders: self.whole,
            slices: self.slices,
            slice_memory_bytes: u64::try_from(self.memory).unwrap_or(u64::MAX),
            slice_compute_percent: u32::try_from(self.compute).unwrap_or(u32::MAX),
            mps_slices: self.mps,
            time_sliced_slices: self.time_sliced,
            mps_sizes: MpsSizes::of(&self.mps_sizes),
            server_held_slices: self.server_held,
        }
    }

    fn add(&mut self, kind: UseKind, enforcement: Enforcement, claim: &str) {
        match kind {
            UseKind::Whole => self.whole += 1,
            UseKind::Slice {
                memory_bytes,
                compute_percent,
                sharing,
            } => {
                self.slices += 1;
                self.memory += u128::from(memory_bytes);
                self.compute += u64::from(compute_percent);
                if let Some(count) = self.strategy_count(sharing) {
                    *count += 1;
                }
                if sharing == Sharing::Mps {
                    self.mps_sizes.push((memory_bytes, compute_percent));
                    self.server_held += u32::from(enforcement == Enforcement::Server);
                }
            }
        }
        self.holders.push(claim.to_owned());
    }

    fn remove(&mut self, kind: UseKind, enforcement: Enforcement, claim: &str) {
        match kind {
            UseKind::Whole => self.whole = self.whole.saturating_sub(1),
            UseKind::Slice {
                memory_bytes,
                compute_percent,
                sharing,
            } => {
                self.slices = self.slices.saturating_sub(1);
                self.memory = self.memory.saturating_sub(u128::from(memory_bytes));
                self.compute = self.compute.saturating_sub(u64::from(compute_percent));
                if let Some(count) = self.strategy_count(sharing) {
                    *count = count.saturating_sub(1);
                }
                if sharing == Sharing::Mps {
                    let size = (memory_bytes, compute_percent);
                    if let Some(at) = self.mps_sizes.iter().position(|&s| s == size) {
                        self.mps_sizes.swap_remove(at);
                    }
                    if enforcement == Enforcement::Server {
                        self.server_held = self.server_held.saturating_sub(1);
                    }
                }
            }
        }
        if let Some(at) = self.holders.iter().position(|h| h == claim) {
            self.holders.swap_remove(at);
        }
    }

    fn is_empty(&self) -> bool {
        self.whole == 0 && self.slices == 0 && self.holders.is_empty()
    }

    /// The count of slices of a strategy that excludes another; exclusive-sharing slices
    /// (accounting only) constrain nothing and are not counted.
    fn strategy_count(&mut self, sharing: Sharing) -> Option<&mut u32> {
        match sharing {
            Sharing::Mps => Some(&mut self.mps),
            Sharing::TimeSlicing => Some(&mut self.time_sliced),
            Sharing::Exclusive => None,
        }
    }
}

/// One node as placement sees it.
#[derive(Debug, Clone)]
pub(super) struct NodeEntry {
    pub(super) name: String,
    /// Sorts like `name` among the index's nodes.
    pub(super) order: u64,
    /// Sorted by device name.
    pub(super) gpus: Vec<GpuEntry>,
    pub(super) agg: NodeAggregates,
}

/// One GPU with its usage and what is left of it.
#[derive(Debug, Clone)]
pub(super) struct GpuEntry {
    pub(super) info: GpuInfo,
    /// Dense id of the NVLink domain within the node (ids follow domain name order).
    pub(super) nvlink: Option<u16>,
    /// Dense id of the PCIe root within the node (ids follow root name order).
    pub(super) pcie: Option<u16>,
    pub(super) usage: GpuUsage,
    pub(super) free: GpuFree,
    /// Carries a taint that keeps it from requests that do not tolerate it: only then does
    /// placement look at the taints.
    pub(super) blocking_taints: bool,
}

/// What is left of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GpuFree {
    pub(super) memory: u64,
    pub(super) compute: u8,
    pub(super) slices: u32,
    /// Held whole by some claim: nothing else fits.
    pub(super) whole_held: bool,
    /// Used by no claim: a whole-GPU request fits.
    pub(super) idle: bool,
    /// Carries MPS slices: a time-sliced slice does not fit.
    pub(super) mps: bool,
    /// Carries time-sliced slices: an MPS slice does not fit.
    pub(super) time_sliced: bool,
    /// The sizes of its MPS slices.
    pub(super) mps_sizes: MpsSizes,
    /// Carries an MPS slice whose class requires the server to hold it: only MPS slices of
    /// its size fit.
    pub(super) server_held: bool,
}

/// Per-node figures that let placement skip nodes without looking at their GPUs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct NodeAggregates {
    /// GPUs used by no claim.
    pub(super) idle_gpus: u32,
    /// GPUs not held whole.
    pub(super) open_gpus: u32,
    pub(super) max_free_memory: u64,
    pub(super) max_free_compute: u8,
    /// Sum of [`free_permille`] over the node's GPUs.
    pub(super) free_score: u64,
    pub(super) min_total_memory: u64,
    pub(super) max_total_memory: u64,
    /// GPUs in the largest NVLink domain / behind the busiest PCIe root.
    pub(super) max_nvlink_group: u32,
    pub(super) max_pcie_group: u32,
}

/// Free capacity of a GPU on one scale for both resources: memory and compute each count
/// 0–1000, so an idle GPU scores 2000 whatever its size.
pub(super) fn free_permille(free_memory: u64, free_compute: u8, total_memory: u64) -> u64 {
    let memory = if total_memory == 0 {
        0
    } else {
        per_mille(free_memory, total_memory)
    };
    memory + u64::from(free_compute) * 10
}

/// `part * 1000 / whole`, capped at 1000; u128 only for parts beyond 18 PB, since 128-bit
/// division is slow and this runs for every GPU considered.
pub(super) fn per_mille(part: u64, whole: u64) -> u64 {
    let share = match part.checked_mul(1000) {
        Some(scaled) => scaled / whole,
        None => u64::try_from(u128::from(part) * 1000 / u128::from(whole)).unwrap_or(1000),
    };
    share.min(1000)
}

impl GpuFree {
    fn of(total_memory: u64, usage: GpuUsage) -> Self {
        if usage.whole_holders > 0 {
            return GpuFree {
                memory: 0,
                compute: 0,
                slices: usage.slices,
                whole_held: true,
                idle: false,
                mps: usage.mps_slices > 0,
                time_sliced: usage.time_sliced_slices > 0,
                mps_sizes: usage.mps_sizes,
                server_held: usage.server_held_slices > 0,
            };
        }
        let used_compute = u8::try_from(usage.slice_compute_percent.min(100)).unwrap_or(100);
        GpuFree {
            memory: total_memory.saturating_sub(usage.slice_memory_bytes),
            compute: 100 - used_compute,
            slices: usage.slices,
            whole_held: false,
            idle: usage.slices == 0,
            mps: usage.mps_slices > 0,
            time_sliced: usage.time_sliced_slices > 0,
            mps_sizes: usage.mps_sizes,
            server_held: usage.server_held_slices > 0,
        }
    }
}

impl NodeEntry {
    fn new(node: NodeGpus, usage: Option<&FastMap<String, RawUsage>>) -> Self {
        let mut gpus = node.gpus;
        gpus.sort_by(|a, b| a.device.cmp(&b.device));
        // Two devices of one name cannot both be addressed by an allocation; keep the first.
        gpus.dedup_by(|later, earlier| later.device == earlier.device);
        let groups: Vec<(Option<u16>, Option<u16>)> = {
            let nvlink_ids = dense_ids(gpus.iter().map(|g| g.nvlink_domain.as_deref()));
            let pcie_ids = dense_ids(gpus.iter().map(|g| g.pcie_root.as_deref()));
            gpus.iter()
                .map(|g| {
                    (
                        id_of(&nvlink_ids, g.nvlink_domain.as_deref()),
                        id_of(&pcie_ids, g.pcie_root.as_deref()),
                    )
                })
                .collect()
        };
        let gpus = gpus
            .into_iter()
            .zip(groups)
            .map(|(info, (nvlink, pcie))| {
                let usage = usage
                    .and_then(|u| u.get(&info.device))
                    .map(RawUsage::summary)
                    .unwrap_or_default();
                GpuEntry {
                    free: GpuFree::of(info.memory_bytes, usage),
                    blocking_taints: info.taints.iter().any(DeviceTaint::blocks_allocation),
                    info,
                    nvlink,
                    pcie,
                    usage,
                }
            })
            .collect();
        let mut entry = NodeEntry {
            name: node.node,
            order: 0,
            gpus,
            agg: NodeAggregates::default(),
        };
        entry.refresh_aggregates();
        entry
    }

    fn refresh_usage(&mut self, usage: Option<&FastMap<String, RawUsage>>) {
        for gpu in &mut self.gpus {
            gpu.usage = usage
                .and_then(|u| u.get(&gpu.info.device))
                .map(RawUsage::summary)
                .unwrap_or_default();
            gpu.free = GpuFree::of(gpu.info.memory_bytes, gpu.usage);
        }
        self.refresh_aggregates();
    }

    fn refresh_aggregates(&mut self) {
        let mut agg = NodeAggregates {
            min_total_memory: u64::MAX,
            ..NodeAggregates::default()
        };
        for gpu in &self.gpus {
            let free = gpu.free;
            agg.idle_gpus += u32::from(free.idle);
            agg.open_gpus += u32::from(!free.whole_held);
            agg.max_free_memory = agg.max_free_memory.max(free.memory);
            agg.max_free_compute = agg.max_free_compute.max(free.compute);
            agg.free_score += free_permille(free.memory, free.compute, gpu.info.memory_bytes);
            agg.min_total_memory = agg.min_total_memory.min(gpu.info.memory_bytes);
            agg.max_total_memory = agg.max_total_memory.max(gpu.info.memory_bytes);
        }
        if self.gpus.is_empty() {
            agg.min_total_memory = 0;
        }
        agg.max_nvlink_group = largest_group(self.gpus.iter().map(|g| g.nvlink));
        agg.max_pcie_group = largest_group(self.gpus.iter().map(|g| g.pcie));
        self.agg = agg;
    }
}

fn dense_ids<'a>(names: impl Iterator<Item = Option<&'a str>>) -> Vec<&'a str> {
    let mut names: Vec<&str> = names.flatten().collect();
    names.sort_unstable();
    names.dedup();
    names
}

fn id_of(ids: &[&str], name: Option<&str>) -> Option<u16> {
    let at = ids.binary_search(&name?).ok()?;
    u16::try_from(at).ok()
}

fn largest_group(ids: impl Iterator<Item = Option<u16>>) -> u32 {
    let mut counts: Vec<u32> = Vec::new();
    for id in ids.flatten() {
        let id = usize::from(id);
        if counts.len() <= id {
            counts.resize(id + 1, 0);
        }
        counts[id] += 1;
    }
    counts.into_iter().max().unwrap_or(0)
}

impl Index {
    /// An empty index.
    pub fn new() -> Self {
        Index::default()
    }

    /// Adds a node or replaces its GPUs (usage recorded for its devices applies at once).
    pub fn upsert_node(&mut self, node: NodeGpus) {
        let usage = self.usage.get(node.node.as_str());
        let mut entry = NodeEntry::new(node, usage);
        if let Some(&slot) = self.by_name.get(&entry.name) {
            entry.order = self.nodes[slot].order;
            self.nodes[slot] = entry;
        } else {
            let name = entry.name.clone();
            self.by_name.insert(name.clone(), self.nodes.len());
            self.nodes.push(entry);
            self.assign_order(name);
        }
    }

    /// Removes a node's inventory; returns whether it was known. Usage of its devices is kept
    /// (the claims still exist) and applies again if the node comes back.
    pub fn remove_node(&mut self, name: &str) -> bool {
        let Some(slot) = self.by_name.remove(name) else {
            return false;
        };
        self.order.remove(name);
        self.nodes.swap_remove(slot);
        if let Some(moved) = self.nodes.get(slot) {
            self.by_name.insert(moved.name.clone(), slot);
        }
        true
    }

    /// Sets the devices claim `claim_key` (its UID) holds, replacing what it held before.
    /// An empty list is the same as [`Index::remove_claim`]. Idempotent.
    pub fn set_claim_usage(&mut self, claim_key: &str, uses: Vec<DeviceUse>) {
        let old = self.claims.remove(claim_key).unwrap_or_default();
        if old == uses {
            if !uses.is_empty() {
                self.claims.insert(claim_key.to_owned(), uses);
            }
            return;
        }
        for device in &old {
            self.remove_use(device, claim_key);
        }
        for device in &uses {
            self.add_use(device, claim_key);
        }
        let mut touched: Vec<&str> = old.iter().chain(&uses).map(|u| u.node.as_str()).collect();
        touched.sort_unstable();
        touched.dedup();
        for node in touched {
            if let Some(&slot) = self.by_name.get(node) {
                self.nodes[slot].refresh_usage(self.usage.get(node));
            }
        }
        if !uses.is_empty() {
            self.claims.insert(claim_key.to_owned(), uses);
        }
    }

    /// Forgets everything claim `claim_key` held; returns whether it held anything.
    pub fn remove_claim(&mut self, claim_key: &str) -> bool {
        let held = self.claims.contains_key(claim_key);
        self.set_claim_usage(claim_key, Vec::new());
        held
    }

    /// Records a placement as the usage of its claims (before the write is confirmed, so that
    /// the next decision does not reuse the same capacity). A watch event that later reports
    /// the same usage changes nothing. Admin-access devices use nothing.
    pub fn apply(&mut self, placement: &PodPlacement) {
        for claim in &placement.claims {
            self.set_claim_usage(&claim.key, placement.claim_uses(claim));
        }
    }

    /// The devices a claim holds, as last set.
    pub fn claim_uses(&self, claim_key: &str) -> Option<&[DeviceUse]> {
        self.claims.get(claim_key).map(Vec::as_slice)
    }

    /// Keys of the claims that use a device (one entry per use), known node or not.
    pub fn claims_using(&self, node: &str, device: &str) -> impl Iterator<Item = &str> {
        self.usage
            .get(node)
            .and_then(|devices| devices.get(device))
            .into_iter()
            .flat_map(|u| u.holders.iter().map(String::as_str))
    }

    /// Usage of a device, known node or not.
    pub fn gpu_usage(&self, node: &str, device: &str) -> GpuUsage {
        self.usage
            .get(node)
            .and_then(|devices| devices.get(device))
            .map(RawUsage::summary)
            .unwrap_or_default()
    }

    /// A node's inventory and free capacity.
    pub fn node(&self, name: &str) -> Option<NodeView<'_>> {
        self.entry(name).map(|entry| NodeView { entry })
    }

    /// Every known node, in no particular order.
    pub fn nodes(&self) -> impl Iterator<Item = NodeView<'_>> {
        self.nodes.iter().map(|entry| NodeView { entry })
    }

    /// Number of known nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when no node is known.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Number of claims that hold something.
    pub fn claim_count(&self) -> usize {
        self.claims.len()
    }

    /// Gives a new node an order key between its neighbours by name, renumbering every node
    /// when there is no room left.
    fn assign_order(&mut self, name: String) {
        const SPACING: u64 = 1 << 32;
        let key: &str = &name;
        let before = self
            .order
            .range::<str, _>((Bound::Unbounded, Bound::Excluded(key)))
            .next_back()
            .map(|(_, k)| *k);
        let after = self
            .order
            .range::<str, _>((Bound::Excluded(key), Bound::Unbounded))
            .next()
            .map(|(_, k)| *k);
        let key = match (before, after) {
            (None, None) => Some(u64::MAX / 2),
            (Some(low), None) => low.checked_add(SPACING),
            (None, Some(high)) => high
                .checked_sub(SPACING)
                .or((high >= 2).then_some(high / 2)),
            (Some(low), Some(high)) => (high - low >= 2).then_some(low + (high - low) / 2),
        };
        let slot = self.by_name.get(&name).copied();
        if let Some(key) = key {
            if let Some(slot) = slot {
                self.nodes[slot].order = key;
            }
            self.order.insert(name, key);
        } else {
            self.order.insert(name, 0);
            self.renumber();
        }
    }

    fn renumber(&mut self) {
        const SPACING: u64 = 1 << 32;
        let mut key = SPACING;
        for (name, order) in &mut self.order {
            *order = key;
            key = key.saturating_add(SPACING);
            if let Some(&slot) = self.by_name.get(name) {
                self.nodes[slot].order = *order;
            }
        }
    }

    pub(super) fn entries(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.iter()
    }

    pub(super) fn entry(&self, name: &str) -> Option<&NodeEntry> {
        self.by_name.get(name).map(|&slot| &self.nodes[slot])
    }

    fn add_use(&mut self, device: &DeviceUse, claim: &str) {
        self.usage
            .entry(device.node.clone())
            .or_default()
            .entry(device.device.clone())
            .or_default()
            .add(device.kind, device.enforcement, claim);
    }

    fn remove_use(&mut self, device: &DeviceUse, claim: &str) {
        let Some(devices) = self.usage.get_mut(&device.node) else {
            return;
        };
        if let Some(usage) = devices.get_mut(&device.device) {
            usage.remove(device.kind, device.enforcement, claim);
            if usage.is_empty() {
                devices.remove(&device.device);
            }
        }
        if devices.is_empty() {
            self.usage.remove(&device.node);
        }
    }
}

/// A node of the [`Index`].
#[derive(Debug, Clone, Copy)]
pub struct NodeView<'a> {
    entry: &'a NodeEntry,
}

impl<'a> NodeView<'a> {
    /// The node name.
    pub fn name(&self) -> &'a str {
        &self.entry.name
    }

    /// The node's GPUs, by device name.
    pub fn gpus(&self) -> impl Iterator<Item = GpuView<'a>> + use<'a> {
        self.entry.gpus.iter().map(|gpu| GpuView { gpu })
    }

    /// GPUs that no claim uses.
    pub fn idle_gpus(&self) -> u32 {
        self.entry.agg.idle_gpus
    }
}

/// A GPU of a node of the [`Index`].
#[derive(Debug, Clone, Copy)]
pub struct GpuView<'a> {
    gpu: &'a GpuEntry,
}

impl<'a> GpuView<'a> {
    /// What the inventory says about the GPU.
    pub fn info(&self) -> &'a GpuInfo {
        &self.gpu.info
    }

    /// How it is used.
    pub fn usage(&self) -> GpuUsage {
        self.gpu.usage
    }

    /// Memory not reserved by anyone (0 when the GPU is held whole).
    pub fn free_memory_bytes(&self) -> u64 {
        self.gpu.free.memory
    }

    /// Compute percent not reserved by anyone (0 when the GPU is held whole).
    pub fn free_compute_percent(&self) -> u8 {
        self.gpu.free.compute
    }

    /// True when no claim uses the GPU.
    pub fn is_idle(&self) -> bool {
        self.gpu.free.idle
    }

    /// True when some claim holds the GPU whole.
    pub fn is_held_whole(&self) -> bool {
        self.gpu.free.whole_held
    }
}
