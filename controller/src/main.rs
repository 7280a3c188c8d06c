//! `kerf-controller`: parses flags, sets up logging and the client, and runs the controller
//! until SIGTERM or Ctrl-C.

use anyhow::Context as _;
use clap::Parser;
use kerf_controller::args::{Args, LogFormat};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logging(args.log_format, &args.log_filter)?;
    let config = args.into_config(host_name())?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    kerf_controller::run(config, client, shutdown).await?;
    Ok(())
}

fn init_logging(format: LogFormat, filter: &str) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(filter).map_err(|e| anyhow::anyhow!("--log-filter: {e}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))
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

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the controller");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
