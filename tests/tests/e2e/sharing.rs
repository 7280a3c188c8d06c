//! How kerf's GPUs are shared between claims, as the suite judges it: no device is held by
//! two claims when one of them holds it exclusively, no GPU's slices add up to more memory or
//! compute than it has, which GPUs are idle, and whether a burst of whole GPUs and slices fits
//! a node. Pure functions over API objects, unit-tested without a cluster.
//!
//! What an allocation holds is read with [`kerf_api::device_uses`], the documented rule both
//! allocators' claims are counted by (a `GpuSliceAllocation` entry is a slice, or the whole GPU
//! when it sets neither memory nor compute; a consumable-capacity share is a slice; any other
//! result, such as kube-scheduler's, is the whole device).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_core::alloc::UseKind;

use super::checks::PublishedDevice;

/// The GPU a published device is part of: the device itself for a whole GPU, the parent
/// `gpu-<minor>` for a MIG device `gpu-<minor>-mig-<profile>-<start>`.
pub fn physical_gpu(device: &str) -> &str {
    device.split_once("-mig-").map_or(device, |(gpu, _)| gpu)
}

/// One claim's hold on one device.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    claim: String,
    device: String,
    kind: UseKind,
}

impl Hold {
    fn describe(&self) -> String {
        match self.kind {
            UseKind::Whole => format!("{} holds {} whole", self.claim, self.device),
            UseKind::Slice {
                memory_bytes,
                compute_percent,
                ..
            } => format!(
                "{} holds {} bytes / {compute_percent}% of {}",
                self.claim, memory_bytes, self.device
            ),
        }
    }
}

/// The holds of `claims` on the devices of `driver`, by (node, physical GPU).
fn holds(claims: &[ResourceClaim], driver: &str) -> BTreeMap<(String, String), Vec<Hold>> {
    let mut out: BTreeMap<(String, String), Vec<Hold>> = BTreeMap::new();
    for claim in claims {
        let id = format!(
            "{}/{}",
            claim.metadata.namespace.as_deref().unwrap_or_default(),
            claim.metadata.name.as_deref().unwrap_or_default()
        );
        for used in kerf_api::device_uses(claim, driver) {
            let gpu = physical_gpu(&used.device).to_owned();
            out.entry((used.node, gpu)).or_default().push(Hold {
                claim: id.clone(),
                device: used.device,
                kind: used.kind,
            });
        }
    }
    out
}

/// Every way `claims` share the devices of `driver` that they must not, one line each; empty
/// when there is none:
///
/// - a device held whole by one claim is held by no other claim in any way (for a whole GPU
///   this includes its MIG devices, and for a MIG device its parent GPU);
/// - the slices on one GPU add up to at most its published `memory` capacity and to at most
///   100 % of its compute.
pub fn sharing_problems(
    claims: &[ResourceClaim],
    driver: &str,
    published: &[PublishedDevice],
) -> Vec<String> {
    let mut problems = Vec::new();
    for ((node, gpu), holds) in holds(claims, driver) {
        for (i, a) in holds.iter().enumerate() {
            for b in &holds[i + 1..] {
                let overlap = a.device == b.device || a.device == gpu || b.device == gpu;
                let exclusive = a.kind == UseKind::Whole || b.kind == UseKind::Whole;
                if a.claim != b.claim && overlap && exclusive {
                    problems.push(format!(
                        "{node}/{gpu} is shared although one hold is exclusive: {}; {}",
                        a.describe(),
                        b.describe()
                    ));
                }
            }
        }
        let (mut memory, mut compute, mut slices) = (0u64, 0u32, Vec::new());
        for hold in &holds {
            if let UseKind::Slice {
                memory_bytes,
                compute_percent,
                ..
            } = hold.kind
            {
                memory = memory.saturating_add(memory_bytes);
                compute += u32::from(compute_percent);
                slices.push(hold.describe());
            }
        }
        if slices.is_empty() {
            continue;
        }
        let capacity = published
            .iter()
            .find(|d| d.node == node && d.name == gpu)
            .and_then(|d| d.memory_bytes);
        match capacity {
            Some(capacity) if memory > capacity => problems.push(format!(
                "the slices on {node}/{gpu} take {memory} bytes of its {capacity}: {slices:?}"
            )),
            Some(_) => {}
            None => problems.push(format!(
                "{node}/{gpu} holds slices but kerf publishes no memory capacity for it: {slices:?}"
            )),
        }
        if compute > 100 {
            problems.push(format!(
                "the slices on {node}/{gpu} take {compute}% of its compute: {slices:?}"
            ));
        }
    }
    problems
}

/// The whole GPUs of `node` that no claim in `claims` holds in any way (nor any of their MIG
/// devices), in name order.
pub fn idle_gpus(
    node: &str,
    claims: &[ResourceClaim],
    driver: &str,
    published: &[PublishedDevice],
) -> Vec<String> {
    let held: BTreeSet<(String, String)> = holds(claims, driver).into_keys().collect();
    published
        .iter()
        .filter(|d| d.node == node && d.kind == "gpu")
        .filter(|d| !held.contains(&(node.to_owned(), d.name.clone())))
        .map(|d| d.name.clone())
        .collect()
}

/// A burst of whole-GPU claims and equal slices, as the mixed-burst test sizes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Burst {
    /// Pods with one whole GPU each.
    pub whole: usize,
    /// Pods with one slice each.
    pub slices: usize,
    /// Memory of each slice, in bytes.
    pub slice_bytes: u64,
    /// Compute of each slice, in percent.
    pub slice_compute: u8,
}

impl Burst {
    /// How many of these slices one GPU of `memory_bytes` holds.
    pub fn slices_per_gpu(&self, memory_bytes: u64) -> usize {
        if self.slice_bytes == 0 || self.slice_compute == 0 {
            return 0;
        }
        let by_memory = memory_bytes / self.slice_bytes;
        let by_compute = 100 / u64::from(self.slice_compute);
        usize::try_from(by_memory.min(by_compute)).unwrap_or(usize::MAX)
    }

    /// How many idle GPUs of `memories` (bytes each) stay unused when the burst is placed as
    /// tightly as it can be (slices on the GPUs that hold the most of them, whole GPUs on any
    /// other), or `None` when it does not fit.
    pub fn spare_gpus(&self, memories: &[u64]) -> Option<usize> {
        let mut capacities: Vec<usize> = memories.iter().map(|m| self.slices_per_gpu(*m)).collect();
        capacities.sort_unstable_by(|a, b| b.cmp(a));
        let mut placed = 0;
        let mut used = 0;
        for capacity in &capacities {
            if placed >= self.slices {
                break;
            }
            placed += capacity;
            used += 1;
        }
        if placed < self.slices {
            return None;
        }
        (capacities.len() - used).checked_sub(self.whole)
    }

    /// The nodes of `published` whose idle whole GPUs (held by none of `claims`) fit the
    /// burst, in name order.
    pub fn fitting_nodes(
        &self,
        claims: &[ResourceClaim],
        driver: &str,
        published: &[PublishedDevice],
    ) -> Vec<String> {
        let nodes: BTreeSet<&str> = published.iter().map(|d| d.node.as_str()).collect();
        nodes
            .into_iter()
            .filter(|node| {
                let idle = idle_gpus(node, claims, driver, published);
                let memories: Vec<u64> = published
                    .iter()
                    .filter(|d| d.node == *node && idle.contains(&d.name))
                    .map(|d| d.memory_bytes.unwrap_or(0))
                    .collect();
                self.spare_gpus(&memories).is_some()
            })
            .map(str::to_owned)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kerf_api::params::{GpuSliceAllocation, OpaqueKind as _, SliceDevice};
    use serde_json::{Value, json};

    const DRIVER: &str = "gpu.kerf.dev";
    const GI: u64 = 1 << 30;
    /// Memory of a mock H100 80GB (81559Mi).
    const H100: u64 = 81559 << 20;

    /// A claim `name` allocated `devices` of node `n`; `slice` adds kerf's controller's
    /// `GpuSliceAllocation` of (memory, compute) for every device.
    fn claim(name: &str, devices: &[&str], slice: Option<(u64, u8)>) -> ResourceClaim {
        let results: Vec<Value> = devices
            .iter()
            .map(|d| json!({"request": "gpu", "driver": DRIVER, "pool": "n", "device": d}))
            .collect();
        let mut allocation = json!({"devices": {"results": results}});
        if let Some((memory, compute)) = slice {
            let parameters = GpuSliceAllocation {
                devices: devices
                    .iter()
                    .map(|d| SliceDevice {
                        pool: "n".to_owned(),
                        device: (*d).to_owned(),
                        share_id: None,
                        gpu_uuid: format!("GPU-{d}"),
                        memory_bytes: Some(memory),
                        compute_percent: Some(compute),
                        sharing: kerf_core::sharing::Sharing::Mps,
                        time_slice_interval: None,
                        enforcement: kerf_core::enforcement::Enforcement::default(),
                    })
                    .collect(),
            }
            .to_parameters()
            .unwrap();
            allocation["devices"]["config"] = json!([{
                "source": "FromClaim",
                "requests": ["gpu"],
                "opaque": {"driver": DRIVER, "parameters": parameters},
            }]);
        }
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "c"}}]}},
            "status": {"allocation": allocation},
        }))
        .unwrap()
    }

    fn gpus(count: usize) -> Vec<PublishedDevice> {
        (0..count)
            .map(|i| PublishedDevice {
                node: "n".to_owned(),
                name: format!("gpu-{i}"),
                kind: "gpu".to_owned(),
                uuid: format!("GPU-{i}"),
                minor: i64::try_from(i).ok(),
                memory_bytes: Some(H100),
                owner: None,
            })
            .collect()
    }

    #[test]
    fn slices_that_fit_and_separate_whole_gpus_pass() {
        let claims = [
            claim("whole-a", &["gpu-0"], None),
            claim("whole-b", &["gpu-1"], None),
            claim("s1", &["gpu-2"], Some((19 * GI, 20))),
            claim("s2", &["gpu-2"], Some((19 * GI, 20))),
            claim("s3", &["gpu-2"], Some((19 * GI, 20))),
            claim("s4", &["gpu-2"], Some((19 * GI, 20))),
            // One claim holding two GPUs whole is no conflict with itself.
            claim("pair", &["gpu-3", "gpu-4"], None),
        ];
        assert_eq!(
            sharing_problems(&claims, DRIVER, &gpus(8)),
            Vec::<String>::new()
        );
        assert_eq!(
            idle_gpus("n", &claims, DRIVER, &gpus(8)),
            ["gpu-5", "gpu-6", "gpu-7"]
        );
        // Another driver's allocations are not kerf's.
        assert!(sharing_problems(&claims, "other.example.com", &[]).is_empty());
    }

    #[test]
    fn a_whole_gpu_held_twice_or_sliced_is_named() {
        let claims = [
            claim("whole-a", &["gpu-0"], None),
            claim("whole-b", &["gpu-0"], None),
            claim("slice", &["gpu-0"], Some((GI, 10))),
        ];
        let problems = sharing_problems(&claims, DRIVER, &gpus(1));
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems[0].contains("n/gpu-0 is shared")
                && problems[0].contains("ns/whole-a holds gpu-0 whole")
                && problems[0].contains("ns/whole-b holds gpu-0 whole"),
            "{problems:?}"
        );
        assert!(
            problems[1].contains("ns/slice holds 1073741824 bytes / 10% of gpu-0"),
            "{problems:?}"
        );

        // A MIG device and its parent GPU are one GPU.
        let claims = [
            claim("whole", &["gpu-0"], None),
            claim("mig", &["gpu-0-mig-1g.10gb-0"], None),
        ];
        assert_eq!(sharing_problems(&claims, DRIVER, &gpus(1)).len(), 1);
        assert!(idle_gpus("n", &claims[1..], DRIVER, &gpus(1)).is_empty());
        // Two different MIG devices of one GPU are not.
        let claims = [
            claim("mig-a", &["gpu-0-mig-1g.10gb-0"], None),
            claim("mig-b", &["gpu-0-mig-1g.10gb-1"], None),
        ];
        assert!(sharing_problems(&claims, DRIVER, &gpus(1)).is_empty());
    }

    #[test]
    fn over_committed_slices_are_named() {
        let four = |memory, compute| -> Vec<ResourceClaim> {
            (0..4)
                .map(|i| claim(&format!("s{i}"), &["gpu-0"], Some((memory, compute))))
                .collect()
        };
        // 4 × 20Gi is more than an H100 80GB's 81559Mi.
        let problems = sharing_problems(&four(20 * GI, 20), DRIVER, &gpus(1));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("take 85899345920 bytes of its 85520809984"),
            "{problems:?}"
        );
        let problems = sharing_problems(&four(GI, 30), DRIVER, &gpus(1));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("take 120% of its compute"),
            "{problems:?}"
        );
        let problems = sharing_problems(&four(GI, 10), DRIVER, &[]);
        assert!(
            problems[0].contains("publishes no memory capacity"),
            "{problems:?}"
        );
    }

    #[test]
    fn bursts_are_sized_against_the_gpus() {
        let burst = Burst {
            whole: 4,
            slices: 14,
            slice_bytes: 19 * GI,
            slice_compute: 20,
        };
        assert_eq!(burst.slices_per_gpu(H100), 4);
        // 14 slices need 4 GPUs, plus 4 whole GPUs: exactly 8 × H100.
        assert_eq!(burst.spare_gpus(&[H100; 8]), Some(0));
        assert_eq!(burst.spare_gpus(&[H100; 9]), Some(1));
        assert_eq!(burst.spare_gpus(&[H100; 7]), None);
        // 20Gi slices: three per H100, so the same burst needs 9.
        let wider = Burst {
            slice_bytes: 20 * GI,
            ..burst
        };
        assert_eq!(wider.slices_per_gpu(H100), 3);
        assert_eq!(wider.spare_gpus(&[H100; 8]), None);
        // Compute limits too: 30% slices, three per GPU.
        let hungry = Burst {
            slice_compute: 30,
            ..burst
        };
        assert_eq!(hungry.slices_per_gpu(H100), 3);
        let none = Burst {
            whole: 0,
            slices: 0,
            ..burst
        };
        assert_eq!(none.spare_gpus(&[]), Some(0));

        // A node fits while its idle GPUs do.
        assert_eq!(burst.fitting_nodes(&[], DRIVER, &gpus(8)), ["n"]);
        let busy = [claim("other", &["gpu-0"], Some((GI, 10)))];
        assert!(burst.fitting_nodes(&busy, DRIVER, &gpus(8)).is_empty());
        assert!(burst.fitting_nodes(&busy, DRIVER, &gpus(9)) == ["n"]);
    }
}
