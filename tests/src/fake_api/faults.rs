//! The request log and scripted faults: failures ([`FakeApi::fail_next`]), delays
//! ([`FakeApi::delay_next`]), outages ([`FakeApi::set_outage`]), `dryRun=All` creates and
//! fields dropped like a feature gate that is off ([`FakeApi::drop_field`]; kube-apiserver's
//! `dropDisabledFields` in kubernetes/kubernetes
//! `pkg/registry/resource/resourceslice/strategy.go`).

use std::fmt::Write as _;
use std::time::Duration;

use http::Response;
use serde_json::Value;

use super::routing::{ApiRequest, error_response};
use super::{ApiError, ApiResult, FakeApi, FakeBody, ObjKey, Outage, RecordedRequest, State};

/// A scripted failure: the next `times` matching requests get `code`, with the Status reason
/// and message of `answer` when given (else `code`'s reason and "injected fault").
#[derive(Debug, Clone)]
pub(super) struct Fault {
    method: String,
    path_prefix: String,
    code: u16,
    answer: Option<(&'static str, String)>,
    remaining: usize,
}

impl Fault {
    /// The Status the faulted request is answered with.
    fn error(&self) -> ApiError {
        match &self.answer {
            Some((reason, message)) => ApiError {
                code: self.code,
                reason: std::borrow::Cow::Borrowed(reason),
                message: message.clone(),
                details: None,
            },
            None => ApiError::new(self.code, "injected fault"),
        }
    }
}

/// A scripted delay: the next `remaining` matching requests are answered `delay` late.
#[derive(Debug, Clone)]
pub(super) struct Delay {
    method: String,
    path_prefix: String,
    duration: Duration,
    remaining: usize,
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

impl FakeApi {
    /// Drops `path` from every object of `resource` (plural, e.g. `resourceslices`) written
    /// from now on, as an API server with that field's feature gate off does. `path` is
    /// dotted, and a segment ending in `[]` means every element of that list, e.g.
    /// `spec.devices[].taints`.
    pub fn drop_field(&self, resource: &str, path: &str) {
        self.state()
            .dropped_fields
            .push((resource.to_owned(), path.to_owned()));
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
            answer: None,
            remaining: times,
        });
    }

    /// [`FakeApi::fail_next`] with the Status a real API server sends: `reason` (a
    /// `metav1.StatusReason` such as `Forbidden` or `Invalid`) and `message`, e.g. the words of
    /// kube-apiserver's RBAC denial (`forbiddenMessage` in kubernetes/kubernetes
    /// `staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go`:
    /// `pods "p" is forbidden: User "…" cannot patch resource "pods" in API group "" in the
    /// namespace "default"`) or of a validation error (`NewInvalid` in apimachinery's
    /// `pkg/api/errors/errors.go`: `ResourceClaim.resource.k8s.io "c" is invalid: spec: Invalid
    /// value: …: field is immutable`). The message is sent as given.
    pub fn fail_next_with(
        &self,
        method: &str,
        path_prefix: &str,
        status_code: u16,
        reason: &'static str,
        message: &str,
        times: usize,
    ) {
        self.state().faults.push(Fault {
            method: method.to_owned(),
            path_prefix: path_prefix.to_owned(),
            code: status_code,
            answer: Some((reason, message.to_owned())),
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
    pub(super) async fn outage_response(&self) -> Option<Response<FakeBody>> {
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

    pub(super) fn take_delay(&self, record: &RecordedRequest) -> Option<Duration> {
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

    pub(super) fn record_and_check_faults(&self, record: RecordedRequest) -> Option<ApiError> {
        let mut state = self.state();
        let fault = state
            .faults
            .iter_mut()
            .find(|f| f.remaining > 0 && record.matches(&f.method, &f.path_prefix));
        let error = fault.map(|f| {
            f.remaining -= 1;
            f.error()
        });
        state.faults.retain(|f| f.remaining > 0);
        state.requests.push(record);
        error
    }
}

impl State {
    /// What [`State::create`] would store, without storing it.
    pub(super) fn dry_run_create(&mut self, request: &ApiRequest) -> ApiResult<Value> {
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

    pub(super) fn drop_disabled_fields(&self, key: &ObjKey, obj: &mut Value) {
        for (_, path) in self
            .dropped_fields
            .iter()
            .filter(|(r, _)| *r == key.resource)
        {
            let segments: Vec<&str> = path.split('.').collect();
            drop_path(obj, &segments);
        }
    }
}
