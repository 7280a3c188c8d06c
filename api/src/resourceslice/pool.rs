//! [`node_slices`]: the whole pool of one node for a given set of API features, cut into
//! slices the API server accepts.

use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};
use kerf_core::inventory::{Gpu, Inventory};

use super::device::device_groups;
use super::dynamic_mig::{counter_set, is_partitionable};
use super::limits::{
    MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE_WITH_COUNTERS, check_pool, check_slice,
};
use super::taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS;
use super::{MAX_DEVICES_PER_SLICE, check_driver_name, check_node_name, resource_slices_chunked};
use crate::error::{Error, Result};

/// The optional API features a node's slices may use, as the start-up probes found them
/// ([`crate::features`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SliceFeatures {
    /// `DRADeviceTaints`: devices may carry taints, so every slice holds at most 64 devices
    /// whether or not a device is tainted now (a taint never re-cuts the pool). The taints
    /// themselves are set afterwards ([`super::taints::set_health_taints`]).
    pub device_taints: bool,
    /// `DRAPartitionableDevices`: dynamic-MIG GPUs are published as counter sets and
    /// placement devices ([`super::partitions`]); without it as whole GPUs.
    pub partitionable_devices: bool,
}

/// The ResourceSlice specs of `node_name`'s pool of `driver` with `features`: what the kubelet
/// plugin publishes (before it adds taints, the `allocator` attribute and scheduler slices).
///
/// Without partitionable devices, or without a dynamic-MIG GPU, this is
/// [`resource_slices_chunked`] at 128 devices per slice (64 with device taints); a dynamic-MIG
/// GPU is then its whole GPU, and its MIG devices (instances kerf created) are not published.
///
/// With partitionable devices and at least one dynamic-MIG GPU with a catalogue, the pool is:
/// first the counter-set slices (`sharedCounters` only, at most 8 sets each, GPUs by minor),
/// then the device slices (`devices` only, at most 64 devices each), each holding the devices
/// of whole GPUs: the devices of one GPU are never split across slices. Every slice carries
/// `spec.nodeName` and the pool's `resourceSliceCount`, and is checked with
/// [`check_slice`]; the pool with [`check_pool`].
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when the driver or node name is invalid, a device breaks an
/// API limit, one GPU has more devices than a slice may hold, or a slice breaks a limit.
pub fn node_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
    features: SliceFeatures,
) -> Result<Vec<ResourceSliceSpec>> {
    let max_devices = if features.device_taints {
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    let mut partitioned: Vec<&Gpu> = inventory
        .gpus
        .iter()
        .filter(|g| features.partitionable_devices && is_partitionable(g))
        .collect();
    if partitioned.is_empty() {
        let specs = resource_slices_chunked(inventory, driver, node_name, max_devices)?;
        specs.iter().try_for_each(check_slice)?;
        return Ok(specs);
    }
    check_driver_name(driver)?;
    check_node_name(node_name)?;
    partitioned.sort_by_key(|g| g.minor);
    let mut specs: Vec<ResourceSliceSpec> = Vec::new();
    for chunk in partitioned.chunks(MAX_COUNTER_SETS_PER_SLICE) {
        let sets = chunk
            .iter()
            .filter_map(|gpu| Some(counter_set(gpu, gpu.mig_catalog.as_ref()?)))
            .collect();
        specs.push(spec(driver, node_name, None, Some(sets)));
    }
    for devices in pack(device_groups(inventory, true)?)? {
        specs.push(spec(driver, node_name, Some(devices), None));
    }
    let count = i64::try_from(specs.len())
        .map_err(|_| Error::slice("pool.resourceSliceCount", "too many slices"))?;
    for spec in &mut specs {
        spec.pool.resource_slice_count = count;
        check_slice(spec)?;
    }
    check_pool(&specs)?;
    Ok(specs)
}

/// Packs the GPUs' device groups, in order, into slices of at most
/// [`MAX_DEVICES_PER_SLICE_WITH_COUNTERS`] devices without splitting a group.
fn pack(groups: Vec<Vec<Device>>) -> Result<Vec<Vec<Device>>> {
    let max = MAX_DEVICES_PER_SLICE_WITH_COUNTERS;
    let mut slices: Vec<Vec<Device>> = Vec::new();
    for group in groups.into_iter().filter(|g| !g.is_empty()) {
        if group.len() > max {
            return Err(Error::slice(
                format!("devices[{:?}]", group[0].name),
                format!(
                    "the GPU has {} devices; a slice with counters holds at most {max}",
                    group.len()
                ),
            ));
        }
        match slices.last_mut() {
            Some(slice) if slice.len() + group.len() <= max => slice.extend(group),
            _ => slices.push(group),
        }
    }
    Ok(slices)
}

fn spec(
    driver: &str,
    node_name: &str,
    devices: Option<Vec<Device>>,
    shared_counters: Option<Vec<k8s_openapi::api::resource::v1::CounterSet>>,
) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: driver.to_owned(),
        node_name: Some(node_name.to_owned()),
        pool: ResourcePool {
            name: node_name.to_owned(),
            generation: 0,
            resource_slice_count: 1,
        },
        devices,
        shared_counters,
        ..ResourceSliceSpec::default()
    }
}
