//! Where a scheduling cycle's view of the cluster comes from.
//!
//! kube-scheduler never reads the cluster per cycle: its informers decode each object once, when
//! it changes, and a cycle starts from a snapshot of those caches
//! (`pkg/scheduler/schedule_one.go`, `schedulingCycle` → `Cache.UpdateSnapshot` in
//! `pkg/scheduler/backend/cache/cache.go`, which copies only the nodes whose generation moved;
//! the DynamicResources plugin reads claims, slices and classes from listers and the claim
//! assume cache in `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`).
//! Two sources give the stand-in the same consistent view at the start of a cycle:
//!
//! - [`SnapshotSource::Api`] lists nodes, slices, classes, claims and pods through the client,
//!   for any API server. Every cycle pays for encoding and decoding the whole cluster, which
//!   is far more than kube-scheduler pays and grows with the objects' size.
//! - [`SnapshotSource::Reader`] asks a [`SnapshotReader`], such as kerf-tests' reader of its
//!   in-memory API server's store, which decodes only the objects that changed since the
//!   previous cycle, as an informer whose caches have caught up would hold them. The view is
//!   the same as a list's; only the cost model is kube-scheduler's.
//!
//! A [`Snapshot`] is plain data: [`crate::Allocator`] decides from one without any client.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::ListParams;
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;

use crate::pods::{claim_key, pod_key};
use crate::prepared::Prepared;

/// The objects a cycle decides from.
///
/// The allocator works out what it needs of the slices once per snapshot (pools, parsed
/// capacities, CEL inputs) and keeps it with the snapshot: change the cluster by building a
/// new snapshot, not by editing these fields after allocating from it. A clone starts without
/// that work.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The nodes, by name.
    pub nodes: Vec<Arc<Node>>,
    /// The ResourceSlices, by driver, pool and name: the allocator's device order.
    pub slices: Vec<Arc<ResourceSlice>>,
    /// The DeviceClasses by name.
    pub classes: HashMap<String, Arc<DeviceClass>>,
    /// The claims by `namespace/name`.
    pub claims: HashMap<String, Arc<ResourceClaim>>,
    /// The pods, by `namespace/name`.
    pub pods: Vec<Arc<Pod>>,
    /// The allocator's view of the slices, built on first use.
    prepared: OnceLock<Prepared>,
}

impl Clone for Snapshot {
    fn clone(&self) -> Self {
        Self {
            nodes: self.nodes.clone(),
            slices: self.slices.clone(),
            classes: self.classes.clone(),
            claims: self.claims.clone(),
            pods: self.pods.clone(),
            prepared: OnceLock::new(),
        }
    }
}

impl Snapshot {
    /// A snapshot of these objects, put in the orders documented on the fields.
    pub fn new(
        mut nodes: Vec<Arc<Node>>,
        mut slices: Vec<Arc<ResourceSlice>>,
        classes: Vec<Arc<DeviceClass>>,
        claims: Vec<Arc<ResourceClaim>>,
        mut pods: Vec<Arc<Pod>>,
    ) -> Self {
        nodes.sort_by_key(|n| n.name_any());
        slices.sort_by(|a, b| {
            (&a.spec.driver, &a.spec.pool.name, a.name_any()).cmp(&(
                &b.spec.driver,
                &b.spec.pool.name,
                b.name_any(),
            ))
        });
        pods.sort_by_key(|p| pod_key(p));
        Self {
            nodes,
            slices,
            classes: classes.into_iter().map(|c| (c.name_any(), c)).collect(),
            claims: claims.into_iter().map(|c| (claim_key(&c), c)).collect(),
            pods,
            prepared: OnceLock::new(),
        }
    }

    /// The allocator's view of the slices, worked out on the first call.
    pub(crate) fn prepared(&self) -> &Prepared {
        self.prepared.get_or_init(|| Prepared::new(self))
    }
}

/// A source of snapshots other than listing through the client (see the module
/// documentation).
pub trait SnapshotReader: Send + Sync {
    /// The cluster as it is now.
    fn snapshot(&mut self) -> Snapshot;
}

/// Where [`Snapshot`]s come from (see the module documentation).
pub enum SnapshotSource {
    /// Lists through the stand-in's client.
    Api,
    /// Asks a reader, such as one of an in-memory API server's store.
    Reader(Box<dyn SnapshotReader>),
}

impl std::fmt::Debug for SnapshotSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SnapshotSource::Api => "Api",
            SnapshotSource::Reader(_) => "Reader",
        })
    }
}

impl SnapshotSource {
    /// The cluster as the source sees it now.
    ///
    /// # Errors
    ///
    /// A failed list.
    pub async fn snapshot(&mut self, client: &Client) -> Result<Snapshot, kube::Error> {
        match self {
            SnapshotSource::Api => listed(client).await,
            SnapshotSource::Reader(reader) => Ok(reader.snapshot()),
        }
    }
}

async fn listed(client: &Client) -> Result<Snapshot, kube::Error> {
    async fn all<K>(client: &Client) -> Result<Vec<Arc<K>>, kube::Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let items = Api::<K>::all(client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        Ok(items.into_iter().map(Arc::new).collect())
    }
    Ok(Snapshot::new(
        all(client).await?,
        all(client).await?,
        all(client).await?,
        all(client).await?,
        all(client).await?,
    ))
}
