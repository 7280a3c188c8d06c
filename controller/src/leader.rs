//! Leader election through a `coordination.k8s.io/v1` Lease, with kube-lease-manager.
//!
//! kube-lease-manager (0.13, built on kube 5 and k8s-openapi 0.29) acquires the Lease, renews
//! it and reports when this replica becomes or stops being the holder. Two gaps are closed
//! here:
//! - It works in whole seconds and has no separate renew deadline: a holder renews `grace`
//!   seconds before expiry. `grace` is set to `lease_duration − retry_period`, so the holder
//!   renews every `retry_period`, as client-go's elector does.
//! - When renewing fails with an API error it keeps reporting "leader" and retries. A leader
//!   that cannot renew must stop before the Lease expires and a standby takes over, so
//!   [`LeaderElector::lost`] also watches the Lease itself: leadership is lost as soon as the
//!   Lease names another holder, or its `renewTime` is older than `renew_deadline` (client-go's
//!   rule; `renew_deadline < lease_duration` keeps the old leader's last writes before a new
//!   leader's first).

use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManager, LeaseParams};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::FIELD_MANAGER;
use crate::error::{Error, Result};

/// Where the Lease lives, who this replica is, and the election's timing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Name of the Lease.
    pub name: String,
    /// Namespace of the Lease.
    pub namespace: String,
    /// Holder identity of this replica (the pod name); unique among replicas.
    pub identity: String,
    /// How long a Lease is valid after its last renewal; a standby takes over after that.
    /// Whole seconds, at least 2.
    pub lease_duration: Duration,
    /// How long the leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// How often the leader renews and checks the Lease. Whole seconds, at least 1.
    pub retry_period: Duration,
    /// The program's field manager; the Lease is written as `<field_manager>-<identity>`.
    pub field_manager: String,
}

impl LeaseConfig {
    /// A configuration with client-go's default timing (15 s, 10 s, 2 s).
    pub fn new(
        name: impl Into<String>,
        namespace: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            field_manager: FIELD_MANAGER.to_owned(),
        }
    }

    /// Checks `0 < retry_period < renew_deadline < lease_duration` and the whole-second rules.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the flag at fault.
    pub fn validate(&self) -> Result<()> {
        let config = |message: String| Err(Error::Config(message));
        if self.name.is_empty() || self.namespace.is_empty() || self.identity.is_empty() {
            return config(
                "--lease-name, --lease-namespace and --identity must not be empty".to_owned(),
            );
        }
        for (flag, value, min) in [
            ("--lease-duration", self.lease_duration, 2),
            ("--lease-retry-period", self.retry_period, 1),
        ] {
            if value.subsec_nanos() != 0 || value.as_secs() < min {
                return config(format!(
                    "{flag} {value:?} must be a whole number of seconds, at least {min}s (Lease durations are in seconds)"
                ));
            }
        }
        if !(self.retry_period < self.renew_deadline && self.renew_deadline < self.lease_duration) {
            return config(format!(
                "need --lease-retry-period ({:?}) < --lease-renew-deadline ({:?}) < --lease-duration ({:?})",
                self.retry_period, self.renew_deadline, self.lease_duration
            ));
        }
        Ok(())
    }

    /// The lease manager's parameters. Its field manager is the program's, per replica
    /// (`<field_manager>-<identity>`): kube-lease-manager takes an orphaned Lease with a
    /// server-side apply that must conflict with another replica's (`LeaseState::lock` in
    /// kube-lease-manager's `state.rs`; `LeaseState::patch` names `params.field_manager()`), which needs one manager per identity — its default,
    /// `kube-lease-manager-<identity>`, would not say which program holds the Lease.
    fn params(&self) -> LeaseParams {
        let duration = self.lease_duration.as_secs();
        let grace = duration - self.retry_period.as_secs();
        LeaseParams::new(self.identity.clone(), duration, grace)
            .with_field_manager(format!("{}-{}", self.field_manager, self.identity))
    }
}

/// One replica's participation in the election.
pub struct LeaderElector {
    config: LeaseConfig,
    client: Client,
    api: Api<Lease>,
    leading: Watching,
    task: Task,
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field("config", &self.config)
            .field("leading", &*self.leading.borrow())
            .finish_non_exhaustive()
    }
}

type Watching = watch::Receiver<bool>;
type Task = JoinHandle<kube_lease_manager::Result<LeaseManager>>;

impl LeaderElector {
    /// Creates the Lease if it does not exist and starts competing for it in the background.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for invalid timing; [`Error::LeaderElection`] when the Lease cannot be
    /// read or created.
    pub async fn start(client: Client, config: LeaseConfig) -> Result<Self> {
        config.validate()?;
        let (leading, task) = Self::compete(&client, &config).await?;
        Ok(Self {
            api: Api::namespaced(client.clone(), &config.namespace),
            client,
            config,
            leading,
            task,
        })
    }

    async fn compete(client: &Client, config: &LeaseConfig) -> Result<(Watching, Task)> {
        let manager = LeaseManager::new(
            client.clone(),
            config.name.clone(),
            config.namespace.clone(),
            config.params(),
            LeaseCreateMode::AutoCreate,
        )
        .await?;
        Ok(manager.watch().await)
    }

    /// Whether this replica holds the Lease, as last reported.
    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// The configuration this elector runs with.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Waits until this replica holds the Lease.
    ///
    /// kube-lease-manager (0.13.1, `LeaseManager::watch` in `manager.rs`) retries a failed
    /// Lease read with a back-off that doubles from 1 s to 30 s (`MAX_WATCHER_BACKOFF_TIME`)
    /// and is only reset by a success: after an API outage of half a minute a standby (or a
    /// restarted leader) would wait up to 30 s more before it looks at the Lease again. So the
    /// Lease is also read here every `retry_period`, and when it has been free or expired for
    /// longer than kube-lease-manager needs to take it (`2 × retry_period` plus its random
    /// wait of up to 1 s), the manager is started afresh: its first step reads the Lease at
    /// once.
    ///
    /// # Errors
    ///
    /// [`Error::LeaderElection`] when the election task ended.
    pub async fn acquired(&mut self) -> Result<()> {
        let period = self.config.retry_period;
        let patience = period * 2 + Duration::from_secs(1);
        let mut free_since: Option<tokio::time::Instant> = None;
        loop {
            let ended = tokio::select! {
                acquired = self.leading.wait_for(|leading| *leading) => Some(acquired.is_ok()),
                () = tokio::time::sleep(period) => None,
            };
            match ended {
                Some(true) => return Ok(()),
                Some(false) => return Err(self.task_ended().await),
                None => {}
            }
            let free = match tokio::time::timeout(period, self.read_renewal()).await {
                Ok(Ok(renewal)) => renewal.is_free(SystemTime::now()),
                Ok(Err(error)) => {
                    tracing::debug!(%error, lease = %self.config.name, "cannot read the Lease");
                    false
                }
                Err(_) => false,
            };
            if !free {
                free_since = None;
                continue;
            }
            let since = *free_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= patience {
                self.restart().await;
                free_since = None;
            }
        }
    }

    /// Starts competing afresh; keeps the running manager when a new one cannot start.
    async fn restart(&mut self) {
        let period = self.config.retry_period;
        match tokio::time::timeout(period, Self::compete(&self.client, &self.config)).await {
            Ok(Ok((leading, task))) => {
                tracing::info!(lease = %self.config.name, "the Lease is free but was not taken; competing for it afresh");
                self.task.abort();
                self.leading = leading;
                self.task = task;
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, lease = %self.config.name, "cannot restart the election");
            }
            Err(_) => {
                tracing::debug!(lease = %self.config.name, "restarting the election timed out");
            }
        }
    }

    /// Waits until this replica, which holds the Lease, must stop leading, and says why: the
    /// Lease names another holder, it has not been renewed within `renew_deadline`, or the
    /// election task ended.
    pub async fn lost(&mut self) -> String {
        let mut confirmed = SystemTime::now();
        loop {
            let deadline = confirmed + self.config.renew_deadline;
            let wait = deadline
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO)
                .min(self.config.retry_period);
            tokio::select! {
                changed = self.leading.changed() => {
                    if changed.is_err() {
                        return "the leader election task stopped".to_owned();
                    }
                    if !*self.leading.borrow_and_update() {
                        return "the Lease was taken over by another replica".to_owned();
                    }
                }
                () = tokio::time::sleep(wait) => {
                    // Bounded: a frozen API server would hold the read past the deadline, and
                    // the leader must stop at the deadline, not when the server answers.
                    let read = tokio::time::timeout(self.config.retry_period, self.read_renewal());
                    match read.await {
                        Ok(Ok(Renewal::Ours(Some(renewed)))) => confirmed = confirmed.max(renewed),
                        Ok(Ok(Renewal::Ours(None))) => {}
                        Ok(Ok(Renewal::Other(holder) | Renewal::Held { holder, .. })) => {
                            return format!("the Lease is held by {holder:?}");
                        }
                        Ok(Err(error)) => {
                            tracing::warn!(%error, lease = %self.config.name, "cannot read the Lease");
                        }
                        Err(_) => {
                            tracing::warn!(lease = %self.config.name, timeout = ?self.config.retry_period, "reading the Lease timed out");
                        }
                    }
                    if SystemTime::now() >= confirmed + self.config.renew_deadline {
                        return format!(
                            "the Lease was not renewed for {:?} (--lease-renew-deadline)",
                            self.config.renew_deadline
                        );
                    }
                }
            }
        }
    }

    /// Stops competing and gives the Lease up if this replica holds it, so a standby takes
    /// over at once rather than after the Lease expires.
    ///
    /// # Errors
    ///
    /// [`Error::LeaderElection`] when releasing the Lease failed.
    pub async fn release(self) -> Result<()> {
        drop(self.leading);
        match self.task.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(error)) => Err(error.into()),
            Err(join) => Err(task_failed(&join)),
        }
    }

    /// Stops competing without touching the Lease, as a crashed replica would: a leader's Lease
    /// then expires after `lease_duration`. For a replica that lost the Lease (releasing could
    /// clear another holder's fresh claim) and for tests.
    pub fn abandon(self) {
        self.task.abort();
    }

    async fn task_ended(&mut self) -> Error {
        match (&mut self.task).await {
            Ok(Ok(_)) => Error::LeadershipLost("the leader election task stopped".to_owned()),
            Ok(Err(error)) => error.into(),
            Err(join) => task_failed(&join),
        }
    }

    async fn read_renewal(&self) -> Result<Renewal> {
        let lease = self.api.get(&self.config.name).await?;
        let spec = lease.spec.unwrap_or_default();
        match spec.holder_identity {
            Some(holder) if holder == self.config.identity => Ok(Renewal::Ours(
                spec.renew_time.map(|t| SystemTime::from(t.0)),
            )),
            Some(holder) => {
                let valid = spec
                    .lease_duration_seconds
                    .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or_default()));
                let renewed = spec.renew_time.map(|t| SystemTime::from(t.0));
                Ok(match renewed.zip(valid) {
                    Some((renewed, valid)) => Renewal::Held {
                        holder,
                        until: renewed + valid,
                    },
                    None => Renewal::Other(holder),
                })
            }
            None => Ok(Renewal::Other(String::new())),
        }
    }
}

fn task_failed(join: &tokio::task::JoinError) -> Error {
    Error::ControllerStopped {
        name: "leader-election",
        message: join.to_string(),
    }
}

/// What the Lease says about this replica.
enum Renewal {
    /// This replica holds it, last renewed at the time given.
    Ours(Option<SystemTime>),
    /// Another replica holds it, valid until the time given.
    Held { holder: String, until: SystemTime },
    /// Another replica holds it without a renewal time (or nobody: empty).
    Other(String),
}

impl Renewal {
    /// Whether this replica could take the Lease at `now`: nobody holds it, it has expired,
    /// or it names this replica (a restarted process keeps its pod name).
    fn is_free(&self, now: SystemTime) -> bool {
        match self {
            Renewal::Ours(_) => true,
            Renewal::Held { until, .. } => *until <= now,
            Renewal::Other(holder) => holder.is_empty(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(duration: u64, deadline_ms: u64, retry: u64) -> LeaseConfig {
        LeaseConfig {
            lease_duration: Duration::from_secs(duration),
            renew_deadline: Duration::from_millis(deadline_ms),
            retry_period: Duration::from_secs(retry),
            ..LeaseConfig::new("kerf-controller", "kerf-system", "pod-a")
        }
    }

    #[test]
    fn defaults_are_valid() {
        LeaseConfig::new("l", "ns", "me").validate().unwrap();
    }

    #[test]
    fn timing_must_be_ordered() {
        assert!(config(15, 10_000, 2).validate().is_ok());
        assert!(config(3, 2_500, 1).validate().is_ok());
        for bad in [
            config(15, 15_000, 2),
            config(15, 2_000, 2),
            config(15, 20_000, 2),
        ] {
            let err = bad.validate().unwrap_err();
            assert!(err.to_string().contains("--lease-renew-deadline"), "{err}");
        }
    }

    #[test]
    fn lease_timing_is_in_whole_seconds() {
        let mut c = config(15, 10_000, 2);
        c.lease_duration = Duration::from_millis(15_500);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--lease-duration")
        );
        let mut c = config(15, 10_000, 2);
        c.retry_period = Duration::from_millis(1500);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--lease-retry-period")
        );
        assert!(config(1, 500, 1).validate().is_err());
    }

    #[test]
    fn the_holder_renews_every_retry_period() {
        let params = config(15, 10_000, 2).params();
        // grace = duration - retry: renewal at renewTime + duration - grace = renewTime + retry.
        assert_eq!(
            params,
            LeaseParams::new("pod-a", 15, 13).with_field_manager("kerf-controller-pod-a")
        );
    }

    #[test]
    fn empty_names_are_refused() {
        let c = LeaseConfig::new("l", "ns", "");
        assert!(c.validate().unwrap_err().to_string().contains("--identity"));
    }
}
