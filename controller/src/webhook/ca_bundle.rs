//! Keeps this replica's CA in the `caBundle` of the webhook configurations (mutating and
//! validating).
//!
//! Every replica makes its own CA, and the API server may call any replica behind the Service,
//! so the bundle holds several CAs: a replica puts its current CA first and keeps the others'
//! (up to [`MAX_BUNDLE_CAS`]), so replicas and rotations do not evict each other. The write
//! is a JSONPatch that first tests the configuration's resourceVersion: two replicas writing at
//! once cannot lose each other's CA (the loser retries on its next round).

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
/// certificate), patching with `field_manager`. Returns whether it wrote.
///
/// # Errors
///
/// [`Error::Kube`] when the configuration cannot be read or the patch fails (also on a
/// concurrent change: the patch tests the resourceVersion it read); [`Error::MissingField`]
/// when the configuration has no resourceVersion.
pub async fn ensure_ca<K: WebhookConfiguration>(
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
