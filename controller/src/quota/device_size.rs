//! The size of the largest device a class selects (`GpuClass.status.largestDevice`): what a
//! GpuQuota charges for one whole device of the class (`kerf_api::gpuquota::DeviceSize`).
//!
//! Memory is the published `memory` capacity. Compute is in percent of a GPU: 100 for a whole
//! GPU; for a MIG device its multiprocessors over those of its GPU in MIG mode, which is the
//! GPU's largest profile (`7g.*`, the figure the dynamic-MIG counter set publishes as the GPU's
//! `multiprocessors`, `kerf_core::mig_catalog::gpu_counters`). The GPU itself is not published
//! beside its MIG devices, so its figure comes from the built-in catalogue of its product; for
//! a product without one, the profile's compute slices (`<n>g.…`) over the seven every MIG GPU
//! kerf knows has.

use k8s_openapi::api::resource::v1::DeviceAttribute;
use kerf_api::gpuclass::DeviceSizeStatus;
use kerf_api::quantity::bytes_quantity;
use kerf_api::resourceslice::{
    DeviceFields, TYPE_MIG, attributes, capacities, device_attribute, device_capacity,
    device_memory_bytes,
};

use crate::capacity::{ClassScope, PublishedDevice};

/// A whole GPU's compute, in percent.
const FULL_COMPUTE: u64 = 100;

/// Compute slices of a MIG GPU when its product has no built-in catalogue (A100, H100, H200
/// and B200 all have seven).
const COMPUTE_SLICES: u64 = 7;

/// The largest of `devices` that `scope` counts, by memory and then compute; `None` when it
/// counts none (or none publishes its memory).
pub(crate) fn largest_device(
    scope: &ClassScope<'_>,
    devices: &[PublishedDevice<'_>],
    driver: &str,
) -> Option<DeviceSizeStatus> {
    devices
        .iter()
        .filter(|d| scope.matches(d.device, driver))
        .filter_map(|d| {
            let memory = device_memory_bytes(d.device, driver)?;
            Some((memory, device_compute(d.device, driver)))
        })
        .max()
        .map(|(memory, compute)| DeviceSizeStatus {
            memory: bytes_quantity(memory),
            compute,
        })
}

/// The compute of one device in percent of a GPU (see the module documentation).
pub(crate) fn device_compute<D: DeviceFields + ?Sized>(device: &D, driver: &str) -> u64 {
    let text = |name| device_attribute(device, driver, name).and_then(string);
    if text(attributes::TYPE) != Some(TYPE_MIG) {
        return FULL_COMPUTE;
    }
    let multiprocessors = device_capacity(device, driver, capacities::MULTIPROCESSORS)
        .and_then(|q| q.0.trim().parse::<u64>().ok());
    let gpu_multiprocessors = text(attributes::PRODUCT_NAME)
        .and_then(kerf_core::mig_catalog::catalog_for)
        .and_then(|catalog| {
            catalog
                .profiles
                .iter()
                .map(|p| u64::from(p.multiprocessors))
                .max()
        })
        .filter(|n| *n > 0);
    let share = match (multiprocessors, gpu_multiprocessors) {
        (Some(own), Some(gpu)) => Some(own.saturating_mul(FULL_COMPUTE) / gpu),
        _ => text(attributes::PROFILE)
            .and_then(|profile| profile.split_once('g'))
            .and_then(|(slices, _)| slices.parse::<u64>().ok())
            .map(|slices| slices.saturating_mul(FULL_COMPUTE) / COMPUTE_SLICES),
    };
    // Never 0: a MIG device holds some of its GPU; never past the whole GPU.
    share.map_or(FULL_COMPUTE, |s| s.clamp(1, FULL_COMPUTE))
}

fn string(attribute: &DeviceAttribute) -> Option<&str> {
    attribute.string.as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const DRIVER: &str = "gpu.kerf.dev";

    /// Each device's profile (or type) and compute, as the mock node `profile` publishes them.
    fn computes(profile: &str) -> BTreeMap<String, u64> {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, "node-a")
            .unwrap()
            .into_iter()
            .flat_map(|spec| spec.devices.unwrap_or_default())
            .map(|device| {
                let kind = device_attribute(&device, DRIVER, attributes::PROFILE)
                    .or_else(|| device_attribute(&device, DRIVER, attributes::TYPE))
                    .and_then(string)
                    .unwrap()
                    .to_owned();
                (kind, device_compute(&device, DRIVER))
            })
            .collect()
    }

    #[test]
    fn a_whole_gpu_is_100_and_a_mig_device_its_share_of_the_multiprocessors() {
        assert_eq!(
            computes("h100-sxm-80gb:1"),
            BTreeMap::from([("gpu".to_owned(), 100)])
        );
        // The mock's first A100-40GB is in MIG mode: 14, 28 and 42 multiprocessors of the 98 of its 7g.40gb profile.
        assert_eq!(
            computes("a100-40gb-mig:1"),
            BTreeMap::from([
                ("1g.5gb".to_owned(), 14),
                ("2g.10gb".to_owned(), 28),
                ("3g.20gb".to_owned(), 42),
            ])
        );
    }
}
