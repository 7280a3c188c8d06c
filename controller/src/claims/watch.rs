//! Wiring the reconciler to the watches: one watch per kind feeds a store and the reconcile
//! queue (the claims' watch is the process's, shared with the webhook).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::runtime::controller::{
    self, Config as ApplierConfig, ReconcileReason, ReconcileRequest, trigger_with,
};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt as _, applier, watcher};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;

use super::context::{ClaimSettings, ClaimsContext};
use super::pod_index::PodsByClaim;
use super::reconcile::{CONTROLLER, error_policy, object_key, reconcile};
use super::{consumers, node_label, ownership};
use crate::cache::{Change, ProcessCaches, strip};
use crate::context::Context;
use crate::error::Result;
use kerf_api::watch_backoff::WatchBackoff;

type Applied = std::result::Result<
    (ObjectRef<ResourceClaim>, controller::Action),
    controller::Error<crate::Error, Infallible>,
>;

/// What a finished reconcile leaves behind: a claim gone from the cache is deleted, so its
/// failures are history; the other outcomes were logged by the reconcile or its error policy.
fn applied(ctx: &ClaimsContext, result: Applied) {
    match result {
        Err(controller::Error::ObjectNotFound(gone)) => {
            let key = object_key(gone.namespace.as_deref(), &gone.name);
            ctx.base.backoff.forget(&key);
        }
        Err(error) => tracing::debug!(controller = CONTROLLER, %error, "reconcile not done"),
        Ok(_) => {}
    }
}

/// How long a stopping controller lets running reconciles finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

type Request = std::result::Result<ReconcileRequest<ResourceClaim>, watcher::Error>;

/// Runs the claim controller until `shutdown`.
///
/// One watch per kind feeds both a store and the reconcile queue, and the store is written
/// before the event is queued, so a reconcile never sees a pod or claim older than the event
/// that triggered it. The claim watch is the process's (shared with the webhook, see
/// [`ProcessCaches`]); pods and nodes, which only the leader reads, are watched here, stripped
/// of what kerf never reads ([`strip`]). Claims trigger themselves; pods trigger the claims they use (creation,
/// scheduling, deletion); an allocation by someone else triggers the controller claims that
/// must yield its devices; and every claim is reconciled again each resync period. Ownership
/// of the devices is decided next to it, every [`ClaimSettings::ownership_tick`], and the
/// claims' node label by [`node_label`] on the same claim events and store.
///
/// # Errors
/// Never returns an error today; the signature fits [`crate::ControllerTask`].
pub async fn run(
    base: Arc<Context>,
    shutdown: CancellationToken,
    settings: ClaimSettings,
) -> Result<()> {
    let client = base.client.clone();
    let resync_period = base.config.resync_period;
    // The process-wide claim store, shared with the webhook (see `ProcessCaches`).
    let claims = base.caches.claims.clone();
    // The node label reconciler runs on the same watch and store: every claim event goes to
    // both queues, after the store has it.
    let (label_trigger, label_triggered) = tokio::sync::mpsc::unbounded_channel();
    // Bumped after every pod, node and claim store write: what wakes the ownership pass.
    let ownership_inputs = ownership::InputChanges::default();
    let claim_requests = claim_events(base.caches.process(), label_trigger, &ownership_inputs);
    let labels = node_label::run(
        Arc::clone(&base),
        claims.clone(),
        label_requests(label_triggered, claims.clone(), resync_period),
        shutdown.clone(),
        SHUTDOWN_GRACE,
    );
    let (pods, pod_writer) = reflector::store();
    let pods_by_claim = PodsByClaim::default();
    let pod_requests = trigger_with(
        reflector::reflector(
            pod_writer,
            watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
                .backoff(WatchBackoff::default())
                .modify(strip::pod),
        )
        .inspect(ownership_inputs.pod_bumper())
        // After the store, before the pod's claims are queued (see `PodsByClaim`).
        .inspect(pods_by_claim.updater())
        .touched_objects(),
        pod_claim_refs,
    );
    let (nodes, node_writer) = reflector::store();
    let node_watch = reflector::reflector(
        node_writer,
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .backoff(WatchBackoff::default())
            .modify(strip::node),
    )
    .inspect(ownership_inputs.node_bumper())
    .for_each(|_| std::future::ready(()));
    let (trigger, triggered) = tokio::sync::mpsc::unbounded_channel();
    let ctx = Arc::new(ClaimsContext::new(
        base,
        claims.clone(),
        (pods, pods_by_claim),
        nodes,
        ownership_inputs,
        trigger,
        settings,
    ));
    let ownership = ownership::run(Arc::clone(&ctx), shutdown.clone());
    let yield_requests = stream::unfold(triggered, |mut triggered| async move {
        let claim = triggered.recv().await?;
        Some((Ok(claim.into()), triggered))
    });
    let queue = stream::select_all([
        claim_requests.boxed(),
        pod_requests.boxed(),
        yield_requests.boxed(),
        resync_requests(claims.clone(), resync_period).boxed(),
    ])
    .filter_map(|request: Request| {
        std::future::ready(match request {
            Ok(request) => Some(Ok::<_, Infallible>(request)),
            Err(error) => {
                tracing::warn!(controller = CONTROLLER, %error, "watch failed; retrying");
                None
            }
        })
    })
    .take_until(shutdown.clone().cancelled_owned());
    let applied_ctx = Arc::clone(&ctx);
    let reconciles = applier(
        |claim, ctx| Box::pin(reconcile(claim, ctx)),
        error_policy,
        ctx,
        claims,
        queue,
        ApplierConfig::default(),
    )
    .for_each(move |result| {
        applied(&applied_ctx, result);
        std::future::ready(())
    });
    tokio::pin!(reconciles);
    let controller = async {
        tokio::select! {
            () = &mut reconciles => {}
            () = node_watch => {}
            () = shutdown.cancelled() => {
                // The queue has ended: running reconciles finish, then the applier stops.
                if tokio::time::timeout(SHUTDOWN_GRACE, &mut reconciles).await.is_err() {
                    tracing::warn!(controller = CONTROLLER, "reconciles did not finish in time");
                }
            }
        }
    };
    tokio::join!(controller, ownership, labels);
    // The watches only end with the process; what matters is that the controller stopped.
    shutdown.cancelled().await;
    Ok(())
}

/// The claims the process-wide watch brings, after its store has them (see
/// [`ProcessCaches::claim_updates`]): a reconcile request each, also sent to `labels`. Every
/// change, deletions included, bumps `ownership_inputs`.
fn claim_events(
    caches: &ProcessCaches,
    labels: UnboundedSender<ReconcileRequest<ResourceClaim>>,
    ownership_inputs: &ownership::InputChanges,
) -> impl futures::Stream<Item = Request> + Send + 'static {
    caches
        .claim_updates()
        .inspect(ownership_inputs.bumper())
        .filter_map(move |change| {
            std::future::ready(match change {
                Change::Applied { object, .. } => {
                    // Only fails once the label reconciler stopped, i.e. while shutting down.
                    let _ = labels.send(node_label::request(&object));
                    Some(Ok(ReconcileRequest {
                        obj_ref: ObjectRef::from_obj(object.as_ref()),
                        reason: ReconcileReason::ObjectUpdated,
                    }))
                }
                Change::Deleted | Change::Listed => None,
            })
        })
}

/// The node label reconciler's queue: the claims `triggered` names, and every cached claim
/// once per `period`.
fn label_requests(
    triggered: UnboundedReceiver<ReconcileRequest<ResourceClaim>>,
    claims: reflector::Store<ResourceClaim>,
    period: Duration,
) -> impl futures::Stream<Item = ReconcileRequest<ResourceClaim>> + Send + 'static {
    stream::select(
        stream::unfold(triggered, |mut triggered| async move {
            let request = triggered.recv().await?;
            Some((request, triggered))
        }),
        resync_requests(claims, period).filter_map(|r| std::future::ready(r.ok())),
    )
}

/// Every cached claim, once per `period`: a safety net for missed events.
fn resync_requests(
    claims: reflector::Store<ResourceClaim>,
    period: Duration,
) -> impl futures::Stream<Item = Request> + Send + 'static {
    let start = tokio::time::Instant::now() + period;
    stream::unfold(
        tokio::time::interval_at(start, period.max(Duration::from_millis(1))),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
    .flat_map(move |()| {
        stream::iter(claims.state().into_iter().map(|claim| {
            Ok(ReconcileRequest {
                obj_ref: ObjectRef::from_obj(claim.as_ref()),
                reason: ReconcileReason::BulkReconcile,
            })
        }))
    })
}

/// Pod changes trigger the pod's claims.
#[allow(clippy::needless_pass_by_value)] // the signature is kube-runtime's
fn pod_claim_refs(pod: Pod) -> Vec<ObjectRef<ResourceClaim>> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    consumers::pod_claims(&pod)
        .names
        .into_iter()
        .map(|name| ObjectRef::new(&name).within(&namespace))
        .collect()
}
