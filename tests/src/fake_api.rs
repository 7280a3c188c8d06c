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
//! What every cluster does on top of storing objects is done here too: TaintNodesByCondition
//! and the node lifecycle controller's NoSchedule taints (`admission`), kerf's
//! ValidatingAdmissionPolicies from `deploy/helm/kerf/templates/resourceslice-policy.yaml` and
//! `mps-daemon-pod-policy.yaml` (`admission_policy`), the immutable spec of ResourceClaims
//! and ResourceClaimTemplates with their opaque parameters kept as the bytes the client sent
//! (`claims`), the update rules of object metadata (`meta_rules`), and the validating
//! admission webhooks of the stored ValidatingWebhookConfigurations, called over HTTPS at each
//! CREATE, UPDATE and DELETE their rules match, without the store's lock held meanwhile
//! (`webhooks`; a test says where a webhook's Service serves with
//! [`FakeApi::serve_webhook_service`] and may install kerf's configurations with
//! [`FakeApi::install_webhook_configurations`]).
//!
//! Where FakeApi still differs from kube-apiserver 1.36:
//! - authorization: see `rbac`;
//! - any resource name is accepted (no discovery, no schema validation, no defaulting), and
//!   objects are stored as [`Value`]s, so JSON keys come back sorted and numbers as serde_json
//!   writes them; only the opaque `parameters` of a claim's or template's `spec` keep their
//!   text (compacted as Go does, key order kept), not those in a claim's `status.allocation`;
//! - server-side apply is "create or merge, forcing": fields are merged like a JSON merge
//!   patch, and fields the same field manager applied before but omits now are removed (lists
//!   are atomic); there is no conflict detection between managers and no `managedFields`;
//! - strategic merge patches are treated as JSON merge patches (no patch strategies or merge
//!   keys), except that they re-encode a claim's parameters as a real one does;
//! - a JSON or merge patch that descends *into* a claim's parameters re-encodes them wholly
//!   (keys sorted); a real server keeps the text of the sub-objects it does not descend into;
//! - a claim's `Invalid value` shows the new spec as JSON, where the real server prints Go's
//!   `%#v` of its internal struct; the causes and reason are the real ones;
//! - admission plugins other than TaintNodesByCondition, kerf's policy and validating webhooks
//!   do not run (no NodeRestriction, no LimitRanger, no NamespaceLifecycle, no ResourceQuota,
//!   **no mutating webhooks**: MutatingWebhookConfigurations are stored but never called);
//!   the node lifecycle controller's tainting is synchronous and waits for a Ready condition
//!   (see `admission`), and it neither adds NoExecute taints nor marks silent nodes Unknown;
//! - of validating webhooks (`webhooks`), not imitated: `matchPolicy: Equivalent` (a rule
//!   matches only the version the request names), AdmissionReview v1beta1, the `authorizer`
//!   variable of matchConditions, CEL type checking and cost limits, warnings, audit
//!   annotations, a Service's port (the fake dials the address the test gave), and calls on
//!   `dryRun` requests; error texts of a failed call are Rust's (`Connection refused (os
//!   error 111)`, not Go's `connect: connection refused`); a namespace a webhook's
//!   namespaceSelector must look at has to exist as an object (else `404`, as upstream);
//!   timeouts run on Tokio's clock, so a paused-clock test sees a webhook time out as soon
//!   as nothing else is runnable;
//! - field selectors accept any dotted field path; list pagination returns everything at once;
//! - pods are deleted gracefully only on nodes named by [`FakeApi::graceful_pod_deletion_on`]
//!   (`pod_deletion`); elsewhere at once, as if their kubelet had confirmed at once;
//! - `dryRun=All` is simulated for CREATE only (the answer is what would be stored, nothing
//!   is; no admission runs); on other verbs it is rejected with 400.
//!
//! [`FakeApi::drop_field`] makes the fake behave like an API server whose feature gate for a
//! field is off: kube-apiserver's registry strategies call `dropDisabledFields` (e.g.
//! kubernetes/kubernetes `pkg/registry/resource/resourceslice/strategy.go`,
//! `dropDisabledFields`, which clears `devices[].taints` unless `DRADeviceTaints` is on) on
//! every create and update, so the write succeeds and the field is silently gone.
//!
//! Layout: this module holds the shared types; `routing` the HTTP side and verb dispatch,
//! `store` objects and their lifecycle, `patch` PATCH and server-side apply, `watch` change
//! history and watch streams, `selectors` field and label selectors, `faults` the request log
//! and injected faults, `fixtures` the test-side API that bypasses HTTP, `raw_json` JSON text
//! as Go's encoder handles it, `webhooks` validating admission webhooks.

mod admission;
mod admission_policy;
mod claims;
mod faults;
mod fixtures;
mod identity;
mod meta_rules;
mod patch;
mod pod_deletion;
mod raw_json;
mod rbac;
mod request_counts;
mod routing;
mod selectors;
mod store;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_admission;
#[cfg(test)]
mod tests_claims;
mod watch;
mod webhooks;

pub use faults::describe_requests;
pub use fixtures::StoreView;
pub use identity::{Identity, KERF_NAMESPACE, NODE_NAME_EXTRA};
pub use rbac::{Attributes, Check, Grant, KERF_RBAC_MANIFESTS, Policy, RbacError, RuleSource};
pub use request_counts::{RequestCounts, RequestKind};
pub use webhooks::KERF_WEBHOOK_MANIFEST;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use faults::{Delay, Fault};

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
    /// Authorizes requests of users outside `system:masters` (`rbac`).
    rbac: Arc<rbac::Authorizer>,
    /// Where the Services named by webhook configurations are served
    /// ([`FakeApi::serve_webhook_service`]).
    webhook_services: Mutex<HashMap<(String, String), SocketAddr>>,
    /// How many AdmissionReviews were sent, for their uids (`webhooks`).
    review_uids: AtomicU64,
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
    /// Who sent it ([`Identity::username`]).
    pub user: String,
    /// When the fake received it (Tokio's clock, so paused-time tests see their own time).
    pub at: tokio::time::Instant,
}

impl RecordedRequest {
    /// Whether `method` names this request's HTTP method or Kubernetes verb
    /// (case-insensitive) and its path starts with `path_prefix`.
    pub fn matches(&self, method: &str, path_prefix: &str) -> bool {
        (self.method.eq_ignore_ascii_case(method) || self.verb.eq_ignore_ascii_case(method))
            && self.path.starts_with(path_prefix)
    }
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
    /// The texts of `new`'s opaque parameters as stored (ResourceClaims and templates only).
    raw: Option<Arc<claims::RawParams>>,
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
    /// The texts of the opaque parameters of stored ResourceClaims and templates, as the
    /// request that wrote them sent them (`claims`).
    raw_params: HashMap<ObjKey, Arc<claims::RawParams>>,
    /// The ValidatingAdmissionPolicies in force (`admission_policy`).
    policies: Arc<admission_policy::Policies>,
    /// Nodes whose pods are deleted gracefully (`pod_deletion`).
    kubelet_nodes: HashSet<String>,
    /// The CEL environment of webhooks' matchConditions (`webhooks`).
    webhook_cel: Arc<cel::Env>,
}

/// An API error, rendered as a `Status` object.
#[derive(Debug, Clone)]
struct ApiError {
    code: u16,
    /// Empty when the Status has none (a webhook's denial may lack one).
    reason: Cow<'static, str>,
    message: String,
    /// `details` of the `Status` (e.g. the causes of a 422), when there are any.
    details: Option<Value>,
}

type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(code: u16, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: Cow::Borrowed(reason_for(code)),
            message: message.into(),
            details: None,
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
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if self.reason.is_empty()
            && let Some(map) = status.as_object_mut()
        {
            map.remove("reason");
        }
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
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
    /// workloads, ResourceClaims and kerf's GpuClasses and GpuQuotas have a `/status`
    /// subresource, as on a real cluster: writes to the main resource leave their status alone,
    /// and writes to `/status` change nothing else (for custom resources as apiextensions'
    /// `statusStrategy.PrepareForUpdate` in kubernetes/kubernetes
    /// `staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/status_strategy.go`
    /// does it: the old object with the new status). A PUT whose `metadata.resourceVersion`
    /// is not the stored one is `409 Conflict`, on every resource.
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
            "gpuquotas",
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
            raw_params: HashMap::new(),
            policies: Arc::new(admission_policy::Policies::kerf()),
            kubelet_nodes: HashSet::new(),
            webhook_cel: Arc::new(cel::Env::stdlib()),
        };
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(state),
                events,
                outage: tokio::sync::watch::Sender::new(None),
                rbac: Arc::new(rbac::Authorizer::kerf()),
                webhook_services: Mutex::new(HashMap::new()),
                review_uids: AtomicU64::new(0),
            }),
        }
    }

    /// A kube client whose requests this fake serves; its default namespace is `default`.
    ///
    /// Must be called inside a Tokio runtime: the client spawns its request buffer there.
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.clone(), "default")
    }

    /// A kube client whose requests this fake serves as sent by `identity` (a component's
    /// ServiceAccount: [`Identity::kerf_controller`], [`Identity::kerf_kubelet_plugin`]).
    /// Its default namespace is `default`.
    ///
    /// Must be called inside a Tokio runtime: the client spawns its request buffer there.
    pub fn client_as(&self, identity: Identity) -> kube::Client {
        let service = identity::AsIdentity {
            api: self.clone(),
            identity: Arc::new(identity),
        };
        kube::Client::new(service, "default")
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
}
