//! The per-claim CDI spec: one transient spec per prepared claim, one CDI device per
//! prepared device.
//!
//! # Environment variables
//!
//! A container can receive several devices of one claim, or devices of several claims (each
//! claim has its own spec). Runtimes concatenate the `env` of every applied edit and the
//! last entry of a name wins, so kerf keeps one rule: **a variable name is either keyed by
//! the CDI device it describes, or it has one value per claim.**
//!
//! - Per-device variables live in the device's own edits and carry the device in their name:
//!   `KERF_DEVICE_<KEY>_NAME`, `_UUID`, `_SHARING`, and for slices `_MEMORY_BYTES` and
//!   `_COMPUTE_PERCENT`. `<KEY>` is [`env_key`] of the CDI device name `<claim uid>-<device>`,
//!   unique across claims (claim UIDs are unique and map one-to-one) and checked unique
//!   within a claim. These are never in conflict and list exactly the devices injected.
//! - Claim-level variables live in the spec-wide edits, applied once whenever any device of
//!   the claim is injected, so two devices of one claim never disagree:
//!   `NVIDIA_VISIBLE_DEVICES=void` (the same for every claim: no NVIDIA runtime hook should
//!   add devices on top of kerf's), `KERF_CLAIM_UID`, `KERF_CLAIM_NAMESPACE`,
//!   `KERF_CLAIM_NAME`, `KERF_DEVICES` and `KERF_DEVICE_UUIDS` (all devices of the claim, in
//!   allocation order, comma-separated), and the slice summary: `KERF_SHARING`,
//!   `KERF_SLICE_MEMORY_BYTES`, `KERF_SLICE_COMPUTE_PERCENT` when every device of the claim
//!   has the same slice (omitted otherwise), `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (the
//!   smallest compute limit of the claim: it is one value per process) and
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`<ordinal>=<MiB>M` pairs; the ordinal is the
//!   device's rank among the claim's devices ordered by GPU minor, which is the order CUDA
//!   enumerates a container's GPUs in when they are all of one model).
//!
//! A container that consumes two kerf claims therefore sees the unkeyed claim-level
//! variables of whichever claim the runtime applied last; that is inherent in one
//! process-wide variable such as `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, and the keyed
//! per-device variables stay exact.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::spec::{ContainerEdits, Device, DeviceNode, Mount, Spec};
use super::version::CdiVersion;
use super::{claim_device_name, qualified_name};
use crate::error::{Error, Result};
use crate::slice::{Sharing, SliceLimits};

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

/// Builds the CDI spec of one claim; see the module docs for the environment it sets.
///
/// The result is deterministic (an idempotent re-prepare rewrites the same bytes), written at
/// the lowest `cdiVersion` its fields allow, and valid per [`Spec::validate`].
///
/// # Errors
///
/// [`Error::InvalidCdiSpec`] when the claim has no devices, a name makes an invalid CDI
/// device name, two devices collide on a name or env key, or the resulting spec is invalid
/// (e.g. a malformed common env entry).
pub fn generate(
    request: &ClaimSpecRequest<'_>,
    policy: &DeviceNodePolicy,
) -> Result<GeneratedSpec> {
    if request.devices.is_empty() {
        return Err(Error::InvalidCdiSpec(format!(
            "claim {} has no devices to prepare",
            request.claim_uid
        )));
    }
    let host_path = host_path_override(policy)?;
    let cdi_names: Vec<String> = request
        .devices
        .iter()
        .map(|d| claim_device_name(request.claim_uid, &d.name))
        .collect();
    check_unique_env_keys(&cdi_names)?;

    let devices = request
        .devices
        .iter()
        .zip(&cdi_names)
        .map(|(device, cdi_name)| Device {
            name: cdi_name.clone(),
            annotations: BTreeMap::new(),
            container_edits: device_edits(device, cdi_name, host_path),
        })
        .collect();
    let mut spec = Spec {
        cdi_version: CdiVersion::V0_3_0,
        kind: request.kind.to_owned(),
        annotations: BTreeMap::new(),
        devices,
        container_edits: claim_edits(request, host_path),
    };
    spec.cdi_version = spec.minimum_version();
    spec.validate()?;
    let device_ids = cdi_names
        .iter()
        .map(|name| qualified_name(request.kind, name))
        .collect();
    Ok(GeneratedSpec { spec, device_ids })
}

/// The env-safe key of a CDI device name: ASCII letters and digits upper-cased, every other
/// character `_`. E.g. `7f3c-gpu-0` → `7F3C_GPU_0`.
pub fn env_key(cdi_device_name: &str) -> String {
    cdi_device_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

fn host_path_override(policy: &DeviceNodePolicy) -> Result<Option<&str>> {
    policy
        .host_path_override
        .as_deref()
        .map(|p| {
            p.to_str().ok_or_else(|| {
                Error::InvalidCdiSpec(format!(
                    "device node host path {} is not valid UTF-8",
                    p.display()
                ))
            })
        })
        .transpose()
}

fn check_unique_env_keys(cdi_names: &[String]) -> Result<()> {
    let mut keys: Vec<(String, &str)> =
        cdi_names.iter().map(|n| (env_key(n), n.as_str())).collect();
    keys.sort_unstable();
    match keys.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) if w[0].1 == w[1].1 => Err(Error::InvalidCdiSpec(format!(
            "device name {:?} appears more than once in the claim",
            w[0].1
        ))),
        Some(w) => Err(Error::InvalidCdiSpec(format!(
            "devices {:?} and {:?} map to the same environment key {}",
            w[0].1, w[1].1, w[0].0
        ))),
        None => Ok(()),
    }
}

fn node(path: String, host_path: Option<&str>) -> DeviceNode {
    DeviceNode {
        path,
        host_path: host_path.map(str::to_owned),
        ..DeviceNode::default()
    }
}

fn device_edits(
    device: &PreparedDevice,
    cdi_name: &str,
    host_path: Option<&str>,
) -> ContainerEdits {
    let mut nodes = vec![node(format!("/dev/nvidia{}", device.gpu_minor), host_path)];
    if let Some(caps) = device.mig {
        for minor in [caps.gi_cap_minor, caps.ci_cap_minor] {
            nodes.push(node(
                format!("/dev/nvidia-caps/nvidia-cap{minor}"),
                host_path,
            ));
        }
    }
    let prefix = format!("KERF_DEVICE_{}", env_key(cdi_name));
    let mut env = vec![
        format!("{prefix}_NAME={}", device.name),
        format!("{prefix}_UUID={}", device.uuid),
        format!("{prefix}_SHARING={}", device.sharing),
    ];
    if let Some(bytes) = device.limits.memory_bytes {
        env.push(format!("{prefix}_MEMORY_BYTES={bytes}"));
    }
    if let Some(percent) = device.limits.compute_percent {
        env.push(format!("{prefix}_COMPUTE_PERCENT={percent}"));
    }
    ContainerEdits {
        env,
        device_nodes: nodes,
        ..ContainerEdits::default()
    }
}

fn claim_edits(request: &ClaimSpecRequest<'_>, host_path: Option<&str>) -> ContainerEdits {
    let devices = request.devices;
    let mut env = vec![
        "NVIDIA_VISIBLE_DEVICES=void".to_owned(),
        format!("KERF_CLAIM_UID={}", request.claim_uid),
        format!("KERF_CLAIM_NAMESPACE={}", request.claim_namespace),
        format!("KERF_CLAIM_NAME={}", request.claim_name),
        format!(
            "KERF_DEVICES={}",
            join(devices.iter().map(|d| d.name.as_str()))
        ),
        format!(
            "KERF_DEVICE_UUIDS={}",
            join(devices.iter().map(|d| d.uuid.as_str()))
        ),
    ];
    env.extend(slice_summary_env(devices));
    env.extend(mps_env(devices));
    env.extend(request.common.env.iter().cloned());
    let device_nodes = request
        .common
        .device_nodes
        .iter()
        .map(|n| match host_path {
            Some(host) => DeviceNode {
                host_path: Some(host.to_owned()),
                ..n.clone()
            },
            None => n.clone(),
        })
        .collect();
    ContainerEdits {
        env,
        device_nodes,
        mounts: request.common.mounts.clone(),
        ..ContainerEdits::default()
    }
}

/// `KERF_SHARING` and `KERF_SLICE_*` when every device of the claim has the same slice.
fn slice_summary_env(devices: &[PreparedDevice]) -> Vec<String> {
    let Some(first) = devices.first() else {
        return Vec::new();
    };
    if devices
        .iter()
        .any(|d| d.limits != first.limits || d.sharing != first.sharing)
    {
        return Vec::new();
    }
    let mut env = vec![format!("KERF_SHARING={}", first.sharing)];
    if let Some(bytes) = first.limits.memory_bytes {
        env.push(format!("KERF_SLICE_MEMORY_BYTES={bytes}"));
    }
    if let Some(percent) = first.limits.compute_percent {
        env.push(format!("KERF_SLICE_COMPUTE_PERCENT={percent}"));
    }
    env
}

/// The CUDA MPS client limits of the claim.
fn mps_env(devices: &[PreparedDevice]) -> Vec<String> {
    let mut env = Vec::new();
    if let Some(percent) = devices
        .iter()
        .filter_map(|d| d.limits.compute_percent)
        .min()
    {
        env.push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}"));
    }
    let mut by_ordinal: Vec<&PreparedDevice> = devices.iter().collect();
    by_ordinal.sort_by_key(|d| (d.gpu_minor, d.mig.map(|m| (m.gi_cap_minor, m.ci_cap_minor))));
    let mut limits = String::new();
    for (ordinal, device) in by_ordinal.iter().enumerate() {
        if let Some(bytes) = device.limits.memory_bytes {
            let sep = if limits.is_empty() { "" } else { "," };
            // Round down so the limit never exceeds the slice; MPS takes whole MiB here.
            let mib = (bytes >> 20).max(1);
            let _ = write!(limits, "{sep}{ordinal}={mib}M");
        }
    }
    if !limits.is_empty() {
        env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={limits}"));
    }
    env
}

fn join<'a>(items: impl Iterator<Item = &'a str>) -> String {
    let mut out = String::new();
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out
}
