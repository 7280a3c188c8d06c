//! What the claim reconciler needs besides the shared [`Context`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::GpuClassParameters;
use kerf_api::controller_claims::class_parameters;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc::UnboundedSender;

use super::ledger::{Books, Ledger, WriteGuard};
use super::pod_index::PodsByClaim;
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
        }
    }
}

/// State of the claim reconciler.
pub struct ClaimsContext {
    /// Client, config, metrics, recorder and the caches of slices and DeviceClasses.
    pub base: Arc<Context>,
    /// Every ResourceClaim: the store the reconciler is fed from, so that the capacity index
    /// and the pod's other claims are never older than the claim being reconciled.
    pub claims: Store<ResourceClaim>,
    /// Every pod; its watch also triggers the pod's claims, after the store is updated.
    pub pods: Store<Pod>,
    /// The pods that use each claim, kept by the pod watch after the store and before the
    /// pod's claims are queued, so finding a claim's consumers does not walk every pod.
    pods_by_claim: PodsByClaim,
    /// Every node.
    pub nodes: Store<Node>,
    /// Free capacity, writes in flight, rejections, claims waiting for capacity.
    ledger: Ledger,
    /// Reconciles other claims (those that must yield a device to the scheduler, those
    /// waiting for capacity).
    pub trigger: UnboundedSender<ObjectRef<ResourceClaim>>,
    /// Timing.
    pub settings: ClaimSettings,
    /// One waiter at a time on the stores' readiness (see [`crate::cache::Caches::wait_ready`]).
    ready_waiters: tokio::sync::Mutex<()>,
    /// Bumped after each claim store write, after the pod and node writes an ownership pass
    /// reads, and by the ledger: the pass runs on it instead of on a clock
    /// ([`super::ownership::InputChanges`]).
    pub ownership_inputs: super::ownership::InputChanges,
    /// Gate removals already sent, so a stale cached pod does not send another.
    pub(crate) released_gates: super::gate::ReleasedGates,
}

impl std::fmt::Debug for ClaimsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimsContext")
            .field("claims", &self.claims.len())
            .field("pods", &self.pods.len())
            .field("nodes", &self.nodes.len())
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ClaimsContext {
    /// Builds the context; `ownership_inputs` must be bumped after each write to the stores,
    /// and the pod index (`pods.1`) updated after each write to the pod store (`pods.0`).
    pub fn new(
        base: Arc<Context>,
        claims: Store<ResourceClaim>,
        pods: (Store<Pod>, PodsByClaim),
        nodes: Store<Node>,
        ownership_inputs: super::ownership::InputChanges,
        trigger: UnboundedSender<ObjectRef<ResourceClaim>>,
        settings: ClaimSettings,
    ) -> Self {
        ClaimsContext {
            base,
            claims,
            pods: pods.0,
            pods_by_claim: pods.1,
            nodes,
            ledger: Ledger::new(ownership_inputs.clone()),
            released_gates: super::gate::ReleasedGates::default(),
            trigger,
            settings,
            ready_waiters: tokio::sync::Mutex::new(()),
            ownership_inputs,
        }
    }

    /// Waits until every store the reconciler reads holds its first complete list.
    ///
    /// # Errors
    /// [`Error::ControllerStopped`] when a store's watch was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "resourceclaim",
            message: "a watch stopped before its first list completed".to_owned(),
        };
        let _one_at_a_time = self.ready_waiters.lock().await;
        // `claims` is the store of the caches, whose waiters queue on their own lock.
        self.pods.wait_until_ready().await.map_err(stopped)?;
        self.nodes.wait_until_ready().await.map_err(stopped)?;
        self.base.caches.wait_ready().await
    }

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.base.config.driver_name
    }

    /// The bookkeeping, locked, with the capacity index brought up to date with the stores.
    pub(crate) fn books(&self) -> Books<'_> {
        // `claims` is bumped into `ownership_inputs` after each write: see `Ledger::synced`.
        self.ledger
            .synced(&self.base.caches.slices, &self.claims, self.driver())
    }

    /// Marks claims `uids` as being written until the guard is dropped; `None` when another
    /// reconcile is writing one of them.
    pub(crate) fn begin_write(&self, uids: Vec<String>) -> Option<WriteGuard<'_>> {
        self.ledger.begin(uids)
    }

    /// The kerf class parameters of DeviceClass `name`, when it carries them.
    pub fn class_params(&self, name: &str) -> Option<GpuClassParameters> {
        let class = self
            .base
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
        self.claims
            .get(&ObjectRef::<ResourceClaim>::new(name).within(namespace))
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
    pub fn mark_unsuitable(&self, pod_uid: &str, node: &str) {
        let (base, max) = (
            self.settings.rejection_backoff,
            self.settings.rejection_backoff_max,
        );
        self.ledger
            .mark_unsuitable(pod_uid, node, Instant::now(), |repeats| {
                base.saturating_mul(1 << repeats.min(16)).min(max)
            });
    }

    /// Nodes currently unsuitable for pod `pod_uid`.
    pub fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        self.ledger.unsuitable_nodes(pod_uid)
    }

    /// True when devices the controller took over are still behind their ownership fence:
    /// placements that fail now may fit once they pass.
    pub fn capacity_settling(&self) -> bool {
        self.ledger.settling()
    }

    /// Remembers that `claim` waits for capacity.
    pub fn wait_for_capacity(&self, claim: &ResourceClaim) {
        self.ledger.wait_for_capacity(ObjectRef::from_obj(claim));
    }

    /// Capacity was freed: every waiting claim is reconciled again.
    pub fn capacity_freed(&self) {
        for claim in self.ledger.take_waiting() {
            if self.trigger.send(claim).is_err() {
                // The controller is stopping; nothing will be reconciled any more.
                return;
            }
        }
    }

    /// For an annotated claim without allocation: true (once) when the missing allocation is
    /// not the controller's doing, i.e. the scheduler cleared it.
    pub fn take_rejection(&self, uid: &str) -> bool {
        self.ledger.take_rejection(uid)
    }
}
