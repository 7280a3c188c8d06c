//! The program of `kerf-kubelet-plugin`, as a library so that tests run the same one
//! (`kerf-test-plugin`): [`launch`] does what must happen before any runtime or thread exists,
//! [`run`] runs the plugin until SIGTERM or Ctrl-C.

use std::ffi::OsString;

use clap::Parser as _;

use crate::args::Args;
use crate::plugin::{self, Connections};
use crate::{Error, Result, mps_control_daemon, reaper};

/// What the process goes on with after [`launch`].
#[derive(Debug)]
pub enum Launched {
    /// Exit with this code: the MPS control daemon's program, or the init whose child ran the
    /// plugin, has ended.
    Exit(i32),
    /// Run the plugin with these flags ([`run`], on a Tokio runtime).
    Plugin(Box<Args>),
}

/// Why [`launch`] could not get as far as the plugin.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The MPS control daemon's program (`<program> mps-control-daemon …`) failed.
    #[error("mps-control-daemon")]
    MpsControlDaemon(#[source] Error),
    /// Logging could not be set up, e.g. a `--log-filter` that does not parse.
    #[error(transparent)]
    Logging(#[from] kerf_ops::logging::LoggingError),
    /// The plugin's init could not be started (`--init`).
    #[error("starting the plugin's init")]
    Init(#[source] Error),
}

/// The part of the program before any runtime or thread exists, for the process's `argv`:
/// `<program> mps-control-daemon …` runs an MPS daemon pod's program
/// ([`mps_control_daemon`]); otherwise the flags are parsed (clap prints bad ones and exits,
/// as it does for `--help`), logging is set up as `--log-format` and `--log-filter` say, and
/// as PID 1 or with `--init=always` the process becomes the plugin's init ([`reaper`]), which
/// re-executes the program as its child and returns the child's exit code.
///
/// # Errors
/// [`LaunchError`]: the daemon's program failed, logging or the init could not be set up.
pub fn launch(argv: Vec<OsString>) -> std::result::Result<Launched, LaunchError> {
    // The program of an MPS daemon pod: the same image, another first argument.
    if mps_control_daemon::is_invoked(&argv) {
        let code = mps_control_daemon::main_from(argv).map_err(LaunchError::MpsControlDaemon)?;
        return Ok(Launched::Exit(code));
    }
    let args = Args::parse_from(&argv);
    // In the init too: what it cannot do (forward a signal) is logged.
    kerf_ops::logging::init(args.log_format, &args.log_filter)?;
    // Before any runtime or thread exists: the init re-executes this program as its child.
    match reaper::enter(args.init, argv).map_err(LaunchError::Init)? {
        Some(code) => Ok(Launched::Exit(code)),
        None => Ok(Launched::Plugin(Box::new(args))),
    }
}

/// Runs the plugin as `args` configure it until SIGTERM or Ctrl-C, then stops it cleanly:
/// discovers the GPUs, connects to the API server of the environment's kubeconfig (in a pod,
/// its ServiceAccount), names the sockets as the node's kubelet version allows
/// ([`crate::grpc::kubelet_version::sockets_for_kubelet`]), and starts every part
/// ([`plugin::start`]) with the connections the flags ask for ([`Connections::kube`]).
///
/// # Errors
/// Invalid flags, no GPU discovery, no API server configuration, a part that cannot start,
/// or the first part that failed while running.
pub async fn run(args: Args) -> Result<()> {
    let config = args.into_config()?;
    let inventory = plugin::discover(&config)?;
    let client = kube::Client::try_default().await?;
    // Per-instance socket names only where the kubelet keeps both instances (1.33+).
    let config = crate::grpc::kubelet_version::sockets_for_kubelet(config, &client).await;
    let connections = Connections::kube(client, &config);
    let running = plugin::start(&config, inventory, connections).await?;
    let token = running.shutdown_token();
    tokio::spawn(async move {
        kerf_ops::signal::terminated().await;
        tracing::info!("shutting down");
        token.cancel();
    });
    running.wait().await
}
