//! What the pods on each node take of its allocatable, kept as kube-scheduler's cache keeps
//! it, so that the controller never places a pod's claims on a node the pod does not fit.
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/backend/cache/cache.go` and
//! `pkg/scheduler/framework/types.go` (`NodeInfo`: `Allocatable`, `Requested`, `Pods`,
//! `UsedPorts`). A node's books are its `status.allocatable` (node watch) and the requests and
//! host ports of:
//! - the pods bound to it (`spec.nodeName`) that have not terminated: kube-scheduler's pod
//!   informer leaves out phases Succeeded and Failed (`scheduler.go`, `newPodInformer`); pods
//!   being deleted still count until they are gone;
//! - the pods nominated to it (`status.nominatedNodeName`, unbound): counted only against pods
//!   of the same or lower priority, as `framework.addNominatedPods` adds them;
//! - the pods whose claims kerf-controller placed there and kube-scheduler has not bound yet
//!   (assumed, as the scheduler assumes a pod between its decision and the binding): dropped
//!   when the pod shows up bound or is deleted, when the controller clears its placement, or
//!   after a time to live (`--assumed-pod-ttl`; kube-scheduler's own never expire since
//!   kubernetes#106361 because it learns every binding's outcome, the controller does not).
//!
//! It is kept incrementally, by the pod and node watch events in the order kube-runtime's
//! stores apply them (`Init` … `InitDone` replaces everything at a relist), so a placement
//! costs a lookup per candidate node, not a walk over the pods ([`fit`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kerf_api::pod_resources::{host_ports, node_allocatable, pod_resource_requests, priority};
use kerf_core::alloc::node_fit::{HostPort, HostPorts, NodeResources, Resources};
use kube::runtime::watcher;

pub(crate) mod fit;

pub(crate) use fit::PodFit;

/// How a counted pod is tied to its node.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tie {
    /// `spec.nodeName`.
    Bound,
    /// `status.nominatedNodeName`, with the pod's priority.
    Nominated(i32),
}

/// A pod the books count, and what it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counted {
    node: String,
    tie: Tie,
    requests: Resources,
    ports: Vec<HostPort>,
}

/// A pod the controller placed and kube-scheduler has not bound yet.
#[derive(Debug, Clone)]
struct Assumed {
    node: String,
    requests: Resources,
    ports: Vec<HostPort>,
    expires: Option<Instant>,
}

/// One node's books.
#[derive(Debug, Clone, Default)]
struct NodeBooks {
    /// Allocatable and what the bound and assumed pods request; `allowed_pods` and the
    /// allocatable are zero while `reported` is false.
    resources: NodeResources,
    /// The node reports `status.allocatable`: only then are resources checked.
    reported: bool,
    /// Host ports of the bound and assumed pods.
    ports: HostPorts,
    /// UIDs of the pods nominated to the node.
    nominated: BTreeSet<String>,
}

impl NodeBooks {
    fn is_idle(&self) -> bool {
        !self.reported && self.resources.pods == 0 && self.nominated.is_empty()
    }
}

#[derive(Debug, Default)]
struct State {
    nodes: HashMap<String, NodeBooks>,
    /// Counted pods by UID.
    pods: HashMap<String, Counted>,
    assumed: HashMap<String, Assumed>,
    /// Assumptions by expiry, to expire them in order.
    expiry: BTreeSet<(Instant, String)>,
    /// A pod relist in progress: the counted pods, and every UID listed.
    pod_relist: Option<(HashMap<String, Counted>, HashSet<String>)>,
    /// A node relist in progress: each listed node's allocatable.
    node_relist: Option<HashMap<String, Option<NodeResources>>>,
}

/// The books of every node; clones share them.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeUsage {
    state: Arc<RwLock<State>>,
}

/// Read access to the books for one placement ([`NodeUsage::read`]).
pub(crate) struct UsageView<'a> {
    state: RwLockReadGuard<'a, State>,
}

/// What a pod takes, or `None` when it is not counted (unbound and not nominated, or
/// terminated).
fn counted(pod: &Pod) -> Option<Counted> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return None;
    }
    let bound = crate::claims::consumers::assigned_node(pod);
    let nominated = pod
        .status
        .as_ref()
        .and_then(|s| s.nominated_node_name.as_deref())
        .filter(|n| !n.is_empty());
    let (node, tie) = match (bound, nominated) {
        (Some(node), _) => (node, Tie::Bound),
        (None, Some(node)) => (node, Tie::Nominated(priority(pod))),
        (None, None) => return None,
    };
    Some(Counted {
        node: node.to_owned(),
        tie,
        requests: pod_resource_requests(pod),
        ports: host_ports(pod),
    })
}

fn uid_of(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref().filter(|uid| !uid.is_empty())
}

impl State {
    fn node(&mut self, name: &str) -> &mut NodeBooks {
        self.nodes.entry(name.to_owned()).or_default()
    }

    fn tidy(&mut self, name: &str) {
        if self.nodes.get(name).is_some_and(NodeBooks::is_idle) {
            self.nodes.remove(name);
        }
    }

    fn charge(&mut self, uid: &str, pod: &Counted) {
        let books = self.node(&pod.node);
        match pod.tie {
            Tie::Bound => {
                books.resources.add_pod(&pod.requests);
                books.ports.add(&pod.ports);
            }
            Tie::Nominated(_) => {
                books.nominated.insert(uid.to_owned());
            }
        }
    }

    fn refund(&mut self, uid: &str, pod: &Counted) {
        let books = self.node(&pod.node);
        match pod.tie {
            Tie::Bound => {
                books.resources.remove_pod(&pod.requests);
                books.ports.remove(&pod.ports);
            }
            Tie::Nominated(_) => {
                books.nominated.remove(uid);
            }
        }
        self.tidy(&pod.node);
    }

    /// Counts `pod` as it is now; true when it stopped taking resources on a node.
    fn apply_pod(&mut self, pod: &Pod) -> bool {
        let Some(uid) = uid_of(pod) else { return false };
        let now = counted(pod);
        if now.as_ref().is_some_and(|c| c.tie == Tie::Bound) {
            self.forget(uid);
        }
        let before = self.pods.remove(uid);
        if let Some(before) = &before {
            self.refund(uid, before);
        }
        if let Some(now) = now.as_ref() {
            self.charge(uid, now);
            self.pods.insert(uid.to_owned(), now.clone());
        }
        let was_bound = before.is_some_and(|b| b.tie == Tie::Bound);
        was_bound && now.is_none_or(|n| n.tie != Tie::Bound)
    }

    /// The pod is gone; true when it was bound.
    fn delete_pod(&mut self, pod: &Pod) -> bool {
        let Some(uid) = uid_of(pod) else { return false };
        self.forget(uid);
        match self.pods.remove(uid) {
            Some(before) => {
                self.refund(uid, &before);
                before.tie == Tie::Bound
            }
            None => false,
        }
    }

    /// Replaces every counted pod with those of a finished relist; assumptions of pods that
    /// were not listed or are bound now are dropped.
    fn finish_pod_relist(&mut self, pods: HashMap<String, Counted>, listed: &HashSet<String>) {
        for books in self.nodes.values_mut() {
            books.resources.requested = Resources::default();
            books.resources.pods = 0;
            books.ports = HostPorts::default();
            books.nominated.clear();
        }
        let stale: Vec<String> = self
            .assumed
            .keys()
            .filter(|uid| {
                !listed.contains(*uid) || pods.get(*uid).is_some_and(|p| p.tie == Tie::Bound)
            })
            .cloned()
            .collect();
        let assumed: Vec<(String, Assumed)> = self.assumed.drain().collect();
        self.expiry.clear();
        for (uid, counted) in &pods {
            self.charge(uid, counted);
        }
        self.pods = pods;
        for (uid, assumed) in assumed {
            if !stale.contains(&uid) {
                self.add_assumed(uid, assumed);
            }
        }
        let idle: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, b)| b.is_idle())
            .map(|(n, _)| n.clone())
            .collect();
        for name in idle {
            self.nodes.remove(&name);
        }
    }

    /// Sets the node's allocatable; true when it changed.
    fn set_allocatable(&mut self, name: &str, allocatable: Option<NodeResources>) -> bool {
        let allocatable_reported = allocatable.is_some();
        let books = self.node(name);
        let before = (
            books.reported,
            books.resources.allowed_pods,
            books.resources.allocatable.clone(),
        );
        let reported = allocatable.unwrap_or_default();
        books.reported = allocatable_reported;
        books.resources.allocatable = reported.allocatable;
        books.resources.allowed_pods = reported.allowed_pods;
        let changed = before
            != (
                books.reported,
                books.resources.allowed_pods,
                books.resources.allocatable.clone(),
            );
        self.tidy(name);
        changed
    }

    fn add_assumed(&mut self, uid: String, assumed: Assumed) {
        let books = self.node(&assumed.node);
        books.resources.add_pod(&assumed.requests);
        books.ports.add(&assumed.ports);
        if let Some(at) = assumed.expires {
            self.expiry.insert((at, uid.clone()));
        }
        self.assumed.insert(uid, assumed);
    }

    fn forget(&mut self, uid: &str) -> bool {
        let Some(assumed) = self.assumed.remove(uid) else {
            return false;
        };
        if let Some(at) = assumed.expires {
            self.expiry.remove(&(at, uid.to_owned()));
        }
        let books = self.node(&assumed.node);
        books.resources.remove_pod(&assumed.requests);
        books.ports.remove(&assumed.ports);
        self.tidy(&assumed.node);
        true
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, uid)) = self.expiry.first().cloned() {
            if at > now {
                break;
            }
            tracing::debug!(pod_uid = %uid, "assumed pod expired before kube-scheduler bound it");
            self.forget(&uid);
        }
    }
}

impl NodeUsage {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        // The books stay meaningful whatever panicked while the lock was held.
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies one event of the pod watch, after the pod store; true when a bound pod stopped
    /// counting (deleted or terminated), which frees its node's resources.
    pub(crate) fn apply_pod_event(&self, event: &watcher::Event<Pod>) -> bool {
        let mut state = self.write();
        match event {
            watcher::Event::Apply(pod) => state.apply_pod(pod),
            watcher::Event::Delete(pod) => state.delete_pod(pod),
            watcher::Event::Init => {
                state.pod_relist = Some((HashMap::new(), HashSet::new()));
                false
            }
            watcher::Event::InitApply(pod) => {
                let (pods, listed) = state.pod_relist.get_or_insert_default();
                if let Some(uid) = uid_of(pod) {
                    listed.insert(uid.to_owned());
                    if let Some(counted) = counted(pod) {
                        pods.insert(uid.to_owned(), counted);
                    }
                }
                false
            }
            watcher::Event::InitDone => {
                let (pods, listed) = state.pod_relist.take().unwrap_or_default();
                state.finish_pod_relist(pods, &listed);
                true
            }
        }
    }

    /// Applies one event of the node watch; true when a node's allocatable changed (it may
    /// have room now).
    pub(crate) fn apply_node_event(&self, event: &watcher::Event<Node>) -> bool {
        let mut state = self.write();
        let name = |node: &Node| node.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Apply(node) => {
                state.set_allocatable(&name(node), node_allocatable(node))
            }
            watcher::Event::Delete(node) => {
                state.set_allocatable(&name(node), None);
                false
            }
            watcher::Event::Init => {
                state.node_relist = Some(HashMap::new());
                false
            }
            watcher::Event::InitApply(node) => {
                let allocatable = node_allocatable(node);
                state
                    .node_relist
                    .get_or_insert_default()
                    .insert(name(node), allocatable);
                false
            }
            watcher::Event::InitDone => {
                let mut listed = state.node_relist.take().unwrap_or_default();
                let known: Vec<String> = state.nodes.keys().cloned().collect();
                let mut changed = false;
                for node in known {
                    let allocatable = listed.remove(&node).flatten();
                    changed |= state.set_allocatable(&node, allocatable);
                }
                for (node, allocatable) in listed {
                    changed |= state.set_allocatable(&node, allocatable);
                }
                changed
            }
        }
    }

    /// Assumes pod `uid` on `node` with its requests and ports until kube-scheduler binds it
    /// (replacing an earlier assumption of the pod); a pod already bound is counted as such
    /// and not assumed. `ttl` zero: the assumption does not expire.
    pub(crate) fn assume(&self, uid: &str, node: &str, pod: &PodFit, ttl: Duration, now: Instant) {
        let mut state = self.write();
        if state.pods.get(uid).is_some_and(|p| p.tie == Tie::Bound) {
            return;
        }
        state.forget(uid);
        let assumed = Assumed {
            node: node.to_owned(),
            requests: pod.requests.clone(),
            ports: pod.ports.clone(),
            expires: (!ttl.is_zero()).then(|| now + ttl),
        };
        state.add_assumed(uid.to_owned(), assumed);
    }

    /// Drops the assumption of pod `uid`, if any; true when there was one.
    pub(crate) fn forget(&self, uid: &str) -> bool {
        self.write().forget(uid)
    }

    /// True when pod `uid` is assumed on some node.
    pub(crate) fn is_assumed(&self, uid: &str) -> bool {
        self.state
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .assumed
            .contains_key(uid)
    }

    /// Expires the assumptions due at `now`, then locks the books for reading.
    pub(crate) fn read(&self, now: Instant) -> UsageView<'_> {
        {
            let mut state = self.write();
            if state.expiry.first().is_some_and(|(at, _)| *at <= now) {
                state.expire(now);
            }
        }
        UsageView {
            state: self.state.read().unwrap_or_else(PoisonError::into_inner),
        }
    }
}

#[cfg(test)]
#[path = "node_usage/tests.rs"]
mod tests;
