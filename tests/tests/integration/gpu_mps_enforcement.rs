//! On a machine with an NVIDIA GPU (ignored elsewhere): who holds an MPS slice's limits
//! against a process that clears its `CUDA_MPS_*` environment before it initializes CUDA, with
//! kerf's plugin, its daemon pods and the real `nvidia-cuda-mps-control` (the set-up of
//! `gpu_mps_pods`, whose wrapped `nvidia-smi` never changes the GPU's compute mode or MIG).
//!
//! 1. A baseline: one PyTorch process without MPS, its matmul throughput the whole GPU's.
//! 2. Two 10 GiB / 25 % slices of GPU 0 (one size: the server holds both). One PyTorch
//!    process per slice clears `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and
//!    `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` first: a 12 GiB allocation must be refused and each
//!    must run at about its share of the baseline.
//! 3. A 10 GiB / 25 % and a 20 GiB / 50 % slice (sizes differ: the server holds the larger
//!    one, the smaller only by its environment). The smaller slice's process that clears its
//!    environment gets its 12 GiB (what `limitsHeldBy: client environment` says), one that
//!    keeps it is refused.
//!
//! One server serves both slices in either case, so there is no time-slicing between servers
//! to measure. Run it with
//! `cargo test --release -p kerf-tests --test integration gpu_mps_enforcement:: -- --ignored --nocapture`;
//! `KERF_GPU_PYTHON` names the Python with PyTorch, `KERF_GPU_REPORT` a file for the report.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{GIB, TestNode, uid};
use crate::gpu_mps_pods::{
    GpuNode, finish_workloads, first_gpu, logs, mps_env, prepare_pods, publish, spawn_plugin, step,
    wait_for_matmuls,
};
use kerf_proto::client::Claim;
use kerf_tests::fake_kubelet::FakeKubelet;
use serde_json::{Value, json};

/// How long each PyTorch process runs its matmuls.
const WORK_SECONDS: u64 = 15;

/// argv: result file, seconds, `clear` or `keep` (the MPS limits in the environment).
const WORKLOAD: &str = r#"
import json, os, sys, time
out, seconds, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
if mode == "clear":
    for name in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        os.environ.pop(name, None)
import torch
r = {"mode": mode, "mps_env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_")}}
try:
    y = torch.empty(12 * 2**30, dtype=torch.uint8, device="cuda"); r["alloc_12gib"] = "ok"; del y
except RuntimeError as e:
    r["alloc_12gib"] = "out of memory" if "out of memory" in str(e) else str(e)[:300]
torch.cuda.empty_cache()
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a)
n, t0 = 0, time.time()
while time.time() - t0 < seconds:
    c = a @ b; torch.cuda.synchronize(); n += 1
    open(out + ".progress", "w").write(str(n))
el = time.time() - t0
r["matmuls"], r["tflops"], r["done"] = n, 2 * 8192**3 * n / el / 1e12, True
json.dump(r, open(out, "w"))
"#;

/// One PyTorch process per `(claim, mode)`, with the claim's MPS environment (none for the
/// baseline's `None`), as `(result file, process)`.
fn start(node: &TestNode, runs: &[(Option<&Claim>, &str, &str)]) -> Vec<(PathBuf, Child)> {
    let python = std::env::var("KERF_GPU_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = node.root.join("enforcement.py");
    std::fs::write(&script, WORKLOAD).unwrap();
    runs.iter()
        .map(|(claim, name, mode)| {
            let out = node.root.join(format!("{name}.json"));
            let mut command = Command::new(&python);
            command
                .arg(&script)
                .arg(&out)
                .arg(WORK_SECONDS.to_string())
                .arg(mode)
                .env_remove("CUDA_MPS_PIPE_DIRECTORY")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(out.with_extension("err")).unwrap());
            if let Some(claim) = claim {
                command.envs(mps_env(node, claim));
            }
            (out, command.spawn().unwrap())
        })
        .collect()
}

async fn run(node: &TestNode, runs: &[(Option<&Claim>, &str, &str)]) -> Vec<Value> {
    let mut workloads = start(node, runs);
    wait_for_matmuls(&workloads).await;
    finish_workloads(
        &mut workloads,
        Instant::now() + Duration::from_secs(WORK_SECONDS + 60),
    )
}

fn tflops(entry: &Value) -> f64 {
    entry["result"]["tflops"].as_f64().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU, its driver and PyTorch"]
async fn a_process_that_clears_its_environment_is_held_by_the_server() {
    let GpuNode {
        node,
        tools,
        inventory,
        gpu,
        runner,
        server: _server,
        kubeconfig,
    } = GpuNode::start().await;
    let gpu0 = first_gpu(&inventory);
    let t0 = Instant::now();
    step(t0, "baseline without MPS");
    let baseline = run(&node, &[(None, "baseline", "keep")]).await;

    let mut plugin = spawn_plugin(&node, &tools, &kubeconfig, 1);
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(30))
        .await
        .unwrap();
    step(t0, "one size: two 10 GiB / 25 % slices");
    let same = [
        node.slice_claim_on(gpu0, "same-a", &uid(1), 10 * GIB, 25),
        node.slice_claim_on(gpu0, "same-b", &uid(2), 10 * GIB, 25),
    ];
    let (pods, _) = prepare_pods(&kubelet, &same).await;
    let one_size = run(
        &node,
        &[
            (Some(&same[0]), "same-a", "clear"),
            (Some(&same[1]), "same-b", "clear"),
        ],
    )
    .await;
    for pod in &pods {
        kubelet.unprepare_pod(pod).await.unwrap();
    }

    step(t0, "two sizes: 10 GiB / 25 % and 20 GiB / 50 %");
    let mixed = [
        node.slice_claim_on(gpu0, "small", &uid(3), 10 * GIB, 25),
        node.slice_claim_on(gpu0, "large", &uid(4), 20 * GIB, 50),
    ];
    let (pods, _) = prepare_pods(&kubelet, &mixed).await;
    let two_sizes = run(
        &node,
        &[
            (Some(&mixed[0]), "small-clear", "clear"),
            (Some(&mixed[0]), "small-keep", "keep"),
        ],
    )
    .await;
    for pod in &pods {
        kubelet.unprepare_pod(pod).await.unwrap();
    }
    let full = tflops(&baseline[0]);
    let report = json!({
        "gpu": gpu,
        "gpu_name": gpu0.product_name,
        "baseline": baseline,
        "one_size_cleared": one_size,
        "one_size_share_of_baseline": one_size.iter().map(|e| tflops(e) / full).collect::<Vec<_>>(),
        "two_sizes": two_sizes,
        "logs": logs(&node, &runner, &gpu),
    });
    let text = publish(&report);
    plugin.kill().unwrap();
    plugin.wait().unwrap();
    runner.stop().await;

    for entry in &one_size {
        assert_eq!(entry["exit"], 0, "{text}");
        assert_eq!(entry["result"]["alloc_12gib"], "out of memory", "{text}");
        // Two clients at 25 % each: each well below the whole GPU (MPS rounds the share to
        // its granularity, and one client may run alone for a moment).
        assert!(tflops(entry) < 0.45 * full, "{text}");
    }
    assert_eq!(two_sizes[0]["result"]["alloc_12gib"], "ok", "{text}");
    assert_eq!(
        two_sizes[1]["result"]["alloc_12gib"], "out of memory",
        "{text}"
    );
}
