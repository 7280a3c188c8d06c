//! The allocator's view of free capacity, kept in step with the watch-fed caches.
//!
//! The caches hold every ResourceSlice of the driver and every ResourceClaim; [`CapacityIndex`]
//! turns them into [`kerf_core::alloc::Index`] incrementally: a pool is rebuilt only when one
//! of its slices changed, a claim's usage only when its resourceVersion changed. Allocations
//! this controller has just written are *assumed* until the watch shows them, so two
//! reconciles never hand out the same capacity while the API server's echo is in flight.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kerf_core::alloc::{DeviceUse, Index};
use kube::ResourceExt as _;

/// How long an assumed allocation waits for the watch to show it before it is dropped.
pub const ASSUME_TTL: Duration = Duration::from_secs(60);

/// Free capacity per GPU, fed from the caches.
#[derive(Debug, Default)]
pub struct CapacityIndex {
    index: Index,
    claim_versions: HashMap<String, String>,
    pool_versions: HashMap<String, String>,
    assumed: HashMap<String, (Vec<DeviceUse>, Instant)>,
}

impl CapacityIndex {
    /// The capacity index (read-only).
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Brings the index up to date with the caches' current contents.
    pub fn sync(
        &mut self,
        slices: &[Arc<ResourceSlice>],
        claims: &[Arc<ResourceClaim>],
        driver: &str,
        now: Instant,
    ) {
        self.sync_pools(slices, driver);
        self.sync_claims(claims, driver, now);
    }

    /// Records an allocation this controller is writing for claim `uid`.
    pub fn assume(&mut self, uid: &str, uses: Vec<DeviceUse>, now: Instant) {
        self.index.set_claim_usage(uid, uses.clone());
        self.assumed
            .insert(uid.to_owned(), (uses, now + ASSUME_TTL));
        // Force the next sync to look at the claim again.
        self.claim_versions.remove(uid);
    }

    /// Drops what is known about claim `uid` (after a rollback or a deallocation); the next
    /// sync takes the claim from the cache again.
    pub fn forget(&mut self, uid: &str) {
        self.index.remove_claim(uid);
        self.assumed.remove(uid);
        self.claim_versions.remove(uid);
    }

    fn sync_pools(&mut self, slices: &[Arc<ResourceSlice>], driver: &str) {
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
            let fingerprint = fingerprint(&pool_slices);
            if self.pool_versions.get(pool) == Some(&fingerprint) {
                continue;
            }
            let owned: Vec<ResourceSlice> = pool_slices.iter().map(|s| (***s).clone()).collect();
            match kerf_api::inventory_view::node_gpus_from_slices(&owned, driver).remove(pool) {
                Some(node) => self.index.upsert_node(node),
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
            if self.claim_versions.get(uid) == Some(&version) {
                continue;
            }
            let uses = kerf_api::allocation::device_uses(claim, driver);
            match self.assumed.get(uid) {
                // The cache has not caught up with our own write yet: keep the assumption.
                Some((_, expires)) if uses.is_empty() && *expires > now => continue,
                Some(_) => {
                    self.assumed.remove(uid);
                }
                None => {}
            }
            if uses.is_empty() {
                self.index.remove_claim(uid);
            } else {
                self.index.set_claim_usage(uid, uses);
            }
            self.claim_versions.insert(uid.to_owned(), version);
        }
        let gone: Vec<String> = self
            .claim_versions
            .keys()
            .filter(|uid| !seen.contains(uid.as_str()))
            .cloned()
            .collect();
        for uid in gone {
            if !self.assumed.contains_key(&uid) {
                self.index.remove_claim(&uid);
                self.claim_versions.remove(&uid);
            }
        }
        self.assumed.retain(|uid, (_, expires)| {
            let keep = *expires > now || seen.contains(uid.as_str());
            if !keep {
                self.index.remove_claim(uid);
            }
            keep
        });
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
