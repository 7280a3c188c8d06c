//! Dynamic MIG in the publisher: the `DRAPartitionableDevices` probe and the features the pool
//! is built with ([`kerf_api::resourceslice::node_slices`]).
//!
//! The probe is two dry-run creates ([`features::partitionable_devices_probes`]): a
//! counters-only slice and a devices-only slice consuming its counter, the two shapes the pool
//! then has. It runs once, the first time the inventory holds a dynamic-MIG GPU with a
//! catalogue; a server that drops either field (Kubernetes 1.34/1.35 with the gate off, or a
//! 1.34 server that wants both in one slice) gets those GPUs whole and one log line.

use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::features::{self, ApiFeature, Probed};
use kerf_api::resourceslice::ResourceSliceFeatures;
use kerf_api::resourceslice::dynamic_mig::is_partitionable;
use kerf_core::inventory::Inventory;
use kube::api::{Api, PostParams};

use super::{FIELD_MANAGER, Publisher};

impl Publisher {
    /// Probes partitionable devices the first time `inventory` has a dynamic-MIG GPU with a
    /// catalogue; afterwards (and while there is none) it does nothing.
    pub(super) async fn probe_partitionable_devices(&self, inventory: &Inventory) {
        let needed =
            self.state().partitionable.is_none() && inventory.gpus.iter().any(is_partitionable);
        if !needed {
            return;
        }
        let probed = probe(&self.slices, &self.driver, &self.node_name).await;
        log_probe(&probed);
        self.state().partitionable = Some(probed.is_served());
    }

    /// The API features the pool is built with: device taints when the publisher taints,
    /// partitionable devices once probed served.
    pub(super) fn slice_features(&self) -> ResourceSliceFeatures {
        ResourceSliceFeatures {
            device_taints: self.taints.is_some(),
            partitionable_devices: self.state().partitionable == Some(true),
        }
    }
}

fn log_probe(probed: &Probed) {
    match probed.degraded_message(ApiFeature::PartitionableDevices) {
        None => tracing::info!(
            "the API server keeps partitionable devices: dynamic-MIG GPUs are published as counter sets and MIG placements"
        ),
        Some(line) => tracing::info!("{line}"),
    }
}

/// The dry-run creates of [`features::partitionable_devices_probes`].
async fn probe(slices: &Api<ResourceSlice>, driver: &str, node: &str) -> Probed {
    let params = PostParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.to_owned()),
    };
    let [sets, devices] = features::partitionable_devices_probes(driver, node);
    let sets = match slices.create(&params, &sets).await {
        Ok(answer) => answer,
        Err(e) => return Probed::Failed(e.to_string()),
    };
    match slices.create(&params, &devices).await {
        Ok(answer) => features::kept_partitionable_devices(&sets, &answer),
        Err(e) => Probed::Failed(e.to_string()),
    }
}
