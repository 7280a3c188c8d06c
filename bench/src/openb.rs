//! `openb`: kerf's placement replaying Alibaba's GPU-sharing trace, beside the published
//! results of the paper "Beware of Fragmentation" (FGD, USENIX ATC '23).
//!
//! Per trace (`openb_pod_list_<trace>.csv`) and seed, the tasks are inflated to 130 % of the
//! cluster's GPUs ([`inflate`]) and replayed ([`replay`]) under each placer: kerf's policies
//! through `kerf_core::alloc::place_where` with node CPU and memory fit from
//! `kerf_core::alloc::node_fit` (tasks without GPUs where kube-scheduler's default scoring
//! puts them, [`kube`], with or without kerf's `PreferNoSchedule` taint on the nodes with idle
//! GPUs), and the FGD port ([`fgd`]) that checks the replay against the paper. The figures are the allocation ratio at 100 % and 130 % arrived demand, means
//! over the seeds, beside the paper's six policies; the curves go to an SVG ([`svg`]).

mod cluster;
mod curve;
mod data;
mod fgd;
mod inflate;
mod kube;
mod replay;
mod svg;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kerf_core::alloc::Policy;

use crate::summary::Summary;
use crate::{BenchOptions, Error, Result};

use self::cluster::Cluster;
use self::curve::{Curve, mean_at, mean_curve};
use self::data::ExpectedRow;
use self::replay::{Placer, TraceInput, replay};

/// The paper's policies, in its order.
const PAPER_POLICIES: [&str; 6] = [
    "Random",
    "DotProd",
    "GpuClustering",
    "GpuPacking",
    "BestFit",
    "FGD",
];

/// Every placer, kerf's default policy first, in the order of the tables.
pub(crate) const PLACERS: [Placer; 7] = [
    Placer::KerfTainted,
    Placer::Kerf(Policy::LeastFragmentation),
    Placer::KerfAll,
    Placer::Kerf(Policy::BinPack),
    Placer::Kerf(Policy::Spread),
    Placer::Fgd,
    Placer::FgdKube,
];

/// The placers `options` names ([`BenchOptions::openb_placers`], by key), all when none.
fn placers(options: &BenchOptions) -> Result<Vec<Placer>> {
    if options.openb_placers.is_empty() {
        return Ok(PLACERS.to_vec());
    }
    options
        .openb_placers
        .iter()
        .map(|key| {
            PLACERS
                .iter()
                .copied()
                .find(|p| p.key() == key)
                .ok_or_else(|| Error::InvalidOption {
                    option: "openb_placers",
                    reason: format!(
                        "unknown placer {key:?}; expected some of: {}",
                        PLACERS.map(Placer::key).join(", ")
                    ),
                })
        })
        .collect()
}

/// The data directory: `options.openb_dir`, or when that is the relative default and not a
/// directory here, the same path relative to this repository's root.
fn data_dir(options: &BenchOptions) -> PathBuf {
    let dir = &options.openb_dir;
    if dir.is_dir() || dir.is_absolute() {
        return dir.clone();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let beside = repo.join(dir);
    if beside.is_dir() { beside } else { dir.clone() }
}

/// One trace's results: per placer, one curve per seed.
struct TraceResult {
    trace: String,
    tasks: usize,
    curves: Vec<(Placer, Vec<Curve>)>,
}

/// The `openb` benchmark.
///
/// # Errors
/// The data directory or a file in it cannot be read or parsed, or a named trace has no file.
pub(crate) fn openb(options: &BenchOptions) -> Result<Summary> {
    let dir = data_dir(options);
    let traces = if options.openb_traces.is_empty() {
        data::traces(&dir)?
    } else {
        options.openb_traces.clone()
    };
    if traces.is_empty() {
        return Err(Error::Workload(format!(
            "no openb_pod_list_*.csv in {}",
            dir.display()
        )));
    }
    let nodes: Vec<_> = data::read_nodes(&dir)?
        .into_iter()
        .step_by(options.openb_node_stride.max(1))
        .collect();
    let expected = data::read_expected(&dir)?;
    let placers = placers(options)?;
    let started = Instant::now();
    let mut results = Vec::new();
    for trace in &traces {
        let tasks = data::read_tasks(&dir, trace)?;
        let input = TraceInput::new(Cluster::new(nodes.clone()), tasks);
        results.push(run_trace(trace, &input, &placers, &options.openb_seeds));
    }
    let mut summary = report(&results, &expected, options, &nodes);
    summary.detail(format!(
        "replays took {:.1} s on {} threads",
        started.elapsed().as_secs_f64(),
        threads()
    ));
    if let Some(path) = &options.openb_svg {
        let picture = svg::render(&svg_series(&results, &expected));
        std::fs::write(path, picture).map_err(|e| Error::io("write", path, e))?;
        summary.detail(format!("curves written to {}", path.display()));
    }
    Ok(summary)
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Every placer × seed of one trace, on all cores.
fn run_trace(trace: &str, input: &TraceInput, placers: &[Placer], seeds: &[u64]) -> TraceResult {
    let jobs: Vec<(usize, u64)> = (0..placers.len())
        .flat_map(|p| seeds.iter().map(move |&s| (p, s)))
        .collect();
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, u64, Curve)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..threads().min(jobs.len()) {
            scope.spawn(|| {
                while let Some(&(p, seed)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let curve = replay(input, placers[p], seed);
                    if let Ok(mut done) = done.lock() {
                        done.push((p, seed, curve));
                    }
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_default();
    done.sort_by_key(|(p, seed, _)| (*p, *seed));
    let curves = placers
        .iter()
        .enumerate()
        .map(|(p, placer)| {
            let mine = done
                .iter()
                .filter(|(q, _, _)| *q == p)
                .map(|(_, _, c)| c.clone())
                .collect();
            (*placer, mine)
        })
        .collect();
    TraceResult {
        trace: trace.to_owned(),
        tasks: input.tasks.len(),
        curves,
    }
}

/// The paper's curves of `trace` and `policy` (one per seed).
fn paper_curves(expected: &[ExpectedRow], trace: &str, policy: &str) -> Vec<Curve> {
    expected
        .iter()
        .filter(|r| r.trace == trace && r.policy == policy)
        .map(|r| r.ratios.iter().copied().map(Some).collect())
        .collect()
}

fn fmt(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

/// The table, the figures and the targets.
fn report(
    results: &[TraceResult],
    expected: &[ExpectedRow],
    options: &BenchOptions,
    nodes: &[data::NodeRow],
) -> Summary {
    let mut summary = Summary::new("openb");
    let gpus: u64 = nodes.iter().map(|n| u64::from(n.gpus)).sum();
    summary.detail(format!(
        "openb: {} nodes, {gpus} GPUs; seeds {:?}; inflation to 130 % of the GPUs; GPU allocation ratio (%) at 100 % and 130 % arrived demand, means over the seeds",
        nodes.len(),
        options.openb_seeds
    ));
    for result in results {
        summary.detail(format!("trace {} ({} tasks)", result.trace, result.tasks));
        for (placer, curves) in &result.curves {
            let (at100, at130) = (mean_at(curves, 100), mean_at(curves, 130));
            summary.detail(format!(
                "  {:<34} {:>7} {:>7}",
                placer.name(),
                fmt(at100),
                fmt(at130)
            ));
            let key = format!("{}_{}", result.trace, placer.key());
            summary.figure(&format!("{key}_100"), fmt(at100));
        }
        for policy in PAPER_POLICIES {
            let curves = paper_curves(expected, &result.trace, policy);
            if curves.is_empty() {
                continue;
            }
            summary.detail(format!(
                "  {:<34} {:>7} {:>7}",
                format!("paper {policy}"),
                fmt(mean_at(&curves, 100)),
                fmt(mean_at(&curves, 130))
            ));
        }
        add_target(&mut summary, result, expected);
    }
    summary
}

/// kerf's default policy against the paper's FGD at 100 % arrived demand.
fn add_target(summary: &mut Summary, result: &TraceResult, expected: &[ExpectedRow]) {
    let fgd = mean_at(&paper_curves(expected, &result.trace, "FGD"), 100);
    let ours = result
        .curves
        .iter()
        .find(|(p, _)| *p == PLACERS[0])
        .and_then(|(_, curves)| mean_at(curves, 100));
    if let (Some(fgd), Some(ours)) = (fgd, ours) {
        let strict = result.trace == "default";
        let met = if strict {
            ours > fgd
        } else {
            ours >= fgd - 0.005
        };
        summary.target(
            &format!("{}_vs_fgd", result.trace),
            format!(
                "{}: kerf default {} paper FGD at 100 % arrived",
                result.trace,
                if strict { ">" } else { ">=" }
            ),
            met,
            format!("{ours:.2} vs {fgd:.2}"),
        );
    }
}

/// The series of the picture: per trace, kerf's placers' and the paper's mean curves.
fn svg_series(results: &[TraceResult], expected: &[ExpectedRow]) -> Vec<svg::Panel> {
    results
        .iter()
        .map(|result| {
            let mut series: Vec<svg::Series> = result
                .curves
                .iter()
                .map(|(placer, curves)| svg::Series {
                    name: placer.name().to_owned(),
                    ours: true,
                    points: mean_curve(curves),
                })
                .collect();
            for policy in PAPER_POLICIES {
                let curves = paper_curves(expected, &result.trace, policy);
                if !curves.is_empty() {
                    series.push(svg::Series {
                        name: format!("paper {policy}"),
                        ours: false,
                        points: mean_curve(&curves),
                    });
                }
            }
            svg::Panel {
                title: result.trace.clone(),
                series,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data directory of two nodes, trace `tiny` and the paper's FGD row for it.
    fn data_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        write(
            data::NODE_FILE,
            "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\nn1,96000,393216,8,G2\n",
        );
        write(
            "openb_pod_list_tiny.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n\
             p0,2000,3000,1,100,\np1,4000,15000,1,200,\np2,12000,50000,0,0,\n\
             p3,1000,2000,1,150,G2\np4,3000,8000,1,200,T4\n",
        );
        let header: Vec<String> = (0..=data::MAX_PERCENT).map(|p| p.to_string()).collect();
        let values: Vec<String> = (0..=data::MAX_PERCENT)
            .map(|p| p.min(90).to_string())
            .collect();
        write(
            data::EXPECTED_FILE,
            &format!(
                "workload,sc_policy,tune,seed,total_gpus,{}\nopenb_pod_list_tiny,06-FGD,1.3,42,10,{}\n",
                header.join(","),
                values.join(",")
            ),
        );
        dir
    }

    #[test]
    fn a_small_run_prints_kerf_beside_the_paper_and_draws_the_curves() {
        let dir = data_dir();
        let svg = dir.path().join("openb.svg");
        let options = BenchOptions {
            openb_dir: dir.path().to_owned(),
            openb_seeds: vec![42, 43],
            openb_placers: vec!["leastfrag_taint".into(), "leastfrag".into(), "fgd".into()],
            openb_svg: Some(svg.clone()),
            ..BenchOptions::default()
        };
        let summary = openb(&options).unwrap();
        for key in [
            "tiny_leastfrag_taint_100",
            "tiny_leastfrag_100",
            "tiny_fgd_100",
            "tiny_vs_fgd",
        ] {
            assert!(summary.get(key).is_some(), "{key} missing from {summary}");
        }
        let report = summary.report();
        assert!(report.contains("paper FGD"), "{report}");
        assert!(report.contains("90.00"), "{report}");
        let picture = std::fs::read_to_string(svg).unwrap();
        assert!(picture.contains("paper FGD") && picture.contains("<polyline"));
    }

    #[test]
    fn unknown_placers_and_missing_traces_are_errors() {
        let dir = data_dir();
        let unknown = BenchOptions {
            openb_dir: dir.path().to_owned(),
            openb_placers: vec!["fastest".into()],
            ..BenchOptions::default()
        };
        let message = openb(&unknown).unwrap_err().to_string();
        assert!(message.contains("unknown placer \"fastest\""), "{message}");
        let missing = BenchOptions {
            openb_dir: dir.path().to_owned(),
            openb_traces: vec!["nope".into()],
            ..BenchOptions::default()
        };
        let message = openb(&missing).unwrap_err().to_string();
        assert!(message.contains("openb_pod_list_nope.csv"), "{message}");
    }
}
