//! The pure decision: does a pod being created need kerf's scheduling gate, and the JSONPatch
//! that adds it.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kerf_api::controller_claims::{
    SCHEDULING_GATE, is_controller_claim, requests_controller_class,
};
use kerf_api::params::GpuClassParameters;
use serde_json::{Value, json};

use super::outcome::{PodDecision, Skip};

/// What the webhook reads to decide: the claims, claim templates and class parameters the pod
/// refers to. Implemented over the watch caches in production ([`super::WebhookCaches`]) and
/// over maps in tests.
pub trait ClaimLookup {
    /// The ResourceClaim `name` in `namespace`, if known.
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim>;
    /// The ResourceClaimTemplate `name` in `namespace`, if known.
    fn template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate>;
    /// kerf's class parameters of the DeviceClass `name` (for this controller's driver), if
    /// the class exists and carries them.
    fn class_parameters(&self, name: &str) -> Option<GpuClassParameters>;
}

/// Decides whether `pod` (created in `namespace`) needs the scheduling gate.
///
/// A pod needs it when one of its `spec.resourceClaims` is a Controller-class claim: a
/// `resourceClaimName` whose claim [`is_controller_claim`], or a `resourceClaimTemplateName`
/// whose template's `spec.spec.devices` [`requests_controller_class`]. A referenced claim or
/// template that does not exist (yet) is unknown: when no known claim decides for the gate,
/// the pod is admitted unchanged. That is what `failurePolicy: Ignore` does for any failure of
/// the webhook, and what happened before the webhook existed; a wrong gate would hold the pod
/// until someone removes it by hand, a missing one only risks the scheduler trying the pod
/// early. Pods with `spec.nodeName` and pods that already carry the gate are left alone.
pub fn decide(pod: &Pod, namespace: &str, lookup: &impl ClaimLookup) -> PodDecision {
    let Some(spec) = pod.spec.as_ref() else {
        return PodDecision::Skip(Skip::NoControllerClaim);
    };
    if spec.node_name.as_deref().is_some_and(|n| !n.is_empty()) {
        return PodDecision::Skip(Skip::Bound);
    }
    let gates = spec.scheduling_gates.as_deref();
    if gates
        .unwrap_or_default()
        .iter()
        .any(|g| g.name == SCHEDULING_GATE)
    {
        return PodDecision::Skip(Skip::AlreadyGated);
    }
    let params = |class: &str| lookup.class_parameters(class);
    let mut unknown = None;
    for pod_claim in spec.resource_claims.as_deref().unwrap_or_default() {
        let controller = if let Some(name) = pod_claim.resource_claim_name.as_deref() {
            let claim = lookup.claim(namespace, name);
            if claim.is_none() {
                unknown.get_or_insert_with(|| format!("ResourceClaim {namespace}/{name}"));
            }
            claim.is_some_and(|c| is_controller_claim(&c, params))
        } else if let Some(name) = pod_claim.resource_claim_template_name.as_deref() {
            let template = lookup.template(namespace, name);
            if template.is_none() {
                unknown.get_or_insert_with(|| format!("ResourceClaimTemplate {namespace}/{name}"));
            }
            template
                .is_some_and(|t| requests_controller_class(t.spec.spec.devices.as_ref(), params))
        } else {
            false
        };
        if controller {
            return PodDecision::Gate(gate_patch(gates.is_some()));
        }
    }
    PodDecision::Skip(match unknown {
        Some(what) => Skip::Unknown { what },
        None => Skip::NoControllerClaim,
    })
}

/// The JSONPatch adding the gate: appends to `spec.schedulingGates` when the pod has the list,
/// creates the list otherwise (RFC 6902 `add` to a missing array index fails).
pub fn gate_patch(has_gates: bool) -> Value {
    if has_gates {
        json!([{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": SCHEDULING_GATE}}])
    } else {
        json!([{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": SCHEDULING_GATE}]}])
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::resource::v1::{DeviceClaim, ResourceClaimSpec};
    use kerf_api::params::Allocator;
    use serde_json::from_value;

    use super::*;

    #[derive(Default)]
    struct Maps {
        claims: BTreeMap<String, ResourceClaim>,
        templates: BTreeMap<String, ResourceClaimTemplate>,
    }

    impl ClaimLookup for Maps {
        fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
            self.claims.get(&format!("{namespace}/{name}")).cloned()
        }
        fn template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate> {
            self.templates.get(&format!("{namespace}/{name}")).cloned()
        }
        fn class_parameters(&self, name: &str) -> Option<GpuClassParameters> {
            let allocator = match name {
                "slice" => Allocator::Controller,
                "whole" => Allocator::Scheduler,
                _ => return None,
            };
            Some(GpuClassParameters {
                allocator,
                ..GpuClassParameters::default()
            })
        }
    }

    fn devices(class: &str) -> DeviceClaim {
        from_value(json!({"requests": [{"name": "gpu", "exactly": {"deviceClassName": class}}]}))
            .unwrap()
    }

    fn maps() -> Maps {
        let mut maps = Maps::default();
        for class in ["slice", "whole", "other"] {
            maps.claims.insert(
                format!("ns/{class}"),
                ResourceClaim {
                    spec: ResourceClaimSpec {
                        devices: Some(devices(class)),
                    },
                    ..ResourceClaim::default()
                },
            );
            let mut template: ResourceClaimTemplate = from_value(json!({
                "metadata": {"name": class}, "spec": {"spec": {}}
            }))
            .unwrap();
            template.spec.spec.devices = Some(devices(class));
            maps.templates.insert(format!("ns/{class}-t"), template);
        }
        maps
    }

    #[allow(clippy::needless_pass_by_value)] // callers pass json!() literals
    fn pod(spec: Value) -> Pod {
        from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[allow(clippy::needless_pass_by_value)] // callers pass json!() literals
    fn claims(refs: Value) -> Pod {
        pod(json!({"containers": [], "resourceClaims": refs}))
    }

    #[test]
    fn controller_claims_and_templates_get_the_gate() {
        let maps = maps();
        let by_name = claims(json!([{"name": "a", "resourceClaimName": "whole"},
                                    {"name": "b", "resourceClaimName": "slice"}]));
        assert_eq!(
            decide(&by_name, "ns", &maps),
            PodDecision::Gate(gate_patch(false))
        );
        let by_template = claims(json!([{"name": "a", "resourceClaimTemplateName": "slice-t"}]));
        assert_eq!(
            decide(&by_template, "ns", &maps),
            PodDecision::Gate(gate_patch(false))
        );
    }

    #[test]
    fn other_claims_get_no_gate() {
        let maps = maps();
        for refs in [
            json!([{"name": "a", "resourceClaimName": "whole"}]),
            json!([{"name": "a", "resourceClaimName": "other"}]),
            json!([{"name": "a", "resourceClaimTemplateName": "whole-t"}]),
            json!([{"name": "a"}]),
            json!([]),
        ] {
            assert_eq!(
                decide(&claims(refs.clone()), "ns", &maps),
                PodDecision::Skip(Skip::NoControllerClaim),
                "{refs}"
            );
        }
        // The same claim name in another namespace is not the pod's.
        let elsewhere = claims(json!([{"name": "a", "resourceClaimName": "slice"}]));
        assert!(matches!(
            decide(&elsewhere, "other-ns", &maps),
            PodDecision::Skip(Skip::Unknown { .. })
        ));
    }

    #[test]
    fn bound_and_gated_pods_are_left_alone() {
        let maps = maps();
        let bound = pod(json!({"containers": [], "nodeName": "n",
            "resourceClaims": [{"name": "a", "resourceClaimName": "slice"}]}));
        assert_eq!(decide(&bound, "ns", &maps), PodDecision::Skip(Skip::Bound));
        let gated = pod(json!({"containers": [],
            "schedulingGates": [{"name": "x"}, {"name": SCHEDULING_GATE}],
            "resourceClaims": [{"name": "a", "resourceClaimName": "slice"}]}));
        assert_eq!(
            decide(&gated, "ns", &maps),
            PodDecision::Skip(Skip::AlreadyGated)
        );
        let other_gate = pod(json!({"containers": [], "schedulingGates": [{"name": "x"}],
            "resourceClaims": [{"name": "a", "resourceClaimName": "slice"}]}));
        assert_eq!(
            decide(&other_gate, "ns", &maps),
            PodDecision::Gate(gate_patch(true))
        );
        assert_eq!(
            decide(&Pod::default(), "ns", &maps),
            PodDecision::Skip(Skip::NoControllerClaim)
        );
    }

    #[test]
    fn unknown_claims_fall_back_to_no_gate_unless_a_known_one_decides() {
        let maps = maps();
        let missing = claims(json!([{"name": "a", "resourceClaimName": "nope"},
                                    {"name": "b", "resourceClaimTemplateName": "nope-t"}]));
        assert_eq!(
            decide(&missing, "ns", &maps),
            PodDecision::Skip(Skip::Unknown {
                what: "ResourceClaim ns/nope".to_owned()
            })
        );
        let mixed = claims(json!([{"name": "a", "resourceClaimName": "nope"},
                                  {"name": "b", "resourceClaimTemplateName": "slice-t"}]));
        assert_eq!(
            decide(&mixed, "ns", &maps),
            PodDecision::Gate(gate_patch(false))
        );
    }

    #[test]
    fn the_patch_applies_to_pods_with_and_without_gates() {
        for (gates, expected) in [
            (None, json!([{"name": SCHEDULING_GATE}])),
            (Some(json!([])), json!([{"name": SCHEDULING_GATE}])),
            (
                Some(json!([{"name": "x"}])),
                json!([{"name": "x"}, {"name": SCHEDULING_GATE}]),
            ),
        ] {
            let mut doc = json!({"spec": {"containers": []}});
            if let Some(gates) = gates.clone() {
                doc["spec"]["schedulingGates"] = gates;
            }
            let patch: json_patch::Patch = from_value(gate_patch(gates.is_some())).unwrap();
            json_patch::patch(&mut doc, &patch).unwrap();
            assert_eq!(doc["spec"]["schedulingGates"], expected);
        }
    }
}
