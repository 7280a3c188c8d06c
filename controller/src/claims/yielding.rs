//! Yielding to the scheduler: a device the scheduler allocated whole to another claim is
//! given up by an unreserved controller claim that shares it, and a node the scheduler
//! rejected (it cleared our allocation) is avoided for the pod.
//!
//! The rejection walk is the exception: nodes are filtered first as kube-scheduler filters
//! them wherever the controller's caches can tell (`placement.rs`), so a rejection means a
//! filter kerf does not model (inter-pod affinity and anti-affinity, topology spread,
//! volumes, other drivers' claims, scheduler extenders or plugins of a custom profile). The
//! walk is bounded: `--max-node-rejections` remembered rejections stop it for the pod
//! (`allocate.rs`).

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;

use super::reasons;
use super::report::publish;
use super::state::{allocation_of, annotated_node, pod_uid};
use crate::claims::ClaimsContext;

/// A device of this (not yet reserved) claim that the scheduler allocated whole to another
/// claim, as `node/device exclusively to claim namespace/name`: the controller yields it.
pub(super) fn scheduler_conflict(claim: &ResourceClaim, ctx: &ClaimsContext) -> Option<String> {
    let uid = claim.metadata.uid.as_deref()?;
    let ours = kerf_api::allocation::device_uses(claim, ctx.core.driver());
    let books = ctx.books();
    for used in &ours {
        for holder in books.holders(&used.node, &used.device, uid) {
            let Some(other) = ctx.core.caches.claims.get(&holder) else {
                continue;
            };
            // Only claims the controller did not allocate are the scheduler's.
            if annotated_node(&other).is_some() {
                continue;
            }
            let holds_whole = kerf_api::allocation::device_uses(&other, ctx.core.driver())
                .iter()
                .any(|u| {
                    u.node == used.node
                        && u.device == used.device
                        && u.kind == alloc::UseKind::Whole
                });
            if holds_whole {
                return Some(format!(
                    "{}/{} exclusively to claim {}/{}",
                    used.node,
                    used.device,
                    holder.namespace.as_deref().unwrap_or_default(),
                    holder.name
                ));
            }
        }
    }
    None
}

/// Someone else's allocation holds devices whole: the controller's claims on them must yield,
/// so they are reconciled (their own watch events may be long past).
pub(super) fn notify_yielders(claim: &ResourceClaim, ctx: &ClaimsContext) {
    let Some(uid) = claim.metadata.uid.as_deref() else {
        return;
    };
    let whole: Vec<_> = kerf_api::allocation::device_uses(claim, ctx.core.driver())
        .into_iter()
        .filter(|u| u.kind == alloc::UseKind::Whole)
        .collect();
    if whole.is_empty() {
        return;
    }
    let holders: Vec<ObjectRef<ResourceClaim>> = {
        let books = ctx.books();
        whole
            .iter()
            .flat_map(|u| books.holders(&u.node, &u.device, uid))
            .collect()
    };
    for holder in holders {
        let ours = ctx
            .core
            .caches
            .claims
            .get(&holder)
            .is_some_and(|c| annotated_node(&c).is_some());
        // Only our claims: foreign claims triggering each other could loop.
        if ours && ctx.trigger.send(holder).is_err() {
            tracing::debug!("the claim controller is stopping; yield not triggered");
        }
    }
}

/// Our allocation of `claim` is gone and we did not clear it: the scheduler rejected the node
/// (it clears an unreserved allocation whose node does not fit the pod). The node becomes
/// unsuitable for `pods`. Reported once: afterwards the missing allocation counts as ours.
pub(super) async fn note_rejection(claim: &ResourceClaim, pods: &[&Pod], ctx: &ClaimsContext) {
    let (Some(uid), Some(node)) = (claim.metadata.uid.as_deref(), annotated_node(claim)) else {
        return;
    };
    if allocation_of(claim).is_some() || !ctx.take_rejection(uid) {
        return;
    }
    for pod_uid in pods.iter().filter_map(|pod| pod_uid(pod)) {
        ctx.mark_unsuitable(pod_uid, node);
        // The pod no longer takes room on the node kube-scheduler refused it.
        ctx.node_usage.forget(pod_uid);
    }
    let note = format!("the scheduler cleared the allocation on node {node}; trying other nodes");
    publish(ctx, claim, EventType::Warning, reasons::NODE_REJECTED, note).await;
}
