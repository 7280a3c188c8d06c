//! Cluster e2e for MPS daemon pods: MPS control daemons run in pods of their own (one per GPU, in
//! kerf-system, created by the kubelet plugin), so deleting, rolling or OOM-killing the plugin
//! leaves every running MPS workload's daemon alone, prepares succeed while the DaemonSet
//! rolls, and a daemon that really dies is started again and reported on its claims.
//!
//! Every cluster test is `#[ignore = "needs cluster"]`; run them with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e mps_daemons:: -- --ignored`. Unlike the
//! rest of the suite (tests/tests/e2e/main.rs, whose helpers in tests/tests/e2e/ these share) they look
//! at kerf's own pods, so kerf must be deployed from deploy/ (`kubectl apply -f
//! deploy/kerf-mock.yaml` or the chart with `gpus.source=mock`) with `--mps-daemons=pod`; the rolling-update
//! test also needs the DaemonSet to roll with `maxSurge: 1, maxUnavailable: 0`, and `kubectl`
//! (`KERF_E2E_KUBECTL`) with the suite's `KUBECONFIG`. They disturb kerf on one node (delete or
//! roll its plugin, delete an MPS daemon pod), which kerf repairs by itself; run them where
//! nothing else uses kerf's MPS slices on that node.
//!
//! Every wait is for a condition, bounded by `KERF_E2E_TIMEOUT` (rollouts by a minute per
//! node); "the daemon stays the same" is a bounded observation spanning several of the
//! plugin's daemon checks. The test's pods and claims live in its namespace, which the suite's
//! guard deletes also when an assertion fails.

use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use kerf_api::GpuClassSpec;
use kerf_api::params::SharingConfig;
use kerf_core::enforcement::Enforcement;
use kerf_core::sharing::Sharing;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use serde_json::json;

use crate::checks;
use crate::cluster;
use crate::cluster::{PodState, TestEnv, e2e};
use crate::daemon_checks;
use crate::daemon_checks::{DAEMON_RESTARTED, DaemonIdentity, FAILED_PREPARE, KERF_NAMESPACE};
use crate::daemon_pods;
use crate::expect::{controller_node, pod_node, single_result};
use crate::manifests;
use crate::manifests::{PodClaim, Script};
use crate::wait;
use crate::wait::Poll;

/// Memory of each test slice.
const SLICE_MEMORY: &str = "10Gi";
/// Compute of each test slice, in percent.
const SLICE_COMPUTE: u8 = 25;
/// How long a daemon must stay the same after the plugin came back: four of the plugin's
/// daemon checks at their default interval (`--mps-check-interval`, 5 s).
pub(crate) const ADOPTION_WINDOW: Duration = Duration::from_secs(20);

/// A Running test pod with one MPS slice, and where its slice is.
#[derive(Debug, Clone)]
pub(crate) struct MpsPod {
    /// The pod's name, also its claim's.
    pub(crate) name: String,
    /// The node kerf's controller allocated the claim on, where the pod runs.
    pub(crate) node: String,
    /// The allocated device (`gpu-<minor>`).
    pub(crate) device: String,
    /// The GPU's UUID: the daemon pod's `gpu.kerf.dev/gpu` label.
    pub(crate) uuid: String,
}

/// A deleted plugin pod (a rollout, an OOM kill or a node-agent upgrade does the same) leaves
/// the running MPS workload's daemon pod alone: the same pod UID, container and restart count
/// once the replacement plugin is Ready and for several of its daemon checks after, no
/// `MpsDaemonRestarted` Event, the workload still Running unrestarted and its
/// `CUDA_MPS_PIPE_DIRECTORY` still holding the daemon's `control` socket. Once the workload
/// pod is gone, the daemon of a GPU nothing else uses goes too.
#[tokio::test]
#[ignore = "needs cluster"]
async fn plugin_pod_deletion_keeps_running_mps_daemons() -> Result<()> {
    e2e("mps-plugin-deleted", |env: TestEnv| async move {
        let class = mps_class(&env, "mps-plugin-deleted").await?;
        let (first, before) = run_mps_pod(&env, &class, "first").await?;
        let plugin = daemon_pods::plugin_pod(&env, &first.node).await?;
        let plugin_uid = plugin.uid().context("the plugin pod has no UID")?;
        eprintln!(
            "[mps-plugin-deleted] deleting plugin pod {} on {}",
            plugin.name_any(),
            first.node
        );
        kerf_pods_api(&env)
            .delete(&plugin.name_any(), &DeleteParams::default())
            .await
            .with_context(|| format!("deleting plugin pod {}", plugin.name_any()))?;
        let replacement =
            daemon_pods::wait_plugin_replaced(&env, &first.node, &plugin_uid, env.settings.timeout)
                .await?;
        eprintln!(
            "[mps-plugin-deleted] plugin pod {} is Ready",
            replacement.name_any()
        );
        daemon_pods::hold_still(
            &env,
            &first.node,
            &first.uuid,
            &before,
            &[&first.name],
            ADOPTION_WINDOW,
        )
        .await?;
        workload_intact(&env, &first.name).await?;
        daemon_pods::wait_pipe_control(&env, &first.name).await?;
        env.delete_pod(&first.name).await?;
        daemon_left_behind(&env, &first).await
    })
    .await
}

/// A DaemonSet rolling update (`kubectl rollout restart`) with an MPS workload running: a
/// second MPS pod, allocated before the roll and let go to the node as soon as the roll
/// creates the node's new plugin pod (while the old one still runs, with `maxSurge: 1,
/// maxUnavailable: 0`), is prepared without a `FailedPrepareDynamicResources` Event and runs;
/// once the rollout is done the node runs a new plugin pod, the first workload's daemon pod is
/// the same (UID, container, restart count) and stays so, neither claim got
/// `MpsDaemonRestarted`, and both pods run unrestarted, each reaching its daemon's socket.
#[tokio::test]
#[ignore = "needs cluster"]
async fn rolling_update_keeps_mps_daemons_and_prepares_during_the_roll() -> Result<()> {
    // Boxed: the body's future is large (clippy::large_futures).
    e2e("mps-rolling-update", |env: TestEnv| {
        Box::pin(rolling_update(env))
    })
    .await
}

/// The body of `rolling_update_keeps_mps_daemons_and_prepares_during_the_roll`.
async fn rolling_update(env: TestEnv) -> Result<()> {
    let bound = seamless_rollout_bound(&env).await?;
    let class = mps_class(&env, "mps-rolling-update").await?;
    let (first, before) = run_mps_pod(&env, &class, "first").await?;
    // Allocated now and held by its gate, so that once the roll starts only binding, the
    // kubelet's admission and the prepare are left.
    create_mps_pod(&env, &class, "second", Some(&first.node), true).await?;
    env.wait_claim(
        "second",
        "allocated by kerf's controller",
        checks::is_allocated,
    )
    .await?;
    let old_plugin = daemon_pods::plugin_pod(&env, &first.node).await?;
    let old_uid = old_plugin.uid().context("the plugin pod has no UID")?;
    roll_and_prepare(&env, &first.node, &old_uid, bound).await?;
    let timeout = format!("--timeout={}s", bound.as_secs());
    daemon_pods::kubectl(
        &env,
        &[
            "rollout",
            "status",
            "daemonset/kerf-kubelet-plugin",
            "--namespace",
            KERF_NAMESPACE,
            &timeout,
        ],
    )
    .await?;
    let second = mps_pod_facts(&env, "second").await?;
    daemon_pods::expect_no_event(&env, "Pod", &second.name, FAILED_PREPARE).await?;
    let new_plugin = daemon_pods::plugin_pod(&env, &first.node).await?;
    ensure!(
        new_plugin.uid().as_deref() != Some(old_uid.as_str()),
        "the rollout finished but node {} still runs plugin pod {} (UID {old_uid})",
        first.node,
        old_plugin.name_any()
    );
    let claims = [first.name.as_str(), second.name.as_str()];
    daemon_pods::hold_still(
        &env,
        &first.node,
        &first.uuid,
        &before,
        &claims,
        ADOPTION_WINDOW,
    )
    .await?;
    for pod in [&first, &second] {
        workload_intact(&env, &pod.name).await?;
        daemon_pods::wait_pipe_control(&env, &pod.name).await?;
    }
    Ok(())
}

/// How long the plugin's rollout may take; fails unless its DaemonSet rolls a node with the
/// old and the new plugin side by side.
async fn seamless_rollout_bound(env: &TestEnv) -> Result<Duration> {
    let daemon_set = daemon_pods::plugin_daemon_set(env).await?;
    if let Some(problem) = daemon_checks::rolling_update_problem(&daemon_set) {
        bail!("DaemonSet {KERF_NAMESPACE}/kerf-kubelet-plugin cannot roll seamlessly: {problem}");
    }
    let desired = daemon_set
        .status
        .as_ref()
        .map_or(1, |s| s.desired_number_scheduled);
    Ok(daemon_checks::rollout_bound(env.settings.timeout, desired))
}

/// A daemon that dies is started again and reported. The daemon pod's image has no shell to
/// kill the daemon from, so the test kills it the other way the kubelet would: it deletes the
/// daemon pod. Within the plugin's check interval plus a daemon's start (both well inside the
/// wait's bound) a new daemon runs for the GPU (another pod, or the same one restarted), the
/// claim gets a Warning Event `MpsDaemonRestarted`, and the workload, still Running, sees the
/// new daemon's `control` socket at its `CUDA_MPS_PIPE_DIRECTORY` (so the CUDA processes the
/// Event asks to restart can connect).
#[tokio::test]
#[ignore = "needs cluster"]
async fn killed_mps_daemon_is_restarted_and_reported() -> Result<()> {
    e2e("mps-daemon-killed", |env: TestEnv| async move {
        let class = mps_class(&env, "mps-daemon-killed").await?;
        let (first, before) = run_mps_pod(&env, &class, "first").await?;
        eprintln!("[mps-daemon-killed] deleting {before}");
        kerf_pods_api(&env)
            .delete(&before.pod, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting daemon pod {}", before.pod))?;
        let after = daemon_pods::wait_daemon(
            &env,
            &first.node,
            &first.uuid,
            &format!("another than {before}"),
            |now| !before.changes(now).is_empty(),
        )
        .await?;
        eprintln!("[mps-daemon-killed] now {after}");
        let event = env
            .wait_event("ResourceClaim", &first.name, DAEMON_RESTARTED)
            .await?;
        ensure!(
            event.type_.as_deref() == Some("Warning"),
            "the {DAEMON_RESTARTED} Event is of type {:?}, not Warning: {:?}",
            event.type_,
            event.message
        );
        daemon_pods::wait_pipe_control(&env, &first.name).await?;
        workload_intact(&env, &first.name).await
    })
    .await
}

/// A class that requires its MPS server to hold its slices: the pod runs, and the claim's
/// status says both of its limits are held by the server, which the plugin gave the GPU's
/// daemon pod before the prepare returned.
#[tokio::test]
#[ignore = "needs cluster"]
async fn a_server_held_slice_reports_its_limits_held_by_the_server() -> Result<()> {
    e2e("mps-server-held", |env: TestEnv| async move {
        let spec = GpuClassSpec {
            sharing: Some(SharingConfig {
                strategy: Sharing::Mps,
                enforcement: Enforcement::Server,
                ..SharingConfig::default()
            }),
            ..manifests::controller_class_spec(None)
        };
        let class = env.gpu_class("mps-server-held", spec).await?;
        let (pod, _) = run_mps_pod(&env, &class, "held").await?;
        let driver = env.settings.driver.clone();
        let held = wait::poll_until(
            format_args!("claim held to report who holds its limits"),
            env.settings.timeout,
            || async {
                let claim = env.claim("held").await?;
                let entry = claim
                    .status
                    .as_ref()
                    .and_then(|s| s.devices.as_ref())
                    .and_then(|d| d.iter().find(|d| d.driver == driver))
                    .and_then(|d| d.data.as_ref())
                    .and_then(|data| data.0.get("limitsHeldBy").cloned());
                Ok(match entry {
                    Some(held) => Poll::Ready(held),
                    None => Poll::Pending("no limitsHeldBy in status.devices yet".into()),
                })
            },
        )
        .await?;
        ensure!(
            held == json!({"memory": "server", "compute": "server"}),
            "the slice on {} ({}) is held by {held}, not by its MPS server",
            pod.node,
            pod.uuid
        );
        workload_intact(&env, &pod.name).await
    })
    .await
}

/// A Controller GpuClass of MPS slices (as the chart's default `slice.gpu.kerf.dev`,
/// but the test's own, so the test does not depend on the defaults' current values).
pub(crate) async fn mps_class(env: &TestEnv, test: &str) -> Result<String> {
    let spec = GpuClassSpec {
        sharing: Some(SharingConfig {
            strategy: Sharing::Mps,
            ..SharingConfig::default()
        }),
        ..manifests::controller_class_spec(None)
    };
    env.gpu_class(test, spec).await
}

/// Creates claim `name` for one [`SLICE_MEMORY`] / [`SLICE_COMPUTE`] % slice of `class` and pod
/// `name` using it (restart policy `Always`, so a restart shows in its `restartCount`), pinned
/// to `node` when given and held by a scheduling gate with `hold`.
async fn create_mps_pod(
    env: &TestEnv,
    class: &str,
    name: &str,
    node: Option<&str>,
    hold: bool,
) -> Result<()> {
    let params = manifests::slice_parameters(SLICE_MEMORY, SLICE_COMPUTE)?;
    let spec = manifests::claim_spec(class, &env.settings.driver, Some(params), &[]);
    env.create(&manifests::resource_claim(name, spec)).await?;
    let mut pod_spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Claim(name),
        Script::ReportAndSleep,
        "Always",
    );
    if let Some(node) = node {
        pod_spec = manifests::pin_to_node(pod_spec, node);
    }
    env.create(&manifests::pod(name, pod_spec, hold)).await?;
    Ok(())
}

/// Waits until pod `name` runs and says where its slice is.
async fn mps_pod_facts(env: &TestEnv, name: &str) -> Result<MpsPod> {
    let pod = env.wait_pod(name, PodState::Running).await?;
    let claim = env.claim(name).await?;
    let node = controller_node(&claim)?;
    ensure!(
        pod_node(&pod) == Some(node.as_str()),
        "pod {name} runs on {:?}, not on {node} where its claim is allocated",
        pod_node(&pod)
    );
    let (pool, device) = single_result(&claim, &env.settings.driver)?;
    let gpu = env.published_device(&pool, &device).await?;
    Ok(MpsPod {
        name: name.to_owned(),
        node,
        device,
        uuid: gpu.uuid,
    })
}

/// Runs MPS pod `name` of `class` and returns it with its GPU's daemon, once the daemon runs
/// and the pod's `CUDA_MPS_PIPE_DIRECTORY` holds its `control` socket.
pub(crate) async fn run_mps_pod(
    env: &TestEnv,
    class: &str,
    name: &str,
) -> Result<(MpsPod, DaemonIdentity)> {
    create_mps_pod(env, class, name, None, false).await?;
    let pod = mps_pod_facts(env, name).await?;
    let daemon = daemon_pods::wait_daemon(env, &pod.node, &pod.uuid, "running", |_| true).await?;
    let pipe = daemon_pods::wait_pipe_control(env, name).await?;
    eprintln!(
        "[{name}] on {} {} ({}): {daemon}; pipe {} holds {:?}",
        pod.node, pod.device, pod.uuid, pipe.directory, pipe.entries
    );
    Ok((pod, daemon))
}

/// Restarts the plugin's DaemonSet and lets pod `second` go to `node` as soon as the roll has
/// created the node's new plugin pod (whose predecessor is `old_uid`).
async fn roll_and_prepare(env: &TestEnv, node: &str, old_uid: &str, bound: Duration) -> Result<()> {
    daemon_pods::kubectl(
        env,
        &[
            "rollout",
            "restart",
            "daemonset/kerf-kubelet-plugin",
            "--namespace",
            KERF_NAMESPACE,
        ],
    )
    .await?;
    let (surge, overlap) = daemon_pods::wait_surge(env, node, old_uid, bound).await?;
    env.api::<Pod>()
        .patch(
            "second",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": []}})),
        )
        .await
        .context("removing pod second's scheduling gate")?;
    // Whether the prepare fell into the overlap depends on how fast the node's kubelet was;
    // the message says what the test saw, the assertions hold either way.
    eprintln!(
        "[mps-rolling-update] new plugin pod {} on {node}; old plugin pod {}: pod second let go",
        surge.name_any(),
        if overlap {
            "still running"
        } else {
            "already gone"
        }
    );
    Ok(())
}

/// Fails unless pod `name` still runs with no container restarted.
pub(crate) async fn workload_intact(env: &TestEnv, name: &str) -> Result<()> {
    let pod = env.api::<Pod>().get(name).await?;
    daemon_checks::workload_intact(&pod)
}

/// After the last workload on `pod`'s GPU is gone (the pod deleted, so the kubelet has
/// unprepared its claim), its daemon pod goes too: the plugin stops a daemon no prepared claim
/// uses. Skipped, with a line saying so, when another claim in the cluster still holds that GPU.
async fn daemon_left_behind(env: &TestEnv, pod: &MpsPod) -> Result<()> {
    let others: Vec<String> = env
        .all_claims()
        .await?
        .iter()
        .filter(|c| {
            // The pod's own claim may not be deallocated yet; its prepare is undone already
            // (the kubelet unprepares before the pod object goes).
            let own = c.namespace().as_deref() == Some(env.namespace.as_str())
                && c.name_any() == pod.name;
            !own && checks::allocation_results(c, &env.settings.driver)
                .iter()
                .any(|r| r.pool == pod.node && r.device == pod.device)
        })
        .map(checks::describe_claim)
        .collect();
    if !others.is_empty() {
        eprintln!(
            "SKIPPED: the daemon's stop, because other claims hold {}/{}: {others:?}",
            pod.node, pod.device
        );
        return Ok(());
    }
    let labels = daemon_checks::daemon_labels(&pod.uuid);
    wait::poll_until(
        format_args!(
            "the MPS daemon pod of GPU {} to go once no claim uses it",
            pod.uuid
        ),
        env.settings.timeout,
        || async {
            let pods = daemon_pods::kerf_pods(env, &labels, &pod.node).await?;
            Ok(if pods.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending(format!(
                    "still there: {:?}",
                    pods.iter().map(cluster::describe_pod).collect::<Vec<_>>()
                ))
            })
        },
    )
    .await
}

/// The pods of kerf's namespace.
fn kerf_pods_api(env: &TestEnv) -> Api<Pod> {
    Api::namespaced(env.client.clone(), KERF_NAMESPACE)
}
