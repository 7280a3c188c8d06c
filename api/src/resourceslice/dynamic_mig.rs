//! Dynamic-MIG GPUs as partitionable devices (`DRAPartitionableDevices`, beta in Kubernetes
//! 1.36): kube-scheduler picks a MIG placement that fits, and the kubelet plugin creates it at
//! prepare.
//!
//! For each GPU with [`Gpu::dynamic_mig`] and a catalogue ([`Gpu::mig_catalog`]):
//! - a counter set named [`counter_set_name`] (`gpu-<minor>`) with the GPU's counters
//!   ([`gpu_counters`]: `memory-slice-0..7`, `compute-slices`, `multiprocessors`, `memory`
//!   and the engines);
//! - one device per catalogue placement ([`CatalogPlacement::device_name`], e.g.
//!   `gpu-0-mig-1g-5gb-3`) consuming its profile's figures and the memory slices it covers
//!   ([`placement_consumption`]), with the attributes of a MIG device except `uuid` (the
//!   instance does not exist yet) plus `giProfileId`, and the capacities `memory` and
//!   `multiprocessors` of the profile.
//!
//! The full GPU is not published, unlike in NVIDIA's DRA driver, which turns MIG mode off to
//! prepare it (`nvlib.go` `maybeDisableMigMode`): kerf manages only GPUs already in MIG mode,
//! where the whole GPU runs no CUDA work, and switching MIG mode needs a GPU reset on A100.
//! The largest placement (`7g.40gb` on an A100-40GB) is the whole GPU as one MIG device.
//!
//! The shape follows NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu
//! `cmd/gpu-kubelet-plugin/partitions.go` (`PartSharedCounterSets`), `mig.go`
//! (`MigSpec.PartConsumesCounters`), `nvlib.go` (`GpuInfo.PartConsumesCounters`)), and how
//! the slices are laid out its `driver.go` (`generateSplitResourceSlices`): counter sets in
//! slices of their own, devices in others of the same pool ([`super::node_slices`]).
//! How the scheduler uses the counters: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`
//! (`checkAvailableCounters`): a device fits when, for every counter of its set, the set's value
//! minus what the pool's allocated devices consume covers its own consumption.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Counter, CounterSet, Device, DeviceCounterConsumption};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_core::inventory::{Gpu, Inventory};
use kerf_core::mig_catalog::{
    COUNTER_MEMORY, CatalogPlacement, GpuMigCatalog, counter_set_name, gpu_counters,
    placement_consumption,
};

use super::device::{Attributes, capacity, check_names_and_count, common_attributes};
use super::names::{TYPE_MIG, attributes, capacities, is_dns_label};
use crate::error::{Error, Result};
use crate::quantity::bytes_quantity;

/// Whether [`super::node_slices`] publishes `gpu` as partitionable devices when the API
/// server keeps them: dynamic MIG with a catalogue.
pub fn is_partitionable(gpu: &Gpu) -> bool {
    gpu.dynamic_mig && gpu.mig_catalog.is_some()
}

/// The counter set of GPU `gpu` with `catalog`: [`counter_set_name`] and [`gpu_counters`].
pub fn counter_set(gpu: &Gpu, catalog: &GpuMigCatalog) -> CounterSet {
    CounterSet {
        name: counter_set_name(gpu.minor),
        counters: counters(&gpu_counters(catalog)),
    }
}

/// The devices of a dynamic-MIG GPU: one per placement, in catalogue order.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when a device breaks an API limit (name, attribute value
/// length or count).
pub(crate) fn gpu_devices(
    gpu: &Gpu,
    catalog: &GpuMigCatalog,
    inventory: &Inventory,
) -> Result<Vec<Device>> {
    catalog
        .placements()
        .map(|placement| placement_device(gpu, placement, inventory))
        .collect()
}

/// The device of one placement of GPU `gpu`.
///
/// # Errors
///
/// As [`gpu_devices`].
fn placement_device(
    gpu: &Gpu,
    placement: CatalogPlacement<'_>,
    inventory: &Inventory,
) -> Result<Device> {
    let name = placement.device_name(gpu.minor);
    let at = format!("devices[{name:?}]");
    if !is_dns_label(&name) {
        return Err(Error::slice(
            at,
            "device name is not a DNS label of at most 63 characters",
        ));
    }
    let profile = placement.profile;
    let mut attrs = Attributes::new(&at);
    common_attributes(&mut attrs, gpu, None, inventory)?;
    attrs.string(attributes::TYPE, TYPE_MIG)?;
    attrs.string(attributes::PROFILE, &profile.name)?;
    attrs.string(attributes::PARENT_UUID, &gpu.uuid)?;
    attrs.int(attributes::PARENT_MINOR, gpu.minor);
    attrs.int(attributes::PLACEMENT_START, placement.placement.start);
    attrs.int(attributes::PLACEMENT_SIZE, placement.placement.size);
    attrs.int(attributes::GI_PROFILE_ID, profile.gi_profile_id);
    let capacity = BTreeMap::from([
        (
            capacities::MEMORY.to_owned(),
            capacity(bytes_quantity(profile.memory_bytes())),
        ),
        (
            capacities::MULTIPROCESSORS.to_owned(),
            capacity(Quantity(profile.multiprocessors.to_string())),
        ),
    ]);
    check_names_and_count(&at, &attrs.map, &capacity)?;
    Ok(Device {
        name,
        attributes: Some(attrs.map),
        capacity: Some(capacity),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: counter_set_name(gpu.minor),
            counters: counters(&placement_consumption(profile, placement.placement)),
        }]),
        ..Device::default()
    })
}

/// Counter values as quantities: bytes for `memory` (`40192Mi`), plain numbers otherwise.
fn counters(values: &BTreeMap<String, u64>) -> BTreeMap<String, Counter> {
    values
        .iter()
        .map(|(name, &value)| {
            let value = if name == COUNTER_MEMORY {
                bytes_quantity(value)
            } else {
                Quantity(value.to_string())
            };
            (name.clone(), Counter { value })
        })
        .collect()
}
