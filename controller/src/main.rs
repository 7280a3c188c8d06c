//! `kerf-controller` binary.

use clap::Parser;

/// kerf's control-plane controller.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// DRA driver name whose claims this controller allocates.
    #[arg(long, env = "KERF_DRIVER_NAME", default_value = "gpu.kerf.dev")]
    driver_name: String,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::bail!(
        "kerf-controller for driver {} is not implemented yet: allocation arrives with the controller issue",
        args.driver_name
    )
}
