//! The claim controller's part of the shared [`Context`] ([`ClaimsPart`], its field
//! [`Context::claims`]) and what the claim reconciler asks of the [`Context`].

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::GpuClassParameters;
use kerf_api::controller_claims::class_parameters;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::gate::ReleasedGates;
use super::ledger::{Books, Ledger, WriteGuard};
use super::node_usage::NodeUsage;
use super::ownership::InputChanges;
use super::pod_index::PodsByClaim;
use super::pod_kinds::PodKinds;
use super::pod_latency::PodLatency;
use crate::context::Context;
use crate::error::{Error, Result};
/// Timing of the claim reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimSettings {
    /// How long a node the scheduler rejected is avoided for that pod the first time; it
    /// doubles with each further rejection of the same node for the same pod.
    pub rejection_backoff: Duration,
    /// Longest time a rejected node is avoided.
    pub rejection_backoff_max: Duration,
    /// When to try again after nothing fitted.
    pub unplaceable_retry: Duration,
    /// When to look again at a pod whose claims do not all exist yet.
    pub pending_retry: Duration,
    /// Fences and lingering of ownership moves.
    pub ownership: super::ownership::OwnershipTiming,
    /// The shortest time between two ownership passes; a pass runs only when its inputs
    /// changed or a fence or linger is due ([`super::ownership`]).
    pub ownership_tick: Duration,
    /// How long a pod the controller placed counts on its node before kube-scheduler binds it
    /// (its requests and host ports, `super::node_usage`); zero: until bound, deleted or
    /// placed again.
    pub assumed_pod_ttl: Duration,
    /// After this many rejections by kube-scheduler still remembered for one pod (filters the
    /// controller does not model), the pod is not placed again until they are forgotten; a
    /// Warning says so. Zero: no bound.
    pub max_node_rejections: u32,
    /// How often the fragmentation of each node pool, and the usage of each GPU, class and
    /// namespace, are measured for the metrics; zero: never.
    pub fragmentation_interval: Duration,
    /// Keep the `PreferNoSchedule` taint `gpu.kerf.dev/idle-gpus` on the nodes with an idle
    /// GPU (`super::idle_gpus_taint`); off: take it off where an earlier run left it.
    pub idle_gpus_taint: bool,
}

impl Default for ClaimSettings {
    fn default() -> Self {
        ClaimSettings {
            rejection_backoff: Duration::from_secs(5),
            rejection_backoff_max: Duration::from_secs(300),
            unplaceable_retry: Duration::from_secs(30),
            pending_retry: Duration::from_secs(2),
            ownership: super::ownership::OwnershipTiming::default(),
            ownership_tick: Duration::from_millis(500),
            assumed_pod_ttl: Duration::from_secs(300),
            max_node_rejections: 10,
            fragmentation_interval: Duration::from_secs(15),
            idle_gpus_taint: true,
        }
    }
}

/// What only the claim controller reads: the stores of pods and nodes (fed by its watches,
/// [`super::run`]), its bookkeeping, and its queue of claims to reconcile again. The claims
/// themselves are the shared caches' store ([`crate::cache::Caches::claims`]).
pub struct ClaimsPart {
    /// Every pod; its watch also triggers the pod's claims, after the store is updated.
    pub pods: Store<Pod>,
    /// The pods that use each claim, kept by the pod watch after the store and before the
    /// pod's claims are queued, so finding a claim's consumers does not walk every pod.
    pub(super) pods_by_claim: PodsByClaim,
    /// What the bound, nominated and assumed pods take of each node, kept by the pod and node
    /// watches after their stores ([`super::node_usage`]).
    pub(super) node_usage: NodeUsage,
    /// The pod kinds seen, for the LeastFragmentation policy ([`super::pod_kinds`]), kept by
    /// the pod watch and by placements.
    pub(super) pod_kinds: PodKinds,
    /// The pods seen waiting for their claims, for the pod allocation latency
    /// ([`super::pod_latency`]), kept by the pod and claim watches.
    pub(super) pod_latency: PodLatency,
    /// Every node.
    pub nodes: Store<Node>,
    /// Free capacity, writes in flight, rejections, claims waiting for capacity.
    ledger: Ledger,
    /// Reconciles other claims (those that must yield a device to the scheduler, those
    /// waiting for capacity).
    pub trigger: UnboundedSender<ObjectRef<ResourceClaim>>,
    /// One waiter at a time on the stores' readiness (see [`crate::cache::Caches::wait_ready`]).
    ready_waiters: tokio::sync::Mutex<()>,
    /// Bumped after each claim store write, after the pod and node writes an ownership pass
    /// reads, and by the ledger: the pass runs on it instead of on a clock
    /// ([`super::ownership::InputChanges`]).
    pub ownership_inputs: InputChanges,
    /// The nodes with an idle GPU that wants kerf's node taint, as the last ownership pass
    /// found them (`None` before the first): what `super::idle_gpus_taint` writes.
    pub(super) idle_gpu_nodes: tokio::sync::watch::Sender<Option<Arc<BTreeSet<String>>>>,
    /// Gate removals already sent, so a stale cached pod does not send another.
    pub(crate) released_gates: ReleasedGates,
    /// What feeds the stores and the queue, until the claim controller takes it.
    feeds: Mutex<Option<ClaimFeeds>>,
}

/// The writing ends of [`ClaimsPart`]'s stores and queue: taken once, by the claim controller
/// that runs the watches ([`ClaimsPart::take_feeds`]).
pub(super) struct ClaimFeeds {
    /// Writes [`ClaimsPart::pods`]; the index ([`ClaimsPart`]`::pods_by_claim`) must follow.
    pub pods: Writer<Pod>,
    /// Writes [`ClaimsPart::nodes`].
    pub nodes: Writer<Node>,
    /// What [`ClaimsPart::trigger`] sends.
    pub triggered: UnboundedReceiver<ObjectRef<ResourceClaim>>,
}

impl std::fmt::Debug for ClaimsPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimsPart")
            .field("pods", &self.pods.len())
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl Default for ClaimsPart {
    fn default() -> Self {
        Self::new()
    }
}

impl ClaimsPart {
    /// Empty stores and bookkeeping, with their feeds waiting for the claim controller.
    pub fn new() -> Self {
        let (pods, pod_writer) = reflector::store();
        let (nodes, node_writer) = reflector::store();
        let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
        let ownership_inputs = InputChanges::default();
        ClaimsPart {
            pods,
            pods_by_claim: PodsByClaim::default(),
            node_usage: NodeUsage::default(),
            pod_kinds: PodKinds::default(),
            pod_latency: PodLatency::default(),
            nodes,
            ledger: Ledger::new(ownership_inputs.clone()),
            trigger,
            ready_waiters: tokio::sync::Mutex::new(()),
            ownership_inputs,
            idle_gpu_nodes: tokio::sync::watch::Sender::new(None),
            released_gates: ReleasedGates::default(),
            feeds: Mutex::new(Some(ClaimFeeds {
                pods: pod_writer,
                nodes: node_writer,
                triggered,
            })),
        }
    }

    /// The feeds of the stores and the queue; `None` once taken: one claim controller per
    /// context.
    pub(super) fn take_feeds(&self) -> Option<ClaimFeeds> {
        self.feeds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Context {
    /// Waits until every store the claim reconciler reads holds its first complete list.
    ///
    /// # Errors
    /// [`Error::ControllerStopped`] when a store's watch was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "resourceclaim",
            message: "a watch stopped before its first list completed".to_owned(),
        };
        let _one_at_a_time = self.claims.ready_waiters.lock().await;
        // The claims are the store of the caches, whose waiters queue on their own lock.
        self.claims.pods.wait_until_ready().await.map_err(stopped)?;
        self.claims
            .nodes
            .wait_until_ready()
            .await
            .map_err(stopped)?;
        self.caches.wait_ready().await
    }

    /// Follows a pod watch event for the pod allocation latency (after the pod store).
    pub(super) fn note_pod_latency(&self, event: &kube::runtime::watcher::Event<Pod>) {
        let now = k8s_openapi::jiff::Timestamp::now();
        let latency = &self.claims.pod_latency;
        if let Some(waited) =
            latency.apply_pod_event(event, &self.caches.claims, self.driver(), now)
        {
            self.metrics.record_pod_allocation(waited);
        }
    }

    /// Observes the pods waiting for `claim` that it was the last claim of.
    pub(super) fn note_claim_latency(&self, claim: &ResourceClaim) {
        let allocated = claim
            .status
            .as_ref()
            .is_some_and(|s| s.allocation.is_some());
        if !allocated || self.claims.pod_latency.is_idle() {
            return;
        }
        let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        let pods = self
            .claims
            .pods_by_claim
            .consumers(&self.claims.pods, namespace, name);
        let now = k8s_openapi::jiff::Timestamp::now();
        let latency = &self.claims.pod_latency;
        for waited in latency.claim_changed(claim, pods, &self.caches.claims, self.driver(), now) {
            self.metrics.record_pod_allocation(waited);
        }
    }

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.config.driver_name
    }

    /// The bookkeeping, locked, with the capacity index brought up to date with the stores.
    pub(crate) fn books(&self) -> Books<'_> {
        // The claim watch notes each change in the ledger before passing it on: see
        // `Ledger::synced`.
        self.claims
            .ledger
            .synced(&self.caches.slices, &self.caches.claims, self.driver())
    }

    /// Notes a change of the claim store for the next [`Context::books`] (see
    /// `Ledger::note_claim`).
    pub(crate) fn note_claim(&self, change: &crate::cache::Change<ResourceClaim>) {
        self.claims.ledger.note_claim(change);
    }

    /// Marks claims `uids` as being written until the guard is dropped; `None` when another
    /// reconcile is writing one of them.
    pub(crate) fn begin_write(&self, uids: Vec<String>) -> Option<WriteGuard<'_>> {
        self.claims.ledger.begin(uids)
    }

    /// The kerf class parameters of DeviceClass `name`, when it carries them.
    pub fn class_params(&self, name: &str) -> Option<GpuClassParameters> {
        let class = self
            .caches
            .device_classes
            .get(&ObjectRef::<DeviceClass>::new(name))?;
        class_parameters(&class, self.driver())
    }

    /// True when a request of the claim uses a controller class of this driver.
    pub fn is_controller_claim(&self, claim: &ResourceClaim) -> bool {
        kerf_api::controller_claims::is_controller_claim(claim, |class| self.class_params(class))
    }

    /// The cached claim `name` in `namespace`.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<Arc<ResourceClaim>> {
        self.caches
            .claims
            .get(&ObjectRef::<ResourceClaim>::new(name).within(namespace))
    }

    /// Live pods in the claim's namespace that use it, oldest first; found through the pod
    /// index, so the cost follows the claim's pods, not the cluster's.
    pub fn consumers(&self, claim: &ResourceClaim) -> Vec<Arc<Pod>> {
        let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        self.claims
            .pods_by_claim
            .consumers(&self.claims.pods, namespace, name)
    }

    /// Marks `node` unsuitable for pod `pod_uid`: for [`ClaimSettings::rejection_backoff`]
    /// the first time, twice as long on each repeat, at most
    /// [`ClaimSettings::rejection_backoff_max`].
    pub(crate) fn mark_unsuitable(&self, pod_uid: &str, node: &str) {
        let (base, max) = (
            self.config.claims.rejection_backoff,
            self.config.claims.rejection_backoff_max,
        );
        self.claims
            .ledger
            .mark_unsuitable(pod_uid, node, Instant::now(), |repeats| {
                base.saturating_mul(1 << repeats.min(16)).min(max)
            });
    }

    /// Nodes currently unsuitable for pod `pod_uid`.
    pub(crate) fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        self.claims.ledger.unsuitable_nodes(pod_uid)
    }

    /// The rejections by kube-scheduler still remembered for pod `pod_uid`.
    pub(crate) fn rejections(&self, pod_uid: &str) -> u32 {
        self.claims.ledger.rejections(pod_uid)
    }

    /// True when devices the controller took over are still behind their ownership fence:
    /// placements that fail now may fit once they pass.
    pub(crate) fn capacity_settling(&self) -> bool {
        self.claims.ledger.settling()
    }

    /// Remembers that `claim` waits for capacity.
    pub(crate) fn wait_for_capacity(&self, claim: &ResourceClaim) {
        self.claims
            .ledger
            .wait_for_capacity(ObjectRef::from_obj(claim));
    }

    /// Capacity was freed: every waiting claim is reconciled again.
    pub(crate) fn capacity_freed(&self) {
        for claim in self.claims.ledger.take_waiting() {
            if self.claims.trigger.send(claim).is_err() {
                // The controller is stopping; nothing will be reconciled any more.
                return;
            }
        }
    }

    /// For an annotated claim without allocation: true (once) when the missing allocation is
    /// not the controller's doing, i.e. the scheduler cleared it.
    pub(crate) fn take_rejection(&self, uid: &str) -> bool {
        self.claims.ledger.take_rejection(uid)
    }
}
