//! The parts of a claim request beyond `exactly` with a count: `firstAvailable` subrequests,
//! tolerations and admin access, and what the allocation result copies of them.
//!
//! Upstream (kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go`):
//! - `Allocate` writes each result's `tolerations` from its (sub)request and `adminAccess: true`
//!   for an admin-access request; a subrequest never has admin access
//!   (`deviceSubRequestAccessor.adminAccess`).
//! - A claim config applies to a subrequest's devices when its `requests` is empty, names the
//!   parent request, or names `parent/sub` of the chosen subrequest.
//! - Admin access is allowed only in namespaces labelled
//!   `resource.kubernetes.io/admin-access: "true"`; kube-apiserver enforces that when the claim
//!   is created (`pkg/registry/resource/utils.go`, `AuthorizedForAdmin`, called from the
//!   ResourceClaim strategy's validation), so the allocator does not check it and neither does
//!   kerf's controller.

use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceRequest as ApiDeviceRequest, DeviceSubRequest, DeviceToleration,
    ExactDeviceRequest, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kerf_core::alloc::{self, ClaimPlacement, DeviceRequest, MAX_SUBREQUESTS};

use crate::claim::parent_request;
use crate::error::{Error, Result};
use crate::params::join;

/// A subrequest as the `exactly` request it stands for (subrequests have no admin access).
pub(crate) fn as_exact(sub: &DeviceSubRequest) -> ExactDeviceRequest {
    ExactDeviceRequest {
        admin_access: None,
        allocation_mode: sub.allocation_mode.clone(),
        capacity: sub.capacity.clone(),
        count: sub.count,
        device_class_name: sub.device_class_name.clone(),
        selectors: sub.selectors.clone(),
        tolerations: sub.tolerations.clone(),
    }
}

/// The request's `firstAvailable` list, checked: 1 to [`MAX_SUBREQUESTS`] subrequests with
/// distinct names; `at` is the request's path.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming `firstAvailable` for an empty or too long list, or
/// `firstAvailable[j].name` for an empty or repeated name.
pub(super) fn subrequests<'r>(
    request: &'r ApiDeviceRequest,
    at: &str,
) -> Result<&'r [DeviceSubRequest]> {
    let field = join(at, "firstAvailable");
    let subs = request.first_available.as_deref().unwrap_or_default();
    if subs.is_empty() || subs.len() > MAX_SUBREQUESTS {
        return Err(Error::config(
            field,
            format!(
                "{} subrequests; a prioritized list holds 1 to {MAX_SUBREQUESTS}",
                subs.len()
            ),
        ));
    }
    for (j, sub) in subs.iter().enumerate() {
        if sub.name.is_empty() || subs[..j].iter().any(|s| s.name == sub.name) {
            return Err(Error::config(
                format!("{field}[{j}].name"),
                format!("{:?} must be set and unique within the request", sub.name),
            ));
        }
    }
    Ok(subs)
}

/// A request of `subrequests` for the allocator: the first subrequest's fields (unused) with
/// every subrequest, named `parent/sub`, as alternatives.
pub(super) fn parent(name: &str, resolved: Vec<DeviceRequest>) -> DeviceRequest {
    let mut parent = resolved
        .first()
        .cloned()
        .unwrap_or_else(|| DeviceRequest::whole(name, 1));
    name.clone_into(&mut parent.name);
    parent.first_available = resolved;
    parent
}

/// The tolerations of a request in the allocator's terms; `at` is the request's path.
///
/// # Errors
///
/// [`Error::InvalidConfig`] naming `tolerations[k].operator` or `tolerations[k].effect` for a
/// value the API does not define.
pub(super) fn tolerations(
    tolerations: Option<&[DeviceToleration]>,
    at: &str,
) -> Result<Vec<alloc::Toleration>> {
    let mut out = Vec::new();
    for (k, toleration) in tolerations.unwrap_or_default().iter().enumerate() {
        let path = format!("{}[{k}]", join(at, "tolerations"));
        let operator = match toleration.operator.as_deref() {
            None | Some("" | "Equal") => alloc::TolerationOperator::Equal,
            Some("Exists") => alloc::TolerationOperator::Exists,
            Some(other) => {
                return Err(Error::config(
                    join(&path, "operator"),
                    format!("{other:?} is not a toleration operator; expected Equal or Exists"),
                ));
            }
        };
        let effect = match toleration.effect.as_deref() {
            None | Some("") => None,
            Some(effect) => Some(
                effect
                    .parse()
                    .map_err(|reason: String| Error::config(join(&path, "effect"), reason))?,
            ),
        };
        out.push(alloc::Toleration {
            key: toleration.key.clone().unwrap_or_default(),
            operator,
            value: toleration.value.clone().unwrap_or_default(),
            effect,
        });
    }
    Ok(out)
}

/// [`allocation_status`](super::allocation_status) of `claim`'s placement with what the
/// scheduler copies from the claim into each result: the (sub)request's `tolerations`, and
/// `adminAccess: true` for an admin-access request.
///
/// # Errors
///
/// As [`allocation_status`](super::allocation_status).
pub fn claim_allocation_status(
    claim: &ResourceClaim,
    placement_for_claim: &ClaimPlacement,
    node: &str,
    driver: &str,
    now: Time,
) -> Result<AllocationResult> {
    let mut allocation = super::status::allocation_status(placement_for_claim, node, driver, now)?;
    let requests = crate::claim::claim_requests(claim);
    let results = allocation
        .devices
        .as_mut()
        .and_then(|d| d.results.as_mut())
        .into_iter()
        .flatten();
    for result in results {
        let name = result.request.as_str();
        let Some(request) = requests.iter().find(|r| r.name == parent_request(name)) else {
            continue;
        };
        if name == request.name {
            let exactly = request.exactly.as_ref();
            result.tolerations = exactly.and_then(|e| e.tolerations.clone());
            result.admin_access = exactly.and_then(|e| e.admin_access).filter(|admin| *admin);
        } else {
            let sub = name.split_once('/').map(|(_, sub)| sub);
            result.tolerations = request
                .first_available
                .iter()
                .flatten()
                .find(|s| Some(s.name.as_str()) == sub)
                .and_then(|s| s.tolerations.clone());
        }
    }
    Ok(allocation)
}
