//! Admission emulation: kerf's mutating webhook applied to each pod the sim creates.
//!
//! Upstream: the API server calls a mutating admission webhook before it persists a created
//! object and applies the JSONPatch of the answer (`staging/src/k8s.io/apiserver/pkg/
//! admission/plugin/webhook/mutating/dispatcher.go`, `callAttrMutatingHook`: the patch is
//! decoded with `jsonpatch.DecodePatch` and applied to the object being admitted). kerf's
//! webhook decides with [`kerf_controller::webhook::decide()`]; here the same function decides
//! and the patch is applied with `json-patch` before the pod is created, so the stored pod is
//! what the API server would store.
//!
//! Simplification: the production webhook reads claims, templates and DeviceClasses from its
//! own watch caches, which may lag behind the API (then the pod is admitted ungated, as under
//! `failurePolicy: Ignore`); the sim reads them from [`FakeApi`]'s current state, so its
//! decisions are what an up-to-date webhook decides.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceClaimTemplate};
use kerf_api::params::GpuClassParameters;
use kerf_controller::webhook::{ClaimLookup, PodDecision, decide};
use serde_json::Value;

use super::SimError;
use crate::fake_api::FakeApi;

/// [`ClaimLookup`] over the fake API server's current state.
#[derive(Debug, Clone, Copy)]
pub struct FakeLookup<'a> {
    fake: &'a FakeApi,
    driver: &'a str,
}

impl<'a> FakeLookup<'a> {
    /// Looks objects up in `fake`; class parameters of `driver`.
    pub fn new(fake: &'a FakeApi, driver: &'a str) -> Self {
        FakeLookup { fake, driver }
    }
}

impl ClaimLookup for FakeLookup<'_> {
    fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.fake.get_resource(Some(namespace), name)
    }

    fn template(&self, namespace: &str, name: &str) -> Option<ResourceClaimTemplate> {
        self.fake.get_resource(Some(namespace), name)
    }

    fn class_parameters(&self, name: &str) -> Option<GpuClassParameters> {
        let class: DeviceClass = self.fake.get_resource(None, name)?;
        kerf_api::controller_claims::class_parameters(&class, self.driver)
    }
}

/// Runs `pod` (JSON, as it is about to be created in `namespace`) through kerf's admission
/// decision and applies the patch when the decision is to gate. Returns the decision.
///
/// # Errors
/// [`SimError::Setup`] when the pod is not a Pod or the patch does not apply (a bug).
pub fn admit(
    fake: &FakeApi,
    driver: &str,
    namespace: &str,
    pod: &mut Value,
) -> Result<PodDecision, SimError> {
    let typed: Pod = serde_json::from_value(pod.clone())
        .map_err(|e| SimError::Setup(format!("admission: not a pod: {e}")))?;
    let decision = decide(&typed, namespace, &FakeLookup::new(fake, driver));
    if let PodDecision::Gate(patch) = &decision {
        let patch: json_patch::Patch = serde_json::from_value(patch.clone())
            .map_err(|e| SimError::Setup(format!("admission: patch: {e}")))?;
        json_patch::patch(pod, &patch)
            .map_err(|e| SimError::Setup(format!("admission: patch does not apply: {e}")))?;
    }
    Ok(decision)
}
