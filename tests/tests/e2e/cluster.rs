//! The cluster side of the suite: the per-test runner (namespace, cleanup, state dump on
//! failure) and the reads and waits the tests share.

use std::fmt::{Debug, Write as _};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use futures::FutureExt as _;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kerf_api::{GpuClass, GpuClassSpec};
use kube::api::{DeleteParams, ListParams, LogParams, PostParams};
use kube::{Api, Client, Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::checks::{self, ContainerReport, PublishedDevice};
use super::manifests;
use super::settings::Settings;
use super::sharing::Burst;
use super::wait::{self, Outcome, Poll};

/// Tests share the cluster's GPUs: one at a time, so one test's allocations cannot change
/// where another's land (BinPack would pack onto a GPU another test is using).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a test body gets: a client, the settings and its own namespace.
#[derive(Clone)]
pub struct TestEnv {
    /// Client of the cluster under test.
    pub client: Client,
    /// The suite's settings.
    pub settings: Settings,
    /// The test's namespace, deleted after the test.
    pub namespace: String,
    /// Cluster-scoped objects (GpuClasses) to delete after the test.
    gpu_classes: Arc<Mutex<Vec<String>>>,
}

/// Runs one e2e test: waits for the cluster to be free of other tests of this binary, checks
/// the cluster serves what the suite needs, creates the test's namespace, runs `body`, dumps
/// the namespace's state when `body` fails or panics, and deletes everything the test made
/// (also on failure: the cleanup runs in a guard's `Drop`).
pub async fn e2e<F, Fut>(test: &str, body: F) -> Result<()>
where
    F: FnOnce(TestEnv) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    run(test, true, body).await
}

/// [`e2e`] for a test that installs kerf itself: the cluster must serve DRA, not yet kerf's
/// CRD.
pub async fn e2e_installing_kerf<F, Fut>(test: &str, body: F) -> Result<()>
where
    F: FnOnce(TestEnv) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    run(test, false, body).await
}

async fn run<F, Fut>(test: &str, needs_kerf: bool, body: F) -> Result<()>
where
    F: FnOnce(TestEnv) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let _serial = SERIAL.lock().await;
    let settings = Settings::from_env()?;
    let config = kube::Config::infer()
        .await
        .context("no cluster to test: set KUBECONFIG to a cluster where kerf runs")?;
    let client = Client::try_from(config.clone()).context("building the API client")?;
    preflight(&client, needs_kerf).await?;
    let created = Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &manifests::namespace(test))
        .await
        .context("creating the test namespace")?;
    let namespace = created
        .metadata
        .name
        .context("the API server returned a namespace without a name")?;
    let gpu_classes = Arc::new(Mutex::new(Vec::new()));
    let _cleanup = Cleanup {
        config,
        namespace: namespace.clone(),
        gpu_classes: Arc::clone(&gpu_classes),
        timeout: settings.timeout,
    };
    let env = TestEnv {
        client,
        settings,
        namespace: namespace.clone(),
        gpu_classes,
    };
    eprintln!("[{test}] namespace {namespace}");
    match AssertUnwindSafe(body(env.clone())).catch_unwind().await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(anyhow!(
            "{error:?}\n\n--- state of namespace {namespace} ---\n{}",
            env.dump().await
        )),
        Err(panic) => {
            eprintln!(
                "--- state of namespace {namespace} ---\n{}",
                env.dump().await
            );
            std::panic::resume_unwind(panic)
        }
    }
}

/// Fails early, in words, when the cluster lacks the DRA API or, with `needs_kerf`, kerf's CRD.
async fn preflight(client: &Client, needs_kerf: bool) -> Result<()> {
    let one = ListParams::default().limit(1);
    Api::<ResourceSlice>::all(client.clone())
        .list(&one)
        .await
        .context("listing resource.k8s.io/v1 ResourceSlices failed: the suite needs Kubernetes 1.35+ (DRA v1)")?;
    if !needs_kerf {
        return Ok(());
    }
    Api::<GpuClass>::all(client.clone())
        .list(&one)
        .await
        .context("listing GpuClasses failed: is kerf's CRD (deploy/helm/kerf/crds/) installed?")?;
    Ok(())
}

/// Deletes the test's namespace and GpuClasses when dropped, and waits (bounded) until the
/// namespace is gone, so the next test starts with the GPUs this one used free again.
struct Cleanup {
    config: kube::Config,
    namespace: String,
    gpu_classes: Arc<Mutex<Vec<String>>>,
    timeout: Duration,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let config = self.config.clone();
        let namespace = self.namespace.clone();
        let classes = self
            .gpu_classes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let timeout = self.timeout;
        // The test's runtime may be unwinding or single-threaded; a thread with its own
        // runtime and client can block here whatever state that runtime is in.
        let joined = std::thread::spawn(move || -> Result<()> {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(clean_up(config, &namespace, &classes, timeout))
        })
        .join();
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!(
                "cleanup of namespace {} incomplete: {error:#}",
                self.namespace
            ),
            Err(_) => eprintln!("cleanup of namespace {} panicked", self.namespace),
        }
    }
}

async fn clean_up(
    config: kube::Config,
    namespace: &str,
    gpu_classes: &[String],
    timeout: Duration,
) -> Result<()> {
    let client = Client::try_from(config)?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    delete_ignoring_absent(&namespaces, namespace).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let gone = wait::poll_until(
        format_args!("namespace {namespace} to be deleted"),
        timeout,
        || async {
            if namespaces.get_opt(namespace).await?.is_none() {
                return Ok(Poll::Ready(()));
            }
            let left: Vec<String> = claims
                .list(&ListParams::default())
                .await?
                .iter()
                .map(checks::describe_claim)
                .collect();
            Ok(Poll::Pending(format!(
                "still terminating; claims left: {left:?}"
            )))
        },
    )
    .await;
    // The classes go even when the namespace is stuck: they are cluster-scoped leftovers.
    let classes: Api<GpuClass> = Api::all(client);
    for class in gpu_classes {
        delete_ignoring_absent(&classes, class).await?;
    }
    gone
}

async fn delete_ignoring_absent<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(error) => Err(error).with_context(|| format!("deleting {name}")),
    }
}

/// The state a pod can be awaited in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    /// Phase `Running`.
    Running,
    /// Phase `Succeeded` (a pod with restart policy `Never` whose container exited 0).
    Succeeded,
}

impl TestEnv {
    /// The namespaced API of `K` in the test's namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Creates `object` in the test's namespace.
    pub async fn create<K>(&self, object: &K) -> Result<K>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + Serialize
            + Debug,
    {
        self.api::<K>()
            .create(&PostParams::default(), object)
            .await
            .with_context(|| format!("creating {} {}", K::kind(&()), object.name_any()))
    }

    /// Creates a GpuClass (deleted after the test) and waits for kerf's controller to create
    /// its DeviceClass, which has the GpuClass's name. Returns that name.
    pub async fn gpu_class(&self, test: &str, spec: GpuClassSpec) -> Result<String> {
        let classes: Api<GpuClass> = Api::all(self.client.clone());
        let created = classes
            .create(&PostParams::default(), &manifests::gpu_class(test, spec))
            .await
            .context("creating a GpuClass")?;
        let name = created.name_any();
        self.gpu_classes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(name.clone());
        let device_classes: Api<DeviceClass> = Api::all(self.client.clone());
        wait::poll_until(
            format_args!("kerf's controller to create DeviceClass {name} for GpuClass {name}"),
            self.settings.timeout,
            || async {
                if device_classes.get_opt(&name).await?.is_some() {
                    return Ok(Poll::Ready(()));
                }
                let status = classes.get(&name).await?.status;
                Ok(Poll::Pending(format!(
                    "no DeviceClass; GpuClass status: {status:?} (is kerf's controller running?)"
                )))
            },
        )
        .await?;
        Ok(name)
    }

    /// kerf's ResourceSlices (every pool of the driver).
    pub async fn kerf_slices(&self) -> Result<Vec<ResourceSlice>> {
        let params = ListParams::default().fields(&format!("spec.driver={}", self.settings.driver));
        Ok(Api::<ResourceSlice>::all(self.client.clone())
            .list(&params)
            .await
            .context("listing kerf's ResourceSlices")?
            .items)
    }

    /// Every device kerf publishes, from each pool's current generation.
    pub async fn published(&self) -> Result<Vec<PublishedDevice>> {
        Ok(checks::published_devices(
            &self.kerf_slices().await?,
            &self.settings.driver,
        ))
    }

    /// The published device `device` of pool `node`.
    pub async fn published_device(&self, node: &str, device: &str) -> Result<PublishedDevice> {
        self.published()
            .await?
            .into_iter()
            .find(|d| d.node == node && d.name == device)
            .with_context(|| format!("no device {device} in kerf's pool {node}"))
    }

    /// Reads claim `name`.
    pub async fn claim(&self, name: &str) -> Result<ResourceClaim> {
        self.api::<ResourceClaim>()
            .get(name)
            .await
            .with_context(|| format!("reading ResourceClaim {name}"))
    }

    /// Waits until claim `name` satisfies `ready` (described by `what`).
    pub async fn wait_claim(
        &self,
        name: &str,
        what: &str,
        ready: impl Fn(&ResourceClaim) -> bool,
    ) -> Result<ResourceClaim> {
        let claims = self.api::<ResourceClaim>();
        wait::poll_until(
            format_args!("claim {name} to be {what}"),
            self.settings.timeout,
            || async {
                let claim = claims.get(name).await?;
                if ready(&claim) {
                    Ok(Poll::Ready(claim))
                } else {
                    Ok(Poll::Pending(checks::describe_claim(&claim)))
                }
            },
        )
        .await
    }

    /// Runs pod `name` with a claim `name` of a new Scheduler GpuClass (one whole GPU), its
    /// container reporting and then sleeping, and waits until it is Running. Returns the pod.
    pub async fn run_whole_gpu_pod(&self, name: &str) -> Result<Pod> {
        let class = self
            .gpu_class(name, manifests::scheduler_class_spec())
            .await?;
        let spec = manifests::claim_spec(&class, &self.settings.driver, None, &[]);
        self.create(&manifests::resource_claim(name, spec)).await?;
        let pod_spec = manifests::pod_spec(
            &self.settings,
            manifests::PodClaim::Claim(name),
            manifests::Script::ReportAndSleep,
            "Never",
        );
        self.create(&manifests::pod(name, pod_spec, false)).await?;
        self.wait_pod(name, PodState::Running).await
    }

    /// Waits until pod `name` is in `state`; a pod that fails ends the wait with its logs.
    pub async fn wait_pod(&self, name: &str, state: PodState) -> Result<Pod> {
        let pods = self.api::<Pod>();
        wait::fail_fast(
            format_args!("pod {name} to be {state:?}"),
            self.settings.timeout,
            || async {
                let pod = pods.get(name).await?;
                let phase = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.as_deref())
                    .unwrap_or_default();
                match (phase, state) {
                    ("Running", PodState::Running) | ("Succeeded", PodState::Succeeded) => {
                        Ok(Poll::Ready(pod))
                    }
                    ("Failed", _) | ("Succeeded", PodState::Running) => {
                        let logs = self.logs(name).await.unwrap_or_else(|e| format!("{e:#}"));
                        Err(Outcome::Stop(anyhow!(
                            "pod {name} ended ({}); logs:\n{logs}",
                            describe_pod(&pod)
                        )))
                    }
                    _ => Ok(Poll::Pending(describe_pod(&pod))),
                }
            },
        )
        .await
    }

    /// Waits until object `name` of `api` no longer exists.
    pub async fn wait_gone<K>(&self, api: &Api<K>, name: &str) -> Result<()>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    {
        wait::poll_until(
            format_args!("{} {name} to be gone", K::kind(&())),
            self.settings.timeout,
            || async {
                Ok(match api.get_opt(name).await? {
                    None => Poll::Ready(()),
                    Some(object) => Poll::Pending(format!(
                        "still there (deletionTimestamp {:?}, finalizers {:?})",
                        object.meta().deletion_timestamp,
                        object.meta().finalizers
                    )),
                })
            },
        )
        .await
    }

    /// Waits until every pod of `names` is Running, at most `timeout`; a pod that ends (or
    /// fails) ends the wait with its description. Returns the pods in the order of `names`.
    pub async fn wait_all_running(&self, names: &[String], timeout: Duration) -> Result<Vec<Pod>> {
        let pods = self.api::<Pod>();
        wait::fail_fast(
            format_args!("{} pods to be Running", names.len()),
            timeout,
            || async {
                let listed = pods.list(&ListParams::default()).await?.items;
                let mut running = Vec::new();
                let mut waiting = Vec::new();
                for name in names {
                    let Some(pod) = listed.iter().find(|p| p.name_any() == *name) else {
                        waiting.push(format!("pod {name}: not found"));
                        continue;
                    };
                    match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
                        Some("Running") => running.push(pod.clone()),
                        Some("Succeeded" | "Failed") => {
                            return Err(Outcome::Stop(anyhow!(
                                "pod {name} ended: {}",
                                describe_pod(pod)
                            )));
                        }
                        _ => waiting.push(describe_pod(pod)),
                    }
                }
                Ok(if waiting.is_empty() {
                    Poll::Ready(running)
                } else {
                    Poll::Pending(format!(
                        "{}/{} Running; not yet:\n{}",
                        running.len(),
                        names.len(),
                        waiting.join("\n")
                    ))
                })
            },
        )
        .await
    }

    /// Deletes pod `name` and waits until it is gone: the kubelet has stopped its container
    /// and unprepared its claims.
    pub async fn delete_pod(&self, name: &str) -> Result<()> {
        let pods = self.api::<Pod>();
        pods.delete(name, &DeleteParams::default())
            .await
            .with_context(|| format!("deleting pod {name}"))?;
        self.wait_gone(&pods, name).await
    }

    /// The logs of pod `name`'s container.
    pub async fn logs(&self, name: &str) -> Result<String> {
        self.api::<Pod>()
            .logs(name, &LogParams::default())
            .await
            .with_context(|| format!("reading the logs of pod {name}"))
    }

    /// What pod `name`'s container reported, once its report is complete: a Running
    /// container may not have printed all of it yet.
    pub async fn wait_report(&self, name: &str) -> Result<ContainerReport> {
        wait::poll_until(
            format_args!("pod {name}'s container to print its whole report"),
            self.settings.timeout,
            || async {
                let logs = self.logs(name).await?;
                Ok(match ContainerReport::parse(&logs) {
                    Ok(report) => Poll::Ready(report),
                    Err(error) => Poll::Pending(format!("{error:#}")),
                })
            },
        )
        .await
    }

    /// Fails unless DeviceClasses of all `names` exist (classes the test does not make, such
    /// as the defaults kerf's deployment installs).
    pub async fn require_device_classes(&self, names: &[&str]) -> Result<()> {
        let classes: Api<DeviceClass> = Api::all(self.client.clone());
        for name in names {
            if classes.get_opt(name).await?.is_none() {
                bail!("no DeviceClass {name}: the test uses the chart's default GpuClasses");
            }
        }
        Ok(())
    }

    /// The first node (by name) whose idle kerf GPUs fit `burst`.
    pub async fn node_fitting(&self, burst: &Burst) -> Result<String> {
        let claims = self.all_claims().await?;
        let published = self.published().await?;
        let nodes = burst.fitting_nodes(&claims, &self.settings.driver, &published);
        match nodes.into_iter().next() {
            Some(node) => Ok(node),
            None => bail!(
                "no node's idle kerf GPUs fit {burst:?} (8 × H100 80GB do: deploy/kerf-mock.yaml); kerf allocations:\n{}",
                self.kerf_allocations().await?.join("\n")
            ),
        }
    }

    /// Every ResourceClaim in the cluster, in all namespaces.
    pub async fn all_claims(&self) -> Result<Vec<ResourceClaim>> {
        Ok(Api::<ResourceClaim>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("listing the cluster's ResourceClaims")?
            .items)
    }

    /// The Events about object `kind`/`name` in the test's namespace, oldest first.
    pub async fn events_about(&self, kind: &str, name: &str) -> Result<Vec<Event>> {
        let params = ListParams::default().fields(&format!(
            "involvedObject.kind={kind},involvedObject.name={name}"
        ));
        let mut events = self.api::<Event>().list(&params).await?.items;
        events.sort_by_key(|e| e.metadata.creation_timestamp.clone().map(|t| t.0));
        Ok(events)
    }

    /// Waits for an Event with `reason` about `kind`/`name`.
    pub async fn wait_event(&self, kind: &str, name: &str, reason: &str) -> Result<Event> {
        wait::poll_until(
            format_args!("an Event {reason} about {kind} {name}"),
            self.settings.timeout,
            || async {
                let events = self.events_about(kind, name).await?;
                if let Some(event) = events.iter().find(|e| e.reason.as_deref() == Some(reason)) {
                    return Ok(Poll::Ready(event.clone()));
                }
                let seen: Vec<String> = events.iter().map(describe_event).collect();
                Ok(Poll::Pending(format!("events: {seen:?}")))
            },
        )
        .await
    }

    /// Every claim in the cluster with a result of kerf's driver, one line each: what else
    /// holds kerf GPUs (for messages about where allocations landed).
    pub async fn kerf_allocations(&self) -> Result<Vec<String>> {
        let claims = self.all_claims().await?;
        Ok(claims
            .iter()
            .filter(|c| !checks::allocation_results(c, &self.settings.driver).is_empty())
            .map(|c| {
                format!(
                    "{}/{}",
                    c.namespace().unwrap_or_default(),
                    checks::describe_claim(c)
                )
            })
            .collect())
    }

    /// Pods, claims and Events of the test's namespace, for a failure message.
    pub async fn dump(&self) -> String {
        let mut out = String::new();
        match self.api::<Pod>().list(&ListParams::default()).await {
            Ok(pods) => {
                for pod in &pods {
                    let _ = writeln!(out, "{}", describe_pod(pod));
                }
            }
            Err(e) => {
                let _ = writeln!(out, "listing pods failed: {e}");
            }
        }
        match self
            .api::<ResourceClaim>()
            .list(&ListParams::default())
            .await
        {
            Ok(claims) => {
                for claim in &claims {
                    let _ = writeln!(out, "{}", checks::describe_claim(claim));
                }
            }
            Err(e) => {
                let _ = writeln!(out, "listing claims failed: {e}");
            }
        }
        match self.api::<Event>().list(&ListParams::default()).await {
            Ok(events) => {
                let mut events = events.items;
                events.sort_by_key(|e| e.metadata.creation_timestamp.clone().map(|t| t.0));
                for event in &events {
                    let _ = writeln!(out, "{}", describe_event(event));
                }
            }
            Err(e) => {
                let _ = writeln!(out, "listing events failed: {e}");
            }
        }
        out
    }
}

/// One line about a pod: phase, node, gates, conditions, container states, claim statuses.
pub fn describe_pod(pod: &Pod) -> String {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let gates: Vec<&str> = spec
        .and_then(|s| s.scheduling_gates.as_ref())
        .into_iter()
        .flatten()
        .map(|g| g.name.as_str())
        .collect();
    let conditions: Vec<String> = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}={} {} {}",
                c.type_,
                c.status,
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default()
            )
        })
        .collect();
    let containers: Vec<String> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .map(|c| {
            let state = c.state.as_ref();
            match (
                state.and_then(|s| s.waiting.as_ref()),
                state.and_then(|s| s.terminated.as_ref()),
            ) {
                (Some(w), _) => format!(
                    "{} waiting {} {}",
                    c.name,
                    w.reason.as_deref().unwrap_or_default(),
                    w.message.as_deref().unwrap_or_default()
                ),
                (_, Some(t)) => format!(
                    "{} terminated exit={} {}",
                    c.name,
                    t.exit_code,
                    t.reason.as_deref().unwrap_or_default()
                ),
                _ => format!("{} running", c.name),
            }
        })
        .collect();
    let claims: Vec<String> = status
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}->{}",
                c.name,
                c.resource_claim_name.as_deref().unwrap_or("?")
            )
        })
        .collect();
    format!(
        "pod {}: phase={} node={:?} gates={gates:?} conditions={conditions:?} containers={containers:?} claims={claims:?} deleting={}",
        pod.name_any(),
        status.and_then(|s| s.phase.as_deref()).unwrap_or("?"),
        spec.and_then(|s| s.node_name.as_deref()),
        pod.metadata.deletion_timestamp.is_some(),
    )
}

fn describe_event(event: &Event) -> String {
    format!(
        "event {} {} {}/{}: {}",
        event.type_.as_deref().unwrap_or_default(),
        event.reason.as_deref().unwrap_or_default(),
        event.involved_object.kind.as_deref().unwrap_or_default(),
        event.involved_object.name.as_deref().unwrap_or_default(),
        event.message.as_deref().unwrap_or_default()
    )
}
