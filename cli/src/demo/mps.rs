//! The MPS daemons the demo's slices are clients of, read back from what the plugin wrote:
//! each MPS device of a claim's CDI spec mounts its GPU's pipe directory at
//! `/run/kerf/mps/<gpu-uuid>` ([`kerf_core::mps`]), and the daemon's PID file is in that
//! directory while the claim is prepared.

use std::path::{Path, PathBuf};

use kerf_core::mps::{CONTAINER_PIPE_ROOT, PID_FILE};
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

/// The PID in the PID file of the daemon of `pipe`, when that process is alive.
pub fn daemon_pid(pipe: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
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

    #[test]
    fn a_missing_or_dead_pid_file_is_no_daemon() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(daemon_pid(dir.path()), None);
        let write = |text: &str| std::fs::write(dir.path().join(PID_FILE), text).unwrap();
        write(&format!("{}\n", std::process::id()));
        assert_eq!(daemon_pid(dir.path()), Some(std::process::id()));
        write("not a pid\n");
        assert_eq!(daemon_pid(dir.path()), None);
    }
}
