//! kerf's permission surface: each component runs a representative flow against one
//! [`FakeApi`] as its own ServiceAccount, and the test prints the distinct (verb, resource,
//! subresource) each one was authorized for. Every one must be allowed by
//! `deploy/base/*rbac*.yaml`, and every rule there must be used by this flow or be listed in
//! [`EXERCISED_ELSEWHERE`] with the test that needs it (least privilege: a rule nothing uses
//! is a right nobody should hold).
//!
//! The flow: the plugin publishes its slices (watching its Node), prepares a claim (reading
//! it, writing its device status as `associated-node`), reports a claim Event and unprepares;
//! kerf-controller leads through its Lease, creates the default GpuClasses and their record,
//! turns a GpuClass into a DeviceClass and its status, and keeps the webhook's CA bundle.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::{NODE, TestNode, eventually, uid};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kerf_controller::default_classes::{DefaultClasses, ensure};
use kerf_controller::webhook::ca_bundle::ensure_ca;
use kerf_controller::{Config, ControllerConfig, LeaseConfig};
use kerf_kubelet_plugin::claim_events::{ClaimEvents as _, ClaimWarning, KubeClaimEvents};
use kerf_kubelet_plugin::plugin::{self, Connections};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_proto::client::{KNOWN_SERVICES, KubeletClient};
use kerf_tests::fake_api::{Check, FakeApi, Identity, KERF_NAMESPACE, Policy};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// Rules this flow does not reach, each with the test that fails without it.
const EXERCISED_ELSEWHERE: &[(&str, &str)] = &[
    (
        "ClusterRole kerf-controller rule 1",
        "controller/tests/claims.rs: status.allocation is written through resourceclaims/status",
    ),
    (
        "ClusterRole kerf-controller rule 2",
        "controller/tests/claims.rs: 1.36 needs resourceclaims/binding to change the allocation",
    ),
    (
        "ClusterRole kerf-controller rule 6",
        "controller/tests/claims.rs: the pod condition that says why claims are not allocated",
    ),
    (
        "ClusterRole kerf-controller rule 10",
        "none: gpuclasses/finalizers is checked by the OwnerReferencesPermissionEnforcement \
         admission plugin (off by default, not imitated by FakeApi) when the DeviceClass's \
         owner reference sets blockOwnerDeletion",
    ),
    (
        "ClusterRole kerf-controller rule 12",
        "controller/tests/webhook.rs: the webhook reads pods' claim templates",
    ),
];

/// `system:serviceaccount:<ns>:<name>` as its identity (groups only; RBAC needs no node).
fn identity_of(username: &str) -> Identity {
    match username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
    {
        Some((namespace, name)) => Identity::service_account(namespace, name),
        None => Identity {
            username: username.to_owned(),
            groups: Vec::new(),
            extra: BTreeMap::new(),
        },
    }
}

async fn plugin_flow(node: &TestNode) {
    let claim_uid = uid(1);
    node.device_claim("whole", &claim_uid, "gpu-0");
    let mut config = node.config();
    config.publish_resources = true;
    let connections = Connections::kube(node.plugin_client(), NODE, true);
    let options = plugin::StartOptions::defaults(true);
    let running = plugin::start_with(&config, &options, node.inventory(), connections)
        .await
        .unwrap();
    let kubelet = KubeletClient::new()
        .knowing(&KNOWN_SERVICES)
        .register(&config.registration_socket)
        .await
        .unwrap();
    let claim = kerf_proto::client::Claim::new(common::NAMESPACE, "whole", &claim_uid);
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answers[&claim_uid].is_ok(), "{answers:?}");
    let path = format!(
        "/apis/resource.k8s.io/v1/namespaces/{}/resourceclaims/whole",
        common::NAMESPACE
    );
    eventually("the claim's device status", WAIT, || {
        node.api.get(&path).is_some_and(|c| {
            c["status"]["devices"]
                .as_array()
                .is_some_and(|d| !d.is_empty())
        })
    })
    .await;
    eventually("the slices are published", WAIT, || {
        !node
            .api
            .list("/apis/resource.k8s.io/v1/resourceslices")
            .is_empty()
    })
    .await;
    KubeClaimEvents::new(node.plugin_client(), NODE)
        .warn(ClaimWarning {
            claim: ClaimRef {
                uid: claim_uid.clone(),
                namespace: common::NAMESPACE.to_owned(),
                name: "whole".to_owned(),
            },
            reason: "PermissionCheck",
            note: "an Event the test sends".to_owned(),
        })
        .await;
    let answers = kubelet.unprepare(&[claim]).await.unwrap();
    assert!(answers[&claim_uid].is_ok(), "{answers:?}");
    eventually("the device status withdrawn", WAIT, || {
        node.api
            .get(&path)
            .is_some_and(|c| c["status"]["devices"].as_array().is_none_or(Vec::is_empty))
    })
    .await;
    running.shutdown().await.unwrap();
}

async fn controller_flow(fake: &FakeApi) {
    let client = fake.client_as(Identity::kerf_controller());
    let stop = CancellationToken::new();
    let shipped =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/gpuclasses.yaml");
    let defaults = DefaultClasses::load(&shipped, KERF_NAMESPACE).unwrap();
    ensure(&client, &defaults, "kerf-controller", &stop)
        .await
        .unwrap();

    fake.insert(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "kerf-scheduling-gate"},
        "webhooks": [{"name": "scheduling-gate.gpu.kerf.dev", "clientConfig": {}}],
    }));
    let webhooks = kube::Api::<MutatingWebhookConfiguration>::all(client.clone());
    let ca = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    assert!(
        ensure_ca(&webhooks, "kerf-scheduling-gate", ca, "kerf-controller")
            .await
            .unwrap()
    );

    let config = Config {
        controller: ControllerConfig::new("gpu.kerf.dev"),
        leader_election: Some(LeaseConfig::new(
            "kerf-controller",
            KERF_NAMESPACE,
            "replica-a",
        )),
        metrics_address: None,
    };
    let run = tokio::spawn(kerf_controller::run(config, client, stop.clone()));
    eventually("a DeviceClass per GpuClass", WAIT, || {
        fake.list("/apis/resource.k8s.io/v1/deviceclasses").len() >= 2
    })
    .await;
    stop.cancel();
    run.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_allowed_and_every_rule_is_used() {
    let node = TestNode::new("h100-sxm-80gb:2");
    node.api
        .insert(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}));
    plugin_flow(&node).await;
    controller_flow(&node.api).await;

    let checks: Vec<Check> = node.api.authorization_checks();
    let mut surface: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    for check in &checks {
        let a = &check.attributes;
        surface
            .entry(check.user.clone())
            .or_default()
            .insert((a.verb.clone(), a.combined_resource()));
    }
    for (user, used) in &surface {
        eprintln!("{user}:");
        for (verb, resource) in used {
            eprintln!("  {verb} {resource}");
        }
    }
    let denied: Vec<&Check> = checks.iter().filter(|c| !c.allowed).collect();
    assert!(denied.is_empty(), "denied: {denied:#?}");

    let policy = Policy::kerf_manifests().unwrap();
    let used: BTreeSet<String> = checks
        .iter()
        .flat_map(|c| policy.allowing_rules(&identity_of(&c.user), &c.attributes))
        .map(|source| source.to_string())
        .collect();
    let elsewhere: BTreeSet<&str> = EXERCISED_ELSEWHERE.iter().map(|(rule, _)| *rule).collect();
    let unused: BTreeSet<String> = policy
        .grants()
        .iter()
        .map(|grant| grant.source.to_string())
        .filter(|rule| !used.contains(rule) && !elsewhere.contains(rule.as_str()))
        .collect();
    assert!(
        unused.is_empty(),
        "rules in deploy/ nothing uses (remove them, or name the test that needs them): {unused:#?}"
    );
    let stale: Vec<&&str> = elsewhere
        .iter()
        .filter(|rule| used.contains(**rule))
        .collect();
    assert!(
        stale.is_empty(),
        "listed as elsewhere but used here: {stale:?}"
    );
}
