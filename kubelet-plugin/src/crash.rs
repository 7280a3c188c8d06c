//! Crash injection for the crash-safety tests (mock mode only): the plugin aborts right after
//! a named step of a prepare or an unprepare, as a SIGKILL there would stop it, so that a
//! restarted plugin has to find and finish, undo or keep what the step left.

use clap::ValueEnum;

/// The step of a prepare or unprepare after which the plugin aborts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[allow(
    clippy::enum_variant_names,
    reason = "the variants are the values of --mock-crash-at (after-start, ...)"
)]
pub enum CrashStep {
    /// The claim's PrepareStarted entry reserves its devices in memory; nothing is written.
    AfterStart,
    /// Dynamic MIG: the GPU instance exists; the checkpoint holds only the intent.
    AfterGiCreate,
    /// Dynamic MIG: the compute instance exists too; the checkpoint still holds only the
    /// intent.
    AfterCiCreate,
    /// Dynamic MIG: the instance's ids, UUID and capability minors are written to the
    /// checkpoint; the claim is still PrepareStarted and has no CDI spec.
    AfterRecord,
    /// A shared GPU is set up for the claim (its MPS daemon runs, or its time slice is set);
    /// no CDI spec yet.
    AfterSharing,
    /// The claim's CDI spec is written; its entry may or may not be PrepareCompleted yet (the
    /// two writes run at the same time).
    AfterSpecWrite,
    /// The CDI spec is written and the claim PrepareCompleted in the checkpoint; the kubelet
    /// has no answer yet.
    AfterCdiWrite,
    /// Unprepare: the CDI spec is removed; the checkpoint entry is still there.
    AfterSpecRemove,
    /// Unprepare: the checkpoint entry is removed; the claim's shared GPUs are not released
    /// yet.
    AfterEntryRemove,
}

impl CrashStep {
    /// The flag value, e.g. `after-gi-create`.
    pub fn as_str(self) -> &'static str {
        match self {
            CrashStep::AfterStart => "after-start",
            CrashStep::AfterGiCreate => "after-gi-create",
            CrashStep::AfterCiCreate => "after-ci-create",
            CrashStep::AfterRecord => "after-record",
            CrashStep::AfterSharing => "after-sharing",
            CrashStep::AfterSpecWrite => "after-spec-write",
            CrashStep::AfterCdiWrite => "after-cdi-write",
            CrashStep::AfterSpecRemove => "after-spec-remove",
            CrashStep::AfterEntryRemove => "after-entry-remove",
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
