//! [`DynamicMig`]: the MIG instance behind a dynamic-MIG placement device, created at the
//! prepare of a claim that was allocated it and destroyed at its unprepare.
//!
//! The order follows NVIDIA's DRA driver, which writes its claim's `PrepareStarted` checkpoint
//! entry before it creates anything, and `PrepareCompleted` after the CDI spec
//! (kubernetes-sigs/dra-driver-nvidia-gpu `cmd/gpu-kubelet-plugin/device_state.go`
//! (`DeviceState.Prepare`)), and creates and destroys as `nvlib.go` (`createMigDevice`,
//! `deleteMigDevice`) does:
//! 1. the claim's entry with each placement's [`MigInstanceRecord`] intent (ids `None`) is
//!    written — a plugin crash after this point leaves a record that start-up
//!    ([`DynamicMig::restore`]) finds, by placement, whatever instance exists;
//! 2. the GPU instance is created at the placement. `INSUFFICIENT_RESOURCES` means the
//!    placement is taken: by the instance this claim's own earlier attempt created (its intent
//!    recorded the id; adopted), by another prepared claim (a per-claim error naming it), or by
//!    an instance kerf does not know (an error naming the device and the driver's words);
//! 3. the compute instance is created in it;
//! 4. the capability minors come from the driver's `mig-minors` table, the `nvidia-caps`
//!    major from `/proc/devices`;
//! 5. the record gets the ids, the MIG UUID and the capability minors, written; the preparer
//!    then writes the CDI spec (the MIG UUID is the device's UUID) and completes the entry.
//!
//! Unprepare destroys the compute instance, then the GPU instance (`NOT_FOUND` is done; `IN_USE`
//! fails the unprepare and the entry stays, so the kubelet retries). Every driver call runs on a
//! blocking thread; creates and destroys on one GPU serialise on a per-GPU lock.

use std::sync::Arc;

use kerf_core::cdi::MigCaps;
use kerf_core::checkpoint::{ClaimEntry, DeviceRecord, MigInstanceRecord, RecordedPlacement};
use kerf_core::inventory::{DynamicPlacement, MigPlacement};
use kerf_core::mig_catalog;
use kerf_core::mig_reconcile::LiveGpuInstance;

use super::control::{CreatedCompute, MigControl, MigFailureKind, MigGpu};
use super::metrics::MigMetrics;
use crate::checkpoint_store::CheckpointStore;
use crate::claim_locks::ClaimLocks;
use crate::crash::{CrashStep, crash_point};
use crate::discovery::facts::HostPaths;
use crate::prepare_error::PrepareError;
use crate::{Error, Result};

/// Where MIG instances come from on this node.
enum Backend {
    /// The driver (NVML) or the mock's emulation.
    Control(Arc<dyn MigControl>),
    /// No MIG control: a prepare of a placement device fails with this reason.
    Unavailable(String),
}

/// Creates and destroys the MIG instances of dynamic-MIG placement devices (see the module
/// docs).
pub(crate) struct DynamicMig {
    backend: Backend,
    host: HostPaths,
    gpu_locks: ClaimLocks,
    metrics: MigMetrics,
    crash_at: Option<CrashStep>,
}

/// One instance a set-up created (or adopted), for its rollback.
struct Created {
    gpu_uuid: String,
    minor: u32,
    gi_id: u32,
    ci_id: Option<u32>,
}

impl DynamicMig {
    /// Dynamic MIG through `control`, reading the driver's `/proc` files under `host.proc`.
    pub fn new(control: Arc<dyn MigControl>, host: HostPaths, metrics: MigMetrics) -> Self {
        DynamicMig {
            backend: Backend::Control(control),
            host,
            gpu_locks: ClaimLocks::default(),
            metrics,
            crash_at: None,
        }
    }

    /// No MIG control on this node: placement devices cannot be prepared, for `reason`.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        DynamicMig {
            backend: Backend::Unavailable(reason.into()),
            host: HostPaths::default(),
            gpu_locks: ClaimLocks::default(),
            metrics: MigMetrics::default(),
            crash_at: None,
        }
    }

    /// Aborts the process right after `step` of every MIG prepare (mock-mode crash tests).
    #[must_use]
    pub(crate) fn with_crash_at(mut self, step: Option<CrashStep>) -> Self {
        self.crash_at = step;
        self
    }

    /// Aborts the process when `step` is the one asked for ([`DynamicMig::with_crash_at`]).
    pub(crate) fn crash_point(&self, step: CrashStep) {
        crash_point(self.crash_at, step);
    }

    pub(super) fn control(&self) -> Result<Arc<dyn MigControl>> {
        match &self.backend {
            Backend::Control(control) => Ok(Arc::clone(control)),
            Backend::Unavailable(reason) => Err(Error::Config(reason.clone())),
        }
    }

    /// Runs one driver call on a blocking thread and counts it as `op`.
    pub(super) async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&dyn MigControl) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let control = self.control()?;
        let result = tokio::task::spawn_blocking(move || f(control.as_ref()))
            .await
            .map_err(|e| Error::internal("a MIG driver call", e))
            .and_then(|r| r);
        self.metrics.record(op, &result);
        result
    }

    /// Creates the MIG instance of every placement device of `devices` (records with a
    /// [`MigInstanceRecord`] intent) for claim `claim_uid`, whose entry `record_started` put
    /// in `checkpoint`: writes that entry first, then creates, then records the
    /// instances and completes `devices` (MIG UUID, capability minors) for the CDI
    /// spec. A claim without placement devices costs nothing.
    ///
    /// # Errors
    /// The checkpoint write failed, a driver call failed ([`Error::Mig`]), the placement is
    /// held by another claim ([`PrepareError::DeviceHeld`]), or there is no MIG control
    /// ([`Error::Config`]). Whatever this call created is destroyed again before it returns.
    pub(crate) async fn set_up(
        &self,
        claim_uid: &str,
        devices: &mut [DeviceRecord],
        checkpoint: &CheckpointStore,
    ) -> Result<()> {
        if !devices.iter().any(|d| d.mig_instance.is_some()) {
            return Ok(());
        }
        self.control()?;
        // The intent must be on disk before the driver changes: a crash after the create
        // then leaves a record that start-up matches against the live instances.
        checkpoint.update(|_| ()).await?;
        let mut created = Vec::new();
        let result = self
            .create_all(claim_uid, devices, checkpoint, &mut created)
            .await;
        if let Err(error) = result {
            self.roll_back(&created).await;
            return Err(error);
        }
        let recorded = checkpoint
            .update(|cp| {
                if let Some(entry) = cp.claims.get_mut(claim_uid) {
                    for held in &mut entry.devices {
                        if let Some(done) =
                            devices.iter().find(|d| d.device_name == held.device_name)
                        {
                            held.clone_from(done);
                        }
                    }
                }
            })
            .await;
        if let Err(error) = recorded {
            self.roll_back(&created).await;
            return Err(error);
        }
        self.crash_point(CrashStep::AfterRecord);
        Ok(())
    }

    async fn create_all(
        &self,
        claim_uid: &str,
        devices: &mut [DeviceRecord],
        checkpoint: &CheckpointStore,
        created: &mut Vec<Created>,
    ) -> Result<()> {
        for device in devices.iter_mut().filter(|d| d.mig_instance.is_some()) {
            self.create_one(claim_uid, device, checkpoint, created)
                .await?;
        }
        Ok(())
    }

    /// Steps 2–4 of the module docs for one device.
    async fn create_one(
        &self,
        claim_uid: &str,
        device: &mut DeviceRecord,
        checkpoint: &CheckpointStore,
        created: &mut Vec<Created>,
    ) -> Result<()> {
        let Some(intent) = device.mig_instance.clone() else {
            return Ok(());
        };
        let (uuid, minor) = (intent.parent_uuid.clone(), intent.parent_minor);
        let _gpu = self.gpu_locks.lock(&uuid).await;
        let placement = MigPlacement::from(intent.placement);
        let gi_profile = intent.gi_profile_id;
        let gpu = uuid.clone();
        let first = self
            .call("create_gpu_instance", move |c| {
                c.create_gpu_instance(MigGpu { minor, uuid: &gpu }, gi_profile, placement)
            })
            .await;
        let (gi_id, adopted_ci) = match first {
            Ok(gi_id) => (gi_id, None),
            Err(Error::Mig {
                kind: MigFailureKind::InsufficientResources,
                message,
                ..
            }) => {
                self.adopt_or_refuse(claim_uid, device, &intent, checkpoint, message)
                    .await?
            }
            Err(other) => return Err(other),
        };
        created.push(Created {
            gpu_uuid: uuid.clone(),
            minor,
            gi_id,
            ci_id: None,
        });
        self.crash_point(CrashStep::AfterGiCreate);
        let compute = if let Some(compute) = adopted_ci {
            compute
        } else {
            let (gpu, ci_profile) = (uuid.clone(), intent.ci_profile_id);
            self.call("create_compute_instance", move |c| {
                c.create_compute_instance(MigGpu { minor, uuid: &gpu }, gi_id, ci_profile)
            })
            .await?
        };
        if let Some(last) = created.last_mut() {
            last.ci_id = Some(compute.ci_id);
        }
        self.crash_point(CrashStep::AfterCiCreate);
        let caps = self
            .capability_minors(&uuid, minor, gi_id, compute.ci_id)
            .await?;
        complete_record(device, gi_id, compute, caps);
        Ok(())
    }

    /// The placement is taken: adopts the instance this claim's earlier attempt recorded, or
    /// says who holds the placement.
    async fn adopt_or_refuse(
        &self,
        claim_uid: &str,
        device: &DeviceRecord,
        intent: &MigInstanceRecord,
        checkpoint: &CheckpointStore,
        message: String,
    ) -> Result<(u32, Option<CreatedCompute>)> {
        let (gpu, minor) = (intent.parent_uuid.clone(), intent.parent_minor);
        let live = self
            .call("list_gpu_instances", move |c| {
                c.gpu_instances(MigGpu { minor, uuid: &gpu })
            })
            .await?;
        if let Some(adopted) = adoptable(intent, &live) {
            tracing::info!(claim.uid = claim_uid, device = %device.device_name, gi_id = adopted.0, "adopting the MIG instance an earlier attempt of this claim created");
            return Ok(adopted);
        }
        let placement = MigPlacement::from(intent.placement);
        let holder = checkpoint.read(|cp| {
            cp.claims
                .iter()
                .filter(|(uid, _)| uid.as_str() != claim_uid)
                .find(|(_, entry)| holds(entry, minor, placement))
                .map(|(uid, entry)| (uid.clone(), entry.namespace.clone(), entry.name.clone()))
        });
        if let Some((holder_uid, holder_namespace, holder_name)) = holder {
            return Err(PrepareError::DeviceHeld {
                device: device.device_name.clone(),
                holder_uid,
                holder_namespace,
                holder_name,
            }
            .into());
        }
        Err(Error::Mig {
            call: "create GPU instance",
            gpu: intent.parent_uuid.clone(),
            kind: MigFailureKind::InsufficientResources,
            message: format!(
                "device {}: placement {}:{} is taken by a MIG instance no claim prepared on this node holds ({message})",
                device.device_name, placement.start, placement.size
            ),
        })
    }

    /// Reads the capability minors of `gi_id`/`ci_id` on GPU `minor` and the `nvidia-caps`
    /// major.
    async fn capability_minors(
        &self,
        uuid: &str,
        minor: u32,
        gi_id: u32,
        ci_id: u32,
    ) -> Result<MigCaps> {
        let host = self.host.clone();
        let (minors, major) =
            tokio::task::spawn_blocking(move || (host.mig_minors(), host.nvidia_caps_major()))
                .await
                .map_err(|e| Error::internal("the MIG capability reader", e))?;
        let (gi_cap_minor, ci_cap_minor) =
            minors
                .lookup(minor, gi_id, ci_id)
                .ok_or_else(|| Error::Mig {
                    call: "read capability minors",
                    gpu: uuid.to_owned(),
                    kind: MigFailureKind::Other,
                    message: format!(
                        "no gpu{minor}/gi{gi_id}/ci{ci_id} in {}",
                        self.host
                            .proc
                            .join("driver/nvidia-caps/mig-minors")
                            .display()
                    ),
                })?;
        Ok(MigCaps {
            gi_cap_minor,
            ci_cap_minor,
            caps_major: major,
        })
    }

    /// Destroys what a failed set-up created, newest first; failures are logged (start-up
    /// destroys what is left, as nothing records it as prepared).
    async fn roll_back(&self, created: &[Created]) {
        for instance in created.iter().rev() {
            if let Err(error) = self
                .destroy(
                    &instance.gpu_uuid,
                    instance.minor,
                    instance.gi_id,
                    instance.ci_id,
                )
                .await
            {
                tracing::error!(gpu = %instance.gpu_uuid, gi_id = instance.gi_id, %error, "rollback: destroying a MIG instance failed");
            }
        }
    }

    /// Destroys the MIG instances of a claim's `devices` (unprepare): compute instance, then
    /// GPU instance; `NOT_FOUND` counts as destroyed.
    ///
    /// # Errors
    /// The first instance that could not be destroyed ([`Error::Mig`], e.g. `IN_USE` while a
    /// process runs on it) or no MIG control; the caller keeps the claim so that the
    /// kubelet's retry destroys it later.
    pub async fn release(&self, devices: &[DeviceRecord]) -> Result<()> {
        for device in devices {
            let Some(instance) = &device.mig_instance else {
                continue;
            };
            let Some(gi_id) = instance.gi_id else {
                continue;
            };
            let _gpu = self.gpu_locks.lock(&instance.parent_uuid).await;
            self.destroy(
                &instance.parent_uuid,
                instance.parent_minor,
                gi_id,
                instance.ci_id,
            )
            .await?;
            tracing::info!(device = %device.device_name, gpu = %instance.parent_uuid, gi_id, "destroyed the MIG instance of an unprepared claim");
        }
        Ok(())
    }

    /// Destroys compute instance `ci_id` (if any) and GPU instance `gi_id`.
    pub(super) async fn destroy(
        &self,
        uuid: &str,
        minor: u32,
        gi_id: u32,
        ci_id: Option<u32>,
    ) -> Result<()> {
        if let Some(ci_id) = ci_id {
            let gpu = uuid.to_owned();
            let destroyed = self
                .call("destroy_compute_instance", move |c| {
                    c.destroy_compute_instance(MigGpu { minor, uuid: &gpu }, gi_id, ci_id)
                })
                .await;
            gone_is_done(destroyed)?;
        }
        let gpu = uuid.to_owned();
        let destroyed = self
            .call("destroy_gpu_instance", move |c| {
                c.destroy_gpu_instance(MigGpu { minor, uuid: &gpu }, gi_id)
            })
            .await;
        gone_is_done(destroyed)
    }
}

/// `NOT_FOUND` from a destroy: the instance is gone, which is what the destroy wanted.
fn gone_is_done(result: Result<()>) -> Result<()> {
    match result {
        Err(Error::Mig {
            kind: MigFailureKind::NotFound,
            ..
        }) => Ok(()),
        other => other,
    }
}

/// The record of a placement device before its instance exists: the parent GPU's record
/// (`record`, made by the preparer from the parent as a whole GPU) with the intent added.
/// Until the instance is created the UUID stays the parent's; the capability minors are
/// placeholders so that the record counts as a MIG device (no MPS, no time slice).
pub(crate) fn mark_intent(record: &mut DeviceRecord, placement: &DynamicPlacement<'_>) {
    record.mig = Some(MigCaps::default());
    record.mig_instance = Some(MigInstanceRecord {
        parent_uuid: placement.gpu.uuid.clone(),
        parent_minor: placement.gpu.minor,
        profile: placement.profile.name.clone(),
        gi_profile_id: placement.profile.gi_profile_id,
        ci_profile_id: placement.profile.ci_profile_id,
        placement: RecordedPlacement {
            start: placement.placement.start,
            size: placement.placement.size,
        },
        gi_id: None,
        ci_id: None,
        mig_uuid: None,
    });
}

/// Carries the instance ids an earlier, unfinished attempt of the same claim recorded for the
/// same device and placement into the new intent, so that [`DynamicMig::set_up`] can adopt
/// that instance instead of finding its placement taken.
pub(crate) fn carry_over(previous: Option<&ClaimEntry>, devices: &mut [DeviceRecord]) {
    let Some(previous) = previous else {
        return;
    };
    for device in devices {
        let Some(intent) = device.mig_instance.as_mut() else {
            continue;
        };
        let earlier = previous
            .devices
            .iter()
            .filter(|d| d.device_name == device.device_name)
            .find_map(|d| d.mig_instance.as_ref())
            .filter(|e| e.parent_minor == intent.parent_minor && e.placement == intent.placement);
        if let Some(earlier) = earlier {
            intent.gi_id = earlier.gi_id;
            intent.ci_id = earlier.ci_id;
            intent.mig_uuid.clone_from(&earlier.mig_uuid);
        }
    }
}

/// The live instance the intent's recorded ids name at its placement, with its compute
/// instance when that is recorded too.
fn adoptable(
    intent: &MigInstanceRecord,
    live: &[LiveGpuInstance],
) -> Option<(u32, Option<CreatedCompute>)> {
    let gi_id = intent.gi_id?;
    let gi = live.iter().find(|gi| {
        gi.gi_id == gi_id
            && gi.placement == MigPlacement::from(intent.placement)
            && gi.gi_profile_id == intent.gi_profile_id
    })?;
    let compute = intent.ci_id.and_then(|ci_id| {
        gi.compute_instances
            .iter()
            .find(|ci| ci.ci_id == ci_id && intent.mig_uuid.as_deref() == Some(ci.uuid.as_str()))
            .map(|ci| CreatedCompute {
                ci_id: ci.ci_id,
                uuid: ci.uuid.clone(),
            })
    });
    Some((gi.gi_id, compute))
}

/// Whether a claim entry holds an instance on GPU `minor` overlapping `placement`.
fn holds(entry: &ClaimEntry, minor: u32, placement: MigPlacement) -> bool {
    entry.devices.iter().any(|d| {
        d.mig_instance.as_ref().is_some_and(|i| {
            i.parent_minor == minor
                && mig_catalog::conflicts(MigPlacement::from(i.placement), placement)
        })
    })
}

fn complete_record(device: &mut DeviceRecord, gi_id: u32, compute: CreatedCompute, caps: MigCaps) {
    device.uuid.clone_from(&compute.uuid);
    device.mig = Some(caps);
    if let Some(intent) = device.mig_instance.as_mut() {
        intent.gi_id = Some(gi_id);
        intent.ci_id = Some(compute.ci_id);
        intent.mig_uuid = Some(compute.uuid);
    }
}
