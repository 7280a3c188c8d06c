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
    Config as ApplierConfig, ReconcileReason, ReconcileRequest, trigger_with,
};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt as _, applier, watcher};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio_util::sync::CancellationToken;

use super::reconcile::{CONTROLLER, RETRY, reconcile};
use super::{consumers, node_label, ownership};
use crate::cache::{Change, strip};
use crate::claims::ClaimsContext;
use crate::context::Context;
use crate::error::Result;
use kerf_api::watch_backoff::WatchBackoff;

/// How long a stopping controller lets running reconciles finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

type Request = std::result::Result<ReconcileRequest<ResourceClaim>, watcher::Error>;

/// Runs the claim controller until `shutdown`.
///
/// One watch per kind feeds both a store and the reconcile queue, and the store is written before
/// the event is queued, so a reconcile never sees a pod or claim older than the event that
/// triggered it. The claim watch is the process's (shared with the webhook, see
/// [`ProcessCaches`](crate::cache::ProcessCaches)); pods and nodes, which only the leader reads,
/// are watched here into the stores of the claim controller's [`ClaimsContext`], stripped of what kerf never reads
/// ([`strip`]). Claims trigger themselves; pods trigger the claims they use (creation, scheduling,
/// deletion); an allocation by someone else triggers the controller claims that must yield its
/// devices; and every claim is reconciled again each resync period. Ownership of the devices is
/// decided next to it, every [`ClaimSettings::ownership_tick`](super::ClaimSettings), and the
/// claims' node label by `node_label.rs` on the same claim events and store.
///
/// # Errors
/// [`Error::ControllerStopped`] when a watch or the reconcile queue stops on its own.
pub async fn run(core: Arc<Context>, shutdown: CancellationToken) -> Result<()> {
    let (ctx, feeds) = ClaimsContext::new(core);
    let ctx = Arc::new(ctx);
    // kube-runtime's applier waits for its store's first list itself, and kube-runtime 5
    // wakes only the last of several waiters on one store (see `ProcessCaches::wait_ready`):
    // the two appliers below share the claim store with kerf's own waiters, so they start only
    // once it is ready and their wait returns at once. (The pod and node stores cannot be
    // awaited here: the appliers' queue and the node watch below fill them.)
    tokio::select! {
        () = shutdown.cancelled() => return Ok(()),
        ready = ctx.core.caches.process().wait_ready() => ready?,
    }
    let resync_period = ctx.core.config.resync_period;
    let claims = ctx.core.caches.claims.clone();
    // The node label reconciler runs on the same watch and store: every claim event goes to
    // both queues, after the store has it.
    let (label_trigger, label_triggered) = tokio::sync::mpsc::unbounded_channel();
    let claim_requests = claim_events(Arc::clone(&ctx), label_trigger);
    let labels = node_label::run(
        Arc::clone(&ctx),
        label_requests(label_triggered, claims.clone(), resync_period),
        shutdown.clone(),
        SHUTDOWN_GRACE,
    );
    let yield_requests = stream::unfold(feeds.triggered, |mut triggered| async move {
        let claim = triggered.recv().await?;
        Some((Ok(claim.into()), triggered))
    });
    let queue = stream::select_all([
        claim_requests.boxed(),
        pod_requests(&ctx, feeds.pods).boxed(),
        yield_requests.boxed(),
        resync_requests(claims, resync_period).boxed(),
    ]);
    let node_watch = node_watch(&ctx, feeds.nodes);
    let ownership = ownership::run(Arc::clone(&ctx), shutdown.clone());
    let pools = super::fragmentation::run(Arc::clone(&ctx), shutdown.clone());
    let taints = super::idle_gpus_taint::run(Arc::clone(&ctx), shutdown.clone());
    let controller = reconcile_until(ctx, queue, node_watch, &shutdown);
    tokio::join!(controller, ownership, labels, pools, taints);
    // The watches only end with the process; what matters is that the controller stopped.
    shutdown.cancelled().await;
    Ok(())
}

/// Reconciles the claims `queue` names until `shutdown` (or until `node_watch`, which feeds
/// the node store, ends), letting running reconciles finish for at most [`SHUTDOWN_GRACE`].
async fn reconcile_until(
    ctx: Arc<ClaimsContext>,
    queue: impl futures::Stream<Item = Request> + Send + 'static,
    node_watch: impl Future<Output = ()>,
    shutdown: &CancellationToken,
) {
    let queue = queue
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
        RETRY.error_policy(),
        ctx.clone(),
        ctx.core.caches.claims.clone(),
        queue,
        ApplierConfig::default(),
    )
    .for_each(move |result| {
        RETRY.applied(&applied_ctx.core, &result);
        std::future::ready(())
    });
    tokio::pin!(reconciles);
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
}

/// The pod watch: writes the pod store through `writer`, then the pod index, the pod kinds
/// and the nodes' books, then bumps the ownership inputs, and asks for the reconcile of each changed pod's
/// claims.
fn pod_requests(
    ctx: &Arc<ClaimsContext>,
    writer: reflector::store::Writer<Pod>,
) -> impl futures::Stream<Item = Request> + Send + 'static {
    let usage_ctx = Arc::clone(ctx);
    trigger_with(
        reflector::reflector(
            writer,
            watcher(
                Api::<Pod>::all(ctx.core.client.clone()),
                watcher::Config::default(),
            )
            .backoff(WatchBackoff::default())
            .modify(strip::pod),
        )
        .inspect(ctx.ownership_inputs.pod_bumper())
        // After the store, before the pod's claims are queued (see `PodsByClaim`).
        .inspect(ctx.pods_by_claim.updater())
        .inspect(move |item| {
            // A bound pod that went frees its node: claims waiting for room try again, as
            // kube-scheduler requeues unschedulable pods on a pod deletion.
            if let Ok(event) = item {
                usage_ctx.note_pod_latency(event);
                usage_ctx.pod_kinds.apply_pod_event(event);
                if usage_ctx.node_usage.apply_pod_event(event) {
                    usage_ctx.capacity_freed();
                }
            }
        })
        .touched_objects(),
        pod_claim_refs,
    )
}

/// The node watch: writes the node store through `writer`, then the nodes' books, and bumps
/// the ownership inputs.
fn node_watch(
    ctx: &Arc<ClaimsContext>,
    writer: reflector::store::Writer<Node>,
) -> impl Future<Output = ()> + Send + 'static {
    let usage_ctx = Arc::clone(ctx);
    reflector::reflector(
        writer,
        watcher(
            Api::<Node>::all(ctx.core.client.clone()),
            watcher::Config::default(),
        )
        .backoff(WatchBackoff::default())
        .modify(strip::node),
    )
    .inspect(ctx.ownership_inputs.node_bumper())
    .for_each(move |item| {
        if let Ok(event) = item
            && usage_ctx.node_usage.apply_node_event(&event)
        {
            usage_ctx.capacity_freed();
        }
        std::future::ready(())
    })
}

/// The claims the process-wide watch brings, after its store has them (see
/// [`crate::cache::ProcessCaches::claim_updates`]): a reconcile request each, also sent to
/// `labels`. Every change, deletions included, is noted in the bookkeeping (which then reads only
/// the changed claims again) and bumps the ownership inputs, both before the request is passed
/// on.
fn claim_events(
    ctx: Arc<ClaimsContext>,
    labels: UnboundedSender<ReconcileRequest<ResourceClaim>>,
) -> impl futures::Stream<Item = Request> + Send + 'static {
    let updates = ctx.core.caches.process().claim_updates();
    updates
        .inspect(move |change| {
            ctx.note_claim(change);
            ctx.ownership_inputs.bump();
            if let Change::Applied { object, .. } = change {
                ctx.note_claim_latency(object);
            }
        })
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
