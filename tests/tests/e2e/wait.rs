//! Bounded polling with a message that says what was awaited and what was last seen.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use anyhow::{Result, bail};
use tokio::time::Instant;

/// How often a condition is checked again.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// What one look at the cluster found.
#[derive(Debug)]
pub enum Poll<T> {
    /// The condition holds; here is what the caller wanted.
    Ready(T),
    /// Not yet; the words say what was seen instead (they end up in the timeout message).
    Pending(String),
}

/// Checks `probe` until it is [`Poll::Ready`] or `timeout` has passed, and returns an error
/// (never panics) when it does not get there: cluster checks report their failure through
/// `Result`. Not to be confused with `kerf_tests::wait::until`, which panics on timeout.
///
/// A probe error counts as "not yet" (API servers have hiccups) and is kept for the message;
/// use [`fail_fast`] when some states mean the condition can never hold.
pub async fn poll_until<T, F, Fut>(what: impl Display, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Poll<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match probe().await {
            Ok(Poll::Ready(value)) => return Ok(value),
            Ok(Poll::Pending(seen)) => seen,
            Err(error) => format!("the last check failed: {error:#}"),
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last seen: {seen}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Like [`poll_until`], but a probe that returns `Err(Stop)` ends the wait at once with that error:
/// for states that can never turn good (a pod that failed).
pub async fn fail_fast<T, F, Fut>(what: impl Display, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Poll<T>, Outcome>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let seen = match probe().await {
            Ok(Poll::Ready(value)) => return Ok(value),
            Ok(Poll::Pending(seen)) => seen,
            Err(Outcome::Stop(error)) => {
                return Err(error.context(format!("while waiting for {what}")));
            }
            Err(Outcome::Retry(error)) => format!("the last check failed: {error:#}"),
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last seen: {seen}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Why a [`fail_fast`] probe did not get an answer.
#[derive(Debug)]
pub enum Outcome {
    /// A transient failure (an API call); look again.
    Retry(anyhow::Error),
    /// The awaited state can no longer be reached.
    Stop(anyhow::Error),
}

impl<E: Into<anyhow::Error>> From<E> for Outcome {
    fn from(error: E) -> Self {
        Outcome::Retry(error.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A zero timeout ends every wait after its first look, so these tests never sleep.

    #[tokio::test]
    async fn a_wait_that_never_succeeds_names_what_and_the_last_state() {
        let error = poll_until("the answer", Duration::ZERO, || async {
            Ok(Poll::<()>::Pending("attempt 1".to_owned()))
        })
        .await
        .unwrap_err()
        .to_string();
        assert_eq!(
            error,
            "timed out after 0ns waiting for the answer; last seen: attempt 1"
        );
        let error = poll_until("the answer", Duration::ZERO, || async {
            Err::<Poll<()>, _>(anyhow::anyhow!("connection refused"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(
            error.ends_with("last seen: the last check failed: connection refused"),
            "{error}"
        );
        let value = poll_until("the answer", Duration::ZERO, || async {
            Ok(Poll::Ready(42))
        })
        .await
        .unwrap();
        assert_eq!(value, 42);
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait_and_a_retry_does_not() {
        let error = fail_fast("never", Duration::from_secs(3600), || async {
            Err::<Poll<()>, _>(Outcome::Stop(anyhow::anyhow!("pod failed")))
        })
        .await
        .unwrap_err();
        assert_eq!(format!("{error:#}"), "while waiting for never: pod failed");

        let error = fail_fast("retry", Duration::ZERO, || async {
            Err::<Poll<()>, _>(Outcome::from(anyhow::anyhow!("hiccup")))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(
            error.ends_with("last seen: the last check failed: hiccup"),
            "{error}"
        );
    }
}
