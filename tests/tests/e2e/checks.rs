//! What the suite asserts about the objects it reads back: kerf's ResourceSlices, the
//! allocations on claims, and the report a test container prints. Pure functions over API
//! objects and text, unit-tested without a cluster.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{
    Device, DeviceRequestAllocationResult, ResourceClaim, ResourceSlice,
};
use kerf_api::ownership;
use kerf_api::params::{GpuSliceAllocation, OpaqueConfig};
use kerf_api::quantity::quantity_bytes;
use kerf_api::resourceslice::{
    TYPE_GPU, TYPE_MIG, attributes, capacities, device_attribute, device_capacity,
};

use super::manifests::{DEVICES_MARKER, END_MARKER, ENV_MARKER};

/// The finalizer kerf's controller puts on the claims it allocates.
pub const ALLOCATION_FINALIZER: &str = "gpu.kerf.dev/allocation";
/// The annotation naming the node kerf's controller allocated a claim on.
pub const ALLOCATED_NODE_ANNOTATION: &str = "gpu.kerf.dev/allocated-node";

/// One device of the current generation of a kerf pool, as the tests need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedDevice {
    /// The pool, which is the node name.
    pub node: String,
    /// The device name (`gpu-<minor>` or a MIG device name).
    pub name: String,
    /// The `type` attribute: `gpu` or `mig`.
    pub kind: String,
    /// The `uuid` attribute.
    pub uuid: String,
    /// The `minor` attribute of a whole GPU.
    pub minor: Option<i64>,
    /// The `memory` capacity in bytes.
    pub memory_bytes: Option<u64>,
    /// The `allocator` attribute: which allocator owns the device (`scheduler` or
    /// `controller`), absent while the node's ownership record does not name it.
    pub owner: Option<String>,
}

/// The slices of `driver`, grouped by pool name.
pub fn pools<'a>(
    slices: &'a [ResourceSlice],
    driver: &str,
) -> BTreeMap<&'a str, Vec<&'a ResourceSlice>> {
    let mut pools: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.spec.driver == driver) {
        pools
            .entry(slice.spec.pool.name.as_str())
            .or_default()
            .push(slice);
    }
    pools
}

/// The slices of a pool that consumers use: those of its highest generation.
fn current<'a>(slices: &[&'a ResourceSlice]) -> (i64, Vec<&'a ResourceSlice>) {
    let generation = slices
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or_default();
    let current = slices
        .iter()
        .copied()
        .filter(|s| s.spec.pool.generation == generation)
        .collect();
    (generation, current)
}

/// Every device of every pool of `driver`, from each pool's highest generation.
pub fn published_devices(slices: &[ResourceSlice], driver: &str) -> Vec<PublishedDevice> {
    let mut out = Vec::new();
    for (pool, pool_slices) in pools(slices, driver) {
        let (_, current) = current(&pool_slices);
        for device in current.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
            let string = |name| {
                device_attribute(device, driver, name)
                    .and_then(|a| a.string.clone())
                    .unwrap_or_default()
            };
            out.push(PublishedDevice {
                node: pool.to_owned(),
                name: device.name.clone(),
                kind: string(attributes::TYPE),
                uuid: string(attributes::UUID),
                minor: device_attribute(device, driver, attributes::MINOR).and_then(|a| a.int),
                memory_bytes: device_capacity(device, driver, capacities::MEMORY)
                    .and_then(|q| quantity_bytes(q).ok()),
                owner: device_attribute(device, driver, ownership::ATTRIBUTE)
                    .and_then(|a| a.string.clone()),
            });
        }
    }
    out
}

/// Everything wrong with the pools of `driver` as kerf documents them (DESIGN.md "The
/// objects", api/src/resourceslice.rs); empty when they are complete and consistent.
///
/// Per pool: the pool is named after its node and every slice sets `spec.nodeName` to it;
/// only slices of the highest generation exist (older ones are deleted once a new generation
/// is complete); there are exactly `resourceSliceCount` of them and they agree on it; device
/// names and UUIDs are unique; and every device passes [`device_problems`].
pub fn pool_problems(slices: &[ResourceSlice], driver: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (pool, pool_slices) in pools(slices, driver) {
        let (generation, current) = current(&pool_slices);
        let mut problem = |text: String| problems.push(format!("pool {pool:?}: {text}"));
        let stale = pool_slices.len() - current.len();
        if stale > 0 {
            problem(format!(
                "{stale} slice(s) of generations below {generation} still exist"
            ));
        }
        let counts: BTreeSet<i64> = current
            .iter()
            .map(|s| s.spec.pool.resource_slice_count)
            .collect();
        match counts.iter().collect::<Vec<_>>().as_slice() {
            [count] if usize::try_from(**count).ok() == Some(current.len()) => {}
            [count] => problem(format!(
                "resourceSliceCount is {count} but generation {generation} has {} slice(s)",
                current.len()
            )),
            several => problem(format!(
                "slices of generation {generation} disagree on resourceSliceCount: {several:?}"
            )),
        }
        for slice in &current {
            if slice.spec.node_name.as_deref() != Some(pool) {
                problem(format!(
                    "slice {:?} has spec.nodeName {:?}; kerf names the pool after its node",
                    slice.metadata.name.as_deref().unwrap_or_default(),
                    slice.spec.node_name
                ));
            }
        }
        let devices: Vec<&Device> = current
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect();
        if devices.is_empty() {
            problem("publishes no devices".to_owned());
        }
        let mut names = BTreeSet::new();
        let mut uuids = BTreeSet::new();
        for device in devices {
            if !names.insert(device.name.as_str()) {
                problem(format!("device {:?} is published twice", device.name));
            }
            if let Some(uuid) =
                device_attribute(device, driver, attributes::UUID).and_then(|a| a.string.as_deref())
                && !uuids.insert(uuid)
            {
                problem(format!("uuid {uuid:?} is published twice"));
            }
            for text in device_problems(device, driver) {
                problem(format!("device {:?}: {text}", device.name));
            }
        }
    }
    problems
}

/// Everything wrong with one published device: its name, the attributes its type must have
/// and their value types, its capacities, the ownership attribute's value when it is there,
/// and no attribute kerf does not document.
pub fn device_problems(device: &Device, driver: &str) -> Vec<String> {
    let mut problems = name_problems(device, driver);
    let attribute = |name: &str| device_attribute(device, driver, name);
    let string = |name: &str, problems: &mut Vec<String>| -> Option<String> {
        match attribute(name).and_then(|a| a.string.clone()) {
            Some(value) if !value.is_empty() => Some(value),
            _ => {
                problems.push(format!("attribute {name:?} is not a non-empty string"));
                None
            }
        }
    };
    let int = |name: &str, problems: &mut Vec<String>| -> Option<i64> {
        match attribute(name).and_then(|a| a.int) {
            Some(value) if value >= 0 => Some(value),
            _ => {
                problems.push(format!("attribute {name:?} is not a non-negative int"));
                None
            }
        }
    };
    for name in [
        attributes::PRODUCT_NAME,
        attributes::BRAND,
        attributes::ARCHITECTURE,
    ] {
        string(name, &mut problems);
    }
    for name in [
        attributes::CUDA_COMPUTE_CAPABILITY,
        attributes::DRIVER_VERSION,
    ] {
        if attribute(name).and_then(|a| a.version.as_ref()).is_none() {
            problems.push(format!("attribute {name:?} is not a version"));
        }
    }
    let uuid = string(attributes::UUID, &mut problems).unwrap_or_default();
    match string(attributes::TYPE, &mut problems).as_deref() {
        Some(TYPE_GPU) => {
            if !uuid.starts_with("GPU-") {
                problems.push(format!("uuid {uuid:?} of a GPU does not start with GPU-"));
            }
            int(attributes::INDEX, &mut problems);
            string(attributes::PCI_BUS_ID, &mut problems);
            if let Some(minor) = int(attributes::MINOR, &mut problems)
                && device.name != format!("gpu-{minor}")
            {
                problems.push(format!("a GPU of minor {minor} must be named gpu-{minor}"));
            }
        }
        Some(TYPE_MIG) => {
            if !uuid.starts_with("MIG-") {
                problems.push(format!(
                    "uuid {uuid:?} of a MIG device does not start with MIG-"
                ));
            }
            string(attributes::PROFILE, &mut problems);
            string(attributes::PARENT_UUID, &mut problems);
            int(attributes::PLACEMENT_SIZE, &mut problems);
            let parent = int(attributes::PARENT_MINOR, &mut problems);
            let start = int(attributes::PLACEMENT_START, &mut problems);
            if let (Some(parent), Some(start)) = (parent, start) {
                let prefix = format!("gpu-{parent}-mig-");
                let suffix = format!("-{start}");
                if !device.name.starts_with(&prefix) || !device.name.ends_with(&suffix) {
                    problems.push(format!(
                        "a MIG device of GPU {parent} at placement {start} must be named {prefix}<profile>{suffix}"
                    ));
                }
            }
        }
        Some(other) => problems.push(format!("type {other:?} is neither gpu nor mig")),
        None => {}
    }
    match device_capacity(device, driver, capacities::MEMORY).map(quantity_bytes) {
        Some(Ok(_)) => {}
        Some(Err(e)) => problems.push(format!("capacity memory: {e}")),
        None => problems.push("capacity memory is missing".to_owned()),
    }
    let multiprocessors = device_capacity(device, driver, capacities::MULTIPROCESSORS)
        .and_then(|q| q.0.parse::<u64>().ok());
    if multiprocessors.is_none_or(|n| n == 0) {
        problems.push("capacity multiprocessors is not a positive integer".to_owned());
    }
    problems
}

/// The attributes and capacities of `device` that kerf does not document, and an ownership
/// attribute (absent until kerf's controller records the device's owner, see
/// api/src/ownership.rs) whose value is not an owner.
fn name_problems(device: &Device, driver: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let domain_prefix = format!("{driver}/");
    for name in device.attributes.iter().flat_map(|a| a.keys()) {
        let short = name.strip_prefix(&domain_prefix).unwrap_or(name);
        if !attributes::ALL.contains(&short) && short != ownership::ATTRIBUTE {
            problems.push(format!("attribute {name:?} is not one kerf documents"));
        }
    }
    if let Some(attribute) = device_attribute(device, driver, ownership::ATTRIBUTE)
        && ownership::published_owner(device, driver).is_none()
    {
        problems.push(format!(
            "attribute {:?} is {attribute:?}, not the string \"scheduler\" or \"controller\"",
            ownership::ATTRIBUTE
        ));
    }
    for name in device.capacity.iter().flat_map(|c| c.keys()) {
        let short = name.strip_prefix(&domain_prefix).unwrap_or(name);
        if !capacities::ALL.contains(&short) {
            problems.push(format!("capacity {name:?} is not one kerf documents"));
        }
    }
    problems
}

/// The allocation results of `driver` on `claim`.
pub fn allocation_results<'a>(
    claim: &'a ResourceClaim,
    driver: &str,
) -> Vec<&'a DeviceRequestAllocationResult> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .collect()
}

/// Whether `claim` has `status.allocation`.
pub fn is_allocated(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some())
}

/// Whether kerf's controller holds `claim` (its finalizer is on it).
pub fn has_allocation_finalizer(claim: &ResourceClaim) -> bool {
    claim
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == ALLOCATION_FINALIZER)
}

/// The node kerf's controller recorded for `claim`, if any.
pub fn allocated_node(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ALLOCATED_NODE_ANNOTATION))
        .map(String::as_str)
}

/// What kerf's controller says it allocated the claim on, in words
/// (`gpu.kerf.dev/allocated-devices`), if it allocated it.
pub fn allocated_devices(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(kerf_api::controller_claims::ALLOCATED_DEVICES_ANNOTATION))
        .map(String::as_str)
}

/// The node names an allocation's `nodeSelector` pins (`matchFields metadata.name In [...]`).
pub fn selector_nodes(selector: &NodeSelector) -> Vec<String> {
    selector
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_fields.iter().flatten())
        .filter(|r| r.key == "metadata.name" && r.operator == "In")
        .flat_map(|r| r.values.iter().flatten().cloned())
        .collect()
}

/// The `GpuSliceAllocation` kerf's controller wrote into the claim's allocation config.
pub fn slice_allocation(claim: &ResourceClaim, driver: &str) -> Result<GpuSliceAllocation> {
    let configs = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.config.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.source == "FromClaim");
    for (i, config) in configs.enumerate() {
        let Some(opaque) = config.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        let path = format!("status.allocation.devices.config[{i}].opaque.parameters");
        if let OpaqueConfig::Slice(slice) = kerf_api::decode_opaque(&opaque.parameters.0, &path)? {
            return Ok(slice);
        }
    }
    bail!("status.allocation.devices.config has no FromClaim GpuSliceAllocation for {driver}")
}

/// One line per claim: name, allocation, reservations, finalizers, kerf's annotation.
pub fn describe_claim(claim: &ResourceClaim) -> String {
    let name = claim.metadata.name.as_deref().unwrap_or_default();
    let status = claim.status.as_ref();
    let allocation = status.and_then(|s| s.allocation.as_ref());
    let results: Vec<String> = allocation
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .map(|r| format!("{}/{}/{}", r.driver, r.pool, r.device))
        .collect();
    let reserved: Vec<String> = status
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .map(|r| format!("{}/{}", r.resource, r.name))
        .collect();
    format!(
        "claim {name}: allocation={} results={results:?} nodeSelector={:?} reservedFor={reserved:?} finalizers={:?} allocatedNode={:?} deleting={}",
        allocation.is_some(),
        allocation
            .and_then(|a| a.node_selector.as_ref())
            .map(selector_nodes)
            .unwrap_or_default(),
        claim.metadata.finalizers.clone().unwrap_or_default(),
        allocated_node(claim),
        claim.metadata.deletion_timestamp.is_some(),
    )
}

/// What a test container printed (see `manifests::script`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerReport {
    /// The container's environment.
    pub env: BTreeMap<String, String>,
    /// Paths that `ls -1d /dev/nvidia*` printed.
    pub device_nodes: BTreeSet<String>,
}

impl ContainerReport {
    /// Parses a container's log; fails unless the whole report is there.
    pub fn parse(logs: &str) -> Result<Self> {
        let lines: Vec<&str> = logs.lines().map(str::trim_end).collect();
        let find = |marker: &str| {
            lines
                .iter()
                .position(|l| *l == marker)
                .with_context(|| format!("no line {marker:?} in the container log:\n{logs}"))
        };
        let (env_at, devices_at, end_at) =
            (find(ENV_MARKER)?, find(DEVICES_MARKER)?, find(END_MARKER)?);
        if !(env_at < devices_at && devices_at < end_at) {
            bail!("the report's markers are out of order in the container log:\n{logs}");
        }
        let env = lines[env_at + 1..devices_at]
            .iter()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let device_nodes = lines[devices_at + 1..end_at]
            .iter()
            .map(|l| l.trim())
            .filter(|l| l.starts_with("/dev/"))
            .map(str::to_owned)
            .collect();
        Ok(ContainerReport { env, device_nodes })
    }

    /// The GPU device nodes, `/dev/nvidia<N>`, without the control nodes.
    pub fn gpu_nodes(&self) -> Vec<&str> {
        self.device_nodes
            .iter()
            .map(String::as_str)
            .filter(|p| {
                p.strip_prefix("/dev/nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .collect()
    }

    /// Fails unless `name` is set to exactly `value`.
    pub fn expect_env(&self, name: &str, value: &str) -> Result<()> {
        match self.env.get(name) {
            Some(actual) if actual == value => Ok(()),
            Some(actual) => bail!("container env {name}={actual:?}, expected {value:?}"),
            None => bail!(
                "container env has no {name} (expected {value:?}); it has: {:?}",
                self.env.keys().collect::<Vec<_>>()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSelectorRequirement, NodeSelectorTerm};
    use k8s_openapi::api::resource::v1::ResourceSliceSpec;
    use kube::api::ObjectMeta;

    const DRIVER: &str = "gpu.kerf.dev";

    fn slices(profile: &str, node: &str, generation: i64) -> Vec<ResourceSlice> {
        let inventory = kerf_core::mock::from_spec(profile).unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, node)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, mut spec): (usize, ResourceSliceSpec)| {
                spec.pool.generation = generation;
                ResourceSlice {
                    metadata: ObjectMeta {
                        name: Some(kerf_api::slice_name(node, DRIVER, i)),
                        ..ObjectMeta::default()
                    },
                    spec,
                }
            })
            .collect()
    }

    fn first_device(slices: &mut [ResourceSlice]) -> &mut Device {
        &mut slices[0].spec.devices.as_mut().unwrap()[0]
    }

    #[test]
    fn what_the_plugin_publishes_passes() {
        let mut all = slices("h100-sxm-80gb", "node-a", 3);
        all.extend(slices("a100-40gb-mig", "node-b", 1));
        all.extend(slices("l4:64", "node-c", 2));
        assert_eq!(pool_problems(&all, DRIVER), Vec::<String>::new());
        // Another driver's pool is not ours to judge.
        assert!(pool_problems(&all, "other.example.com").is_empty());

        let devices = published_devices(&all, DRIVER);
        let gpu3 = devices
            .iter()
            .find(|d| d.node == "node-a" && d.name == "gpu-3")
            .unwrap();
        assert_eq!((gpu3.kind.as_str(), gpu3.minor), ("gpu", Some(3)));
        assert!(gpu3.uuid.starts_with("GPU-"));
        assert_eq!(gpu3.memory_bytes, Some(81559 << 20));
        assert!(
            devices
                .iter()
                .any(|d| d.node == "node-b" && d.kind == "mig")
        );
    }

    #[test]
    fn broken_devices_are_named() {
        let mut all = slices("h100-sxm-80gb", "node-a", 1);
        first_device(&mut all).name = "gpu-9".to_owned();
        let problems = pool_problems(&all, DRIVER).join("\n");
        assert!(
            problems.contains("device \"gpu-9\": a GPU of minor 0 must be named gpu-0"),
            "{problems}"
        );

        let mut all = slices("h100-sxm-80gb", "node-a", 1);
        let device = first_device(&mut all);
        device.attributes.as_mut().unwrap().remove("uuid");
        device.attributes.as_mut().unwrap().insert(
            "colour".to_owned(),
            k8s_openapi::api::resource::v1::DeviceAttribute {
                string: Some("green".to_owned()),
                ..Default::default()
            },
        );
        device.capacity.as_mut().unwrap().remove("multiprocessors");
        let problems = device_problems(first_device(&mut all), DRIVER).join("\n");
        assert!(
            problems.contains("\"uuid\" is not a non-empty string"),
            "{problems}"
        );
        assert!(
            problems.contains("\"colour\" is not one kerf documents"),
            "{problems}"
        );
        assert!(problems.contains("multiprocessors"), "{problems}");
    }

    #[test]
    fn the_ownership_attribute_is_known_and_checked() {
        let mut all = slices("h100-sxm-80gb", "node-a", 1);
        ownership::set_published_owner(first_device(&mut all), Some(ownership::Owner::Scheduler));
        assert_eq!(pool_problems(&all, DRIVER), Vec::<String>::new());
        let devices = published_devices(&all, DRIVER);
        assert_eq!(devices[0].owner.as_deref(), Some("scheduler"));
        assert_eq!(devices[1].owner, None);

        first_device(&mut all)
            .attributes
            .as_mut()
            .unwrap()
            .get_mut(ownership::ATTRIBUTE)
            .unwrap()
            .string = Some("kubelet".to_owned());
        let problems = device_problems(first_device(&mut all), DRIVER).join("\n");
        assert!(
            problems.contains("attribute \"allocator\" is") && problems.contains("kubelet"),
            "{problems}"
        );
    }

    #[test]
    fn inconsistent_pools_are_named() {
        let mut all = slices("l4", "node-a", 2);
        all[0].spec.pool.resource_slice_count = 2;
        let problems = pool_problems(&all, DRIVER).join("\n");
        assert!(
            problems.contains("resourceSliceCount is 2 but generation 2 has 1"),
            "{problems}"
        );

        let mut all = slices("l4", "node-a", 2);
        all.extend(slices("l4", "node-a", 1));
        let problems = pool_problems(&all, DRIVER).join("\n");
        assert!(
            problems.contains("1 slice(s) of generations below 2"),
            "{problems}"
        );

        let mut all = slices("l4", "node-a", 1);
        all[0].spec.node_name = Some("node-b".to_owned());
        assert!(
            pool_problems(&all, DRIVER)
                .join("\n")
                .contains("spec.nodeName")
        );

        let mut all = slices("l4", "node-a", 1);
        let copy = all[0].spec.devices.as_ref().unwrap()[0].clone();
        all[0].spec.devices.as_mut().unwrap().push(copy);
        let problems = pool_problems(&all, DRIVER).join("\n");
        assert!(
            problems.contains("\"gpu-0\" is published twice"),
            "{problems}"
        );
        assert!(problems.contains("is published twice"), "{problems}");
    }

    #[test]
    fn reports_parse_env_and_gpu_nodes() {
        let logs = format!(
            "{ENV_MARKER}\nPATH=/bin\nKERF_DEVICES=gpu-3\nCUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M\n{DEVICES_MARKER}\n/dev/nvidia-uvm\n/dev/nvidia-uvm-tools\n/dev/nvidia3\n/dev/nvidiactl\n{END_MARKER}\n"
        );
        let report = ContainerReport::parse(&logs).unwrap();
        report.expect_env("KERF_DEVICES", "gpu-3").unwrap();
        report
            .expect_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=10240M")
            .unwrap();
        assert!(report.expect_env("KERF_DEVICES", "gpu-4").is_err());
        assert!(report.expect_env("MISSING", "x").is_err());
        assert_eq!(report.gpu_nodes(), ["/dev/nvidia3"]);
        assert!(report.device_nodes.contains("/dev/nvidiactl"));

        let cut = logs.replace(END_MARKER, "");
        assert!(ContainerReport::parse(&cut).is_err());
        let none = format!(
            "{ENV_MARKER}\n{DEVICES_MARKER}\nls: /dev/nvidia*: No such file or directory\n{END_MARKER}"
        );
        assert!(
            ContainerReport::parse(&none)
                .unwrap()
                .device_nodes
                .is_empty()
        );
    }

    #[test]
    fn node_selectors_name_their_nodes() {
        let selector = NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".to_owned(),
                    operator: "In".to_owned(),
                    values: Some(vec!["node-a".to_owned()]),
                }]),
                match_expressions: None,
            }],
        };
        assert_eq!(selector_nodes(&selector), ["node-a"]);
    }
}
