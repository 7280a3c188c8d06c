//! Shared counters (DRAPartitionableDevices, beta and on in 1.36): a pool's slices publish
//! counter sets (`spec.sharedCounters`, since 1.35 in slices without devices), devices
//! consume from them (`consumesCounters`), and a device fits only while every counter stays
//! covered.
//!
//! Upstream: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`
//! (`checkAvailableCounters`): available = the pool's counter values − what every
//! **allocated** device of the pool consumes (all its slices, whichever node they target;
//! `IsDeviceAllocated`, so a device with several shares counts once); then the devices of
//! the current attempt are added up, and the device fits when no counter of any set of the
//! pool is exceeded. `allocateDevice` skips the check for a shareable device that already
//! has consumed capacity (`skipCounterCheck`): its counters are taken once.

use std::collections::HashMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::allocated::AllocatedState;
use super::capacity::amount;

/// Counter amounts (units of 10⁻⁹) by (counter set, counter).
pub(super) type Counters = HashMap<(String, String), i128>;

/// What `device` consumes, by (counter set, counter).
///
/// # Errors
///
/// A counter value that does not parse, naming the device.
pub(super) fn consumption(device: &Device) -> Result<Counters, String> {
    let mut counters = Counters::new();
    for consumption in device.consumes_counters.iter().flatten() {
        for (name, counter) in &consumption.counters {
            let what = format!(
                "device {} consumesCounters {}/{name}",
                device.name, consumption.counter_set
            );
            *counters
                .entry((consumption.counter_set.clone(), name.clone()))
                .or_insert(0) += amount(&counter.value, &what)?;
        }
    }
    Ok(counters)
}

/// What is left of a pool's counters after its allocated devices: `pool` holds all slices
/// of the pool's current generation.
///
/// # Errors
///
/// A counter value that does not parse.
pub(super) fn available(
    pool: &[&ResourceSlice],
    state: &AllocatedState,
) -> Result<Counters, String> {
    let mut available = Counters::new();
    for slice in pool {
        for set in slice.spec.shared_counters.iter().flatten() {
            for (name, counter) in &set.counters {
                let what = format!("slice counter {}/{name}", set.name);
                available.insert(
                    (set.name.clone(), name.clone()),
                    amount(&counter.value, &what)?,
                );
            }
        }
    }
    for slice in pool {
        for device in slice.spec.devices.iter().flatten() {
            let id = (
                slice.spec.driver.clone(),
                slice.spec.pool.name.clone(),
                device.name.clone(),
            );
            if !state.is_allocated(&id) {
                continue;
            }
            for (key, value) in consumption(device)? {
                // Upstream ignores consumption of counters that do not exist (validation
                // forbids them); a negative balance just means nothing is left.
                if let Some(left) = available.get_mut(&key) {
                    *left -= value;
                }
            }
        }
    }
    Ok(available)
}

/// Whether `allocating` (the attempt's consumption so far, this device included) stays
/// within `available` for every counter of the pool.
pub(super) fn within(available: &Counters, allocating: &Counters) -> bool {
    available
        .iter()
        .all(|(key, left)| allocating.get(key).copied().unwrap_or(0) <= *left)
}
