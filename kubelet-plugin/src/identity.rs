//! Names every part of the plugin uses and none owns: which program writes (the field
//! manager) and which claim a call is about ([`ClaimRef`]). A leaf: it uses no other module of
//! the plugin, so the preparer, the status writer, the Event reporter and the publisher all
//! depend on it rather than on each other.

use kerf_core::checkpoint::ClaimEntry;

/// The kubelet plugin's field manager: every write it makes names it (slices, claim status,
/// Events, probes), so `managedFields` says which program wrote what.
pub const FIELD_MANAGER: &str = "kerf-kubelet-plugin";

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// Namespace of the ResourceClaim.
    pub namespace: String,
    /// UID of the ResourceClaim; the key of every answer.
    pub uid: String,
    /// Name of the ResourceClaim.
    pub name: String,
}

impl ClaimRef {
    /// The claim of a checkpoint entry, keyed by `uid`.
    pub(crate) fn of_entry(uid: &str, entry: &ClaimEntry) -> Self {
        ClaimRef {
            namespace: entry.namespace.clone(),
            uid: uid.to_owned(),
            name: entry.name.clone(),
        }
    }
}
