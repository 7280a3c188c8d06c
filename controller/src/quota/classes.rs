//! How a GpuQuota sees each of kerf's classes (`kerf_api::gpuquota::QuotaClass`).
