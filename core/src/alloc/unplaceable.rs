//! Why a pod's claims could not be placed, in words for Events and conditions and as a label
//! for metrics.

use std::fmt;

/// What kept a pod's claims from being placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnplaceableReason {
    /// No candidate node has GPUs of this driver (or there were no candidates).
    NoCandidateNodes,
    /// A request that cannot be satisfied anywhere: zero count, compute over 100 %, …
    InvalidRequest,
    /// Too few GPUs match the request's selector.
    Selector,
    /// GPUs that match are held by other claims (whole, or partly for a whole-GPU request).
    InUse,
    /// GPUs that match already carry the most slices allowed.
    MaxSlices,
    /// GPUs that match carry slices of the other sharing strategy (MPS and time-slicing never
    /// share a GPU).
    SharingConflict,
    /// GPUs that match have too little free memory.
    InsufficientMemory,
    /// GPUs that match have too little free compute.
    InsufficientCompute,
    /// Enough GPUs fit, but not in one NVLink domain / behind one PCIe root.
    Topology,
    /// GPUs that match carry a `NoSchedule` or `NoExecute` taint the request does not
    /// tolerate.
    Tainted,
}

impl UnplaceableReason {
    /// A short, stable, low-cardinality label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            UnplaceableReason::NoCandidateNodes => "no_candidate_nodes",
            UnplaceableReason::InvalidRequest => "invalid_request",
            UnplaceableReason::Selector => "selector",
            UnplaceableReason::InUse => "in_use",
            UnplaceableReason::MaxSlices => "max_slices",
            UnplaceableReason::SharingConflict => "sharing_conflict",
            UnplaceableReason::InsufficientMemory => "insufficient_memory",
            UnplaceableReason::InsufficientCompute => "insufficient_compute",
            UnplaceableReason::Topology => "topology",
            UnplaceableReason::Tainted => "tainted",
        }
    }
}

/// The node that came closest to fitting the request that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BestCandidate {
    /// Node name.
    pub node: String,
    /// How many GPUs of the failing request it could offer (matching the selector, with
    /// enough free capacity, or in one topology group, depending on the reason).
    pub found: u32,
}

/// Why [`place`](super::place) found no node, as a sentence such as
/// `request "gpu": no node has 2 GPUs with 20Gi memory free on one NVLink domain; best:
/// node-3 has 1` and a [`reason`](Unplaceable::reason) label.
///
/// The sentence names the request but not the claim, whose key is a UID; a caller that
/// reports it on a pod with several claims finds the claim through [`Unplaceable::claim`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unplaceable {
    kind: UnplaceableReason,
    claim: Option<String>,
    request: Option<String>,
    needed: u32,
    best: Option<BestCandidate>,
    message: String,
}

impl Unplaceable {
    pub(super) fn new(kind: UnplaceableReason, message: String) -> Self {
        Unplaceable {
            kind,
            claim: None,
            request: None,
            needed: 0,
            best: None,
            message,
        }
    }

    pub(super) fn for_request(mut self, claim: &str, request: &str, needed: u32) -> Self {
        self.claim = Some(claim.to_owned());
        self.request = Some(request.to_owned());
        self.needed = needed;
        self
    }

    /// The same diagnosis explained by `message` instead.
    pub(super) fn with_message(mut self, message: String) -> Self {
        self.message = message;
        self
    }

    pub(super) fn with_best(mut self, best: BestCandidate) -> Self {
        self.best = Some(best);
        self
    }

    /// A short, stable label for metrics, e.g. `insufficient_memory`.
    pub fn reason(&self) -> &'static str {
        self.kind.label()
    }

    /// The reason as an enum.
    pub fn kind(&self) -> UnplaceableReason {
        self.kind
    }

    /// Key of the claim whose request failed, when one did.
    pub fn claim(&self) -> Option<&str> {
        self.claim.as_deref()
    }

    /// Name of the request that failed, when one did.
    pub fn request(&self) -> Option<&str> {
        self.request.as_deref()
    }

    /// How many GPUs the failing request needs (0 when no request failed).
    pub fn needed(&self) -> u32 {
        self.needed
    }

    /// The node that came closest, when any candidate was known.
    pub fn best(&self) -> Option<&BestCandidate> {
        self.best.as_ref()
    }

    /// The explanation in words (the same as `Display`).
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Unplaceable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Unplaceable {}
