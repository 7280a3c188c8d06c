//! What the controller's HTTP endpoint (`/healthz`, `/readyz`, `/metrics`, served by
//! [`kerf_ops::http::serve`]) reports on `/readyz`.
//!
//! `/readyz` answers 200 once this replica takes part in the election (or runs without one),
//! as leader or standby: a standby that reported not-ready would block rolling updates of the
//! Deployment without making anything safer. The body says which role the replica has. A
//! replica that runs the admission webhook is ready only while the webhook serves: the
//! webhook Service sends reviews to ready replicas, and kube-apiserver refuses a claim with a
//! kerf config whose review finds no answer (`failurePolicy: Fail`).

use kerf_ops::ready::{ReadyFlag, ReadyFlags};

/// What `/readyz` says while the webhook of a replica that runs one does not serve.
const WEBHOOK_NOT_SERVING: &str = "the admission webhook is not serving";

/// What `/readyz` says until the replica takes part in the election.
const ELECTION_NOT_STARTED: &str = "leader election has not started (is the Lease reachable?)";

/// The flags of a controller replica: the election sets `started` once it takes part (or
/// at once without an election) and `leader` while it leads; `webhook_serving` is the
/// webhook's, when the replica runs it.
#[must_use]
pub(crate) fn ready_flags(
    started: &ReadyFlag,
    leader: &ReadyFlag,
    webhook_serving: Option<&ReadyFlag>,
) -> ReadyFlags {
    let flags = match webhook_serving {
        Some(serving) => ReadyFlags::new().require(serving, WEBHOOK_NOT_SERVING),
        None => ReadyFlags::new(),
    };
    flags
        .require(started, ELECTION_NOT_STARTED)
        .with_role(leader, "leader", "standby")
}

#[cfg(test)]
mod tests {
    use super::*;

    // How `/readyz` turns these answers into 200 and 503 is `kerf_ops::http`'s, tested there.

    #[test]
    fn a_replica_is_ready_once_the_election_started_and_says_its_role() {
        let (started, leader) = (ReadyFlag::new(), ReadyFlag::new());
        let flags = ready_flags(&started, &leader, None);
        assert_eq!(flags.readiness(), Err(ELECTION_NOT_STARTED.to_owned()));
        started.set(true);
        assert_eq!(flags.readiness(), Ok("ok: standby".to_owned()));
        leader.set(true);
        assert_eq!(flags.readiness(), Ok("ok: leader".to_owned()));
        started.set(false);
        assert!(!flags.is_ready());
    }

    #[test]
    fn a_replica_with_a_webhook_is_ready_only_while_it_serves() {
        let (started, leader, serving) = (ReadyFlag::new(), ReadyFlag::new(), ReadyFlag::new());
        let flags = ready_flags(&started, &leader, Some(&serving));
        assert_eq!(
            flags.readiness(),
            Err(format!("{WEBHOOK_NOT_SERVING}; {ELECTION_NOT_STARTED}"))
        );
        started.set(true);
        assert_eq!(flags.readiness(), Err(WEBHOOK_NOT_SERVING.to_owned()));
        serving.set(true);
        assert_eq!(flags.readiness(), Ok("ok: standby".to_owned()));
        serving.set(false);
        assert!(!flags.is_ready());
    }
}
