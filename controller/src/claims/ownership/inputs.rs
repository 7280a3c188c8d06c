//! When the ownership pass has to run again: something it reads changed, or a moment it
//! computed has come.
//!
//! The pass reads the published slices, the claims, the DeviceClasses (the shared caches, whose
//! own change counter [`crate::cache::Caches::changes`] is forwarded here), the pods and nodes
//! of the claim controller's watches and the claim store it reconciles from (bumped by
//! `watch.rs` after each store write), and the ledger's allocations in flight and claims
//! waiting for capacity (bumped by `ledger.rs` on each change). What changes with time alone is
//! computed by the pass itself ([`super::OwnershipBook::next_due`], the expiry of an assumed
//! allocation, a node write in back-off). With nothing changing, nothing runs.

use std::sync::Arc;

use tokio::sync::watch;

/// A counter of changes to what the ownership pass reads, coalesced: a burst of changes while
/// the pass runs or waits wakes it once. Clones bump and watch the same counter.
#[derive(Debug, Clone)]
pub struct InputChanges(Arc<watch::Sender<u64>>);

impl Default for InputChanges {
    fn default() -> Self {
        InputChanges(Arc::new(watch::Sender::new(0)))
    }
}

impl InputChanges {
    /// Something the pass reads changed. Call it after the change is visible to readers (after
    /// the store write, under or after the ledger change), so that a pass woken by it sees the
    /// change.
    pub fn bump(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A closure for a watch stream's `inspect`, placed after the reflector: every event,
    /// relists included, bumps the counter once the store holds it.
    pub fn bumper<T>(&self) -> impl FnMut(&T) + Send + 'static {
        let changes = self.clone();
        move |_| changes.bump()
    }

    /// The counter now. Read it before reading what it counts: a change after the read bumps
    /// it past the value read.
    pub fn version(&self) -> u64 {
        *self.0.borrow()
    }

    /// A receiver that is told of every bump from now on.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt as _;

    #[tokio::test]
    async fn a_burst_of_bumps_is_one_wake_and_a_quiet_counter_none() {
        let changes = InputChanges::default();
        let mut seen = changes.subscribe();
        assert!(seen.changed().now_or_never().is_none(), "nothing changed");
        let bumper = changes.clone();
        for _ in 0..5 {
            bumper.bump();
        }
        assert!(matches!(seen.changed().now_or_never(), Some(Ok(()))));
        assert!(
            seen.changed().now_or_never().is_none(),
            "five bumps before the wake make one"
        );
    }
}
