//! Writes kerf's CRD manifests to `deploy/helm/kerf/crds/`, or with `--check` fails when they are out of date
//! or when a schema in them has a `format` kube-apiserver does not know (it would warn on
//! every apply; see `kerf_api::crd::formats`).
//!
//! Usage: `crdgen [--check] [--out-dir DIR]`; DIR defaults to the chart's `deploy/helm/kerf/crds/`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kerf_api::crd::formats::unknown_formats;
use kerf_api::crd::{CrdFile, crd_files};

const USAGE: &str = "usage: crdgen [--check] [--out-dir DIR]";

struct Args {
    check: bool,
    out_dir: PathBuf,
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("crdgen: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let files = match crd_files() {
        Ok(files) => files,
        Err(e) => {
            eprintln!("crdgen: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check {
        check(&args.out_dir, &files)
    } else {
        write(&args.out_dir, &files)
    }
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut parsed = Args {
        check: false,
        out_dir: Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/kerf/crds"),
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--check" => parsed.check = true,
            "--out-dir" => {
                parsed.out_dir = args.next().ok_or("--out-dir needs a directory")?.into();
            }
            "-h" | "--help" => {
                return Err("writes the CRD manifests generated from kerf-api's types".to_owned());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

fn write(dir: &Path, files: &[CrdFile]) -> ExitCode {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("crdgen: create {}: {e}", dir.display());
        return ExitCode::from(2);
    }
    for file in files {
        let path = dir.join(&file.file_name);
        if let Err(e) = std::fs::write(&path, &file.yaml) {
            eprintln!("crdgen: write {}: {e}", path.display());
            return ExitCode::from(2);
        }
        println!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}

fn check(dir: &Path, files: &[CrdFile]) -> ExitCode {
    let mut stale = false;
    let mut bad_formats = false;
    for file in files {
        let path = dir.join(&file.file_name);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        let mut unknown = format_problems(&committed);
        if committed != file.yaml {
            stale = true;
            eprintln!("{} differs from the Rust types", path.display());
            eprintln!("{}", first_difference(&committed, &file.yaml));
            unknown.extend(
                format_problems(&file.yaml)
                    .into_iter()
                    .map(|problem| format!("(as generated) {problem}")),
            );
        }
        for problem in &unknown {
            eprintln!("{}: {problem}", path.display());
        }
        if !unknown.is_empty() {
            bad_formats = true;
        } else if committed == file.yaml {
            println!("{} is up to date", path.display());
        }
    }
    if bad_formats {
        eprintln!(
            "kube-apiserver warns about these formats and ignores them: derive int32/int64 (see kerf_api::crd::formats)"
        );
    }
    if stale {
        eprintln!(
            "run `cargo run -p kerf-api --bin crdgen` and `deploy/render`, and commit deploy/"
        );
    }
    if stale || bad_formats {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// The unknown formats in a CRD manifest, or why it does not parse as one.
fn format_problems(yaml: &str) -> Vec<String> {
    if yaml.is_empty() {
        return Vec::new();
    }
    match serde_saphyr::from_str::<CustomResourceDefinition>(yaml) {
        Ok(crd) => unknown_formats(&crd)
            .iter()
            .map(ToString::to_string)
            .collect(),
        Err(e) => vec![format!("not a CustomResourceDefinition: {e}")],
    }
}

/// Where the committed file and the generated one first part ways.
fn first_difference(committed: &str, generated: &str) -> String {
    if committed.is_empty() {
        return "  (file is missing or empty)".to_owned();
    }
    let mut committed_lines = committed.lines();
    let mut generated_lines = generated.lines();
    let mut line = 1;
    loop {
        match (committed_lines.next(), generated_lines.next()) {
            (Some(a), Some(b)) if a == b => line += 1,
            (None, None) => return "  (files differ only in trailing newlines)".to_owned(),
            (a, b) => {
                return format!(
                    "  first difference at line {line}:\n  - committed: {}\n  + generated: {}",
                    a.unwrap_or("<end of file>"),
                    b.unwrap_or("<end of file>")
                );
            }
        }
    }
}
