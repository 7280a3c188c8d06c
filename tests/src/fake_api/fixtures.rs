//! The test-side API of [`FakeApi`]: storing fixtures and reading the store directly,
//! bypassing HTTP.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::routing::{ParsedPath, Query, plural_of, prefix_of};
use super::selectors::Filter;
use super::store::{copy_identity, metadata_mut, set_generation, str_at};
use super::{FakeApi, ObjKey};

/// Aborts a test whose fixture is malformed.
#[allow(
    clippy::panic,
    reason = "a malformed fixture is a bug in the test itself"
)]
fn fixture_bug(message: &str) -> ! {
    panic!("FakeApi: {message}")
}

/// The store at one resourceVersion, read in place ([`FakeApi::read_store`]).
#[derive(Debug)]
pub struct StoreView<'a> {
    objects: &'a BTreeMap<ObjKey, Value>,
    rv: u64,
}

impl StoreView<'_> {
    /// The resourceVersion the view is at.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// The objects of the collection at `collection_path` (as for [`FakeApi::list`], without
    /// selectors), in namespace and name order. An unparsable path yields nothing.
    pub fn objects(&self, collection_path: &str) -> impl Iterator<Item = &Value> {
        let parsed = ParsedPath::parse(collection_path).ok();
        let start = parsed.as_ref().map(|p| ObjKey {
            prefix: p.prefix.clone(),
            resource: p.resource.clone(),
            namespace: p.namespace.clone().unwrap_or_default(),
            name: String::new(),
        });
        let range = match &start {
            Some(start) => self.objects.range(start.clone()..),
            None => self.objects.range(..),
        };
        range
            .take_while(move |(key, _)| {
                parsed.as_ref().is_some_and(|p| {
                    key.prefix == p.prefix
                        && key.resource == p.resource
                        && p.namespace.as_ref().is_none_or(|ns| *ns == key.namespace)
                })
            })
            .map(|(_, value)| value)
    }
}

impl FakeApi {
    /// Stores `obj` (creating or replacing it) as a test fixture, and returns it as stored,
    /// with `resourceVersion`, `uid` (unless given), `creationTimestamp` and `generation` filled
    /// in. Status is kept as given. Watchers see the change.
    ///
    /// The resource name is derived from `kind` (lower case plural); use
    /// [`FakeApi::insert_resource`] for kinds whose plural is irregular.
    ///
    /// # Panics
    ///
    /// When `obj` lacks `apiVersion`, `kind` or `metadata.name`: that is a bug in the test.
    pub fn insert(&self, obj: Value) -> Value {
        let (Some(api_version), Some(kind)) = (
            obj.get("apiVersion").and_then(Value::as_str),
            obj.get("kind").and_then(Value::as_str),
        ) else {
            fixture_bug(&format!("insert: object without apiVersion or kind: {obj}"));
        };
        let prefix = prefix_of(api_version);
        let resource = plural_of(kind);
        self.insert_at(prefix, resource, obj)
    }

    /// Stores a typed object as a test fixture; see [`FakeApi::insert`].
    ///
    /// # Panics
    ///
    /// When the object does not serialize or has no name.
    pub fn insert_resource<K>(&self, obj: &K) -> K
    where
        K: kube::Resource<DynamicType = ()> + serde::Serialize + serde::de::DeserializeOwned,
    {
        let mut value = serde_json::to_value(obj).unwrap_or_else(|e| fixture_bug(&e.to_string()));
        value["apiVersion"] = Value::String(K::api_version(&()).into_owned());
        value["kind"] = Value::String(K::kind(&()).into_owned());
        let stored = self.insert_at(
            prefix_of(&K::api_version(&())),
            K::plural(&()).into_owned(),
            value,
        );
        serde_json::from_value(stored).unwrap_or_else(|e| fixture_bug(&e.to_string()))
    }

    fn insert_at(&self, prefix: String, resource: String, mut obj: Value) -> Value {
        let Some(name) = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            fixture_bug(&format!("insert: object without metadata.name: {obj}"));
        };
        let namespace = str_at(&obj, "/metadata/namespace").to_owned();
        let key = ObjKey {
            prefix,
            resource,
            namespace,
            name,
        };
        let mut state = self.state();
        state.learn_kind(&key, &obj);
        // A fixture's opaque parameters are as serde_json writes them, as kube-rs sends them.
        state.set_raw_params(&key, BTreeMap::new());
        let old = state.objects.get(&key).cloned();
        if let Some(old) = &old {
            copy_identity(old, &mut obj);
            set_generation(old, &mut obj);
        } else {
            // A fixture may name its UID (e.g. to match what a kubelet sends).
            let given_uid = str_at(&obj, "/metadata/uid").to_owned();
            state.init_metadata(&mut obj);
            if !given_uid.is_empty() {
                metadata_mut(&mut obj).insert("uid".to_owned(), json!(given_uid));
            }
        }
        state.commit(&self.inner.events, key, obj, old)
    }

    /// The object at `api_path`, e.g. `/api/v1/nodes/node-a` or
    /// `/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c`.
    pub fn get(&self, api_path: &str) -> Option<Value> {
        let parsed = ParsedPath::parse(api_path).ok()?;
        let key = parsed.object_key()?;
        self.state().objects.get(&key).cloned()
    }

    /// The decoded PEM `caBundle` of each webhook of MutatingWebhookConfiguration `name`, once
    /// every webhook has one; `None` before (a controller that makes its own certificate
    /// writes them at start-up).
    pub fn mutating_webhook_ca_bundles(&self, name: &str) -> Option<Vec<String>> {
        use base64::Engine as _;
        let config = self.get(&format!(
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}"
        ))?;
        config["webhooks"]
            .as_array()?
            .iter()
            .map(|webhook| {
                let encoded = webhook["clientConfig"]["caBundle"].as_str()?;
                let pem = base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .ok()?;
                String::from_utf8(pem).ok()
            })
            .collect()
    }

    /// A typed object, by namespace (`None` for cluster-scoped) and name.
    pub fn get_resource<K>(&self, namespace: Option<&str>, name: &str) -> Option<K>
    where
        K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned,
    {
        let path = format!("{}/{name}", K::url_path(&(), namespace));
        self.get(&path).and_then(|v| serde_json::from_value(v).ok())
    }

    /// The objects in the collection at `collection_path`, in name order. The path may carry
    /// `?fieldSelector=…&labelSelector=…`; a path without a namespace lists all namespaces.
    /// An unparsable path or selector yields nothing.
    pub fn list(&self, collection_path: &str) -> Vec<Value> {
        let (path, query) = collection_path
            .split_once('?')
            .unwrap_or((collection_path, ""));
        let Ok(parsed) = ParsedPath::parse(path) else {
            return Vec::new();
        };
        let Ok(filter) = Filter::new(&parsed, &Query::parse(query)) else {
            return Vec::new();
        };
        self.state()
            .objects
            .iter()
            .filter(|(k, v)| filter.matches(k, v))
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Typed objects of kind `K` in `namespace` (`None`: all namespaces, or cluster-scoped).
    pub fn list_resources<K>(&self, namespace: Option<&str>) -> Vec<K>
    where
        K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned,
    {
        self.list(&K::url_path(&(), namespace))
            .into_iter()
            .filter_map(|v| serde_json::from_value(v).ok())
            .collect()
    }

    /// Deletes the object at `api_path` behind the clients' backs, ignoring finalizers, and
    /// returns it. Watchers see a `DELETED` event.
    pub fn remove(&self, api_path: &str) -> Option<Value> {
        let key = ParsedPath::parse(api_path).ok()?.object_key()?;
        let mut state = self.state();
        let old = state.objects.get(&key).cloned()?;
        Some(state.commit_delete(&self.inner.events, key, old))
    }

    /// Calls `read` with the store as it is at one resourceVersion: what a watch-fed cache
    /// (an informer) holds once it has caught up, without a list's encoding and decoding.
    /// The lock is held during `read`, so keep it short and do not call this `FakeApi` in it.
    pub fn read_store<R>(&self, read: impl FnOnce(&StoreView<'_>) -> R) -> R {
        let state = self.state();
        read(&StoreView {
            objects: &state.objects,
            rv: state.rv,
        })
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state().rv
    }
}

impl FakeApi {
    /// The Warning Events (`events.k8s.io/v1`, every namespace) regarding the `kind` object
    /// `name`, oldest first.
    pub fn warning_events(&self, kind: &str, name: &str) -> Vec<Value> {
        self.list("/apis/events.k8s.io/v1/events")
            .into_iter()
            .filter(|e| {
                e["type"] == "Warning"
                    && e["regarding"]["kind"] == kind
                    && e["regarding"]["name"] == name
            })
            .collect()
    }

    /// Sends `body` byte for byte as the cluster admin, as a client that writes its own JSON
    /// (Python's `json.dumps`, curl) does — `kube::Api` would re-encode it — and answers the
    /// status code and the response's JSON (`null` when it is none).
    pub async fn request_raw(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &[u8],
    ) -> (u16, Value) {
        use http_body_util::BodyExt as _;
        use tower::ServiceExt as _;
        let request = match http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::CONTENT_TYPE, content_type)
            .body(kube::client::Body::from(body.to_vec()))
        {
            Ok(request) => request,
            Err(e) => fixture_bug(&format!("{method} {path}: {e}")),
        };
        let Ok(response) = self.clone().oneshot(request).await;
        let code = response.status().as_u16();
        let bytes = match response.into_body().collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(never) => match never {},
        };
        (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }
}
