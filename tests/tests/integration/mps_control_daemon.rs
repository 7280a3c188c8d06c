//! `kerf-kubelet-plugin mps-control-daemon`, the program of an MPS daemon pod, run
//! as a process (`kerf-test-plugin mps-control-daemon`, the same library code) with the fake
//! `nvidia-cuda-mps-control -f` of `kerf-fake-gpu-tools` in a mock driver root: the daemon
//! comes up and accepts connections, SIGTERM becomes `quit` and exit 0, a daemon that dies
//! ends the program non-zero (so that the kubelet restarts the container), a dead daemon's
//! leftovers do not stop a new start, a live one is never doubled, and bad flags are named.
//!
//! Waits are bounded hang guards, never assertions on speed.

use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use kerf_core::mps::PID_FILE;
use kerf_fake_gpu_tools::{Call, calls, install};

const PROGRAM: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");
const TOOLS: &str = env!("CARGO_BIN_EXE_kerf-test-gpu-tools");
const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";
const CONTROL: &str = "nvidia-cuda-mps-control";
/// How long anything may take before the test gives up on it (a hang guard).
const PATIENCE: Duration = Duration::from_secs(30);

/// A mock driver root with the fake tools and an MPS root, in a temporary directory.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new() -> Self {
        let node = Node {
            dir: tempfile::tempdir().unwrap(),
        };
        install(&node.tools_root(), Path::new(TOOLS)).unwrap();
        node
    }

    fn tools_root(&self) -> PathBuf {
        self.dir.path().join("tools")
    }

    fn mps_root(&self) -> PathBuf {
        self.dir.path().join("mps")
    }

    fn pipe(&self) -> PathBuf {
        self.mps_root().join(UUID).join("pipe")
    }

    fn flags(&self) -> Vec<String> {
        vec![
            format!("--gpu={UUID}"),
            format!("--mps-root={}", self.mps_root().display()),
            format!("--tools-root={}", self.tools_root().display()),
            "--stop-timeout=5s".to_owned(),
        ]
    }

    /// The program with `args` after `mps-control-daemon`, stderr captured.
    fn start(&self, args: &[String]) -> Program {
        self.start_with(args, &[])
    }

    fn start_with(&self, args: &[String], env: &[(&str, String)]) -> Program {
        let child = Command::new(PROGRAM)
            .arg("mps-control-daemon")
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("KERF_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Program {
            child: Some(child),
            pipe: self.pipe(),
        }
    }

    fn calls(&self) -> Vec<Call> {
        calls(&self.tools_root())
    }

    fn daemon_pid(&self) -> Option<u32> {
        pid_in(&self.pipe())
    }
}

/// A running `mps-control-daemon`; dropping it kills it and its daemon.
struct Program {
    child: Option<Child>,
    pipe: PathBuf,
}

impl Program {
    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits until the daemon accepts connections on its control socket.
    /// Until the daemon accepts connections and has written its PID file (the fake binds its
    /// socket first, so under load the file can come, or be half written, a moment later).
    fn wait_accepting(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        while UnixStream::connect(self.pipe.join("control")).is_err()
            || pid_in(&self.pipe).is_none()
        {
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "the program ended: {:?}", self.finish());
            assert!(Instant::now() < deadline, "the daemon never accepted");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, signal: &str) {
        kill(signal, self.pid());
    }

    /// Waits for the program to end (bounded) and returns its status and stderr.
    fn finish(&mut self) -> Output {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + PATIENCE;
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let output = child.wait_with_output().unwrap();
        assert!(
            Instant::now() <= deadline,
            "the program did not end: {output:?}"
        );
        output
    }
}

impl Drop for Program {
    /// A program that a failed test left running: its daemon is a real process in its own
    /// process group, which must not outlive the test. (A program that ended was either
    /// refused, leaving another's daemon alone, or took its daemon with it.)
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.kill();
        let _ = child.wait();
        if let Some(pid) = std::fs::read_to_string(self.pipe.join(PID_FILE))
            .ok()
            .and_then(|pid| pid.trim().parse::<u32>().ok())
        {
            kill("-9", pid);
        }
    }
}

/// The PID in the pipe directory's PID file, once it is written whole.
fn pid_in(pipe: &Path) -> Option<u32> {
    std::fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn kill(signal: &str, pid: u32) {
    let _ = Command::new("kill")
        .args([signal, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn parent_of(pid: u32) -> u32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn is_quit(call: &Call) -> bool {
    call.tool == CONTROL && call.args.is_empty() && call.stdin == "quit\n"
}

/// SIGTERM (to the program, or to its init) → `quit` through the control client → exit 0,
/// with nothing owning the pipe directory any more.
fn stops_on_sigterm(node: &Node, mut program: Program, foreground_child: bool) {
    program.wait_accepting();
    let daemon = node.daemon_pid().unwrap();
    if foreground_child {
        assert_eq!(
            parent_of(daemon),
            program.pid(),
            "the daemon runs in the foreground, as the program's child"
        );
    }
    assert!(node.mps_root().join(UUID).join("log").is_dir());
    assert!(
        !node.mps_root().join("shm").exists(),
        "shm is the plugin's to create"
    );

    program.signal("-TERM");
    let output = program.finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let recorded = node.calls();
    let quit = recorded.iter().find(|c| is_quit(c)).unwrap();
    assert_eq!(quit.env["CUDA_VISIBLE_DEVICES"], UUID);
    assert_eq!(
        quit.env["CUDA_MPS_PIPE_DIRECTORY"],
        node.pipe().to_string_lossy()
    );
    let started = recorded
        .iter()
        .find(|c| c.tool == CONTROL && c.args == ["-f"])
        .unwrap();
    assert_eq!(started.pid, daemon);
    assert!(
        !node.pipe().join(PID_FILE).exists(),
        "the daemon quit: no PID file"
    );
    assert!(
        UnixStream::connect(node.pipe().join("control")).is_err(),
        "nothing listens on the pipe directory"
    );
}

#[test]
fn sigterm_becomes_quit_and_the_program_exits_0() {
    let node = Node::new();
    let program = node.start(&node.flags());
    stops_on_sigterm(&node, program, true);
}

#[test]
fn behind_its_init_sigterm_still_becomes_quit_and_exit_0() {
    let node = Node::new();
    let mut flags = node.flags();
    flags.push("--init=always".to_owned());
    let program = node.start(&flags);
    stops_on_sigterm(&node, program, false);
}

#[test]
fn every_flag_is_also_an_environment_variable() {
    let node = Node::new();
    let env = [
        ("KERF_MPS_GPU", UUID.to_owned()),
        ("KERF_MPS_ROOT", node.mps_root().display().to_string()),
        (
            "KERF_GPU_TOOLS_ROOT",
            node.tools_root().display().to_string(),
        ),
        ("KERF_MPS_STOP_TIMEOUT", "5s".to_owned()),
    ];
    let program = node.start_with(&[], &env);
    stops_on_sigterm(&node, program, true);
}

#[test]
fn a_killed_daemon_ends_the_program_non_zero_and_its_leftovers_do_not_stop_the_next_start() {
    let node = Node::new();
    let mut first = node.start(&node.flags());
    first.wait_accepting();
    let killed = node.daemon_pid().unwrap();
    kill("-9", killed);
    let output = first.finish();
    assert_eq!(
        output.status.code(),
        Some(128 + 9),
        "the daemon's death, for the container's lastState: {}",
        stderr(&output)
    );
    assert!(
        stderr(&output).contains("exited without being asked"),
        "{}",
        stderr(&output)
    );
    assert!(!node.calls().iter().any(is_quit), "nobody asked it to quit");
    assert_eq!(
        node.daemon_pid(),
        Some(killed),
        "a killed daemon leaves its PID file (and socket) behind"
    );

    let mut second = node.start(&node.flags());
    second.wait_accepting();
    let restarted = node.daemon_pid().unwrap();
    assert_ne!(restarted, killed);
    second.signal("-TERM");
    assert_eq!(second.finish().status.code(), Some(0));
}

#[test]
fn a_live_daemon_is_never_started_twice() {
    let node = Node::new();
    let mut first = node.start(&node.flags());
    first.wait_accepting();
    let daemon = node.daemon_pid().unwrap();

    let output = node.start(&node.flags()).finish();
    assert_ne!(output.status.code(), Some(0));
    assert!(
        stderr(&output).contains("already serves"),
        "{}",
        stderr(&output)
    );
    assert_eq!(
        node.daemon_pid(),
        Some(daemon),
        "the first one is untouched"
    );
    assert!(UnixStream::connect(node.pipe().join("control")).is_ok());
    let starts = node
        .calls()
        .into_iter()
        .filter(|c| c.tool == CONTROL && c.args == ["-f"])
        .count();
    assert_eq!(starts, 1, "the second program never ran the tool");

    first.signal("-TERM");
    assert_eq!(first.finish().status.code(), Some(0));
}

#[test]
fn a_daemon_that_ignores_quit_is_killed_after_the_stop_timeout() {
    let node = Node::new();
    let mut flags = node.flags();
    flags.retain(|flag| !flag.starts_with("--stop-timeout="));
    flags.push("--stop-timeout=1s".to_owned());
    let mut program = node.start(&flags);
    program.wait_accepting();
    let daemon = node.daemon_pid().unwrap();
    // A stopped daemon takes the quit client's connection (the kernel's backlog) and never
    // answers, as a hung one would.
    kill("-STOP", daemon);
    program.signal("-TERM");
    let output = program.finish();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("killing it"),
        "{}",
        stderr(&output)
    );
    assert!(
        !Path::new(&format!("/proc/{daemon}")).exists()
            || std::fs::read_to_string(format!("/proc/{daemon}/stat"))
                .is_ok_and(|stat| stat.contains(") Z")),
        "the daemon is gone"
    );
    assert_eq!(
        node.daemon_pid(),
        None,
        "the killed daemon's PID file is removed"
    );
}

#[test]
fn bad_flags_are_named_with_their_values_and_fail() {
    let node = Node::new();
    let with = |flag: &str, value: &str| {
        let mut flags: Vec<String> = node
            .flags()
            .into_iter()
            .filter(|f| !f.starts_with(&format!("{flag}=")))
            .collect();
        flags.push(format!("{flag}={value}"));
        node.start(&flags).finish()
    };
    for (flag, value) in [
        ("--gpu", "GPU-not-hex"),
        ("--gpu", "0"),
        ("--mps-root", "relative/mps"),
        ("--tools-root", "relative/tools"),
    ] {
        let output = with(flag, value);
        let status: ExitStatus = output.status;
        assert!(
            status.code().is_some_and(|c| c != 0),
            "{flag}={value}: {status:?}, signal {:?}",
            status.signal()
        );
        let message = stderr(&output);
        assert!(
            message.contains(&format!("{flag} {value}")),
            "{flag}={value}: {message}"
        );
    }
    assert!(node.calls().is_empty(), "no tool ran");
    assert!(!node.mps_root().exists(), "nothing was created");
}
