//! One retry policy for every reconciler ([`Retry`]) and the one wrapper around every
//! reconcile ([`Retry::reconcile`]): per-object exponential back-off ([`crate::backoff`]), the
//! reconcile metric labelled by the error's variant ([`Error::reason`]), a failed write told
//! where the user looks, and logs in which the expected outcomes of optimistic concurrency
//! (conflict, NotFound) are not warnings (`log_failure`).

use std::sync::Arc;
use std::time::Instant;

use kerf_api::write_failure::{FailureKind, WriteFailure};
use kube::runtime::controller::{self, Action};
use kube::{Resource, ResourceExt as _};

use crate::backoff::{Failure, KEEPS_FAILING_AFTER};
use crate::context::{Context, Write};
use crate::error::{Error, Result};

/// Logs a failed reconcile of `object` the way kube-runtime's `error_policy` hook is meant to
/// be used: conflicts and NotFound ([`Error::is_routine`]) are part of optimistic concurrency
/// and go to debug, other errors warn on an object's first failure, and any object that fails
/// [`KEEPS_FAILING_AFTER`] times in a row warns then and every as many failures after. The
/// reconcile metric counts every failure by reason either way.
fn log_failure(controller: &'static str, object: &str, error: &Error, failure: Failure) {
    let keeps_failing = failure.count.is_multiple_of(KEEPS_FAILING_AFTER);
    let first_fault = failure.count == 1 && !error.is_routine();
    if keeps_failing {
        tracing::warn!(
            controller,
            object,
            reason = error.reason(),
            %error,
            failures = failure.count,
            retry_in = ?failure.retry_in,
            "reconcile keeps failing"
        );
    } else if first_fault {
        tracing::warn!(controller, object, reason = error.reason(), %error, retry_in = ?failure.retry_in, "reconcile failed");
    } else {
        tracing::debug!(controller, object, reason = error.reason(), %error, failures = failure.count, retry_in = ?failure.retry_in, "reconcile failed; retrying");
    }
}

/// How one controller retries its failed reconciles. The three reconcilers (GpuClasses,
/// claims, the claims' node label) share everything but their name and whether a refused write
/// holds the object (`Retry::holding_refused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    controller: &'static str,
    hold_refused: bool,
}

impl Retry {
    /// The policy of `controller`, whose name labels the reconcile metric and the logs and
    /// prefixes its back-off keys.
    pub const fn new(controller: &'static str) -> Self {
        Self {
            controller,
            hold_refused: false,
        }
    }

    /// The policy that, after a write the API server refused, holds the object until its
    /// back-off delay has passed ([`crate::backoff::ObjectBackoff::hold`]): for a reconciler whose own watch
    /// brings the object back at once after a failed write (a rollback changes it).
    #[must_use]
    pub(crate) const fn holding_refused(self) -> Self {
        Self {
            hold_refused: true,
            ..self
        }
    }

    /// The controller's name.
    pub const fn controller(self) -> &'static str {
        self.controller
    }

    /// The back-off key of the object `namespace/name`: `controller/namespace/name`, the
    /// namespace empty for cluster-scoped objects, so that controllers share one
    /// [`crate::backoff::ObjectBackoff`].
    pub fn object_key(self, namespace: Option<&str>, name: &str) -> String {
        format!(
            "{}/{}/{name}",
            self.controller,
            namespace.unwrap_or_default()
        )
    }

    /// The back-off key of `object` (by its name, or generateName when it has none).
    pub fn key<K: Resource>(self, object: &K) -> String {
        self.object_key(object.meta().namespace.as_deref(), &object.name_any())
    }

    /// One reconcile of the object of `key`: waits out a hold on it (a refused write, for a
    /// policy [`Retry::holding_refused`]), runs `work`, records the reconcile metric (a failure
    /// labelled by [`Error::reason`]), calls `report(write, error, attempts)` for a failed
    /// write with the attempt [`Retry::error_policy`] will count, holds the key when the write
    /// was refused and the policy says so, forgets the object's failures after a success, and
    /// notes the reconcile in the diagnostics.
    ///
    /// # Errors
    /// `work`'s error, unchanged.
    pub async fn reconcile(
        self,
        ctx: &Context,
        key: String,
        work: impl Future<Output = Result<Action>>,
        report: impl AsyncFnOnce(&Write, &kube::Error, u32),
    ) -> Result<Action> {
        if self.hold_refused
            && let Some(wait) = ctx.backoff.held_for(&ctx.config.backoff, &key)
        {
            return Ok(Action::requeue(wait));
        }
        let started = Instant::now();
        let result = work.await;
        let result = self.finish(ctx, &key, started, result, report).await;
        ctx.note_reconcile(key).await;
        result
    }

    async fn finish<T>(
        self,
        ctx: &Context,
        key: &str,
        started: Instant,
        result: Result<T>,
        report: impl AsyncFnOnce(&Write, &kube::Error, u32),
    ) -> Result<T> {
        ctx.metrics.record_reconcile(
            self.controller,
            result.as_ref().map(|_| ()).map_err(Error::reason),
            started.elapsed(),
        );
        match &result {
            Err(Error::Write { write, source }) => {
                // error_policy counts this failure after the reconcile returns.
                let attempts = ctx.backoff.failures(key).saturating_add(1);
                report(write, source, attempts).await;
                if self.hold_refused && WriteFailure::of(source).kind() == FailureKind::Refused {
                    ctx.backoff.hold(key);
                }
            }
            Err(_) => {}
            Ok(_) => ctx.backoff.succeeded(key),
        }
        result
    }

    /// kube-runtime's error policy for a controller whose context `C` wraps the shared
    /// [`Context`]: counts the failure of the object, logs it by `log_failure` and requeues it
    /// after its next back-off delay.
    pub fn error_policy<K: Resource, C: AsRef<Context>>(
        self,
    ) -> impl Fn(Arc<K>, &Error, Arc<C>) -> Action {
        move |object: Arc<K>, error: &Error, ctx: Arc<C>| {
            let ctx = (*ctx).as_ref();
            let key = self.key(object.as_ref());
            let failure = ctx.backoff.failed(&ctx.config.backoff, &key);
            log_failure(self.controller, &key, error, failure);
            Action::requeue(failure.retry_in)
        }
    }

    /// What a finished reconcile leaves behind: an object gone from the store is deleted, so
    /// its failures are forgotten; the other outcomes were logged by the reconcile or
    /// [`Retry::error_policy`].
    pub fn applied<T, Q: std::error::Error>(
        self,
        ctx: &Context,
        result: &std::result::Result<T, controller::Error<Error, Q>>,
    ) {
        match result {
            Err(controller::Error::ObjectNotFound(gone)) => {
                let key = self.object_key(gone.namespace.as_deref(), &gone.name);
                ctx.backoff.forget(&key);
            }
            Err(error) => {
                tracing::debug!(controller = self.controller, %error, "reconcile not done");
            }
            Ok(_) => {}
        }
    }
}
