//! kerf's own pods, for the MPS daemon tests (tests/tests/e2e/mps_daemons.rs): the
//! kubelet plugin pod of a node and the MPS control daemon pod of a GPU, both in
//! [`KERF_NAMESPACE`], read through the API; and the kubectl the tests run (`exec`, `rollout`).
//!
//! Unlike the rest of the suite these tests look at kerf's pods, so they need kerf deployed
//! from `deploy/` (`deploy/kerf-mock.yaml` or the chart with mock GPUs) with MPS daemons in pods
//! (`--mps-daemons=pod`). What they conclude from what they read is in daemon_checks.rs.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt as _};
use tokio::time::Instant;

use super::cluster::{TestEnv, describe_pod};
use super::daemon_checks::{
    DAEMON_RESTARTED, DaemonIdentity, KERF_NAMESPACE, PIPE_SCRIPT, PLUGIN_DAEMON_SET,
    PLUGIN_LABELS, PipeCheck, TEST_CONTAINER, daemon_labels, is_ready, live, only_daemon,
};
use super::wait::{self, POLL_INTERVAL, Poll};

/// kerf's pods in [`KERF_NAMESPACE`] with `labels` on `node`, deleting ones included.
pub async fn kerf_pods(env: &TestEnv, labels: &str, node: &str) -> Result<Vec<Pod>> {
    let params = ListParams::default()
        .labels(labels)
        .fields(&format!("spec.nodeName={node}"));
    Ok(Api::<Pod>::namespaced(env.client.clone(), KERF_NAMESPACE)
        .list(&params)
        .await
        .with_context(|| format!("listing pods {labels} on node {node} in {KERF_NAMESPACE}"))?
        .items)
}

/// The daemon of GPU `uuid` on `node` now (see [`only_daemon`]).
///
/// # Errors
/// As [`only_daemon`], or the list failed.
pub async fn daemon(env: &TestEnv, node: &str, uuid: &str) -> Result<DaemonIdentity> {
    only_daemon(
        &kerf_pods(env, &daemon_labels(uuid), node).await?,
        node,
        uuid,
    )
}

/// Waits until the daemon of GPU `uuid` on `node` runs and `accept`s it (`what` says what is
/// awaited).
pub async fn wait_daemon(
    env: &TestEnv,
    node: &str,
    uuid: &str,
    what: &str,
    accept: impl Fn(&DaemonIdentity) -> bool,
) -> Result<DaemonIdentity> {
    wait::poll_until(
        format_args!("the MPS daemon of GPU {uuid} on node {node} to be {what}"),
        env.settings.timeout,
        || async {
            Ok(match daemon(env, node, uuid).await {
                Ok(identity) if accept(&identity) => Poll::Ready(identity),
                Ok(identity) => Poll::Pending(format!("still {identity}")),
                Err(error) => Poll::Pending(format!("{error:#}")),
            })
        },
    )
    .await
}

/// Watches for `window` that the daemon of GPU `uuid` on `node` stays `before` and that none
/// of `claims` gets a [`DAEMON_RESTARTED`] Event; fails at the first sign of either.
///
/// A bounded observation, not a wait for something to happen: a plugin that adopts the daemon
/// changes nothing, so there is no event to wait for, and a plugin that would replace it does
/// so at one of its checks (every 5 s by default), which the window spans several times.
pub async fn hold_still(
    env: &TestEnv,
    node: &str,
    uuid: &str,
    before: &DaemonIdentity,
    claims: &[&str],
    window: Duration,
) -> Result<()> {
    let deadline = Instant::now() + window;
    // API calls that fail are looked at again; only a look that succeeds after the window
    // ends it, and failures past the suite's timeout fail it.
    let give_up = deadline + env.settings.timeout;
    loop {
        match look_still(env, node, uuid, before, claims).await {
            Ok(Some(change)) => bail!("{change}"),
            Ok(None) if Instant::now() >= deadline => return Ok(()),
            Err(error) if Instant::now() >= give_up => {
                return Err(error.context(format!(
                    "watching the MPS daemon of GPU {uuid} on node {node}"
                )));
            }
            Ok(None) | Err(_) => {}
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// One look for [`hold_still`]: `Some` change of the daemon or Event on a claim, `None` when
/// all is as `before`; `Err` when an API call failed.
async fn look_still(
    env: &TestEnv,
    node: &str,
    uuid: &str,
    before: &DaemonIdentity,
    claims: &[&str],
) -> Result<Option<String>> {
    let pods = kerf_pods(env, &daemon_labels(uuid), node).await?;
    let now = match only_daemon(&pods, node, uuid) {
        Ok(now) => now,
        Err(error) => {
            return Ok(Some(format!(
                "the MPS daemon of GPU {uuid} did not stay {before}: {error:#}"
            )));
        }
    };
    let changes = before.changes(&now);
    if !changes.is_empty() {
        return Ok(Some(format!(
            "the MPS daemon of GPU {uuid} was replaced: {}",
            changes.join("; ")
        )));
    }
    for claim in claims {
        let events = env.events_about("ResourceClaim", claim).await?;
        if let Some(event) = events
            .iter()
            .find(|e| e.reason.as_deref() == Some(DAEMON_RESTARTED))
        {
            return Ok(Some(format!(
                "claim {claim} got a {DAEMON_RESTARTED} Event: {}",
                event.message.as_deref().unwrap_or_default()
            )));
        }
    }
    Ok(None)
}

/// Fails if there is an Event with `reason` about `kind`/`name` in the test's namespace.
pub async fn expect_no_event(env: &TestEnv, kind: &str, name: &str, reason: &str) -> Result<()> {
    let events = env.events_about(kind, name).await?;
    if let Some(event) = events.iter().find(|e| e.reason.as_deref() == Some(reason)) {
        bail!(
            "{kind} {name} got a {} Event {reason}: {}",
            event.type_.as_deref().unwrap_or_default(),
            event.message.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// The one plugin pod of `node`, once it is Ready (before the test disturbs it).
pub async fn plugin_pod(env: &TestEnv, node: &str) -> Result<Pod> {
    wait::poll_until(
        format_args!("one Ready kerf plugin pod on node {node}"),
        env.settings.timeout,
        || async {
            let pods = kerf_pods(env, PLUGIN_LABELS, node).await?;
            Ok(match live(&pods).as_slice() {
                [pod] if is_ready(pod) => Poll::Ready((*pod).clone()),
                seen => Poll::Pending(format!(
                    "plugin pods on the node: {:?}",
                    seen.iter().map(|p| describe_pod(p)).collect::<Vec<_>>()
                )),
            })
        },
    )
    .await
}

/// Waits until the plugin pod `old_uid` of `node` is gone and another one there is Ready.
pub async fn wait_plugin_replaced(
    env: &TestEnv,
    node: &str,
    old_uid: &str,
    bound: Duration,
) -> Result<Pod> {
    wait::poll_until(
        format_args!("plugin pod {old_uid} on node {node} to be gone and a new one Ready"),
        bound,
        || async {
            let pods = kerf_pods(env, PLUGIN_LABELS, node).await?;
            let old_left = pods.iter().any(|p| p.uid().as_deref() == Some(old_uid));
            let new_ready = live(&pods)
                .into_iter()
                .find(|p| p.uid().as_deref() != Some(old_uid) && is_ready(p));
            Ok(match new_ready {
                Some(pod) if !old_left => Poll::Ready(pod.clone()),
                _ => Poll::Pending(format!(
                    "plugin pods on the node: {:?}",
                    pods.iter().map(describe_pod).collect::<Vec<_>>()
                )),
            })
        },
    )
    .await
}

/// Waits until `node` has a plugin pod other than `old_uid` (created by a roll). Returns it and
/// whether the old pod was still there, not yet deleted, when the new one was seen.
pub async fn wait_surge(
    env: &TestEnv,
    node: &str,
    old_uid: &str,
    bound: Duration,
) -> Result<(Pod, bool)> {
    wait::poll_until(
        format_args!("the roll to create a new plugin pod on node {node}"),
        bound,
        || async {
            let pods = kerf_pods(env, PLUGIN_LABELS, node).await?;
            let live_pods = live(&pods);
            let old_running = live_pods
                .iter()
                .any(|p| p.uid().as_deref() == Some(old_uid));
            Ok(
                match live_pods
                    .into_iter()
                    .find(|p| p.uid().as_deref() != Some(old_uid))
                {
                    Some(pod) => Poll::Ready((pod.clone(), old_running)),
                    None => Poll::Pending(format!(
                        "plugin pods on the node: {:?}",
                        pods.iter().map(describe_pod).collect::<Vec<_>>()
                    )),
                },
            )
        },
    )
    .await
}

/// The plugin's DaemonSet.
pub async fn plugin_daemon_set(env: &TestEnv) -> Result<DaemonSet> {
    Api::<DaemonSet>::namespaced(env.client.clone(), KERF_NAMESPACE)
        .get(PLUGIN_DAEMON_SET)
        .await
        .with_context(|| {
            format!(
                "reading DaemonSet {KERF_NAMESPACE}/{PLUGIN_DAEMON_SET}: the test needs kerf deployed from deploy/"
            )
        })
}

/// Runs the suite's kubectl (`KERF_E2E_KUBECTL`, same `KUBECONFIG`) with `args`; returns its
/// stdout, or fails with both outputs.
pub async fn kubectl(env: &TestEnv, args: &[&str]) -> Result<String> {
    let kubectl = &env.settings.kubectl;
    let output = tokio::process::Command::new(kubectl)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {kubectl} (set KERF_E2E_KUBECTL)"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "{kubectl} {} failed ({}):\n{stdout}\n{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(stdout)
}

/// Waits until test pod `pod`'s `CUDA_MPS_PIPE_DIRECTORY` holds the daemon's `control` socket,
/// looked at with `kubectl exec` in its container (the test image has a shell).
pub async fn wait_pipe_control(env: &TestEnv, pod: &str) -> Result<PipeCheck> {
    wait::poll_until(
        format_args!("pod {pod}'s CUDA_MPS_PIPE_DIRECTORY to hold the daemon's control socket"),
        env.settings.timeout,
        || async {
            let args = [
                "exec",
                "--namespace",
                env.namespace.as_str(),
                pod,
                "--container",
                TEST_CONTAINER,
                "--",
                "sh",
                "-c",
                PIPE_SCRIPT,
            ];
            let check = PipeCheck::parse(&kubectl(env, &args).await?)?;
            Ok(match check.problem() {
                None => Poll::Ready(check),
                Some(problem) => Poll::Pending(problem),
            })
        },
    )
    .await
}
