//! Device taints of unhealthy devices in the published slices.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kerf_core::health::{Fault, NodeHealth, TaintPolicy};
use kerf_core::inventory::Inventory;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{DRIVER, Setup, WAIT, huge_inventory, names, setup, until};

type Taint = (String, Option<String>, String);

/// The taints of each device, in slice and device order.
fn taints(slices: &[ResourceSlice]) -> Vec<(String, Vec<Taint>)> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| {
            let taints = d
                .taints
                .iter()
                .flatten()
                .map(|t| {
                    assert!(t.time_added.is_none(), "timeAdded is the server's to set");
                    (t.key.clone(), t.value.clone(), t.effect.clone())
                })
                .collect();
            (d.name.clone(), taints)
        })
        .collect()
}

/// The taints every device should have when GPU `faulty` has `value`/`effect`.
fn expected(inventory: &Inventory, faulty: &str, taint: Option<(&str, &str)>) -> Vec<String> {
    let mut want: Vec<String> = inventory
        .devices()
        .filter(|d| taint.is_some() && d.gpu().uuid == faulty)
        .map(|d| {
            let (value, effect) = taint.unwrap_or_default();
            format!("{} {DRIVER}/unhealthy={value}:{effect}", d.name())
        })
        .collect();
    want.sort();
    want
}

fn tainted(s: &Setup) -> Vec<String> {
    let mut seen: Vec<String> = taints(&s.slices())
        .into_iter()
        .flat_map(|(device, taints)| {
            taints.into_iter().map(move |(key, value, effect)| {
                format!("{device} {key}={}:{effect}", value.unwrap_or_default())
            })
        })
        .collect();
    seen.sort();
    seen
}

fn faulty(uuid: &str, faults: Vec<Fault>) -> NodeHealth {
    let mut health = NodeHealth::default();
    health.set_faults(uuid, faults);
    health
}

#[tokio::test]
async fn a_faulty_gpu_and_its_mig_devices_are_tainted_until_it_recovers() {
    let s = setup();
    let inventory = kerf_core::mock::from_spec("a100-40gb-mig:2").unwrap();
    let gpu = inventory.gpus[0].uuid.clone();
    assert!(
        inventory.devices().filter(|d| d.gpu().uuid == gpu).count() > 1,
        "the first GPU has MIG devices"
    );
    let (sender, receiver) = watch::channel(NodeHealth::default());
    let shutdown = CancellationToken::new();
    let publisher = s
        .publisher()
        .with_device_taints(receiver, TaintPolicy::default());
    let task = tokio::spawn(publisher.run(
        Arc::new(inventory.clone()),
        Duration::from_secs(3600),
        shutdown.clone(),
    ));
    until("the slices are published", WAIT, || !s.slices().is_empty()).await;
    assert!(tainted(&s).is_empty());

    sender.send_replace(faulty(&gpu, vec![Fault::Xid { code: 61 }]));
    let want = expected(&inventory, &gpu, Some(("xid-61", "NoSchedule")));
    until("XID 61 taints NoSchedule", WAIT, || tainted(&s) == want).await;

    // A fatal fault: NoExecute, with the worst fault's reason.
    sender.send_replace(faulty(&gpu, vec![Fault::Xid { code: 61 }, Fault::GpuLost]));
    let want = expected(&inventory, &gpu, Some(("gpu-lost", "NoExecute")));
    until("a lost GPU taints NoExecute", WAIT, || tainted(&s) == want).await;

    // Throttling alone is no reason for a taint.
    sender.send_replace(faulty(&gpu, vec![Fault::ThermalThrottle]));
    until("the taints are gone", WAIT, || tainted(&s).is_empty()).await;
    super::stop_run(&shutdown, task).await;
}

#[tokio::test]
async fn with_taints_slices_hold_64_devices_and_a_taint_does_not_rechunk() {
    let s = setup();
    let inventory = huge_inventory(130);
    let (sender, receiver) = watch::channel(NodeHealth::default());
    let publisher = s
        .publisher()
        .with_device_taints(receiver, TaintPolicy::default());
    publisher.publish(&inventory).await.unwrap();
    let before = s.slices();
    let counts = |slices: &[ResourceSlice]| -> Vec<usize> {
        let mut counts: Vec<usize> = slices
            .iter()
            .map(|s| s.spec.devices.as_deref().unwrap_or_default().len())
            .collect();
        counts.sort_unstable();
        counts
    };
    assert_eq!(counts(&before), [2, 64, 64]);

    let uuid = inventory.gpus[100].uuid.clone();
    sender.send_replace(faulty(&uuid, vec![Fault::EccUncorrected]));
    publisher.publish(&inventory).await.unwrap();
    let after = s.slices();
    assert_eq!(names(&after), names(&before));
    assert_eq!(counts(&after), [2, 64, 64]);
    assert_eq!(
        tainted(&s),
        [format!(
            "gpu-100 {DRIVER}/unhealthy=ecc-uncorrected:NoExecute"
        )]
    );
    let generation = after[0].spec.pool.generation;
    assert!(after.iter().all(|s| s.spec.pool.generation == generation));
    assert!(generation > before[0].spec.pool.generation);

    // Without taints the pool is cut at 128, as before.
    let plain = setup();
    plain.publisher().publish(&inventory).await.unwrap();
    assert_eq!(counts(&plain.slices()), [2, 128]);
}
