//! Shared counters for the scheduler stand-in ([`super::scheduler`]): which partitionable
//! devices (dynamic-MIG placements) still fit their GPU's counter set.
//!
//! The rule is kube-scheduler's, from kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go`
//! (`checkAvailableCounters`): what is available of a pool's counter set is its value minus
//! what the pool's already allocated devices consume (negative counts as nothing left); the
//! devices the current allocation attempt takes add their consumption, and a device fits when
//! afterwards no counter of any set is consumed beyond what is available. The stand-in keeps
//! one [`Counters`] per node and claim attempt, starting from the devices other claims hold.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{CounterSet, Device};

/// A counter value as a number: counters here are byte quantities (`4864Mi`) or counts
/// (`1`, `14`), both whole numbers; a value that is neither counts as zero, which only
/// makes a device consuming it fit (the API server refuses such slices).
fn value(quantity: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> i128 {
    kerf_api::quantity::parse_bytes(&quantity.0).map_or(0, i128::from)
}

/// What is left of one node's counter sets, by set and counter name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    available: BTreeMap<String, BTreeMap<String, i128>>,
}

impl Counters {
    /// The node's counter sets minus the consumption of the devices in `held` (allocated to
    /// other claims), as `checkAvailableCounters` computes a pool's available counters.
    pub fn available(sets: &[CounterSet], devices: &[Device], held: &BTreeSet<String>) -> Self {
        let mut counters = Counters {
            available: sets
                .iter()
                .map(|set| {
                    let values = set
                        .counters
                        .iter()
                        .map(|(name, c)| (name.clone(), value(&c.value)))
                        .collect();
                    (set.name.clone(), values)
                })
                .collect(),
        };
        for device in devices.iter().filter(|d| held.contains(&d.name)) {
            counters.subtract(device);
        }
        counters
    }

    /// Whether `device` consumes counters at all (a partitionable device).
    pub fn consumes(device: &Device) -> bool {
        device
            .consumes_counters
            .as_ref()
            .is_some_and(|c| !c.is_empty())
    }

    /// Whether `device` fits what is left: every counter it consumes is available. Counters
    /// of a set the node does not publish are not checked, as upstream skips them (API
    /// validation makes sure they exist).
    pub fn fits(&self, device: &Device) -> bool {
        device
            .consumes_counters
            .iter()
            .flatten()
            .all(|consumption| {
                let Some(set) = self.available.get(&consumption.counter_set) else {
                    return true;
                };
                consumption.counters.iter().all(|(name, c)| {
                    set.get(name)
                        .is_none_or(|available| *available >= value(&c.value))
                })
            })
    }

    /// Takes `device`'s consumption from what is left.
    pub fn subtract(&mut self, device: &Device) {
        for consumption in device.consumes_counters.iter().flatten() {
            let Some(set) = self.available.get_mut(&consumption.counter_set) else {
                continue;
            };
            for (name, c) in &consumption.counters {
                if let Some(available) = set.get_mut(name) {
                    *available -= value(&c.value);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{Counter, DeviceCounterConsumption};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::*;

    fn counters(values: &[(&str, &str)]) -> BTreeMap<String, Counter> {
        values
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

    fn device(name: &str, values: &[(&str, &str)]) -> Device {
        Device {
            name: name.to_owned(),
            consumes_counters: Some(vec![DeviceCounterConsumption {
                counter_set: "gpu-0".to_owned(),
                counters: counters(values),
            }]),
            ..Device::default()
        }
    }

    fn set() -> Vec<CounterSet> {
        vec![CounterSet {
            name: "gpu-0".to_owned(),
            counters: counters(&[
                ("memory-slice-0", "1"),
                ("memory-slice-1", "1"),
                ("memory", "10Gi"),
            ]),
        }]
    }

    #[test]
    fn overlapping_placements_exclude_each_other_and_others_fit_beside() {
        let first = device("p0", &[("memory-slice-0", "1"), ("memory", "5Gi")]);
        let overlapping = device("p0-me", &[("memory-slice-0", "1"), ("memory", "1Gi")]);
        let beside = device("p1", &[("memory-slice-1", "1"), ("memory", "5Gi")]);
        let full = device("full", &[("memory-slice-0", "1"), ("memory-slice-1", "1")]);
        let devices = vec![first.clone(), overlapping.clone(), beside.clone()];
        let held = BTreeSet::from(["p0".to_owned()]);
        let mut left = Counters::available(&set(), &devices, &held);
        assert!(!left.fits(&overlapping));
        assert!(!left.fits(&full));
        assert!(left.fits(&beside));
        left.subtract(&beside);
        assert!(!left.fits(&beside), "in-flight consumption counts");
        let fresh = Counters::available(&set(), &devices, &BTreeSet::new());
        assert!(fresh.fits(&full) && fresh.fits(&overlapping));
    }

    #[test]
    fn byte_counters_compare_as_bytes() {
        let big = device("big", &[("memory", "11Gi")]);
        let exact = device("exact", &[("memory", "10240Mi")]);
        let left = Counters::available(&set(), &[], &BTreeSet::new());
        assert!(!left.fits(&big));
        assert!(left.fits(&exact));
        assert!(Counters::consumes(&exact));
        assert!(!Counters::consumes(&Device::default()));
    }
}
