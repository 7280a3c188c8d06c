//! [`MigControl`] over NVML, for GPU nodes: the raw calls of
//! `crate::discovery::nvml_raw::mig` on the GPU found by UUID.
//!
//! The steps are NVIDIA's (kubernetes-sigs/dra-driver-nvidia-gpu
//! `cmd/gpu-kubelet-plugin/nvlib.go`): `createMigDevice` creates the GPU instance with
//! `CreateGpuInstanceWithPlacement`, reads the compute-instance profile from the new GPU
//! instance (`GetComputeInstanceProfileInfo`, shared engines), creates the compute instance
//! and takes the MIG device's UUID from the compute instance's info; `deleteMigDevice` looks
//! the instances up by id and destroys the compute instance before the GPU instance. Unlike
//! NVIDIA's driver, kerf never switches MIG mode: a dynamic-MIG GPU is one already in MIG mode
//! (an A100 needs a reset to switch), and the caller decides what `NOT_FOUND` means (a
//! destroy treats it as done).

use kerf_core::inventory::MigPlacement;
use kerf_core::mig_reconcile::LiveGpuInstance;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlReturn_enum_NVML_ERROR_IN_USE, nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES,
    nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT, nvmlReturn_enum_NVML_ERROR_NOT_FOUND,
    nvmlReturn_t,
};

use super::control::{CreatedCompute, MigControl, MigFailureKind, MigGpu};
use crate::discovery::nvml_raw::mig::{self as raw, RawMigError};
use crate::{Error, Result};

/// Creates and destroys MIG instances through NVML.
pub(crate) struct NvmlMigControl {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlMigControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlMigControl").finish_non_exhaustive()
    }
}

impl NvmlMigControl {
    /// Loads and initialises NVML for MIG changes (NVML counts initialisations, so this and
    /// discovery's handle coexist).
    ///
    /// # Errors
    /// [`Error::Nvml`] when `libnvidia-ml.so` cannot be loaded or NVML does not initialise.
    pub(crate) fn new() -> Result<Self> {
        let nvml = Nvml::init().map_err(|e| Error::Nvml(format!("initialise: {e}")))?;
        Ok(NvmlMigControl { nvml })
    }

    fn device(&self, call: &'static str, gpu: MigGpu<'_>) -> Result<Device<'_>> {
        self.nvml
            .device_by_uuid(gpu.uuid)
            .map_err(|e| lookup_error(call, gpu, &e))
    }
}

impl MigControl for NvmlMigControl {
    fn create_gpu_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_profile_id: u32,
        placement: MigPlacement,
    ) -> Result<u32> {
        const CALL: &str = "create GPU instance";
        let device = self.device(CALL, gpu)?;
        raw::create_gpu_instance(&device, gi_profile_id, placement).map_err(|e| {
            mig_error(
                CALL,
                gpu,
                e,
                &format!(
                    "profile id {gi_profile_id} at slices {}..{}",
                    placement.start,
                    placement.start + placement.size
                ),
            )
        })
    }

    fn create_compute_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_id: u32,
        ci_profile_id: u32,
    ) -> Result<CreatedCompute> {
        const CALL: &str = "create compute instance";
        let device = self.device(CALL, gpu)?;
        let context = format!("GPU instance {gi_id}, compute profile {ci_profile_id}");
        let (ci_id, uuid) = raw::create_compute_instance(&device, gi_id, ci_profile_id)
            .map_err(|e| mig_error(CALL, gpu, e, &context))?;
        let uuid = uuid
            .or_else(|| raw::mig_uuid_by_ids(&device, gi_id, ci_id))
            .ok_or_else(|| Error::Mig {
                call: CALL,
                gpu: gpu.uuid.to_owned(),
                kind: MigFailureKind::Other,
                message: format!(
                    "compute instance {ci_id} of GPU instance {gi_id} was created, but NVML \
                     names no MIG device for it"
                ),
            })?;
        Ok(CreatedCompute { ci_id, uuid })
    }

    fn destroy_compute_instance(&self, gpu: MigGpu<'_>, gi_id: u32, ci_id: u32) -> Result<()> {
        const CALL: &str = "destroy compute instance";
        let device = self.device(CALL, gpu)?;
        raw::destroy_compute_instance(&device, gi_id, ci_id).map_err(|e| {
            mig_error(
                CALL,
                gpu,
                e,
                &format!("compute instance {ci_id} of GPU instance {gi_id}"),
            )
        })
    }

    fn destroy_gpu_instance(&self, gpu: MigGpu<'_>, gi_id: u32) -> Result<()> {
        const CALL: &str = "destroy GPU instance";
        let device = self.device(CALL, gpu)?;
        raw::destroy_gpu_instance(&device, gi_id)
            .map_err(|e| mig_error(CALL, gpu, e, &format!("GPU instance {gi_id}")))
    }

    fn gpu_instances(&self, gpu: MigGpu<'_>) -> Result<Vec<LiveGpuInstance>> {
        const CALL: &str = "list GPU instances";
        let device = self.device(CALL, gpu)?;
        raw::gpu_instances(&device).map_err(|e| mig_error(CALL, gpu, e, "all profiles"))
    }
}

/// How kerf acts on an NVML return code of a MIG call.
pub(crate) fn failure_kind(code: nvmlReturn_t) -> MigFailureKind {
    const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
    const INSUFFICIENT_RESOURCES: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
    const INVALID_ARGUMENT: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
    const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
    match code {
        NOT_FOUND => MigFailureKind::NotFound,
        INSUFFICIENT_RESOURCES => MigFailureKind::InsufficientResources,
        INVALID_ARGUMENT => MigFailureKind::InvalidArgument,
        IN_USE => MigFailureKind::InUse,
        _ => MigFailureKind::Other,
    }
}

/// [`Error::Mig`] for a refused NVML call: kerf's step, the GPU, the kind, and NVML's call,
/// words and code with what was asked.
fn mig_error(step: &'static str, gpu: MigGpu<'_>, error: RawMigError, asked: &str) -> Error {
    Error::Mig {
        call: step,
        gpu: gpu.uuid.to_owned(),
        kind: failure_kind(error.code),
        message: format!(
            "{}: {} (NVML return code {}; {asked}, GPU {})",
            error.call,
            NvmlError::from(error.code),
            error.code,
            gpu.minor
        ),
    }
}

/// [`Error::Mig`] for a GPU NVML cannot find by UUID: `NotFound` too, which a destroy must
/// not take for "the instance is gone", so the message says it is the GPU.
fn lookup_error(step: &'static str, gpu: MigGpu<'_>, error: &NvmlError) -> Error {
    Error::Mig {
        call: step,
        gpu: gpu.uuid.to_owned(),
        kind: MigFailureKind::Other,
        message: format!(
            "nvmlDeviceGetHandleByUUID: the GPU (minor {}) is not there: {error}",
            gpu.minor
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: MigGpu<'static> = MigGpu {
        minor: 3,
        uuid: "GPU-5b1e0f3a-7c2d-4e8b-9a61-3d0c2f4e8a17",
    };

    #[test]
    fn return_codes_map_to_the_kinds_kerf_acts_on() {
        assert_eq!(failure_kind(6), MigFailureKind::NotFound);
        assert_eq!(failure_kind(23), MigFailureKind::InsufficientResources);
        assert_eq!(failure_kind(2), MigFailureKind::InvalidArgument);
        assert_eq!(failure_kind(19), MigFailureKind::InUse);
        for other in [1, 3, 4, 13, 999] {
            assert_eq!(failure_kind(other), MigFailureKind::Other, "code {other}");
        }
    }

    #[test]
    fn errors_name_the_step_the_call_and_the_gpu() {
        let error = mig_error(
            "create GPU instance",
            GPU,
            RawMigError {
                call: "nvmlDeviceCreateGpuInstanceWithPlacement",
                code: 23,
            },
            "profile id 19 at slices 2..3",
        );
        let Error::Mig {
            call,
            gpu,
            kind,
            message,
        } = error
        else {
            panic!("expected Error::Mig");
        };
        assert_eq!(call, "create GPU instance");
        assert_eq!(gpu, GPU.uuid);
        assert_eq!(kind, MigFailureKind::InsufficientResources);
        assert!(
            message.starts_with("nvmlDeviceCreateGpuInstanceWithPlacement: "),
            "{message}"
        );
        assert!(message.contains("code 23"), "{message}");
        assert!(message.contains("slices 2..3"), "{message}");
        let lookup = lookup_error("destroy GPU instance", GPU, &NvmlError::NotFound);
        assert!(
            matches!(&lookup, Error::Mig { kind: MigFailureKind::Other, message, .. } if message.contains("minor 3")),
            "{lookup:?}"
        );
    }

    /// No NVIDIA driver here: construction fails with NVML's message, never panics.
    #[test]
    fn without_a_driver_new_fails_clearly() {
        match NvmlMigControl::new() {
            Ok(control) => assert!(format!("{control:?}").contains("NvmlMigControl")),
            Err(Error::Nvml(message)) => assert!(message.starts_with("initialise: "), "{message}"),
            Err(other) => panic!("expected Error::Nvml, got {other:?}"),
        }
    }
}
