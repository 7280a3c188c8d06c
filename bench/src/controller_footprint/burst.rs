//! The load of `controller-footprint`: claims and pods created through kerf's webhooks, and
//! the kube-scheduler stand-in that reserves and binds each pod once kerf-controller has
//! allocated its claim and removed its gate.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _, stream};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_scheduler_standin::{
    BindOutcome, CycleOutcome, SchedulerStandIn, SeededRng, StandInConfig,
};
use kerf_tests::fake_api::FakeApi;
use kerf_tests::sim::workload::{PodPlan, Shape};
use kerf_tests::sim::{DRIVER, NAMESPACE};
use kube::Api;
use kube::api::PostParams;

use super::admission::{Admitter, Resource};
use crate::{Error, Result};

/// Creates (each through the webhooks) in flight at once: a handful of clients creating
/// pods at once, as a Job controller or `kubectl apply` of many objects does.
const IN_FLIGHT: usize = 16;
/// How long the stand-in sleeps when no pod waits for it and no reservation waits for PreBind
/// (kube-scheduler blocks on its queue; a short poll stands in for that wake-up).
const IDLE_POLL: Duration = Duration::from_millis(2);
/// How long a probe review may take to be gated by every replica: the webhooks' claim caches
/// catch up through their watches.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

/// The pods of one load, and what the stand-in saw of them.
pub(super) struct Load {
    plans: Vec<PodPlan>,
    admin: kube::Client,
    admitter: Admitter,
    stand_in: SchedulerStandIn,
    rng: SeededRng,
    /// When the stand-in bound each pod (`namespace/name`).
    bound: HashMap<String, Instant>,
}

/// What one load measured.
#[derive(Debug, Clone)]
pub(super) struct Timeline {
    /// The first claim was created.
    pub claims_started: Instant,
    /// The first pod was created.
    pub pods_started: Instant,
    /// The last pod was bound.
    pub last_bound: Instant,
    /// Creation of each pod to its binding.
    pub latencies: Vec<Duration>,
}

/// The plans of `count` pods named `<prefix>-<i>`, one Controller-class slice claim each
/// (10 GiB, 10 % of a GPU: the controller phase of `scheduling`).
pub(super) fn plans(prefix: &str, count: usize) -> Vec<PodPlan> {
    (0..count)
        .map(|i| PodPlan {
            name: format!("{prefix}-{i:04}"),
            shape: Shape::Slice {
                memory_gib: 10,
                compute: 10,
            },
            node: None,
        })
        .collect()
}

impl Load {
    /// A load creating `plans` as the cluster admin of `fake`, admitted by `admitter`, bound by
    /// a stand-in reading `fake`'s store (seed `seed`).
    pub(super) fn new(fake: &FakeApi, admitter: Admitter, plans: Vec<PodPlan>, seed: u64) -> Self {
        let admin = fake.client();
        let stand_in =
            SchedulerStandIn::with_config(admin.clone(), DRIVER, StandInConfig::default()).reading(
                kerf_tests::scheduler_snapshots::store_snapshots(fake.clone()),
            );
        Load {
            plans,
            admin,
            admitter,
            stand_in,
            rng: SeededRng::new(seed),
            bound: HashMap::new(),
        }
    }

    /// Creates every claim, waits until every replica's webhook knows the last one (its
    /// caches follow a watch), creates every pod and schedules until all are bound.
    ///
    /// # Errors
    /// A create, an admission or the stand-in's snapshot fails; a pod is admitted without
    /// kerf's gate; not every pod is bound within `timeout` of the first pod's creation.
    pub(super) async fn run(&mut self, replicas: usize, timeout: Duration) -> Result<Timeline> {
        let claims_started = Instant::now();
        let claims = Api::<ResourceClaim>::namespaced(self.admin.clone(), NAMESPACE);
        stream::iter(self.plans.iter().map(Ok))
            .try_for_each_concurrent(IN_FLIGHT, |plan| {
                let (claims, admitter) = (claims.clone(), self.admitter.clone());
                async move { create_claim(&claims, &admitter, plan).await }
            })
            .await?;
        if let Some(last) = self.plans.last() {
            self.probe(last, replicas).await?;
        }
        let pods_started = Instant::now();
        let pods = Api::<Pod>::namespaced(self.admin.clone(), NAMESPACE);
        let created: Vec<(String, Instant)> = {
            let admitter = &self.admitter;
            let create = stream::iter(self.plans.iter())
                .map(|plan| {
                    let (pods, admitter) = (pods.clone(), admitter.clone());
                    async move { create_pod(&pods, &admitter, plan).await }
                })
                .buffer_unordered(IN_FLIGHT)
                .try_collect::<Vec<_>>();
            let keys: Vec<String> = self.plans.iter().map(key).collect();
            let schedule = schedule_until_bound(
                &mut self.stand_in,
                &mut self.rng,
                &mut self.bound,
                &keys,
                pods_started + timeout,
            );
            let (created, ()) = futures::try_join!(create, schedule)?;
            created
        };
        let mut last_bound = pods_started;
        let mut latencies = Vec::with_capacity(created.len());
        for (key, at) in &created {
            let bound = self.bound.get(key).copied().unwrap_or(*at);
            last_bound = last_bound.max(bound);
            latencies.push(bound.saturating_duration_since(*at));
        }
        Ok(Timeline {
            claims_started,
            pods_started,
            last_bound,
            latencies,
        })
    }

    /// Sends a review of the pod of `plan` until `replicas` replicas in a row gate it (the
    /// reviews go to the replicas in turn).
    async fn probe(&self, plan: &PodPlan, replicas: usize) -> Result<()> {
        let deadline = Instant::now() + PROBE_TIMEOUT;
        let mut in_a_row = 0;
        while in_a_row < replicas {
            let mut pod = plan.pod(NAMESPACE);
            if self
                .admitter
                .admit(Resource::Pod, NAMESPACE, &mut pod)
                .await?
            {
                in_a_row += 1;
            } else {
                in_a_row = 0;
                if Instant::now() > deadline {
                    return Err(Error::Workload(format!(
                        "the webhooks did not know claim {} within {PROBE_TIMEOUT:?}",
                        plan.claim_name()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }
}

fn key(plan: &PodPlan) -> String {
    format!("{NAMESPACE}/{}", plan.name)
}

async fn create_claim(
    claims: &Api<ResourceClaim>,
    admitter: &Admitter,
    plan: &PodPlan,
) -> Result<()> {
    let mut claim = plan.shape.claim(&plan.claim_name(), NAMESPACE, DRIVER);
    admitter
        .admit(Resource::Claim, NAMESPACE, &mut claim)
        .await?;
    let claim: ResourceClaim =
        serde_json::from_value(claim).map_err(|e| Error::Workload(format!("claim: {e}")))?;
    claims
        .create(&PostParams::default(), &claim)
        .await
        .map_err(|e| Error::Workload(format!("create claim {}: {e}", plan.claim_name())))?;
    Ok(())
}

async fn create_pod(
    pods: &Api<Pod>,
    admitter: &Admitter,
    plan: &PodPlan,
) -> Result<(String, Instant)> {
    let mut pod = plan.pod(NAMESPACE);
    if !admitter.admit(Resource::Pod, NAMESPACE, &mut pod).await? {
        return Err(Error::Workload(format!(
            "kerf's webhook admitted pod {} without its scheduling gate",
            plan.name
        )));
    }
    let pod: Pod = serde_json::from_value(pod).map_err(|e| Error::Workload(format!("pod: {e}")))?;
    let at = Instant::now();
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(|e| Error::Workload(format!("create pod {}: {e}", plan.name)))?;
    Ok((key(plan), at))
}

/// Runs the stand-in as kube-scheduler's loop runs (a step whenever a pod may wait for it or
/// a reservation waits for PreBind, a short sleep otherwise) until every pod of `keys` is
/// bound.
async fn schedule_until_bound(
    stand_in: &mut SchedulerStandIn,
    rng: &mut SeededRng,
    bound: &mut HashMap<String, Instant>,
    keys: &[String],
    deadline: Instant,
) -> Result<()> {
    while !keys.iter().all(|k| bound.contains_key(k)) {
        if Instant::now() > deadline {
            let missing = keys.iter().filter(|k| !bound.contains_key(*k)).count();
            return Err(Error::Workload(format!(
                "{missing} of {} pods not bound in time",
                keys.len()
            )));
        }
        let report = stand_in
            .step(rng)
            .await
            .map_err(|e| Error::Workload(format!("stand-in snapshot: {e}")))?;
        for outcome in &report.bound {
            if let BindOutcome::Bound { pod, .. } = outcome {
                bound.entry(pod.clone()).or_insert_with(Instant::now);
            }
        }
        let idle = report.cycle == CycleOutcome::Idle && report.bound.is_empty();
        if idle && stand_in.pending_prebinds().is_empty() {
            tokio::time::sleep(IDLE_POLL).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}
