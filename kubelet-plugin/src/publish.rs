//! Publishing the node's GPUs as ResourceSlices, and keeping them published.
//!
//! The slices of one node form one pool (named after the node) whose slices have deterministic
//! names ([`kerf_api::slice_name`]), so server-side apply can address them. Consumers use only
//! the slices of a pool's highest `pool.generation`, and treat the pool as complete once they
//! see `resourceSliceCount` of them; so:
//!
//! - when the published slices already hold exactly the desired content, nothing is written
//!   and the generation stays;
//! - any other change (content, slice count, a slice lost or edited by someone else) writes
//!   every desired slice at generation `max + 1` and then deletes the slices that are no
//!   longer desired. Until the new generation is complete consumers see an incomplete pool,
//!   never a mix of old and new devices.
//!
//! What a slice was built from is recorded as a hash in an annotation. Comparing that, rather
//! than the spec the API server returns, keeps server-side normalisation (quantities,
//! defaults) from looking like a change and bumping the generation forever.
//!
//! The kubelet deletes every node-local slice when it starts, and a driver's slices 30 s after
//! the driver's connection drops; [`Publisher::run`] therefore watches this node's slices of
//! this driver and publishes again, after a short debounce, when one disappears or is changed
//! by someone else. A periodic resync catches anything the watch missed.
//!
//! Every device carries the `allocator` attribute from its Node's ownership record
//! ([`kerf_api::ownership`]): the annotation [`kerf_api::ownership::RECORD_ANNOTATION`] that
//! kerf-controller writes.
//! The record is read with the Node the first publish fetches for the owner reference, and
//! [`Publisher::run`] watches this node's Node object (only that one) and publishes again,
//! after the same debounce, when the record changes. A device the record does not name is
//! published without the attribute. A malformed record is warned about once per bad value and
//! ignored: the publisher keeps the last good record. The shared publication (scheduler
//! slices, [`kerf_api::shared_publication`]) is read from the same Node and watch; see
//! `SharedPublicationHandle` and the `scheduler_slices` submodule.
//!
//! A dynamic-MIG GPU is published as partitionable devices (a counter set and one device per
//! MIG placement, [`kerf_api::resourceslice::dynamic_mig`]) when the API server keeps them: the
//! publisher probes `DRAPartitionableDevices` the first time the inventory has such a GPU;
//! without it the GPU is published whole, with one log line. See the `dynamic_mig` submodule.
//!
//! With [`Publisher::with_device_taints`] an unhealthy device carries the taint
//! `<driver>/unhealthy` ([`kerf_api::resourceslice::taints`]) and the publisher publishes again
//! whenever the health changes; the pool is then cut at 64 devices per slice, the API's limit
//! for slices with taints, whether or not any device is tainted, so a taint never re-chunks
//! the pool. In mock mode `Publisher::with_mock_fault_annotation` hands each version of the
//! watched Node to the mock fault annotation source.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kerf_api::ownership::OwnershipRecord;
use kerf_api::resourceslice::taints::set_health_taints;
use kerf_core::health::{NodeHealth, TaintPolicy};
use kerf_core::inventory::Inventory;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;

use crate::health::mock::NodeAnnotationSource;
pub(crate) use scheduler_slices::SharedPublicationHandle;

mod dynamic_mig;
mod failures;
mod run;
mod scheduler_slices;
use crate::metrics::Metrics;
use crate::{Error, Result};

pub use crate::identity::FIELD_MANAGER;

/// Annotation that records a hash of the spec a slice was built from (generation excluded).
pub const CONTENT_HASH_ANNOTATION: &str = "gpu.kerf.dev/content-hash";

/// Default wait between noticing a lost or changed slice and publishing again: long enough to
/// coalesce the burst of events a kubelet wipe causes, short enough to be "prompt".
const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(500);

/// Default first and longest waits between failed publish attempts.
const DEFAULT_RETRY_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(500), Duration::from_secs(30));

/// How often [`Publisher::run`] tries to delete the slices at shutdown before giving up.
const SHUTDOWN_DELETE_ATTEMPTS: u32 = 3;

/// One item of a kube-runtime watch.
type WatchItem<K> = std::result::Result<Event<K>, watcher::Error>;
/// A kube-runtime watch that retries errors with backoff.
type WatchStream<K> = BoxStream<'static, WatchItem<K>>;

/// Publishes one node's GPUs as ResourceSlices of one driver.
pub struct Publisher {
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    driver: String,
    node_name: String,
    metrics: Metrics,
    debounce: Duration,
    retry_backoff: (Duration, Duration),
    state: Mutex<PublishState>,
    taints: Option<DeviceTaints>,
    fault_annotation: Option<NodeAnnotationSource>,
    publication: SharedPublicationHandle,
    /// Where slice writes the API server will not take are told (Warning on the Node).
    reports: Option<crate::write_failures::WriteFailureReports>,
    /// Other instances of the driver on this node, which keep the slices at shutdown.
    others: Option<crate::instances::OtherInstances>,
}

/// Where device taints come from.
#[derive(Debug, Clone)]
struct DeviceTaints {
    health: watch::Receiver<NodeHealth>,
    policy: TaintPolicy,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("driver", &self.driver)
            .field("node_name", &self.node_name)
            .field("debounce", &self.debounce)
            .field("retry_backoff", &self.retry_backoff)
            .finish_non_exhaustive()
    }
}

/// What the publisher remembers between publishes.
#[derive(Debug, Default)]
struct PublishState {
    /// The Node as owner of the slices, once its UID is known.
    owner: Option<OwnerReference>,
    /// Whether the "no owner reference" warning was logged already.
    owner_warned: bool,
    /// resourceVersion of each slice as this publisher last wrote it; a different version
    /// means someone else changed the slice.
    written: HashMap<String, String>,
    /// Highest generation this publisher wrote, so a pool wiped by the kubelet comes back at
    /// a generation above anything consumers may still cache.
    last_generation: i64,
    /// The last good ownership record of the Node: the `allocator` attribute of each device.
    record: OwnershipRecord,
    /// The malformed record value warned about last, so a bad value is warned about once.
    bad_record: Option<String>,
    /// Scheduler slices: whether the server keeps them, the last bad publication.
    scheduler_slices: scheduler_slices::SchedulerSliceState,
    /// Whether the server keeps partitionable devices; `None` until probed.
    partitionable: Option<bool>,
    /// Failed slice writes in a row, and the note last told about them.
    write_failures: failures::FailedWrites,
}

/// What one publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    generation: i64,
    written: usize,
    deleted: usize,
}

/// A slice the publisher wants to exist.
struct Desired {
    name: String,
    hash: String,
    spec: ResourceSliceSpec,
}

impl Publisher {
    /// A publisher of `node_name`'s slices for `driver`, through `client`.
    pub fn new(client: kube::Client, driver: String, node_name: String, metrics: Metrics) -> Self {
        Self {
            slices: Api::all(client.clone()),
            nodes: Api::all(client),
            driver,
            node_name,
            metrics,
            debounce: DEFAULT_DEBOUNCE,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
            state: Mutex::new(PublishState::default()),
            taints: None,
            fault_annotation: None,
            publication: SharedPublicationHandle::default(),
            reports: None,
            others: None,
        }
    }

    /// At shutdown, leaves the slices alone while another instance of the driver serves
    /// this node (a rolling update's newer instance; see [`crate::instances`]).
    #[must_use]
    pub(crate) fn with_other_instances(mut self, others: crate::instances::OtherInstances) -> Self {
        self.others = Some(others);
        self
    }

    /// Tells slice writes the API server refuses, or that keep failing, through `reports`:
    /// a Warning Event on the Node and the write-failure metric (see `publish/failures.rs`).
    #[must_use]
    pub fn with_write_failure_reports(
        mut self,
        reports: crate::write_failures::WriteFailureReports,
    ) -> Self {
        self.reports = Some(reports);
        self
    }

    /// Taints unhealthy devices as `policy` says, from the health `health` carries, and
    /// publishes again when it changes. Only for an API server that keeps device taints
    /// ([`kerf_api::features::device_taints_probe`]); slices then hold at most 64 devices.
    #[must_use]
    pub fn with_device_taints(
        mut self,
        health: watch::Receiver<NodeHealth>,
        policy: TaintPolicy,
    ) -> Self {
        self.taints = Some(DeviceTaints { health, policy });
        self
    }

    /// Hands every version of the watched Node to `source` (mock mode: faults declared in a
    /// Node annotation).
    #[must_use]
    pub(crate) fn with_mock_fault_annotation(mut self, source: NodeAnnotationSource) -> Self {
        self.fault_annotation = Some(source);
        self
    }

    /// Sets the wait between noticing a lost or changed slice and publishing again.
    #[must_use]
    pub fn with_debounce(mut self, debounce: Duration) -> Self {
        self.debounce = debounce;
        self
    }

    /// Sets the first and the longest wait between failed publish attempts in
    /// [`Publisher::run`]; the wait doubles after each failure.
    #[must_use]
    pub fn with_retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.retry_backoff = (first, max.max(first));
        self
    }

    fn state(&self) -> MutexGuard<'_, PublishState> {
        // The state is plain bookkeeping that stays valid even if a holder panicked.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `spec.nodeName=<node>,spec.driver=<driver>`: this node's slices of this driver.
    fn field_selector(&self) -> String {
        format!(
            "spec.nodeName={},spec.driver={}",
            self.node_name, self.driver
        )
    }

    /// Publishes `inventory` once: writes the desired slices by server-side apply (only when
    /// something differs from what is published), then deletes this node's slices of this
    /// driver that are not desired. Records the outcome in the metrics.
    ///
    /// # Errors
    ///
    /// [`Error::Api`] when the inventory cannot be expressed as ResourceSlices, and
    /// [`Error::Kube`] when an API call fails; slices written before the failure stay, and the
    /// next publish completes the job.
    pub async fn publish(&self, inventory: &Inventory) -> Result<()> {
        let result = self.publish_once(inventory).await;
        self.metrics
            .record_publish(result.as_ref().map(|_| ()).map_err(Error::reason));
        self.tell_write_failure(result.as_ref().err()).await;
        match result {
            Ok(outcome) if outcome.written + outcome.deleted > 0 => {
                tracing::info!(
                    node = %self.node_name,
                    driver = %self.driver,
                    generation = outcome.generation,
                    written = outcome.written,
                    deleted = outcome.deleted,
                    "published ResourceSlices"
                );
                Ok(())
            }
            Ok(outcome) => {
                tracing::debug!(
                    generation = outcome.generation,
                    "ResourceSlices are up to date"
                );
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    async fn publish_once(&self, inventory: &Inventory) -> Result<Outcome> {
        // The Node first: the first read of it also takes its ownership record.
        let owner = self.node_owner().await?;
        self.probe_consumable_capacity().await;
        self.probe_partitionable_devices(inventory).await;
        let desired = self.desired_slices(inventory)?;
        let existing = self.list_slices().await?;
        let current_max = max_generation(&existing, &desired);
        let unchanged = self.is_published(&existing, &desired, current_max);
        let generation = if unchanged {
            current_max.unwrap_or_default()
        } else {
            let last = self.state().last_generation;
            current_max.unwrap_or_default().max(last).saturating_add(1)
        };
        let by_name: HashMap<&str, &ResourceSlice> = existing
            .iter()
            .filter_map(|s| Some((s.metadata.name.as_deref()?, s)))
            .collect();
        let mut written = 0;
        for slice in &desired {
            let owner_missing = by_name
                .get(slice.name.as_str())
                .is_none_or(|live| !has_owner(live, owner.as_ref()));
            if !unchanged || owner_missing {
                self.apply(slice, generation, owner.clone()).await?;
                written += 1;
            }
        }
        self.state().last_generation = generation;
        let desired_names: HashSet<&str> = desired.iter().map(|d| d.name.as_str()).collect();
        let mut deleted = 0;
        for name in existing.iter().filter_map(|s| s.metadata.name.as_deref()) {
            if !desired_names.contains(name) && self.delete_slice(name).await? {
                deleted += 1;
            }
        }
        Ok(Outcome {
            generation,
            written,
            deleted,
        })
    }

    fn desired_slices(&self, inventory: &Inventory) -> Result<Vec<Desired>> {
        let mut specs = kerf_api::resourceslice::node_slices(
            inventory,
            &self.driver,
            &self.node_name,
            self.slice_features(),
        )?;
        if let Some(taints) = &self.taints {
            let devices = taints.health.borrow().devices(inventory);
            set_health_taints(&mut specs, &self.driver, &devices, &taints.policy);
        }
        kerf_api::ownership::publish_owners(&mut specs, &self.state().record);
        let specs = self.finish_specs(specs)?;
        Ok(specs
            .into_iter()
            .enumerate()
            .map(|(index, mut spec)| {
                spec.pool.generation = 0;
                Desired {
                    name: kerf_api::slice_name(&self.node_name, &self.driver, index),
                    hash: content_hash(&spec),
                    spec,
                }
            })
            .collect())
    }

    /// Whether exactly the desired slices exist, all at one generation, as this publisher
    /// built and last wrote them.
    fn is_published(
        &self,
        existing: &[ResourceSlice],
        desired: &[Desired],
        generation: Option<i64>,
    ) -> bool {
        if existing.len() != desired.len() {
            return false;
        }
        let state = self.state();
        desired.iter().all(|want| {
            existing.iter().any(|live| {
                live.metadata.name.as_deref() == Some(want.name.as_str())
                    && Some(live.spec.pool.generation) == generation
                    && live.spec.pool.name == want.spec.pool.name
                    && annotation(live, CONTENT_HASH_ANNOTATION) == Some(want.hash.as_str())
                    && state
                        .written
                        .get(&want.name)
                        .is_none_or(|rv| live.metadata.resource_version.as_ref() == Some(rv))
            })
        })
    }

    async fn list_slices(&self) -> Result<Vec<ResourceSlice>> {
        let params = ListParams::default().fields(&self.field_selector());
        Ok(self.slices.list(&params).await?.items)
    }

    async fn apply(
        &self,
        desired: &Desired,
        generation: i64,
        owner: Option<OwnerReference>,
    ) -> Result<()> {
        let mut spec = desired.spec.clone();
        spec.pool.generation = generation;
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(desired.name.clone()),
                annotations: Some(BTreeMap::from([(
                    CONTENT_HASH_ANNOTATION.to_owned(),
                    desired.hash.clone(),
                )])),
                owner_references: owner.map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec,
        };
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let stored = self
            .slices
            .patch(&desired.name, &params, &Patch::Apply(&slice))
            .await
            .map_err(|e| Error::write("patch", "resourceslices", &desired.name, e))?;
        if let Some(rv) = stored.metadata.resource_version {
            self.state().written.insert(desired.name.clone(), rv);
        }
        Ok(())
    }

    /// Deletes one slice; `false` when it was already gone.
    async fn delete_slice(&self, name: &str) -> Result<bool> {
        let deleted = match self.slices.delete(name, &DeleteParams::default()).await {
            Ok(_) => true,
            Err(kube::Error::Api(status)) if status.code == 404 => false,
            Err(err) => return Err(Error::write("delete", "resourceslices", name, err)),
        };
        self.state().written.remove(name);
        Ok(deleted)
    }

    /// The Node as owner reference, so the garbage collector removes the slices with the
    /// node; the first successful read also takes the Node's ownership record, so the first
    /// publish already carries it. Publishing must not depend on it: without permission to
    /// read nodes, or before the Node object exists, the slices go out without an owner
    /// (warned about once).
    async fn node_owner(&self) -> Result<Option<OwnerReference>> {
        if let Some(owner) = self.state().owner.clone() {
            return Ok(Some(owner));
        }
        match self.nodes.get(&self.node_name).await {
            Ok(node) => {
                self.observe_record(&node);
                self.observe_publication(&node);
                if let Some(source) = &self.fault_annotation {
                    source.observe(&node);
                }
                let owner = node.metadata.uid.map(|uid| OwnerReference {
                    api_version: "v1".to_owned(),
                    kind: "Node".to_owned(),
                    name: self.node_name.clone(),
                    uid,
                    ..OwnerReference::default()
                });
                self.state().owner.clone_from(&owner);
                Ok(owner)
            }
            Err(kube::Error::Api(status)) if matches!(status.code, 403 | 404) => {
                let mut state = self.state();
                if !state.owner_warned {
                    state.owner_warned = true;
                    tracing::warn!(
                        node = %self.node_name,
                        code = status.code,
                        message = %status.message,
                        "cannot read the Node; publishing ResourceSlices without an owner reference"
                    );
                }
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }

    /// Deletes every slice of this driver on this node and returns how many there were.
    ///
    /// # Errors
    ///
    /// [`Error::Kube`] when listing or deleting fails.
    pub async fn delete_all(&self) -> Result<usize> {
        let mut deleted = 0;
        for slice in self.list_slices().await? {
            if let Some(name) = slice.metadata.name.as_deref()
                && self.delete_slice(name).await?
            {
                deleted += 1;
            }
        }
        self.state().written.clear();
        tracing::info!(node = %self.node_name, driver = %self.driver, deleted, "deleted ResourceSlices");
        Ok(deleted)
    }
}
/// The highest `pool.generation` among the existing slices of the desired pool.
fn max_generation(existing: &[ResourceSlice], desired: &[Desired]) -> Option<i64> {
    let pools: HashSet<&str> = desired.iter().map(|d| d.spec.pool.name.as_str()).collect();
    existing
        .iter()
        .filter(|s| pools.contains(s.spec.pool.name.as_str()))
        .map(|s| s.spec.pool.generation)
        .max()
}

/// Whether `slice` carries `owner` (trivially true without one): an owner that became known
/// after the slice was written is added without a new generation.
fn has_owner(slice: &ResourceSlice, owner: Option<&OwnerReference>) -> bool {
    owner.is_none_or(|owner| {
        slice
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|existing| existing.uid == owner.uid)
    })
}

fn annotation<'a>(slice: &'a ResourceSlice, key: &str) -> Option<&'a str> {
    slice
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// A stable hash of a spec (FNV-1a over its JSON, whose field and map order is fixed), so the
/// recorded hash means the same across restarts and releases of the plugin.
fn content_hash(spec: &ResourceSliceSpec) -> String {
    // Serialising plain data structures cannot fail; an empty input would only force one
    // extra generation bump.
    let bytes = serde_json::to_vec(spec).unwrap_or_default();
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::ResourcePool;

    fn spec(devices: usize) -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: "gpu.kerf.dev".to_owned(),
            node_name: Some("node-a".to_owned()),
            pool: ResourcePool {
                name: "node-a".to_owned(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(
                (0..devices)
                    .map(|i| k8s_openapi::api::resource::v1::Device {
                        name: format!("gpu-{i}"),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..ResourceSliceSpec::default()
        }
    }

    #[test]
    fn content_hash_is_stable_and_content_sensitive() {
        assert_eq!(content_hash(&spec(2)), content_hash(&spec(2)));
        assert_ne!(content_hash(&spec(2)), content_hash(&spec(3)));
        assert_eq!(content_hash(&spec(2)).len(), 16);
    }

    #[test]
    fn max_generation_looks_only_at_the_desired_pool() {
        let slice = |pool: &str, generation: i64| {
            let mut s = spec(1);
            s.pool.name = pool.to_owned();
            s.pool.generation = generation;
            ResourceSlice {
                metadata: ObjectMeta::default(),
                spec: s,
            }
        };
        let desired = [Desired {
            name: "x".to_owned(),
            hash: String::new(),
            spec: spec(1),
        }];
        assert_eq!(
            max_generation(
                &[slice("node-a", 3), slice("other", 9), slice("node-a", 4)],
                &desired
            ),
            Some(4)
        );
        assert_eq!(max_generation(&[slice("other", 9)], &desired), None);
    }
}
