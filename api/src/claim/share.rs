//! Scheduler slices: a result of this driver that kube-scheduler allocated as one share of a
//! shareable GPU (`shareID` and `consumedCapacity`, `DRAConsumableCapacity`) becomes a slice
//! with the consumed `memory` and `compute` as its limits, prepared exactly as a controller
//! slice of that size (same [`kerf_core::sharing::SliceLimits`] and
//! [`kerf_core::sharing::Sharing`], so the same CDI edits).
//!
//! The scheduler writes every capacity of the device into `consumedCapacity`, zero included
//! (kubernetes/api `resource/v1/types.go` `DeviceRequestAllocationResult.ConsumedCapacity`;
//! kubernetes/kubernetes `structured/internal/incubating/allocator_incubating.go
//! (allocateDevice)` with `GetConsumedCapacityFromRequest`), so `memory` is always there for a
//! GPU kerf published shareable ([`crate::resourceslice::scheduler_slices`]).
//!
//! Two steps, because the GPU's size is known only on the node: [`consumed`] reads the result
//! when the claim is resolved; [`super::AllocatedDevice::finish_share`] then compares it with the GPU
//! and the Node's shared publication.

use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::error::{Error, Result};
use crate::quantity::quantity_bytes;

/// `consumedCapacity` key of the memory a share took, in bytes.
pub(crate) const CONSUMED_MEMORY: &str = "memory";
/// `consumedCapacity` key of the compute a share took, in percent.
pub(crate) const CONSUMED_COMPUTE: &str = "compute";

/// What a scheduler share consumed, kept until the GPU it is on is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareConsumption {
    /// `namespace/name` of the claim, for messages.
    pub claim: String,
    /// `consumedCapacity.memory` in bytes.
    pub memory_bytes: u64,
    /// The memory quantity as written.
    pub memory_text: String,
    /// Path of `consumedCapacity.memory`, for messages.
    pub memory_path: String,
    /// The class's memory granularity when a class config names one.
    pub granularity: Option<u64>,
    /// Whether a config of the claim named the sharing; if not, the Node's shared publication
    /// gives it.
    pub sharing_configured: bool,
}

/// Reads a share's consumption from result `index` of `claim`; `None` for a result that is
/// not a share (no `shareID` and no `consumedCapacity`).
///
/// # Errors
///
/// [`Error::InvalidAllocation`] at
/// `status.allocation.devices.results[<index>].consumedCapacity.memory` (or `.compute`) when
/// memory is missing, zero or not a quantity of bytes, or compute is not a whole number 0–100.
pub(super) fn consumed(
    claim: &str,
    index: usize,
    result: &DeviceRequestAllocationResult,
) -> Result<Option<(ShareConsumption, Option<u8>)>> {
    if result.share_id.is_none() && result.consumed_capacity.is_none() {
        return Ok(None);
    }
    let base = format!("status.allocation.devices.results[{index}].consumedCapacity");
    let bad = |path: String, message: String| Error::InvalidAllocation {
        claim: claim.to_owned(),
        path,
        message,
    };
    let lookup = |name: &str| -> Option<&Quantity> {
        let map = result.consumed_capacity.as_ref()?;
        map.get(name)
            .or_else(|| map.get(&format!("{}/{name}", result.driver)))
    };
    let memory_path = format!("{base}.{CONSUMED_MEMORY}");
    let memory = lookup(CONSUMED_MEMORY).ok_or_else(|| {
        bad(
            memory_path.clone(),
            "missing: a share of a GPU must say how much memory it consumed".to_owned(),
        )
    })?;
    let memory_bytes =
        quantity_bytes(memory).map_err(|e| bad(memory_path.clone(), e.to_string()))?;
    let compute = match lookup(CONSUMED_COMPUTE) {
        None => None,
        Some(q) => {
            let path = format!("{base}.{CONSUMED_COMPUTE}");
            let percent = percent(q).ok_or_else(|| {
                bad(
                    path,
                    format!("{:?} is not a whole percent from 0 to 100", q.0),
                )
            })?;
            // 0 (a device published without a compute policy) and 100 both mean "no limit".
            Some(percent).filter(|p| (1..100).contains(p))
        }
    };
    Ok(Some((
        ShareConsumption {
            claim: claim.to_owned(),
            memory_bytes,
            memory_text: memory.0.clone(),
            memory_path,
            granularity: None,
            sharing_configured: false,
        },
        compute,
    )))
}

fn percent(quantity: &Quantity) -> Option<u8> {
    let text = quantity.0.trim_start_matches('+');
    if !text.is_empty() && text.bytes().all(|b| b == b'0') {
        return Some(0);
    }
    let value = quantity_bytes(quantity).ok()?;
    u8::try_from(value).ok().filter(|v| *v <= 100)
}

#[cfg(test)]
mod tests;
