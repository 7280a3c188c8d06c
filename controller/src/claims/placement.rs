//! Choosing the node: candidate nodes for a pod and the allocator's placement on them, with
//! the capacity assumed and the claims marked as being written under one lock.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::{self, PodRequest};
use kube::runtime::reflector::ObjectRef;

use super::ledger::WriteGuard;
use super::nodes::node_fits;
use super::report::explain;
use super::state::pod_uid;
use crate::context::Context;

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

/// Places the pod on one of its candidate nodes (`pinned`: the node its allocated claims are
/// on) and, before the books are unlocked, assumes the capacity and marks the claims in
/// flight, so that a concurrent reconcile cannot take the same capacity or write the same
/// claims.
pub(super) fn place_and_begin<'a>(
    pod: &Pod,
    request: &PodRequest,
    todo: &[Arc<ResourceClaim>],
    pinned: &[String],
    ctx: &'a Context,
) -> Placing<'a> {
    let unsuitable = pod_uid(pod)
        .map(|uid| ctx.unsuitable_nodes(uid))
        .unwrap_or_default();
    let mut books = ctx.books();
    if todo.iter().any(|c| books.is_stale(c)) {
        return Placing::Busy;
    }
    let gpu_nodes: Vec<String> = books.index().nodes().map(|n| n.name().to_owned()).collect();
    let (candidates, rejections) = candidate_nodes(pod, gpu_nodes, &unsuitable, pinned, ctx);
    let uids: Vec<String> = request.claims.iter().map(|c| c.key.clone()).collect();
    if uids.iter().any(|uid| books.in_flight(uid)) {
        return Placing::Busy;
    }
    let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
    match alloc::place(books.index(), request, &names) {
        Ok(placement) => {
            for claim in &placement.claims {
                books.assume(&claim.key, placement.claim_uses(claim));
            }
            // Nothing was in flight under this same lock, so `begin` succeeds.
            match books.begin(uids) {
                Some(writing) => Placing::Placed(placement, writing),
                None => Placing::Busy,
            }
        }
        Err(unplaceable) => Placing::NoFit(NoFit {
            reason: unplaceable.reason(),
            message: explain(&unplaceable, &rejections, todo),
        }),
    }
}

/// Nodes with kerf GPUs where the pod may run, and why the others may not.
fn candidate_nodes(
    pod: &Pod,
    gpu_nodes: Vec<String>,
    unsuitable: &[String],
    pinned: &[String],
    ctx: &Context,
) -> (Vec<String>, BTreeMap<String, String>) {
    let mut candidates = Vec::new();
    let mut rejections = BTreeMap::new();
    for name in gpu_nodes {
        if !pinned.is_empty() && !pinned.contains(&name) {
            rejections.insert(
                name,
                format!(
                    "is not the node of the pod's allocated claims ({})",
                    pinned.join(", ")
                ),
            );
            continue;
        }
        if pinned.len() > 1 {
            rejections.insert(
                name,
                "holds only some of the pod's allocated claims".to_owned(),
            );
            continue;
        }
        let Some(node) = ctx.claims.nodes.get(&ObjectRef::<Node>::new(&name)) else {
            rejections.insert(name, "has no Node object".to_owned());
            continue;
        };
        if unsuitable.contains(&name) {
            rejections.insert(
                name,
                "was rejected by the scheduler for this pod".to_owned(),
            );
            continue;
        }
        match node_fits(pod, &node) {
            Ok(()) => candidates.push(name),
            Err(why) => {
                rejections.insert(name, why.to_string());
            }
        }
    }
    (candidates, rejections)
}
