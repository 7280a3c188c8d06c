//! What the simulated cluster is made of: nodes with mock GPU inventories, the Node objects,
//! and the GpuClasses kerf installs.

use std::collections::BTreeMap;

use kerf_core::inventory::{DeviceRef, Inventory};
use serde_json::{Value, json};

use super::SimError;

/// The example MIG class (`mig-1g.5gb`, Scheduler), the model of the sim's other MIG classes.
const MIG_CLASS: &str = include_str!("../../../examples/admin/mig-1g-5gb.yaml");

/// The Scheduler class of whole GPUs (the chart's default classes).
pub const WHOLE_CLASS: &str = "gpu.kerf.dev";
/// The Controller class of GPU slices (the chart's default classes).
pub const SLICE_CLASS: &str = "slice.gpu.kerf.dev";
/// The MIG profiles of the mock A100 inventory, each with a Scheduler class `mig-<profile>`.
pub const MIG_PROFILES: [&str; 3] = ["1g.5gb", "2g.10gb", "3g.20gb"];

/// The Scheduler class of MIG devices of `profile`.
pub fn mig_class(profile: &str) -> String {
    format!("mig-{profile}")
}

/// One simulated node: a name, a mock inventory (`kerf_core::mock::from_spec`) and labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// The node's name (and pool name).
    pub name: String,
    /// The mock inventory, `PROFILE[:COUNT]`, e.g. `h100-sxm-80gb:4`.
    pub mock: String,
    /// Extra labels, e.g. [`kerf_api::ownership::NODE_LABEL`] to pin the node's owner.
    pub labels: BTreeMap<String, String>,
}

impl NodeSpec {
    /// A node `name` with the mock inventory `mock` and no extra labels.
    pub fn new(name: impl Into<String>, mock: impl Into<String>) -> Self {
        NodeSpec {
            name: name.into(),
            mock: mock.into(),
            labels: BTreeMap::new(),
        }
    }

    /// The node's inventory.
    ///
    /// # Errors
    /// [`SimError::Setup`] for a mock spec `kerf_core::mock` refuses.
    pub fn inventory(&self) -> Result<Inventory, SimError> {
        kerf_core::mock::from_spec(&self.mock)
            .map_err(|e| SimError::Setup(format!("node {}: {e}", self.name)))
    }

    /// The Node object: Ready, `kubernetes.io/hostname` and the extra labels.
    pub fn node_object(&self) -> Value {
        let mut labels = json!({"kubernetes.io/hostname": self.name});
        for (key, value) in &self.labels {
            labels[key] = json!(value);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        })
    }
}

/// `count` nodes `node-<i>` cycling through a mix of inventories: 4 × H100 80GB, 4 × A100
/// 40GB of which two in MIG mode (3 and 4 MIG devices), 2 × L4.
pub fn mixed_nodes(count: usize) -> Vec<NodeSpec> {
    const MIX: [&str; 3] = ["h100-sxm-80gb:4", "a100-40gb-mig", "l4:2"];
    (0..count)
        .map(|i| NodeSpec::new(format!("node-{i}"), MIX[i % MIX.len()]))
        .collect()
}

/// `count` nodes `node-<i>` of 8 × H100 80GB each.
pub fn h100_nodes(count: usize) -> Vec<NodeSpec> {
    (0..count)
        .map(|i| NodeSpec::new(format!("node-{i}"), "h100-sxm-80gb"))
        .collect()
}

/// What a published device is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKind {
    /// A whole GPU (not in MIG mode).
    Gpu,
    /// A MIG device of this profile.
    Mig(String),
}

/// One published device of the simulated cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Node (and pool) name.
    pub node: String,
    /// Published device name, e.g. `gpu-3` or `gpu-0-mig-1g-5gb-6`.
    pub name: String,
    /// Whole GPU or MIG device.
    pub kind: DeviceKind,
    /// Memory in bytes.
    pub memory_bytes: u64,
}

/// Every published device of `nodes`, in node order, then in the inventory's order.
///
/// # Errors
/// As [`NodeSpec::inventory`].
pub fn devices(nodes: &[NodeSpec]) -> Result<Vec<DeviceInfo>, SimError> {
    let mut out = Vec::new();
    for node in nodes {
        let inventory = node.inventory()?;
        for device in inventory.devices() {
            let (kind, memory_bytes) = match device {
                DeviceRef::Gpu(gpu) => (DeviceKind::Gpu, gpu.memory_bytes),
                DeviceRef::Mig { mig, .. } => {
                    (DeviceKind::Mig(mig.profile.clone()), mig.memory_bytes)
                }
            };
            out.push(DeviceInfo {
                node: node.name.clone(),
                name: device.name(),
                kind,
                memory_bytes,
            });
        }
    }
    Ok(out)
}

/// The GpuClasses the sim installs, as JSON objects: the chart's default classes as is, and
/// one MIG class per [`MIG_PROFILES`] entry made from `examples/admin/mig-1g-5gb.yaml` (only
/// name and profile changed). kerf-controller's GpuClass reconciler turns each into the
/// DeviceClass the scheduler stand-in reads.
///
/// # Errors
/// [`SimError::Setup`] when a manifest does not parse.
pub fn gpu_classes() -> Result<Vec<Value>, SimError> {
    let parse = |text: &str, what: &str| {
        serde_saphyr::from_multiple::<Value>(text)
            .map_err(|e| SimError::Setup(format!("{what}: {e}")))
    };
    let deployed =
        crate::manifests::default_gpu_classes().map_err(|e| SimError::Setup(e.to_string()))?;
    let mut classes = parse(&deployed, "the chart's default GpuClasses")?;
    let template = parse(MIG_CLASS, "examples/admin/mig-1g-5gb.yaml")?
        .into_iter()
        .next()
        .ok_or_else(|| SimError::Setup("examples/admin/mig-1g-5gb.yaml is empty".to_owned()))?;
    for profile in MIG_PROFILES {
        let mut class = template.clone();
        class["metadata"]["name"] = json!(mig_class(profile));
        class["spec"]["selector"]["migProfile"] = json!(profile);
        classes.push(class);
    }
    classes.retain(|c| !c.is_null());
    Ok(classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_classes_are_kerfs_own() {
        let classes = gpu_classes().unwrap();
        let names: Vec<&str> = classes
            .iter()
            .filter_map(|c| c.pointer("/metadata/name").and_then(Value::as_str))
            .collect();
        assert_eq!(
            names,
            [
                WHOLE_CLASS,
                SLICE_CLASS,
                "mig-1g.5gb",
                "mig-2g.10gb",
                "mig-3g.20gb"
            ]
        );
        assert_eq!(classes[1]["spec"]["allocator"], "Controller");
    }

    #[test]
    fn mixed_nodes_have_whole_gpus_and_mig_devices() {
        let all = devices(&mixed_nodes(3)).unwrap();
        let whole = all.iter().filter(|d| d.kind == DeviceKind::Gpu).count();
        let mig = all.len() - whole;
        assert_eq!((whole, mig), (4 + 2 + 2, 3 + 4));
    }
}
