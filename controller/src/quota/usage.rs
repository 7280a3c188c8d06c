//! What a namespace's claims hold, as the recount counts it: every claim the controller's cache
//! has, plus the admitted charges of claims it does not have yet.
//!
//! As kube-controller-manager's resourcequota controller (`pkg/controller/resourcequota/
//! resource_quota_controller.go`, `syncResourceQuota`), usage is recomputed from the objects
//! that exist rather than adjusted by events, so a missed admission or a deleted claim is
//! corrected by the next recount. What it adds: a claim the webhook charged moments ago may not
//! have reached the cache, and a recount that ignored it would lower `used` below what was
//! admitted, letting the next claim past the cap. Its `status.admitted` entry counts until the
//! cache has the claim or the grace passes (a create that failed after admission).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::jiff::Timestamp;
use kerf_api::gpuquota::{AdmittedClaim, Charge, GpuAmount};

/// A recount's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Usage {
    /// What the namespace holds, all classes.
    pub(crate) total: GpuAmount,
    /// What each class holds (every class a claim was charged for).
    pub(crate) classes: BTreeMap<String, GpuAmount>,
    /// The admitted entries that still count: claims not in the cache, within the grace.
    pub(crate) admitted: Vec<AdmittedClaim>,
    /// Claims of the namespace counted: those of the cache, charged or not.
    pub(crate) claims: usize,
}

impl Usage {
    fn add(&mut self, amount: GpuAmount, classes: impl IntoIterator<Item = (String, GpuAmount)>) {
        self.total = self.total.plus(amount);
        for (class, amount) in classes {
            let entry = self.classes.entry(class).or_default();
            *entry = entry.plus(amount);
        }
    }
}

/// The usage of a namespace whose cached claims are `claims` and whose quota lists `admitted`,
/// at `now`; `charge` prices one claim (an error counts the claim as nothing and is logged:
/// kerf's allocators refuse such a claim too, so it holds no GPU).
pub(crate) fn usage<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    admitted: &[AdmittedClaim],
    now: Timestamp,
    grace: Duration,
    charge: impl Fn(&ResourceClaim) -> kerf_api::Result<Charge>,
) -> Usage {
    let mut usage = Usage::default();
    let mut cached = BTreeSet::new();
    for claim in claims {
        usage.claims += 1;
        if let Some(uid) = &claim.metadata.uid {
            cached.insert(uid.as_str());
        }
        match charge(claim) {
            Ok(charge) => usage.add(charge.total, charge.classes),
            Err(error) => tracing::warn!(
                namespace = claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim = claim.metadata.name.as_deref().unwrap_or_default(),
                %error,
                "cannot price the claim for its namespace's GpuQuota; counting it as nothing"
            ),
        }
    }
    for entry in admitted {
        if cached.contains(entry.uid.as_str()) || expired(entry, now, grace) {
            continue;
        }
        match admitted_amounts(entry) {
            Ok((total, classes)) => {
                usage.add(total, classes);
                usage.admitted.push(entry.clone());
            }
            Err(error) => tracing::warn!(
                claim = %entry.name,
                %error,
                "dropping an admitted entry whose charge does not parse"
            ),
        }
    }
    usage
}

/// Whether `entry` was admitted `grace` or longer before `now`.
fn expired(entry: &AdmittedClaim, now: Timestamp, grace: Duration) -> bool {
    let age = now.duration_since(entry.time.0);
    age.is_positive() && age.unsigned_abs() >= grace
}

type Amounts = (GpuAmount, Vec<(String, GpuAmount)>);

fn admitted_amounts(entry: &AdmittedClaim) -> kerf_api::Result<Amounts> {
    let total = entry.charge.amount("status.admitted.charge")?;
    let classes = entry
        .classes
        .iter()
        .map(|class| {
            let amount = class.charge.amount("status.admitted.classes.charge")?;
            Ok((class.name.clone(), amount))
        })
        .collect::<kerf_api::Result<_>>()?;
    Ok((total, classes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use kerf_api::gpuquota::{ClassCharge, GpuResources};

    const GIB: u64 = 1 << 30;

    fn claim(name: &str, uid: &str) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("team-a".to_owned()),
                uid: Some(uid.to_owned()),
                ..ObjectMeta::default()
            },
            ..ResourceClaim::default()
        }
    }

    fn slice(gib: u64) -> GpuAmount {
        GpuAmount {
            memory_bytes: gib * GIB,
            compute: 50,
            gpus: 0,
        }
    }

    /// Every claim is charged a 20Gi slice of class `slices`, but `broken`, which does not price.
    fn charge(claim: &ResourceClaim) -> kerf_api::Result<Charge> {
        if claim.metadata.name.as_deref() == Some("broken") {
            return Err(kerf_api::Error::config("spec", "bad"));
        }
        Ok(Charge {
            total: slice(20),
            classes: BTreeMap::from([("slices".to_owned(), slice(20))]),
            unsized_classes: Vec::new(),
        })
    }

    fn admitted(uid: &str, at: Timestamp) -> AdmittedClaim {
        AdmittedClaim {
            name: format!("claim-{uid}"),
            uid: uid.to_owned(),
            time: Time(at),
            charge: GpuResources::of(slice(20)),
            classes: vec![ClassCharge {
                name: "slices".to_owned(),
                charge: GpuResources::of(slice(20)),
            }],
        }
    }

    #[test]
    fn claims_are_summed_and_admitted_entries_count_until_seen_or_expired() {
        let now = Timestamp::from_second(1_000_000).unwrap();
        let grace = Duration::from_secs(60);
        let claims = [claim("a", "u-a"), claim("broken", "u-b")];
        let entries = [
            // Seen in the cache: counted once, through the claim.
            admitted("u-a", now),
            // Not seen yet, within the grace: counted and kept.
            admitted("u-new", now - Duration::from_secs(59)),
            // Not seen and expired: a create that failed after admission.
            admitted("u-old", now - Duration::from_secs(60)),
        ];
        let usage = usage(&claims, &entries, now, grace, charge);
        let two = slice(20).times(2);
        assert_eq!(usage.total, two);
        assert_eq!(usage.classes, BTreeMap::from([("slices".to_owned(), two)]));
        assert_eq!(usage.claims, 2);
        let kept: Vec<&str> = usage.admitted.iter().map(|e| e.uid.as_str()).collect();
        assert_eq!(kept, ["u-new"]);
    }

    #[test]
    fn an_entry_from_a_clock_ahead_still_counts() {
        let now = Timestamp::from_second(1_000_000).unwrap();
        let ahead = admitted("u", now + Duration::from_secs(3600));
        let usage = usage(
            std::iter::empty(),
            &[ahead],
            now,
            Duration::from_secs(60),
            charge,
        );
        assert_eq!(usage.total, slice(20));
    }
}
