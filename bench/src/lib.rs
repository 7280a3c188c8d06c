//! kerf-bench: kerf's benchmarks, run by `kerf-bench <name>|all` (flags: [`BenchArgs`]).
//!
//! Every benchmark prints figures and ends with one summary line `bench NAME key=value …`
//! ([`Summary`]); every time is reported next to a floor or baseline measured in the same
//! run, as a ratio, because these machines are noisy. Targets are checked and printed as
//! met or missed, never asserted.
//!
//! - `prepare`: one claim at a time over the plugin's Unix socket, against an empty round
//!   trip plus the same checkpoint writes; then MPS slices on a node that enforces them with
//!   fake GPU tools ([`gpu_tools`]): the first slice of a GPU (the prepare starts the GPU's
//!   MPS control daemon) and later ones (it adopts the running daemon), against the same
//!   floor.
//! - `prepare-real`: `prepare` on the real path: the plugin started as in production with a
//!   kube client that talks HTTP to the in-memory API server, which answers every request
//!   1 ms late; claims labelled with their node (served from the plugin's claim cache when it
//!   has one), unlabelled ones (every prepare GETs), and the miss path (the allocation
//!   written by kube-scheduler or kerf-controller right before the prepare), against the
//!   empty call + one checkpoint write + a map lookup (and one GET more for the miss
//!   path), with each part's share of a prepare; CDI specs on a tmpfs as on a node. Then the
//!   cached path's p99 taken apart: runs with the claim status writer off, with the plugin's
//!   files on a tmpfs, and beside a thread making fsync'd writes on the same disk.
//! - `prepare-parallel`: 64 claims at once, as 64 calls and as one batched call, against one
//!   single-claim prepare, with every file on disk.
//! - `prepare-parallel-node`: the same with the CDI specs on a tmpfs, as `/var/run/cdi` is on
//!   a node (the checkpoint stays on disk).
//! - `allocate`: the controller's allocator on 1,000 nodes × 8 H100 with 20,000 seeded
//!   claims, against one scan of every GPU.
//! - `packing`: BinPack, Spread and kube-scheduler's allocator ([`baseline`], from
//!   kerf-scheduler-standin) until the first claim that does not fit.
//! - `footprint`: resident memory of the plugin and of the controller's index.
//! - `controller-footprint`: the real `kerf-controller` binary (two replicas with leader
//!   election, webhook on) against the in-memory API server over HTTP at 500 nodes: CPU per
//!   pod through a burst of 1,000 Controller-class pods, then idle CPU and resident memory
//!   ([`controller_footprint`]). It needs the `kerf-controller` binary: by default the one
//!   next to the running executable ([`BenchOptions::controller_binary`]).
//! - `scheduling`: pods/s through the kube-scheduler stand-in on a simulated cluster,
//!   Controller-class pods (gated, allocated by kerf-controller, bound by the stand-in)
//!   against Scheduler-class pods the stand-in allocates itself.
//!
//! - `openb` (by name only, not part of `all`): kerf's placement replaying Alibaba's
//!   GPU-sharing trace with the method of the paper "Beware of Fragmentation" (FGD), beside
//!   its published results and a port of FGD ([`openb`](crate::BenchOptions::openb_dir)
//!   options).
//!
//! Wiring into a CLI: call [`run`] (or [`run_each`] to print as each finishes) from outside
//! any Tokio runtime, with [`BenchOptions`]; set [`BenchOptions::reexec`] to the command
//! that reaches [`run`] again (for `kerf-bench NAME`: the current executable), so that
//! `footprint` measures in fresh child processes. [`BenchArgs::options`] makes both of the
//! command line. The hidden names those children are started with go through [`run`] like
//! any other name.
//!
//! `prepare` links the fake `nvidia-smi` and `nvidia-cuda-mps-control` to the running
//! executable, so a CLI that runs it must be multi-call: its `main` must hand over to
//! `kerf_fake_gpu_tools::run` when argv\[0\] names one of those tools, as `kerf-bench` does
//! with [`gpu_tools::run_as_tool`]. `KERF_BENCH_FAKE_GPU_TOOLS` ([`gpu_tools::PROGRAM_ENV`])
//! names another program instead (e.g. `kerf-fake-gpu-tools`).

mod alloc;
mod args;
mod baseline;
pub mod controller_footprint;
mod error;
mod floor;
mod footprint;
pub mod gpu_tools;
mod node;
mod openb;
mod prepare;
mod prepare_cluster;
mod prepare_real;
mod rng;
mod scheduling;
mod stats;
mod summary;
mod sys;
mod workload;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

pub use args::BenchArgs;
pub use error::{Error, Result};
pub use prepare::SpecLayout;
pub use prepare_cluster::ClusterDriver;
pub use summary::{Summary, Target};

/// The benchmarks, in the order `all` runs them.
pub const NAMES: [&str; 9] = [
    "prepare",
    "prepare-real",
    "prepare-parallel",
    "prepare-parallel-node",
    "allocate",
    "packing",
    "footprint",
    "controller-footprint",
    "scheduling",
];

/// Benchmarks run only by name, not by `all`: `openb` replays a production trace for
/// minutes of CPU, and its data lives outside the repository.
pub const EXTRA_NAMES: [&str; 2] = ["openb", "prepare-cluster"];

/// What the benchmarks run on and how much.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Where the prepare benchmarks put the plugin's files and sockets. It must be on a
    /// disk (not tmpfs), and short enough for Unix socket paths (about 80 bytes).
    /// Default: `target/kerf-bench`, relative to the current directory.
    pub work_dir: PathBuf,
    /// Parent of the tmpfs directory that stands for a node's `/var/run/cdi` in
    /// `prepare-parallel-node` and `prepare-real`; must be on a tmpfs.
    pub node_cdi_dir: PathBuf,
    /// Claims of `prepare` (default 2,000).
    pub prepare_claims: usize,
    /// Claims of each series of `prepare-real` (default 3,000).
    pub prepare_real_claims: usize,
    /// How late the API server of `prepare-real` answers every request (default 1 ms; see
    /// `kerf_tests::api_server::ApiServer::set_latency` for why).
    pub api_latency: Duration,
    /// Claims prepared at once by `prepare-parallel` (default 64).
    pub parallel_claims: usize,
    /// Rounds of `prepare-parallel` (default 20).
    pub parallel_rounds: usize,
    /// Nodes of 8 mock H100 for `allocate`, `packing` and the index footprint (default 1,000).
    pub nodes: usize,
    /// Claims of `allocate` and `packing` (default 20,000).
    pub allocate_claims: usize,
    /// Seed of the workload (default 1).
    pub seed: u64,
    /// Prepare/unprepare cycles of the plugin footprint (default 1,000).
    pub footprint_cycles: usize,
    /// Allocated claims in the index footprint (default 10,000).
    pub footprint_claims: usize,
    /// Simulated nodes of 8 mock H100 for `scheduling` (default 8).
    pub scheduling_nodes: usize,
    /// Pods per phase and round of `scheduling` (default 64; at most 8 per node).
    pub scheduling_pods: usize,
    /// Nodes of 8 mock H100 for `controller-footprint` (default 500).
    pub controller_nodes: usize,
    /// Pods of `controller-footprint`, one Controller-class slice claim each (default 1,000;
    /// at most 64 per node).
    pub controller_claims: usize,
    /// kerf-controller replicas of `controller-footprint` (default 2).
    pub controller_replicas: usize,
    /// Quiet time after the last binding before the idle window (default 10 s).
    pub controller_settle: Duration,
    /// The idle window of `controller-footprint` (default 30 s).
    pub controller_idle_window: Duration,
    /// The directory of the openb trace (`openb_node_list_gpu_node.csv`,
    /// `openb_pod_list_*.csv`, `expected_allocation.csv`); a relative path that is not a
    /// directory from here is also tried relative to the repository's root. Default:
    /// `../shared/data/openb`.
    pub openb_dir: PathBuf,
    /// Traces `openb` replays (`default` for `openb_pod_list_default.csv`); empty: every
    /// trace of the directory.
    pub openb_traces: Vec<String>,
    /// Seeds of `openb`'s workload inflation (default 42–51, as the paper's).
    pub openb_seeds: Vec<u64>,
    /// Placers `openb` replays, by key (leastfrag_taint, leastfrag, leastfrag_all, binpack,
    /// spread, fgd, fgd_kube); empty: all.
    pub openb_placers: Vec<String>,
    /// Every how many nodes `openb` keeps one (default 1: all; more for a quick run on a
    /// smaller cluster).
    pub openb_node_stride: usize,
    /// Where `openb` writes its curves as SVG; none by default.
    pub openb_svg: Option<PathBuf>,
    /// The kerf-controller binary; `None`: the `kerf-controller` next to the running
    /// executable ([`controller_footprint::default_binary`]).
    pub controller_binary: Option<PathBuf>,
    /// Flags appended to every kerf-controller replica's command line (e.g.
    /// `--ownership-settle-period=1s`); none by default: production timing.
    pub controller_args: Vec<OsString>,
    /// When set, `perf record -F 499 -g --call-graph dwarf` is attached to the leader for the
    /// burst and for the idle window, writing `<this>.burst` and `<this>.idle`.
    pub controller_perf: Option<PathBuf>,
    /// The node `prepare-cluster` runs on (its plugins' sockets are here); no default.
    pub cluster_node: Option<String>,
    /// The drivers `prepare-cluster` compares, in order (the ratios are the first's over
    /// each other's); none by default.
    pub cluster_drivers: Vec<ClusterDriver>,
    /// Claims per driver and series of `prepare-cluster` (default 200).
    pub cluster_claims: usize,
    /// How long `prepare-cluster` holds a prepared claim before it unprepares it, standing in
    /// for the pod's run between the kubelet's two calls (default 200 ms; zero unprepares at
    /// once, while the plugin's follow-up work of the prepare may still run).
    pub cluster_hold: Duration,
    /// The kubelet's plugin registration directory (default
    /// `/var/lib/kubelet/plugins_registry`).
    pub cluster_registry_dir: PathBuf,
    /// The namespace of `prepare-cluster`'s claims (default `kerf-bench`).
    pub cluster_namespace: String,
    /// How to start this program again so that it reaches [`run`] with a given name; `None`
    /// measures the footprint in this process.
    pub reexec: Option<Reexec>,
}

/// A command that reaches [`run`] with the benchmark name appended as its last argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reexec {
    /// The program, usually `std::env::current_exe()`.
    pub program: PathBuf,
    /// Arguments before the flags and the name (none for `kerf-bench`; `["bench"]` for a CLI
    /// whose `bench` subcommand flattens [`BenchArgs`]).
    pub args: Vec<OsString>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            work_dir: PathBuf::from("target/kerf-bench"),
            node_cdi_dir: PathBuf::from("/dev/shm"),
            prepare_claims: 2_000,
            prepare_real_claims: 3_000,
            api_latency: Duration::from_millis(1),
            parallel_claims: 64,
            parallel_rounds: 20,
            nodes: 1_000,
            allocate_claims: 20_000,
            seed: 1,
            footprint_cycles: 1_000,
            footprint_claims: 10_000,
            scheduling_nodes: 8,
            scheduling_pods: 64,
            controller_nodes: 500,
            controller_claims: 1_000,
            controller_replicas: 2,
            controller_settle: Duration::from_secs(10),
            controller_idle_window: Duration::from_secs(30),
            openb_dir: PathBuf::from("../shared/data/openb"),
            openb_traces: Vec::new(),
            openb_seeds: (42..=51).collect(),
            openb_placers: Vec::new(),
            openb_node_stride: 1,
            openb_svg: None,
            controller_binary: None,
            controller_args: Vec::new(),
            controller_perf: None,
            cluster_node: None,
            cluster_drivers: Vec::new(),
            cluster_claims: 200,
            cluster_hold: Duration::from_millis(200),
            cluster_registry_dir: PathBuf::from("/var/lib/kubelet/plugins_registry"),
            cluster_namespace: "kerf-bench".to_owned(),
            reexec: None,
        }
    }
}

impl BenchOptions {
    fn validate(&self) -> Result<()> {
        let positive = [
            ("prepare_claims", self.prepare_claims),
            ("prepare_real_claims", self.prepare_real_claims),
            ("parallel_claims", self.parallel_claims),
            ("parallel_rounds", self.parallel_rounds),
            ("nodes", self.nodes),
            ("allocate_claims", self.allocate_claims),
            ("footprint_cycles", self.footprint_cycles),
            ("footprint_claims", self.footprint_claims),
            ("scheduling_nodes", self.scheduling_nodes),
            ("scheduling_pods", self.scheduling_pods),
            ("controller_nodes", self.controller_nodes),
            ("controller_claims", self.controller_claims),
            ("controller_replicas", self.controller_replicas),
            ("openb_seeds", self.openb_seeds.len()),
            ("openb_node_stride", self.openb_node_stride),
            ("cluster_claims", self.cluster_claims),
        ];
        if let Some((option, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(Error::InvalidOption {
                option,
                reason: "must be at least 1".into(),
            });
        }
        if self.scheduling_pods > 8 * self.scheduling_nodes {
            return Err(Error::InvalidOption {
                option: "scheduling_pods",
                reason: format!(
                    "{} whole-GPU pods do not fit {} nodes of 8 GPUs",
                    self.scheduling_pods, self.scheduling_nodes
                ),
            });
        }
        // 10Gi slices of 80 GB H100s: 8 per GPU, 64 per node.
        if self.controller_claims > 64 * self.controller_nodes {
            return Err(Error::InvalidOption {
                option: "controller_claims",
                reason: format!(
                    "{} 10Gi slices do not fit {} nodes of 8 H100",
                    self.controller_claims, self.controller_nodes
                ),
            });
        }
        if self.controller_idle_window.is_zero() {
            return Err(Error::InvalidOption {
                option: "controller_idle_window",
                reason: "must be positive".into(),
            });
        }
        Ok(())
    }

    /// The configuration of `controller-footprint`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] when no binary is named and the running executable's
    /// directory is unknown.
    pub fn controller_footprint(&self) -> Result<controller_footprint::FootprintConfig> {
        let binary = self
            .controller_binary
            .clone()
            .or_else(controller_footprint::default_binary)
            .ok_or_else(|| Error::InvalidOption {
                option: "controller_binary",
                reason:
                    "the running executable's directory is unknown; name the kerf-controller binary"
                        .into(),
            })?;
        Ok(controller_footprint::FootprintConfig {
            binary,
            dir: self.work_dir.join("controller-footprint"),
            nodes: self.controller_nodes,
            claims: self.controller_claims,
            replicas: self.controller_replicas,
            settle: self.controller_settle,
            idle_window: self.controller_idle_window,
            extra_args: self.controller_args.clone(),
            perf: self.controller_perf.clone(),
            seed: self.seed,
        })
    }
}

/// Runs benchmark `name` (one of [`NAMES`], or `all`) and returns its summaries.
///
/// Blocking: builds its own Tokio runtime, so call it outside any runtime.
///
/// # Errors
/// An unknown name, invalid options, a call from inside a Tokio runtime, or a benchmark that
/// could not run. A missed target is not an error.
pub fn run(name: &str, options: &BenchOptions) -> Result<Vec<Summary>> {
    let mut out = Vec::new();
    run_each(name, options, |s| out.push(s.clone()))?;
    Ok(out)
}

/// As [`run`], calling `on_summary` as soon as each benchmark finishes (for `all`, so that
/// figures appear as they are measured).
///
/// # Errors
/// As [`run`].
pub fn run_each(
    name: &str,
    options: &BenchOptions,
    mut on_summary: impl FnMut(&Summary),
) -> Result<()> {
    options.validate()?;
    let names: Vec<&str> = match name {
        "all" => NAMES.to_vec(),
        footprint::PLUGIN_CHILD | footprint::INDEX_CHILD => vec![name],
        known if NAMES.contains(&known) || EXTRA_NAMES.contains(&known) => vec![known],
        unknown => return Err(Error::UnknownBenchmark(unknown.to_owned())),
    };
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(Error::InvalidOption {
            option: "runtime",
            reason: "kerf_bench::run builds its own Tokio runtime; call it outside one".into(),
        });
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("start", "tokio runtime", e))?;
    for name in names {
        let summary = match name {
            "prepare" => runtime.block_on(prepare::prepare(options))?,
            "prepare-real" => runtime.block_on(prepare_real::prepare_real(options))?,
            "prepare-parallel" => {
                runtime.block_on(prepare::prepare_parallel(options, SpecLayout::Disk))?
            }
            "prepare-parallel-node" => {
                runtime.block_on(prepare::prepare_parallel(options, SpecLayout::Node))?
            }
            "allocate" => alloc::allocate(options)?,
            "packing" => alloc::packing(options)?,
            "footprint" => footprint::footprint(options, &runtime)?,
            "controller-footprint" => runtime.block_on(
                controller_footprint::controller_footprint(&options.controller_footprint()?),
            )?,
            "scheduling" => runtime.block_on(scheduling::scheduling(options))?,
            "openb" => openb::openb(options)?,
            "prepare-cluster" => runtime.block_on(prepare_cluster::prepare_cluster(options))?,
            footprint::PLUGIN_CHILD => return footprint::plugin_child(&runtime),
            footprint::INDEX_CHILD => return footprint::index_child(options),
            other => return Err(Error::UnknownBenchmark(other.to_owned())),
        };
        on_summary(&summary);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_and_zero_options_are_refused() {
        let options = BenchOptions::default();
        assert!(matches!(
            run("nope", &options),
            Err(Error::UnknownBenchmark(n)) if n == "nope"
        ));
        let zero = BenchOptions {
            prepare_claims: 0,
            ..BenchOptions::default()
        };
        assert!(matches!(
            run("prepare", &zero),
            Err(Error::InvalidOption {
                option: "prepare_claims",
                ..
            })
        ));
    }

    #[test]
    fn a_small_scheduling_run_reports_both_rates() {
        let options = BenchOptions {
            scheduling_nodes: 1,
            scheduling_pods: 4,
            ..BenchOptions::default()
        };
        let summaries = run("scheduling", &options).unwrap();
        let line = summaries[0].to_string();
        for key in [
            "controller_per_s=",
            "direct_per_s=",
            "ratio=",
            "ratio_target=",
        ] {
            assert!(line.contains(key), "{key} missing from {line}");
        }
        let too_many = BenchOptions {
            scheduling_pods: 9,
            ..options
        };
        assert!(matches!(
            run("scheduling", &too_many),
            Err(Error::InvalidOption {
                option: "scheduling_pods",
                ..
            })
        ));
    }

    #[test]
    fn a_small_packing_run_compares_all_allocators() {
        let options = BenchOptions {
            nodes: 10,
            allocate_claims: 400,
            ..BenchOptions::default()
        };
        let summaries = run("packing", &options).unwrap();
        let line = summaries[0].to_string();
        assert!(line.starts_with("bench packing "), "{line}");
        for key in [
            "binpack_memory_pct=",
            "spread_memory_pct=",
            "firstfit_memory_pct=",
            "lead_target=",
        ] {
            assert!(line.contains(key), "{key} missing from {line}");
        }
    }
}
