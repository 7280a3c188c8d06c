//! Command-line flags of `kerf-kubelet-plugin`; every flag is also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

use crate::config::DynamicMigSettings;
use crate::config::{Discovery, PluginConfig};
use crate::crash::CrashStep;
use crate::health::{HealthConfig, resend_interval_for};
use crate::{Error, Result};
use kerf_core::health::{TaintEffect, TaintPolicy};
use kerf_ops::logging::LogFormat;

/// kerf kubelet plugin: registers with the kubelet, publishes this node's GPUs as
/// ResourceSlices and prepares allocated ResourceClaims as CDI devices.
#[derive(Debug, Clone, Parser)]
#[command(name = "kerf-kubelet-plugin", version, about, long_about = None)]
pub struct Args {
    /// DRA driver name: the ResourceSlice driver, the CDI vendor and the socket names derive from it.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    pub driver_name: String,

    /// Name of this node; the ResourceSlice pool name. Usually set from the downward API.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// Directory where the kubelet looks for plugin registration sockets.
    #[arg(
        long,
        env = "KERF_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub registry_dir: PathBuf,

    /// Directory of the DRA socket and the checkpoint [default: /var/lib/kubelet/plugins/<driver-name>].
    #[arg(long, env = "KERF_PLUGIN_DIR")]
    pub plugin_dir: Option<PathBuf>,

    /// Directory for the per-claim CDI spec files; the container runtime must read it. A tmpfs
    /// on most nodes (/var/run); specs are replaced atomically without fsync and rebuilt from
    /// the checkpoint at start-up, so a directory on a disk costs no flushes either.
    #[arg(long, env = "KERF_CDI_DIR", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,

    /// Checkpoint file of prepared claims [default: <plugin-dir>/checkpoint.json].
    #[arg(long, env = "KERF_CHECKPOINT_FILE")]
    pub checkpoint_file: Option<PathBuf>,

    /// Root of the NVIDIA driver installation whose libraries and binaries are mounted into
    /// containers (`/` for a host install, `/run/nvidia/driver` for the GPU operator).
    #[arg(long, env = "KERF_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,

    /// Use a named mock inventory instead of NVML: PROFILE[:COUNT], e.g. h100-sxm-80gb:4
    /// (profiles: h100-sxm-80gb, a100-40gb-mig, l4).
    #[arg(long, env = "KERF_MOCK_GPUS", conflicts_with = "mock_inventory")]
    pub mock_gpus: Option<String>,

    /// Use a mock inventory from a YAML file instead of NVML.
    #[arg(long, env = "KERF_MOCK_INVENTORY")]
    pub mock_inventory: Option<PathBuf>,

    /// Mock mode: a YAML file of GPU faults (device name or UUID -> list of faults), re-read
    /// when it changes; a missing file means every GPU is healthy.
    #[arg(long, env = "KERF_MOCK_FAULT_FILE")]
    pub mock_fault_file: Option<PathBuf>,

    /// Health check timeout sent to the kubelet: a device without an update for this long is
    /// shown as Unknown. The full health list is sent again every third of it.
    #[arg(long, env = "KERF_HEALTH_CHECK_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub health_check_timeout: Duration,

    /// How often NVML is asked for lost GPUs, uncorrected ECC counts and throttling.
    #[arg(long, env = "KERF_NVML_HEALTH_POLL_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub nvml_health_poll_interval: Duration,

    /// XIDs to ignore besides the application XIDs 13, 31, 43, 45, 68 and 109 (comma-separated).
    #[arg(long, env = "KERF_ADDITIONAL_XIDS_TO_IGNORE", value_delimiter = ',')]
    pub additional_xids_to_ignore: Vec<u64>,

    /// Taint effect of a device with a non-fatal fault: None, NoSchedule or NoExecute.
    #[arg(
        long,
        env = "KERF_UNHEALTHY_TAINT_EFFECT",
        default_value = "NoSchedule"
    )]
    pub unhealthy_taint_effect: TaintEffect,

    /// Taint effect of a device with a fatal fault (GPU lost, uncorrected ECC, fatal XIDs):
    /// None, NoSchedule or NoExecute.
    #[arg(long, env = "KERF_FATAL_TAINT_EFFECT", default_value = "NoExecute")]
    pub fatal_taint_effect: TaintEffect,

    /// In mock mode, the host character device every GPU device node is backed by.
    #[arg(long, env = "KERF_MOCK_DEVICE_NODE", default_value = "/dev/null")]
    pub mock_device_node: PathBuf,

    /// In mock mode, a directory whose usr/bin holds stand-ins for nvidia-smi and
    /// nvidia-cuda-mps-control (kerf-fake-gpu-tools), so that MPS daemons and time slices run
    /// without a GPU; without it mock mode does not enforce MPS or time-slicing.
    #[arg(long, env = "KERF_MOCK_DRIVER_ROOT")]
    pub mock_driver_root: Option<PathBuf>,

    /// Mock mode only, for crash-safety tests: abort the process right after this step of
    /// every prepare or unprepare (after-start, after-gi-create, after-ci-create, after-record,
    /// after-sharing, after-spec-write, after-cdi-write, after-spec-remove, after-entry-remove),
    /// as a SIGKILL there would stop it.
    #[arg(long, env = "KERF_MOCK_CRASH_AT", value_enum)]
    pub mock_crash_at: Option<CrashStep>,

    /// Create MIG devices on demand (dynamic MIG) on GPUs in MIG mode that have no MIG device
    /// kerf did not create, when the API server serves partitionable devices (1.36+). Off:
    /// such GPUs are published as before (only their existing MIG devices).
    #[arg(long, env = "KERF_DYNAMIC_MIG", default_value_t = true, action = clap::ArgAction::Set)]
    pub dynamic_mig: bool,

    /// Minors of GPUs whose MIG devices the admin partitions by hand (comma-separated, e.g.
    /// 0,3): never dynamic MIG, their existing MIG devices are published.
    #[arg(long, env = "KERF_STATIC_MIG_GPUS", value_delimiter = ',')]
    pub static_mig_gpus: Vec<u32>,

    /// Root of the per-GPU MPS daemon directories (<root>/<gpu-uuid>/{pipe,log,shm}, the shm
    /// one a daemon pod's /dev/shm) and, with daemon processes, of the shared-memory directory
    /// <root>/shm, which must then also be this process's /dev/shm.
    #[arg(long, env = "KERF_MPS_ROOT", default_value = kerf_core::mps::DEFAULT_MPS_ROOT)]
    pub mps_root: PathBuf,

    /// How long an MPS daemon may take to stop after `quit` before it is killed.
    #[arg(long, env = "KERF_MPS_STOP_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub mps_stop_timeout: Duration,

    /// Run behind a minimal init that reaps the orphans of the tools the plugin starts (the
    /// MPS control daemons daemonize): `auto` when the process is PID 1, as in a container;
    /// `always`; `never`. See docs/design.md, "Slices on the GPU".
    #[arg(
        long,
        env = "KERF_INIT",
        value_enum,
        default_value = "auto",
        overrides_with = "init"
    )]
    pub init: crate::reaper::InitMode,

    /// How often the MPS daemons of GPUs with MPS claims are checked and restarted if dead.
    #[arg(long, env = "KERF_MPS_CHECK_INTERVAL", default_value = "5s", value_parser = humantime::parse_duration)]
    pub mps_check_interval: Duration,

    /// Where the MPS control daemons run: `pod`, one pod per GPU in the plugin's namespace,
    /// created through the API and run by the kubelet, so that no plugin restart, upgrade or
    /// OOM kill stops one (needs --pod-name and --pod-namespace); `process`, children of the
    /// plugin that daemonize (no cluster, `kerf demo`). See docs/design.md, "Slices on the GPU".
    #[arg(long, env = "KERF_MPS_DAEMONS", value_enum, default_value = "process")]
    pub mps_daemons: crate::config::MpsDaemonMode,

    /// Image of the MPS daemon pods [default: the plugin's own image, read from its pod].
    #[arg(long, env = "KERF_MPS_DAEMON_IMAGE")]
    pub mps_daemon_image: Option<String>,

    /// How long a new MPS daemon (its pod scheduled, pulled and started) may take to accept
    /// connections before the prepare that needs it fails.
    #[arg(long, env = "KERF_MPS_START_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub mps_start_timeout: Duration,

    /// Name of the plugin's own pod (downward API `metadata.name`).
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,

    /// Namespace of the plugin's own pod (downward API `metadata.namespace`); MPS daemon pods
    /// are created there.
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,

    /// UID of the plugin's own pod (downward API `metadata.uid`): the registration and DRA
    /// sockets carry it, so that two plugin instances run side by side during a rolling
    /// update (kubelet 1.33+).
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,

    /// Publish this node's GPUs as ResourceSlices (switch off for tests).
    #[arg(long, env = "KERF_PUBLISH_RESOURCES", default_value_t = true, action = ArgAction::Set)]
    pub publish_resources: bool,

    /// Write each prepared claim's per-device status (`status.devices`: GPU UUID, slice,
    /// sharing, MPS pipe directory, a Ready condition) after the prepare.
    #[arg(long, env = "KERF_CLAIM_DEVICE_STATUS", default_value_t = true, action = ArgAction::Set)]
    pub claim_device_status: bool,

    /// Prepare claims from a watch of this node's claims (label gpu.kerf.dev/node), GETting a
    /// claim only when the watch does not hold it allocated here; false GETs every claim.
    /// The watch needs list and watch on resourceclaims.
    #[arg(long, env = "KERF_CLAIM_CACHE", default_value_t = true, action = ArgAction::Set)]
    pub claim_cache: bool,

    /// How often the published ResourceSlices are checked even without a watch event.
    #[arg(long, env = "KERF_RESYNC_PERIOD", default_value = "10m", value_parser = humantime::parse_duration)]
    pub resync_period: Duration,

    /// Address of the HTTP server for /metrics, /healthz and /readyz; empty to disable.
    #[arg(long, env = "KERF_METRICS_ADDRESS", default_value = "0.0.0.0:8080")]
    pub metrics_address: String,

    /// File holding the node's boot ID, recorded in the checkpoint.
    #[arg(
        long,
        env = "KERF_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    pub boot_id_file: PathBuf,

    /// Log format.
    #[arg(long, env = "KERF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax, e.g. `info,kerf_kubelet_plugin=debug`.
    #[arg(long, env = "KERF_LOG", default_value = "info")]
    pub log_filter: String,
}

impl Args {
    /// The health settings of the flags.
    ///
    /// # Errors
    /// [`Error::Config`] for a health check timeout under one second, a zero poll interval,
    /// or a mock fault file without a mock inventory.
    fn health_config(&self) -> Result<HealthConfig> {
        if self.health_check_timeout < Duration::from_secs(1) {
            return Err(Error::Config(format!(
                "--health-check-timeout {:?}: must be at least 1s (the kubelet counts whole seconds)",
                self.health_check_timeout
            )));
        }
        if self.nvml_health_poll_interval.is_zero() {
            return Err(Error::Config(
                "--nvml-health-poll-interval must be more than 0".into(),
            ));
        }
        let mock = self.mock_gpus.is_some() || self.mock_inventory.is_some();
        if let (Some(path), false) = (&self.mock_fault_file, mock) {
            return Err(Error::Config(format!(
                "--mock-fault-file {}: needs a mock inventory (--mock-gpus or --mock-inventory)",
                path.display()
            )));
        }
        Ok(HealthConfig {
            check_timeout: self.health_check_timeout,
            resend_interval: resend_interval_for(self.health_check_timeout),
            nvml_poll_interval: self.nvml_health_poll_interval,
            extra_ignored_xids: self.additional_xids_to_ignore.clone(),
            mock_fault_file: self.mock_fault_file.clone(),
            mock_annotation: mock,
            taint_policy: TaintPolicy {
                unhealthy: self.unhealthy_taint_effect,
                fatal: self.fatal_taint_effect,
            },
            ..HealthConfig::defaults(mock)
        })
    }

    /// The prepare or unprepare step to abort after (`--mock-crash-at`), if any.
    ///
    /// # Errors
    /// [`Error::Config`] when it is given without a mock inventory: a real node never
    /// crashes on purpose.
    fn mock_crash_at(&self) -> Result<Option<CrashStep>> {
        let mock = self.mock_gpus.is_some() || self.mock_inventory.is_some();
        match (self.mock_crash_at, mock) {
            (Some(step), false) => Err(Error::Config(format!(
                "--mock-crash-at {}: needs a mock inventory (--mock-gpus or --mock-inventory)",
                step.as_str()
            ))),
            (step, _) => Ok(step),
        }
    }

    /// Which GPUs NVML discovery may make dynamic-MIG GPUs (`--dynamic-mig`,
    /// `--static-mig-gpus`). Mock inventories carry their own choice.
    fn dynamic_mig_settings(&self) -> DynamicMigSettings {
        DynamicMigSettings {
            enabled: self.dynamic_mig,
            static_gpus: self.static_mig_gpus.iter().copied().collect(),
        }
    }

    /// Resolves defaults that depend on other flags and checks the values: the whole
    /// configuration the plugin starts with ([`crate::run`]).
    ///
    /// # Errors
    /// An invalid driver, node or pod name; [`Error::Config`] for an unparsable metrics
    /// address, flags that exclude each other, a health flag out of range, or a mock-only flag
    /// (`--mock-fault-file`, `--mock-crash-at`, `--mock-driver-root`) without a mock inventory.
    pub fn into_config(self) -> Result<PluginConfig> {
        let health = self.health_config()?;
        let mock_crash_at = self.mock_crash_at()?;
        let dynamic_mig = self.dynamic_mig_settings();
        kerf_core::names::driver_name("--driver-name", &self.driver_name)?;
        kerf_core::names::object_name("--node-name", &self.node_name)?;
        let plugin_dir = self
            .plugin_dir
            .unwrap_or_else(|| PathBuf::from("/var/lib/kubelet/plugins").join(&self.driver_name));
        let checkpoint_file = self
            .checkpoint_file
            .unwrap_or_else(|| plugin_dir.join("checkpoint.json"));
        let metrics_address = parse_address(&self.metrics_address)?;
        check_mps_root(&self.mps_root)?;
        check_mps_check_interval(self.mps_check_interval)?;
        let discovery = discovery(self.mock_gpus, self.mock_inventory)?;
        let gpu_tools_root = gpu_tools_root(&discovery, &self.driver_root, self.mock_driver_root)?;
        let own_pod = own_pod(self.pod_name, self.pod_namespace, self.pod_uid)?;
        if self.mps_daemons == crate::config::MpsDaemonMode::Pod && own_pod.is_none() {
            return Err(Error::Config(
                "--mps-daemons=pod needs --pod-name and --pod-namespace (POD_NAME, POD_NAMESPACE from the downward API)".into(),
            ));
        }
        let (registration_socket, dra_socket) = socket_paths(
            &self.registry_dir,
            &plugin_dir,
            &self.driver_name,
            own_pod.as_ref().and_then(|p| p.uid.as_deref()),
        )?;
        Ok(PluginConfig {
            registration_socket,
            dra_socket,
            driver_name: self.driver_name,
            node_name: self.node_name,
            cdi_dir: self.cdi_dir,
            checkpoint_file,
            driver_root: self.driver_root,
            gpu_tools_root,
            mps_root: self.mps_root,
            mps_stop_timeout: self.mps_stop_timeout,
            mps_check_interval: self.mps_check_interval,
            mps_daemons: self.mps_daemons,
            mps_daemon_image: self.mps_daemon_image,
            mps_start_timeout: self.mps_start_timeout,
            own_pod,
            discovery,
            mock_device_node: self.mock_device_node,
            dynamic_mig,
            health,
            mock_crash_at,
            publish_resources: self.publish_resources,
            claim_device_status: self.claim_device_status,
            claim_cache: self.claim_cache,
            resync_period: self.resync_period,
            metrics_address,
            boot_id_file: self.boot_id_file,
        })
    }
}

/// The flags of `kerf-kubelet-plugin mps-control-daemon`, the program of an MPS daemon pod, as
/// clap defines them (for the flag reference in docs/configuration.md).
pub fn mps_control_daemon_command() -> clap::Command {
    <crate::mps_control_daemon::DaemonArgs as clap::CommandFactory>::command()
}

/// `--mps-check-interval` must be more than 0.
fn check_mps_check_interval(interval: Duration) -> Result<()> {
    if interval.is_zero() {
        return Err(Error::Config(
            "--mps-check-interval must be more than 0".into(),
        ));
    }
    Ok(())
}

/// The inventory source of `--mock-gpus` / `--mock-inventory`: NVML without either.
fn discovery(mock_gpus: Option<String>, mock_inventory: Option<PathBuf>) -> Result<Discovery> {
    match (mock_gpus, mock_inventory) {
        (Some(spec), None) => Ok(Discovery::MockProfile(spec)),
        (None, Some(path)) => Ok(Discovery::MockFile(path)),
        (None, None) => Ok(Discovery::Nvml),
        (Some(_), Some(_)) => Err(Error::Config(
            "--mock-gpus and --mock-inventory exclude each other".into(),
        )),
    }
}

/// Where `nvidia-smi` and `nvidia-cuda-mps-control` come from: the driver root on a real node,
/// the mock driver root (if any) in mock mode.
///
/// # Errors
/// [`Error::Config`] for `--mock-driver-root` without a mock inventory.
fn gpu_tools_root(
    discovery: &Discovery,
    driver_root: &std::path::Path,
    mock_driver_root: Option<PathBuf>,
) -> Result<Option<PathBuf>> {
    match (discovery, mock_driver_root) {
        (Discovery::Nvml, None) => Ok(Some(driver_root.to_owned())),
        (Discovery::Nvml, Some(_)) => Err(Error::Config(
            "--mock-driver-root needs a mock inventory (--mock-gpus or --mock-inventory)".into(),
        )),
        (_, mock_root) => Ok(mock_root),
    }
}

/// The plugin's own pod, when the downward API names it: name and namespace together, the UID
/// optional (older manifests do not pass it).
fn own_pod(
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
) -> Result<Option<crate::config::OwnPod>> {
    match (name, namespace) {
        (Some(name), Some(namespace)) => {
            kerf_core::names::object_name("--pod-name", &name)?;
            kerf_core::names::object_name("--pod-namespace", &namespace)?;
            Ok(Some(crate::config::OwnPod {
                name,
                namespace,
                uid: uid.filter(|u| !u.is_empty()),
            }))
        }
        (None, None) => Ok(None),
        (Some(_), None) | (None, Some(_)) => Err(Error::Config(
            "--pod-name and --pod-namespace go together".into(),
        )),
    }
}

/// The registration and DRA sockets, named as upstream's helper names them
/// (`k8s.io/dynamic-resource-allocation/kubeletplugin`, `draplugin.go`, `Start` with the
/// `RollingUpdate(uid)` option): `<registry>/<driver>-<uid>-reg.sock` and
/// `<plugin-dir>/dra-<uid>.sock` with the pod's UID, so that the instance of a rolling update
/// binds its own sockets beside the old instance's and the kubelet (1.33+, which keeps every
/// registered endpoint of a driver) holds both; without a UID the fixed names
/// `<driver>-reg.sock` and `dra.sock`, which one instance at a time uses.
///
/// # Errors
/// [`Error::Config`] for a UID that is not a valid UID (it becomes part of a file name).
fn socket_paths(
    registry_dir: &std::path::Path,
    plugin_dir: &std::path::Path,
    driver_name: &str,
    pod_uid: Option<&str>,
) -> Result<(PathBuf, PathBuf)> {
    let uid_part = match pod_uid {
        Some(uid) => format!("-{}", kerf_core::names::claim_uid("--pod-uid", uid)?),
        None => String::new(),
    };
    Ok((
        registry_dir.join(format!("{driver_name}{uid_part}-reg.sock")),
        plugin_dir.join(format!("dra{uid_part}.sock")),
    ))
}

/// The MPS root ends up in CDI specs (JSON) and in mounts: absolute and UTF-8.
///
/// # Errors
/// [`Error::Config`] naming `--mps-root` and its value.
pub(crate) fn check_mps_root(root: &std::path::Path) -> Result<()> {
    if root.is_absolute() && root.to_str().is_some() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "--mps-root {}: must be an absolute UTF-8 path",
            root.display()
        )))
    }
}

fn parse_address(value: &str) -> Result<Option<SocketAddr>> {
    kerf_ops::parse_listen_address("--metrics-address", value).map_err(Error::Config)
}

#[cfg(test)]
mod tests;
