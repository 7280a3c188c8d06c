//! kerf's MPS daemon manager (`kerf_kubelet_plugin::mps_daemons`) over the fake
//! `nvidia-cuda-mps-control` and `nvidia-smi` of `kerf-fake-gpu-tools` (built here as
//! `kerf-test-gpu-tools`) in a mock driver root: real processes, real PID files, real signals.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kerf_fake_gpu_tools::{Call, calls, fail_next_mps_start, install};
use kerf_kubelet_plugin::mps_daemons::{MpsSettings, ProcessDaemons};

const GPU_A: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";
const GPU_B: &str = "GPU-8a1b2c3d-0000-1111-2222-333344445555";

struct Node {
    _dir: tempfile::TempDir,
    root: PathBuf,
    daemons: ProcessDaemons,
}

fn node() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("driver");
    install(&root, Path::new(env!("CARGO_BIN_EXE_kerf-test-gpu-tools"))).unwrap();
    let daemons = ProcessDaemons::new(MpsSettings {
        root: dir.path().join("mps"),
        driver_root: root.clone(),
        stop_timeout: Duration::from_secs(2),
    });
    Node {
        _dir: dir,
        root,
        daemons,
    }
}

fn of_tool<'a>(calls: &'a [Call], tool: &str) -> Vec<&'a Call> {
    calls.iter().filter(|c| c.tool == tool).collect()
}

#[tokio::test]
async fn a_daemon_per_gpu_started_once_with_only_its_gpu_and_stopped_cleanly() {
    let node = node();
    let (dirs_a, first) = node.daemons.ensure(GPU_A).await.unwrap();
    let (_, again) = node.daemons.ensure(GPU_A).await.unwrap();
    assert_eq!(
        first, again,
        "a running daemon is adopted, not started twice"
    );
    let (dirs_b, other) = node.daemons.ensure(GPU_B).await.unwrap();
    assert_ne!(first.pid, other.pid);
    assert_ne!(dirs_a.pipe(), dirs_b.pipe());

    let recorded = calls(&node.root);
    let starts = of_tool(&recorded, "nvidia-cuda-mps-control");
    assert_eq!(starts.len(), 2, "{recorded:#?}");
    assert_eq!(starts[0].args, ["-d"]);
    assert_eq!(starts[0].env["CUDA_VISIBLE_DEVICES"], GPU_A);
    assert_eq!(
        starts[0].env["CUDA_MPS_PIPE_DIRECTORY"],
        dirs_a.pipe().to_string_lossy()
    );
    assert_eq!(
        starts[0].env["CUDA_MPS_LOG_DIRECTORY"],
        dirs_a.log().to_string_lossy()
    );
    assert_eq!(starts[1].env["CUDA_VISIBLE_DEVICES"], GPU_B);
    let smi = of_tool(&recorded, "nvidia-smi");
    assert_eq!(smi[0].args, ["-i", GPU_A, "-c", "EXCLUSIVE_PROCESS"]);

    node.daemons.stop(GPU_A).await.unwrap();
    assert!(node.daemons.running(&dirs_a).is_none());
    assert!(!dirs_a.base().exists(), "its directories are removed");
    assert!(
        node.daemons.running(&dirs_b).is_some(),
        "the other GPU's daemon stays"
    );
    let recorded = calls(&node.root);
    let quit = recorded
        .iter()
        .find(|c| c.tool == "nvidia-cuda-mps-control" && c.args.is_empty())
        .unwrap();
    assert_eq!(quit.stdin, "quit\n");
    assert_eq!(
        quit.env["CUDA_MPS_PIPE_DIRECTORY"],
        dirs_a.pipe().to_string_lossy()
    );
    assert_eq!(
        of_tool(&recorded, "nvidia-smi").last().unwrap().args,
        ["-i", GPU_A, "-c", "DEFAULT"]
    );
    node.daemons.stop(GPU_B).await.unwrap();
    assert!(node.daemons.known_gpus().is_empty());
}

#[tokio::test]
async fn a_failed_start_names_the_gpu_and_the_tools_message_and_leaves_nothing() {
    let node = node();
    fail_next_mps_start(&node.root, "NVIDIA driver not loaded").unwrap();
    let error = node.daemons.ensure(GPU_A).await.unwrap_err().to_string();
    assert!(error.contains(GPU_A), "{error}");
    assert!(error.contains("NVIDIA driver not loaded"), "{error}");
    assert!(node.daemons.known_gpus().is_empty(), "no directory left");
    let recorded = calls(&node.root);
    assert_eq!(
        of_tool(&recorded, "nvidia-smi").last().unwrap().args,
        ["-i", GPU_A, "-c", "DEFAULT"],
        "the compute mode is restored"
    );
    assert!(of_tool(&recorded, "mps-daemon").is_empty());
}

#[tokio::test]
async fn a_daemon_that_ignores_quit_is_killed() {
    let node = node();
    let (dirs, running) = node.daemons.ensure(GPU_A).await.unwrap();
    // Without its control socket the client cannot reach it: quit is lost.
    std::fs::remove_file(dirs.pipe().join("control")).unwrap();
    node.daemons.stop(GPU_A).await.unwrap();
    assert!(
        !Path::new(&format!("/proc/{}/cmdline", running.pid)).exists() || {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", running.pid)).unwrap_or_default();
            stat.contains(") Z")
        }
    );
    assert!(!dirs.base().exists());
}

#[tokio::test]
async fn hostile_gpu_names_never_reach_a_path() {
    let node = node();
    for bad in [
        "../../etc",
        "GPU-../x",
        "MIG-2f4e0e00-e140-bcbd-d4fd-278c95116d02",
    ] {
        let error = node.daemons.ensure(bad).await.unwrap_err().to_string();
        assert!(error.contains("gpuUUID"), "{bad}: {error}");
    }
    assert!(calls(&node.root).is_empty());
}
