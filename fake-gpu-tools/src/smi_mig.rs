//! The fake `nvidia-smi mig` on the emulated MIG state of [`crate::mig`]: `-lgi` and `-lci`
//! (list GPU and compute instances) and `-dci` / `-dgi` (destroy), with `-i <GPU>`,
//! `-gi <id>` and `-ci <id>` in any order.
//!
//! Output follows the tables and messages of NVIDIA's MIG user guide ("Getting Started with
//! MIG": `nvidia-smi mig -lgi`, `-lci`, "Destroying GPU Instances"): a boxed table with the
//! GPU, the profile name `MIG <name>`, profile id, instance id and `Start:Size` placement;
//! `Successfully destroyed …` lines; failures name NVML's error text and exit with
//! nvidia-smi's code for it (6 "not found", 1 otherwise). In mock mode a GPU's index is its
//! minor. Profile names are the A100-SXM4-40GB's (the GPU of the `a100-40gb-dynmig` mock
//! profile); other profile ids print as `id<N>`.

use std::fmt::Write as _;
use std::path::Path;

use crate::mig::{GpuInstance, MigError, MockMig};

/// A100-SXM4-40GB GPU-instance profiles: id, name, compute slices.
const A100_40GB_NAMES: [(u32, &str, u32); 7] = [
    (19, "1g.5gb", 1),
    (20, "1g.5gb+me", 1),
    (15, "1g.10gb", 1),
    (14, "2g.10gb", 2),
    (9, "3g.20gb", 3),
    (5, "4g.20gb", 4),
    (0, "7g.40gb", 7),
];

const GI_RULE: &str = "+-------------------------------------------------------+";
const CI_RULE: &str = "+--------------------------------------------------------------------+";

/// Runs `nvidia-smi mig <args>` on the MIG state of `root`; prints and returns the exit code.
pub(crate) fn run(root: &Path, args: &[&str]) -> i32 {
    let Some((command, options)) = args.split_first() else {
        eprintln!("kerf-fake-gpu-tools: nvidia-smi mig needs a command");
        return 2;
    };
    let Some(options) = Options::parse(options) else {
        eprintln!("kerf-fake-gpu-tools: nvidia-smi mig {args:?} is not imitated");
        return 2;
    };
    let mig = match MockMig::open(root) {
        Ok(mig) => mig,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    let result = match *command {
        "-lgi" => list(&mig, options.gpu, false),
        "-lci" => list(&mig, options.gpu, true),
        "-dci" => destroy_ci(&mig, &options),
        "-dgi" => destroy_gi(&mig, &options),
        _ => {
            eprintln!("kerf-fake-gpu-tools: nvidia-smi mig {command} is not imitated");
            return 2;
        }
    };
    match result {
        Ok(text) => {
            print!("{text}");
            0
        }
        Err((message, code)) => {
            eprintln!("{message}");
            code
        }
    }
}

#[derive(Default)]
struct Options {
    gpu: Option<u32>,
    gi: Option<u32>,
    ci: Option<u32>,
}

impl Options {
    fn parse(args: &[&str]) -> Option<Self> {
        let mut options = Options::default();
        let mut words = args.iter();
        while let Some(flag) = words.next() {
            let value: u32 = words.next()?.parse().ok()?;
            match *flag {
                "-i" => options.gpu = Some(value),
                "-gi" => options.gi = Some(value),
                "-ci" => options.ci = Some(value),
                _ => return None,
            }
        }
        Some(options)
    }
}

type Outcome = Result<String, (String, i32)>;

fn exit_code(e: &MigError) -> i32 {
    if matches!(e, MigError::NotFound(_)) {
        6
    } else {
        1
    }
}

/// NVML's text for an error, as nvidia-smi prints it after the colon.
fn nvml_text(e: &MigError) -> &'static str {
    match e {
        MigError::NotFound(_) => "Not Found",
        MigError::InUse(_) => "In use by another client",
        MigError::InsufficientResources(_) => "Insufficient Resources",
        MigError::InvalidArgument(_) => "Invalid Argument",
        MigError::Injected(_) | MigError::Io(_) => "Unknown Error",
    }
}

fn profile(id: u32) -> (String, u32) {
    A100_40GB_NAMES
        .iter()
        .find(|(known, _, _)| *known == id)
        .map_or_else(
            || (format!("id{id}"), 1),
            |(_, name, slices)| ((*name).to_owned(), *slices),
        )
}

fn instances(mig: &MockMig, gpu: Option<u32>) -> Result<Vec<(u32, GpuInstance)>, (String, i32)> {
    let failed = |e: MigError| (format!("Failed to list instances: {e}"), 1);
    let gpus = match gpu {
        Some(gpu) => vec![gpu],
        None => mig.gpus().map_err(failed)?,
    };
    let mut out = Vec::new();
    for gpu in gpus {
        out.extend(
            mig.list(gpu)
                .map_err(failed)?
                .into_iter()
                .map(|gi| (gpu, gi)),
        );
    }
    Ok(out)
}

fn list(mig: &MockMig, gpu: Option<u32>, compute: bool) -> Outcome {
    let gis = instances(mig, gpu)?;
    if compute {
        if gis.iter().all(|(_, gi)| gi.cis.is_empty()) {
            return Err(("No compute instances found: Not Found".to_owned(), 6));
        }
        Ok(compute_table(&gis))
    } else {
        if gis.is_empty() {
            return Err(("No GPU instances found: Not Found".to_owned(), 6));
        }
        Ok(gpu_instance_table(&gis))
    }
}

/// The table `nvidia-smi mig -lci` prints for `gis`.
fn compute_table(gis: &[(u32, GpuInstance)]) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "{CI_RULE}");
    let _ = writeln!(
        text,
        "| Compute instances:                                                 |"
    );
    let _ = writeln!(
        text,
        "| GPU     GPU       Name             Profile   Instance   Placement  |"
    );
    let _ = writeln!(
        text,
        "|       Instance                       ID        ID       Start:Size |"
    );
    let _ = writeln!(
        text,
        "|         ID                                                         |"
    );
    let _ = writeln!(
        text,
        "|====================================================================|"
    );
    for (gpu, gi) in gis {
        let (name, slices) = profile(gi.profile_id);
        for ci in &gi.cis {
            let row = format!(
                "{gpu:>4}  {:>5}       MIG {name:<12} {:>5}  {:>8}  {:>10}:{slices}",
                gi.gi_id, ci.profile_id, ci.ci_id, 0
            );
            let _ = writeln!(text, "|{row:<68}|");
        }
    }
    let _ = writeln!(text, "{CI_RULE}");
    text
}

/// The table `nvidia-smi mig -lgi` prints for `gis`.
fn gpu_instance_table(gis: &[(u32, GpuInstance)]) -> String {
    let mut text = String::new();
    let _ = writeln!(text, "{GI_RULE}");
    let _ = writeln!(
        text,
        "| GPU instances:                                        |"
    );
    let _ = writeln!(
        text,
        "| GPU   Name             Profile  Instance   Placement  |"
    );
    let _ = writeln!(
        text,
        "|                          ID       ID       Start:Size |"
    );
    let _ = writeln!(
        text,
        "|=======================================================|"
    );
    for (gpu, gi) in gis {
        let (name, _) = profile(gi.profile_id);
        let row = format!(
            "{gpu:>4}  MIG {name:<12} {:>6}  {:>8}  {:>10}:{}",
            gi.profile_id, gi.gi_id, gi.placement.start, gi.placement.size
        );
        let _ = writeln!(text, "|{row:<55}|");
    }
    let _ = writeln!(text, "{GI_RULE}");
    text
}

fn destroy_ci(mig: &MockMig, options: &Options) -> Outcome {
    let (Some(gpu), Some(gi), Some(ci)) = (options.gpu, options.gi, options.ci) else {
        return Err((
            "kerf-fake-gpu-tools: -dci needs -i, -gi and -ci".to_owned(),
            2,
        ));
    };
    match mig.destroy_ci(gpu, gi, ci) {
        Ok(()) => Ok(format!(
            "Successfully destroyed compute instance ID {ci:>2} from GPU {gpu:>2} GPU instance ID {gi:>2}\n"
        )),
        Err(e) => Err((
            format!(
                "Unable to destroy compute instance ID {ci:>2} from GPU {gpu:>2} GPU instance ID {gi:>2}: {}",
                nvml_text(&e)
            ),
            exit_code(&e),
        )),
    }
}

fn destroy_gi(mig: &MockMig, options: &Options) -> Outcome {
    let (Some(gpu), Some(gi)) = (options.gpu, options.gi) else {
        return Err(("kerf-fake-gpu-tools: -dgi needs -i and -gi".to_owned(), 2));
    };
    match mig.destroy_gi(gpu, gi) {
        Ok(()) => Ok(format!(
            "Successfully destroyed GPU instance ID {gi:>2} from GPU {gpu:>2}\n"
        )),
        Err(e) => Err((
            format!(
                "Unable to destroy GPU instance ID {gi:>2} from GPU {gpu:>2}: {}",
                nvml_text(&e)
            ),
            exit_code(&e),
        )),
    }
}
