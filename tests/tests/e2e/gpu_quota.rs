//! Cluster e2e for GpuQuota: kerf's webhook refuses, at creation, a ResourceClaim that would
//! take its namespace past its quota, with ResourceQuota's `exceeded quota` message, and
//! admits it once a claim is deleted and kerf-controller has recounted the quota.
//!
//! Every cluster test is `#[ignore = "needs cluster"]`; run them with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e gpu_quota:: -- --ignored`. They need kerf
//! deployed from deploy/ (the GpuQuota CRD and the ValidatingWebhookConfiguration
//! `kerf-gpu-quota`) with mock GPUs of at least 20Gi (`h100-sxm-80gb`, the mock overlay's
//! default). They share the helpers of tests/tests/e2e/main.rs (tests/tests/e2e/) and its rules: every
//! wait is for a condition, never for an order of events or a time.
//!
//! What a real cluster does that the test allows for: kerf-controller's recount follows the
//! claims' deletion with a lag, so the test waits for `status.used` to drop before it
//! creates the claim again; and every kerf-controller replica serves the webhook from its own
//! watch of the GpuQuotas, so a replica may still see the deleted claim's charge for a moment:
//! the create is retried while it meets the quota's refusal, until a deadline.

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::GpuQuota;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

use crate::checks;
use crate::cluster;
use crate::cluster::{PodState, TestEnv, e2e};
use crate::manifests;
use crate::manifests::{PodClaim, Script};
use crate::quota;
use crate::wait;
use crate::wait::{Outcome, Poll};

/// Memory of each slice: the quota holds two.
const SLICE_MEMORY: &str = "20Gi";
/// [`SLICE_MEMORY`] in bytes.
const SLICE_BYTES: u64 = 20 << 30;
/// Compute of each slice, in percent.
const SLICE_COMPUTE: u8 = 25;
/// The quota's name, which its refusals quote.
const QUOTA: &str = "team-quota";
/// The quota's memory cap: two slices.
const QUOTA_MEMORY: &str = "40Gi";
/// The quota's compute cap: more than three slices take, so only memory is exceeded.
const QUOTA_COMPUTE: u64 = 100;

/// A namespace whose GpuQuota holds 40Gi of GPU memory runs two pods with a 20Gi slice each;
/// a third 20Gi claim is refused at creation with `exceeded quota: team-quota, requested:
/// memory=20Gi, used: memory=40Gi, limited: memory=40Gi` (compute, 75 of 100, is not over and
/// not named) and is not stored. Once one pod and its claim are deleted and kerf-controller
/// has lowered `status.used` to 20Gi, the third claim is admitted, kerf-controller allocates
/// it and its pod runs; the quota then shows `40Gi/40Gi` memory and `50/100` compute (the
/// `kubectl get gpuquota` columns).
#[tokio::test]
#[ignore = "needs cluster"]
async fn quota_refuses_the_third_slice_until_one_is_deleted() -> Result<()> {
    e2e("gpu-quota", |env: TestEnv| async move {
        require_quota_webhook(&env).await?;
        ensure!(
            env.published()
                .await?
                .iter()
                .any(|d| d.kind == "gpu" && d.memory_bytes.is_some_and(|m| m >= SLICE_BYTES)),
            "no kerf GPU has {SLICE_MEMORY} of memory; run kerf with a mock profile such as h100-sxm-80gb"
        );
        let class = env
            .gpu_class("gpu-quota", manifests::controller_class_spec(Some(SLICE_MEMORY)))
            .await?;
        env.create(&quota::gpu_quota(QUOTA, QUOTA_MEMORY, QUOTA_COMPUTE))
            .await
            .context("creating the GpuQuota: is kerf's GpuQuota CRD (deploy/helm/kerf/crds/gpuquotas.gpu.kerf.dev.yaml) installed?")?;
        wait_quota(&env, "recounted by kerf-controller (Ready)", |q| {
            Ok(quota::is_recounted(q))
        })
        .await?;

        for name in ["slice-a", "slice-b"] {
            env.create(&slice_claim(&env, &class, name)?).await?;
            create_pod(&env, name).await?;
        }
        env.wait_all_running(&["slice-a".to_owned(), "slice-b".to_owned()], env.settings.timeout)
            .await?;
        wait_used_memory(&env, 2 * SLICE_BYTES).await?;

        refuse_third(&env, &class).await?;

        env.delete_pod("slice-a").await?;
        let claims = env.api::<ResourceClaim>();
        claims
            .delete("slice-a", &DeleteParams::default())
            .await
            .context("deleting claim slice-a")?;
        env.wait_gone(&claims, "slice-a").await?;
        wait_used_memory(&env, SLICE_BYTES).await?;

        create_once_admitted(&env, &class, "slice-c").await?;
        create_pod(&env, "slice-c").await?;
        env.wait_pod("slice-c", PodState::Running).await?;
        let claim = env.claim("slice-c").await?;
        let slice = checks::slice_allocation(&claim, &env.settings.driver)?;
        ensure!(
            matches!(slice.devices.as_slice(), [d] if d.memory_bytes == Some(SLICE_BYTES)),
            "claim slice-c should hold one {SLICE_MEMORY} slice: {}",
            checks::describe_claim(&claim)
        );
        wait_quota(&env, "to show 40Gi/40Gi memory and 50/100 compute", |q| {
            let summary = q.status.as_ref().and_then(|s| s.summary.as_ref());
            Ok(summary.is_some_and(|s| s.memory == "40Gi/40Gi" && s.compute == "50/100"))
        })
        .await?;
        Ok(())
    })
    .await
}

/// The third claim: refused with the exact message while slice-a and slice-b hold the quota,
/// and not stored.
async fn refuse_third(env: &TestEnv, class: &str) -> Result<()> {
    let claims = env.api::<ResourceClaim>();
    let created = claims
        .create(&PostParams::default(), &slice_claim(env, class, "slice-c")?)
        .await;
    let expected = quota::exceeded_memory(QUOTA, SLICE_MEMORY, QUOTA_MEMORY, QUOTA_MEMORY);
    match created {
        Ok(_) => bail!(
            "claim slice-c was admitted over the quota ({}); kerf's webhook has failurePolicy Ignore, so this is also what happens while no kerf-controller replica answers it",
            quota::describe_quota(&env.api::<GpuQuota>().get(QUOTA).await?)
        ),
        Err(kube::Error::Api(status)) => quota::expect_quota_denial(&status, "slice-c", &expected)?,
        Err(other) => return Err(other).context("creating claim slice-c"),
    }
    ensure!(
        claims.get_opt("slice-c").await?.is_none(),
        "claim slice-c was refused, yet it exists"
    );
    Ok(())
}

/// Creates claim `name`, again while the create meets the quota's refusal (a webhook replica
/// whose copy of the quota still holds a deleted claim), until the settings' timeout. A claim
/// that already exists counts as created: a create whose answer was lost may have been stored.
async fn create_once_admitted(env: &TestEnv, class: &str, name: &str) -> Result<()> {
    let claims = env.api::<ResourceClaim>();
    let claim = slice_claim(env, class, name)?;
    wait::fail_fast(
        format_args!("claim {name} to be admitted under the quota"),
        env.settings.timeout,
        || async {
            match claims.create(&PostParams::default(), &claim).await {
                Ok(_) => Ok(Poll::Ready(())),
                Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(Poll::Ready(())),
                Err(kube::Error::Api(status)) if quota::is_quota_denial(&status) => {
                    let quota = env.api::<GpuQuota>().get(QUOTA).await?;
                    Ok(Poll::Pending(format!(
                        "refused: {}; {}",
                        status.message,
                        quota::describe_quota(&quota)
                    )))
                }
                Err(kube::Error::Api(status)) => Err(Outcome::Stop(anyhow!(
                    "creating claim {name} was refused for another reason: {} {}",
                    status.code,
                    status.message
                ))),
                Err(other) => Err(Outcome::Retry(other.into())),
            }
        },
    )
    .await
}

/// A claim `name` for one slice of [`SLICE_MEMORY`] and [`SLICE_COMPUTE`] of `class`.
fn slice_claim(env: &TestEnv, class: &str, name: &str) -> Result<ResourceClaim> {
    let params = manifests::slice_parameters(SLICE_MEMORY, SLICE_COMPUTE)?;
    let spec = manifests::claim_spec(class, &env.settings.driver, Some(params), &[]);
    Ok(manifests::resource_claim(name, spec))
}

/// Creates pod `name` of claim `name`, reporting and then sleeping.
async fn create_pod(env: &TestEnv, name: &str) -> Result<()> {
    let spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Claim(name),
        Script::ReportAndSleep,
        "Never",
    );
    env.create(&manifests::pod(name, spec, false)).await?;
    Ok(())
}

/// Waits until the quota's `status.used.memory` is `bytes`.
async fn wait_used_memory(env: &TestEnv, bytes: u64) -> Result<()> {
    wait_quota(env, &format!("to use {} GiB of memory", bytes >> 30), |q| {
        Ok(quota::used(q)?.is_some_and(|u| u.memory_bytes == bytes))
    })
    .await?;
    Ok(())
}

/// Waits until the test's GpuQuota satisfies `ready` (described by `what`); the wait's message
/// shows the quota's status and the namespace's pods.
async fn wait_quota(
    env: &TestEnv,
    what: &str,
    ready: impl Fn(&GpuQuota) -> Result<bool>,
) -> Result<GpuQuota> {
    let quotas = env.api::<GpuQuota>();
    wait::poll_until(
        format_args!("GpuQuota {QUOTA} {what}"),
        env.settings.timeout,
        || async {
            let quota = quotas.get(QUOTA).await?;
            if ready(&quota)? {
                return Ok(Poll::Ready(quota));
            }
            let pods: Vec<String> = env
                .api::<Pod>()
                .list(&ListParams::default())
                .await?
                .iter()
                .map(cluster::describe_pod)
                .collect();
            Ok(Poll::Pending(format!(
                "{}; pods: {pods:?}",
                quota::describe_quota(&quota)
            )))
        },
    )
    .await
}

/// Waits until a ValidatingWebhookConfiguration holds kerf's quota webhook with a CA bundle
/// (kerf-controller writes its CA into it at start): without one, kube-apiserver cannot call it
/// and `failurePolicy: Ignore` admits every claim.
async fn require_quota_webhook(env: &TestEnv) -> Result<()> {
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(env.client.clone());
    wait::poll_until(
        format_args!(
            "the webhook {} (ValidatingWebhookConfiguration {} of deploy/helm/kerf/templates/webhook.yaml) with a caBundle",
            quota::QUOTA_WEBHOOK,
            quota::QUOTA_CONFIGURATION
        ),
        env.settings.timeout,
        || async {
            let listed = configurations.list(&ListParams::default()).await?.items;
            let webhook = listed
                .iter()
                .flat_map(|c| c.webhooks.iter().flatten())
                .find(|w| w.name == quota::QUOTA_WEBHOOK);
            Ok(match webhook {
                Some(w) if w.client_config.ca_bundle.as_ref().is_some_and(|b| !b.0.is_empty()) => {
                    Poll::Ready(())
                }
                Some(_) => Poll::Pending(
                    "the webhook has no caBundle yet: is kerf-controller running?".to_owned(),
                ),
                None => Poll::Pending(format!(
                    "no such webhook among {} configurations: deploy kerf from deploy/",
                    listed.len()
                )),
            })
        },
    )
    .await
}
