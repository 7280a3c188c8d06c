//! CUDA MPS and time-slicing for shared GPUs: where one GPU's MPS control daemon keeps its
//! files, how it is started and stopped, what its clients need in their containers, and the
//! time-slice settings of `nvidia-smi compute-policy`.
//!
//! Facts this module relies on (NVIDIA's MPS documentation and NVIDIA's DRA driver,
//! `cmd/gpu-kubelet-plugin/sharing.go` and `nvlib.go` in `NVIDIA/k8s-dra-driver-gpu`):
//! - the control daemon is `nvidia-cuda-mps-control -d`; it serves the GPUs in its
//!   `CUDA_VISIBLE_DEVICES`, keeps its sockets in `CUDA_MPS_PIPE_DIRECTORY` (`control`,
//!   `control_privileged`, `log`) with its PID in `nvidia-cuda-mps-control.pid`, which
//!   disappears when it stops, and writes `control.log`/`server.log` to
//!   `CUDA_MPS_LOG_DIRECTORY`;
//! - it is stopped by writing `quit` to the stdin of `nvidia-cuda-mps-control` run with the
//!   same pipe directory;
//! - MPS needs the GPU in compute mode `EXCLUSIVE_PROCESS` (`nvidia-smi -i <uuid> -c
//!   EXCLUSIVE_PROCESS`), time-slicing in `DEFAULT`;
//! - clients find the server through `CUDA_MPS_PIPE_DIRECTORY` and share memory with it
//!   through `/dev/shm`, so a client container mounts the daemon's pipe directory and its
//!   shared-memory directory (NVIDIA mounts them at `/tmp/nvidia-mps` and `/dev/shm`);
//! - `nvidia-smi compute-policy -i <uuid> --set-timeslice <n>` takes 0 (default), 1 (short),
//!   2 (medium) or 3 (long).
//!
//! One daemon serves one GPU, so a client process sees exactly one GPU through it, as device
//! ordinal 0. Each MPS device of a claim therefore carries its whole client setup in its own
//! CDI edits ([`MpsClient`]): its pipe directory mounted at `/run/kerf/mps/<gpu-uuid>`,
//! `CUDA_MPS_PIPE_DIRECTORY` naming it, and the per-client limits of that device
//! (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`). A
//! container given several MPS devices gets every pipe directory, each also named in
//! `KERF_DEVICE_<KEY>_MPS_PIPE_DIRECTORY`; the unkeyed variables are those of the device the
//! runtime applied last, all three from that one device, so they never mix two daemons. A
//! launcher that runs one process per GPU sets each process's variables from the keyed ones.
//!
//! Shared memory: a client and its server share `/dev/shm`. A daemon run in its own pod has
//! its GPU's own `<mps-root>/<gpu-uuid>/shm` mounted there, and the clients of that GPU mount
//! the same directory ([`MpsDirectories::client_with_gpu_shm`]), so pods on different GPUs
//! share no memory directory (NVIDIA's DRA driver mounts one shm directory into its daemon
//! pod and its clients the same way, `GetCDIContainerEdits` in
//! `cmd/gpu-kubelet-plugin/sharing.go`). A daemonized child of the plugin inherits the
//! plugin's `/dev/shm`, the node-wide `<mps-root>/shm`, which its clients then mount
//! ([`MpsDirectories::client`]; NVIDIA's device plugin does the same with one `ShmDir` per
//! resource, `internal/plugin/mps.go` `updateReponse` in `NVIDIA/k8s-device-plugin`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::names;

/// The control program, looked up in the driver root's binary directories.
pub const CONTROL_PROGRAM: &str = "nvidia-cuda-mps-control";
/// The command that stops a control daemon, written to the control program's stdin.
pub const QUIT_COMMAND: &str = "quit\n";
/// The file in the pipe directory that holds the running daemon's PID.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Where a client container sees the pipe directories of its GPUs, one per GPU UUID.
pub const CONTAINER_PIPE_ROOT: &str = "/run/kerf/mps";
/// Where a client container sees the shared-memory directory.
pub const CONTAINER_SHM_DIRECTORY: &str = "/dev/shm";
/// The node-wide shared-memory directory's name under the MPS root.
pub const SHM_DIRECTORY_NAME: &str = "shm";
/// Options of the client mounts: writable (clients create files there), no devices or setuid.
pub(crate) const CLIENT_MOUNT_OPTIONS: [&str; 4] = ["rw", "nosuid", "nodev", "bind"];
/// Default root of the per-GPU directories on the node.
pub const DEFAULT_MPS_ROOT: &str = "/var/run/kerf/mps";

/// The directories of one GPU's control daemon under the MPS root:
/// `<root>/<gpu-uuid>/{pipe,log}`, and the node-wide `<root>/shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDirectories {
    gpu_uuid: String,
    root: PathBuf,
    base: PathBuf,
}

impl MpsDirectories {
    /// The directories of the daemon of `gpu_uuid` under `mps_root`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] when `gpu_uuid` is not a GPU UUID ([`names::gpu_uuid`]).
    pub fn new(mps_root: &Path, gpu_uuid: &str) -> Result<Self> {
        let uuid = names::gpu_uuid("gpuUUID", gpu_uuid)?;
        Ok(Self {
            gpu_uuid: uuid.to_owned(),
            root: mps_root.to_owned(),
            base: mps_root.join(uuid),
        })
    }

    /// The GPU the daemon serves.
    pub fn gpu_uuid(&self) -> &str {
        &self.gpu_uuid
    }

    /// The MPS root these directories are under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/<gpu-uuid>`: everything of this daemon, removed when it stops.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// The pipe directory (`CUDA_MPS_PIPE_DIRECTORY`).
    pub fn pipe(&self) -> PathBuf {
        self.base.join("pipe")
    }

    /// The log directory (`CUDA_MPS_LOG_DIRECTORY`).
    pub fn log(&self) -> PathBuf {
        self.base.join("log")
    }

    /// The node-wide shared-memory directory, `<root>/shm`: the `/dev/shm` of the plugin
    /// (and so of its daemons) and of every client.
    pub fn shm(&self) -> PathBuf {
        self.root.join(SHM_DIRECTORY_NAME)
    }

    /// The GPU's own shared-memory directory, `<root>/<gpu-uuid>/shm`: the `/dev/shm` of a
    /// daemon pod and of its clients.
    pub fn gpu_shm(&self) -> PathBuf {
        self.base.join(SHM_DIRECTORY_NAME)
    }

    /// The daemon's PID file.
    pub fn pid_file(&self) -> PathBuf {
        self.pipe().join(PID_FILE)
    }

    /// The environment of the control program, for starting and for stopping the daemon:
    /// only this GPU, this pipe directory and this log directory.
    pub fn control_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CUDA_VISIBLE_DEVICES", self.gpu_uuid.clone()),
            ("CUDA_MPS_PIPE_DIRECTORY", path_string(&self.pipe())),
            ("CUDA_MPS_LOG_DIRECTORY", path_string(&self.log())),
        ]
    }

    /// What a client container of a daemon that shares the node-wide shared-memory
    /// directory is given.
    pub fn client(&self) -> MpsClient {
        self.client_sharing(&self.shm())
    }

    /// What a client container of a daemon with its GPU's own shared-memory directory is
    /// given.
    pub fn client_with_gpu_shm(&self) -> MpsClient {
        self.client_sharing(&self.gpu_shm())
    }

    fn client_sharing(&self, shm: &Path) -> MpsClient {
        MpsClient {
            pipe_directory: path_string(&self.pipe()),
            shm_directory: path_string(shm),
            container_pipe_directory: format!("{CONTAINER_PIPE_ROOT}/{}", self.gpu_uuid),
        }
    }
}

/// What a container needs to be a client of one GPU's MPS control daemon: the host
/// directories to mount and where the pipe directory appears (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsClient {
    /// The daemon's pipe directory on the host.
    pub pipe_directory: String,
    /// The shared-memory directory on the host (the node-wide one or the GPU's own), mounted
    /// at `/dev/shm`.
    pub shm_directory: String,
    /// Where the container sees the pipe directory: `/run/kerf/mps/<gpu-uuid>`, the value of
    /// `CUDA_MPS_PIPE_DIRECTORY`.
    pub container_pipe_directory: String,
}

fn path_string(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// The compute mode a GPU needs for a sharing strategy (`nvidia-smi -c`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeMode {
    /// Several processes may use the GPU: the default, and what time-slicing needs.
    Default,
    /// One process (the MPS server) owns the GPU: what MPS needs.
    ExclusiveProcess,
}

impl ComputeMode {
    /// The `nvidia-smi -c` argument.
    fn as_arg(self) -> &'static str {
        match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
        }
    }
}

/// The `nvidia-smi -i <uuid> -c <mode>` arguments.
pub fn compute_mode_args(gpu_uuid: &str, mode: ComputeMode) -> Vec<String> {
    vec![
        "-i".to_owned(),
        gpu_uuid.to_owned(),
        "-c".to_owned(),
        mode.as_arg().to_owned(),
    ]
}

/// How long each process runs on a time-sliced GPU before the next one
/// (`nvidia-smi compute-policy --set-timeslice`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    /// The driver's default.
    #[default]
    Default,
    /// Short slices: lower latency for interactive work, more switching.
    Short,
    /// Medium slices.
    Medium,
    /// Long slices: throughput for batch work.
    Long,
}

impl TimeSliceInterval {
    /// The value `--set-timeslice` takes.
    fn as_arg(self) -> u8 {
        match self {
            TimeSliceInterval::Default => 0,
            TimeSliceInterval::Short => 1,
            TimeSliceInterval::Medium => 2,
            TimeSliceInterval::Long => 3,
        }
    }
}

/// The `nvidia-smi compute-policy -i <uuid> --set-timeslice <n>` arguments.
pub fn timeslice_args(gpu_uuid: &str, interval: TimeSliceInterval) -> Vec<String> {
    vec![
        "compute-policy".to_owned(),
        "-i".to_owned(),
        gpu_uuid.to_owned(),
        "--set-timeslice".to_owned(),
        interval.as_arg().to_string(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";

    #[test]
    fn directories_are_per_gpu_under_the_root() {
        let dirs = MpsDirectories::new(Path::new("/var/run/kerf/mps"), UUID).unwrap();
        assert_eq!(
            dirs.pipe(),
            Path::new("/var/run/kerf/mps").join(UUID).join("pipe")
        );
        assert_eq!(dirs.log().file_name().unwrap(), "log");
        assert_eq!(dirs.shm(), Path::new("/var/run/kerf/mps/shm"));
        assert_eq!(dirs.pid_file().file_name().unwrap(), PID_FILE);
        let env = dirs.control_env();
        assert_eq!(env[0], ("CUDA_VISIBLE_DEVICES", UUID.to_owned()));
        assert_eq!(env[1].1, path_string(&dirs.pipe()));
        assert_eq!(env[2].1, path_string(&dirs.log()));
    }

    #[test]
    fn hostile_or_mig_uuids_never_name_a_directory() {
        for bad in [
            "",
            "GPU-",
            "GPU-../../etc",
            "GPU-abc/def",
            "MIG-2f4e0e00-e140-bcbd-d4fd-278c95116d02",
            "gpu-2f4e",
            "GPU-2f4e\0",
            &format!("GPU-{}", "a".repeat(64)),
        ] {
            let error = MpsDirectories::new(Path::new("/r"), bad).unwrap_err();
            assert!(error.to_string().contains("gpuUUID"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn a_daemon_pods_client_gets_its_gpus_own_shm() {
        let dirs = MpsDirectories::new(Path::new("/r"), UUID).unwrap();
        let client = dirs.client_with_gpu_shm();
        assert_eq!(client.shm_directory, format!("/r/{UUID}/shm"));
        assert_eq!(client.pipe_directory, dirs.client().pipe_directory);
        assert!(
            dirs.gpu_shm().starts_with(dirs.base()),
            "removed with the daemon's files"
        );
    }

    #[test]
    fn a_client_gets_its_gpus_pipe_and_the_node_wide_shm() {
        let dirs = MpsDirectories::new(Path::new("/r"), UUID).unwrap();
        let client = dirs.client();
        assert_eq!(client.pipe_directory, format!("/r/{UUID}/pipe"));
        assert_eq!(client.shm_directory, "/r/shm");
        assert_eq!(
            client.container_pipe_directory,
            format!("/run/kerf/mps/{UUID}")
        );
    }

    #[test]
    fn nvidia_smi_arguments() {
        assert_eq!(
            compute_mode_args(UUID, ComputeMode::ExclusiveProcess),
            ["-i", UUID, "-c", "EXCLUSIVE_PROCESS"]
        );
        assert_eq!(
            timeslice_args(UUID, TimeSliceInterval::Long),
            ["compute-policy", "-i", UUID, "--set-timeslice", "3"]
        );
        assert_eq!(TimeSliceInterval::default().as_arg(), 0);
    }
}
