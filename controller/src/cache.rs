//! Watch-fed caches of the objects the reconcilers read: kerf's ResourceSlices, every
//! ResourceClaim and every DeviceClass. Reconcilers read these stores instead of listing, so a
//! reconcile costs no API reads however many claims exist.
//!
//! [`Caches::changes`] says when anything in them changed. It is a `tokio::sync::watch`
//! counter, so a burst of events (a node publishing, a hundred claims being allocated) reaches
//! a slow subscriber as a single notification: this is what keeps "re-evaluate every GpuClass
//! on every claim change" cheap.

mod process;
mod resource_slice;
pub mod strip;

use std::fmt::Debug;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt as _, TryStreamExt as _, stream};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use crate::error::{Error, Result};
use kerf_api::watch_backoff::WatchBackoff;

pub use process::ProcessCaches;
pub(crate) use resource_slice::CompactDevice;
pub use resource_slice::{CompactResourceSlice, Interner};

/// Read handles of the caches. Clones share the same stores.
#[derive(Clone)]
pub struct Caches {
    /// ResourceSlices of the driver (all generations; see [`crate::capacity::current_devices`]),
    /// compacted ([`CompactResourceSlice`]).
    pub slices: Store<CompactResourceSlice>,
    /// Every ResourceClaim of the cluster (the store of [`ProcessCaches::claims`]).
    pub claims: Store<ResourceClaim>,
    /// Every DeviceClass of the cluster (the store of [`ProcessCaches::device_classes`]).
    pub device_classes: Store<DeviceClass>,
    process: ProcessCaches,
    changes: watch::Receiver<u64>,
    /// One waiter at a time on the slices' readiness; see [`Caches::wait_ready`].
    ready_waiters: Arc<tokio::sync::Mutex<()>>,
}

impl Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("slices", &self.slices.len())
            .field("claims", &self.claims.len())
            .field("device_classes", &self.device_classes.len())
            .finish_non_exhaustive()
    }
}

impl Caches {
    /// Creates the caches for `driver`, with [`ProcessCaches`] of their own, and the future
    /// that fills them; the stores stay empty until that future is polled (run it next to the
    /// controllers that read the caches). It runs until dropped: watch errors are retried
    /// with back-off.
    pub fn start(client: &Client, driver: &str) -> (Self, impl Future<Output = ()> + Send + use<>) {
        let (process, fill_process) = ProcessCaches::start(client);
        let (caches, fill) = Self::start_with(&process, client, driver);
        let fill = async move {
            futures::future::join(fill_process, fill).await;
        };
        (caches, fill)
    }

    /// Creates the caches for `driver` on the claims and DeviceClasses of `process` (filled
    /// by its own future), and the future that fills the rest: the driver's ResourceSlices.
    pub fn start_with(
        process: &ProcessCaches,
        client: &Client,
        driver: &str,
    ) -> (Self, impl Future<Output = ()> + Send + use<>) {
        let (notify, changes) = watch::channel(0u64);
        let slice_config = watcher::Config::default().fields(&format!("spec.driver={driver}"));
        let (slices, slice_ticks) = slice_cache(Api::all(client.clone()), slice_config);
        let process_ticks = stream::unfold(process.changes.clone(), |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        });
        let fill = stream::select(slice_ticks, process_ticks).for_each(move |()| {
            notify.send_modify(|n| *n = n.wrapping_add(1));
            std::future::ready(())
        });
        let caches = Self {
            slices,
            claims: process.claims.clone(),
            device_classes: process.device_classes.clone(),
            process: process.clone(),
            changes,
            ready_waiters: Arc::default(),
        };
        (caches, fill)
    }

    /// The process-wide part of the caches.
    pub fn process(&self) -> &ProcessCaches {
        &self.process
    }

    /// Waits until every cache holds its first complete list.
    ///
    /// # Errors
    ///
    /// [`Error::ControllerStopped`] when a future filling the caches was dropped first.
    pub async fn wait_ready(&self) -> Result<()> {
        let stopped = |_| Error::ControllerStopped {
            name: "caches",
            message: "the caches stopped before their first list completed".to_owned(),
        };
        {
            // kube-runtime 5's `Store::wait_until_ready` keeps the waker of one waiter only
            // (`DelayedInit` polls a futures oneshot receiver), so a second concurrent waiter
            // can make the first sleep for ever: waiters queue on a fair lock instead.
            let _one_at_a_time = self.ready_waiters.lock().await;
            self.slices.wait_until_ready().await.map_err(stopped)?;
        }
        self.process.wait_ready().await
    }

    /// A stream that yields after the caches changed: an object was added, modified or deleted,
    /// or a (re)list completed. It yields at most once per `min_interval`: changes that happen
    /// while the subscriber is busy or within the interval are coalesced into one item, so a
    /// burst of claim writes costs its subscriber one pass per interval, not one per write.
    /// The first change after a quiet interval is passed on at once. Ends when the caches stop.
    pub fn changes(&self, min_interval: Duration) -> impl Stream<Item = ()> + Send + 'static {
        throttled(self.changes.clone(), min_interval)
    }
}

/// One item per change of `changes`, at most one per `min_interval` (see [`Caches::changes`]).
fn throttled(
    changes: watch::Receiver<u64>,
    min_interval: Duration,
) -> impl Stream<Item = ()> + Send + 'static {
    let start = (changes, None::<tokio::time::Instant>);
    stream::unfold(start, move |(mut changes, last)| async move {
        if let Some(last) = last {
            tokio::time::sleep_until(last + min_interval).await;
        }
        // A change during the sleep is still unseen, so this returns at once for it.
        changes.changed().await.ok()?;
        Some(((), (changes, Some(tokio::time::Instant::now()))))
    })
}

/// What a cache's watch did, once its store has it.
#[derive(Debug)]
pub enum Change<K> {
    /// An object was added or modified; `listed` when it came with a (re)list, which the store
    /// shows only once the list is complete ([`Change::Listed`]).
    Applied {
        /// The object as the watch brought it (stripped like the store's copy).
        object: Arc<K>,
        /// True for an object of a (re)list.
        listed: bool,
    },
    /// An object was deleted.
    Deleted,
    /// A (re)list completed: the store holds it now.
    Listed,
}

impl<K> Clone for Change<K> {
    fn clone(&self) -> Self {
        match self {
            Change::Applied { object, listed } => Change::Applied {
                object: Arc::clone(object),
                listed: *listed,
            },
            Change::Deleted => Change::Deleted,
            Change::Listed => Change::Listed,
        }
    }
}

impl<K> Change<K> {
    /// `Some` for a change the store shows now: not an object of a list still coming in.
    fn tick(&self) -> Option<()> {
        match self {
            Change::Applied { listed: true, .. } => None,
            Change::Applied { .. } | Change::Deleted | Change::Listed => Some(()),
        }
    }
}

/// The reflector of kerf's ResourceSlices: each slice compacted ([`CompactResourceSlice`]) before the
/// store keeps it, and a stream with one item per change the store shows (watch errors are
/// logged and retried with back-off).
fn slice_cache(
    api: Api<ResourceSlice>,
    config: watcher::Config,
) -> (
    Store<CompactResourceSlice>,
    impl Stream<Item = ()> + Send + 'static,
) {
    let (store, writer) = reflector::store();
    let mut interner = Interner::default();
    let compacted = watcher(api, config)
        .backoff(WatchBackoff::default())
        .map_ok(move |event| compact_event(event, &mut interner));
    let ticks = reflector(writer, compacted).filter_map(|event| {
        std::future::ready(match event {
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                Some(())
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => None,
            Err(error) => {
                tracing::warn!(kind = "ResourceSlice", %error, "watch failed; retrying");
                None
            }
        })
    });
    (store, ticks)
}

fn compact_event(
    event: watcher::Event<ResourceSlice>,
    interner: &mut Interner,
) -> watcher::Event<CompactResourceSlice> {
    let mut compact = |slice| CompactResourceSlice::new(slice, interner);
    match event {
        watcher::Event::Apply(slice) => watcher::Event::Apply(compact(slice)),
        watcher::Event::Delete(slice) => watcher::Event::Delete(compact(slice)),
        watcher::Event::InitApply(slice) => watcher::Event::InitApply(compact(slice)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// A reflector for `api` whose objects go through `strip` before the store keeps them: its
/// store and a stream of its changes (watch errors are logged and retried with back-off).
pub(crate) fn cache<K>(
    api: Api<K>,
    config: watcher::Config,
    kind: &'static str,
    strip: fn(&mut K),
) -> (Store<K>, impl Stream<Item = Change<K>> + Send + 'static)
where
    K: Resource<DynamicType = ()>
        + Clone
        + PartialEq
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    // The resourceVersion of an update that left the stripped object as the store holds it.
    // Set before the reflector writes the store (which it still does, for the new version)
    // and read right after, for the same event: one stream, one event at a time.
    let unchanged: Arc<Mutex<Option<String>>> = Arc::default();
    let (reader, noted) = (store.clone(), Arc::clone(&unchanged));
    let events = reflector(
        writer,
        watcher(api, config)
            .backoff(WatchBackoff::default())
            .modify(strip)
            .map(move |mut event| {
                if let Ok(watcher::Event::Apply(object)) = &mut event {
                    let same = reader
                        .get(&ObjectRef::from_obj(object))
                        .is_some_and(|cached| same_but_version(cached.as_ref(), object));
                    *lock(&noted) = same
                        .then(|| object.meta().resource_version.clone())
                        .flatten();
                }
                event
            }),
    )
    .filter_map(move |event| {
        std::future::ready(match event {
            Ok(watcher::Event::Apply(object)) => {
                let version = object.meta().resource_version.as_ref();
                if lock(&unchanged).take().as_ref() == version && version.is_some() {
                    None
                } else {
                    Some(Change::Applied {
                        object: Arc::new(object),
                        listed: false,
                    })
                }
            }
            Ok(watcher::Event::InitApply(object)) => Some(Change::Applied {
                object: Arc::new(object),
                listed: true,
            }),
            Ok(watcher::Event::Delete(_)) => Some(Change::Deleted),
            Ok(watcher::Event::InitDone) => Some(Change::Listed),
            Ok(watcher::Event::Init) => None,
            Err(error) => {
                tracing::warn!(kind, %error, "watch failed; retrying");
                None
            }
        })
    });
    (store, events)
}

/// True when `cached` and `object` differ in their resourceVersion at most. `object` lends
/// its resourceVersion slot for the comparison (and gets its own back), so that no copy of
/// an object is made on every watch event.
pub(crate) fn same_but_version<K: Resource + PartialEq>(cached: &K, object: &mut K) -> bool {
    let own = std::mem::replace(
        &mut object.meta_mut().resource_version,
        cached.meta().resource_version.clone(),
    );
    let same = cached == object;
    object.meta_mut().resource_version = own;
    same
}

fn lock(slot: &Mutex<Option<String>>) -> std::sync::MutexGuard<'_, Option<String>> {
    // An Option<String> is consistent whatever panicked while it was locked.
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;
    use std::time::Instant;

    #[tokio::test]
    async fn changes_are_coalesced_to_one_item_per_interval() {
        let interval = Duration::from_millis(200);
        let (notify, changes) = watch::channel(0u64);
        let mut stream = Box::pin(throttled(changes, interval));
        assert!(stream.next().now_or_never().is_none(), "no change, no item");

        notify.send_modify(|n| *n += 1);
        let first = Instant::now();
        assert_eq!(
            stream.next().await,
            Some(()),
            "the first change passes at once"
        );

        for _ in 0..5 {
            notify.send_modify(|n| *n += 1);
        }
        assert_eq!(stream.next().await, Some(()));
        assert!(
            first.elapsed() >= interval,
            "a burst waits for the interval: {:?}",
            first.elapsed()
        );
        assert!(
            stream.next().now_or_never().is_none(),
            "five changes within the interval make one item"
        );

        drop(notify);
        assert_eq!(stream.next().await, None, "ends when the caches stop");
    }
}
