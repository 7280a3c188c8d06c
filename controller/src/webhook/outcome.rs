//! What an admission review decides, one type per kind of review ([`PodDecision`],
//! [`ClaimDecision`], [`QuotaDecision`]), how a review of any kind ended ([`Outcome`]) and the
//! HTTP answer that carries it ([`Answer`]). A leaf below the reviews (`review.rs`,
//! `claims.rs`, `decide.rs`, `quota.rs`) and the server that counts them.

use serde_json::Value;

/// How one review ended, for metrics and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A pod was reviewed.
    Pod(PodDecision),
    /// A ResourceClaim or ResourceClaimTemplate was reviewed.
    Claim(ClaimResource, ClaimDecision),
    /// A ResourceClaim was checked against its namespace's GpuQuotas.
    Quota(QuotaDecision),
    /// The request was not one the webhook reviews (not a CREATE, no object): admitted
    /// unchanged, with the reason.
    NotHandled(Review, String),
    /// The body was not an AdmissionReview: HTTP 400.
    BadRequest(String),
}

/// The kind of review a request was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Review {
    /// The pod webhook (`/mutate`, not a claim resource).
    Pod,
    /// The claim webhook, for this resource.
    Claim(ClaimResource),
    /// The quota webhook (`/quota`).
    Quota,
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

/// Why a pod is admitted without the gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The pod already names a node: the API server refuses scheduling gates on bound pods.
    Bound,
    /// The pod already carries the gate.
    AlreadyGated,
    /// No claim of the pod is a Controller-class claim.
    NoControllerClaim,
    /// The pod refers to a claim or template the caches do not know (yet), and none of its
    /// known claims is a controller claim. Treated like a webhook failure under
    /// `failurePolicy: Ignore`: the pod is admitted as it would be without the webhook.
    Unknown {
        /// `ResourceClaim <ns>/<name>` or `ResourceClaimTemplate <ns>/<name>`.
        what: String,
    },
}

/// The webhook's decision for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodDecision {
    /// Add [`SCHEDULING_GATE`](kerf_api::controller_claims::SCHEDULING_GATE) with this JSONPatch (RFC 6902) document.
    Gate(Value),
    /// Admit unchanged.
    Skip(Skip),
}

impl PodDecision {
    /// The metric label: `gated` or `not_gated`.
    pub fn label(&self) -> &'static str {
        match self {
            PodDecision::Gate(_) => "gated",
            PodDecision::Skip(_) => "not_gated",
        }
    }
}

/// The resources the claim webhook handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClaimResource {
    /// `resourceclaims`: the configs are at `spec.devices.config`.
    Claim,
    /// `resourceclaimtemplates`: the configs are at `spec.spec.devices.config`.
    Template,
}

impl ClaimResource {
    /// The resource of an admission request (`group`, `resource`), when it is one of these.
    pub fn from_request(group: &str, resource: &str) -> Option<Self> {
        match (group, resource) {
            ("resource.k8s.io", "resourceclaims") => Some(ClaimResource::Claim),
            ("resource.k8s.io", "resourceclaimtemplates") => Some(ClaimResource::Template),
            _ => None,
        }
    }

    /// The resource's name, also the metric label.
    pub fn label(self) -> &'static str {
        match self {
            ClaimResource::Claim => "resourceclaims",
            ClaimResource::Template => "resourceclaimtemplates",
        }
    }

    /// The kind, for messages.
    pub fn kind(self) -> &'static str {
        match self {
            ClaimResource::Claim => "ResourceClaim",
            ClaimResource::Template => "ResourceClaimTemplate",
        }
    }

    /// The JSON pointer to the config list.
    pub(super) fn config_pointer(self) -> &'static str {
        match self {
            ClaimResource::Claim => "/spec/devices/config",
            ClaimResource::Template => "/spec/spec/devices/config",
        }
    }

    /// The field path of the config list, as in API errors and kerf's Events.
    pub(super) fn config_field(self) -> &'static str {
        match self {
            ClaimResource::Claim => "spec.devices.config",
            ClaimResource::Template => "spec.spec.devices.config",
        }
    }
}

/// The webhook's decision for one claim or template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Every kerf config is valid; this JSONPatch (RFC 6902, as JSON text) replaces each one's
    /// `parameters` with its canonical bytes.
    Normalize {
        /// The patch document.
        patch: String,
        /// How many configs it rewrites.
        configs: usize,
    },
    /// The object has no config for kerf's driver: admitted unchanged.
    NoKerfConfig,
    /// A kerf config is invalid: the request is denied, naming the field and the value.
    Invalid {
        /// The field at fault, e.g. `spec.devices.config[0].opaque.parameters.compute`.
        field: String,
        /// What is wrong with it, naming the value.
        message: String,
    },
}

impl ClaimDecision {
    /// The metric label: `normalized`, `no_kerf_config` or `denied`.
    pub fn label(&self) -> &'static str {
        match self {
            ClaimDecision::Normalize { .. } => "normalized",
            ClaimDecision::NoKerfConfig => "no_kerf_config",
            ClaimDecision::Invalid { .. } => "denied",
        }
    }
}

/// The quota webhook's decision for one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaDecision {
    /// Admitted and charged to this many quotas.
    Charged(usize),
    /// Admitted without a write: no quota in the namespace, a charge of zero, a dry run.
    NotCharged,
    /// Refused: over a quota, not chargeable, or the quota could not be written.
    Denied(String),
}

impl QuotaDecision {
    /// The metric label: `charged`, `not_charged` or `denied`.
    pub fn label(&self) -> &'static str {
        match self {
            QuotaDecision::Charged(_) => "charged",
            QuotaDecision::NotCharged => "not_charged",
            QuotaDecision::Denied(_) => "denied",
        }
    }
}
