//! ResourceSlice publishing by the kubelet plugin, against the in-memory API server.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::ownership::{Owner, RECORD_ANNOTATION, published_owner};
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::metrics::Metrics;
use kerf_kubelet_plugin::publish::{CONTENT_HASH_ANNOTATION, Publisher};
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_api::{FakeApi, describe_requests};
use kerf_tests::logs::CapturedLogs;
use kerf_tests::wait::until;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

mod partitions;
mod shared;
mod taints;

use kerf_tests::fixtures::DRIVER;
const NODE: &str = "node-a";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

struct Setup {
    fake: FakeApi,
    registry: Registry,
    metrics: Metrics,
}

fn setup() -> Setup {
    let fake = FakeApi::new();
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NODE },
    }));
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    Setup {
        fake,
        registry,
        metrics,
    }
}

impl Setup {
    fn publisher(&self) -> Publisher {
        self.publisher_for(NODE, DRIVER)
    }

    fn publisher_for(&self, node: &str, driver: &str) -> Publisher {
        Publisher::new(
            self.fake.client_as(Identity::kerf_kubelet_plugin(node)),
            driver.to_owned(),
            node.to_owned(),
            self.metrics.clone(),
        )
        .with_debounce(Duration::from_millis(20))
        .with_retry_backoff(Duration::from_millis(10), Duration::from_millis(50))
    }

    /// This node's slices of this driver, in name order.
    fn slices(&self) -> Vec<ResourceSlice> {
        self.slices_of(NODE, DRIVER)
    }

    fn slices_of(&self, node: &str, driver: &str) -> Vec<ResourceSlice> {
        self.fake
            .list_resources::<ResourceSlice>(None)
            .into_iter()
            .filter(|s| s.spec.node_name.as_deref() == Some(node) && s.spec.driver == driver)
            .collect()
    }

    fn metrics_text(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }
}

fn h100() -> Inventory {
    kerf_core::mock::from_spec("h100-sxm-80gb").unwrap()
}

/// More GPUs than fit in one slice, so the pool needs two.
fn huge_inventory(gpus: u32) -> Inventory {
    let mut inventory = h100();
    let template = inventory.gpus[0].clone();
    inventory.gpus = (0..gpus)
        .map(|i| {
            let mut gpu = template.clone();
            gpu.index = i;
            gpu.minor = i;
            gpu.uuid = format!("GPU-00000000-0000-0000-0000-{i:012x}");
            gpu.pci_bus_id = format!("0000:{:02x}:{:02x}.0", i / 32, i % 32);
            gpu.nvlink_peers.clear();
            gpu.nvlink_domain = None;
            gpu
        })
        .collect();
    inventory
}

fn generations(slices: &[ResourceSlice]) -> Vec<i64> {
    slices.iter().map(|s| s.spec.pool.generation).collect()
}

fn names(slices: &[ResourceSlice]) -> Vec<String> {
    slices
        .iter()
        .map(|s| s.metadata.name.clone().unwrap_or_default())
        .collect()
}

fn device_names(slice: &ResourceSlice) -> Vec<String> {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| d.name.clone())
        .collect()
}

/// How long a test waits for the publisher.
const WAIT: Duration = Duration::from_secs(10);

fn other_slice(name: &str, node: &str, driver: &str) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": { "name": name },
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": { "name": node, "generation": 7, "resourceSliceCount": 1 },
            "devices": [],
        },
    })
}

#[tokio::test]
async fn initial_publish_creates_the_slices_of_an_8_gpu_node() {
    let s = setup();
    let inventory = h100();
    s.publisher().publish(&inventory).await.unwrap();

    let slices = s.slices();
    assert_eq!(names(&slices), [kerf_api::slice_name(NODE, DRIVER, 0)]);
    let slice = &slices[0];
    assert_eq!(
        device_names(slice),
        (0..8).map(|i| format!("gpu-{i}")).collect::<Vec<_>>()
    );
    assert_eq!(slice.spec.pool.name, NODE);
    assert_eq!(slice.spec.pool.resource_slice_count, 1);
    assert_eq!(slice.spec.pool.generation, 1);
    assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));

    let mut expected = kerf_api::resource_slices(&inventory, DRIVER, NODE)
        .unwrap()
        .remove(0);
    expected.pool.generation = 1;
    assert_eq!(
        slice.spec, expected,
        "the published spec is what kerf-api builds"
    );

    let owners = slice.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].name.as_str()),
        ("Node", NODE)
    );
    let node = s.fake.get(&format!("/api/v1/nodes/{NODE}")).unwrap();
    assert_eq!(owners[0].uid, node["metadata"]["uid"].as_str().unwrap());
    assert!(
        slice
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(CONTENT_HASH_ANNOTATION))
    );

    let requests = s.fake.requests();
    let applies: Vec<_> = requests
        .iter()
        .filter(|r| r.matches("patch", SLICES))
        .collect();
    assert_eq!(applies.len(), 1, "{}", describe_requests(&requests));
    assert_eq!(
        applies[0].content_type.as_deref(),
        Some("application/apply-patch+yaml")
    );
    assert!(
        applies[0]
            .query
            .contains("fieldManager=kerf-kubelet-plugin"),
        "{}",
        applies[0].query
    );
    assert!(
        applies[0].query.contains("force=true"),
        "{}",
        applies[0].query
    );
    assert!(
        requests.iter().any(|r| r.matches("list", SLICES)
            && r.query
                .contains("spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.kerf.dev")),
        "{}",
        describe_requests(&requests)
    );
    assert!(
        s.metrics_text()
            .contains(r#"kerf_plugin_resource_slice_publish_total{result="ok",reason=""} 1"#)
    );
}

#[tokio::test]
async fn republishing_the_same_inventory_keeps_the_generation_and_writes_nothing() {
    let s = setup();
    let publisher = s.publisher();
    publisher.publish(&h100()).await.unwrap();
    let before = s.slices();
    s.fake.clear_requests();

    publisher.publish(&h100()).await.unwrap();
    assert_eq!(s.slices(), before);
    assert_eq!(generations(&s.slices()), [1]);
    assert_eq!(
        s.fake.count("patch", SLICES),
        0,
        "{}",
        describe_requests(&s.fake.requests())
    );
    assert_eq!(s.fake.count("delete", SLICES), 0);

    // A new process (empty memory) sees the same published content and keeps it too.
    let restarted = s.publisher();
    restarted.publish(&h100()).await.unwrap();
    assert_eq!(s.slices(), before);
}

#[tokio::test]
async fn a_changed_inventory_bumps_the_generation_and_removes_stale_slices() {
    let s = setup();
    let publisher = s.publisher();

    publisher.publish(&huge_inventory(130)).await.unwrap();
    let slices = s.slices();
    assert_eq!(
        names(&slices),
        [
            kerf_api::slice_name(NODE, DRIVER, 0),
            kerf_api::slice_name(NODE, DRIVER, 1)
        ]
    );
    assert_eq!(generations(&slices), [1, 1]);
    assert!(slices.iter().all(|s| s.spec.pool.resource_slice_count == 2));
    assert_eq!(
        slices.iter().map(|s| device_names(s).len()).sum::<usize>(),
        130
    );

    publisher.publish(&h100()).await.unwrap();
    let slices = s.slices();
    assert_eq!(
        names(&slices),
        [kerf_api::slice_name(NODE, DRIVER, 0)],
        "the second slice is stale"
    );
    assert_eq!(generations(&slices), [2]);
    assert_eq!(slices[0].spec.pool.resource_slice_count, 1);
    assert_eq!(device_names(&slices[0]).len(), 8);

    // Same slice count, different devices: still a new generation.
    let mut four = h100();
    four.gpus.truncate(4);
    publisher.publish(&four).await.unwrap();
    let slices = s.slices();
    assert_eq!(generations(&slices), [3]);
    assert_eq!(
        device_names(&slices[0]),
        ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    );
}

#[tokio::test]
async fn a_new_process_continues_above_the_published_generation() {
    let s = setup();
    s.publisher().publish(&h100()).await.unwrap();
    s.publisher().publish(&huge_inventory(130)).await.unwrap();
    let mut four = h100();
    four.gpus.truncate(4);
    s.publisher().publish(&four).await.unwrap();
    assert_eq!(generations(&s.slices()), [3]);
}

#[tokio::test]
async fn publishing_without_access_to_the_node_omits_the_owner() {
    let s = setup();
    s.fake
        .fail_next("get", &format!("/api/v1/nodes/{NODE}"), 403, 1);
    let publisher = s.publisher();
    publisher.publish(&h100()).await.unwrap();
    assert_eq!(s.slices()[0].metadata.owner_references, None);

    // Once the node can be read, the owner is added without a new generation.
    publisher.publish(&h100()).await.unwrap();
    let slices = s.slices();
    assert_eq!(generations(&slices), [1]);
    assert_eq!(
        slices[0].metadata.owner_references.as_ref().map(Vec::len),
        Some(1)
    );
}

#[tokio::test]
async fn a_missing_node_is_not_an_error() {
    let s = setup();
    s.fake.remove(&format!("/api/v1/nodes/{NODE}"));
    s.publisher().publish(&h100()).await.unwrap();
    assert_eq!(s.slices()[0].metadata.owner_references, None);
}

#[tokio::test]
async fn publish_returns_api_errors_and_counts_them() {
    let s = setup();
    s.fake.fail_next("patch", SLICES, 500, 1);
    let err = s.publisher().publish(&h100()).await.unwrap_err();
    assert_eq!(err.reason(), "kube_api");
    assert!(s.slices().is_empty());
    assert!(
        s.metrics_text().contains(
            r#"kerf_plugin_resource_slice_publish_total{result="error",reason="kube_api"} 1"#
        ),
        "{}",
        s.metrics_text()
    );

    s.fake.fail_next("get", "/api/v1/nodes", 500, 1);
    assert!(
        s.publisher().publish(&h100()).await.is_err(),
        "a failing node read is not a 403/404"
    );
}

#[tokio::test]
async fn delete_all_removes_only_this_nodes_slices_of_this_driver() {
    let s = setup();
    s.publisher().publish(&huge_inventory(130)).await.unwrap();
    s.fake.insert(other_slice("other-node", "node-b", DRIVER));
    s.fake
        .insert(other_slice("other-driver", NODE, "net.example.com"));

    assert_eq!(s.publisher().delete_all().await.unwrap(), 2);
    assert!(s.slices().is_empty());
    assert_eq!(s.slices_of("node-b", DRIVER).len(), 1);
    assert_eq!(s.slices_of(NODE, "net.example.com").len(), 1);
    assert_eq!(s.publisher().delete_all().await.unwrap(), 0);
}

#[tokio::test]
async fn run_keeps_the_slices_published_and_deletes_them_at_shutdown() {
    let s = setup();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(s.publisher().run(
        Arc::new(h100()),
        Duration::from_secs(3600),
        shutdown.clone(),
    ));

    until("the slice is published", WAIT, || s.slices().len() == 1).await;
    let name = kerf_api::slice_name(NODE, DRIVER, 0);
    let path = format!("{SLICES}/{name}");

    // Deleted behind the publisher's back: published again, at a new generation.
    s.fake.remove(&path).unwrap();
    until("the deleted slice is back", WAIT, || {
        generations(&s.slices()) == [2]
    })
    .await;

    // The kubelet wipes every slice of the node when it starts.
    let api: Api<ResourceSlice> = Api::all(s.fake.client());
    api.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().fields(&format!("spec.nodeName={NODE}")),
    )
    .await
    .unwrap();
    until("the wiped slice is back", WAIT, || {
        generations(&s.slices()) == [3]
    })
    .await;

    // Someone else edits the slice: the publisher restores its content.
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "devices": [] } })),
    )
    .await
    .unwrap();
    until("the edited slice is restored", WAIT, || {
        s.slices()
            .first()
            .is_some_and(|slice| device_names(slice).len() == 8)
    })
    .await;
    let generation = generations(&s.slices())[0];
    assert!(
        generation > 3,
        "a restored slice is a new generation, got {generation}"
    );

    // A stray slice of this driver on this node is removed.
    s.fake.insert(other_slice("stray", NODE, DRIVER));
    until("the stray slice is gone", WAIT, || s.slices().len() == 1).await;

    // Slices the kubelet's wipe above would have taken along, had they existed then.
    s.fake.insert(other_slice("other-node", "node-b", DRIVER));
    s.fake
        .insert(other_slice("other-driver", NODE, "net.example.com"));
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        s.slices().is_empty(),
        "this node's slices are deleted at shutdown"
    );
    assert_eq!(
        s.slices_of("node-b", DRIVER).len(),
        1,
        "another node's slices stay"
    );
    assert_eq!(
        s.slices_of(NODE, "net.example.com").len(),
        1,
        "another driver's slices stay"
    );
}

#[tokio::test]
async fn run_retries_api_errors() {
    let s = setup();
    s.fake.fail_next("list", SLICES, 503, 2);
    s.fake.fail_next("patch", SLICES, 500, 2);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(s.publisher().run(
        Arc::new(h100()),
        Duration::from_secs(3600),
        shutdown.clone(),
    ));

    until("the slice is published despite errors", WAIT, || {
        s.slices().len() == 1
    })
    .await;
    assert_eq!(generations(&s.slices()), [1]);
    let text = s.metrics_text();
    assert!(
        text.contains(
            r#"kerf_plugin_resource_slice_publish_total{result="error",reason="kube_api"}"#
        ),
        "{text}"
    );

    // Deleting at shutdown is retried too.
    s.fake.fail_next("delete", SLICES, 500, 1);
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(s.slices().is_empty());
}

#[tokio::test]
async fn a_periodic_resync_repairs_what_the_watch_missed() {
    let s = setup();
    let shutdown = CancellationToken::new();
    // Watches fail for good, so only the resync can notice the lost slice.
    s.fake.fail_next("watch", SLICES, 500, usize::MAX);
    let task = tokio::spawn(s.publisher().run(
        Arc::new(h100()),
        Duration::from_millis(50),
        shutdown.clone(),
    ));
    until("the slice is published", WAIT, || s.slices().len() == 1).await;
    s.fake
        .remove(&format!(
            "{SLICES}/{}",
            kerf_api::slice_name(NODE, DRIVER, 0)
        ))
        .unwrap();
    until("the resync publishes it again", WAIT, || {
        s.slices().len() == 1
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// The allocator attribute, from the Node's ownership record (gpu.kerf.dev/allocators).

/// Sets (`Some`) or removes (`None`) the Node's ownership record, as kerf-controller does.
async fn set_record(s: &Setup, value: Option<&str>) {
    let nodes: Api<Node> = Api::all(s.fake.client());
    let patch = json!({ "metadata": { "annotations": { RECORD_ANNOTATION: value } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// The published owner of each device of this node, in device order.
fn owners(s: &Setup) -> Vec<(String, Option<Owner>)> {
    s.slices()
        .iter()
        .flat_map(|slice| slice.spec.devices.iter().flatten())
        .map(|d| (d.name.clone(), published_owner(d, DRIVER)))
        .collect()
}

fn owner_of(s: &Setup, device: &str) -> Option<Owner> {
    owners(s)
        .into_iter()
        .find(|(name, _)| name == device)
        .and_then(|(_, owner)| owner)
}

/// Starts [`Publisher::run`] and waits until its first publish is out.
async fn start_run(
    s: &Setup,
) -> (
    CancellationToken,
    JoinHandle<kerf_kubelet_plugin::Result<()>>,
) {
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(s.publisher().run(
        Arc::new(h100()),
        Duration::from_secs(3600),
        shutdown.clone(),
    ));
    until("the slice is published", WAIT, || s.slices().len() == 1).await;
    (shutdown, task)
}

async fn stop_run(shutdown: &CancellationToken, task: JoinHandle<kerf_kubelet_plugin::Result<()>>) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn the_nodes_record_is_published_as_the_allocator_attribute() {
    let s = setup();
    set_record(&s, Some(r#"{"gpu-0":"controller","gpu-1":"scheduler"}"#)).await;

    // The first publish reads the record with the Node it fetches for the owner reference.
    s.publisher().publish(&h100()).await.unwrap();
    assert_eq!(owner_of(&s, "gpu-0"), Some(Owner::Controller));
    assert_eq!(owner_of(&s, "gpu-1"), Some(Owner::Scheduler));
    assert_eq!(generations(&s.slices()), [1]);
    let slices = s.slices();
    let device = &slices[0].spec.devices.as_ref().unwrap()[0];
    assert_eq!(
        device.attributes.as_ref().unwrap()["allocator"]
            .string
            .as_deref(),
        Some("controller"),
        "an unqualified attribute in the driver's domain"
    );

    // The same record again: nothing to write.
    s.publisher().publish(&h100()).await.unwrap();
    assert_eq!(generations(&s.slices()), [1]);
}

#[tokio::test]
async fn a_device_the_record_does_not_name_has_no_allocator_attribute() {
    let s = setup();
    set_record(&s, Some(r#"{"gpu-0":"controller","gpu-9":"scheduler"}"#)).await;
    s.publisher().publish(&h100()).await.unwrap();
    let published = owners(&s);
    assert_eq!(published.len(), 8);
    assert_eq!(published[0], ("gpu-0".to_owned(), Some(Owner::Controller)));
    assert!(
        published[1..].iter().all(|(_, owner)| owner.is_none()),
        "{published:?}"
    );
    for device in s.slices()[0].spec.devices.iter().flatten().skip(1) {
        assert!(
            !device
                .attributes
                .as_ref()
                .unwrap()
                .contains_key("allocator"),
            "{}",
            device.name
        );
    }

    // Without any record, no device has the attribute.
    let bare = setup();
    bare.publisher().publish(&h100()).await.unwrap();
    assert!(owners_all_none(&bare), "{:?}", owners(&bare));
}

fn owners_all_none(s: &Setup) -> bool {
    owners(s).iter().all(|(_, owner)| owner.is_none())
}

#[tokio::test]
async fn a_changed_record_is_published_again_promptly() {
    let s = setup();
    set_record(&s, Some(r#"{"gpu-0":"controller","gpu-1":"controller"}"#)).await;
    let (shutdown, task) = start_run(&s).await;
    assert_eq!(owner_of(&s, "gpu-0"), Some(Owner::Controller));
    assert_eq!(generations(&s.slices()), [1]);

    // The plugin watches its own Node only.
    let requests = s.fake.requests();
    assert!(
        requests.iter().any(|r| r.matches("watch", "/api/v1/nodes")
            && r.query.contains("fieldSelector=metadata.name%3Dnode-a")),
        "{}",
        describe_requests(&requests)
    );

    let changed_at = tokio::time::Instant::now();
    set_record(&s, Some(r#"{"gpu-0":"scheduler"}"#)).await;
    until("the changed record is published", WAIT, || {
        owner_of(&s, "gpu-0") == Some(Owner::Scheduler)
    })
    .await;
    let took = changed_at.elapsed();
    assert!(took < Duration::from_millis(500), "took {took:?}");
    assert_eq!(generations(&s.slices()), [2], "a new pool generation");
    assert_eq!(owner_of(&s, "gpu-1"), None, "gpu-1 left the record");

    // Other changes of the Node publish nothing; the record's removal does.
    let nodes: Api<Node> = Api::all(s.fake.client());
    let labels = json!({ "metadata": { "labels": { "example.com/rack": "r1" } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(labels))
        .await
        .unwrap();
    set_record(&s, None).await;
    until("the removed record is published", WAIT, || {
        owners_all_none(&s)
    })
    .await;
    assert_eq!(generations(&s.slices()), [3]);

    stop_run(&shutdown, task).await;
}

#[tokio::test]
async fn a_malformed_record_keeps_the_last_good_one() {
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::WARN);
    let s = setup();
    set_record(&s, Some(r#"{"gpu-0":"controller"}"#)).await;
    let (shutdown, task) = start_run(&s).await;
    assert_eq!(owner_of(&s, "gpu-0"), Some(Owner::Controller));

    let warnings = || logs.lines_containing("malformed ownership record");
    set_record(&s, Some(r#"{"gpu-0":"kubelet"}"#)).await;
    until("the bad record is warned about", WAIT, || {
        warnings().len() == 1
    })
    .await;
    let warning = warnings().remove(0);
    assert!(
        warning.contains(RECORD_ANNOTATION) && warning.contains("unknown variant"),
        "{warning}"
    );

    // The same bad value again (any other change of the Node) is not warned about again; a
    // different bad value is. Watch events arrive in order, so once the second warning is
    // out, the label change before it was seen too.
    let nodes: Api<Node> = Api::all(s.fake.client());
    let labels = json!({ "metadata": { "labels": { "example.com/rack": "r1" } } });
    nodes
        .patch(NODE, &PatchParams::default(), &Patch::Merge(labels))
        .await
        .unwrap();
    set_record(&s, Some("not json")).await;
    until("the second bad value is warned about", WAIT, || {
        warnings().len() >= 2
    })
    .await;
    assert_eq!(warnings().len(), 2, "{:?}", warnings());

    // Well past the debounce: still the last good record, at the same generation.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(owner_of(&s, "gpu-0"), Some(Owner::Controller));
    assert_eq!(generations(&s.slices()), [1]);

    // A good record again is published (one new generation: nothing was published between).
    set_record(&s, Some(r#"{"gpu-0":"scheduler"}"#)).await;
    until("the good record is published", WAIT, || {
        owner_of(&s, "gpu-0") == Some(Owner::Scheduler)
    })
    .await;
    assert_eq!(generations(&s.slices()), [2]);

    stop_run(&shutdown, task).await;
}

#[tokio::test]
async fn the_node_watch_recovers_from_errors() {
    let s = setup();
    // The first list of the Node watch fails; the watch retries it.
    s.fake.fail_next("list", "/api/v1/nodes", 500, 1);
    let (shutdown, task) = start_run(&s).await;

    set_record(&s, Some(r#"{"gpu-3":"controller"}"#)).await;
    until("the record is published", WAIT, || {
        owner_of(&s, "gpu-3") == Some(Owner::Controller)
    })
    .await;

    // The API server ends every watch: the watch resumes and sees the next change.
    s.fake.close_watches();
    set_record(&s, Some(r#"{"gpu-3":"scheduler"}"#)).await;
    until(
        "the record is published after the watch ended",
        WAIT,
        || owner_of(&s, "gpu-3") == Some(Owner::Scheduler),
    )
    .await;

    stop_run(&shutdown, task).await;
}
