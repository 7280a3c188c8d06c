//! The table of Helm values in docs/install.md is generated from the chart's values.yaml (each
//! value's comment above it and its default), so that the docs cannot drift from the chart.
//! `KERF_BLESS=1 cargo test -p kerf-tests --test integration helm_values_doc` rewrites it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Where the table goes and where it comes from.
const DOC: &str = "docs/install.md";
const VALUES: &str = "deploy/helm/kerf/values.yaml";
const BEGIN: &str = "<!-- helm-values:begin: generated from deploy/helm/kerf/values.yaml; \
KERF_BLESS=1 cargo test -p kerf-tests --test integration helm_values_doc -->";
const END: &str = "<!-- helm-values:end -->";

/// One documented value.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    path: String,
    default: String,
    description: String,
}

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// The values of a values.yaml: each key with its dotted path, its default as written (lists
/// and maps with entries only as "see values.yaml") and the comment lines right above it.
/// Comment lines indented past `# ` are commented-out examples, not descriptions.
fn rows(text: &str) -> Vec<Row> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut comment: Vec<String> = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            comment.clear();
            continue;
        }
        if let Some(text) = trimmed.strip_prefix('#') {
            if !text.starts_with("  ") {
                comment.push(text.trim().to_owned());
            }
            continue;
        }
        if trimmed.starts_with("- ") || path.last().is_some_and(|(i, _)| indent > *i + 2) {
            comment.clear();
            continue;
        }
        let Some((key, rest)) = trimmed.split_once(':') else {
            continue;
        };
        if key.contains(' ') {
            continue;
        }
        while path.last().is_some_and(|(i, _)| *i >= indent) {
            path.pop();
        }
        path.push((indent, key.to_owned()));
        let (value, inline) = match rest.split_once(" # ") {
            Some((value, inline)) => (value.trim(), Some(inline.trim())),
            None => (rest.trim(), None),
        };
        let next = lines[index + 1..]
            .iter()
            .find(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
        let has_children =
            value.is_empty() && next.is_some_and(|l| l.len() - l.trim_start().len() > indent);
        let list = has_children && next.is_some_and(|l| l.trim_start().starts_with("- "));
        let mut description = comment.join(" ");
        if let Some(inline) = inline {
            if !description.is_empty() {
                description.push(' ');
            }
            description.push_str(inline);
        }
        comment.clear();
        if has_children && !list {
            if !description.is_empty() {
                out.push(row(&path, "", description));
            }
            continue;
        }
        let default = if list { "see values.yaml" } else { value };
        out.push(row(&path, default, description));
    }
    out
}

fn row(path: &[(usize, String)], default: &str, description: String) -> Row {
    Row {
        path: path
            .iter()
            .map(|(_, k)| k.as_str())
            .collect::<Vec<_>>()
            .join("."),
        default: default.to_owned(),
        description,
    }
}

/// The markdown table, between [`BEGIN`] and [`END`].
fn table(rows: &[Row]) -> String {
    let mut out = format!("{BEGIN}\n\n| value | default | meaning |\n|---|---|---|\n");
    for row in rows {
        let default = if row.default.is_empty() {
            String::new()
        } else {
            format!("`{}`", row.default)
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} |",
            row.path,
            default.replace('|', "\\|"),
            row.description.replace('|', "\\|")
        );
    }
    out.push('\n');
    out.push_str(END);
    out
}

#[test]
fn the_install_docs_list_every_helm_value_as_values_yaml_says() {
    let values = std::fs::read_to_string(repo(VALUES)).unwrap();
    let generated = table(&rows(&values));
    let doc_path = repo(DOC);
    let doc = std::fs::read_to_string(&doc_path).unwrap();
    let (Some(start), Some(end)) = (doc.find(BEGIN), doc.find(END)) else {
        panic!(
            "{DOC} has no generated values table: put the two lines\n{BEGIN}\n{END}\nwhere it goes, then run with KERF_BLESS=1"
        );
    };
    let current = &doc[start..end + END.len()];
    if current == generated {
        return;
    }
    if std::env::var_os("KERF_BLESS").is_some() {
        let updated = format!("{}{generated}{}", &doc[..start], &doc[end + END.len()..]);
        std::fs::write(&doc_path, updated).unwrap();
        return;
    }
    panic!(
        "{DOC}'s table of Helm values differs from {VALUES}; regenerate it with\n  KERF_BLESS=1 cargo test -p kerf-tests --test integration helm_values_doc"
    );
}

#[test]
fn values_are_read_with_their_paths_comments_and_defaults() {
    let text = "\
# The image.
image:
  # Where from.
  repository: ghcr.io/x # inline
  #  example: commented out
  tag: \"\"

tolerations:
  - key: a
    operator: Exists
empty: {}
";
    let found = rows(text);
    let paths: Vec<_> = found.iter().map(|r| r.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "image",
            "image.repository",
            "image.tag",
            "tolerations",
            "empty"
        ]
    );
    assert_eq!(found[1].default, "ghcr.io/x");
    assert_eq!(found[1].description, "Where from. inline");
    assert_eq!(found[2].description, "");
    assert_eq!(found[3].default, "see values.yaml");
    assert_eq!(found[4].default, "{}");
}
