//! The quota webhook's part of the permissions flow: kerf-controller's webhook keeps its CA in
//! the ValidatingWebhookConfiguration `kerf-gpu-quota`, charges a claim the fake sends it for
//! review into the GpuQuota's status (a replace of `/status`), and reads the quota again when
//! that write conflicts with someone else's.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::GpuQuota;
use kerf_tests::fake_api::{FakeApi, Identity, KERF_NAMESPACE, KERF_WEBHOOK_MANIFEST};
use kerf_tests::fixtures::SliceClaim;
use kerf_tests::wait::eventually;
use kube::api::{Api, PostParams};
use serde_json::json;

/// The ValidatingWebhookConfiguration of the quota webhook (`deploy/helm/kerf/templates/webhook.yaml`).
pub const QUOTA_CONFIGURATION: &str = "kerf-gpu-quota";
const TEAM: &str = "quota-team";
const WAIT: Duration = Duration::from_secs(20);

/// A stand-in for `kerf-gpu-quota` before the controller starts: one webhook without rules
/// (never called), whose caBundle the controller fills.
pub fn stub_configuration(fake: &FakeApi) {
    fake.insert(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": QUOTA_CONFIGURATION},
        "webhooks": [{"name": "quota.gpu.kerf.dev", "clientConfig": {}}],
    }));
}

/// The controller's CA in the quota configuration, once it has put it there.
pub fn ca_bundle(fake: &FakeApi) -> Option<String> {
    let config = fake.get(&format!(
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{QUOTA_CONFIGURATION}"
    ))?;
    let encoded = config["webhooks"][0]["clientConfig"]["caBundle"].as_str()?;
    String::from_utf8(STANDARD.decode(encoded).ok()?).ok()
}

/// With the controller's webhook serving on `port`: kerf's configurations installed with its
/// CA, a quota in a namespace of its own, claims of Controller class `class` created until the
/// webhook charges one (its cache has the quota then), a status write by the cluster admin
/// that makes the webhook's copy stale, and one more claim, whose charge conflicts and is
/// written after the quota is read again.
pub async fn admissions(fake: &FakeApi, port: u16, class: &str) {
    let ca = ca_bundle(fake).unwrap();
    fake.install_webhook_configurations(KERF_WEBHOOK_MANIFEST, Some(&ca));
    fake.serve_webhook_service(
        KERF_NAMESPACE,
        "kerf-webhook",
        ([127, 0, 0, 1], port).into(),
    );
    fake.insert(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": TEAM, "labels": {"kubernetes.io/metadata.name": TEAM}},
    }));
    let quotas: Api<GpuQuota> = Api::namespaced(fake.client(), TEAM);
    let quota: GpuQuota = serde_json::from_value(json!({
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": TEAM, "namespace": TEAM},
        "spec": {"hard": {"memory": "40Gi"}},
    }))
    .unwrap();
    quotas.create(&PostParams::default(), &quota).await.unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(fake.client(), TEAM);
    let mut created = 0;
    eventually("the webhook charges a claim", WAIT, || {
        created += 1;
        let (claims, quotas, claim) = (
            &claims,
            &quotas,
            slice_claim(&format!("claim-{created}"), class),
        );
        async move {
            claims.create(&PostParams::default(), &claim).await.unwrap();
            let status = quotas.get_status(TEAM).await.unwrap().status;
            status.is_some_and(|s| !s.admitted.is_empty()).then_some(())
        }
    })
    .await;
    // The next status write of the quota conflicts, as when another replica or the recount
    // wrote first: the writer (the webhook, or the recount if it writes first) reads the quota
    // again. Injected, because whether a real race happens depends on timing.
    fake.fail_next(
        "PUT",
        &format!("/apis/gpu.kerf.dev/v1alpha1/namespaces/{TEAM}/gpuquotas/{TEAM}/status"),
        409,
        1,
    );
    let after = slice_claim("after-conflict", class);
    claims.create(&PostParams::default(), &after).await.unwrap();
    let user = Identity::kerf_controller().username;
    let read_again = fake.authorization_checks().iter().any(|c| {
        c.allowed
            && c.user == user
            && c.attributes.verb == "get"
            && c.attributes.combined_resource() == "gpuquotas"
    });
    assert!(
        read_again,
        "the conflicting write made the webhook read the quota again"
    );
}

/// A claim of a 1Gi slice of Controller class `class`.
fn slice_claim(name: &str, class: &str) -> ResourceClaim {
    SliceClaim::new(name, class, "1Gi")
        .in_namespace(TEAM)
        .resource()
        .unwrap()
}
