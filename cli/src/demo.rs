//! `kerf demo`: kerf's main job on one mock node, without a cluster or a GPU.
//!
//! 1. The node: a mock inventory, the ResourceSlices the plugin would publish for it, and
//!    the real kubelet plugin ([`kerf_kubelet_plugin::plugin::start`]) serving its sockets
//!    under the output directory, reading claims from memory ([`claim_store`]).
//! 2. The cluster's side: the manifests (the default GpuClasses and the given ones →
//!    DeviceClasses as the controller reconciles them; claims, templates, pods, Deployments), allocated pod by pod by kerf's
//!    real controller allocator and, for Scheduler classes, by kube-scheduler's structured
//!    allocator from kerf-scheduler-standin ([`allocate`], [`scheduler`]).
//! 3. The kubelet's side: registration and one `NodePrepareResources` per pod over the
//!    plugin's socket ([`kerf_proto::client`]); optionally one busybox container per claim with its CDI
//!    devices ([`containers`]); then `NodeUnprepareResources` for every pod and shutdown.
//!    With [`DemoConfig::gpu_tools`] the plugin runs the fake GPU tools of a mock driver root
//!    under the output directory, so each GPU with MPS slices gets a real (fake) MPS daemon
//!    process, which the last unprepare of the GPU stops; any daemon still running after
//!    shutdown is stopped and fails the run.
//! 4. Device health: the kubelet stand-in watches the plugin's health stream, and while the
//!    claims are prepared the demo flips one prepared device unhealthy and back through the
//!    plugin's mock fault file ([`health`]).
//! 5. Dynamic MIG ([`mig`]): a second node, `demo-mig-node`, whose A100s in MIG mode are
//!    published as counter sets and MIG placements (Kubernetes 1.36 partitionable devices);
//!    pods whose claims fit nowhere else run there, and its own plugin creates each
//!    allocated placement's MIG instance at prepare and destroys it at unprepare.
//! 6. Scheduler slices ([`shareable`]): the nodes' GPUs are published as on a Kubernetes 1.36
//!    cluster with `DRAConsumableCapacity` — kerf-controller's shared publication made
//!    shareable by the plugin — and the classes are reconciled for it. A third node,
//!    `demo-nvl-node` (2 × H100 NVL, which the sliced class of the examples selects), gets its
//!    GPUs shareable; kube-scheduler's allocator cuts shares from them and its own plugin
//!    prepares them under MPS. The H100s of the main node stay whole for the whole-GPU class.
//!
//! [`run`] returns the [`Summary`] and writes it to `<output-dir>/summary.json`;
//! [`print::render_summary`] is the report `kerf demo` prints from it.

pub mod allocate;
pub mod claim_store;
pub mod classes;
pub mod containers;
mod extra_node;
pub mod health;
mod kubelet_visit;
pub mod manifests;
pub mod mig;
pub mod mps;
pub mod node;
pub mod print;
pub mod report;
pub mod scheduler;
pub mod shareable;
mod summarize;
pub mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::Device;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::plugin::{self, Connections};

use crate::error::{Error, Result};
use allocate::PodOutcome;
use claim_store::MemoryClaimReader;
use kubelet_visit::{NodeRun, NodeVisit};
use manifests::ManifestSource;
pub use mig::{MigNode, MigNodeReport};
use node::Layout;
pub use report::{ClaimReport, DeviceReport, MpsReport, PodReport, Summary};
pub use shareable::{ShareableNode, ShareableNodeReport};
use summarize::Run;
use workload::Workload;

/// The node name the demo uses unless told otherwise.
pub const DEFAULT_NODE_NAME: &str = "demo-node";
/// The mock profile the demo uses unless told otherwise.
pub const DEFAULT_MOCK_GPUS: &str = "h100-sxm-80gb";

/// Everything a demo run needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoConfig {
    /// Directory for sockets, CDI specs, checkpoint and summary.
    pub output_dir: PathBuf,
    /// DRA driver name.
    pub driver_name: String,
    /// The mock node's name.
    pub node_name: String,
    /// The mock inventory (a profile or a file; NVML is refused).
    pub discovery: Discovery,
    /// Where GpuClasses and DeviceClasses come from, besides the default classes, which every
    /// run loads.
    pub classes: ManifestSource,
    /// Where claims, templates, pods and Deployments come from.
    pub claims: ManifestSource,
    /// Run one busybox container per claim prepared on the main node with podman.
    pub run_containers: bool,
    /// A static busybox to use instead of `/bin/busybox`.
    pub busybox: Option<PathBuf>,
    /// The program installed as the fake `nvidia-smi` and `nvidia-cuda-mps-control` of the
    /// node's mock driver root ([`kerf_fake_gpu_tools::install`]): one that acts as those
    /// tools when run under their names, such as the `kerf` binary. With it the plugin
    /// enforces MPS slices with one (fake) MPS daemon per GPU; without it, as the plugin's
    /// mock mode without `--mock-driver-root`, slices are accounting only.
    pub gpu_tools: Option<PathBuf>,
    /// The dynamic-MIG node beside the main one, or `None` for none.
    pub mig_node: Option<MigNode>,
    /// The node of shareable GPUs beside the main one, or `None` for none.
    pub shareable_node: Option<ShareableNode>,
}

impl DemoConfig {
    /// The defaults: the embedded examples on an `h100-sxm-80gb` node named `demo-node`, the
    /// dynamic-MIG node `demo-mig-node` (`a100-40gb-dynmig`) and the node of shareable GPUs
    /// `demo-nvl-node` (`h100-nvl`).
    pub fn new(output_dir: impl Into<PathBuf>) -> Self {
        DemoConfig {
            output_dir: output_dir.into(),
            driver_name: "gpu.kerf.dev".to_owned(),
            node_name: DEFAULT_NODE_NAME.to_owned(),
            discovery: Discovery::MockProfile(DEFAULT_MOCK_GPUS.to_owned()),
            classes: ManifestSource::Embedded("admin"),
            claims: ManifestSource::Embedded("claims"),
            run_containers: false,
            busybox: None,
            // The running program is only known to be such a tool when it is `kerf` itself,
            // which its main passes explicitly.
            gpu_tools: None,
            mig_node: Some(MigNode::default()),
            shareable_node: Some(ShareableNode::default()),
        }
    }
}

/// Runs the demo and writes `<output-dir>/summary.json` and `<output-dir>/claims.yaml`.
///
/// Claims that cannot be allocated or prepared are not errors: the summary reports them with
/// the reason. Containers that cannot be run are reported in
/// [`Summary::containers_error`]. When this returns, the plugin has stopped, every claim is
/// unprepared and the sockets are gone.
///
/// # Errors
/// The configuration is unusable (NVML discovery, bad names, no manifests), the output
/// directory cannot be written, the plugin cannot start or stop, the kubelet stand-in cannot
/// register, or a socket or CDI spec was left behind.
pub async fn run(config: &DemoConfig) -> Result<Summary> {
    check_config(config)?;
    let driver = config.driver_name.as_str();
    let (layout, plugin_config, inventory) = open_main_node(config)?;
    // The default classes first, as on every cluster kerf runs on.
    let manifests = manifests::load(&[
        ManifestSource::DefaultClasses,
        config.classes.clone(),
        config.claims.clone(),
    ])?;
    let classes = classes::build(&manifests, driver);
    let mut slices = crate::inventory::resource_slices(&inventory, driver, &config.node_name)?;
    let main_whole = shareable::publish(&mut slices, &config.node_name, driver, &classes)?;
    let devices = node::published_devices(&slices);
    let extra = ExtraNodes::setup(config, &classes)?;
    let mut index = node::capacity_index(&slices, driver);
    extra.add_to_index(driver, &mut index);

    let mut workload = workload::build(&manifests);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let main = scheduler::Node {
        name: &config.node_name,
        driver,
        devices: &devices,
        slices: &slices,
    };
    let scheduler_nodes: Vec<scheduler::Node<'_>> = std::iter::once(main)
        .chain(extra.scheduler_nodes(driver))
        .collect();
    let (claim_outcomes, pod_outcomes) =
        allocate::allocate_all(&mut workload, &classes, &scheduler_nodes, &mut index, &now);

    let store = claim_store(&workload);
    let main_node = MainNode {
        config,
        layout: &layout,
        plugin_config: &plugin_config,
        workload: &workload,
        pods: &pod_outcomes,
    };
    let mut node_run = main_node.run(inventory, Arc::clone(&store)).await?;
    let extra_reports = extra
        .run(driver, &workload, &pod_outcomes, store, &mut node_run)
        .await?;
    let node_devices: Vec<(&str, &[Device])> = scheduler_nodes
        .iter()
        .map(|n| (n.name, n.devices))
        .collect();
    let run = Run {
        config,
        layout: &layout,
        node_devices: &node_devices,
        manifests: &manifests,
        classes: &classes,
        workload: &workload,
    };
    let mut summary = run.summarize(&claim_outcomes, &pod_outcomes, node_run);
    (summary.mig_node, summary.shareable_node) = extra_reports;
    summary.published_whole = main_whole;
    summary.published_whole.extend(extra.published_whole());
    write_outputs(&layout, &summary, &workload)?;
    Ok(summary)
}

/// Lays the main node out under the output directory (with the fake GPU tools when asked)
/// and discovers its GPUs as its plugin will.
fn open_main_node(config: &DemoConfig) -> Result<(Layout, PluginConfig, Inventory)> {
    let driver = config.driver_name.as_str();
    let layout = Layout::new(&config.output_dir, driver);
    layout.create()?;
    if let Some(program) = &config.gpu_tools {
        layout.install_gpu_tools(program)?;
    }
    let plugin_config = node::plugin_config(
        &layout,
        driver,
        &config.node_name,
        config.discovery.clone(),
        config.gpu_tools.is_some(),
    );
    let inventory = node::discover(&plugin_config)?;
    Ok((layout, plugin_config, inventory))
}

/// The nodes beside the main one: the dynamic-MIG node and the node of shareable GPUs, each
/// when the configuration asks for it.
struct ExtraNodes {
    mig: Option<mig::Setup>,
    shareable: Option<shareable::Setup>,
}

impl ExtraNodes {
    /// Lays out, discovers and publishes each node; the shareable node needs the `classes`
    /// to publish as kerf-controller decides.
    fn setup(config: &DemoConfig, classes: &classes::Classes) -> Result<Self> {
        let output = config.output_dir.as_path();
        let driver = config.driver_name.as_str();
        let tools = config.gpu_tools.as_deref();
        Ok(ExtraNodes {
            mig: config
                .mig_node
                .as_ref()
                .map(|m| mig::setup(m, output, driver, tools))
                .transpose()?,
            shareable: config
                .shareable_node
                .as_ref()
                .map(|s| shareable::setup(s, output, driver, tools, classes))
                .transpose()?,
        })
    }

    fn nodes(&self) -> impl Iterator<Item = &extra_node::ExtraNode> {
        let mig = self.mig.iter().map(|m| &m.node);
        mig.chain(self.shareable.iter().map(|s| &s.node))
    }

    /// The nodes as the scheduler stand-in sees them, after the main node, in this order.
    fn scheduler_nodes<'a>(
        &'a self,
        driver: &'a str,
    ) -> impl Iterator<Item = scheduler::Node<'a>> + 'a {
        self.nodes().map(move |n| n.scheduler_node(driver))
    }

    /// The GPUs of the nodes that a sliced class selects but that stay whole, and why.
    fn published_whole(&self) -> impl Iterator<Item = String> + '_ {
        self.shareable.iter().flat_map(|s| s.whole.iter().cloned())
    }

    /// Adds every node's GPUs to the controller's capacity `index`.
    fn add_to_index(&self, driver: &str, index: &mut kerf_core::alloc::Index) {
        for node in self.nodes() {
            node.add_to_index(driver, index);
        }
    }

    /// Runs each node's plugin and visit, merges them into `node_run` and reports the nodes.
    async fn run(
        &self,
        driver: &str,
        workload: &Workload,
        pods: &[PodOutcome],
        store: Arc<MemoryClaimReader>,
        node_run: &mut NodeRun,
    ) -> Result<(Option<MigNodeReport>, Option<ShareableNodeReport>)> {
        let mut mig_report = None;
        if let Some(setup) = &self.mig {
            let mut mig_run = mig::run_node(setup, workload, pods, Arc::clone(&store)).await?;
            mig_report = Some(mig::report(setup, driver, &mut mig_run)?);
            node_run.merge(mig_run);
        }
        let mut shareable_report = None;
        if let Some(setup) = &self.shareable {
            let shareable_run = setup.node.run(None, workload, pods, store).await?;
            shareable_report = Some(shareable::report(setup, driver));
            node_run.merge(shareable_run);
        }
        Ok((mig_report, shareable_report))
    }
}

/// The allocated claims, as the plugins read them from the API server.
fn claim_store(workload: &Workload) -> Arc<MemoryClaimReader> {
    let store = Arc::new(MemoryClaimReader::default());
    for claim in workload.claims.iter().filter_map(|c| c.claim.clone()) {
        store.insert(claim);
    }
    store
}

/// The main node's plugin and the kubelet's visit to it.
struct MainNode<'a> {
    config: &'a DemoConfig,
    layout: &'a Layout,
    plugin_config: &'a PluginConfig,
    workload: &'a Workload,
    pods: &'a [PodOutcome],
}

impl MainNode<'_> {
    /// Starts the plugin, prepares and unprepares the node's pods with the health flip and
    /// the containers, stops the plugin and checks that nothing is left.
    async fn run(&self, inventory: Inventory, store: Arc<MemoryClaimReader>) -> Result<NodeRun> {
        let MainNode {
            config,
            layout,
            plugin_config,
            workload,
            pods,
        } = *self;
        let driver = config.driver_name.as_str();
        let runtime = config
            .run_containers
            .then(|| containers::find_runtime(config.busybox.as_deref()));
        let plugin_config = PluginConfig {
            health: health::health_config(layout),
            ..plugin_config.clone()
        };
        let running = plugin::start(&plugin_config, inventory, Connections::reading(store)).await?;
        let visit = NodeVisit {
            layout,
            driver,
            node: &config.node_name,
            workload,
            pods,
            health: true,
            mig_root: None,
        };
        let visited = visit.run(runtime).await;
        let stopped = running.shutdown().await;
        // Whatever failed before: no daemon may outlive the demo.
        let daemons_stopped = kubelet_visit::stop_leftover_daemons(&plugin_config).await;
        let node_run = visited?;
        stopped?;
        daemons_stopped?;
        kubelet_visit::check_clean(layout, driver)?;
        Ok(node_run)
    }
}

/// How the summary names a node's inventory.
fn inventory_text(discovery: &Discovery) -> String {
    match discovery {
        Discovery::MockProfile(profile) => format!("mock profile {profile}"),
        Discovery::MockFile(path) => format!("mock inventory {}", path.display()),
        Discovery::Nvml => "NVML".to_owned(),
    }
}

fn check_config(config: &DemoConfig) -> Result<()> {
    if config.discovery == Discovery::Nvml {
        return Err(Error::Config(
            "the demo runs on mock GPUs: give a mock profile or inventory file".to_owned(),
        ));
    }
    kerf_core::names::driver_name("--driver-name", &config.driver_name)?;
    kerf_core::names::object_name("--node-name", &config.node_name)?;
    for source in [&config.classes, &config.claims] {
        if let ManifestSource::Dir(dir) = source
            && !dir.is_dir()
        {
            return Err(Error::Config(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
    }
    if manifests::is_empty(&config.classes) && manifests::is_empty(&config.claims) {
        return Err(Error::Config(
            "no manifests: this build embeds no examples; pass --classes DIR and --claims DIR"
                .to_owned(),
        ));
    }
    Ok(())
}

fn write_outputs(layout: &Layout, summary: &Summary, workload: &Workload) -> Result<()> {
    let json = serde_json::to_vec_pretty(summary).map_err(|source| Error::Json {
        what: "encode summary",
        source,
    })?;
    write_file(&layout.summary_file, &json)?;
    let mut yaml = String::new();
    for claim in workload.claims.iter().filter_map(|c| c.claim.as_ref()) {
        yaml.push_str("---\n");
        match serde_saphyr::to_string(claim) {
            Ok(text) => yaml.push_str(&text),
            Err(e) => {
                return Err(Error::Config(format!("rendering claims as YAML: {e}")));
            }
        }
    }
    write_file(&layout.claims_file, yaml.as_bytes())
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io("write", path, e))
}
