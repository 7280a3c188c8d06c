//! `kerf-controller`: parses flags, sets up logging and the client, and runs the controller
//! until SIGTERM or Ctrl-C.

use anyhow::Context as _;
use clap::Parser;
use kerf_controller::args::Args;
use tokio_util::sync::CancellationToken;

// mimalloc while the feature `mimalloc` (on by default) is on; why: `kerf_ops::allocator`.
kerf_ops::global_allocator!();

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    kerf_ops::logging::init(args.log_format, &args.log_filter)?;
    let webhook = args.webhook_config()?;
    let mut controllers = kerf_controller::controllers();
    if let Some(defaults) = args.default_classes()? {
        controllers.push(kerf_controller::default_classes::task(defaults));
    }
    let config = args.into_config(host_name())?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        kerf_ops::signal::terminated().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    kerf_controller::run_controllers_and_webhook(config, webhook, client, shutdown, controllers)
        .await?;
    Ok(())
}

/// The identity fallback when POD_NAME is not set: Kubernetes sets the pod's host name to the
/// pod name.
fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}
