//! Manifests and checks for the scheduler-slice and dynamic-MIG e2e tests
//! (tests/tests/e2e/slice_shares.rs): a sliced Scheduler GpuClass, a MIG-profile
//! Scheduler GpuClass, and claims whose request carries `capacity.requests` (capacity
//! names as the GPU publishes them, `memory` and `compute`: the 1.36 allocator looks them up
//! by exact name).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, CapacityRequirements, DeviceClaim, DeviceRequest, DeviceSelector,
    ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::params::{Allocator, GpuSelector};
use kerf_api::{GpuClassSpec, Slicing};

use super::checks;
use super::manifests::CLAIM_REF;

/// A Scheduler class whose GPUs are published shareable: kube-scheduler hands out slices.
pub fn sliced_scheduler_class_spec() -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Scheduler,
        slicing: Some(Slicing {
            memory_granularity: Quantity("1Gi".to_owned()),
            max_slices_per_gpu: None,
            default_compute: None,
        }),
        ..GpuClassSpec::default()
    }
}

/// A Scheduler class of MIG devices of `profile`.
pub fn mig_class_spec(profile: &str) -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Scheduler,
        selector: GpuSelector {
            mig_profile: Some(profile.to_owned()),
            ..GpuSelector::default()
        },
        ..GpuClassSpec::default()
    }
}

/// A claim spec with one request [`CLAIM_REF`] for one device of `class`, asking for
/// `capacity` (name → quantity) and restricted by the CEL `selectors`.
pub fn capacity_claim_spec(
    class: &str,
    capacity: &[(&str, &str)],
    selectors: &[String],
) -> ResourceClaimSpec {
    let selectors = (!selectors.is_empty()).then(|| {
        selectors
            .iter()
            .map(|expression| DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: expression.clone(),
                }),
            })
            .collect()
    });
    let requests: BTreeMap<String, Quantity> = capacity
        .iter()
        .map(|(name, quantity)| ((*name).to_owned(), Quantity((*quantity).to_owned())))
        .collect();
    ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(vec![DeviceRequest {
                name: CLAIM_REF.to_owned(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: class.to_owned(),
                    count: Some(1),
                    selectors,
                    capacity: (!requests.is_empty()).then_some(CapacityRequirements {
                        requests: Some(requests),
                    }),
                    ..ExactDeviceRequest::default()
                }),
                first_available: None,
            }]),
            config: None,
            constraints: None,
        }),
    }
}

/// One share of a claim's allocation: pool, device, shareID and `consumedCapacity`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    /// The pool (node).
    pub pool: String,
    /// The device.
    pub device: String,
    /// The shareID kube-scheduler wrote, if any.
    pub id: Option<String>,
    /// `consumedCapacity` as written.
    pub consumed: BTreeMap<String, String>,
}

/// The results of `driver` in the claim's allocation, as [`Share`]s.
pub fn shares(claim: &ResourceClaim, driver: &str) -> Vec<Share> {
    checks::allocation_results(claim, driver)
        .into_iter()
        .map(|r| Share {
            pool: r.pool.clone(),
            device: r.device.clone(),
            id: r.share_id.clone(),
            consumed: r
                .consumed_capacity
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.0.clone()))
                .collect(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_claim_asks_for_capacity_under_the_published_names() {
        let spec = capacity_claim_spec("sliced", &[("memory", "10Gi"), ("compute", "30")], &[]);
        let value = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            value["devices"]["requests"][0]["exactly"]["capacity"],
            json!({"requests": {"compute": "30", "memory": "10Gi"}})
        );
        let class = serde_json::to_value(sliced_scheduler_class_spec()).unwrap();
        assert_eq!(class["allocator"], "Scheduler");
        assert_eq!(class["slicing"]["memoryGranularity"], "1Gi");
    }
}
