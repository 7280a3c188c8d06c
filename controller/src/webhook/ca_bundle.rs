//! Keeps this replica's CA in the `caBundle` of the webhook configurations (mutating and
//! validating).
//!
//! Every replica makes its own CA, and the API server may call any replica behind the Service,
//! so the bundle holds several CAs: a replica puts its current CA first and keeps the others'
//! (up to [`MAX_BUNDLE_CAS`]), so replicas and rotations do not evict each other. The write
//! is a JSONPatch that first tests the configuration's resourceVersion: two replicas writing at
//! once cannot lose each other's CA. The loser reads the configuration again and writes at
//! once: every replica of a rollout starts at about the same moment, and until its CA is in
//! the bundle the API server's calls that reach it fail TLS verification.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::error::{Error, Result};

/// Writes of one CA tried before giving up to the caller's next round: each lost write means
/// another replica wrote in between, so a handful covers every replica of a rollout.
const WRITE_ATTEMPTS: u32 = 8;

/// At most this many CA certificates stay in a bundle: enough for a few replicas, each with a
/// current and a previous CA, and a bound on what restarts can pile up.
pub const MAX_BUNDLE_CAS: usize = 8;

const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const END: &str = "-----END CERTIFICATE-----";

/// The PEM certificate blocks of `bundle`, normalised (one block per entry, `\n` line ends).
pub fn pem_blocks(bundle: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut rest = bundle;
    while let Some(start) = rest.find(BEGIN) {
        let Some(len) = rest[start..].find(END) else {
            break;
        };
        let end = start + len + END.len();
        let body: String = rest[start..end]
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join("\n");
        blocks.push(body + "\n");
        rest = &rest[end..];
    }
    blocks
}

/// The bundle with `ca` first, followed by the other CAs of `existing` (without duplicates),
/// cut to [`MAX_BUNDLE_CAS`].
pub fn merged_bundle(existing: &str, ca: &str) -> String {
    let ca = pem_blocks(ca);
    let mut blocks = ca.clone();
    for block in pem_blocks(existing) {
        if !blocks.contains(&block) {
            blocks.push(block);
        }
    }
    blocks.truncate(MAX_BUNDLE_CAS.max(ca.len()));
    blocks.concat()
}

/// A kind of webhook configuration whose webhooks each have a `clientConfig.caBundle`.
pub trait WebhookConfiguration:
    Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug
{
    /// The kind, for errors.
    const KIND: &'static str;
    /// The client configuration of each webhook, in order.
    fn client_configs(&self) -> Vec<&WebhookClientConfig>;
}

impl WebhookConfiguration for MutatingWebhookConfiguration {
    const KIND: &'static str = "MutatingWebhookConfiguration";
    fn client_configs(&self) -> Vec<&WebhookClientConfig> {
        self.webhooks
            .iter()
            .flatten()
            .map(|w| &w.client_config)
            .collect()
    }
}

impl WebhookConfiguration for ValidatingWebhookConfiguration {
    const KIND: &'static str = "ValidatingWebhookConfiguration";
    fn client_configs(&self) -> Vec<&WebhookClientConfig> {
        self.webhooks
            .iter()
            .flatten()
            .map(|w| &w.client_config)
            .collect()
    }
}

/// Makes sure every webhook of the webhook configuration `name` trusts `ca` (a PEM
/// certificate), patching with `field_manager`. Returns whether it wrote. A write that lost
/// to a concurrent change is read and tried again, up to [`WRITE_ATTEMPTS`] times.
///
/// # Errors
///
/// [`Error::Kube`] when the configuration cannot be read or the patch fails (also when every
/// attempt lost to a concurrent change); [`Error::MissingField`] when the configuration has
/// no resourceVersion.
pub async fn ensure_ca<K: WebhookConfiguration>(
    api: &Api<K>,
    name: &str,
    ca: &str,
    field_manager: &str,
) -> Result<bool> {
    let mut attempt = 1;
    loop {
        match write_ca(api, name, ca, field_manager).await {
            Err(Error::Kube(kube::Error::Api(status)))
                if lost_to_a_concurrent_change(&status) && attempt < WRITE_ATTEMPTS =>
            {
                attempt += 1;
            }
            outcome => return outcome,
        }
    }
}

/// Whether the API server refused the patch because the configuration changed since it was
/// read: its resourceVersion test failed, which kube-apiserver answers with a 422 (`applyJSPatch`
/// in k8s.io/apiserver `pkg/endpoints/handlers/patch.go`: `NewGenericServerResponse(422, …)`),
/// or a 409 from a conflicting update in storage.
fn lost_to_a_concurrent_change(status: &kube::core::Status) -> bool {
    status.code == 409 || status.code == 422
}

/// One read and (when the CA is missing) one resourceVersion-tested write of [`ensure_ca`].
async fn write_ca<K: WebhookConfiguration>(
    api: &Api<K>,
    name: &str,
    ca: &str,
    field_manager: &str,
) -> Result<bool> {
    let config = api.get(name).await?;
    let wanted = pem_blocks(ca);
    let mut ops = Vec::new();
    for (i, client_config) in config.client_configs().into_iter().enumerate() {
        let current = client_config
            .ca_bundle
            .as_ref()
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
            .unwrap_or_default();
        let present = pem_blocks(&current);
        if wanted.iter().all(|b| present.contains(b)) {
            continue;
        }
        ops.push(json!({
            "op": "add",
            "path": format!("/webhooks/{i}/clientConfig/caBundle"),
            "value": STANDARD.encode(merged_bundle(&current, ca)),
        }));
    }
    if ops.is_empty() {
        return Ok(false);
    }
    let version = config
        .meta()
        .resource_version
        .clone()
        .ok_or(Error::MissingField {
            kind: K::KIND,
            field: "resourceVersion",
        })?;
    ops.insert(
        0,
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}),
    );
    let patch: json_patch::Patch =
        serde_json::from_value(json!(ops)).map_err(|e| Error::serialize("caBundle patch", e))?;
    let params = PatchParams {
        field_manager: Some(field_manager.to_owned()),
        ..PatchParams::default()
    };
    api.patch(name, &params, &Patch::<()>::Json(patch)).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(tag: &str) -> String {
        format!("{BEGIN}\n{tag}\n{END}\n")
    }

    #[test]
    fn the_new_ca_goes_first_and_others_stay() {
        let existing = format!("{}\r\n{}", cert("a").replace('\n', "\r\n"), cert("b"));
        assert_eq!(pem_blocks(&existing), vec![cert("a"), cert("b")]);
        assert_eq!(
            merged_bundle(&existing, &cert("c")),
            [cert("c"), cert("a"), cert("b")].concat()
        );
        assert_eq!(
            merged_bundle(&existing, &cert("b")),
            [cert("b"), cert("a")].concat()
        );
        assert_eq!(merged_bundle("", &cert("c")), cert("c"));
    }

    #[test]
    fn the_bundle_is_bounded() {
        let many: String = (0..20).map(|i| cert(&i.to_string())).collect();
        let merged = merged_bundle(&many, &cert("new"));
        let blocks = pem_blocks(&merged);
        assert_eq!(blocks.len(), MAX_BUNDLE_CAS);
        assert_eq!(blocks[0], cert("new"));
        assert_eq!(blocks[1], cert("0"));
    }
}
