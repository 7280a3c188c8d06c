//! The limits each GPU's MPS server holds its clients to: the largest MPS slice prepared on
//! the GPU ([`ServerLimits::for_slices`]), given to the daemon before the prepare that changes
//! them returns (so before the slice's container starts its CUDA client), and given again to
//! a daemon that replaced the one that had them (a daemon forgets them when it quits).
//!
//! A raised limit reaches only clients created afterwards (NVIDIA's MPS documentation for
//! `set_active_thread_percentage <PID>`); clients created under a lower one keep it, which
//! holds them tighter, never looser, than their slice. A lowered one (the largest slice left)
//! likewise reaches the clients created afterwards.

use std::collections::BTreeMap;

use kerf_core::checkpoint::{Checkpoint, DeviceRecord};
use kerf_core::enforcement::{self, Holders, ServerLimits};
use kerf_core::inventory::Inventory;

use super::mps_gpu;
use crate::Result;
use crate::checkpoint_store::CheckpointStore;
use crate::mps_daemons::ControlDaemons;

/// A memory limit that stands for "none" on a GPU the inventory does not know: more than any
/// GPU has.
const UNKNOWN_GPU_MIB: u64 = 1 << 20;

/// Gives GPUs' MPS servers their limits; what each was given is in the checkpoint
/// (`GpuSharingEntry::mps_server_limits`, cleared with the daemon that had them).
#[derive(Debug, Default)]
pub(super) struct ServerLimitBook {
    /// Memory of each GPU, MiB, by UUID: the limit that stands for "none".
    total_mib: BTreeMap<String, u64>,
}

impl ServerLimitBook {
    pub(super) fn of_inventory(inventory: &Inventory) -> Self {
        ServerLimitBook {
            total_mib: inventory
                .gpus
                .iter()
                .map(|gpu| (gpu.uuid.clone(), gpu.memory_bytes >> 20))
                .collect(),
        }
    }

    /// Gives `gpu`'s daemon the limits of the MPS slices the checkpoint has on it, unless the
    /// checkpoint says it has them. The caller holds the GPU's lock.
    ///
    /// # Errors
    /// [`crate::Error::Mps`] when the daemon does not take them.
    pub(super) async fn hold(
        &self,
        tools: &ControlDaemons,
        gpu: &str,
        checkpoint: &CheckpointStore,
    ) -> Result<()> {
        let (wanted, recorded) = checkpoint.read(|cp| {
            let recorded = cp.gpu_sharing.get(gpu).and_then(|e| e.mps_server_limits);
            (ServerLimits::for_slices(mps_slices(cp, gpu)), recorded)
        });
        if recorded != Some(wanted) {
            let total = self.total_mib.get(gpu).copied().unwrap_or(UNKNOWN_GPU_MIB);
            tools.apply_server_limits(gpu, wanted, total).await?;
            tracing::info!(gpu, ?wanted, "MPS server limits given");
            checkpoint.mutate_lazily(|cp| {
                cp.gpu_sharing
                    .entry(gpu.to_owned())
                    .or_default()
                    .mps_server_limits = Some(wanted);
            });
        }
        Ok(())
    }
}

/// The limits of the MPS slices the checkpoint has on `gpu`.
fn mps_slices<'a>(
    cp: &'a Checkpoint,
    gpu: &'a str,
) -> impl Iterator<Item = kerf_core::sharing::SliceLimits> + 'a {
    cp.claims
        .values()
        .flat_map(|entry| &entry.devices)
        .filter(move |device| mps_gpu(device) == Some(gpu))
        .map(|device| device.limits)
}

/// Who holds `device`'s limits: its GPU's server limits as the checkpoint records them given
/// when a daemon serves it, nothing but accounting when `enforced` is false (no GPU tools).
pub(super) fn holders_of(cp: &Checkpoint, device: &DeviceRecord, enforced: bool) -> Holders {
    let server = (enforced && mps_gpu(device).is_some()).then(|| {
        cp.gpu_sharing
            .get(&device.uuid)
            .and_then(|entry| entry.mps_server_limits)
            .unwrap_or_default()
    });
    enforcement::holders(device.sharing, device.mig.is_some(), device.limits, server)
}
