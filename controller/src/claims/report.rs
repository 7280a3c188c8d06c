//! What the controller says about a pod's claims: Events on claims and pods, and the pod
//! condition, in words an admin can act on — also when the API server will not take the
//! controller's writes ([`write_failed`]).

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::write_failure::FailureKind;
use kerf_core::alloc::{ClaimPlacement, Unplaceable};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt as _};

use super::write::{self, PodCondition};
use super::{consumers, reasons};
use crate::claims::ClaimsContext;
use crate::context::Write;
use crate::error::Error;

/// The allocator's sentence, prefixed with the failing claim's name (its message names only
/// the request) and closed with a period: what follows kube-scheduler's `0/N nodes are
/// available: …` when nodes passed the filters but the pod's claims fit on none of them.
pub(super) fn explain(unplaceable: &Unplaceable, claims: &[Arc<ResourceClaim>]) -> String {
    let claim = unplaceable.claim().and_then(|key| {
        claims
            .iter()
            .find(|c| c.metadata.uid.as_deref() == Some(key))
    });
    let sentence = match claim {
        Some(claim) => format!("claim {}: {unplaceable}", claim.name_any()),
        None => unplaceable.to_string(),
    };
    if sentence.ends_with('.') {
        sentence
    } else {
        format!("{sentence}.")
    }
}

pub(super) fn describe(node: &str, placed: &ClaimPlacement) -> String {
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

/// The pod's `count` controller claims are allocated on `node`: condition True, written only
/// over an earlier False one. On the happy path the removed scheduling gate and the claims'
/// annotations (`gpu.kerf.dev/allocated-node`, `gpu.kerf.dev/allocated-devices`) already say
/// so, and a pod status write per pod would cost the API server and every pod watcher a write
/// in the middle of the scheduling path.
pub(super) async fn report_allocated(ctx: &ClaimsContext, pod: &Pod, count: usize, node: &str) {
    if !write::has_condition(pod) {
        return;
    }
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
pub(super) async fn report_unplaceable(
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

/// kube-scheduler rejected the pod's placements too often: a Warning Event on every claim
/// still waiting and on the pod, and the pod condition False with the same words.
pub(super) async fn report_rejection_limit(
    ctx: &ClaimsContext,
    pod: &Pod,
    claims: &[Arc<ResourceClaim>],
    message: &str,
) {
    let reason = reasons::TOO_MANY_REJECTIONS;
    for claim in claims {
        publish(ctx, claim, EventType::Warning, reason, message.to_owned()).await;
    }
    let on_pod = pod.object_ref(&());
    publish_on(ctx, &on_pod, EventType::Warning, reason, message.to_owned()).await;
    let condition = PodCondition {
        allocated: false,
        reason,
        message: message.to_owned(),
    };
    set_condition(ctx, pod, &condition).await;
}

/// A claim's parameters are invalid: a Warning Event on it naming the field, and the pod
/// condition False. Retrying cannot help until the claim changes.
pub(super) async fn report_invalid(
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

/// A write of a claim reconcile failed at its `attempts`-th consecutive try: told where the
/// user looks ([`crate::context::Context::report_write_failure`] decides whether it is worth
/// telling). A claim write is told on the claim and on each live pod using it, whose
/// allocation it blocks; when the server refused it, those pods that wait for their
/// allocation also get the condition False with reason [`reasons::CLAIM_WRITE_REFUSED`]. A pod
/// write is told on the pod.
pub(super) async fn write_failed(
    ctx: &ClaimsContext,
    write: &Write,
    error: &kube::Error,
    attempts: u32,
) {
    let namespace = write.namespace.as_deref().unwrap_or_default();
    let mut regarding = Vec::new();
    let mut pods = Vec::new();
    if write.resource.starts_with("resourceclaims") {
        match ctx.core.claim(namespace, &write.name) {
            Some(claim) => {
                regarding.push(claim.object_ref(&()));
                pods = ctx.consumers(&claim);
            }
            // Gone from the cache: the claim is named without its UID.
            None => regarding.push(reference::<ResourceClaim>(write)),
        }
        regarding.extend(pods.iter().map(|pod| pod.object_ref(&())));
    } else if write.resource.starts_with("pods") {
        let pod = ctx
            .pods
            .get(&ObjectRef::<Pod>::new(&write.name).within(namespace));
        regarding.push(pod.map_or_else(|| reference::<Pod>(write), |p| p.object_ref(&())));
    }
    let Some(reported) = ctx
        .core
        .report_write_failure(write, error, attempts, &regarding)
        .await
    else {
        return;
    };
    if reported.failure.kind() != FailureKind::Refused || pods.is_empty() {
        return;
    }
    let condition = PodCondition {
        allocated: false,
        reason: reasons::CLAIM_WRITE_REFUSED,
        message: reported.note,
    };
    for pod in pods.iter().filter(|p| consumers::awaits_allocation(p)) {
        set_condition(ctx, pod, &condition).await;
    }
}

/// The back-off key of the ownership record write on `node`.
pub(super) fn node_write_key(node: &str) -> String {
    format!("ownership//{node}")
}

/// A write of `what` on `node` failed (not with NotFound): counted under `backoff_key` for the
/// node's back-off — the writer's pass skips the node until its next attempt is due, instead of
/// writing every tick — and told on the Node when refused or persistent.
pub(super) async fn node_write_failed(
    ctx: &ClaimsContext,
    node: &str,
    backoff_key: &str,
    what: &str,
    error: &kube::Error,
) {
    let failure = ctx
        .core
        .backoff
        .failed(&ctx.core.config.backoff, backoff_key);
    let write = Write::patch("nodes", None, node);
    let regarding = [ctx
        .nodes
        .get(&ObjectRef::<Node>::new(node))
        .map_or_else(|| reference::<Node>(&write), |n| n.object_ref(&()))];
    let reported = ctx
        .core
        .report_write_failure(&write, error, failure.count, &regarding)
        .await;
    if reported.is_none() {
        tracing::warn!(%node, %error, retry_in = ?failure.retry_in, "could not write the {what}; retrying");
    }
}

/// A reference to the object `write` names, of kind `K`, for an object not in the caches.
fn reference<K: Resource<DynamicType = ()>>(write: &Write) -> ObjectReference {
    ObjectReference {
        api_version: Some(K::api_version(&()).into_owned()),
        kind: Some(K::kind(&()).into_owned()),
        namespace: write.namespace.clone(),
        name: Some(write.name.clone()),
        ..ObjectReference::default()
    }
}

/// Conditions are best effort, like Events: a pod that is gone only logs, and a write the API
/// server refuses is told on the pod (a Warning Event and the write-failure metric).
async fn set_condition(ctx: &ClaimsContext, pod: &Pod, condition: &PodCondition) {
    match write::set_pod_condition(ctx, pod, condition).await {
        // The pod was deleted meanwhile: nobody is left to read the condition.
        Err(error) if error.is_routine() => {
            tracing::debug!(pod = %pod.name_any(), %error, "could not set the pod condition");
        }
        Err(Error::Write { write, source }) => {
            // Not retried on its own: the next reconcile of the pod's claims writes it again,
            // so a transient failure counts as the first attempt and is not told.
            let regarding = [pod.object_ref(&())];
            if ctx
                .core
                .report_write_failure(&write, &source, 1, &regarding)
                .await
                .is_none()
            {
                tracing::warn!(pod = %pod.name_any(), error = %source, "could not set the pod condition");
            }
        }
        Err(error) => {
            tracing::warn!(pod = %pod.name_any(), %error, "could not set the pod condition");
        }
        Ok(_) => {}
    }
}

pub(super) async fn publish(
    ctx: &ClaimsContext,
    claim: &ResourceClaim,
    type_: EventType,
    reason: &str,
    note: String,
) {
    publish_on(ctx, &claim.object_ref(&()), type_, reason, note).await;
}

pub(super) async fn publish_on(
    ctx: &ClaimsContext,
    regarding: &ObjectReference,
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
    if let Err(e) = ctx.core.recorder.publish(&event, regarding).await {
        tracing::warn!(object = ?regarding.name, error = %e, "could not publish event");
    }
}
