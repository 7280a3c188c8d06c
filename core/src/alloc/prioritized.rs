//! Requests with `firstAvailable` subrequests: the pod is placed with the first combination of
//! subrequests that fits.
//!
//! kube-scheduler's allocator (kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go`,
//! `allocateOne`) walks a pod's claims and their requests in order and, for a request with
//! subrequests, tries each subrequest in order, backtracking into the next one when the rest of
//! the pod cannot be allocated with it: on one node, the first combination in that order that
//! fits wins, the first request's choice changing slowest. kerf's controller picks the node
//! itself, so it tries the combinations in the same order over all candidates and takes the
//! first one that fits anywhere: no node gets a less preferred subrequest while some node
//! fits a preferred one.

use super::model::PodPlacement;
use super::request::{ClaimRequest, DeviceRequest, MAX_SUBREQUESTS, PodRequest};
use super::unplaceable::{Unplaceable, UnplaceableReason};

/// Most combinations of subrequests tried for one pod; a pod with more (e.g. four requests of
/// eight subrequests each) is an invalid request rather than seconds of placement.
pub(super) const MAX_COMBINATIONS: usize = 256;

/// Runs `place` on `pod` when no request has subrequests, else on each combination of
/// subrequests in order until one fits.
pub(super) fn place_first_available(
    pod: &PodRequest,
    mut place: impl FnMut(&PodRequest) -> Result<PodPlacement, Unplaceable>,
) -> Result<PodPlacement, Unplaceable> {
    let choices: Vec<usize> = pod
        .claims
        .iter()
        .flat_map(|claim| &claim.requests)
        .filter(|req| !req.first_available.is_empty())
        .map(|req| req.first_available.len())
        .collect();
    if choices.is_empty() {
        return place(pod);
    }
    check(pod, &choices)?;
    let mut chosen = vec![0usize; choices.len()];
    let mut failures: Vec<Unplaceable> = Vec::new();
    loop {
        let concrete = combination(pod, &chosen);
        match place(&concrete) {
            Ok(placement) => return Ok(placement),
            Err(err) => failures.push(err),
        }
        if !advance(&mut chosen, &choices) {
            break;
        }
    }
    Err(explain(failures))
}

fn check(pod: &PodRequest, choices: &[usize]) -> Result<(), Unplaceable> {
    for claim in &pod.claims {
        if let Some(req) = claim
            .requests
            .iter()
            .find(|r| r.first_available.len() > MAX_SUBREQUESTS)
        {
            return Err(Unplaceable::new(
                UnplaceableReason::InvalidRequest,
                format!(
                    "request {:?}: {} subrequests; at most {MAX_SUBREQUESTS}",
                    req.name,
                    req.first_available.len()
                ),
            )
            .for_request(&claim.key, &req.name, req.count));
        }
    }
    let combinations = choices
        .iter()
        .try_fold(1usize, |product, &n| product.checked_mul(n))
        .filter(|&n| n <= MAX_COMBINATIONS);
    if combinations.is_none() {
        return Err(Unplaceable::new(
            UnplaceableReason::InvalidRequest,
            format!(
                "the pod's firstAvailable requests make more than {MAX_COMBINATIONS} combinations of subrequests"
            ),
        ));
    }
    Ok(())
}

/// Next combination, the last request's choice changing fastest; false after the last one.
fn advance(chosen: &mut [usize], choices: &[usize]) -> bool {
    for (at, choice) in chosen.iter_mut().enumerate().rev() {
        *choice += 1;
        if *choice < choices[at] {
            return true;
        }
        *choice = 0;
    }
    false
}

/// The pod with every request that has subrequests replaced by its chosen one.
fn combination(pod: &PodRequest, chosen: &[usize]) -> PodRequest {
    let mut next = chosen.iter();
    let claims = pod
        .claims
        .iter()
        .map(|claim| ClaimRequest {
            key: claim.key.clone(),
            requests: claim
                .requests
                .iter()
                .map(|req| pick(req, &mut next))
                .collect(),
        })
        .collect();
    PodRequest { claims }
}

fn pick<'a>(req: &DeviceRequest, next: &mut impl Iterator<Item = &'a usize>) -> DeviceRequest {
    if req.first_available.is_empty() {
        return req.clone();
    }
    let at = next.next().copied().unwrap_or(0);
    req.first_available
        .get(at)
        .cloned()
        .unwrap_or_else(|| req.clone())
}

/// One diagnosis naming why each combination failed, with the last one's reason and request.
fn explain(failures: Vec<Unplaceable>) -> Unplaceable {
    let mut messages: Vec<String> = Vec::new();
    for failure in &failures {
        let message = failure.message().to_owned();
        if !messages.contains(&message) {
            messages.push(message);
        }
    }
    let text = format!(
        "no subrequest of the pod's firstAvailable requests fits: {}",
        messages.join("; else ")
    );
    match failures.into_iter().last() {
        Some(last) => last.with_message(text),
        None => Unplaceable::new(UnplaceableReason::InvalidRequest, text),
    }
}
