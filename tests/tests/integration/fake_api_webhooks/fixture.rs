//! What the FakeApi webhook tests share: a ResourceClaim webhook of Service
//! `webhooks/validator`, its configuration, namespaces, claims, and a cluster that serves it.
#![allow(dead_code, reason = "each test binary uses a part of the fixture")]

use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_tests::fake_api::FakeApi;
use kube::api::{Api, ApiResource, DynamicObject};
use serde_json::{Value, json};

use super::server::{self, Webhook};

pub const NAMESPACE: &str = "webhooks";
pub const SERVICE: &str = "validator";
pub const HOST: &str = "validator.webhooks.svc";
/// Ends a test that would otherwise hang (a webhook called under the store's lock).
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A webhook named `name` of Service `webhooks/validator` for `operations` on ResourceClaims.
pub fn webhook(name: &str, operations: &[&str], failure_policy: &str, ca_bundle: &str) -> Value {
    json!({
        "name": name,
        "clientConfig": {
            "service": {"namespace": NAMESPACE, "name": SERVICE, "path": "/validate", "port": 443},
            "caBundle": ca_bundle,
        },
        "rules": [{
            "operations": operations, "apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"],
            "resources": ["resourceclaims"], "scope": "Namespaced",
        }],
        "failurePolicy": failure_policy,
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    })
}

pub fn configure(fake: &FakeApi, name: &str, webhooks: Vec<Value>) {
    let mut configuration = json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
    });
    configuration["webhooks"] = Value::Array(webhooks);
    fake.insert(configuration);
}

pub fn namespace(fake: &FakeApi, name: &str, labels: Value) {
    let mut namespace =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
    namespace["metadata"]["labels"] = labels;
    fake.insert(namespace);
}

pub fn claim(name: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
    }))
    .unwrap()
}

/// A fake with the webhook `name` (`failure_policy`) for `operations` on ResourceClaims,
/// served by `server`, and the namespaces `team-a` and the webhook's own.
pub async fn cluster(
    name: &str,
    operations: &[&str],
    failure_policy: &str,
    answer: server::Handler,
) -> (FakeApi, Webhook) {
    let server = server::start(&[HOST], answer).await;
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    namespace(&fake, NAMESPACE, json!({}));
    configure(
        &fake,
        "claims",
        vec![webhook(
            name,
            operations,
            failure_policy,
            &server.ca_bundle(),
        )],
    );
    fake.serve_webhook_service(NAMESPACE, SERVICE, server.address);
    (fake, server)
}

pub fn claims(fake: &FakeApi) -> Api<ResourceClaim> {
    Api::namespaced(fake.client(), "team-a")
}

pub fn api_error(result: Result<impl std::fmt::Debug, kube::Error>) -> kube::core::Status {
    match result {
        Err(kube::Error::Api(status)) => *status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn gpu_quotas(fake: &FakeApi) -> Api<DynamicObject> {
    let resource = ApiResource {
        group: "gpu.kerf.dev".to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: "gpu.kerf.dev/v1alpha1".to_owned(),
        kind: "GpuQuota".to_owned(),
        plural: "gpuquotas".to_owned(),
    };
    Api::namespaced_with(fake.client(), "team-a", &resource)
}

pub fn gpu_quota(spec: Value, status: Value) -> DynamicObject {
    let mut quota = json!({
        "apiVersion": "gpu.kerf.dev/v1alpha1", "kind": "GpuQuota", "metadata": {"name": "team-a"},
    });
    quota["spec"] = spec;
    quota["status"] = status;
    serde_json::from_value(quota).unwrap()
}
