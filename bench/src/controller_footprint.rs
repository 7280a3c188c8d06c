//! `controller-footprint`: the real `kerf-controller` binary, as processes, against the
//! in-memory API server over HTTP at cluster size, measured from outside through `/proc`.
//!
//! 1. The cluster ([`cluster`]): kerf's GpuClasses and webhook configurations, `nodes` Ready
//!    nodes of 8 mock H100 pinned to the controller (`gpu.kerf.dev/allocator=controller`), each
//!    with a copy of the ResourceSlice the real publisher wrote for the first node.
//! 2. The replicas ([`replica`]): `replicas` kerf-controller processes with a kubeconfig for
//!    kerf-controller's ServiceAccount (so RBAC is what `deploy/` grants), leader election on
//!    through a `coordination.k8s.io/v1` Lease, which FakeApi stores like any namespaced object
//!    (resourceVersion, 409 on a stale update; `tests/tests/integration/leader.rs` runs elections on
//!    it). The first replica starts alone and takes the Lease; the others start once it holds
//!    it, because kube-lease-manager 0.13 takes a free Lease with a server-side apply without
//!    force (`LeaseState::lock`, `src/state.rs`) and counts on kube-apiserver's field-manager
//!    conflict to stop a second taker, which FakeApi's apply does not raise. The webhook is on
//!    (every replica serves it); timing is production's unless `extra_args` say otherwise.
//! 3. A warm-up pod, bound once the leader has passed its ownership fence (its settle period
//!    after first seeing the slices): the time to it is reported as `ready_s`.
//! 4. The burst ([`burst`]): `claims` Controller-class slice claims, then as many pods, each
//!    created through kerf's webhooks over HTTPS ([`admission`]); the kube-scheduler
//!    stand-in reserves and binds each pod once the controller has allocated its claim and
//!    removed its gate. Measured: first pod created to last pod bound, and every replica's CPU
//!    from the first claim created to the last pod bound.
//! 5. Quiet: `settle` with nothing happening, then the idle window: each replica's CPU over it
//!    (as % of one core), RSS (`VmRSS`) and peak RSS (`VmHWM`) at its end, and the requests
//!    the replicas sent to the API server meanwhile.
//!
//! With `perf` set, `perf record -F 499 -g --call-graph dwarf` is attached to the leader for
//! the burst (`<perf>.burst`) and for the idle window (`<perf>.idle`).

mod admission;
mod burst;
mod cluster;
mod replica;

pub use replica::default_binary;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::{FakeApi, Identity};

use crate::stats::{Samples, mib, ms};
use crate::summary::Summary;
use crate::{Error, Result};
use admission::{Admitter, CLAIM_CONFIGURATION, POD_CONFIGURATION};
use replica::{PerfRecord, Replica, Sample};

/// How long the first replica may take to hold the Lease, and the webhooks to publish their
/// CAs.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the warm-up pod may take (the leader's ownership fence is 10 s by default).
const WARM_UP_TIMEOUT: Duration = Duration::from_secs(120);
/// The Lease of the leader election (kerf-controller's defaults).
const LEASE_PATH: &str =
    "/apis/coordination.k8s.io/v1/namespaces/kerf-system/leases/kerf-controller";
/// How long `perf record` is given to attach before a measured phase starts.
const PERF_ATTACH: Duration = Duration::from_secs(1);
/// Idle CPU target, percent of one core.
const IDLE_CPU_TARGET_PCT: f64 = 1.0;
/// Leader RSS target, MiB.
const RSS_TARGET_MIB: f64 = 64.0;

/// What `controller-footprint` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FootprintConfig {
    /// The kerf-controller binary.
    pub binary: PathBuf,
    /// Where the replicas' logs and kubeconfigs go.
    pub dir: PathBuf,
    /// Nodes of 8 mock H100.
    pub nodes: usize,
    /// Pods, one slice claim each.
    pub claims: usize,
    /// Replicas (leader election on).
    pub replicas: usize,
    /// Quiet time after the last binding before the idle window.
    pub settle: Duration,
    /// The idle window.
    pub idle_window: Duration,
    /// Flags appended to every replica's command line.
    pub extra_args: Vec<OsString>,
    /// Prefix of `perf record` output files; `None`: no recording.
    pub perf: Option<PathBuf>,
    /// Seed of the stand-in's choices.
    pub seed: u64,
}

/// One replica's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    /// CPU over the burst (first claim to last binding) per pod.
    per_pod: Duration,
    /// The same less what the replica's idle rate would have used over the burst: the steady
    /// work (ticks, renewals) grows with the burst's length, the pods' work with their number.
    above_idle: Duration,
    /// CPU over the idle window, percent of one core.
    idle_pct: f64,
    /// At the end of the idle window.
    end: Sample,
}

impl Figures {
    fn new(burst: &Window, idle: &Window, replica: usize, pods: usize, window: Duration) -> Self {
        let burst_cpu = burst.end[replica]
            .cpu
            .saturating_sub(burst.start[replica].cpu);
        let idle_cpu = idle.end[replica]
            .cpu
            .saturating_sub(idle.start[replica].cpu);
        let idle_secs = idle.elapsed.as_secs_f64().max(1e-9);
        let steady = idle_cpu.mul_f64(window.as_secs_f64() / idle_secs);
        Figures {
            per_pod: burst_cpu / count(pods.max(1)),
            above_idle: burst_cpu.saturating_sub(steady) / count(pods.max(1)),
            idle_pct: 100.0 * idle_cpu.as_secs_f64() / idle_secs,
            end: idle.end[replica],
        }
    }
}

/// The `controller-footprint` benchmark.
///
/// # Errors
/// The binary is missing, a replica exits or does not start in time, or the load fails.
pub async fn controller_footprint(config: &FootprintConfig) -> Result<Summary> {
    std::fs::create_dir_all(&config.dir).map_err(|e| Error::io("create", &config.dir, e))?;
    let fake = FakeApi::new();
    let server = ApiServer::start(fake.clone())
        .await
        .map_err(|e| Error::io("start", "the in-memory API server", e))?;
    cluster::install(&fake, config.nodes).await?;
    let mut replicas = Vec::with_capacity(config.replicas);
    let result = Box::pin(measure(config, &fake, &server, &mut replicas)).await;
    for replica in replicas {
        replica.stop().await;
    }
    result
}

async fn measure(
    config: &FootprintConfig,
    fake: &FakeApi,
    server: &ApiServer,
    replicas: &mut Vec<Replica>,
) -> Result<Summary> {
    let started = Instant::now();
    let admitter = start_replicas(config, fake, server, replicas).await?;
    let mut warm_up = burst::Load::new(fake, admitter.clone(), burst::plans("warmup", 1), 0);
    Box::pin(warm_up.run(config.replicas, WARM_UP_TIMEOUT)).await?;
    let ready = started.elapsed();

    let mut load = burst::Load::new(
        fake,
        admitter,
        burst::plans("burst", config.claims),
        config.seed,
    );
    let timeout = Duration::from_secs(60) + Duration::from_millis(100) * count(config.claims);
    let (timeline, burst) = measured(
        config,
        fake,
        replicas,
        "burst",
        Box::pin(load.run(config.replicas, timeout)),
    )
    .await?;
    tokio::time::sleep(config.settle).await;
    let idle = async {
        tokio::time::sleep(config.idle_window).await;
        Ok(())
    };
    let ((), idle) = measured(config, fake, replicas, "idle", idle).await?;
    Ok(report(
        config, fake, replicas, ready, &timeline, &burst, &idle,
    ))
}

/// Starts the replicas (the first alone until it holds the Lease) and returns a webhook client
/// once every replica's CA is in both webhook configurations.
async fn start_replicas(
    config: &FootprintConfig,
    fake: &FakeApi,
    server: &ApiServer,
    replicas: &mut Vec<Replica>,
) -> Result<Admitter> {
    for index in 0..config.replicas {
        let replica = Replica::start(
            &config.binary,
            server,
            &config.dir,
            index,
            &config.extra_args,
        )?;
        // On stderr at once, for attaching a profiler by hand.
        eprintln!(
            "controller-footprint: {} runs as pid {} (log {})",
            replica.identity,
            replica.pid(),
            replica.log.display()
        );
        let identity = replica.identity.clone();
        replicas.push(replica);
        if index == 0 {
            wait(replicas, "the first replica to hold the Lease", || {
                holder(fake).as_deref() == Some(identity.as_str())
            })
            .await?;
        }
    }
    let all_cas = || {
        [POD_CONFIGURATION, CLAIM_CONFIGURATION].iter().all(|name| {
            fake.mutating_webhook_ca_bundles(name)
                .is_some_and(|bundles| {
                    bundles
                        .iter()
                        .all(|pem| admission::certificates(pem) >= config.replicas)
                })
        })
    };
    wait(
        replicas,
        "every replica's CA in both webhook configurations",
        all_cas,
    )
    .await?;
    let bundle = fake
        .mutating_webhook_ca_bundles(POD_CONFIGURATION)
        .unwrap_or_default()
        .concat();
    Admitter::new(&bundle, replicas.iter().map(|r| r.webhook_port).collect())
}

/// What every replica did over one measured phase.
#[derive(Debug)]
struct Window {
    start: Vec<Sample>,
    end: Vec<Sample>,
    elapsed: Duration,
    /// Requests of kerf-controller's replicas to the API server.
    requests: usize,
    /// The leader's `perf record` file.
    perf: Option<PathBuf>,
}

/// Runs `phase` between two samples of every replica (and, when configured, under `perf
/// record` of the first replica, the leader).
async fn measured<T>(
    config: &FootprintConfig,
    fake: &FakeApi,
    replicas: &mut [Replica],
    name: &str,
    phase: impl Future<Output = Result<T>>,
) -> Result<(T, Window)> {
    let perf = start_perf(config, replicas[0].pid(), name).await?;
    let start = sample_all(replicas)?;
    let requests = controller_requests(fake);
    let started = Instant::now();
    let outcome = phase.await;
    let elapsed = started.elapsed();
    let end = sample_all(replicas);
    let requests = controller_requests(fake).saturating_sub(requests);
    let perf = stop_perf(perf).await;
    Ok((
        outcome?,
        Window {
            start,
            end: end?,
            elapsed,
            requests,
            perf,
        },
    ))
}

/// The summary, leader first (the Lease's holder at the end).
fn report(
    config: &FootprintConfig,
    fake: &FakeApi,
    replicas: &[Replica],
    ready: Duration,
    timeline: &burst::Timeline,
    burst: &Window,
    idle: &Window,
) -> Summary {
    let holder = holder(fake).unwrap_or_default();
    let leader = replicas
        .iter()
        .position(|r| r.identity == holder)
        .unwrap_or(0);
    let order = std::iter::once(leader).chain((0..replicas.len()).filter(|i| *i != leader));
    let window = timeline
        .last_bound
        .saturating_duration_since(timeline.claims_started);
    let figures: Vec<Figures> = order
        .map(|i| Figures::new(burst, idle, i, config.claims, window))
        .collect();
    let mut s = summary(config, timeline, &figures, idle.elapsed);
    let per_pod = ratio(burst.requests, config.claims);
    let idle_rate = per_second(idle.requests, idle.elapsed);
    s.detail(format!(
        "ready (replicas started -> warm-up pod bound, the leader's ownership fence included): {:.1} s; Lease holder at the end: {holder}",
        ready.as_secs_f64()
    ));
    s.detail(format!(
        "API requests of kerf-controller (all replicas): {per_pod:.1} per pod in the burst, {idle_rate:.1}/s idle"
    ));
    for (what, window) in [("burst", burst), ("idle", idle)] {
        if let Some(file) = &window.perf {
            s.detail(format!(
                "perf record of the leader ({what}): {}",
                file.display()
            ));
        }
    }
    let logs: Vec<String> = replicas
        .iter()
        .map(|r| r.log.display().to_string())
        .collect();
    s.detail(format!("replica logs: {}", logs.join(", ")));
    s.figure("ready_s", format!("{:.1}", ready.as_secs_f64()))
        .figure("api_requests_per_pod", format!("{per_pod:.1}"))
        .figure("idle_api_requests_per_s", format!("{idle_rate:.1}"));
    s
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn ratio(n: usize, d: usize) -> f64 {
    f64::from(count(n)) / f64::from(count(d.max(1)))
}

fn per_second(n: usize, over: Duration) -> f64 {
    if over.is_zero() {
        0.0
    } else {
        f64::from(count(n)) / over.as_secs_f64()
    }
}

fn mib_f(bytes: u64) -> f64 {
    #[allow(
        clippy::cast_precision_loss,
        reason = "process sizes are far below 2^52"
    )]
    let bytes = bytes as f64;
    bytes / f64::from(1u32 << 20)
}

/// The holder of the leader election Lease.
fn holder(fake: &FakeApi) -> Option<String> {
    fake.get(LEASE_PATH)?
        .pointer("/spec/holderIdentity")?
        .as_str()
        .map(str::to_owned)
}

/// Requests kerf-controller's replicas sent so far.
fn controller_requests(fake: &FakeApi) -> usize {
    let user = Identity::kerf_controller().username;
    fake.requests().iter().filter(|r| r.user == user).count()
}

fn sample_all(replicas: &mut [Replica]) -> Result<Vec<Sample>> {
    replicas.iter_mut().map(Replica::sample).collect()
}

/// Polls `done` every 20 ms for [`START_TIMEOUT`], failing early when a replica exits.
async fn wait(replicas: &mut [Replica], what: &str, mut done: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !done() {
        for replica in replicas.iter_mut() {
            replica.check_running()?;
        }
        if Instant::now() > deadline {
            return Err(Error::Child(format!(
                "no {what} within {START_TIMEOUT:?}; see {}",
                replicas
                    .iter()
                    .map(|r| r.log.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Starts `perf record` on `pid` into `<perf>.<phase>` and gives it a moment to attach (it
/// missed the first half second of a burst without).
async fn start_perf(config: &FootprintConfig, pid: u32, phase: &str) -> Result<Option<PerfRecord>> {
    let Some(prefix) = &config.perf else {
        return Ok(None);
    };
    let mut name = prefix.clone().into_os_string();
    name.push(format!(".{phase}"));
    let perf = PerfRecord::start(pid, &PathBuf::from(name))?;
    tokio::time::sleep(PERF_ATTACH).await;
    Ok(Some(perf))
}

async fn stop_perf(perf: Option<PerfRecord>) -> Option<PathBuf> {
    match perf {
        Some(perf) => Some(perf.stop().await),
        None => None,
    }
}

fn summary(
    config: &FootprintConfig,
    timeline: &burst::Timeline,
    figures: &[Figures],
    idle: Duration,
) -> Summary {
    let pods = config.claims;
    let busy = timeline
        .last_bound
        .saturating_duration_since(timeline.pods_started);
    let window = timeline
        .last_bound
        .saturating_duration_since(timeline.claims_started);
    let rate = per_second(pods, busy);
    let latency = Samples::new(timeline.latencies.clone());
    let mut s = Summary::new("controller-footprint");
    s.detail(format!(
        "real kerf-controller binary ({}), {} replica(s) with leader election, webhook on, against the in-memory API server over HTTP; {} nodes x 8 H100 pinned to the controller; {pods} pods with one slice claim each (10Gi, 10 %), created through kerf's webhooks over HTTPS, bound by the kube-scheduler stand-in",
        config.binary.display(),
        config.replicas,
        config.nodes
    ));
    let env = replica::deployment_env().map_or_else(
        |e| e.to_string(),
        |env| {
            env.iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join(" ")
        },
    );
    s.detail(format!(
        "replicas' environment from deploy/helm/kerf/templates/controller.yaml: {env}"
    ));
    s.detail(format!(
        "burst: first pod created -> last bound {:.2} s ({rate:.1} pods/s), latency p50 {} ms p99 {} ms; claims created and known to every webhook {:.2} s before",
        busy.as_secs_f64(),
        ms(latency.p50()),
        ms(latency.p99()),
        timeline
            .pods_started
            .saturating_duration_since(timeline.claims_started)
            .as_secs_f64()
    ));
    for (i, f) in figures.iter().enumerate() {
        let role = if i == 0 { "leader" } else { "standby" };
        s.detail(format!(
            "{role}: CPU {} ms per pod over the burst ({:.2} s from the first claim to the last binding; {} ms above its idle rate); idle {:.2} % of a core over {:.1} s; RSS {} MiB, peak {} MiB",
            ms(f.per_pod),
            window.as_secs_f64(),
            ms(f.above_idle),
            f.idle_pct,
            idle.as_secs_f64(),
            mib(f.end.rss),
            mib(f.end.peak_rss)
        ));
    }
    s.figure("nodes", config.nodes)
        .figure("pods", pods)
        .figure("bound", timeline.latencies.len())
        .figure("replicas", config.replicas)
        .figure("burst_s", format!("{:.2}", busy.as_secs_f64()))
        .figure("pods_per_s", format!("{rate:.1}"))
        .figure("p50_ms", ms(latency.p50()))
        .figure("p99_ms", ms(latency.p99()));
    add_replica_figures(&mut s, figures);
    s
}

/// The leader's figures (and the standby's) and the targets.
fn add_replica_figures(s: &mut Summary, figures: &[Figures]) {
    let leader = &figures[0];
    s.figure("cpu_ms_per_pod", ms(leader.per_pod))
        .figure("cpu_ms_per_pod_above_idle", ms(leader.above_idle))
        .figure("idle_cpu_pct", format!("{:.2}", leader.idle_pct))
        .figure("rss_mib", mib(leader.end.rss))
        .figure("peak_rss_mib", mib(leader.end.peak_rss));
    if let Some(standby) = figures.get(1) {
        s.figure("standby_cpu_ms_per_pod", ms(standby.per_pod))
            .figure("standby_idle_cpu_pct", format!("{:.2}", standby.idle_pct))
            .figure("standby_rss_mib", mib(standby.end.rss))
            .figure("standby_peak_rss_mib", mib(standby.end.peak_rss));
    }
    s.target(
        "idle_cpu_target",
        format!("leader idle CPU < {IDLE_CPU_TARGET_PCT} % of a core"),
        leader.idle_pct < IDLE_CPU_TARGET_PCT,
        format!("{:.2} %", leader.idle_pct),
    );
    s.target(
        "rss_target",
        format!("leader RSS <= {RSS_TARGET_MIB} MiB"),
        mib_f(leader.end.rss) <= RSS_TARGET_MIB,
        format!("{} MiB", mib(leader.end.rss)),
    );
}
