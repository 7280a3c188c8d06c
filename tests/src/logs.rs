//! What code under test logged: a tracing subscriber for the current thread that keeps every
//! formatted line, so tests can check that a condition is logged once and not in a loop.
//!
//! A `#[tokio::test]` runs on a current-thread runtime, so tasks the code spawns log on the
//! test's thread and are captured too.

use std::io::Write;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::Level;
use tracing::subscriber::DefaultGuard;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Log lines written on this thread while a [`CapturedLogs::capture`] guard lives.
#[derive(Clone, Default)]
pub struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl CapturedLogs {
    /// Captures events at `level` and above (level names included in each line, without
    /// colours) until the returned guard is dropped.
    #[must_use]
    pub fn capture(&self, level: Level) -> DefaultGuard {
        let logs = self.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || logs.clone())
            .finish()
            .set_default()
    }

    /// Every captured line that contains `text`.
    pub fn lines_containing(&self, text: &str) -> Vec<String> {
        let bytes = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }

    /// How many captured lines contain `text`.
    pub fn count(&self, text: &str) -> usize {
        self.lines_containing(text).len()
    }
}

impl Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
