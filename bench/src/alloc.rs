//! `allocate` and `packing`: the controller's allocator on a simulated cluster of mock H100
//! nodes with a seeded workload.

use std::time::{Duration, Instant};

use kerf_core::alloc::{Index, PodRequest, Policy, place_where};

use crate::baseline::{Baseline, NodeChoice};
use crate::node::PROFILE;
use crate::rng::Rng;
use crate::stats::{Samples, percent, ratio, us};
use crate::summary::Summary;
use crate::workload::{self, Mix, Shape, Workload};
use crate::{BenchOptions, Error, Result};

/// Decisions between two measurements of the scan floor.
const FLOOR_EVERY: usize = 100;

/// The workload's shapes for `options`.
fn shapes(options: &BenchOptions, count: usize) -> Vec<Shape> {
    let mut workload = Workload::new(options.seed, Mix::default());
    (0..count).map(|_| workload.next_shape()).collect()
}

fn pods(shapes: &[Shape], policy: Policy) -> Vec<PodRequest> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| shape.pod(workload::claim_uid(i as u64), policy))
        .collect()
}

/// The floor of a decision: one look at every GPU's free capacity, which an allocator that
/// scored every GPU would need at least.
fn scan(index: &Index) -> Duration {
    let started = Instant::now();
    let mut free = 0u64;
    for node in index.nodes() {
        for gpu in node.gpus() {
            free =
                free.wrapping_add(gpu.free_memory_bytes() ^ u64::from(gpu.free_compute_percent()));
        }
    }
    std::hint::black_box(free);
    started.elapsed()
}

/// The `allocate` benchmark.
///
/// # Errors
/// The mock profile is missing.
pub(crate) fn allocate(options: &BenchOptions) -> Result<Summary> {
    let (mut index, inventory) = workload::cluster(options.nodes, PROFILE)?;
    let pods = pods(&shapes(options, options.allocate_claims), Policy::BinPack);
    let decisions = decide_all(&mut index, &pods);
    Ok(allocate_summary(options, inventory.gpus.len(), &decisions))
}

/// The latencies of every decision of the `allocate` benchmark, and of the scan floor.
struct Decisions {
    placed: Samples,
    failed: Samples,
    all: Samples,
    floor: Samples,
}

/// Places (and applies) every pod in order, timing each decision, with a scan of every GPU
/// every [`FLOOR_EVERY`] decisions.
fn decide_all(index: &mut Index, pods: &[PodRequest]) -> Decisions {
    let mut placed_latency = Vec::with_capacity(pods.len());
    let mut failed_latency = Vec::new();
    let mut floor = Vec::with_capacity(pods.len() / FLOOR_EVERY + 1);
    for (i, pod) in pods.iter().enumerate() {
        if i % FLOOR_EVERY == 0 {
            floor.push(scan(index));
        }
        let started = Instant::now();
        match place_where(index, pod, |_| true) {
            Ok(placement) => {
                index.apply(&placement);
                placed_latency.push(started.elapsed());
            }
            Err(unplaceable) => {
                std::hint::black_box(unplaceable);
                failed_latency.push(started.elapsed());
            }
        }
    }
    Decisions {
        placed: Samples::new(placed_latency.clone()),
        failed: Samples::new(failed_latency.clone()),
        all: Samples::new([placed_latency, failed_latency].concat()),
        floor: Samples::new(floor),
    }
}

/// The `allocate` summary: rate, latencies against the scan floor, and the targets.
fn allocate_summary(options: &BenchOptions, gpus_per_node: usize, d: &Decisions) -> Summary {
    let (all, placed, failed, floor) = (&d.all, &d.placed, &d.failed, &d.floor);
    let gpus = options.nodes * gpus_per_node;
    let total = all.total();
    let rate = if total.is_zero() {
        0.0
    } else {
        f64::from(u32::try_from(all.len()).unwrap_or(u32::MAX)) / total.as_secs_f64()
    };
    let mut s = Summary::new("allocate");
    s.detail(format!(
        "{} decisions (place_where + apply) on {} nodes x {} GPUs = {gpus} GPUs, seed {}, BinPack; {} placed, {} unplaceable (explained)",
        all.len(),
        options.nodes,
        gpus_per_node,
        options.seed,
        placed.len(),
        failed.len()
    ));
    s.detail(format!(
        "all         p50 {} us  p99 {} us  max {} us  -> {rate:.0} decisions/s",
        us(all.p50()),
        us(all.p99()),
        us(all.max())
    ));
    s.detail(format!(
        "placed      p50 {} us  p99 {} us;  unplaceable p50 {} us  p99 {} us",
        us(placed.p50()),
        us(placed.p99()),
        us(failed.p50()),
        us(failed.p99())
    ));
    s.detail(format!(
        "floor: one scan of every GPU's free capacity p50 {} us; decision p50 = {} x scan",
        us(floor.p50()),
        ratio(all.p50(), floor.p50())
    ));
    s.figure("decisions", all.len())
        .figure("gpus", gpus)
        .figure("placed", placed.len())
        .figure("unplaceable", failed.len())
        .figure("per_s", format!("{rate:.0}"))
        .figure("p50_us", us(all.p50()))
        .figure("p99_us", us(all.p99()))
        .figure("max_us", us(all.max()))
        .figure("placed_p99_us", us(placed.p99()))
        .figure("unplaceable_p99_us", us(failed.p99()))
        .figure("scan_p50_us", us(floor.p50()))
        .figure("ratio_p50_scan", ratio(all.p50(), floor.p50()))
        .figure("ratio_p99_scan", ratio(all.p99(), floor.p50()));
    allocate_targets(&mut s, rate, all);
    s
}

/// The `allocate` targets: at least 10,000 decisions/s, p99 at most 1 ms.
fn allocate_targets(s: &mut Summary, rate: f64, all: &Samples) {
    s.target(
        "rate_target",
        "allocate >= 10000 decisions/s",
        rate >= 10_000.0,
        format!("{rate:.0}/s"),
    );
    s.target(
        "p99_target",
        "allocate p99 <= 1 ms",
        all.p99() <= Duration::from_millis(1),
        format!("{} us", us(all.p99())),
    );
}

/// How full a cluster got before its first failure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Packed {
    /// Claims placed before the first that did not fit.
    pub claims: usize,
    /// Share of the cluster's GPU memory allocated (whole GPUs count their whole memory).
    pub memory: f64,
    /// Share of the cluster's compute allocated (whole GPUs count 100 %).
    pub compute: f64,
    /// Share of GPUs held whole.
    pub whole_gpus: f64,
    /// Share of GPUs used at all (whole or by slices).
    pub used_gpus: f64,
}

/// What `index` has allocated.
pub(crate) fn packed(index: &Index, claims: usize) -> Packed {
    let (mut total_memory, mut memory, mut compute) = (0u128, 0u128, 0u64);
    let (mut gpus, mut whole, mut used) = (0u64, 0u64, 0u64);
    for node in index.nodes() {
        for gpu in node.gpus() {
            let usage = gpu.usage();
            let size = u128::from(gpu.info().memory_bytes);
            total_memory += size;
            gpus += 1;
            if usage.whole_holders > 0 {
                memory += size;
                compute += 100;
                whole += 1;
            } else {
                memory += u128::from(usage.slice_memory_bytes).min(size);
                compute += u64::from(usage.slice_compute_percent.min(100));
            }
            used += u64::from(!usage.is_idle());
        }
    }
    let share = |a: u128, b: u128| {
        if b == 0 {
            0.0
        } else {
            // Shares only need a few digits.
            #[allow(clippy::cast_precision_loss)]
            let s = a as f64 / b as f64;
            s
        }
    };
    Packed {
        claims,
        memory: share(memory, total_memory),
        compute: share(u128::from(compute), u128::from(gpus) * 100),
        whole_gpus: share(u128::from(whole), u128::from(gpus)),
        used_gpus: share(u128::from(used), u128::from(gpus)),
    }
}

/// Allocates `shapes` with kerf's allocator and `policy` until the first that does not fit.
pub(crate) fn pack_kerf(mut index: Index, shapes: &[Shape], policy: Policy) -> Packed {
    for (i, pod) in pods(shapes, policy).iter().enumerate() {
        match place_where(&index, pod, |_| true) {
            Ok(placement) => index.apply(&placement),
            Err(_) => return packed(&index, i),
        }
    }
    packed(&index, shapes.len())
}

/// Allocates `shapes` with kube-scheduler's allocator ([`Baseline`]) until the first that
/// does not fit; what it allocated is counted on `index` as kerf's allocator counts it.
///
/// # Errors
/// [`Error::Workload`] when the allocator fails (a search that took too long).
pub(crate) fn pack_first_fit(
    mut index: Index,
    shapes: &[Shape],
    choice: NodeChoice,
) -> Result<Packed> {
    let mut baseline = Baseline::new(&index, choice);
    for (i, shape) in shapes.iter().enumerate() {
        match baseline.place(*shape).map_err(Error::Workload)? {
            Some(placement) => index.set_claim_usage(
                &workload::claim_uid(i as u64),
                placement.device_uses(*shape),
            ),
            None => return Ok(packed(&index, i)),
        }
    }
    Ok(packed(&index, shapes.len()))
}

/// The `packing` benchmark.
///
/// # Errors
/// The mock profile is missing, or the workload never fills the cluster.
pub(crate) fn packing(options: &BenchOptions) -> Result<Summary> {
    let (index, inventory) = workload::cluster(options.nodes, PROFILE)?;
    let shapes = shapes(options, options.allocate_claims);
    let runs = [
        (
            "binpack",
            pack_kerf(index.clone(), &shapes, Policy::BinPack),
        ),
        ("spread", pack_kerf(index.clone(), &shapes, Policy::Spread)),
        (
            "firstfit",
            pack_first_fit(
                index.clone(),
                &shapes,
                NodeChoice::Scheduler(Rng::new(options.seed)),
            )?,
        ),
        (
            "firstfit_ordered",
            pack_first_fit(index, &shapes, NodeChoice::InOrder)?,
        ),
    ];
    if runs.iter().all(|(_, p)| p.claims == shapes.len()) {
        return Err(Error::Workload(format!(
            "all {} claims fit on {} nodes: nothing to compare; use more claims or fewer nodes",
            shapes.len(),
            options.nodes
        )));
    }
    let mut s = Summary::new("packing");
    s.detail(format!(
        "seeded workload (seed {}, {} % slices 5Gi-40Gi / 10-50 % compute, {} % 1 GPU, {} % 2 NVLink GPUs, {} % 4 NVLink GPUs) on {} nodes x {} GPUs, until the first claim that does not fit",
        options.seed,
        Mix::default().slice,
        Mix::default().whole_one,
        Mix::default().nvlink_two,
        Mix::default().nvlink_four,
        options.nodes,
        inventory.gpus.len()
    ));
    s.detail("firstfit: kube-scheduler's structured allocator (kerf-scheduler-standin: every GPU shareable with memory and compute capacity, first devices in inventory order, no scoring) on a node the scheduler picks at random among the feasible nodes it finds from a rotating start; firstfit_ordered: the same allocator on the first feasible node by name (plain first-fit, for reference)");
    for (name, p) in &runs {
        s.detail(format!(
            "{name:<17} {:>6} claims  memory {:>5} %  compute {:>5} %  whole GPUs {:>5} %  GPUs used {:>5} %",
            p.claims,
            percent(p.memory),
            percent(p.compute),
            percent(p.whole_gpus),
            percent(p.used_gpus)
        ));
        s.figure(&format!("{name}_claims"), p.claims)
            .figure(&format!("{name}_memory_pct"), percent(p.memory))
            .figure(&format!("{name}_whole_gpus_pct"), percent(p.whole_gpus));
    }
    let binpack = runs[0].1;
    let first_fit = runs[2].1;
    let lead = (binpack.memory - first_fit.memory) * 100.0;
    s.figure("binpack_lead_pp", format!("{lead:.1}"));
    s.target(
        "lead_target",
        "BinPack memory >= first-fit + 5 pp",
        lead >= 5.0,
        format!("{lead:+.1} pp"),
    );
    Ok(s)
}
