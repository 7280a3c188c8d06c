//! Builders of the objects the suite creates. Pure functions, so their shape is unit-tested
//! without a cluster.

use std::collections::BTreeMap;

use anyhow::Result;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, Namespace, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, Pod, PodResourceClaim, PodSchedulingGate,
    PodSecurityContext, PodSpec, PodTemplateSpec, ResourceClaim as ContainerClaim,
    ResourceRequirements, SeccompProfile, SecurityContext, Toleration,
};
use k8s_openapi::api::resource::v1::{
    CELDeviceSelector, DeviceClaim, DeviceClaimConfiguration, DeviceRequest, DeviceSelector,
    ExactDeviceRequest, OpaqueDeviceConfiguration, ResourceClaim, ResourceClaimSpec,
    ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kerf_api::params::{
    Allocator, ControllerPlacement, GpuClaimParameters, GpuSelector, OpaqueKind as _,
    PlacementPolicy, Slicing,
};
use kerf_api::{GpuClass, GpuClassSpec};
use serde_json::Value;

use super::settings::Settings;

/// Label on every object the suite creates, so leftovers can be found and deleted.
pub const SUITE_LABEL: &str = "app.kubernetes.io/part-of";
/// Value of [`SUITE_LABEL`].
pub const SUITE: &str = "kerf-e2e";
/// Label naming the test that created a namespace.
pub const TEST_LABEL: &str = "e2e.kerf.dev/test";
/// Name of the pod-level claim entry and of the claim's one request.
pub const CLAIM_REF: &str = "gpu";
/// Scheduling gate that holds a pod back from kube-scheduler.
pub const HOLD_GATE: &str = "e2e.kerf.dev/hold";
/// Line the report script prints before `env`.
pub const ENV_MARKER: &str = "--- kerf-e2e env";
/// Line the report script prints before the device node listing.
pub const DEVICES_MARKER: &str = "--- kerf-e2e devices";
/// Line the report script prints last: the output is complete.
pub const END_MARKER: &str = "--- kerf-e2e end";

const NAME_PREFIX_MAX: usize = 40;

/// What a test container does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Print the environment and the `/dev/nvidia*` nodes, then exit 0.
    ReportAndExit,
    /// Print the same, then sleep until killed.
    ReportAndSleep,
}

/// How a pod refers to its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodClaim<'a> {
    /// An existing ResourceClaim of this name.
    Claim(&'a str),
    /// A claim generated from the ResourceClaimTemplate of this name.
    Template(&'a str),
}

/// `metadata.generateName` for a test's objects: `kerf-e2e-<test>-`, lower-case and short
/// enough for the server's random suffix to fit in a DNS label.
pub fn generate_name(test: &str) -> String {
    let mut cleaned: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    cleaned.truncate(NAME_PREFIX_MAX);
    let cleaned = cleaned.trim_matches('-');
    if cleaned.is_empty() {
        format!("{SUITE}-")
    } else {
        format!("{SUITE}-{cleaned}-")
    }
}

fn suite_labels(test: &str) -> BTreeMap<String, String> {
    let value: String = generate_name(test)
        .trim_end_matches('-')
        .chars()
        .take(63)
        .collect();
    BTreeMap::from([
        (SUITE_LABEL.to_owned(), SUITE.to_owned()),
        (TEST_LABEL.to_owned(), value),
    ])
}

/// The namespace of one test, named by the server (`generateName`).
pub fn namespace(test: &str) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            generate_name: Some(generate_name(test)),
            labels: Some(suite_labels(test)),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// A GpuClass of the test, named by the server (`generateName`).
pub fn gpu_class(test: &str, spec: GpuClassSpec) -> GpuClass {
    let mut class = GpuClass::new("", spec);
    class.metadata.name = None;
    class.metadata.generate_name = Some(generate_name(test));
    class.metadata.labels = Some(suite_labels(test));
    class
}

/// A class of whole GPUs allocated by kube-scheduler.
pub fn scheduler_class_spec() -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Scheduler,
        ..GpuClassSpec::default()
    }
}

/// A class of GPU slices allocated by kerf's controller with BinPack, on GPUs of at least
/// `min_memory` when given.
pub fn controller_class_spec(min_memory: Option<&str>) -> GpuClassSpec {
    GpuClassSpec {
        allocator: Allocator::Controller,
        selector: GpuSelector {
            min_memory: min_memory.map(|m| Quantity(m.to_owned())),
            ..GpuSelector::default()
        },
        slicing: Some(Slicing::default()),
        placement: Some(ControllerPlacement {
            policy: PlacementPolicy::BinPack,
        }),
        sharing: None,
        extended_resource_name: None,
    }
}

/// `GpuClaimParameters` for a slice of `memory` and `compute` percent, as `opaque.parameters`.
pub fn slice_parameters(memory: &str, compute: u8) -> Result<Value> {
    let params = GpuClaimParameters {
        memory: Some(Quantity(memory.to_owned())),
        compute: Some(compute),
        ..GpuClaimParameters::default()
    };
    Ok(params.to_parameters()?)
}

/// A claim spec with one request [`CLAIM_REF`] for one device of `class`, the CEL `selectors`
/// on that request, and `parameters` (an `opaque.parameters` object) for `driver`.
pub fn claim_spec(
    class: &str,
    driver: &str,
    parameters: Option<Value>,
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
    let config = parameters.map(|parameters| {
        vec![DeviceClaimConfiguration {
            requests: Some(vec![CLAIM_REF.to_owned()]),
            opaque: Some(OpaqueDeviceConfiguration {
                driver: driver.to_owned(),
                parameters: RawExtension(parameters),
            }),
        }]
    });
    ResourceClaimSpec {
        devices: Some(DeviceClaim {
            requests: Some(vec![DeviceRequest {
                name: CLAIM_REF.to_owned(),
                exactly: Some(ExactDeviceRequest {
                    device_class_name: class.to_owned(),
                    count: Some(1),
                    selectors,
                    ..ExactDeviceRequest::default()
                }),
                first_available: None,
            }]),
            config,
            constraints: None,
        }),
    }
}

/// The CEL that picks exactly the device of `driver` with this `uuid` attribute.
pub fn uuid_selector(driver: &str, uuid: &str) -> String {
    // Debug formatting quotes and escapes like a CEL string literal for these ASCII values.
    format!("device.driver == {driver:?} && device.attributes[{driver:?}].uuid == {uuid:?}")
}

/// A ResourceClaim.
pub fn resource_claim(name: &str, spec: ResourceClaimSpec) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    }
}

/// A ResourceClaimTemplate.
pub fn claim_template(name: &str, spec: ResourceClaimSpec) -> ResourceClaimTemplate {
    ResourceClaimTemplate {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: ResourceClaimTemplateSpec {
            metadata: None,
            spec,
        },
    }
}

/// The shell script of a test container.
pub fn script(script: Script) -> String {
    // `ls -1d`: one name per line, and a directory such as /dev/nvidia-caps is named, not
    // listed. stderr joins stdout so a missing glob shows up in the logs.
    let report = format!(
        "echo '{ENV_MARKER}'; env; echo '{DEVICES_MARKER}'; ls -1d /dev/nvidia* 2>&1; echo '{END_MARKER}'"
    );
    match script {
        Script::ReportAndExit => format!("{report}; exit 0"),
        Script::ReportAndSleep => format!("{report}; while :; do sleep 3600; done"),
    }
}

/// A pod spec with one container that uses the pod's one claim and runs `script`.
///
/// The pod runs as an unprivileged user with the restricted Pod Security profile, so the suite
/// works in namespaces that enforce it, and tolerates the control-plane taint, so single-node
/// clusters whose only kerf node is a control-plane node work too.
pub fn pod_spec(
    settings: &Settings,
    claim: PodClaim<'_>,
    script_kind: Script,
    restart_policy: &str,
) -> PodSpec {
    let (claim_name, template_name) = match claim {
        PodClaim::Claim(name) => (Some(name.to_owned()), None),
        PodClaim::Template(name) => (None, Some(name.to_owned())),
    };
    PodSpec {
        restart_policy: Some(restart_policy.to_owned()),
        // sleep as the container's main process ignores SIGTERM; a short grace keeps
        // deletions quick.
        termination_grace_period_seconds: Some(1),
        resource_claims: Some(vec![PodResourceClaim {
            name: CLAIM_REF.to_owned(),
            resource_claim_name: claim_name,
            resource_claim_template_name: template_name,
        }]),
        security_context: Some(PodSecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65534),
            run_as_group: Some(65534),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".to_owned(),
                localhost_profile: None,
            }),
            ..PodSecurityContext::default()
        }),
        tolerations: Some(vec![Toleration {
            key: Some("node-role.kubernetes.io/control-plane".to_owned()),
            operator: Some("Exists".to_owned()),
            effect: Some("NoSchedule".to_owned()),
            ..Toleration::default()
        }]),
        containers: vec![Container {
            name: "report".to_owned(),
            image: Some(settings.image.clone()),
            image_pull_policy: Some(settings.pull_policy.clone()),
            command: Some(vec!["sh".to_owned(), "-c".to_owned(), script(script_kind)]),
            resources: Some(ResourceRequirements {
                claims: Some(vec![ContainerClaim {
                    name: CLAIM_REF.to_owned(),
                    request: None,
                }]),
                ..ResourceRequirements::default()
            }),
            security_context: Some(SecurityContext {
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    drop: Some(vec!["ALL".to_owned()]),
                    add: None,
                }),
                ..SecurityContext::default()
            }),
            ..Container::default()
        }],
        ..PodSpec::default()
    }
}

/// `spec` restricted to node `node` by a required node affinity on `metadata.name`, which
/// kube-scheduler and kerf's controller both honour (unlike `nodeName`, it leaves the
/// scheduling to them).
pub fn pin_to_node(mut spec: PodSpec, node: &str) -> PodSpec {
    spec.affinity = Some(Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_fields: Some(vec![NodeSelectorRequirement {
                        key: "metadata.name".to_owned(),
                        operator: "In".to_owned(),
                        values: Some(vec![node.to_owned()]),
                    }]),
                    match_expressions: None,
                }],
            }),
            preferred_during_scheduling_ignored_during_execution: None,
        }),
        ..Affinity::default()
    });
    spec
}

/// A pod; with `hold` it carries [`HOLD_GATE`], so kube-scheduler leaves it alone until the
/// gate is removed.
pub fn pod(name: &str, mut spec: PodSpec, hold: bool) -> Pod {
    if hold {
        spec.scheduling_gates = Some(vec![PodSchedulingGate {
            name: HOLD_GATE.to_owned(),
        }]);
    }
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// A Deployment of `replicas` pods of `spec` (whose restart policy must be `Always`).
pub fn deployment(name: &str, replicas: i32, spec: PodSpec) -> Deployment {
    let labels = BTreeMap::from([("app".to_owned(), name.to_owned())]);
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                match_expressions: None,
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(spec),
            },
            ..DeploymentSpec::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::decode_opaque;
    use kerf_api::params::OpaqueConfig;
    use std::time::Duration;

    fn settings() -> Settings {
        Settings {
            driver: "gpu.kerf.dev".to_owned(),
            image: "registry.local/busybox:1.36".to_owned(),
            pull_policy: "Never".to_owned(),
            timeout: Duration::from_secs(10),
            kubectl: "kubectl".to_owned(),
            helm: "helm".to_owned(),
            helm_set: String::new(),
        }
    }

    #[test]
    fn generated_names_are_short_dns_prefixes() {
        assert_eq!(generate_name("whole_gpu"), "kerf-e2e-whole-gpu-");
        assert_eq!(generate_name("__"), "kerf-e2e-");
        let long = generate_name(&"x".repeat(200));
        // The server appends five characters; a namespace name is a DNS label.
        assert!(long.len() + 5 <= 63, "{long}");
        let labels = suite_labels("Binpack_Deployment");
        assert_eq!(labels[TEST_LABEL], "kerf-e2e-binpack-deployment");
    }

    #[test]
    fn slice_claims_carry_typed_parameters_for_the_driver() {
        let params = slice_parameters("10Gi", 25).unwrap();
        let spec = claim_spec("slices", "gpu.kerf.dev", Some(params), &[]);
        let devices = spec.devices.unwrap();
        let request = &devices.requests.as_ref().unwrap()[0];
        assert_eq!(request.name, CLAIM_REF);
        let exactly = request.exactly.as_ref().unwrap();
        assert_eq!(exactly.device_class_name, "slices");
        assert_eq!(exactly.count, Some(1));
        assert!(exactly.selectors.is_none());
        let config = &devices.config.as_ref().unwrap()[0];
        assert_eq!(
            config.requests.as_deref(),
            Some(&[CLAIM_REF.to_owned()][..])
        );
        let opaque = config.opaque.as_ref().unwrap();
        assert_eq!(opaque.driver, "gpu.kerf.dev");
        match decode_opaque(&opaque.parameters.0, "parameters").unwrap() {
            OpaqueConfig::Claim(p) => {
                assert_eq!(p.memory, Some(Quantity("10Gi".to_owned())));
                assert_eq!(p.compute, Some(25));
            }
            other => panic!("decoded as {other:?}"),
        }
    }

    #[test]
    fn uuid_selectors_are_quoted_cel() {
        let cel = uuid_selector("gpu.kerf.dev", "GPU-1234");
        assert_eq!(
            cel,
            r#"device.driver == "gpu.kerf.dev" && device.attributes["gpu.kerf.dev"].uuid == "GPU-1234""#
        );
        let spec = claim_spec("whole", "gpu.kerf.dev", None, std::slice::from_ref(&cel));
        let devices = spec.devices.unwrap();
        assert!(devices.config.is_none());
        let selectors = devices.requests.unwrap()[0]
            .exactly
            .clone()
            .unwrap()
            .selectors
            .unwrap();
        assert_eq!(selectors[0].cel.as_ref().unwrap().expression, cel);
    }

    #[test]
    fn pods_use_their_claim_image_and_gate() {
        let spec = pod_spec(
            &settings(),
            PodClaim::Template("slice"),
            Script::ReportAndSleep,
            "Always",
        );
        let held = pod("p", spec.clone(), true);
        let held_spec = held.spec.unwrap();
        assert_eq!(held_spec.scheduling_gates.unwrap()[0].name, HOLD_GATE);
        let claims = held_spec.resource_claims.unwrap();
        assert_eq!(claims[0].name, CLAIM_REF);
        assert_eq!(
            claims[0].resource_claim_template_name.as_deref(),
            Some("slice")
        );
        assert!(claims[0].resource_claim_name.is_none());
        let container = &held_spec.containers[0];
        assert_eq!(
            container.image.as_deref(),
            Some("registry.local/busybox:1.36")
        );
        assert_eq!(container.image_pull_policy.as_deref(), Some("Never"));
        let used = container
            .resources
            .as_ref()
            .unwrap()
            .claims
            .as_ref()
            .unwrap();
        assert_eq!(used[0].name, CLAIM_REF);
        let command = container.command.as_ref().unwrap();
        assert!(command[2].contains(ENV_MARKER) && command[2].ends_with("done"));

        assert!(
            pod("p", spec.clone(), false)
                .spec
                .unwrap()
                .scheduling_gates
                .is_none()
        );
        let direct = pod_spec(
            &settings(),
            PodClaim::Claim("c"),
            Script::ReportAndExit,
            "Never",
        );
        assert_eq!(
            direct.resource_claims.unwrap()[0]
                .resource_claim_name
                .as_deref(),
            Some("c")
        );
        assert!(script(Script::ReportAndExit).ends_with("exit 0"));

        let pinned = pin_to_node(spec.clone(), "node-a");
        let required = pinned
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap();
        let labels = BTreeMap::new();
        assert!(kerf_api::node_selection::node_selector_matches(
            &required, &labels, "node-a"
        ));
        assert!(!kerf_api::node_selection::node_selector_matches(
            &required, &labels, "node-b"
        ));

        let deployment = deployment("binpack", 3, spec);
        let deployment_spec = deployment.spec.unwrap();
        assert_eq!(deployment_spec.replicas, Some(3));
        assert_eq!(
            deployment_spec.selector.match_labels,
            deployment_spec.template.metadata.unwrap().labels
        );
    }

    #[test]
    fn classes_are_generated_and_pick_their_allocator() {
        let class = gpu_class("slice", controller_class_spec(Some("30Gi")));
        assert!(class.metadata.name.is_none());
        assert_eq!(
            class.metadata.generate_name.as_deref(),
            Some("kerf-e2e-slice-")
        );
        assert_eq!(class.spec.allocator, Allocator::Controller);
        assert_eq!(
            class.spec.selector.min_memory,
            Some(Quantity("30Gi".to_owned()))
        );
        class.spec.validate("spec").unwrap();
        assert_eq!(scheduler_class_spec().allocator, Allocator::Scheduler);
        assert_eq!(namespace("x").metadata.labels.unwrap()[SUITE_LABEL], SUITE);
    }
}
