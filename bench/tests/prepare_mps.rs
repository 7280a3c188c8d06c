//! The `prepare` benchmark's MPS cases through the `kerf-bench` binary, which is also the
//! program behind the fake GPU tools (multi-call), and the guard that no daemon outlives a
//! benchmark that stops half-way.

use std::path::Path;
use std::process::Command;

use kerf_bench::gpu_tools::FakeGpuTools;

const BENCH: &str = env!("CARGO_BIN_EXE_kerf-bench");
const GPU: &str = "GPU-00000000-0000-0000-0000-000000000001";

/// The processes whose program lies under `dir`.
fn processes_under(dir: &Path) -> Vec<String> {
    let dir = dir.to_string_lossy();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|cmdline| String::from_utf8_lossy(&cmdline).replace('\0', " "))
        .filter(|args| args.starts_with(&*dir))
        .collect()
}

#[test]
fn a_small_prepare_run_measures_both_mps_cases_and_leaves_no_daemon() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let output = Command::new(BENCH)
        .args(["prepare", "--prepare-claims", "8", "--work-dir"])
        .arg(work.path())
        // The running executable, not a program named in the caller's environment.
        .env_remove(kerf_bench::gpu_tools::PROGRAM_ENV)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = stdout.lines().last().unwrap_or_default();
    // 8 mock H100: one round of first slices, then 8 later ones.
    for figure in [
        "claims=8 ",
        "mps_first_claims=8 ",
        "mps_first_ratio_p50=",
        "mps_tools_p50_ms=",
        "mps_later_claims=8 ",
        "mps_later_ratio_p99=",
    ] {
        assert!(summary.contains(figure), "{figure} missing from {summary}");
    }
    assert_eq!(processes_under(work.path()), Vec::<String>::new());
}

#[test]
fn dropping_the_tools_kills_the_daemons_they_left() {
    let dir = tempfile::tempdir().unwrap();
    let tools = FakeGpuTools::install(&dir.path().join("tools"), Path::new(BENCH)).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(tools.check(GPU)).unwrap();
    runtime.block_on(tools.start_direct(GPU)).unwrap();
    assert_eq!(tools.processes().len(), 1, "the daemon runs");
    drop(tools);
    assert_eq!(processes_under(dir.path()), Vec::<String>::new());
}
