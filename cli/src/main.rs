//! `kerf`: kerf's command-line tool.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};

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
}

#[derive(Debug, clap::Args)]
struct InventoryArgs {
    /// Mock inventory PROFILE[:COUNT] (h100-sxm-80gb, a100-40gb-mig, l4); the default when
    /// neither this nor --mock-inventory is given is to ask NVML.
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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Inventory(args) => inventory(&args),
    }
}

fn inventory(args: &InventoryArgs) -> anyhow::Result<()> {
    let source = kerf_kubelet_plugin::discovery::select(
        args.mock_gpus.as_deref(),
        args.mock_inventory.as_deref(),
    )?;
    let inventory = source.discover()?;
    let slices =
        kerf_cli::inventory::resource_slices(&inventory, &args.driver_name, &args.node_name)?;
    print!(
        "{}",
        kerf_cli::inventory::to_yaml(&slices).context("rendering YAML")?
    );
    Ok(())
}
