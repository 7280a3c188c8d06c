//! Driver root discovery on fake roots built in a temporary directory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Test helpers may fail loudly.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use kerf_core::driver_root::{self, DriverFile};

fn file(root: &Path, rel: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, rel.as_bytes()).unwrap();
}

fn link(root: &Path, rel: &str, target: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    symlink(target, p).unwrap();
}

/// A driver root laid out like a Debian host (merged /usr) with a 570 driver.
fn fake_root() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path();
    let lib = "usr/lib/x86_64-linux-gnu";
    file(r, &format!("{lib}/libcuda.so.570.124.06"));
    link(r, &format!("{lib}/libcuda.so.1"), "libcuda.so.570.124.06");
    link(r, &format!("{lib}/libcuda.so"), "libcuda.so.1");
    file(r, &format!("{lib}/libnvidia-ml.so.570.124.06"));
    link(
        r,
        &format!("{lib}/libnvidia-ml.so.1"),
        "libnvidia-ml.so.570.124.06",
    );
    file(r, &format!("{lib}/libcudadebugger.so.570.124.06"));
    // An absolute link: resolved inside the root, not on the host running the test.
    file(r, &format!("{lib}/libnvidia-gpucomp.so.570.124.06"));
    link(
        r,
        &format!("{lib}/libnvidia-gpucomp.so.1"),
        &format!("/{lib}/libnvidia-gpucomp.so.570.124.06"),
    );
    // Not driver files, or not usable.
    file(r, &format!("{lib}/libcudart.so.12"));
    file(r, &format!("{lib}/libnvidia-mlx.so.1"));
    file(r, &format!("{lib}/libcuda.sox"));
    link(
        r,
        &format!("{lib}/libnvidia-ptxjitcompiler.so.1"),
        "libnvidia-ptxjitcompiler.so.570.124.06",
    );
    fs::create_dir_all(r.join(format!("{lib}/libnvidia-cfg.so.1"))).unwrap();
    // A second library directory and merged-/usr aliases that must not duplicate anything.
    file(r, "usr/lib64/libnvidia-opencl.so.1");
    link(r, "lib64", "/usr/lib64");
    link(r, "lib", "usr/lib");
    file(r, "usr/bin/nvidia-smi");
    file(r, "usr/bin/nvidia-cuda-mps-control");
    link(
        r,
        "usr/bin/nvidia-cuda-mps-server",
        "../../opt/nvidia/mps-server",
    );
    file(r, "opt/nvidia/mps-server");
    file(r, "usr/bin/nvidia-settings");
    link(r, "bin", "usr/bin");
    tmp
}

fn rel(files: &[DriverFile], root: &Path) -> Vec<(String, String)> {
    files
        .iter()
        .map(|f| {
            let host = f
                .host_path
                .strip_prefix(root)
                .unwrap_or_else(|_| panic!("{} outside root", f.host_path.display()));
            (
                f.container_path.display().to_string(),
                host.display().to_string(),
            )
        })
        .collect()
}

#[test]
fn finds_libraries_and_binaries_with_symlinks_resolved_inside_the_root() {
    let tmp = fake_root();
    let root = tmp.path();
    let found = driver_root::discover(root).unwrap();
    let lib = "usr/lib/x86_64-linux-gnu";
    let want_libs: Vec<(String, String)> = [
        ("libcuda.so", "libcuda.so.570.124.06"),
        ("libcuda.so.1", "libcuda.so.570.124.06"),
        ("libcuda.so.570.124.06", "libcuda.so.570.124.06"),
        (
            "libcudadebugger.so.570.124.06",
            "libcudadebugger.so.570.124.06",
        ),
        ("libnvidia-gpucomp.so.1", "libnvidia-gpucomp.so.570.124.06"),
        (
            "libnvidia-gpucomp.so.570.124.06",
            "libnvidia-gpucomp.so.570.124.06",
        ),
        ("libnvidia-ml.so.1", "libnvidia-ml.so.570.124.06"),
        ("libnvidia-ml.so.570.124.06", "libnvidia-ml.so.570.124.06"),
    ]
    .iter()
    .map(|(c, h)| (format!("/{lib}/{c}"), format!("{lib}/{h}")))
    .chain([(
        "/usr/lib64/libnvidia-opencl.so.1".into(),
        "usr/lib64/libnvidia-opencl.so.1".into(),
    )])
    .collect();
    assert_eq!(rel(&found.libraries, root), want_libs);
    let want_bins: Vec<(String, String)> = vec![
        (
            "/usr/bin/nvidia-cuda-mps-control".into(),
            "usr/bin/nvidia-cuda-mps-control".into(),
        ),
        (
            "/usr/bin/nvidia-cuda-mps-server".into(),
            "opt/nvidia/mps-server".into(),
        ),
        ("/usr/bin/nvidia-smi".into(), "usr/bin/nvidia-smi".into()),
    ];
    assert_eq!(rel(&found.binaries, root), want_bins);
    assert_eq!(found.root, root);
    assert_eq!(driver_root::discover(root).unwrap(), found, "deterministic");
}

#[test]
fn mounts_are_read_only_binds_without_type() {
    let tmp = fake_root();
    let found = driver_root::discover(tmp.path()).unwrap();
    let mounts = found.mounts();
    assert_eq!(mounts.len(), found.libraries.len() + found.binaries.len());
    let first = &mounts[0];
    assert_eq!(first.container_path, "/usr/lib/x86_64-linux-gnu/libcuda.so");
    assert_eq!(
        PathBuf::from(&first.host_path),
        tmp.path()
            .join("usr/lib/x86_64-linux-gnu/libcuda.so.570.124.06")
    );
    for m in &mounts {
        assert_eq!(m.options, ["ro", "nosuid", "nodev", "bind"]);
        assert_eq!(m.fs_type, None);
        assert!(m.container_path.starts_with('/'));
    }
    assert_eq!(mounts.last().unwrap().container_path, "/usr/bin/nvidia-smi");
}

#[test]
fn empty_root_and_odd_layouts_are_fine() {
    let tmp = tempfile::tempdir().unwrap();
    let found = driver_root::discover(tmp.path()).unwrap();
    assert!(found.is_empty());
    assert!(found.mounts().is_empty());
    // A search "directory" that is a file, and a symlink loop, are skipped.
    file(tmp.path(), "usr/lib64");
    link(tmp.path(), "lib64", "lib64");
    file(tmp.path(), "bin/nvidia-smi");
    let found = driver_root::discover(tmp.path()).unwrap();
    assert!(found.libraries.is_empty());
    assert_eq!(found.binaries.len(), 1);
    assert_eq!(
        found.binaries[0].container_path,
        Path::new("/bin/nvidia-smi")
    );
}

#[test]
fn missing_or_non_directory_root_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing");
    let e = driver_root::discover(&missing).unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
    file(tmp.path(), "plain");
    assert!(driver_root::discover(&tmp.path().join("plain")).is_err());
}
