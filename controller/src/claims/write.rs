//! The controller's writes to ResourceClaims and pods. Every claim write carries the
//! resourceVersion it was computed from, so a concurrent change fails it with a conflict
//! instead of being overwritten, and every write names the controller's field manager, so
//! `managedFields` says who wrote what. The claim writes keep the node label
//! ([`CLAIM_NODE_LABEL`]) on the rule of [`node_label::label_node`] at every resourceVersion.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kerf_api::controller_claims::POD_CONDITION_TYPE;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};

use super::node_label::{self, labels_patch};
use super::state::allocation_of;
use crate::claims::ClaimsContext;
use crate::context::Write;
use crate::error::{Error, Result};
use kerf_api::controller_claims::{
    ALLOCATED_DEVICES_ANNOTATION, ALLOCATED_NODE_ANNOTATION, FINALIZER,
};

/// The claim write named for its failure report: a patch of `resource` (`resourceclaims` or
/// `resourceclaims/status`) of claim `name`.
fn claim_write(resource: &'static str, claim: &ResourceClaim, name: &str) -> Write {
    Write::patch(resource, claim.metadata.namespace.as_deref(), name)
}

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

/// Writes to the claims of one namespace as the controller's field manager.
#[derive(Clone)]
pub(crate) struct ClaimApi {
    api: Api<ResourceClaim>,
    params: PatchParams,
    /// The driver whose allocation results name the node label's node.
    driver: String,
}

/// The patch parameters of every controller write: its field manager.
fn params(ctx: &ClaimsContext) -> PatchParams {
    PatchParams {
        field_manager: Some(ctx.core.config.field_manager.clone()),
        ..PatchParams::default()
    }
}

/// The claim's API in its namespace, writing as `ctx`'s field manager.
pub(crate) fn claim_api(ctx: &ClaimsContext, claim: &ResourceClaim) -> ClaimApi {
    ClaimApi {
        api: Api::namespaced(
            ctx.core.client.clone(),
            claim.metadata.namespace.as_deref().unwrap_or_default(),
        ),
        params: params(ctx),
        driver: ctx.core.config.driver_name.clone(),
    }
}

/// Adds the finalizer and records the node (annotation and node label) and, in words, the
/// `devices` about to be allocated ([`ALLOCATED_DEVICES_ANNOTATION`]), guarded by the claim's
/// resourceVersion: the finalizer is in place before any allocation exists, and the plugin's
/// label-selected watch sees the allocation arrive on an already labelled claim.
///
/// # Errors
/// [`Error::Write`] when the API call failed (a conflict when the claim changed meanwhile).
pub(crate) async fn mark_allocating(
    api: &ClaimApi,
    claim: &ResourceClaim,
    node: &str,
    devices: &str,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let mut finalizers = claim.finalizers().to_vec();
    if !finalizers.iter().any(|f| f == FINALIZER) {
        finalizers.push(FINALIZER.to_owned());
    }
    // The rule with the annotation about to be written: the allocation's node, once it exists.
    let label = node_label::label_node(allocation_of(claim), &api.driver, Some(node))
        .map(|node| node_label_value(&node));
    let patch = json!({"metadata": {
        "resourceVersion": version,
        "finalizers": finalizers,
        "annotations": {ALLOCATED_NODE_ANNOTATION: node, ALLOCATED_DEVICES_ANNOTATION: devices},
        "labels": {CLAIM_NODE_LABEL: label},
    }});
    api.api
        .patch(&name, &api.params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::write(claim_write("resourceclaims", claim, &name), e))
}

/// Writes `status.allocation` and, given a `pod`, reserves the claim for it
/// (`status.reservedFor`, the one entry: an unallocated claim has none), guarded by the
/// claim's resourceVersion. The caller passes the pod only while kerf's gate holds it
/// ([`super::state::gate_holds`]).
///
/// The reservation saves kube-scheduler a write per claim: its DynamicResources PreBind calls
/// `bindClaim` (an UpdateStatus adding the pod to `reservedFor`) only for the pod's claims not
/// yet reserved for it (kubernetes/kubernetes
/// `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`, `PreBind`). The
/// pod is still gated, so kube-scheduler has not seen it; until kerf removes the gate the
/// claim counts as not in use ([`super::state::in_use`]), and if kube-scheduler then finds
/// the node unfit its `PostFilter` clears a claim reserved for nobody but the pod, allocation
/// and reservation together, as it clears an unreserved one.
///
/// # Errors
/// [`Error::Write`] when the API call failed (a conflict when the claim changed meanwhile);
/// [`Error::MissingField`] when the pod has no name or UID.
pub(crate) async fn write_allocation(
    api: &ClaimApi,
    claim: &ResourceClaim,
    allocation: &AllocationResult,
    pod: Option<&Pod>,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let allocation =
        serde_json::to_value(allocation).map_err(|e| Error::serialize("status.allocation", e))?;
    let mut status = json!({"allocation": allocation});
    if let Some(pod) = pod {
        status["reservedFor"] = json!([pod_reference(pod)?]);
    }
    let patch = json!({"metadata": {"resourceVersion": version}, "status": status});
    api.api
        .patch_status(&name, &api.params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::write(claim_write("resourceclaims/status", claim, &name), e))
}

/// The `reservedFor` entry of `pod`.
fn pod_reference(pod: &Pod) -> Result<Value> {
    let missing = |field| Error::MissingField { kind: "Pod", field };
    let name = pod.metadata.name.as_deref().ok_or(missing("name"))?;
    let uid = pod
        .metadata
        .uid
        .as_deref()
        .filter(|uid| !uid.is_empty())
        .ok_or(missing("uid"))?;
    Ok(json!({"resource": "pods", "name": name, "uid": uid}))
}

/// Clears `status.allocation`, `status.devices` (the driver's device status belongs to the
/// allocation) and `status.reservedFor` (kerf's own reservation for a pod its gate still
/// holds: the only kind a claim not [`super::state::in_use`] has), guarded by the claim's
/// resourceVersion; only called for claims not in use.
///
/// # Errors
/// [`Error::Write`] when the API call failed (a conflict when the claim changed meanwhile).
pub(crate) async fn clear_allocation(
    api: &ClaimApi,
    claim: &ResourceClaim,
) -> Result<ResourceClaim> {
    let (name, version) = name_and_version(claim)?;
    let patch = json!({"metadata": {"resourceVersion": version}, "status": {"allocation": null, "devices": null, "reservedFor": null}});
    api.api
        .patch_status(&name, &api.params, &Patch::Merge(&patch))
        .await
        .map_err(|e| Error::write(claim_write("resourceclaims/status", claim, &name), e))
}

/// Removes the node annotation and, with `drop_finalizer`, the finalizer, guarded by the
/// claim's resourceVersion; the node label follows in the same write (on an unallocated claim,
/// the only kind this is called for, it goes). Without anything to change it writes nothing and
/// returns `None`.
///
/// # Errors
/// [`Error::Write`] when the API call failed (a conflict when the claim changed meanwhile).
pub(crate) async fn unmark(
    api: &ClaimApi,
    claim: &ResourceClaim,
    drop_finalizer: bool,
) -> Result<Option<ResourceClaim>> {
    let annotated = claim.annotations().contains_key(ALLOCATED_NODE_ANNOTATION);
    let finalized = claim.finalizers().iter().any(|f| f == FINALIZER);
    let removing = drop_finalizer && finalized;
    let label = node_label::label_node(allocation_of(claim), &api.driver, None)
        .map(|node| node_label_value(&node));
    let labels = labels_patch(claim, label.as_deref());
    if !annotated && !removing && labels.is_none() {
        return Ok(None);
    }
    let (name, version) = name_and_version(claim)?;
    let mut metadata = json!({"resourceVersion": version});
    if annotated {
        metadata["annotations"] = json!({ALLOCATED_NODE_ANNOTATION: Value::Null, ALLOCATED_DEVICES_ANNOTATION: Value::Null});
    }
    if let Some(labels) = labels {
        metadata["labels"] = labels;
    }
    if removing {
        let finalizers: Vec<&String> = claim
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .collect();
        metadata["finalizers"] = json!(finalizers);
    }
    let patch = json!({"metadata": metadata});
    api.api
        .patch(&name, &api.params, &Patch::Merge(&patch))
        .await
        .map(Some)
        .map_err(|e| Error::write(claim_write("resourceclaims", claim, &name), e))
}

/// The pod condition the controller reports on, as it should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodCondition {
    /// True when the pod's claims are allocated.
    pub allocated: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Why, in words.
    pub message: String,
}

/// Whether the pod carries a `gpu.kerf.dev/GpuAllocation` condition.
pub(crate) fn has_condition(pod: &Pod) -> bool {
    pod_condition(pod).is_some()
}

fn pod_condition(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::PodCondition> {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == POD_CONDITION_TYPE))
}

/// Sets the pod's `gpu.kerf.dev/GpuAllocation` condition when it differs from `condition`
/// (a strategic merge patch of `pods/status`, which merges conditions by type). Returns
/// whether it wrote.
///
/// # Errors
/// [`Error::Write`] when the API call failed.
pub(crate) async fn set_pod_condition(
    ctx: &ClaimsContext,
    pod: &Pod,
    condition: &PodCondition,
) -> Result<bool> {
    let status = if condition.allocated { "True" } else { "False" };
    let current = pod_condition(pod);
    if current.is_some_and(|c| {
        c.status == status
            && c.reason.as_deref() == Some(condition.reason)
            && c.message.as_deref() == Some(condition.message.as_str())
    }) {
        return Ok(false);
    }
    let transition = current
        .filter(|c| c.status == status)
        .and_then(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    let name = pod.metadata.name.clone().ok_or(Error::MissingField {
        kind: "Pod",
        field: "name",
    })?;
    let api: Api<Pod> = Api::namespaced(
        ctx.core.client.clone(),
        pod.metadata.namespace.as_deref().unwrap_or_default(),
    );
    let patch = json!({"status": {"conditions": [{
        "type": POD_CONDITION_TYPE,
        "status": status,
        "reason": condition.reason,
        "message": condition.message,
        "lastTransitionTime": transition,
    }]}});
    let write = Write::patch("pods/status", pod.metadata.namespace.as_deref(), &name);
    api.patch_status(&name, &params(ctx), &Patch::Strategic(&patch))
        .await
        .map_err(|e| Error::write(write, e))?;
    Ok(true)
}
