//! What the claim reconciler needs besides the shared [`Context`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::{Allocator, GpuClassParameters, OpaqueConfig};
use kube::runtime::reflector::{ObjectRef, Store};

use super::consumers;
use super::index::CapacityIndex;
use crate::context::Context;

/// Timing of the claim reconciler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimSettings {
    /// How long a node the scheduler rejected stays unsuitable for that pod.
    pub unsuitable_for: Duration,
    /// When to try again after nothing fitted.
    pub unplaceable_retry: Duration,
    /// When to look again at a pod whose template claims do not exist yet.
    pub pending_retry: Duration,
}

impl Default for ClaimSettings {
    fn default() -> Self {
        ClaimSettings {
            unsuitable_for: Duration::from_secs(300),
            unplaceable_retry: Duration::from_secs(30),
            pending_retry: Duration::from_secs(2),
        }
    }
}

/// State of the claim reconciler.
pub struct ClaimsContext {
    /// Client, config, metrics, recorder and the caches of slices, claims and DeviceClasses.
    pub base: Arc<Context>,
    /// Every pod.
    pub pods: Store<Pod>,
    /// Every node.
    pub nodes: Store<Node>,
    /// Free capacity per GPU.
    pub capacity: Mutex<CapacityIndex>,
    /// Nodes the scheduler rejected, per pod UID, until when.
    pub unsuitable: Mutex<HashMap<String, HashMap<String, Instant>>>,
    /// Timing.
    pub settings: ClaimSettings,
}

impl ClaimsContext {
    /// Builds the context.
    pub fn new(
        base: Arc<Context>,
        pods: Store<Pod>,
        nodes: Store<Node>,
        settings: ClaimSettings,
    ) -> Self {
        ClaimsContext {
            base,
            pods,
            nodes,
            capacity: Mutex::new(CapacityIndex::default()),
            unsuitable: Mutex::new(HashMap::new()),
            settings,
        }
    }

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.base.config.driver_name
    }

    /// The capacity index, brought up to date with the caches.
    pub fn capacity(&self) -> MutexGuard<'_, CapacityIndex> {
        let mut capacity = self.capacity.lock().unwrap_or_else(PoisonError::into_inner);
        let slices = self.base.caches.slices.state();
        let claims = self.base.caches.claims.state();
        capacity.sync(&slices, &claims, self.driver(), Instant::now());
        capacity
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
        claim
            .spec
            .devices
            .as_ref()
            .and_then(|d| d.requests.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|r| r.exactly.as_ref())
            .any(|r| {
                self.class_params(&r.device_class_name)
                    .is_some_and(|p| p.allocator == Allocator::Controller)
            })
    }

    /// Live pods in the claim's namespace that use it.
    pub fn consumers(&self, claim: &ResourceClaim) -> Vec<Arc<Pod>> {
        let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
        let name = claim.metadata.name.as_deref().unwrap_or_default();
        let mut pods: Vec<Arc<Pod>> = self
            .pods
            .state()
            .into_iter()
            .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
            .filter(|p| consumers::is_live(p) && consumers::uses_claim(p, name))
            .collect();
        // Oldest first, so the same pod is picked on every reconcile.
        pods.sort_by(|a, b| {
            (
                a.metadata.creation_timestamp.as_ref().map(|t| t.0),
                &a.metadata.name,
            )
                .cmp(&(
                    b.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    &b.metadata.name,
                ))
        });
        pods
    }

    /// Marks `node` unsuitable for `pod_uid` for [`ClaimSettings::unsuitable_for`].
    pub fn mark_unsuitable(&self, pod_uid: &str, node: &str) {
        let until = Instant::now() + self.settings.unsuitable_for;
        let mut map = self
            .unsuitable
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        map.entry(pod_uid.to_owned())
            .or_default()
            .insert(node.to_owned(), until);
    }

    /// Nodes currently unsuitable for `pod_uid`.
    pub fn unsuitable_nodes(&self, pod_uid: &str) -> Vec<String> {
        let now = Instant::now();
        let mut map = self
            .unsuitable
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(nodes) = map.get_mut(pod_uid) else {
            return Vec::new();
        };
        nodes.retain(|_, until| *until > now);
        let out = nodes.keys().cloned().collect();
        if nodes.is_empty() {
            map.remove(pod_uid);
        }
        out
    }
}

/// The kerf class parameters a DeviceClass carries for `driver`, if any (the last wins).
pub fn class_parameters(class: &DeviceClass, driver: &str) -> Option<GpuClassParameters> {
    class
        .spec
        .config
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.opaque.as_ref())
        .filter(|o| o.driver == driver)
        .filter_map(|o| {
            match kerf_api::decode_opaque(&o.parameters.0, "spec.config[].opaque.parameters") {
                Ok(OpaqueConfig::Class(params)) => Some(params),
                _ => None,
            }
        })
        .next_back()
}
