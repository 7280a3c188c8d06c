//! DeviceClasses that select kerf's devices without the ownership guard: kube-scheduler may
//! allocate through them devices kerf-controller owns. Reported once per class version, as a
//! Warning Event on the class and a log line.

use std::collections::HashSet;

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use kerf_api::Allocator;
use kerf_api::controller_claims::class_parameters;
use kerf_api::ownership::scheduler_guard_cel;
use kube::Resource as _;
use kube::runtime::events::{Event, EventType};

use crate::claims::ClaimsContext;

/// Event reason on a DeviceClass without the ownership guard.
pub(super) const UNGUARDED_CLASS: &str = "AllocatorGuardMissing";

/// The DeviceClass names a claim's requests use, sorted, each once.
pub(super) fn request_classes(claim: &ResourceClaim) -> Vec<String> {
    let mut names: Vec<String> =
        kerf_api::controller_claims::request_class_names(claim.spec.devices.as_ref())
            .map(str::to_owned)
            .collect();
    names.sort();
    names.dedup();
    names
}

/// True when `class` selects devices of `driver` for kube-scheduler without requiring the
/// scheduler's ownership: it names the driver in a selector, carries no Controller parameters
/// (those classes match nothing published), and no selector holds the guard.
pub(super) fn is_unguarded(class: &DeviceClass, driver: &str) -> bool {
    if class_parameters(class, driver).is_some_and(|p| p.allocator == Allocator::Controller) {
        return false;
    }
    let expressions: Vec<&str> = class
        .spec
        .selectors
        .iter()
        .flatten()
        .filter_map(|s| s.cel.as_ref())
        .map(|c| c.expression.as_str())
        .collect();
    let quoted = serde_json::Value::String(driver.to_owned()).to_string();
    let guard = scheduler_guard_cel(driver);
    expressions.iter().any(|e| e.contains(&quoted))
        && !expressions.iter().any(|e| e.contains(&guard))
}

/// Warns about every unguarded DeviceClass not warned about at its current version.
pub(super) async fn warn_unguarded_classes(
    ctx: &ClaimsContext,
    warned: &mut HashSet<(String, String)>,
) {
    for class in ctx.core.caches.device_classes.state() {
        if !is_unguarded(&class, ctx.core.driver()) {
            continue;
        }
        let key = (
            class.metadata.name.clone().unwrap_or_default(),
            class.metadata.resource_version.clone().unwrap_or_default(),
        );
        if !warned.insert(key.clone()) {
            continue;
        }
        let note = format!(
            "selects {} devices without the ownership guard, so kube-scheduler may allocate a \
             device kerf-controller owns; make the class from a GpuClass or add `{}` to its \
             selector",
            ctx.core.driver(),
            scheduler_guard_cel(ctx.core.driver())
        );
        tracing::warn!(device_class = %key.0, "{note}");
        let event = Event {
            type_: EventType::Warning,
            reason: UNGUARDED_CLASS.to_owned(),
            note: Some(note),
            action: "CheckOwnership".to_owned(),
            secondary: None,
        };
        if let Err(error) = ctx
            .core
            .recorder
            .publish(&event, &class.object_ref(&()))
            .await
        {
            tracing::debug!(device_class = %key.0, %error, "could not publish event");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn class(expression: &str) -> DeviceClass {
        serde_json::from_value(json!({
            "metadata": {"name": "c"},
            "spec": {"selectors": [{"cel": {"expression": expression}}]}
        }))
        .unwrap()
    }

    #[test]
    fn a_hand_written_kerf_class_without_the_guard_is_found() {
        let driver = "gpu.kerf.dev";
        assert!(is_unguarded(
            &class(r#"device.driver == "gpu.kerf.dev""#),
            driver
        ));
        let guarded = format!(
            r#"device.driver == "gpu.kerf.dev" && {}"#,
            scheduler_guard_cel(driver)
        );
        assert!(!is_unguarded(&class(&guarded), driver));
        assert!(!is_unguarded(
            &class(r#"device.driver == "other.example.com""#),
            driver
        ));
    }
}
