//! The one error type of kerf-api.

/// Everything that can go wrong decoding or building kerf's Kubernetes objects.
///
/// Messages name the field (as a path into the object it came from) and the offending value,
/// because they end up in per-claim errors and Events that users read. Each variant has a
/// stable [`Error::reason`] used as a metric label.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An opaque configuration object that does not decode or breaks a rule of its kind.
    #[error("{path}: {message}")]
    InvalidConfig {
        /// Where in the enclosing object the bad value is, e.g.
        /// `spec.devices.config[1].opaque.parameters.compute`.
        path: String,
        /// What is wrong, naming the value.
        message: String,
    },
    /// A Kubernetes quantity that is not a valid, positive, whole number of bytes.
    #[error("{value:?} is not a valid byte quantity: {reason}")]
    InvalidQuantity {
        /// The quantity as written.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A ResourceClaim without `status.allocation`.
    #[error("ResourceClaim {claim} is not allocated (status.allocation is not set)")]
    NotAllocated {
        /// `namespace/name` of the claim.
        claim: String,
    },
    /// An allocated ResourceClaim that has no result for this driver.
    #[error(
        "ResourceClaim {claim} has no allocation results for driver {driver:?}; drivers in status.allocation.devices.results: {present}"
    )]
    NoResultsForDriver {
        /// `namespace/name` of the claim.
        claim: String,
        /// This driver's name.
        driver: String,
        /// Comma-separated drivers that do have results, or `none`.
        present: String,
    },
    /// An allocation result or config entry that is malformed (not an opaque-parameter problem).
    #[error("ResourceClaim {claim}: {path}: {message}")]
    InvalidAllocation {
        /// `namespace/name` of the claim.
        claim: String,
        /// The field at fault.
        path: String,
        /// What is wrong, naming the value.
        message: String,
    },
    /// A ResourceSlice that the API server would reject, or an inventory that cannot be published.
    #[error("cannot publish ResourceSlices: {path}: {message}")]
    InvalidResourceSlice {
        /// The field at fault, e.g. `devices["gpu-0"].attributes["productName"]`.
        path: String,
        /// What limit or rule is broken, naming the value.
        message: String,
    },
    /// Serialising a generated object (CRD YAML, opaque parameters) failed.
    #[error("serialising {what}: {message}")]
    Serialize {
        /// What was being serialised.
        what: &'static str,
        /// The serialiser's message.
        message: String,
    },
}

impl Error {
    /// A short, stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::InvalidConfig { .. } => "invalid_config",
            Error::InvalidQuantity { .. } => "invalid_quantity",
            Error::NotAllocated { .. } => "claim_not_allocated",
            Error::NoResultsForDriver { .. } => "no_results_for_driver",
            Error::InvalidAllocation { .. } => "invalid_allocation",
            Error::InvalidResourceSlice { .. } => "invalid_resource_slice",
            Error::Serialize { .. } => "serialize",
        }
    }

    /// Builds an [`Error::InvalidConfig`] for the field at `path`.
    pub fn config(path: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidConfig {
            path: path.into(),
            message: message.into(),
        }
    }

    /// Builds an [`Error::InvalidResourceSlice`] for the field at `path`.
    pub fn slice(path: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidResourceSlice {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Result alias for kerf-api.
pub type Result<T, E = Error> = std::result::Result<T, E>;
