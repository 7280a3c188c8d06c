//! MPS control daemons as pods (`--mps-daemons=pod`), run by the pod runner (the kubelet's
//! pod lifecycle over FakeApi) with the fake tools: one pod per GPU made from the plugin's own
//! pod as `deploy/kerf.yaml` installs it; a plugin killed and restarted adopts it untouched; a
//! daemon that dies is restarted by the kubelet and reported on every claim of its GPU, also
//! when it happened while the plugin was down; a deleted daemon pod is created again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::mps::{
    CONTROL, MpsNode, PLUGIN_BINARY, assert_restarts_counted, kill_9, prepare, seen_through,
    unprepare,
};
use crate::common::plugin_pod::{IMAGE_PROGRAM, PLUGIN_POD, plugin_pod_from_manifest};
use crate::common::{GIB, NODE, uid};
use k8s_openapi::api::core::v1::Pod;
use kerf_kubelet_plugin::claim_reader::ApiClaimReader;
use kerf_kubelet_plugin::config::{MpsDaemonMode, OwnPod, PluginConfig};
use kerf_kubelet_plugin::mps_daemons::daemon_pod_name;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_proto::client::Claim;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod as KubeletPod};
use kerf_tests::pod_runner::{PodRunner, PodRunnerSettings};
use kerf_tests::wait::until;

const NAMESPACE: &str = kerf_tests::fake_api::KERF_NAMESPACE;

/// A node whose plugin runs MPS daemons as pods, which the pod runner runs.
struct PodNode {
    sharing: MpsNode,
    runner: Option<PodRunner>,
    plugin_pod: Pod,
}

impl PodNode {
    fn new() -> Self {
        let sharing = MpsNode::new();
        let plugin_pod = plugin_pod_from_manifest(NODE);
        sharing
            .node
            .api
            .insert(serde_json::to_value(&plugin_pod).unwrap());
        let runner = PodRunner::start(
            &sharing.node.api,
            NODE,
            BTreeMap::from([(IMAGE_PROGRAM.to_owned(), PathBuf::from(PLUGIN_BINARY))]),
            PodRunnerSettings {
                initial_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(1),
                ..PodRunnerSettings::default()
            },
        );
        PodNode {
            sharing,
            runner: Some(runner),
            plugin_pod,
        }
    }

    fn runner(&self) -> &PodRunner {
        self.runner.as_ref().unwrap()
    }

    fn config(&self) -> PluginConfig {
        PluginConfig {
            mps_daemons: MpsDaemonMode::Pod,
            mps_start_timeout: Duration::from_secs(20),
            own_pod: Some(OwnPod {
                name: PLUGIN_POD.to_owned(),
                namespace: NAMESPACE.to_owned(),
                uid: None,
            }),
            ..self.sharing.config()
        }
    }

    async fn start(&self) -> RunningPlugin {
        let client = self.sharing.node.plugin_client();
        let connections = Connections {
            mps_daemon_pods: Some(client.clone()),
            device_status: None,
            claim_reader: Arc::new(ApiClaimReader::new(client)),
            publisher: None,
            events: Arc::clone(&self.sharing.events) as _,
        };
        plugin::start(&self.config(), self.sharing.node.inventory(), connections)
            .await
            .unwrap()
    }

    fn daemon_pod(&self, gpu: &str) -> Option<Pod> {
        self.sharing
            .node
            .api
            .get_resource::<Pod>(Some(NAMESPACE), &daemon_pod_name(NODE, gpu))
    }

    /// The daemon pod's UID and its container's restart count.
    fn incarnation(&self, gpu: &str) -> Option<(String, i32)> {
        let pod = self.daemon_pod(gpu)?;
        let restarts = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|s| s.first())
            .map_or(0, |s| s.restart_count);
        Some((pod.metadata.uid.unwrap(), restarts))
    }

    /// The `nvidia-cuda-mps-control -f` starts recorded for `gpu`.
    fn foreground_starts(&self, gpu: &str) -> usize {
        self.sharing
            .calls()
            .into_iter()
            .filter(|c| c.tool == CONTROL && c.args == ["-f"])
            .filter(|c| c.env.get("CUDA_VISIBLE_DEVICES").map(String::as_str) == Some(gpu))
            .count()
    }

    fn diagnostics(&self, gpu: &str) -> String {
        format!(
            "pod: {:#?}\nlogs: {}\nproblems: {:?}",
            self.daemon_pod(gpu).map(|p| p.status),
            self.runner().logs(NAMESPACE, &daemon_pod_name(NODE, gpu)),
            self.runner().problems()
        )
    }
}

impl Drop for PodNode {
    fn drop(&mut self) {
        // The runner's processes die with it; the daemons are its containers' children.
        drop(self.runner.take());
    }
}

async fn prepare_all(plugin: &RunningPlugin, claims: &[&Claim]) {
    let results = prepare(plugin, claims).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

fn shm_mounts(on: &MpsNode, claim: &Claim) -> Vec<String> {
    let spec = on.node.cdi_spec(&claim.uid);
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|m| m["containerPath"] == "/dev/shm")
        .map(|m| m["hostPath"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_pod_per_gpu_made_from_the_plugins_pod_and_deleted_after_the_last_unprepare() {
    let on = PodNode::new();
    let sharing = &on.sharing;
    let plugin = on.start().await;
    let (gpu0, gpu1) = (sharing.gpu_uuid(0), sharing.gpu_uuid(1));
    let a = sharing.node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    let b = sharing.node.slice_claim("b", &uid(2), 0, 10 * GIB, 25);
    let c = sharing.node.slice_claim("c", &uid(3), 1, 10 * GIB, 25);
    prepare_all(&plugin, &[&a, &b]).await;
    prepare_all(&plugin, &[&c]).await;

    assert_eq!(on.foreground_starts(&gpu0), 1, "{}", on.diagnostics(&gpu0));
    assert_eq!(on.foreground_starts(&gpu1), 1, "{}", on.diagnostics(&gpu1));
    let pod = on.daemon_pod(&gpu0).unwrap();
    let spec = pod.spec.as_ref().unwrap();
    let plugin_spec = on.plugin_pod.spec.as_ref().unwrap();
    let (container, plugin_container) = (&spec.containers[0], &plugin_spec.containers[0]);
    assert_eq!(spec.node_name.as_deref(), Some(NODE));
    assert_eq!(spec.restart_policy.as_deref(), Some("Always"));
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some("kerf-mps-control-daemon")
    );
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(
        container.image, plugin_container.image,
        "the plugin's own image"
    );
    assert_eq!(
        container.security_context,
        plugin_container.security_context
    );
    assert_eq!(spec.security_context, plugin_spec.security_context);
    assert_eq!(
        container.command.as_deref(),
        Some(&[IMAGE_PROGRAM.to_owned()][..])
    );
    let labels = pod.metadata.labels.as_ref().unwrap();
    assert_eq!(labels["app.kubernetes.io/component"], "mps-control-daemon");
    assert_eq!(labels["gpu.kerf.dev/gpu"], gpu0);
    let requests = container
        .resources
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap();
    assert!(requests.contains_key("cpu") && requests.contains_key("memory"));
    assert_ne!(on.daemon_pod(&gpu1).unwrap().metadata.uid, pod.metadata.uid);

    // Its GPU's own /dev/shm, for the daemon and for its clients alike.
    let gpu_shm = sharing.mps_root().join(&gpu0).join("shm");
    assert_eq!(shm_mounts(sharing, &a), [gpu_shm.display().to_string()]);
    let unemulated = on.runner().unemulated_mounts();
    assert!(
        unemulated
            .iter()
            .any(|m| m.mount_path == "/dev/shm" && m.host_path == gpu_shm),
        "{unemulated:?}"
    );
    assert_ne!(
        shm_mounts(sharing, &a),
        shm_mounts(sharing, &c),
        "no /dev/shm across GPUs"
    );

    unprepare(&plugin, &a).await;
    assert!(on.daemon_pod(&gpu0).is_some(), "b still uses it");
    unprepare(&plugin, &b).await;
    assert!(
        on.daemon_pod(&gpu0).is_none(),
        "deleted after the last unprepare"
    );
    assert!(!sharing.mps_root().join(&gpu0).exists());
    let quits = sharing
        .calls()
        .into_iter()
        .filter(|c| c.tool == CONTROL && c.stdin.contains("quit"))
        .count();
    assert_eq!(
        quits,
        1,
        "the daemon was told to quit: {:#?}",
        sharing.calls()
    );
    unprepare(&plugin, &c).await;
    assert!(on.daemon_pod(&gpu1).is_none());
    assert!(sharing.events.warnings().is_empty());
    plugin.shutdown().await.unwrap();
}

/// The plugin as its own process in daemon-pod mode, so that it can be SIGKILLed.
fn spawn_plugin(on: &PodNode, kubeconfig: &Path, generation: u32) -> Child {
    on.sharing
        .plugin_command(kubeconfig, &generation.to_string(), &[])
        .arg("--mps-check-interval=100ms")
        .arg("--mps-daemons=pod")
        .arg(format!("--pod-name={PLUGIN_POD}"))
        .arg(format!("--pod-namespace={NAMESPACE}"))
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_and_restarted_adopts_the_running_daemon_pod_untouched() {
    let on = PodNode::new();
    let node = &on.sharing.node;
    let server = ApiServer::start(node.api.clone()).await.unwrap();
    let kubeconfig = node.root.join("kubeconfig");
    server
        .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(NODE))
        .unwrap();
    let gpu = on.sharing.gpu_uuid(0);
    let claim = node.slice_claim("running", &uid(1), 0, 10 * GIB, 25);

    let mut first = spawn_plugin(&on, &kubeconfig, 1);
    let kubelet = FakeKubelet::start(node.kubelet_config());
    kubelet
        .wait_for_registration(1, Duration::from_secs(10))
        .await
        .unwrap();
    let pod = KubeletPod::new("workload").with_claim(common::DRIVER, claim.clone());
    kubelet.prepare_pod(&pod).await.unwrap();
    let before = on.incarnation(&gpu).unwrap();
    let name = daemon_pod_name(NODE, &gpu);
    let pid = on.runner().pid(NAMESPACE, &name).unwrap();

    first.kill().unwrap();
    first.wait().unwrap();
    assert_eq!(
        on.runner().pid(NAMESPACE, &name),
        Some(pid),
        "the daemon outlives the plugin"
    );
    let mut second = spawn_plugin(&on, &kubeconfig, 2);
    kubelet
        .wait_for_registration(2, Duration::from_secs(10))
        .await
        .unwrap();
    // A few of the new plugin's daemon checks.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        on.incarnation(&gpu),
        Some(before),
        "{}",
        on.diagnostics(&gpu)
    );
    assert_eq!(on.runner().pid(NAMESPACE, &name), Some(pid));
    assert_eq!(on.foreground_starts(&gpu), 1, "adopted, not started again");
    assert!(
        node.api
            .warning_events("ResourceClaim", "running")
            .is_empty(),
        "nothing to report: the daemon never stopped"
    );

    kubelet.unprepare_pod(&pod).await.unwrap();
    until("the daemon pod deleted", Duration::from_secs(10), || {
        on.daemon_pod(&gpu).is_none()
    })
    .await;
    second.kill().unwrap();
    second.wait().unwrap();
}

fn kill_daemon(on: &PodNode, gpu: &str) {
    kill_9(on.sharing.daemon_pid(gpu).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_dies_is_restarted_by_the_kubelet_and_reported_on_each_claim() {
    let on = PodNode::new();
    let sharing = &on.sharing;
    let plugin = on.start().await;
    let gpu = sharing.gpu_uuid(0);
    let a = sharing.node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    let b = sharing.node.slice_claim("b", &uid(2), 0, 10 * GIB, 25);
    prepare_all(&plugin, &[&a, &b]).await;
    let (pod_uid, restarts) = on.incarnation(&gpu).unwrap();
    assert_eq!(restarts, 0);
    // As a running container's bind mount holds it.
    let mounted_pipe = std::fs::File::open(sharing.pipe(&gpu)).unwrap();

    kill_daemon(&on, &gpu);
    until(
        "the kubelet restarted the daemon",
        Duration::from_secs(10),
        || on.incarnation(&gpu) == Some((pod_uid.clone(), 1)),
    )
    .await;
    until(
        "a Warning Event on each claim",
        Duration::from_secs(10),
        || on.sharing.events.warnings().len() >= 2,
    )
    .await;
    on.sharing.assert_restart_warned(&gpu, &["a", "b"]);
    until(
        "the new daemon accepts clients",
        Duration::from_secs(10),
        || std::os::unix::net::UnixStream::connect(sharing.pipe(&gpu).join("control")).is_ok(),
    )
    .await;
    until(
        "the new daemon's socket in the pipe directory containers have mounted",
        Duration::from_secs(10),
        || seen_through(&mounted_pipe).join("control").exists(),
    )
    .await;
    assert_restarts_counted(&plugin, &gpu, 1);
    unprepare(&plugin, &a).await;
    unprepare(&plugin, &b).await;
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_restarted_while_the_plugin_was_down_is_reported_at_start_up() {
    let on = PodNode::new();
    let sharing = &on.sharing;
    let gpu = sharing.gpu_uuid(0);
    let a = sharing.node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    let plugin = on.start().await;
    prepare_all(&plugin, &[&a]).await;
    let (pod_uid, _) = on.incarnation(&gpu).unwrap();
    plugin.shutdown().await.unwrap();

    kill_daemon(&on, &gpu);
    until(
        "the kubelet restarted the daemon",
        Duration::from_secs(10),
        || on.incarnation(&gpu) == Some((pod_uid.clone(), 1)),
    )
    .await;
    let plugin = on.start().await;
    until(
        "a Warning Event at start-up",
        Duration::from_secs(10),
        || !on.sharing.events.warnings().is_empty(),
    )
    .await;
    on.sharing.assert_restart_warned(&gpu, &["a"]);
    assert_eq!(
        on.incarnation(&gpu),
        Some((pod_uid, 1)),
        "adopted, not replaced"
    );
    unprepare(&plugin, &a).await;
    plugin.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_daemon_pod_is_created_again_and_reported() {
    let on = PodNode::new();
    let sharing = &on.sharing;
    let plugin = on.start().await;
    let gpu = sharing.gpu_uuid(0);
    let a = sharing.node.slice_claim("a", &uid(1), 0, 10 * GIB, 25);
    prepare_all(&plugin, &[&a]).await;
    let (first_uid, _) = on.incarnation(&gpu).unwrap();

    let pods: kube::Api<Pod> = kube::Api::namespaced(sharing.node.api.client(), NAMESPACE);
    pods.delete(
        &daemon_pod_name(NODE, &gpu),
        &kube::api::DeleteParams::default(),
    )
    .await
    .unwrap();
    until("a new daemon pod", Duration::from_secs(15), || {
        on.incarnation(&gpu)
            .is_some_and(|(uid, _)| uid != first_uid)
    })
    .await;
    until("a Warning Event", Duration::from_secs(10), || {
        !on.sharing.events.warnings().is_empty()
    })
    .await;
    on.sharing.assert_restart_warned(&gpu, &["a"]);
    unprepare(&plugin, &a).await;
    assert!(on.daemon_pod(&gpu).is_none());
    plugin.shutdown().await.unwrap();
}
