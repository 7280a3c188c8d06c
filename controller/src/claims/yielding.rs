//! Yielding to the scheduler: a device the scheduler allocated whole to another claim is
//! given up by an unreserved controller claim that shares it.

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc;
use kube::runtime::reflector::ObjectRef;

use super::state::annotated_node;
use crate::context::Context;

/// A device of this (not yet reserved) claim that the scheduler allocated whole to another
/// claim, as `node/device exclusively to claim namespace/name`: the controller yields it.
pub(super) fn scheduler_conflict(claim: &ResourceClaim, ctx: &Context) -> Option<String> {
    let uid = claim.metadata.uid.as_deref()?;
    let ours = kerf_api::allocation::device_uses(claim, ctx.driver());
    let books = ctx.books();
    for used in &ours {
        for holder in books.holders(&used.node, &used.device, uid) {
            let Some(other) = ctx.caches.claims.get(&holder) else {
                continue;
            };
            // Only claims the controller did not allocate are the scheduler's.
            if annotated_node(&other).is_some() {
                continue;
            }
            let holds_whole = kerf_api::allocation::device_uses(&other, ctx.driver())
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
pub(super) fn notify_yielders(claim: &ResourceClaim, ctx: &Context) {
    let Some(uid) = claim.metadata.uid.as_deref() else {
        return;
    };
    let whole: Vec<_> = kerf_api::allocation::device_uses(claim, ctx.driver())
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
            .caches
            .claims
            .get(&holder)
            .is_some_and(|c| annotated_node(&c).is_some());
        // Only our claims: foreign claims triggering each other could loop.
        if ours && ctx.claims.trigger.send(holder).is_err() {
            tracing::debug!("the claim controller is stopping; yield not triggered");
        }
    }
}
