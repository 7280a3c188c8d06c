//! The preparer's pure parts: the checkpoint records of a claim's devices, what a claim's
//! annotations and allocation results contribute to them, and the answers made from them.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::AllocatedDevice;
use kerf_core::cdi;
use kerf_core::checkpoint::DeviceRecord;
use kerf_core::inventory::DeviceRef;
use kerf_proto::PreparedDevice;

use crate::Result;

/// The pod claim name of a claim made from a ResourceClaimTemplate (its
/// `resource.kubernetes.io/pod-claim-name` annotation, see [`cdi::POD_CLAIM_NAME_ANNOTATION`]),
/// checked because it becomes a path segment in the claim's containers.
///
/// # Errors
/// An annotation that is not a DNS label, naming the annotation and its value.
pub(super) fn pod_claim_name(claim: &ResourceClaim) -> Result<Option<String>> {
    let Some(value) = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(cdi::POD_CLAIM_NAME_ANNOTATION))
    else {
        return Ok(None);
    };
    cdi::check_pod_claim_name(value)?;
    Ok(Some(value.clone()))
}

/// The kubelet matches devices to containers by request name; a `req/sub` result belongs to
/// the container's request `req`.
pub(super) fn parent_request(request: &str) -> &str {
    request
        .split_once('/')
        .map_or(request, |(parent, _)| parent)
}

/// Two preparations of one device conflict unless both share it.
pub(super) fn conflicts(held: &DeviceRecord, wanted: &DeviceRecord) -> bool {
    if held.admin_access || wanted.admin_access {
        return false;
    }
    is_exclusive(held) || is_exclusive(wanted)
}

pub(super) fn is_exclusive(record: &DeviceRecord) -> bool {
    record.share_id.is_none()
        && record.limits.is_whole()
        && record.sharing == kerf_core::slice::Sharing::Exclusive
}

pub(super) fn device_record(
    found: DeviceRef<'_>,
    device: &AllocatedDevice,
    request: String,
    cdi_id: String,
) -> DeviceRecord {
    let (gpu_minor, mig) = match found {
        DeviceRef::Gpu(gpu) => (gpu.minor, None),
        DeviceRef::Mig { parent, mig } => (
            parent.minor,
            Some(cdi::MigCaps {
                gi_cap_minor: mig.gi_cap_minor,
                ci_cap_minor: mig.ci_cap_minor,
            }),
        ),
    };
    DeviceRecord {
        request_names: vec![request],
        request_refs: vec![device.request.clone()],
        pool_name: device.pool.clone(),
        device_name: device.device.clone(),
        cdi_device_ids: vec![cdi_id],
        share_id: device.share_id.clone(),
        admin_access: device.admin_access,
        uuid: found.uuid().to_owned(),
        gpu_minor,
        mig,
        limits: device.limits,
        sharing: device.sharing,
        time_slice_interval: device.time_slice_interval,
    }
}

pub(super) fn results_of(devices: &[DeviceRecord]) -> Vec<PreparedDevice> {
    devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: d.request_names.clone(),
            pool_name: d.pool_name.clone(),
            device_name: d.device_name.clone(),
            cdi_device_ids: d.cdi_device_ids.clone(),
            share_id: d.share_id.clone(),
        })
        .collect()
}
