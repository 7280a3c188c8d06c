//! A whole kerf cluster in one process, for stress tests and benchmarks.
//!
//! [`Sim`] puts together:
//! - [`FakeApi`], the in-memory API server, with Ready nodes of mock GPU inventories
//!   ([`cluster::NodeSpec`], mixed by [`cluster::mixed_nodes`]);
//! - one **real** kubelet-plugin ResourceSlice publisher per node
//!   ([`kerf_kubelet_plugin::publish::Publisher`] over the node's `kerf_core::mock` inventory),
//!   which also publishes each device's `allocator` attribute from the node's ownership record;
//! - the **real** kerf-controller ([`kerf_controller::Process`], leader election off): the GpuClass
//!   reconciler turns kerf's installed GpuClasses ([`cluster::gpu_classes`]) into DeviceClasses,
//!   the claim controller allocates Controller-class claims and keeps the ownership records;
//! - the kube-scheduler stand-in ([`SchedulerStandIn`]), driven step by step with a seeded RNG
//!   ([`Sim::step`]), as kube-scheduler's loop runs (a step whenever a pod waits:
//!   [`Sim::schedule_until`]) or in the background ([`Sim::spawn_scheduler`]), and its
//!   resourceclaim controller pass ([`Sim::run_claim_controller`]);
//! - admission emulation ([`admission`]): each pod the sim creates passes through kerf's
//!   webhook decision first, and is stored with the scheduling gate when it decides so.
//!
//! What is seeded: the workload ([`workload::Workload`]) and every choice of the stand-in. What
//! is not: kerf-controller and the publishers run as Tokio tasks on their own watches, so
//! *when* they act relative to the steps depends on the machine. A failing seed reproduces the
//! same sequence of requests, not necessarily the same interleaving.
//!
//! [`check::Checker`] reads the API state at any point and reports broken invariants (a
//! device in two exclusive allocations, an over-committed GPU, a bound pod without its
//! devices, a device kerf-controller allocated but does not own) and the ownership moves it
//! saw; [`monitor`] checks the devices of every state each claim passes through, from a
//! watch, so that a double allocation undone within milliseconds is caught too.

pub mod admission;
pub mod check;
pub mod cluster;
pub mod monitor;
mod tasks;
pub mod workload;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kerf_controller::webhook::{PodDecision, Skip};
use kerf_controller::{BackoffConfig, ControllerConfig};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt as _};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::fake_api::{FakeApi, Identity};
use cluster::{DeviceInfo, NodeSpec};
use kerf_scheduler_standin::{
    BindOutcome, CycleOutcome, SchedulerStandIn, SeededRng, SpawnConfig, StandInConfig,
    StandInHandle, StepReport,
};
pub use tasks::PodWatch;
use tasks::{spawn_controller, spawn_pod_watch, spawn_publisher};
use workload::{PINNED_LABEL, PodPlan};

/// The DRA driver of the sim.
pub use crate::fixtures::DRIVER;
/// The namespace of the sim's pods and claims.
pub const NAMESPACE: &str = "default";
/// How long [`Sim::start`] waits for DeviceClasses and ResourceSlices (both take a few
/// milliseconds when kerf-controller and the publishers work), plus [`READY_PER_NODE`] for
/// each node: 500 publishers start one after the other on two shared cores. Generous, since
/// it only bounds a failure: a debug build's start-up on two cores shared with compilers took
/// over 10 s several times.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// See [`READY_TIMEOUT`].
const READY_PER_NODE: Duration = Duration::from_millis(40);
/// The user the stand-in talks as. On a cluster kube-scheduler authenticates as
/// `system:kube-scheduler` and RBAC's bootstrap role of that name authorizes it; FakeApi
/// loads only kerf's RBAC, so the user is also in `system:masters`. Its own name lets request
/// counts ([`crate::fake_api::RequestCounts`]) tell the scheduler's requests from the user's.
pub const SCHEDULER_USER: &str = "system:kube-scheduler";

/// What went wrong setting up or driving the sim.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The cluster could not be set up as configured.
    #[error("sim setup: {0}")]
    Setup(String),
    /// Something the sim waited for did not happen in time.
    #[error("sim: no {0}")]
    Timeout(String),
    /// An API call of the sim itself failed.
    #[error("sim API call {what}: {source}")]
    Api {
        /// The call.
        what: String,
        /// The error.
        source: kube::Error,
    },
}

fn api_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> SimError {
    let what = what.into();
    move |source| SimError::Api { what, source }
}

/// How the sim is built.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The nodes.
    pub nodes: Vec<NodeSpec>,
    /// Seed of the stand-in's choices.
    pub seed: u64,
    /// kerf-controller's configuration (see [`SimConfig::fast_controller`]).
    pub controller: ControllerConfig,
    /// The stand-in's configuration.
    pub stand_in: StandInConfig,
    /// The publishers' debounce between noticing a change and publishing again.
    pub publisher_debounce: Duration,
    /// Whether pods pass through kerf's admission decision (the webhook); off only to show
    /// what goes wrong without it.
    pub admission: bool,
}

impl SimConfig {
    /// `nodes`, seed `seed`, [`SimConfig::fast_controller`], the stand-in's defaults, a 10 ms
    /// publisher debounce and admission on.
    pub fn new(nodes: Vec<NodeSpec>, seed: u64) -> Self {
        SimConfig {
            nodes,
            seed,
            controller: Self::fast_controller(),
            stand_in: StandInConfig::default(),
            publisher_debounce: Duration::from_millis(10),
            admission: true,
        }
    }

    /// kerf-controller's defaults with every wait cut to what a simulation of seconds needs:
    /// back-off 20 ms to 500 ms, rejected nodes avoided for 200 ms at first (at most 2 s),
    /// unplaceable claims retried after 100 ms, pods with missing claims after 50 ms,
    /// ownership decided every 25 ms, a device reclaimed from the scheduler placed on 300 ms
    /// after its republished slice is seen (the settle period: well above the stand-in's
    /// Reserve-to-PreBind time in the sim, a few tens of milliseconds, as kerf's 10 s default
    /// is above kube-scheduler's), and an idle lent device returned after 500 ms.
    pub fn fast_controller() -> ControllerConfig {
        let mut config = ControllerConfig::new(DRIVER);
        config.backoff = BackoffConfig {
            base: Duration::from_millis(20),
            max: Duration::from_millis(500),
        };
        let claims = &mut config.claims;
        claims.rejection_backoff = Duration::from_millis(200);
        claims.rejection_backoff_max = Duration::from_secs(2);
        claims.unplaceable_retry = Duration::from_millis(100);
        claims.pending_retry = Duration::from_millis(50);
        claims.ownership.settle = Duration::from_millis(300);
        claims.ownership.linger = Duration::from_millis(500);
        claims.ownership_tick = Duration::from_millis(25);
        config
    }
}

/// Counts of what the sim did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Pods created.
    pub created: u64,
    /// Of those, created with kerf's scheduling gate.
    pub gated: u64,
    /// Pods deleted.
    pub deleted: u64,
    /// Stand-in steps.
    pub steps: u64,
    /// Pods the stand-in bound.
    pub bound: u64,
    /// PreBinds or binds that failed (the pod was retried).
    pub bind_failures: u64,
    /// Scheduling cycles that found no node.
    pub unschedulable: u64,
    /// Scheduling cycles aborted by an error.
    pub cycle_errors: u64,
}

/// True for pods the sim created with `spec.nodeName` (they skip the scheduler).
pub fn is_pinned(pod: &Pod) -> bool {
    pod.labels().get(PINNED_LABEL).is_some_and(|v| v == "true")
}

/// The simulated cluster (see the module documentation).
pub struct Sim {
    fake: FakeApi,
    client: Client,
    config: SimConfig,
    devices: Vec<DeviceInfo>,
    stand_in: Option<SchedulerStandIn>,
    rng: SeededRng,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    /// Creation time of every pod the sim created, and whether it was created on a node.
    created_at: HashMap<String, (Instant, bool)>,
    pods: PodWatch,
    /// Counts of what the sim did.
    pub stats: SimStats,
    /// The invariant checker, fed by [`Sim::observe`].
    pub checker: check::Checker,
    /// The watch of every claim state ([`monitor`]), drained by [`Sim::observe`].
    pub monitor: monitor::ClaimMonitor,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("nodes", &self.config.nodes.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// Builds the cluster and starts publishers and kerf-controller; returns once every
    /// DeviceClass exists and every node has published its slices. Must run in a Tokio
    /// runtime.
    ///
    /// # Errors
    /// [`SimError::Setup`] for a bad node spec or manifest, or when the cluster is not ready
    /// within 10 s and 40 ms per node.
    pub async fn start(config: SimConfig) -> Result<Sim, SimError> {
        let fake = FakeApi::new();
        let client = fake.client();
        let devices = cluster::devices(&config.nodes)?;
        for node in &config.nodes {
            fake.insert(node.node_object());
        }
        let classes = cluster::gpu_classes()?;
        for class in &classes {
            fake.insert(class.clone());
        }
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();
        let (monitor, task) = monitor::spawn(&client, DRIVER, &devices, shutdown.clone());
        tasks.push(task);
        for node in &config.nodes {
            // Each component talks as its own ServiceAccount, so RBAC limits it as on a cluster.
            let plugin = fake.client_as(Identity::kerf_kubelet_plugin(&node.name));
            tasks.push(spawn_publisher(&plugin, node, &config, shutdown.clone())?);
        }
        let controller = fake.client_as(Identity::kerf_controller());
        tasks.push(spawn_controller(&controller, &config, shutdown.clone()));
        let pods = PodWatch::default();
        tasks.push(spawn_pod_watch(&client, pods.clone(), shutdown.clone()));
        let scheduler = fake.client_as(Identity {
            username: SCHEDULER_USER.to_owned(),
            groups: Identity::admin().groups,
            extra: std::collections::BTreeMap::new(),
        });
        let stand_in = SchedulerStandIn::with_config(scheduler, DRIVER, config.stand_in.clone())
            .reading(crate::scheduler_snapshots::store_snapshots(fake.clone()));
        let sim = Sim {
            checker: check::Checker::new(DRIVER, &devices),
            monitor,
            fake,
            client,
            rng: SeededRng::new(config.seed),
            config,
            devices,
            stand_in: Some(stand_in),
            shutdown,
            tasks,
            created_at: HashMap::new(),
            pods,
            stats: SimStats::default(),
        };
        sim.wait_ready(classes.len()).await?;
        Ok(sim)
    }

    async fn wait_ready(&self, classes: usize) -> Result<(), SimError> {
        let nodes = u32::try_from(self.config.nodes.len()).unwrap_or(u32::MAX);
        let timeout = READY_TIMEOUT + READY_PER_NODE.saturating_mul(nodes);
        let deadline = Instant::now() + timeout;
        loop {
            let have_classes = self.fake.list_resources::<DeviceClass>(None).len();
            let slices = self.fake.list_resources::<ResourceSlice>(None);
            let published = self
                .config
                .nodes
                .iter()
                .filter(|n| {
                    slices
                        .iter()
                        .any(|s| s.spec.node_name.as_deref() == Some(&n.name))
                })
                .count();
            if have_classes >= classes && published == self.config.nodes.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(SimError::Setup(format!(
                    "not ready after {timeout:?}: kerf-controller made {have_classes} of the {classes} DeviceClasses of kerf's GpuClasses, {published} of {} nodes published their slices",
                    self.config.nodes.len()
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// How the sim was built.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The in-memory API server.
    pub fn fake(&self) -> &FakeApi {
        &self.fake
    }

    /// Every published device.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// The watch of the pods: when each was first seen bound, which wait for a scheduler.
    pub fn pods(&self) -> &PodWatch {
        &self.pods
    }

    /// When the sim created pod `name` (in [`NAMESPACE`]).
    pub fn created_at(&self, name: &str) -> Option<Instant> {
        self.created_at.get(name).map(|(at, _)| *at)
    }

    /// For every pod the sim created without `spec.nodeName` and saw bound (deleted ones
    /// included): the time from its creation to its binding.
    pub fn bind_latencies(&self) -> Vec<Duration> {
        self.created_at
            .iter()
            .filter(|(_, (_, pinned))| !pinned)
            .filter_map(|(name, (created, _))| {
                let bound = self.pods.bound_at(&format!("{NAMESPACE}/{name}"))?;
                Some(bound.saturating_duration_since(*created))
            })
            .collect()
    }

    /// Creates the plan's claim, then its pod, after admission (see [`admission`]). Returns
    /// the admission decision.
    ///
    /// # Errors
    /// A failed create or a bug in the plan ([`SimError`]).
    pub async fn create(&mut self, plan: &PodPlan) -> Result<PodDecision, SimError> {
        let claim: ResourceClaim =
            from_json(plan.shape.claim(&plan.claim_name(), NAMESPACE, DRIVER))?;
        Api::<ResourceClaim>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &claim)
            .await
            .map_err(api_error(format!("create claim {}", plan.claim_name())))?;
        let mut pod = plan.pod(NAMESPACE);
        let decision = if self.config.admission {
            admission::admit(&self.fake, DRIVER, NAMESPACE, &mut pod)?
        } else {
            PodDecision::Skip(Skip::NoControllerClaim)
        };
        let pod: Pod = from_json(pod)?;
        Api::<Pod>::namespaced(self.client.clone(), NAMESPACE)
            .create(&PostParams::default(), &pod)
            .await
            .map_err(api_error(format!("create pod {}", plan.name)))?;
        self.created_at
            .insert(plan.name.clone(), (Instant::now(), plan.node.is_some()));
        self.stats.created += 1;
        if matches!(decision, PodDecision::Gate(_)) {
            self.stats.gated += 1;
        }
        Ok(decision)
    }

    /// Deletes the plan's pod, then its claim (as the garbage collector deletes a pod's
    /// generated claim after the pod). A pod or claim already gone is fine.
    ///
    /// # Errors
    /// A failed delete other than 404.
    pub async fn delete(&mut self, plan: &PodPlan) -> Result<(), SimError> {
        let params = DeleteParams::default();
        let pods = Api::<Pod>::namespaced(self.client.clone(), NAMESPACE);
        match pods.delete(&plan.name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(api_error(format!("delete pod {}", plan.name))(e)),
        }
        let claims = Api::<ResourceClaim>::namespaced(self.client.clone(), NAMESPACE);
        match claims.delete(&plan.claim_name(), &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(api_error(format!("delete claim {}", plan.claim_name()))(e)),
        }
        self.stats.deleted += 1;
        Ok(())
    }

    /// One stand-in step ([`SchedulerStandIn::step`]) with the sim's RNG.
    ///
    /// # Errors
    /// [`SimError::Setup`] while the stand-in runs in the background; a failed snapshot read.
    pub async fn step(&mut self) -> Result<StepReport, SimError> {
        let stand_in = self
            .stand_in
            .as_mut()
            .ok_or_else(|| SimError::Setup("the stand-in runs in the background".to_owned()))?;
        let report = stand_in
            .step(&mut self.rng)
            .await
            .map_err(api_error("stand-in snapshot"))?;
        self.stats.steps += 1;
        for outcome in &report.bound {
            match outcome {
                BindOutcome::Bound { .. } => self.stats.bound += 1,
                BindOutcome::Failed { .. } => self.stats.bind_failures += 1,
            }
        }
        match report.cycle {
            CycleOutcome::Unschedulable { .. } => self.stats.unschedulable += 1,
            CycleOutcome::Error { .. } => self.stats.cycle_errors += 1,
            CycleOutcome::Idle | CycleOutcome::Reserved { .. } => {}
        }
        Ok(report)
    }

    /// One pass of the stand-in's resourceclaim controller.
    ///
    /// # Errors
    /// As [`Sim::step`].
    pub async fn run_claim_controller(&self) -> Result<Vec<String>, SimError> {
        let stand_in = self
            .stand_in
            .as_ref()
            .ok_or_else(|| SimError::Setup("the stand-in runs in the background".to_owned()))?;
        stand_in
            .run_claim_controller_once()
            .await
            .map_err(api_error("resourceclaim controller"))
    }

    /// Runs the stand-in in the background ([`SchedulerStandIn::spawn`]) until
    /// [`Sim::stop_scheduler`]; [`Sim::step`] is unavailable meanwhile.
    ///
    /// # Errors
    /// [`SimError::Setup`] when it already runs in the background.
    pub fn spawn_scheduler(&mut self, config: SpawnConfig) -> Result<StandInHandle, SimError> {
        let stand_in = self.stand_in.take().ok_or_else(|| {
            SimError::Setup("the stand-in already runs in the background".to_owned())
        })?;
        Ok(stand_in.spawn(config))
    }

    /// Stops the background stand-in and takes it back; returns its log.
    ///
    /// # Errors
    /// [`SimError::Setup`] when its task failed.
    pub async fn stop_scheduler(&mut self, handle: StandInHandle) -> Result<Vec<String>, SimError> {
        let (stand_in, log) = handle
            .stop()
            .await
            .map_err(|e| SimError::Setup(format!("stand-in task: {e}")))?;
        self.stand_in = Some(stand_in);
        Ok(log)
    }

    /// Runs the stand-in the way kube-scheduler's loop runs: a step whenever a pod waits for
    /// a scheduler or a reservation waits for its PreBind, otherwise asleep until a pod
    /// starts waiting (upstream: `ScheduleOne` blocks in the active queue's `Pop`,
    /// `pkg/scheduler/backend/queue/scheduling_queue.go`). Returns once `done` holds.
    ///
    /// # Errors
    /// [`SimError::Timeout`] naming `what` after `timeout`; as [`Sim::step`].
    pub async fn schedule_until(
        &mut self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Sim) -> bool,
    ) -> Result<(), SimError> {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            if Instant::now() > deadline {
                return Err(SimError::Timeout(format!("{what} within {timeout:?}")));
            }
            let reserved = self
                .stand_in
                .as_ref()
                .is_some_and(|s| !s.pending_prebinds().is_empty());
            if reserved || self.pods.waiting() > 0 {
                self.step().await?;
                tokio::task::yield_now().await;
            } else {
                let pods = self.pods.clone();
                let _ =
                    tokio::time::timeout(Duration::from_millis(5), pods.waiting_changed()).await;
            }
        }
        Ok(())
    }

    /// Sets label `key` of every node to `value` (a merge patch, as `kubectl label
    /// --overwrite` does), e.g. [`kerf_api::ownership::NODE_LABEL`] to pin the owner.
    ///
    /// # Errors
    /// A failed patch.
    pub async fn label_nodes(&self, key: &str, value: &str) -> Result<(), SimError> {
        let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(self.client.clone());
        let patch = serde_json::json!({"metadata": {"labels": {key: value}}});
        for node in &self.config.nodes {
            nodes
                .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api_error(format!("label node {}", node.name)))?;
        }
        Ok(())
    }

    /// Polls `done` every millisecond until it holds, for at most `timeout`.
    ///
    /// # Errors
    /// [`SimError::Timeout`] naming `what` when it does not hold in time.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Sim) -> bool,
    ) -> Result<(), SimError> {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            if Instant::now() > deadline {
                return Err(SimError::Timeout(format!("{what} within {timeout:?}")));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// Checks every invariant on the current state ([`check::Checker::observe`]) and adds
    /// what [`monitor`] found in the claim states since the last call (states the poll may
    /// have missed; the monitor trails the API by the watch's delivery time).
    pub fn observe(&mut self) -> check::Observation {
        let mut observation = self.checker.observe(&self.fake);
        let missed = self.monitor.take_violations();
        self.checker.violations += missed.len() as u64;
        for violation in missed {
            if !observation.violations.contains(&violation) {
                observation
                    .violations
                    .push(format!("{violation} (seen by the claim watch)"));
            }
        }
        observation
    }

    /// The sim's pods that are not done yet (`namespace/name`): a pod is done when it is
    /// bound to a node and each of its claims is allocated there.
    pub fn not_done(&self) -> Vec<String> {
        let claims: HashMap<String, ResourceClaim> = self
            .fake
            .list_resources::<ResourceClaim>(Some(NAMESPACE))
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect();
        self.fake
            .list_resources::<Pod>(Some(NAMESPACE))
            .into_iter()
            .filter(|pod| {
                let Some(node) = check::pod_node(pod) else {
                    return true;
                };
                !check::pod_claims(pod).iter().all(|name| {
                    claims.get(name).is_some_and(|c| {
                        let held = kerf_api::device_uses(c, DRIVER);
                        !held.is_empty() && held.iter().all(|u| u.node == node)
                    })
                })
            })
            .map(|pod| format!("{NAMESPACE}/{}", pod.name_any()))
            .collect()
    }

    /// Stops kerf-controller, the publishers and the watches.
    pub async fn stop(self) {
        self.shutdown.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }
}

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> Result<T, SimError> {
    serde_json::from_value(value).map_err(|e| SimError::Setup(format!("object: {e}")))
}
