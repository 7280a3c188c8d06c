//! `kerf-kubelet-plugin`: parses flags and runs the plugin until SIGTERM or Ctrl-C; as PID 1
//! (or with `--init=always`) first becomes the plugin's minimal init
//! ([`kerf_kubelet_plugin::reaper`]). `kerf-kubelet-plugin mps-control-daemon …` is the program
//! of an MPS daemon pod instead ([`kerf_kubelet_plugin::mps_control_daemon`]).

use anyhow::Context as _;
use clap::Parser;
use kerf_kubelet_plugin::args::Args;
use kerf_kubelet_plugin::{mps_control_daemon, plugin, reaper};

/// mimalloc rather than the system allocator: the prepare path allocates from many threads
/// (gRPC workers, the blocking pool of the file writers), where glibc's malloc spent a
/// quarter of the CPU time of 64 concurrent prepares (see README, Performance).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let argv: Vec<_> = std::env::args_os().collect();
    // The program of an MPS daemon pod: the same image, another first argument.
    if mps_control_daemon::is_invoked(&argv) {
        let code = mps_control_daemon::main_from(argv).context("mps-control-daemon")?;
        std::process::exit(code);
    }
    let args = Args::parse();
    // In the init too: what it cannot do (forward a signal) is logged.
    kerf_ops::logging::init(args.log_format, &args.log_filter)?;
    // Before any runtime or thread exists: the init re-executes this program as its child.
    if let Some(code) = reaper::enter(args.init, std::env::args_os().collect())
        .context("starting the plugin's init")?
    {
        std::process::exit(code);
    }
    run(args)
}

#[tokio::main]
async fn run(args: Args) -> anyhow::Result<()> {
    let health = args.health_config()?;
    let claim_device_status = args.claim_device_status;
    let claim_cache = args.claim_cache;
    let crash_at = args.mock_crash_at()?;
    let dynamic_mig = args.dynamic_mig_settings();
    let config = args.into_config()?;
    let inventory = plugin::discover_with_dynamic_mig(&config, &dynamic_mig)?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    // Per-instance socket names only where the kubelet keeps both instances (1.33+).
    let config =
        kerf_kubelet_plugin::grpc::kubelet_version::sockets_for_kubelet(config, &client).await;
    let mut connections =
        plugin::Connections::kube(client, &config.node_name, config.publish_resources);
    if !claim_device_status {
        connections = connections.without_device_status();
    }
    if !claim_cache {
        connections = connections.without_claim_cache();
    }
    let options = plugin::StartOptions {
        health,
        mock_crash_at: crash_at,
    };
    let running = plugin::start_with(&config, &options, inventory, connections).await?;
    let token = running.shutdown_token();
    tokio::spawn(async move {
        kerf_ops::signal::terminated().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    running.wait().await?;
    Ok(())
}
