//! The process: metrics/health HTTP, leader election, and the controllers that run only while
//! this replica leads.
//!
//! A leadership term starts the caches and every [`ControllerTask`] with one shared
//! [`Context`]. The watches of claims and DeviceClasses ([`ProcessCaches`]) are the process's
//! when the webhook runs (it reads them on every replica, leader or standby) and the term
//! borrows them; without the webhook the term starts them itself. When the term ends because
//! the Lease was lost, the controllers are stopped and [`Process::run`] returns
//! [`Error::LeadershipLost`]: the process exits and restarts as a standby, as
//! kube-controller-manager does. Nothing written from in-memory state of the old term can then
//! outlive it.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use kerf_ops::ready::{ReadyFlag, ReadyFlags};
use kube::Client;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cache::{Caches, ProcessCaches};
use crate::config::ControllerConfig;
use crate::context::Context;
use crate::error::{Error, Result};
use crate::features;
use crate::gpuclass;
use crate::http;
use crate::leader::{LeaderElector, LeaseConfig};
use crate::metrics::Metrics;
use crate::webhook::{self, WebhookConfig};

/// Everything `kerf-controller` is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// What the reconcilers read.
    pub controller: ControllerConfig,
    /// The Lease to elect a leader with; `None` runs the controllers at once (one replica only).
    pub leader_election: Option<LeaseConfig>,
    /// Address of `/metrics`, `/healthz` and `/readyz`; `None` serves nothing.
    pub metrics_address: Option<SocketAddr>,
}

/// The future of a running controller.
pub(crate) type ControllerFuture = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

type StartFn = Box<dyn FnOnce(Arc<Context>, CancellationToken) -> ControllerFuture + Send>;

/// A controller started under leadership: a name for logs and a function that runs it with
/// the term's context until the token is cancelled.
pub struct ControllerTask {
    name: &'static str,
    start: StartFn,
}

impl std::fmt::Debug for ControllerTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControllerTask")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ControllerTask {
    /// A task named `name` that runs `start(context, shutdown)`. The future must return once
    /// `shutdown` is cancelled; returning earlier ends the leadership term with an error.
    pub fn new<F, Fut>(name: &'static str, start: F) -> Self
    where
        F: FnOnce(Arc<Context>, CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        Self {
            name,
            start: Box::new(move |ctx, shutdown| Box::pin(start(ctx, shutdown))),
        }
    }

    /// The task's name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// The controllers `kerf-controller` runs while it leads.
pub fn controllers() -> Vec<ControllerTask> {
    vec![
        ControllerTask::new(gpuclass::CONTROLLER, gpuclass::run),
        ControllerTask::new("resourceclaim", crate::claims::run),
        ControllerTask::new(
            crate::quota::recount::CONTROLLER,
            crate::quota::recount::run,
        ),
    ]
}

/// One `kerf-controller` process as one value: what it is configured with, the client it talks
/// with, the controllers it runs while it leads, the webhook it serves and the token that ends
/// it. The binary builds it from its flags ([`crate::entry::run`]); tests build it with their
/// client and the controllers they exercise.
pub struct Process {
    /// The reconcilers' configuration, the leader election, the metrics address.
    pub config: Config,
    /// The API server.
    pub client: Client,
    /// Run while this replica leads: [`controllers`], and in the binary the default
    /// GpuClasses' task when the flags ask for it.
    pub controllers: Vec<ControllerTask>,
    /// The admission webhook, served on every replica, leader or standby; `None` serves none.
    pub webhook: Option<WebhookConfig>,
    /// Ends the process: the controllers stop and the Lease is released.
    pub shutdown: CancellationToken,
}

impl std::fmt::Debug for Process {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Process")
            .field("config", &self.config)
            .field("controllers", &self.controllers)
            .field("webhook", &self.webhook)
            .finish_non_exhaustive()
    }
}

impl Process {
    /// A process that runs [`controllers`] and serves no webhook.
    pub fn new(config: Config, client: Client, shutdown: CancellationToken) -> Self {
        Self {
            config,
            client,
            controllers: controllers(),
            webhook: None,
            shutdown,
        }
    }

    /// Serves metrics and readiness, serves the webhook when there is one, takes part in the
    /// leader election and, while leading, runs the controllers, until `shutdown` is cancelled
    /// (then the Lease is released). A webhook that fails is logged and does not stop the
    /// controllers: the API server admits pods unchanged while it is away (`failurePolicy:
    /// Ignore`), and refuses claims and templates with a kerf config that it sends to this
    /// replica (`failurePolicy: Fail`, see `deploy/helm/kerf/templates/webhook.yaml`).
    ///
    /// # Errors
    ///
    /// - [`Error::Http`] when the metrics address cannot be bound;
    /// - [`Error::Config`] / [`Error::LeaderElection`] when the election cannot start;
    /// - [`Error::LeadershipLost`] when this replica led and lost the Lease;
    /// - the error of a controller that stopped on its own ([`Error::ControllerStopped`] when
    ///   it returned without one).
    pub async fn run(self) -> Result<()> {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let serving = self
            .webhook
            .as_ref()
            .map(|_| Arc::new(AtomicBool::new(false)));
        let (started, leader) = (ReadyFlag::new(), ReadyFlag::new());
        let webhook_serving = serving.as_ref().map(|s| ReadyFlag::from(Arc::clone(s)));
        let ready = http::ready_flags(&started, &leader, webhook_serving.as_ref());
        // One watch per kind for the whole process: the webhook's caches are the term's too.
        let process = self.webhook.as_ref().map(|_| {
            let (caches, fill) = ProcessCaches::start(&self.client);
            (caches, tokio::spawn(fill))
        });
        let webhook_shutdown = CancellationToken::new();
        let webhook_task = self.webhook.zip(serving).map(|(config, serving)| {
            spawn_webhook(webhook::Webhook {
                config,
                client: self.client.clone(),
                caches: process.as_ref().map(|(caches, _)| caches.clone()),
                metrics: metrics.clone(),
                serving,
                shutdown: webhook_shutdown.clone(),
            })
        });
        let http_shutdown = CancellationToken::new();
        let http = serve_http(self.config.metrics_address, registry, ready, &http_shutdown).await?;
        let term = Term {
            config: &self.config.controller,
            client: self.client,
            metrics: &metrics,
            started: &started,
            leader: &leader,
            controllers: self.controllers,
            process: process.as_ref().map(|(caches, _)| caches.clone()),
        };
        let result = match &self.config.leader_election {
            None => {
                started.set(true);
                term.lead(self.shutdown.child_token()).await
            }
            Some(lease) => elect_and_lead(lease, term, &self.shutdown).await,
        };
        http_shutdown.cancel();
        webhook_shutdown.cancel();
        let process_fill = process.map(|(_, fill)| fill);
        stop_serving(webhook_task, process_fill, http).await;
        result
    }
}

/// Runs the webhook on its own task; its failure is logged (see [`Process::run`]).
fn spawn_webhook(webhook: webhook::Webhook) -> JoinHandle<()> {
    tokio::spawn(async move {
        if let Err(error) = webhook::run(webhook).await {
            tracing::error!(%error, "admission webhook stopped; pods are admitted without the scheduling gate, and claims with a kerf config sent to this replica are refused");
        }
    })
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `address`, when there is one, until
/// `shutdown`.
async fn serve_http(
    address: Option<SocketAddr>,
    registry: Registry,
    ready: ReadyFlags,
    shutdown: &CancellationToken,
) -> Result<Option<JoinHandle<std::io::Result<()>>>> {
    let Some(address) = address else {
        return Ok(None);
    };
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(Error::Http)?;
    Ok(Some(tokio::spawn(kerf_ops::http::serve(
        listener,
        Arc::new(registry),
        ready,
        shutdown.clone(),
    ))))
}

/// Waits a while for the webhook, stops the process's watches, and waits for the HTTP server,
/// after their tokens were cancelled.
async fn stop_serving(
    webhook: Option<JoinHandle<()>>,
    process_fill: Option<JoinHandle<()>>,
    http: Option<JoinHandle<std::io::Result<()>>>,
) {
    if let Some(task) = webhook {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    if let Some(fill) = process_fill {
        // Abort is enough: the caches only hold watches, which close with the task.
        fill.abort();
    }
    if let Some(http) = http {
        match http.await {
            Ok(Err(error)) => tracing::warn!(%error, "HTTP server failed"),
            Err(join) => tracing::warn!(error = %join, "HTTP server task failed"),
            Ok(Ok(())) => {}
        }
    }
}

/// Waits for the Lease, leads until shutdown or until the Lease is lost.
async fn elect_and_lead(
    lease: &LeaseConfig,
    term: Term<'_>,
    shutdown: &CancellationToken,
) -> Result<()> {
    let Some(mut elector) = start_elector(&term.client, lease, shutdown).await? else {
        return Ok(());
    };
    term.started.set(true);
    tracing::info!(lease = %lease.name, namespace = %lease.namespace, identity = %lease.identity, "waiting for leadership");
    tokio::select! {
        () = shutdown.cancelled() => return elector.release().await,
        acquired = elector.acquired() => acquired?,
    }
    tracing::info!(identity = %lease.identity, "became leader");
    let stop = shutdown.child_token();
    let leading = term.lead(stop.clone());
    tokio::pin!(leading);
    tokio::select! {
        result = &mut leading => {
            if let Err(error) = elector.release().await {
                tracing::warn!(%error, "cannot release the Lease");
            }
            result
        }
        reason = elector.lost() => {
            tracing::error!(%reason, "lost leadership; stopping the controllers");
            stop.cancel();
            // The Lease is valid for others lease_duration after its last renewal and we gave
            // up renew_deadline after it: what is left is the time in-flight work may finish.
            let grace = lease.lease_duration.saturating_sub(lease.renew_deadline);
            if tokio::time::timeout(grace, &mut leading).await.is_err() {
                tracing::warn!(?grace, "controllers did not stop in time; abandoning them");
            }
            elector.abandon();
            Err(Error::LeadershipLost(reason))
        }
    }
}

/// Joins the election, retrying every `retry_period` while the API server cannot be reached
/// rather than failing: a replica restarted during an API outage (a leader that lost its Lease
/// exits) would otherwise exit again and again, and the kubelet's crash-loop back-off (10 s,
/// doubling to 5 min: kubernetes/kubernetes `pkg/kubelet/kubelet.go`, `backOffPeriod` and
/// `MaxContainerBackOff`) would keep it down long after the server is back. `None` when
/// `shutdown` came first.
async fn start_elector(
    client: &Client,
    lease: &LeaseConfig,
    shutdown: &CancellationToken,
) -> Result<Option<LeaderElector>> {
    let mut warned = false;
    loop {
        // Bounded: against a frozen server LeaseManager::new would wait for its answer.
        let start = tokio::time::timeout(
            lease.retry_period,
            LeaderElector::start(client.clone(), lease.clone()),
        );
        let failure = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            started = start => match started {
                Ok(Ok(elector)) => return Ok(Some(elector)),
                Ok(Err(error @ Error::Config(_))) => return Err(error),
                Ok(Err(error)) => error.to_string(),
                Err(_) => format!("no answer within {:?}", lease.retry_period),
            },
        };
        if warned {
            tracing::debug!(error = %failure, "cannot join the leader election yet; retrying");
        } else {
            tracing::warn!(error = %failure, "cannot join the leader election yet; retrying every --lease-retry-period");
            warned = true;
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(lease.retry_period) => {}
        }
    }
}

/// What a leadership term needs.
struct Term<'a> {
    config: &'a ControllerConfig,
    client: Client,
    metrics: &'a Metrics,
    /// Raised once the replica takes part in the election (`/readyz`).
    started: &'a ReadyFlag,
    /// Up while this replica leads (`/readyz` says leader or standby).
    leader: &'a ReadyFlag,
    controllers: Vec<ControllerTask>,
    /// The process's caches, when the webhook runs; `None` starts the term's own.
    process: Option<ProcessCaches>,
}

impl Term<'_> {
    /// Starts the caches and the controllers and runs them until `stop` is cancelled or one
    /// of them stops on its own (then the others are stopped too).
    async fn lead(self, stop: CancellationToken) -> Result<()> {
        let (leader, metrics) = (self.leader, self.metrics);
        leader.set(true);
        metrics.set_leader(true);
        let result = self.run_controllers(&stop).await;
        leader.set(false);
        metrics.set_leader(false);
        result
    }

    async fn run_controllers(self, stop: &CancellationToken) -> Result<()> {
        // Once per term, and a term is once per process (losing the Lease exits): one log
        // line per feature the server lacks, and the answer as a value for the reconcilers.
        let api_support = features::probe(
            &self.client,
            &self.config.driver_name,
            &self.config.field_manager,
        )
        .await;
        let (process, fill_process) = if let Some(process) = self.process {
            (process, None)
        } else {
            let (process, fill) = ProcessCaches::start(&self.client);
            (process, Some(tokio::spawn(fill)))
        };
        let (caches, fill_caches) =
            Caches::start_with(&process, &self.client, &self.config.driver_name);
        let ctx = Arc::new(
            Context::new(
                self.client,
                self.config.clone(),
                self.metrics.clone(),
                caches,
            )
            .with_api_support(api_support),
        );
        let caches_task = tokio::spawn(fill_caches);
        let first_error = supervise(self.controllers, &ctx, stop).await;
        caches_task.abort();
        // Abort is enough: the caches only hold watches, which close with the task.
        let _ = tokio::time::timeout(Duration::from_secs(5), caches_task).await;
        if let Some(fill) = fill_process {
            fill.abort();
            let _ = tokio::time::timeout(Duration::from_secs(5), fill).await;
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Runs `controllers` with `ctx` until `stop` is cancelled; the first one that stops on its own
/// cancels `stop`, and its error is returned once all have stopped.
async fn supervise(
    controllers: Vec<ControllerTask>,
    ctx: &Arc<Context>,
    stop: &CancellationToken,
) -> Option<Error> {
    let mut running: FuturesUnordered<_> = controllers
        .into_iter()
        .map(|task| {
            let name = task.name;
            let future = (task.start)(Arc::clone(ctx), stop.clone());
            async move { (name, future.await) }
        })
        .collect();
    let mut first_error = None;
    if running.is_empty() {
        stop.cancelled().await;
    }
    while let Some((name, result)) = running.next().await {
        if stop.is_cancelled() {
            if let Err(error) = result {
                tracing::warn!(controller = name, %error, "controller failed while stopping");
            }
            continue;
        }
        let error = result.err().unwrap_or_else(|| Error::ControllerStopped {
            name,
            message: "it returned before being asked to stop".to_owned(),
        });
        tracing::error!(controller = name, %error, "controller stopped; stopping the others");
        first_error = Some(error);
        stop.cancel();
    }
    first_error
}
