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
use tokio_util::sync::CancellationToken;

use super::{ApiClaimReader, Cached, ClaimReader};
use crate::Result;

/// This node's ResourceClaims as one label-selected watch sees them.
pub struct ClaimCache {
    store: Store<ResourceClaim>,
    /// True while the watch is in step with the API server (see the module docs).
    live: Arc<AtomicBool>,
    /// What the watch task needs, until [`ClaimCache::task`] takes it.
    source: Mutex<Option<Source>>,
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
            source: Mutex::new(Some(Source {
                claims: Api::all(client),
                selector: node_label_selector(node),
                writer,
            })),
        }
    }

    /// The claim `namespace/name` as last watched, if the watch is in step.
    pub fn lookup(&self, namespace: &str, name: &str) -> Cached {
        if !self.live.load(Ordering::Acquire) {
            return Cached::NotSynced;
        }
        match self.store.get(&ObjectRef::new(name).within(namespace)) {
            Some(claim) => Cached::Found(claim),
            None => Cached::Absent,
        }
    }

    /// Whether the watch is in step with the API server, i.e. lookups are answered.
    pub fn is_synced(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }

    /// Number of claims held.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    /// True when no claim is held.
    pub fn is_empty(&self) -> bool {
        self.store.is_empty()
    }

    /// The watch that feeds the cache until `shutdown`; `None` once taken (one watch per
    /// cache). Errors are retried with [`WatchBackoff`] and never end the task.
    pub fn task(&self, shutdown: CancellationToken) -> Option<BoxFuture<'static, Result<()>>> {
        let source = self
            .source
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        let live = Arc::clone(&self.live);
        Some(Box::pin(run_watch(source, live, shutdown)))
    }
}

/// Applies the watch's events to the store and keeps `live` in step with it.
async fn run_watch(
    source: Source,
    live: Arc<AtomicBool>,
    shutdown: CancellationToken,
) -> Result<()> {
    let Source {
        claims,
        selector,
        writer,
    } = source;
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
                if !live.swap(true, Ordering::AcqRel) {
                    tracing::info!("prepare cache synced: known claims prepare without a GET");
                }
            }
            Some(Ok(Event::Init)) => live.store(false, Ordering::Release),
            Some(Ok(Event::InitApply(_) | Event::Apply(_) | Event::Delete(_))) => {}
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
    }
    live.store(false, Ordering::Release);
    Ok(())
}

/// Reads claims from this node's [`ClaimCache`] when it holds them, and GETs them from the API
/// server ([`ApiClaimReader`]) otherwise.
pub struct CachingClaimReader {
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

    /// The cache.
    pub fn cache(&self) -> &ClaimCache {
        &self.cache
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

    fn cached(&self, namespace: &str, name: &str) -> Cached {
        self.cache.lookup(namespace, name)
    }

    fn uncached(&self) -> Option<Arc<dyn ClaimReader>> {
        Some(Arc::new(self.api.clone()))
    }

    fn cache_task(&self, shutdown: CancellationToken) -> Option<BoxFuture<'static, Result<()>>> {
        self.cache.task(shutdown)
    }
}
