//! The controller's writes to ResourceClaims: every write carries the resourceVersion it was
//! computed from, so a concurrent change fails it with a conflict instead of being
//! overwritten.

use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};

use super::{ALLOCATED_NODE_ANNOTATION, FINALIZER};
use crate::error::{Error, Result};

fn name_and_version(claim: &ResourceClaim) -> Result<(String, String)> {
    let name = claim.metadata.name.clone().ok_or(Error::MissingField {
        kind: "ResourceClaim",
        field: "name",
    })?;
    let version = claim
        .metadata
        .resource_version
        .clone()
        .ok_or(Error::MissingField {
            kind: "ResourceClaim",
            field: "resourceVersion",
        })?;
    Ok((name, version))
}

/// Adds the finalizer and records the node, guarded by the claim's resourceVersion.
///
/// # Errors
/// The API call failed (a conflict when the claim changed meanwhile).
pub async fn mark_allocating(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    node: &str,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let mut finalizers = claim.finalizers().to_vec();
    if !finalizers.iter().any(|f| f == FINALIZER) {
        finalizers.push(FINALIZER.to_owned());
    }
    let patch = json!({"metadata": {
        "resourceVersion": version,
        "finalizers": finalizers,
        "annotations": {ALLOCATED_NODE_ANNOTATION: node},
    }});
    Ok(api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}

/// Writes `status.allocation`, guarded by the claim's resourceVersion.
///
/// # Errors
/// The API call failed (a conflict when the claim changed meanwhile).
pub async fn write_allocation(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    allocation: &AllocationResult,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let allocation =
        serde_json::to_value(allocation).map_err(|e| Error::serialize("status.allocation", e))?;
    let patch =
        json!({"metadata": {"resourceVersion": version}, "status": {"allocation": allocation}});
    Ok(api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}

/// Clears `status.allocation` (and `reservedFor`, which must be empty for a deallocation),
/// guarded by the claim's resourceVersion.
///
/// # Errors
/// The API call failed (a conflict when the claim changed meanwhile).
pub async fn clear_allocation(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let patch = json!({"metadata": {"resourceVersion": version}, "status": {"allocation": null, "devices": null}});
    Ok(api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}

/// Removes the node annotation and, with `drop_finalizer`, the finalizer.
///
/// # Errors
/// The API call failed (a conflict when the claim changed meanwhile).
pub async fn unmark(
    api: &Api<ResourceClaim>,
    claim: &ResourceClaim,
    drop_finalizer: bool,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let mut metadata = json!({"resourceVersion": version, "annotations": {ALLOCATED_NODE_ANNOTATION: Value::Null}});
    if drop_finalizer {
        let finalizers: Vec<&String> = claim
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .collect();
        metadata["finalizers"] = json!(finalizers);
    }
    let patch = json!({"metadata": metadata});
    Ok(api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}
