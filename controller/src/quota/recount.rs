//! The recount of every GpuQuota's `status.used` from the claims that exist.
