//! Shared counters (DRAPartitionableDevices, beta and on in 1.36): kube-scheduler's rule for
//! whether a partitionable device still fits its pool's counter sets. A pool's slices publish
//! counter sets (`spec.sharedCounters`, since 1.35 in slices without devices), devices consume
//! from them (`consumesCounters`), and a device fits only while every counter stays covered.
//!
//! Upstream: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`,
//! `checkAvailableCounters`: available = the pool's counter values − what every **allocated**
//! device of the pool consumes (all its slices, whichever node they target;
//! `IsDeviceAllocated`, so a device with several shares counts once); then the devices of the
//! current attempt are added up, and the device fits when no counter of any set of the pool
//! is exceeded. Consumption of a counter the pool does not publish is ignored (API validation
//! forbids it), and a negative balance just means nothing is left. (`allocateDevice` skips the
//! check for a shareable device that already has consumed capacity, `skipCounterCheck`; that
//! part belongs to the caller's allocator.)
//!
//! Counter values are Kubernetes quantities; callers pass the parser that turns them into
//! whole numbers in their unit (`AmountOf`), so that one rule serves every caller.

use std::collections::HashMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Counter amounts by (counter set, counter), in the unit of the caller's `AmountOf`.
pub type Counters = HashMap<(String, String), i128>;

/// Parses a counter value; the second argument names the counter for the error.
type AmountOf<'a, E> = &'a dyn Fn(&Quantity, &str) -> Result<i128, E>;

/// What `device` consumes, by (counter set, counter).
///
/// # Errors
///
/// A counter value `amount` refuses.
pub fn consumption<E>(device: &Device, amount: AmountOf<'_, E>) -> Result<Counters, E> {
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

/// Whether `device` consumes counters at all (a partitionable device).
pub fn consumes(device: &Device) -> bool {
    device
        .consumes_counters
        .as_ref()
        .is_some_and(|c| !c.is_empty())
}

/// What is left of a pool's counters after its allocated devices: `pool` holds all slices
/// of the pool's current generation, `is_allocated` says whether a device of a slice is
/// allocated (exclusively or by at least one share).
///
/// # Errors
///
/// A counter value `amount` refuses.
pub fn available<E>(
    pool: &[&ResourceSlice],
    is_allocated: impl Fn(&ResourceSlice, &Device) -> bool,
    amount: AmountOf<'_, E>,
) -> Result<Counters, E> {
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
            if !is_allocated(slice, device) {
                continue;
            }
            for (key, value) in consumption(device, amount)? {
                if let Some(left) = available.get_mut(&key) {
                    *left -= value;
                }
            }
        }
    }
    Ok(available)
}

/// Whether `allocating` (the attempt's consumption so far, the device being tried included)
/// stays within `available` for every counter of the pool.
pub fn within(available: &Counters, allocating: &Counters) -> bool {
    available
        .iter()
        .all(|(key, left)| allocating.get(key).copied().unwrap_or(0) <= *left)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{
        Counter, CounterSet, DeviceCounterConsumption, ResourceSliceSpec,
    };

    use super::*;

    fn parse(quantity: &Quantity, what: &str) -> Result<i128, String> {
        quantity.0.parse().map_err(|_| format!("{what}: bad"))
    }

    fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, Counter> {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    (*n).to_owned(),
                    Counter {
                        value: Quantity((*v).to_owned()),
                    },
                )
            })
            .collect()
    }

    fn device(name: &str, memory: &str) -> Device {
        Device {
            name: name.to_owned(),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: "gpu-0".to_owned(),
                counters: values(&[("memory", memory), ("unpublished", "5")]),
            }]),
            ..Device::default()
        }
    }

    fn slice() -> ResourceSlice {
        ResourceSlice {
            spec: ResourceSliceSpec {
                shared_counters: Some(vec![CounterSet {
                    name: "gpu-0".to_owned(),
                    counters: values(&[("memory", "8")]),
                }]),
                devices: Some(vec![device("a", "3"), device("b", "4"), device("c", "6")]),
                ..ResourceSliceSpec::default()
            },
            ..ResourceSlice::default()
        }
    }

    #[test]
    fn allocated_devices_are_taken_and_unpublished_counters_ignored() {
        let slice = slice();
        let left = available(&[&slice], |_, d| d.name == "a", &parse).unwrap();
        assert_eq!(left[&("gpu-0".to_owned(), "memory".to_owned())], 5);
        assert_eq!(left.len(), 1, "a counter no set publishes is not tracked");
        let b = consumption(&device("b", "4"), &parse).unwrap();
        assert!(within(&left, &b));
        let c = consumption(&device("c", "6"), &parse).unwrap();
        assert!(!within(&left, &c), "6 of the 5 left does not fit");
        assert!(consumes(&device("c", "6")));
        assert!(!consumes(&Device::default()));
    }

    #[test]
    fn a_value_the_parser_refuses_is_an_error_naming_the_counter() {
        let error = consumption(&device("d", "x"), &parse).unwrap_err();
        assert_eq!(error, "device d consumesCounters gpu-0/memory: bad");
    }
}
