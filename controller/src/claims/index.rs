//! The allocator's view of free capacity, kept in step with the watch-fed stores.
//!
//! The stores hold every ResourceSlice of the driver and every ResourceClaim;
//! [`CapacityIndex`] turns them into [`kerf_core::alloc::Index`] incrementally: a pool is
//! rebuilt only when one of its slices changed, a claim's usage only when its resourceVersion
//! changed.
//!
//! Allocations this controller is writing are *assumed* until the watch shows them, so two
//! reconciles never hand out the same capacity while the API server's echo is in flight. An
//! assumption is first *pending* (the write has not returned: every cached version is older)
//! and then *confirmed* with the resourceVersion the write returned: cached versions older
//! than that one are ignored, the first one at least as new replaces the assumption. This is
//! the scheduler's assume cache rule; like it, it relies on resourceVersions of one resource
//! growing as integers, which every etcd-backed API server guarantees. An assumption the
//! cache never confirms expires after [`ASSUME_TTL`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_core::alloc::{DeviceUse, Index};
use kube::ResourceExt as _;
use kube::runtime::reflector::ObjectRef;

use super::ownership::OwnershipBook;

/// How long an assumed allocation waits for the watch to show it before it is dropped.
pub const ASSUME_TTL: Duration = Duration::from_secs(60);

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

/// Free capacity per GPU, fed from the stores.
#[derive(Debug, Default)]
pub struct CapacityIndex {
    index: Index,
    pool_versions: HashMap<String, String>,
    claims: HashMap<String, Source>,
    refs: HashMap<String, ObjectRef<ResourceClaim>>,
}

/// A resourceVersion as the integer etcd makes it; `None` when it is not one.
fn version_number(version: &str) -> Option<u64> {
    version.parse().ok()
}

impl CapacityIndex {
    /// The capacity index (read-only).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Brings the index up to date with the stores' current contents. Only the whole GPUs
    /// `book` lets the controller place on are placement candidates; the usage of every
    /// device is kept whoever owns it.
    pub fn sync(
        &mut self,
        slices: &[Arc<ResourceSlice>],
        claims: &[Arc<ResourceClaim>],
        driver: &str,
        book: &OwnershipBook,
        now: Instant,
    ) {
        self.sync_pools(slices, driver, book);
        self.sync_claims(claims, driver, now);
    }

    /// Records an allocation this controller is about to write for claim `uid` (pending).
    pub fn assume(&mut self, uid: &str, uses: Vec<DeviceUse>, now: Instant) {
        self.index.set_claim_usage(uid, uses);
        self.claims.insert(
            uid.to_owned(),
            Source::Assumed {
                after: None,
                expires: now + ASSUME_TTL,
            },
        );
    }

    /// The write of claim `uid`'s allocation (or deallocation, with no uses) returned
    /// `version`: cached versions older than it are ignored from now on.
    pub fn confirm(&mut self, uid: &str, uses: Vec<DeviceUse>, version: &str, now: Instant) {
        self.index.set_claim_usage(uid, uses);
        self.claims.insert(
            uid.to_owned(),
            Source::Assumed {
                after: version_number(version),
                expires: now + ASSUME_TTL,
            },
        );
    }

    /// The earliest expiry after `now` of an assumed allocation: the index then lets the cache
    /// win, which may change who holds a device without any store changing.
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
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
    pub fn forget(&mut self, uid: &str) {
        self.index.remove_claim(uid);
        self.claims.remove(uid);
    }

    /// True when `claim` is older than what the index knows: an allocation of ours is being
    /// written, or was written at a newer resourceVersion than the copy's. Deciding on such a
    /// copy would undo our own write; the watch brings the newer version soon.
    pub fn is_stale(&self, claim: &ResourceClaim) -> bool {
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
    pub fn holders(&self, node: &str, device: &str, except: &str) -> Vec<ObjectRef<ResourceClaim>> {
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
    pub fn holder_kinds(
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

    fn sync_pools(&mut self, slices: &[Arc<ResourceSlice>], driver: &str, book: &OwnershipBook) {
        let mut by_pool: BTreeMap<&str, Vec<&Arc<ResourceSlice>>> = BTreeMap::new();
        for slice in slices.iter().filter(|s| s.spec.driver == driver) {
            by_pool
                .entry(slice.spec.pool.name.as_str())
                .or_default()
                .push(slice);
        }
        let gone: Vec<String> = self
            .pool_versions
            .keys()
            .filter(|pool| !by_pool.contains_key(pool.as_str()))
            .cloned()
            .collect();
        for pool in gone {
            self.pool_versions.remove(&pool);
            self.index.remove_node(&pool);
        }
        for (pool, pool_slices) in by_pool {
            let fingerprint = format!("{}#{}", fingerprint(&pool_slices), book.epoch(pool));
            if self.pool_versions.get(pool) == Some(&fingerprint) {
                continue;
            }
            let owned: Vec<ResourceSlice> = pool_slices.iter().map(|s| (***s).clone()).collect();
            match kerf_api::inventory_view::node_gpus_from_slices(&owned, driver).remove(pool) {
                Some(mut node) => {
                    node.gpus.retain(|gpu| book.usable(pool, &gpu.device));
                    self.index.upsert_node(node);
                }
                None => {
                    self.index.remove_node(pool);
                }
            }
            self.pool_versions.insert(pool.to_owned(), fingerprint);
        }
    }

    fn sync_claims(&mut self, claims: &[Arc<ResourceClaim>], driver: &str, now: Instant) {
        let mut seen = HashSet::with_capacity(claims.len());
        for claim in claims {
            let Some(uid) = claim.metadata.uid.as_deref() else {
                continue;
            };
            seen.insert(uid);
            let version = claim.resource_version().unwrap_or_default();
            if !self.cache_wins(uid, &version, now) {
                continue;
            }
            let uses = kerf_api::allocation::device_uses(claim, driver);
            if uses.is_empty() {
                self.refs.remove(uid);
            } else {
                self.refs
                    .insert(uid.to_owned(), ObjectRef::from_obj(claim.as_ref()));
            }
            self.index.set_claim_usage(uid, uses);
            self.claims
                .insert(uid.to_owned(), Source::Cache { version });
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

/// Identifies the content of a pool's slices: their names and resourceVersions.
fn fingerprint(slices: &[&Arc<ResourceSlice>]) -> String {
    let mut parts: Vec<String> = slices
        .iter()
        .map(|s| {
            format!(
                "{}@{}",
                s.name_any(),
                s.resource_version().unwrap_or_default()
            )
        })
        .collect();
    parts.sort();
    parts.join(",")
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
        index.sync(&[], claims, DRIVER, &OwnershipBook::default(), now);
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
