//! The documentation against the code: docs/configuration.md lists every flag of every binary
//! as their clap definitions say (`kerf_cli::reference`); `KERF_BLESS=1` rewrites it.

use std::path::{Path, PathBuf};

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

#[test]
fn the_flag_reference_is_what_the_binaries_accept() {
    let path = root().join("docs/configuration.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let expected = kerf_cli::reference::splice(&text, &kerf_cli::reference::markdown())
        .unwrap_or_else(|| {
            panic!(
                "docs/configuration.md lacks the lines {:?} and {:?} around the flag reference",
                kerf_cli::reference::BEGIN,
                kerf_cli::reference::END
            )
        });
    if text == expected {
        return;
    }
    if std::env::var_os("KERF_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
        return;
    }
    let (line, (written, generated)) = text
        .lines()
        .zip(expected.lines())
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .map_or(
            (text.lines().count().min(expected.lines().count()), ("", "")),
            |(i, pair)| (i, pair),
        );
    panic!(
        "docs/configuration.md differs from the binaries' flags, first at line {}:\n  written:   {written}\n  generated: {generated}\n\
         Regenerate it: KERF_BLESS=1 cargo test -p kerf-tests --test integration docs::",
        line + 1
    );
}
