//! What becomes of a GpuClass's `spec.extendedResourceName`: the name its DeviceClass carries
//! and the `ExtendedResource` condition that says why.
//!
//! How kube-scheduler serves such a name (kubernetes/kubernetes
//! `pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go`,
//! DRAExtendedResource, beta and on in 1.36):
//! - `preFilterExtendedResources` maps each extended resource a pod requests to a DeviceClass
//!   (its `spec.extendedResourceName`, or the implicit `deviceclass.resource.kubernetes.io/<class>`)
//!   and keeps an in-memory claim without requests;
//! - `filterExtendedResources`, per node: a resource the node advertises in its allocatable
//!   (a device plugin) is left to the device plugin there; only where the allocatable is 0 are
//!   requests `container-<i>-request-<j>` of `deviceClassName: <class>` added, and the
//!   scheduler's own allocator picks devices the class selects from published ResourceSlices;
//! - `bindClaim` at PreBind creates the claim (`<pod>-extended-resources-<random>`, owned by
//!   the pod, annotation `resource.kubernetes.io/extended-resource-claim: "true"`) already
//!   allocated, and `patchPodExtendedResourceClaimStatus` records it in
//!   `pod.status.extendedResourceClaimStatus`.
//!
//! So a Controller class cannot serve it: its DeviceClass selects no published device (the
//! controller allocates its claims), the scheduler finds nothing and the pod stays Pending,
//! and the claim the controller would have to allocate only exists after the scheduler has
//! allocated it. The name is therefore written for Scheduler classes only.
//!
//! A pod asking by extended resource has no ResourceClaim before kube-scheduler's PreBind,
//! so kerf-controller counts its requests as scheduler demand itself
//! (`claims::ownership`, `device_class_for` maps the name as kube-scheduler does).
//!
//! Two DeviceClasses with one name: the API documents (`DeviceClassSpec.ExtendedResourceName`)
//! that the class created later is picked, and of classes created in the same second the one
//! whose name sorts first. The controller still writes the name — what the admin asked, and
//! writing it does not depend on other classes, so two GpuClasses never flap — and reports
//! which class kube-scheduler picks.

use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::GpuClassSpec;
use kerf_api::features::Probed;
use kerf_api::params::Allocator;
use kube::ResourceExt;

use crate::condition::Verdict;

/// `ExtendedResource` reasons the reconciler writes.
pub mod reasons {
    /// The DeviceClass carries the name, and no other DeviceClass names it.
    pub const NAME_APPLIED: &str = "NameApplied";
    /// The DeviceClass carries the name; another DeviceClass names it too, but kube-scheduler
    /// picks this one.
    pub(crate) const NAME_SHARED: &str = "NameShared";
    /// The DeviceClass carries the name, but kube-scheduler picks another DeviceClass for it.
    pub const NAME_TAKEN: &str = "NameTakenByDeviceClass";
    /// Controller classes cannot serve extended resource requests; the name is not written.
    pub const UNSUPPORTED_FOR_CONTROLLER_CLASS: &str = "UnsupportedForControllerClass";
    /// The API server drops DeviceClass `spec.extendedResourceName`; the name is not written.
    pub const NOT_SERVED_BY_API_SERVER: &str = "NotServedByApiServer";
}

/// The name the DeviceClass gets and the `ExtendedResource` condition.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decision {
    /// The DeviceClass's `spec.extendedResourceName`.
    pub name: Option<String>,
    /// The condition; `None` when the class names no extended resource.
    pub verdict: Option<Verdict>,
}

/// Decides for the GpuClass `class` with `spec` (already validated), whose DeviceClass is
/// `own` if it exists, given what the API server serves and every DeviceClass of the cluster.
pub fn decide(
    class: &str,
    spec: &GpuClassSpec,
    served: &Probed,
    own: Option<&DeviceClass>,
    device_classes: &[std::sync::Arc<DeviceClass>],
) -> Decision {
    let Some(name) = spec.extended_resource_name.clone() else {
        return Decision::default();
    };
    if spec.allocator == Allocator::Controller {
        return not_written(
            reasons::UNSUPPORTED_FOR_CONTROLLER_CLASS,
            format!(
                "extendedResourceName {name} is not written to the DeviceClass: kube-scheduler allocates extended resource requests itself from the devices a DeviceClass selects, and a Controller class selects none (kerf's controller allocates its claims), so such pods would stay Pending; use a Scheduler class for {name}, or ResourceClaims for slices"
            ),
        );
    }
    if !served.is_served() {
        let why = match served {
            Probed::Failed(error) => format!("the start-up probe failed: {error}"),
            _ => "the API server drops DeviceClass spec.extendedResourceName (feature gate DRAExtendedResource off, or Kubernetes before 1.36)".to_owned(),
        };
        return not_written(
            reasons::NOT_SERVED_BY_API_SERVER,
            format!(
                "extendedResourceName {name} is not written to the DeviceClass: {why}; pods must use ResourceClaims (restart kerf-controller after enabling the feature)"
            ),
        );
    }
    let verdict = match picked_other(class, &name, own, device_classes) {
        NamePick::Alone => Verdict {
            ok: true,
            reason: reasons::NAME_APPLIED,
            message: format!(
                "DeviceClass {class} carries extendedResourceName {name}: pods asking resources.limits {name} get this class's devices"
            ),
        },
        NamePick::PicksUs(others) => Verdict {
            ok: true,
            reason: reasons::NAME_SHARED,
            message: format!(
                "DeviceClass {class} carries extendedResourceName {name}, and so does DeviceClass {}; kube-scheduler picks {class} (the class created last, then the first name)",
                others.join(", ")
            ),
        },
        NamePick::PicksOther(winner) => Verdict {
            ok: false,
            reason: reasons::NAME_TAKEN,
            message: format!(
                "extendedResourceName {name} is taken by DeviceClass {winner}: kube-scheduler picks it for pods asking {name} (the class created last, then the first name); rename one of them"
            ),
        },
    };
    Decision {
        name: Some(name),
        verdict: Some(verdict),
    }
}

fn not_written(reason: &'static str, message: String) -> Decision {
    Decision {
        name: None,
        verdict: Some(Verdict {
            ok: false,
            reason,
            message,
        }),
    }
}

enum NamePick {
    Alone,
    PicksUs(Vec<String>),
    PicksOther(String),
}

/// The extended resource name every DeviceClass carries implicitly, before its own name
/// (`resourceapi.ResourceDeviceClassPrefix`).
const IMPLICIT_NAME_PREFIX: &str = "deviceclass.resource.kubernetes.io/";

/// The DeviceClass kube-scheduler serves extended resource `resource` from, among
/// `device_classes`: the class named after [`IMPLICIT_NAME_PREFIX`], or of the classes whose
/// `spec.extendedResourceName` is `resource` the one created last, then the first name (the
/// pick [`decide`] reports). kubernetes/kubernetes
/// `pkg/scheduler/framework/plugins/dynamicresources/extended/cache.go`
/// (`ExtendedResourceCache.OnDeviceClassEvent`: the explicit name and the implicit one) and
/// `extendeddynamicresources.go` (`hasDeviceClassMappedExtendedResource`: only a resource that
/// maps to a class is served by DRA).
pub(crate) fn device_class_for<'a>(
    resource: &str,
    device_classes: &'a [std::sync::Arc<DeviceClass>],
) -> Option<&'a DeviceClass> {
    let mut classes = device_classes.iter().map(AsRef::as_ref);
    if let Some(class) = resource.strip_prefix(IMPLICIT_NAME_PREFIX) {
        return classes.find(|dc| dc.name_any() == class);
    }
    classes
        .filter(|dc| dc.spec.extended_resource_name.as_deref() == Some(resource))
        .max_by_key(|dc| pick_key(created_second(dc), dc.name_any()))
}

/// The order in which kube-scheduler prefers DeviceClasses of one extended resource name:
/// the latest creation (whole seconds on the wire), then the smallest name.
fn pick_key(created: Option<i64>, name: String) -> (Option<i64>, std::cmp::Reverse<String>) {
    (created, std::cmp::Reverse(name))
}

fn created_second(dc: &DeviceClass) -> Option<i64> {
    dc.metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_second())
}

/// Which DeviceClass kube-scheduler picks among those naming `name`. `own` not created yet
/// counts as created now, i.e. after every other.
fn picked_other(
    class: &str,
    name: &str,
    own: Option<&DeviceClass>,
    device_classes: &[std::sync::Arc<DeviceClass>],
) -> NamePick {
    let mut others: Vec<&DeviceClass> = device_classes
        .iter()
        .map(AsRef::as_ref)
        .filter(|dc| dc.name_any() != class)
        .filter(|dc| dc.spec.extended_resource_name.as_deref() == Some(name))
        .collect();
    if others.is_empty() {
        return NamePick::Alone;
    }
    let own_created = own.and_then(|dc| dc.metadata.creation_timestamp.as_ref());
    others.sort_by_key(|dc| std::cmp::Reverse(pick_key(created_second(dc), dc.name_any())));
    let best_other = others[0];
    let ours_wins = match own_created {
        None => true,
        Some(t) => {
            pick_key(Some(t.0.as_second()), class.to_owned())
                > pick_key(created_second(best_other), best_other.name_any())
        }
    };
    if ours_wins {
        NamePick::PicksUs(others.iter().map(|dc| dc.name_any()).collect())
    } else {
        NamePick::PicksOther(best_other.name_any())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;
    use std::sync::Arc;

    fn spec(allocator: Allocator, name: Option<&str>) -> GpuClassSpec {
        GpuClassSpec {
            allocator,
            extended_resource_name: name.map(str::to_owned),
            ..GpuClassSpec::default()
        }
    }

    fn dc(name: &str, extended: Option<&str>, created: i64) -> Arc<DeviceClass> {
        let mut dc = DeviceClass::default();
        dc.metadata.name = Some(name.to_owned());
        dc.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        dc.spec.extended_resource_name = extended.map(str::to_owned);
        Arc::new(dc)
    }

    const GPU: &str = "gpu.kerf.dev/gpu";

    #[test]
    fn no_name_no_condition() {
        let d = decide(
            "a",
            &spec(Allocator::Scheduler, None),
            &Probed::Served,
            None,
            &[],
        );
        assert_eq!(d, Decision::default());
    }

    #[test]
    fn controller_classes_and_unserved_servers_get_no_name() {
        let d = decide(
            "a",
            &spec(Allocator::Controller, Some(GPU)),
            &Probed::Served,
            None,
            &[],
        );
        assert_eq!(d.name, None);
        let v = d.verdict.unwrap();
        assert_eq!(
            (v.ok, v.reason),
            (false, reasons::UNSUPPORTED_FOR_CONTROLLER_CLASS)
        );
        for probed in [Probed::Dropped, Probed::Failed("403".to_owned())] {
            let d = decide(
                "a",
                &spec(Allocator::Scheduler, Some(GPU)),
                &probed,
                None,
                &[],
            );
            assert_eq!(d.name, None);
            let v = d.verdict.unwrap();
            assert_eq!((v.ok, v.reason), (false, reasons::NOT_SERVED_BY_API_SERVER));
        }
    }

    #[test]
    fn the_later_class_wins_then_the_first_name() {
        let s = spec(Allocator::Scheduler, Some(GPU));
        let own = dc("b", Some(GPU), 100);
        let decide_with = |others: &[Arc<DeviceClass>]| {
            let mut all = others.to_vec();
            all.push(own.clone());
            decide("b", &s, &Probed::Served, Some(&own), &all)
                .verdict
                .unwrap()
        };
        assert_eq!(decide_with(&[]).reason, reasons::NAME_APPLIED);
        assert_eq!(
            decide_with(&[dc("z", Some("other.dev/x"), 200)]).reason,
            reasons::NAME_APPLIED
        );
        let older = decide_with(&[dc("z", Some(GPU), 50)]);
        assert_eq!((older.ok, older.reason), (true, reasons::NAME_SHARED));
        assert!(older.message.contains('z'), "{}", older.message);
        let newer = decide_with(&[dc("z", Some(GPU), 200)]);
        assert_eq!((newer.ok, newer.reason), (false, reasons::NAME_TAKEN));
        assert!(newer.message.contains("DeviceClass z"), "{}", newer.message);
        // Same second: the first name wins.
        assert_eq!(
            decide_with(&[dc("a", Some(GPU), 100)]).reason,
            reasons::NAME_TAKEN
        );
        assert_eq!(
            decide_with(&[dc("c", Some(GPU), 100)]).reason,
            reasons::NAME_SHARED
        );
        // Not created yet: ours will be the latest.
        let d = decide("b", &s, &Probed::Served, None, &[dc("z", Some(GPU), 200)]);
        assert_eq!(d.verdict.unwrap().reason, reasons::NAME_SHARED);
        assert_eq!(d.name.as_deref(), Some(GPU));
    }

    #[test]
    fn a_resource_maps_to_the_class_kube_scheduler_picks() {
        let name = |dc: Option<&DeviceClass>| dc.map(ResourceExt::name_any);
        let classes = [
            dc("old", Some(GPU), 50),
            dc("new", Some(GPU), 100),
            dc("same-second", Some(GPU), 100),
            dc("plain", None, 10),
        ];
        assert_eq!(
            name(device_class_for(GPU, &classes)).as_deref(),
            Some("new")
        );
        assert_eq!(
            name(device_class_for(
                "deviceclass.resource.kubernetes.io/plain",
                &classes
            ))
            .as_deref(),
            Some("plain")
        );
        // The implicit name of a class that names another resource still maps to it.
        assert_eq!(
            name(device_class_for(
                "deviceclass.resource.kubernetes.io/old",
                &classes
            ))
            .as_deref(),
            Some("old")
        );
        assert_eq!(name(device_class_for("other.dev/x", &classes)), None);
        assert_eq!(
            name(device_class_for(
                "deviceclass.resource.kubernetes.io/missing",
                &classes
            )),
            None
        );
    }
}
