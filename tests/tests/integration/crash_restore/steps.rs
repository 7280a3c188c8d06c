//! The plugin aborts (`--mock-crash-at`) right after each step of a prepare and of an
//! unprepare, as a SIGKILL there would stop it, and is started again on the same
//! directories. Whatever the step left, before the restarted plugin serves a claim has a
//! CDI spec exactly when its checkpoint entry is PrepareCompleted (no orphan spec, no
//! completed claim without one), the kubelet's retried call succeeds, and the unprepare
//! leaves neither spec nor entry. Dynamic MIG's own steps are in `dynamic_mig_crash`.

use kerf_proto::client::Claim;

use super::{
    Cluster, STARTED_IN, cdi_ids, defined_ids, prepare, register, spec_when_the_sockets_open,
};
use crate::common::{PluginProcess, uid};

const GIB: u64 = 1 << 30;

fn crash_at(step: &str) -> Vec<String> {
    vec![format!("--mock-crash-at={step}")]
}

/// A whole GPU, or an MPS slice when the step is the shared GPU's set-up.
fn claim_for(cluster: &Cluster, step: &str) -> Claim {
    if step == "after-sharing" {
        cluster.node.slice_claim("steps", &uid(1), 0, 10 * GIB, 50)
    } else {
        cluster.node.device_claim("steps", &uid(1), "gpu-0")
    }
}

/// Starts the plugin again and checks, as its sockets open, that the claim has a spec
/// exactly when its entry is complete.
async fn restart_consistent(
    cluster: &Cluster,
    claim: &Claim,
    step: &str,
    generation: u32,
) -> PluginProcess {
    let mut plugin = cluster.spawn_plugin(generation);
    let spec = spec_when_the_sockets_open(cluster, &mut plugin, claim).await;
    let entries = cluster.node.checkpoint_claims();
    let completed = entries
        .iter()
        .any(|(uid, state)| *uid == claim.uid && state == "PrepareCompleted");
    assert_eq!(
        spec.is_some(),
        completed,
        "{step}: spec {spec:?} against the entries {entries:?}; log:\n{}",
        plugin.log()
    );
    plugin
}

/// The retried prepare and the unprepare after it, on a consistent restarted plugin.
async fn retry_and_clean_up(cluster: &Cluster, claim: &Claim, step: &str, plugin: &PluginProcess) {
    let registered = register(cluster, plugin).await;
    let devices = prepare(&registered, claim, plugin).await;
    let spec = std::fs::read(cluster.spec_path(claim)).unwrap();
    assert_eq!(defined_ids(&spec), cdi_ids(&devices), "{step}");
    assert_eq!(
        cluster.node.checkpoint_claims(),
        [(claim.uid.clone(), "PrepareCompleted".to_owned())]
    );
    let unprepared = registered
        .unprepare(std::slice::from_ref(claim))
        .await
        .unwrap();
    assert_eq!(unprepared[&claim.uid], Ok(()), "{step}: {}", plugin.log());
    assert_eq!(cluster.node.cdi_files(), Vec::<String>::new(), "{step}");
    assert!(cluster.node.checkpoint_claims().is_empty(), "{step}");
}

async fn prepare_aborted_after(step: &str) {
    let cluster = Cluster::new().await;
    let claim = claim_for(&cluster, step);
    let mut first = cluster.spawn_with(1, &crash_at(step));
    let registered = register(&cluster, &first).await;
    let answer = registered.prepare(std::slice::from_ref(&claim)).await;
    assert!(
        answer.is_err(),
        "{step}: answered before aborting: {answer:?}"
    );
    first.wait_for_exit(STARTED_IN);
    drop(registered);

    let second = restart_consistent(&cluster, &claim, step, 2).await;
    retry_and_clean_up(&cluster, &claim, step, &second).await;
}

async fn unprepare_aborted_after(step: &str) {
    let cluster = Cluster::new().await;
    let claim = claim_for(&cluster, step);
    let mut first = cluster.spawn_plugin(1);
    let registered = register(&cluster, &first).await;
    prepare(&registered, &claim, &first).await;
    first.kill();
    drop(registered);

    let mut second = cluster.spawn_with(2, &crash_at(step));
    let registered = register(&cluster, &second).await;
    let answer = registered.unprepare(std::slice::from_ref(&claim)).await;
    assert!(
        answer.is_err(),
        "{step}: answered before aborting: {answer:?}"
    );
    second.wait_for_exit(STARTED_IN);
    drop(registered);

    let third = restart_consistent(&cluster, &claim, step, 3).await;
    retry_and_clean_up(&cluster, &claim, step, &third).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_in_memory_start_record() {
    prepare_aborted_after("after-start").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_shared_gpu_set_up() {
    prepare_aborted_after("after-sharing").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_spec_write() {
    prepare_aborted_after("after-spec-write").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_completed_entry_before_the_answer() {
    prepare_aborted_after("after-cdi-write").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_unprepare_removed_the_spec() {
    unprepare_aborted_after("after-spec-remove").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_after_the_unprepare_removed_the_entry() {
    unprepare_aborted_after("after-entry-remove").await;
}
