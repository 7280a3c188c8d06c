//! `kerf`: kerf's command-line tool.
//!
//! Also a multi-call program: run under the name of one of the fake GPU tools
//! ([`kerf_fake_gpu_tools::TOOLS`]: `nvidia-smi`, `nvidia-cuda-mps-control`), as the links of
//! the mock driver root `kerf demo` installs, it is that fake tool. So the demo's plugin runs
//! real MPS daemon processes without a second binary to ship or find.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use kerf_cli::demo::manifests::ManifestSource;
use kerf_cli::demo::{self, DemoConfig};
use kerf_cli::status;
use kerf_kubelet_plugin::config::Discovery;

// mimalloc while the feature `mimalloc` (on by default) is on; why: `kerf_ops::allocator`.
kerf_ops::global_allocator!();

/// kerf: GPUs for Kubernetes through Dynamic Resource Allocation.
#[derive(Debug, Parser)]
#[command(name = "kerf", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the ResourceSlices the kubelet plugin would publish for this node, as YAML.
    Inventory(InventoryArgs),
    /// Run kerf on one mock node without a cluster: allocate the example claims with kerf's
    /// controller (and a stand-in for kube-scheduler), prepare them through the real kubelet
    /// plugin's socket, print what each claim got, and clean up.
    Demo(DemoArgs),
    /// Run kerf's benchmarks (build with --release): prepare, prepare-real, prepare-parallel(-node), allocate,
    /// packing, footprint, controller-footprint, scheduling, or all. Each prints its figures and one `bench NAME key=value …` line.
    Bench(BenchArgs),
    /// Show every kerf GPU of the cluster per node, from kerf's ResourceSlices and the claims
    /// allocated on them: owner, product, memory and compute used, health, claims (pod, size,
    /// allocator), MIG devices and the pool's generation.
    Status(StatusArgs),
}

#[derive(Debug, clap::Args)]
struct StatusArgs {
    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, then the in-cluster config].
    #[arg(long, env = "KERF_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// kubeconfig context [default: the current context].
    #[arg(long, env = "KERF_CONTEXT")]
    context: Option<String>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    driver_name: String,
    /// Output format: `table`, or `json` (a stable shape for scripts, see README).
    #[arg(
        short,
        long,
        env = "KERF_STATUS_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    output: StatusOutput,
    /// Keep watching and print again after every change (Ctrl-C exits). With `-o json`, one
    /// compact document per line.
    #[arg(short, long)]
    watch: bool,
    /// Read ResourceSlices and ResourceClaims from these YAML files instead of a cluster
    /// (e.g. `kerf demo`'s claims.yaml and `kerf inventory`'s output); repeatable.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["watch", "kubeconfig", "context"])]
    from: Vec<PathBuf>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StatusOutput {
    Table,
    Json,
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// Benchmark to run: prepare, prepare-real, prepare-parallel, prepare-parallel-node,
    /// allocate, packing, footprint, controller-footprint, scheduling or all.
    name: String,
    /// Directory for the plugin's files and sockets in the prepare benchmarks; must be on a
    /// disk, not tmpfs, and short enough for Unix socket paths.
    #[arg(long, env = "KERF_BENCH_WORK_DIR", default_value = "target/kerf-bench")]
    work_dir: PathBuf,
    /// Parent of the directory that stands for a node's /var/run/cdi in
    /// `prepare-parallel-node` and `prepare-real`; must be on a tmpfs.
    #[arg(long, env = "KERF_BENCH_NODE_CDI_DIR", default_value = "/dev/shm")]
    node_cdi_dir: PathBuf,
    /// Claims prepared one at a time by `prepare`.
    #[arg(long, env = "KERF_BENCH_PREPARE_CLAIMS", default_value_t = 2_000)]
    prepare_claims: usize,
    /// Claims of each series of `prepare-real` (from the claim cache, with a GET, and missing
    /// the cache right after the allocation); a p99 of 3,000 is the 30th slowest, steady
    /// where a disk's hiccups decide the 10th.
    #[arg(long, env = "KERF_BENCH_PREPARE_REAL_CLAIMS", default_value_t = 3_000)]
    prepare_real_claims: usize,
    /// How late the API server of `prepare-real` answers every request, in microseconds.
    #[arg(long, env = "KERF_BENCH_API_LATENCY_US", default_value_t = 1_000)]
    api_latency_us: u64,
    /// Claims prepared at once by `prepare-parallel`.
    #[arg(long, env = "KERF_BENCH_PARALLEL_CLAIMS", default_value_t = 64)]
    parallel_claims: usize,
    /// Rounds of `prepare-parallel`.
    #[arg(long, env = "KERF_BENCH_PARALLEL_ROUNDS", default_value_t = 20)]
    parallel_rounds: usize,
    /// Nodes of 8 mock H100 for `allocate`, `packing` and the index footprint.
    #[arg(long, env = "KERF_BENCH_NODES", default_value_t = 1_000)]
    nodes: usize,
    /// Claims of `allocate` and `packing`.
    #[arg(long, env = "KERF_BENCH_ALLOCATE_CLAIMS", default_value_t = 20_000)]
    allocate_claims: usize,
    /// Seed of the workload.
    #[arg(long, env = "KERF_BENCH_SEED", default_value_t = 1)]
    seed: u64,
    /// Prepare/unprepare cycles of the plugin footprint.
    #[arg(long, env = "KERF_BENCH_FOOTPRINT_CYCLES", default_value_t = 1_000)]
    footprint_cycles: usize,
    /// Allocated claims in the index footprint.
    #[arg(long, env = "KERF_BENCH_FOOTPRINT_CLAIMS", default_value_t = 10_000)]
    footprint_claims: usize,
    /// Simulated nodes of 8 mock H100 for `scheduling`.
    #[arg(long, env = "KERF_BENCH_SCHEDULING_NODES", default_value_t = 8)]
    scheduling_nodes: usize,
    /// Pods per phase and round of `scheduling` (at most 8 per node).
    #[arg(long, env = "KERF_BENCH_SCHEDULING_PODS", default_value_t = 64)]
    scheduling_pods: usize,
    /// Nodes of 8 mock H100 for `controller-footprint`, pinned to the controller.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_NODES", default_value_t = 500)]
    controller_nodes: usize,
    /// Pods of `controller-footprint`, one Controller-class slice claim each (at most 64 per
    /// node), created at once.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_CLAIMS", default_value_t = 1_000)]
    controller_claims: usize,
    /// kerf-controller replicas of `controller-footprint` (leader election on; the first
    /// leads, the others stand by).
    #[arg(long, env = "KERF_BENCH_CONTROLLER_REPLICAS", default_value_t = 2)]
    controller_replicas: usize,
    /// Seconds of quiet after the last pod is bound before `controller-footprint`'s idle
    /// window.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_SETTLE", default_value_t = 10)]
    controller_settle: u64,
    /// Seconds over which `controller-footprint` measures idle CPU.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_IDLE_WINDOW", default_value_t = 30)]
    controller_idle_window: u64,
    /// The kerf-controller binary `controller-footprint` runs [default: the kerf-controller
    /// next to this executable, e.g. target/release/kerf-controller].
    #[arg(long, env = "KERF_CONTROLLER_BINARY")]
    controller_binary: Option<PathBuf>,
    /// A flag appended to every kerf-controller replica's command line (repeat it; e.g.
    /// --controller-arg=--ownership-settle-period=1s). None by default: production timing.
    #[arg(
        long = "controller-arg",
        env = "KERF_BENCH_CONTROLLER_ARGS",
        value_delimiter = ' ',
        allow_hyphen_values = true
    )]
    controller_args: Vec<OsString>,
    /// Profile the leader: attach `perf record -F 499 -g --call-graph dwarf -p <pid>` for the
    /// burst and, separately, for the idle window, writing PREFIX.burst and PREFIX.idle (read
    /// them with `perf report -i PREFIX.burst`). The replicas' pids and logs are printed
    /// with the figures.
    #[arg(long, env = "KERF_BENCH_CONTROLLER_PERF", value_name = "PREFIX")]
    controller_perf: Option<PathBuf>,
}

impl BenchArgs {
    /// The options, and how to start this program again for the footprint's fresh processes
    /// (`kerf bench <same flags> <child name>`).
    fn options(&self) -> kerf_bench::BenchOptions {
        let flags: Vec<OsString> = [
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
        .collect();
        let reexec = std::env::current_exe()
            .ok()
            .map(|program| kerf_bench::Reexec {
                program,
                args: std::iter::once("bench".into()).chain(flags).collect(),
            });
        kerf_bench::BenchOptions {
            work_dir: self.work_dir.clone(),
            node_cdi_dir: self.node_cdi_dir.clone(),
            prepare_claims: self.prepare_claims,
            prepare_real_claims: self.prepare_real_claims,
            api_latency: std::time::Duration::from_micros(self.api_latency_us),
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
            controller_settle: std::time::Duration::from_secs(self.controller_settle),
            controller_idle_window: std::time::Duration::from_secs(self.controller_idle_window),
            controller_binary: self.controller_binary.clone(),
            controller_args: self.controller_args.clone(),
            controller_perf: self.controller_perf.clone(),
            reexec,
        }
    }
}

#[derive(Debug, clap::Args)]
struct InventoryArgs {
    /// Mock inventory PROFILE[:COUNT] (h100-sxm-80gb, a100-40gb-mig, l4, …; --list-profiles
    /// prints them all); the default when neither this nor --mock-inventory is given is to ask
    /// NVML.
    #[arg(long, env = "KERF_MOCK_GPUS", conflicts_with = "mock_inventory")]
    mock_gpus: Option<String>,
    /// Mock inventory YAML file.
    #[arg(long, env = "KERF_MOCK_INVENTORY")]
    mock_inventory: Option<PathBuf>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    driver_name: String,
    /// Node name (the pool name).
    #[arg(long, env = "NODE_NAME", default_value = "node-1")]
    node_name: String,
    /// Print the names of the mock profiles, one a line, and nothing else (the other flags
    /// are not used).
    #[arg(long)]
    list_profiles: bool,
    /// Publish every whole GPU outside MIG mode as a scheduler slice (Kubernetes 1.36
    /// DRAConsumableCapacity: allowMultipleAllocations with memory and compute capacities and
    /// their request policies), as for the GPUs of a sliced Scheduler GpuClass.
    #[arg(long, env = "KERF_INVENTORY_CONSUMABLE_CAPACITY")]
    consumable_capacity: bool,
    /// Memory granularity of the scheduler slices [default: 1Gi].
    #[arg(
        long,
        env = "KERF_INVENTORY_MEMORY_GRANULARITY",
        requires = "consumable_capacity",
        value_parser = parse_granularity
    )]
    memory_granularity: Option<u64>,
    /// Compute percent of a scheduler slice that asks for memory only [default: 100].
    #[arg(
        long,
        env = "KERF_INVENTORY_DEFAULT_COMPUTE",
        requires = "consumable_capacity",
        value_parser = clap::value_parser!(u8).range(1..=100)
    )]
    default_compute: Option<u8>,
    /// Most scheduler slices per GPU (a `slices` capacity) [default: no limit].
    #[arg(
        long,
        env = "KERF_INVENTORY_MAX_SLICES_PER_GPU",
        requires = "consumable_capacity",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    max_slices_per_gpu: Option<u32>,
    /// Publish dynamic-MIG GPUs as counter sets and one device per MIG placement (Kubernetes
    /// 1.36 DRAPartitionableDevices), as the scheduler's.
    #[arg(long, env = "KERF_INVENTORY_PARTITIONABLE_DEVICES")]
    partitionable_devices: bool,
}

impl InventoryArgs {
    fn features(&self) -> kerf_cli::inventory::Features {
        let consumable_capacity = self.consumable_capacity.then(|| {
            let mut slicing = kerf_cli::inventory::default_slicing();
            if let Some(bytes) = self.memory_granularity {
                slicing.memory_granularity_bytes = bytes;
            }
            slicing.default_compute_percent = self.default_compute;
            slicing.max_slices_per_gpu = self.max_slices_per_gpu;
            slicing
        });
        kerf_cli::inventory::Features {
            consumable_capacity,
            partitionable_devices: self.partitionable_devices,
        }
    }
}

/// `--memory-granularity`: a byte quantity such as `1Gi` or `512Mi`.
fn parse_granularity(text: &str) -> Result<u64, String> {
    kerf_api::quantity::parse_bytes(text).map_err(|e| e.to_string())
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// Mock GPUs of the node, PROFILE[:COUNT] (h100-sxm-80gb, a100-40gb-mig, l4).
    #[arg(
        long,
        env = "KERF_MOCK_GPUS",
        default_value = demo::DEFAULT_MOCK_GPUS,
        conflicts_with = "mock_inventory"
    )]
    mock_gpus: String,
    /// Mock inventory YAML file instead of a profile.
    #[arg(long, env = "KERF_MOCK_INVENTORY")]
    mock_inventory: Option<PathBuf>,
    /// Directory for the plugin's sockets and checkpoint, the CDI specs (cdi/), summary.json
    /// and claims.yaml [default: a new temporary directory, printed].
    #[arg(long, env = "KERF_DEMO_OUTPUT_DIR")]
    output_dir: Option<PathBuf>,
    /// Directory of claims, ResourceClaimTemplates, Pods and Deployments (*.yaml)
    /// [default: the examples/claims built into this binary].
    #[arg(long, env = "KERF_DEMO_CLAIMS")]
    claims: Option<PathBuf>,
    /// Directory of GpuClasses and DeviceClasses (*.yaml) [default: the examples/admin built
    /// into this binary].
    #[arg(long, env = "KERF_DEMO_CLASSES")]
    classes: Option<PathBuf>,
    /// Run one busybox container per prepared claim with podman (as root), injecting the
    /// claim's CDI devices, and print what it sees. Fails when podman is missing.
    #[arg(long, env = "KERF_DEMO_RUN_CONTAINERS")]
    run_containers: bool,
    /// Statically linked busybox for the containers' root filesystem [default: /bin/busybox].
    #[arg(long, env = "KERF_DEMO_BUSYBOX")]
    busybox: Option<PathBuf>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    driver_name: String,
    /// The mock node's name (the pool name).
    #[arg(long, env = "KERF_DEMO_NODE_NAME", default_value = demo::DEFAULT_NODE_NAME)]
    node_name: String,
    /// The dynamic-MIG node's name: a second mock node whose GPUs in MIG mode are published
    /// as counter sets and MIG placements (Kubernetes 1.36 partitionable devices), with its
    /// own plugin creating each allocated placement's MIG instance.
    #[arg(
        long,
        env = "KERF_DEMO_MIG_NODE_NAME",
        default_value = demo::mig::DEFAULT_MIG_NODE_NAME
    )]
    mig_node_name: String,
    /// Mock GPUs of the dynamic-MIG node, PROFILE[:COUNT] (a100-40gb-dynmig,
    /// a100-80gb-dynmig, h100-sxm-80gb-dynmig).
    #[arg(
        long,
        env = "KERF_DEMO_MIG_MOCK_GPUS",
        default_value = demo::mig::DEFAULT_MIG_MOCK_GPUS
    )]
    mig_mock_gpus: String,
    /// Run the main node alone, without the dynamic-MIG node.
    #[arg(long, env = "KERF_DEMO_NO_MIG_NODE")]
    no_mig_node: bool,
    /// Log filter for the plugin's and controller's logs on stderr (tracing EnvFilter syntax).
    #[arg(long, env = "KERF_LOG", default_value = "warn")]
    log_filter: String,
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if runs_as_fake_tool(&args) {
        // Before clap: the tools' arguments (`-d`, `-i <uuid> -c <mode>`) are not kerf's.
        std::process::exit(kerf_fake_gpu_tools::run(args, std::io::stdin()));
    }
    let result = match Cli::parse_from(args).command {
        Command::Inventory(args) => inventory(&args).map(|()| ExitCode::SUCCESS),
        Command::Demo(args) => run_demo(args),
        Command::Bench(args) => kerf_bench::run_each(&args.name, &args.options(), |summary| {
            print!("{}", summary.report());
        })
        .map(|()| ExitCode::SUCCESS)
        .map_err(anyhow::Error::from),
        Command::Status(args) => run_status(&args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, joined by `: `, leaving out a cause whose text is already
/// in the message: kerf-cli's errors show their cause themselves (`reading FILE: <io error>`),
/// and printing the chain as well would say it twice.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// Whether the program was started under the file name of a fake GPU tool (argv\[0\]).
fn runs_as_fake_tool(args: &[OsString]) -> bool {
    args.first()
        .and_then(|program| Path::new(program).file_name())
        .is_some_and(|name| kerf_fake_gpu_tools::TOOLS.iter().any(|tool| name == *tool))
}

fn inventory(args: &InventoryArgs) -> anyhow::Result<()> {
    if args.list_profiles {
        for name in kerf_core::mock::profile_names() {
            println!("{name}");
        }
        return Ok(());
    }
    let source = kerf_kubelet_plugin::discovery::select(
        args.mock_gpus.as_deref(),
        args.mock_inventory.as_deref(),
    )?;
    let inventory = source.discover()?;
    let slices = kerf_cli::inventory::published_slices(
        &inventory,
        &args.driver_name,
        &args.node_name,
        &args.features(),
    )?;
    print!(
        "{}",
        kerf_cli::inventory::to_yaml(&slices).context("rendering YAML")?
    );
    Ok(())
}

fn run_status(args: &StatusArgs) -> anyhow::Result<()> {
    let driver = args.driver_name.as_str();
    if !args.from.is_empty() {
        let status = status::Status::new(&status::files::read(&args.from)?, driver);
        return print_status(&status, args.output);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = status_client(args).await?;
        if !args.watch {
            let status = status::Status::new(&status::fetch(&client, driver).await?, driver);
            return print_status(&status, args.output);
        }
        let ctrl_c = async {
            // Without a SIGINT handler the default action (exit) is just as clean.
            let _ = tokio::signal::ctrl_c().await;
        };
        let output = args.output;
        status::watch(
            client,
            driver,
            ctrl_c,
            |status| match output {
                // Clear the screen and home the cursor, as `watch(1)` does.
                StatusOutput::Table => print!("\x1b[2J\x1b[H{}", status::table(status)),
                StatusOutput::Json => match serde_json::to_string(status) {
                    Ok(line) => println!("{line}"),
                    Err(e) => eprintln!("error: encoding the status as JSON: {e}"),
                },
            },
            |error| eprintln!("warning: {error}"),
        )
        .await?;
        Ok(())
    })
}

fn print_status(status: &status::Status, output: StatusOutput) -> anyhow::Result<()> {
    match output {
        StatusOutput::Table => print!("{}", status::table(status)),
        StatusOutput::Json => println!("{}", status::json(status)?),
    }
    Ok(())
}

/// A client from `--kubeconfig`/`--context` when given, else kube's default (KUBECONFIG,
/// ~/.kube/config, in-cluster).
async fn status_client(args: &StatusArgs) -> anyhow::Result<kube::Client> {
    let options = kube::config::KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .context("loading the kubeconfig")?
        }
        None if args.context.is_some() => kube::Config::from_kubeconfig(&options)
            .await
            .context("loading the kubeconfig")?,
        None => kube::Config::infer()
            .await
            .context("finding a kubeconfig or in-cluster config")?,
    };
    kube::Client::try_from(config).context("creating the Kubernetes client")
}

fn run_demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log_filter).context("--log-filter")?,
        )
        .with_writer(std::io::stderr)
        .init();
    let output_dir = match args.output_dir {
        Some(dir) => dir,
        None => tempfile::Builder::new()
            .prefix("kerf-demo-")
            .tempdir()
            .context("creating the output directory")?
            .keep(),
    };
    let config = DemoConfig {
        output_dir,
        driver_name: args.driver_name,
        node_name: args.node_name,
        discovery: match args.mock_inventory {
            Some(path) => Discovery::MockFile(path),
            None => Discovery::MockProfile(args.mock_gpus),
        },
        classes: args
            .classes
            .map_or(ManifestSource::Embedded("admin"), ManifestSource::Dir),
        claims: args
            .claims
            .map_or(ManifestSource::Embedded("claims"), ManifestSource::Dir),
        run_containers: args.run_containers,
        busybox: args.busybox,
        // This very program, which is the fake tools under their names (see main).
        gpu_tools: Some(
            std::env::current_exe().context("finding the kerf binary for the fake GPU tools")?,
        ),
        mig_node: (!args.no_mig_node).then_some(demo::MigNode {
            name: args.mig_node_name,
            discovery: Discovery::MockProfile(args.mig_mock_gpus),
        }),
    };
    println!(
        "kerf demo — output directory: {}",
        config.output_dir.display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let summary = runtime.block_on(demo::run(&config))?;
    print!(
        "{}",
        demo::print::render_summary(&summary, config.run_containers)
    );
    Ok(if demo::print::failed(&summary) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error =
            anyhow::Error::from(kerf_cli::Error::io("reading", "/x.yaml", io)).context("--from");
        assert_eq!(error_text(&error), "--from: reading /x.yaml: no such file");
    }
}
