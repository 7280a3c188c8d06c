//! The pure decision for a ResourceClaim or ResourceClaimTemplate being created: are its
//! configs for kerf's driver valid `GpuClaimParameters`, and the JSONPatch that rewrites each
//! of them in the [`canonical`] form.
//!
//! Why every kerf config is rewritten, even one that already looks canonical: kube-apiserver
//! sends the webhook the object re-encoded by `encoding/json`
//! (`runtime/serializer/json/json.go`, `Serializer.doEncode`), which compacts a
//! `RawExtension`'s bytes, so the webhook never sees the spaces a client such as Python's
//! `json.dumps` wrote; the stored object keeps them unless a webhook answers with a non-empty
//! patch. Only then does the API server encode the object, apply the patch and decode the
//! result (`callAttrMutatingHook` in
//! `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/mutating/dispatcher.go`: an empty
//! patch returns early; `jsonpatch.DecodePatch` and `Apply` from
//! `gopkg.in/evanphx/json-patch.v4`, whose `replace` keeps the value's bytes as sent and whose
//! marshal compacts them), so a `replace` with the canonical bytes is what stores them.

use kerf_api::Error as ApiError;
use kerf_api::params::{GpuClaimParameters, OpaqueConfig, OpaqueKind as _, decode_opaque};
use serde_json::Value;

use super::canonical::canonical;
use super::outcome::{ClaimDecision, ClaimResource};

/// Decides for `object` (the `resource` being created) with configs of `driver`.
///
/// Each `opaque` config of `driver` must hold `GpuClaimParameters` that
/// [`decode_opaque`] accepts (the decoding and checks the controller uses for its Events, so
/// the messages are the same); the first one that does not decides [`ClaimDecision::Invalid`].
/// Parameters that are not an object are invalid too: kube-apiserver's own validation
/// (`validateRawExtension` in `pkg/apis/resource/validation/validation.go`) refuses them right
/// after the mutating webhooks, and kerf's message names the field and value. Other drivers'
/// configs and everything else in the object are left alone.
pub fn decide_claim(object: &Value, resource: ClaimResource, driver: &str) -> ClaimDecision {
    let configs = object
        .pointer(resource.config_pointer())
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut operations = Vec::new();
    for (i, config) in configs.iter().enumerate() {
        let Some(opaque) = config.get("opaque") else {
            continue;
        };
        if opaque.get("driver").and_then(Value::as_str) != Some(driver) {
            continue;
        }
        let field = format!("{}[{i}].opaque.parameters", resource.config_field());
        let parameters = opaque.get("parameters").unwrap_or(&Value::Null);
        if let Err(error) = check_parameters(parameters, &field) {
            return invalid(error, field);
        }
        let pointer = format!("{}/{i}/opaque/parameters", resource.config_pointer());
        // The pointer holds digits and fixed names only, and the value is already JSON text:
        // the operation is written as text so the value's bytes are sent exactly.
        operations.push(format!(
            r#"{{"op":"replace","path":"{pointer}","value":{}}}"#,
            canonical(parameters)
        ));
    }
    if operations.is_empty() {
        return ClaimDecision::NoKerfConfig;
    }
    ClaimDecision::Normalize {
        configs: operations.len(),
        patch: format!("[{}]", operations.join(",")),
    }
}

/// Decodes `parameters` (at `field`) as a claim's: `GpuClaimParameters` only.
fn check_parameters(parameters: &Value, field: &str) -> Result<(), ApiError> {
    match decode_opaque(parameters, field)? {
        OpaqueConfig::Claim(_) => Ok(()),
        // The same words as the controller's (kerf_api::allocation's claim_configs).
        other => Err(ApiError::config(
            format!("{field}.kind"),
            format!(
                "{} does not belong in a ResourceClaim; expected {}",
                other.kind(),
                GpuClaimParameters::KIND
            ),
        )),
    }
}

fn invalid(error: ApiError, field: String) -> ClaimDecision {
    match error {
        ApiError::InvalidConfig { path, message } => ClaimDecision::Invalid {
            field: path,
            message,
        },
        // decode_opaque reports every problem as InvalidConfig; anything else still names
        // the parameters.
        other => ClaimDecision::Invalid {
            field,
            message: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests;
