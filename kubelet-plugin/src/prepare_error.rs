//! Why a claim cannot be prepared.
//!
//! These errors stay typed through the preparer; only the gRPC layer turns them into the
//! per-claim error string the kubelet shows on the pod, so every message names the field and
//! the value at fault.

/// A claim the kubelet asked to prepare that this node cannot prepare as asked.
///
/// Retrying the same prepare gives the same answer until the claim, its allocation or the
/// claims prepared on this node change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrepareError {
    /// The claim's UID is already prepared on this node, for a claim of another name.
    #[error(
        "claim.uid: {uid} is prepared for ResourceClaim {prepared_namespace}/{prepared_name}, not {namespace}/{name}"
    )]
    PreparedUnderOtherName {
        /// The UID the kubelet sent.
        uid: String,
        /// Namespace of the claim prepared under that UID.
        prepared_namespace: String,
        /// Name of the claim prepared under that UID.
        prepared_name: String,
        /// Namespace the kubelet sent.
        namespace: String,
        /// Name the kubelet sent.
        name: String,
    },
    /// The API server has no claim of that namespace and name.
    #[error("ResourceClaim {namespace}/{name} not found")]
    ClaimNotFound {
        /// Namespace of the claim.
        namespace: String,
        /// Name of the claim.
        name: String,
    },
    /// The claim of that name has another UID: it was deleted and created again since the
    /// kubelet read it.
    #[error(
        "claim.uid: ResourceClaim {namespace}/{name} has UID {actual:?}, not {expected:?} (it was deleted and created again)"
    )]
    UidMismatch {
        /// Namespace of the claim.
        namespace: String,
        /// Name of the claim.
        name: String,
        /// The UID of the claim the API server holds.
        actual: String,
        /// The UID the kubelet sent.
        expected: String,
    },
    /// The claim's allocation cannot be resolved for this driver: it is not allocated, has no
    /// result for this driver, or carries an opaque configuration that does not decode or
    /// breaks a rule (the message names the field and the value).
    #[error(transparent)]
    Allocation(kerf_api::Error),
    /// An allocation result is in another node's pool: the claim is allocated to another node.
    #[error(
        "status.allocation.devices.results[{index}].pool: {pool:?} is not this node's pool {node:?}"
    )]
    OtherNodePool {
        /// Index of the result in `status.allocation.devices.results`.
        index: usize,
        /// The pool of the result.
        pool: String,
        /// This node's name, the pool of its devices.
        node: String,
    },
    /// An allocation result names a device this node does not have.
    #[error(
        "status.allocation.devices.results[{index}].device: {device:?} is not a device of node {node:?}"
    )]
    UnknownDevice {
        /// Index of the result in `status.allocation.devices.results`.
        index: usize,
        /// The device of the result.
        device: String,
        /// This node's name.
        node: String,
    },
    /// A GpuSliceAllocation config places a device on a GPU other than the one it is on this
    /// node, e.g. after the GPUs were renumbered.
    #[error(
        "status.allocation.devices.config: GpuSliceAllocation places device {device:?} on GPU {expected}, but on node {node:?} that device is GPU {actual}"
    )]
    GpuMismatch {
        /// The device the config names.
        device: String,
        /// The GPU UUID the config expects.
        expected: String,
        /// This node's name.
        node: String,
        /// The UUID of the device's GPU on this node.
        actual: String,
    },
    /// A device of the claim is held by another prepared claim, and one of the two holds it
    /// exclusively.
    #[error(
        "device {device:?} is held exclusively by prepared claim {holder_namespace}/{holder_name} (uid {holder_uid})"
    )]
    DeviceHeld {
        /// The contested device.
        device: String,
        /// UID of the prepared claim holding it.
        holder_uid: String,
        /// Namespace of the prepared claim holding it.
        holder_namespace: String,
        /// Name of the prepared claim holding it.
        holder_name: String,
    },
}

impl PrepareError {
    /// A short, stable, low-cardinality label for metrics: `claim` for what the plugin itself
    /// checks, kerf-api's own label for an allocation that does not resolve.
    pub fn reason(&self) -> &'static str {
        match self {
            PrepareError::Allocation(e) => e.reason(),
            PrepareError::PreparedUnderOtherName { .. }
            | PrepareError::ClaimNotFound { .. }
            | PrepareError::UidMismatch { .. }
            | PrepareError::OtherNodePool { .. }
            | PrepareError::UnknownDevice { .. }
            | PrepareError::GpuMismatch { .. }
            | PrepareError::DeviceHeld { .. } => "claim",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_and_value_at_fault() {
        let held = PrepareError::DeviceHeld {
            device: "gpu-0".into(),
            holder_uid: "u1".into(),
            holder_namespace: "ns".into(),
            holder_name: "other".into(),
        };
        assert_eq!(
            held.to_string(),
            r#"device "gpu-0" is held exclusively by prepared claim ns/other (uid u1)"#
        );
        assert_eq!(held.reason(), "claim");
        let pool = PrepareError::OtherNodePool {
            index: 1,
            pool: "node-b".into(),
            node: "node-a".into(),
        };
        assert_eq!(
            pool.to_string(),
            r#"status.allocation.devices.results[1].pool: "node-b" is not this node's pool "node-a""#
        );
    }

    #[test]
    fn an_unresolvable_allocation_keeps_kerf_api_message_and_label() {
        let inner = kerf_api::Error::NotAllocated {
            claim: "ns/c".into(),
        };
        let message = inner.to_string();
        let error = PrepareError::Allocation(inner);
        assert_eq!(error.to_string(), message);
        assert_eq!(error.reason(), "claim_not_allocated");
    }
}
