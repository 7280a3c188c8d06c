//! The emulated MIG state and the fake `nvidia-smi mig` on it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests may fail loudly.

use std::path::Path;
use std::process::Command;

use kerf_fake_gpu_tools::mig::{self, GpuInstancePlacement, MigError, MockMig};

fn at(start: u32, size: u32) -> GpuInstancePlacement {
    GpuInstancePlacement { start, size }
}

#[test]
fn instances_are_created_listed_and_destroyed_with_nvml_errors() {
    let root = tempfile::tempdir().unwrap();
    let mig = MockMig::open(root.path()).unwrap();
    let gi = mig.create_gi(0, 9, at(0, 4)).unwrap();
    assert_eq!(gi, 1, "lowest free id from 1");
    let err = mig.create_gi(0, 19, at(3, 1)).unwrap_err();
    assert!(matches!(err, MigError::InsufficientResources(_)), "{err}");
    assert_eq!(err.nvml_name(), "ERROR_INSUFFICIENT_RESOURCES");
    assert!(matches!(
        mig.create_gi(0, 19, at(7, 2)),
        Err(MigError::InvalidArgument(_))
    ));
    let (ci, uuid) = mig.create_ci(0, gi, 2).unwrap();
    assert_eq!(ci, 0);
    assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
    assert!(matches!(mig.create_ci(0, 5, 0), Err(MigError::NotFound(_))));
    assert!(matches!(mig.destroy_gi(0, gi), Err(MigError::InUse(_))));
    let listed = mig.list(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].placement, listed[0].cis[0].uuid.clone()),
        (at(0, 4), uuid.clone())
    );
    mig.destroy_ci(0, gi, ci).unwrap();
    assert!(matches!(
        mig.destroy_ci(0, gi, ci),
        Err(MigError::NotFound(_))
    ));
    mig.destroy_gi(0, gi).unwrap();
    assert!(matches!(mig.destroy_gi(0, gi), Err(MigError::NotFound(_))));
    assert!(mig.list(0).unwrap().is_empty());
    // Recreated: the id comes back, the UUID does not.
    let again = mig.create_gi(0, 9, at(0, 4)).unwrap();
    let (_, uuid2) = mig.create_ci(0, again, 2).unwrap();
    assert_eq!(again, gi);
    assert_ne!(uuid2, uuid);
}

#[test]
fn the_state_is_shared_between_handles_and_survives_reopening() {
    let root = tempfile::tempdir().unwrap();
    let one = MockMig::open(root.path()).unwrap();
    let two = MockMig::open(root.path()).unwrap();
    one.create_gi(2, 19, at(6, 1)).unwrap();
    assert_eq!(two.list(2).unwrap().len(), 1);
    assert_eq!(two.gpus().unwrap(), [2]);
    let text = std::fs::read_to_string(root.path().join("kerf-fake-tools/mig-state.json")).unwrap();
    assert!(text.contains("\"profileId\": 19"), "{text}");
}

#[test]
fn concurrent_creators_never_get_overlapping_instances() {
    let root = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..7)
        .map(|start| {
            let root = root.path().to_path_buf();
            std::thread::spawn(move || {
                let mig = MockMig::open(&root).unwrap();
                // Every thread also tries the whole GPU: at most one of all these succeeds
                // unless nothing else is there.
                let small = mig.create_gi(1, 19, at(start, 1)).is_ok();
                let whole = mig.create_gi(1, 0, at(0, 8)).is_ok();
                (small, whole)
            })
        })
        .collect();
    let results: Vec<(bool, bool)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let gis = MockMig::open(root.path()).unwrap().list(1).unwrap();
    for (i, a) in gis.iter().enumerate() {
        for b in &gis[i + 1..] {
            let overlap = a.placement.start < b.placement.start + b.placement.size
                && b.placement.start < a.placement.start + a.placement.size;
            assert!(!overlap, "{a:?} {b:?}");
        }
    }
    let created = results
        .iter()
        .map(|(s, w)| usize::from(*s) + usize::from(*w))
        .sum::<usize>();
    assert_eq!(created, gis.len());
}

#[test]
fn an_injected_failure_fails_the_next_create_once() {
    let root = tempfile::tempdir().unwrap();
    let mig = MockMig::open(root.path()).unwrap();
    mig::fail_next_mig(root.path(), "GPU is lost\n").unwrap();
    match mig.create_gi(0, 19, at(0, 1)) {
        Err(MigError::Injected(message)) => assert_eq!(message, "GPU is lost"),
        other => panic!("{other:?}"),
    }
    assert!(mig.list(0).unwrap().is_empty());
    let gi = mig.create_gi(0, 19, at(0, 1)).unwrap();
    mig::fail_next_mig(root.path(), "boom").unwrap();
    assert!(matches!(
        mig.create_ci(0, gi, 0),
        Err(MigError::Injected(_))
    ));
    assert!(mig.create_ci(0, gi, 0).is_ok());
}

/// What kerf's mig-minors parser (`kubelet-plugin/src/discovery/facts.rs` `MigMinors::parse`)
/// reads: `gpu<N>/gi<G>/access <minor>` and `gpu<N>/gi<G>/ci<C>/access <minor>` lines.
#[test]
fn proc_files_carry_the_capability_table_and_the_caps_major() {
    let root = tempfile::tempdir().unwrap();
    let mig = MockMig::open(root.path()).unwrap();
    mig.create_gi(0, 19, at(0, 1)).unwrap();
    let table =
        std::fs::read_to_string(root.path().join("proc/driver/nvidia-caps/mig-minors")).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[..2], ["config 1", "monitor 2"]);
    assert!(lines.contains(&"gpu0/gi1/access 12"));
    assert!(lines.contains(&"gpu0/gi1/ci0/access 13"));
    assert!(lines.contains(&"gpu3/gi3/ci3/access 439"));
    assert!(lines.contains(&"gpu6/gi11/ci7/access 920"));
    assert_eq!(lines.last(), Some(&"gpu31/gi14/ci7/access 4322"));
    let devices = std::fs::read_to_string(root.path().join("proc/devices")).unwrap();
    assert!(
        devices
            .lines()
            .any(|l| l.trim() == format!("{} nvidia-caps", mig::CAPS_MAJOR)),
        "{devices}"
    );
}

fn smi(root: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(root.join("usr/bin/nvidia-smi"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn nvidia_smi_mig_lists_and_destroys() {
    let root = tempfile::tempdir().unwrap();
    kerf_fake_gpu_tools::install(
        root.path(),
        Path::new(env!("CARGO_BIN_EXE_kerf-fake-gpu-tools")),
    )
    .unwrap();
    let (code, _, err) = smi(root.path(), &["mig", "-lgi"]);
    assert_eq!((code, err.trim()), (6, "No GPU instances found: Not Found"));
    let mig = MockMig::open(root.path()).unwrap();
    let gi = mig.create_gi(0, 9, at(4, 4)).unwrap();
    let (ci, _) = mig.create_ci(0, gi, 2).unwrap();

    let (code, out, _) = smi(root.path(), &["mig", "-lgi", "-i", "0"]);
    assert_eq!(code, 0);
    assert!(out.contains("| GPU instances:"), "{out}");
    let row = out.lines().find(|l| l.contains("MIG 3g.20gb")).unwrap();
    let cells: Vec<&str> = row.trim_matches('|').split_whitespace().collect();
    assert_eq!(cells, ["0", "MIG", "3g.20gb", "9", "1", "4:4"], "{out}");
    let (code, out, _) = smi(root.path(), &["mig", "-lci"]);
    assert_eq!(code, 0);
    let row = out.lines().find(|l| l.contains("MIG 3g.20gb")).unwrap();
    let cells: Vec<&str> = row.trim_matches('|').split_whitespace().collect();
    assert_eq!(
        cells,
        ["0", "1", "MIG", "3g.20gb", "2", "0", "0:3"],
        "{out}"
    );

    let (code, _, err) = smi(root.path(), &["mig", "-dgi", "-gi", "1", "-i", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("In use by another client"), "{err}");
    let (code, out, _) = smi(
        root.path(),
        &["mig", "-dci", "-ci", &ci.to_string(), "-gi", "1", "-i", "0"],
    );
    assert_eq!(code, 0);
    assert_eq!(
        out.trim(),
        "Successfully destroyed compute instance ID  0 from GPU  0 GPU instance ID  1"
    );
    let (code, out, _) = smi(root.path(), &["mig", "-dgi", "-gi", "1", "-i", "0"]);
    assert_eq!(
        (code, out.trim()),
        (0, "Successfully destroyed GPU instance ID  1 from GPU  0")
    );
    assert!(mig.list(0).unwrap().is_empty());
    let (code, _, err) = smi(root.path(), &["mig", "-dgi", "-gi", "1", "-i", "0"]);
    assert_eq!(code, 6, "{err}");
    let (code, _, _) = smi(root.path(), &["mig", "-cgi", "9"]);
    assert_eq!(code, 2, "not imitated");
    // Every run is in the call log.
    assert!(
        kerf_fake_gpu_tools::calls(root.path())
            .iter()
            .any(|c| c.args.first().is_some_and(|a| a == "mig"))
    );
}
