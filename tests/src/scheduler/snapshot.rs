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
//! - [`SnapshotSource::Store`] reads [`FakeApi`]'s store at one resourceVersion and decodes
//!   only the objects whose resourceVersion changed since the previous cycle, as an informer
//!   whose caches have caught up would hold them. The view is the same as a list's; only the
//!   cost model is kube-scheduler's.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::ListParams;
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::de::DeserializeOwned;

use super::pods::{claim_key, pod_key};
use crate::fake_api::{FakeApi, StoreView};

/// The objects a cycle decides from.
pub(super) struct Snapshot {
    pub nodes: Vec<Arc<Node>>,
    pub slices: Vec<Arc<ResourceSlice>>,
    pub classes: HashMap<String, Arc<DeviceClass>>,
    pub claims: HashMap<String, Arc<ResourceClaim>>,
    pub pods: Vec<Arc<Pod>>,
}

impl Snapshot {
    fn new(
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
        }
    }
}

/// Where [`Snapshot`]s come from (see the module documentation).
pub enum SnapshotSource {
    /// Lists through the stand-in's client.
    Api,
    /// Reads the fake API server's store, decoding changed objects only.
    Store(Box<StoreCaches>),
}

impl std::fmt::Debug for SnapshotSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SnapshotSource::Api => "Api",
            SnapshotSource::Store(_) => "Store",
        })
    }
}

impl SnapshotSource {
    /// Reads `fake`'s store.
    pub fn store(fake: FakeApi) -> Self {
        SnapshotSource::Store(Box::new(StoreCaches {
            fake,
            nodes: Decoded::default(),
            slices: Decoded::default(),
            classes: Decoded::default(),
            claims: Decoded::default(),
            pods: Decoded::default(),
        }))
    }

    pub(super) async fn snapshot(&mut self, client: &Client) -> Result<Snapshot, kube::Error> {
        match self {
            SnapshotSource::Api => listed(client).await,
            SnapshotSource::Store(caches) => Ok(caches.snapshot()),
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

/// Decoded copies of the five collections a cycle reads from a [`FakeApi`].
pub struct StoreCaches {
    fake: FakeApi,
    nodes: Decoded<Node>,
    slices: Decoded<ResourceSlice>,
    classes: Decoded<DeviceClass>,
    claims: Decoded<ResourceClaim>,
    pods: Decoded<Pod>,
}

impl StoreCaches {
    fn snapshot(&mut self) -> Snapshot {
        let Self {
            fake,
            nodes,
            slices,
            classes,
            claims,
            pods,
        } = self;
        fake.read_store(|view| {
            Snapshot::new(
                nodes.refresh(view),
                slices.refresh(view),
                classes.refresh(view),
                claims.refresh(view),
                pods.refresh(view),
            )
        })
    }
}

/// One collection's objects decoded, keyed by namespace/name, with the resourceVersion each
/// was decoded at.
struct Decoded<K> {
    by_key: HashMap<String, (String, Arc<K>)>,
}

impl<K> Default for Decoded<K> {
    fn default() -> Self {
        Self {
            by_key: HashMap::new(),
        }
    }
}

impl<K> Decoded<K>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    /// The collection as `view` holds it; objects whose resourceVersion is unchanged are
    /// reused, deleted ones forgotten. An object that does not decode as `K` is left out, as
    /// an informer drops what it cannot decode.
    fn refresh(&mut self, view: &StoreView<'_>) -> Vec<Arc<K>> {
        let mut seen = HashMap::with_capacity(self.by_key.len());
        for value in view.objects(&K::url_path(&(), None)) {
            let meta = &value["metadata"];
            let key = format!(
                "{}/{}",
                meta["namespace"].as_str().unwrap_or_default(),
                meta["name"].as_str().unwrap_or_default()
            );
            let version = meta["resourceVersion"].as_str().unwrap_or_default();
            let reused = self
                .by_key
                .remove(&key)
                .filter(|(decoded_at, _)| decoded_at == version);
            let entry = match reused {
                Some(entry) => entry,
                None => match K::deserialize(value) {
                    Ok(object) => (version.to_owned(), Arc::new(object)),
                    Err(_) => continue,
                },
            };
            seen.insert(key, entry);
        }
        self.by_key = seen;
        self.by_key.values().map(|(_, o)| Arc::clone(o)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn node(name: &str, label: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": name, "labels": {"l": label}}})
    }

    #[tokio::test]
    async fn the_store_snapshot_equals_a_list_and_decodes_only_changed_objects() {
        let fake = FakeApi::new();
        fake.insert(node("b", "1"));
        fake.insert(node("a", "1"));
        fake.insert(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}}));
        let client = fake.client();
        let mut store = SnapshotSource::store(fake.clone());
        let from_store = store.snapshot(&client).await.unwrap();
        let from_list = SnapshotSource::Api.snapshot(&client).await.unwrap();
        let names = |s: &Snapshot| s.nodes.iter().map(|n| n.name_any()).collect::<Vec<_>>();
        assert_eq!(names(&from_store), ["a", "b"]);
        assert_eq!(names(&from_store), names(&from_list));
        assert_eq!(from_store.pods.len(), 1);
        assert_eq!(*from_store.pods[0], *from_list.pods[0]);

        fake.insert(node("b", "2"));
        fake.remove("/api/v1/nodes/a");
        let again = store.snapshot(&client).await.unwrap();
        assert_eq!(names(&again), ["b"]);
        assert_eq!(
            again.nodes[0].labels()["l"],
            "2",
            "a changed object is decoded again"
        );
        assert!(
            Arc::ptr_eq(&again.pods[0], &from_store.pods[0]),
            "an unchanged object is reused"
        );
    }
}
