//! `kerf-bench NAME|all`: the benchmarks without the `kerf` CLI, e.g. for profiling.
//!
//! Options are `--key value` for the fields of [`kerf_bench::BenchOptions`]
//! (`--work-dir`, `--prepare-claims`, `--prepare-real-claims`, `--api-latency-us`, `--parallel-claims`, `--parallel-rounds`, `--nodes`,
//! `--allocate-claims`, `--seed`, `--footprint-cycles`, `--footprint-claims`,
//! `--scheduling-nodes`, `--scheduling-pods`, `--controller-nodes`, `--controller-claims`,
//! `--controller-replicas`, `--controller-settle` and `--controller-idle-window` in seconds,
//! `--controller-binary`, `--controller-arg` (repeated), `--controller-perf`).
//!
//! Multi-call: run as `nvidia-smi` or `nvidia-cuda-mps-control` (argv\[0\]), it is the fake
//! tool of `kerf-fake-gpu-tools`, which `prepare` links to it for its MPS cases.

use std::process::ExitCode;
use std::time::Duration;

use kerf_bench::{BenchOptions, Reexec};

fn main() -> ExitCode {
    // `prepare` runs this executable as the fake `nvidia-smi` and `nvidia-cuda-mps-control`
    // (and as the daemon), under their names; those runs are not benchmark runs.
    if let Some(code) = kerf_bench::gpu_tools::run_as_tool() {
        std::process::exit(code);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args) {
        Ok((name, options)) => {
            let result = kerf_bench::run_each(&name, &options, |s| print!("{}", s.report()));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kerf-bench: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(message) => {
            eprintln!("kerf-bench: {message}");
            eprintln!(
                "usage: kerf-bench NAME|all [--work-dir DIR] [--prepare-claims N] [--prepare-real-claims N] [--api-latency-us N] [--parallel-claims N] [--parallel-rounds N] [--nodes N] [--allocate-claims N] [--seed N] [--footprint-cycles N] [--footprint-claims N] [--scheduling-nodes N] [--scheduling-pods N] [--controller-nodes N] [--controller-claims N] [--controller-replicas N] [--controller-settle SECONDS] [--controller-idle-window SECONDS] [--controller-binary PATH] [--controller-arg FLAG]... [--controller-perf PREFIX]"
            );
            eprintln!("names: {}", kerf_bench::NAMES.join(", "));
            ExitCode::from(2)
        }
    }
}

fn parse(args: &[String]) -> Result<(String, BenchOptions), String> {
    let mut options = BenchOptions {
        reexec: std::env::current_exe().ok().map(|program| Reexec {
            program,
            args: Vec::new(),
        }),
        ..BenchOptions::default()
    };
    let mut name = None;
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        let Some(key) = arg.strip_prefix("--") else {
            if name.replace(arg.clone()).is_some() {
                return Err(format!("more than one benchmark name: {arg}"));
            }
            continue;
        };
        let value = rest
            .next()
            .ok_or_else(|| format!("--{key} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("--{key} {value}: {e}"))
        };
        match key {
            "work-dir" => options.work_dir = value.into(),
            "prepare-claims" => options.prepare_claims = number()?,
            "prepare-real-claims" => options.prepare_real_claims = number()?,
            "api-latency-us" => {
                let micros = value
                    .parse::<u64>()
                    .map_err(|e| format!("--{key} {value}: {e}"))?;
                options.api_latency = Duration::from_micros(micros);
            }
            "parallel-claims" => options.parallel_claims = number()?,
            "parallel-rounds" => options.parallel_rounds = number()?,
            "nodes" => options.nodes = number()?,
            "allocate-claims" => options.allocate_claims = number()?,
            "seed" => options.seed = value.parse().map_err(|e| format!("--seed {value}: {e}"))?,
            "footprint-cycles" => options.footprint_cycles = number()?,
            "footprint-claims" => options.footprint_claims = number()?,
            "scheduling-nodes" => options.scheduling_nodes = number()?,
            "scheduling-pods" => options.scheduling_pods = number()?,
            "controller-nodes" => options.controller_nodes = number()?,
            "controller-claims" => options.controller_claims = number()?,
            "controller-replicas" => options.controller_replicas = number()?,
            "controller-settle" => options.controller_settle = seconds(number()?),
            "controller-idle-window" => options.controller_idle_window = seconds(number()?),
            "controller-binary" => options.controller_binary = Some(value.into()),
            "controller-arg" => options.controller_args.push(value.into()),
            "controller-perf" => options.controller_perf = Some(value.into()),
            other => return Err(format!("unknown option --{other}")),
        }
    }
    Ok((name.ok_or("no benchmark name")?, options))
}

fn seconds(n: usize) -> Duration {
    Duration::from_secs(u64::try_from(n).unwrap_or(u64::MAX))
}
