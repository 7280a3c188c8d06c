//! The pod kinds the cluster runs, learned online, for the LeastFragmentation policy
//! (`kerf_core::alloc::Workload`): each pod counts once, when the controller first places
//! its claims, or, for a pod without claims, when the pod watch first shows it.
//!
//! Pods without claims are counted because kube-scheduler places them by its default
//! scoring, on the nodes with the most free CPU and memory: the policy steers GPU pods so
//! that those pods strand fewer GPUs, and it needs their CPU and memory to do so. Pods with
//! claims that another allocator handles (kube-scheduler's classes) are not counted: their
//! GPU part is not kerf-controller's to place.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::core::v1::Pod;
use kerf_api::pod_resources::pod_resource_requests;
use kerf_core::alloc::{Distribution, HostAmounts, PodRequest, TaskShape, Workload};
use kube::runtime::watcher;

use super::state::pod_uid;

/// The learned workload and the pods already counted in it.
#[derive(Debug, Default)]
pub(crate) struct PodKinds {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    workload: Workload,
    /// UIDs of the pods counted, until the pod is deleted.
    counted: HashSet<String>,
    /// A pod relist in progress: every UID listed, to forget the pods deleted meanwhile.
    relist: Option<HashSet<String>>,
    /// The workload's distribution as last handed out: shared until it is rebuilt.
    shared: Arc<Distribution>,
}

impl Inner {
    /// The workload's current distribution, shared.
    fn distribution(&mut self) -> Arc<Distribution> {
        let current = self.workload.distribution();
        if current.version() != self.shared.version() {
            self.shared = Arc::new(current.clone());
        }
        Arc::clone(&self.shared)
    }
}

impl PodKinds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A histogram is meaningful whatever panicked while it was locked.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts pod `uid`, asking `request` of GPUs and `host` of its node, unless it was
    /// counted before (a pod placed again after a rejection counts once); returns the
    /// distribution to place it by.
    pub(crate) fn placing(
        &self,
        uid: Option<&str>,
        request: &PodRequest,
        host: HostAmounts,
    ) -> Arc<Distribution> {
        let mut inner = self.lock();
        if let Some(uid) = uid
            && inner.counted.insert(uid.to_owned())
        {
            inner.workload.observe(TaskShape::of(request, host));
        }
        inner.distribution()
    }

    /// The current distribution, for measuring fragmentation.
    pub(crate) fn distribution(&self) -> Arc<Distribution> {
        self.lock().distribution()
    }

    /// Applies one event of the pod watch: a pod without claims, not terminated, counts when
    /// first seen; a deleted pod is forgotten.
    pub(crate) fn apply_pod_event(&self, event: &watcher::Event<Pod>) {
        let mut inner = self.lock();
        match event {
            watcher::Event::Apply(pod) => inner.see(pod),
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod_uid(pod) {
                    inner.counted.remove(uid);
                }
            }
            watcher::Event::Init => inner.relist = Some(HashSet::new()),
            watcher::Event::InitApply(pod) => {
                if let Some(uid) = pod_uid(pod) {
                    inner.relist.get_or_insert_default().insert(uid.to_owned());
                }
                inner.see(pod);
            }
            watcher::Event::InitDone => {
                if let Some(listed) = inner.relist.take() {
                    inner.counted.retain(|uid| listed.contains(uid));
                }
            }
        }
    }
}

impl Inner {
    fn see(&mut self, pod: &Pod) {
        let Some(uid) = pod_uid(pod) else { return };
        let has_claims = pod
            .spec
            .as_ref()
            .and_then(|spec| spec.resource_claims.as_ref())
            .is_some_and(|claims| !claims.is_empty());
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if has_claims || matches!(phase, Some("Succeeded" | "Failed")) {
            return;
        }
        if self.counted.insert(uid.to_owned()) {
            self.workload.observe(TaskShape {
                host: host_amounts_of(pod),
                ..TaskShape::default()
            });
        }
    }
}

/// What `pod` requests of its node's CPU and memory (upstream `PodRequests`).
pub(crate) fn host_amounts_of(pod: &Pod) -> HostAmounts {
    let requests = pod_resource_requests(pod);
    HostAmounts {
        milli_cpu: requests.milli_cpu,
        memory: requests.memory,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, cpu: &str, claims: bool) -> Pod {
        let mut pod = json!({
            "metadata": {"name": uid, "namespace": "default", "uid": uid},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
        });
        if claims {
            pod["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "c"}]);
        }
        serde_json::from_value(pod).unwrap()
    }

    #[test]
    fn pods_without_claims_count_once_and_pods_with_claims_not_from_the_watch() {
        let kinds = PodKinds::default();
        let cpu_pod = pod("a", "2", false);
        kinds.apply_pod_event(&watcher::Event::Apply(cpu_pod.clone()));
        kinds.apply_pod_event(&watcher::Event::Apply(cpu_pod));
        kinds.apply_pod_event(&watcher::Event::Apply(pod("b", "4", true)));
        let inner = kinds.lock();
        assert_eq!(inner.workload.seen(), 1);
        assert!(inner.counted.contains("a"));
    }

    #[test]
    fn a_placed_pod_counts_once_and_a_relist_forgets_the_pods_gone() {
        let kinds = PodKinds::default();
        let request = PodRequest::default();
        let host = HostAmounts {
            milli_cpu: 1000,
            memory: 1 << 30,
        };
        kinds.placing(Some("p"), &request, host);
        kinds.placing(Some("p"), &request, host);
        assert_eq!(kinds.lock().workload.seen(), 1);
        assert!(!kinds.distribution().is_empty());

        kinds.apply_pod_event(&watcher::Event::Init);
        kinds.apply_pod_event(&watcher::Event::InitApply(pod("q", "1", false)));
        kinds.apply_pod_event(&watcher::Event::InitDone);
        let inner = kinds.lock();
        assert!(!inner.counted.contains("p"), "p was not listed again");
        assert!(inner.counted.contains("q"));
    }
}
