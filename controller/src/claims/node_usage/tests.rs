//! The books follow the watch events, and a pod fits where kube-scheduler would let it.

use super::*;
use serde_json::json;

const GI: i64 = 1 << 30;

fn node(name: &str, cpu: &str, pods: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "status": {"allocatable": {"cpu": cpu, "memory": "128Gi", "pods": pods, "example.com/fpga": "1"}}
    }))
    .unwrap()
}

fn pod(uid: &str, cpu: &str, node: Option<&str>, phase: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": uid, "namespace": "ns", "uid": uid},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
        "status": {"phase": phase}
    }))
    .unwrap()
}

fn asking(uid: &str, milli_cpu: i64) -> PodFit {
    PodFit {
        uid: Some(uid.to_owned()),
        requests: Resources::cpu_memory(milli_cpu, GI),
        ..PodFit::default()
    }
}

fn usage_with(nodes: &[Node], pods: &[Pod]) -> NodeUsage {
    let usage = NodeUsage::default();
    for n in nodes {
        usage.apply_node_event(&watcher::Event::Apply(n.clone()));
    }
    for p in pods {
        usage.apply_pod_event(&watcher::Event::Apply(p.clone()));
    }
    usage
}

fn reasons(usage: &NodeUsage, node: &str, pod: &PodFit) -> Vec<String> {
    usage.read(Instant::now()).reasons(node, pod)
}

#[test]
fn bound_pods_take_cpu_until_they_terminate_or_go() {
    let running = pod("a", "20", Some("n1"), "Running");
    let usage = usage_with(&[node("n1", "32", "110")], std::slice::from_ref(&running));
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 20_000)),
        ["Insufficient cpu"]
    );
    assert!(reasons(&usage, "n1", &asking("b", 12_000)).is_empty());
    // Its own request does not count against itself.
    assert!(reasons(&usage, "n1", &asking("a", 20_000)).is_empty());
    let done = pod("a", "20", Some("n1"), "Succeeded");
    assert!(usage.apply_pod_event(&watcher::Event::Apply(done)), "freed");
    assert!(reasons(&usage, "n1", &asking("b", 20_000)).is_empty());
    usage.apply_pod_event(&watcher::Event::Apply(running.clone()));
    assert!(usage.apply_pod_event(&watcher::Event::Delete(running)));
    assert!(reasons(&usage, "n1", &asking("b", 32_000)).is_empty());
}

#[test]
fn unbound_pods_take_nothing_and_nodes_without_allocatable_are_not_checked() {
    let usage = usage_with(
        &[node("n1", "32", "110")],
        &[pod("a", "30", None, "Pending")],
    );
    assert!(reasons(&usage, "n1", &asking("b", 32_000)).is_empty());
    assert!(reasons(&usage, "unknown", &asking("b", 64_000)).is_empty());
    let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n1"}})).unwrap();
    usage.apply_node_event(&watcher::Event::Apply(bare));
    assert!(reasons(&usage, "n1", &asking("b", 64_000)).is_empty());
}

#[test]
fn the_pod_count_is_checked() {
    let usage = usage_with(
        &[node("n1", "32", "1")],
        &[pod("a", "0", Some("n1"), "Running")],
    );
    assert_eq!(reasons(&usage, "n1", &PodFit::default()), ["Too many pods"]);
}

#[test]
fn an_assumed_pod_counts_until_bound_forgotten_or_expired() {
    let usage = usage_with(&[node("n1", "32", "110")], &[]);
    let now = Instant::now();
    usage.assume(
        "a",
        "n1",
        &asking("a", 20_000),
        Duration::from_secs(60),
        now,
    );
    assert!(usage.is_assumed("a"));
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 20_000)),
        ["Insufficient cpu"]
    );
    assert!(
        reasons(&usage, "n1", &asking("a", 20_000)).is_empty(),
        "not against itself"
    );
    // Bound: counted once, as a bound pod.
    usage.apply_pod_event(&watcher::Event::Apply(pod(
        "a",
        "20",
        Some("n1"),
        "Pending",
    )));
    assert!(!usage.is_assumed("a"));
    assert!(reasons(&usage, "n1", &asking("b", 12_000)).is_empty());
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 12_001)),
        ["Insufficient cpu"]
    );

    usage.assume("c", "n1", &asking("c", 5_000), Duration::from_secs(60), now);
    assert!(usage.forget("c"));
    usage.assume("d", "n1", &asking("d", 5_000), Duration::from_secs(1), now);
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 12_000)),
        ["Insufficient cpu"]
    );
    let later = usage.read(now + Duration::from_secs(2));
    assert!(
        later.reasons("n1", &asking("b", 12_000)).is_empty(),
        "expired"
    );
}

#[test]
fn nominated_pods_count_against_lower_or_equal_priority_only() {
    let nominated: Pod = serde_json::from_value(json!({
        "metadata": {"name": "n", "namespace": "ns", "uid": "nom"},
        "spec": {"priority": 100, "containers": [{"name": "c", "resources": {"requests": {"cpu": "30"}}}]},
        "status": {"phase": "Pending", "nominatedNodeName": "n1"}
    }))
    .unwrap();
    let usage = usage_with(&[node("n1", "32", "110")], &[nominated]);
    let mut low = asking("low", 4_000);
    low.priority = 100;
    assert_eq!(reasons(&usage, "n1", &low), ["Insufficient cpu"]);
    let mut high = asking("high", 4_000);
    high.priority = 101;
    assert!(reasons(&usage, "n1", &high).is_empty());
    assert!(
        reasons(&usage, "n1", &asking("nom", 30_000)).is_empty(),
        "itself"
    );
}

#[test]
fn host_ports_conflict_first() {
    let holder: Pod = serde_json::from_value(json!({
        "metadata": {"name": "h", "namespace": "ns", "uid": "h"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 8080}]}]},
        "status": {"phase": "Running"}
    }))
    .unwrap();
    let usage = usage_with(&[node("n1", "1", "110")], &[holder]);
    let mut wants = asking("b", 64_000);
    wants.ports = vec![HostPort::new("", "TCP", 8080)];
    assert_eq!(
        reasons(&usage, "n1", &wants),
        ["node(s) didn't have free ports for the requested pod ports"]
    );
    wants.ports = vec![HostPort::new("", "UDP", 8080)];
    assert_eq!(reasons(&usage, "n1", &wants), ["Insufficient cpu"]);
}

#[test]
fn dra_backed_extended_resources_are_left_to_dra_where_the_node_lacks_them() {
    let usage = usage_with(&[node("n1", "32", "110")], &[]);
    let mut wants = asking("b", 1_000);
    wants.requests.scalars.insert("gpu.kerf.dev/gpu".into(), 1);
    assert_eq!(
        reasons(&usage, "n1", &wants),
        ["Insufficient gpu.kerf.dev/gpu"]
    );
    wants.dra_backed.insert("gpu.kerf.dev/gpu".into());
    assert!(reasons(&usage, "n1", &wants).is_empty());
    // A resource the node advertises (a device plugin) is checked there.
    wants.requests.scalars.insert("example.com/fpga".into(), 2);
    wants.dra_backed.insert("example.com/fpga".into());
    assert_eq!(
        reasons(&usage, "n1", &wants),
        ["Insufficient example.com/fpga"]
    );
}

#[test]
fn a_relist_replaces_the_pods_and_keeps_live_assumptions() {
    let usage = usage_with(
        &[node("n1", "32", "110")],
        &[pod("gone", "30", Some("n1"), "Running")],
    );
    let now = Instant::now();
    usage.assume(
        "waiting",
        "n1",
        &asking("waiting", 10_000),
        Duration::ZERO,
        now,
    );
    usage.assume(
        "deleted",
        "n1",
        &asking("deleted", 10_000),
        Duration::ZERO,
        now,
    );
    usage.apply_pod_event(&watcher::Event::Init);
    usage.apply_pod_event(&watcher::Event::InitApply(pod(
        "waiting", "10", None, "Pending",
    )));
    usage.apply_pod_event(&watcher::Event::InitApply(pod(
        "new",
        "2",
        Some("n1"),
        "Running",
    )));
    // Until InitDone the old books hold.
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 1_000)),
        ["Insufficient cpu"]
    );
    usage.apply_pod_event(&watcher::Event::InitDone);
    assert!(usage.is_assumed("waiting") && !usage.is_assumed("deleted"));
    assert!(reasons(&usage, "n1", &asking("b", 20_000)).is_empty());
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 20_001)),
        ["Insufficient cpu"]
    );
}

#[test]
fn a_node_relist_replaces_allocatables() {
    let usage = usage_with(&[node("n1", "32", "110"), node("n2", "32", "110")], &[]);
    usage.apply_node_event(&watcher::Event::Init);
    usage.apply_node_event(&watcher::Event::InitApply(node("n1", "8", "110")));
    usage.apply_node_event(&watcher::Event::InitDone);
    assert_eq!(
        reasons(&usage, "n1", &asking("b", 9_000)),
        ["Insufficient cpu"]
    );
    assert!(
        reasons(&usage, "n2", &asking("b", 64_000)).is_empty(),
        "gone: unchecked"
    );
}
