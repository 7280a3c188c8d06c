//! Claims whose opaque parameters carry spaces, end to end against the in-memory API server's
//! ResourceClaim rules (kube-apiserver keeps an opaque config's `parameters` byte for byte, and
//! any patch of the claim re-encodes them, which `ValidateResourceClaimUpdate` refuses as a spec
//! change):
//! - a claim stored with spaces (as Python's `json.dumps` writes) can never be written by
//!   kerf-controller, which says so on the claim and the pod instead of failing silently;
//! - the same claim after kerf's admission webhook normalized it (its JSONPatch applied to the
//!   request as kube-apiserver applies it) is allocated and its pod released.

use crate::common::claim_cluster;

use std::time::Duration;

use claim_cluster::{
    CLAIMS, Controller, DRIVER, NS, PODS, SLICES, allocation, cluster, gated_pod, get_claim,
};
use kerf_api::controller_claims::SCHEDULING_GATE;
use kerf_controller::webhook::{ClaimDecision, ClaimResource, decide_claim};
use kerf_tests::fake_api::FakeApi;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(15);

/// The parameters as `json.dumps` writes them: `", "` and `": "` separators.
const SPACED: &str =
    r#"{"apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuClaimParameters", "memory": "1Gi"}"#;

/// A claim of one slice of the controller class whose parameters are `parameters` (JSON
/// text, kept as it is).
fn claim_body(name: &str, parameters: &str) -> String {
    format!(
        r#"{{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {{"name": "{name}", "namespace": "{NS}"}}, "spec": {{"devices": {{"requests": [{{"name": "gpu", "exactly": {{"deviceClassName": "{SLICES}", "count": 1, "allocationMode": "ExactCount"}}}}], "config": [{{"opaque": {{"driver": "{DRIVER}", "parameters": {parameters}}}}}]}}}}}}"#
    )
}

async fn create_claim(fake: &FakeApi, body: &str) {
    let (code, answer) = fake
        .request_raw("POST", CLAIMS, "application/json", body.as_bytes())
        .await;
    assert_eq!(code, 201, "create: {answer}");
}

fn warning_about(fake: &FakeApi, kind: &str, name: &str) -> Option<Value> {
    fake.warning_events(kind, name).into_iter().next()
}

fn gates(fake: &FakeApi, pod: &str) -> Value {
    fake.get(&format!("{PODS}/{pod}")).unwrap()["spec"]["schedulingGates"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_stored_with_spaced_parameters_is_reported_on_claim_and_pod() {
    let fake = cluster();
    create_claim(&fake, &claim_body("spaced", SPACED)).await;
    gated_pod(&fake, "spaced-pod", "spaced");
    let controller = Controller::start(&fake);

    for (kind, name) in [("ResourceClaim", "spaced"), ("Pod", "spaced-pod")] {
        let event = kerf_tests::wait::eventually(
            &format!("a Warning Event on {kind} {name}"),
            DEADLINE,
            || async { warning_about(&fake, kind, name) },
        )
        .await;
        let note = event["note"].as_str().unwrap_or_default();
        assert!(
            note.contains("field is immutable"),
            "the API's words: {note}"
        );
        assert!(note.contains("compact JSON"), "what to do: {note}");
    }
    assert_eq!(allocation(&get_claim(&fake, "spaced").unwrap()), None);
    assert_eq!(
        gates(&fake, "spaced-pod"),
        json!([{"name": SCHEDULING_GATE}])
    );
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhooks_normalized_parameters_survive_every_controller_write() {
    let fake = cluster();
    let spaced = claim_body("normalized", SPACED);
    // kube-apiserver hands the webhook the decoded object and applies its JSONPatch to the
    // stored form: the replaced parameters keep the patch value's bytes.
    let object: Value = serde_json::from_str(&spaced).unwrap();
    let ClaimDecision::Normalize { patch, .. } =
        decide_claim(&object, ClaimResource::Claim, DRIVER)
    else {
        panic!("a kerf claim is normalized");
    };
    let operations: Value = serde_json::from_str(&patch).unwrap();
    let value = &operations[0]["value"];
    let start = patch.find(r#""value":"#).unwrap() + r#""value":"#.len();
    let canonical = &patch[start..patch.len() - 2];
    assert_eq!(serde_json::from_str::<Value>(canonical).unwrap(), *value);
    create_claim(&fake, &spaced.replace(SPACED, canonical)).await;
    gated_pod(&fake, "normalized-pod", "normalized");
    let controller = Controller::start(&fake);

    kerf_tests::wait::eventually(
        "the claim allocated and the gate removed",
        DEADLINE,
        || async {
            let claim = get_claim(&fake, "normalized")?;
            let allocated = allocation(&claim).is_some();
            let released = gates(&fake, "normalized-pod")
                .as_array()
                .is_none_or(Vec::is_empty);
            (allocated && released).then_some(())
        },
    )
    .await;
    assert!(
        warning_about(&fake, "ResourceClaim", "normalized").is_none(),
        "no write was refused"
    );
    controller.stop().await;
}
