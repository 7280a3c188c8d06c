//! `kerf demo`: kerf's main job on one mock node, without a cluster or a GPU.
//!
//! 1. The node: a mock inventory, the ResourceSlices the plugin would publish for it, and
//!    the real kubelet plugin ([`kerf_kubelet_plugin::plugin::start`]) serving its sockets
//!    under the output directory, reading claims from memory ([`claim_store`]).
//! 2. The cluster's side: the manifests (GpuClasses → DeviceClasses as the controller
//!    reconciles them; claims, templates, pods, Deployments), allocated pod by pod by kerf's
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
//!
//! [`run`] returns the [`Summary`] and writes it to `<output-dir>/summary.json`;
//! [`print::render_summary`] is the report `kerf demo` prints from it.

pub mod allocate;
pub mod claim_store;
pub mod classes;
pub mod containers;
pub mod health;
pub mod manifests;
pub mod mig;
pub mod mps;
pub mod node;
pub mod print;
pub mod report;
pub mod scheduler;
mod visit;
pub mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::Device;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::resourceslice::{attributes, device_attribute};
use kerf_core::cdi;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::plugin::{self, Connections};

use crate::error::{Error, Result};
use allocate::{ClaimOutcome, PodOutcome};
use claim_store::MemoryClaimReader;
use manifests::ManifestSource;
pub use mig::{MigNode, MigNodeReport};
use node::Layout;
pub use report::{ClaimReport, DeviceReport, MpsReport, PodReport, Summary};
use visit::{NodeRun, NodeVisit};
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
    /// Where GpuClasses and DeviceClasses come from.
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
    /// The dynamic-MIG node beside the main one, or `None` for the main node alone.
    pub mig_node: Option<MigNode>,
}

impl DemoConfig {
    /// The defaults: the embedded examples on an `h100-sxm-80gb` node named `demo-node` and
    /// the dynamic-MIG node `demo-mig-node` (`a100-40gb-dynmig`).
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
    let slices = crate::inventory::resource_slices(&inventory, driver, &config.node_name)?;
    let devices = node::published_devices(&slices);
    let mig_setup = config
        .mig_node
        .as_ref()
        .map(|m| mig::setup(m, &config.output_dir, driver, config.gpu_tools.as_deref()))
        .transpose()?;
    let mut index = node::capacity_index(&slices, driver);
    if let Some(setup) = &mig_setup {
        mig::add_to_index(setup, driver, &mut index);
    }

    let manifests = manifests::load(&[config.classes.clone(), config.claims.clone()])?;
    let classes = classes::build(&manifests, driver);
    let mut workload = workload::build(&manifests);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let main = scheduler::Node {
        name: &config.node_name,
        driver,
        devices: &devices,
        slices: &slices,
    };
    let scheduler_nodes = with_mig_node(main, mig_setup.as_ref());
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

    let mig_node = mig_setup.as_ref();
    let mig_report = run_mig_node(
        mig_node,
        driver,
        &workload,
        &pod_outcomes,
        store,
        &mut node_run,
    )
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
    summary.mig_node = mig_report;
    write_outputs(&layout, &summary, &workload)?;
    Ok(summary)
}

/// The nodes the scheduler stand-in sees: the main node, and the MIG node when there is one.
fn with_mig_node<'a>(
    main: scheduler::Node<'a>,
    mig: Option<&'a mig::Setup>,
) -> Vec<scheduler::Node<'a>> {
    let driver = main.driver;
    let mig = mig.map(|setup| scheduler::Node {
        name: &setup.name,
        driver,
        devices: &setup.devices,
        slices: &setup.slices,
    });
    std::iter::once(main).chain(mig).collect()
}

/// The allocated claims, as the plugins read them from the API server.
fn claim_store(workload: &Workload) -> Arc<MemoryClaimReader> {
    let store = Arc::new(MemoryClaimReader::default());
    for claim in workload.claims.iter().filter_map(|c| c.claim.clone()) {
        store.insert(claim);
    }
    store
}

/// Runs the MIG node's plugin and visit (when there is a MIG node), merges them into
/// `node_run` and reports the node.
async fn run_mig_node(
    setup: Option<&mig::Setup>,
    driver: &str,
    workload: &Workload,
    pods: &[PodOutcome],
    store: Arc<MemoryClaimReader>,
    node_run: &mut NodeRun,
) -> Result<Option<MigNodeReport>> {
    let Some(setup) = setup else {
        return Ok(None);
    };
    let mut mig_run = mig::run_node(setup, workload, pods, store).await?;
    let report = mig::report(setup, driver, &mut mig_run)?;
    node_run.merge(mig_run);
    Ok(Some(report))
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
    async fn run(
        &self,
        inventory: kerf_core::inventory::Inventory,
        store: Arc<MemoryClaimReader>,
    ) -> Result<NodeRun> {
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
        let running = plugin::start(
            &plugin_config,
            inventory,
            Connections {
                mps_daemon_pods: None,
                device_status: None,
                claim_reader: store,
                publisher: None,
                events: Arc::new(kerf_kubelet_plugin::claim_events::MemoryClaimEvents::default()),
            },
        )
        .await?;
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
        let daemons_stopped = visit::stop_leftover_daemons(&plugin_config).await;
        let node_run = visited?;
        stopped?;
        daemons_stopped?;
        visit::check_clean(layout, driver)?;
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

/// What the summary is made from, besides the outcomes.
struct Run<'a> {
    config: &'a DemoConfig,
    layout: &'a Layout,
    /// Each node's published devices, main node first.
    node_devices: &'a [(&'a str, &'a [Device])],
    manifests: &'a manifests::Manifests,
    classes: &'a classes::Classes,
    workload: &'a Workload,
}

impl Run<'_> {
    fn summarize(
        &self,
        claim_outcomes: &[ClaimOutcome],
        pod_outcomes: &[PodOutcome],
        mut node_run: NodeRun,
    ) -> Summary {
        let Run {
            config,
            layout,
            node_devices,
            manifests,
            classes,
            workload,
        } = *self;
        let driver = config.driver_name.as_str();
        let devices = node_devices.first().map_or(&[][..], |(_, d)| *d);
        let claims = workload
            .claims
            .iter()
            .zip(claim_outcomes)
            .map(|(claim, outcome)| {
                claim_report(claim, outcome, node_devices, driver, &mut node_run)
            })
            .collect();
        let pods = workload
            .pods
            .iter()
            .zip(pod_outcomes)
            .map(|(pod, outcome)| pod_report(pod, outcome, workload))
            .collect();
        Summary {
            node: config.node_name.clone(),
            driver: driver.to_owned(),
            inventory: inventory_text(&config.discovery),
            devices: report::describe_devices(devices, driver),
            output_dir: layout.root.clone(),
            classes: classes.reports.clone(),
            claims,
            pods,
            invalid_manifests: invalid_manifest_lines(manifests),
            ignored: manifests.ignored.clone(),
            containers_error: node_run.containers_error.take(),
            container_runtime: node_run.container_runtime.take(),
            gpu_tools_root: config
                .gpu_tools
                .as_ref()
                .map(|_| layout.gpu_tools_root.clone()),
            device_health: node_run.health.take(),
            mig_node: None,
        }
    }
}

fn pod_report(pod: &workload::DemoPod, outcome: &PodOutcome, workload: &Workload) -> PodReport {
    PodReport {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        owner: pod.owner.clone(),
        claims: pod
            .claims
            .iter()
            .map(|c| match &c.claim {
                Ok(i) => workload.claims[*i].name.clone(),
                Err(_) => format!("?{}", c.pod_claim_name),
            })
            .collect(),
        scheduled: outcome.schedulable.is_ok(),
        node: outcome.schedulable.clone().ok(),
        error: outcome.schedulable.clone().err(),
    }
}

/// One line per invalid manifest the claim and class reports do not already name.
fn invalid_manifest_lines(manifests: &manifests::Manifests) -> Vec<String> {
    manifests
        .invalid
        .iter()
        .filter(|i| {
            !matches!(
                i.kind.as_str(),
                "ResourceClaim" | "GpuClass" | "DeviceClass"
            )
        })
        .map(|i| {
            let what = if i.kind.is_empty() {
                String::new()
            } else {
                format!("{}/{} ", i.kind, i.name)
            };
            format!("{what}({}): {}", i.origin, i.error)
        })
        .collect()
}

fn claim_report(
    claim: &workload::DemoClaim,
    outcome: &ClaimOutcome,
    node_devices: &[(&str, &[Device])],
    driver: &str,
    node_run: &mut NodeRun,
) -> ClaimReport {
    let uid = claim.claim.as_ref().map(|_| claim.uid().to_owned());
    let classes = kerf_api::controller_claims::request_class_names(
        claim.claim.as_ref().and_then(|c| c.spec.devices.as_ref()),
    )
    .map(str::to_owned)
    .collect();
    let prepared = uid.as_deref().and_then(|u| node_run.prepared.get(u));
    let cdi_ids: BTreeMap<String, Vec<String>> = match prepared {
        Some(Ok(devices)) => devices
            .iter()
            .map(|d| (d.device_name.clone(), d.cdi_device_ids.clone()))
            .collect(),
        _ => BTreeMap::new(),
    };
    let mut error = outcome.error.clone();
    if let Some(Err(e)) = prepared {
        error = Some(format!("NodePrepareResources: {e}"));
    }
    let allocated = claim
        .claim
        .as_ref()
        .and_then(|c| kerf_api::resolve_allocation(c, driver).ok())
        .unwrap_or_default();
    let spec = uid.as_deref().and_then(|u| node_run.specs.remove(u));
    let pipes = spec
        .as_ref()
        .map(|(_, value)| mps::pipe_mounts(value))
        .unwrap_or_default();
    let device_reports = allocated
        .iter()
        .map(|a| {
            device_report(
                a,
                uid.as_deref(),
                &pipes,
                node_devices,
                driver,
                &cdi_ids,
                node_run,
            )
        })
        .collect();
    let node = allocated.first().map(|a| a.pool.clone());
    ClaimReport {
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        origin: claim.origin.clone(),
        template: claim.template.clone(),
        classes,
        pods: claim.pods.clone(),
        allocated_by: outcome.allocated_by,
        node,
        devices: device_reports,
        prepared: matches!(prepared, Some(Ok(_))),
        error,
        cdi_spec_file: spec.as_ref().map(|(path, _)| path.clone()),
        cdi_spec: spec.map(|(_, value)| value),
        container: uid.as_deref().and_then(|u| node_run.containers.remove(u)),
        uid,
    }
}

/// The report of one allocated device of a claim: what was published, prepared and started.
fn device_report(
    a: &kerf_api::AllocatedDevice,
    uid: Option<&str>,
    pipes: &[mps::PipeMount],
    node_devices: &[(&str, &[Device])],
    driver: &str,
    cdi_ids: &BTreeMap<String, Vec<String>>,
    node_run: &NodeRun,
) -> DeviceReport {
    let mps = uid.and_then(|u| {
        let name = cdi::claim_device_name(u, &a.device);
        let pipe = pipes.iter().find(|p| p.device == name)?;
        Some(MpsReport {
            pipe_directory: pipe.host.clone(),
            container_pipe_directory: pipe.container.clone(),
            daemon_pid: node_run.mps_daemons.get(&pipe.host).copied().flatten(),
        })
    });
    let published = node_devices
        .iter()
        .find(|(node, _)| *node == a.pool)
        .and_then(|(_, devices)| devices.iter().find(|d| d.name == a.device));
    let string = |name: &str| {
        published
            .and_then(|d| device_attribute(d, driver, name))
            .and_then(|v| v.string.clone())
    };
    DeviceReport {
        request: a.request.clone(),
        device: a.device.clone(),
        device_type: string(attributes::TYPE).unwrap_or_default(),
        mig_profile: string(attributes::PROFILE),
        memory_bytes: a.limits.memory_bytes,
        compute_percent: a.limits.compute_percent,
        sharing: a.sharing.to_string(),
        cdi_device_ids: cdi_ids.get(&a.device).cloned().unwrap_or_default(),
        mps,
        mig_instance: published.and_then(|d| mig::instance_of(d, driver, &node_run.mig_prepared)),
    }
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
