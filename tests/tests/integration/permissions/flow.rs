//! The flow of `permissions.rs`: the kubelet plugin and kerf-controller (with its webhook)
//! doing, against one [`FakeApi`] and as their ServiceAccounts, everything deploy/ grants
//! them rights for. Objects a user, kube-scheduler or the kubelet would write are written as
//! the cluster admin; the kubelet's running of pods is the pod runner's.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kerf_api::claim_node_label::CLAIM_NODE_LABEL;
use kerf_api::controller_claims::{FINALIZER, SCHEDULING_GATE};
use kerf_controller::claims::ownership::OwnershipTiming;
use kerf_controller::claims::{ClaimSettings, POD_CONDITION_TYPE};
use kerf_controller::default_classes::{self, DefaultClasses};
use kerf_controller::webhook::{Certificates, SelfSigned, WebhookConfig};
use kerf_controller::{BackoffConfig, Config, ControllerConfig, FIELD_MANAGER, LeaseConfig};
use kerf_kubelet_plugin::claim_events::{ClaimEvents as _, ClaimWarning, KubeClaimEvents};
use kerf_kubelet_plugin::config::{MpsDaemonMode, OwnPod};
use kerf_kubelet_plugin::mps_daemons::daemon_pod_name;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_proto::client::{Claim, KNOWN_SERVICES, KubeletClient};
use kerf_tests::fake_api::{FakeApi, Identity, KERF_NAMESPACE};
use kerf_tests::pod_runner::{PodRunner, PodRunnerSettings};
use kerf_tests::wait::until;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::mps::MpsNode;
use crate::common::plugin_pod::{IMAGE_PROGRAM, PLUGIN_POD, plugin_pod_from_manifest};
use crate::common::{self, DRIVER, GIB, NODE, TestNode, uid};

const WAIT: Duration = Duration::from_secs(20);
/// The plugin as a program, which the daemon pods run (`kerf-test-plugin mps-control-daemon`).
const PLUGIN_BINARY: &str = env!("CARGO_BIN_EXE_kerf-test-plugin");
/// The default class kerf-controller allocates (the chart's default GpuClasses).
const CONTROLLER_CLASS: &str = "slice.gpu.kerf.dev";
/// The MutatingWebhookConfigurations of `deploy/helm/kerf/templates/webhook.yaml`, whose caBundle the
/// webhook keeps.
const WEBHOOK_CONFIGURATIONS: [&str; 2] = ["kerf-scheduling-gate", "kerf-claim-parameters"];
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";
const PODS: &str = "/api/v1/namespaces/default/pods";

/// The node as the kubelet registers it: Ready, with its host name label.
pub fn ready_node(fake: &FakeApi) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }));
}

/// The plugin publishes its slices (watching its Node), prepares two claims kube-scheduler
/// allocated (reading them, writing their device status as `associated-node`): a whole GPU,
/// and an MPS slice whose prepare creates its GPU's control daemon pod (`--mps-daemons=pod`:
/// reading its own pod at start-up, listing its node's daemon pods, reading and creating the
/// GPU's); it reports a claim Event and unprepares both, the slice's unprepare deleting the
/// daemon pod. The pod runner plays the kubelet that runs the daemon pod. The plugin keeps
/// running, publishing, for the controller's flow; its shutdown deletes the slices.
pub async fn plugin(on: &MpsNode) -> (RunningPlugin, PodRunner) {
    let node = &on.node;
    let whole = node.device_claim("whole", &uid(1), "gpu-0");
    let slice = node.slice_claim("slice", &uid(2), 1, 10 * GIB, 25);
    let (running, runner) = start_with_daemon_pods(on).await;
    let kubelet = KubeletClient::new()
        .knowing(&KNOWN_SERVICES)
        .register(&on.config().registration_socket)
        .await
        .unwrap();
    let claims = [whole.clone(), slice.clone()];
    let answers = kubelet.prepare(&claims).await.unwrap();
    for claim in &claims {
        assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    }
    let daemon_pod = daemon_pod_name(NODE, &on.gpu_uuid(1));
    let daemon_pod_exists = || {
        node.api
            .get_resource::<Pod>(Some(KERF_NAMESPACE), &daemon_pod)
            .is_some()
    };
    assert!(
        daemon_pod_exists(),
        "the slice's prepare created its GPU's daemon pod; runner: {:?}",
        runner.problems()
    );
    for claim in &claims {
        until("the claim's device status", WAIT, || {
            device_status(&node.api, claim).is_some_and(|d| !d.is_empty())
        })
        .await;
    }
    until("the slices are published", WAIT, || {
        !node
            .api
            .list("/apis/resource.k8s.io/v1/resourceslices")
            .is_empty()
    })
    .await;
    warn(node, &whole).await;
    let answers = kubelet.unprepare(&claims).await.unwrap();
    for claim in &claims {
        assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    }
    assert!(
        !daemon_pod_exists(),
        "the slice's unprepare deleted the daemon pod"
    );
    // Its user deletes the slice's claim: its GPU is free for the controller's flow, as
    // before the slice (the whole GPU's claim stays, keeping its GPU taken).
    node.api.remove(&format!("{CLAIMS}/{}", slice.name));
    (running, runner)
}

/// The plugin as the DaemonSet runs it, publishing and with `--mps-daemons=pod` (its own pod
/// as `deploy/kerf.yaml` makes it, the fake tools as the driver's), and the pod runner that
/// runs its node's pods with the `kerf-test-plugin` binary as the image's program.
async fn start_with_daemon_pods(on: &MpsNode) -> (RunningPlugin, PodRunner) {
    let node = &on.node;
    node.api
        .insert(serde_json::to_value(plugin_pod_from_manifest(NODE)).unwrap());
    let runner = PodRunner::start(
        &node.api,
        NODE,
        BTreeMap::from([(IMAGE_PROGRAM.to_owned(), PathBuf::from(PLUGIN_BINARY))]),
        PodRunnerSettings {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            ..PodRunnerSettings::default()
        },
    );
    let mut config = on.config();
    config.publish_resources = true;
    config.mps_daemons = MpsDaemonMode::Pod;
    config.mps_start_timeout = WAIT;
    config.own_pod = Some(OwnPod {
        name: PLUGIN_POD.to_owned(),
        namespace: KERF_NAMESPACE.to_owned(),
        uid: None,
    });
    // The plugin's client for everything, daemon pods included.
    let connections = Connections::kube(node.plugin_client(), &config);
    let running = plugin::start(&config, node.inventory(), connections)
        .await
        .unwrap();
    (running, runner)
}

/// A Warning Event on `claim`, as the plugin reports one.
async fn warn(node: &TestNode, claim: &Claim) {
    KubeClaimEvents::new(node.plugin_client(), NODE)
        .warn(ClaimWarning {
            claim: ClaimRef {
                uid: claim.uid.clone(),
                namespace: common::NAMESPACE.to_owned(),
                name: claim.name.clone(),
            },
            reason: "PermissionCheck",
            note: "an Event the test sends".to_owned(),
        })
        .await;
}

/// The entries of `claim`'s `status.devices`, if it has the field.
fn device_status(fake: &FakeApi, claim: &Claim) -> Option<Vec<Value>> {
    fake.get(&format!("{CLAIMS}/{}", claim.name))?["status"]["devices"]
        .as_array()
        .cloned()
}

/// kerf-controller as `main` runs it (leader election, the controllers, the default classes,
/// the webhook with a self-signed certificate): it creates the default GpuClasses and their
/// record, turns each into a DeviceClass and its status, keeps the webhooks' caBundle, fills
/// the webhook's caches (claims, claim templates, DeviceClasses), and then allocates a
/// claim end to end ([`claim_path`]).
pub async fn controller(fake: &FakeApi) {
    for name in WEBHOOK_CONFIGURATIONS {
        fake.insert(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": format!("{name}.gpu.kerf.dev"), "clientConfig": {}}],
        }));
    }
    super::quota_flow::stub_configuration(fake);
    // A template a pod would name: the webhook's cache lists it.
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "slice-template", "namespace": common::NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": CONTROLLER_CLASS}}
        ]}}},
    }));
    let shipped = kerf_tests::manifests::default_gpu_classes().unwrap();
    let defaults =
        DefaultClasses::parse(Path::new("gpuclasses.yaml"), &shipped, KERF_NAMESPACE).unwrap();
    let mut controllers = kerf_controller::controllers();
    controllers.push(default_classes::task(defaults));
    let stop = CancellationToken::new();
    let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let process = kerf_controller::Process {
        config: config(),
        client: fake.client_as(Identity::kerf_controller()),
        controllers,
        webhook: Some(webhook(port)),
        shutdown: stop.clone(),
    };
    let run = tokio::spawn(process.run());
    until("the caBundle of both webhook configurations", WAIT, || {
        WEBHOOK_CONFIGURATIONS.iter().all(|name| {
            fake.get(&format!(
                "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}"
            ))
            .is_some_and(|c| c["webhooks"][0]["clientConfig"]["caBundle"].is_string())
        }) && super::quota_flow::ca_bundle(fake).is_some()
    })
    .await;
    until("the webhook's template cache filled", WAIT, || {
        checked(fake, "watch", "resourceclaimtemplates")
    })
    .await;
    until("the controller class's DeviceClass", WAIT, || {
        fake.get(&format!(
            "/apis/resource.k8s.io/v1/deviceclasses/{CONTROLLER_CLASS}"
        ))
        .is_some()
    })
    .await;
    claim_path(fake).await;
    super::quota_flow::admissions(fake, port, CONTROLLER_CLASS).await;
    stop.cancel();
    run.await.unwrap().unwrap();
}

/// Whether kerf-controller was allowed `verb` on `resource` (`resource/subresource`).
fn checked(fake: &FakeApi, verb: &str, resource: &str) -> bool {
    let user = Identity::kerf_controller().username;
    fake.authorization_checks().iter().any(|c| {
        c.allowed
            && c.user == user
            && c.attributes.verb == verb
            && c.attributes.combined_resource() == resource
    })
}

/// A pod gated as the webhook gates it gets its controller-class claim allocated (finalizer,
/// node label, status through `binding`), its gate removed and the claim's Event; a pod
/// whose claim fits nowhere gets the condition that says so and the repeated Warning as a
/// series patch; once the first pod is deleted, its claim is deallocated and released.
async fn claim_path(fake: &FakeApi) {
    claim(fake, "train", 1);
    pod(fake, "train", "train");
    let allocated = |c: &Value| !c["status"]["allocation"].is_null();
    until("claim train allocated and labelled", WAIT, || {
        fake.get(&format!("{CLAIMS}/train"))
            .is_some_and(|c| allocated(&c) && c["metadata"]["labels"][CLAIM_NODE_LABEL] == NODE)
    })
    .await;
    until("the pod's scheduling gate removed", WAIT, || {
        fake.get(&format!("{PODS}/train")).is_some_and(|p| {
            p["spec"]["schedulingGates"]
                .as_array()
                .is_none_or(Vec::is_empty)
        })
    })
    .await;

    // More GPUs than the node has: the pod's condition says why, and the retries repeat the
    // Warning.
    claim(fake, "too-big", 3);
    pod(fake, "waits", "too-big");
    until("the waiting pod's condition", WAIT, || {
        fake.get(&format!("{PODS}/waits")).is_some_and(|p| {
            p["status"]["conditions"]
                .as_array()
                .is_some_and(|conditions| {
                    conditions
                        .iter()
                        .any(|c| c["type"] == POD_CONDITION_TYPE && c["status"] == "False")
                })
        })
    })
    .await;
    until("a repeated Warning patched into its series", WAIT, || {
        checked(fake, "patch", "events")
    })
    .await;

    // The pod goes, and kube-controller-manager's resourceclaim controller drops its
    // reservation (`pkg/controller/resourceclaim/controller.go`, `Controller.syncClaim`).
    fake.remove(&format!("{PODS}/train"));
    if let Some(mut unreserved) = fake.get(&format!("{CLAIMS}/train")) {
        if let Some(status) = unreserved["status"].as_object_mut() {
            status.remove("reservedFor");
        }
        fake.insert(unreserved);
    }
    until("claim train deallocated and released", WAIT, || {
        fake.get(&format!("{CLAIMS}/train")).is_some_and(|c| {
            !allocated(&c)
                && c["metadata"]["finalizers"]
                    .as_array()
                    .is_none_or(|f| !f.iter().any(|f| f == FINALIZER))
        })
    })
    .await;
}

/// A user's claim of `count` slices of the controller class.
fn claim(fake: &FakeApi, name: &str, count: u32) {
    let parameters = json!({
        "apiVersion": "gpu.kerf.dev/v1alpha1",
        "kind": "GpuClaimParameters",
        "memory": "10Gi",
        "compute": 10,
    });
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": common::NAMESPACE},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {
                "deviceClassName": CONTROLLER_CLASS, "count": count, "allocationMode": "ExactCount",
            }}],
            "config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}],
        }},
    }));
}

/// An unscheduled pod `name` using `claim`, created with kerf's scheduling gate as the
/// webhook adds it.
fn pod(fake: &FakeApi, name: &str, claim: &str) {
    fake.insert(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": common::NAMESPACE},
        "spec": {
            "containers": [{"name": "main", "image": "busybox"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "schedulingGates": [{"name": SCHEDULING_GATE}],
        },
        "status": {"phase": "Pending"},
    }));
}

/// The flags `deploy/helm/kerf/templates/controller.yaml` sets, with timings short enough for a test.
fn config() -> Config {
    let settings = ClaimSettings {
        unplaceable_retry: Duration::from_millis(200),
        pending_retry: Duration::from_millis(100),
        ownership: OwnershipTiming {
            settle: Duration::from_millis(50),
            linger: Duration::from_secs(1),
        },
        ownership_tick: Duration::from_millis(20),
        ..ClaimSettings::default()
    };
    Config {
        controller: ControllerConfig {
            backoff: BackoffConfig {
                base: Duration::from_millis(50),
                max: Duration::from_secs(1),
            },
            claims: settings,
            ..ControllerConfig::new(DRIVER)
        },
        leader_election: Some(LeaseConfig::new(
            "kerf-controller",
            KERF_NAMESPACE,
            "replica-a",
        )),
        metrics_address: None,
    }
}

/// The webhook with its self-signed certificate, on `port`.
fn webhook(port: u16) -> WebhookConfig {
    WebhookConfig {
        address: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        driver_name: DRIVER.to_owned(),
        field_manager: FIELD_MANAGER.to_owned(),
        certificates: Certificates::SelfSigned(SelfSigned {
            service: "kerf-webhook".to_owned(),
            namespace: KERF_NAMESPACE.to_owned(),
            webhook_configurations: WEBHOOK_CONFIGURATIONS.map(str::to_owned).to_vec(),
            validating_configurations: vec![super::quota_flow::QUOTA_CONFIGURATION.to_owned()],
            validity: Duration::from_secs(3600),
            renew_before: Duration::from_secs(600),
        }),
    }
}
