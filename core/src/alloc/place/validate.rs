//! Requests the allocator refuses before looking at any node.

use super::super::request::DeviceRequest;
use super::super::unplaceable::{Unplaceable, UnplaceableReason};
use super::MAX_DEVICES_PER_REQUEST;

fn invalid(claim: &str, req: &DeviceRequest, what: &str) -> Unplaceable {
    Unplaceable::new(
        UnplaceableReason::InvalidRequest,
        format!("request {:?}: {what}", req.name),
    )
    .for_request(claim, &req.name, req.count)
}

pub(super) fn validate(claim: &str, req: &DeviceRequest) -> Result<(), Unplaceable> {
    if !req.first_available.is_empty() {
        // place_first_available replaces every such request by one of its subrequests.
        return Err(invalid(claim, req, "subrequests cannot have subrequests"));
    }
    if req.admin_access && req.slice.is_some() {
        return Err(invalid(
            claim,
            req,
            "admin access takes whole GPUs, not slices",
        ));
    }
    if req.count == 0 {
        return Err(invalid(claim, req, "count must be at least 1"));
    }
    if req.count > MAX_DEVICES_PER_REQUEST {
        return Err(invalid(
            claim,
            req,
            &format!("count {} is more than {MAX_DEVICES_PER_REQUEST}", req.count),
        ));
    }
    if let Some(size) = req.slice {
        if size.compute_percent > 100 {
            return Err(invalid(
                claim,
                req,
                &format!("compute {}% is more than 100%", size.compute_percent),
            ));
        }
        if size.memory_bytes == 0 && size.compute_percent == 0 {
            return Err(invalid(
                claim,
                req,
                "a slice must reserve memory or compute",
            ));
        }
    }
    if req.max_slices_per_gpu == Some(0) {
        return Err(invalid(claim, req, "max slices per GPU must be at least 1"));
    }
    Ok(())
}
