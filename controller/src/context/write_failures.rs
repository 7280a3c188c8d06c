//! Writes the API server would not take, told to the user: a Warning Event on each object the
//! write concerns, quoting the server's own words and what to do, and the counter
//! `kerf_api_write_failures_total{component="controller",resource,reason}`.
//!
//! Which failures: refusals ([`kerf_api::write_failure::FailureKind::Refused`]: 403, 422, 400, 413, …) at once, since
//! retrying cannot help until someone acts; transient ones ([`FailureKind::Transient`](kerf_api::write_failure::FailureKind::Transient)) only
//! once they outlast the retry budget ([`KEEPS_FAILING_AFTER`] attempts); expected ones
//! (conflict, NotFound, Gone) never — they are optimistic concurrency at work. The Event of a
//! failure that repeats on every retry keeps the same reason and note, so the recorder folds
//! the repeats into the first Event's `series` count instead of writing new Events; the retries
//! themselves follow the object's back-off ([`crate::retry::ObjectBackoff`]).

use k8s_openapi::api::core::v1::ObjectReference;
use kerf_api::write_failure::{self, Report, WriteAttempt};
use kube::runtime::events::{Event, EventType};

use super::Context;
use crate::backoff::KEEPS_FAILING_AFTER;
use crate::error::Write;

/// What to tell the user about `error` from `write` at its `attempts`-th consecutive failure
/// by `component`; `None` when the failure is expected, or transient and still within its
/// retries ([`KEEPS_FAILING_AFTER`] attempts). See [`kerf_api::write_failure::assess`].
pub(super) fn assess(
    write: &Write,
    error: &kube::Error,
    attempts: u32,
    component: &str,
) -> Option<Report> {
    let object = match &write.namespace {
        Some(namespace) => format!("{namespace}/{}", write.name),
        None => write.name.clone(),
    };
    let attempt = WriteAttempt {
        component,
        verb: write.verb,
        resource: write.resource,
        object: &object,
    };
    write_failure::assess(&attempt, error, attempts, KEEPS_FAILING_AFTER)
}

impl Context {
    /// Tells the user about `error` from `write` when `assess` (above) says so: a Warning Event on
    /// each object of `regarding` and one count of the write-failure metric. `attempts` counts
    /// the consecutive failures of the write, this one included. Returns what was reported.
    pub async fn report_write_failure(
        &self,
        write: &Write,
        error: &kube::Error,
        attempts: u32,
        regarding: &[ObjectReference],
    ) -> Option<Report> {
        let reported = assess(write, error, attempts, &self.config.field_manager)?;
        self.metrics
            .api_write_failures()
            .record(write.resource, reported.failure.label());
        tracing::warn!(write = %write, reason = reported.failure.label(), error = %error, "write failed; reported as a Warning Event");
        let event = Event {
            type_: EventType::Warning,
            reason: reported.reason.to_owned(),
            note: Some(reported.note.clone()),
            action: "Write".to_owned(),
            secondary: None,
        };
        for object in regarding {
            if let Err(e) = self.recorder.publish(&event, object).await {
                tracing::warn!(object = ?object.name, error = %e, "could not publish the write failure Event");
            }
        }
        Some(reported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::write_failure::{WRITE_FAILING, WRITE_REFUSED};

    fn api(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, reason)
                .with_code(code)
                .boxed(),
        )
    }

    fn gate() -> Write {
        Write::patch("pods", Some("default"), "p")
    }

    #[test]
    fn a_refusal_is_reported_at_once_with_the_servers_words_and_the_way_out() {
        let denied = r#"pods "p" is forbidden: User "system:serviceaccount:kerf-system:kerf-controller" cannot patch resource "pods" in API group "" in the namespace "default""#;
        let reported = assess(
            &gate(),
            &api(403, "Forbidden", denied),
            1,
            "kerf-controller",
        )
        .unwrap();
        assert_eq!(reported.reason, WRITE_REFUSED);
        assert_eq!(reported.failure, write_failure::WriteFailure::Forbidden);
        assert!(reported.note.contains(denied), "{}", reported.note);
        assert!(
            reported.note.contains("patch pods default/p"),
            "{}",
            reported.note
        );
        assert!(
            reported.note.contains("lacks `patch` on `pods`"),
            "{}",
            reported.note
        );
    }

    #[test]
    fn conflicts_are_never_reported() {
        let conflict = api(409, "Conflict", "the object has been modified");
        assert_eq!(assess(&gate(), &conflict, 100, "kerf-controller"), None);
        let gone = api(404, "NotFound", "not found");
        assert_eq!(assess(&gate(), &gone, 100, "kerf-controller"), None);
    }

    #[test]
    fn a_transient_failure_is_reported_once_it_outlasts_the_retries() {
        let unavailable = api(503, "ServiceUnavailable", "try later");
        assert_eq!(assess(&gate(), &unavailable, 1, "kerf-controller"), None);
        let late = assess(
            &gate(),
            &unavailable,
            KEEPS_FAILING_AFTER,
            "kerf-controller",
        )
        .unwrap();
        assert_eq!(late.reason, WRITE_FAILING);
        let later = assess(
            &gate(),
            &unavailable,
            KEEPS_FAILING_AFTER + 3,
            "kerf-controller",
        )
        .unwrap();
        assert_eq!(late.note, later.note, "repeats read the same");
    }
}
