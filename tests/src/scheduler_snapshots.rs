//! The one part of the kube-scheduler stand-in ([`kerf_scheduler_standin`]) that needs
//! [`FakeApi`], and so lives in this harness rather than in the stand-in's crate (which
//! `kerf demo` links): snapshots read from its store ([`store_snapshots`]).
//!
//! kube-scheduler never reads the cluster per cycle: its informers decode each object once,
//! when it changes (`pkg/scheduler/schedule_one.go`, `schedulingCycle` →
//! `Cache.UpdateSnapshot`). [`StoreCaches`] reads [`FakeApi`]'s store at one resourceVersion
//! and decodes only the objects whose resourceVersion changed since the previous cycle, as an
//! informer whose caches have caught up would hold them. The view is the same as a list's;
//! only the cost model is kube-scheduler's.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kerf_scheduler_standin::{Snapshot, SnapshotReader, SnapshotSource};
use kube::Resource;
use serde::de::DeserializeOwned;

use crate::fake_api::{FakeApi, StoreView};

/// Snapshots read from `fake`'s store, decoding changed objects only (see the module
/// documentation), for [`SchedulerStandIn::reading`](kerf_scheduler_standin::SchedulerStandIn::reading).
pub fn store_snapshots(fake: FakeApi) -> SnapshotSource {
    SnapshotSource::Reader(Box::new(StoreCaches {
        fake,
        nodes: Decoded::default(),
        slices: Decoded::default(),
        classes: Decoded::default(),
        claims: Decoded::default(),
        pods: Decoded::default(),
    }))
}

/// Decoded copies of the five collections a cycle reads from a [`FakeApi`].
struct StoreCaches {
    fake: FakeApi,
    nodes: Decoded<Node>,
    slices: Decoded<ResourceSlice>,
    classes: Decoded<DeviceClass>,
    claims: Decoded<ResourceClaim>,
    pods: Decoded<Pod>,
}

impl SnapshotReader for StoreCaches {
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
    use kube::ResourceExt as _;
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
        let mut store = store_snapshots(fake.clone());
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
