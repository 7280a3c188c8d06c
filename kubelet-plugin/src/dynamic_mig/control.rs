//! The seam between kerf and the driver for MIG instances on dynamic-MIG GPUs.
//!
//! The calls are NVML's (`nvmlDeviceCreateGpuInstanceWithPlacement`,
//! `nvmlGpuInstanceCreateComputeInstance`, `nvmlComputeInstanceDestroy`,
//! `nvmlGpuInstanceDestroy`, `nvmlDeviceGetGpuInstances`), which NVIDIA's DRA driver makes in
//! the same order (kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/nvlib.go`
//! (`createMigDevice`, `deleteMigDevice`)). Every call blocks; callers run them on a blocking
//! thread.

use kerf_core::inventory::MigPlacement;
use kerf_core::mig_reconcile::LiveGpuInstance;

use crate::Result;
pub use crate::error::MigFailureKind;

/// The GPU a MIG call is about: NVML finds it by UUID, the mock by minor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MigGpu<'a> {
    /// The GPU's minor number.
    pub minor: u32,
    /// The GPU's UUID (`GPU-…`).
    pub uuid: &'a str,
}

/// A compute instance that was just created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CreatedCompute {
    /// Compute instance id.
    pub ci_id: u32,
    /// UUID of the MIG device it makes (`MIG-…`).
    pub uuid: String,
}

/// Creates, destroys and lists the MIG instances of dynamic-MIG GPUs.
///
/// Implementations: NVML (a GPU node) and the mock over `kerf-fake-gpu-tools`' emulated
/// instances (mock mode, tests, `kerf demo`). Each call blocks.
pub(crate) trait MigControl: Send + Sync + 'static {
    /// Creates a GPU instance of `gi_profile_id` at `placement`; returns its id.
    ///
    /// # Errors
    /// [`crate::Error::Mig`]: [`MigFailureKind::InsufficientResources`] when the placement is
    /// taken, [`MigFailureKind::InvalidArgument`] for a profile or placement the GPU lacks,
    /// [`MigFailureKind::Other`] for anything else.
    fn create_gpu_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_profile_id: u32,
        placement: MigPlacement,
    ) -> Result<u32>;

    /// Creates a compute instance of `ci_profile_id` in GPU instance `gi_id`.
    ///
    /// # Errors
    /// [`crate::Error::Mig`]: [`MigFailureKind::NotFound`] when the GPU instance is gone,
    /// other kinds as the driver reports them.
    fn create_compute_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_id: u32,
        ci_profile_id: u32,
    ) -> Result<CreatedCompute>;

    /// Destroys compute instance `ci_id` of GPU instance `gi_id`.
    ///
    /// # Errors
    /// [`crate::Error::Mig`]: [`MigFailureKind::NotFound`] when it does not exist (callers
    /// treat that as done), [`MigFailureKind::InUse`] while a process uses it.
    fn destroy_compute_instance(&self, gpu: MigGpu<'_>, gi_id: u32, ci_id: u32) -> Result<()>;

    /// Destroys GPU instance `gi_id`, which must have no compute instance left.
    ///
    /// # Errors
    /// [`crate::Error::Mig`]: [`MigFailureKind::NotFound`] when it does not exist (callers
    /// treat that as done), [`MigFailureKind::InUse`] while it has compute instances.
    fn destroy_gpu_instance(&self, gpu: MigGpu<'_>, gi_id: u32) -> Result<()>;

    /// The GPU instances that exist on the GPU, with their compute instances.
    ///
    /// # Errors
    /// [`crate::Error::Mig`] when the driver cannot list them.
    fn gpu_instances(&self, gpu: MigGpu<'_>) -> Result<Vec<LiveGpuInstance>>;
}
