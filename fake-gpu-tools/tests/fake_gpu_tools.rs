//! The fake `nvidia-cuda-mps-control` and `nvidia-smi` behave as the module documentation of
//! `kerf_fake_gpu_tools` says, run as real processes from a mock driver root.
#![allow(
    clippy::unwrap_used,
    reason = "helpers outside #[test] functions fail the test the same way"
)]

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use kerf_fake_gpu_tools::{calls, fail_next_mps_start, install};

const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";

fn root() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("driver");
    install(&root, Path::new(env!("CARGO_BIN_EXE_kerf-fake-gpu-tools"))).unwrap();
    (dir, root)
}

fn mps_control(root: &Path, pipe: &Path, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(root.join("usr/bin/nvidia-cuda-mps-control"))
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", UUID)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", pipe.with_file_name("log"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn the_daemon_starts_once_answers_quit_and_every_call_is_recorded() {
    let (dir, root) = root();
    let pipe = dir.path().join("mps").join(UUID).join("pipe");

    let started = mps_control(&root, &pipe, &["-d"], "");
    assert!(started.status.success(), "{started:?}");
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    assert!(Path::new(&format!("/proc/{}", pid.trim())).exists());
    assert!(pipe.join("control").exists());

    let again = mps_control(&root, &pipe, &["-d"], "");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already running"));

    let quit = mps_control(&root, &pipe, &[], "quit\n");
    assert!(quit.status.success(), "{quit:?}");
    for _ in 0..500 {
        if !pid_file.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(!pid_file.exists(), "quit removes the PID file");
    let log = std::fs::read_to_string(pipe.with_file_name("log").join("control.log")).unwrap();
    assert!(log.contains("daemon stopped"), "{log}");

    let no_daemon = mps_control(&root, &pipe, &[], "quit\n");
    assert!(!no_daemon.status.success());

    let recorded = calls(&root);
    let tools: Vec<(&str, Vec<&str>)> = recorded
        .iter()
        .map(|c| (c.tool.as_str(), c.args.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        tools,
        [
            ("nvidia-cuda-mps-control", vec!["-d"]),
            ("mps-daemon", vec![]),
            ("nvidia-cuda-mps-control", vec!["-d"]),
            ("nvidia-cuda-mps-control", vec![]),
            ("nvidia-cuda-mps-control", vec![]),
        ]
    );
    assert_eq!(recorded[0].env["CUDA_VISIBLE_DEVICES"], UUID);
    assert_eq!(
        recorded[1].env["CUDA_MPS_PIPE_DIRECTORY"],
        pipe.to_string_lossy()
    );
    assert_eq!(recorded[3].stdin, "quit\n");
}

#[test]
fn a_start_can_be_made_to_fail_once() {
    let (dir, root) = root();
    let pipe = dir.path().join("pipe");
    fail_next_mps_start(&root, "NVML: GPU is lost").unwrap();
    let failed = mps_control(&root, &pipe, &["-d"], "");
    assert!(!failed.status.success());
    assert!(String::from_utf8_lossy(&failed.stderr).contains("GPU is lost"));
    assert!(!pipe.join("nvidia-cuda-mps-control.pid").exists());

    let started = mps_control(&root, &pipe, &["-d"], "");
    assert!(started.status.success(), "{started:?}");
    assert!(mps_control(&root, &pipe, &[], "quit\n").status.success());
}

#[test]
fn nvidia_smi_sets_compute_modes_and_time_slices() {
    let (_dir, root) = root();
    let smi = root.join("usr/bin/nvidia-smi");
    let run = |args: &[&str]| Command::new(&smi).args(args).output().unwrap();
    assert!(
        run(&["-i", UUID, "-c", "EXCLUSIVE_PROCESS"])
            .status
            .success()
    );
    assert!(
        run(&["compute-policy", "-i", UUID, "--set-timeslice", "3"])
            .status
            .success()
    );
    assert!(!run(&["--query"]).status.success());
    let recorded = calls(&root);
    assert_eq!(recorded.len(), 3);
    assert!(recorded.iter().all(|c| c.tool == "nvidia-smi"));
    assert_eq!(recorded[1].args[4], "3");
}

/// Waits (bounded: a hang guard, not a speed check) until `path` exists.
fn wait_for(path: &Path) {
    for _ in 0..2500 {
        if path.exists() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert!(path.exists(), "{} did not appear", path.display());
}

/// The first line of `path` once it is whole: the daemon creates the file before it writes its
/// PID (as a plain write does), so a reader can see it empty for a moment.
fn written_line(path: &Path) -> String {
    for _ in 0..2500 {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Some((line, _)) = text.split_once('\n')
        {
            return line.to_owned();
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.contains('\n'),
        "{} holds no whole line",
        path.display()
    );
    text.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn the_foreground_daemon_is_the_process_that_runs_it_and_exits_0_after_quit() {
    let (dir, root) = root();
    let pipe = dir.path().join("mps").join(UUID).join("pipe");
    let log = pipe.with_file_name("log");
    let daemon = Command::new(root.join("usr/bin/nvidia-cuda-mps-control"))
        .arg("-f")
        .env("CUDA_VISIBLE_DEVICES", UUID)
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &log)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let daemon_pid = daemon.id();
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    assert_eq!(
        written_line(&pid_file),
        daemon_pid.to_string(),
        "no fork: the PID file names the process that ran -f"
    );
    assert!(std::os::unix::net::UnixStream::connect(pipe.join("control")).is_ok());

    for refused in [["-f"], ["-d"]] {
        let again = mps_control(&root, &pipe, &refused, "");
        assert_eq!(again.status.code(), Some(1), "{refused:?}: {again:?}");
        assert!(String::from_utf8_lossy(&again.stderr).contains("already running"));
    }

    assert!(mps_control(&root, &pipe, &[], "quit\n").status.success());
    let ended = daemon.wait_with_output().unwrap();
    assert_eq!(ended.status.code(), Some(0), "{ended:?}");
    assert!(!pid_file.exists(), "quit removes the PID file");
    assert!(
        std::os::unix::net::UnixStream::connect(pipe.join("control")).is_err(),
        "nothing listens after quit"
    );
    let stdout = String::from_utf8_lossy(&ended.stdout);
    assert!(stdout.contains("daemon started"), "{stdout}");
    assert!(stdout.contains("daemon stopped"), "{stdout}");
    assert!(
        !log.join("control.log").exists(),
        "the foreground daemon logs to stdout"
    );

    let recorded = calls(&root);
    let tools: Vec<(&str, Vec<&str>)> = recorded
        .iter()
        .map(|c| (c.tool.as_str(), c.args.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        tools,
        [
            ("nvidia-cuda-mps-control", vec!["-f"]),
            ("nvidia-cuda-mps-control", vec!["-f"]),
            ("nvidia-cuda-mps-control", vec!["-d"]),
            ("nvidia-cuda-mps-control", vec![]),
        ],
        "one record per run; no separate daemon record without a fork"
    );
    assert_eq!(recorded[0].pid, daemon_pid);
    assert_eq!(recorded[0].env["CUDA_VISIBLE_DEVICES"], UUID);
}

#[test]
fn a_foreground_start_over_a_killed_daemons_leftovers_succeeds_and_can_be_made_to_fail() {
    let (dir, root) = root();
    let pipe = dir.path().join("pipe");
    let start = || {
        Command::new(root.join("usr/bin/nvidia-cuda-mps-control"))
            .arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", dir.path().join("log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let pid_file = pipe.join("nvidia-cuda-mps-control.pid");
    let mut killed = start();
    wait_for(&pid_file);
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(pid_file.exists(), "SIGKILL leaves the PID file");

    fail_next_mps_start(&root, "NVML: GPU is lost").unwrap();
    let failed = start().wait_with_output().unwrap();
    assert_eq!(failed.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&failed.stderr).contains("GPU is lost"));

    let daemon = start();
    for _ in 0..2500 {
        if std::fs::read_to_string(&pid_file)
            .unwrap_or_default()
            .trim()
            == daemon.id().to_string()
        {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap().trim(),
        daemon.id().to_string(),
        "a dead daemon's PID file does not stop a new one"
    );
    assert!(mps_control(&root, &pipe, &[], "quit\n").status.success());
    assert_eq!(daemon.wait_with_output().unwrap().status.code(), Some(0));
}
