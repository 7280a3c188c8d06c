//! The fixtures of the integration tests. Here: a node for kubelet-level tests, a temporary
//! directory laid out like a node's (registry, plugin directory, CDI directory, driver root,
//! boot ID), an in-memory API server, the plugin in-process or as its own process, and claim
//! builders for every kind of claim. In the modules: kerf-controller's ([`controller`]: the
//! process, a context over watched caches, the claim controller on it), the claim
//! controller's cluster ([`claim_cluster`], [`label_cluster`]), leader election ([`lease`]),
//! the webhook over HTTPS ([`webhook_server`]), MPS nodes ([`mps`]) and the plugin's Pod
//! ([`plugin_pod`]).

#![allow(dead_code, reason = "each test module uses a part of the helpers")]

pub mod claim_cluster;
pub mod controller;
pub mod label_cluster;
pub mod lease;
pub mod mps;
pub mod plugin_pod;
pub mod webhook_server;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{ClaimPlacement, PlacedDevice, SliceSize};
use kerf_core::enforcement::Enforcement;
use kerf_core::inventory::{Inventory, MigDevice};
use kerf_core::sharing::Sharing;
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_proto::client::{Claim, KubeletClient, RegisteredPlugin};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{KubeletConfig, RetryPolicy};
use serde_json::{Value, json};

pub use kerf_tests::fixtures::DRIVER;
pub const NODE: &str = "node-1";
pub const NAMESPACE: &str = "default";
pub const GIB: u64 = 1024 * 1024 * 1024;

/// The files of the fake driver root, relative to it, as they appear in containers.
pub const DRIVER_FILES: [&str; 4] = [
    "usr/lib/x86_64-linux-gnu/libcuda.so.570.124.06",
    "usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.124.06",
    "usr/bin/nvidia-smi",
];

/// The file name of a claim's CDI spec.
pub fn cdi_spec_file(uid: &str) -> String {
    format!("k8s.{DRIVER}-gpu_{uid}.json")
}

/// A claim UID that is a valid UUID, distinct per `n`.
pub fn uid(n: u32) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

pub struct TestNode {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub api: FakeApi,
    pub profile: String,
}

impl TestNode {
    /// A node whose GPUs come from the mock profile `profile` (`PROFILE[:COUNT]`).
    pub fn new(profile: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_owned();
        std::fs::write(root.join("boot_id"), "boot-1\n").unwrap();
        make_driver_root(&root.join("driver-root"));
        TestNode {
            _dir: dir,
            root,
            api: FakeApi::new(),
            profile: profile.to_owned(),
        }
    }

    pub fn registry_dir(&self) -> PathBuf {
        self.root.join("registry")
    }

    pub fn plugin_dir(&self) -> PathBuf {
        self.root.join("plugins").join(DRIVER)
    }

    pub fn cdi_dir(&self) -> PathBuf {
        self.root.join("cdi")
    }

    pub fn checkpoint_file(&self) -> PathBuf {
        self.plugin_dir().join("checkpoint.json")
    }

    pub fn config(&self) -> PluginConfig {
        PluginConfig {
            claim_device_status: true,
            claim_cache: true,
            ..PluginConfig::under(
                &self.root,
                DRIVER,
                NODE,
                Discovery::MockProfile(self.profile.clone()),
            )
        }
    }

    /// The plugin's flags for the same configuration, for the plugin as a process.
    pub fn plugin_args(&self) -> Vec<String> {
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        vec![
            format!("--driver-name={DRIVER}"),
            format!("--node-name={NODE}"),
            format!("--registry-dir={}", path(self.registry_dir())),
            format!("--plugin-dir={}", path(self.plugin_dir())),
            format!("--cdi-dir={}", path(self.cdi_dir())),
            format!("--checkpoint-file={}", path(self.checkpoint_file())),
            format!("--driver-root={}", path(self.root.join("driver-root"))),
            format!("--mock-gpus={}", self.profile),
            "--mock-device-node=/dev/null".to_owned(),
            "--publish-resources=false".to_owned(),
            "--metrics-address=".to_owned(),
            format!("--boot-id-file={}", path(self.root.join("boot_id"))),
            "--log-filter=info".to_owned(),
        ]
    }

    /// A client of the in-memory API as the kubelet plugin on this node talks to it (its
    /// ServiceAccount, its token bound to [`NODE`]), so that RBAC limits it as on a cluster.
    pub fn plugin_client(&self) -> kube::Client {
        self.api.client_as(Identity::kerf_kubelet_plugin(NODE))
    }

    pub fn inventory(&self) -> Inventory {
        plugin::discover(&self.config()).unwrap()
    }

    /// Starts the plugin in this process, reading claims from the in-memory API.
    pub async fn start_plugin(&self) -> RunningPlugin {
        let config = self.config();
        let connections = Connections::reading(Arc::new(ApiClaimReader::new(self.plugin_client())));
        plugin::start(&config, self.inventory(), connections)
            .await
            .unwrap()
    }

    /// Starts the plugin in this process with `health`; with `publish` it also publishes
    /// ResourceSlices to (and watches its Node in) the in-memory API.
    pub async fn start_plugin_with_health(
        &self,
        health: &kerf_kubelet_plugin::health::HealthConfig,
        publish: bool,
    ) -> RunningPlugin {
        let mut config = self.config();
        config.publish_resources = publish;
        config.health = health.clone();
        let client = self.plugin_client();
        let connections = Connections {
            publisher: publish.then_some(client.clone()),
            ..Connections::reading(Arc::new(ApiClaimReader::new(client)))
        };
        plugin::start(&config, self.inventory(), connections)
            .await
            .unwrap()
    }

    /// A kubelet for this node with short retries, so that tests stay fast.
    pub fn kubelet_config(&self) -> KubeletConfig {
        let mut config = KubeletConfig::new(self.registry_dir());
        config.call_timeout = Duration::from_secs(20);
        config.health_retry = Some(Duration::from_millis(100));
        config.retry = RetryPolicy {
            attempts: 40,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
        };
        config
    }

    /// Names of every file in the CDI directory, sorted.
    pub fn cdi_files(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.cdi_dir()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    pub fn cdi_spec(&self, uid: &str) -> Value {
        let path = self.cdi_dir().join(cdi_spec_file(uid));
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }

    pub fn checkpoint(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.checkpoint_file()).unwrap()).unwrap()
    }

    /// Claim UIDs in the checkpoint with their state.
    pub fn checkpoint_claims(&self) -> Vec<(String, String)> {
        let checkpoint = self.checkpoint();
        let mut claims: Vec<(String, String)> = checkpoint["claims"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(uid, e)| (uid.clone(), e["state"].as_str().unwrap_or("").to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        claims.sort();
        claims
    }

    /// Stores an allocated claim and returns how the kubelet names it.
    pub fn add_claim(&self, claim: Value) -> Claim {
        let stored = self.api.insert(claim);
        Claim::new(
            stored["metadata"]["namespace"].as_str().unwrap(),
            stored["metadata"]["name"].as_str().unwrap(),
            stored["metadata"]["uid"].as_str().unwrap(),
        )
    }

    /// A claim the scheduler allocated: one whole device (a GPU or a MIG device).
    pub fn device_claim(&self, name: &str, uid: &str, device: &str) -> Claim {
        self.add_claim(allocated_claim(
            name,
            uid,
            &json!({"devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}}),
        ))
    }

    /// A slice the controller allocated, written exactly as the controller writes it
    /// (`kerf_api::allocation_status` of an allocator placement).
    pub fn slice_claim(
        &self,
        name: &str,
        uid: &str,
        gpu_minor: u32,
        memory_bytes: u64,
        compute_percent: u8,
    ) -> Claim {
        let inventory = self.inventory();
        let gpu = inventory.gpu_by_minor(gpu_minor).unwrap();
        self.slice_claim_on(gpu, name, uid, memory_bytes, compute_percent)
    }

    /// As [`TestNode::slice_claim`], of a class that requires its MPS server to hold it
    /// (`sharing.enforcement: Server`).
    pub fn server_held_slice_claim(
        &self,
        name: &str,
        uid: &str,
        gpu_minor: u32,
        memory_bytes: u64,
        compute_percent: u8,
    ) -> Claim {
        let inventory = self.inventory();
        let gpu = inventory.gpu_by_minor(gpu_minor).unwrap();
        let size = SliceSize {
            memory_bytes,
            compute_percent,
        };
        self.mps_claim_on(gpu, name, uid, size, Enforcement::Server)
    }

    /// As [`TestNode::slice_claim`], on `gpu` of any inventory (the real one NVML finds).
    pub fn slice_claim_on(
        &self,
        gpu: &kerf_core::inventory::Gpu,
        name: &str,
        uid: &str,
        memory_bytes: u64,
        compute_percent: u8,
    ) -> Claim {
        let size = SliceSize {
            memory_bytes,
            compute_percent,
        };
        self.mps_claim_on(gpu, name, uid, size, Enforcement::default())
    }

    fn mps_claim_on(
        &self,
        gpu: &kerf_core::inventory::Gpu,
        name: &str,
        uid: &str,
        size: SliceSize,
        enforcement: Enforcement,
    ) -> Claim {
        let placement = ClaimPlacement {
            key: uid.to_owned(),
            devices: vec![PlacedDevice {
                request: "gpu".to_owned(),
                device: gpu.device_name(),
                gpu_uuid: gpu.uuid.clone(),
                slice: Some(size),
                sharing: Sharing::Mps,
                time_slice_interval: None,
                enforcement,
            }],
        };
        let allocation = kerf_api::allocation_status(
            &placement,
            NODE,
            DRIVER,
            Time(k8s_openapi::jiff::Timestamp::now()),
        )
        .unwrap();
        self.add_claim(allocated_claim(
            name,
            uid,
            &serde_json::to_value(allocation).unwrap(),
        ))
    }

    /// The first GPU without MIG and the first MIG device (with its parent's minor).
    pub fn whole_gpu_and_mig(&self) -> (u32, u32, MigDevice) {
        let inventory = self.inventory();
        let whole = inventory
            .gpus
            .iter()
            .find(|g| !g.mig_enabled)
            .expect("profile has a GPU without MIG")
            .minor;
        let (parent, mig) = inventory
            .gpus
            .iter()
            .find_map(|g| g.mig_devices.first().map(|m| (g.minor, m.clone())))
            .expect("profile has a MIG device");
        (whole, parent, mig)
    }

    /// The minor of a GPU without MIG other than `other`.
    pub fn another_whole_gpu(&self, other: u32) -> u32 {
        self.inventory()
            .gpus
            .iter()
            .find(|g| !g.mig_enabled && g.minor != other)
            .expect("profile has two GPUs without MIG")
            .minor
    }
}

/// A claim allocated on [`NODE`]: an allocation without a node selector gets the one
/// kube-scheduler's allocator writes for a node-local pool (kubernetes/kubernetes
/// `staging/src/k8s.io/dynamic-resource-allocation/structured/allocator.go`,
/// `createNodeSelector`: one term, `matchFields metadata.name In [<node>]`), which 1.36's
/// device-status authorization needs to let the plugin write as `associated-node`.
pub fn allocated_claim(name: &str, uid: &str, allocation: &Value) -> Value {
    let mut allocation = allocation.clone();
    if allocation.get("nodeSelector").is_none() {
        allocation["nodeSelector"] = node_selector(NODE);
    }
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {"allocation": allocation}
    })
}

/// The node selector of an allocation on `node`'s local devices.
pub fn node_selector(node: &str) -> Value {
    json!({"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [node]}
    ]}]})
}

/// A driver root with the files a real one has, so that the mounts can be checked.
fn make_driver_root(root: &Path) {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libcuda.so.570.124.06"), b"libcuda\n").unwrap();
    std::os::unix::fs::symlink("libcuda.so.570.124.06", lib.join("libcuda.so.1")).unwrap();
    std::fs::write(lib.join("libnvidia-ml.so.570.124.06"), b"libnvidia-ml\n").unwrap();
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("nvidia-smi"), b"#!/bin/sh\necho fake\n").unwrap();
}

/// The plugin as its own process (`kerf-test-plugin`), so that it can be SIGKILLed. Its
/// stderr goes to a log file that [`PluginProcess::log`] reads back for failure messages.
pub struct PluginProcess {
    child: Child,
    log: PathBuf,
}

impl PluginProcess {
    pub fn spawn(binary: &str, node: &TestNode, kubeconfig: &Path, generation: u32) -> Self {
        Self::spawn_with(binary, node, kubeconfig, generation, &[])
    }

    /// [`PluginProcess::spawn`] with `extra_args` after the node's own flags.
    pub fn spawn_with(
        binary: &str,
        node: &TestNode,
        kubeconfig: &Path,
        generation: u32,
        extra_args: &[String],
    ) -> Self {
        let log = node.root.join(format!("plugin-{generation}.log"));
        let child = Command::new(binary)
            .args(node.plugin_args())
            .args(extra_args)
            .env_clear()
            .env("KUBECONFIG", kubeconfig)
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary}: {e}"));
        PluginProcess { child, log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL: no cleanup of any kind runs in the plugin.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits until the process ended by itself (an injected abort), failing after `within`.
    pub fn wait_for_exit(&mut self, within: Duration) {
        let started = Instant::now();
        while self.is_running() {
            assert!(
                started.elapsed() < within,
                "the plugin did not exit; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Registers with the plugin on `socket` as the kubelet does, retrying until the socket
    /// answers, failing after `within`.
    pub async fn register(&self, socket: &Path, within: Duration) -> RegisteredPlugin {
        let started = Instant::now();
        loop {
            match KubeletClient::new().register(socket).await {
                Ok(registered) => return registered,
                Err(e) => assert!(
                    started.elapsed() < within,
                    "the plugin did not register: {e}; plugin log:\n{}",
                    self.log()
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
