//! Control daemons as daemonized children of the plugin (`--mps-daemons=process`): for a
//! plugin without a cluster or outside a container. In a container they die with it.
//!
//! The daemon runs from the driver root (`<driver-root>/usr/bin/nvidia-cuda-mps-control -d`,
//! or the fake of `kerf-fake-gpu-tools` in a mock driver root) with only its GPU visible and
//! its files in [`MpsDirectories`] under the MPS root. It daemonizes, so the plugin is not
//! its parent: whether it runs is read from its PID file and `/proc/<pid>/cmdline`, which is
//! also how a restarted plugin adopts the daemons of GPUs that still have MPS claims. Before
//! starting it the GPU is put in compute mode `EXCLUSIVE_PROCESS`; after stopping it, back in
//! `DEFAULT`. A start that fails leaves nothing behind: no directory, no daemon, the compute
//! mode restored.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use kerf_core::mps::{CONTROL_PROGRAM, ComputeMode, MpsDirectories, PID_FILE};

use super::MpsSettings;
use super::tools::{clean_up, clear_directory, control, mps_error, send_quit, set_compute_mode};
use crate::error::{Error, Result};

/// A daemon found running for a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunningDaemon {
    /// Its process ID.
    pub pid: u32,
}

/// Starts, finds and stops the control daemons (see the module documentation).
#[derive(Debug, Clone)]
pub struct ProcessDaemons {
    settings: MpsSettings,
}

impl ProcessDaemons {
    /// Daemons run with `settings`.
    pub fn new(settings: MpsSettings) -> Self {
        Self { settings }
    }

    /// The settings.
    pub fn settings(&self) -> &MpsSettings {
        &self.settings
    }

    /// The same tools with daemons under another MPS root: for stopping the daemons a plugin
    /// started before its root was changed.
    #[must_use]
    pub(crate) fn with_root(&self, root: PathBuf) -> Self {
        Self {
            settings: MpsSettings {
                root,
                ..self.settings.clone()
            },
        }
    }

    /// The directories of the daemon of `gpu_uuid`.
    ///
    /// # Errors
    /// [`Error::Core`] when `gpu_uuid` is not a GPU UUID.
    pub fn directories(&self, gpu_uuid: &str) -> Result<MpsDirectories> {
        Ok(MpsDirectories::new(&self.settings.root, gpu_uuid)?)
    }

    /// The daemon of `dirs` when its PID file names a live `nvidia-cuda-mps-control`.
    pub fn running(&self, dirs: &MpsDirectories) -> Option<RunningDaemon> {
        daemon_in(&dirs.pipe())
    }

    /// Makes sure the daemon of `gpu_uuid` runs: adopts a running one, else sets the compute
    /// mode and starts one. Returns its directories.
    ///
    /// # Errors
    /// [`Error::Mps`] naming the GPU and the tool's own message when the compute mode cannot
    /// be set or the daemon does not start; nothing is left behind then.
    pub async fn ensure(&self, gpu_uuid: &str) -> Result<(MpsDirectories, RunningDaemon)> {
        let dirs = self.directories(gpu_uuid)?;
        let started = self.restart(gpu_uuid).await;
        if started.is_err() {
            clean_up(&self.settings.driver_root, &dirs).await;
        }
        started
    }

    /// As [`ProcessDaemons::ensure`] for a GPU whose clients run: a failed start keeps the
    /// GPU's files, which their containers have mounted.
    ///
    /// # Errors
    /// As [`ProcessDaemons::ensure`].
    pub async fn restart(&self, gpu_uuid: &str) -> Result<(MpsDirectories, RunningDaemon)> {
        let dirs = self.directories(gpu_uuid)?;
        if let Some(running) = self.running(&dirs) {
            return Ok((dirs, running));
        }
        let running = self.start(&dirs).await?;
        Ok((dirs, running))
    }

    async fn start(&self, dirs: &MpsDirectories) -> Result<RunningDaemon> {
        let gpu = dirs.gpu_uuid();
        // No live daemon owns the pipe directory (ensure checked): what a dead one left there
        // (its PID file, naming a PID that may be a zombie or reused, and its sockets) would
        // make the new one believe it already runs.
        clear_directory(&dirs.pipe()).await.map_err(|error| {
            mps_error(
                gpu,
                format!("cannot clear the stale pipe directory: {error}"),
            )
        })?;
        // The shared-memory directory is the node's, kept when a daemon stops.
        for dir in [dirs.pipe(), dirs.log(), dirs.shm()] {
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(|e| Error::io("create MPS directory", &dir, e))?;
        }
        set_compute_mode(
            &self.settings.driver_root,
            gpu,
            ComputeMode::ExclusiveProcess,
        )
        .await?;
        let output = control(&self.settings.driver_root, dirs)
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| mps_error(gpu, format!("cannot run {CONTROL_PROGRAM}: {e}")))?;
        if !output.status.success() {
            return Err(mps_error(
                gpu,
                format!(
                    "{CONTROL_PROGRAM} -d failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                ),
            ));
        }
        self.running(dirs).ok_or_else(|| {
            mps_error(
                gpu,
                format!("{CONTROL_PROGRAM} -d returned but no daemon runs for its pipe directory"),
            )
        })
    }

    /// Stops the daemon of `gpu_uuid` (`quit`, then at most the stop timeout, then SIGKILL),
    /// removes its directories and puts the GPU back in compute mode `DEFAULT`. A GPU without
    /// a daemon only gets the clean-up.
    ///
    /// # Errors
    /// [`Error::Core`] for an invalid UUID; [`Error::Mps`] when the daemon survives SIGKILL.
    pub async fn stop(&self, gpu_uuid: &str) -> Result<()> {
        let dirs = self.directories(gpu_uuid)?;
        if let Some(running) = self.running(&dirs) {
            self.quit(&dirs).await;
            if !self.wait_gone(running.pid).await {
                tracing::warn!(
                    gpu = gpu_uuid,
                    pid = running.pid,
                    "MPS daemon ignored quit; killing it"
                );
                kill(running.pid);
                if !self.wait_gone(running.pid).await {
                    return Err(mps_error(
                        gpu_uuid,
                        format!("daemon {} survived SIGKILL", running.pid),
                    ));
                }
            }
        }
        clean_up(&self.settings.driver_root, &dirs).await;
        Ok(())
    }

    /// GPUs with a daemon directory under the MPS root, running or not.
    pub fn known_gpus(&self) -> Vec<String> {
        gpus_with_files(&self.settings.root)
    }

    async fn quit(&self, dirs: &MpsDirectories) {
        let deadline = tokio::time::Instant::now() + self.settings.stop_timeout;
        // A daemon that is already gone makes the client fail; the wait for it decides.
        if let Err(message) = send_quit(&self.settings.driver_root, dirs, deadline).await {
            tracing::debug!(gpu = dirs.gpu_uuid(), %message, "quit not delivered");
        }
    }

    async fn wait_gone(&self, pid: u32) -> bool {
        let deadline = tokio::time::Instant::now() + self.settings.stop_timeout;
        while tokio::time::Instant::now() < deadline {
            if !is_control_daemon(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        !is_control_daemon(pid)
    }
}

/// GPUs with a daemon directory under `root`, sorted.
pub(crate) fn gpus_with_files(root: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut gpus: Vec<String> = entries
        .filter_map(std::result::Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| kerf_core::names::gpu_uuid("mpsRoot", name).is_ok())
        .collect();
    gpus.sort();
    gpus
}

/// The daemon whose pipe directory is `pipe`, when its PID file names a live
/// `nvidia-cuda-mps-control` (not a zombie, not a reused PID).
pub fn daemon_in(pipe: &Path) -> Option<RunningDaemon> {
    let pid: u32 = std::fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    is_control_daemon(pid).then_some(RunningDaemon { pid })
}

/// Whether `pid` is a live process whose program is `nvidia-cuda-mps-control`: a PID file can
/// outlive its daemon and the PID be reused.
fn is_control_daemon(pid: u32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let program = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    Path::new(std::ffi::OsStr::new(&*String::from_utf8_lossy(program)))
        .file_name()
        .is_some_and(|name| name == CONTROL_PROGRAM)
        && !is_zombie(pid)
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|s| s == "Z"))
        })
        .unwrap_or(false)
}

fn kill(pid: u32) {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    if let Err(error) = rustix::process::kill_process(pid, rustix::process::Signal::KILL) {
        tracing::warn!(pid = pid.as_raw_nonzero().get(), %error, "cannot kill MPS daemon");
    }
}
