//! What one cached object costs kerf-controller's heap, full and as the caches keep it
//! (`kerf_controller::cache::strip`), for the objects a real cluster holds: a Job's pod as
//! kube-apiserver serves it once scheduled and running (ServiceAccount token volume, default
//! tolerations, container statuses, managedFields of four writers) and a kubelet-registered
//! Node (images, addresses, capacity, five conditions). Run with `--nocapture` for the
//! figures; the assertions hold what stripping must save. Each figure is the resident growth
//! of a fresh child process (the test binary run again) that decodes and keeps 2000 objects.

use std::process::Command;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_controller::cache::{CompactResourceSlice, Interner, strip};
use serde_json::{Value, json};

/// The child's environment variable naming what it decodes: `<kind>` or `<kind>-stripped`.
const CHILD: &str = "KERF_CACHE_SIZES_CHILD";
/// Objects each child decodes and keeps: enough that a page of RSS is noise.
const COUNT: usize = 2000;

fn managed_fields(managers: &[&str]) -> Value {
    managers
        .iter()
        .map(|manager| {
            json!({"manager": manager, "operation": "Update", "apiVersion": "v1",
                   "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
                   "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                                "f:spec": {"f:containers": {"k:{\"name\":\"main\"}": {".": {}, "f:image": {}, "f:name": {}, "f:resources": {".": {}, "f:claims": {}}}}},
                                "f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:status": {}, "f:type": {}}}}}})
        })
        .collect()
}

fn pod(i: usize) -> Value {
    let condition = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"});
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("train-{i}-x7k2p"), "generateName": format!("train-{i}-"), "namespace": "ml",
            "uid": format!("0b7f5d2e-6d1a-4d6b-9a1e-{i:012}"), "resourceVersion": "123456",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"batch.kubernetes.io/job-name": format!("train-{i}"), "job-name": format!("train-{i}"),
                       "batch.kubernetes.io/controller-uid": "5c1e", "controller-uid": "5c1e"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": format!("train-{i}"), "uid": "5c1e", "controller": true, "blockOwnerDeletion": true}],
            "finalizers": ["batch.kubernetes.io/job-tracking"],
            "managedFields": managed_fields(&["kube-controller-manager", "kube-scheduler", "kubelet", "kerf-controller"])
        },
        "spec": {
            "nodeName": format!("node-{}", i % 500),
            "restartPolicy": "Never", "serviceAccountName": "default", "schedulerName": "default-scheduler",
            "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst", "enableServiceLinks": true,
            "priority": 0, "preemptionPolicy": "PreemptLowerPriority",
            "securityContext": {},
            "resourceClaims": [{"name": "gpu", "resourceClaimName": format!("train-{i}-gpu")}],
            "containers": [{
                "name": "main", "image": "nvcr.io/nvidia/pytorch:25.01-py3", "imagePullPolicy": "IfNotPresent",
                "command": ["python", "train.py"], "args": ["--epochs", "10"],
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}],
                "resources": {"claims": [{"name": "gpu"}]},
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "volumeMounts": [{"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}]
            }],
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            ],
            "volumes": [{"name": "kube-api-access-abcde", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}
            ]}}]
        },
        "status": {
            "phase": "Running", "qosClass": "BestEffort", "startTime": "2026-01-01T00:00:01Z",
            "hostIP": "10.0.3.7", "hostIPs": [{"ip": "10.0.3.7"}], "podIP": "10.244.3.17", "podIPs": [{"ip": "10.244.3.17"}],
            "conditions": (["PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled", "gpu.kerf.dev/GpuAllocation"].map(condition)),
            "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": format!("train-{i}-gpu")}],
            "containerStatuses": [{"name": "main", "ready": true, "started": true, "restartCount": 0,
                "image": "nvcr.io/nvidia/pytorch:25.01-py3", "imageID": "nvcr.io/nvidia/pytorch@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "containerID": "containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "state": {"running": {"startedAt": "2026-01-01T00:00:02Z"}}}]
        }
    })
}

fn node(i: usize) -> Value {
    let condition = |(t, s): (&str, &str)| {
        json!({"type": t, "status": s, "reason": format!("Kubelet{t}"),
        "message": "kubelet has sufficient resources", "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"})
    };
    let images: Vec<Value> = (0..12)
        .map(|n| json!({"names": [format!("registry.k8s.io/image-{n}@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"), format!("registry.k8s.io/image-{n}:v1.36.2")], "sizeBytes": 123_456_789}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": format!("node-{i}"), "uid": format!("8d1c-{i:012}"), "resourceVersion": "98765",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"kubernetes.io/hostname": format!("node-{i}"), "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64", "node.kubernetes.io/instance-type": "p5.48xlarge",
                       "topology.kubernetes.io/zone": "zone-a", "topology.kubernetes.io/region": "region-1", "gpu.kerf.dev/allocator": "controller"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                            "gpu.kerf.dev/ownership": "v1;gpu-0=c,gpu-1=c,gpu-2=c,gpu-3=c,gpu-4=c,gpu-5=c,gpu-6=c,gpu-7=c"},
            "managedFields": managed_fields(&["kubelet", "kube-controller-manager", "kerf-controller"])
        },
        "spec": {"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"], "providerID": format!("aws:///zone-a/i-{i:017}")},
        "status": {
            "capacity": {"cpu": "192", "memory": "2097152Mi", "pods": "110", "ephemeral-storage": "1Ti", "hugepages-1Gi": "0", "hugepages-2Mi": "0"},
            "allocatable": {"cpu": "191", "memory": "2090000Mi", "pods": "110", "ephemeral-storage": "900Gi", "hugepages-1Gi": "0", "hugepages-2Mi": "0"},
            "conditions": ([("MemoryPressure", "False"), ("DiskPressure", "False"), ("PIDPressure", "False"), ("Ready", "True")].map(condition)),
            "addresses": [{"type": "InternalIP", "address": "10.0.3.7"}, {"type": "Hostname", "address": format!("node-{i}")}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": "0123456789abcdef", "systemUUID": "0123-4567", "bootID": "89ab-cdef", "kernelVersion": "6.8.0",
                         "osImage": "Ubuntu 24.04 LTS", "containerRuntimeVersion": "containerd://2.0.0", "kubeletVersion": "v1.36.2",
                         "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
            "images": images
        }
    })
}

fn claim(i: usize) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {
            "name": format!("train-{i}-gpu"), "namespace": "ml", "uid": format!("c1a1-{i:012}"), "resourceVersion": "5",
            "creationTimestamp": "2026-01-01T00:00:00Z", "finalizers": ["gpu.kerf.dev/allocation"],
            "labels": {"gpu.kerf.dev/node": format!("node-{}", i % 500)},
            "annotations": {"gpu.kerf.dev/allocated-node": format!("node-{}", i % 500)},
            "managedFields": managed_fields(&["kubectl", "kerf-controller", "kube-controller-manager"])
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.kerf.dev-slice"}}],
                 "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.kerf.dev", "parameters": {"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memory": "10Gi", "compute": 10}}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.kerf.dev", "pool": format!("node-{}", i % 500), "device": "gpu-0"}],
                           "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.kerf.dev", "parameters": {"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memory": "10Gi", "compute": 10}}}]},
                           "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [format!("node-{}", i % 500)]}]}]}},
            "reservedFor": [{"resource": "pods", "name": format!("train-{i}-x7k2p"), "uid": format!("0b7f5d2e-6d1a-4d6b-9a1e-{i:012}")}]
        }
    })
}

/// A ResourceSlice of a node of 8 mock H100 as kerf's kubelet plugin publishes it (the slices
/// `kerf-bench controller-footprint` copies to every node).
fn slice(i: usize) -> Value {
    let inventory = kerf_tests::sim::cluster::h100_nodes(1)[0]
        .inventory()
        .unwrap();
    let node = format!("node-{i}");
    let mut spec = kerf_api::resourceslice::resource_slices(&inventory, "gpu.kerf.dev", &node)
        .unwrap()
        .remove(0);
    // Every node's GPUs have UUIDs of their own (the slice cache shares equal values).
    for device in spec.devices.iter_mut().flatten() {
        let uuid = device
            .attributes
            .as_mut()
            .and_then(|a| a.get_mut(kerf_api::resourceslice::attributes::UUID))
            .and_then(|a| a.string.as_mut())
            .unwrap();
        *uuid = format!("{uuid}-{i}");
    }
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": kerf_api::slice_name(&node, "gpu.kerf.dev", 0), "uid": format!("5l1c-{i:012}"),
                     "resourceVersion": "4", "creationTimestamp": "2026-01-01T00:00:00Z",
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": format!("8d1c-{i:012}"), "controller": true}]},
        "spec": spec
    })
}

/// Resident anonymous memory (the heap): `VmRSS` also counts the test binary's code pages, which
/// the first decode of each type faults in, megabytes in a large test binary.
fn rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Resident bytes that `COUNT` objects of `json`, decoded as `K` and passed through `strip`
/// one by one (as the watch does), add to the process.
fn resident<K: serde::de::DeserializeOwned>(
    json: fn(usize) -> Value,
    strip: Option<fn(&mut K)>,
) -> usize {
    let before = rss();
    let objects: Vec<K> = (0..COUNT)
        .map(|i| {
            let mut object = serde_json::from_value::<K>(json(i)).unwrap();
            if let Some(strip) = strip {
                strip(&mut object);
            }
            object
        })
        .collect();
    let after = rss();
    drop(objects);
    after.saturating_sub(before)
}

/// Resident bytes that `COUNT` slices add as the controller caches them: compacted one by one
/// with the attribute names shared, as the slice watch does.
fn compact_slices_resident() -> usize {
    let before = rss();
    let mut interner = Interner::default();
    let objects: Vec<CompactResourceSlice> = (0..COUNT)
        .map(|i| {
            CompactResourceSlice::new(serde_json::from_value(slice(i)).unwrap(), &mut interner)
        })
        .collect();
    let after = rss();
    drop(objects);
    after.saturating_sub(before)
}

/// Runs in a child process of [`stripping_keeps_a_fraction_of_pods_and_nodes`]: prints the
/// bytes per object of what `CHILD` names.
#[test]
#[ignore = "a child process of stripping_keeps_a_fraction_of_pods_and_nodes"]
fn child() {
    let Ok(what) = std::env::var(CHILD) else {
        return;
    };
    let bytes = match what.as_str() {
        "pod" => resident::<Pod>(pod, None),
        "pod-managed" => resident::<Pod>(pod, Some(strip::managed_fields)),
        "pod-stripped" => resident::<Pod>(pod, Some(strip::pod)),
        "node" => resident::<Node>(node, None),
        "node-managed" => resident::<Node>(node, Some(strip::managed_fields)),
        "node-stripped" => resident::<Node>(node, Some(strip::node)),
        "claim" => resident::<ResourceClaim>(claim, None),
        "slice" => resident::<ResourceSlice>(slice, None),
        "slice-compact" => compact_slices_resident(),
        "claim-stripped" => resident::<ResourceClaim>(claim, Some(strip::managed_fields)),
        other => panic!("unknown {other}"),
    };
    println!("bytes-per-object={}", bytes / COUNT);
}

/// The name the test binary knows [`child`] by: its module path below the crate.
fn child_test_name() -> String {
    let module = module_path!();
    let below_crate = module.split_once("::").map_or(module, |(_, path)| path);
    format!("{below_crate}::child")
}

/// Bytes per object of `what`, measured in a fresh process (freed memory of another
/// measurement would otherwise be reused and hide what this one costs).
fn measured(what: &str) -> usize {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &child_test_name(),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, what)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .split("bytes-per-object=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no figure from the child for {what}: {stdout}"))
        .parse()
        .unwrap()
}

#[test]
fn stripping_keeps_a_fraction_of_pods_and_nodes() {
    let [pod, pod_managed, pod_kept] = ["pod", "pod-managed", "pod-stripped"].map(measured);
    let [node, node_managed, node_kept] = ["node", "node-managed", "node-stripped"].map(measured);
    let [claim, claim_kept] = ["claim", "claim-stripped"].map(measured);
    let [slice, slice_kept] = ["slice", "slice-compact"].map(measured);
    println!(
        "resident bytes per cached object: Pod {pod} full, {pod_managed} without managedFields, \
         {pod_kept} as cached; Node {node} full, {node_managed} without managedFields, \
         {node_kept} as cached; ResourceClaim {claim} full, {claim_kept} as cached; kerf's \
         ResourceSlice of 8 H100 {slice} full (no managedFields), {slice_kept} as cached"
    );
    assert!(
        slice_kept * 2 < slice,
        "a compacted slice keeps under half of k8s-openapi's maps"
    );
    // About half in either case; each figure also carries the allocator's own overhead per
    // object (some hundred bytes, varying from build to build), hence the margin.
    assert!(
        pod_kept * 10 < pod_managed * 7,
        "a pod keeps under 70 % of what managedFields left"
    );
    assert!(
        node_kept * 10 < node_managed * 7,
        "a node keeps under 70 % of what managedFields left"
    );
    assert!(claim_kept < claim, "a claim loses its managedFields");
}
