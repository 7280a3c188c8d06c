//! The claim controller's context ([`ClaimsContext`]): the shared [`Context`] and what only the
//! claim controller keeps, with what its reconcilers ask of both.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use super::bookkeeping::{Bookkeeping, Books, WriteGuard};
use super::gate::ReleasedGates;
use super::node_usage::NodeUsage;
use super::ownership::InputChanges;
use super::pod_index::PodsByClaim;
use super::pod_kinds::PodKinds;
use super::pod_latency::PodLatency;
use crate::context::Context;
use crate::error::{Error, Result};

/// The claim controller's context: the shared [`Context`], and what only the claim controller
/// reads: the stores of pods and nodes (fed by its watches, [`super::run`]), its bookkeeping,
/// and its queue of claims to reconcile again. The claims themselves are the shared caches'
/// store ([`crate::cache::Caches::claims`]).
pub struct ClaimsContext {
    /// The client, configuration, caches and metrics every controller shares.
    pub core: Arc<Context>,
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
    bookkeeping: Bookkeeping,
    /// Reconciles other claims (those that must yield a device to the scheduler, those
    /// waiting for capacity).
    pub trigger: UnboundedSender<ObjectRef<ResourceClaim>>,
    /// One waiter at a time on the stores' readiness (see [`crate::cache::Caches::wait_ready`]).
    ready_waiters: tokio::sync::Mutex<()>,
    /// Bumped after each claim store write, after the pod and node writes an ownership pass
    /// reads, and by the bookkeeping: the pass runs on it instead of on a clock
    /// ([`super::ownership::InputChanges`]).
    pub ownership_inputs: InputChanges,
    /// The nodes with an idle GPU that wants kerf's node taint, as the last ownership pass
    /// found them (`None` before the first): what `super::idle_gpus_taint` writes.
    pub(super) idle_gpu_nodes: tokio::sync::watch::Sender<Option<Arc<BTreeSet<String>>>>,
    /// Gate removals already sent, so a stale cached pod does not send another.
    pub(crate) released_gates: ReleasedGates,
}

/// The writing ends of [`ClaimsContext`]'s stores and queue: taken once, by the claim controller
/// that runs the watches, from [`ClaimsContext::new`].
pub(super) struct ClaimFeeds {
    /// Writes [`ClaimsContext::pods`]; the index ([`ClaimsContext`]`::pods_by_claim`) must follow.
    pub pods: Writer<Pod>,
    /// Writes [`ClaimsContext::nodes`].
    pub nodes: Writer<Node>,
    /// What [`ClaimsContext::trigger`] sends.
    pub triggered: UnboundedReceiver<ObjectRef<ResourceClaim>>,
}

impl AsRef<Context> for ClaimsContext {
    fn as_ref(&self) -> &Context {
        &self.core
    }
}

impl std::fmt::Debug for ClaimsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimsContext")
            .field("pods", &self.pods.len())
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl ClaimsContext {
    /// The claim controller's context over `core` (empty stores and bookkeeping), and the
    /// feeds of its stores and queue.
    pub(super) fn new(core: Arc<Context>) -> (Self, ClaimFeeds) {
        let (pods, pod_writer) = reflector::store();
        let (nodes, node_writer) = reflector::store();
        let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
        let ownership_inputs = InputChanges::default();
        let context = ClaimsContext {
            core,
            pods,
            pods_by_claim: PodsByClaim::default(),
            node_usage: NodeUsage::default(),
            pod_kinds: PodKinds::default(),
            pod_latency: PodLatency::default(),
            nodes,
            bookkeeping: Bookkeeping::new(ownership_inputs.clone()),
            trigger,
            ready_waiters: tokio::sync::Mutex::new(()),
            ownership_inputs,
            idle_gpu_nodes: tokio::sync::watch::Sender::new(None),
            released_gates: ReleasedGates::default(),
        };
        let feeds = ClaimFeeds {
            pods: pod_writer,
            nodes: node_writer,
            triggered,
        };
        (context, feeds)
    }

    /// Waits until every store the claim reconciler reads holds its first complete list.
    ///
    /// # Errors
    /// [`Error::ControllerStopped`] when a store's watch was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "resourceclaim",
            message: "a watch stopped before its first list completed".to_owned(),
        };
        let _one_at_a_time = self.ready_waiters.lock().await;
        // The claims are the store of the caches, whose waiters queue on their own lock.
        self.pods.wait_until_ready().await.map_err(stopped)?;
        self.nodes.wait_until_ready().await.map_err(stopped)?;
        self.core.caches.wait_ready().await
    }

    /// Follows a pod watch event for the pod allocation latency (after the pod store).
    pub(super) fn note_pod_latency(&self, event: &kube::runtime::watcher::Event<Pod>) {
        let now = k8s_openapi::jiff::Timestamp::now();
        let latency = &self.pod_latency;
        if let Some(waited) =
            latency.apply_pod_event(event, &self.core.caches.claims, self.core.driver(), now)
        {
            self.core.metrics.record_pod_allocation(waited);
        }
    }

    /// Observes the pods waiting for `claim` that it was the last claim of.
    pub(super) fn note_claim_latency(&self, claim: &ResourceClaim) {
        let allocated = claim
            .status
            .as_ref()
            .is_some_and(|s| s.allocation.is_some());
        if !allocated || self.pod_latency.is_idle() {
            return;
        }
        let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        let pods = self.pods_by_claim.consumers(&self.pods, namespace, name);
        let now = k8s_openapi::jiff::Timestamp::now();
        let latency = &self.pod_latency;
        for waited in latency.claim_changed(
            claim,
            pods,
            &self.core.caches.claims,
            self.core.driver(),
            now,
        ) {
            self.core.metrics.record_pod_allocation(waited);
        }
    }

    /// The bookkeeping, locked, with the capacity index brought up to date with the stores.
    pub(crate) fn books(&self) -> Books<'_> {
        // The claim watch notes each change in the bookkeeping before passing it on: see
        // `Bookkeeping::synced`.
        self.bookkeeping.synced(
            &self.core.caches.slices,
            &self.core.caches.claims,
            self.core.driver(),
        )
    }

    /// Notes a change of the claim store for the next [`Context::books`] (see
    /// `Bookkeeping::note_claim`).
    pub(crate) fn note_claim(&self, change: &crate::cache::Change<ResourceClaim>) {
        self.bookkeeping.note_claim(change);
    }

    /// Marks claims `uids` as being written until the guard is dropped; `None` when another
    /// reconcile is writing one of them.
    pub(crate) fn begin_write(&self, uids: Vec<String>) -> Option<WriteGuard<'_>> {
        self.bookkeeping.begin(uids)
    }

    /// Live pods in the claim's namespace that use it, oldest first; found through the pod
    /// index, so the cost follows the claim's pods, not the cluster's.
    pub fn consumers(&self, claim: &ResourceClaim) -> Vec<Arc<Pod>> {
        let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        self.pods_by_claim.consumers(&self.pods, namespace, name)
    }

    /// Marks `node` unsuitable for pod `pod_uid`: for [`ClaimSettings::rejection_backoff`]
    /// the first time, twice as long on each repeat, at most
    /// [`ClaimSettings::rejection_backoff_max`].
    pub(crate) fn mark_unsuitable(&self, pod_uid: &str, node: &str) {
        let (base, max) = (
            self.core.config.claims.rejection_backoff,
            self.core.config.claims.rejection_backoff_max,
        );
        self.bookkeeping
            .mark_unsuitable(pod_uid, node, Instant::now(), |repeats| {
                base.saturating_mul(1 << repeats.min(16)).min(max)
            });
    }

    /// Nodes currently unsuitable for pod `pod_uid`.
    pub(crate) fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        self.bookkeeping.unsuitable_nodes(pod_uid)
    }

    /// The rejections by kube-scheduler still remembered for pod `pod_uid`.
    pub(crate) fn rejections(&self, pod_uid: &str) -> u32 {
        self.bookkeeping.rejections(pod_uid)
    }

    /// True when devices the controller took over are still behind their ownership fence:
    /// placements that fail now may fit once they pass.
    pub(crate) fn capacity_settling(&self) -> bool {
        self.bookkeeping.settling()
    }

    /// Remembers that `claim` waits for capacity.
    pub(crate) fn wait_for_capacity(&self, claim: &ResourceClaim) {
        self.bookkeeping
            .wait_for_capacity(ObjectRef::from_obj(claim));
    }

    /// Capacity was freed: every waiting claim is reconciled again.
    pub(crate) fn capacity_freed(&self) {
        for claim in self.bookkeeping.take_waiting() {
            if self.trigger.send(claim).is_err() {
                // The controller is stopping; nothing will be reconciled any more.
                return;
            }
        }
    }

    /// For an annotated claim without allocation: true (once) when the missing allocation is
    /// not the controller's doing, i.e. the scheduler cleared it.
    pub(crate) fn take_rejection(&self, uid: &str) -> bool {
        self.bookkeeping.take_rejection(uid)
    }
}
