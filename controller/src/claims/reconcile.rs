//! The ResourceClaim reconciler: [`reconcile`] and [`error_policy`], and [`run`] that wires
//! them to the watches.
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
//! 7. Unallocated with an unscheduled consumer pod: place every unallocated controller claim of
//!    the pod on one node (the node of its already allocated ones, if any; when they do not
//!    fit there, the allocated ones are released and all are placed again together) and write
//!    them all or none. Nothing fits: Warning Events and the pod condition say why, and the
//!    claims are tried again after a while or as soon as the controller frees capacity.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{self, ClaimPlacement, PodRequest, Unplaceable};
use kube::runtime::controller::{
    Action, Config as ApplierConfig, ReconcileReason, ReconcileRequest, trigger_self, trigger_with,
};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt as _, applier, watcher};
use kube::{Api, Resource as _, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use super::context::{ClaimSettings, ClaimsContext};
use super::nodes::node_fits;
use super::write::{self, PodCondition, claim_api};
use super::{ALLOCATED_NODE_ANNOTATION, FINALIZER, consumers, reasons};
use crate::context::Context;
use crate::error::{Error, Result};

const CONTROLLER: &str = "resourceclaim";

/// How long a stopping controller lets running reconciles finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Reconciles one ResourceClaim (see the module documentation).
///
/// # Errors
/// API failures (retried with per-object back-off by [`error_policy`]).
pub async fn reconcile(claim: Arc<ResourceClaim>, ctx: Arc<ClaimsContext>) -> Result<Action> {
    ctx.wait_ready().await?;
    let started = Instant::now();
    let result = reconcile_claim(&claim, &ctx).await;
    ctx.base.metrics.record_reconcile(
        CONTROLLER,
        result.as_ref().map(|_| ()).map_err(Error::reason),
        started.elapsed(),
    );
    let key = backoff_key(&claim);
    if result.is_ok() {
        ctx.base.backoff.succeeded(&key);
    }
    ctx.base.note_reconcile(key).await;
    result
}

fn backoff_key(claim: &ResourceClaim) -> String {
    format!(
        "{CONTROLLER}/{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    )
}

fn allocation_of(
    claim: &ResourceClaim,
) -> Option<&k8s_openapi::api::resource::v1::AllocationResult> {
    claim.status.as_ref().and_then(|s| s.allocation.as_ref())
}

fn is_reserved(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| !r.is_empty())
}

fn has_finalizer(claim: &ResourceClaim) -> bool {
    claim.finalizers().iter().any(|f| f == FINALIZER)
}

fn annotated_node(claim: &ResourceClaim) -> Option<&String> {
    claim.annotations().get(ALLOCATED_NODE_ANNOTATION)
}

async fn reconcile_claim(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    let uid = claim.metadata.uid.as_deref().ok_or(Error::MissingField {
        kind: "ResourceClaim",
        field: "uid",
    })?;
    let allocated = allocation_of(claim).is_some();
    if allocated && annotated_node(claim).is_none() {
        notify_yielders(claim, ctx);
    }
    if !has_finalizer(claim) && !ctx.is_controller_claim(claim) {
        return Ok(Action::await_change());
    }
    {
        let capacity = ctx.capacity();
        if capacity.in_flight(uid) {
            // Another reconcile is writing this claim; look again once it is done.
            return Ok(Action::requeue(ctx.settings.pending_retry));
        }
        if capacity.is_stale(claim) {
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
    if is_reserved(claim) {
        // A pod still uses the devices; the reservation's removal brings the claim back.
        return Ok(Action::await_change());
    }
    deallocate(claim, ctx, true, "the claim is being deleted").await?;
    Ok(Action::await_change())
}

async fn reconcile_allocated(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    if annotated_node(claim).is_none() || is_reserved(claim) {
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
    if consumers::is_unscheduled(pod) {
        // The pod's other claims may still need their allocation on this node.
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
        write::unmark(
            &claim_api(&ctx.base.client, claim),
            claim,
            consumers.is_empty(),
        )
        .await?;
        ctx.set_self_cleared(uid, false);
        // The write brings the claim back without the annotation.
        return Ok(Action::await_change());
    }
    match consumers.first() {
        Some(pod) if consumers::is_unscheduled(pod) => allocate_for_pod(pod, ctx).await,
        Some(_) => Ok(Action::await_change()),
        None => {
            // Idle: a finalizer left from an allocation that was never written.
            write::unmark(&claim_api(&ctx.base.client, claim), claim, true).await?;
            Ok(Action::await_change())
        }
    }
}

/// Our allocation of `claim` is gone and we did not clear it: the scheduler rejected the node
/// (it clears an unreserved allocation whose node does not fit the pod). The node becomes
/// unsuitable for `pods`. Reported once: afterwards the missing allocation counts as ours.
async fn note_rejection(claim: &ResourceClaim, pods: &[&Pod], ctx: &ClaimsContext) {
    let (Some(uid), Some(node)) = (claim.metadata.uid.as_deref(), annotated_node(claim)) else {
        return;
    };
    if allocation_of(claim).is_some() || !ctx.take_rejection(uid) {
        return;
    }
    for pod in pods {
        ctx.mark_unsuitable(pod.metadata.uid.as_deref().unwrap_or_default(), node);
    }
    let note = format!("the scheduler cleared the allocation on node {node}; trying other nodes");
    publish(ctx, claim, EventType::Warning, reasons::NODE_REJECTED, note).await;
}

/// The allocation's node: the pool of our driver's results, else our annotation.
fn allocated_on(claim: &ResourceClaim, driver: &str) -> Option<String> {
    kerf_api::allocation::device_uses(claim, driver)
        .into_iter()
        .map(|u| u.node)
        .next()
        .or_else(|| annotated_node(claim).cloned())
}

/// Places every unallocated controller claim of `pod` on one node and writes the
/// allocations; all or nothing.
async fn allocate_for_pod(pod: &Pod, ctx: &ClaimsContext) -> Result<Action> {
    let started = Instant::now();
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_claims = consumers::pod_claims(pod);
    if !pod_claims.pending_templates.is_empty() {
        return Ok(Action::requeue(ctx.settings.pending_retry));
    }
    let mut claims = Vec::new();
    for name in &pod_claims.names {
        match ctx.claim(&namespace, name) {
            Some(claim) => claims.push(claim),
            None => return Ok(Action::requeue(ctx.settings.pending_retry)),
        }
    }
    let (placed, todo): (Vec<_>, Vec<_>) = claims
        .into_iter()
        .filter(|c| ctx.is_controller_claim(c) && c.metadata.deletion_timestamp.is_none())
        .partition(|c| allocation_of(c).is_some());
    if todo.is_empty() {
        if let Some(node) = placed.iter().find_map(|c| allocated_on(c, ctx.driver())) {
            report_allocated(ctx, pod, placed.len(), &node).await;
        }
        return Ok(Action::await_change());
    }
    for claim in &todo {
        // A claim of the pod the scheduler rejected: its node must not be chosen again.
        note_rejection(claim, &[pod], ctx).await;
    }
    let mut pinned: Vec<String> = placed
        .iter()
        .filter_map(|c| allocated_on(c, ctx.driver()))
        .collect();
    pinned.sort();
    pinned.dedup();
    let request = match pod_request(&todo, ctx) {
        Ok(request) => request,
        Err((claim, error)) => {
            ctx.base
                .metrics
                .record_allocation(Err("invalid_parameters"), started.elapsed());
            report_invalid(ctx, pod, &claim, &error).await;
            return Ok(Action::await_change());
        }
    };
    let (placement, in_flight) = match place_and_begin(pod, &request, &todo, &pinned, ctx) {
        Placing::Placed(placement, in_flight) => (placement, in_flight),
        Placing::Busy => return Ok(Action::requeue(ctx.settings.pending_retry)),
        Placing::NoFit(no_fit) => {
            if !pinned.is_empty() && release_pinned(&placed, ctx).await? {
                // The pod's claims are placed again together once the released ones are back.
                return Ok(Action::requeue(ctx.settings.pending_retry));
            }
            ctx.base
                .metrics
                .record_allocation(Err(no_fit.reason), started.elapsed());
            report_unplaceable(ctx, pod, &todo, &no_fit.message).await;
            return Ok(Action::requeue(ctx.settings.unplaceable_retry));
        }
    };
    let result = write_placement(&todo, &placement, ctx).await;
    drop(in_flight);
    match result {
        Ok(()) => {
            ctx.base
                .metrics
                .record_allocation(Ok(()), started.elapsed());
            for (claim, placed) in todo.iter().zip(&placement.claims) {
                let note = describe(&placement.node, placed);
                publish(ctx, claim, EventType::Normal, reasons::ALLOCATED, note).await;
            }
            let count = placed.len() + todo.len();
            report_allocated(ctx, pod, count, &placement.node).await;
            Ok(Action::await_change())
        }
        Err(error) => {
            ctx.base
                .metrics
                .record_allocation(Err(error.reason()), started.elapsed());
            Err(error)
        }
    }
}

fn pod_request(
    claims: &[Arc<ResourceClaim>],
    ctx: &ClaimsContext,
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

/// Why nothing fitted: a metric label and the words for Events and the pod condition.
struct NoFit {
    reason: &'static str,
    message: String,
}

/// The outcome of [`place_and_begin`].
enum Placing<'a> {
    /// Placed; the capacity is assumed and the claims are marked in flight until the guard
    /// is dropped.
    Placed(alloc::Placement, InFlight<'a>),
    /// Another reconcile is writing one of the claims, or our copy of one is older than our
    /// last write to it.
    Busy,
    /// Nothing fits.
    NoFit(NoFit),
}

/// Claims a reconcile is writing; released when dropped.
struct InFlight<'a> {
    ctx: &'a ClaimsContext,
    uids: Vec<String>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.ctx.capacity_unsynced().end(&self.uids);
    }
}

/// Claims `uids` for writing, or `None` when another reconcile is writing one of them.
fn begin(ctx: &ClaimsContext, uids: Vec<String>) -> Option<InFlight<'_>> {
    ctx.capacity_unsynced()
        .begin(&uids)
        .then_some(InFlight { ctx, uids })
}

/// Places the pod on one of its candidate nodes (`pinned`: the node its allocated claims are
/// on) and, before the index lock is released, assumes the capacity and marks the claims in
/// flight, so that a concurrent reconcile cannot take the same capacity or write the same
/// claims.
fn place_and_begin<'a>(
    pod: &Pod,
    request: &PodRequest,
    todo: &[Arc<ResourceClaim>],
    pinned: &[String],
    ctx: &'a ClaimsContext,
) -> Placing<'a> {
    let unsuitable = ctx.unsuitable_nodes(pod.metadata.uid.as_deref().unwrap_or_default());
    let mut capacity = ctx.capacity();
    if todo.iter().any(|c| capacity.is_stale(c)) {
        return Placing::Busy;
    }
    let gpu_nodes: Vec<String> = capacity
        .index()
        .nodes()
        .map(|n| n.name().to_owned())
        .collect();
    let (candidates, rejections) = candidate_nodes(pod, gpu_nodes, &unsuitable, pinned, ctx);
    let uids: Vec<String> = request.claims.iter().map(|c| c.key.clone()).collect();
    if !capacity.begin(&uids) {
        return Placing::Busy;
    }
    let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
    match alloc::place(capacity.index(), request, &names) {
        Ok(placement) => {
            let now = Instant::now();
            for claim in &placement.claims {
                capacity.assume(&claim.key, claim.device_uses(&placement.node), now);
            }
            Placing::Placed(placement, InFlight { ctx, uids })
        }
        Err(unplaceable) => {
            capacity.end(&uids);
            Placing::NoFit(NoFit {
                reason: unplaceable.reason(),
                message: explain(&unplaceable, &rejections, todo),
            })
        }
    }
}

/// Nodes with kerf GPUs where the pod may run, and why the others may not.
fn candidate_nodes(
    pod: &Pod,
    gpu_nodes: Vec<String>,
    unsuitable: &[String],
    pinned: &[String],
    ctx: &ClaimsContext,
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
        let Some(node) = ctx.nodes.get(&ObjectRef::<Node>::new(&name)) else {
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

/// The pod's remaining claims fit nowhere next to its allocated ones: deallocate those (when
/// they are all ours and unreserved) so that all are placed again together. Returns whether
/// it did.
async fn release_pinned(placed: &[Arc<ResourceClaim>], ctx: &ClaimsContext) -> Result<bool> {
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

/// What one claim's write went through, for a rollback.
struct Written {
    uid: String,
    had_finalizer: bool,
    latest: ResourceClaim,
    allocated: bool,
}

/// Writes every claim's allocation; on any failure, rolls back the ones written.
async fn write_placement(
    claims: &[Arc<ResourceClaim>],
    placement: &alloc::Placement,
    ctx: &ClaimsContext,
) -> Result<()> {
    let mut written: Vec<Written> = Vec::new();
    let mut failure = None;
    for placed in &placement.claims {
        let Some(claim) = claims
            .iter()
            .find(|c| c.metadata.uid.as_deref() == Some(placed.key.as_str()))
        else {
            continue;
        };
        if let Err(error) = write_one(claim, placed, &placement.node, ctx, &mut written).await {
            failure = Some(error);
            break;
        }
    }
    let Some(error) = failure else { return Ok(()) };
    tracing::warn!(node = %placement.node, %error, "allocation write failed; rolling back the pod's claims");
    rollback(&written, ctx).await;
    let mut capacity = ctx.capacity_unsynced();
    for placed in &placement.claims {
        capacity.forget(&placed.key);
    }
    Err(error)
}

/// Marks the claim (finalizer, node) and writes its allocation, recording each step in
/// `written`.
async fn write_one(
    claim: &ResourceClaim,
    placed: &ClaimPlacement,
    node: &str,
    ctx: &ClaimsContext,
    written: &mut Vec<Written>,
) -> Result<()> {
    let api = claim_api(&ctx.base.client, claim);
    ctx.set_self_cleared(&placed.key, true);
    let marked = match write::mark_allocating(&api, claim, node).await {
        Ok(marked) => marked,
        Err(error) => {
            if annotated_node(claim).is_none() {
                ctx.set_self_cleared(&placed.key, false);
            }
            return Err(error);
        }
    };
    written.push(Written {
        uid: placed.key.clone(),
        had_finalizer: has_finalizer(claim),
        latest: marked.clone(),
        allocated: false,
    });
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let allocation = kerf_api::allocation::allocation_status(placed, node, ctx.driver(), now)?;
    let updated = write::write_allocation(&api, &marked, &allocation).await?;
    ctx.capacity_unsynced().confirm(
        &placed.key,
        placed.device_uses(node),
        updated
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default(),
        Instant::now(),
    );
    ctx.set_self_cleared(&placed.key, false);
    if let Some(last) = written.last_mut() {
        last.latest = updated;
        last.allocated = true;
    }
    Ok(())
}

/// Best effort: clears what was written and restores each claim's metadata. What fails is
/// logged; the next reconcile of the pod's claims starts from whatever is left.
async fn rollback(written: &[Written], ctx: &ClaimsContext) {
    for step in written {
        let api = claim_api(&ctx.base.client, &step.latest);
        let mut latest = step.latest.clone();
        if step.allocated {
            ctx.set_self_cleared(&step.uid, true);
            match write::clear_allocation(&api, &latest).await {
                Ok(cleared) => latest = cleared,
                Err(error) => {
                    tracing::error!(claim = %latest.name_any(), %error, "rollback failed");
                    continue;
                }
            }
        }
        match write::unmark(&api, &latest, !step.had_finalizer).await {
            Ok(_) => ctx.set_self_cleared(&step.uid, false),
            Err(error) => tracing::error!(claim = %latest.name_any(), %error, "rollback failed"),
        }
    }
}

/// Clears our allocation and tells the index; with `drop_finalizer` the claim is let go.
async fn deallocate(
    claim: &ResourceClaim,
    ctx: &ClaimsContext,
    drop_finalizer: bool,
    why: &str,
) -> Result<()> {
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let Some(_in_flight) = begin(ctx, vec![uid.clone()]) else {
        return Ok(());
    };
    let api = claim_api(&ctx.base.client, claim);
    let mut latest = None;
    if allocation_of(claim).is_some() {
        ctx.set_self_cleared(&uid, true);
        let cleared = write::clear_allocation(&api, claim).await?;
        ctx.capacity_unsynced().confirm(
            &uid,
            Vec::new(),
            cleared
                .metadata
                .resource_version
                .as_deref()
                .unwrap_or_default(),
            Instant::now(),
        );
        ctx.capacity_freed();
        publish(
            ctx,
            claim,
            EventType::Normal,
            reasons::DEALLOCATED,
            why.to_owned(),
        )
        .await;
        latest = Some(cleared);
    }
    write::unmark(&api, latest.as_ref().unwrap_or(claim), drop_finalizer).await?;
    ctx.set_self_cleared(&uid, false);
    Ok(())
}

/// A device of this (not yet reserved) claim that the scheduler allocated whole to another
/// claim, as `node/device exclusively to claim namespace/name`: the controller yields it.
fn scheduler_conflict(claim: &ResourceClaim, ctx: &ClaimsContext) -> Option<String> {
    let uid = claim.metadata.uid.as_deref()?;
    let ours = kerf_api::allocation::device_uses(claim, ctx.driver());
    let capacity = ctx.capacity();
    for used in &ours {
        for holder in capacity.holders(&used.node, &used.device, uid) {
            let Some(other) = ctx.claims.get(&holder) else {
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
fn notify_yielders(claim: &ResourceClaim, ctx: &ClaimsContext) {
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
        let capacity = ctx.capacity();
        whole
            .iter()
            .flat_map(|u| capacity.holders(&u.node, &u.device, uid))
            .collect()
    };
    for holder in holders {
        let ours = ctx
            .claims
            .get(&holder)
            .is_some_and(|c| annotated_node(&c).is_some());
        // Only our claims: foreign claims triggering each other could loop.
        if ours && ctx.trigger.send(holder).is_err() {
            tracing::debug!("the claim controller is stopping; yield not triggered");
        }
    }
}

/// The allocator's sentence, prefixed with the failing claim's name (its message names only
/// the request) and followed by the nodes that were not considered and why.
fn explain(
    unplaceable: &Unplaceable,
    rejections: &BTreeMap<String, String>,
    claims: &[Arc<ResourceClaim>],
) -> String {
    let claim = unplaceable.claim().and_then(|key| {
        claims
            .iter()
            .find(|c| c.metadata.uid.as_deref() == Some(key))
    });
    let unplaceable = match claim {
        Some(claim) => format!("claim {}: {unplaceable}", claim.name_any()),
        None => unplaceable.to_string(),
    };
    if rejections.is_empty() {
        return unplaceable;
    }
    let skipped: Vec<String> = rejections
        .iter()
        .take(5)
        .map(|(node, why)| format!("{node} {why}"))
        .collect();
    let more = rejections.len().saturating_sub(5);
    let tail = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!(
        "{unplaceable} (nodes not considered: {}{tail})",
        skipped.join("; ")
    )
}

fn describe(node: &str, placed: &ClaimPlacement) -> String {
    let devices: Vec<String> = placed
        .devices
        .iter()
        .map(|d| match d.slice {
            Some(size) => format!(
                "{} ({} MiB, {}% compute)",
                d.device,
                size.memory_bytes / (1024 * 1024),
                size.compute_percent
            ),
            None => format!("{} (whole GPU)", d.device),
        })
        .collect();
    format!("allocated on node {node}: {}", devices.join(", "))
}

/// The pod's `count` controller claims are allocated on `node`: condition True.
async fn report_allocated(ctx: &ClaimsContext, pod: &Pod, count: usize, node: &str) {
    let message = format!(
        "{count} claim{} allocated on node {node}",
        if count == 1 { "" } else { "s" }
    );
    let condition = PodCondition {
        allocated: true,
        reason: reasons::ALLOCATED,
        message,
    };
    set_condition(ctx, pod, &condition).await;
}

/// Nothing fits: a Warning Event on every claim still waiting and on the pod, and the pod
/// condition False with the same words.
async fn report_unplaceable(
    ctx: &ClaimsContext,
    pod: &Pod,
    claims: &[Arc<ResourceClaim>],
    message: &str,
) {
    for claim in claims {
        ctx.wait_for_capacity(claim);
        publish(
            ctx,
            claim,
            EventType::Warning,
            reasons::UNPLACEABLE,
            message.to_owned(),
        )
        .await;
    }
    publish_on(
        ctx,
        &pod.object_ref(&()),
        EventType::Warning,
        reasons::UNPLACEABLE,
        message.to_owned(),
    )
    .await;
    let condition = PodCondition {
        allocated: false,
        reason: reasons::UNPLACEABLE,
        message: message.to_owned(),
    };
    set_condition(ctx, pod, &condition).await;
}

/// A claim's parameters are invalid: a Warning Event on it naming the field, and the pod
/// condition False. Retrying cannot help until the claim changes.
async fn report_invalid(
    ctx: &ClaimsContext,
    pod: &Pod,
    claim: &ResourceClaim,
    error: &kerf_api::Error,
) {
    let note = format!("claim {}: {error}", claim.name_any());
    publish(
        ctx,
        claim,
        EventType::Warning,
        reasons::INVALID_PARAMETERS,
        error.to_string(),
    )
    .await;
    let condition = PodCondition {
        allocated: false,
        reason: reasons::INVALID_PARAMETERS,
        message: note,
    };
    set_condition(ctx, pod, &condition).await;
}

/// Conditions are best effort, like Events: a pod that is gone or a failed write only logs.
async fn set_condition(ctx: &ClaimsContext, pod: &Pod, condition: &PodCondition) {
    if let Err(error) = write::set_pod_condition(&ctx.base.client, pod, condition).await {
        tracing::warn!(pod = %pod.name_any(), %error, "could not set the pod condition");
    }
}

async fn publish(
    ctx: &ClaimsContext,
    claim: &ResourceClaim,
    type_: EventType,
    reason: &str,
    note: String,
) {
    publish_on(ctx, &claim.object_ref(&()), type_, reason, note).await;
}

async fn publish_on(
    ctx: &ClaimsContext,
    regarding: &k8s_openapi::api::core::v1::ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(note),
        action: "Allocate".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.base.recorder.publish(&event, regarding).await {
        tracing::warn!(object = ?regarding.name, error = %e, "could not publish event");
    }
}

/// Retries a failed reconcile with per-object exponential back-off.
#[allow(clippy::needless_pass_by_value)] // the signature is kube-runtime's
pub fn error_policy(claim: Arc<ResourceClaim>, error: &Error, ctx: Arc<ClaimsContext>) -> Action {
    let key = backoff_key(&claim);
    let delay = ctx.base.backoff.failed(&ctx.base.config.backoff, &key);
    tracing::warn!(claim = %key, reason = error.reason(), %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

type Request = std::result::Result<ReconcileRequest<ResourceClaim>, watcher::Error>;

/// Runs the claim controller until `shutdown`.
///
/// One watch per kind feeds both a store and the reconcile queue, and the store is written
/// before the event is queued, so a reconcile never sees a pod or claim older than the event
/// that triggered it: claims trigger themselves; pods trigger the claims they use (creation,
/// scheduling, deletion); an allocation by someone else triggers the controller claims that
/// must yield its devices; and every claim is reconciled again each resync period.
///
/// # Errors
/// Never returns an error today; the signature fits [`crate::ControllerTask`].
pub async fn run(
    base: Arc<Context>,
    shutdown: CancellationToken,
    settings: ClaimSettings,
) -> Result<()> {
    let client = base.client.clone();
    let resync_period = base.config.resync_period;
    let (claims, claim_writer) = reflector::store();
    let claim_requests = trigger_self(
        reflector::reflector(
            claim_writer,
            watcher(
                Api::<ResourceClaim>::all(client.clone()),
                watcher::Config::default(),
            )
            .default_backoff()
            .modify(|claim: &mut ResourceClaim| claim.managed_fields_mut().clear()),
        )
        .applied_objects(),
        (),
    );
    let (pods, pod_writer) = reflector::store();
    let pod_requests = trigger_with(
        reflector::reflector(
            pod_writer,
            watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .modify(|pod: &mut Pod| pod.managed_fields_mut().clear()),
        )
        .touched_objects(),
        pod_claim_refs,
    );
    let (nodes, node_writer) = reflector::store();
    let node_watch = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .modify(|node: &mut Node| node.managed_fields_mut().clear()),
    )
    .for_each(|_| std::future::ready(()));
    let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
    let ctx = Arc::new(ClaimsContext::new(
        base,
        claims.clone(),
        pods,
        nodes,
        trigger,
        settings,
    ));
    let yield_requests = stream::unfold(triggered, |mut triggered| async move {
        let claim = triggered.recv().await?;
        Some((Ok(claim.into()), triggered))
    });
    let queue = stream::select_all([
        claim_requests.boxed(),
        pod_requests.boxed(),
        yield_requests.boxed(),
        resync_requests(claims.clone(), resync_period).boxed(),
    ])
    .filter_map(|request: Request| {
        std::future::ready(match request {
            Ok(request) => Some(Ok::<_, Infallible>(request)),
            Err(error) => {
                tracing::warn!(controller = CONTROLLER, %error, "watch failed; retrying");
                None
            }
        })
    })
    .take_until(shutdown.clone().cancelled_owned());
    let reconciles = applier(
        |claim, ctx| Box::pin(reconcile(claim, ctx)),
        error_policy,
        ctx,
        claims,
        queue,
        ApplierConfig::default(),
    )
    .for_each(|result| {
        if let Err(error) = result {
            tracing::debug!(controller = CONTROLLER, %error, "reconcile not done");
        }
        std::future::ready(())
    });
    tokio::pin!(reconciles);
    tokio::select! {
        () = &mut reconciles => {}
        () = node_watch => {}
        () = shutdown.cancelled() => {
            // The queue has ended: running reconciles finish, then the applier stops.
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut reconciles).await.is_err() {
                tracing::warn!(controller = CONTROLLER, "reconciles did not finish in time");
            }
        }
    }
    // The watches only end with the process; what matters is that the controller stopped.
    shutdown.cancelled().await;
    Ok(())
}

/// Every cached claim, once per `period`: a safety net for missed events.
fn resync_requests(
    claims: reflector::Store<ResourceClaim>,
    period: Duration,
) -> impl futures::Stream<Item = Request> + Send + 'static {
    let start = tokio::time::Instant::now() + period;
    stream::unfold(
        tokio::time::interval_at(start, period.max(Duration::from_millis(1))),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
    .flat_map(move |()| {
        stream::iter(claims.state().into_iter().map(|claim| {
            Ok(ReconcileRequest {
                obj_ref: ObjectRef::from_obj(claim.as_ref()),
                reason: ReconcileReason::BulkReconcile,
            })
        }))
    })
}

/// Pod changes trigger the pod's claims.
#[allow(clippy::needless_pass_by_value)] // the signature is kube-runtime's
fn pod_claim_refs(pod: Pod) -> Vec<ObjectRef<ResourceClaim>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    consumers::pod_claims(&pod)
        .names
        .into_iter()
        .map(|name| ObjectRef::new(&name).within(&namespace))
        .collect()
}
