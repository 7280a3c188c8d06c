//! Tests of the RBAC authorizer: request attributes, rule matching, bindings, the 403 and
//! the 1.36 ResourceClaim status checks.

use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

use super::*;

fn attributes(method: &str, path: &str, query: &str) -> Attributes {
    Attributes::from_request(method, path, query)
}

#[test]
fn every_role_of_the_default_install_is_bound_and_loaded() {
    use crate::manifests::{INSTALL, INSTALL_PATH, documents};
    let mut in_manifest: Vec<(String, String)> = documents(INSTALL_PATH, INSTALL)
        .unwrap()
        .into_iter()
        .filter(|d| d["kind"] == "ClusterRole" || d["kind"] == "Role")
        .map(|d| {
            let kind = d["kind"].as_str().unwrap().to_owned();
            (kind, d["metadata"]["name"].as_str().unwrap().to_owned())
        })
        .collect();
    in_manifest.sort();
    let policy = Policy::kerf_manifests().unwrap();
    let mut granted: Vec<(String, String)> = policy
        .grants()
        .iter()
        .map(|g| (g.source.kind.to_owned(), g.source.name.clone()))
        .collect();
    granted.sort();
    granted.dedup();
    assert_eq!(granted, in_manifest);
    assert!(in_manifest.len() >= 4, "{in_manifest:?}");
}

#[test]
fn attributes_follow_request_info() {
    let get = attributes("GET", "/api/v1/namespaces/ns/pods/p", "");
    assert_eq!(
        (get.verb.as_str(), get.namespace.as_str(), get.name.as_str()),
        ("get", "ns", "p")
    );
    let list = attributes("GET", "/apis/resource.k8s.io/v1/resourceclaims", "limit=5");
    assert_eq!(
        (list.verb.as_str(), list.api_group.as_str()),
        ("list", "resource.k8s.io")
    );
    let watch = attributes(
        "GET",
        "/api/v1/nodes",
        "watch=true&fieldSelector=metadata.name%3Dnode-a",
    );
    assert_eq!(
        (watch.verb.as_str(), watch.name.as_str()),
        ("watch", "node-a")
    );
    let not_exact = attributes(
        "GET",
        "/api/v1/nodes",
        "fieldSelector=metadata.name!%3Dnode-a",
    );
    assert_eq!(not_exact.name, "");
    let status = attributes("PATCH", "/api/v1/namespaces/ns/pods/p/status", "");
    assert_eq!(
        (status.verb.as_str(), status.combined_resource().as_str()),
        ("patch", "pods/status")
    );
    let collection = attributes("DELETE", "/apis/resource.k8s.io/v1/resourceslices", "");
    assert_eq!(collection.verb, "deletecollection");
    let create = attributes("POST", "/api/v1/namespaces/ns/configmaps", "");
    assert_eq!((create.verb.as_str(), create.name.as_str()), ("create", ""));
    let namespace = attributes("GET", "/api/v1/namespaces/ns", "");
    assert_eq!(
        (
            namespace.resource.as_str(),
            namespace.name.as_str(),
            namespace.namespace.as_str()
        ),
        ("namespaces", "ns", "ns")
    );
    let old_watch = attributes("GET", "/api/v1/watch/namespaces/ns/pods", "");
    assert_eq!(
        (old_watch.verb.as_str(), old_watch.resource.as_str()),
        ("watch", "pods")
    );
    let version = attributes("GET", "/version", "");
    assert!(!version.resource_request);
}

const POLICY: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: reader}
rules:
  - apiGroups: [""]
    resources: ["*/status"]
    verbs: ["get"]
  - apiGroups: [""]
    resources: ["configmaps"]
    resourceNames: ["one"]
    verbs: ["get"]
  - apiGroups: [""]
    resources: ["pods/*"]
    verbs: ["get"]
  - nonResourceURLs: ["/healthz/*"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: reader}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}
subjects:
  - {kind: Group, name: readers}
  # No namespace in a ClusterRoleBinding: matches nobody.
  - {kind: ServiceAccount, name: lost}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: writer, namespace: ns}
rules:
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["*"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: writer, namespace: ns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: writer}
subjects:
  - {kind: ServiceAccount, name: sa}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader-here, namespace: ns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: reader}
subjects:
  - {kind: User, name: alice}
"#;

#[test]
fn rules_match_as_upstream_evaluation_helpers() {
    let mut policy = Policy::default();
    policy.add_yaml("test", POLICY).unwrap();
    let reader = Identity {
        groups: vec!["readers".to_owned()],
        ..Identity::service_account("other", "x")
    };
    let allows = |user: &Identity, method: &str, path: &str| {
        policy.allows(user, &attributes(method, path, ""))
    };
    // `*/status` matches any resource's status, not the resource.
    assert!(allows(&reader, "GET", "/api/v1/namespaces/a/pods/p/status"));
    assert!(!allows(&reader, "GET", "/api/v1/namespaces/a/pods/p"));
    // `pods/*` is no wildcard upstream.
    assert!(!allows(&reader, "GET", "/api/v1/namespaces/a/pods/p/log"));
    // resourceNames: that name only, and never a list.
    assert!(allows(
        &reader,
        "GET",
        "/api/v1/namespaces/a/configmaps/one"
    ));
    assert!(!allows(
        &reader,
        "GET",
        "/api/v1/namespaces/a/configmaps/two"
    ));
    assert!(!allows(&reader, "GET", "/api/v1/namespaces/a/configmaps"));
    assert!(allows(&reader, "GET", "/healthz/ready"));
    assert!(!allows(&reader, "GET", "/version"));
    // A ServiceAccount subject without a namespace takes its RoleBinding's, and a Role
    // grants only in its namespace.
    let sa = Identity::service_account("ns", "sa");
    assert!(allows(&sa, "DELETE", "/api/v1/namespaces/ns/pods/p"));
    assert!(!allows(&sa, "DELETE", "/api/v1/namespaces/other/pods/p"));
    assert!(!allows(
        &Identity::service_account("x", "lost"),
        "GET",
        "/api/v1/nodes/n/status"
    ));
    // A ClusterRole bound by a RoleBinding grants in that namespace only.
    let alice = Identity {
        username: "alice".to_owned(),
        groups: vec!["system:authenticated".to_owned()],
        extra: BTreeMap::new(),
    };
    assert!(allows(
        &alice,
        "GET",
        "/api/v1/namespaces/ns/configmaps/one"
    ));
    assert!(!allows(
        &alice,
        "GET",
        "/api/v1/namespaces/a/configmaps/one"
    ));
    assert!(allows(&Identity::admin(), "DELETE", "/api/v1/nodes/n"));
}

#[tokio::test]
async fn a_denied_request_is_the_api_servers_403() {
    let fake = FakeApi::new();
    fake.insert(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "c", "namespace": "default"},
    }));
    let controller = fake.client_as(Identity::kerf_controller());
    let err = Api::<ConfigMap>::namespaced(controller, "default")
        .get("c")
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err}")
    };
    assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        status.message,
        "configmaps \"c\" is forbidden: User \"system:serviceaccount:kerf-system:kerf-controller\" \
         cannot get resource \"configmaps\" in API group \"\" in the namespace \"default\""
    );
    let checks = fake.authorization_checks();
    assert_eq!(checks.len(), 1);
    assert!(!checks[0].allowed);
    // The admin is never checked, nor refused.
    Api::<ConfigMap>::namespaced(fake.client(), "default")
        .get("c")
        .await
        .unwrap();
    assert_eq!(fake.authorization_checks().len(), 1);
    // Pods: the controller reads them everywhere, and may not delete them.
    let pods = Api::<Pod>::namespaced(fake.client_as(Identity::kerf_controller()), "default");
    pods.list(&kube::api::ListParams::default()).await.unwrap();
    let err = pods
        .delete("p", &kube::api::DeleteParams::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403 && s.message.starts_with("pods \"p\" is forbidden: ")),
        "{err}"
    );
}

fn claim_on(node: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "claim", "namespace": "ns"},
        "spec": {"devices": {"requests": []}},
        "status": {
            "allocation": {
                "devices": {"results": [
                    {"request": "gpu", "driver": "gpu.kerf.dev", "pool": node, "device": "gpu-0"}
                ]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}
                ]}]},
            },
        },
    })
}

fn device_status(driver: &str, node: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "status": {"devices": [{"driver": driver, "pool": node, "device": "gpu-0"}]},
    })
}

async fn apply_status(
    fake: &FakeApi,
    identity: Identity,
    body: &Value,
) -> Result<ResourceClaim, kube::Error> {
    Api::<ResourceClaim>::namespaced(fake.client_as(identity), "ns")
        .patch_status("claim", &PatchParams::apply("test"), &Patch::Apply(body))
        .await
}

/// The plugin writes its driver's device status on the claims of its own node
/// (`associated-node:patch`); on another node's claim, for another driver, or where the
/// allocation names no single node, the write is `422 Invalid`.
#[tokio::test]
async fn device_status_needs_the_driver_subresource_for_the_claims_node() {
    let fake = FakeApi::new();
    fake.insert(claim_on("node-a"));
    let on_a = Identity::kerf_kubelet_plugin("node-a");
    apply_status(
        &fake,
        on_a.clone(),
        &device_status("gpu.kerf.dev", "node-a"),
    )
    .await
    .unwrap();
    let checks = fake.authorization_checks();
    let driver_check = checks
        .iter()
        .find(|c| c.attributes.subresource == "driver")
        .unwrap();
    assert_eq!(
        (
            driver_check.attributes.verb.as_str(),
            driver_check.attributes.name.as_str(),
            driver_check.allowed
        ),
        ("associated-node:patch", "gpu.kerf.dev", true)
    );

    let err = apply_status(
        &fake,
        Identity::kerf_kubelet_plugin("node-b"),
        &device_status("gpu.kerf.dev", "node-b"),
    )
    .await
    .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err}")
    };
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    assert!(
        status.message.starts_with(
            "ResourceClaim.resource.k8s.io \"claim\" is invalid: status.devices: Forbidden: \
             changing status.devices requires resource=\"resourceclaims/driver\", \
             verb=\"[arbitrary-node:patch]\" permission: resourceclaims.resource.k8s.io \
             \"gpu.kerf.dev\" is forbidden: User"
        ),
        "{}",
        status.message
    );

    let err = apply_status(
        &fake,
        on_a.clone(),
        &device_status("other.example.com", "node-a"),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );

    // A token without the node: only arbitrary-node, which the plugin is not granted.
    let unbound = Identity::service_account(crate::fake_api::KERF_NAMESPACE, "kerf-kubelet-plugin");
    let withdraw = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "status": {"devices": []}});
    let err = Api::<ResourceClaim>::namespaced(fake.client_as(unbound), "ns")
        .patch_status(
            "claim",
            &PatchParams::apply("test"),
            &Patch::Apply(&withdraw),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422),
        "{err}"
    );
    // The admin may write anything.
    apply_status(
        &fake,
        Identity::admin(),
        &device_status("other.example.com", "node-a"),
    )
    .await
    .unwrap();
}

/// Changing `status.allocation` or `status.reservedFor` needs `resourceclaims/binding`; the
/// plugin has it not, kerf-controller has.
#[tokio::test]
async fn allocation_and_reservations_need_the_binding_subresource() {
    let fake = FakeApi::new();
    fake.insert(claim_on("node-a"));
    let reserve = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]},
    });
    let err = apply_status(&fake, Identity::kerf_kubelet_plugin("node-a"), &reserve)
        .await
        .unwrap_err();
    let kube::Error::Api(status) = err else {
        panic!("{err}")
    };
    assert_eq!(status.code, 422);
    assert!(
        status.message.contains(
            "status: Forbidden: changing status.allocation or status.reservedFor requires \
             resource=\"resourceclaims/binding\", verb=\"patch\" permission: \
             resourceclaims.resource.k8s.io is forbidden: User \
             \"system:serviceaccount:kerf-system:kerf-kubelet-plugin\" cannot patch resource \
             \"resourceclaims/binding\" in API group \"resource.k8s.io\" at the cluster scope"
        ),
        "{}",
        status.message
    );
    apply_status(&fake, Identity::kerf_controller(), &reserve)
        .await
        .unwrap();
}

/// A server-side apply that creates an object needs `create` as well as `patch`.
#[tokio::test]
async fn an_apply_that_creates_needs_create() {
    let fake = FakeApi::new();
    let record = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "kerf-default-gpu-classes-created", "namespace": crate::fake_api::KERF_NAMESPACE},
    });
    let mut policy = Policy::default();
    let (_, install) = KERF_RBAC_MANIFESTS[0];
    assert!(install.contains(
        "  - apiGroups: [\"\"]\n    resources: [\"configmaps\"]\n    verbs: [\"create\"]\n"
    ));
    let patch_only = install.replace(
        "  - apiGroups: [\"\"]\n    resources: [\"configmaps\"]\n    verbs: [\"create\"]\n",
        "",
    );
    policy.add_yaml("patch-only", &patch_only).unwrap();
    let attributes = Attributes {
        verb: "create".to_owned(),
        name: "kerf-default-gpu-classes-created".to_owned(),
        ..Attributes::from_request(
            "PATCH",
            "/api/v1/namespaces/kerf-system/configmaps/kerf-default-gpu-classes-created",
            "",
        )
    };
    assert!(!policy.allows(&Identity::kerf_controller(), &attributes));
    Api::<ConfigMap>::namespaced(
        fake.client_as(Identity::kerf_controller()),
        crate::fake_api::KERF_NAMESPACE,
    )
    .patch(
        "kerf-default-gpu-classes-created",
        &PatchParams::apply("test"),
        &Patch::Apply(&record),
    )
    .await
    .unwrap();
    let create = fake
        .authorization_checks()
        .into_iter()
        .find(|c| c.attributes.verb == "create")
        .unwrap();
    assert_eq!(create.attributes.name, "kerf-default-gpu-classes-created");
}
