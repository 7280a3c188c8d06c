//! The claim reader: where the plugin reads the ResourceClaims the kubelet names.
//!
//! A reader may keep a watch-fed cache of this node's claims (`CachingClaimReader`); a
//! prepare ([`read`]) then takes a claim from it when [`Cached::usable`] says it can stand in
//! for the GET, and otherwise races the API server's answer against the watch (see [`miss`]).

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::GetParams;
use kube::core::Status;
use tokio_util::sync::CancellationToken;

mod cache;
pub mod miss;

pub(crate) use cache::CachingClaimReader;
pub use miss::{Lookup, ReadError, Wanted, read};

/// Reads one ResourceClaim. The kubelet sends only namespace, name and UID; the allocation
/// comes from the API server.
pub trait ClaimReader: Send + Sync + 'static {
    /// GETs the claim `namespace/name`.
    ///
    /// # Errors
    /// The API server's answer; a claim that does not exist must be [`kube::Error::Api`] with
    /// code 404, which the preparer reports as the claim not being found rather than as an
    /// API failure.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>>;

    /// GETs the claim `namespace/name` with `resourceVersion=0`: kube-apiserver answers from
    /// its watch cache, possibly with an older version than a quorum GET's (see [`miss`]).
    /// A reader that has no such read GETs.
    ///
    /// # Errors
    /// As [`ClaimReader::get`].
    fn get_any<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        self.get(namespace, name)
    }

    /// Whether a usable answer of [`ClaimReader::get_any`] may stand in for a quorum GET of the
    /// claim with `uid`: only when the reader knows the claim was not unprepared here since
    /// its allocation was last seen cleared (see [`ClaimReader::unprepared`]), so a reader
    /// without a cache answers `false`.
    fn may_read_any(&self, uid: &str) -> bool {
        let _ = uid;
        false
    }

    /// Resolves once the reader's cache holds a copy of the claim usable for `wanted`
    /// ([`Wanted::usable`]); never, for a reader without a cache.
    fn until_cached<'a>(&'a self, wanted: &'a Wanted) -> BoxFuture<'a, Arc<ResourceClaim>> {
        let _ = wanted;
        Box::pin(std::future::pending())
    }

    /// The claim `namespace/name` as the reader's cache holds it, without a request; a reader
    /// without a cache answers [`Cached::Off`].
    fn cached(&self, namespace: &str, name: &str) -> Cached {
        let _ = (namespace, name);
        Cached::Off
    }

    /// Tells the reader that the claim with `uid` was unprepared on this node, so that its
    /// cache does not answer for it again until it has seen the allocation cleared (or the
    /// claim gone): the claim may be allocated anew, and a copy from before would name the
    /// old devices. A reader without a cache ignores it.
    fn unprepared(&self, uid: &str) {
        let _ = uid;
    }

    /// The task that feeds the reader's cache until `shutdown`, or `None` when there is no
    /// cache or its task was already taken (it runs once).
    fn cache_task(
        &self,
        shutdown: CancellationToken,
    ) -> Option<BoxFuture<'static, crate::Result<()>>> {
        let _ = shutdown;
        None
    }
}

/// What a reader's cache holds for one claim.
#[derive(Debug, Clone)]
pub enum Cached {
    /// The reader keeps no cache.
    Off,
    /// The cache's watch has not finished its first list, or is listing again after an error:
    /// what it holds may be missing changes.
    NotSynced,
    /// The cache does not hold the claim (not labelled for this node, or deleted).
    Absent,
    /// The claim was unprepared here and the cache has not seen its allocation cleared since
    /// (see [`ClaimReader::unprepared`]).
    HeldBack,
    /// The claim as the watch last saw it.
    Found(Arc<ResourceClaim>),
}

/// Why a prepare GETs its claim instead of using the cached copy; [`Fallback::reason`] is the
/// metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// The reader keeps no cache (`--claim-cache=false`, or no API server).
    CacheOff,
    /// The cache's watch is not in step with the API server (see [`Cached::NotSynced`]).
    NotSynced,
    /// The cache does not hold the claim.
    Miss,
    /// The claim was unprepared here and may have been allocated anew since.
    Unprepared,
    /// The cached claim has another UID than the one the kubelet sent.
    UidMismatch,
    /// The cached claim is being deleted.
    Deleting,
    /// The cached claim has no allocation result of this driver in this node's pool (e.g. the
    /// node label arrived before the allocation).
    NotAllocatedHere,
}

impl Fallback {
    /// A short, stable label for metrics.
    pub fn reason(self) -> &'static str {
        match self {
            Fallback::CacheOff => "cache_off",
            Fallback::NotSynced => "not_synced",
            Fallback::Miss => "miss",
            Fallback::Unprepared => "unprepared_here",
            Fallback::UidMismatch => "uid_mismatch",
            Fallback::Deleting => "deleting",
            Fallback::NotAllocatedHere => "not_allocated_here",
        }
    }
}

impl Cached {
    /// The cached claim, when it can stand in for a GET of the claim with `uid` that the
    /// kubelet asks `driver` on `node` to prepare: it is cached, has that UID, is not being
    /// deleted, and its allocation has a result of `driver` in `node`'s pool.
    ///
    /// Why a cached copy is as good as a GET then:
    /// - An allocation is immutable once written: the API server only lets it be cleared
    ///   (kubernetes/kubernetes `pkg/apis/resource/validation/validation.go`,
    ///   `ValidateResourceClaimStatusUpdate`),
    ///   so an allocated copy with the right UID carries the allocation the claim has, unless
    ///   it was cleared and written again, which needs the claim to have been unused in
    ///   between. When it was in use here, its unprepare holds it back
    ///   ([`ClaimReader::unprepared`]) until the watch shows the allocation cleared; what is
    ///   left is a claim allocated here, deallocated before any prepare, allocated here again,
    ///   and a watch that lags behind that whole chain of writes.
    /// - The kubelet GETs the claim and checks it is reserved for the pod right before it
    ///   calls NodePrepareResources (kubernetes/kubernetes `pkg/kubelet/cm/dra/manager.go`,
    ///   `Manager.prepareResources`), so the claim it names was alive and allocated a moment
    ///   before; the kubelet, not the plugin, is the gate on whether the pod may use it.
    /// - A deleted claim leaves the cache with the watch's delete event, and one deleted and
    ///   created again under the same name has a new UID, which the kubelet's UID does not
    ///   match.
    ///
    /// # Errors
    /// The [`Fallback`] that sends the prepare to the GET.
    pub fn usable(
        self,
        uid: &str,
        driver: &str,
        node: &str,
    ) -> Result<Arc<ResourceClaim>, Fallback> {
        let claim = match self {
            Cached::Off => return Err(Fallback::CacheOff),
            Cached::NotSynced => return Err(Fallback::NotSynced),
            Cached::Absent => return Err(Fallback::Miss),
            Cached::HeldBack => return Err(Fallback::Unprepared),
            Cached::Found(claim) => claim,
        };
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Err(Fallback::UidMismatch);
        }
        if claim.metadata.deletion_timestamp.is_some() {
            return Err(Fallback::Deleting);
        }
        let allocated_here = claim
            .status
            .as_ref()
            .and_then(|status| status.allocation.as_ref())
            .and_then(|allocation| allocation.devices.as_ref())
            .and_then(|devices| devices.results.as_ref())
            .is_some_and(|results| {
                results
                    .iter()
                    .any(|result| result.driver == driver && result.pool == node)
            });
        if allocated_here {
            Ok(claim)
        } else {
            Err(Fallback::NotAllocatedHere)
        }
    }
}

/// Reads claims straight from the API server, one GET per claim and no client-side rate
/// limit, so prepares never queue behind each other. Alone (`--claim-cache=false`) it never
/// lets a `resourceVersion=0` answer stand in for a quorum GET
/// ([`ClaimReader::may_read_any`]): it does not know which claims were unprepared here.
#[derive(Clone)]
pub struct ApiClaimReader {
    client: kube::Client,
}

impl ApiClaimReader {
    /// Reads through `client`.
    pub fn new(client: kube::Client) -> Self {
        ApiClaimReader { client }
    }
}

impl ClaimReader for ApiClaimReader {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        Box::pin(async move {
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .get(name)
                .await
        })
    }

    fn get_any<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        Box::pin(async move {
            Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
                .get_with(name, &GetParams::any())
                .await
        })
    }
}

/// ResourceClaims held in memory, by `(namespace, name)`, for running the plugin without an
/// API server (the demo, the benchmarks); a missing claim answers 404 as the API server does.
#[derive(Debug, Default)]
pub struct MemoryClaimReader {
    claims: RwLock<BTreeMap<(String, String), ResourceClaim>>,
}

impl MemoryClaimReader {
    /// Stores (or replaces) a claim under its namespace and name.
    pub fn insert(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        self.claims
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, claim);
    }

    /// Number of claims held.
    pub fn len(&self) -> usize {
        self.claims
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// True when no claim is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ClaimReader for MemoryClaimReader {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        let found = self
            .claims
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned();
        Box::pin(async move {
            found.ok_or_else(|| {
                let message = format!("resourceclaims.resource.k8s.io {name:?} not found");
                kube::Error::Api(Status::failure(&message, "NotFound").with_code(404).boxed())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn allocated(uid: &str, driver: &str, pool: &str) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": "c", "uid": uid},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "other.example.com", "pool": "node-a", "device": "x"},
                {"request": "gpu", "driver": driver, "pool": pool, "device": "gpu-0"},
            ]}}},
        }))
        .unwrap()
    }

    fn verdict(claim: ResourceClaim) -> Result<(), Fallback> {
        Cached::Found(Arc::new(claim))
            .usable("u1", "gpu.kerf.dev", "node-a")
            .map(|_| ())
    }

    #[test]
    fn a_cached_claim_stands_in_only_with_the_uid_alive_and_allocated_here() {
        assert_eq!(verdict(allocated("u1", "gpu.kerf.dev", "node-a")), Ok(()));
        assert_eq!(
            verdict(allocated("u2", "gpu.kerf.dev", "node-a")),
            Err(Fallback::UidMismatch)
        );
        assert_eq!(
            verdict(allocated("u1", "gpu.kerf.dev", "node-b")),
            Err(Fallback::NotAllocatedHere)
        );
        assert_eq!(
            verdict(allocated("u1", "gpu.example.com", "node-a")),
            Err(Fallback::NotAllocatedHere)
        );
        let mut unallocated = allocated("u1", "gpu.kerf.dev", "node-a");
        unallocated.status = None;
        assert_eq!(verdict(unallocated), Err(Fallback::NotAllocatedHere));
        let mut deleting = allocated("u1", "gpu.kerf.dev", "node-a");
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(verdict(deleting), Err(Fallback::Deleting));
        for (cached, fallback) in [
            (Cached::Off, Fallback::CacheOff),
            (Cached::NotSynced, Fallback::NotSynced),
            (Cached::Absent, Fallback::Miss),
        ] {
            assert_eq!(
                cached.usable("u1", "gpu.kerf.dev", "node-a").map(|_| ()),
                Err(fallback)
            );
        }
    }

    #[tokio::test]
    async fn serves_stored_claims_and_404_otherwise() {
        let store = MemoryClaimReader::default();
        store.insert(ResourceClaim {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some("c".into()),
                ..ObjectMeta::default()
            },
            ..ResourceClaim::default()
        });
        assert_eq!(store.len(), 1);
        assert!(store.get("ns", "c").await.is_ok());
        match store.get("ns", "x").await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
            other => panic!("unexpected {other:?}"),
        }
    }
}
