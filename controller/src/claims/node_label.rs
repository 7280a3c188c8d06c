//! The node label of kerf claims ([`CLAIM_NODE_LABEL`]): which node a claim is allocated on,
//! so that each kubelet plugin can keep a cache of its own node's claims fed by a
//! label-selected watch.
//!
//! One rule decides the label ([`label_node`]): the node of kerf's allocation results when the
//! claim is allocated, else the node of the controller's
//! [`ALLOCATED_NODE_ANNOTATION`](super::ALLOCATED_NODE_ANNOTATION), else none. Both writers
//! follow it, so they never undo each other:
//! - the claim reconciler's own writes ([`super::write::mark_allocating`] puts the label in the
//!   same write as the annotation, before any allocation; [`super::write::unmark`] takes it off
//!   with the annotation) keep its claims right at every resourceVersion;
//! - the label reconciler here ([`reconcile`]) puts the rule on every other claim: those
//!   kube-scheduler allocated with kerf devices, and claims allocated before kerf wrote the
//!   label. It reads the claim store of [`super::run`] (no second watch of every claim)
//!   and writes only when the label differs from the rule, so an unrelated update of a claim
//!   costs no write.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kube::api::{Patch, PatchParams};
use kube::runtime::applier;
use kube::runtime::controller::{Action, Config as ApplierConfig, ReconcileRequest};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource as _, ResourceExt as _};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::state::{allocation_of, annotated_node};
use crate::claims::ClaimsContext;
use crate::context::Write;
use crate::error::{Error, Result};
use crate::metrics::{ACTION_REMOVED, ACTION_SET};
use crate::retry::Retry;

/// The label reconciler's name in metrics, back-off keys and logs.
pub(crate) const CONTROLLER: &str = "claimnodelabel";

/// The node [`CLAIM_NODE_LABEL`] names for a claim with `allocation` and the controller's node
/// annotation `annotated`: the pool of `driver`'s results when allocated (kerf's pools are
/// node names; none when they name no pool or several), else `annotated`. The one rule of
/// both writers: during the controller's allocation (annotation written, allocation not yet)
/// it already names the node the allocation will.
pub(crate) fn label_node(
    allocation: Option<&AllocationResult>,
    driver: &str,
    annotated: Option<&str>,
) -> Option<String> {
    let Some(allocation) = allocation else {
        return annotated.map(str::to_owned);
    };
    let pools: BTreeSet<&str> = allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver)
        .map(|r| r.pool.as_str())
        .collect();
    let mut pools = pools.into_iter();
    match (pools.next(), pools.next()) {
        (Some(pool), None) => Some(pool.to_owned()),
        (Some(first), Some(second)) => {
            // kerf's devices are per node; results on two nodes have no one node to name.
            tracing::debug!(
                controller = CONTROLLER,
                first,
                second,
                "allocation names several pools of the driver; no node label"
            );
            None
        }
        (None, _) => None,
    }
}

/// The value [`CLAIM_NODE_LABEL`] should have on `claim` by [`label_node`]; `None`: no label.
pub(crate) fn desired_label(claim: &ResourceClaim, driver: &str) -> Option<String> {
    label_node(
        allocation_of(claim),
        driver,
        annotated_node(claim).map(String::as_str),
    )
    .map(|node| node_label_value(&node))
}

/// The label's current value on `claim`.
pub(crate) fn current_label(claim: &ResourceClaim) -> Option<&str> {
    claim.labels().get(CLAIM_NODE_LABEL).map(String::as_str)
}

/// The `metadata.labels` merge-patch fragment that makes the label `desired`, or `None` when
/// the claim already has it.
pub(super) fn labels_patch(claim: &ResourceClaim, desired: Option<&str>) -> Option<Value> {
    if current_label(claim) == desired {
        return None;
    }
    Some(json!({ CLAIM_NODE_LABEL: desired }))
}

/// How failed label writes are retried.
pub(crate) const RETRY: Retry = Retry::new(CONTROLLER);

/// Makes the claim's [`CLAIM_NODE_LABEL`] follow [`desired_label`]: a JSON merge patch of that
/// one label as the controller's field manager, only when it differs. No resourceVersion
/// guard: the write touches that one key, and a write made from an older copy is followed by
/// the reconcile of the newer version the watch brings. A claim deleted meanwhile fails the
/// reconcile routinely (debug log).
///
/// # Errors
/// The API call failed (retried with per-object back-off by [`RETRY`]'s error policy).
pub(crate) async fn reconcile(
    claim: Arc<ResourceClaim>,
    ctx: Arc<ClaimsContext>,
) -> Result<Action> {
    let synced = async {
        sync_label(&claim, &ctx).await?;
        Ok(Action::await_change())
    };
    RETRY
        .reconcile(
            &ctx.core,
            RETRY.key(claim.as_ref()),
            synced,
            async |write, source, attempts| {
                // Told on the claim: a refused label write leaves the kubelet plugin's
                // label-selected watch without the claim.
                let regarding = [claim.object_ref(&())];
                ctx.core
                    .report_write_failure(write, source, attempts, &regarding)
                    .await;
            },
        )
        .await
}

async fn sync_label(claim: &ResourceClaim, ctx: &ClaimsContext) -> Result<()> {
    let desired = desired_label(claim, &ctx.core.config.driver_name);
    let Some(labels) = labels_patch(claim, desired.as_deref()) else {
        return Ok(());
    };
    let name = claim.metadata.name.as_deref().ok_or(Error::MissingField {
        kind: "ResourceClaim",
        field: "name",
    })?;
    let api: Api<ResourceClaim> = Api::namespaced(
        ctx.core.client.clone(),
        claim.metadata.namespace.as_deref().unwrap_or_default(),
    );
    let params = PatchParams {
        field_manager: Some(ctx.core.config.field_manager.clone()),
        ..PatchParams::default()
    };
    let patch = json!({"metadata": {"labels": labels}});
    api.patch(name, &params, &Patch::Merge(&patch))
        .await
        .map_err(|e| {
            let write = Write::patch("resourceclaims", claim.metadata.namespace.as_deref(), name);
            Error::write(write, e)
        })?;
    let action = if desired.is_some() {
        ACTION_SET
    } else {
        ACTION_REMOVED
    };
    ctx.core.metrics.record_claim_node_label(action);
    tracing::debug!(
        controller = CONTROLLER,
        claim = %RETRY.key(claim),
        label = ?desired,
        action,
        "claim node label written"
    );
    Ok(())
}

/// Runs the label reconciler over the claim store of the caches for `requests` until
/// `shutdown`, letting running writes finish for at most `grace`.
pub(super) async fn run(
    ctx: Arc<ClaimsContext>,
    requests: impl Stream<Item = ReconcileRequest<ResourceClaim>> + Send + 'static,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let queue = requests
        .map(Ok::<_, Infallible>)
        .take_until(shutdown.clone().cancelled_owned());
    let applied_ctx = Arc::clone(&ctx);
    let reconciles = applier(
        |claim, ctx| Box::pin(reconcile(claim, ctx)),
        RETRY.error_policy(),
        ctx.clone(),
        ctx.core.caches.claims.clone(),
        queue,
        ApplierConfig::default(),
    )
    .for_each(move |result| {
        RETRY.applied(&applied_ctx.core, &result);
        std::future::ready(())
    });
    tokio::pin!(reconciles);
    tokio::select! {
        () = &mut reconciles => {}
        () = shutdown.cancelled() => {
            if tokio::time::timeout(grace, &mut reconciles).await.is_err() {
                tracing::warn!(controller = CONTROLLER, "reconciles did not finish in time");
            }
        }
    }
}

/// The request of a claim the watch brought.
pub(super) fn request(claim: &ResourceClaim) -> ReconcileRequest<ResourceClaim> {
    ObjectRef::from_obj(claim).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{DeviceAllocationResult, DeviceRequestAllocationResult};

    const DRIVER: &str = "gpu.kerf.dev";

    fn result(driver: &str, pool: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            device: "gpu-0".to_owned(),
            request: "gpu".to_owned(),
            ..DeviceRequestAllocationResult::default()
        }
    }

    fn allocation(results: Vec<DeviceRequestAllocationResult>) -> AllocationResult {
        AllocationResult {
            devices: Some(DeviceAllocationResult {
                results: Some(results),
                config: None,
            }),
            ..AllocationResult::default()
        }
    }

    #[test]
    fn the_allocations_node_wins_over_the_annotation() {
        let on_a = allocation(vec![result(DRIVER, "node-a"), result(DRIVER, "node-a")]);
        assert_eq!(
            label_node(Some(&on_a), DRIVER, Some("node-b")).as_deref(),
            Some("node-a")
        );
        assert_eq!(
            label_node(Some(&on_a), DRIVER, None).as_deref(),
            Some("node-a")
        );
    }

    #[test]
    fn the_annotation_names_the_node_until_the_allocation_exists() {
        assert_eq!(
            label_node(None, DRIVER, Some("node-b")).as_deref(),
            Some("node-b")
        );
        assert_eq!(label_node(None, DRIVER, None), None);
    }

    #[test]
    fn other_drivers_and_several_pools_get_no_label() {
        let theirs = allocation(vec![result("other.example.com", "node-a")]);
        assert_eq!(label_node(Some(&theirs), DRIVER, None), None);
        let mixed = allocation(vec![
            result("other.example.com", "node-z"),
            result(DRIVER, "node-a"),
        ]);
        assert_eq!(
            label_node(Some(&mixed), DRIVER, None).as_deref(),
            Some("node-a")
        );
        let two = allocation(vec![result(DRIVER, "node-a"), result(DRIVER, "node-b")]);
        assert_eq!(label_node(Some(&two), DRIVER, Some("node-a")), None);
    }

    #[test]
    fn a_patch_is_made_only_when_the_label_differs() {
        let mut claim = ResourceClaim::default();
        assert_eq!(labels_patch(&claim, None), None);
        assert_eq!(
            labels_patch(&claim, Some("node-a")),
            Some(json!({CLAIM_NODE_LABEL: "node-a"}))
        );
        claim
            .labels_mut()
            .insert(CLAIM_NODE_LABEL.to_owned(), "node-a".to_owned());
        assert_eq!(labels_patch(&claim, Some("node-a")), None);
        assert_eq!(
            labels_patch(&claim, None),
            Some(json!({CLAIM_NODE_LABEL: null}))
        );
        assert_eq!(
            labels_patch(&claim, Some("node-b")),
            Some(json!({CLAIM_NODE_LABEL: "node-b"}))
        );
    }
}
