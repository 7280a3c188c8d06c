//! The plugin killed and started again, as a node sees it: the checkpoint and the CDI specs
//! are written without fsync, so they must outlive the plugin (the page cache does) but not
//! the node, after which nothing is prepared.
//!
//! - [`same_boot`]: SIGKILL right after a prepare returned, a spec lost meanwhile; the
//!   restarted plugin has it back before it serves.
//! - [`steps`]: the plugin aborts after each step of a prepare and an unprepare
//!   (`--mock-crash-at`); the restarted plugin leaves no orphan and the kubelet's retry
//!   succeeds.
//! - [`power_loss`]: a new boot ID with the checkpoint intact, empty, torn or zeroed and a
//!   spec truncated on a disk-backed CDI directory: nothing is prepared, nothing of the
//!   older boot is left, and the kubelet's prepare starts afresh.
//!
//! The plugin runs as its own process (`kerf-test-plugin`) talking to the in-memory API over
//! HTTP, so that a kill is a real SIGKILL.

mod power_loss;
mod same_boot;
mod steps;

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::{DRIVER, PluginProcess, TestNode, cdi_spec_file};
use kerf_proto::PreparedDevice;
use kerf_proto::client::{Claim, RegisteredPlugin};
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use serde_json::Value;

const PLUGIN_BINARY: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");
pub(crate) const STARTED_IN: Duration = Duration::from_secs(20);

/// A node with the API served over HTTP for plugin processes.
pub(crate) struct Cluster {
    pub(crate) node: TestNode,
    kubeconfig: PathBuf,
    _server: ApiServer,
}

impl Cluster {
    pub(crate) async fn new() -> Self {
        Self::with_profile("h100-sxm-80gb").await
    }

    /// A node whose GPUs come from the mock profile `profile`.
    pub(crate) async fn with_profile(profile: &str) -> Self {
        let node = TestNode::new(profile);
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

    pub(crate) fn spawn_plugin(&self, generation: u32) -> PluginProcess {
        self.spawn_with(generation, &[])
    }

    /// The plugin with `extra` flags after the node's own.
    pub(crate) fn spawn_with(&self, generation: u32, extra: &[String]) -> PluginProcess {
        PluginProcess::spawn_with(
            PLUGIN_BINARY,
            &self.node,
            &self.kubeconfig,
            generation,
            extra,
        )
    }

    pub(crate) fn registration_socket(&self) -> PathBuf {
        self.node.registry_dir().join(format!("{DRIVER}-reg.sock"))
    }

    pub(crate) fn sockets(&self) -> [PathBuf; 2] {
        [
            self.registration_socket(),
            self.node.plugin_dir().join("dra.sock"),
        ]
    }

    pub(crate) fn spec_path(&self, claim: &Claim) -> PathBuf {
        self.node.cdi_dir().join(cdi_spec_file(&claim.uid))
    }

    pub(crate) fn claim_gets(&self, claim: &Claim) -> usize {
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
pub(crate) async fn register(cluster: &Cluster, plugin: &PluginProcess) -> RegisteredPlugin {
    plugin
        .register(&cluster.registration_socket(), STARTED_IN)
        .await
}

pub(crate) async fn prepare(
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

pub(crate) fn cdi_ids(devices: &[PreparedDevice]) -> Vec<String> {
    devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.iter().cloned())
        .collect()
}

/// The CDI IDs a spec file defines; panics on a file that is not a whole spec.
pub(crate) fn defined_ids(bytes: &[u8]) -> Vec<String> {
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
pub(crate) async fn spec_when_the_sockets_open(
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
