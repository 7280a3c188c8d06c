//! The kubelet's side of one demo node ([`NodeVisit`]), and the checks that the node's
//! plugin left nothing behind once it stopped.

use std::collections::HashMap;
use std::path::PathBuf;

use kerf_core::cdi;
use kerf_kubelet_plugin::config::PluginConfig;
use kerf_kubelet_plugin::mps_daemons::{self, ProcessDaemons};
use kerf_kubelet_plugin::preparer::PreparerConfig;
use kerf_proto::client::{Claim, ClaimResult, KubeletClient, RegisteredPlugin};

use super::allocate::PodOutcome;
use super::containers::{self, ContainerRun};
use super::node::Layout;
use super::workload::Workload;
use super::{health, mig, mps};
use crate::error::{Error, Result};

/// What happened on the node.
#[derive(Debug, Default)]
pub(super) struct NodeRun {
    pub(super) prepared: HashMap<String, ClaimResult>,
    pub(super) specs: HashMap<String, (PathBuf, serde_json::Value)>,
    /// The PID of each MPS pipe directory's daemon while the claims were prepared.
    pub(super) mps_daemons: HashMap<PathBuf, Option<u32>>,
    pub(super) containers: HashMap<String, ContainerRun>,
    pub(super) containers_error: Option<String>,
    pub(super) container_runtime: Option<String>,
    pub(super) health: Option<health::HealthReport>,
    /// A dynamic-MIG node's emulated MIG instances while the claims were prepared.
    pub(super) mig_prepared: Vec<mig::LiveInstance>,
    /// Its instances once every claim was unprepared (none, when all went well).
    pub(super) mig_left: Option<Result<Vec<mig::LiveInstance>>>,
}

impl NodeRun {
    /// Adds another node's run (claim UIDs differ between nodes).
    pub(super) fn merge(&mut self, other: NodeRun) {
        self.prepared.extend(other.prepared);
        self.specs.extend(other.specs);
        self.mps_daemons.extend(other.mps_daemons);
        self.containers.extend(other.containers);
        self.mig_prepared.extend(other.mig_prepared);
    }
}

/// The kubelet's part of the run on one node.
pub(super) struct NodeVisit<'a> {
    pub(super) layout: &'a Layout,
    pub(super) driver: &'a str,
    /// The node: only the pods running on it are prepared here.
    pub(super) node: &'a str,
    pub(super) workload: &'a Workload,
    pub(super) pods: &'a [PodOutcome],
    /// Open the health stream and flip a prepared device (the main node only).
    pub(super) health: bool,
    /// The root of the node's emulated MIG state (a dynamic-MIG node), read while the
    /// claims are prepared and after they are unprepared.
    pub(super) mig_root: Option<PathBuf>,
}

impl NodeVisit<'_> {
    /// Registers, opens the health stream, prepares every runnable pod, snapshots the CDI
    /// specs, flips a prepared device's health, runs containers, and unprepares every pod
    /// again, even when something in between failed.
    pub(super) async fn run(
        &self,
        runtime: Option<Result<containers::Runtime>>,
    ) -> Result<NodeRun> {
        let kubelet = KubeletClient::new()
            .register(&self.layout.registration_socket)
            .await?;
        // As the kubelet: the health stream is opened as soon as the plugin has registered.
        let watcher = if self.health {
            Some(health::Watcher::open(&kubelet).await)
        } else {
            None
        };
        let mut run = NodeRun::default();
        let prepared = self.prepare_all(&kubelet, &mut run).await;
        self.snapshot_specs(&mut run);
        if let Some(root) = &self.mig_root {
            // Unreadable state shows as no instance; the report then has none to show.
            run.mig_prepared = mig::live_instances(root).unwrap_or_default();
        }
        if let Some(watcher) = watcher {
            let target = health::target(self.workload, &run.prepared);
            run.health = Some(health::flip(watcher, &self.layout.fault_file, target).await);
        }
        match runtime {
            None => {}
            Some(Ok(runtime)) => self.run_containers(&runtime, &mut run),
            Some(Err(e)) => run.containers_error = Some(e.to_string()),
        }
        let unprepared = self.unprepare_all(&kubelet).await;
        run.mig_left = self.mig_root.as_deref().map(mig::live_instances);
        prepared?;
        unprepared?;
        Ok(run)
    }

    /// The pods that can run, with their claims as the kubelet names them.
    fn runnable_pods(&self) -> Vec<Vec<Claim>> {
        self.workload
            .pods
            .iter()
            .zip(self.pods)
            .filter(|(_, outcome)| outcome.runs_on(self.node))
            .map(|(pod, _)| {
                pod.claims
                    .iter()
                    .filter_map(|c| c.claim.as_ref().ok())
                    .map(|&i| {
                        let claim = &self.workload.claims[i];
                        Claim::new(&claim.namespace, &claim.name, claim.uid())
                    })
                    .collect()
            })
            .collect()
    }

    async fn prepare_all(&self, kubelet: &RegisteredPlugin, run: &mut NodeRun) -> Result<()> {
        for claims in self.runnable_pods() {
            if claims.is_empty() {
                continue;
            }
            let answers = kubelet.prepare(&claims).await?;
            for (uid, answer) in answers {
                // A claim shared by pods keeps its first answer (later ones repeat it).
                run.prepared.entry(uid).or_insert(answer);
            }
        }
        Ok(())
    }

    fn snapshot_specs(&self, run: &mut NodeRun) {
        let kind = PreparerConfig::cdi_kind_for(self.driver);
        for (uid, answer) in &run.prepared {
            if answer.is_err() {
                continue;
            }
            let Ok(file_name) = cdi::transient_spec_file_name(&kind, uid) else {
                continue;
            };
            let path = self.layout.cdi_dir.join(file_name);
            let spec = std::fs::read(&path)
                .ok()
                .and_then(|bytes| serde_json::from_slice(&bytes).ok());
            if let Some(spec) = spec {
                // Read now: the daemon and its PID file go with the GPU's last unprepare.
                for pipe in mps::pipe_mounts(&spec) {
                    let pid = mps_daemons::daemon_in(&pipe.host).map(|d| d.pid);
                    run.mps_daemons.entry(pipe.host).or_insert(pid);
                }
                run.specs.insert(uid.clone(), (path, spec));
            }
        }
    }

    fn run_containers(&self, runtime: &containers::Runtime, run: &mut NodeRun) {
        run.container_runtime = Some(runtime.version.clone());
        let rootfs = match containers::make_rootfs(runtime, &self.layout.root) {
            Ok(rootfs) => rootfs,
            Err(e) => {
                run.containers_error = Some(e.to_string());
                return;
            }
        };
        let empty = self.layout.root.join("empty");
        if let Err(e) = std::fs::create_dir_all(&empty) {
            run.containers_error = Some(Error::io("create directory", &empty, e).to_string());
            return;
        }
        for claim in &self.workload.claims {
            let Some(Ok(devices)) = run.prepared.get(claim.uid()) else {
                continue;
            };
            let mut ids: Vec<String> = Vec::new();
            for id in devices.iter().flat_map(|d| &d.cdi_device_ids) {
                if !ids.contains(id) {
                    ids.push(id.clone());
                }
            }
            match containers::run(runtime, &self.layout.cdi_dir, &empty, &rootfs, &ids) {
                Ok(container) => {
                    run.containers.insert(claim.uid().to_owned(), container);
                }
                Err(e) => {
                    run.containers_error = Some(e.to_string());
                    return;
                }
            }
        }
    }

    /// One `NodeUnprepareResources` per pod, last pod first; a claim shared with a pod not
    /// yet torn down stays prepared until that pod goes, as in the kubelet.
    async fn unprepare_all(&self, kubelet: &RegisteredPlugin) -> Result<()> {
        let mut pods = self.runnable_pods();
        let mut failures = Vec::new();
        while let Some(claims) = pods.pop() {
            let still_used = |c: &Claim| pods.iter().flatten().any(|o| o.uid == c.uid);
            let batch: Vec<Claim> = claims.into_iter().filter(|c| !still_used(c)).collect();
            if batch.is_empty() {
                continue;
            }
            match kubelet.unprepare(&batch).await {
                Ok(answers) => failures.extend(
                    answers
                        .into_iter()
                        .filter_map(|(uid, r)| r.err().map(|e| format!("claim {uid}: {e}"))),
                ),
                Err(e) => failures.push(e.to_string()),
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::Unprepare(failures.join("; ")))
        }
    }
}

/// Stops every MPS daemon still running under the demo's MPS root once the plugin has
/// stopped. The plugin stops a GPU's daemon at the GPU's last unprepare and keeps running
/// ones across its own restarts (on a node they outlive the plugin on purpose), so after the
/// demo unprepared every claim none should be left; one that is, is stopped here (the
/// daemons run in their own process groups, so nothing else would end them) and reported
/// as an error.
pub(super) async fn stop_leftover_daemons(config: &PluginConfig) -> Result<()> {
    let Some(settings) = config.mps_settings() else {
        return Ok(());
    };
    let daemons = ProcessDaemons::new(settings);
    let mut left = Vec::new();
    for gpu in daemons.known_gpus() {
        let dirs = daemons.directories(&gpu)?;
        let Some(daemon) = daemons.running(&dirs) else {
            continue;
        };
        let stopped = match daemons.stop(&gpu).await {
            Ok(()) => "stopped".to_owned(),
            Err(e) => format!("cannot stop it: {e}"),
        };
        left.push(format!("GPU {gpu}: daemon {} ({stopped})", daemon.pid));
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "MPS daemons still ran after every claim was unprepared: {}",
            left.join("; ")
        )))
    }
}

/// Fails when the plugin left a socket or one of this driver's CDI specs behind, or the
/// demo its fault file.
pub(super) fn check_clean(layout: &Layout, driver: &str) -> Result<()> {
    let sockets = layout.leftover_sockets();
    if !sockets.is_empty() {
        return Err(Error::Config(format!(
            "the plugin left sockets behind after shutdown: {sockets:?}"
        )));
    }
    if std::fs::symlink_metadata(&layout.fault_file).is_ok() {
        return Err(Error::Config(format!(
            "the mock fault file was left behind: {}",
            layout.fault_file.display()
        )));
    }
    let kind = PreparerConfig::cdi_kind_for(driver);
    let (vendor, class) = cdi::parse_kind(&kind)?;
    let prefix = format!("{vendor}-{class}_");
    let specs: Vec<PathBuf> = std::fs::read_dir(&layout.cdi_dir)
        .map_err(|e| Error::io("read directory", &layout.cdi_dir, e))?
        .filter_map(std::result::Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    if !specs.is_empty() {
        return Err(Error::Config(format!(
            "CDI specs left behind after unprepare: {specs:?}"
        )));
    }
    Ok(())
}
