//! Start-up of dynamic MIG, before the sockets serve: the live MIG instances of the dynamic
//! GPUs are brought in line with the checkpoint ([`kerf_core::mig_reconcile`], NVIDIA's
//! `DestroyUnknownMIGDevices` rule: keep what completed claims use, destroy the rest).
//!
//! Claim entries whose MIG state cannot be trusted any more are dropped from the checkpoint:
//! `PrepareStarted` entries with an instance intent on a dynamic GPU (their prepare never
//! answered the kubelet, which retries it from the start) and completed entries whose instance
//! vanished (their next prepare creates it again). Their CDI specs are then removed as orphans
//! by the preparer's spec restore, which runs after this.

use std::collections::{BTreeMap, BTreeSet};

use kerf_core::checkpoint::ClaimState;
use kerf_core::inventory::Inventory;
use kerf_core::mig_reconcile::{self, LiveGpu, LiveMigState, MigAction};

use super::control::MigGpu;
use super::manager::DynamicMig;
use crate::checkpoint_store::CheckpointStore;
use crate::{Error, Result};

/// What [`DynamicMig::restore`] did.
#[derive(Debug, Default)]
pub(crate) struct MigRestore {
    /// Instances kept for completed claims.
    pub kept: usize,
    /// Compute instances destroyed.
    pub compute_destroyed: usize,
    /// GPU instances destroyed.
    pub gpu_destroyed: usize,
    /// Claim entries dropped (unfinished, or their instance vanished).
    pub claims_dropped: Vec<String>,
    /// What could not be listed or destroyed; the GPU's instances stay as they are.
    pub failures: Vec<Error>,
}

impl DynamicMig {
    /// Reconciles the dynamic GPUs of `inventory` with `checkpoint` (see the module docs);
    /// each action is logged at info. Nothing to do without dynamic GPUs.
    ///
    /// # Errors
    /// The checkpoint write that drops entries failed. Driver failures are reported in
    /// [`MigRestore::failures`]: the GPU they concern is left alone.
    pub async fn restore(
        &self,
        inventory: &Inventory,
        checkpoint: &CheckpointStore,
    ) -> Result<MigRestore> {
        let mut report = MigRestore::default();
        let dynamic: Vec<(u32, String)> = inventory
            .gpus
            .iter()
            .filter(|g| g.dynamic_mig)
            .map(|g| (g.minor, g.uuid.clone()))
            .collect();
        if dynamic.is_empty() {
            return Ok(report);
        }
        let uuids: BTreeMap<u32, String> = dynamic.iter().cloned().collect();
        let live = self.list_live(dynamic, &mut report).await;
        let records = checkpoint.read(mig_reconcile::recorded_instances);
        let actions = mig_reconcile::reconcile(&records, &live);
        let mut drop: BTreeSet<String> = records
            .iter()
            .filter(|r| {
                r.state == ClaimState::PrepareStarted
                    && live.gpus.contains_key(&r.instance.parent_minor)
            })
            .map(|r| r.claim_uid.clone())
            .collect();
        for action in actions {
            self.carry_out(action, &uuids, &mut report, &mut drop).await;
        }
        if !drop.is_empty() {
            checkpoint
                .update(|cp| {
                    for uid in &drop {
                        cp.claims.remove(uid);
                    }
                })
                .await?;
        }
        report.claims_dropped = drop.into_iter().collect();
        Ok(report)
    }

    async fn carry_out(
        &self,
        action: MigAction,
        uuids: &BTreeMap<u32, String>,
        report: &mut MigRestore,
        drop: &mut BTreeSet<String>,
    ) {
        let uuid = |minor: u32| uuids.get(&minor).cloned().unwrap_or_default();
        match action {
            MigAction::Keep {
                claim_uid,
                parent_minor,
                gi_id,
            } => {
                tracing::info!(claim.uid = %claim_uid, gpu = %uuid(parent_minor), gi_id, "start-up: keeping the MIG instance of a prepared claim");
                report.kept += 1;
            }
            MigAction::DestroyComputeInstance {
                parent_minor,
                gi_id,
                ci_id,
                reason,
            } => {
                let gpu = uuid(parent_minor);
                match self.destroy_ci(&gpu, parent_minor, gi_id, ci_id).await {
                    Ok(()) => {
                        tracing::info!(%gpu, gi_id, ci_id, reason = reason.as_str(), "start-up: destroyed a compute instance");
                        report.compute_destroyed += 1;
                    }
                    Err(error) => failed(report, &gpu, gi_id, error),
                }
            }
            MigAction::DestroyGpuInstance {
                parent_minor,
                gi_id,
                reason,
            } => {
                let gpu = uuid(parent_minor);
                match self.destroy(&gpu, parent_minor, gi_id, None).await {
                    Ok(()) => {
                        tracing::info!(%gpu, gi_id, reason = reason.as_str(), "start-up: destroyed a GPU instance");
                        report.gpu_destroyed += 1;
                    }
                    Err(error) => failed(report, &gpu, gi_id, error),
                }
            }
            MigAction::ForgetInstance {
                claim_uid,
                parent_minor,
                placement,
                reason,
            } => {
                tracing::info!(claim.uid = %claim_uid, gpu = %uuid(parent_minor), start = placement.start, size = placement.size, ?reason, "start-up: forgetting the claim's MIG instance; its next prepare creates one");
                drop.insert(claim_uid);
            }
        }
    }
}

impl DynamicMig {
    /// The GPU instances of each dynamic GPU (`(minor, uuid)`) as the driver lists them; a
    /// GPU that cannot be listed is left out (and left alone), its error in `report`.
    async fn list_live(
        &self,
        dynamic: Vec<(u32, String)>,
        report: &mut MigRestore,
    ) -> LiveMigState {
        let mut live = LiveMigState::default();
        for (minor, uuid) in dynamic {
            let gpu = uuid.clone();
            let listed = self
                .call("list_gpu_instances", move |c| {
                    c.gpu_instances(MigGpu { minor, uuid: &gpu })
                })
                .await;
            match listed {
                Ok(gpu_instances) => {
                    live.gpus.insert(
                        minor,
                        LiveGpu {
                            dynamic: true,
                            gpu_instances,
                        },
                    );
                }
                Err(error) => {
                    tracing::error!(gpu = %uuid, %error, "start-up: cannot list the GPU's MIG instances; leaving them alone");
                    report.failures.push(error);
                }
            }
        }
        live
    }

    /// Destroys compute instance `ci_id` of GPU instance `gi_id` on GPU `gpu` (`minor`).
    async fn destroy_ci(&self, gpu: &str, minor: u32, gi_id: u32, ci_id: u32) -> Result<()> {
        let owned = gpu.to_owned();
        self.call("destroy_compute_instance", move |c| {
            c.destroy_compute_instance(
                MigGpu {
                    minor,
                    uuid: &owned,
                },
                gi_id,
                ci_id,
            )
        })
        .await
    }
}

fn failed(report: &mut MigRestore, gpu: &str, gi_id: u32, error: Error) {
    tracing::error!(%gpu, gi_id, %error, "start-up: cannot destroy a MIG instance");
    report.failures.push(error);
}
