//! The `kerf-kubelet-plugin` binary as an admin meets it: its help names an environment
//! variable for every flag (DaemonSets set most of them by `env:`), and a mistyped flag stops
//! it with the flag's name rather than starting with a default.
//!
//! This test also makes `cargo test --workspace` build the binary itself, which `.ci/image`
//! (`KERF_IMAGE_PROFILE=dev`) packages without a second build.
#![allow(
    clippy::expect_used,
    reason = "helpers outside #[test] functions fail the test the same way"
)]

use std::process::{Command, Output};

fn plugin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kerf-kubelet-plugin"))
        .args(args)
        .env_clear()
        .output()
        .expect("the kerf-kubelet-plugin binary runs")
}

/// The help text cut into one block per flag: from a line whose first word is a flag up to the
/// next such line.
fn flag_blocks(help: &str) -> Vec<(String, String)> {
    let mut blocks: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        // clap indents flags by 2 (`-x, --flag`) or 6 (`--flag`) spaces, and the lists of
        // possible values in the help text by 10 or more.
        let indent = line.len() - trimmed.len();
        let is_flag = (2..=6).contains(&indent) && trimmed.starts_with('-');
        if is_flag {
            let long = trimmed
                .split([',', ' '])
                .find(|word| word.starts_with("--"))
                .unwrap_or(trimmed)
                .to_owned();
            blocks.push((long, String::new()));
        } else if let Some((_, text)) = blocks.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    blocks
}

#[test]
fn help_names_an_environment_variable_for_every_flag() {
    let out = plugin(&["--help"]);
    assert!(out.status.success(), "--help failed: {out:?}");
    let help = String::from_utf8(out.stdout).expect("help is UTF-8");
    let blocks = flag_blocks(&help);
    assert!(
        blocks.len() > 20,
        "expected the plugin's many flags, found {}: {help}",
        blocks.len()
    );
    let without_env: Vec<&str> = blocks
        .iter()
        .filter(|(flag, text)| {
            !matches!(flag.as_str(), "--help" | "--version") && !text.contains("[env: ")
        })
        .map(|(flag, _)| flag.as_str())
        .collect();
    assert!(
        without_env.is_empty(),
        "flags without an environment variable: {without_env:?}"
    );
    for name in [
        "KERF_DRIVER_NAME",
        "NODE_NAME",
        "KERF_CDI_DIR",
        "KERF_MOCK_GPUS",
    ] {
        assert!(help.contains(&format!("[env: {name}=")), "{name} missing");
    }
}

#[test]
fn a_mistyped_flag_stops_the_plugin_and_names_the_flag() {
    let out = plugin(&["--node-name", "node-1", "--cdi-dri", "/tmp"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--cdi-dri"), "{stderr}");
}
