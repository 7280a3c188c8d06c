//! Which cached pods use which claim: an index kept by the pod watch, so that finding a
//! claim's consumers costs the claim's pods, not every pod of the cluster.
//!
//! Without it every claim reconcile (and every ownership and report pass that asks for a
//! claim's pods) walked the whole pod store and resolved every pod's claims: at 1,000 pods
//! that was a thousand [`consumers::pod_claims`] per reconcile, the largest O(cluster) term
//! of the leader's CPU per pod (docs/performance.md, "Where the leader's CPU goes").
//!
//! The index follows the watch events exactly as kube-runtime's store does
//! (`kube-runtime` `reflector::store::Writer::apply_watcher_event`: `Apply` inserts,
//! `Delete` removes, `Init` starts a buffer that `InitApply` fills and `InitDone` swaps in),
//! and it is updated after the store and before the pod's claims are queued, so a reconcile
//! triggered by a pod finds that pod in the index.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use super::consumers;

type WatchItem = Result<watcher::Event<Pod>, watcher::Error>;

/// A claim or pod name within its namespace.
type Key = (String, String);

/// Both directions, so that a pod's update removes exactly the entries it had.
#[derive(Debug, Default)]
struct Entries {
    /// `(namespace, claim name)` → names of the pods that use it.
    pods_by_claim: HashMap<Key, BTreeSet<String>>,
    /// `(namespace, pod name)` → the claim names it uses.
    claims_by_pod: HashMap<Key, Vec<String>>,
}

impl Entries {
    fn insert(&mut self, pod: &Pod) {
        let namespace = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        self.remove(&namespace, &name);
        let claims = consumers::pod_claims(pod).names;
        if claims.is_empty() {
            return;
        }
        for claim in &claims {
            self.pods_by_claim
                .entry((namespace.clone(), claim.clone()))
                .or_default()
                .insert(name.clone());
        }
        self.claims_by_pod.insert((namespace, name), claims);
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        let Some(claims) = self
            .claims_by_pod
            .remove(&(namespace.to_owned(), name.to_owned()))
        else {
            return;
        };
        for claim in claims {
            let key = (namespace.to_owned(), claim);
            if let Some(pods) = self.pods_by_claim.get_mut(&key) {
                pods.remove(name);
                if pods.is_empty() {
                    self.pods_by_claim.remove(&key);
                }
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    current: Entries,
    /// Filled between `Init` and `InitDone` of a relist.
    buffer: Option<Entries>,
}

/// The pods that use each claim, by name; clones share the index.
#[derive(Debug, Clone, Default)]
pub(crate) struct PodsByClaim {
    state: Arc<RwLock<State>>,
}

impl PodsByClaim {
    /// Applies one event of the pod watch (what [`Self::updater`] does for each item).
    pub(crate) fn apply(&self, event: &watcher::Event<Pod>) {
        let mut state = self.state.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Apply(pod) => state.current.insert(pod),
            watcher::Event::Delete(pod) => state
                .current
                .remove(&pod.namespace().unwrap_or_default(), &pod.name_any()),
            watcher::Event::Init => state.buffer = Some(Entries::default()),
            watcher::Event::InitApply(pod) => state.buffer.get_or_insert_default().insert(pod),
            watcher::Event::InitDone => {
                state.current = state.buffer.take().unwrap_or_default();
            }
        }
    }

    /// For `inspect` on the pod watch, after its reflector: keeps the index in step with
    /// the store. Watch errors change nothing (the watcher retries and relists).
    pub(crate) fn updater(&self) -> impl FnMut(&WatchItem) + Send + 'static {
        let index = self.clone();
        move |item| {
            if let Ok(event) = item {
                index.apply(event);
            }
        }
    }

    /// Names of the pods in `namespace` that use claim `claim`.
    pub(crate) fn pods_using(&self, namespace: &str, claim: &str) -> Vec<String> {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        state
            .current
            .pods_by_claim
            .get(&(namespace.to_owned(), claim.to_owned()))
            .map(|pods| pods.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Live pods of `pods` that use claim `claim` in `namespace`, oldest first: the index
    /// names the candidates, the store's current version of each decides.
    pub(crate) fn consumers(
        &self,
        pods: &Store<Pod>,
        namespace: &str,
        claim: &str,
    ) -> Vec<Arc<Pod>> {
        let mut found: Vec<Arc<Pod>> = self
            .pods_using(namespace, claim)
            .into_iter()
            .filter_map(|name| pods.get(&ObjectRef::new(&name).within(namespace)))
            .filter(|p| consumers::is_live(p) && consumers::uses_claim(p, claim))
            .collect();
        // Oldest first, so the same pod is picked on every reconcile.
        found.sort_by(|a, b| {
            (
                a.metadata.creation_timestamp.as_ref().map(|t| t.0),
                &a.metadata.name,
            )
                .cmp(&(
                    b.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    &b.metadata.name,
                ))
        });
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector;
    use serde_json::json;

    fn pod(name: &str, claims: &[&str]) -> Pod {
        let refs: Vec<_> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"name": format!("c{i}"), "resourceClaimName": c}))
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"containers": [], "resourceClaims": refs}
        }))
        .unwrap()
    }

    #[test]
    fn follows_apply_update_delete() {
        let index = PodsByClaim::default();
        index.apply(&watcher::Event::Apply(pod("a", &["x", "y"])));
        index.apply(&watcher::Event::Apply(pod("b", &["x"])));
        assert_eq!(index.pods_using("ns", "x"), ["a", "b"]);
        assert_eq!(index.pods_using("ns", "y"), ["a"]);
        assert!(index.pods_using("other", "x").is_empty());
        // An update replaces the pod's entries.
        index.apply(&watcher::Event::Apply(pod("a", &["z"])));
        assert_eq!(index.pods_using("ns", "x"), ["b"]);
        assert!(index.pods_using("ns", "y").is_empty());
        assert_eq!(index.pods_using("ns", "z"), ["a"]);
        index.apply(&watcher::Event::Delete(pod("b", &["x"])));
        assert!(index.pods_using("ns", "x").is_empty());
    }

    #[test]
    fn a_relist_replaces_the_index_when_done() {
        let index = PodsByClaim::default();
        index.apply(&watcher::Event::Apply(pod("gone", &["x"])));
        index.apply(&watcher::Event::Init);
        index.apply(&watcher::Event::InitApply(pod("new", &["x"])));
        // Until InitDone the store still holds the old list, and so does the index.
        assert_eq!(index.pods_using("ns", "x"), ["gone"]);
        index.apply(&watcher::Event::InitDone);
        assert_eq!(index.pods_using("ns", "x"), ["new"]);
    }

    /// The complexity probe: consumers are found through the index only. A pod the store
    /// holds but the index was never told of is not found, which a scan of the store would
    /// find; the 1,000 other pods of the store are not looked at.
    #[test]
    fn consumers_read_the_index_not_the_whole_store() {
        let (store, mut writer) = reflector::store::<Pod>();
        let index = PodsByClaim::default();
        for i in 0..1000 {
            let claim = format!("claim{i}");
            let p = pod(&format!("p{i}"), &[claim.as_str()]);
            writer.apply_watcher_event(&watcher::Event::Apply(p.clone()));
            index.apply(&watcher::Event::Apply(p));
        }
        let unindexed = pod("unindexed", &["claim7"]);
        writer.apply_watcher_event(&watcher::Event::Apply(unindexed));
        let found = index.consumers(&store, "ns", "claim7");
        let names: Vec<_> = found.iter().map(|p| p.name_any()).collect();
        assert_eq!(names, ["p7"]);
    }

    #[test]
    fn the_store_decides_liveness() {
        let (store, mut writer) = reflector::store::<Pod>();
        let index = PodsByClaim::default();
        let p = pod("a", &["x"]);
        index.apply(&watcher::Event::Apply(p.clone()));
        let mut done = p;
        done.status = Some(k8s_openapi::api::core::v1::PodStatus {
            phase: Some("Succeeded".to_owned()),
            ..Default::default()
        });
        writer.apply_watcher_event(&watcher::Event::Apply(done));
        assert!(index.consumers(&store, "ns", "x").is_empty());
    }
}
