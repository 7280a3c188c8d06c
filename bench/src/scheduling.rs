//! `scheduling`: pods per second through the kube-scheduler stand-in on the simulated cluster
//! of `kerf_tests::sim` (in-memory API server, the real kerf-controller, the real
//! kubelet-plugin publishers), in the same run on the same nodes:
//!
//! - **controller**: pods with one Controller-class slice claim (`slice.gpu.kerf.dev`, 10Gi and
//!   10 %). Admission gates them, kerf-controller allocates the claim and removes the gate, the
//!   stand-in only reserves the claim and binds the pod.
//! - **direct** (the floor): pods with one Scheduler-class whole-GPU claim (`gpu.kerf.dev`),
//!   which the stand-in allocates (CEL over every device) and binds itself, as kube-scheduler
//!   does for any DRA driver.
//!
//! Each round pins every node's devices to the phase's allocator with the node label
//! `gpu.kerf.dev/allocator` and waits until the publishers show the new owners, so neither
//! phase measures ownership moves; then it creates all pods of the phase at once and runs the
//! stand-in as kube-scheduler's loop runs (a cycle whenever a pod waits for a scheduler,
//! asleep otherwise: `Sim::schedule_until`) until every pod is bound (seen by a watch). A pod's latency is creation to binding; a phase's rate is its pods over
//! the time from its first creation to its last binding. Rounds alternate which phase runs
//! first. The ratio reported is controller rate / direct rate (target ≥ 1.0: routing pods
//! through kerf-controller costs the scheduler nothing).
//!
//! The stand-in runs with kube-scheduler's per-pod costs where they can be imitated in one
//! process: Filter stops at `numFeasibleNodesToFind` feasible nodes and rotates its start
//! node, its requests wait on kube-scheduler's client rate limit (50 QPS, burst 100) and a
//! bound pod gets the `Scheduled` Event (see `kerf_scheduler_standin`). Every API request of
//! a phase's window (from the first creation to the last binding, everyone's) is counted by
//! user, verb and resource and reported per pod: on a real control plane each write costs
//! kube-apiserver and etcd CPU, which the in-memory API server does not charge. The admission
//! webhook runs in process (`kerf_tests::sim::admission`): on a cluster it is one more HTTPS
//! call per pod create, on either path.

use std::time::{Duration, Instant};

use kerf_api::ownership::{NODE_LABEL, Owner};
use kerf_scheduler_standin::ClientRateLimit;
use kerf_tests::fake_api::{Identity, RequestCounts};
use kerf_tests::sim::cluster::h100_nodes;
use kerf_tests::sim::workload::{PodPlan, Shape};
use kerf_tests::sim::{NAMESPACE, SCHEDULER_USER, Sim, SimConfig, check};

use crate::stats::{Samples, ms, ratio_f};
use crate::summary::Summary;
use crate::sys;
use crate::{BenchOptions, Result};

/// Rounds of each phase on small clusters.
pub(crate) const ROUNDS: usize = 3;
/// Above this many nodes, two rounds (one in each order): a 500-node round takes minutes.
const LARGE_CLUSTER: usize = 64;
/// How long a phase may take before the benchmark gives up: this, plus [`PHASE_PER_POD`]
/// for each pod (the stand-in is throttled to 50 requests per second, and a direct pod's
/// cycle filters hundreds of nodes with CEL at 500 nodes).
const PHASE_TIMEOUT: Duration = Duration::from_secs(60);
/// See [`PHASE_TIMEOUT`].
const PHASE_PER_POD: Duration = Duration::from_millis(500);
/// How long pinning owners or cleaning up may take: this, plus [`SETTLE_PER_NODE`] for each
/// node (every node's publisher republishes when its label changes).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// See [`SETTLE_TIMEOUT`].
const SETTLE_PER_NODE: Duration = Duration::from_millis(100);

/// Rounds of each phase at `nodes` nodes.
fn rounds(nodes: usize) -> usize {
    if nodes > LARGE_CLUSTER { 2 } else { ROUNDS }
}

fn scaled(base: Duration, each: Duration, count: usize) -> Duration {
    base + each.saturating_mul(u32::try_from(count).unwrap_or(u32::MAX))
}

/// One of the two ways a pod gets its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Gated, allocated by kerf-controller, bound by the stand-in.
    Controller,
    /// Allocated and bound by the stand-in.
    Direct,
}

impl Phase {
    fn owner(self) -> Owner {
        match self {
            Phase::Controller => Owner::Controller,
            Phase::Direct => Owner::Scheduler,
        }
    }

    fn shape(self) -> Shape {
        match self {
            Phase::Controller => Shape::Slice {
                memory_gib: 10,
                compute: 10,
            },
            Phase::Direct => Shape::Whole,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Phase::Controller => "controller",
            Phase::Direct => "direct",
        }
    }
}

/// What the phases of all rounds measured.
#[derive(Debug, Default)]
struct Measured {
    latencies: Vec<Duration>,
    /// Creation to the gate's removal (controller phase) and the gate's removal to binding.
    to_ungated: Vec<Duration>,
    ungated_to_bound: Vec<Duration>,
    /// Stand-in scheduling cycles.
    cycles: u64,
    /// CPU time of the whole process (all components) from the first creation to the last
    /// binding.
    cpu: Duration,
    pods: usize,
    busy: Duration,
    /// Every API request in the phases' windows, by user, verb and resource.
    requests: RequestCounts,
}

impl Measured {
    fn cycles_per_pod(&self) -> String {
        let cycles = f64::from(u32::try_from(self.cycles).unwrap_or(u32::MAX));
        let pods = f64::from(u32::try_from(self.pods).unwrap_or(u32::MAX));
        ratio_f(cycles, pods)
    }

    fn cpu_per_pod(&self) -> Duration {
        self.cpu / u32::try_from(self.pods.max(1)).unwrap_or(u32::MAX)
    }

    /// Writes per pod of everyone, then of each user; the read requests per pod of everyone.
    fn writes_per_pod(&self) -> (String, Vec<String>, String) {
        let pods = u64::try_from(self.pods.max(1)).unwrap_or(u64::MAX);
        let per = |n: u64| ratio_f(as_f64(n), as_f64(pods));
        let mut users: Vec<&str> = self
            .requests
            .counts
            .keys()
            .map(|k| k.user.as_str())
            .collect();
        users.dedup();
        let mut lines = Vec::new();
        for user in users {
            let kinds: Vec<String> = self
                .requests
                .counts
                .iter()
                .filter(|(k, _)| k.user == user && k.is_write())
                .map(|(k, n)| format!("{} {} {}", k.verb, k.resource, per(*n)))
                .collect();
            if !kinds.is_empty() {
                lines.push(format!(
                    "{} {}: {}",
                    short_user(user),
                    per(self.requests.writes_of(user)),
                    kinds.join(", ")
                ));
            }
        }
        let total: u64 = self.requests.counts.values().sum();
        let reads = total - self.requests.writes();
        (per(self.requests.writes()), lines, per(reads))
    }

    fn rate(&self) -> f64 {
        let pods = f64::from(u32::try_from(self.pods).unwrap_or(u32::MAX));
        if self.busy.is_zero() {
            0.0
        } else {
            pods / self.busy.as_secs_f64()
        }
    }
}

/// The `scheduling` benchmark.
///
/// # Errors
/// The simulated cluster does not start, or a phase does not finish in time.
pub(crate) async fn scheduling(options: &BenchOptions) -> Result<Summary> {
    let nodes = options.scheduling_nodes;
    let pods = options.scheduling_pods;
    let mut config = SimConfig::new(h100_nodes(nodes), options.seed);
    config.stand_in.client_rate_limit = Some(ClientRateLimit::KUBE_SCHEDULER);
    config.stand_in.scheduled_events = true;
    let mut sim = Sim::start(config).await?;
    let mut controller = Measured::default();
    let mut direct = Measured::default();
    let result = async {
        for round in 0..rounds(nodes) {
            let order = if round % 2 == 0 {
                [Phase::Direct, Phase::Controller]
            } else {
                [Phase::Controller, Phase::Direct]
            };
            for phase in order {
                let measured = match phase {
                    Phase::Controller => &mut controller,
                    Phase::Direct => &mut direct,
                };
                run_phase(&mut sim, phase, round, pods, measured).await?;
            }
        }
        Ok::<(), crate::Error>(())
    }
    .await;
    sim.stop().await;
    result?;
    Ok(summary(options, &controller, &direct))
}

async fn run_phase(
    sim: &mut Sim,
    phase: Phase,
    round: usize,
    pods: usize,
    measured: &mut Measured,
) -> Result<()> {
    let settle = scaled(SETTLE_TIMEOUT, SETTLE_PER_NODE, sim.config().nodes.len());
    hand_over(sim, phase.owner(), settle).await?;
    sim.fake().clear_requests();
    let steps_before = sim.stats.steps;
    let cpu_before = sys::cpu_time()?;
    let plans: Vec<PodPlan> = (0..pods)
        .map(|i| PodPlan {
            name: format!("{}-{round}-{i:04}", phase.name()),
            shape: phase.shape(),
            node: None,
        })
        .collect();
    let started = Instant::now();
    let mut created = Vec::with_capacity(pods);
    for plan in &plans {
        sim.create(plan).await?;
        created.push(sim.created_at(&plan.name).unwrap_or(started));
    }
    let keys: Vec<String> = plans
        .iter()
        .map(|p| format!("{NAMESPACE}/{}", p.name))
        .collect();
    let what = format!("binding of all {pods} {} pods", phase.name());
    let timeout = scaled(PHASE_TIMEOUT, PHASE_PER_POD, pods);
    sim.schedule_until(&what, timeout, |sim| {
        keys.iter().all(|k| sim.pods().bound_at(k).is_some())
    })
    .await?;
    let requests = sim.fake().request_counts();
    let last = record_latencies(sim, &keys, &created, started, measured);
    measured.pods += pods;
    measured.cycles += sim.stats.steps - steps_before;
    measured.cpu += sys::cpu_time()?.saturating_sub(cpu_before);
    measured.busy += last.saturating_duration_since(started);
    for (kind, count) in requests.counts {
        *measured.requests.counts.entry(kind).or_insert(0) += count;
    }
    cleanup(sim, &plans, settle).await
}

/// Gives every node's devices to `owner` and waits until they are published as its (and,
/// for kerf-controller, until it may place on them).
async fn hand_over(sim: &mut Sim, owner: Owner, settle: Duration) -> Result<()> {
    sim.label_nodes(NODE_LABEL, owner.as_str()).await?;
    let what = format!("devices published as the {owner}'s");
    sim.wait_for(&what, settle, |sim| {
        check::published_owners(sim.fake(), kerf_tests::sim::DRIVER)
            .values()
            .all(|o| *o == Some(owner))
    })
    .await?;
    if owner == Owner::Controller {
        // kerf-controller places on a device it took back only after the settle period that
        // follows seeing the device republished (its fence), decided at its next tick.
        let claims = &sim.config().controller.claims;
        tokio::time::sleep(claims.ownership.settle + 4 * claims.ownership_tick).await;
    }
    Ok(())
}

/// Adds each pod's create-to-bound latency (and, for gated pods, to ungated and ungated to
/// bound) to `measured`; returns the last binding (`started` if none).
fn record_latencies(
    sim: &Sim,
    keys: &[String],
    created: &[Instant],
    started: Instant,
    measured: &mut Measured,
) -> Instant {
    let mut last = started;
    for (key, created) in keys.iter().zip(created) {
        let bound = sim.pods().bound_at(key).unwrap_or(started);
        last = last.max(bound);
        measured
            .latencies
            .push(bound.saturating_duration_since(*created));
        if let Some(ungated) = sim.pods().ungated_at(key) {
            measured
                .to_ungated
                .push(ungated.saturating_duration_since(*created));
            measured
                .ungated_to_bound
                .push(bound.saturating_duration_since(ungated));
        }
    }
    last
}

/// Deletes the phase's pods and claims and waits until every claim is gone.
async fn cleanup(sim: &mut Sim, plans: &[PodPlan], settle: Duration) -> Result<()> {
    for plan in plans {
        sim.delete(plan).await?;
    }
    for _ in 0..100 {
        sim.run_claim_controller().await?;
        if sim
            .fake()
            .list(&format!(
                "/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
            ))
            .is_empty()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sim.wait_for("release of every claim", settle, |sim| {
        sim.fake()
            .list(&format!(
                "/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
            ))
            .is_empty()
    })
    .await?;
    Ok(())
}

fn as_f64(n: u64) -> f64 {
    f64::from(u32::try_from(n).unwrap_or(u32::MAX))
}

/// The name a request count prints for `user`.
fn short_user(user: &str) -> String {
    if user == SCHEDULER_USER {
        "kube-scheduler (stand-in)".to_owned()
    } else if user == Identity::admin().username {
        "user (creates)".to_owned()
    } else if let Some(account) = user.strip_prefix("system:serviceaccount:kerf-system:") {
        account.to_owned()
    } else {
        user.to_owned()
    }
}

/// The request-count lines of one phase.
fn request_details(s: &mut Summary, name: &str, measured: &Measured) -> String {
    let (writes, lines, reads) = measured.writes_per_pod();
    s.detail(format!(
        "{name}: API writes per pod {writes} (requests in the phase's window, everyone's), reads {reads}"
    ));
    for line in lines {
        s.detail(format!("  {name} writes per pod, {line}"));
    }
    writes
}

fn summary(options: &BenchOptions, controller: &Measured, direct: &Measured) -> Summary {
    let c = Samples::new(controller.latencies.clone());
    let d = Samples::new(direct.latencies.clone());
    let (c_rate, d_rate) = (controller.rate(), direct.rate());
    let ratio = ratio_f(c_rate, d_rate);
    let mut s = Summary::new("scheduling");
    s.detail(setup_detail(options));
    s.detail(format!(
        "controller (gate -> kerf-controller allocates -> ungate -> stand-in binds): {c_rate:.1} pods/s, latency p50 {} ms p99 {} ms",
        ms(c.p50()),
        ms(c.p99())
    ));
    s.detail(format!(
        "direct (stand-in allocates and binds; the floor):                          {d_rate:.1} pods/s, latency p50 {} ms p99 {} ms",
        ms(d.p50()),
        ms(d.p99())
    ));
    let (to_ungated, after) = (
        Samples::new(controller.to_ungated.clone()),
        Samples::new(controller.ungated_to_bound.clone()),
    );
    s.detail(format!(
        "controller phase split: creation -> gate removed p50 {} ms p99 {} ms; gate removed -> bound p50 {} ms p99 {} ms",
        ms(to_ungated.p50()),
        ms(to_ungated.p99()),
        ms(after.p50()),
        ms(after.p99())
    ));
    per_pod_details(&mut s, controller, direct);
    let c_writes = request_details(&mut s, "controller", controller);
    let d_writes = request_details(&mut s, "direct", direct);
    s.detail(
        "not counted: the admission webhook call on every pod create (in process here, one HTTPS call per pod on a cluster, on both paths)"
            .to_owned(),
    );
    s.detail(format!("controller / direct rate: {ratio}"));
    s.figure("nodes", options.scheduling_nodes)
        .figure("pods_per_phase", options.scheduling_pods)
        .figure("rounds", rounds(options.scheduling_nodes))
        .figure("controller_per_s", format!("{c_rate:.1}"))
        .figure("controller_p50_ms", ms(c.p50()))
        .figure("controller_p99_ms", ms(c.p99()))
        .figure("controller_ungate_p50_ms", ms(to_ungated.p50()))
        .figure("controller_ungated_to_bound_p50_ms", ms(after.p50()))
        .figure("controller_cpu_ms_per_pod", ms(controller.cpu_per_pod()))
        .figure("direct_per_s", format!("{d_rate:.1}"))
        .figure("direct_p50_ms", ms(d.p50()))
        .figure("direct_p99_ms", ms(d.p99()))
        .figure("direct_cpu_ms_per_pod", ms(direct.cpu_per_pod()))
        .figure("controller_writes_per_pod", &c_writes)
        .figure("direct_writes_per_pod", &d_writes)
        .figure("ratio", &ratio);
    s.target(
        "ratio_target",
        "controller-class pods/s >= direct Scheduler-class pods/s (ratio >= 1.0)",
        d_rate > 0.0 && c_rate >= d_rate,
        format!("ratio {ratio}"),
    );
    s
}

/// What the `scheduling` benchmark ran on.
fn setup_detail(options: &BenchOptions) -> String {
    format!(
        "{} nodes x 8 H100 (simulated: in-memory API server, kerf-controller, plugin publishers, scheduler stand-in at 50 QPS / burst 100, filtering up to {} feasible nodes), {} rounds x {} pods per phase, seed {}",
        options.scheduling_nodes,
        kerf_scheduler_standin::num_feasible_nodes_to_find(options.scheduling_nodes),
        rounds(options.scheduling_nodes),
        options.scheduling_pods,
        options.seed
    )
}

/// The stand-in's cycles and the process's CPU per pod, on both paths.
fn per_pod_details(s: &mut Summary, controller: &Measured, direct: &Measured) {
    s.detail(format!(
        "stand-in cycles per pod: controller {}, direct {}",
        controller.cycles_per_pod(),
        direct.cycles_per_pod()
    ));
    s.detail(format!(
        "CPU per pod (whole process: API server, controller, publishers, stand-in): controller {} ms, direct {} ms",
        ms(controller.cpu_per_pod()),
        ms(direct.cpu_per_pod())
    ));
}
