//! What every class's status needs from all slices and claims, computed once per version of
//! the caches and shared by the classes' reconciles.
//!
//! A change of the caches re-evaluates every GpuClass (`gpuclass.rs`); each class used to
//! decode every allocated claim twice (memory, then compute) on its own, so a refresh cost
//! classes × claims decodes: at 500 nodes and 1,000 claims the GpuClass refreshes were a fifth
//! of the leader's CPU per pod (docs/performance.md, "Where the leader's CPU goes"). Memory and compute in
//! use do not depend on the class; only which devices count does.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash as _, Hasher as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::cache::CompactResourceSlice;

use super::{ComputeUse, MemoryUse, compute_in_use, current_devices, memory_in_use};

/// Memory and compute in use per device, for every class alike.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Memory in use per device.
    pub memory: MemoryUse,
    /// Compute in use per device.
    pub compute: ComputeUse,
}

/// The last [`Usage`] and the version of the caches it was computed from.
#[derive(Debug, Default)]
pub struct UsageMemo {
    last: Mutex<Option<(u64, Arc<Usage>)>>,
    computations: AtomicU64,
}

impl UsageMemo {
    /// The usage of `slices` and `claims`: the last one when neither changed since (same
    /// objects at the same resourceVersions), else computed now. Objects without UID or
    /// resourceVersion (built by hand, never from a watch) are always computed afresh.
    pub fn usage(
        &self,
        slices: &[Arc<CompactResourceSlice>],
        claims: &[Arc<ResourceClaim>],
        driver: &str,
    ) -> Arc<Usage> {
        // Held while computing, so that classes reconciled at once compute it once.
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let version = fingerprint(slices, claims);
        if let (Some(version), Some((known, usage))) = (version, last.as_ref())
            && version == *known
        {
            return Arc::clone(usage);
        }
        self.computations.fetch_add(1, Ordering::Relaxed);
        let devices = current_devices(slices, driver);
        let usage = Arc::new(Usage {
            memory: memory_in_use(&devices, claims, driver),
            compute: compute_in_use(&devices, claims, driver),
        });
        *last = version.map(|version| (version, Arc::clone(&usage)));
        usage
    }

    /// How many times a usage was computed rather than reused (what the tests count).
    #[cfg(test)]
    fn computations(&self) -> u64 {
        self.computations.load(Ordering::Relaxed)
    }
}

/// An order-independent digest of the objects' UIDs and resourceVersions; `None` when one
/// lacks either.
fn fingerprint(slices: &[Arc<CompactResourceSlice>], claims: &[Arc<ResourceClaim>]) -> Option<u64> {
    let digest = |uid: Option<&str>, resource_version: Option<&str>| -> Option<u64> {
        let mut hasher = DefaultHasher::new();
        uid?.hash(&mut hasher);
        resource_version?.hash(&mut hasher);
        Some(hasher.finish())
    };
    let mut sum = ((slices.len() as u64) << 32) | claims.len() as u64;
    for slice in slices {
        sum = sum.wrapping_add(digest(slice.uid(), slice.resource_version())?);
    }
    for meta in claims.iter().map(|c| &c.metadata) {
        // Slices and claims are told apart, so a claim cannot stand in for a slice.
        let claim = digest(meta.uid.as_deref(), meta.resource_version.as_deref())?;
        sum = sum.wrapping_add(claim.rotate_left(1));
    }
    Some(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
    use kube::api::ObjectMeta;

    const DRIVER: &str = "gpu.kerf.dev";

    fn meta(uid: &str, version: &str) -> ObjectMeta {
        ObjectMeta {
            uid: Some(uid.to_owned()),
            resource_version: Some(version.to_owned()),
            ..ObjectMeta::default()
        }
    }

    fn slices() -> Vec<Arc<CompactResourceSlice>> {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").unwrap();
        kerf_api::resource_slices(&inventory, DRIVER, "n1")
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, spec): (usize, ResourceSliceSpec)| {
                Arc::new(CompactResourceSlice::from(ResourceSlice {
                    metadata: meta(&format!("slice-{i}"), "1"),
                    spec,
                }))
            })
            .collect()
    }

    fn claim(uid: &str, version: &str) -> Arc<ResourceClaim> {
        Arc::new(ResourceClaim {
            metadata: meta(uid, version),
            ..ResourceClaim::default()
        })
    }

    /// The counter probe: the classes of one refresh share one computation; a changed claim
    /// (new resourceVersion), a new claim or objects without versions compute again.
    #[test]
    fn computed_once_per_version_of_the_caches() {
        let memo = UsageMemo::default();
        let slices = slices();
        let mut claims = vec![claim("a", "1"), claim("b", "1")];
        for _class in 0..3 {
            memo.usage(&slices, &claims, DRIVER);
        }
        assert_eq!(memo.computations(), 1);
        claims[1] = claim("b", "2");
        memo.usage(&slices, &claims, DRIVER);
        memo.usage(&slices, &claims, DRIVER);
        assert_eq!(memo.computations(), 2);
        claims.push(claim("c", "1"));
        memo.usage(&slices, &claims, DRIVER);
        assert_eq!(memo.computations(), 3);
        let unversioned = vec![Arc::new(ResourceClaim::default())];
        memo.usage(&slices, &unversioned, DRIVER);
        memo.usage(&slices, &unversioned, DRIVER);
        assert_eq!(memo.computations(), 5);
    }

    #[test]
    fn order_does_not_matter() {
        let slices = slices();
        let forward = [claim("a", "1"), claim("b", "1")];
        let backward = [claim("b", "1"), claim("a", "1")];
        assert_eq!(
            fingerprint(&slices, &forward),
            fingerprint(&slices, &backward)
        );
        assert_ne!(
            fingerprint(&slices, &forward),
            fingerprint(&slices, &[claim("a", "1"), claim("b", "2")])
        );
    }
}
