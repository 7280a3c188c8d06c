//! Dynamic MIG in mock mode, with the plugin as its own process: a claim allocated a
//! placement device (`gpu-0-mig-1g-5gb-0` of the `a100-40gb-dynmig` profile) gets a MIG
//! instance created at prepare and destroyed at unprepare, in the emulated driver state of
//! `kerf-fake-gpu-tools` (`<plugin dir>/mock-mig`, the default without a mock driver root).
//!
//! Crash safety: the plugin aborts (`--mock-crash-at`) right after each step of the prepare, as
//! a SIGKILL there would stop it; the restarted plugin must have undone the unfinished
//! instance before it serves (or kept it, when the prepare had completed), its retried
//! prepare must succeed with the same device and a MIG UUID, and the unprepare must leave the
//! GPU without instances.

use std::time::Duration;

use crate::common::{PluginProcess, uid};
use crate::crash_restore;
use kerf_fake_gpu_tools::mig::{GpuInstance, MockMig};
use kerf_proto::client::{Claim, RegisteredPlugin};
use serde_json::Value;

const STARTED_IN: Duration = Duration::from_secs(30);
const PLACEMENT: &str = "gpu-0-mig-1g-5gb-0";

/// A dynamic-MIG node with the API served over HTTP for plugin processes.
struct Cluster(crash_restore::Cluster);

impl std::ops::Deref for Cluster {
    type Target = crash_restore::Cluster;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Cluster {
    async fn new() -> Self {
        Cluster(crash_restore::Cluster::with_profile("a100-40gb-dynmig").await)
    }

    fn spawn(&self, generation: u32, crash_at: Option<&str>) -> PluginProcess {
        let extra: Vec<String> = crash_at
            .map(|step| format!("--mock-crash-at={step}"))
            .into_iter()
            .collect();
        self.spawn_with(generation, &extra)
    }

    async fn register(&self, plugin: &PluginProcess) -> RegisteredPlugin {
        plugin
            .register(&self.registration_socket(), STARTED_IN)
            .await
    }

    /// The emulated MIG instances of GPU 0.
    fn instances(&self) -> Vec<GpuInstance> {
        MockMig::open(&self.node.plugin_dir().join("mock-mig"))
            .unwrap()
            .list(0)
            .unwrap()
    }
}

async fn prepare(
    registered: &RegisteredPlugin,
    claim: &Claim,
    plugin: &PluginProcess,
) -> Result<Vec<kerf_proto::PreparedDevice>, String> {
    let mut answers = registered
        .prepare(std::slice::from_ref(claim))
        .await
        .map_err(|e| format!("{e}; log:\n{}", plugin.log()))?;
    answers.remove(&claim.uid).unwrap()
}

/// The `KERF_DEVICE_*_UUID` values of a claim's spec.
fn spec_uuids(spec: &Value) -> Vec<String> {
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["env"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|e| e.as_str().map(str::to_owned))
        .filter(|e| e.starts_with("KERF_DEVICE_") && e.contains("_UUID="))
        .map(|e| e.split_once('=').unwrap().1.to_owned())
        .collect()
}

/// Prepares a placement claim with the plugin aborting after `step`, restarts it, and checks
/// what the restarted plugin left, its retried prepare and the unprepare.
async fn crash_after(step: &str, kept: bool) {
    let cluster = Cluster::new().await;
    let claim = cluster.node.device_claim("mig", &uid(1), PLACEMENT);
    let mut first = cluster.spawn(1, Some(step));
    let registered = cluster.register(&first).await;
    let answer = prepare(&registered, &claim, &first).await;
    assert!(
        answer.is_err(),
        "the plugin answered before aborting at {step}"
    );
    first.wait_for_exit(STARTED_IN);
    drop(registered);
    let left = cluster.instances();
    assert_eq!(
        left.len(),
        1,
        "{step}: the GPU instance exists when the plugin dies"
    );
    assert_eq!(
        left[0].cis.len(),
        usize::from(step != "after-gi-create"),
        "{step}: compute instance"
    );

    let second = cluster.spawn(2, None);
    let registered = cluster.register(&second).await;
    let after_restart = cluster.instances();
    if kept {
        assert_eq!(
            after_restart, left,
            "the completed claim's instance is kept"
        );
    } else {
        assert!(
            after_restart.is_empty(),
            "{step}: the unfinished instance is destroyed before the plugin serves: {after_restart:?}; log:\n{}",
            second.log()
        );
    }

    let devices = prepare(&registered, &claim, &second).await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].device_name, PLACEMENT);
    let live = cluster.instances();
    assert_eq!(live.len(), 1, "one instance after the retried prepare");
    assert_eq!(
        (
            live[0].profile_id,
            live[0].placement.start,
            live[0].placement.size
        ),
        (19, 0, 1),
        "1g.5gb at slice 0"
    );
    let uuid = &live[0].cis[0].uuid;
    assert!(uuid.starts_with("MIG-"));
    assert_eq!(
        spec_uuids(&cluster.node.cdi_spec(&claim.uid)),
        std::slice::from_ref(uuid)
    );
    if kept {
        assert_eq!(live, left, "the kept instance serves the retried prepare");
    }
    let record = &cluster.node.checkpoint()["claims"][&claim.uid];
    assert_eq!(record["state"], "PrepareCompleted");
    assert_eq!(
        record["devices"][0]["migInstance"]["migUuid"],
        uuid.as_str()
    );

    let unprepared = registered
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(unprepared[&claim.uid], Ok(()), "log:\n{}", second.log());
    assert!(
        cluster.instances().is_empty(),
        "the unprepare destroyed the instance"
    );
    assert!(cluster.node.checkpoint_claims().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_the_gpu_instance_create_leaves_no_orphan() {
    crash_after("after-gi-create", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_create_and_checkpoint_leaves_no_orphan() {
    crash_after("after-ci-create", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_checkpoint_and_cdi_write_leaves_no_orphan() {
    crash_after("after-record", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_after_the_cdi_write_keeps_the_prepared_instance() {
    crash_after("after-cdi-write", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_placements_on_one_gpu_an_overlap_refused_and_unprepare_destroys() {
    let cluster = Cluster::new().await;
    let small = cluster.node.device_claim("small", &uid(1), PLACEMENT);
    let large = cluster
        .node
        .device_claim("large", &uid(2), "gpu-0-mig-3g-20gb-4");
    let overlapping = cluster
        .node
        .device_claim("overlapping", &uid(3), "gpu-0-mig-2g-10gb-0");
    let plugin = cluster.spawn(1, None);
    let registered = cluster.register(&plugin).await;
    let a = prepare(&registered, &small, &plugin).await.unwrap();
    let b = prepare(&registered, &large, &plugin).await.unwrap();
    assert_eq!(
        (a[0].device_name.as_str(), b[0].device_name.as_str()),
        (PLACEMENT, "gpu-0-mig-3g-20gb-4")
    );
    let live = cluster.instances();
    let placements: Vec<(u32, u32)> = live
        .iter()
        .map(|gi| (gi.placement.start, gi.placement.size))
        .collect();
    assert_eq!(placements, [(0, 1), (4, 4)]);
    assert_ne!(live[0].cis[0].uuid, live[1].cis[0].uuid);

    let refused = prepare(&registered, &overlapping, &plugin)
        .await
        .unwrap_err();
    assert!(
        refused.contains("gpu-0-mig-2g-10gb-0") && refused.contains("small"),
        "the error names the device and the claim holding its memory slices: {refused}"
    );
    assert_eq!(
        cluster.instances(),
        live,
        "the refused prepare created nothing"
    );

    let unprepared = registered.unprepare(&[small, large]).await.unwrap();
    assert!(unprepared.values().all(Result::is_ok), "{unprepared:?}");
    assert!(cluster.instances().is_empty());
    // The refused claim left no entry, so nothing was prepared for it.
    assert!(cluster.node.checkpoint_claims().is_empty());
}
