//! The pod status the kubelet writes, built from what the runner saw of each container.
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/kubelet/kubelet_pods.go`, `generateAPIPodStatus` and `getPhase`: with
//!   `restartPolicy: Always` a pod is `Pending` while a container has never run, else
//!   `Running`; once the pod is terminated (deleted, every container stopped) `Succeeded` when
//!   every container exited 0, else `Failed`; `convertToAPIContainerStatuses`: `ready` (no
//!   probes: while running), `started`, `restartCount`, `containerID`, `state` and
//!   `lastState.terminated`;
//! - `pkg/kubelet/status/generate.go`, `GeneratePodReadyCondition` /
//!   `GenerateContainersReadyCondition`: `Ready` and `ContainersReady` while every container
//!   is ready;
//! - `pkg/util/pod/pod.go`, `PatchPodStatus`: the status manager sends the difference between
//!   the status it wrote last and the new one as a patch of `pods/<name>/status`.

use k8s_openapi::jiff::Timestamp;
use serde_json::{Map, Value, json};

use super::container::Exit;
use super::plan::Waiting;

/// The state of one container as the runner last saw it.
#[derive(Debug, Clone)]
pub(super) enum State {
    Waiting(Waiting),
    Running { started_at: Timestamp },
    Terminated(Exit),
}

/// One container's part of the status.
#[derive(Debug, Clone)]
pub(super) struct ContainerView {
    pub(super) name: String,
    pub(super) image: String,
    pub(super) image_id: String,
    pub(super) restart_count: u32,
    pub(super) id: Option<String>,
    pub(super) state: State,
    pub(super) last: Option<Exit>,
}

impl ContainerView {
    pub(super) fn waiting(name: &str, image: &str, image_id: &str, waiting: Waiting) -> Self {
        Self {
            name: name.to_owned(),
            image: image.to_owned(),
            image_id: image_id.to_owned(),
            restart_count: 0,
            id: None,
            state: State::Waiting(waiting),
            last: None,
        }
    }

    fn running(&self) -> bool {
        matches!(self.state, State::Running { .. })
    }

    fn to_json(&self) -> Value {
        let running = self.running();
        let mut status = json!({
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id,
            "ready": running,
            "started": running,
            "restartCount": self.restart_count,
            "state": state_json(&self.state),
            "lastState": self.last.as_ref().map_or_else(|| json!({}), |exit| json!({"terminated": terminated_json(exit)})),
        });
        if let Some(id) = &self.id {
            status["containerID"] = json!(id);
        }
        status
    }
}

fn time(at: Timestamp) -> Value {
    serde_json::to_value(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at))
        .unwrap_or(Value::Null)
}

fn state_json(state: &State) -> Value {
    match state {
        State::Waiting(waiting) => {
            json!({"waiting": {"reason": waiting.reason, "message": waiting.message}})
        }
        State::Running { started_at } => json!({"running": {"startedAt": time(*started_at)}}),
        State::Terminated(exit) => json!({"terminated": terminated_json(exit)}),
    }
}

fn terminated_json(exit: &Exit) -> Value {
    let mut terminated = json!({
        "exitCode": exit.code,
        "reason": exit.reason,
        "finishedAt": time(exit.finished_at),
    });
    if let Some(started_at) = exit.started_at {
        terminated["startedAt"] = time(started_at);
    }
    if let Some(message) = &exit.message {
        terminated["message"] = json!(message);
    }
    if let Some(id) = &exit.id {
        terminated["containerID"] = json!(id);
    }
    terminated
}

/// The pod's whole status. `ready_since` is when the `Ready` condition last changed; the
/// runner keeps it between writes.
pub(super) fn pod_status(
    containers: &[ContainerView],
    start_time: Timestamp,
    ready_since: Timestamp,
    terminated: bool,
) -> Value {
    let phase = if terminated {
        let all_zero = containers.iter().all(|c| match &c.state {
            State::Terminated(exit) => exit.code == 0,
            _ => false,
        });
        if all_zero { "Succeeded" } else { "Failed" }
    } else if containers
        .iter()
        .any(|c| matches!(c.state, State::Waiting(_)) && c.last.is_none())
    {
        "Pending"
    } else {
        "Running"
    };
    let ready = if !containers.is_empty() && containers.iter().all(ContainerView::running) {
        "True"
    } else {
        "False"
    };
    let condition = |kind: &str| json!({"type": kind, "status": ready, "lastTransitionTime": time(ready_since)});
    json!({
        "phase": phase,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "startTime": time(start_time),
        "conditions": [condition("Ready"), condition("ContainersReady")],
        "containerStatuses": containers.iter().map(ContainerView::to_json).collect::<Vec<_>>(),
    })
}

/// Whether `status` (from [`pod_status`]) says the pod is ready.
pub(super) fn is_ready(status: &Value) -> bool {
    status
        .pointer("/conditions/0/status")
        .and_then(Value::as_str)
        == Some("True")
}

/// A JSON merge patch that turns `old` into `new` (RFC 7386; removed keys become null).
pub(super) fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    match (old, new) {
        (Value::Object(old), Value::Object(new)) => {
            let mut patch = Map::new();
            for (key, value) in new {
                let change = match old.get(key) {
                    Some(before) => merge_diff(before, value),
                    None => Some(value.clone()),
                };
                if let Some(change) = change {
                    patch.insert(key.clone(), change);
                }
            }
            for key in old.keys().filter(|key| !new.contains_key(*key)) {
                patch.insert(key.clone(), Value::Null);
            }
            (!patch.is_empty()).then_some(Value::Object(patch))
        }
        _ if old == new => None,
        _ => Some(new.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_diff_removes_what_is_gone() {
        let old = json!({"a": {"running": {"x": 1}}, "b": 1, "c": [1]});
        let new = json!({"a": {"waiting": {"r": "y"}}, "b": 1, "c": [1, 2]});
        assert_eq!(
            merge_diff(&old, &new),
            Some(json!({"a": {"waiting": {"r": "y"}, "running": null}, "c": [1, 2]}))
        );
        assert_eq!(merge_diff(&new, &new), None);
    }
}
