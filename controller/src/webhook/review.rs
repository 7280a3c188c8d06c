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

use super::claims::{ClaimDecision, ClaimResource, decide_claim};
use super::decide::{ClaimLookup, Decision, Skip, decide};
use super::quota::QuotaOutcome;

/// How one review ended, for metrics and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The pod gets the scheduling gate.
    Gated,
    /// The pod is admitted unchanged.
    NotGated(Skip),
    /// A ResourceClaim or ResourceClaimTemplate was reviewed.
    Claim(ClaimResource, ClaimOutcome),
    /// A ResourceClaim was checked against its namespace's GpuQuotas.
    Quota(QuotaOutcome),
    /// The review could not be handled; the pod is admitted unchanged (or the body was not a
    /// review at all).
    Error(String),
}

impl Outcome {
    /// The metric label of a pod review: `gated`, `not_gated` or `error` (a claim review
    /// counts as `error` here; its own label is [`ClaimOutcome::label`]).
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Gated => "gated",
            Outcome::NotGated(_) => "not_gated",
            Outcome::Claim(..) | Outcome::Quota(_) | Outcome::Error(_) => "error",
        }
    }
}

/// How the review of a claim or template ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Admitted with a patch rewriting this many kerf configs in canonical form.
    Normalized(usize),
    /// Admitted unchanged: no config for kerf's driver.
    NoKerfConfig,
    /// Denied: a kerf config is invalid (the message names field and value).
    Denied(String),
    /// Not handled (not a CREATE, no object); admitted unchanged.
    Error(String),
}

impl ClaimOutcome {
    /// The metric label: `normalized`, `no_kerf_config`, `denied` or `error`.
    pub fn label(&self) -> &'static str {
        match self {
            ClaimOutcome::Normalized(_) => "normalized",
            ClaimOutcome::NoKerfConfig => "no_kerf_config",
            ClaimOutcome::Denied(_) => "denied",
            ClaimOutcome::Error(_) => "error",
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

/// Handles one AdmissionReview request body; `driver` is kerf's DRA driver name.
///
/// Reviews are routed by the request's `resource`, not by the URL path (both webhooks may
/// point at the same path): `resource.k8s.io` `resourceclaims` and `resourceclaimtemplates`
/// go to [`decide_claim`], everything else to the pod decision.
///
/// A pod review that parses is always answered `allowed: true` (the webhook only ever adds a
/// gate, it never refuses a pod), with a base64 JSONPatch when the pod needs the gate. A
/// review for anything but the CREATE of a pod, or whose pod does not decode, is allowed
/// unchanged with the reason in `status.message`. A claim review is denied (`allowed: false`,
/// `status.code` 422, `reason: Invalid`) when a kerf config is invalid, and answered with a
/// JSONPatch normalizing kerf's configs otherwise. A body that is not an
/// `admission.k8s.io/v1` AdmissionReview with a `request` gets HTTP 400 and a `Status` naming
/// the problem; the API server then applies the webhook's failure policy.
pub fn handle(body: &[u8], lookup: &impl ClaimLookup, driver: &str) -> Answer {
    let (request, mut response) = match parse(body) {
        Ok(parsed) => parsed,
        Err(answer) => return answer,
    };
    let answer = &mut response["response"];
    if let Some(resource) =
        ClaimResource::from_request(&request.resource.group, &request.resource.resource)
    {
        let outcome = review_claim(&request, resource, driver, answer);
        return Answer {
            status: 200,
            body: response.to_string().into_bytes(),
            outcome: Outcome::Claim(resource, outcome),
        };
    }
    let (outcome, patch) = review_pod(&request, lookup);
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

/// The request of an AdmissionReview body, and the review to answer it with: `allowed: true`
/// with the request's uid, to be changed by the caller.
///
/// # Errors
///
/// The HTTP 400 [`Answer`] for a body that is not an `admission.k8s.io/v1` AdmissionReview
/// with a `request`.
pub(crate) fn parse(body: &[u8]) -> Result<(AdmissionRequest<DynamicObject>, Value), Answer> {
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(e) => return Err(bad_request(format!("not an AdmissionReview: {e}"))),
    };
    if review.types.api_version != "admission.k8s.io/v1" || review.types.kind != "AdmissionReview" {
        return Err(bad_request(format!(
            "expected admission.k8s.io/v1 AdmissionReview, got {}/{}",
            review.types.api_version, review.types.kind
        )));
    }
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return Err(bad_request(format!("AdmissionReview without request: {e}"))),
    };
    let mut response = serde_json::to_value(AdmissionResponse::from(&request).into_review())
        .unwrap_or_else(|_| json!({}));
    let answer = &mut response["response"];
    answer["uid"] = json!(request.uid);
    answer["allowed"] = json!(true);
    Ok((request, response))
}

/// Decides for a claim or template and writes the decision into `answer` (the review's
/// `response`, already `allowed: true` with the request's uid).
fn review_claim(
    request: &AdmissionRequest<DynamicObject>,
    resource: ClaimResource,
    driver: &str,
    answer: &mut Value,
) -> ClaimOutcome {
    // UPDATE needs no review: kube-apiserver refuses any change of a claim's spec.
    if request.operation != Operation::Create || request.sub_resource.is_some() {
        let message = format!(
            "kerf's claim webhook handles the CREATE of {}, not {:?}",
            resource.label(),
            request.operation
        );
        answer["status"] = json!({"message": message});
        return ClaimOutcome::Error(message);
    }
    let object = request
        .object
        .as_ref()
        .ok_or_else(|| "request without object".to_owned())
        .and_then(|o| serde_json::to_value(o).map_err(|e| e.to_string()));
    let object = match object {
        Ok(object) => object,
        Err(e) => {
            let message = format!("cannot read the {}: {e}", resource.kind());
            answer["status"] = json!({"message": message});
            return ClaimOutcome::Error(message);
        }
    };
    match decide_claim(&object, resource, driver) {
        ClaimDecision::Normalize { patch, configs } => {
            answer["patchType"] = json!("JSONPatch");
            answer["patch"] = json!(STANDARD.encode(patch));
            ClaimOutcome::Normalized(configs)
        }
        ClaimDecision::NoKerfConfig => ClaimOutcome::NoKerfConfig,
        ClaimDecision::Invalid { field, message } => {
            let text = format!("{field}: {message}");
            answer["allowed"] = json!(false);
            // The shape of kube-apiserver's own validation errors (a 422 `Invalid` with a
            // `FieldValueInvalid` cause), which ToStatusErr passes on with the webhook's name
            // in front of the message.
            answer["status"] = json!({
                "status": "Failure",
                "code": 422,
                "reason": "Invalid",
                "message": text,
                "details": {
                    "name": request.name,
                    "group": "resource.k8s.io",
                    "kind": resource.kind(),
                    "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
                },
            });
            ClaimOutcome::Denied(text)
        }
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
