//! The floor of a real-path prepare and its parts, each measured on its own, interleaved
//! with the prepares they explain.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_kubelet_plugin::config::PluginConfig;
use kerf_proto::client::Claim;
use kube::Api;

use super::miss::{Allocator, MissClaim, Writer};
use crate::floor::FloorWrites;
use crate::node::{Kubelet, NAMESPACE, spec_path};
use crate::prepare::timed;
use crate::{Error, Result};

/// The files one prepare leaves, by size: what the floor and the write parts write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Sizes {
    /// The checkpoint, which the prepare writes.
    pub checkpoint: usize,
    /// The claim's CDI spec.
    pub spec: usize,
    /// The claim's device metadata files, by file name.
    pub metadata: Vec<(String, usize)>,
}

impl Sizes {
    /// The sizes of the files of `claim`, which the plugin configured by `config` holds
    /// prepared (and no other claim, so the checkpoint is a one-claim checkpoint).
    pub(super) fn of_prepared(config: &PluginConfig, claim: &Claim) -> Result<Self> {
        let metadata_dir = config
            .checkpoint_file
            .parent()
            .map(|dir| dir.join(kerf_core::cdi::METADATA_HOST_SUBDIR))
            .ok_or_else(|| Error::Workload("the checkpoint file has no directory".into()))?;
        let mut metadata = Vec::new();
        files_under(&metadata_dir, &mut metadata)?;
        Ok(Sizes {
            checkpoint: file_size(&config.checkpoint_file)?,
            spec: file_size(&spec_path(config, claim)?)?,
            metadata,
        })
    }

    /// Bytes of the files written without fsync: the spec and the metadata files.
    pub(super) fn plain_bytes(&self) -> usize {
        self.spec + self.metadata.iter().map(|(_, size)| size).sum::<usize>()
    }
}

fn file_size(path: &Path) -> Result<usize> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    Ok(usize::try_from(len).unwrap_or(usize::MAX))
}

/// Appends every regular file under `dir` (recursively) as (name, size).
fn files_under(dir: &Path, out: &mut Vec<(String, usize)>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| Error::io("stat", &path, e))?;
        if kind.is_dir() {
            files_under(&path, out)?;
        } else if kind.is_file() {
            let name = entry.file_name().to_string_lossy().into_owned();
            out.push((name, file_size(&path)?));
        }
    }
    Ok(())
}

/// The floor of a prepare from the cache: an empty `NodePrepareResources`, one
/// atomic write of the checkpoint's size, and one lookup of the claim in a map of as many
/// claims as the plugin's cache holds (its UID compared, as the plugin must).
pub(super) struct Floor {
    checkpoint: FloorWrites,
    claims: HashMap<(String, String), ResourceClaim>,
}

impl Floor {
    /// Writes go to `dir`; `claims` are the labelled claims, by (namespace, name).
    pub(super) fn new(
        dir: &Path,
        sizes: &Sizes,
        claims: impl IntoIterator<Item = ((String, String), ResourceClaim)>,
    ) -> Result<Self> {
        Ok(Floor {
            checkpoint: FloorWrites::new(dir, "floor-checkpoint", &[sizes.checkpoint])?,
            claims: claims.into_iter().collect(),
        })
    }

    /// Claims in the lookup map.
    pub(super) fn len(&self) -> usize {
        self.claims.len()
    }

    /// Whether `claim` is in the map with its UID.
    fn lookup(&self, claim: &Claim) -> bool {
        self.claims
            .get(&(claim.namespace.clone(), claim.name.clone()))
            .is_some_and(|c| c.metadata.uid.as_deref() == Some(claim.uid.as_str()))
    }

    /// One floor sample for a prepare of `claim`.
    async fn once(&self, kubelet: &Kubelet, claim: &Claim) -> Result<Duration> {
        let started = Instant::now();
        kubelet.empty_prepare().await?;
        // Blocking on purpose, as the in-memory floor: the write alone, no thread hand-off.
        self.checkpoint.write_plain()?;
        if !std::hint::black_box(self.lookup(claim)) {
            return Err(Error::Workload(format!(
                "claim {} is not in the floor's map",
                claim.name
            )));
        }
        Ok(started.elapsed())
    }
}

/// The parts of a prepare, each on its own.
pub(super) struct Parts {
    /// The write of the checkpoint's size (its own file, not the floor's).
    checkpoint: FloorWrites,
    /// The spec and metadata files, written without fsync.
    plain: PlainWrites,
    /// GETs of claims through the plugin's client, at the API server's latency.
    api: Api<ResourceClaim>,
    /// Where the fsync'd write without the directory fsync (as dra-example-driver writes its
    /// checkpoint) goes, and what it writes.
    no_dir_sync: (PathBuf, Vec<u8>),
}

impl Parts {
    /// The checkpoint and metadata writes go to `dir`, the spec's to `spec_dir` (on the file
    /// systems of the plugin's); GETs through `client`.
    pub(super) fn new(
        dir: &Path,
        spec_dir: &Path,
        sizes: &Sizes,
        client: &kube::Client,
    ) -> Result<Self> {
        Ok(Parts {
            checkpoint: FloorWrites::new(dir, "part-checkpoint", &[sizes.checkpoint])?,
            plain: PlainWrites::new(&dir.join("plain"), spec_dir, sizes)?,
            api: Api::namespaced(client.clone(), NAMESPACE),
            no_dir_sync: (dir.to_owned(), vec![b'x'; sizes.checkpoint]),
        })
    }

    /// The checkpoint's write as dra-example-driver makes its own (`writeCheckpoint` in
    /// `cmd/dra-example-kubeletplugin/checkpoint.go`): a temporary file, fsync, rename, and no
    /// fsync of the directory, so the rename itself may not survive a power loss.
    fn without_dir_sync(&self) -> Result<()> {
        let (dir, contents) = &self.no_dir_sync;
        let temp = dir.join(".part-no-dir-sync.tmp");
        let mut file = std::fs::File::create(&temp).map_err(|e| Error::io("create", &temp, e))?;
        std::io::Write::write_all(&mut file, contents).map_err(|e| Error::io("write", &temp, e))?;
        file.sync_data().map_err(|e| Error::io("fsync", &temp, e))?;
        drop(file);
        let target = dir.join("part-no-dir-sync.json");
        std::fs::rename(&temp, &target).map_err(|e| Error::io("rename", &target, e))
    }
}

/// The spec and metadata files of one prepare, written as the plugin writes them when it
/// does not fsync: a temporary file renamed over the target, the metadata files in a
/// directory of the claim's own.
struct PlainWrites {
    dir: PathBuf,
    spec_dir: PathBuf,
    spec: Vec<u8>,
    metadata: Vec<(String, Vec<u8>)>,
}

impl PlainWrites {
    fn new(dir: &Path, spec_dir: &Path, sizes: &Sizes) -> Result<Self> {
        for dir in [dir, spec_dir] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        }
        Ok(PlainWrites {
            dir: dir.to_owned(),
            spec_dir: spec_dir.to_owned(),
            spec: vec![b'x'; sizes.spec],
            metadata: sizes
                .metadata
                .iter()
                .map(|(name, size)| (name.clone(), vec![b'x'; *size]))
                .collect(),
        })
    }

    fn claim_dir(&self) -> PathBuf {
        self.dir.join("claim")
    }

    /// Metadata files first, as the plugin writes them before the spec that mounts them.
    fn write(&self) -> Result<()> {
        let claim_dir = self.claim_dir();
        std::fs::create_dir_all(&claim_dir).map_err(|e| Error::io("create", &claim_dir, e))?;
        for (name, contents) in &self.metadata {
            replace(&claim_dir, name, contents)?;
        }
        replace(&self.spec_dir, "spec.json", &self.spec)
    }

    /// Removes what [`PlainWrites::write`] wrote, as an unprepare does (not timed).
    fn clean(&self) -> Result<()> {
        let claim_dir = self.claim_dir();
        std::fs::remove_dir_all(&claim_dir).map_err(|e| Error::io("remove", &claim_dir, e))
    }
}

/// `dir/name` replaced by `contents` through a temporary file, without fsync.
fn replace(dir: &Path, name: &str, contents: &[u8]) -> Result<()> {
    let temp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&temp, contents).map_err(|e| Error::io("write", &temp, e))?;
    let target = dir.join(name);
    std::fs::rename(&temp, &target).map_err(|e| Error::io("rename", &target, e))
}

fn timed_sync(f: impl FnOnce() -> Result<()>) -> Result<Duration> {
    let started = Instant::now();
    f()?;
    Ok(started.elapsed())
}

/// The samples of one run.
#[derive(Debug, Default)]
pub(super) struct PartRuns {
    /// Prepares of labelled claims (from the cache when the plugin has one).
    pub cached: Vec<Duration>,
    pub cached_unprepare: Vec<Duration>,
    /// Prepares of unlabelled claims allocated long before: every one GETs.
    pub get: Vec<Duration>,
    pub get_unprepare: Vec<Duration>,
    /// Prepares right after kube-scheduler wrote the allocation (no node label).
    pub scheduler: Vec<Duration>,
    /// Prepares right after kerf-controller wrote the allocation of a labelled claim.
    pub controller: Vec<Duration>,
    pub floor: Vec<Duration>,
    /// The parts: a GET, the checkpoint write, the same fsync'd as dra-example-driver writes
    /// its checkpoint, the spec and metadata writes, the empty call, the floor's lookup.
    pub api: Vec<Duration>,
    pub checkpoint_write: Vec<Duration>,
    pub fsynced: Vec<Duration>,
    pub plain: Vec<Duration>,
    pub rpc: Vec<Duration>,
    pub lookup: Vec<Duration>,
}

impl PartRuns {
    /// The miss path's floor, sample by sample: the GET and the floor measured in the same
    /// round, added.
    pub(super) fn miss_floor(&self) -> Vec<Duration> {
        self.api
            .iter()
            .zip(&self.floor)
            .map(|(get, floor)| *get + *floor)
            .collect()
    }
}

/// The claims of each series; the series other than `cached` may be empty (the tail runs).
pub(super) struct Series<'a> {
    pub cached: &'a [Claim],
    pub get: &'a [Claim],
    pub scheduler: &'a [MissClaim],
    pub controller: &'a [MissClaim],
}

/// Prepares and unprepares `claims`, pushing the prepare's time to `prepares` and the
/// unprepare's to `unprepares` when given.
async fn prepare_once(
    kubelet: &Kubelet,
    claim: &Claim,
    prepares: &mut Vec<Duration>,
    unprepares: Option<&mut Vec<Duration>>,
) -> Result<()> {
    let one = std::slice::from_ref(claim);
    prepares.push(timed(kubelet.prepare(one)).await?);
    let unprepare = timed(kubelet.unprepare(one)).await?;
    if let Some(unprepares) = unprepares {
        unprepares.push(unprepare);
    }
    Ok(())
}

/// One claim of each series at a time: each prepared and unprepared (a miss-path claim right
/// after its allocation is written), then a floor sample, then every part once, so that all
/// see the same disk and machine noise. The parts' GETs read `extra` claims in turn (neither
/// series', so that the series' GET counts stay theirs).
pub(super) async fn measure(
    kubelet: &Kubelet,
    (floor, parts): (&Floor, &Parts),
    series: &Series<'_>,
    allocator: &Allocator,
    extra: &[Claim],
) -> Result<PartRuns> {
    let mut runs = PartRuns::default();
    for (n, (cached, extra)) in series.cached.iter().zip(extra.iter().cycle()).enumerate() {
        prepare_once(
            kubelet,
            cached,
            &mut runs.cached,
            Some(&mut runs.cached_unprepare),
        )
        .await?;
        if let Some(get) = series.get.get(n) {
            prepare_once(kubelet, get, &mut runs.get, Some(&mut runs.get_unprepare)).await?;
        }
        if let Some(miss) = series.scheduler.get(n) {
            allocator.allocate(miss, Writer::Scheduler).await?;
            prepare_once(kubelet, &miss.claim, &mut runs.scheduler, None).await?;
        }
        if let Some(miss) = series.controller.get(n) {
            allocator.allocate(miss, Writer::Controller).await?;
            prepare_once(kubelet, &miss.claim, &mut runs.controller, None).await?;
        }
        runs.floor.push(floor.once(kubelet, cached).await?);
        measure_parts(kubelet, (floor, parts), cached, extra, &mut runs).await?;
    }
    Ok(runs)
}

/// Each part once, on its own.
async fn measure_parts(
    kubelet: &Kubelet,
    (floor, parts): (&Floor, &Parts),
    cached: &Claim,
    extra: &Claim,
    runs: &mut PartRuns,
) -> Result<()> {
    let started = Instant::now();
    parts
        .api
        .get(&extra.name)
        .await
        .map_err(|e| Error::Workload(format!("GET of claim {}: {e}", extra.name)))?;
    runs.api.push(started.elapsed());
    runs.checkpoint_write
        .push(timed_sync(|| parts.checkpoint.write_plain())?);
    runs.fsynced.push(timed_sync(|| parts.without_dir_sync())?);
    runs.plain.push(timed_sync(|| parts.plain.write())?);
    parts.plain.clean()?;
    runs.rpc.push(timed(kubelet.empty_prepare()).await?);
    let started = Instant::now();
    let found = std::hint::black_box(floor.lookup(cached));
    runs.lookup.push(started.elapsed());
    if !found {
        return Err(Error::Workload(format!(
            "claim {} is not in the floor's map",
            cached.name
        )));
    }
    Ok(())
}
