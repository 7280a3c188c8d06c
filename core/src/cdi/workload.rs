//! Names a workload can use without knowing its claim's UID: per-request environment
//! variables and the read-only mounts of the claim's metadata files ([`super::metadata`]).
//!
//! # Per-request variables
//!
//! For every request `<REQ>` of the claim (the request name upper-cased, every character
//! other than a letter or digit made `_`; a `firstAvailable` result `parent/sub` counts as
//! `parent`), each device serving the request carries in its own edits:
//!
//! - `KERF_<REQ>_UUIDS` and `KERF_<REQ>_DEVICES`: the request's GPU/MIG UUIDs and device names,
//!   comma-separated, in allocation order; `KERF_<REQ>_COUNT`: how many;
//! - `KERF_<REQ>_SHARING`, and `KERF_<REQ>_MEMORY_BYTES` / `KERF_<REQ>_COMPUTE_PERCENT` when
//!   limited, when every device of the request has the same slice;
//! - the same under `KERF_<CLAIM>_<REQ>_*`, `<CLAIM>` being the name the pod knows the claim
//!   by, made env-safe alike: the claim name of a claim the pod names directly, the pod claim
//!   name (`pod.spec.resourceClaims[].name`) of a claim made from a ResourceClaimTemplate,
//!   whose generated name a container cannot know.
//!
//! They sit in the device edits rather than the claim-wide ones because the kubelet gives a
//! container only the devices of the requests it names: a container sees the variables of
//! its own requests and no others. Every device of a request carries the same values, so the
//! order the runtime applies them in does not matter within a claim.
//!
//! Across claims it does: CDI's `ContainerEdits.Apply`
//! (`tags.cncf.io/container-device-interface` `pkg/cdi/container-edits.go`) adds env through
//! `AddMultipleProcessEnv`, which replaces an existing name, and containerd and CRI-O apply
//! the devices in the order the kubelet lists them. When two claims of one container both
//! have a request `gpu`, `KERF_GPU_*` describes the claim listed last, while
//! `KERF_<CLAIM>_GPU_*` stays exact for each. Two claims of one container share a `<CLAIM>`
//! only when their names differ solely in `-` versus `.`, or when a template claim's pod
//! claim name equals (up to that) the name of a claim the pod names directly (a pod claim
//! `gpu` from a template beside an entry `other` with `resourceClaimName: gpu`); then, as for
//! the short names, the claim listed last wins. The metadata files never collide: direct and
//! template claims have separate directories.
//!
//! A short name that is already a claim-level variable (a request `device` would make
//! `KERF_DEVICE_UUIDS`, one named `slice` `KERF_SLICE_MEMORY_BYTES` and
//! `KERF_SLICE_COMPUTE_PERCENT`) is left out; its `KERF_<CLAIM>_<REQ>_*` twin is kept.
//!
//! # Mounts
//!
//! Each device mounts, read-only, the KEP-5304 file of each of its requests and kerf's
//! claim-wide file (paths in [`super::metadata`]). Two devices mounting the same file at the
//! same path are harmless: `Apply` removes a mount at the same container path before adding.

use std::fmt::Write as _;

use super::env_key;
use super::input::{ClaimSpec, PreparedDevice, READ_ONLY_BIND};
use super::metadata::{
    CLAIM_FILE, ClaimWorkload, claim_container_path, claim_metadata_dir, request_container_path,
    requests_of,
};
use super::spec::Mount;
use crate::error::{Error, Result};

/// Claim-level variable names a per-request short name must not take (see the module docs).
const CLAIM_LEVEL_NAMES: [&str; 8] = [
    "KERF_CLAIM_UID",
    "KERF_CLAIM_NAMESPACE",
    "KERF_CLAIM_NAME",
    "KERF_DEVICES",
    "KERF_DEVICE_UUIDS",
    "KERF_SHARING",
    "KERF_SLICE_MEMORY_BYTES",
    "KERF_SLICE_COMPUTE_PERCENT",
];

/// The env-safe form of a request or claim name: letters and digits upper-cased, anything
/// else `_`. E.g. `big-gpu` → `BIG_GPU`.
pub fn workload_env_name(name: &str) -> String {
    env_key(name)
}

/// The extra env and mounts of each device of the claim, index-aligned with its devices.
///
/// # Errors
///
/// The errors of [`requests_of`]; [`Error::InvalidCdiSpec`] when the metadata directory is
/// not valid UTF-8.
pub(super) fn workload_edits(
    claim: &ClaimSpec<'_>,
    workload: &ClaimWorkload<'_>,
) -> Result<Vec<(Vec<String>, Vec<Mount>)>> {
    let requests = requests_of(claim, workload)?;
    let host_dir = claim_metadata_dir(workload.metadata_dir, claim.claim_uid);
    let host_dir = host_dir.to_str().ok_or_else(|| {
        Error::InvalidCdiSpec(format!(
            "metadata directory {} is not valid UTF-8",
            host_dir.display()
        ))
    })?;
    let container_name = workload.container_name(claim);
    let claim_key = workload_env_name(container_name.name());
    let request_env: Vec<Vec<String>> = requests
        .iter()
        .map(|request| {
            let devices: Vec<&PreparedDevice> =
                request.devices.iter().map(|&i| &claim.devices[i]).collect();
            let key = workload_env_name(&request.name);
            let mut env = group_env(&["KERF_", &key, "_"].concat(), &devices);
            env.retain(|entry| !is_claim_level(entry));
            env.extend(group_env(
                &["KERF_", &claim_key, "_", &key, "_"].concat(),
                &devices,
            ));
            env
        })
        .collect();
    let claim_mount = read_only(
        &[host_dir, "/", CLAIM_FILE].concat(),
        claim_container_path(container_name),
    );
    let edits = workload
        .requests
        .iter()
        .map(|device_requests| {
            let mut env = Vec::new();
            let mut mounts = Vec::with_capacity(device_requests.len() + 1);
            for request in device_requests {
                if let Some(at) = requests.iter().position(|r| r.name == *request) {
                    env.extend(request_env[at].iter().cloned());
                }
                mounts.push(read_only(
                    &[host_dir, "/", request, ".json"].concat(),
                    request_container_path(workload.driver, container_name, request),
                ));
            }
            mounts.push(claim_mount.clone());
            (env, mounts)
        })
        .collect();
    Ok(edits)
}

fn is_claim_level(entry: &str) -> bool {
    entry
        .split_once('=')
        .is_some_and(|(name, _)| CLAIM_LEVEL_NAMES.contains(&name))
}

fn read_only(host: &str, container: String) -> Mount {
    Mount {
        host_path: host.to_owned(),
        container_path: container,
        options: READ_ONLY_BIND.map(str::to_owned).to_vec(),
        fs_type: None,
    }
}

/// The variables of one group of devices under `prefix`.
fn group_env(prefix: &str, devices: &[&PreparedDevice]) -> Vec<String> {
    let mut env = Vec::with_capacity(6);
    let join = |field: &str, item: fn(&PreparedDevice) -> &str| {
        let mut entry = [prefix, field, "="].concat();
        for (i, device) in devices.iter().enumerate() {
            if i > 0 {
                entry.push(',');
            }
            entry.push_str(item(device));
        }
        entry
    };
    env.push(join("UUIDS", |d| &d.uuid));
    env.push(join("DEVICES", |d| &d.name));
    let mut count = [prefix, "COUNT="].concat();
    let _ = write!(count, "{}", devices.len());
    env.push(count);
    let Some(first) = devices.first() else {
        return env;
    };
    if devices
        .iter()
        .all(|d| d.limits == first.limits && d.sharing == first.sharing)
    {
        env.push([prefix, "SHARING=", first.sharing.as_str()].concat());
        if let Some(bytes) = first.limits.memory_bytes {
            let mut entry = [prefix, "MEMORY_BYTES="].concat();
            let _ = write!(entry, "{bytes}");
            env.push(entry);
        }
        if let Some(percent) = first.limits.compute_percent {
            let mut entry = [prefix, "COMPUTE_PERCENT="].concat();
            let _ = write!(entry, "{percent}");
            env.push(entry);
        }
    }
    env
}
