//! Validating admission webhooks, called as kube-apiserver's ValidatingAdmissionWebhook plugin
//! calls them (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/`):
//!
//! - at each write, the stored `ValidatingWebhookConfiguration`s are read, sorted by name, and
//!   every webhook whose rules, namespace and object selectors and matchConditions match is
//!   called (`matching`; `generic/webhook.go`, `ShouldCallHook`); writes of the configurations
//!   themselves are exempt;
//! - the webhooks run after the write's validation and ValidatingAdmissionPolicies, on the
//!   object as it will be stored: a created object already has its generated name, `uid` and
//!   `creationTimestamp` (`registry/generic/registry/store.go`, `Create`: `BeforeCreate`, then
//!   `createValidation`); the review is an `admission.k8s.io/v1` AdmissionReview as
//!   `request/admissionreview.go`, `CreateV1AdmissionReview`, builds it;
//! - all matching webhooks are called at once (`validating/dispatcher.go`, `Dispatch`), each
//!   with its `timeoutSeconds` (default 10), over HTTPS (`client`);
//! - the answer is checked as `VerifyAdmissionResponse` does (a v1 AdmissionReview, the
//!   request's uid, no patch); a failed call or an invalid answer is `ErrCallingWebhook`:
//!   `failurePolicy: Ignore` lets the write go on, `Fail` (the default) refuses it with
//!   `500 Internal error occurred: failed calling webhook "<name>": …`;
//! - a denial becomes the Status of `errors/statuserror.go`, `ToStatusErr`: the webhook's
//!   `result` with code raised to 400 when below, status `Failure`, and the message
//!   `admission webhook "<name>" denied the request: <message>` (or its reason, or
//!   `without explanation`); the first denial (in configuration order) is the answer.
//!
//! **The store's lock is not held while webhooks run**: a write that needs them computes the
//! calls under the lock and gives up ([`ApiError::awaiting_webhooks`]); the request then makes
//! the calls, records their verdict ([`Rounds`]) and runs the write again, and the verdict
//! counts only if the write still stores the very object the webhooks saw (else they are
//! called again, as kube-apiserver's `GuaranteedUpdate` re-runs admission when it retries).
//! A created object keeps the name, uid and timestamp of its first round.

mod client;
mod matching;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use serde_json::{Value, json};

use super::identity::Identity;
use super::meta_rules::group_of;
use super::routing::ApiRequest;
use super::store::{metadata_mut, now_timestamp, uid_from};
use super::{ApiError, ApiResult, FakeApi, ObjKey, State};
use client::Endpoint;
use matching::internal_error;

/// The AdmissionReview operation of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Operation {
    Create,
    Update,
    Delete,
}

impl Operation {
    fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
            Self::Delete => "DELETE",
        }
    }
}

/// What admission knows of one write (`admission.Attributes`).
pub(super) struct Attributes<'a> {
    pub(super) operation: Operation,
    pub(super) key: &'a ObjKey,
    /// `status` for a write of the status subresource, else empty.
    pub(super) subresource: &'static str,
    pub(super) old: Option<&'a Value>,
    pub(super) new: Option<&'a Value>,
}

impl Attributes<'_> {
    fn version(&self) -> &str {
        self.key.prefix.rsplit('/').next().unwrap_or("")
    }
}

/// One webhook about to be called.
#[derive(Debug, Clone)]
pub(super) struct Invocation {
    webhook: String,
    fail_open: bool,
    timeout: Duration,
    endpoint: Result<Endpoint, String>,
    /// The AdmissionReview, its `request.uid` still empty.
    review: Value,
}

/// The webhook rounds of one request, kept across the runs of its write.
#[derive(Debug, Default)]
pub(super) struct Rounds {
    /// Key, uid and creationTimestamp a created object got in the first round.
    created: Option<(ObjKey, Value, Value)>,
    /// The write's attributes and the calls it waits for.
    waiting: Option<(Value, Vec<Invocation>)>,
    /// Attributes the webhooks were called for, and their verdict.
    verdicts: Vec<(Value, Result<(), ApiError>)>,
}

impl Rounds {
    /// The name, uid and creationTimestamp a created object got in an earlier round.
    pub(super) fn created(&self) -> Option<&(ObjKey, Value, Value)> {
        self.created.as_ref()
    }

    pub(super) fn remember_created(&mut self, key: ObjKey, uid: Value, timestamp: Value) {
        self.created = Some((key, uid, timestamp));
    }
}

impl ApiRequest {
    pub(super) fn rounds(&self) -> MutexGuard<'_, Rounds> {
        // Only this request's own code touches its rounds; a poisoned lock holds no partial
        // update worth refusing.
        self.webhooks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Each request's rounds.
pub(super) type RoundsCell = Mutex<Rounds>;

impl ApiError {
    /// The marker a write returns when webhooks must be called before it can go on; never
    /// sent to a client.
    pub(super) fn awaiting_webhooks() -> Self {
        Self::new(0, "awaiting admission webhooks")
    }

    /// Whether this is [`ApiError::awaiting_webhooks`].
    pub(super) fn awaits_webhooks(&self) -> bool {
        self.code == 0
    }
}

impl State {
    /// Validating webhook admission of a write (after its validation and policies).
    ///
    /// # Errors
    ///
    /// [`ApiError::awaiting_webhooks`] when webhooks must be called; the recorded verdict of
    /// the webhooks for this very write; what `ShouldCallHook` refuses (a missing namespace,
    /// a failing matchCondition).
    pub(super) fn validating_webhooks(
        &self,
        request: &ApiRequest,
        attributes: &Attributes<'_>,
    ) -> ApiResult<()> {
        if matching::is_exempt(attributes.key) {
            return Ok(());
        }
        // Most fakes have no webhooks: every write pays only for this look.
        let configurations = self.validating_configurations();
        if configurations.is_empty() {
            return Ok(());
        }
        let mut applying = Vec::new();
        for configuration in configurations {
            for hook in configuration.webhooks.into_iter().flatten() {
                if self.webhook_applies(&hook, attributes)? {
                    applying.push(hook);
                }
            }
        }
        if applying.is_empty() {
            return Ok(());
        }
        let seen = json!({
            "operation": attributes.operation.as_str(),
            "key": [&attributes.key.prefix, &attributes.key.resource,
                    &attributes.key.namespace, &attributes.key.name],
            "subresource": attributes.subresource,
            "old": attributes.old,
            "new": attributes.new,
        });
        if let Some((_, verdict)) = request.rounds().verdicts.iter().find(|(s, _)| *s == seen) {
            return verdict.clone();
        }
        let review = self.review(&request.user, request, attributes);
        let mut calls = Vec::new();
        for hook in applying {
            if matching::conditions_match(&self.webhook_cel, &hook, attributes, &review["request"])?
            {
                calls.push(invocation(&hook, &review));
            }
        }
        if calls.is_empty() {
            return Ok(());
        }
        request.rounds().waiting = Some((seen, calls));
        Err(ApiError::awaiting_webhooks())
    }

    /// `obj` as `BeforeCreate` leaves it for validation and validating admission: type
    /// fields, no status where it has its own subresource, uid, creationTimestamp and
    /// generation, those of an earlier run of the same request when there was one.
    pub(super) fn prepared_for_create(
        &mut self,
        request: &ApiRequest,
        key: &ObjKey,
        mut obj: Value,
    ) -> Value {
        self.fill_type_meta(key, &mut obj);
        self.learn_kind(key, &obj);
        if self.has_status_subresource(key)
            && let Some(map) = obj.as_object_mut()
        {
            map.remove("status");
        }
        let remembered = request
            .rounds()
            .created()
            .filter(|(k, _, _)| k == key)
            .map(|(_, uid, timestamp)| (uid.clone(), timestamp.clone()));
        let (uid, timestamp) = remembered.unwrap_or_else(|| {
            self.uids += 1;
            (json!(uid_from(self.uids)), now_timestamp())
        });
        request
            .rounds()
            .remember_created(key.clone(), uid.clone(), timestamp.clone());
        let meta = metadata_mut(&mut obj);
        meta.insert("uid".to_owned(), uid);
        meta.insert("creationTimestamp".to_owned(), timestamp);
        meta.insert("generation".to_owned(), json!(1));
        meta.remove("deletionTimestamp");
        obj
    }

    /// The stored ValidatingWebhookConfigurations, by name.
    fn validating_configurations(&self) -> Vec<ValidatingWebhookConfiguration> {
        let first = ObjKey {
            prefix: "apis/admissionregistration.k8s.io/v1".to_owned(),
            resource: "validatingwebhookconfigurations".to_owned(),
            namespace: String::new(),
            name: String::new(),
        };
        self.objects
            .range(first.clone()..)
            .take_while(|(k, _)| k.prefix == first.prefix && k.resource == first.resource)
            // A configuration the fake cannot read is skipped, as one that fails
            // kube-apiserver's validation could not have been stored.
            .filter_map(|(_, v)| serde_json::from_value(v.clone()).ok())
            .collect()
    }

    /// `CreateV1AdmissionReview` for this write; `request.uid` is set when it is sent.
    fn review(&self, user: &Identity, request: &ApiRequest, attributes: &Attributes<'_>) -> Value {
        let key = attributes.key;
        let gvk = json!({
            "group": group_of(key),
            "version": attributes.version(),
            "kind": self.kind_of(&key.prefix, &key.resource),
        });
        let gvr = json!({
            "group": group_of(key),
            "version": attributes.version(),
            "resource": key.resource,
        });
        let mut user_info = json!({"username": user.username, "groups": user.groups});
        if !user.extra.is_empty() {
            user_info["extra"] = json!(user.extra);
        }
        let mut body = json!({
            "uid": "",
            "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
            "operation": attributes.operation.as_str(),
            "userInfo": user_info,
            "object": attributes.new,
            "oldObject": attributes.old,
            "dryRun": false,
            "options": options(request, attributes.operation),
        });
        // `omitempty` fields.
        for (field, value) in [
            ("name", key.name.as_str()),
            ("namespace", key.namespace.as_str()),
            ("subResource", attributes.subresource),
            ("requestSubResource", attributes.subresource),
        ] {
            if !value.is_empty() {
                body[field] = json!(value);
            }
        }
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": body})
    }
}

/// The `options` of the review: the write's CreateOptions, UpdateOptions (a PATCH's too) or
/// DeleteOptions, as the handlers pass them to admission.
fn options(request: &ApiRequest, operation: Operation) -> Value {
    let kind = match operation {
        Operation::Create => "CreateOptions",
        Operation::Update => "UpdateOptions",
        Operation::Delete => "DeleteOptions",
    };
    let mut options = match operation {
        Operation::Delete => request
            .json_body()
            .ok()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({})),
        Operation::Create | Operation::Update => json!({}),
    };
    options["kind"] = json!(kind);
    options["apiVersion"] = json!("meta.k8s.io/v1");
    if let Some(manager) = request.query.get("fieldManager").filter(|m| !m.is_empty()) {
        options["fieldManager"] = json!(manager);
    }
    options
}

fn invocation(
    hook: &k8s_openapi::api::admissionregistration::v1::ValidatingWebhook,
    review: &Value,
) -> Invocation {
    let seconds = hook.timeout_seconds.unwrap_or(10).clamp(1, 30);
    let endpoint = if hook.admission_review_versions.iter().any(|v| v == "v1") {
        Endpoint::of(&hook.client_config)
    } else {
        // The fake speaks only v1 (upstream also knows v1beta1).
        Err("webhook does not accept known AdmissionReview versions (v1, v1beta1)".to_owned())
    };
    Invocation {
        webhook: hook.name.clone(),
        fail_open: hook.failure_policy.as_deref() == Some("Ignore"),
        timeout: Duration::from_secs(u64::try_from(seconds).unwrap_or(10)),
        endpoint,
        review: review.clone(),
    }
}

impl FakeApi {
    /// Makes the calls `request` waits for and records their verdict.
    pub(super) async fn call_waiting_webhooks(&self, request: &ApiRequest) {
        let Some((seen, calls)) = request.rounds().waiting.take() else {
            return;
        };
        let services = self
            .inner
            .webhook_services
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let calls = calls.into_iter().map(|call| {
            // Counted down from the top, so no review shares a uid with a stored object.
            let sent = self.inner.review_uids.fetch_add(1, Ordering::Relaxed);
            let uid = uid_from(u64::MAX - sent);
            call_hook(call, uid, &services)
        });
        let outcomes = futures::future::join_all(calls).await;
        let verdict = outcomes
            .into_iter()
            .find_map(Result::err)
            .map_or(Ok(()), Err);
        request.rounds().verdicts.push((seen, verdict));
    }
}

/// `callHook` and `Dispatch`'s handling of its outcome for one webhook.
async fn call_hook(
    mut call: Invocation,
    uid: String,
    services: &HashMap<(String, String), SocketAddr>,
) -> ApiResult<()> {
    call.review["request"]["uid"] = json!(uid);
    let answer = match &call.endpoint {
        Ok(endpoint) => endpoint
            .post(services, &call.review, call.timeout)
            .await
            .map_err(|e| format!("failed to call webhook: {e}"))
            .and_then(|answer| {
                verify(&uid, &answer)
                    .map_err(|e| format!("received invalid webhook response: {e}"))
                    .map(|()| answer)
            }),
        Err(e) => Err(e.clone()),
    };
    let answer = match answer {
        Ok(answer) => answer,
        Err(_) if call.fail_open => return Ok(()),
        Err(e) => {
            // `ErrCallingWebhook.Error()`, wrapped by `NewInternalError`.
            return Err(internal_error(&format!(
                "failed calling webhook {:?}: {e}",
                call.webhook
            )));
        }
    };
    let response = &answer["response"];
    if response["allowed"].as_bool() == Some(true) {
        return Ok(());
    }
    // `AdmissionResponse.Result` is `status` in JSON.
    Err(denial(&call.webhook, response.get("status")))
}

/// `VerifyAdmissionResponse` for a validating webhook's v1 answer.
fn verify(uid: &str, answer: &Value) -> Result<(), String> {
    let response = answer
        .get("response")
        .filter(|r| r.is_object())
        .ok_or("webhook response was absent")?;
    let got = response["uid"].as_str().unwrap_or("");
    if got != uid {
        return Err(format!("expected response.uid={uid:?}, got {got:?}"));
    }
    let api_version = answer["apiVersion"].as_str().unwrap_or("");
    let kind = answer["kind"].as_str().unwrap_or("");
    if (api_version, kind) != ("admission.k8s.io/v1", "AdmissionReview") {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        return Err(format!(
            "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {group}/{version}, Kind={kind}"
        ));
    }
    if response
        .get("patch")
        .and_then(Value::as_str)
        .is_some_and(|p| !p.is_empty())
    {
        return Err("validating webhook may not return response.patch".to_owned());
    }
    if response.get("patchType").is_some_and(|p| !p.is_null()) {
        return Err("validating webhook may not return response.patchType".to_owned());
    }
    Ok(())
}

/// `ToStatusErr`: the webhook's Status with its code at least 400 and the message naming the
/// webhook.
fn denial(webhook: &str, result: Option<&Value>) -> ApiError {
    let result = result.cloned().unwrap_or(Value::Null);
    let text = |field: &str| result.get(field).and_then(Value::as_str).unwrap_or("");
    let denied_by = format!("admission webhook {webhook:?} denied the request");
    let message = match (text("message"), text("reason")) {
        (message, _) if !message.is_empty() => format!("{denied_by}: {message}"),
        (_, reason) if !reason.is_empty() => format!("{denied_by}: {reason}"),
        _ => format!("{denied_by} without explanation"),
    };
    let code = result
        .get("code")
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .filter(|c| *c >= 400)
        .unwrap_or(400);
    let mut err = ApiError::new(code, message);
    err.reason = text("reason").to_owned().into();
    err.details = result.get("details").filter(|d| !d.is_null()).cloned();
    err
}

/// kerf's default install (`deploy/kerf.yaml`), whose webhook configurations tests install
/// the configurations kerf ships ([`FakeApi::install_webhook_configurations`]).
pub const KERF_WEBHOOK_MANIFEST: &str = crate::manifests::INSTALL;

impl FakeApi {
    /// Tells the fake where the pods behind Service `namespace`/`name` serve: a webhook whose
    /// `clientConfig.service` names it is dialled at `address` (whatever the service's port),
    /// and its certificate verified for `<name>.<namespace>.svc`, as kube-apiserver dials a
    /// service reference. A webhook of a service the fake does not know fails to be called.
    pub fn serve_webhook_service(&self, namespace: &str, name: &str, address: SocketAddr) {
        self.inner
            .webhook_services
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((namespace.to_owned(), name.to_owned()), address);
    }

    /// Stores the ValidatingWebhookConfigurations and MutatingWebhookConfigurations of a
    /// multi-document YAML `manifest` (e.g. [`KERF_WEBHOOK_MANIFEST`]), each webhook's
    /// `clientConfig.caBundle` set to `ca_bundle_pem` when given (as cert-manager's CA injector
    /// or kerf-controller's self-signed mode fills it); other documents are skipped. Returns the
    /// names of the configurations stored.
    ///
    /// The fake calls only validating webhooks; mutating configurations are stored for the
    /// code that maintains them (e.g. the controller's caBundle upkeep).
    ///
    /// # Panics
    ///
    /// When `manifest` is not YAML: a bug in the test.
    pub fn install_webhook_configurations(
        &self,
        manifest: &str,
        ca_bundle_pem: Option<&str>,
    ) -> Vec<String> {
        let docs: Vec<Value> = serde_saphyr::from_multiple(manifest)
            .unwrap_or_else(|e| webhook_fixture_bug(&format!("manifest is not YAML: {e}")));
        let bundle = ca_bundle_pem.map(|pem| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(pem)
        });
        let mut names = Vec::new();
        for mut doc in docs {
            let kind = doc["kind"].as_str().unwrap_or("");
            if !matches!(
                kind,
                "ValidatingWebhookConfiguration" | "MutatingWebhookConfiguration"
            ) {
                continue;
            }
            if let (Some(bundle), Some(webhooks)) = (&bundle, doc["webhooks"].as_array_mut()) {
                for webhook in webhooks {
                    webhook["clientConfig"]["caBundle"] = json!(bundle);
                }
            }
            names.push(doc["metadata"]["name"].as_str().unwrap_or("").to_owned());
            self.insert(doc);
        }
        names
    }
}

#[allow(
    clippy::panic,
    reason = "a fixture that cannot be built is a bug in the test"
)]
fn webhook_fixture_bug(message: &str) -> ! {
    panic!("FakeApi::install_webhook_configurations: {message}")
}
