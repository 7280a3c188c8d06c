//! What the reconciler reads off a claim or a pod.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimConsumerReference};
use kube::ResourceExt as _;
use kube::runtime::reflector::ObjectRef;

use super::gate;
use crate::claims::ClaimsContext;

use crate::error::{Error, Result};
use kerf_api::controller_claims::{ALLOCATED_NODE_ANNOTATION, FINALIZER};

/// The claim's UID, never empty: claims are keyed by it.
///
/// # Errors
/// [`Error::MissingField`] when the claim has none (an object not from the API server).
pub(super) fn claim_uid(claim: &ResourceClaim) -> Result<&str> {
    claim
        .metadata
        .uid
        .as_deref()
        .filter(|uid| !uid.is_empty())
        .ok_or(Error::MissingField {
            kind: "ResourceClaim",
            field: "uid",
        })
}

/// The pod's UID, when it has a non-empty one.
pub(super) fn pod_uid(pod: &Pod) -> Option<&str> {
    pod.metadata.uid.as_deref().filter(|uid| !uid.is_empty())
}

pub(super) use kerf_api::claim_status::allocation_of;

/// Whether a pod may be using the claim's devices, so its allocation must stay: the claim is
/// reserved for a consumer other than a pod kerf's scheduling gate still holds back.
///
/// kerf-controller reserves a claim for the pod it places it for, with the allocation
/// ([`super::write::write_allocation`]). While that pod carries kerf's gate (and kerf has not
/// sent its removal), kube-scheduler does not consider it, so nothing can bind it to the
/// claim's node: the allocation and that reservation may still be cleared together (yielding
/// a conflict, releasing a pod's claims to place them again). Once the removal is sent,
/// kube-scheduler may bind the pod at any moment without writing the claim again (its
/// PreBind skips claims already reserved for the pod), so from then on the claim is in use,
/// as a claim kube-scheduler reserved itself always was. An entry whose pod is not in the
/// cache counts as in use.
pub(super) fn in_use(claim: &ResourceClaim, ctx: &ClaimsContext) -> bool {
    let namespace = claim.metadata.namespace.as_deref().unwrap_or_default();
    kerf_api::claim_status::reserved_for(claim)
        .iter()
        .any(|reference| !held_by_gate(reference, namespace, ctx))
}

/// The reservation names a pod of the cache that kerf's gate still holds, unbound.
fn held_by_gate(
    reference: &ResourceClaimConsumerReference,
    namespace: &str,
    ctx: &ClaimsContext,
) -> bool {
    if reference.resource != "pods"
        || reference
            .api_group
            .as_deref()
            .is_some_and(|g| !g.is_empty())
    {
        return false;
    }
    let Some(pod) = ctx
        .pods
        .get(&ObjectRef::new(&reference.name).within(namespace))
    else {
        return false;
    };
    pod_uid(&pod) == Some(reference.uid.as_str()) && gate_holds(&pod, ctx)
}

/// kube-scheduler cannot bind the pod yet: it is unbound and carries kerf's scheduling gate,
/// whose removal kerf has not sent. Only such a pod gets kerf's reservation with the
/// allocation; for any other (its gate already lifted, or none: the webhook off) kube-scheduler
/// reserves the claim itself in PreBind, as before.
pub(super) fn gate_holds(pod: &Pod, ctx: &ClaimsContext) -> bool {
    pod.spec.as_ref().is_none_or(|s| s.node_name.is_none())
        && gate::gate_index(pod).is_some()
        && pod_uid(pod).is_some_and(|uid| !ctx.released_gates.sent_any(uid))
}

pub(super) fn has_finalizer(claim: &ResourceClaim) -> bool {
    claim.finalizers().iter().any(|f| f == FINALIZER)
}

/// The node the controller allocated the claim on, from its annotation.
pub(super) fn annotated_node(claim: &ResourceClaim) -> Option<&String> {
    claim.annotations().get(ALLOCATED_NODE_ANNOTATION)
}

/// The allocation's node: the pool of our driver's results, else our annotation.
pub(super) fn allocated_on(claim: &ResourceClaim, driver: &str) -> Option<String> {
    kerf_api::allocation::device_uses(claim, driver)
        .into_iter()
        .map(|u| u.node)
        .next()
        .or_else(|| annotated_node(claim).cloned())
}
