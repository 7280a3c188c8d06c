//! What the allocator reads from a [`Snapshot`]'s ResourceSlices, worked out once per
//! snapshot instead of once per claim and node: the pools of their newest generation, which
//! pools a node may see, each device's ID and parsed capacity values, and (on first use) its
//! CEL `device` variable.
//!
//! kube-scheduler does the same: its informers decode a slice once when it changes, the
//! allocator gathers pools once per attempt (`GatherPools`, `pools_incubating.go`) and keeps
//! CEL inputs and compiled programs in caches (`celcache.go`), so a Filter over hundreds of
//! nodes does not parse every quantity again for each node.

use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

use cel::Value;
use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::ResourceExt;

use crate::allocated::DeviceKey;
use crate::cel::{CelQuantity, device_value};
use crate::snapshot::Snapshot;

/// A pool's slices of its newest generation, as positions in [`Snapshot::slices`].
#[derive(Debug)]
pub(crate) struct Pool {
    pub slices: Vec<usize>,
    pub complete: bool,
}

/// One published device with what the allocator needs of it, parsed once.
#[derive(Debug)]
pub(crate) struct DeviceFacts {
    /// The device's ID, hashed once.
    pub key: DeviceKey,
    /// The device's position among all devices of the snapshot, for the search's own
    /// bookkeeping of what it took.
    pub slot: usize,
    /// Each capacity's value in units of 10⁻⁹, in the order of `device.capacity`; the parse
    /// error (without the device's name) where it does not parse, reported when used.
    pub capacity: Vec<Result<i128, String>>,
    /// The CEL `device` variable, built when a selector first reads it.
    cel: OnceLock<Result<Value, String>>,
}

impl DeviceFacts {
    /// The CEL `device` variable of `device` (published by `driver`), built once.
    ///
    /// # Errors
    ///
    /// A version or capacity that does not parse, as [`device_value`].
    pub fn cel_value(&self, device: &Device, driver: &str) -> Result<&Value, String> {
        self.cel
            .get_or_init(|| device_value(device, driver))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// The allocator's view of one snapshot's slices (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// Every pool, in (driver, pool name) order.
    pub pools: Vec<Pool>,
    /// Pools whose slices all name one node (`nodeName`), by node: that node's alone.
    by_node: HashMap<String, Vec<usize>>,
    /// Every other pool (`allNodes`, a `nodeSelector`, per-device node selection).
    everywhere: Vec<usize>,
    /// [`Self::pools_for`] of each node of [`Snapshot::nodes`], in that order.
    node_pools: Vec<Vec<usize>>,
    /// Per slice of the snapshot, its devices' facts in device order.
    pub devices: Vec<Vec<DeviceFacts>>,
}

impl Prepared {
    pub(crate) fn new(snapshot: &Snapshot) -> Self {
        let pools = current_pools(&snapshot.slices);
        let mut by_node: HashMap<String, Vec<usize>> = HashMap::new();
        let mut everywhere = Vec::new();
        for (index, pool) in pools.iter().enumerate() {
            match one_node(&snapshot.slices, pool) {
                Some(name) => by_node.entry(name.to_owned()).or_default().push(index),
                None => everywhere.push(index),
            }
        }
        let mut slot = 0;
        let devices = snapshot
            .slices
            .iter()
            .map(|s| facts(s, &mut slot))
            .collect();
        let mut prepared = Self {
            pools,
            by_node,
            everywhere,
            node_pools: Vec::new(),
            devices,
        };
        prepared.node_pools = snapshot
            .nodes
            .iter()
            .map(|node| prepared.pools_for(&node.name_any()))
            .collect();
        prepared
    }

    /// [`Self::pools_for`] the node at `at` in [`Snapshot::nodes`], worked out once.
    pub(crate) fn pools_at(&self, at: usize) -> &[usize] {
        self.node_pools
            .get(at)
            .map(Vec::as_slice)
            .unwrap_or_default()
    }

    /// The pools `node` may see, in pool order: its own and those of no single node. Only
    /// these can hold devices local to `node`, so one pass over N nodes reads N pools' slices
    /// rather than N × N.
    pub(crate) fn pools_for(&self, node: &str) -> Vec<usize> {
        let own = self
            .by_node
            .get(node)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut merged: Vec<usize> = own.iter().chain(&self.everywhere).copied().collect();
        merged.sort_unstable();
        merged
    }
}

/// `GatherPools`: every pool's slices of its newest generation, with whether all of them are
/// there, in pool order.
fn current_pools(slices: &[std::sync::Arc<ResourceSlice>]) -> Vec<Pool> {
    let mut pools: BTreeMap<(&str, &str), Pool> = BTreeMap::new();
    for (index, slice) in slices.iter().enumerate() {
        let spec = &slice.spec;
        let pool = pools
            .entry((&spec.driver, &spec.pool.name))
            .or_insert_with(|| Pool {
                slices: Vec::new(),
                complete: false,
            });
        match pool.slices.first().map(|s| slices[*s].spec.pool.generation) {
            Some(generation) if generation > spec.pool.generation => continue,
            Some(generation) if generation < spec.pool.generation => pool.slices.clear(),
            _ => {}
        }
        pool.slices.push(index);
    }
    let mut pools: Vec<Pool> = pools.into_values().collect();
    for pool in &mut pools {
        pool.complete = pool.slices.first().is_some_and(|s| {
            i64::try_from(pool.slices.len())
                .is_ok_and(|n| n == slices[*s].spec.pool.resource_slice_count)
        });
    }
    pools
}

/// The node every slice of `pool` names, unless one names none or selects per device.
fn one_node<'a>(slices: &'a [std::sync::Arc<ResourceSlice>], pool: &Pool) -> Option<&'a str> {
    let name = slices[*pool.slices.first()?].spec.node_name.as_deref()?;
    pool.slices
        .iter()
        .all(|s| {
            let spec = &slices[*s].spec;
            spec.node_name.as_deref() == Some(name) && spec.per_device_node_selection != Some(true)
        })
        .then_some(name)
}

/// The facts of the slice's devices, numbering them from `slot` on.
fn facts(slice: &ResourceSlice, slot: &mut usize) -> Vec<DeviceFacts> {
    let spec = &slice.spec;
    spec.devices
        .iter()
        .flatten()
        .map(|device| {
            let mut facts = DeviceFacts::of(&spec.driver, &spec.pool.name, device);
            facts.slot = *slot;
            *slot += 1;
            facts
        })
        .collect()
}

impl DeviceFacts {
    /// The facts of `device` in pool `pool` of `driver`.
    pub(crate) fn of(driver: &str, pool: &str, device: &Device) -> Self {
        Self {
            key: DeviceKey::new((driver.to_owned(), pool.to_owned(), device.name.clone())),
            slot: 0,
            capacity: device
                .capacity
                .iter()
                .flatten()
                .map(|(_, c)| CelQuantity::parse(&c.value.0).map(CelQuantity::nanos))
                .collect(),
            cel: OnceLock::new(),
        }
    }
}
