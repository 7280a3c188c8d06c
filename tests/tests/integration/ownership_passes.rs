//! The ownership pass runs on changes, not on a clock: an idle cluster costs no pass
//! (`kerf_controller_ownership_passes_total` stands still), and every kind of input change —
//! a pending pod's demand, its deletion, a node's policy label, a claim kube-scheduler
//! allocated and its deletion, the republished slice, a settle fence and a linger running out —
//! still moves the devices where they went when the pass ran every tick. The changes come in
//! seeded random orders ([`SeededRng`]); a failing seed replays.

use crate::common::claim_cluster;
use crate::common::controller::{ClaimController, Watched, metric};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use claim_cluster::{DRIVER, NODES, NS, PODS, WHOLE, settings};
use k8s_openapi::api::core::v1::Node;
use kerf_api::ownership::{NODE_LABEL, Owner, OwnershipRecord};
use kerf_controller::{BackoffConfig, ControllerConfig};
use kerf_scheduler_standin::SeededRng;
use kerf_tests::fake_api::FakeApi;
use kube::api::{Patch, PatchParams};
use prometheus_client::registry::Registry;
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(20);
const GPUS: usize = 8;
const CLAIMS: &str = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims";

/// The claim controller on its own context, whose metrics the test reads.
struct Harness {
    registry: Registry,
    controller: ClaimController,
}

impl Harness {
    async fn start(fake: &FakeApi) -> Self {
        let config = ControllerConfig {
            backoff: BackoffConfig {
                base: Duration::from_millis(10),
                max: Duration::from_millis(100),
            },
            claims: settings(),
            ..ControllerConfig::new(DRIVER)
        };
        let Watched { context, registry } = Watched::start(fake, config).await;
        let controller = ClaimController::start(fake, Arc::new(context));
        Self {
            registry,
            controller,
        }
    }

    fn passes(&self) -> u64 {
        metric(&self.registry, "kerf_controller_ownership_passes_total").unwrap_or(0)
    }

    /// No device waits for its fence.
    fn nothing_settling(&self) -> bool {
        metric(
            &self.registry,
            r#"kerf_controller_ownership_devices{owner="settling"}"#,
        ) == Some(0)
    }

    async fn stop(self) {
        self.controller.stop().await;
    }
}

/// Every device's owner as the Nodes' records say, by (node, device).
fn recorded(fake: &FakeApi) -> BTreeMap<(String, String), Owner> {
    let mut out = BTreeMap::new();
    for name in NODES {
        let node: Node = fake.get_resource(None, name).unwrap();
        let record = OwnershipRecord::from_annotations(node.metadata.annotations.as_ref()).unwrap();
        for (device, owner) in record.0 {
            out.insert((name.to_owned(), device), owner);
        }
    }
    out
}

/// The changes the test makes; each `Undo` comes after its `Do`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    /// A pending, ungated pod with an unallocated claim of the scheduler's whole-GPU class:
    /// demand for one GPU.
    PendingPod,
    /// node-1 labelled for the scheduler alone.
    SchedulerLabel,
    /// A claim kube-scheduler allocated node-2's gpu-3 to, behind the controller's back.
    SchedulerClaim,
}

/// What is on now, and the owners the controller must end up recording for it.
#[derive(Debug, Default)]
struct Model {
    pending_pod: bool,
    scheduler_label: bool,
    scheduler_claim: bool,
}

impl Model {
    fn set(&mut self, input: Input, on: bool) {
        match input {
            Input::PendingPod => self.pending_pod = on,
            Input::SchedulerLabel => self.scheduler_label = on,
            Input::SchedulerClaim => self.scheduler_claim = on,
        }
    }

    /// True when `owners` is where this state ends once fences and lingers have run out: node-1
    /// all the scheduler's while labelled, node-2/gpu-3 the scheduler's while its claim holds
    /// it, and one more idle GPU lent for the pending pod unless node-1's idle ones serve it.
    fn reached(&self, owners: &BTreeMap<(String, String), Owner>) -> bool {
        if owners.len() != NODES.len() * GPUS {
            return false;
        }
        let scheduler = |node: &str, device: &str| {
            owners.get(&(node.to_owned(), device.to_owned())) == Some(&Owner::Scheduler)
        };
        let node_1 = (0..GPUS)
            .filter(|i| scheduler("node-1", &format!("gpu-{i}")))
            .count();
        if self.scheduler_label && node_1 != GPUS {
            return false;
        }
        if self.scheduler_claim && !scheduler("node-2", "gpu-3") {
            return false;
        }
        let lent = usize::from(self.pending_pod && !self.scheduler_label);
        let want =
            GPUS * usize::from(self.scheduler_label) + usize::from(self.scheduler_claim) + lent;
        let have = owners.values().filter(|o| **o == Owner::Scheduler).count();
        have == want
    }
}

async fn set_label(fake: &FakeApi, value: &str) {
    let nodes: kube::Api<Node> = kube::Api::all(fake.client());
    let patch = json!({"metadata": {"labels": {NODE_LABEL: value}}});
    nodes
        .patch("node-1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

fn whole_claim(fake: &FakeApi, name: &str) {
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE}}]}},
    }));
}

/// Makes `input` true (`on`) or false, as a user, kube-scheduler or kubelet would.
async fn apply(fake: &FakeApi, input: Input, on: bool) {
    match (input, on) {
        (Input::PendingPod, true) => {
            whole_claim(fake, "wanted");
            fake.insert(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "waiting", "namespace": NS},
                "spec": {
                    "containers": [{"name": "main", "image": "busybox"}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": "wanted"}],
                },
                "status": {"phase": "Pending"},
            }));
        }
        (Input::PendingPod, false) => {
            fake.remove(&format!("{PODS}/waiting"));
            fake.remove(&format!("{CLAIMS}/wanted"));
        }
        (Input::SchedulerLabel, on) => {
            set_label(fake, if on { "scheduler" } else { "dynamic" }).await;
        }
        (Input::SchedulerClaim, true) => {
            fake.insert(json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "taken", "namespace": NS},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": WHOLE}}]}},
                "status": {"allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "node-2", "device": "gpu-3"}]},
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-2"]}]}]},
                }},
            }));
        }
        (Input::SchedulerClaim, false) => {
            fake.remove(&format!("{CLAIMS}/taken"));
        }
    }
}

/// Waits until the records match `model` and no device waits for its fence.
async fn settled(fake: &FakeApi, harness: &Harness, model: &Model, what: &str) {
    kerf_tests::wait::eventually(what, DEADLINE, || async {
        (model.reached(&recorded(fake)) && harness.nothing_settling()).then_some(())
    })
    .await;
}

/// Asserts that no pass runs while nothing changes, for fifty ticks.
async fn assert_idle(harness: &Harness) {
    // The pass that wrote the last record is woken once more by its own echo.
    tokio::time::sleep(settings().ownership_tick * 10).await;
    let before = harness.passes();
    tokio::time::sleep(settings().ownership_tick * 50).await;
    assert_eq!(
        harness.passes(),
        before,
        "nothing changed, yet the ownership pass ran"
    );
}

#[tokio::test]
async fn an_idle_cluster_runs_no_ownership_pass() {
    let fake = claim_cluster::cluster();
    let harness = Harness::start(&fake).await;
    settled(
        &fake,
        &harness,
        &Model::default(),
        "every device the controller's",
    )
    .await;
    assert!(harness.passes() > 0, "the first pass runs at once");
    assert_idle(&harness).await;
    harness.stop().await;
}

#[tokio::test]
async fn every_kind_of_input_change_still_moves_devices_in_any_order() {
    for seed in [1, 2] {
        let fake = claim_cluster::cluster();
        let harness = Harness::start(&fake).await;
        let mut model = Model::default();
        settled(&fake, &harness, &model, "every device the controller's").await;
        let mut rng = SeededRng::new(seed);
        let mut pending = vec![
            (Input::PendingPod, true),
            (Input::SchedulerLabel, true),
            (Input::SchedulerClaim, true),
        ];
        while !pending.is_empty() {
            let (input, on) = pending.swap_remove(rng.below(pending.len()));
            if on {
                pending.push((input, false));
            }
            apply(&fake, input, on).await;
            model.set(input, on);
            let what = format!("seed {seed}: {input:?} {on} reached {model:?}");
            settled(&fake, &harness, &model, &what).await;
        }
        assert_idle(&harness).await;
        harness.stop().await;
    }
}
