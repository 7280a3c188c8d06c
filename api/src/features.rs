//! Which optional `resource.k8s.io/v1` fields the API server keeps.
//!
//! Fields of alpha features are in the v1 schema of every 1.34+ API server, but a server
//! whose feature gate is off drops them on write (its `dropDisabledFields`), so neither the
//! OpenAPI document nor discovery tells whether a feature works. kerf asks the server itself:
//! a dry-run create (`dryRun=All`, nothing is stored) of a probe object that sets the field,
//! and a look at whether the answer still carries it. The objects and the checks are here; the
//! binaries make the call once at start-up and degrade with one log line.
//!
//! How a server with a gate off treats the fields: kubernetes/kubernetes
//! `pkg/registry/resource/resourceslice/strategy.go (dropDisabledFields`, e.g.
//! `dropDisabledDRAConsumableCapacityFields`, which clears `allowMultipleAllocations` and every
//! capacity's `requestPolicy`; `dropDisabledDRAPartitionableDevicesFields`, which clears
//! `sharedCounters`, `perDeviceNodeSelection` and every device's `consumesCounters`).

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet,
    Device, DeviceCapacity, DeviceClass, DeviceClassSpec, DeviceCounterConsumption, DeviceSelector,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// `metadata.generateName` of every probe object; the server never stores them.
pub const PROBE_NAME_PREFIX: &str = "kerf-feature-probe-";

/// An optional API feature kerf uses, named by its Kubernetes feature gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiFeature {
    /// `DRADeviceTaints`: `spec.devices[].taints` of ResourceSlices (beta, on, in 1.36).
    DeviceTaints,
    /// `DRAExtendedResource`: `spec.extendedResourceName` of DeviceClasses (beta, on, in 1.36).
    ExtendedResource,
    /// `DRAConsumableCapacity`: `spec.devices[].allowMultipleAllocations` and capacity
    /// `requestPolicy` of ResourceSlices (beta, on, in 1.36).
    ConsumableCapacity,
    /// `DRAPartitionableDevices`: `spec.sharedCounters` and `spec.devices[].consumesCounters`
    /// of ResourceSlices (beta, on, in 1.36), in slices of their own (1.35+).
    PartitionableDevices,
}

impl ApiFeature {
    /// The feature gate's name.
    pub fn gate(self) -> &'static str {
        match self {
            ApiFeature::DeviceTaints => "DRADeviceTaints",
            ApiFeature::ExtendedResource => "DRAExtendedResource",
            ApiFeature::ConsumableCapacity => "DRAConsumableCapacity",
            ApiFeature::PartitionableDevices => "DRAPartitionableDevices",
        }
    }

    /// The field the feature adds, as a path.
    pub fn field(self) -> &'static str {
        match self {
            ApiFeature::DeviceTaints => "ResourceSlice spec.devices[].taints",
            ApiFeature::ExtendedResource => "DeviceClass spec.extendedResourceName",
            ApiFeature::ConsumableCapacity => {
                "ResourceSlice spec.devices[].allowMultipleAllocations and capacity requestPolicy"
            }
            ApiFeature::PartitionableDevices => {
                "ResourceSlice spec.sharedCounters and spec.devices[].consumesCounters"
            }
        }
    }

    /// What kerf does without the feature, for the one log line at start-up.
    pub fn without(self) -> &'static str {
        match self {
            ApiFeature::DeviceTaints => {
                "unhealthy devices are not tainted; their health still reaches the kubelet"
            }
            ApiFeature::ExtendedResource => {
                "GpuClasses' extendedResourceName is not written; pods must use ResourceClaims"
            }
            ApiFeature::ConsumableCapacity => {
                "GPUs of sliced Scheduler GpuClasses are published whole, not as scheduler slices"
            }
            ApiFeature::PartitionableDevices => {
                "dynamic-MIG GPUs are published whole, without MIG placements"
            }
        }
    }
}

impl fmt::Display for ApiFeature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.gate())
    }
}

/// What the probe of one feature found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probed {
    /// The server kept the field: the feature is on.
    Served,
    /// The server dropped the field: the feature is off or the server predates it.
    Dropped,
    /// The probe call failed (no permission, server error); the message says why. Callers
    /// treat the feature as off.
    Failed(String),
}

impl Probed {
    /// Whether the feature can be used.
    pub fn is_served(&self) -> bool {
        matches!(self, Probed::Served)
    }

    /// The start-up log line for `feature`, `None` when it is served.
    pub fn degraded_message(&self, feature: ApiFeature) -> Option<String> {
        match self {
            Probed::Served => None,
            Probed::Dropped => Some(format!(
                "the API server drops {} (feature gate {} off, or Kubernetes before 1.36): {}",
                feature.field(),
                feature.gate(),
                feature.without()
            )),
            Probed::Failed(why) => Some(format!(
                "cannot tell whether the API server serves {} ({why}); assuming feature gate {} is off: {}",
                feature.field(),
                feature.gate(),
                feature.without()
            )),
        }
    }
}

/// A ResourceSlice for `driver` on `node` with one tainted device, to create with
/// `dryRun=All`.
pub fn device_taints_probe(driver: &str, node: &str) -> ResourceSlice {
    ResourceSlice {
        metadata: probe_metadata(),
        spec: ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: format!("{PROBE_NAME_PREFIX}{node}"),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(vec![Device {
                name: "probe".to_owned(),
                taints: Some(vec![DeviceTaint {
                    key: format!("{driver}/probe"),
                    value: Some("probe".to_owned()),
                    effect: "NoSchedule".to_owned(),
                    time_added: None,
                }]),
                ..Device::default()
            }]),
            ..ResourceSliceSpec::default()
        },
    }
}

/// Whether the server's answer to [`device_taints_probe`] kept the taint.
pub fn kept_device_taints(answer: &ResourceSlice) -> Probed {
    let kept = answer
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()));
    if kept {
        Probed::Served
    } else {
        Probed::Dropped
    }
}

/// A DeviceClass of `driver` with an extended resource name, to create with `dryRun=All`.
pub fn extended_resource_probe(driver: &str) -> DeviceClass {
    DeviceClass {
        metadata: probe_metadata(),
        spec: DeviceClassSpec {
            extended_resource_name: Some(format!("{driver}/kerf-feature-probe")),
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!("device.driver == {driver:?}"),
                }),
            }]),
            ..DeviceClassSpec::default()
        },
    }
}

/// Whether the server's answer to [`extended_resource_probe`] kept the name.
pub fn kept_extended_resource(answer: &DeviceClass) -> Probed {
    if answer
        .spec
        .extended_resource_name
        .as_deref()
        .is_some_and(|n| !n.is_empty())
    {
        Probed::Served
    } else {
        Probed::Dropped
    }
}

/// A ResourceSlice for `driver` on `node` with one shareable device whose capacity has a
/// request policy, to create with `dryRun=All`. The policy is a valid one (default on the
/// range), so a server with the feature on accepts it.
pub fn consumable_capacity_probe(driver: &str, node: &str) -> ResourceSlice {
    let quantity = |v: &str| Quantity(v.to_owned());
    let capacity = DeviceCapacity {
        value: quantity("100"),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(quantity("1")),
            valid_range: Some(CapacityRequestPolicyRange {
                min: quantity("1"),
                max: Some(quantity("100")),
                step: Some(quantity("1")),
            }),
            valid_values: None,
        }),
    };
    let mut probe = device_taints_probe(driver, node);
    probe.spec.devices = Some(vec![Device {
        name: "probe".to_owned(),
        allow_multiple_allocations: Some(true),
        capacity: Some(BTreeMap::from([("probe".to_owned(), capacity)])),
        ..Device::default()
    }]);
    probe
}

/// Whether the server's answer to [`consumable_capacity_probe`] kept both
/// `allowMultipleAllocations` and the request policy (its `dropDisabledFields` clears both
/// when the gate is off).
pub fn kept_consumable_capacity(answer: &ResourceSlice) -> Probed {
    let kept = answer.spec.devices.iter().flatten().any(|d| {
        d.allow_multiple_allocations == Some(true)
            && d.capacity
                .iter()
                .flatten()
                .any(|(_, c)| c.request_policy.is_some())
    });
    if kept {
        Probed::Served
    } else {
        Probed::Dropped
    }
}

/// The two ResourceSlices for `driver` on `node` that dynamic MIG publishes, to create with
/// `dryRun=All`: a counters-only slice with one counter set, and a devices-only slice whose
/// device consumes that set's counter. Both shapes must be kept: the set and the consumption
/// live in different slices of the pool, which the API server accepts from 1.35 on (1.34
/// validation wanted them in the same slice and answers the second with an error, which the
/// caller takes as the feature being off).
pub fn partitionable_devices_probes(driver: &str, node: &str) -> [ResourceSlice; 2] {
    let counters = || {
        BTreeMap::from([(
            "probe".to_owned(),
            Counter {
                value: Quantity("1".to_owned()),
            },
        )])
    };
    let mut sets = device_taints_probe(driver, node);
    sets.spec.devices = None;
    sets.spec.shared_counters = Some(vec![CounterSet {
        name: "probe".to_owned(),
        counters: counters(),
    }]);
    let mut devices = device_taints_probe(driver, node);
    devices.spec.devices = Some(vec![Device {
        name: "probe".to_owned(),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: "probe".to_owned(),
            counters: counters(),
        }]),
        ..Device::default()
    }]);
    [sets, devices]
}

/// Whether the server's answers to [`partitionable_devices_probes`] (in that order) kept the
/// counter set and the consumption.
pub fn kept_partitionable_devices(sets: &ResourceSlice, devices: &ResourceSlice) -> Probed {
    let kept_sets = sets
        .spec
        .shared_counters
        .as_ref()
        .is_some_and(|s| !s.is_empty());
    let kept_consumption = devices
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty()));
    if kept_sets && kept_consumption {
        Probed::Served
    } else {
        Probed::Dropped
    }
}

fn probe_metadata() -> ObjectMeta {
    ObjectMeta {
        generate_name: Some(PROBE_NAME_PREFIX.to_owned()),
        ..ObjectMeta::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_answer_without_the_field_is_dropped() {
        let slice = device_taints_probe("gpu.kerf.dev", "node-a");
        assert_eq!(kept_device_taints(&slice), Probed::Served);
        let mut dropped = slice.clone();
        for device in dropped.spec.devices.iter_mut().flatten() {
            device.taints = None;
        }
        assert_eq!(kept_device_taints(&dropped), Probed::Dropped);

        let class = extended_resource_probe("gpu.kerf.dev");
        assert_eq!(kept_extended_resource(&class), Probed::Served);
        let mut dropped = class.clone();
        dropped.spec.extended_resource_name = None;
        assert_eq!(kept_extended_resource(&dropped), Probed::Dropped);

        let slice = consumable_capacity_probe("gpu.kerf.dev", "node-a");
        assert_eq!(kept_consumable_capacity(&slice), Probed::Served);
        for device in slice.spec.devices.iter().flatten() {
            for (name, capacity) in device.capacity.iter().flatten() {
                crate::resourceslice::limits::check_request_policy(name, true, capacity).unwrap();
            }
        }
        let mut dropped = slice.clone();
        for device in dropped.spec.devices.iter_mut().flatten() {
            device.allow_multiple_allocations = None;
        }
        assert_eq!(kept_consumable_capacity(&dropped), Probed::Dropped);
        let mut dropped = slice;
        for device in dropped.spec.devices.iter_mut().flatten() {
            for capacity in device.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                capacity.request_policy = None;
            }
        }
        assert_eq!(kept_consumable_capacity(&dropped), Probed::Dropped);
    }

    #[test]
    fn the_partitionable_probe_needs_both_the_set_and_the_consumption() {
        let [sets, devices] = partitionable_devices_probes("gpu.kerf.dev", "node-a");
        assert_eq!(kept_partitionable_devices(&sets, &devices), Probed::Served);
        for probe in [&sets, &devices] {
            crate::resourceslice::limits::check_slice(&probe.spec).unwrap();
        }
        crate::resourceslice::limits::check_pool(&[sets.spec.clone(), devices.spec.clone()])
            .unwrap();
        let mut dropped = sets.clone();
        dropped.spec.shared_counters = None;
        assert_eq!(
            kept_partitionable_devices(&dropped, &devices),
            Probed::Dropped
        );
        let mut dropped = devices;
        for device in dropped.spec.devices.iter_mut().flatten() {
            device.consumes_counters = None;
        }
        assert_eq!(kept_partitionable_devices(&sets, &dropped), Probed::Dropped);
        let line = Probed::Dropped
            .degraded_message(ApiFeature::PartitionableDevices)
            .expect("a line");
        assert!(
            line.contains("DRAPartitionableDevices") && line.contains("published whole"),
            "{line}"
        );
    }

    #[test]
    fn the_degraded_line_names_the_gate_and_the_consequence() {
        assert_eq!(
            Probed::Served.degraded_message(ApiFeature::DeviceTaints),
            None
        );
        let line = Probed::Dropped
            .degraded_message(ApiFeature::DeviceTaints)
            .expect("a line");
        assert!(
            line.contains("DRADeviceTaints") && line.contains("not tainted"),
            "{line}"
        );
        let line = Probed::Failed("403 Forbidden".into())
            .degraded_message(ApiFeature::ExtendedResource)
            .expect("a line");
        assert!(
            line.contains("403 Forbidden") && line.contains("DRAExtendedResource"),
            "{line}"
        );
    }
}
