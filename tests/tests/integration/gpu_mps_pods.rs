//! On a machine with an NVIDIA GPU (ignored elsewhere): kerf's MPS daemon pods with the real
//! `nvidia-cuda-mps-control`. The plugin (NVML discovery, `--mps-daemons=pod`) runs as its
//! own process against FakeApi over HTTP, the pod runner runs the daemon pod, two 10 GiB / 25 %
//! slices of GPU 0 are prepared over the DRA socket, one PyTorch process per slice runs with
//! its CDI spec's MPS environment, and the plugin is SIGKILLed and started again while both
//! run: both must keep running, stay within their limits, and the daemon pod must be the one
//! they started with.
//!
//! `nvidia-smi` is wrapped: calls that would change the GPU's settings (compute mode,
//! compute policy, MIG) are logged and skipped, so the GPU stays in its compute mode (MPS runs
//! in `DEFAULT` too). Run it with
//! `cargo test --release -p kerf-tests --test integration gpu_mps_pods:: -- --ignored --nocapture`;
//! `KERF_TEST_PLUGIN` names the plugin binary when the tests run elsewhere than they were
//! built, `KERF_GPU_PYTHON` the Python with PyTorch (`python3`), `KERF_GPU_REPORT` a file for
//! the JSON report.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::plugin_pod::{IMAGE_PROGRAM, PLUGIN_POD, plugin_pod_from};
use crate::common::{DRIVER, GIB, NODE, TestNode, uid};
use k8s_openapi::api::core::v1::Pod;
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::config::Discovery;
use kerf_kubelet_plugin::mps_daemons::daemon_pod_name;
use kerf_proto::client::Claim;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod as KubeletPod};
use kerf_tests::pod_runner::{PodRunner, PodRunnerSettings};
use serde_json::{Value, json};

const NAMESPACE: &str = kerf_tests::fake_api::KERF_NAMESPACE;
/// Compiled in: the check runs where the source tree may not be.
const MANIFEST: &str = kerf_tests::manifests::MOCK_INSTALL;
/// How long each PyTorch process runs its matmuls.
const WORK_SECONDS: u64 = 20;

const WORKLOAD: &str = r#"
import json, sys, time, torch
out, seconds = sys.argv[1], float(sys.argv[2])
r = {}
free, total = torch.cuda.mem_get_info()
r["free_gib"], r["total_gib"] = free / 2**30, total / 2**30
x = torch.empty(8 * 2**30, dtype=torch.uint8, device="cuda"); r["alloc_8gib"] = "ok"; del x
torch.cuda.empty_cache()
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

/// A driver root whose `nvidia-smi` refuses to change the GPU and whose
/// `nvidia-cuda-mps-control` is the real one.
fn wrapped_tools(root: &Path) -> PathBuf {
    let tools = root.join("tools");
    let bin = tools.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = |name: &str| {
        let out = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let control = real("nvidia-cuda-mps-control");
    assert!(!control.is_empty(), "nvidia-cuda-mps-control not found");
    std::os::unix::fs::symlink(&control, bin.join("nvidia-cuda-mps-control")).unwrap();
    let log = root.join("nvidia-smi.log");
    let wrapper = format!(
        "#!/bin/sh\n# Never change the GPU's settings: log and skip compute mode, compute policy and MIG.\necho \"$*\" >> {log}\ncase \" $* \" in\n  *\" -c \"*|*\" --compute-mode\"*|*compute-policy*|*\" mig \"*|*\" -mig \"*) echo \"skipped: $*\" >> {log}; exit 0;;\nesac\nexec {smi} \"$@\"\n",
        log = log.display(),
        smi = real("nvidia-smi"),
    );
    std::fs::write(bin.join("nvidia-smi"), wrapper).unwrap();
    // The tools run with only the driver root's library directories on their search path
    // (as on a node); here the driver's libraries may live elsewhere (a GPU container's
    // /usr/local/nvidia/lib64), so the wrapped root points its lib64 there.
    if let Some(libraries) = driver_library_dir() {
        std::os::unix::fs::symlink(libraries, tools.join("usr/lib64")).unwrap();
    }
    std::fs::set_permissions(
        bin.join("nvidia-smi"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    tools
}

/// The directory of `libcuda.so.1`: on `LD_LIBRARY_PATH`, else in the loader's cache.
fn driver_library_dir() -> Option<PathBuf> {
    let from_env = std::env::var_os("LD_LIBRARY_PATH").and_then(|paths| {
        std::env::split_paths(&paths).find(|dir| dir.join("libcuda.so.1").exists())
    });
    from_env.or_else(|| {
        let cache = Command::new("ldconfig").arg("-p").output().ok()?;
        let text = String::from_utf8_lossy(&cache.stdout).into_owned();
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("libcuda.so.1"))?;
        let path = PathBuf::from(line.rsplit(" => ").next()?.trim());
        path.parent().map(Path::to_path_buf)
    })
}

/// A step of the check, on stderr, so that a run cut short shows how far it got.
pub(crate) fn step(started: Instant, what: &str) {
    eprintln!("[gpu {:6.1}s] {what}", started.elapsed().as_secs_f64());
}

fn plugin_binary() -> PathBuf {
    std::env::var_os("KERF_TEST_PLUGIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_kerf-test-plugin")),
        PathBuf::from,
    )
}

pub(crate) fn spawn_plugin(
    node: &TestNode,
    tools: &Path,
    kubeconfig: &Path,
    generation: u32,
) -> Child {
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let log = node.root.join(format!("plugin-{generation}.log"));
    Command::new(plugin_binary())
        .args([
            format!("--driver-name={DRIVER}"),
            format!("--node-name={NODE}"),
            format!("--registry-dir={}", path(node.registry_dir())),
            format!("--plugin-dir={}", path(node.plugin_dir())),
            format!("--cdi-dir={}", path(node.cdi_dir())),
            format!("--checkpoint-file={}", path(node.checkpoint_file())),
            format!("--driver-root={}", tools.display()),
            format!("--mps-root={}", path(node.root.join("mps"))),
            "--mps-daemons=pod".to_owned(),
            format!("--pod-name={PLUGIN_POD}"),
            format!("--pod-namespace={NAMESPACE}"),
            "--mps-check-interval=1s".to_owned(),
            "--publish-resources=false".to_owned(),
            "--metrics-address=".to_owned(),
            "--log-filter=info".to_owned(),
        ])
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap()
}

/// The GPU with the lowest minor.
pub(crate) fn first_gpu(inventory: &Inventory) -> &kerf_core::inventory::Gpu {
    inventory.gpus.iter().min_by_key(|g| g.minor).unwrap()
}

/// A 10 GiB / 25 % MPS slice of the real GPU 0, allocated as kerf-controller writes it.
fn slice_claim(node: &TestNode, inventory: &Inventory, name: &str, claim_uid: &str) -> Claim {
    node.slice_claim_on(first_gpu(inventory), name, claim_uid, 10 * GIB, 25)
}

/// The MPS environment of a claim's CDI spec, with the pipe directory's host path (no
/// container runtime mounts it here).
pub(crate) fn mps_env(node: &TestNode, claim: &Claim) -> BTreeMap<String, String> {
    let spec = node.cdi_spec(&claim.uid);
    let edits = &spec["devices"][0]["containerEdits"];
    let mut env: BTreeMap<String, String> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str()?.split_once('='))
        .filter(|(k, _)| k.starts_with("CUDA_MPS_"))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let pipe = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| {
            env.get("CUDA_MPS_PIPE_DIRECTORY").map(String::as_str) == m["containerPath"].as_str()
        })
        .unwrap()["hostPath"]
        .as_str()
        .unwrap()
        .to_owned();
    env.insert("CUDA_MPS_PIPE_DIRECTORY".to_owned(), pipe);
    env
}

fn incarnation(node: &TestNode, gpu: &str) -> Option<(String, i32)> {
    let pod: Pod = node
        .api
        .get_resource(Some(NAMESPACE), &daemon_pod_name(NODE, gpu))?;
    let restarts = pod
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|s| s.into_iter().next())
        .map_or(0, |s| s.restart_count);
    Some((pod.metadata.uid?, restarts))
}

pub(crate) fn progress(out: &Path) -> u64 {
    std::fs::read_to_string(out.with_extension("json.progress"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// The test node with the real GPU: FakeApi over HTTP with the plugin's pod, the pod runner,
/// the wrapped tools and the GPU NVML finds first.
pub(crate) struct GpuNode {
    pub(crate) node: TestNode,
    pub(crate) tools: PathBuf,
    pub(crate) inventory: Inventory,
    pub(crate) gpu: String,
    pub(crate) runner: PodRunner,
    pub(crate) server: ApiServer,
    pub(crate) kubeconfig: PathBuf,
}

impl GpuNode {
    pub(crate) async fn start() -> Self {
        let node = TestNode::new("h100-sxm-80gb:1");
        let tools = wrapped_tools(&node.root);
        let mut config = node.config();
        config.discovery = Discovery::Nvml;
        config.driver_root.clone_from(&tools);
        let inventory = kerf_kubelet_plugin::plugin::discover(&config).unwrap();
        let gpu = first_gpu(&inventory).uuid.clone();
        node.api
            .insert(serde_json::to_value(plugin_pod_from(MANIFEST, NODE)).unwrap());
        let runner = PodRunner::start(
            &node.api,
            NODE,
            BTreeMap::from([(IMAGE_PROGRAM.to_owned(), plugin_binary())]),
            PodRunnerSettings::default(),
        );
        let server = ApiServer::start(node.api.clone()).await.unwrap();
        let kubeconfig = node.root.join("kubeconfig");
        server
            .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(NODE))
            .unwrap();
        GpuNode {
            node,
            tools,
            inventory,
            gpu,
            runner,
            server,
            kubeconfig,
        }
    }
}

/// What the wrapped `nvidia-smi`, the daemon pod and both plugins logged.
pub(crate) fn logs(node: &TestNode, runner: &PodRunner, gpu: &str) -> Value {
    let read = |name: &str| std::fs::read_to_string(node.root.join(name)).unwrap_or_default();
    json!({
        "nvidia_smi_calls": read("nvidia-smi.log"),
        "daemon": runner.logs(NAMESPACE, &daemon_pod_name(NODE, gpu)),
        "plugin": [read("plugin-1.log"), read("plugin-2.log")],
    })
}

/// Prints the report and writes it to `KERF_GPU_REPORT`, if set.
pub(crate) fn publish(report: &Value) -> String {
    let text = serde_json::to_string_pretty(report).unwrap();
    println!("{text}");
    if let Some(path) = std::env::var_os("KERF_GPU_REPORT") {
        std::fs::write(path, &text).unwrap();
    }
    text
}

/// One pod per claim, prepared in turn; the pods and how long both prepares took (ms).
pub(crate) async fn prepare_pods(
    kubelet: &FakeKubelet,
    claims: &[Claim],
) -> (Vec<KubeletPod>, u128) {
    let pods: Vec<KubeletPod> = claims
        .iter()
        .map(|c| KubeletPod::new(&format!("pod-{}", c.name)).with_claim(DRIVER, c.clone()))
        .collect();
    let started = Instant::now();
    for pod in &pods {
        tokio::time::timeout(Duration::from_secs(60), kubelet.prepare_pod(pod))
            .await
            .expect("a prepare within 60 s")
            .unwrap();
    }
    (pods, started.elapsed().as_millis())
}

/// Until every workload has finished a matmul (CUDA and its MPS client are up).
pub(crate) async fn wait_for_matmuls(workloads: &[(PathBuf, Child)]) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while workloads.iter().any(|(out, _)| progress(out) == 0) {
        assert!(
            Instant::now() < deadline,
            "the workloads never started their matmuls"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One PyTorch process per claim with its MPS environment, as `(result file, process)`.
fn start_workloads(node: &TestNode, claims: &[Claim]) -> Vec<(PathBuf, Child)> {
    let python = std::env::var("KERF_GPU_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let script = node.root.join("workload.py");
    std::fs::write(&script, WORKLOAD).unwrap();
    claims
        .iter()
        .map(|claim| {
            let out = node.root.join(format!("{}.json", claim.name));
            let child = Command::new(&python)
                .arg(&script)
                .arg(&out)
                .arg(WORK_SECONDS.to_string())
                .envs(mps_env(node, claim))
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(out.with_extension("err")).unwrap())
                .spawn()
                .unwrap();
            (out, child)
        })
        .collect()
}

/// Waits for every workload (killing what still runs after `deadline`); its exit code and
/// its result (or its stderr).
pub(crate) fn finish_workloads(
    workloads: &mut [(PathBuf, Child)],
    deadline: Instant,
) -> Vec<Value> {
    workloads
        .iter_mut()
        .map(|(out, child)| {
            while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = child.kill();
            let status = child.wait().unwrap();
            let result: Value = std::fs::read_to_string(&*out)
                .ok()
                .and_then(|s| serde_json::from_str(&s).ok())
                .unwrap_or_else(|| {
                    let stderr = std::fs::read_to_string(out.with_extension("err"));
                    json!({"stderr": stderr.unwrap_or_default()})
                });
            json!({"exit": status.code(), "result": result})
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs an NVIDIA GPU, its driver and PyTorch"]
async fn mps_slices_keep_running_while_the_plugin_is_killed_and_restarted() {
    let GpuNode {
        node,
        tools,
        inventory,
        gpu,
        runner,
        server: _server,
        kubeconfig,
    } = GpuNode::start().await;
    let claims = [
        slice_claim(&node, &inventory, "slice-a", &uid(1)),
        slice_claim(&node, &inventory, "slice-b", &uid(2)),
    ];

    let t0 = Instant::now();
    step(t0, "starting the plugin");
    let mut plugin = spawn_plugin(&node, &tools, &kubeconfig, 1);
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(30))
        .await
        .unwrap();
    step(t0, "registered; preparing two slices");
    let (pods, prepare_ms) = prepare_pods(&kubelet, &claims).await;
    step(t0, "prepared; starting the workloads");
    let before = incarnation(&node, &gpu).unwrap();

    let mut workloads = start_workloads(&node, &claims);
    wait_for_matmuls(&workloads).await;
    step(t0, "matmuls running; killing the plugin");
    plugin.kill().unwrap();
    plugin.wait().unwrap();
    let during_outage: Vec<u64> = workloads.iter().map(|(out, _)| progress(out)).collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut plugin = spawn_plugin(&node, &tools, &kubeconfig, 2);
    kubelet
        .wait_for_registration(2, Duration::from_secs(30))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after_restart: Vec<u64> = workloads.iter().map(|(out, _)| progress(out)).collect();
    let still_running: Vec<bool> = workloads
        .iter_mut()
        .map(|(_, child)| child.try_wait().unwrap().is_none())
        .collect();
    let after = incarnation(&node, &gpu);
    step(t0, "plugin restarted; waiting for the workloads");

    let results = finish_workloads(
        &mut workloads,
        Instant::now() + Duration::from_secs(WORK_SECONDS + 60),
    );
    step(t0, "workloads ended; unpreparing");
    let warnings: Vec<Value> = claims
        .iter()
        .flat_map(|c| node.api.warning_events("ResourceClaim", &c.name))
        .collect();
    for pod in &pods {
        kubelet.unprepare_pod(pod).await.unwrap();
    }
    let daemon_gone = incarnation(&node, &gpu).is_none();
    let report = json!({
        "gpu": gpu,
        "gpu_name": first_gpu(&inventory).product_name,
        "prepare_two_slices_ms": prepare_ms,
        "daemon_before": before,
        "daemon_after_plugin_restart": after,
        "matmuls_at_kill": during_outage,
        "matmuls_after_restart": after_restart,
        "running_after_restart": still_running,
        "workloads": results,
        "warnings": warnings,
        "daemon_pod_deleted_after_unprepare": daemon_gone,
        "logs": logs(&node, &runner, &gpu),
    });
    let text = publish(&report);
    plugin.kill().unwrap();
    plugin.wait().unwrap();
    runner.stop().await;

    assert_eq!(
        after,
        Some(before),
        "the daemon pod survived the plugin's restart"
    );
    assert_eq!(still_running, [true, true]);
    assert!(
        after_restart.iter().zip(&during_outage).all(|(a, b)| a > b),
        "matmuls went on"
    );
    for entry in &results {
        assert_eq!(entry["exit"], 0, "{text}");
        assert_eq!(entry["result"]["alloc_12gib"], "out of memory", "{text}");
        assert_eq!(entry["result"]["alloc_8gib"], "ok", "{text}");
    }
    assert!(warnings.is_empty(), "{text}");
    assert!(daemon_gone, "{text}");
}
