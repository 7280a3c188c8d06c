//! Where the time of a cache-miss prepare goes: the plugin in-process, started as in
//! production (`Connections::kube`, device-status writer on) with a kube client read from a
//! kubeconfig that points at the in-memory API server over HTTP (1 ms latency, as `kerf bench
//! prepare-real` runs it), through a TCP proxy that counts the connections the client opens.
//! The claim reader is wrapped to time the cache lookup and each read from the API server.
//! Run with `cargo test -p kerf-tests --test claim_cache_miss -- --ignored --nocapture`.

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
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{DRIVER, NAMESPACE, NODE, TestNode, allocated_claim, eventually, uid};

const CLAIMS: usize = 300;
const LATENCY: Duration = Duration::from_millis(1);

/// Times what the preparer asks of the reader it wraps.
pub struct Timed {
    inner: Arc<dyn ClaimReader>,
    steps: Mutex<Steps>,
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
        }
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
        self.inner.may_read_any(uid)
    }

    fn until_cached<'a>(&'a self, wanted: &'a Wanted) -> BoxFuture<'a, Arc<ResourceClaim>> {
        self.inner.until_cached(wanted)
    }

    fn cached(&self, namespace: &str, name: &str) -> Cached {
        let started = Instant::now();
        let cached = self.inner.cached(namespace, name);
        self.steps.lock().unwrap().lookup.push(started.elapsed());
        cached
    }

    fn uncached(&self) -> Option<Arc<dyn ClaimReader>> {
        self.inner.uncached()
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
        let client = kube::Client::try_from(config).unwrap();
        let mut connections_of = Connections::kube(client, NODE, false);
        if !device_status {
            connections_of = connections_of.without_device_status();
        }
        let reader = Arc::new(Timed::new(Arc::clone(&connections_of.claim_reader)));
        connections_of.claim_reader = Arc::clone(&reader) as Arc<dyn ClaimReader>;
        let plugin = plugin::start(&node.config(), node.inventory(), connections_of)
            .await
            .unwrap();
        let started = HttpNode {
            node,
            _server: server,
            connections,
            plugin,
            reader,
        };
        eventually(
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
    /// Allocated, then labelled by a "controller" write at once, prepared at once.
    LabelRacing,
}

async fn series(node: &HttpNode, series: Series, base: u32) {
    let mut total = Vec::new();
    let mut lookups = Vec::new();
    let mut reads: std::collections::BTreeMap<String, Vec<Duration>> = Default::default();
    let mut requests: std::collections::BTreeMap<String, usize> = Default::default();
    let mut overlapping_writes = 0;
    let connections_before = node.connections.load(Ordering::SeqCst);
    for n in 0..CLAIMS {
        let id = uid(base + u32::try_from(n).unwrap());
        let name = format!("c-{base}-{n}");
        let device = format!("gpu-{}", n % 8);
        let labelled = matches!(series, Series::Cached);
        node.node
            .api
            .insert(claim_json(&name, &id, labelled, &device));
        if labelled {
            eventually("cached", Duration::from_secs(20), || {
                matches!(node.reader.inner.cached(NAMESPACE, &name), Cached::Found(_))
            })
            .await;
        }
        let _ = node.reader.take();
        let before = node.node.api.requests().len();
        let claim = ClaimRef {
            namespace: NAMESPACE.into(),
            uid: id.clone(),
            name: name.clone(),
        };
        if matches!(series, Series::LabelRacing) {
            let api = node.node.api.clone();
            let labelled = claim_json(&name, &id, true, &device);
            tokio::spawn(async move {
                api.insert(labelled);
            });
        }
        let started = Instant::now();
        let answer = node
            .plugin
            .preparer()
            .prepare(std::slice::from_ref(&claim))
            .await;
        total.push(started.elapsed());
        assert!(answer[0].1.is_ok(), "{answer:?}");
        let steps = node.reader.take();
        lookups.extend(steps.lookup);
        for (elapsed, what) in steps.reads {
            reads.entry(what).or_default().push(elapsed);
        }
        for request in &node.node.api.requests()[before..] {
            if request.verb == "watch" {
                continue;
            }
            let kind = if request.path.ends_with("/status") {
                "status"
            } else {
                "claim"
            };
            let any = if request.query.contains("resourceVersion=0") {
                " resourceVersion=0"
            } else {
                ""
            };
            *requests
                .entry(format!("{} {kind}{any}", request.verb))
                .or_default() += 1;
            if request.verb == "patch" {
                overlapping_writes += 1;
            }
        }
        for (uid, answer) in node.plugin.preparer().unprepare(&[claim]).await {
            answer.unwrap_or_else(|e| panic!("unprepare {uid}: {e}"));
        }
    }
    println!("--- {series:?}");
    line("prepare", &total);
    line("cache lookup", &lookups);
    for (what, samples) in &reads {
        line(&format!("read: {what}"), samples);
    }
    println!(
        "requests seen by the API server during the prepares (watches excluded): {requests:?}; \
         status writes that arrived during a prepare: {overlapping_writes}; new TCP connections: {}",
        node.connections.load(Ordering::SeqCst) - connections_before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: prints the miss path's breakdown"]
async fn miss_path_breakdown() {
    for device_status in [true, false] {
        println!(
            "=== device-status writer {}",
            if device_status { "on" } else { "off" }
        );
        let node = HttpNode::start(device_status).await;
        // Warm-up: connections, allocator, files.
        series(&node, Series::Unlabelled, 90_000).await;
        series(&node, Series::Cached, 100_000).await;
        series(&node, Series::Unlabelled, 200_000).await;
        series(&node, Series::LabelRacing, 300_000).await;
        node.plugin.shutdown().await.unwrap();
    }
}
