//! The DeviceClasses of the demo: each GpuClass reconciled into its DeviceClass exactly as
//! kerf's controller does ([`kerf_controller::deviceclass::device_class`]), plus the
//! hand-written DeviceClasses.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceClass;
use kerf_api::GpuClassParameters;
use kerf_api::controller_claims::class_parameters;
use serde::{Deserialize, Serialize};

use super::manifests::Manifests;
use super::workload::uid_for;

/// The field manager / `managed-by` label value of DeviceClasses the demo writes.
pub const MANAGER: &str = "kerf-demo";

/// Where a class came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClassSource {
    /// Reconciled from a GpuClass.
    GpuClass,
    /// A hand-written DeviceClass.
    DeviceClass,
}

/// One class as the demo reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClassReport {
    /// The class name (GpuClass and DeviceClass share it).
    pub name: String,
    /// Where it came from.
    pub source: ClassSource,
    /// Scheduler or Controller, when the class carries kerf parameters.
    pub allocator: Option<String>,
    /// Why no DeviceClass exists for it.
    pub error: Option<String>,
}

/// The DeviceClasses by name, and the class report.
#[derive(Debug, Clone, Default)]
pub struct Classes {
    /// DeviceClasses as the API server would hold them.
    pub device_classes: BTreeMap<String, DeviceClass>,
    /// One entry per class manifest, in load order.
    pub reports: Vec<ClassReport>,
    driver: String,
}

impl Classes {
    /// The kerf class parameters of DeviceClass `name`, as the controller reads them.
    pub fn params(&self, name: &str) -> Option<GpuClassParameters> {
        self.device_classes
            .get(name)
            .and_then(|class| class_parameters(class, &self.driver))
    }
}

/// Builds the DeviceClasses of `manifests` for `driver`. A GpuClass whose spec is invalid
/// gets no DeviceClass and a report naming the field; a hand-written DeviceClass of the same
/// name wins over a GpuClass (the controller never overwrites a class it does not own).
pub fn build(manifests: &Manifests, driver: &str) -> Classes {
    let mut classes = Classes {
        driver: driver.to_owned(),
        ..Classes::default()
    };
    for parsed in &manifests.device_classes {
        let class = &parsed.object;
        let name = class.metadata.name.clone().unwrap_or_default();
        let allocator = class_parameters(class, driver).map(|p| format!("{:?}", p.allocator));
        classes.device_classes.insert(name.clone(), class.clone());
        classes.reports.push(ClassReport {
            name,
            source: ClassSource::DeviceClass,
            allocator,
            error: None,
        });
    }
    for parsed in &manifests.gpu_classes {
        let mut gpu_class = parsed.object.clone();
        let name = gpu_class.metadata.name.clone().unwrap_or_default();
        gpu_class.metadata.uid = Some(uid_for("GpuClass", "", &name));
        let allocator = Some(format!("{:?}", gpu_class.spec.allocator));
        let error = if classes.device_classes.contains_key(&name) {
            Some(format!(
                "DeviceClass {name:?} exists and is not owned by this GpuClass; the controller leaves it alone"
            ))
        } else {
            // The demo's in-memory cluster is a 1.36 one serving DRAConsumableCapacity, as the
            // stand-in allocates consumable capacity: sliced Scheduler classes select shareable
            // GPUs, whole-GPU Scheduler classes only GPUs that are not.
            match kerf_controller::deviceclass::device_class(&gpu_class, driver, MANAGER, true) {
                Ok(device_class) => {
                    classes.device_classes.insert(name.clone(), device_class);
                    None
                }
                Err(e) => Some(e.to_string()),
            }
        };
        classes.reports.push(ClassReport {
            name,
            source: ClassSource::GpuClass,
            allocator,
            error,
        });
    }
    for refused in manifests
        .invalid
        .iter()
        .filter(|i| i.kind == "GpuClass" || i.kind == "DeviceClass")
    {
        classes.reports.push(ClassReport {
            name: refused.name.clone(),
            source: if refused.kind == "GpuClass" {
                ClassSource::GpuClass
            } else {
                ClassSource::DeviceClass
            },
            allocator: None,
            error: Some(refused.error.clone()),
        });
    }
    classes
}
