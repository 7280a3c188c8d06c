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
//! - Devices served by a kerf MPS daemon ([`PreparedDevice::mps`]) are the one exception:
//!   a CUDA process talks to one MPS server, which shows it one GPU, so such a device's own
//!   edits set `CUDA_MPS_PIPE_DIRECTORY` and that device's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
//!   and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`, besides the keyed
//!   `KERF_DEVICE_<KEY>_MPS_PIPE_DIRECTORY` and the mounts of its pipe directory and of the
//!   shared-memory directory (see [`crate::mps`]). With several such devices in one container
//!   the device applied last sets all three, so they always describe one daemon. The
//!   claim-level MPS limits above then cover only the claim's other devices.
//!
//! A container that consumes two kerf claims therefore sees the unkeyed claim-level
//! variables of whichever claim the runtime applied last; that is inherent in one
//! process-wide variable such as `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, and the keyed
//! per-device variables stay exact.
//!
//! [`generate_for_workload`] adds names a workload can know in advance: `KERF_<REQUEST>_*`
//! and `KERF_<CLAIM>_<REQUEST>_*` in the devices' own edits, and the read-only mounts of the
//! claim's KEP-5304 metadata files (see [`super::workload`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::input::{
    ClaimSpec, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, GeneratedSpec, PreparedDevice,
};
use super::metadata::ClaimWorkload;
use super::spec::{ContainerEdits, Device, DeviceNode, Mount, Spec};
use super::version::CdiVersion;
use super::workload::workload_edits;
use super::{claim_device_name, qualified_name};
use crate::enforcement::pinned_mib;
use crate::error::{Error, Result};
use crate::mps::{CLIENT_MOUNT_OPTIONS, CONTAINER_SHM_DIRECTORY, MpsClient};

/// What the names of per-device variables start with, before the device's [`env_key`].
const DEVICE_VAR_PREFIX: &str = "KERF_DEVICE_";

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
    generate_spec(request, policy, None)
}

/// [`generate`] plus the names a workload can use: per-request variables and the read-only
/// mounts of the claim's metadata files (see [`super::workload`] and [`super::metadata`]).
///
/// # Errors
///
/// The errors of [`generate`], and [`Error::InvalidCdiSpec`] when `workload.requests` is not
/// index-aligned with the devices, a device serves no request, or a request name is not a
/// DNS label.
pub fn generate_for_workload(
    request: &ClaimSpecRequest<'_>,
    policy: &DeviceNodePolicy,
    workload: &ClaimWorkload<'_>,
) -> Result<GeneratedSpec> {
    generate_spec(request, policy, Some(workload))
}

fn generate_spec(
    request: &ClaimSpecRequest<'_>,
    policy: &DeviceNodePolicy,
    workload: Option<&ClaimWorkload<'_>>,
) -> Result<GeneratedSpec> {
    let claim = request.claim();
    check_has_devices(&claim)?;
    let host_path = host_path_override(policy)?;
    let ClaimPart {
        devices,
        mut env,
        device_ids,
    } = claim_part(request.kind, &claim, host_path, workload)?;
    env.extend(request.common.env.iter().cloned());
    let mut spec = Spec {
        cdi_version: CdiVersion::V0_3_0,
        kind: request.kind.to_owned(),
        annotations: BTreeMap::new(),
        devices,
        container_edits: ContainerEdits {
            env,
            device_nodes: common_device_nodes(request.common, host_path),
            mounts: request.common.mounts.clone(),
            ..ContainerEdits::default()
        },
    };
    spec.cdi_version = spec.minimum_version();
    spec.validate()?;
    Ok(GeneratedSpec { spec, device_ids })
}

/// What a spec holds for one claim besides the node-wide [`CommonEdits`].
pub(super) struct ClaimPart {
    /// One CDI device per prepared device, in input order.
    pub(super) devices: Vec<Device>,
    /// The claim-level env, without the common env.
    pub(super) env: Vec<String>,
    /// The qualified id of each device, in input order.
    pub(super) device_ids: Vec<String>,
}

/// Fails for a claim without devices, before anything else is looked at.
pub(super) fn check_has_devices(claim: &ClaimSpec<'_>) -> Result<()> {
    if claim.devices.is_empty() {
        return Err(Error::InvalidCdiSpec(format!(
            "claim {} has no devices to prepare",
            claim.claim_uid
        )));
    }
    Ok(())
}

/// The claim-specific devices and env. Device names are only checked for collisions here;
/// the spec they end up in is validated by the caller.
pub(super) fn claim_part(
    kind: &str,
    claim: &ClaimSpec<'_>,
    host_path: Option<&str>,
    workload: Option<&ClaimWorkload<'_>>,
) -> Result<ClaimPart> {
    let cdi_names: Vec<String> = claim
        .devices
        .iter()
        .map(|d| claim_device_name(claim.claim_uid, &d.name))
        .collect();
    let keys: Vec<String> = cdi_names.iter().map(|n| env_key(n)).collect();
    check_unique_env_keys(&cdi_names, &keys)?;
    let device_ids = cdi_names
        .iter()
        .map(|name| qualified_name(kind, name))
        .collect();
    let mut devices: Vec<Device> = claim
        .devices
        .iter()
        .zip(cdi_names)
        .zip(&keys)
        .map(|((device, cdi_name), key)| Device {
            container_edits: device_edits(device, key, host_path),
            name: cdi_name,
            annotations: BTreeMap::new(),
        })
        .collect();
    if let Some(workload) = workload {
        for (device, (env, mounts)) in devices.iter_mut().zip(workload_edits(claim, workload)?) {
            device.container_edits.env.extend(env);
            device.container_edits.mounts.extend(mounts);
        }
    }
    Ok(ClaimPart {
        devices,
        env: claim_env(claim),
        device_ids,
    })
}

/// The env-safe key of a CDI device name: ASCII letters and digits upper-cased, every other
/// character `_`. E.g. `7f3c-gpu-0` → `7F3C_GPU_0`.
pub fn env_key(cdi_device_name: &str) -> String {
    let mut key = String::with_capacity(cdi_device_name.len());
    key.extend(cdi_device_name.chars().map(|c| {
        if c.is_ascii_alphanumeric() {
            c.to_ascii_uppercase()
        } else {
            '_'
        }
    }));
    key
}

pub(super) fn host_path_override(policy: &DeviceNodePolicy) -> Result<Option<&str>> {
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

/// `keys[i]` is the [`env_key`] of `cdi_names[i]`.
fn check_unique_env_keys(cdi_names: &[String], keys: &[String]) -> Result<()> {
    let mut keys: Vec<(&str, &str)> = keys
        .iter()
        .zip(cdi_names)
        .map(|(key, name)| (key.as_str(), name.as_str()))
        .collect();
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

/// `parts` concatenated, then the decimal `n`, in one allocation.
fn with_number(parts: &[&str], n: impl std::fmt::Display) -> String {
    // u64::MAX has 20 digits.
    let mut out = String::with_capacity(parts.iter().map(|p| p.len()).sum::<usize>() + 20);
    for part in parts {
        out.push_str(part);
    }
    let _ = write!(out, "{n}");
    out
}

/// The edits of one device; `key` is the [`env_key`] of its CDI device name.
///
/// Strings are concatenated rather than `format!`ted: this runs for every device of every
/// claim, and the formatting machinery was a measurable share of it.
fn device_edits(device: &PreparedDevice, key: &str, host_path: Option<&str>) -> ContainerEdits {
    let mut nodes = Vec::with_capacity(if device.mig.is_some() { 3 } else { 1 });
    nodes.push(node(
        with_number(&["/dev/nvidia"], device.gpu_minor),
        host_path,
    ));
    if let Some(caps) = device.mig {
        for minor in [caps.gi_cap_minor, caps.ci_cap_minor] {
            let mut cap = node(
                with_number(&["/dev/nvidia-caps/nvidia-cap"], minor),
                host_path,
            );
            if let (Some(major), None) = (caps.caps_major, host_path) {
                cap.node_type = Some("c".to_owned());
                cap.major = Some(i64::from(major));
                cap.minor = Some(i64::from(minor));
            }
            nodes.push(cap);
        }
    }
    let mut env = Vec::with_capacity(5);
    env.push([DEVICE_VAR_PREFIX, key, "_NAME=", &device.name].concat());
    env.push([DEVICE_VAR_PREFIX, key, "_UUID=", &device.uuid].concat());
    env.push([DEVICE_VAR_PREFIX, key, "_SHARING=", device.sharing.as_str()].concat());
    if let Some(bytes) = device.limits.memory_bytes {
        env.push(with_number(
            &[DEVICE_VAR_PREFIX, key, "_MEMORY_BYTES="],
            bytes,
        ));
    }
    if let Some(percent) = device.limits.compute_percent {
        env.push(with_number(
            &[DEVICE_VAR_PREFIX, key, "_COMPUTE_PERCENT="],
            percent,
        ));
    }
    let mounts = match &device.mps {
        Some(client) => mps_client_edits(device, client, key, &mut env),
        None => Vec::new(),
    };
    ContainerEdits {
        env,
        device_nodes: nodes,
        mounts,
        ..ContainerEdits::default()
    }
}

/// The mounts and env that make a container a client of the device's MPS daemon, with the
/// device's limits as the per-client limits (the daemon shows the client its one GPU as
/// ordinal 0); see [`crate::mps`] for why these unkeyed variables are per device.
fn mps_client_edits(
    device: &PreparedDevice,
    client: &MpsClient,
    key: &str,
    env: &mut Vec<String>,
) -> Vec<Mount> {
    let pipe = client.container_pipe_directory.as_str();
    env.push([DEVICE_VAR_PREFIX, key, "_MPS_PIPE_DIRECTORY=", pipe].concat());
    env.push(["CUDA_MPS_PIPE_DIRECTORY=", pipe].concat());
    if let Some(percent) = device.limits.compute_percent {
        env.push(with_number(
            &["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="],
            percent,
        ));
    }
    if let Some(bytes) = device.limits.memory_bytes {
        env.push(with_number(&["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0="], pinned_mib(bytes)) + "M");
    }
    let mount = |host: &str, container: &str| Mount {
        host_path: host.to_owned(),
        container_path: container.to_owned(),
        options: CLIENT_MOUNT_OPTIONS.map(str::to_owned).to_vec(),
        fs_type: None,
    };
    vec![
        mount(&client.pipe_directory, pipe),
        mount(&client.shm_directory, CONTAINER_SHM_DIRECTORY),
    ]
}

/// The claim-level env: identity, device lists, slice summary and MPS limits.
fn claim_env(claim: &ClaimSpec<'_>) -> Vec<String> {
    let devices = claim.devices;
    let mut env = Vec::with_capacity(11);
    env.push("NVIDIA_VISIBLE_DEVICES=void".to_owned());
    env.push(["KERF_CLAIM_UID=", claim.claim_uid].concat());
    env.push(["KERF_CLAIM_NAMESPACE=", claim.claim_namespace].concat());
    env.push(["KERF_CLAIM_NAME=", claim.claim_name].concat());
    env.push(join(
        "KERF_DEVICES=",
        devices.iter().map(|d| d.name.as_str()),
    ));
    env.push(join(
        "KERF_DEVICE_UUIDS=",
        devices.iter().map(|d| d.uuid.as_str()),
    ));
    slice_summary_env(devices, &mut env);
    mps_env(devices, &mut env);
    env
}

/// The common device nodes, backed by `host_path` when the policy overrides it.
pub(super) fn common_device_nodes(
    common: &CommonEdits,
    host_path: Option<&str>,
) -> Vec<DeviceNode> {
    common
        .device_nodes
        .iter()
        .map(|n| match host_path {
            Some(host) => DeviceNode {
                host_path: Some(host.to_owned()),
                ..n.clone()
            },
            None => n.clone(),
        })
        .collect()
}

/// `KERF_SHARING` and `KERF_SLICE_*` when every device of the claim has the same slice.
fn slice_summary_env(devices: &[PreparedDevice], env: &mut Vec<String>) {
    let Some(first) = devices.first() else {
        return;
    };
    if devices
        .iter()
        .any(|d| d.limits != first.limits || d.sharing != first.sharing)
    {
        return;
    }
    env.push(["KERF_SHARING=", first.sharing.as_str()].concat());
    if let Some(bytes) = first.limits.memory_bytes {
        env.push(with_number(&["KERF_SLICE_MEMORY_BYTES="], bytes));
    }
    if let Some(percent) = first.limits.compute_percent {
        env.push(with_number(&["KERF_SLICE_COMPUTE_PERCENT="], percent));
    }
}

/// The CUDA MPS client limits of the claim's devices that no kerf MPS daemon serves (those
/// served by one carry their limits in their own edits).
fn mps_env(devices: &[PreparedDevice], env: &mut Vec<String>) {
    let unserved = || devices.iter().filter(|d| d.mps.is_none());
    if let Some(percent) = unserved().filter_map(|d| d.limits.compute_percent).min() {
        env.push(with_number(
            &["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="],
            percent,
        ));
    }
    if unserved().all(|d| d.limits.memory_bytes.is_none()) {
        return;
    }
    let mut by_ordinal: Vec<&PreparedDevice> = unserved().collect();
    by_ordinal.sort_by_key(|d| (d.gpu_minor, d.mig.map(|m| (m.gi_cap_minor, m.ci_cap_minor))));
    let mut limits = String::from("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=");
    let mut sep = "";
    for (ordinal, device) in by_ordinal.iter().enumerate() {
        if let Some(bytes) = device.limits.memory_bytes {
            let _ = write!(limits, "{sep}{ordinal}={}M", pinned_mib(bytes));
            sep = ",";
        }
    }
    env.push(limits);
}

/// `prefix` followed by `items`, comma-separated.
fn join<'a>(prefix: &str, items: impl Iterator<Item = &'a str> + Clone) -> String {
    let len = items.clone().map(|item| item.len() + 1).sum::<usize>();
    let mut out = String::with_capacity(prefix.len() + len);
    out.push_str(prefix);
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(item);
    }
    out
}
