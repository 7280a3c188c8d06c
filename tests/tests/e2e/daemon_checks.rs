//! What the MPS daemon tests (tests/tests/e2e/mps_daemons.rs) decide about kerf's
//! own pods and their own test pods: pure functions over API objects and command output, so
//! they are unit-tested without a cluster. The cluster side is in daemon_pods.rs.
//!
//! The daemon pod's shape is the one the design fixes: labels
//! `app.kubernetes.io/component: mps-control-daemon` and `gpu.kerf.dev/gpu: <GPU UUID>`,
//! `spec.nodeName` set by the plugin, one container; a daemon counts as restarted when the
//! pod's UID, `containerStatuses[0].containerID` or `restartCount` changes.

use std::fmt;
use std::time::Duration;

use anyhow::{Result, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt as _;

use super::cluster::describe_pod;

/// Namespace of kerf's plugin, and so of its MPS daemon pods (deploy/helm/kerf/templates/namespace.yaml).
pub const KERF_NAMESPACE: &str = "kerf-system";
/// The plugin's DaemonSet (deploy/helm/kerf/templates/kubelet-plugin.yaml).
pub const PLUGIN_DAEMON_SET: &str = "kerf-kubelet-plugin";
/// Label selector of the plugin's pods (the DaemonSet's `spec.selector`).
pub const PLUGIN_LABELS: &str =
    "app.kubernetes.io/name=kerf,app.kubernetes.io/component=kubelet-plugin";
/// The container of the test pods (`manifests::pod_spec`).
pub const TEST_CONTAINER: &str = "report";
/// Reason of the Warning Event the plugin puts on every claim of a GPU whose daemon restarted.
pub const DAEMON_RESTARTED: &str = "MpsDaemonRestarted";
/// Reason of the kubelet's Warning Event on a pod whose claims failed to prepare
/// (kubernetes/kubernetes `pkg/kubelet/events/event.go`, `FailedPrepareDynamicResources`).
pub const FAILED_PREPARE: &str = "FailedPrepareDynamicResources";
/// Marker lines of [`PIPE_SCRIPT`]'s output.
const PIPE_MARKER: &str = "kerf-e2e-pipe:";
const CONTROL_MARKER: &str = "kerf-e2e-control:";
/// Run in a test container: where `CUDA_MPS_PIPE_DIRECTORY` points, what is in it, and whether
/// `control` there is a Unix socket (the daemon's, which MPS clients connect to).
pub const PIPE_SCRIPT: &str = r#"d="$CUDA_MPS_PIPE_DIRECTORY"; echo "kerf-e2e-pipe: $d"; [ -n "$d" ] && ls -1a "$d" 2>&1; if [ -S "$d/control" ]; then echo 'kerf-e2e-control: socket'; elif [ -e "$d/control" ]; then echo 'kerf-e2e-control: not a socket'; else echo 'kerf-e2e-control: missing'; fi"#;

/// Label selector of the MPS daemon pods of GPU `uuid`.
pub fn daemon_labels(uuid: &str) -> String {
    format!("app.kubernetes.io/component=mps-control-daemon,gpu.kerf.dev/gpu={uuid}")
}

/// Which daemon runs: the pod and its container's incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonIdentity {
    /// The pod's name.
    pub pod: String,
    /// The pod's UID: another one is another pod.
    pub uid: String,
    /// `containerStatuses[0].containerID`: another one is another container.
    pub container_id: String,
    /// `containerStatuses[0].restartCount`.
    pub restart_count: i32,
}

impl DaemonIdentity {
    /// The identity of a daemon pod whose container runs; otherwise why not.
    ///
    /// # Errors
    /// A description of the pod when it has no UID or its first container does not run.
    pub fn of(pod: &Pod) -> Result<Self, String> {
        let status = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first());
        let running = status
            .and_then(|s| s.state.as_ref())
            .is_some_and(|s| s.running.is_some());
        match (pod.metadata.uid.as_ref(), status) {
            (Some(uid), Some(container)) if running => Ok(DaemonIdentity {
                pod: pod.name_any(),
                uid: uid.clone(),
                container_id: container.container_id.clone().unwrap_or_default(),
                restart_count: container.restart_count,
            }),
            _ => Err(describe_pod(pod)),
        }
    }

    /// What differs in `now` from `self`; empty when it is the same daemon.
    pub fn changes(&self, now: &DaemonIdentity) -> Vec<String> {
        let mut changes = Vec::new();
        if self.uid != now.uid {
            changes.push(format!(
                "pod {} (UID {}) replaced by pod {} (UID {})",
                self.pod, self.uid, now.pod, now.uid
            ));
        }
        if self.container_id != now.container_id {
            changes.push(format!(
                "containerID {:?} became {:?}",
                self.container_id, now.container_id
            ));
        }
        if self.restart_count != now.restart_count {
            changes.push(format!(
                "restartCount {} became {}",
                self.restart_count, now.restart_count
            ));
        }
        changes
    }
}

impl fmt::Display for DaemonIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "daemon pod {} (UID {}, container {}, restartCount {})",
            self.pod, self.uid, self.container_id, self.restart_count
        )
    }
}

/// The pods of `pods` that are not being deleted.
pub fn live(pods: &[Pod]) -> Vec<&Pod> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

/// Whether `pod`'s condition `Ready` is `True`.
pub fn is_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Fails unless `pod` is Running with every container running and never restarted.
///
/// # Errors
/// Which of those does not hold, with the pod's description.
pub fn workload_intact(pod: &Pod) -> Result<()> {
    let status = pod.status.as_ref();
    ensure!(
        status.and_then(|s| s.phase.as_deref()) == Some("Running"),
        "the workload pod is no longer Running: {}",
        describe_pod(pod)
    );
    let containers = status.and_then(|s| s.container_statuses.as_ref());
    ensure!(
        containers.is_some_and(|c| !c.is_empty()),
        "the workload pod reports no container: {}",
        describe_pod(pod)
    );
    for container in containers.into_iter().flatten() {
        let running = container
            .state
            .as_ref()
            .is_some_and(|s| s.running.is_some());
        ensure!(
            running && container.restart_count == 0,
            "the workload's container {} was restarted or stopped (restartCount {}): {}",
            container.name,
            container.restart_count,
            describe_pod(pod)
        );
    }
    Ok(())
}

/// What [`PIPE_SCRIPT`] printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeCheck {
    /// `CUDA_MPS_PIPE_DIRECTORY` in the container (empty when unset).
    pub directory: String,
    /// What `ls -1a` listed there (with `.` and `..`, or ls's error).
    pub entries: Vec<String>,
    /// `socket`, `not a socket` or `missing`: what `control` is.
    pub control: String,
}

impl PipeCheck {
    /// Parses [`PIPE_SCRIPT`]'s output.
    ///
    /// # Errors
    /// When a marker line is missing: the script did not run to its end.
    pub fn parse(output: &str) -> Result<Self> {
        let mut directory = None;
        let mut control = None;
        let mut entries = Vec::new();
        for line in output.lines().map(str::trim_end) {
            if let Some(value) = line.strip_prefix(PIPE_MARKER) {
                directory = Some(value.trim().to_owned());
            } else if let Some(value) = line.strip_prefix(CONTROL_MARKER) {
                control = Some(value.trim().to_owned());
            } else if !line.is_empty() {
                entries.push(line.to_owned());
            }
        }
        match (directory, control) {
            (Some(directory), Some(control)) => Ok(PipeCheck {
                directory,
                entries,
                control,
            }),
            _ => bail!("the pipe-directory check did not run to its end; it printed:\n{output}"),
        }
    }

    /// Why a client in the container could not reach its daemon, or `None`.
    pub fn problem(&self) -> Option<String> {
        if self.directory.is_empty() {
            return Some("the container has no CUDA_MPS_PIPE_DIRECTORY".to_owned());
        }
        (self.control != "socket").then(|| {
            format!(
                "{}/control is {} (the directory holds {:?})",
                self.directory, self.control, self.entries
            )
        })
    }
}

/// Why `daemon_set` would not roll one node with the old and the new plugin side by side:
/// that needs `maxSurge: 1, maxUnavailable: 0`. `None` when it does.
pub fn rolling_update_problem(daemon_set: &DaemonSet) -> Option<String> {
    let strategy = daemon_set
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref());
    let kind = strategy
        .and_then(|s| s.type_.as_deref())
        .unwrap_or("RollingUpdate");
    if kind != "RollingUpdate" {
        return Some(format!("updateStrategy.type is {kind}, not RollingUpdate"));
    }
    let rolling = strategy.and_then(|s| s.rolling_update.as_ref());
    // The API server's defaults (apps/v1 SetDefaults_DaemonSet): maxUnavailable 1, maxSurge 0.
    let surge = rolling.and_then(|r| r.max_surge.clone());
    let unavailable = rolling.and_then(|r| r.max_unavailable.clone());
    let zero = |v: &Option<IntOrString>| match v {
        Some(IntOrString::Int(n)) => *n == 0,
        Some(IntOrString::String(s)) => s.trim_end_matches('%').trim() == "0",
        None => false,
    };
    let no_surge = surge.is_none() || zero(&surge);
    let may_stop_first = unavailable.is_none() || !zero(&unavailable);
    (no_surge || may_stop_first).then(|| {
        format!(
            "rollingUpdate maxSurge {surge:?}, maxUnavailable {unavailable:?}: the old plugin would stop before the new one runs (side by side needs maxSurge: 1, maxUnavailable: 0)"
        )
    })
}

/// How long a rollout of `desired` plugin pods may take: a minute a node, at least `timeout`.
pub fn rollout_bound(timeout: Duration, desired: i32) -> Duration {
    let per_node = Duration::from_secs(60) * u32::try_from(desired.max(1)).unwrap_or(1);
    per_node.max(timeout)
}

/// The daemon among `pods` (the pods with GPU `uuid`'s daemon labels on `node`): exactly one
/// live pod, its container running.
///
/// # Errors
/// No live pod, several, or one whose container does not run, in words.
pub fn only_daemon(pods: &[Pod], node: &str, uuid: &str) -> Result<DaemonIdentity> {
    match live(pods).as_slice() {
        [pod] => {
            DaemonIdentity::of(pod).map_err(|seen| anyhow!("its container does not run: {seen}"))
        }
        [] => bail!(
            "no MPS daemon pod for GPU {uuid} on node {node} in {KERF_NAMESPACE} (is the plugin running with --mps-daemons=pod?); pods with its labels: {:?}",
            pods.iter().map(describe_pod).collect::<Vec<_>>()
        ),
        several => bail!(
            "{} live MPS daemon pods for GPU {uuid} on node {node}: {:?}",
            several.len(),
            several.iter().map(|p| describe_pod(p)).collect::<Vec<_>>()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::{
        DaemonSetSpec, DaemonSetUpdateStrategy, RollingUpdateDaemonSet,
    };
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateWaiting, ContainerStatus, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    fn daemon_pod(uid: &str, id: &str, restarts: i32, running: bool) -> Pod {
        let state = if running {
            ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            }
        } else {
            ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("CrashLoopBackOff".to_owned()),
                    message: None,
                }),
                ..ContainerState::default()
            }
        };
        Pod {
            metadata: ObjectMeta {
                name: Some("kerf-mps-gpu".to_owned()),
                uid: Some(uid.to_owned()),
                ..ObjectMeta::default()
            },
            spec: None,
            status: Some(PodStatus {
                phase: Some("Running".to_owned()),
                container_statuses: Some(vec![ContainerStatus {
                    name: "mps-control-daemon".to_owned(),
                    container_id: Some(id.to_owned()),
                    restart_count: restarts,
                    state: Some(state),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn a_daemon_is_the_same_only_with_the_same_pod_container_and_restarts() {
        let before = DaemonIdentity::of(&daemon_pod("u1", "containerd://a", 0, true)).unwrap();
        assert_eq!(before.pod, "kerf-mps-gpu");
        assert!(before.changes(&before.clone()).is_empty());
        let restarted = DaemonIdentity::of(&daemon_pod("u1", "containerd://b", 1, true)).unwrap();
        let changes = before.changes(&restarted);
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert!(
            changes[1].contains("restartCount 0 became 1"),
            "{changes:?}"
        );
        let replaced = DaemonIdentity::of(&daemon_pod("u2", "containerd://a", 0, true)).unwrap();
        assert!(before.changes(&replaced)[0].contains("UID u1"));
        let waiting = DaemonIdentity::of(&daemon_pod("u1", "containerd://a", 3, false));
        assert!(waiting.unwrap_err().contains("CrashLoopBackOff"));
    }

    #[test]
    fn one_live_running_daemon_pod_is_the_daemon() {
        let pod = daemon_pod("u1", "c", 0, true);
        let found = only_daemon(std::slice::from_ref(&pod), "n", "GPU-1").unwrap();
        assert_eq!(found.uid, "u1");
        let none = only_daemon(&[], "n", "GPU-1").unwrap_err().to_string();
        assert!(none.contains("--mps-daemons=pod"), "{none}");
        let two = [pod.clone(), daemon_pod("u2", "c", 0, true)];
        assert!(
            only_daemon(&two, "n", "GPU-1")
                .unwrap_err()
                .to_string()
                .starts_with("2 live")
        );
        let stopped = daemon_pod("u1", "c", 0, false);
        assert!(only_daemon(&[stopped], "n", "GPU-1").is_err());
    }

    #[test]
    fn deleting_pods_are_not_live_and_workloads_must_not_restart() {
        let mut deleting = daemon_pod("u1", "c", 0, true);
        deleting.metadata.deletion_timestamp = Some(
            serde_json::from_value::<Time>(serde_json::json!("2026-01-01T00:00:00Z")).unwrap(),
        );
        let pods = [deleting, daemon_pod("u2", "c", 0, true)];
        let live = live(&pods);
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].metadata.uid.as_deref(), Some("u2"));

        workload_intact(&daemon_pod("w", "c", 0, true)).unwrap();
        let restarted = workload_intact(&daemon_pod("w", "c", 1, true)).unwrap_err();
        assert!(
            restarted.to_string().contains("restartCount 1"),
            "{restarted}"
        );
        assert!(workload_intact(&daemon_pod("w", "c", 0, false)).is_err());
        let mut pending = daemon_pod("w", "c", 0, true);
        pending.status.as_mut().unwrap().phase = Some("Pending".to_owned());
        assert!(workload_intact(&pending).is_err());
    }

    #[test]
    fn the_pipe_check_wants_a_control_socket() {
        let good = PipeCheck::parse(
            "kerf-e2e-pipe: /run/kerf/mps/GPU-1\n.\n..\ncontrol\nlog\nkerf-e2e-control: socket\n",
        )
        .unwrap();
        assert_eq!(good.directory, "/run/kerf/mps/GPU-1");
        assert_eq!(good.entries, [".", "..", "control", "log"]);
        assert_eq!(good.problem(), None);
        let missing = PipeCheck::parse(
            "kerf-e2e-pipe: /run/kerf/mps/GPU-1\n.\n..\nkerf-e2e-control: missing",
        )
        .unwrap();
        assert!(missing.problem().unwrap().contains("control is missing"));
        let unset = PipeCheck::parse("kerf-e2e-pipe:\nkerf-e2e-control: missing").unwrap();
        assert!(
            unset
                .problem()
                .unwrap()
                .contains("no CUDA_MPS_PIPE_DIRECTORY")
        );
        assert!(PipeCheck::parse("kerf-e2e-pipe: /x\n").is_err());
        // The script prints exactly the markers the parser reads.
        assert!(PIPE_SCRIPT.contains(PIPE_MARKER) && PIPE_SCRIPT.contains(CONTROL_MARKER));
    }

    fn daemon_set(surge: Option<IntOrString>, unavailable: Option<IntOrString>) -> DaemonSet {
        DaemonSet {
            spec: Some(DaemonSetSpec {
                update_strategy: Some(DaemonSetUpdateStrategy {
                    type_: Some("RollingUpdate".to_owned()),
                    rolling_update: Some(RollingUpdateDaemonSet {
                        max_surge: surge,
                        max_unavailable: unavailable,
                    }),
                }),
                ..DaemonSetSpec::default()
            }),
            ..DaemonSet::default()
        }
    }

    #[test]
    fn only_a_surging_roll_keeps_a_plugin_running() {
        let int = IntOrString::Int;
        assert_eq!(
            rolling_update_problem(&daemon_set(Some(int(1)), Some(int(0)))),
            None
        );
        let pct = |s: &str| Some(IntOrString::String(s.to_owned()));
        assert_eq!(
            rolling_update_problem(&daemon_set(pct("10%"), pct("0%"))),
            None
        );
        // the chart before the MPS daemon pods, and the API server's defaults.
        assert!(rolling_update_problem(&daemon_set(Some(int(0)), Some(int(1)))).is_some());
        assert!(rolling_update_problem(&daemon_set(None, None)).is_some());
        assert!(rolling_update_problem(&daemon_set(Some(int(1)), None)).is_some());
        assert!(rolling_update_problem(&DaemonSet::default()).is_some());
    }

    #[test]
    fn selectors_and_bounds() {
        assert_eq!(
            daemon_labels("GPU-1"),
            "app.kubernetes.io/component=mps-control-daemon,gpu.kerf.dev/gpu=GPU-1"
        );
        let timeout = Duration::from_secs(180);
        assert_eq!(rollout_bound(timeout, 1), timeout);
        assert_eq!(rollout_bound(timeout, 5), Duration::from_secs(300));
        assert_eq!(rollout_bound(timeout, 0), timeout);
    }
}
