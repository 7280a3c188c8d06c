//! What the watch caches keep of each object: kerf-controller holds every Pod, Node,
//! ResourceClaim, DeviceClass and kerf ResourceSlice of the cluster in memory, so each kind is
//! stripped, before it reaches a store, of the fields nothing in kerf reads (kube-runtime's
//! `WatchStreamExt::modify`, applied between the watcher and the reflector).
//!
//! Stripping is only safe because no write sends a cached object back: every write of the
//! controller is a patch naming its own fields (`claims/write.rs`, `claims/gate.rs`,
//! `claims/ownership`, `claims/node_label.rs`). The tests below run every reader of a kind on
//! a full and a stripped object and fail when the answers differ: a read of a newly used
//! field that is stripped shows up there, not as a silent misplacement.

use k8s_openapi::api::core::v1::{Affinity, Container, Node, NodeStatus, Pod, PodSpec, PodStatus};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Resource;

use kerf_api::controller_claims::POD_CONDITION_TYPE;

/// Drops `managedFields`, which every kind carries and nothing in kerf reads: the server-side
/// apply bookkeeping of every writer, often larger than the rest of the metadata.
pub fn managed_fields<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// Drops a ResourceClaim's `managedFields` and `status.devices`: the devices' status that
/// kubelet plugins write after a prepare (kerf's own included), which nothing in
/// kerf-controller reads. A write of it alone then leaves the cached claim as
/// it was, which [`super::cache`] does not pass on as a change: no reconcile, no label check,
/// no ownership pass for it.
pub fn claim(claim: &mut ResourceClaim) {
    claim.metadata.managed_fields = None;
    if let Some(status) = &mut claim.status {
        status.devices = None;
    }
}

/// Keeps of a Pod what the claim reconciler, the nodes' books, the ownership tick and the
/// Events read:
/// - metadata but `managedFields` and `annotations` (which may hold kubectl's
///   `last-applied-configuration`, a second copy of the whole pod; nothing reads pod
///   annotations);
/// - of the spec, the claims (`resourceClaims`), the gates (`schedulingGates`), the node
///   (`nodeName`), what decides the nodes the pod may run on (`nodeSelector`, the node part
///   of `affinity`, `tolerations`), what it takes of a node (`overhead`, pod-level
///   `resources`, `priority` against nominated pods) and the containers' and init
///   containers' names, resources (requests: `claims::node_usage`, extended resources:
///   `claims::ownership`), restart policy (sidecars) and host ports (the `ports` with a
///   `hostPort`); images, commands, environments, volumes, probes and the other ports go;
/// - of the status, `phase`, `nominatedNodeName`, kerf's own condition ([`POD_CONDITION_TYPE`],
///   which the reconciler compares before writing it), `resourceClaimStatuses` and
///   `extendedResourceClaimStatus`; the kubelet's and kube-scheduler's conditions, container
///   statuses and addresses go.
pub fn pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.metadata.annotations = None;
    pod.spec = pod.spec.take().map(pod_spec);
    pod.status = pod.status.take().map(|status| PodStatus {
        phase: status.phase,
        nominated_node_name: status.nominated_node_name,
        conditions: status.conditions.map(|conditions| {
            conditions
                .into_iter()
                .filter(|condition| condition.type_ == POD_CONDITION_TYPE)
                .collect()
        }),
        resource_claim_statuses: status.resource_claim_statuses,
        extended_resource_claim_status: status.extended_resource_claim_status,
        ..PodStatus::default()
    });
}

fn pod_spec(spec: PodSpec) -> PodSpec {
    PodSpec {
        node_name: spec.node_name,
        node_selector: spec.node_selector,
        // Pod (anti-)affinity is kube-scheduler's alone; node affinity limits kerf's choice.
        affinity: spec.affinity.map(|affinity| Affinity {
            node_affinity: affinity.node_affinity,
            ..Affinity::default()
        }),
        tolerations: spec.tolerations,
        overhead: spec.overhead,
        resources: spec.resources,
        priority: spec.priority,
        scheduling_gates: spec.scheduling_gates,
        resource_claims: spec.resource_claims,
        containers: spec.containers.into_iter().map(container).collect(),
        init_containers: spec
            .init_containers
            .map(|containers| containers.into_iter().map(container).collect()),
        ..PodSpec::default()
    }
}

/// A container's name, resources, restart policy and host ports: what the extended-resource
/// totals (`claims::ownership::extended::requests`) and the nodes' books
/// (`kerf_api::pod_resources`) read.
fn container(container: Container) -> Container {
    let host_ports: Vec<_> = container
        .ports
        .into_iter()
        .flatten()
        .filter(|p| p.host_port.is_some_and(|port| port > 0))
        .collect();
    Container {
        name: container.name,
        resources: container.resources,
        restart_policy: container.restart_policy,
        ports: (!host_ports.is_empty()).then_some(host_ports),
        ..Container::default()
    }
}

/// Keeps of a Node its metadata but `managedFields` (labels select nodes and carry the
/// ownership policy; annotations carry the ownership record and the shared publication), its
/// spec (`unschedulable`, `taints`) and, of its status, `allocatable` (what pods may take) and
/// the `Ready` condition only: the image list, addresses, capacity, node info and the other
/// conditions are the kubelet's and kube-scheduler's business.
pub fn node(node: &mut Node) {
    node.metadata.managed_fields = None;
    node.status = node.status.take().map(|status| NodeStatus {
        allocatable: status.allocatable,
        conditions: status.conditions.map(|conditions| {
            conditions
                .into_iter()
                .filter(|condition| condition.type_ == "Ready")
                .collect()
        }),
        ..NodeStatus::default()
    });
}

#[cfg(test)]
#[path = "strip_tests.rs"]
mod tests;
