//! The watches of the kinds both the admission webhook and the reconcilers read: every
//! ResourceClaim, DeviceClass, GpuClass and GpuQuota, watched once per process. The webhook
//! serves on every replica for the whole process; a leadership term borrows these stores
//! instead of watching the same objects a second (and, for claims, a third) time. The quota
//! webhook and the leader's quota recount price claims from the same GpuClass store, so they
//! agree on what a claim costs.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use futures::{Stream, StreamExt as _, stream};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::{GpuClass, GpuQuota};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::watch;

use super::{Change, cache, strip};
use crate::error::{Error, Result};

/// Read handles of the process-wide caches. Clones share the stores.
#[derive(Clone)]
pub struct ProcessCaches {
    /// Every ResourceClaim of the cluster.
    pub claims: Store<ResourceClaim>,
    /// Every DeviceClass of the cluster.
    pub device_classes: Store<DeviceClass>,
    /// Every GpuClass: its status sizes the devices a quota charges
    /// (`crate::quota::classes::quota_class`).
    pub gpu_classes: Store<GpuClass>,
    /// Every GpuQuota of the cluster, which the quota webhook checks claims against.
    pub gpu_quotas: Store<GpuQuota>,
    /// Counts changes of the claim and DeviceClass stores (see [`super::Caches::changes`]);
    /// GpuClass and GpuQuota changes do not count: the reconcilers that read the counter do
    /// not read those stores.
    pub(super) changes: watch::Receiver<u64>,
    claim_subscribers: Arc<Subscribers>,
    /// One waiter at a time on the stores' readiness; see [`super::Caches::wait_ready`]. Shared
    /// by every clone, since clones of a store share its one-waiter readiness signal.
    ready_waiters: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for ProcessCaches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessCaches")
            .field("claims", &self.claims.len())
            .field("device_classes", &self.device_classes.len())
            .field("gpu_classes", &self.gpu_classes.len())
            .field("gpu_quotas", &self.gpu_quotas.len())
            .finish_non_exhaustive()
    }
}

impl ProcessCaches {
    /// Creates the caches and the future that fills them; the stores stay empty until that
    /// future is polled. It runs until dropped: watch errors are retried with back-off.
    pub fn start(client: &Client) -> (Self, impl Future<Output = ()> + Send + use<>) {
        let (notify, changes) = watch::channel(0u64);
        let claim_subscribers = Arc::new(Subscribers::default());
        let all = watcher::Config::default;
        let (claims, claim_changes) = cache(
            Api::all(client.clone()),
            all(),
            "ResourceClaim",
            strip::claim,
        );
        // Runs after the store was written: a subscriber never sees a claim the store lacks.
        let publish = Arc::clone(&claim_subscribers);
        let claim_ticks = claim_changes.filter_map(move |change| {
            publish.send(&change);
            std::future::ready(change.tick())
        });
        let (device_classes, class_changes) = cache(
            Api::all(client.clone()),
            all(),
            "DeviceClass",
            strip::managed_fields,
        );
        let class_ticks = class_changes.filter_map(|change| std::future::ready(change.tick()));
        let (gpu_classes, gpu_class_changes) = cache(
            Api::all(client.clone()),
            all(),
            "GpuClass",
            strip::managed_fields,
        );
        let (gpu_quotas, quota_changes) = cache(
            Api::all(client.clone()),
            all(),
            "GpuQuota",
            strip::managed_fields,
        );
        // Polled for their stores only: they tick nothing.
        let quiet = stream::select(
            gpu_class_changes.filter_map(|_| std::future::ready(None)),
            quota_changes.filter_map(|_| std::future::ready(None)),
        );
        let ticks = stream::select(stream::select(claim_ticks, class_ticks), quiet);
        let fill = ticks.for_each(move |()| {
            notify.send_modify(|n| *n = n.wrapping_add(1));
            std::future::ready(())
        });
        let caches = Self {
            claims,
            device_classes,
            gpu_classes,
            gpu_quotas,
            changes,
            claim_subscribers,
            ready_waiters: Arc::default(),
        };
        (caches, fill)
    }

    /// Waits until every store holds its first complete list.
    ///
    /// # Errors
    ///
    /// [`Error::ControllerStopped`] when the future filling the caches was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "caches",
            message: "the caches stopped before their first list completed".to_owned(),
        };
        // kube-runtime 5's `Store::wait_until_ready` keeps the waker of one waiter only
        // (`DelayedInit` polls a futures oneshot receiver), so a second concurrent waiter can
        // make the first sleep for ever: waiters queue on a fair lock instead.
        let _one_at_a_time = self.ready_waiters.lock().await;
        self.claims.wait_until_ready().await.map_err(stopped)?;
        self.device_classes
            .wait_until_ready()
            .await
            .map_err(stopped)?;
        self.gpu_classes.wait_until_ready().await.map_err(stopped)?;
        self.gpu_quotas.wait_until_ready().await.map_err(stopped)
    }

    /// Every change of the claim store, after the store has it: first every claim already in
    /// the store, as a fresh watch's first list would bring them ([`Change::Applied`] with
    /// `listed`), then each change as it comes. Ends when the caches stop.
    ///
    /// A claim written between the first part and the second may come twice; none is missed:
    /// the store is read and the subscriber added under the lock each claim is sent under,
    /// and a claim is sent only after the store has it.
    pub(crate) fn claim_updates(&self) -> impl Stream<Item = Change<ResourceClaim>> + Send + use<> {
        let receiver = self.claim_subscribers.subscribe(&self.claims);
        stream::unfold(receiver, |mut receiver| async move {
            let claim = receiver.recv().await?;
            Some((claim, receiver))
        })
    }
}

/// The senders of [`ProcessCaches::claim_updates`]. Unbounded: a subscriber is a reconcile
/// queue that drains as fast as it is fed, and one slow subscriber must not hold back the
/// store (and with it the webhook).
#[derive(Default)]
struct Subscribers {
    senders: Mutex<Vec<UnboundedSender<Change<ResourceClaim>>>>,
}

impl Subscribers {
    fn send(&self, claim: &Change<ResourceClaim>) {
        // A sender whose receiver is gone (a subscriber that stopped) is dropped here.
        self.lock()
            .retain(|sender| sender.send(claim.clone()).is_ok());
    }

    fn subscribe(&self, store: &Store<ResourceClaim>) -> UnboundedReceiver<Change<ResourceClaim>> {
        let (sender, receiver) = unbounded_channel();
        let mut senders = self.lock();
        for claim in store.state() {
            // Cannot fail: the receiver is in hand.
            let _ = sender.send(Change::Applied {
                object: claim,
                listed: true,
            });
        }
        senders.push(sender);
        receiver
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<UnboundedSender<Change<ResourceClaim>>>> {
        // A vector of senders is consistent whatever panicked while it was locked.
        self.senders.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use kube::runtime::reflector;

    fn claim(name: &str) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..ObjectMeta::default()
            },
            ..ResourceClaim::default()
        }
    }

    fn name(change: Change<ResourceClaim>) -> (String, bool) {
        match change {
            Change::Applied { object, listed } => (object.metadata.name.clone().unwrap(), listed),
            other => panic!("not an applied claim: {other:?}"),
        }
    }

    #[test]
    fn a_late_subscriber_sees_the_store_first_then_each_change() {
        let (store, mut writer) = reflector::store::<ResourceClaim>();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitApply(claim("a")));
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let subscribers = Subscribers::default();
        drop(subscribers.subscribe(&store));
        let mut late = subscribers.subscribe(&store);
        assert_eq!(name(late.try_recv().unwrap()), ("a".to_owned(), true));
        assert!(late.try_recv().is_err(), "the store held one claim");

        let b = claim("b");
        writer.apply_watcher_event(&watcher::Event::Apply(b.clone()));
        subscribers.send(&Change::Applied {
            object: Arc::new(b),
            listed: false,
        });
        subscribers.send(&Change::Deleted);
        assert_eq!(name(late.try_recv().unwrap()), ("b".to_owned(), false));
        assert!(matches!(late.try_recv(), Ok(Change::Deleted)));
        assert_eq!(
            subscribers.lock().len(),
            1,
            "a subscriber that stopped is dropped"
        );
    }
}
