//! Fake `nvidia-cuda-mps-control` and `nvidia-smi` for machines without a GPU, and a fake CUDA
//! program under MPS (`kerf-fake-cuda-client`): one program (`kerf-fake-gpu-tools`) that acts
//! as any of them, chosen by the name it is run as, installed into an explicit mock driver root
//! as `<root>/usr/bin/<tool>` symlinks ([`install`], every name of [`TOOLS`]).
//!
//! Used by kerf's tests, by the image (a mock driver root at `/opt/kerf/mock-driver` for the
//! kubelet plugin's mock mode, `--mock-driver-root`) and by `kerf demo`. They never stand in
//! for a real GPU: a mock driver root is only ever given to a plugin with a mock inventory.
//!
//! What they imitate (NVIDIA's MPS documentation; the pipe directory of a running daemon as
//! NVIDIA's device plugin documents it: `control`, `control_privileged`, `log`,
//! `nvidia-cuda-mps-control.pid`):
//! - `nvidia-cuda-mps-control -d` starts a daemon in the background and returns once it runs
//!   ("Start daemon in background process", NVIDIA MPS docs, Common Tasks). It daemonizes as
//!   the real one was seen to on an H100 (each start left a `[nvidia-cuda-mps]
//!   <defunct>` under a PID 1 that does not reap): a double fork. `-d` runs an intermediate
//!   process that calls `setsid` and starts the daemon, then exits at once; `-d` reaps the
//!   intermediate and waits for the daemon's PID file. The daemon is thus an orphan from its
//!   first instant, re-parented to the nearest child subreaper or PID 1, which must reap it
//!   after `quit` (the caller of `-d` never can). Without `unsafe` there is no `fork()`, so each
//!   "fork" is a fresh run of this program with a hidden argument; what matters for reaping
//!   (whose child the daemon is) is the same.
//!   The daemon takes `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`) and
//!   `CUDA_MPS_LOG_DIRECTORY` (default `/var/log/nvidia-mps`), creates both, listens on
//!   `<pipe>/control`, writes its PID to `<pipe>/nvidia-cuda-mps-control.pid` and a line to
//!   `<log>/control.log`. A second `-d` on the same pipe directory fails as the real one does.
//! - `nvidia-cuda-mps-control -f` is the same daemon in the foreground ("Start daemon in
//!   foreground", NVIDIA MPS docs, Common Tasks; NVIDIA/k8s-dra-driver's
//!   `templates/mps-control-daemon.tmpl.yaml` ran it so as a Deployment's container, with a
//!   startup probe on `<pipe>/control`): no fork, so the process that runs `-f` is the daemon.
//!   What the real one does, as run on an H200 (driver 580.159.04, MPS control binary 13000):
//!   it writes its own PID to `<pipe>/nvidia-cuda-mps-control.pid` as `-d`'s daemon
//!   does (NVIDIA's MPS docs: "the control daemon creates a nvidia-cuda-mps-control.pid file
//!   that contains the PID of the control daemon process in the CUDA_MPS_PIPE_DIRECTORY", for
//!   either mode) and listens on `<pipe>/control`; it prints its log lines on stdout instead of
//!   `<log>/control.log` (which it does not create); a second `-f` or a `-d` on the same pipe
//!   directory fails with "An instance of this daemon is already running" (exit 1); after
//!   `quit` it exits 0 having removed its PID file but left its socket files (which then refuse
//!   connections); SIGTERM ends it by the default action (exit 143) with its PID file left, as
//!   does SIGKILL, and a new `-f` over those leftovers starts. The fake does all of that; it
//!   removes `control` on `quit` in `-d` mode only, as it always has.
//! - `nvidia-cuda-mps-control` without arguments is the client: it sends each line of its
//!   stdin to the daemon of its pipe directory and prints the replies; `quit` stops the daemon,
//!   which removes its PID file and socket. Without a daemon it fails.
//! - The daemon keeps the MPS limits NVIDIA documents for its commands (the default and
//!   per-server active thread percentage and pinned device memory limits, `get_server_list`):
//!   a server, started for the first client, takes the defaults of that moment. Malformed
//!   commands get an error line. Protocol, replies and the fake server PID: `src/mps_server.rs`.
//! - `kerf-fake-cuda-client [--alloc <N>G|<N>M] [--device <uuid>]` is a CUDA program under MPS:
//!   it gets its server's limits from the daemon, lowers them by its own
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (which can
//!   never raise them), prints them as JSON and fails an allocation above its memory limit
//!   (`src/cuda_client.rs`).
//! - `nvidia-smi -i <uuid> -c <mode>` and `nvidia-smi compute-policy -i <uuid>
//!   --set-timeslice <n>` succeed and print what they set; other arguments fail.
//! - `nvidia-smi mig -lgi|-lci|-dci|-dgi` list and destroy the emulated MIG instances of
//!   [`mig::MockMig`] (state shared through `<root>/kerf-fake-tools/mig-state.json`).
//!
//! Every run appends one JSON line to `<root>/kerf-fake-tools/calls.jsonl` ([`calls`]): the
//! tool, its arguments, its `CUDA_*` environment and its stdin. A test makes the next daemon
//! start fail by writing the message to `<root>/kerf-fake-tools/fail-mps-start`
//! ([`fail_next_mps_start`]).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead as _, BufReader, Read, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::mps_server::ControlState;

mod cuda_client;
pub mod mig;
mod mps_server;
mod smi_mig;

/// The tools this program can be.
pub const TOOLS: [&str; 3] = ["nvidia-cuda-mps-control", "nvidia-smi", cuda_client::NAME];
/// The hidden argument the background daemon is started with.
const DAEMON_ARG: &str = "--kerf-fake-daemon";
/// The hidden argument of the intermediate process of the double fork: it starts the daemon
/// in a new session and exits without waiting for it.
const DAEMONIZE_ARG: &str = "--kerf-fake-daemonize";
/// Where the fake keeps its call log and switches, under the driver root.
const STATE_DIR: &str = "kerf-fake-tools";
/// How long `-d` waits for the daemon to write its PID file.
const START_TIMEOUT: Duration = Duration::from_secs(5);

/// One recorded run of a fake tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    /// `nvidia-cuda-mps-control`, `nvidia-smi`, `kerf-fake-cuda-client`, or `mps-daemon` for
    /// the background daemon.
    pub tool: String,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// The `CUDA_*` variables it ran with.
    pub env: BTreeMap<String, String>,
    /// What it read from stdin (the control client only).
    pub stdin: String,
    /// Its process ID.
    pub pid: u32,
}

/// Makes `root` a mock driver root: links `<root>/usr/bin/<tool>` to `program` for every tool
/// of [`TOOLS`] (replacing what is there) and creates `<root>/kerf-fake-tools` for the call
/// log, creating the directories. Give `root` to the kubelet plugin as `--mock-driver-root`.
///
/// `program` must be an executable that hands its arguments to [`run`] when it is run under a
/// tool's name: the `kerf-fake-gpu-tools` binary, or a program of the caller's own (such as
/// the `kerf` CLI) whose `main` does that. It is linked, not copied, so it must stay where it
/// is for as long as the root is used; an absolute path keeps the links valid from any
/// working directory.
///
/// # Errors
/// The directories or links cannot be created.
pub fn install(root: &Path, program: &Path) -> std::io::Result<()> {
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&bin)?;
    std::fs::create_dir_all(root.join(STATE_DIR))?;
    for tool in TOOLS {
        let link = bin.join(tool);
        match std::fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::os::unix::fs::symlink(program, &link)?;
    }
    Ok(())
}

/// Every recorded call under the driver root `root`, oldest first.
pub fn calls(root: &Path) -> Vec<Call> {
    let Ok(text) = std::fs::read_to_string(root.join(STATE_DIR).join("calls.jsonl")) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// Makes the next daemon start under `root` fail with `message` on stderr.
///
/// # Errors
/// The switch file cannot be written.
pub fn fail_next_mps_start(root: &Path, message: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(root.join(STATE_DIR))?;
    std::fs::write(root.join(STATE_DIR).join("fail-mps-start"), message)
}

/// Runs the tool named by `args[0]` (or by `args[1]` when run under its own name) and returns
/// the exit code.
pub fn run(args: Vec<OsString>, stdin: impl Read) -> i32 {
    let mut args: Vec<String> = args
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let Some(program) = args.first().cloned() else {
        eprintln!("kerf-fake-gpu-tools: no program name");
        return 2;
    };
    let mut tool = base_name(&program);
    if !TOOLS.contains(&tool.as_str()) && args.len() > 1 && TOOLS.contains(&args[1].as_str()) {
        args.remove(0);
        tool.clone_from(&args[0]);
    }
    let root = driver_root(&args[0]);
    let rest = args[1..].to_vec();
    match tool.as_str() {
        "nvidia-cuda-mps-control" if rest.first().map(String::as_str) == Some(DAEMON_ARG) => {
            daemon(&root)
        }
        "nvidia-cuda-mps-control" if rest.first().map(String::as_str) == Some(DAEMONIZE_ARG) => {
            daemonize(&args[0])
        }
        "nvidia-cuda-mps-control" => mps_control(&root, &args[0], &rest, stdin),
        "nvidia-smi" => {
            record(&root, "nvidia-smi", &rest, "");
            if rest.first().map(String::as_str) == Some("mig") {
                let words: Vec<&str> = rest[1..].iter().map(String::as_str).collect();
                return smi_mig::run(&root, &words);
            }
            nvidia_smi(&rest)
        }
        cuda_client::NAME => cuda_client::run(&root, &rest),
        other => {
            eprintln!("kerf-fake-gpu-tools: run as one of {TOOLS:?} (a symlink), not {other:?}");
            2
        }
    }
}

fn base_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `<root>` of `<root>/usr/bin/<tool>` (or `<root>/bin/<tool>`); the program's directory
/// otherwise.
fn driver_root(program: &str) -> PathBuf {
    let path = Path::new(program);
    let dir = path.parent().unwrap_or(Path::new("."));
    if dir.ends_with("usr/bin") {
        dir.parent()
            .and_then(Path::parent)
            .unwrap_or(dir)
            .to_path_buf()
    } else if dir.ends_with("bin") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

fn cuda_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("CUDA_"))
        .collect()
}

fn record(root: &Path, tool: &str, args: &[String], stdin: &str) {
    let call = Call {
        tool: tool.to_owned(),
        args: args.to_vec(),
        env: cuda_env(),
        stdin: stdin.to_owned(),
        pid: std::process::id(),
    };
    let Ok(mut line) = serde_json::to_string(&call) else {
        return;
    };
    line.push('\n');
    let dir = root.join(STATE_DIR);
    let _ = std::fs::create_dir_all(&dir);
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("calls.jsonl"))
    {
        // One write per line: appends of concurrent tools do not interleave.
        let _ = file.write_all(line.as_bytes());
    }
}

fn pipe_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map_or_else(|| PathBuf::from("/tmp/nvidia-mps"), PathBuf::from)
}

fn log_dir() -> PathBuf {
    std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        .map_or_else(|| PathBuf::from("/var/log/nvidia-mps"), PathBuf::from)
}

fn pid_file(pipe: &Path) -> PathBuf {
    pipe.join("nvidia-cuda-mps-control.pid")
}

fn running_pid(pipe: &Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(pid_file(pipe))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
}

fn mps_control(root: &Path, program: &str, args: &[String], mut stdin: impl Read) -> i32 {
    if args.iter().any(|a| a == "-d") {
        record(root, "nvidia-cuda-mps-control", args, "");
        return start_daemon(root, program);
    }
    if args.iter().any(|a| a == "-f") {
        record(root, "nvidia-cuda-mps-control", args, "");
        return foreground(root);
    }
    let mut input = String::new();
    let _ = stdin.read_to_string(&mut input);
    record(root, "nvidia-cuda-mps-control", args, &input);
    let socket = pipe_dir().join("control");
    for command in input.lines().map(str::trim).filter(|c| !c.is_empty()) {
        let reply = UnixStream::connect(&socket).and_then(|mut stream| {
            stream.write_all(format!("{command}\n").as_bytes())?;
            stream.shutdown(std::net::Shutdown::Write)?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply)?;
            Ok(reply)
        });
        match reply {
            Ok(reply) => print!("{reply}"),
            Err(error) => {
                eprintln!(
                    "Cannot find MPS control daemon process ({}: {error})",
                    socket.display()
                );
                return 1;
            }
        }
    }
    0
}

/// Why a daemon must not start: the switch of [`fail_next_mps_start`] (consumed), or a live
/// daemon that owns the pipe directory. Prints the message as the real tool does.
fn refuse_start(root: &Path, pipe: &Path) -> bool {
    let switch = root.join(STATE_DIR).join("fail-mps-start");
    if let Ok(message) = std::fs::read_to_string(&switch) {
        let _ = std::fs::remove_file(&switch);
        eprintln!("{}", message.trim());
        return true;
    }
    if running_pid(pipe).is_some() {
        eprintln!("An instance of this daemon is already running");
        return true;
    }
    false
}

fn start_daemon(root: &Path, program: &str) -> i32 {
    let pipe = pipe_dir();
    if refuse_start(root, &pipe) {
        return 1;
    }
    // The first fork: the intermediate, which this process waits for (as the real `-d` does
    // for its first child; only the daemon is left to whoever adopts it).
    let intermediate = Command::new(program)
        .arg(DAEMONIZE_ARG)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match intermediate {
        Ok(status) if status.success() => {}
        Ok(status) => {
            eprintln!("cannot start the daemon: the intermediate process failed ({status})");
            return 1;
        }
        Err(error) => {
            eprintln!("cannot start the daemon: {error}");
            return 1;
        }
    }
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        if running_pid(&pipe).is_some() {
            return 0;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    eprintln!("the daemon did not start within {START_TIMEOUT:?}");
    1
}

/// The intermediate of the double fork: a new session (no controlling terminal, no signal of
/// the caller's terminal or process group reaches the daemon), the daemon started in it, and
/// an exit without waiting, which leaves the daemon an orphan.
fn daemonize(program: &str) -> i32 {
    if let Err(error) = rustix::process::setsid() {
        eprintln!("cannot start the daemon: setsid: {error}");
        return 1;
    }
    match Command::new(program)
        .arg(DAEMON_ARG)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(_daemon) => 0,
        Err(error) => {
            eprintln!("cannot start the daemon: {error}");
            1
        }
    }
}

/// How a daemon runs: started by `-d` (the background daemon) or `-f` (in the foreground).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Logs to `<log>/control.log`; removes its socket on `quit`.
    Background,
    /// Logs to stdout; leaves its socket file on `quit`, as the real `-f` was seen to.
    Foreground,
}

/// The background daemon, started by the double fork of `-d`.
fn daemon(root: &Path) -> i32 {
    record(root, "mps-daemon", &[], "");
    serve(&pipe_dir(), &log_dir(), Mode::Background)
}

/// `-f`: the refusals of `-d`, then this process is the daemon until `quit`.
fn foreground(root: &Path) -> i32 {
    let pipe = pipe_dir();
    if refuse_start(root, &pipe) {
        return 1;
    }
    serve(&pipe, &log_dir(), Mode::Foreground)
}

/// Creates the pipe and log directories, listens on `<pipe>/control`, writes the PID file and
/// answers commands until `quit`.
fn serve(pipe: &Path, log: &Path, mode: Mode) -> i32 {
    if std::fs::create_dir_all(pipe).is_err() || std::fs::create_dir_all(log).is_err() {
        return 1;
    }
    let socket = pipe.join("control");
    let _ = std::fs::remove_file(&socket);
    let Ok(listener) = UnixListener::bind(&socket) else {
        return 1;
    };
    let _ = std::fs::write(pid_file(pipe), format!("{}\n", std::process::id()));
    let say = |message: &str| match mode {
        Mode::Background => append_log(log, message),
        // Not `println!`: a closed stdout must not end the daemon.
        Mode::Foreground => {
            let _ = writeln!(std::io::stdout(), "[pid {}] {message}", std::process::id());
        }
    };
    say("daemon started");
    let mut state = ControlState::new(std::process::id());
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut line = String::new();
        let _ = BufReader::new(&stream).read_line(&mut line);
        let command = line.trim();
        say(&format!("command {command}"));
        if command == "quit" {
            let _ = std::fs::remove_file(pid_file(pipe));
            if mode == Mode::Background {
                let _ = std::fs::remove_file(&socket);
            }
            say("daemon stopped");
            return 0;
        }
        let server = state.server_pid();
        let reply = state.answer(command);
        if let Some(pid) = state.server_pid().filter(|pid| server != Some(*pid)) {
            say(&format!("Starting new server {pid}"));
        }
        if !reply.is_empty() {
            let _ = writeln!(stream, "{reply}");
        }
    }
    0
}

fn append_log(dir: &Path, message: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("control.log"))
    {
        let _ = writeln!(file, "[pid {}] {message}", std::process::id());
    }
}

fn nvidia_smi(args: &[String]) -> i32 {
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["-i", uuid, "-c", mode] => {
            println!("Compute mode for GPU {uuid} set to {mode}.");
            0
        }
        ["compute-policy", "-i", uuid, "--set-timeslice", value] => {
            println!("Set time slice of GPU {uuid} to {value}.");
            0
        }
        _ => {
            eprintln!("kerf-fake-gpu-tools: nvidia-smi {args:?} is not imitated");
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_root_is_above_usr_bin() {
        assert_eq!(driver_root("/r/usr/bin/nvidia-smi"), Path::new("/r"));
        assert_eq!(driver_root("/r/bin/nvidia-smi"), Path::new("/r"));
        assert_eq!(driver_root("/x/nvidia-smi"), Path::new("/x"));
    }

    #[test]
    fn nvidia_smi_accepts_only_what_kerf_runs() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(nvidia_smi(&args(&["-i", "GPU-1", "-c", "DEFAULT"])), 0);
        assert_eq!(
            nvidia_smi(&args(&[
                "compute-policy",
                "-i",
                "GPU-1",
                "--set-timeslice",
                "2"
            ])),
            0
        );
        assert_eq!(nvidia_smi(&args(&["-q"])), 2);
    }
}
