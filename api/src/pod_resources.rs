//! A Pod's requests, host ports and priority, and a Node's allocatable, read as kube-scheduler
//! reads them, into kerf-core's plain amounts ([`kerf_core::alloc::node_fit`]).
//!
//! Quantities are converted as upstream `framework.Resource.Add` /
//! `SetMaxResource` convert them (kubernetes/kubernetes `pkg/scheduler/framework/types.go`):
//! `cpu` with `MilliValue`, everything else with `Value`, both rounding up
//! ([`crate::quantity::scaled_ceil`]); `pods` of the allocatable is the pod count; other names
//! count only when they are scalar resources (upstream `schedutil.IsScalarResourceName`:
//! extended resources, hugepages, `kubernetes.io/`-prefixed native resources and attachable
//! volumes), the rest is ignored as upstream ignores it. A quantity that does not parse (the
//! API server validates them, so only a hand-made object has one) counts as zero.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_core::alloc::node_fit::{
    HostPort, InitContainer, NodeResources, PodLevelRequests, PodShape, Resources, pod_requests,
};

use crate::quantity::scaled_ceil;

const CPU: &str = "cpu";
const MEMORY: &str = "memory";
const EPHEMERAL_STORAGE: &str = "ephemeral-storage";
const PODS: &str = "pods";
const HUGEPAGES_PREFIX: &str = "hugepages-";

/// True for the resource names kube-scheduler keeps as scalar resources (upstream
/// `pkg/scheduler/util/utils.go` `IsScalarResourceName`): extended resources (a domain that is
/// not `kubernetes.io`, and not a quota `requests.` name), hugepages, native resources with a
/// `kubernetes.io/` prefix and `attachable-volumes-` names.
pub fn is_scalar_resource_name(name: &str) -> bool {
    is_extended_resource_name(name)
        || name.starts_with(HUGEPAGES_PREFIX)
        || name.contains("kubernetes.io/")
        || name.starts_with("attachable-volumes-")
}

/// Upstream `v1helper.IsExtendedResourceName`: a name with a domain (`example.com/foo`) that is
/// neither native (`kubernetes.io/…`) nor a quota name (`requests.…`).
pub fn is_extended_resource_name(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/") && !name.starts_with("requests.")
}

/// Converts one quantity; an unparsable one counts as zero.
fn amount(name: &str, quantity: &Quantity) -> i64 {
    let exp10 = if name == CPU { -3 } else { 0 };
    scaled_ceil(quantity, exp10).unwrap_or(0)
}

/// Adds the named quantities into `into` (upstream `framework.Resource.Add`, without `pods`).
fn add_list<'a>(into: &mut Resources, list: impl Iterator<Item = (&'a String, &'a Quantity)>) {
    for (name, quantity) in list {
        let value = amount(name, quantity);
        match name.as_str() {
            CPU => into.milli_cpu = into.milli_cpu.saturating_add(value),
            MEMORY => into.memory = into.memory.saturating_add(value),
            EPHEMERAL_STORAGE => {
                into.ephemeral_storage = into.ephemeral_storage.saturating_add(value);
            }
            other if is_scalar_resource_name(other) => {
                let slot = into.scalars.entry(other.to_owned()).or_insert(0);
                *slot = slot.saturating_add(value);
            }
            _ => {}
        }
    }
}

/// A container's requests; a resource it only limits counts at its limit, as the API server
/// defaults requests to limits (`pkg/apis/core/v1/defaults.go`, `SetDefaults_Pod`).
pub fn container_requests(container: &Container) -> Resources {
    let mut out = Resources::default();
    let Some(resources) = container.resources.as_ref() else {
        return out;
    };
    let requests = resources.requests.as_ref();
    add_list(&mut out, requests.iter().flat_map(|r| r.iter()));
    let limit_only = resources
        .limits
        .iter()
        .flatten()
        .filter(|(name, _)| requests.is_none_or(|r| !r.contains_key(*name)));
    add_list(&mut out, limit_only);
    out
}

/// The pod's containers, init containers, overhead and pod-level requests.
pub fn pod_shape(pod: &Pod) -> PodShape {
    let Some(spec) = pod.spec.as_ref() else {
        return PodShape::default();
    };
    let overhead = spec.overhead.as_ref().map(|overhead| {
        let mut resources = Resources::default();
        add_list(&mut resources, overhead.iter());
        resources
    });
    PodShape {
        containers: spec.containers.iter().map(container_requests).collect(),
        init_containers: spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| InitContainer {
                requests: container_requests(c),
                restartable: is_restartable(c),
            })
            .collect(),
        overhead,
        pod_level: pod_level_requests(pod),
    }
}

/// The pod's effective requests (upstream `PodRequests`, see [`pod_requests`]).
pub fn pod_resource_requests(pod: &Pod) -> Resources {
    pod_requests(&pod_shape(pod))
}

fn pod_level_requests(pod: &Pod) -> Option<PodLevelRequests> {
    let requests = pod.spec.as_ref()?.resources.as_ref()?.requests.as_ref()?;
    let mut level = PodLevelRequests::default();
    for (name, quantity) in requests {
        match name.as_str() {
            CPU => level.milli_cpu = Some(amount(name, quantity)),
            MEMORY => level.memory = Some(amount(name, quantity)),
            hugepages if hugepages.starts_with(HUGEPAGES_PREFIX) => {
                level
                    .hugepages
                    .insert(hugepages.to_owned(), amount(name, quantity));
            }
            _ => {}
        }
    }
    Some(level)
}

fn is_restartable(container: &Container) -> bool {
    container.restart_policy.as_deref() == Some("Always")
}

/// The host ports the pod holds (upstream `pkg/scheduler/util/utils.go` `GetHostPorts`: the
/// `hostPort` > 0 ports of the restartable init containers and the app containers).
pub fn host_ports(pod: &Pod) -> Vec<HostPort> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| is_restartable(c));
    sidecars
        .chain(&spec.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .filter(|p| p.host_port.is_some_and(|port| port > 0))
        .map(|p| {
            HostPort::new(
                p.host_ip.as_deref().unwrap_or_default(),
                p.protocol.as_deref().unwrap_or_default(),
                p.host_port.unwrap_or_default(),
            )
        })
        .collect()
}

/// The pod's priority (`spec.priority`; 0 when unset, as upstream `corev1helpers.PodPriority`).
pub fn priority(pod: &Pod) -> i32 {
    pod.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)
}

/// The node's `status.allocatable` as kube-scheduler's `NodeInfo.Allocatable`, with nothing
/// requested yet; `None` when the node reports no allocatable at all (a Node object no kubelet
/// has written, which kerf does not check for resources).
pub fn node_allocatable(node: &Node) -> Option<NodeResources> {
    let allocatable: &BTreeMap<String, Quantity> = node.status.as_ref()?.allocatable.as_ref()?;
    let mut resources = Resources::default();
    add_list(
        &mut resources,
        allocatable.iter().filter(|(name, _)| name.as_str() != PODS),
    );
    let allowed_pods = allocatable
        .get(PODS)
        .map_or(0, |quantity| amount(PODS, quantity));
    Some(NodeResources {
        allocatable: resources,
        allowed_pods,
        ..NodeResources::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[allow(
        clippy::needless_pass_by_value,
        reason = "fixtures take JSON as tests write it"
    )]
    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[test]
    fn names_are_classified_as_upstream() {
        for scalar in [
            "example.com/foo",
            "nvidia.com/gpu",
            "hugepages-2Mi",
            "kubernetes.io/batch-cpu",
            "attachable-volumes-aws-ebs",
        ] {
            assert!(is_scalar_resource_name(scalar), "{scalar}");
        }
        for ignored in ["requests.example.com/foo", "storage", "cpu", "pods"] {
            assert!(!is_scalar_resource_name(ignored), "{ignored}");
        }
        assert!(!is_extended_resource_name("kubernetes.io/batch-cpu"));
    }

    #[test]
    fn requests_of_every_kind_and_limits_for_missing_requests() {
        let p = pod(json!({
            "containers": [
                {"name": "a", "resources": {
                    "requests": {"cpu": "1500m", "memory": "1Gi", "example.com/nic": "1"},
                    "limits": {"cpu": "4", "ephemeral-storage": "10Gi", "storage": "1"}}},
                {"name": "b", "resources": {"limits": {"cpu": "0.5"}}}
            ],
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "250m"}}}
            ],
            "overhead": {"cpu": "100m", "memory": "64Mi"}
        }));
        let requests = pod_resource_requests(&p);
        assert_eq!(requests.milli_cpu, 1500 + 500 + 250 + 100);
        assert_eq!(requests.memory, (1 << 30) + (64 << 20));
        assert_eq!(requests.ephemeral_storage, 10 << 30);
        assert_eq!(
            requests.scalars,
            BTreeMap::from([("example.com/nic".to_owned(), 1)])
        );
    }

    #[test]
    fn pod_level_requests_are_read() {
        let p = pod(json!({
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "1"}}}],
            "resources": {"requests": {"cpu": "3", "hugepages-1Gi": "2Gi"}}
        }));
        let requests = pod_resource_requests(&p);
        assert_eq!(requests.milli_cpu, 3000);
        assert_eq!(requests.scalars["hugepages-1Gi"], 2 << 30);
    }

    #[test]
    fn host_ports_of_apps_and_sidecars_only() {
        let p = pod(json!({
            "containers": [{"name": "a", "ports": [
                {"containerPort": 80, "hostPort": 8080},
                {"containerPort": 81},
                {"containerPort": 53, "hostPort": 53, "protocol": "UDP", "hostIP": "10.0.0.1"}
            ]}],
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "ports": [{"containerPort": 9, "hostPort": 9090}]},
                {"name": "init", "ports": [{"containerPort": 7, "hostPort": 7070}]}
            ]
        }));
        assert_eq!(
            host_ports(&p),
            [
                HostPort::new("", "", 9090),
                HostPort::new("", "TCP", 8080),
                HostPort::new("10.0.0.1", "UDP", 53)
            ]
        );
    }

    #[test]
    fn allocatable_with_pods_and_scalars() {
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n"},
            "status": {"allocatable": {
                "cpu": "31850m", "memory": "128Gi", "pods": "110", "ephemeral-storage": "100Gi",
                "hugepages-2Mi": "0", "example.com/fpga": "2"}}
        }))
        .unwrap();
        let allocatable = node_allocatable(&node).unwrap();
        assert_eq!(allocatable.allowed_pods, 110);
        assert_eq!(allocatable.allocatable.milli_cpu, 31_850);
        assert_eq!(allocatable.allocatable.memory, 128 << 30);
        assert_eq!(allocatable.allocatable.ephemeral_storage, 100 << 30);
        assert_eq!(allocatable.allocatable.scalars["example.com/fpga"], 2);
        assert_eq!(allocatable.allocatable.scalars["hugepages-2Mi"], 0);
        assert!(node_allocatable(&Node::default()).is_none());
    }
}
