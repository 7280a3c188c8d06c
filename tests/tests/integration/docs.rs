//! The documentation against the code and against itself:
//! - docs/configuration.md lists every flag of every binary as their clap definitions say
//!   (`kerf_cli::reference`); `KERF_BLESS=1` rewrites it.
//! - Every relative link of README.md, ARCHITECTURE.md and docs/*.md names a file or directory
//!   that exists, and every `#anchor` a heading of the Markdown file it points into, by GitHub's
//!   rules for heading anchors.

use std::collections::BTreeSet;
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

/// The Markdown files whose links are checked.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// `text` without fenced code blocks and inline code spans, which hold no links.
fn without_code(text: &str) -> String {
    let mut prose = String::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        match fence {
            Some(marker) => {
                if trimmed.starts_with(marker) {
                    fence = None;
                }
                prose.push('\n');
                continue;
            }
            None if trimmed.starts_with("```") || trimmed.starts_with("~~~") => {
                fence = Some(&trimmed[..3]);
                prose.push('\n');
                continue;
            }
            None => {}
        }
        prose.push_str(line);
        prose.push('\n');
    }
    // Inline code: a run of n backticks up to the next run of exactly n.
    let chars: Vec<char> = prose.chars().collect();
    let mut out = String::with_capacity(prose.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|c| **c == '`').count();
        let mut j = i + run;
        let mut closed = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let other = chars[j..].iter().take_while(|c| **c == '`').count();
                if other == run {
                    closed = Some(j + other);
                    break;
                }
                j += other;
            } else {
                j += 1;
            }
        }
        if let Some(end) = closed {
            out.push_str("code");
            i = end;
        } else {
            out.extend(&chars[i..i + run]);
            i += run;
        }
    }
    out
}

/// The link targets of `text`: inline links and images (`[text](target)`) and reference
/// definitions (`[name]: target`).
fn link_targets(text: &str) -> Vec<String> {
    let prose = without_code(text);
    let mut targets = Vec::new();
    let mut rest = prose.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].trim();
        // `<target>` and `target "title"`.
        let target = target.trim_start_matches('<').trim_end_matches('>');
        let target = target.split_whitespace().next().unwrap_or("");
        targets.push(target.to_owned());
        rest = &after[end.min(after.len())..];
    }
    for line in prose.lines() {
        let line = line.trim_start();
        if let Some(close) = line.strip_prefix('[').and_then(|l| l.find("]:"))
            && let Some(target) = line[close + 3..].split_whitespace().next()
        {
            targets.push(target.to_owned());
        }
    }
    targets
}

/// The anchors GitHub gives the headings of a Markdown text: the heading's text without its
/// markup, lower-cased, with every character dropped that is not a letter, digit, space,
/// `-` or `_`, spaces made `-`; a repeated anchor gets `-1`, `-2`, … appended.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        if fence || !trimmed.starts_with('#') {
            continue;
        }
        let level = trimmed.chars().take_while(|c| *c == '#').count();
        let Some(heading) = trimmed[level..].strip_prefix(' ') else {
            continue;
        };
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

fn slug(heading: &str) -> String {
    // Links in a heading keep their text only.
    let mut text = String::new();
    let mut rest = heading.trim();
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](") else {
            break;
        };
        let Some(close) = rest[open + mid..].find(')') else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..open + mid]);
        rest = &rest[open + mid + close + 1..];
    }
    text.push_str(rest);
    text.trim_end_matches('#')
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn github_heading_anchors() {
    let text = "# kerf\n## `kerf status`\n### Why the checkpoint is not fsync'd\n\
                ## Scheduler slices and dynamic MIG (1.36+)\n## Slices on the GPU: MPS and time-slicing\n\
                ```\n# not a heading\n```\n## Upgrades\n## Upgrades\n## Before and after the `:authority` adapter\n";
    let expected: BTreeSet<String> = [
        "kerf",
        "kerf-status",
        "why-the-checkpoint-is-not-fsyncd",
        "scheduler-slices-and-dynamic-mig-136",
        "slices-on-the-gpu-mps-and-time-slicing",
        "upgrades",
        "upgrades-1",
        "before-and-after-the-authority-adapter",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(anchors(text), expected);
}

#[test]
fn links_outside_code_only() {
    let text = "See [a](docs/a.md#x) and `[b](no.md)`.\n```\n[c](no.md)\n```\n\
                [d\nacross lines](b.md) ![img](i.svg \"title\")\n[ref]: r.md\n";
    assert_eq!(link_targets(text), ["docs/a.md#x", "b.md", "i.svg", "r.md"]);
}

#[test]
fn every_relative_link_resolves() {
    let root = root();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in documents() {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{name}: {e} (it is one of the documents)"));
        for target in link_targets(&text) {
            if target.is_empty() {
                problems.push(format!("{name}: a link without a target"));
                continue;
            }
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let linked = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !linked.exists() {
                problems.push(format!("{name}: {target}: no such file or directory"));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if linked.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let linked_text = std::fs::read_to_string(&linked).unwrap();
            if !anchors(&linked_text).contains(anchor) {
                problems.push(format!(
                    "{name}: {target}: {} has no heading whose anchor is #{anchor}",
                    linked.strip_prefix(&root).unwrap_or(&linked).display()
                ));
            }
        }
    }
    assert!(checked > 0, "no relative link found at all");
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}
