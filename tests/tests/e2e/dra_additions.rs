//! The bodies of the cluster tests of Kubernetes 1.36's DRA additions: a pod that asks for a
//! kerf GPU by extended resource name, and a device's health flip as the pod and the
//! ResourceSlice show it. Both skip, with a line that says why, on clusters that lack the
//! feature (a capability of the cluster, not a missing tool).

use anyhow::{Context as _, Result, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::GpuClass;
use kerf_api::gpuclass::CONDITION_EXTENDED_RESOURCE;
use kube::Api;

use super::cluster::{PodState, TestEnv};
use super::expect::{self, pod_node, single_result, single_result_for};
use super::manifests::{self, CLAIM_REF, Script};
use super::wait::{self, Poll};
use super::{extended, health};

/// The XID the health test injects: not an application XID and not fatal, so the device gets
/// a NoSchedule taint and the running pod is not evicted.
const NON_FATAL_XID: u64 = 61;

/// See `extended_resource_pod_gets_a_kerf_gpu` in tests/tests/e2e/main.rs.
pub async fn extended_resource_pod(env: TestEnv) -> Result<()> {
    let driver = env.settings.driver.clone();
    let probed = extended::probe_extended_resource(&env.client, &driver).await;
    if let Some(line) = probed.degraded_message(kerf_api::features::ApiFeature::ExtendedResource) {
        eprintln!("[extended] SKIPPED: {line}");
        return Ok(());
    }
    let resource = extended::unique_resource_name(&driver, &env.namespace)?;
    let spec = kerf_api::GpuClassSpec {
        extended_resource_name: Some(resource.clone()),
        ..manifests::scheduler_class_spec()
    };
    let class = env.gpu_class("extended", spec).await?;
    let classes: Api<GpuClass> = Api::all(env.client.clone());
    let device_classes: Api<DeviceClass> = Api::all(env.client.clone());
    wait::poll_until(
        format_args!("DeviceClass {class} to carry extendedResourceName {resource}"),
        env.settings.timeout,
        || async {
            let named = device_classes
                .get(&class)
                .await?
                .spec
                .extended_resource_name;
            if named.as_deref() == Some(resource.as_str()) {
                return Ok(Poll::Ready(()));
            }
            let condition = classes
                .get(&class)
                .await?
                .status
                .and_then(|s| s.condition(CONDITION_EXTENDED_RESOURCE).cloned());
            Ok(Poll::Pending(format!(
                "DeviceClass names {named:?}; GpuClass condition {condition:?}"
            )))
        },
    )
    .await?;

    let pod_spec = extended::pod_spec(&env.settings, &resource, Script::ReportAndSleep);
    env.create(&manifests::pod("extended", pod_spec, false))
        .await?;
    let pod = env.wait_pod("extended", PodState::Running).await?;
    let report = env.wait_report("extended").await?;
    let claim_name = extended::claim_name(&pod)
        .context("the running pod has no status.extendedResourceClaimStatus")?
        .to_owned();
    let claim = env.claim(&claim_name).await?;
    extended::expect_special_claim(&claim, &pod)?;
    let request = extended::request_name(&pod, &resource)
        .with_context(|| format!("no container of the running pod requests {resource}"))?;
    let (pool, device) = single_result_for(&claim, &driver, &request)?;
    ensure!(
        pod_node(&pod) == Some(pool.as_str()),
        "the pod runs on {:?} but its GPU is in pool {pool}",
        pod_node(&pod)
    );
    let gpu = env.published_device(&pool, &device).await?;
    expect::whole_by_scheduler(&claim, &driver, &gpu)?;
    expect::claim_devices(&report, &claim, &gpu)?;

    env.delete_pod("extended").await?;
    // The claim is the pod's: the garbage collector removes it with the pod.
    env.wait_gone(
        &env.api::<k8s_openapi::api::resource::v1::ResourceClaim>(),
        &claim_name,
    )
    .await?;
    Ok(())
}

/// See `health_flip_visible_in_pod_status` in tests/tests/e2e/main.rs.
pub async fn health_flip(env: TestEnv) -> Result<()> {
    let driver = env.settings.driver.clone();
    env.run_whole_gpu_pod("health").await?;
    let claim = env.claim("health").await?;
    let (pool, device) = single_result(&claim, &driver)?;

    let pods = env.api::<Pod>();
    let first = wait_health(
        &pods,
        "a first health report",
        health::FIRST_REPORT_BOUND,
        |_| true,
    )
    .await;
    let Ok(first) = first else {
        eprintln!(
            "[health] SKIPPED: the kubelet reported no allocatedResourcesStatus for claim:{CLAIM_REF} within {:?} (feature gate ResourceHealthStatus is off by default before Kubernetes 1.36)",
            health::FIRST_REPORT_BOUND
        );
        return Ok(());
    };
    ensure!(first == "Healthy", "before any fault the device is {first}");
    let taints = health::probe_device_taints(&env.client, &driver, &pool)
        .await
        .is_served();
    if !taints {
        eprintln!("[health] the API server drops device taints: only the pod status is checked");
    }

    let guard = health::FaultGuard::set(
        &env.client,
        &pool,
        &health::xid_fault(&device, NON_FATAL_XID),
    )
    .await?;
    wait_health(&pods, "Unhealthy", env.settings.timeout, |h| {
        h == "Unhealthy"
    })
    .await?;
    if taints {
        wait_taint(&env, &pool, &device, true).await?;
    }
    drop(guard);
    wait_health(&pods, "Healthy again", env.settings.timeout, |h| {
        h == "Healthy"
    })
    .await?;
    if taints {
        wait_taint(&env, &pool, &device, false).await?;
    }
    let pod = pods.get("health").await?;
    ensure!(
        pod.status.and_then(|s| s.phase).as_deref() == Some("Running"),
        "a NoSchedule fault must not evict the running pod"
    );
    Ok(())
}

/// Waits (at most `bound`) for the pod `health`'s claim to report a health `accept` takes.
async fn wait_health(
    pods: &Api<Pod>,
    what: &str,
    bound: std::time::Duration,
    accept: impl Fn(&str) -> bool,
) -> Result<String> {
    wait::poll_until(
        format_args!("allocatedResourcesStatus claim:{CLAIM_REF}: {what}"),
        bound,
        || async {
            let pod = pods.get("health").await?;
            let (health, seen) = health::claim_health(&pod, CLAIM_REF);
            Ok(match health {
                Some(h) if accept(&h) => Poll::Ready(h),
                _ => Poll::Pending(format!("reported {seen:?}")),
            })
        },
    )
    .await
}

/// Waits until device `device` of pool `pool` carries (or, with `present` false, no longer
/// carries) kerf's NoSchedule taint for the injected XID.
async fn wait_taint(env: &TestEnv, pool: &str, device: &str, present: bool) -> Result<()> {
    let driver = &env.settings.driver;
    let key = format!("{driver}/unhealthy");
    let value = format!("xid-{NON_FATAL_XID}");
    wait::poll_until(
        format_args!(
            "device {device} of pool {pool} {} taint {key}={value}:NoSchedule",
            if present { "to carry" } else { "to lose" }
        ),
        env.settings.timeout,
        || async {
            let taints = health::device_taints(&env.kerf_slices().await?, driver, pool, device);
            let has = taints.iter().any(|t| {
                t.key == key
                    && t.value.as_deref() == Some(value.as_str())
                    && t.effect == "NoSchedule"
            });
            let gone = taints.iter().all(|t| t.key != key);
            Ok(if (present && has) || (!present && gone) {
                Poll::Ready(())
            } else {
                Poll::Pending(format!("taints {taints:?}"))
            })
        },
    )
    .await
}
