//! Cluster e2e for the Helm chart (deploy/helm/kerf): `helm install` on a cluster without kerf
//! runs a slice pod to completion, `helm upgrade` with changed values rolls kerf's pods while a
//! running MPS client keeps running, and `helm uninstall` leaves no object of the release but
//! the CRDs.
//!
//! Run them on their own, on a cluster where kerf is not installed or installed by the Helm
//! release `kerf` in kerf-system: `KUBECONFIG=… cargo test -p kerf-tests --test e2e helm:: --
//! --ignored --test-threads=1` (and the rest of the suite with `--skip helm::`). Each test
//! installs the release first when it is missing, and the uninstall test installs it again
//! after its checks, so kerf stays installed by Helm. A kerf installed otherwise (`kubectl
//! apply -f deploy/kerf-mock.yaml`, processes on the nodes) fails the tests at once: Helm
//! refuses to take over objects it did not make. Needs `helm` (`KERF_E2E_HELM`), `kubectl`
//! (`KERF_E2E_KUBECTL`), the values in `KERF_E2E_HELM_SET` (default: mock GPUs and the image
//! `kerf:dev`, which must be on the nodes).

use std::path::PathBuf;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use kube::{Api, ResourceExt as _};

use crate::cluster::{self, TestEnv};
use crate::daemon_checks::KERF_NAMESPACE;
use crate::daemon_pods;
use crate::install_and_parameters;
use crate::mps_daemons;

/// The release the tests install, upgrade and uninstall.
const RELEASE: &str = "kerf";
/// What uninstalling leaves: the CRDs, which Helm never deletes.
const CRDS: [&str; 2] = ["gpuclasses.gpu.kerf.dev", "gpuquotas.gpu.kerf.dev"];
/// Kinds the chart renders, for the check that none of the release's objects is left.
const RELEASE_KINDS: &str = "deployments,daemonsets,services,serviceaccounts,configmaps,roles,\
rolebindings,clusterroles,clusterrolebindings,mutatingwebhookconfigurations,\
validatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings";

/// `helm install` on a cluster without kerf: the release's workloads become ready (`--wait`),
/// the controller creates the default class `slice.gpu.kerf.dev`, and a pod with a 10Gi / 25 %
/// slice of it runs to `Succeeded` with the slice's limits in its container.
#[tokio::test]
#[ignore = "needs a cluster; run helm:: alone (see the module doc)"]
async fn helm_install_runs_a_slice_pod() -> Result<()> {
    cluster::e2e_installing_kerf("helm-install", |env: TestEnv| {
        Box::pin(async move {
            ensure_release(&env).await?;
            install_and_parameters::wait_default_class(&env).await?;
            install_and_parameters::run_default_slice_pod(&env).await
        })
    })
    .await
}

/// `helm upgrade` with changed values (a new log level) rolls the controller and the kubelet
/// plugin, and an MPS client that ran before keeps running unrestarted, with the same MPS
/// daemon pod and its pipe's `control` socket.
#[tokio::test]
#[ignore = "needs a cluster; run helm:: alone (see the module doc)"]
async fn helm_upgrade_keeps_a_running_mps_client() -> Result<()> {
    cluster::e2e_installing_kerf("helm-upgrade", |env: TestEnv| {
        Box::pin(async move {
            ensure_release(&env).await?;
            let class = mps_daemons::mps_class(&env, "helm-upgrade").await?;
            let (client, daemon) = mps_daemons::run_mps_pod(&env, &class, "client").await?;
            let old_plugin = daemon_pods::plugin_pod(&env, &client.node).await?;
            let level = if release_values(&env).await?.contains("logLevel: debug") {
                "info"
            } else {
                "debug"
            };
            helm(
                &env,
                &upgrade_args(&env, &["--reuse-values", "--set", &format!("logLevel={level}")]),
            )
            .await?;
            let new_plugin = daemon_pods::plugin_pod(&env, &client.node).await?;
            ensure!(
                new_plugin.uid() != old_plugin.uid(),
                "the upgrade changed the plugin's pod template, yet node {} still runs plugin pod {}",
                client.node,
                old_plugin.name_any()
            );
            daemon_pods::hold_still(
                &env,
                &client.node,
                &client.uuid,
                &daemon,
                &[client.name.as_str()],
                mps_daemons::ADOPTION_WINDOW,
            )
            .await?;
            mps_daemons::workload_intact(&env, &client.name).await?;
            daemon_pods::wait_pipe_control(&env, &client.name).await?;
            Ok(())
        })
    })
    .await
}

/// `helm uninstall` removes every object of the release and keeps the CRDs (Helm never
/// deletes CRDs); the release is installed again afterwards.
#[tokio::test]
#[ignore = "needs a cluster; run helm:: alone (see the module doc)"]
async fn helm_uninstall_leaves_only_the_crds() -> Result<()> {
    cluster::e2e_installing_kerf("helm-uninstall", |env: TestEnv| {
        Box::pin(async move {
            ensure_release(&env).await?;
            helm(
                &env,
                &[
                    "uninstall",
                    RELEASE,
                    "--namespace",
                    KERF_NAMESPACE,
                    "--wait",
                ],
            )
            .await?;
            let selector = format!("app.kubernetes.io/instance={RELEASE}");
            let left = daemon_pods::kubectl(
                &env,
                &[
                    "get",
                    RELEASE_KINDS,
                    "--all-namespaces",
                    "-l",
                    &selector,
                    "-o",
                    "name",
                ],
            )
            .await?;
            ensure!(
                left.trim().is_empty(),
                "helm uninstall left objects of the release:\n{left}"
            );
            for crd in CRDS {
                daemon_pods::kubectl(&env, &["get", "crd", crd, "-o", "name"])
                    .await
                    .with_context(|| format!("the CRD {crd} is gone after helm uninstall"))?;
            }
            ensure_release(&env).await
        })
    })
    .await
}

/// Installs the release when it is missing (`helm upgrade --install --wait`); fails when kerf
/// runs in kerf-system without being the release's.
async fn ensure_release(env: &TestEnv) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(env.client.clone(), KERF_NAMESPACE);
    if let Some(controller) = deployments.get_opt("kerf-controller").await? {
        let release = controller
            .annotations()
            .get("meta.helm.sh/release-name")
            .cloned();
        if release.as_deref() != Some(RELEASE) {
            bail!(
                "kerf runs in {KERF_NAMESPACE} but not from the Helm release {RELEASE} \
                 (release annotation {release:?}); run the helm tests on a cluster without kerf"
            );
        }
    }
    helm(
        env,
        &upgrade_args(env, &["--install", "--create-namespace"]),
    )
    .await?;
    Ok(())
}

/// `helm upgrade RELEASE CHART` with the suite's values, `extra`, and a wait for the rollout.
fn upgrade_args(env: &TestEnv, extra: &[&str]) -> Vec<String> {
    let timeout = format!("{}s", env.settings.timeout.as_secs() * 2);
    let mut args: Vec<String> = [
        "upgrade",
        RELEASE,
        &chart().display().to_string(),
        "--namespace",
        KERF_NAMESPACE,
        "--set",
        &env.settings.helm_set,
        "--wait",
        "--timeout",
        &timeout,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// The values of the installed release (`helm get values`).
async fn release_values(env: &TestEnv) -> Result<String> {
    helm(
        env,
        &["get", "values", RELEASE, "--namespace", KERF_NAMESPACE],
    )
    .await
}

/// The chart in this checkout.
fn chart() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/kerf")
}

/// Runs helm with `args` and returns its standard output; fails with its output when it fails.
async fn helm(
    env: &TestEnv,
    args: &[impl AsRef<std::ffi::OsStr> + std::fmt::Debug],
) -> Result<String> {
    let output = tokio::process::Command::new(&env.settings.helm)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {} (set KERF_E2E_HELM)", env.settings.helm))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("[helm] {args:?}:\n{stdout}{stderr}");
    if !output.status.success() {
        bail!(
            "helm {args:?} failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
    }
    Ok(stdout)
}
