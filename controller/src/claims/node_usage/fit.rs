//! Whether a pod fits a node's books: kube-scheduler's NodePorts and NodeResourcesFit filters.
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/framework/plugins/nodeports/node_ports.go`
//! (`fitsPorts`) then `pkg/scheduler/framework/plugins/noderesources/fit.go` (`fitsRequest`,
//! [`insufficient_resources`]), in the order of the default plugins: a node with a port
//! conflict reports only that. Nominated pods of the same or higher priority count as on the
//! node (`pkg/scheduler/framework/runtime/framework.go`, `addNominatedPods`); the pod itself
//! (bound, nominated or assumed) never counts against itself. A scalar resource the node does
//! not advertise (allocatable 0) that a DeviceClass backs through DRAExtendedResource is left
//! to DRA (`shouldDelegateResourceToDRA`), as the caller's [`PodFit::dra_backed`] says.

use std::borrow::Cow;
use std::collections::BTreeSet;

use kerf_core::alloc::HostState;
use kerf_core::alloc::node_fit::{
    HostPort, HostPorts, NODE_PORTS_REASON, NodeResources, Resources, insufficient_resources,
};

use super::{NodeBooks, State, Tie, UsageView};

/// What a pod asks of a node, read once per placement.
#[derive(Debug, Clone, Default)]
pub(crate) struct PodFit {
    /// The pod's UID: its own share of the books does not count against it.
    pub uid: Option<String>,
    /// Effective requests (upstream `PodRequests`).
    pub requests: Resources,
    /// Host ports (upstream `GetHostPorts`).
    pub ports: Vec<HostPort>,
    /// `spec.priority`.
    pub priority: i32,
    /// Extended resources the pod asks for that a DeviceClass maps (DRAExtendedResource
    /// served): not checked on nodes that do not advertise them.
    pub dra_backed: BTreeSet<String>,
}

impl UsageView<'_> {
    /// The node's CPU and memory as kube-scheduler counts them (allocatable, and the requests
    /// of its bound and assumed pods); `None` for a node that reports no allocatable.
    pub(crate) fn host(&self, node: &str) -> Option<HostState> {
        let books = self.state.nodes.get(node).filter(|books| books.reported)?;
        Some(HostState::from(&books.resources))
    }

    /// Why `pod` does not fit `node`, in kube-scheduler's words: empty when it fits, or when
    /// the node reports no allocatable (not modelled).
    pub(crate) fn reasons(&self, node: &str, pod: &PodFit) -> Vec<String> {
        let Some(books) = self.state.nodes.get(node) else {
            return Vec::new();
        };
        if !books.reported {
            return Vec::new();
        }
        let nominated = nominated_ahead(&self.state, books, pod);
        if ports_conflict(&self.state, node, books, pod, &nominated) {
            return vec![NODE_PORTS_REASON.to_owned()];
        }
        let resources = effective_resources(&self.state, node, books, pod, &nominated);
        let allocatable = &resources.allocatable;
        insufficient_resources(&pod.requests, &resources, |name| {
            pod.dra_backed.contains(name)
                && allocatable.scalars.get(name).copied().unwrap_or(0) <= 0
        })
        .iter()
        .map(ToString::to_string)
        .collect()
    }
}

/// The nominated pods that count against `pod` on this node: not itself, priority at least its.
fn nominated_ahead<'a>(
    state: &'a State,
    books: &NodeBooks,
    pod: &PodFit,
) -> Vec<&'a super::Counted> {
    books
        .nominated
        .iter()
        .filter(|uid| pod.uid.as_deref() != Some(uid.as_str()))
        .filter_map(|uid| state.pods.get(uid))
        .filter(|other| matches!(other.tie, Tie::Nominated(p) if p >= pod.priority))
        .collect()
}

/// The pod's own share of `node`'s books (bound there or assumed there), if any.
fn own_share<'a>(
    state: &'a State,
    node: &str,
    pod: &PodFit,
) -> Option<(&'a Resources, &'a [HostPort])> {
    let uid = pod.uid.as_deref()?;
    if let Some(counted) = state.pods.get(uid)
        && counted.tie == Tie::Bound
        && counted.node == node
    {
        return Some((&counted.requests, &counted.ports));
    }
    state
        .assumed
        .get(uid)
        .filter(|a| a.node == node)
        .map(|a| (&a.requests, a.ports.as_slice()))
}

fn ports_conflict(
    state: &State,
    node: &str,
    books: &NodeBooks,
    pod: &PodFit,
    nominated: &[&super::Counted],
) -> bool {
    if pod.ports.is_empty() {
        return false;
    }
    let mut own = HostPorts::default();
    if let Some((_, ports)) = own_share(state, node, pod) {
        own.add(ports);
    }
    let mut ahead = HostPorts::default();
    for other in nominated {
        ahead.add(&other.ports);
    }
    pod.ports.iter().any(|port| {
        let held = books
            .ports
            .conflicts(port)
            .saturating_sub(own.conflicts(port));
        held > 0 || ahead.conflicts(port) > 0
    })
}

/// The node's books as the pod sees them: without its own share, with the nominated pods
/// ahead of it. Borrowed when nothing changes (the common case).
fn effective_resources<'a>(
    state: &State,
    node: &str,
    books: &'a NodeBooks,
    pod: &PodFit,
    nominated: &[&super::Counted],
) -> Cow<'a, NodeResources> {
    let own = own_share(state, node, pod);
    if own.is_none() && nominated.is_empty() {
        return Cow::Borrowed(&books.resources);
    }
    let mut resources = books.resources.clone();
    if let Some((requests, _)) = own {
        resources.remove_pod(requests);
    }
    for other in nominated {
        resources.add_pod(&other.requests);
    }
    Cow::Owned(resources)
}
