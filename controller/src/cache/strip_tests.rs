//! Every reader of a cached kind answers the same on the stripped object as on the full one.

use super::*;
use crate::claims::consumers;
use crate::claims::nodes::node_fits;
use crate::claims::write::has_condition;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::pod_resources::{host_ports, node_allocatable, pod_resource_requests, priority};
use kube::ResourceExt as _;
use serde_json::json;

/// A pod that sets every field any reader looks at, and a good deal nobody reads.
fn full_pod(phase: &str, node_name: Option<&str>) -> Pod {
    let resources = json!({
        "requests": {"cpu": "1", "gpu.kerf.dev/gpu": "1"},
        "limits": {"gpu.kerf.dev/gpu": "1", "example.com/fpga": "2"},
        "claims": [{"name": "gpu"}]
    });
    serde_json::from_value(json!({
        "metadata": {
            "name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "7",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": "train"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{…}"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "r1", "controller": true}],
            "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
        },
        "spec": {
            "nodeName": node_name,
            "nodeSelector": {"zone": "a"},
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpus", "operator": "In", "values": ["8"]}]}
                ]}},
                "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "train"}}}
                ]}
            },
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "schedulingGates": [{"name": "gpu.kerf.dev/allocation"}],
            "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared"},
                {"name": "b", "resourceClaimTemplateName": "tpl"},
                {"name": "c", "resourceClaimTemplateName": "tpl2"}
            ],
            "containers": [{
                "name": "main", "image": "cuda:12", "command": ["train"],
                "env": [{"name": "A", "value": "b"}], "resources": resources,
                "ports": [{"containerPort": 80, "hostPort": 8080}, {"containerPort": 9090}]
            }],
            "initContainers": [
                {"name": "sidecar", "image": "s", "restartPolicy": "Always",
                 "resources": {"requests": {"memory": "1Gi"}, "limits": {"gpu.kerf.dev/gpu": "1"}},
                 "ports": [{"containerPort": 53, "hostPort": 53, "protocol": "UDP"}]},
                {"name": "init", "image": "i", "resources": {"requests": {"cpu": "4"}, "limits": {"gpu.kerf.dev/gpu": "3"}}}
            ],
            "overhead": {"cpu": "250m", "memory": "120Mi"},
            "resources": {"requests": {"memory": "8Gi"}},
            "priority": 1000,
            "volumes": [{"name": "data", "emptyDir": {}}]
        },
        "status": {
            "phase": phase,
            "nominatedNodeName": "n2",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "gpu.kerf.dev/GpuAllocation", "status": "True"}],
            "resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x7k"}],
            "extendedResourceClaimStatus": {"resourceClaimName": "p-ext", "requestMappings": []},
            "containerStatuses": [{"name": "main", "image": "cuda:12", "imageID": "", "ready": false, "restartCount": 0}],
            "podIP": "10.0.0.1"
        }
    }))
    .unwrap()
}

#[allow(clippy::needless_pass_by_value)] // `json!` takes the values by reference anyway
fn full_node(name: &str, labels: serde_json::Value, taints: serde_json::Value) -> Node {
    serde_json::from_value(json!({
        "metadata": {
            "name": name, "uid": format!("uid-{name}"), "resourceVersion": "3", "labels": labels,
            "annotations": {"gpu.kerf.dev/ownership": "record", "gpu.kerf.dev/shared": "publication"},
            "managedFields": [{"manager": "kubelet", "operation": "Update"}]
        },
        "spec": {"taints": taints, "podCIDR": "10.0.0.0/24"},
        "status": {
            "conditions": [
                {"type": "MemoryPressure", "status": "False"},
                {"type": "Ready", "status": "True", "message": "kubelet is posting ready status"}
            ],
            "images": [{"names": ["cuda:12"], "sizeBytes": 1}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.2"}],
            "capacity": {"cpu": "64", "pods": "110"},
            "allocatable": {"cpu": "63", "memory": "250Gi", "pods": "110", "example.com/fpga": "1"}
        }
    }))
    .unwrap()
}

fn stripped_pod(full: &Pod) -> Pod {
    let mut stripped = full.clone();
    pod(&mut stripped);
    stripped
}

fn stripped_node(full: &Node) -> Node {
    let mut stripped = full.clone();
    node(&mut stripped);
    stripped
}

/// The nodes a pod is checked against: one fitting, one per reason to refuse it.
fn nodes() -> Vec<Node> {
    let fits = json!({"zone": "a", "gpus": "8"});
    let tainted = json!([{"key": "other", "effect": "NoSchedule"}]);
    let mut not_ready = full_node("n5", fits.clone(), json!([]));
    not_ready
        .status
        .as_mut()
        .unwrap()
        .conditions
        .as_mut()
        .unwrap()[1]
        .status = "False".into();
    vec![
        full_node(
            "n1",
            fits.clone(),
            json!([{"key": "gpu", "effect": "NoSchedule"}]),
        ),
        full_node("n2", json!({"zone": "b", "gpus": "8"}), json!([])),
        full_node("n3", json!({"zone": "a", "gpus": "4"}), json!([])),
        full_node("n4", fits, tainted),
        not_ready,
    ]
}

#[test]
fn stripped_pods_answer_every_reader_as_full_ones() {
    let pods = [
        full_pod("Pending", None),
        full_pod("Running", Some("n1")),
        full_pod("Succeeded", Some("n1")),
    ];
    let nodes = nodes();
    for full in &pods {
        let stripped = stripped_pod(full);
        assert_eq!(
            consumers::pod_claims(&stripped),
            consumers::pod_claims(full)
        );
        assert_eq!(consumers::is_live(&stripped), consumers::is_live(full));
        assert_eq!(
            consumers::assigned_node(&stripped),
            consumers::assigned_node(full)
        );
        assert_eq!(
            consumers::awaits_allocation(&stripped),
            consumers::awaits_allocation(full)
        );
        assert_eq!(has_condition(&stripped), has_condition(full));
        // The nodes' books: requests, host ports, priority, nomination.
        let requests = pod_resource_requests(&stripped);
        assert_eq!(requests, pod_resource_requests(full));
        assert!(requests.milli_cpu == 4250 && requests.memory == (8 << 30) + (120 << 20));
        assert_eq!(host_ports(&stripped), host_ports(full));
        assert_eq!(host_ports(&stripped).len(), 2);
        assert_eq!(priority(&stripped), priority(full));
        let nominated = |p: &Pod| p.status.as_ref().unwrap().nominated_node_name.clone();
        assert_eq!(nominated(&stripped), nominated(full));
        let kerf_condition = |p: &Pod| {
            let conditions = p.status.as_ref().unwrap().conditions.clone().unwrap();
            conditions
                .into_iter()
                .find(|c| c.type_ == POD_CONDITION_TYPE)
        };
        assert_eq!(kerf_condition(&stripped), kerf_condition(full));
        for node in &nodes {
            assert_eq!(node_fits(&stripped, node), node_fits(full, node));
        }
        assert_eq!(stripped.object_ref(&()), full.object_ref(&()));
        // What readers outside this module's sight use (`gate::gate_index`,
        // `ownership::demand`'s gate and age order, `ownership::extended`'s requests and
        // claim status): the fields themselves.
        let (s, f) = (stripped.spec.as_ref(), full.spec.as_ref());
        assert_eq!(
            s.map(|s| &s.scheduling_gates),
            f.map(|f| &f.scheduling_gates)
        );
        let resources = |spec: Option<&PodSpec>| {
            let spec = spec.unwrap();
            let all = spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten());
            all.map(|c| {
                (
                    c.name.clone(),
                    c.resources.clone(),
                    c.restart_policy.clone(),
                )
            })
            .collect::<Vec<_>>()
        };
        assert_eq!(resources(s), resources(f));
        let claim_status = |p: &Pod| {
            p.status
                .as_ref()
                .unwrap()
                .extended_resource_claim_status
                .clone()
        };
        assert_eq!(claim_status(&stripped), claim_status(full));
        assert_eq!(
            (
                &stripped.metadata.creation_timestamp,
                &stripped.metadata.uid
            ),
            (&full.metadata.creation_timestamp, &full.metadata.uid)
        );
    }
    assert!(
        nodes.iter().any(|n| node_fits(&pods[0], n).is_ok())
            && nodes
                .iter()
                .filter(|n| node_fits(&pods[0], n).is_err())
                .count()
                == 4,
        "the nodes exercise every reason, or the comparison proves little"
    );
}

#[test]
fn stripped_pods_lose_what_nobody_reads() {
    let stripped = stripped_pod(&full_pod("Running", Some("n1")));
    let spec = stripped.spec.as_ref().unwrap();
    assert!(stripped.metadata.managed_fields.is_none());
    assert!(stripped.metadata.annotations.is_none());
    assert!(spec.volumes.is_none());
    assert!(spec.containers[0].image.is_none() && spec.containers[0].env.is_none());
    let ports = spec.containers[0].ports.as_ref().unwrap();
    assert_eq!(ports.len(), 1, "only the host port stays: {ports:?}");
    assert!(spec.affinity.as_ref().unwrap().pod_anti_affinity.is_none());
    assert!(
        stripped
            .status
            .as_ref()
            .unwrap()
            .container_statuses
            .is_none()
    );
}

#[test]
fn stripped_nodes_answer_every_reader_as_full_ones() {
    let pods = [full_pod("Pending", None), Pod::default()];
    for full in nodes() {
        let stripped = stripped_node(&full);
        for pod in &pods {
            assert_eq!(node_fits(pod, &stripped), node_fits(pod, &full));
        }
        assert_eq!(node_allocatable(&stripped), node_allocatable(&full));
        assert!(node_allocatable(&stripped).is_some());
        // The ownership tick reads the policy label and the record and publication
        // annotations; Events name the node.
        assert_eq!(stripped.metadata.labels, full.metadata.labels);
        assert_eq!(stripped.metadata.annotations, full.metadata.annotations);
        assert_eq!(stripped.object_ref(&()), full.object_ref(&()));
        let status = stripped.status.as_ref().unwrap();
        assert!(status.images.is_none() && status.addresses.is_none());
        assert!(stripped.metadata.managed_fields.is_none());
    }
}

#[test]
fn managed_fields_go_and_nothing_else() {
    let full: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "s", "managedFields": [{"manager": "kubelet"}]},
        "spec": {"driver": "gpu.kerf.dev", "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                 "nodeName": "n1", "devices": [{"name": "gpu-0"}]}
    }))
    .unwrap();
    let mut stripped = full.clone();
    managed_fields(&mut stripped);
    assert!(stripped.managed_fields().is_empty());
    assert_eq!(stripped.spec, full.spec);
    assert_eq!(stripped.metadata.name, full.metadata.name);
}

fn claim_with_devices_status(resource_version: &str, data: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "c", "namespace": "ns", "resourceVersion": resource_version,
                     "labels": {"gpu.kerf.dev/node": "n1"},
                     "managedFields": [{"manager": "kubelet-plugin", "operation": "Update"}]},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.kerf.dev"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.kerf.dev", "pool": "n1", "device": "gpu-0"}]}},
            "devices": [{"driver": "gpu.kerf.dev", "pool": "n1", "device": "gpu-0", "data": {"uuid": data}}],
        },
    }))
    .unwrap()
}

#[test]
fn a_claim_keeps_its_allocation_and_loses_the_devices_status() {
    let mut stripped = claim_with_devices_status("1", "GPU-1");
    claim(&mut stripped);
    assert!(stripped.metadata.managed_fields.is_none());
    let status = stripped.status.as_ref().unwrap();
    assert!(status.devices.is_none());
    assert!(status.allocation.is_some());
    assert_eq!(stripped.labels()["gpu.kerf.dev/node"], "n1");
}

#[test]
fn a_write_of_the_devices_status_alone_is_no_change_once_stripped() {
    let mut before = claim_with_devices_status("1", "GPU-1");
    let mut after = claim_with_devices_status("2", "GPU-2");
    assert!(
        !crate::cache::same_but_version(&before, &mut after),
        "unstripped"
    );
    claim(&mut before);
    claim(&mut after);
    assert!(crate::cache::same_but_version(&before, &mut after));
    assert_eq!(
        after.metadata.resource_version.as_deref(),
        Some("2"),
        "its own version back"
    );
    after
        .metadata
        .labels
        .get_or_insert_default()
        .insert("other".into(), "x".into());
    assert!(
        !crate::cache::same_but_version(&before, &mut after),
        "a label is a change"
    );
}
