//! Allocation latency as a pod sees it: from the pod's creation to the moment all its claims
//! are allocated (`kerf_controller_pod_allocation_duration_seconds`), whoever allocated them.
//!
//! A pod is measured only when this process saw it waiting: a pod seen with a claim not yet
//! allocated (or a template claim not yet created) is remembered, and observed once the pod
//! watch or the claim watch shows all its claims allocated. So a restarted or newly elected
//! controller does not count the pods that were allocated long before it started, and a pod
//! whose claims were all allocated before it was created (a shared claim) is not counted.
//! Only pods with at least one allocation result of kerf's driver are observed.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt as _;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use super::consumers;

/// `(namespace, pod name)`.
type PodKey = (String, String);

/// A pod seen waiting for its claims.
#[derive(Debug, Clone)]
struct Waiting {
    uid: String,
    created: Timestamp,
}

/// The pods seen waiting; see the module documentation.
#[derive(Debug, Default)]
pub(crate) struct PodLatency {
    waiting: Mutex<HashMap<PodKey, Waiting>>,
}

/// Whether a pod's claims are all allocated, and whether one holds a device of the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimsState {
    /// A claim is missing or unallocated.
    Waiting,
    /// All allocated; `true` when one has a result of the driver.
    Allocated(bool),
    /// The pod uses no claim.
    None,
}

impl PodLatency {
    /// Follows one event of the pod watch (after the claim store): a pod may start or end
    /// waiting. Returns the latency to observe, if the pod just got all its claims.
    pub(crate) fn apply_pod_event(
        &self,
        event: &watcher::Event<Pod>,
        claims: &Store<ResourceClaim>,
        driver: &str,
        now: Timestamp,
    ) -> Option<Duration> {
        match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => {
                self.check(pod, claims, driver, now)
            }
            watcher::Event::Delete(pod) => {
                self.lock().remove(&key(pod));
                None
            }
            watcher::Event::Init | watcher::Event::InitDone => None,
        }
    }

    /// Checks the waiting pods that use `claim` after the claim watch brought it.
    pub(crate) fn claim_changed(
        &self,
        claim: &ResourceClaim,
        pods: impl IntoIterator<Item = std::sync::Arc<Pod>>,
        claims: &Store<ResourceClaim>,
        driver: &str,
        now: Timestamp,
    ) -> Vec<Duration> {
        if claim.status.as_ref().is_none_or(|s| s.allocation.is_none()) {
            return Vec::new();
        }
        pods.into_iter()
            .filter(|pod| self.lock().contains_key(&key(pod)))
            .filter_map(|pod| self.check(&pod, claims, driver, now))
            .collect()
    }

    /// True while no pod is seen waiting: a claim change then has nothing to observe.
    pub(crate) fn is_idle(&self) -> bool {
        self.lock().is_empty()
    }

    fn check(
        &self,
        pod: &Pod,
        claims: &Store<ResourceClaim>,
        driver: &str,
        now: Timestamp,
    ) -> Option<Duration> {
        let key = key(pod);
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let state = if consumers::is_live(pod) {
            claims_state(pod, claims, driver)
        } else {
            ClaimsState::None
        };
        let mut waiting = self.lock();
        match state {
            ClaimsState::None => {
                waiting.remove(&key);
                None
            }
            ClaimsState::Waiting => {
                let created = pod.metadata.creation_timestamp.as_ref()?.0;
                // A pod of the same name created again waits from its own creation.
                let entry = waiting.entry(key).or_insert_with(|| Waiting {
                    uid: uid.clone(),
                    created,
                });
                if entry.uid != uid {
                    *entry = Waiting { uid, created };
                }
                None
            }
            ClaimsState::Allocated(ours) => {
                let seen = waiting.remove(&key).filter(|w| w.uid == uid)?;
                ours.then(|| {
                    Duration::try_from(seen.created.duration_until(now)).unwrap_or_default()
                })
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PodKey, Waiting>> {
        // Entries are inserted and removed whole; a panic elsewhere leaves the map usable.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn key(pod: &Pod) -> PodKey {
    (pod.namespace().unwrap_or_default(), pod.name_any())
}

fn claims_state(pod: &Pod, claims: &Store<ResourceClaim>, driver: &str) -> ClaimsState {
    let used = consumers::pod_claims(pod);
    if used.names.is_empty() && used.pending_templates.is_empty() {
        return ClaimsState::None;
    }
    if !used.pending_templates.is_empty() {
        return ClaimsState::Waiting;
    }
    let namespace = pod.namespace().unwrap_or_default();
    let mut ours = false;
    for name in &used.names {
        let claim = claims.get(&ObjectRef::new(name).within(&namespace));
        let Some(allocation) = claim
            .as_ref()
            .and_then(|c| c.status.as_ref())
            .and_then(|s| s.allocation.as_ref())
        else {
            return ClaimsState::Waiting;
        };
        ours |= allocation
            .devices
            .as_ref()
            .and_then(|d| d.results.as_ref())
            .is_some_and(|results| results.iter().any(|r| r.driver == driver));
    }
    ClaimsState::Allocated(ours)
}

#[cfg(test)]
#[path = "pod_latency_tests.rs"]
mod tests;
