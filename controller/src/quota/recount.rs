//! The recount of every GpuQuota's `status.used` from the claims that exist.
//!
//! A kube-runtime controller over GpuQuotas, triggered by a quota's own changes, by claim
//! changes (a claim created or changed: the quotas of its namespace; a claim deleted or the
//! claims relisted: every quota, since a deletion carries no namespace here), by the expiry
//! of the earliest `status.admitted` entry, and by a resync (`--quota-resync`). Each recount
//! prices every cached claim of the namespace ([`super::usage`], with the classes the webhook
//! prices with, [`super::classes::quota_class`]) and writes the status ([`super::status`]) when
//! it differs, as a replace of `/status` carrying the `resourceVersion` it read: when the
//! webhook admitted a claim meanwhile the replace conflicts, and the recount reads the quota
//! again and counts anew, so it never drops a charge the webhook just added (the optimistic
//! concurrency of ResourceQuota, `staging/src/k8s.io/apiserver/pkg/admission/plugin/
//! resourcequota/controller.go`, `checkQuotas`, on the controller's side).
//!
//! An invalid spec gets `Ready=False, reason InvalidSpec` and a Warning Event on the quota; a
//! status write that the API server refuses or that keeps failing is told on the quota too
//! ([`Context::report_write_failure`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kerf_api::gpuquota::{GpuAmount, GpuQuota, GpuQuotaStatus, claim_charge};
use kube::api::PostParams;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Resource as _, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use super::status::{desired_status, readiness, ready_changed};
use super::usage::{Usage, usage};
use crate::cache::Change;
use crate::condition::Verdict;
use crate::context::{Context, Write};
use crate::error::{Error, Result};
use crate::retry::Retry;

/// Name of this controller in metrics and logs.
pub const CONTROLLER: &str = "gpuquota";

/// How failed recounts are retried: after the quota's next back-off delay.
pub const RETRY: Retry = Retry::new(CONTROLLER);

/// Recounts of one reconcile that lose to a concurrent write before it gives up and backs off:
/// each loss is an admission that succeeded, so a few in a row already mean a burst.
const CONFLICT_TRIES: usize = 5;

/// Runs the recount until `shutdown` is cancelled; in-flight recounts finish.
///
/// The caches in `ctx` must be running; the recount waits for their first lists, so that it
/// never writes a usage counted from an empty claim cache.
///
/// # Errors
///
/// [`Error::ControllerStopped`] when the caches stop before they are ready.
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) -> Result<()> {
    tokio::select! {
        () = shutdown.cancelled() => return Ok(()),
        ready = ctx.caches.wait_ready() => ready?,
    }
    let controller = Controller::new(
        Api::<GpuQuota>::all(ctx.client.clone()),
        watcher::Config::default(),
    );
    let quotas = controller.store();
    let claims = ctx.caches.process().claim_updates();
    let applied_ctx = Arc::clone(&ctx);
    let known = quotas.clone();
    controller
        .reconcile_all_on(claim_triggers(claims, quotas))
        .graceful_shutdown_on(async move { shutdown.cancelled().await })
        .run(reconcile, RETRY.error_policy(), ctx)
        .for_each(|result| {
            // A quota gone from the cache is deleted: its failures and series are history.
            RETRY.applied(&applied_ctx, &result);
            let keys: BTreeSet<(String, String)> = known
                .state()
                .iter()
                .map(|q| (q.namespace().unwrap_or_default(), q.name_any()))
                .collect();
            applied_ctx.metrics.quota().retain(&keys);
            std::future::ready(())
        })
        .await;
    Ok(())
}

/// One item per claim change that may move a quota's usage: a claim created or changed in a
/// namespace that has a quota, any deletion (which carries no namespace here) and any relist.
/// Each recounts every quota ([`Controller::reconcile_all_on`]; kube-runtime's per-object
/// routing of foreign triggers is unstable in kube 5): quotas are few, a recount reads only
/// the caches and writes only a status that changed, and triggers that arrive while a quota
/// waits for its recount are merged into it.
fn claim_triggers(
    claims: impl Stream<Item = Change<ResourceClaim>> + Send + 'static,
    quotas: Store<GpuQuota>,
) -> impl Stream<Item = ()> + Send + 'static {
    claims.filter_map(move |change| {
        let counts = match &change {
            Change::Applied { object, .. } => {
                let namespace = object.namespace();
                quotas.state().iter().any(|q| q.namespace() == namespace)
            }
            Change::Deleted | Change::Listed => !quotas.is_empty(),
        };
        std::future::ready(counts.then_some(()))
    })
}

/// Recounts one GpuQuota (see the module documentation).
///
/// # Errors
///
/// API errors reading the quota or writing its status ([`Error::Write`], told on the quota as
/// a Warning Event when refused or persistent), a conflict that outlasted the retries, a
/// quota without namespace; [`RETRY`]'s error policy retries them with per-object back-off.
pub async fn reconcile(quota: Arc<GpuQuota>, ctx: Arc<Context>) -> Result<Action> {
    RETRY
        .reconcile(
            &ctx,
            RETRY.key(quota.as_ref()),
            Box::pin(recount(&quota, &ctx)),
            async |write, source, attempts| {
                // `kubectl describe gpuquota` is where the namespace's admin looks.
                let regarding = [quota.object_ref(&())];
                ctx.report_write_failure(write, source, attempts, &regarding)
                    .await;
            },
        )
        .await
}

async fn recount(quota: &GpuQuota, ctx: &Context) -> Result<Action> {
    if quota.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let namespace = quota.namespace().ok_or(Error::MissingField {
        kind: "GpuQuota",
        field: "namespace",
    })?;
    let name = quota.name_any();
    let api = Api::<GpuQuota>::namespaced(ctx.client.clone(), &namespace);
    let write = || Write::update("gpuquotas/status", Some(&namespace), &name);
    let mut current = quota.clone();
    let mut tries = 0;
    loop {
        tries += 1;
        let ready = readiness(&current);
        let usage = count(&current, &namespace, ctx);
        let status = desired_status(&current, &usage, &ready);
        record_metrics(ctx, &current, usage.total, &ready);
        let requeue = Action::requeue(next_recount(ctx, &usage));
        if current.status.as_ref() == Some(&status) {
            return Ok(requeue);
        }
        match replace_status(&api, ctx, &current, status).await {
            Ok(written) => {
                if ready_changed(current.status.as_ref(), &written) {
                    publish_event(&current, ctx, &ready).await;
                }
                return Ok(requeue);
            }
            // An admission wrote meanwhile: count again from what it wrote.
            Err(error) if is_conflict(&error) && tries < CONFLICT_TRIES => {
                current = api.get(&name).await.map_err(|e| Error::write(write(), e))?;
            }
            Err(error) => return Err(Error::write(write(), error)),
        }
    }
}

/// What the namespace's claims hold now.
fn count(quota: &GpuQuota, namespace: &str, ctx: &Context) -> Usage {
    let process = ctx.caches.process();
    let driver = ctx.config.driver_name.as_str();
    let classes = |name: &str| {
        super::classes::quota_class(&process.device_classes, &process.gpu_classes, driver, name)
    };
    let claims = ctx.caches.claims.state();
    let in_namespace = claims
        .iter()
        .filter(|c| c.metadata.namespace.as_deref() == Some(namespace))
        .map(AsRef::as_ref);
    let admitted = quota
        .status
        .as_ref()
        .map(|s| s.admitted.as_slice())
        .unwrap_or_default();
    usage(
        in_namespace,
        admitted,
        Timestamp::now(),
        ctx.config.quota.admitted_grace,
        |claim| claim_charge(claim, driver, classes),
    )
}

/// When to recount without a change: at the resync, or sooner when an admitted entry expires
/// (its claim never came, and its charge must go).
fn next_recount(ctx: &Context, usage: &Usage) -> Duration {
    let settings = ctx.config.quota;
    let now = Timestamp::now();
    usage
        .admitted
        .iter()
        .map(|entry| {
            let age = now.duration_since(entry.time.0);
            let age = if age.is_negative() {
                Duration::ZERO
            } else {
                age.unsigned_abs()
            };
            // A moment past the grace, so the entry has expired when the recount runs.
            settings
                .admitted_grace
                .saturating_sub(age)
                .saturating_add(Duration::from_millis(100))
        })
        .fold(settings.resync, Duration::min)
}

/// Replaces `quota`'s status with `status`, conditional on the `resourceVersion` read.
async fn replace_status(
    api: &Api<GpuQuota>,
    ctx: &Context,
    quota: &GpuQuota,
    status: GpuQuotaStatus,
) -> std::result::Result<GpuQuotaStatus, kube::Error> {
    let mut next = quota.clone();
    next.status = Some(status);
    let params = PostParams {
        dry_run: false,
        field_manager: Some(ctx.config.field_manager.clone()),
    };
    let written = api
        .replace_status(&quota.name_any(), &params, &next)
        .await?;
    Ok(written.status.unwrap_or_default())
}

fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.is_conflict())
}

/// The gauges of `quota`: `used`, and `hard` while the quota is enforced.
fn record_metrics(ctx: &Context, quota: &GpuQuota, used: GpuAmount, ready: &Verdict) {
    let namespace = quota.namespace().unwrap_or_default();
    let hard = ready
        .ok
        .then(|| {
            let amount = quota.spec.hard.amount("spec.hard").ok()?;
            let caps = quota.spec.hard.caps();
            Some((amount, [caps.memory, caps.compute, caps.gpus]))
        })
        .flatten();
    ctx.metrics
        .quota()
        .set(&namespace, &quota.name_any(), used, hard);
}

/// Events are best effort: a quota whose Event cannot be written is still recounted.
async fn publish_event(quota: &GpuQuota, ctx: &Context, ready: &Verdict) {
    let event = Event {
        type_: if ready.ok {
            EventType::Normal
        } else {
            EventType::Warning
        },
        reason: ready.reason.to_owned(),
        note: Some(ready.message.clone()),
        action: "Recount".to_owned(),
        secondary: None,
    };
    if let Err(error) = ctx.recorder.publish(&event, &quota.object_ref(&())).await {
        tracing::warn!(quota = %quota.name_any(), %error, "cannot publish Event");
    }
}
