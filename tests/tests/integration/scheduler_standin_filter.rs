//! The stand-in's Filter visits nodes as kube-scheduler's does (kubernetes/kubernetes
//! `pkg/scheduler/schedule_one.go`): it stops once `numFeasibleNodesToFind` nodes fit (100
//! of 150) and the next cycle starts where this one stopped (`nextStartNodeIndex`), so over
//! a large cluster consecutive pods land in consecutive windows of nodes.

use kerf_scheduler_standin::{
    CycleOutcome, SchedulerStandIn, SeededRng, num_feasible_nodes_to_find,
};
use kerf_tests::fake_api::FakeApi;
use serde_json::json;

const NODES: usize = 150;
const NS: &str = "default";

fn node_name(at: usize) -> String {
    format!("n{at:03}")
}

#[tokio::test]
async fn filter_stops_at_the_feasible_limit_and_rotates() {
    let fake = FakeApi::new();
    for at in 0..NODES {
        let name = node_name(at);
        fake.insert(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }));
    }
    let limit = num_feasible_nodes_to_find(NODES);
    assert_eq!(limit, 100);
    let mut stand_in = SchedulerStandIn::new(fake.client(), "gpu.kerf.dev");
    let mut rng = SeededRng::new(3);
    for k in 0..12 {
        let pod = format!("p{k:02}");
        fake.insert(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            "status": {"phase": "Pending"},
        }));
        let outcome = stand_in.schedule_one(&mut rng).await.unwrap();
        let CycleOutcome::Reserved { node, .. } = outcome else {
            panic!("pod {pod}: {outcome:?}");
        };
        // Every node fits, so cycle k filters exactly `limit` nodes starting at k * limit.
        let start = (k * limit) % NODES;
        let window: Vec<String> = (0..limit).map(|i| node_name((start + i) % NODES)).collect();
        assert!(
            window.contains(&node),
            "pod {pod} on {node}, outside the nodes {}..{} its cycle filtered",
            window[0],
            window[limit - 1]
        );
    }
}
