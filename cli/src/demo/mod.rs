//! `kerf demo`: kerf's main job on one mock node, without a cluster or a GPU.
//!
//! 1. The node: a mock inventory, the ResourceSlices the plugin would publish for it, and
//!    the real kubelet plugin ([`kerf_kubelet_plugin::plugin::start`]) serving its sockets
//!    under the output directory, reading claims from memory ([`claim_store`]).
//! 2. The cluster's side: the manifests (GpuClasses → DeviceClasses as the controller
//!    reconciles them; claims, templates, pods, Deployments), allocated pod by pod by kerf's
//!    real controller allocator and, for Scheduler classes, by a simple stand-in for
//!    kube-scheduler ([`allocate`], [`scheduler`]).
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
//!
//! [`run`] returns the [`Summary`] and writes it to `<output-dir>/summary.json`;
//! [`print::render_summary`] is the report `kerf demo` prints from it.

pub mod allocate;
pub mod claim_store;
pub mod classes;
pub mod containers;
pub mod health;
pub mod manifests;
pub mod mps;
pub mod node;
pub mod print;
pub mod report;
pub mod scheduler;
pub mod workload;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::Device;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_api::resourceslice::{attributes, device_attribute};
use kerf_core::cdi;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::mps_daemons::{self, MpsDaemons};
use kerf_kubelet_plugin::plugin::{self, Connections};
use kerf_kubelet_plugin::preparer::PreparerConfig;
use kerf_proto::client::{Claim, ClaimResult, KubeletClient, RegisteredPlugin};

use crate::error::{Error, Result};
use allocate::{ClaimOutcome, PodOutcome};
use claim_store::MemoryClaimReader;
use containers::ContainerRun;
use manifests::ManifestSource;
use node::Layout;
pub use report::{ClaimReport, DeviceReport, MpsReport, PodReport, Summary};
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
    /// Run one busybox container per prepared claim with podman.
    pub run_containers: bool,
    /// A static busybox to use instead of `/bin/busybox`.
    pub busybox: Option<PathBuf>,
    /// The program installed as the fake `nvidia-smi` and `nvidia-cuda-mps-control` of the
    /// node's mock driver root ([`kerf_fake_gpu_tools::install`]): one that acts as those
    /// tools when run under their names, such as the `kerf` binary. With it the plugin
    /// enforces MPS slices with one (fake) MPS daemon per GPU; without it, as the plugin's
    /// mock mode without `--mock-driver-root`, slices are accounting only.
    pub gpu_tools: Option<PathBuf>,
}

impl DemoConfig {
    /// The defaults: the embedded examples on an `h100-sxm-80gb` node named `demo-node`.
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
    let mut index = node::capacity_index(&slices, driver);

    let manifests = manifests::load(&[config.classes.clone(), config.claims.clone()])?;
    let classes = classes::build(&manifests, driver);
    let mut workload = workload::build(&manifests);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let scheduler_node = scheduler::Node {
        name: &config.node_name,
        driver,
        devices: &devices,
    };
    let (claim_outcomes, pod_outcomes) =
        allocate::allocate_all(&mut workload, &classes, &scheduler_node, &mut index, &now);

    let store = Arc::new(MemoryClaimReader::default());
    for claim in workload.claims.iter().filter_map(|c| c.claim.clone()) {
        store.insert(claim);
    }
    let runtime = config
        .run_containers
        .then(|| containers::find_runtime(config.busybox.as_deref()));

    let running = plugin::start_with_health(
        &plugin_config,
        &health::health_config(&layout),
        inventory,
        Connections {
            device_status: None,
            claim_reader: store,
            publisher: None,
            events: Arc::new(kerf_kubelet_plugin::claim_events::MemoryClaimEvents::default()),
        },
    )
    .await?;
    let visit = NodeVisit {
        layout: &layout,
        driver,
        workload: &workload,
        pods: &pod_outcomes,
    };
    let visited = visit.run(runtime).await;
    let stopped = running.shutdown().await;
    // Whatever failed before: no daemon may outlive the demo.
    let daemons_stopped = stop_leftover_daemons(&plugin_config).await;
    let node_run = visited?;
    stopped?;
    daemons_stopped?;
    check_clean(&layout, driver)?;

    let summary = summarize(
        config,
        &layout,
        &devices,
        &manifests,
        &classes,
        &workload,
        &claim_outcomes,
        &pod_outcomes,
        node_run,
    );
    write_outputs(&layout, &summary, &workload)?;
    Ok(summary)
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

/// What happened on the node.
#[derive(Debug, Default)]
struct NodeRun {
    prepared: HashMap<String, ClaimResult>,
    specs: HashMap<String, (PathBuf, serde_json::Value)>,
    /// The PID of each MPS pipe directory's daemon while the claims were prepared.
    mps_daemons: HashMap<PathBuf, Option<u32>>,
    containers: HashMap<String, ContainerRun>,
    containers_error: Option<String>,
    container_runtime: Option<String>,
    health: Option<health::HealthReport>,
}

/// The kubelet's part of the run.
struct NodeVisit<'a> {
    layout: &'a Layout,
    driver: &'a str,
    workload: &'a Workload,
    pods: &'a [PodOutcome],
}

impl NodeVisit<'_> {
    /// Registers, opens the health stream, prepares every runnable pod, snapshots the CDI
    /// specs, flips a prepared device's health, runs containers, and unprepares every pod
    /// again, even when something in between failed.
    async fn run(&self, runtime: Option<Result<containers::Runtime>>) -> Result<NodeRun> {
        let kubelet = KubeletClient::new()
            .register(&self.layout.registration_socket)
            .await?;
        // As the kubelet: the health stream is opened as soon as the plugin has registered.
        let watcher = health::Watcher::open(&kubelet).await;
        let mut run = NodeRun::default();
        let prepared = self.prepare_all(&kubelet, &mut run).await;
        self.snapshot_specs(&mut run);
        let target = health::target(self.workload, &run.prepared);
        run.health = Some(health::flip(watcher, &self.layout.fault_file, target).await);
        match runtime {
            None => {}
            Some(Ok(runtime)) => self.run_containers(&runtime, &mut run),
            Some(Err(e)) => run.containers_error = Some(e.to_string()),
        }
        let unprepared = self.unprepare_all(&kubelet).await;
        prepared?;
        unprepared?;
        Ok(run)
    }

    /// The pods that can run, with their claims as the kubelet names them.
    fn runnable_pods(&self) -> Vec<Vec<Claim>> {
        self.workload
            .pods
            .iter()
            .zip(self.pods)
            .filter(|(_, outcome)| outcome.schedulable.is_ok())
            .map(|(pod, _)| {
                pod.claims
                    .iter()
                    .filter_map(|c| c.claim.as_ref().ok())
                    .map(|&i| {
                        let claim = &self.workload.claims[i];
                        Claim::new(&claim.namespace, &claim.name, claim.uid())
                    })
                    .collect()
            })
            .collect()
    }

    async fn prepare_all(&self, kubelet: &RegisteredPlugin, run: &mut NodeRun) -> Result<()> {
        for claims in self.runnable_pods() {
            if claims.is_empty() {
                continue;
            }
            let answers = kubelet.prepare(&claims).await?;
            for (uid, answer) in answers {
                // A claim shared by pods keeps its first answer (later ones repeat it).
                run.prepared.entry(uid).or_insert(answer);
            }
        }
        Ok(())
    }

    fn snapshot_specs(&self, run: &mut NodeRun) {
        let kind = PreparerConfig::cdi_kind_for(self.driver);
        for (uid, answer) in &run.prepared {
            if answer.is_err() {
                continue;
            }
            let Ok(file_name) = cdi::transient_spec_file_name(&kind, uid) else {
                continue;
            };
            let path = self.layout.cdi_dir.join(file_name);
            let spec = std::fs::read(&path)
                .ok()
                .and_then(|bytes| serde_json::from_slice(&bytes).ok());
            if let Some(spec) = spec {
                // Read now: the daemon and its PID file go with the GPU's last unprepare.
                for pipe in mps::pipe_mounts(&spec) {
                    let pid = mps_daemons::daemon_in(&pipe.host).map(|d| d.pid);
                    run.mps_daemons.entry(pipe.host).or_insert(pid);
                }
                run.specs.insert(uid.clone(), (path, spec));
            }
        }
    }

    fn run_containers(&self, runtime: &containers::Runtime, run: &mut NodeRun) {
        run.container_runtime = Some(runtime.version.clone());
        let rootfs = match containers::make_rootfs(runtime, &self.layout.root) {
            Ok(rootfs) => rootfs,
            Err(e) => {
                run.containers_error = Some(e.to_string());
                return;
            }
        };
        let empty = self.layout.root.join("empty");
        if let Err(e) = std::fs::create_dir_all(&empty) {
            run.containers_error = Some(Error::io("create directory", &empty, e).to_string());
            return;
        }
        for claim in &self.workload.claims {
            let Some(Ok(devices)) = run.prepared.get(claim.uid()) else {
                continue;
            };
            let mut ids: Vec<String> = Vec::new();
            for id in devices.iter().flat_map(|d| &d.cdi_device_ids) {
                if !ids.contains(id) {
                    ids.push(id.clone());
                }
            }
            match containers::run(runtime, &self.layout.cdi_dir, &empty, &rootfs, &ids) {
                Ok(container) => {
                    run.containers.insert(claim.uid().to_owned(), container);
                }
                Err(e) => {
                    run.containers_error = Some(e.to_string());
                    return;
                }
            }
        }
    }

    /// One `NodeUnprepareResources` per pod, last pod first; a claim shared with a pod not
    /// yet torn down stays prepared until that pod goes, as in the kubelet.
    async fn unprepare_all(&self, kubelet: &RegisteredPlugin) -> Result<()> {
        let mut pods = self.runnable_pods();
        let mut failures = Vec::new();
        while let Some(claims) = pods.pop() {
            let still_used = |c: &Claim| pods.iter().flatten().any(|o| o.uid == c.uid);
            let batch: Vec<Claim> = claims.into_iter().filter(|c| !still_used(c)).collect();
            if batch.is_empty() {
                continue;
            }
            match kubelet.unprepare(&batch).await {
                Ok(answers) => failures.extend(
                    answers
                        .into_iter()
                        .filter_map(|(uid, r)| r.err().map(|e| format!("claim {uid}: {e}"))),
                ),
                Err(e) => failures.push(e.to_string()),
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::Unprepare(failures.join("; ")))
        }
    }
}

/// Stops every MPS daemon still running under the demo's MPS root once the plugin has
/// stopped. The plugin stops a GPU's daemon at the GPU's last unprepare and keeps running
/// ones across its own restarts (on a node they outlive the plugin on purpose), so after the
/// demo unprepared every claim none should be left; one that is, is stopped here (the
/// daemons run in their own process groups, so nothing else would end them) and reported
/// as an error.
async fn stop_leftover_daemons(config: &PluginConfig) -> Result<()> {
    let Some(settings) = config.mps_settings() else {
        return Ok(());
    };
    let daemons = MpsDaemons::new(settings);
    let mut left = Vec::new();
    for gpu in daemons.known_gpus() {
        let dirs = daemons.directories(&gpu)?;
        let Some(daemon) = daemons.running(&dirs) else {
            continue;
        };
        let stopped = match daemons.stop(&gpu).await {
            Ok(()) => "stopped".to_owned(),
            Err(e) => format!("cannot stop it: {e}"),
        };
        left.push(format!("GPU {gpu}: daemon {} ({stopped})", daemon.pid));
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "MPS daemons still ran after every claim was unprepared: {}",
            left.join("; ")
        )))
    }
}

/// Fails when the plugin left a socket or one of this driver's CDI specs behind, or the
/// demo its fault file.
fn check_clean(layout: &Layout, driver: &str) -> Result<()> {
    let sockets = layout.leftover_sockets();
    if !sockets.is_empty() {
        return Err(Error::Config(format!(
            "the plugin left sockets behind after shutdown: {sockets:?}"
        )));
    }
    if std::fs::symlink_metadata(&layout.fault_file).is_ok() {
        return Err(Error::Config(format!(
            "the mock fault file was left behind: {}",
            layout.fault_file.display()
        )));
    }
    let kind = PreparerConfig::cdi_kind_for(driver);
    let (vendor, class) = cdi::parse_kind(&kind)?;
    let prefix = format!("{vendor}-{class}_");
    let specs: Vec<PathBuf> = std::fs::read_dir(&layout.cdi_dir)
        .map_err(|e| Error::io("read directory", &layout.cdi_dir, e))?
        .filter_map(std::result::Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    if !specs.is_empty() {
        return Err(Error::Config(format!(
            "CDI specs left behind after unprepare: {specs:?}"
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // one call site; the pieces are the run's results
fn summarize(
    config: &DemoConfig,
    layout: &Layout,
    devices: &[Device],
    manifests: &manifests::Manifests,
    classes: &classes::Classes,
    workload: &Workload,
    claim_outcomes: &[ClaimOutcome],
    pod_outcomes: &[PodOutcome],
    mut node_run: NodeRun,
) -> Summary {
    let driver = config.driver_name.as_str();
    let claims = workload
        .claims
        .iter()
        .zip(claim_outcomes)
        .map(|(claim, outcome)| claim_report(claim, outcome, devices, driver, &mut node_run))
        .collect();
    let pods = workload
        .pods
        .iter()
        .zip(pod_outcomes)
        .map(|(pod, outcome)| PodReport {
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
            error: outcome.schedulable.clone().err(),
        })
        .collect();
    Summary {
        node: config.node_name.clone(),
        driver: driver.to_owned(),
        inventory: match &config.discovery {
            Discovery::MockProfile(profile) => format!("mock profile {profile}"),
            Discovery::MockFile(path) => format!("mock inventory {}", path.display()),
            Discovery::Nvml => "NVML".to_owned(),
        },
        devices: report::describe_devices(devices, driver),
        output_dir: layout.root.clone(),
        classes: classes.reports.clone(),
        claims,
        pods,
        invalid_manifests: manifests
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
            .collect(),
        ignored: manifests.ignored.clone(),
        containers_error: node_run.containers_error.take(),
        container_runtime: node_run.container_runtime.take(),
        gpu_tools_root: config
            .gpu_tools
            .as_ref()
            .map(|_| layout.gpu_tools_root.clone()),
        device_health: node_run.health.take(),
    }
}

fn claim_report(
    claim: &workload::DemoClaim,
    outcome: &ClaimOutcome,
    devices: &[Device],
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
            let mps = uid.as_deref().and_then(|u| {
                let name = cdi::claim_device_name(u, &a.device);
                let pipe = pipes.iter().find(|p| p.device == name)?;
                Some(MpsReport {
                    pipe_directory: pipe.host.clone(),
                    container_pipe_directory: pipe.container.clone(),
                    daemon_pid: node_run.mps_daemons.get(&pipe.host).copied().flatten(),
                })
            });
            let published = devices.iter().find(|d| d.name == a.device);
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
            }
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
