//! What a claim asks for: its requests with claim and class parameters merged, in the
//! allocator's terms ([`claim_request`]).

use k8s_openapi::api::resource::v1::{ExactDeviceRequest, ResourceClaim};
use kerf_core::alloc::{self, ClaimRequest, DeviceRequest, SliceSize};
use kerf_core::enforcement::Enforcement;
use kerf_core::sharing::Sharing;

use crate::claim::parent_request;
use crate::error::{Error, Result};
use crate::params::{
    Allocator, GpuClaimParameters, GpuClassParameters, GpuSelector, OpaqueConfig, OpaqueKind,
    PlacementPolicy, TopologyScope, decode_opaque, join, quantity_at,
};
use crate::quantity::format_bytes;

use super::status::MAX_ALLOCATION_RESULTS;

/// [`MAX_ALLOCATION_RESULTS`] as a request count.
const MAX_COUNT: u32 = 32;

/// `allocationMode` that asks for a number of devices.
const MODE_EXACT_COUNT: &str = "ExactCount";

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
            PlacementPolicy::LeastFragmentation => alloc::Policy::LeastFragmentation,
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
pub(crate) fn core_selector(selector: &GpuSelector, path: &str) -> Result<alloc::GpuSelector> {
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
/// `MAX_ALLOCATION_RESULTS` devices in total; invalid class parameters.
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
    let requests = crate::claim::claim_requests(claim);
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
        let resolved =
            claim_device_request(request, &base, (configs.as_slice(), &class_params, driver))?;
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

/// One request of the claim at path `base`, `exactly` or `firstAvailable`, in the
/// allocator's terms.
fn claim_device_request(
    request: &k8s_openapi::api::resource::v1::DeviceRequest,
    base: &str,
    (configs, class_params, driver): (
        &[ClaimConfig],
        &impl Fn(&str) -> Option<GpuClassParameters>,
        &str,
    ),
) -> Result<DeviceRequest> {
    let resolved = match (&request.exactly, &request.first_available) {
        (Some(_), Some(_)) => {
            return Err(Error::config(
                join(base, "firstAvailable"),
                "set either exactly or firstAvailable, not both",
            ));
        }
        (Some(exactly), None) => {
            let at = join(base, "exactly");
            resolve_request(&request.name, exactly, &at, (configs, class_params, driver))?
        }
        (None, _) if request.first_available.is_none() => {
            return Err(Error::config(
                join(base, "exactly"),
                "missing (and no firstAvailable)",
            ));
        }
        (None, _) => {
            let mut subs = Vec::new();
            for (j, sub) in super::prioritized::subrequests(request, base)?
                .iter()
                .enumerate()
            {
                let at = format!("{base}.firstAvailable[{j}]");
                let name = format!("{}/{}", request.name, sub.name);
                let exact = super::prioritized::as_exact(sub);
                subs.push(resolve_request(
                    &name,
                    &exact,
                    &at,
                    (configs, class_params, driver),
                )?);
            }
            super::prioritized::parent(&request.name, subs)
        }
    };
    Ok(resolved)
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
    /// The sharing a claim config sets, and where.
    sharing: Option<(Sharing, String)>,
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
        if let Some(sharing) = params.sharing {
            merged.sharing = Some((sharing, join(&config.path, "sharing")));
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
        .as_ref()
        .map(|(sharing, _)| *sharing)
        .or(class.sharing.map(|s| s.strategy))
        .unwrap_or_default();
    let slice = slice_size(&merged, &class, &class_path)?;
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
    let enforcement = class.sharing.map(|s| s.enforcement).unwrap_or_default();
    if let (Enforcement::Server, Some(_), Some((claim_sharing, path))) =
        (enforcement, slice, &merged.sharing)
        && *claim_sharing != Sharing::Mps
    {
        return Err(Error::config(
            path.clone(),
            format!(
                "{} cannot be held by an MPS server, which the class {class_name:?} requires (sharing.enforcement Server); use MPS or leave sharing unset",
                sharing.as_str()
            ),
        ));
    }
    Ok(DeviceRequest {
        name: name.to_owned(),
        count,
        slice,
        enforcement,
        tolerations: super::prioritized::tolerations(exactly.tolerations.as_deref(), &at)?,
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

/// The slice the merged claim configs ask for, `None` for whole GPUs: the memory must be a
/// multiple of the class granularity, and a memory without compute takes the class's default
/// compute.
fn slice_size(
    merged: &Merged,
    class: &GpuClassParameters,
    class_path: &str,
) -> Result<Option<SliceSize>> {
    let slicing = class.slicing.as_ref();
    match (merged.memory.as_ref(), merged.compute) {
        (None, None) => Ok(None),
        (memory, compute) => {
            let memory_bytes = memory.map_or(0, |(bytes, _, _)| *bytes);
            if let (Some((bytes, text, path)), Some(granularity)) =
                (memory, class.memory_granularity_bytes(class_path)?)
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
            Ok(Some(SliceSize {
                memory_bytes,
                compute_percent: compute.or(default_compute).unwrap_or(0),
            }))
        }
    }
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
