//! kerf's `PreferNoSchedule` taint on the nodes with an idle GPU
//! ([`IDLE_GPUS_TAINT_KEY`]), which steers the pods without GPUs that kube-scheduler places
//! to nodes whose GPUs are in use, so that CPU and memory stay free next to idle GPUs for the
//! GPU pods to come. Why one taint, and what it measured, is written at
//! [`kerf_core::alloc::wants_idle_gpus_taint`], the rule this module applies.
//!
//! The ownership pass finds the nodes with such an idle GPU, whoever owns it (it already walks
//! every published device and who holds it, `super::ownership`), and hands the set over after
//! each pass. A pass here then compares, for every cached Node, whether it carries the taint
//! with whether it is in that set (never, when `ClaimSettings::idle_gpus_taint` is off: the
//! passes then take off the taints an earlier run left), and writes the Nodes that differ: at
//! most one pass per ownership pass, and none before the first.
//!
//! `spec.taints` has no merge key, so a patch carries the whole list; written as
//! kube-controller-manager writes taints (kubernetes/kubernetes
//! `pkg/controller/controller_utils.go`, `PatchNodeTaints`: the list, with the node's
//! resourceVersion as a precondition), so that a taint another writer added meanwhile is never
//! dropped: the API server refuses the stale write with 409 Conflict, an expected outcome the
//! next pass resolves from the newer node.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Taint};
use kerf_core::alloc::{IDLE_GPUS_TAINT_EFFECT, IDLE_GPUS_TAINT_KEY};
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::report::node_write_failed;
use crate::claims::ClaimsContext;
use crate::metrics::{ACTION_REMOVED, ACTION_SET};

/// Keeps the taint on the nodes the ownership passes find until `shutdown`: a pass after each
/// ownership pass, and one tick after a pass that left a node for later (a conflict, a failed
/// write, a node in back-off).
pub(super) async fn run(ctx: Arc<ClaimsContext>, shutdown: CancellationToken) {
    let tick = ctx
        .core
        .config
        .claims
        .ownership_tick
        .max(Duration::from_millis(10));
    let mut found = ctx.idle_gpu_nodes.subscribe();
    let mut later = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            // The sender lives in `ctx`, which outlives this loop.
            _ = found.changed() => {}
            () = tokio::time::sleep(tick), if later => {}
        }
        let Some(idle_gpu_nodes) = found.borrow_and_update().clone() else {
            continue;
        };
        later = pass(&ctx, &idle_gpu_nodes).await;
    }
}

/// One pass: a write for every cached node whose taint differs from what `idle_gpu_nodes`
/// asks. True when a node is left for later.
async fn pass(ctx: &ClaimsContext, idle_gpu_nodes: &BTreeSet<String>) -> bool {
    let enabled = ctx.core.config.claims.idle_gpus_taint;
    let mut later = false;
    for node in ctx.nodes.state() {
        let name = node.name_any();
        let wants = enabled && idle_gpu_nodes.contains(&name);
        let Some(taints) = retainted(&node, wants) else {
            continue;
        };
        let backoff_key = write_key(&name);
        if ctx
            .core
            .backoff
            .backing_off(&ctx.core.config.backoff, &backoff_key)
        {
            later = true;
            continue;
        }
        later |= !write(ctx, &node, &name, &backoff_key, taints, wants).await;
    }
    later
}

/// Whether `taint` is kerf's.
fn is_ours(taint: &Taint) -> bool {
    taint.key == IDLE_GPUS_TAINT_KEY && taint.effect == IDLE_GPUS_TAINT_EFFECT
}

/// The node's taints with kerf's taint present when `wants`, absent otherwise, in the order
/// they were (kerf's last); `None` when the node already is so.
fn retainted(node: &Node, wants: bool) -> Option<Vec<Taint>> {
    let current = node
        .spec
        .as_ref()
        .and_then(|spec| spec.taints.as_deref())
        .unwrap_or_default();
    if current.iter().any(is_ours) == wants {
        return None;
    }
    let mut taints: Vec<Taint> = current.iter().filter(|t| !is_ours(t)).cloned().collect();
    if wants {
        taints.push(Taint {
            key: IDLE_GPUS_TAINT_KEY.to_owned(),
            effect: IDLE_GPUS_TAINT_EFFECT.to_owned(),
            ..Taint::default()
        });
    }
    Some(taints)
}

/// The merge patch that sets the node's taints to `taints`, valid only at `resource_version`
/// (an empty list removes the field, as an emptied list is stored).
fn taints_patch(resource_version: &str, taints: &[Taint]) -> Value {
    let taints = if taints.is_empty() {
        Value::Null
    } else {
        json!(taints)
    };
    json!({
        "metadata": {"resourceVersion": resource_version},
        "spec": {"taints": taints},
    })
}

/// The back-off key of the taint write on `node`.
fn write_key(node: &str) -> String {
    format!("idle-gpus-taint//{node}")
}

/// Writes the node's `taints`. True when the node needs nothing more for now: written, or
/// deleted meanwhile.
async fn write(
    ctx: &ClaimsContext,
    node: &Node,
    name: &str,
    backoff_key: &str,
    taints: Vec<Taint>,
    wants: bool,
) -> bool {
    let Some(resource_version) = node.metadata.resource_version.as_deref() else {
        return false;
    };
    let api: Api<Node> = Api::all(ctx.core.client.clone());
    let params = PatchParams {
        field_manager: Some(ctx.core.config.field_manager.clone()),
        ..PatchParams::default()
    };
    let patch = taints_patch(resource_version, &taints);
    match api.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => {
            ctx.core.backoff.succeeded(backoff_key);
            let action = if wants { ACTION_SET } else { ACTION_REMOVED };
            ctx.core.metrics.record_idle_gpus_taint(action);
            tracing::debug!(node = name, action, "idle-GPU taint written");
            true
        }
        Err(kube::Error::Api(status)) if status.code == 404 => {
            ctx.core.backoff.forget(backoff_key);
            tracing::debug!(
                node = name,
                "node deleted before its idle-GPU taint was written"
            );
            true
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {
            tracing::debug!(
                node = name,
                "node changed since it was cached; its taint is written from the newer copy"
            );
            false
        }
        // Backed off per node, and told on the Node when refused or persistent.
        Err(error) => {
            node_write_failed(ctx, name, backoff_key, "idle-GPU taint", &error).await;
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(taints: &Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "node-a", "resourceVersion": "7"},
            "spec": {"taints": taints},
        }))
        .unwrap_or_default()
    }

    fn ours() -> Value {
        json!({"key": IDLE_GPUS_TAINT_KEY, "effect": IDLE_GPUS_TAINT_EFFECT})
    }

    fn theirs() -> Value {
        json!({"key": "dedicated", "value": "ml", "effect": "NoSchedule"})
    }

    fn keys(taints: &[Taint]) -> Vec<(&str, &str)> {
        taints
            .iter()
            .map(|t| (t.key.as_str(), t.effect.as_str()))
            .collect()
    }

    #[test]
    fn the_taint_is_added_after_the_others_and_taken_off_alone() {
        let added = retainted(&node(&json!([theirs()])), true);
        assert_eq!(
            added.as_deref().map(keys),
            Some(vec![
                ("dedicated", "NoSchedule"),
                (IDLE_GPUS_TAINT_KEY, IDLE_GPUS_TAINT_EFFECT)
            ])
        );
        let removed = retainted(&node(&json!([ours(), theirs()])), false);
        assert_eq!(
            removed.as_deref().map(keys),
            Some(vec![("dedicated", "NoSchedule")])
        );
    }

    #[test]
    fn nodes_already_right_are_not_written() {
        assert_eq!(retainted(&node(&json!([theirs(), ours()])), true), None);
        assert_eq!(retainted(&node(&json!([theirs()])), false), None);
        assert_eq!(retainted(&Node::default(), false), None);
    }

    #[test]
    fn another_effect_under_the_same_key_is_not_ours() {
        let admins = json!({"key": IDLE_GPUS_TAINT_KEY, "effect": "NoSchedule"});
        let added = retainted(&node(&json!([admins])), true);
        assert_eq!(
            added.as_deref().map(keys),
            Some(vec![
                (IDLE_GPUS_TAINT_KEY, "NoSchedule"),
                (IDLE_GPUS_TAINT_KEY, IDLE_GPUS_TAINT_EFFECT)
            ])
        );
    }

    #[test]
    fn the_patch_is_guarded_by_the_resource_version() {
        let patch = taints_patch("7", &[]);
        assert_eq!(
            patch,
            json!({"metadata": {"resourceVersion": "7"}, "spec": {"taints": null}})
        );
        let taint = Taint {
            key: IDLE_GPUS_TAINT_KEY.to_owned(),
            effect: IDLE_GPUS_TAINT_EFFECT.to_owned(),
            ..Taint::default()
        };
        assert_eq!(
            taints_patch("8", &[taint])["spec"]["taints"],
            json!([ours()])
        );
    }
}
