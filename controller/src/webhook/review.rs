//! AdmissionReview `admission.k8s.io/v1`: request body in, response body out.
//!
//! The API server checks a webhook's answer in `VerifyAdmissionResponse`
//! (`staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/request/admissionreview.go`):
//! the response must be an `admission.k8s.io/v1` `AdmissionReview`, carry the request's `uid`,
//! and send `patch` and `patchType` together. `patch` is a Go `[]byte`
//! (`staging/src/k8s.io/api/admission/v1/types.go`), which JSON carries as a base64 string.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::{Value, json};

use super::decide::{ClaimLookup, Decision, Skip, decide};

/// How one review ended, for metrics and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The pod gets the scheduling gate.
    Gated,
    /// The pod is admitted unchanged.
    NotGated(Skip),
    /// The review could not be handled; the pod is admitted unchanged (or the body was not a
    /// review at all).
    Error(String),
}

impl Outcome {
    /// The metric label: `gated`, `not_gated` or `error`.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Gated => "gated",
            Outcome::NotGated(_) => "not_gated",
            Outcome::Error(_) => "error",
        }
    }
}

/// The answer to one HTTP request: status code, JSON body, outcome.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status: 200 for every review that parsed, 400 for a body that is not one.
    pub status: u16,
    /// The JSON body.
    pub body: Vec<u8>,
    /// What happened.
    pub outcome: Outcome,
}

/// Handles one AdmissionReview request body.
///
/// A review that parses is always answered `allowed: true` (the webhook only ever adds a
/// gate, it never refuses a pod), with a base64 JSONPatch when the pod needs the gate. A
/// review for anything but the CREATE of a pod, or whose pod does not decode, is allowed
/// unchanged with the reason in `status.message`. A body that is not an `admission.k8s.io/v1`
/// AdmissionReview with a `request` gets HTTP 400 and a `Status` naming the problem; under
/// `failurePolicy: Ignore` the API server then admits the pod unchanged.
pub fn handle(body: &[u8], lookup: &impl ClaimLookup) -> Answer {
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(e) => return bad_request(format!("not an AdmissionReview: {e}")),
    };
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return bad_request(format!(
            "expected admission.k8s.io/v1 AdmissionReview, got {}/{}",
            review.types.api_version, review.types.kind
        ));
    }
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return bad_request(format!("AdmissionReview without request: {e}")),
    };
    let response = AdmissionResponse::from(&request);
    let (outcome, patch) = review_pod(&request, lookup);
    let mut response = serde_json::to_value(response.into_review()).unwrap_or_else(|_| json!({}));
    let answer = &mut response["response"];
    answer["uid"] = json!(request.uid);
    answer["allowed"] = json!(true);
    if let Some(patch) = patch {
        answer["patchType"] = json!("JSONPatch");
        answer["patch"] = json!(STANDARD.encode(patch.to_string()));
    } else if let Outcome::NotGated(skip) = &outcome {
        answer["status"] = json!({"message": format!("{skip:?}")});
    } else if let Outcome::Error(message) = &outcome {
        answer["status"] = json!({"message": message});
    }
    Answer {
        status: 200,
        body: response.to_string().into_bytes(),
        outcome,
    }
}

fn review_pod(
    request: &AdmissionRequest<DynamicObject>,
    lookup: &impl ClaimLookup,
) -> (Outcome, Option<Value>) {
    if request.operation != Operation::Create
        || request.kind.kind != "Pod"
        || !request.kind.group.is_empty()
        || request.sub_resource.is_some()
    {
        return (
            Outcome::Error(format!(
                "kerf's webhook handles the CREATE of pods, not {:?} of {}",
                request.operation, request.kind.kind
            )),
            None,
        );
    }
    let pod = request
        .object
        .as_ref()
        .ok_or_else(|| "request without object".to_owned())
        .and_then(|o| serde_json::to_value(o).map_err(|e| e.to_string()))
        .and_then(|v| serde_json::from_value::<Pod>(v).map_err(|e| e.to_string()));
    let pod = match pod {
        Ok(pod) => pod,
        Err(e) => return (Outcome::Error(format!("cannot decode the pod: {e}")), None),
    };
    // On CREATE the namespace is the request's: the pod's metadata may omit it.
    let namespace = request
        .namespace
        .as_deref()
        .or(pod.metadata.namespace.as_deref())
        .unwrap_or("default");
    match decide(&pod, namespace, lookup) {
        Decision::Gate(patch) => (Outcome::Gated, Some(patch)),
        Decision::Skip(skip) => (Outcome::NotGated(skip), None),
    }
}

fn bad_request(message: String) -> Answer {
    let body = json!({
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": 400,
        "reason": "BadRequest",
        "message": message,
    });
    Answer {
        status: 400,
        body: body.to_string().into_bytes(),
        outcome: Outcome::Error(message),
    }
}
