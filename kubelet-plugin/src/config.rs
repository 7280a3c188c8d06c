//! The plugin's resolved configuration, passed in as a value (no env reads in logic).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::crash::CrashStep;
use crate::health::HealthConfig;
use crate::mps_daemons::MpsSettings;

/// Directory of the emulated MIG state under the plugin directory when mock mode has no
/// `--mock-driver-root`: `<plugin dir>/mock-mig`, beside the checkpoint, so that it lives
/// exactly as long as the records that name its instances.
pub(crate) const DEFAULT_MOCK_MIG_DIR: &str = "mock-mig";

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
    /// A plugin of `driver` on `node` whose files and sockets all live under `root`
    /// (`registry/<driver>-reg.sock`, `plugins/<driver>/{dra.sock,checkpoint.json}`, `cdi/`,
    /// `driver-root/`, `mps/`, `boot_id`), finding its GPUs by `discovery`, with MPS daemons as
    /// processes and no work that needs an API server (no publishing, claim status or claim
    /// cache): for tests, benchmarks and the demo, which change what they need with struct
    /// update syntax. The binary builds its configuration from its flags instead.
    pub fn under(root: &Path, driver: &str, node: &str, discovery: Discovery) -> Self {
        let plugin_dir = root.join("plugins").join(driver);
        PluginConfig {
            driver_name: driver.to_owned(),
            node_name: node.to_owned(),
            registration_socket: root.join("registry").join(format!("{driver}-reg.sock")),
            dra_socket: plugin_dir.join("dra.sock"),
            cdi_dir: root.join("cdi"),
            checkpoint_file: plugin_dir.join("checkpoint.json"),
            driver_root: root.join("driver-root"),
            gpu_tools_root: None,
            mps_root: root.join("mps"),
            mps_stop_timeout: Duration::from_secs(10),
            mps_check_interval: Duration::from_secs(5),
            mps_daemons: MpsDaemonMode::Process,
            mps_daemon_image: None,
            mps_start_timeout: Duration::from_secs(60),
            own_pod: None,
            health: HealthConfig::defaults(discovery.is_mock()),
            discovery,
            mock_device_node: PathBuf::from("/dev/null"),
            dynamic_mig: DynamicMigSettings::default(),
            mock_crash_at: None,
            publish_resources: false,
            claim_device_status: false,
            claim_cache: false,
            resync_period: Duration::from_secs(600),
            metrics_address: None,
            boot_id_file: root.join("boot_id"),
        }
    }

    /// Root of mock mode's emulated MIG instances (dynamic MIG): the mock driver root when one
    /// is given, so that its fake `nvidia-smi mig` sees them; otherwise
    /// `<plugin dir>/mock-mig` ([`DEFAULT_MOCK_MIG_DIR`]) beside the
    /// checkpoint that records them. `None` outside mock mode.
    pub fn mock_mig_root(&self) -> Option<PathBuf> {
        if !self.discovery.is_mock() {
            return None;
        }
        Some(self.gpu_tools_root.clone().unwrap_or_else(|| {
            self.dra_socket
                .parent()
                .unwrap_or_else(|| Path::new("."))
                .join(DEFAULT_MOCK_MIG_DIR)
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
