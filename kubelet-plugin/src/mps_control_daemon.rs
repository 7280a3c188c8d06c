//! `kerf-kubelet-plugin mps-control-daemon`: the program of an MPS daemon pod (one per GPU
//! with MPS slices, `--mps-daemons=pod`). It runs `<tools-root>/usr/bin/nvidia-cuda-mps-control
//! -f` in the foreground with the GPU's MPS environment and lives and dies with it, so that the
//! kubelet, not the plugin, keeps the daemon running: a plugin restart, upgrade or OOM kill no
//! longer stops it.
//!
//! What it does and why:
//! - The pipe directory of a dead daemon is emptied first (not replaced: running clients have
//!   it bind-mounted): its PID file and sockets stay behind a SIGKILL (seen with the real `-f`
//!   on an H200, see `kerf_fake_gpu_tools`), and a stale PID that is reused would make the new
//!   daemon believe it already runs. A pipe directory whose
//!   `control` socket accepts a connection belongs to a live daemon (perhaps in another PID
//!   namespace, where its PID means nothing): the program refuses to start a second one.
//! - `pipe` and `log` are created; `shm` is not: the plugin creates it and the pod mounts it
//!   at `/dev/shm`.
//! - SIGTERM and SIGINT become the control client's `quit` (the real `-f` dies of SIGTERM by
//!   the default action, leaving its PID file and its MPS servers behind); the daemon then has
//!   the stop timeout to exit before it is killed, and the program exits 0.
//! - A daemon that exits without being asked is logged (one line, with its status) and the
//!   program exits non-zero, so that the kubelet restarts the container and the restart shows
//!   in the container's `lastState`.
//! - The daemon runs in its own process group, so a Ctrl-C in a terminal reaches only this
//!   program, which stops the daemon with `quit`.
//! - As PID 1 of its container it runs behind [`crate::reaper`]'s init (`--init`), which reaps
//!   the MPS servers the daemon leaves when it dies.
//!
//! The control program runs as the plugin's own daemons run it
//! (`crate::mps_daemons::tools::control`: a clean environment, the driver root's libraries,
//! the GPU's MPS variables).

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use clap::Parser;
use kerf_core::mps::{CONTROL_PROGRAM, MpsDirectories, PID_FILE};
use kerf_ops::logging::LogFormat;
use tokio::process::Child;
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::error::{Error, Result};
use crate::mps_daemons::tools::{self, accepts_connections, control as control_command};
use crate::reaper::{self, InitMode};

/// The first argument that selects this program instead of the plugin.
pub(crate) const SUBCOMMAND: &str = "mps-control-daemon";

/// How often the control socket is tried until the daemon accepts connections.
const READY_POLL: Duration = Duration::from_millis(50);

/// The flags of `kerf-kubelet-plugin mps-control-daemon`; each also an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = SUBCOMMAND,
    bin_name = "kerf-kubelet-plugin mps-control-daemon",
    about = "Runs one GPU's MPS control daemon in the foreground (the program of an MPS daemon pod)"
)]
pub(crate) struct DaemonArgs {
    /// UUID of the GPU the daemon serves (`GPU-…`).
    #[arg(long, env = "KERF_MPS_GPU")]
    pub gpu: String,

    /// Root of the per-GPU MPS directories; the daemon's are `<root>/<gpu>/{pipe,log}`.
    #[arg(long, env = "KERF_MPS_ROOT")]
    pub mps_root: PathBuf,

    /// Directory whose `usr/bin` holds `nvidia-cuda-mps-control` (the driver root, or a mock
    /// driver root with the fake tools).
    #[arg(long, env = "KERF_GPU_TOOLS_ROOT")]
    pub tools_root: PathBuf,

    /// How long the daemon may take to exit after `quit` before it is killed.
    #[arg(long, env = "KERF_MPS_STOP_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub stop_timeout: Duration,

    /// Run behind a minimal init that reaps orphans: `auto` when the process is PID 1.
    #[arg(
        long,
        env = "KERF_INIT",
        value_enum,
        default_value = "auto",
        overrides_with = "init"
    )]
    pub init: InitMode,

    /// Log format.
    #[arg(long, env = "KERF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax.
    #[arg(long, env = "KERF_LOG", default_value = "info")]
    pub log_filter: String,
}

impl DaemonArgs {
    /// The daemon's directories, after checking the flags: a GPU UUID, absolute paths, an MPS
    /// root that is UTF-8 (it ends up in environment variables and CDI specs).
    ///
    /// # Errors
    /// [`Error::Config`] naming the flag and its value.
    pub(crate) fn directories(&self) -> Result<MpsDirectories> {
        crate::args::check_mps_root(&self.mps_root)?;
        if !self.tools_root.is_absolute() {
            return Err(Error::Config(format!(
                "--tools-root {}: must be an absolute path",
                self.tools_root.display()
            )));
        }
        MpsDirectories::new(&self.mps_root, &self.gpu)
            .map_err(|error| Error::Config(format!("--gpu {}: {error}", self.gpu)))
    }
}

/// Whether `argv` (the program first) asks for this program rather than the plugin.
pub(crate) fn is_invoked(argv: &[OsString]) -> bool {
    argv.get(1).is_some_and(|arg| arg == SUBCOMMAND)
}

/// The whole program for `argv` (`<program> mps-control-daemon <flags>…`): parses and checks
/// the flags, sets up logging, enters the init when PID 1, runs the daemon; returns the exit
/// code. Bad flags are printed by clap (with `--help` and its code 0 among them).
///
/// # Errors
/// [`Error::Config`] for an invalid flag value or log filter; [`Error::Io`] when the init or
/// the runtime cannot start; what [`run`] returns.
pub(crate) fn main_from(argv: Vec<OsString>) -> Result<i32> {
    let args = match DaemonArgs::try_parse_from(argv.iter().skip(1)) {
        Ok(args) => args,
        Err(error) => {
            let _ = error.print();
            return Ok(error.exit_code());
        }
    };
    let dirs = args.directories()?;
    kerf_ops::logging::init(args.log_format, &args.log_filter)
        .map_err(|error| Error::Config(error.to_string()))?;
    // Before any runtime or thread exists: the init re-executes this program as its child.
    if let Some(code) = reaper::enter(args.init, argv)? {
        return Ok(code);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("start the runtime", &args.tools_root, e))?;
    runtime.block_on(run(&args, &dirs))
}

/// Prepares the directories, runs the daemon and waits for it or for SIGTERM/SIGINT; returns
/// the exit code (see the module documentation).
///
/// # Errors
/// [`Error::Mps`] when a live daemon owns the pipe directory or the daemon cannot be started;
/// [`Error::Io`] when the directories cannot be prepared or the signals watched.
pub(crate) async fn run(args: &DaemonArgs, dirs: &MpsDirectories) -> Result<i32> {
    // Before the daemon starts: a SIGTERM in between must become a `quit`, not our death.
    let mut terminate = watch(SignalKind::terminate(), &args.tools_root)?;
    let mut interrupt = watch(SignalKind::interrupt(), &args.tools_root)?;
    prepare_directories(dirs).await?;
    let mut daemon = control_command(&args.tools_root, dirs)
        .arg("-f")
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| mps_error(dirs, format!("cannot run {CONTROL_PROGRAM} -f: {e}")))?;
    let gpu = dirs.gpu_uuid();
    tracing::info!(gpu, pid = daemon.id(), pipe = %dirs.pipe().display(), "MPS control daemon started");
    let mut ready = std::pin::pin!(accepting(dirs));
    let mut announced = false;
    loop {
        tokio::select! {
            status = daemon.wait() => {
                let status = status.map_err(|e| Error::io("wait for the daemon", dirs.pipe(), e))?;
                tracing::error!(gpu, %status, "MPS control daemon exited without being asked to; exiting so that the kubelet restarts it");
                return Ok(exit_code(status));
            }
            () = &mut ready, if !announced => {
                announced = true;
                tracing::info!(gpu, "MPS control daemon accepts connections");
            }
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
        }
    }
    stop(&mut daemon, &args.tools_root, dirs, args.stop_timeout).await;
    Ok(0)
}

fn watch(kind: SignalKind, path: &Path) -> Result<Signal> {
    signal(kind).map_err(|e| Error::io("watch signals", path, e))
}

/// Clears what a dead daemon left in the pipe directory and creates `pipe` and `log`.
async fn prepare_directories(dirs: &MpsDirectories) -> Result<()> {
    let pipe = dirs.pipe();
    if accepts_connections(dirs).await {
        return Err(mps_error(
            dirs,
            format!(
                "a live MPS control daemon already serves {} (its control socket accepts connections); not starting a second one",
                pipe.display()
            ),
        ));
    }
    // Emptied, not replaced: running clients have this very directory bind-mounted.
    tools::clear_directory(&pipe)
        .await
        .map_err(|error| Error::io("clear the stale pipe directory", &pipe, error))?;
    for dir in [pipe, dirs.log()] {
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| Error::io("create MPS directory", &dir, e))?;
    }
    Ok(())
}

/// Resolves once the daemon of `dirs` accepts connections (the probe the plugin's readiness
/// uses, which tries the control socket's own type).
async fn accepting(dirs: &MpsDirectories) {
    while !accepts_connections(dirs).await {
        tokio::time::sleep(READY_POLL).await;
    }
}

/// `quit` through the control client, then at most `timeout` (from now, for both) for the
/// daemon to exit, then SIGKILL.
async fn stop(daemon: &mut Child, tools_root: &Path, dirs: &MpsDirectories, timeout: Duration) {
    let gpu = dirs.gpu_uuid();
    tracing::info!(gpu, "stopping the MPS control daemon (quit)");
    let deadline = tokio::time::Instant::now() + timeout;
    if let Err(message) = tools::send_quit(tools_root, dirs, deadline).await {
        tracing::warn!(gpu, %message, "the control client could not deliver quit");
    }
    match tokio::time::timeout_at(deadline, daemon.wait()).await {
        Ok(Ok(status)) => tracing::info!(gpu, %status, "MPS control daemon stopped"),
        Ok(Err(error)) => tracing::warn!(gpu, %error, "cannot wait for the MPS control daemon"),
        Err(_) => kill(daemon, dirs, timeout).await,
    }
}

/// SIGKILL for a daemon that ignored `quit`, and its PID file, which would name a dead PID.
async fn kill(daemon: &mut Child, dirs: &MpsDirectories, timeout: Duration) {
    let gpu = dirs.gpu_uuid();
    let pid = daemon.id();
    tracing::warn!(
        gpu,
        ?pid,
        ?timeout,
        "MPS control daemon did not exit after quit; killing it"
    );
    if let Err(error) = daemon.kill().await {
        tracing::warn!(gpu, %error, "cannot kill the MPS control daemon");
        return;
    }
    let pid_file = dirs.pipe().join(PID_FILE);
    let names_it = tokio::fs::read_to_string(&pid_file)
        .await
        .is_ok_and(|text| pid.is_some_and(|pid| text.trim() == pid.to_string()));
    if names_it && let Err(error) = tokio::fs::remove_file(&pid_file).await {
        tracing::warn!(gpu, %error, "cannot remove the killed daemon's PID file");
    }
}

/// The exit code for a daemon that exited by itself: its own when non-zero, 128 + the signal
/// that killed it (as a shell reports it), and 1 for a 0, which must still restart the
/// container.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(0), _) | (None, None) => 1,
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
    }
}

fn mps_error(dirs: &MpsDirectories, message: String) -> Error {
    tools::mps_error(dirs.gpu_uuid(), message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";

    fn parse(args: &[&str]) -> std::result::Result<DaemonArgs, clap::Error> {
        DaemonArgs::try_parse_from(std::iter::once(SUBCOMMAND).chain(args.iter().copied()))
    }

    #[test]
    fn flags_are_checked_and_named_in_errors() {
        let ok = parse(&["--gpu", UUID, "--mps-root", "/m", "--tools-root", "/t"]).unwrap();
        assert_eq!(ok.stop_timeout, Duration::from_secs(10));
        assert_eq!(
            ok.directories().unwrap().pipe(),
            Path::new("/m").join(UUID).join("pipe")
        );
        for (args, named) in [
            (["GPU-zz", "/m", "/t"], "--gpu GPU-zz"),
            ([UUID, "m", "/t"], "--mps-root m"),
            ([UUID, "/m", "t"], "--tools-root t"),
        ] {
            let parsed = parse(&[
                "--gpu",
                args[0],
                "--mps-root",
                args[1],
                "--tools-root",
                args[2],
            ])
            .unwrap();
            let error = parsed.directories().unwrap_err().to_string();
            assert!(error.contains(named), "{error}");
        }
        assert!(parse(&["--gpu", UUID]).is_err(), "the roots are required");
    }

    #[test]
    fn only_the_subcommand_selects_the_program() {
        let argv = |args: &[&str]| args.iter().map(OsString::from).collect::<Vec<_>>();
        assert!(is_invoked(&argv(&[
            "kerf-kubelet-plugin",
            SUBCOMMAND,
            "--gpu",
            UUID
        ])));
        assert!(!is_invoked(&argv(&[
            "kerf-kubelet-plugin",
            "--node-name",
            "n"
        ])));
        assert!(!is_invoked(&argv(&["kerf-kubelet-plugin"])));
    }

    #[test]
    fn a_daemon_that_exits_by_itself_never_exits_0() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 1);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
    }
}
