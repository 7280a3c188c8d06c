//! What the demo did, as `summary.json` and as the table it prints.

use std::fmt::Write as _;
use std::path::PathBuf;

use k8s_openapi::api::resource::v1::Device;
use kerf_api::quantity::format_bytes;
use kerf_api::resourceslice::{TYPE_MIG, attributes, device_attribute};
use serde::{Deserialize, Serialize};

use super::allocate::AllocatedBy;
use super::classes::ClassReport;
use super::containers::ContainerRun;
use super::health::HealthReport;
use super::mig::{LiveInstance, MigNodeReport};
use super::shareable::{ShareableNodeReport, shareable_text};

/// Everything `<output-dir>/summary.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// The node's name.
    pub node: String,
    /// The DRA driver name.
    pub driver: String,
    /// The inventory source, e.g. `mock profile h100-sxm-80gb`.
    pub inventory: String,
    /// The node's devices as published, e.g. `gpu-0 (NVIDIA H100 80GB HBM3, 80Gi)`.
    pub devices: Vec<String>,
    /// The output directory.
    pub output_dir: PathBuf,
    /// The classes and what became of them.
    pub classes: Vec<ClassReport>,
    /// Every claim, allocated or not.
    pub claims: Vec<ClaimReport>,
    /// Every pod and whether it could run.
    pub pods: Vec<PodReport>,
    /// Manifests the API server would refuse, other than claims (which are in `claims`).
    pub invalid_manifests: Vec<String>,
    /// Objects of kinds the demo does not model.
    pub ignored: Vec<String>,
    /// Why containers were not run although asked for.
    pub containers_error: Option<String>,
    /// The podman version used, when containers ran.
    pub container_runtime: Option<String>,
    /// The mock driver root whose fake `nvidia-cuda-mps-control` ran the MPS daemons;
    /// `None` when slices were accounting only.
    #[serde(default)]
    pub gpu_tools_root: Option<PathBuf>,
    /// What the kubelet saw on the plugin's health stream when the demo flipped a prepared
    /// device unhealthy and back; `None` when the node was not visited.
    #[serde(default)]
    pub device_health: Option<HealthReport>,
    /// The dynamic-MIG node, when the run had one.
    #[serde(default)]
    pub mig_node: Option<MigNodeReport>,
    /// The node of shareable GPUs, when the run had one.
    #[serde(default)]
    pub shareable_node: Option<ShareableNodeReport>,
    /// GPUs a sliced Scheduler class selects that are published whole, on any node, as
    /// `node/device: why`.
    #[serde(default)]
    pub published_whole: Vec<String>,
}

/// One claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimReport {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID, when the claim was created.
    pub uid: Option<String>,
    /// Where its manifest was read.
    pub origin: String,
    /// The ResourceClaimTemplate it was generated from.
    pub template: Option<String>,
    /// DeviceClasses of its requests.
    pub classes: Vec<String>,
    /// Pods that use it, `namespace/name`.
    pub pods: Vec<String>,
    /// Who allocated it.
    pub allocated_by: Option<AllocatedBy>,
    /// The node it is allocated on.
    pub node: Option<String>,
    /// Its devices: allocated, with CDI IDs once prepared.
    pub devices: Vec<DeviceReport>,
    /// Whether `NodePrepareResources` succeeded for it.
    pub prepared: bool,
    /// Why it is not allocated or not prepared.
    pub error: Option<String>,
    /// Its CDI spec file while it was prepared.
    pub cdi_spec_file: Option<PathBuf>,
    /// The content of that spec (the file is removed when the claim is unprepared).
    pub cdi_spec: Option<serde_json::Value>,
    /// The container run with its CDI devices.
    pub container: Option<ContainerRun>,
}

/// One allocated device of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceReport {
    /// The request it serves.
    pub request: String,
    /// Device name in the pool.
    pub device: String,
    /// `gpu` or `mig`.
    pub device_type: String,
    /// The MIG profile of a MIG device.
    pub mig_profile: Option<String>,
    /// The share ID kube-scheduler wrote for a share of a shareable GPU (a scheduler slice).
    #[serde(default)]
    pub share_id: Option<String>,
    /// Memory of a slice, in bytes; `None` for the whole device.
    pub memory_bytes: Option<u64>,
    /// Compute percent of a slice; `None` for the whole device.
    pub compute_percent: Option<u8>,
    /// Sharing strategy.
    pub sharing: String,
    /// CDI device IDs returned by `NodePrepareResources`.
    pub cdi_device_ids: Vec<String>,
    /// The MPS daemon of an MPS slice, as its CDI spec names it.
    #[serde(default)]
    pub mps: Option<MpsReport>,
    /// The MIG instance the plugin created for a dynamic-MIG placement, as the emulated
    /// driver state showed it while the claim was prepared.
    #[serde(default)]
    pub mig_instance: Option<LiveInstance>,
}

/// The MPS daemon a slice is a client of, as seen while its claim was prepared (the
/// directories go when the GPU's last slice is unprepared).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsReport {
    /// The GPU's daemon pipe directory on the node, `<mps-root>/<gpu-uuid>/pipe`.
    pub pipe_directory: PathBuf,
    /// Where the container sees it: its `CUDA_MPS_PIPE_DIRECTORY`.
    pub container_pipe_directory: String,
    /// The daemon's PID from its PID file; `None` when no live daemon was found.
    pub daemon_pid: Option<u32>,
}

impl MpsReport {
    /// `MPS daemon pid 42: pipe directory /x/mps/GPU-…/pipe, mounted at /run/kerf/mps/GPU-…`.
    pub fn text(&self) -> String {
        let daemon = self
            .daemon_pid
            .map_or_else(|| "not running".to_owned(), |pid| format!("pid {pid}"));
        format!(
            "MPS daemon {daemon}: pipe directory {}, mounted at {}",
            self.pipe_directory.display(),
            self.container_pipe_directory
        )
    }
}

impl DeviceReport {
    /// The slice as the table shows it: `10Gi / 25%`, `whole GPU`, `MIG 1g.10gb`.
    pub fn slice_text(&self) -> String {
        if let Some(profile) = &self.mig_profile {
            return format!("MIG {profile}");
        }
        match (self.memory_bytes, self.compute_percent) {
            (None, None) => "whole GPU".to_owned(),
            (memory, compute) => format!(
                "{} / {}",
                memory.map_or_else(|| "all".to_owned(), format_bytes),
                compute.map_or_else(|| "100%".to_owned(), |c| format!("{c}%"))
            ),
        }
    }
}

/// One pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodReport {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `Deployment/<name>` for a Deployment's replica.
    pub owner: Option<String>,
    /// Its claims' names (`?name` for one that does not exist).
    pub claims: Vec<String>,
    /// Whether all its claims were allocated, so that it could run.
    pub scheduled: bool,
    /// The node it runs on.
    #[serde(default)]
    pub node: Option<String>,
    /// Why it could not.
    pub error: Option<String>,
}

impl Summary {
    /// The claim `namespace/name`.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<&ClaimReport> {
        self.claims
            .iter()
            .find(|c| c.namespace == namespace && c.name == name)
    }
}

/// `gpu-0 (NVIDIA H100 80GB HBM3, 80Gi)` per published device, a shareable one with its
/// slicing (`, shareable: memory in 1Gi steps, …`).
pub fn describe_devices(devices: &[Device], driver: &str) -> Vec<String> {
    devices
        .iter()
        .map(|device| {
            let string = |name: &str| {
                device_attribute(device, driver, name)
                    .and_then(|a| a.string.clone())
                    .unwrap_or_default()
            };
            let memory = kerf_api::resourceslice::device_memory_bytes(device, driver)
                .map(format_bytes)
                .unwrap_or_default();
            let mut text = format!(
                "{} ({}, {memory}",
                device.name,
                string(attributes::PRODUCT_NAME)
            );
            if string(attributes::TYPE) == TYPE_MIG {
                let _ = write!(text, ", MIG {}", string(attributes::PROFILE));
            }
            let domain = string(attributes::NVLINK_DOMAIN);
            if !domain.is_empty() {
                let _ = write!(text, ", NVLink {domain}");
            }
            text.push_str(&shareable_text(device));
            text.push(')');
            text
        })
        .collect()
}

const HEADERS: [&str; 7] = [
    "CLAIM",
    "CLASS",
    "ALLOCATOR",
    "NODE",
    "DEVICE",
    "SLICE",
    "CDI DEVICE ID",
];

/// The claims table: one line per device (claim columns blank on a claim's further
/// devices), `-` for an unallocated claim, the MPS daemon under each MPS slice, and the
/// reason under any claim that is not allocated or not prepared.
pub fn render_table(summary: &Summary) -> String {
    let mut rows: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    for claim in &summary.claims {
        let claim_cells = vec![
            format!("{}/{}", claim.namespace, claim.name),
            if claim.classes.is_empty() {
                "-".to_owned()
            } else {
                claim.classes.join(",")
            },
            claim
                .allocated_by
                .map_or_else(|| "-".to_owned(), |a| a.as_str().to_owned()),
            claim.node.clone().unwrap_or_else(|| "-".to_owned()),
        ];
        if claim.devices.is_empty() {
            let mut cells = claim_cells;
            cells.extend(["-".to_owned(), "-".to_owned(), "-".to_owned()]);
            rows.push((cells, claim.error.iter().cloned().collect()));
            continue;
        }
        for (i, device) in claim.devices.iter().enumerate() {
            let mut cells = if i == 0 {
                claim_cells.clone()
            } else {
                vec![String::new(); claim_cells.len()]
            };
            cells.push(device.device.clone());
            cells.push(device.slice_text());
            cells.push(if device.cdi_device_ids.is_empty() {
                "-".to_owned()
            } else {
                device.cdi_device_ids.join(" ")
            });
            let mut notes: Vec<String> = device
                .share_id
                .iter()
                .map(|id| format!("share {id} of the shareable GPU (kube-scheduler's shareID)"))
                .collect();
            notes.extend(device.mps.iter().map(MpsReport::text));
            notes.extend(
                device
                    .mig_instance
                    .iter()
                    .map(|i| format!("MIG instance created at prepare: {}", i.text())),
            );
            if i + 1 == claim.devices.len() {
                notes.extend(claim.error.iter().cloned());
            }
            rows.push((cells, notes));
        }
    }
    let mut widths: Vec<usize> = HEADERS.iter().map(|h| h.len()).collect();
    for (cells, _) in &rows {
        for (w, cell) in widths.iter_mut().zip(cells) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = HEADERS.iter().map(|h| (*h).to_owned()).collect();
    push_row(&mut out, &header, &widths);
    for (cells, notes) in &rows {
        push_row(&mut out, cells, &widths);
        for note in notes {
            let _ = writeln!(out, "    ↳ {note}");
        }
    }
    out
}

fn push_row(out: &mut String, cells: &[String], widths: &[usize]) {
    let mut line = String::new();
    for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
        if i + 1 == cells.len() {
            line.push_str(cell);
        } else {
            let _ = write!(line, "{cell:<width$}  ");
        }
    }
    let _ = writeln!(out, "{}", line.trim_end());
}

/// What each container printed, claim by claim: the podman command line once, then per
/// claim its `--device` arguments and the output.
pub fn render_containers(summary: &Summary) -> String {
    let mut out = String::new();
    let runs: Vec<(&ClaimReport, &ContainerRun)> = summary
        .claims
        .iter()
        .filter_map(|c| c.container.as_ref().map(|run| (c, run)))
        .collect();
    if let Some((_, first)) = runs.first() {
        let _ = writeln!(out, "each: {}", generic_command(&first.command));
    }
    for (claim, run) in runs {
        let status = match run.exit_code {
            Some(0) => String::new(),
            Some(code) => format!(" (exit code {code})"),
            None => " (killed by a signal)".to_owned(),
        };
        let devices: Vec<&str> = claim
            .devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.iter().map(String::as_str))
            .collect();
        let _ = writeln!(
            out,
            "--- {}/{}{status}: --device {}",
            claim.namespace,
            claim.name,
            devices.join(" --device ")
        );
        for line in run.output.lines() {
            let _ = writeln!(out, "    {line}");
        }
    }
    out
}

/// The command with its `--device` arguments replaced by one placeholder.
fn generic_command(command: &str) -> String {
    let mut words = command.split(' ').peekable();
    let mut out: Vec<&str> = Vec::new();
    let mut placeholder = false;
    while let Some(word) = words.next() {
        if word == "--device" {
            words.next();
            if !placeholder {
                out.push("--device <CDI device ID>...");
                placeholder = true;
            }
        } else {
            out.push(word);
        }
    }
    out.join(" ")
}

/// The class list: name, source, allocator, and any error.
pub fn render_classes(summary: &Summary) -> String {
    let mut out = String::new();
    for class in &summary.classes {
        let allocator = class.allocator.as_deref().unwrap_or("no kerf parameters");
        let _ = write!(out, "  {:<24} {:?}, {allocator}", class.name, class.source);
        match &class.error {
            Some(error) => {
                let _ = writeln!(out, " — NOT CREATED: {error}");
            }
            None => out.push('\n'),
        }
    }
    out
}

/// The "Device health" section: the flipped device and the claims holding it, then per step
/// the status and message the kubelet received and how long after the step; why the flip
/// stopped short, if it did. Empty when the node was not visited.
pub fn render_health(summary: &Summary) -> String {
    let Some(health) = &summary.device_health else {
        return String::new();
    };
    let mut out =
        "Device health, as the kubelet saw it on the plugin's health stream (NodeWatchResources):\n"
            .to_owned();
    if let Some(device) = &health.device {
        let _ = writeln!(out, "  {device}, held by {}:", health.claims.join(", "));
    }
    let steps: Vec<String> = health.observations.iter().map(|o| o.step.text()).collect();
    let width = steps.iter().map(|s| s.chars().count()).max().unwrap_or(0);
    for (observation, step) in health.observations.iter().zip(&steps) {
        let message = if observation.message.is_empty() {
            String::new()
        } else {
            format!(" {:?}", observation.message)
        };
        let _ = writeln!(
            out,
            "    {step:<width$}  {:?}{message}, after {} ms",
            observation.status, observation.millis
        );
    }
    if let Some(error) = &health.error {
        let _ = writeln!(out, "  not shown: {error}");
    }
    let _ = writeln!(
        out,
        "  (fault file: {}, the plugin's --mock-fault-file)",
        health.fault_file.display()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(memory: Option<u64>, compute: Option<u8>, mig: Option<&str>) -> DeviceReport {
        DeviceReport {
            request: "gpu".into(),
            device: "gpu-0".into(),
            device_type: "gpu".into(),
            mig_profile: mig.map(str::to_owned),
            share_id: None,
            memory_bytes: memory,
            compute_percent: compute,
            sharing: "Exclusive".into(),
            mig_instance: None,
            cdi_device_ids: vec!["k8s.gpu.kerf.dev/gpu=u-gpu-0".into()],
            mps: None,
        }
    }

    #[test]
    fn slice_texts() {
        assert_eq!(device(None, None, None).slice_text(), "whole GPU");
        assert_eq!(
            device(Some(10 << 30), Some(25), None).slice_text(),
            "10Gi / 25%"
        );
        assert_eq!(
            device(Some(10 << 30), None, None).slice_text(),
            "10Gi / 100%"
        );
        assert_eq!(
            device(None, None, Some("1g.10gb")).slice_text(),
            "MIG 1g.10gb"
        );
    }

    #[test]
    fn unallocated_claims_show_their_reason() {
        let claim = |name: &str, devices: Vec<DeviceReport>, error: Option<&str>| ClaimReport {
            namespace: "default".into(),
            name: name.into(),
            uid: None,
            origin: "x.yaml#1".into(),
            template: None,
            classes: vec!["c".into()],
            pods: vec![],
            allocated_by: (!devices.is_empty()).then_some(AllocatedBy::Controller),
            node: (!devices.is_empty()).then(|| "n".to_owned()),
            devices,
            prepared: false,
            error: error.map(str::to_owned),
            cdi_spec_file: None,
            cdi_spec: None,
            container: None,
        };
        let mps_slice = DeviceReport {
            mps: Some(MpsReport {
                pipe_directory: PathBuf::from("/out/mps/GPU-1/pipe"),
                container_pipe_directory: "/run/kerf/mps/GPU-1".into(),
                daemon_pid: Some(42),
            }),
            ..device(Some(1 << 30), Some(10), None)
        };
        let summary = Summary {
            node: "n".into(),
            driver: "gpu.kerf.dev".into(),
            inventory: String::new(),
            devices: vec![],
            output_dir: PathBuf::new(),
            classes: vec![],
            claims: vec![
                claim(
                    "ok",
                    vec![device(None, None, None), mps_slice.clone()],
                    None,
                ),
                claim("bad", vec![], Some("spec.x: unknown field")),
            ],
            pods: vec![],
            invalid_manifests: vec![],
            ignored: vec![],
            containers_error: None,
            container_runtime: None,
            gpu_tools_root: None,
            mig_node: None,
            shareable_node: None,
            published_whole: vec![],
            device_health: None,
        };
        let table = render_table(&summary);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("CLAIM"), "{table}");
        assert!(lines[1].starts_with("default/ok"), "{table}");
        // A claim's further devices leave the claim columns blank.
        assert!(lines[2].starts_with("      "), "{table}");
        assert!(
            lines[2].trim_start().starts_with("gpu-0") && lines[2].contains("1Gi / 10%"),
            "{table}"
        );
        // An MPS slice names its daemon and pipe directory under its row.
        assert_eq!(
            lines[3],
            "    ↳ MPS daemon pid 42: pipe directory /out/mps/GPU-1/pipe, mounted at \
             /run/kerf/mps/GPU-1"
        );
        assert!(lines[4].starts_with("default/bad"), "{table}");
        assert_eq!(lines[5], "    ↳ spec.x: unknown field");
    }
}
