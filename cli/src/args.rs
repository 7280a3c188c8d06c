//! The command line of `kerf`: its subcommands and their flags, each flag also an environment
//! variable where it makes sense. The binary parses [`Cli`]; docs/configuration.md is rendered
//! from the same definitions ([`crate::reference`]).

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// kerf: GPUs for Kubernetes through Dynamic Resource Allocation.
#[derive(Debug, Parser)]
#[command(name = "kerf", version, about)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands of `kerf`.
#[derive(Debug, Subcommand)]
pub enum Command {
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

/// The flags of `kerf status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, then the in-cluster config].
    #[arg(long, env = "KERF_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// kubeconfig context [default: the current context].
    #[arg(long, env = "KERF_CONTEXT")]
    pub context: Option<String>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    pub driver_name: String,
    /// Output format: `table`, or `json` (a stable shape for scripts, see docs/operations.md).
    #[arg(
        short,
        long,
        env = "KERF_STATUS_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    pub output: StatusOutput,
    /// Keep watching and print again after every change (Ctrl-C exits). With `-o json`, one
    /// compact document per line.
    #[arg(short, long)]
    pub watch: bool,
    /// Read ResourceSlices and ResourceClaims from these YAML files instead of a cluster
    /// (e.g. `kerf demo`'s claims.yaml and `kerf inventory`'s output); repeatable.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["watch", "kubeconfig", "context"])]
    pub from: Vec<PathBuf>,
    /// The node label whose value names a node's pool, for the GPU fragmentation per pool
    /// (nodes without it are in pool `unlabeled`).
    #[arg(
        long,
        env = "KERF_NODE_POOL_LABEL",
        default_value = kerf_api::node_pool::DEFAULT_NODE_POOL_LABEL
    )]
    pub node_pool_label: String,
}

/// The output formats of `kerf status`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum StatusOutput {
    /// One table per node, for people.
    Table,
    /// A stable JSON document, for scripts.
    Json,
}

/// The flags of `kerf inventory`.
#[derive(Debug, clap::Args)]
pub struct InventoryArgs {
    /// Mock inventory PROFILE[:COUNT] (h100-sxm-80gb, a100-40gb-mig, l4, …; --list-profiles
    /// prints them all); the default when neither this nor --mock-inventory is given is to ask
    /// NVML.
    #[arg(long, env = "KERF_MOCK_GPUS", conflicts_with = "mock_inventory")]
    pub mock_gpus: Option<String>,
    /// Mock inventory YAML file.
    #[arg(long, env = "KERF_MOCK_INVENTORY")]
    pub mock_inventory: Option<PathBuf>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    pub driver_name: String,
    /// Node name (the pool name).
    #[arg(long, env = "NODE_NAME", default_value = "node-1")]
    pub node_name: String,
    /// Print the names of the mock profiles, one a line, and nothing else (the other flags
    /// are not used).
    #[arg(long)]
    pub list_profiles: bool,
    /// Publish every whole GPU outside MIG mode as a scheduler slice (Kubernetes 1.36
    /// DRAConsumableCapacity: allowMultipleAllocations with memory and compute capacities and
    /// their request policies), as for the GPUs of a sliced Scheduler GpuClass.
    #[arg(long, env = "KERF_INVENTORY_CONSUMABLE_CAPACITY")]
    pub consumable_capacity: bool,
    /// Memory granularity of the scheduler slices [default: 1Gi].
    #[arg(
        long,
        env = "KERF_INVENTORY_MEMORY_GRANULARITY",
        requires = "consumable_capacity",
        value_parser = parse_granularity
    )]
    pub memory_granularity: Option<u64>,
    /// Compute percent of a scheduler slice that asks for memory only [default: 100].
    #[arg(
        long,
        env = "KERF_INVENTORY_DEFAULT_COMPUTE",
        requires = "consumable_capacity",
        value_parser = clap::value_parser!(u8).range(1..=100)
    )]
    pub default_compute: Option<u8>,
    /// Most scheduler slices per GPU (a `slices` capacity) [default: no limit].
    #[arg(
        long,
        env = "KERF_INVENTORY_MAX_SLICES_PER_GPU",
        requires = "consumable_capacity",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_slices_per_gpu: Option<u32>,
    /// Publish dynamic-MIG GPUs as counter sets and one device per MIG placement (Kubernetes
    /// 1.36 DRAPartitionableDevices), as the scheduler's.
    #[arg(long, env = "KERF_INVENTORY_PARTITIONABLE_DEVICES")]
    pub partitionable_devices: bool,
}

impl InventoryArgs {
    /// The Kubernetes 1.36 features the printed ResourceSlices use.
    pub fn features(&self) -> crate::inventory::Features {
        let consumable_capacity = self.consumable_capacity.then(|| {
            let mut slicing = crate::inventory::default_slicing();
            if let Some(bytes) = self.memory_granularity {
                slicing.memory_granularity_bytes = bytes;
            }
            slicing.default_compute_percent = self.default_compute;
            slicing.max_slices_per_gpu = self.max_slices_per_gpu;
            slicing
        });
        crate::inventory::Features {
            consumable_capacity,
            partitionable_devices: self.partitionable_devices,
        }
    }
}

/// `--memory-granularity`: a byte quantity such as `1Gi` or `512Mi`.
fn parse_granularity(text: &str) -> Result<u64, String> {
    kerf_api::quantity::parse_bytes(text).map_err(|e| e.to_string())
}

/// The flags of `kerf demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Mock GPUs of the node, PROFILE[:COUNT] (h100-sxm-80gb, a100-40gb-mig, l4).
    #[arg(
        long,
        env = "KERF_MOCK_GPUS",
        default_value = crate::demo::DEFAULT_MOCK_GPUS,
        conflicts_with = "mock_inventory"
    )]
    pub mock_gpus: String,
    /// Mock inventory YAML file instead of a profile.
    #[arg(long, env = "KERF_MOCK_INVENTORY")]
    pub mock_inventory: Option<PathBuf>,
    /// Directory for the plugin's sockets and checkpoint, the CDI specs (cdi/), summary.json
    /// and claims.yaml [default: a new temporary directory, printed].
    #[arg(long, env = "KERF_DEMO_OUTPUT_DIR")]
    pub output_dir: Option<PathBuf>,
    /// Directory of claims, ResourceClaimTemplates, Pods and Deployments (*.yaml)
    /// [default: the examples/claims built into this binary].
    #[arg(long, env = "KERF_DEMO_CLAIMS")]
    pub claims: Option<PathBuf>,
    /// Directory of GpuClasses and DeviceClasses (*.yaml) [default: the examples/admin built
    /// into this binary]; the default classes of an install are always loaded first.
    #[arg(long, env = "KERF_DEMO_CLASSES")]
    pub classes: Option<PathBuf>,
    /// Run one busybox container per prepared claim with podman (as root), injecting the
    /// claim's CDI devices, and print what it sees. Fails when podman is missing.
    #[arg(long, env = "KERF_DEMO_RUN_CONTAINERS")]
    pub run_containers: bool,
    /// Statically linked busybox for the containers' root filesystem [default: /bin/busybox].
    #[arg(long, env = "KERF_DEMO_BUSYBOX")]
    pub busybox: Option<PathBuf>,
    /// DRA driver name.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    pub driver_name: String,
    /// The mock node's name (the pool name).
    #[arg(long, env = "KERF_DEMO_NODE_NAME", default_value = crate::demo::DEFAULT_NODE_NAME)]
    pub node_name: String,
    /// The dynamic-MIG node's name: a second mock node whose GPUs in MIG mode are published
    /// as counter sets and MIG placements (Kubernetes 1.36 partitionable devices), with its
    /// own plugin creating each allocated placement's MIG instance.
    #[arg(
        long,
        env = "KERF_DEMO_MIG_NODE_NAME",
        default_value = crate::demo::mig::DEFAULT_MIG_NODE_NAME
    )]
    pub mig_node_name: String,
    /// Mock GPUs of the dynamic-MIG node, PROFILE[:COUNT] (a100-40gb-dynmig,
    /// a100-80gb-dynmig, h100-sxm-80gb-dynmig).
    #[arg(
        long,
        env = "KERF_DEMO_MIG_MOCK_GPUS",
        default_value = crate::demo::mig::DEFAULT_MIG_MOCK_GPUS
    )]
    pub mig_mock_gpus: String,
    /// Run without the dynamic-MIG node.
    #[arg(long, env = "KERF_DEMO_NO_MIG_NODE")]
    pub no_mig_node: bool,
    /// The name of the node of shareable GPUs: a third mock node whose GPUs the sliced
    /// Scheduler classes select are published shareable (Kubernetes 1.36 consumable capacity),
    /// with its own plugin preparing the scheduler slices kube-scheduler cuts from them.
    #[arg(
        long,
        env = "KERF_DEMO_SHAREABLE_NODE_NAME",
        default_value = crate::demo::shareable::DEFAULT_SHAREABLE_NODE_NAME
    )]
    pub shareable_node_name: String,
    /// Mock GPUs of the node of shareable GPUs, PROFILE[:COUNT].
    #[arg(
        long,
        env = "KERF_DEMO_SHAREABLE_MOCK_GPUS",
        default_value = crate::demo::shareable::DEFAULT_SHAREABLE_MOCK_GPUS
    )]
    pub shareable_mock_gpus: String,
    /// Run without the node of shareable GPUs.
    #[arg(long, env = "KERF_DEMO_NO_SHAREABLE_NODE")]
    pub no_shareable_node: bool,
    /// Log filter for the plugin's and controller's logs on stderr (tracing EnvFilter syntax).
    #[arg(long, env = "KERF_LOG", default_value = "warn")]
    pub log_filter: String,
}
