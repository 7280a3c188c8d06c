use super::*;
use prometheus_client::encoding::text::encode;

fn setup() -> (Registry, Metrics) {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    (registry, metrics)
}

fn encoded(registry: &Registry) -> String {
    let mut text = String::new();
    encode(&mut text, registry).unwrap();
    text
}

#[test]
fn reconciles_are_counted_by_controller_result_and_reason() {
    let (registry, metrics) = setup();
    metrics.record_reconcile("gpuclass", Ok(()), Duration::from_millis(3));
    metrics.record_reconcile("gpuclass", Err("kube_conflict"), Duration::from_millis(3));
    metrics.record_reconcile("gpuclass", Err("kube_conflict"), Duration::from_millis(3));
    let text = encoded(&registry);
    assert!(
        text.contains(
            r#"kerf_controller_reconcile_total{controller="gpuclass",result="ok",reason=""} 1"#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_reconcile_total{controller="gpuclass",result="error",reason="kube_conflict"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kerf_controller_reconcile_duration_seconds_count{controller="gpuclass"} 3"#
        ),
        "{text}"
    );
}

#[test]
fn class_series_follow_the_classes() {
    let (registry, metrics) = setup();
    let capacity = ClassCapacity {
        matching_devices: 2,
        total_memory_bytes: 100,
        free_memory_bytes: 40,
    };
    metrics.set_class_capacity("a", &capacity);
    metrics.set_class_capacity("b", &capacity);
    metrics.set_class_free_compute("b", 1.5);
    let text = encoded(&registry);
    assert!(
        text.contains(r#"kerf_controller_class_free_memory_bytes{class="a"} 40"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_class_matching_devices{class="b"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_class_free_compute_gpus{class="b"} 1.5"#),
        "{text}"
    );

    metrics.retain_classes(["a"]);
    let text = encoded(&registry);
    assert!(text.contains(r#"class="a""#), "{text}");
    assert!(!text.contains(r#"class="b""#), "{text}");
}

#[test]
fn allocations_and_leadership_are_recorded() {
    let (registry, metrics) = setup();
    metrics.record_allocation(Ok(()), Duration::from_millis(20));
    metrics.record_allocation(Err("no_fit"), Duration::from_millis(20));
    metrics.set_leader(true);
    let text = encoded(&registry);
    assert!(
        text.contains(r#"kerf_controller_allocations_total{result="error",reason="no_fit"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("kerf_controller_allocation_duration_seconds_count 2"),
        "{text}"
    );
    assert!(text.contains("kerf_controller_leader 1"), "{text}");
}

#[test]
fn admissions_and_node_label_writes_are_counted() {
    let (registry, metrics) = setup();
    metrics.record_admission("gated");
    metrics.record_admission("gated");
    metrics.record_admission("error");
    metrics.record_claim_admission("resourceclaims", "denied");
    metrics.record_claim_node_label("set");
    let text = encoded(&registry);
    assert!(
        text.contains(r#"kerf_controller_claim_node_labels_total{action="set"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_admissions_total{outcome="gated"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"kerf_controller_admissions_total{outcome="error"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"kerf_controller_claim_admissions_total{resource="resourceclaims",outcome="denied"} 1"#
        ),
        "{text}"
    );
}
