//! GPU quota per namespace (GpuQuota, `kerf_api::gpuquota`): how the webhook and the recount
//! see kerf's classes (`classes.rs`), the size of a class's largest device (`device_size.rs`),
//! and the recount of `status.used` from the claims that exist ([`recount`], the arithmetic in
//! `usage.rs`, the status it writes in `status.rs`).

pub(crate) mod classes;
pub(crate) mod device_size;
mod metrics;
pub mod recount;
mod status;
mod usage;

use std::time::Duration;

pub(crate) use metrics::QuotaMetrics;

/// How the recount runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaSettings {
    /// How often every GpuQuota is recounted even without a change: the longest a quota stays
    /// wrong after a missed event.
    pub resync: Duration,
    /// How long an admitted charge counts before the claim reaches the controller's cache
    /// (`kerf_api::gpuquota::ADMITTED_GRACE`; shorter in tests).
    pub admitted_grace: Duration,
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            resync: Duration::from_secs(300),
            admitted_grace: kerf_api::gpuquota::ADMITTED_GRACE,
        }
    }
}
