//! The cluster of `controller-footprint`, stored in the in-memory API server before any
//! kerf-controller starts: kerf's GpuClasses and webhook configurations as the chart
//! installs them, and Ready nodes of 8 mock H100 pinned to the controller, each with a copy of
//! one ResourceSlice the real kubelet-plugin publisher wrote.
//!
//! Ownership is settled as the controller finds it on a running cluster whose nodes were
//! pinned long ago: each Node carries the label `gpu.kerf.dev/allocator=controller` and the
//! ownership record naming every GPU the controller's, and the slice publishes every GPU with
//! `allocator: controller`. The controller still waits its settle period after first seeing
//! the slices before it places anything (its fence); the benchmark waits for that with a
//! warm-up pod (see the module above).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::ownership::{NODE_LABEL, Owner, OwnershipRecord, RECORD_ANNOTATION};
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::sim::DRIVER;
use kerf_tests::sim::cluster::{NodeSpec, gpu_classes, h100_nodes};
use kube::ResourceExt;
use serde_json::{Value, json};

use crate::{Error, Result};

/// kerf's default install, whose MutatingWebhookConfigurations the replicas keep.
const WEBHOOKS: &str = kerf_tests::manifests::INSTALL;

/// Stores GpuClasses, webhook configurations, `nodes` Ready nodes and their slices; returns the
/// node names. The first node's slices are published by the real publisher (as its kubelet
/// plugin, through RBAC and kerf's ValidatingAdmissionPolicy); the others get copies of them
/// with their own node, pool, slice name and owner reference.
///
/// # Errors
/// A manifest does not parse, or the publisher fails.
pub(super) async fn install(fake: &FakeApi, nodes: usize) -> Result<Vec<String>> {
    for class in gpu_classes()? {
        fake.insert(class);
    }
    for config in webhook_configurations()? {
        fake.insert(config);
    }
    let specs: Vec<NodeSpec> = h100_nodes(nodes)
        .into_iter()
        .map(|mut spec| {
            spec.labels
                .insert(NODE_LABEL.to_owned(), Owner::Controller.as_str().to_owned());
            spec
        })
        .collect();
    let Some(first) = specs.first() else {
        return Err(Error::InvalidOption {
            option: "controller_nodes",
            reason: "must be at least 1".into(),
        });
    };
    let inventory = first.inventory()?;
    let record = OwnershipRecord(
        inventory
            .devices()
            .map(|d| (d.name(), Owner::Controller))
            .collect::<BTreeMap<_, _>>(),
    )
    .to_annotation();
    let mut uids = Vec::with_capacity(specs.len());
    for spec in &specs {
        let mut node = spec.node_object();
        node["metadata"]["annotations"] = json!({ RECORD_ANNOTATION: record });
        let stored = fake.insert(node);
        uids.push(
            stored["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    let template = publish_once(fake, &first.name, &inventory).await?;
    for (spec, uid) in specs.iter().zip(&uids).skip(1) {
        for (index, slice) in template.iter().enumerate() {
            fake.insert(copy_for(slice, index, &spec.name, uid)?);
        }
    }
    Ok(specs.into_iter().map(|s| s.name).collect())
}

/// The MutatingWebhookConfigurations of `deploy/kerf.yaml`.
fn webhook_configurations() -> Result<Vec<Value>> {
    let documents: Vec<Value> = serde_saphyr::from_multiple(WEBHOOKS)
        .map_err(|e| Error::Workload(format!("deploy/kerf.yaml does not parse: {e}")))?;
    Ok(documents
        .into_iter()
        .filter(|d| d["kind"] == "MutatingWebhookConfiguration")
        .collect())
}

/// Runs the real publisher once for `node`, as that node's kubelet plugin, and returns the
/// slices it wrote.
async fn publish_once(
    fake: &FakeApi,
    node: &str,
    inventory: &kerf_core::inventory::Inventory,
) -> Result<Vec<ResourceSlice>> {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = kerf_kubelet_plugin::metrics::Metrics::new(&mut registry);
    let publisher = kerf_kubelet_plugin::publish::Publisher::new(
        fake.client_as(Identity::kerf_kubelet_plugin(node)),
        DRIVER.to_owned(),
        node.to_owned(),
        metrics,
    );
    publisher.publish(inventory).await?;
    let mut slices: Vec<ResourceSlice> = fake
        .list_resources::<ResourceSlice>(None)
        .into_iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(node))
        .collect();
    slices.sort_by_key(ResourceExt::name_any);
    if slices.is_empty() {
        return Err(Error::Workload(format!(
            "the publisher of {node} wrote no ResourceSlice"
        )));
    }
    Ok(slices)
}

/// Slice `index` of `template` as node `node` (uid `uid`) would publish it.
fn copy_for(template: &ResourceSlice, index: usize, node: &str, uid: &str) -> Result<Value> {
    let mut slice = serde_json::to_value(template)
        .map_err(|e| Error::Workload(format!("slice does not serialize: {e}")))?;
    slice["apiVersion"] = json!("resource.k8s.io/v1");
    slice["kind"] = json!("ResourceSlice");
    let metadata = &mut slice["metadata"];
    for server_set in [
        "uid",
        "resourceVersion",
        "creationTimestamp",
        "managedFields",
    ] {
        if let Some(map) = metadata.as_object_mut() {
            map.remove(server_set);
        }
    }
    metadata["name"] = json!(kerf_api::slice_name(node, DRIVER, index));
    if let Some(owners) = metadata["ownerReferences"].as_array_mut() {
        for owner in owners {
            owner["name"] = json!(node);
            owner["uid"] = json!(uid);
        }
    }
    slice["spec"]["nodeName"] = json!(node);
    slice["spec"]["pool"]["name"] = json!(node);
    unique_uuids(&mut slice["spec"], node);
    Ok(slice)
}

/// Gives each GPU of `spec` a UUID of its own on `node`, as real GPUs have: copies of one slice
/// would otherwise share every attribute value, which the controller's slice cache stores once
/// (`kerf_controller::cache::Interner`), and the benchmark would understate its memory. The
/// last group of the UUID becomes a hash of the node and the original.
fn unique_uuids(spec: &mut Value, node: &str) {
    let devices = spec.get_mut("devices").and_then(Value::as_array_mut);
    for device in devices.into_iter().flatten() {
        let uuid = device
            .get_mut("attributes")
            .and_then(|a| a.get_mut(kerf_api::resourceslice::attributes::UUID))
            .and_then(|a| a.get_mut("string"));
        if let Some(Value::String(uuid)) = uuid
            && let Some((head, _)) = uuid.rsplit_once('-')
        {
            let mut hasher = std::hash::DefaultHasher::new();
            std::hash::Hash::hash(&(node, uuid.as_str()), &mut hasher);
            let tail = std::hash::Hasher::finish(&hasher) & 0xffff_ffff_ffff;
            *uuid = format!("{head}-{tail:012x}");
        }
    }
}
