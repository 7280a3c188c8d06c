//! Device taints on published devices: an unhealthy device carries `<driver>/unhealthy`, so
//! no new claim gets it (`NoSchedule`) or its pods are evicted (`NoExecute`).
//!
//! The API server's limits (`k8s.io/api/resource/v1` `ResourceSliceMaxDevicesWithAdvancedFeatures`
//! and `DeviceTaintsMaxLength`): a slice with any tainted device holds at most 64 devices, and
//! a device at most 16 taints (kerf sets one).
//!
//! `timeAdded` is left unset: the API server defaults it when the taint first appears, and a
//! time set here would change the slice's content on every publish.

use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSliceSpec};
use kerf_core::health::{DeviceHealth, TaintPolicy};

/// Most devices a slice may hold when any of its devices has a taint.
pub(crate) const MAX_DEVICES_PER_SLICE_WITH_TAINTS: usize = 64;

/// The key of the taint of an unhealthy device of `driver`: `<driver>/unhealthy`.
pub fn unhealthy_taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// Sets the taint of every device of `specs` from its health: a device whose `health` calls
/// for a taint under `policy` gets exactly one, keyed [`unhealthy_taint_key`] with the worst
/// fault's reason as value; every other device gets none. Devices without an entry in
/// `health` are left untainted. Returns how many devices are tainted.
pub fn set_health_taints(
    specs: &mut [ResourceSliceSpec],
    driver: &str,
    health: &[DeviceHealth],
    policy: &TaintPolicy,
) -> usize {
    let key = unhealthy_taint_key(driver);
    let mut tainted = 0;
    for device in specs
        .iter_mut()
        .flat_map(|s| s.devices.iter_mut().flatten())
    {
        let taint = health
            .iter()
            .find(|h| h.device == device.name)
            .and_then(|h| policy.taint_for(h))
            .and_then(|(effect, reason)| {
                Some(DeviceTaint {
                    key: key.clone(),
                    value: Some(reason),
                    effect: effect.api_name()?.to_owned(),
                    time_added: None,
                })
            });
        if taint.is_some() {
            tainted += 1;
        }
        device.taints = taint.map(|t| vec![t]);
    }
    tainted
}

#[cfg(test)]
mod tests {
    use kerf_core::health::{Fault, NodeHealth, TaintEffect};
    use kerf_core::mock;

    use super::*;

    #[test]
    fn a_faulty_gpu_and_its_mig_devices_are_tainted_and_the_rest_not() {
        let inventory = mock::from_spec("a100-40gb-mig:2").expect("mock profile");
        let mut specs = crate::resourceslice::pool::resource_slices_chunked(
            &inventory,
            "gpu.kerf.dev",
            "n",
            64,
        )
        .expect("slices");
        let first = inventory.gpus[0].uuid.clone();
        let mut health = NodeHealth::default();
        health.set_faults(&first, [Fault::Xid { code: 79 }]);
        let devices = health.devices(&inventory);
        let tainted = set_health_taints(
            &mut specs,
            "gpu.kerf.dev",
            &devices,
            &TaintPolicy::default(),
        );
        let on_first = inventory
            .devices()
            .filter(|d| d.gpu().uuid == first)
            .count();
        assert_eq!(tainted, on_first);
        for device in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
            let faulty = inventory
                .devices()
                .any(|d| d.name() == device.name && d.gpu().uuid == first);
            match &device.taints {
                Some(taints) => {
                    assert!(faulty, "{}", device.name);
                    assert_eq!(taints.len(), 1);
                    assert_eq!(taints[0].key, "gpu.kerf.dev/unhealthy");
                    assert_eq!(taints[0].value.as_deref(), Some("xid-79"));
                    assert_eq!(taints[0].effect, "NoExecute");
                    assert_eq!(taints[0].time_added, None);
                }
                None => assert!(!faulty, "{}", device.name),
            }
        }
        let lenient = TaintPolicy {
            unhealthy: TaintEffect::None,
            fatal: TaintEffect::None,
        };
        assert_eq!(
            set_health_taints(&mut specs, "gpu.kerf.dev", &devices, &lenient),
            0
        );
        assert!(
            specs
                .iter()
                .flat_map(|s| s.devices.iter().flatten())
                .all(|d| d.taints.is_none())
        );
    }
}
