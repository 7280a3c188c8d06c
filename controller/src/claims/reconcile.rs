//! The ResourceClaim reconciler: `reconcile` and `error_policy`, and [`run`] that wires them
//! to the watches.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{self, ClaimPlacement, PodRequest, Unplaceable};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{Controller, WatchStreamExt as _, watcher};
use kube::{Api, Resource as _, ResourceExt as _};

use super::context::{ClaimSettings, ClaimsContext};
use super::nodes::node_fits;
use super::{ALLOCATED_NODE_ANNOTATION, FINALIZER, consumers, write};
use crate::context::Context;
use crate::error::{Error, Result};
use tokio_util::sync::CancellationToken;

const CONTROLLER: &str = "resourceclaim";

/// Reconciles one ResourceClaim.
///
/// # Errors
/// API failures (retried with per-object back-off by [`error_policy`]).
pub async fn reconcile(claim: Arc<ResourceClaim>, ctx: Arc<ClaimsContext>) -> Result<Action> {
    let started = Instant::now();
    let result = reconcile_inner(claim, &ctx).await;
    ctx.base.metrics.record_reconcile(
        CONTROLLER,
        result.as_ref().map(|_| ()).map_err(Error::reason),
        started.elapsed(),
    );
    result
}

async fn reconcile_inner(claim: Arc<ResourceClaim>, ctx: &ClaimsContext) -> Result<Action> {
    let namespace = claim.namespace().ok_or(Error::MissingField {
        kind: "ResourceClaim",
        field: "namespace",
    })?;
    let ours = claim.finalizers().iter().any(|f| f == FINALIZER);
    let deleting = claim.metadata.deletion_timestamp.is_some();
    if !ours && (deleting || !ctx.is_controller_claim(&claim)) {
        return Ok(Action::await_change());
    }
    let unallocated = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .is_none();
    if !ours && unallocated && ctx.consumers(&claim).is_empty() {
        // Nothing to do until a pod uses the claim (WaitForFirstConsumer).
        return Ok(Action::await_change());
    }
    let api: Api<ResourceClaim> = Api::namespaced(ctx.base.client.clone(), &namespace);
    finalizer(&api, FINALIZER, claim, |event| async {
        match event {
            FinalizerEvent::Apply(claim) => apply(&api, &claim, ctx).await,
            FinalizerEvent::Cleanup(claim) => cleanup(&claim, ctx),
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Decides what an unfinished claim needs: allocation, nothing, a yield or a deallocation.
async fn apply(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    ctx: &ClaimsContext,
) -> Result<Action> {
    let allocation = claim.status.as_ref().and_then(|s| s.allocation.as_ref());
    let allocated_node = claim.annotations().get(ALLOCATED_NODE_ANNOTATION).cloned();
    let reserved = claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| !r.is_empty());
    let consumers = ctx.consumers(claim);
    if allocation.is_some() {
        if allocated_node.is_none() {
            // Someone else (the scheduler) allocated it: not ours to manage.
            return Ok(Action::await_change());
        }
        if !reserved && consumers.is_empty() {
            deallocate(api, claim, ctx, true, "no pod uses the claim any more").await?;
            return Ok(Action::await_change());
        }
        if !reserved && let Some(holder) = scheduler_conflict(claim, ctx) {
            let why =
                format!("the scheduler allocated {holder} exclusively; placing the claim again");
            deallocate(api, claim, ctx, false, &why).await?;
            return Ok(Action::requeue(Duration::from_millis(100)));
        }
        return Ok(Action::await_change());
    }
    if let Some(node) = &allocated_node {
        // Our allocation is gone but our finalizer is not: the scheduler rejected the node.
        for pod in &consumers {
            ctx.mark_unsuitable(pod.metadata.uid.as_deref().unwrap_or_default(), node);
        }
        publish(
            ctx,
            claim,
            EventType::Warning,
            "NodeRejected",
            format!("the scheduler cleared the allocation on node {node}; trying other nodes"),
        )
        .await;
        let claim = write::unmark(api, claim, consumers.is_empty()).await?;
        if consumers.is_empty() {
            return Ok(Action::await_change());
        }
        return allocate_for_pod(&consumers[0], &claim, ctx).await;
    }
    match consumers.first() {
        Some(pod) if consumers::is_unscheduled(pod) => allocate_for_pod(pod, claim, ctx).await,
        Some(_) => Ok(Action::await_change()),
        None => {
            write::unmark(api, claim, true).await?;
            Ok(Action::await_change())
        }
    }
}

/// Deletion: the claim goes away with its allocation; only the index needs to know.
#[allow(clippy::unnecessary_wraps)] // the finalizer helper wants a Result from both arms
fn cleanup(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<Action> {
    if let Some(uid) = claim.metadata.uid.as_deref() {
        ctx.capacity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .forget(uid);
    }
    Ok(Action::await_change())
}

/// Places every unallocated controller claim of `pod` on one node and writes the allocations;
/// all or nothing.
async fn allocate_for_pod(
    pod: &Pod,
    trigger: &ResourceClaim,
    ctx: &ClaimsContext,
) -> Result<Action> {
    let started = Instant::now();
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_claims = consumers::pod_claims(pod);
    if !pod_claims.pending_templates.is_empty() {
        return Ok(Action::requeue(ctx.settings.pending_retry));
    }
    let mut claims = Vec::new();
    for name in &pod_claims.names {
        let reference = ObjectRef::<ResourceClaim>::new(name).within(&namespace);
        match ctx.base.caches.claims.get(&reference) {
            Some(claim) => claims.push(claim),
            None => return Ok(Action::requeue(ctx.settings.pending_retry)),
        }
    }
    // The trigger may be fresher than the cache (it just got our finalizer).
    let claims: Vec<Arc<ResourceClaim>> = claims
        .into_iter()
        .map(|c| {
            if c.metadata.uid == trigger.metadata.uid {
                Arc::new(trigger.clone())
            } else {
                c
            }
        })
        .filter(|c| {
            c.status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .is_none()
                && ctx.is_controller_claim(c)
        })
        .collect();
    if claims.is_empty() {
        return Ok(Action::await_change());
    }
    let request = match pod_request(&claims, ctx) {
        Ok(request) => request,
        Err((claim, error)) => {
            ctx.base
                .metrics
                .record_allocation(Err("invalid_parameters"), started.elapsed());
            publish(
                ctx,
                &claim,
                EventType::Warning,
                "InvalidParameters",
                error.to_string(),
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    let placement = match place_and_assume(pod, &request, ctx) {
        Ok(placement) => placement,
        Err(no_fit) => {
            ctx.base
                .metrics
                .record_allocation(Err(no_fit.reason), started.elapsed());
            for claim in &claims {
                let message = no_fit.message.clone();
                publish(ctx, claim, EventType::Warning, "Unplaceable", message).await;
            }
            return Ok(Action::requeue(ctx.settings.unplaceable_retry));
        }
    };
    match write_placement(&claims, &placement, ctx).await {
        Ok(()) => {
            ctx.base
                .metrics
                .record_allocation(Ok(()), started.elapsed());
            for (claim, placed) in claims.iter().zip(&placement.claims) {
                publish(
                    ctx,
                    claim,
                    EventType::Normal,
                    "Allocated",
                    describe(&placement.node, placed),
                )
                .await;
            }
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

/// Why nothing fitted: a metric label and the words for the Event.
struct NoFit {
    reason: &'static str,
    message: String,
}

/// Places the pod on one of its candidate nodes and reserves the capacity in the index before
/// the lock is released, so a concurrent reconcile cannot take the same capacity.
fn place_and_assume(
    pod: &Pod,
    request: &PodRequest,
    ctx: &ClaimsContext,
) -> Result<alloc::Placement, NoFit> {
    let (candidates, rejections) = candidate_nodes(pod, ctx);
    let mut capacity = ctx.capacity();
    let names: Vec<&str> = candidates.iter().map(String::as_str).collect();
    let placement =
        alloc::place(capacity.index(), request, &names).map_err(|unplaceable| NoFit {
            reason: unplaceable.reason(),
            message: explain(&unplaceable, &rejections),
        })?;
    let now = Instant::now();
    for claim in &placement.claims {
        capacity.assume(&claim.key, claim.device_uses(&placement.node), now);
    }
    Ok(placement)
}

/// Nodes with kerf GPUs where the pod may run, and why the others may not.
fn candidate_nodes(pod: &Pod, ctx: &ClaimsContext) -> (Vec<String>, BTreeMap<String, String>) {
    let unsuitable = ctx.unsuitable_nodes(pod.metadata.uid.as_deref().unwrap_or_default());
    let gpu_nodes: Vec<String> = ctx
        .capacity()
        .index()
        .nodes()
        .map(|n| n.name().to_owned())
        .collect();
    let mut candidates = Vec::new();
    let mut rejections = BTreeMap::new();
    for name in gpu_nodes {
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

/// Writes every claim's allocation; on any failure, rolls back the ones written.
async fn write_placement(
    claims: &[Arc<ResourceClaim>],
    placement: &alloc::Placement,
    ctx: &ClaimsContext,
) -> Result<()> {
    let mut written: Vec<ResourceClaim> = Vec::new();
    let mut failure = None;
    for placed in &placement.claims {
        let Some(claim) = claims
            .iter()
            .find(|c| c.metadata.uid.as_deref() == Some(placed.key.as_str()))
        else {
            continue;
        };
        match write_one(claim, placed, &placement.node, ctx).await {
            Ok(updated) => written.push(updated),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let Some(error) = failure else { return Ok(()) };
    tracing::warn!(node = %placement.node, error = %error, "allocation write failed; rolling back the pod's other claims");
    for claim in &written {
        let api: Api<ResourceClaim> = Api::namespaced(
            ctx.base.client.clone(),
            claim.metadata.namespace.as_deref().unwrap_or_default(),
        );
        if let Err(e) = write::clear_allocation(&api, claim).await {
            tracing::error!(claim = %claim.name_any(), error = %e, "rollback failed");
        }
    }
    let mut capacity = ctx
        .capacity
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for placed in &placement.claims {
        capacity.forget(&placed.key);
    }
    Err(error)
}

async fn write_one(
    claim: &ResourceClaim,
    placed: &ClaimPlacement,
    node: &str,
    ctx: &ClaimsContext,
) -> Result<ResourceClaim> {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    let api: Api<ResourceClaim> = Api::namespaced(ctx.base.client.clone(), namespace);
    let marked = write::mark_allocating(&api, claim, node).await?;
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let allocation = kerf_api::allocation::allocation_status(placed, node, ctx.driver(), now)?;
    write::write_allocation(&api, &marked, &allocation).await
}

/// Clears our allocation and tells the index; with `drop_finalizer` the claim is let go.
async fn deallocate(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    ctx: &ClaimsContext,
    drop_finalizer: bool,
    why: &str,
) -> Result<()> {
    let cleared = write::clear_allocation(api, claim).await?;
    if let Some(uid) = claim.metadata.uid.as_deref() {
        ctx.capacity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .forget(uid);
    }
    write::unmark(api, &cleared, drop_finalizer).await?;
    publish(ctx, claim, EventType::Normal, "Deallocated", why.to_owned()).await;
    Ok(())
}

/// A device of this (not yet reserved) claim that the scheduler allocated whole to another
/// claim: the controller yields it.
fn scheduler_conflict(claim: &ResourceClaim, ctx: &ClaimsContext) -> Option<String> {
    let uid = claim.metadata.uid.as_deref()?;
    let ours = kerf_api::allocation::device_uses(claim, ctx.driver());
    let cached = ctx.base.caches.claims.state();
    for used in &ours {
        for other in cached
            .iter()
            .filter(|c| c.metadata.uid.as_deref() != Some(uid))
        {
            // Only claims the controller did not allocate are the scheduler's.
            if other.annotations().contains_key(ALLOCATED_NODE_ANNOTATION) {
                continue;
            }
            let holds_whole = kerf_api::allocation::device_uses(other, ctx.driver())
                .iter()
                .any(|u| {
                    u.node == used.node
                        && u.device == used.device
                        && u.kind == alloc::UseKind::Whole
                });
            if holds_whole {
                return Some(format!("{}/{}", used.node, used.device));
            }
        }
    }
    None
}

fn explain(unplaceable: &Unplaceable, rejections: &BTreeMap<String, String>) -> String {
    if rejections.is_empty() {
        return unplaceable.to_string();
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

async fn publish(
    ctx: &ClaimsContext,
    claim: &ResourceClaim,
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
    if let Err(e) = ctx
        .base
        .recorder
        .publish(&event, &claim.object_ref(&()))
        .await
    {
        tracing::warn!(claim = %claim.name_any(), error = %e, "could not publish event");
    }
}

/// Retries a failed reconcile with per-object exponential back-off.
#[allow(clippy::needless_pass_by_value)] // the signature is kube-runtime's
pub fn error_policy(claim: Arc<ResourceClaim>, error: &Error, ctx: Arc<ClaimsContext>) -> Action {
    let key = format!(
        "{CONTROLLER}/{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    );
    let delay = ctx.base.backoff.failed(&ctx.base.config.backoff, &key);
    tracing::warn!(claim = %key, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Runs the claim controller until `shutdown`: reflectors of pods and nodes for the
/// reconciler's stores, and the claim controller, triggered by claim and pod changes.
///
/// # Errors
/// Never returns an error today; the signature fits [`crate::ControllerTask`].
pub async fn run(
    base: Arc<Context>,
    shutdown: CancellationToken,
    settings: ClaimSettings,
) -> Result<()> {
    let client = base.client.clone();
    let (pods, pod_writer) = reflector::store();
    let pod_stream = reflector::reflector(
        pod_writer,
        watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .modify(|pod: &mut Pod| pod.managed_fields_mut().clear()),
    )
    .for_each(|_| std::future::ready(()));
    let (nodes, node_writer) = reflector::store();
    let node_stream = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .modify(|node: &mut Node| node.managed_fields_mut().clear()),
    )
    .for_each(|_| std::future::ready(()));
    let ctx = Arc::new(ClaimsContext::new(Arc::clone(&base), pods, nodes, settings));
    let controller = {
        let ctx = Arc::clone(&ctx);
        let stop = shutdown.clone();
        async move {
            let ready = async {
                let _ = ctx.pods.wait_until_ready().await;
                let _ = ctx.nodes.wait_until_ready().await;
                ctx.base.caches.wait_ready().await
            };
            tokio::select! {
                () = stop.cancelled() => return,
                result = ready => if let Err(error) = result {
                    tracing::error!(%error, "caches never became ready");
                    return;
                },
            }
            Controller::new(
                Api::<ResourceClaim>::all(client.clone()),
                watcher::Config::default(),
            )
            .watches(
                Api::<Pod>::all(client.clone()),
                watcher::Config::default(),
                pod_claim_refs,
            )
            .graceful_shutdown_on(async move { stop.cancelled().await })
            .run(reconcile, error_policy, ctx)
            .for_each(|result| {
                if let Err(error) = result {
                    tracing::debug!(controller = CONTROLLER, %error, "reconcile not done");
                }
                std::future::ready(())
            })
            .await;
        }
    };
    tokio::select! {
        () = pod_stream => {}
        () = node_stream => {}
        () = controller => {}
        () = shutdown.cancelled() => {}
    }
    // The watches only end with the process; what matters is that the controller stopped.
    shutdown.cancelled().await;
    Ok(())
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
