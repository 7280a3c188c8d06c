//! `prepare-cluster`: prepare and unprepare on a real cluster, kerf beside another DRA driver
//! (kubernetes-sigs/dra-example-driver, built from source), one claim per call as the
//! kubelet makes them, over each plugin's own socket on the node this runs on.
//!
//! Every driver named by `--cluster-driver DRIVER=CLASS=DEVICE[+DEVICE...]` gets its own
//! claims in one namespace, each requesting one of the devices of class `CLASS` on
//! `--cluster-node`, and the drivers take turns claim by claim, so that whatever else the node
//! and the API server do at a moment falls on all of them alike. No two claims hold a device
//! at once, as on a real node (a device in two allocations is something kerf-controller
//! reports, pair by pair). Two series:
//!
//! - **allocated before**: in rounds of as many claims as the driver has devices, every
//!   claim's allocation is written (as kube-scheduler writes it: one status patch, no
//!   reservation) and left to settle for [`SETTLE`] — long enough for kerf-controller's node
//!   label and kerf's node-scoped claim watch — then each claim is prepared, held, and
//!   unprepared, both calls timed, and deleted;
//! - **right after the allocation**: the allocation is written and the prepare called as soon
//!   as the write returned, as a kubelet that starts a pod just bound does; the prepare is
//!   timed, then the claim is held, unprepared and deleted.
//!
//! The hold (`--cluster-hold-ms`) stands in for the pod: a kubelet unprepares a claim only
//! after the pod that used it has run and stopped (`Kubelet.SyncTerminatingPod` in
//! `pkg/kubelet/kubelet.go`, once all its containers have stopped), so a plugin's follow-up work of the prepare
//! (kerf's write of the claim's device status) is not what the unprepare competes with on a
//! node. Zero unprepares at once, which measures the unprepare beside that work.
//!
//! The plugins are reached as the kubelet reaches them: the newest registration socket of
//! each driver under `--cluster-registry-dir`, its `GetInfo` endpoint, the newest DRA API
//! version both know. The claims are deleted at the end, and before the run when a previous
//! one left them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_proto::client::{Claim, KubeletClient, RegisteredPlugin};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::stats::{Samples, ms, ratio};
use crate::summary::Summary;
use crate::{BenchOptions, Error, Result};

/// How long the claims of a round of the first series rest between their allocation and
/// their prepares.
const SETTLE: Duration = Duration::from_secs(3);
/// Prepares and unprepares per driver before measuring.
const WARMUP: usize = 10;
/// Labels every claim of the run, so that a later run finds and deletes leftovers.
const RUN_LABEL: &str = "kerf.dev/bench";

/// One driver under test, as `--cluster-driver DRIVER=CLASS=DEVICE[+DEVICE...]` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterDriver {
    /// The DRA driver name, e.g. `gpu.kerf.dev`.
    pub name: String,
    /// The DeviceClass its claims request.
    pub class: String,
    /// The devices of the node's pool the claims are allocated, in turn.
    pub devices: Vec<String>,
}

impl ClusterDriver {
    /// Parses `DRIVER=CLASS=DEVICE[+DEVICE...]`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] naming the value when it has not three non-empty parts, or
    /// an empty device name.
    pub fn parse(value: &str) -> Result<Self> {
        let parts: Vec<&str> = value.split('=').collect();
        match parts.as_slice() {
            [name, class, devices]
                if !name.is_empty()
                    && !class.is_empty()
                    && devices.split('+').all(|d| !d.is_empty()) =>
            {
                Ok(ClusterDriver {
                    name: (*name).to_owned(),
                    class: (*class).to_owned(),
                    devices: devices.split('+').map(str::to_owned).collect(),
                })
            }
            _ => Err(Error::InvalidOption {
                option: "cluster_drivers",
                reason: format!("{value:?} is not DRIVER=CLASS=DEVICE[+DEVICE...]"),
            }),
        }
    }

    /// The device claim `i` of a series is allocated.
    fn device(&self, i: usize) -> &str {
        &self.devices[i % self.devices.len()]
    }
}

/// A driver with its plugin reached and its timings.
struct Subject {
    driver: ClusterDriver,
    plugin: RegisteredPlugin,
    before: Vec<Duration>,
    unprepare: Vec<Duration>,
    after_allocation: Vec<Duration>,
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// No node or driver was named, a plugin cannot be reached, or an API call or a prepare
/// fails.
pub(crate) async fn prepare_cluster(options: &BenchOptions) -> Result<Summary> {
    let node = options
        .cluster_node
        .clone()
        .ok_or_else(|| Error::InvalidOption {
            option: "cluster_node",
            reason: "prepare-cluster needs the node this runs on (--cluster-node)".into(),
        })?;
    if options.cluster_drivers.is_empty() {
        return Err(Error::InvalidOption {
            option: "cluster_drivers",
            reason: "prepare-cluster needs at least one --cluster-driver DRIVER=CLASS=DEVICE"
                .into(),
        });
    }
    let client = kube::Client::try_default()
        .await
        .map_err(|e| Error::Workload(format!("kube client from the kubeconfig: {e}")))?;
    let claims = ClaimWriter::new(client, &options.cluster_namespace, &node).await?;
    let mut subjects = Vec::new();
    for driver in &options.cluster_drivers {
        let plugin = reach(&options.cluster_registry_dir, &driver.name).await?;
        subjects.push(Subject {
            driver: driver.clone(),
            plugin,
            before: Vec::new(),
            unprepare: Vec::new(),
            after_allocation: Vec::new(),
        });
    }
    claims.delete_all().await?;
    let n = options.cluster_claims;
    let hold = options.cluster_hold;
    allocated_before(&claims, &mut subjects, n, hold).await?;
    right_after_allocation(&claims, &mut subjects, n, hold).await?;
    claims.delete_all().await?;
    Ok(summary(&node, n, hold, &subjects))
}

/// The series on claims allocated [`SETTLE`] before, in rounds of as many claims as the
/// driver with the fewest devices has.
async fn allocated_before(
    claims: &ClaimWriter,
    subjects: &mut [Subject],
    n: usize,
    hold: Duration,
) -> Result<()> {
    let round = subjects
        .iter()
        .map(|s| s.driver.devices.len())
        .min()
        .unwrap_or(1);
    let total = WARMUP + n;
    for start in (0..total).step_by(round) {
        let end = (start + round).min(total);
        for i in start..end {
            for s in subjects.iter() {
                let name = claim_name(&s.driver, "before", i);
                claims.create(&name, &s.driver).await?;
                claims.allocate(&name, &s.driver, i).await?;
            }
        }
        tokio::time::sleep(SETTLE).await;
        for i in start..end {
            for s in subjects.iter_mut() {
                let name = claim_name(&s.driver, "before", i);
                let claim = claims.get(&name).await?;
                let prepared = timed_prepare(&s.plugin, &claim).await?;
                tokio::time::sleep(hold).await;
                let unprepared = timed_unprepare(&s.plugin, &claim).await?;
                claims.delete(&name).await?;
                if i >= WARMUP {
                    s.before.push(prepared);
                    s.unprepare.push(unprepared);
                }
            }
        }
    }
    Ok(())
}

/// The series whose prepare follows its allocation's write at once.
async fn right_after_allocation(
    claims: &ClaimWriter,
    subjects: &mut [Subject],
    n: usize,
    hold: Duration,
) -> Result<()> {
    for i in 0..WARMUP + n {
        for s in subjects.iter() {
            claims
                .create(&claim_name(&s.driver, "after", i), &s.driver)
                .await?;
        }
    }
    for i in 0..WARMUP + n {
        for s in subjects.iter_mut() {
            let name = claim_name(&s.driver, "after", i);
            let claim = claims.allocate(&name, &s.driver, i).await?;
            let prepared = timed_prepare(&s.plugin, &claim).await?;
            tokio::time::sleep(hold).await;
            timed_unprepare(&s.plugin, &claim).await?;
            claims.delete(&name).await?;
            if i >= WARMUP {
                s.after_allocation.push(prepared);
            }
        }
    }
    Ok(())
}

fn claim_name(driver: &ClusterDriver, series: &str, i: usize) -> String {
    let short: String = driver
        .name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    format!("{short}-{series}-{i}")
}

/// The newest registration socket of `driver` (a rolling update leaves the old pod's until
/// it is gone), registered with as the kubelet does.
async fn reach(registry: &Path, driver: &str) -> Result<RegisteredPlugin> {
    let socket = newest_registration_socket(registry, driver)?;
    Ok(KubeletClient::new().register(&socket).await?)
}

fn newest_registration_socket(registry: &Path, driver: &str) -> Result<PathBuf> {
    let entries = std::fs::read_dir(registry).map_err(|e| Error::io("read", registry, e))?;
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(std::result::Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix(driver)
                .is_some_and(|rest| rest.starts_with('-') && rest.ends_with("reg.sock"))
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    found.sort();
    found.pop().map(|(_, path)| path).ok_or_else(|| {
        Error::Workload(format!(
            "no registration socket of {driver} in {}",
            registry.display()
        ))
    })
}

async fn timed_prepare(plugin: &RegisteredPlugin, claim: &Claim) -> Result<Duration> {
    let started = Instant::now();
    let mut answers = plugin.prepare(std::slice::from_ref(claim)).await?;
    let elapsed = started.elapsed();
    match answers.remove(&claim.uid) {
        Some(Ok(_)) => Ok(elapsed),
        Some(Err(e)) => Err(Error::Workload(format!("prepare of {}: {e}", claim.name))),
        None => Err(Error::Workload(format!("no answer for {}", claim.name))),
    }
}

async fn timed_unprepare(plugin: &RegisteredPlugin, claim: &Claim) -> Result<Duration> {
    let started = Instant::now();
    let mut answers = plugin.unprepare(std::slice::from_ref(claim)).await?;
    let elapsed = started.elapsed();
    match answers.remove(&claim.uid) {
        Some(Ok(())) => Ok(elapsed),
        Some(Err(e)) => Err(Error::Workload(format!("unprepare of {}: {e}", claim.name))),
        None => Err(Error::Workload(format!("no answer for {}", claim.name))),
    }
}

/// Creates, allocates and deletes the run's claims.
struct ClaimWriter {
    api: Api<ResourceClaim>,
    namespace: String,
    node: String,
}

impl ClaimWriter {
    async fn new(client: kube::Client, namespace: &str, node: &str) -> Result<Self> {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let object =
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
        let ns: Namespace = serde_json::from_value(object)
            .map_err(|e| Error::Workload(format!("namespace object: {e}")))?;
        match namespaces.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => return Err(api_error("create namespace", namespace, &e)),
        }
        Ok(ClaimWriter {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            node: node.to_owned(),
        })
    }

    async fn create(&self, name: &str, driver: &ClusterDriver) -> Result<()> {
        let object = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {RUN_LABEL: "prepare-cluster"}},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver.class}}]}},
        });
        let claim: ResourceClaim = serde_json::from_value(object)
            .map_err(|e| Error::Workload(format!("claim object: {e}")))?;
        self.api
            .create(&PostParams::default(), &claim)
            .await
            .map_err(|e| api_error("create claim", name, &e))?;
        Ok(())
    }

    /// Writes the claim's allocation as kube-scheduler does (one status write) and returns
    /// the claim as the kubelet names it.
    async fn allocate(&self, name: &str, driver: &ClusterDriver, i: usize) -> Result<Claim> {
        let patch = json!({"status": {"allocation": self.allocation(driver, driver.device(i))}});
        let written = self
            .api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| api_error("allocate claim", name, &e))?;
        self.as_kubelet_names(&written, name)
    }

    async fn get(&self, name: &str) -> Result<Claim> {
        let claim = self
            .api
            .get(name)
            .await
            .map_err(|e| api_error("get claim", name, &e))?;
        self.as_kubelet_names(&claim, name)
    }

    fn as_kubelet_names(&self, claim: &ResourceClaim, name: &str) -> Result<Claim> {
        let uid = claim
            .metadata
            .uid
            .as_deref()
            .ok_or_else(|| Error::Workload(format!("claim {name} has no UID")))?;
        Ok(Claim::new(&self.namespace, name, uid))
    }

    fn allocation(&self, driver: &ClusterDriver, device: &str) -> Value {
        json!({
            "devices": {"results": [{
                "request": "gpu", "driver": driver.name, "pool": self.node, "device": device,
            }]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                "key": "metadata.name", "operator": "In", "values": [self.node],
            }]}]},
        })
    }

    async fn delete(&self, name: &str) -> Result<()> {
        self.api
            .delete(name, &DeleteParams::default())
            .await
            .map_err(|e| api_error("delete claim", name, &e))?;
        Ok(())
    }

    async fn delete_all(&self) -> Result<()> {
        let selector = ListParams::default().labels(RUN_LABEL);
        self.api
            .delete_collection(&DeleteParams::default(), &selector)
            .await
            .map_err(|e| api_error("delete claims", &self.namespace, &e))?;
        Ok(())
    }
}

fn api_error(what: &str, name: &str, e: &kube::Error) -> Error {
    Error::Workload(format!("{what} {name}: {e}"))
}

fn summary(node: &str, n: usize, hold: Duration, subjects: &[Subject]) -> Summary {
    let mut summary = Summary::new("prepare-cluster");
    summary
        .figure("node", node)
        .figure("claims", n)
        .figure("hold_ms", hold.as_millis());
    // The ratios read as "kerf / the other driver" when kerf is named first.
    let base = subjects.first();
    for s in subjects {
        let key = s.driver.name.replace('.', "_");
        let series = [
            ("before", &s.before, base.map(|b| &b.before)),
            (
                "after_allocation",
                &s.after_allocation,
                base.map(|b| &b.after_allocation),
            ),
            ("unprepare", &s.unprepare, base.map(|b| &b.unprepare)),
        ];
        let mut line = format!("{:<18}", s.driver.name);
        for (name, samples, first) in series {
            let samples = Samples::new(samples.clone());
            summary
                .figure(&format!("{key}_{name}_p50_ms"), ms(samples.p50()))
                .figure(&format!("{key}_{name}_p99_ms"), ms(samples.p99()));
            let _ = write!(line, "  {name} {}", samples.p50_p99_ms());
            if let Some(first) = first.filter(|_| !std::ptr::eq(s, base.unwrap_or(s))) {
                let first = Samples::new(first.clone());
                let (p50, p99) = (
                    ratio(first.p50(), samples.p50()),
                    ratio(first.p99(), samples.p99()),
                );
                let _ = write!(line, " (first driver / this: p50 {p50}x, p99 {p99}x)");
                summary
                    .figure(&format!("first_over_{key}_{name}_p50"), &p50)
                    .figure(&format!("first_over_{key}_{name}_p99"), &p99);
            }
        }
        summary.detail(line);
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_is_three_non_empty_parts() {
        assert_eq!(
            ClusterDriver::parse("gpu.kerf.dev=gpu.kerf.dev=gpu-0+gpu-1").unwrap(),
            ClusterDriver {
                name: "gpu.kerf.dev".into(),
                class: "gpu.kerf.dev".into(),
                devices: vec!["gpu-0".into(), "gpu-1".into()],
            }
        );
        for bad in ["gpu.kerf.dev", "a=b", "a==c", "a=b=c=d", "a=b=c+", "=b=c"] {
            let err = ClusterDriver::parse(bad).unwrap_err().to_string();
            assert!(err.contains(bad), "{err}");
        }
    }

    #[test]
    fn the_newest_registration_socket_of_the_driver_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "gpu.kerf.dev-old-reg.sock",
            "gpu.example.com-abc-reg.sock",
            "gpu.kerf.devx-reg.sock",
        ] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.path().join("gpu.kerf.dev-new-reg.sock"), "").unwrap();
        let found = newest_registration_socket(dir.path(), "gpu.kerf.dev").unwrap();
        assert_eq!(found, dir.path().join("gpu.kerf.dev-new-reg.sock"));
        let err = newest_registration_socket(dir.path(), "other.dev").unwrap_err();
        assert!(err.to_string().contains("other.dev"), "{err}");
    }
}
