//! `prepare` and `prepare-parallel`: real `NodePrepareResources` calls over the plugin's
//! Unix socket, against a floor measured in the same run on the same socket and disk.
//!
//! `prepare` measures three cases, each interleaved with its own floor samples (an empty
//! `NodePrepareResources` plus the atomic write of that case's checkpoint, the one write a
//! prepare waits for beside its spec):
//! slices the plugin only accounts for (no GPU tools); the first MPS slice of a GPU on a node
//! that enforces MPS with fake GPU tools, whose prepare runs `nvidia-smi` and
//! `nvidia-cuda-mps-control -d` before it answers; and later MPS slices, whose prepare only
//! adopts the running daemon.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::future::try_join_all;

use crate::floor::FloorWrites;
use kerf_proto::client::Claim;

use crate::gpu_tools::{self, FakeGpuTools};
use crate::node::{BenchNode, Kubelet, NodeLayout};
use crate::stats::{Samples, ms, ratio};
use crate::summary::Summary;
use crate::{BenchOptions, Error, Result, sys};

/// Claims prepared and unprepared before measuring, to warm caches and thread pools.
pub(crate) const WARMUP: usize = 50;
/// Checkpoint writes per prepare: the entry as PrepareCompleted (PrepareStarted stays in
/// memory). The CDI spec and metadata files are written at the same time and rebuilt from
/// the checkpoint at start-up, so the serial floors ([`checkpoint_writes`]) leave them out.
const CHECKPOINT_WRITES_PER_PREPARE: usize = 1;
/// Single-claim prepares measured per round of `prepare-parallel`.
const SINGLES_PER_ROUND: usize = 5;

/// Claim series, so that the benchmarks' claims never share a UID.
const SERIES_WARMUP: u64 = 1;
const SERIES_SERIAL: u64 = 2;
const SERIES_PARALLEL: u64 = 3;
const SERIES_SINGLE: u64 = 4;
const SERIES_MPS_WARMUP: u64 = 5;
const SERIES_MPS_FIRST: u64 = 6;
const SERIES_MPS_ANCHOR: u64 = 7;
const SERIES_MPS_LATER_WARMUP: u64 = 8;
const SERIES_MPS_LATER: u64 = 9;
/// At most this many first-MPS-slice prepares (fewer when `prepare_claims` is smaller): each
/// starts three processes and its round's unprepare stops them, tens of milliseconds a claim.
const MPS_FIRST_MAX: usize = 200;

/// A started benchmark node and the directories it lives in (removed on drop).
struct Setup {
    /// First, so that on drop its processes are killed before their directories go.
    tools: Option<FakeGpuTools>,
    dir: tempfile::TempDir,
    /// The CDI directory's own temporary parent in the node layout.
    spec_dir: Option<tempfile::TempDir>,
    fs_type: String,
    node: BenchNode,
    kubelet: Kubelet,
}

impl Setup {
    /// Where floor spec files go: next to the plugin's CDI specs, on the same file system.
    fn floor_spec_dir(&self) -> PathBuf {
        self.spec_dir
            .as_ref()
            .map_or_else(|| self.dir.path().join("floor"), |d| d.path().join("floor"))
    }
}

/// Makes a fresh node directory under the work directory after checking that it is on a
/// disk, and starts the plugin there; with `node_cdi_dir`, the CDI specs go to a fresh
/// directory under it instead, which must be a tmpfs (the node layout). With
/// `gpu_tools_program`, the plugin enforces MPS slices with fake GPU tools linked to it,
/// checked before the node is handed out.
async fn start_node(
    work_dir: &Path,
    node_cdi_dir: Option<&Path>,
    gpu_tools_program: Option<&Path>,
) -> Result<Setup> {
    let fs_type = disk_work_dir(work_dir)?;
    let spec_dir = node_cdi_dir.map(tmpfs_dir).transpose()?;
    let dir = tempfile::Builder::new()
        .prefix("node-")
        .tempdir_in(work_dir)
        .map_err(|e| Error::io("create", work_dir, e))?;
    let cdi_dir = spec_dir.as_ref().map(|d| d.path().join("cdi"));
    let tools = gpu_tools_program
        .map(|program| FakeGpuTools::install(&dir.path().join("gpu-tools"), program))
        .transpose()?;
    let layout = NodeLayout {
        cdi_dir: cdi_dir.as_deref(),
        gpu_tools: tools.as_ref(),
    };
    let node = BenchNode::start_with(dir.path(), &layout).await?;
    if let (Some(tools), Some(gpu)) = (&tools, node.inventory.gpus.first()) {
        tools.check(&gpu.uuid).await?;
    }
    let kubelet = Kubelet::connect(&node.config).await?;
    Ok(Setup {
        tools,
        dir,
        spec_dir,
        fs_type,
        node,
        kubelet,
    })
}

/// Creates the work directory if missing and returns its file system type, refusing a
/// memory file system, where fsync is free and a prepare's figures would mean nothing.
pub(crate) fn disk_work_dir(work_dir: &Path) -> Result<String> {
    std::fs::create_dir_all(work_dir).map_err(|e| Error::io("create", work_dir, e))?;
    let fs_type = sys::fs_type(work_dir)?;
    if sys::is_memory_fs(&fs_type) {
        return Err(Error::NotOnDisk {
            path: work_dir.to_owned(),
            fs_type,
        });
    }
    Ok(fs_type)
}

/// A fresh directory under `parent`, which must be on a tmpfs.
pub(crate) fn tmpfs_dir(parent: &Path) -> Result<tempfile::TempDir> {
    let fs_type = sys::fs_type(parent)?;
    if !sys::is_memory_fs(&fs_type) {
        return Err(Error::NotOnTmpfs {
            path: parent.to_owned(),
            fs_type,
        });
    }
    tempfile::Builder::new()
        .prefix("kerf-bench-cdi-")
        .tempdir_in(parent)
        .map_err(|e| Error::io("create", parent, e))
}

/// Prepares and unprepares claims to warm up; returns the sizes of the files one prepare
/// writes (checkpoint, spec, checkpoint).
async fn warm_up(node: &BenchNode, kubelet: &Kubelet) -> Result<Vec<usize>> {
    let claims = node.add_claims(SERIES_WARMUP, WARMUP)?;
    let mut sizes = Vec::new();
    for (i, claim) in claims.iter().enumerate() {
        kubelet.prepare(std::slice::from_ref(claim)).await?;
        if i == 0 {
            sizes = prepared_file_sizes(node, claim)?;
        }
        kubelet.unprepare(std::slice::from_ref(claim)).await?;
    }
    Ok(sizes)
}

/// The sizes of the writes every prepare makes among [`prepared_file_sizes`]: the checkpoint's.
fn checkpoint_writes(sizes: &[usize]) -> &[usize] {
    &sizes[..CHECKPOINT_WRITES_PER_PREPARE.min(sizes.len())]
}

fn prepared_file_sizes(node: &BenchNode, claim: &Claim) -> Result<Vec<usize>> {
    let size = |path: &Path| -> Result<usize> {
        let len = std::fs::metadata(path)
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        Ok(usize::try_from(len).unwrap_or(usize::MAX))
    };
    let checkpoint = size(&node.config.checkpoint_file)?;
    let spec = size(&node.spec_path(claim)?)?;
    let mut sizes = vec![checkpoint; CHECKPOINT_WRITES_PER_PREPARE];
    sizes.insert(1, spec);
    Ok(sizes)
}

/// One floor sample: an empty round trip plus the durable writes of one prepare.
async fn floor_once(kubelet: &Kubelet, floor: &FloorWrites) -> Result<Duration> {
    let started = Instant::now();
    kubelet.empty_prepare().await?;
    // Blocking on purpose: the floor is the writes alone, without a hand-off to a thread pool.
    floor.write_plain()?;
    Ok(started.elapsed())
}

/// The floor of `width` claims prepared at once, as the plugin prepares them: their spec
/// files written at the same time without fsync (each claim has its own file, all in the CDI
/// directory, each on a blocking thread), plus the one durable checkpoint write they share
/// (in a directory of their own, as the plugin's).
struct ParallelFloor {
    specs: Vec<FloorWrites>,
    checkpoint: FloorWrites,
}

impl ParallelFloor {
    fn new(spec_dir: &Path, checkpoint_dir: &Path, sizes: &[usize], width: usize) -> Result<Self> {
        let spec = sizes.get(1).copied().unwrap_or_default();
        let checkpoint = sizes.first().copied().unwrap_or_default();
        let specs = (0..width)
            .map(|i| FloorWrites::new(spec_dir, &format!("spec-{i}"), &[spec]))
            .collect::<Result<_>>()?;
        let checkpoint = FloorWrites::new(
            checkpoint_dir,
            "checkpoint",
            &[checkpoint; CHECKPOINT_WRITES_PER_PREPARE],
        )?;
        Ok(ParallelFloor { specs, checkpoint })
    }

    async fn once(&self, kubelet: &Kubelet) -> Result<Duration> {
        let started = Instant::now();
        kubelet.empty_prepare().await?;
        let writers: Vec<_> = self
            .specs
            .iter()
            .map(|spec| {
                let spec = spec.clone();
                tokio::task::spawn_blocking(move || spec.write_plain())
            })
            .collect();
        self.checkpoint.write_plain()?;
        for writer in writers {
            writer
                .await
                .map_err(|e| Error::Workload(format!("floor writer failed: {e}")))??;
        }
        Ok(started.elapsed())
    }
}

pub(crate) async fn timed<F: Future<Output = Result<()>>>(f: F) -> Result<Duration> {
    let started = Instant::now();
    f.await?;
    Ok(started.elapsed())
}

/// The `prepare` benchmark: slices the plugin only accounts for, then MPS slices on a node
/// that enforces them, the first of a GPU and later ones, each against its floor.
///
/// # Errors
/// A node cannot be set up, the fake GPU tools cannot run, or a call fails.
pub(crate) async fn prepare(options: &BenchOptions) -> Result<Summary> {
    let plain = plain_prepares(options).await?;
    let mps = mps_prepares(options).await?;
    Ok(prepare_summary(&plain, &mps))
}

/// What the accounting-only case measured.
struct PlainRuns {
    claims: usize,
    fs_type: String,
    sizes: Vec<usize>,
    floor_writes: (usize, usize),
    prepare: Samples,
    unprepare: Samples,
    floor: Samples,
    rtt: Samples,
}

/// MPS slices as the plugin sees them without GPU tools: recorded, not enforced.
async fn plain_prepares(options: &BenchOptions) -> Result<PlainRuns> {
    let Setup {
        dir,
        fs_type,
        node,
        kubelet,
        ..
    } = start_node(&options.work_dir, None, None).await?;
    let sizes = warm_up(&node, &kubelet).await?;
    let floor = FloorWrites::new(
        &dir.path().join("floor"),
        "prepare",
        checkpoint_writes(&sizes),
    )?;
    let claims = node.add_claims(SERIES_SERIAL, options.prepare_claims)?;
    let mut prepares = Vec::with_capacity(claims.len());
    let mut unprepares = Vec::with_capacity(claims.len());
    let mut floors = Vec::with_capacity(claims.len());
    let mut round_trips = Vec::with_capacity(claims.len());
    // Interleaved, so that both see the same disk and machine noise.
    for claim in &claims {
        let one = std::slice::from_ref(claim);
        prepares.push(timed(kubelet.prepare(one)).await?);
        unprepares.push(timed(kubelet.unprepare(one)).await?);
        floors.push(floor_once(&kubelet, &floor).await?);
        round_trips.push(timed(kubelet.empty_prepare()).await?);
    }
    node.stop().await?;
    drop(dir);
    Ok(PlainRuns {
        claims: claims.len(),
        fs_type,
        sizes,
        floor_writes: (floor.count(), floor.bytes()),
        prepare: Samples::new(prepares),
        unprepare: Samples::new(unprepares),
        floor: Samples::new(floors),
        rtt: Samples::new(round_trips),
    })
}

/// What the MPS cases measured.
#[derive(Default)]
struct MpsRuns {
    program: PathBuf,
    fs_type: String,
    gpus: usize,
    rounds: usize,
    /// First MPS slice of a GPU: the prepare starts its daemon.
    first: Vec<Duration>,
    first_floor: Vec<Duration>,
    first_sizes: Vec<usize>,
    /// `nvidia-smi -c EXCLUSIVE_PROCESS` and `nvidia-cuda-mps-control -d` run directly.
    tools: Vec<Duration>,
    /// Of those: `nvidia-smi`, and `nvidia-cuda-mps-control -d`.
    smi: Vec<Duration>,
    control: Vec<Duration>,
    /// Unprepare of a GPU's last MPS slice: it stops the daemon.
    stop: Vec<Duration>,
    /// Later MPS slices: the prepare adopts the running daemon.
    later: Vec<Duration>,
    later_floor: Vec<Duration>,
    later_sizes: Vec<usize>,
    later_unprepare: Vec<Duration>,
}

/// The MPS cases on a node whose plugin runs the fake GPU tools. Every daemon is stopped by
/// unpreparing its claims; one still running afterwards is killed and reported as an error,
/// and on an error path dropping the tools kills what runs.
async fn mps_prepares(options: &BenchOptions) -> Result<MpsRuns> {
    let program = gpu_tools::program()?;
    let setup = start_node(&options.work_dir, None, Some(&program)).await?;
    let tools = setup
        .tools
        .as_ref()
        .ok_or_else(|| Error::Workload("the MPS node has no GPU tools".into()))?;
    let mut runs = MpsRuns {
        program,
        fs_type: setup.fs_type.clone(),
        ..MpsRuns::default()
    };
    let floor_dir = setup.dir.path().join("floor");
    runs.measure_first(&setup.node, &setup.kubelet, tools, &floor_dir, options)
        .await?;
    runs.measure_later(&setup.node, &setup.kubelet, tools, &floor_dir, options)
        .await?;
    let Setup {
        tools, node, dir, ..
    } = setup;
    node.stop().await?;
    let left = tools.as_ref().map_or(0, FakeGpuTools::wait_for_exit);
    drop((tools, dir));
    if left > 0 {
        return Err(Error::Workload(format!(
            "{left} fake GPU tool process(es) still ran after every MPS claim was unprepared (killed)"
        )));
    }
    Ok(runs)
}

impl MpsRuns {
    /// Rounds of one claim on each GPU, each the GPU's first MPS slice, then the round's
    /// claims unprepared one by one, which stops the daemons for the next round. Each prepare
    /// is followed by a floor sample and by the two programs run directly.
    async fn measure_first(
        &mut self,
        node: &BenchNode,
        kubelet: &Kubelet,
        tools: &FakeGpuTools,
        floor_dir: &Path,
        options: &BenchOptions,
    ) -> Result<()> {
        let gpus: Vec<&str> = node
            .inventory
            .gpus
            .iter()
            .map(|g| g.uuid.as_str())
            .collect();
        if gpus.is_empty() {
            return Err(Error::Workload("the mock inventory has no GPU".into()));
        }
        self.gpus = gpus.len();
        // One round to warm up, which also gives the sizes of a first slice's files: the
        // checkpoint then holds that claim alone (later ones of a round write a bigger one, so
        // this floor is the lower one).
        let warm = node.add_claims(SERIES_MPS_WARMUP, gpus.len())?;
        for (i, claim) in warm.iter().enumerate() {
            kubelet.prepare(std::slice::from_ref(claim)).await?;
            if i == 0 {
                self.first_sizes = prepared_file_sizes(node, claim)?;
            }
        }
        kubelet.unprepare(&warm).await?;
        let floor = FloorWrites::new(floor_dir, "mps-first", checkpoint_writes(&self.first_sizes))?;
        self.rounds = options
            .prepare_claims
            .min(MPS_FIRST_MAX)
            .div_ceil(gpus.len());
        let claims = node.add_claims(SERIES_MPS_FIRST, self.rounds * gpus.len())?;
        let starts_before = tools.plugin_daemon_starts();
        // add_claims puts claim n on GPU n % gpus, so each round has one claim per GPU.
        for round in claims.chunks(gpus.len()) {
            for (claim, gpu) in round.iter().zip(&gpus) {
                self.first
                    .push(timed(kubelet.prepare(std::slice::from_ref(claim))).await?);
                self.first_floor.push(floor_once(kubelet, &floor).await?);
                let direct = tools.start_direct(gpu).await?;
                self.tools.push(direct.total());
                self.smi.push(direct.smi);
                self.control.push(direct.control);
                tools.quit_direct(gpu).await?;
            }
            for claim in round {
                self.stop
                    .push(timed(kubelet.unprepare(std::slice::from_ref(claim))).await?);
            }
        }
        // The case is only what it says if every measured prepare started a daemon.
        let started = tools.plugin_daemon_starts() - starts_before;
        if started != claims.len() {
            return Err(Error::Workload(format!(
                "{} first MPS slices started {started} daemons",
                claims.len()
            )));
        }
        Ok(())
    }

    /// One claim per GPU kept prepared, so that every daemon runs; then claims prepared and
    /// unprepared one at a time, interleaved with the floor.
    async fn measure_later(
        &mut self,
        node: &BenchNode,
        kubelet: &Kubelet,
        tools: &FakeGpuTools,
        floor_dir: &Path,
        options: &BenchOptions,
    ) -> Result<()> {
        let anchors = node.add_claims(SERIES_MPS_ANCHOR, self.gpus)?;
        for claim in &anchors {
            kubelet.prepare(std::slice::from_ref(claim)).await?;
        }
        let starts_before = tools.plugin_daemon_starts();
        let warm = node.add_claims(SERIES_MPS_LATER_WARMUP, WARMUP)?;
        for (i, claim) in warm.iter().enumerate() {
            kubelet.prepare(std::slice::from_ref(claim)).await?;
            if i == 0 {
                // The checkpoint holds the anchors too, as in every measured prepare.
                self.later_sizes = prepared_file_sizes(node, claim)?;
            }
            kubelet.unprepare(std::slice::from_ref(claim)).await?;
        }
        let floor = FloorWrites::new(floor_dir, "mps-later", checkpoint_writes(&self.later_sizes))?;
        let claims = node.add_claims(SERIES_MPS_LATER, options.prepare_claims)?;
        for claim in &claims {
            let one = std::slice::from_ref(claim);
            self.later.push(timed(kubelet.prepare(one)).await?);
            self.later_unprepare
                .push(timed(kubelet.unprepare(one)).await?);
            self.later_floor.push(floor_once(kubelet, &floor).await?);
        }
        let started = tools.plugin_daemon_starts() - starts_before;
        kubelet.unprepare(&anchors).await?;
        if started != 0 {
            return Err(Error::Workload(format!(
                "later MPS slices started {started} daemons instead of adopting the running ones"
            )));
        }
        Ok(())
    }
}

/// `a / b`, for the targets; `b` of zero counts as the smallest positive time.
pub(crate) fn ratio_of(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(f64::MIN_POSITIVE)
}

/// The figures and targets of `prepare`: the accounting-only case first, as before the MPS
/// cases existed, then the MPS cases.
fn prepare_summary(plain: &PlainRuns, mps: &MpsRuns) -> Summary {
    let PlainRuns {
        prepare,
        unprepare,
        floor: floor_s,
        rtt,
        fs_type,
        ..
    } = plain;
    let mut s = Summary::new("prepare");
    s.detail(format!(
        "{} claims, one at a time, each a NodePrepareResources over the plugin's Unix socket (mock H100, 10Gi MPS slice, accounting only: no GPU tools), then NodeUnprepareResources; files on {fs_type}",
        plain.claims
    ));
    s.detail(format!("prepare   {}", prepare.p50_p99_max_ms()));
    s.detail(format!(
        "floor     {}  (empty NodePrepareResources + {} atomic write(s) of {} bytes: the checkpoint; the spec, {} bytes, written at the same time)",
        floor_s.p50_p99_max_ms(),
        plain.floor_writes.0,
        plain.floor_writes.1,
        plain.sizes.get(1).copied().unwrap_or_default()
    ));
    s.detail(format!(
        "unprepare {};  empty round trip {}",
        unprepare.p50_p99_ms(),
        rtt.p50_p99_ms()
    ));
    mps_details(&mut s, mps);
    let ratio_p50 = ratio_of(prepare.p50(), floor_s.p50());
    let ratio_p99 = ratio_of(prepare.p99(), floor_s.p99());
    s.figure("claims", plain.claims)
        .figure("fs", fs_type)
        .figure("p50_ms", ms(prepare.p50()))
        .figure("p99_ms", ms(prepare.p99()))
        .figure("max_ms", ms(prepare.max()))
        .figure("floor_p50_ms", ms(floor_s.p50()))
        .figure("floor_p99_ms", ms(floor_s.p99()))
        .figure("ratio_p50", ratio(prepare.p50(), floor_s.p50()))
        .figure("ratio_p99", ratio(prepare.p99(), floor_s.p99()))
        .figure("unprepare_p50_ms", ms(unprepare.p50()))
        .figure("unprepare_p99_ms", ms(unprepare.p99()))
        .figure("rtt_p50_ms", ms(rtt.p50()));
    mps_figures(&mut s, mps);
    s.target(
        "p99_target",
        "prepare p99 <= 2 ms",
        prepare.p99() <= Duration::from_millis(2),
        format!("{} ms", ms(prepare.p99())),
    );
    s.target(
        "ratio_p99_target",
        "prepare ratio_p99 <= 1.5",
        ratio_p99 <= 1.5,
        format!("{ratio_p99:.2}; ratio_p50 {ratio_p50:.2}"),
    );
    s
}

/// The samples of one MPS case and of its floor.
fn case(samples: &[Duration], floor: &[Duration]) -> (Samples, Samples) {
    (Samples::new(samples.to_vec()), Samples::new(floor.to_vec()))
}

fn mps_details(s: &mut Summary, mps: &MpsRuns) {
    let (first, first_floor) = case(&mps.first, &mps.first_floor);
    let (later, later_floor) = case(&mps.later, &mps.later_floor);
    let (tools, stop) = case(&mps.tools, &mps.stop);
    let later_unprepare = Samples::new(mps.later_unprepare.clone());
    s.detail(format!(
        "MPS slices enforced: the plugin runs fake nvidia-smi and nvidia-cuda-mps-control ({}), {} mock H100; files on {}",
        mps.program.display(),
        mps.gpus,
        mps.fs_type
    ));
    s.detail(format!(
        "first MPS slice of a GPU  {}  ({} rounds of one claim on each GPU; the prepare starts the GPU's daemon: nvidia-smi -c EXCLUSIVE_PROCESS, nvidia-cuda-mps-control -d, its PID file)",
        first.p50_p99_max_ms(),
        mps.rounds
    ));
    s.detail(format!(
        "  floor   {}  (empty NodePrepareResources + atomic write of {:?} bytes)  ratio_p50 {}  ratio_p99 {}",
        first_floor.p50_p99_ms(),
        checkpoint_writes(&mps.first_sizes),
        ratio(first.p50(), first_floor.p50()),
        ratio(first.p99(), first_floor.p99())
    ));
    let (smi, control) = case(&mps.smi, &mps.control);
    s.detail(format!(
        "  the two programs run directly  {}  (nvidia-smi p50 {} ms, then nvidia-cuda-mps-control -d until the daemon's PID file exists p50 {} ms)",
        tools.p50_p99_ms(),
        ms(smi.p50()),
        ms(control.p50())
    ));
    s.detail(format!(
        "  unprepare of the GPU's last slice (stops the daemon: quit, wait, nvidia-smi -c DEFAULT; not in the prepare figures)  {}",
        stop.p50_p99_ms()
    ));
    s.detail(format!(
        "later MPS slices  {}  ({} claims one at a time while every GPU's daemon runs; the prepare adopts it: PID file, /proc)",
        later.p50_p99_max_ms(),
        mps.later.len()
    ));
    s.detail(format!(
        "  floor   {}  (empty NodePrepareResources + atomic write of {:?} bytes)  ratio_p50 {}  ratio_p99 {};  unprepare {}",
        later_floor.p50_p99_ms(),
        checkpoint_writes(&mps.later_sizes),
        ratio(later.p50(), later_floor.p50()),
        ratio(later.p99(), later_floor.p99()),
        later_unprepare.p50_p99_ms()
    ));
}

fn mps_figures(s: &mut Summary, mps: &MpsRuns) {
    let (first, first_floor) = case(&mps.first, &mps.first_floor);
    let (later, later_floor) = case(&mps.later, &mps.later_floor);
    let (tools, stop) = case(&mps.tools, &mps.stop);
    s.figure("mps_first_claims", mps.first.len())
        .figure("mps_first_p50_ms", ms(first.p50()))
        .figure("mps_first_p99_ms", ms(first.p99()))
        .figure("mps_first_floor_p50_ms", ms(first_floor.p50()))
        .figure("mps_first_floor_p99_ms", ms(first_floor.p99()))
        .figure("mps_first_ratio_p50", ratio(first.p50(), first_floor.p50()))
        .figure("mps_first_ratio_p99", ratio(first.p99(), first_floor.p99()))
        .figure("mps_tools_p50_ms", ms(tools.p50()))
        .figure("mps_smi_p50_ms", ms(Samples::new(mps.smi.clone()).p50()))
        .figure(
            "mps_control_p50_ms",
            ms(Samples::new(mps.control.clone()).p50()),
        )
        .figure("mps_stop_p50_ms", ms(stop.p50()))
        .figure("mps_later_claims", mps.later.len())
        .figure("mps_later_p50_ms", ms(later.p50()))
        .figure("mps_later_p99_ms", ms(later.p99()))
        .figure("mps_later_floor_p50_ms", ms(later_floor.p50()))
        .figure("mps_later_floor_p99_ms", ms(later_floor.p99()))
        .figure("mps_later_ratio_p50", ratio(later.p50(), later_floor.p50()))
        .figure("mps_later_ratio_p99", ratio(later.p99(), later_floor.p99()));
}

/// The samples of `prepare-parallel`, one per round (singles: several per round).
#[derive(Default)]
struct ParallelRuns {
    single: Vec<Duration>,
    separate: Vec<Duration>,
    batched: Vec<Duration>,
    floor: Vec<Duration>,
}

impl ParallelRuns {
    /// Each round: the floor, the single-claim baseline, the claims as concurrent calls,
    /// and as one batched call; everything is unprepared again before the next step.
    async fn measure(
        kubelet: &Kubelet,
        floor: &ParallelFloor,
        claims: &[Claim],
        singles: &[Claim],
        rounds: usize,
    ) -> Result<Self> {
        let mut runs = ParallelRuns::default();
        for _ in 0..rounds {
            runs.floor.push(floor.once(kubelet).await?);
            for claim in singles {
                let one = std::slice::from_ref(claim);
                runs.single.push(timed(kubelet.prepare(one)).await?);
                kubelet.unprepare(one).await?;
            }
            let concurrent = claims
                .iter()
                .map(|c| kubelet.prepare(std::slice::from_ref(c)));
            runs.separate
                .push(timed(async { try_join_all(concurrent).await.map(|_| ()) }).await?);
            kubelet.unprepare(claims).await?;
            runs.batched.push(timed(kubelet.prepare(claims)).await?);
            kubelet.unprepare(claims).await?;
        }
        Ok(runs)
    }
}

/// Where `prepare-parallel` keeps the plugin's CDI specs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecLayout {
    /// Under the work directory, on disk with the checkpoint: the strictest case.
    Disk,
    /// On a tmpfs, as `/var/run/cdi` is on a node; the checkpoint stays on disk.
    Node,
}

/// The `prepare-parallel` benchmark (`prepare-parallel-node` with [`SpecLayout::Node`]).
///
/// # Errors
/// The node cannot be set up or a call fails.
pub(crate) async fn prepare_parallel(
    options: &BenchOptions,
    layout: SpecLayout,
) -> Result<Summary> {
    let node_cdi_dir = (layout == SpecLayout::Node).then_some(options.node_cdi_dir.as_path());
    let setup = start_node(&options.work_dir, node_cdi_dir, None).await?;
    let sizes = warm_up(&setup.node, &setup.kubelet).await?;
    let width = options.parallel_claims;
    let floor = ParallelFloor::new(
        &setup.floor_spec_dir(),
        &setup.dir.path().join("floor-checkpoint"),
        &sizes,
        width,
    )?;
    let claims = setup.node.add_claims(SERIES_PARALLEL, width)?;
    let singles = setup.node.add_claims(SERIES_SINGLE, SINGLES_PER_ROUND)?;
    let runs = ParallelRuns::measure(
        &setup.kubelet,
        &floor,
        &claims,
        &singles,
        options.parallel_rounds,
    )
    .await?;
    let spec_fs = sys::fs_type(&setup.node.config.cdi_dir)?;
    let Setup {
        dir,
        spec_dir,
        fs_type,
        node,
        ..
    } = setup;
    node.stop().await?;
    drop((dir, spec_dir));
    Ok(parallel_summary(
        runs,
        layout,
        width,
        options.parallel_rounds,
        &fs_type,
        &spec_fs,
    ))
}

/// The figures and targets of `prepare-parallel(-node)`.
fn parallel_summary(
    runs: ParallelRuns,
    layout: SpecLayout,
    width: usize,
    rounds: usize,
    fs_type: &str,
    spec_fs: &str,
) -> Summary {
    let (single, separate, batched, floor) = (
        Samples::new(runs.single),
        Samples::new(runs.separate),
        Samples::new(runs.batched),
        Samples::new(runs.floor),
    );
    let one = single.p50();
    let separate_ratio = separate.p50().as_secs_f64() / one.as_secs_f64().max(f64::MIN_POSITIVE);
    let batched_ratio = batched.p50().as_secs_f64() / one.as_secs_f64().max(f64::MIN_POSITIVE);
    let mut s = Summary::new(match layout {
        SpecLayout::Disk => "prepare-parallel",
        SpecLayout::Node => "prepare-parallel-node",
    });
    s.detail(format!(
        "{rounds} rounds of {width} claims prepared at once (as {width} concurrent calls, and as one batched call); CDI specs on {spec_fs}, checkpoint on {fs_type}; baseline: one single-claim prepare, {SINGLES_PER_ROUND} per round"
    ));
    s.detail(format!("one claim          {}", single.p50_p99_ms()));
    s.detail(format!(
        "{width} separate calls  wall p50 {} ms  max {} ms  = {separate_ratio:.2} x one claim",
        ms(separate.p50()),
        ms(separate.max())
    ));
    s.detail(format!(
        "1 call of {width}      wall p50 {} ms  max {} ms  = {batched_ratio:.2} x one claim",
        ms(batched.p50()),
        ms(batched.max())
    ));
    s.detail(format!(
        "floor              wall p50 {} ms  max {} ms  (empty NodePrepareResources + {width} concurrent spec-sized files written without fsync + {CHECKPOINT_WRITES_PER_PREPARE} shared checkpoint write at the same time) = {} x one claim; {width} separate calls = {} x floor, 1 call = {} x floor",
        ms(floor.p50()),
        ms(floor.max()),
        ratio(floor.p50(), one),
        ratio(separate.p50(), floor.p50()),
        ratio(batched.p50(), floor.p50())
    ));
    s.figure("claims", width)
        .figure("rounds", rounds)
        .figure("fs", fs_type)
        .figure("cdi_fs", spec_fs)
        .figure("one_p50_ms", ms(one))
        .figure("separate_p50_ms", ms(separate.p50()))
        .figure("separate_max_ms", ms(separate.max()))
        .figure("separate_ratio", ratio(separate.p50(), one))
        .figure("batched_p50_ms", ms(batched.p50()))
        .figure("batched_max_ms", ms(batched.max()))
        .figure("batched_ratio", ratio(batched.p50(), one))
        .figure("floor_p50_ms", ms(floor.p50()))
        .figure("separate_ratio_floor", ratio(separate.p50(), floor.p50()))
        .figure("batched_ratio_floor", ratio(batched.p50(), floor.p50()))
        .figure("floor_ratio", ratio(floor.p50(), one));
    parallel_targets(&mut s, width, separate_ratio, batched_ratio);
    s
}

/// The `prepare-parallel(-node)` targets: `width` claims at once, as separate calls and as
/// one batched call, within 4 x one claim.
fn parallel_targets(s: &mut Summary, width: usize, separate_ratio: f64, batched_ratio: f64) {
    s.target(
        "separate_target",
        format!("{width} concurrent calls within 4 x one claim"),
        separate_ratio <= 4.0,
        format!("{separate_ratio:.2} x"),
    );
    s.target(
        "batched_target",
        format!("one call of {width} claims within 4 x one claim"),
        batched_ratio <= 4.0,
        format!("{batched_ratio:.2} x"),
    );
}
