//! Dynamic MIG, the controller's half: with the kubelet plugin's real dynamic-MIG
//! pool (counter sets, full GPUs and placements) on a node, the ownership tick records every
//! device as kube-scheduler's, whatever the node's allocator label, never moves one to the
//! controller, and the published `allocator` attribute follows (one owner per GPU).

use std::time::Duration;

use claim_cluster::{Controller, DRIVER, node, publish_slices};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_api::ownership::{Owner, OwnershipRecord, published_owner};
use kerf_api::resourceslice::ResourceSliceFeatures;
use kerf_tests::fake_api::FakeApi;
use serde_json::json;

use crate::common::claim_cluster;

const NODE: &str = "node-0";

/// A node whose plugin publishes 4 × A100-40GB as dynamic MIG.
fn dynamic_mig_cluster(label: &str) -> (FakeApi, usize) {
    let fake = FakeApi::new();
    node(
        &fake,
        NODE,
        json!({"gpu.kerf.dev/allocator": label}),
        json!([]),
        true,
    );
    let features = ResourceSliceFeatures {
        device_taints: false,
        partitionable_devices: true,
    };
    let devices = publish_slices(&fake, NODE, "a100-40gb-dynmig", features);
    (fake, devices)
}

fn record(fake: &FakeApi) -> OwnershipRecord {
    let node: Node = fake.get_resource(None, NODE).unwrap();
    OwnershipRecord::from_annotations(node.metadata.annotations.as_ref()).unwrap()
}

fn published_owners(fake: &FakeApi) -> Vec<(String, Option<Owner>)> {
    fake.list_resources::<ResourceSlice>(None)
        .iter()
        .flat_map(|s| s.spec.devices.clone().unwrap_or_default())
        .map(|d| (d.name.clone(), published_owner(&d, DRIVER)))
        .collect()
}

#[tokio::test]
async fn dynamic_mig_devices_are_recorded_and_published_as_the_schedulers_on_every_node_policy() {
    for label in ["dynamic", "controller", "scheduler"] {
        let (fake, devices) = dynamic_mig_cluster(label);
        assert_eq!(
            devices,
            4 * 25,
            "25 placements per GPU, no whole GPU in MIG mode"
        );
        let controller = Controller::start(&fake);
        kerf_tests::wait::eventually(
            "every device recorded and published",
            Duration::from_secs(20),
            || async {
                let owners = published_owners(&fake);
                (record(&fake).0.len() == devices && owners.iter().all(|(_, o)| o.is_some()))
                    .then_some(())
            },
        )
        .await;
        // Several ticks later nothing has moved to the controller.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let record = record(&fake);
        assert!(
            record.0.values().all(|o| *o == Owner::Scheduler),
            "{label}: {record:?}"
        );
        for (name, owner) in published_owners(&fake) {
            assert_eq!(owner, Some(Owner::Scheduler), "{label}: {name}");
        }
        controller.stop().await;
    }
}
