//! Log set-up for kerf's binaries: stderr, text or JSON, with an EnvFilter.

use tracing_subscriber::EnvFilter;

/// `--log-format` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// The filter does not parse.
    #[error("--log-filter {filter:?}: {source}")]
    Filter {
        /// The filter as given.
        filter: String,
        /// The parser's error.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber is already installed.
    #[error("installing the log subscriber: {0}")]
    Install(String),
}

/// Installs the global tracing subscriber writing to stderr.
///
/// # Errors
/// The filter does not parse, or a subscriber is already installed.
pub fn init(format: LogFormat, filter: &str) -> Result<(), LoggingError> {
    let env_filter = EnvFilter::try_new(filter).map_err(|source| LoggingError::Filter {
        filter: filter.to_owned(),
        source,
    })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| LoggingError::Install(e.to_string()))
}
