//! The object store: create, replace, delete (with finalizers and preconditions),
//! resourceVersions, generations, UIDs and the `/status` subresource, and the list
//! documents, as kube clients see them.

use std::sync::Arc;

use kerf_core::rng::SeededRng;
use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::admission;
use super::claims::{RawParams, Write};
use super::meta_rules::{FieldError, invalid};
use super::routing::{ApiRequest, ParsedPath, api_version_of};
use super::selectors::Filter;
use super::{
    ApiError, ApiResult, Broadcast, Change, ChangeKind, ObjKey, State, qualified_resource,
};

pub(super) fn str_at<'a>(obj: &'a Value, pointer: &str) -> &'a str {
    obj.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

pub(super) fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(meta)) => meta,
        // Just made sure it is an object; this arm is unreachable.
        _ => unreachable_metadata(),
    }
}

#[allow(clippy::panic, reason = "metadata was made an object just before")]
fn unreachable_metadata() -> ! {
    panic!("FakeApi: metadata is not an object")
}

/// Keeps the server-owned identity fields of `old` on an updated object.
pub(super) fn copy_identity(old: &Value, new: &mut Value) {
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match old.pointer(&format!("/metadata/{field}")).cloned() {
            Some(v) => {
                metadata_mut(new).insert(field.to_owned(), v);
            }
            None => {
                metadata_mut(new).remove(field);
            }
        }
    }
}

/// Bumps `metadata.generation` when anything but metadata and status changed.
pub(super) fn set_generation(old: &Value, new: &mut Value) {
    let spec_of = |v: &Value| -> Map<String, Value> {
        v.as_object()
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "metadata" | "status"))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let generation = old
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let generation = if spec_of(old) == spec_of(new) {
        generation
    } else {
        generation + 1
    };
    metadata_mut(new).insert("generation".to_owned(), json!(generation));
}

pub(super) fn now_timestamp() -> Value {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    serde_json::to_value(now).unwrap_or(Value::Null)
}

/// A deterministic, UUID-shaped identifier from a counter: the first number of the seeded
/// sequence of `counter`, and the first of that number's.
pub(super) fn uid_from(counter: u64) -> String {
    let a = SeededRng::new(counter).next_u64();
    let b = SeededRng::new(a).next_u64();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0x0fff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// `current` with its status replaced by the status of `next` (a `/status` write).
pub(super) fn with_status_of(current: &Value, next: &Value) -> Value {
    let mut out = current.clone();
    if let Some(map) = out.as_object_mut() {
        match next.get("status") {
            Some(status) => map.insert("status".to_owned(), status.clone()),
            None => map.remove("status"),
        };
    }
    out
}

/// kube-apiserver's `storage.Preconditions.Check` (kubernetes/kubernetes
/// `staging/src/k8s.io/apiserver/pkg/storage/interfaces.go`): a failed precondition is a
/// `StorageError` of code `ErrCodeInvalidObj` (4), which `InterpretDeleteError` /
/// `InterpretUpdateError` turn into a 409 Conflict carrying the storage error's text. The
/// key is the etcd key (`/registry/<resource>/[<namespace>/]<name>`).
pub(super) fn check_preconditions(
    key: &ObjKey,
    current: &Value,
    wanted_uid: &str,
    wanted_rv: &str,
) -> ApiResult<()> {
    let storage_error = |detail: String| {
        let etcd_key = if key.namespace.is_empty() {
            format!("/registry/{}/{}", key.resource, key.name)
        } else {
            format!("/registry/{}/{}/{}", key.resource, key.namespace, key.name)
        };
        ApiError::conflict(
            key,
            &format!(
                "StorageError: invalid object, Code: 4, Key: {etcd_key}, ResourceVersion: 0, AdditionalErrorMsg: {detail}"
            ),
        )
    };
    let uid = str_at(current, "/metadata/uid");
    if !wanted_uid.is_empty() && wanted_uid != uid {
        return Err(storage_error(format!(
            "Precondition failed: UID in precondition: {wanted_uid}, UID in object meta: {uid}"
        )));
    }
    let rv = str_at(current, "/metadata/resourceVersion");
    if !wanted_rv.is_empty() && wanted_rv != rv {
        return Err(storage_error(format!(
            "Precondition failed: ResourceVersion in precondition: {wanted_rv}, ResourceVersion in meta: {rv}"
        )));
    }
    Ok(())
}

/// The `DeleteOptions` a DELETE sent as its body (null when it sent none).
fn delete_options(request: &ApiRequest) -> ApiResult<Value> {
    if request.body.is_empty() {
        Ok(Value::Null)
    } else {
        request.json_body()
    }
}

fn check_delete_preconditions(key: &ObjKey, current: &Value, options: &Value) -> ApiResult<()> {
    check_preconditions(
        key,
        current,
        str_at(options, "/preconditions/uid"),
        str_at(options, "/preconditions/resourceVersion"),
    )
}

/// `names.SimpleNameGenerator` (kubernetes/kubernetes
/// `staging/src/k8s.io/apiserver/pkg/storage/names/generate.go`): the prefix cut to 58
/// bytes, then 5 characters of `utilrand`'s alphabet (no vowels, no confusable digits).
fn generated_name(prefix: &str, counter: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut cut = prefix.len().min(58);
    while !prefix.is_char_boundary(cut) {
        cut -= 1;
    }
    let seed = uid_from(counter);
    let suffix: String = seed
        .bytes()
        .take(5)
        .map(|b| char::from(ALPHABET[usize::from(b) % ALPHABET.len()]))
        .collect();
    format!("{}{suffix}", &prefix[..cut])
}

/// A list response as [`State::list_bytes`] writes it, without its items.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListDocument {
    api_version: String,
    kind: String,
    metadata: ListMeta,
    items: [(); 0],
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    resource_version: String,
}

impl State {
    pub(super) fn learn_kind(&mut self, key: &ObjKey, obj: &Value) {
        if let Some(kind) = obj.get("kind").and_then(Value::as_str) {
            self.kinds
                .insert((key.prefix.clone(), key.resource.clone()), kind.to_owned());
        }
    }

    pub(super) fn kind_of(&self, prefix: &str, resource: &str) -> String {
        self.kinds
            .get(&(prefix.to_owned(), resource.to_owned()))
            .cloned()
            .unwrap_or_else(|| {
                // Never seen: a readable guess is all list and bookmark type fields need.
                let singular = resource.strip_suffix('s').unwrap_or(resource);
                let mut chars = singular.chars();
                chars
                    .next()
                    .map(|c| c.to_ascii_uppercase().to_string() + chars.as_str())
                    .unwrap_or_default()
            })
    }

    pub(super) fn init_metadata(&mut self, obj: &mut Value) {
        self.uids += 1;
        let uid = uid_from(self.uids);
        let meta = metadata_mut(obj);
        meta.insert("uid".to_owned(), json!(uid));
        meta.insert("creationTimestamp".to_owned(), now_timestamp());
        meta.insert("generation".to_owned(), json!(1));
        meta.remove("deletionTimestamp");
    }

    /// Stores `obj` under `key` at a new resourceVersion, records the change and tells the
    /// watchers. An object marked for deletion whose last finalizer is gone is deleted instead.
    pub(super) fn commit(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        mut obj: Value,
        old: Option<Value>,
    ) -> Value {
        // `shouldDeleteDuringUpdate`: not a pod still in its grace period (`pod_deletion`).
        let finalizers_done = obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
            && obj
                .pointer("/metadata/deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .is_none_or(|grace| grace <= 0);
        if obj
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|t| !t.is_null())
            && finalizers_done
        {
            return self.commit_delete(events, key, obj);
        }
        self.drop_disabled_fields(&key, &mut obj);
        admission::taint_nodes_by_condition(&key, old.is_none(), &mut obj);
        self.rv += 1;
        let rv = self.rv.to_string();
        metadata_mut(&mut obj).insert("resourceVersion".to_owned(), json!(rv));
        let kind = if old.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        let raw = self.seal_raw_params(&key, &rv);
        self.objects.insert(key.clone(), obj.clone());
        self.record_change(events, kind, key, old, obj.clone(), raw);
        obj
    }

    pub(super) fn commit_delete(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        mut obj: Value,
    ) -> Value {
        self.rv += 1;
        metadata_mut(&mut obj).insert("resourceVersion".to_owned(), json!(self.rv.to_string()));
        self.objects.remove(&key);
        self.applied.retain(|(k, _, _), _| *k != key);
        let raw = self.raw_params.remove(&key);
        self.record_change(events, ChangeKind::Deleted, key, None, obj.clone(), raw);
        obj
    }

    fn record_change(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        kind: ChangeKind,
        key: ObjKey,
        old: Option<Value>,
        new: Value,
        raw: Option<Arc<RawParams>>,
    ) {
        let change = Arc::new(Change {
            rv: self.rv,
            kind,
            key,
            old,
            new,
            raw,
        });
        self.history.push(Arc::clone(&change));
        // No watcher listening is not an error.
        let _ = events.send(Broadcast::Change(change));
    }

    pub(super) fn existing(&self, key: &ObjKey) -> ApiResult<Value> {
        self.objects
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(key))
    }

    pub(super) fn has_status_subresource(&self, key: &ObjKey) -> bool {
        self.status_subresources.contains(&key.resource)
    }

    pub(super) fn get(&self, request: &ApiRequest) -> ApiResult<Value> {
        self.existing(&request.object_key()?)
    }

    /// The list document of a collection read as JSON bytes, serialized from the stored objects
    /// without copying them first: a list of a busy collection is the most expensive read,
    /// and the lock is held meanwhile.
    pub(super) fn list_bytes(&self, request: &ApiRequest) -> ApiResult<Vec<u8>> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let path = &request.parsed;
        let document = ListDocument {
            api_version: path.api_version(),
            kind: format!("{}List", self.kind_of(&path.prefix, &path.resource)),
            metadata: ListMeta {
                resource_version: self.rv.to_string(),
            },
            items: [],
        };
        let mut out = serde_json::to_vec(&document)
            .map_err(|e| ApiError::new(500, format!("cannot serialize the list: {e}")))?;
        // The items go last: replace the empty list's `[]}` with the rendered objects, each
        // with its opaque parameters as stored ([`State::render_object`]).
        out.truncate(out.len().saturating_sub(3));
        out.push(b'[');
        let selected = self.objects.iter().filter(|(k, v)| filter.matches(k, v));
        for (i, (key, obj)) in selected.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend(self.render_object(&key.prefix, &key.resource, obj));
        }
        out.extend_from_slice(b"]}");
        Ok(out)
    }

    fn list_document(&self, path: &ParsedPath, items: Vec<Value>) -> Value {
        json!({
            "apiVersion": path.api_version(),
            "kind": format!("{}List", self.kind_of(&path.prefix, &path.resource)),
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": Value::Array(items),
        })
    }

    pub(super) fn create(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        if request.parsed.name.is_some() {
            return Err(ApiError::new(405, "create needs a collection path"));
        }
        let mut obj = request.object_body()?;
        // kube-apiserver's create handler retries a generated name that is taken
        // (RetryGenerateName, on since 1.31): up to 7 more names before AlreadyExists.
        let generated = str_at(&obj, "/metadata/name").is_empty();
        // A create run again after its webhooks answered keeps the name they saw.
        let remembered = request.rounds().created().map(|(k, _, _)| k.name.clone());
        let mut tries = 0;
        let key = loop {
            let name = match &remembered {
                Some(name) if generated && tries == 0 => name.clone(),
                _ => self.name_for_create(&obj)?,
            };
            let key = Self::key_in_collection(&request.parsed, &mut obj, name)?;
            if !self.objects.contains_key(&key) {
                break key;
            }
            tries += 1;
            if !generated || tries > 7 {
                let mut err = ApiError::new(
                    409,
                    format!("{} {:?} already exists", qualified_resource(&key), key.name),
                );
                err.reason = "AlreadyExists".into();
                return Err(err);
            }
            metadata_mut(&mut obj).remove("name");
        };
        let text = std::str::from_utf8(&request.body).unwrap_or("");
        let obj = self.prepared_for_create(request, &key, obj);
        self.admit(request, &key, None, &obj, &Write::Body(text))?;
        Ok(self.commit(events, key, obj, None))
    }

    pub(super) fn fill_type_meta(&self, key: &ObjKey, obj: &mut Value) {
        if obj.get("apiVersion").is_none() {
            obj["apiVersion"] = json!(api_version_of(&key.prefix));
        }
        if obj.get("kind").is_none() {
            obj["kind"] = json!(self.kind_of(&key.prefix, &key.resource));
        }
    }

    pub(super) fn name_for_create(&mut self, obj: &Value) -> ApiResult<String> {
        let name = str_at(obj, "/metadata/name");
        if !name.is_empty() {
            return Ok(name.to_owned());
        }
        let generate = str_at(obj, "/metadata/generateName");
        if generate.is_empty() {
            // The group is not known here; the body's apiVersion names it.
            let api_version = str_at(obj, "/apiVersion");
            let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
            return Err(invalid(
                group,
                str_at(obj, "/kind"),
                "",
                &[FieldError::required(
                    "metadata.name",
                    "name or generateName is required",
                )],
            ));
        }
        self.uids += 1;
        Ok(generated_name(generate, self.uids))
    }

    /// The key of `obj` in the collection at `path`, after checking and filling in its
    /// name and namespace.
    pub(super) fn key_in_collection(
        path: &ParsedPath,
        obj: &mut Value,
        name: String,
    ) -> ApiResult<ObjKey> {
        let body_ns = str_at(obj, "/metadata/namespace").to_owned();
        let namespace = match &path.namespace {
            Some(ns) if !body_ns.is_empty() && body_ns != *ns => {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the provided object ({body_ns}) does not match the namespace sent on the request ({ns})"
                )));
            }
            Some(ns) => ns.clone(),
            None => String::new(),
        };
        let meta = metadata_mut(obj);
        meta.insert("name".to_owned(), json!(name));
        if !namespace.is_empty() {
            meta.insert("namespace".to_owned(), json!(namespace));
        }
        Ok(ObjKey {
            prefix: path.prefix.clone(),
            resource: path.resource.clone(),
            namespace,
            name,
        })
    }

    pub(super) fn check_resource_version(
        key: &ObjKey,
        current: &Value,
        body: &Value,
    ) -> ApiResult<()> {
        let wanted = str_at(body, "/metadata/resourceVersion");
        if wanted.is_empty() || wanted == str_at(current, "/metadata/resourceVersion") {
            Ok(())
        } else {
            Err(ApiError::conflict(
                key,
                "the object has been modified; please apply your changes to the latest version and try again",
            ))
        }
    }

    pub(super) fn replace(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        let key = request.object_key()?;
        let mut body = request.object_body()?;
        let current = self.existing(&key)?;
        let body_name = str_at(&body, "/metadata/name");
        if !body_name.is_empty() && body_name != key.name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({body_name}) does not match the name on the URL ({})",
                key.name
            )));
        }
        // A PUT's UID is a precondition (`rest.DefaultUpdatedObjectInfo.Preconditions`).
        check_preconditions(&key, &current, str_at(&body, "/metadata/uid"), "")?;
        Self::check_resource_version(&key, &current, &body)?;
        let next = if request.parsed.status {
            let mut next = with_status_of(&current, &body);
            super::claims::drop_deallocated_status_devices(&key, &current, &mut next);
            next
        } else {
            Self::key_in_collection(&request.parsed, &mut body, key.name.clone())?;
            self.next_main_object(&key, &current, body)
        };
        request.authorize_write(&key, Some(&current), &next)?;
        let text = std::str::from_utf8(&request.body).unwrap_or("");
        self.admit(request, &key, Some(&current), &next, &Write::Body(text))?;
        Ok(self.commit(events, key, next, Some(current)))
    }

    /// An update of the main resource: identity fields stay, status stays when it has its own
    /// subresource, and the generation follows the spec.
    pub(super) fn next_main_object(&self, key: &ObjKey, current: &Value, mut next: Value) -> Value {
        self.fill_type_meta(key, &mut next);
        copy_identity(current, &mut next);
        if self.has_status_subresource(key)
            && let Some(map) = next.as_object_mut()
        {
            match current.get("status") {
                Some(status) => map.insert("status".to_owned(), status.clone()),
                None => map.remove("status"),
            };
        }
        set_generation(current, &mut next);
        next
    }

    pub(super) fn delete(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        let key = request.object_key()?;
        let current = self.existing(&key)?;
        let options = delete_options(request)?;
        check_delete_preconditions(&key, &current, &options)?;
        self.admit_delete(request, &key, &current)?;
        Ok(self.delete_with_options(events, key, current, &options))
    }

    pub(super) fn delete_object(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        current: Value,
    ) -> Value {
        let has_finalizers = current
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        if !has_finalizers {
            return self.commit_delete(events, key, current);
        }
        if current
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|t| !t.is_null())
        {
            return current;
        }
        let mut marked = current.clone();
        metadata_mut(&mut marked).insert("deletionTimestamp".to_owned(), now_timestamp());
        self.commit(events, key, marked, Some(current))
    }

    pub(super) fn delete_collection(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let options = delete_options(request)?;
        let doomed: Vec<(ObjKey, Value)> = self
            .objects
            .iter()
            .filter(|(k, v)| filter.matches(k, v))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // Validating admission runs per object (`DeleteCollection` calls `deleteValidation`
        // for each); the objects it allows are deleted and the first denial is the answer.
        let mut deleted = Vec::new();
        let mut denied = None;
        for (key, obj) in doomed {
            match self.admit_delete(request, &key, &obj) {
                Ok(()) => deleted.push(self.delete_with_options(events, key, obj, &options)),
                // This object's webhooks are called before the collection goes on (`webhooks`);
                // the objects deleted so far stay deleted.
                Err(err) if err.awaits_webhooks() => return Err(err),
                Err(err) => {
                    denied.get_or_insert(err);
                }
            }
        }
        match denied {
            Some(err) => Err(err),
            None => Ok(self.list_document(&request.parsed, deleted)),
        }
    }
}
