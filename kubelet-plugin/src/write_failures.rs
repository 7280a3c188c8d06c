//! Writes the API server will not take, told to the user: a Warning Event on the object the
//! write concerns — the claim for its `status.devices`, the Node for its ResourceSlices — with
//! the server's own words and what to do, and the counter
//! `kerf_api_write_failures_total{component="kubelet-plugin",resource,reason}`.
//!
//! Which failures, as [`kerf_api::write_failure::assess`] decides for kerf-controller too:
//! refusals (403, 422, …) at once, transient failures once they outlast the writer's retries,
//! expected ones (conflict, NotFound) never.

use std::sync::Arc;

use kerf_api::write_failure::{Report, WriteAttempt, assess};
use kerf_ops::write_failures::ApiWriteFailures;

use crate::claim_events::{ClaimEvents, ClaimWarning, NodeWarning};
use crate::identity::ClaimRef;

/// The plugin's name in the notes: its field manager and Event reporter.
const COMPONENT: &str = crate::claim_events::REPORTING_CONTROLLER;

/// Where the plugin tells about its failed writes. Cheap to clone.
#[derive(Clone)]
pub struct WriteFailureReports {
    events: Arc<dyn ClaimEvents>,
    counter: ApiWriteFailures,
    node: String,
}

impl std::fmt::Debug for WriteFailureReports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteFailureReports")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl WriteFailureReports {
    /// Reports through `events`, counted in `counter`, for the plugin on `node`.
    pub fn new(events: Arc<dyn ClaimEvents>, counter: ApiWriteFailures, node: &str) -> Self {
        Self {
            events,
            counter,
            node: node.to_owned(),
        }
    }

    /// Tells about the failed `verb` of `resource` (e.g. `resourceclaims/status`) of `claim`
    /// at its `attempts`-th try out of `retry_budget`, on the claim. Returns what was told.
    pub(crate) async fn claim_write_failed(
        &self,
        claim: &ClaimRef,
        (verb, resource): (&'static str, &'static str),
        error: &kube::Error,
        (attempts, retry_budget): (u32, u32),
    ) -> Option<Report> {
        let object = format!("{}/{}", claim.namespace, claim.name);
        let attempt = WriteAttempt {
            component: COMPONENT,
            verb,
            resource,
            object: &object,
        };
        let report = assess(&attempt, error, attempts, retry_budget)?;
        self.counter.record(resource, report.failure.label());
        self.events
            .warn(ClaimWarning {
                claim: claim.clone(),
                reason: report.reason,
                note: report.note.clone(),
            })
            .await;
        Some(report)
    }

    /// Tells about the failed `verb` of `resource` (e.g. `resourceslices`) object `object`,
    /// which concerns the node as a whole, at its `attempts`-th try out of `retry_budget`, on
    /// the Node — unless its note is `told` already, when it is only counted (a writer that
    /// retries the same write would otherwise repeat its first Event). Returns the report.
    pub async fn node_write_failed(
        &self,
        (verb, resource, object): (&'static str, &'static str, &str),
        error: &kube::Error,
        (attempts, retry_budget): (u32, u32),
        told: Option<&str>,
    ) -> Option<Report> {
        let attempt = WriteAttempt {
            component: COMPONENT,
            verb,
            resource,
            object,
        };
        let report = assess(&attempt, error, attempts, retry_budget)?;
        self.counter.record(resource, report.failure.label());
        if told == Some(report.note.as_str()) {
            return Some(report);
        }
        self.events
            .warn_node(NodeWarning {
                reason: report.reason,
                note: report.note.clone(),
            })
            .await;
        Some(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claim_events::MemoryClaimEvents;
    use prometheus_client::registry::Registry;

    fn denied() -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(
                r#"resourceslices.resource.k8s.io "n-gpu.kerf.dev-0" is forbidden"#,
                "Forbidden",
            )
            .with_code(403)
            .boxed(),
        )
    }

    #[tokio::test]
    async fn a_refused_slice_write_is_a_node_warning_and_counted() {
        let events = Arc::new(MemoryClaimEvents::default());
        let counter = ApiWriteFailures::new("kubelet-plugin", &mut Registry::default());
        let reports = WriteFailureReports::new(events.clone(), counter.clone(), "n");
        let write = ("patch", "resourceslices", "n-gpu.kerf.dev-0");
        let told = reports
            .node_write_failed(write, &denied(), (1, 5), None)
            .await;
        assert!(told.is_some());
        let warnings = events.node_warnings();
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].reason, "WriteRefused");
        assert!(warnings[0].note.contains("is forbidden"), "{warnings:?}");
        assert!(
            warnings[0]
                .note
                .contains("kerf-kubelet-plugin's ServiceAccount lacks `patch` on `resourceslices`"),
            "{warnings:?}"
        );
        assert_eq!(counter.count("resourceslices", "Forbidden"), 1);
    }

    #[tokio::test]
    async fn a_conflict_is_not_told() {
        let events = Arc::new(MemoryClaimEvents::default());
        let counter = ApiWriteFailures::new("kubelet-plugin", &mut Registry::default());
        let reports = WriteFailureReports::new(events.clone(), counter, "n");
        let conflict = kube::Error::Api(
            kube::core::Status::failure("modified", "Conflict")
                .with_code(409)
                .boxed(),
        );
        let write = ("patch", "resourceslices", "s");
        assert!(
            reports
                .node_write_failed(write, &conflict, (9, 5), None)
                .await
                .is_none()
        );
        assert!(events.node_warnings().is_empty());
    }
}
