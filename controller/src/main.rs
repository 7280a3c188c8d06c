//! `kerf-controller`: parses flags, sets up logging and the client, and runs the controller
//! until SIGTERM or Ctrl-C.

use anyhow::Context as _;
use clap::Parser;
use kerf_controller::args::Args;
use tokio_util::sync::CancellationToken;

/// mimalloc rather than glibc's malloc (feature `mimalloc`, on by default): the controller
/// allocates on every watch event, admission review and reconcile (heaptrack counted 12
/// million allocations in a 500-node burst, 128,000 a second), across the runtime's worker
/// threads, and with glibc the leader spent about 1.5x the CPU per pod. Measured with `kerf
/// bench controller-footprint` (500 nodes of 8 H100, 1000 slice claims, 2 replicas, 2-core
/// host shared with builds), two pairs of runs of one source: leader CPU per pod 7.0 / 6.2 ms
/// with mimalloc against 9.9 / 11.4 ms with glibc, burst 28.3 / 23.7 s against 32.3 / 31.7 s.
/// The price is memory: leader RSS 107 / 115 MiB (peak 124) against 76 / 78 MiB, standby
/// 36 / 34 against 25 MiB. heaptrack puts the leader's live heap at 44 MB after the burst, 31
/// MB of it the cached ResourceSlices, so the difference is pages mimalloc keeps, not kerf's
/// data. Build with `--no-default-features` for the system allocator where memory matters
/// more than CPU, and to profile the heap with heaptrack (which cannot see mimalloc).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
