//! kube-apiserver's rules for ResourceClaims and ResourceClaimTemplates: the spec is
//! immutable, and the opaque configuration parameters are kept as the bytes the client sent.
//!
//! Upstream (kubernetes/kubernetes):
//! - `pkg/apis/resource/validation/validation.go`, `ValidateResourceClaimUpdate` and
//!   `ValidateResourceClaimTemplateUpdate`: `apimachineryvalidation.ValidateImmutableField(
//!   new.Spec, old.Spec, field.NewPath("spec"))`, i.e. `apiequality.Semantic.DeepEqual`, which
//!   compares the `Raw []byte` of a `runtime.RawExtension` (`spec.devices.config[].opaque.
//!   parameters`) byte for byte;
//! - `pkg/registry/resource/resourceclaim/strategy.go`: `PrepareForUpdate` keeps the old
//!   status on writes to the main resource, the status strategy's `PrepareForUpdate` the old
//!   spec (and so its bytes) on `/status` writes;
//! - `staging/src/k8s.io/apimachinery/pkg/runtime/types.go`, `RawExtension.UnmarshalJSON`
//!   keeps the request's text of the value, `MarshalJSON` returns it, and Go's encoder
//!   compacts it ([`super::raw_json`]);
//! - `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go`: merge and JSON patches
//!   are applied to the *encoded* current object (`runtime.Encode`, then
//!   `gopkg.in/evanphx/json-patch.v4` `MergePatch` / `Patch.Apply`, which keep subtrees they
//!   do not descend into as `json.RawMessage` and re-marshal the maps they do descend into),
//!   strategic merge patches and server-side apply to `map[string]interface{}` (whose
//!   `json.Marshal` sorts keys) — so every patch re-encodes the parameters, and when the
//!   client's text was not already Go's compact encoding, the spec "changed".
//!
//! The fake keeps, per stored object, the text of each parameters value ([`RawParams`]),
//! computes on each write the text the real server would now hold, and refuses the write
//! with the real `Invalid` error when the spec or any of those texts differs.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::meta_rules::{FieldError, invalid};
use super::raw_json::{go_compact, go_encode, raw_at, render_with_texts};
use super::{ApiResult, ObjKey, State};

/// The texts of the opaque parameters of one stored object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct RawParams {
    /// JSON pointer of each `parameters` value → its text as stored.
    pub(super) texts: BTreeMap<String, String>,
    /// The resourceVersion of the object these texts belong to.
    pub(super) resource_version: String,
}

impl RawParams {
    /// `object` (the version these texts belong to) as a real server writes it: each
    /// parameters value as its stored text, compacted ([`go_compact`]).
    pub(super) fn render(&self, object: &Value) -> Vec<u8> {
        let compacted = self
            .texts
            .iter()
            .map(|(pointer, text)| (pointer.clone(), go_compact(text)))
            .collect();
        render_with_texts(object, &compacted)
    }
}

/// How a write to the main resource reached the server, which decides the text each
/// parameters value has afterwards.
pub(super) enum Write<'a> {
    /// CREATE or PUT: the texts of the request body.
    Body(&'a str),
    /// A JSON merge patch (its text and value).
    MergePatch(&'a str, &'a Value),
    /// A JSON patch (its text and operations).
    JsonPatch(&'a str, &'a Value),
    /// A strategic merge patch or server-side apply: everything re-encoded.
    Reencoded,
}

/// The kind of the objects at `key` whose spec this module guards, if they are such.
fn guarded_kind(key: &ObjKey) -> Option<&'static str> {
    if !key.prefix.starts_with("apis/resource.k8s.io/") {
        return None;
    }
    match key.resource.as_str() {
        "resourceclaims" => Some("ResourceClaim"),
        "resourceclaimtemplates" => Some("ResourceClaimTemplate"),
        _ => None,
    }
}

/// The pointer of the `config` list in objects at `key`.
fn config_pointer(key: &ObjKey) -> &'static str {
    if key.resource == "resourceclaimtemplates" {
        "/spec/spec/devices/config"
    } else {
        "/spec/devices/config"
    }
}

/// The pointers of the opaque parameters values `obj` has.
fn param_pointers(key: &ObjKey, obj: &Value) -> Vec<String> {
    let list = config_pointer(key);
    obj.pointer(list)
        .and_then(Value::as_array)
        .map(|configs| {
            configs
                .iter()
                .enumerate()
                .filter(|(_, c)| c.pointer("/opaque/parameters").is_some())
                .map(|(i, _)| format!("{list}/{i}/opaque/parameters"))
                .collect()
        })
        .unwrap_or_default()
}

/// What the text of the parameters at `pointer` is after a merge patch, as evanphx
/// json-patch v4's `mergeDocs` leaves it: untouched unless the patch descends to it;
/// replaced by the patch's own text when the patch holds a list on the way or a
/// non-object; re-encoded when two objects merge.
fn merge_patch_effect(body: &str, patch: &Value, pointer: &str) -> Effect {
    let mut node = patch;
    for segment in pointer.trim_start_matches('/').split('/') {
        match node {
            Value::Object(map) => match map.get(segment) {
                None | Some(Value::Null) => return Effect::Untouched,
                Some(child) => node = child,
            },
            // A list in a merge patch replaces the whole list, as the patch wrote it.
            _ => return Effect::Text(raw_at(body, pointer).map(go_compact)),
        }
    }
    if node.is_object() {
        // Both objects: merged as maps, so re-encoded.
        Effect::Reencoded
    } else {
        Effect::Text(raw_at(body, pointer).map(go_compact))
    }
}

/// What a patch did to the text of one parameters value.
enum Effect {
    /// Not descended into: the stored text, compacted.
    Untouched,
    /// Replaced by the patch's own text (compacted), when found.
    Text(Option<String>),
    /// Decoded and marshalled again ([`go_encode`]).
    Reencoded,
}

/// What happened to the parameters at `pointer` in a JSON patch, in the terms of
/// evanphx json-patch v4 `Patch.Apply`: ancestors of every `path`/`from` are decoded (so an
/// operation inside the parameters re-encodes them), `add`/`replace` at or above them put the
/// patch's own text, `test` at an ancestor compares (and so decodes) the whole subtree.
fn json_patch_effect(body: &str, ops: &Value, pointer: &str) -> Effect {
    let mut effect = Effect::Untouched;
    let inside = |path: &str| {
        path.strip_prefix(pointer)
            .is_some_and(|r| r.starts_with('/'))
    };
    for (i, op) in ops.as_array().into_iter().flatten().enumerate() {
        let kind = op.get("op").and_then(Value::as_str).unwrap_or("");
        let path = op.get("path").and_then(Value::as_str).unwrap_or("");
        let from = op.get("from").and_then(Value::as_str).unwrap_or("");
        if inside(path) || inside(from) {
            effect = Effect::Reencoded;
            continue;
        }
        let rest = if path == pointer {
            Some("")
        } else {
            pointer
                .strip_prefix(path)
                .filter(|r| r.starts_with('/') || path.is_empty())
        };
        effect = match (kind, rest) {
            (_, None) | ("test", Some("")) => continue,
            ("add" | "replace", Some(rest)) => {
                Effect::Text(raw_at(body, &format!("/{i}/value{rest}")).map(go_compact))
            }
            _ => Effect::Reencoded,
        };
    }
    effect
}

impl State {
    /// The texts of the parameters of the stored `obj` at `key`: as written, or (for an
    /// object stored as a fixture) as serde_json, like kube-rs, writes them.
    fn stored_texts(&self, key: &ObjKey, obj: &Value) -> BTreeMap<String, String> {
        if let Some(raw) = self.raw_params.get(key) {
            return raw.texts.clone();
        }
        param_pointers(key, obj)
            .into_iter()
            .filter_map(|p| obj.pointer(&p).map(|v| (p, v.to_string())))
            .collect()
    }

    /// The texts the parameters of `next` have after `write` replaced `current` by it.
    fn texts_after(
        &self,
        key: &ObjKey,
        current: Option<&Value>,
        next: &Value,
        write: &Write<'_>,
    ) -> BTreeMap<String, String> {
        let stored = current
            .map(|c| self.stored_texts(key, c))
            .unwrap_or_default();
        let untouched = |pointer: &str| stored.get(pointer).map(|t| go_compact(t));
        param_pointers(key, next)
            .into_iter()
            .filter_map(|pointer| {
                let value = next.pointer(&pointer)?;
                let effect = match write {
                    Write::Body(body) => Effect::Text(raw_at(body, &pointer).map(str::to_owned)),
                    Write::MergePatch(body, patch) => merge_patch_effect(body, patch, &pointer),
                    Write::JsonPatch(body, ops) => json_patch_effect(body, ops, &pointer),
                    Write::Reencoded => Effect::Reencoded,
                };
                let text = match effect {
                    Effect::Untouched => untouched(&pointer),
                    Effect::Text(text) => text,
                    Effect::Reencoded => None,
                };
                Some((pointer, text.unwrap_or_else(|| go_encode(value))))
            })
            .collect()
    }

    /// Applies the ResourceClaim / ResourceClaimTemplate rules to a write of the main
    /// resource that turns `current` (`None` on create) into `next`, and remembers the
    /// parameters' texts for the commit that follows.
    ///
    /// # Errors
    ///
    /// `422 Invalid` (`spec: Invalid value: …: field is immutable`) when the spec or the text
    /// of any parameters value would change.
    pub(super) fn guard_claim_spec(
        &mut self,
        key: &ObjKey,
        current: Option<&Value>,
        next: &Value,
        write: &Write<'_>,
    ) -> ApiResult<()> {
        let Some(kind) = guarded_kind(key) else {
            return Ok(());
        };
        let texts = self.texts_after(key, current, next, write);
        if let Some(current) = current {
            let unchanged =
                current.get("spec") == next.get("spec") && self.stored_texts(key, current) == texts;
            if !unchanged {
                let spec = next.get("spec").cloned().unwrap_or(Value::Null);
                let shown = render_spec(&texts, &spec);
                return Err(invalid(
                    "resource.k8s.io",
                    kind,
                    &key.name,
                    &[FieldError::invalid("spec", &shown, "field is immutable")],
                ));
            }
        }
        self.set_raw_params(key, texts);
        Ok(())
    }

    /// Remembers `texts` for the object at `key` (none: forgets them).
    pub(super) fn set_raw_params(&mut self, key: &ObjKey, texts: BTreeMap<String, String>) {
        if texts.is_empty() {
            self.raw_params.remove(key);
        } else {
            self.raw_params.insert(
                key.clone(),
                Arc::new(RawParams {
                    texts,
                    resource_version: String::new(),
                }),
            );
        }
    }

    /// Records the resourceVersion the object at `key` was just committed at, and returns
    /// its parameters' texts for the change record.
    pub(super) fn seal_raw_params(
        &mut self,
        key: &ObjKey,
        resource_version: &str,
    ) -> Option<Arc<RawParams>> {
        let raw = self.raw_params.get_mut(key)?;
        resource_version.clone_into(&mut Arc::make_mut(raw).resource_version);
        Some(Arc::clone(raw))
    }

    /// `obj` (an object of the collection at `prefix`/`resource`) as JSON bytes, with its
    /// parameters as the real server writes them when the store holds their texts for this
    /// very version.
    pub(super) fn render_object(&self, prefix: &str, resource: &str, obj: &Value) -> Vec<u8> {
        let key = ObjKey {
            prefix: prefix.to_owned(),
            resource: resource.to_owned(),
            namespace: super::store::str_at(obj, "/metadata/namespace").to_owned(),
            name: super::store::str_at(obj, "/metadata/name").to_owned(),
        };
        let rv = super::store::str_at(obj, "/metadata/resourceVersion");
        match self.raw_params.get(&key) {
            Some(raw) if raw.resource_version == rv => raw.render(obj),
            _ => serde_json::to_vec(obj).unwrap_or_default(),
        }
    }
}

/// The new spec as the error shows it. kube-apiserver prints Go's `%#v` of its internal
/// struct (`resource.ResourceClaimSpec{Devices:resource.DeviceClaim{…}}`), which the fake
/// cannot reproduce; it writes the spec as JSON with the parameters' texts as they would be,
/// which shows what changed.
fn render_spec(texts: &BTreeMap<String, String>, spec: &Value) -> String {
    let wrapper = serde_json::json!({ "spec": spec });
    let bytes = render_with_texts(&wrapper, texts);
    let text = String::from_utf8_lossy(&bytes).into_owned();
    text.strip_prefix("{\"spec\":")
        .and_then(|t| t.strip_suffix('}'))
        .map_or_else(|| spec.to_string(), str::to_owned)
}

/// The ResourceClaim status strategy's `dropDeallocatedStatusDevices`
/// (kubernetes/kubernetes `pkg/registry/resource/resourceclaim/strategy.go`, called from
/// `resourceclaimStatusStrategy.PrepareForUpdate`): on a `/status` write, the
/// `status.devices` entries of devices the old allocation held and the new one does not
/// (driver, pool, device and shareID) are removed, so deallocating a claim takes every
/// driver's entries of its devices with it. `new` is the object about to be stored.
pub(super) fn drop_deallocated_status_devices(key: &ObjKey, old: &Value, new: &mut Value) {
    if guarded_kind(key) != Some("ResourceClaim") {
        return;
    }
    let id = |entry: &Value| {
        let text = |field: &str| {
            entry
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned()
        };
        (
            text("driver"),
            text("pool"),
            text("device"),
            text("shareID"),
        )
    };
    let allocated = |claim: &Value| -> Vec<_> {
        claim
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
            .map(|results| results.iter().map(id).collect())
            .unwrap_or_default()
    };
    let still = allocated(new);
    let gone: Vec<_> = allocated(old)
        .into_iter()
        .filter(|device| !still.contains(device))
        .collect();
    if gone.is_empty() {
        return;
    }
    let Some(status) = new.get_mut("status").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(devices) = status.get_mut("devices").and_then(Value::as_array_mut) {
        devices.retain(|entry| !gone.contains(&id(entry)));
        if devices.is_empty() {
            status.remove("devices");
        }
    }
}
