//! ResourceClaims as the controller's allocator sees them: what a claim asks for
//! ([`claim_request`]), what an allocated claim holds whoever allocated it ([`device_uses`]),
//! and the `status.allocation` the controller writes for a placement ([`allocation_status`]).

mod prioritized;
mod request;
mod status;
#[cfg(test)]
mod tests;
mod uses;

pub(crate) use prioritized::as_exact as as_exact_request;
pub use prioritized::claim_allocation_status;
pub use request::claim_request;
pub use status::{allocation_status, node_selector};
pub use uses::device_uses;
