//! One CUDA MPS control daemon per GPU that carries MPS slices: started before the first MPS
//! slice of a GPU is prepared, stopped after its last one is unprepared, adopted after a
//! plugin restart, and restarted (and reported) when it dies.
//!
//! Two ways to run them ([`ControlDaemons`], `--mps-daemons`):
//! - `PodDaemons` (`pod`, what the DaemonSet uses): one pod per GPU in the plugin's
//!   namespace, created through the API and run by the kubelet, so that deleting, upgrading
//!   or OOM-killing the plugin's pod never stops a daemon that prepared claims use — the
//!   design of NVIDIA's DRA driver, whose kubelet plugin creates its MPS control daemon as a
//!   Deployment from a template (`cmd/gpu-kubelet-plugin/sharing.go`,
//!   `MpsManager.EnsureStarted`, `templates/mps-control-daemon.tmpl.yaml` in
//!   `NVIDIA/k8s-dra-driver-gpu`);
//! - [`ProcessDaemons`] (`process`): daemonized children of the plugin, for a plugin without
//!   a cluster (`kerf demo`) or outside a container; in a container they die with it.
//!
//! Either way the daemon's files are the [`MpsDirectories`] under the MPS root, the GPU is in
//! compute mode `EXCLUSIVE_PROCESS` while it runs, and a running daemon has an
//! [`Incarnation`] that the checkpoint records, so that a replaced daemon is noticed even when
//! it was replaced while the plugin was down.

mod pod_spec;
mod pods;
mod processes;
pub(crate) mod tools;

use std::path::PathBuf;
use std::time::Duration;

use kerf_core::enforcement::ServerLimits;
use kerf_core::mps::{MpsClient, MpsDirectories, TimeSliceInterval, timeslice_args};

pub use pod_spec::{DaemonPodTemplate, daemon_pod_name};
pub(crate) use pods::PodDaemons;
pub use processes::{ProcessDaemons, RunningDaemon, daemon_in};

use crate::error::{Error, Result};

/// Where the daemons keep their files and which tools run them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsSettings {
    /// Root of the per-GPU directories, `/var/run/kerf/mps` by default.
    pub root: PathBuf,
    /// The driver root whose `usr/bin` holds `nvidia-cuda-mps-control` and `nvidia-smi`.
    pub driver_root: PathBuf,
    /// How long a daemon may take to stop after `quit` before it is killed.
    pub stop_timeout: Duration,
}

/// Which daemon serves a GPU: a new value whenever the daemon was replaced (a new process, a
/// restarted container, a new pod). Recorded in the checkpoint; opaque to everything else.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Incarnation(String);

impl Incarnation {
    /// A daemonized process.
    pub fn process(pid: u32) -> Self {
        Incarnation(format!("pid {pid}"))
    }

    /// A daemon pod's container after `restarts` restarts.
    pub fn pod(uid: &str, restarts: i32) -> Self {
        Incarnation(format!("pod {uid} restarts {restarts}"))
    }

    /// The value recorded in the checkpoint.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A value read back from the checkpoint.
    pub fn recorded(value: String) -> Self {
        Incarnation(value)
    }
}

impl std::fmt::Display for Incarnation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The node's control daemons, run one way or the other (see the module docs).
#[derive(Debug, Clone)]
pub enum ControlDaemons {
    /// Daemonized children of the plugin.
    Processes(ProcessDaemons),
    /// One pod per GPU, run by the kubelet.
    Pods(Box<PodDaemons>),
}

impl ControlDaemons {
    /// Where the daemons keep their files and which tools run them.
    pub fn settings(&self) -> &MpsSettings {
        match self {
            ControlDaemons::Processes(daemons) => daemons.settings(),
            ControlDaemons::Pods(daemons) => daemons.settings(),
        }
    }

    /// The directories of the daemon of `gpu_uuid`.
    ///
    /// # Errors
    /// [`Error::Core`] when `gpu_uuid` is not a GPU UUID.
    pub fn directories(&self, gpu_uuid: &str) -> Result<MpsDirectories> {
        Ok(MpsDirectories::new(&self.settings().root, gpu_uuid)?)
    }

    /// What a client container of the daemon of `gpu_uuid` is given. A daemon pod has its
    /// GPU's own shared-memory directory as `/dev/shm`; a daemonized process has the plugin's,
    /// which is the node-wide one.
    ///
    /// # Errors
    /// [`Error::Core`] when `gpu_uuid` is not a GPU UUID.
    pub fn client(&self, gpu_uuid: &str) -> Result<MpsClient> {
        let dirs = self.directories(gpu_uuid)?;
        Ok(match self {
            ControlDaemons::Processes(_) => dirs.client(),
            ControlDaemons::Pods(_) => dirs.client_with_gpu_shm(),
        })
    }

    /// The daemon serving `gpu_uuid` now, if one runs (or, for a pod, exists to be restarted
    /// by the kubelet).
    ///
    /// # Errors
    /// [`Error::Core`] for an invalid UUID; [`Error::Kube`] when the daemon pod cannot be read.
    pub async fn current(&self, gpu_uuid: &str) -> Result<Option<Incarnation>> {
        match self {
            ControlDaemons::Processes(daemons) => {
                let dirs = self.directories(gpu_uuid)?;
                Ok(daemons.running(&dirs).map(|d| Incarnation::process(d.pid)))
            }
            ControlDaemons::Pods(daemons) => daemons.current(gpu_uuid).await,
        }
    }

    /// Makes sure a daemon serves `gpu_uuid`: adopts the running one, else sets the compute
    /// mode and starts one, and returns once it accepts clients.
    ///
    /// # Errors
    /// [`Error::Mps`] naming the GPU and the tool's (or the pod's) own message when the
    /// compute mode cannot be set or the daemon does not start; nothing is left behind then.
    pub async fn ensure(&self, gpu_uuid: &str) -> Result<Incarnation> {
        match self {
            ControlDaemons::Processes(daemons) => {
                let (_, running) = daemons.ensure(gpu_uuid).await?;
                Ok(Incarnation::process(running.pid))
            }
            ControlDaemons::Pods(daemons) => daemons.ensure(gpu_uuid).await,
        }
    }

    /// As [`ControlDaemons::ensure`] for a GPU whose clients run (a dead daemon found by the
    /// periodic check): a failed start leaves the GPU's files, which their containers have
    /// mounted, for the next try.
    ///
    /// # Errors
    /// As [`ControlDaemons::ensure`].
    pub async fn restart(&self, gpu_uuid: &str) -> Result<Incarnation> {
        match self {
            ControlDaemons::Processes(daemons) => {
                let (_, running) = daemons.restart(gpu_uuid).await?;
                Ok(Incarnation::process(running.pid))
            }
            ControlDaemons::Pods(daemons) => daemons.restart(gpu_uuid).await,
        }
    }

    /// Stops the daemon of `gpu_uuid`, removes its directories and puts the GPU back in
    /// compute mode `DEFAULT`. A GPU without a daemon only gets the clean-up.
    ///
    /// # Errors
    /// [`Error::Mps`] when the daemon does not go away; nothing is cleaned up then.
    pub async fn stop(&self, gpu_uuid: &str) -> Result<()> {
        match self {
            ControlDaemons::Processes(daemons) => daemons.stop(gpu_uuid).await,
            ControlDaemons::Pods(daemons) => daemons.stop(gpu_uuid).await,
        }
    }

    /// The same daemons with their files under another MPS root: for stopping the daemons a
    /// plugin started before its root was changed.
    #[must_use]
    pub(crate) fn with_root(&self, root: PathBuf) -> Self {
        match self {
            ControlDaemons::Processes(daemons) => {
                ControlDaemons::Processes(daemons.with_root(root))
            }
            ControlDaemons::Pods(daemons) => {
                ControlDaemons::Pods(Box::new(daemons.with_root(root)))
            }
        }
    }

    /// GPUs with a daemon (or its directories) on this node, running or not.
    pub async fn known_gpus(&self) -> Vec<String> {
        match self {
            ControlDaemons::Processes(daemons) => daemons.known_gpus(),
            ControlDaemons::Pods(daemons) => daemons.known_gpus().await,
        }
    }

    /// Gives the daemon of `gpu_uuid` the server limits `limits` (see
    /// [`kerf_core::enforcement`]): as the defaults of its next server, and for the next
    /// clients of each running server; then reads the defaults back, so that a daemon that
    /// did not take them is an error rather than a limit believed held. `total_mib` is the
    /// GPU's memory, the limit that stands for "none".
    ///
    /// # Errors
    /// [`Error::Mps`] naming the GPU when the control client fails or the daemon reports
    /// other defaults than those set.
    pub(crate) async fn apply_server_limits(
        &self,
        gpu_uuid: &str,
        limits: ServerLimits,
        total_mib: u64,
    ) -> Result<()> {
        let settings = self.settings();
        let dirs = self.directories(gpu_uuid)?;
        let timeout = settings.stop_timeout;
        // Defaults first, then the servers: a server a client starts in between takes the
        // new defaults, and one that ran before is in the list.
        let mut commands = limits.default_commands(total_mib);
        commands.push("get_server_list".to_owned());
        let servers =
            tools::send_commands(&settings.driver_root, &dirs, &commands, timeout).await?;
        let mut commands = Vec::new();
        for pid in servers
            .lines()
            .filter_map(|line| line.trim().parse::<u32>().ok())
        {
            commands.extend(limits.server_commands(pid, total_mib));
        }
        commands.extend(READ_BACK.map(str::to_owned));
        let replies =
            tools::send_commands(&settings.driver_root, &dirs, &commands, timeout).await?;
        let read = read_back(&replies);
        let expected = (
            limits.pinned_mib.unwrap_or(total_mib),
            limits.thread_percentage.unwrap_or(100),
        );
        if read.is_some_and(|(mib, percent)| shown_as(expected.0, mib) && percent == expected.1) {
            Ok(())
        } else {
            Err(tools::mps_error(
                gpu_uuid,
                format!(
                    "the MPS control daemon did not take the server limits {} MiB, {} %: it answered {:?}",
                    expected.0,
                    expected.1,
                    replies.trim()
                ),
            ))
        }
    }

    /// Sets the time slice of `gpu_uuid` (`nvidia-smi compute-policy --set-timeslice`).
    ///
    /// # Errors
    /// [`Error::TimeSlice`] naming the GPU and `nvidia-smi`'s own message.
    pub(crate) async fn set_time_slice(
        &self,
        gpu_uuid: &str,
        interval: TimeSliceInterval,
    ) -> Result<()> {
        let root = &self.settings().driver_root;
        tools::smi(root, gpu_uuid, &timeslice_args(gpu_uuid, interval))
            .await
            .map_err(|error| match error {
                Error::Mps { gpu, message } => Error::TimeSlice { gpu, message },
                other => other,
            })
    }
}

/// The queries that end a limits change: the defaults as the daemon now has them.
const READ_BACK: [&str; 2] = [
    "get_default_device_pinned_mem_limit 0",
    "get_default_active_thread_percentage",
];

/// The pinned limit in MiB and the percentage of the last two lines of `replies` (the answers
/// to [`READ_BACK`]): a limit is printed with `M` or, from 1 GiB up, as whole GiB with `G`
/// (as drivers were seen to print it), a percentage as a decimal (`25.0`).
fn read_back(replies: &str) -> Option<(Shown, u8)> {
    let mut lines = replies
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .rev();
    let percent: f64 = lines.next()?.parse().ok()?;
    let limit = lines.next()?;
    let shown = if let Some(gib) = limit.strip_suffix('G') {
        Shown::Gib(gib.parse().ok()?)
    } else {
        Shown::Mib(limit.strip_suffix('M')?.parse().ok()?)
    };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0–100 checked.
    let percent = (0.0..=100.0)
        .contains(&percent)
        .then(|| percent.round() as u8)?;
    Some((shown, percent))
}

/// A pinned limit as the daemon prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    Mib(u64),
    Gib(u64),
}

/// Whether `mib` is printed as `shown`.
fn shown_as(mib: u64, shown: Shown) -> bool {
    match shown {
        Shown::Mib(value) => value == mib,
        Shown::Gib(value) => value == mib / 1024,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_back_takes_either_unit_and_a_decimal_percentage() {
        assert_eq!(read_back("\n10240M\n25.0\n"), Some((Shown::Mib(10240), 25)));
        assert_eq!(read_back("10G\n100.0"), Some((Shown::Gib(10), 100)));
        assert!(shown_as(10 * 1024 + 512, Shown::Gib(10)));
        assert!(!shown_as(10 * 1024, Shown::Mib(10)));
        assert_eq!(read_back("Invalid value\n25.0"), None);
        assert_eq!(read_back("10240M\n250.0"), None);
        assert_eq!(read_back(""), None);
    }
}
