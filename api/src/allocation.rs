//! ResourceClaims as the controller's allocator sees them: what a claim asks for
//! ([`claim_request`]), what an allocated claim holds whoever allocated it ([`device_uses`]),
//! and the `status.allocation` the controller writes for a placement ([`allocation_status`]).

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
    DeviceRequestAllocationResult, ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{
    self, ClaimPlacement, ClaimRequest, DeviceRequest, DeviceUse, SliceSize, UseKind,
};
use kerf_core::slice::Sharing;

use crate::claim::{SOURCE_FROM_CLAIM, parent_request};
use crate::error::{Error, Result};
use crate::params::{
    Allocator, GpuClaimParameters, GpuClassParameters, GpuSelector, GpuSliceAllocation,
    OpaqueConfig, OpaqueKind, PlacementPolicy, SliceDevice, TopologyScope, decode_opaque, join,
    quantity_at,
};
use crate::quantity::{self, format_bytes};

mod prioritized;

pub use prioritized::claim_allocation_status;

/// Most results one allocation may hold (`AllocationResultsMaxSize`).
pub const MAX_ALLOCATION_RESULTS: usize = 32;

/// [`MAX_ALLOCATION_RESULTS`] as a request count.
const MAX_COUNT: u32 = 32;

/// `allocationMode` that asks for a number of devices.
const MODE_EXACT_COUNT: &str = "ExactCount";

/// Capacity names the scheduler writes into `consumedCapacity` for a shared GPU.
const CONSUMED_MEMORY: &str = "memory";
/// Compute share in percent (0–100) of a shared GPU.
const CONSUMED_COMPUTE: &str = "compute";

impl From<TopologyScope> for alloc::TopologyScope {
    fn from(scope: TopologyScope) -> Self {
        match scope {
            TopologyScope::Any => alloc::TopologyScope::Any,
            TopologyScope::PcieRoot => alloc::TopologyScope::PcieRoot,
            TopologyScope::NvLink => alloc::TopologyScope::NvLink,
        }
    }
}

impl From<PlacementPolicy> for alloc::Policy {
    fn from(policy: PlacementPolicy) -> Self {
        match policy {
            PlacementPolicy::BinPack => alloc::Policy::BinPack,
            PlacementPolicy::Spread => alloc::Policy::Spread,
        }
    }
}

/// A class selector in the allocator's terms; `path` locates it for messages.
///
/// # Errors
///
/// [`Error::InvalidConfig`] for a minimum memory or compute capability that does not parse,
/// or a MIG profile (MIG devices are the scheduler's).
pub fn core_selector(selector: &GpuSelector, path: &str) -> Result<alloc::GpuSelector> {
    if let Some(profile) = &selector.mig_profile {
        return Err(Error::config(
            join(path, "migProfile"),
            format!(
                "{profile:?}: MIG devices are allocated by the Scheduler allocator, not kerf's controller"
            ),
        ));
    }
    Ok(alloc::GpuSelector {
        product_names: selector.product_names.clone(),
        min_memory_bytes: selector.min_memory_bytes(path)?,
        min_compute_capability: selector.min_compute_capability(path)?,
    })
}

/// What the devices of `claim`'s allocation hold, for the allocator's index: results of
/// `driver` only, whoever wrote them.
///
/// - A result that a `GpuSliceAllocation` entry of this driver names (kerf's controller) is a
///   slice of the entry's memory and compute, or the whole GPU when the entry sets neither.
/// - A result with `consumedCapacity` or a `shareID` (a consumable-capacity share, 1.36+) is
///   a slice of its consumed `memory` and `compute` (percent); missing ones count as zero.
/// - An admin-access result holds nothing.
/// - Anything else (the scheduler's whole-device allocation) holds the whole device.
///
/// Unallocated claims hold nothing. A config or quantity that does not decode makes the
/// result count as whole: over-counting is safe, under-counting would over-commit.
pub fn device_uses(claim: &ResourceClaim, driver: &str) -> Vec<DeviceUse> {
    let Some(devices) = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
    else {
        return Vec::new();
    };
    let slices = slice_allocations(devices, driver);
    devices
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == driver && r.admin_access != Some(true))
        .map(|result| DeviceUse {
            node: result.pool.clone(),
            device: result.device.clone(),
            kind: use_kind(result, &slices, driver),
        })
        .collect()
}

/// The `GpuSliceAllocation` configs of this driver that decode.
fn slice_allocations(devices: &DeviceAllocationResult, driver: &str) -> Vec<GpuSliceAllocation> {
    devices
        .config
        .iter()
        .flatten()
        .filter_map(|c| c.opaque.as_ref())
        .filter(|o| o.driver == driver)
        .filter_map(|o| match decode_opaque(&o.parameters.0, "parameters") {
            Ok(OpaqueConfig::Slice(slice)) => Some(slice),
            _ => None,
        })
        .collect()
}

fn use_kind(
    result: &DeviceRequestAllocationResult,
    slices: &[GpuSliceAllocation],
    driver: &str,
) -> UseKind {
    let share = result.share_id.as_deref();
    if let Some(entry) = slices
        .iter()
        .find_map(|s| s.find(&result.pool, &result.device, share))
    {
        if entry.memory_bytes.is_none() && entry.compute_percent.is_none() {
            return UseKind::Whole;
        }
        return UseKind::Slice {
            memory_bytes: entry.memory_bytes.unwrap_or(0),
            compute_percent: entry.compute_percent.unwrap_or(0),
            sharing: entry.sharing,
        };
    }
    if result.consumed_capacity.is_none() && share.is_none() {
        return UseKind::Whole;
    }
    let consumed = |name: &str| -> Option<u64> {
        let map = result.consumed_capacity.as_ref();
        let value = map.and_then(|m| m.get(name).or_else(|| m.get(&format!("{driver}/{name}"))));
        value.map_or(Some(0), amount)
    };
    match (consumed(CONSUMED_MEMORY), consumed(CONSUMED_COMPUTE)) {
        // A scheduler share (consumable capacity) names no strategy in its result; it counts
        // as unconstrained until the class's strategy travels with it.
        (Some(memory_bytes), Some(compute)) => UseKind::Slice {
            memory_bytes,
            compute_percent: u8::try_from(compute.min(100)).unwrap_or(100),
            sharing: Sharing::Exclusive,
        },
        _ => UseKind::Whole,
    }
}

/// A consumed amount: a whole number, zero included (the scheduler writes zero for a capacity
/// the share does not use; the size parser refuses it).
fn amount(value: &Quantity) -> Option<u64> {
    let text = value.0.trim_start_matches('+');
    let number: String = text
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    if number.chars().any(|c| c.is_ascii_digit()) && number.chars().all(|c| c == '0' || c == '.') {
        return Some(0);
    }
    quantity::quantity_bytes(value).ok()
}

/// The `status.allocation` that puts `placement`'s devices on `node`.
///
/// - `devices.results[]`: one per placed device, in placement order: `request`, `driver`,
///   `pool` = node, `device`.
/// - `devices.config[]`: one `source: FromClaim` entry for every request of the placement with
///   an opaque `GpuSliceAllocation` of `driver` that lists every device, whole GPUs included
///   (without memory or compute), so the kubelet plugin checks the GPU UUID of each and gets
///   the exact slice, sharing and (for a TimeSlicing device whose class names one) time slice
///   interval without re-deriving them from claim and class parameters. A slice's zero memory
///   or compute is left unset (not limited).
/// - `nodeSelector`: `matchFields metadata.name In [node]`, as the scheduler writes it.
/// - `allocationTimestamp`: `now`. Required: without it a 1.36+ scheduler's attempt to reserve
///   the claim stamps the timestamp onto the immutable allocation and is rejected.
///
/// # Errors
///
/// [`Error::InvalidConfig`] when the placement has more than [`MAX_ALLOCATION_RESULTS`]
/// devices or a device the `GpuSliceAllocation` cannot describe (empty name or UUID).
pub fn allocation_status(
    placement_for_claim: &ClaimPlacement,
    node: &str,
    driver: &str,
    now: Time,
) -> Result<AllocationResult> {
    let placed = &placement_for_claim.devices;
    if placed.len() > MAX_ALLOCATION_RESULTS {
        return Err(Error::config(
            "status.allocation.devices.results",
            format!(
                "{} devices; an allocation holds at most {MAX_ALLOCATION_RESULTS}",
                placed.len()
            ),
        ));
    }
    let results = placed
        .iter()
        .map(|device| DeviceRequestAllocationResult {
            request: device.request.clone(),
            driver: driver.to_owned(),
            pool: node.to_owned(),
            device: device.device.clone(),
            ..DeviceRequestAllocationResult::default()
        })
        .collect();
    let config = if placed.is_empty() {
        None
    } else {
        Some(vec![slice_config(placement_for_claim, node, driver)?])
    };
    Ok(AllocationResult {
        allocation_timestamp: Some(now),
        devices: Some(DeviceAllocationResult {
            results: Some(results),
            config,
        }),
        node_selector: Some(node_selector(node)),
    })
}

fn slice_config(
    placement: &ClaimPlacement,
    node: &str,
    driver: &str,
) -> Result<DeviceAllocationConfiguration> {
    let slices = GpuSliceAllocation {
        devices: placement
            .devices
            .iter()
            .map(|device| {
                let size = device.slice.unwrap_or_default();
                SliceDevice {
                    pool: node.to_owned(),
                    device: device.device.clone(),
                    share_id: None,
                    gpu_uuid: device.gpu_uuid.clone(),
                    memory_bytes: (size.memory_bytes > 0).then_some(size.memory_bytes),
                    compute_percent: (size.compute_percent > 0).then_some(size.compute_percent),
                    sharing: device.sharing,
                    // The node refuses an interval on a device that is not time-sliced.
                    time_slice_interval: device
                        .time_slice_interval
                        .filter(|_| device.sharing == Sharing::TimeSlicing),
                }
            })
            .collect(),
    };
    slices.validate("status.allocation.devices.config[0].opaque.parameters")?;
    let mut requests: Vec<String> = Vec::new();
    for device in &placement.devices {
        if !requests.contains(&device.request) {
            requests.push(device.request.clone());
        }
    }
    Ok(DeviceAllocationConfiguration {
        source: SOURCE_FROM_CLAIM.to_owned(),
        requests: Some(requests),
        opaque: Some(OpaqueDeviceConfiguration {
            driver: driver.to_owned(),
            parameters: slices.to_raw_extension()?,
        }),
    })
}

/// `matchFields metadata.name In [node]`.
pub fn node_selector(node: &str) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: None,
            match_fields: Some(vec![NodeSelectorRequirement {
                key: "metadata.name".to_owned(),
                operator: "In".to_owned(),
                values: Some(vec![node.to_owned()]),
            }]),
        }],
    }
}

/// A claim's part of a [`PodRequest`](kerf_core::alloc::PodRequest): its requests with the
/// claim's `GpuClaimParameters` merged over its classes' `GpuClassParameters`.
///
/// `class_params(deviceClassName)` gives the kerf class parameters of a DeviceClass, `None`
/// when it has none. The claim's key is its UID.
///
/// Per request (`spec.devices.requests[i].exactly`, or each of its `firstAvailable`
/// subrequests, at most 8, which become the allocator's alternatives named `request/sub`): the
/// class must be a kerf `Controller` class; `count` devices (default 1) with `allocationMode`
/// ExactCount; `tolerations` as the request's tolerations of device taints; `adminAccess: true`
/// (`exactly` only) for whole GPUs whoever uses them, consuming nothing. The claim's opaque
/// configs of `driver` that apply to the request (no `requests`, or naming it) are decoded
/// strictly and merged in order, later fields overriding earlier ones (for a subrequest also
/// configs naming its parent request or `request/sub`): `memory`, `compute`,
/// `sharing`, `topology`. A slice when memory or compute is set: compute defaults to the
/// class's `defaultCompute` when only memory is set; memory must be a multiple of the class's
/// `memoryGranularity` when the class sets slicing. From the class: selector, `maxSlicesPerGpu`,
/// placement policy, sharing unless the claim sets it, and `sharing.timeSliceInterval` when
/// the resulting sharing is TimeSlicing (claims cannot name one).
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming the field path and value for: a claim without UID or
/// requests; both or neither of `exactly` and `firstAvailable`; an empty or too long
/// `firstAvailable`; `allocationMode: All`; a count below 1; `adminAccess` with memory or
/// compute; a toleration operator or effect the API does not define; CEL
/// `selectors`; `capacity` requests; `constraints`; a class that is not a kerf Controller
/// class (for any subrequest); an opaque config of this driver that does not decode or is not
/// `GpuClaimParameters`; a memory that breaks the class granularity; more than
/// [`MAX_ALLOCATION_RESULTS`] devices in total; invalid class parameters.
pub fn claim_request(
    claim: &ResourceClaim,
    class_params: impl Fn(&str) -> Option<GpuClassParameters>,
    driver: &str,
) -> Result<ClaimRequest> {
    let key = claim
        .metadata
        .uid
        .clone()
        .filter(|uid| !uid.is_empty())
        .ok_or_else(|| Error::config("metadata.uid", "must be set: claims are keyed by UID"))?;
    let devices = claim.spec.devices.as_ref();
    let requests = devices
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default();
    if requests.is_empty() {
        return Err(Error::config(
            "spec.devices.requests",
            "the claim requests no devices",
        ));
    }
    if let Some(constraints) = devices
        .and_then(|d| d.constraints.as_deref())
        .filter(|c| !c.is_empty())
    {
        return Err(Error::config(
            "spec.devices.constraints[0]",
            format!(
                "{} constraint(s) are not supported by kerf's controller; use topology.scope in GpuClaimParameters",
                constraints.len()
            ),
        ));
    }
    let configs = claim_configs(claim, driver)?;
    let mut out = Vec::with_capacity(requests.len());
    let mut total = 0usize;
    for (i, request) in requests.iter().enumerate() {
        let base = format!("spec.devices.requests[{i}]");
        let resolved = match (&request.exactly, &request.first_available) {
            (Some(_), Some(_)) => {
                return Err(Error::config(
                    join(&base, "firstAvailable"),
                    "set either exactly or firstAvailable, not both",
                ));
            }
            (Some(exactly), None) => {
                let at = join(&base, "exactly");
                let resolve = (configs.as_slice(), &class_params, driver);
                resolve_request(&request.name, exactly, &at, resolve)?
            }
            (None, _) if request.first_available.is_none() => {
                return Err(Error::config(
                    join(&base, "exactly"),
                    "missing (and no firstAvailable)",
                ));
            }
            (None, _) => {
                let mut subs = Vec::new();
                for (j, sub) in prioritized::subrequests(request, &base)?.iter().enumerate() {
                    let at = format!("{base}.firstAvailable[{j}]");
                    let name = format!("{}/{}", request.name, sub.name);
                    let exact = prioritized::as_exact(sub);
                    subs.push(resolve_request(
                        &name,
                        &exact,
                        &at,
                        (configs.as_slice(), &class_params, driver),
                    )?);
                }
                prioritized::parent(&request.name, subs)
            }
        };
        // The fewest devices the request may take, as kube-scheduler's allocator counts it.
        total += resolved
            .first_available
            .iter()
            .map(|s| s.count)
            .min()
            .unwrap_or(resolved.count) as usize;
        out.push(resolved);
    }
    if total > MAX_ALLOCATION_RESULTS {
        return Err(Error::config(
            "spec.devices.requests",
            format!(
                "{total} devices in total; an allocation holds at most {MAX_ALLOCATION_RESULTS}"
            ),
        ));
    }
    Ok(ClaimRequest { key, requests: out })
}

/// A decoded `GpuClaimParameters` of the claim and where it sits.
struct ClaimConfig {
    path: String,
    requests: Vec<String>,
    params: GpuClaimParameters,
}

fn claim_configs(claim: &ResourceClaim, driver: &str) -> Result<Vec<ClaimConfig>> {
    let configs = claim
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();
    let mut out = Vec::new();
    for (i, config) in configs.iter().enumerate() {
        let Some(opaque) = config.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let path = format!("spec.devices.config[{i}].opaque.parameters");
        match decode_opaque(&opaque.parameters.0, &path)? {
            OpaqueConfig::Claim(params) => out.push(ClaimConfig {
                path,
                requests: config.requests.clone().unwrap_or_default(),
                params,
            }),
            other => {
                return Err(Error::config(
                    join(&path, "kind"),
                    format!(
                        "{} does not belong in a ResourceClaim; expected {}",
                        other.kind(),
                        GpuClaimParameters::KIND
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// The claim's settings for one request, with where memory came from for messages.
#[derive(Default)]
struct Merged {
    memory: Option<(u64, String, String)>,
    compute: Option<u8>,
    sharing: Option<Sharing>,
    topology: Option<TopologyScope>,
}

fn merge_claim_configs(request: &str, configs: &[ClaimConfig]) -> Result<Merged> {
    let mut merged = Merged::default();
    // `parent/sub` takes the configs of its parent request too, as the scheduler's allocator
    // applies them (allocator_stable.go, Allocate).
    let parent = parent_request(request);
    let applies = |c: &&ClaimConfig| {
        c.requests.is_empty() || c.requests.iter().any(|r| r == request || r == parent)
    };
    for config in configs.iter().filter(applies) {
        let params = &config.params;
        if let Some(memory) = &params.memory {
            let path = join(&config.path, "memory");
            merged.memory = Some((quantity_at(memory, &path)?, memory.0.clone(), path));
        }
        if params.compute.is_some() {
            merged.compute = params.compute;
        }
        if params.sharing.is_some() {
            merged.sharing = params.sharing;
        }
        if let Some(topology) = params.topology {
            merged.topology = Some(topology.scope);
        }
    }
    Ok(merged)
}

/// One `exactly` request (or subrequest) at path `at` in the allocator's terms.
fn resolve_request(
    name: &str,
    exactly: &ExactDeviceRequest,
    at: &str,
    (configs, class_params, driver): (
        &[ClaimConfig],
        &impl Fn(&str) -> Option<GpuClassParameters>,
        &str,
    ),
) -> Result<DeviceRequest> {
    let at = at.to_owned();
    check_supported(exactly, &at)?;
    let count = request_count(exactly, &at)?;
    let class_name = exactly.device_class_name.as_str();
    let class = controller_class(class_name, class_params, &at, driver)?;
    let class_path = format!("DeviceClass {class_name:?} parameters");
    class.validate(&class_path)?;
    let merged = merge_claim_configs(name, configs)?;
    let slicing = class.slicing.as_ref();
    let sharing = merged
        .sharing
        .or(class.sharing.map(|s| s.strategy))
        .unwrap_or_default();
    let slice = match (merged.memory.as_ref(), merged.compute) {
        (None, None) => None,
        (memory, compute) => {
            let memory_bytes = memory.map_or(0, |(bytes, _, _)| *bytes);
            if let (Some((bytes, text, path)), Some(granularity)) =
                (memory, class.memory_granularity_bytes(&class_path)?)
                && bytes % granularity != 0
            {
                return Err(Error::config(
                    path,
                    format!(
                        "{text} is not a multiple of the class granularity {}",
                        format_bytes(granularity)
                    ),
                ));
            }
            let default_compute = memory.and(slicing.and_then(|s| s.default_compute));
            Some(SliceSize {
                memory_bytes,
                compute_percent: compute.or(default_compute).unwrap_or(0),
            })
        }
    };
    let admin_access = exactly.admin_access == Some(true);
    if admin_access && let Some(size) = slice {
        return Err(Error::config(
            join(&at, "adminAccess"),
            format!(
                "true takes whole GPUs, but the claim's config asks for a slice of {} memory and {}% compute",
                format_bytes(size.memory_bytes),
                size.compute_percent
            ),
        ));
    }
    Ok(DeviceRequest {
        name: name.to_owned(),
        count,
        slice,
        tolerations: prioritized::tolerations(exactly.tolerations.as_deref(), &at)?,
        admin_access,
        first_available: Vec::new(),
        selector: core_selector(&class.selector, &join(&class_path, "selector"))?,
        topology: merged.topology.unwrap_or_default().into(),
        policy: class.placement.map(|p| p.policy).unwrap_or_default().into(),
        max_slices_per_gpu: slicing.and_then(|s| s.max_slices_per_gpu),
        sharing,
        time_slice_interval: class
            .sharing
            .and_then(|s| s.time_slice_interval_for(sharing)),
    })
}

fn check_supported(exactly: &ExactDeviceRequest, at: &str) -> Result<()> {
    if exactly.selectors.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(Error::config(
            join(at, "selectors"),
            "CEL selectors are not evaluated by kerf's controller; select GPUs in the class",
        ));
    }
    if exactly
        .capacity
        .as_ref()
        .and_then(|c| c.requests.as_ref())
        .is_some_and(|r| !r.is_empty())
    {
        return Err(Error::config(
            join(at, "capacity.requests"),
            "consumable capacity is not supported by kerf's controller; set memory and compute in GpuClaimParameters",
        ));
    }
    Ok(())
}

fn request_count(exactly: &ExactDeviceRequest, at: &str) -> Result<u32> {
    match exactly.allocation_mode.as_deref() {
        None | Some(MODE_EXACT_COUNT) => {}
        Some(mode) => {
            return Err(Error::config(
                join(at, "allocationMode"),
                format!(
                    "{mode:?} is not supported by kerf's controller; use ExactCount with a count"
                ),
            ));
        }
    }
    let count = exactly.count.unwrap_or(1);
    u32::try_from(count)
        .ok()
        .filter(|c| (1..=MAX_COUNT).contains(c))
        .ok_or_else(|| {
            Error::config(
                join(at, "count"),
                format!("{count} is out of range 1-{MAX_ALLOCATION_RESULTS}"),
            )
        })
}

fn controller_class(
    name: &str,
    class_params: &impl Fn(&str) -> Option<GpuClassParameters>,
    at: &str,
    driver: &str,
) -> Result<GpuClassParameters> {
    let field = join(at, "deviceClassName");
    let class = class_params(name).ok_or_else(|| {
        Error::config(
            &field,
            format!("{name:?} has no GpuClassParameters of driver {driver}; kerf's controller allocates a claim only when every request uses a kerf Controller class"),
        )
    })?;
    if class.allocator != Allocator::Controller {
        return Err(Error::config(
            field,
            format!(
                "{name:?} uses allocator {:?}; kerf's controller allocates a claim only when every request uses a Controller class",
                class.allocator
            ),
        ));
    }
    Ok(class)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::Timestamp;
    use kerf_core::alloc::{PlacedDevice, Policy};
    use kerf_core::inventory::ComputeCapability;
    use kerf_core::mps::TimeSliceInterval;
    use kerf_core::slice::SliceLimits;
    use serde_json::{Value, json};

    use super::*;
    use crate::claim::resolve_allocation;
    use crate::params::{Placement, SharingConfig, Slicing};
    use crate::{API_VERSION, AllocatedDevice};

    const DRIVER: &str = "gpu.kerf.dev";
    const GI: u64 = 1 << 30;

    fn claim(value: &Value) -> ResourceClaim {
        serde_json::from_value(value.clone()).unwrap()
    }

    fn allocated(results: &Value, config: &Value) -> ResourceClaim {
        claim(&json!({
            "metadata": { "namespace": "ns", "name": "c", "uid": "uid-1" },
            "spec": { "devices": {} },
            "status": { "allocation": { "devices": { "results": results, "config": config } } },
        }))
    }

    fn time() -> Time {
        Time(Timestamp::from_second(1_800_000_000).unwrap())
    }

    fn placed(request: &str, device: &str, slice: Option<SliceSize>) -> PlacedDevice {
        PlacedDevice {
            request: request.to_owned(),
            device: device.to_owned(),
            gpu_uuid: format!("GPU-{device}"),
            slice,
            sharing: Sharing::Mps,
            time_slice_interval: None,
        }
    }

    fn size(memory_gi: u64, compute: u8) -> SliceSize {
        SliceSize {
            memory_bytes: memory_gi * GI,
            compute_percent: compute,
        }
    }

    fn mixed_placement() -> ClaimPlacement {
        ClaimPlacement {
            key: "uid-1".into(),
            devices: vec![
                placed("a", "gpu-0", Some(size(20, 25))),
                placed("a", "gpu-1", Some(size(20, 0))),
                placed("b", "gpu-3", None),
            ],
        }
    }

    fn with_allocation(allocation: &AllocationResult) -> ResourceClaim {
        let mut claim = allocated(&json!([]), &json!([]));
        claim.status.as_mut().unwrap().allocation = Some(allocation.clone());
        claim
    }

    // ---- allocation_status ----

    #[test]
    fn allocation_status_has_results_config_node_selector_and_timestamp() {
        let allocation = allocation_status(&mixed_placement(), "node-7", DRIVER, time()).unwrap();
        let expected = json!({
            "allocationTimestamp": "2027-01-15T08:00:00Z",
            "devices": {
                "results": [
                    { "request": "a", "driver": DRIVER, "pool": "node-7", "device": "gpu-0" },
                    { "request": "a", "driver": DRIVER, "pool": "node-7", "device": "gpu-1" },
                    { "request": "b", "driver": DRIVER, "pool": "node-7", "device": "gpu-3" },
                ],
                "config": [{
                    "source": "FromClaim",
                    "requests": ["a", "b"],
                    "opaque": {
                        "driver": DRIVER,
                        "parameters": {
                            "apiVersion": API_VERSION,
                            "kind": "GpuSliceAllocation",
                            "devices": [
                                { "pool": "node-7", "device": "gpu-0", "gpuUUID": "GPU-gpu-0",
                                  "memoryBytes": 20 * GI, "computePercent": 25, "sharing": "MPS" },
                                { "pool": "node-7", "device": "gpu-1", "gpuUUID": "GPU-gpu-1",
                                  "memoryBytes": 20 * GI, "sharing": "MPS" },
                                { "pool": "node-7", "device": "gpu-3", "gpuUUID": "GPU-gpu-3",
                                  "sharing": "MPS" },
                            ],
                        },
                    },
                }],
            },
            "nodeSelector": { "nodeSelectorTerms": [
                { "matchFields": [{ "key": "metadata.name", "operator": "In", "values": ["node-7"] }] },
            ]},
        });
        assert_eq!(serde_json::to_value(&allocation).unwrap(), expected);
    }

    #[test]
    fn the_kubelet_plugin_resolves_what_the_controller_writes() {
        let allocation = allocation_status(&mixed_placement(), "node-7", DRIVER, time()).unwrap();
        let devices = resolve_allocation(&with_allocation(&allocation), DRIVER).unwrap();
        let device = |device: &str, memory: Option<u64>, compute: Option<u8>| AllocatedDevice {
            request: if device == "gpu-3" { "b" } else { "a" }.to_owned(),
            pool: "node-7".into(),
            device: device.into(),
            share_id: None,
            admin_access: false,
            limits: SliceLimits {
                memory_bytes: memory,
                compute_percent: compute,
            },
            sharing: Sharing::Mps,
            time_slice_interval: TimeSliceInterval::Default,
            expected_gpu_uuid: Some(format!("GPU-{device}")),
        };
        assert_eq!(
            devices,
            [
                device("gpu-0", Some(20 * GI), Some(25)),
                device("gpu-1", Some(20 * GI), None),
                device("gpu-3", None, None),
            ]
        );
    }

    fn time_sliced_placement() -> ClaimPlacement {
        let time_sliced = |device: &str, interval| PlacedDevice {
            sharing: Sharing::TimeSlicing,
            time_slice_interval: interval,
            ..placed("a", device, Some(size(10, 0)))
        };
        ClaimPlacement {
            key: "uid-1".into(),
            devices: vec![
                time_sliced("gpu-0", Some(TimeSliceInterval::Long)),
                time_sliced("gpu-1", None),
                // Not time-sliced: an interval here would make the node refuse the entry.
                PlacedDevice {
                    time_slice_interval: Some(TimeSliceInterval::Short),
                    ..placed("a", "gpu-2", Some(size(10, 0)))
                },
            ],
        }
    }

    #[test]
    fn allocation_status_writes_the_interval_of_time_sliced_devices() {
        let allocation =
            allocation_status(&time_sliced_placement(), "node-7", DRIVER, time()).unwrap();
        let value = serde_json::to_value(&allocation).unwrap();
        let devices = &value["devices"]["config"][0]["opaque"]["parameters"]["devices"];
        assert_eq!(
            devices,
            &json!([
                { "pool": "node-7", "device": "gpu-0", "gpuUUID": "GPU-gpu-0",
                  "memoryBytes": 10 * GI, "sharing": "TimeSlicing", "timeSliceInterval": "Long" },
                { "pool": "node-7", "device": "gpu-1", "gpuUUID": "GPU-gpu-1",
                  "memoryBytes": 10 * GI, "sharing": "TimeSlicing" },
                { "pool": "node-7", "device": "gpu-2", "gpuUUID": "GPU-gpu-2",
                  "memoryBytes": 10 * GI, "sharing": "MPS" },
            ])
        );
    }

    #[test]
    fn the_kubelet_plugin_reads_back_the_interval_the_controller_writes() {
        let allocation =
            allocation_status(&time_sliced_placement(), "node-7", DRIVER, time()).unwrap();
        let devices = resolve_allocation(&with_allocation(&allocation), DRIVER).unwrap();
        let intervals: Vec<_> = devices
            .iter()
            .map(|d| (d.device.as_str(), d.sharing, d.time_slice_interval))
            .collect();
        assert_eq!(
            intervals,
            [
                ("gpu-0", Sharing::TimeSlicing, TimeSliceInterval::Long),
                ("gpu-1", Sharing::TimeSlicing, TimeSliceInterval::Default),
                ("gpu-2", Sharing::Mps, TimeSliceInterval::Default),
            ]
        );
    }

    #[test]
    fn usage_read_back_equals_the_placement() {
        let placement = mixed_placement();
        let allocation = allocation_status(&placement, "node-7", DRIVER, time()).unwrap();
        assert_eq!(
            device_uses(&with_allocation(&allocation), DRIVER),
            placement.device_uses("node-7")
        );
    }

    #[test]
    fn allocation_status_refuses_too_many_devices_and_bad_entries() {
        let many = ClaimPlacement {
            key: "k".into(),
            devices: (0..33)
                .map(|i| placed("a", &format!("gpu-{i}"), None))
                .collect(),
        };
        let err = allocation_status(&many, "n", DRIVER, time()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "status.allocation.devices.results: 33 devices; an allocation holds at most 32"
        );
        let mut bad = mixed_placement();
        bad.devices[0].gpu_uuid.clear();
        let err = allocation_status(&bad, "n", DRIVER, time()).unwrap_err();
        assert!(
            err.to_string().contains("gpuUUID: must not be empty"),
            "{err}"
        );
        let empty = ClaimPlacement {
            key: "k".into(),
            devices: Vec::new(),
        };
        let allocation = allocation_status(&empty, "n", DRIVER, time()).unwrap();
        assert_eq!(allocation.devices.unwrap().config, None);
    }

    // ---- device_uses ----

    #[test]
    fn an_unallocated_claim_holds_nothing() {
        let claim = claim(&json!({ "metadata": { "name": "c" }, "spec": {} }));
        assert_eq!(device_uses(&claim, DRIVER), []);
    }

    #[test]
    fn scheduler_results_hold_whole_devices_and_admin_access_holds_nothing() {
        let claim = allocated(
            &json!([
                { "request": "g", "driver": DRIVER, "pool": "node-1", "device": "gpu-0" },
                { "request": "n", "driver": "net.example.com", "pool": "node-1", "device": "eth0" },
                { "request": "m", "driver": DRIVER, "pool": "node-1", "device": "gpu-1", "adminAccess": true },
            ]),
            &json!([]),
        );
        assert_eq!(
            device_uses(&claim, DRIVER),
            [DeviceUse::whole("node-1", "gpu-0")]
        );
    }

    #[test]
    fn consumed_capacity_and_shares_are_slices() {
        let claim = allocated(
            &json!([
                { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-0", "shareID": "s1",
                  "consumedCapacity": { "memory": "30Gi", "compute": "40" } },
                { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-1", "shareID": "s2",
                  "consumedCapacity": { "gpu.kerf.dev/memory": "10Gi", "compute": "0", "multiprocessors": "12" } },
                { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-2", "shareID": "s3" },
                { "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-3",
                  "consumedCapacity": { "memory": "lots" } },
            ]),
            &json!([]),
        );
        assert_eq!(
            device_uses(&claim, DRIVER),
            [
                DeviceUse::slice("n", "gpu-0", 30 * GI, 40),
                DeviceUse::slice("n", "gpu-1", 10 * GI, 0),
                DeviceUse::slice("n", "gpu-2", 0, 0),
                DeviceUse::whole("n", "gpu-3"),
            ]
        );
    }

    #[test]
    fn a_slice_config_that_does_not_decode_counts_as_whole() {
        let claim = allocated(
            &json!([{ "request": "a", "driver": DRIVER, "pool": "n", "device": "gpu-0" }]),
            &json!([{ "source": "FromClaim", "opaque": { "driver": DRIVER, "parameters": {
                "apiVersion": API_VERSION, "kind": "GpuSliceAllocation", "devices": [], "extra": 1,
            }}}]),
        );
        assert_eq!(
            device_uses(&claim, DRIVER),
            [DeviceUse::whole("n", "gpu-0")]
        );
    }

    // ---- claim_request ----

    fn controller_class() -> GpuClassParameters {
        GpuClassParameters {
            allocator: Allocator::Controller,
            selector: GpuSelector {
                product_names: vec!["NVIDIA H100 80GB HBM3".into()],
                min_memory: Some(Quantity("40Gi".into())),
                min_compute_capability: Some("9.0".into()),
                mig_profile: None,
            },
            slicing: Some(Slicing {
                memory_granularity: Quantity("2Gi".into()),
                max_slices_per_gpu: Some(7),
                default_compute: Some(15),
            }),
            placement: Some(Placement {
                policy: PlacementPolicy::Spread,
            }),
            sharing: Some(SharingConfig {
                strategy: Sharing::TimeSlicing,
                time_slice_interval: Some(TimeSliceInterval::Long),
            }),
        }
    }

    fn classes(name: &str) -> Option<GpuClassParameters> {
        match name {
            "slices" => Some(controller_class()),
            "plain" => Some(GpuClassParameters {
                allocator: Allocator::Controller,
                ..GpuClassParameters::default()
            }),
            "scheduler" => Some(GpuClassParameters::default()),
            "mig" => Some(GpuClassParameters {
                allocator: Allocator::Controller,
                selector: GpuSelector {
                    mig_profile: Some("1g.10gb".into()),
                    ..GpuSelector::default()
                },
                ..GpuClassParameters::default()
            }),
            _ => None,
        }
    }

    fn params(fields: &Value) -> Value {
        let mut parameters = json!({ "apiVersion": API_VERSION, "kind": "GpuClaimParameters" });
        if let (Some(target), Value::Object(fields)) = (parameters.as_object_mut(), fields) {
            target.extend(fields.clone());
        }
        parameters
    }

    fn config(requests: &[&str], fields: &Value) -> Value {
        let mut entry = json!({ "opaque": { "driver": DRIVER, "parameters": params(fields) } });
        if !requests.is_empty() {
            entry["requests"] = json!(requests);
        }
        entry
    }

    fn request(name: &str, class: &str) -> Value {
        json!({ "name": name, "exactly": { "deviceClassName": class } })
    }

    fn spec_claim(requests: &Value, configs: &Value) -> ResourceClaim {
        claim(&json!({
            "metadata": { "namespace": "ns", "name": "c", "uid": "uid-1" },
            "spec": { "devices": { "requests": requests, "config": configs } },
        }))
    }

    fn request_of(requests: &Value, configs: &Value) -> Result<ClaimRequest> {
        claim_request(&spec_claim(requests, configs), classes, DRIVER)
    }

    fn error_of(requests: &Value, configs: &Value) -> String {
        request_of(requests, configs).unwrap_err().to_string()
    }

    #[test]
    fn a_whole_gpu_request_takes_the_class_settings() {
        let claim = request_of(&json!([request("gpu", "slices")]), &json!([])).unwrap();
        assert_eq!(claim.key, "uid-1");
        assert_eq!(
            claim.requests,
            [DeviceRequest {
                name: "gpu".into(),
                count: 1,
                slice: None,
                selector: alloc::GpuSelector {
                    product_names: vec!["NVIDIA H100 80GB HBM3".into()],
                    min_memory_bytes: Some(40 * GI),
                    min_compute_capability: Some(ComputeCapability { major: 9, minor: 0 }),
                },
                topology: alloc::TopologyScope::Any,
                policy: Policy::Spread,
                max_slices_per_gpu: Some(7),
                sharing: Sharing::TimeSlicing,
                time_slice_interval: Some(TimeSliceInterval::Long),
                tolerations: Vec::new(),
                admin_access: false,
                first_available: Vec::new(),
            }]
        );
    }

    #[test]
    fn the_class_interval_follows_only_time_sliced_requests() {
        let requests = json!([
            request("a", "slices"),
            request("b", "slices"),
            request("c", "plain")
        ]);
        let configs = json!([
            config(&["a"], &json!({ "sharing": "MPS" })),
            config(&["c"], &json!({ "sharing": "TimeSlicing" })),
        ]);
        let claim = request_of(&requests, &configs).unwrap();
        let intervals: Vec<_> = claim
            .requests
            .iter()
            .map(|r| (r.name.as_str(), r.sharing, r.time_slice_interval))
            .collect();
        assert_eq!(
            intervals,
            [
                // The claim overrides the class's TimeSlicing: no interval.
                ("a", Sharing::Mps, None),
                ("b", Sharing::TimeSlicing, Some(TimeSliceInterval::Long)),
                // Time-sliced by the claim, but the class names no interval.
                ("c", Sharing::TimeSlicing, None),
            ]
        );
    }

    #[test]
    fn claim_parameters_make_slices_per_request_later_configs_winning() {
        let requests = json!([
            { "name": "a", "exactly": { "deviceClassName": "slices", "count": 2, "allocationMode": "ExactCount" } },
            request("b", "slices"),
            request("c", "plain"),
        ]);
        let configs = json!([
            config(&[], &json!({ "memory": "10Gi", "topology": { "scope": "NVLink" } })),
            config(&["a"], &json!({ "memory": "20Gi", "compute": 30, "sharing": "MPS" })),
            config(&["c"], &json!({ "compute": 50 })),
            { "opaque": { "driver": "other.example.com", "parameters": { "anything": true } } },
        ]);
        let claim = request_of(&requests, &configs).unwrap();
        let summary: Vec<_> = claim
            .requests
            .iter()
            .map(|r| {
                (
                    r.name.as_str(),
                    r.count,
                    r.slice,
                    r.topology,
                    r.sharing,
                    r.policy,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "a",
                    2,
                    Some(size(20, 30)),
                    alloc::TopologyScope::NvLink,
                    Sharing::Mps,
                    Policy::Spread
                ),
                // Memory only: the class's default compute applies.
                (
                    "b",
                    1,
                    Some(size(10, 15)),
                    alloc::TopologyScope::NvLink,
                    Sharing::TimeSlicing,
                    Policy::Spread
                ),
                // The memory of the first config also applies to c; no class default compute.
                (
                    "c",
                    1,
                    Some(size(10, 50)),
                    alloc::TopologyScope::NvLink,
                    Sharing::Exclusive,
                    Policy::BinPack
                ),
            ]
        );
        let compute_only = request_of(
            &json!([request("c", "plain")]),
            &json!([config(&[], &json!({ "compute": 20 }))]),
        )
        .unwrap();
        assert_eq!(
            compute_only.requests[0].slice,
            Some(SliceSize {
                memory_bytes: 0,
                compute_percent: 20
            })
        );
    }

    #[test]
    fn memory_must_be_a_multiple_of_the_class_granularity() {
        let err = error_of(
            &json!([request("a", "slices")]),
            &json!([config(&[], &json!({ "memory": "7Gi" }))]),
        );
        assert_eq!(
            err,
            "spec.devices.config[0].opaque.parameters.memory: 7Gi is not a multiple of the class granularity 2Gi"
        );
        // A class without slicing has no granularity.
        assert!(
            request_of(
                &json!([request("a", "plain")]),
                &json!([config(&[], &json!({ "memory": "7Gi" }))])
            )
            .is_ok()
        );
    }

    #[test]
    fn claim_parameters_are_decoded_strictly() {
        let cases = [
            (
                json!([config(&[], &json!({ "memory": "10Gi", "colour": "red" }))]),
                "spec.devices.config[0].opaque.parameters.colour: unknown field `colour`",
            ),
            (
                json!([config(&[], &json!({ "compute": 150 }))]),
                "spec.devices.config[0].opaque.parameters.compute: 150 is out of range 1-100",
            ),
            (
                json!([config(&[], &json!({ "memory": "-1Gi" }))]),
                "spec.devices.config[0].opaque.parameters.memory: \"-1Gi\" is not a valid byte quantity: must not be negative",
            ),
            (
                json!([{ "opaque": { "driver": DRIVER, "parameters": {
                    "apiVersion": API_VERSION, "kind": "GpuClassParameters" } } }]),
                "spec.devices.config[0].opaque.parameters.kind: GpuClassParameters does not belong in a ResourceClaim; expected GpuClaimParameters",
            ),
        ];
        for (configs, message) in cases {
            let err = error_of(&json!([request("a", "slices")]), &configs);
            assert!(err.starts_with(message), "{err}\n  expected {message}");
        }
    }

    #[test]
    fn unsupported_request_forms_are_refused_with_the_field() {
        let exactly = |extra: Value| {
            let mut r = request("a", "slices");
            if let (Some(target), Value::Object(extra)) = (r["exactly"].as_object_mut(), extra) {
                target.extend(extra);
            }
            json!([r])
        };
        let cases = [
            (
                json!([{ "name": "a", "firstAvailable": [
                    { "name": "x", "deviceClassName": "slices" },
                    { "name": "y", "deviceClassName": "scheduler" },
                ] }]),
                "spec.devices.requests[0].firstAvailable[1].deviceClassName: \"scheduler\" uses allocator Scheduler",
            ),
            (
                exactly(json!({ "allocationMode": "All" })),
                "spec.devices.requests[0].exactly.allocationMode: \"All\" is not supported by kerf's controller; use ExactCount with a count",
            ),
            (
                exactly(json!({ "count": 0 })),
                "spec.devices.requests[0].exactly.count: 0 is out of range 1-32",
            ),
            (
                exactly(json!({ "tolerations": [{ "key": "k", "operator": "Bogus" }] })),
                "spec.devices.requests[0].exactly.tolerations[0].operator: \"Bogus\" is not a toleration operator",
            ),
            (
                exactly(json!({ "selectors": [{ "cel": { "expression": "true" } }] })),
                "spec.devices.requests[0].exactly.selectors: CEL selectors are not evaluated",
            ),
            (
                exactly(json!({ "capacity": { "requests": { "memory": "10Gi" } } })),
                "spec.devices.requests[0].exactly.capacity.requests: consumable capacity is not supported",
            ),
            (
                json!([request("a", "nvidia")]),
                "spec.devices.requests[0].exactly.deviceClassName: \"nvidia\" has no GpuClassParameters of driver gpu.kerf.dev",
            ),
            (
                json!([request("a", "scheduler")]),
                "spec.devices.requests[0].exactly.deviceClassName: \"scheduler\" uses allocator Scheduler",
            ),
            (
                json!([request("a", "mig")]),
                "DeviceClass \"mig\" parameters.selector.migProfile: \"1g.10gb\": MIG devices are allocated by the Scheduler allocator",
            ),
            (
                json!([]),
                "spec.devices.requests: the claim requests no devices",
            ),
            (
                json!([{ "name": "a", "exactly": { "deviceClassName": "slices", "count": 20 } },
                       { "name": "b", "exactly": { "deviceClassName": "slices", "count": 20 } }]),
                "spec.devices.requests: 40 devices in total; an allocation holds at most 32",
            ),
        ];
        for (requests, message) in cases {
            let err = error_of(&requests, &json!([]));
            assert!(err.starts_with(message), "{err}\n  expected {message}");
        }
    }

    #[test]
    fn constraints_and_a_missing_uid_are_refused() {
        let mut with_constraints = spec_claim(&json!([request("a", "slices")]), &json!([]));
        with_constraints.spec.devices.as_mut().unwrap().constraints =
            serde_json::from_value(json!([
                { "requests": ["a"], "matchAttribute": "resource.kubernetes.io/pcieRoot" }
            ]))
            .unwrap();
        let err = claim_request(&with_constraints, classes, DRIVER).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("spec.devices.constraints[0]: 1 constraint(s) are not supported"),
            "{err}"
        );

        let mut no_uid = spec_claim(&json!([request("a", "slices")]), &json!([]));
        no_uid.metadata.uid = None;
        let err = claim_request(&no_uid, classes, DRIVER).unwrap_err();
        assert_eq!(
            err.to_string(),
            "metadata.uid: must be set: claims are keyed by UID"
        );
        assert_eq!(err.reason(), "invalid_config");
    }

    #[test]
    fn api_enums_convert_into_the_allocators() {
        assert_eq!(
            alloc::TopologyScope::from(TopologyScope::PcieRoot),
            alloc::TopologyScope::PcieRoot
        );
        assert_eq!(
            alloc::TopologyScope::from(TopologyScope::NvLink),
            alloc::TopologyScope::NvLink
        );
        assert_eq!(Policy::from(PlacementPolicy::Spread), Policy::Spread);
        assert_eq!(Policy::from(PlacementPolicy::BinPack), Policy::BinPack);
    }

    mod prioritized;
}
