//! A node for the kubelet plugin driven as the kubelet drives it (`plugin.rs`,
//! `scheduler_slices.rs`): its directories under a temporary root, a mock H100 inventory, the
//! in-memory API server behind a real kube client, and the claims it serves.
#![allow(
    clippy::needless_pass_by_value,
    reason = "the claim builders take JSON values as the tests write them inline"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::{Discovery, PluginConfig};
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_proto::client::{Claim, KubeletClient, RegisteredPlugin};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::fake_api::Identity;
use serde_json::{Value, json};

pub use kerf_tests::fixtures::DRIVER;
pub const NODE: &str = "node-1";

pub struct Node {
    _root: tempfile::TempDir,
    pub root: PathBuf,
    pub api: FakeApi,
}

impl Node {
    pub fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().to_owned();
        std::fs::write(path.join("boot_id"), "boot-1\n").unwrap();
        make_driver_root(&path.join("driver-root"));
        Node {
            _root: root,
            root: path,
            api: FakeApi::new(),
        }
    }

    pub fn config(&self) -> PluginConfig {
        PluginConfig {
            claim_device_status: true,
            claim_cache: true,
            ..PluginConfig::under(
                &self.root,
                DRIVER,
                NODE,
                Discovery::MockProfile("h100-sxm-80gb".into()),
            )
        }
    }

    /// A client of the in-memory API as the kubelet plugin on [`NODE`] talks to it.
    pub fn plugin_client(&self) -> kube::Client {
        self.api.client_as(Identity::kerf_kubelet_plugin(NODE))
    }

    pub async fn start(&self) -> RunningPlugin {
        let config = self.config();
        let inventory = plugin::discover(&config).unwrap();
        let connections = Connections::reading(Arc::new(ApiClaimReader::new(self.plugin_client())));
        plugin::start(&config, inventory, connections)
            .await
            .unwrap()
    }

    /// Starts the plugin publishing, on a Node carrying `annotations` (e.g. the shared
    /// publication kerf-controller writes), and returns once its publisher has read the Node:
    /// the publisher GETs the Node before its first publish, so a slice means it has.
    #[allow(
        dead_code,
        reason = "plugin.rs shares this module and starts no publisher"
    )]
    pub async fn start_publishing(&self, annotations: Value) -> RunningPlugin {
        self.api.insert(json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": NODE, "annotations": annotations},
        }));
        let config = self.config();
        let inventory = plugin::discover(&config).unwrap();
        let connections = Connections {
            publisher: Some(self.plugin_client()),
            ..Connections::reading(Arc::new(ApiClaimReader::new(self.plugin_client())))
        };
        let running = plugin::start(&config, inventory, connections)
            .await
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self
            .api
            .list("/apis/resource.k8s.io/v1/resourceslices")
            .is_empty()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the publisher never published"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        running
    }

    pub async fn kubelet(&self, known: &[&str]) -> RegisteredPlugin {
        KubeletClient::new()
            .knowing(known)
            .register(&self.config().registration_socket)
            .await
            .unwrap()
    }

    pub fn cdi_files(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.root.join("cdi"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    pub fn cdi_spec(&self, uid: &str) -> Value {
        let path = self
            .root
            .join("cdi")
            .join(format!("k8s.{DRIVER}-gpu_{uid}.json"));
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap()
    }

    pub fn checkpoint(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.config().checkpoint_file).unwrap()).unwrap()
    }

    pub fn add_claim(&self, claim: Value) {
        self.api.insert(claim);
    }
}

/// A driver root with the files a real one has, so that the mounts can be checked.
pub fn make_driver_root(root: &std::path::Path) {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libcuda.so.570.124.06"), b"elf").unwrap();
    std::os::unix::fs::symlink("libcuda.so.570.124.06", lib.join("libcuda.so.1")).unwrap();
    std::fs::write(lib.join("libnvidia-ml.so.570.124.06"), b"elf").unwrap();
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("nvidia-smi"), b"#!/bin/sh\n").unwrap();
}

/// A ResourceClaim allocated on this node with the given (request, driver, pool, device) results.
pub fn allocated_claim(
    name: &str,
    uid: &str,
    results: &[(&str, &str, &str, &str)],
    config: Value,
) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|(request, driver, pool, device)| json!({"request": request, "driver": driver, "pool": pool, "device": device}))
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.kerf.dev"}}]}},
        "status": {"allocation": {
            "devices": {"results": results, "config": config},
            // As kube-scheduler pins a node-local allocation, which 1.36's device-status
            // authorization needs to let the plugin write as `associated-node`.
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}
            ]}]},
        }}
    })
}

pub fn whole_gpu_claim(name: &str, uid: &str, device: &str) -> Value {
    allocated_claim(name, uid, &[("gpu", DRIVER, NODE, device)], json!([]))
}

pub const UID_A: &str = "11111111-1111-4111-8111-111111111111";
pub const UID_B: &str = "22222222-2222-4222-8222-222222222222";
pub const UID_C: &str = "33333333-3333-4333-8333-333333333333";

pub fn claim(name: &str, uid: &str) -> Claim {
    Claim::new("default", name, uid)
}

pub fn mock_uuid(node: &Node, minor: u32) -> String {
    let inventory = plugin::discover(&node.config()).unwrap();
    inventory.gpu_by_minor(minor).unwrap().uuid.clone()
}

pub fn slice_allocation(device: &str, uuid: &str, memory_bytes: u64, compute: u8) -> Value {
    json!([{"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuSliceAllocation",
        "devices": [{"pool": NODE, "device": device, "gpuUUID": uuid,
                     "memoryBytes": memory_bytes, "computePercent": compute, "sharing": "MPS"}]}}}])
}
