//! Cluster benchmark of the controller path: how fast pods bind through kerf-controller's slices
//! against kube-scheduler's structured allocation, on the same kubelet-less nodes of a real
//! control plane (nothing paused, creation → all bound).
//!
//! The test makes `KERF_E2E_TP_NODES` Ready nodes (32 CPU, 128Gi, 110 pods;
//! `tests/tests/e2e/fake_nodes.rs`) with 8 mock H100 each, then runs the phases of
//! `KERF_E2E_TP_ORDER`, each `KERF_E2E_TP_PODS` pods created at once (`KERF_E2E_TP_CREATORS`
//! requests in flight):
//! - `controller`: the nodes pinned to kerf-controller (`gpu.kerf.dev/allocator=controller`),
//!   each pod with one claim from a template of a Controller GpuClass slice of 5Gi / 10 %;
//! - `structured`: the nodes pinned to kube-scheduler (`…=scheduler`), each pod with one claim
//!   from a template of a Scheduler GpuClass (one whole GPU: kube-scheduler's structured
//!   allocation, kerf-controller only labels the claim's node).
//!
//! Before each phase the nodes are pinned and their GPUs published under the new owner (the
//! test plays the plugin's part), and after a move to the controller it waits
//! `KERF_E2E_TP_SETTLE_SECONDS` for the ownership fence, so no move is measured. A watch on the
//! namespace's pods sees each binding; the phase's rate is its pods over the time from the
//! first creation to the last binding. With `KERF_E2E_TP_CPU` set (e.g. `4`) every pod also
//! asks that much `cpu` (and 1Gi of memory), so kerf-controller's node filters run.
//!
//! Per phase it prints, from kube-apiserver's `/metrics` before and after
//! (`apiserver_request_total`), the API writes per pod by verb and resource (all clients,
//! kubelet heartbeats and leases included), and the admission webhooks' calls and mean
//! latency (`apiserver_admission_webhook_admission_duration_seconds`). With
//! `KERF_E2E_TP_PIDS` (`name=pid,…`, processes on the machine running the test, e.g. the
//! control plane's and kerf-controller's) it prints each one's CPU during the phase from
//! `/proc/<pid>/stat`, in ms per pod.
//!
//! `#[ignore = "needs cluster"]`; run with
//! `KUBECONFIG=… cargo test -p kerf-tests --test e2e throughput:: -- --ignored --nocapture`.
//! Needs what `e2e_node_fit` needs (kerf from `deploy/`, no node lifecycle controller).
//! Environment: `KERF_E2E_TP_NODES` (100), `KERF_E2E_TP_PODS` (500, at most 8 per node),
//! `KERF_E2E_TP_ORDER` (`controller,structured,structured,controller`), `KERF_E2E_TP_CPU`
//! (none), `KERF_E2E_TP_CREATORS` (64), `KERF_E2E_TP_BIND_SECONDS` (600),
//! `KERF_E2E_TP_SETTLE_SECONDS` (12), `KERF_E2E_TP_PIDS` (none).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{Pod, ResourceRequirements, Toleration};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kerf_api::ownership::Owner;
use kube::api::{DeleteParams, ListParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use tokio::sync::oneshot;

use crate::cluster::{TestEnv, e2e};
use crate::fake_nodes;
use crate::fake_nodes::{FakeNodes, LABEL, Shape};
use crate::manifests;
use crate::manifests::{PodClaim, Script};
use crate::wait;
use crate::wait::Poll;

const TEST: &str = "throughput";

/// One measured phase: which allocator binds the pods' GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// kerf-controller's slices (Controller GpuClass).
    Controller,
    /// kube-scheduler's structured allocation (Scheduler GpuClass, whole GPUs).
    Structured,
}

impl Path {
    fn parse(word: &str) -> Result<Self> {
        match word.trim() {
            "controller" => Ok(Path::Controller),
            "structured" => Ok(Path::Structured),
            other => bail!("KERF_E2E_TP_ORDER: {other:?} is neither controller nor structured"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Path::Controller => "controller",
            Path::Structured => "structured",
        }
    }

    fn owner(self) -> Owner {
        match self {
            Path::Controller => Owner::Controller,
            Path::Structured => Owner::Scheduler,
        }
    }
}

/// What the environment asks of the run.
#[derive(Debug, Clone)]
struct Plan {
    nodes: usize,
    pods: usize,
    order: Vec<Path>,
    cpu: Option<String>,
    creators: usize,
    bind: Duration,
    settle: Duration,
    pids: Vec<(String, u32)>,
}

fn env_text(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

fn env_number(name: &str, default: u64) -> Result<u64> {
    env_text(name).map_or(Ok(default), |text| {
        text.parse()
            .with_context(|| format!("{name}={text:?}: expected a whole number"))
    })
}

/// `name=pid,…` of `KERF_E2E_TP_PIDS`.
fn parse_pids(text: &str) -> Result<Vec<(String, u32)>> {
    text.split(',')
        .filter(|item| !item.trim().is_empty())
        .map(|item| {
            let (name, pid) = item
                .split_once('=')
                .with_context(|| format!("KERF_E2E_TP_PIDS: {item:?} is not name=pid"))?;
            let pid = pid
                .trim()
                .parse()
                .with_context(|| format!("KERF_E2E_TP_PIDS: {item:?}: bad pid"))?;
            Ok((name.trim().to_owned(), pid))
        })
        .collect()
}

impl Plan {
    fn from_env() -> Result<Self> {
        let nodes = usize::try_from(env_number("KERF_E2E_TP_NODES", 100)?)?;
        let pods = usize::try_from(env_number("KERF_E2E_TP_PODS", 500)?)?;
        ensure!(nodes >= 1, "at least one fake node is needed");
        ensure!(
            pods <= nodes * fake_nodes::GPUS_PER_NODE,
            "{pods} pods of a whole GPU each cannot bind on {nodes} nodes of 8 GPUs"
        );
        let order = env_text("KERF_E2E_TP_ORDER")
            .unwrap_or_else(|| "controller,structured,structured,controller".to_owned())
            .split(',')
            .map(Path::parse)
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            nodes,
            pods,
            order,
            cpu: env_text("KERF_E2E_TP_CPU"),
            creators: usize::try_from(env_number("KERF_E2E_TP_CREATORS", 64)?)?.max(1),
            bind: Duration::from_secs(env_number("KERF_E2E_TP_BIND_SECONDS", 600)?),
            settle: Duration::from_secs(env_number("KERF_E2E_TP_SETTLE_SECONDS", 12)?),
            pids: parse_pids(&env_text("KERF_E2E_TP_PIDS").unwrap_or_default())?,
        })
    }
}

/// A pod of the phase: one claim from `template`, for the fake nodes only, asking `cpu` (and
/// 1Gi of memory) when given.
fn phase_pod(env: &TestEnv, name: &str, template: &str, cpu: Option<&str>) -> Pod {
    let mut spec = manifests::pod_spec(
        &env.settings,
        PodClaim::Template(template),
        Script::ReportAndSleep,
        "Never",
    );
    spec.node_selector = Some(BTreeMap::from([(LABEL.to_owned(), "true".to_owned())]));
    spec.tolerations.get_or_insert_default().push(Toleration {
        key: Some(LABEL.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    });
    if let Some(cpu) = cpu {
        for container in &mut spec.containers {
            let resources = container
                .resources
                .get_or_insert_with(ResourceRequirements::default);
            resources.requests = Some(BTreeMap::from([
                ("cpu".to_owned(), Quantity(cpu.to_owned())),
                ("memory".to_owned(), Quantity("1Gi".to_owned())),
            ]));
        }
    }
    manifests::pod(name, spec, false)
}

/// The counters read from kube-apiserver's `/metrics`.
#[derive(Debug, Clone, Default)]
struct Metrics {
    /// Requests by `VERB resource[/subresource]`, writes only (not GET, LIST, WATCH).
    writes: BTreeMap<String, f64>,
    /// Admission webhook calls and their summed seconds, by webhook name.
    webhooks: BTreeMap<String, (f64, f64)>,
}

/// The value of `label="…"` in a metric line's label set.
fn label<'a>(labels: &'a str, name: &str) -> &'a str {
    let key = format!("{name}=\"");
    labels
        .split(',')
        .find_map(|pair| pair.strip_prefix(key.as_str()))
        .and_then(|rest| rest.strip_suffix('"'))
        .unwrap_or_default()
}

/// The label set and value of a line of `metric{…} value`.
fn sample<'a>(line: &'a str, metric: &str) -> Option<(&'a str, f64)> {
    let rest = line.strip_prefix(metric)?.strip_prefix('{')?;
    let (labels, value) = rest.rsplit_once("} ")?;
    Some((labels, value.trim().parse().ok()?))
}

impl Metrics {
    fn parse(text: &str) -> Self {
        let mut metrics = Metrics::default();
        for line in text.lines() {
            if let Some((labels, value)) = sample(line, "apiserver_request_total") {
                let verb = label(labels, "verb");
                if matches!(verb, "GET" | "LIST" | "WATCH") {
                    continue;
                }
                let sub = label(labels, "subresource");
                let key = if sub.is_empty() {
                    format!("{verb} {}", label(labels, "resource"))
                } else {
                    format!("{verb} {}/{sub}", label(labels, "resource"))
                };
                *metrics.writes.entry(key).or_default() += value;
            }
            for (metric, sum) in [
                (
                    "apiserver_admission_webhook_admission_duration_seconds_count",
                    false,
                ),
                (
                    "apiserver_admission_webhook_admission_duration_seconds_sum",
                    true,
                ),
            ] {
                if let Some((labels, value)) = sample(line, metric) {
                    let entry = metrics
                        .webhooks
                        .entry(label(labels, "name").to_owned())
                        .or_default();
                    if sum {
                        entry.1 += value;
                    } else {
                        entry.0 += value;
                    }
                }
            }
        }
        metrics
    }

    async fn scrape(client: &Client) -> Result<Self> {
        let request = http::Request::get("/metrics").body(Vec::new())?;
        let text = client
            .request_text(request)
            .await
            .context("reading kube-apiserver's /metrics")?;
        Ok(Metrics::parse(&text))
    }

    /// What happened between `self` and `after`, per pod, in words.
    fn report(&self, after: &Metrics, pods: usize) -> String {
        #[allow(clippy::cast_precision_loss, reason = "pod counts are small")]
        let pods = pods.max(1) as f64;
        let mut out = String::new();
        let mut total = 0.0;
        for (key, value) in &after.writes {
            let delta = value - self.writes.get(key).copied().unwrap_or_default();
            if delta > 0.0 {
                total += delta;
                let _ = writeln!(out, "    {key}: {:.2} per pod", delta / pods);
            }
        }
        let _ = writeln!(out, "    all writes: {:.2} per pod", total / pods);
        for (name, (count, seconds)) in &after.webhooks {
            let (count_before, seconds_before) =
                self.webhooks.get(name).copied().unwrap_or_default();
            let calls = count - count_before;
            if calls > 0.0 {
                let _ = writeln!(
                    out,
                    "    webhook {name}: {:.2} calls per pod, mean {:.1} ms",
                    calls / pods,
                    1000.0 * (seconds - seconds_before) / calls
                );
            }
        }
        out
    }
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks = |i: usize| -> Result<f64> {
        fields
            .get(i)
            .with_context(|| format!("/proc/{pid}/stat has no field {i}"))?
            .parse::<f64>()
            .with_context(|| format!("/proc/{pid}/stat field {i}"))
    };
    // USER_HZ is 100 on Linux.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

fn cpu_of(pids: &[(String, u32)]) -> Vec<Option<f64>> {
    pids.iter().map(|(_, pid)| cpu_seconds(*pid).ok()).collect()
}

/// Waits (on a watch) until `pods` pods of the namespace are bound; returns the instant of
/// the last binding. `ready` is sent once the watch has started.
async fn watch_bound(
    env: TestEnv,
    prefix: String,
    pods: usize,
    ready: oneshot::Sender<()>,
) -> Result<Instant> {
    let api = env.api::<Pod>();
    let mut stream = Box::pin(watcher(api, watcher::Config::default()));
    let mut ready = Some(ready);
    let mut bound = BTreeSet::new();
    while let Some(event) = stream.try_next().await? {
        let pod = match event {
            watcher::Event::InitDone => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
                continue;
            }
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => pod,
            watcher::Event::Delete(_) | watcher::Event::Init => continue,
        };
        let name = pod.name_any();
        if name.starts_with(&prefix)
            && pod.spec.as_ref().is_some_and(|s| s.node_name.is_some())
            && bound.insert(name)
            && bound.len() >= pods
        {
            return Ok(Instant::now());
        }
    }
    bail!("the pod watch ended after {} bound pods", bound.len())
}

/// The claim template of `path`, created once per run; returns its name.
async fn template(env: &TestEnv, path: Path) -> Result<String> {
    let driver = env.settings.driver.clone();
    let (class_spec, parameters) = match path {
        Path::Controller => (
            manifests::controller_class_spec(None),
            Some(manifests::slice_parameters("5Gi", 10)?),
        ),
        Path::Structured => (manifests::scheduler_class_spec(), None),
    };
    let class = env.gpu_class(TEST, class_spec).await?;
    let name = format!("{}-gpu", path.name());
    let spec = manifests::claim_spec(&class, &driver, parameters, &[]);
    env.create(&manifests::claim_template(&name, spec)).await?;
    Ok(name)
}

/// Pins the nodes to `path`'s allocator and publishes their GPUs under it.
async fn prepare(env: &TestEnv, fake: &FakeNodes, path: Path, plan: &Plan) -> Result<()> {
    let driver = env.settings.driver.clone();
    fake_nodes::pin(&env.client, fake, path.owner()).await?;
    let timeout = env.settings.timeout.max(Duration::from_secs(300));
    fake_nodes::publish_gpus(&env.client, &driver, fake, path.owner(), timeout).await?;
    if path == Path::Controller {
        tokio::time::sleep(plan.settle).await;
    }
    Ok(())
}

/// Creates the phase's pods, `creators` requests in flight at a time.
async fn create_pods(env: &TestEnv, names: &[String], template: &str, plan: &Plan) -> Result<()> {
    futures::stream::iter(names.iter().map(|name| {
        let pod = phase_pod(env, name, template, plan.cpu.as_deref());
        async move { env.create(&pod).await.map(|_| ()) }
    }))
    .buffer_unordered(plan.creators)
    .try_collect::<()>()
    .await
}

/// How often a request the connection dropped is sent before the run fails.
const TRANSPORT_ATTEMPTS: u32 = 5;

/// Deletes the namespace's pods at once and waits until they and their claims are gone.
async fn clear(env: &TestEnv, plan: &Plan) -> Result<()> {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    // Deleting a thousand pods in one request can outlast kube-apiserver's request timeout on
    // a loaded machine, which then drops the connection (`SendRequest`): what was deleted stays
    // deleted, so the request is sent again.
    let mut attempts = 0;
    while let Err(error) = env
        .api::<Pod>()
        .delete_collection(&now, &ListParams::default())
        .await
    {
        attempts += 1;
        if attempts == TRANSPORT_ATTEMPTS || matches!(error, kube::Error::Api(_)) {
            return Err(error.into());
        }
        eprintln!("[throughput] deleting the pods: {error}; again");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let timeout = plan.bind.max(env.settings.timeout);
    wait::poll_until(
        "the phase's pods and claims to be gone",
        timeout,
        || async {
            let pods = env.api::<Pod>().list(&ListParams::default()).await;
            let claims = env
                .api::<ResourceClaim>()
                .list(&ListParams::default())
                .await;
            let (pods, claims) = match (pods, claims) {
                (Ok(pods), Ok(claims)) => (pods.items, claims.items),
                // A dropped connection under load is no answer: asked again at the next poll.
                (Err(error), _) | (_, Err(error)) if !matches!(error, kube::Error::Api(_)) => {
                    return Ok(Poll::Pending(format!("listing failed: {error}")));
                }
                (Err(error), _) | (_, Err(error)) => return Err(error.into()),
            };
            Ok(if pods.is_empty() && claims.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending(format!("{} pods, {} claims left", pods.len(), claims.len()))
            })
        },
    )
    .await
}

/// One phase's figures.
#[derive(Debug, Clone, Copy)]
struct Rate {
    path: Path,
    pods_per_second: f64,
}

/// Runs one phase and prints its figures.
async fn phase(
    env: &TestEnv,
    fake: &FakeNodes,
    (index, path): (usize, Path),
    template: &str,
    plan: &Plan,
) -> Result<Rate> {
    prepare(env, fake, path, plan).await?;
    let prefix = format!("p{index}-{}-", path.name());
    let names: Vec<String> = (0..plan.pods).map(|i| format!("{prefix}{i:05}")).collect();
    let (ready_tx, ready_rx) = oneshot::channel();
    let watch = tokio::spawn(watch_bound(env.clone(), prefix, plan.pods, ready_tx));
    ready_rx.await.context("the pod watch did not start")?;
    let before = Metrics::scrape(&env.client).await?;
    let cpu_before = cpu_of(&plan.pids);
    let started = Instant::now();
    create_pods(env, &names, template, plan).await?;
    let created = started.elapsed();
    let last = tokio::time::timeout(plan.bind, watch)
        .await
        .with_context(|| format!("not all {} pods bound within {:?}", plan.pods, plan.bind))???;
    let cpu_after = cpu_of(&plan.pids);
    let after = Metrics::scrape(&env.client).await?;
    let seconds = last.duration_since(started).as_secs_f64();
    #[allow(clippy::cast_precision_loss, reason = "pod counts are small")]
    let pods = plan.pods as f64;
    let mut report = format!(
        "[{TEST}] phase {index} {}: {} pods on {} nodes{}: all bound {seconds:.1} s after the \
         first creation ({:.1} s creating): {:.1} pods/s\n",
        path.name(),
        plan.pods,
        plan.nodes,
        plan.cpu
            .as_deref()
            .map_or(String::new(), |c| format!(", cpu {c} each")),
        created.as_secs_f64(),
        pods / seconds,
    );
    report.push_str(&before.report(&after, plan.pods));
    for ((name, _), (b, a)) in plan.pids.iter().zip(cpu_before.iter().zip(&cpu_after)) {
        if let (Some(b), Some(a)) = (b, a) {
            let _ = writeln!(
                report,
                "    cpu {name}: {:.2} s, {:.1} ms per pod, {:.0} % of a core",
                a - b,
                1000.0 * (a - b) / pods,
                100.0 * (a - b) / seconds
            );
        }
    }
    eprint!("{report}");
    clear(env, plan).await?;
    Ok(Rate {
        path,
        pods_per_second: pods / seconds,
    })
}

/// The summary line: each path's rates and the ratio of the means.
fn summary(rates: &[Rate]) -> String {
    let of = |path: Path| -> Vec<f64> {
        rates
            .iter()
            .filter(|r| r.path == path)
            .map(|r| r.pods_per_second)
            .collect()
    };
    #[allow(clippy::cast_precision_loss, reason = "a handful of phases")]
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (controller, structured) = (of(Path::Controller), of(Path::Structured));
    let ratio = mean(&controller) / mean(&structured);
    format!(
        "[{TEST}] controller pods/s {controller:.1?}, structured pods/s {structured:.1?}, \
         ratio of the means {ratio:.2}"
    )
}

async fn run(env: TestEnv, plan: Plan) -> Result<()> {
    let shape = Shape {
        cpu: "32".to_owned(),
        memory: "128Gi".to_owned(),
        pods: "110".to_owned(),
    };
    let prefix = format!("{}-n", env.namespace);
    let driver = env.settings.driver.clone();
    let fake = fake_nodes::create(&env.client, &driver, &prefix, plan.nodes, &shape).await?;
    let outcome = async {
        let mut templates = BTreeMap::new();
        for path in &plan.order {
            if !templates.contains_key(path.name()) {
                templates.insert(path.name(), template(&env, *path).await?);
            }
        }
        let mut rates = Vec::new();
        for (index, path) in plan.order.iter().copied().enumerate() {
            let template = templates
                .get(path.name())
                .context("a phase without a template")?;
            rates.push(phase(&env, &fake, (index, path), template, &plan).await?);
        }
        eprintln!("{}", summary(&rates));
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let cleanup = fake_nodes::delete(&env.client, &driver, &fake).await;
    outcome?;
    cleanup
}

#[tokio::test]
#[ignore = "needs cluster"]
async fn controller_path_throughput_against_structured() -> Result<()> {
    let plan = Plan::from_env()?;
    e2e(TEST, |env| run(env, plan)).await
}

#[test]
fn metrics_are_read_by_verb_resource_and_webhook() {
    let text = "\
apiserver_request_total{code=\"201\",component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"pods\",scope=\"resource\",subresource=\"\",verb=\"POST\",version=\"v1\"} 12
apiserver_request_total{code=\"200\",component=\"apiserver\",dry_run=\"\",group=\"\",resource=\"pods\",scope=\"resource\",subresource=\"\",verb=\"GET\",version=\"v1\"} 99
apiserver_request_total{code=\"200\",component=\"apiserver\",dry_run=\"\",group=\"resource.k8s.io\",resource=\"resourceclaims\",scope=\"resource\",subresource=\"status\",verb=\"PUT\",version=\"v1\"} 3
apiserver_admission_webhook_admission_duration_seconds_sum{name=\"pods.gpu.kerf.dev\",operation=\"CREATE\",rejected=\"false\",type=\"admit\"} 0.5
apiserver_admission_webhook_admission_duration_seconds_count{name=\"pods.gpu.kerf.dev\",operation=\"CREATE\",rejected=\"false\",type=\"admit\"} 10
";
    let metrics = Metrics::parse(text);
    assert_eq!(metrics.writes.get("POST pods"), Some(&12.0));
    assert_eq!(metrics.writes.get("PUT resourceclaims/status"), Some(&3.0));
    assert_eq!(metrics.writes.len(), 2, "{:?}", metrics.writes);
    assert_eq!(
        metrics.webhooks.get("pods.gpu.kerf.dev"),
        Some(&(10.0, 0.5))
    );
    let report = Metrics::default().report(&metrics, 3);
    assert!(report.contains("POST pods: 4.00 per pod"), "{report}");
    assert!(report.contains("all writes: 5.00 per pod"), "{report}");
    assert!(report.contains("mean 50.0 ms"), "{report}");
}

#[test]
fn pids_are_read_as_name_equals_pid() {
    assert_eq!(
        parse_pids("apiserver=12, etcd = 34,").ok(),
        Some(vec![("apiserver".to_owned(), 12), ("etcd".to_owned(), 34)])
    );
    assert!(parse_pids("apiserver").is_err());
    assert!(cpu_seconds(std::process::id()).is_ok_and(|s| s >= 0.0));
}
