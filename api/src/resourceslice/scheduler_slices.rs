//! Whole GPUs published as shareable for kube-scheduler (consumable capacity,
//! `DRAConsumableCapacity`, beta in Kubernetes 1.36): scheduler slices.
//!
//! A GPU that the Node's ownership record gives to the scheduler and that kerf-controller names
//! in the shared publication ([`crate::shared_publication`]) keeps its name and attributes and
//! gets `allowMultipleAllocations: true` with these capacities:
//!
//! - `memory`: the true bytes; a share takes a multiple of the granularity `G`
//!   (`validRange{min: G, step: G, max: ⌊bytes/G⌋·G}`), and a request that names no memory takes
//!   `default = ⌊bytes/G⌋·G`, so a claim without capacity requests gets the whole GPU (no other
//!   share fits beside it, as min is G);
//! - `compute`: 100 (percent); `default` is the class's default compute (else 100),
//!   `validRange{1..100, step 1}`;
//! - `slices` (only with `maxSlicesPerGpu`): the most shares, each taking exactly 1;
//! - `multiprocessors`: the SM count, with a policy that only allows 0, because on a shareable
//!   device every capacity is consumed by every share (kubernetes/api `resource/v1/types.go`
//!   `Device.AllowMultipleAllocations`: "all of its capacity is consumable"); zero keeps the SM
//!   count visible to CEL without any share using it up.
//!
//! The scheduler's consumption rules are kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/incubating/consumable_capacity.go`
//! (`calculateConsumedCapacity`, `fillEmptyRequest`, `roundUpRange`, `violatesPolicy`).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceCapacity, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::limits::check_request_policy;
use super::names::{MAX_ATTRIBUTES_AND_CAPACITIES, attributes, capacities};
use crate::error::{Error, Result};
use crate::ownership::{Owner, OwnershipRecord};
use crate::quantity::{bytes_quantity, quantity_bytes};
use crate::shared_publication::{SharedPublication, SharedSlicing};

/// Capacity of a shareable GPU: compute in percent (100).
pub const COMPUTE: &str = "compute";
/// Capacity of a shareable GPU with `maxSlicesPerGpu`: the most shares it takes.
pub const SLICES: &str = "slices";
/// The `compute` capacity of a shareable GPU: percent of the whole.
const FULL_COMPUTE: u8 = 100;

/// Makes the devices that are the scheduler's in `record` and named in `publication`
/// shareable (`share_device`). A device that cannot be made shareable stays whole; its error
/// is returned so the caller can log it (a share publication must never cost the GPU).
pub fn publish_shared(
    specs: &mut [ResourceSliceSpec],
    record: &OwnershipRecord,
    publication: &SharedPublication,
) -> Vec<Error> {
    let mut errors = Vec::new();
    for device in specs
        .iter_mut()
        .flat_map(|s| s.devices.iter_mut().flatten())
    {
        let Some(slicing) = publication.get(&device.name) else {
            continue;
        };
        if record.owner(&device.name) != Some(Owner::Scheduler) {
            continue;
        }
        if let Err(e) = share_device(device, slicing) {
            errors.push(e);
        }
    }
    errors
}

/// Turns a published whole GPU into a shareable one with `slicing`; `device` is unchanged on
/// error.
///
/// # Errors
///
/// [`Error::InvalidResourceSlice`] when the device is not a whole GPU with `memory` and
/// `multiprocessors` capacities, when its memory is less than two granules (the API requires
/// `min + step ≤ value`), or when a capacity or the attribute count would break an API rule
/// ([`check_request_policy`]).
fn share_device(device: &mut Device, slicing: &SharedSlicing) -> Result<()> {
    let at = format!("devices[{:?}]", device.name);
    let is_gpu = device
        .attributes
        .as_ref()
        .and_then(|a| a.get(attributes::TYPE))
        .and_then(|t| t.string.as_deref())
        == Some(super::names::TYPE_GPU);
    if !is_gpu {
        return Err(Error::slice(
            at,
            "only a whole GPU can be published as shareable",
        ));
    }
    let capacity = device.capacity.as_ref();
    let value_of = |name: &str| {
        capacity
            .and_then(|c| c.get(name))
            .map(|c| c.value.clone())
            .ok_or_else(|| Error::slice(format!("{at}.capacity[{name:?}]"), "missing"))
    };
    let memory = value_of(capacities::MEMORY)?;
    let multiprocessors = value_of(capacities::MULTIPROCESSORS)?;
    let bytes = quantity_bytes(&memory).map_err(|e| {
        Error::slice(
            format!("{at}.capacity[{:?}]", capacities::MEMORY),
            e.to_string(),
        )
    })?;
    let shared = shared_capacities(bytes, multiprocessors, slicing)
        .map_err(|message| Error::slice(&at, message))?;
    for (name, capacity) in &shared {
        check_request_policy(&format!("{at}.capacity[{name:?}]"), true, capacity)?;
    }
    let attributes = device.attributes.as_ref();
    let allocator_pending = attributes.is_none_or(|a| !a.contains_key(attributes::ALLOCATOR));
    let total = attributes.map_or(0, BTreeMap::len) + shared.len() + usize::from(allocator_pending);
    if total > MAX_ATTRIBUTES_AND_CAPACITIES {
        return Err(Error::slice(
            at,
            format!(
                "{total} attributes and capacities when shareable; the API allows at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
            ),
        ));
    }
    device.allow_multiple_allocations = Some(true);
    device.capacity = Some(shared);
    Ok(())
}

/// The capacities of a shareable GPU with `bytes` of memory and `multiprocessors` SMs.
fn shared_capacities(
    bytes: u64,
    multiprocessors: Quantity,
    slicing: &SharedSlicing,
) -> std::result::Result<BTreeMap<String, DeviceCapacity>, String> {
    let granule = slicing.memory_granularity_bytes;
    if granule == 0 {
        return Err("memory granularity 0".to_owned());
    }
    let on_grid = bytes / granule * granule;
    if on_grid < granule.saturating_mul(2) {
        return Err(format!(
            "{} of memory holds fewer than two shares of the granularity {}",
            bytes_quantity(bytes).0,
            bytes_quantity(granule).0
        ));
    }
    let default_compute = slicing.default_compute_percent.unwrap_or(FULL_COMPUTE);
    let mut shared = BTreeMap::from([
        (
            capacities::MEMORY.to_owned(),
            range(
                bytes_quantity(bytes),
                bytes_quantity(on_grid),
                bytes_quantity(granule),
                bytes_quantity(on_grid),
                bytes_quantity(granule),
            ),
        ),
        (
            COMPUTE.to_owned(),
            range(
                number(FULL_COMPUTE),
                number(default_compute),
                number(1),
                number(FULL_COMPUTE),
                number(1),
            ),
        ),
        (
            capacities::MULTIPROCESSORS.to_owned(),
            only(multiprocessors, number(0u8)),
        ),
    ]);
    if let Some(max) = slicing.max_slices_per_gpu {
        shared.insert(SLICES.to_owned(), only(number(max), number(1u8)));
    }
    Ok(shared)
}

fn number(n: impl std::fmt::Display) -> Quantity {
    Quantity(n.to_string())
}

fn range(
    value: Quantity,
    default: Quantity,
    min: Quantity,
    max: Quantity,
    step: Quantity,
) -> DeviceCapacity {
    DeviceCapacity {
        value,
        request_policy: Some(CapacityRequestPolicy {
            default: Some(default),
            valid_range: Some(CapacityRequestPolicyRange {
                min,
                max: Some(max),
                step: Some(step),
            }),
            valid_values: None,
        }),
    }
}

/// A capacity every share takes exactly `each` of.
fn only(value: Quantity, each: Quantity) -> DeviceCapacity {
    DeviceCapacity {
        value,
        request_policy: Some(CapacityRequestPolicy {
            default: Some(each.clone()),
            valid_range: None,
            valid_values: Some(vec![each]),
        }),
    }
}
