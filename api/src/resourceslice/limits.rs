//! The API server's limits on ResourceSlices that kerf's publication can reach, and
//! [`check_request_policy`], the validation of a consumable capacity's `requestPolicy`.
//!
//! Constants and rules follow kubernetes/kubernetes `pkg/apis/resource/types.go` (the
//! `ResourceSliceMax…` constants) and `pkg/apis/resource/validation/validation.go`
//! (`validateResourceSliceSpec`, `validateDevice`, `validateMultiAllocatableDeviceCapacity`,
//! `validateSingleAllocatableDeviceCapacity`, `validateRequestPolicy`,
//! `validateValidRequestValues`, `validateRequestPolicyValidValues`,
//! `validateRequestPolicyRange`, `validateRequestPolicyRangeStep`). A slice that breaks one of
//! them is refused as a whole, which would leave the node's pool incomplete, so the publisher
//! checks before writing ([`check_slice`]).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, Counter, Device, DeviceCapacity, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::names::{MAX_ATTRIBUTES_AND_CAPACITIES, MAX_DEVICES_PER_SLICE, is_dns_label};
use super::taints::MAX_DEVICES_PER_SLICE_WITH_TAINTS;
use crate::error::{Error, Result};

/// Most devices in a slice where any device has taints or consumes counters
/// (`ResourceSliceMaxDevicesWithTaintsOrConsumesCounters`).
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS: usize = MAX_DEVICES_PER_SLICE_WITH_TAINTS;
/// Most shared counter sets in one slice (`ResourceSliceMaxCounterSets`).
pub(crate) const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Most counters in one counter set (`ResourceSliceMaxCountersPerCounterSet`).
const MAX_COUNTERS_PER_SET: usize = 32;
/// Most `consumesCounters` entries of one device
/// (`ResourceSliceMaxDeviceCounterConsumptionsPerDevice`).
const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// Most counters in one `consumesCounters` entry
/// (`ResourceSliceMaxCountersPerDeviceCounterConsumption`).
const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;
/// Most entries of `requestPolicy.validValues` (`CapacityRequestPolicyDiscreteMaxOptions`).
const MAX_VALID_VALUES: usize = 10;
/// Largest object etcd stores by default (`--max-request-bytes`, 1.5 MiB): a bigger slice is
/// refused however valid its fields are. kerf checks the JSON size, which is above the
/// protobuf size the API server stores.
pub const MAX_OBJECT_BYTES: usize = 1536 * 1024;

/// Checks one capacity of a device as the API server does; `at` names the capacity in
/// messages, e.g. `devices["gpu-0"].capacity["memory"]`.
///
/// A policy is refused on a device without `allowMultipleAllocations: true`
/// (`validateSingleAllocatableDeviceCapacity`). With a policy: `validValues` and `validRange`
/// exclude each other; `default` is required with either; values are ascending, unique, at most
/// `MAX_VALID_VALUES`, none above the capacity, and `default` is one of them; a range has a
/// `default ≥ min`, `min ≤ max ≤ value`, `default ≤ max`, `min + step ≤ value`, and
/// `default` and `max` lie on the step grid from `min`.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] naming the field and the values at fault.
pub fn check_request_policy(at: &str, shareable: bool, capacity: &DeviceCapacity) -> Result<()> {
    let Some(policy) = &capacity.request_policy else {
        return Ok(());
    };
    let at = format!("{at}.requestPolicy");
    if !shareable {
        return Err(Error::slice(at, "allowMultipleAllocations must be true"));
    }
    let value = amount(&format!("{at}.value"), &capacity.value)?;
    let has_values = policy.valid_values.as_ref().is_some_and(|v| !v.is_empty());
    if has_values && policy.valid_range.is_some() {
        return Err(Error::slice(
            at,
            "exactly one policy can be specified, not validValues and validRange",
        ));
    }
    let default = || -> Result<u64> {
        let quantity = policy.default.as_ref().ok_or_else(|| {
            Error::slice(
                format!("{at}.default"),
                "required when validValues or validRange is defined",
            )
        })?;
        amount(&format!("{at}.default"), quantity)
    };
    if has_values {
        check_valid_values(&at, policy, default()?, value)
    } else if policy.valid_range.is_some() {
        check_range(&at, policy, default()?, value)
    } else {
        Ok(())
    }
}

fn check_valid_values(
    at: &str,
    policy: &CapacityRequestPolicy,
    default: u64,
    value: u64,
) -> Result<()> {
    let at = format!("{at}.validValues");
    let quantities = policy.valid_values.as_deref().unwrap_or_default();
    if quantities.len() > MAX_VALID_VALUES {
        return Err(Error::slice(
            at,
            format!(
                "{} values; at most {MAX_VALID_VALUES} are allowed",
                quantities.len()
            ),
        ));
    }
    let values = quantities
        .iter()
        .enumerate()
        .map(|(i, q)| amount(&format!("{at}[{i}]"), q))
        .collect::<Result<Vec<u64>>>()?;
    for (i, pair) in values.windows(2).enumerate() {
        if pair[0] > pair[1] {
            return Err(Error::slice(
                format!("{at}[{}]", i + 1),
                format!("{} is below {}: values must be ascending", pair[1], pair[0]),
            ));
        }
        if pair[0] == pair[1] {
            return Err(Error::slice(
                format!("{at}[{}]", i + 1),
                format!("{} is a duplicate", pair[1]),
            ));
        }
    }
    if let Some((i, v)) = values.iter().enumerate().find(|(_, v)| **v > value) {
        return Err(Error::slice(
            format!("{at}[{i}]"),
            format!("{v} is larger than the capacity value {value}"),
        ));
    }
    if !values.contains(&default) {
        return Err(Error::slice(
            at,
            format!("default {default} is not one of the valid values {values:?}"),
        ));
    }
    Ok(())
}

fn check_range(at: &str, policy: &CapacityRequestPolicy, default: u64, value: u64) -> Result<()> {
    let at = format!("{at}.validRange");
    let Some(range) = &policy.valid_range else {
        return Ok(());
    };
    // `min` is required by the type (k8s-openapi makes it non-optional), as validation says.
    let min = amount(&format!("{at}.min"), &range.min)?;
    let bad = |field: &str, message: String| Err(Error::slice(format!("{at}.{field}"), message));
    if min > value {
        return bad(
            "min",
            format!("{min} is larger than the capacity value {value}"),
        );
    }
    if default < min {
        return bad("min", format!("default {default} is less than min {min}"));
    }
    let max = match &range.max {
        Some(max) => Some(amount(&format!("{at}.max"), max)?),
        None => None,
    };
    if let Some(max) = max {
        if min > max {
            return bad("max", format!("min {min} is larger than max {max}"));
        }
        if max > value {
            return bad(
                "max",
                format!("{max} is larger than the capacity value {value}"),
            );
        }
        if default > max {
            return bad("max", format!("default {default} is more than max {max}"));
        }
    }
    let Some(step) = &range.step else {
        return Ok(());
    };
    let step = amount(&format!("{at}.step"), step)?;
    if step == 0 {
        return bad("step", "0 is not a step".to_owned());
    }
    if min.saturating_add(step) > value {
        return bad(
            "step",
            format!(
                "one step {} from min is larger than the capacity value {value}",
                min.saturating_add(step)
            ),
        );
    }
    for (what, v) in [("default", Some(default)), ("max", max)] {
        if let Some(v) = v
            && (v - min) % step != 0
        {
            return bad(
                "step",
                format!("{what} {v} is not a multiple of the step {step} from min {min}"),
            );
        }
    }
    Ok(())
}

/// Checks a slice against the limits kerf can reach: devices per slice (64 when any device has
/// taints or consumes counters), `sharedCounters` and `devices` not both set (1.35+), counter
/// sets per slice, counters per set, names of sets and counters (DNS labels, sets unique),
/// counter consumptions per device and counters per consumption, attributes and capacities
/// per device, every capacity's request policy, and the object size ([`MAX_OBJECT_BYTES`]).
/// 1.36 has no limit on the total counter consumptions of a slice (kubernetes/kubernetes
/// `pkg/apis/resource/validation/validation.go`, `validateResourceSliceSpec`,
/// `validateCounterSet`, `validateDeviceCounterConsumption`).
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] naming the first limit broken.
pub fn check_slice(spec: &ResourceSliceSpec) -> Result<()> {
    if spec.shared_counters.is_some() && spec.devices.is_some() {
        return Err(Error::slice(
            "spec",
            "only one of `sharedCounters` or `devices` is allowed",
        ));
    }
    let devices = spec.devices.as_deref().unwrap_or_default();
    let advanced = devices
        .iter()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()) || d.consumes_counters.is_some());
    let max = if advanced {
        MAX_DEVICES_PER_SLICE_WITH_COUNTERS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    if devices.len() > max {
        return Err(Error::slice(
            "spec.devices",
            format!(
                "{} devices; at most {max} are allowed{}",
                devices.len(),
                if advanced {
                    " when a device has taints or consumes counters"
                } else {
                    ""
                }
            ),
        ));
    }
    check_counter_sets(spec)?;
    devices.iter().try_for_each(check_device)?;
    let bytes = slice_json_bytes(spec);
    if bytes > MAX_OBJECT_BYTES {
        return Err(Error::slice(
            "spec",
            format!("{bytes} bytes of JSON; the API server stores at most {MAX_OBJECT_BYTES}"),
        ));
    }
    Ok(())
}

/// The size of `spec` as JSON, in bytes.
pub fn slice_json_bytes(spec: &ResourceSliceSpec) -> usize {
    // Serialising plain data cannot fail; 0 would only skip the size check.
    serde_json::to_vec(spec).map_or(0, |json| json.len())
}

/// Checks what one slice cannot see: counter-set names unique in the pool, every device's
/// consumption naming a counter set of the pool and counters that set has (else kube-scheduler
/// cannot allocate the device), and device names unique in the pool.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] naming the device or counter set at fault.
pub fn check_pool(specs: &[ResourceSliceSpec]) -> Result<()> {
    let mut sets: BTreeMap<&str, &BTreeMap<String, Counter>> = BTreeMap::new();
    for set in specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
    {
        if sets.insert(&set.name, &set.counters).is_some() {
            return Err(Error::slice(
                format!("spec.sharedCounters[{:?}]", set.name),
                "two counter sets of the pool have this name",
            ));
        }
    }
    let mut names = BTreeSet::new();
    for device in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
        let at = format!("devices[{:?}]", device.name);
        if !names.insert(device.name.as_str()) {
            return Err(Error::slice(at, "two devices of the pool have this name"));
        }
        for consumption in device.consumes_counters.iter().flatten() {
            let at = format!("{at}.consumesCounters[{:?}]", consumption.counter_set);
            let Some(set) = sets.get(consumption.counter_set.as_str()) else {
                return Err(Error::slice(at, "no counter set of the pool has this name"));
            };
            if let Some(missing) = consumption.counters.keys().find(|c| !set.contains_key(*c)) {
                return Err(Error::slice(
                    at,
                    format!("counter {missing:?} is not in the counter set"),
                ));
            }
        }
    }
    Ok(())
}

fn check_counter_sets(spec: &ResourceSliceSpec) -> Result<()> {
    let sets = spec.shared_counters.as_deref().unwrap_or_default();
    if sets.len() > MAX_COUNTER_SETS_PER_SLICE {
        return Err(Error::slice(
            "spec.sharedCounters",
            format!(
                "{} counter sets; at most {MAX_COUNTER_SETS_PER_SLICE} are allowed",
                sets.len()
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for set in sets {
        let at = format!("spec.sharedCounters[{:?}]", set.name);
        if !is_dns_label(&set.name) {
            return Err(Error::slice(at, "the name is not a DNS label"));
        }
        if !seen.insert(set.name.as_str()) {
            return Err(Error::slice(at, "two counter sets have this name"));
        }
        check_counters(&at, &set.counters, MAX_COUNTERS_PER_SET)?;
    }
    Ok(())
}

/// Counters of a set or a consumption: at least one, at most `max`, names DNS labels.
fn check_counters(at: &str, counters: &BTreeMap<String, Counter>, max: usize) -> Result<()> {
    if counters.is_empty() {
        return Err(Error::slice(format!("{at}.counters"), "required"));
    }
    if counters.len() > max {
        return Err(Error::slice(
            format!("{at}.counters"),
            format!("{} counters; at most {max} are allowed", counters.len()),
        ));
    }
    if let Some(bad) = counters.keys().find(|name| !is_dns_label(name)) {
        return Err(Error::slice(
            format!("{at}.counters[{bad:?}]"),
            "the name is not a DNS label",
        ));
    }
    Ok(())
}

fn check_device(device: &Device) -> Result<()> {
    let at = format!("devices[{:?}]", device.name);
    let consumptions = device.consumes_counters.as_deref().unwrap_or_default();
    if consumptions.len() > MAX_CONSUMPTIONS_PER_DEVICE {
        return Err(Error::slice(
            format!("{at}.consumesCounters"),
            format!(
                "{} entries; at most {MAX_CONSUMPTIONS_PER_DEVICE} are allowed",
                consumptions.len()
            ),
        ));
    }
    let mut seen = BTreeSet::new();
    for consumption in consumptions {
        let at = format!("{at}.consumesCounters[{:?}]", consumption.counter_set);
        if !is_dns_label(&consumption.counter_set) {
            return Err(Error::slice(at, "counterSet is not a DNS label"));
        }
        if !seen.insert(consumption.counter_set.as_str()) {
            return Err(Error::slice(at, "two entries name this counter set"));
        }
        check_counters(&at, &consumption.counters, MAX_COUNTERS_PER_CONSUMPTION)?;
    }
    let attributes = device.attributes.as_ref().map_or(0, BTreeMap::len);
    let capacities = device.capacity.as_ref().map_or(0, BTreeMap::len);
    if attributes + capacities > MAX_ATTRIBUTES_AND_CAPACITIES {
        return Err(Error::slice(
            at,
            format!(
                "{} attributes and capacities; at most {MAX_ATTRIBUTES_AND_CAPACITIES} are allowed",
                attributes + capacities
            ),
        ));
    }
    let shareable = device.allow_multiple_allocations == Some(true);
    for (name, capacity) in device.capacity.iter().flatten() {
        check_request_policy(&format!("{at}.capacity[{name:?}]"), shareable, capacity)?;
    }
    Ok(())
}

/// A quantity of a capacity as a whole number; zero is allowed (a capacity no share consumes).
fn amount(at: &str, quantity: &Quantity) -> Result<u64> {
    let text = quantity.0.trim_start_matches('+');
    if !text.is_empty() && text.bytes().all(|b| b == b'0') {
        return Ok(0);
    }
    crate::quantity::quantity_bytes(quantity)
        .map_err(|e| Error::slice(at, format!("{:?} is not a whole quantity: {e}", quantity.0)))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::CapacityRequestPolicyRange;

    use super::*;

    fn q(text: &str) -> Quantity {
        Quantity(text.to_owned())
    }

    fn range(
        value: &str,
        default: &str,
        min: &str,
        max: Option<&str>,
        step: &str,
    ) -> DeviceCapacity {
        DeviceCapacity {
            value: q(value),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(q(default)),
                valid_range: Some(CapacityRequestPolicyRange {
                    min: q(min),
                    max: max.map(q),
                    step: Some(q(step)),
                }),
                valid_values: None,
            }),
        }
    }

    fn values(value: &str, default: &str, options: &[&str]) -> DeviceCapacity {
        DeviceCapacity {
            value: q(value),
            request_policy: Some(CapacityRequestPolicy {
                default: Some(q(default)),
                valid_range: None,
                valid_values: Some(options.iter().map(|o| q(o)).collect()),
            }),
        }
    }

    fn check(capacity: &DeviceCapacity) -> std::result::Result<(), String> {
        check_request_policy("c", true, capacity).map_err(|e| e.to_string())
    }

    #[test]
    fn kerf_policies_pass() {
        check(&range("81559Mi", "79Gi", "1Gi", Some("79Gi"), "1Gi")).unwrap();
        check(&range("100", "25", "1", Some("100"), "1")).unwrap();
        check(&values("8", "1", &["1"])).unwrap();
        check(&values("132", "0", &["0"])).unwrap();
    }

    #[test]
    fn range_rules() {
        let e = check(&range("10", "3", "2", Some("10"), "2")).unwrap_err();
        assert!(e.contains("step") && e.contains("default 3"), "{e}");
        let e = check(&range("10", "9", "2", Some("9"), "2")).unwrap_err();
        assert!(e.contains("default 9"), "{e}");
        let e = check(&range("10", "1", "2", None, "2")).unwrap_err();
        assert!(e.contains("less than min"), "{e}");
        let e = check(&range("10", "12", "2", Some("12"), "2")).unwrap_err();
        assert!(e.contains("max") && e.contains("capacity value 10"), "{e}");
        let e = check(&range("3", "2", "2", None, "2")).unwrap_err();
        assert!(e.contains("one step 4"), "{e}");
        let e = check(&range("10", "8", "2", Some("6"), "2")).unwrap_err();
        assert!(e.contains("more than max"), "{e}");
        let mut no_default = range("10", "2", "2", None, "2");
        no_default.request_policy.as_mut().unwrap().default = None;
        let e = check(&no_default).unwrap_err();
        assert!(
            e.contains("c.requestPolicy.default") && e.contains("required"),
            "{e}"
        );
    }

    #[test]
    fn value_rules() {
        let e = check(&values("8", "2", &["1"])).unwrap_err();
        assert!(e.contains("default 2"), "{e}");
        let e = check(&values("8", "1", &["2", "1"])).unwrap_err();
        assert!(e.contains("ascending"), "{e}");
        let e = check(&values("8", "1", &["1", "9"])).unwrap_err();
        assert!(
            e.contains("validValues[1]") && e.contains("capacity value 8"),
            "{e}"
        );
        let many: Vec<String> = (1..=11).map(|i| i.to_string()).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let e = check(&values("20", "1", &many)).unwrap_err();
        assert!(e.contains("at most 10"), "{e}");
    }

    #[test]
    fn a_policy_needs_a_shareable_device() {
        let e = check_request_policy("c", false, &values("8", "1", &["1"])).unwrap_err();
        assert!(
            e.to_string()
                .contains("allowMultipleAllocations must be true")
        );
        check_request_policy(
            "c",
            false,
            &DeviceCapacity {
                value: q("8"),
                request_policy: None,
            },
        )
        .unwrap();
    }

    #[test]
    fn slices_with_counters_hold_at_most_64_devices() {
        let device = |i: usize, counters: bool| Device {
            name: format!("d{i}"),
            consumes_counters: counters.then(Vec::new),
            ..Device::default()
        };
        let spec = |n: usize, counters: bool| ResourceSliceSpec {
            devices: Some((0..n).map(|i| device(i, counters)).collect()),
            ..ResourceSliceSpec::default()
        };
        check_slice(&spec(128, false)).unwrap();
        check_slice(&spec(64, true)).unwrap();
        let e = check_slice(&spec(65, true)).unwrap_err().to_string();
        assert!(e.contains("at most 64"), "{e}");
        let e = check_slice(&spec(129, false)).unwrap_err().to_string();
        assert!(e.contains("at most 128"), "{e}");
    }
}
