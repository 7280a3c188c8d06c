//! `kerf-bench NAME|all [OPTIONS]`: kerf's benchmarks (`kerf-bench --help` lists the options,
//! [`kerf_bench::BenchArgs`] defines them). They live in their own binary, not in the `kerf`
//! CLI users install, because they run on the test harness (the in-memory API server, the
//! fake kubelet and the kube-scheduler stand-in of `kerf-tests`).
//!
//! Multi-call: run as `nvidia-smi` or `nvidia-cuda-mps-control` (argv\[0\]), it is the fake
//! tool of `kerf-fake-gpu-tools`, which `prepare` links to it for its MPS cases.

use std::process::ExitCode;

use clap::Parser;
use kerf_bench::{BenchArgs, Reexec};

/// kerf's benchmarks (build with --release): each prints its figures and one
/// `bench NAME key=value …` line.
#[derive(Debug, Parser)]
#[command(name = "kerf-bench", version, about)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn main() -> ExitCode {
    // `prepare` runs this executable as the fake `nvidia-smi` and `nvidia-cuda-mps-control`
    // (and as the daemon), under their names; those runs are not benchmark runs.
    if let Some(code) = kerf_bench::gpu_tools::run_as_tool() {
        std::process::exit(code);
    }
    let args = Cli::parse().bench;
    // The footprint's fresh child processes are this executable again, with the same flags.
    let reexec = std::env::current_exe().ok().map(|program| Reexec {
        program,
        args: Vec::new(),
    });
    match kerf_bench::run_each(&args.name, &args.options(reexec), |s| {
        print!("{}", s.report());
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kerf-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
