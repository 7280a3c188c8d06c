//! Releasing a pod to kube-scheduler: once every controller claim of the pod is allocated,
//! the scheduling gate kerf's admission webhook put on it is removed, and the scheduler only
//! has to bind the pod where the allocations' node selectors point.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::claims::ClaimsContext;
use crate::context::Write;
use crate::error::{Error, Result};
use kerf_api::controller_claims::SCHEDULING_GATE;

/// Where the pod's kerf gate is in `spec.schedulingGates`, if it has one.
pub(super) fn gate_index(pod: &Pod) -> Option<usize> {
    pod.spec
        .as_ref()?
        .scheduling_gates
        .as_ref()?
        .iter()
        .position(|gate| gate.name == SCHEDULING_GATE)
}

/// The message of kube-apiserver's 422 for a JSON patch that does not apply, a failed `test`
/// op among them: `applyJSPatch` in kubernetes/kubernetes
/// `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go` answers
/// `NewGenericServerResponse(http.StatusUnprocessableEntity, …)`, whose message for 422 is this
/// generic sentence (apimachinery `pkg/api/errors/errors.go`); a validation error of the
/// patched pod is also 422, but names the pod and the field.
const PATCH_NOT_APPLICABLE: &str = "the server rejected our request due to an error in our request";

/// The pods whose gate this controller removed, by UID, with the resourceVersion of the pod it
/// removed it from.
///
/// The claims' own status events reconcile the pod again right after the allocation, usually
/// before the pod watch brings the ungated pod: without this, every such reconcile sent the
/// removal again (about 0.6 extra pod patches per pod at 500 nodes), each refused by its
/// `test` op, but each a write the API server pays for.
#[derive(Debug, Default)]
pub(crate) struct ReleasedGates {
    sent: Mutex<HashMap<String, String>>,
}

impl ReleasedGates {
    /// True when the removal was already sent for this very version of the pod.
    fn already_sent(&self, uid: &str, resource_version: &str) -> bool {
        self.lock()
            .get(uid)
            .is_some_and(|rv| rv == resource_version)
    }

    /// True when a removal was sent (or is being sent) for any version of the pod: from then
    /// on kube-scheduler may bind it ([`super::state::in_use`]).
    pub(super) fn sent_any(&self, uid: &str) -> bool {
        self.lock().contains_key(uid)
    }

    fn sent(&self, uid: String, resource_version: String) {
        self.lock().insert(uid, resource_version);
    }

    /// The pod has no kerf gate any more (or is gone): nothing to remember.
    fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        // A panic while holding it cannot leave the map inconsistent: every use is one call.
        self.sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Removes the kerf gate from `pod` (nothing to do without one, nor when the removal was
/// already sent for this version of the pod: see [`ReleasedGates`]). A JSON patch that tests
/// the gate's position first, so a concurrent change of the gates fails the write instead of
/// removing someone else's gate; the pod's next event brings it back.
///
/// # Errors
/// [`Error::Write`] when the write fails for another reason than the pod being gone or its
/// gates having changed meanwhile: a refusal (403 when kerf-controller may not patch pods)
/// is reported on the pod by the claim reconciler.
pub(super) async fn release(pod: &Pod, ctx: &ClaimsContext) -> Result<()> {
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let Some(index) = gate_index(pod) else {
        ctx.released_gates.forget(uid);
        return Ok(());
    };
    let version = pod.resource_version().unwrap_or_default();
    if ctx.released_gates.already_sent(uid, &version) {
        return Ok(());
    }
    let namespace = pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(ctx.core.client.clone(), &namespace);
    let path = format!("/spec/schedulingGates/{index}");
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": format!("{path}/name"), "value": SCHEDULING_GATE},
        {"op": "remove", "path": path},
    ]))
    .map_err(|e| Error::serialize("scheduling gate patch", e))?;
    let params = PatchParams {
        field_manager: Some(ctx.core.config.field_manager.clone()),
        ..PatchParams::default()
    };
    // Noted before the write: from the moment the API server may apply it, kube-scheduler may
    // bind the pod, and the claims reserved for it are in use.
    ctx.released_gates.sent(uid.to_owned(), version);
    match api
        .patch(&pod.name_any(), &params, &Patch::Json::<()>(patch))
        .await
    {
        Ok(_) => {
            tracing::debug!(pod = %pod.name_any(), %namespace, "scheduling gate removed");
            Ok(())
        }
        // Gone, or the gates changed under us (the test op failed): nothing to release now.
        Err(kube::Error::Api(status))
            if matches!(status.code, 404 | 409)
                || (status.code == 422 && status.message == PATCH_NOT_APPLICABLE) =>
        {
            ctx.released_gates.forget(uid);
            Ok(())
        }
        Err(source) => {
            // Sent again on the retry. (After a transport error the removal may have been
            // applied all the same: then the pod watch soon shows the pod ungated, which
            // counts as in use too.)
            ctx.released_gates.forget(uid);
            let write = Write::patch("pods", Some(&namespace), &pod.name_any());
            Err(Error::write(write, source))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_only_kerfs_gate() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [], "schedulingGates": [
                {"name": "example.com/other"}, {"name": SCHEDULING_GATE}
            ]}
        }))
        .unwrap();
        assert_eq!(gate_index(&pod), Some(1));
        let ungated: Pod =
            serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"containers": []}}))
                .unwrap();
        assert_eq!(gate_index(&ungated), None);
    }

    #[test]
    fn a_removal_is_sent_once_per_version_of_the_pod() {
        let released = ReleasedGates::default();
        assert!(!released.already_sent("uid-1", "10"));
        released.sent("uid-1".to_owned(), "10".to_owned());
        assert!(released.already_sent("uid-1", "10"));
        // A newer version (the gate put back, say) gets its own removal.
        assert!(!released.already_sent("uid-1", "11"));
        assert!(!released.already_sent("uid-2", "10"));
        released.forget("uid-1");
        assert!(!released.already_sent("uid-1", "10"));
    }
}
