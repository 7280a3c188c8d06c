//! The registry `docs/metrics.md` is generated from ([`reference_registry`]).

use std::collections::BTreeMap;
use std::time::Duration;

use kerf_api::gpuquota::GpuAmount;
use prometheus_client::registry::Registry;

use super::{ACTION_SET, Metrics, PoolFragmentation};
use crate::capacity::{ClassCapacity, DeviceFill, Held, Holdings};

/// kerf-controller's registry as [`crate::Process::run`] fills it, with one example series in
/// every family so that the reference can show each family's labels (a family without
/// series shows none).
pub fn reference_registry() -> Registry {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    metrics.touch_every_family();
    registry
}

impl Metrics {
    /// Records one example in every family; the values mean nothing.
    fn touch_every_family(&self) {
        let tick = Duration::from_millis(1);
        self.record_reconcile("gpuclass", Ok(()), tick);
        self.set_class_capacity("example", &ClassCapacity::default());
        self.set_class_free_compute("example", 0.0);
        self.record_allocation(Ok(()), tick);
        self.record_pod_allocation(tick);
        self.set_leader(false);
        self.record_admission("gated");
        self.record_claim_admission("resourceclaims", "normalized");
        self.record_quota_admission("charged");
        self.set_webhook_serving("0.0.0.0:9443", true);
        self.record_ownership_move("controller");
        self.set_ownership_devices(0, 0, 0);
        self.record_ownership_pass();
        self.record_allocation_conflict("scheduler");
        self.record_claim_node_label(ACTION_SET);
        self.record_idle_gpus_taint(ACTION_SET);
        self.api_write_failures().record("pods", "Forbidden");
        let capped = (GpuAmount::ZERO, [true; 3]);
        self.quota
            .set("example", "example", GpuAmount::ZERO, Some(capped));
        let pools = BTreeMap::from([(
            "example".to_owned(),
            PoolFragmentation {
                fragmented_gpus: Some(0.0),
                stranded_gpus: Some(0.0),
                ..PoolFragmentation::default()
            },
        )]);
        self.set_pool_fragmentation(&pools);
        let device = DeviceFill {
            node: "node".to_owned(),
            device: "gpu-0".to_owned(),
            uuid: "GPU-0".to_owned(),
            product: "NVIDIA L4".to_owned(),
            memory_bytes: 0,
            memory_allocated_bytes: 0,
            compute_allocated_percent: 0,
            slices: 0,
        };
        let held = BTreeMap::from([("example".to_owned(), Held::default())]);
        self.usage.set_holdings(&Holdings {
            devices: vec![device],
            classes: held.clone(),
            namespaces: held,
        });
        self.usage.set_unallocated(0, Duration::ZERO);
    }
}
