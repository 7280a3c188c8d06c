//! The fake GPU tools of the `prepare` benchmark's MPS cases: `nvidia-smi` and
//! `nvidia-cuda-mps-control` of `kerf-fake-gpu-tools` in a GPU tools root of the benchmark
//! node, so that the plugin starts and adopts MPS control daemons as it does on a node; the
//! same two programs run directly, to say how much of a first MPS slice's prepare they are;
//! and a guard that no daemon outlives the benchmark.
//!
//! The tools are links to one multi-call program, which runs [`kerf_fake_gpu_tools::run`](fake_gpu_tools::run)
//! when it is run under a tool's name (argv\[0\]). By default that program is the running
//! executable: `kerf-bench` dispatches in its `main` ([`run_as_tool`]), and any other program
//! that runs `prepare` must do the same. [`PROGRAM_ENV`] names another program instead, e.g.
//! `target/release/kerf-fake-gpu-tools`. [`FakeGpuTools::check`] fails the benchmark with
//! that advice before anything is measured when the program does not answer as `nvidia-smi`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use kerf_core::mps::{
    CONTROL_PROGRAM, ComputeMode, MpsDirectories, QUIT_COMMAND, compute_mode_args,
};
use kerf_fake_gpu_tools as fake_gpu_tools;
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use crate::{Error, Result};

/// Environment variable naming the program the fake tools link to, instead of the running
/// executable.
pub const PROGRAM_ENV: &str = "KERF_BENCH_FAKE_GPU_TOOLS";
/// `nvidia-smi`, next to the control program in the tools root.
const SMI_PROGRAM: &str = "nvidia-smi";
/// The longest path a Unix socket can have (`sun_path` holds 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// A GPU UUID's length (`GPU-` and 36 characters), for the socket path check.
const GPU_UUID_LEN: usize = 40;
/// How long [`FakeGpuTools::kill_daemons`] waits for killed processes to disappear.
const KILL_WAIT: Duration = Duration::from_secs(2);

/// Runs the fake GPU tool that argv\[0\] names, if it names one, and returns its exit code.
/// A benchmark binary calls it first thing in `main` and exits with the code, so that it can
/// be the program behind the fake tools (it is started as `nvidia-smi`, as
/// `nvidia-cuda-mps-control`, and as the daemon that one starts).
pub fn run_as_tool() -> Option<i32> {
    let args: Vec<OsString> = std::env::args_os().collect();
    let name = Path::new(args.first()?).file_name()?;
    fake_gpu_tools::TOOLS
        .iter()
        .any(|tool| name == *tool)
        .then(|| fake_gpu_tools::run(args, std::io::stdin()))
}

/// The program the fake tools link to: [`PROGRAM_ENV`] when set, else the running executable.
///
/// # Errors
/// The running executable cannot be found, or the named program's path cannot be made
/// absolute (links must not depend on the working directory).
pub fn program() -> Result<PathBuf> {
    match std::env::var_os(PROGRAM_ENV) {
        Some(path) if !path.is_empty() => {
            std::path::absolute(&path).map_err(|e| Error::io("resolve", path, e))
        }
        _ => std::env::current_exe().map_err(|e| Error::io("find", "the running executable", e)),
    }
}

/// How long the two programs of a daemon start took, run directly
/// ([`FakeGpuTools::start_direct`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectStart {
    /// `nvidia-smi -i <uuid> -c EXCLUSIVE_PROCESS`, until it exited.
    pub smi: Duration,
    /// `nvidia-cuda-mps-control -d`, until it exited: the fake's returns once the daemon it
    /// started wrote its PID file, which it looks for every 5 ms.
    pub control: Duration,
}

impl DirectStart {
    /// Both programs.
    pub fn total(&self) -> Duration {
        self.smi + self.control
    }
}

/// The fake tools of one benchmark node, and the MPS root its daemons live under. Dropping it
/// kills every process still running as one of its tools (see [`FakeGpuTools::kill_daemons`]),
/// so that an error or a panic mid-benchmark leaves no daemon behind.
#[derive(Debug)]
pub struct FakeGpuTools {
    root: PathBuf,
    program: PathBuf,
    /// Holds the MPS root (`mps`) and the directories of the daemons started directly
    /// (`direct`); short and absolute, because the daemons' sockets live there.
    dir: tempfile::TempDir,
}

impl FakeGpuTools {
    /// Links the tools in `root/usr/bin` to `program` and makes a fresh MPS root in the
    /// system's temporary directory.
    ///
    /// # Errors
    /// The links or directories cannot be made, or the MPS root is too long for the daemons'
    /// sockets.
    pub fn install(root: &Path, program: &Path) -> Result<Self> {
        let root = std::path::absolute(root).map_err(|e| Error::io("resolve", root, e))?;
        fake_gpu_tools::install(&root, program).map_err(|e| Error::io("install", &root, e))?;
        let temp = std::env::temp_dir();
        let dir = tempfile::Builder::new()
            .prefix("kerf-bench-mps-")
            .tempdir_in(&temp)
            .map_err(|e| Error::io("create", &temp, e))?;
        let tools = FakeGpuTools {
            root,
            program: program.to_owned(),
            dir,
        };
        // `<mps root>/<uuid>/pipe/control`: a longer one would fail only inside the daemon.
        let socket = tools.mps_root().as_os_str().len() + GPU_UUID_LEN + "//pipe/control".len();
        if socket > MAX_SOCKET_PATH {
            return Err(tools.error(format!(
                "the MPS root {} leaves {socket} bytes for a daemon's socket, more than {MAX_SOCKET_PATH}; set TMPDIR to a shorter directory",
                tools.mps_root().display()
            )));
        }
        Ok(tools)
    }

    /// The GPU tools root to give the plugin (`PluginConfig::gpu_tools_root`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The MPS root to give the plugin (`PluginConfig::mps_root`).
    pub fn mps_root(&self) -> PathBuf {
        self.dir.path().join("mps")
    }

    fn direct_root(&self) -> PathBuf {
        self.dir.path().join("direct")
    }

    fn tool(&self, name: &str) -> PathBuf {
        self.root.join("usr/bin").join(name)
    }

    fn error(&self, message: String) -> Error {
        Error::FakeGpuTools {
            program: self.program.clone(),
            message,
        }
    }

    /// Checks that the program answers as `nvidia-smi` does (the fake's words), before
    /// anything is measured.
    ///
    /// # Errors
    /// [`Error::FakeGpuTools`] when it does not, with what it said.
    pub async fn check(&self, gpu_uuid: &str) -> Result<()> {
        let args = compute_mode_args(gpu_uuid, ComputeMode::Default);
        let output = self.run(&self.tool(SMI_PROGRAM), &args, &[]).await?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if output.status.success() && stdout.contains(gpu_uuid) {
            return Ok(());
        }
        Err(self.error(format!(
            "run as nvidia-smi it did not answer as kerf's fake ({}: {}{}); the program must call kerf_fake_gpu_tools::run when argv[0] names a tool, or set {PROGRAM_ENV} to one that does, e.g. target/release/kerf-fake-gpu-tools",
            output.status,
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }

    /// Runs what the plugin runs to start the daemon of `gpu_uuid` (`nvidia-smi -i <uuid> -c
    /// EXCLUSIVE_PROCESS`, then `nvidia-cuda-mps-control -d`, which returns once the daemon
    /// wrote its PID file), with the same arguments and environment, outside the plugin and
    /// in directories of its own; returns the time each took. Stop it with
    /// [`FakeGpuTools::quit_direct`].
    ///
    /// # Errors
    /// A program cannot be run or fails.
    pub async fn start_direct(&self, gpu_uuid: &str) -> Result<DirectStart> {
        let dirs = MpsDirectories::new(&self.direct_root(), gpu_uuid)?;
        for dir in [dirs.pipe(), dirs.log()] {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        }
        let smi_args = compute_mode_args(gpu_uuid, ComputeMode::ExclusiveProcess);
        let env = dirs.control_env();
        let started = Instant::now();
        let smi = self.run(&self.tool(SMI_PROGRAM), &smi_args, &[]).await?;
        let smi_done = Instant::now();
        let control = self
            .run(&self.tool(CONTROL_PROGRAM), &["-d".to_owned()], &env)
            .await?;
        let times = DirectStart {
            smi: smi_done - started,
            control: smi_done.elapsed(),
        };
        for (name, output) in [(SMI_PROGRAM, smi), (CONTROL_PROGRAM, control)] {
            if !output.status.success() {
                return Err(self.error(format!(
                    "{name} failed ({}): {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim()
                )));
            }
        }
        Ok(times)
    }

    /// Stops the daemon [`FakeGpuTools::start_direct`] started for `gpu_uuid` (`quit` on the
    /// control program's stdin, as the plugin stops one) and waits until its PID file is gone.
    ///
    /// # Errors
    /// The control program cannot be run, or the daemon does not stop.
    pub async fn quit_direct(&self, gpu_uuid: &str) -> Result<()> {
        let dirs = MpsDirectories::new(&self.direct_root(), gpu_uuid)?;
        let control = self.tool(CONTROL_PROGRAM);
        let mut child = Command::new(&control)
            .env_clear()
            .envs(dirs.control_env())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| Error::io("run", &control, e))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(QUIT_COMMAND.as_bytes())
                .await
                .map_err(|e| Error::io("write to", &control, e))?;
        }
        child
            .wait()
            .await
            .map_err(|e| Error::io("wait for", &control, e))?;
        // The daemon removes its PID file before it answers the client; waiting for it keeps
        // the next start from finding the old daemon.
        let deadline = Instant::now() + KILL_WAIT;
        while dirs.pid_file().exists() {
            if Instant::now() > deadline {
                return Err(self.error(format!("the daemon of {gpu_uuid} ignored quit")));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    async fn run(&self, program: &Path, args: &[String], env: &[(&str, String)]) -> Result<Output> {
        // As the plugin runs the tools: an empty environment but for the daemon's variables.
        Command::new(program)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| Error::io("run", program, e))
    }

    /// How many times the plugin ran `nvidia-cuda-mps-control -d`, by the fake's call log (the
    /// direct runs of [`FakeGpuTools::start_direct`] have pipe directories elsewhere).
    pub fn plugin_daemon_starts(&self) -> usize {
        let mps_root = self.mps_root();
        fake_gpu_tools::calls(&self.root)
            .iter()
            .filter(|c| c.tool == CONTROL_PROGRAM && c.args == ["-d"])
            .filter(|c| {
                c.env
                    .get("CUDA_MPS_PIPE_DIRECTORY")
                    .is_some_and(|pipe| Path::new(pipe).starts_with(&mps_root))
            })
            .count()
    }

    /// Waits a little for every process of [`FakeGpuTools::processes`] to exit on its own (a
    /// daemon told to quit exits just after it answers), then kills what is left; returns how
    /// many it had to kill.
    pub fn wait_for_exit(&self) -> usize {
        let deadline = Instant::now() + KILL_WAIT;
        while !self.processes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill_daemons()
    }

    /// The processes running as one of these tools: the daemons (which daemonize, so they are
    /// not this process's children) and any tool still running. Found by their argv\[0\], the
    /// tool's path, which lies in this benchmark's own fresh directory.
    pub fn processes(&self) -> Vec<u32> {
        let tools = [self.tool(CONTROL_PROGRAM), self.tool(SMI_PROGRAM)];
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .filter_map(std::result::Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                // A zombie's cmdline is empty, so it does not count: it runs nothing.
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                    let program = cmdline.split(|b| *b == 0).next().unwrap_or_default();
                    tools
                        .iter()
                        .any(|tool| tool.as_os_str().as_encoded_bytes() == program)
                })
            })
            .collect()
    }

    /// Kills (SIGKILL) every process of [`FakeGpuTools::processes`] and waits a little for
    /// them to go; returns how many there were.
    pub fn kill_daemons(&self) -> usize {
        let pids = self.processes();
        for &pid in &pids {
            if let Some(pid) = i32::try_from(pid)
                .ok()
                .and_then(rustix::process::Pid::from_raw)
            {
                // One that exited meanwhile is what we wanted.
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        let deadline = Instant::now() + KILL_WAIT;
        while !pids.is_empty() && !self.processes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        pids.len()
    }
}

impl Drop for FakeGpuTools {
    fn drop(&mut self) {
        let killed = self.kill_daemons();
        if killed > 0 && !std::thread::panicking() {
            eprintln!(
                "kerf-bench: killed {killed} fake GPU tool process(es) left under {}",
                self.root.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_that_is_not_multi_call_is_refused_before_measuring() {
        let dir = tempfile::tempdir().unwrap();
        let tools =
            FakeGpuTools::install(&dir.path().join("tools"), Path::new("/bin/true")).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let error = runtime
            .block_on(tools.check("GPU-00000000-0000-0000-0000-000000000000"))
            .unwrap_err();
        assert!(
            matches!(&error, Error::FakeGpuTools { message, .. } if message.contains(PROGRAM_ENV)),
            "{error}"
        );
        assert!(tools.processes().is_empty());
    }
}
