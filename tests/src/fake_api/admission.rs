//! Admission every cluster has, run on the writes the fake accepts:
//!
//! - validation of the update itself (`meta_rules`, `claims`), which kube-apiserver runs
//!   before validating admission;
//! - the ValidatingAdmissionPolicies kerf ships ([`super::admission_policy`]);
//! - TaintNodesByCondition ([`taint_nodes_by_condition`]), with the node lifecycle
//!   controller's NoSchedule tainting that follows it.

use serde_json::{Map, Value, json};

use super::claims::Write;
use super::meta_rules::{group_of, invalid, object_meta_update_errors};
use super::routing::ApiRequest;
use super::webhooks::{Attributes, Operation};
use super::{ApiResult, ObjKey, State};

/// The taint kube-apiserver's TaintNodesByCondition admission plugin puts on every new Node.
const NOT_READY: &str = "node.kubernetes.io/not-ready";

/// The NoSchedule taint the node lifecycle controller wants for a node condition
/// (`nodeConditionToTaintKeyStatusMap` in kubernetes/kubernetes
/// `pkg/controller/nodelifecycle/node_lifecycle_controller.go`).
fn condition_taint(condition_type: &str, status: &str) -> Option<&'static str> {
    match (condition_type, status) {
        ("Ready", "False") => Some(NOT_READY),
        ("Ready", "Unknown") => Some("node.kubernetes.io/unreachable"),
        ("MemoryPressure", "True") => Some("node.kubernetes.io/memory-pressure"),
        ("DiskPressure", "True") => Some("node.kubernetes.io/disk-pressure"),
        ("NetworkUnavailable", "True") => Some("node.kubernetes.io/network-unavailable"),
        ("PIDPressure", "True") => Some("node.kubernetes.io/pid-pressure"),
        _ => None,
    }
}

/// The taint keys the lifecycle controller owns (`taintKeyToNodeConditionMap`, plus
/// `node.kubernetes.io/unschedulable`).
const CONTROLLER_TAINTS: [&str; 7] = [
    NOT_READY,
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/network-unavailable",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/unschedulable",
];

/// TaintNodesByCondition and the node lifecycle controller's answer, on a Node being stored.
///
/// - kubernetes/kubernetes `plugin/pkg/admission/nodetaint/admission.go`, `Admit`: a Node
///   *created* gets `node.kubernetes.io/not-ready:NoSchedule` unless it has a taint with that
///   key and effect.
/// - `pkg/controller/nodelifecycle/node_lifecycle_controller.go`,
///   `doNoScheduleTaintingPass`, run for every Node the controller's informer sees: the
///   NoSchedule taints it owns are made to match the conditions (Ready False → not-ready,
///   Unknown → unreachable, pressure conditions True → their taints, `spec.unschedulable` →
///   unschedulable); others are left alone.
///
/// The fake runs the controller's pass **synchronously**, in the same write, so no client
/// ever sees the in-between version a real cluster has for a moment. It does so only once the
/// Node has a Ready condition: upstream's pass would drop the admission's taint from a Node
/// without conditions at once and add `unreachable` when `nodeStartupGracePeriod` (1 minute)
/// passes without a kubelet status — the fake has no such clock and keeps the node tainted
/// instead, so a Node nobody marked Ready is never schedulable. Fixture inserts
/// ([`super::FakeApi::insert`]) go through this too: they stand for a Node a kubelet created.
pub(super) fn taint_nodes_by_condition(key: &ObjKey, created: bool, node: &mut Value) {
    if key.prefix != "api/v1" || key.resource != "nodes" {
        return;
    }
    let mut taints: Vec<Value> = node
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let is_no_schedule = |t: &Value, key: &str| {
        t.get("key").and_then(Value::as_str) == Some(key)
            && t.get("effect").and_then(Value::as_str) == Some("NoSchedule")
    };
    if created && !taints.iter().any(|t| is_no_schedule(t, NOT_READY)) {
        taints.push(json!({"key": NOT_READY, "effect": "NoSchedule"}));
    }
    if let Some(wanted) = lifecycle_taints(node) {
        // Drop the controller's NoSchedule taints it no longer wants, then add the missing.
        taints.retain(|t| {
            let key = t.get("key").and_then(Value::as_str).unwrap_or("");
            !(CONTROLLER_TAINTS.contains(&key) && is_no_schedule(t, key)) || wanted.contains(&key)
        });
        for key in wanted {
            if !taints.iter().any(|t| is_no_schedule(t, key)) {
                // SwapNodeControllerTaint stamps the taints it adds.
                taints.push(json!({"key": key, "effect": "NoSchedule", "timeAdded": now()}));
            }
        }
    }
    set_taints(node, taints);
}

fn status_of<'a>(condition: &'a Value, field: &str) -> &'a str {
    condition.get(field).and_then(Value::as_str).unwrap_or("")
}

/// The NoSchedule taint keys the lifecycle controller wants on `node`; `None` while the node
/// has no Ready condition (see [`taint_nodes_by_condition`]).
fn lifecycle_taints(node: &Value) -> Option<Vec<&'static str>> {
    let conditions = node
        .pointer("/status/conditions")
        .and_then(Value::as_array)?;
    if !conditions.iter().any(|c| status_of(c, "type") == "Ready") {
        return None;
    }
    let mut wanted: Vec<&'static str> = conditions
        .iter()
        .filter_map(|c| condition_taint(status_of(c, "type"), status_of(c, "status")))
        .collect();
    if node
        .pointer("/spec/unschedulable")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        wanted.push("node.kubernetes.io/unschedulable");
    }
    Some(wanted)
}

fn set_taints(node: &mut Value, taints: Vec<Value>) {
    if !node.get("spec").is_some_and(Value::is_object) {
        if taints.is_empty() {
            return;
        }
        node["spec"] = Value::Object(Map::new());
    }
    if let Some(spec) = node.get_mut("spec").and_then(Value::as_object_mut) {
        if taints.is_empty() {
            spec.remove("taints");
        } else {
            spec.insert("taints".to_owned(), Value::Array(taints));
        }
    }
}

fn now() -> Value {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    serde_json::to_value(now).unwrap_or(Value::Null)
}

impl State {
    /// Validates a create (`old` is `None`) or update of the object at `key` to `new`, as
    /// kube-apiserver does after its mutating admission: the update rules of object metadata
    /// and of ResourceClaims, then the ValidatingAdmissionPolicies, then the validating
    /// admission webhooks (`webhooks`; kube-apiserver's plugin order puts
    /// ValidatingAdmissionPolicy before ValidatingAdmissionWebhook).
    ///
    /// # Errors
    ///
    /// `422 Invalid` for what validation or a policy refuses; a webhook's denial or failure;
    /// [`super::ApiError::awaiting_webhooks`] when webhooks must be called first.
    pub(super) fn admit(
        &mut self,
        request: &ApiRequest,
        key: &ObjKey,
        old: Option<&Value>,
        new: &Value,
        write: &Write<'_>,
    ) -> ApiResult<()> {
        let attributes = Attributes {
            operation: if old.is_some() {
                Operation::Update
            } else {
                Operation::Create
            },
            key,
            subresource: if request.parsed.status { "status" } else { "" },
            old,
            new: Some(new),
        };
        if request.parsed.status {
            // The status strategies reset metadata and spec; no policy kerf ships matches
            // a subresource, but a webhook's rules may name it.
            return self.validating_webhooks(request, &attributes);
        }
        if let Some(old) = old {
            let errors = object_meta_update_errors(old, new);
            if !errors.is_empty() {
                let kind = self.kind_of(&key.prefix, &key.resource);
                return Err(invalid(&group_of(key), &kind, &key.name, &errors));
            }
        }
        self.guard_claim_spec(key, old, new, write)?;
        let operation = if old.is_some() { "UPDATE" } else { "CREATE" };
        self.policies
            .validate(&request.user, operation, key, old, Some(new))?;
        self.validating_webhooks(request, &attributes)
    }

    /// Validating admission of a DELETE of `current` at `key`: policies, then webhooks.
    ///
    /// # Errors
    ///
    /// `422 Invalid` when a policy refuses it; a webhook's denial or failure;
    /// [`super::ApiError::awaiting_webhooks`] when webhooks must be called first.
    pub(super) fn admit_delete(
        &self,
        request: &ApiRequest,
        key: &ObjKey,
        current: &Value,
    ) -> ApiResult<()> {
        self.policies
            .validate(&request.user, "DELETE", key, Some(current), None)?;
        let attributes = Attributes {
            operation: Operation::Delete,
            key,
            subresource: "",
            old: Some(current),
            new: None,
        };
        self.validating_webhooks(request, &attributes)
    }
}
