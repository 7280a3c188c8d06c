//! Whether a pod's CPU, memory, ephemeral storage, pod slot and scalar resources fit on a
//! node, computed as kube-scheduler's NodeResourcesFit filter computes it.
//!
//! Upstream: kubernetes/kubernetes `pkg/scheduler/framework/plugins/noderesources/fit.go`,
//! `fitsRequest`: the pod count is checked first (`Too many pods`); a pod that requests
//! nothing else fits; then each resource the pod requests (> 0) must be at most the node's
//! allocatable minus what the node's pods request (`Insufficient cpu`, `Insufficient memory`,
//! `Insufficient ephemeral-storage`, `Insufficient <name>`). Every failing resource is
//! reported, not only the first. Scalar resources the filter ignores (the plugin's
//! `ignoredResources`, and extended resources that DRA backs on this node) are left out by
//! the caller, who knows them.
//!
//! Quantities are plain integers in the units kube-scheduler's `framework.Resource` uses:
//! millicores for CPU, bytes for memory and ephemeral storage, the quantity's value for
//! scalar resources (hugepages in bytes, extended resources in units).
//!
//! Also here, for the callers that filter nodes as kube-scheduler does (kerf-controller, and
//! the bench that replays traces through the same code): a pod's effective requests from its
//! containers ([`pod_requests`], upstream `PodRequests`), host ports ([`HostPorts`], upstream
//! `NodePorts`) and the `0/N nodes are available: …` message ([`Diagnosis`], upstream
//! `FitError`) with the filter plugins' reasons.

use std::collections::BTreeMap;

mod diagnosis;
mod ports;
mod requests;

pub use diagnosis::{
    Diagnosis, NODE_AFFINITY_REASON, NODE_NAME_REASON, NODE_PORTS_REASON, TAINT_REASON,
    UNSCHEDULABLE_REASON,
};
pub use ports::{HostPort, HostPorts};
pub use requests::{InitContainer, PodLevelRequests, PodShape, pod_requests};

/// Resource amounts, as kube-scheduler's `framework.Resource`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources {
    /// CPU in millicores.
    pub milli_cpu: i64,
    /// Memory in bytes.
    pub memory: i64,
    /// Ephemeral storage in bytes.
    pub ephemeral_storage: i64,
    /// Every other resource (extended resources, hugepages, attachable volumes) by name.
    pub scalars: BTreeMap<String, i64>,
}

impl Resources {
    /// CPU and memory only.
    pub fn cpu_memory(milli_cpu: i64, memory: i64) -> Self {
        Resources {
            milli_cpu,
            memory,
            ..Resources::default()
        }
    }

    /// True when nothing is requested (every amount is zero or less).
    pub fn is_empty(&self) -> bool {
        self.milli_cpu <= 0
            && self.memory <= 0
            && self.ephemeral_storage <= 0
            && self.scalars.values().all(|v| *v <= 0)
    }

    /// Adds `other` to these amounts (saturating).
    pub fn add(&mut self, other: &Resources) {
        self.milli_cpu = self.milli_cpu.saturating_add(other.milli_cpu);
        self.memory = self.memory.saturating_add(other.memory);
        self.ephemeral_storage = self
            .ephemeral_storage
            .saturating_add(other.ephemeral_storage);
        for (name, value) in &other.scalars {
            let slot = self.scalars.entry(name.clone()).or_insert(0);
            *slot = slot.saturating_add(*value);
        }
    }

    /// Subtracts `other` from these amounts (saturating), dropping scalars that reach zero,
    /// so that adding and then removing a pod leaves the sums as they were.
    pub fn subtract(&mut self, other: &Resources) {
        self.milli_cpu = self.milli_cpu.saturating_sub(other.milli_cpu);
        self.memory = self.memory.saturating_sub(other.memory);
        self.ephemeral_storage = self
            .ephemeral_storage
            .saturating_sub(other.ephemeral_storage);
        for (name, value) in &other.scalars {
            if let Some(slot) = self.scalars.get_mut(name) {
                *slot = slot.saturating_sub(*value);
                if *slot == 0 {
                    self.scalars.remove(name);
                }
            }
        }
    }

    /// The larger of each amount, as `framework.Resource.SetMaxResource` (init containers).
    pub fn max_with(&mut self, other: &Resources) {
        self.milli_cpu = self.milli_cpu.max(other.milli_cpu);
        self.memory = self.memory.max(other.memory);
        self.ephemeral_storage = self.ephemeral_storage.max(other.ephemeral_storage);
        for (name, value) in &other.scalars {
            let slot = self.scalars.entry(name.clone()).or_insert(0);
            *slot = (*slot).max(*value);
        }
    }
}

/// A node's capacity for pods and what its pods already take, as kube-scheduler's
/// `NodeInfo` (`Allocatable`, `Requested`, `len(Pods)`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeResources {
    /// The node's `status.allocatable`, without the pod count.
    pub allocatable: Resources,
    /// The node's `status.allocatable["pods"]`.
    pub allowed_pods: i64,
    /// Sum of the requests of the pods on the node (bound, nominated or assumed).
    pub requested: Resources,
    /// How many pods are on the node.
    pub pods: i64,
}

impl NodeResources {
    /// Free amount of a scalar resource: allocatable minus requested (may be negative).
    pub fn free_scalar(&self, name: &str) -> i64 {
        let allocatable = self.allocatable.scalars.get(name).copied().unwrap_or(0);
        let requested = self.requested.scalars.get(name).copied().unwrap_or(0);
        allocatable.saturating_sub(requested)
    }

    /// Free CPU in millicores (may be negative when the node is over-committed).
    pub fn free_milli_cpu(&self) -> i64 {
        self.allocatable
            .milli_cpu
            .saturating_sub(self.requested.milli_cpu)
    }

    /// Free memory in bytes (may be negative when the node is over-committed).
    pub fn free_memory(&self) -> i64 {
        self.allocatable
            .memory
            .saturating_sub(self.requested.memory)
    }

    /// Counts a pod with these requests on the node.
    pub fn add_pod(&mut self, requests: &Resources) {
        self.requested.add(requests);
        self.pods = self.pods.saturating_add(1);
    }

    /// Removes a pod counted by [`NodeResources::add_pod`].
    pub fn remove_pod(&mut self, requests: &Resources) {
        self.requested.subtract(requests);
        self.pods = self.pods.saturating_sub(1);
    }
}

/// One reason a pod does not fit, in kube-scheduler's words (its `Display`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Insufficient {
    /// The node holds as many pods as `allocatable["pods"]` allows.
    Pods,
    /// Not enough CPU.
    Cpu,
    /// Not enough memory.
    Memory,
    /// Not enough ephemeral storage.
    EphemeralStorage,
    /// Not enough of a scalar resource, by name.
    Scalar(String),
}

impl std::fmt::Display for Insufficient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Insufficient::Pods => f.write_str("Too many pods"),
            Insufficient::Cpu => f.write_str("Insufficient cpu"),
            Insufficient::Memory => f.write_str("Insufficient memory"),
            Insufficient::EphemeralStorage => f.write_str("Insufficient ephemeral-storage"),
            Insufficient::Scalar(name) => write!(f, "Insufficient {name}"),
        }
    }
}

/// Every resource of `pod` that `node` lacks, in kube-scheduler's order (pods, cpu, memory,
/// ephemeral storage, scalars by name); empty when the pod fits.
///
/// `ignored` names scalar resources not to check (see the module docs).
pub fn insufficient_resources(
    pod: &Resources,
    node: &NodeResources,
    mut ignored: impl FnMut(&str) -> bool,
) -> Vec<Insufficient> {
    let mut missing = Vec::new();
    if node.pods.saturating_add(1) > node.allowed_pods {
        missing.push(Insufficient::Pods);
    }
    if pod.is_empty() {
        return missing;
    }
    let lacks = |asked: i64, allocatable: i64, requested: i64| {
        asked > 0 && asked > allocatable.saturating_sub(requested)
    };
    let (alloc, used) = (&node.allocatable, &node.requested);
    if lacks(pod.milli_cpu, alloc.milli_cpu, used.milli_cpu) {
        missing.push(Insufficient::Cpu);
    }
    if lacks(pod.memory, alloc.memory, used.memory) {
        missing.push(Insufficient::Memory);
    }
    if lacks(
        pod.ephemeral_storage,
        alloc.ephemeral_storage,
        used.ephemeral_storage,
    ) {
        missing.push(Insufficient::EphemeralStorage);
    }
    for (name, asked) in &pod.scalars {
        if ignored(name) {
            continue;
        }
        if *asked > 0 && *asked > node.free_scalar(name) {
            missing.push(Insufficient::Scalar(name.clone()));
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: i64 = 1 << 30;

    fn node(milli_cpu: i64, memory: i64) -> NodeResources {
        NodeResources {
            allocatable: Resources::cpu_memory(milli_cpu, memory),
            allowed_pods: 110,
            ..NodeResources::default()
        }
    }

    #[test]
    fn a_pod_fits_up_to_the_last_millicore() {
        let mut n = node(32_000, 128 * GI);
        n.add_pod(&Resources::cpu_memory(12_000, GI));
        let pod = Resources::cpu_memory(20_000, GI);
        assert!(insufficient_resources(&pod, &n, |_| false).is_empty());
        n.add_pod(&Resources::cpu_memory(1, 0));
        assert_eq!(
            insufficient_resources(&pod, &n, |_| false),
            vec![Insufficient::Cpu]
        );
    }

    #[test]
    fn every_lacking_resource_is_named_in_upstream_words() {
        let mut n = node(1000, GI);
        n.allocatable.scalars.insert("example.com/foo".into(), 1);
        n.allowed_pods = 1;
        n.add_pod(&Resources::default());
        let mut pod = Resources::cpu_memory(2000, 2 * GI);
        pod.ephemeral_storage = 1;
        pod.scalars.insert("example.com/foo".into(), 2);
        let words: Vec<String> = insufficient_resources(&pod, &n, |_| false)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            words,
            [
                "Too many pods",
                "Insufficient cpu",
                "Insufficient memory",
                "Insufficient ephemeral-storage",
                "Insufficient example.com/foo"
            ]
        );
    }

    #[test]
    fn an_empty_request_checks_only_the_pod_count() {
        let mut n = node(0, 0);
        n.requested = Resources::cpu_memory(5000, GI);
        assert!(insufficient_resources(&Resources::default(), &n, |_| false).is_empty());
        n.allowed_pods = 0;
        assert_eq!(
            insufficient_resources(&Resources::default(), &n, |_| false),
            vec![Insufficient::Pods]
        );
    }

    #[test]
    fn ignored_scalars_are_not_checked() {
        let n = node(1000, GI);
        let mut pod = Resources::cpu_memory(1, 1);
        pod.scalars.insert("gpu.kerf.dev/gpu".into(), 1);
        assert_eq!(
            insufficient_resources(&pod, &n, |_| false),
            vec![Insufficient::Scalar("gpu.kerf.dev/gpu".into())]
        );
        assert!(insufficient_resources(&pod, &n, |name| name == "gpu.kerf.dev/gpu").is_empty());
    }

    #[test]
    fn removing_a_pod_undoes_adding_it() {
        let mut n = node(1000, GI);
        let before = n.clone();
        let mut pod = Resources::cpu_memory(300, 5);
        pod.scalars.insert("hugepages-2Mi".into(), 2 << 20);
        n.add_pod(&pod);
        n.remove_pod(&pod);
        assert_eq!(n, before);
    }
}
