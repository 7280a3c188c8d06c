//! How soon kerf's watches retry after the API server stopped answering.
//!
//! kube-runtime's `WatchStreamExt::default_backoff` waits 800 ms, doubling up to 30 s, and
//! forgets the delay only after a success (kube-runtime 5.0 `watcher.rs` `DefaultBackoff`;
//! `utils/stream_backoff.rs` `StreamBackoff::poll_next` resets it when an item arrives). After
//! an outage of half a minute that leaves kerf's caches up to 30 s behind a server that is
//! back, while claims wait (controller) or slices stay stale (plugin). [`WatchBackoff`] doubles from 250 ms up to 5 s instead: a
//! watch re-lists within 5 s of the server's return, and a down server still gets at most one
//! re-list per watch every 5 s.

use std::time::Duration;

use kube::runtime::utils::Backoff;

/// First delay after a failed watch or list.
const FIRST_DELAY: Duration = Duration::from_millis(250);
/// Longest delay between two attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(5);

/// Capped exponential back-off for watches: `FIRST_DELAY`, doubling, at most
/// [`MAX_DELAY`]; `reset` (after a success) starts again at `FIRST_DELAY`.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: FIRST_DELAY }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(MAX_DELAY);
        Some(delay)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = FIRST_DELAY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_five_seconds_and_starts_again_after_a_success() {
        let mut backoff = WatchBackoff::default();
        let delays: Vec<Duration> = backoff.by_ref().take(7).collect();
        assert_eq!(
            delays,
            [250, 500, 1000, 2000, 4000, 5000, 5000].map(Duration::from_millis)
        );
        backoff.reset();
        assert_eq!(backoff.next(), Some(FIRST_DELAY));
    }
}
