//! Device health as pods and ResourceSlices show it: the mock fault annotation the suite sets
//! on a node, the pod's `allocatedResourcesStatus`, and the device's taints.
//!
//! In mock mode kerf's kubelet plugin reads its node's annotation [`MOCK_FAULTS_ANNOTATION`]
//! (published device name → that GPU's faults, YAML or JSON) as its fault source. The kubelet
//! shows what the plugin's health stream says in
//! `pod.status.containerStatuses[].allocatedResourcesStatus` (kubernetes/kubernetes
//! `pkg/kubelet/cm/dra/manager.go`, `UpdateAllocatedResourcesStatus`): an entry named
//! `claim:<pod claim name>` (or `claim:<pod claim name>/<request>`) whose resources have the
//! device's first CDI ID, or `<driver>/<pool>/<device>`, as `resourceID`, and `health`
//! Healthy / Unhealthy / Unknown. The feature gate ResourceHealthStatus is on by default from
//! 1.36 only, so a kubelet that reports nothing within a bound means the test cannot run.

use std::time::Duration;

use anyhow::{Context as _, Result};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use kerf_api::features::{Probed, device_taints_probe, kept_device_taints};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

/// The Node annotation kerf's plugin reads its mock faults from.
pub const MOCK_FAULTS_ANNOTATION: &str = "gpu.kerf.dev/mock-faults";

/// How long to wait for the kubelet's first health report before deciding it gives none.
pub const FIRST_REPORT_BOUND: Duration = Duration::from_secs(60);

/// The annotation value that gives `device` one XID `code`.
pub fn xid_fault(device: &str, code: u64) -> String {
    json!({ device: [{"kind": "xid", "code": code}] }).to_string()
}

/// The health the kubelet reports for the devices of pod claim `claim_ref` in any container
/// of `pod`: `Some(health)` when every reported device of it has that health (one device per
/// claim in this suite), `None` when nothing is reported yet or the devices disagree. Also the
/// resource IDs seen, for messages.
pub fn claim_health(pod: &Pod, claim_ref: &str) -> (Option<String>, Vec<String>) {
    let name = format!("claim:{claim_ref}");
    let entries: Vec<(String, String)> = pod
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .flat_map(|c| c.allocated_resources_status.iter().flatten())
        .filter(|r| r.name == name || r.name.starts_with(&format!("{name}/")))
        .flat_map(|r| r.resources.iter().flatten())
        .map(|h| {
            (
                h.resource_id.clone(),
                h.health.clone().unwrap_or_else(|| "Unknown".to_owned()),
            )
        })
        .collect();
    let seen = entries.iter().map(|(id, h)| format!("{id}={h}")).collect();
    let first = entries.first().map(|(_, h)| h.clone());
    let agreed = first.filter(|h| entries.iter().all(|(_, other)| other == h));
    (agreed, seen)
}

/// The taints of device `device` in pool `pool` of `driver`, from the pool's newest slices.
pub fn device_taints(
    slices: &[ResourceSlice],
    driver: &str,
    pool: &str,
    device: &str,
) -> Vec<DeviceTaint> {
    let newest = slices
        .iter()
        .filter(|s| s.spec.driver == driver && s.spec.pool.name == pool)
        .map(|s| s.spec.pool.generation)
        .max();
    slices
        .iter()
        .filter(|s| s.spec.driver == driver && s.spec.pool.name == pool)
        .filter(|s| Some(s.spec.pool.generation) == newest)
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.name == device)
        .flat_map(|d| d.taints.clone().unwrap_or_default())
        .collect()
}

/// Whether the API server keeps ResourceSlice device taints (DRADeviceTaints), asked with a
/// dry-run create, as kerf's plugin asks.
pub async fn probe_device_taints(client: &Client, driver: &str, node: &str) -> Probed {
    let params = PostParams {
        dry_run: true,
        field_manager: Some("kerf-e2e".to_owned()),
    };
    match Api::<ResourceSlice>::all(client.clone())
        .create(&params, &device_taints_probe(driver, node))
        .await
    {
        Ok(answer) => kept_device_taints(&answer),
        Err(error) => Probed::Failed(error.to_string()),
    }
}

/// Sets or (with `None`) removes [`MOCK_FAULTS_ANNOTATION`] on `node` (a merge patch, so
/// other annotations stay).
pub async fn set_faults(client: &Client, node: &str, faults: Option<&str>) -> Result<()> {
    Api::<Node>::all(client.clone())
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {MOCK_FAULTS_ANNOTATION: faults}}})),
        )
        .await
        .with_context(|| format!("setting {MOCK_FAULTS_ANNOTATION}={faults:?} on node {node}"))?;
    Ok(())
}

/// Removes the fault annotation from its node when dropped (also when the test fails or
/// panics), on a thread with its own runtime and client, like the suite's namespace cleanup.
pub struct FaultGuard {
    node: String,
}

impl FaultGuard {
    /// Puts `faults` on `node` and arms the guard.
    pub async fn set(client: &Client, node: &str, faults: &str) -> Result<Self> {
        // Armed before the write: a write that lands but whose answer is lost is undone too.
        let guard = FaultGuard {
            node: node.to_owned(),
        };
        set_faults(client, node, Some(faults)).await?;
        Ok(guard)
    }
}

impl Drop for FaultGuard {
    fn drop(&mut self) {
        let node = self.node.clone();
        let joined = std::thread::spawn(move || -> Result<()> {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(async {
                    let client = Client::try_from(kube::Config::infer().await?)?;
                    set_faults(&client, &node, None).await
                })
        })
        .join();
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!(
                "could not remove {MOCK_FAULTS_ANNOTATION} from node {}: {error:#}; run kubectl annotate node {} {MOCK_FAULTS_ANNOTATION}-",
                self.node, self.node
            ),
            Err(_) => eprintln!(
                "removing {MOCK_FAULTS_ANNOTATION} from node {} panicked",
                self.node
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus, ResourceHealth, ResourceStatus};
    use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};

    fn pod(entries: &[(&str, &str, Option<&str>)]) -> Pod {
        let statuses = entries
            .iter()
            .map(|(name, id, health)| ResourceStatus {
                name: (*name).to_owned(),
                resources: Some(vec![ResourceHealth {
                    resource_id: (*id).to_owned(),
                    health: health.map(str::to_owned),
                }]),
            })
            .collect();
        Pod {
            status: Some(PodStatus {
                container_statuses: Some(vec![ContainerStatus {
                    allocated_resources_status: Some(statuses),
                    ..ContainerStatus::default()
                }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    #[test]
    fn the_fault_value_is_the_documented_json() {
        let value: serde_json::Value = serde_json::from_str(&xid_fault("gpu-3", 61)).unwrap();
        assert_eq!(value, json!({"gpu-3": [{"kind": "xid", "code": 61}]}));
    }

    #[test]
    fn health_is_read_from_the_claims_entry() {
        assert_eq!(claim_health(&Pod::default(), "gpu").0, None);
        let id = "k8s.gpu.kerf.dev/claim=uid-gpu-0";
        let healthy = pod(&[
            ("claim:gpu", id, Some("Healthy")),
            ("claim:other", "x", Some("Unhealthy")),
        ]);
        let (health, seen) = claim_health(&healthy, "gpu");
        assert_eq!(health.as_deref(), Some("Healthy"));
        assert_eq!(seen, [format!("{id}=Healthy")]);
        let by_request = pod(&[(
            "claim:gpu/req",
            "gpu.kerf.dev/node/gpu-0",
            Some("Unhealthy"),
        )]);
        assert_eq!(
            claim_health(&by_request, "gpu").0.as_deref(),
            Some("Unhealthy")
        );
        let missing = pod(&[("claim:gpu", id, None)]);
        assert_eq!(claim_health(&missing, "gpu").0.as_deref(), Some("Unknown"));
        let mixed = pod(&[
            ("claim:gpu", "a", Some("Healthy")),
            ("claim:gpu", "b", Some("Unhealthy")),
        ]);
        assert_eq!(claim_health(&mixed, "gpu").0, None);
    }

    #[test]
    fn taints_come_from_the_newest_generation() {
        let slice = |generation: i64, taint: Option<&str>| ResourceSlice {
            metadata: kube::api::ObjectMeta::default(),
            spec: ResourceSliceSpec {
                driver: "gpu.kerf.dev".to_owned(),
                pool: ResourcePool {
                    name: "node-a".to_owned(),
                    generation,
                    resource_slice_count: 1,
                },
                devices: Some(vec![Device {
                    name: "gpu-0".to_owned(),
                    taints: taint.map(|value| {
                        vec![DeviceTaint {
                            key: "gpu.kerf.dev/unhealthy".to_owned(),
                            value: Some(value.to_owned()),
                            effect: "NoSchedule".to_owned(),
                            time_added: None,
                        }]
                    }),
                    ..Device::default()
                }]),
                ..ResourceSliceSpec::default()
            },
        };
        let slices = [slice(1, Some("xid-61")), slice(2, None)];
        assert!(device_taints(&slices, "gpu.kerf.dev", "node-a", "gpu-0").is_empty());
        let slices = [slice(3, Some("xid-61")), slice(2, None)];
        let taints = device_taints(&slices, "gpu.kerf.dev", "node-a", "gpu-0");
        assert_eq!(taints[0].value.as_deref(), Some("xid-61"));
        assert!(device_taints(&slices, "gpu.kerf.dev", "node-a", "gpu-1").is_empty());
    }
}
