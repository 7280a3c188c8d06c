//! When the ownership pass has to run again: something it reads changed, or a moment it
//! computed has come.
//!
//! The pass reads the published slices, the claims, the DeviceClasses (the shared caches, whose
//! own change counter [`crate::cache::Caches::changes`] is forwarded here), the claims, pods
//! and nodes of the claim controller's watches (bumped by `watch.rs` after the store write: on
//! every claim event, which [`crate::claims::bookkeeping`]'s sync relies on, and on the node and pod
//! events that change what a pass reads, see [`InputChanges::node_bumper`] and
//! [`InputChanges::pod_bumper`]), and the bookkeeping's allocations in flight and claims waiting for
//! capacity (bumped by `bookkeeping.rs` on each change). What changes with time alone is
//! computed by the pass itself ([`super::DeviceOwnership::next_due`], the expiry of an assumed
//! allocation, a node write in back-off). With nothing changing, nothing runs.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash as _, Hasher as _};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use kerf_api::ownership::RECORD_ANNOTATION;
use kerf_api::shared_publication::SHARED_PUBLICATION_ANNOTATION;
use kube::ResourceExt as _;
use kube::runtime::watcher;
use tokio::sync::watch;

/// An item of a reflector's stream.
type WatchItem<K> = Result<watcher::Event<K>, watcher::Error>;

/// A counter of changes to what the ownership pass reads, coalesced: a burst of changes while
/// the pass runs or waits wakes it once. Clones bump and watch the same counter.
#[derive(Debug, Clone)]
pub struct InputChanges(Arc<watch::Sender<u64>>);

impl Default for InputChanges {
    fn default() -> Self {
        InputChanges(Arc::new(watch::Sender::new(0)))
    }
}

impl InputChanges {
    /// Something the pass reads changed. Call it after the change is visible to readers (after
    /// the store write, under or after the bookkeeping change), so that a pass woken by it sees the
    /// change.
    pub fn bump(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The counter now. Read it before reading what it counts: a change after the read bumps
    /// it past the value read.
    pub fn version(&self) -> u64 {
        *self.0.borrow()
    }

    /// A closure for the node watch stream's `inspect`, placed after the reflector (so the
    /// store holds the event when the counter moves), bumping only when what a pass reads of a
    /// Node changed: its labels (policy, node selectors), kerf's record and shared publication
    /// annotations, `unschedulable`, taints and the Ready condition's status. A kubelet's status
    /// heartbeat (every node, every few minutes) changes none of these, and at 500 nodes would
    /// otherwise wake a pass every second on an idle cluster.
    pub(crate) fn node_bumper(&self) -> impl FnMut(&WatchItem<Node>) + Send + 'static {
        let changes = self.clone();
        let mut seen: HashMap<String, u64> = HashMap::new();
        move |item| {
            let changed = match item {
                Ok(watcher::Event::Apply(node)) => {
                    let fingerprint = node_fingerprint(node);
                    seen.insert(node.name_any(), fingerprint) != Some(fingerprint)
                }
                Ok(watcher::Event::InitApply(node)) => {
                    seen.insert(node.name_any(), node_fingerprint(node));
                    false
                }
                Ok(watcher::Event::Delete(node)) => {
                    seen.remove(&node.name_any());
                    true
                }
                // The store holds the relist from now on: nodes may be gone or changed.
                Ok(watcher::Event::InitDone) => true,
                Ok(watcher::Event::Init) | Err(_) => false,
            };
            if changed {
                changes.bump();
            }
        }
    }

    /// A closure for the pod watch stream's `inspect`, placed after the reflector, bumping only
    /// for pods a pass reads: those
    /// not bound to a node yet (pending demand), and a pod's leaving that set (bound or
    /// deleted). Bound pods' status updates, and every other workload of the cluster once
    /// running, wake nothing.
    pub(crate) fn pod_bumper(&self) -> impl FnMut(&WatchItem<Pod>) + Send + 'static {
        let changes = self.clone();
        let mut unbound: HashSet<(String, String)> = HashSet::new();
        move |item| {
            let changed = match item {
                Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                    let key = (pod.namespace().unwrap_or_default(), pod.name_any());
                    let was = if is_unbound(pod) {
                        !unbound.insert(key)
                    } else {
                        unbound.remove(&key)
                    };
                    let listed = matches!(item, Ok(watcher::Event::InitApply(_)));
                    !listed && (was || is_unbound(pod))
                }
                Ok(watcher::Event::Delete(pod)) => {
                    unbound.remove(&(pod.namespace().unwrap_or_default(), pod.name_any()))
                }
                Ok(watcher::Event::InitDone) => true,
                Ok(watcher::Event::Init) | Err(_) => false,
            };
            if changed {
                changes.bump();
            }
        }
    }

    /// A receiver that is told of every bump from now on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// Not bound to a node: the only pods the pass's demand reads.
fn is_unbound(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_none()
}

/// A hash of what a pass reads of `node` (see [`InputChanges::node_bumper`]).
fn node_fingerprint(node: &Node) -> u64 {
    let annotations = node.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key));
    let spec = node.spec.as_ref();
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.as_str());
    let taints = spec.and_then(|s| s.taints.as_ref()).map(|taints| {
        taints
            .iter()
            .map(|t| (&t.key, &t.value, &t.effect))
            .collect::<Vec<_>>()
    });
    let mut hasher = DefaultHasher::new();
    (
        &node.metadata.labels,
        annotation(RECORD_ANNOTATION),
        annotation(SHARED_PUBLICATION_ANNOTATION),
        spec.and_then(|s| s.unschedulable),
        taints,
        ready,
    )
        .hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;
    use serde_json::json;

    #[tokio::test]
    async fn a_burst_of_bumps_is_one_wake_and_a_quiet_counter_none() {
        let changes = InputChanges::default();
        let mut seen = changes.subscribe();
        assert!(seen.changed().now_or_never().is_none(), "nothing changed");
        let bumper = changes.clone();
        for _ in 0..5 {
            bumper.bump();
        }
        assert!(matches!(seen.changed().now_or_never(), Some(Ok(()))));
        assert!(
            seen.changed().now_or_never().is_none(),
            "five bumps before the wake make one"
        );
    }

    fn node(labels: &serde_json::Value, heartbeat: &str, ready: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "labels": labels},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}]},
        }))
        .unwrap()
    }

    #[allow(
        clippy::unnecessary_wraps,
        reason = "the item type of the watch stream"
    )]
    fn apply<K>(object: K) -> WatchItem<K> {
        Ok(watcher::Event::Apply(object))
    }

    #[test]
    fn a_node_heartbeat_wakes_no_pass_and_a_label_or_readiness_change_does() {
        let changes = InputChanges::default();
        let mut seen = changes.subscribe();
        let mut bump = changes.node_bumper();
        let mut step = |item: WatchItem<Node>| {
            bump(&item);
            let bumped = seen.has_changed().unwrap();
            seen.mark_unchanged();
            bumped
        };
        let labels = json!({"gpu.kerf.dev/allocator": "dynamic"});
        let at = |s: u32| format!("2026-01-01T00:{s:02}:00Z");
        assert!(step(apply(node(&labels, &at(0), "True"))), "a new node");
        assert!(!step(apply(node(&labels, &at(5), "True"))), "a heartbeat");
        assert!(step(apply(node(&labels, &at(5), "False"))));
        let pinned = json!({"gpu.kerf.dev/allocator": "scheduler"});
        assert!(step(apply(node(&pinned, &at(6), "False"))));
        assert!(step(Ok(watcher::Event::Delete(node(
            &pinned,
            &at(6),
            "False"
        )))));
        assert!(step(Ok(watcher::Event::InitDone)), "a relist");
    }

    fn pod(name: &str, node: Option<&str>, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"containers": [], "nodeName": node},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn only_unbound_pods_and_their_binding_or_deletion_wake_a_pass() {
        let changes = InputChanges::default();
        let mut seen = changes.subscribe();
        let mut bump = changes.pod_bumper();
        let mut step = |item: WatchItem<Pod>| {
            bump(&item);
            let bumped = seen.has_changed().unwrap();
            seen.mark_unchanged();
            bumped
        };
        assert!(step(apply(pod("p", None, "Pending"))), "a pending pod");
        assert!(step(apply(pod("p", Some("n1"), "Pending"))), "bound");
        assert!(
            !step(apply(pod("p", Some("n1"), "Running"))),
            "a bound pod's status"
        );
        assert!(
            !step(apply(pod("elsewhere", Some("n2"), "Running"))),
            "created bound"
        );
        assert!(!step(Ok(watcher::Event::Delete(pod(
            "p",
            Some("n1"),
            "Running"
        )))));
        assert!(step(apply(pod("q", None, "Pending"))));
        assert!(
            step(Ok(watcher::Event::Delete(pod("q", None, "Pending")))),
            "a pending pod deleted"
        );
    }
}
