//! Slice writes the API server will not take, told on the Node: a refusal (403 when the
//! plugin's ServiceAccount may not write ResourceSlices, 422 when a slice does not validate)
//! at once, a transient failure once it outlasts [`RETRY_BUDGET`] publishes in a row. One
//! Warning per distinct failure until a publish succeeds: the publisher retries with its own
//! back-off, and each retry's failure reads the same, so telling it again would only repeat
//! the first Event. The write-failure metric counts each of those failures, told or repeated.

use super::Publisher;
use crate::Error;

/// Failed publishes in a row after which a transient write failure is told.
const RETRY_BUDGET: u32 = 5;

/// Slice write failures in a row, and the note last told about them.
#[derive(Debug, Default)]
pub(super) struct FailedWrites {
    in_a_row: u32,
    told: Option<String>,
}

impl Publisher {
    /// Tells the user about the publish's failed slice write, if any (see the module docs);
    /// a publish without one ends the run of failures.
    pub(super) async fn tell_write_failure(&self, error: Option<&Error>) {
        let Some(Error::Write {
            verb,
            resource,
            name,
            source,
        }) = error
        else {
            self.state().write_failures = FailedWrites::default();
            return;
        };
        let attempts = {
            let mut state = self.state();
            state.write_failures.in_a_row = state.write_failures.in_a_row.saturating_add(1);
            state.write_failures.in_a_row
        };
        let Some(reports) = &self.reports else {
            return;
        };
        let told = self.state().write_failures.told.clone();
        let reported = reports
            .node_write_failed(
                (verb, resource, name),
                source,
                (attempts, RETRY_BUDGET),
                told.as_deref(),
            )
            .await;
        if let Some(report) = reported {
            self.state().write_failures.told = Some(report.note);
        }
    }
}
