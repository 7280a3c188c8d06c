//! Allocating a pod's controller claims together: which claims, their request, the
//! placement, the writes, and what to do when they do not fit next to claims already placed.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::PodRequest;
use kube::runtime::controller::Action;

use super::commit::{deallocate, write_placement};
use super::consumers;
use super::gate;
use super::placement::{NoFit, Placing, place_and_begin, pod_fit};
use super::report::{report_allocated, report_invalid, report_rejection_limit, report_unplaceable};
use super::state::{allocated_on, allocation_of, annotated_node, in_use, pod_uid};
use super::yielding::note_rejection;
use crate::claims::ClaimsContext;
use crate::error::Result;

/// Places every unallocated controller claim of `pod` on one node the pod fits (its
/// `spec.nodeName` when it was created with one) and writes the allocations, all or nothing;
/// then releases the pod's scheduling gate.
pub(super) async fn allocate_for_pod(pod: &Pod, ctx: &ClaimsContext) -> Result<Action> {
    let started = Instant::now();
    let Some(claims) = cached_pod_claims(pod, ctx) else {
        return Ok(Action::requeue(ctx.core.config.claims.pending_retry));
    };
    let (placed, todo): (Vec<_>, Vec<_>) = claims
        .into_iter()
        .filter(|c| ctx.core.is_controller_claim(c) && c.metadata.deletion_timestamp.is_none())
        .partition(|c| allocation_of(c).is_some());
    if todo.is_empty() {
        if let Some(node) = placed
            .iter()
            .find_map(|c| allocated_on(c, ctx.core.driver()))
        {
            assume_placed(pod, &node, ctx);
            report_allocated(ctx, pod, placed.len(), &node).await;
        }
        gate::release(pod, ctx).await?;
        return Ok(Action::await_change());
    }
    for claim in &todo {
        // A claim of the pod the scheduler rejected: its node must not be chosen again.
        note_rejection(claim, &[pod], ctx).await;
    }
    if let Some(action) = rejection_limit(pod, &todo, started, ctx).await {
        return Ok(action);
    }
    let pinned = pinned_nodes(&placed, ctx);
    let request = match pod_request(&todo, ctx) {
        Ok(request) => request,
        Err((claim, error)) => {
            ctx.core
                .metrics
                .record_allocation(Err("invalid_parameters"), started.elapsed());
            report_invalid(ctx, pod, &claim, &error).await;
            return Ok(Action::await_change());
        }
    };
    let (placement, mut writing) = match place_and_begin(pod, &request, &todo, &pinned, ctx) {
        Placing::Placed(placement, writing) => (placement, writing),
        Placing::Busy => return Ok(Action::requeue(ctx.core.config.claims.pending_retry)),
        Placing::NoFit(no_fit) => {
            forget_assumed(pod, ctx);
            let unfit = Unfit {
                placed: &placed,
                todo: &todo,
                pinned: &pinned,
            };
            return on_no_fit(pod, &unfit, &no_fit, started, ctx).await;
        }
    };
    let result = write_placement(pod, &todo, &placement, &mut writing, ctx).await;
    drop(writing);
    match result {
        Ok(()) => {
            // No `Allocated` Event per claim: the claim's annotations say where and what
            // (`gpu.kerf.dev/allocated-devices`, in the mark patch), without a write of its own.
            ctx.core
                .metrics
                .record_allocation(Ok(()), started.elapsed());
            let count = placed.len() + todo.len();
            report_allocated(ctx, pod, count, &placement.node).await;
            gate::release(pod, ctx).await?;
            Ok(Action::await_change())
        }
        Err(error) => {
            forget_assumed(pod, ctx);
            ctx.core
                .metrics
                .record_allocation(Err(error.reason()), started.elapsed());
            Err(error)
        }
    }
}

/// The pod's claims are all allocated on `node` and it is not bound yet: it counts there
/// until kube-scheduler binds it (after a restart, or a placement whose assumption expired).
fn assume_placed(pod: &Pod, node: &str, ctx: &ClaimsContext) {
    let Some(uid) = pod_uid(pod) else { return };
    if !consumers::is_unscheduled(pod) || ctx.node_usage.is_assumed(uid) {
        return;
    }
    let fit = pod_fit(pod, ctx);
    let ttl = ctx.core.config.claims.assumed_pod_ttl;
    ctx.node_usage.assume(uid, node, &fit, ttl, Instant::now());
}

/// The pod's placement is not written (nothing fits, or the write failed): it takes nothing
/// on the node it was assumed on.
fn forget_assumed(pod: &Pod, ctx: &ClaimsContext) {
    if let Some(uid) = pod_uid(pod) {
        ctx.node_usage.forget(uid);
    }
}

/// kube-scheduler rejected the pod's placements as often as `--max-node-rejections` allows
/// (for filters the controller does not model): the pod is not placed again until some of the
/// rejections are forgotten, and a Warning on the pod and its claims says so.
async fn rejection_limit(
    pod: &Pod,
    todo: &[Arc<ResourceClaim>],
    started: Instant,
    ctx: &ClaimsContext,
) -> Option<Action> {
    let limit = ctx.core.config.claims.max_node_rejections;
    let uid = pod_uid(pod)?;
    let rejections = ctx.rejections(uid);
    if limit == 0 || rejections < limit {
        return None;
    }
    let message = format!(
        "kube-scheduler rejected {rejections} placements of this pod's claims (--max-node-rejections {limit}), for a filter kerf-controller does not model (inter-pod affinity, topology spread, volumes, other drivers' claims: see the pod's FailedScheduling Events); not placing them again until rejections are forgotten (after at most twice --rejection-backoff-max)"
    );
    ctx.core
        .metrics
        .record_allocation(Err("rejection_limit"), started.elapsed());
    report_rejection_limit(ctx, pod, todo, &message).await;
    Some(Action::requeue(ctx.core.config.claims.unplaceable_retry))
}

/// The pod's claims from the cache, or `None` while one of them (or a claim its templates
/// make) does not exist yet.
fn cached_pod_claims(pod: &Pod, ctx: &ClaimsContext) -> Option<Vec<Arc<ResourceClaim>>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_claims = consumers::pod_claims(pod);
    if !pod_claims.pending_templates.is_empty() {
        return None;
    }
    pod_claims
        .names
        .iter()
        .map(|name| ctx.core.claim(&namespace, name))
        .collect()
}

/// The nodes the pod is tied to by its allocated claims. (A pod created with `spec.nodeName`
/// runs there whatever kerf decides: the NodeName filter keeps the other nodes out,
/// `nodes.rs`.)
fn pinned_nodes(placed: &[Arc<ResourceClaim>], ctx: &ClaimsContext) -> Vec<String> {
    let mut pinned: Vec<String> = placed
        .iter()
        .filter_map(|c| allocated_on(c, ctx.core.driver()))
        .collect();
    pinned.sort();
    pinned.dedup();
    pinned
}

/// A pod's claims that did not fit: those already allocated, those to place, and the nodes
/// the pod is tied to.
struct Unfit<'a> {
    placed: &'a [Arc<ResourceClaim>],
    todo: &'a [Arc<ResourceClaim>],
    pinned: &'a [String],
}

/// What to do when the pod's claims fit on no node: release its pinned claims to place all
/// again, wait while device ownership settles, or report the pod unplaceable.
async fn on_no_fit(
    pod: &Pod,
    unfit: &Unfit<'_>,
    no_fit: &NoFit,
    started: Instant,
    ctx: &ClaimsContext,
) -> Result<Action> {
    if !unfit.pinned.is_empty() && release_pinned(unfit.placed, ctx).await? {
        // The pod's claims are placed again together once the released ones are back.
        return Ok(Action::requeue(ctx.core.config.claims.pending_retry));
    }
    if ctx.capacity_settling() {
        // Devices are passing their ownership fence (at start-up, or taken back from
        // the scheduler): not a verdict yet. Their passing triggers the claims again.
        for claim in unfit.todo {
            ctx.wait_for_capacity(claim);
        }
        return Ok(Action::requeue(ctx.core.config.claims.pending_retry));
    }
    ctx.core
        .metrics
        .record_allocation(Err(no_fit.reason), started.elapsed());
    report_unplaceable(ctx, pod, unfit.todo, &no_fit.message).await;
    Ok(Action::requeue(ctx.core.config.claims.unplaceable_retry))
}

fn pod_request(
    claims: &[Arc<ResourceClaim>],
    ctx: &ClaimsContext,
) -> Result<PodRequest, (Arc<ResourceClaim>, kerf_api::Error)> {
    let mut request = PodRequest::default();
    for claim in claims {
        let part = kerf_api::allocation::claim_request(
            claim,
            |class| ctx.core.class_params(class),
            ctx.core.driver(),
        )
        .map_err(|e| (Arc::clone(claim), e))?;
        request.claims.push(part);
    }
    Ok(request)
}

/// The pod's remaining claims fit nowhere next to its allocated ones: deallocate those (when
/// they are all ours and unreserved) so that all are placed again together. Returns whether
/// it did.
async fn release_pinned(placed: &[Arc<ResourceClaim>], ctx: &ClaimsContext) -> Result<bool> {
    let releasable = placed
        .iter()
        .all(|c| annotated_node(c).is_some() && !in_use(c, ctx));
    if !releasable {
        return Ok(false);
    }
    for claim in placed {
        deallocate(
            claim,
            ctx,
            false,
            "the pod's other claims do not fit on its node; placing all of them again",
        )
        .await?;
    }
    Ok(true)
}
