//! The plugin's resolved configuration, passed in as a value (no env reads in logic).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::crash::CrashStep;
use crate::health::HealthConfig;
use crate::mps_daemons::MpsSettings;

/// Which GPUs NVML discovery may make dynamic-MIG GPUs (kerf creates their MIG devices at
/// prepare); see `crate::discovery::DynamicMigPolicy`, which adds the instances kerf's
/// checkpoint records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamicMigSettings {
    /// Dynamic MIG at all (`--dynamic-mig`).
    pub enabled: bool,
    /// Minors of GPUs the admin partitions by hand (`--static-mig-gpus`).
    pub static_gpus: BTreeSet<u32>,
}

/// Where MPS control daemons run (`--mps-daemons`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MpsDaemonMode {
    /// Daemonized children of the plugin: for a plugin without a cluster or outside a pod.
    Process,
    /// One pod per GPU, created through the API in the plugin's namespace and run by the
    /// kubelet, independent of the plugin's container.
    Pod,
}

/// The plugin's own pod, from the downward API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnPod {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.uid`, when passed.
    pub uid: Option<String>,
}

/// Where the GPU inventory comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovery {
    /// Real GPUs through NVML.
    Nvml,
    /// A named mock profile, `PROFILE[:COUNT]`.
    MockProfile(String),
    /// A mock inventory YAML file.
    MockFile(PathBuf),
}

impl Discovery {
    /// True for either mock mode.
    pub fn is_mock(&self) -> bool {
        !matches!(self, Discovery::Nvml)
    }
}

impl PluginConfig {
    /// Root of mock mode's emulated MIG instances (dynamic MIG): the mock driver root when one
    /// is given, so that its fake `nvidia-smi mig` sees them; otherwise
    /// `<plugin dir>/mock-mig` ([`crate::dynamic_mig::mock::DEFAULT_MOCK_MIG_DIR`]) beside the
    /// checkpoint that records them. `None` outside mock mode.
    pub fn mock_mig_root(&self) -> Option<PathBuf> {
        if !self.discovery.is_mock() {
            return None;
        }
        Some(self.gpu_tools_root.clone().unwrap_or_else(|| {
            self.dra_socket
                .parent()
                .unwrap_or_else(|| std::path::Path::new("."))
                .join(crate::dynamic_mig::mock::DEFAULT_MOCK_MIG_DIR)
        }))
    }

    /// How the MPS daemons run, or `None` when MPS and time-slicing are not enforced (mock
    /// mode without a mock driver root).
    pub fn mps_settings(&self) -> Option<MpsSettings> {
        self.gpu_tools_root.as_ref().map(|tools_root| MpsSettings {
            root: self.mps_root.clone(),
            driver_root: tools_root.clone(),
            stop_timeout: self.mps_stop_timeout,
        })
    }
}

/// Everything the plugin needs to run.
#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// DRA driver name.
    pub driver_name: String,
    /// This node's name (the pool name).
    pub node_name: String,
    /// Registration socket the kubelet watches for.
    pub registration_socket: PathBuf,
    /// DRA socket the kubelet calls.
    pub dra_socket: PathBuf,
    /// Directory of per-claim CDI specs.
    pub cdi_dir: PathBuf,
    /// Checkpoint file.
    pub checkpoint_file: PathBuf,
    /// NVIDIA driver root on the host.
    pub driver_root: PathBuf,
    /// Root whose `usr/bin` holds `nvidia-smi` and `nvidia-cuda-mps-control`: the driver root,
    /// a mock driver root, or `None` when MPS and time-slicing are not enforced.
    pub gpu_tools_root: Option<PathBuf>,
    /// Root of the MPS daemons' directories.
    pub mps_root: PathBuf,
    /// Bound on an MPS daemon's stop before it is killed.
    pub mps_stop_timeout: Duration,
    /// Period of the MPS daemon liveness check.
    pub mps_check_interval: Duration,
    /// Where MPS control daemons run.
    pub mps_daemons: MpsDaemonMode,
    /// Image of MPS daemon pods; `None`: the plugin's own.
    pub mps_daemon_image: Option<String>,
    /// Bound on a new MPS daemon's start.
    pub mps_start_timeout: Duration,
    /// The plugin's own pod, when it runs in one and the downward API names it.
    pub own_pod: Option<OwnPod>,
    /// Inventory source.
    pub discovery: Discovery,
    /// Host device backing every device node in mock mode.
    pub mock_device_node: PathBuf,
    /// Which GPUs NVML discovery may make dynamic-MIG GPUs ([`crate::plugin::discover`]).
    pub dynamic_mig: DynamicMigSettings,
    /// GPU health: sources, timeouts, taint effects.
    pub health: HealthConfig,
    /// Mock mode's crash tests only: abort the process right after this step of every
    /// prepare or unprepare (`--mock-crash-at`); `None` on a real node.
    pub mock_crash_at: Option<CrashStep>,
    /// Whether ResourceSlices are published ([`crate::plugin::Connections::kube`] gives the
    /// publisher a client only then).
    pub publish_resources: bool,
    /// Whether prepared claims get their per-device status (`status.devices`) written
    /// ([`crate::plugin::Connections::kube`]).
    pub claim_device_status: bool,
    /// Whether claims are read from a watch of this node's claims rather than GET each time
    /// ([`crate::plugin::Connections::kube`]).
    pub claim_cache: bool,
    /// Periodic ResourceSlice check.
    pub resync_period: Duration,
    /// Address of the `/metrics`, `/healthz` and `/readyz` server, if any.
    pub metrics_address: Option<SocketAddr>,
    /// File holding the boot ID.
    pub boot_id_file: PathBuf,
}
