//! GPU quota per namespace (GpuQuota, `kerf_api::gpuquota`): how the webhook and the recount
//! see kerf's classes (`classes.rs`), the size of a class's largest device (`device_size.rs`),
//! and the recount of `status.used` from the claims that exist ([`recount`], the arithmetic in
//! `usage.rs`, the status it writes in `status.rs`).

pub(crate) mod classes;
pub(crate) mod device_size;
pub mod recount;
mod status;
mod usage;

pub use crate::config::QuotaSettings;
