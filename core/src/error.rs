//! The one error type of kerf-core.

use std::path::PathBuf;

/// Everything that can go wrong in kerf's pure domain logic.
///
/// Each variant has a stable [`Error::reason`] used as a metric label.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A mock GPU profile name that kerf does not know.
    #[error("unknown mock GPU profile {name:?}; known profiles: {known}")]
    UnknownMockProfile {
        /// The name that was asked for.
        name: String,
        /// Comma-separated list of known profiles.
        known: String,
    },
    /// A `PROFILE[:COUNT]` mock specification that does not parse.
    #[error("invalid mock GPU specification {spec:?}: {reason}")]
    InvalidMockSpec {
        /// The specification as given.
        spec: String,
        /// Why it was rejected.
        reason: String,
    },
    /// An inventory (file or discovered) that breaks an invariant.
    #[error("invalid inventory: {0}")]
    InvalidInventory(String),
    /// A YAML document that does not decode.
    #[error("invalid YAML in {what}: {source}")]
    Yaml {
        /// What was being decoded.
        what: String,
        /// The decoder's error, boxed because it is large and every `Result` carries it.
        #[source]
        source: Box<serde_saphyr::Error>,
    },
    /// A name from outside the process that is unsafe or invalid where it is used.
    #[error("invalid {field} {value:?}: {reason}")]
    InvalidName {
        /// Which field held the name, e.g. `claim.uid`.
        field: &'static str,
        /// The offending value.
        value: String,
        /// What rule it breaks.
        reason: &'static str,
    },
    /// A CDI spec that breaks the CDI naming or version rules.
    #[error("invalid CDI spec: {0}")]
    InvalidCdiSpec(String),
    /// A file system operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done, e.g. `write`, `rename`.
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// JSON encoding or decoding failed.
    #[error("JSON {what}: {source}")]
    Json {
        /// What was being encoded or decoded.
        what: &'static str,
        /// The serde_json error.
        #[source]
        source: serde_json::Error,
    },
    /// A checkpoint file that cannot be used.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
}

impl Error {
    /// A short, stable, low-cardinality label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::UnknownMockProfile { .. } => "unknown_mock_profile",
            Error::InvalidMockSpec { .. } => "invalid_mock_spec",
            Error::InvalidInventory(_) => "invalid_inventory",
            Error::Yaml { .. } => "yaml",
            Error::InvalidName { .. } => "invalid_name",
            Error::InvalidCdiSpec(_) => "invalid_cdi_spec",
            Error::Io { .. } => "io",
            Error::Json { .. } => "json",
            Error::Checkpoint { .. } => "checkpoint",
        }
    }

    /// Builds an [`Error::Io`] for `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Result alias for kerf-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;
