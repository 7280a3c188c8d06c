//! The allocator's view of free capacity, kept in step with the watch-fed stores.
//!
//! The stores hold every ResourceSlice of the driver and every ResourceClaim;
//! [`CapacityIndex`] turns them into [`kerf_core::alloc::Index`] incrementally: a pool is
//! rebuilt only when one of its slices changed (the store replaces an object's `Arc` on every
//! change, so an unchanged pool is told by pointer, without formatting or hashing anything), a
//! claim's usage only when its resourceVersion changed, and the claims are not walked at all
//! when the caller knows the claim store did not change ([`CapacityIndex::sync_pools`] and
//! [`CapacityIndex::sync_claims`] are separate for that).
//!
//! Allocations this controller is writing are *assumed* until the watch shows them, so two
//! reconciles never hand out the same capacity while the API server's echo is in flight. An
//! assumption is first *pending* (the write has not returned: every cached version is older)
//! and then *confirmed* with the resourceVersion the write returned: cached versions older
//! than that one are ignored, the first one at least as new replaces the assumption. This is
//! the scheduler's assume cache rule; like it, it relies on resourceVersions of one resource
//! growing as integers, which every etcd-backed API server guarantees. An assumption the
//! cache never confirms expires after [`ASSUME_TTL`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::resourceslice::ResourceSliceFields as _;
use kerf_core::alloc::{DeviceUse, Index};
use kube::runtime::reflector::ObjectRef;

use super::ownership::device_ownership::DeviceOwnership;
use crate::cache::CompactResourceSlice;

/// How long an assumed allocation waits for the watch to show it before it is dropped.
pub(crate) const ASSUME_TTL: Duration = Duration::from_secs(60);

/// Where the index's knowledge of one claim comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// The cached object at this resourceVersion.
    Cache { version: String },
    /// Our own write: pending (`after: None`) or returned at resourceVersion `after`.
    Assumed {
        after: Option<u64>,
        expires: Instant,
    },
}

/// The slices a pool was last built from, and the ownership epoch of its node then.
#[derive(Debug)]
struct PoolSource {
    /// Held, so that a pointer seen again is the same object (no address is reused while held).
    slices: Vec<Arc<CompactResourceSlice>>,
    epoch: u64,
    /// The [`CapacityIndex::syncs`] count of the last sync that saw the pool.
    seen: u64,
}

/// What the last sync of a [`CapacityIndex`] did: for tests and benchmarks of its cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SyncWork {
    /// Pools rebuilt from their slices.
    pub pools_rebuilt: usize,
    /// Cached claims looked at.
    pub claims_examined: usize,
}

/// Free capacity per GPU, fed from the stores.
#[derive(Debug, Default)]
pub(crate) struct CapacityIndex {
    index: Index,
    pools: HashMap<String, PoolSource>,
    syncs: u64,
    claims: HashMap<String, Source>,
    refs: HashMap<String, ObjectRef<ResourceClaim>>,
    /// The earliest expiry of an assumption, `None` when there is none: a claim sync is due
    /// then even if the store did not change.
    earliest_expiry: Option<Instant>,
    work: SyncWork,
}

/// A resourceVersion as the integer etcd makes it; `None` when it is not one.
fn version_number(version: &str) -> Option<u64> {
    version.parse().ok()
}

impl CapacityIndex {
    /// The capacity index (read-only).
    pub(crate) fn index(&self) -> &Index {
        &self.index
    }

    /// Brings the index up to date with the stores' current contents. Only the whole GPUs
    /// `book` lets the controller place on are placement candidates; the usage of every
    /// device is kept whoever owns it.
    #[cfg(test)]
    pub(crate) fn sync(
        &mut self,
        slices: &[Arc<CompactResourceSlice>],
        claims: &[Arc<ResourceClaim>],
        driver: &str,
        book: &DeviceOwnership,
        now: Instant,
    ) {
        self.sync_pools(slices, driver, book);
        self.sync_claims(claims, driver, now);
    }

    /// What the last [`CapacityIndex::sync_pools`] and [`CapacityIndex::sync_claims`] did.
    #[cfg(test)]
    pub(crate) fn last_work(&self) -> SyncWork {
        self.work
    }

    /// True when an assumption has expired by `now`: the claims must be synced although the
    /// store did not change, for the cache to win over it.
    pub(crate) fn expiry_due(&self, now: Instant) -> bool {
        self.earliest_expiry.is_some_and(|at| at <= now)
    }

    /// Records an allocation this controller is about to write for claim `uid` (pending).
    pub(crate) fn assume(&mut self, uid: &str, uses: Vec<DeviceUse>, now: Instant) {
        self.index.set_claim_usage(uid, uses);
        self.assumed(uid, None, now + ASSUME_TTL);
    }

    fn assumed(&mut self, uid: &str, after: Option<u64>, expires: Instant) {
        self.claims
            .insert(uid.to_owned(), Source::Assumed { after, expires });
        self.earliest_expiry = Some(self.earliest_expiry.map_or(expires, |at| at.min(expires)));
    }

    /// The write of claim `uid`'s allocation (or deallocation, with no uses) returned
    /// `version`: cached versions older than it are ignored from now on.
    pub(crate) fn confirm(&mut self, uid: &str, uses: Vec<DeviceUse>, version: &str, now: Instant) {
        self.index.set_claim_usage(uid, uses);
        self.assumed(uid, version_number(version), now + ASSUME_TTL);
    }

    /// The earliest expiry after `now` of an assumed allocation: the index then lets the cache
    /// win, which may change who holds a device without any store changing.
    pub(crate) fn next_expiry(&self, now: Instant) -> Option<Instant> {
        self.claims
            .values()
            .filter_map(|source| match source {
                Source::Assumed { expires, .. } => Some(*expires),
                Source::Cache { .. } => None,
            })
            .filter(|expires| *expires > now)
            .min()
    }

    /// Drops what is known about claim `uid` (after a rollback); the next sync takes the
    /// claim from the cache again.
    pub(crate) fn forget(&mut self, uid: &str) {
        self.index.remove_claim(uid);
        self.claims.remove(uid);
    }

    /// True when `claim` is older than what the index knows: an allocation of ours is being
    /// written, or was written at a newer resourceVersion than the copy's. Deciding on such a
    /// copy would undo our own write; the watch brings the newer version soon.
    pub(crate) fn is_stale(&self, claim: &ResourceClaim) -> bool {
        let Some(uid) = claim.metadata.uid.as_deref() else {
            return false;
        };
        let copy = claim
            .metadata
            .resource_version
            .as_deref()
            .and_then(version_number);
        match self.claims.get(uid) {
            Some(Source::Assumed { after: None, .. }) => true,
            Some(Source::Assumed {
                after: Some(after), ..
            }) => copy.is_none_or(|copy| copy < *after),
            Some(Source::Cache { version }) => match (copy, version_number(version)) {
                (Some(copy), Some(known)) => copy < known,
                _ => false,
            },
            None => false,
        }
    }

    /// The claims (but `except`) that hold or share device `device` of `node`.
    pub(crate) fn holders(
        &self,
        node: &str,
        device: &str,
        except: &str,
    ) -> Vec<ObjectRef<ResourceClaim>> {
        let mut refs: Vec<ObjectRef<ResourceClaim>> = self
            .index
            .claims_using(node, device)
            .filter(|uid| *uid != except)
            .filter_map(|uid| self.refs.get(uid).cloned())
            .collect();
        refs.dedup();
        refs
    }

    /// Who uses `device` of `node`: (the controller, someone else). Allocations the
    /// controller is writing are its own; `is_ours` tells for cached claims.
    pub(crate) fn holder_kinds(
        &self,
        node: &str,
        device: &str,
        is_ours: impl Fn(&ObjectRef<ResourceClaim>) -> bool,
    ) -> (bool, bool) {
        let (mut ours, mut others) = (false, false);
        for uid in self.index.claims_using(node, device) {
            let mine = match (self.claims.get(uid), self.refs.get(uid)) {
                (Some(Source::Assumed { .. }), _) => true,
                (_, Some(claim)) => is_ours(claim),
                (_, None) => false,
            };
            ours |= mine;
            others |= !mine;
        }
        (ours, others)
    }

    /// Rebuilds the pools whose slices changed since the last sync (by pointer) or whose
    /// node's ownership epoch in `book` moved, and drops the pools no slice names any more.
    /// Only the whole GPUs `book` lets the controller place on are placement candidates.
    pub(crate) fn sync_pools(
        &mut self,
        slices: &[Arc<CompactResourceSlice>],
        driver: &str,
        book: &DeviceOwnership,
    ) {
        self.syncs += 1;
        self.work.pools_rebuilt = 0;
        let mut ours: Vec<&Arc<CompactResourceSlice>> =
            slices.iter().filter(|s| s.driver() == driver).collect();
        ours.sort_unstable_by(|a, b| {
            (a.pool().name.as_str(), a.slice_name()).cmp(&(b.pool().name.as_str(), b.slice_name()))
        });
        for pool_slices in ours.chunk_by(|a, b| a.pool().name == b.pool().name) {
            let pool = pool_slices[0].pool().name.as_str();
            let epoch = book.epoch(pool);
            if let Some(known) = self.pools.get_mut(pool) {
                known.seen = self.syncs;
                let same = known.epoch == epoch
                    && known.slices.len() == pool_slices.len()
                    && known
                        .slices
                        .iter()
                        .zip(pool_slices)
                        .all(|(a, b)| Arc::ptr_eq(a, b));
                if same {
                    continue;
                }
            }
            self.rebuild_pool(pool, pool_slices, driver, book);
        }
        let syncs = self.syncs;
        let index = &mut self.index;
        self.pools.retain(|pool, source| {
            let kept = source.seen == syncs;
            if !kept {
                index.remove_node(pool);
            }
            kept
        });
    }

    fn rebuild_pool(
        &mut self,
        pool: &str,
        pool_slices: &[&Arc<CompactResourceSlice>],
        driver: &str,
        book: &DeviceOwnership,
    ) {
        self.work.pools_rebuilt += 1;
        match kerf_api::inventory_view::node_gpus_from_slices(pool_slices, driver).remove(pool) {
            Some(mut node) => {
                node.gpus.retain(|gpu| book.usable(pool, &gpu.device));
                self.index.upsert_node(node);
            }
            None => {
                self.index.remove_node(pool);
            }
        }
        self.pools.insert(
            pool.to_owned(),
            PoolSource {
                slices: pool_slices.iter().map(|s| Arc::clone(s)).collect(),
                epoch: book.epoch(pool),
                seen: self.syncs,
            },
        );
    }

    /// Brings the claims' usage up to date with `claims`, every cached claim: the usage of a
    /// claim whose resourceVersion changed, the claims gone, the assumptions expired by `now`.
    pub(crate) fn sync_claims(
        &mut self,
        claims: &[Arc<ResourceClaim>],
        driver: &str,
        now: Instant,
    ) {
        self.work.claims_examined = claims.len();
        self.sync_claims_of(claims, driver, now);
    }

    /// Brings the usage of `changed` claims (as the store holds them now) up to date, and
    /// nothing else: the claims the watch changed since the last sync, none deleted.
    pub(crate) fn sync_changed_claims(
        &mut self,
        changed: &[Arc<ResourceClaim>],
        driver: &str,
        now: Instant,
    ) {
        self.work.claims_examined = changed.len();
        for claim in changed {
            self.sync_claim(claim, driver, now);
        }
    }

    fn sync_claims_of(&mut self, claims: &[Arc<ResourceClaim>], driver: &str, now: Instant) {
        let mut seen = HashSet::with_capacity(claims.len());
        for claim in claims {
            if let Some(uid) = self.sync_claim(claim, driver, now) {
                seen.insert(uid);
            }
        }
        let gone: Vec<String> = self
            .claims
            .iter()
            .filter(|(uid, source)| {
                !seen.contains(uid.as_str())
                    && match source {
                        Source::Cache { .. } => true,
                        Source::Assumed { expires, .. } => *expires <= now,
                    }
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in gone {
            self.index.remove_claim(&uid);
            self.claims.remove(&uid);
            self.refs.remove(&uid);
        }
        self.earliest_expiry = self.next_expiry(now);
    }

    /// Takes `claim`'s usage from the store's copy unless an assumption newer than it wins;
    /// its UID, `None` for a claim without one.
    fn sync_claim<'c>(
        &mut self,
        claim: &'c Arc<ResourceClaim>,
        driver: &str,
        now: Instant,
    ) -> Option<&'c str> {
        let uid = claim.metadata.uid.as_deref()?;
        let version = claim
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default();
        if !self.cache_wins(uid, version, now) {
            return Some(uid);
        }
        let uses = kerf_api::allocation::device_uses(claim, driver);
        if uses.is_empty() {
            self.refs.remove(uid);
        } else {
            self.refs
                .insert(uid.to_owned(), ObjectRef::from_obj(claim.as_ref()));
        }
        self.index.set_claim_usage(uid, uses);
        self.claims.insert(
            uid.to_owned(),
            Source::Cache {
                version: version.to_owned(),
            },
        );
        Some(uid)
    }

    /// Whether the cached `version` of claim `uid` replaces what the index holds.
    fn cache_wins(&self, uid: &str, version: &str, now: Instant) -> bool {
        match self.claims.get(uid) {
            None => true,
            Some(Source::Cache { version: known }) => known != version,
            Some(Source::Assumed { after, expires }) => {
                if *expires <= now {
                    return true;
                }
                match (after, version_number(version)) {
                    (Some(after), Some(cached)) => cached >= *after,
                    // Pending, or versions that are not numbers: wait for the expiry.
                    _ => false,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "gpu.kerf.dev";

    fn claim(version: &str, device: Option<&str>) -> Arc<ResourceClaim> {
        let mut value = json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u1", "resourceVersion": version},
            "spec": {"devices": {"requests": []}},
        });
        if let Some(device) = device {
            value["status"] = json!({"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": device}
            ]}}});
        }
        Arc::new(serde_json::from_value(value).unwrap())
    }

    /// Syncs `index` with no slices, `claims` and an empty ownership book.
    fn sync(index: &mut CapacityIndex, claims: &[Arc<ResourceClaim>], now: Instant) {
        index.sync(&[], claims, DRIVER, &DeviceOwnership::default(), now);
    }

    fn held(index: &CapacityIndex) -> Vec<String> {
        index
            .index()
            .claim_uses("u1")
            .unwrap_or_default()
            .iter()
            .map(|u| u.device.clone())
            .collect()
    }

    #[test]
    fn an_assumption_survives_older_cached_versions_and_yields_to_newer_ones() {
        let now = Instant::now();
        let mut index = CapacityIndex::default();
        // The cache shows an old allocation on gpu-0; we re-place the claim on gpu-1.
        sync(&mut index, &[claim("5", Some("gpu-0"))], now);
        assert_eq!(held(&index), ["gpu-0"]);
        index.assume("u1", vec![DeviceUse::whole("n1", "gpu-1")], now);
        assert!(index.is_stale(&claim("5", Some("gpu-0"))));
        sync(&mut index, &[claim("5", Some("gpu-0"))], now);
        assert_eq!(held(&index), ["gpu-1"], "pending: the cache cannot win");
        index.confirm("u1", vec![DeviceUse::whole("n1", "gpu-1")], "9", now);
        sync(&mut index, &[claim("7", None)], now);
        assert_eq!(held(&index), ["gpu-1"], "older than our write");
        assert!(index.is_stale(&claim("7", None)));
        sync(&mut index, &[claim("9", Some("gpu-1"))], now);
        assert_eq!(held(&index), ["gpu-1"]);
        assert!(!index.is_stale(&claim("9", Some("gpu-1"))));
        sync(&mut index, &[claim("11", None)], now);
        assert!(held(&index).is_empty(), "a newer cached version wins");
    }

    #[test]
    fn an_unconfirmed_assumption_expires() {
        let now = Instant::now();
        let mut index = CapacityIndex::default();
        index.assume("u1", vec![DeviceUse::whole("n1", "gpu-1")], now);
        sync(&mut index, &[], now);
        assert_eq!(held(&index), ["gpu-1"], "the claim may not be cached yet");
        sync(&mut index, &[claim("3", None)], now + ASSUME_TTL);
        assert!(held(&index).is_empty());
        index.assume("u1", vec![DeviceUse::whole("n1", "gpu-1")], now);
        sync(&mut index, &[], now + ASSUME_TTL);
        assert!(held(&index).is_empty(), "gone from the cache and expired");
    }

    #[test]
    fn an_expired_assumption_is_due_without_any_store_change() {
        let now = Instant::now();
        let mut index = CapacityIndex::default();
        assert!(!index.expiry_due(now + ASSUME_TTL * 2), "nothing assumed");
        index.assume("u1", vec![DeviceUse::whole("n1", "gpu-1")], now);
        assert_eq!(index.next_expiry(now), Some(now + ASSUME_TTL));
        assert!(!index.expiry_due(now));
        assert!(index.expiry_due(now + ASSUME_TTL));
        sync(&mut index, &[], now + ASSUME_TTL);
        assert!(!index.expiry_due(now + ASSUME_TTL * 2), "synced away");
        assert_eq!(index.next_expiry(now), None);
    }

    #[test]
    fn forgetting_returns_to_the_cache_and_holders_name_other_claims() {
        let now = Instant::now();
        let mut index = CapacityIndex::default();
        sync(&mut index, &[claim("5", Some("gpu-0"))], now);
        let holders = index.holders("n1", "gpu-0", "other");
        assert_eq!(holders.len(), 1);
        assert_eq!(holders[0].name, "c");
        assert!(index.holders("n1", "gpu-0", "u1").is_empty());
        index.assume("u1", vec![DeviceUse::whole("n1", "gpu-3")], now);
        index.forget("u1");
        sync(&mut index, &[claim("5", Some("gpu-0"))], now);
        assert_eq!(held(&index), ["gpu-0"]);
    }
}
