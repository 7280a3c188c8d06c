//! `controller-footprint` end to end at CI size: the real kerf-controller binary (two
//! replicas, leader election, webhooks over HTTPS) against the in-memory API server, 10 nodes
//! and 20 pods. Asserts the structure of the result (every pod bound, every figure there),
//! never its speed.
//!
//! The binary: kerf-controller is another package's, and Cargo tells a package's tests only
//! its own binaries (`CARGO_BIN_EXE_*`). `cargo test --workspace` builds every package's
//! binaries for their integration tests (kerf-controller has some) into the same
//! `target/<profile>/` before any test runs, which `.ci/image`'s dev profile relies on too; so
//! this test takes the `kerf-controller` beside its own `deps/` directory
//! (`kerf_bench::controller_footprint::default_binary`), or the one `KERF_CONTROLLER_BINARY`
//! names. Run alone (`cargo test -p kerf-bench`), it needs `cargo build -p kerf-controller`
//! first, and says so.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "helpers outside #[test] functions fail the test the same way"
)]

use std::path::PathBuf;
use std::time::Duration;

use kerf_bench::BenchOptions;

fn binary() -> PathBuf {
    let binary = std::env::var_os("KERF_CONTROLLER_BINARY")
        .map(PathBuf::from)
        .or_else(kerf_bench::controller_footprint::default_binary)
        .unwrap();
    assert!(
        binary.is_file(),
        "no kerf-controller at {}: run `cargo build -p kerf-controller` (cargo test --workspace builds it), or set KERF_CONTROLLER_BINARY",
        binary.display()
    );
    binary
}

#[test]
fn a_small_run_binds_every_pod_and_reports_cpu_and_memory_of_both_replicas() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let options = BenchOptions {
        work_dir: work.path().to_owned(),
        controller_nodes: 10,
        controller_claims: 20,
        controller_settle: Duration::from_secs(1),
        controller_idle_window: Duration::from_secs(2),
        controller_binary: Some(binary()),
        // The fence after the slices are first seen: 1 s instead of 10 s, to keep the test short.
        controller_args: vec!["--ownership-settle-period=1s".into()],
        ..BenchOptions::default()
    };
    let summaries = kerf_bench::run("controller-footprint", &options).unwrap();
    let summary = &summaries[0];
    let line = summary.to_string();
    assert!(line.starts_with("bench controller-footprint "), "{line}");
    assert_eq!(summary.get("nodes"), Some("10"), "{line}");
    assert_eq!(summary.get("pods"), Some("20"), "{line}");
    assert_eq!(summary.get("bound"), Some("20"), "{line}");
    assert_eq!(summary.get("replicas"), Some("2"), "{line}");
    for key in [
        "pods_per_s",
        "cpu_ms_per_pod",
        "cpu_ms_per_pod_above_idle",
        "idle_cpu_pct",
        "rss_mib",
        "peak_rss_mib",
        "standby_cpu_ms_per_pod",
        "standby_idle_cpu_pct",
        "standby_rss_mib",
        "api_requests_per_pod",
        "idle_api_requests_per_s",
    ] {
        let value: f64 = summary
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing from {line}"))
            .parse()
            .unwrap_or_else(|e| panic!("{key} is not a number in {line}: {e}"));
        assert!(value >= 0.0, "{key} in {line}");
    }
    // A running process has resident memory and used CPU to allocate 20 claims.
    let rss: f64 = summary.get("rss_mib").unwrap().parse().unwrap();
    assert!(rss > 1.0, "{line}");
    let cpu: f64 = summary.get("cpu_ms_per_pod").unwrap().parse().unwrap();
    assert!(cpu > 0.0, "{line}");
    for target in ["idle_cpu_target", "rss_target"] {
        assert!(
            matches!(summary.get(target), Some("met" | "missed")),
            "{target} in {line}"
        );
    }
    // Each replica wrote its log where the report says.
    let logs = work.path().join("controller-footprint");
    assert!(logs.join("kerf-controller-0.log").is_file());
    assert!(logs.join("kerf-controller-1.log").is_file());
}

#[test]
fn a_missing_binary_is_named_in_the_error() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let missing = work.path().join("no-such-dir/kerf-controller");
    let options = BenchOptions {
        work_dir: work.path().to_owned(),
        controller_nodes: 1,
        controller_claims: 1,
        controller_binary: Some(missing.clone()),
        ..BenchOptions::default()
    };
    let err = kerf_bench::run("controller-footprint", &options).unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
}
