//! The bodies of the cluster tests of installing and claim parameters: a controller-class claim created from JSON with
//! spaces, as Python's `json.dumps` writes it, through a raw request; and kerf installed with
//! `kubectl apply -f deploy/kerf-mock.yaml` alone, then a controller-class pod run to
//! completion.

use std::path::PathBuf;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::GpuClass;
use kube::Api;
use serde::Serialize as _;
use serde_json::{Value, json};

use super::checks::{self, ContainerReport};
use super::cluster::{PodState, TestEnv, describe_pod};
use super::expect::{self, controller_node, single_result};
use super::manifests::{self, CLAIM_REF, PodClaim, Script};
use super::wait::{self, Outcome, Poll};

/// Memory of the tests' slices.
const SLICE_MEMORY: &str = "10Gi";
/// [`SLICE_MEMORY`] in bytes.
const SLICE_BYTES: u64 = 10 << 30;
/// Compute of the tests' slices, in percent.
const SLICE_COMPUTE: u8 = 25;
/// What kerf sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to for one [`SLICE_MEMORY`] slice.
const SLICE_MPS_MEMORY_LIMIT: &str = "0=10240M";
/// The default Controller class kerf's controller creates from the chart's ConfigMap.
const DEFAULT_SLICE_CLASS: &str = "slice.gpu.kerf.dev";

/// JSON as Python's `json.dumps(value, sort_keys=True)` writes it: `", "` between items and
/// `": "` after keys, on one line. serde_json's compact output has no spaces and its pretty
/// output breaks lines, so neither is what a Python client sends.
#[derive(Debug, Default, Clone, Copy)]
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// `value` encoded as Python's `json.dumps(value, sort_keys=True)` encodes it (serde_json's
/// maps are sorted by key).
pub fn python_json(value: &Value) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    value.serialize(&mut serializer)?;
    Ok(out)
}

/// The claim of the spaced-JSON test, as a Python client builds it: one request of `class`
/// with a [`SLICE_MEMORY`] / [`SLICE_COMPUTE`] % slice for `driver`.
fn spaced_claim(name: &str, class: &str, driver: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": CLAIM_REF, "exactly": {"deviceClassName": class}}],
            "config": [{"requests": [CLAIM_REF], "opaque": {
                "driver": driver,
                "parameters": {
                    "apiVersion": kerf_api::API_VERSION,
                    "kind": "GpuClaimParameters",
                    "memory": SLICE_MEMORY,
                    "compute": SLICE_COMPUTE,
                },
            }}],
        }},
    })
}

/// See `spaced_json_claim_runs` in tests/tests/e2e/main.rs.
pub async fn spaced_json_claim(env: TestEnv) -> Result<()> {
    let driver = env.settings.driver.clone();
    let class = env
        .gpu_class("spaced", manifests::controller_class_spec(None))
        .await?;
    let body = python_json(&spaced_claim("spaced", &class, &driver))?;
    eprintln!("[spaced] body: {}", String::from_utf8_lossy(&body));
    let request = http::Request::post(format!(
        "/apis/resource.k8s.io/v1/namespaces/{}/resourceclaims",
        env.namespace
    ))
    .header(http::header::CONTENT_TYPE, "application/json")
    .body(body)?;
    let created: ResourceClaim = env
        .client
        .request(request)
        .await
        .context("creating ResourceClaim spaced from the spaced JSON body")?;
    ensure!(
        created.metadata.name.as_deref() == Some("spaced"),
        "the API server answered with another object: {}",
        checks::describe_claim(&created)
    );
    let pod_spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Claim("spaced"),
        Script::ReportAndSleep,
        "Never",
    );
    env.create(&manifests::pod("spaced", pod_spec, false))
        .await?;
    wait_running_showing_warnings(&env, "spaced").await?;
    let report = env.wait_report("spaced").await?;
    let claim = env.claim("spaced").await?;
    let node = controller_node(&claim)?;
    let (pool, device) = single_result(&claim, &driver)?;
    ensure!(
        pool == node,
        "the result names pool {pool} but the claim was allocated on node {node}"
    );
    let gpu = env.published_device(&pool, &device).await?;
    expect::one_slice(&claim, &driver, &gpu, SLICE_BYTES, SLICE_COMPUTE)?;
    expect::claim_devices(&report, &claim, &gpu)?;
    expect_slice_env(&report)
}

/// Waits until pod `name` (of claim `name`) runs; while it does not, the message carries the
/// pod and the Warning Events about the claim (kerf's controller says there why it does not
/// allocate); a pod that ends stops the wait.
async fn wait_running_showing_warnings(env: &TestEnv, name: &str) -> Result<Pod> {
    let pods = env.api::<Pod>();
    wait::fail_fast(
        format_args!("pod {name} to be Running with its claim allocated"),
        env.settings.timeout,
        || async {
            let pod = pods.get(name).await?;
            match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some("Running") => return Ok(Poll::Ready(pod)),
                Some("Succeeded" | "Failed") => {
                    return Err(Outcome::Stop(anyhow!(
                        "pod {name} ended: {}",
                        describe_pod(&pod)
                    )));
                }
                _ => {}
            }
            let warnings: Vec<String> = env
                .events_about("ResourceClaim", name)
                .await?
                .into_iter()
                .filter(|e| e.type_.as_deref() == Some("Warning"))
                .map(|e| {
                    format!(
                        "{}: {}",
                        e.reason.unwrap_or_default(),
                        e.message.unwrap_or_default()
                    )
                })
                .collect();
            let claim = checks::describe_claim(&env.claim(name).await?);
            Ok(Poll::Pending(format!(
                "{}; {claim}; Warning Events about the claim: {warnings:?}",
                describe_pod(&pod)
            )))
        },
    )
    .await
}

/// The slice limits kerf's CDI spec gives a container of one [`SLICE_MEMORY`] /
/// [`SLICE_COMPUTE`] % slice.
fn expect_slice_env(report: &ContainerReport) -> Result<()> {
    let compute = SLICE_COMPUTE.to_string();
    report.expect_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", &compute)?;
    report.expect_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", SLICE_MPS_MEMORY_LIMIT)?;
    report.expect_env("KERF_SLICE_MEMORY_BYTES", &SLICE_BYTES.to_string())?;
    report.expect_env("KERF_SLICE_COMPUTE_PERCENT", &compute)
}

/// deploy/kerf-mock.yaml, the one-file install for clusters without GPUs (the chart with
/// `gpus.source=mock` and the image `kerf:dev`).
pub fn install_manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kerf-mock.yaml")
}

/// The workloads of a manifest that must be ready once it is applied: `(kind, namespace,
/// name)` of each Deployment and DaemonSet.
pub fn workloads(manifest: &str) -> Result<Vec<(String, String, String)>> {
    let documents: Vec<Value> = serde_saphyr::from_multiple(manifest)
        .map_err(|e| anyhow!("the manifest does not parse: {e}"))?;
    Ok(documents
        .iter()
        .filter_map(|d| {
            let kind = d["kind"].as_str()?;
            if kind != "Deployment" && kind != "DaemonSet" {
                return None;
            }
            let meta = &d["metadata"];
            Some((
                kind.to_owned(),
                meta["namespace"].as_str().unwrap_or("default").to_owned(),
                meta["name"].as_str()?.to_owned(),
            ))
        })
        .collect())
}

/// See `kubectl_apply_installs_kerf` in tests/tests/e2e/main.rs.
pub async fn kubectl_apply_installs_kerf(env: TestEnv) -> Result<()> {
    let manifest = install_manifest();
    let text = std::fs::read_to_string(&manifest)
        .with_context(|| format!("reading {}", manifest.display()))?;
    let workloads = workloads(&text)?;
    kubectl_apply(&env.settings.kubectl, &manifest).await?;
    for (kind, namespace, name) in &workloads {
        match kind.as_str() {
            "Deployment" => wait_deployment(&env, namespace, name).await?,
            _ => wait_daemon_set(&env, namespace, name).await?,
        }
    }
    wait_default_class(&env).await?;
    run_default_slice_pod(&env).await
}

/// Runs `kubectl apply -f <manifest>`; fails with kubectl's output when it fails.
async fn kubectl_apply(kubectl: &str, manifest: &std::path::Path) -> Result<()> {
    let output = tokio::process::Command::new(kubectl)
        .arg("apply")
        .arg("-f")
        .arg(manifest)
        .output()
        .await
        .with_context(|| format!("running {kubectl} (set KERF_E2E_KUBECTL)"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!(
        "[install] kubectl apply -f {}:\n{stdout}",
        manifest.display()
    );
    if !output.status.success() {
        bail!(
            "kubectl apply -f {} failed ({}):\n{stdout}\n{stderr}",
            manifest.display(),
            output.status
        );
    }
    Ok(())
}

/// Waits until Deployment `namespace/name` has rolled out: every replica updated and ready
/// (as `kubectl rollout status` decides).
async fn wait_deployment(env: &TestEnv, namespace: &str, name: &str) -> Result<()> {
    let api: Api<Deployment> = Api::namespaced(env.client.clone(), namespace);
    wait::poll_until(
        format_args!("Deployment {namespace}/{name} to be ready"),
        env.settings.timeout,
        || async {
            let deployment = api.get(name).await?;
            let wanted = deployment
                .spec
                .as_ref()
                .and_then(|s| s.replicas)
                .unwrap_or(1);
            let generation = deployment.metadata.generation.unwrap_or_default();
            let status = deployment.status.unwrap_or_default();
            let done = status.observed_generation.unwrap_or_default() >= generation
                && status.updated_replicas.unwrap_or_default() == wanted
                && status.ready_replicas.unwrap_or_default() == wanted
                && status.replicas.unwrap_or_default() == wanted;
            Ok(if done {
                Poll::Ready(())
            } else {
                Poll::Pending(format!(
                    "{wanted} wanted, {} updated, {} ready, {} in all; conditions {:?}",
                    status.updated_replicas.unwrap_or_default(),
                    status.ready_replicas.unwrap_or_default(),
                    status.replicas.unwrap_or_default(),
                    status.conditions
                ))
            })
        },
    )
    .await
}

/// Waits until DaemonSet `namespace/name` runs an updated, ready pod on every node it
/// schedules to, and on one node at least.
async fn wait_daemon_set(env: &TestEnv, namespace: &str, name: &str) -> Result<()> {
    let api: Api<DaemonSet> = Api::namespaced(env.client.clone(), namespace);
    wait::poll_until(
        format_args!("DaemonSet {namespace}/{name} to be ready"),
        env.settings.timeout,
        || async {
            let daemon_set = api.get(name).await?;
            let generation = daemon_set.metadata.generation.unwrap_or_default();
            let status = daemon_set.status.unwrap_or_default();
            let wanted = status.desired_number_scheduled;
            let done = status.observed_generation.unwrap_or_default() >= generation
                && wanted > 0
                && status.updated_number_scheduled.unwrap_or_default() == wanted
                && status.number_ready == wanted;
            Ok(if done {
                Poll::Ready(())
            } else {
                Poll::Pending(format!(
                    "{wanted} wanted, {} updated, {} ready",
                    status.updated_number_scheduled.unwrap_or_default(),
                    status.number_ready
                ))
            })
        },
    )
    .await
}

/// Waits for the DeviceClass of the default Controller class, which kerf's controller creates
/// from the manifest's ConfigMap once the CRD is established.
pub async fn wait_default_class(env: &TestEnv) -> Result<()> {
    let device_classes: Api<DeviceClass> = Api::all(env.client.clone());
    let classes: Api<GpuClass> = Api::all(env.client.clone());
    wait::poll_until(
        format_args!("kerf's controller to create GpuClass and DeviceClass {DEFAULT_SLICE_CLASS}"),
        env.settings.timeout,
        || async {
            if device_classes.get_opt(DEFAULT_SLICE_CLASS).await?.is_some() {
                return Ok(Poll::Ready(()));
            }
            let class = classes.get_opt(DEFAULT_SLICE_CLASS).await?;
            Ok(Poll::Pending(format!(
                "no DeviceClass; GpuClass: {:?}",
                class.map(|c| c.status)
            )))
        },
    )
    .await
}

/// A 10Gi / 25 % slice of the default Controller class for a pod that reports and exits: the
/// pod Succeeds, kerf's controller allocated the claim (its `Allocated` Event) and the
/// container saw the slice's limits.
pub async fn run_default_slice_pod(env: &TestEnv) -> Result<()> {
    let driver = &env.settings.driver;
    let params = manifests::slice_parameters(SLICE_MEMORY, SLICE_COMPUTE)?;
    let spec = manifests::claim_spec(DEFAULT_SLICE_CLASS, driver, Some(params), &[]);
    env.create(&manifests::resource_claim("installed", spec))
        .await?;
    let pod_spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Claim("installed"),
        Script::ReportAndExit,
        "Never",
    );
    env.create(&manifests::pod("installed", pod_spec, false))
        .await?;
    env.wait_pod("installed", PodState::Succeeded).await?;
    let report = ContainerReport::parse(&env.logs("installed").await?)?;
    ensure!(
        report.gpu_nodes().len() == 1,
        "the container should see one GPU; it sees {:?}",
        report.gpu_nodes()
    );
    expect_slice_env(&report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_spaced_as_python_writes_it() {
        let body = python_json(&json!({"b": [1, "x", {}], "a": {"k": null, "j": []}})).unwrap();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"a": {"j": [], "k": null}, "b": [1, "x", {}]}"#
        );
        let claim = python_json(&spaced_claim("spaced", "cls", "gpu.kerf.dev")).unwrap();
        let text = String::from_utf8(claim).unwrap();
        assert!(
            text.starts_with(r#"{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "#),
            "{text}"
        );
        assert!(text.contains(r#""memory": "10Gi""#), "{text}");
        // The spaced body means the same claim as the compact one.
        let parsed: ResourceClaim = serde_json::from_str(&text).unwrap();
        let request = &parsed.spec.devices.unwrap().requests.unwrap()[0];
        assert_eq!(request.exactly.as_ref().unwrap().device_class_name, "cls");
    }

    #[test]
    fn the_install_manifest_names_the_controller_and_the_plugin() {
        let text = std::fs::read_to_string(install_manifest()).unwrap();
        let mut found = workloads(&text).unwrap();
        // Helm renders kinds in its install order; the test waits for each alike.
        found.sort();
        let expected = [
            ("DaemonSet", "kerf-system", "kerf-kubelet-plugin"),
            ("Deployment", "kerf-system", "kerf-controller"),
        ];
        assert_eq!(
            found,
            expected.map(|(k, n, m)| (k.to_owned(), n.to_owned(), m.to_owned()))
        );
        assert!(
            text.contains(&format!("name: {DEFAULT_SLICE_CLASS}")),
            "the manifest's default classes include {DEFAULT_SLICE_CLASS}"
        );
    }
}
