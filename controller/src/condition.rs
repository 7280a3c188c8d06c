//! Status conditions as the controllers write them: what a condition says ([`Verdict`]) and
//! the `Condition` it becomes ([`condition`]), for GpuClasses and GpuQuotas alike.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// A condition's content before timestamps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Status True.
    pub ok: bool,
    /// The reason, one of the writing controller's reasons.
    pub reason: &'static str,
    /// What happened, in words.
    pub message: String,
}

/// The condition `type_` saying `verdict` for `generation`: its last transition time is the
/// `previous` condition's while the status stays, and now when it changes.
pub fn condition(
    type_: &str,
    verdict: &Verdict,
    generation: Option<i64>,
    previous: Option<&Condition>,
) -> Condition {
    let status = if verdict.ok { "True" } else { "False" };
    let last_transition_time = previous.filter(|p| p.status == status).map_or_else(
        || Time(Timestamp::now()),
        |p| p.last_transition_time.clone(),
    );
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: verdict.reason.to_owned(),
        message: verdict.message.clone(),
        observed_generation: generation,
        last_transition_time,
    }
}
