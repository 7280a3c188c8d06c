//! The device health flip of `kerf demo`: what the kubelet sees on the plugin's health stream
//! when a prepared GPU reports a fault and then recovers.
//!
//! The demo's plugin runs in mock mode with a fault file under the output directory
//! ([`Layout::fault_file`], the plugin's `--mock-fault-file`), read in the format of
//! [`kerf_core::health::parse_fault_file`]. The kubelet stand-in opens
//! `v1alpha1.DRAResourceHealth/NodeWatchResources` once the plugin has registered, as the
//! kubelet does ([`RegisteredPlugin::watch_health`]). Once the claims are prepared, the demo
//! declares a non-fatal XID on a device a claim holds, waits (at most [`STEP_TIMEOUT`]) for the
//! stream to show the device Unhealthy with its message, removes the fault file and waits for
//! Healthy again. Whatever happens, the fault file is gone afterwards.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kerf_core::health::HealthStatus;
use kerf_kubelet_plugin::health::HealthConfig;
use kerf_proto::PreparedDevice;
use kerf_proto::client::{ClaimResult, HealthStream, RegisteredPlugin};
use kerf_proto::health::v1alpha1 as pb;
use serde::{Deserialize, Serialize};

use super::node::Layout;
use super::workload::Workload;
use crate::error::Error;

/// The XID the demo declares: 61, not one of [`kerf_core::health::FATAL_XIDS`], so the
/// device becomes Unhealthy (no new work) without being called in need of a reset.
pub const FAULT_XID: u64 = 61;

/// How long each step may take to show on the stream. The plugin re-reads the fault file
/// every [`FAULT_FILE_POLL`] and sends every change at once, so a step that takes this long
/// is lost, not slow.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the demo's plugin re-reads the fault file: often, so that the flip adds little to
/// the run (the plugin's default is every second).
pub const FAULT_FILE_POLL: Duration = Duration::from_millis(100);

/// The health settings of the demo's plugin: mock faults from [`Layout::fault_file`] only.
pub fn health_config(layout: &Layout) -> HealthConfig {
    HealthConfig {
        mock_fault_file: Some(layout.fault_file.clone()),
        mock_fault_file_poll: FAULT_FILE_POLL,
        // The demo has no Node object whose annotation could declare faults.
        mock_annotation: false,
        ..HealthConfig::defaults(true)
    }
}

/// What the kubelet saw of the flip.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthReport {
    /// The fault file the plugin watched.
    pub fault_file: PathBuf,
    /// The device flipped, by its published name; `None` when no claim was prepared.
    pub device: Option<String>,
    /// The claims holding it, `namespace/name`.
    pub claims: Vec<String>,
    /// What the stream showed for the device after each step, in order.
    pub observations: Vec<HealthObservation>,
    /// Why the flip stopped short: no device to flip, the stream could not be opened or
    /// broke, a step did not show within [`STEP_TIMEOUT`], or the fault file could not be
    /// written or removed.
    pub error: Option<String>,
}

/// The device's health as one message of the stream showed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthObservation {
    /// What the demo had done.
    pub step: Step,
    /// The device's status in the message.
    pub status: HealthStatus,
    /// The device's message (its faults in words; empty when healthy).
    pub message: String,
    /// Time from the step to the message, in milliseconds.
    pub millis: u64,
}

/// A step of the flip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Step {
    /// The kubelet opened the stream; the observation is its first list.
    Opened,
    /// The demo wrote XID [`FAULT_XID`] for the device to the fault file.
    FaultDeclared,
    /// The demo removed the fault file.
    FaultRemoved,
}

impl Step {
    /// The step in words, e.g. `XID 61 written to the fault file`.
    pub fn text(self) -> String {
        match self {
            Step::Opened => "stream opened".to_owned(),
            Step::FaultDeclared => format!("XID {FAULT_XID} written to the fault file"),
            Step::FaultRemoved => "fault file removed".to_owned(),
        }
    }
}

/// The device to flip: the first device of the first prepared claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The pool the stream names it in (kerf's pools are the node's name).
    pub pool: String,
    /// Its published name.
    pub device: String,
    /// Every prepared claim holding it, `namespace/name`.
    pub claims: Vec<String>,
}

/// The first device of the first prepared claim of `workload` (in manifest order), with
/// every prepared claim that holds it; `None` when no claim was prepared with a device.
pub fn target<S: BuildHasher>(
    workload: &Workload,
    prepared: &HashMap<String, ClaimResult, S>,
) -> Option<Target> {
    let claims: Vec<(String, &[PreparedDevice])> = workload
        .claims
        .iter()
        .filter_map(|c| match prepared.get(c.uid()) {
            Some(Ok(devices)) => Some((c.key(), devices.as_slice())),
            _ => None,
        })
        .collect();
    let first = claims.iter().find_map(|(_, devices)| devices.first())?;
    let holds = |devices: &[PreparedDevice]| {
        devices
            .iter()
            .any(|d| d.pool_name == first.pool_name && d.device_name == first.device_name)
    };
    Some(Target {
        pool: first.pool_name.clone(),
        device: first.device_name.clone(),
        claims: claims
            .iter()
            .filter(|(_, devices)| holds(devices))
            .map(|(name, _)| name.clone())
            .collect(),
    })
}

/// The kubelet's open health stream with the first list it received.
#[derive(Debug)]
pub struct Watcher {
    stream: HealthStream,
    first: pb::NodeWatchResourcesResponse,
    first_millis: u64,
}

impl Watcher {
    /// Opens the health stream and reads its first list, as the kubelet does once the
    /// plugin has registered.
    ///
    /// # Errors
    /// The plugin refuses the stream, ends it, or sends no list within [`STEP_TIMEOUT`]; the
    /// error in words, for the report.
    pub async fn open(kubelet: &RegisteredPlugin) -> Result<Self, String> {
        let start = Instant::now();
        let mut stream = kubelet.watch_health().await.map_err(|e| e.to_string())?;
        let first = tokio::time::timeout(STEP_TIMEOUT, stream.next())
            .await
            .map_err(|_| format!("the health stream sent no list within {STEP_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "the plugin ended the health stream at once".to_owned())?;
        Ok(Watcher {
            stream,
            first,
            first_millis: millis(start.elapsed()),
        })
    }

    /// Declares the fault, waits for Unhealthy, removes it and waits for Healthy; every
    /// observation goes to `seen` as it comes.
    async fn observe_flip(
        &mut self,
        target: &Target,
        fault_file: &Path,
        seen: &mut Vec<HealthObservation>,
    ) -> Result<(), String> {
        let (status, message) = device_health(&self.first, target).ok_or_else(|| {
            format!(
                "the stream's first list lacks device {} of pool {}",
                target.device, target.pool
            )
        })?;
        seen.push(HealthObservation {
            step: Step::Opened,
            status,
            message,
            millis: self.first_millis,
        });
        let start = Instant::now();
        write_fault_file(fault_file, &target.device)?;
        let unhealthy = self
            .wait_for(target, HealthStatus::Unhealthy, Step::FaultDeclared, start)
            .await?;
        seen.push(unhealthy);
        let start = Instant::now();
        remove_fault_file(fault_file)?;
        let healthy = self
            .wait_for(target, HealthStatus::Healthy, Step::FaultRemoved, start)
            .await?;
        seen.push(healthy);
        Ok(())
    }

    /// Reads lists until one shows the device `wanted`. Lists sent before the step (the
    /// stream buffers them while nobody reads) still show the old status and are skipped.
    async fn wait_for(
        &mut self,
        target: &Target,
        wanted: HealthStatus,
        step: Step,
        start: Instant,
    ) -> Result<HealthObservation, String> {
        let deadline = tokio::time::Instant::from_std(start + STEP_TIMEOUT);
        let mut last = None;
        loop {
            let Ok(next) = tokio::time::timeout_at(deadline, self.stream.next()).await else {
                let last = last.map_or_else(
                    || "no list since".to_owned(),
                    |status: HealthStatus| format!("last {status:?}"),
                );
                return Err(format!(
                    "{} was not {wanted:?} on the health stream within {STEP_TIMEOUT:?} of: {} \
                     ({last})",
                    target.device,
                    step.text()
                ));
            };
            let list = next
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "the plugin ended the health stream".to_owned())?;
            if let Some((status, message)) = device_health(&list, target) {
                if status == wanted {
                    return Ok(HealthObservation {
                        step,
                        status,
                        message,
                        millis: millis(start.elapsed()),
                    });
                }
                last = Some(status);
            }
        }
    }
}

/// Flips `target` unhealthy and back on the stream `watcher` opened (or reports why not),
/// and removes the fault file in any case.
pub async fn flip(
    watcher: Result<Watcher, String>,
    fault_file: &Path,
    target: Option<Target>,
) -> HealthReport {
    let mut report = HealthReport {
        fault_file: fault_file.to_owned(),
        device: target.as_ref().map(|t| t.device.clone()),
        claims: target
            .as_ref()
            .map(|t| t.claims.clone())
            .unwrap_or_default(),
        observations: Vec::new(),
        error: None,
    };
    let (mut watcher, target) = match (watcher, target) {
        (_, None) => {
            report.error = Some("no claim was prepared, so no device to flip".to_owned());
            return report;
        }
        (Err(e), _) => {
            report.error = Some(format!("health stream: {e}"));
            return report;
        }
        (Ok(watcher), Some(target)) => (watcher, target),
    };
    let flipped = watcher
        .observe_flip(&target, fault_file, &mut report.observations)
        .await;
    // Even after a failed step: the demo leaves no fault behind.
    let removed = remove_fault_file(fault_file);
    report.error = flipped.and(removed).err();
    report
}

/// The status and message of `target` in one list of the stream.
fn device_health(
    list: &pb::NodeWatchResourcesResponse,
    target: &Target,
) -> Option<(HealthStatus, String)> {
    let device = list.devices.iter().find(|d| {
        d.device
            .as_ref()
            .is_some_and(|id| id.pool_name == target.pool && id.device_name == target.device)
    })?;
    let status = match device.health() {
        pb::HealthStatus::Healthy => HealthStatus::Healthy,
        pb::HealthStatus::Unhealthy => HealthStatus::Unhealthy,
        pb::HealthStatus::Unknown => HealthStatus::Unknown,
    };
    Some((status, device.message.clone()))
}

/// The fault file declaring XID [`FAULT_XID`] on `device`.
pub fn fault_file_text(device: &str) -> String {
    // A JSON string is a YAML double-quoted scalar: any device name stays one key.
    let key = serde_json::Value::from(device);
    format!(
        "# kerf demo: a non-fatal XID on a prepared device\n{key}:\n  - kind: xid\n    code: {FAULT_XID}\n"
    )
}

/// Writes the fault file whole: written beside it and renamed, so the plugin never reads half
/// of it (it would log an error and keep the last state).
fn write_fault_file(path: &Path, device: &str) -> Result<(), String> {
    let partial = partial_path(path);
    std::fs::write(&partial, fault_file_text(device))
        .map_err(|e| Error::io("write", &partial, e).to_string())?;
    std::fs::rename(&partial, path).map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        Error::io("rename to the fault file", &partial, e).to_string()
    })
}

/// Removes the fault file (and a partial one); a missing one is fine.
///
/// # Errors
/// A file exists but cannot be removed; the error in words.
pub fn remove_fault_file(path: &Path) -> Result<(), String> {
    for file in [partial_path(path), path.to_owned()] {
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &file, e).to_string()),
        }
    }
    Ok(())
}

/// The fault file while it is being written: `<name>.partial` beside it.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

fn millis(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    use kerf_core::health::{Fault, parse_fault_file};

    use super::*;
    use crate::demo::workload::DemoClaim;

    fn prepared(device: &str) -> PreparedDevice {
        PreparedDevice {
            pool_name: "node".into(),
            device_name: device.into(),
            ..PreparedDevice::default()
        }
    }

    #[test]
    fn the_fault_file_declares_the_xid_on_the_device() {
        let inventory = kerf_core::mock::from_spec("h100-sxm-80gb:2").unwrap();
        let device = inventory.devices().nth(1).unwrap();
        let faults = parse_fault_file(&fault_file_text(&device.name()), &inventory).unwrap();
        assert_eq!(
            faults.get(&device.gpu().uuid),
            Some(&vec![Fault::Xid { code: FAULT_XID }])
        );
        assert_eq!(faults.len(), 1);
    }

    fn demo_claim(name: &str) -> DemoClaim {
        let mut claim = ResourceClaim::default();
        claim.metadata.uid = Some(format!("uid-{name}"));
        DemoClaim {
            namespace: "default".into(),
            name: name.into(),
            claim: Some(claim),
            manifest_error: None,
            origin: String::new(),
            template: None,
            pods: vec![],
        }
    }

    #[test]
    fn the_target_is_the_first_prepared_device_with_every_claim_holding_it() {
        let mut workload = Workload::default();
        let mut answers: HashMap<String, ClaimResult> = HashMap::new();
        for (name, answer) in [
            ("failed", Err("no".to_owned())),
            ("a", Ok(vec![prepared("gpu-3"), prepared("gpu-4")])),
            ("b", Ok(vec![prepared("gpu-5")])),
            ("c", Ok(vec![prepared("gpu-3")])),
        ] {
            let demo = demo_claim(name);
            answers.insert(demo.uid().to_owned(), answer);
            workload.claims.push(demo);
        }
        assert_eq!(
            target(&workload, &answers),
            Some(Target {
                pool: "node".into(),
                device: "gpu-3".into(),
                claims: vec!["default/a".into(), "default/c".into()],
            })
        );
        assert_eq!(target(&workload, &HashMap::new()), None);
    }

    #[test]
    fn a_list_gives_the_targets_status_and_message() {
        let target = Target {
            pool: "node".into(),
            device: "gpu-1".into(),
            claims: vec![],
        };
        let device =
            |pool: &str, name: &str, health: pb::HealthStatus, message: &str| pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: pool.into(),
                    device_name: name.into(),
                }),
                health: health.into(),
                message: message.into(),
                ..pb::DeviceHealth::default()
            };
        let list = pb::NodeWatchResourcesResponse {
            devices: vec![
                device("node", "gpu-0", pb::HealthStatus::Healthy, ""),
                device("other", "gpu-1", pb::HealthStatus::Healthy, ""),
                device("node", "gpu-1", pb::HealthStatus::Unhealthy, "XID 61"),
            ],
        };
        assert_eq!(
            device_health(&list, &target),
            Some((HealthStatus::Unhealthy, "XID 61".to_owned()))
        );
        let empty = pb::NodeWatchResourcesResponse::default();
        assert_eq!(device_health(&empty, &target), None);
    }

    #[test]
    fn the_fault_file_is_written_whole_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mock-faults.yaml");
        remove_fault_file(&path).unwrap();
        write_fault_file(&path, "gpu-0").unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            fault_file_text("gpu-0")
        );
        assert!(!partial_path(&path).exists());
        std::fs::write(partial_path(&path), "x").unwrap();
        remove_fault_file(&path).unwrap();
        assert!(!path.exists() && !partial_path(&path).exists());
    }
}
