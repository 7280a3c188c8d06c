//! The demo's dynamic-MIG node: a second mock node (`demo-mig-node`, mock profile
//! `a100-40gb-dynmig`: A100s in MIG mode without MIG devices) with its own kubelet plugin.
//!
//! Its ResourceSlices are what the plugin publishes on Kubernetes 1.36 with
//! `DRAPartitionableDevices` ([`crate::inventory::published_slices`]): a counter set per GPU
//! and one device per MIG placement consuming it. The scheduler stand-in picks a placement
//! that fits the counters ([`kerf_api::counters`]); at prepare the plugin creates the GPU and
//! compute instance in mock mode's emulated driver state
//! ([`kerf_fake_gpu_tools::mig::MockMig`], under
//! [`kerf_kubelet_plugin::config::PluginConfig::mock_mig_root`]) and at unprepare destroys
//! them. The demo reads that state while the claims are prepared and after they are
//! unprepared ([`live_instances`]).

use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{CounterSet, Device};
use kerf_api::quantity::format_bytes;
use kerf_api::resourceslice::{TYPE_MIG, attributes, device_attribute};
use kerf_core::mig_catalog::counter_set_name;
use kerf_fake_gpu_tools::mig::MockMig;
use kerf_kubelet_plugin::config::Discovery;
use serde::{Deserialize, Serialize};

use super::allocate::PodOutcome;
use super::claim_store::MemoryClaimReader;
use super::extra_node::ExtraNode;
use super::kubelet_visit::NodeRun;
use super::workload::Workload;
use crate::error::{Error, Result};

/// The dynamic-MIG node's name unless told otherwise.
pub const DEFAULT_MIG_NODE_NAME: &str = "demo-mig-node";
/// Its mock profile unless told otherwise.
pub const DEFAULT_MIG_MOCK_GPUS: &str = "a100-40gb-dynmig";

/// The dynamic-MIG node of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigNode {
    /// Its name (the pool name).
    pub name: String,
    /// Its mock inventory: GPUs in MIG mode without MIG devices (dynamic MIG).
    pub discovery: Discovery,
}

impl Default for MigNode {
    fn default() -> Self {
        MigNode {
            name: DEFAULT_MIG_NODE_NAME.to_owned(),
            discovery: Discovery::MockProfile(DEFAULT_MIG_MOCK_GPUS.to_owned()),
        }
    }
}

/// One MIG instance of the emulated driver state: a GPU instance and its compute instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LiveInstance {
    /// The parent GPU's minor.
    pub gpu_minor: u32,
    /// GPU instance id.
    pub gi_id: u32,
    /// GPU-instance profile id.
    pub gi_profile_id: u32,
    /// First memory slice of its placement.
    pub placement_start: u32,
    /// Memory slices of its placement.
    pub placement_size: u32,
    /// Compute instance id, when one exists.
    pub ci_id: Option<u32>,
    /// The MIG device's UUID (its compute instance's).
    pub mig_uuid: Option<String>,
}

impl LiveInstance {
    /// `GPU 0 GI 1 CI 0 (memory slices 0+1), MIG-…`.
    pub fn text(&self) -> String {
        format!(
            "GPU {} GI {} CI {} (memory slices {}+{}), {}",
            self.gpu_minor,
            self.gi_id,
            self.ci_id.map_or_else(|| "-".to_owned(), |c| c.to_string()),
            self.placement_start,
            self.placement_size,
            self.mig_uuid.as_deref().unwrap_or("no MIG UUID")
        )
    }
}

/// What the dynamic-MIG node published and what its MIG instances did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigNodeReport {
    /// The node's name.
    pub node: String,
    /// `mock profile a100-40gb-dynmig`.
    pub inventory: String,
    /// Per GPU: `gpu-0 (NVIDIA A100-SXM4-40GB, 40Gi): counter set gpu-0 of 16 counters, 25
    /// MIG placements` (a GPU in MIG mode is not published whole).
    pub gpus: Vec<String>,
    /// ResourceSlices of the pool.
    pub slices: usize,
    /// Of them, the slices holding counter sets only.
    pub counter_slices: usize,
    /// Root of the emulated MIG state (`kerf-fake-tools/mig-state.json` under it).
    pub mig_state_root: PathBuf,
    /// The MIG instances that existed while the claims were prepared.
    pub instances_prepared: Vec<LiveInstance>,
    /// The MIG instances left after every claim was unprepared.
    pub instances_left: Vec<LiveInstance>,
}

/// The dynamic-MIG node before its plugin runs.
pub(super) struct Setup {
    pub(super) node: ExtraNode,
    pub(super) counter_sets: Vec<CounterSet>,
}

/// Lays out the node under `<output>/<name>`, discovers its GPUs and builds its slices with
/// partitionable devices.
///
/// # Errors
/// Bad names, an unusable mock inventory, the directories or the tools cannot be created,
/// or the slices break an API limit.
pub(super) fn setup(
    mig: &MigNode,
    output: &std::path::Path,
    driver: &str,
    gpu_tools: Option<&std::path::Path>,
) -> Result<Setup> {
    // With the tools, its fake `nvidia-smi mig` shows the instances the plugin creates.
    let node = ExtraNode::open(
        (&mig.name, "--mig-node-name"),
        &mig.discovery,
        output,
        driver,
        gpu_tools,
    )?;
    let features = crate::inventory::Features {
        consumable_capacity: None,
        partitionable_devices: true,
    };
    let slices = crate::inventory::published_slices(&node.inventory, driver, &mig.name, &features)?;
    let counter_sets = slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.clone().unwrap_or_default())
        .collect();
    Ok(Setup {
        node: node.with_slices(slices),
        counter_sets,
    })
}

/// Starts the node's plugin, prepares and unprepares the pods that run on it through its DRA
/// socket (reading the MIG instances in between and after), and stops it.
///
/// # Errors
/// As [`super::run`] for the main node's plugin.
pub(super) async fn run_node(
    setup: &Setup,
    workload: &Workload,
    pods: &[PodOutcome],
    store: Arc<MemoryClaimReader>,
) -> Result<NodeRun> {
    let mig_root = setup.node.plugin_config.mock_mig_root();
    setup.node.run(mig_root, workload, pods, store).await
}

/// The report of the node: its GPUs with their counter sets and devices, and the instances
/// the run saw.
///
/// # Errors
/// The MIG state could not be read after the unprepare.
pub(super) fn report(setup: &Setup, driver: &str, node_run: &mut NodeRun) -> Result<MigNodeReport> {
    let node = &setup.node;
    let instances_left = node_run.mig_left.take().transpose()?.unwrap_or_default();
    let is_mig = |d: &Device| {
        device_attribute(d, driver, attributes::TYPE).and_then(|a| a.string.as_deref())
            == Some(TYPE_MIG)
    };
    let gpus = node
        .inventory
        .gpus
        .iter()
        .map(|gpu| {
            let set = counter_set_name(gpu.minor);
            let described = format!(
                "gpu-{} ({}, {})",
                gpu.minor,
                gpu.product_name,
                format_bytes(gpu.memory_bytes)
            );
            let Some(counters) = setup.counter_sets.iter().find(|s| s.name == set) else {
                return format!("{described}: no counter set, not published as MIG placements");
            };
            let placements = node
                .devices
                .iter()
                .filter(|d| {
                    is_mig(d)
                        && d.consumes_counters
                            .iter()
                            .flatten()
                            .any(|c| c.counter_set == set)
                })
                .count();
            format!(
                "{described}: counter set {set} of {} counters, {placements} MIG placements",
                counters.counters.len()
            )
        })
        .collect();
    Ok(MigNodeReport {
        node: node.name.clone(),
        inventory: node.inventory_text.clone(),
        gpus,
        slices: node.slices.len(),
        counter_slices: node
            .slices
            .iter()
            .filter(|s| s.spec.shared_counters.is_some())
            .count(),
        mig_state_root: node.plugin_config.mock_mig_root().unwrap_or_default(),
        instances_prepared: node_run.mig_prepared.clone(),
        instances_left,
    })
}

/// Every MIG instance of the emulated driver state under `root`.
///
/// # Errors
/// The state cannot be opened or read.
pub fn live_instances(root: &std::path::Path) -> Result<Vec<LiveInstance>> {
    let failed = |e: kerf_fake_gpu_tools::mig::MigError| {
        Error::Config(format!("emulated MIG state under {}: {e}", root.display()))
    };
    let mig = MockMig::open(root).map_err(failed)?;
    let mut live = Vec::new();
    for minor in mig.gpus().map_err(failed)? {
        for gi in mig.list(minor).map_err(failed)? {
            let ci = gi.cis.first();
            live.push(LiveInstance {
                gpu_minor: minor,
                gi_id: gi.gi_id,
                gi_profile_id: gi.profile_id,
                placement_start: gi.placement.start,
                placement_size: gi.placement.size,
                ci_id: ci.map(|c| c.ci_id),
                mig_uuid: ci.map(|c| c.uuid.clone()),
            });
        }
    }
    Ok(live)
}

/// The instance created for placement device `device`: the one on its GPU with its GPU
/// instance profile and placement.
pub(super) fn instance_of(
    device: &Device,
    driver: &str,
    live: &[LiveInstance],
) -> Option<LiveInstance> {
    let int = |name: &str| {
        device_attribute(device, driver, name)
            .and_then(|a| a.int)
            .and_then(|v| u32::try_from(v).ok())
    };
    let minor = int(attributes::PARENT_MINOR)?;
    let profile = int(attributes::GI_PROFILE_ID)?;
    let start = int(attributes::PLACEMENT_START)?;
    let size = int(attributes::PLACEMENT_SIZE)?;
    live.iter()
        .find(|i| {
            i.gpu_minor == minor
                && i.gi_profile_id == profile
                && i.placement_start == start
                && i.placement_size == size
        })
        .cloned()
}
