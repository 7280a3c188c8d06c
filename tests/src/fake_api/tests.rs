//! Unit tests of the fake API server.

use std::time::Duration;

use futures::StreamExt as _;

use super::patch::remove_dropped_fields;
use super::routing::{ParsedPath, Query, plural_of};
use super::selectors::{label_term_matches, parse_label_selector};
use super::store::uid_from;
use super::*;

#[test]
fn plurals_follow_the_api_server() {
    assert_eq!(plural_of("ResourceSlice"), "resourceslices");
    assert_eq!(plural_of("DeviceClass"), "deviceclasses");
    assert_eq!(plural_of("GpuClass"), "gpuclasses");
    assert_eq!(plural_of("NetworkPolicy"), "networkpolicies");
    assert_eq!(plural_of("Gateway"), "gateways");
    assert_eq!(plural_of("Endpoints"), "endpoints");
    assert_eq!(plural_of("Node"), "nodes");
}

#[test]
fn paths_parse() {
    let p = ParsedPath::parse("/api/v1/namespaces/ns/pods/p/status").unwrap();
    assert_eq!(
        (
            p.prefix.as_str(),
            p.namespace.as_deref(),
            p.resource.as_str(),
            p.name.as_deref(),
            p.status
        ),
        ("api/v1", Some("ns"), "pods", Some("p"), true)
    );
    let p = ParsedPath::parse("/api/v1/namespaces/ns").unwrap();
    assert_eq!(
        (
            p.namespace.as_deref(),
            p.resource.as_str(),
            p.name.as_deref()
        ),
        (None, "namespaces", Some("ns"))
    );
    let p = ParsedPath::parse("/apis/resource.k8s.io/v1/resourceslices").unwrap();
    assert_eq!(
        (p.prefix.as_str(), p.resource.as_str(), p.name),
        ("apis/resource.k8s.io/v1", "resourceslices", None)
    );
    assert!(ParsedPath::parse("/version").is_err());
}

#[test]
fn queries_decode() {
    let q =
        Query::parse("&fieldSelector=spec.nodeName%3Dn1%2Cspec.driver%3Dgpu.kerf.dev&watch=true");
    assert_eq!(
        q.get("fieldSelector"),
        Some("spec.nodeName=n1,spec.driver=gpu.kerf.dev")
    );
    assert!(q.flag("watch"));
}

#[test]
fn label_selectors_match() {
    let obj = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
    let sel = |s: &str| {
        parse_label_selector(s)
            .unwrap()
            .iter()
            .all(|t| label_term_matches(t, &obj))
    };
    assert!(sel("app=web"));
    assert!(sel("app==web,tier!=back"));
    assert!(sel("app in (web, db),!missing"));
    assert!(!sel("app notin (web)"));
    assert!(sel("tier"));
    assert!(!sel("app=db"));
}

#[test]
fn uids_are_uuid_shaped_and_distinct() {
    let a = uid_from(1);
    let b = uid_from(2);
    assert_ne!(a, b);
    assert_eq!(a.len(), 36);
    assert_eq!(a.chars().nth(14), Some('4'));
}

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;

fn config_map(name: &str, data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ),
        ..Default::default()
    }
}

fn api_error(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(status) => (status.code, status.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn create_get_replace_delete() {
    let fake = FakeApi::new();
    let api: Api<ConfigMap> = Api::namespaced(fake.client(), "ns");
    let created = api
        .create(&PostParams::default(), &config_map("a", &[("k", "v")]))
        .await
        .unwrap();
    assert_eq!(created.metadata.namespace.as_deref(), Some("ns"));
    assert!(created.metadata.uid.is_some());
    assert!(created.metadata.creation_timestamp.is_some());
    let err = api
        .create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (409, "AlreadyExists".to_owned()));

    let mut changed = created.clone();
    changed.data = Some([("k".to_owned(), "w".to_owned())].into());
    let replaced = api
        .replace("a", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_ne!(
        replaced.metadata.resource_version,
        created.metadata.resource_version
    );
    assert_eq!(replaced.metadata.uid, created.metadata.uid);
    let err = api
        .replace("a", &PostParams::default(), &changed)
        .await
        .unwrap_err();
    assert_eq!(api_error(err), (409, "Conflict".to_owned()));

    assert_eq!(api.get("a").await.unwrap().data.unwrap()["k"], "w");
    assert!(fake.get("/api/v1/namespaces/ns/configmaps/a").is_some());
    api.delete("a", &DeleteParams::default()).await.unwrap();
    assert_eq!(api_error(api.get("a").await.unwrap_err()).0, 404);
    assert_eq!(
        api_error(api.delete("a", &DeleteParams::default()).await.unwrap_err()).0,
        404
    );
    assert_eq!(fake.count("get", "/api/v1/namespaces/ns/configmaps/a"), 2);
    assert_eq!(fake.count("DELETE", "/api/v1/namespaces/ns/configmaps"), 2);
}

#[tokio::test]
async fn dry_run_creates_store_nothing_and_dropped_fields_vanish_like_a_gate_that_is_off() {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let fake = FakeApi::new();
    let api: Api<ResourceSlice> = Api::all(fake.client());
    let probe = kerf_api::features::device_taints_probe("gpu.kerf.dev", "n1");
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let answer = api.create(&dry, &probe).await.unwrap();
    assert!(answer.metadata.name.is_some());
    assert_eq!(
        kerf_api::features::kept_device_taints(&answer),
        kerf_api::features::Probed::Served
    );
    assert!(
        fake.list("/apis/resource.k8s.io/v1/resourceslices")
            .is_empty()
    );

    fake.drop_field("resourceslices", "spec.devices[].taints");
    let answer = api.create(&dry, &probe).await.unwrap();
    assert_eq!(
        kerf_api::features::kept_device_taints(&answer),
        kerf_api::features::Probed::Dropped
    );
    let stored = api.create(&PostParams::default(), &probe).await.unwrap();
    let devices = stored.spec.devices.unwrap();
    assert_eq!(devices[0].name, "probe");
    assert!(devices[0].taints.is_none());
}

#[tokio::test]
async fn selectors_filter_lists() {
    let fake = FakeApi::new();
    for (name, node, driver) in [("a", "n1", "d1"), ("b", "n1", "d2"), ("c", "n2", "d1")] {
        fake.insert(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name, "labels": {"node": node}},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
        }));
    }
    let api: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(fake.client());
    let names = |list: kube::api::ObjectList<k8s_openapi::api::resource::v1::ResourceSlice>| {
        list.items
            .into_iter()
            .map(|s| s.metadata.name.unwrap())
            .collect::<Vec<_>>()
    };
    let selected = api
        .list(&ListParams::default().fields("spec.nodeName=n1,spec.driver=d1"))
        .await
        .unwrap();
    assert_eq!(names(selected), ["a"]);
    let selected = api
        .list(&ListParams::default().fields("spec.driver!=d1"))
        .await
        .unwrap();
    assert_eq!(names(selected), ["b"]);
    let selected = api
        .list(&ListParams::default().labels("node=n2"))
        .await
        .unwrap();
    assert_eq!(names(selected), ["c"]);
    assert_eq!(
        fake.list("/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn1")
            .len(),
        2
    );
    let deleted = api
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().fields("spec.nodeName=n1"),
        )
        .await
        .unwrap();
    assert!(deleted.is_left());
    assert_eq!(
        fake.list("/apis/resource.k8s.io/v1/resourceslices").len(),
        1
    );
}

#[tokio::test]
async fn apply_creates_merges_and_drops_what_the_manager_no_longer_sets() {
    let fake = FakeApi::new();
    let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
    let params = PatchParams::apply("test").force();
    let first = api
        .patch(
            "a",
            &params,
            &Patch::Apply(config_map("a", &[("x", "1"), ("y", "2")])),
        )
        .await
        .unwrap();
    let other = PatchParams::apply("other").force();
    api.patch("a", &other, &Patch::Apply(config_map("a", &[("z", "3")])))
        .await
        .unwrap();
    let second = api
        .patch("a", &params, &Patch::Apply(config_map("a", &[("x", "9")])))
        .await
        .unwrap();
    let data = second.data.unwrap();
    assert_eq!(data.get("x").map(String::as_str), Some("9"));
    assert_eq!(data.get("y"), None, "dropped by its manager");
    assert_eq!(
        data.get("z").map(String::as_str),
        Some("3"),
        "owned by another manager"
    );
    assert_eq!(second.metadata.uid, first.metadata.uid);
    let unchanged = api
        .patch("a", &params, &Patch::Apply(config_map("a", &[("x", "9")])))
        .await
        .unwrap();
    assert_eq!(
        unchanged.metadata.resource_version,
        second.metadata.resource_version
    );

    let merged = api
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"x": null}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.data.unwrap().get("x"), None);
    let ops: json_patch::Patch =
        serde_json::from_value(json!([{"op": "add", "path": "/data/j", "value": "p"}])).unwrap();
    let patched = api
        .patch("a", &PatchParams::default(), &Patch::Json::<()>(ops))
        .await
        .unwrap();
    assert_eq!(
        patched.data.unwrap().get("j").map(String::as_str),
        Some("p")
    );
    let err = api
        .patch("missing", &PatchParams::default(), &Patch::Merge(json!({})))
        .await
        .unwrap_err();
    assert_eq!(api_error(err).0, 404);
}

#[tokio::test]
async fn status_is_a_subresource_for_pods() {
    let fake = FakeApi::new();
    let api: Api<Pod> = Api::namespaced(fake.client(), "default");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": "Running"},
    }))
    .unwrap();
    let created = api.create(&PostParams::default(), &pod).await.unwrap();
    assert!(created.status.is_none(), "status is not set on create");
    let with_status = api
        .patch_status(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}, "spec": {"nodeName": "x"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        with_status.status.unwrap().phase.as_deref(),
        Some("Running")
    );
    assert_eq!(
        with_status.spec.unwrap().node_name,
        None,
        "a status write changes only status"
    );
    let replaced = api
        .patch(
            "p",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}, "spec": {"nodeName": "n"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        replaced.status.unwrap().phase.as_deref(),
        Some("Running"),
        "a main write keeps status"
    );
    assert_eq!(replaced.metadata.generation, Some(2));
}

#[tokio::test]
async fn finalizers_delay_deletion() {
    let fake = FakeApi::new();
    let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
    let mut cm = config_map("f", &[]);
    cm.metadata.finalizers = Some(vec!["example.com/keep".to_owned()]);
    api.create(&PostParams::default(), &cm).await.unwrap();
    api.delete("f", &DeleteParams::default()).await.unwrap();
    let marked = api.get("f").await.unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    api.patch(
        "f",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_error(api.get("f").await.unwrap_err()).0, 404);
}

#[tokio::test]
async fn scripted_faults_fail_the_next_matching_requests() {
    let fake = FakeApi::new();
    let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
    api.create(&PostParams::default(), &config_map("a", &[]))
        .await
        .unwrap();
    fake.fail_next("get", "/api/v1/namespaces/default/configmaps/a", 503, 2);
    assert_eq!(
        api_error(api.get("a").await.unwrap_err()),
        (503, "ServiceUnavailable".to_owned())
    );
    assert_eq!(api_error(api.get("a").await.unwrap_err()).0, 503);
    assert!(api.get("a").await.is_ok());
    assert_eq!(
        fake.count("get", "/api/v1/namespaces/default/configmaps/a"),
        3
    );
}

/// The next event, skipping the errors the watcher reports before it recovers.
async fn next_event(
    stream: &mut (
             impl futures::Stream<Item = Result<watcher::Event<ConfigMap>, watcher::Error>> + Unpin
         ),
) -> watcher::Event<ConfigMap> {
    loop {
        let next = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .unwrap();
        match next.unwrap() {
            Ok(event) => return event,
            Err(watcher::Error::WatchError(status)) => assert_eq!(status.code, 410),
            Err(other) => panic!("unexpected watch error {other:?}"),
        }
    }
}

fn event_name(event: &watcher::Event<ConfigMap>) -> String {
    match event {
        watcher::Event::Apply(o) => {
            format!("apply {}", o.metadata.name.as_deref().unwrap_or(""))
        }
        watcher::Event::Delete(o) => {
            format!("delete {}", o.metadata.name.as_deref().unwrap_or(""))
        }
        watcher::Event::Init => "init".to_owned(),
        watcher::Event::InitApply(o) => {
            format!("init-apply {}", o.metadata.name.as_deref().unwrap_or(""))
        }
        watcher::Event::InitDone => "init-done".to_owned(),
    }
}

async fn watcher_sees_changes(config: watcher::Config) {
    let fake = FakeApi::new();
    let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
    api.create(&PostParams::default(), &config_map("before", &[]))
        .await
        .unwrap();
    let mut events = Box::pin(watcher(api.clone(), config.labels("!skip")));
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(event_name(&next_event(&mut events).await));
    }
    assert_eq!(seen, ["init", "init-apply before", "init-done"]);
    api.create(&PostParams::default(), &config_map("after", &[]))
        .await
        .unwrap();
    assert_eq!(event_name(&next_event(&mut events).await), "apply after");
    let mut skipped = config_map("skipped", &[]);
    skipped.metadata.labels = Some([("skip".to_owned(), "yes".to_owned())].into());
    api.create(&PostParams::default(), &skipped).await.unwrap();
    api.delete("before", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(event_name(&next_event(&mut events).await), "delete before");

    // A restarted watch resumes where it was; after compaction it lists again.
    fake.close_watches();
    api.create(&PostParams::default(), &config_map("resumed", &[]))
        .await
        .unwrap();
    assert_eq!(event_name(&next_event(&mut events).await), "apply resumed");
    fake.close_watches();
    api.create(&PostParams::default(), &config_map("late", &[]))
        .await
        .unwrap();
    fake.compact();
    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("init-done") {
        seen.push(event_name(&next_event(&mut events).await));
    }
    assert_eq!(
        seen,
        [
            "init",
            "init-apply after",
            "init-apply late",
            "init-apply resumed",
            "init-done"
        ]
    );
}

#[tokio::test]
async fn list_then_watch() {
    watcher_sees_changes(watcher::Config::default()).await;
}

#[tokio::test]
async fn streaming_list_watch() {
    watcher_sees_changes(watcher::Config::default().streaming_lists()).await;
}

#[test]
fn apply_removes_fields_the_manager_dropped() {
    let mut live = json!({"spec": {"a": 1, "b": 2, "c": 3}});
    let previous = json!({"spec": {"a": 1, "b": 2}});
    let next = json!({"spec": {"a": 5}});
    remove_dropped_fields(&mut live, &previous, &next);
    json_patch::merge(&mut live, &next);
    assert_eq!(live, json!({"spec": {"a": 5, "c": 3}}));
}
