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

use super::claims::decide_claim;
use super::decide::{ClaimLookup, decide};
use super::outcome::{Answer, ClaimDecision, ClaimResource, Outcome, PodDecision, Review};

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
    let outcome = if let Some(resource) =
        ClaimResource::from_request(&request.resource.group, &request.resource.resource)
    {
        match review_claim(&request, resource, driver, answer) {
            Ok(decision) => Outcome::Claim(resource, decision),
            Err(message) => Outcome::NotHandled(Review::Claim(resource), message),
        }
    } else {
        match review_pod(&request, lookup) {
            Ok(PodDecision::Gate(patch)) => {
                answer["patchType"] = json!("JSONPatch");
                answer["patch"] = json!(STANDARD.encode(patch.to_string()));
                Outcome::Pod(PodDecision::Gate(patch))
            }
            Ok(PodDecision::Skip(skip)) => {
                answer["status"] = json!({"message": format!("{skip:?}")});
                Outcome::Pod(PodDecision::Skip(skip))
            }
            Err(message) => {
                answer["status"] = json!({"message": message});
                Outcome::NotHandled(Review::Pod, message)
            }
        }
    };
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
/// `response`, already `allowed: true` with the request's uid); `Err` with the reason, also
/// written there, when the request is not one the webhook reviews.
fn review_claim(
    request: &AdmissionRequest<DynamicObject>,
    resource: ClaimResource,
    driver: &str,
    answer: &mut Value,
) -> Result<ClaimDecision, String> {
    // UPDATE needs no review: kube-apiserver refuses any change of a claim's spec.
    if request.operation != Operation::Create || request.sub_resource.is_some() {
        let message = format!(
            "kerf's claim webhook handles the CREATE of {}, not {:?}",
            resource.label(),
            request.operation
        );
        answer["status"] = json!({"message": message});
        return Err(message);
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
            return Err(message);
        }
    };
    let decision = decide_claim(&object, resource, driver);
    match &decision {
        ClaimDecision::Normalize { patch, .. } => {
            answer["patchType"] = json!("JSONPatch");
            answer["patch"] = json!(STANDARD.encode(patch));
        }
        ClaimDecision::NoKerfConfig => {}
        ClaimDecision::Invalid { field, message } => {
            answer["allowed"] = json!(false);
            // The shape of kube-apiserver's own validation errors (a 422 `Invalid` with a
            // `FieldValueInvalid` cause), which ToStatusErr passes on with the webhook's name
            // in front of the message.
            answer["status"] = json!({
                "status": "Failure",
                "code": 422,
                "reason": "Invalid",
                "message": format!("{field}: {message}"),
                "details": {
                    "name": request.name,
                    "group": "resource.k8s.io",
                    "kind": resource.kind(),
                    "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
                },
            });
        }
    }
    Ok(decision)
}

/// Decides for a pod; `Err` with the reason when the request is not one the webhook
/// reviews.
fn review_pod(
    request: &AdmissionRequest<DynamicObject>,
    lookup: &impl ClaimLookup,
) -> Result<PodDecision, String> {
    if request.operation != Operation::Create
        || request.kind.kind != "Pod"
        || !request.kind.group.is_empty()
        || request.sub_resource.is_some()
    {
        return Err(format!(
            "kerf's webhook handles the CREATE of pods, not {:?} of {}",
            request.operation, request.kind.kind
        ));
    }
    let pod = request
        .object
        .as_ref()
        .ok_or_else(|| "request without object".to_owned())
        .and_then(|o| serde_json::to_value(o).map_err(|e| e.to_string()))
        .and_then(|v| serde_json::from_value::<Pod>(v).map_err(|e| e.to_string()))
        .map_err(|e| format!("cannot decode the pod: {e}"))?;
    // On CREATE the namespace is the request's: the pod's metadata may omit it.
    let namespace = request
        .namespace
        .as_deref()
        .or(pod.metadata.namespace.as_deref())
        .unwrap_or("default");
    Ok(decide(&pod, namespace, lookup))
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
        outcome: Outcome::BadRequest(message),
    }
}
