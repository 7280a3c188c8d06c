//! Cluster e2e suite: kerf against a real API server, kube-scheduler, kube-controller-manager,
//! kubelet and container runtime, on a Kubernetes 1.35+ cluster where kerf runs with mock GPUs.
//!
//! Every cluster test is `#[ignore = "needs cluster"]`; run them with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e -- --ignored` (see tests/e2e/README.md).
//! The suite finds kerf through its ResourceSlices and GpuClasses, never its pods, so it works
//! whether kerf was deployed by `deploy/overlays/mock` or started as processes on the nodes.
//! The helpers live in tests/e2e/ and carry unit tests that run without a cluster.

#[path = "../e2e/checks.rs"]
mod checks;
#[path = "../e2e/cluster.rs"]
mod cluster;
#[path = "../e2e/manifests.rs"]
mod manifests;
#[path = "../e2e/settings.rs"]
mod settings;
#[path = "../e2e/wait.rs"]
mod wait;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;

use checks::{ContainerReport, PublishedDevice};
use cluster::{PodState, TestEnv, e2e};
use manifests::{CLAIM_REF, PodClaim, Script};
use wait::Poll;

/// Memory of each test slice.
const SLICE_MEMORY: &str = "10Gi";
/// [`SLICE_MEMORY`] in bytes.
const SLICE_BYTES: u64 = 10 << 30;
/// What kerf sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to for one [`SLICE_MEMORY`] slice.
const SLICE_MPS_MEMORY_LIMIT: &str = "0=10240M";
/// How long a "nothing happens" observation lasts after the controller has spoken.
const SETTLE: Duration = Duration::from_secs(5);

/// The node a pod is bound to.
fn pod_node(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// Checks the claim-level env and device nodes kerf's CDI spec gives a container of `claim`
/// whose one device is `gpu`.
fn expect_claim_devices(
    report: &ContainerReport,
    claim: &ResourceClaim,
    gpu: &PublishedDevice,
) -> Result<()> {
    report.expect_env("NVIDIA_VISIBLE_DEVICES", "void")?;
    report.expect_env(
        "KERF_CLAIM_UID",
        claim.metadata.uid.as_deref().unwrap_or_default(),
    )?;
    report.expect_env(
        "KERF_CLAIM_NAME",
        claim.metadata.name.as_deref().unwrap_or_default(),
    )?;
    report.expect_env(
        "KERF_CLAIM_NAMESPACE",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
    )?;
    report.expect_env("KERF_DEVICES", &gpu.name)?;
    report.expect_env("KERF_DEVICE_UUIDS", &gpu.uuid)?;
    let minor = gpu
        .minor
        .with_context(|| format!("published device {} has no minor attribute", gpu.name))?;
    let expected = format!("/dev/nvidia{minor}");
    ensure!(
        report.gpu_nodes() == [expected.as_str()],
        "the container should see exactly its GPU's node {expected}; it sees {:?}",
        report.device_nodes
    );
    ensure!(
        report.device_nodes.contains("/dev/nvidiactl"),
        "the container lacks /dev/nvidiactl; it sees {:?}",
        report.device_nodes
    );
    Ok(())
}

/// The one allocation result of kerf's driver on `claim`, as (pool, device).
fn single_result(claim: &ResourceClaim, driver: &str) -> Result<(String, String)> {
    let results = checks::allocation_results(claim, driver);
    match results.as_slice() {
        [result] => {
            ensure!(
                result.request == CLAIM_REF,
                "the result is for request {:?}, expected {CLAIM_REF:?}",
                result.request
            );
            Ok((result.pool.clone(), result.device.clone()))
        }
        _ => bail!(
            "expected one allocation result of {driver}, got {}: {}",
            results.len(),
            checks::describe_claim(claim)
        ),
    }
}

/// Fails unless kerf's controller (not kube-scheduler) allocated `claim`, and returns the node.
fn controller_node(claim: &ResourceClaim) -> Result<String> {
    ensure!(
        checks::has_allocation_finalizer(claim),
        "the claim lacks kerf's finalizer {}: {}",
        checks::ALLOCATION_FINALIZER,
        checks::describe_claim(claim)
    );
    let node = checks::allocated_node(claim).with_context(|| {
        format!(
            "the claim lacks kerf's annotation {}: {}",
            checks::ALLOCATED_NODE_ANNOTATION,
            checks::describe_claim(claim)
        )
    })?;
    Ok(node.to_owned())
}

/// The name of the claim the pod's template claim [`CLAIM_REF`] generated.
fn generated_claim(pod: &Pod) -> Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .find(|s| s.name == CLAIM_REF)
        .and_then(|s| s.resource_claim_name.clone())
        .with_context(|| format!("pod {:?} records no generated claim", pod.metadata.name))
}

/// Every node whose kerf pool is complete publishes the documented devices.
///
/// "Nodes running the plugin" are the nodes that have kerf ResourceSlices: the suite does not
/// look at pods. For each: the pool is named after a Node that exists, only its current
/// generation is left and it has `resourceSliceCount` slices, and every device is `gpu-<minor>`
/// (or a MIG device) with the documented attributes and the `memory` and `multiprocessors`
/// capacities. Waits (bounded) for a publisher in the middle of an update to finish.
#[tokio::test]
#[ignore = "needs cluster"]
async fn resource_slices_describe_every_plugin_node() -> Result<()> {
    e2e("slices", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let slices = wait::until(
            format_args!("complete, consistent ResourceSlices of driver {driver}"),
            env.settings.timeout,
            || async {
                let slices = env.kerf_slices().await?;
                if slices.is_empty() {
                    return Ok(Poll::Pending(format!(
                        "no ResourceSlice of driver {driver}: is kerf's kubelet plugin running?"
                    )));
                }
                let problems = checks::pool_problems(&slices, &driver);
                Ok(if problems.is_empty() {
                    Poll::Ready(slices)
                } else {
                    Poll::Pending(problems.join("; "))
                })
            },
        )
        .await?;
        let nodes: Api<Node> = Api::all(env.client.clone());
        let devices = checks::published_devices(&slices, &driver);
        for (pool, pool_slices) in checks::pools(&slices, &driver) {
            ensure!(
                nodes.get_opt(pool).await?.is_some(),
                "kerf publishes pool {pool:?} but there is no Node of that name"
            );
            let names: Vec<&str> = devices
                .iter()
                .filter(|d| d.node == pool)
                .map(|d| d.name.as_str())
                .collect();
            eprintln!(
                "node {pool}: {} slice(s), devices {names:?}",
                pool_slices.len()
            );
        }
        Ok(())
    })
    .await
}

/// A whole GPU from a Scheduler class: kube-scheduler allocates it, the kubelet plugin
/// prepares it, and the container sees exactly that GPU's device node and kerf's env.
#[tokio::test]
#[ignore = "needs cluster"]
async fn scheduler_class_whole_gpu_reaches_the_container() -> Result<()> {
    e2e("whole", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let class = env
            .gpu_class("whole", manifests::scheduler_class_spec())
            .await?;
        let spec = manifests::claim_spec(&class, &driver, None, &[]);
        env.create(&manifests::resource_claim("whole", spec)).await?;
        let pod_spec = manifests::pod_spec(
            &env.settings,
            PodClaim::Claim("whole"),
            Script::ReportAndExit,
            "Never",
        );
        env.create(&manifests::pod("whole", pod_spec, false))
            .await?;

        let pod = env.wait_pod("whole", PodState::Succeeded).await?;
        let claim = env.claim("whole").await?;
        let (pool, device) = single_result(&claim, &driver)?;
        ensure!(
            !checks::has_allocation_finalizer(&claim) && checks::allocated_node(&claim).is_none(),
            "a Scheduler-class claim must be left to kube-scheduler, but kerf's controller marked it: {}",
            checks::describe_claim(&claim)
        );
        ensure!(
            pod_node(&pod) == Some(pool.as_str()),
            "the pod ran on {:?} but its GPU is in pool {pool}",
            pod_node(&pod)
        );
        let gpu = env.published_device(&pool, &device).await?;
        ensure!(gpu.kind == "gpu", "{device} is a {:?}, not a whole GPU", gpu.kind);
        let report = ContainerReport::parse(&env.logs("whole").await?)?;
        expect_claim_devices(&report, &claim, &gpu)?;
        ensure!(
            !report.env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                && !report.env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "a whole GPU carries no slice limits, but the container has {:?} {:?}",
            report.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            report.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );
        Ok(())
    })
    .await
}

/// A slice from a Controller class: kerf's controller allocates it while the pod is still
/// held back by a scheduling gate (so the allocation provably comes first), the pod is then
/// bound to the node the allocation names, and the container sees the slice limits.
///
/// Relies on the controller treating a gated pod as the claim's first consumer, as it treats
/// every live pod that is not bound yet.
#[tokio::test]
#[ignore = "needs cluster"]
async fn controller_slice_is_allocated_before_scheduling() -> Result<()> {
    e2e("slice", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let class = env
            .gpu_class("slice", manifests::controller_class_spec(None))
            .await?;
        let params = manifests::slice_parameters(SLICE_MEMORY, 25)?;
        let spec = manifests::claim_spec(&class, &driver, Some(params), &[]);
        env.create(&manifests::resource_claim("slice", spec))
            .await?;
        let pod_spec = manifests::pod_spec(
            &env.settings,
            PodClaim::Claim("slice"),
            Script::ReportAndExit,
            "Never",
        );
        env.create(&manifests::pod("slice", pod_spec, true)).await?;

        let claim = env
            .wait_claim(
                "slice",
                "allocated by kerf's controller",
                checks::is_allocated,
            )
            .await?;
        let pods = env.api::<Pod>();
        let held = pods.get("slice").await?;
        ensure!(
            pod_node(&held).is_none(),
            "the pod was bound to {:?} while its scheduling gate held it",
            pod_node(&held)
        );
        let node = controller_node(&claim)?;
        let (pool, device) = single_result(&claim, &driver)?;
        ensure!(
            pool == node,
            "the result names pool {pool} but the claim was allocated on node {node}"
        );
        let pinned = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.node_selector.as_ref())
            .map(checks::selector_nodes)
            .unwrap_or_default();
        ensure!(
            pinned == [node.clone()],
            "the allocation's nodeSelector pins {pinned:?}, expected [{node}]"
        );
        let slice = checks::slice_allocation(&claim, &driver)?;
        let gpu = env.published_device(&node, &device).await?;
        match slice.devices.as_slice() {
            [d] => ensure!(
                d.pool == node
                    && d.device == device
                    && d.gpu_uuid == gpu.uuid
                    && d.memory_bytes == Some(SLICE_BYTES)
                    && d.compute_percent == Some(25),
                "the allocation's slice {d:?} is not {SLICE_MEMORY}/25% of {node}/{device} ({})",
                gpu.uuid
            ),
            other => bail!("expected one slice in the allocation, got {other:?}"),
        }
        env.wait_event("ResourceClaim", "slice", "Allocated")
            .await?;

        pods.patch(
            "slice",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"schedulingGates": []}})),
        )
        .await
        .context("removing the pod's scheduling gate")?;
        let pod = env.wait_pod("slice", PodState::Succeeded).await?;
        ensure!(
            pod_node(&pod) == Some(node.as_str()),
            "the pod was bound to {:?}, not to {node} where its claim is allocated",
            pod_node(&pod)
        );
        let report = ContainerReport::parse(&env.logs("slice").await?)?;
        expect_claim_devices(&report, &claim, &gpu)?;
        report.expect_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "25")?;
        report.expect_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", SLICE_MPS_MEMORY_LIMIT)?;
        report.expect_env("KERF_SLICE_MEMORY_BYTES", &SLICE_BYTES.to_string())?;
        report.expect_env("KERF_SLICE_COMPUTE_PERCENT", "25")?;
        Ok(())
    })
    .await
}

/// Three replicas with a slice template: three claims, all placed by BinPack on one GPU.
///
/// The class selects only GPUs of at least 3 × 10Gi, so every candidate GPU can hold all three
/// slices and "fewest GPUs" means exactly one. Assumes no other workload holds kerf GPUs
/// partly (the message lists every kerf allocation in the cluster when it fails).
#[tokio::test]
#[ignore = "needs cluster"]
async fn deployment_slices_are_bin_packed() -> Result<()> {
    e2e("binpack", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let fits_three = |d: &PublishedDevice| {
            d.kind == "gpu" && d.memory_bytes.is_some_and(|m| m >= 3 * SLICE_BYTES)
        };
        ensure!(
            env.published().await?.iter().any(fits_three),
            "no kerf GPU has 30Gi of memory; run kerf with a mock profile such as h100-sxm-80gb or a100-40gb-mig"
        );
        let class = env
            .gpu_class("binpack", manifests::controller_class_spec(Some("30Gi")))
            .await?;
        let params = manifests::slice_parameters(SLICE_MEMORY, 10)?;
        let spec = manifests::claim_spec(&class, &driver, Some(params), &[]);
        env.create(&manifests::claim_template("slice", spec))
            .await?;
        let pod_spec = manifests::pod_spec(
            &env.settings,
            PodClaim::Template("slice"),
            Script::ReportAndSleep,
            "Always",
        );
        env.create(&manifests::deployment("binpack", 3, pod_spec))
            .await?;

        let deployments = env.api::<Deployment>();
        wait::until(
            "deployment binpack to have 3 ready replicas",
            env.settings.timeout,
            || async {
                let status = deployments.get("binpack").await?.status.unwrap_or_default();
                let ready = status.ready_replicas.unwrap_or(0);
                Ok(if ready == 3 {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("{ready}/3 replicas ready"))
                })
            },
        )
        .await?;

        let claims = env
            .api::<ResourceClaim>()
            .list(&ListParams::default())
            .await?
            .items;
        ensure!(
            claims.len() == 3,
            "expected 3 claims generated from the template, found {}: {:?}",
            claims.len(),
            claims.iter().map(checks::describe_claim).collect::<Vec<_>>()
        );
        let pods = env.api::<Pod>();
        let mut placed = BTreeSet::new();
        for claim in &claims {
            let node = controller_node(claim)?;
            let (pool, device) = single_result(claim, &driver)?;
            ensure!(pool == node, "{}", checks::describe_claim(claim));
            let users = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .filter(|r| r.resource == "pods");
            for user in users {
                let pod = pods.get(&user.name).await?;
                ensure!(
                    pod_node(&pod) == Some(node.as_str()),
                    "pod {} runs on {:?}, its claim is allocated on {node}",
                    user.name,
                    pod_node(&pod)
                );
            }
            placed.insert((pool, device));
        }
        if placed.len() != 1 {
            bail!(
                "BinPack should put all three 10Gi slices on one GPU, they went to {placed:?}; kerf allocations in the cluster:\n{}",
                env.kerf_allocations().await?.join("\n")
            );
        }
        Ok(())
    })
    .await
}

/// A claim whose parameters are out of range: kerf's controller reports an
/// `InvalidParameters` Event that names the field, and allocates nothing.
#[tokio::test]
#[ignore = "needs cluster"]
async fn invalid_parameters_are_reported_and_not_allocated() -> Result<()> {
    e2e("invalid", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let class = env
            .gpu_class("invalid", manifests::controller_class_spec(None))
            .await?;
        // The API server stores opaque parameters unchecked; kerf must reject compute 150.
        let params = json!({
            "apiVersion": kerf_api::API_VERSION,
            "kind": "GpuClaimParameters",
            "memory": SLICE_MEMORY,
            "compute": 150,
        });
        let spec = manifests::claim_spec(&class, &driver, Some(params), &[]);
        env.create(&manifests::resource_claim("invalid", spec))
            .await?;
        // Allocation waits for a consumer, so the error only shows once a pod uses the claim.
        let pod_spec = manifests::pod_spec(
            &env.settings,
            PodClaim::Claim("invalid"),
            Script::ReportAndSleep,
            "Never",
        );
        env.create(&manifests::pod("invalid", pod_spec, false))
            .await?;

        let event = env
            .wait_event("ResourceClaim", "invalid", "InvalidParameters")
            .await?;
        let message = event.message.unwrap_or_default();
        ensure!(
            message.contains("spec.devices.config[0].opaque.parameters.compute")
                && message.contains("150"),
            "the InvalidParameters Event should name the field and value, it says: {message}"
        );
        for look in 0..2 {
            if look > 0 {
                tokio::time::sleep(SETTLE).await;
            }
            let claim = env.claim("invalid").await?;
            ensure!(
                !checks::is_allocated(&claim) && checks::allocated_node(&claim).is_none(),
                "an invalid claim got allocated: {}",
                checks::describe_claim(&claim)
            );
            let pod = env.api::<Pod>().get("invalid").await?;
            ensure!(
                pod_node(&pod).is_none(),
                "a pod with an invalid claim was bound to {:?}",
                pod_node(&pod)
            );
            let allocated = env
                .events_about("ResourceClaim", "invalid")
                .await?
                .into_iter()
                .any(|e| e.reason.as_deref() == Some("Allocated"));
            ensure!(!allocated, "an invalid claim got an Allocated Event");
        }
        Ok(())
    })
    .await
}

/// Deleting the pods gives the capacity back: a claim the pod named stays but is deallocated
/// and released (no allocation, no kerf finalizer or annotation); a template claim is deleted
/// with its pod once kerf's controller lets it go.
///
/// The node's CDI specs cannot be read from here, so their removal is shown indirectly: the
/// pods are only gone after the kubelet's NodeUnprepareResources succeeded (the kubelet does
/// not finish terminating a pod before that, and kerf's unprepare removes the claim's spec),
/// and a new whole-GPU claim pinned by UUID to each freed GPU is then allocated by
/// kube-scheduler (which counts every allocated device as in use) and prepared by the kubelet
/// plugin (which refuses a GPU other prepared claims still hold), and its pod runs.
#[tokio::test]
#[ignore = "needs cluster"]
async fn deleting_pods_deallocates_controller_claims() -> Result<()> {
    e2e("dealloc", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let slices = env
            .gpu_class("dealloc-slice", manifests::controller_class_spec(None))
            .await?;
        let whole = env
            .gpu_class("dealloc-whole", manifests::scheduler_class_spec())
            .await?;
        let params = manifests::slice_parameters(SLICE_MEMORY, 10)?;
        let spec = manifests::claim_spec(&slices, &driver, Some(params), &[]);
        env.create(&manifests::resource_claim("direct", spec.clone()))
            .await?;
        env.create(&manifests::claim_template("templated", spec))
            .await?;
        for (name, claim) in [
            ("direct", PodClaim::Claim("direct")),
            ("templated", PodClaim::Template("templated")),
        ] {
            let pod_spec =
                manifests::pod_spec(&env.settings, claim, Script::ReportAndSleep, "Never");
            env.create(&manifests::pod(name, pod_spec, false)).await?;
        }
        env.wait_pod("direct", PodState::Running).await?;
        let templated_pod = env.wait_pod("templated", PodState::Running).await?;
        let generated = generated_claim(&templated_pod)?;

        let mut freed = BTreeSet::new();
        for name in ["direct", generated.as_str()] {
            let claim = env.claim(name).await?;
            controller_node(&claim)?;
            freed.insert(single_result(&claim, &driver)?);
        }

        let pods = env.api::<Pod>();
        for name in ["direct", "templated"] {
            pods.delete(name, &DeleteParams::default()).await?;
        }
        for name in ["direct", "templated"] {
            env.wait_gone(&pods, name).await?;
        }
        env.wait_claim(
            "direct",
            "deallocated and released by kerf's controller",
            |c| {
                !checks::is_allocated(c)
                    && !checks::has_allocation_finalizer(c)
                    && checks::allocated_node(c).is_none()
            },
        )
        .await?;
        env.wait_gone(&env.api::<ResourceClaim>(), &generated)
            .await?;

        for (i, (node, device)) in freed.iter().enumerate() {
            let gpu = env.published_device(node, device).await?;
            let name = format!("reuse-{i}");
            let selector = manifests::uuid_selector(&driver, &gpu.uuid);
            let spec = manifests::claim_spec(&whole, &driver, None, &[selector]);
            env.create(&manifests::resource_claim(&name, spec)).await?;
            let pod_spec = manifests::pod_spec(
                &env.settings,
                PodClaim::Claim(&name),
                Script::ReportAndExit,
                "Never",
            );
            env.create(&manifests::pod(&name, pod_spec, false)).await?;
            let pod = env.wait_pod(&name, PodState::Succeeded).await?;
            let claim = env.claim(&name).await?;
            let got = single_result(&claim, &driver)?;
            ensure!(
                got == (node.clone(), device.clone()),
                "the claim pinned to {node}/{device} got {got:?}"
            );
            ensure!(
                pod_node(&pod) == Some(node.as_str()),
                "pod {name} ran on {:?}, not {node}",
                pod_node(&pod)
            );
            let report = ContainerReport::parse(&env.logs(&name).await?)?;
            expect_claim_devices(&report, &claim, &gpu)?;
        }
        Ok(())
    })
    .await
}
