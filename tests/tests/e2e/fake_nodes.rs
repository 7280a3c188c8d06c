//! Kubelet-less nodes for scale tests of kerf-controller's placement: Node objects made Ready
//! through the status subresource (as `../shared/cluster/fake-nodes.sh` makes them), with 8
//! mock H100 each published as kerf's ResourceSlices and owned by kerf-controller.
//!
//! Nobody runs on them: no kubelet, no kerf plugin. The test plays the plugin's part in the
//! ownership protocol (`kerf_api::ownership`): it publishes the devices without an owner,
//! labels the node `gpu.kerf.dev/allocator=controller` so that kerf-controller records every
//! device as its own in the Node annotation `gpu.kerf.dev/allocators`, and publishes them
//! again with the recorded owner, as `kubelet-plugin/src/publish.rs` does. The nodes carry
//! a NoSchedule taint of their own, so ordinary pods (and kerf's plugin DaemonSet) stay off
//! them; the test's pods tolerate it and select the nodes by label. Each slice is owned by
//! its Node, so deleting the nodes deletes the slices too.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kerf_api::ownership::{self, OwnershipRecord};
use kerf_api::resourceslice::{ResourceSliceFeatures, node_slices};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt as _};
use serde_json::json;

use super::wait::{self, Poll};

/// Label (and taint key) of the test's nodes.
pub const LABEL: &str = "e2e.gpu.kerf.dev/fake-node";
/// The mock GPUs of each node (`kerf_core::mock::from_spec`).
const GPUS: &str = "h100-sxm-80gb";
/// GPUs per node.
pub const GPUS_PER_NODE: usize = 8;
/// The field manager of the test's writes.
const MANAGER: &str = "kerf-e2e-fake-nodes";

/// What each fake node offers.
#[derive(Debug, Clone)]
pub struct Shape {
    /// `cpu` of capacity and allocatable.
    pub cpu: String,
    /// `memory` of capacity and allocatable.
    pub memory: String,
    /// `pods` of capacity and allocatable.
    pub pods: String,
}

/// The fake nodes of one test, by name.
#[derive(Debug, Clone)]
pub struct FakeNodes {
    /// Node names, in order.
    pub names: Vec<String>,
}

/// The Node `name`, labelled and tainted as the test's (the status is written apart).
fn node(name: &str) -> Result<Node> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {
            LABEL: "true",
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            ownership::NODE_LABEL: "controller",
        }},
        "spec": {"taints": [{"key": LABEL, "value": "true", "effect": "NoSchedule"}]},
    }))?)
}

/// The status a kubelet would post: Ready, no pressure, capacity = allocatable = `shape`.
fn status(shape: &Shape) -> serde_json::Value {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({"type": type_, "status": status, "reason": reason, "message": "fake node",
               "lastHeartbeatTime": now, "lastTransitionTime": now})
    };
    let resources = json!({"cpu": shape.cpu, "memory": shape.memory, "pods": shape.pods});
    json!({"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [
            condition("Ready", "True", "KubeletReady"),
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID"),
        ],
    }})
}

/// Creates `count` Ready nodes `<prefix>-00001` … of `shape`; on failure deletes those it
/// made. Admission adds the `node.kubernetes.io/not-ready` taint to every new node and only a
/// node lifecycle controller would lift it, so the spec's taints are written again after the
/// status.
pub async fn create(
    client: &Client,
    driver: &str,
    prefix: &str,
    count: usize,
    shape: &Shape,
) -> Result<FakeNodes> {
    let mut fake = FakeNodes {
        names: Vec::with_capacity(count),
    };
    for i in 1..=count {
        let name = format!("{prefix}-{i:05}");
        if let Err(error) = create_one(client, &name, shape, &mut fake).await {
            if let Err(cleanup) = delete(client, driver, &fake).await {
                eprintln!("deleting the fake nodes made so far failed: {cleanup:#}");
            }
            return Err(error);
        }
    }
    Ok(fake)
}

async fn create_one(
    client: &Client,
    name: &str,
    shape: &Shape,
    fake: &mut FakeNodes,
) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let params = PatchParams::default();
    nodes
        .create(&PostParams::default(), &node(name)?)
        .await
        .with_context(|| format!("creating Node {name}"))?;
    fake.names.push(name.to_owned());
    nodes
        .patch_status(name, &params, &Patch::Merge(status(shape)))
        .await
        .with_context(|| format!("writing the status of Node {name}"))?;
    let taints =
        json!({"spec": {"taints": [{"key": LABEL, "value": "true", "effect": "NoSchedule"}]}});
    nodes
        .patch(name, &params, &Patch::Merge(taints))
        .await
        .with_context(|| format!("dropping the not-ready taint of Node {name}"))?;
    Ok(())
}

/// The ResourceSlices of `node` (uid `uid`) as kerf's plugin publishes them under `record`.
fn slices(
    driver: &str,
    node: &str,
    uid: &str,
    record: &OwnershipRecord,
) -> Result<Vec<ResourceSlice>> {
    let inventory = kerf_core::mock::from_spec(GPUS)?;
    let mut specs = node_slices(&inventory, driver, node, ResourceSliceFeatures::default())?;
    ownership::publish_owners(&mut specs, record);
    let owner = OwnerReference {
        api_version: "v1".to_owned(),
        kind: "Node".to_owned(),
        name: node.to_owned(),
        uid: uid.to_owned(),
        ..OwnerReference::default()
    };
    Ok(specs
        .into_iter()
        .enumerate()
        .map(|(i, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(kerf_api::slice_name(node, driver, i)),
                owner_references: Some(vec![owner.clone()]),
                ..ObjectMeta::default()
            },
            spec,
        })
        .collect())
}

/// Publishes (creates or replaces) the slices of every node under its current record.
async fn publish(client: &Client, driver: &str, fake: &FakeNodes) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let params = PatchParams::apply(MANAGER).force();
    for name in &fake.names {
        let node = nodes.get(name).await?;
        let record = OwnershipRecord::from_annotations(node.metadata.annotations.as_ref())?;
        let uid = node.metadata.uid.clone().unwrap_or_default();
        for slice in slices(driver, name, &uid, &record)? {
            let mut value = serde_json::to_value(&slice)?;
            value["apiVersion"] = json!("resource.k8s.io/v1");
            value["kind"] = json!("ResourceSlice");
            api.patch(&slice.name_any(), &params, &Patch::Apply(value))
                .await
                .with_context(|| format!("publishing ResourceSlice {}", slice.name_any()))?;
        }
    }
    Ok(())
}

/// Publishes every node's GPUs, waits until kerf-controller has recorded all of them as its
/// own, and publishes them again with that owner, as the plugin would.
pub async fn publish_controller_gpus(
    client: &Client,
    driver: &str,
    fake: &FakeNodes,
    timeout: Duration,
) -> Result<()> {
    publish_gpus(client, driver, fake, ownership::Owner::Controller, timeout).await
}

/// Pins every node's devices to `owner` with the Node label `gpu.kerf.dev/allocator`.
pub async fn pin(client: &Client, fake: &FakeNodes, owner: ownership::Owner) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let label = json!({"metadata": {"labels": {ownership::NODE_LABEL: owner.as_str()}}});
    for name in &fake.names {
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .with_context(|| format!("pinning Node {name} to {}", owner.as_str()))?;
    }
    Ok(())
}

/// Publishes every node's GPUs, waits until kerf-controller has recorded all of them as
/// `owner`'s (the nodes must be pinned to it, [`pin`]), and publishes them again with that
/// owner, as the plugin would.
pub async fn publish_gpus(
    client: &Client,
    driver: &str,
    fake: &FakeNodes,
    owner: ownership::Owner,
    timeout: Duration,
) -> Result<()> {
    publish(client, driver, fake).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let on_fake: BTreeSet<&str> = fake.names.iter().map(String::as_str).collect();
    let listed = ListParams::default().labels(LABEL);
    wait::poll_until(
        format_args!(
            "kerf-controller to record the fake nodes' GPUs as {}'s",
            owner.as_str()
        ),
        timeout,
        || async {
            let mut short = Vec::new();
            for node in nodes.list(&listed).await?.items {
                let name = node.name_any();
                if !on_fake.contains(name.as_str()) {
                    continue;
                }
                let record = OwnershipRecord::from_annotations(node.metadata.annotations.as_ref())?;
                let owned = record.0.values().filter(|o| **o == owner).count();
                if owned < GPUS_PER_NODE {
                    short.push(format!("{name}: {owned}"));
                }
            }
            Ok(if short.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending(format!(
                    "{} nodes short of {} GPUs owned by {}, e.g. {:?}",
                    short.len(),
                    GPUS_PER_NODE,
                    owner.as_str(),
                    short.iter().take(5).collect::<Vec<_>>()
                ))
            })
        },
    )
    .await?;
    publish(client, driver, fake).await
}

/// Deletes the pods bound to the fake nodes at once (no kubelet will ever stop them), then the
/// nodes (their slices go with them, by owner reference, and are deleted here too).
pub async fn delete(client: &Client, driver: &str, fake: &FakeNodes) -> Result<()> {
    let pods: Api<Pod> = Api::all(client.clone());
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    let on_fake: BTreeSet<&str> = fake.names.iter().map(String::as_str).collect();
    for pod in pods.list(&ListParams::default()).await?.items {
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if bound.is_some_and(|node| on_fake.contains(node)) {
            let namespaced: Api<Pod> =
                Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
            ignore_absent(namespaced.delete(&pod.name_any(), &now).await)?;
        }
    }
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let nodes: Api<Node> = Api::all(client.clone());
    for name in &fake.names {
        let inventory = kerf_core::mock::from_spec(GPUS)?;
        let count = node_slices(&inventory, driver, name, ResourceSliceFeatures::default())?.len();
        for i in 0..count {
            let slice = kerf_api::slice_name(name, driver, i);
            ignore_absent(slices.delete(&slice, &DeleteParams::default()).await)?;
        }
        ignore_absent(nodes.delete(name, &DeleteParams::default()).await)?;
    }
    Ok(())
}

fn ignore_absent<T>(result: kube::Result<T>) -> Result<()> {
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Checks that the test's node count and pod count make sense: every pod needs a node of its
/// own (its CPU request takes more than half a node).
pub fn check_counts(nodes: usize, pods: usize) -> Result<()> {
    ensure!(nodes >= 1, "at least one fake node is needed");
    ensure!(
        pods <= nodes,
        "{pods} pods of more than half a node's CPU each cannot all bind on {nodes} nodes"
    );
    Ok(())
}
