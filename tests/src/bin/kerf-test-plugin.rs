//! `kerf-test-plugin`: the kubelet plugin library run as its own process, for tests that must
//! kill the plugin (SIGKILL) and start it again. It takes exactly the flags of
//! `kerf-kubelet-plugin` (`--mock-crash-at` included) and reads the API server from `KUBECONFIG`; SIGTERM or Ctrl-C stop
//! it cleanly. `kerf-test-plugin mps-control-daemon …` runs the MPS daemon pod's program, as
//! `kerf-kubelet-plugin mps-control-daemon …` does.
//!
//! It lives in kerf-tests because Cargo builds a package's own binaries for that package's
//! integration tests (`CARGO_BIN_EXE_kerf-test-plugin`), but not another package's.

use clap::Parser as _;
use kerf_kubelet_plugin::args::Args;
use kerf_kubelet_plugin::{mps_control_daemon, plugin, reaper};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let argv: Vec<_> = std::env::args_os().collect();
    // `kerf-test-plugin mps-control-daemon …`, as kerf-kubelet-plugin dispatches it.
    if mps_control_daemon::is_invoked(&argv) {
        match mps_control_daemon::main_from(argv) {
            Ok(code) => std::process::exit(code),
            Err(error) => {
                eprintln!("Error: {error}");
                std::process::exit(1);
            }
        }
    }
    let args = Args::parse();
    // `--init`, as kerf-kubelet-plugin's main takes it: the init re-executes this program.
    if let Some(code) = reaper::enter(args.init, std::env::args_os().collect())? {
        std::process::exit(code);
    }
    run(args)
}

#[tokio::main]
async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    // Plain text on stderr, which the test captures: the log format flag does not matter here.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log_filter)?)
        .with_writer(std::io::stderr)
        .init();
    let claim_cache = args.claim_cache;
    let crash_at = args.mock_crash_at()?;
    let config = args.into_config()?;
    let inventory = plugin::discover(&config)?;
    let client = kube::Client::try_default().await?;
    let mut connections =
        plugin::Connections::kube(client, &config.node_name, config.publish_resources);
    if !claim_cache {
        connections = connections.without_claim_cache();
    }
    let options = plugin::StartOptions {
        mock_crash_at: crash_at,
        ..plugin::StartOptions::defaults(config.discovery.is_mock())
    };
    let running = plugin::start_with(&config, &options, inventory, connections).await?;
    let token = running.shutdown_token();
    tokio::spawn(async move {
        wait_for_termination().await;
        token.cancel();
    });
    running.wait().await?;
    Ok(())
}

async fn wait_for_termination() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
