//! What the spec of one claim is made from ([`ClaimSpecRequest`]: the claim, its
//! [`PreparedDevice`]s, the node's [`CommonEdits`] and [`DeviceNodePolicy`]) and what comes
//! out ([`GeneratedSpec`]): the types the generator (`generate.rs`) and its workload parts
//! (`metadata.rs`, `workload.rs`) share, below all three.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::spec::{DeviceNode, Mount, Spec};
use crate::mps::MpsClient;
use crate::sharing::{Sharing, SliceLimits};

/// Common device nodes every CUDA container needs, besides its GPUs' own nodes.
pub const COMMON_DEVICE_NODES: [&str; 3] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// Options of the read-only bind mounts of driver files.
pub const READ_ONLY_BIND: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// Minors of the `/dev/nvidia-caps/nvidia-cap<N>` nodes that grant access to a MIG device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MigCaps {
    /// Capability minor of the GPU instance.
    pub gi_cap_minor: u32,
    /// Capability minor of the compute instance.
    pub ci_cap_minor: u32,
    /// Major of the `nvidia-caps` character devices (`/proc/devices`), when known: the cap
    /// nodes are then emitted with `type: c`, `major` and `minor`, so the runtime creates
    /// them in the container without a host node (what NVIDIA's DRA driver does,
    /// dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/cdi.go` (`GetDevNodesForMigDevice`)).
    /// Without it (or in mock mode, where every node is backed by the host-path override)
    /// the nodes carry their path only and the runtime stats the host node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caps_major: Option<u32>,
}

/// One device of a claim as the spec generator needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// Published device name, e.g. `gpu-3` or `gpu-0-mig-1g-5gb-0`.
    pub name: String,
    /// GPU or MIG UUID.
    pub uuid: String,
    /// Minor of `/dev/nvidia<minor>` of the (parent) GPU.
    pub gpu_minor: u32,
    /// Capability minors when the device is a MIG device.
    pub mig: Option<MigCaps>,
    /// The slice of the device the claim was given.
    pub limits: SliceLimits,
    /// How the device is shared.
    pub sharing: Sharing,
    /// The MPS daemon serving the device, when its slice is enforced by one.
    pub mps: Option<MpsClient>,
}

/// Edits shared by every claim of the node: control device nodes, driver mounts, extra env.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommonEdits {
    /// Device nodes every container gets, e.g. `/dev/nvidiactl`.
    pub device_nodes: Vec<DeviceNode>,
    /// Mounts every container gets, e.g. driver libraries.
    pub mounts: Vec<Mount>,
    /// `NAME=value` entries every container gets.
    pub env: Vec<String>,
}

impl CommonEdits {
    /// The NVIDIA control nodes ([`COMMON_DEVICE_NODES`]) plus the given mounts, typically
    /// [`crate::driver_root::DriverFiles::mounts`].
    pub fn nvidia(mounts: Vec<Mount>) -> Self {
        CommonEdits {
            device_nodes: COMMON_DEVICE_NODES
                .into_iter()
                .map(DeviceNode::at)
                .collect(),
            mounts,
            env: Vec::new(),
        }
    }
}

/// Where device nodes come from on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceNodePolicy {
    /// Mock mode: every device node gets this `hostPath` (e.g. `/dev/null`), so that a real
    /// runtime can create `/dev/nvidia0` in a container on a machine without GPUs. `None`
    /// (real mode) leaves `hostPath` out, which keeps specs at the oldest version.
    pub host_path_override: Option<PathBuf>,
}

impl DeviceNodePolicy {
    /// Real GPUs: device nodes are taken from the same host path.
    pub fn real() -> Self {
        DeviceNodePolicy {
            host_path_override: None,
        }
    }

    /// Mock GPUs: every device node is backed by `host_path`.
    pub fn mock(host_path: impl Into<PathBuf>) -> Self {
        DeviceNodePolicy {
            host_path_override: Some(host_path.into()),
        }
    }
}

/// Everything the spec of one claim is made from.
#[derive(Debug, Clone, Copy)]
pub struct ClaimSpecRequest<'a> {
    /// CDI kind, e.g. `k8s.gpu.kerf.dev/gpu`.
    pub kind: &'a str,
    /// UID of the ResourceClaim.
    pub claim_uid: &'a str,
    /// Namespace of the ResourceClaim.
    pub claim_namespace: &'a str,
    /// Name of the ResourceClaim.
    pub claim_name: &'a str,
    /// The claim's devices, in allocation order.
    pub devices: &'a [PreparedDevice],
    /// Edits shared across the claims of the node.
    pub common: &'a CommonEdits,
}

/// A generated spec and the qualified CDI device id of each input device, in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedSpec {
    /// The spec, at its minimum version.
    pub spec: Spec,
    /// `vendor/class=<claim uid>-<device>` per input device.
    pub device_ids: Vec<String>,
}

/// The claim-specific fields of a [`ClaimSpecRequest`]: what differs from one claim of a
/// node to the next. [`super::SpecEncoder::encode`] takes this.
#[derive(Debug, Clone, Copy)]
pub struct ClaimSpec<'a> {
    /// UID of the ResourceClaim.
    pub claim_uid: &'a str,
    /// Namespace of the ResourceClaim.
    pub claim_namespace: &'a str,
    /// Name of the ResourceClaim.
    pub claim_name: &'a str,
    /// The claim's devices, in allocation order.
    pub devices: &'a [PreparedDevice],
}

impl<'a> ClaimSpecRequest<'a> {
    /// The claim-specific fields of the request.
    pub fn claim(&self) -> ClaimSpec<'a> {
        ClaimSpec {
            claim_uid: self.claim_uid,
            claim_namespace: self.claim_namespace,
            claim_name: self.claim_name,
            devices: self.devices,
        }
    }
}
