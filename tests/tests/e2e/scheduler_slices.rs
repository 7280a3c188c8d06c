//! Cluster e2e for scheduler slices and dynamic MIG on Kubernetes 1.36 (DRAConsumableCapacity and
//! DRAPartitionableDevices on by default), kerf deployed with mock GPUs: kube-scheduler hands
//! out two slices of one GPU of a sliced Scheduler GpuClass, and a dynamic MIG device of a
//! MIG-profile Scheduler GpuClass.
//!
//! Every cluster test is `#[ignore = "needs cluster"]`; run them with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e scheduler_slices:: -- --ignored`. They
//! share the helpers of tests/tests/e2e/main.rs (tests/tests/e2e/) and its rules: allocations are read
//! while the pods run, and every wait is for a condition, never for an order of events.

use anyhow::{Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceSlice;

use crate::checks::ContainerReport;
use crate::cluster;
use crate::cluster::{PodState, TestEnv, e2e};
use crate::manifests;
use crate::manifests::{PodClaim, Script};
use crate::slice_shares;
use crate::slice_shares::{Share, shares};
use crate::wait;
use crate::wait::Poll;

/// Memory of each scheduler slice.
const SLICE_MEMORY: &str = "10Gi";
/// [`SLICE_MEMORY`] in bytes.
const SLICE_BYTES: u64 = 10 << 30;
/// Compute of each scheduler slice, in percent.
const SLICE_COMPUTE: &str = "30";

/// Every device of `driver` in `slices` that `wanted` accepts, with its pool.
fn devices_with<'a>(
    slices: &'a [ResourceSlice],
    driver: &str,
    wanted: impl Fn(&k8s_openapi::api::resource::v1::Device) -> bool,
) -> Vec<(&'a str, &'a k8s_openapi::api::resource::v1::Device)> {
    slices
        .iter()
        .filter(|s| s.spec.driver == driver)
        .flat_map(|s| {
            s.spec
                .devices
                .iter()
                .flatten()
                .map(move |d| (s.spec.pool.name.as_str(), d))
        })
        .filter(|(_, d)| wanted(d))
        .collect()
}

/// Creates pod `name` of claim `name`, reporting and then sleeping.
async fn create_reporting_pod(env: &TestEnv, name: &str) -> Result<()> {
    let spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Claim(name),
        Script::ReportAndSleep,
        "Always",
    );
    env.create(&manifests::pod(name, spec, false)).await?;
    Ok(())
}

/// Waits until pod `name` runs and returns its report.
async fn wait_reporting_pod(env: &TestEnv, name: &str) -> Result<ContainerReport> {
    env.wait_pod(name, PodState::Running).await?;
    env.wait_report(name).await
}

/// Runs a pod of `claim` that reports and sleeps, and returns its report once Running.
async fn run_reporting_pod(env: &TestEnv, name: &str) -> Result<ContainerReport> {
    create_reporting_pod(env, name).await?;
    wait_reporting_pod(env, name).await
}

/// Two claims ask a sliced Scheduler class for 10Gi / 30 % each and land on one GPU:
/// kube-scheduler allocates two shares of that GPU (own shareIDs, `consumedCapacity` memory
/// 10Gi and compute 30), both pods run at the same time, and each container carries its
/// slice limits. Once the pods are gone, kube-controller-manager deallocates both claims.
///
/// The demand comes first, as a user makes it: kerf-controller lends a GPU to kube-scheduler
/// only for pending pods that ask for one, so the class, the first claim and its pod are
/// created before any GPU is shareable, and the test then waits for kerf-controller to name
/// a GPU in the Node's shared publication, for the plugin to publish it shareable
/// (`allowMultipleAllocations`, `memory` and `compute` with request policies) and for the pod
/// to run. The second claim is pinned by CEL to the first one's GPU (by its `uuid`), which its
/// share keeps the scheduler's; kerf turns each share into the same limits as a controller
/// slice (`KERF_SLICE_*`, `CUDA_MPS_*`).
#[tokio::test]
#[ignore = "needs cluster"]
async fn kube_scheduler_allocates_two_slices_of_one_gpu() -> Result<()> {
    e2e("sched-slices", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let class = env
            .gpu_class("sched-slices", slice_shares::sliced_scheduler_class_spec())
            .await?;
        let capacity = [("memory", SLICE_MEMORY), ("compute", SLICE_COMPUTE)];
        let first = slice_shares::capacity_claim_spec(&class, &capacity, &[]);
        env.create(&manifests::resource_claim("share-a", first)).await?;
        create_reporting_pod(&env, "share-a").await?;
        wait::poll_until(
            "kerf-controller to lend a GPU for pending pod share-a and the plugin to publish it shareable (allowMultipleAllocations)",
            env.settings.timeout,
            || async {
                let slices = env.kerf_slices().await?;
                let shareable = devices_with(&slices, &driver, |d| {
                    d.allow_multiple_allocations == Some(true)
                });
                Ok(if shareable.is_empty() {
                    Poll::Pending(format!(
                        "no shareable kerf device among {} slice(s); pod share-a: {}",
                        slices.len(),
                        env.api::<Pod>()
                            .get("share-a")
                            .await
                            .map_or_else(|e| e.to_string(), |p| cluster::describe_pod(&p))
                    ))
                } else {
                    Poll::Ready(())
                })
            },
        )
        .await?;
        let mut reports = vec![wait_reporting_pod(&env, "share-a").await?];
        let (pool, device) = match shares(&env.claim("share-a").await?, &driver).as_slice() {
            [one] => (one.pool.clone(), one.device.clone()),
            other => anyhow::bail!("claim share-a should hold one share, it holds {other:?}"),
        };
        let gpu = env.published_device(&pool, &device).await?;
        ensure!(
            gpu.owner.as_deref() == Some("scheduler"),
            "share-a got {pool}/{device}, published with allocator {:?}, not the scheduler's",
            gpu.owner
        );
        let pin = manifests::uuid_selector(&driver, &gpu.uuid);
        let second =
            slice_shares::capacity_claim_spec(&class, &capacity, std::slice::from_ref(&pin));
        env.create(&manifests::resource_claim("share-b", second)).await?;
        create_reporting_pod(&env, "share-b").await?;
        reports.push(wait_reporting_pod(&env, "share-b").await?);
        check_two_shares(&env, &pool, &device, &reports).await?;
        for name in ["share-a", "share-b"] {
            env.delete_pod(name).await?;
        }
        for name in ["share-a", "share-b"] {
            env.wait_claim(name, "deallocated once its pod is gone", |c| {
                c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none()
            })
            .await?;
        }
        Ok(())
    })
    .await
}

/// Both claims hold one share each of `pool`/`device`, with their own shareIDs and the asked
/// capacity, and both pods still run with the slice's limits in their containers.
async fn check_two_shares(
    env: &TestEnv,
    pool: &str,
    device: &str,
    reports: &[ContainerReport],
) -> Result<()> {
    let driver = &env.settings.driver;
    let mut found: Vec<Share> = Vec::new();
    for name in ["share-a", "share-b"] {
        let claim = env.claim(name).await?;
        let share = match shares(&claim, driver).as_slice() {
            [one] => one.clone(),
            other => anyhow::bail!("claim {name} should hold one share, it holds {other:?}"),
        };
        ensure!(
            share.pool == pool && share.device == device,
            "claim {name} got {}/{}, expected the GPU {pool}/{device}",
            share.pool,
            share.device
        );
        ensure!(share.id.is_some(), "claim {name}'s result has no shareID");
        ensure!(
            share.consumed.get("memory").map(String::as_str) == Some(SLICE_MEMORY)
                && share.consumed.get("compute").map(String::as_str) == Some(SLICE_COMPUTE),
            "claim {name} consumed {:?}, expected memory {SLICE_MEMORY} and compute {SLICE_COMPUTE}",
            share.consumed
        );
        found.push(share);
    }
    ensure!(
        found[0].id != found[1].id,
        "both shares carry shareID {:?}",
        found[0].id
    );
    for report in reports {
        report.expect_env("KERF_DEVICES", device)?;
        report.expect_env("KERF_SLICE_MEMORY_BYTES", &SLICE_BYTES.to_string())?;
        report.expect_env("KERF_SLICE_COMPUTE_PERCENT", SLICE_COMPUTE)?;
        report.expect_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", SLICE_COMPUTE)?;
        report.expect_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=10240M")?;
    }
    let pods = env.api::<Pod>();
    for name in ["share-a", "share-b"] {
        let pod = pods.get(name).await?;
        ensure!(
            pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
            "pod {name} stopped while both shares should run side by side: {}",
            cluster::describe_pod(&pod)
        );
    }
    Ok(())
}

/// A claim of a Scheduler class for MIG profile 1g.5gb on a node publishing dynamic MIG
/// (mock profile `a100-40gb-dynmig`: counter sets and one device per placement):
/// kube-scheduler allocates one placement device, exclusively (no shareID), the plugin
/// creates the MIG device and the container gets it. Prints `SKIPPED` and passes when no
/// kerf pool publishes counter sets (no dynamic-MIG node in the cluster).
///
/// Placement devices are named `gpu-<minor>-mig-1g-5gb-<start>` with attributes
/// `type: mig` and `profile: 1g.5gb`; the container's env names the device in
/// `KERF_DEVICES` and the created MIG device's UUID (`MIG-…`) in `KERF_DEVICE_UUIDS`, and it
/// has `/dev/nvidia-caps`.
#[tokio::test]
#[ignore = "needs cluster"]
async fn kube_scheduler_allocates_a_dynamic_mig_device() -> Result<()> {
    e2e("dyn-mig", |env: TestEnv| async move {
        let driver = env.settings.driver.clone();
        let slices = env.kerf_slices().await?;
        let dynamic = slices
            .iter()
            .any(|s| s.spec.driver == driver && s.spec.shared_counters.is_some());
        if !dynamic {
            eprintln!(
                "SKIPPED: no kerf pool publishes shared counters; run a node with --mock-gpus=a100-40gb-dynmig on Kubernetes 1.36"
            );
            return Ok(());
        }
        let class = env
            .gpu_class("dyn-mig", slice_shares::mig_class_spec("1g.5gb"))
            .await?;
        let spec = slice_shares::capacity_claim_spec(&class, &[], &[]);
        env.create(&manifests::resource_claim("mig", spec)).await?;
        let report = run_reporting_pod(&env, "mig").await?;
        let claim = env.claim("mig").await?;
        let share = match shares(&claim, &driver).as_slice() {
            [one] => one.clone(),
            other => anyhow::bail!("claim mig should hold one device, it holds {other:?}"),
        };
        ensure!(
            share.device.contains("-mig-1g-5gb-"),
            "claim mig got {}, not a 1g.5gb placement",
            share.device
        );
        ensure!(
            share.id.is_none(),
            "a MIG placement is exclusive, yet the result has shareID {:?}",
            share.id
        );
        report.expect_env("KERF_DEVICES", &share.device)?;
        let uuids = report.env.get("KERF_DEVICE_UUIDS").cloned().unwrap_or_default();
        ensure!(
            uuids.starts_with("MIG-"),
            "KERF_DEVICE_UUIDS is {uuids:?}, expected the created MIG device's UUID"
        );
        ensure!(
            report.device_nodes.contains("/dev/nvidia-caps"),
            "the container lacks /dev/nvidia-caps; it sees {:?}",
            report.device_nodes
        );
        env.delete_pod("mig").await?;
        env.wait_claim("mig", "deallocated once its pod is gone", |c| {
            c.status.as_ref().and_then(|s| s.allocation.as_ref()).is_none()
        })
        .await?;
        Ok(())
    })
    .await
}
