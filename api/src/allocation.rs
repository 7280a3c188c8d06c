//! ResourceClaims as the controller's allocator sees them: what a claim asks for
//! ([`claim_request`]), what an allocated claim holds whoever allocated it ([`device_uses`]),
//! and the `status.allocation` the controller writes for a placement ([`allocation_status`]).

mod prioritized;
mod request;
mod status;
#[cfg(test)]
mod tests;
mod uses;

pub use prioritized::claim_allocation_status;
pub use request::{claim_request, core_selector};
pub use status::{allocation_status, node_selector};
pub use uses::device_uses;

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
