//! The demo's mock node: its files under the output directory, its inventory, the
//! ResourceSlices the plugin would publish for it, and the plugin's configuration.

use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kerf_core::alloc::Index;
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};

use crate::error::{Error, Result};

/// Where everything of one demo run lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The output directory.
    pub root: PathBuf,
    /// Per-claim CDI specs (`<root>/cdi`).
    pub cdi_dir: PathBuf,
    /// The kubelet's plugin registry directory (`<root>/plugins_registry`).
    pub registry_dir: PathBuf,
    /// The plugin's own directory: DRA socket and checkpoint (`<root>/plugins/<driver>`).
    pub plugin_dir: PathBuf,
    /// The registration socket.
    pub registration_socket: PathBuf,
    /// The DRA socket.
    pub dra_socket: PathBuf,
    /// The checkpoint file.
    pub checkpoint_file: PathBuf,
    /// The boot ID file the demo writes.
    pub boot_id_file: PathBuf,
    /// An empty driver root: mock GPUs have no driver libraries to mount.
    pub driver_root: PathBuf,
    /// The mock driver root holding the fake GPU tools (`<root>/mock-driver`): apart from
    /// [`Layout::driver_root`], so that containers never get the tools mounted as if they
    /// were the driver's (they are links to the `kerf` binary).
    pub gpu_tools_root: PathBuf,
    /// The MPS root: per-GPU daemon directories and the node-wide shared memory
    /// (`<root>/mps`).
    pub mps_root: PathBuf,
    /// The mock fault file the plugin watches (`<root>/mock-faults.yaml`, its
    /// `--mock-fault-file`); it exists only while the demo declares a fault.
    pub fault_file: PathBuf,
    /// The machine-readable summary.
    pub summary_file: PathBuf,
    /// The claims as allocated, as YAML.
    pub claims_file: PathBuf,
}

impl Layout {
    /// The layout under `root` for `driver`.
    pub fn new(root: &Path, driver: &str) -> Self {
        let plugin_dir = root.join("plugins").join(driver);
        let registry_dir = root.join("plugins_registry");
        Layout {
            root: root.to_owned(),
            cdi_dir: root.join("cdi"),
            registration_socket: registry_dir.join(format!("{driver}-reg.sock")),
            registry_dir,
            dra_socket: plugin_dir.join("dra.sock"),
            checkpoint_file: plugin_dir.join("checkpoint.json"),
            plugin_dir,
            boot_id_file: root.join("boot_id"),
            driver_root: root.join("driver-root"),
            gpu_tools_root: root.join("mock-driver"),
            mps_root: root.join("mps"),
            fault_file: root.join("mock-faults.yaml"),
            summary_file: root.join("summary.json"),
            claims_file: root.join("claims.yaml"),
        }
    }

    /// Creates the directories and the boot ID file. A checkpoint left by an earlier run in
    /// the same directory is removed, so the run starts empty (the plugin then removes that
    /// run's CDI specs as orphans), and so is a fault file of an interrupted run, so the
    /// devices start healthy.
    ///
    /// # Errors
    /// A directory or file cannot be created or removed.
    pub fn create(&self) -> Result<()> {
        for dir in [
            &self.root,
            &self.cdi_dir,
            &self.registry_dir,
            &self.plugin_dir,
            &self.driver_root,
        ] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        match std::fs::remove_file(&self.checkpoint_file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &self.checkpoint_file, e)),
        }
        super::health::remove_fault_file(&self.fault_file).map_err(Error::Config)?;
        std::fs::write(&self.boot_id_file, "kerf-demo-boot\n")
            .map_err(|e| Error::io("write", &self.boot_id_file, e))
    }

    /// Makes [`Layout::gpu_tools_root`] a mock driver root whose `nvidia-smi` and
    /// `nvidia-cuda-mps-control` are links to `program`.
    ///
    /// # Errors
    /// The directories or links cannot be created.
    pub fn install_gpu_tools(&self, program: &Path) -> Result<()> {
        kerf_fake_gpu_tools::install(&self.gpu_tools_root, program)
            .map_err(|e| Error::io("install the fake GPU tools in", &self.gpu_tools_root, e))
    }

    /// The sockets that still exist (none after a clean shutdown).
    pub fn leftover_sockets(&self) -> Vec<PathBuf> {
        [&self.registration_socket, &self.dra_socket]
            .into_iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .cloned()
            .collect()
    }
}

/// The plugin configuration of the demo node: mock discovery, sockets and files under the
/// output directory, no ResourceSlice publishing, no metrics server. With `gpu_tools` the
/// plugin runs the tools of [`Layout::gpu_tools_root`] (installed by
/// [`Layout::install_gpu_tools`]) and so enforces slices; without, slices are accounting only.
pub fn plugin_config(
    layout: &Layout,
    driver: &str,
    node: &str,
    discovery: Discovery,
    gpu_tools: bool,
) -> PluginConfig {
    PluginConfig {
        registration_socket: layout.registration_socket.clone(),
        dra_socket: layout.dra_socket.clone(),
        cdi_dir: layout.cdi_dir.clone(),
        checkpoint_file: layout.checkpoint_file.clone(),
        driver_root: layout.driver_root.clone(),
        boot_id_file: layout.boot_id_file.clone(),
        gpu_tools_root: gpu_tools.then(|| layout.gpu_tools_root.clone()),
        mps_root: layout.mps_root.clone(),
        // No API server: the demo's connections are in memory, not `Connections::kube`.
        ..PluginConfig::under(&layout.root, driver, node, discovery)
    }
}

/// The published devices of the node's slices, in slice order.
pub fn published_devices(slices: &[ResourceSlice]) -> Vec<Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .collect()
}

/// The controller's capacity index over the node, read back from its ResourceSlices as the
/// controller reads them.
pub fn capacity_index(slices: &[ResourceSlice], driver: &str) -> Index {
    let mut index = Index::new();
    for (_, node) in kerf_api::node_gpus_from_slices(slices, driver) {
        index.upsert_node(node);
    }
    index
}

/// The node's inventory as the plugin discovers it.
///
/// # Errors
/// The mock profile or file is invalid.
pub fn discover(config: &PluginConfig) -> Result<Inventory> {
    Ok(kerf_kubelet_plugin::plugin::discover(config)?)
}
