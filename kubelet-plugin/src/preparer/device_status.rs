//! Per-device claim status: after a prepare, kerf's entries in the claim's `status.devices`
//! (one per prepared device, `Ready=True` and kerf's result as `data`, see
//! [`kerf_api::device_status`]); `kubectl get resourceclaim -o yaml` shows them.
//!
//! Writes are server-side applies of the `status` subresource by the field manager
//! [`FIELD_MANAGER`], holding only this driver's entries: the list is a map keyed by driver,
//! device, pool and shareID upstream, so the allocation, `reservedFor` and other drivers'
//! entries stay with their managers.
//!
//! The unprepare writes nothing: the kubelet unprepares a claim once no pod on the node uses
//! it, and then its allocator deallocates it (kube-controller-manager's resourceclaim
//! controller, `syncClaim` in `pkg/controller/resourceclaim/controller.go`, once
//! `reservedFor` is empty; kerf-controller for its own claims) or its owner deletes it. The
//! API server's status strategy drops the entries of deallocated devices by itself
//! (`dropDeallocatedStatusDevices` in `pkg/registry/resource/resourceclaim/strategy.go`), so
//! an apply of an empty list at unprepare would be a second write per claim that races the
//! deallocation (and mostly loses it, with a 404 or 422). The unprepare only cancels a write
//! still waiting in the queue ([`DeviceStatusWriter::forget`]).
//!
//! A status write never slows down or fails a prepare: the preparer hands the facts to a
//! bounded queue that coalesces per claim (the newest wish for a claim wins) and returns; one
//! background task writes, retrying transient failures with backoff. Outcomes that say the
//! write is moot are dropped quietly: the claim is gone (404), or no longer allocated to the
//! devices (422 "must be an allocated device in the claim", from `validateDeviceStatus` in
//! kubernetes/kubernetes `pkg/apis/resource/validation/validation.go`; the status strategy's
//! `dropDeallocatedStatusDevices` in `pkg/registry/resource/resourceclaim/strategy.go` also
//! removes entries of deallocated devices by itself).
//!
//! Two answers say the cluster does not want the status at all, and stop the writer for the
//! process lifetime after one log line:
//! - the answer lacks the entries just applied: the API server drops `status.devices`
//!   because its `DRAResourceClaimDeviceStatus` gate is off
//!   (`dropDisabledDRAResourceClaimDeviceStatusFields`, same strategy.go);
//! - permission denied: 403 when RBAC lacks `patch` on `resourceclaims/status`, or, from
//!   Kubernetes 1.36 with `DRAResourceClaimGranularStatusAuthorization`, a 422 whose cause
//!   says `changing status.devices requires resource="resourceclaims/driver"`: the per-driver
//!   check (`AuthorizedForDeviceStatus` in `pkg/registry/resource/utils.go`, called from the
//!   status strategy's validation) reports a missing `associated-node:patch` as a field
//!   error, not as a 403.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::device_status::{
    PreparedDeviceFacts, allocated_device_status, kept_device_status, status_apply_configuration,
};
use kerf_core::checkpoint::{Checkpoint, DeviceRecord};
use kerf_core::inventory::{DeviceRef, Inventory};
use kube::Api;
use kube::api::{Patch, PatchParams};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::gpu_sharing::GpuSharing;
use crate::identity::ClaimRef;
use crate::write_failures::WriteFailureReports;

/// The field manager of the plugin's writes, the same name as its Events' reporter.
pub const FIELD_MANAGER: &str = crate::identity::FIELD_MANAGER;

/// How the writer retries transient failures (timeouts, 429, 5xx, connection errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per write, the first included.
    pub attempts: u32,
    /// Wait before the second attempt; doubled for each further one.
    pub initial_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
}

/// Settings of the status writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceStatusConfig {
    /// The DRA driver name: the `driver` of every entry.
    pub driver_name: String,
    /// This node's name, named in the Ready message.
    pub node_name: String,
    /// Claims that may wait for their write at once; a new claim beyond that is not written
    /// (counted as `queue_full`), while later wishes for a waiting claim replace its earlier.
    pub queue_capacity: usize,
    /// Retries of transient failures.
    pub retry: RetryPolicy,
}

impl DeviceStatusConfig {
    /// Production settings: 1024 waiting claims, 5 attempts 0.5 s to 30 s apart.
    pub fn new(driver_name: &str, node_name: &str) -> Self {
        DeviceStatusConfig {
            driver_name: driver_name.to_owned(),
            node_name: node_name.to_owned(),
            queue_capacity: 1024,
            retry: RetryPolicy {
                attempts: 5,
                initial_backoff: Duration::from_millis(500),
                max_backoff: Duration::from_secs(30),
            },
        }
    }
}

/// The entries of a prepared claim's devices, waiting to be applied.
#[derive(Debug, Clone)]
struct Job {
    claim: ClaimRef,
    devices: Vec<PreparedDeviceFacts>,
    prepared_at: Time,
}

/// Claims waiting for their write, oldest first, one job each.
#[derive(Debug, Default)]
struct Queue {
    order: VecDeque<String>,
    jobs: HashMap<String, Job>,
}

/// Labels of the outcome counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// The writer's metrics, registered under `kerf_plugin_`:
/// `claim_device_status_writes_total{outcome}` and `claim_device_status_enabled`.
#[derive(Clone, Debug, Default)]
struct StatusMetrics {
    outcomes: Family<OutcomeLabels, Counter>,
    enabled: Gauge,
}

impl StatusMetrics {
    fn register(&self, registry: &mut Registry) {
        let registry = registry.sub_registry_with_prefix("kerf_plugin");
        registry.register(
            "claim_device_status_writes",
            "Per-device claim status writes, by outcome: written, claim_gone, deallocated, invalid, retried, gave_up, forbidden, field_dropped, queue_full, disabled",
            self.outcomes.clone(),
        );
        registry.register(
            "claim_device_status_enabled",
            "1 while the plugin writes per-device claim status, 0 once the API server dropped the field or refused the permission",
            self.enabled.clone(),
        );
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

struct WriterInner {
    config: DeviceStatusConfig,
    metrics: StatusMetrics,
    queue: Mutex<Queue>,
    wake: Notify,
    disabled: AtomicBool,
    overflow_logged: AtomicBool,
    /// Claims whose entries this process applied and that are still prepared: a repeated
    /// prepare of one of them writes nothing.
    written: Mutex<HashSet<String>>,
    /// Where writes the API server refuses, or that fail all their attempts, are told.
    reports: Option<WriteFailureReports>,
}

/// Registers the writer's metrics in `registry` as [`DeviceStatusWriter::start`] does, with
/// one example series each, for the metrics reference
/// ([`crate::metrics_reference::reference_registry`]).
pub(crate) fn reference_metrics(registry: &mut Registry) {
    let metrics = StatusMetrics::default();
    metrics.register(registry);
    metrics.count("written");
    metrics.enabled.set(1);
}

/// The handle the preparer gives status work to. Cloning is cheap; every clone feeds the same
/// background writer.
#[derive(Clone)]
pub struct DeviceStatusWriter {
    inner: Arc<WriterInner>,
}

impl std::fmt::Debug for DeviceStatusWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStatusWriter")
            .field("enabled", &self.is_enabled())
            .field("pending", &self.pending())
            .finish_non_exhaustive()
    }
}

impl DeviceStatusWriter {
    /// Starts the background writer, which applies through `client` until `shutdown` is
    /// cancelled (waiting writes are then dropped: the next plugin writes them again on the
    /// kubelet's next prepare). Registers its metrics in `registry`. Must be called inside a
    /// Tokio runtime.
    pub fn start(
        client: kube::Client,
        config: DeviceStatusConfig,
        registry: &mut Registry,
        shutdown: CancellationToken,
    ) -> (Self, JoinHandle<crate::Result<()>>) {
        Self::start_with_reports(client, config, registry, shutdown, None)
    }

    /// [`DeviceStatusWriter::start`], telling through `reports` the writes the API server
    /// refuses (403, 422 other than a deallocated device), and those that fail every attempt:
    /// a Warning Event on the claim and the write-failure metric, once per write.
    pub fn start_with_reports(
        client: kube::Client,
        config: DeviceStatusConfig,
        registry: &mut Registry,
        shutdown: CancellationToken,
        reports: Option<WriteFailureReports>,
    ) -> (Self, JoinHandle<crate::Result<()>>) {
        let metrics = StatusMetrics::default();
        metrics.register(registry);
        metrics.enabled.set(1);
        let inner = Arc::new(WriterInner {
            config,
            metrics,
            queue: Mutex::new(Queue::default()),
            wake: Notify::new(),
            disabled: AtomicBool::new(false),
            overflow_logged: AtomicBool::new(false),
            written: Mutex::new(HashSet::new()),
            reports,
        });
        let task = tokio::spawn(Arc::clone(&inner).run(client, shutdown));
        (DeviceStatusWriter { inner }, task)
    }

    /// Queues the entries of a prepared claim's devices; returns at once.
    pub fn publish(&self, claim: &ClaimRef, devices: Vec<PreparedDeviceFacts>) {
        let inner = &self.inner;
        if inner.is_disabled() {
            inner.metrics.count("disabled");
            return;
        }
        let already = lock(&inner.written).contains(&claim.uid);
        if already && !lock(&inner.queue).jobs.contains_key(&claim.uid) {
            // A repeated prepare: the entries are there, and rewriting them would only move
            // the condition's lastTransitionTime.
            return;
        }
        inner.enqueue(Job {
            claim: claim.clone(),
            devices,
            prepared_at: Time(k8s_openapi::jiff::Timestamp::now()),
        });
    }

    /// Forgets an unprepared claim: its write still waiting is cancelled, and a later prepare
    /// of it writes again. Its entries already written stay until the API server drops them
    /// at deallocation (module doc).
    pub fn forget(&self, claim: &ClaimRef) {
        let inner = &self.inner;
        lock(&inner.queue).jobs.remove(&claim.uid);
        lock(&inner.written).remove(&claim.uid);
    }

    /// False once the API server dropped the field or refused the permission.
    pub fn is_enabled(&self) -> bool {
        !self.inner.is_disabled()
    }

    /// Claims waiting for their write (the one being written not included).
    pub fn pending(&self) -> usize {
        lock(&self.inner.queue).jobs.len()
    }
}

/// The facts of a claim's prepared devices for its status: the records, with the parent GPU
/// and profile of MIG devices from `inventory`, the MPS directories from `sharing` and who
/// holds each device's limits from `checkpoint` (all in memory; no API read).
pub(crate) fn prepared_facts(
    inventory: &Inventory,
    sharing: &GpuSharing,
    checkpoint: &Checkpoint,
    devices: &[DeviceRecord],
) -> Vec<PreparedDeviceFacts> {
    // Only a record whose UUID is no GPU UUID fails here, and such a claim never prepared.
    let clients = sharing
        .clients(devices)
        .unwrap_or_else(|_| vec![None; devices.len()]);
    devices
        .iter()
        .zip(clients)
        .map(|(record, mps)| {
            let (gpu_uuid, mig_profile) = match inventory.device(&record.device_name) {
                Some(DeviceRef::Mig { parent, mig }) => {
                    (parent.uuid.clone(), Some(mig.profile.clone()))
                }
                Some(DeviceRef::Gpu(gpu)) => (gpu.uuid.clone(), None),
                None => (record.uuid.clone(), None),
            };
            PreparedDeviceFacts {
                record: record.clone(),
                gpu_uuid,
                mig_profile,
                mps,
                holders: sharing.holders(checkpoint, record),
            }
        })
        .collect()
}

/// What one answer of the API server means for a write.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Written; the label says which way.
    Done(&'static str),
    /// Moot (the claim is gone or deallocated); `warn` when it points at a bug of ours.
    Dropped { label: &'static str, warn: bool },
    /// The cluster does not take the status: stop writing, saying why once.
    Disable { label: &'static str, why: String },
    /// Worth another attempt.
    Retry,
}

fn classify(result: &Result<bool, kube::Error>) -> Outcome {
    match result {
        Ok(true) => Outcome::Done("written"),
        Ok(false) => Outcome::Disable {
            label: "field_dropped",
            why: "the API server dropped status.devices (feature gate DRAResourceClaimDeviceStatus is off)".to_owned(),
        },
        Err(kube::Error::Api(status)) => match status.code {
            404 => Outcome::Dropped {
                label: "claim_gone",
                warn: false,
            },
            403 => Outcome::Disable {
                label: "forbidden",
                why: format!(
                    "RBAC denies patch on resourceclaims/status ({})",
                    status.message
                ),
            },
            422 if status.message.contains("resourceclaims/driver") => Outcome::Disable {
                label: "forbidden",
                why: format!(
                    "RBAC denies associated-node:patch on resourceclaims/driver for this driver ({})",
                    status.message
                ),
            },
            422 if status
                .message
                .contains("must be an allocated device in the claim") =>
            {
                Outcome::Dropped {
                    label: "deallocated",
                    warn: false,
                }
            }
            400 | 422 => Outcome::Dropped {
                label: "invalid",
                warn: true,
            },
            _ => Outcome::Retry,
        },
        Err(_) => Outcome::Retry,
    }
}

impl WriterInner {
    fn is_disabled(&self) -> bool {
        self.disabled.load(Ordering::Acquire)
    }

    fn enqueue(&self, job: Job) {
        let uid = job.claim.uid.clone();
        let mut queue = lock(&self.queue);
        if let Some(waiting) = queue.jobs.get_mut(&uid) {
            *waiting = job;
        } else if queue.jobs.len() >= self.config.queue_capacity {
            drop(queue);
            self.metrics.count("queue_full");
            if !self.overflow_logged.swap(true, Ordering::AcqRel) {
                tracing::warn!(
                    capacity = self.config.queue_capacity,
                    claim.uid = %uid,
                    "per-device claim status queue full; statuses of new claims are not written until it drains"
                );
            }
            return;
        } else {
            queue.order.push_back(uid.clone());
            queue.jobs.insert(uid, job);
            self.overflow_logged.store(false, Ordering::Release);
        }
        drop(queue);
        self.wake.notify_one();
    }

    fn pop(&self) -> Option<Job> {
        let mut queue = lock(&self.queue);
        while let Some(uid) = queue.order.pop_front() {
            if let Some(job) = queue.jobs.remove(&uid) {
                return Some(job);
            }
        }
        None
    }

    fn has_waiting(&self, uid: &str) -> bool {
        lock(&self.queue).jobs.contains_key(uid)
    }

    async fn run(
        self: Arc<Self>,
        client: kube::Client,
        shutdown: CancellationToken,
    ) -> crate::Result<()> {
        loop {
            let Some(job) = self.pop() else {
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    () = self.wake.notified() => continue,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = self.write(&client, job) => {}
            }
        }
    }

    /// Writes one job, retrying transient failures, until it is done, moot, superseded by a
    /// newer job for the same claim, or the writer is disabled.
    async fn write(&self, client: &kube::Client, job: Job) {
        let claim = job.claim.clone();
        let entries = self.entries(&job);
        let mut backoff = self.config.retry.initial_backoff;
        for attempt in 1..=self.config.retry.attempts.max(1) {
            if self.is_disabled() {
                return;
            }
            let result = apply(client, &claim, &entries).await;
            match classify(&result) {
                Outcome::Retry => {
                    if self.gave_up(&claim, &result, attempt).await {
                        return;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.config.retry.max_backoff);
                    if self.has_waiting(&claim.uid) {
                        // A newer wish for this claim is queued; it replaces this one.
                        return;
                    }
                }
                Outcome::Done(label) => return self.done(&claim, label, entries.len()),
                Outcome::Dropped { label, warn } => {
                    return self.dropped(&claim, (label, warn), &result, attempt).await;
                }
                Outcome::Disable { label, why } => {
                    if !self.is_disabled() {
                        // Told once: the writer stops for the process lifetime.
                        self.tell(&claim, &result, (attempt, attempt)).await;
                    }
                    return self.disable(label, &why);
                }
            }
        }
    }

    /// The entries `job` applies.
    fn entries(&self, job: &Job) -> Vec<AllocatedDeviceStatus> {
        let (driver, node) = (&self.config.driver_name, &self.config.node_name);
        job.devices
            .iter()
            .map(|facts| allocated_device_status(driver, node, facts, &job.prepared_at))
            .collect()
    }

    /// Records a written status of `claim`.
    fn done(&self, claim: &ClaimRef, label: &'static str, devices: usize) {
        self.metrics.count(label);
        lock(&self.written).insert(claim.uid.clone());
        tracing::debug!(claim.uid = %claim.uid, devices, outcome = label, "per-device claim status applied");
    }

    /// Forgets a status that is moot; tells about it when `warn` (a bug of ours).
    async fn dropped(
        &self,
        claim: &ClaimRef,
        (label, warn): (&'static str, bool),
        result: &Result<bool, kube::Error>,
        attempt: u32,
    ) {
        self.metrics.count(label);
        lock(&self.written).remove(&claim.uid);
        let error = error_text(result);
        if warn {
            self.tell(claim, result, (attempt, attempt)).await;
            tracing::warn!(claim.uid = %claim.uid, claim.namespace = %claim.namespace, claim.name = %claim.name, %error, "the API server refused the per-device claim status");
        } else {
            tracing::debug!(claim.uid = %claim.uid, outcome = label, %error, "per-device claim status not written: the claim is gone or no longer allocated");
        }
    }

    /// After a transient failure: true, told, when `attempt` was the last one; else counts
    /// the retry.
    async fn gave_up(
        &self,
        claim: &ClaimRef,
        result: &Result<bool, kube::Error>,
        attempt: u32,
    ) -> bool {
        let error = error_text(result);
        if attempt >= self.config.retry.attempts {
            self.metrics.count("gave_up");
            self.tell(claim, result, (attempt, attempt)).await;
            tracing::warn!(claim.uid = %claim.uid, claim.namespace = %claim.namespace, claim.name = %claim.name, attempts = attempt, %error, "giving up on the per-device claim status");
            return true;
        }
        self.metrics.count("retried");
        tracing::debug!(claim.uid = %claim.uid, attempt, %error, "per-device claim status write failed; retrying");
        false
    }

    /// Tells about the failed write of `claim`'s status at its `attempts` (attempt, budget).
    async fn tell(
        &self,
        claim: &ClaimRef,
        result: &Result<bool, kube::Error>,
        attempts: (u32, u32),
    ) {
        if let (Some(reports), Err(error)) = (&self.reports, result) {
            let write = ("patch", "resourceclaims/status");
            reports
                .claim_write_failed(claim, write, error, attempts)
                .await;
        }
    }

    fn disable(&self, label: &'static str, why: &str) {
        self.metrics.count(label);
        if self.disabled.swap(true, Ordering::AcqRel) {
            return;
        }
        self.metrics.enabled.set(0);
        lock(&self.queue).jobs.clear();
        tracing::warn!(
            reason = label,
            "per-device claim status (status.devices) disabled until the plugin restarts: {why}"
        );
    }
}

/// One server-side apply of `entries` as the claim's `status.devices` of this manager.
/// `Ok(false)` when the answer lacks entries just applied.
async fn apply(
    client: &kube::Client,
    claim: &ClaimRef,
    entries: &[AllocatedDeviceStatus],
) -> Result<bool, kube::Error> {
    let config = status_apply_configuration(&claim.namespace, &claim.name, entries);
    let answer: ResourceClaim = Api::<ResourceClaim>::namespaced(client.clone(), &claim.namespace)
        .patch_status(
            &claim.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&config),
        )
        .await?;
    Ok(kept_device_status(&answer, entries))
}

/// The error of a failed write, empty for a success.
fn error_text(result: &Result<bool, kube::Error>) -> String {
    result
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held; a poisoned one still holds consistent data.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
