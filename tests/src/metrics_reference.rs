//! The metrics reference (`docs/metrics.md`), rendered from the registries the binaries fill
//! (`kerf_controller::metrics_reference_registry`,
//! `kerf_kubelet_plugin::metrics_reference::reference_registry`): each family's name as scraped, type,
//! labels and help, read back from the registry's text encoding.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use prometheus_client::registry::Registry;

/// Where the reference lives, from the repository root.
pub const PATH: &str = "docs/metrics.md";

/// One metric family as the text encoding describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    /// The name Prometheus stores: with `_total` for a counter; a histogram's series add
    /// `_bucket`, `_sum` and `_count`.
    pub name: String,
    /// `counter`, `gauge`, `histogram`, …
    pub kind: String,
    /// The help text.
    pub help: String,
    /// Label names of its series (`le` of a histogram's buckets left out).
    pub labels: BTreeSet<String>,
}

/// The families of `registry`, in registration order.
///
/// # Errors
/// When the registry cannot be encoded (a label value that fails to encode).
pub fn families(registry: &Registry) -> Result<Vec<Family>, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(parse(&text))
}

/// The families of a text exposition (OpenMetrics as prometheus-client writes it).
pub fn parse(text: &str) -> Vec<Family> {
    let mut out: Vec<Family> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push(Family {
                name: name.to_owned(),
                kind: String::new(),
                help: help.to_owned(),
                labels: BTreeSet::new(),
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if let Some(family) = out.iter_mut().rev().find(|f| f.name == name) {
                kind.clone_into(&mut family.kind);
                if kind == "counter" {
                    family.name = format!("{name}_total");
                }
            }
        } else if !line.starts_with('#') {
            let Some((series, labels)) = line.split_once('{') else {
                continue;
            };
            let Some(family) = out.iter_mut().rev().find(|f| {
                series == f.name || series.strip_prefix(f.name.as_str()).is_some_and(is_suffix)
            }) else {
                continue;
            };
            family
                .labels
                .extend(label_names(labels).filter(|l| l != "le"));
        }
    }
    out
}

fn is_suffix(rest: &str) -> bool {
    matches!(rest, "_bucket" | "_sum" | "_count" | "_total" | "_created")
}

/// Label names of `a="x",b="y"} 1`, skipping quoted values (which may hold `,` and `=`).
fn label_names(labels: &str) -> impl Iterator<Item = String> + '_ {
    let mut names = Vec::new();
    let mut rest = labels;
    while let Some((name, after)) = rest.split_once("=\"") {
        names.push(name.trim_start_matches(',').to_owned());
        let mut escaped = false;
        let end = after
            .char_indices()
            .find(|&(_, c)| {
                let close = c == '"' && !escaped;
                escaped = c == '\\' && !escaped;
                close
            })
            .map_or(after.len(), |(i, _)| i + 1);
        rest = &after[end..];
        if rest.starts_with('}') {
            break;
        }
    }
    names.into_iter()
}

/// The whole reference: one table per binary.
///
/// # Errors
/// When a registry cannot be encoded.
pub fn render(binaries: &[(&str, &Registry)]) -> Result<String, std::fmt::Error> {
    let mut out = String::from(HEADER);
    for (binary, registry) in binaries {
        let _ = write!(
            out,
            "\n## {binary}\n\n| Metric | Type | Labels | Help |\n|---|---|---|---|\n"
        );
        let mut families = families(registry)?;
        families.sort_by(|a, b| a.name.cmp(&b.name));
        for family in families {
            let labels: Vec<String> = family.labels.iter().map(|l| format!("`{l}`")).collect();
            let labels = if labels.is_empty() {
                "–".to_owned()
            } else {
                labels.join(", ")
            };
            let _ = writeln!(
                out,
                "| `{}` | {} | {} | {} |",
                family.name,
                family.kind,
                labels,
                family.help.replace('|', "\\|")
            );
        }
    }
    Ok(out)
}

const HEADER: &str = "# Metrics reference

Every metric kerf-controller and kerf-kubelet-plugin serve on `/metrics` (the
`--metrics-address` of each), the alerts and the Grafana dashboard, generated from the
registries the binaries fill, `deploy/helm/kerf/files/prometheus-rules.yaml` and
`deploy/helm/kerf/files/grafana-dashboard.json`. Do not edit this file: change the metric's
registration, the rules or the dashboard, and regenerate it with

    KERF_BLESS=1 cargo test -p kerf-tests --test integration metrics_reference

(the test fails while this file and its sources disagree). How the chart installs them:
[operations](operations.md#metrics-and-alerts).

Names follow Prometheus conventions: base units (`_bytes`, `_seconds`), `_ratio` for a share
between 0 and 1, `_gpus` for an amount in GPUs (1.0 is one GPU's multiprocessors, or one
device where the name counts devices), `_total` for counters. A histogram `x` is scraped as
`x_bucket{le}`, `x_sum` and `x_count`. Prometheus adds the scrape target's labels (`instance`,
and `pod`, `namespace` with the chart's ServiceMonitor) to every series. Error `reason` labels
are the error variants' reason names, empty on success.
";

/// Whitespace runs as one space, `|` escaped: one table cell.
fn cell(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// The alerts of a Prometheus rule file (parsed): one row per alert.
pub fn render_alerts(rules: &serde_json::Value) -> String {
    let mut out = String::from(
        "\n## Alerts\n\nThe rule groups of `deploy/helm/kerf/files/prometheus-rules.yaml`, which the chart \
         installs as a PrometheusRule (`metrics.prometheusRule.enabled`).\n\n\
         | Alert | Severity | For | Expression | What it means |\n|---|---|---|---|---|\n",
    );
    let groups = rules["groups"].as_array().into_iter().flatten();
    for rule in groups.flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default()) {
        let Some(alert) = rule["alert"].as_str() else {
            continue;
        };
        let text = |v: &serde_json::Value| cell(v.as_str().unwrap_or(""));
        let _ = writeln!(
            out,
            "| `{alert}` | {} | {} | `{}` | {} |",
            text(&rule["labels"]["severity"]),
            rule["for"].as_str().unwrap_or("–"),
            text(&rule["expr"]),
            text(&rule["annotations"]["description"]),
        );
    }
    out
}

/// The panels of a Grafana dashboard (parsed), by row.
pub fn render_dashboard(dashboard: &serde_json::Value) -> String {
    let mut out = String::from(
        "\n## Dashboard\n\n`deploy/helm/kerf/files/grafana-dashboard.json`, which the chart installs as a \
         ConfigMap for Grafana's dashboard sidecar (`grafanaDashboard.enabled`).\n",
    );
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        let title = cell(panel["title"].as_str().unwrap_or(""));
        if panel["type"] == "row" {
            let _ = write!(out, "\n### {title}\n\n");
        } else {
            let _ = writeln!(
                out,
                "- **{title}**: {}",
                cell(panel["description"].as_str().unwrap_or(""))
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_carry_their_scraped_name_type_and_labels() {
        let text = "# HELP a_x Things.\n# TYPE a_x counter\na_x_total{k=\"v,w=\\\"x\\\"\",m=\"\"} 1\n\
            # HELP a_d Time.\n# TYPE a_d histogram\na_d_sum 0.0\na_d_bucket{le=\"1.0\"} 0\n\
            # HELP a_g Level.\n# TYPE a_g gauge\n# EOF\n";
        let families = parse(text);
        assert_eq!(families.len(), 3);
        assert_eq!(families[0].name, "a_x_total");
        assert_eq!(families[0].kind, "counter");
        assert_eq!(
            families[0].labels,
            BTreeSet::from(["k".to_owned(), "m".to_owned()])
        );
        assert_eq!(families[1].name, "a_d");
        assert!(families[1].labels.is_empty());
        assert_eq!(families[2].help, "Level.");
    }
}
