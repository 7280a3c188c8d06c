//! A prepare makes one durable write, the checkpoint entry; the CDI spec is written without
//! an fsync because the plugin rebuilds it from the checkpoint at start-up. These tests hold
//! the plugin to that: SIGKILL it as soon as a prepare returned, damage the spec as a node
//! would (a reboot empties the tmpfs `/var/run/cdi`; a power cut can leave an unsynced file
//! on a disk empty), start it again on the same directories, and the spec must be back, whole
//! and the same, before either of its sockets accepts a connection: the kubelet cannot call
//! before that, and a container started with the IDs the first prepare returned finds them
//! defined. A repeat prepare then returns the same IDs from the checkpoint.
//!
//! The plugin runs as its own process (`kerf-test-plugin`) talking to the in-memory API over
//! HTTP, so that the kill is a real SIGKILL.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::{DRIVER, PluginProcess, TestNode, cdi_spec_file, uid};
use kerf_proto::PreparedDevice;
use kerf_proto::client::{Claim, RegisteredPlugin};
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use serde_json::Value;

const PLUGIN_BINARY: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");
const STARTED_IN: Duration = Duration::from_secs(20);

/// What a node does to an unsynced spec file while the plugin is down.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// A reboot emptied the tmpfs holding `/var/run/cdi`.
    Deleted,
    /// A power cut left the file's name but not its data on a disk.
    Truncated,
}

impl Damage {
    fn apply(self, path: &Path) {
        match self {
            Damage::Deleted => std::fs::remove_file(path).unwrap(),
            Damage::Truncated => {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .unwrap()
                    .set_len(0)
                    .unwrap();
            }
        }
    }
}

/// A node with the API served over HTTP for plugin processes.
struct Cluster {
    node: TestNode,
    kubeconfig: PathBuf,
    _server: ApiServer,
}

impl Cluster {
    async fn new() -> Self {
        let node = TestNode::new("h100-sxm-80gb");
        let server = ApiServer::start(node.api.clone()).await.unwrap();
        let kubeconfig = node.root.join("kubeconfig");
        server
            .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(common::NODE))
            .unwrap();
        Cluster {
            node,
            kubeconfig,
            _server: server,
        }
    }

    fn spawn_plugin(&self, generation: u32) -> PluginProcess {
        PluginProcess::spawn(PLUGIN_BINARY, &self.node, &self.kubeconfig, generation)
    }

    fn registration_socket(&self) -> PathBuf {
        self.node.registry_dir().join(format!("{DRIVER}-reg.sock"))
    }

    fn sockets(&self) -> [PathBuf; 2] {
        [
            self.registration_socket(),
            self.node.plugin_dir().join("dra.sock"),
        ]
    }

    fn spec_path(&self, claim: &Claim) -> PathBuf {
        self.node.cdi_dir().join(cdi_spec_file(&claim.uid))
    }

    fn claim_gets(&self, claim: &Claim) -> usize {
        let path = format!(
            "/apis/resource.k8s.io/v1/namespaces/{}/resourceclaims/{}",
            claim.namespace, claim.name
        );
        self.node
            .api
            .requests()
            .iter()
            .filter(|r| r.verb == "get" && r.path == path)
            .count()
    }
}

/// Registers with the plugin as the kubelet does, retrying until its socket answers.
async fn register(cluster: &Cluster, plugin: &PluginProcess) -> RegisteredPlugin {
    plugin
        .register(&cluster.registration_socket(), STARTED_IN)
        .await
}

async fn prepare(
    registered: &RegisteredPlugin,
    claim: &Claim,
    plugin: &PluginProcess,
) -> Vec<PreparedDevice> {
    let mut answers = registered
        .prepare(std::slice::from_ref(claim))
        .await
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()));
    answers
        .remove(&claim.uid)
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", plugin.log()))
}

fn cdi_ids(devices: &[PreparedDevice]) -> Vec<String> {
    devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
        .collect()
}

/// The CDI IDs a spec file defines; panics on a file that is not a whole spec.
fn defined_ids(bytes: &[u8]) -> Vec<String> {
    let spec: Value = serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("not a whole JSON spec ({} bytes): {e}", bytes.len()));
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            format!(
                "{}={}",
                spec["kind"].as_str().unwrap(),
                d["name"].as_str().unwrap()
            )
        })
        .collect()
}

/// Waits, checking without pause, until either socket of the restarted plugin accepts a
/// connection (until then the stale socket files the killed process left refuse them), and
/// returns the spec file's content at that moment. Checking only after the kubelet's
/// registration would miss a restore that ran after the sockets opened.
async fn spec_when_the_sockets_open(
    cluster: &Cluster,
    plugin: &mut PluginProcess,
    claim: &Claim,
) -> Option<Vec<u8>> {
    let started = Instant::now();
    let sockets = cluster.sockets();
    loop {
        if sockets.iter().any(|s| UnixStream::connect(s).is_ok()) {
            return std::fs::read(cluster.spec_path(claim)).ok();
        }
        assert!(
            plugin.is_running() && started.elapsed() < STARTED_IN,
            "the restarted plugin did not open its sockets; plugin log:\n{}",
            plugin.log()
        );
        // Lets the API server, served by this runtime, answer the plugin meanwhile.
        tokio::task::yield_now().await;
    }
}

async fn killed_after_a_prepare_and_restarted(damage: Damage) {
    let cluster = Cluster::new().await;
    let claim = cluster.node.device_claim("crash-restore", &uid(1), "gpu-0");
    let spec_path = cluster.spec_path(&claim);

    let mut first = cluster.spawn_plugin(1);
    let registered = register(&cluster, &first).await;
    let devices = prepare(&registered, &claim, &first).await;
    first.kill();
    drop(registered);

    let written = std::fs::read(&spec_path).unwrap();
    assert_eq!(
        defined_ids(&written),
        cdi_ids(&devices),
        "the spec defined the returned IDs when the prepare returned"
    );
    assert_eq!(
        cluster.node.checkpoint_claims(),
        [(claim.uid.clone(), "PrepareCompleted".to_owned())],
        "the checkpoint entry was durable before the IDs were returned"
    );
    damage.apply(&spec_path);
    let gets_before_restart = cluster.claim_gets(&claim);

    let mut second = cluster.spawn_plugin(2);
    let restored = spec_when_the_sockets_open(&cluster, &mut second, &claim).await;
    assert_eq!(
        restored.as_deref(),
        Some(written.as_slice()),
        "{damage:?} spec restored before the sockets opened; plugin log:\n{}",
        second.log()
    );
    assert_eq!(
        cluster.node.cdi_files(),
        [cdi_spec_file(&claim.uid)],
        "no temporary or other files"
    );

    let registered = register(&cluster, &second).await;
    let again = prepare(&registered, &claim, &second).await;
    assert_eq!(
        again, devices,
        "a repeat prepare returns the same devices and IDs"
    );
    assert_eq!(
        cluster.claim_gets(&claim),
        gets_before_restart,
        "the repeat prepare was answered from the checkpoint"
    );
    assert_eq!(std::fs::read(&spec_path).unwrap(), written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_deleted_after_a_kill_is_back_before_the_plugin_serves() {
    killed_after_a_prepare_and_restarted(Damage::Deleted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spec_truncated_after_a_kill_is_whole_again_before_the_plugin_serves() {
    killed_after_a_prepare_and_restarted(Damage::Truncated).await;
}
