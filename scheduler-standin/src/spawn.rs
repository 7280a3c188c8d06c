//! The stand-in running in the background.

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::{CycleOutcome, SchedulerStandIn, SeededRng, SpawnConfig};

impl SchedulerStandIn {
    /// Runs the stand-in in the background: every [`SpawnConfig::interval`] it PreBinds the
    /// reservations older than [`SpawnConfig::prebind_delay`], runs one scheduling cycle and,
    /// if configured, the resourceclaim controller once. Read errors are retried on the next
    /// tick. [`StandInHandle::stop`] ends the loop and returns the stand-in.
    pub fn spawn(mut self, config: SpawnConfig) -> StandInHandle {
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let mut rng = SeededRng::new(config.seed);
            let mut log = Vec::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    () = tokio::time::sleep(config.interval) => {}
                }
                for outcome in self.flush_older_than(config.prebind_delay).await {
                    log.push(format!("{outcome:?}"));
                }
                if let Ok(outcome) = self.schedule_one(&mut rng).await
                    && outcome != CycleOutcome::Idle
                {
                    log.push(format!("{outcome:?}"));
                }
                if config.claim_controller {
                    let _ = self.run_claim_controller_once().await;
                }
            }
            (self, log)
        });
        StandInHandle { stop, task }
    }
}

/// A stand-in running in the background ([`SchedulerStandIn::spawn`]).
#[derive(Debug)]
pub struct StandInHandle {
    stop: oneshot::Sender<()>,
    task: JoinHandle<(SchedulerStandIn, Vec<String>)>,
}

impl StandInHandle {
    /// Stops the loop after its current tick and returns the stand-in (with any reservations
    /// still pending) and a log of every non-idle cycle and bind outcome, in order.
    ///
    /// # Errors
    ///
    /// The task's [`tokio::task::JoinError`] if it panicked or was cancelled.
    pub async fn stop(self) -> Result<(SchedulerStandIn, Vec<String>), tokio::task::JoinError> {
        let _ = self.stop.send(());
        self.task.await
    }
}
