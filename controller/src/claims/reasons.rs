//! The words the claim controller reports with: the reasons of its Events and of its pod
//! condition (`kerf_api::controller_claims::POD_CONDITION_TYPE`).

/// The claims are allocated (condition True; Event on each claim).
pub(crate) const ALLOCATED: &str = "Allocated";
/// Nothing fits (condition False; Warning Events).
pub(crate) const UNPLACEABLE: &str = "Unplaceable";
/// A claim's parameters are invalid (condition False; Warning Event on the claim).
pub(crate) const INVALID_PARAMETERS: &str = "InvalidParameters";
/// The controller cleared its allocation of a claim.
pub(crate) const DEALLOCATED: &str = "Deallocated";
/// The scheduler cleared an allocation the controller wrote: the node is avoided for the pod.
pub(crate) const NODE_REJECTED: &str = "NodeRejected";
/// The scheduler rejected the pod's placements `--max-node-rejections` times: the controller
/// stops placing it for a while (condition False; Warning Events on the pod and its claims).
pub(crate) const TOO_MANY_REJECTIONS: &str = "TooManyRejections";
/// The API server refused a write of one of the pod's claims (condition False; the
/// Warning Events on the claim and the pod, reason `WriteRefused`, quote its answer).
pub const CLAIM_WRITE_REFUSED: &str = "ClaimWriteRefused";
