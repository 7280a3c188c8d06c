//! PATCH: JSON merge patches (strategic ones treated alike), JSON patches and server-side
//! apply as "create or merge, forcing" (see the simplifications in the [module docs](super)).

use serde_json::Value;
use tokio::sync::broadcast;

use super::claims::Write;
use super::meta_rules::{FieldError, group_of, invalid};
use super::routing::ApiRequest;
use super::store::{metadata_mut, str_at, with_status_of};
use super::{ApiError, ApiResult, Broadcast, ObjKey, State};

/// Removes from `live` the fields a field manager applied before (`previous`) but no longer
/// applies (`next`), recursing into maps; lists are atomic and replaced by the merge.
pub(super) fn remove_dropped_fields(live: &mut Value, previous: &Value, next: &Value) {
    let (Some(live), Some(previous)) = (live.as_object_mut(), previous.as_object()) else {
        return;
    };
    for (field, prev_value) in previous {
        match next.get(field) {
            None => {
                live.remove(field);
            }
            Some(next_value) if prev_value.is_object() && next_value.is_object() => {
                if let Some(live_value) = live.get_mut(field) {
                    remove_dropped_fields(live_value, prev_value, next_value);
                }
            }
            Some(_) => {}
        }
    }
}

/// The applied configuration without the fields that are preconditions, not content.
fn applied_config(body: &Value) -> Value {
    let mut config = body.clone();
    if let Some(meta) = config.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("resourceVersion");
    }
    config
}

impl State {
    /// A patch may not change the UID: `rest.BeforeUpdate` keeps only an empty one, and
    /// `ValidateObjectMetaUpdate` refuses a different one as immutable.
    fn check_patched_uid(&self, key: &ObjKey, current: &Value, patched: &Value) -> ApiResult<()> {
        let uid = str_at(patched, "/metadata/uid");
        if uid.is_empty() || uid == str_at(current, "/metadata/uid") {
            return Ok(());
        }
        Err(invalid(
            &group_of(key),
            &self.kind_of(&key.prefix, &key.resource),
            &key.name,
            &[FieldError::invalid(
                "metadata.uid",
                &format!("{uid:?}"),
                "field is immutable",
            )],
        ))
    }

    pub(super) fn patch(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<(u16, Value)> {
        let key = request.object_key()?;
        let content_type = request.content_type.as_deref().unwrap_or("");
        let media = content_type.split(';').next().unwrap_or("").trim();
        if media == "application/apply-patch+yaml" {
            return self.apply(events, request, key);
        }
        let current = self.existing(&key)?;
        let mut patched = current.clone();
        let text = std::str::from_utf8(&request.body).unwrap_or("");
        let patch = request.json_body()?;
        match media {
            "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                Self::check_resource_version(&key, &current, &patch)?;
                json_patch::merge(&mut patched, &patch);
            }
            "application/json-patch+json" => {
                let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                    .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
                // kube-apiserver's words (`applyJSPatch` in apiserver's handlers/patch.go:
                // `NewGenericServerResponse(422, …)`, whose message is this generic sentence;
                // the op that failed is only in the Status causes, which this fake omits).
                json_patch::patch(&mut patched, &ops.0).map_err(|_| {
                    ApiError::new(
                        422,
                        "the server rejected our request due to an error in our request",
                    )
                })?;
                Self::check_resource_version(&key, &current, &patched)?;
            }
            other => {
                return Err(ApiError::new(
                    415,
                    format!("the media type {other:?} is not supported"),
                ));
            }
        }
        let write = match media {
            "application/merge-patch+json" => Write::MergePatch(text, &patch),
            "application/json-patch+json" => Write::JsonPatch(text, &patch),
            _ => Write::Reencoded,
        };
        if !request.parsed.status {
            self.check_patched_uid(&key, &current, &patched)?;
        }
        let next = self.patched_object(request, &key, &current, patched);
        request.authorize_write(&key, Some(&current), &next)?;
        self.admit(request, &key, Some(&current), &next, &write)?;
        Ok((200, self.commit(events, key, next, Some(current))))
    }

    fn patched_object(
        &self,
        request: &ApiRequest,
        key: &ObjKey,
        current: &Value,
        mut patched: Value,
    ) -> Value {
        if request.parsed.status {
            let mut next = with_status_of(current, &patched);
            super::claims::drop_deallocated_status_devices(key, current, &mut next);
            return next;
        }
        for field in ["name", "namespace"] {
            match current.pointer(&format!("/metadata/{field}")).cloned() {
                Some(v) => metadata_mut(&mut patched).insert(field.to_owned(), v),
                None => metadata_mut(&mut patched).remove(field),
            };
        }
        self.next_main_object(key, current, patched)
    }

    /// Server-side apply as "create or merge, forcing", removing what the same manager
    /// applied before but no longer does.
    pub(super) fn apply(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
        key: ObjKey,
    ) -> ApiResult<(u16, Value)> {
        let Some(manager) = request
            .query
            .get("fieldManager")
            .filter(|m| !m.is_empty())
            .map(str::to_owned)
        else {
            return Err(ApiError::bad_request(
                "PATCH requests of type apply need a fieldManager",
            ));
        };
        let mut body = request.object_body()?;
        if body.get("apiVersion").is_none() || body.get("kind").is_none() {
            return Err(ApiError::bad_request(
                "apply configurations need apiVersion and kind",
            ));
        }
        let body_name = str_at(&body, "/metadata/name");
        // A real server checks the name of the merged object, so a configuration without a
        // name updates the object named in the URL (kube-lease-manager applies such), but
        // cannot create one.
        let unnamed_update = body_name.is_empty() && self.objects.contains_key(&key);
        if body_name != key.name && !unnamed_update {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({})",
                key.name
            )));
        }
        let config = applied_config(&body);
        let applied_key = (key.clone(), request.parsed.status, manager);
        let Some(current) = self.objects.get(&key).cloned() else {
            if request.parsed.status {
                return Err(ApiError::not_found(&key));
            }
            if !str_at(&body, "/metadata/resourceVersion").is_empty() {
                return Err(ApiError::conflict(&key, "the object does not exist"));
            }
            let key = Self::key_in_collection(&request.parsed, &mut body, key.name.clone())?;
            request.authorize_write(&key, None, &body)?;
            let body = self.prepared_for_create(request, &key, body);
            self.admit(request, &key, None, &body, &Write::Reencoded)?;
            let created = self.commit(events, key, body, None);
            self.applied.insert(applied_key, config);
            return Ok((201, created));
        };
        Self::check_resource_version(&key, &current, &body)?;
        let mut patched = current.clone();
        if let Some(previous) = self.applied.get(&applied_key) {
            remove_dropped_fields(&mut patched, previous, &config);
        }
        json_patch::merge(&mut patched, &config);
        let next = self.patched_object(request, &key, &current, patched);
        request.authorize_write(&key, Some(&current), &next)?;
        // Validation runs before the storage layer notices a no-op, so a no-op apply is
        // refused like any other write that fails it.
        self.admit(request, &key, Some(&current), &next, &Write::Reencoded)?;
        self.applied.insert(applied_key, config);
        if next == current {
            // A no-op apply does not write, so the resourceVersion stays, as on a real server.
            return Ok((200, current));
        }
        Ok((200, self.commit(events, key, next, Some(current))))
    }
}
