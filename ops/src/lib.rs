//! kerf-ops: what kerf's binaries share to be operable — the `/healthz`, `/readyz` and
//! `/metrics` endpoint ([`http`]) with the readiness it reports ([`ready`]), log set-up
//! ([`logging`]), shutdown signals ([`signal`]), the counter of writes the API server would
//! not take ([`write_failures`]), the parsing of listen addresses ([`parse_listen_address`])
//! and the binaries' global allocator ([`allocator`]).

pub mod allocator;
pub mod http;
pub mod logging;
pub mod ready;
pub mod signal;
pub mod write_failures;

use std::net::SocketAddr;

/// Parses a `--metrics-address` style flag: empty disables the listener.
///
/// # Errors
/// The value is neither empty nor a socket address; the message names `flag`.
pub fn parse_listen_address(flag: &str, value: &str) -> Result<Option<SocketAddr>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    value
        .parse()
        .map(Some)
        .map_err(|e| format!("{flag} {value:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_disables_and_garbage_is_named() {
        assert_eq!(parse_listen_address("--metrics-address", ""), Ok(None));
        assert_eq!(
            parse_listen_address("--metrics-address", "127.0.0.1:9").unwrap(),
            Some("127.0.0.1:9".parse().unwrap())
        );
        let err = parse_listen_address("--metrics-address", "nope").unwrap_err();
        assert!(err.starts_with("--metrics-address \"nope\""), "{err}");
    }
}
