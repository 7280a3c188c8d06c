//! Benchmarks of kerf-api's share of the hot paths: decoding what the controller wrote into
//! a claim (every prepare) and writing an allocation (every controller decision).

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to measure.

use divan::{Bencher, black_box};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kerf_core::alloc::{ClaimPlacement, PlacedDevice, SliceSize};
use kerf_core::enforcement::Enforcement;
use kerf_core::sharing::Sharing;

fn main() {
    divan::main();
}

const DRIVER: &str = "gpu.kerf.dev";
const GI: u64 = 1 << 30;

fn placement(devices: u32) -> ClaimPlacement {
    ClaimPlacement {
        key: "7f3c9a2e-5b1d-4c8e-9f0a-1b2c3d4e5f60".into(),
        devices: (0..devices)
            .map(|i| PlacedDevice {
                request: "gpu".into(),
                device: format!("gpu-{i}"),
                gpu_uuid: format!("GPU-8d4b4a36-1c2d-4e5f-9a0b-00000000000{i}"),
                slice: Some(SliceSize {
                    memory_bytes: 10 * GI,
                    compute_percent: 25,
                }),
                sharing: Sharing::Mps,
                time_slice_interval: None,
                enforcement: Enforcement::default(),
            })
            .collect(),
    }
}

fn time() -> Time {
    Time(Timestamp::from_second(1_800_000_000).unwrap())
}

#[divan::bench(args = [1, 8])]
fn allocation_status(bencher: Bencher, devices: u32) {
    let placement = placement(devices);
    bencher.bench_local(|| {
        kerf_api::allocation_status(black_box(&placement), "node-1", DRIVER, time())
    });
}

#[divan::bench(args = [1, 8])]
fn resolve_allocation(bencher: Bencher, devices: u32) {
    let allocation =
        kerf_api::allocation_status(&placement(devices), "node-1", DRIVER, time()).unwrap();
    let claim = ResourceClaim {
        metadata: ObjectMeta {
            name: Some("train".into()),
            namespace: Some("team-a".into()),
            uid: Some("7f3c9a2e-5b1d-4c8e-9f0a-1b2c3d4e5f60".into()),
            ..ObjectMeta::default()
        },
        spec: k8s_openapi::api::resource::v1::ResourceClaimSpec::default(),
        status: Some(ResourceClaimStatus {
            allocation: Some(allocation),
            ..ResourceClaimStatus::default()
        }),
    };
    bencher.bench_local(|| kerf_api::resolve_allocation(black_box(&claim), DRIVER));
}
