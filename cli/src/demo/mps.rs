//! The MPS daemons the demo's slices are clients of, read back from what the plugin wrote:
//! each MPS device of a claim's CDI spec mounts its GPU's pipe directory at
//! `/run/kerf/mps/<gpu-uuid>` ([`kerf_core::mps`]); whether a daemon runs there is the
//! plugin's own check, [`kerf_kubelet_plugin::mps_daemons::daemon_in`].

use std::path::PathBuf;

use kerf_core::mps::CONTAINER_PIPE_ROOT;
use serde_json::Value;

/// One MPS pipe directory mounted by a CDI device of a spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeMount {
    /// The CDI device's name (`<claim-uid>-<device>`).
    pub device: String,
    /// The daemon's pipe directory on the node.
    pub host: PathBuf,
    /// Where the container sees it (its `CUDA_MPS_PIPE_DIRECTORY`).
    pub container: String,
}

/// Every MPS pipe directory mount of the CDI devices of `spec` (a CDI spec as JSON), in
/// device order; none for a spec without MPS devices.
pub fn pipe_mounts(spec: &Value) -> Vec<PipeMount> {
    let prefix = format!("{CONTAINER_PIPE_ROOT}/");
    let mut found = Vec::new();
    for device in spec["devices"].as_array().into_iter().flatten() {
        let Some(name) = device["name"].as_str() else {
            continue;
        };
        let mounts = device["containerEdits"]["mounts"].as_array();
        for mount in mounts.into_iter().flatten() {
            let (Some(host), Some(container)) =
                (mount["hostPath"].as_str(), mount["containerPath"].as_str())
            else {
                continue;
            };
            if container.starts_with(&prefix) {
                found.push(PipeMount {
                    device: name.to_owned(),
                    host: PathBuf::from(host),
                    container: container.to_owned(),
                });
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_pipe_mounts_of_mps_devices_only() {
        let spec = serde_json::json!({"devices": [
            {"name": "u-gpu-0", "containerEdits": {"env": ["A=1"]}},
            {"name": "u-gpu-1", "containerEdits": {"mounts": [
                {"hostPath": "/m/GPU-1/pipe", "containerPath": "/run/kerf/mps/GPU-1"},
                {"hostPath": "/m/shm", "containerPath": "/dev/shm"}
            ]}}
        ]});
        assert_eq!(
            pipe_mounts(&spec),
            [PipeMount {
                device: "u-gpu-1".to_owned(),
                host: PathBuf::from("/m/GPU-1/pipe"),
                container: "/run/kerf/mps/GPU-1".to_owned(),
            }]
        );
        assert!(pipe_mounts(&serde_json::json!({})).is_empty());
    }
}
