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
    /// Show every kerf GPU of the cluster per node, from kerf's ResourceSlices and the claims
    /// allocated on them: owner, product, memory and compute used, health, claims (pod, size,
    /// allocator), MIG devices and the pool's generation; the GPU fragmentation of each node
    /// pool; the GpuQuotas.
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
    /// The node label whose value names a node's pool, for the GPU fragmentation per pool
    /// (nodes without it are in pool `unlabeled`).
    #[arg(
        long,
        env = "KERF_NODE_POOL_LABEL",
        default_value = kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL
    )]
    node_pool_label: String,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StatusOutput {
    Table,
    Json,
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
    /// Run without the dynamic-MIG node.
    #[arg(long, env = "KERF_DEMO_NO_MIG_NODE")]
    no_mig_node: bool,
    /// The name of the node of shareable GPUs: a third mock node whose GPUs the sliced
    /// Scheduler classes select are published shareable (Kubernetes 1.36 consumable capacity),
    /// with its own plugin preparing the scheduler slices kube-scheduler cuts from them.
    #[arg(
        long,
        env = "KERF_DEMO_SHAREABLE_NODE_NAME",
        default_value = demo::shareable::DEFAULT_SHAREABLE_NODE_NAME
    )]
    shareable_node_name: String,
    /// Mock GPUs of the node of shareable GPUs, PROFILE[:COUNT].
    #[arg(
        long,
        env = "KERF_DEMO_SHAREABLE_MOCK_GPUS",
        default_value = demo::shareable::DEFAULT_SHAREABLE_MOCK_GPUS
    )]
    shareable_mock_gpus: String,
    /// Run without the node of shareable GPUs.
    #[arg(long, env = "KERF_DEMO_NO_SHAREABLE_NODE")]
    no_shareable_node: bool,
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
    let pool_label = args.node_pool_label.as_str();
    if !args.from.is_empty() {
        let snapshot = status::files::read(&args.from)?;
        let status = status::Status::with_pool_label(&snapshot, driver, pool_label);
        return print_status(&status, args.output);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = status_client(args).await?;
        if !args.watch {
            let snapshot = status::fetch(&client, driver).await?;
            let status = status::Status::with_pool_label(&snapshot, driver, pool_label);
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
            pool_label,
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
        shareable_node: (!args.no_shareable_node).then_some(demo::ShareableNode {
            name: args.shareable_node_name,
            discovery: Discovery::MockProfile(args.shareable_mock_gpus),
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
