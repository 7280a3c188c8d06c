//! Unit tests of the ResourceClaim rules (`claims`), the update rules every object has
//! (`meta_rules`) and the JSON text helpers (`raw_json`), over raw HTTP so the request
//! bodies are exactly the bytes a client sends.

use http::Request;
use http_body_util::BodyExt as _;
use serde_json::{Value, json};
use tower::ServiceExt as _;

use super::FakeApi;
use super::raw_json::{go_compact, go_encode, raw_at};

const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";

/// Sends `body` as is and returns the status code, the body's text and its JSON.
pub(super) async fn send(
    fake: &FakeApi,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, String, Value) {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", content_type)
        .body(kube::client::Body::from(body.as_bytes().to_vec()))
        .unwrap();
    let response = fake.clone().oneshot(request).await.unwrap();
    let code = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::Null);
    (code, text, value)
}

/// A claim as Python's `json.dumps` writes it when `spaced` (`", "` and `": "`), else as
/// `kubectl` sends it: compact, keys as written (here not sorted).
fn claim_body(name: &str, spaced: bool) -> String {
    let params = if spaced {
        r#"{"kind": "GpuConfig", "apiVersion": "gpu.kerf.dev/v1", "sharing": {"strategy": "TimeSlicing"}}"#
    } else {
        r#"{"kind":"GpuConfig","apiVersion":"gpu.kerf.dev/v1","sharing":{"strategy":"TimeSlicing"}}"#
    };
    format!(
        r#"{{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{{"name":"{name}","namespace":"default"}},"spec":{{"devices":{{"requests":[{{"name":"gpu","exactly":{{"deviceClassName":"gpu.kerf.dev"}}}}],"config":[{{"requests":["gpu"],"opaque":{{"driver":"gpu.kerf.dev","parameters":{params}}}}}]}}}}}}"#
    )
}

const MERGE: &str = "application/merge-patch+json";
const STRATEGIC: &str = "application/strategic-merge-patch+json";
const JSON_PATCH: &str = "application/json-patch+json";

async fn create_claim(fake: &FakeApi, name: &str, spaced: bool) {
    let (code, text, _) = send(
        fake,
        "POST",
        CLAIMS,
        "application/json",
        &claim_body(name, spaced),
    )
    .await;
    assert_eq!(code, 201, "{text}");
}

fn assert_immutable(code: u16, status: &Value, kind: &str, name: &str) {
    assert_eq!(code, 422, "{status}");
    assert_eq!(status["reason"], "Invalid");
    let message = status["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "{kind}.resource.k8s.io {name:?} is invalid: spec: Invalid value: "
        )) && message.ends_with(": field is immutable"),
        "{message}"
    );
    assert_eq!(status["details"]["causes"][0]["field"], "spec");
    assert_eq!(
        status["details"]["causes"][0]["reason"],
        "FieldValueInvalid"
    );
    assert_eq!(status["details"]["kind"], kind);
}

#[tokio::test]
async fn spaced_parameters_make_every_main_resource_patch_invalid() {
    let fake = FakeApi::new();
    create_claim(&fake, "spaced", true).await;
    let path = format!("{CLAIMS}/spaced");

    // (a) Only metadata: the parameters come back compacted, which is a change.
    let labels = r#"{"metadata":{"labels":{"kerf.dev/owned":"true"}}}"#;
    let (code, _, status) = send(&fake, "PATCH", &path, MERGE, labels).await;
    assert_immutable(code, &status, "ResourceClaim", "spaced");
    assert!(
        status["message"]
            .as_str()
            .unwrap()
            .contains(r#""parameters":{"kind":"GpuConfig","apiVersion""#),
        "the error shows the new value, compacted: {status}"
    );

    // (b) A JSON patch adding a finalizer, as a controller would.
    let finalizer =
        r#"[{"op":"add","path":"/metadata/finalizers","value":["gpu.kerf.dev/claim"]}]"#;
    let (code, _, status) = send(&fake, "PATCH", &path, JSON_PATCH, finalizer).await;
    assert_immutable(code, &status, "ResourceClaim", "spaced");

    // (c) The status subresource keeps the old spec and its bytes.
    let status_patch = r#"{"status":{"devices":[]}}"#;
    let (code, text, _) = send(
        &fake,
        "PATCH",
        &format!("{path}/status"),
        MERGE,
        status_patch,
    )
    .await;
    assert_eq!(code, 200, "{text}");
    let (_, text, stored) = send(&fake, "GET", &path, "application/json", "").await;
    assert!(
        text.contains(r#""parameters":{"kind":"GpuConfig","apiVersion":"gpu.kerf.dev/v1","sharing":{"strategy":"TimeSlicing"}}"#),
        "reads answer the stored text compacted, key order kept: {text}"
    );
    assert_eq!(stored["status"]["devices"], json!([]));
    let (code, _, _) = send(&fake, "PATCH", &path, MERGE, labels).await;
    assert_eq!(code, 422, "the stored bytes are still the spaced ones");
    assert_eq!(fake.get(&path).unwrap()["metadata"].get("labels"), None);
}

#[tokio::test]
async fn compact_parameters_survive_merge_and_json_patches_but_not_strategic_ones() {
    let fake = FakeApi::new();
    create_claim(&fake, "compact", false).await;
    let path = format!("{CLAIMS}/compact");
    let labels = r#"{"metadata":{"labels":{"kerf.dev/owned":"true"}}}"#;
    let (code, text, _) = send(&fake, "PATCH", &path, MERGE, labels).await;
    assert_eq!(code, 200, "{text}");
    let finalizer =
        r#"[{"op":"add","path":"/metadata/finalizers","value":["gpu.kerf.dev/claim"]}]"#;
    let (code, text, _) = send(&fake, "PATCH", &path, JSON_PATCH, finalizer).await;
    assert_eq!(code, 200, "{text}");
    // A strategic merge patch decodes the parameters into a map: keys come back sorted.
    let (code, _, status) = send(&fake, "PATCH", &path, STRATEGIC, labels).await;
    assert_immutable(code, &status, "ResourceClaim", "compact");
    // A PUT of the same text is no change.
    let mut body: Value = serde_json::from_str(&claim_body("compact", false)).unwrap();
    body["metadata"] = fake.get(&path).unwrap()["metadata"].clone();
    let put = claim_body("compact", false).replace(
        r#""metadata":{"name":"compact","namespace":"default"}"#,
        &format!(r#""metadata":{}"#, body["metadata"]),
    );
    let (code, text, _) = send(&fake, "PUT", &path, "application/json", &put).await;
    assert_eq!(code, 200, "{text}");
}

#[tokio::test]
async fn a_spec_change_is_always_invalid_and_a_template_spec_too() {
    let fake = FakeApi::new();
    create_claim(&fake, "c", false).await;
    let path = format!("{CLAIMS}/c");
    let rename = r#"{"spec":{"devices":{"requests":[{"name":"other","exactly":{"deviceClassName":"gpu.kerf.dev"}}]}}}"#;
    let (code, _, status) = send(&fake, "PATCH", &path, MERGE, rename).await;
    assert_immutable(code, &status, "ResourceClaim", "c");

    let templates = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates";
    let template = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t"},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.kerf.dev"}}]}}},
    });
    let (code, text, _) = send(
        &fake,
        "POST",
        templates,
        "application/json",
        &template.to_string(),
    )
    .await;
    assert_eq!(code, 201, "{text}");
    let mut changed = template.clone();
    changed["spec"]["spec"]["devices"]["requests"][0]["name"] = json!("other");
    let (code, _, status) = send(
        &fake,
        "PUT",
        &format!("{templates}/t"),
        "application/json",
        &changed.to_string(),
    )
    .await;
    assert_immutable(code, &status, "ResourceClaimTemplate", "t");
    let labels = r#"{"metadata":{"labels":{"a":"b"}}}"#;
    let (code, text, _) = send(&fake, "PATCH", &format!("{templates}/t"), MERGE, labels).await;
    assert_eq!(code, 200, "metadata of a template may change: {text}");
}

#[tokio::test]
async fn watches_and_lists_see_the_stored_text() {
    let fake = FakeApi::new();
    create_claim(&fake, "w", true).await;
    let (_, text, _) = send(&fake, "GET", CLAIMS, "application/json", "").await;
    assert!(
        text.contains(r#""parameters":{"kind":"GpuConfig","apiVersion""#),
        "{text}"
    );
    let (_, text, _) = send(
        &fake,
        "GET",
        &format!("{CLAIMS}?watch=true&timeoutSeconds=0"),
        "",
        "",
    )
    .await;
    assert!(
        text.contains(r#""parameters":{"kind":"GpuConfig","apiVersion""#),
        "{text}"
    );
}

#[tokio::test]
async fn no_finalizer_may_be_added_once_deleting() {
    let fake = FakeApi::new();
    let path = "/api/v1/namespaces/default/configmaps/cm";
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "cm", "finalizers": ["a"]}});
    let (code, _, _) = send(
        &fake,
        "POST",
        "/api/v1/namespaces/default/configmaps",
        "application/json",
        &cm.to_string(),
    )
    .await;
    assert_eq!(code, 201);
    let (code, _, _) = send(&fake, "DELETE", path, "application/json", "").await;
    assert_eq!(code, 200);
    let add = r#"{"metadata":{"finalizers":["a","b"]}}"#;
    let (code, _, status) = send(&fake, "PATCH", path, MERGE, add).await;
    assert_eq!(code, 422, "{status}");
    assert_eq!(
        status["message"],
        r#"ConfigMap "cm" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{"b"}"#
    );
    let (code, _, _) = send(
        &fake,
        "PATCH",
        path,
        MERGE,
        r#"{"metadata":{"finalizers":[]}}"#,
    )
    .await;
    assert_eq!(code, 200, "removing finalizers is fine");
    assert!(
        fake.get(path).is_none(),
        "and the last one lets the object go"
    );
}

#[tokio::test]
async fn preconditions_and_names_fail_as_upstream_words_it() {
    let fake = FakeApi::new();
    let collection = "/api/v1/namespaces/default/configmaps";
    let unnamed = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}});
    let (code, _, status) = send(
        &fake,
        "POST",
        collection,
        "application/json",
        &unnamed.to_string(),
    )
    .await;
    assert_eq!(code, 422);
    assert_eq!(
        status["message"],
        r#"ConfigMap "" is invalid: metadata.name: Required value: name or generateName is required"#
    );
    let generated =
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "cm-"}});
    let (code, _, created) = send(
        &fake,
        "POST",
        collection,
        "application/json",
        &generated.to_string(),
    )
    .await;
    assert_eq!(code, 201);
    let name = created["metadata"]["name"].as_str().unwrap();
    let suffix = name.strip_prefix("cm-").unwrap();
    assert_eq!(suffix.len(), 5);
    assert!(
        suffix
            .chars()
            .all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c)),
        "{name}"
    );
    let delete = json!({"preconditions": {"uid": "other"}});
    let (code, _, status) = send(
        &fake,
        "DELETE",
        &format!("{collection}/{name}"),
        "application/json",
        &delete.to_string(),
    )
    .await;
    assert_eq!(code, 409);
    let message = status["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("Operation cannot be fulfilled on configmaps {name:?}: StorageError: invalid object, Code: 4, Key: /registry/configmaps/default/{name}"))
            && message.ends_with(&format!("Precondition failed: UID in precondition: other, UID in object meta: {}", created["metadata"]["uid"].as_str().unwrap())),
        "{message}"
    );
}

#[test]
fn raw_texts_are_found_and_compacted_as_go_does() {
    let doc = r#"{ "a" : [1, {"b": "x<y" , "c":{ "d" : 2.50 }}], "e": null }"#;
    assert_eq!(raw_at(doc, "/a/1/c"), Some(r#"{ "d" : 2.50 }"#));
    assert_eq!(raw_at(doc, "/a/0"), Some("1"));
    assert_eq!(raw_at(doc, "/e"), Some("null"));
    assert_eq!(raw_at(doc, "/a/2"), None);
    assert_eq!(raw_at(doc, "/f"), None);
    assert_eq!(
        go_compact(doc),
        r#"{"a":[1,{"b":"x\u003cy","c":{"d":2.50}}],"e":null}"#
    );
    assert_eq!(go_compact(r#"{"s": "a b\" c"}"#), r#"{"s":"a b\" c"}"#);
    let value = json!({"z": 1.0, "a": [1e-7, 1.5e21, 0.25], "m": "&"});
    assert_eq!(
        go_encode(&value),
        r#"{"a":[1e-07,1.5e+21,0.25],"m":"\u0026","z":1}"#
    );
}

/// A `/status` write that takes devices out of the allocation drops their `status.devices`
/// entries and keeps those of devices still allocated (`dropDeallocatedStatusDevices`).
#[tokio::test]
async fn a_status_write_drops_the_entries_of_deallocated_devices() {
    let fake = FakeApi::new();
    create_claim(&fake, "c", false).await;
    let result = |device: &str| json!({"request": "gpu", "driver": "gpu.kerf.dev", "pool": "node-1", "device": device});
    let entry =
        |driver: &str, device: &str| json!({"driver": driver, "pool": "node-1", "device": device});
    let status = json!({"status": {
        "allocation": {"devices": {"results": [result("gpu-0"), result("gpu-1")]}},
        "devices": [entry("gpu.kerf.dev", "gpu-0"), entry("gpu.kerf.dev", "gpu-1")],
    }});
    let path = format!("{CLAIMS}/c/status");
    let (code, text, _) = send(&fake, "PATCH", &path, MERGE, &status.to_string()).await;
    assert_eq!(code, 200, "{text}");

    let one_left = json!({"status": {"allocation": {"devices": {"results": [result("gpu-1")]}}}});
    let (code, text, stored) = send(&fake, "PATCH", &path, MERGE, &one_left.to_string()).await;
    assert_eq!(code, 200, "{text}");
    assert_eq!(
        stored["status"]["devices"],
        json!([entry("gpu.kerf.dev", "gpu-1")])
    );

    let none = json!({"status": {"allocation": null}});
    let (code, text, stored) = send(&fake, "PATCH", &path, MERGE, &none.to_string()).await;
    assert_eq!(code, 200, "{text}");
    assert_eq!(stored["status"].get("devices"), None, "{stored}");

    // The main resource keeps the status as it is (its strategy keeps the old status).
    assert_eq!(
        fake.get(&format!("{CLAIMS}/c")).unwrap()["status"].get("devices"),
        None
    );
}
