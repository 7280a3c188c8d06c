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

/// A daemon started with `-d` under its own pipe directory, stopped with `quit` when dropped
/// (also when a test fails, so that no daemon outlives it).
struct Daemon {
    root: PathBuf,
    pipe: PathBuf,
}

impl Daemon {
    fn start(root: &Path, dir: &Path) -> Self {
        let pipe = dir.join("mps").join(UUID).join("pipe");
        let started = mps_control(root, &pipe, &["-d"], "");
        assert!(started.status.success(), "{started:?}");
        Self {
            root: root.to_path_buf(),
            pipe,
        }
    }

    /// Sends `commands` (one a line) through the control client; its stdout.
    fn send(&self, commands: &str) -> String {
        let output = mps_control(&self.root, &self.pipe, &[], commands);
        assert!(output.status.success(), "{commands}: {output:?}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// Runs the fake CUDA client with `args` and only the `env` of the client's own limits.
    fn client(&self, args: &[&str], env: &[(&str, &str)]) -> (Output, serde_json::Value) {
        client(&self.root, &self.pipe, args, env)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = mps_control(&self.root, &self.pipe, &[], "quit\n");
    }
}

fn client(
    root: &Path,
    pipe: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Output, serde_json::Value) {
    let output = Command::new(root.join("usr/bin/kerf-fake-cuda-client"))
        .args(args)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&output.stdout);
    let json = serde_json::from_str(line.trim()).unwrap_or(serde_json::Value::Null);
    (output, json)
}

/// (thread percentage, pinned memory limit in MiB or null) a client ran with.
fn limits(json: &serde_json::Value) -> (f64, Option<u64>) {
    (
        json["thread_percentage"].as_f64().unwrap(),
        json["pinned_mem_limit_mib"].as_u64(),
    )
}

#[test]
fn a_client_is_held_to_the_servers_limits_and_its_env_can_only_lower_them() {
    let (dir, root) = root();
    let daemon = Daemon::start(&root, dir.path());
    assert_eq!(
        daemon.send("get_server_list\n"),
        "",
        "no server before a client"
    );
    let set = daemon.send(&format!(
        "set_default_device_pinned_mem_limit {UUID} 10G\nset_default_active_thread_percentage 25\n"
    ));
    assert_eq!(set, "", "a successful set prints nothing");

    let (refused, json) = daemon.client(&["--alloc", "12G"], &[]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("out of memory"));
    assert_eq!(limits(&json), (25.0, Some(10_240)));
    assert_eq!(
        (json["alloc_mib"].as_u64(), json["allocated"].as_bool()),
        (Some(12_288), Some(false))
    );
    let server_pid = json["server_pid"].as_u64().unwrap();
    assert_eq!(daemon.send("get_server_list\n"), format!("{server_pid}\n"));

    let (fits, json) = daemon.client(&["--alloc", "8G"], &[]);
    assert_eq!(fits.status.code(), Some(0), "{fits:?}");
    assert_eq!(json["allocated"], true);
    assert_eq!(
        json["server_pid"].as_u64(),
        Some(server_pid),
        "one server for the user"
    );

    let asks_more = [
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=20G"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
    ];
    let (held, json) = daemon.client(&["--alloc", "12G", "--device", UUID], &asks_more);
    assert_eq!(held.status.code(), Some(2), "{held:?}");
    assert_eq!(
        limits(&json),
        (25.0, Some(10_240)),
        "the env cannot raise them"
    );

    let asks_less = [
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4096M"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
    ];
    let (lowered, json) = daemon.client(&["--alloc", "5G"], &asks_less);
    assert_eq!(lowered.status.code(), Some(2), "{lowered:?}");
    assert_eq!(limits(&json), (10.0, Some(4096)), "the env can lower them");
    assert_eq!(daemon.send("get_server_list\n"), format!("{server_pid}\n"));
}

#[test]
fn without_server_limits_a_client_with_no_env_is_not_limited() {
    let (dir, root) = root();
    let daemon = Daemon::start(&root, dir.path());
    let (unlimited, json) = daemon.client(&["--alloc", "80G"], &[]);
    assert_eq!(unlimited.status.code(), Some(0), "{unlimited:?}");
    assert_eq!(limits(&json), (100.0, None));
    assert_eq!(json["allocated"], true);

    let own = [("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")];
    let (limited, json) = daemon.client(&["--alloc", "2G"], &own);
    assert_eq!(limited.status.code(), Some(2), "{limited:?}");
    assert_eq!(limits(&json), (100.0, Some(1024)));
}

#[test]
fn later_defaults_reach_only_the_next_server_and_per_pid_settings_reach_new_clients() {
    let (dir, root) = root();
    let daemon = Daemon::start(&root, dir.path());
    daemon.send(&format!(
        "set_default_device_pinned_mem_limit {UUID} 10G\nset_default_active_thread_percentage 25\n"
    ));
    let (_, first) = daemon.client(&[], &[]);
    let pid = first["server_pid"].as_u64().unwrap();
    assert!(
        pid > 4_194_304,
        "no real process has the fake server's PID: {pid}"
    );

    daemon.send(&format!(
        "set_default_device_pinned_mem_limit {UUID} 2G\nset_default_active_thread_percentage 10\n"
    ));
    let defaults = daemon.send(&format!(
        "get_default_device_pinned_mem_limit {UUID}\nget_default_active_thread_percentage\n"
    ));
    assert_eq!(defaults, "2048M\n10.0\n");
    let (_, json) = daemon.client(&[], &[]);
    assert_eq!(
        limits(&json),
        (25.0, Some(10_240)),
        "the running server keeps its own"
    );

    daemon.send(&format!(
        "set_device_pinned_mem_limit {pid} {UUID} 4G\nset_active_thread_percentage {pid} 50\n"
    ));
    let server = daemon.send(&format!(
        "get_device_pinned_mem_limit {pid} {UUID}\nget_active_thread_percentage {pid}\n"
    ));
    assert_eq!(server, "4096M\n50.0\n");
    let (_, json) = daemon.client(&[], &[]);
    assert_eq!(
        limits(&json),
        (50.0, Some(4096)),
        "new clients see the server's new limits"
    );

    daemon.send(&format!("shutdown_server {pid}\n"));
    assert_eq!(daemon.send("get_server_list\n"), "");
    let (_, next) = daemon.client(&[], &[]);
    assert_ne!(next["server_pid"].as_u64(), Some(pid), "a new server");
    assert_eq!(
        limits(&next),
        (10.0, Some(2048)),
        "with the defaults of its start"
    );
    let log =
        std::fs::read_to_string(daemon.pipe.with_file_name("log").join("control.log")).unwrap();
    assert!(log.contains(&format!("Starting new server {pid}")), "{log}");
}

#[test]
fn malformed_commands_get_an_error_line_and_the_daemon_keeps_serving() {
    let (dir, root) = root();
    let daemon = Daemon::start(&root, dir.path());
    let replies = daemon.send(
        "set_default_device_pinned_mem_limit x 10Q\n\
         set_default_device_pinned_mem_limit 0 10Q\n\
         set_default_active_thread_percentage 0\n\
         set_default_active_thread_percentage 101\n\
         set_default_active_thread_percentage abc\n\
         set_active_thread_percentage 4194999 50\n\
         get_device_pinned_mem_limit 123 0\n\
         set_default_active_thread_percentage\n\
         no_such_command\n\
         get_default_active_thread_percentage\n",
    );
    assert_eq!(
        replies.lines().collect::<Vec<_>>(),
        [
            "Invalid value",
            "Invalid value",
            "Invalid value",
            "Invalid value",
            "Invalid value",
            "Invalid PID",
            "Invalid PID",
            "Invalid command",
            "Invalid command",
            "100.0",
        ]
    );
    let (fine, json) = daemon.client(&[], &[]);
    assert!(fine.status.success(), "{fine:?}");
    assert_eq!(limits(&json), (100.0, None), "nothing malformed was kept");
}

#[test]
fn the_client_is_installed_and_recorded_and_fails_without_a_daemon() {
    let (dir, root) = root();
    let pipe = dir.path().join("no-daemon");
    let env = [("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "30")];
    let (alone, json) = client(&root, &pipe, &["--alloc", "1G"], &env);
    assert_eq!(alone.status.code(), Some(1), "{alone:?}");
    assert_eq!(json, serde_json::Value::Null, "nothing on stdout");
    let stderr = String::from_utf8_lossy(&alone.stderr);
    assert!(stderr.contains("without MPS"), "{stderr}");

    let (bad, _) = client(&root, &pipe, &["--alloc", "1T"], &[]);
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");

    let recorded = calls(&root);
    assert_eq!(recorded.len(), 2);
    assert_eq!(recorded[0].tool, "kerf-fake-cuda-client");
    assert_eq!(recorded[0].args, ["--alloc", "1G"]);
    assert_eq!(recorded[0].env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "30");
    for tool in kerf_fake_gpu_tools::TOOLS {
        assert!(root.join("usr/bin").join(tool).exists(), "{tool} is linked");
    }
}
