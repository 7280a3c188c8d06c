//! HTTP side of [`FakeApi`]: the [`tower::Service`], parsing of resource paths and query
//! strings, dispatch of each Kubernetes verb to the store, and the JSON responses.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use serde_json::Value;

use super::rbac::{Attributes, Authorizer};
use super::webhooks::RoundsCell;
use super::{ApiError, ApiResult, FakeApi, FakeBody, Identity, ObjKey, RecordedRequest};

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

pub(super) struct ApiRequest {
    pub(super) parsed: ParsedPath,
    pub(super) query: Query,
    pub(super) content_type: Option<String>,
    pub(super) body: Bytes,
    /// Who sent it (the admin when the client set no [`Identity`]).
    pub(super) user: Arc<Identity>,
    /// What the authorizer was asked about it.
    pub(super) attributes: Attributes,
    /// The fake's authorizer, for the checks a write makes once its objects are known
    /// ([`ApiRequest::authorize_write`]).
    pub(super) rbac: Arc<Authorizer>,
    /// The admission webhooks' verdicts on this write, kept across its runs (`webhooks`).
    pub(super) webhooks: RoundsCell,
}

impl ApiRequest {
    pub(super) fn json_body(&self) -> ApiResult<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("request body is not JSON: {e}")))
    }

    pub(super) fn object_body(&self) -> ApiResult<Value> {
        let value = self.json_body()?;
        if value.is_object() {
            Ok(value)
        } else {
            Err(ApiError::bad_request("request body is not a JSON object"))
        }
    }

    pub(super) fn object_key(&self) -> ApiResult<ObjKey> {
        self.parsed
            .object_key()
            .ok_or_else(|| ApiError::new(405, "this verb needs an object path"))
    }
}

/// How often a write runs at most when the object changes while its admission webhooks are
/// called (each change calls them again).
const WEBHOOK_ROUNDS: usize = 16;

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
pub(super) struct ParsedPath {
    pub(super) prefix: String,
    pub(super) namespace: Option<String>,
    pub(super) resource: String,
    pub(super) name: Option<String>,
    pub(super) status: bool,
}

impl ParsedPath {
    pub(super) fn parse(path: &str) -> ApiResult<Self> {
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

    pub(super) fn object_key(&self) -> Option<ObjKey> {
        Some(ObjKey {
            prefix: self.prefix.clone(),
            resource: self.resource.clone(),
            namespace: self.namespace.clone().unwrap_or_default(),
            name: self.name.clone()?,
        })
    }

    pub(super) fn api_version(&self) -> String {
        api_version_of(&self.prefix)
    }
}

/// `/api/v1/namespaces/<ns>/status` is the namespace's status, not a resource named `status`.
fn is_namespace_subresource(segment: &str, more: &[&str]) -> bool {
    more.is_empty() && matches!(segment, "status" | "finalize")
}

pub(super) fn prefix_of(api_version: &str) -> String {
    if api_version.contains('/') {
        format!("apis/{api_version}")
    } else {
        format!("api/{api_version}")
    }
}

pub(super) fn api_version_of(prefix: &str) -> String {
    prefix
        .strip_prefix("apis/")
        .or_else(|| prefix.strip_prefix("api/"))
        .unwrap_or(prefix)
        .to_owned()
}

/// The lower-case plural the API server uses for a kind, for the regular English cases.
pub(super) fn plural_of(kind: &str) -> String {
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
pub(super) struct Query(HashMap<String, String>);

impl Query {
    pub(super) fn parse(raw: &str) -> Self {
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

    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    pub(super) fn flag(&self, key: &str) -> bool {
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

fn json_response(code: u16, value: &Value) -> Response<FakeBody> {
    bytes_response(code, value.to_string().into_bytes())
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

pub(super) fn error_response(err: &ApiError) -> Response<FakeBody> {
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

impl FakeApi {
    pub(super) async fn handle(self, request: Request<kube::client::Body>) -> Response<FakeBody> {
        let (parts, body) = request.into_parts();
        let user = parts
            .extensions
            .get::<Arc<Identity>>()
            .cloned()
            .unwrap_or_else(|| Arc::new(Identity::admin()));
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
        let attributes = Attributes::from_request(parts.method.as_str(), &path, &raw_query);
        let record = RecordedRequest {
            method: parts.method.to_string(),
            verb,
            path,
            query: raw_query,
            content_type: content_type.clone(),
            user: user.username.clone(),
            at: tokio::time::Instant::now(),
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
            return error_response(&fault);
        }
        // kube-apiserver's authorization filter runs before any handler, so a request the
        // user may not make is 403 even where the path names nothing.
        if let Err(err) = self.inner.rbac.authorize(&user, &attributes) {
            return error_response(&err);
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
            user,
            attributes,
            rbac: Arc::clone(&self.inner.rbac),
            webhooks: RoundsCell::default(),
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
        match self.dispatch(verb, &request).await {
            // Written as the store holds it: a claim's opaque parameters as their stored text.
            Ok((code, value)) => bytes_response(
                code,
                self.state().render_object(
                    &request.parsed.prefix,
                    &request.parsed.resource,
                    &value,
                ),
            ),
            Err(err) => error_response(&err),
        }
    }

    /// Runs the write (or read) of `request`; a write that must wait for admission webhooks
    /// is run again once they answered, without the store's lock held meanwhile (`webhooks`).
    async fn dispatch(&self, verb: &str, request: &ApiRequest) -> ApiResult<(u16, Value)> {
        // A collection's objects each wait for their webhooks in turn.
        let rounds = if verb == "deletecollection" {
            WEBHOOK_ROUNDS * 256
        } else {
            WEBHOOK_ROUNDS
        };
        for _ in 0..rounds {
            match self.dispatch_locked(verb, request) {
                Err(err) if err.awaits_webhooks() => self.call_waiting_webhooks(request).await,
                done => return done,
            }
        }
        // The object kept changing while its webhooks ran: what `GuaranteedUpdate` answers
        // when its retries keep conflicting.
        let key = request.object_key().unwrap_or_else(|_| ObjKey {
            prefix: request.parsed.prefix.clone(),
            resource: request.parsed.resource.clone(),
            namespace: request.parsed.namespace.clone().unwrap_or_default(),
            name: String::new(),
        });
        Err(ApiError::conflict(
            &key,
            "the object has been modified; please apply your changes to the latest version and try again",
        ))
    }

    fn dispatch_locked(&self, verb: &str, request: &ApiRequest) -> ApiResult<(u16, Value)> {
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
}
