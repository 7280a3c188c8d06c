//! [`node_slices`]: the whole pool of one node for a given set of API features, cut into
//! slices the API server accepts.

use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};
use kerf_core::inventory::{DeviceRef, Gpu, Inventory};

use std::collections::BTreeSet;

use super::device::publish_device;
use super::dynamic_mig::{counter_set, is_partitionable};
use super::limits::{
    MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE_WITH_COUNTERS, check_pool, check_slice,
};
use super::names::{MAX_DEVICES_PER_SLICE, MAX_DOMAIN_LEN, is_dns_subdomain};
use super::taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS;
use crate::error::{Error, Result};

/// The optional API features a node's slices may use, as the start-up probes found them
/// ([`crate::features`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResourceSliceFeatures {
    /// `DRADeviceTaints`: devices may carry taints, so every slice holds at most 64 devices
    /// whether or not a device is tainted now (a taint never re-cuts the pool). The taints
    /// themselves are set afterwards ([`super::taints::set_health_taints`]).
    pub device_taints: bool,
    /// `DRAPartitionableDevices`: dynamic-MIG GPUs are published as counter sets and
    /// placement devices ([`super::dynamic_mig`]); without it as whole GPUs.
    pub partitionable_devices: bool,
}

/// The ResourceSlice specs of `node_name`'s pool of `driver` with `features`: what the kubelet
/// plugin publishes (before it adds taints, the `allocator` attribute and scheduler slices).
///
/// Without partitionable devices, or without a dynamic-MIG GPU, this is
/// `resource_slices_chunked` at 128 devices per slice (64 with device taints); a dynamic-MIG
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
    features: ResourceSliceFeatures,
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

/// Builds the ResourceSlice specs that publish `inventory` for `node_name`.
///
/// The pool is named after the node and `spec.nodeName` is the node. Devices are ordered by
/// GPU minor number, then MIG placement, and split into slices of at most
/// `MAX_DEVICES_PER_SLICE`; every slice carries the pool's `resourceSliceCount`. An empty
/// inventory gives one empty slice, so consumers see the pool. `pool.generation` is 0: the
/// publisher sets it.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when the driver or node name is invalid, two devices have
/// the same name, a version cannot be written as semver, the PCI bus ID is not in BDF form, or
/// a device breaks an API limit (name length, value length, attribute count; the count
/// includes the `allocator` attribute the kubelet plugin adds later).
pub fn resource_slices(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
) -> Result<Vec<ResourceSliceSpec>> {
    resource_slices_chunked(inventory, driver, node_name, MAX_DEVICES_PER_SLICE)
}

/// [`resource_slices`] with at most `max_devices` devices per slice: the kubelet plugin
/// passes [`super::taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS`] whenever it may publish device taints,
/// so that a taint appearing on a device never changes how the pool is cut into slices.
///
/// # Errors
///
/// As [`resource_slices`]; also [`Error::InvalidResourceSlice`] when `max_devices` is 0 or
/// above [`MAX_DEVICES_PER_SLICE`].
pub(crate) fn resource_slices_chunked(
    inventory: &Inventory,
    driver: &str,
    node_name: &str,
    max_devices: usize,
) -> Result<Vec<ResourceSliceSpec>> {
    if max_devices == 0 || max_devices > MAX_DEVICES_PER_SLICE {
        return Err(Error::slice(
            "spec.devices",
            format!(
                "{max_devices} devices per slice; must be between 1 and {MAX_DEVICES_PER_SLICE}"
            ),
        ));
    }
    check_driver_name(driver)?;
    check_node_name(node_name)?;
    let devices = published_devices(inventory)?;
    let mut chunks: Vec<Vec<Device>> = Vec::new();
    for device in devices {
        match chunks.last_mut() {
            Some(chunk) if chunk.len() < max_devices => chunk.push(device),
            _ => chunks.push(vec![device]),
        }
    }
    if chunks.is_empty() {
        chunks.push(Vec::new());
    }
    let count = i64::try_from(chunks.len())
        .map_err(|_| Error::slice("pool.resourceSliceCount", "too many slices"))?;
    Ok(chunks
        .into_iter()
        .map(|devices| ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node_name.to_owned()),
            pool: ResourcePool {
                name: node_name.to_owned(),
                generation: 0,
                resource_slice_count: count,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        })
        .collect())
}

/// Every device of the inventory, in a stable order (GPU minor, then MIG placement), checked
/// against the API limits. A dynamic-MIG GPU is its whole GPU only: its MIG devices are
/// instances kerf created for placements ([`device_groups`]).
pub(super) fn published_devices(inventory: &Inventory) -> Result<Vec<Device>> {
    Ok(device_groups(inventory, false)?
        .into_iter()
        .flatten()
        .collect())
}

/// The devices of each GPU, GPUs by minor: a GPU without MIG is its whole GPU; a GPU with MIG
/// its existing MIG devices; a dynamic-MIG GPU ([`Gpu::dynamic_mig`]) with a catalogue, when
/// `partitioned`, one device per placement ([`super::dynamic_mig::gpu_devices`]), else
/// nothing. A GPU in MIG mode runs no CUDA work as a whole GPU, so it is never published
/// whole. The existing MIG devices of a dynamic-MIG GPU are never published: they are the
/// instances kerf created for allocated placements, which stay published under the
/// placement's name.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when a device breaks an API limit or two devices share a name.
pub(super) fn device_groups(inventory: &Inventory, partitioned: bool) -> Result<Vec<Vec<Device>>> {
    let mut gpus: Vec<&Gpu> = inventory.gpus.iter().collect();
    gpus.sort_by_key(|g| g.minor);
    let mut seen = BTreeSet::new();
    let mut groups = Vec::with_capacity(gpus.len());
    for gpu in gpus {
        let devices = gpu_group(gpu, inventory, partitioned)?;
        for device in &devices {
            if !seen.insert(device.name.clone()) {
                return Err(Error::slice(
                    format!("devices[{:?}]", device.name),
                    "two devices of the inventory have this name (duplicate GPU minor or MIG placement)",
                ));
            }
        }
        groups.push(devices);
    }
    Ok(groups)
}

fn gpu_group(gpu: &Gpu, inventory: &Inventory, partitioned: bool) -> Result<Vec<Device>> {
    if gpu.dynamic_mig {
        return match (&gpu.mig_catalog, partitioned) {
            (Some(catalog), true) => super::dynamic_mig::gpu_devices(gpu, catalog, inventory),
            _ => Ok(Vec::new()),
        };
    }
    if !gpu.mig_enabled {
        return Ok(vec![publish_device(DeviceRef::Gpu(gpu), inventory)?]);
    }
    let mut migs: Vec<_> = gpu.mig_devices.iter().collect();
    migs.sort_by(|a, b| {
        (a.placement.start, a.profile.as_str(), a.gi_id).cmp(&(
            b.placement.start,
            b.profile.as_str(),
            b.gi_id,
        ))
    });
    migs.into_iter()
        .map(|mig| publish_device(DeviceRef::Mig { parent: gpu, mig }, inventory))
        .collect()
}

fn check_driver_name(driver: &str) -> Result<()> {
    if driver.len() <= MAX_DOMAIN_LEN && is_dns_subdomain(driver) {
        Ok(())
    } else {
        Err(Error::slice(
            "spec.driver",
            format!("{driver:?} is not a DNS subdomain of at most 63 characters"),
        ))
    }
}

fn check_node_name(node: &str) -> Result<()> {
    if is_dns_subdomain(node) {
        Ok(())
    } else {
        Err(Error::slice(
            "spec.pool.name",
            format!("node name {node:?} is not a DNS subdomain of at most 253 characters"),
        ))
    }
}
