//! A stand-in for kube-scheduler's structured-parameters allocator, for claims of Scheduler
//! classes (whole GPUs, MIG devices), which kerf's controller leaves alone.
//!
//! It is deliberately simple: per request, the first free devices in ResourceSlice order
//! that the class selects. The class's selection is evaluated in Rust by the controller's
//! [`DeviceSelector::matches`], the same predicate its CEL expression is generated from;
//! CEL in claims is not evaluated. `matchAttribute` constraints are honoured by trying each
//! value of the attribute in turn. A device is free when no claim holds it (the scheduler
//! counts every device named in any allocation, the controller's slices included) and, for
//! a MIG device, when its parent GPU is free too (and the other way round). Partitionable
//! devices (dynamic-MIG placements, which consume their GPU's shared counters) are instead free when no claim holds them and they fit what the allocated
//! devices left of the counters ([`Counters`], as 1.36's allocator checks them); taken in
//! slice order without backtracking, unlike kube-scheduler's exhaustive search.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::{
    AllocationResult, CounterSet, Device, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceAttribute, DeviceConstraint, DeviceRequest, DeviceRequestAllocationResult,
    DeviceSubRequest, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::claim::{SOURCE_FROM_CLAIM, SOURCE_FROM_CLASS};
use kerf_api::resourceslice::{TYPE_GPU, TYPE_MIG, attributes, device_attribute};
use kerf_controller::selector::DeviceSelector;
use kerf_core::alloc::Index;

use super::classes::Classes;
use super::counters::Counters;

/// What the scheduler stand-in needs to know about the node.
pub struct Node<'a> {
    /// Node name (the pool name).
    pub name: &'a str,
    /// Driver name.
    pub driver: &'a str,
    /// The node's published devices, in ResourceSlice order.
    pub devices: &'a [Device],
    /// The counter sets of the node's slices (`sharedCounters`), for partitionable devices.
    pub counter_sets: &'a [CounterSet],
}

/// One way to satisfy a request: the request itself, or one of its `firstAvailable`
/// subrequests.
struct Alternative<'a> {
    /// The name results carry: `request` or `request/subrequest`.
    result_name: String,
    class: &'a str,
    mode: Option<&'a str>,
    count: Option<i64>,
    selectors: bool,
    admin_access: bool,
    capacity: bool,
}

/// Allocates `claim` on `node` and returns its `status.allocation` and the devices taken.
/// `held` names the devices other claims hold whole (the scheduler's own allocations, MIG
/// devices included); `index` knows every GPU's usage.
///
/// # Errors
/// A message saying why, as the scheduler would report it on the pod.
pub fn allocate(
    claim: &ResourceClaim,
    classes: &Classes,
    node: &Node<'_>,
    held: &BTreeSet<String>,
    index: &Index,
    now: Time,
) -> Result<(AllocationResult, Vec<String>), String> {
    let devices = claim.spec.devices.as_ref();
    let requests = devices
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default();
    if requests.is_empty() {
        return Err("spec.devices.requests: the claim requests no devices".to_owned());
    }
    let constraints = devices
        .and_then(|d| d.constraints.as_deref())
        .unwrap_or_default();
    let free: Vec<&Device> = node
        .devices
        .iter()
        .filter(|d| is_free(d, node, held, index))
        .collect();
    let choices = constraint_choices(constraints, &free, node.driver)?;
    let counters = Counters::available(node.counter_sets, node.devices, held);
    let mut last_error = None;
    for choice in &choices {
        let mut counters = counters.clone();
        let picked = allocate_with(
            requests,
            constraints,
            choice,
            &free,
            classes,
            node,
            &mut counters,
        );
        match picked {
            Ok(results) => {
                let taken = results.iter().map(|r| r.device.clone()).collect();
                let allocation = allocation(claim, results, classes, node, now);
                return Ok((allocation, taken));
            }
            Err(e) => last_error = Some(e),
        }
    }
    let why = last_error.unwrap_or_else(|| "no devices".to_owned());
    if choices.len() > 1 || choices.first().is_some_and(|c| !c.is_empty()) {
        Err(format!("{why} satisfying spec.devices.constraints"))
    } else {
        Err(why)
    }
}

/// The attribute values each `matchAttribute` constraint is tried with, as the product of
/// every constraint's values (in order of first appearance); one empty choice without
/// constraints.
fn constraint_choices(
    constraints: &[DeviceConstraint],
    free: &[&Device],
    driver: &str,
) -> Result<Vec<Vec<DeviceAttribute>>, String> {
    let mut choices: Vec<Vec<DeviceAttribute>> = vec![Vec::new()];
    for (i, constraint) in constraints.iter().enumerate() {
        if constraint.distinct_attribute.is_some() {
            return Err(format!(
                "spec.devices.constraints[{i}].distinctAttribute is not supported by the demo's scheduler stand-in"
            ));
        }
        let Some(name) = constraint.match_attribute.as_deref() else {
            return Err(format!(
                "spec.devices.constraints[{i}]: neither matchAttribute nor distinctAttribute is set"
            ));
        };
        let mut values: Vec<DeviceAttribute> = Vec::new();
        for device in free {
            if let Some(value) = qualified_attribute(device, driver, name)
                && !values.contains(value)
            {
                values.push(value.clone());
            }
        }
        choices = choices
            .into_iter()
            .flat_map(|choice| {
                values.iter().map(move |value| {
                    let mut next = choice.clone();
                    next.push(value.clone());
                    next
                })
            })
            .collect();
    }
    Ok(choices)
}

fn allocate_with(
    requests: &[DeviceRequest],
    constraints: &[DeviceConstraint],
    choice: &[DeviceAttribute],
    free: &[&Device],
    classes: &Classes,
    node: &Node<'_>,
    counters: &mut Counters,
) -> Result<Vec<DeviceRequestAllocationResult>, String> {
    let mut results: Vec<DeviceRequestAllocationResult> = Vec::new();
    for (i, request) in requests.iter().enumerate() {
        let path = format!("spec.devices.requests[{i}]");
        let alternatives = alternatives(request, &path)?;
        let mut last_error = None;
        let mut satisfied = false;
        for (alternative, at) in &alternatives {
            let constrained = |device: &Device| {
                constraints.iter().zip(choice).all(|(constraint, value)| {
                    let applies = constraint
                        .requests
                        .as_ref()
                        .is_none_or(|r| r.is_empty() || r.iter().any(|name| name == &request.name));
                    let name = constraint.match_attribute.as_deref().unwrap_or_default();
                    !applies || qualified_attribute(device, node.driver, name) == Some(value)
                })
            };
            let taken: BTreeSet<&str> = results.iter().map(|r| r.device.as_str()).collect();
            let candidates: Vec<&Device> = free
                .iter()
                .copied()
                .filter(|d| !taken.contains(d.name.as_str()) && constrained(d))
                .collect();
            match pick(alternative, at, &candidates, classes, node, counters) {
                Ok(devices) => {
                    results.extend(devices.into_iter().map(|device| {
                        DeviceRequestAllocationResult {
                            request: alternative.result_name.clone(),
                            driver: node.driver.to_owned(),
                            pool: node.name.to_owned(),
                            device,
                            ..DeviceRequestAllocationResult::default()
                        }
                    }));
                    satisfied = true;
                    break;
                }
                Err(e) => last_error = Some(e),
            }
        }
        if !satisfied {
            return Err(last_error.unwrap_or_else(|| format!("{path}: nothing to allocate")));
        }
    }
    Ok(results)
}

/// The request, or its `firstAvailable` subrequests in order, with their field paths.
fn alternatives<'a>(
    request: &'a DeviceRequest,
    path: &str,
) -> Result<Vec<(Alternative<'a>, String)>, String> {
    if let Some(exactly) = &request.exactly {
        return Ok(vec![(
            Alternative {
                result_name: request.name.clone(),
                class: &exactly.device_class_name,
                mode: exactly.allocation_mode.as_deref(),
                count: exactly.count,
                selectors: exactly.selectors.as_ref().is_some_and(|s| !s.is_empty()),
                admin_access: exactly.admin_access == Some(true),
                capacity: exactly
                    .capacity
                    .as_ref()
                    .and_then(|c| c.requests.as_ref())
                    .is_some_and(|r| !r.is_empty()),
            },
            format!("{path}.exactly"),
        )]);
    }
    let subrequests: &[DeviceSubRequest] = request.first_available.as_deref().unwrap_or_default();
    if subrequests.is_empty() {
        return Err(format!("{path}: neither exactly nor firstAvailable is set"));
    }
    Ok(subrequests
        .iter()
        .enumerate()
        .map(|(j, sub)| {
            (
                Alternative {
                    result_name: format!("{}/{}", request.name, sub.name),
                    class: &sub.device_class_name,
                    mode: sub.allocation_mode.as_deref(),
                    count: sub.count,
                    selectors: sub.selectors.as_ref().is_some_and(|s| !s.is_empty()),
                    admin_access: false,
                    capacity: sub
                        .capacity
                        .as_ref()
                        .and_then(|c| c.requests.as_ref())
                        .is_some_and(|r| !r.is_empty()),
                },
                format!("{path}.firstAvailable[{j}]"),
            )
        })
        .collect())
}

/// The devices of `candidates` (free, in slice order) that one alternative takes; a
/// partitionable device only when it fits the counters left, which it then consumes.
fn pick(
    alternative: &Alternative<'_>,
    at: &str,
    candidates: &[&Device],
    classes: &Classes,
    node: &Node<'_>,
    counters: &mut Counters,
) -> Result<Vec<String>, String> {
    let unsupported =
        |field: &str| format!("{at}.{field} is not supported by the demo's scheduler stand-in");
    if alternative.selectors {
        return Err(unsupported("selectors"));
    }
    if alternative.admin_access {
        return Err(unsupported("adminAccess"));
    }
    if alternative.capacity {
        return Err(unsupported("capacity"));
    }
    let class = alternative.class;
    if !classes.device_classes.contains_key(class) {
        return Err(format!(
            "{at}.deviceClassName: DeviceClass {class:?} not found"
        ));
    }
    let params = classes.params(class).ok_or_else(|| {
        format!(
            "{at}.deviceClassName: DeviceClass {class:?} carries no GpuClassParameters of {}; the demo evaluates kerf class selectors only, not CEL",
            node.driver
        )
    })?;
    let selector = DeviceSelector::new(&params, &format!("DeviceClass {class:?} parameters"))
        .map_err(|e| e.to_string())?;
    let matching: Vec<&Device> = candidates
        .iter()
        .copied()
        .filter(|d| selector.matches(d, node.driver))
        .collect();
    let wanted = match alternative.mode {
        Some("All") => {
            let matching = take_fitting(&matching, usize::MAX, counters);
            if matching.is_empty() {
                return Err(format!(
                    "{at}: no free device of class {class:?} on node {} (allocationMode All)",
                    node.name
                ));
            }
            return Ok(matching);
        }
        None | Some("ExactCount") => alternative.count.unwrap_or(1),
        Some(other) => return Err(format!("{at}.allocationMode: {other:?} is not known")),
    };
    let wanted = usize::try_from(wanted)
        .ok()
        .filter(|w| *w >= 1)
        .ok_or_else(|| format!("{at}.count: {wanted} is not a positive count"))?;
    let matching = take_fitting(&matching, wanted, counters);
    if matching.len() < wanted {
        let on_node = node
            .devices
            .iter()
            .filter(|d| selector.matches(d, node.driver))
            .count();
        let why = if on_node == 0 {
            "no device of the node matches the class".to_owned()
        } else {
            format!(
                "{} of the {on_node} matching device(s) are free",
                matching.len()
            )
        };
        return Err(format!(
            "{at}: cannot allocate {wanted} device(s) of class {class:?} on node {}: {why}",
            node.name
        ));
    }
    Ok(matching)
}

/// Up to `wanted` of `devices` in order, a partitionable one only when it fits the counters
/// left (its consumption is then taken from them).
fn take_fitting(devices: &[&Device], wanted: usize, counters: &mut Counters) -> Vec<String> {
    let mut taken = Vec::new();
    for device in devices {
        if taken.len() == wanted {
            break;
        }
        if Counters::consumes(device) {
            if !counters.fits(device) {
                continue;
            }
            counters.subtract(device);
        }
        taken.push(device.name.clone());
    }
    taken
}

/// The allocation the scheduler writes: results, the class configs (`FromClass`, per
/// request) followed by the claim's configs (`FromClaim`), the node selector and the time.
fn allocation(
    claim: &ResourceClaim,
    results: Vec<DeviceRequestAllocationResult>,
    classes: &Classes,
    node: &Node<'_>,
    now: Time,
) -> AllocationResult {
    let mut config = Vec::new();
    let mut seen_requests: Vec<(String, String)> = Vec::new();
    for result in &results {
        let class = class_of(claim, &result.request);
        if let Some(class) = class
            && !seen_requests.iter().any(|(r, _)| r == &result.request)
        {
            seen_requests.push((result.request.clone(), class.clone()));
        }
    }
    for (request, class) in &seen_requests {
        let class_configs = classes
            .device_classes
            .get(class)
            .and_then(|c| c.spec.config.clone())
            .unwrap_or_default();
        config.extend(
            class_configs
                .into_iter()
                .map(|c| DeviceAllocationConfiguration {
                    source: SOURCE_FROM_CLASS.to_owned(),
                    requests: Some(vec![request.clone()]),
                    opaque: c.opaque,
                }),
        );
    }
    let claim_configs = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.config.clone())
        .unwrap_or_default();
    config.extend(
        claim_configs
            .into_iter()
            .map(|c| DeviceAllocationConfiguration {
                source: SOURCE_FROM_CLAIM.to_owned(),
                requests: c.requests,
                opaque: c.opaque,
            }),
    );
    AllocationResult {
        allocation_timestamp: Some(now),
        devices: Some(DeviceAllocationResult {
            results: Some(results),
            config: (!config.is_empty()).then_some(config),
        }),
        node_selector: Some(kerf_api::allocation::node_selector(node.name)),
    }
}

/// The DeviceClass a result's request (`request` or `request/subrequest`) used.
fn class_of(claim: &ResourceClaim, result_request: &str) -> Option<String> {
    let (request, sub) = match result_request.split_once('/') {
        Some((r, s)) => (r, Some(s)),
        None => (result_request, None),
    };
    let found = claim
        .spec
        .devices
        .as_ref()?
        .requests
        .as_ref()?
        .iter()
        .find(|r| r.name == request)?;
    match sub {
        None => found.exactly.as_ref().map(|e| e.device_class_name.clone()),
        Some(sub) => found
            .first_available
            .as_ref()?
            .iter()
            .find(|s| s.name == sub)
            .map(|s| s.device_class_name.clone()),
    }
}

/// Whether no claim holds `device` (nor, through MIG, its parent or children).
fn is_free(device: &Device, node: &Node<'_>, held: &BTreeSet<String>, index: &Index) -> bool {
    if held.contains(&device.name) {
        return false;
    }
    if Counters::consumes(device) {
        // Its counters say whether it fits beside what is allocated.
        return true;
    }
    let string = |d: &Device, name: &str| -> Option<String> {
        device_attribute(d, node.driver, name).and_then(|a| a.string.clone())
    };
    match string(device, attributes::TYPE).as_deref() {
        Some(TYPE_GPU) => {
            let uuid = string(device, attributes::UUID);
            let child_held = node.devices.iter().any(|d| {
                held.contains(&d.name)
                    && uuid.is_some()
                    && string(d, attributes::PARENT_UUID) == uuid
            });
            !child_held && index.gpu_usage(node.name, &device.name).is_idle()
        }
        Some(TYPE_MIG) => {
            let parent_uuid = string(device, attributes::PARENT_UUID);
            let parent = node
                .devices
                .iter()
                .find(|d| parent_uuid.is_some() && string(d, attributes::UUID) == parent_uuid);
            parent.is_none_or(|p| {
                !held.contains(&p.name) && index.gpu_usage(node.name, &p.name).is_idle()
            })
        }
        _ => false,
    }
}

/// A device attribute by its constraint name: `<domain>/<id>`, where kerf's own domain is
/// published unqualified.
fn qualified_attribute<'a>(
    device: &'a Device,
    driver: &str,
    name: &str,
) -> Option<&'a DeviceAttribute> {
    let attributes = device.attributes.as_ref()?;
    attributes.get(name).or_else(|| {
        name.strip_prefix(driver)
            .and_then(|rest| rest.strip_prefix('/'))
            .and_then(|id| attributes.get(id))
    })
}
