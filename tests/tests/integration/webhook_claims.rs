//! The claim webhook over real HTTPS: AdmissionReviews for ResourceClaims and
//! ResourceClaimTemplates, as kube-apiserver sends them, and the answers checked as it checks
//! them.
//!
//! Upstream, read in kubernetes/kubernetes:
//! - `callAttrMutatingHook` in
//!   `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/mutating/dispatcher.go`: a
//!   denial (`allowed: false`) becomes `ToStatusErr(webhook, response.status)`
//!   (`staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/errors/statuserror.go`), which
//!   keeps the status' code, reason and details and puts
//!   `admission webhook "<name>" denied the request: ` before its message; a non-empty
//!   JSONPatch is applied with `gopkg.in/evanphx/json-patch.v4`, whose `replace` keeps the
//!   value's bytes as the patch holds them (hence the exact text checked below);
//! - with `matchPolicy: Equivalent`, a request made through `resource.k8s.io/v1beta1` reaches a
//!   webhook registered for v1 with `kind`/`resource` v1 and the object converted to v1, and
//!   `requestKind`/`requestResource` naming v1beta1 (`admission/v1` `AdmissionRequest` docs in
//!   `staging/src/k8s.io/api/admission/v1/types.go`).
//!
//! The review bodies are written as text, the claim's part as Python's `json.dumps` writes it
//! (`", "` and `": "` separators), the way the official Python client sends claims.

use crate::common::webhook_server;

use std::sync::atomic::Ordering;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use kerf_tests::fake_api::FakeApi;
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use webhook_server::{Answer, Started, bundles, configuration, post, start};

const POD_CONFIGURATION: &str = "kerf-scheduling-gate";
const CLAIM_CONFIGURATION: &str = "kerf-claim-parameters";
const DEADLINE: Duration = Duration::from_secs(15);

fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    fake.insert(configuration(
        POD_CONFIGURATION,
        &["scheduling-gate.gpu.kerf.dev"],
        "Ignore",
    ));
    fake.insert(configuration(
        CLAIM_CONFIGURATION,
        &[
            "claim-parameters.gpu.kerf.dev",
            "claim-template-parameters.gpu.kerf.dev",
        ],
        "Fail",
    ));
    fake
}

/// An AdmissionReview for the CREATE of `object` (JSON text, inserted as written) of `kind`
/// through `request_version` (v1 or, converted to v1 by matchPolicy Equivalent, a beta).
fn review(uid: &str, kind: &str, request_version: &str, object: &str) -> String {
    let resource = format!("{}s", kind.to_lowercase());
    format!(
        r#"{{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {{
            "uid": "{uid}",
            "kind": {{"group": "resource.k8s.io", "version": "v1", "kind": "{kind}"}},
            "resource": {{"group": "resource.k8s.io", "version": "v1", "resource": "{resource}"}},
            "requestKind": {{"group": "resource.k8s.io", "version": "{request_version}", "kind": "{kind}"}},
            "requestResource": {{"group": "resource.k8s.io", "version": "{request_version}", "resource": "{resource}"}},
            "name": "c", "namespace": "default", "operation": "CREATE",
            "userInfo": {{"username": "python-client"}},
            "object": {object},
            "oldObject": null, "dryRun": false,
            "options": {{"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}}}}"#
    )
}

/// A claim as Python's `json.dumps` writes it, with `parameters` (also written so) as config.
fn python_claim(parameters: &str) -> String {
    format!(
        r#"{{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {{"name": "c", "namespace": "default"}}, "spec": {{"devices": {{"requests": [{{"name": "gpu", "exactly": {{"deviceClassName": "slices"}}}}], "config": [{{"requests": ["gpu"], "opaque": {{"driver": "other.example.com", "parameters": {{"b": 1, "a": 2}}}}}}, {{"requests": ["gpu"], "opaque": {{"driver": "gpu.kerf.dev", "parameters": {parameters}}}}}]}}}}}}"#
    )
}

fn python_template(parameters: &str) -> String {
    format!(
        r#"{{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {{"name": "c", "namespace": "default"}}, "spec": {{"spec": {{"devices": {{"requests": [{{"name": "gpu", "exactly": {{"deviceClassName": "slices"}}}}], "config": [{{"opaque": {{"driver": "gpu.kerf.dev", "parameters": {parameters}}}}}]}}}}}}}}"#
    )
}

/// Checks the answer as `VerifyAdmissionResponse` does; returns `response`.
fn response<'a>(uid: &str, answer: &'a Value) -> &'a Value {
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    let response = &answer["response"];
    assert_eq!(response["uid"], uid, "{answer}");
    assert_eq!(
        response.get("patch").is_some(),
        response.get("patchType").is_some(),
        "patch and patchType come together: {answer}"
    );
    response
}

/// The JSONPatch of an allowed answer, as text.
fn patch_text(response: &Value) -> String {
    assert_eq!(response["allowed"], true, "{response}");
    assert_eq!(response["patchType"], "JSONPatch", "{response}");
    let bytes = STANDARD
        .decode(response["patch"].as_str().unwrap())
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

/// A running webhook: its port, the CA bundle to trust and its metrics.
struct Served {
    port: u16,
    bundle: String,
    registry: Registry,
    stop: CancellationToken,
    _fake: FakeApi,
}

impl Served {
    /// Starts the webhook and waits until its CA is in every webhook of both configurations
    /// and it answers.
    async fn start() -> Self {
        let fake = cluster();
        let stop = CancellationToken::new();
        let Started {
            port,
            registry,
            serving,
        } = start(
            &fake,
            &[POD_CONFIGURATION, CLAIM_CONFIGURATION],
            Duration::from_secs(3600),
            Duration::from_secs(600),
            &stop,
        );
        let (pod, claim) = kerf_tests::wait::eventually("both caBundles", DEADLINE, || {
            std::future::ready(
                bundles(&fake, POD_CONFIGURATION).zip(bundles(&fake, CLAIM_CONFIGURATION)),
            )
        })
        .await;
        assert_eq!(claim.len(), 2);
        assert!(claim.iter().all(|b| b == &pod[0]), "{claim:?} vs {pod:?}");
        let bundle = pod[0].clone();
        // Not a review (HTTP 400): counted apart from the claim reviews the tests count.
        let probe = "{}".to_owned();
        kerf_tests::wait::eventually("the webhook", DEADLINE, || async {
            post(port, &bundle, probe.clone()).await.ok()
        })
        .await;
        assert!(
            serving.load(Ordering::Acquire),
            "an answering webhook counts as serving (the replica's readiness)"
        );
        Self {
            port,
            bundle,
            registry,
            stop,
            _fake: fake,
        }
    }

    /// Posts a review; returns its `response` after the checks of `VerifyAdmissionResponse`.
    async fn review(&self, uid: &str, kind: &str, request_version: &str, object: &str) -> Value {
        let body = review(uid, kind, request_version, object);
        let Answer {
            status,
            body: answer,
            ..
        } = post(self.port, &self.bundle, body).await.unwrap();
        assert_eq!(status, 200, "{answer}");
        response(uid, &answer).clone()
    }

    fn metrics(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test]
async fn claims_written_by_python_are_normalized_over_https() {
    let served = Served::start().await;
    // A claim written by Python: the kerf config (index 1) becomes compact and sorted; the
    // other driver's config (index 0) is not touched.
    let spaced = r#"{"memory": "10Gi", "kind": "GpuClaimParameters", "apiVersion": "gpu.kerf.dev/v1alpha1", "compute": 50}"#;
    let answer = served
        .review("uid-py", "ResourceClaim", "v1", &python_claim(spaced))
        .await;
    let patch = patch_text(&answer);
    assert_eq!(
        patch,
        r#"[{"op":"replace","path":"/spec/devices/config/1/opaque/parameters","value":{"apiVersion":"gpu.kerf.dev/v1alpha1","compute":50,"kind":"GpuClaimParameters","memory":"10Gi"}}]"#
    );
    let mut object: Value = serde_json::from_str(&python_claim(spaced)).unwrap();
    let before = object.clone();
    let operations: json_patch::Patch = serde_json::from_str(&patch).unwrap();
    json_patch::patch(&mut object, &operations).unwrap();
    assert_eq!(object, before, "the same values, only their bytes change");

    // Through v1beta1 (converted to v1 by matchPolicy Equivalent): the same answer.
    let answer = served
        .review(
            "uid-beta",
            "ResourceClaim",
            "v1beta1",
            &python_claim(spaced),
        )
        .await;
    assert_eq!(patch_text(&answer), patch);

    // A template, at its own path.
    let parameters = r#"{"kind": "GpuClaimParameters", "apiVersion": "gpu.kerf.dev/v1alpha1", "sharing": "MPS"}"#;
    let template = python_template(parameters);
    let answer = served
        .review("uid-t", "ResourceClaimTemplate", "v1", &template)
        .await;
    assert_eq!(
        patch_text(&answer),
        r#"[{"op":"replace","path":"/spec/spec/devices/config/0/opaque/parameters","value":{"apiVersion":"gpu.kerf.dev/v1alpha1","kind":"GpuClaimParameters","sharing":"MPS"}}]"#
    );
    let text = served.metrics();
    for (resource, count) in [("resourceclaims", 2), ("resourceclaimtemplates", 1)] {
        let line = format!(
            r#"kerf_controller_claim_admissions_total{{resource="{resource}",outcome="normalized"}} {count}"#
        );
        assert!(text.contains(&line), "{line}\n{text}");
    }
}

#[tokio::test]
async fn invalid_parameters_are_denied_naming_field_and_value() {
    let served = Served::start().await;
    let invalid =
        r#"{"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "compute": 150}"#;
    let denied = served
        .review("uid-bad", "ResourceClaim", "v1", &python_claim(invalid))
        .await;
    assert_eq!(denied["allowed"], false, "{denied}");
    assert!(denied.get("patch").is_none(), "{denied}");
    // As kube-apiserver refuses an invalid field: 422 Invalid, a FieldValueInvalid cause.
    assert_eq!(denied["status"]["code"], 422, "{denied}");
    assert_eq!(denied["status"]["reason"], "Invalid", "{denied}");
    assert_eq!(
        denied["status"]["message"],
        "spec.devices.config[1].opaque.parameters.compute: 150 is out of range 1-100"
    );
    let cause = &denied["status"]["details"]["causes"][0];
    assert_eq!(
        cause["field"],
        "spec.devices.config[1].opaque.parameters.compute"
    );
    assert_eq!(cause["reason"], "FieldValueInvalid");
    let line =
        r#"kerf_controller_claim_admissions_total{resource="resourceclaims",outcome="denied"} 1"#;
    assert!(served.metrics().contains(line), "{}", served.metrics());
}

#[tokio::test]
async fn claims_without_a_kerf_config_are_admitted_unchanged() {
    let served = Served::start().await;
    let other = python_claim(r#"{"x": 1}"#).replace("gpu.kerf.dev", "else.example.com");
    let unchanged = served
        .review("uid-other", "ResourceClaim", "v1", &other)
        .await;
    assert_eq!(unchanged["allowed"], true, "{unchanged}");
    assert!(unchanged.get("patch").is_none(), "{unchanged}");
    let line = r#"kerf_controller_claim_admissions_total{resource="resourceclaims",outcome="no_kerf_config"} 1"#;
    assert!(served.metrics().contains(line), "{}", served.metrics());
}
