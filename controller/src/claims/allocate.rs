//! Allocating a pod's controller claims together: which claims, their request, the
//! placement, the writes, and what to do when they do not fit next to claims already placed.

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::PodRequest;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;

use super::commit::{deallocate, write_placement};
use super::gate;
use super::placement::{NoFit, Placing, place_and_begin};
use super::report::{describe, publish, report_allocated, report_invalid, report_unplaceable};
use super::state::{allocated_on, allocation_of, annotated_node, is_reserved};
use super::yielding::note_rejection;
use super::{consumers, reasons};
use crate::context::Context;
use crate::error::Result;

/// Places every unallocated controller claim of `pod` on one node (its `spec.nodeName` when it
/// was created with one) and writes the allocations, all or nothing; then releases the pod's
/// scheduling gate.
pub(super) async fn allocate_for_pod(pod: &Pod, ctx: &Context) -> Result<Action> {
    let started = Instant::now();
    let Some(claims) = cached_pod_claims(pod, ctx) else {
        return Ok(Action::requeue(ctx.config.claims.pending_retry));
    };
    let (placed, todo): (Vec<_>, Vec<_>) = claims
        .into_iter()
        .filter(|c| ctx.is_controller_claim(c) && c.metadata.deletion_timestamp.is_none())
        .partition(|c| allocation_of(c).is_some());
    if todo.is_empty() {
        if let Some(node) = placed.iter().find_map(|c| allocated_on(c, ctx.driver())) {
            report_allocated(ctx, pod, placed.len(), &node).await;
        }
        gate::release(pod, ctx).await?;
        return Ok(Action::await_change());
    }
    for claim in &todo {
        // A claim of the pod the scheduler rejected: its node must not be chosen again.
        note_rejection(claim, &[pod], ctx).await;
    }
    let pinned = pinned_nodes(pod, &placed, ctx);
    let request = match pod_request(&todo, ctx) {
        Ok(request) => request,
        Err((claim, error)) => {
            ctx.metrics
                .record_allocation(Err("invalid_parameters"), started.elapsed());
            report_invalid(ctx, pod, &claim, &error).await;
            return Ok(Action::await_change());
        }
    };
    let (placement, mut writing) = match place_and_begin(pod, &request, &todo, &pinned, ctx) {
        Placing::Placed(placement, writing) => (placement, writing),
        Placing::Busy => return Ok(Action::requeue(ctx.config.claims.pending_retry)),
        Placing::NoFit(no_fit) => {
            let unfit = Unfit {
                placed: &placed,
                todo: &todo,
                pinned: &pinned,
            };
            return on_no_fit(pod, &unfit, &no_fit, started, ctx).await;
        }
    };
    let result = write_placement(&todo, &placement, &mut writing, ctx).await;
    drop(writing);
    match result {
        Ok(()) => {
            ctx.metrics.record_allocation(Ok(()), started.elapsed());
            for (claim, placed) in todo.iter().zip(&placement.claims) {
                let note = describe(&placement.node, placed);
                publish(ctx, claim, EventType::Normal, reasons::ALLOCATED, note).await;
            }
            let count = placed.len() + todo.len();
            report_allocated(ctx, pod, count, &placement.node).await;
            gate::release(pod, ctx).await?;
            Ok(Action::await_change())
        }
        Err(error) => {
            ctx.metrics
                .record_allocation(Err(error.reason()), started.elapsed());
            Err(error)
        }
    }
}

/// The pod's claims from the cache, or `None` while one of them (or a claim its templates
/// make) does not exist yet.
fn cached_pod_claims(pod: &Pod, ctx: &Context) -> Option<Vec<Arc<ResourceClaim>>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_claims = consumers::pod_claims(pod);
    if !pod_claims.pending_templates.is_empty() {
        return None;
    }
    pod_claims
        .names
        .iter()
        .map(|name| ctx.claim(&namespace, name))
        .collect()
}

/// The nodes the pod is tied to: where its allocated claims are, and its `spec.nodeName`.
fn pinned_nodes(pod: &Pod, placed: &[Arc<ResourceClaim>], ctx: &Context) -> Vec<String> {
    let mut pinned: Vec<String> = placed
        .iter()
        .filter_map(|c| allocated_on(c, ctx.driver()))
        .collect();
    // A pod created with spec.nodeName runs there whatever kerf decides.
    pinned.extend(consumers::assigned_node(pod).map(str::to_owned));
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
    ctx: &Context,
) -> Result<Action> {
    if !unfit.pinned.is_empty() && release_pinned(unfit.placed, ctx).await? {
        // The pod's claims are placed again together once the released ones are back.
        return Ok(Action::requeue(ctx.config.claims.pending_retry));
    }
    if ctx.capacity_settling() {
        // Devices are passing their ownership fence (at start-up, or taken back from
        // the scheduler): not a verdict yet. Their passing triggers the claims again.
        for claim in unfit.todo {
            ctx.wait_for_capacity(claim);
        }
        return Ok(Action::requeue(ctx.config.claims.pending_retry));
    }
    ctx.metrics
        .record_allocation(Err(no_fit.reason), started.elapsed());
    report_unplaceable(ctx, pod, unfit.todo, &no_fit.message).await;
    Ok(Action::requeue(ctx.config.claims.unplaceable_retry))
}

fn pod_request(
    claims: &[Arc<ResourceClaim>],
    ctx: &Context,
) -> Result<PodRequest, (Arc<ResourceClaim>, kerf_api::Error)> {
    let mut request = PodRequest::default();
    for claim in claims {
        let part = kerf_api::allocation::claim_request(
            claim,
            |class| ctx.class_params(class),
            ctx.driver(),
        )
        .map_err(|e| (Arc::clone(claim), e))?;
        request.claims.push(part);
    }
    Ok(request)
}

/// The pod's remaining claims fit nowhere next to its allocated ones: deallocate those (when
/// they are all ours and unreserved) so that all are placed again together. Returns whether
/// it did.
async fn release_pinned(placed: &[Arc<ResourceClaim>], ctx: &Context) -> Result<bool> {
    let releasable = placed
        .iter()
        .all(|c| annotated_node(c).is_some() && !is_reserved(c));
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
