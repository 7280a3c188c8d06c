//! What a ResourceClaim's status says: its allocation and the consumers it is reserved for.
//! kerf-controller and the kube-scheduler stand-in read claims through these.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    AllocationResult, ResourceClaim, ResourceClaimConsumerReference,
};

/// The claim's `status.allocation`, whoever wrote it.
pub fn allocation_of(claim: &ResourceClaim) -> Option<&AllocationResult> {
    claim.status.as_ref().and_then(|s| s.allocation.as_ref())
}

/// The claim's `status.reservedFor`, empty when unset.
pub fn reserved_for(claim: &ResourceClaim) -> &[ResourceClaimConsumerReference] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_deref())
        .unwrap_or_default()
}

/// Whether `reservedFor` names `pod` (by UID, as the API server and kube-scheduler compare).
pub fn is_reserved_for(claim: &ResourceClaim, pod: &Pod) -> bool {
    let uid = pod.metadata.uid.as_ref();
    reserved_for(claim)
        .iter()
        .any(|c| c.resource == "pods" && Some(&c.uid) == uid)
}
