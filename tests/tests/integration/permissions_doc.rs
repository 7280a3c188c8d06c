//! The "Permissions" table of docs/install.md says what the chart's
//! `deploy/helm/kerf/templates/*rbac*.yaml` grant, row for rule: this test parses both and fails
//! naming each row that matches no rule and each rule that has no row (with the row to add).

use std::collections::BTreeMap;
use std::path::Path;

use kerf_tests::fake_api::{Grant, Policy};

/// The section's heading; the table is the section's only table.
const HEADING: &str = "## Permissions";

/// What a row and a rule say: component, scope, API group, resource, verbs, names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    /// The ServiceAccount's name.
    component: String,
    /// `cluster`, or the namespace of a Role.
    scope: String,
    /// `core` for the core group.
    api_group: String,
    resource: String,
    /// Sorted.
    verbs: Vec<String>,
    /// Sorted; empty: any name.
    names: Vec<String>,
}

impl Entry {
    /// The row as docs/install.md writes it, with `why` to fill in.
    fn row(&self) -> String {
        let names: Vec<String> = self.names.iter().map(|n| format!("`{n}`")).collect();
        format!(
            "| {} | {} | {} | {} | {} | {} | <why> |",
            self.component,
            self.scope,
            self.api_group,
            self.resource,
            self.verbs.join(", "),
            names.join(", ")
        )
    }
}

/// A comma-separated cell as a sorted list, backticks dropped.
fn list(cell: &str) -> Vec<String> {
    let mut items: Vec<String> = cell
        .split(',')
        .map(|item| item.trim().trim_matches('`').to_owned())
        .filter(|item| !item.is_empty())
        .collect();
    items.sort();
    items
}

/// The rows of the table in `section` (the Permissions section up to the end of the document),
/// each with its line as written.
fn table_rows(section: &str) -> Vec<(String, Entry)> {
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells.first() == Some(&"Component") || cells.iter().all(|c| c.starts_with("---")) {
            continue;
        }
        assert_eq!(cells.len(), 7, "a row of seven cells: {line}");
        assert!(!cells[6].is_empty(), "a row without its why: {line}");
        rows.push((
            line.to_owned(),
            Entry {
                component: cells[0].to_owned(),
                scope: cells[1].to_owned(),
                api_group: cells[2].to_owned(),
                resource: cells[3].trim_matches('`').to_owned(),
                verbs: list(cells[4]),
                names: list(cells[5]),
            },
        ));
    }
    rows
}

/// The entries of one grant: one per API group × resource of its rule.
fn entries_of(grant: &Grant) -> Vec<Entry> {
    let rule = &grant.rule;
    let mut verbs = rule.verbs.clone();
    verbs.sort();
    let mut names = rule.resource_names.clone().unwrap_or_default();
    names.sort();
    let scope = if grant.scope.is_empty() {
        "cluster"
    } else {
        &grant.scope
    };
    let mut entries = Vec::new();
    for group in rule.api_groups.iter().flatten() {
        for resource in rule.resources.iter().flatten() {
            entries.push(Entry {
                component: grant.subject.name.clone(),
                scope: scope.to_owned(),
                api_group: if group.is_empty() { "core" } else { group }.to_owned(),
                resource: resource.clone(),
                verbs: verbs.clone(),
                names: names.clone(),
            });
        }
    }
    entries
}

#[test]
fn the_install_guides_permissions_table_is_what_the_chart_grants() {
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/install.md"))
            .unwrap();
    let (_, section) = guide
        .split_once(&format!("\n{HEADING}\n"))
        .expect("docs/install.md has a Permissions section");
    let rows = table_rows(section);
    assert!(!rows.is_empty(), "the Permissions table has no rows");
    let policy = Policy::kerf_manifests().unwrap();
    let mut granted: BTreeMap<Entry, String> = BTreeMap::new();
    for grant in policy.grants() {
        for entry in entries_of(grant) {
            granted.insert(entry, grant.source.to_string());
        }
    }

    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for (line, entry) in &rows {
        if seen.contains(entry) {
            problems.push(format!("row written twice: {line}"));
        } else if !granted.contains_key(entry) {
            problems.push(format!(
                "row matches no rule of deploy/helm/kerf/templates/*rbac*.yaml: {line}"
            ));
        }
        seen.push(entry.clone());
    }
    for (entry, source) in &granted {
        if !seen.contains(entry) {
            problems.push(format!(
                "{source} has no row in docs/install.md; add: {}",
                entry.row()
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
