//! What makes a claim kerf-controller's rather than kube-scheduler's, and the names the
//! controller marks its claims and pods with. kerf-controller, its admission webhook and
//! `kerf demo` all decide through these functions, so they cannot disagree.

use k8s_openapi::api::resource::v1::{DeviceClaim, DeviceClass, ResourceClaim};

use crate::params::{Allocator, GpuClassParameters, OpaqueConfig, decode_opaque};

/// The finalizer that keeps a claim until the controller has deallocated it.
pub const FINALIZER: &str = "gpu.kerf.dev/allocation";

/// The scheduling gate kerf's admission webhook puts on pods that use a Controller-class claim
/// (directly or through a claim template). kube-scheduler does not try a gated pod, so it
/// cannot run its PostFilter over allocations kerf-controller has not finished; the controller
/// removes the gate once it has allocated every controller claim of the pod.
pub const SCHEDULING_GATE: &str = "gpu.kerf.dev/allocation";

/// Type of the pod condition kerf-controller writes to say why the pod's controller claims are
/// not allocated (and, after such a wait, that they are).
pub const POD_CONDITION_TYPE: &str = "gpu.kerf.dev/GpuAllocation";

/// Annotation naming the node the controller allocated a claim on: how a later reconcile
/// tells "the scheduler cleared our allocation" from "never allocated".
pub const ALLOCATED_NODE_ANNOTATION: &str = "gpu.kerf.dev/allocated-node";

/// Annotation saying, in words, which devices (and slice sizes) the controller allocated the
/// claim on, e.g. `allocated on node n1: gpu-3 (10240 MiB, 10% compute)`. Written with
/// [`ALLOCATED_NODE_ANNOTATION`] in the same patch, so it costs no API write of its own (an
/// `Allocated` Event per claim did).
pub const ALLOCATED_DEVICES_ANNOTATION: &str = "gpu.kerf.dev/allocated-devices";

/// The kerf class parameters a DeviceClass carries for `driver`, if any (the last of its
/// configs wins, as for every opaque config). Configs that do not decode are skipped: the
/// GpuClass reconciler reports them, and such a class then counts as a Scheduler class.
pub fn class_parameters(class: &DeviceClass, driver: &str) -> Option<GpuClassParameters> {
    class
        .spec
        .config
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.opaque.as_ref())
        .filter(|o| o.driver == driver)
        .filter_map(
            |o| match decode_opaque(&o.parameters.0, "spec.config[].opaque.parameters") {
                Ok(OpaqueConfig::Class(params)) => Some(params),
                _ => None,
            },
        )
        .next_back()
}

/// True when a request of `devices` (a claim's or a claim template's `spec.devices`) asks for
/// a class whose parameters (looked up by DeviceClass name with `class_params`) name the
/// Controller allocator: an `exactly` request's class or the class of any `firstAvailable`
/// subrequest. A claim that mixes a Controller class with others is still the controller's,
/// which refuses it with a reason ([`claim_request`](crate::claim_request)) rather than leave
/// it to a scheduler that cannot allocate kerf's slices.
pub fn requests_controller_class(
    devices: Option<&DeviceClaim>,
    class_params: impl Fn(&str) -> Option<GpuClassParameters>,
) -> bool {
    request_class_names(devices)
        .any(|name| class_params(name).is_some_and(|p| p.allocator == Allocator::Controller))
}

/// The DeviceClass names the requests of `devices` (a claim's or a claim template's
/// `spec.devices`) use, request by request: an `exactly` request's class, then the classes of
/// its `firstAvailable` subrequests. Names repeat when requests share a class.
pub fn request_class_names(devices: Option<&DeviceClaim>) -> impl Iterator<Item = &str> {
    devices
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
        .flat_map(|r| {
            r.exactly
                .iter()
                .map(|e| e.device_class_name.as_str())
                .chain(
                    r.first_available
                        .iter()
                        .flatten()
                        .map(|s| s.device_class_name.as_str()),
                )
        })
}

/// True when kerf-controller allocates `claim` (see [`requests_controller_class`]).
pub fn is_controller_claim(
    claim: &ResourceClaim,
    class_params: impl Fn(&str) -> Option<GpuClassParameters>,
) -> bool {
    requests_controller_class(claim.spec.devices.as_ref(), class_params)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        DeviceClassConfiguration, DeviceClassSpec, DeviceRequest, DeviceSubRequest,
        ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaimSpec,
    };
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    use serde_json::json;

    use super::*;

    fn class(driver: &str, allocator: &str) -> DeviceClass {
        DeviceClass {
            spec: DeviceClassSpec {
                config: Some(vec![DeviceClassConfiguration {
                    opaque: Some(OpaqueDeviceConfiguration {
                        driver: driver.to_owned(),
                        parameters: RawExtension(json!({
                            "apiVersion": crate::group::API_VERSION,
                            "kind": "GpuClassParameters",
                            "allocator": allocator,
                        })),
                    }),
                }]),
                ..DeviceClassSpec::default()
            },
            ..DeviceClass::default()
        }
    }

    fn claim(class: &str) -> ResourceClaim {
        ResourceClaim {
            spec: ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: "gpu".to_owned(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: class.to_owned(),
                            ..ExactDeviceRequest::default()
                        }),
                        ..DeviceRequest::default()
                    }]),
                    ..DeviceClaim::default()
                }),
            },
            ..ResourceClaim::default()
        }
    }

    #[test]
    fn a_claim_is_the_controllers_when_a_request_uses_a_controller_class() {
        let controller = class("gpu.kerf.dev", "Controller");
        let scheduler = class("gpu.kerf.dev", "Scheduler");
        let other_driver = class("gpu.example.com", "Controller");
        let lookup = |name: &str| {
            let class = match name {
                "slice" => &controller,
                "whole" => &scheduler,
                "other" => &other_driver,
                _ => return None,
            };
            class_parameters(class, "gpu.kerf.dev")
        };
        assert!(is_controller_claim(&claim("slice"), lookup));
        assert!(!is_controller_claim(&claim("whole"), lookup));
        assert!(!is_controller_claim(&claim("other"), lookup));
        assert!(!is_controller_claim(&claim("missing"), lookup));
        assert!(!is_controller_claim(&ResourceClaim::default(), lookup));

        let prioritized = |classes: &[&str]| {
            let mut claim = claim("unused");
            let request = &mut claim
                .spec
                .devices
                .as_mut()
                .unwrap()
                .requests
                .as_mut()
                .unwrap()[0];
            request.exactly = None;
            request.first_available = Some(
                classes
                    .iter()
                    .map(|class| DeviceSubRequest {
                        name: format!("s-{class}"),
                        device_class_name: (*class).to_owned(),
                        ..DeviceSubRequest::default()
                    })
                    .collect(),
            );
            claim
        };
        assert!(is_controller_claim(
            &prioritized(&["slice", "slice"]),
            lookup
        ));
        assert!(is_controller_claim(
            &prioritized(&["whole", "slice"]),
            lookup
        ));
        assert!(!is_controller_claim(
            &prioritized(&["whole", "other"]),
            lookup
        ));
    }
}
