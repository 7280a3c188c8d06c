//! The watch-fed cache of this node's ResourceClaims, so that a prepare needs no GET.
//!
//! One watch of `resourceclaims` across namespaces, label-selected by
//! [`kerf_api::claim_node_label::node_label_selector`] (the API server's watch cache filters
//! it, so the plugin receives only its node's claims), feeds a kube-runtime reflector
//! [`Store`]. A lookup is a hash lookup under the store's read lock and hands out the stored
//! `Arc`, never a copy of the claim.
//!
//! The cache answers only while its watch is in step with the API server: from the end of a
//! list until the next watch error or re-list. Before its first list, and while it lists again
//! after an error (when the store still holds the old list and may miss deletions), every
//! lookup is [`Cached::NotSynced`] and the prepare GETs; nothing ever waits for the cache.
//!
//! A prepare that misses can wait for the watch ([`ClaimCache::until_usable`]): every event the
//! watch applies wakes the waiters, which look their claim up again.
//!
//! A claim unprepared here is held back ([`Cached::HeldBack`]) until the watch shows its
//! allocation cleared or the claim gone: a claim reused by a later pod may be deallocated and
//! allocated anew under the same UID, and until the watch has caught up the cached copy would
//! still name the old devices.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt as _;
use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::claim_node_label::node_label_selector;
use kerf_api::watch_backoff::WatchBackoff;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt as _};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{ApiClaimReader, Cached, ClaimReader, Wanted};
use crate::Result;

/// This node's ResourceClaims as one label-selected watch sees them.
pub(crate) struct ClaimCache {
    store: Store<ResourceClaim>,
    /// True while the watch is in step with the API server (see the module docs).
    live: Arc<AtomicBool>,
    /// UIDs of claims unprepared here whose cleared allocation the watch has not shown yet.
    held_back: HeldBack,
    /// What the watch task needs, until [`ClaimCache::task`] takes it.
    source: Mutex<Option<Source>>,
    /// Counts the events the watch applied, so that [`ClaimCache::until_usable`] wakes up.
    changes: Arc<watch::Sender<u64>>,
}

struct Source {
    claims: Api<ResourceClaim>,
    selector: String,
    writer: reflector::store::Writer<ResourceClaim>,
}

impl ClaimCache {
    /// A cache of the claims labelled for `node`, read through `client`; empty and not synced
    /// until its [`ClaimCache::task`] runs.
    pub fn new(client: kube::Client, node: &str) -> Self {
        let (store, writer) = reflector::store();
        ClaimCache {
            store,
            live: Arc::new(AtomicBool::new(false)),
            held_back: HeldBack::default(),
            source: Mutex::new(Some(Source {
                claims: Api::all(client),
                selector: node_label_selector(node),
                writer,
            })),
            changes: Arc::new(watch::Sender::new(0)),
        }
    }

    /// The claim `namespace/name` as last watched, if the watch is in step.
    pub fn lookup(&self, namespace: &str, name: &str) -> Cached {
        if !self.live.load(Ordering::Acquire) {
            return Cached::NotSynced;
        }
        match self.store.get(&ObjectRef::new(name).within(namespace)) {
            Some(claim) if self.held_back.contains(claim.metadata.uid.as_deref()) => {
                Cached::HeldBack
            }
            Some(claim) => Cached::Found(claim),
            None => Cached::Absent,
        }
    }

    /// Resolves with the cached claim once it is usable for `wanted` ([`Wanted::usable`]): at
    /// once when it is, else after the watch event that makes it so. Never resolves when no
    /// such event comes; the caller races it against a GET.
    async fn until_usable(&self, wanted: &Wanted) -> Arc<ResourceClaim> {
        let mut changes = self.changes.subscribe();
        loop {
            // Marked seen before the lookup, so an event applied after it wakes the wait.
            changes.borrow_and_update();
            if let Ok(claim) = wanted.usable(self.lookup(&wanted.namespace, &wanted.name)) {
                return claim;
            }
            if changes.changed().await.is_err() {
                // Unreachable while `self` holds the sender; wait for the GET then.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether the claim with `uid` is held back (see [`ClaimCache::hold_back`]).
    fn is_held_back(&self, uid: &str) -> bool {
        self.held_back.contains(Some(uid))
    }

    /// Holds back the claim with `uid`, unprepared here, until the watch shows its allocation
    /// cleared or the claim gone (see the module docs).
    fn hold_back(&self, uid: &str) {
        self.held_back.insert(uid);
    }

    /// The watch that feeds the cache until `shutdown`; `None` once taken (one watch per
    /// cache). Errors are retried with [`WatchBackoff`] and never end the task.
    pub fn task(&self, shutdown: CancellationToken) -> Option<BoxFuture<'static, Result<()>>> {
        let source = self
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        let watched = Watched {
            live: Arc::clone(&self.live),
            held_back: self.held_back.clone(),
            store: self.store.clone(),
            changes: Arc::clone(&self.changes),
        };
        Some(Box::pin(run_watch(source, watched, shutdown)))
    }
}

/// What the watch task shares with the lookups.
struct Watched {
    live: Arc<AtomicBool>,
    held_back: HeldBack,
    store: Store<ResourceClaim>,
    changes: Arc<watch::Sender<u64>>,
}

/// Applies the watch's events to the store and keeps `live` in step with it.
async fn run_watch(source: Source, watched: Watched, shutdown: CancellationToken) -> Result<()> {
    let Source {
        claims,
        selector,
        writer,
    } = source;
    let Watched {
        live,
        held_back,
        store,
        changes,
    } = watched;
    tracing::info!(selector = %selector, "watching this node's ResourceClaims for the prepare cache");
    let events = watcher::watcher(claims, watcher::Config::default().labels(&selector))
        .backoff(WatchBackoff::default())
        // Nothing reads managedFields; they are often the largest part of a claim.
        .modify(|claim| claim.managed_fields_mut().clear())
        .reflect(writer);
    let mut events = std::pin::pin!(events);
    loop {
        let item = tokio::select! {
            () = shutdown.cancelled() => break,
            item = events.next() => item,
        };
        match item {
            Some(Ok(Event::InitDone)) => {
                forget_unlisted(&held_back, &store);
                if !live.swap(true, Ordering::AcqRel) {
                    tracing::info!("prepare cache synced: known claims prepare without a GET");
                }
            }
            Some(Ok(Event::Init)) => live.store(false, Ordering::Release),
            Some(Ok(Event::InitApply(claim) | Event::Apply(claim))) => {
                let allocated = claim
                    .status
                    .as_ref()
                    .is_some_and(|status| status.allocation.is_some());
                if !allocated {
                    held_back.remove(claim.metadata.uid.as_deref());
                }
            }
            Some(Ok(Event::Delete(claim))) => held_back.remove(claim.metadata.uid.as_deref()),
            Some(Err(error)) => {
                // Until the re-list ends, the store may hold claims deleted meanwhile.
                if live.swap(false, Ordering::AcqRel) {
                    tracing::warn!(%error, "claim watch failed; prepares GET their claims until it has listed again");
                } else {
                    tracing::debug!(%error, "claim watch failed again");
                }
            }
            None => break,
        }
        // The store and `live` already show the event; a waiting prepare looks again.
        changes.send_modify(|n| *n = n.wrapping_add(1));
    }
    live.store(false, Ordering::Release);
    Ok(())
}

/// Stops holding back claims a new list lacks: they were deleted (or moved) meanwhile.
fn forget_unlisted(held_back: &HeldBack, store: &Store<ResourceClaim>) {
    if !held_back.is_empty() {
        let listed: HashSet<String> = store
            .state()
            .iter()
            .filter_map(|claim| claim.metadata.uid.clone())
            .collect();
        held_back.retain(|uid| listed.contains(uid));
    }
}

/// Reads claims from this node's [`ClaimCache`] when it holds them, and GETs them from the API
/// server ([`ApiClaimReader`]) otherwise.
pub(crate) struct CachingClaimReader {
    api: ApiClaimReader,
    cache: ClaimCache,
}

impl CachingClaimReader {
    /// Caches the claims labelled for `node` and GETs the others, both through `client`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        CachingClaimReader {
            cache: ClaimCache::new(client.clone(), node),
            api: ApiClaimReader::new(client),
        }
    }
}

impl ClaimReader for CachingClaimReader {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, std::result::Result<ResourceClaim, kube::Error>> {
        self.api.get(namespace, name)
    }

    fn get_any<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, std::result::Result<ResourceClaim, kube::Error>> {
        self.api.get_any(namespace, name)
    }

    /// A claim held back may have been allocated anew, and kube-apiserver's watch cache may
    /// lag behind that as this cache's watch may; every other claim is one whose
    /// `resourceVersion=0` answer is as good as a cached copy, for the reasons
    /// [`Cached::usable`] gives (the watch cache is what this cache's watch reads from).
    fn may_read_any(&self, uid: &str) -> bool {
        !self.cache.is_held_back(uid)
    }

    fn until_cached<'a>(&'a self, wanted: &'a Wanted) -> BoxFuture<'a, Arc<ResourceClaim>> {
        Box::pin(self.cache.until_usable(wanted))
    }

    fn cached(&self, namespace: &str, name: &str) -> Cached {
        self.cache.lookup(namespace, name)
    }

    fn unprepared(&self, uid: &str) {
        self.cache.hold_back(uid);
    }

    fn cache_task(&self, shutdown: CancellationToken) -> Option<BoxFuture<'static, Result<()>>> {
        self.cache.task(shutdown)
    }
}

/// The UIDs of claims held back, shared by lookups and the watch task.
#[derive(Clone, Default)]
struct HeldBack(Arc<Mutex<HashSet<String>>>);

impl HeldBack {
    fn set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(&self, uid: &str) {
        self.set().insert(uid.to_owned());
    }

    fn remove(&self, uid: Option<&str>) {
        if let Some(uid) = uid {
            self.set().remove(uid);
        }
    }

    /// Whether `uid` is held back.
    fn contains(&self, uid: Option<&str>) -> bool {
        let set = self.set();
        !set.is_empty() && uid.is_some_and(|uid| set.contains(uid))
    }

    fn is_empty(&self) -> bool {
        self.set().is_empty()
    }

    fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        self.set().retain(|uid| keep(uid));
    }
}
