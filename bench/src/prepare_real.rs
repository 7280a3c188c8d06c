//! `prepare-real`: `prepare` on the real path. The plugin is started the production way
//! ([`plugin::start`] with [`Connections::kube`]), its kube client built from a kubeconfig
//! that points at the in-memory API server served over HTTP
//! ([`kerf_tests::api_server::ApiServer`]: a real hyper client, real JSON), which answers
//! every request a set latency late ([`ApiServer::set_latency`]). The claims are in the API
//! server as kerf-controller leaves them: allocated on this node and labelled with it
//! ([`kerf_api::claim_node_label`]). The node is laid out as a node is: the checkpoint and the
//! claims' device metadata files on disk (the work directory), the CDI specs on a tmpfs
//! (under `--node-cdi-dir`), as `/var/run/cdi` is on most nodes.
//!
//! Four series run interleaved on the same plugin, one claim at a time over its Unix socket:
//! labelled claims allocated long before, which a plugin with a watch-fed claim cache
//! prepares without a GET; unlabelled ones allocated long before, which no node-scoped watch
//! sees, so every prepare GETs its claim; and the miss path ([`miss`]): claims whose
//! allocation kube-scheduler (no label) or kerf-controller (labelled before) writes right
//! before the prepare. Between them, in the same run: the floor (an empty
//! `NodePrepareResources`, one atomic write of the checkpoint's size, one lookup in a map of
//! as many claims as the cache holds), the miss path's floor (a GET through the same client
//! added to the floor of the same round) and each part on its own (a GET of a claim, the
//! checkpoint write, the same fsync'd as dra-example-driver writes its checkpoint, the spec
//! and metadata files, the empty call), from which each part's share of a prepare is reported.
//!
//! Then the p99 tail taken apart, each a run of its own with a fresh plugin and its own floor
//! (labelled claims only): the claim status writer off; the plugin's directory on a tmpfs,
//! where the checkpoint's fsyncs cost nothing (status writer off too); and, status writer on,
//! a thread making fsync'd writes on the plugin's disk all along ([`disk_writer`]), as etcd
//! does on a node that holds the API server.

mod disk_writer;
mod miss;
mod parts;
mod report;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::claim_node_label::{CLAIM_NODE_LABEL, node_label_value};
use kerf_core::inventory::Inventory;
use kerf_kubelet_plugin::config::PluginConfig;
use kerf_kubelet_plugin::plugin::{self, Connections, RunningPlugin};
use kerf_proto::client::Claim;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::{FakeApi, Identity};
use kerf_tests::fixtures;

use crate::node::{Kubelet, NAMESPACE, NODE, NodeLayout, numbered_claim, slice_claim};
use crate::prepare::{WARMUP, disk_work_dir, tmpfs_dir};
use crate::summary::Summary;
use crate::{BenchOptions, Error, Result};

use disk_writer::{DiskWriter, Written};
use miss::{Allocator, MissClaim, Writer};
use parts::{Floor, PartRuns, Parts, Series};

/// Claim series, apart from the other benchmarks' (see `prepare.rs`).
const SERIES_WARMUP: u64 = 20;
const SERIES_CACHED: u64 = 21;
const SERIES_GET: u64 = 22;
const SERIES_SCHEDULER: u64 = 23;
const SERIES_CONTROLLER: u64 = 24;
/// How long the plugin has to start a watch of ResourceClaims after it started; a plugin
/// without a claim cache never does, so this is what deciding so costs.
const WATCH_GRACE: Duration = Duration::from_secs(2);
/// How long a plugin that watches has to serve a prepare from its cache.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(10);
/// Warm-up claims besides [`WARMUP`], for the wait until the cache serves: one fresh claim
/// per try, a try every 10 ms and more, so at least 3 s of tries. They stay in the API server
/// and in the plugin's cache, and so in the floor's lookup map.
const SYNC_SPARE: usize = 300;

/// The collection a node-scoped claim watch lists and watches (all namespaces).
const CLAIM_COLLECTION: &str = "/apis/resource.k8s.io/v1/resourceclaims";

/// GETs of claim `name` the API server has received.
fn gets_of(fake: &FakeApi, name: &str) -> usize {
    let path = fixtures::claim_path(NAMESPACE, name);
    fake.requests()
        .iter()
        .filter(|r| r.verb == "get" && r.path == path)
        .count()
}

/// GETs of claims of `series` the API server has received.
fn gets_of_series(fake: &FakeApi, series: u64) -> usize {
    let prefix = fixtures::claim_path(NAMESPACE, &format!("claim-{series}-"));
    fake.requests()
        .iter()
        .filter(|r| r.verb == "get" && r.path.starts_with(&prefix))
        .count()
}

/// What the plugin's claim cache did, as the API server saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheUse {
    /// No list or watch of ResourceClaims came: the plugin has no claim cache, every prepare
    /// GETs its claim.
    NotUsed,
    /// The plugin watches ResourceClaims, and prepares of labelled claims came from it.
    Hit,
    /// The plugin watches ResourceClaims, yet no warm-up prepare of a labelled claim was
    /// served without a GET before the deadline.
    NeverHit,
}

impl CacheUse {
    /// The figure's value.
    pub(crate) fn label(self) -> &'static str {
        match self {
            CacheUse::NotUsed => "not_used",
            CacheUse::Hit => "hit",
            CacheUse::NeverHit => "never_hit",
        }
    }
}

/// The node: the plugin started the production way against the API server over HTTP.
struct RealNode {
    dir: tempfile::TempDir,
    /// The tmpfs directory that holds the CDI directory, as `/var/run/cdi` on a node.
    spec_dir: tempfile::TempDir,
    fs_type: String,
    fake: FakeApi,
    /// Kept for the life of the node: dropping it stops the server.
    _server: ApiServer,
    client: kube::Client,
    config: PluginConfig,
    plugin: RunningPlugin,
    kubelet: Kubelet,
}

/// The claims of one run, by series, and the labelled ones as a node's cache would hold them.
struct RealClaims {
    warmup: Vec<Claim>,
    cached: Vec<Claim>,
    get: Vec<Claim>,
    scheduler: Vec<MissClaim>,
    controller: Vec<MissClaim>,
    /// Every labelled claim by (namespace, name): the floor's lookup map.
    labelled: HashMap<(String, String), ResourceClaim>,
}

/// Builds claims as kerf-controller leaves them (allocated on [`NODE`], spread over the GPUs;
/// labelled with the node when `labelled`) and stores them in the API server.
fn insert_claims(
    fake: &FakeApi,
    inventory: &Inventory,
    series: u64,
    count: usize,
    labelled: Option<&mut HashMap<(String, String), ResourceClaim>>,
) -> Result<Vec<Claim>> {
    let gpus = inventory.gpus.len().max(1);
    let mut claims = Vec::with_capacity(count);
    let mut objects = Vec::with_capacity(count);
    for n in 0..count {
        let claim = numbered_claim(series, n as u64);
        let mut object = slice_claim(&claim, inventory, n % gpus)?;
        if labelled.is_some() {
            object
                .metadata
                .labels
                .get_or_insert_default()
                .insert(CLAIM_NODE_LABEL.to_owned(), node_label_value(NODE));
        }
        objects.push(fake.insert_resource(&object));
        claims.push(claim);
    }
    if let Some(map) = labelled {
        for object in objects {
            let key = (
                object.metadata.namespace.clone().unwrap_or_default(),
                object.metadata.name.clone().unwrap_or_default(),
            );
            map.insert(key, object);
        }
    }
    Ok(claims)
}

/// A kube client as the plugin's binary builds one with `KUBECONFIG` set: read from the file.
async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client> {
    let api_client = |message: String| Error::ApiClient {
        path: path.to_owned(),
        message,
    };
    let kubeconfig =
        kube::config::Kubeconfig::read_from(path).map_err(|e| api_client(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .map_err(|e| api_client(e.to_string()))?;
    kube::Client::try_from(config).map_err(|e| api_client(e.to_string()))
}

/// How a run's node differs from the plugin as deployed, and which series it measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Variant {
    /// What the report calls the run.
    pub name: &'static str,
    /// The per-device claim status writer runs, as in production.
    pub device_status: bool,
    /// The plugin's directory (checkpoint, device metadata files, sockets) and the floor's
    /// files on a tmpfs, where an fsync returns at once.
    pub tmpfs_root: bool,
    /// A thread makes fsync'd writes on the plugin's disk all along ([`disk_writer`]).
    pub disk_writer: bool,
    /// The GET and miss-path series run beside the cached one.
    pub all_series: bool,
}

/// The plugin as deployed, with every series.
const MAIN: Variant = Variant {
    name: "main",
    device_status: true,
    tmpfs_root: false,
    disk_writer: false,
    all_series: true,
};

/// The runs that take the cached path's p99 apart.
const TAIL: [Variant; 3] = [
    Variant {
        name: "status_off",
        device_status: false,
        tmpfs_root: false,
        disk_writer: false,
        all_series: false,
    },
    Variant {
        name: "tmpfs",
        device_status: false,
        tmpfs_root: true,
        disk_writer: false,
        all_series: false,
    },
    Variant {
        name: "disk_load",
        device_status: true,
        tmpfs_root: false,
        disk_writer: true,
        all_series: false,
    },
];

/// The node's root directory: on the work directory's disk, or on a tmpfs for
/// [`Variant::tmpfs_root`]; with its file system's type.
fn node_root(options: &BenchOptions, variant: Variant) -> Result<(tempfile::TempDir, String)> {
    if variant.tmpfs_root {
        let dir = tmpfs_dir(&options.node_cdi_dir)?;
        let fs_type = crate::sys::fs_type(dir.path())?;
        return Ok((dir, fs_type));
    }
    let fs_type = disk_work_dir(&options.work_dir)?;
    let dir = tempfile::Builder::new()
        .prefix("real-")
        .tempdir_in(&options.work_dir)
        .map_err(|e| Error::io("create", &options.work_dir, e))?;
    Ok((dir, fs_type))
}

/// Stores every series' claims in the API server (the series besides the cached one only
/// with [`Variant::all_series`]).
fn insert_all(
    fake: &FakeApi,
    inventory: &Inventory,
    variant: Variant,
    claims: usize,
) -> Result<RealClaims> {
    let others = if variant.all_series { claims } else { 0 };
    let mut labelled = HashMap::new();
    let warmup = WARMUP + SYNC_SPARE;
    Ok(RealClaims {
        warmup: insert_claims(fake, inventory, SERIES_WARMUP, warmup, Some(&mut labelled))?,
        cached: insert_claims(fake, inventory, SERIES_CACHED, claims, Some(&mut labelled))?,
        get: insert_claims(fake, inventory, SERIES_GET, others, None)?,
        scheduler: miss::insert(fake, inventory, SERIES_SCHEDULER, others, Writer::Scheduler)?,
        controller: miss::insert(
            fake,
            inventory,
            SERIES_CONTROLLER,
            others,
            Writer::Controller,
        )?,
        labelled,
    })
}

/// Lays out a node, serves the API server over HTTP with every claim already in it, and
/// starts the plugin with a client read from a kubeconfig.
async fn start(
    options: &BenchOptions,
    variant: Variant,
    claims: usize,
) -> Result<(RealNode, RealClaims)> {
    let (dir, fs_type) = node_root(options, variant)?;
    let spec_dir = tmpfs_dir(&options.node_cdi_dir)?;
    let layout = NodeLayout {
        cdi_dir: Some(&spec_dir.path().join("cdi")),
        gpu_tools: None,
    };
    let (mut config, inventory) = crate::node::lay_out(dir.path(), &layout)?;
    config.claim_device_status = variant.device_status;
    let fake = FakeApi::new();
    let real_claims = insert_all(&fake, &inventory, variant, claims)?;
    let server = ApiServer::start(fake.clone())
        .await
        .map_err(|e| Error::io("serve", "the fake API server on 127.0.0.1", e))?;
    server.set_latency(options.api_latency);
    let kubeconfig = dir.path().join("kubeconfig");
    // The plugin's own ServiceAccount on its node, so that it pays RBAC as in production.
    server
        .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(NODE))
        .map_err(|e| Error::io("write", &kubeconfig, e))?;
    let client = client_from_kubeconfig(&kubeconfig).await?;
    let connections = Connections::kube(client.clone(), &config);
    let plugin = plugin::start(&config, inventory, connections).await?;
    let kubelet = Kubelet::connect(&config).await?;
    let node = RealNode {
        dir,
        spec_dir,
        fs_type,
        fake,
        _server: server,
        client,
        config,
        plugin,
        kubelet,
    };
    Ok((node, real_claims))
}

/// Whether the plugin lists or watches ResourceClaims within [`WATCH_GRACE`] of its start.
async fn watches_claims(fake: &FakeApi) -> bool {
    let deadline = Instant::now() + WATCH_GRACE;
    loop {
        if fake.count("list", CLAIM_COLLECTION) + fake.count("watch", CLAIM_COLLECTION) > 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Prepares and unprepares warm-up claims, each once: the plugin holds a claim it has
/// unprepared back from its cache until the watch shows the claim deallocated or gone, so
/// only a fresh claim shows whether the cache serves. When the plugin watches claims, goes on
/// (with a pause between claims) until a prepare caused no GET (its cache has synced), the
/// claims run out or [`CACHE_SYNC_TIMEOUT`] passed. Returns what the cache did and the sizes
/// of one prepare's files.
async fn warm_up(node: &RealNode, claims: &[Claim]) -> Result<(CacheUse, parts::Sizes)> {
    let watching = watches_claims(&node.fake).await;
    let (first, rest) = claims
        .split_first()
        .ok_or_else(|| Error::Workload("no warm-up claim".into()))?;
    node.kubelet.prepare(std::slice::from_ref(first)).await?;
    let sizes = parts::Sizes::of_prepared(&node.config, first)?;
    node.kubelet.unprepare(std::slice::from_ref(first)).await?;
    let mut cache = if watching {
        CacheUse::NeverHit
    } else {
        CacheUse::NotUsed
    };
    let deadline = Instant::now() + CACHE_SYNC_TIMEOUT;
    for (done, claim) in rest.iter().enumerate() {
        node.kubelet.prepare(std::slice::from_ref(claim)).await?;
        node.kubelet.unprepare(std::slice::from_ref(claim)).await?;
        if cache == CacheUse::NeverHit {
            if gets_of(&node.fake, &claim.name) == 0 {
                cache = CacheUse::Hit;
            } else if Instant::now() >= deadline {
                break;
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        if done + 2 >= WARMUP && cache != CacheUse::NeverHit {
            break;
        }
    }
    Ok((cache, sizes))
}

/// What one run of `prepare-real` measured.
struct RealRuns {
    variant: Variant,
    claims: usize,
    fs_type: String,
    cdi_fs_type: String,
    api_latency: Duration,
    cache: CacheUse,
    /// Labelled claims the floor's lookup map held.
    cache_size: usize,
    sizes: parts::Sizes,
    /// GETs of the measured claims of each series.
    cached_gets: usize,
    get_gets: usize,
    scheduler_gets: usize,
    controller_gets: usize,
    /// What the disk writer did, when it ran.
    written: Option<Written>,
    parts: PartRuns,
}

/// One run: a fresh node as `variant` says, warmed up, then every series and part measured.
async fn run(options: &BenchOptions, variant: Variant) -> Result<RealRuns> {
    let claims = options.prepare_real_claims;
    let (node, real_claims) = start(options, variant, claims).await?;
    let (cache, sizes) = warm_up(&node, &real_claims.warmup).await?;
    let floor_dir = node.dir.path().join("floor");
    let floor = Floor::new(&floor_dir, &sizes, real_claims.labelled)?;
    let parts = Parts::new(
        &floor_dir,
        &node.spec_dir.path().join("floor"),
        &sizes,
        &node.client,
    )?;
    let allocator = Allocator::new(&node.fake);
    let series = Series {
        cached: &real_claims.cached,
        get: &real_claims.get,
        scheduler: &real_claims.scheduler,
        controller: &real_claims.controller,
    };
    node.fake.clear_requests();
    let writer = if variant.disk_writer {
        Some(DiskWriter::start(node.dir.path())?)
    } else {
        None
    };
    let measured = parts::measure(
        &node.kubelet,
        (&floor, &parts),
        &series,
        &allocator,
        &real_claims.warmup,
    )
    .await;
    let written = writer.map(DiskWriter::stop).transpose()?;
    let runs = RealRuns {
        variant,
        claims,
        fs_type: node.fs_type.clone(),
        cdi_fs_type: crate::sys::fs_type(&node.config.cdi_dir)?,
        api_latency: options.api_latency,
        cache,
        cache_size: floor.len(),
        sizes,
        cached_gets: gets_of_series(&node.fake, SERIES_CACHED),
        get_gets: gets_of_series(&node.fake, SERIES_GET),
        scheduler_gets: gets_of_series(&node.fake, SERIES_SCHEDULER),
        controller_gets: gets_of_series(&node.fake, SERIES_CONTROLLER),
        written,
        parts: measured?,
    };
    let RealNode {
        dir,
        spec_dir,
        plugin,
        ..
    } = node;
    plugin.shutdown().await?;
    drop((dir, spec_dir));
    Ok(runs)
}

/// The `prepare-real` benchmark.
///
/// # Errors
/// The node or the API server cannot be set up, or a call fails.
pub(crate) async fn prepare_real(options: &BenchOptions) -> Result<Summary> {
    let main = run(options, MAIN).await?;
    let mut tail = Vec::with_capacity(TAIL.len());
    for variant in TAIL {
        tail.push(run(options, variant).await?);
    }
    Ok(report::summary(&main, &tail))
}
