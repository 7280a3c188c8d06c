//! The prepare fast path: the kubelet plugin, in-process against the in-memory API server,
//! prepares a claim its watch of the node's claims (label `gpu.kerf.dev/node`) holds allocated
//! here without a GET, and GETs every other claim: unlabelled, another UID, being deleted,
//! not allocated here in the cached copy, deleted, or with the cache switched off.

#![allow(
    clippy::needless_pass_by_value,
    reason = "fixtures take JSON values as the tests write them inline"
)]

use std::sync::Arc;
use std::time::Duration;

use crate::common::{DRIVER, NAMESPACE, NODE, TestNode, allocated_claim, uid};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kerf_kubelet_plugin::claim_reader::{Cached, ClaimReader};
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_kubelet_plugin::{Error, PrepareError};
use kerf_proto::PreparedDevice;
use kerf_tests::fixtures;
use kerf_tests::wait::until;
use serde_json::{Value, json};

/// Long enough for a watch event to arrive on a loaded CI machine.
const WAIT: Duration = Duration::from_secs(20);

/// A plugin started with `Connections::kube` against its node's in-memory API server; the
/// test keeps a handle on the claim reader to see what the cache holds.
struct CacheNode {
    node: TestNode,
    plugin: Option<RunningPlugin>,
    reader: Arc<dyn ClaimReader>,
}

impl CacheNode {
    /// The plugin with the claim cache (`cache`) or without it (`--claim-cache=false`).
    async fn start(cache: bool) -> Self {
        let node = TestNode::new("h100-sxm-80gb");
        let mut config = node.config();
        config.claim_device_status = false;
        config.claim_cache = cache;
        let connections = Connections::kube(node.plugin_client(), &config);
        let reader = Arc::clone(&connections.claim_reader);
        let plugin = plugin::start(&config, node.inventory(), connections)
            .await
            .unwrap();
        let started = CacheNode {
            node,
            plugin: Some(plugin),
            reader,
        };
        if cache {
            until("the claim cache's first list", WAIT, || {
                !matches!(started.cached("any", "claim"), Cached::NotSynced)
            })
            .await;
        }
        started
    }

    fn cached(&self, namespace: &str, name: &str) -> Cached {
        self.reader.cached(namespace, name)
    }

    /// The UID of the cache's copy of `name`, if it holds one.
    fn cached_uid(&self, name: &str) -> Option<String> {
        match self.cached(NAMESPACE, name) {
            Cached::Found(claim) => claim.metadata.uid.clone(),
            _ => None,
        }
    }

    /// Waits until the cache's copy of `name` satisfies `condition`.
    async fn until_cached(&self, name: &str, what: &str, condition: impl Fn(&Cached) -> bool) {
        until(what, WAIT, || condition(&self.cached(NAMESPACE, name))).await;
    }

    fn running(&self) -> &RunningPlugin {
        self.plugin.as_ref().unwrap()
    }

    async fn prepare(&self, claim: &ClaimRef) -> kerf_kubelet_plugin::Result<Vec<PreparedDevice>> {
        let mut answers = self
            .running()
            .preparer()
            .prepare(std::slice::from_ref(claim))
            .await;
        answers.pop().unwrap().1
    }

    async fn unprepare(&self, claim: &ClaimRef) {
        for (uid, answer) in self
            .running()
            .preparer()
            .unprepare(std::slice::from_ref(claim))
            .await
        {
            answer.unwrap_or_else(|e| panic!("unprepare of {uid}: {e}"));
        }
    }

    /// GETs of the claim `name` the API server received, both kinds.
    fn gets(&self, name: &str) -> usize {
        self.node
            .api
            .count("get", &fixtures::claim_path(NAMESPACE, name))
    }

    /// GETs of the claim `name` with `resourceVersion=0` (kube-apiserver's watch cache).
    fn any_gets(&self, name: &str) -> usize {
        let path = fixtures::claim_path(NAMESPACE, name);
        self.node
            .api
            .requests()
            .iter()
            .filter(|r| r.verb == "get" && r.path == path && r.query.contains("resourceVersion=0"))
            .count()
    }

    /// The plugin's count of claim lookups from `source` for `reason`.
    fn lookups(&self, source: &str, reason: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, self.running().registry()).unwrap();
        let series =
            format!("kerf_plugin_claim_lookups_total{{source=\"{source}\",reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&series))
            .map_or(0, |n| n.trim().parse().unwrap())
    }

    /// Stops the plugin, which must stop cleanly (the claim watch included).
    async fn stop(mut self) {
        self.plugin.take().unwrap().shutdown().await.unwrap();
    }
}

fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: NAMESPACE.to_owned(),
        uid: uid.to_owned(),
        name: name.to_owned(),
    }
}

/// A claim allocated one whole device in `pool` (`None`: not allocated), with the node label
/// of this node when `labelled`.
fn claim(name: &str, uid: &str, labelled: bool, allocation: Option<(&str, &str)>) -> Value {
    let results = allocation.map_or_else(Vec::new, |(pool, device)| {
        vec![json!({"request": "gpu", "driver": DRIVER, "pool": pool, "device": device})]
    });
    let mut claim = allocated_claim(name, uid, &json!({"devices": {"results": results}}));
    if allocation.is_none() {
        claim["status"] = json!({});
    }
    if labelled {
        claim["metadata"]["labels"] = json!({ CLAIM_NODE_LABEL: node_label_value(NODE) });
    }
    claim
}

/// An allocation on this node.
#[allow(clippy::unnecessary_wraps, reason = "what claim() takes")]
fn here(device: &str) -> Option<(&'static str, &str)> {
    Some((NODE, device))
}

fn is_claim_error(result: &kerf_kubelet_plugin::Result<Vec<PreparedDevice>>) -> bool {
    matches!(result, Err(Error::Prepare(_)))
}

#[tokio::test]
async fn a_cached_claim_prepares_without_a_get_and_as_the_get_path_does() {
    let cached = CacheNode::start(true).await;
    let uncached = CacheNode::start(false).await;
    let (name, id) = ("train", uid(1));
    for node in [&cached, &uncached] {
        node.node.api.insert(claim(name, &id, true, here("gpu-0")));
    }
    cached
        .until_cached(name, "the labelled claim in the cache", |c| {
            matches!(c, Cached::Found(_))
        })
        .await;

    let from_cache = cached.prepare(&claim_ref(name, &id)).await.unwrap();
    let from_api = uncached.prepare(&claim_ref(name, &id)).await.unwrap();

    assert_eq!(cached.gets(name), 0, "the cached claim was GET");
    assert_eq!(cached.lookups("cache", ""), 1);
    assert_eq!(uncached.gets(name), 1);
    assert_eq!(uncached.lookups("api", "cache_off"), 1);
    assert_eq!(from_cache, from_api);
    assert_eq!(from_cache[0].device_name, "gpu-0");
    assert!(
        from_cache[0].cdi_device_ids[0].contains(&id),
        "{from_cache:?}"
    );
    cached.stop().await;
    uncached.stop().await;
}

#[tokio::test]
async fn the_watch_selects_this_nodes_label_across_namespaces() {
    let node = CacheNode::start(true).await;
    let requests = node.node.api.requests();
    let watches: Vec<_> = requests
        .iter()
        .filter(|r| r.path == "/apis/resource.k8s.io/v1/resourceclaims")
        .collect();
    assert!(!watches.is_empty(), "no list or watch of resourceclaims");
    let selector = format!("labelSelector=gpu.kerf.dev%2Fnode%3D{NODE}");
    for request in &watches {
        assert!(request.query.contains(&selector), "{request:?}");
    }
    assert!(watches.iter().any(|r| r.verb == "watch"), "{watches:?}");
    node.stop().await;
}

#[tokio::test]
async fn an_unlabelled_claim_is_read_with_a_get() {
    let node = CacheNode::start(true).await;
    node.node
        .api
        .insert(claim("plain", &uid(2), false, here("gpu-0")));
    // Another claim's event proves the watch has passed the unlabelled claim's write.
    node.node
        .api
        .insert(claim("marker", &uid(3), true, here("gpu-1")));
    node.until_cached("marker", "the marker claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    assert!(matches!(node.cached(NAMESPACE, "plain"), Cached::Absent));

    node.prepare(&claim_ref("plain", &uid(2))).await.unwrap();

    // kube-apiserver's watch cache answers with the allocation: no quorum read.
    assert_eq!((node.gets("plain"), node.any_gets("plain")), (1, 1));
    assert_eq!(node.lookups("api_any", "miss"), 1);
    node.stop().await;
}

#[tokio::test]
async fn a_claim_recreated_under_its_name_is_refused_by_the_get() {
    let node = CacheNode::start(true).await;
    let (old, new) = (uid(4), uid(5));
    node.node.api.insert(claim("c", &old, true, here("gpu-0")));
    node.until_cached("c", "the first claim", |_| true).await;
    node.node.api.remove(&fixtures::claim_path(NAMESPACE, "c"));
    node.node.api.insert(claim("c", &new, true, here("gpu-0")));
    until("the recreated claim in the cache", WAIT, || {
        node.cached_uid("c").as_deref() == Some(new.as_str())
    })
    .await;

    // The kubelet still names the claim it knew.
    let answer = node.prepare(&claim_ref("c", &old)).await;

    assert!(
        matches!(
            &answer,
            Err(Error::Prepare(PrepareError::UidMismatch { actual, expected, .. }))
                if *actual == new && *expected == old
        ),
        "{answer:?}"
    );
    // The resourceVersion=0 answer has the new UID too, so the quorum GET decides.
    assert_eq!((node.gets("c"), node.any_gets("c")), (2, 1));
    assert_eq!(node.lookups("api", "uid_mismatch"), 1);
    node.stop().await;
}

#[tokio::test]
async fn a_claim_being_deleted_is_read_with_a_get() {
    let node = CacheNode::start(true).await;
    let mut deleting = claim("going", &uid(6), true, here("gpu-0"));
    deleting["metadata"]["finalizers"] = json!(["resource.kubernetes.io/delete-protection"]);
    node.node.api.insert(deleting);
    // A DELETE of a claim with a finalizer only marks it (deletionTimestamp).
    kube::Api::<ResourceClaim>::namespaced(node.node.api.client(), NAMESPACE)
        .delete("going", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    node.until_cached(
        "going",
        "the deleting claim",
        |c| matches!(c, Cached::Found(claim) if claim.metadata.deletion_timestamp.is_some()),
    )
    .await;

    // The GET path prepares it as before: the kubelet, not the plugin, decides whether a pod
    // may still use a claim that is being deleted.
    node.prepare(&claim_ref("going", &uid(6))).await.unwrap();

    assert_eq!((node.gets("going"), node.any_gets("going")), (2, 1));
    assert_eq!(node.lookups("api", "deleting"), 1);
    node.stop().await;
}

#[tokio::test]
async fn a_cached_copy_without_the_allocation_sends_the_prepare_to_the_get() {
    let node = CacheNode::start(true).await;
    let id = uid(7);
    // The label arrives first, as kerf-controller writes it before the allocation.
    node.node.api.insert(claim("early", &id, true, None));
    node.until_cached("early", "the unallocated claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    // Hold the cache at that copy: the watch ends and its resumption is held back, so the
    // allocation below reaches the API server but not the cache (which stays in step as far
    // as it knows: a watch that ends without an error resumes where it was).
    node.node.api.delay_next(
        "watch",
        "/apis/resource.k8s.io/v1/resourceclaims",
        Duration::from_secs(3600),
        1,
    );
    node.node.api.close_watches();
    node.node
        .api
        .insert(claim("early", &id, true, here("gpu-0")));
    assert!(
        matches!(node.cached(NAMESPACE, "early"), Cached::Found(c) if c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none()),
        "the cache saw the allocation"
    );

    let devices = node.prepare(&claim_ref("early", &id)).await.unwrap();

    assert_eq!(devices[0].device_name, "gpu-0");
    assert_eq!((node.gets("early"), node.any_gets("early")), (1, 1));
    assert_eq!(node.lookups("api_any", "not_allocated_here"), 1);
    node.stop().await;
}

#[tokio::test]
async fn a_deleted_claim_is_never_prepared_from_the_cache() {
    let node = CacheNode::start(true).await;
    let id = uid(8);
    node.node
        .api
        .insert(claim("gone", &id, true, here("gpu-0")));
    node.until_cached("gone", "the claim", |c| matches!(c, Cached::Found(_)))
        .await;
    node.node
        .api
        .remove(&fixtures::claim_path(NAMESPACE, "gone"));
    node.until_cached("gone", "the delete event", |c| matches!(c, Cached::Absent))
        .await;

    let answer = node.prepare(&claim_ref("gone", &id)).await;

    assert!(
        matches!(
            &answer,
            Err(Error::Prepare(PrepareError::ClaimNotFound { name, .. })) if name == "gone"
        ),
        "{answer:?}"
    );
    // The watch cache's 404 may be stale; the quorum GET's is not.
    assert_eq!((node.gets("gone"), node.any_gets("gone")), (2, 1));
    assert_eq!(node.lookups("api", "miss"), 1);
    node.stop().await;
}

#[tokio::test]
async fn without_the_cache_every_prepare_gets_its_claim_and_nothing_is_watched() {
    let node = CacheNode::start(false).await;
    let id = uid(9);
    node.node.api.insert(claim("c", &id, true, here("gpu-0")));
    let first = claim_ref("c", &id);
    node.prepare(&first).await.unwrap();
    node.unprepare(&first).await;
    node.prepare(&first).await.unwrap();

    assert_eq!((node.gets("c"), node.any_gets("c")), (2, 0));
    assert_eq!(node.lookups("api", "cache_off"), 2);
    assert_eq!(node.lookups("cache", ""), 0);
    assert_eq!(
        node.node
            .api
            .count("watch", "/apis/resource.k8s.io/v1/resourceclaims"),
        0
    );
    assert!(matches!(node.cached(NAMESPACE, "c"), Cached::Off));
    node.stop().await;
}

#[tokio::test]
async fn a_claim_error_from_the_get_is_the_same_with_the_cache() {
    // Not labelled here and allocated on another node: a miss, then today's error.
    let node = CacheNode::start(true).await;
    node.node.api.insert(claim(
        "elsewhere",
        &uid(10),
        false,
        Some(("node-2", "gpu-0")),
    ));
    let answer = node.prepare(&claim_ref("elsewhere", &uid(10))).await;
    assert!(is_claim_error(&answer), "{answer:?}");
    assert_eq!((node.gets("elsewhere"), node.any_gets("elsewhere")), (2, 1));
    node.stop().await;
}

mod race;

mod miss;

/// Holds the cache at what it has now: the watch ends and its resumption waits an hour, so
/// later writes reach the API server but not the cache (which stays in step as far as it
/// knows: a watch that ends without an error resumes where it was).
fn freeze_cache(node: &CacheNode) {
    node.node.api.delay_next(
        "watch",
        "/apis/resource.k8s.io/v1/resourceclaims",
        Duration::from_secs(3600),
        1,
    );
    node.node.api.close_watches();
}

#[tokio::test]
async fn a_claim_reused_after_its_unprepare_is_not_prepared_from_a_copy_that_lags() {
    let node = CacheNode::start(true).await;
    let id = uid(40);
    node.node
        .api
        .insert(claim("reused", &id, true, here("gpu-0")));
    node.until_cached("reused", "the allocated claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    node.prepare(&claim_ref("reused", &id)).await.unwrap();
    node.unprepare(&claim_ref("reused", &id)).await;
    // The pod is gone; the claim is deallocated and allocated anew (another device) for the
    // next pod, while the cache still holds the first allocation.
    freeze_cache(&node);
    node.node.api.insert(claim("reused", &id, true, None));
    node.node
        .api
        .insert(claim("reused", &id, true, here("gpu-1")));

    let devices = node.prepare(&claim_ref("reused", &id)).await.unwrap();

    assert_eq!(devices[0].device_name, "gpu-1", "prepared the stale copy");
    // Held back: not even kube-apiserver's watch cache is asked.
    assert_eq!((node.gets("reused"), node.any_gets("reused")), (1, 0));
    assert_eq!(node.lookups("api", "unprepared_here"), 1);
    node.stop().await;
}

#[tokio::test]
async fn a_claim_unprepared_here_comes_from_the_cache_again_once_the_watch_shows_it_deallocated() {
    let node = CacheNode::start(true).await;
    let id = uid(41);
    node.node
        .api
        .insert(claim("again", &id, true, here("gpu-0")));
    node.until_cached("again", "the allocated claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    node.prepare(&claim_ref("again", &id)).await.unwrap();
    node.unprepare(&claim_ref("again", &id)).await;
    assert!(matches!(node.cached(NAMESPACE, "again"), Cached::HeldBack));

    node.node.api.insert(claim("again", &id, true, None));
    node.until_cached("again", "the deallocated claim", |c| {
        matches!(c, Cached::Found(claim) if claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none())
    })
    .await;
    node.node
        .api
        .insert(claim("again", &id, true, here("gpu-1")));
    node.until_cached("again", "the new allocation", |c| {
        matches!(c, Cached::Found(claim) if claim.status.as_ref().and_then(|s| s.allocation.as_ref()).is_some())
    })
    .await;
    let devices = node.prepare(&claim_ref("again", &id)).await.unwrap();

    assert_eq!(devices[0].device_name, "gpu-1");
    assert_eq!(node.gets("again"), 0);
    assert_eq!(node.lookups("cache", ""), 2);
    node.stop().await;
}
