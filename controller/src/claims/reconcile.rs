//! The ResourceClaim reconciler's decision tree: [`reconcile`] and its retry policy [`RETRY`]
//! ([`super::watch::run`] wires them to the watches).
//!
//! One reconcile of a claim, in order:
//! 1. An allocation someone else wrote (the scheduler's) makes the controller claims that share
//!    one of its whole devices reconcile: they yield it.
//! 2. Claims that are neither ours (finalizer) nor of a controller class are left alone.
//! 3. A claim another reconcile is writing right now, or older than our own last write to it,
//!    waits: the write's watch event brings it back.
//! 4. Deletion: once no pod has it reserved, clear the allocation, remove the finalizer.
//! 5. Allocated by us: deallocate when no live pod uses it and none has it reserved; yield a
//!    device the scheduler allocated whole while unreserved; else see that the pod's other
//!    claims are allocated too.
//! 6. Unallocated but annotated with our node: unless the missing allocation is our own doing,
//!    the scheduler rejected the node — avoid it for the pod; then drop the annotation.
//! 7. Unallocated with a consumer pod that awaits allocation (unbound, or created with
//!    `spec.nodeName` and not started): place every unallocated controller claim of the pod on
//!    one node — its `spec.nodeName` if set, else the node of its already allocated claims, if
//!    any (when they do not fit there, those are released and all are placed again together)
//!    — and write them all or none, then remove the pod's scheduling gate. Nothing fits:
//!    Warning Events and the pod condition say why, and the claims are tried again after a
//!    while or as soon as the controller frees capacity.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::controller::Action;

use super::allocate::allocate_for_pod;
use super::commit::deallocate;
use super::consumers;
use super::report;
use super::state::{allocation_of, annotated_node, claim_uid, has_finalizer, in_use};
use super::write::{self, claim_api};
use super::yielding::{note_rejection, notify_yielders, scheduler_conflict};
use crate::claims::ClaimsContext;
use crate::error::Result;
use crate::retry::Retry;

/// The controller's name in metrics, back-off keys and logs.
pub(super) const CONTROLLER: &str = "resourceclaim";

/// How failed reconciles of claims are retried: a refused write holds the claim, since the
/// rollback of the write's earlier steps would otherwise bring it back at once, in a loop.
pub const RETRY: Retry = Retry::new(CONTROLLER).holding_refused();

/// Reconciles one ResourceClaim (see the module documentation). A write the API server
/// refuses, or that keeps failing, is told on the claim and its pods (Warning Events, the pod
/// condition, the write-failure metric) before it is returned.
///
/// # Errors
/// API failures (retried with per-object back-off by [`RETRY`]'s error policy).
pub async fn reconcile(claim: Arc<ResourceClaim>, ctx: Arc<ClaimsContext>) -> Result<Action> {
    ctx.wait_ready().await?;
    RETRY
        .reconcile(
            &ctx.core,
            RETRY.key(claim.as_ref()),
            Box::pin(reconcile_claim(&claim, &ctx)),
            async |write, source, attempts| {
                report::write_failed(&ctx, write, source, attempts).await;
            },
        )
        .await
}

async fn reconcile_claim(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    let uid = claim_uid(claim)?;
    let allocated = allocation_of(claim).is_some();
    if allocated && annotated_node(claim).is_none() {
        notify_yielders(claim, ctx);
    }
    if !has_finalizer(claim) && !ctx.core.is_controller_claim(claim) {
        return Ok(Action::await_change());
    }
    {
        let books = ctx.books();
        if books.in_flight(uid) {
            // Another reconcile is writing this claim; look again once it is done.
            return Ok(Action::requeue(ctx.core.config.claims.pending_retry));
        }
        if books.is_stale(claim) {
            return Ok(Action::await_change());
        }
    }
    if claim.metadata.deletion_timestamp.is_some() {
        return finish_deletion(claim, ctx).await;
    }
    if allocated {
        reconcile_allocated(claim, ctx).await
    } else {
        reconcile_unallocated(claim, uid, ctx).await
    }
}

/// The claim is being deleted: once no pod has it reserved, clear our allocation and let the
/// claim go.
async fn finish_deletion(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    if !has_finalizer(claim) {
        return Ok(Action::await_change());
    }
    if in_use(claim, ctx) {
        // A pod still uses the devices; the reservation's removal brings the claim back.
        return Ok(Action::await_change());
    }
    deallocate(claim, ctx, true, "the claim is being deleted").await?;
    Ok(Action::await_change())
}

async fn reconcile_allocated(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    if annotated_node(claim).is_none() || in_use(claim, ctx) {
        // Someone else's allocation, or one a pod has reserved: nothing to decide.
        return Ok(Action::await_change());
    }
    let consumers = ctx.consumers(claim);
    let Some(pod) = consumers.first() else {
        deallocate(claim, ctx, true, "no pod uses the claim any more").await?;
        return Ok(Action::await_change());
    };
    if let Some(holder) = scheduler_conflict(claim, ctx) {
        let why = format!("the scheduler allocated {holder}; placing the claim again");
        deallocate(claim, ctx, false, &why).await?;
        return Ok(Action::await_change());
    }
    if consumers::awaits_allocation(pod) {
        // The pod's other claims may still need their allocation on this node, and its gate
        // its release.
        return allocate_for_pod(pod, ctx).await;
    }
    Ok(Action::await_change())
}

async fn reconcile_unallocated(
    claim: &ResourceClaim,
    uid: &str,
    ctx: &ClaimsContext,
) -> Result<Action> {
    let consumers = ctx.consumers(claim);
    if annotated_node(claim).is_some() {
        let unscheduled: Vec<&Pod> = consumers
            .iter()
            .filter(|p| consumers::is_unscheduled(p))
            .map(AsRef::as_ref)
            .collect();
        note_rejection(claim, &unscheduled, ctx).await;
        let Some(mut writing) = ctx.begin_write(vec![uid.to_owned()]) else {
            return Ok(Action::requeue(ctx.core.config.claims.pending_retry));
        };
        write::unmark(&claim_api(ctx, claim), claim, consumers.is_empty()).await?;
        writing.settled(uid);
        // The write brings the claim back without the annotation.
        return Ok(Action::await_change());
    }
    match consumers.first() {
        Some(pod) if consumers::awaits_allocation(pod) => allocate_for_pod(pod, ctx).await,
        Some(_) => Ok(Action::await_change()),
        None => {
            // Idle: a finalizer left from an allocation that was never written.
            write::unmark(&claim_api(ctx, claim), claim, true).await?;
            Ok(Action::await_change())
        }
    }
}
