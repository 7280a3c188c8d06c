//! Waiting in tests for something that happens in the background: the one polling loop of the
//! workspace's tests.

use std::future::Future;
use std::time::Duration;

/// How often [`eventually`] checks again.
const POLL: Duration = Duration::from_millis(20);

/// Polls `check` until it returns `Some` and returns that value; fails the test (panics,
/// naming `what`) once `timeout` has passed.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a condition that needs no `await`: polls `condition` until it holds.
pub async fn until(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    eventually(what, timeout, || {
        std::future::ready(condition().then_some(()))
    })
    .await;
}
