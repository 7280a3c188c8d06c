//! What an allocated claim holds, whoever allocated it ([`device_uses`]).

use k8s_openapi::api::resource::v1::{
    DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_core::alloc::{DeviceUse, UseKind};
use kerf_core::enforcement::Enforcement;
use kerf_core::sharing::Sharing;

use crate::params::{GpuSliceAllocation, OpaqueConfig, decode_opaque};
use crate::quantity;

use crate::claim::{CONSUMED_COMPUTE, CONSUMED_MEMORY};

/// What the devices of `claim`'s allocation hold, for the allocator's index: results of
/// `driver` only, whoever wrote them.
///
/// - A result that a `GpuSliceAllocation` entry of this driver names (kerf's controller) is a
///   slice of the entry's memory and compute, or the whole GPU when the entry sets neither.
/// - A result with `consumedCapacity` or a `shareID` (a consumable-capacity share, 1.36+) is
///   a slice of its consumed `memory` and `compute` (percent); missing ones count as zero. It
///   is shared as it is prepared: as the claim's configs say ([`crate::claim::resolve_allocation`]),
///   MPS when they name no sharing (the Node's shared publication, which may name another, is
///   not in the claim). Whether it took the whole GPU depends on the GPU's size, which the
///   published device knows: see kerf-controller's `capacity` module.
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
    let results = || {
        devices
            .results
            .iter()
            .flatten()
            .filter(|r| r.driver == driver && r.admin_access != Some(true))
    };
    let shares = if results().any(|r| r.share_id.is_some()) {
        share_sharing(claim, driver)
    } else {
        Vec::new()
    };
    results()
        .map(|result| {
            let (mut kind, enforcement) = use_kind(result, &slices, driver);
            if let (UseKind::Slice { sharing, .. }, Some(share)) = (&mut kind, &result.share_id)
                && *sharing == Sharing::Exclusive
            {
                *sharing = shares
                    .iter()
                    .find(|(device, id, _)| *device == result.device && id == share)
                    .map_or(Sharing::Mps, |(_, _, s)| *s);
            }
            DeviceUse {
                node: result.pool.clone(),
                device: result.device.clone(),
                kind,
                enforcement,
            }
        })
        .collect()
}

/// The sharing each scheduler share of `claim` is prepared with, by device and share ID, as
/// the claim's configs resolve it; nothing when they do not resolve (the caller's MPS then).
fn share_sharing(claim: &ResourceClaim, driver: &str) -> Vec<(String, String, Sharing)> {
    crate::claim::resolve_allocation(claim, driver)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|d| Some((d.device, d.share_id?, d.sharing)))
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

/// How the result holds its device, and the enforcement its kerf allocation entry requires
/// (the default for results kerf's controller did not write).
fn use_kind(
    result: &DeviceRequestAllocationResult,
    slices: &[GpuSliceAllocation],
    driver: &str,
) -> (UseKind, Enforcement) {
    let share = result.share_id.as_deref();
    if let Some(entry) = slices
        .iter()
        .find_map(|s| s.find(&result.pool, &result.device, share))
    {
        if entry.memory_bytes.is_none() && entry.compute_percent.is_none() {
            return (UseKind::Whole, entry.enforcement);
        }
        let kind = UseKind::Slice {
            memory_bytes: entry.memory_bytes.unwrap_or(0),
            compute_percent: entry.compute_percent.unwrap_or(0),
            sharing: entry.sharing,
        };
        return (kind, entry.enforcement);
    }
    (
        scheduler_use_kind(result, share, driver),
        Enforcement::default(),
    )
}

/// What a result kube-scheduler wrote holds: a share of its consumed capacity, or the whole
/// device.
fn scheduler_use_kind(
    result: &DeviceRequestAllocationResult,
    share: Option<&str>,
    driver: &str,
) -> UseKind {
    if result.consumed_capacity.is_none() && share.is_none() {
        return UseKind::Whole;
    }
    let consumed = |name: &str| -> Option<u64> {
        let map = result.consumed_capacity.as_ref();
        let value = map.and_then(|m| m.get(name).or_else(|| m.get(&format!("{driver}/{name}"))));
        value.map_or(Some(0), amount)
    };
    match (consumed(CONSUMED_MEMORY), consumed(CONSUMED_COMPUTE)) {
        // The strategy is not in the result; device_uses fills it in from the configs.
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
