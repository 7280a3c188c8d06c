//! The `status.allocation` the controller writes for a placement ([`allocation_status`]).

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, OpaqueDeviceConfiguration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::ClaimPlacement;
use kerf_core::sharing::Sharing;

use crate::claim::SOURCE_FROM_CLAIM;
use crate::error::{Error, Result};
use crate::params::{GpuSliceAllocation, OpaqueKind, SliceDevice};

/// Most results one allocation may hold (`AllocationResultsMaxSize`).
pub(crate) const MAX_ALLOCATION_RESULTS: usize = 32;

/// The `status.allocation` that puts `placement`'s devices on `node`.
///
/// - `devices.results[]`: one per placed device, in placement order: `request`, `driver`,
///   `pool` = node, `device`.
/// - `devices.config[]`: one `source: FromClaim` entry for every request of the placement with
///   an opaque `GpuSliceAllocation` of `driver` that lists every device, whole GPUs included
///   (without memory or compute), so the kubelet plugin checks the GPU UUID of each and gets
///   the exact slice, sharing and (for a TimeSlicing device whose class names one) time slice
///   interval without re-deriving them from claim and class parameters. A slice's zero memory
///   or compute is left unset (not limited).
/// - `nodeSelector`: `matchFields metadata.name In [node]`, as the scheduler writes it.
/// - `allocationTimestamp`: `now`. Required: without it a 1.36+ scheduler's attempt to reserve
///   the claim stamps the timestamp onto the immutable allocation and is rejected.
///
/// # Errors
///
/// [`Error::InvalidConfig`] when the placement has more than `MAX_ALLOCATION_RESULTS`
/// devices or a device the `GpuSliceAllocation` cannot describe (empty name or UUID).
pub fn allocation_status(
    placement_for_claim: &ClaimPlacement,
    node: &str,
    driver: &str,
    now: Time,
) -> Result<AllocationResult> {
    let placed = &placement_for_claim.devices;
    if placed.len() > MAX_ALLOCATION_RESULTS {
        return Err(Error::config(
            "status.allocation.devices.results",
            format!(
                "{} devices; an allocation holds at most {MAX_ALLOCATION_RESULTS}",
                placed.len()
            ),
        ));
    }
    let results = placed
        .iter()
        .map(|device| DeviceRequestAllocationResult {
            request: device.request.clone(),
            driver: driver.to_owned(),
            pool: node.to_owned(),
            device: device.device.clone(),
            ..DeviceRequestAllocationResult::default()
        })
        .collect();
    let config = if placed.is_empty() {
        None
    } else {
        Some(vec![slice_config(placement_for_claim, node, driver)?])
    };
    Ok(AllocationResult {
        allocation_timestamp: Some(now),
        devices: Some(DeviceAllocationResult {
            results: Some(results),
            config,
        }),
        node_selector: Some(node_selector(node)),
    })
}

fn slice_config(
    placement: &ClaimPlacement,
    node: &str,
    driver: &str,
) -> Result<DeviceAllocationConfiguration> {
    let slices = GpuSliceAllocation {
        devices: placement
            .devices
            .iter()
            .map(|device| {
                let size = device.slice.unwrap_or_default();
                SliceDevice {
                    pool: node.to_owned(),
                    device: device.device.clone(),
                    share_id: None,
                    gpu_uuid: device.gpu_uuid.clone(),
                    memory_bytes: (size.memory_bytes > 0).then_some(size.memory_bytes),
                    compute_percent: (size.compute_percent > 0).then_some(size.compute_percent),
                    sharing: device.sharing,
                    // The node refuses an interval on a device that is not time-sliced.
                    time_slice_interval: device
                        .time_slice_interval
                        .filter(|_| device.sharing == Sharing::TimeSlicing),
                    enforcement: device.enforcement,
                }
            })
            .collect(),
    };
    slices.validate("status.allocation.devices.config[0].opaque.parameters")?;
    let mut requests: Vec<String> = Vec::new();
    for device in &placement.devices {
        if !requests.contains(&device.request) {
            requests.push(device.request.clone());
        }
    }
    Ok(DeviceAllocationConfiguration {
        source: SOURCE_FROM_CLAIM.to_owned(),
        requests: Some(requests),
        opaque: Some(OpaqueDeviceConfiguration {
            driver: driver.to_owned(),
            parameters: slices.to_raw_extension()?,
        }),
    })
}

/// `matchFields metadata.name In [node]`.
pub fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_owned(),
                operator: "In".to_owned(),
                values: Some(vec![node.to_owned()]),
            }]),
        }],
    }
}
