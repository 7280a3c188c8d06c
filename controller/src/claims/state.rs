//! What the reconciler reads off a claim or a pod.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt as _;

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

pub(super) fn is_reserved(claim: &ResourceClaim) -> bool {
    !kerf_api::claim_status::reserved_for(claim).is_empty()
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
