//! [`MigControl`] over the emulated MIG instances of `kerf-fake-gpu-tools`
//! ([`kerf_fake_gpu_tools::mig::MockMig`]): mock mode, tests and `kerf demo`.
//!
//! The emulation answers as NVML does where kerf acts on the answer: an occupied placement is
//! `INSUFFICIENT_RESOURCES` (NVIDIA's DRA driver relies on exactly that,
//! kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/nvlib.go`
//! (`createMigDevice`)), an unknown instance `NOT_FOUND` (its `deleteMigDevice` treats that
//! as already gone), a GPU instance with compute instances left `IN_USE`. The state is a file
//! under the mock driver root, so a killed and restarted plugin finds its instances again, as
//! it would on a GPU.

use std::path::Path;

use kerf_core::inventory::MigPlacement;
use kerf_core::mig_reconcile::{LiveComputeInstance, LiveGpuInstance};
use kerf_fake_gpu_tools::mig::{self, MigError, MockMig};

use super::control::{CreatedCompute, MigControl, MigFailureKind, MigGpu};
use crate::{Error, Result};

/// The emulated instances of one mock driver root.
#[derive(Debug, Clone)]
pub(crate) struct MockMigControl {
    mig: MockMig,
}

impl MockMigControl {
    /// Opens (creating if need be) the emulated MIG state of the mock driver root `root`.
    ///
    /// # Errors
    /// [`Error::Mig`] when the state directory or its files cannot be created.
    pub(crate) fn open(root: &Path) -> Result<Self> {
        let mig = MockMig::open(root).map_err(|e| mig_error("open the mock MIG state", "-", &e))?;
        Ok(MockMigControl { mig })
    }
}

impl MigControl for MockMigControl {
    fn create_gpu_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_profile_id: u32,
        placement: MigPlacement,
    ) -> Result<u32> {
        let placement = mig::GpuInstancePlacement {
            start: placement.start,
            size: placement.size,
        };
        self.mig
            .create_gi(gpu.minor, gi_profile_id, placement)
            .map_err(|e| mig_error("create GPU instance", gpu.uuid, &e))
    }

    fn create_compute_instance(
        &self,
        gpu: MigGpu<'_>,
        gi_id: u32,
        ci_profile_id: u32,
    ) -> Result<CreatedCompute> {
        let (ci_id, uuid) = self
            .mig
            .create_ci(gpu.minor, gi_id, ci_profile_id)
            .map_err(|e| mig_error("create compute instance", gpu.uuid, &e))?;
        Ok(CreatedCompute { ci_id, uuid })
    }

    fn destroy_compute_instance(&self, gpu: MigGpu<'_>, gi_id: u32, ci_id: u32) -> Result<()> {
        self.mig
            .destroy_ci(gpu.minor, gi_id, ci_id)
            .map_err(|e| mig_error("destroy compute instance", gpu.uuid, &e))
    }

    fn destroy_gpu_instance(&self, gpu: MigGpu<'_>, gi_id: u32) -> Result<()> {
        self.mig
            .destroy_gi(gpu.minor, gi_id)
            .map_err(|e| mig_error("destroy GPU instance", gpu.uuid, &e))
    }

    fn gpu_instances(&self, gpu: MigGpu<'_>) -> Result<Vec<LiveGpuInstance>> {
        let listed = self
            .mig
            .list(gpu.minor)
            .map_err(|e| mig_error("list GPU instances", gpu.uuid, &e))?;
        Ok(listed
            .into_iter()
            .map(|gi| LiveGpuInstance {
                gi_id: gi.gi_id,
                gi_profile_id: gi.profile_id,
                placement: MigPlacement {
                    start: gi.placement.start,
                    size: gi.placement.size,
                },
                compute_instances: gi
                    .cis
                    .into_iter()
                    .map(|ci| LiveComputeInstance {
                        ci_id: ci.ci_id,
                        uuid: ci.uuid,
                    })
                    .collect(),
            })
            .collect())
    }
}

/// The emulation's error as NVML's would reach kerf.
fn mig_error(call: &'static str, gpu: &str, error: &MigError) -> Error {
    let kind = match error {
        MigError::NotFound(_) => MigFailureKind::NotFound,
        MigError::InsufficientResources(_) => MigFailureKind::InsufficientResources,
        MigError::InvalidArgument(_) => MigFailureKind::InvalidArgument,
        MigError::InUse(_) => MigFailureKind::InUse,
        MigError::Injected(_) | MigError::Io(_) => MigFailureKind::Other,
    };
    Error::Mig {
        call,
        gpu: gpu.to_owned(),
        kind,
        message: error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: MigGpu<'static> = MigGpu {
        minor: 0,
        uuid: "GPU-0",
    };

    fn kind(result: Result<impl std::fmt::Debug>) -> MigFailureKind {
        match result {
            Err(Error::Mig { kind, .. }) => kind,
            other => panic!("expected a MIG error, got {other:?}"),
        }
    }

    #[test]
    fn instances_are_created_listed_and_destroyed_with_nvml_failure_kinds() {
        let dir = tempfile::tempdir().unwrap();
        let control = MockMigControl::open(dir.path()).unwrap();
        let at = |start, size| MigPlacement { start, size };
        let gi = control.create_gpu_instance(GPU, 19, at(0, 1)).unwrap();
        assert_eq!(
            kind(control.create_gpu_instance(GPU, 9, at(0, 4))),
            MigFailureKind::InsufficientResources
        );
        assert_eq!(
            kind(control.create_gpu_instance(GPU, 19, at(8, 1))),
            MigFailureKind::InvalidArgument
        );
        let ci = control.create_compute_instance(GPU, gi, 0).unwrap();
        assert!(ci.uuid.starts_with("MIG-"), "{}", ci.uuid);
        let live = control.gpu_instances(GPU).unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!(
            (live[0].gi_id, live[0].gi_profile_id, live[0].placement),
            (gi, 19, at(0, 1))
        );
        assert_eq!(live[0].compute_instances[0].uuid, ci.uuid);
        assert_eq!(
            kind(control.destroy_gpu_instance(GPU, gi)),
            MigFailureKind::InUse
        );
        control.destroy_compute_instance(GPU, gi, ci.ci_id).unwrap();
        control.destroy_gpu_instance(GPU, gi).unwrap();
        assert_eq!(
            kind(control.destroy_gpu_instance(GPU, gi)),
            MigFailureKind::NotFound
        );
        assert!(control.gpu_instances(GPU).unwrap().is_empty());
    }

    #[test]
    fn an_injected_failure_is_other_and_names_the_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let control = MockMigControl::open(dir.path()).unwrap();
        mig::fail_next_mig(dir.path(), "driver busy").unwrap();
        let error = control
            .create_gpu_instance(GPU, 19, MigPlacement { start: 0, size: 1 })
            .unwrap_err();
        assert_eq!(error.reason(), "mig");
        assert!(
            error.to_string().contains("GPU-0") && error.to_string().contains("driver busy"),
            "{error}"
        );
    }
}
