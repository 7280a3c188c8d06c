//! The usage pass: every `fragmentation_interval` (with the pools' fragmentation), how full
//! each GPU is and what each class and namespace holds (`crate::capacity::holdings`, from the
//! caches' slices and claims), and the claims of kerf's classes that a live pod waits for and that have no allocation yet,
//! into the usage metrics (`crate::metrics::usage`).
//!
//! It runs with the claim controller because the waiting claims need its pod store; the
//! holdings only read the shared caches.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kerf_api::controller_claims::class_parameters;
use kube::ResourceExt as _;
use kube::runtime::reflector::ObjectRef;

use super::consumers;
use crate::capacity::{current_devices, holdings};
use crate::claims::ClaimsContext;

/// One pass: reads the caches and replaces the usage series (every `fragmentation_interval`,
/// with the pools' fragmentation: `super::fragmentation::run`).
pub(super) fn measure(ctx: &ClaimsContext) {
    let driver = ctx.core.config.driver_name.as_str();
    let slices = ctx.core.caches.slices.state();
    let claims = ctx.core.caches.claims.state();
    let devices = current_devices(&slices, driver);
    let usage = ctx.core.metrics.usage();
    usage.set_holdings(&holdings(&devices, &claims, driver));
    let waiting = waiting_claims(ctx, Timestamp::now());
    let oldest = waiting.values().copied().max().unwrap_or_default();
    usage.set_unallocated(waiting.len(), oldest);
}

/// The unallocated claims of kerf's classes that live pods use, with how long each has
/// waited: since the later of its own creation and its pod's (the oldest such pod's wait).
fn waiting_claims(ctx: &ClaimsContext, now: Timestamp) -> HashMap<(String, String), Duration> {
    let mut waiting: HashMap<(String, String), Duration> = HashMap::new();
    for pod in ctx.pods.state() {
        if !consumers::is_live(&pod) {
            continue;
        }
        let namespace = pod.namespace().unwrap_or_default();
        for name in consumers::pod_claims(&pod).names {
            let key = ObjectRef::<ResourceClaim>::new(&name).within(&namespace);
            let Some(claim) = ctx.core.caches.claims.get(&key) else {
                continue;
            };
            if !is_waiting(ctx, &claim) {
                continue;
            }
            let since = later(created(&claim), pod.metadata.creation_timestamp.as_ref());
            let waited = since.map_or(Duration::ZERO, |since| elapsed(since, now));
            let entry = waiting.entry((namespace.clone(), name)).or_default();
            *entry = (*entry).max(waited);
        }
    }
    waiting
}

/// An unallocated claim, not being deleted, with a request of a DeviceClass of kerf's driver.
fn is_waiting(ctx: &ClaimsContext, claim: &ResourceClaim) -> bool {
    let allocated = claim
        .status
        .as_ref()
        .is_some_and(|s| s.allocation.is_some());
    if allocated || claim.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let driver = ctx.core.config.driver_name.as_str();
    let requests = kerf_api::claim_requests(claim);
    requests
        .iter()
        .flat_map(|r| {
            let exactly = r.exactly.iter().map(|e| e.device_class_name.as_str());
            let subs = r.first_available.iter().flatten();
            exactly.chain(subs.map(|s| s.device_class_name.as_str()))
        })
        .any(|class| {
            ctx.core
                .caches
                .device_classes
                .get(&ObjectRef::new(class))
                .is_some_and(|class| class_parameters(&class, driver).is_some())
        })
}

fn created(claim: &ResourceClaim) -> Option<&Time> {
    claim.metadata.creation_timestamp.as_ref()
}

fn later<'a>(a: Option<&'a Time>, b: Option<&'a Time>) -> Option<&'a Time> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// Time from `since` to `now`; zero when `since` is later (clocks of different machines).
fn elapsed(since: &Time, now: Timestamp) -> Duration {
    Duration::try_from(since.0.duration_until(now)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn a_claim_waits_from_the_later_of_its_and_its_pods_creation() {
        let (claim, pod) = (at(100), at(160));
        assert_eq!(later(Some(&claim), Some(&pod)), Some(&pod));
        assert_eq!(later(Some(&pod), Some(&claim)), Some(&pod));
        assert_eq!(later(None, Some(&claim)), Some(&claim));
        let now = Timestamp::from_second(190).unwrap();
        assert_eq!(elapsed(&pod, now), Duration::from_secs(30));
        assert_eq!(elapsed(&at(200), now), Duration::ZERO);
    }
}
