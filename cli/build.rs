//! Embeds the manifests of `examples/admin` and `examples/claims` into the binary, so that
//! `kerf demo` runs the examples from any working directory (and from an installed binary).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The example folders the demo loads, in load order.
const FOLDERS: [&str; 2] = ["admin", "claims"];

fn main() -> std::io::Result<()> {
    let manifest_dir = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let examples = manifest_dir.join("..").join("examples");
    let mut out = String::from("&[\n");
    for folder in FOLDERS {
        let dir = examples.join(folder);
        // A directory path makes cargo rerun this script when any file below it changes.
        println!("cargo:rerun-if-changed={}", dir.display());
        for file in yaml_files(&dir) {
            let name = file
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "    ({:?}, {:?}, include_str!({:?})),",
                folder,
                name,
                file.display().to_string()
            );
        }
    }
    out.push_str("]\n");
    let out_dir = PathBuf::from(env("OUT_DIR")?);
    std::fs::write(out_dir.join("embedded_examples.rs"), out)
}

/// A variable cargo sets for build scripts.
fn env(name: &str) -> std::io::Result<std::ffi::OsString> {
    std::env::var_os(name).ok_or_else(|| std::io::Error::other(format!("cargo did not set {name}")))
}

/// `*.yaml` and `*.yml` files of `dir`, sorted by name; none when `dir` does not exist.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    files
}
