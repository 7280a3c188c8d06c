//! Where the time of a cache-miss prepare goes: the plugin in-process, started as in
//! production (`Connections::kube`, device-status writer on) with a kube client read from a
//! kubeconfig that points at the in-memory API server over HTTP (1 ms latency, as `kerf-bench
//! prepare-real` runs it), through a TCP proxy that counts the connections the client opens.
//! The claim reader is wrapped to time the cache lookup and each read from the API server.
//! Run with `cargo test -p kerf-tests --test integration claim_cache_miss:: -- --ignored --nocapture`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kerf_kubelet_plugin::claim_reader::{Cached, ClaimReader, Wanted};
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_kubelet_plugin::preparer::ClaimRef;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::wait::until;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{DRIVER, NAMESPACE, NODE, TestNode, allocated_claim, uid};

const CLAIMS: usize = 200;
const LATENCY: Duration = Duration::from_millis(1);

/// How the wrapped reader answers a miss: the read before the race (a quorum GET only), the
/// race without the `resourceVersion=0` read, or both (the plugin as built).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    QuorumOnly,
    Race,
    RaceAny,
}

/// Times what the preparer asks of the reader it wraps, and answers misses as its [`Mode`]
/// says.
pub struct Timed {
    inner: Arc<dyn ClaimReader>,
    steps: Mutex<Steps>,
    mode: Mutex<Mode>,
}

#[derive(Default, Debug, Clone)]
pub struct Steps {
    pub lookup: Vec<Duration>,
    pub reads: Vec<(Duration, String)>,
}

impl Timed {
    pub fn new(inner: Arc<dyn ClaimReader>) -> Self {
        Timed {
            inner,
            steps: Mutex::default(),
            mode: Mutex::new(Mode::RaceAny),
        }
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }

    pub fn take(&self) -> Steps {
        std::mem::take(&mut *self.steps.lock().unwrap())
    }

    fn read(&self, started: Instant, what: &str) {
        self.steps
            .lock()
            .unwrap()
            .reads
            .push((started.elapsed(), what.to_owned()));
    }
}

impl ClaimReader for Timed {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        Box::pin(async move {
            let started = Instant::now();
            let answer = self.inner.get(namespace, name).await;
            self.read(started, "get");
            answer
        })
    }

    fn get_any<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        Box::pin(async move {
            let started = Instant::now();
            let answer = self.inner.get_any(namespace, name).await;
            self.read(started, "get resourceVersion=0");
            answer
        })
    }

    fn may_read_any(&self, uid: &str) -> bool {
        self.mode() == Mode::RaceAny && self.inner.may_read_any(uid)
    }

    fn until_cached<'a>(&'a self, wanted: &'a Wanted) -> BoxFuture<'a, Arc<ResourceClaim>> {
        if self.mode() == Mode::QuorumOnly {
            return Box::pin(std::future::pending());
        }
        Box::pin(async move {
            let started = Instant::now();
            let claim = self.inner.until_cached(wanted).await;
            self.read(started, "watch delivered");
            claim
        })
    }

    fn cached(&self, namespace: &str, name: &str) -> Cached {
        let started = Instant::now();
        let cached = self.inner.cached(namespace, name);
        self.steps.lock().unwrap().lookup.push(started.elapsed());
        cached
    }

    fn unprepared(&self, uid: &str) {
        self.inner.unprepared(uid);
    }

    fn cache_task(
        &self,
        shutdown: CancellationToken,
    ) -> Option<BoxFuture<'static, kerf_kubelet_plugin::Result<()>>> {
        self.inner.cache_task(shutdown)
    }
}

/// A loopback TCP proxy to `target` that counts the connections it accepted.
async fn counting_proxy(target: SocketAddr) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                    inbound.set_nodelay(true).unwrap();
                    outbound.set_nodelay(true).unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (address, accepted)
}

pub struct HttpNode {
    pub node: TestNode,
    _server: ApiServer,
    pub connections: Arc<AtomicUsize>,
    pub plugin: RunningPlugin,
    pub reader: Arc<Timed>,
    /// A client of its own from the same kubeconfig, for GETs outside the plugin.
    pub alone: kube::Api<ResourceClaim>,
}

impl HttpNode {
    pub async fn start(device_status: bool) -> Self {
        let node = TestNode::new("h100-sxm-80gb");
        let server = ApiServer::start(node.api.clone()).await.unwrap();
        server.set_latency(LATENCY);
        let target: SocketAddr = server.url().trim_start_matches("http://").parse().unwrap();
        let (proxy, connections) = counting_proxy(target).await;
        let path = node.root.join("kubeconfig");
        server
            .write_kubeconfig_for(&path, Identity::kerf_kubelet_plugin(NODE))
            .unwrap();
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace(&server.url(), &format!("http://{proxy}"));
        std::fs::write(&path, text).unwrap();
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .unwrap();
        let client = kube::Client::try_from(config.clone()).unwrap();
        let alone = kube::Api::namespaced(kube::Client::try_from(config).unwrap(), NAMESPACE);
        let mut config = node.config();
        config.claim_device_status = device_status;
        let mut connections_of = Connections::kube(client, &config);
        let reader = Arc::new(Timed::new(Arc::clone(&connections_of.claim_reader)));
        connections_of.claim_reader = Arc::clone(&reader) as Arc<dyn ClaimReader>;
        let plugin = plugin::start(&config, node.inventory(), connections_of)
            .await
            .unwrap();
        let started = HttpNode {
            node,
            _server: server,
            connections,
            plugin,
            reader,
            alone,
        };
        until(
            "the claim cache's first list",
            Duration::from_secs(20),
            || !matches!(started.reader.inner.cached("any", "x"), Cached::NotSynced),
        )
        .await;
        started
    }
}

pub fn claim_json(name: &str, uid: &str, labelled: bool, device: &str) -> Value {
    let results = vec![json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device})];
    let mut claim = allocated_claim(name, uid, &json!({"devices": {"results": results}}));
    if labelled {
        claim["metadata"]["labels"] = json!({ CLAIM_NODE_LABEL: node_label_value(NODE) });
    }
    claim
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let index = ((sorted.len() as f64 - 1.0) * p).round();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    sorted[index as usize]
}

fn line(what: &str, samples: &[Duration]) {
    if samples.is_empty() {
        println!("{what:<48} (none)");
        return;
    }
    println!(
        "{what:<48} n={:<4} p50 {:>8.3} ms  p99 {:>8.3} ms",
        samples.len(),
        percentile(samples, 0.5).as_secs_f64() * 1e3,
        percentile(samples, 0.99).as_secs_f64() * 1e3,
    );
}

#[derive(Clone, Copy, Debug)]
enum Series {
    /// Labelled and in the cache before the prepare.
    Cached,
    /// Never labelled: no node-scoped watch sees it.
    Unlabelled,
    /// Allocated and prepared at once; a "controller" labels it a timer tick later.
    LabelRacing,
}

/// The samples of one series in one mode.
#[derive(Default)]
struct Samples {
    total: Vec<Duration>,
    lookups: Vec<Duration>,
    reads: BTreeMap<String, Vec<Duration>>,
    requests: BTreeMap<String, usize>,
    status_writes: usize,
}

impl Samples {
    fn add_requests(&mut self, requests: &[kerf_tests::fake_api::RecordedRequest]) {
        for request in requests.iter().filter(|r| r.verb != "watch") {
            let kind = if request.path.ends_with("/status") {
                self.status_writes += 1;
                "status"
            } else {
                "claim"
            };
            let any = if request.query.contains("resourceVersion=0") {
                " resourceVersion=0"
            } else {
                ""
            };
            *self
                .requests
                .entry(format!("{} {kind}{any}", request.verb))
                .or_default() += 1;
        }
    }

    fn print(&self, title: &str) {
        println!("--- {title}");
        line("prepare", &self.total);
        line("cache lookup", &self.lookups);
        for (what, samples) in &self.reads {
            line(what, samples);
        }
        println!(
            "  requests that reached the API server during the prepares (watches left out): {:?}; status writes among them: {}",
            self.requests, self.status_writes
        );
    }
}

/// One prepare (and unprepare) of a fresh claim of `series`, sampled into `samples`.
async fn once(
    node: &HttpNode,
    series: Series,
    id: &str,
    name: &str,
    device: &str,
    samples: &mut Samples,
) {
    let labelled = matches!(series, Series::Cached);
    node.node.api.insert(claim_json(name, id, labelled, device));
    if labelled {
        until("cached", Duration::from_secs(20), || {
            matches!(node.reader.inner.cached(NAMESPACE, name), Cached::Found(_))
        })
        .await;
    }
    let _ = node.reader.take();
    let before = node.node.api.requests().len();
    let claim = ClaimRef {
        namespace: NAMESPACE.into(),
        uid: id.to_owned(),
        name: name.to_owned(),
    };
    if matches!(series, Series::LabelRacing) {
        // kerf-controller's label write, right after the allocation.
        let api = node.node.api.clone();
        let labelled = claim_json(name, id, true, device);
        tokio::spawn(async move {
            // A tick of Tokio's timer: 1-2 ms, about a GET's round trip here.
            tokio::time::sleep(Duration::from_millis(1)).await;
            api.insert(labelled);
        });
    }
    let started = Instant::now();
    let answer = node
        .plugin
        .preparer()
        .prepare(std::slice::from_ref(&claim))
        .await;
    samples.total.push(started.elapsed());
    assert!(answer[0].1.is_ok(), "{answer:?}");
    let steps = node.reader.take();
    samples.lookups.extend(steps.lookup);
    for (elapsed, what) in steps.reads {
        samples.reads.entry(what).or_default().push(elapsed);
    }
    samples.add_requests(&node.node.api.requests()[before..]);
    // The same GET outside the plugin, on an idle connection of a client of its own.
    let started = Instant::now();
    node.alone.get(name).await.unwrap();
    samples
        .reads
        .entry("GET alone, outside the plugin".into())
        .or_default()
        .push(started.elapsed());
    for (uid, answer) in node.plugin.preparer().unprepare(&[claim]).await {
        answer.unwrap_or_else(|e| panic!("unprepare {uid}: {e}"));
    }
}

/// A series, its claims prepared one at a time, the modes taking turns claim by claim so that
/// they share the machine's noise.
async fn series(node: &HttpNode, series: Series, base: u32, modes: &[Mode]) {
    let mut samples: Vec<Samples> = modes.iter().map(|_| Samples::default()).collect();
    // A claim from the cache before each turn: the reference, in the same noise.
    let mut reference = Samples::default();
    let connections_before = node.connections.load(Ordering::SeqCst);
    let lookups_before = lookup_counts(node);
    for n in 0..CLAIMS {
        let number = base + 50_000 + u32::try_from(n).unwrap();
        let name = format!("c-{number}");
        let device = format!("gpu-{}", n % 8);
        once(
            node,
            Series::Cached,
            &uid(number),
            &name,
            &device,
            &mut reference,
        )
        .await;
        for (m, mode) in modes.iter().enumerate() {
            node.reader.set_mode(*mode);
            let number = base + u32::try_from(n * modes.len() + m).unwrap();
            let device = format!("gpu-{}", n % 8);
            let name = format!("c-{number}");
            once(node, series, &uid(number), &name, &device, &mut samples[m]).await;
        }
    }
    node.reader.set_mode(Mode::RaceAny);
    reference.print(&format!(
        "{series:?}: the reference, claims from the cache in turn with it"
    ));
    for (mode, samples) in modes.iter().zip(&samples) {
        samples.print(&format!("{series:?}, {mode:?}"));
    }
    let lookups: Vec<String> = lookup_counts(node)
        .into_iter()
        .filter(|line| !lookups_before.contains(line))
        .collect();
    println!(
        "  new TCP connections: {}; lookup counters now: {lookups:?}",
        node.connections.load(Ordering::SeqCst) - connections_before
    );
}

/// The plugin's `kerf_plugin_claim_lookups_total` series.
fn lookup_counts(node: &HttpNode) -> Vec<String> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, node.plugin.registry()).unwrap();
    text.lines()
        .filter(|l| l.starts_with("kerf_plugin_claim_lookups_total"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: prints the miss path's breakdown"]
async fn miss_path_breakdown() {
    let all = [Mode::QuorumOnly, Mode::Race, Mode::RaceAny];
    for device_status in [true, false] {
        println!(
            "=== device-status writer {}",
            if device_status { "on" } else { "off" }
        );
        let node = HttpNode::start(device_status).await;
        // Warm-up: connections, allocator, files.
        series(&node, Series::Unlabelled, 10_000, &[Mode::RaceAny]).await;
        series(&node, Series::Unlabelled, 200_000, &all).await;
        series(&node, Series::LabelRacing, 300_000, &all).await;
        node.plugin.shutdown().await.unwrap();
    }
}
