//! A mock node beside the main one — the dynamic-MIG node ([`super::mig`]) and the node of
//! shareable GPUs ([`super::shareable`]): its files under `<output>/<name>`, its inventory and
//! ResourceSlices, and its own kubelet plugin, which the kubelet stand-in visits once the
//! pods are allocated.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::health::HealthConfig;
use kerf_kubelet_plugin::plugin::{self, Connections};

use super::allocate::PodOutcome;
use super::claim_store::MemoryClaimReader;
use super::kubelet_visit::{self, NodeRun, NodeVisit};
use super::node::{self, Layout};
use super::scheduler;
use super::workload::Workload;
use crate::error::Result;

/// A node beside the main one, before its plugin runs.
pub(super) struct ExtraNode {
    /// Its name (the pool name).
    pub(super) name: String,
    /// How the summary names its inventory.
    pub(super) inventory_text: String,
    pub(super) layout: Layout,
    pub(super) plugin_config: PluginConfig,
    pub(super) inventory: Inventory,
    /// Its ResourceSlices as its plugin publishes them.
    pub(super) slices: Vec<ResourceSlice>,
    /// The devices of [`ExtraNode::slices`], in slice order.
    pub(super) devices: Vec<Device>,
}

impl ExtraNode {
    /// Lays the node out under `<output>/<name>`, installs the fake GPU tools there (so that
    /// its plugin runs its own MPS daemons and its own emulated MIG state) and discovers its
    /// GPUs; it publishes nothing until [`ExtraNode::with_slices`]. `flag` names the option
    /// the name came from, for the error.
    ///
    /// # Errors
    /// A bad name, the directories or the tools cannot be created, or the mock inventory is
    /// unusable.
    pub(super) fn open(
        (name, flag): (&str, &'static str),
        discovery: &Discovery,
        output: &Path,
        driver: &str,
        gpu_tools: Option<&Path>,
    ) -> Result<Self> {
        kerf_core::names::object_name(flag, name)?;
        let layout = Layout::new(&output.join(name), driver);
        layout.create()?;
        if let Some(program) = gpu_tools {
            layout.install_gpu_tools(program)?;
        }
        let plugin_config = node::plugin_config(
            &layout,
            driver,
            name,
            discovery.clone(),
            gpu_tools.is_some(),
        );
        let inventory = node::discover(&plugin_config)?;
        Ok(ExtraNode {
            name: name.to_owned(),
            inventory_text: super::inventory_text(discovery),
            layout,
            plugin_config,
            inventory,
            slices: Vec::new(),
            devices: Vec::new(),
        })
    }

    /// The node publishing `slices`.
    pub(super) fn with_slices(self, slices: Vec<ResourceSlice>) -> Self {
        let devices = node::published_devices(&slices);
        ExtraNode {
            slices,
            devices,
            ..self
        }
    }

    /// The node as the scheduler stand-in sees it.
    pub(super) fn scheduler_node<'a>(&'a self, driver: &'a str) -> scheduler::Node<'a> {
        scheduler::Node {
            name: &self.name,
            driver,
            devices: &self.devices,
            slices: &self.slices,
        }
    }

    /// Adds the node's GPUs to the controller's capacity `index`: the controller reads every
    /// node's slices (partitionable devices give it nothing).
    pub(super) fn add_to_index(&self, driver: &str, index: &mut kerf_core::alloc::Index) {
        for (_, gpus) in kerf_api::node_gpus_from_slices(&self.slices, driver) {
            index.upsert_node(gpus);
        }
    }

    /// Starts the node's plugin, prepares and unprepares the pods that run on it through its
    /// DRA socket, and stops it. `mig_root` is the emulated MIG state to read while the
    /// claims are prepared and after (a dynamic-MIG node's).
    ///
    /// # Errors
    /// As [`super::run`] for the main node's plugin.
    pub(super) async fn run(
        &self,
        mig_root: Option<PathBuf>,
        workload: &Workload,
        pods: &[PodOutcome],
        store: Arc<MemoryClaimReader>,
    ) -> Result<NodeRun> {
        let driver = self.plugin_config.driver_name.as_str();
        let plugin_config = PluginConfig {
            health: HealthConfig {
                // The demo has no Node object whose annotation could declare faults.
                mock_annotation: false,
                ..HealthConfig::defaults(true)
            },
            ..self.plugin_config.clone()
        };
        let running = plugin::start(
            &plugin_config,
            self.inventory.clone(),
            Connections::reading(store),
        )
        .await?;
        let visit = NodeVisit {
            layout: &self.layout,
            driver,
            node: &self.name,
            workload,
            pods,
            health: false,
            mig_root,
        };
        let visited = visit.run(None).await;
        let stopped = running.shutdown().await;
        // Whatever failed before: no daemon may outlive the demo.
        let daemons_stopped = kubelet_visit::stop_leftover_daemons(&self.plugin_config).await;
        let node_run = visited?;
        stopped?;
        daemons_stopped?;
        kubelet_visit::check_clean(&self.layout, driver)?;
        Ok(node_run)
    }
}
