//! `docs/metrics.md` is the metrics reference generated from the registries kerf-controller
//! and kerf-kubelet-plugin fill, the chart's alerts and its dashboard; this test fails while
//! they disagree, and `KERF_BLESS=1` writes the file anew.

use std::path::PathBuf;

use kerf_tests::metrics_reference::{PATH, families, render, render_alerts, render_dashboard};

fn repo_path(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// The reference as the registries, the rules and the dashboard make it now.
pub fn generated() -> String {
    let controller = kerf_controller::metrics_reference_registry();
    let plugin = kerf_kubelet_plugin::metrics_reference::reference_registry();
    let mut text = render(&[
        ("kerf-controller", &controller),
        ("kerf-kubelet-plugin", &plugin),
    ])
    .unwrap();
    let read = |path: &str| std::fs::read_to_string(repo_path(path)).unwrap();
    let rules = serde_saphyr::from_str(&read("deploy/helm/kerf/files/prometheus-rules.yaml"));
    text.push_str(&render_alerts(&rules.unwrap()));
    let dashboard = serde_json::from_str(&read("deploy/helm/kerf/files/grafana-dashboard.json"));
    text.push_str(&render_dashboard(&dashboard.unwrap()));
    text
}

#[test]
fn docs_metrics_md_matches_the_registries() {
    let path = repo_path(PATH);
    let expected = generated();
    if std::env::var_os("KERF_BLESS").is_some() {
        std::fs::write(&path, &expected).unwrap();
        return;
    }
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    if actual != expected {
        let first = actual
            .lines()
            .zip(expected.lines())
            .position(|(a, e)| a != e)
            .unwrap_or_else(|| actual.lines().count().min(expected.lines().count()));
        panic!(
            "{PATH} differs from the metrics the binaries register (first at line {}: {:?} \
             should be {:?}); regenerate it with\n\n    \
             KERF_BLESS=1 cargo test -p kerf-tests --test integration metrics_reference\n",
            first + 1,
            actual.lines().nth(first).unwrap_or(""),
            expected.lines().nth(first).unwrap_or(""),
        );
    }
}

/// Every alert has a summary, a description and a runbook that resolves: the Alerts section
/// of `docs/metrics.md`, which this file generates.
#[test]
fn every_alert_points_at_its_description() {
    let path = repo_path("deploy/helm/kerf/files/prometheus-rules.yaml");
    let rules: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let alerts = rules["groups"][0]["rules"].as_array().unwrap();
    assert!(!alerts.is_empty());
    for alert in alerts {
        let annotations = &alert["annotations"];
        assert!(annotations["summary"].is_string(), "{alert}");
        assert!(annotations["description"].is_string(), "{alert}");
        assert_eq!(
            annotations["runbook_url"], "docs/metrics.md#alerts",
            "{alert}"
        );
    }
    assert!(generated().contains("\n## Alerts\n"));
}

/// Every family has a help text and a type, and the names follow Prometheus's conventions:
/// counters end in `_total`, and no name carries a unit Prometheus has a base unit for.
#[test]
fn every_metric_is_named_in_base_units() {
    let registries = [
        kerf_controller::metrics_reference_registry(),
        kerf_kubelet_plugin::metrics_reference::reference_registry(),
    ];
    for family in registries.iter().flat_map(|r| families(r).unwrap()) {
        let name = &family.name;
        assert!(!family.help.is_empty(), "{name} has no help");
        assert!(name.starts_with("kerf_"), "{name}: kerf_ prefix");
        if family.kind == "counter" {
            assert!(name.ends_with("_total"), "{name}: counter without _total");
        } else {
            assert!(
                !name.ends_with("_total"),
                "{name}: _total on a {}",
                family.kind
            );
        }
        for unit in [
            "_ms",
            "_milliseconds",
            "_percent",
            "_kb",
            "_mb",
            "_gb",
            "_gib",
            "_mib",
        ] {
            assert!(
                !name.split('_').any(|w| format!("_{w}") == unit),
                "{name}: not a base unit ({unit})"
            );
        }
        let words: Vec<&str> = name.split('_').collect();
        if ["duration", "latency", "age"]
            .iter()
            .any(|w| words.contains(w))
        {
            assert!(name.ends_with("_seconds"), "{name}: a time in seconds");
        }
        if words.contains(&"memory") {
            assert!(name.ends_with("_bytes"), "{name}: a memory in bytes");
        }
    }
}
