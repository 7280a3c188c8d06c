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

use std::time::{Duration, Instant};

use kerf_api::ownership::{NODE_LABEL, Owner};
use kerf_tests::sim::cluster::h100_nodes;
use kerf_tests::sim::workload::{PodPlan, Shape};
use kerf_tests::sim::{NAMESPACE, Sim, SimConfig, check};

use crate::stats::{Samples, ms, ratio_f};
use crate::summary::Summary;
use crate::sys;
use crate::{BenchOptions, Result};

/// Rounds of each phase.
pub const ROUNDS: usize = 3;
/// How long a phase may take before the benchmark gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long pinning owners or cleaning up may take.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

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
pub async fn scheduling(options: &BenchOptions) -> Result<Summary> {
    let nodes = options.scheduling_nodes;
    let pods = options.scheduling_pods;
    let mut sim = Sim::start(SimConfig::new(h100_nodes(nodes), options.seed)).await?;
    let mut controller = Measured::default();
    let mut direct = Measured::default();
    let result = async {
        for round in 0..ROUNDS {
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
    let owner = phase.owner();
    sim.label_nodes(NODE_LABEL, owner.as_str()).await?;
    let what = format!("devices published as the {owner}'s");
    sim.wait_for(&what, SETTLE_TIMEOUT, |sim| {
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
    sim.schedule_until(&what, PHASE_TIMEOUT, |sim| {
        keys.iter().all(|k| sim.pods().bound_at(k).is_some())
    })
    .await?;
    let mut last = started;
    for (key, created) in keys.iter().zip(&created) {
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
    measured.pods += pods;
    measured.cycles += sim.stats.steps - steps_before;
    measured.cpu += sys::cpu_time()?.saturating_sub(cpu_before);
    measured.busy += last.saturating_duration_since(started);
    for plan in &plans {
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
    sim.wait_for("release of every claim", SETTLE_TIMEOUT, |sim| {
        sim.fake()
            .list(&format!(
                "/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims"
            ))
            .is_empty()
    })
    .await?;
    Ok(())
}

fn summary(options: &BenchOptions, controller: &Measured, direct: &Measured) -> Summary {
    let c = Samples::new(controller.latencies.clone());
    let d = Samples::new(direct.latencies.clone());
    let (c_rate, d_rate) = (controller.rate(), direct.rate());
    let ratio = ratio_f(c_rate, d_rate);
    let mut s = Summary::new("scheduling");
    s.detail(format!(
        "{} nodes x 8 H100 (simulated: in-memory API server, kerf-controller, plugin publishers, scheduler stand-in), {ROUNDS} rounds x {} pods per phase, seed {}",
        options.scheduling_nodes, options.scheduling_pods, options.seed
    ));
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
    s.detail(format!("controller / direct rate: {ratio}"));
    s.figure("nodes", options.scheduling_nodes)
        .figure("pods_per_phase", options.scheduling_pods)
        .figure("rounds", ROUNDS)
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
        .figure("ratio", &ratio);
    s.target(
        "ratio_target",
        "controller-class pods/s >= direct Scheduler-class pods/s (ratio >= 1.0)",
        d_rate > 0.0 && c_rate >= d_rate,
        format!("ratio {ratio}"),
    );
    s
}
