//! The preparer: the plugin's answer to the kubelet's prepare and unprepare calls,
//! independent of the gRPC API version that carried them.
//!
//! A prepare GETs its claim only on a cache miss: a claim the watch-fed cache of this node's
//! claims holds with the kubelet's UID, not being deleted and allocated here is taken from it
//! ([`crate::claim_reader::Cached::usable`] says why that is safe); any other claim is read
//! from the API server, raced against the cache's watch ([`crate::claim_reader::miss`]). Then
//! the checkpoint entry is written as PrepareCompleted before the IDs are returned. No file
//! is fsync'd: the checkpoint must outlive the plugin, not the node, because after a reboot
//! nothing is prepared ([`crate::checkpoint_store`]). The CDI spec and the claim's device
//! metadata files (KEP-5304, mounted read-only by the spec) are written atomically
//! ([`crate::spec_writer`]), on one blocking thread while the checkpoint's write is under way:
//! they are transient, rebuilt from the checkpoint at start-up before the sockets serve,
//! rewritten by an idempotent repeat prepare, and removed at unprepare.
//! Concurrent prepares share checkpoint writes
//! ([`crate::checkpoint_store`]). PrepareStarted is recorded in memory first — it reserves the
//! devices against concurrent prepares — and reaches the disk only if a checkpoint write
//! happens to carry it:
//! the one side effect before completion is the spec file, which a crash cannot lose track of
//! (start-up removes specs no checkpoint entry owns, and the kubelet retries the prepare).
//! Claims prepare in parallel; two calls for the same claim serialise on a per-claim lock.
//! A claim allocated a dynamic-MIG placement is the exception: its PrepareStarted entry, with
//! the instance it is about to create, is written before the create, because a MIG
//! instance is a side effect start-up must be able to find and destroy after a crash
//! ([`crate::dynamic_mig`]).
//!
//! Slices shared by MPS or time-slicing are made real on their GPU ([`GpuSharing`]) after the
//! claim is recorded and before its spec is written, so the IDs reach the kubelet only once
//! the GPU's MPS daemon runs; the claim is removed before its GPUs are released, so a GPU
//! loses its daemon only when no claim on it remains.
//!
//! Errors stay typed ([`Error`], with [`PrepareError`] for claims that cannot be prepared as
//! asked) so that metrics get their reason label; the gRPC layer makes them the per-claim
//! message.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use futures::future::join_all;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::cdi::{self, CommonEdits, DeviceNodePolicy, SpecEncoder};
use kerf_core::checkpoint::{ClaimEntry, ClaimState, DeviceRecord};
use kerf_core::inventory::Inventory;
use kerf_core::names;
use kerf_proto::PreparedDevice;

use crate::checkpoint_store::CheckpointStore;
use crate::claim_locks::ClaimLocks;
use crate::claim_reader::{self, ClaimReader, ReadError};
use crate::crash::{CrashStep, crash_point};
use crate::dynamic_mig::{DynamicMig, startup::MigRestore};
use crate::gpu_sharing::{GpuSharing, Restarted, SharingRestore};
use crate::metrics::Metrics;
use crate::prepare_error::PrepareError;
use crate::publish::SharedPublicationHandle;
use crate::spec_writer::SpecWriter;
use crate::{Error, Result};

pub mod device_status;
mod plan;
mod records;
mod spec_files;
mod unprepare;

use device_status::DeviceStatusWriter;
use records::{pod_claim_name, results_of};

pub use crate::identity::ClaimRef;

/// Settings of the prepare path, fixed at start-up.
#[derive(Debug, Clone)]
pub struct PreparerConfig {
    /// The DRA driver name, e.g. `gpu.kerf.dev`.
    pub driver_name: String,
    /// This node's name: the pool name of every device the plugin publishes.
    pub node_name: String,
    /// Directory of the transient CDI specs, e.g. `/var/run/cdi`.
    pub cdi_dir: PathBuf,
    /// The CDI kind of kerf's devices, `k8s.<driver>/gpu`.
    pub cdi_kind: String,
    /// Container edits shared by every claim (control nodes, driver files).
    pub common_edits: CommonEdits,
    /// How device nodes are mapped to host paths (mock mode points them at `/dev/null`).
    pub device_nodes: DeviceNodePolicy,
}

impl PreparerConfig {
    /// The CDI kind kerf uses for a driver name.
    pub fn cdi_kind_for(driver_name: &str) -> String {
        format!("k8s.{driver_name}/gpu")
    }
}

/// The prepare/unprepare engine: turns a claim the kubelet names into CDI devices, recorded
/// in the checkpoint.
pub struct Preparer {
    config: PreparerConfig,
    inventory: Arc<Inventory>,
    claim_reader: Arc<dyn ClaimReader>,
    checkpoint: CheckpointStore,
    encoder: SpecEncoder,
    specs: SpecWriter,
    locks: ClaimLocks,
    sharing: GpuSharing,
    metrics: Metrics,
    device_status: Option<DeviceStatusWriter>,
    publication: SharedPublicationHandle,
    mig: DynamicMig,
    crash_at: Option<CrashStep>,
}

impl Preparer {
    /// Builds the engine over an opened checkpoint and starts its CDI spec writer; must be
    /// called inside a Tokio runtime. `sharing` enforces MPS and time-sliced slices.
    ///
    /// # Errors
    /// The CDI kind or the common container edits of `config` cannot make a valid spec.
    pub fn new(
        config: PreparerConfig,
        inventory: Arc<Inventory>,
        claim_reader: Arc<dyn ClaimReader>,
        checkpoint: CheckpointStore,
        sharing: GpuSharing,
        metrics: Metrics,
    ) -> Result<Self> {
        // The node-wide part of every spec is checked and encoded once, here.
        let encoder =
            SpecEncoder::new(&config.cdi_kind, &config.common_edits, &config.device_nodes)?;
        let specs = SpecWriter::start(config.cdi_dir.clone());
        let preparer = Preparer {
            config,
            inventory,
            claim_reader,
            checkpoint,
            encoder,
            specs,
            locks: ClaimLocks::default(),
            sharing,
            metrics,
            device_status: None,
            publication: SharedPublicationHandle::default(),
            mig: DynamicMig::unavailable(
                "dynamic MIG is not set up in this plugin (no MIG control)",
            ),
            crash_at: None,
        };
        preparer.update_prepared_gauge();
        Ok(preparer)
    }

    /// Makes prepares and unprepares report each claim's devices in its `status.devices`
    /// through `writer`, in the background (see [`device_status`]).
    #[must_use]
    pub fn with_device_status(mut self, writer: DeviceStatusWriter) -> Self {
        self.device_status = Some(writer);
        self
    }

    /// Completes scheduler shares (`shareID`/`consumedCapacity`) with the Node's shared
    /// publication as `handle` holds it at prepare time (the publisher keeps it current): the
    /// sharing of a share whose claim names none, and the grid on which a share is the whole
    /// GPU. Without it shares are shared by MPS.
    #[must_use]
    pub(crate) fn with_shared_publication(mut self, handle: SharedPublicationHandle) -> Self {
        self.publication = handle;
        self
    }

    /// Creates and destroys the MIG instances of dynamic-MIG placement devices with `mig`
    /// ([`crate::dynamic_mig`]); without it such devices fail to prepare.
    #[must_use]
    pub(crate) fn with_dynamic_mig(mut self, mig: DynamicMig) -> Self {
        self.mig = mig;
        self
    }

    /// Aborts the process right after `step` of every prepare or unprepare (mock mode's
    /// crash tests, [`crate::crash`]).
    #[must_use]
    pub(crate) fn with_crash_at(mut self, step: Option<CrashStep>) -> Self {
        self.crash_at = step;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &PreparerConfig {
        &self.config
    }

    /// Prepares a batch of claims concurrently. Every claim gets an answer, by UID: its
    /// devices, or the error that names what is wrong with it.
    ///
    /// Each claim runs as its own task: a batch spreads over the runtime's worker threads,
    /// and a prepare runs to its end (success or rollback) even when the kubelet gives up on
    /// the call, instead of stopping at whatever await point the cancellation found it.
    pub async fn prepare(
        self: &Arc<Self>,
        claims: &[ClaimRef],
    ) -> Vec<(String, Result<Vec<PreparedDevice>>)> {
        let started = Instant::now();
        let tasks = claims.iter().map(|claim| {
            let preparer = Arc::clone(self);
            let claim = claim.clone();
            tokio::spawn(async move { preparer.prepare_and_record(&claim).await })
        });
        join_all(tasks)
            .await
            .into_iter()
            .zip(claims)
            .map(|(joined, claim)| {
                let result = joined.unwrap_or_else(|e| {
                    // The task never got to count itself; it ran from the batch's start.
                    let error = Error::internal("the prepare task", e);
                    self.metrics
                        .record_prepare(Err(error.reason()), started.elapsed());
                    tracing::error!(claim.uid = %claim.uid, error = %error, "prepare failed");
                    Err(error)
                });
                (claim.uid.clone(), result)
            })
            .collect()
    }

    async fn prepare_and_record(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>> {
        let started = Instant::now();
        let result = self.prepare_claim(claim).await;
        self.metrics
            .record_prepare(outcome(&result), started.elapsed());
        if let Err(e) = &result {
            tracing::warn!(claim.uid = %claim.uid, claim.namespace = %claim.namespace, claim.name = %claim.name, error = %e, "prepare failed");
        }
        result
    }

    /// Unprepares a batch of claims concurrently; unknown claims succeed. Every claim gets an
    /// answer, by UID.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> Vec<(String, Result<()>)> {
        join_all(claims.iter().map(|claim| async move {
            let started = Instant::now();
            let result = self.unprepare_claim(claim).await;
            self.metrics
                .record_unprepare(outcome(&result), started.elapsed());
            if let Err(e) = &result {
                tracing::warn!(claim.uid = %claim.uid, error = %e, "unprepare failed");
            }
            (claim.uid.clone(), result)
        }))
        .await
    }

    /// Prepares one claim.
    ///
    /// # Errors
    /// Any reason the claim cannot be prepared, nothing being left behind for it:
    /// [`Error::Prepare`] when the claim itself is at fault (not found, not allocated to this
    /// node, a device held by another claim, …); other variants when the API server, the CDI
    /// directory or the checkpoint failed.
    async fn prepare_claim(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>> {
        validate_claim_ref(claim)?;
        let _guard = self.locks.lock(&claim.uid).await;
        if let Some(entry) = self.completed_entry(claim)? {
            // Idempotent repeat: the spec is rewritten because /var/run/cdi is a tmpfs that a
            // reboot empties, while the kubelet still holds the IDs we returned before.
            self.write_cdi_spec(claim, entry.pod_claim_name.as_deref(), &entry.devices)
                .await?;
            self.report_prepared(claim, &entry.devices);
            return Ok(results_of(&entry.devices));
        }
        let api_claim = self.fetch_claim(claim).await?;
        let pod_claim_name = pod_claim_name(&api_claim)?;
        let allocated = kerf_api::resolve_allocation(&api_claim, &self.config.driver_name)
            .map_err(PrepareError::Allocation)?;
        let mut devices = self.plan_devices(claim, &allocated)?;
        // Another plugin instance's start-up clean-up must not run beside this prepare.
        let _operation = self.checkpoint.operation().await?;
        self.record_started(claim, pod_claim_name.clone(), &mut devices)?;
        crash_point(self.crash_at, CrashStep::AfterStart);
        // Dynamic MIG writes its intent and creates the instances; it undoes them
        // itself when it fails.
        let mig = self
            .mig
            .set_up(&claim.uid, &mut devices, &self.checkpoint)
            .await;
        let created = mig.is_ok();
        let prepared = async {
            mig?;
            self.sharing.set_up(&devices, &self.checkpoint).await?;
            self.sharing
                .check_held(&allocated, &devices, &self.checkpoint)?;
            crash_point(self.crash_at, CrashStep::AfterSharing);
            self.finish_prepare(claim, pod_claim_name.as_deref(), &devices)
                .await
        }
        .await;
        if let Err(e) = prepared {
            self.forget_claim(claim).await;
            self.sharing.release(&devices, &self.checkpoint).await;
            if created {
                self.release_mig(claim, &devices).await;
            }
            return Err(e);
        }
        crash_point(self.crash_at, CrashStep::AfterCdiWrite);
        self.report_prepared(claim, &devices);
        Ok(results_of(&devices))
    }

    /// Hands a prepared claim's devices to the status writer, which only queues them.
    fn report_prepared(&self, claim: &ClaimRef, devices: &[DeviceRecord]) {
        if let Some(writer) = &self.device_status {
            let facts = self.checkpoint.read(|cp| {
                device_status::prepared_facts(&self.inventory, &self.sharing, cp, devices)
            });
            writer.publish(claim, facts);
        }
    }

    /// Makes sure every completed claim's CDI spec exists, e.g. after a reboot emptied
    /// `/var/run/cdi` while the kubelet still runs containers with our CDI IDs; and removes
    /// spec files of kerf's CDI kind that no checkpoint entry owns (left by a crash between the
    /// spec write and the checkpoint update).
    ///
    /// # Errors
    /// A spec could not be written or the CDI directory could not be read.
    pub(crate) async fn restore_cdi_specs(&self) -> Result<RestoreReport> {
        type Completed = (ClaimRef, Option<String>, Vec<DeviceRecord>);
        let completed: Vec<Completed> = self.checkpoint.read(|cp| {
            cp.claims
                .iter()
                .filter(|(_, e)| e.state == ClaimState::PrepareCompleted)
                .map(|(uid, e)| {
                    (
                        ClaimRef::of_entry(uid, e),
                        e.pod_claim_name.clone(),
                        e.devices.clone(),
                    )
                })
                .collect()
        });
        futures::future::try_join_all(completed.iter().map(|(claim, pod_claim_name, devices)| {
            self.write_cdi_spec(claim, pod_claim_name.as_deref(), devices)
        }))
        .await?;
        let owned: Vec<String> = self
            .checkpoint
            .read(|cp| cp.claims.keys().cloned().collect());
        let dir = self.config.cdi_dir.clone();
        let kind = self.config.cdi_kind.clone();
        let metadata_dir = self.metadata_dir();
        let (removed, metadata_removed) = blocking("the CDI spec clean-up task", move || {
            // A crash between a spec's temporary file and its rename leaves the temporary.
            let (vendor, class) = cdi::parse_kind(&kind)?;
            kerf_core::fsutil::remove_stale_temp_files(&dir, &format!("{vendor}-{class}_"))?;
            let specs = cdi::remove_orphan_specs(&dir, &kind, &owned)?;
            let metadata = cdi::remove_orphan_metadata(&metadata_dir, &owned)?;
            Ok((specs, metadata))
        })
        .await?;
        if metadata_removed > 0 {
            tracing::debug!(
                removed = metadata_removed,
                "removed device metadata of claims no checkpoint entry owns"
            );
        }
        Ok(RestoreReport {
            rewritten: completed.len(),
            orphans_removed: removed,
        })
    }

    /// Brings the MIG instances of dynamic-MIG GPUs in line with the checkpoint at start-up,
    /// before the CDI specs are restored (entries it drops lose their specs as orphans).
    ///
    /// # Errors
    /// The checkpoint write that drops unfinished entries failed.
    pub(crate) async fn restore_dynamic_mig(&self) -> Result<MigRestore> {
        let restored = self.mig.restore(&self.inventory, &self.checkpoint).await;
        self.update_prepared_gauge();
        restored
    }

    /// Brings the GPUs' MPS daemons and time slices in line with the checkpoint at start-up:
    /// adopts or restarts what prepared claims need, stops and restores the rest.
    pub(crate) async fn restore_sharing(&self) -> SharingRestore {
        self.sharing.restore(&self.checkpoint).await
    }

    /// Starts again the MPS daemons that died on GPUs that still have MPS claims.
    pub(crate) async fn check_mps_daemons(&self) -> Vec<Restarted> {
        self.sharing.check_daemons(&self.checkpoint).await
    }

    /// Whether MPS and time-slicing are enforced on the GPUs.
    pub(crate) fn sharing_enforced(&self) -> bool {
        self.sharing.is_enforced()
    }

    /// Number of claims in the checkpoint.
    pub(crate) fn prepared_claims(&self) -> usize {
        self.checkpoint.read(|cp| cp.claims.len())
    }

    fn completed_entry(&self, claim: &ClaimRef) -> Result<Option<ClaimEntry>> {
        let Some(entry) = self
            .checkpoint
            .read(|cp| cp.claims.get(&claim.uid).cloned())
        else {
            return Ok(None);
        };
        if entry.namespace != claim.namespace || entry.name != claim.name {
            return Err(PrepareError::PreparedUnderOtherName {
                uid: claim.uid.clone(),
                prepared_namespace: entry.namespace,
                prepared_name: entry.name,
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            }
            .into());
        }
        Ok((entry.state == ClaimState::PrepareCompleted).then_some(entry))
    }

    /// The claim from the reader's cache when it can stand in for a GET, else from the API
    /// server raced against the cache's watch ([`claim_reader::read`]).
    async fn fetch_claim(&self, claim: &ClaimRef) -> Result<Arc<ResourceClaim>> {
        let wanted = claim_reader::Wanted {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            driver: self.config.driver_name.clone(),
            node: self.config.node_name.clone(),
        };
        let read = claim_reader::read(&self.claim_reader, &wanted).await;
        let lookup = read
            .as_ref()
            .map_or_else(ReadError::lookup, |(_, lookup)| *lookup);
        self.metrics
            .record_claim_lookup_from(lookup.source(), lookup.reason());
        let (api_claim, _) = read.map_err(|e| match e {
            ReadError::Api {
                error: kube::Error::Api(status),
                ..
            } if status.code == 404 => Error::from(PrepareError::ClaimNotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            }),
            ReadError::Api { error, .. } => Error::Kube(error),
            ReadError::Task { error, .. } => Error::internal("the claim read task", error),
        })?;
        let actual = api_claim.metadata.uid.as_deref().unwrap_or_default();
        if actual != claim.uid {
            return Err(PrepareError::UidMismatch {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                actual: actual.to_owned(),
                expected: claim.uid.clone(),
            }
            .into());
        }
        Ok(api_claim)
    }

    /// Writes the spec and the entry as PrepareCompleted at the same time. Either order of
    /// the two is safe in a crash, because the kubelet has no answer yet and retries: a written
    /// entry without its spec gets the spec back at start-up
    /// ([`Preparer::restore_cdi_specs`]) and from the repeat prepare; a spec without a
    /// completed entry is removed at start-up or rewritten by the retried prepare. If either
    /// fails, the caller's rollback removes both.
    async fn finish_prepare(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        devices: &[DeviceRecord],
    ) -> Result<()> {
        let spec = async {
            let written = self.write_cdi_spec(claim, pod_claim_name, devices).await;
            crash_point(self.crash_at, CrashStep::AfterSpecWrite);
            written
        };
        let completed = self.checkpoint.update(|cp| {
            if let Some(entry) = cp.claims.get_mut(&claim.uid) {
                entry.state = ClaimState::PrepareCompleted;
            }
        });
        let (spec, completed) = tokio::join!(spec, completed);
        spec.and(completed)
    }

    /// Best-effort rollback of the MIG instances of a prepare that failed after creating them.
    async fn release_mig(&self, claim: &ClaimRef, devices: &[DeviceRecord]) {
        if let Err(e) = self.mig.release(devices).await {
            tracing::error!(claim.uid = %claim.uid, error = %e, "rollback: destroying MIG instances failed; start-up destroys them");
        }
    }

    /// Best-effort rollback of a failed prepare: no spec, no checkpoint entry.
    async fn forget_claim(&self, claim: &ClaimRef) {
        if let Err(e) = self.remove_cdi_spec(&claim.uid).await {
            tracing::error!(claim.uid = %claim.uid, error = %e, "rollback: removing CDI spec failed");
        }
        if let Err(e) = self
            .checkpoint
            .update(|cp| cp.remove_claim(&claim.uid))
            .await
        {
            tracing::error!(claim.uid = %claim.uid, error = %e, "rollback: checkpoint update failed");
        }
        self.update_prepared_gauge();
    }

    fn update_prepared_gauge(&self) {
        let n = self.prepared_claims();
        self.metrics
            .set_prepared_claims(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// What [`Preparer::restore_cdi_specs`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RestoreReport {
    /// Specs of completed claims written again.
    pub rewritten: usize,
    /// Spec files of kerf's CDI kind that no claim owned (including undecodable ones named for
    /// a claim UID), removed.
    pub orphans_removed: usize,
}

/// The metric label of a result.
fn outcome<T>(result: &Result<T>) -> Result<(), &'static str> {
    result.as_ref().map(|_| ()).map_err(Error::reason)
}

fn validate_claim_ref(claim: &ClaimRef) -> Result<()> {
    names::claim_uid("claim.uid", &claim.uid)?;
    names::namespace("claim.namespace", &claim.namespace)?;
    names::object_name("claim.name", &claim.name)?;
    Ok(())
}

/// Runs blocking file I/O off the async workers; `what` names the task if it panics.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> kerf_core::Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::internal(what, e))?
        .map_err(Error::from)
}
