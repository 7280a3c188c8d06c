//! GPU quota per namespace (GpuQuota, `kerf_api::gpuquota`): how the webhook and the recount
//! see kerf's classes ([`classes`]), and the recount of `status.used` from the claims that
//! exist ([`recount`]).

pub(crate) mod classes;
pub(crate) mod recount;
