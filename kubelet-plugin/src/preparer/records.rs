//! The preparer's pure parts: the checkpoint records of a claim's devices, what a claim's
//! annotations and allocation results contribute to them, and the answers made from them.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::AllocatedDevice;
use kerf_api::shared_publication::SharedPublication;
use kerf_core::cdi;
use kerf_core::checkpoint::DeviceRecord;
use kerf_core::inventory::DeviceRef;
use kerf_proto::PreparedDevice;

use super::ClaimRef;
use crate::Result;
use crate::prepare_error::PrepareError;

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

/// Two preparations of one device conflict unless both share it: slices (the controller's or
/// the scheduler's shares) coexist, a whole GPU (with or without a share ID: a scheduler share
/// of all its memory is whole) coexists with nothing.
pub(super) fn conflicts(held: &DeviceRecord, wanted: &DeviceRecord) -> bool {
    if held.admin_access || wanted.admin_access {
        return false;
    }
    is_exclusive(held) || is_exclusive(wanted)
}

pub(super) fn is_exclusive(record: &DeviceRecord) -> bool {
    record.limits.is_whole() && record.sharing == kerf_core::sharing::Sharing::Exclusive
}

/// `device` with its scheduler share completed against the GPU it is on
/// ([`AllocatedDevice::finish_share`]) and the Node's shared publication.
///
/// # Errors
/// A share that consumed more memory than the GPU has, naming
/// `status.allocation.devices.results[i].consumedCapacity.memory` and the value.
pub(super) fn finished_share(
    found: DeviceRef<'_>,
    device: &AllocatedDevice,
    publication: &SharedPublication,
) -> Result<AllocatedDevice> {
    let mut device = device.clone();
    device
        .finish_share(memory_of(found), publication.get(&device.device))
        .map_err(PrepareError::Allocation)?;
    Ok(device)
}

fn memory_of(found: DeviceRef<'_>) -> u64 {
    match found {
        DeviceRef::Gpu(gpu) => gpu.memory_bytes,
        DeviceRef::Mig { mig, .. } => mig.memory_bytes,
    }
}

/// The checkpoint record of `device`. A scheduler share not yet completed by
/// [`finished_share`] is completed here without the Node's publication (MPS, whole only at
/// exactly the GPU's memory); one larger than the GPU keeps its consumed memory as its limit.
pub(super) fn device_record(
    found: DeviceRef<'_>,
    device: &AllocatedDevice,
    request: String,
    cdi_id: String,
) -> DeviceRecord {
    let finished;
    let device = if device.share.is_some() {
        let mut copy = device.clone();
        if let Err(e) = copy.finish_share(memory_of(found), None) {
            tracing::debug!(error = %e, "share larger than its GPU; prepared with its consumed memory as the limit");
        }
        finished = copy;
        &finished
    } else {
        device
    };
    let (gpu_minor, mig) = match found {
        DeviceRef::Gpu(gpu) => (gpu.minor, None),
        DeviceRef::Mig { parent, mig } => (
            parent.minor,
            Some(cdi::MigCaps {
                gi_cap_minor: mig.gi_cap_minor,
                ci_cap_minor: mig.ci_cap_minor,
                caps_major: None,
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
        mig_instance: None,
        limits: device.limits,
        sharing: device.sharing,
        time_slice_interval: device.time_slice_interval,
    }
}

/// Refuses `wanted` when an earlier result `held` of the same claim prepares the same device
/// and the two cannot coexist: several shares of one GPU in one claim (kube-scheduler gives
/// each request of a claim its own share of a shareable GPU, kubernetes/kubernetes
/// `structured/internal/incubating/allocator_incubating.go (allocateDevice)` keeps a
/// shareable device out of `allocatingDevices`) coexist, a whole GPU coexists with nothing.
///
/// # Errors
/// [`PrepareError::Allocation`] at `status.allocation.devices.results[<index>]` naming the
/// device and both requests.
pub(super) fn check_within_claim(
    claim: &ClaimRef,
    index: usize,
    records: &[DeviceRecord],
    wanted: &DeviceRecord,
) -> Result<()> {
    let Some(held) = records
        .iter()
        .find(|held| held.device_name == wanted.device_name && conflicts(held, wanted))
    else {
        return Ok(());
    };
    let how = |r: &DeviceRecord| match (&r.share_id, is_exclusive(r)) {
        (Some(share), true) => format!("whole (share {share} of all its memory)"),
        (None, true) => "whole".to_owned(),
        (Some(share), false) => format!("as share {share}"),
        (None, false) => "as a slice".to_owned(),
    };
    let message = format!(
        "device {:?} is given {} to request {:?} and {} to request {:?} of the same claim; a GPU given whole cannot be shared",
        wanted.device_name,
        how(wanted),
        wanted.request_refs.first().map_or("", String::as_str),
        how(held),
        held.request_refs.first().map_or("", String::as_str),
    );
    Err(
        PrepareError::Allocation(kerf_api::Error::InvalidAllocation {
            claim: format!("{}/{}", claim.namespace, claim.name),
            path: format!("status.allocation.devices.results[{index}]"),
            message,
        })
        .into(),
    )
}

/// Gives each of several shares of one device in a claim its own CDI device,
/// `<claim uid>-<device>-<share>` ([`cdi::share_device_name`]), so each carries its own
/// limits; a device with one record in the claim keeps `<claim uid>-<device>`.
pub(super) fn name_shares(records: &mut [DeviceRecord], kind: &str, claim_uid: &str) {
    let shared: Vec<usize> = (0..records.len())
        .filter(|&i| {
            records[i].share_id.is_some()
                && records
                    .iter()
                    .filter(|r| r.device_name == records[i].device_name)
                    .count()
                    > 1
        })
        .collect();
    let names = |len: usize| -> Vec<String> {
        shared
            .iter()
            .map(|&i| {
                let record = &records[i];
                let share = record.share_id.as_deref().unwrap_or_default();
                cdi::share_device_name(&record.device_name, share, len)
            })
            .collect()
    };
    let mut chosen = names(8);
    let unique = chosen
        .iter()
        .collect::<std::collections::BTreeSet<_>>()
        .len()
        == chosen.len();
    if !unique {
        chosen = names(0);
    }
    for (i, name) in shared.into_iter().zip(chosen) {
        records[i].cdi_device_ids = vec![cdi::qualified_name(
            kind,
            &cdi::claim_device_name(claim_uid, &name),
        )];
    }
}

/// The device name the claim's CDI spec uses for `record`: the one its recorded CDI ID was
/// made from (so a restored spec matches the IDs the kubelet holds), `None` when that is
/// the published device name.
pub(super) fn spec_device_name<'a>(
    record: &'a DeviceRecord,
    kind: &str,
    claim_uid: &str,
) -> Option<&'a str> {
    let name = record
        .cdi_device_ids
        .first()?
        .strip_prefix(kind)?
        .strip_prefix('=')?
        .strip_prefix(claim_uid)?
        .strip_prefix('-')?;
    (name != record.device_name).then_some(name)
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use kerf_api::shared_publication::SharedSlicing;
    use kerf_core::sharing::Sharing;
    use serde_json::json;

    use super::*;

    fn share(memory: &str) -> AllocatedDevice {
        let claim: ResourceClaim = serde_json::from_value(json!({
            "metadata": { "namespace": "ns", "name": "c", "uid": "u" },
            "spec": {},
            "status": { "allocation": { "devices": { "results": [{
                "request": "gpu", "driver": "gpu.kerf.dev", "pool": "n", "device": "gpu-0",
                "shareID": "s", "consumedCapacity": { "memory": memory, "compute": "30" } }] } } },
        }))
        .unwrap();
        kerf_api::resolve_allocation(&claim, "gpu.kerf.dev")
            .unwrap()
            .remove(0)
    }

    fn record(device: &AllocatedDevice) -> DeviceRecord {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
        let found = inventory.device("gpu-0").unwrap();
        device_record(found, device, "gpu".into(), "k/c=x".into())
    }

    #[test]
    fn shares_coexist_and_a_whole_share_excludes_them() {
        let small = record(&share("10Gi"));
        assert_eq!(small.limits.memory_bytes, Some(10 << 30));
        assert_eq!(small.sharing, Sharing::Mps);
        assert!(!conflicts(&small, &record(&share("20Gi"))));
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
        let found = inventory.device("gpu-0").unwrap();
        let whole = record(&share(&found.gpu().memory_bytes.to_string()));
        assert!(whole.limits.is_whole() && whole.share_id.is_some());
        assert!(conflicts(&small, &whole) && conflicts(&whole, &small));
        let mut exclusive = small.clone();
        exclusive.share_id = None;
        exclusive.limits = kerf_core::sharing::SliceLimits::default();
        exclusive.sharing = Sharing::Exclusive;
        assert!(conflicts(&exclusive, &small));
    }

    #[test]
    fn shares_of_one_device_get_their_own_cdi_names_longer_when_8_characters_collide() {
        let with_share = |id: &str| {
            let mut r = record(&share("10Gi"));
            r.share_id = Some(id.to_owned());
            r
        };
        let kind = "k8s.gpu.kerf.dev/gpu";
        let mut records = vec![
            with_share("aaaaaaaa-0000-4000-8000-000000000001"),
            with_share("bbbbbbbb-0000-4000-8000-000000000002"),
        ];
        name_shares(&mut records, kind, "u");
        assert_eq!(
            records[0].cdi_device_ids,
            [format!("{kind}=u-gpu-0-aaaaaaaa")]
        );
        assert_eq!(
            spec_device_name(&records[1], kind, "u"),
            Some("gpu-0-bbbbbbbb")
        );
        let mut colliding = vec![
            with_share("aaaaaaaa-0000-4000-8000-000000000001"),
            with_share("aaaaaaaa-0000-4000-8000-000000000002"),
        ];
        name_shares(&mut colliding, kind, "u");
        assert_eq!(
            colliding[1].cdi_device_ids,
            [format!("{kind}=u-gpu-0-aaaaaaaa000040008000000000000002")]
        );
        // A lone share keeps the device's own name.
        let mut lone = vec![with_share("aaaaaaaa-0000-4000-8000-000000000001")];
        lone[0].cdi_device_ids = vec![format!("{kind}=u-gpu-0")];
        name_shares(&mut lone, kind, "u");
        assert_eq!(lone[0].cdi_device_ids, [format!("{kind}=u-gpu-0")]);
        assert_eq!(spec_device_name(&lone[0], kind, "u"), None);
    }

    #[test]
    fn the_publication_completes_a_share_and_refuses_one_larger_than_the_gpu() {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb").unwrap();
        let found = inventory.device("gpu-0").unwrap();
        let mut publication = SharedPublication::default();
        publication.0.insert(
            "gpu-0".into(),
            SharedSlicing {
                memory_granularity_bytes: 1 << 30,
                default_compute_percent: None,
                max_slices_per_gpu: None,
                sharing: None,
            },
        );
        let grid = found.gpu().memory_bytes >> 30 << 30;
        let whole = finished_share(found, &share(&grid.to_string()), &publication).unwrap();
        assert!(whole.limits.is_whole());
        assert_eq!(whole.sharing, Sharing::Exclusive);
        let error = finished_share(found, &share("1Ti"), &publication).unwrap_err();
        assert!(
            error.to_string().contains("consumedCapacity.memory"),
            "{error}"
        );
    }
}
