//! An in-memory Kubernetes API server for tests, served as a [`tower::Service`].
//!
//! [`FakeApi`] speaks enough of the API server's REST protocol for everything kube's `Api<K>`
//! and kube-runtime's watcher send: GET, LIST (field and label selectors), CREATE, REPLACE
//! (with resourceVersion preconditions), PATCH (server-side apply, merge patch, JSON patch),
//! DELETE (with finalizers), DELETECOLLECTION and WATCH (including streaming lists and
//! bookmarks). Errors are real `Status` objects, so client code sees exactly the
//! `kube::Error::Api` values a real server produces.
//!
//! Every request is logged ([`FakeApi::requests`]) so tests can assert how many calls code
//! made, and faults can be scripted ([`FakeApi::fail_next`], [`FakeApi::delay_next`]) to
//! exercise error handling.
//!
//! Deliberate simplifications, none of which kube clients observe in practice:
//! - any resource name is accepted (no discovery, no schema validation, no defaulting);
//! - server-side apply is "create or merge, forcing": fields are merged like a JSON merge
//!   patch, and fields the same field manager applied before but omits now are removed (lists
//!   are atomic); there is no conflict detection between managers and no `managedFields`;
//! - strategic merge patches are treated as JSON merge patches;
//! - field selectors accept any dotted field path; list pagination returns everything at once;
//! - `dryRun=All` is simulated for CREATE only (the answer is what would be stored, nothing
//!   is); on other verbs it is rejected with 400.
//!
//! [`FakeApi::drop_field`] makes the fake behave like an API server whose feature gate for a
//! field is off: kube-apiserver's registry strategies call `dropDisabledFields` (e.g.
//! kubernetes/kubernetes `pkg/registry/resource/resourceslice/strategy.go`,
//! `dropDisabledFields`, which clears `devices[].taints` unless `DRADeviceTaints` is on) on
//! every create and update, so the write succeeds and the field is silently gone.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use http::{Method, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

/// Response body of the fake: a whole JSON document or a stream of watch events.
pub type FakeBody = UnsyncBoxBody<Bytes, Infallible>;

/// How many watch events a slow watcher may fall behind before it gets `410 Expired`.
const WATCH_BUFFER: usize = 4096;

/// An in-memory Kubernetes API server. Clones share the same state.
#[derive(Clone)]
pub struct FakeApi {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    events: broadcast::Sender<Broadcast>,
    /// The outage in progress, if any ([`FakeApi::set_outage`]).
    outage: tokio::sync::watch::Sender<Option<Outage>>,
}

/// How the fake is unreachable during an injected outage ([`FakeApi::set_outage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// Requests hang until the outage ends and are then served, as with a frozen API server
    /// (an etcd that stopped answering, a process stopped with SIGSTOP): the TCP connection
    /// stays open and nothing comes back.
    Frozen,
    /// Requests fail at once with `503 ServiceUnavailable`, as when a load balancer in front
    /// of the API server has no healthy backend (client-go and kube-rs treat it like a
    /// refused connection: retried with back-off).
    Unavailable,
}

impl std::fmt::Debug for FakeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state();
        f.debug_struct("FakeApi")
            .field("objects", &state.objects.len())
            .field("resource_version", &state.rv)
            .field("requests", &state.requests.len())
            .finish_non_exhaustive()
    }
}

/// One request the fake received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// HTTP method, e.g. `GET`.
    pub method: String,
    /// Kubernetes verb: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection` (empty when the path is not a resource path).
    pub verb: &'static str,
    /// URL path, e.g. `/apis/resource.k8s.io/v1/resourceslices`.
    pub path: String,
    /// Raw query string without the `?` (empty when there is none).
    pub query: String,
    /// The `Content-Type` header, when sent.
    pub content_type: Option<String>,
}

impl RecordedRequest {
    /// Whether `method` names this request's HTTP method or Kubernetes verb
    /// (case-insensitive) and its path starts with `path_prefix`.
    pub fn matches(&self, method: &str, path_prefix: &str) -> bool {
        (self.method.eq_ignore_ascii_case(method) || self.verb.eq_ignore_ascii_case(method))
            && self.path.starts_with(path_prefix)
    }
}

/// A scripted failure: the next `times` matching requests get `code`.
#[derive(Debug, Clone)]
struct Fault {
    method: String,
    path_prefix: String,
    code: u16,
    remaining: usize,
}

/// A scripted delay: the next `remaining` matching requests are answered `delay` late.
#[derive(Debug, Clone)]
struct Delay {
    method: String,
    path_prefix: String,
    duration: Duration,
    remaining: usize,
}

/// Identity of a stored object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct ObjKey {
    /// `api/v1` or `apis/<group>/<version>`.
    prefix: String,
    /// Plural resource name, e.g. `resourceslices`.
    resource: String,
    /// Empty for cluster-scoped objects.
    namespace: String,
    name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One committed write, kept for watches that resume from an older resourceVersion.
#[derive(Debug)]
struct Change {
    rv: u64,
    kind: ChangeKind,
    key: ObjKey,
    old: Option<Value>,
    new: Value,
}

#[derive(Debug, Clone)]
enum Broadcast {
    Change(Arc<Change>),
    CloseWatches,
}

struct State {
    objects: BTreeMap<ObjKey, Value>,
    rv: u64,
    uids: u64,
    history: Vec<Arc<Change>>,
    /// Watches from a resourceVersion below this get `410 Expired`.
    compacted_below: u64,
    /// Last configuration applied per object, subresource and field manager.
    applied: HashMap<(ObjKey, bool, String), Value>,
    /// Kinds seen per collection (`prefix`, `resource`), for list and bookmark type fields.
    kinds: HashMap<(String, String), String>,
    status_subresources: HashSet<String>,
    requests: Vec<RecordedRequest>,
    faults: Vec<Fault>,
    delays: Vec<Delay>,
    /// Fields removed from every write, per resource (plural).
    dropped_fields: Vec<(String, String)>,
}

/// An API error, rendered as a `Status` object.
#[derive(Debug)]
struct ApiError {
    code: u16,
    reason: &'static str,
    message: String,
}

type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason_for(code),
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    fn not_found(key: &ObjKey) -> Self {
        Self::new(
            404,
            format!("{} {:?} not found", qualified_resource(key), key.name),
        )
    }

    fn conflict(key: &ObjKey, why: &str) -> Self {
        Self::new(
            409,
            format!(
                "Operation cannot be fulfilled on {} {:?}: {why}",
                qualified_resource(key),
                key.name
            ),
        )
    }

    fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

/// The `reason` a real API server puts in a `Status` with this code.
fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

/// `resourceslices.resource.k8s.io` or `pods`, as the API server names resources in messages.
fn qualified_resource(key: &ObjKey) -> String {
    match key
        .prefix
        .strip_prefix("apis/")
        .and_then(|gv| gv.split('/').next())
    {
        Some(group) => format!("{}.{group}", key.resource),
        None => key.resource.clone(),
    }
}

impl Default for FakeApi {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeApi {
    /// An empty API server. Pods, nodes, namespaces, services, persistent volume claims,
    /// workloads, ResourceClaims and kerf's GpuClasses have a `/status` subresource, as on a
    /// real cluster: writes to the main resource leave their status alone.
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(WATCH_BUFFER);
        let status_subresources = [
            "pods",
            "nodes",
            "namespaces",
            "services",
            "persistentvolumeclaims",
            "persistentvolumes",
            "deployments",
            "replicasets",
            "statefulsets",
            "daemonsets",
            "jobs",
            "resourceclaims",
            "gpuclasses",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        let state = State {
            objects: BTreeMap::new(),
            rv: 0,
            uids: 0,
            history: Vec::new(),
            compacted_below: 0,
            applied: HashMap::new(),
            kinds: HashMap::new(),
            status_subresources,
            requests: Vec::new(),
            faults: Vec::new(),
            delays: Vec::new(),
            dropped_fields: Vec::new(),
        };
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                events,
                outage: tokio::sync::watch::Sender::new(None),
            }),
        }
    }

    /// A kube client whose requests this fake serves; its default namespace is `default`.
    ///
    /// Must be called inside a Tokio runtime: the client spawns its request buffer there.
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.clone(), "default")
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held can only come from a bug in this file; the state
        // is still consistent enough for a test to report what it sees.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Declares whether `resource` (plural, e.g. `widgets`) has a `/status` subresource.
    pub fn set_status_subresource(&self, resource: &str, enabled: bool) {
        let mut state = self.state();
        if enabled {
            state.status_subresources.insert(resource.to_owned());
        } else {
            state.status_subresources.remove(resource);
        }
    }

    /// Drops `path` from every object of `resource` (plural, e.g. `resourceslices`) written
    /// from now on, as an API server with that field's feature gate off does. `path` is
    /// dotted, and a segment ending in `[]` means every element of that list, e.g.
    /// `spec.devices[].taints`.
    pub fn drop_field(&self, resource: &str, path: &str) {
        self.state()
            .dropped_fields
            .push((resource.to_owned(), path.to_owned()));
    }

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

    /// Every request received so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state().requests.clone()
    }

    /// How many requests matched `method` (HTTP method or Kubernetes verb) and `path_prefix`.
    pub fn count(&self, method: &str, path_prefix: &str) -> usize {
        self.state()
            .requests
            .iter()
            .filter(|r| r.matches(method, path_prefix))
            .count()
    }

    /// Forgets the request log.
    pub fn clear_requests(&self) {
        self.state().requests.clear();
    }

    /// Makes the next `times` requests that match `method` (HTTP method such as `PATCH`, or a
    /// Kubernetes verb such as `list`/`watch`) and `path_prefix` fail with `status_code` and a
    /// `Status` body. Faults are checked in the order they were added.
    pub fn fail_next(&self, method: &str, path_prefix: &str, status_code: u16, times: usize) {
        self.state().faults.push(Fault {
            method: method.to_owned(),
            path_prefix: path_prefix.to_owned(),
            code: status_code,
            remaining: times,
        });
    }

    /// Holds the next `times` requests that match `method` and `path_prefix` (as in
    /// [`FakeApi::fail_next`]) for `delay` before answering them. A held request is already
    /// in [`FakeApi::requests`], so a test can see it arrive and act while it is in flight.
    pub fn delay_next(&self, method: &str, path_prefix: &str, delay: Duration, times: usize) {
        self.state().delays.push(Delay {
            method: method.to_owned(),
            path_prefix: path_prefix.to_owned(),
            duration: delay,
            remaining: times,
        });
    }

    /// Ends every open watch, as an API server restart would; kube-runtime watchers resume.
    pub fn close_watches(&self) {
        // No receivers is fine: there is nothing to close.
        let _ = self.inner.events.send(Broadcast::CloseWatches);
    }

    /// Starts (`Some`) or ends (`None`) an outage of the whole server. Starting one ends every
    /// open watch, as the lost connections of a frozen or unreachable server do; the watchers'
    /// new requests then hang or fail like all others until the outage ends. Requests are
    /// still logged in [`FakeApi::requests`] when they arrive.
    pub fn set_outage(&self, outage: Option<Outage>) {
        self.inner.outage.send_replace(outage);
        if outage.is_some() {
            self.close_watches();
        }
    }

    /// Holds a request while the server is [`Outage::Frozen`]; answers it with the error of an
    /// [`Outage::Unavailable`] one.
    async fn outage_response(&self) -> Option<Response<FakeBody>> {
        let mut outage = self.inner.outage.subscribe();
        // The sender lives in `self`, so the wait cannot fail.
        let now = outage
            .wait_for(|o| *o != Some(Outage::Frozen))
            .await
            .map_or(None, |o| *o);
        (now == Some(Outage::Unavailable)).then(|| {
            error_response(&ApiError::new(
                503,
                "the server is currently unable to handle the request",
            ))
        })
    }

    /// Forgets the change history, so watches resuming from an older resourceVersion get
    /// `410 Expired` and must list again, as after etcd compaction.
    pub fn compact(&self) {
        let mut state = self.state();
        state.history.clear();
        state.compacted_below = state.rv + 1;
    }

    async fn handle(self, request: Request<kube::client::Body>) -> Response<FakeBody> {
        let (parts, body) = request.into_parts();
        let path = parts.uri.path().to_owned();
        let raw_query = parts.uri.query().unwrap_or("").to_owned();
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let parsed = ParsedPath::parse(&path);
        let query = Query::parse(&raw_query);
        let verb = parsed
            .as_ref()
            .map_or("", |p| verb_of(&parts.method, p, &query));
        let record = RecordedRequest {
            method: parts.method.to_string(),
            verb,
            path,
            query: raw_query,
            content_type: content_type.clone(),
        };
        let delay = self.take_delay(&record);
        let fault = self.record_and_check_faults(record);
        if let Some(unavailable) = self.outage_response().await {
            return unavailable;
        }
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        if let Some(fault) = fault {
            return error_response(&ApiError::new(fault, "injected fault"));
        }
        let parsed = match parsed {
            Ok(parsed) => parsed,
            Err(err) => return error_response(&err),
        };
        let body = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => {
                return error_response(&ApiError::bad_request(format!("reading body: {err}")));
            }
        };
        let request = ApiRequest {
            parsed,
            query,
            content_type,
            body,
        };
        if verb == "watch" {
            return match self.watch(&request) {
                Ok(body) => streaming_response(body),
                Err(err) => error_response(&err),
            };
        }
        if verb == "list" {
            // Lists are the largest responses: written straight from the store.
            return match self.state().list_bytes(&request) {
                Ok(bytes) => bytes_response(200, bytes),
                Err(err) => error_response(&err),
            };
        }
        match self.dispatch(verb, &request) {
            Ok((code, value)) => json_response(code, &value),
            Err(err) => error_response(&err),
        }
    }

    fn take_delay(&self, record: &RecordedRequest) -> Option<Duration> {
        let mut state = self.state();
        let delay = state
            .delays
            .iter_mut()
            .find(|d| d.remaining > 0 && record.matches(&d.method, &d.path_prefix))
            .map(|d| {
                d.remaining -= 1;
                d.duration
            });
        state.delays.retain(|d| d.remaining > 0);
        delay
    }

    fn record_and_check_faults(&self, record: RecordedRequest) -> Option<u16> {
        let mut state = self.state();
        let fault = state
            .faults
            .iter_mut()
            .find(|f| f.remaining > 0 && record.matches(&f.method, &f.path_prefix));
        let code = fault.map(|f| {
            f.remaining -= 1;
            f.code
        });
        state.faults.retain(|f| f.remaining > 0);
        state.requests.push(record);
        code
    }

    fn dispatch(&self, verb: &str, request: &ApiRequest) -> ApiResult<(u16, Value)> {
        let events = &self.inner.events;
        let mut state = self.state();
        if let Some(dry_run) = request.query.get("dryRun") {
            return match (verb, dry_run) {
                ("create", "All") => state.dry_run_create(request).map(|v| (201, v)),
                _ => Err(ApiError::bad_request(format!(
                    "dryRun={dry_run} on {verb} is not supported by FakeApi"
                ))),
            };
        }
        match verb {
            "get" => state.get(request).map(|v| (200, v)),
            "create" => state.create(events, request).map(|v| (201, v)),
            "update" => state.replace(events, request).map(|v| (200, v)),
            "patch" => state.patch(events, request),
            "delete" => state.delete(events, request).map(|v| (200, v)),
            "deletecollection" => state.delete_collection(events, request).map(|v| (200, v)),
            _ => Err(ApiError::new(405, "method not allowed")),
        }
    }

    fn watch(&self, request: &ApiRequest) -> ApiResult<FakeBody> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let state = self.state();
        // Subscribing and reading the backlog under one lock means no change is lost or sent
        // twice: every later commit happens after this and goes to the receiver.
        let receiver = self.inner.events.subscribe();
        let kind = state.kind_of(&request.parsed.prefix, &request.parsed.resource);
        let backlog = state.watch_backlog(&filter, &request.query, &kind)?;
        drop(state);
        let timeout = request
            .query
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok());
        let deadline = timeout.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
        let watch = WatchStream {
            pending: backlog,
            receiver,
            filter,
            deadline,
            done: false,
        };
        Ok(watch_body(watch))
    }
}

/// Aborts a test whose fixture is malformed.
#[allow(
    clippy::panic,
    reason = "a malformed fixture is a bug in the test itself"
)]
fn fixture_bug(message: &str) -> ! {
    panic!("FakeApi: {message}")
}

impl tower::Service<Request<kube::client::Body>> for FakeApi {
    type Response = Response<FakeBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let api = self.clone();
        Box::pin(async move { Ok(api.handle(request).await) })
    }
}

struct ApiRequest {
    parsed: ParsedPath,
    query: Query,
    content_type: Option<String>,
    body: Bytes,
}

impl ApiRequest {
    fn json_body(&self) -> ApiResult<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("request body is not JSON: {e}")))
    }

    fn object_body(&self) -> ApiResult<Value> {
        let value = self.json_body()?;
        if value.is_object() {
            Ok(value)
        } else {
            Err(ApiError::bad_request("request body is not a JSON object"))
        }
    }

    fn object_key(&self) -> ApiResult<ObjKey> {
        self.parsed
            .object_key()
            .ok_or_else(|| ApiError::new(405, "this verb needs an object path"))
    }
}

fn verb_of(method: &Method, path: &ParsedPath, query: &Query) -> &'static str {
    let has_name = path.name.is_some();
    match *method {
        Method::GET if has_name => "get",
        Method::GET if query.flag("watch") => "watch",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if has_name => "delete",
        Method::DELETE => "deletecollection",
        _ => "",
    }
}

/// A parsed resource URL path.
#[derive(Debug, Clone)]
struct ParsedPath {
    prefix: String,
    namespace: Option<String>,
    resource: String,
    name: Option<String>,
    status: bool,
}

impl ParsedPath {
    fn parse(path: &str) -> ApiResult<Self> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (prefix, rest) = match segments.as_slice() {
            ["api", version, rest @ ..] => (format!("api/{version}"), rest),
            ["apis", group, version, rest @ ..] => (format!("apis/{group}/{version}"), rest),
            _ => {
                return Err(ApiError::new(
                    404,
                    format!("the server could not find {path}"),
                ));
            }
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, resource, more @ ..]
                if !is_namespace_subresource(resource, more) =>
            {
                (
                    Some((*ns).to_owned()),
                    std::iter::once(*resource)
                        .chain(more.iter().copied())
                        .collect::<Vec<_>>(),
                )
            }
            _ => (None, rest.to_vec()),
        };
        let (resource, name, sub) = match rest.as_slice() {
            [resource] => (*resource, None, None),
            [resource, name] => (*resource, Some(*name), None),
            [resource, name, sub] => (*resource, Some(*name), Some(*sub)),
            _ => {
                return Err(ApiError::new(
                    404,
                    format!("the server could not find {path}"),
                ));
            }
        };
        let status = match sub {
            None => false,
            Some("status") => true,
            Some(other) => {
                return Err(ApiError::new(
                    404,
                    format!("subresource {other} is not supported"),
                ));
            }
        };
        if resource.is_empty() || name.is_some_and(str::is_empty) {
            return Err(ApiError::new(
                404,
                format!("the server could not find {path}"),
            ));
        }
        Ok(Self {
            prefix,
            namespace,
            resource: resource.to_owned(),
            name: name.map(str::to_owned),
            status,
        })
    }

    fn object_key(&self) -> Option<ObjKey> {
        Some(ObjKey {
            prefix: self.prefix.clone(),
            resource: self.resource.clone(),
            namespace: self.namespace.clone().unwrap_or_default(),
            name: self.name.clone()?,
        })
    }

    fn api_version(&self) -> String {
        api_version_of(&self.prefix)
    }
}

/// `/api/v1/namespaces/<ns>/status` is the namespace's status, not a resource named `status`.
fn is_namespace_subresource(segment: &str, more: &[&str]) -> bool {
    more.is_empty() && matches!(segment, "status" | "finalize")
}

fn prefix_of(api_version: &str) -> String {
    if api_version.contains('/') {
        format!("apis/{api_version}")
    } else {
        format!("api/{api_version}")
    }
}

fn api_version_of(prefix: &str) -> String {
    prefix
        .strip_prefix("apis/")
        .or_else(|| prefix.strip_prefix("api/"))
        .unwrap_or(prefix)
        .to_owned()
}

/// The lower-case plural the API server uses for a kind, for the regular English cases.
fn plural_of(kind: &str) -> String {
    let lower = kind.to_ascii_lowercase();
    if lower == "endpoints" {
        return lower;
    }
    if lower.ends_with('s')
        || lower.ends_with("sh")
        || lower.ends_with("ch")
        || lower.ends_with('x')
    {
        return format!("{lower}es");
    }
    if let Some(stem) = lower.strip_suffix('y')
        && !stem.ends_with(['a', 'e', 'i', 'o', 'u'])
    {
        return format!("{stem}ies");
    }
    format!("{lower}s")
}

/// Decoded query parameters (last value wins).
#[derive(Debug, Clone, Default)]
struct Query(HashMap<String, String>);

impl Query {
    fn parse(raw: &str) -> Self {
        Self(
            raw.split('&')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                    (percent_decode(k), percent_decode(v))
                })
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| {
        char::from(b)
            .to_digit(16)
            .and_then(|d| u8::try_from(d).ok())
    };
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(hi, lo)| hi * 16 + lo),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One field-selector term.
#[derive(Debug, Clone)]
struct FieldTerm {
    path: String,
    value: String,
    negate: bool,
}

/// One label-selector requirement.
#[derive(Debug, Clone)]
enum LabelTerm {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Which objects a LIST or WATCH selects.
#[derive(Debug, Clone)]
struct Filter {
    prefix: String,
    resource: String,
    namespace: Option<String>,
    fields: Vec<FieldTerm>,
    labels: Vec<LabelTerm>,
}

impl Filter {
    fn new(path: &ParsedPath, query: &Query) -> ApiResult<Self> {
        Ok(Self {
            prefix: path.prefix.clone(),
            resource: path.resource.clone(),
            namespace: path.namespace.clone(),
            fields: parse_field_selector(query.get("fieldSelector").unwrap_or(""))?,
            labels: parse_label_selector(query.get("labelSelector").unwrap_or(""))?,
        })
    }

    fn in_collection(&self, key: &ObjKey) -> bool {
        key.prefix == self.prefix
            && key.resource == self.resource
            && self
                .namespace
                .as_ref()
                .is_none_or(|ns| *ns == key.namespace)
    }

    fn matches(&self, key: &ObjKey, obj: &Value) -> bool {
        self.in_collection(key) && self.selects(obj)
    }

    fn selects(&self, obj: &Value) -> bool {
        self.fields
            .iter()
            .all(|t| (field_value(obj, &t.path) == t.value) != t.negate)
            && self.labels.iter().all(|t| label_term_matches(t, obj))
    }

    /// The watch event line a change produces for this watch, if any. An object that starts
    /// or stops matching the selectors is reported as added or deleted, as the API server does.
    fn render(&self, change: &Change) -> Option<Bytes> {
        if !self.in_collection(&change.key) {
            return None;
        }
        let now = self.selects(&change.new);
        let before = change.old.as_ref().is_some_and(|old| self.selects(old));
        let event = match (change.kind, before, now) {
            (ChangeKind::Modified, true, true) => "MODIFIED",
            (ChangeKind::Added | ChangeKind::Modified, _, true) => "ADDED",
            (ChangeKind::Modified, true, false) | (ChangeKind::Deleted, _, true) => "DELETED",
            _ => return None,
        };
        Some(event_line(event, &change.new))
    }
}

fn parse_field_selector(raw: &str) -> ApiResult<Vec<FieldTerm>> {
    raw.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|term| {
            let (path, value, negate) = if let Some((p, v)) = term.split_once("!=") {
                (p, v, true)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, v, false)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, v, false)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid field selector term {term:?}"
                )));
            };
            Ok(FieldTerm {
                path: path.trim().to_owned(),
                value: value.trim().to_owned(),
                negate,
            })
        })
        .collect()
}

/// Splits a label selector at the commas that are not inside a `(…)` value set.
fn split_selector_terms(raw: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in raw.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&raw[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&raw[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn parse_label_selector(raw: &str) -> ApiResult<Vec<LabelTerm>> {
    split_selector_terms(raw)
        .into_iter()
        .map(parse_label_term)
        .collect()
}

fn parse_label_term(term: &str) -> ApiResult<LabelTerm> {
    let set = |rest: &str| -> ApiResult<Vec<String>> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| {
                ApiError::bad_request(format!("invalid label selector term {term:?}"))
            })?;
        Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
    };
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelTerm::NotExists(key.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(LabelTerm::NotEquals(
            k.trim().to_owned(),
            v.trim().to_owned(),
        ));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelTerm::Equals(k.trim().to_owned(), v.trim().to_owned()));
    }
    if let Some((k, rest)) = term.split_once(" notin ") {
        return Ok(LabelTerm::NotIn(k.trim().to_owned(), set(rest)?));
    }
    if let Some((k, rest)) = term.split_once(" in ") {
        return Ok(LabelTerm::In(k.trim().to_owned(), set(rest)?));
    }
    if term
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    {
        return Ok(LabelTerm::Exists(term.to_owned()));
    }
    Err(ApiError::bad_request(format!(
        "invalid label selector term {term:?}"
    )))
}

fn label_term_matches(term: &LabelTerm, obj: &Value) -> bool {
    let labels = obj.pointer("/metadata/labels").and_then(Value::as_object);
    let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    match term {
        LabelTerm::Equals(k, v) => label(k) == Some(v.as_str()),
        LabelTerm::NotEquals(k, v) => label(k) != Some(v.as_str()),
        LabelTerm::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
        LabelTerm::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        LabelTerm::Exists(k) => label(k).is_some(),
        LabelTerm::NotExists(k) => label(k).is_none(),
    }
}

/// The value of a dotted field path as a field selector compares it (missing: empty).
fn field_value(obj: &Value, path: &str) -> String {
    let mut current = obj;
    for part in path.split('.') {
        match current.get(part) {
            Some(next) => current = next,
            None => return String::new(),
        }
    }
    match current {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn str_at<'a>(obj: &'a Value, pointer: &str) -> &'a str {
    obj.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
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
fn copy_identity(old: &Value, new: &mut Value) {
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
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
fn set_generation(old: &Value, new: &mut Value) {
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

/// Removes the field at `segments` (see [`FakeApi::drop_field`]) from `value`.
fn drop_path(value: &mut Value, segments: &[&str]) {
    let Some((first, rest)) = segments.split_first() else {
        return;
    };
    let (name, each) = match first.strip_suffix("[]") {
        Some(name) => (name, true),
        None => (*first, false),
    };
    let Some(map) = value.as_object_mut() else {
        return;
    };
    if rest.is_empty() && !each {
        map.remove(name);
        return;
    }
    let Some(child) = map.get_mut(name) else {
        return;
    };
    if each {
        for element in child.as_array_mut().into_iter().flatten() {
            drop_path(element, rest);
        }
    } else {
        drop_path(child, rest);
    }
}

fn now_timestamp() -> Value {
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    serde_json::to_value(now).unwrap_or(Value::Null)
}

/// A deterministic, UUID-shaped identifier from a counter (SplitMix64).
fn uid_from(counter: u64) -> String {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let a = mix(counter);
    let b = mix(a);
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0x0fff,
        ((b >> 48) & 0x3fff) | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// Removes from `live` the fields a field manager applied before (`previous`) but no longer
/// applies (`next`), recursing into maps; lists are atomic and replaced by the merge.
fn remove_dropped_fields(live: &mut Value, previous: &Value, next: &Value) {
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
    fn learn_kind(&mut self, key: &ObjKey, obj: &Value) {
        if let Some(kind) = obj.get("kind").and_then(Value::as_str) {
            self.kinds
                .insert((key.prefix.clone(), key.resource.clone()), kind.to_owned());
        }
    }

    fn kind_of(&self, prefix: &str, resource: &str) -> String {
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

    fn init_metadata(&mut self, obj: &mut Value) {
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
    fn commit(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        mut obj: Value,
        old: Option<Value>,
    ) -> Value {
        let finalizers_done = obj
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if obj
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|t| !t.is_null())
            && finalizers_done
        {
            return self.commit_delete(events, key, obj);
        }
        self.drop_disabled_fields(&key, &mut obj);
        self.rv += 1;
        metadata_mut(&mut obj).insert("resourceVersion".to_owned(), json!(self.rv.to_string()));
        let kind = if old.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        self.objects.insert(key.clone(), obj.clone());
        self.record_change(events, kind, key, old, obj.clone());
        obj
    }

    fn commit_delete(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        mut obj: Value,
    ) -> Value {
        self.rv += 1;
        metadata_mut(&mut obj).insert("resourceVersion".to_owned(), json!(self.rv.to_string()));
        self.objects.remove(&key);
        self.applied.retain(|(k, _, _), _| *k != key);
        self.record_change(events, ChangeKind::Deleted, key, None, obj.clone());
        obj
    }

    fn record_change(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        kind: ChangeKind,
        key: ObjKey,
        old: Option<Value>,
        new: Value,
    ) {
        let change = Arc::new(Change {
            rv: self.rv,
            kind,
            key,
            old,
            new,
        });
        self.history.push(Arc::clone(&change));
        // No watcher listening is not an error.
        let _ = events.send(Broadcast::Change(change));
    }

    fn existing(&self, key: &ObjKey) -> ApiResult<Value> {
        self.objects
            .get(key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(key))
    }

    fn has_status_subresource(&self, key: &ObjKey) -> bool {
        self.status_subresources.contains(&key.resource)
    }

    fn get(&self, request: &ApiRequest) -> ApiResult<Value> {
        self.existing(&request.object_key()?)
    }

    /// The list document of a collection read as JSON bytes, serialized from the stored objects
    /// without copying them first: a list of a busy collection is the most expensive read,
    /// and the lock is held meanwhile.
    fn list_bytes(&self, request: &ApiRequest) -> ApiResult<Vec<u8>> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let path = &request.parsed;
        let document = ListDocument {
            api_version: path.api_version(),
            kind: format!("{}List", self.kind_of(&path.prefix, &path.resource)),
            metadata: ListMeta {
                resource_version: self.rv.to_string(),
            },
            items: ListedItems {
                objects: &self.objects,
                filter: &filter,
            },
        };
        serde_json::to_vec(&document)
            .map_err(|e| ApiError::new(500, format!("cannot serialize the list: {e}")))
    }

    fn list_document(&self, path: &ParsedPath, items: Vec<Value>) -> Value {
        json!({
            "apiVersion": path.api_version(),
            "kind": format!("{}List", self.kind_of(&path.prefix, &path.resource)),
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": Value::Array(items),
        })
    }

    fn create(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        if request.parsed.name.is_some() {
            return Err(ApiError::new(405, "create needs a collection path"));
        }
        let mut obj = request.object_body()?;
        let name = self.name_for_create(&obj)?;
        let key = Self::key_in_collection(&request.parsed, &mut obj, name)?;
        if self.objects.contains_key(&key) {
            let mut err = ApiError::new(
                409,
                format!("{} {:?} already exists", qualified_resource(&key), key.name),
            );
            err.reason = "AlreadyExists";
            return Err(err);
        }
        Ok(self.create_object(events, key, obj))
    }

    /// What [`State::create`] would store, without storing it.
    fn dry_run_create(&mut self, request: &ApiRequest) -> ApiResult<Value> {
        if request.parsed.name.is_some() {
            return Err(ApiError::new(405, "create needs a collection path"));
        }
        let mut obj = request.object_body()?;
        let name = self.name_for_create(&obj)?;
        let key = Self::key_in_collection(&request.parsed, &mut obj, name)?;
        self.fill_type_meta(&key, &mut obj);
        self.init_metadata(&mut obj);
        self.drop_disabled_fields(&key, &mut obj);
        Ok(obj)
    }

    fn drop_disabled_fields(&self, key: &ObjKey, obj: &mut Value) {
        for (_, path) in self
            .dropped_fields
            .iter()
            .filter(|(r, _)| *r == key.resource)
        {
            let segments: Vec<&str> = path.split('.').collect();
            drop_path(obj, &segments);
        }
    }

    fn create_object(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        key: ObjKey,
        mut obj: Value,
    ) -> Value {
        self.fill_type_meta(&key, &mut obj);
        self.learn_kind(&key, &obj);
        if self.has_status_subresource(&key)
            && let Some(map) = obj.as_object_mut()
        {
            map.remove("status");
        }
        self.init_metadata(&mut obj);
        self.commit(events, key, obj, None)
    }

    fn fill_type_meta(&self, key: &ObjKey, obj: &mut Value) {
        if obj.get("apiVersion").is_none() {
            obj["apiVersion"] = json!(api_version_of(&key.prefix));
        }
        if obj.get("kind").is_none() {
            obj["kind"] = json!(self.kind_of(&key.prefix, &key.resource));
        }
    }

    fn name_for_create(&mut self, obj: &Value) -> ApiResult<String> {
        let name = str_at(obj, "/metadata/name");
        if !name.is_empty() {
            return Ok(name.to_owned());
        }
        let generate = str_at(obj, "/metadata/generateName");
        if generate.is_empty() {
            return Err(ApiError::new(
                422,
                "metadata.name: Required value: name or generateName is required",
            ));
        }
        self.uids += 1;
        let suffix: String = uid_from(self.uids)
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(5)
            .collect();
        Ok(format!("{generate}{suffix}"))
    }

    /// The key of `obj` in the collection at `path`, after checking and filling in its
    /// name and namespace.
    fn key_in_collection(path: &ParsedPath, obj: &mut Value, name: String) -> ApiResult<ObjKey> {
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

    fn check_resource_version(key: &ObjKey, current: &Value, body: &Value) -> ApiResult<()> {
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

    fn replace(
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
        Self::check_resource_version(&key, &current, &body)?;
        let next = if request.parsed.status {
            with_status_of(&current, &body)
        } else {
            Self::key_in_collection(&request.parsed, &mut body, key.name.clone())?;
            self.next_main_object(&key, &current, body)
        };
        Ok(self.commit(events, key, next, Some(current)))
    }

    /// An update of the main resource: identity fields stay, status stays when it has its own
    /// subresource, and the generation follows the spec.
    fn next_main_object(&self, key: &ObjKey, current: &Value, mut next: Value) -> Value {
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

    fn patch(
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
        match media {
            "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                let patch = request.json_body()?;
                Self::check_resource_version(&key, &current, &patch)?;
                json_patch::merge(&mut patched, &patch);
            }
            "application/json-patch+json" => {
                let patch: json_patch::Patch = serde_json::from_slice(&request.body)
                    .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
                json_patch::patch(&mut patched, &patch.0).map_err(|e| {
                    ApiError::new(422, format!("the JSON patch does not apply: {e}"))
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
        let next = self.patched_object(request, &key, &current, patched);
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
            return with_status_of(current, &patched);
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
    fn apply(
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
            let created = self.create_object(events, key, body);
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
        self.applied.insert(applied_key, config);
        if next == current {
            // A no-op apply does not write, so the resourceVersion stays, as on a real server.
            return Ok((200, current));
        }
        Ok((200, self.commit(events, key, next, Some(current))))
    }

    fn delete(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        let key = request.object_key()?;
        let current = self.existing(&key)?;
        if !request.body.is_empty() {
            let options = request.json_body()?;
            check_delete_preconditions(&key, &current, &options)?;
        }
        Ok(self.delete_object(events, key, current))
    }

    fn delete_object(
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

    fn delete_collection(
        &mut self,
        events: &broadcast::Sender<Broadcast>,
        request: &ApiRequest,
    ) -> ApiResult<Value> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let doomed: Vec<(ObjKey, Value)> = self
            .objects
            .iter()
            .filter(|(k, v)| filter.matches(k, v))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let deleted = doomed
            .into_iter()
            .map(|(key, obj)| self.delete_object(events, key, obj))
            .collect();
        Ok(self.list_document(&request.parsed, deleted))
    }

    /// The events a new watch starts with: the current objects for a watch without a
    /// resourceVersion (or `0`) or with `sendInitialEvents`, else the recorded changes after
    /// the given resourceVersion.
    fn watch_backlog(
        &self,
        filter: &Filter,
        query: &Query,
        kind: &str,
    ) -> ApiResult<VecDeque<Bytes>> {
        let rv = query.get("resourceVersion").unwrap_or("");
        let initial = query.flag("sendInitialEvents");
        let mut backlog = VecDeque::new();
        if initial || rv.is_empty() || rv == "0" {
            for (key, obj) in &self.objects {
                if filter.matches(key, obj) {
                    backlog.push_back(event_line("ADDED", obj));
                }
            }
            if initial && query.flag("allowWatchBookmarks") {
                backlog.push_back(self.initial_events_end(filter, kind));
            }
            return Ok(backlog);
        }
        let since: u64 = rv
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
        if since + 1 < self.compacted_below {
            backlog.push_back(expired_line(since));
            return Ok(backlog);
        }
        for change in self.history.iter().filter(|c| c.rv > since) {
            if let Some(line) = filter.render(change) {
                backlog.push_back(line);
            }
        }
        Ok(backlog)
    }

    fn initial_events_end(&self, filter: &Filter, kind: &str) -> Bytes {
        let bookmark = json!({
            "apiVersion": api_version_of(&filter.prefix),
            "kind": kind,
            "metadata": {
                "resourceVersion": self.rv.to_string(),
                "annotations": { "k8s.io/initial-events-end": "true" },
            },
        });
        event_line("BOOKMARK", &bookmark)
    }
}

/// `current` with its status replaced by the status of `next` (a `/status` write).
fn with_status_of(current: &Value, next: &Value) -> Value {
    let mut out = current.clone();
    if let Some(map) = out.as_object_mut() {
        match next.get("status") {
            Some(status) => map.insert("status".to_owned(), status.clone()),
            None => map.remove("status"),
        };
    }
    out
}

fn check_delete_preconditions(key: &ObjKey, current: &Value, options: &Value) -> ApiResult<()> {
    let wanted_uid = str_at(options, "/preconditions/uid");
    if !wanted_uid.is_empty() && wanted_uid != str_at(current, "/metadata/uid") {
        return Err(ApiError::conflict(
            key,
            "Precondition failed: UID in precondition does not match the object",
        ));
    }
    let wanted_rv = str_at(options, "/preconditions/resourceVersion");
    if !wanted_rv.is_empty() && wanted_rv != str_at(current, "/metadata/resourceVersion") {
        return Err(ApiError::conflict(
            key,
            "Precondition failed: ResourceVersion in precondition does not match the object",
        ));
    }
    Ok(())
}

fn event_line(event: &str, object: &Value) -> Bytes {
    let mut line = json!({ "type": event, "object": object }).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn expired_line(since: u64) -> Bytes {
    let err = ApiError::new(410, format!("too old resource version: {since}"));
    event_line("ERROR", &err.to_status())
}

/// An open watch: the backlog first, then live changes until the deadline, a
/// [`FakeApi::close_watches`], or the fake being dropped.
struct WatchStream {
    pending: VecDeque<Bytes>,
    receiver: broadcast::Receiver<Broadcast>,
    filter: Filter,
    deadline: Option<tokio::time::Instant>,
    done: bool,
}

impl WatchStream {
    async fn next_line(&mut self) -> Option<Bytes> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return Some(line);
            }
            if self.done {
                return None;
            }
            let received = match self.deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, self.receiver.recv())
                    .await
                    .ok()?,
                None => self.receiver.recv().await,
            };
            match received {
                Ok(Broadcast::Change(change)) => {
                    if let Some(line) = self.filter.render(&change) {
                        self.pending.push_back(line);
                    }
                }
                Ok(Broadcast::CloseWatches) | Err(broadcast::error::RecvError::Closed) => {
                    return None;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Fell too far behind: make the client list again, as the API server does.
                    self.pending.push_back(expired_line(0));
                    self.done = true;
                }
            }
        }
    }
}

fn watch_body(watch: WatchStream) -> FakeBody {
    let stream = futures::stream::unfold(watch, |mut watch| async move {
        let line = watch.next_line().await?;
        Some((Ok::<_, Infallible>(Frame::data(line)), watch))
    });
    StreamBody::new(stream.boxed()).boxed_unsync()
}

fn json_response(code: u16, value: &Value) -> Response<FakeBody> {
    bytes_response(code, value.to_string().into_bytes())
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

/// A list response as [`State::list_bytes`] writes it.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListDocument<'a> {
    api_version: String,
    kind: String,
    metadata: ListMeta,
    items: ListedItems<'a>,
}

#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct ListMeta {
    resource_version: String,
}

/// The stored objects a filter selects, serialized in key order as they are iterated.
struct ListedItems<'a> {
    objects: &'a BTreeMap<ObjKey, Value>,
    filter: &'a Filter,
}

impl serde::Serialize for ListedItems<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(
            self.objects
                .iter()
                .filter(|(k, v)| self.filter.matches(k, v))
                .map(|(_, v)| v),
        )
    }
}

fn bytes_response(code: u16, bytes: Vec<u8>) -> Response<FakeBody> {
    let mut response = Response::new(Full::new(Bytes::from(bytes)).boxed_unsync());
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(err: &ApiError) -> Response<FakeBody> {
    json_response(err.code, &err.to_status())
}

fn streaming_response(body: FakeBody) -> Response<FakeBody> {
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

/// Renders the request log as text, one request a line, for assertion messages.
pub fn describe_requests(requests: &[RecordedRequest]) -> String {
    let mut out = String::new();
    for r in requests {
        let _ = writeln!(
            out,
            "{} {}{}{}",
            r.method,
            r.path,
            if r.query.is_empty() { "" } else { "?" },
            r.query
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plurals_follow_the_api_server() {
        assert_eq!(plural_of("ResourceSlice"), "resourceslices");
        assert_eq!(plural_of("DeviceClass"), "deviceclasses");
        assert_eq!(plural_of("GpuClass"), "gpuclasses");
        assert_eq!(plural_of("NetworkPolicy"), "networkpolicies");
        assert_eq!(plural_of("Gateway"), "gateways");
        assert_eq!(plural_of("Endpoints"), "endpoints");
        assert_eq!(plural_of("Node"), "nodes");
    }

    #[test]
    fn paths_parse() {
        let p = ParsedPath::parse("/api/v1/namespaces/ns/pods/p/status").unwrap();
        assert_eq!(
            (
                p.prefix.as_str(),
                p.namespace.as_deref(),
                p.resource.as_str(),
                p.name.as_deref(),
                p.status
            ),
            ("api/v1", Some("ns"), "pods", Some("p"), true)
        );
        let p = ParsedPath::parse("/api/v1/namespaces/ns").unwrap();
        assert_eq!(
            (
                p.namespace.as_deref(),
                p.resource.as_str(),
                p.name.as_deref()
            ),
            (None, "namespaces", Some("ns"))
        );
        let p = ParsedPath::parse("/apis/resource.k8s.io/v1/resourceslices").unwrap();
        assert_eq!(
            (p.prefix.as_str(), p.resource.as_str(), p.name),
            ("apis/resource.k8s.io/v1", "resourceslices", None)
        );
        assert!(ParsedPath::parse("/version").is_err());
    }

    #[test]
    fn queries_decode() {
        let q = Query::parse(
            "&fieldSelector=spec.nodeName%3Dn1%2Cspec.driver%3Dgpu.kerf.dev&watch=true",
        );
        assert_eq!(
            q.get("fieldSelector"),
            Some("spec.nodeName=n1,spec.driver=gpu.kerf.dev")
        );
        assert!(q.flag("watch"));
    }

    #[test]
    fn label_selectors_match() {
        let obj = json!({"metadata": {"labels": {"app": "web", "tier": "front"}}});
        let sel = |s: &str| {
            parse_label_selector(s)
                .unwrap()
                .iter()
                .all(|t| label_term_matches(t, &obj))
        };
        assert!(sel("app=web"));
        assert!(sel("app==web,tier!=back"));
        assert!(sel("app in (web, db),!missing"));
        assert!(!sel("app notin (web)"));
        assert!(sel("tier"));
        assert!(!sel("app=db"));
    }

    #[test]
    fn uids_are_uuid_shaped_and_distinct() {
        let a = uid_from(1);
        let b = uid_from(2);
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(a.chars().nth(14), Some('4'));
    }

    use k8s_openapi::api::core::v1::{ConfigMap, Pod};
    use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
    use kube::runtime::watcher;

    fn config_map(name: &str, data: &[(&str, &str)]) -> ConfigMap {
        ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_owned()),
                ..Default::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn api_error(err: kube::Error) -> (u16, String) {
        match err {
            kube::Error::Api(status) => (status.code, status.reason),
            other => panic!("expected an API error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn create_get_replace_delete() {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "ns");
        let created = api
            .create(&PostParams::default(), &config_map("a", &[("k", "v")]))
            .await
            .unwrap();
        assert_eq!(created.metadata.namespace.as_deref(), Some("ns"));
        assert!(created.metadata.uid.is_some());
        assert!(created.metadata.creation_timestamp.is_some());
        let err = api
            .create(&PostParams::default(), &config_map("a", &[]))
            .await
            .unwrap_err();
        assert_eq!(api_error(err), (409, "AlreadyExists".to_owned()));

        let mut changed = created.clone();
        changed.data = Some([("k".to_owned(), "w".to_owned())].into());
        let replaced = api
            .replace("a", &PostParams::default(), &changed)
            .await
            .unwrap();
        assert_ne!(
            replaced.metadata.resource_version,
            created.metadata.resource_version
        );
        assert_eq!(replaced.metadata.uid, created.metadata.uid);
        let err = api
            .replace("a", &PostParams::default(), &changed)
            .await
            .unwrap_err();
        assert_eq!(api_error(err), (409, "Conflict".to_owned()));

        assert_eq!(api.get("a").await.unwrap().data.unwrap()["k"], "w");
        assert!(fake.get("/api/v1/namespaces/ns/configmaps/a").is_some());
        api.delete("a", &DeleteParams::default()).await.unwrap();
        assert_eq!(api_error(api.get("a").await.unwrap_err()).0, 404);
        assert_eq!(
            api_error(api.delete("a", &DeleteParams::default()).await.unwrap_err()).0,
            404
        );
        assert_eq!(fake.count("get", "/api/v1/namespaces/ns/configmaps/a"), 2);
        assert_eq!(fake.count("DELETE", "/api/v1/namespaces/ns/configmaps"), 2);
    }

    #[tokio::test]
    async fn dry_run_creates_store_nothing_and_dropped_fields_vanish_like_a_gate_that_is_off() {
        use k8s_openapi::api::resource::v1::ResourceSlice;
        let fake = FakeApi::new();
        let api: Api<ResourceSlice> = Api::all(fake.client());
        let probe = kerf_api::features::device_taints_probe("gpu.kerf.dev", "n1");
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let answer = api.create(&dry, &probe).await.unwrap();
        assert!(answer.metadata.name.is_some());
        assert_eq!(
            kerf_api::features::kept_device_taints(&answer),
            kerf_api::features::Probed::Served
        );
        assert!(
            fake.list("/apis/resource.k8s.io/v1/resourceslices")
                .is_empty()
        );

        fake.drop_field("resourceslices", "spec.devices[].taints");
        let answer = api.create(&dry, &probe).await.unwrap();
        assert_eq!(
            kerf_api::features::kept_device_taints(&answer),
            kerf_api::features::Probed::Dropped
        );
        let stored = api.create(&PostParams::default(), &probe).await.unwrap();
        let devices = stored.spec.devices.unwrap();
        assert_eq!(devices[0].name, "probe");
        assert!(devices[0].taints.is_none());
    }

    #[tokio::test]
    async fn selectors_filter_lists() {
        let fake = FakeApi::new();
        for (name, node, driver) in [("a", "n1", "d1"), ("b", "n1", "d2"), ("c", "n2", "d1")] {
            fake.insert(json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": name, "labels": {"node": node}},
                "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
            }));
        }
        let api: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(fake.client());
        let names = |list: kube::api::ObjectList<k8s_openapi::api::resource::v1::ResourceSlice>| {
            list.items
                .into_iter()
                .map(|s| s.metadata.name.unwrap())
                .collect::<Vec<_>>()
        };
        let selected = api
            .list(&ListParams::default().fields("spec.nodeName=n1,spec.driver=d1"))
            .await
            .unwrap();
        assert_eq!(names(selected), ["a"]);
        let selected = api
            .list(&ListParams::default().fields("spec.driver!=d1"))
            .await
            .unwrap();
        assert_eq!(names(selected), ["b"]);
        let selected = api
            .list(&ListParams::default().labels("node=n2"))
            .await
            .unwrap();
        assert_eq!(names(selected), ["c"]);
        assert_eq!(
            fake.list("/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn1")
                .len(),
            2
        );
        let deleted = api
            .delete_collection(
                &DeleteParams::default(),
                &ListParams::default().fields("spec.nodeName=n1"),
            )
            .await
            .unwrap();
        assert!(deleted.is_left());
        assert_eq!(
            fake.list("/apis/resource.k8s.io/v1/resourceslices").len(),
            1
        );
    }

    #[tokio::test]
    async fn apply_creates_merges_and_drops_what_the_manager_no_longer_sets() {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
        let params = PatchParams::apply("test").force();
        let first = api
            .patch(
                "a",
                &params,
                &Patch::Apply(config_map("a", &[("x", "1"), ("y", "2")])),
            )
            .await
            .unwrap();
        let other = PatchParams::apply("other").force();
        api.patch("a", &other, &Patch::Apply(config_map("a", &[("z", "3")])))
            .await
            .unwrap();
        let second = api
            .patch("a", &params, &Patch::Apply(config_map("a", &[("x", "9")])))
            .await
            .unwrap();
        let data = second.data.unwrap();
        assert_eq!(data.get("x").map(String::as_str), Some("9"));
        assert_eq!(data.get("y"), None, "dropped by its manager");
        assert_eq!(
            data.get("z").map(String::as_str),
            Some("3"),
            "owned by another manager"
        );
        assert_eq!(second.metadata.uid, first.metadata.uid);
        let unchanged = api
            .patch("a", &params, &Patch::Apply(config_map("a", &[("x", "9")])))
            .await
            .unwrap();
        assert_eq!(
            unchanged.metadata.resource_version,
            second.metadata.resource_version
        );

        let merged = api
            .patch(
                "a",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"x": null}})),
            )
            .await
            .unwrap();
        assert_eq!(merged.data.unwrap().get("x"), None);
        let ops: json_patch::Patch =
            serde_json::from_value(json!([{"op": "add", "path": "/data/j", "value": "p"}]))
                .unwrap();
        let patched = api
            .patch("a", &PatchParams::default(), &Patch::Json::<()>(ops))
            .await
            .unwrap();
        assert_eq!(
            patched.data.unwrap().get("j").map(String::as_str),
            Some("p")
        );
        let err = api
            .patch("missing", &PatchParams::default(), &Patch::Merge(json!({})))
            .await
            .unwrap_err();
        assert_eq!(api_error(err).0, 404);
    }

    #[tokio::test]
    async fn status_is_a_subresource_for_pods() {
        let fake = FakeApi::new();
        let api: Api<Pod> = Api::namespaced(fake.client(), "default");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"phase": "Running"},
        }))
        .unwrap();
        let created = api.create(&PostParams::default(), &pod).await.unwrap();
        assert!(created.status.is_none(), "status is not set on create");
        let with_status = api
            .patch_status(
                "p",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Running"}, "spec": {"nodeName": "x"}})),
            )
            .await
            .unwrap();
        assert_eq!(
            with_status.status.unwrap().phase.as_deref(),
            Some("Running")
        );
        assert_eq!(
            with_status.spec.unwrap().node_name,
            None,
            "a status write changes only status"
        );
        let replaced = api
            .patch(
                "p",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Failed"}, "spec": {"nodeName": "n"}})),
            )
            .await
            .unwrap();
        assert_eq!(
            replaced.status.unwrap().phase.as_deref(),
            Some("Running"),
            "a main write keeps status"
        );
        assert_eq!(replaced.metadata.generation, Some(2));
    }

    #[tokio::test]
    async fn finalizers_delay_deletion() {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
        let mut cm = config_map("f", &[]);
        cm.metadata.finalizers = Some(vec!["example.com/keep".to_owned()]);
        api.create(&PostParams::default(), &cm).await.unwrap();
        api.delete("f", &DeleteParams::default()).await.unwrap();
        let marked = api.get("f").await.unwrap();
        assert!(marked.metadata.deletion_timestamp.is_some());
        api.patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
        assert_eq!(api_error(api.get("f").await.unwrap_err()).0, 404);
    }

    #[tokio::test]
    async fn scripted_faults_fail_the_next_matching_requests() {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
        api.create(&PostParams::default(), &config_map("a", &[]))
            .await
            .unwrap();
        fake.fail_next("get", "/api/v1/namespaces/default/configmaps/a", 503, 2);
        assert_eq!(
            api_error(api.get("a").await.unwrap_err()),
            (503, "ServiceUnavailable".to_owned())
        );
        assert_eq!(api_error(api.get("a").await.unwrap_err()).0, 503);
        assert!(api.get("a").await.is_ok());
        assert_eq!(
            fake.count("get", "/api/v1/namespaces/default/configmaps/a"),
            3
        );
    }

    /// The next event, skipping the errors the watcher reports before it recovers.
    async fn next_event(
        stream: &mut (
                 impl futures::Stream<Item = Result<watcher::Event<ConfigMap>, watcher::Error>> + Unpin
             ),
    ) -> watcher::Event<ConfigMap> {
        loop {
            let next = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .unwrap();
            match next.unwrap() {
                Ok(event) => return event,
                Err(watcher::Error::WatchError(status)) => assert_eq!(status.code, 410),
                Err(other) => panic!("unexpected watch error {other:?}"),
            }
        }
    }

    fn event_name(event: &watcher::Event<ConfigMap>) -> String {
        match event {
            watcher::Event::Apply(o) => {
                format!("apply {}", o.metadata.name.as_deref().unwrap_or(""))
            }
            watcher::Event::Delete(o) => {
                format!("delete {}", o.metadata.name.as_deref().unwrap_or(""))
            }
            watcher::Event::Init => "init".to_owned(),
            watcher::Event::InitApply(o) => {
                format!("init-apply {}", o.metadata.name.as_deref().unwrap_or(""))
            }
            watcher::Event::InitDone => "init-done".to_owned(),
        }
    }

    async fn watcher_sees_changes(config: watcher::Config) {
        let fake = FakeApi::new();
        let api: Api<ConfigMap> = Api::namespaced(fake.client(), "default");
        api.create(&PostParams::default(), &config_map("before", &[]))
            .await
            .unwrap();
        let mut events = Box::pin(watcher(api.clone(), config.labels("!skip")));
        let mut seen = Vec::new();
        for _ in 0..3 {
            seen.push(event_name(&next_event(&mut events).await));
        }
        assert_eq!(seen, ["init", "init-apply before", "init-done"]);
        api.create(&PostParams::default(), &config_map("after", &[]))
            .await
            .unwrap();
        assert_eq!(event_name(&next_event(&mut events).await), "apply after");
        let mut skipped = config_map("skipped", &[]);
        skipped.metadata.labels = Some([("skip".to_owned(), "yes".to_owned())].into());
        api.create(&PostParams::default(), &skipped).await.unwrap();
        api.delete("before", &DeleteParams::default())
            .await
            .unwrap();
        assert_eq!(event_name(&next_event(&mut events).await), "delete before");

        // A restarted watch resumes where it was; after compaction it lists again.
        fake.close_watches();
        api.create(&PostParams::default(), &config_map("resumed", &[]))
            .await
            .unwrap();
        assert_eq!(event_name(&next_event(&mut events).await), "apply resumed");
        fake.close_watches();
        api.create(&PostParams::default(), &config_map("late", &[]))
            .await
            .unwrap();
        fake.compact();
        let mut seen = Vec::new();
        while seen.last().map(String::as_str) != Some("init-done") {
            seen.push(event_name(&next_event(&mut events).await));
        }
        assert_eq!(
            seen,
            [
                "init",
                "init-apply after",
                "init-apply late",
                "init-apply resumed",
                "init-done"
            ]
        );
    }

    #[tokio::test]
    async fn list_then_watch() {
        watcher_sees_changes(watcher::Config::default()).await;
    }

    #[tokio::test]
    async fn streaming_list_watch() {
        watcher_sees_changes(watcher::Config::default().streaming_lists()).await;
    }

    #[test]
    fn apply_removes_fields_the_manager_dropped() {
        let mut live = json!({"spec": {"a": 1, "b": 2, "c": 3}});
        let previous = json!({"spec": {"a": 1, "b": 2}});
        let next = json!({"spec": {"a": 5}});
        remove_dropped_fields(&mut live, &previous, &next);
        json_patch::merge(&mut live, &next);
        assert_eq!(live, json!({"spec": {"a": 5, "c": 3}}));
    }
}
