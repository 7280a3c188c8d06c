//! Start-up and shutdown of the whole plugin: checkpoint, CDI, gRPC servers, publisher, HTTP.

use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::features::{self, ApiFeature, Probed};
use kerf_core::cdi::{self, CommonEdits, DeviceNodePolicy};
use kerf_core::driver_root;
use kerf_core::health::XidPolicy;
use kerf_core::inventory::Inventory;
use kerf_ops::ready::{ReadyFlag, ReadyFlags};
use kerf_proto::pluginregistration::registration_server::RegistrationServer;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::checkpoint_store::{CheckpointStore, Opened};
use crate::claim_events::{ClaimEvents, KubeClaimEvents, MemoryClaimEvents};
use crate::claim_reader::{ApiClaimReader, CachingClaimReader, ClaimReader};
use crate::config::PluginConfig;
use crate::dynamic_mig::DynamicMig;
use crate::grpc::dra::DraService;
use crate::grpc::registration::RegistrationService;
use crate::grpc::socket::BoundSocket;
use crate::health::grpc::HealthService;
use crate::health::mock::NodeAnnotationSource;
use crate::health::{HealthConfig, HealthMonitor};
use crate::instances::OtherInstances;
use crate::metrics::Metrics;
use crate::preparer::device_status::{DeviceStatusConfig, DeviceStatusWriter};
use crate::preparer::{Preparer, PreparerConfig};
use crate::publish::{Publisher, SharedPublicationHandle};
use crate::write_failures::WriteFailureReports;
use crate::{Error, Result, discovery};

/// Device nodes every CUDA process needs besides its GPUs.
const CONTROL_DEVICE_NODES: [&str; 3] =
    ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// What the plugin talks to outside the node.
pub struct Connections {
    /// Where claims are read from; a reader with a cache has its watch started with the
    /// plugin ([`ClaimReader::cache_task`]).
    pub claim_reader: Arc<dyn ClaimReader>,
    /// Client used to publish ResourceSlices and to watch the Node's ownership record (the
    /// devices' `allocator` attribute); `None` disables publishing.
    pub publisher: Option<kube::Client>,
    /// Where Warning Events about prepared claims go.
    pub events: Arc<dyn ClaimEvents>,
    /// Client that writes prepared claims' per-device status (`status.devices`); `None`
    /// disables it.
    pub device_status: Option<kube::Client>,
    /// Client that creates, reads and deletes MPS daemon pods (`--mps-daemons=pod`); unused
    /// with daemon processes.
    pub mps_daemon_pods: Option<kube::Client>,
}

impl Connections {
    /// Everything through one API client, as `config`'s flags ask: claims read from a
    /// watch-fed cache of the node's claims, GETting the others (`claim_cache`; else a GET
    /// each), slices published (`publish_resources`), claims' device status written
    /// (`claim_device_status`), MPS daemon pods and Events.
    pub fn kube(client: kube::Client, config: &PluginConfig) -> Self {
        let node = config.node_name.as_str();
        let claim_reader: Arc<dyn ClaimReader> = if config.claim_cache {
            Arc::new(CachingClaimReader::new(client.clone(), node))
        } else {
            Arc::new(ApiClaimReader::new(client.clone()))
        };
        Connections {
            claim_reader,
            events: Arc::new(KubeClaimEvents::new(client.clone(), node)),
            device_status: config.claim_device_status.then(|| client.clone()),
            mps_daemon_pods: Some(client.clone()),
            publisher: config.publish_resources.then_some(client),
        }
    }

    /// Claims from `claim_reader` and no other API use: nothing published, no device status
    /// written, no MPS daemon pods, Events kept in memory. For the demo, tests and tools that
    /// run the plugin without a cluster; set a field on top for the one connection they want.
    pub fn reading(claim_reader: Arc<dyn ClaimReader>) -> Self {
        Connections {
            claim_reader,
            publisher: None,
            events: Arc::new(MemoryClaimEvents::default()),
            device_status: None,
            mps_daemon_pods: None,
        }
    }
}

/// A running plugin. Dropping it without [`RunningPlugin::shutdown`] leaves tasks running
/// until the runtime stops; sockets are removed when the servers end.
pub struct RunningPlugin {
    shutdown: CancellationToken,
    tasks: Vec<Task>,
    preparer: Arc<Preparer>,
    registry: Arc<Registry>,
    ready: ReadyFlags,
    device_health: HealthMonitor,
    device_taints: Option<Probed>,
}

impl RunningPlugin {
    /// The prepare/unprepare engine (for in-process callers such as the demo).
    pub fn preparer(&self) -> &Arc<Preparer> {
        &self.preparer
    }

    /// The metrics registry.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The readiness flags `/readyz` reports (process readiness, not GPU health).
    pub fn ready_flags(&self) -> &ReadyFlags {
        &self.ready
    }

    /// The monitor of the devices' health (for in-process callers such as the demo).
    pub fn device_health(&self) -> &HealthMonitor {
        &self.device_health
    }

    /// What the start-up probe found about device taints; `None` when the plugin does not
    /// publish ResourceSlices.
    pub fn device_taints(&self) -> Option<&Probed> {
        self.device_taints.as_ref()
    }

    /// A token that stops the plugin when cancelled.
    pub(crate) fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Waits until the plugin stops (a task failed or the token was cancelled), then stops
    /// everything: servers end and remove their sockets, the publisher deletes its slices.
    ///
    /// # Errors
    /// The first task that failed.
    pub async fn wait(self) -> Result<()> {
        let RunningPlugin {
            shutdown, tasks, ..
        } = self;
        let (names, handles): (Vec<_>, Vec<_>) = tasks.into_iter().unzip();
        let mut first_error = None;
        let mut pending: Vec<_> = handles
            .into_iter()
            .zip(names)
            .map(|(h, n)| Box::pin(async move { (n, h.await) }))
            .collect();
        while !pending.is_empty() {
            let ((name, joined), _, rest) = futures::future::select_all(pending).await;
            pending = rest;
            let result = joined.map_err(|e| Error::internal(name, e)).and_then(|r| r);
            match result {
                Ok(()) => tracing::info!(task = name, "stopped"),
                Err(e) => {
                    tracing::error!(task = name, error = %e, "failed; stopping the plugin");
                    first_error.get_or_insert(e);
                }
            }
            shutdown.cancel();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Stops the plugin and waits for it.
    ///
    /// # Errors
    /// The first task that failed.
    pub async fn shutdown(self) -> Result<()> {
        self.shutdown.cancel();
        self.wait().await
    }
}

/// Discovers the inventory as configured (NVML or mock), NVML discovery marking the GPUs
/// `config.dynamic_mig` allows as dynamic-MIG GPUs. The MIG instances kerf created are read
/// from the checkpoint file as it is now (before the plugin opens it), so that they do not
/// make their GPU look partitioned by hand.
///
/// # Errors
/// No discovery is available, or it fails.
pub fn discover(config: &PluginConfig) -> Result<Inventory> {
    let (mock_gpus, mock_file) = match &config.discovery {
        crate::config::Discovery::Nvml => (None, None),
        crate::config::Discovery::MockProfile(spec) => (Some(spec.as_str()), None),
        crate::config::Discovery::MockFile(path) => (None, Some(path.as_path())),
    };
    let policy = discovery::DynamicMigPolicy {
        enabled: config.dynamic_mig.enabled,
        static_gpus: config.dynamic_mig.static_gpus.clone(),
        kerf_instances: recorded_mig_instances(&config.checkpoint_file),
    };
    let source: discovery::DynamicMigSource = Arc::new(move || policy.clone());
    let source = discovery::select_with_dynamic_mig(mock_gpus, mock_file, Some(source))?;
    let inventory = source.discover()?;
    let dynamic = inventory.gpus.iter().filter(|g| g.dynamic_mig).count();
    tracing::info!(source = source.source(), gpus = inventory.gpus.len(), dynamic_mig_gpus = dynamic, driver = %inventory.driver_version, "discovered GPUs");
    Ok(inventory)
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `address` until `shutdown`.
async fn spawn_http(
    address: std::net::SocketAddr,
    registry: &Arc<Registry>,
    ready: &ReadyFlags,
    shutdown: &CancellationToken,
) -> Result<Task> {
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| Error::io("bind metrics address", address.to_string(), e))?;
    tracing::info!(%address, "serving /metrics, /healthz and /readyz");
    let (registry, ready, token) = (Arc::clone(registry), ready.clone(), shutdown.clone());
    let serve = kerf_ops::http::serve(listener, registry, ready, token);
    Ok((
        "http",
        tokio::spawn(async move { serve.await.map_err(Error::Http) }),
    ))
}

/// The MIG instances the checkpoint at `path` records, read without changing the file (the
/// checkpoint store deals with a missing or corrupt one when it opens it). An unreadable
/// checkpoint names no instance: a GPU holding kerf's instances then counts as partitioned
/// by hand and is left alone, which is the safe side.
fn recorded_mig_instances(path: &Path) -> discovery::KerfInstances {
    let checkpoint = match std::fs::read(path) {
        Ok(bytes) => kerf_core::checkpoint::decode(&bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return discovery::KerfInstances::default();
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the checkpoint for kerf's MIG instances; GPUs with MIG devices count as partitioned by hand");
            return discovery::KerfInstances::default();
        }
    };
    match checkpoint {
        Ok(cp) => discovery::KerfInstances::from_records(
            &kerf_core::mig_reconcile::recorded_instances(&cp),
        ),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot decode the checkpoint for kerf's MIG instances; GPUs with MIG devices count as partitioned by hand");
            discovery::KerfInstances::default()
        }
    }
}

/// Starts every part of the plugin and returns once the sockets serve.
///
/// # Errors
/// The checkpoint, CDI directory, sockets or HTTP address cannot be set up.
pub async fn start(
    config: &PluginConfig,
    inventory: Inventory,
    connections: Connections,
) -> Result<RunningPlugin> {
    let shutdown = CancellationToken::new();
    let inventory = Arc::new(inventory);
    let events = Arc::clone(&connections.events);
    let Parts {
        registry,
        metrics,
        preparer,
        publisher,
        mut tasks,
    } = open(config, &inventory, connections, &shutdown).await?;
    let registry = Arc::new(registry);
    let (serving, registered) = (ReadyFlag::new(), ReadyFlag::new());
    let ready = crate::http::ready_flags(&serving, &registered);

    let device_health = HealthMonitor::new(Arc::clone(&inventory), metrics.clone());
    tasks.extend(spawn_health_sources(config, &device_health, &shutdown));
    let sockets = (&preparer, &device_health, &registered);
    tasks.extend(spawn_sockets(config, sockets, &metrics, &shutdown)?);
    serving.set(true);
    tasks.extend(spawn_mps_check(
        config, &preparer, &inventory, &metrics, &events, &shutdown,
    ));

    let mut device_taints = None;
    if let Some(publisher) = publisher {
        let publishing = (&inventory, &device_health, &shutdown);
        let (task, probed) = spawn_publisher(config, publisher, publishing).await;
        tasks.push(task);
        device_taints = Some(probed);
    }
    if let Some(address) = config.metrics_address {
        tasks.push(spawn_http(address, &registry, &ready, &shutdown).await?);
    }

    tracing::info!(
        driver = %config.driver_name,
        node = %config.node_name,
        dra_socket = %config.dra_socket.display(),
        registration_socket = %config.registration_socket.display(),
        "kubelet plugin serving"
    );
    Ok(RunningPlugin {
        shutdown,
        tasks,
        preparer,
        registry,
        ready,
        device_health,
        device_taints,
    })
}

/// The preparer and what it is built with, before anything serves.
struct Parts {
    registry: Registry,
    metrics: Metrics,
    preparer: Arc<Preparer>,
    /// The publisher, not yet running; none without a client.
    publisher: Option<(kube::Client, Publisher)>,
    /// The device status writer's and the claim cache's tasks.
    tasks: Vec<Task>,
}

/// Registers the metrics, starts the device status writer, opens dynamic MIG, builds the
/// publisher (for the handle the preparer reads the Node's publication through) and opens
/// the preparer on the checkpoint; then starts the claim cache.
async fn open(
    config: &PluginConfig,
    inventory: &Arc<Inventory>,
    connections: Connections,
    shutdown: &CancellationToken,
) -> Result<Parts> {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let reports = WriteFailureReports::new(
        Arc::clone(&connections.events),
        metrics.api_write_failures().clone(),
        &config.node_name,
    );
    let device_status = connections.device_status.map(|client| {
        start_device_status(config, client, &mut registry, shutdown, reports.clone())
    });
    let mig =
        crate::dynamic_mig::node::for_node(config, inventory, &mut registry, config.mock_crash_at)?;
    let (status_writer, status_task) = device_status.unzip();
    let claim_cache = connections.claim_reader.cache_task(shutdown.clone());
    let (publisher, publication) =
        build_publisher(config, connections.publisher, &metrics, reports);
    let preparer = Box::pin(open_preparer(
        config,
        inventory,
        connections.claim_reader,
        &metrics,
        (status_writer, publication, mig, connections.mps_daemon_pods),
    ))
    .await?;
    let mut tasks: Vec<Task> = status_task
        .map(|task| ("device-status", task))
        .into_iter()
        .collect();
    // Prepares do not wait for it: until its first list they GET their claims.
    tasks.extend(claim_cache.map(|task| ("claim-cache", tokio::spawn(task))));
    Ok(Parts {
        registry,
        metrics,
        preparer,
        publisher,
        tasks,
    })
}

/// The DRA server (with the health service the kubelet streams device health from) and the
/// registration server, each on its socket.
fn spawn_sockets(
    config: &PluginConfig,
    (preparer, device_health, registered): (&Arc<Preparer>, &HealthMonitor, &ReadyFlag),
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<[Task; 2]> {
    let health_service = health_service(config, &config.health, device_health, shutdown);
    let dra = spawn_dra_server(config, preparer, health_service, metrics, shutdown)?;
    let registration = spawn_registration_server(config, registered, metrics, shutdown)?;
    Ok([dra, registration])
}

/// The periodic check of the MPS daemons, when the preparer enforces sharing (else none).
fn spawn_mps_check(
    config: &PluginConfig,
    preparer: &Arc<Preparer>,
    inventory: &Inventory,
    metrics: &Metrics,
    events: &Arc<dyn ClaimEvents>,
    shutdown: &CancellationToken,
) -> Option<Task> {
    if !preparer.sharing_enforced() {
        return None;
    }
    metrics.init_mps_daemon_restarts(inventory.gpus.iter().map(|gpu| gpu.uuid.as_str()));
    let check = crate::mps_checks::check_mps_daemons(
        Arc::clone(preparer),
        metrics.clone(),
        Arc::clone(events),
        config.mps_check_interval,
        shutdown.clone(),
    );
    Some(("mps-daemon-check", tokio::spawn(check)))
}

/// Starts the per-device claim status writer, telling the writes the API server refuses
/// through `reports`.
fn start_device_status(
    config: &PluginConfig,
    client: kube::Client,
    registry: &mut Registry,
    shutdown: &CancellationToken,
    reports: WriteFailureReports,
) -> (DeviceStatusWriter, JoinHandle<Result<()>>) {
    let settings = DeviceStatusConfig::new(&config.driver_name, &config.node_name);
    DeviceStatusWriter::start_with_reports(
        client,
        settings,
        registry,
        shutdown.clone(),
        Some(reports),
    )
}

/// Opens the checkpoint and CDI directory, builds the preparer (with the per-device claim
/// status writer, if any, and the Node's shared publication as the publisher reads it) and
/// restores the node's state from the checkpoint: GPU sharing, then the CDI specs.
async fn open_preparer(
    config: &PluginConfig,
    inventory: &Arc<Inventory>,
    claim_reader: Arc<dyn ClaimReader>,
    metrics: &Metrics,
    (status_writer, publication, mig, mps_daemon_pods): (
        Option<DeviceStatusWriter>,
        SharedPublicationHandle,
        DynamicMig,
        Option<kube::Client>,
    ),
) -> Result<Arc<Preparer>> {
    let sharing = Box::pin(crate::mps_checks::gpu_sharing(config, mps_daemon_pods))
        .await?
        .with_gpus_of(inventory);
    let checkpoint = open_checkpoint(config).await?;
    // Until the clean-up below is done, another instance's prepares wait (rolling update).
    let start_up = checkpoint.start_up_hold().await?;
    std::fs::create_dir_all(&config.cdi_dir)
        .map_err(|e| Error::io("create CDI directory", &config.cdi_dir, e))?;
    let mut preparer = Preparer::new(
        preparer_config(config)?,
        Arc::clone(inventory),
        claim_reader,
        checkpoint,
        sharing,
        metrics.clone(),
    )?
    .with_shared_publication(publication);
    if let Some(writer) = status_writer {
        preparer = preparer.with_device_status(writer);
    }
    let preparer = Arc::new(
        preparer
            .with_dynamic_mig(mig)
            .with_crash_at(config.mock_crash_at),
    );
    crate::dynamic_mig::node::log_restore(&preparer.restore_dynamic_mig().await?);
    crate::mps_checks::log_sharing_restore(&preparer.restore_sharing().await);
    let restored = preparer.restore_cdi_specs().await?;
    drop(start_up);
    tracing::info!(
        prepared = preparer.prepared_claims(),
        rewritten = restored.rewritten,
        orphans_removed = restored.orphans_removed,
        "checkpoint restored"
    );
    Ok(preparer)
}

fn health_service(
    config: &PluginConfig,
    health_config: &HealthConfig,
    monitor: &HealthMonitor,
    shutdown: &CancellationToken,
) -> HealthService {
    HealthService::new(
        monitor.subscribe(),
        Arc::clone(monitor.inventory()),
        config.node_name.clone(),
        health_config.check_timeout,
        health_config.resend_interval,
        shutdown.clone(),
    )
}

/// The publisher (not yet running) and the handle through which the preparer reads the Node's
/// shared publication as the publisher keeps it; built before the preparer for that handle,
/// it starts publishing only once the sockets serve. Without a client nothing is published
/// and the handle stays empty.
fn build_publisher(
    config: &PluginConfig,
    client: Option<kube::Client>,
    metrics: &Metrics,
    reports: WriteFailureReports,
) -> (Option<(kube::Client, Publisher)>, SharedPublicationHandle) {
    let Some(client) = client else {
        return (None, SharedPublicationHandle::default());
    };
    let publisher = Publisher::new(
        client.clone(),
        config.driver_name.clone(),
        config.node_name.clone(),
        metrics.clone(),
    )
    .with_write_failure_reports(reports);
    let publisher =
        match OtherInstances::of_socket(&config.driver_name, &config.registration_socket) {
            Some(others) => publisher.with_other_instances(others),
            None => publisher,
        };
    let publication = publisher.shared_publication();
    (Some((client, publisher)), publication)
}

/// Probes device taints through `client`, then starts `publisher`: with taints when the API
/// server keeps them (else one log line says what is lost), and in mock mode with the Node
/// annotation as a fault source.
async fn spawn_publisher(
    config: &PluginConfig,
    (client, mut publisher): (kube::Client, Publisher),
    (inventory, device_health, shutdown): (&Arc<Inventory>, &HealthMonitor, &CancellationToken),
) -> (Task, Probed) {
    let health_config = &config.health;
    let probed = probe_device_taints(&client, &config.driver_name, &config.node_name).await;
    match probed.degraded_message(ApiFeature::DeviceTaints) {
        None => {
            tracing::info!("the API server keeps device taints: unhealthy devices are tainted");
            publisher =
                publisher.with_device_taints(device_health.subscribe(), health_config.taint_policy);
        }
        Some(line) => tracing::warn!("{line}"),
    }
    if health_config.mock_annotation {
        publisher =
            publisher.with_mock_fault_annotation(NodeAnnotationSource::new(device_health.clone()));
    }
    let inventory = Arc::clone(inventory);
    let token = shutdown.clone();
    let resync = config.resync_period;
    let task = tokio::spawn(async move { publisher.run(inventory, resync, token).await });
    (("publisher", task), probed)
}

/// Asks the API server whether it keeps device taints: a dry-run create of a slice with a
/// tainted device ([`features::device_taints_probe`]), once at start-up.
async fn probe_device_taints(client: &kube::Client, driver: &str, node: &str) -> Probed {
    let slices: kube::Api<ResourceSlice> = kube::Api::all(client.clone());
    let params = kube::api::PostParams {
        dry_run: true,
        field_manager: Some(crate::identity::FIELD_MANAGER.to_owned()),
    };
    match slices
        .create(&params, &features::device_taints_probe(driver, node))
        .await
    {
        Ok(answer) => features::kept_device_taints(&answer),
        Err(e) => Probed::Failed(e.to_string()),
    }
}

/// The tasks that observe device health: NVML on a real node; in mock mode the fault file,
/// if one is given (the Node annotation is read by the publisher's Node watch).
fn spawn_health_sources(
    config: &PluginConfig,
    monitor: &HealthMonitor,
    shutdown: &CancellationToken,
) -> Vec<Task> {
    let health = &config.health;
    let mut tasks = Vec::new();
    if !config.discovery.is_mock() {
        let policy = XidPolicy::ignoring(health.extra_ignored_xids.iter().copied());
        let task = crate::health::nvml::watch_nvml(
            monitor.clone(),
            policy,
            health.nvml_poll_interval,
            shutdown.clone(),
        );
        tasks.push(("nvml-health", tokio::spawn(task)));
    } else if let Some(path) = &health.mock_fault_file {
        tracing::info!(path = %path.display(), "mock device health from the fault file");
        let task = crate::health::mock::watch_fault_file(
            path.clone(),
            monitor.clone(),
            health.mock_fault_file_poll,
            shutdown.clone(),
        );
        tasks.push(("mock-fault-file", tokio::spawn(task)));
    }
    tasks
}

type Task = (&'static str, JoinHandle<Result<()>>);

fn spawn_dra_server(
    config: &PluginConfig,
    preparer: &Arc<Preparer>,
    health: HealthService,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<Task> {
    let dra = DraService::new(Arc::clone(preparer), metrics.clone());
    let mut socket = BoundSocket::bind(&config.dra_socket)?;
    let incoming = socket.incoming_any_authority("dra")?;
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        let _socket = socket;
        tonic::transport::Server::builder()
            .add_service(dra.v1())
            .add_service(dra.v1beta1())
            .add_service(health.server())
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
            .await
            .map_err(Error::from)
    });
    Ok(("dra-server", task))
}

fn spawn_registration_server(
    config: &PluginConfig,
    registered: &ReadyFlag,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<Task> {
    let registration = RegistrationService::new(
        config.driver_name.clone(),
        config.dra_socket.clone(),
        registered.clone(),
        metrics.clone(),
    );
    let mut socket = BoundSocket::bind(&config.registration_socket)?;
    let incoming = socket.incoming_any_authority("registration")?;
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        let _socket = socket;
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registration))
            .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
            .await
            .map_err(Error::from)
    });
    Ok(("registration-server", task))
}

async fn open_checkpoint(config: &PluginConfig) -> Result<CheckpointStore> {
    if let Some(dir) = config.checkpoint_file.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io("create checkpoint directory", dir, e))?;
    }
    let boot_id = read_boot_id(&config.boot_id_file);
    let (store, opened) = CheckpointStore::open(&config.checkpoint_file, &boot_id).await?;
    match opened {
        Opened::Fresh => {
            tracing::info!(path = %config.checkpoint_file.display(), "starting with an empty checkpoint");
        }
        Opened::Loaded => {
            tracing::info!(path = %config.checkpoint_file.display(), "checkpoint loaded");
        }
        Opened::Rebooted { forgotten } => {
            tracing::info!(path = %config.checkpoint_file.display(), forgotten, "the node booted since the checkpoint was written: nothing is prepared in this boot, the kubelet prepares its claims again");
        }
        // Only a power loss or a kernel crash tears the file (it is replaced atomically), and
        // the node boots again after either: nothing in it is prepared in this boot.
        Opened::MovedAside { moved_to, reason } => tracing::warn!(
            path = %config.checkpoint_file.display(),
            moved_to = %moved_to.display(),
            %reason,
            "checkpoint unreadable (left torn or empty by a power loss?): moved aside, starting with nothing prepared"
        ),
    }
    Ok(store)
}

fn read_boot_id(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(id) => id.trim().to_owned(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the boot ID; reboots will not be detected");
            String::new()
        }
    }
}

fn preparer_config(config: &PluginConfig) -> Result<PreparerConfig> {
    let mock = config.discovery.is_mock();
    let files = driver_root::discover(&config.driver_root)?;
    let device_nodes = DeviceNodePolicy {
        host_path_override: mock.then(|| config.mock_device_node.clone()),
    };
    let control_nodes = CONTROL_DEVICE_NODES
        .iter()
        // On a real node a missing node means the driver did not create it (e.g. no UVM);
        // naming it in the spec would make every container creation fail.
        .filter(|path| mock || Path::new(path).exists())
        .map(|path| cdi::DeviceNode::at(*path))
        .collect();
    Ok(PreparerConfig {
        driver_name: config.driver_name.clone(),
        node_name: config.node_name.clone(),
        cdi_dir: config.cdi_dir.clone(),
        cdi_kind: PreparerConfig::cdi_kind_for(&config.driver_name),
        common_edits: CommonEdits {
            device_nodes: control_nodes,
            mounts: files.mounts(),
            env: Vec::new(),
        },
        device_nodes,
    })
}
