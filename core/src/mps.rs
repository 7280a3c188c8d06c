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
//! One daemon serves one GPU. A process can talk to one MPS server only, so a container of a
//! multi-GPU MPS claim gets every GPU's pipe directory mounted, each at its own path named in
//! `KERF_DEVICE_<KEY>_MPS_PIPE_DIRECTORY`, and `CUDA_MPS_PIPE_DIRECTORY` names the first
//! one: a launcher that runs one process per GPU sets each process's variable from those.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cdi::Mount;
use crate::error::Result;
use crate::names;

/// The control program, looked up in the driver root's binary directories.
pub const CONTROL_PROGRAM: &str = "nvidia-cuda-mps-control";
/// The command that stops a control daemon, written to the control program's stdin.
pub const QUIT_COMMAND: &str = "quit\n";
/// The file in the pipe directory that holds the running daemon's PID.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Where a client container sees the pipe directory of its (first) GPU.
pub const CONTAINER_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// Where a client container sees the pipe directories of all its GPUs, one per GPU UUID.
pub const CONTAINER_PIPE_ROOT: &str = "/run/kerf/mps";
/// Options of the client mounts: writable (clients create files there), no devices or setuid.
pub const CLIENT_MOUNT_OPTIONS: [&str; 4] = ["rw", "nosuid", "nodev", "bind"];
/// Default root of the per-GPU directories on the node.
pub const DEFAULT_MPS_ROOT: &str = "/var/run/kerf/mps";
/// The directories of one GPU's control daemon under the MPS root:
/// `<root>/<gpu-uuid>/{pipe,log,shm}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsDirectories {
    gpu_uuid: String,
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
            base: mps_root.join(uuid),
        })
    }

    /// The GPU the daemon serves.
    pub fn gpu_uuid(&self) -> &str {
        &self.gpu_uuid
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

    /// The shared-memory directory the daemon and its clients use as `/dev/shm`.
    pub fn shm(&self) -> PathBuf {
        self.base.join("shm")
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

    /// Where a client container sees this GPU's pipe directory besides
    /// [`CONTAINER_PIPE_DIRECTORY`]: `/run/kerf/mps/<gpu-uuid>`.
    pub fn container_pipe(&self) -> String {
        format!("{CONTAINER_PIPE_ROOT}/{}", self.gpu_uuid)
    }

    /// The mounts a client of this daemon needs: the pipe directory at its per-GPU path and,
    /// when `primary`, at [`CONTAINER_PIPE_DIRECTORY`] with the shared-memory directory at
    /// `/dev/shm` (a container has one `/dev/shm`, so it is shared with its first GPU's
    /// daemon).
    pub fn client_mounts(&self, primary: bool) -> Vec<Mount> {
        let mount = |host: PathBuf, container: String| Mount {
            host_path: path_string(&host),
            container_path: container,
            options: CLIENT_MOUNT_OPTIONS.map(str::to_owned).to_vec(),
            fs_type: None,
        };
        let mut mounts = vec![mount(self.pipe(), self.container_pipe())];
        if primary {
            mounts.push(mount(self.pipe(), CONTAINER_PIPE_DIRECTORY.to_owned()));
            mounts.push(mount(self.shm(), "/dev/shm".to_owned()));
        }
        mounts
    }
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
    pub fn as_arg(self) -> &'static str {
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
    pub fn as_arg(self) -> u8 {
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
        assert_eq!(dirs.shm().file_name().unwrap(), "shm");
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
    fn only_the_first_gpu_gives_the_container_its_pipe_and_shm() {
        let dirs = MpsDirectories::new(Path::new("/r"), UUID).unwrap();
        let first = dirs.client_mounts(true);
        let targets: Vec<&str> = first.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(
            targets,
            [
                format!("/run/kerf/mps/{UUID}").as_str(),
                CONTAINER_PIPE_DIRECTORY,
                "/dev/shm"
            ]
        );
        assert!(first.iter().all(|m| m.options.contains(&"rw".to_owned())));
        assert_eq!(dirs.client_mounts(false).len(), 1);
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
