//! The benchmarks' command line: one definition of every flag, read by the `kerf-bench`
//! binary and by anything else that flattens [`BenchArgs`] into its own clap command.
//!
//! The defaults are [`BenchOptions::default`]'s, so that a run from the command line and a
//! run from code measure the same thing unless told otherwise.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::{BenchOptions, ClusterDriver, Reexec};

/// Which benchmark to run and with what; see [`BenchOptions`] for what each option means.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Benchmark to run: prepare, prepare-real, prepare-parallel, prepare-parallel-node,
    /// allocate, packing, footprint, controller-footprint, scheduling or all; or openb or
    /// prepare-cluster (on a real cluster's node; not part of all).
    pub name: String,
    /// Directory for the plugin's files and sockets in the prepare benchmarks; must be on a
    /// disk, not tmpfs, and short enough for Unix socket paths.
    #[arg(long, env = "KERF_BENCH_WORK_DIR", default_value_os_t = BenchOptions::default().work_dir)]
    pub work_dir: PathBuf,
    /// Parent of the directory that stands for a node's /var/run/cdi in
    /// `prepare-parallel-node` and `prepare-real`; must be on a tmpfs.
    #[arg(long, env = "KERF_BENCH_NODE_CDI_DIR", default_value_os_t = BenchOptions::default().node_cdi_dir)]
    pub node_cdi_dir: PathBuf,
    /// Claims prepared one at a time by `prepare`.
    #[arg(long, env = "KERF_BENCH_PREPARE_CLAIMS", default_value_t = BenchOptions::default().prepare_claims)]
    pub prepare_claims: usize,
    /// Claims of each series of `prepare-real` (from the claim cache, with a GET, and missing
    /// the cache right after the allocation); a p99 of 3,000 is the 30th slowest, steady
    /// where a disk's hiccups decide the 10th.
    #[arg(long, env = "KERF_BENCH_PREPARE_REAL_CLAIMS", default_value_t = BenchOptions::default().prepare_real_claims)]
    pub prepare_real_claims: usize,
    /// How late the API server of `prepare-real` answers every request, in microseconds.
    #[arg(long, env = "KERF_BENCH_API_LATENCY_US", default_value_t = micros(BenchOptions::default().api_latency))]
    pub api_latency_us: u64,
    /// Claims prepared at once by `prepare-parallel`.
    #[arg(long, env = "KERF_BENCH_PARALLEL_CLAIMS", default_value_t = BenchOptions::default().parallel_claims)]
    pub parallel_claims: usize,
    /// Rounds of `prepare-parallel`.
    #[arg(long, env = "KERF_BENCH_PARALLEL_ROUNDS", default_value_t = BenchOptions::default().parallel_rounds)]
    pub parallel_rounds: usize,
    /// Nodes of 8 mock H100 for `allocate`, `packing` and the index footprint.
    #[arg(long, env = "KERF_BENCH_NODES", default_value_t = BenchOptions::default().nodes)]
    pub nodes: usize,
    /// Claims of `allocate` and `packing`.
    #[arg(long, env = "KERF_BENCH_ALLOCATE_CLAIMS", default_value_t = BenchOptions::default().allocate_claims)]
    pub allocate_claims: usize,
    /// Seed of the workload.
    #[arg(long, env = "KERF_BENCH_SEED", default_value_t = BenchOptions::default().seed)]
    pub seed: u64,
    /// Prepare/unprepare cycles of the plugin footprint.
    #[arg(long, env = "KERF_BENCH_FOOTPRINT_CYCLES", default_value_t = BenchOptions::default().footprint_cycles)]
    pub footprint_cycles: usize,
    /// Allocated claims in the index footprint.
    #[arg(long, env = "KERF_BENCH_FOOTPRINT_CLAIMS", default_value_t = BenchOptions::default().footprint_claims)]
    pub footprint_claims: usize,
    /// Simulated nodes of 8 mock H100 for `scheduling`.
    #[arg(long, env = "KERF_BENCH_SCHEDULING_NODES", default_value_t = BenchOptions::default().scheduling_nodes)]
    pub scheduling_nodes: usize,
    /// Pods per phase and round of `scheduling` (at most 8 per node).
    #[arg(long, env = "KERF_BENCH_SCHEDULING_PODS", default_value_t = BenchOptions::default().scheduling_pods)]
    pub scheduling_pods: usize,
    /// Nodes of 8 mock H100 for `controller-footprint`, pinned to the controller.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_NODES", default_value_t = BenchOptions::default().controller_nodes)]
    pub controller_nodes: usize,
    /// Pods of `controller-footprint`, one Controller-class slice claim each (at most 64 per
    /// node), created at once.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_CLAIMS", default_value_t = BenchOptions::default().controller_claims)]
    pub controller_claims: usize,
    /// kerf-controller replicas of `controller-footprint` (leader election on; the first
    /// leads, the others stand by).
    #[arg(long, env = "KERF_BENCH_CONTROLLER_REPLICAS", default_value_t = BenchOptions::default().controller_replicas)]
    pub controller_replicas: usize,
    /// Seconds of quiet after the last pod is bound before `controller-footprint`'s idle
    /// window.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_SETTLE", default_value_t = BenchOptions::default().controller_settle.as_secs())]
    pub controller_settle: u64,
    /// Seconds over which `controller-footprint` measures idle CPU.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_IDLE_WINDOW", default_value_t = BenchOptions::default().controller_idle_window.as_secs())]
    pub controller_idle_window: u64,
    /// Directory of the openb trace for `openb` (relative paths that are not a directory
    /// from here are also tried from the repository's root).
    #[arg(long, env = "KERF_BENCH_OPENB_DIR", default_value_os_t = BenchOptions::default().openb_dir)]
    pub openb_dir: PathBuf,
    /// Traces `openb` replays, comma-separated (e.g. default,cpu050) [default: every
    /// openb_pod_list_*.csv of the directory].
    #[arg(long, env = "KERF_BENCH_OPENB_TRACES", value_delimiter = ',')]
    pub openb_traces: Vec<String>,
    /// Seeds of `openb`'s workload inflation, comma-separated [default: 42-51].
    #[arg(long, env = "KERF_BENCH_OPENB_SEEDS", value_delimiter = ',')]
    pub openb_seeds: Vec<u64>,
    /// Placers `openb` replays, comma-separated: leastfrag_taint (kerf's default policy, tasks
    /// without GPUs by kube-scheduler's scoring with kerf's PreferNoSchedule taint on nodes
    /// with idle GPUs), leastfrag (the same without the taint), leastfrag_all (every task by
    /// the policy), binpack, spread, fgd (the paper's policy, ported), fgd_kube [default: all].
    #[arg(long, env = "KERF_BENCH_OPENB_PLACERS", value_delimiter = ',')]
    pub openb_placers: Vec<String>,
    /// `openb` keeps every Nth node of the cluster (1: all).
    #[arg(long, env = "KERF_BENCH_OPENB_NODE_STRIDE", default_value_t = BenchOptions::default().openb_node_stride)]
    pub openb_node_stride: usize,
    /// Where `openb` writes its curves as SVG (e.g. docs/openb.svg).
    #[arg(long, env = "KERF_BENCH_OPENB_SVG")]
    pub openb_svg: Option<PathBuf>,
    /// The kerf-controller binary `controller-footprint` runs [default: the kerf-controller
    /// next to this executable, e.g. target/release/kerf-controller].
    #[arg(long, env = "KERF_CONTROLLER_BINARY")]
    pub controller_binary: Option<PathBuf>,
    /// A flag appended to every kerf-controller replica's command line (repeat it; e.g.
    /// --controller-arg=--ownership-settle-period=1s). None by default: production timing.
    #[arg(
        long = "controller-arg",
        env = "KERF_BENCH_CONTROLLER_ARGS",
        value_delimiter = ' ',
        allow_hyphen_values = true
    )]
    pub controller_args: Vec<OsString>,
    /// Profile the leader: attach `perf record -F 499 -g --call-graph dwarf -p <pid>` for the
    /// burst and, separately, for the idle window, writing PREFIX.burst and PREFIX.idle (read
    /// them with `perf report -i PREFIX.burst`). The replicas' pids and logs are printed
    /// with the figures.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_PERF", value_name = "PREFIX")]
    pub controller_perf: Option<PathBuf>,
    /// The node `prepare-cluster` runs on, whose plugins it calls.
    #[arg(long, env = "KERF_BENCH_CLUSTER_NODE")]
    pub cluster_node: Option<String>,
    /// A driver `prepare-cluster` calls, as DRIVER=DEVICECLASS=DEVICE[+DEVICE...] (repeat
    /// it; the first is the one the ratios are of, e.g.
    /// gpu.kerf.dev=gpu.kerf.dev=gpu-0+gpu-1+gpu-2+gpu-3 then
    /// gpu.example.com=gpu.example.com=gpu-0+gpu-1+gpu-2+gpu-3).
    #[arg(long = "cluster-driver", env = "KERF_BENCH_CLUSTER_DRIVERS", value_delimiter = ',', value_parser = parse_driver)]
    pub cluster_drivers: Vec<ClusterDriver>,
    /// Claims per driver and series of `prepare-cluster`.
    #[arg(long, env = "KERF_BENCH_CLUSTER_CLAIMS", default_value_t = BenchOptions::default().cluster_claims)]
    pub cluster_claims: usize,
    /// Milliseconds `prepare-cluster` holds each prepared claim before unprepares it, as the
    /// pod that uses it would run between the kubelet's two calls (0: unprepare at once).
    #[arg(long, env = "KERF_BENCH_CLUSTER_HOLD_MS", default_value_t = millis(BenchOptions::default().cluster_hold))]
    pub cluster_hold_ms: u64,
    /// The kubelet's plugin registration directory on the node.
    #[arg(long, env = "KERF_BENCH_CLUSTER_REGISTRY_DIR", default_value_os_t = BenchOptions::default().cluster_registry_dir)]
    pub cluster_registry_dir: PathBuf,
    /// The namespace of `prepare-cluster`'s claims (created when missing).
    #[arg(long, env = "KERF_BENCH_CLUSTER_NAMESPACE", default_value_t = BenchOptions::default().cluster_namespace)]
    pub cluster_namespace: String,
}

fn parse_driver(value: &str) -> Result<ClusterDriver, String> {
    ClusterDriver::parse(value).map_err(|e| e.to_string())
}

impl BenchArgs {
    /// The options these flags ask for. `reexec`, when given, is the command that reaches
    /// these flags again (e.g. `kerf-bench` itself with no arguments); the flags the
    /// footprint's fresh child processes read are appended to its arguments, so that the
    /// children measure what the parent was asked to.
    pub fn options(&self, reexec: Option<Reexec>) -> BenchOptions {
        let reexec = reexec.map(|mut reexec| {
            reexec.args.extend(self.child_flags());
            reexec
        });
        BenchOptions {
            work_dir: self.work_dir.clone(),
            node_cdi_dir: self.node_cdi_dir.clone(),
            prepare_claims: self.prepare_claims,
            prepare_real_claims: self.prepare_real_claims,
            api_latency: Duration::from_micros(self.api_latency_us),
            parallel_claims: self.parallel_claims,
            parallel_rounds: self.parallel_rounds,
            nodes: self.nodes,
            allocate_claims: self.allocate_claims,
            seed: self.seed,
            footprint_cycles: self.footprint_cycles,
            footprint_claims: self.footprint_claims,
            scheduling_nodes: self.scheduling_nodes,
            scheduling_pods: self.scheduling_pods,
            controller_nodes: self.controller_nodes,
            controller_claims: self.controller_claims,
            controller_replicas: self.controller_replicas,
            controller_settle: Duration::from_secs(self.controller_settle),
            controller_idle_window: Duration::from_secs(self.controller_idle_window),
            openb_dir: self.openb_dir.clone(),
            openb_traces: self.openb_traces.clone(),
            openb_seeds: if self.openb_seeds.is_empty() {
                BenchOptions::default().openb_seeds
            } else {
                self.openb_seeds.clone()
            },
            openb_placers: self.openb_placers.clone(),
            openb_node_stride: self.openb_node_stride,
            openb_svg: self.openb_svg.clone(),
            controller_binary: self.controller_binary.clone(),
            controller_args: self.controller_args.clone(),
            controller_perf: self.controller_perf.clone(),
            cluster_node: self.cluster_node.clone(),
            cluster_drivers: self.cluster_drivers.clone(),
            cluster_claims: self.cluster_claims,
            cluster_hold: Duration::from_millis(self.cluster_hold_ms),
            cluster_registry_dir: self.cluster_registry_dir.clone(),
            cluster_namespace: self.cluster_namespace.clone(),
            reexec,
        }
    }

    /// The flags of every option a benchmark's child process can read (all but the
    /// controller-footprint's, which runs no children of this program).
    fn child_flags(&self) -> Vec<OsString> {
        [
            ("--work-dir", self.work_dir.display().to_string()),
            ("--node-cdi-dir", self.node_cdi_dir.display().to_string()),
            ("--prepare-claims", self.prepare_claims.to_string()),
            (
                "--prepare-real-claims",
                self.prepare_real_claims.to_string(),
            ),
            ("--api-latency-us", self.api_latency_us.to_string()),
            ("--parallel-claims", self.parallel_claims.to_string()),
            ("--parallel-rounds", self.parallel_rounds.to_string()),
            ("--nodes", self.nodes.to_string()),
            ("--allocate-claims", self.allocate_claims.to_string()),
            ("--seed", self.seed.to_string()),
            ("--footprint-cycles", self.footprint_cycles.to_string()),
            ("--footprint-claims", self.footprint_claims.to_string()),
            ("--scheduling-nodes", self.scheduling_nodes.to_string()),
            ("--scheduling-pods", self.scheduling_pods.to_string()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.into(), value.into()])
        .collect()
    }
}

/// `duration` in whole microseconds, saturating (the flag's unit).
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// `duration` in whole milliseconds, saturating (the flag's unit).
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn no_flags_are_the_library_defaults() {
        let args = Command::parse_from(["kerf-bench", "allocate"]).bench;
        assert_eq!(args.name, "allocate");
        assert_eq!(args.options(None), BenchOptions::default());
    }

    #[test]
    fn flags_set_options_and_reach_the_footprint_children() {
        let args = Command::parse_from([
            "kerf-bench",
            "--nodes",
            "10",
            "footprint",
            "--controller-settle",
            "3",
            "--cluster-hold-ms",
            "0",
        ])
        .bench;
        let reexec = Reexec {
            program: "kerf-bench".into(),
            args: Vec::new(),
        };
        let options = args.options(Some(reexec));
        assert_eq!(options.nodes, 10);
        assert_eq!(options.controller_settle, Duration::from_secs(3));
        assert_eq!(options.cluster_hold, Duration::ZERO);
        let child_args = options.reexec.unwrap().args;
        let nodes = child_args.iter().position(|a| a == "--nodes").unwrap();
        assert_eq!(child_args[nodes + 1], "10");
    }
}
