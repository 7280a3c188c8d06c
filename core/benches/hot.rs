//! Benchmarks of kerf-core's share of the prepare hot path: CDI spec generation and
//! encoding (the reference path and the reusable encoder), checkpoint encoding, and the
//! atomic write against its floor (one plain fsync'd write of the same bytes).
//!
//! File benchmarks write under Cargo's target tmpdir rather than `/tmp`, which is often a
//! tmpfs where fsync costs nothing.

#![allow(clippy::panic)] // A benchmark that cannot set up has nothing to measure.

use std::fs::File;
use std::io::Write;

use divan::{Bencher, black_box};
use kerf_core::cdi::{
    self, ClaimSpecRequest, CommonEdits, DeviceNodePolicy, MigCaps, Mount, PreparedDevice,
    READ_ONLY_BIND,
};
use kerf_core::checkpoint::{self, Checkpoint, ClaimEntry, ClaimState, DeviceRecord};
use kerf_core::sharing::{Sharing, SliceLimits};

fn main() {
    divan::main();
}

const UID: &str = "7f3c9a2e-5b1d-4c8e-9f0a-1b2c3d4e5f60";
const KIND: &str = "k8s.gpu.kerf.dev/gpu";

fn devices(n: u32) -> Vec<PreparedDevice> {
    (0..n)
        .map(|i| PreparedDevice {
            name: format!("gpu-{i}"),
            uuid: format!("GPU-8d4b4a36-1c2d-4e5f-9a0b-00000000000{i}"),
            gpu_minor: i,
            mig: (i % 2 == 1).then_some(MigCaps {
                gi_cap_minor: 10 + i,
                ci_cap_minor: 20 + i,
                caps_major: None,
            }),
            limits: SliceLimits {
                memory_bytes: Some(10 << 30),
                compute_percent: Some(25),
            },
            sharing: Sharing::Mps,
            mps: None,
        })
        .collect()
}

/// About as many driver files as a real 570 driver root yields.
fn common() -> CommonEdits {
    let mounts = (0..24)
        .map(|i| Mount {
            host_path: format!(
                "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-{i}.so.570.124.06"
            ),
            container_path: format!("/usr/lib/x86_64-linux-gnu/libnvidia-{i}.so.570.124.06"),
            options: READ_ONLY_BIND.iter().map(|&o| o.to_owned()).collect(),
            fs_type: None,
        })
        .collect();
    CommonEdits::nvidia(mounts)
}

fn request<'a>(devices: &'a [PreparedDevice], common: &'a CommonEdits) -> ClaimSpecRequest<'a> {
    ClaimSpecRequest {
        kind: KIND,
        claim_uid: UID,
        claim_namespace: "team-a",
        claim_name: "train",
        devices,
        common,
    }
}

#[divan::bench(args = [1, 8])]
fn cdi_generate(bencher: Bencher, n: u32) {
    let (devices, common) = (devices(n), common());
    let policy = DeviceNodePolicy::real();
    bencher.bench_local(|| cdi::generate(black_box(&request(&devices, &common)), &policy));
}

#[divan::bench(args = [1, 8])]
fn cdi_generate_and_encode(bencher: Bencher, n: u32) {
    let (devices, common) = (devices(n), common());
    let policy = DeviceNodePolicy::real();
    bencher.bench_local(|| {
        let generated = cdi::generate(black_box(&request(&devices, &common)), &policy)?;
        cdi::encode_spec(&generated.spec)
    });
}

/// The same claims through a [`cdi::SpecEncoder`] built once, as the plugin holds one.
#[divan::bench(args = [1, 8])]
fn cdi_encoder(bencher: Bencher, n: u32) {
    let (devices, common) = (devices(n), common());
    let encoder = match cdi::SpecEncoder::new(KIND, &common, &DeviceNodePolicy::real()) {
        Ok(encoder) => encoder,
        Err(e) => panic!("cannot build the spec encoder: {e}"),
    };
    let request = request(&devices, &common);
    bencher.bench_local(|| encoder.encode(black_box(&request.claim())));
}

fn checkpoint_with(claims: u32) -> Checkpoint {
    let mut cp = Checkpoint {
        boot_id: "0d3f7c8e-8f0a-4b1c-9d2e-3f4a5b6c7d8e".into(),
        ..Checkpoint::default()
    };
    for c in 0..claims {
        let uid = format!("{c:08x}-5b1d-4c8e-9f0a-1b2c3d4e5f60");
        let devices = devices(1)
            .into_iter()
            .map(|d| DeviceRecord {
                request_names: vec!["gpu".into()],
                request_refs: vec!["gpu".into()],
                pool_name: "node-1".into(),
                cdi_device_ids: vec![cdi::qualified_name(
                    KIND,
                    &cdi::claim_device_name(&uid, &d.name),
                )],
                device_name: d.name,
                share_id: None,
                admin_access: false,
                uuid: d.uuid,
                gpu_minor: d.gpu_minor,
                mig: d.mig,
                mig_instance: None,
                limits: d.limits,
                sharing: d.sharing,
                time_slice_interval: kerf_core::mps::TimeSliceInterval::Default,
            })
            .collect();
        let entry = ClaimEntry {
            namespace: "team-a".into(),
            name: format!("claim-{c}"),
            pod_claim_name: None,
            state: ClaimState::PrepareCompleted,
            devices,
        };
        cp.claims.insert(uid, entry);
    }
    cp
}

#[divan::bench(args = [1, 16, 128])]
fn checkpoint_encode(bencher: Bencher, claims: u32) {
    let cp = checkpoint_with(claims);
    bencher.bench_local(|| checkpoint::encode(black_box(&cp)));
}

#[divan::bench(args = [16, 128])]
fn checkpoint_decode(bencher: Bencher, claims: u32) {
    let bytes = checkpoint::encode(&checkpoint_with(claims)).unwrap_or_default();
    bencher.bench_local(|| checkpoint::decode(black_box(&bytes)));
}

fn spec_bytes() -> Vec<u8> {
    let (devices, common) = (devices(1), common());
    cdi::generate(&request(&devices, &common), &DeviceNodePolicy::real())
        .and_then(|g| cdi::encode_spec(&g.spec))
        .unwrap_or_default()
}

fn bench_dir() -> tempfile::TempDir {
    match tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")) {
        Ok(dir) => dir,
        Err(e) => panic!("cannot create a benchmark directory: {e}"),
    }
}

/// The floor: one create + write + fdatasync of the same bytes, no rename, no directory sync.
#[divan::bench(sample_count = 30, sample_size = 5)]
fn write_plain_fsync(bencher: Bencher) {
    let (dir, bytes) = (bench_dir(), spec_bytes());
    let path = dir.path().join("plain.json");
    bencher.bench_local(|| -> std::io::Result<()> {
        let mut f = File::create(&path)?;
        f.write_all(&bytes)?;
        f.sync_data()
    });
}

#[divan::bench(sample_count = 30, sample_size = 5)]
fn write_atomic(bencher: Bencher) {
    let (dir, bytes) = (bench_dir(), spec_bytes());
    bencher.bench_local(|| {
        kerf_core::fsutil::write_atomic(dir.path(), "atomic.json", black_box(&bytes))
    });
}
