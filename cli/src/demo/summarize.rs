//! The [`Summary`] of a run, made from the allocation outcomes and what the kubelet saw on
//! each node: one report per claim (its devices as published, prepared and started) and per
//! pod.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::Device;
use kerf_api::resourceslice::{attributes, device_attribute};
use kerf_core::cdi;

use super::allocate::{ClaimOutcome, PodOutcome};
use super::kubelet_visit::NodeRun;
use super::node::Layout;
use super::workload::{self, Workload};
use super::{ClaimReport, DeviceReport, MpsReport, PodReport, Summary};
use super::{DemoConfig, classes, inventory_text, manifests, mig, mps, report};

/// What the summary is made from, besides the outcomes.
pub(super) struct Run<'a> {
    pub(super) config: &'a DemoConfig,
    pub(super) layout: &'a Layout,
    /// Each node's published devices, main node first.
    pub(super) node_devices: &'a [(&'a str, &'a [Device])],
    pub(super) manifests: &'a manifests::Manifests,
    pub(super) classes: &'a classes::Classes,
    pub(super) workload: &'a Workload,
}

impl Run<'_> {
    /// The summary, the main node's parts filled in; the extra nodes' reports are added by
    /// the caller.
    pub(super) fn summarize(
        &self,
        claim_outcomes: &[ClaimOutcome],
        pod_outcomes: &[PodOutcome],
        mut node_run: NodeRun,
    ) -> Summary {
        let Run {
            config,
            layout,
            node_devices,
            manifests,
            classes,
            workload,
        } = *self;
        let driver = config.driver_name.as_str();
        let devices = node_devices.first().map_or(&[][..], |(_, d)| *d);
        let claims = workload
            .claims
            .iter()
            .zip(claim_outcomes)
            .map(|(claim, outcome)| {
                claim_report(claim, outcome, node_devices, driver, &mut node_run)
            })
            .collect();
        let pods = workload
            .pods
            .iter()
            .zip(pod_outcomes)
            .map(|(pod, outcome)| pod_report(pod, outcome, workload))
            .collect();
        Summary {
            node: config.node_name.clone(),
            driver: driver.to_owned(),
            inventory: inventory_text(&config.discovery),
            devices: report::describe_devices(devices, driver),
            output_dir: layout.root.clone(),
            classes: classes.reports.clone(),
            claims,
            pods,
            invalid_manifests: invalid_manifest_lines(manifests),
            ignored: manifests.ignored.clone(),
            containers_error: node_run.containers_error.take(),
            container_runtime: node_run.container_runtime.take(),
            gpu_tools_root: config
                .gpu_tools
                .as_ref()
                .map(|_| layout.gpu_tools_root.clone()),
            device_health: node_run.health.take(),
            mig_node: None,
            shareable_node: None,
            published_whole: Vec::new(),
        }
    }
}

fn pod_report(pod: &workload::DemoPod, outcome: &PodOutcome, workload: &Workload) -> PodReport {
    PodReport {
        namespace: pod.namespace.clone(),
        name: pod.name.clone(),
        owner: pod.owner.clone(),
        claims: pod
            .claims
            .iter()
            .map(|c| match &c.claim {
                Ok(i) => workload.claims[*i].name.clone(),
                Err(_) => format!("?{}", c.pod_claim_name),
            })
            .collect(),
        scheduled: outcome.schedulable.is_ok(),
        node: outcome.schedulable.clone().ok(),
        error: outcome.schedulable.clone().err(),
    }
}

/// One line per invalid manifest the claim and class reports do not already name.
fn invalid_manifest_lines(manifests: &manifests::Manifests) -> Vec<String> {
    manifests
        .invalid
        .iter()
        .filter(|i| {
            !matches!(
                i.kind.as_str(),
                "ResourceClaim" | "GpuClass" | "DeviceClass"
            )
        })
        .map(|i| {
            let what = if i.kind.is_empty() {
                String::new()
            } else {
                format!("{}/{} ", i.kind, i.name)
            };
            format!("{what}({}): {}", i.origin, i.error)
        })
        .collect()
}

fn claim_report(
    claim: &workload::DemoClaim,
    outcome: &ClaimOutcome,
    node_devices: &[(&str, &[Device])],
    driver: &str,
    node_run: &mut NodeRun,
) -> ClaimReport {
    let uid = claim.claim.as_ref().map(|_| claim.uid().to_owned());
    let classes = kerf_api::controller_claims::request_class_names(
        claim.claim.as_ref().and_then(|c| c.spec.devices.as_ref()),
    )
    .map(str::to_owned)
    .collect();
    let prepared = uid.as_deref().and_then(|u| node_run.prepared.get(u));
    let cdi_ids: BTreeMap<String, Vec<String>> = match prepared {
        Some(Ok(devices)) => devices
            .iter()
            .map(|d| (d.device_name.clone(), d.cdi_device_ids.clone()))
            .collect(),
        _ => BTreeMap::new(),
    };
    let mut error = outcome.error.clone();
    if let Some(Err(e)) = prepared {
        error = Some(format!("NodePrepareResources: {e}"));
    }
    let allocated = claim
        .claim
        .as_ref()
        .and_then(|c| kerf_api::resolve_allocation(c, driver).ok())
        .unwrap_or_default();
    let spec = uid.as_deref().and_then(|u| node_run.specs.remove(u));
    let pipes = spec
        .as_ref()
        .map(|(_, value)| mps::pipe_mounts(value))
        .unwrap_or_default();
    let device_reports = allocated
        .iter()
        .map(|a| {
            device_report(
                a,
                uid.as_deref(),
                &pipes,
                node_devices,
                driver,
                &cdi_ids,
                node_run,
            )
        })
        .collect();
    let node = allocated.first().map(|a| a.pool.clone());
    ClaimReport {
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        origin: claim.origin.clone(),
        template: claim.template.clone(),
        classes,
        pods: claim.pods.clone(),
        allocated_by: outcome.allocated_by,
        node,
        devices: device_reports,
        prepared: matches!(prepared, Some(Ok(_))),
        error,
        cdi_spec_file: spec.as_ref().map(|(path, _)| path.clone()),
        cdi_spec: spec.map(|(_, value)| value),
        container: uid.as_deref().and_then(|u| node_run.containers.remove(u)),
        uid,
    }
}

/// The report of one allocated device of a claim: what was published, prepared and started.
fn device_report(
    a: &kerf_api::AllocatedDevice,
    uid: Option<&str>,
    pipes: &[mps::PipeMount],
    node_devices: &[(&str, &[Device])],
    driver: &str,
    cdi_ids: &BTreeMap<String, Vec<String>>,
    node_run: &NodeRun,
) -> DeviceReport {
    let mps = uid.and_then(|u| {
        let name = cdi::claim_device_name(u, &a.device);
        let pipe = pipes.iter().find(|p| p.device == name)?;
        Some(MpsReport {
            pipe_directory: pipe.host.clone(),
            container_pipe_directory: pipe.container.clone(),
            daemon_pid: node_run.mps_daemons.get(&pipe.host).copied().flatten(),
        })
    });
    let published = node_devices
        .iter()
        .find(|(node, _)| *node == a.pool)
        .and_then(|(_, devices)| devices.iter().find(|d| d.name == a.device));
    let string = |name: &str| {
        published
            .and_then(|d| device_attribute(d, driver, name))
            .and_then(|v| v.string.clone())
    };
    DeviceReport {
        request: a.request.clone(),
        device: a.device.clone(),
        device_type: string(attributes::TYPE).unwrap_or_default(),
        mig_profile: string(attributes::PROFILE),
        share_id: a.share_id.clone(),
        memory_bytes: a.limits.memory_bytes,
        compute_percent: a.limits.compute_percent,
        sharing: a.sharing.to_string(),
        cdi_device_ids: cdi_ids.get(&a.device).cloned().unwrap_or_default(),
        mps,
        mig_instance: published.and_then(|d| mig::instance_of(d, driver, &node_run.mig_prepared)),
    }
}
