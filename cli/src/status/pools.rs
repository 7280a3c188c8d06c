//! The GPU fragmentation of each node pool, as `kerf status` shows it: kerf-core's
//! LeastFragmentation measure ([`node_fragmentation`]) of every node, summed per pool.
//!
//! A node's pool is the value of its pool label ([`kerf_api::node_pool`]). The GPUs are the
//! whole GPUs of kerf's current ResourceSlices with what every allocated claim holds of them;
//! the workload they are measured against is learned from those same claims, each claim one
//! pod kind observation: as many GPUs as it holds on kerf's whole GPUs, whole or of its slice
//! size. A snapshot has no arrival order, so every claim counts the same (no decay).
//!
//! `kerf status` knows no pod's CPU and memory: every kind's host amounts are zero and nodes are
//! measured with `host: None`. So this is the GPU part, FGD's measure (free capacity the
//! expected pods could not use); GPUs stranded by a node's CPU or memory are in
//! kerf-controller's metrics only. Without any allocated claim there is no workload to measure
//! against: the free GPUs are shown, the fragmentation is not known (`None`), never 0.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::inventory_view::InventoryView;
use kerf_api::node_pool::pool_of;
use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, DeviceUse, Distribution, Fragmentation, HostAmounts, Index,
    PodRequest, SliceSize, TaskShape, UseKind, Workload, node_fragmentation,
};
use serde::{Serialize, Serializer};

use super::model::Snapshot;

/// One node pool's GPUs and their fragmentation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolFragmentation {
    /// The pool: its nodes' value of the pool label, or `unlabeled`.
    pub pool: String,
    /// Nodes of the pool with a pool of kerf's ResourceSlices.
    pub nodes: usize,
    /// Free GPU capacity: each GPU's free share (the smaller of its free memory and compute
    /// fractions), summed.
    pub free_gpus: Decimal,
    /// The part of the free capacity the expected pods could not use; `None` while no claim is
    /// allocated (no workload to measure against).
    pub fragmented_gpus: Option<Decimal>,
    /// `fragmented_gpus / free_gpus` (0 when nothing is free); `None` as `fragmented_gpus`.
    pub ratio: Option<Decimal>,
}

/// A non-negative number to three decimals, kept as thousandths: the status stays comparable
/// (a watch renders again only on a real change) and its JSON free of float noise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Decimal(u64);

impl Decimal {
    /// `value` rounded to three decimals; negative and NaN values are 0.
    pub fn new(value: f64) -> Decimal {
        let thousandths = (value * 1000.0).round();
        if thousandths.is_nan() || thousandths <= 0.0 {
            return Decimal(0);
        }
        // GPU counts and ratios are far below 2^53.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Decimal(thousandths as u64)
    }

    /// The value.
    #[allow(clippy::cast_precision_loss)] // far below 2^52 thousandths
    pub fn value(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// Up to two decimals, trailing zeros dropped: `3`, `1.5`, `0.33`.
    pub fn short(self) -> String {
        let hundredths = (self.0 + 5) / 10;
        let text = format!("{}.{:02}", hundredths / 100, hundredths % 100);
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

impl Serialize for Decimal {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(self.value())
    }
}

/// The fragmentation of every pool of `view`'s nodes, by pool name; `None` when the
/// snapshot's Nodes could not be listed. A node without a Node object is `unlabeled`.
pub(super) fn pools(
    snapshot: &Snapshot,
    view: &InventoryView,
    driver: &str,
    pool_label: &str,
) -> Option<Vec<PoolFragmentation>> {
    if snapshot.nodes_problem.is_some() {
        return None;
    }
    let (index, dist) = index_and_workload(&snapshot.claims, view, driver);
    let labels: BTreeMap<&str, Option<&BTreeMap<String, String>>> = snapshot
        .nodes
        .iter()
        .filter_map(|n| Some((n.metadata.name.as_deref()?, n.metadata.labels.as_ref())))
        .collect();
    let mut sums: BTreeMap<&str, (usize, Fragmentation)> = BTreeMap::new();
    for node in view.nodes.keys() {
        let pool = pool_of(labels.get(node.as_str()).copied().flatten(), pool_label);
        let sum = sums.entry(pool).or_default();
        sum.0 += 1;
        // Every node of the view is in the index: upserted from it.
        if let Some(frag) = node_fragmentation(&index, node, None, &dist) {
            sum.1.free_gpus += frag.free_gpus;
            sum.1.fragmented_gpus += frag.fragmented_gpus;
        }
    }
    let known = !dist.is_empty();
    Some(
        sums.into_iter()
            .map(|(pool, (nodes, frag))| PoolFragmentation {
                pool: pool.to_owned(),
                nodes,
                free_gpus: Decimal::new(frag.free_gpus),
                fragmented_gpus: known.then(|| Decimal::new(frag.fragmented_gpus)),
                ratio: known.then(|| Decimal::new(frag.ratio())),
            })
            .collect(),
    )
}

/// The index of `view`'s whole GPUs with what `claims` hold of them, and the workload those
/// claims make (empty without any claim on them).
fn index_and_workload(
    claims: &[ResourceClaim],
    view: &InventoryView,
    driver: &str,
) -> (Index, Distribution) {
    let gpus: HashSet<(&str, &str)> = view
        .nodes
        .values()
        .flat_map(|n| {
            n.gpus
                .iter()
                .map(move |g| (n.node.as_str(), g.device.as_str()))
        })
        .collect();
    // A watch's store hands the claims in no fixed order; the workload keeps at most its
    // capacity of kinds, so which ones must not depend on it.
    let mut sorted: Vec<&ResourceClaim> = claims.iter().collect();
    sorted.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    let mut index = Index::new();
    // No decay: a snapshot's claims have no arrival order to decay by.
    let mut workload = Workload::new(u32::MAX, 64);
    for claim in sorted {
        let uses = kerf_api::device_uses(claim, driver);
        if uses.is_empty() {
            continue;
        }
        let on_gpus: Vec<&DeviceUse> = uses
            .iter()
            .filter(|u| gpus.contains(&(u.node.as_str(), u.device.as_str())))
            .collect();
        // Claims on MIG devices or shareable GPUs hold nothing the measure sees.
        if let Some(shape) = shape_of(&on_gpus) {
            workload.observe(shape);
        }
        index.set_claim_usage(&claim_key(claim), uses);
    }
    // Usage first: each node then takes its usage once, as it is upserted.
    for node in view.nodes.values() {
        index.upsert_node(node.clone());
    }
    let dist = if workload.seen() == 0 {
        Distribution::default()
    } else {
        workload.rebuild().clone()
    };
    (index, dist)
}

/// The index key of `claim`: its UID, or `namespace/name` for one saved without it.
fn claim_key(claim: &ResourceClaim) -> String {
    match claim.metadata.uid.as_deref().filter(|u| !u.is_empty()) {
        Some(uid) => uid.to_owned(),
        None => format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            claim.metadata.name.as_deref().unwrap_or_default()
        ),
    }
}

/// The pod kind of a claim holding `uses`: one request per device, whole or of the slice's
/// size, turned into a kind as the controller's workload turns a pod ([`TaskShape::of`]);
/// `None` for no use. CPU and memory are not known here: zero.
fn shape_of(uses: &[&DeviceUse]) -> Option<TaskShape> {
    if uses.is_empty() {
        return None;
    }
    let requests = uses
        .iter()
        .map(|u| match u.kind {
            UseKind::Whole => DeviceRequest::whole("gpu", 1),
            UseKind::Slice {
                memory_bytes,
                compute_percent,
                ..
            } => DeviceRequest::slices(
                "gpu",
                1,
                SliceSize {
                    memory_bytes,
                    compute_percent,
                },
            ),
        })
        .collect();
    let pod = PodRequest {
        claims: vec![ClaimRequest {
            key: String::new(),
            requests,
        }],
    };
    Some(TaskShape::of(&pod, HostAmounts::default()))
}

/// The table rows of `pools`: a header, then one row per pool; `-` for a fragmentation not
/// known.
pub(super) fn rows(pools: &[PoolFragmentation]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["POOL", "NODES", "FREE GPUS", "FRAGMENTED", "RATIO"]
            .map(str::to_owned)
            .to_vec(),
    ];
    let known = |value: Option<Decimal>| value.map_or_else(|| "-".to_owned(), Decimal::short);
    for pool in pools {
        rows.push(vec![
            pool.pool.clone(),
            pool.nodes.to_string(),
            pool.free_gpus.short(),
            known(pool.fragmented_gpus),
            known(pool.ratio),
        ]);
    }
    rows
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    use kerf_api::node_pool::{DEFAULT_NODE_POOL_LABEL, UNLABELED_POOL};
    use serde_json::{Value, json};

    use super::super::model::{Snapshot, Status};
    use super::*;

    const DRIVER: &str = "gpu.kerf.dev";

    /// Two H100s on `node`, as the kubelet plugin publishes them.
    fn slices(node: &str) -> Vec<ResourceSlice> {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, node)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, spec)| {
                serde_json::from_value(json!({
                    "metadata": {"name": kerf_api::slice_name(node, DRIVER, i)},
                    "spec": serde_json::to_value(spec).unwrap(),
                }))
                .unwrap()
            })
            .collect()
    }

    /// A Node, in pool `pool` of the default label when given.
    fn node(name: &str, pool: Option<&str>) -> Node {
        let mut value = json!({"metadata": {"name": name}});
        if let Some(pool) = pool {
            value["metadata"]["labels"] = json!({DEFAULT_NODE_POOL_LABEL: pool});
        }
        serde_json::from_value(value).unwrap()
    }

    /// A claim allocated on `device` of `node`: whole, or with `slice` (memory GiB, compute
    /// percent) a kerf-controller MPS slice.
    fn claim(name: &str, node: &str, device: &str, slice: Option<(u64, u8)>) -> ResourceClaim {
        let result = json!({"request": "gpu", "driver": DRIVER, "pool": node, "device": device});
        let mut value = json!({
            "metadata": {"namespace": "default", "name": name, "uid": format!("uid-{name}")},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {"results": [result]}}},
        });
        if let Some((memory_gib, compute_percent)) = slice {
            let entry: Value = json!({"pool": node, "device": device, "gpuUUID": "GPU-x",
                "memoryBytes": memory_gib << 30, "computePercent": compute_percent,
                "sharing": "MPS"});
            value["status"]["allocation"]["devices"]["config"] = json!([{
                "source": "FromClaim",
                "requests": ["gpu"],
                "opaque": {"driver": DRIVER, "parameters": {
                    "apiVersion": "gpu.kerf.dev/v1alpha1",
                    "kind": "GpuSliceAllocation",
                    "devices": [entry],
                }},
            }]);
        }
        serde_json::from_value(value).unwrap()
    }

    /// Pool `small` (node a-1: a 20Gi 25 % slice on gpu-0), pool `big` (node b-1: gpu-0 held
    /// whole), node c-1 without the label (both GPUs held whole), with `claims` or none.
    fn snapshot(claims: bool) -> Snapshot {
        let mut snapshot = Snapshot {
            slices: ["a-1", "b-1", "c-1"]
                .iter()
                .flat_map(|n| slices(n))
                .collect(),
            nodes: vec![
                node("a-1", Some("small")),
                node("b-1", Some("big")),
                node("c-1", None),
            ],
            ..Snapshot::default()
        };
        if claims {
            snapshot.claims = vec![
                claim("slice", "a-1", "gpu-0", Some((20, 25))),
                claim("whole-b", "b-1", "gpu-0", None),
                claim("whole-c0", "c-1", "gpu-0", None),
                claim("whole-c1", "c-1", "gpu-1", None),
            ];
        }
        snapshot
    }

    fn pools_of(snapshot: &Snapshot) -> BTreeMap<String, PoolFragmentation> {
        Status::new(snapshot, DRIVER)
            .pools
            .unwrap()
            .into_iter()
            .map(|p| (p.pool.clone(), p))
            .collect()
    }

    #[test]
    fn slices_that_leave_gpus_partly_used_fragment_their_pool_against_whole_gpus() {
        let pools = pools_of(&snapshot(true));
        assert_eq!(
            pools.keys().map(String::as_str).collect::<Vec<_>>(),
            ["big", "small", UNLABELED_POOL]
        );
        // Workload: 3/4 whole GPUs, 1/4 slices of 20Gi and 25 %. In `small`, the part-used
        // gpu-0 (0.75 free) is fragment to the whole-GPU pods: 0.75 × 0.75 of 1.75 free.
        let small = &pools["small"];
        assert_eq!(small.nodes, 1);
        assert!((small.free_gpus.value() - 1.75).abs() < 0.01, "{small:?}");
        let fragmented = small.fragmented_gpus.unwrap().value();
        assert!((fragmented - 0.5625).abs() < 0.01, "{small:?}");
        assert!((small.ratio.unwrap().value() - 0.5625 / 1.75).abs() < 0.01);
        // In `big`, the free GPU is idle: every kind fits it.
        let big = &pools["big"];
        assert_eq!(
            (big.free_gpus, big.fragmented_gpus, big.ratio),
            (Decimal::new(1.0), Some(Decimal(0)), Some(Decimal(0)))
        );
        let unlabeled = &pools[UNLABELED_POOL];
        assert_eq!((unlabeled.nodes, unlabeled.free_gpus), (1, Decimal(0)));
    }

    #[test]
    fn without_allocated_claims_fragmentation_is_not_known() {
        let status = Status::new(&snapshot(false), DRIVER);
        let pools = status.pools.as_ref().unwrap();
        assert_eq!(pools.len(), 3);
        for pool in pools {
            assert_eq!(pool.free_gpus, Decimal::new(2.0), "{pool:?}");
            assert_eq!((pool.fragmented_gpus, pool.ratio), (None, None), "{pool:?}");
        }
        let doc = serde_json::to_value(&status).unwrap();
        assert_eq!(
            doc["pools"][0],
            json!({"pool": "big", "nodes": 1, "freeGpus": 2.0, "fragmentedGpus": null,
                   "ratio": null})
        );
        let table = super::super::table(&status);
        assert!(
            table.contains("fragmentation not known: no allocated claim"),
            "{table}"
        );
    }

    #[test]
    fn nodes_without_the_label_or_a_node_object_are_unlabeled() {
        let mut snapshot = snapshot(true);
        snapshot
            .nodes
            .retain(|n| n.metadata.name.as_deref() != Some("b-1"));
        let pools = pools_of(&snapshot);
        assert_eq!(
            pools.keys().map(String::as_str).collect::<Vec<_>>(),
            ["small", UNLABELED_POOL]
        );
        assert_eq!(pools[UNLABELED_POOL].nodes, 2);
        // Another label names other pools.
        let status = Status::with_pool_label(&snapshot, DRIVER, "example.com/pool");
        let pools = status.pools.unwrap();
        assert_eq!((pools.len(), pools[0].nodes), (1, 3));
        assert_eq!(status.pool_label, "example.com/pool");
    }

    #[test]
    fn pools_are_omitted_with_the_reason_when_nodes_cannot_be_listed() {
        let mut snapshot = snapshot(true);
        snapshot.nodes.clear();
        snapshot.nodes_problem = Some("not allowed to list Nodes".to_owned());
        let status = Status::new(&snapshot, DRIVER);
        assert_eq!(status.pools, None);
        let table = super::super::table(&status);
        assert!(
            table.contains(&format!(
                "GPU fragmentation per node pool (label {DEFAULT_NODE_POOL_LABEL}): not shown, \
                 not allowed to list Nodes\n"
            )),
            "{table}"
        );
    }

    #[test]
    fn the_table_lists_each_pool() {
        let table = super::super::table(&Status::new(&snapshot(true), DRIVER));
        let rows: Vec<String> = table
            .lines()
            .skip_while(|l| !l.starts_with("GPU fragmentation per node pool"))
            .skip(1)
            .take(4)
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            rows,
            [
                "POOL NODES FREE GPUS FRAGMENTED RATIO",
                "big 1 1 0 0",
                "small 1 1.75 0.56 0.32",
                "unlabeled 1 0 0 0",
            ]
        );
    }

    #[test]
    fn decimals_round_to_thousandths() {
        assert_eq!(Decimal::new(0.33333), Decimal(333));
        assert_eq!(Decimal::new(-1.0), Decimal(0));
        assert_eq!(Decimal::new(f64::NAN), Decimal(0));
        assert_eq!(Decimal(1750).short(), "1.75");
        assert_eq!(Decimal(2000).short(), "2");
        assert_eq!(Decimal(333).short(), "0.33");
        assert_eq!(Decimal(0).short(), "0");
    }
}
