//! `kerf-kubelet-plugin`: parses flags and runs the plugin until SIGTERM or Ctrl-C.

use anyhow::Context as _;
use clap::Parser;
use kerf_kubelet_plugin::args::Args;
use kerf_kubelet_plugin::{logging, plugin};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    logging::init(args.log_format.into(), &args.log_filter)
        .map_err(|e| anyhow::anyhow!("--log-filter: {e}"))?;
    let config = args.into_config()?;
    let inventory = plugin::discover(&config)?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API")?;
    let connections = plugin::Connections::kube(client, config.publish_resources);
    let running = plugin::start(&config, inventory, connections).await?;
    let token = running.shutdown_token();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    running.wait().await?;
    Ok(())
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
            tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the plugin");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
