//! What the allocator allocates from (whole GPUs per node) and what holds them (device uses).

use crate::enforcement::Enforcement;
use crate::inventory::{ComputeCapability, Inventory};
use crate::mps::TimeSliceInterval;
use crate::sharing::Sharing;

use super::taint::DeviceTaint;

/// The whole GPUs of one node that the controller may slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGpus {
    /// Node name (the pool name of kerf's ResourceSlices).
    pub node: String,
    /// Whole GPUs in any order. MIG devices are not listed: they are the scheduler's.
    pub gpus: Vec<GpuInfo>,
}

/// One whole GPU as published in kerf's ResourceSlices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Published device name, e.g. `gpu-3`.
    pub device: String,
    /// NVML UUID, e.g. `GPU-8d4b…`.
    pub uuid: String,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub product: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// CUDA compute capability.
    pub compute_capability: ComputeCapability,
    /// NVLink domain, when the GPU has one.
    pub nvlink_domain: Option<String>,
    /// PCIe root complex, when known.
    pub pcie_root: Option<String>,
    /// NUMA node, when known.
    pub numa: Option<u32>,
    /// Taints published on the device; a `NoSchedule` or `NoExecute` one keeps it from
    /// requests that do not tolerate it.
    pub taints: Vec<DeviceTaint>,
}

impl NodeGpus {
    /// The whole GPUs of an inventory (GPUs in MIG mode are left out: their MIG devices are
    /// allocated by the scheduler), as the kubelet plugin publishes them.
    pub fn from_inventory(node: impl Into<String>, inventory: &Inventory) -> Self {
        let gpus = inventory
            .gpus
            .iter()
            .filter(|gpu| !gpu.mig_enabled)
            .map(|gpu| GpuInfo {
                device: gpu.device_name(),
                uuid: gpu.uuid.clone(),
                product: gpu.product_name.clone(),
                memory_bytes: gpu.memory_bytes,
                multiprocessors: gpu.multiprocessors,
                compute_capability: gpu.compute_capability,
                nvlink_domain: gpu.nvlink_domain.clone(),
                pcie_root: gpu.pcie_root.clone(),
                numa: gpu.numa_node,
                taints: Vec::new(),
            })
            .collect();
        NodeGpus {
            node: node.into(),
            gpus,
        }
    }
}

/// One device held by one claim, whoever allocated it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceUse {
    /// Node (pool) of the device.
    pub node: String,
    /// Device name, e.g. `gpu-3`.
    pub device: String,
    /// Whether the claim holds the whole device or a slice of it.
    pub kind: UseKind,
    /// The holder of its limits its class requires: an MPS slice that needs the server keeps
    /// the GPU's other MPS slices at its size ([`crate::enforcement`]).
    pub enforcement: Enforcement,
}

/// How a claim holds a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UseKind {
    /// Exclusively: nothing else may be placed on the device.
    Whole,
    /// A share that reserves this much of the device. A zero field reserves none of that
    /// resource (the slice is not limited in it either); the share still counts towards the
    /// device's slice count and keeps whole-device requests off the device.
    Slice {
        /// Reserved memory in bytes.
        memory_bytes: u64,
        /// Reserved percent of the multiprocessors (0–100).
        compute_percent: u8,
        /// How the GPU is shared with the other slices: one GPU never carries MPS and
        /// time-sliced slices together (an MPS server owns the GPU in compute mode
        /// `EXCLUSIVE_PROCESS`, time-slicing needs `DEFAULT`).
        sharing: Sharing,
    },
}

impl DeviceUse {
    /// A whole-device use.
    pub fn whole(node: impl Into<String>, device: impl Into<String>) -> Self {
        DeviceUse {
            node: node.into(),
            device: device.into(),
            kind: UseKind::Whole,
            enforcement: Enforcement::default(),
        }
    }

    /// A slice use without a sharing strategy ([`Sharing::Exclusive`]: it constrains no other
    /// slice's strategy); see [`DeviceUse::shared_by`].
    pub fn slice(
        node: impl Into<String>,
        device: impl Into<String>,
        memory_bytes: u64,
        compute_percent: u8,
    ) -> Self {
        DeviceUse {
            node: node.into(),
            device: device.into(),
            kind: UseKind::Slice {
                memory_bytes,
                compute_percent,
                sharing: Sharing::Exclusive,
            },
            enforcement: Enforcement::default(),
        }
    }

    /// The same use, requiring `enforcement` of its limits.
    #[must_use]
    pub fn held_by(mut self, enforcement: Enforcement) -> Self {
        self.enforcement = enforcement;
        self
    }

    /// The same use, a slice shared by `sharing` (a whole-device use is unchanged).
    #[must_use]
    pub fn shared_by(mut self, sharing: Sharing) -> Self {
        if let UseKind::Slice { sharing: s, .. } = &mut self.kind {
            *s = sharing;
        }
        self
    }
}

/// The share of one GPU a slice reserves. A zero field reserves none of that resource; at
/// least one field must be non-zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SliceSize {
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Percent (0–100) of the GPU's multiprocessors.
    pub compute_percent: u8,
}

/// Where a pod's claims go: one node, and per claim the devices of each request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPlacement {
    /// The node every claim of the pod is placed on.
    pub node: String,
    /// One entry per claim of the [`PodRequest`], in its order.
    pub claims: Vec<ClaimPlacement>,
    /// `(claim key, request name)` of every placed request with admin access: its devices
    /// use nothing.
    pub admin_requests: Vec<(String, String)>,
}

impl PodPlacement {
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
    /// The holder of its limits the request's class requires.
    pub enforcement: Enforcement,
}

impl ClaimPlacement {
    /// The usage this claim's devices put on `node` if all of them used their GPU; see
    /// [`PodPlacement::claim_uses`], which leaves admin-access devices out.
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
                enforcement: device.enforcement,
            })
            .collect()
    }
}
