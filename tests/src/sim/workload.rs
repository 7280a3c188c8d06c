//! What the sim's pods ask for, the claims and pods made of it, and a seeded generator of
//! creates and deletes whose live set always fits the cluster.
//!
//! # When the live set fits
//! Neither allocator moves a running pod, so "fits" must hold whatever the allocators did
//! before. The generator keeps a sufficient condition: with `G` whole (non-MIG) GPUs in the
//! cluster and `W` whole-GPU pods and `S` slice pods live, `W + S <= G`. Then a pending
//! whole-GPU or slice pod always finds an idle GPU, since at most `W + S - 1` GPUs hold
//! anything, and every slice (at most [`MAX_SLICE_GIB`] and [`MAX_SLICE_COMPUTE`] %) fits on
//! any idle GPU of the mix. Live MIG pods of a profile never outnumber the MIG devices of that
//! profile. Slices still share GPUs (kerf's default class packs them), they are just never
//! forced to.
//!
//! Pods created with `spec.nodeName` ([`PodPlan::node`]) are small slices; whether one fits
//! its node is judged at the end, from the allocations then (see the stress test).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::cluster::{self, DeviceInfo, DeviceKind};
use kerf_scheduler_standin::SeededRng;

/// The largest slice's memory, in GiB.
pub const MAX_SLICE_GIB: u32 = 8;
/// The largest slice's compute, in percent.
pub const MAX_SLICE_COMPUTE: u8 = 25;
/// Label on every pod the sim creates with `spec.nodeName`.
pub const PINNED_LABEL: &str = "sim.kerf.dev/pinned";

/// What one pod's single claim asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// One whole GPU of the Scheduler class [`cluster::WHOLE_CLASS`].
    Whole,
    /// One MIG device of this profile, Scheduler class [`cluster::mig_class`].
    Mig(String),
    /// A slice of the Controller class [`cluster::SLICE_CLASS`].
    Slice {
        /// Memory in GiB.
        memory_gib: u32,
        /// Compute in percent.
        compute: u8,
    },
}

impl Shape {
    /// True for shapes kerf-controller allocates.
    pub fn is_controller(&self) -> bool {
        matches!(self, Shape::Slice { .. })
    }

    /// A short name for figures: `whole`, `mig` or `slice`.
    pub fn kind(&self) -> &'static str {
        match self {
            Shape::Whole => "whole",
            Shape::Mig(_) => "mig",
            Shape::Slice { .. } => "slice",
        }
    }

    /// The ResourceClaim `name` in `namespace` asking for this shape.
    pub fn claim(&self, name: &str, namespace: &str, driver: &str) -> Value {
        let class = match self {
            Shape::Whole => cluster::WHOLE_CLASS.to_owned(),
            Shape::Mig(profile) => cluster::mig_class(profile),
            Shape::Slice { .. } => cluster::SLICE_CLASS.to_owned(),
        };
        let mut devices = json!({"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": class, "allocationMode": "ExactCount", "count": 1}}]});
        if let Shape::Slice {
            memory_gib,
            compute,
        } = self
        {
            devices["config"] = json!([{"requests": ["gpu"], "opaque": {"driver": driver, "parameters": {
                "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters",
                "memory": format!("{memory_gib}Gi"), "compute": compute}}}]);
        }
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": devices},
        })
    }
}

/// One pod to create: its name, what its claim asks for, and the node it is created on, if
/// any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPlan {
    /// Pod name; its claim is `<name>-gpu`.
    pub name: String,
    /// What the claim asks for.
    pub shape: Shape,
    /// `spec.nodeName` at creation.
    pub node: Option<String>,
}

impl PodPlan {
    /// The claim's name.
    pub fn claim_name(&self) -> String {
        format!("{}-gpu", self.name)
    }

    /// The pod object (before admission): one container using the one claim, `Pending`.
    pub fn pod(&self, namespace: &str) -> Value {
        let mut pod = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": namespace,
                         "labels": {"sim.kerf.dev/kind": self.shape.kind()}},
            "spec": {
                "containers": [{"name": "main", "image": "busybox",
                                "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": self.claim_name()}],
            },
            "status": {"phase": "Pending"},
        });
        if let Some(node) = &self.node {
            pod["spec"]["nodeName"] = json!(node);
            pod["metadata"]["labels"][PINNED_LABEL] = json!("true");
        }
        pod
    }
}

/// One thing the generator wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create the claim, then the pod.
    Create(PodPlan),
    /// Delete the pod, then its claim.
    Delete(PodPlan),
}

/// Relative weights of the shapes the generator creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mix {
    /// Whole-GPU pods.
    pub whole: u32,
    /// Slice pods.
    pub slice: u32,
    /// MIG pods.
    pub mig: u32,
    /// Of the slice pods, how many in 100 are created with `spec.nodeName`.
    pub pinned_percent: u32,
    /// How many actions in 100 are creates while the live set has room.
    pub create_percent: u32,
}

impl Default for Mix {
    fn default() -> Self {
        Mix {
            whole: 3,
            slice: 5,
            mig: 2,
            pinned_percent: 10,
            create_percent: 60,
        }
    }
}

/// The seeded generator of creates and deletes (see the module documentation).
#[derive(Debug, Clone)]
pub struct Workload {
    rng: SeededRng,
    mix: Mix,
    /// Whole GPUs (G).
    gpus: usize,
    /// MIG devices per profile.
    mig: BTreeMap<String, usize>,
    /// Nodes with whole GPUs, for pinned pods.
    gpu_nodes: Vec<String>,
    next: u64,
    live: BTreeMap<String, PodPlan>,
}

impl Workload {
    /// A generator for the cluster of `devices`, seeded with `seed`.
    pub fn new(seed: u64, mix: Mix, devices: &[DeviceInfo]) -> Self {
        let mut mig = BTreeMap::new();
        let mut gpu_nodes: Vec<String> = Vec::new();
        let mut gpus = 0;
        for device in devices {
            match &device.kind {
                DeviceKind::Gpu => {
                    gpus += 1;
                    if !gpu_nodes.contains(&device.node) {
                        gpu_nodes.push(device.node.clone());
                    }
                }
                DeviceKind::Mig(profile) => *mig.entry(profile.clone()).or_insert(0) += 1,
            }
        }
        Workload {
            rng: SeededRng::new(seed),
            mix,
            gpus,
            mig,
            gpu_nodes,
            next: 0,
            live: BTreeMap::new(),
        }
    }

    /// The pods created and not deleted, by name.
    pub fn live(&self) -> &BTreeMap<String, PodPlan> {
        &self.live
    }

    fn count(&self, pred: impl Fn(&Shape) -> bool) -> usize {
        self.live.values().filter(|p| pred(&p.shape)).count()
    }

    /// Whether one more pod of `shape` keeps the live set fitting.
    pub fn fits(&self, shape: &Shape) -> bool {
        let whole = self.count(|s| *s == Shape::Whole);
        let slices = self.count(Shape::is_controller);
        match shape {
            Shape::Whole | Shape::Slice { .. } => whole + slices < self.gpus,
            Shape::Mig(profile) => {
                self.count(|s| matches!(s, Shape::Mig(p) if p == profile))
                    < self.mig.get(profile).copied().unwrap_or(0)
            }
        }
    }

    /// A new plan of a random shape (not yet live).
    pub fn plan(&mut self) -> PodPlan {
        let total = self.mix.whole + self.mix.slice + self.mix.mig;
        let pick = u32::try_from(self.rng.below(total.max(1) as usize)).unwrap_or(0);
        let mut node = None;
        let shape = if pick < self.mix.whole
            || (pick >= self.mix.whole + self.mix.slice && self.mig.is_empty())
        {
            Shape::Whole
        } else if pick < self.mix.whole + self.mix.slice {
            let pinned = self.rng.below(100) < self.mix.pinned_percent as usize;
            if pinned && !self.gpu_nodes.is_empty() {
                node = Some(self.gpu_nodes[self.rng.below(self.gpu_nodes.len())].clone());
                Shape::Slice {
                    memory_gib: 1 + u32::try_from(self.rng.below(4)).unwrap_or(0),
                    compute: 10,
                }
            } else {
                Shape::Slice {
                    memory_gib: 1 + u32::try_from(self.rng.below(MAX_SLICE_GIB as usize))
                        .unwrap_or(0),
                    compute: 5
                        * (1 + u8::try_from(self.rng.below(usize::from(MAX_SLICE_COMPUTE / 5)))
                            .unwrap_or(0)),
                }
            }
        } else {
            let profiles: Vec<&String> = self.mig.keys().collect();
            Shape::Mig(profiles[self.rng.below(profiles.len())].clone())
        };
        self.next += 1;
        PodPlan {
            name: format!("p-{:05}", self.next),
            shape,
            node,
        }
    }

    /// The next action: a create of a shape that fits (with [`Mix::create_percent`] chance
    /// while one does), else a delete of a random live pod. `None` when nothing is live and
    /// nothing fits (an empty cluster).
    pub fn next_action(&mut self) -> Option<Action> {
        if self.live.is_empty() || self.rng.below(100) < self.mix.create_percent as usize {
            let plan = self.plan();
            if self.fits(&plan.shape) {
                self.live.insert(plan.name.clone(), plan.clone());
                return Some(Action::Create(plan));
            }
        }
        self.delete_random()
    }

    /// Creates until the live set is full: plans random shapes and keeps those that fit,
    /// until `misses` plans in a row did not.
    pub fn fill(&mut self, misses: usize) -> Vec<PodPlan> {
        let mut created = Vec::new();
        let mut missed = 0;
        while missed < misses {
            let plan = self.plan();
            if self.fits(&plan.shape) {
                self.live.insert(plan.name.clone(), plan.clone());
                created.push(plan);
                missed = 0;
            } else {
                missed += 1;
            }
        }
        created
    }

    /// A delete of a random live pod; `None` when nothing is live.
    pub fn delete_random(&mut self) -> Option<Action> {
        if self.live.is_empty() {
            return None;
        }
        let index = self.rng.below(self.live.len());
        let name = self.live.keys().nth(index)?.clone();
        self.live.remove(&name).map(Action::Delete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_live_set_never_exceeds_the_fit_condition() {
        let devices = cluster::devices(&cluster::mixed_nodes(3)).unwrap();
        let mut workload = Workload::new(7, Mix::default(), &devices);
        let (mut creates, mut deletes) = (0, 0);
        for _ in 0..2000 {
            match workload.next_action().unwrap() {
                Action::Create(_) => creates += 1,
                Action::Delete(_) => deletes += 1,
            }
            let whole = workload.count(|s| *s == Shape::Whole);
            let slices = workload.count(Shape::is_controller);
            assert!(whole + slices <= 8, "{whole} whole + {slices} slices");
            assert!(workload.count(|s| matches!(s, Shape::Mig(_))) <= 7);
        }
        assert!(
            creates > 900 && deletes > 900,
            "{creates} creates, {deletes} deletes"
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_actions() {
        let devices = cluster::devices(&cluster::mixed_nodes(3)).unwrap();
        let run = || {
            let mut w = Workload::new(42, Mix::default(), &devices);
            (0..200).filter_map(|_| w.next_action()).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }
}
