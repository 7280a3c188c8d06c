//! What `kerf status` shows, built from one [`Snapshot`] of the API: the devices of kerf's
//! current ResourceSlices and the claims allocated on them, and the GPU fragmentation of each
//! node pool ([`super::pools`]). Also the `-o json` document, whose shape is documented in the
//! parent module.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourceClaim, ResourceSlice};
use kerf_api::controller_claims::ALLOCATED_NODE_ANNOTATION;
use kerf_api::inventory_view::InventoryView;
use kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL;
use kerf_api::ownership::{self, Owner};
use kerf_api::resourceslice::taints::unhealthy_taint_key;
use kerf_api::resourceslice::{TYPE_MIG, attributes, device_attribute, device_memory_bytes};
use kerf_core::alloc::UseKind;
use serde::Serialize;

/// Version of the JSON document; raised when a field changes meaning or goes away (new
/// fields may appear without a raise).
pub const JSON_VERSION: u32 = 1;

/// The objects `kerf status` reads: all ResourceSlices and ResourceClaims it may see, the
/// GpuQuotas and the Nodes.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// ResourceSlices (of every driver: those of other drivers are ignored).
    pub slices: Vec<ResourceSlice>,
    /// ResourceClaims of every namespace.
    pub claims: Vec<ResourceClaim>,
    /// GpuQuotas of every namespace (none where the CRD is not installed).
    pub quotas: Vec<kerf_api::gpuquota::GpuQuota>,
    /// Nodes, for their pool label (fetched as metadata only: nothing else is read).
    pub nodes: Vec<Node>,
    /// Why the Nodes could not be listed (pools are then not shown); `None` when they were.
    pub nodes_problem: Option<String>,
}

/// Every kerf GPU of the cluster, per node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// [`JSON_VERSION`].
    pub version: u32,
    /// The DRA driver whose devices these are.
    pub driver: String,
    /// Nodes with a pool of the driver, by name.
    pub nodes: Vec<NodeStatus>,
    /// Claims allocated on devices no current slice lists (a node gone, a device removed).
    pub unmatched_claims: Vec<UnmatchedClaim>,
    /// GpuQuotas, by namespace and name.
    pub quotas: Vec<super::quotas::QuotaStatus>,
    /// The node label that names a node's pool.
    pub pool_label: String,
    /// GPU fragmentation per node pool, by pool name; `None` when the Nodes could not be
    /// listed.
    pub pools: Option<Vec<super::pools::PoolFragmentation>>,
    /// Why `pools` is `None`.
    pub pools_problem: Option<String>,
}

/// One node's pool and devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Node name.
    pub node: String,
    /// The node's pool (kerf publishes one per node).
    pub pool: Pool,
    /// Whole GPUs, by device name.
    pub gpus: Vec<GpuStatus>,
    /// MIG devices, by device name.
    pub mig_devices: Vec<MigStatus>,
    /// Published devices that could not be read, and why.
    pub unreadable: Vec<Unreadable>,
}

/// A ResourceSlice pool as last published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    /// Pool name.
    pub name: String,
    /// The newest `pool.generation`; slices of older generations are ignored.
    pub generation: i64,
    /// Slices of that generation seen.
    pub slices: usize,
    /// `pool.resourceSliceCount`: more than `slices` while a republish is in progress.
    pub expected_slices: i64,
}

/// A whole GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// Device name, e.g. `gpu-0`.
    pub device: String,
    /// NVML UUID.
    pub uuid: String,
    /// Product name.
    pub product: String,
    /// Who may allocate it (the `allocator` attribute); `null` while no owner is recorded.
    pub owner: Option<Owner>,
    /// Memory held by claims.
    pub memory: Memory,
    /// Compute held by claims, in percent of the multiprocessors.
    pub compute: Compute,
    /// Health, from the device taints.
    pub health: Health,
    /// Claims allocated on it.
    pub claims: Vec<ClaimOnDevice>,
}

/// A MIG device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigStatus {
    /// Device name, e.g. `gpu-0-mig-1g-5gb-6`.
    pub device: String,
    /// MIG UUID.
    pub uuid: String,
    /// MIG profile, e.g. `1g.5gb`.
    pub profile: String,
    /// UUID of the parent GPU.
    pub parent_uuid: String,
    /// Product name of the parent GPU.
    pub product: String,
    /// Who may allocate it; `null` while no owner is recorded.
    pub owner: Option<Owner>,
    /// Memory, all of it used while a claim holds the device.
    pub memory: Memory,
    /// Health, from the device taints.
    pub health: Health,
    /// Claims allocated on it.
    pub claims: Vec<ClaimOnDevice>,
}

/// Memory of a device in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Memory {
    /// Capacity (`totalBytes`).
    #[serde(rename = "totalBytes")]
    pub total: u64,
    /// Held by claims (`usedBytes`; a whole-device claim holds all of it).
    #[serde(rename = "usedBytes")]
    pub used: u64,
    /// `total - used` (`freeBytes`).
    #[serde(rename = "freeBytes")]
    pub free: u64,
}

/// Compute of a device in percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Compute {
    /// Held by claims, at most 100 (a whole-device claim holds 100).
    pub used_percent: u8,
    /// `100 - used_percent`.
    pub free_percent: u8,
}

/// A device's health as its taints tell it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Health {
    /// False when the device carries the `<driver>/unhealthy` taint.
    pub healthy: bool,
    /// Every taint of the device.
    pub taints: Vec<Taint>,
}

/// A device taint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    /// Key, e.g. `gpu.kerf.dev/unhealthy`.
    pub key: String,
    /// Value (the fault, e.g. `xid-79`); empty when none.
    pub value: String,
    /// Effect: `NoSchedule`, `NoExecute` or `None`.
    pub effect: String,
}

/// A claim's hold on one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimOnDevice {
    /// Claim namespace.
    pub namespace: String,
    /// Claim name.
    pub name: String,
    /// Pods the claim is reserved for (`status.reservedFor`), same namespace.
    pub pods: Vec<String>,
    /// What it holds of the device.
    pub size: Size,
    /// Who allocated the claim.
    pub allocator: ClaimAllocator,
    /// Who holds the slice's limits, as the kubelet plugin reported at prepare
    /// (`status.devices[].data.limitsHeldBy`); `None` before the prepare, or without the
    /// report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits_held_by: Option<LimitsHeldBy>,
}

/// Who holds a prepared slice's memory and compute limits: `hardware`, `server`,
/// `client environment` or `none` (see `kerf_core::enforcement`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LimitsHeldBy {
    /// The memory limit's holder.
    pub memory: String,
    /// The compute limit's holder.
    pub compute: String,
}

/// What the plugin reported on holding the limits of `claim`'s `device` in `pool`.
fn limits_held_by(
    claim: &ResourceClaim,
    driver: &str,
    pool: &str,
    device: &str,
) -> Option<LimitsHeldBy> {
    let entry = claim
        .status
        .as_ref()?
        .devices
        .as_ref()?
        .iter()
        .find(|d| d.driver == driver && d.pool == pool && d.device == device)?;
    let held = entry.data.as_ref()?.0.get("limitsHeldBy")?;
    Some(LimitsHeldBy {
        memory: held.get("memory")?.as_str()?.to_owned(),
        compute: held.get("compute")?.as_str()?.to_owned(),
    })
}

/// What a claim holds of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(
    tag = "kind",
    rename_all = "camelCase",
    rename_all_fields = "camelCase"
)]
pub enum Size {
    /// All of it.
    Whole,
    /// A slice: reserved memory and compute (zero: not reserved) and how the GPU is shared.
    Slice {
        /// Reserved memory in bytes.
        memory_bytes: u64,
        /// Reserved compute in percent.
        compute_percent: u8,
        /// `Exclusive`, `MPS` or `TimeSlicing`.
        sharing: &'static str,
    },
}

/// Who allocated a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimAllocator {
    /// kerf-controller (the claim carries its `gpu.kerf.dev/allocated-node` annotation).
    KerfController,
    /// kube-scheduler.
    KubeScheduler,
}

impl ClaimAllocator {
    /// `kerf-controller` or `kube-scheduler`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimAllocator::KerfController => "kerf-controller",
            ClaimAllocator::KubeScheduler => "kube-scheduler",
        }
    }
}

/// A published device `kerf status` could not read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Unreadable {
    /// Device name.
    pub device: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A claim allocated on a device that no current slice lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnmatchedClaim {
    /// Node (pool) of the allocation result.
    pub node: String,
    /// Device of the allocation result.
    pub device: String,
    /// The claim.
    pub claim: ClaimOnDevice,
}

/// Claims per (node, device).
type ClaimsByDevice = BTreeMap<(String, String), Vec<(ClaimOnDevice, UseKind)>>;

impl Status {
    /// The status of `driver`'s devices in `snapshot`, node pools named by
    /// [`DEFAULT_NODE_POOL_LABEL`].
    pub fn new(snapshot: &Snapshot, driver: &str) -> Status {
        Status::with_pool_label(snapshot, driver, DEFAULT_NODE_POOL_LABEL)
    }

    /// The status of `driver`'s devices in `snapshot`, node pools named by the node label
    /// `pool_label`.
    pub fn with_pool_label(snapshot: &Snapshot, driver: &str, pool_label: &str) -> Status {
        let mut claims = claims_by_device(&snapshot.claims, driver);
        let view = kerf_api::inventory_view(&snapshot.slices, driver);
        let mut nodes: BTreeMap<String, NodeStatus> = BTreeMap::new();
        for slice in current_slices(&snapshot.slices, driver) {
            let Some(node_name) = slice.spec.node_name.as_deref().filter(|n| !n.is_empty()) else {
                continue;
            };
            let node = nodes
                .entry(node_name.to_owned())
                .or_insert_with(|| NodeStatus::empty(node_name, slice));
            node.pool.slices += 1;
            for device in slice.spec.devices.iter().flatten() {
                let held = claims
                    .remove(&(node_name.to_owned(), device.name.clone()))
                    .unwrap_or_default();
                node.add_device(device, driver, &view, held);
            }
        }
        let pools = super::pools::pools(snapshot, &view, driver, pool_label);
        for skipped in view.skipped {
            if let Some(node) = nodes.values_mut().find(|n| n.pool.name == skipped.pool) {
                node.unreadable.push(Unreadable {
                    device: skipped.device,
                    reason: skipped.reason,
                });
            }
        }
        for node in nodes.values_mut() {
            node.gpus.sort_by(|a, b| a.device.cmp(&b.device));
            node.mig_devices.sort_by(|a, b| a.device.cmp(&b.device));
        }
        Status {
            version: JSON_VERSION,
            driver: driver.to_owned(),
            nodes: nodes.into_values().collect(),
            unmatched_claims: unmatched(claims),
            quotas: super::quotas::quotas(&snapshot.quotas),
            pool_label: pool_label.to_owned(),
            pools,
            pools_problem: snapshot.nodes_problem.clone(),
        }
    }
}

impl NodeStatus {
    /// A node with no devices yet, its pool as `slice` names it.
    fn empty(node: &str, slice: &ResourceSlice) -> NodeStatus {
        NodeStatus {
            node: node.to_owned(),
            pool: Pool {
                name: slice.spec.pool.name.clone(),
                generation: slice.spec.pool.generation,
                slices: 0,
                expected_slices: slice.spec.pool.resource_slice_count,
            },
            gpus: Vec::new(),
            mig_devices: Vec::new(),
            unreadable: Vec::new(),
        }
    }

    /// Adds `device` of one of this node's slices, with the claims `held` on it: a MIG device,
    /// or a GPU as the inventory view read it (a device the view skipped is listed under
    /// `unreadable` instead).
    fn add_device(
        &mut self,
        device: &Device,
        driver: &str,
        view: &InventoryView,
        held: Vec<(ClaimOnDevice, UseKind)>,
    ) {
        let is_mig = device_attribute(device, driver, attributes::TYPE)
            .and_then(|a| a.string.as_deref())
            == Some(TYPE_MIG);
        if is_mig {
            self.mig_devices.push(mig_status(device, driver, held));
            return;
        }
        let info = view
            .nodes
            .get(&self.node)
            .and_then(|n| n.gpus.iter().find(|g| g.device == device.name));
        if let Some(info) = info {
            self.gpus.push(GpuStatus {
                device: info.device.clone(),
                uuid: info.uuid.clone(),
                product: info.product.clone(),
                owner: ownership::published_owner(device, driver),
                memory: memory(info.memory_bytes, &held),
                compute: compute(&held),
                health: health(device, driver),
                claims: held.into_iter().map(|(claim, _)| claim).collect(),
            });
        }
    }
}

/// The claims left in `claims` once every device was matched: on devices no slice lists.
fn unmatched(claims: ClaimsByDevice) -> Vec<UnmatchedClaim> {
    claims
        .into_iter()
        .flat_map(|((node, device), held)| {
            held.into_iter().map(move |(claim, _)| UnmatchedClaim {
                node: node.clone(),
                device: device.clone(),
                claim,
            })
        })
        .collect()
}

/// `driver`'s slices of each pool's newest generation, by name (older generations are left
/// over from a republish in progress, as [`kerf_api::inventory_view`] treats them).
fn current_slices<'a>(slices: &'a [ResourceSlice], driver: &str) -> Vec<&'a ResourceSlice> {
    let ours: Vec<&ResourceSlice> = slices.iter().filter(|s| s.spec.driver == driver).collect();
    let mut newest: BTreeMap<&str, i64> = BTreeMap::new();
    for slice in &ours {
        let generation = newest.entry(&slice.spec.pool.name).or_insert(i64::MIN);
        *generation = (*generation).max(slice.spec.pool.generation);
    }
    let mut current: Vec<&ResourceSlice> = ours
        .into_iter()
        .filter(|s| newest.get(s.spec.pool.name.as_str()) == Some(&s.spec.pool.generation))
        .collect();
    current.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    current
}

/// What every allocated claim holds, per device, through [`kerf_api::device_uses`].
fn claims_by_device(claims: &[ResourceClaim], driver: &str) -> ClaimsByDevice {
    let mut by_device = ClaimsByDevice::new();
    let mut sorted: Vec<&ResourceClaim> = claims.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    for claim in sorted {
        let allocator = if claim
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(ALLOCATED_NODE_ANNOTATION))
        {
            ClaimAllocator::KerfController
        } else {
            ClaimAllocator::KubeScheduler
        };
        let pods: Vec<String> = claim
            .status
            .as_ref()
            .and_then(|s| s.reserved_for.as_ref())
            .into_iter()
            .flatten()
            .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
            .map(|r| r.name.clone())
            .collect();
        for used in kerf_api::device_uses(claim, driver) {
            let entry = ClaimOnDevice {
                namespace: claim.metadata.namespace.clone().unwrap_or_default(),
                name: claim.metadata.name.clone().unwrap_or_default(),
                pods: pods.clone(),
                size: match used.kind {
                    UseKind::Whole => Size::Whole,
                    UseKind::Slice {
                        memory_bytes,
                        compute_percent,
                        sharing,
                    } => Size::Slice {
                        memory_bytes,
                        compute_percent,
                        sharing: sharing.as_str(),
                    },
                },
                allocator,
                limits_held_by: limits_held_by(claim, driver, &used.node, &used.device),
            };
            by_device
                .entry((used.node, used.device))
                .or_default()
                .push((entry, used.kind));
        }
    }
    by_device
}

fn memory(total_bytes: u64, held: &[(ClaimOnDevice, UseKind)]) -> Memory {
    let used: u64 = held
        .iter()
        .map(|(_, kind)| match kind {
            UseKind::Whole => total_bytes,
            UseKind::Slice { memory_bytes, .. } => *memory_bytes,
        })
        .fold(0, u64::saturating_add)
        .min(total_bytes);
    Memory {
        total: total_bytes,
        used,
        free: total_bytes - used,
    }
}

fn compute(held: &[(ClaimOnDevice, UseKind)]) -> Compute {
    let used: u32 = held
        .iter()
        .map(|(_, kind)| match kind {
            UseKind::Whole => 100,
            UseKind::Slice {
                compute_percent, ..
            } => u32::from(*compute_percent),
        })
        .sum();
    let used = u8::try_from(used.min(100)).unwrap_or(100);
    Compute {
        used_percent: used,
        free_percent: 100 - used,
    }
}

fn health(device: &Device, driver: &str) -> Health {
    let unhealthy = unhealthy_taint_key(driver);
    let taints: Vec<Taint> = device
        .taints
        .iter()
        .flatten()
        .map(|t| Taint {
            key: t.key.clone(),
            value: t.value.clone().unwrap_or_default(),
            effect: t.effect.clone(),
        })
        .collect();
    Health {
        healthy: !taints.iter().any(|t| t.key == unhealthy),
        taints,
    }
}

fn mig_status(device: &Device, driver: &str, held: Vec<(ClaimOnDevice, UseKind)>) -> MigStatus {
    let text = |name: &str| {
        device_attribute(device, driver, name)
            .and_then(|a| a.string.clone())
            .unwrap_or_default()
    };
    // kerf always publishes it; an unreadable one shows as 0 rather than hiding the device.
    let total = device_memory_bytes(device, driver).unwrap_or(0);
    // A MIG device is never sliced: any claim holds all of it.
    let whole: Vec<(ClaimOnDevice, UseKind)> = held
        .into_iter()
        .map(|(claim, _)| (claim, UseKind::Whole))
        .collect();
    MigStatus {
        device: device.name.clone(),
        uuid: text(attributes::UUID),
        profile: text(attributes::PROFILE),
        parent_uuid: text(attributes::PARENT_UUID),
        product: text(attributes::PRODUCT_NAME),
        owner: ownership::published_owner(device, driver),
        memory: memory(total, &whole),
        health: health(device, driver),
        claims: whole.into_iter().map(|(claim, _)| claim).collect(),
    }
}
