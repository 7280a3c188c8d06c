//! Crash injection for the crash-safety tests of dynamic MIG (mock mode only): the plugin
//! aborts right after a named step of a MIG prepare, as a SIGKILL or a power cut would stop
//! it there, so that a restarted plugin has to find and undo (or keep) what the step left.

use clap::ValueEnum;

/// The step of a dynamic-MIG prepare after which the plugin aborts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[allow(
    clippy::enum_variant_names,
    reason = "the variants are the values of --mock-crash-at (after-gi-create, ...)"
)]
pub enum CrashStep {
    /// The GPU instance exists; the checkpoint holds only the intent.
    AfterGiCreate,
    /// The compute instance exists too; the checkpoint still holds only the intent.
    AfterCiCreate,
    /// The instance's ids, UUID and capability minors are durable in the checkpoint; the
    /// claim is still PrepareStarted and has no CDI spec.
    AfterRecord,
    /// The CDI spec is written and the claim PrepareCompleted, durably; the kubelet has no
    /// answer yet.
    AfterCdiWrite,
}

impl CrashStep {
    /// The flag value, e.g. `after-gi-create`.
    pub fn as_str(self) -> &'static str {
        match self {
            CrashStep::AfterGiCreate => "after-gi-create",
            CrashStep::AfterCiCreate => "after-ci-create",
            CrashStep::AfterRecord => "after-record",
            CrashStep::AfterCdiWrite => "after-cdi-write",
        }
    }
}

/// Aborts the process when `step` is the step a test asked to crash at.
pub(crate) fn crash_point(crash_at: Option<CrashStep>, step: CrashStep) {
    if crash_at == Some(step) {
        // stderr is unbuffered: the line reaches the test's log before the abort.
        eprintln!("kerf: --mock-crash-at {}: aborting", step.as_str());
        std::process::abort();
    }
}
