//! What makes a slice real on its GPU: one CUDA MPS control daemon per GPU that carries MPS
//! slices, and the time slice of GPUs that carry time-sliced ones.
//!
//! The checkpoint is the one source of truth for who needs what: a GPU needs its daemon while
//! any claim entry (being prepared or prepared) has an MPS device on it, and its time slice
//! while any has a time-sliced device on it. Exclusive devices and MIG devices need neither.
//! Set-up and tear-down of one GPU serialise on a per-GPU lock, and a prepare records its
//! claim before it takes the lock while an unprepare removes its claim before it takes it, so
//! the last unprepare and a new prepare cannot both miss each other: either the unprepare sees
//! the new claim and keeps the daemon, or the prepare waits and starts a fresh one.
//!
//! What was set up is also recorded in the checkpoint ([`GpuSharingEntry`]), riding along
//! with the claim's own checkpoint write, so that a restarted plugin finds it again: start-up
//! ([`GpuSharing::restore`]) adopts or restarts the daemons prepared claims need, sets their
//! time slices again after a reboot, and undoes everything else (orphans).
//!
//! Each MPS GPU's server is held to the largest MPS slice on it ([`server_limits`]), so
//! that a process that clears its `CUDA_MPS_*` environment still meets that ceiling.
//!
//! Each GPU's record also names the daemon that served it ([`Incarnation`]). Whenever the
//! plugin finds another one — at start-up, in the periodic check, at a prepare — the daemon
//! was replaced and its clients lost their server: that is reported once per replacement
//! (`Restarted`), whoever restarted it (the plugin, or the kubelet restarting a daemon pod).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

mod server_limits;

use kerf_core::checkpoint::{Checkpoint, DeviceRecord, GpuSharingEntry};
use kerf_core::enforcement::{Enforcement, Holder, Holders};
use kerf_core::inventory::Inventory;
use kerf_core::mps::{MpsClient, TimeSliceInterval};
use kerf_core::sharing::Sharing;

use crate::checkpoint_store::CheckpointStore;
use crate::claim_locks::ClaimLocks;
use crate::identity::ClaimRef;
use crate::mps_daemons::{ControlDaemons, Incarnation};
use crate::{Error, Result};

use self::server_limits::{ServerLimitBook, holders_of};

/// The GPU whose MPS daemon serves `device`: whole GPUs shared by MPS.
fn mps_gpu(device: &DeviceRecord) -> Option<&str> {
    (device.sharing == Sharing::Mps && device.mig.is_none()).then_some(device.uuid.as_str())
}

/// The GPU whose time slice `device` needs, with the interval it asks for.
fn time_sliced_gpu(device: &DeviceRecord) -> Option<(&str, TimeSliceInterval)> {
    (device.sharing == Sharing::TimeSlicing && device.mig.is_none())
        .then_some((device.uuid.as_str(), device.time_slice_interval))
}

/// How many claim entries need each kind of set-up on one GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Users {
    mps: usize,
    time_sliced: usize,
}

fn users(cp: &Checkpoint, gpu: &str) -> Users {
    let mut users = Users::default();
    for entry in cp.claims.values() {
        if entry.devices.iter().any(|d| mps_gpu(d) == Some(gpu)) {
            users.mps += 1;
        }
        if entry
            .devices
            .iter()
            .any(|d| time_sliced_gpu(d).is_some_and(|(g, _)| g == gpu))
        {
            users.time_sliced += 1;
        }
    }
    users
}

/// What [`GpuSharing::restore`] did at start-up.
#[derive(Debug, Default)]
pub struct SharingRestore {
    /// GPUs whose running daemon was adopted.
    pub adopted: Vec<String>,
    /// GPUs whose daemon was started (after a reboot, or because it had died).
    pub started: Vec<String>,
    /// GPUs whose daemon is not the one recorded: replaced while the plugin was down. Their
    /// claims are reported by the next `GpuSharing::check_daemons`.
    pub replaced: Vec<String>,
    /// GPUs whose daemon no prepared claim needed, stopped.
    pub orphans_stopped: Vec<String>,
    /// GPUs whose time slice was set again.
    pub time_slices_set: Vec<String>,
    /// GPUs whose time slice no claim needed, restored to the default.
    pub time_slices_restored: Vec<String>,
    /// What could not be done, per GPU; the daemon check retries the daemons.
    pub failures: Vec<Error>,
}

/// A daemon found replaced (dead and started again, by the plugin or by the kubelet).
#[derive(Debug)]
pub(crate) struct Restarted {
    /// The GPU.
    pub gpu: String,
    /// The claims with MPS slices on it.
    pub claims: Vec<ClaimRef>,
    /// Why the restart failed, if it did (the next check tries again).
    pub error: Option<Error>,
}

/// MPS daemons and time slices of the node's GPUs (see the module docs). Without GPU tools
/// (mock mode without a mock driver root) nothing is enforced and slices stay accounting.
pub struct GpuSharing {
    tools: Option<ControlDaemons>,
    gpu_locks: ClaimLocks,
    /// Replacements found outside the periodic check, reported by its next run.
    replaced: std::sync::Mutex<Vec<Restarted>>,
    /// The limits each MPS server was given.
    limits: ServerLimitBook,
}

impl GpuSharing {
    /// Sharing enforced with `tools`, or not at all when `None`.
    pub fn new(tools: Option<ControlDaemons>) -> Self {
        GpuSharing {
            tools,
            gpu_locks: ClaimLocks::default(),
            replaced: std::sync::Mutex::default(),
            limits: ServerLimitBook::default(),
        }
    }

    /// The same, knowing the GPUs of `inventory`: their memory stands for "no memory limit"
    /// in an MPS server's limits.
    #[must_use]
    pub fn with_gpus_of(mut self, inventory: &Inventory) -> Self {
        self.limits = ServerLimitBook::of_inventory(inventory);
        self
    }

    /// Refuses a prepare whose class requires the MPS server (or the hardware) to hold a
    /// device's limits when, with its GPU set up, something weaker holds them: its GPU
    /// carries MPS slices of another size (an allocation kerf-controller did not keep to one
    /// size), or no GPU tools enforce anything here. Call after [`GpuSharing::set_up`].
    ///
    /// # Errors
    /// [`Error::Mps`] naming the GPU, the device and who holds what.
    pub(crate) fn check_held(
        &self,
        allocated: &[kerf_api::AllocatedDevice],
        devices: &[DeviceRecord],
        checkpoint: &CheckpointStore,
    ) -> Result<()> {
        let required = allocated
            .iter()
            .filter(|a| a.enforcement == Enforcement::Server)
            .map(|a| a.device.as_str());
        for name in required {
            for device in devices.iter().filter(|d| d.device_name == name) {
                let held = checkpoint.read(|cp| self.holders(cp, device));
                let weak = |h: Holder| !matches!(h, Holder::Hardware | Holder::Server);
                if weak(held.memory) || weak(held.compute) {
                    return Err(Error::Mps {
                        gpu: device.uuid.clone(),
                        message: format!(
                            "device {name}'s class requires its MPS server to hold its limits (sharing.enforcement Server), but its memory is held by {} and its compute by {}: the GPU carries MPS slices of other sizes, or this node enforces no MPS limits",
                            held.memory.as_str(),
                            held.compute.as_str()
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Who holds `device`'s memory and compute limits, by the server limits `cp` records
    /// (see [`kerf_core::enforcement`]).
    pub(crate) fn holders(&self, cp: &Checkpoint, device: &DeviceRecord) -> Holders {
        holders_of(cp, device, self.is_enforced())
    }

    /// Whether slices are enforced.
    pub(crate) fn is_enforced(&self) -> bool {
        self.tools.is_some()
    }

    /// The MPS client of each device, `None` for devices no daemon serves. Pure: no daemon
    /// is started or checked.
    ///
    /// # Errors
    /// [`Error::Core`] when an MPS device's UUID is not a GPU UUID.
    pub fn clients(&self, devices: &[DeviceRecord]) -> Result<Vec<Option<MpsClient>>> {
        devices
            .iter()
            .map(|device| match (&self.tools, mps_gpu(device)) {
                (Some(tools), Some(gpu)) => Ok(Some(tools.client(gpu)?)),
                _ => Ok(None),
            })
            .collect()
    }

    /// Sets up what the devices of a claim already recorded in `checkpoint` need: starts or
    /// adopts each MPS GPU's daemon, sets each time-sliced GPU's time slice unless it is set.
    /// Records the set-up in the checkpoint lazily: the claim's own checkpoint write carries it.
    ///
    /// # Errors
    /// [`Error::Mps`] or [`Error::TimeSlice`] naming the GPU and the tool's words. What this
    /// call did for other GPUs of the claim stays; [`GpuSharing::release`] after the claim is
    /// removed undoes it.
    pub(crate) async fn set_up(
        &self,
        devices: &[DeviceRecord],
        checkpoint: &CheckpointStore,
    ) -> Result<()> {
        let Some(tools) = &self.tools else {
            return Ok(());
        };
        for gpu in devices.iter().filter_map(mps_gpu).collect::<BTreeSet<_>>() {
            let _gpu = self.gpu_locks.lock(gpu).await;
            let incarnation = tools.ensure(gpu).await?;
            self.record_daemon(tools, gpu, &incarnation, checkpoint);
            self.limits.hold(tools, gpu, checkpoint).await?;
        }
        let time_sliced: BTreeMap<&str, TimeSliceInterval> =
            devices.iter().filter_map(time_sliced_gpu).collect();
        for (gpu, interval) in time_sliced {
            let _gpu = self.gpu_locks.lock(gpu).await;
            let set = checkpoint.read(|cp| cp.gpu_sharing.get(gpu).and_then(|e| e.time_slice));
            match set {
                Some(current) if current != interval => tracing::info!(
                    gpu,
                    current = ?current,
                    asked = ?interval,
                    "GPU keeps the time slice its first time-sliced claim set"
                ),
                Some(_) => {}
                None => {
                    tools.set_time_slice(gpu, interval).await?;
                    checkpoint.mutate_lazily(|cp| {
                        cp.gpu_sharing.entry(gpu.to_owned()).or_default().time_slice =
                            Some(interval);
                    });
                }
            }
        }
        Ok(())
    }

    /// Undoes, on the GPUs of `devices`, what no claim in `checkpoint` needs any more: stops
    /// daemons, restores default time slices. Call after the claim left the checkpoint.
    /// Failures are logged: the claim is gone either way, and start-up retries the orphans.
    pub async fn release(&self, devices: &[DeviceRecord], checkpoint: &CheckpointStore) {
        let Some(tools) = &self.tools else {
            return;
        };
        let gpus: BTreeSet<&str> = devices
            .iter()
            .filter_map(|d| mps_gpu(d).or_else(|| time_sliced_gpu(d).map(|(g, _)| g)))
            .collect();
        for gpu in gpus {
            let _gpu = self.gpu_locks.lock(gpu).await;
            if let Err(error) = release_gpu(tools, gpu, checkpoint).await {
                tracing::warn!(gpu, %error, "cannot undo the GPU's sharing set-up");
            }
            if checkpoint.read(|cp| users(cp, gpu).mps) > 0
                && let Err(error) = self.limits.hold(tools, gpu, checkpoint).await
            {
                // The largest slice left is smaller: the old, higher ceiling stays until the
                // next change or check gives the new one.
                tracing::warn!(gpu, %error, "cannot lower the MPS server limits");
            }
        }
    }

    /// Brings the GPUs in line with the checkpoint at start-up (see the module docs).
    pub async fn restore(&self, checkpoint: &CheckpointStore) -> SharingRestore {
        let mut report = SharingRestore::default();
        let Some(tools) = &self.tools else {
            return report;
        };
        let (needed_mps, needed_time_slices) = checkpoint.read(needed_set_up);
        let recorded: BTreeMap<String, GpuSharingEntry> =
            checkpoint.read(|cp| cp.gpu_sharing.clone());
        for gpu in &needed_mps {
            let _gpu = self.gpu_locks.lock(gpu).await;
            let found = tools.current(gpu).await.ok().flatten();
            match tools.ensure(gpu).await {
                Ok(incarnation) => {
                    if found.as_ref() == Some(&incarnation) {
                        report.adopted.push(gpu.clone());
                    } else {
                        report.started.push(gpu.clone());
                    }
                    if self.record_daemon(tools, gpu, &incarnation, checkpoint) {
                        report.replaced.push(gpu.clone());
                    }
                    if let Err(error) = self.limits.hold(tools, gpu, checkpoint).await {
                        report.failures.push(error);
                    }
                }
                Err(error) => report.failures.push(error),
            }
        }
        self.stop_orphans(tools, &needed_mps, &recorded, checkpoint, &mut report)
            .await;
        self.restore_time_slices(
            tools,
            &needed_time_slices,
            &recorded,
            checkpoint,
            &mut report,
        )
        .await;
        report
    }

    async fn stop_orphans(
        &self,
        tools: &ControlDaemons,
        needed: &BTreeSet<String>,
        recorded: &BTreeMap<String, GpuSharingEntry>,
        checkpoint: &CheckpointStore,
        report: &mut SharingRestore,
    ) {
        let mut orphans: BTreeMap<String, PathBuf> = tools
            .known_gpus()
            .await
            .into_iter()
            .map(|gpu| (gpu, tools.settings().root.clone()))
            .collect();
        for (gpu, entry) in recorded {
            if let Some(root) = &entry.mps_root {
                orphans.entry(gpu.clone()).or_insert_with(|| root.clone());
            }
        }
        for (gpu, root) in orphans.into_iter().filter(|(g, _)| !needed.contains(g)) {
            let _gpu = self.gpu_locks.lock(&gpu).await;
            match tools.with_root(root).stop(&gpu).await {
                Ok(()) => {
                    checkpoint.mutate_lazily(|cp| clear(cp, &gpu, forget_daemon));
                    report.orphans_stopped.push(gpu);
                }
                Err(error) => report.failures.push(error),
            }
        }
    }

    async fn restore_time_slices(
        &self,
        tools: &ControlDaemons,
        needed: &BTreeMap<String, TimeSliceInterval>,
        recorded: &BTreeMap<String, GpuSharingEntry>,
        checkpoint: &CheckpointStore,
        report: &mut SharingRestore,
    ) {
        // A reboot resets time slices, and setting one again costs one nvidia-smi call, so
        // every GPU that needs one gets it set, the recorded interval first.
        for (gpu, asked) in needed {
            let _gpu = self.gpu_locks.lock(gpu).await;
            let interval = recorded
                .get(gpu)
                .and_then(|e| e.time_slice)
                .unwrap_or(*asked);
            match tools.set_time_slice(gpu, interval).await {
                Ok(()) => {
                    checkpoint.mutate_lazily(|cp| {
                        cp.gpu_sharing.entry(gpu.clone()).or_default().time_slice = Some(interval);
                    });
                    report.time_slices_set.push(gpu.clone());
                }
                Err(error) => report.failures.push(error),
            }
        }
        for (gpu, _) in recorded
            .iter()
            .filter(|(g, e)| e.time_slice.is_some() && !needed.contains_key(*g))
        {
            let _gpu = self.gpu_locks.lock(gpu).await;
            match tools.set_time_slice(gpu, TimeSliceInterval::Default).await {
                Ok(()) => {
                    checkpoint.mutate_lazily(|cp| clear(cp, gpu, |e| e.time_slice = None));
                    report.time_slices_restored.push(gpu.clone());
                }
                Err(error) => report.failures.push(error),
            }
        }
    }

    /// Starts again the daemons that died on GPUs that still have MPS claims, and reports
    /// every daemon found replaced since the plugin last looked (here, at start-up or at a
    /// prepare). Returns one entry per replaced daemon.
    pub(crate) async fn check_daemons(&self, checkpoint: &CheckpointStore) -> Vec<Restarted> {
        let Some(tools) = &self.tools else {
            return Vec::new();
        };
        let (needed, _) = checkpoint.read(needed_set_up);
        for gpu in needed {
            let _gpu = self.gpu_locks.lock(&gpu).await;
            if !checkpoint.read(|cp| users(cp, &gpu).mps > 0) {
                continue;
            }
            let current = match tools.current(&gpu).await {
                Ok(current) => current,
                Err(error) => {
                    tracing::warn!(gpu, %error, "cannot check the MPS daemon");
                    continue;
                }
            };
            let outcome = match current {
                Some(incarnation) => Ok(incarnation),
                None => tools.restart(&gpu).await,
            };
            match outcome {
                Ok(incarnation) => {
                    self.record_daemon(tools, &gpu, &incarnation, checkpoint);
                    if let Err(error) = self.limits.hold(tools, &gpu, checkpoint).await {
                        tracing::warn!(gpu, %error, "cannot give the MPS server its limits");
                    }
                }
                Err(error) => {
                    let claims = checkpoint.read(|cp| mps_claims(cp, &gpu));
                    self.lock_replaced().push(Restarted {
                        gpu,
                        claims,
                        error: Some(error),
                    });
                }
            }
        }
        std::mem::take(&mut *self.lock_replaced())
    }

    /// Records `incarnation` as the daemon of `gpu`; when another one was recorded, the
    /// daemon was replaced: queues the report and returns true. The caller holds the GPU's
    /// lock.
    fn record_daemon(
        &self,
        tools: &ControlDaemons,
        gpu: &str,
        incarnation: &Incarnation,
        checkpoint: &CheckpointStore,
    ) -> bool {
        let root = tools.settings().root.clone();
        let previous =
            checkpoint.read(|cp| cp.gpu_sharing.get(gpu).and_then(|e| e.mps_daemon.clone()));
        if previous.as_deref() != Some(incarnation.as_str()) {
            // A new daemon has none of the limits the old one was given.
            checkpoint.mutate_lazily(|cp| {
                let entry = cp.gpu_sharing.entry(gpu.to_owned()).or_default();
                entry.mps_root = Some(root);
                entry.mps_daemon = Some(incarnation.as_str().to_owned());
                entry.mps_server_limits = None;
            });
        }
        let Some(previous) = previous.filter(|p| p != incarnation.as_str()) else {
            return false;
        };
        tracing::warn!(gpu, %previous, current = %incarnation, "MPS daemon was replaced");
        let claims = checkpoint.read(|cp| mps_claims(cp, gpu));
        self.lock_replaced().push(Restarted {
            gpu: gpu.to_owned(),
            claims,
            error: None,
        });
        true
    }

    fn lock_replaced(&self) -> std::sync::MutexGuard<'_, Vec<Restarted>> {
        // A panic while holding it cannot leave the list half-changed: push and take only.
        self.replaced
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn forget_daemon(entry: &mut GpuSharingEntry) {
    entry.mps_root = None;
    entry.mps_daemon = None;
    entry.mps_server_limits = None;
}

/// Undoes on one GPU what no claim needs any more; the caller holds the GPU's lock.
async fn release_gpu(
    tools: &ControlDaemons,
    gpu: &str,
    checkpoint: &CheckpointStore,
) -> Result<()> {
    let (users, entry) = checkpoint.read(|cp| (users(cp, gpu), cp.gpu_sharing.get(gpu).cloned()));
    let entry = entry.unwrap_or_default();
    let has_daemon_files = tools.directories(gpu).is_ok_and(|d| d.base().exists());
    if users.mps == 0 && (entry.mps_root.is_some() || has_daemon_files) {
        let root = entry
            .mps_root
            .clone()
            .unwrap_or_else(|| tools.settings().root.clone());
        tools.with_root(root).stop(gpu).await?;
        checkpoint.mutate_lazily(|cp| clear(cp, gpu, forget_daemon));
    }
    if users.time_sliced == 0 && entry.time_slice.is_some() {
        tools
            .set_time_slice(gpu, TimeSliceInterval::Default)
            .await?;
        checkpoint.mutate_lazily(|cp| clear(cp, gpu, |e| e.time_slice = None));
    }
    Ok(())
}

/// Applies `change` to the GPU's set-up record and drops the record once it is empty.
fn clear(cp: &mut Checkpoint, gpu: &str, change: impl FnOnce(&mut GpuSharingEntry)) {
    if let Some(entry) = cp.gpu_sharing.get_mut(gpu) {
        change(entry);
        if entry.is_empty() {
            cp.gpu_sharing.remove(gpu);
        }
    }
}

/// The GPUs that need a daemon, and those that need a time slice with the interval of their
/// first claim in UID order.
fn needed_set_up(cp: &Checkpoint) -> (BTreeSet<String>, BTreeMap<String, TimeSliceInterval>) {
    let mut mps = BTreeSet::new();
    let mut time_slices = BTreeMap::new();
    for device in cp.claims.values().flat_map(|e| &e.devices) {
        if let Some(gpu) = mps_gpu(device) {
            mps.insert(gpu.to_owned());
        }
        if let Some((gpu, interval)) = time_sliced_gpu(device) {
            time_slices.entry(gpu.to_owned()).or_insert(interval);
        }
    }
    (mps, time_slices)
}

fn mps_claims(cp: &Checkpoint, gpu: &str) -> Vec<ClaimRef> {
    cp.claims
        .iter()
        .filter(|(_, e)| e.devices.iter().any(|d| mps_gpu(d) == Some(gpu)))
        .map(|(uid, e)| ClaimRef::of_entry(uid, e))
        .collect()
}
