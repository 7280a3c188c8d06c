//! Cluster e2e suite: kerf against a real API server, kube-scheduler, kube-controller-manager,
//! kubelet and container runtime, on a Kubernetes 1.35+ cluster where kerf runs with mock GPUs.
//!
//! Every cluster test is `#[ignore = "needs cluster"]`; run them with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e -- --ignored --test-threads=1` (see
//! tests/tests/e2e/README.md); one area with a module filter, e.g. `… --test e2e gpu_quota::`.
//! The suite finds kerf through its ResourceSlices and GpuClasses, never its pods, so it works
//! whether kerf was deployed by `deploy/kerf-mock.yaml` or started as processes on the nodes.
//! The tests of the basic flows are here; each other area has its module (GPU quota, MPS daemon
//! pods, node fit, scheduler slices, throughput). The helpers are the other modules and carry
//! unit tests that run without a cluster.
//!
//! # Reading a Scheduler-class claim's allocation
//!
//! Only while a pod uses it. kube-controller-manager's resourceclaim controller deallocates a
//! claim kube-scheduler allocated as soon as its last consumer is gone: kubernetes/kubernetes
//! `pkg/controller/resourceclaim/controller.go`, `(*Controller).syncClaim`, drops every
//! `status.reservedFor` pod that is gone or done (`isPodDone`: phase Succeeded or Failed) and,
//! when none is left (`len(valid) == 0`), sets `claim.Status.Allocation = nil` on a claim with
//! the builtin finalizer `resource.kubernetes.io/delete-protection` (which kube-scheduler adds
//! when it allocates), then removes that finalizer. So the tests run such pods with
//! [`Script::ReportAndSleep`], read the claim once the pod is Running and its report is
//! complete, and delete the pod afterwards. Claims kerf's controller allocated carry its own
//! finalizer instead, and kerf's controller deallocates them.

mod gpu_quota;
mod helm;
mod mps_daemons;
mod node_fit;
mod scheduler_slices;
mod throughput;

mod checks;
mod cluster;
mod daemon_checks;
mod daemon_pods;
mod dra_additions;
mod expect;
mod extended;
mod fake_nodes;
mod health;
mod install_and_parameters;
mod manifests;
mod quota;
mod settings;
mod sharing;
mod slice_shares;
mod wait;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::ownership::Owner;
use kerf_core::alloc::{IDLE_GPUS_TAINT_EFFECT, IDLE_GPUS_TAINT_KEY};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt as _};
use serde_json::json;

use checks::{ContainerReport, PublishedDevice};
use cluster::{PodState, TestEnv, e2e};
use expect::{controller_node, pod_node, single_result};
use manifests::{PodClaim, Script};
use sharing::Burst;
use wait::Poll;

/// Memory of each test slice.
const SLICE_MEMORY: &str = "10Gi";
/// [`SLICE_MEMORY`] in bytes.
const SLICE_BYTES: u64 = 10 << 30;
/// What kerf sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to for one [`SLICE_MEMORY`] slice.
const SLICE_MPS_MEMORY_LIMIT: &str = "0=10240M";
/// How long a "nothing happens" observation lasts after the controller has spoken.
const SETTLE: Duration = Duration::from_secs(5);

/// The default Scheduler class the chart installs: whole GPUs.
const DEFAULT_WHOLE_CLASS: &str = "gpu.kerf.dev";
/// The default Controller class the chart installs: slices, BinPack, MPS.
const DEFAULT_SLICE_CLASS: &str = "slice.gpu.kerf.dev";
/// The mixed burst: 4 whole GPUs and 14 slices of [`BURST_SLICE_MEMORY`] / 20 %. Four such
/// slices fit an H100 80GB (81559Mi; four 20Gi slices would not), so the burst fills exactly
/// 8 × H100: 4 GPUs of slices and 4 whole.
const BURST: Burst = Burst {
    whole: 4,
    slices: 14,
    slice_bytes: 19 << 30,
    slice_compute: 20,
};
/// [`BURST`]'s slice memory as a quantity.
const BURST_SLICE_MEMORY: &str = "19Gi";
/// How soon after the first create every pod of the burst must be Running.
const BURST_RUNNING_WITHIN: Duration = Duration::from_secs(30);

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
        let slices = wait::poll_until(
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

/// kerf-controller's `PreferNoSchedule` taint `gpu.kerf.dev/idle-gpus` is on exactly the
/// nodes that publish a kerf GPU no claim uses (no claim's result names it or a device of it).
/// Waits (bounded) for the controller's next pass after the claims of a previous test are
/// gone.
#[tokio::test]
#[ignore = "needs cluster"]
async fn idle_gpu_nodes_carry_kerfs_taint() -> Result<()> {
    e2e("idle-taint", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let nodes: Api<Node> = Api::all(env.client.clone());
        wait::poll_until(
            "kerf's taint on the nodes with an idle kerf GPU, and only there",
            env.settings.timeout,
            || async {
                let published = env.published().await?;
                let claims = env.all_claims().await?;
                let used: Vec<_> = claims
                    .iter()
                    .flat_map(|claim| checks::allocation_results(claim, &driver))
                    .collect();
                let mut wrong = Vec::new();
                let pools: BTreeSet<&str> = published.iter().map(|d| d.node.as_str()).collect();
                for pool in pools {
                    let idle = published.iter().any(|d| {
                        d.node == pool
                            && d.kind == "gpu"
                            && !used.iter().any(|result| {
                                result.pool == pool
                                    && (result.device == d.name
                                        || result.device.starts_with(&format!("{}-", d.name)))
                            })
                    });
                    let node = nodes.get(pool).await?;
                    let tainted = node
                        .spec
                        .and_then(|spec| spec.taints)
                        .unwrap_or_default()
                        .iter()
                        .any(|t| {
                            t.key == IDLE_GPUS_TAINT_KEY && t.effect == IDLE_GPUS_TAINT_EFFECT
                        });
                    eprintln!("node {pool}: idle kerf GPU {idle}, kerf's taint {tainted}");
                    if idle != tainted {
                        wrong.push(format!("{pool}: idle GPU {idle}, taint {tainted}"));
                    }
                }
                Ok(if wrong.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending(wrong.join("; "))
                })
            },
        )
        .await
    })
    .await
}

/// A whole GPU from a Scheduler class: kube-scheduler allocates it, the kubelet plugin
/// prepares it, and the container sees exactly that GPU's device node and kerf's env. Once
/// the pod is gone, kube-controller-manager deallocates the claim; kerf's controller only
/// labels it with its node while it is allocated (no finalizer, no allocated-node annotation).
///
/// The allocation is read while the pod runs (see "Reading a Scheduler-class claim's
/// allocation" at the top of this file).
#[tokio::test]
#[ignore = "needs cluster"]
async fn scheduler_class_whole_gpu_reaches_the_container() -> Result<()> {
    e2e("whole", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let pod = env.run_whole_gpu_pod("whole").await?;
        let report = env.wait_report("whole").await?;
        let claim = env.claim("whole").await?;
        let (pool, device) = single_result(&claim, &driver)?;
        ensure!(
            pod_node(&pod) == Some(pool.as_str()),
            "the pod runs on {:?} but its GPU is in pool {pool}",
            pod_node(&pod)
        );
        let gpu = env.published_device(&pool, &device).await?;
        expect::whole_by_scheduler(&claim, &driver, &gpu)?;
        expect::claim_devices(&report, &claim, &gpu)?;
        // kerf-controller labels claims kube-scheduler allocated once it sees them.
        let label = kerf_api::claim_node_label::node_label_value(&pool);
        env.wait_claim("whole", "labelled with its node by kerf-controller", |c| {
            expect::node_label(c) == Some(label.as_str())
        })
        .await?;
        ensure!(
            !report.env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
                && !report.env.contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "a whole GPU carries no slice limits, but the container has {:?} {:?}",
            report.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            report.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        );

        env.delete_pod("whole").await?;
        let claim = env
            .wait_claim(
                "whole",
                "deallocated by kube-controller-manager once its pod is gone, and unlabelled",
                |c| expect::is_released(c) && expect::node_label(c).is_none(),
            )
            .await?;
        expect::left_to_the_scheduler(&claim)?;
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
        let gpu = env.published_device(&node, &device).await?;
        expect::one_slice(&claim, &driver, &gpu, SLICE_BYTES, 25)?;
        ensure!(
            checks::allocated_devices(&claim).is_some(),
            "kerf's controller did not say what it allocated: {}",
            checks::describe_claim(&claim)
        );

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
        expect::claim_devices(&report, &claim, &gpu)?;
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
        wait::poll_until(
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

/// A claim whose parameters are out of range is refused where the user sees it, naming the
/// field and the value, and nothing is allocated.
///
/// Where kerf's claim webhook is installed (`kerf-claim-parameters`, failurePolicy Fail, as
/// deploy/ installs it) the create itself is denied with the webhook's words. Where it is not
/// (kerf started as processes without webhooks), the API server stores the opaque parameters
/// unchecked and kerf's controller must report an `InvalidParameters` Event and allocate
/// nothing once a pod uses the claim. The test says which of the two it checked.
#[tokio::test]
#[ignore = "needs cluster"]
async fn invalid_parameters_are_reported_and_not_allocated() -> Result<()> {
    e2e("invalid", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let class = env
            .gpu_class("invalid", manifests::controller_class_spec(None))
            .await?;
        let params = json!({
            "apiVersion": kerf_api::API_VERSION,
            "kind": "GpuClaimParameters",
            "memory": SLICE_MEMORY,
            "compute": 150,
        });
        let spec = manifests::claim_spec(&class, &driver, Some(params), &[]);
        let webhook = claim_webhook_installed(&env).await?;
        match env
            .create(&manifests::resource_claim("invalid", spec))
            .await
        {
            Err(refused) if webhook => {
                let message = format!("{refused:#}");
                ensure!(
                    message.contains("kerf-claim-parameters") || message.contains("denied"),
                    "the create should be denied by kerf's claim webhook, it failed with: {message}"
                );
                ensure!(
                    message.contains("compute") && message.contains("150"),
                    "the denial should name the field and value, it says: {message}"
                );
                ensure!(
                    env.api::<ResourceClaim>()
                        .get_opt("invalid")
                        .await?
                        .is_none(),
                    "a refused claim was stored"
                );
                eprintln!("[invalid] refused at admission: {message}");
                Ok(())
            }
            Err(error) => Err(error),
            Ok(_) if webhook => {
                bail!("kerf's claim webhook is installed but admitted a claim with compute 150")
            }
            Ok(_) => invalid_claim_reported_by_controller(&env).await,
        }
    })
    .await
}

/// Whether the cluster has kerf's claim-parameters webhook (deploy/'s
/// MutatingWebhookConfiguration `kerf-claim-parameters`, webhook
/// `claim-parameters.gpu.kerf.dev`).
async fn claim_webhook_installed(env: &TestEnv) -> Result<bool> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let configs: Api<MutatingWebhookConfiguration> = Api::all(env.client.clone());
    let installed = configs
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .flat_map(|config| config.webhooks.iter().flatten())
        .any(|webhook| webhook.name == "claim-parameters.gpu.kerf.dev");
    Ok(installed)
}

/// The stored invalid claim "invalid", used by a pod: kerf's controller reports an
/// `InvalidParameters` Event that names the field and value, and allocates nothing.
async fn invalid_claim_reported_by_controller(env: &TestEnv) -> Result<()> {
    eprintln!("[invalid] no claim webhook installed: checking the controller's Event");
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
}

/// Deleting the pods gives the capacity back: a claim the pod named stays but is deallocated
/// and released (no allocation, no kerf finalizer or annotation); a template claim is deleted
/// with its pod once kerf's controller lets it go.
///
/// The node's CDI specs cannot be read from here, so their removal is shown indirectly: the
/// pods are only gone after the kubelet's NodeUnprepareResources succeeded (the kubelet does
/// not finish terminating a pod before that, and kerf's unprepare removes the claim's spec),
/// and then every idle GPU of the freed GPUs' nodes, the freed ones among them, is allocated
/// whole by kube-scheduler (which counts every allocated device as in use) to a pod pinned to
/// that node and prepared by the kubelet plugin (which refuses a GPU other prepared claims
/// still hold), and each pod runs and sees its GPU.
///
/// Why every idle GPU and not a claim pinned by UUID to each freed one: kerf's controller
/// lends idle GPUs to kube-scheduler by how many pending pods want, not by which GPU their
/// claims select, so a pinned claim could wait for a GPU that is never lent.
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
        let generated = expect::generated_claim(&templated_pod)?;

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

        let claims = env.all_claims().await?;
        let published = env.published().await?;
        let mut reuse = Vec::new();
        let nodes: BTreeSet<&str> = freed.iter().map(|(node, _)| node.as_str()).collect();
        for node in nodes {
            let idle = sharing::idle_gpus(node, &claims, &driver, &published);
            for (_, device) in freed.iter().filter(|(n, _)| n == node) {
                ensure!(
                    idle.contains(device),
                    "the freed GPU {node}/{device} is still held; kerf allocations:\n{}",
                    env.kerf_allocations().await?.join("\n")
                );
            }
            for _ in &idle {
                let name = format!("reuse-{}", reuse.len());
                let spec = manifests::claim_spec(&whole, &driver, None, &[]);
                env.create(&manifests::resource_claim(&name, spec)).await?;
                let pod_spec = manifests::pod_spec(
                    &env.settings,
                    PodClaim::Claim(&name),
                    Script::ReportAndSleep,
                    "Never",
                );
                let pod_spec = manifests::pin_to_node(pod_spec, node);
                env.create(&manifests::pod(&name, pod_spec, false)).await?;
                reuse.push(name);
            }
        }
        let mut taken = BTreeSet::new();
        for pod in env.wait_all_running(&reuse, env.settings.timeout).await? {
            // Read while the pod runs: kube-scheduler allocated these claims.
            let name = pod.name_any();
            let report = env.wait_report(&name).await?;
            let claim = env.claim(&name).await?;
            let (node, device) = single_result(&claim, &driver)?;
            ensure!(
                pod_node(&pod) == Some(node.as_str()),
                "pod {name} runs on {:?}, its GPU is in pool {node}",
                pod_node(&pod)
            );
            let gpu = env.published_device(&node, &device).await?;
            expect::claim_devices(&report, &claim, &gpu)?;
            taken.insert((node, device));
        }
        ensure!(
            freed.is_subset(&taken),
            "every idle GPU was asked for whole, but the freed {freed:?} are not all among those taken, {taken:?}"
        );
        Ok(())
    })
    .await
}

/// A mixed burst on one node, created at once with no waits, as two Deployments scaled up
/// together would: [`BURST`]'s 4 pods with a whole GPU each of the default Scheduler class
/// `gpu.kerf.dev` and 14 pods with a 19Gi / 20 % slice each of the default Controller class
/// `slice.gpu.kerf.dev`, each pod's claim made from a ResourceClaimTemplate. They fill 8 ×
/// H100 80GB exactly, so kerf's controller must give kube-scheduler as many idle GPUs as its
/// pods need and keep enough for the slices.
///
/// Every pod is Running within [`BURST_RUNNING_WITHIN`] of the first create. Read while they
/// run: each whole-GPU claim was allocated by kube-scheduler a device published as the
/// scheduler's, each slice claim by kerf's controller a 19Gi / 20 % slice of a device
/// published as the controller's, all on the node; and across every claim in the cluster no
/// device is held whole by one claim and in any way by another, and no GPU's slices add up to
/// more than its memory or 100 % compute.
///
/// Needs a node whose idle GPUs fit the burst (8 × H100 80GB: `deploy/kerf-mock.yaml`) and the
/// test image on the node already (the first pull can take longer than the bound). Everything
/// the test made lives in its namespace, which the suite's guard deletes also when the test
/// fails or panics.
#[tokio::test]
#[ignore = "needs cluster"]
async fn mixed_burst_runs_without_sharing_a_device() -> Result<()> {
    e2e("burst", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        env.require_device_classes(&[DEFAULT_WHOLE_CLASS, DEFAULT_SLICE_CLASS])
            .await?;
        let node = env.node_fitting(&BURST).await?;
        eprintln!("[burst] on node {node}");

        let whole_spec = manifests::claim_spec(DEFAULT_WHOLE_CLASS, &driver, None, &[]);
        env.create(&manifests::claim_template("whole", whole_spec))
            .await?;
        let params = manifests::slice_parameters(BURST_SLICE_MEMORY, BURST.slice_compute)?;
        let slice_spec = manifests::claim_spec(DEFAULT_SLICE_CLASS, &driver, Some(params), &[]);
        env.create(&manifests::claim_template("slice", slice_spec))
            .await?;
        let whole: Vec<String> = (0..BURST.whole).map(|i| format!("whole-{i}")).collect();
        let slices: Vec<String> = (0..BURST.slices).map(|i| format!("slice-{i}")).collect();
        let pods: Vec<Pod> = whole
            .iter()
            .map(|name| (name, "whole"))
            .chain(slices.iter().map(|name| (name, "slice")))
            .map(|(name, template)| {
                let spec = manifests::pod_spec(
                    &env.settings,
                    PodClaim::Template(template),
                    Script::ReportAndSleep,
                    "Never",
                );
                manifests::pod(name, manifests::pin_to_node(spec, &node), false)
            })
            .collect();
        let started = Instant::now();
        futures::future::try_join_all(pods.iter().map(|pod| env.create(pod))).await?;
        let names: Vec<String> = whole.iter().chain(&slices).cloned().collect();
        let running = env
            .wait_all_running(
                &names,
                BURST_RUNNING_WITHIN.saturating_sub(started.elapsed()),
            )
            .await?;
        eprintln!(
            "[burst] {} pods Running after {:?}",
            running.len(),
            started.elapsed()
        );

        // Read while every pod runs (kube-scheduler's claims are deallocated once their pods
        // are done).
        let claims: BTreeMap<String, ResourceClaim> = env
            .api::<ResourceClaim>()
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .map(|c| (c.name_any(), c))
            .collect();
        let published = env.published().await?;
        for pod in &running {
            let name = pod.name_any();
            let check = || -> Result<()> {
                ensure!(
                    pod_node(pod) == Some(node.as_str()),
                    "the pod runs on {:?}, not {node}",
                    pod_node(pod)
                );
                let claim_name = expect::generated_claim(pod)?;
                let claim = claims
                    .get(&claim_name)
                    .with_context(|| format!("its claim {claim_name} is not listed"))?;
                let (pool, device) = single_result(claim, &driver)?;
                let gpu = published
                    .iter()
                    .find(|d| d.node == pool && d.name == device)
                    .with_context(|| format!("no device {device} in kerf's pool {pool}"))?;
                ensure!(
                    pool == node,
                    "its claim is allocated in pool {pool}, not {node}"
                );
                if whole.contains(&name) {
                    expect::whole_by_scheduler(claim, &driver, gpu)?;
                    expect::owned_by(gpu, Owner::Scheduler)
                } else {
                    let at = controller_node(claim)?;
                    ensure!(at == node, "its slice was allocated on {at}, not {node}");
                    expect::one_slice(claim, &driver, gpu, BURST.slice_bytes, BURST.slice_compute)?;
                    expect::owned_by(gpu, Owner::Controller)
                }
            };
            check().with_context(|| format!("pod {name}"))?;
        }
        let problems = sharing::sharing_problems(&env.all_claims().await?, &driver, &published);
        if !problems.is_empty() {
            bail!(
                "kerf GPUs are shared where they must not be:\n{}\nkerf allocations:\n{}",
                problems.join("\n"),
                env.kerf_allocations().await?.join("\n")
            );
        }
        Ok(())
    })
    .await
}

/// A pod that asks for a kerf GPU by extended resource name, with no ResourceClaim: a GpuClass
/// with a unique `extendedResourceName` gets a DeviceClass that carries it; the unmodified pod
/// (`resources.limits: {<name>: 1}`) runs with one whole GPU that kube-scheduler allocated from
/// kerf's devices into the claim it made at binding — annotated
/// `resource.kubernetes.io/extended-resource-claim`, owned by the pod, named in
/// `pod.status.extendedResourceClaimStatus` — and its container sees that GPU and kerf's env.
/// The claim goes with the pod.
///
/// Skips (passes with a SKIPPED line) where the API server drops DeviceClass
/// `extendedResourceName` (DRAExtendedResource off: 1.34/1.35 by default), probed as kerf's
/// controller probes it.
#[tokio::test]
#[ignore = "needs cluster"]
async fn extended_resource_pod_gets_a_kerf_gpu() -> Result<()> {
    e2e("extended", dra_additions::extended_resource_pod).await
}

/// A device's health flip as the pod and the ResourceSlice show it: a pod with a whole GPU
/// runs; the suite gives that GPU a non-fatal XID 61 through the node annotation
/// `gpu.kerf.dev/mock-faults` that kerf's plugin reads in mock mode; the kubelet then reports
/// the claim's device Unhealthy in `allocatedResourcesStatus` (`claim:gpu`) and, where the API
/// server keeps device taints, the device carries `gpu.kerf.dev/unhealthy=xid-61:NoSchedule`;
/// once the annotation is removed the device is Healthy again, the taint is gone, and the pod
/// was never evicted. The annotation is removed also when the test fails.
///
/// Skips (passes with a SKIPPED line) when the kubelet reports no health for the claim within
/// a minute (ResourceHealthStatus off: 1.34/1.35 by default).
#[tokio::test]
#[ignore = "needs cluster"]
async fn health_flip_visible_in_pod_status() -> Result<()> {
    e2e("health", dra_additions::health_flip).await
}

/// A controller-class claim created as a Python client creates it: through a raw request
/// whose body is JSON with spaces after `,` and `:` (`json.dumps`), not re-encoded by kube's
/// `Api::create`. A pod using the claim runs, kerf's controller allocated the claim a 10Gi /
/// 25 % slice, and the container sees the slice's limits. While the pod waits, the wait's
/// message shows the Warning Events about the claim, so a claim kerf cannot handle fails with
/// kerf's own words.
#[tokio::test]
#[ignore = "needs cluster"]
async fn spaced_json_claim_runs() -> Result<()> {
    e2e("spaced", install_and_parameters::spaced_json_claim).await
}

/// kerf installed with one `kubectl apply -f deploy/kerf-mock.yaml` (mock GPUs): the
/// controller Deployment and the kubelet-plugin DaemonSet it names become ready, the
/// controller creates the default class `slice.gpu.kerf.dev` from the manifest's ConfigMap,
/// and a pod with a 10Gi / 25 % slice claim of that class runs to completion (`Succeeded`)
/// with kerf's controller's `Allocated` Event on the claim and the slice's limits in its
/// container. Needs nothing but DRA from the cluster (not kerf's CRD), `kubectl`
/// (`KERF_E2E_KUBECTL`) and the image `kerf:dev` on the nodes; kerf stays installed.
#[tokio::test]
#[ignore = "needs cluster"]
async fn kubectl_apply_installs_kerf() -> Result<()> {
    cluster::e2e_installing_kerf(
        "install",
        install_and_parameters::kubectl_apply_installs_kerf,
    )
    .await
}
