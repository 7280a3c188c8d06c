//! Writes the API server will not take are told to the user: the claim controller runs as
//! kerf-controller's ServiceAccount against the in-memory API server, which answers chosen
//! writes as kube-apiserver does when RBAC denies them (403 Forbidden) or when a claim's
//! stored spec no longer validates (422 `field is immutable`). The user must see a Warning
//! Event on the objects concerned quoting the server, the pod condition, the metric
//! `kerf_api_write_failures_total`, and the controller must back off instead of hammering.

use crate::common::claim_cluster;

use std::time::Duration;

use claim_cluster::{
    CLAIMS, Controller, DRIVER, NS, PODS, SLICES, allocation, cluster, condition, gated_pod,
    get_claim, settings,
};
use kerf_api::controller_claims::SCHEDULING_GATE;
use kerf_controller::{BackoffConfig, ControllerConfig, claims};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::fixtures::SliceClaim;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(10);
/// Delay after a first failure; doubled per failure up to [`BACKOFF_MAX`] (the shipped
/// default is 1 s up to 5 min: scaled down so the test sees several retries).
const BACKOFF_BASE: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// kube-apiserver's RBAC denial of the gate removal (`forbiddenMessage` in
/// `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go`).
fn forbidden(pod: &str) -> String {
    format!(
        r#"pods "{pod}" is forbidden: User "system:serviceaccount:kerf-system:kerf-controller" cannot patch resource "pods" in API group "" in the namespace "{NS}""#
    )
}

/// kube-apiserver's answer to a metadata merge patch of a claim whose stored opaque
/// parameters re-encode differently (`ValidateResourceClaimUpdate` in
/// `pkg/apis/resource/validation/validation.go`: the spec is immutable).
fn immutable(claim: &str) -> String {
    format!(
        r#"ResourceClaim.resource.k8s.io "{claim}" is invalid: spec: Invalid value: "{{\"devices\":{{…}}}}": field is immutable"#
    )
}

/// The claim controller running as kerf-controller's ServiceAccount, with its metrics, its
/// back-off scaled down.
fn start_controller(fake: &FakeApi) -> Controller {
    Controller::start_config(
        fake,
        ControllerConfig {
            backoff: BackoffConfig {
                base: BACKOFF_BASE,
                max: BACKOFF_MAX,
            },
            claims: settings(),
            ..ControllerConfig::new(DRIVER)
        },
    )
}

/// A claim of one 1 GiB slice of the controller class.
fn claim(fake: &FakeApi, name: &str) {
    fake.insert(SliceClaim::new(name, SLICES, "1Gi").in_namespace(NS).json());
}

/// Warning Events about object `name` with `reason`.
fn warnings(fake: &FakeApi, kind: &str, name: &str, reason: &str) -> Vec<Value> {
    fake.warning_events(kind, name)
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .collect()
}

async fn warning(fake: &FakeApi, kind: &str, name: &str, reason: &str) -> Value {
    kerf_tests::wait::eventually(
        &format!("a {reason} Warning about {kind} {name}"),
        DEADLINE,
        || async { warnings(fake, kind, name, reason).into_iter().next() },
    )
    .await
}

fn note(event: &Value) -> &str {
    event["note"].as_str().unwrap_or_default()
}

fn gates(fake: &FakeApi, pod: &str) -> Value {
    fake.get(&format!("{PODS}/{pod}")).unwrap()["spec"]["schedulingGates"].clone()
}

/// PATCH requests to the claim and its status so far.
fn claim_patches(fake: &FakeApi, name: &str) -> usize {
    fake.count("PATCH", &format!("{CLAIMS}/{name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_removal_refused_by_rbac_is_a_warning_on_the_pod_and_counted() {
    let fake = cluster();
    claim(&fake, "gated-claim");
    gated_pod(&fake, "gated-pod", "gated-claim");
    let denied = forbidden("gated-pod");
    fake.fail_next_with(
        "PATCH",
        &format!("{PODS}/gated-pod"),
        403,
        "Forbidden",
        &denied,
        usize::MAX,
    );
    let controller = start_controller(&fake);

    let event = warning(&fake, "Pod", "gated-pod", "WriteRefused").await;
    let note = note(&event);
    assert!(note.contains(&denied), "the API's words: {note}");
    assert!(
        note.contains("lacks `patch` on `pods`") && note.contains("deploy/"),
        "what to do: {note}"
    );
    assert!(
        allocation(&get_claim(&fake, "gated-claim").unwrap()).is_some(),
        "the claim is allocated; only the gate removal is refused"
    );
    assert_eq!(
        gates(&fake, "gated-pod"),
        json!([{"name": SCHEDULING_GATE}]),
        "the refused write changed nothing"
    );
    assert!(controller.write_failures("pods", "Forbidden") >= 1);
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_writes_are_immutable_is_told_on_claim_and_pod_and_backed_off() {
    let fake = cluster();
    claim(&fake, "stored-spaced");
    gated_pod(&fake, "waits", "stored-spaced");
    let refusal = immutable("stored-spaced");
    fake.fail_next_with(
        "PATCH",
        &format!("{CLAIMS}/stored-spaced"),
        422,
        "Invalid",
        &refusal,
        usize::MAX,
    );
    let controller = start_controller(&fake);

    let on_claim = warning(&fake, "ResourceClaim", "stored-spaced", "WriteRefused").await;
    for text in [
        "field is immutable",
        "compact JSON",
        "kubectl replace",
        &refusal,
    ] {
        assert!(note(&on_claim).contains(text), "{text}: {on_claim}");
    }
    let on_pod = warning(&fake, "Pod", "waits", "WriteRefused").await;
    assert_eq!(note(&on_pod), note(&on_claim), "the pod is told the same");
    let condition = kerf_tests::wait::eventually(
        "the pod condition says the claim write is refused",
        DEADLINE,
        || async {
            condition(&fake, "waits")
                .filter(|c| c["reason"] == claims::reasons::CLAIM_WRITE_REFUSED)
        },
    )
    .await;
    assert_eq!(condition["status"], "False");
    assert!(
        condition["message"]
            .as_str()
            .unwrap()
            .contains("field is immutable"),
        "{condition}"
    );
    assert!(controller.write_failures("resourceclaims", "FieldImmutable") >= 1);

    // Back-off: over a few seconds the refused claim is tried a handful of times (delays
    // 0.2, 0.4, 0.8, 1.6, 2, 2 s …), not in a loop.
    let before = claim_patches(&fake, "stored-spaced");
    tokio::time::sleep(Duration::from_secs(6)).await;
    let attempts = claim_patches(&fake, "stored-spaced") - before;
    assert!(
        attempts <= 12,
        "{attempts} claim patches in 6 s: the refused write is retried without back-off"
    );
    // Repeats are counted in the first Event's series, not written as new Events.
    let events = warnings(&fake, "ResourceClaim", "stored-spaced", "WriteRefused");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        allocation(&get_claim(&fake, "stored-spaced").unwrap()),
        None,
        "nothing was written"
    );
    controller.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_refused_after_the_claim_was_marked_is_not_retried_in_a_loop() {
    // The metadata patch (finalizer, node annotation) succeeds, the status write is refused,
    // and the rollback of the metadata changes the claim again: its watch events must not
    // bring the claim back before its back-off is over.
    let fake = cluster();
    claim(&fake, "status-refused");
    gated_pod(&fake, "waits-for-status", "status-refused");
    let status = format!("{CLAIMS}/status-refused/status");
    fake.fail_next_with(
        "PATCH",
        &status,
        403,
        "Forbidden",
        r#"resourceclaims.resource.k8s.io "status-refused" is forbidden: User "system:serviceaccount:kerf-system:kerf-controller" cannot patch resource "resourceclaims/status" in API group "resource.k8s.io" in the namespace "default""#,
        usize::MAX,
    );
    let controller = start_controller(&fake);
    warning(&fake, "ResourceClaim", "status-refused", "WriteRefused").await;
    let before = fake.count("PATCH", &status);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let attempts = fake.count("PATCH", &status) - before;
    assert!(
        attempts <= 8,
        "{attempts} status writes in 4 s: the refused claim is retried without back-off"
    );
    controller.stop().await;
}
