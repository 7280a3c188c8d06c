//! The program of `kerf-controller`, as a library: [`run`] is all the binary does with its
//! flags, so that nothing of it lives where tests cannot reach.

use tokio_util::sync::CancellationToken;

use crate::args::Args;
use crate::error::{Error, Result};
use crate::run::{Process, controllers};

/// Runs `kerf-controller` as `args` configure it until SIGTERM or Ctrl-C: sets up logging as
/// `--log-format` and `--log-filter` say, connects to the API server of the environment's
/// kubeconfig (in a pod, its ServiceAccount), and runs the [`Process`] of [`controllers`], the
/// default GpuClasses when the flags ask for them, and the webhook when enabled.
///
/// # Errors
/// Logging cannot be set up ([`Error::Logging`]), invalid flags ([`Error::Config`]), no API
/// server configuration ([`Error::Connect`]), or what [`Process::run`] returns.
pub async fn run(args: Args) -> Result<()> {
    kerf_ops::logging::init(args.log_format, &args.log_filter)?;
    let webhook = args.webhook_config()?;
    let mut controllers = controllers();
    if let Some(defaults) = args.default_classes()? {
        controllers.push(crate::default_classes::task(defaults));
    }
    let config = args.into_config(host_name())?;
    let client = kube::Client::try_default().await.map_err(Error::Connect)?;
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        kerf_ops::signal::terminated().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    let process = Process {
        config,
        client,
        controllers,
        webhook,
        shutdown,
    };
    process.run().await
}

/// The identity fallback when POD_NAME is not set: Kubernetes sets the pod's host name to the
/// pod name. Read here, in the program, so that the flags stay the only input of the logic.
fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}
