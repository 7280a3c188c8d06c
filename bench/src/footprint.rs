//! `footprint`: resident memory of the kubelet plugin (idle, and after prepare/unprepare
//! cycles) and of the controller's allocator index.
//!
//! Each part runs best in a fresh child process ([`crate::Reexec`]): the plugin child serves
//! on its sockets while this process drives the cycles and reads the child's
//! `/proc/<pid>/status`, so the figures hold the plugin alone; the index child reports its
//! RSS before and after building the index, with no freed memory of earlier benchmarks for
//! the allocator to reuse. Without a way to re-exec, both parts run in this process and the
//! figures include the benchmark's own memory (reported as `mode=in-process`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use kerf_core::alloc::{Policy, place_where};
use kerf_proto::client::Claim;

use crate::node::{BenchNode, Kubelet, PROFILE, numbered_claim, plugin_config};
use crate::stats::mib;
use crate::summary::Summary;
use crate::workload::{self, Mix, Workload};
use crate::{BenchOptions, Error, Reexec, Result, sys};

/// Hidden benchmark name of the plugin child.
pub(crate) const PLUGIN_CHILD: &str = "__footprint-plugin-child";
/// Hidden benchmark name of the index child.
pub(crate) const INDEX_CHILD: &str = "__footprint-index-child";

/// Claims the cycles go round.
const CYCLE_CLAIMS: usize = 8;
const SERIES_FOOTPRINT: u64 = 5;
/// RSS samples over the cycles.
const SAMPLES: usize = 10;
/// Growth after warm-up that still counts as none: a few pages of allocator noise.
const GROWTH_TOLERANCE: u64 = 128 << 10;
/// Plugin RSS target when idle.
const PLUGIN_IDLE_TARGET: u64 = 20 << 20;
/// Index RSS target.
const INDEX_TARGET: u64 = 100 << 20;
/// Draws of the workload allowed per claim to be placed (skipping those that do not fit).
const DRAWS_PER_CLAIM: usize = 3;

/// The plugin's memory as measured: idle, then after every tenth of the cycles.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PluginMemory {
    idle: u64,
    /// (cycles done, RSS).
    samples: Vec<(usize, u64)>,
}

impl PluginMemory {
    /// RSS after all cycles.
    fn after(&self) -> u64 {
        self.samples.last().map_or(self.idle, |s| s.1)
    }

    /// RSS half-way through the cycles: the first half is the warm-up (connections,
    /// buffers, the blocking-thread pool and its allocator arenas settle).
    fn halfway(&self) -> u64 {
        self.samples
            .get(self.samples.len().saturating_sub(1) / 2)
            .map_or(self.idle, |s| s.1)
    }

    /// Growth over the second half of the cycles.
    fn growth(&self) -> u64 {
        self.after().saturating_sub(self.halfway())
    }
}

/// The index's memory as measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexMemory {
    /// RSS before anything was built.
    pub before: u64,
    /// RSS with the nodes in the index.
    pub nodes: u64,
    /// RSS with the nodes and the allocated claims.
    pub after: u64,
    /// Claims allocated.
    pub claims: usize,
}

/// The `footprint` benchmark. Runs its own Tokio runtime for the plugin part.
///
/// # Errors
/// The plugin or a child process fails.
pub(crate) fn footprint(
    options: &BenchOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<Summary> {
    std::fs::create_dir_all(&options.work_dir)
        .map_err(|e| Error::io("create", &options.work_dir, e))?;
    let dir = tempfile::Builder::new()
        .prefix("footprint-")
        .tempdir_in(&options.work_dir)
        .map_err(|e| Error::io("create", &options.work_dir, e))?;
    let (mode, plugin, index) = match &options.reexec {
        Some(reexec) => (
            "child",
            plugin_in_child(reexec, dir.path(), options, runtime)?,
            index_in_child(reexec, options)?,
        ),
        None => (
            "in-process",
            runtime.block_on(plugin_in_process(dir.path(), options))?,
            index_memory(options)?,
        ),
    };
    Ok(report(mode, &plugin, index, options))
}

fn report(
    mode: &str,
    plugin: &PluginMemory,
    index: IndexMemory,
    options: &BenchOptions,
) -> Summary {
    let growth = plugin.growth();
    let index_bytes = index.after.saturating_sub(index.before);
    let mut s = Summary::new("footprint");
    s.detail(format!(
        "resident memory (VmRSS), measured {}",
        if mode == "child" {
            "in fresh child processes"
        } else {
            "in this process (includes the benchmark's own memory)"
        }
    ));
    let trajectory: Vec<String> = plugin
        .samples
        .iter()
        .map(|(cycles, rss)| format!("{cycles}: {}", mib(*rss)))
        .collect();
    s.detail(format!(
        "plugin, 8 mock H100: idle {} MiB; MiB after N prepare/unprepare cycles: {}; growth over the second half {} KiB",
        mib(plugin.idle),
        trajectory.join(", "),
        growth >> 10
    ));
    s.detail(format!(
        "controller index: {} nodes {} MiB, + {} allocated claims {} MiB; total {} MiB over a process baseline of {} MiB",
        options.nodes,
        mib(index.nodes.saturating_sub(index.before)),
        index.claims,
        mib(index.after.saturating_sub(index.nodes)),
        mib(index_bytes),
        mib(index.before)
    ));
    s.figure("mode", mode)
        .figure("plugin_idle_mib", mib(plugin.idle))
        .figure("plugin_halfway_mib", mib(plugin.halfway()))
        .figure("plugin_after_mib", mib(plugin.after()))
        .figure("plugin_cycles", options.footprint_cycles)
        .figure("plugin_growth_kib", growth >> 10)
        .figure("index_nodes", options.nodes)
        .figure("index_claims", index.claims)
        .figure("index_mib", mib(index_bytes));
    targets(&mut s, plugin, &index, options);
    s
}

/// The footprint targets: the idle plugin, its growth, the controller's index.
fn targets(s: &mut Summary, plugin: &PluginMemory, index: &IndexMemory, options: &BenchOptions) {
    let growth = plugin.growth();
    let index_bytes = index.after.saturating_sub(index.before);
    s.target(
        "plugin_idle_target",
        "plugin RSS idle <= 20 MiB",
        plugin.idle <= PLUGIN_IDLE_TARGET,
        format!("{} MiB", mib(plugin.idle)),
    );
    s.target(
        "plugin_growth_target",
        format!(
            "plugin RSS does not grow over {} cycles (<= {} KiB over the second half)",
            options.footprint_cycles,
            GROWTH_TOLERANCE >> 10
        ),
        growth <= GROWTH_TOLERANCE,
        format!("{} KiB", growth >> 10),
    );
    s.target(
        "index_target",
        format!("controller index <= 100 MiB at {} claims", index.claims),
        index_bytes <= INDEX_TARGET && index.claims >= options.footprint_claims,
        format!("{} MiB", mib(index_bytes)),
    );
}

fn cycle_claims() -> Vec<Claim> {
    (0..CYCLE_CLAIMS)
        .map(|n| numbered_claim(SERIES_FOOTPRINT, n as u64))
        .collect()
}

async fn cycles(kubelet: &Kubelet, claims: &[Claim], range: std::ops::Range<usize>) -> Result<()> {
    for i in range {
        let one = std::slice::from_ref(&claims[i % claims.len()]);
        kubelet.prepare(one).await?;
        kubelet.unprepare(one).await?;
    }
    Ok(())
}

/// Runs `total` prepare/unprepare cycles against the plugin behind `config`, reading the
/// RSS of `pid` (`None`: this process) when idle and after every tenth of the cycles.
async fn measure_cycles(
    config: &kerf_kubelet_plugin::config::PluginConfig,
    pid: Option<u32>,
    total: usize,
) -> Result<PluginMemory> {
    settle().await;
    let idle = sys::rss_bytes(pid)?;
    let kubelet = Kubelet::connect(config).await?;
    let claims = cycle_claims();
    let mut samples = Vec::new();
    let mut done = 0;
    for tenth in 1..=SAMPLES {
        let until = total * tenth / SAMPLES;
        cycles(&kubelet, &claims, done..until).await?;
        done = until;
        samples.push((done, sys::rss_bytes(pid)?));
    }
    Ok(PluginMemory { idle, samples })
}

/// Starts the plugin for the footprint under `root`, with the cycle claims.
async fn start_plugin(root: &Path) -> Result<BenchNode> {
    let node = BenchNode::start(root).await?;
    node.add_claims(SERIES_FOOTPRINT, CYCLE_CLAIMS)?;
    Ok(node)
}

async fn plugin_in_process(root: &Path, options: &BenchOptions) -> Result<PluginMemory> {
    let node = start_plugin(root).await?;
    let measured = measure_cycles(&node.config, None, options.footprint_cycles).await;
    node.stop().await?;
    measured
}

/// Lets start-up work (first checkpoint write, spec restore) finish before measuring.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// A child process speaking the line protocol: one request line on stdin, answers on stdout.
struct ChildProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl ChildProcess {
    fn spawn(reexec: &Reexec, name: &str, request: &str) -> Result<Self> {
        let mut child = Command::new(&reexec.program)
            .args(&reexec.args)
            .arg(name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| Error::io("spawn", &reexec.program, e))?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::Child("no pipes to the child".into()));
        };
        writeln!(stdin, "{request}").map_err(|e| Error::io("write to", &reexec.program, e))?;
        Ok(ChildProcess {
            child,
            stdin: Some(stdin),
            stdout: BufReader::new(stdout),
        })
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| Error::Child(format!("reading its output: {e}")))?;
        if line.is_empty() {
            return Err(Error::Child("it exited without answering".into()));
        }
        Ok(line.trim_end().to_owned())
    }

    /// Closes stdin (the child's signal to stop) and waits for a clean exit.
    fn finish(mut self) -> Result<()> {
        drop(self.stdin.take());
        let status = self
            .child
            .wait()
            .map_err(|e| Error::Child(format!("waiting for it: {e}")))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Child(format!("it exited with {status}")))
        }
    }
}

fn plugin_in_child(
    reexec: &Reexec,
    root: &Path,
    options: &BenchOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<PluginMemory> {
    let mut child = ChildProcess::spawn(reexec, PLUGIN_CHILD, &format!("root={}", root.display()))?;
    let ready = child.read_line()?;
    if ready != "ready" {
        return Err(Error::Child(format!("expected \"ready\", got {ready:?}")));
    }
    let pid = Some(child.child.id());
    let measured = runtime.block_on(measure_cycles(
        &plugin_config(root),
        pid,
        options.footprint_cycles,
    ));
    let finished = child.finish();
    let measured = measured?;
    finished?;
    Ok(measured)
}

fn index_in_child(reexec: &Reexec, options: &BenchOptions) -> Result<IndexMemory> {
    let request = format!(
        "nodes={} claims={} seed={}",
        options.nodes, options.footprint_claims, options.seed
    );
    let mut child = ChildProcess::spawn(reexec, INDEX_CHILD, &request)?;
    let answer = child.read_line()?;
    child.finish()?;
    let fields = parse_fields(&answer);
    let get = |key: &str| -> Result<u64> {
        fields
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::Child(format!("no {key} in {answer:?}")))
    };
    Ok(IndexMemory {
        before: get("before")?,
        nodes: get("nodes")?,
        after: get("after")?,
        claims: usize::try_from(get("claims")?).unwrap_or(usize::MAX),
    })
}

/// Builds the controller's index of `options.nodes` mock H100 nodes and allocates
/// `options.footprint_claims` claims of the seeded workload in it (skipping draws that do
/// not fit), measuring this process's RSS around it. The claims' requests are drawn one at a
/// time, so that only the index stays.
///
/// # Errors
/// The mock profile is missing.
pub(crate) fn index_memory(options: &BenchOptions) -> Result<IndexMemory> {
    let before = sys::rss_bytes(None)?;
    let (mut index, _) = workload::cluster(options.nodes, PROFILE)?;
    let nodes = sys::rss_bytes(None)?;
    let mut workload = Workload::new(options.seed, Mix::default());
    let mut claims = 0;
    let draws = options.footprint_claims.saturating_mul(DRAWS_PER_CLAIM);
    for n in 0..draws {
        if claims >= options.footprint_claims {
            break;
        }
        let pod = workload
            .next_shape()
            .pod(workload::claim_uid(n as u64), Policy::BinPack);
        if let Ok(placement) = place_where(&index, &pod, |_| true) {
            index.apply(&placement);
            claims += 1;
        }
    }
    let after = sys::rss_bytes(None)?;
    std::hint::black_box(&index);
    Ok(IndexMemory {
        before,
        nodes,
        after,
        claims,
    })
}

/// Runs the child side of [`PLUGIN_CHILD`]: reads `root=PATH`, serves the plugin there,
/// prints `ready`, and stops when stdin closes.
///
/// # Errors
/// The request is malformed or the plugin fails.
pub(crate) fn plugin_child(runtime: &tokio::runtime::Runtime) -> Result<()> {
    let request = read_request()?;
    let fields = parse_fields(&request);
    let root = fields
        .get("root")
        .map(PathBuf::from)
        .ok_or_else(|| Error::Child(format!("no root= in {request:?}")))?;
    runtime.block_on(async {
        let node = start_plugin(&root).await?;
        answer("ready")?;
        // The parent closes stdin when it is done measuring.
        tokio::task::spawn_blocking(|| {
            let mut rest = Vec::new();
            std::io::stdin().read_to_end(&mut rest)
        })
        .await
        .map_err(|e| Error::Child(format!("stdin reader failed: {e}")))?
        .map_err(|e| Error::io("read", "stdin", e))?;
        node.stop().await
    })
}

/// Runs the child side of [`INDEX_CHILD`]: reads `nodes=N claims=N seed=N`, builds the
/// index and prints `before=B nodes=B after=B claims=N` (bytes).
///
/// # Errors
/// The request is malformed.
pub(crate) fn index_child(options: &BenchOptions) -> Result<()> {
    let request = read_request()?;
    let fields = parse_fields(&request);
    let number = |key: &str| -> Result<u64> {
        fields
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::Child(format!("no number {key}= in {request:?}")))
    };
    let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
    let options = BenchOptions {
        nodes: to_usize(number("nodes")?),
        footprint_claims: to_usize(number("claims")?),
        seed: number("seed")?,
        ..options.clone()
    };
    let m = index_memory(&options)?;
    answer(&format!(
        "before={} nodes={} after={} claims={}",
        m.before, m.nodes, m.after, m.claims
    ))
}

fn read_request() -> Result<String> {
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| Error::io("read", "stdin", e))?;
    Ok(line.trim_end().to_owned())
}

fn answer(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::io("write", "stdout", e))
}

/// `key=value` fields separated by spaces; a value runs to the next ` key=` (so paths with
/// spaces survive when they are the last field).
pub(crate) fn parse_fields(line: &str) -> HashMap<String, String> {
    let mut fields = HashMap::new();
    let mut key: Option<&str> = None;
    let mut value = String::new();
    for word in line.split(' ') {
        match word.split_once('=') {
            Some((k, v))
                if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                if let Some(k) = key.take() {
                    fields.insert(k.to_owned(), std::mem::take(&mut value));
                }
                key = Some(k);
                value.push_str(v);
            }
            _ if key.is_some() => {
                value.push(' ');
                value.push_str(word);
            }
            _ => {}
        }
    }
    if let Some(k) = key {
        fields.insert(k.to_owned(), value);
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_parse_and_a_last_path_may_hold_spaces() {
        let f = parse_fields("nodes=10 claims=5 root=/a b/c");
        assert_eq!(f["nodes"], "10");
        assert_eq!(f["claims"], "5");
        assert_eq!(f["root"], "/a b/c");
        assert!(parse_fields("garbage").is_empty());
    }

    #[test]
    fn a_small_index_is_built_with_every_claim_placed() {
        let options = BenchOptions {
            nodes: 20,
            footprint_claims: 100,
            ..BenchOptions::default()
        };
        let m = index_memory(&options).unwrap();
        assert_eq!(m.claims, 100);
        assert!(m.before > 0 && m.after > 0);
    }
}
