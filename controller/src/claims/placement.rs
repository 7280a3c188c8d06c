//! Choosing the node: candidate nodes for a pod and the allocator's placement on them, with
//! the capacity assumed, the pod assumed on its node and the claims marked as being written
//! under one lock.
//!
//! A node is a candidate when it passes, in this order, the filters of kube-scheduler the
//! controller's caches can answer — readiness (kerf's), `NodeUnschedulable`, `NodeName`,
//! `TaintToleration`, `NodeAffinity` (`nodes.rs`), `NodePorts` and `NodeResourcesFit` against
//! the node's books (`node_usage`) — and then kerf's own: the node of the pod's claims already
//! allocated, and not rejected by kube-scheduler for this pod lately. The first filter that
//! fails gives the node's reasons, counted into kube-scheduler's `0/N nodes are available: …`
//! ([`Diagnosis`]).
//!
//! Among the candidates, the class's policy chooses; LeastFragmentation (the default) measures
//! each placement against the pod kinds learned so far (`super::pod_kinds`) and the nodes'
//! CPU and memory from the same books.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::pod_resources::{host_ports, is_extended_resource_name, pod_resource_requests};
use kerf_core::alloc::node_fit::Diagnosis;
use kerf_core::alloc::{self, HostAmounts, PlacementContext, PodRequest, Unplaceable};
use kube::runtime::reflector::ObjectRef;

use super::bookkeeping::WriteGuard;
use super::node_usage::{PodFit, UsageView};
use super::nodes::node_fits;
use super::report::explain;
use super::state::pod_uid;
use crate::claims::ClaimsContext;

/// A node with kerf GPUs but no Node object in the cache.
const NO_NODE_REASON: &str = "node(s) had no Node object";
/// A cached Node whose GPUs are not in kerf-controller's inventory.
const NO_GPUS_REASON: &str = "node(s) had no GPUs kerf-controller allocates";
/// Not the node of the pod's claims already allocated.
const PINNED_REASON: &str = "node(s) didn't hold the pod's allocated claims";
/// kube-scheduler cleared an allocation of the pod's claims there lately.
const REJECTED_REASON: &str = "node(s) were rejected by kube-scheduler for this pod";
/// Passed every filter, but the allocator found no devices for the pod's claims there
/// (kube-scheduler's DynamicResources words).
const CANNOT_ALLOCATE_REASON: &str = "cannot allocate all claims";

/// Why nothing fitted: a metric label and the words for Events and the pod condition.
pub(super) struct NoFit {
    pub(super) reason: &'static str,
    pub(super) message: String,
}

/// The outcome of [`place_and_begin`].
pub(super) enum Placing<'a> {
    /// Placed; the capacity is assumed and the claims are being written until the guard is
    /// dropped.
    Placed(alloc::PodPlacement, WriteGuard<'a>),
    /// Another reconcile is writing one of the claims, or our copy of one is older than our
    /// last write to it.
    Busy,
    /// Nothing fits.
    NoFit(NoFit),
}

/// The candidate nodes of one placement, and why the others were left out.
struct Filtered {
    candidates: Vec<String>,
    diagnosis: Diagnosis,
    /// GPU nodes with a cached Node object.
    cached: usize,
}

/// Places the pod on one of its candidate nodes (`pinned`: the node its allocated claims are
/// on) and, before the books are unlocked, assumes the capacity and the pod on the node and
/// marks the claims in flight, so that a concurrent reconcile cannot take the same capacity or
/// write the same claims.
pub(super) fn place_and_begin<'a>(
    pod: &Pod,
    request: &PodRequest,
    todo: &[Arc<ResourceClaim>],
    pinned: &[String],
    ctx: &'a ClaimsContext,
) -> Placing<'a> {
    let unsuitable = pod_uid(pod)
        .map(|uid| ctx.unsuitable_nodes(uid))
        .unwrap_or_default();
    let fit = pod_fit(pod, ctx);
    let mut books = ctx.books();
    if todo.iter().any(|c| books.is_stale(c)) {
        return Placing::Busy;
    }
    let gpu_nodes: Vec<String> = books.index().nodes().map(|n| n.name().to_owned()).collect();
    let now = Instant::now();
    let usage = ctx.node_usage.read(now);
    let filtered = candidate_nodes(pod, &fit, gpu_nodes, &unsuitable, pinned, &usage, ctx);
    let uids: Vec<String> = request.claims.iter().map(|c| c.key.clone()).collect();
    if uids.iter().any(|uid| books.in_flight(uid)) {
        return Placing::Busy;
    }
    let names: Vec<&str> = filtered.candidates.iter().map(String::as_str).collect();
    let host = HostAmounts {
        milli_cpu: fit.requests.milli_cpu,
        memory: fit.requests.memory,
    };
    let workload = ctx.pod_kinds.placing(fit.uid.as_deref(), request, host);
    let hosts = |node: &str| usage.host(node);
    let policy = PlacementContext {
        workload: &workload,
        pod: host,
        hosts: &hosts,
        // kube-scheduler places pods without GPUs by its default scoring.
        steer_pods_without_gpus: true,
    };
    let placed = alloc::place_with(books.index(), request, &names, &policy);
    drop(usage);
    match placed {
        Ok(placement) => {
            for claim in &placement.claims {
                books.assume(&claim.key, placement.claim_uses(claim));
            }
            if let Some(uid) = fit.uid.as_deref() {
                let ttl = ctx.core.config.claims.assumed_pod_ttl;
                ctx.node_usage.assume(uid, &placement.node, &fit, ttl, now);
            }
            // Nothing was in flight under this same lock, so `begin` succeeds.
            match books.begin(uids) {
                Some(writing) => Placing::Placed(placement, writing),
                None => Placing::Busy,
            }
        }
        Err(unplaceable) => Placing::NoFit(no_fit(&unplaceable, filtered, todo, ctx)),
    }
}

/// What the pod asks of a node besides GPUs.
pub(super) fn pod_fit(pod: &Pod, ctx: &ClaimsContext) -> PodFit {
    let requests = pod_resource_requests(pod);
    let extended: Vec<&String> = requests
        .scalars
        .keys()
        .filter(|name| is_extended_resource_name(name))
        .collect();
    let mut dra_backed = BTreeSet::new();
    if !extended.is_empty() && ctx.core.api_support.extended_resource.is_served() {
        let classes = ctx.core.caches.device_classes.state();
        dra_backed = extended
            .into_iter()
            .filter(|name| {
                crate::extended_resource::device_class_for(name.as_str(), &classes).is_some()
            })
            .cloned()
            .collect();
    }
    PodFit {
        uid: pod_uid(pod).map(str::to_owned),
        requests,
        ports: host_ports(pod),
        priority: kerf_api::pod_resources::priority(pod),
        dra_backed,
    }
}

/// Nodes with kerf GPUs where the pod may run, and why the others may not.
fn candidate_nodes(
    pod: &Pod,
    fit: &PodFit,
    gpu_nodes: Vec<String>,
    unsuitable: &[String],
    pinned: &[String],
    usage: &UsageView<'_>,
    ctx: &ClaimsContext,
) -> Filtered {
    let mut filtered = Filtered {
        candidates: Vec::new(),
        diagnosis: Diagnosis::default(),
        cached: 0,
    };
    for name in gpu_nodes {
        let Some(node) = ctx.nodes.get(&ObjectRef::<Node>::new(&name)) else {
            filtered.diagnosis.reject(&[NO_NODE_REASON]);
            continue;
        };
        filtered.cached += 1;
        if let Err(why) = node_fits(pod, &node) {
            filtered.diagnosis.reject(&[why.to_string()]);
            continue;
        }
        let reasons = usage.reasons(&name, fit);
        if !reasons.is_empty() {
            filtered.diagnosis.reject(reasons.as_slice());
            continue;
        }
        if !pinned.is_empty() && (pinned.len() > 1 || !pinned.contains(&name)) {
            filtered.diagnosis.reject(&[PINNED_REASON]);
            continue;
        }
        if unsuitable.contains(&name) {
            filtered.diagnosis.reject(&[REJECTED_REASON]);
            continue;
        }
        filtered.candidates.push(name);
    }
    filtered
}

/// kube-scheduler's `0/N nodes are available: …` over every cached node and every GPU node,
/// followed by the allocator's sentence when some nodes passed the filters.
fn no_fit(
    unplaceable: &Unplaceable,
    filtered: Filtered,
    todo: &[Arc<ResourceClaim>],
    ctx: &ClaimsContext,
) -> NoFit {
    let mut diagnosis = filtered.diagnosis;
    let others = ctx.nodes.len().saturating_sub(filtered.cached);
    diagnosis.reject_many(NO_GPUS_REASON, others);
    let candidates = filtered.candidates.len();
    diagnosis.reject_many(CANNOT_ALLOCATE_REASON, candidates);
    let mut message = diagnosis.message(diagnosis.nodes());
    if candidates > 0 {
        message.push(' ');
        message.push_str(&explain(unplaceable, todo));
    }
    NoFit {
        reason: unplaceable.reason(),
        message,
    }
}
