//! A node whose kubelet plugin enforces MPS and time-slicing with the fake GPU tools, and
//! the ways to look at what the tools did: for the plugin's sharing tests and the podman MPS
//! test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kerf_core::mps::PID_FILE;
use kerf_fake_gpu_tools::{Call, calls, install};
use kerf_kubelet_plugin::claim_events::MemoryClaimEvents;
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::PluginConfig;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_proto::client::Claim;
use serde_json::Value;

use super::TestNode;

/// The fake tools, as this package builds them.
pub const TOOLS: &str = env!("CARGO_BIN_EXE_kerf-test-gpu-tools");
/// The MPS control program's name.
pub const CONTROL: &str = "nvidia-cuda-mps-control";
/// The plugin as a process, as this package builds it.
pub const PLUGIN_BINARY: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");

/// A mock node whose plugin runs the fake GPU tools of `kerf-fake-gpu-tools` (built here
/// as `kerf-test-gpu-tools`) in a mock driver root, so that MPS and time slices are enforced.
pub struct MpsNode {
    pub node: TestNode,
    /// The Warning Events the plugin published.
    pub events: Arc<MemoryClaimEvents>,
}

impl MpsNode {
    pub fn new() -> Self {
        Self::with_profile("h100-sxm-80gb:4")
    }

    pub fn with_profile(profile: &str) -> Self {
        let node = TestNode::new(profile);
        install(&node.root.join("tools"), Path::new(TOOLS)).unwrap();
        MpsNode {
            node,
            events: Arc::default(),
        }
    }

    pub fn tools_root(&self) -> PathBuf {
        self.node.root.join("tools")
    }

    pub fn mps_root(&self) -> PathBuf {
        self.node.root.join("mps")
    }

    pub fn config(&self) -> PluginConfig {
        PluginConfig {
            gpu_tools_root: Some(self.tools_root()),
            mps_root: self.mps_root(),
            mps_stop_timeout: Duration::from_secs(2),
            mps_check_interval: Duration::from_millis(50),
            mps_daemons: kerf_kubelet_plugin::config::MpsDaemonMode::Process,
            mps_daemon_image: None,
            mps_start_timeout: Duration::from_secs(60),
            own_pod: None,
            ..self.node.config()
        }
    }

    pub async fn start(&self) -> RunningPlugin {
        let connections = Connections {
            mps_daemon_pods: None,
            device_status: None,
            claim_reader: Arc::new(ApiClaimReader::new(self.node.plugin_client())),
            publisher: None,
            events: Arc::clone(&self.events) as _,
        };
        plugin::start(&self.config(), self.node.inventory(), connections)
            .await
            .unwrap()
    }

    /// The plugin as its own process (`kerf-test-plugin`) with the fake tools, reading the API
    /// server from `kubeconfig`, its stderr in `plugin-<log>.log`: callers add their flags
    /// and spawn it; `program` and `before` put a launcher in front of it.
    pub fn plugin_command(&self, kubeconfig: &Path, log: &str, launcher: &[&str]) -> Command {
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let (program, before) = match launcher.split_first() {
            Some((program, rest)) => (*program, [rest, &[PLUGIN_BINARY]].concat()),
            None => (PLUGIN_BINARY, Vec::new()),
        };
        let log = self.node.root.join(format!("plugin-{log}.log"));
        let mut command = Command::new(program);
        command
            .args(before)
            .args(self.node.plugin_args())
            .arg(format!("--mock-driver-root={}", path(self.tools_root())))
            .arg(format!("--mps-root={}", path(self.mps_root())))
            .arg("--mps-stop-timeout=2s")
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        command
    }

    /// Every Warning Event so far is `MpsDaemonRestarted` for `gpu`, one on each of `claims`
    /// (names, sorted).
    pub fn assert_restart_warned(&self, gpu: &str, claims: &[&str]) {
        let warnings = self.events.warnings();
        let mut warned: Vec<&str> = warnings.iter().map(|w| w.claim.name.as_str()).collect();
        warned.sort_unstable();
        assert_eq!(warned, claims, "{warnings:#?}");
        assert!(
            warnings
                .iter()
                .all(|w| w.reason == "MpsDaemonRestarted" && w.note.contains(gpu)),
            "{warnings:#?}"
        );
    }

    pub fn gpu_uuid(&self, minor: u32) -> String {
        self.node
            .inventory()
            .gpu_by_minor(minor)
            .unwrap()
            .uuid
            .clone()
    }

    pub fn calls(&self) -> Vec<Call> {
        calls(&self.tools_root())
    }

    /// The `nvidia-cuda-mps-control -d` starts recorded for `gpu`.
    pub fn starts(&self, gpu: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.tool == CONTROL && c.args == ["-d"])
            .filter(|c| c.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str) == Some(gpu))
            .collect()
    }

    pub fn pipe(&self, gpu: &str) -> PathBuf {
        self.mps_root().join(gpu).join("pipe")
    }

    pub fn daemon_pid(&self, gpu: &str) -> Option<u32> {
        let pid = std::fs::read_to_string(self.pipe(gpu).join(PID_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }
}

impl Drop for MpsNode {
    /// Daemons are real processes outside the plugin: never leave one behind a test.
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir(self.mps_root()) else {
            return;
        };
        for entry in entries.flatten() {
            let gpu = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = self.daemon_pid(&gpu) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
    }
}

pub fn claim_ref(claim: &Claim) -> ClaimRef {
    ClaimRef {
        namespace: claim.namespace.clone(),
        uid: claim.uid.clone(),
        name: claim.name.clone(),
    }
}

/// Prepares `claims` in one call; per claim its CDI device IDs or the error's text.
pub async fn prepare(plugin: &RunningPlugin, claims: &[&Claim]) -> Vec<Result<Value, String>> {
    let refs: Vec<ClaimRef> = claims.iter().map(|c| claim_ref(c)).collect();
    plugin
        .preparer()
        .prepare(&refs)
        .await
        .into_iter()
        .map(|(_, result)| {
            result
                .map(|devices| {
                    Value::Array(
                        devices
                            .iter()
                            .map(|d| Value::from(d.cdi_device_ids.clone()))
                            .collect(),
                    )
                })
                .map_err(|e| e.to_string())
        })
        .collect()
}

pub async fn unprepare(plugin: &RunningPlugin, claim: &Claim) {
    let results = plugin.preparer().unprepare(&[claim_ref(claim)]).await;
    for (uid, result) in results {
        assert!(result.is_ok(), "unprepare {uid}: {result:?}");
    }
}

/// The directory an open handle holds, even if its path now names another one: what a
/// running container's bind mount of it sees.
pub fn seen_through(held: &std::fs::File) -> PathBuf {
    PathBuf::from(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(held)
    ))
}

pub fn kill_9(pid: u32) {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
}

/// The plugin's metrics count `restarts` successful restarts of `gpu`'s daemon.
pub fn assert_restarts_counted(plugin: &RunningPlugin, gpu: &str, restarts: u32) {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, plugin.registry()).unwrap();
    assert!(
        text.contains(&format!(
            "kerf_mps_daemon_restarts_total{{gpu=\"{gpu}\",result=\"ok\"}} {restarts}"
        )),
        "{text}"
    );
}
